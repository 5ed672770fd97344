"""Images to quality on real digits: the paper's recipe (eps, L_simple) against v-prediction,
Min-SNR-gamma weighting and both, same seeds and images, several seeds each. Each run is
train.py on --dataset digits with the digits score every --eval-every images; the report gives
the score against images seen (mean and spread over seeds), the images each setting needs to
reach the score the paper's recipe ends at (as a ratio to the recipe's, with its spread), and
whether the final scores differ by more than the seeds do.

    OMP_NUM_THREADS=1 python scripts/prediction_study.py --out-dir results --workers 2   # 4 settings x 3 seeds
    python scripts/prediction_study.py --images 12000 --seeds 1 --eval-every 4000 --out-dir /tmp/s  # a smoke run

Runs go to RUNS_DIR/<setting>-seed<k>/; a finished run is not trained again, so a stopped study
continues where it stopped. The report: OUT_DIR/STEM.{json,md,png}.
"""
import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from cli import format_or_na, markdown_table, provenance, pyplot, save_figure, write_report  # noqa: E402

SETTINGS = {  # name -> train.py flags
    'paper (eps, uniform)': [],
    'v-prediction': ['--prediction', 'v'],
    'min-snr-5 (eps)': ['--loss-weight', 'min-snr', '--snr-gamma', '5'],
    'v + min-snr-5': ['--prediction', 'v', '--loss-weight', 'min-snr', '--snr-gamma', '5'],
}
SCORE = 'digits_fd'


def slug(name: str) -> str:
    return ''.join(c if c.isalnum() else '-' for c in name).strip('-').replace('--', '-')


def run_once(name: str, seed: int, args) -> list:
    """The eval rows of one run (trained now unless its folder already holds the finished run)."""
    folder = os.path.join(args.runs_dir, f'{slug(name)}-seed{seed}')
    steps = args.images // args.batch_size
    flags = ['--dataset', 'digits', '--preset', 'tiny', '--image-size', str(args.image_size), '--device', 'cpu',
             '--batch-size', str(args.batch_size), '--steps', str(steps), '--seed', str(seed),
             '--eval-every', str(args.eval_every), '--eval-samples', str(args.eval_samples), '--eval-bpd-images', '50',
             '--eval-bpd-timesteps', '4', '--sampler', 'dpm++', '--sample-steps', '20', '--sample-every', '0',
             '--log-every', '100', '--ckpt-every', '1000', '--out-dir', folder, '--data-dir', args.data_dir,
             '--resume', 'auto', *SETTINGS[name]]
    if train.cli(flags) != 0:
        raise SystemExit(f'{name}, seed {seed}: train.py failed (see above)')
    with open(os.path.join(folder, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = {r['images_seen']: r for r in rows if r.get('kind') == 'eval'}  # the last of each, after resumes
    heldout = {r['images_seen']: r.get('heldout_loss_ema') for r in rows if r.get('kind') == 'train'}
    return [{'images': n, 'score': evals[n][SCORE], 'heldout_loss_ema': heldout.get(n), 'kid': evals[n]['digits_kid'],
             'confident': evals[n]['digits_confident']} for n in sorted(evals)]


def images_to_reach(curve: list, target: float):
    """The first image count at which the score falls to `target`, interpolated in log images and
    log score between the evaluations on either side; None if it never does."""
    previous = None
    for point in curve:
        if point['score'] <= target:
            if previous is None:
                return point['images']
            share = math.log(previous['score'] / target) / math.log(previous['score'] / point['score'])
            return math.exp(math.log(previous['images']) + share * math.log(point['images'] / previous['images']))
        previous = point
    return None


def summarise(curves: dict) -> dict:
    """Per setting: final scores (mean, sd over seeds), images to reach the recipe's final mean score
    (per seed, mean, sd) and the ratio to the recipe's, with whether the final scores differ by more
    than twice their standard error."""
    paper = 'paper (eps, uniform)'
    finals = {name: [c[-1]['score'] for c in runs] for name, runs in curves.items()}
    target = statistics.mean(finals[paper])
    out = {'target': target, 'settings': {}}
    paper_images = [images_to_reach(c, target) for c in curves[paper]]
    for name, runs in curves.items():
        reach = [images_to_reach(c, target) for c in runs]
        reached = [r for r in reach if r is not None]
        sd = lambda v: statistics.stdev(v) if len(v) > 1 else None  # noqa: E731
        stderr = math.sqrt(sum((sd(v) or 0) ** 2 / len(v) for v in (finals[name], finals[paper])))
        ratios = [r / p for r, p in zip(reach, paper_images) if r is not None and p is not None]
        out['settings'][name] = {
            'final_mean': statistics.mean(finals[name]), 'final_sd': sd(finals[name]), 'finals': finals[name],
            'images_to_target': reach, 'reached': f'{len(reached)} of {len(reach)}',
            'images_mean': statistics.mean(reached) if reached else None, 'images_sd': sd(reached),
            'ratio_to_paper_mean': statistics.mean(ratios) if ratios else None, 'ratio_sd': sd(ratios),
            'final_difference': statistics.mean(finals[name]) - target,
            'exceeds_seed_noise': abs(statistics.mean(finals[name]) - target) > 2 * stderr if stderr else None}
    return out


def report(curves: dict, summary: dict, args):
    """The table (JSON and Markdown, through cli.write_report) and the curves' plot."""
    table = markdown_table(
        ['Setting', 'final score, mean', 'sd over seeds', 'images to the target, mean', 'sd',
         'x the recipe\'s images (mean of per-seed ratios)', 'sd', 'reached', 'final differs beyond seed noise'],
        [[name, f"{s['final_mean']:.2f}"] + [format_or_na(s[key], spec) for key, spec in (
            ('final_sd', '.2f'), ('images_mean', ',.0f'), ('images_sd', ',.0f'), ('ratio_to_paper_mean', '.2f'),
            ('ratio_sd', '.2f'))] + [s['reached'], s['exceeds_seed_noise']]
         for name, s in summary['settings'].items()])
    png = write_report(args.out_dir, args.stem, {**summary, 'curves': curves},
                       'Images to quality on digits: v-prediction and Min-SNR against the paper\'s recipe', table,
                       notes=f"; tiny preset, {args.image_size}x{args.image_size}, batch {args.batch_size}, "
                             f"{args.images:,} training images per run, seeds 0 to {args.seeds - 1}; the digits score "
                             f"(FD in digit-classifier features, {args.eval_samples} EMA samples of DPM-Solver++ at 20 "
                             f"calls; floor about 7 at 450) every {args.eval_every:,} images. Target: the "
                             f"recipe's mean final score, {summary['target']:.2f}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (name, runs), colour in zip(curves.items(), ('black', 'tab:blue', 'tab:orange', 'tab:green')):
        images = [p['images'] for p in runs[0]]
        scores = [[run[i]['score'] for run in runs] for i in range(len(images))]
        mean = [statistics.mean(s) for s in scores]
        ax.plot(images, mean, 'o-', color=colour, label=name, markersize=3)
        if len(runs) > 1:
            ax.fill_between(images, [min(s) for s in scores], [max(s) for s in scores], color=colour, alpha=0.15)
    ax.axhline(summary['target'], color='gray', linestyle=':', label='the recipe\'s final score')
    ax.set_yscale('log')
    ax.set_xlabel('training images seen')
    ax.set_ylabel('digits FD (classifier features; lower is better)')
    ax.set_title(f'mean over {args.seeds} seeds (band: min to max); {summary["device"]}', fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which='both')
    save_figure(fig, png, dpi=110)
    print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--images', type=int, default=120_000, help='training images per run (default 120000)')
    parser.add_argument('--eval-every', type=int, default=15_000, help='images between scores (default 15000)')
    parser.add_argument('--seeds', type=int, default=3, help='seeds per setting (default 3)')
    parser.add_argument('--eval-samples', type=int, default=450, help='samples per score (default 450, the size of '
                                                                         'the held-out digits that set its floor)')
    parser.add_argument('--batch-size', type=int, default=32, help='batch size (default 32)')
    parser.add_argument('--image-size', type=int, default=16, help='digit resolution (default 16)')
    parser.add_argument('--runs-dir', default='runs/prediction-study', help='where the runs go')
    parser.add_argument('--data-dir', default='./data', help='where the digit classifier is cached')
    parser.add_argument('--out-dir', default='results', help='where the report goes')
    parser.add_argument('--stem', default='cpu-digits-prediction-study', help='report file name stem')
    parser.add_argument('--workers', type=int, default=1, help='runs trained at once, each in its own process (set '
                                                               'OMP_NUM_THREADS=1 then; default 1)')
    args = parser.parse_args(argv)
    if args.images < args.eval_every or args.seeds < 1 or args.images < args.batch_size or args.workers < 1:
        parser.error('--images must be at least --eval-every and --batch-size, --seeds and --workers at least 1')
    jobs = [(name, seed, args) for name in SETTINGS for seed in range(args.seeds)]
    if args.workers > 1:  # the runs are independent: what decides each is its own flags and seed
        import multiprocessing
        with multiprocessing.get_context('spawn').Pool(args.workers) as pool:
            done = pool.starmap(run_once, jobs)
    else:
        done = [run_once(*job) for job in jobs]
    curves = {name: [curve for (job_name, _, _), curve in zip(jobs, done) if job_name == name] for name in SETTINGS}
    report(curves, {**provenance(f'CPU ({os.cpu_count()} cores)'), **summarise(curves)}, args)
    return 0


if __name__ == '__main__':
    sys.exit(main())

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
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from cli import ConfigError, check_plain_name, check_ranges, flag, parse_config, run_main  # noqa: E402
from devices import device_name  # noqa: E402
from files import atomic_open, check_creatable, check_writable  # noqa: E402
from reports import format_or_na, markdown_table, provenance, pyplot, save_figure, write_report  # noqa: E402


@dataclass
class StudyConfig:
    images: int = flag(120_000, 'training images per run', at_least=1)
    eval_every: int = flag(15_000, 'images between scores', at_least=1)
    seeds: int = flag(3, 'seeds per setting', at_least=1)
    eval_samples: int = flag(450, 'samples per score (450: the size of the held-out digits that set its floor)',
                             at_least=2)
    batch_size: int = flag(32, 'batch size', at_least=1)
    image_size: int = flag(16, 'digit resolution', at_least=4)
    runs_dir: str = flag('runs/prediction-study', 'where the runs go')
    data_dir: str = flag('./data', 'where the digit classifier is cached')
    out_dir: str = flag('results', 'where the report goes')
    stem: str = flag('cpu-digits-prediction-study', 'report file name stem')
    workers: int = flag(1, 'runs trained at once, each in its own process (set OMP_NUM_THREADS=1 then)', at_least=1)


SETTINGS = {  # name -> train.py flags
    'paper (eps, uniform)': [],
    'v-prediction': ['--prediction', 'v'],
    'min-snr-5 (eps)': ['--loss-weight', 'min-snr', '--snr-gamma', '5'],
    'v + min-snr-5': ['--prediction', 'v', '--loss-weight', 'min-snr', '--snr-gamma', '5'],
}
SCORE = 'digits_fd'


def slug(name: str) -> str:
    return '-'.join(''.join(c if c.isalnum() else ' ' for c in name).split())  # 'v + min-snr-5' -> 'v-min-snr-5'


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
    logged = sorted((r['images_seen'], r['heldout_loss_ema']) for r in rows  # a stop's row holds no held-out loss
                    if r.get('kind') == 'train' and r.get('heldout_loss_ema') is not None)

    def heldout_at(n):  # the last held-out loss logged at or before an evaluation (rows every --log-every)
        return next((loss for seen, loss in reversed(logged) if seen <= n), None)
    return [{'images': n, 'score': evals[n][SCORE], 'heldout_loss_ema': heldout_at(n), 'kid': evals[n]['digits_kid'],
             'confident': evals[n]['digits_confident'], 'train_minutes': 60 * evals[n]['train_hours']}
            for n in sorted(evals)]


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
    """Per setting: final scores (mean, sd over seeds) and whether they differ from the recipe's by
    more than twice their standard error; then, for two targets (the recipe's mean final score and
    its mean score at the evaluation nearest half the run), the images each seed needs to reach it
    and the ratio to the recipe's images at the same seed (mean, sd over seeds where both reach it)."""
    paper = 'paper (eps, uniform)'
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else None  # noqa: E731
    finals = {name: [c[-1]['score'] for c in runs] for name, runs in curves.items()}
    halfway = min(range(len(curves[paper][0])), key=lambda i: abs(2 * curves[paper][0][i]['images'] -
                                                                  curves[paper][0][-1]['images']))
    targets = {'final': statistics.mean(finals[paper]),
               'halfway': statistics.mean(c[halfway]['score'] for c in curves[paper])}
    paper_reach = {key: [images_to_reach(c, target) for c in curves[paper]] for key, target in targets.items()}
    out = {'targets': targets, 'halfway_images': curves[paper][0][halfway]['images'], 'settings': {}}
    for name, runs in curves.items():
        stderr = math.sqrt(sum((sd(v) or 0) ** 2 / len(v) for v in (finals[name], finals[paper])))
        difference = statistics.mean(finals[name]) - targets['final']
        out['settings'][name] = {
            'final_mean': statistics.mean(finals[name]), 'final_sd': sd(finals[name]), 'finals': finals[name],
            'final_difference': difference, 'exceeds_seed_noise': abs(difference) > 2 * stderr if stderr else None,
            'reach': {key: reach_summary([images_to_reach(c, target) for c in runs], paper_reach[key], sd)
                      for key, target in targets.items()}}
    return out


def reach_summary(reach: list, paper_reach: list, sd) -> dict:
    """The images each seed needs to reach a target (None: never), and their ratio to the recipe's
    images at the same seed, over the seeds where both reach it."""
    reached = [r for r in reach if r is not None]
    ratios = [r / p for r, p in zip(reach, paper_reach) if r is not None and p is not None]
    return {'images': reach, 'reached': f'{len(reached)} of {len(reach)}',
            'images_mean': statistics.mean(reached) if reached else None, 'images_sd': sd(reached),
            'ratio_mean': statistics.mean(ratios) if ratios else None, 'ratio_sd': sd(ratios), 'ratios': len(ratios)}


def report(curves: dict, summary: dict, args):
    """The table (JSON and Markdown, through reports.write_report) and the curves' plot."""
    def reach(r):  # images (seeds that reach the target), ratio to the recipe's at the same seed
        return [f"{format_or_na(r['images_mean'], ',.0f')} ({r['reached']})",
                f"{format_or_na(r['ratio_mean'], '.2f')} +- {format_or_na(r['ratio_sd'], '.2f')} (n={r['ratios']})"]
    targets = summary['targets']
    table = markdown_table(
        ['Setting', 'final score, mean +- sd over seeds', 'final differs beyond seed noise',
         f"images to {targets['final']:.1f} (the recipe's final), mean (seeds that reach it)",
         'x the recipe\'s images, per-seed ratio mean +- sd',
         f"images to {targets['halfway']:.1f} (the recipe's at {summary['halfway_images']:,}), mean (seeds)",
         'x the recipe\'s images, per-seed ratio mean +- sd'],
        [[name, f"{s['final_mean']:.2f} +- {format_or_na(s['final_sd'], '.2f')}",
          {True: 'yes', False: 'no'}.get(s['exceeds_seed_noise'], 'n/a (one seed)'),
          *reach(s['reach']['final']), *reach(s['reach']['halfway'])] for name, s in summary['settings'].items()])
    png = write_report(args.out_dir, args.stem, {**summary, 'curves': curves},
                       'Images to quality on digits: v-prediction and Min-SNR against the paper\'s recipe', table,
                       notes=f"; tiny preset, {args.image_size}x{args.image_size}, batch {args.batch_size}, "
                             f"{args.images:,} training images per run, seeds 0 to {args.seeds - 1}; the digits score "
                             f"(FD in digit-classifier features, {args.eval_samples} EMA samples of DPM-Solver++ at 20 "
                             f"calls; floor about 7 at 450) every {args.eval_every:,} images. Targets: the "
                             f"recipe's mean score at the end and half-way; ratios pair runs of the same seed")
    fig, axes = pyplot().subplots(1, 2, figsize=(13, 4.5))
    for ax, key, label in ((axes[0], 'score', 'digits FD (classifier features; lower is better)'),
                           (axes[1], 'heldout_loss_ema', 'held-out loss of the EMA (eps MSE)')):
        for (name, runs), colour in zip(curves.items(), ('black', 'tab:blue', 'tab:orange', 'tab:green')):
            images = [p['images'] for p in runs[0]]
            values = [[run[i][key] for run in runs] for i in range(len(images))]
            if any(v is None for point in values for v in point):
                continue
            ax.plot(images, [statistics.mean(v) for v in values], 'o-', color=colour, label=name, markersize=3)
            if len(runs) > 1:
                ax.fill_between(images, [min(v) for v in values], [max(v) for v in values], color=colour, alpha=0.15)
        ax.set(yscale='log', xlabel='training images seen', ylabel=label)
        ax.grid(alpha=0.3, which='both')
    axes[0].axhline(summary['targets']['final'], color='gray', linestyle=':', label='the recipe\'s final score')
    axes[0].legend(fontsize=8)
    fig.suptitle(f'mean over {args.seeds} seeds (band: min to max); {summary["device"]}', fontsize=9)
    save_figure(fig, png, dpi=110)
    print(table)


def main(argv=None) -> int:
    return run_main(study, parse_config(argv, StudyConfig, __doc__))


def study(args: StudyConfig):
    """Every run (reused where its folder holds it: the runs folder records what decides them, and
    a study of other settings into it is refused), then the report."""
    check_ranges(args)
    check_plain_name(args.stem, '--stem')
    if args.images < max(args.eval_every, args.batch_size):
        raise ConfigError('--images must be at least --eval-every and --batch-size')
    folders = ((args.runs_dir, '--runs-dir'), (args.data_dir, '--data-dir'), (args.out_dir, '--out-dir'))
    for check in (check_creatable, check_writable):  # all three checked before any is made
        for folder, name in folders:
            check(folder, name)
    decides = {k: getattr(args, k) for k in ('images', 'eval_every', 'eval_samples', 'batch_size', 'image_size')}
    manifest = os.path.join(args.runs_dir, 'study.json')
    if os.path.isfile(manifest):
        with open(manifest) as f:
            saved = json.load(f)
        if saved != decides:
            raise ConfigError(f'--runs-dir {args.runs_dir} holds runs of other settings ({saved}): pass another one')
    elif os.listdir(args.runs_dir):
        raise ConfigError(f'--runs-dir {args.runs_dir} holds files but no study.json (what its runs were made with): '
                          f'pass a new or empty folder')
    with atomic_open(manifest) as f:
        json.dump(decides, f)
    jobs = [(name, seed, args) for name in SETTINGS for seed in range(args.seeds)]
    if args.workers > 1:  # the runs are independent: what decides each is its own flags and seed
        import multiprocessing
        with multiprocessing.get_context('spawn').Pool(args.workers) as pool:
            done = pool.starmap(run_once, jobs)
    else:
        done = [run_once(*job) for job in jobs]
    curves = {name: [curve for (job_name, _, _), curve in zip(jobs, done) if job_name == name] for name in SETTINGS}
    report(curves, {**provenance(device_name(torch.device('cpu'))), 'config': asdict(args), **summarise(curves)},
           args)


if __name__ == '__main__':
    sys.exit(main())

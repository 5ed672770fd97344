"""Does the digits score measure what it names? Its floor (held-out real digits), and the scores of
noise, pixel-shuffled digits, sets collapsed to one or two classes, mirrored digits (what random
horizontal flips in training would cost), and blur of growing width, each the size of the held-out
split; written to OUT_DIR/digits-score-SIZE.{json,md}.

With --ckpt (one or more checkpoints, comma-separated): the score's own noise. Each checkpoint's EMA
draws one pool of --pool samples (DPM-Solver++ at --sample-steps calls, as train.py's evaluations
draw them); the pool is cut into disjoint sets of 450, 1,000 and 2,000 samples (independent draws
of the same model), each set scored, and the spread of the scores across sets reported for the
plain FD and the class FD, and for the mean of 3 sets of 450 (what an evaluation reports). Written
to OUT_DIR/STEM.{json,md} after each checkpoint; a stop (SIGTERM, Ctrl-C) ends it after the
checkpoint under way, the report holding those done.

    python scripts/digits_score.py [--image-size 16] [--data-dir ./data] [--out-dir results]
    python scripts/digits_score.py --ckpt early.pt,demo.pt,long.pt --pool 12000 --sample-steps 10
"""
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torchvision.transforms.functional import gaussian_blur

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import evaluation  # noqa: E402
import sample  # noqa: E402
from cli import ConfigError, StopFlag, check_plain_name, check_ranges, flag, parse_config, run_main  # noqa: E402
from devices import device_name  # noqa: E402
from drawing import Sampling, draw  # noqa: E402
from files import check_creatable, check_writable  # noqa: E402
from reports import markdown_table, provenance, write_report  # noqa: E402


@dataclass
class ScoreCheckConfig:
    image_size: int = flag(16, 'resolution of the digits (the blur is up to 9 pixels wide)', at_least=8, at_most=256)
    data_dir: str = flag('./data', 'where the classifier is cached')
    out_dir: str = flag('runs/digits-score', 'where the JSON and Markdown go (results/ only when named: '
                                             'a run never replaces the committed evidence by default)')
    ckpt: str = flag('', 'digits checkpoints, comma-separated: measure the score\'s noise on their EMA samples '
                         'instead')
    pool: int | None = flag(None, 'samples drawn from each --ckpt and cut into disjoint sets (default 12000)',
                            at_least=4000, at_most=1_000_000)
    sample_steps: int | None = flag(None, 'DPM-Solver++ calls of --ckpt\'s samples (default 10, the demo\'s '
                                          'evaluations)', at_least=1, at_most=1000)
    stem: str = flag('', 'report name with --ckpt (default digits-score-SIZE-noise-CALLS)')


SIZES = (450, 1000, 2000)  # samples per set: the evaluations' size (the floor's) and two larger
AVERAGED = 3  # sets of 450 averaged, as train.py's digits evaluations do (--eval-draws)
SCORES = {'digits_class_fd': 'class FD (the score)', 'digits_fd': 'FD (plain)'}


def damaged_sets(size: int) -> list:
    """(name, uint8 (N, 1, S, S)) for every case, N = 450 (the held-out split) where it can be."""
    held, _ = data.load_digits_split(size, heldout=True)
    train, labels = data.load_digits_split(size, heldout=False)
    generator = torch.Generator().manual_seed(0)
    cases = [('held-out digits (the floor)', held),
             ('training digits (450 of them)', train[torch.randperm(len(train), generator=generator)[:len(held)]])]
    cases.append(('uniform noise', torch.randint(0, 256, held.shape, dtype=torch.uint8, generator=generator)))
    pixels = size * size
    cases.append(('held-out digits, pixels shuffled', torch.stack(
        [image.flatten()[torch.randperm(pixels, generator=generator)].view(1, size, size) for image in held])))
    two = train[(labels == 1) | (labels == 7)]
    cases.append((f'only 1s and 7s ({len(two)})', two))
    cases.append((f'training digits, balanced ({len(two)})', train[:len(two)]))
    cases.append((f'only 3s ({int((labels == 3).sum())})', train[labels == 3]))
    for k in range(5):  # what a sampler that draws a horizontally flipping loader's data perfectly would score
        mirrored = torch.rand(len(held), generator=generator) < 0.5
        cases.append((f'held-out digits, a random half mirrored (draw {k + 1} of 5)',
                      torch.where(mirrored[:, None, None, None], held.flip(-1), held)))
    cases.append(('held-out digits, all mirrored', held.flip(-1)))
    for sigma in (0.5, 1.0, 1.5, 2.0, 3.0):
        blurred = gaussian_blur(held.float(), kernel_size=9, sigma=sigma).round().clamp(0, 255).to(torch.uint8)
        cases.append((f'held-out digits, Gaussian blur sigma {sigma}', blurred))
    return cases


def main(argv=None) -> int:
    return run_main(check_the_score, parse_config(argv, ScoreCheckConfig, __doc__))


def check_the_score(args: ScoreCheckConfig):
    check_ranges(args)
    for name in ('pool', 'sample_steps', 'stem'):
        if getattr(args, name) and not args.ckpt:
            raise ConfigError(f'--{name.replace("_", "-")} {getattr(args, name)} measures checkpoints: pass --ckpt, or '
                              f'leave it out')
    if args.stem:
        check_plain_name(args.stem, '--stem')
    paths = [p for p in args.ckpt.split(',') if p]
    check_creatable(args.out_dir, '--out-dir')  # created once the classifier (cached in --data-dir) is there
    models = [sample.load_model(p, 'ema', torch.device('cpu'), named_as=f'--ckpt {p}') for p in paths]
    for path, (_, config, _, _) in zip(paths, models):
        if (config.in_channels, config.image_size) != (1, args.image_size):
            raise ConfigError(f'--ckpt {path}: not a digits model at {args.image_size}x{args.image_size}')
    judge = evaluation.DigitsJudge(args.image_size, args.data_dir)
    check_writable(args.out_dir, '--out-dir')
    if models:
        return noise_table(args, judge, list(zip(paths, models)))
    rows = []
    for name, images in damaged_sets(args.image_size):
        rows.append({'set': name, **judge.score(judge.features(images))})
        print(f"{name}: class FD {rows[-1]['digits_class_fd']:.1f}, FD {rows[-1]['digits_fd']:.2f}", flush=True)
    result = {**provenance(device_name(torch.device('cpu'))), 'config': asdict(args), 'image_size': args.image_size,
              'classifier_accuracy': judge.accuracy, 'rows': rows}
    table = markdown_table(['Set', 'N', 'class FD (the score)', 'FD', 'KID', 'KID std', 'confident',
                            'label entropy (bits)'], [
        [r['set'], r['digits_samples'], f"{r['digits_class_fd']:.1f}", f"{r['digits_fd']:.2f}",
         f"{r['digits_kid']:.1f}", f"{r['digits_kid_std']:.1f}", f"{r['digits_confident']:.1%}",
         f"{r['digits_class_entropy']:.2f}"] for r in rows])
    write_report(args.out_dir, f'digits-score-{args.image_size}', result,
                 f'The digits score on real, damaged and collapsed sets ({args.image_size}x{args.image_size})', table,
                 notes=f'; classifier held-out accuracy {judge.accuracy:.4f}; each set against the training split\'s '
                       f'statistics')
    print(table)


def spread(name: str, scores: list) -> dict:
    return {'score': name, 'sets': len(scores), 'mean': statistics.mean(scores), 'sd': statistics.stdev(scores),
            'relative_sd': statistics.stdev(scores) / statistics.mean(scores), 'min': min(scores), 'max': max(scores)}


def pool_rows(judge, features: np.ndarray) -> list:
    """The spread of each score across disjoint sets of each size cut from one pool of features (in a
    fixed shuffled order), and of the mean of AVERAGED sets of 450."""
    features = features[np.random.RandomState(0).permutation(len(features))]
    rows = []
    for size in SIZES:
        sets = [judge.score(features[i * size:(i + 1) * size], kid=False) for i in range(len(features) // size)]
        if len(sets) < 2:
            continue
        for key, name in SCORES.items():
            rows.append({'samples': size, 'averaged': 1, **spread(name, [s[key] for s in sets])})
            if size == SIZES[0] and len(sets) >= 2 * AVERAGED:
                means = [statistics.mean(s[key] for s in sets[i:i + AVERAGED])
                         for i in range(0, len(sets) - AVERAGED + 1, AVERAGED)]
                rows.append({'samples': size, 'averaged': AVERAGED, **spread(name, means)})
    return rows


def noise_table(args: ScoreCheckConfig, judge, models: list):
    """Each checkpoint's pool drawn, cut and scored (pool_rows); the report rewritten after each."""
    pool, steps = args.pool or 12000, args.sample_steps or 10
    stem = args.stem or f'digits-score-{args.image_size}-noise-{steps}'
    done, stop = [], StopFlag()
    restore = stop.install()
    try:
        for path, (model, config, sched, prediction) in models:
            start = time.perf_counter()
            sampling = Sampling(num=pool, batch_size=500, sampler='dpm++', steps=steps, seed=0)
            images = torch.cat(list(draw(model, config, sched, sampling, torch.device('cpu'), progress=False,
                                         prediction=prediction)))
            seconds = time.perf_counter() - start
            features = judge.features(images)
            whole = judge.score(features, kid=False)
            done.append({'ckpt': path, 'images_trained': images_trained(path), 'pool': pool,
                         'draw_seconds': seconds, 'confident': whole['digits_confident'],
                         'rows': pool_rows(judge, features)})
            print(f"{path}: {pool} samples in {seconds:.0f} s", flush=True)
            write_noise(args, stem, done, len(models), stop.reason, judge, steps)
            if stop.reason:
                print(f'stopped by {stop.reason} after {len(done)} of {len(models)} checkpoints: the report holds '
                      f'them', flush=True)
                break
    finally:
        restore()


def images_trained(path: str):
    """Training images a train.py checkpoint has seen (None for other files)."""
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=False)
        return ckpt['step'] * ckpt['config']['batch_size']
    except Exception:  # a diffusers folder, or a stand-in in the tests: the table shows no count
        return None


def write_noise(args: ScoreCheckConfig, stem: str, done: list, planned: int, stopped, judge, steps: int):
    result = {**provenance(device_name(torch.device('cpu'))), 'config': asdict(args), 'sample_steps': steps,
              'floor': {k: judge.floor[k] for k in SCORES}, 'checkpoints': done, 'planned': planned,
              'complete': len(done) == planned, 'stopped': stopped}
    table = markdown_table(
        ['checkpoint', 'images trained', 'samples per score', 'sets averaged', 'score', 'scores', 'mean',
         'sd across draws', 'sd / mean', 'range'],
        [[os.path.basename(d['ckpt']), '-' if d['images_trained'] is None else f"{d['images_trained']:,}",
          r['samples'], r['averaged'], r['score'], r['sets'], f"{r['mean']:.2f}", f"{r['sd']:.2f}",
          f"{r['relative_sd']:.1%}", f"{r['min']:.2f}-{r['max']:.2f}"] for d in done for r in d['rows']])
    write_report(args.out_dir, stem, result, 'The digits score\'s own noise: one model, many draws', table,
                 notes=f"; per checkpoint one pool of {done[0]['pool']:,} EMA samples, DPM-Solver++ at {steps} calls "
                       f"(seed 0, batch 500), cut into disjoint sets; floors (the 450 held-out digits): class FD "
                       f"{judge.floor['digits_class_fd']:.2f}, FD {judge.floor['digits_fd']:.2f}"
                       + ('' if result['complete'] else f"; {len(done)} of {planned} checkpoints (unfinished)"))
    if result['complete'] or stopped:
        print(table)


if __name__ == '__main__':
    sys.exit(main())

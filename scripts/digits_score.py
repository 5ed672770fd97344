"""Does the digits score measure what it names? Its floor (held-out real digits), and the scores of
noise, pixel-shuffled digits, sets collapsed to one or two classes, mirrored digits (what random
horizontal flips in training would cost), and blur of growing width, each the size of the held-out
split; written to OUT_DIR/digits-score-SIZE.{json,md}. With --ckpt: the score's own noise, the
scores of one checkpoint's EMA samples drawn with --resamples sampling seeds (as train.py's evaluation
draws them: 450 samples, DPM-Solver++ at 20 calls, batch 32), to OUT_DIR/digits-score-SIZE-resampled.*.

    python scripts/digits_score.py [--image-size 16] [--data-dir ./data] [--out-dir results]
    python scripts/digits_score.py --ckpt runs/ckpt.pt --resamples 10
"""
import os
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
from torchvision.transforms.functional import gaussian_blur

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import evaluation  # noqa: E402
import sample  # noqa: E402
from cli import ConfigError, StopFlag, check_ranges, flag, parse_config, run_main  # noqa: E402
from devices import device_name  # noqa: E402
from drawing import Sampling, draw  # noqa: E402
from files import check_creatable, check_writable  # noqa: E402
from reports import markdown_table, provenance, write_report  # noqa: E402


@dataclass
class ScoreCheckConfig:
    image_size: int = flag(16, 'resolution of the digits (the blur is up to 9 pixels wide)', at_least=8, at_most=256)
    data_dir: str = flag('./data', 'where the classifier is cached')
    out_dir: str = flag('results', 'where the JSON and Markdown go')
    ckpt: str = flag('', 'a digits checkpoint: score its EMA samples under --resamples sampling seeds instead')
    resamples: int | None = flag(None, 'sampling seeds of --ckpt (0, 1, ...; default 10); the report is rewritten '
                                       'after each, and a stop (SIGTERM, Ctrl-C) ends it after the seed under way',
                                 at_least=2, at_most=1000)


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
    if args.resamples is not None and not args.ckpt:
        raise ConfigError(f'--resamples {args.resamples} resamples a checkpoint: pass --ckpt, or leave --resamples out')
    check_creatable(args.out_dir, '--out-dir')  # created once the classifier (cached in --data-dir) is there
    loaded = sample.load_model(args.ckpt, 'ema', torch.device('cpu')) if args.ckpt else None
    if loaded and (loaded[1].in_channels, loaded[1].image_size) != (1, args.image_size):
        raise ConfigError(f'--ckpt {args.ckpt}: not a digits model at {args.image_size}x{args.image_size}')
    judge = evaluation.DigitsJudge(args.image_size, args.data_dir)
    check_writable(args.out_dir, '--out-dir')
    if loaded:
        return resampled(args, judge, loaded)
    rows = []
    for name, images in damaged_sets(args.image_size):
        rows.append({'set': name, **judge.score(judge.features(images))})
        print(f"{name}: FD {rows[-1]['digits_fd']:.2f}", flush=True)
    result = {**provenance(device_name(torch.device('cpu'))), 'config': asdict(args), 'image_size': args.image_size,
              'classifier_accuracy': judge.accuracy, 'rows': rows}
    table = markdown_table(['Set', 'N', 'FD', 'KID', 'KID std', 'confident', 'label entropy (bits)'], [
        [r['set'], r['digits_samples'], f"{r['digits_fd']:.2f}", f"{r['digits_kid']:.1f}", f"{r['digits_kid_std']:.1f}",
         f"{r['digits_confident']:.1%}", f"{r['digits_class_entropy']:.2f}"] for r in rows])
    write_report(args.out_dir, f'digits-score-{args.image_size}', result,
                 f'The digits score on real, damaged and collapsed sets ({args.image_size}x{args.image_size})', table,
                 notes=f'; classifier held-out accuracy {judge.accuracy:.4f}; each set against the training split\'s '
                       f'statistics')
    print(table)


def resampled(args: ScoreCheckConfig, judge, loaded):
    """The scores of one checkpoint's EMA samples under sampling seeds 0, 1, ...: how much of a score
    is the draw of the noise. The report is rewritten after every seed; a stop (SIGTERM, Ctrl-C) ends
    the loop once the seed under way is scored, and what was scored is kept."""
    model, config, sched, prediction = loaded
    planned, rows, stop = args.resamples or 10, [], StopFlag()
    restore = stop.install()
    try:
        for seed in range(planned):
            sampling = Sampling(num=450, batch_size=32, sampler='dpm++', steps=20, seed=seed)
            images = torch.cat(list(draw(model, config, sched, sampling, torch.device('cpu'), progress=False,
                                         prediction=prediction)))
            rows.append({'seed': seed, **judge.score(judge.features(images))})
            print(f"sampling seed {seed}: FD {rows[-1]['digits_fd']:.2f}", flush=True)
            write_resampled(args, rows, planned, stop.reason)
            if stop.reason:
                print(f'stopped by {stop.reason} after {len(rows)} of {planned} seeds: the report holds them',
                      flush=True)
                break
    finally:
        restore()


def write_resampled(args: ScoreCheckConfig, rows: list, planned: int, stopped):
    """The report of the seeds scored so far (JSON and Markdown, each written whole)."""
    scores = [r['digits_fd'] for r in rows]
    sd = statistics.stdev(scores) if len(scores) > 1 else None
    result = {**provenance(device_name(torch.device('cpu'))), 'config': {**asdict(args), 'resamples': planned},
              'rows': rows, 'seeds_planned': planned, 'complete': len(rows) == planned, 'stopped': stopped,
              'mean': statistics.mean(scores), 'sd': sd, 'min': min(scores), 'max': max(scores)}
    table = markdown_table(['sampling seed', 'FD', 'KID', 'confident'], [
        [r['seed'], f"{r['digits_fd']:.2f}", f"{r['digits_kid']:.1f}", f"{r['digits_confident']:.1%}"] for r in rows])
    write_report(args.out_dir, f'digits-score-{args.image_size}-resampled', result,
                 f'The digits score of one checkpoint, resampled ({args.ckpt})', table,
                 notes=f"; 450 EMA samples, DPM-Solver++ at 20 calls, batch 32, per sampling seed; FD mean "
                       f"{result['mean']:.2f}" + (f" +- {sd:.2f} (sd)" if sd is not None else '') +
                       f", range {min(scores):.2f} to {max(scores):.2f}" +
                       ('' if result['complete'] else f"; {len(rows)} of {planned} seeds (unfinished)"))
    if result['complete'] or stopped:
        print(table)


if __name__ == '__main__':
    sys.exit(main())

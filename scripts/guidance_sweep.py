"""Classifier-free guidance on a class-conditional digits checkpoint, scale by scale: --num EMA samples
(each class in turn), the share the digit classifier judges as the digit asked (overall and per
class), and the digits score of all classes together and per class; beside them the floor (held-out
real digits with their true labels) and a control that must fail (the same samples against shuffled
labels, about 10%). Written to OUT_DIR/STEM.{json,md,png} after every scale, so a stop keeps the
scales done.

    python scripts/guidance_sweep.py --ckpt runs/ckpt.pt --scales 0,1,2,3 --num 1000
"""
import hashlib
import os
import sys
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evaluation  # noqa: E402
import sample  # noqa: E402
from checkpoint import read_checkpoint  # noqa: E402
from cli import ConfigError, StopFlag, StopRequested, check_ranges, flag, parse_config, run_main  # noqa: E402
from devices import device_name  # noqa: E402
from drawing import Sampling, class_labels, draw  # noqa: E402
from files import check_creatable, check_writable  # noqa: E402
from reports import markdown_table, provenance, pyplot, save_figure, write_report  # noqa: E402


@dataclass
class GuidanceConfig:
    ckpt: str = flag('', 'a class-conditional digits checkpoint (train.py --dataset digits --class-cond; required)')
    scales: str = flag('0,1,1.5,2,3,4', 'guidance scales, comma-separated, each 0 or more (1: the conditional '
                                        'model alone, 0: the unconditional one)')
    num: int = flag(1000, 'samples per scale, each class in turn (image i asks for digit i mod 10)', at_least=10,
                    at_most=100_000)
    sampler: str = flag('dpm++', 'the sampler (train.py\'s evaluations: dpm++ at 20 calls)',
                        choices=('ddim', 'dpm++', 'ddpm'))
    steps: int = flag(20, 'model calls per image of ddim and dpm++ (each guided call runs both halves)', at_least=1,
                      at_most=1000)
    batch_size: int = flag(250, 'images per sampling batch', at_least=1)
    seed: int = flag(0, 'sampling seed: every scale draws from the same noise', at_least=0, at_most=2 ** 32 - 1)
    data_dir: str = flag('./data', 'where the digit classifier is cached')
    out_dir: str = flag('runs/guidance-sweep', 'where the JSON, Markdown and PNG go (results/ only when named: '
                                               'a run never replaces the committed evidence by default)')
    stem: str = flag('cpu-digits-guidance', 'the reports\' file name')


FLOOR_SAMPLES = 450  # the held-out digits that set the digits score's floor: only a score of as many compares


def parse_scales(text: str) -> list:
    try:
        scales = [float(part) for part in text.split(',')]  # an empty item ('1,,2') is no number either
    except ValueError:
        raise ConfigError(f'--scales {text!r}: numbers separated by commas, such as 0,1,2') from None
    if not scales or any(not 0 <= s < float('inf') for s in scales) or len(set(scales)) != len(scales):
        raise ConfigError(f'--scales {text!r}: one or more distinct finite scales, each 0 or more')
    return scales


def main(argv=None) -> int:
    return run_main(sweep, parse_config(argv, GuidanceConfig, __doc__))


def sweep(args: GuidanceConfig):
    check_ranges(args)
    scales = parse_scales(args.scales)
    if not args.ckpt:
        raise ConfigError('--ckpt is required: a class-conditional digits checkpoint')
    check_creatable(args.out_dir, '--out-dir')
    device = torch.device('cpu')
    model, config, sched, prediction = sample.load_model(args.ckpt, 'ema', device)
    if config.in_channels != 1 or config.num_classes != 10:
        raise ConfigError(f'--ckpt {args.ckpt}: not a class-conditional digits model (channels '
                          f'{config.in_channels}, classes {config.num_classes}): train one with --dataset digits '
                          f'--class-cond')
    judge = evaluation.DigitsJudge(config.image_size, args.data_dir)
    check_writable(args.out_dir, '--out-dir')
    trained = trained_with(args.ckpt)
    asked = class_labels(0, args.num, 10)
    rows, stop = [], StopFlag()
    restore = stop.install()
    try:
        for scale in scales:
            sampling = Sampling(num=args.num, batch_size=args.batch_size, sampler=args.sampler, steps=args.steps,
                                seed=args.seed, guidance=scale)
            try:  # a stop abandons the scale under way: the reports keep the scales done
                with stop.interruptible():
                    images = torch.cat(list(draw(model, config, sched, sampling, device, progress=True,
                                                 prediction=prediction)))
            except StopRequested:
                break
            # The first 450 (45 of each digit) as train.py's evaluations score them: the size of the floor's set.
            first = images[:FLOOR_SAMPLES]
            rows.append({'scale': scale, **judge.score(judge.features(images)), **judge.conditioning(images, asked),
                         'digits_fd_450': judge.score(judge.features(first))['digits_fd'],  # --num is 10 or more
                         **judge.memorisation(first)})
            print(f"guidance {scale:g}: {rows[-1]['accuracy']:.1%} judged as asked, digits FD "
                  f"{rows[-1]['digits_fd']:.2f} ({rows[-1]['digits_fd_450']:.2f} of the first {len(first)}), "
                  f"near copies {rows[-1]['digits_near_copies']:.1%}", flush=True)
            report(args, judge, rows, trained)
            if stop.reason:
                break
    finally:
        restore()
    if stop.reason:
        done = ', '.join(f"{r['scale']:g}" for r in rows) or 'none'
        print(f'stopped by {stop.reason}: the reports in {args.out_dir} hold the scales done ({done})', flush=True)


def trained_with(path: str) -> dict | None:
    """What made the checkpoint, for the report: train.py's flags, steps and images, and its sha256
    (None for a diffusers folder, which records none of it)."""
    if not os.path.isfile(path):
        return None
    with open(path, 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    ckpt = read_checkpoint(path, '--ckpt')
    images = ckpt['step'] * ckpt['config']['batch_size']
    return {'flags': ckpt.get('flags', {}), 'steps': ckpt['step'], 'images': images, 'sha256': digest}


def train_command(trained: dict) -> str:
    flags = [f'--{name.replace("_", "-")}' + ('' if value is True else f' {value}')
             for name, value in sorted(trained['flags'].items()) if value is not False]
    return ' '.join(['python train.py'] + flags)


def report(args: GuidanceConfig, judge, rows: list, trained: dict):
    floor = rows[0]
    result = {**provenance(device_name(torch.device('cpu'))), 'config': asdict(args), 'trained': trained,
              'floor': {'accuracy': floor['floor_accuracy'], 'digits_fd': judge.floor['digits_fd'],
                        'digits_near_copies': judge.floor['digits_near_copies'],
                        'digits_nn_ratio': judge.floor['digits_nn_ratio'],
                        'per_class_digits_fd': {c: r['floor_digits_fd'] for c, r in floor['per_class'].items()}},
              'rows': rows}
    headers = ['scale', 'judged as asked', 'worst class', 'shuffled labels (control)', 'digits FD (all)',
               f'digits FD ({FLOOR_SAMPLES})', f'near copies ({FLOOR_SAMPLES})', 'NN distance / unseen digits\'',
               'per-class FD, mean', 'confident']
    table = markdown_table(headers, [
        [f"{r['scale']:g}", f"{r['accuracy']:.1%}", f"{min(c['accuracy'] for c in r['per_class'].values()):.1%}",
         f"{r['shuffled_labels_accuracy']:.1%}", f"{r['digits_fd']:.2f}",
         f"{r['digits_fd_450']:.2f}", f"{r['digits_near_copies']:.1%}",
         f"{r['digits_nn_ratio']:.2f}",
         f"{sum(c['digits_fd'] for c in r['per_class'].values()) / len(r['per_class']):.1f}",
         f"{r['digits_confident']:.1%}"] for r in rows] + [[
            'real held-out digits (floor)', f"{floor['floor_accuracy']:.1%}",
            f"{min(c['floor_accuracy'] for c in floor['per_class'].values()):.1%}", '', '',
            f"{judge.floor['digits_fd']:.2f}", f"{judge.floor['digits_near_copies']:.1%} (225)",
            f"{judge.floor['digits_nn_ratio']:.2f} (225)",
            f"{sum(c['floor_digits_fd'] for c in floor['per_class'].values()) / len(floor['per_class']):.1f}",
            f"{judge.floor['digits_confident']:.1%}"], [
            'training digits (control: copies)', '', '', '', '', '', '100.0%', '0.00', '', '']])
    write_report(args.out_dir, args.stem, result, f'Classifier-free guidance of {args.ckpt}', table,
                 notes=f'; {args.num} EMA samples per scale ({args.sampler}, {args.steps} calls, seed {args.seed}), '
                       f'digit i mod 10 asked of image i; judged by the digits classifier (held-out accuracy '
                       f'{judge.accuracy:.4f}); per-class FD against the training digits of that class, its floor '
                       f'the 45 held-out digits of the class; FD falls with the number of samples, so only a score '
                       f'of 450 samples compares with the floors (450 held-out digits, 45 a class): the first 450 '
                       f'samples\' is given beside it. Near copies: the share of those 450 nearer (pixel RMS) a '
                       f'training digit than the closest 1% of unseen real digits are (calibrated on half the '
                       f'held-out digits, the floor the other half; training digits themselves: 100%); NN distance: '
                       f'their median distance to the nearest training digit over unseen digits\'. A score under '
                       f'the floor with no more near copies than the floor is a model close to the training '
                       f'digits\' statistics, not a copier' + (
                           f'. The checkpoint (sha256 {trained["sha256"][:12]}, {trained["images"]:,} images): '
                           f'`{train_command(trained)}`' if trained else ''))
    plot(rows, judge, floor, os.path.join(args.out_dir, f'{args.stem}.png'))
    print(table)


def plot(rows: list, judge, floor: dict, path: str):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    scales = [r['scale'] for r in rows]
    left.plot(scales, [100 * r['accuracy'] for r in rows], 'o-', label='judged as the digit asked')
    left.plot(scales, [100 * r['shuffled_labels_accuracy'] for r in rows], 's:', color='grey',
              label='control: against shuffled labels')
    left.axhline(100 * floor['floor_accuracy'], color='green', ls='--', label='floor: real held-out digits')
    left.axhline(95, color='red', lw=0.8, label='target 95%')
    left.set(xlabel='guidance scale', ylabel='% of samples', ylim=(0, 102))
    left.legend(fontsize=7, loc='center right')
    right.plot(scales, [r['digits_fd'] for r in rows], 'o-', label='all classes together')
    right.plot(scales, [sum(c['digits_fd'] for c in r['per_class'].values()) / len(r['per_class']) for r in rows],
               's-', label='per class, mean of the ten')
    right.axhline(judge.floor['digits_fd'], color='green', ls='--', label='floor (all classes)')
    right.set(xlabel='guidance scale', ylabel='digits FD (lower is better)', yscale='log')
    right.legend(fontsize=7)
    fig.suptitle('Classifier-free guidance on the class-conditional tiny digits model', fontsize=10)
    save_figure(fig, path)


if __name__ == '__main__':
    sys.exit(main())

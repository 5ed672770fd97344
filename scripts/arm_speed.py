"""img/s of the time-to-quality ladder's arms, measured interleaved in one process: every arm is built as
train.py builds its run, warmed up, then timed for --steps steps in turn, round after round, the order
rotated each round (A B C, B C A, ...), so that every arm sees the same machine state; each arm's
median img/s over the rounds and its ratio to the baseline in each round, with a 95% interval. With
--study (a side-by-side ladder's JSON: --ladder shape), the minutes to its target follow as that
study's images to the target over these img/s, seed by seed.

    python scripts/arm_speed.py --ladder shape --study results/cpu-digits-shape-study.json
    python scripts/arm_speed.py --ladder speed --arms '+ channels-last,+ fused Adam'
"""
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import time_to_quality as ttq  # noqa: E402
import train  # noqa: E402
from cli import ConfigError, check_ranges, flag, parse_config, run_main  # noqa: E402
from devices import device_name, pick_device, synchronize  # noqa: E402
from files import check_creatable  # noqa: E402
from ladder_arms import BASELINE, BASELINE_ARM, STUDIES, Arm, chosen  # noqa: E402
from ladder_stats import images_to, interval, t_quantile  # noqa: E402
from reports import markdown_table, provenance, write_report  # noqa: E402


@dataclass
class ArmSpeedConfig:
    ladder: str = flag('shape', 'whose arms: shape or prediction (a study\'s arms) or speed (the ladder\'s levers '
                                'judged on img/s, each alone on the baseline)', choices=('speed', *STUDIES))
    arms: str = flag('', 'comma-separated arms besides the baseline (default: all of --ladder\'s)')
    rounds: int = flag(8, 'rounds: each times every arm once, in a rotated order', at_least=2)
    steps: int = flag(30, 'training steps timed per arm per round', at_least=1)
    warmup: int = flag(10, 'untimed steps of each arm before the first round (a compiled arm compiles here)',
                       at_least=1)
    study: str = flag('', 'a side-by-side ladder\'s JSON (time_to_quality.py --ladder shape): minutes to its '
                          'target from its images and these img/s')
    device: str = flag('cpu', 'cpu, cuda or cuda:N')
    data_dir: str = flag('./data', 'the data (digits: the classifier\'s cache only)')
    out_dir: str = flag('results', 'where the JSON and Markdown go')
    stem: str = flag('', 'file name stem (default: <device>-digits-<ladder>-speed)')


def arms_of(cfg: ArmSpeedConfig, ladder) -> list:
    if cfg.ladder in STUDIES:  # the baseline always: every ratio is to it
        return [BASELINE_ARM] + chosen(ladder, STUDIES[cfg.ladder]()[1:])
    levers = [lv for lv in ttq.speed_levers(pick_device(cfg.device), ladder) if lv.judged_by == 'speed']
    return [BASELINE_ARM] + [Arm(lv.name, lv.changes, BASELINE + lv.flags) for lv in levers]


def build(arm: Arm, ladder, device, dataset, folder: str):
    """The arm's run as train.py builds it, and an endless iterator of its batches."""
    flags = ttq.base_flags(ladder) + ['--steps', '1000000', '--out-dir', folder, *arm.flags]
    run = train.build_run(train.check_flags(flags), device, dataset=dataset, progress=False)
    return run, train.batches(run, 0)


def timed(run, batches, first: int, steps: int) -> float:
    """img/s of `steps` training steps (the device synchronised before and after)."""
    synchronize(run.device)
    start = time.perf_counter()
    for step in range(first, first + steps):
        train.train_step(run, next(batches), step)
    synchronize(run.device)
    return steps * run.cfg.batch_size / (time.perf_counter() - start)


def measure(cfg: ArmSpeedConfig):
    check_ranges(cfg)
    ladder = ttq.LadderConfig(ladder=cfg.ladder if cfg.ladder in STUDIES else 'speed', arms=cfg.arms,
                              device=cfg.device, data_dir=cfg.data_dir)
    ttq.check_names(ladder)
    study = read_study(cfg.study) if cfg.study else None
    device, arms = pick_device(cfg.device), arms_of(cfg, ladder)
    stem = cfg.stem or f'{device.type}-digits-{cfg.ladder}-speed'
    check_creatable(os.path.join(cfg.out_dir, stem + '.json'), '--out-dir')
    common = train.check_flags(ttq.base_flags(ladder))
    dataset = data.load_dataset(common.dataset, common.data_dir, common.image_size)
    rates = {arm.name: [] for arm in arms}
    with tempfile.TemporaryDirectory() as folder:  # no checkpoint is written: the runs are never saved
        built = {arm.name: build(arm, ladder, device, dataset, folder) for arm in arms}
        for name, (run, batches) in built.items():
            timed(run, batches, 0, cfg.warmup)
            print(f'{name}: warmed up ({cfg.warmup} steps)')
        for r in range(cfg.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:
                run, batches = built[arm.name]
                rates[arm.name].append(timed(run, batches, cfg.warmup + r * cfg.steps, cfg.steps))
            print(f'round {r + 1} of {cfg.rounds}: ' + ', '.join(f'{a.name} {rates[a.name][-1]:,.0f}' for a in arms))
    result = {**provenance(device_name(device)), 'config': asdict(cfg), 'batch': common.batch_size,
              'arms': summarise(arms, rates, study)}
    report(result, cfg, stem)


def summarise(arms: list, rates: dict, study: dict | None) -> dict:
    """Per arm: its img/s per round, median and 95% interval; its ratio to the baseline round by round
    (geometric mean, 95% t-interval of the log ratios); with a study, its minutes to the target seed by
    seed (images / median img/s) and the baseline's minutes over its, with an interval that adds the
    variances of the log images ratio (over seeds) and of the log speed ratio (over rounds)."""
    base = rates['baseline']
    out = {}
    for arm in arms:
        logs = interval([math.log(a / b) for a, b in zip(rates[arm.name], base)])
        speed = {'ratio': math.exp(logs['mean']), 'low': math.exp(logs['low']), 'high': math.exp(logs['high']),
                 'log_sd': logs['sd'], 'rounds': logs['n']}
        out[arm.name] = {'flags': arm.flags, 'img_per_s': rates[arm.name],
                         'median_img_per_s': statistics.median(rates[arm.name]), 'speed_vs_baseline': speed}
        if study and arm.name in study['runs']:
            out[arm.name]['minutes'] = minutes(study, arm.name, out[arm.name]['median_img_per_s'],
                                               statistics.median(base), speed)
    return out


def minutes(study: dict, name: str, img_per_s: float, base_img_per_s: float, speed: dict) -> dict:
    target = study['targets']['target']
    mine, theirs = (seeds_images(study, n, target) for n in (name, 'baseline'))
    seeds = sorted(set(mine) & set(theirs))
    reached = all(mine[s][1] for s in seeds) and all(theirs[s][1] for s in seeds)
    got = {'target': target, 'seeds': seeds, 'reached': reached,
           'minutes': [mine[s][0] / img_per_s / 60 for s in seeds]}
    if name == 'baseline' or not reached or len(seeds) < 2:
        return got
    logs = interval([math.log(theirs[s][0] / mine[s][0]) for s in seeds])  # images: baseline over the arm
    mean = logs['mean'] + math.log(speed['ratio'])
    sd_images, sd_speed = logs['sd'] / math.sqrt(len(seeds)), speed['log_sd'] / math.sqrt(speed['rounds'])
    half = t_quantile(min(len(seeds), speed["rounds"]) - 1) * math.hypot(sd_images, sd_speed)
    return {**got, 'images_ratio': math.exp(logs['mean']), 'ratio': math.exp(mean), 'low': math.exp(mean - half),
            'high': math.exp(mean + half)}


def seeds_images(study: dict, name: str, target: float) -> dict:
    return {r['run']['seed']: images_to(r, target) for r in study['runs'].get(name, [])}


def read_study(path: str) -> dict:
    try:
        with open(path) as f:
            study = json.load(f)
        study['runs'], study['targets']['target']
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f'--study {path}: not a time_to_quality.py report ({error})') from None
    return study


def report(result: dict, cfg: ArmSpeedConfig, stem: str):
    rows = []
    for name, arm in result['arms'].items():
        s, m = arm['speed_vs_baseline'], arm.get('minutes') or {}
        rows.append([name, f"{arm['median_img_per_s']:,.0f}", f"{min(arm['img_per_s']):,.0f}-{max(arm['img_per_s']):,.0f}",
                     f"{s['ratio']:.3f} [{s['low']:.3f}, {s['high']:.3f}]",
                     (f"{statistics.mean(m['minutes']):.2f}" + ('' if m['reached'] else ' (not reached)'))
                     if m.get('minutes') else '-',
                     f"{m['ratio']:.2f}x [{m['low']:.2f}, {m['high']:.2f}] (images {m['images_ratio']:.2f}x)"
                     if 'ratio' in m else '-'])
    body = markdown_table(['Arm', 'img/s (median of rounds)', 'range', 'speed / baseline [95%]',
                           'minutes to target (mean of seeds)', 'baseline minutes / arm\'s [95%]'], rows)
    notes = (f"\n\nEach arm built as train.py builds it (batch {result['batch']}), warmed up {cfg.warmup} steps, "
             f"then timed {cfg.steps} steps per round over {cfg.rounds} rounds, the arms in a rotated order each "
             "round, all in one process: the machine's state is shared by every arm. Measured, not computed."
             + (f" Minutes to the target: the study's images to it (each seed, {cfg.study}) over the median img/s "
                "here; their ratio's interval adds the variances of the log images ratio over seeds and of the log "
                "speed ratio over rounds." if cfg.study else ''))
    write_report(cfg.out_dir, stem, result, f'img/s of the {cfg.ladder} arms, interleaved in one process', body,
                 notes=notes)
    print(body)


def main(argv=None) -> int:
    return run_main(measure, parse_config(argv, ArmSpeedConfig, __doc__))


if __name__ == '__main__':
    sys.exit(main())

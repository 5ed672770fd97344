"""img/s of the time-to-quality ladder's arms, measured interleaved in one process: every arm is built as
train.py builds its run, warmed up, then timed for --steps steps in turn, round after round, the order
rotated each round (A B C, B C A, ...), so that every arm sees the same machine state; each arm's
median img/s over the rounds and its ratio to the baseline in each round, with a 95% interval, judged
by the ladder's keep rule (the rounds as its pairs: kept when the interval lies above 1 on 5 rounds or
more); its warm-up's seconds (a compiled arm compiles there) and the images after which a faster arm
has paid back the extra warm-up. With
--study (a side-by-side ladder's JSON: --ladder shape), the minutes to its target follow as that
study's images to the target over these img/s, seed by seed.

    python -m time_to_quality.arm_speed --ladder shape --study results/cpu-digits-shape-study.json
    python -m time_to_quality.arm_speed --ladder speed --arms '+ channels-last,+ fused Adam'
"""
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass

import train_config
from cli import ConfigError, StopFlag, check_ranges, flag, parse_config, run_main
from devices import device_name, pick_device
from files import check_creatable
from reports import markdown_table, provenance, write_report

from .arms import BASELINE, BASELINE_ARM, STUDIES, Arm, chosen
from .ladder import LadderConfig, check_names, speed_levers
from .runs import base_flags
from .speed import interleave
from .stats import images_to, interval, keep_rule, t_quantile


@dataclass
class ArmSpeedConfig:
    ladder: str = flag('shape', 'whose arms: shape or prediction (a study\'s arms) or speed (the ladder\'s levers '
                                'judged on img/s, each alone on the baseline, and train.py\'s defaults)',
                       choices=('speed', *STUDIES))
    arms: str = flag('', 'comma-separated arms besides the baseline (default: all of --ladder\'s)')
    rounds: int = flag(8, 'rounds: each times every arm once, in a rotated order (at least 3, the keep rule\'s '
                          'screen; it keeps on 5 or more)', at_least=3)
    steps: int = flag(30, 'training steps timed per arm per round', at_least=1)
    warmup: int = flag(10, 'untimed steps of each arm before the first round (a compiled arm compiles here)',
                       at_least=1)
    cold_compile: bool = flag(True, "compile into an empty Inductor cache, as a first run on a machine does "
                                    "(--no-cold-compile: the cache as found)")
    study: str = flag('', 'a side-by-side ladder\'s JSON (python -m time_to_quality --ladder shape): minutes to its '
                          'target from its images and these img/s')
    device: str = flag('cpu', 'cpu, cuda or cuda:N')
    data_dir: str = flag('./data', 'the data (digits: the classifier\'s cache only)')
    out_dir: str = flag('runs/arm-speed', 'where the JSON and Markdown go (results/ only when named: '
                                          'a run never replaces the committed evidence by default)')
    stem: str = flag('', 'file name stem (default: <device>-digits-<ladder>-speed)')


def arms_of(cfg: ArmSpeedConfig, ladder) -> list:
    if cfg.ladder in STUDIES:  # the baseline always: every ratio is to it
        return [BASELINE_ARM] + chosen(ladder, STUDIES[cfg.ladder]()[1:])
    levers = [lv for lv in speed_levers(pick_device(cfg.device), ladder) if lv.judged_by == 'speed']
    return [BASELINE_ARM] + [Arm(lv.name, lv.changes, BASELINE + lv.flags) for lv in levers] + [
        Arm('defaults', "train.py's own defaults on this device (no speed flag given)", [])]


def measure(cfg: ArmSpeedConfig):
    check_ranges(cfg)
    ladder = LadderConfig(ladder=cfg.ladder if cfg.ladder in STUDIES else 'speed', arms=cfg.arms,
                          device=cfg.device, data_dir=cfg.data_dir)
    check_names(ladder)
    study = read_study(cfg.study) if cfg.study else None
    device, arms = pick_device(cfg.device), arms_of(cfg, ladder)
    stem = cfg.stem or f'{device.type}-digits-{cfg.ladder}-speed'
    check_creatable(cfg.out_dir, '--out-dir')
    common = base_flags(ladder)
    stop = StopFlag()
    restore = stop.install()
    try:  # a stop is heeded after the arm being built or warmed up, or the round under way
        got = interleave({arm.name: arm.flags for arm in arms}, common, device, cfg.rounds, cfg.steps, cfg.warmup,
                         cold=cfg.cold_compile, stop=stop)
    finally:
        restore()
    if got is None:
        print(f'stopped by {stop.reason}: no report written (its rounds would be unfinished); rerun to time them',
              flush=True)
        return
    result = {**provenance(device_name(device)), 'config': asdict(cfg),
              'batch': train_config.check_flags(common).batch_size,
              'arms': summarise(arms, got['img_per_s'], got['warmup_s'], study)}
    report(result, cfg, stem)


def summarise(arms: list, rates: dict, warmup_s: dict, study: dict | None) -> dict:
    """Per arm: its img/s per round, median and 95% interval; its ratio to the baseline round by round
    (geometric mean, 95% t-interval of the log ratios) and the keep rule's decision on the log ratios
    (stats.keep_rule, each round a pair); its warm-up seconds and, when it is faster and warms up
    slower, the images it needs to pay that back (pays_back); with a study, its minutes to the target seed by
    seed (images / median img/s) and the baseline's minutes over its, with an interval that adds the
    variances of the log images ratio (over seeds) and of the log speed ratio (over rounds)."""
    base = rates['baseline']
    out = {}
    for arm in arms:
        gains = [math.log(a / b) for a, b in zip(rates[arm.name], base)]
        logs = interval(gains)
        speed = {'ratio': math.exp(logs['mean']), 'low': math.exp(logs['low']), 'high': math.exp(logs['high']),
                 'log_sd': logs['sd'], 'rounds': logs['n']}
        median = statistics.median(rates[arm.name])
        extra, base_median = warmup_s[arm.name] - warmup_s['baseline'], statistics.median(base)
        out[arm.name] = {'flags': arm.flags, 'img_per_s': rates[arm.name], 'median_img_per_s': median,
                         'speed_vs_baseline': speed, 'warmup_s': warmup_s[arm.name],
                         'pays_back': pays_back(extra, speed['ratio'], base_median),
                         'pays_back_interval': [pays_back(extra, speed[end], base_median) for end in ('high', 'low')]}
        if arm.name != 'baseline':
            out[arm.name]['decision'] = keep_rule(gains, True, screen=3, confirm=5)
        if study and arm.name in study['runs']:
            out[arm.name]['minutes'] = minutes(study, arm.name, median, base_median, speed)
    return out


def pays_back(extra_s: float, ratio: float, base_img_per_s: float):
    """The images after which an arm `ratio` times the baseline's speed (base_img_per_s, the baseline's
    median) that warms up extra_s seconds longer has saved that time back: extra_s / ((1 - 1 / ratio) /
    base_img_per_s); 0 when it warms up no slower, None when it never does (it is no faster)."""
    if ratio <= 1:
        return None
    return max(extra_s, 0) / ((1 - 1 / ratio) / base_img_per_s)


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
        target = study['targets']['target']
        for runs in study['runs'].values():  # every run readable now, not after the measurement
            for run in runs:
                run['run']['seed'], images_to(run, target)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f'--study {path}: not a time_to_quality.py report ({error})') from None
    return study


def report(result: dict, cfg: ArmSpeedConfig, stem: str):
    rows = []
    for name, arm in result['arms'].items():
        s, m = arm['speed_vs_baseline'], arm.get('minutes') or {}
        back, (soonest, latest) = arm['pays_back'], arm['pays_back_interval']
        spread = f"{min(arm['img_per_s']):,.0f}-{max(arm['img_per_s']):,.0f}"
        interval = '' if not back else f" [{soonest:,.0f}, {'never' if latest is None else f'{latest:,.0f}'}]"
        rows.append([name, f"{arm['median_img_per_s']:,.0f}", spread,
                     f"{s['ratio']:.3f} [{s['low']:.3f}, {s['high']:.3f}]",
                     arm['decision']['status'] if 'decision' in arm else '-', f"{arm['warmup_s']:.1f}",
                     '-' if name == 'baseline' else 'never' if back is None else
                     f'{back:,.0f}' + ('' if not back else interval),
                     (f"{statistics.mean(m['minutes']):.2f}" + ('' if m['reached'] else ' (not reached)'))
                     if m.get('minutes') else '-',
                     f"{m['ratio']:.2f}x [{m['low']:.2f}, {m['high']:.2f}] (images {m['images_ratio']:.2f}x)"
                     if 'ratio' in m else '-'])
    body = markdown_table(['Arm', 'img/s (median of rounds)', 'range', 'speed / baseline [95%]',
                           'keep rule (rounds as pairs)', 'warm-up s', 'pays its warm-up back after (images) [95%]',
                           'minutes to target (mean of seeds)', 'baseline minutes / arm\'s [95%]'], rows)
    notes = (f"\n\nEach arm built as train.py builds it (batch {result['batch']}), warmed up {cfg.warmup} steps, "
             f"then timed {cfg.steps} steps per round over {cfg.rounds} rounds, the arms in a rotated order each "
             "round, all in one process: the machine's state is shared by every arm. Measured, not computed. "
             "The keep rule is the ladder's, each round a pair (screen: the mean log ratio of the first 3 rounds "
             "above 0; kept: its 95% t-interval above 0 on 5 rounds or more). Warm-up: the seconds of the "
             f"{cfg.warmup} untimed steps (compiling included, into "
             + ("an empty Inductor cache, as on a first run); an " if cfg.cold_compile
                else "Inductor's cache as found); an ")
             + "arm that warms up longer than the baseline but runs faster has saved that time back after the "
             "images given (extra seconds / ((1 - 1 / its speed ratio) / the baseline's median img/s), the interval "
             "from the ratio's). Rounds in one process are paired by the machine's state, not independent: the "
             "rule's 2.5% false keeps hold for them only as far as the machine's drift within a round is small."
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

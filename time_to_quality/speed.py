"""Speed levers timed interleaved in one process: arms built as train.py builds their runs, warmed up,
then timed in turn round after round in a rotated order (A B, B A, ...), so that every arm sees the same
machine state; each round is a pair for the ladder's keep rule. The ladder's speed part
(ladder.py) keeps one such timing per lever, a lever against the arm below it, as
OUT_DIR/STEM-runs/<lever>-speed.json, reused or refused like a run's curve; arm_speed.py times
any set of arms the same way."""
import json
import math
import os
import statistics
import tempfile
import time
from unittest import mock

import data
import train
import train_config
from cli import ConfigError, brief
from devices import synchronize
from reports import provenance

from .curves import sealed
from .stats import interval, paired_gain

WARMUP_STEPS = 10  # untimed steps of each arm before the first round (a compiled arm compiles here)


def build(flags: list, device, dataset, folder: str):
    """The run train.py builds from `flags` (never saved: it writes no checkpoint), and an endless
    iterator of its batches."""
    run = train.build_run(train_config.check_flags(flags + ['--steps', '1000000', '--out-dir', folder]), device,
                          dataset=dataset, progress=False)
    return run, train.batches(run, 0)


def timed(run, batches, first: int, steps: int) -> float:
    """img/s of `steps` training steps (the device synchronised before and after)."""
    synchronize(run.device)
    start = time.perf_counter()
    for step in range(first, first + steps):
        train.train_step(run, next(batches), step)
    synchronize(run.device)
    return steps * run.cfg.batch_size / (time.perf_counter() - start)


def interleave(arms: dict, common: list, device, rounds: int, steps: int, warmup: int = WARMUP_STEPS,
               cold: bool = True, stop=None, say=print) -> dict | None:
    """Each arm ({name: train.py flags on top of `common`}) warmed up `warmup` steps (timed: a compiled
    arm compiles there; with `cold`, into an empty Inductor cache, as on a first run), then `rounds`
    rounds of `steps` timed steps each, the arms' order rotated each round. Returns {'img_per_s': {name:
    [per round]}, 'warmup_s': {name: s}, 'batch': {name: batch}}; None when `stop` (a StopFlag) was set,
    as soon as the arm being built or warmed up, or the round under way, is done (a compile is not cut)."""
    base = train_config.check_flags(common)
    dataset = data.load_dataset(base.dataset, base.data_dir, base.image_size)
    names = list(arms)
    rates, warmup_s = {name: [] for name in names}, {}
    halted = lambda: stop is not None and bool(stop.reason)  # noqa: E731
    with tempfile.TemporaryDirectory() as folder:
        cache = {'TORCHINDUCTOR_CACHE_DIR': os.path.join(folder, 'inductor')} if cold else {}
        with mock.patch.dict(os.environ, cache):  # the environment put back after, an error included
            built = {}
            for name in names:
                built[name] = build(common + arms[name], device, dataset, folder)
                if halted():
                    return None
            for name, (run, batches) in built.items():
                if halted():  # a compile can take minutes: checked after each arm's warm-up
                    return None
                start = time.perf_counter()
                timed(run, batches, 0, warmup)
                warmup_s[name] = time.perf_counter() - start
                say(f'{name}: warmed up ({warmup} steps, {warmup_s[name]:.1f} s)')
            for r in range(rounds):
                if halted():
                    return None
                for name in names[r % len(names):] + names[:r % len(names)]:
                    run, batches = built[name]
                    rates[name].append(timed(run, batches, warmup + r * steps, steps))
                say(f'round {r + 1} of {rounds}: ' + ', '.join(f'{n} {rates[n][-1]:,.0f} img/s' for n in names))
        batch = {name: run.cfg.batch_size for name, (run, _) in built.items()}
    return {'img_per_s': rates, 'warmup_s': warmup_s, 'batch': batch}


def start_seconds(warmup_s: float, rates: list, batch: int, warmup: int) -> float:
    """What a run pays once beyond its steps at the steady rate (compiling, mostly): the warm-up's
    seconds less its steps at the arm's median img/s, at least 0."""
    return max(0.0, warmup_s - warmup * batch / statistics.median(rates))


def decide(saved: dict, planned: int, screen: int, confirm: int) -> dict:
    """The keep rule on a saved timing (a lever against the arm below): each round a pair, its gain the
    img/s over a run of `planned` images, start_seconds paid once and every image at that round's rate
    (stats.paired_gain, 'speed'); beside it the ratio of the rates round by round (geometric mean,
    95% interval) and each arm's start seconds."""
    def rounds(name):
        rates, batch = saved['img_per_s'][name], saved['batch']
        start = start_seconds(saved['warmup_s'][name], rates, batch, saved['warmup_steps'])
        return [{'img_per_s': r, 'steady_img_per_s': r, 'first_step_s': start + batch / r, 'batch': batch}
                for r in rates], start
    (mine, start), (theirs, start_below) = rounds(saved['lever']['name']), rounds(saved['below']['name'])
    logs = interval([math.log(m['img_per_s'] / t['img_per_s']) for m, t in zip(mine, theirs)])
    return {**paired_gain('speed', mine, theirs, None, planned=planned, screen=screen, confirm=confirm),
            'timed': {'rounds': len(mine), 'steps': saved['steps'], 'ratio': math.exp(logs['mean']),
                      'low': math.exp(logs['low']), 'high': math.exp(logs['high']), 'start_s': start,
                      'start_s_below': start_below, 'commit': saved['code']['commit'], 'hash': saved['code']['hash'],
                      'device': saved.get('made', {}).get('device')}}


def refusal(saved: dict, identity: dict, code_hash: str, settings: dict, arms: dict = None) -> str | None:
    """Why a saved timing may not be reused, or None: not readable as one, edited since it was written
    (its digest), another ladder's, other code's (the hash of ladder.code_identity), other
    rounds or steps (`settings`), or, with `arms` ({'lever': {name, flags}, 'below': ...}), other arms."""
    try:
        rates, names = saved['img_per_s'], [saved[side]['name'] for side in ('lever', 'below')]
        if not (set(names) <= set(rates) and len({len(rates[n]) for n in names}) == 1 and all(
                isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for n in names for r in rates[n])
                and all(saved['warmup_s'][n] >= 0 for n in names) and saved['batch'] > 0):
            return 'damaged (rates not finite and positive, or rounds unequal)'
        code = saved['code']['hash']
    except (KeyError, TypeError, AttributeError) as error:
        return f'damaged ({brief(error, 80)})'
    if sealed(saved)['digest'] != saved.get('digest'):
        return 'edited since it was written (its digest differs)'
    if saved['ladder'] != identity:
        return f"made by another ladder ({saved['ladder']}; this one: {identity})"
    if code != code_hash:
        return f"made by other code (hash {code}, commit {saved['code'].get('commit')}; this code: {code_hash})"
    if differ := [f'{key} {saved.get(key)!r} (now {value!r})' for key, value in settings.items()
                  if saved.get(key) != value]:
        return f"timed with other settings: {'; '.join(differ)}"
    if arms and (differ := [f"{side} {saved[side]!r} (now {arms[side]!r})" for side in arms
                            if saved[side] != arms[side]]):
        return f"timed other arms: {'; '.join(differ)}"
    return None


def settings(cfg) -> dict:
    """A ladder's timing settings (ladder.LadderConfig): a saved timing is reused under the same."""
    return {'rounds': cfg.speed_rounds, 'steps': cfg.speed_steps, 'warmup_steps': WARMUP_STEPS}


def record(arms: dict, got: dict, cfg, identity: dict, code: dict, device: str) -> dict:
    """The saved timing of a lever against the arm below (`arms`, from interleave's `got`), sealed."""
    return sealed({**arms, 'img_per_s': got['img_per_s'], 'warmup_s': got['warmup_s'],
                   'batch': got['batch'][arms['lever']['name']], **settings(cfg),
                   'made': provenance(device), 'ladder': identity, 'code': code})


def checked(path: str, cfg, identity: dict, code_hash: str, arms: dict = None) -> dict:
    """A saved timing under the reuse rule (refusal), or one line naming the file and how to time it again."""
    saved = read(path)
    why = saved if isinstance(saved, str) else refusal(saved, identity, code_hash, settings(cfg), arms)
    if why:
        name = os.path.basename(path)[:-len('.json')]
        raise ConfigError(f'{path}: {why}; to time it again, pass --retrain {name} (it is replaced) or remove it')
    return saved


def read(path: str):
    """A saved timing's record, or why it cannot be read as one (a string)."""
    try:
        with open(path) as f:
            saved = json.load(f)
        return saved if isinstance(saved, dict) else 'damaged (not a JSON object)'
    except (OSError, ValueError) as error:
        return f'damaged ({brief(error, 80)})'

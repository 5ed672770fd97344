"""The time-to-quality ladder's folders and finished curves: what identifies
a ladder, its runs folder (claimed by one ladder at a time), a curve's seal (its digest) and the values
no run could have written. The reuse rule that applies them is ladder.reuse_or_refuse."""
import hashlib
import json
import math
import os

import data
from cli import ConfigError, brief
from files import atomic_open, claim_folder


def ladder_identity(cfg) -> dict:
    """What decides every run of the ladder: its kind, the data (their fingerprint) and the settings
    of the runs and their scores. A finished run made under other values is never reused."""
    images = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size)
    return {'ladder': cfg.ladder, 'dataset': cfg.dataset, 'data': data.fingerprint(images), 'preset': cfg.preset,
            'image_size': cfg.image_size, 'device': cfg.device, 'eval_every': cfg.eval_every,
            'eval_samples': cfg.eval_samples, 'sampler': cfg.sampler, 'sample_steps': cfg.sample_steps,
            'eval_noise': 'fresh'}


def check_runs_dir(cfg, identity: dict):
    """RUNS_DIR holds this ladder's runs or nothing: another ladder's runs (other settings or data), a
    damaged ladder.json or files that are no ladder's are refused, and nothing is deleted."""
    manifest = os.path.join(cfg.runs_dir, 'ladder.json')
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                saved = json.load(f)
        except (OSError, ValueError) as error:
            raise ConfigError(f'{manifest}: damaged ({brief(error, 80)}); remove it if --runs-dir holds only this '
                              f'ladder\'s runs, or pass another --runs-dir') from None
        if saved != identity:
            raise ConfigError(f'--runs-dir {cfg.runs_dir} holds the runs of another ladder ({saved}): pass another '
                              f'folder')
    elif os.path.isdir(cfg.runs_dir) and set(os.listdir(cfg.runs_dir)) - {'lock'}:
        raise ConfigError(f'--runs-dir {cfg.runs_dir} holds files but no ladder.json: pass a new or empty folder')


def claim_runs_dir(cfg, identity: dict):
    """RUNS_DIR claimed for this ladder (check_runs_dir again, then its lock: a ladder running there now
    is refused) and its ladder.json written. Returns the lock's release."""
    check_runs_dir(cfg, identity)
    release = claim_folder(cfg.runs_dir, '--runs-dir')  # one ladder at a time: it deletes unfinished runs
    with atomic_open(os.path.join(cfg.runs_dir, 'ladder.json')) as f:
        json.dump(identity, f)
    return release


def sealed(record: dict) -> dict:
    """A curve record with its digest (of its JSON without the digest): an edit of the file shows."""
    body = {k: v for k, v in record.items() if k != 'digest'}
    return {**body, 'digest': hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def stop_index(curve: list, target):
    """The evaluation at which a run stopping at `target` stops: its first score at or below it."""
    return next((i for i, p in enumerate(curve) if target is not None and p['score'] <= target), None)


def impossible(saved: dict, floor: float) -> str | None:
    """What makes a curve record one no run could have written, or None: a score not finite or below
    the floor, images not whole and increasing, minutes negative or going back, a time not finite, an
    end above its stop short of its budget."""
    def number(x, low=0.0):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= low
    run, curve = saved['run'], saved['curve']
    arm = run['arm']
    if not (isinstance(arm['name'], str) and isinstance(arm['flags'], list) and isinstance(arm['recipe'], bool)
            and all(isinstance(f, str) for f in arm['flags'])):
        return f"its arm {arm!r} (a name, a list of flags, recipe or not)"
    if not (isinstance(run['images'], int) and run['images'] > 0 and isinstance(run['seed'], int) and run['seed'] >= 0
            and (run['stop_at'] is None or number(run['stop_at']))):
        return f"its run {run!r} (images and seed whole, a finite stop)"
    images, minutes = 0, 0.0
    for k, point in enumerate(curve):
        whole = isinstance(point['images'], int) and not isinstance(point['images'], bool)
        if not (whole and point['images'] > images):
            return f"evaluation {k}: images {point['images']!r} (whole and increasing)"
        if not number(point['score'], floor):
            return f"evaluation {k}: score {point['score']!r} (finite, at or above the floor {floor:.2f})"
        if not number(point['minutes'], minutes):
            return f"evaluation {k}: minutes {point['minutes']!r} (finite, 0 or more, never going back)"
        if not number(point['eval_seconds']):
            return f"evaluation {k}: eval_seconds {point['eval_seconds']!r} (finite, 0 or more)"
        images, minutes = point['images'], point['minutes']
    for key in ('img_per_s', 'train_minutes'):
        if not number(saved[key]):
            return f'{key} {saved[key]!r} (finite, 0 or more)'
    # A run may train on past a score at or under its stop (train.py draws it again and goes on when the
    # second draw is above it), but it never ends above its stop while its budget holds another evaluation.
    room = curve and curve[-1]['images'] + saved['ladder']['eval_every'] <= run['images']
    if room and run['stop_at'] is not None and curve[-1]['score'] > run['stop_at']:
        return (f"its end above its stop at {run['stop_at']} ({curve[-1]['score']:.2f} at {curve[-1]['images']:,} "
                f"images)")
    return None

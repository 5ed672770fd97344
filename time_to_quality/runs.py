"""One run of the time-to-quality ladder: train.py's flags for it (the ladder's common ones, the arm's,
its budget and stop), its name and identity (Job), the train.py run itself read back as a curve
(train_arm), and where its curve file goes. What reuses or refuses a finished curve is the runner's
(ladder.reuse_or_refuse); these functions are part of the code a curve records (ladder.RUN_MAKERS)."""
import json
import math
import os
from dataclasses import dataclass

import evaluation
import train
import train_config

from .arms import Arm, slug
from .report import stem_of


def base_flags(cfg) -> list:
    return ['--dataset', cfg.dataset, '--preset', cfg.preset, '--image-size', str(cfg.image_size),
            '--device', cfg.device, '--data-dir', cfg.data_dir, '--eval-every', str(cfg.eval_every),
            '--eval-samples', str(cfg.eval_samples), '--eval-bpd-images', '50', '--eval-bpd-timesteps', '4',
            '--sampler', cfg.sampler, '--sample-steps', str(cfg.sample_steps), '--sample-every', '0',
            '--log-every', '100', '--eval-noise', 'fresh']


def run_flags(cfg, job, folder: str) -> tuple:
    """train.py's flags of one run (the budget, the stop at the target, the evaluations, the outputs,
    the arm's) and the config train.py resolves them to."""
    batch = train_config.check_flags(base_flags(cfg) + job.arm.flags).batch_size
    flags = base_flags(cfg) + ['--steps', str(math.ceil(job.images / batch)), '--seed', str(job.seed),
                               '--out-dir', folder, *(['--stop-at-score', str(job.target)] if job.target else []),
                               *job.arm.flags]
    return flags, train_config.check_flags(flags)


@dataclass(frozen=True)
class Job:
    arm: Arm
    seed: int
    images: int  # planned
    target: float | None  # where it stops (None: it runs its whole budget)

    @property
    def name(self) -> str:
        return f'{slug(self.arm.name)}-{self.images}{"-screen" if self.target is None else ""}-seed{self.seed}'

    def identity(self) -> dict:
        return {'arm': {'name': self.arm.name, 'flags': self.arm.flags, 'recipe': self.arm.recipe},
                'seed': self.seed, 'images': self.images, 'stop_at': self.target}

    def __hash__(self):
        return hash(self.name)


def train_arm(job: Job, cfg, folder: str) -> dict | None:
    """One train.py run; its curve, or None when a signal stopped it."""
    flags, run_cfg = run_flags(cfg, job, folder)
    if train.cli(flags) != 0:
        raise RunFailed(f'{job.arm.name}, seed {job.seed}: train.py failed (its error is above)')
    if not os.path.isfile(os.path.join(folder, 'metrics.jsonl')):
        return None  # stopped in its start-up: nothing trained
    with open(os.path.join(folder, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    done = [r for r in rows if r.get('kind') == 'done']
    if not done:
        return None
    if len(done) > 1 or rows[-1] is not done[0]:  # never report a run two processes wrote
        raise RunFailed(f'{folder}/metrics.jsonl holds rows of more than one process: remove {folder} and rerun')
    first_step = sum(r.get('first_step_s') or 0 for r in rows if r.get('kind') == 'train')  # each process's first
    key, evals = evaluation.score_key(cfg.dataset), {}
    for r in rows:
        if r.get('kind') == 'eval':
            evals[r['images_seen']] = r  # the last of each
    curve = [{'images': n, 'score': r[key], 'minutes': (60 * r['train_hours'] + first_step / 60),
              'eval_seconds': r['eval_seconds']} for n, r in sorted(evals.items())]
    images = done[0]['step'] * run_cfg.batch_size
    made = {key: rows[0].get(key) for key in ('device_name', 'torch', 'date', 'commit')}  # train.py's record
    return {'made': made, 'curve': curve, 'img_per_s': images / (done[0]['train_seconds'] + first_step),
            'steady_img_per_s': (images - run_cfg.batch_size) / done[0]['train_seconds'], 'batch': run_cfg.batch_size,
            'first_step_s': first_step, 'train_minutes': (done[0]['train_seconds'] + first_step) / 60,
            'wall_minutes': done[0]['wall_s'] / 60}


class RunFailed(Exception):
    exit_code = 1


def curve_path(job: Job, cfg) -> str:
    return os.path.join(curves_dir(cfg), job.name + '.json')


def curves_dir(cfg) -> str:
    return os.path.join(cfg.out_dir, stem_of(cfg) + '-runs')


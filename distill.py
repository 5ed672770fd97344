"""Few-step students of a trained model, by progressive distillation or as consistency students:
python distill.py --help

    python distill.py --ckpt runs/ckpt.pt --out-dir runs/distill       # students of 32, 16, ..., 1 steps
    python sample.py --ckpt runs/distill/student-4.pt --num 64 --grid  # draws with its own 4 steps
    python distill.py --ckpt runs/ckpt.pt --method consistency --out-dir runs/consistency  # 1 and 2 calls

Salimans & Ho (2022), "Progressive Distillation for Fast Sampling of Diffusion Models" (their code:
google-research diffusion_distillation, dpm.py). The first teacher is a train.py checkpoint's EMA
sampled with DDIM at --teacher-steps N0; a student of N0/2 steps starts as a copy of it and learns to
land, in one DDIM step, where two of its teacher's land (distillation_loss); it then teaches a student
of N0/4, with a fresh optimizer, down to --down-to steps. Each stage writes
OUT/student-N.pt, which sample.py draws with its own N steps on the grid it was trained on
(students.student_timesteps, from t = T-1 to the clean endpoint). A class-conditional teacher is
distilled at --guidance s: the teacher runs both halves of classifier-free guidance, the student
learns the guided output with the label as its input, one pass per step.
--method consistency tunes one student, a copy of the teacher, into a consistency model in the manner of
ECT (Geng et al. 2025, "Consistency Models Made Easy"; students.py holds its maths): f(z_t, t) is
trained to equal f(z_r, r) (stop-gradient) at a nearer level r of the same trajectory, the gap t - r
halving at each of --stages stages. The point z_r comes from the same image and noise (consistency
training, --ode-step data: ECT's) or from the teacher's DDIM step from z_t (consistency distillation,
--ode-step teacher: the only way to learn a guided teacher's trajectories, so the default with a
--guidance other than 1). Each stage writes OUT/consistency-1.pt and consistency-2.pt (one set of
weights; 1 call, or 2 calls re-noised to --mid-timestep), drawn by sample.py with their own calls.
The file reads in the order a run happens: its flags and their checks, building the run, the loss,
the step, the checkpoints, the loop, main; what it shares with train.py (the data and its loader, the
EMA, the states a resume puts back, the non-finite checks) lives in bookkeeping.py.
Exit codes: 0 done (or stopped by SIGTERM/Ctrl-C with OUT/distill.pt saved), 1 a write failed,
2 bad input, 3 non-finite loss (the last good checkpoint is kept), 130 a second Ctrl-C.
"""
import copy
import glob
import math
import os
import shlex
import sys
import time
import typing
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm import tqdm

import data
import diffusion
import students
from bookkeeping import (data_identity, ema_update, finite_mean_loss, last_good_note, load_states,
                         replayed_randomness, rng_states, set_rng_states, training_data, weights_finite)
from checkpoint import (check_same_data, model_from_checkpoint, read_checkpoint, require_finite, save_checkpoint,
                        weights_fingerprint)
from cli import (ConfigError, NonFiniteLoss, StopFlag, StopRequested, changed_fields, check_ranges, flag, given_fields,
                 parse_config, run_main)
from devices import device_name, pick_device
from files import JsonLines, claim_folder
from model import MODEL_VERSION, UNet
from reports import provenance

GRID = 'trailing'  # students.student_timesteps: t_i = round(T i / N) - 1, i = N..0


METHODS = ('progressive', 'consistency')
ODE_STEPS = ('auto', 'data', 'teacher')


@dataclass
class DistillConfig:
    ckpt: str = flag('', 'the first teacher: a train.py checkpoint (its EMA weights); required for a fresh run')
    method: str = flag('progressive', 'progressive: students of N0/2, ..., --down-to steps, each the next one\'s '
                                      'teacher; consistency: one student of 1 and 2 calls (ECT)', choices=METHODS)
    teacher_steps: int = flag(64, 'N0, the DDIM steps of the first teacher; the first student takes N0/2 '
                                  '(docs/sampling.md: where DDIM has converged)', at_least=2, at_most=1000)
    down_to: int = flag(1, 'the last student\'s steps; --teacher-steps must halve to it', at_least=1)
    steps_per_stage: int | None = flag(None, 'optimizer steps per halving of the steps (progressive: 400 after the '
                                             'first stage from a guided teacher, else 1000; the paper: 50,000 '
                                             'at batch 128 on CIFAR-10) or of the '
                                             'gap (consistency: half the teacher\'s training images over the '
                                             'stages) (default: measured, docs/sampling.md)', at_least=1)
    first_stage_steps: int | None = flag(None, 'progressive: optimizer steps of the first stage, where the student '
                                               'also learns what its output means when the teacher predicts eps '
                                               '(default: 1000)', at_least=1)
    stages: int = flag(8, 'consistency: stages, the gap t - r halving at each (ECT: 8 on CIFAR-10)', at_least=1,
                       at_most=30)
    ode_step: str = flag('auto', 'consistency: where z_r comes from: data (the same image and noise at r: '
                                 'consistency training, ECT) or teacher (its DDIM step from z_t: consistency '
                                 'distillation); auto: teacher for a --guidance other than 1, else data',
                         choices=ODE_STEPS)
    huber_c: float = flag(0.0, 'consistency: the distance sqrt(||a - b||^2 + c^2) - c (0: the L2 distance, '
                               'ECT\'s; iCT: 0.00054 sqrt(pixels))', at_least=0)
    level_mean: float = flag(0.0, 'consistency: the mean of ln s over the loss\'s pairs, s = sigma / alpha, EDM\'s '
                                  'noise level (ECT\'s P_mean: -1.1; 0 measured better on digits: docs/sampling.md)')
    level_std: float = flag(students.ECT_P_STD, 'consistency: the spread of ln s over the pairs (ECT\'s P_std: 2)',
                            positive=True)
    mid_timestep: int = flag(400, 'consistency: the 2-call student\'s second timestep, where its first image is '
                                  're-noised to (400: best of 100, 222 (ECT\'s EDM sigma 0.821), 400 and 600 on '
                                  'digits, docs/sampling.md)',
                             at_least=0, at_most=998)
    dropout: float | None = flag(None, 'consistency: the student\'s dropout, the same masks on both sides of the '
                                       'loss (default: the teacher\'s; progressive students have none)',
                                 at_least=0, below=1)
    prediction: str | None = flag(None, 'what the student predicts: v = alpha eps - sigma x, or x (never eps: at '
                                        't = T-1 x from eps divides by alpha = 0.006); the teacher keeps its own '
                                        '(default: x for progressive from a guided teacher, else v; measured)',
                                  choices=students.STUDENT_PREDICTIONS)
    guidance: float | None = flag(None, 'a class-conditional teacher\'s guidance scale (1: the conditional model '
                                        'alone, one pass; default 1); the student learns the guided output',
                                  at_least=0)
    batch_size: int | None = flag(None, 'images per step (default: the teacher\'s)', at_least=1)
    lr: float | None = flag(None, 'Adam\'s learning rate: progressive, at each stage\'s start, decayed linearly to '
                                  '0 at its end (default: the teacher\'s; the paper: 5e-5, a quarter of its '
                                  'teacher\'s); consistency, constant (default: a fifth of the teacher\'s, '
                                  'measured; ECT: a tenth)', positive=True)
    grad_clip: float = flag(1.0, 'clip the global gradient norm to this (0: off)', at_least=0)
    ema_decay: float | None = flag(None, 'EMA decay of the students (0: none, the stage\'s student is its last '
                                         'weights; default: 0 for progressive, the paper\'s; 0.998 for '
                                         'consistency, measured)', at_least=0, below=1)
    data_dir: str | None = flag(None, 'the teacher\'s data set (default: the teacher\'s --data-dir)')
    num_workers: int = flag(4, 'DataLoader workers when the set does not fit in memory', at_least=0)
    log_every: int = flag(100, 'steps between metrics.jsonl rows', at_least=1)
    ckpt_every: int = flag(500, 'steps between checkpoints OUT/distill.pt (also at each stage\'s end)', at_least=1)
    out_dir: str = flag('runs/distill', 'where distill.pt, student-N.pt and metrics.jsonl go')
    resume: str = flag('', 'OUT/distill.pt of a stopped run to continue exactly, or auto: it when it exists')
    seed: int = flag(0, 'seed of the data order, timesteps and noise', at_least=0, at_most=2 ** 32 - 1)
    device: str = flag('auto', 'auto, cpu, cuda or cuda:N')


# The flags of one method only: given with the other, refused.
METHOD_FLAGS = {'progressive': ('teacher_steps', 'down_to', 'first_stage_steps'),
                'consistency': ('stages', 'ode_step', 'huber_c', 'level_mean', 'level_std', 'mid_timestep',
                                'dropout')}
# Flags a resumed run may change: they move no number of the run.
CHANGEABLE_ON_RESUME = ('log_every', 'ckpt_every', 'num_workers', 'device', 'out_dir', 'resume', 'data_dir')


def stage_steps(cfg: DistillConfig) -> list:
    """The students' step counts, one per stage: N0/2, N0/4, ..., --down-to; a consistency run's stages
    all train the one student of 1 (and 2) calls."""
    if cfg.method == 'consistency':
        return [1] * cfg.stages
    counts = [cfg.teacher_steps // 2]
    while counts[-1] > cfg.down_to:
        counts.append(counts[-1] // 2)
    return counts


def stage_lengths(cfg: DistillConfig) -> list:
    """Optimizer steps of each stage: --first-stage-steps for a progressive run's first (its student starts
    from a teacher that may predict eps and must match two of its steps in one), --steps-per-stage after."""
    first = cfg.first_stage_steps if cfg.method == 'progressive' and cfg.first_stage_steps else cfg.steps_per_stage
    return [first] + [cfg.steps_per_stage] * (len(stage_steps(cfg)) - 1)


def stage_at(cfg: DistillConfig, step: int) -> tuple:
    """(stage, steps into it) of the run's `step`; past the last stage, (the number of stages, the steps
    beyond its end)."""
    lengths = stage_lengths(cfg)
    for stage, length in enumerate(lengths):
        if step < length:
            return stage, step
        step -= length
    return len(lengths), step


def made_students(cfg: DistillConfig) -> str:
    if cfg.method == 'consistency':
        return 'consistency students of 1 and 2 calls (consistency-1.pt, consistency-2.pt)'
    return f'students of {", ".join(map(str, stage_steps(cfg)))} steps'


# ----------------------------------------------------------------------------- the settings, checked first

def check_settings(cfg: DistillConfig, given: set) -> tuple:
    """(the resolved config, the checkpoint it starts from) with every flag checked before any work: a
    fresh run reads the teacher (--ckpt), a resumed one (--resume) replays its checkpoint's settings,
    refusing another value of any that moves its numbers."""
    check_ranges(cfg)
    other = METHODS[1 - METHODS.index(cfg.method)]
    misplaced = sorted(given & set(METHOD_FLAGS[other]))
    if misplaced:
        raise ConfigError(f'--{misplaced[0].replace("_", "-")}: a flag of --method {other}, not of --method '
                          f'{cfg.method}')
    ckpt_path = os.path.join(cfg.out_dir, 'distill.pt')
    if cfg.resume == 'auto':
        cfg = replace(cfg, resume=ckpt_path if os.path.isfile(ckpt_path) else '')
    if cfg.resume:
        if 'out_dir' not in given:
            cfg = replace(cfg, out_dir=os.path.dirname(cfg.resume) or '.')
        ckpt = read_checkpoint(cfg.resume, f'--resume {cfg.resume}', student_ok=True)
        if 'optimizer' not in ckpt or 'distill' not in ckpt:
            raise ConfigError(f'--resume {cfg.resume}: not a distill.py run (OUT/distill.pt): a student-N.pt is '
                              f'for sampling; a train.py checkpoint is a teacher, for --ckpt')
        # A run begun before --level-mean had its flag drew ECT's levels: resumed, it goes on with them.
        saved = DistillConfig(**{'level_mean': students.ECT_P_MEAN, 'level_std': students.ECT_P_STD,
                                 **ckpt['distill']})
        for name in sorted(given - set(CHANGEABLE_ON_RESUME)):
            if getattr(cfg, name) != getattr(saved, name) and not same_file(name, cfg.ckpt, saved.ckpt):
                raise ConfigError(f'--{name.replace("_", "-")} {getattr(cfg, name)}: the run has '
                                  f'{getattr(saved, name)}; an exact resume needs the same value')
        changed = {name: getattr(cfg, name) for name in CHANGEABLE_ON_RESUME if name in given}
        return replace(saved, **{**changed, 'resume': cfg.resume, 'out_dir': cfg.out_dir}), ckpt
    if os.path.isfile(ckpt_path):
        raise ConfigError(f'{ckpt_path} exists: continue that run with --resume {ckpt_path} (or --resume auto), '
                          f'or pass another --out-dir')
    if any(glob.glob(os.path.join(glob.escape(cfg.out_dir), f'{name}-*.pt')) for name in ('student', 'consistency')):
        raise ConfigError(f'--out-dir {cfg.out_dir} holds the students of another run: pass another --out-dir')
    if not cfg.ckpt:
        raise ConfigError('--ckpt is required: the teacher, a train.py checkpoint')
    if os.path.isdir(cfg.ckpt):
        raise ConfigError(f'--ckpt {cfg.ckpt}: a folder (a diffusers export?); the teacher must be a train.py '
                          f'checkpoint, which holds the data and settings it was trained with')
    ckpt = read_checkpoint(cfg.ckpt, f'--ckpt {cfg.ckpt}')
    teacher = ckpt['config']
    if teacher.get('prediction', 'eps') not in diffusion.PREDICTIONS or teacher.get('schedule') not in ('linear',
                                                                                                       'cosine'):
        raise ConfigError(f'--ckpt {cfg.ckpt}: not a train.py checkpoint (its prediction or schedule)')
    halvings = math.log2(cfg.teacher_steps / cfg.down_to)
    if cfg.method == 'progressive' and (cfg.down_to >= cfg.teacher_steps or halvings != int(halvings)):
        raise ConfigError(f'--teacher-steps {cfg.teacher_steps} does not halve to --down-to {cfg.down_to}: their '
                          f'ratio must be 2, 4, 8, ... (such as 64 and 1, or 96 and 3)')
    classes = ckpt['model_config'].get('num_classes', 0)
    if cfg.guidance is not None and not classes:
        raise ConfigError(f'--guidance {cfg.guidance}: {cfg.ckpt} is an unconditional model (trained without '
                          f'--class-cond): it has no classes to guide towards')
    guidance = (1.0 if cfg.guidance is None else cfg.guidance) if classes else None
    ode_step = cfg.ode_step if cfg.ode_step != 'auto' else 'teacher' if guidance not in (None, 1.0) else 'data'
    if cfg.method == 'consistency' and ode_step == 'data' and guidance not in (None, 1.0):
        raise ConfigError(f'--ode-step data --guidance {guidance}: consistency training learns the data\'s own '
                          f'trajectories, unguided; a guided teacher\'s are learnt with --ode-step teacher')
    batch_size = cfg.batch_size or teacher['batch_size']
    defaults = method_defaults(cfg.method, ckpt, batch_size, cfg.stages, guidance not in (None, 1.0))
    return replace(cfg, **{name: value for name, value in defaults.items() if getattr(cfg, name) is None},
                   guidance=guidance, ode_step=ode_step if cfg.method == 'consistency' else cfg.ode_step,
                   batch_size=batch_size,
                   data_dir=cfg.data_dir if cfg.data_dir is not None else teacher['data_dir']), ckpt


def method_defaults(method: str, ckpt: dict, batch_size: int, stages: int, guided: bool) -> dict:
    """The settings a fresh run leaves to its method, each measured on digits (docs/sampling.md): progressive,
    the teacher's learning rate, no EMA, and from a guided teacher x students, a first stage of 1,000 steps
    and 400 per later one (its v student's first stage lost 15% to its target, the x student's 3%), from
    an unguided one v students and 1,000 steps per stage (there x with the short stages lost 3% to 12%);
    a consistency student tuned on half the teacher's training images over its stages, at a fifth of the
    teacher's learning rate (better than a tenth and a twentieth), with an EMA of 0.998."""
    teacher = ckpt['config']
    if method == 'progressive':
        return {'prediction': 'x' if guided else 'v', 'first_stage_steps': 1000,
                'steps_per_stage': 400 if guided else 1000, 'lr': teacher['lr'], 'ema_decay': 0.0}
    teacher_images = ckpt['step'] * teacher['batch_size']
    return {'prediction': 'v', 'steps_per_stage': max(1, teacher_images // (2 * stages * batch_size)),
            'lr': teacher['lr'] / 5, 'ema_decay': 0.998}


def same_file(name: str, given: str, saved: str) -> bool:
    """--ckpt given as another spelling of the path the run was started with (relative, absolute)."""
    try:
        return name == 'ckpt' and os.path.samefile(given, saved)
    except OSError:
        return False


# ----------------------------------------------------------------------------- building the run

@dataclass
class Distillation:
    """What one run holds. `teacher` and `student` are UNets; `ema` the student's EMA or None
    (--ema-decay 0); `teacher_config` the first teacher's train.py config (its data, schedule,
    what it predicts); `stop` is set by SIGTERM/Ctrl-C."""
    cfg: DistillConfig
    device: torch.device
    teacher_config: dict
    sched: diffusion.Schedule
    teacher: torch.nn.Module
    student: torch.nn.Module
    ema: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    loader: typing.Any
    data_identity: dict
    first_teacher: str = ''  # checkpoint.weights_fingerprint of the trained teacher: its students name it
    stop: StopFlag = field(default_factory=StopFlag)

    @property
    def num_classes(self) -> int:
        return self.student.config.num_classes

    @property
    def total_steps(self) -> int:
        return sum(stage_lengths(self.cfg))

    def sampled(self) -> torch.nn.Module:  # what the stage's student is: its EMA, or its weights
        return self.ema if self.ema is not None else self.student


def build_distillation(cfg: DistillConfig, ckpt: dict, device, stop: StopFlag) -> Distillation:
    """The teacher, the student (a copy of it, without dropout), the optimizer and the teacher's data,
    loaded and checked before the output folder is claimed."""
    resuming = bool(cfg.resume)
    named_as = f'--resume {cfg.resume}' if resuming else f'--ckpt {cfg.ckpt}'
    teacher_config = ckpt['teacher_config'] if resuming else ckpt['config']
    teacher = model_from_checkpoint({**ckpt, 'ema': ckpt['teacher']} if resuming else ckpt, 'ema', named_as)
    require_finite(teacher.state_dict(), f'{named_as}: its teacher weights', 'use an earlier checkpoint')
    teacher = teacher.to(device).requires_grad_(False)
    # The paper's progressive students have no dropout; ECT keeps it (the same masks on both sides of its loss).
    dropout = 0.0 if cfg.method == 'progressive' else teacher.config.dropout if cfg.dropout is None else cfg.dropout
    config = replace(teacher.config, dropout=dropout)
    student = UNet(config).to(device)
    student.load_state_dict(teacher.state_dict())
    ema = copy.deepcopy(student).requires_grad_(False) if cfg.ema_decay > 0 else None
    dataset = data.load_dataset(teacher_config['dataset'], cfg.data_dir, config.image_size,
                                teacher_config.get('shapes_count', 8192), labels=bool(config.num_classes))
    check_same_data({'data': ckpt.get('data')}, named_as, data_identity(dataset, bool(config.num_classes)),
                    cfg.data_dir)  # before the loader, which may copy the whole set to the device
    if cfg.batch_size > len(dataset):
        raise ConfigError(f'--batch-size {cfg.batch_size} is larger than the data set ({len(dataset)} images): '
                          f'pass a smaller one')
    train_data = training_data(dataset, config.image_size, cfg.data_dir, cfg.batch_size, cfg.seed, device,
                               data.flipped_in_training(teacher_config['dataset']), workers=cfg.num_workers,
                               classes=bool(config.num_classes))
    torch.manual_seed(cfg.seed)
    sched = diffusion.make_schedule(1000, teacher_config['schedule']).to(device)
    optimizer = torch.optim.Adam(student.parameters(), lr=cfg.lr)
    first_teacher = ckpt.get('first_teacher_fingerprint', '') if resuming else weights_fingerprint(teacher.state_dict())
    return Distillation(cfg, device, teacher_config, sched, teacher, student, ema, optimizer, train_data.loader,
                        train_data.identity, first_teacher, stop)


# ----------------------------------------------------------------------------- the loss

@torch.no_grad()
def teacher_step(teacher, sched: diffusion.Schedule, z: torch.Tensor, t: torch.Tensor, t_to: torch.Tensor,
                 prediction: str = 'eps') -> torch.Tensor:
    """One unclipped DDIM step of the teacher (its output read as `prediction`) from t to t_to, per
    image; t_to = -1 lands on its x prediction. The teacher may be diffusion.guided's (two halves)."""
    alpha, sigma = students.alpha_sigma(sched, t, z)
    x, eps = students.x_and_eps(teacher(z, t).to(z.dtype), z, alpha, sigma, prediction)
    return students.ddim_to(x, eps, *students.alpha_sigma(sched, t_to, z))


def teacher_two_steps(teacher, sched: diffusion.Schedule, z: torch.Tensor, t: torch.Tensor, t_mid: torch.Tensor,
                      t_to: torch.Tensor, prediction: str = 'eps') -> torch.Tensor:
    """z'': two unclipped DDIM steps of the teacher, t -> t_mid -> t_to, per image (two teacher calls)."""
    z_mid = teacher_step(teacher, sched, z, t, t_mid, prediction)
    return teacher_step(teacher, sched, z_mid, t_mid, t_to, prediction)


def distillation_loss(student, teacher, sched: diffusion.Schedule, x0: torch.Tensor, steps: int,
                      prediction: str = 'v', teacher_prediction: str = 'eps', k: torch.Tensor = None,
                      noise: torch.Tensor = None, per_example: bool = False) -> torch.Tensor:
    """Progressive distillation's loss for a student of `steps` steps (Salimans & Ho 2022, Algorithm 2):
    a step k of its grid (uniform over the `steps` unless given), t = g[k] -> t'' = g[k + 1], with the
    teacher's grid point t' between them (students.student_timesteps of 2 x steps); z_t = alpha_t x0 + sigma_t eps;
    the target x~ (students.distillation_target) from the teacher's two DDIM steps; the loss
    max(SNR_t, 1) ||x_student - x~||^2, SNR_t = alpha_t^2 / sigma_t^2 ("truncated SNR" weighting, their
    snr_trunc: the x error at low noise, the eps error at high). student and teacher are model(z, t)
    callables; the student's output is read as `prediction` ('v' or 'x'), the teacher's as its own."""
    grid = torch.tensor(students.student_timesteps(2 * steps, sched.num_steps), device=x0.device)
    if k is None:
        k = torch.randint(0, steps, (x0.shape[0],), device=x0.device)
    if noise is None:
        noise = torch.randn_like(x0)
    t, t_mid, t_to = grid[2 * k], grid[2 * k + 1], grid[2 * k + 2]
    alpha, sigma = students.alpha_sigma(sched, t, x0)
    z = alpha * x0 + sigma * noise  # q_sample (eq. 4)
    z_teacher = teacher_two_steps(teacher, sched, z, t, t_mid, t_to, teacher_prediction)
    target = students.distillation_target(z, z_teacher, alpha, sigma, *students.alpha_sigma(sched, t_to, x0))
    x, _ = students.x_and_eps(student(z, t).to(z.dtype), z, alpha, sigma, prediction)
    weight = (alpha / sigma).square().clamp(min=1.0).flatten()
    per_image = weight * (x - target).square().flatten(1).mean(1)
    return per_image if per_example else per_image.mean()


def consistency_loss(student, sched: diffusion.Schedule, x0: torch.Tensor, stage: int, prediction: str = 'v',
                     ode_step: typing.Callable = None, huber_c: float = 0.0, t: torch.Tensor = None,
                     r: torch.Tensor = None, noise: torch.Tensor = None, per_example: bool = False,
                     levels: tuple = (students.ECT_P_MEAN, students.ECT_P_STD)) -> torch.Tensor:
    """ECT's loss (Geng et al. 2025, eq. 8 with the weight 1 / (t - r) of its section 3): for (t, r) of the
    stage (students.consistency_pair at ln s ~ N(levels), unless given) and z_t = alpha_t x0 + sigma_t eps,
    w d(f(z_t, t), stopgrad f(z_r, r)), with w = 1 / (s_t - s_r) in EDM's noise levels, d the pseudo-Huber
    distance (students.pseudo_huber) and f the student read by students.consistency_fn (f = z at r = -1).
    z_r = alpha_r x0 + sigma_r eps on the same noise (consistency training), or ode_step(z_t, t, r), the
    teacher's step along its trajectory (consistency distillation). Both passes draw the same dropout."""
    if t is None:
        t, r = students.consistency_pair(sched, stage, x0.shape[0], x0.device, None, *levels)
    if noise is None:
        noise = torch.randn_like(x0)
    (alpha, sigma), (alpha_r, sigma_r) = students.alpha_sigma(sched, t, x0), students.alpha_sigma(sched, r, x0)
    z = alpha * x0 + sigma * noise  # q_sample (eq. 4)
    z_r = alpha_r * x0 + sigma_r * noise if ode_step is None else ode_step(z, t, r)
    with replayed_randomness(x0.device):
        f = students.consistency_fn(student(z, t).to(z.dtype), z, t, alpha, sigma, prediction)
    with torch.no_grad():  # the network is not called at the clean end: f = z there
        target = students.consistency_fn(student(z_r, r.clamp(min=0)).to(z.dtype), z_r, r, alpha_r, sigma_r,
                                         prediction)
    per_image = students.pseudo_huber(f, target, huber_c) / (sigma / alpha - sigma_r / alpha_r).flatten()
    return per_image if per_example else per_image.mean()


# ----------------------------------------------------------------------------- the step

def stage_lr(stage: int, within: int, cfg: DistillConfig) -> float:
    """Progressive distillation's schedule per stage: no warm-up, linear decay from --lr to 0 at the
    stage's end; ECT's: --lr throughout."""
    return cfg.lr if cfg.method == 'consistency' else cfg.lr * (1 - within / stage_lengths(cfg)[stage])


def distill_step(d: Distillation, batch, step: int) -> torch.Tensor:
    """One optimizer step of the student on a batch (images, or (images, labels)); the loss, unsynced."""
    cfg = d.cfg
    stage, within = stage_at(cfg, step)
    x0, labels = batch if isinstance(batch, tuple) else (batch, None)
    student, teacher = d.student, d.teacher
    # Stage 0's teacher is the trained model (its own prediction, guided with two halves); a later stage's is the
    # last student, which predicts what students predict and learnt the guided output in one pass.
    first = stage == 0 or cfg.method == 'consistency'
    teacher_prediction = d.teacher_config.get('prediction', 'eps') if first else cfg.prediction
    if labels is not None:  # the student told the label
        student = lambda z, t: d.student(z, t, labels)  # noqa: E731
        teacher = (diffusion.guided(d.teacher, labels, cfg.guidance, d.num_classes) if first else
                   (lambda z, t: d.teacher(z, t, labels)))
    for group in d.optimizer.param_groups:
        group['lr'] = stage_lr(stage, within, cfg)
    if cfg.method == 'consistency':  # its teacher is the trained model throughout, guided where it is
        step_of = None if cfg.ode_step == 'data' else (
            lambda z, t, r: teacher_step(teacher, d.sched, z, t, r, teacher_prediction))
        loss = consistency_loss(student, d.sched, x0, stage, cfg.prediction, step_of, cfg.huber_c,
                                levels=(cfg.level_mean, cfg.level_std))
    else:
        loss = distillation_loss(student, teacher, d.sched, x0, stage_steps(cfg)[stage], cfg.prediction,
                                 teacher_prediction)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(d.student.parameters(), cfg.grad_clip)
    d.optimizer.step()
    d.optimizer.zero_grad(set_to_none=True)
    if d.ema is not None:
        ema_update(d.ema, d.student, cfg.ema_decay)
    return loss.detach()


def begin_stage(d: Distillation, stage: int):
    """The last stage's student becomes the teacher (stage 0: the checkpoint's EMA already is), and the
    new student starts as a copy of it, with a fresh optimizer and EMA. A consistency run's one student
    and optimizer go on through its stages: only the gap changes."""
    if d.cfg.method == 'consistency' and stage > 0:
        return
    if stage > 0:
        d.teacher.load_state_dict(d.sampled().state_dict())
    d.student.load_state_dict(d.teacher.state_dict())
    if d.ema is not None:
        d.ema.load_state_dict(d.teacher.state_dict())
    d.optimizer = torch.optim.Adam(d.student.parameters(), lr=d.cfg.lr)


# ----------------------------------------------------------------------------- the checkpoints

def make_student_record(d: Distillation, stage: int, calls: int = None) -> dict:
    """What sample.py draws a student with: its method, steps (network calls), grid or timesteps and
    prediction, beside where it came from. A consistency student's record is of `calls` (1 or 2)."""
    if d.cfg.method == 'consistency':
        timesteps = students.consistency_timesteps(calls, d.cfg.mid_timestep, d.sched.num_steps)
        drawn = {'steps': calls, 'grid': 'consistency', 'timesteps': timesteps, 'ode_step': d.cfg.ode_step}
    else:
        steps = stage_steps(d.cfg)[stage]
        drawn = {'steps': steps, 'grid': GRID, 'timesteps': students.student_timesteps(steps, d.sched.num_steps)}
    return {'method': d.cfg.method, **drawn, 'prediction': d.cfg.prediction,
            'teacher_prediction': d.teacher_config.get('prediction', 'eps'),
            'guidance': d.cfg.guidance, 'stage': stage, 'first_teacher': d.cfg.ckpt,
            'first_teacher_steps': d.cfg.teacher_steps, 'first_teacher_fingerprint': d.first_teacher}


def student_state(d: Distillation, stage: int, step: int, seconds: float, calls: int = None) -> dict:
    """A student checkpoint (OUT/student-N.pt, OUT/consistency-N.pt): read_checkpoint's format, its 'ema'
    the weights to sample, 'student' its record, 'config' the first teacher's train.py config. train.py
    refuses it."""
    return {'model': d.student.state_dict(), 'ema': d.sampled().state_dict(), 'config': d.teacher_config,
            'model_config': asdict(d.student.config), 'model_version': MODEL_VERSION,
            'student': make_student_record(d, stage, calls), 'distill': asdict(d.cfg), 'step': step, 'seconds': seconds,
            'images_seen': step * d.cfg.batch_size}


def run_state(d: Distillation, stage: int, step: int, seconds: float) -> dict:
    """OUT/distill.pt: the student checkpoint of the stage under way, and what an exact resume needs:
    its teacher, the optimizer, the RNG states and the data's identity (the data order is the step's)."""
    return {**student_state(d, stage, step, seconds, calls=1), 'teacher': d.teacher.state_dict(),
            'first_teacher_fingerprint': d.first_teacher,
            'teacher_config': d.teacher_config, 'optimizer': d.optimizer.state_dict(), 'rng': rng_states(d.device),
            'data': d.data_identity}


def restore_distillation(d: Distillation, ckpt: dict) -> int:
    """A distill.pt's states in the run; returns the step to continue from."""
    load_states(f'--resume {d.cfg.resume}', [(d.student, ckpt.get('model')), (d.ema, ckpt.get('ema')),
                                            (d.optimizer, ckpt.get('optimizer'))])
    set_rng_states(ckpt['rng'], d.device)
    return ckpt['step']


def save_students(d: Distillation, stage: int, step: int, seconds: float, log: JsonLines):
    """A stage's end: OUT/student-N.pt (progressive), or OUT/consistency-1.pt and -2.pt (the one student
    so far, drawn in 1 and in 2 calls)."""
    count, consistency = stage_steps(d.cfg)[stage], d.cfg.method == 'consistency'
    paths = []
    for calls in (1, 2) if consistency else (None,):
        paths.append(os.path.join(d.cfg.out_dir, f'consistency-{calls}.pt' if consistency else f'student-{count}.pt'))
        save_checkpoint(student_state(d, stage, step, seconds, calls), paths[-1])
    log.write({'kind': 'stage', 'step': step, 'stage': stage, 'student_steps': count,
               'teacher_steps': None if consistency else 2 * count, 'paths': paths, 'seconds': seconds})
    made = ' and '.join(paths) + ('' if consistency else f' ({count} steps)')
    tqdm.write(f'stage {stage + 1}/{len(stage_steps(d.cfg))}: {made}, {seconds:.0f} s so far')


# ----------------------------------------------------------------------------- the loop

def distill(d: Distillation, step: int, log: JsonLines, seconds: float = 0.0) -> dict:
    """The stages' steps from `step` on; a metrics row every --log-every steps, OUT/student-N.pt at
    each stage's end, OUT/distill.pt every --ckpt-every steps, at each stage's end and at a stop
    (SIGTERM or Ctrl-C: the step finishes, the checkpoint is saved, exit 0)."""
    cfg, counts, lengths = d.cfg, stage_steps(d.cfg), stage_lengths(d.cfg)
    ckpt_path = os.path.join(cfg.out_dir, 'distill.pt')
    loss_sum, unlogged, interval_start, start = torch.zeros((), device=d.device), 0, time.perf_counter(), seconds
    clock = time.perf_counter()
    last_good = f'{d.cfg.resume} (step {step}, resumed from)' if d.cfg.resume else None
    bar = tqdm(total=d.total_steps, initial=step, dynamic_ncols=True, desc='distill')
    try:
        for batch in d.loader.batches(step) if step < d.total_steps else ():
            stage, within = stage_at(cfg, step)
            if within == 0:
                begin_stage(d, stage)
            if within == 0 or bar.n == bar.initial:
                bar.set_description(f'consistency stage {stage + 1}/{len(counts)}' if cfg.method == 'consistency' else
                                    f'distill {2 * counts[stage]}->{counts[stage]} steps', refresh=False)
            loss_sum += distill_step(d, batch, step)
            step, unlogged = step + 1, unlogged + 1
            bar.update(1)
            stage_done, stopped = within + 1 == lengths[stage], d.stop.reason
            must_save = stage_done or stopped or step % cfg.ckpt_every == 0
            if step % cfg.log_every == 0 or must_save:  # a checkpoint only after the losses before it are seen finite
                mean_loss = finite_mean_loss(loss_sum, unlogged, step, last_good)
                now = time.perf_counter()
                seconds += now - clock
                clock = now
                log.write({'kind': 'train', 'step': step, 'stage': stage, 'student_steps': counts[stage],
                           'images_seen': step * cfg.batch_size, 'loss': mean_loss,
                           'lr': stage_lr(stage, within, cfg),
                           'img_per_s': unlogged * cfg.batch_size / (now - interval_start), 'seconds': seconds})
                bar.set_postfix(loss=f'{mean_loss:.4g}')
                loss_sum.zero_()
                unlogged, interval_start = 0, now
            if must_save and not weights_finite(d.sampled()):
                raise NonFiniteLoss(f'the student\'s weights became non-finite at step {step}; stopping. '
                                    + last_good_note(last_good))
            if stage_done:
                save_students(d, stage, step, seconds, log)
            if must_save:
                save_checkpoint(run_state(d, stage, step, seconds), ckpt_path)
                last_good = f'{ckpt_path} (step {step})'
            if stopped:
                tqdm.write(f'stopped by {stopped} at step {step}: {ckpt_path} saved; continue with python distill.py '
                           f'--resume {shlex.quote(ckpt_path)}')
                return {'step': step, 'stopped': stopped, 'checkpoint': ckpt_path}
            if step >= d.total_steps:
                break
    finally:
        bar.close()
    log.write({'kind': 'done', 'step': step, 'seconds': seconds, 'images_seen': step * cfg.batch_size})
    print(f'done: {len(counts)} stages, {step} steps ({step * cfg.batch_size:,} images) in '
          f'{seconds - start:.1f} s this process; {made_students(cfg)} in {cfg.out_dir}')
    return {'step': step, 'stopped': None, 'checkpoint': ckpt_path}


# ----------------------------------------------------------------------------- main

def main(cfg: DistillConfig, given: set = None) -> dict:
    stop, release = StopFlag(), lambda: None
    restore_signals = stop.install()
    try:
        cfg, ckpt = check_settings(cfg, changed_fields(cfg) if given is None else given)
        device = pick_device(cfg.device, 0)
        with stop.interruptible():  # a stop during start-up: nothing trained, nothing to save
            d = build_distillation(cfg, ckpt, device, stop)
        release = claim_folder(cfg.out_dir, '--out-dir', ('*.pt.tmp',), () if cfg.resume else ('metrics.jsonl',))
        step = restore_distillation(d, ckpt) if cfg.resume else 0
        if step >= d.total_steps:  # a finished run resumed: nothing to train, nothing to log again
            print(f'{cfg.out_dir}: finished already ({step} steps; {made_students(cfg)}): nothing to do')
            return {'step': step, 'stopped': None, 'checkpoint': os.path.join(cfg.out_dir, 'distill.pt')}
        log = JsonLines(os.path.join(cfg.out_dir, 'metrics.jsonl'))
        log.drop_after(step)
        log.write({'config': asdict(cfg), 'teacher_config': d.teacher_config, 'start_step': step,
                   'stages': stage_steps(cfg), 'grid': GRID, **provenance(device_name(device))})
        return distill(d, step, log, ckpt['seconds'] if cfg.resume else 0.0)
    except StopRequested:
        print(f'stopped by {stop.reason} before distillation started: nothing to save', flush=True)
        return {'step': 0, 'stopped': stop.reason, 'checkpoint': None}
    finally:
        restore_signals()
        release()


def cli(argv=None) -> int:
    return run_main(main, parse_config(argv, DistillConfig, __doc__), given_fields(argv, DistillConfig))


if __name__ == '__main__':
    sys.exit(cli())

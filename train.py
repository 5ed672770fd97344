"""Train a DDPM UNet: python train.py --help

Single process:  python train.py --dataset shapes --preset tiny --epochs 2 --device cpu
Multi-GPU (DDP): torchrun --nproc_per_node 8 train.py --batch-size 1024
Exit codes: 0 done (or stopped by SIGTERM/Ctrl-C with a checkpoint saved), 1 a write failed
(a full disk), 2 bad input, 3 non-finite loss (the last good checkpoint is kept), 130 a
second Ctrl-C.
"""
import contextlib
import copy
import json
import math
import os
import signal
import sys
import time
import typing
import dataclasses
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data
import diffusion
import sample
from data import ConfigError, brief, check_writable, flag, one_line, pick_device
from model import MODEL_VERSION, PRESETS, UNet, count_flops, count_params, get_config, peak_tflops


@dataclass
class TrainConfig:
    preset: str = flag('ddpm-cifar10', 'UNet preset', choices=tuple(PRESETS))
    dataset: str = flag('cifar10', 'data set', choices=data.DATASETS)
    data_dir: str = flag('./data', 'CIFAR-10 root (downloaded there if missing), image folder, or .beton file '
                                   '(--dataset beton or --loader ffcv)')
    image_size: int = flag(32, 'training resolution (images are resized and centre-cropped)')
    shapes_count: int = flag(8192, 'number of images in the shapes data set')
    batch_size: typing.Optional[int] = flag(None, 'global batch size, split across DDP ranks (paper: 128; tiny: 32)')
    epochs: int = flag(2048, 'epochs to train (2048 epochs of CIFAR-10 at batch 128 ~ the paper\'s 800k steps)')
    steps: typing.Optional[int] = flag(None, 'optimizer steps to train; wins over --epochs when given')
    lr: typing.Optional[float] = flag(None, 'peak learning rate of Adam (paper: 2e-4; tiny: 2e-3)')
    warmup: typing.Optional[int] = flag(None, 'linear learning-rate warm-up steps (paper: 5000; tiny: 50)')
    grad_clip: float = flag(1.0, 'clip the global gradient norm to this (0: off)')
    ema_decay: float = flag(0.9999, 'EMA decay, ramped as min(decay, (1+step)/(10+step))')
    dropout: typing.Optional[float] = flag(None, 'dropout in residual blocks (default: the preset\'s)')
    schedule: str = flag('linear', 'beta schedule', choices=('linear', 'cosine'))
    attention: str = flag('sdpa', 'attention kernel: sdpa (F.scaled_dot_product_attention) or manual',
                           choices=('sdpa', 'manual'))
    compile: typing.Optional[bool] = flag(None, 'torch.compile the model (default: on for CUDA)')
    compile_mode: str = flag('default', 'torch.compile mode',
                              choices=('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs'))
    amp: str = flag('auto', 'autocast precision (auto: bf16 on CUDA, off on CPU)',
                     choices=('auto', 'off', 'bf16', 'fp16'))
    channels_last: typing.Optional[bool] = flag(None, 'NHWC memory format (default: on for CUDA)')
    fused_adam: typing.Optional[bool] = flag(None, 'fused Adam kernel (default: on for CUDA)')
    loader: str = flag('auto', 'data path (auto: gpu when the set fits on the GPU, else torch)',
                        choices=data.LOADERS)
    num_workers: int = flag(4, 'DataLoader workers for --loader torch')
    log_every: int = flag(100, 'steps between metrics.jsonl lines (and held-out loss)')
    heldout_size: int = flag(256, 'images in the fixed held-out set (fixed timesteps and noise)')
    sample_every: int = flag(1, 'epochs between sample grids (0: never)')
    sampler: str = flag('ddim', 'sampler for the grids', choices=('ddim', 'ddpm'))
    sample_steps: int = flag(50, 'DDIM steps for the grids (ddpm always takes all T steps)')
    num_samples: int = flag(64, 'images per sample grid')
    eval_every: int = flag(0, 'training images between evaluations (0: none): FID of EMA samples and bits/dim of '
                              'the EMA on held-out images, as metrics.jsonl rows, and OUT_DIR/curves.png')
    eval_fid: bool = flag(True, 'FID in the evaluations (Inception weights: downloaded on first use, or '
                                '--inception-weights; offline without them FID is left out with a warning)')
    eval_samples: int = flag(10000, 'EMA samples per FID, drawn with --sampler and --sample-steps (papers report '
                                    '50,000; fewer samples read higher)')
    eval_bpd_images: int = flag(1000, 'held-out images of the bits/dim estimate')
    eval_bpd_timesteps: int = flag(32, 'timesteps of the Monte Carlo bits/dim estimate: 1 + this many model calls '
                                       'per held-out image')
    inception_weights: str = flag('', 'local InceptionV3 weights for FID (torch-fidelity\'s '
                                      'weights-inception-2015-12-05-6726825d.pth); default: download')
    ckpt_every: int = flag(5000, 'steps between checkpoints (one is always written at the end)')
    out_dir: str = flag('runs', 'where ckpt.pt and metrics.jsonl go')
    samples_dir: str = flag('ddpm_samples', 'where the sample grids go')
    resume: str = flag('', 'checkpoint to resume from (must exist and match the architecture and data), or auto: '
                           'OUT_DIR/ckpt.pt when it exists, else a fresh run (for preemptible jobs)')
    seed: int = flag(0, 'seed of initialisation, data order, timesteps and noise')
    device: str = flag('auto', 'auto, cpu, cuda or cuda:N')


# Training defaults that depend on the preset, used where the flag is not given: the paper's
# recipe, except for the CPU demo model, which must show shapes after a minute on two cores.
PAPER_TRAINING = {'lr': 2e-4, 'warmup': 5000, 'batch_size': 128}
PRESET_TRAINING = {'tiny': {'lr': 2e-3, 'warmup': 50, 'batch_size': 32}}

NUM_TIMESTEPS = 1000  # T of the paper; every schedule has this many steps

# Fields a resumed run must share with its checkpoint to continue exactly.
RESUME_MUST_MATCH = ('preset', 'dataset', 'image_size', 'shapes_count', 'batch_size', 'seed', 'schedule', 'dropout')


class NonFiniteLoss(Exception):
    """The loss became NaN or inf; exit code 3."""


def parse_config(argv=None) -> TrainConfig:
    """The TrainConfig of a command line (sys.argv when argv is None)."""
    return data.parse_config(argv, TrainConfig, __doc__)


# ----------------------------------------------------------------------------- set-up

def resolve_defaults(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """Fills the 'auto' and None fields: the fast path on CUDA, plain fp32 eager on CPU."""
    cuda = device.type == 'cuda'
    recipe = {**PAPER_TRAINING, **PRESET_TRAINING.get(cfg.preset, {})}
    cfg = dataclasses.replace(cfg)
    for name, value in recipe.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    cfg.dropout = PRESETS[cfg.preset].dropout if cfg.dropout is None else cfg.dropout
    cfg.amp = ('bf16' if cuda and torch.cuda.is_bf16_supported() else 'off') if cfg.amp == 'auto' else cfg.amp
    if cfg.loader == 'ffcv':
        cfg.dataset = 'beton'  # FFCV reads the .beton file given as --data-dir
    for name in ('compile', 'channels_last', 'fused_adam'):
        if getattr(cfg, name) is None:
            setattr(cfg, name, cuda)
    return cfg


def validate(cfg: TrainConfig, device: torch.device, world_size: int):
    """Every flag checked before any work, each failure one ConfigError line."""
    def require(ok: bool, message: str):
        if not ok:
            raise ConfigError(message)
    require(cfg.batch_size >= 1, f'--batch-size must be at least 1, got {cfg.batch_size}')
    require(cfg.batch_size % world_size == 0, f'--batch-size {cfg.batch_size} does not split evenly over '
                                                f'{world_size} ranks')
    require(cfg.steps is None or cfg.steps >= 1, f'--steps must be at least 1, got {cfg.steps}')
    require(cfg.steps is not None or cfg.epochs >= 1, f'--epochs must be at least 1, got {cfg.epochs}')
    require(math.isfinite(cfg.lr) and cfg.lr > 0, f'--lr must be a positive number, got {cfg.lr}')
    require(cfg.warmup >= 0, f'--warmup must be 0 or more steps, got {cfg.warmup}')
    require(math.isfinite(cfg.grad_clip) and cfg.grad_clip >= 0, f'--grad-clip must be 0 (off) or positive, '
                                                                   f'got {cfg.grad_clip}')
    require(0 <= cfg.ema_decay < 1, f'--ema-decay must be in [0, 1), got {cfg.ema_decay}')
    require(0 <= cfg.dropout < 1, f'--dropout must be in [0, 1), got {cfg.dropout}')
    require(cfg.num_workers >= 0, f'--num-workers must be 0 or more, got {cfg.num_workers}')
    for name in ('log_every', 'num_samples', 'heldout_size', 'shapes_count'):
        require(getattr(cfg, name) >= 1, f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    for name in ('eval_samples', 'eval_bpd_images'):
        require(getattr(cfg, name) >= 1, f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    require(1 <= cfg.eval_bpd_timesteps < NUM_TIMESTEPS, f'--eval-bpd-timesteps must be in [1, {NUM_TIMESTEPS - 1}], '
                                                         f'got {cfg.eval_bpd_timesteps}')
    require(not cfg.inception_weights or os.path.isfile(cfg.inception_weights),
            f'--inception-weights {cfg.inception_weights}: no such file')
    for name in ('sample_every', 'ckpt_every', 'eval_every'):
        require(getattr(cfg, name) >= 0, f"--{name.replace('_', '-')} must be 0 (never) or more, "
                                         f"got {getattr(cfg, name)}")
    require(1 <= cfg.sample_steps <= NUM_TIMESTEPS, f'--sample-steps must be in [1, {NUM_TIMESTEPS}] '
                                                    f'(the schedule has T={NUM_TIMESTEPS}), got {cfg.sample_steps}')
    require(not (cfg.amp == 'fp16' and device.type != 'cuda'), f'--amp fp16 needs a CUDA device ({device} has no '
                                                               f'fast fp16 training); use --amp bf16 or --amp off')
    require(not (cfg.amp == 'bf16' and device.type == 'cuda' and not torch.cuda.is_bf16_supported()),
            '--amp bf16: this GPU does not support bf16; use --amp fp16')
    ffcv_missing = data.ffcv_missing_reason() if cfg.dataset == 'beton' else None  # importing ffcv costs seconds
    require(not ffcv_missing, f'--loader ffcv / --dataset beton: {ffcv_missing}')
    try:
        model_config_of(cfg)
    except ValueError as error:
        raise ConfigError(f'--image-size {cfg.image_size}: {error}') from None


def resolve_resume(cfg: TrainConfig) -> TrainConfig:
    """--resume auto resumes from OUT/ckpt.pt when there is one and starts fresh otherwise; a
    fresh run never overwrites a checkpoint (nor appends to another run's metrics.jsonl)."""
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    if cfg.resume == 'auto':
        return dataclasses.replace(cfg, resume=ckpt_path if os.path.isfile(ckpt_path) else '')
    if not cfg.resume and os.path.isfile(ckpt_path):
        raise ConfigError(f'{ckpt_path} exists: continue that run with --resume {ckpt_path} (or --resume auto), '
                          f'or pass another --out-dir')
    into_another_run = (cfg.resume and os.path.isfile(cfg.resume) and os.path.isfile(ckpt_path)
                        and not os.path.samefile(cfg.resume, ckpt_path))
    if into_another_run:
        raise ConfigError(f'--resume {cfg.resume} into --out-dir {cfg.out_dir}, which holds another run\'s '
                          f'checkpoint: pass an empty --out-dir, or resume that run')
    return cfg


def target_reached(ckpt: dict, cfg: TrainConfig) -> bool:
    """Whether a checkpoint already holds the run's last step (--steps, or --epochs whole epochs)."""
    return ckpt['step'] >= cfg.steps if cfg.steps else ckpt['epoch'] >= cfg.epochs


def setup_distributed():
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) without it."""
    world_size = int(os.environ.get('WORLD_SIZE', 1))
    if world_size == 1:
        return 0, 0, 1
    rank, local_rank = int(os.environ['RANK']), int(os.environ['LOCAL_RANK'])
    return rank, local_rank, world_size


def init_process_group(device: torch.device, rank: int, world_size: int):
    if world_size == 1:
        return None
    if device.type == 'cuda':
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo', rank=rank, world_size=world_size)
    # A CPU group for control flags (stop, non-finite loss): no GPU synchronisation.
    return dist.new_group(backend='gloo')


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr over cfg.warmup steps, then constant (the paper's schedule)."""
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup) if cfg.warmup > 0 else cfg.lr


def ema_decay_at(step: int, cfg: TrainConfig) -> float:
    """The EMA decay ramps up from 0.1 so that short runs have a useful EMA; it reaches the
    paper's 0.9999 after ~90k steps."""
    return min(cfg.ema_decay, (1 + step) / (10 + step))


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float):
    """ema = decay * ema + (1 - decay) * model, in one fused multi-tensor kernel."""
    ema_params, params = list(ema.parameters()), list(model.parameters())
    torch._foreach_lerp_(ema_params, params, 1.0 - decay)


def autocast(cfg: TrainConfig, device: torch.device):
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(cfg.amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(state: dict, path: str):
    """Writes to a temporary file, then renames: a crash mid-write leaves the old file intact."""
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str, cfg: TrainConfig, model_config, world_size: int) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f'--resume {path}: no such checkpoint')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as error:
        raise ConfigError(f'--resume {path}: cannot load it ({brief(error)})') from None
    sample.check_model_version(ckpt, f'--resume {path}')
    try:
        check_resumable(ckpt, path, cfg, model_config, world_size)
    except (KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f'--resume {path}: not a complete train.py checkpoint ({brief(error)})') from None
    return ckpt


def check_resumable(ckpt: dict, path: str, cfg: TrainConfig, model_config, world_size: int):
    """The architecture, the settings of an exact resume and the rank count must match."""
    theirs = ckpt.get('model_config') or {}
    diffs = [f'{k}={theirs.get(k)!r} (now {v!r})' for k, v in asdict(model_config).items()
             if theirs.get(k) != v and k not in ('attention', 'dropout')]  # these two hold no weights
    if diffs:
        raise ConfigError(f'--resume {path}: the checkpoint is another architecture: {", ".join(diffs)}')
    saved = ckpt['config']
    for name in RESUME_MUST_MATCH:
        if saved[name] != getattr(cfg, name):
            raise ConfigError(f'--resume {path}: the checkpoint has --{name.replace("_", "-")} {saved[name]}, '
                              f'this run {getattr(cfg, name)}; an exact resume needs the same value')
    if len(ckpt['rng']) != world_size:
        raise ConfigError(f'--resume {path}: written by {len(ckpt["rng"])} ranks, this run has {world_size}')


# ----------------------------------------------------------------------------- the run

class StopRequested(Exception):
    """Raised by a signal inside an interruptible section (evaluation, a grid)."""


class StopFlag:
    """Set by SIGTERM or Ctrl-C; the loop finishes its step, saves and exits. A signal that
    comes during an evaluation or a grid cuts it short (a preempted job has seconds, not
    minutes). A second Ctrl-C aborts at once."""

    def __init__(self):
        self.reason, self.in_interruptible = None, 0

    def __call__(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        if self.in_interruptible:
            raise StopRequested(self.reason)

    def install(self):
        previous = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(s, h) for s, h in previous.items()]

    @contextlib.contextmanager
    def interruptible(self):
        """Work inside may be abandoned by a signal (StopRequested); none of it starts once
        a stop is requested."""
        if self.reason is not None:
            raise StopRequested(self.reason)
        self.in_interruptible += 1
        try:
            yield
        finally:
            self.in_interruptible -= 1


def any_rank(flag: bool, group) -> bool:
    if group is None:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


@torch.no_grad()
def ranks_identical(model: torch.nn.Module, control_group) -> bool:
    """Compares every rank's weights with rank 0's, bit for bit."""
    weights = torch.nn.utils.parameters_to_vector(model.parameters())
    reference = weights.clone()
    dist.broadcast(reference, src=0)
    return not any_rank(not torch.equal(weights, reference), control_group)


@torch.no_grad()
def heldout_losses(model, sched, heldout, cfg: TrainConfig, device) -> torch.Tensor:
    """Per-image training loss on fixed images, timesteps and noise (no flips, no dropout):
    comparable across steps, runs and settings. Returns (N,) on the CPU."""
    was_training = model.training
    model.eval()
    images, t, noise = heldout
    losses = []
    try:
        for chunk in torch.arange(len(images), device=device).split(cfg.batch_size):
            x0 = data.to_model_input(images[chunk], torch.zeros_like(chunk, dtype=torch.bool))
            if cfg.channels_last:
                x0 = x0.contiguous(memory_format=torch.channels_last)
            with autocast(cfg, device):
                losses.append(diffusion.training_loss(model, sched, x0, t[chunk], noise[chunk], per_example=True))
    finally:  # also when a stop cuts the evaluation short: training goes on in training mode
        model.train(was_training)
    return torch.cat(losses).cpu()


def heldout_loss(model, sched, heldout, cfg: TrainConfig, device) -> float:
    return heldout_losses(model, sched, heldout, cfg, device).mean().item()


def make_heldout(cfg: TrainConfig, device, num_steps: int):
    images = data.load_heldout(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.heldout_size).to(device)
    generator = torch.Generator().manual_seed(12345)
    t = (torch.arange(len(images)) * num_steps // len(images)).to(device)  # evenly spread timesteps
    noise = torch.randn(images.shape, generator=generator).to(device)
    return images, t, noise


@torch.no_grad()
def write_sample_grid(ema, sched, cfg: TrainConfig, device, path: str):
    from torchvision.utils import save_image
    shape = (cfg.num_samples, 3, cfg.image_size, cfg.image_size)
    generator = torch.Generator(device).manual_seed(cfg.seed)  # the same noise for every grid
    with autocast(cfg, device):
        if cfg.sampler == 'ddpm':
            images = diffusion.ddpm_sample(ema, sched, shape, generator, device)
        else:
            images = diffusion.ddim_sample(ema, sched, shape, cfg.sample_steps, generator=generator, device=device)
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    save_image((images.float() + 1) / 2, path, nrow=int(math.sqrt(cfg.num_samples)) or 1)


def precision_name(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.amp != 'off':
        return cfg.amp
    return 'tf32' if device.type == 'cuda' and torch.backends.cudnn.allow_tf32 else 'fp32'


def main(cfg: TrainConfig) -> dict:
    rank, local_rank, world_size = setup_distributed()
    device = pick_device(cfg.device, local_rank)
    cfg = resolve_defaults(resolve_resume(cfg), device)
    validate(cfg, device, world_size)
    model_config = model_config_of(cfg)
    ckpt = load_checkpoint(cfg.resume, cfg, model_config, world_size) if cfg.resume else None
    if ckpt is not None and target_reached(ckpt, cfg):
        target = f'--steps {cfg.steps}' if cfg.steps else f'--epochs {cfg.epochs}'
        past = ckpt['step'] > cfg.steps if cfg.steps else (ckpt['epoch'], ckpt['batch_in_epoch']) > (cfg.epochs, 0)
        print(f"{cfg.resume} holds step {ckpt['step']} (epoch {ckpt['epoch']}, batch {ckpt['batch_in_epoch']}), "
              f"{'past' if past else 'at'} the target {target}: nothing to train. Raise {target.split()[0]} to "
              f"train on.", flush=True)
        return {'step': ckpt['step'], 'stopped': None, 'last': {}, 'checkpoint': cfg.resume, 'already_done': True}
    check_writable(cfg.out_dir, '--out-dir')
    if cfg.sample_every:
        check_writable(cfg.samples_dir, '--samples-dir')
    if rank == 0:
        remove_stale_temporary(os.path.join(cfg.out_dir, 'ckpt.pt'))
        if ckpt is None:
            set_aside_old_metrics(cfg.out_dir)
    stop = StopFlag()
    restore_signals = stop.install()
    control_group = init_process_group(device, rank, world_size)
    try:
        # A stop during start-up (data, model, reference statistics) ends the run at once in
        # a single process: nothing has been trained, nothing is lost. Under DDP the ranks
        # must first meet in the loop, where they agree on stops.
        with stop.interruptible() if world_size == 1 else contextlib.nullcontext():
            run = build_run(cfg, device, rank, world_size, progress=rank == 0)
            if ckpt is not None:
                check_same_data(ckpt, run, cfg.resume)
            step = restore(run, ckpt) if ckpt else 0
            logger, evaluator = start_logging(run, step, stop, control_group)
            logger.train_seconds = ckpt.get('train_seconds', 0.0) if ckpt else 0.0
        return train(run, step, logger, evaluator, control_group, eval_owed=bool(ckpt and ckpt.get('eval_owed')))
    except StopRequested:
        print(f'stopped by {stop.reason} before training started: nothing to save', flush=True)
        return {'step': ckpt['step'] if ckpt else 0, 'stopped': stop.reason, 'last': {}, 'checkpoint': cfg.resume}
    finally:
        restore_signals()
        if world_size > 1:
            dist.destroy_process_group()


def start_logging(run: 'Run', step: int, stop: 'StopFlag', control_group) -> tuple:
    """The Logger and (with --eval-every) the Evaluator. Their start-up work (held-out images,
    Inception network, reference statistics) runs on every rank or on rank 0; if it fails on
    any rank, every rank stops with an error instead of leaving the others in a collective."""
    cfg = run.cfg
    total_steps = cfg.steps or cfg.epochs * run.loader.batches_per_epoch

    def make():
        logger = Logger(run, step, total_steps, stop)
        return logger, Evaluator(run, logger, control_group) if cfg.eval_every else None
    logger, evaluator = on_all_ranks(make, control_group)
    if evaluator is not None and any_rank(cfg.eval_fid and evaluator.extractor is None, control_group):
        evaluator.extractor = evaluator.reference = None  # FID on every rank or on none
    logger.interval_start = time.perf_counter()  # the reference statistics are not training time
    return logger, evaluator


def on_all_ranks(make, control_group):
    """make() on this rank; if it raised a ConfigError, DataError or OSError on any rank,
    every rank raises (a lone failure would leave the others waiting in a collective)."""
    error = None
    try:
        result = make()
    except (ConfigError, data.DataError, OSError) as failure:
        error, result = failure, None
    if any_rank(error is not None, control_group):
        raise error or ConfigError('another rank failed during start-up (its error is above)')
    return result


def remove_stale_temporary(ckpt_path: str):
    """A ckpt.pt.tmp left by a write that was killed is garbage (the rename never happened)."""
    tmp = ckpt_path + '.tmp'
    if os.path.exists(tmp):
        os.remove(tmp)
        print(f'removed {tmp}, left by a checkpoint write that did not finish ({ckpt_path} is intact)', flush=True)


def set_aside_old_metrics(out_dir: str):
    """A fresh run in a folder whose earlier run left metrics but no checkpoint (it failed or
    was stopped before its first one) starts its own metrics.jsonl; the old one is kept."""
    path = os.path.join(out_dir, 'metrics.jsonl')
    if os.path.exists(path):
        number = next(n for n in range(1, 10 ** 6) if not os.path.exists(f'{path}.{n}'))
        os.replace(path, f'{path}.{number}')
        print(f'{path} of an earlier run without a checkpoint kept as {path}.{number}', flush=True)


def check_same_data(ckpt: dict, run: 'Run', path: str):
    """An exact resume needs the same images: the checkpoint records their count and fingerprint."""
    saved = ckpt.get('data')
    if saved is None:
        return  # a checkpoint from before fingerprints: the config check is all there is
    if saved['count'] != run.num_images or saved['fingerprint'] != run.data_fingerprint:
        raise ConfigError(f"--resume {path}: the checkpoint was trained on another data set ({saved['count']} images, "
                          f"fingerprint {saved['fingerprint'][:12]}); {run.cfg.data_dir} has {run.num_images} images, "
                          f"fingerprint {run.data_fingerprint[:12]}")


def model_config_of(cfg: TrainConfig):
    return get_config(cfg.preset, image_size=cfg.image_size, dropout=cfg.dropout, attention=cfg.attention)


@dataclass
class Run:
    """Everything one training process holds. `net` is what the step calls (the model, maybe
    wrapped in DDP and torch.compile); `model` the plain module whose state is saved."""
    cfg: TrainConfig
    device: torch.device
    rank: int
    world_size: int
    model: torch.nn.Module
    ema: typing.Optional[torch.nn.Module]
    net: typing.Callable
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sched: diffusion.Schedule
    loader: typing.Any
    loader_kind: str
    num_images: int
    data_fingerprint: str


def build_run(cfg: TrainConfig, device, rank=0, world_size=1, dataset=None, progress=True, make_model=None) -> Run:
    """Model, EMA, optimizer, schedule and loader for a resolved config (see resolve_defaults).
    make_model(config) builds another network in place of ours (the benchmark's peer row)."""
    torch.manual_seed(cfg.seed)
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    if dataset is None:
        dataset = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.shapes_count)
    first = dataset[0]  # decoding one image is not free (a folder, a .beton): once
    stored = tuple(first.shape[-2:])
    if stored != (cfg.image_size, cfg.image_size):
        raise data.DataError(f'the images of {cfg.data_dir} are {stored[0]}x{stored[1]}, not --image-size '
                             f'{cfg.image_size}: pass --image-size {stored[0]} or rewrite the .beton')
    loader_kind = data.choose_loader(cfg.loader, len(dataset) * first.numel(), device)
    loader = data.make_loader(loader_kind, dataset, cfg.batch_size // world_size, cfg.seed, device,
                              cfg.num_workers, rank, world_size, progress=progress)
    model = (make_model or UNet)(model_config_of(cfg)).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = copy.deepcopy(model).eval().requires_grad_(False) if rank == 0 else None
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=cfg.fused_adam or None)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == 'fp16')
    torch.manual_seed(cfg.seed + rank)  # each rank its own timesteps, noise and dropout
    net = model
    if world_size > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda' else None)
    if cfg.compile:
        net = torch.compile(net, mode=None if cfg.compile_mode == 'default' else cfg.compile_mode)
    return Run(cfg, device, rank, world_size, model, ema, net, optimizer, scaler,
               diffusion.make_schedule(NUM_TIMESTEPS, cfg.schedule).to(device), loader, loader_kind, len(dataset),
               data.fingerprint(dataset))


def restore(run: Run, ckpt: dict) -> int:
    """Loads a checkpoint into the run; returns the step to continue from."""
    run.model.load_state_dict(ckpt['model'])
    if run.ema is not None:
        run.ema.load_state_dict(ckpt['ema'])
    run.optimizer.load_state_dict(ckpt['optimizer'])
    run.scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt['rng'][run.rank]
    torch.set_rng_state(rng['cpu'])
    if run.device.type == 'cuda' and rng.get('cuda') is not None:
        torch.cuda.set_rng_state(rng['cuda'], run.device)
    return ckpt['step']


def train_step(run: Run, x0: torch.Tensor, step: int) -> torch.Tensor:
    """One optimizer step on a batch; returns the loss without synchronising with the host."""
    cfg = run.cfg
    if cfg.channels_last:
        x0 = x0.contiguous(memory_format=torch.channels_last)
    for group in run.optimizer.param_groups:
        group['lr'] = lr_at(step, cfg)
    with autocast(cfg, run.device):
        loss = diffusion.training_loss(run.net, run.sched, x0)
    run.scaler.scale(loss).backward()
    if cfg.grad_clip > 0:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)  # no host sync
    run.scaler.step(run.optimizer)  # fused Adam takes the inf check on the device: no host sync
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        ema_update(run.ema, run.model, ema_decay_at(step, cfg))
    return loss.detach()


def batches(run: Run, step: int):
    """The run's batches from `step` on, across epochs."""
    while True:
        epoch, start = divmod(step, run.loader.batches_per_epoch)
        for x0 in run.loader.epoch(epoch, start):
            yield x0
            step += 1


def checkpoint_state(run: Run, step: int, control_group, eval_owed: bool = False, train_seconds: float = 0.0) -> dict:
    """The checkpoint dict; every rank must call it (the RNG states of all ranks are gathered).
    eval_owed: an evaluation due at this step did not run (a stop came first); train_seconds:
    the training time so far, so that a resumed run's evaluations count training hours on."""
    rng = {'cpu': torch.get_rng_state(),
           'cuda': torch.cuda.get_rng_state(run.device) if run.device.type == 'cuda' else None}
    rng_all = [rng]
    if run.world_size > 1:
        rng_all = [None] * run.world_size
        dist.all_gather_object(rng_all, rng, group=control_group)
    epoch, batch = divmod(step, run.loader.batches_per_epoch)
    return {'model': run.model.state_dict(), 'ema': run.ema.state_dict() if run.ema is not None else None,
            'optimizer': run.optimizer.state_dict(), 'scaler': run.scaler.state_dict(), 'step': step,
            'epoch': epoch, 'batch_in_epoch': batch, 'config': asdict(run.cfg),
            'model_config': asdict(run.model.config), 'model_version': MODEL_VERSION, 'rng': rng_all,
            'data': {'count': run.num_images, 'fingerprint': run.data_fingerprint}, 'eval_owed': eval_owed,
            'train_seconds': train_seconds}


def total_loss(loss_sum: torch.Tensor, run: Run) -> float:
    """Sums a device tensor over ranks and reads it: the host synchronisation of a log interval."""
    if run.world_size > 1:
        loss_sum = loss_sum.clone()
        dist.all_reduce(loss_sum)
    return loss_sum.item()


class Logger:
    """metrics.jsonl, the progress bar and the held-out loss; active on rank 0 only.

    Speed is of the training steps alone: the clock is paused while a grid, a checkpoint or
    the held-out loss is computed, and the first step of a process (which compiles) is timed
    on its own as `first_step_s`. `train_seconds` sums the timed training time."""

    def __init__(self, run: Run, step: int, total_steps: int, stop: StopFlag = None):
        cfg, self.run, self.stop = run.cfg, run, stop or StopFlag()
        self.active = run.rank == 0
        self.path = os.path.join(cfg.out_dir, 'metrics.jsonl')
        self.flops = count_flops(run.model.config, cfg.image_size)
        name = torch.cuda.get_device_name(run.device) if run.device.type == 'cuda' else ''
        self.peak = peak_tflops(name, precision_name(cfg, run.device)) if name else None
        self.heldout = make_heldout(cfg, run.device, run.sched.num_steps) if self.active else None
        self.bar = tqdm(total=total_steps, initial=step, disable=not self.active, dynamic_ncols=True, desc='train')
        self.first_step_s, self.untimed_steps = None, 1  # the first step compiles: timed apart
        self.interval_start, self.paused_s, self.train_seconds, self.last = time.perf_counter(), 0.0, 0.0, {}
        self.grids, self.curves_drawn = [], 0.0
        if self.active:
            self.write({'config': asdict(cfg), 'model_config': asdict(run.model.config), 'start_step': step,
                        'world_size': run.world_size, 'loader': run.loader_kind, 'device': str(run.device),
                        'data': {'count': run.num_images, 'fingerprint': run.data_fingerprint}})
            self.print(f'{cfg.preset}: {count_params(run.model) / 1e6:.2f}M parameters, '
                       f'{self.flops["train"] / 1e9:.2f} GFLOP/image per training step; {run.num_images} images, '
                       f'loader {run.loader_kind}, {run.world_size} rank(s), {total_steps} steps of batch '
                       f'{cfg.batch_size} on {run.device} (amp {cfg.amp}, compile {cfg.compile})')

    def print(self, message: str):
        if self.active:
            tqdm.write(message)

    def warn(self, message: str):
        if self.active:
            tqdm.write(f'warning: {message}', file=sys.stderr)

    def write(self, row: dict):
        with open(self.path, 'a') as f:
            f.write(json.dumps(row) + '\n')

    def after_first_step(self):
        """Waits for the first step (one host sync per process) and starts the clock after it."""
        if self.first_step_s is None:
            synchronize(self.run.device)
            self.first_step_s = time.perf_counter() - self.interval_start
            self.interval_start, self.paused_s = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside is not training time (grids, checkpoints)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - start

    def interval(self, step: int, steps: int, mean_loss: float, evaluate: bool = True):
        """A metrics row for the `steps` steps since the last one. img/s is the whole job's;
        MFU is per GPU (one rank's share of the throughput over one GPU's peak)."""
        cfg = self.run.cfg
        seconds = time.perf_counter() - self.interval_start - self.paused_s
        timed = steps - self.untimed_steps
        self.untimed_steps = 0
        self.train_seconds += seconds
        img_per_s = timed * cfg.batch_size / seconds if timed > 0 and seconds > 0 else None
        per_gpu = img_per_s / self.run.world_size if img_per_s else None
        row = {'kind': 'train', 'step': step, 'images_seen': step * cfg.batch_size,
               'epoch': step / self.run.loader.batches_per_epoch, 'loss': mean_loss,
               'lr': lr_at(step - 1, cfg), 'img_per_s': img_per_s, 'img_per_s_per_gpu': per_gpu,
               'mfu': per_gpu * self.flops['train'] / (self.peak * 1e12) if self.peak and per_gpu else None,
               'train_hours': self.train_seconds / 3600}
        if not self.last:
            row['first_step_s'] = self.first_step_s  # compilation and the first step, kept out of img/s
        if self.active:
            if evaluate:
                try:
                    with self.stop.interruptible():
                        row['heldout_loss'] = heldout_loss(self.run.model, self.run.sched, self.heldout, cfg,
                                                           self.run.device)
                        row['heldout_loss_ema'] = heldout_loss(self.run.ema, self.run.sched, self.heldout, cfg,
                                                               self.run.device)
                except StopRequested:
                    row.pop('heldout_loss', None)  # cut short by a stop: the row without it
            self.write(row)
            self.bar.set_postfix(loss=f'{mean_loss:.4f}', img_s=f'{img_per_s or 0:.0f}')
            if self.run.cfg.eval_every:
                self.curves()
        self.last = row
        self.interval_start, self.paused_s = time.perf_counter(), 0.0

    def curves(self, force: bool = False):
        """Redraws OUT/curves.png (at every evaluation and at the end; after a log row at most
        once every 30 s, since matplotlib costs about a second)."""
        if not self.active or (not force and time.perf_counter() - self.curves_drawn < 30):
            return
        with self.paused():
            write_curves(self.path, os.path.join(self.run.cfg.out_dir, 'curves.png'))
        self.curves_drawn = time.perf_counter()

    def training_seconds(self) -> float:
        """Training time so far: the logged intervals and the current one, pauses left out."""
        return self.train_seconds + time.perf_counter() - self.interval_start - self.paused_s

    def evaluate(self, evaluator: 'Evaluator', step: int) -> bool:
        """An evaluation row; False if a stop cut it short (in a single process; under DDP the
        ranks are inside collectives, so it finishes)."""
        hours = self.training_seconds() / 3600
        with self.paused():
            try:
                with self.stop.interruptible() if self.run.world_size == 1 else contextlib.nullcontext():
                    row = evaluator(step, hours)
            except StopRequested:
                self.print(f'evaluation at step {step} left out: a stop was requested; the resumed run owes it')
                return False
        if self.active:
            self.write(row)
            fid = f", FID {row['fid']:.2f} ({row['fid_samples']} samples)" if 'fid' in row else ''
            self.print(f"eval at {row['images_seen']:,} images ({row['train_hours']:.3f} training hours): bits/dim "
                       f"{row['bpd']:.4f} +- {row['bpd_stderr'] or 0:.4f}{fid}; {row['eval_seconds']:.1f} s")
            self.curves(force=True)
        return True

    def grid(self, path: str):
        """A grid of EMA samples; a failure to write it is reported and training goes on."""
        run = self.run
        if run.ema is None:
            return
        with self.paused():
            try:
                with self.stop.interruptible():
                    write_sample_grid(run.ema, run.sched, run.cfg, run.device, path)
                self.grids.append(path)
            except StopRequested:
                self.print(f'{path}: left out, a stop was requested')
            except OSError as error:
                self.warn(f'could not write the sample grid {path} ({brief(error)}); training goes on')


class Evaluator:
    """FID of EMA samples and a Monte Carlo estimate of the EMA's bits/dim on held-out images,
    every --eval-every training images. Every rank takes a share (batches of samples, held-out
    images), so that none waits idle into a timeout; rank 0 gathers, writes the row and draws
    the curves. The reference statistics are computed (or read from their cache) at the start,
    so that a missing data set or Inception network shows before training, not after."""

    def __init__(self, run: Run, logger: 'Logger', control_group=None):
        cfg, self.run, self.logger, self.control_group = run.cfg, run, logger, control_group
        self.images = data.load_heldout(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.eval_bpd_images)
        self.extractor = self.reference = None
        if cfg.eval_fid:
            try:
                self.extractor = sample.inception_extractor(cfg.inception_weights, run.device)
            except ConfigError as error:
                logger.warn(f'FID is left out of the evaluations: {error}')
        if self.extractor is not None and run.rank == 0:
            self.reference = sample.reference_statistics(cfg.dataset, cfg.data_dir, cfg.image_size, self.extractor,
                                                         self.batch_size)
        self.sampling = sample.SampleConfig(num=cfg.eval_samples, batch_size=self.batch_size, sampler=cfg.sampler,
                                            steps=cfg.sample_steps, seed=cfg.seed, amp='auto')

    @property
    def batch_size(self) -> int:
        return max(self.run.cfg.batch_size // self.run.world_size, 1)

    def due(self, step: int) -> bool:
        """At the first step at or past each multiple of --eval-every images (so runs of any batch
        size evaluate at the same image counts, and a resumed run keeps the schedule)."""
        every, batch = self.run.cfg.eval_every, self.run.cfg.batch_size
        return bool(every) and step * batch // every > (step - 1) * batch // every

    def ema_on_every_rank(self) -> torch.nn.Module:
        run = self.run
        if run.world_size == 1:
            return run.ema
        ema = run.ema if run.rank == 0 else copy.deepcopy(run.model).eval()
        for tensor in ema.state_dict().values():
            dist.broadcast(tensor, src=0)
        return ema

    @torch.no_grad()
    def __call__(self, step: int, train_hours: float) -> dict:
        run, cfg = self.run, self.run.cfg
        start = time.perf_counter()
        ema = self.ema_on_every_rank()
        generator = torch.Generator(run.device).manual_seed(cfg.seed * 1_000_003 + step * 131 + run.rank)
        mine = self.images[run.rank::run.world_size]
        bits = sample.bits_per_image(ema, run.sched, mine, self.batch_size, run.device, generator,
                                     cfg.eval_bpd_timesteps, amp='off', progress=False)
        features = None
        if self.extractor is not None:
            batches = sample.draw(ema, run.model.config, run.sched, self.sampling, run.device, progress=False,
                                  rank=run.rank, world_size=run.world_size)
            features = sample.features_of(batches, self.extractor).astype('float32')
        bits, features = gather_to_rank0((bits, features), run, self.control_group)
        if run.rank != 0:
            return {}
        row = {'kind': 'eval', 'step': step, 'images_seen': step * cfg.batch_size, 'train_hours': train_hours}
        summary = sample.summarise_bits({k: torch.cat([b[k] for b in bits]) for k in bits[0]},
                                        cfg.eval_bpd_timesteps, run.sched.num_steps)
        row.update(bpd=summary['bits_per_dim'], bpd_stderr=summary['stderr'], bpd_images=summary['images'],
                   bpd_model_calls_per_image=summary['model_calls_per_image'])
        if self.extractor is not None:
            stats = sample.statistics(np.concatenate(features).astype('float64'))
            row.update(fid=sample.frechet_distance(stats, self.reference), fid_samples=cfg.eval_samples,
                       fid_sampler=f'{cfg.sampler}-{cfg.sample_steps if cfg.sampler == "ddim" else NUM_TIMESTEPS}')
        row['eval_seconds'] = time.perf_counter() - start
        return row


def gather_to_rank0(values: tuple, run: Run, group) -> list:
    """For each of the values, the list of every rank's on rank 0 (None elsewhere), through
    the CPU control group."""
    if run.world_size == 1:
        return [[item] for item in values]
    gathered = [None] * run.world_size if run.rank == 0 else None
    dist.gather_object(values, gathered, dst=0, group=group)
    return [list(items) for items in zip(*gathered)] if run.rank == 0 else [None] * len(values)


def write_curves(metrics_path: str, png_path: str):
    """OUT/curves.png from metrics.jsonl: training and held-out losses, bits/dim (with its
    standard error) and FID against training images seen, training hours on the top axis."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train_rows = [r for r in rows if r.get('kind') == 'train']
    eval_rows = [r for r in rows if r.get('kind') == 'eval']
    panels = [('loss', train_rows)] + [(name, eval_rows) for name in ('bpd', 'fid') if any(name in r for r in eval_rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (name, source) in zip(axes[0], panels):
        if name == 'loss':
            for key, label in (('loss', 'training loss'), ('heldout_loss', 'held-out loss'),
                               ('heldout_loss_ema', 'held-out loss, EMA')):
                points = [(r['images_seen'], r[key]) for r in source if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), marker='.', label=label)
            if ax.lines:
                ax.set_yscale('log')
                ax.legend(fontsize=8)
        else:
            points = [r for r in source if r.get(name) is not None]
            errors = [r.get('bpd_stderr') or 0 for r in points] if name == 'bpd' else None
            ax.errorbar([r['images_seen'] for r in points], [r[name] for r in points], yerr=errors, marker='o',
                        capsize=3)
        ax.set_ylabel({'loss': 'loss (eps MSE)', 'bpd': 'bits/dim (EMA, held-out)', 'fid': 'FID (EMA samples)'}[name])
        ax.set_xlabel('training images seen')
        ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=''))  # 20k, 1.5M: long counts overlap
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(6))
        ax.grid(alpha=0.3)
        add_hours_axis(ax, rows)
    fig.tight_layout()
    fig.savefig(png_path + '.tmp.png', dpi=100)
    plt.close(fig)
    os.replace(png_path + '.tmp.png', png_path)


def add_hours_axis(ax, rows: list):
    """Training hours (evaluation, grids and checkpoints left out) as a top axis."""
    latest = {}  # images seen -> hours; the mapping must rise strictly both ways for np.interp
    for r in rows:
        if r.get('train_hours') is not None and 'images_seen' in r:
            latest[r['images_seen']] = max(r['train_hours'], latest.get(r['images_seen'], 0.0))
    pairs, top_hours = [], -1.0
    for images_seen, hours in sorted(latest.items()):
        if hours > top_hours:
            pairs.append((images_seen, hours))
            top_hours = hours
    if len(pairs) < 2:
        return
    images, hours = (np.array(v, dtype=float) for v in zip(*pairs))
    top = ax.secondary_xaxis('top', functions=(lambda x: np.interp(x, images, hours),
                                               lambda h: np.interp(h, hours, images)))
    top.set_xlabel('training hours', fontsize=8)
    import matplotlib.ticker
    top.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))


def synchronize(device: torch.device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def train(run: Run, step: int, logger: 'Logger', evaluator: 'Evaluator' = None, control_group=None,
          eval_owed: bool = False) -> dict:
    """The loop: steps, then at the right steps a log line, a checkpoint, an evaluation, a stop
    check and a sample grid. The device is only synchronised at log intervals and checkpoints.
    On SIGTERM or Ctrl-C the step finishes and the checkpoint is saved at once: no evaluation
    (it is owed to the resumed run), no grid."""
    cfg, per_epoch, stop = run.cfg, run.loader.batches_per_epoch, logger.stop
    total_steps = cfg.steps or cfg.epochs * per_epoch
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    last_good = f'{cfg.resume} (step {step}, resumed from)' if cfg.resume else None
    loss_sum, unlogged, stopped = torch.zeros((), device=run.device), 0, None
    start_time = time.perf_counter()
    if eval_owed and evaluator is not None:  # the stop of the last run came at an evaluation
        eval_owed = not logger.evaluate(evaluator, step)
    try:
        for x0 in batches(run, step):
            loss_sum += train_step(run, x0, step)
            step, unlogged = step + 1, unlogged + 1
            logger.after_first_step()
            logger.bar.update(1)
            at_end = step >= total_steps
            if run.world_size == 1:
                stopped = stop.reason
            elif step % 10 == 0 or at_end:  # ranks agree on a stop every 10 steps (every rank must call)
                if any_rank(stop.reason is not None, control_group):
                    stopped = stop.reason or 'a signal on another rank'
            eval_owed = eval_owed or (evaluator is not None and evaluator.due(step))
            must_save = (cfg.ckpt_every and step % cfg.ckpt_every == 0) or at_end or stopped
            if step % cfg.log_every == 0 or at_end or (must_save and unlogged):
                # Never log or save past a non-finite loss.
                mean_loss = total_loss(loss_sum, run) / (unlogged * run.world_size)
                if not math.isfinite(mean_loss):
                    raise NonFiniteLoss(f'the loss became {mean_loss} between steps {step - unlogged + 1} and '
                                        f'{step}; stopping. ' + (f'The last good checkpoint is {last_good}.'
                                        if last_good else 'No checkpoint was written by this run.'))
                logger.interval(step, unlogged, mean_loss, evaluate=not stopped)
                loss_sum.zero_()
                unlogged = 0
            if eval_owed and not stopped:
                eval_owed = not logger.evaluate(evaluator, step)
            if must_save:  # before the grid: a failing grid never costs a checkpoint
                with logger.paused():
                    state = checkpoint_state(run, step, control_group, eval_owed, logger.training_seconds())
                    if run.rank == 0:
                        save_checkpoint(state, ckpt_path)
                last_good = f'{ckpt_path} (step {step})'
            if at_end or stopped:
                break
            if step % per_epoch == 0 and cfg.sample_every and (step // per_epoch) % cfg.sample_every == 0:
                logger.grid(os.path.join(cfg.samples_dir, f'epoch_{step // per_epoch:04d}.png'))
    finally:
        logger.bar.close()
    return finish(run, step, stopped, logger, ckpt_path, time.perf_counter() - start_time, control_group)


def finish(run: Run, step: int, stopped, logger: Logger, ckpt_path: str, seconds: float, control_group) -> dict:
    """The end of a run: the DDP weight check, and (unless stopped by a signal) the last grid."""
    cfg = run.cfg
    if run.world_size > 1:
        identical = ranks_identical(run.model, control_group)
        logger.print(f'ranks hold identical weights: {identical}')
        if not identical:
            raise RuntimeError('DDP ranks ended with different weights')
    last = logger.last
    if stopped:
        logger.print(f'stopped by {stopped} at step {step}: checkpoint saved to {ckpt_path}; '
                     f'continue with --resume {ckpt_path}')
        return {'step': step, 'stopped': stopped, 'last': last, 'checkpoint': ckpt_path}
    per_epoch = run.loader.batches_per_epoch
    if cfg.sample_every and (step % per_epoch or (step // per_epoch) % cfg.sample_every == 0):
        name = f'epoch_{step // per_epoch:04d}.png' if step % per_epoch == 0 else f'step_{step:07d}.png'
        logger.grid(os.path.join(cfg.samples_dir, name))
    if cfg.eval_every:
        logger.curves(force=True)
    samples = f', samples in {cfg.samples_dir}/' if logger.grids else ''
    logger.print(f'done: {step} steps in {seconds:.1f}s; loss {last.get("loss", float("nan")):.4f}, '
                 f'held-out loss {last.get("heldout_loss", float("nan")):.4f} (EMA '
                 f'{last.get("heldout_loss_ema", float("nan")):.4f}); checkpoint {ckpt_path}{samples}')
    return {'step': step, 'stopped': stopped, 'last': last, 'checkpoint': ckpt_path}


def cli(argv=None) -> int:
    cfg = parse_config(argv)
    try:
        main(cfg)
    except (ConfigError, data.DataError) as error:
        print(f'error: {one_line(error)}', file=sys.stderr)
        return 2
    except NonFiniteLoss as error:
        print(f'error: {error}', file=sys.stderr)
        return 3
    except OSError as error:  # a full disk while writing a checkpoint or metrics: the last checkpoint is whole
        print(f'error: {brief(error, 300)}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print('aborted by a second Ctrl-C (the last checkpoint written is whole)', file=sys.stderr)
        return 130
    return 0


if __name__ == '__main__':
    sys.exit(cli())

"""Train a DDPM UNet: python train.py --help

Single process:  python train.py --dataset shapes --preset tiny --epochs 2 --device cpu
Multi-GPU (DDP): torchrun --nproc_per_node 8 train.py --batch-size 1024
Exit codes: 0 done (or stopped by SIGTERM/Ctrl-C with a checkpoint saved), 2 bad input,
3 non-finite loss (the last good checkpoint is kept).
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

import torch
import torch.distributed as dist
from tqdm import tqdm

import data
import diffusion
from data import brief, flag, one_line
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


class ConfigError(Exception):
    """A bad flag or file; reported as one line, exit code 2."""


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


def pick_device(name: str, local_rank: int) -> torch.device:
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f'unknown device {name!r}: use cpu, cuda or cuda:N') from None
    if device.type == 'cuda':
        if not torch.cuda.is_available():
            raise ConfigError(f'--device {name}: CUDA is not available here; use --device cpu')
        if device.index is None:
            device = torch.device('cuda', local_rank)
    return device


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
    for name in ('sample_every', 'ckpt_every'):
        require(getattr(cfg, name) >= 0, f"--{name.replace('_', '-')} must be 0 (never) or more, "
                                         f"got {getattr(cfg, name)}")
    require(1 <= cfg.sample_steps <= NUM_TIMESTEPS, f'--sample-steps must be in [1, {NUM_TIMESTEPS}] '
                                                    f'(the schedule has T={NUM_TIMESTEPS}), got {cfg.sample_steps}')
    require(not (cfg.amp == 'fp16' and device.type != 'cuda'), f'--amp fp16 needs a CUDA device ({device} has no '
                                                               f'fast fp16 training); use --amp bf16 or --amp off')
    require(not (cfg.amp == 'bf16' and device.type == 'cuda' and not torch.cuda.is_bf16_supported()),
            '--amp bf16: this GPU does not support bf16; use --amp fp16')
    require(not (cfg.dataset == 'beton' and data.ffcv_missing_reason()),
            f'--loader ffcv / --dataset beton: {data.ffcv_missing_reason()}')
    try:
        model_config_of(cfg)
    except ValueError as error:
        raise ConfigError(f'--image-size {cfg.image_size}: {error}') from None


def check_writable(folder: str, flag_name: str):
    """Creates the folder and writes a file in it, so that a bad path fails now, not after
    hours of training."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f'.write-test-{os.getpid()}')
        with open(probe, 'w') as f:
            f.write('ok')
        os.remove(probe)
    except OSError as error:
        raise ConfigError(f'{flag_name} {folder}: cannot write there ({error.strerror or error})') from None


def resolve_resume(cfg: TrainConfig) -> TrainConfig:
    """--resume auto resumes from OUT/ckpt.pt when there is one and starts fresh otherwise; a
    fresh run never overwrites a checkpoint (nor appends to another run's metrics.jsonl)."""
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    if cfg.resume == 'auto':
        return dataclasses.replace(cfg, resume=ckpt_path if os.path.isfile(ckpt_path) else '')
    if not cfg.resume and os.path.isfile(ckpt_path):
        raise ConfigError(f'{ckpt_path} exists: continue that run with --resume {ckpt_path} (or --resume auto), '
                          f'or pass another --out-dir')
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


def check_model_version(ckpt: dict, what: str):
    """Checkpoints of the network before it was made the paper's (version 1: no SiLU before
    the timestep projections, symmetric downsampling padding, GroupNorm eps 1e-5) have the
    same tensors but compute another function: refuse them."""
    version = ckpt.get('model_version', 1)
    if version != MODEL_VERSION:
        raise ConfigError(f'{what}: written for UNet version {version}, and model.py is version {MODEL_VERSION} '
                          f'(the paper\'s network); its weights do not compute the same function, so retrain')


def load_checkpoint(path: str, cfg: TrainConfig, model_config, world_size: int) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f'--resume {path}: no such checkpoint')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as error:
        raise ConfigError(f'--resume {path}: cannot load it ({brief(error)})') from None
    check_model_version(ckpt, f'--resume {path}')
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
    return ckpt


# ----------------------------------------------------------------------------- the run

class StopRequested(Exception):
    """Raised by a signal inside an interruptible section (evaluation, a grid)."""


class StopFlag:
    """Set by SIGTERM or Ctrl-C; the loop finishes its step, saves and exits. A signal that
    comes during an evaluation or a grid cuts it short (a preempted job has seconds, not
    minutes). A second Ctrl-C aborts at once."""

    def __init__(self):
        self.reason, self.in_interruptible = None, False

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
        self.in_interruptible = True
        try:
            yield
        finally:
            self.in_interruptible = False


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
    remove_stale_temporary(os.path.join(cfg.out_dir, 'ckpt.pt'), rank)
    control_group = init_process_group(device, rank, world_size)
    try:
        run = build_run(cfg, device, rank, world_size, progress=rank == 0)
        if ckpt is not None:
            check_same_data(ckpt, run, cfg.resume)
        step = restore(run, ckpt) if ckpt else 0
        return train(run, step, control_group)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def remove_stale_temporary(ckpt_path: str, rank: int):
    """A ckpt.pt.tmp left by a write that was killed is garbage (the rename never happened)."""
    tmp = ckpt_path + '.tmp'
    if rank == 0 and os.path.exists(tmp):
        os.remove(tmp)
        print(f'removed {tmp}, left by a checkpoint write that did not finish ({ckpt_path} is intact)', flush=True)


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


def checkpoint_state(run: Run, step: int, control_group) -> dict:
    """The checkpoint dict; every rank must call it (the RNG states of all ranks are gathered)."""
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
            'data': {'count': run.num_images, 'fingerprint': run.data_fingerprint}}


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
        self.grids = []
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
        row = {'step': step, 'epoch': step / self.run.loader.batches_per_epoch, 'loss': mean_loss,
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
        self.last = row
        self.interval_start, self.paused_s = time.perf_counter(), 0.0

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
                self.print(f'warning: could not write the sample grid {path} ({brief(error)}); training goes on')


def synchronize(device: torch.device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def train(run: Run, step: int, control_group=None) -> dict:
    """The loop: steps, then at the right steps a log line, a checkpoint, a stop check and a
    sample grid. The device is only synchronised at log intervals and checkpoints. On SIGTERM
    or Ctrl-C the step finishes and the checkpoint is saved at once: no evaluation, no grid."""
    cfg, per_epoch = run.cfg, run.loader.batches_per_epoch
    total_steps = cfg.steps or cfg.epochs * per_epoch
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    stop = StopFlag()
    logger = Logger(run, step, total_steps, stop)
    last_good = f'{cfg.resume} (step {step}, resumed from)' if cfg.resume else None
    loss_sum, unlogged, stopped = torch.zeros((), device=run.device), 0, None
    restore_signals = stop.install()
    start_time = time.perf_counter()
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
            if must_save:  # before the grid: a failing grid never costs a checkpoint
                with logger.paused():
                    state = checkpoint_state(run, step, control_group)
                    if run.rank == 0:
                        save_checkpoint(state, ckpt_path)
                last_good = f'{ckpt_path} (step {step})'
            if at_end or stopped:
                break
            if step % per_epoch == 0 and cfg.sample_every and (step // per_epoch) % cfg.sample_every == 0:
                logger.grid(os.path.join(cfg.samples_dir, f'epoch_{step // per_epoch:04d}.png'))
    finally:
        logger.bar.close()
        restore_signals()
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
    return 0


if __name__ == '__main__':
    sys.exit(cli())

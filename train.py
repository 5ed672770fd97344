"""Train a DDPM UNet: python train.py --help

Single process:  python train.py --dataset digits --preset tiny --image-size 16 --epochs 20 --device cpu
Multi-GPU (DDP): torchrun --nproc_per_node 8 train.py --batch-size 1024
Exit codes: 0 done (or stopped by SIGTERM/Ctrl-C with a checkpoint saved), 1 a write failed,
2 bad input, 3 non-finite loss (the last good checkpoint is kept), 130 a second Ctrl-C.

The file reads in the order a run happens: config, lr and EMA schedules, building the run, the
step, the loop, main. Defaults, validation and the loop's logging, evaluation and checkpoint calls
sit below the line marked "bookkeeping"; the checkpoint format is checkpoint.py's, the metrics
writer metrics.py's, the evaluation evaluation.py's.
"""
import contextlib
import copy
import dataclasses
import importlib.util
import math
import os
import shlex
import sys
import typing
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import data
import diffusion
import evaluation
import metrics
from checkpoint import (already_done, check_resumable, check_same_data, initial_weights, resume_settings,
                        save_checkpoint, warn_of_changes)
from cli import (ConfigError, StopFlag, StopRequested, brief, changed_fields, check_ranges, flag, given_fields,
                 int_list, parse_config, refused_as, run_main)
from devices import autocast, cpu_has_native_bf16, own_rng, pick_device
from distributed import (agreed_stop, any_rank, gather_to_rank0, init_process_group, on_all_ranks, ranks_identical,
                         setup_distributed)
from drawing import GRID_LIMIT, write_grid
from files import check_writable, claim_folder
from model import MODEL_VERSION, PRESETS, UNet, get_config

NUM_TIMESTEPS = 1000  # T of the paper; every schedule has this many steps
COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')


# ----------------------------------------------------------------------------- config

@dataclass
class TrainConfig:
    preset: str = flag('ddpm-cifar10', 'UNet preset', choices=tuple(PRESETS))
    base_channels: int | None = flag(None, 'the UNet\'s width: channels of its first level (default: the preset\'s; '
                                           'ddpm-cifar10 128, small 64, tiny 16)', at_least=1)
    channel_mults: str | None = flag(None, 'channel multiplier of each level, comma-separated, one level per entry, '
                                           'the image halved between levels (default: the preset\'s; ddpm-cifar10 '
                                           '1,2,2,2, tiny 1,2,2)')
    blocks_per_level: int | None = flag(None, 'residual blocks per level (default: the preset\'s; ddpm-cifar10 2, '
                                              'tiny 1)', at_least=1)
    attn_resolutions: str | None = flag(None, 'resolutions whose levels have self-attention, comma-separated, or '
                                              'none (the middle block keeps its own; default: the preset\'s; '
                                              'ddpm-cifar10 16, tiny 8)')
    dataset: str = flag('cifar10', 'data set (digits: scikit-learn\'s 1,797 handwritten digits, one channel, no '
                                   'download)', choices=data.DATASETS)
    data_dir: str = flag('./data', 'CIFAR-10 root (downloaded there if missing), image folder, or .beton file '
                                   '(--dataset beton or --loader ffcv); for digits and shapes only the cache of '
                                   'the evaluation\'s classifier and statistics')
    image_size: int = flag(32, 'training resolution (images are resized and centre-cropped)', at_least=1)
    shapes_count: int = flag(8192, 'number of images in the shapes data set', at_least=1)
    batch_size: int | None = flag(None, 'global batch size, split across DDP ranks (paper: 128; tiny: 32)', at_least=1)
    epochs: int = flag(2048, 'epochs to train (2048 epochs of CIFAR-10 at batch 128 ~ the paper\'s 800k steps)',
                       at_least=1)
    steps: int | None = flag(None, 'optimizer steps to train; wins over --epochs when given', at_least=1)
    lr: float | None = flag(None, 'peak learning rate of Adam (paper: 2e-4; tiny: 2e-3)', positive=True)
    warmup: int | None = flag(None, 'linear learning-rate warm-up steps (paper: 5000; tiny: 50)', at_least=0)
    grad_clip: float = flag(1.0, 'clip the global gradient norm to this (0: off)', at_least=0)
    ema_decay: float = flag(0.9999, 'EMA decay, ramped as min(decay, (1+step)/(10+step))', at_least=0, below=1)
    dropout: float | None = flag(None, 'dropout in residual blocks (default: the preset\'s)', at_least=0, below=1)
    schedule: str = flag('linear', 'beta schedule', choices=('linear', 'cosine'))
    prediction: str = flag('eps', 'what the network predicts: eps, the noise (the paper\'s), or v = alpha eps - '
                                  'sigma x0 (Salimans & Ho 2022)', choices=diffusion.PREDICTIONS)
    loss_weight: str = flag('uniform', 'weight of each timestep\'s loss: uniform (the paper\'s L_simple) or min-snr '
                                       '(Hang et al. 2023: min(SNR, gamma) on the x0 error)',
                            choices=diffusion.LOSS_WEIGHTS)
    snr_gamma: float | None = flag(None, 'gamma of --loss-weight min-snr (default 5)', positive=True)
    t_sampling: str = flag('uniform', 'how training timesteps are drawn: uniform (the paper\'s), lognormal (Karras et '
                                      'al. 2022: ln sigma ~ N(-1.2, 1.2^2)) or laplace (Hang et al. 2024: log-SNR ~ '
                                      'Laplace(0, 0.5))', choices=diffusion.T_SAMPLINGS)
    t_mean: float | None = flag(None, 'the mean of --t-sampling\'s law (lognormal: of ln sigma; laplace: of the '
                                      'log-SNR)')
    t_scale: float | None = flag(None, 'its scale (lognormal: the sd of ln sigma; laplace: b)', positive=True)
    t_reweight: bool = flag(False, 'weight each timestep\'s loss by (1/T) / p(t), so that --t-sampling keeps '
                                   'L_simple\'s objective and changes only its variance')
    input_perturbation: float = flag(0.0, 'DDPM-IP (Ning et al. 2023): the network sees x_t made with eps + gamma xi '
                                          'and learns eps alone; gamma (paper: 0.1; 0: off)', at_least=0, at_most=1)
    lr_decay: str = flag('none', 'after the warm-up: none (constant, the paper\'s), or cosine or linear decay to 0 at '
                                 'the run\'s planned last step (--steps or --epochs)',
                         choices=('none', 'cosine', 'linear'))
    adam_beta2: float = flag(0.999, 'Adam\'s beta2 (paper: 0.999; 0.99 averages the gradient\'s scale over ~100 '
                                    'steps)', at_least=0, below=1)
    ema_length: float = flag(0.0, 'the EMA\'s half-life as a share of the images seen (Karras et al. 2022: 0.05), '
                                  'capped by --ema-decay; 0: the paper\'s ramp (1+step)/(10+step)', at_least=0, below=1)
    class_cond: bool = flag(False, 'class-conditional training on the data set\'s labels (CIFAR-10\'s classes, the '
                                   'digits, a folder\'s subfolders, a .beton\'s label field), for classifier-free '
                                   'guidance (Ho & Salimans 2022)')
    label_drop: float | None = flag(None, 'with --class-cond: the share of labels replaced by "no class" in training, '
                                          'so that one network is also the unconditional model guidance needs '
                                          '(default 0.1)', at_least=0, below=1)
    guidance: float | None = flag(None, 'with --class-cond: the guidance scale of the sample grids and evaluations '
                                        '(1: the conditional model alone; 0: unconditional; default 1)', at_least=0)
    immiscible: bool = flag(False, 'immiscible diffusion (Li et al. 2024): each image of a batch gets the nearest of '
                                   'the batch\'s noise draws, by a linear assignment over L2 distances (scipy, on the '
                                   'host: one sync a step on a GPU)')
    attention: str = flag('sdpa', 'attention: F.scaled_dot_product_attention, or matmul-softmax-matmul',
                          choices=('sdpa', 'manual'))
    compile: bool | None = flag(None, 'torch.compile the whole training loss as one graph: timesteps, noise, '
                                      'q_sample, the model, the MSE (default: on for CUDA; off on a CPU: faster once '
                                      'compiled, but its first compile takes minutes there)')
    compile_mode: str = flag('default', 'torch.compile mode', choices=COMPILE_MODES)
    amp: str = flag('auto', 'autocast (auto: bf16 on CUDA; off on a CPU: bf16 measured no faster on one with '
                            'native bf16, an AMD EPYC with AVX512-BF16; docs/training.md)',
                    choices=('auto', 'off', 'bf16', 'fp16'))
    channels_last: bool | None = flag(None, 'NHWC memory format (default: off on CUDA: slower than NCHW on an '
                                            'H200 with the compiled bf16 step, results/h200-layout-check.md; off on a '
                                            'CPU: with fused Adam no faster there)')
    fused_adam: bool | None = flag(None, 'fused Adam kernel (default: on for CUDA and on a CPU with native bf16, '
                                         'measured faster there)')
    fused_norm: bool = flag(False, 'GroupNorm with the add before it and the SiLU after it as one Triton kernel '
                                   '(kernels.py), forward and backward; CUDA only (default off: no GPU measurement '
                                   'yet)')
    loader: str = flag('auto', 'data path (auto: gpu when the set fits on the GPU, else torch)', choices=data.LOADERS)
    num_workers: int = flag(4, 'DataLoader workers for --loader torch', at_least=0)
    log_every: int = flag(100, 'steps between metrics.jsonl lines (and held-out loss)', at_least=1)
    heldout_size: int = flag(256, 'images in the fixed held-out set (fixed timesteps and noise)', at_least=1)
    sample_every: int = flag(1, 'epochs between sample grids (0: never)', at_least=0)
    sampler: str = flag('ddim', 'sampler of the grids and the FID evaluations (dpm++: DPM-Solver++(2M), log-SNR steps)',
                        choices=('ddim', 'dpm++', 'ddpm'))
    sample_steps: int = flag(50, 'model calls per image of ddim and dpm++ (ddpm always takes all T)',
                             at_least=1, at_most=NUM_TIMESTEPS)
    num_samples: int = flag(64, 'images per sample grid', at_least=1, at_most=GRID_LIMIT)
    eval_every: int = flag(0, 'training images between evaluations (0: none): FID of EMA samples and bits/dim of '
                              'the EMA on held-out images, as metrics.jsonl rows, and OUT_DIR/curves.png', at_least=0)
    eval_fid: bool = flag(True, 'FID in the evaluations (Inception weights: downloaded on first use, or '
                                '--inception-weights; offline without them FID is left out with a warning)')
    eval_samples: int | None = flag(None, 'EMA samples per FID, drawn with --sampler and --sample-steps (default '
                                          '10000; papers report 50,000; fewer samples read higher); digits: 450, '
                                          'the size of the held-out split that sets the score\'s floor', at_least=2)
    eval_noise: str = flag('fixed', 'the noise of the evaluations\' samples: fixed (the run\'s seed at every '
                                    'evaluation) or fresh (a new draw per evaluation, so that no draw\'s luck stays '
                                    'with a run; docs/benchmark.md measures why)', choices=('fixed', 'fresh'))
    stop_at_score: float | None = flag(None, 'end the run (checkpoint, exit 0) at the first evaluation whose score '
                                             '(FID; digits: the digits FD) is at or below this: training to a '
                                             'target, as scripts/time_to_quality.py does', positive=True)
    eval_bpd_images: int = flag(1000, 'held-out images of the bits/dim estimate', at_least=1)
    eval_bpd_timesteps: int = flag(32, 'timesteps of the Monte Carlo bits/dim estimate: 1 + this many model calls '
                                       'per held-out image', at_least=1, at_most=NUM_TIMESTEPS - 1)
    inception_weights: str = flag('', 'local InceptionV3 weights for FID (torch-fidelity\'s '
                                      'weights-inception-2015-12-05-6726825d.pth); default: download')
    ckpt_every: int = flag(5000, 'steps between checkpoints (0: only at the end, which always has one)', at_least=0)
    out_dir: str = flag('runs', 'where ckpt.pt and metrics.jsonl go')
    samples_dir: str = flag('ddpm_samples', 'where the sample grids go')
    resume: str = flag('', 'checkpoint to resume from (must exist and match the architecture and data), or auto: '
                           'OUT_DIR/ckpt.pt when it exists, else a fresh run (for preemptible jobs)')
    init_from: str = flag('', 'a fresh run starts from these weights: a checkpoint of ours (its EMA) or a diffusers '
                              'UNet2DModel or pipeline folder of this --preset; optimizer, step and lr start anew')
    tensorboard: bool = flag(False, 'also log every metric and sample grid to OUT_DIR/tb/ (step: images seen); '
                                    'needs pip install tensorboard')
    seed: int = flag(0, 'seed of initialisation, data order, timesteps and noise', at_least=0, at_most=2 ** 32 - 1)
    device: str = flag('auto', 'auto, cpu, cuda or cuda:N')


# Where a flag is not given: the paper's recipe, except for the tiny CPU demo model, which
# learns faster with a larger learning rate, a short warm-up and a smaller batch.
PAPER_TRAINING = {'lr': 2e-4, 'warmup': 5000, 'batch_size': 128}
# What --amp/--compile/--channels-last/--fused-adam auto turn on on a CPU that computes bf16 natively
# (cpu_has_native_bf16): the speed levers confirmed there by img/s interleaved with the baseline in one process
# (scripts/arm_speed.py --ladder speed: tiny, digits 16x16, batch 32). Fused Adam: kept in all four runs, 1.08x
# to 1.11x (results/cpu-digits-speed-levers.md: 1.111x [1.070, 1.153]). Channels-last: kept in one run of three,
# and with fused Adam 0.963x [0.912, 1.017] (results/cpu-digits-speed-defaults.md): off. Compile: 1.17x to 1.25x
# once compiled (kept in two runs of three), stays off: its first compile took 116-122 s, paid back after about
# 190,000 images (results/cpu-digits-speed-compile.md), more than the demo trains, and it needs a C++ compiler.
# bf16 autocast was left out by the ladder's screen. Plain fp32 eager on every other CPU: nothing measured there.
# docs/training.md#the-cpus-fast-path
CPU_FAST_PATH = {'amp': 'off', 'compile': False, 'channels_last': False, 'fused_adam': True}
PRESET_TRAINING = {'tiny': {'lr': 2e-3, 'warmup': 50, 'batch_size': 32}}
LABEL_DROP = 0.1  # --class-cond's p_uncond: Ho & Salimans (2022) found 0.1 and 0.2 best on ImageNet 64x64


# ----------------------------------------------------------------------------- schedules

def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warm-up to cfg.lr over cfg.warmup steps, then constant (the paper's schedule), or with
    --lr-decay a cosine or linear decay to 0 at the planned last step, total_steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_decay == 'none':
        return cfg.lr
    done = min(1.0, (step - cfg.warmup + 1) / max(1, total_steps - cfg.warmup))  # 1 at the last step
    return cfg.lr * (0.5 * (1 + math.cos(math.pi * done)) if cfg.lr_decay == 'cosine' else 1 - done)


def ema_decay_at(step: int, cfg: TrainConfig) -> float:
    """The EMA decay ramps up from 0.1 so that short runs have a useful EMA; it reaches the
    paper's 0.9999 after ~90k steps. With --ema-length r (Karras et al. 2022) its half-life is
    r times the images seen: decay 0.5^(batch / (r * images)) = 0.5^(1 / (r (step + 1)))."""
    if cfg.ema_length:
        return min(cfg.ema_decay, 0.5 ** (1 / (cfg.ema_length * (step + 1))))
    return min(cfg.ema_decay, (1 + step) / (10 + step))


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float):
    """ema = decay * ema + (1 - decay) * model, in one fused multi-tensor kernel."""
    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - decay)


# ----------------------------------------------------------------------------- building the run

@dataclass
class Run:
    """Everything one training process holds. `compute_loss` is what the step calls: the loss of a batch
    (make_loss; the model inside it maybe wrapped in DDP, the whole of it in torch.compile);
    `model` the plain module whose state is saved; `ema` exists on rank 0 only. `stop` is set
    by SIGTERM/Ctrl-C; `control_group` is a CPU process group for the ranks' control messages
    under DDP."""
    cfg: TrainConfig
    device: torch.device
    rank: int
    world_size: int
    model: torch.nn.Module
    ema: torch.nn.Module | None
    compute_loss: typing.Callable  # x0 -> L_simple of the batch, without a host sync
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sched: diffusion.Schedule
    loader: typing.Any
    loader_kind: str
    data_identity: dict  # {'count', 'fingerprint'} of the training images, checked on resume
    stop: StopFlag = dataclasses.field(default_factory=StopFlag)
    control_group: typing.Any = None
    flags: dict = dataclasses.field(default_factory=dict)  # the settings given, replayed by --resume

    @property
    def total_steps(self) -> int:  # the run's planned length
        return self.cfg.steps or self.cfg.epochs * self.loader.batches_per_epoch


def model_config_of(cfg: TrainConfig):
    return get_config(cfg.preset, image_size=cfg.image_size, dropout=cfg.dropout, attention=cfg.attention,
                      in_channels=data.channels_of(cfg.dataset),
                      num_classes=len(data.class_names(cfg.dataset, cfg.data_dir)) if cfg.class_cond else 0,
                      fused_norm=cfg.fused_norm, **shape_of(cfg))


def shape_of(cfg: TrainConfig) -> dict:
    """The UNetConfig fields the shape flags set (those given; the others stay the preset's)."""
    shape = {'base_channels': cfg.base_channels, 'blocks_per_level': cfg.blocks_per_level}
    if cfg.channel_mults is not None:  # '' too: an empty list is refused, not read as "the preset's"
        shape['channel_mults'] = int_list(cfg.channel_mults, '--channel-mults')
    if cfg.attn_resolutions is not None:
        shape['attn_resolutions'] = (() if cfg.attn_resolutions.strip() == 'none' else
                                     int_list(cfg.attn_resolutions, '--attn-resolutions', 'such as 16,8, or none'))
    return {name: value for name, value in shape.items() if value is not None}


def build_run(cfg: TrainConfig, device, rank=0, world_size=1, dataset=None, progress=True, make_model=None,
              stop=None, control_group=None, flags=None, init: dict = None) -> Run:
    """Model, EMA, optimizer, schedule and loader for a resolved config (see resolve_defaults).
    make_model(config) builds another network in place of ours (the benchmark's peer row); `init`
    is a state dict that the model and the EMA start from (--init-from)."""
    torch.manual_seed(cfg.seed)
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    if dataset is None:
        dataset = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.shapes_count, cfg.class_cond)
    first = data.first_image(dataset, cfg.image_size, cfg.data_dir)
    loader_kind = data.choose_loader(cfg.loader, len(dataset) * first.numel(), device)
    loader = data.make_loader(loader_kind, dataset, cfg.batch_size // world_size, cfg.seed, device,
                              cfg.num_workers, rank, world_size, progress, data.flipped_in_training(cfg.dataset))
    model = (make_model or UNet)(model_config_of(cfg)).to(device)
    if init is not None:
        model.load_state_dict(init)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = copy.deepcopy(model).eval().requires_grad_(False) if rank == 0 else None
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.adam_beta2),
                                 fused=cfg.fused_adam or None)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == 'fp16')
    torch.manual_seed(cfg.seed + rank)  # each rank its own timesteps, noise and dropout
    net = model
    if world_size > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)  # a single-device module: no device_ids needed
    sched = diffusion.make_schedule(NUM_TIMESTEPS, cfg.schedule).to(device)
    loss = make_loss(cfg, net, sched, device, fullgraph=world_size == 1)  # dynamo breaks the graph at DDP's forward
    identity = {'count': len(dataset), 'fingerprint': data.fingerprint(dataset)}
    if cfg.class_cond:  # the classes are part of what was learnt: a resume must see the same ones
        identity['classes'] = list(dataset.class_names)
    return Run(cfg, device, rank, world_size, model, ema, loss, optimizer, scaler, sched, loader, loader_kind,
               identity, stop or StopFlag(), control_group, flags or {})


def checkpoint_state(run: Run, step: int, eval_owed: bool = False, train_seconds: float = 0.0,
                     wall_seconds: float = 0.0) -> dict:
    """The checkpoint (its format: checkpoint.py). Every rank must call it: rank 0
    gathers the RNG states of all ranks. eval_owed: an evaluation due at this step did not run (a
    stop came first); train_seconds, wall_seconds: the training and the loop's wall time so far,
    counted on by a resumed run."""
    rng = {'cpu': torch.get_rng_state(),
           'cuda': torch.cuda.get_rng_state(run.device) if run.device.type == 'cuda' else None}
    (rng_all,) = gather_to_rank0((rng,), run.rank, run.world_size, run.control_group)  # rank 0 saves
    epoch, batch = divmod(step, run.loader.batches_per_epoch)
    return {'model': run.model.state_dict(), 'ema': run.ema.state_dict() if run.ema is not None else None,
            'optimizer': run.optimizer.state_dict(), 'scaler': run.scaler.state_dict(), 'step': step,
            'epoch': epoch, 'batch_in_epoch': batch, 'config': asdict(run.cfg),
            'model_config': asdict(run.model.config), 'model_version': MODEL_VERSION, 'rng': rng_all,
            'data': run.data_identity, 'eval_owed': eval_owed, 'train_seconds': train_seconds,
            'wall_seconds': wall_seconds, 'flags': run.flags}


def restore(run: Run, ckpt: dict) -> int:
    """Loads a checkpoint into the run; returns the step to continue from."""
    try:
        run.model.load_state_dict(ckpt['model'])
        if run.ema is not None:
            run.ema.load_state_dict(ckpt['ema'])
        run.optimizer.load_state_dict(ckpt['optimizer'])
        for group in run.optimizer.param_groups:  # the run's --adam-beta2, not the one the state saved
            group['betas'] = (0.9, run.cfg.adam_beta2)
        run.scaler.load_state_dict(ckpt['scaler'])
    except (KeyError, ValueError, RuntimeError, TypeError) as error:
        raise ConfigError(f'--resume {run.cfg.resume}: its states do not fit this run ({brief(error)})') from None
    rng = ckpt['rng'][run.rank]
    torch.set_rng_state(rng['cpu'])
    if run.device.type == 'cuda' and rng.get('cuda') is not None:
        torch.cuda.set_rng_state(rng['cuda'], run.device)
    return ckpt['step']


# ----------------------------------------------------------------------------- the training step

def make_loss(cfg: TrainConfig, net, sched: diffusion.Schedule, device, **compile_options) -> typing.Callable:
    """x0 -> L_simple of the batch (diffusion.training_loss) in the run's layout and precision.
    With --compile it is one graph from the batch to the loss: timesteps, noise, q_sample, the
    network and the MSE, forward and backward, so that CUDA graphs (reduce-overhead,
    max-autotune) cover all of it and the elementwise work fuses into the network's kernels.
    The learning rate and the EMA decay stay outside the graph: their schedules cannot cause
    recompiles. compile_options go to torch.compile (the tests and the benchmark pick backends)."""
    t_probs = None if cfg.t_sampling == 'uniform' else diffusion.timestep_probabilities(
        sched, cfg.t_sampling, cfg.t_mean, cfg.t_scale).to(device)
    net_classes = getattr(net, 'module', net).config.num_classes if cfg.class_cond else 0

    def loss_of(x0, labels=None, noise=None):
        if cfg.channels_last:
            x0 = x0.contiguous(memory_format=torch.channels_last)
        if labels is not None:  # --class-cond: some labels become "no class" (index num_classes)
            labels = diffusion.drop_labels(labels, cfg.label_drop, net_classes)
        with autocast(cfg.amp, device):
            return diffusion.training_loss(net, sched, x0, noise=noise, prediction=cfg.prediction,
                                           loss_weight=cfg.loss_weight, snr_gamma=cfg.snr_gamma or 5.0,
                                           t_probs=t_probs, t_reweight=cfg.t_reweight,
                                           input_perturbation=cfg.input_perturbation, labels=labels)
    if cfg.compile:
        mode = None if cfg.compile_mode == 'default' else cfg.compile_mode
        loss_of = torch.compile(loss_of, **{'fullgraph': True, 'mode': mode, **compile_options})
    if not cfg.immiscible:
        return loss_of
    # scipy's assignment cannot enter a graph: the noise is drawn and assigned before it, then passed in
    return lambda x0, labels=None: loss_of(x0, labels, diffusion.immiscible_noise(x0, torch.randn_like(x0)))


def train_step(run: Run, batch, step: int) -> torch.Tensor:
    """One optimizer step on a batch (images, or (images, labels) with --class-cond); returns the
    loss without synchronising with the host."""
    cfg = run.cfg
    for group in run.optimizer.param_groups:
        group['lr'] = lr_at(step, cfg, run.total_steps)  # a float argument of fused Adam's kernel: no sync
    loss = run.compute_loss(*batch) if isinstance(batch, tuple) else run.compute_loss(batch)
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


# ----------------------------------------------------------------------------- the loop

def train(run: Run, step: int, log, heldout=None, evaluator=None, eval_owed: bool = False) -> dict:
    """Training steps; after each, when due: a log row with the held-out losses, an evaluation,
    a checkpoint, a sample grid. The device is synchronised only at log rows and checkpoints.
    On SIGTERM or Ctrl-C the step finishes and the checkpoint is saved at once: no evaluation
    (the resumed run owes it), no grid."""
    cfg, per_epoch = run.cfg, run.loader.batches_per_epoch
    total_steps = run.total_steps
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    last_good = f'{cfg.resume} (step {step}, resumed from)' if cfg.resume else None
    loss_sum, unlogged, stopped, row = torch.zeros((), device=run.device), 0, None, {}
    log.start_loop()
    eval_owed = eval_owed and evaluator is not None
    if eval_owed:  # the last process was stopped at an evaluation: it comes first
        scored = evaluate(run, evaluator, log, step)
        eval_owed = scored is None
        reached = not eval_owed and any_rank(score_reached(cfg, scored), run.control_group)
        # The run ends here as the uninterrupted one would have: at its target, at --stop-at-score
        # (the owed score reached it), or stopped again during this evaluation (still owed, at this step).
        if step >= total_steps or reached or eval_owed:
            save_if_good(run, step, log, eval_owed, ckpt_path, heldout, row, last_good)
            return finish_run(run, step, run.stop.reason if eval_owed else None, log, ckpt_path)
    try:
        for x0 in batches(run, step):
            # Step.
            loss_sum += train_step(run, x0, step)
            step, unlogged = step + 1, unlogged + 1
            log.after_step()
            at_end = step >= total_steps
            stopped = agreed_stop(run.stop, run.control_group, ask=step % 10 == 0 or at_end)
            eval_owed = eval_owed or (evaluator is not None and evaluator.due(step))
            must_save = (cfg.ckpt_every and step % cfg.ckpt_every == 0) or at_end or stopped
            # Log: the interval's mean loss (its one host sync; never past a non-finite loss). With
            # --stop-at-score also before each evaluation, which may end the run.
            if step % cfg.log_every == 0 or at_end or (must_save and unlogged) or (eval_owed and cfg.stop_at_score):
                mean_loss = interval_loss(run, loss_sum, unlogged, step, last_good)
                row = log_interval(run, log, heldout, step, unlogged, mean_loss, with_heldout=not stopped)
                loss_sum.zero_()
                unlogged = 0
            # Evaluate: FID and bits/dim of the EMA, every --eval-every training images.
            if eval_owed and not stopped:
                scored = evaluate(run, evaluator, log, step)
                eval_owed = scored is None
                if eval_owed:  # cut short by a stop: save now
                    stopped = must_save = run.stop.reason
                elif any_rank(score_reached(cfg, scored), run.control_group):  # --stop-at-score: the run's end
                    at_end = must_save = True
            # Checkpoint, once proven good (finite weights and held-out losses), before the grid.
            if must_save:
                save_if_good(run, step, log, eval_owed, ckpt_path, heldout, row, last_good)
                last_good = f'{ckpt_path} (step {step})'
            if at_end or stopped:
                break
            # Sample grid at the end of every --sample-every'th epoch.
            if step % per_epoch == 0 and cfg.sample_every and (step // per_epoch) % cfg.sample_every == 0:
                write_sample_grid(run, log, os.path.join(cfg.samples_dir, f'epoch_{step // per_epoch:04d}.png'), step)
    finally:
        log.bar.close()
    return finish_run(run, step, stopped, log, ckpt_path)


# ----------------------------------------------------------------------------- main

def main(cfg: TrainConfig, given: set = None) -> dict:
    """A run of cfg. `given`: the fields set on the command line (default: those that differ
    from their defaults); a resumed run replays its checkpoint's flags with these on top."""
    rank, local_rank, world_size = setup_distributed()
    stop, release_lock = StopFlag(), lambda: None
    restore_signals = stop.install()  # first thing: a stop during start-up ends the run cleanly too
    try:
        given = changed_fields(cfg) if given is None else given
        cfg, flags, ckpt = resume_settings(cfg, given)
        device = pick_device(cfg.device, local_rank)
        cfg = resolve_defaults(cfg, device)
        validate(cfg, device, world_size, resuming=ckpt is not None)
        if ckpt is not None and 'init_from' in given and rank == 0:
            print(f'--init-from {cfg.init_from} is not read: a resumed run continues from the weights of '
                  f'{cfg.resume}', flush=True)
        if ckpt is not None:
            check_resumable(ckpt, f'--resume {cfg.resume}', asdict(cfg), model_config_of(cfg), world_size)
            warn_of_changes(ckpt, cfg)
            if done := already_done(ckpt, cfg):
                return done
        init = (initial_weights(cfg.init_from, model_config_of(cfg), cfg.prediction) if cfg.init_from and ckpt is None
                else None)
        release_lock = claim_outputs(cfg, rank, fresh=ckpt is None)
        control_group = init_process_group(device, rank, world_size)
        # A stop during start-up (data, model, reference statistics) ends one process at once:
        # nothing was trained. Under DDP the ranks first meet in the loop, where they agree on stops.
        with stop.interruptible() if world_size == 1 else contextlib.nullcontext():
            run = build_run(cfg, device, rank, world_size, progress=rank == 0, stop=stop,
                            control_group=control_group, flags=flags, init=init)
            if ckpt is not None:
                check_same_data(ckpt, f'--resume {cfg.resume}', run.data_identity, cfg.data_dir)
            step = restore(run, ckpt) if ckpt else 0
            log, heldout, evaluator = start_logging(run, step, *(ckpt.get(key, 0.0) if ckpt else 0.0
                                                                 for key in ('train_seconds', 'wall_seconds')))
        return train(run, step, log, heldout, evaluator, eval_owed=bool(ckpt and ckpt.get('eval_owed')))
    except StopRequested:
        print(f'stopped by {stop.reason} before training started: nothing to save', flush=True)
        return {'step': ckpt['step'] if ckpt else 0, 'stopped': stop.reason, 'last': {}, 'checkpoint': cfg.resume}
    finally:
        restore_signals()
        release_lock()
        if dist.is_initialized():
            dist.destroy_process_group()


def cli(argv=None) -> int:
    return run_main(main, parse_config(argv, TrainConfig, __doc__), given_fields(argv, TrainConfig))


def check_flags(argv: list) -> TrainConfig:
    """The config train.py would run from these flags, resolved for its device, or the ConfigError it
    would stop with, without running anything: for scripts that plan runs of it."""
    cfg = parse_config(argv, TrainConfig, __doc__)
    device = pick_device(cfg.device, 0)
    cfg = resolve_defaults(cfg, device)
    validate(cfg, device, 1)
    return cfg


# ============================================================================= bookkeeping
# Below: what the run needs but a researcher rarely edits.

class NonFiniteLoss(Exception):
    """The loss became NaN or inf: one line, exit code 3."""
    exit_code = 3


# ----------------------------------------------------------------------------- defaults and validation

def resolve_defaults(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """Fills the 'auto' and None fields: the fast path on CUDA; on a CPU, CPU_FAST_PATH where it
    computes bf16 natively, else plain fp32 eager."""
    cuda = device.type == 'cuda'
    fast_cpu = CPU_FAST_PATH if not cuda and cpu_has_native_bf16() else {}
    defaults = {**PAPER_TRAINING, **PRESET_TRAINING.get(cfg.preset, {}), 'dropout': PRESETS[cfg.preset].dropout,
                **{name: cuda or fast_cpu.get(name, False) for name in ('compile', 'fused_adam')},
                'channels_last': fast_cpu.get('channels_last', False),  # off on CUDA too: measured slower (H200)
                'snr_gamma': 5.0 if cfg.loss_weight == 'min-snr' else None,
                **({'label_drop': LABEL_DROP, 'guidance': 1.0} if cfg.class_cond else {}),
                'eval_samples': 450 if cfg.dataset == 'digits' else 10000}
    cfg = dataclasses.replace(cfg, **{name: value for name, value in defaults.items() if getattr(cfg, name) is None})
    if cfg.amp == 'auto':
        cfg.amp = ('bf16' if torch.cuda.is_bf16_supported() else 'off') if cuda else fast_cpu.get('amp', 'off')
    if cfg.loader == 'ffcv' and cfg.dataset == 'digits':
        raise ConfigError('--loader ffcv reads a .beton, whose images are RGB: digits (one channel) train with '
                          '--loader gpu or torch')
    if cfg.loader == 'ffcv':
        cfg.dataset = 'beton'  # FFCV reads the .beton file given as --data-dir
    return cfg


def validate(cfg: TrainConfig, device: torch.device, world_size: int, resuming: bool = False):
    """Every flag checked before any work: the declared ranges, then what depends on the
    device, the rank count and the installed packages. Each failure is one ConfigError line.
    A resumed run never reads --init-from (its weights come from the checkpoint), so the file
    may be gone: a preemptible fine-tune requeues with the same command."""
    check_ranges(cfg)
    if cfg.snr_gamma is not None and cfg.loss_weight != 'min-snr':
        raise ConfigError(f'--snr-gamma {cfg.snr_gamma} weights nothing without --loss-weight min-snr')
    for name in ('label_drop', 'guidance'):
        if getattr(cfg, name) is not None and not cfg.class_cond:
            raise ConfigError(f'--{name.replace("_", "-")} {getattr(cfg, name)} has no labels to act on without '
                              f'--class-cond')
    for name, value in (('--t-mean', cfg.t_mean), ('--t-scale', cfg.t_scale), ('--t-reweight', cfg.t_reweight or None)):
        if value is not None and cfg.t_sampling == 'uniform':
            raise ConfigError(f'{name} shapes nothing without --t-sampling lognormal or laplace')
    if cfg.stop_at_score and not (cfg.eval_every and (cfg.eval_fid or cfg.dataset == 'digits')):
        raise ConfigError(f'--stop-at-score {cfg.stop_at_score} needs evaluations with a score: --eval-every N'
                          + (' and --eval-fid' if cfg.dataset != 'digits' else ''))
    if cfg.t_mean is not None:  # the law's mean inside the span its variable takes over the T steps
        abar = diffusion.make_schedule(NUM_TIMESTEPS, cfg.schedule).alphas_cumprod
        ln_sigma = (0.5 * (torch.log1p(-abar) - torch.log(abar)))[[0, -1]].tolist()
        low, high = ln_sigma if cfg.t_sampling == 'lognormal' else (-2 * ln_sigma[1], -2 * ln_sigma[0])
        if not low <= cfg.t_mean <= high:
            raise ConfigError(f"--t-mean {cfg.t_mean}: outside [{low:.2f}, {high:.2f}], the span of the "
                              f"{'ln sigma' if cfg.t_sampling == 'lognormal' else 'log-SNR'} over the {cfg.schedule} "
                              f"schedule's {NUM_TIMESTEPS} steps: nearly every timestep drawn would be an end one")
    # The run's length in steps where the flags fix it: --steps, or --epochs of a data set whose size is
    # known before loading it (an image folder's or a .beton's is not: those checks wait for --steps).
    per_epoch = {'digits': lambda: len(data.load_digits_split(8, heldout=False)[1]), 'cifar10': lambda: 50_000,
                 'shapes': lambda: cfg.shapes_count}.get(cfg.dataset)
    planned = cfg.steps or (per_epoch and cfg.epochs * (per_epoch() // world_size // (cfg.batch_size // world_size
                                                                                     or 1)))
    if cfg.lr_decay != 'none' and planned and cfg.warmup >= planned:
        raise ConfigError(f'--lr-decay {cfg.lr_decay} decays after the warm-up, but the warm-up ({cfg.warmup} steps) '
                          f'lasts the whole run ({planned} steps): the lr would only rise; pass a --warmup below '
                          f'{planned}, or train longer')
    if cfg.stop_at_score and planned and planned * cfg.batch_size < cfg.eval_every:
        raise ConfigError(f'--stop-at-score {cfg.stop_at_score}: the run trains {planned * cfg.batch_size:,} images, '
                          f'fewer than --eval-every {cfg.eval_every}: no evaluation would ever score it; lower '
                          f'--eval-every or train longer')
    if cfg.batch_size % world_size:
        raise ConfigError(f'--batch-size {cfg.batch_size} does not split evenly over {world_size} ranks')
    if cfg.fused_norm and device.type != 'cuda' and os.environ.get('TRITON_INTERPRET') != '1':
        raise ConfigError('--fused-norm: its Triton kernel runs on CUDA (on a CPU only under TRITON_INTERPRET=1, '
                          'the tests\' interpreter); leave it off here')
    if cfg.amp == 'fp16' and device.type != 'cuda':
        raise ConfigError(f'--amp fp16 needs a CUDA device ({device} has no fast fp16 training); use --amp bf16 or off')
    if cfg.amp == 'bf16' and device.type == 'cuda' and not torch.cuda.is_bf16_supported():
        raise ConfigError('--amp bf16: this GPU does not support bf16; use --amp fp16')
    if cfg.amp == 'bf16' and device.type == 'cpu' and not cpu_has_native_bf16():
        raise ConfigError('--amp bf16: this CPU has no native bf16 (AVX512-BF16 or AMX), so autocast would emulate '
                          'it, slower than fp32; use --amp off')
    evaluation.check_inception_weights(cfg.inception_weights)
    if cfg.init_from and not resuming and not os.path.exists(cfg.init_from):
        raise ConfigError(f'--init-from {cfg.init_from}: no such checkpoint or folder')
    if cfg.tensorboard and importlib.util.find_spec('tensorboard') is None:
        raise ConfigError('--tensorboard needs the tensorboard package: pip install tensorboard')
    ffcv_missing = data.ffcv_missing_reason() if cfg.dataset == 'beton' else None  # importing ffcv costs seconds
    if ffcv_missing:
        raise ConfigError(f'--loader ffcv / --dataset beton: {ffcv_missing}')
    with refused_as(f'--image-size {cfg.image_size}' if not shape_of(cfg) else 'the UNet\'s shape (--preset '
                    f'{cfg.preset}, --image-size {cfg.image_size} and the shape flags)'):
        config = model_config_of(cfg)
    levels = [config.image_size // 2 ** i for i in range(len(config.channel_mults))]
    nowhere = sorted(set(config.attn_resolutions) - set(levels), reverse=True)
    if nowhere:  # given or the preset's: one rule, so that no flag silently removes the levels' attention
        asked = (f'--attn-resolutions {cfg.attn_resolutions}' if cfg.attn_resolutions is not None else
                 f'the preset\'s attention at {", ".join(map(str, nowhere))} pixels (--preset {cfg.preset})')
        raise ConfigError(f'{asked}: this UNet\'s levels are at {", ".join(map(str, levels))} pixels; attention '
                          f'elsewhere would never run: pass --attn-resolutions with some of those, or none')


# ----------------------------------------------------------------------------- outputs

def claim_outputs(cfg: TrainConfig, rank: int, fresh: bool):
    """The output folders checked writable before any work, and --out-dir claimed for this run
    (rank 0: files.claim_folder). A fresh run in a folder whose earlier run left metrics but no
    checkpoint starts its own metrics.jsonl; the old one is kept. Returns the lock's release."""
    if cfg.sample_every:
        check_writable(cfg.samples_dir, '--samples-dir')
    if rank != 0:
        check_writable(cfg.out_dir, '--out-dir')
        return lambda: None
    release = claim_folder(cfg.out_dir, '--out-dir', ('ckpt.pt.tmp', 'curves.png.tmp'),
                           ('metrics.jsonl',) if fresh else ())
    try:
        if cfg.tensorboard:
            check_writable(os.path.join(cfg.out_dir, 'tb'), '--tensorboard: its folder')
    except ConfigError:
        release()
        raise
    return release


# ----------------------------------------------------------------------------- what the loop calls

def interval_loss(run: Run, loss_sum: torch.Tensor, steps: int, step: int, last_good) -> float:
    """The mean loss of the last `steps` steps over all ranks: the host synchronisation of a log
    interval. A non-finite one stops the run before anything is logged or saved."""
    if run.world_size > 1:
        loss_sum = loss_sum.clone()
        dist.all_reduce(loss_sum)
    mean_loss = loss_sum.item() / (steps * run.world_size)
    if not math.isfinite(mean_loss):
        raise NonFiniteLoss(f'the loss became {mean_loss} between steps {step - steps + 1} and {step}; stopping. '
                            + (f'The last good checkpoint is {last_good}.' if last_good
                               else 'No checkpoint was written by this run.'))
    return mean_loss


def log_interval(run: Run, log, heldout, step: int, steps: int, mean_loss: float, with_heldout: bool):
    """A metrics.jsonl row: loss, speed and (unless a stop is under way) the held-out losses of
    the model and the EMA, which a signal cuts short."""
    row = log.train_row(step, steps, mean_loss, lr_at(step - 1, run.cfg, run.total_steps))
    if heldout is not None and with_heldout:
        with log.paused():
            try:
                with run.stop.interruptible(), own_rng(run.device):
                    for key, model in (('heldout_loss', run.model), ('heldout_loss_ema', run.ema)):
                        losses = evaluation.heldout_losses(model, run.sched, heldout, run.cfg, run.device)
                        row[key] = losses.mean().item()
            except StopRequested:  # cut short by a stop: the row without them
                row.pop('heldout_loss', None)
    log.write(row)
    log.bar.set_postfix(loss=f'{mean_loss:.4f}', img_s=f"{row['img_per_s'] or 0:.0f}")
    if run.cfg.eval_every:
        log.draw_curves()
    return row


def evaluate(run: Run, evaluator, log, step: int) -> dict | None:
    """An evaluation row (evaluation.Evaluator; {} on ranks other than 0); None if a stop cut it
    short (in one process; under DDP the ranks are inside its collectives, so it finishes)."""
    hours = log.training_seconds() / 3600
    with log.paused():
        try:
            with run.stop.interruptible() if run.world_size == 1 else contextlib.nullcontext(), own_rng(run.device):
                row = evaluator(step, hours)
        except StopRequested:
            log.print(f'evaluation at step {step} left out: a stop was requested; the resumed run owes it')
            return None
    if row:  # rank 0
        log.write(row)
        fid = f", FID {row['fid']:.2f} ({row['fid_samples']} samples)" if 'fid' in row else ''
        if 'digits_fd' in row:
            fid = (f", digits FD {row['digits_fd']:.2f} (floor {row['digits_fd_floor']:.2f}; {row['digits_samples']} "
                   f"samples, {row['digits_confident']:.0%} confident)")
        log.print(f"eval at {row['images_seen']:,} images ({row['train_hours']:.3f} training hours): bits/dim "
                  f"{row['bpd']:.4f} +- {row['bpd_stderr'] or 0:.4f}{fid}; {row['eval_seconds']:.1f} s")
        log.draw_curves()
    return row


def score_reached(cfg: TrainConfig, row: dict) -> bool:
    """Whether an evaluation's score (rank 0's row) is at or below --stop-at-score."""
    score = row.get(evaluation.score_key(cfg.dataset)) if cfg.stop_at_score else None
    return score is not None and score <= cfg.stop_at_score


def save_if_good(run: Run, step: int, log, eval_owed: bool, path: str, heldout, row: dict, last_good):
    """The checkpoint of this step, once proven good; a broken model stops the run instead, and
    the last good checkpoint stays (every rank agrees)."""
    with log.paused():
        problem = evaluation.weights_problem(run, heldout, row)
        if any_rank(problem is not None, run.control_group):
            raise NonFiniteLoss(f"at step {step}: {problem or 'a problem on another rank'}; stopping without a "
                                f"checkpoint. " + (f'The last good checkpoint is {last_good}.' if last_good
                                                   else 'No checkpoint was written by this run.'))
        state = checkpoint_state(run, step, eval_owed, log.training_seconds(), log.wall_seconds())
        if run.rank == 0:
            save_checkpoint(state, path)


def write_sample_grid(run: Run, log, path: str, step: int):
    """A grid of EMA samples (rank 0); a failure to write it is a warning and training goes on."""
    if run.ema is None:
        return
    with log.paused():
        try:
            with run.stop.interruptible(), own_rng(run.device):
                write_grid(run.ema, run.sched, run.cfg, run.device, path)  # a row per class with --class-cond
            log.grids.append(path)
            log.out.image('samples', path, step * run.cfg.batch_size)
        except StopRequested:
            log.print(f'{path}: left out, a stop was requested')
        except (OSError, RuntimeError) as error:  # a full disk; memory that a large grid runs out of
            log.print(f'warning: could not write the sample grid {path} ({brief(error)}); training goes on',
                      file=sys.stderr)


def finish_run(run: Run, step: int, stopped, log, ckpt_path: str) -> dict:
    """The end of a run: the DDP weight check, and (unless stopped by a signal) the last grid."""
    cfg = run.cfg
    if run.world_size > 1:
        identical = ranks_identical(run.model, run.control_group)
        log.print(f'ranks hold identical weights: {identical}')
        if not identical:
            raise RuntimeError('DDP ranks ended with different weights')
    result = {'step': step, 'stopped': stopped, 'last': log.last, 'checkpoint': ckpt_path}
    if stopped:
        launch = f'torchrun --nproc_per_node {run.world_size} train.py' if run.world_size > 1 else 'python train.py'
        log.print(f'stopped by {stopped} at step {step}: checkpoint saved to {ckpt_path}; continue with '
                  f'{launch} --resume {shlex.quote(ckpt_path)} (the run\'s settings are replayed from it)')
        return result
    per_epoch = run.loader.batches_per_epoch
    if cfg.sample_every and (step % per_epoch or (step // per_epoch) % cfg.sample_every == 0):
        name = f'epoch_{step // per_epoch:04d}.png' if step % per_epoch == 0 else f'step_{step:07d}.png'
        write_sample_grid(run, log, os.path.join(cfg.samples_dir, name), step)
    if cfg.eval_every:
        log.draw_curves(force=True)
    last, samples = log.last, f', samples in {cfg.samples_dir}/' if log.grids else ''
    losses = ', '.join(f'{name} {last[key]:.4f}' for key, name in (('loss', 'loss'), ('heldout_loss', 'held-out loss'),
                                                                    ('heldout_loss_ema', 'EMA')) if key in last)
    seconds = log.wall_seconds()
    log.write({'kind': 'done', 'step': step, 'wall_s': seconds, 'train_seconds': log.training_seconds()})
    log.print(f'done: {step} steps in {seconds:.1f}s; {losses or "no loss logged"}; checkpoint {ckpt_path}{samples}')
    return result


def start_logging(run: Run, step: int, train_seconds: float, wall_seconds: float = 0.0) -> tuple:
    """(Metrics, the held-out set, the Evaluator or None). Their start-up work (held-out images,
    Inception network, reference statistics) runs on every rank or on rank 0; if it fails on
    any rank, every rank stops with an error instead of leaving the others in a collective."""
    cfg = run.cfg

    def make():  # the progress bar last: an error before it is one clean line
        heldout = evaluation.make_heldout(cfg, run.device, run.sched.num_steps) if run.rank == 0 else None
        evaluator = evaluation.Evaluator(run) if cfg.eval_every else None
        return metrics.Metrics(run, step, run.total_steps, train_seconds, wall_seconds), heldout, evaluator
    with own_rng(run.device):  # the Inception network draws its initial weights: not from training's streams
        log, heldout, evaluator = on_all_ranks(make, run.control_group)
    if evaluator is not None and evaluator.fid_left_out:
        log.print(f'warning: FID is left out of the evaluations: {evaluator.fid_left_out}', file=sys.stderr)
    held = {'heldout_size': len(heldout[0]) if heldout else None,
            'eval_bpd_images': len(evaluator.images) if evaluator else None}
    for name, count in held.items():
        if count is not None and count < getattr(cfg, name):  # a split holds what it holds: said, not hidden
            log.print(f'--{name.replace("_", "-")} {getattr(cfg, name)}: the held-out {cfg.dataset} split has '
                      f'{count} images; all of them are used')
    if evaluator is not None and any_rank(cfg.eval_fid and evaluator.extractor is None, run.control_group):
        evaluator.extractor = evaluator.reference = None  # FID on every rank or on none
    log.restart_clock()  # the reference statistics are not training time
    return log, heldout, evaluator


if __name__ == '__main__':
    sys.exit(cli())

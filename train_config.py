"""train.py's flags, defaults and validation, which a researcher rarely edits: `TrainConfig` (one
field a flag, with its help text and range), the defaults that differ by preset and device
(`resolve_defaults`), every check made before any work (`validate`, `check_flags`) and the output
folders claimed at the start (`claim_outputs`). train.py imports what it needs from here."""
import dataclasses
import importlib.util
import os
from dataclasses import dataclass

import torch

import data
import diffusion
import evaluation
from cli import ConfigError, check_ranges, flag, given_fields, int_list, parse_config, refused_as
from devices import cpu_has_native_bf16, pick_device
from drawing import GRID_LIMIT
from files import check_writable, claim_folder
from model import PRESETS, get_config

NUM_TIMESTEPS = 1000  # T of the paper; every schedule has this many steps
COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')


# ----------------------------------------------------------------------------- config

# Named sets of flags: `--recipe NAME` stands for them, put before every other flag (a flag given
# beside it wins). digits-demo is the README's demo: the time-to-quality ladder's fastest arm (the
# paper's recipe with the two levers it keeps, Min-SNR-5 and a cosine lr decay to 0 at 200,000
# images) on tiny and the digits, on a CPU, to the first digits score at or below
# evaluation.DIGITS_TARGET that holds when drawn again (the ladder's target). An evaluation every
# 50,000 images: that arm's ladder runs score 74 to 88 at 112,500 images and 67 to 74 at 125,000, so
# three evaluations find the stop at 150,000 (docs/training.md#the-cpu-demo).
RECIPES = {
    'digits-demo': ('--dataset', 'digits', '--preset', 'tiny', '--image-size', '16', '--device', 'cpu', '--steps',
                    '6250', '--loss-weight', 'min-snr', '--lr-decay', 'cosine',
                    '--stop-at-score', f'{evaluation.DIGITS_TARGET:g}', '--eval-every', '50000',
                    '--eval-noise', 'fresh',
                    '--eval-bpd-images', '50', '--eval-bpd-timesteps', '4', '--sampler', 'dpm++', '--sample-steps',
                    '10', '--sample-every', '0'),
}


@dataclass
class TrainConfig:
    recipe: str = flag('', 'a named set of flags, taken as if given first (a flag given beside it wins): '
                           + '; '.join(f'{name} = {" ".join(flags)}' for name, flags in RECIPES.items()),
                       choices=('',) + tuple(RECIPES))
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
    sampler: str = flag('dpm++', 'sampler of the grids and the FID evaluations (dpm++: DPM-Solver++(2M)), each on its '
                                'default grid (diffusion.DEFAULT_SPACING; docs/sampling.md, "Which grid")',
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
    eval_draws: int | None = flag(None, 'independent draws of --eval-samples per evaluation, each scored alone and '
                                        'the scores averaged (default 1; digits: 3, which brings the score\'s sd '
                                        'across draws near 5 percent: docs/sampling.md, "A score that decides")',
                                  at_least=1, at_most=100)
    eval_noise: str = flag('fixed', 'the noise of the evaluations\' samples: fixed (the run\'s seed at every '
                                    'evaluation) or fresh (a new draw per evaluation, so that no draw\'s luck stays '
                                    'with a run; docs/benchmark.md measures why)', choices=('fixed', 'fresh'))
    stop_at_score: float | None = flag(None, 'end the run (checkpoint, exit 0) at the first evaluation whose score '
                                             '(FID; digits: the class FD, docs/sampling.md) is at or below this and '
                                             'stays there when drawn again with other seeds: training to a target, '
                                             'as the time-to-quality ladder does', positive=True)
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


# ----------------------------------------------------------------------------- the network of the flags

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


# ----------------------------------------------------------------------------- defaults and validation

def default_eval_draws(dataset: str) -> int:
    """Draws averaged per evaluation unless --eval-draws says otherwise: 3 for the digits score, whose one
    draw of 450 moves by a quarter of its value (docs/sampling.md#a-score-that-decides); 1 for FID."""
    return 3 if dataset == 'digits' else 1


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
                'eval_samples': 450 if cfg.dataset == 'digits' else 10000,
                'eval_draws': default_eval_draws(cfg.dataset)}
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
    levels, nowhere = attention_nowhere(config)
    if nowhere and cfg.attn_resolutions is not None:  # asked for: refused; the preset's own: said (attention_note)
        raise ConfigError(f'--attn-resolutions {cfg.attn_resolutions}: this UNet\'s levels are at '
                          f'{", ".join(map(str, levels))} pixels; attention elsewhere would never run: pass '
                          f'--attn-resolutions with some of those, or none')


def attention_nowhere(config) -> tuple:
    """(the levels' resolutions, the attention resolutions at none of them)."""
    levels = [config.image_size // 2 ** i for i in range(len(config.channel_mults))]
    return levels, sorted(set(config.attn_resolutions) - set(levels), reverse=True)


def attention_note(cfg: TrainConfig) -> str | None:
    """The start-up line when the preset's attention lies at no level of the UNet the flags make (--channel-mults
    1 on tiny, a preset at another --image-size): the levels then have none, as they always had; said, not
    refused, so that such a run, and a run of it started before, trains and resumes as it did."""
    levels, nowhere = attention_nowhere(model_config_of(cfg))
    if not nowhere or cfg.attn_resolutions is not None:
        return None
    return (f'note: the preset\'s attention at {", ".join(map(str, nowhere))} pixels is at no level of this UNet '
            f'(levels at {", ".join(map(str, levels))}): no attention in the levels (the middle block keeps its '
            f'own); --attn-resolutions puts it at a level')


def with_recipe(argv: list) -> list:
    """The command line with `--recipe NAME`'s flags put first, so that a flag given beside it wins
    (argparse keeps a flag's last value); NAME as argparse reads it (`--recipe=NAME`, an abbreviation), an
    unknown one refused by it in one line. --epochs given drops the recipe's --steps, which would win over it."""
    name = parse_config(argv, TrainConfig).recipe
    if not name:
        return list(argv)
    flags = list(RECIPES[name])
    if 'epochs' in given_fields(argv, TrainConfig) and '--steps' in flags:
        del flags[flags.index('--steps'):flags.index('--steps') + 2]
    return [*flags, *argv]


def check_flags(argv: list) -> TrainConfig:
    """The config train.py would run from these flags, resolved for its device, or the ConfigError it
    would stop with, without running anything: for scripts that plan runs of it."""
    cfg = parse_config(with_recipe(argv), TrainConfig, __doc__)
    device = pick_device(cfg.device, 0)
    cfg = resolve_defaults(cfg, device)
    validate(cfg, device, 1)
    return cfg


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

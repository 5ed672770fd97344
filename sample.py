"""Sample from a checkpoint, and evaluate it: FID against a data set, bits/dim on a data set.

    python sample.py --ckpt runs/ckpt.pt --num 50000 --sampler ddim --steps 50 --batch-size 1000 --out samples/
    python sample.py --ckpt runs/ckpt.pt --num 64 --grid                 # one grid PNG
    python sample.py --ckpt runs/ckpt.pt --num 50000 --fid                # FID vs CIFAR-10 train
    python sample.py --ckpt runs/ckpt.pt --bpd --bpd-num 10000            # bits/dim on CIFAR-10 test
    python sample.py --ckpt runs/ckpt.pt --export-diffusers runs/pipeline # a diffusers DDPMPipeline folder

Sampling uses the EMA weights (--weights model for the raw ones), bf16 autocast and
torch.compile on CUDA. Images go to disk batch by batch as they are drawn; SIGTERM or Ctrl-C
stops after the batch under way, and the same command continues (OUT/samples.json records the
settings). FID goes through torch-fidelity's InceptionV3 (the TF-FID-compatible network); its
weights download on first use, or come from --inception-weights offline. A digits checkpoint is
judged by the digits score instead (the same statistics in a digit classifier's features: no
download). It also holds the evaluation that train.py runs during training (held-out loss, FID or
the digits score, bits/dim of the EMA, curves.png), since it reuses the code above.
Exit codes: 0 done (or stopped with what was drawn written), 1 a write failed, 2 bad input, 3
the model drew NaN or inf.
"""
import contextlib
import copy
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import typing
import zipfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data
import diffusion
from cli import (ConfigError, StopFlag, atomic_open, atomic_path, autocast, brief, check_ranges, check_writable,
                 claim_folder, flag, gather_to_rank0, own_rng, parse_config, pick_device, pyplot, run_main,
                 save_figure)
from checkpoint import model_from_checkpoint, read_checkpoint, require_finite
from diffusers_io import diffusers_scheduler, read_diffusers, save_diffusers
from model import UNetConfig, count_flops


REFERENCE_SETS = ('cifar10', 'shapes', 'digits', 'folder', 'beton')


@dataclass
class SampleConfig:
    ckpt: str = flag('runs/ckpt.pt', 'checkpoint written by train.py, or a diffusers UNet2DModel or pipeline '
                                     'folder (such as google/ddpm-cifar10-32)')
    num: int = flag(64, 'images to draw', at_least=1)
    sampler: str = flag('ddim', 'ddim (any --steps), dpm++ (DPM-Solver++(2M), any --steps; its accuracy by steps: '
                                'docs/sampling.md) or ddpm (all T steps, ancestral)',
                        choices=('ddim', 'dpm++', 'ddpm'))
    steps: int = flag(50, 'model calls of ddim and dpm++', at_least=1)
    spacing: str = flag('logsnr', 'timesteps of dpm++: uniform in log-SNR or in time', choices=('logsnr', 'time'))
    eta: float = flag(0.0, 'DDIM eta (0: deterministic given the noise; above 1 would ask for more noise than the '
                           'step\'s posterior has)', at_least=0, at_most=1)
    variance: str = flag('fixedlarge', 'DDPM variance', choices=('fixedlarge', 'fixedsmall'))
    clip: str = flag('auto', 'clipping of the predicted x0 to [-1, 1]: auto is each sampler\'s own (ddpm clips, as the '
                             'paper\'s sampler; ddim and dpm++ do not, so that more steps converge to the ODE\'s '
                             'solution); x0 clips it (diffusers\' clip_sample), x0+eps also re-derives eps from it '
                             '(use_clipped_model_output; for ddpm the same as x0, its mean reads x0 alone); none '
                             'never clips; dpm++ takes auto or none', choices=('auto',) + diffusion.DDIM_CLIPS)
    batch_size: int = flag(256, 'images per sampling batch', at_least=1)
    out: str = flag('samples', 'output folder')
    format: str = flag('png', 'png (one file per image) or npz (one uint8 NHWC array, key arr_0)',
                       choices=('png', 'npz'))
    grid: bool = flag(False, 'write one grid PNG (out/grid.png) instead of separate images')
    weights: str = flag('ema', 'which weights to use', choices=('ema', 'model'))
    seed: int = flag(0, 'seed of the sampling noise', at_least=0, at_most=2 ** 32 - 1)
    device: str = flag('auto', 'auto, cpu, cuda or cuda:N')
    amp: str = flag('auto', 'autocast for sampling (auto: bf16 on CUDA); bits/dim always runs in fp32 unless '
                            'set explicitly', choices=('auto', 'off', 'bf16'))
    compile: typing.Optional[bool] = flag(None, 'torch.compile the model (default: on for CUDA)')
    fid: bool = flag(False, 'compute FID of the drawn images against --fid-data (for digits: the digits score, in '
                            'the features of a digit classifier, not Inception)')
    fid_data: str = flag('auto', 'reference set for FID: cifar10 (train split), shapes, digits (train split), folder '
                                 'or beton (--data-dir DIR or FILE.beton); auto: digits for a 1-channel model, else '
                                 'cifar10', choices=('auto',) + REFERENCE_SETS)
    data_dir: str = flag('./data', 'where the FID / bits/dim data set lives (digits: where the digit classifier is '
                                   'cached; the digits come with scikit-learn)')
    fid_stats: str = flag('', 'cache of the reference statistics (.npz; default: DATA_DIR/fid_stats_<set>_<size>.npz)')
    inception_weights: str = flag('', 'local InceptionV3 weights for FID (torch-fidelity\'s '
                                      'weights-inception-2015-12-05-6726825d.pth); default: download')
    bpd: bool = flag(False, 'compute the variational bound in bits/dim (T model calls per image)')
    bpd_data: str = flag('auto', 'data set for bits/dim: cifar10 (test split), shapes, digits (held-out split), '
                                 'folder or beton; auto: digits for a 1-channel model, else cifar10',
                         choices=('auto',) + REFERENCE_SETS)
    bpd_num: int = flag(10000, 'images for bits/dim, at most what the data set holds (CIFAR-10 test: 10000, '
                               'held-out digits: 450)', at_least=1)
    export_diffusers: str = flag('', 'instead of sampling, write the checkpoint\'s --weights as a diffusers '
                                     'DDPMPipeline folder here (DDPMPipeline.from_pretrained loads it)')
    bpd_timesteps: int = flag(0, 'bits/dim: 0 for the full bound (T model calls per image), K for its unbiased '
                                 'Monte Carlo estimate from K stratified timesteps (K + 1 calls per image)')


def load_model(path: str, weights: str, device) -> tuple:
    """(model in eval mode, its UNetConfig, its diffusion.Schedule, what it predicts: 'eps' or 'v')
    from a train.py checkpoint or a diffusers folder (its scheduler/scheduler_config.json, or the
    paper's schedule without one)."""
    named_as = f'--ckpt {path}'
    if os.path.isdir(path):
        model, scheduler = read_diffusers(path, named_as), diffusers_scheduler(path, named_as)
        kind, num_steps, prediction = scheduler['schedule'], scheduler['num_steps'], scheduler['prediction']
    else:
        ckpt = read_checkpoint(path, named_as)
        model, num_steps = model_from_checkpoint(ckpt, weights, named_as), 1000
        kind, prediction = ckpt['config'].get('schedule'), ckpt['config'].get('prediction', 'eps')
        if kind not in ('linear', 'cosine') or prediction not in diffusion.PREDICTIONS:
            raise ConfigError(f'{named_as}: not a train.py checkpoint (its schedule {kind!r}, '
                              f'prediction {prediction!r})')
    require_finite(model.state_dict(), f'{named_as}: its {weights} weights', 'sample an earlier checkpoint')
    return model.to(device).requires_grad_(False), model.config, diffusion.make_schedule(num_steps, kind), prediction


def sampling_amp(amp: str, device: torch.device) -> str:
    """--amp auto samples in bf16 on CUDA and in fp32 on the CPU."""
    return ('bf16' if device.type == 'cuda' else 'off') if amp == 'auto' else amp


class NonFiniteSamples(Exception):
    """The model drew NaN or inf (a diverged model): one line, exit code 3; the batch is not written."""
    exit_code = 3


def draw(model, config: UNetConfig, sched: diffusion.Schedule, cfg: SampleConfig, device, progress=True,
         rank: int = 0, world_size: int = 1, batches: list = None,
         prediction: str = 'eps') -> typing.Iterator[torch.Tensor]:
    """Yields uint8 (B, C, H, W) batches; batch i's noise comes from seed (seed, i), drawn on
    the device. With world_size > 1 this rank draws batches rank, rank + world_size, ...: the
    ranks together draw exactly the images one process would. `batches`: only these indices;
    `prediction`: what the model predicts ('eps' or 'v')."""
    sched = sched.to(device)
    if batches is None:
        batches = list(range(math.ceil(cfg.num / cfg.batch_size)))[rank::world_size]
    starts = [index * cfg.batch_size for index in batches]
    bar = tqdm(total=sum(min(cfg.batch_size, cfg.num - s) for s in starts), desc=f'{cfg.sampler} sampling',
               unit='img', disable=not progress, leave=False)
    try:
        for start in starts:
            yield draw_batch(model, sched, cfg, device, start, config, prediction)
            bar.update(min(cfg.batch_size, cfg.num - start))
    finally:  # also when a batch fails: the bar's line is cleared before the error is printed
        bar.close()


def draw_batch(model, sched: diffusion.Schedule, cfg: SampleConfig, device, start: int, config: UNetConfig,
               prediction: str = 'eps') -> torch.Tensor:
    """The batch holding images start, start + 1, ... as uint8 (B, C, H, W); refused if non-finite."""
    shape = (min(cfg.batch_size, cfg.num - start), config.in_channels, config.image_size, config.image_size)
    seed = int(np.random.SeedSequence([cfg.seed, start // cfg.batch_size]).generate_state(1)[0])
    generator = torch.Generator(device).manual_seed(seed)
    with autocast(sampling_amp(cfg.amp, device), device):
        x = diffusion.run_sampler(cfg.sampler, model, sched, shape, cfg.steps, generator, device, cfg.eta, cfg.spacing,
                                  cfg.variance, prediction, clip=None if cfg.clip == 'auto' else cfg.clip)
    if not x.isfinite().all():
        raise NonFiniteSamples(f'the model drew NaN or inf in batch {start // cfg.batch_size} (images {start} '
                               f'to {start + shape[0] - 1}): it has diverged; nothing of that batch is written')
    return to_uint8(x)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats to uint8 (B, C, H, W), rounding to the nearest of 256 levels."""
    return ((x.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


# ----------------------------------------------------------------------------- writing samples

MANIFEST = 'samples.json'  # the settings a folder's samples were drawn with: a rerun must match them
GRID_LIMIT = 4096  # images in one --grid PNG (it is held in memory)
SETTINGS = ('weights', 'num', 'sampler', 'steps', 'eta', 'spacing', 'variance', 'clip', 'batch_size', 'format',
            'grid', 'seed', 'amp')


def sample_settings(cfg: SampleConfig) -> dict:
    """What decides the images: the checkpoint (its path and the sha256 of its bytes, or of a
    diffusers folder's files) and the sampling flags."""
    import hashlib
    digest = hashlib.sha256()
    files = [cfg.ckpt] if os.path.isfile(cfg.ckpt) else sorted(
        os.path.join(folder, name) for folder, _, names in os.walk(cfg.ckpt) for name in names)
    for path in files:
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 24), b''):
                digest.update(block)
    return {'ckpt': os.path.realpath(cfg.ckpt), 'ckpt_sha256': digest.hexdigest(),
            **{name: getattr(cfg, name) for name in SETTINGS}}


def batch_paths(cfg: SampleConfig, index: int) -> list:
    """The files batch `index` is written to: its PNGs, or its part of the .npz."""
    if cfg.format == 'npz':
        return [os.path.join(cfg.out, 'parts', f'batch_{index:06d}.npy')]
    first = index * cfg.batch_size
    return [os.path.join(cfg.out, f'{i:06d}.png') for i in range(first, min(first + cfg.batch_size, cfg.num))]


def npz_path(cfg: SampleConfig, size: int) -> str:
    """OUT/samples_NxS.npz: one uint8 (N, S, S, C) array."""
    return os.path.join(cfg.out, f'samples_{cfg.num}x{size}.npz')


def write_batch(images: torch.Tensor, paths: list, file_format: str):
    """One batch of uint8 (B, C, H, W) images, each file written whole or not at all: PNGs in RGB,
    or grey ('L') for one channel."""
    from PIL import Image
    pixels = images.permute(0, 2, 3, 1).numpy()  # (B, H, W, C)
    if file_format == 'npz':
        with atomic_open(paths[0], 'wb', durable=False) as f:
            np.save(f, pixels)
        return
    for path, image in zip(paths, pixels):
        with atomic_open(path, 'wb', durable=False) as f:
            Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(f, format='png')


def assemble_npz(cfg: SampleConfig, config: UNetConfig, num_batches: int) -> str:
    """The parts, in order, as one uint8 (N, H, W, C) array 'arr_0' of an .npz, streamed: memory
    holds one part at a time."""
    size = config.image_size
    path = npz_path(cfg, size)
    header = {'descr': '|u1', 'fortran_order': False, 'shape': (cfg.num, size, size, config.in_channels)}
    with atomic_path(path) as tmp, zipfile.ZipFile(tmp, 'w') as archive, \
            archive.open('arr_0.npy', 'w', force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, header)
        for index in range(num_batches):
            f.write(np.load(batch_paths(cfg, index)[0]).tobytes())
    shutil.rmtree(os.path.join(cfg.out, 'parts'))
    return path


def written_batches(cfg: SampleConfig, config: UNetConfig) -> typing.Iterator[torch.Tensor]:
    """The samples on disk, as uint8 (B, C, H, W) batches: what FID measures (and what any other
    tool would read)."""
    from PIL import Image
    size, channels = config.image_size, config.in_channels
    if cfg.format == 'png':
        for index in range(math.ceil(cfg.num / cfg.batch_size)):
            images = []
            for path in batch_paths(cfg, index):
                with Image.open(path) as image:
                    pixels = np.asarray(image.convert('L' if channels == 1 else 'RGB')).reshape(size, size, channels)
                    images.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1))
            yield torch.stack(images)
        return
    with zipfile.ZipFile(npz_path(cfg, size)) as archive, archive.open('arr_0.npy') as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
        count = read_header(f)[0][0]
        for start in range(0, count, cfg.batch_size):
            n = min(cfg.batch_size, count - start)
            pixels = np.frombuffer(f.read(n * size * size * channels), np.uint8).reshape(n, size, size, channels)
            yield torch.from_numpy(pixels.copy()).permute(0, 3, 1, 2)


def our_samples(cfg: SampleConfig, settings: dict) -> bool:
    """Whether --out (claimed by this run) holds samples of these very settings, to continue. Samples
    are written only into an empty folder or one of ours (its samples.json): a folder of other files
    is refused, since a user's 000000.png or grid.png would be overwritten, and so is one holding
    samples drawn with other settings."""
    path = os.path.join(cfg.out, MANIFEST)
    others = sorted(set(os.listdir(cfg.out)) - {'lock', MANIFEST})
    if others and not os.path.isfile(path):
        raise ConfigError(f"--out {cfg.out} holds files that sample.py did not write ({', '.join(others[:3])}"
                          f"{', ...' if len(others) > 3 else ''}; no {MANIFEST}): pass an empty or new folder")
    if not (any(name.endswith(('.png', '.npz')) for name in others) or 'parts' in others):
        return False
    try:
        with open(path) as f:
            saved = json.load(f)
    except ValueError:
        saved = {}
    differing = [f'{k} {saved.get(k)!r}, now {v!r}' for k, v in settings.items() if saved.get(k) != v]
    if differing:
        raise ConfigError(f"--out {cfg.out} holds samples drawn with other settings ({'; '.join(differing[:3])}): "
                          f"pass another --out, or empty that one")
    return True


def continue_or_start(cfg: SampleConfig, config: UNetConfig) -> list:
    """The batches still to draw in --out: all of them, or those a stopped run of the same settings
    left (our_samples); refused when the disk cannot hold them. Records the settings."""
    settings, path = sample_settings(cfg), os.path.join(cfg.out, MANIFEST)
    size, channels = config.image_size, config.in_channels
    batches = range(math.ceil(cfg.num / cfg.batch_size))
    todo = batches
    if our_samples(cfg, settings):
        # A batch's files are written in order, each whole: its last file is there once all are.
        todo = [] if cfg.format == 'npz' and os.path.isfile(npz_path(cfg, size)) else \
            [b for b in batches if not os.path.isfile(batch_paths(cfg, b)[-1])]
    count = cfg.num if todo is batches else sum(min(cfg.batch_size, cfg.num - b * cfg.batch_size) for b in todo)
    per_image = size * size * channels  # npz: the parts and the archive; png: a file takes a 4 kB block at least
    need = count * (2 * per_image if cfg.format == 'npz' else max(per_image, 4096))
    free = shutil.disk_usage(cfg.out).free
    if need > free:
        raise ConfigError(f'--num {cfg.num}: the samples need about {need / 1e9:.1f} GB and {cfg.out} has '
                          f'{free / 1e9:.1f} GB free: pass a smaller --num or another --out')
    with atomic_open(path) as f:  # once every check has passed: a refused run leaves no settings behind
        json.dump(settings, f, indent=1)
    return todo


def stream_samples(model, config: UNetConfig, sched: diffusion.Schedule, cfg: SampleConfig, device,
                   prediction: str = 'eps') -> dict:
    """Draws the batches --out still lacks, writing each as soon as it is drawn (memory: one
    batch); a rerun with the same arguments continues a stopped run, with the images one run
    would have drawn. SIGTERM or Ctrl-C: the batch under way is drawn and written, then the run
    stops (exit 0). The .npz is assembled once every batch is on disk."""
    size, num_batches = config.image_size, math.ceil(cfg.num / cfg.batch_size)
    todo = continue_or_start(cfg, config)
    stop, drawn, start = StopFlag(), 0, time.perf_counter()
    restore_signals = stop.install()
    try:
        for index, images in zip(todo, draw(model, config, sched, cfg, device, batches=todo, prediction=prediction)):
            write_batch(images, batch_paths(cfg, index), cfg.format)
            drawn += len(images)
            if stop.reason is not None:
                break
    finally:
        restore_signals()
    seconds = time.perf_counter() - start
    complete = drawn == sum(min(cfg.batch_size, cfg.num - b * cfg.batch_size) for b in todo)
    path = cfg.out
    if complete:
        path = (npz_path(cfg, size) if os.path.isfile(npz_path(cfg, size)) else assemble_npz(cfg, config, num_batches)
                ) if cfg.format == 'npz' else os.path.join(cfg.out, f'{0:06d}.png ... {cfg.num - 1:06d}.png')
    return {'images': drawn, 'seconds': seconds, 'complete': complete, 'stopped': None if complete else stop.reason,
            'path': path}


def write_grid_png(images: torch.Tensor, path: str):
    """uint8 (B, C, H, W) images as one square-ish grid PNG: RGB, or grey ('L') for one channel."""
    from PIL import Image
    from torchvision.utils import make_grid
    grid = make_grid(images, nrow=max(1, int(math.sqrt(len(images)))))  # (3, H', W'): one channel repeated
    pixels = grid[:images.shape[1]].permute(1, 2, 0).numpy()
    with atomic_open(path, 'wb') as f:
        Image.fromarray(pixels[:, :, 0] if images.shape[1] == 1 else pixels).save(f, format='png')


@torch.no_grad()
def write_grid(model, sched: diffusion.Schedule, cfg, device, path: str):
    """train.py's sample grid: cfg.num_samples images of cfg.sampler from the same noise every
    time (seed cfg.seed), in cfg.amp, as one PNG."""
    shape = (cfg.num_samples, model.config.in_channels, cfg.image_size, cfg.image_size)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    with autocast(cfg.amp, device):
        images = diffusion.run_sampler(cfg.sampler, model, sched, shape, cfg.sample_steps, generator, device,
                                       prediction=cfg.prediction)
    write_grid_png(to_uint8(images), path)


# ----------------------------------------------------------------------------- FID

def inception_extractor(weights_path: str, device) -> typing.Callable:
    """torch-fidelity's InceptionV3 (pool3, 2048 features), as uint8 (B, 3, H, W) -> (B, 2048)."""
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3
    check_inception_weights(weights_path)
    try:
        network = FeatureExtractorInceptionV3('inception-v3-compat', ['2048'],
                                              feature_extractor_weights_path=weights_path or None)
    except Exception as error:
        if weights_path:
            raise ConfigError(f'--inception-weights {weights_path}: cannot load it ({brief(error)})') from None
        raise ConfigError(
            f'FID needs the InceptionV3 weights, and downloading them failed ({brief(error)}). '
            f'Offline, fetch {URL_INCEPTION_V3} on a machine with network and pass --inception-weights PATH') from None
    network = network.to(device).eval()
    return lambda images: network(images.to(device))[0].double().cpu()


def check_inception_weights(path: str):
    """--inception-weights, when given, must be a file (whether it loads, inception_extractor says)."""
    if path and not os.path.isfile(path):
        raise ConfigError(f'--inception-weights {path}: no such file')


def features_of(batches: typing.Iterable[torch.Tensor], extractor: typing.Callable) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([extractor(batch) for batch in batches]).numpy()


def statistics(features: np.ndarray) -> dict:
    """Mean and covariance of the features, as torch-fidelity computes them."""
    from torch_fidelity.metric_fid import fid_features_to_statistics
    return fid_features_to_statistics(torch.from_numpy(features))


def frechet_distance(stats_a: dict, stats_b: dict) -> float:
    """||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a S_b)^1/2) (Heusel et al., 2017), via torch-fidelity."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric
    return fid_statistics_to_metric(stats_a, stats_b, verbose=False)[KEY_METRIC_FID]


def reference_images(name: str, data_dir: str, image_size: int, split_train: bool,
                     flag: str = '--fid-data') -> torch.Tensor:
    """A reference set: the training split (FID) or the held-out one (bits/dim); `flag` names it."""
    if name == 'cifar10':
        return data.resize_images(data.load_cifar10(data_dir, split_train, True, flag), image_size)
    if name == 'shapes':
        return data.make_shapes(50000 if split_train else 10000, image_size,
                                seed=0 if split_train else data.SHAPES_HELDOUT_SEED)
    if name == 'digits':
        return data.load_digits_split(image_size, heldout=not split_train)[0]
    if name not in ('folder', 'beton'):
        raise ConfigError(f"unknown data set {name!r}: use {', '.join(REFERENCE_SETS)}")
    return data.dataset_images(data.load_dataset(name, data_dir, image_size))  # no split: all of it


def reference_statistics(name: str, data_dir: str, image_size: int, extractor, batch_size: int,
                         cache: str = '') -> dict:
    """Statistics of the FID reference set (the training split of `name`), cached in an .npz
    (default: DATA_DIR/fid_stats_<name>_<size>.npz, beside a .beton file) so that they are computed once."""
    folder = os.path.dirname(data_dir) if os.path.isfile(data_dir) else data_dir  # a .beton is a file
    path = cache or os.path.join(folder, f'fid_stats_{name}_{image_size}.npz')
    if os.path.isfile(path):
        cached = np.load(path)
        return {'mu': cached['mu'], 'sigma': cached['sigma']}
    images = reference_images(name, data_dir, image_size, split_train=True)
    batches = tqdm(images.split(batch_size), desc=f'reference features ({name})', leave=False)
    stats = statistics(features_of(batches, extractor))
    with atomic_open(path, 'wb') as f:  # a run killed mid-write leaves no half cache
        np.savez(f, mu=stats['mu'], sigma=stats['sigma'])
    return stats


# ----------------------------------------------------------------------------- the digits score

# FID's recipe in another feature space: Inception cannot be downloaded everywhere and was never
# meant for 1-channel digits, so the digits are judged in the features of a small classifier
# trained on their training split (seconds on a CPU, cached). The statistics and the distances
# are torch-fidelity's, as for FID.
DIGITS_CLASSIFIER_VERSION = 1  # part of the cache key: a change to the network or its training retrains it
DIGITS_TRAINING = {'epochs': 20, 'batch_size': 64, 'lr': 2e-3, 'seed': 0, 'resolution': 16}
CONFIDENT = 0.9  # a sample labelled with at least this probability counts as a recognisable digit


class DigitsClassifier(torch.nn.Module):
    """Two convolutions and 64 features before a linear read-out of the 10 classes. Every input
    size is resized to 16x16 first, so one network (and its cost) serves every --image-size."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 32, 8, 8)
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),  # (B, 64, 4, 4)
            nn.Flatten(), nn.Linear(64 * 16, 64), nn.ReLU())  # (B, 64): the features
        self.head = nn.Linear(64, 10)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 1, S, S) -> (B, 64)."""
        x = torch.nn.functional.interpolate(images.float() / 127.5 - 1, size=DIGITS_TRAINING['resolution'],
                                            mode='bilinear', antialias=True, align_corners=False)
        return self.body(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def train_digits_classifier(image_size: int) -> tuple:
    """(classifier, held-out accuracy): Adam on the training split at image_size, from a fixed
    seed, on the CPU, leaving the global RNG where it was."""
    settings = DIGITS_TRAINING
    images, labels = data.load_digits_split(image_size, heldout=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings['seed'])
        classifier = DigitsClassifier()
        optimizer = torch.optim.Adam(classifier.parameters(), lr=settings['lr'])
        for _ in range(settings['epochs']):
            for batch in torch.randperm(len(images)).split(settings['batch_size']):
                loss = torch.nn.functional.cross_entropy(classifier(images[batch]), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    heldout, heldout_labels = data.load_digits_split(image_size, heldout=True)
    with torch.no_grad():
        accuracy = (classifier.eval()(heldout).argmax(1) == heldout_labels).double().mean().item()
    return classifier, accuracy


def digits_classifier(image_size: int, cache_dir: str) -> tuple:
    """The trained classifier and its held-out accuracy, from CACHE_DIR/digits_classifier_<size>_<key>.pt
    when there, else trained and cached; the key hashes what decides the weights (the version,
    the settings, the image size and the training images)."""
    import hashlib
    images = data.load_digits_split(image_size, heldout=False)[0]
    key = hashlib.sha256(json.dumps([DIGITS_CLASSIFIER_VERSION, DIGITS_TRAINING, image_size]).encode()
                         + images.numpy().tobytes()).hexdigest()[:16]
    path = os.path.join(cache_dir, f'digits_classifier_{image_size}_{key}.pt')
    classifier = DigitsClassifier()
    if os.path.isfile(path):
        with contextlib.suppress(Exception):  # an unreadable cache is retrained, not an error
            saved = torch.load(path, map_location='cpu', weights_only=True)
            classifier.load_state_dict(saved['weights'])
            return classifier.eval(), saved['accuracy']
    classifier, accuracy = train_digits_classifier(image_size)
    check_writable(cache_dir, '--data-dir')
    with atomic_open(path, 'wb', unique=True) as f:  # processes training it at once each write their own
        torch.save({'weights': classifier.state_dict(), 'accuracy': accuracy}, f)
    return classifier, accuracy


def kernel_distance(features: np.ndarray, reference: np.ndarray, seed: int = 0) -> tuple:
    """KID (Binkowski et al. 2018, unbiased for small sample counts) through torch-fidelity: the
    mean and spread of the unbiased MMD^2 with the cubic kernel over 100 random subsets of equal
    size. The samples are put in one canonical order first, so that their order does not change
    which subsets are drawn."""
    from torch_fidelity.metric_kid import KEY_METRIC_KID_MEAN, KEY_METRIC_KID_STD, kid_features_to_metric
    features = features[np.lexsort(features.T[::-1])]
    subset = min(len(features), len(reference), 1000)
    kid = kid_features_to_metric(torch.from_numpy(features), torch.from_numpy(reference), kid_subsets=100,
                                 kid_subset_size=subset, rng_seed=seed, verbose=False)
    return kid[KEY_METRIC_KID_MEAN], kid[KEY_METRIC_KID_STD]


class DigitsJudge:
    """The digits score of a set of 1-channel images: Frechet distance and KID between their
    classifier features and those of the training split, the share the classifier labels
    confidently, and the entropy of the labels (log2(10) = 3.32 bits for balanced digits)."""

    def __init__(self, image_size: int, cache_dir: str):
        self.classifier, self.accuracy = digits_classifier(image_size, cache_dir)
        self.reference = self.features(data.load_digits_split(image_size, heldout=False)[0])
        self.reference_stats = statistics(self.reference)
        # The floor: real digits the classifier never saw (the 450 held-out ones) against the same statistics.
        self.floor = self.score(self.features(data.load_digits_split(image_size, heldout=True)[0]))

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> np.ndarray:
        """uint8 (N, 1, S, S) -> float64 (N, 64), in batches on the CPU."""
        return torch.cat([self.classifier.features(b.cpu()).double() for b in images.split(512)]).numpy()

    @torch.no_grad()
    def score(self, features: np.ndarray) -> dict:
        kid, kid_std = kernel_distance(features, self.reference)
        probs = self.classifier.head(torch.from_numpy(features).float()).softmax(1)
        counts = torch.bincount(probs.argmax(1), minlength=10).double()
        shares = counts[counts > 0] / len(features)
        return {'digits_fd': frechet_distance(statistics(features), self.reference_stats),
                'digits_kid': kid, 'digits_kid_std': kid_std,
                'digits_confident': (probs.max(1).values >= CONFIDENT).double().mean().item(),
                'digits_class_entropy': abs((shares * shares.log2()).sum().item()), 'digits_samples': len(features),
                'digits_features': f'digits classifier v{DIGITS_CLASSIFIER_VERSION} (64 features, held-out '
                                   f'accuracy {self.accuracy:.4f})'}


# ----------------------------------------------------------------------------- bits/dim

def bits_per_image(model, sched: diffusion.Schedule, images: torch.Tensor, batch_size: int, device,
                   generator: torch.Generator, timesteps: int = 0, amp: str = 'off', progress: bool = True,
                   prediction: str = 'eps') -> dict:
    """Per image (uint8 (N, 3, H, W) in): the full bound (timesteps=0, T model calls each) or its
    unbiased Monte Carlo estimate from `timesteps` timesteps; {'total', 'prior', 'decoder'} (N,)."""
    sched = sched.to(device)
    parts = {'total': [], 'prior': [], 'decoder': []}
    calls = model_calls_per_image(timesteps, sched.num_steps)
    for batch in tqdm(images.split(batch_size), desc=f'bits/dim ({calls} model calls per image)', leave=False,
                      disable=not progress):
        x0 = batch.to(device).float() / 127.5 - 1
        with autocast(amp, device):
            if timesteps:
                result = diffusion.vlb_bits_per_dim_mc(model, sched, x0, timesteps, generator=generator,
                                                       prediction=prediction)
            else:
                result = diffusion.vlb_bits_per_dim(model, sched, x0, generator=generator, prediction=prediction)
        for key in parts:
            parts[key].append(result[key].double().cpu())
    return {key: torch.cat(value) for key, value in parts.items()}


def model_calls_per_image(timesteps: int, num_steps: int) -> int:
    """The full bound calls the model once per timestep; the estimate once per drawn timestep
    plus once for the decoder term."""
    return timesteps + 1 if timesteps else num_steps


def summarise_bits(per_image: dict, timesteps: int, num_steps: int) -> dict:
    """The mean bits/dim and its standard error over images (which, for the Monte Carlo
    estimate, holds the spread of the timestep draws too)."""
    total = per_image['total']
    return {'bits_per_dim': total.mean().item(),
            'stderr': (total.std() / math.sqrt(len(total))).item() if len(total) > 1 else None,
            'prior': per_image['prior'].mean().item(), 'decoder': per_image['decoder'].mean().item(),
            'images': len(total), 'model_calls_per_image': model_calls_per_image(timesteps, num_steps),
            'estimate': f'Monte Carlo, {timesteps} stratified timesteps' if timesteps else 'full bound'}


def bits_per_dim(model, config: UNetConfig, sched: diffusion.Schedule, cfg: SampleConfig, device,
                 prediction: str = 'eps') -> dict:
    images = reference_images(cfg.bpd_data, cfg.data_dir, config.image_size, split_train=False, flag='--bpd-data')
    if len(images) < cfg.bpd_num:
        print(f'--bpd-num {cfg.bpd_num}: {cfg.bpd_data} holds {len(images)} images to evaluate; bits/dim on all '
              f'of them')
    images = images[:cfg.bpd_num]
    amp = 'off' if cfg.amp == 'auto' else cfg.amp  # the likelihood in fp32 unless asked otherwise
    generator = torch.Generator(device).manual_seed(cfg.seed)
    per_image = bits_per_image(model, sched, images, cfg.batch_size, device, generator, cfg.bpd_timesteps, amp,
                               prediction=prediction)
    return {**summarise_bits(per_image, cfg.bpd_timesteps, sched.num_steps), 'data': cfg.bpd_data}


# ----------------------------------------------------------------------------- evaluation during training

# The held-out loss's noise comes from its own generator, the same for every run and seed, and
# never from the training streams: a resumed run and an uninterrupted one measure alike.
HELDOUT_NOISE_SEED = 12345


def make_heldout(cfg, device, num_steps: int) -> tuple:
    """The held-out set of train.py's held-out loss: cfg.heldout_size fixed images, one timestep
    each, spread evenly over 0..T-1, and noise from HELDOUT_NOISE_SEED."""
    images = data.load_heldout(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.heldout_size).to(device)
    generator = torch.Generator().manual_seed(HELDOUT_NOISE_SEED)
    t = (torch.arange(len(images)) * num_steps // len(images)).to(device)
    noise = torch.randn(images.shape, generator=generator).to(device)
    return images, t, noise


@torch.no_grad()
def heldout_losses(model, sched: diffusion.Schedule, heldout: tuple, cfg, device) -> torch.Tensor:
    """Per-image training loss on the fixed images, timesteps and noise (no flips, no dropout):
    comparable across steps, runs and settings, since it is always L_simple, the eps MSE (a v
    model's output is read as the eps it stands for; no Min-SNR weights). Returns (N,) on the CPU."""
    was_training = model.training
    model.eval()
    eps_model = diffusion.as_eps_model(model, sched, cfg.prediction)
    images, t, noise = heldout
    losses = []
    try:
        for chunk in torch.arange(len(images), device=device).split(cfg.batch_size):
            x0 = data.to_model_input(images[chunk], torch.zeros_like(chunk, dtype=torch.bool))
            if cfg.channels_last:
                x0 = x0.contiguous(memory_format=torch.channels_last)
            with autocast(cfg.amp, device):
                losses.append(diffusion.training_loss(eps_model, sched, x0, t[chunk], noise[chunk], per_example=True))
    finally:  # also when a stop cuts the evaluation short: training goes on in training mode
        model.train(was_training)
    return torch.cat(losses).cpu()


def weights_problem(run, heldout, row: dict):
    """Why train.py must not save the weights of `run` (a train.Run; None: it may): a non-finite
    weight of the model or the EMA, or a non-finite held-out loss of either (from this step's log
    row, or after a stop, which skips it, from one batch of the held-out set)."""
    for name, module in (('weights', run.model), ('EMA weights', run.ema)):
        if module is not None and not torch.stack([p.isfinite().all() for p in module.parameters()]).all():
            return f'non-finite {name}'
    if heldout is None:
        return None
    for key, module in (('heldout_loss', run.model), ('heldout_loss_ema', run.ema)):
        loss = row.get(key)
        if loss is None:
            with own_rng(run.device):
                few = tuple(x[:run.cfg.batch_size] for x in heldout)
                loss = heldout_losses(module, run.sched, few, run.cfg, run.device).mean().item()
        if not math.isfinite(loss):
            return f"a held-out loss of {loss} ({'EMA' if 'ema' in key else 'model'})"
    return None


def evaluation_seed(seed: int, step: int, rank: int) -> int:
    """The seed of an evaluation's bits/dim draws: one stream per (run seed, step, rank), none of
    them the training's (a function of the three alone, so a resumed run draws what it would have)."""
    return int(np.random.SeedSequence([seed, step, rank, 1]).generate_state(1)[0])


class Evaluator:
    """FID of EMA samples (the digits score for digits) and a Monte Carlo estimate of the EMA's
    bits/dim on held-out images, for train.py --eval-every. Every rank takes a share (batches of
    samples, held-out images), so that none waits idle into a timeout; rank 0 gathers and returns
    the row. The reference statistics are computed (or read from their cache) here, at the
    start, so that a missing data set or Inception network shows before training, not after.
    `run` is a train.Run."""

    def __init__(self, run):
        cfg, self.run = run.cfg, run
        self.images = data.load_heldout(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.eval_bpd_images)
        self.extractor = self.reference = self.judge = None
        self.fid_left_out = None  # why FID is left out (offline without Inception weights)
        if cfg.eval_fid and cfg.dataset == 'digits':
            self.judge = DigitsJudge(cfg.image_size, cfg.data_dir) if run.rank == 0 else None
        elif cfg.eval_fid:
            try:
                self.extractor = inception_extractor(cfg.inception_weights, run.device)
            except ConfigError as error:
                if cfg.inception_weights:  # the user's file: its error stops the run, as in sample.py
                    raise
                self.fid_left_out = str(error)
        if self.extractor is not None and run.rank == 0:
            self.reference = reference_statistics(cfg.dataset, cfg.data_dir, cfg.image_size, self.extractor,
                                                  self.batch_size)
        self.sampling = SampleConfig(num=cfg.eval_samples, batch_size=self.batch_size, sampler=cfg.sampler,
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
        generator = torch.Generator(run.device).manual_seed(evaluation_seed(cfg.seed, step, run.rank))
        mine = self.images[run.rank::run.world_size]
        bits = bits_per_image(ema, run.sched, mine, self.batch_size, run.device, generator,
                              cfg.eval_bpd_timesteps, amp='off', progress=False, prediction=cfg.prediction)
        features = None  # Inception features, or for digits the samples themselves (rank 0 judges them)
        if self.extractor is not None or cfg.dataset == 'digits' and cfg.eval_fid:
            samples = draw(ema, run.model.config, run.sched, self.sampling, run.device, progress=False,
                           rank=run.rank, world_size=run.world_size, prediction=cfg.prediction)
            features = features_of(samples, self.extractor).astype('float32') if self.extractor else torch.cat(
                list(samples))
        bits, features = gather_to_rank0((bits, features), run.rank, run.world_size, run.control_group)
        if run.rank != 0:
            return {}
        row = {'kind': 'eval', 'step': step, 'images_seen': step * cfg.batch_size, 'train_hours': train_hours}
        summary = summarise_bits({k: torch.cat([b[k] for b in bits]) for k in bits[0]},
                                 cfg.eval_bpd_timesteps, run.sched.num_steps)
        row.update(bpd=summary['bits_per_dim'], bpd_stderr=summary['stderr'], bpd_images=summary['images'],
                   bpd_model_calls_per_image=summary['model_calls_per_image'])
        steps = run.sched.num_steps if cfg.sampler == 'ddpm' else cfg.sample_steps
        if self.extractor is not None:
            stats = statistics(np.concatenate(features).astype('float64'))
            row.update(fid=frechet_distance(stats, self.reference), fid_samples=cfg.eval_samples,
                       fid_sampler=f'{cfg.sampler}-{steps}')
        if self.judge is not None:
            row.update(self.judge.score(self.judge.features(torch.cat(features))),
                       digits_sampler=f'{cfg.sampler}-{steps}', digits_fd_floor=self.judge.floor['digits_fd'])
        row['eval_seconds'] = time.perf_counter() - start
        return row


def write_curves(metrics_path: str, png_path: str):
    """OUT/curves.png from metrics.jsonl: training and held-out losses, bits/dim (with its
    standard error) and FID (or the digits score, with its floor) against training images seen,
    training hours on the top axis."""
    import matplotlib.ticker
    plt = pyplot()
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train_rows = [r for r in rows if r.get('kind') == 'train']
    eval_rows = [r for r in rows if r.get('kind') == 'eval']
    panels = [('loss', train_rows)]
    panels += [(name, eval_rows) for name in ('bpd', 'fid', 'digits_fd') if any(name in r for r in eval_rows)]
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
            if name == 'digits_fd' and points:
                ax.axhline(points[-1]['digits_fd_floor'], color='gray', linestyle=':', label='floor (held-out digits)')
                ax.set_yscale('log')
                ax.legend(fontsize=8)
        ax.set_ylabel({'loss': 'loss (eps MSE)', 'bpd': 'bits/dim (EMA, held-out)', 'fid': 'FID (EMA samples)',
                       'digits_fd': 'digits FD (classifier features)'}[name])
        ax.set_xlabel('training images seen')
        ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=''))  # 20k, 1.5M: long counts overlap
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(6))
        ax.grid(alpha=0.3)
        add_hours_axis(ax, rows)
    save_figure(fig, png_path)


def add_hours_axis(ax, rows: list):
    """Training time (evaluation, grids and checkpoints left out) as a top axis: hours, or minutes
    for a run shorter than two hours."""
    import matplotlib.ticker
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
    unit, scale = ('minutes', 60.0) if hours[-1] < 2 else ('hours', 1.0)  # a CPU demo runs for minutes
    times = hours * scale
    top = ax.secondary_xaxis('top', functions=(lambda x: np.interp(x, images, times),
                                               lambda h: np.interp(h, times, images)))
    top.set_xlabel(f'training {unit}', fontsize=8)
    top.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5, integer=unit == 'minutes'))


# ----------------------------------------------------------------------------- main

def validate(cfg: SampleConfig, config: UNetConfig, sched: diffusion.Schedule) -> SampleConfig:
    """The flags that depend on the model (its schedule, its channels), and the output folder
    (created and checked writable); check_ranges checked the others before the model was loaded.
    Returns cfg with --fid-data and --bpd-data resolved."""
    for name in ('fid_data', 'bpd_data'):
        value = getattr(cfg, name)
        if value == 'auto':
            cfg = dataclasses.replace(cfg, **{name: 'digits' if config.in_channels == 1 else 'cifar10'})
        elif data.channels_of(value) != config.in_channels:
            raise ConfigError(f'--{name.replace("_", "-")} {value}: its images have {data.channels_of(value)} '
                              f'channel(s), the model draws {config.in_channels}')
    if cfg.sampler != 'ddpm' and cfg.steps > sched.num_steps:
        raise ConfigError(f'--steps {cfg.steps}: the model\'s schedule has only T={sched.num_steps} steps')
    if not 0 <= cfg.bpd_timesteps < sched.num_steps:
        raise ConfigError(f'--bpd-timesteps must be in [0, {sched.num_steps - 1}], got {cfg.bpd_timesteps}')
    check_inception_weights(cfg.inception_weights)
    if cfg.export_diffusers:
        if os.path.exists(cfg.export_diffusers) and (not os.path.isdir(cfg.export_diffusers)
                                                     or os.listdir(cfg.export_diffusers)):
            raise ConfigError(f'--export-diffusers {cfg.export_diffusers}: exists and is not an empty folder')
        check_writable(os.path.dirname(os.path.abspath(cfg.export_diffusers)), '--export-diffusers')
        return cfg
    if cfg.grid and cfg.num > GRID_LIMIT:
        raise ConfigError(f'--grid draws at most {GRID_LIMIT} images into one PNG, got --num {cfg.num}')
    if cfg.grid and cfg.format != 'png':
        raise ConfigError(f'--grid writes one PNG: --format {cfg.format} has no meaning with it')
    if cfg.sampler == 'dpm++' and cfg.clip not in ('auto', 'none'):
        raise ConfigError(f'--clip {cfg.clip}: DPM-Solver++ solves the ODE of the model as it is; it does not clip x0')
    if cfg.fid and cfg.num < 2:
        raise ConfigError(f'--fid compares statistics of the samples (a mean and a covariance): --num {cfg.num} is too '
                          f'few; papers draw 50,000 (digits: 450, the size of the floor\'s set)')
    if not cfg.bpd or cfg.fid:  # images will be written
        check_writable(cfg.out, '--out')
    return cfg


def main(cfg: SampleConfig) -> dict:
    check_ranges(cfg)
    device = pick_device(cfg.device, 0)
    model, config, sched, prediction = load_model(cfg.ckpt, cfg.weights, device)
    cfg = validate(cfg, config, sched)
    if cfg.export_diffusers:
        return export_diffusers(model, sched, cfg, prediction)
    if (device.type == 'cuda') if cfg.compile is None else cfg.compile:
        model = torch.compile(model)
    result = {'ckpt': cfg.ckpt, 'weights': cfg.weights, 'sampler': cfg.sampler, 'device': str(device)}
    if cfg.bpd:
        result['bpd'] = bits_per_dim(model, config, sched, cfg, device, prediction)
        print(f"bits/dim on {cfg.bpd_data} ({result['bpd']['images']} images): {result['bpd']['bits_per_dim']:.4f} "
              f"+- {result['bpd']['stderr'] or 0:.4f} (standard error over images)")
        if not cfg.fid:
            return result  # --bpd alone evaluates; add --fid to sample as well
    # The reference statistics first: a missing data set fails before the sampling, not after.
    judge = DigitsJudge(config.image_size, cfg.data_dir) if cfg.fid and cfg.fid_data == 'digits' else None
    extractor = inception_extractor(cfg.inception_weights, device) if cfg.fid and not judge else None
    reference = (reference_statistics(cfg.fid_data, cfg.data_dir, config.image_size, extractor, cfg.batch_size,
                                      cfg.fid_stats) if extractor else None)
    if cfg.grid:  # into a folder of ours, as the separate images are
        release_lock = claim_folder(cfg.out, '--out', ('grid.png.tmp', MANIFEST + '.tmp'))
        try:
            settings = sample_settings(cfg)
            our_samples(cfg, settings)
            with atomic_open(os.path.join(cfg.out, MANIFEST)) as f:
                json.dump(settings, f, indent=1)
            start = time.perf_counter()
            images = torch.cat(list(draw(model, config, sched, cfg, device, prediction=prediction)))
            drawn = {'images': len(images), 'seconds': time.perf_counter() - start, 'complete': True, 'stopped': None,
                     'path': os.path.join(cfg.out, 'grid.png')}
            write_grid_png(images, drawn['path'])
        finally:
            release_lock()
        on_disk = images.split(cfg.batch_size)
    else:
        leftovers = ('[0-9]*.png.tmp', '*.npz.tmp', 'parts/batch_*.npy.tmp', MANIFEST + '.tmp')
        release_lock = claim_folder(cfg.out, '--out', leftovers)
        try:
            drawn = stream_samples(model, config, sched, cfg, device, prediction)
        finally:
            release_lock()
        on_disk = written_batches(cfg, config)
    result.update(drawn)
    steps = sched.num_steps if cfg.sampler == 'ddpm' else cfg.steps
    if drawn['images'] and drawn['seconds'] > 0:
        flops = count_flops(config)['forward'] * steps * drawn['images']
        result.update(img_per_s=drawn['images'] / drawn['seconds'], tflops=flops / drawn['seconds'] / 1e12)
        print(f"{drawn['images']} images ({cfg.sampler}, {steps} steps) in {drawn['seconds']:.1f}s: "
              f"{result['img_per_s']:.1f} img/s, {result['tflops']:.2f} TFLOP/s (first batch includes compilation)")
    if not drawn['complete']:
        print(f"stopped by {drawn['stopped']}: {cfg.out} holds what was drawn; the same command continues it")
        return result
    print(f"{cfg.num} images in {drawn['path']}" + ('' if drawn['images'] else ' (all drawn before: nothing to do)'))
    if judge:
        result['digits'] = {**judge.score(judge.features(torch.cat(list(on_disk)))), 'floor': judge.floor}
        print(digits_summary(result['digits']))
    elif cfg.fid:
        fake = statistics(features_of(tqdm(on_disk, desc='sample features', leave=False), extractor))
        result['fid'] = frechet_distance(fake, reference)
        print(f"FID against {cfg.fid_data} ({cfg.num} samples): {result['fid']:.3f}")
    return result


def digits_summary(score: dict) -> str:
    """The digits score in one paragraph, its floor beside it and the feature space named."""
    floor = score['floor']
    return (f"digits score of {score['digits_samples']} samples, in the features of a digit classifier (not "
            f"Inception: no FID), against the training split: FD {score['digits_fd']:.2f} (floor, the held-out "
            f"real digits: {floor['digits_fd']:.2f}), KID {score['digits_kid']:.1f} +- {score['digits_kid_std']:.1f} "
            f"(floor {floor['digits_kid']:.1f}); {score['digits_confident']:.1%} labelled with p >= {CONFIDENT} "
            f"(floor {floor['digits_confident']:.1%}); label entropy {score['digits_class_entropy']:.2f} bits "
            f"(balanced: 3.32); {score['digits_features']}")


def export_diffusers(model, sched: diffusion.Schedule, cfg: SampleConfig, prediction: str) -> dict:
    try:
        save_diffusers(model.cpu().float(), diffusion.schedule_kind(sched), sched.num_steps, cfg.export_diffusers,
                       prediction)
    except ValueError as error:
        raise ConfigError(f'--export-diffusers: diffusers cannot represent this network or schedule '
                          f'({error})') from None
    print(f'wrote {cfg.export_diffusers}: a diffusers DDPMPipeline of the {cfg.weights} weights of {cfg.ckpt} '
          f'({diffusion.schedule_kind(sched)} schedule, T={sched.num_steps})')
    return {'ckpt': cfg.ckpt, 'weights': cfg.weights, 'export': cfg.export_diffusers}


def cli(argv=None) -> int:
    return run_main(main, parse_config(argv, SampleConfig, __doc__))


if __name__ == '__main__':
    sys.exit(cli())

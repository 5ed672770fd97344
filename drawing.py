"""Drawing N images from a model in seeded batches: batch i's noise comes from (seed, i) alone, so
the same images come out for any split across ranks or a continued run; a non-finite batch is refused.
And grids of them as one PNG (train.py's per-epoch grid, sample.py --grid)."""
import math
import typing
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import diffusion
from devices import autocast
from files import atomic_open
from model import UNetConfig


@dataclass
class Sampling:
    """What draw() reads: how many images, in which batches, with which sampler (sample.py's
    SampleConfig holds the same fields as flags)."""
    num: int
    batch_size: int
    sampler: str = 'ddim'
    steps: int = 50
    seed: int = 0
    eta: float = 0.0
    spacing: str = 'logsnr'
    variance: str = 'fixedlarge'
    clip: str = 'auto'
    amp: str = 'auto'


def sampling_amp(amp: str, device: torch.device) -> str:
    """--amp auto samples in bf16 on CUDA and in fp32 on the CPU."""
    return ('bf16' if device.type == 'cuda' else 'off') if amp == 'auto' else amp


class NonFiniteSamples(Exception):
    """The model drew NaN or inf (a diverged model): one line, exit code 3; the batch is not written."""
    exit_code = 3


def draw(model, config: UNetConfig, sched: diffusion.Schedule, cfg: Sampling, device, progress=True,
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


def draw_batch(model, sched: diffusion.Schedule, cfg: Sampling, device, start: int, config: UNetConfig,
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


# ----------------------------------------------------------------------------- grids

GRID_LIMIT = 4096  # images in one grid PNG (it is held in memory)


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

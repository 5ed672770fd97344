"""Drawing N images from a model in seeded batches: batch i's noise comes from (seed, i) alone (and
for a class-conditional model image i's class from i alone), so the same images come out for any
split across ranks or a continued run; a non-finite batch is refused. And grids of them as one PNG
(train.py's per-epoch grid, sample.py --grid), a row per class for a class-conditional model."""
import math
import typing
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import diffusion
import peers
import students
from devices import autocast
from files import atomic_open
from model import UNetConfig


STUDENT_SAMPLERS = ('student', 'consistency')  # distill.py's students, each drawn only by its own


@dataclass
class Sampling:
    """What draw() reads: how many images, in which batches, with which sampler (sample.py's
    SampleConfig holds the same fields as flags)."""
    num: int
    batch_size: int
    sampler: str = 'dpm++'
    steps: int = 50
    seed: int = 0
    eta: float = 0.0
    spacing: str | None = None  # None: the sampler's default grid (diffusion.DEFAULT_SPACING)
    variance: str = 'fixedlarge'
    clip: str = 'auto'
    amp: str = 'auto'
    label: int = -1  # a class-conditional model's class for every image; -1: each class in turn
    guidance: float = 1.0  # classifier-free guidance scale (diffusion.guided; 1: the conditional model alone)
    mid_timestep: int | None = None  # a 2-call consistency student's second timestep (students.consistency_sample)


def class_labels(first: int, count: int, num_classes: int, label: int = -1) -> torch.Tensor:
    """The classes asked of images first, ..., first + count - 1 of a draw: `label` for all of them,
    or with label=-1 each class in turn (image i: class i mod num_classes)."""
    if label >= 0:
        return torch.full((count,), label, dtype=torch.long)
    return torch.arange(first, first + count) % num_classes


def conditioned(model, config: UNetConfig, first: int, count: int, label: int, guidance: float, device):
    """The model as the samplers call it, model(x_t, t): as it is, or for a class-conditional one
    guided towards the classes class_labels asks of these images."""
    if not config.num_classes:
        return model
    labels = class_labels(first, count, config.num_classes, label).to(device)
    return diffusion.guided(model, labels, guidance, config.num_classes)


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
    # A guided student learnt its scale (cfg.guidance names it): one pass of the conditional network.
    guidance = 1.0 if cfg.sampler in STUDENT_SAMPLERS else cfg.guidance
    model = conditioned(model, config, start, shape[0], cfg.label, guidance, device)
    with autocast(sampling_amp(cfg.amp, device), device):
        if cfg.sampler in peers.PEER_SOLVERS:  # diffusers' own solvers, as peers (few_step_study.py)
            x = peers.peer_sample(cfg.sampler, model, sched, shape, cfg.steps, generator, device, prediction=prediction)
        elif cfg.sampler == 'student':  # a distilled student: its own steps on its own grid
            x = students.student_sample(model, sched, shape, cfg.steps, generator, device, prediction=prediction)
        elif cfg.sampler == 'consistency':  # a consistency student: 1 call, or 2 re-noised to its mid timestep
            timesteps = students.consistency_timesteps(cfg.steps, cfg.mid_timestep, sched.num_steps)
            x = students.consistency_sample(model, sched, shape, timesteps, generator, device, prediction=prediction)
        else:
            clip = None if cfg.clip == 'auto' else cfg.clip
            x = diffusion.run_sampler(cfg.sampler, model, sched, shape, cfg.steps, generator, device, cfg.eta,
                                      cfg.spacing, cfg.variance, prediction, clip=clip)
    if not x.isfinite().all():
        raise NonFiniteSamples(f'the model drew NaN or inf in batch {start // cfg.batch_size} (images {start} '
                               f'to {start + shape[0] - 1}): it has diverged; nothing of that batch is written')
    return to_uint8(x)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats to uint8 (B, C, H, W), rounding to the nearest of 256 levels."""
    return ((x.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


# ----------------------------------------------------------------------------- grids

GRID_LIMIT = 4096  # images in one grid PNG (it is held in memory)


def write_grid_png(images: torch.Tensor, path: str, num_classes: int = 0):
    """uint8 (B, C, H, W) images as one square-ish grid PNG: RGB, or grey ('L') for one channel.
    num_classes: images drawn with each class in turn (class_labels), laid out a row per class
    (when each class has as many)."""
    from PIL import Image
    from torchvision.utils import make_grid
    per_row = max(1, int(math.sqrt(len(images))))
    if num_classes and len(images) % num_classes == 0:  # image i is class i mod K: row c holds c, c + K, ...
        per_row = len(images) // num_classes
        images = images.reshape(per_row, num_classes, *images.shape[1:]).transpose(0, 1).flatten(0, 1)
    grid = make_grid(images, nrow=per_row)  # (3, H', W'): one channel repeated
    pixels = grid[:images.shape[1]].permute(1, 2, 0).numpy()
    with atomic_open(path, 'wb') as f:
        Image.fromarray(pixels[:, :, 0] if images.shape[1] == 1 else pixels).save(f, format='png')


@torch.no_grad()
def write_grid(model, sched: diffusion.Schedule, cfg, device, path: str):
    """train.py's sample grid: cfg.num_samples images of cfg.sampler from the same noise every
    time (seed cfg.seed), in cfg.amp, as one PNG; a class-conditional model's with each class in
    turn at cfg.guidance, a row per class (the count rounded down to a multiple of the classes)."""
    config = model.config
    count = cfg.num_samples
    if config.num_classes:
        count = max(1, count // config.num_classes) * config.num_classes
    shape = (count, config.in_channels, cfg.image_size, cfg.image_size)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    model = conditioned(model, config, 0, count, -1, cfg.guidance, device)
    with autocast(cfg.amp, device):
        images = diffusion.run_sampler(cfg.sampler, model, sched, shape, cfg.sample_steps, generator, device,
                                       prediction=cfg.prediction)
    write_grid_png(to_uint8(images), path, config.num_classes)

"""The speedup table: one row per optimisation, each adding its change to the row above.

One mode per run; each writes STEM.json, STEM.md and STEM.png under --out-dir (write_report):

    command                              mode        what it measures
    python benchmark.py                  ladder      every row: ms/iter, img/s, TFLOP/s, MFU; the diffusers
                                                     peers beside our fastest row (its UNet in our loop, its
                                                     training recipe); then sampling speed
    python benchmark.py --profile        profile     torch.profiler of the fastest row: a trace, top kernels
    python benchmark.py --sweep batch    sweep       one setting (batch|workers|amp|compile) around that row
    python benchmark.py --loader-only    loaders     images/s each data path delivers vs the step's consumption
    python benchmark.py --quality        quality     held-out loss after N steps: baseline vs all speed-ups
    python benchmark.py --sampling-only  sampling    DDIM-50, DPM-Solver++, DDPM-1000: img/s, MFU, time for 50k
    python benchmark.py --solver-accuracy  accuracy  samplers' errors against exact answers, by model calls

    python benchmark.py --preset small                       # the ~9M UNet of the reference table
    python benchmark.py --device cpu --preset tiny --quick   # the CPU smoke run the tests use

An iteration is what train.py runs per step: data, forward, backward, gradient clipping,
Adam step and EMA update. Times are the median over many iterations after warm-up, from a
chain of CUDA events (so that host stalls, such as waiting for data, are counted).
Compilation is timed separately and kept out of the throughput.
"""
import dataclasses
import datetime
import fcntl
import functools
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import asdict, dataclass

import torch

import data
import sample
import train
from cli import (ConfigError, atomic_open, autocast, brief, check_ranges, check_writable, flag, parse_config,
                 pick_device, pyplot, run_main, save_figure, synchronize)
from model import (A100_PEAK_TFLOPS, PRESETS, UNet, count_flops, count_params, count_torchinfo_flops, diffusers_config,
                   get_config, gpu_peak_key, peak_tflops, precision_of)


@dataclass
class BenchConfig:
    preset: str = flag('ddpm-cifar10', 'UNet preset (small is the ~9M UNet of the reference table)',
                       choices=tuple(PRESETS))
    image_size: int = flag(32, 'image resolution')
    dataset: str = flag('auto', 'auto (cifar10 if on disk, else shapes), cifar10 or shapes',
                         choices=('auto', 'cifar10', 'shapes'))
    data_dir: str = flag('./data', 'where CIFAR-10 is looked for; the FFCV rows and the recipe peer write their copies '
                                   'of the images there once (a .beton file, a folder of PNG files)')
    num_images: int = flag(50000, 'images in the shapes set (CIFAR-10 has 50000)', at_least=1)
    device: str = flag('auto', 'auto, cpu, cuda or cuda:N')
    batch_size: int = flag(128, 'batch size of the baseline row (the paper\'s)', at_least=1)
    big_batch: int = flag(512, 'batch size from the "scale up batch size" row on', at_least=1)
    amp_dtype: str = flag('bf16', 'precision of the mixed-precision rows', choices=('bf16', 'fp16'))
    num_workers: int = flag(4, 'DataLoader workers of the torch-loader rows', at_least=0)
    warmup: int = flag(10, 'untimed iterations after the first (compiling) one', at_least=0)
    iters: int = flag(50, 'timed iterations per row; the median is reported', at_least=1)
    rows: str = flag('', 'comma-separated substrings: run only the rows whose names contain one')
    from_row: str = flag('', 'the ladder row that --profile, --quality, --loader-only, --sweep and --sampling-only '
                             'start from (a substring of its name; default: the fastest row in the default compile '
                             'mode, which is what train.py runs)')
    tf32: bool = flag(False, 'let the fp32 rows use TF32 tensor cores (then their MFU is against the TF32 peak); '
                             'off by default, so that fp32 is fp32 and compares with the reference table\'s 19.5')
    stem: str = flag('', 'output file name stem, a plain name (default: <gpu>-<preset>, plus the mode)')
    peer: bool = flag(True, "time the peers beside our fastest row, where diffusers is installed: its UNet2DModel "
                            "(the same function, our settings) and its training recipe (train_unconditional.py's loop)")
    peak_tflops: float | None = flag(None, 'dense peak TFLOP/s of the mixed-precision rows (overrides the table)',
                                     positive=True)
    peak_tflops_fp32: float | None = flag(None, 'dense peak TFLOP/s of the fp32/TF32 rows (overrides the table)',
                                          positive=True)
    quick: bool = flag(False, 'a smoke run: few iterations, small batches; sampling takes DDIM-10 and DDPM over '
                              'T=100')
    compile_backend: str = flag('auto', 'torch.compile backend of the compiled rows (auto: inductor, but eager under '
                                        '--quick on a CPU: dynamo traces, the graph runs eagerly, no minutes of C++ '
                                        'builds)', choices=('auto', 'inductor', 'aot_eager', 'eager'))
    profile: bool = flag(False, 'profile the best row: Chrome/Perfetto trace, top ops table and chart')
    sweep: str = flag('', 'sweep one setting around the start row (see --from-row), with a plot',
                       choices=('', 'batch', 'workers', 'amp', 'compile'))
    sweep_values: str = flag('', 'comma-separated batch sizes or worker counts for --sweep batch|workers '
                                 '(default: 64 to 4096, or 0 2 4 8 workers)')
    loader_only: bool = flag(False, 'images/s that each data path delivers, beside the step\'s consumption')
    sampling: bool = flag(True, 'after the ladder, time the samplers: DDIM-50, DPM-Solver++ at 10, 20, 50 calls and '
                                'DDPM-1000 (their own table)')
    sampling_only: bool = flag(False, 'time only the samplers, no training rows')
    sample_batch: int = flag(1000, 'images per sampling batch', at_least=1)
    sample_compile_mode: str = flag('reduce-overhead', 'torch.compile mode for sampling on CUDA (CUDA graphs)',
                                    choices=train.COMPILE_MODES)
    solver_accuracy: bool = flag(False, 'DDIM, DDPM and DPM-Solver++ at 5 to 1000 model calls against exact answers '
                                        '(a Gaussian mixture with its closed-form denoiser; and --ckpt)')
    ckpt: str = flag('', 'a trained checkpoint for --solver-accuracy: distance of N-call samples to the 1000-call '
                         'ODE solution from the same noise')
    quality: bool = flag(False, 'the equivalence check: train --steps under the baseline and under all the '
                                'speed-ups (same seed, data, batch) and compare held-out losses')
    steps: int = flag(2000, 'training steps of each --quality run', at_least=1)
    out_dir: str = flag('', 'where the JSON, Markdown and PNG go (default: results/ on a GPU, runs/benchmark/ on '
                            'a CPU, so that smoke runs stay out of the committed results)')
    seed: int = flag(0, 'seed', at_least=0, at_most=2 ** 32 - 1)


@dataclass
class Row:
    """One rung of the ladder: the train.py settings it runs with."""
    name: str
    batch_size: int
    attention: str = 'manual'
    compile: bool = False
    compile_mode: str = 'default'
    compile_scope: str = 'loss'  # 'model': torch.compile of the network alone, as before the whole-loss graph
    amp: str = 'off'
    channels_last: bool = False
    fused_adam: bool = False
    loader: str = 'torch'
    num_workers: typing.Optional[int] = None  # None: --num-workers


def ladder(bench: BenchConfig, device: torch.device) -> list:
    """The reference table's rows, then ours; each row changes one thing."""
    amp = bench.amp_dtype
    rows = [Row('Baseline (fp32, eager, manual attention, DataLoader)', bench.batch_size)]

    def add(name, **change):
        rows.append(dataclasses.replace(rows[-1], name=name, **change))
    add(f'Scale up batch size ({bench.big_batch})', batch_size=bench.big_batch)
    add('torch.compile (the network)', compile=True, compile_scope='model')
    add('torch.compile (the whole loss, one graph)', compile_scope='loss')
    add('PyTorch SDPA', attention='sdpa')
    add(f'Mixed precision ({amp})', amp=amp)
    add('Channels-last', channels_last=True)
    add('Fused Adam', fused_adam=True)
    add('FFCV data loading', loader='ffcv')
    add('GPU-resident data' if device.type == 'cuda' else 'Device-resident data (gpu loader, in RAM)', loader='gpu')
    add('compile reduce-overhead (CUDA graphs)', compile_mode='reduce-overhead')
    add('compile max-autotune (no CUDA graphs)', compile_mode='max-autotune-no-cudagraphs')
    add('compile max-autotune + CUDA graphs', compile_mode='max-autotune')
    return rows


def skip_reason(row: Row, device: torch.device) -> str | None:
    if row.loader == 'ffcv':
        return data.ffcv_missing_reason()
    if row.amp == 'fp16' and device.type != 'cuda':
        return 'fp16 training needs CUDA'
    if row.compile_mode != 'default' and device.type != 'cuda':
        return 'compile modes other than default target CUDA (autotuning, CUDA graphs)'
    return None


# ----------------------------------------------------------------------------- timing

def row_train_config(row: Row, bench: BenchConfig, device: torch.device, dataset_name: str) -> train.TrainConfig:
    cfg = train.TrainConfig(preset=bench.preset, dataset=dataset_name, data_dir=bench.data_dir,
                            image_size=bench.image_size, batch_size=row.batch_size, attention=row.attention,
                            compile=row.compile, compile_mode=row.compile_mode, amp=row.amp,
                            channels_last=row.channels_last, fused_adam=row.fused_adam, loader=row.loader,
                            num_workers=bench.num_workers if row.num_workers is None else row.num_workers,
                            seed=bench.seed, device=str(device))
    return train.resolve_defaults(cfg, device)


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == 'cuda'
        self.marks = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def time_iterations(iterate: typing.Callable, device: torch.device, bench: BenchConfig) -> dict:
    """Compile time (the first iteration), then the median ms of `iters` iterations after warm-up.
    iterate(step) runs one training iteration, data included, and leaves its loss on the device."""
    start = time.perf_counter()
    iterate(0)
    synchronize(device)
    compile_s = time.perf_counter() - start
    for step in range(1, bench.warmup + 1):
        iterate(step)
    synchronize(device)
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock(device)
    clock.mark()
    for step in range(bench.warmup + 1, bench.warmup + 1 + bench.iters):
        iterate(step)  # no sync: the next iteration's host work overlaps this one's kernels
        clock.mark()
    intervals = clock.intervals_ms()
    return {'ms_per_iter': statistics.median(intervals), 'ms_min': min(intervals), 'ms_max': max(intervals),
            'compile_s': compile_s,
            'peak_mem_gb': torch.cuda.max_memory_allocated(device) / 1e9 if device.type == 'cuda' else None}


def time_training(run: train.Run, bench: BenchConfig) -> dict:
    """train.py's step (train.train_step) on train.py's batches."""
    stream = train.batches(run, 0)
    return time_iterations(lambda step: train.train_step(run, next(stream), step), run.device, bench)


def release(device: torch.device):
    torch._dynamo.reset()
    if device.type == 'cuda':
        torch.cuda.empty_cache()


def compile_backend(bench: BenchConfig, device: torch.device) -> str:
    if bench.compile_backend == 'auto':
        return 'eager' if bench.quick and device.type == 'cpu' else 'inductor'
    return bench.compile_backend


def build_row_run(row_cfg: train.TrainConfig, bench: BenchConfig, device, dataset, make_model=None,
                  compile_scope: str = 'loss') -> train.Run:
    """train.py's run of a row; compile_scope 'model' compiles the network alone (the loss
    around it runs eagerly), 'loss' the whole loss as train.py does."""
    run = train.build_run(row_cfg, device, dataset=dataset, progress=False, make_model=make_model)
    if row_cfg.compile:  # torch.compile is lazy: replacing the loss before its first call costs nothing
        backend = compile_backend(bench, device)
        options = {} if backend == 'inductor' else {'backend': backend}
        if compile_scope == 'model':
            mode = None if row_cfg.compile_mode == 'default' or options else row_cfg.compile_mode
            net = torch.compile(run.model, mode=mode, **options)
            run.loss = train.make_loss(dataclasses.replace(row_cfg, compile=False), net, run.sched, device)
        elif options:
            run.loss = train.make_loss(row_cfg, run.model, run.sched, device, mode=None, **options)
    return run


def peak_for(precision: str, device: torch.device, bench: BenchConfig):
    """The dense peak the MFU is computed against: the override, the table, or None (n/a)."""
    override = bench.peak_tflops_fp32 if precision in ('fp32', 'tf32') else bench.peak_tflops
    if override:
        return override
    if device.type != 'cuda':
        return None
    return peak_tflops(torch.cuda.get_device_name(device), precision)


def describe(result: dict, row_cfg: train.TrainConfig, bench: BenchConfig, device, flops: dict) -> dict:
    """Adds throughput, TFLOP/s and MFU (device peak and A100 peak) to a timing."""
    precision = precision_of(row_cfg.amp, device)
    img_per_s = row_cfg.batch_size / (result['ms_per_iter'] / 1e3)
    tflops = img_per_s * flops['train'] / 1e12
    peak = peak_for(precision, device, bench)
    a100_peak = A100_PEAK_TFLOPS[precision]  # fp32 19.5, TF32 156, bf16/fp16 312
    return {**result, 'precision': precision, 'img_per_s': img_per_s, 'tflops': tflops,
            'tflops_torchinfo': img_per_s * flops['torchinfo_train'] / 1e12,
            'mfu': tflops / peak if peak else None, 'peak_tflops': peak, 'mfu_a100': tflops / a100_peak}


def measure_row(row: Row, bench, device, dataset, dataset_name, flops, make_model=None) -> dict:
    """One row's timing; a row that cannot run here is 'skipped', one that raises is 'failed'
    (with the reason): the run goes on either way."""
    entry = {'name': row.name, 'batch_size': row.batch_size, 'settings': asdict(row)}
    reason = skip_reason(row, device)
    if reason:
        return {**entry, 'skipped': reason}

    def measure():
        row_cfg = row_train_config(row, bench, device, dataset_name)
        row_data = dataset
        if row.loader == 'ffcv':
            row_data = beton_for(bench, dataset_name, dataset)
            row_cfg = dataclasses.replace(row_cfg, dataset='beton', data_dir=row_data.path)
        run = build_row_run(row_cfg, bench, device, row_data, make_model, row.compile_scope)
        result = describe(time_training(run, bench), row_cfg, bench, device, flops)
        if row_cfg.compile and compile_backend(bench, device) != 'inductor':
            result['note'] = f'torch.compile with backend={compile_backend(bench, device)}'
        return result
    return measured_or_failed(entry, device, measure)


def measured_or_failed(entry: dict, device: torch.device, measure: typing.Callable) -> dict:
    """{**entry, **measure()}; one that raises (a compile mode, a peer, out of memory) is 'failed'
    with the reason: it costs its row, not the table. The device's memory is released either way."""
    try:
        return {**entry, **measure()}
    except torch.cuda.OutOfMemoryError as error:
        return {**entry, 'failed': f'out of memory ({brief(error, 200)})'}
    except Exception as error:
        return {**entry, 'failed': brief(error, 300)}
    finally:
        release(device)


def row_line(index: int, total: int, r: dict) -> str:
    """The one line a row prints when it is done."""
    head = f'[{index}/{total}] {r["name"]}: '
    if 'failed' in r or 'skipped' in r:
        return head + ('FAILED: ' + r['failed'] if 'failed' in r else 'skipped: ' + r['skipped'])
    return head + (f"{r['ms_per_iter']:.2f} ms/iter, {r['img_per_s']:,.0f} img/s, {r['tflops']:.2f} TFLOP/s, "
                   f"MFU {fmt(r['mfu'], '.1%')} ({r['precision']}), {fmt(r.get('speedup'), '.2f')}x; "
                   f"first iteration {r['compile_s']:.1f} s")


def add_speedups(rows: list):
    baseline = next((r for r in rows if 'ms_per_iter' in r), None)
    for r in rows:
        if baseline and 'img_per_s' in r:
            r['speedup'] = r['img_per_s'] / baseline['img_per_s']


# ----------------------------------------------------------------------------- the peer

class DiffusersUNet(torch.nn.Module):
    """diffusers' UNet2DModel in the configuration that computes the same function as our
    UNet (model.diffusers_config: google/ddpm-cifar10-32's for ddpm-cifar10), as model(x, t)."""

    def __init__(self, config):
        super().__init__()
        from diffusers import UNet2DModel
        self.config = config
        self.unet = UNet2DModel(**diffusers_config(config))

    def forward(self, x, t):
        return self.unet(x, t).sample


def diffusers_missing_reason() -> str | None:
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return 'diffusers is not installed (pip install diffusers)'
    return None


def measure_peer(best: Row, best_result: dict, bench, device, dataset, dataset_name, flops) -> dict:
    """diffusers under the settings of our fastest row (compile, precision, channels-last, fused
    Adam, data path, batch); its attention is its own default, SDPA."""
    reason = diffusers_missing_reason()
    if reason:
        return {'name': 'diffusers UNet2DModel', 'kind': 'model', 'skipped': reason}
    row = dataclasses.replace(best, name='diffusers UNet2DModel (settings of our fastest row)', attention='sdpa')
    result = {'kind': 'model',
              **measure_row(row, bench, device, dataset, dataset_name, flops, make_model=DiffusersUNet)}
    return beside_ours(result, best, best_result, bench, device, dataset, dataset_name, flops)


def beside_ours(result: dict, best: Row, best_result: dict, bench, device, dataset, dataset_name, flops) -> dict:
    """A peer's timing with our fastest row timed again right after it, so that the ratio compares
    two neighbouring timings, not a drift of the GPU's clocks since the start of the ladder."""
    from diffusers import __version__ as version
    result['diffusers'] = version
    if 'img_per_s' not in result:
        return result
    again = measure_row(best, bench, device, dataset, dataset_name, flops)
    result.update(ours=best.name, ours_first={k: best_result[k] for k in ('ms_per_iter', 'img_per_s')},
                  ratio_first_timing=best_result['img_per_s'] / result['img_per_s'])
    if 'img_per_s' in again:
        result.update(ours_again={k: again[k] for k in ('ms_per_iter', 'img_per_s')},
                      ratio=again['img_per_s'] / result['img_per_s'])
    return result


# ----------------------------------------------------------------------------- the system peer

# diffusers' unconditional training example (examples/unconditional_image_generation/
# train_unconditional.py) as its README runs it (--center_crop --random_flip --use_ema) with its
# default hyperparameters; the worker count and the precision are ours (--num-workers, the fastest
# row's), since its defaults (0 workers, fp32) would only flatter us.
RECIPE = {'lr': 1e-4, 'betas': (0.95, 0.999), 'weight_decay': 1e-6, 'eps': 1e-8, 'lr_schedule': 'cosine',
          'lr_warmup_steps': 500, 'epochs': 100, 'grad_clip': 1.0, 'ema_max_decay': 0.9999, 'ema_inv_gamma': 1.0,
          'ema_power': 3 / 4, 'center_crop': True, 'random_flip': True}


def recipe_parts(config, device: torch.device, steps_per_epoch: int, amp: str) -> dict:
    """The example's objects around our network's function (model.diffusers_config): UNet2DModel,
    DDPMScheduler, AdamW, the cosine schedule with warm-up, EMAModel with its warm-up, and the
    grad scaler that accelerate's fp16 uses (a no-op otherwise)."""
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel
    unet = UNet2DModel(**diffusers_config(config)).to(device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=RECIPE['lr'], betas=RECIPE['betas'],
                                  weight_decay=RECIPE['weight_decay'], eps=RECIPE['eps'])
    ema = EMAModel(unet.parameters(), decay=RECIPE['ema_max_decay'], use_ema_warmup=True,
                   inv_gamma=RECIPE['ema_inv_gamma'], power=RECIPE['ema_power'], model_cls=UNet2DModel,
                   model_config=unet.config)
    ema.to(device)
    return {'unet': unet, 'noise_scheduler': DDPMScheduler(num_train_timesteps=train.NUM_TIMESTEPS),
            'optimizer': optimizer, 'ema': ema, 'device': device, 'amp': amp,
            'scaler': torch.amp.GradScaler(device.type, enabled=amp == 'fp16'),
            'lr_scheduler': get_scheduler(RECIPE['lr_schedule'], optimizer=optimizer,
                                          num_warmup_steps=RECIPE['lr_warmup_steps'],
                                          num_training_steps=steps_per_epoch * RECIPE['epochs'])}


def recipe_step(parts: dict, clean_images: torch.Tensor) -> torch.Tensor:
    """One iteration of the example's loop: the batch to the device in the weight dtype, noise,
    timesteps, add_noise, the UNet under autocast (accelerate's mixed precision), MSE in fp32,
    backward, clipping, AdamW, the lr schedule, zero_grad, the EMA, and the step's log values
    (loss.item(): the host waits for the step, as the example's progress bar does). Its tqdm and
    tracker calls are left out; under fp16 accelerate also skips the lr step when the scaler skips
    the optimizer's (the first few steps only)."""
    unet, noise_scheduler, device, scaler = parts['unet'], parts['noise_scheduler'], parts['device'], parts['scaler']
    weight_dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(parts['amp'], torch.float32)
    clean_images = clean_images.to(device, weight_dtype)
    noise = torch.randn(clean_images.shape, dtype=weight_dtype, device=device)
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean_images.shape[0],), device=device)
    noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
    with autocast(parts['amp'], device):
        model_output = unet(noisy_images, timesteps).sample
    loss = torch.nn.functional.mse_loss(model_output.float(), noise.float())
    scaler.scale(loss).backward()
    scaler.unscale_(parts['optimizer'])
    torch.nn.utils.clip_grad_norm_(unet.parameters(), RECIPE['grad_clip'])
    scaler.step(parts['optimizer'])
    scaler.update()
    parts['lr_scheduler'].step()
    parts['optimizer'].zero_grad()
    parts['ema'].step(unet.parameters())
    parts['logs'] = {'loss': loss.detach().item(), 'lr': parts['lr_scheduler'].get_last_lr()[0],
                     'ema_decay': parts['ema'].cur_decay_value}
    return loss.detach()


def recipe_loader(folder: str, image_size: int, batch_size: int, num_workers: int):
    """The example's data path: image files decoded by PIL in DataLoader workers, its transforms
    (resize, centre crop, random flip, to [-1, 1]), shuffled; no pinned memory."""
    from torchvision import datasets, transforms
    augmentations = transforms.Compose([
        transforms.Resize(image_size, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(image_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5])])
    images = datasets.ImageFolder(folder, transform=augmentations)
    return torch.utils.data.DataLoader(images, batch_size=batch_size, shuffle=True, num_workers=num_workers)


def recipe_batches(loader):
    while True:  # the example's epoch loop: each epoch starts the loader's workers anew
        for images, _ in loader:
            yield images


def image_folder_for(bench: BenchConfig, dataset_name: str, dataset) -> str:
    """The benchmark's images as PNG files (FOLDER/images/NNNNNN.png, the layout ImageFolder
    reads) next to the data, written once: what the example trains from. One writer at a time
    (a lock file beside it; the others wait, then find it written); it fills a temporary folder
    and renames it into place, so that a killed writer never leaves a folder with some of the
    images, and a folder with another image count is written anew."""
    from torchvision.io import write_png
    folder = os.path.join(bench.data_dir, f'bench-{dataset_name}-{len(dataset)}x{bench.image_size}-png')
    os.makedirs(bench.data_dir, exist_ok=True)
    with open(folder + '.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if _png_count(folder) == len(dataset):
            return folder
        print(f'writing {folder} for the diffusers recipe row ...', flush=True)
        for leftover in glob.glob(folder + '.partial-*') + glob.glob(folder + '.stale-*'):  # killed writers'
            shutil.rmtree(leftover, ignore_errors=True)
        partial = tempfile.mkdtemp(dir=bench.data_dir, prefix=os.path.basename(folder) + '.partial-')
        try:
            os.chmod(partial, 0o755)  # mkdtemp's 0700 would lock out other users of the data folder
            os.makedirs(os.path.join(partial, 'images'))
            for index in range(len(dataset)):
                write_png(dataset[index], os.path.join(partial, 'images', f'{index:06d}.png'))
            if os.path.exists(folder):  # another count: moved aside in one step, then removed
                stale = tempfile.mkdtemp(dir=bench.data_dir, prefix=os.path.basename(folder) + '.stale-')
                os.replace(folder, os.path.join(stale, 'old'))
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return folder


def _png_count(folder: str) -> int:
    images = os.path.join(folder, 'images')
    return sum(name.endswith('.png') for name in os.listdir(images)) if os.path.isdir(images) else -1


def measure_recipe(best: Row, best_result: dict, bench, device, dataset, dataset_name, flops) -> dict:
    """The system peer: what a diffusers user runs to train this network (RECIPE, recipe_step,
    recipe_loader) on the same images as files, at our fastest row's batch size and precision,
    eager as the example is; then our fastest row again."""
    name = f'diffusers training recipe (train_unconditional.py loop, {bench.num_workers} workers)'
    entry = {'name': name, 'kind': 'recipe', 'batch_size': best.batch_size, 'settings': {**RECIPE, 'amp': best.amp}}
    reason = diffusers_missing_reason()
    if reason:
        return {**entry, 'skipped': reason}
    row_cfg = row_train_config(Row(name, best.batch_size, amp=best.amp), bench, device, dataset_name)

    def measure():
        loader = recipe_loader(image_folder_for(bench, dataset_name, dataset), bench.image_size, best.batch_size,
                               bench.num_workers)
        torch.manual_seed(bench.seed)
        parts = recipe_parts(get_config(bench.preset, image_size=bench.image_size), device, len(loader),
                             row_cfg.amp)
        stream = recipe_batches(loader)
        return describe(time_iterations(lambda step: recipe_step(parts, next(stream)), device, bench),
                        row_cfg, bench, device, flops)
    result = measured_or_failed(entry, device, measure)
    return beside_ours(result, best, best_result, bench, device, dataset, dataset_name, flops)


# ----------------------------------------------------------------------------- outputs

def device_slug(device: torch.device) -> str:
    if device.type != 'cuda':
        return 'cpu'
    name = torch.cuda.get_device_name(device)
    return re.sub(r'[^a-z0-9]+', '-', (gpu_peak_key(name) or name).lower()).strip('-')


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == 'cuda' else f'CPU ({os.cpu_count()} cores)'


def git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=here, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=here,
                               capture_output=True, text=True).stdout.strip()
        return commit + ('-dirty' if dirty else '')
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'


def header(bench: BenchConfig, device: torch.device, flops: dict, dataset_name: str) -> dict:
    return {'device': device_name(device), 'torch': torch.__version__,
            'cuda': torch.version.cuda if device.type == 'cuda' else None,
            'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
            'commit': git_commit(), 'command': 'python ' + ' '.join(sys.argv),
            'preset': bench.preset, 'image_size': bench.image_size, 'dataset': dataset_name,
            'tf32_convs': torch.backends.cudnn.allow_tf32, 'tf32_matmul': torch.backends.cuda.matmul.allow_tf32,
            'flops_per_image': flops, 'config': asdict(bench)}


def fmt(value, spec: str, missing: str = 'n/a') -> str:
    return missing if value is None else format(value, spec)


def markdown_table(rows: list, peers: list) -> str:
    lines = ['| Version | Batch | Precision | ms/iter | img/s | TFLOP/s | MFU | MFU (A100 peak) | Speedup '
             '| Peak mem (GB) |',
             '| :- | -: | :- | -: | -: | -: | -: | -: | -: | -: |']
    for r in rows + peers:
        if 'skipped' in r or 'failed' in r:
            why = f"skipped: {r['skipped']}" if 'skipped' in r else f"FAILED: {r['failed']}"
            lines.append(f"| {r['name']} | {r.get('batch_size', '')} | {why} | | | | | | | |")
            continue
        precision = {'tf32': 'fp32 (TF32 allowed)'}.get(r['precision'], r['precision'])
        lines.append(f"| {r['name']} | {r['batch_size']} | {precision} | {r['ms_per_iter']:.2f} | "
                     f"{r['img_per_s']:,.0f} | {r['tflops']:.2f} | {fmt(r['mfu'], '.1%')} | "
                     f"{r['mfu_a100']:.1%} | {fmt(r.get('speedup'), '.2f')}{'x' if r.get('speedup') else ''} | "
                     f"{fmt(r['peak_mem_gb'], '.2f')} |")
    return '\n'.join(lines)


def summary_lines(meta: dict, rows: list, peers: list) -> str:
    flops = meta['flops_per_image']
    lines = [f"{meta['preset']} at {meta['image_size']}x{meta['image_size']}. FLOPs per image, forward+backward: "
             f"{flops['train'] / 1e9:.2f} GFLOP ({flops['method']}); torchinfo MACs x 2 x 3: "
             f"{flops['torchinfo_train'] / 1e9:.2f} GFLOP (the reference table's method, no attention). TFLOP/s and "
             f"MFU below use the first."]
    what = {'model': 'UNet2DModel (the same function) under the same settings',
            'recipe': 'training recipe (its loop and data path from PNG files, eager; the same network, images, '
                      'batch size and precision)'}
    for peer in peers:
        if peer.get('ratio'):
            again = peer['ours_again']
            lines.append(f"Our fastest row ({peer['ours']}), timed again right after the {peer['kind']} peer: "
                         f"{again['img_per_s']:,.0f} img/s, {peer['ratio']:.2f}x the {peer['img_per_s']:,.0f} img/s "
                         f"of diffusers {peer.get('diffusers', '')} {what[peer['kind']]} (first timing of our row: "
                         f"{peer['ratio_first_timing']:.2f}x).")
    return '\n'.join(lines)


def bar_chart(rows: list, peers: list, title: str, path: str):
    plt = pyplot()
    measured = [r for r in rows + peers if 'img_per_s' in r]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(measured) + 1.5))
    names = [r['name'] for r in measured][::-1]
    values = [r['img_per_s'] for r in measured][::-1]
    colours = ['tab:gray' if 'kind' in r else 'tab:blue' for r in measured][::-1]
    bars = ax.barh(names, values, color=colours)
    for bar, r in zip(bars, measured[::-1]):
        label = f" {r['img_per_s']:,.0f} img/s" + (f"  ({r['speedup']:.2f}x)" if r.get('speedup') else '')
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va='center', fontsize=8)
    ax.set_xlabel('training images per second (higher is better)')
    ax.set_xlim(0, max(values) * 1.35 if values else 1)
    ax.set_title(title, fontsize=9)
    save_figure(fig, path, dpi=120)


def write_report(bench: BenchConfig, stem: str, result: dict, title: str, body: str, notes: str = '') -> str:
    """Every mode's report: OUT_DIR/STEM.json (the result) and STEM.md (the title; what ran it:
    device, torch, date, commit; `notes`; the command; the `body`), each written by a rename, so
    a run killed mid-write leaves the previous version whole. Returns the path of the .png that
    goes beside them (each mode draws its own)."""
    path = os.path.join(bench.out_dir, stem)
    markdown = (f"# {title}\n\n{result['device']}, torch {result['torch']}, {result['date']}, commit "
                f"{result['commit']}{notes}\n\nCommand: `{result['command']}`\n\n{body}\n")
    for ext, text in (('.json', json.dumps(result, indent=1)), ('.md', markdown)):
        with atomic_open(path + ext) as f:
            f.write(text)
    return path + '.png'


def write_outputs(stem: str, meta: dict, rows: list, peers: dict, bench: BenchConfig, final: bool = True) -> dict:
    """The ladder's report, rewritten after every row (final=False: quietly, with 'complete':
    false in the JSON), so that a run killed at a time limit keeps its rows; the chart and the
    printed table at the end. peers: {'peer': the model peer, 'recipe': the system peer}, each
    None until measured."""
    result = {**meta, 'complete': final, 'rows': rows, 'peer': peers.get('peer'), 'recipe': peers.get('recipe')}
    measured_peers = [p for p in (peers.get('peer'), peers.get('recipe')) if p]
    table = markdown_table(rows, measured_peers)
    if meta.get('sampling'):
        table += ('\n\nSampling (one batch; FLOPs = steps x forward FLOPs per image):\n\n'
                  + sampling_table(meta['sampling']))
    status = '' if final else '\n\n(incomplete: the run was still going, or was stopped, when this was written)'
    png = write_report(bench, stem, result, f"Training speed: {meta['preset']} on {meta['device']}",
                       table + status, notes='\n\n' + summary_lines(meta, rows, measured_peers))
    if final:  # the chart once, at the end (matplotlib costs about a second)
        bar_chart(rows, measured_peers, f"{meta['preset']} training, {meta['device']}, torch {meta['torch']}", png)
        print(table)
        print(summary_lines(meta, rows, measured_peers))
        print(f'wrote {png[:-4]}.json, .md and .png')
    return result


# ----------------------------------------------------------------------------- modes

def prepare(bench: BenchConfig, need_data: bool = True):
    """(the bench config as --quick shrinks it, device, data set name, data set, FLOP counts).
    fp32 rows run true fp32 unless --tf32: TF32 convolutions (PyTorch's default) are 8x the
    fp32 peak, and would make the fp32 rows' MFU against 19.5 TFLOP/s read several hundred %."""
    device = pick_device(bench.device)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = bench.tf32
    if bench.quick:
        bench = dataclasses.replace(bench, warmup=0, iters=min(bench.iters, 2),
                                    batch_size=min(bench.batch_size, 4), big_batch=min(bench.big_batch, 8),
                                    num_images=min(bench.num_images, 256), num_workers=min(bench.num_workers, 2))
        if device.type == 'cpu':
            bench = dataclasses.replace(bench, image_size=min(bench.image_size, 16))
    dataset_name, dataset = load_data(bench) if need_data else ('none', None)
    config = get_config(bench.preset, image_size=bench.image_size)
    flops = count_flops(config, bench.image_size)
    torchinfo = count_torchinfo_flops(config, bench.image_size)
    flops.update(torchinfo_forward=torchinfo['forward'], torchinfo_train=torchinfo['train'],
                 torchinfo_method=torchinfo['method'], params=count_params(UNet(config)))
    return bench, device, dataset_name, dataset, flops


def beton_for(bench: BenchConfig, dataset_name: str, dataset) -> 'data.BetonDataset':
    """The benchmark's data set as a raw-RGB .beton next to the data (written once)."""
    path = os.path.join(bench.data_dir, f'bench-{dataset_name}-{len(dataset)}x{bench.image_size}.beton')
    if not os.path.isfile(path):
        print(f'writing {path} for the FFCV rows ...', flush=True)
        data.write_beton(dataset, path, num_workers=bench.num_workers or 1)
    return data.BetonDataset(path)


def load_data(bench: BenchConfig):
    """CIFAR-10 where it is on disk; otherwise shapes of the same size and shape (the step's
    speed does not depend on what the pixels show)."""
    if bench.dataset in ('auto', 'cifar10'):
        try:
            return 'cifar10', data.ImageTensorDataset(data.resize_images(
                data.load_cifar10(bench.data_dir, train=True, download=False), bench.image_size))
        except data.DataError:
            if bench.dataset == 'cifar10':
                raise
    return 'shapes', data.ImageTensorDataset(data.make_shapes(bench.num_images, bench.image_size))


def selected_rows(bench: BenchConfig, device: torch.device) -> list:
    wanted = [w.strip().lower() for w in bench.rows.split(',') if w.strip()]
    return [r for r in ladder(bench, device) if not wanted or any(w in r.name.lower() for w in wanted)]


def output_stem(bench: BenchConfig, device: torch.device, mode: str = '') -> str:
    return bench.stem or f"{device_slug(device)}-{bench.preset}{'-' + mode if mode else ''}"


def run_ladder(bench: BenchConfig) -> dict:
    """The ladder, one row at a time; the report is rewritten after every row, the peer and
    each sampler, and a row that fails is reported as failed while the others go on."""
    bench, device, dataset_name, dataset, flops = prepare(bench)
    rows = selected_rows(bench, device)
    meta = {**header(bench, device, flops, dataset_name), 'rows_planned': [row.name for row in rows]}
    stem, results, peers = output_stem(bench, device), [], {}
    for index, row in enumerate(rows, 1):
        print(f'[{index}/{len(rows)}] {row.name} ...', flush=True)
        results.append(measure_row(row, bench, device, dataset, dataset_name, flops))
        add_speedups(results)
        print(row_line(index, len(rows), results[-1]), flush=True)
        write_outputs(stem, meta, results, peers, bench, final=False)
    measured = [(row, r) for row, r in zip(rows, results) if 'img_per_s' in r]
    if bench.peer and measured:
        fastest = max(measured, key=lambda pair: pair[1]['img_per_s'])
        for key, measure, what in (('peer', measure_peer, 'diffusers UNet2DModel'),
                                   ('recipe', measure_recipe, "diffusers' training recipe")):
            print(f'peer: {what}, then our fastest row again ...', flush=True)
            peers[key] = measure(fastest[0], fastest[1], bench, device, dataset, dataset_name, flops)
            add_speedups([results[0], peers[key]])
            print(row_line(len(rows) + len(peers), len(rows) + 2, peers[key]), flush=True)
            write_outputs(stem, meta, results, peers, bench, final=False)
    if bench.sampling:
        meta['sampling'] = []
        for sampler_row in run_sampling(bench, device, flops):
            meta['sampling'].append(sampler_row)
            write_outputs(stem, meta, results, peers, bench, final=False)
    return write_outputs(stem, meta, results, peers, bench)


# ----------------------------------------------------------------------------- sampling speed

def sampling_model(bench: BenchConfig, device: torch.device):
    """The preset's UNet, eval mode, in the fastest settings for inference on this device."""
    cuda = device.type == 'cuda'
    config = get_config(bench.preset, image_size=bench.image_size)
    model = UNet(config).to(device).eval().requires_grad_(False)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
        settings = f'compile {bench.sample_compile_mode}, channels-last'
        return torch.compile(model, mode=bench.sample_compile_mode), 'bf16', settings
    if bench.quick:
        return model, 'fp32', 'eager (--quick on CPU)'
    return torch.compile(model), 'fp32', 'compile default'


def time_sampler(sample_once, device: torch.device, repeats: int) -> tuple:
    """(seconds of the first call, which compiles; median seconds of `repeats` more)."""
    start = time.perf_counter()
    sample_once()
    synchronize(device)
    first = time.perf_counter() - start
    clock = Clock(device)
    clock.mark()
    for _ in range(repeats):
        sample_once()
        clock.mark()
    return first, statistics.median(clock.intervals_ms()) / 1e3


def run_sampling(bench: BenchConfig, device: torch.device, flops: dict) -> typing.Iterator[dict]:
    """img/s and MFU of DDIM-50, DPM-Solver++ at 10, 20 and 50 calls and DDPM-1000 on one batch of
    `--sample-batch` images, a row as each is done."""
    from diffusion import ddim_sample, ddpm_sample, dpm_solver_sample, make_schedule
    model, precision, settings = sampling_model(bench, device)
    quick_cpu = bench.quick and device.type == 'cpu'
    ddim_steps, num_steps = (10, 100) if quick_cpu else (50, 1000)  # --quick on a CPU: the wiring, not the speed
    sched = make_schedule(num_steps).to(device)
    batch = min(bench.sample_batch, 4) if bench.quick else bench.sample_batch
    shape = (batch, 3, bench.image_size, bench.image_size)
    generator = torch.Generator(device).manual_seed(bench.seed)
    amp = 'bf16' if precision == 'bf16' else 'off'
    repeats = 1 if bench.quick else 3
    samplers = [(f'DDIM-{ddim_steps}', ddim_steps, repeats,
                 lambda: ddim_sample(model, sched, shape, ddim_steps, generator=generator, device=device))]
    for calls in (5, 10) if quick_cpu else (10, 20, 50):
        samplers.append((f'DPM-Solver++-{calls}', calls, repeats, functools.partial(
            dpm_solver_sample, model, sched, shape, calls, generator=generator, device=device)))
    samplers.append((f'DDPM-{num_steps}', num_steps, 1, lambda: ddpm_sample(model, sched, shape, generator, device)))
    for name, steps, repeats, draw_batch in samplers:
        print(f'sampling: {name} ...', flush=True)
        try:
            with autocast(amp, device):
                first, seconds = time_sampler(draw_batch, device, repeats)
        except Exception as error:  # a sampler that fails here is reported, not fatal to the table
            yield {'name': name, 'error': brief(error, 300)}
            continue
        tflops = batch * steps * flops['forward'] / seconds / 1e12
        peak = peak_for(precision, device, bench)
        yield {'name': name, 'steps': steps, 'batch_size': batch, 'precision': precision, 'settings': settings,
               'seconds_per_batch': seconds, 'first_call_s': first, 'img_per_s': batch / seconds,
               'tflops': tflops, 'mfu': tflops / peak if peak else None, 'seconds_for_50k': 50000 / (batch / seconds),
               'timed_calls': repeats}
    release(device)


def run_sampling_only(bench: BenchConfig) -> dict:
    bench, device, dataset_name, _, flops = prepare(bench, need_data=False)
    meta = header(bench, device, flops, dataset_name)
    stem, rows = output_stem(bench, device, 'sampling'), []

    def report(final: bool) -> dict:
        result = {**meta, 'complete': final, 'sampling': rows}
        write_report(bench, stem, result, f"Sampling speed: {meta['preset']} on {meta['device']}",
                     sampling_table(rows))
        return result
    for row in run_sampling(bench, device, flops):
        rows.append(row)
        report(final=False)
    print(sampling_table(rows))
    return report(final=True)


def sampling_table(rows: list) -> str:
    lines = ['| Sampler | Batch | Precision | Settings | s/batch | img/s | TFLOP/s | MFU | 50k images |',
             '| :- | -: | :- | :- | -: | -: | -: | -: | -: |']
    for r in rows:
        if 'error' in r:
            lines.append(f"| {r['name']} | | failed: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['name']} | {r['batch_size']} | {r['precision']} | {r['settings']} | "
                     f"{r['seconds_per_batch']:.3f} | {r['img_per_s']:,.1f} | {r['tflops']:.2f} | "
                     f"{fmt(r['mfu'], '.1%')} | {r['seconds_for_50k'] / 60:.1f} min |")
    return '\n'.join(lines)


# ----------------------------------------------------------------------------- sampler accuracy

SOLVER_CALLS = (5, 10, 20, 50, 100, 1000)


class GaussianMixture(torch.nn.Module):
    """Data from a mixture of isotropic Gaussians N(mu_k, s^2 I) with weights w_k, and its exact
    denoiser, in closed form: x_t | k ~ N(alpha mu_k, v I) with v = alpha^2 s^2 + sigma^2, so
    E[x_0 | x_t] = sum_k gamma_k (mu_k + alpha s^2 / v (x_t - alpha mu_k)), gamma_k the posterior
    weight of component k, and the perfect model predicts eps = (x_t - alpha E[x_0 | x_t]) / sigma.
    A sampler's error is then measured without a trained network. Data are (N, D, 1, 1)."""

    def __init__(self, sched, means, std: float, weights):
        super().__init__()
        self.abar = sched.alphas_cumprod.double()
        self.means, self.std = torch.as_tensor(means, dtype=torch.float64), std  # (K, D)
        self.weights = torch.as_tensor(weights, dtype=torch.float64)

    def forward(self, xt, t):
        x = xt.double().flatten(1)  # (B, D)
        abar = self.abar.to(x.device)[t].view(-1, 1, 1)  # (B, 1, 1)
        alpha, sigma2 = abar.sqrt(), 1 - abar
        v = abar * self.std ** 2 + sigma2
        centred = x[:, None, :] - alpha * self.means.to(x.device)  # (B, K, D)
        logits = self.weights.log().to(x.device) - centred.square().sum(-1) / (2 * v[:, :, 0])  # (B, K)
        gamma = logits.softmax(-1)[:, :, None]
        x0 = (gamma * (self.means.to(x.device) + alpha * self.std ** 2 / v * centred)).sum(1)
        eps = (x - alpha[:, 0] * x0) / sigma2[:, 0].sqrt()
        return eps.view_as(xt).to(xt.dtype)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        noise = torch.randn(n, self.means.shape[1], generator=generator, dtype=torch.float64)
        return (self.means[k] + self.std * noise)[:, :, None, None]

    def moments(self) -> tuple:
        mean = self.weights @ self.means
        second = (self.weights[:, None, None] * (self.means[:, :, None] * self.means[:, None, :])).sum(0)
        return mean, second + self.std ** 2 * torch.eye(len(mean), dtype=torch.float64) - mean[:, None] * mean[None]


def sliced_wasserstein(a: torch.Tensor, b: torch.Tensor, projections: int = 128, seed: int = 0) -> float:
    """The sliced Wasserstein-1 distance of two equal-sized sets of points: the W1 distance of
    their 1-D projections (sorted and matched), averaged over random directions."""
    a, b = a.flatten(1).double(), b.flatten(1).double()
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(a.shape[1], projections, generator=generator, dtype=torch.float64)
    directions /= directions.norm(dim=0)
    return ((a @ directions).sort(0).values - (b @ directions).sort(0).values).abs().mean().item()


def solver_run(sampler: str, calls: int, model, sched, shape, seed: int, device) -> torch.Tensor:
    """x_0 from x_T drawn with `seed` (the same x_T for every sampler), in `calls` model calls.
    'ddpm' with fewer calls than T is the ancestral sampler over a strided sub-sequence (DDIM at
    eta 1). No clipping of the predicted x_0: the samplers solve the same ODE or SDE."""
    from diffusion import ddim_sample, ddpm_sample, dpm_solver_sample
    generator = torch.Generator(device).manual_seed(seed)
    dtype = torch.float64 if isinstance(model, GaussianMixture) else torch.float32
    if sampler.startswith('dpm++'):
        spacing = sampler.split('-')[-1] if '-' in sampler else 'logsnr'
        return dpm_solver_sample(model, sched, shape, calls, spacing, generator=generator, device=device, dtype=dtype)
    if sampler == 'ddpm' and calls == sched.num_steps:
        return ddpm_sample(model, sched, shape, generator, device, clip_denoised=False, dtype=dtype)
    return ddim_sample(model, sched, shape, calls, 1.0 if sampler == 'ddpm' else 0.0, generator, device,
                       clip_denoised=False, dtype=dtype)


def run_solver_accuracy(bench: BenchConfig) -> dict:
    """DDIM, DDPM and DPM-Solver++ at 5 to 1000 model calls, measured against exact answers: on a
    Gaussian mixture with its closed-form denoiser, the error of the samples' mean, covariance
    and distribution (sliced W1 against true samples) and the distance to the converged ODE
    solution from the same noise (DPM-Solver++ over all T timesteps); with --ckpt, the same
    distance for a trained model's images."""
    from diffusion import make_schedule
    device = pick_device(bench.device)
    calls = (5, 20) if bench.quick else SOLVER_CALLS  # --quick: the wiring, with a 1000-call reference still
    samplers = ['ddim', 'ddpm', 'dpm++-time', 'dpm++-logsnr']
    sched = make_schedule(1000)
    n = 1000 if bench.quick else 20000
    mixture = GaussianMixture(sched, [[-0.5, -0.4], [0.5, -0.3], [0.0, 0.6]], 0.08, [0.3, 0.3, 0.4])
    true_mean, true_cov = mixture.moments()
    truth = mixture.sample(n, torch.Generator().manual_seed(bench.seed + 1))
    shape = (n, 2, 1, 1)
    ode = solver_run('dpm++-time', sched.num_steps, mixture, sched, shape, bench.seed, torch.device('cpu'))
    rows = []
    for sampler in samplers:
        for k in calls:
            print(f'accuracy: {sampler}, {k} calls ...', flush=True)
            x = solver_run(sampler, k, mixture, sched, shape, bench.seed, torch.device('cpu'))
            flat = x.flatten(1)
            rows.append({'data': 'gaussian mixture (2-D)', 'sampler': sampler, 'calls': k,
                         'mean_error': (flat.mean(0) - true_mean).norm().item(),
                         'cov_error': (torch.cov(flat.T) - true_cov).norm().item(),
                         'sliced_w1': sliced_wasserstein(x, truth),
                         'to_ode': None if sampler == 'ddpm' else (x - ode).square().mean().sqrt().item()})
    floor = {'sliced_w1': sliced_wasserstein(mixture.sample(n, torch.Generator().manual_seed(bench.seed + 2)), truth)}
    if bench.ckpt:
        import sample
        model, config, trained_sched = sample.load_model(bench.ckpt, 'ema', device)
        shape = (min(bench.sample_batch, 2 if bench.quick else 64), 3, config.image_size, config.image_size)
        reference = solver_run('dpm++-time', trained_sched.num_steps, model, trained_sched, shape, bench.seed, device)
        for sampler in [s for s in samplers if s != 'ddpm']:
            for k in calls:
                print(f'accuracy: {sampler}, {k} calls, {bench.ckpt} ...', flush=True)
                x = solver_run(sampler, k, model, trained_sched, shape, bench.seed, device)
                rows.append({'data': f'trained model ({bench.ckpt})', 'sampler': sampler, 'calls': k,
                             'to_ode': (x - reference).float().square().mean().sqrt().item()})
    meta = {**header(bench, device, {}, 'gaussian mixture'), 'samples': n, 'rows': rows, 'floor': floor}
    stem = output_stem(bench, device, 'solver-accuracy')
    table = accuracy_table(rows)
    png = write_report(bench, stem, meta, 'Sampler accuracy against exact answers', table,
                       notes=f"; {n} samples of a 2-D Gaussian mixture with its exact denoiser (sliced W1 between "
                             f"two sets of true samples: {floor['sliced_w1']:.4f}, the noise floor)")
    accuracy_plot(rows, png, floor)
    print(table)
    return meta


def accuracy_table(rows: list) -> str:
    lines = ['| Data | Sampler | Model calls | mean error | covariance error | sliced W1 | RMS to the ODE solution |',
             '| :- | :- | -: | -: | -: | -: | -: |']
    for r in rows:
        lines.append(f"| {r['data']} | {r['sampler']} | {r['calls']} | {fmt(r.get('mean_error'), '.4f')} | "
                     f"{fmt(r.get('cov_error'), '.4f')} | {fmt(r.get('sliced_w1'), '.4f')} | "
                     f"{fmt(r.get('to_ode'), '.2e')} |")
    return '\n'.join(lines)


def accuracy_plot(rows: list, path: str, floor: dict = None):
    """Error against model calls, log-log: one panel per measure and data, one colour per sampler."""
    plt = pyplot()
    colours = {'ddim': 'tab:blue', 'ddpm': 'tab:gray', 'dpm++-time': 'tab:orange', 'dpm++-logsnr': 'tab:green'}
    panels = [('gaussian mixture (2-D)', 'sliced_w1', 'sliced W1 to the true distribution'),
              ('gaussian mixture (2-D)', 'to_ode', 'RMS distance to the ODE solution')]
    panels += [(d, 'to_ode', 'RMS distance to the ODE solution') for d in dict.fromkeys(r['data'] for r in rows)
               if d.startswith('trained')]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (source, key, label) in zip(axes[0], panels):
        for sampler, colour in colours.items():
            points = [(r['calls'], r[key]) for r in rows if r['data'] == source and r['sampler'] == sampler
                      and r.get(key)]
            if points:
                ax.loglog(*zip(*points), 'o-', color=colour, label=sampler)
        if key == 'sliced_w1' and floor:
            ax.axhline(floor['sliced_w1'], color='black', linestyle=':', label='two true samples (noise floor)')
        ax.set_xlabel('model calls per image')
        ax.set_ylabel(label)
        ax.set_title(source if len(source) < 48 else source[:45] + '...', fontsize=9)
        ax.grid(alpha=0.3, which='both')
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


# ----------------------------------------------------------------------------- quality

def train_for_quality(row: Row, bench: BenchConfig, device, dataset, dataset_name, seed: int) -> dict:
    """Trains `bench.steps` steps under a row's settings; held-out losses of the model and EMA."""
    row_cfg = dataclasses.replace(row_train_config(row, bench, device, dataset_name), seed=seed)
    run = build_row_run(row_cfg, bench, device, dataset, compile_scope=row.compile_scope)
    start = time.perf_counter()
    stream = train.batches(run, 0)
    loss_sum = torch.zeros((), device=device)
    for step in range(bench.steps):
        loss_sum += train.train_step(run, next(stream), step)
    train_loss = loss_sum.item() / bench.steps
    seconds = time.perf_counter() - start
    # Evaluated the same way for every row: fp32, eager, on the same images, timesteps and noise.
    eval_cfg = dataclasses.replace(row_cfg, amp='off', channels_last=False)
    heldout = sample.make_heldout(eval_cfg, device, run.sched.num_steps)
    losses = {'model': sample.heldout_losses(run.model, run.sched, heldout, eval_cfg, device),
              'ema': sample.heldout_losses(run.ema, run.sched, heldout, eval_cfg, device)}
    release(device)
    return {'name': row.name, 'seed': seed, 'settings': asdict(row), 'precision': precision_of(row_cfg.amp, device),
            'train_loss': train_loss, 'seconds': seconds, 'losses': losses,
            'heldout_loss': losses['model'].mean().item(), 'heldout_loss_ema': losses['ema'].mean().item()}


def compare(run: dict, baseline: dict, weights: str) -> dict:
    """Relative difference of held-out losses, with the paired standard error of the difference
    (same images, timesteps and noise in both), so that evaluation noise is accounted for."""
    diff = run['losses'][weights] - baseline['losses'][weights]
    base = baseline['losses'][weights].mean().item()
    return {'relative_difference': diff.mean().item() / base,
            'paired_stderr_relative': (diff.std() / len(diff) ** 0.5).item() / base}


def run_quality(bench: BenchConfig) -> dict:
    bench, device, dataset_name, dataset, flops = prepare(bench)
    if bench.quick:
        bench = dataclasses.replace(bench, steps=min(bench.steps, 20))
    baseline = Row('Baseline (fp32, eager, manual attention, DataLoader)', bench.batch_size)
    fast = dataclasses.replace(start_row(bench, device), name='All speed-ups', batch_size=bench.batch_size)
    runs = []
    for row, seed in [(baseline, bench.seed), (fast, bench.seed), (baseline, bench.seed + 1)]:
        print(f'quality: {row.name}, seed {seed}, {bench.steps} steps ...', flush=True)
        runs.append(train_for_quality(row, bench, device, dataset, dataset_name, seed))
    base, fast_run, other_seed = runs
    comparison = {weights: {'all_speedups': compare(fast_run, base, weights),
                            'baseline_other_seed': compare(other_seed, base, weights)} for weights in ('model', 'ema')}
    # Agreement: the speed-ups move the held-out loss no more than changing the seed does,
    # or than two paired standard errors of the evaluation.
    agree = {w: abs(c['all_speedups']['relative_difference'])
             <= max(abs(c['baseline_other_seed']['relative_difference']),
                    2 * c['all_speedups']['paired_stderr_relative'])
             for w, c in comparison.items()}
    meta = header(bench, device, flops, dataset_name)
    result = {**meta, 'steps': bench.steps, 'batch_size': bench.batch_size,
              'runs': [{k: v for k, v in r.items() if k != 'losses'} for r in runs],
              'comparison': comparison, 'agree_within_noise': agree}
    write_quality(result, bench, device)
    return result


def write_quality(result: dict, bench: BenchConfig, device: torch.device):
    lines = ['| Run | Seed | Precision | train loss | held-out loss | held-out loss (EMA) | time (s) |',
             '| :- | -: | :- | -: | -: | -: | -: |']
    for r in result['runs']:
        lines.append(f"| {r['name']} | {r['seed']} | {r['precision']} | {r['train_loss']:.5f} | "
                     f"{r['heldout_loss']:.5f} | {r['heldout_loss_ema']:.5f} | {r['seconds']:.1f} |")
    lines += ['', '| Weights | speed-ups vs baseline | paired s.e. | other seed vs baseline | agree within noise |',
              '| :- | -: | -: | -: | :- |']
    for weights, c in result['comparison'].items():
        lines.append(f"| {weights} | {c['all_speedups']['relative_difference']:+.2%} | "
                     f"{c['all_speedups']['paired_stderr_relative']:.2%} | "
                     f"{c['baseline_other_seed']['relative_difference']:+.2%} | "
                     f"{result['agree_within_noise'][weights]} |")
    table = '\n'.join(lines)
    write_report(bench, bench.stem or f'quality-{device_slug(device)}-{result["preset"]}', result,
                 f"Quality: {result['preset']}, {result['steps']} steps of batch {result['batch_size']} on "
                 f"{result['device']}", table, notes=f"; held-out loss on {train.TrainConfig.heldout_size} fixed "
                                                     f"images, timesteps and noise, evaluated in fp32.")
    print(table)


def start_row(bench: BenchConfig, device: torch.device) -> Row:
    """The row the other modes start from: --from-row, or the last runnable row in the default
    compile mode (it holds every change above it, and it is what train.py runs on a GPU)."""
    rows = ladder(bench, device)
    if bench.from_row:
        runnable = [r for r in rows if not skip_reason(r, device)]
        named = [r for r in runnable if bench.from_row.lower() in r.name.lower()]
        if not named:
            raise ConfigError(f"--from-row {bench.from_row!r} matches no row that runs here; the rows are: "
                                    f"{'; '.join(r.name for r in runnable)}")
        return named[0]
    # From the last row back, so that the FFCV row's check (importing ffcv: seconds) is rarely needed.
    return next(r for r in reversed(rows) if r.compile_mode == 'default' and not skip_reason(r, device))


# Profiler kernel/op names -> what they do. First match wins; the optimizer goes first since
# its multi-tensor kernels are also elementwise.
CATEGORIES = [
    ('optimizer', r'adam|multi_tensor|foreach|lerp|clip_grad|vector_norm|_amp_'),
    ('attention', r'flash|fmha|attention|sdpa|softmax|bmm'),
    ('norm', r'norm|welford'),
    ('conv / matmul', r'conv|cudnn|implicit|xmma|cutlass|gemm|winograd|dgrad|wgrad|fprop|mm\b|addmm|matmul|sm\d\d_'),
    ('elementwise', r'elementwise|vectorized|triton_|silu|add|mul|copy|fill|cat|where|index|gather|reduce|'
                    r'sum|mean|div|sub|pow|exp|clamp|flip|unrolled'),
]


def categorise(name: str) -> str:
    lowered = name.lower()
    return next((category for category, pattern in CATEGORIES if re.search(pattern, lowered)), 'other')


def profile_rows(prof, device: torch.device) -> list:
    """Per op (CPU) or kernel (CUDA): self time in ms per iteration, with its category."""
    cuda = device.type == 'cuda'
    rows = []
    for event in prof.key_averages():
        if cuda:
            if str(event.device_type) != 'DeviceType.CUDA':
                continue  # CPU ops that launch kernels: their kernels are counted instead
            self_us = event.self_device_time_total
        else:
            self_us = event.self_cpu_time_total
        if self_us > 0:
            rows.append({'name': event.key, 'category': categorise(event.key), 'calls': event.count,
                         'self_us': self_us})
    return sorted(rows, key=lambda r: -r['self_us'])


def profile_best_row(bench: BenchConfig) -> dict:
    bench, device, dataset_name, dataset, flops = prepare(bench)
    row = start_row(bench, device)
    row_cfg = row_train_config(row, bench, device, dataset_name)
    run = build_row_run(row_cfg, bench, device, dataset, compile_scope=row.compile_scope)
    stream = train.batches(run, 0)
    for step in range(3):  # compile and warm up outside the profile
        train.train_step(run, next(stream), step)
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == 'cuda':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    active = 3 if bench.quick else 10
    schedule = torch.profiler.schedule(wait=1, warmup=2, active=active)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for step in range(3, 3 + 3 + active):
            train.train_step(run, next(stream), step)
            prof.step()
        synchronize(device)
    stem = output_stem(bench, device, 'profile')
    os.makedirs(os.path.join(bench.out_dir, 'traces'), exist_ok=True)
    trace = os.path.join(bench.out_dir, 'traces', f'{stem}.json')
    prof.export_chrome_trace(trace)
    ops = profile_rows(prof, device)
    for op in ops:
        op['ms_per_iter'] = op['self_us'] / 1e3 / active
    total = sum(op['ms_per_iter'] for op in ops)
    categories = {}
    for op in ops:
        categories[op['category']] = categories.get(op['category'], 0.0) + op['ms_per_iter']
    meta = header(bench, device, flops, dataset_name)
    result = {**meta, 'row': row.name, 'settings': asdict(row), 'trace': trace, 'active_iterations': active,
              'total_ms_per_iter': total, 'categories': categories, 'top_ops': ops[:40]}
    write_profile_outputs(stem, result, bench)
    return result


def write_profile_outputs(stem: str, result: dict, bench: BenchConfig):
    total = result['total_ms_per_iter'] or 1.0
    lines = ['| Category | ms/iter | share |', '| :- | -: | -: |']
    for category, ms in sorted(result['categories'].items(), key=lambda kv: -kv[1]):
        lines.append(f'| {category} | {ms:.3f} | {ms / total:.1%} |')
    lines += ['', '| Op / kernel | Category | calls | ms/iter | share |', '| :- | :- | -: | -: | -: |']
    for op in result['top_ops'][:25]:
        name = op['name'] if len(op['name']) < 90 else op['name'][:87] + '...'
        lines.append(f"| `{name}` | {op['category']} | {op['calls']} | {op['ms_per_iter']:.3f} | "
                     f"{op['ms_per_iter'] / total:.1%} |")
    table = '\n'.join(lines)
    what = 'CPU ops' if result['device'].startswith('CPU') else 'kernels'
    png = write_report(bench, stem, result, f"Profile: {result['preset']}, {result['row']}, on {result['device']}",
                       table, notes=f"; self time per iteration ({what}), mean of {result['active_iterations']} "
                                    f"profiled iterations. Trace for chrome://tracing or ui.perfetto.dev: "
                                    f"`{result['trace']}`.")
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={'width_ratios': [1, 2]})
    cats = sorted(result['categories'].items(), key=lambda kv: kv[1])
    left.barh([c for c, _ in cats], [ms for _, ms in cats], color='tab:blue')
    left.set_xlabel('ms per iteration')
    left.set_title('by category', fontsize=9)
    top = result['top_ops'][:15][::-1]
    right.barh([o['name'][:50] for o in top], [o['ms_per_iter'] for o in top], color='tab:orange')
    right.tick_params(axis='y', labelsize=7)
    right.set_xlabel('ms per iteration')
    right.set_title('top ops / kernels (self time)', fontsize=9)
    fig.suptitle(f"{result['preset']}, {result['row']}, {result['device']}, torch {result['torch']}", fontsize=9)
    save_figure(fig, png, dpi=110)
    print(table)


def sweep_rows(kind: str, best: Row, bench: BenchConfig, device: torch.device) -> list:
    """Variants of the best row along one setting."""
    cuda = device.type == 'cuda'
    values = [int(v) for v in bench.sweep_values.split(',') if v.strip()] if bench.sweep_values else None
    if kind == 'batch':
        sizes = values or ([4, 8, 16] if bench.quick else [64, 128, 256, 512, 1024, 2048, 4096])
        return [dataclasses.replace(best, name=f'batch {b}', batch_size=b) for b in sizes]
    if kind == 'workers':
        counts = values or ([0, 2] if bench.quick else [0, 2, 4, 8])
        return [dataclasses.replace(best, name=f'torch loader, {n} workers', loader='torch', num_workers=n)
                for n in counts]
    if kind == 'amp':
        precisions = ['off', 'bf16'] + (['fp16'] if cuda else [])
        return [dataclasses.replace(best, name=f'amp {p}', amp=p) for p in precisions]
    modes = ['default'] + (['max-autotune-no-cudagraphs', 'reduce-overhead', 'max-autotune'] if cuda else [])
    return [dataclasses.replace(best, name='eager', compile=False)] + [
        dataclasses.replace(best, name=f'compile {m}', compile=True, compile_mode=m) for m in modes]


def run_sweep(bench: BenchConfig) -> dict:
    bench, device, dataset_name, dataset, flops = prepare(bench)
    best = start_row(bench, device)
    results = []
    for row in sweep_rows(bench.sweep, best, bench, device):
        print(f'{row.name} ...', flush=True)
        results.append(measure_row(row, bench, device, dataset, dataset_name, flops))
    add_speedups(results)  # relative to the sweep's first point
    meta = header(bench, device, flops, dataset_name)
    stem = output_stem(bench, device, f'sweep-{bench.sweep}')
    table = markdown_table(results, [])
    png = write_report(bench, stem, {**meta, 'sweep': bench.sweep, 'base_row': best.name, 'rows': results},
                       f"Sweep of {bench.sweep} around '{best.name}': {meta['preset']} on {meta['device']}", table)
    sweep_plot(results, bench.sweep, meta, png)
    print(table)
    return {**meta, 'rows': results}


def sweep_plot(results: list, kind: str, meta: dict, path: str):
    plt = pyplot()
    measured = [r for r in results if 'img_per_s' in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [str(r['batch_size']) if kind == 'batch' else r['name'] for r in measured]
    ax.plot(labels, [r['img_per_s'] for r in measured], 'o-', color='tab:blue')
    ax.set_ylabel('training img/s', color='tab:blue')
    ax.set_xlabel('batch size' if kind == 'batch' else kind)
    if any(r.get('mfu') for r in measured):
        twin = ax.twinx()
        twin.plot(labels, [100 * (r['mfu'] or 0) for r in measured], 's--', color='tab:orange')
        twin.set_ylabel('MFU (%)', color='tab:orange')
    ax.tick_params(axis='x', labelrotation=20, labelsize=8)
    ax.set_title(f"{meta['preset']}: sweep of {kind}, {meta['device']}, torch {meta['torch']}", fontsize=9)
    save_figure(fig, path, dpi=110)


def time_loader(loader, num_batches: int, device: torch.device) -> float:
    """Images per second a loader delivers to the device (the batch is consumed on the device)."""
    stream = (x for epoch in range(10 ** 6) for x in loader.epoch(epoch))
    checksum = torch.zeros((), device=device)
    for _ in range(2):
        checksum += next(stream).sum()  # warm-up: worker start, first epoch's order
    synchronize(device)
    start = time.perf_counter()
    for _ in range(num_batches):
        checksum += next(stream)[:, :, 0, 0].sum()  # touch the batch on the device, cheaply
    synchronize(device)
    return num_batches * loader.batch_size / (time.perf_counter() - start)


def run_loader_only(bench: BenchConfig) -> dict:
    bench, device, dataset_name, dataset, flops = prepare(bench)
    best = start_row(bench, device)
    batch, num_batches = best.batch_size, (5 if bench.quick else 100)
    paths = [('torch', n) for n in ([0, 2] if bench.quick else [0, 2, 4, 8])] + [('gpu', None), ('ffcv', None)]
    results = []
    for kind, workers in paths:
        name = f'torch DataLoader, {workers} workers' if kind == 'torch' else {
            'gpu': 'gpu (device-resident)', 'ffcv': 'FFCV'}[kind]
        print(f'{name} ...', flush=True)
        reason = data.ffcv_missing_reason() if kind == 'ffcv' else None
        if reason:
            results.append({'name': name, 'skipped': reason})
            continue
        source = beton_for(bench, dataset_name, dataset) if kind == 'ffcv' else dataset
        workers = bench.num_workers if kind == 'ffcv' else workers
        loader = data.make_loader(kind, source, batch, bench.seed, device, workers or 0, progress=False)
        if kind == 'ffcv':
            name = f'FFCV ({loader.num_workers} threads)'
        results.append({'name': name, 'loader': kind, 'num_workers': workers,
                        'img_per_s': time_loader(loader, num_batches, device)})
        del loader
    consumption = measure_row(best, bench, device, dataset, dataset_name, flops)
    meta = header(bench, device, flops, dataset_name)
    result = {**meta, 'batch_size': batch, 'step_row': best.name, 'step_img_per_s': consumption.get('img_per_s'),
              'loaders': results}
    stem = output_stem(bench, device, 'loaders')
    lines = ['| Loader | img/s | x the step\'s consumption |', '| :- | -: | -: |']
    for r in results:
        if 'skipped' in r:
            lines.append(f"| {r['name']} | skipped: {r['skipped']} | |")
        else:
            ratio = r['img_per_s'] / result['step_img_per_s'] if result['step_img_per_s'] else None
            lines.append(f"| {r['name']} | {r['img_per_s']:,.0f} | {fmt(ratio, '.1f')} |")
    table = '\n'.join(lines)
    loader_plot(result, write_report(bench, stem, result, f"Data paths: images/s delivered to {meta['device']} "
                                                          f"({dataset_name}, batch {batch})", table,
                                     notes=f"; the training step ('{best.name}') consumes "
                                           f"{fmt(result['step_img_per_s'], ',.0f')} img/s."))
    print(table)
    return result


def loader_plot(result: dict, path: str):
    plt = pyplot()
    measured = [r for r in result['loaders'] if 'img_per_s' in r]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(measured) + 1.5))
    ax.barh([r['name'] for r in measured][::-1], [r['img_per_s'] for r in measured][::-1], color='tab:green')
    if result['step_img_per_s']:
        ax.axvline(result['step_img_per_s'], color='tab:red', linestyle='--', label='training step consumes')
        ax.axvline(2 * result['step_img_per_s'], color='tab:red', linestyle=':', label='2x the step (target)')
        ax.legend(fontsize=8)
    ax.set_xscale('log')
    ax.set_xlabel('images per second delivered (log scale)')
    ax.set_title(f"data paths, {result['preset']}, {result['device']}, torch {result['torch']}", fontsize=9)
    save_figure(fig, path, dpi=110)


# The modes besides the ladder: the flag that asks for each, and what runs it.
MODES = {'profile': profile_best_row, 'sweep': run_sweep, 'loader_only': run_loader_only, 'quality': run_quality,
         'sampling_only': run_sampling_only, 'solver_accuracy': run_solver_accuracy}


def validate(bench: BenchConfig) -> BenchConfig:
    """Every flag checked before any work (ConfigError, one line); fills --out-dir."""
    check_ranges(bench)
    device = pick_device(bench.device)
    modes = [name for name in MODES if getattr(bench, name)]
    if len(modes) > 1:
        raise ConfigError(f"choose one mode, not {' and '.join('--' + m.replace('_', '-') for m in modes)}")
    try:
        get_config(bench.preset, image_size=bench.image_size)
    except ValueError as error:
        raise ConfigError(f'--image-size {bench.image_size}: {error}') from None
    if bench.rows:
        names = [row.name for row in ladder(bench, device)]
        wanted = [w.strip().lower() for w in bench.rows.split(',')]
        if not any(w and w in name.lower() for w in wanted for name in names):
            raise ConfigError(f"--rows {bench.rows!r} matches no row; the rows are: {'; '.join(names)}")
    if bench.from_row:
        start_row(bench, device)  # an unknown row is an error now, not after the data is loaded
    if bench.stem and (os.path.basename(bench.stem) != bench.stem or bench.stem in ('.', '..')):
        raise ConfigError(f'--stem {bench.stem!r}: a plain file name (no folders); --out-dir sets where it goes')
    try:
        values = [int(v) for v in bench.sweep_values.split(',') if v.strip()]
    except ValueError:
        raise ConfigError(f'--sweep-values {bench.sweep_values!r}: comma-separated integers') from None
    if any(v < (0 if bench.sweep == 'workers' else 1) for v in values):
        raise ConfigError(f'--sweep-values {bench.sweep_values!r}: out of range')
    out_dir = bench.out_dir or ('results' if device.type == 'cuda' else os.path.join('runs', 'benchmark'))
    check_writable(out_dir, '--out-dir')
    return dataclasses.replace(bench, out_dir=out_dir)


def main(argv=None):
    bench = validate(parse_config(argv, BenchConfig, __doc__))
    torch.manual_seed(bench.seed)
    mode = next((name for name in MODES if getattr(bench, name)), None)
    return MODES[mode](bench) if mode else run_ladder(bench)


def cli(argv=None) -> int:
    return run_main(main, argv)


if __name__ == '__main__':
    sys.exit(cli())

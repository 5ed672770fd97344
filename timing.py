"""How benchmark.py times what it times: one training step as train.py runs it (the ladder's rows,
one change each), the timed loop (median of iterations after warm-up; CUDA events on a GPU),
throughput, TFLOP/s and MFU; the diffusers peers beside our fastest row; the samplers; a loader's
images per second."""
import contextlib
import dataclasses
import functools
import os
import statistics
import time
import typing
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

import bookkeeping
import data
import diffusion
import train
from cli import ConfigError, brief
from devices import A100_PEAK_TFLOPS, autocast, peak_tflops, precision_of, synchronize
from files import write_once
from model import UNet, get_config
from peers import (RECIPE, DiffusersUNet, diffusers_missing_reason, recipe_batches, recipe_loader, recipe_parts,
                   recipe_step, write_image_folder)
from reports import format_or_na


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
    fused_norm: bool = False  # GroupNorm (+ add, + SiLU) as one Triton kernel (kernels.py)
    coordinate_descent: bool = False  # Inductor's coordinate-descent tuning of its Triton kernels
    sdpa_backend: str = 'auto'  # 'cudnn': SDPA held to cuDNN's attention kernel
    network: str = 'ours'  # 'diffusers': diffusers' UNet2DModel of the same function (the model peer)
    carried: bool = True  # False: a row that is only tried; the rows below leave its change out


def ladder(bench, device: torch.device) -> list:
    """The reference table's rows, then ours; each row changes one thing."""
    rows = [Row('Baseline (fp32, eager, manual attention, DataLoader)', bench.batch_size)]

    base = rows[0]  # the row the next one changes

    def add(name, carried=True, **change):  # a row not carried shows what its change costs; the next row leaves it out
        nonlocal base
        rows.append(dataclasses.replace(base, name=name, carried=carried, **change))
        base = rows[-1] if carried else base
    add(f'Scale up batch size ({bench.big_batch})', batch_size=bench.big_batch)
    add('torch.compile (the network)', compile=True, compile_scope='model')
    add('torch.compile (the whole loss, one graph)', compile_scope='loss')
    add('PyTorch SDPA', attention='sdpa')
    add(f'Mixed precision ({bench.amp_dtype})', amp=bench.amp_dtype)
    # NHWC measured 4.5% slower than NCHW on an H200 with the compiled bf16 step (results/h200-layout-check.md)
    add('Channels-last (tried: the rows below stay NCHW)', carried=False, channels_last=True)
    add('Fused Adam', fused_adam=True)
    add('FFCV data loading', loader='ffcv')
    add('GPU-resident data' if device.type == 'cuda' else 'Device-resident data (gpu loader, in RAM)', loader='gpu')
    # Tried, none carried: not yet measured on a GPU. The compile modes each replace the default mode;
    # CUDA graphs cover the compiled loss (forward and backward), not the optimizer, clipping or EMA.
    add('compile reduce-overhead (CUDA graphs of the compiled loss)', carried=False, compile_mode='reduce-overhead')
    add('compile max-autotune (no CUDA graphs)', carried=False, compile_mode='max-autotune-no-cudagraphs')
    add('compile max-autotune + CUDA graphs', carried=False, compile_mode='max-autotune')
    add('fused GroupNorm (Triton)', carried=False, fused_norm=True)
    add(f'Twice the batch ({2 * bench.big_batch})', carried=False, batch_size=2 * bench.big_batch)
    add('cuDNN attention (SDPA backend)', carried=False, sdpa_backend='cudnn')
    add('Inductor coordinate-descent tuning', carried=False, coordinate_descent=True)
    return rows


def skip_reason(row: Row, device: torch.device) -> str | None:
    if row.loader == 'ffcv':
        return data.ffcv_missing_reason()
    if row.amp == 'fp16' and device.type != 'cuda':
        return 'fp16 training needs CUDA'
    if row.compile_mode != 'default' and device.type != 'cuda':
        return 'compile modes other than default target CUDA (autotuning, CUDA graphs)'
    if row.fused_norm and device.type != 'cuda':
        return 'the fused GroupNorm is a Triton kernel for CUDA (on a CPU only Triton\'s interpreter runs it)'
    if row.sdpa_backend != 'auto' and device.type != 'cuda':
        return f'the {row.sdpa_backend} attention backend is a CUDA one'
    if row.coordinate_descent and device.type != 'cuda':
        return 'coordinate-descent tuning tunes Inductor\'s Triton kernels, which are CUDA ones'
    if row.network == 'diffusers':
        return diffusers_missing_reason()
    return None


@contextlib.contextmanager
def row_settings(row: Row):
    """The settings of a row that live outside train.py's config, for as long as the row is built,
    compiled (lazily: at its first step) and timed: Inductor's coordinate-descent tuning, the SDPA
    backend. Restored afterwards."""
    with contextlib.ExitStack() as stack:
        if row.coordinate_descent:
            import torch._inductor.config as inductor_config
            stack.enter_context(inductor_config.patch(coordinate_descent_tuning=True))
        if row.sdpa_backend != 'auto':
            from torch.nn.attention import SDPBackend, sdpa_kernel
            stack.enter_context(sdpa_kernel({'cudnn': SDPBackend.CUDNN_ATTENTION}[row.sdpa_backend]))
        yield


def network_of(row: Row):
    """What builds the row's network: ours (None: train.py's UNet) or diffusers' UNet2DModel."""
    return DiffusersUNet if row.network == 'diffusers' else None


def start_row(bench, device: torch.device) -> Row:
    """The row the other modes start from: --from-row, or the last runnable row in the default
    compile mode that is carried (it holds every change above it that is kept, and it is what
    train.py runs on a GPU); the rows that are only tried come after it."""
    rows = ladder(bench, device)
    if bench.from_row:
        named = [r for r in rows if not skip_reason(r, device) and bench.from_row.lower() in r.name.lower()]
        if not named:
            raise ConfigError(f"--from-row {bench.from_row!r} matches no row that runs here; the rows are: "
                              f"{'; '.join(r.name for r in rows if not skip_reason(r, device))}")
        return named[0]
    # From the last row back, so that the FFCV row's check (importing ffcv: seconds) is rarely needed.
    return next(r for r in reversed(rows) if r.carried and r.compile_mode == 'default' and not skip_reason(r, device))




def row_train_config(row: Row, bench, device: torch.device, dataset_name: str) -> train.TrainConfig:
    cfg = train.TrainConfig(preset=bench.preset, dataset=dataset_name, data_dir=bench.data_dir,
                            image_size=bench.image_size, batch_size=row.batch_size, attention=row.attention,
                            compile=row.compile, compile_mode=row.compile_mode, amp=row.amp,
                            channels_last=row.channels_last, fused_adam=row.fused_adam, fused_norm=row.fused_norm,
                            loader=row.loader,
                            num_workers=bench.num_workers if row.num_workers is None else row.num_workers,
                            seed=bench.seed, device=str(device))
    return train.resolve_defaults(cfg, device)


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda, self.marks = device.type == 'cuda', []

    def mark(self):
        event = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
        if self.cuda:
            event.record()
        self.marks.append(event)

    def intervals_ms(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def time_iterations(iterate: typing.Callable, device: torch.device, bench, name: str = '') -> dict:
    """Compile time (the first iteration), then the median ms of `iters` iterations after warm-up,
    with a progress bar (on stderr; it never waits for the device). iterate(step) runs one training
    iteration, data included, and leaves its loss on the device."""
    bar = tqdm(total=bench.warmup + bench.iters, desc=f'  {name[:60]}', leave=False)  # after the first iteration
    start = time.perf_counter()
    iterate(0)
    synchronize(device)
    compile_s = time.perf_counter() - start
    for step in range(1, bench.warmup + 1):
        iterate(step)
        bar.update()
    synchronize(device)
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock(device)
    clock.mark()
    for step in range(bench.warmup + 1, bench.warmup + 1 + bench.iters):
        iterate(step)  # no sync: the next iteration's host work overlaps this one's kernels
        clock.mark()
        bar.update()
    intervals = clock.intervals_ms()
    bar.close()
    return {'ms_per_iter': statistics.median(intervals), 'ms_min': min(intervals), 'ms_max': max(intervals),
            'compile_s': compile_s,
            'peak_mem_gb': torch.cuda.max_memory_allocated(device) / 1e9 if device.type == 'cuda' else None}


def release(device: torch.device):
    torch._dynamo.reset()
    if device.type == 'cuda':
        torch.cuda.empty_cache()


def build_row_run(row_cfg: train.TrainConfig, bench, device, dataset, make_model=None,
                  compile_scope: str = 'loss') -> bookkeeping.Run:
    """train.py's run of a row; compile_scope 'model' compiles the network alone (the loss
    around it runs eagerly), 'loss' the whole loss as train.py does."""
    run = train.build_run(row_cfg, device, dataset=dataset, progress=False, make_model=make_model)
    if row_cfg.compile:  # torch.compile is lazy: replacing the loss before its first call costs nothing
        options = {} if bench.compile_backend == 'inductor' else {'backend': bench.compile_backend}
        if compile_scope == 'model':
            mode = None if row_cfg.compile_mode == 'default' or options else row_cfg.compile_mode
            net = torch.compile(run.model, mode=mode, **options)
            run.compute_loss = train.make_loss(dataclasses.replace(row_cfg, compile=False), net, run.sched, device)
        elif options:
            run.compute_loss = train.make_loss(row_cfg, run.model, run.sched, device, mode=None, **options)
    return run


def peak_for(precision: str, device: torch.device, bench):
    """The dense peak the MFU is computed against: the override, the table, or None (n/a)."""
    override = bench.peak_tflops_fp32 if precision in ('fp32', 'tf32') else bench.peak_tflops
    if override or device.type != 'cuda':
        return override
    return peak_tflops(torch.cuda.get_device_name(device), precision)


def throughput(result: dict, row_cfg: train.TrainConfig, bench, device, flops: dict) -> dict:
    """A timing with its throughput, TFLOP/s and MFU (against the device's peak and the A100's)."""
    precision = precision_of(row_cfg.amp, device)
    img_per_s = row_cfg.batch_size / (result['ms_per_iter'] / 1e3)
    tflops, peak = img_per_s * flops['train'] / 1e12, peak_for(precision, device, bench)
    return {**result, 'precision': precision, 'img_per_s': img_per_s, 'tflops': tflops,
            'tflops_torchinfo': img_per_s * flops['torchinfo_train'] / 1e12, 'mfu': tflops / peak if peak else None,
            'peak_tflops': peak, 'mfu_a100': tflops / A100_PEAK_TFLOPS[precision]}  # fp32 19.5, TF32 156, bf16 312


def measure_row(row: Row, bench, device, dataset, dataset_name, flops, make_model=None) -> dict:
    """One row's timing of train.py's step on train.py's batches; a row that cannot run here is
    'skipped', one that raises is 'failed' (with the reason): the run goes on either way."""
    entry = {'name': row.name, 'batch_size': row.batch_size, 'settings': asdict(row)}
    if reason := skip_reason(row, device):
        return {**entry, 'skipped': reason}

    def measure():
        row_cfg, row_data = row_train_config(row, bench, device, dataset_name), dataset
        if row.loader == 'ffcv':
            row_data = beton_for(bench, dataset_name, dataset)
            row_cfg = dataclasses.replace(row_cfg, dataset='beton', data_dir=row_data.path)
        with row_settings(row):
            run = build_row_run(row_cfg, bench, device, row_data, make_model or network_of(row), row.compile_scope)
            stream = train.batches(run, 0)
            result = throughput(time_iterations(lambda step: train.train_step(run, next(stream), step), device,
                                                bench, row.name), row_cfg, bench, device, flops)
        if row_cfg.compile and bench.compile_backend != 'inductor':
            result['note'] = f'torch.compile with backend={bench.compile_backend}'
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
                   f"MFU {format_or_na(r['mfu'], '.1%')} ({r['precision']}), {format_or_na(r.get('speedup'), '.2f')}x; "
                   f"first iteration {r['compile_s']:.1f} s")


def add_speedups(rows: list):
    baseline = next((r for r in rows if 'ms_per_iter' in r), None)
    for r in rows:
        if baseline and 'img_per_s' in r:
            r['speedup'] = r['img_per_s'] / baseline['img_per_s']


def image_folder_for(bench, dataset_name: str, dataset) -> str:
    """The benchmark's images as PNG files, what diffusers' example trains from."""
    return written_once(bench, dataset_name, dataset, '-png', 'the diffusers recipe row',
                        functools.partial(write_image_folder, dataset))


def beton_for(bench, dataset_name: str, dataset) -> 'data.BetonDataset':
    """The benchmark's images as a raw-RGB .beton, for the FFCV rows."""
    return data.BetonDataset(written_once(bench, dataset_name, dataset, '.beton', 'the FFCV rows', lambda tmp: (
        data.write_beton(dataset, tmp, num_workers=bench.num_workers or 1))))


def written_once(bench, dataset_name: str, dataset, suffix: str, what: str, write) -> str:
    """DATA_DIR/bench-<set>-<count>x<size><suffix>: the images in another form (files.write_once)."""
    path = os.path.join(bench.data_dir, f'bench-{dataset_name}-{len(dataset)}x{bench.image_size}{suffix}')
    return write_once(path, what, write)


def selected_rows(bench, device: torch.device) -> list:
    """The ladder's rows whose names contain one of --rows' comma-separated parts (all without
    --rows); a part that matches no row is refused, even when another part matches."""
    wanted = [w.strip() for w in bench.rows.split(',') if w.strip()]
    rows = ladder(bench, device)
    unmatched = [w for w in wanted if not any(w.lower() in r.name.lower() for r in rows)]
    if unmatched:
        raise ConfigError(f"--rows: {', '.join(repr(w) for w in unmatched)} matches no row; the rows are: "
                          f"{'; '.join(r.name for r in rows)}")
    return [r for r in rows if not wanted or any(w.lower() in r.name.lower() for w in wanted)]


# The model peer: diffusers' UNet2DModel of the same function under our row's settings (compile,
# precision, layout, fused Adam, data path, batch), its attention its own default (SDPA).
PEER_NAME, PEER_CHANGE = 'diffusers UNet2DModel (settings of our row)', {'network': 'diffusers', 'attention': 'sdpa'}


def sweep_rows(kind: str, best: Row, bench, device: torch.device) -> list:
    """Variants of the best row along one setting."""
    cuda = device.type == 'cuda'
    values = [int(v) for v in bench.sweep_values.split(',') if v.strip()] if bench.sweep_values else None
    if kind == 'batch':
        sizes = values or ([4, 8, 16] if bench.quick else [64, 128, 256, 512, 1024, 2048, 4096])
        return [dataclasses.replace(best, name=f'batch {b}', batch_size=b) for b in sizes]
    if kind == 'workers':
        return [dataclasses.replace(best, name=f'torch loader, {n} workers', loader='torch', num_workers=n)
                for n in values or ([0, 2] if bench.quick else [0, 2, 4, 8])]
    if kind == 'layout':  # NCHW and NHWC alternated twice, so that drift over the run shows as such
        return [dataclasses.replace(best, name=f'{name}{again}', channels_last=nhwc)
                for again in ('', ' again') for name, nhwc in (('NCHW', False), ('channels-last', True))]
    if kind == 'peer':  # our row and diffusers' UNet2DModel under its settings, A B A B (interleaved)
        return [dataclasses.replace(best, name=name + again, **change) for again in ('', ' again')
                for name, change in ((f'ours ({best.name})', {}), (PEER_NAME, PEER_CHANGE))]
    if kind == 'amp':
        return [dataclasses.replace(best, name=f'amp {p}', amp=p) for p in ['off', 'bf16'] + (['fp16'] if cuda else [])]
    modes = ['default'] + (['max-autotune-no-cudagraphs', 'reduce-overhead', 'max-autotune'] if cuda else [])
    return [dataclasses.replace(best, name='eager', compile=False)] + [
        dataclasses.replace(best, name=f'compile {m}', compile=True, compile_mode=m) for m in modes]


def model_config(bench):
    """The preset at --image-size, with the data set's channels (one for digits)."""
    return get_config(bench.preset, image_size=bench.image_size, in_channels=data.channels_of(bench.dataset))


def load_data(bench):
    """CIFAR-10 where it is on disk; otherwise shapes of the same size and shape (the step's
    speed does not depend on what the pixels show); digits when asked for."""
    if bench.dataset == 'digits':
        return 'digits', data.load_dataset('digits', bench.data_dir, bench.image_size)
    if bench.dataset in ('auto', 'cifar10'):
        try:
            return 'cifar10', data.ImageTensorDataset(data.resize_images(
                data.load_cifar10(bench.data_dir, train=True, download=False), bench.image_size))
        except data.DataError:
            if bench.dataset == 'cifar10':
                raise
    return 'shapes', data.ImageTensorDataset(data.make_shapes(bench.num_images, bench.image_size))


# ----------------------------------------------------------------------------- the peers (their code: diffusers_io)

def measure_peer(best: Row, best_result: dict, bench, device, dataset, dataset_name, flops) -> dict:
    """The model peer: diffusers' UNet2DModel under the settings of our fastest row (compile,
    precision, channels-last, fused Adam, data path, batch; its attention its own default, SDPA)."""
    row = dataclasses.replace(best, name='diffusers UNet2DModel (settings of our fastest row)', **PEER_CHANGE)
    if reason := diffusers_missing_reason():
        return {'name': row.name, 'kind': 'model', 'skipped': reason}
    result = {'kind': 'model', **measure_row(row, bench, device, dataset, dataset_name, flops)}
    return beside_ours(result, best, best_result, bench, device, dataset, dataset_name, flops)


def measure_recipe(best: Row, best_result: dict, bench, device, dataset, dataset_name, flops) -> dict:
    """The system peer: what a diffusers user runs to train this network (diffusers_io's RECIPE,
    recipe_step, recipe_loader) on the same images as PNG files, at our fastest row's batch size and
    precision, eager as the example is."""
    name = f'diffusers training recipe (train_unconditional.py loop, {bench.num_workers} workers)'
    entry = {'name': name, 'kind': 'recipe', 'batch_size': best.batch_size, 'settings': {**RECIPE, 'amp': best.amp}}
    if reason := diffusers_missing_reason():
        return {**entry, 'skipped': reason}
    row_cfg = row_train_config(Row(name, best.batch_size, amp=best.amp), bench, device, dataset_name)

    def measure():
        loader = recipe_loader(image_folder_for(bench, dataset_name, dataset), bench.image_size, best.batch_size,
                               bench.num_workers, data.channels_of(dataset_name),
                               flip=data.flipped_in_training(dataset_name))
        torch.manual_seed(bench.seed)
        parts, stream = recipe_parts(model_config(bench), device, len(loader), row_cfg.amp), recipe_batches(loader)
        return throughput(time_iterations(lambda step: recipe_step(parts, next(stream)), device, bench, name),
                          row_cfg, bench, device, flops)
    return beside_ours(measured_or_failed(entry, device, measure), best, best_result, bench, device, dataset,
                       dataset_name, flops)


def beside_ours(result: dict, best: Row, best_result: dict, bench, device, dataset, dataset_name, flops) -> dict:
    """A peer's timing with our fastest row timed again right after it, so that the ratio compares
    two neighbouring timings, not a drift of the GPU's clocks since the start of the ladder."""
    from diffusers import __version__
    result['diffusers'] = __version__
    if 'img_per_s' not in result:
        return result
    again = measure_row(best, bench, device, dataset, dataset_name, flops)
    result.update(ours=best.name, ours_first={k: best_result[k] for k in ('ms_per_iter', 'img_per_s')},
                  ratio_first_timing=best_result['img_per_s'] / result['img_per_s'])
    if 'img_per_s' in again:
        result.update(ours_again={k: again[k] for k in ('ms_per_iter', 'img_per_s')},
                      ratio=again['img_per_s'] / result['img_per_s'])
    return result


# ----------------------------------------------------------------------------- sampling and loaders

def sampling_model(bench, device: torch.device):
    """The preset's UNet, eval mode, in the fastest settings for inference on this device."""
    model = UNet(model_config(bench)).to(device).eval().requires_grad_(False)
    if device.type == 'cuda':
        model = model.to(memory_format=torch.channels_last)
        return (torch.compile(model, mode=bench.sample_compile_mode), 'bf16',
                f'compile {bench.sample_compile_mode}, channels-last')
    return (model, 'fp32', 'eager (--quick)') if bench.quick else (torch.compile(model), 'fp32', 'compile default')


def run_sampling(bench, device: torch.device, flops: dict) -> typing.Iterator[dict]:
    """img/s and MFU of DDIM-50, DPM-Solver++ at 10, 20 and 50 calls and DDPM-1000 on one batch of
    `--sample-batch` images (the first call, which compiles, timed apart), a row as each is done."""
    model, precision, settings = sampling_model(bench, device)
    quick_cpu = bench.quick and device.type == 'cpu'
    ddim_steps, num_steps = (10, 100) if quick_cpu else (50, 1000)  # --quick on a CPU: the wiring, not the speed
    sched = diffusion.make_schedule(num_steps).to(device)
    batch = min(bench.sample_batch, 4) if bench.quick else bench.sample_batch
    shape = (batch, data.channels_of(bench.dataset), bench.image_size, bench.image_size)
    generator, repeats = torch.Generator(device).manual_seed(bench.seed), 1 if bench.quick else 3
    plan = [('ddim', ddim_steps, repeats)] + [('dpm++', calls, repeats) for calls in
                                              ((5, 10) if quick_cpu else (10, 20, 50))] + [('ddpm', num_steps, 1)]
    for name, steps, repeats in plan:
        label = f"{({'ddim': 'DDIM', 'dpm++': 'DPM-Solver++', 'ddpm': 'DDPM'})[name]}-{steps}"
        print(f'sampling: {label} ...', flush=True)
        draw = functools.partial(diffusion.run_sampler, name, model, sched, shape, steps, generator, device)
        try:
            with autocast('bf16' if precision == 'bf16' else 'off', device):
                timing = time_iterations(lambda step: draw(), device,
                                         dataclasses.replace(bench, warmup=0, iters=repeats), label)
            first, seconds = timing['compile_s'], timing['ms_per_iter'] / 1e3
        except Exception as error:  # a sampler that fails here is reported, not fatal to the table
            yield {'name': label, 'error': brief(error, 300)}
            continue
        tflops, peak = batch * steps * flops['forward'] / seconds / 1e12, peak_for(precision, device, bench)
        yield {'name': label, 'steps': steps, 'batch_size': batch, 'precision': precision, 'settings': settings,
               'seconds_per_batch': seconds, 'first_call_s': first, 'img_per_s': batch / seconds, 'tflops': tflops,
               'mfu': tflops / peak if peak else None, 'seconds_for_50k': 50000 / (batch / seconds),
               'timed_calls': repeats}
    release(device)


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

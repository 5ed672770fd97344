"""The speedup table: one row per optimisation, each adding its change to the row above.

One mode per run; each writes STEM.json and STEM.md under --out-dir, and STEM.png where it draws:

    python benchmark.py                  ladder    every row: ms/iter, img/s, TFLOP/s, MFU; the diffusers peers
                                                   beside our fastest row (its UNet in our loop, its training
                                                   recipe); then sampling speed
    python benchmark.py --profile        profile   torch.profiler of the fastest row: a trace, top kernels
    python benchmark.py --roofline       roofline  one step counted op by op and bounded on a GPU (--profile:
                                                   beside a profile of it; on a CPU, against its measured peaks)
    python benchmark.py --sweep batch    sweep     one setting (batch|workers|amp|compile|layout|peer) around that
                                                   row; peer: that row and diffusers' UNet2DModel, A B A B
    python benchmark.py --side-by-side   profile   that row's step profiled for our UNet and diffusers' UNet2DModel
                                                   in one process: by kernel category and by module, beside bounds
    python benchmark.py --loader-only    loaders   images/s each data path delivers vs the step's consumption
    python benchmark.py --quality        quality   held-out loss after N steps: baseline vs all speed-ups
    python benchmark.py --sampling-only  sampling  DDIM-50, DPM-Solver++, DDPM-1000: img/s, MFU, time for 50k

On a GPU the preset is the paper's; on a CPU it is `tiny` (what a CPU can time in minutes), with
fewer iterations; `--quick` is the smoke run the tests use. An iteration is what train.py runs
per step: data, forward, backward, gradient clipping, Adam step and EMA update. Times are the
median over many iterations after warm-up, from a chain of CUDA events (so that host stalls, such
as waiting for data, are counted). Compilation is timed separately and kept out of the throughput.
"""
import dataclasses
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

import data
import diffusion
import drawing
import evaluation
import loaders
import profiling
import roofline
import train
from cli import (ConfigError, brief, changed_fields, check_plain_name, check_ranges, flag, flag_name, parse_config,
                 refused_as, run_main)
from devices import device_name, device_slug, pick_device, precision_of
from files import check_writable
from model import PRESETS, UNet, count_flops, count_params, count_torchinfo_flops
from peers import DiffusersUNet, diffusers_missing_reason
from reports import bar_chart, format_or_na, markdown_table, provenance, write_report
from timing import (Row, add_speedups, beton_for, build_row_run, load_data, measure_peer, measure_recipe, measure_row,
                    model_config, network_of, release, row_line, row_settings, row_train_config, run_sampling,
                    selected_rows, start_row, sweep_rows, time_loader)
from train_config import COMPILE_MODES


@dataclass
class BenchConfig:
    preset: str | None = flag(None, 'UNet preset (default: ddpm-cifar10 on a GPU, tiny on a CPU; small is the ~9M '
                                    'UNet of the reference table)', choices=tuple(PRESETS))
    image_size: int = flag(32, 'image resolution', at_least=1)
    dataset: str = flag('auto', 'auto (cifar10 if on disk, else shapes), cifar10, shapes or digits (one channel; '
                                '--quality then also compares the digits score)',
                        choices=('auto', 'cifar10', 'shapes', 'digits'))
    data_dir: str = flag('./data', 'where CIFAR-10 is looked for; the FFCV rows and the recipe peer write their copies '
                                   'of the images there once (a .beton file, a folder of PNG files)')
    num_images: int = flag(50000, 'images in the shapes set (CIFAR-10 has 50000)', at_least=1)
    device: str = flag('auto', 'auto, cpu, cuda or cuda:N')
    batch_size: int = flag(128, 'batch size of the baseline row (the paper\'s)', at_least=1)
    big_batch: int = flag(512, 'batch size from the "scale up batch size" row on', at_least=1)
    amp_dtype: str = flag('bf16', 'precision of the mixed-precision rows', choices=('bf16', 'fp16'))
    num_workers: int = flag(4, 'DataLoader workers of the torch-loader rows', at_least=0)
    warmup: int | None = flag(None, 'untimed iterations after the first (compiling) one (default: 10; 3 on a CPU)',
                              at_least=0)
    iters: int | None = flag(None, 'timed iterations per row, the median reported (default: 50; 10 on a CPU)',
                             at_least=1)
    rows: str = flag('', 'comma-separated substrings: run only the rows whose names contain one')
    from_row: str = flag('', 'the ladder row that --profile, --quality, --loader-only, --sweep, --sampling-only and '
                             '--roofline start from (a substring of its name; default: the fastest row in the default '
                             'compile mode, which is what train.py runs)')
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
    profile: bool = flag(False, 'profile the start row\'s step (--from-row): a Chrome/Perfetto trace, the top ops, and '
                                'each category\'s time beside its bound on this device (see --roofline)')
    sweep: str = flag('', 'sweep one setting around the start row (see --from-row), with a plot; peer: the start '
                          'row and diffusers\' UNet2DModel under its settings, alternated A B A B, and their ratio',
                      choices=('', 'batch', 'workers', 'amp', 'compile', 'layout', 'peer'))
    sweep_values: str = flag('', 'comma-separated batch sizes or worker counts for --sweep batch|workers '
                                 '(default: 64 to 4096, or 0 2 4 8 workers)')
    side_by_side: bool = flag(False, 'profile the start row\'s step (--from-row; at --big-batch and --precision) for '
                                     'our UNet and then diffusers\' UNet2DModel under the same settings, in one '
                                     'process: ms per step by kernel category (the step as it runs) and by module '
                                     '(the same step run eagerly), each beside its bound counted op by op')
    loader_only: bool = flag(False, 'images/s that each data path delivers, beside the step\'s consumption')
    sampling: bool = flag(True, 'after the ladder, time the samplers: DDIM-50, DPM-Solver++ at 10, 20, 50 calls and '
                                'DDPM-1000 (their own table)')
    sampling_only: bool = flag(False, 'time only the samplers, no training rows')
    sample_batch: int | None = flag(None, 'images per sampling batch (default: 1000; 64 on a CPU)', at_least=1)
    sample_compile_mode: str = flag('reduce-overhead', 'torch.compile mode for sampling on CUDA (CUDA graphs)',
                                    choices=COMPILE_MODES)
    quality: bool = flag(False, 'the equivalence check: train --steps under the baseline and under all the '
                                'speed-ups (same seed, data, batch) and compare held-out losses')
    steps: int = flag(2000, 'training steps of each --quality run', at_least=1)
    roofline: bool = flag(False, 'the physical limit: one step of the start row (--from-row) at --big-batch and '
                                 '--precision counted op by op and bounded on --gpu; with --profile, beside a profile '
                                 'of it (on a CPU, against its measured peaks)')
    gpu: str = flag('', 'the GPU of the --roofline bound (default: this one, else h100-sxm; others through the '
                        'peak flags)', choices=('', 'h100-sxm', 'h200', 'a100-40gb', 'a100-80gb'))
    precision: str | None = flag(None, 'precision of the --roofline and --profile step (default: bf16 autocast; fp32 '
                                       'for --profile on a CPU)', choices=('bf16', 'fp32'))
    bandwidth_gbs: float | None = flag(None, 'memory bandwidth in GB/s of the --roofline GPU (overrides the table)',
                                       positive=True)
    out_dir: str = flag('', 'where the JSON, Markdown and PNG go (default: results/ on a GPU, runs/benchmark/ on '
                            'a CPU, so that smoke runs stay out of the committed results)')
    seed: int = flag(0, 'seed', at_least=0, at_most=2 ** 32 - 1)


def resolve(bench: BenchConfig, device: torch.device) -> BenchConfig:
    """The defaults that depend on the device (the paper's model, 50 timed iterations, sampling
    batches of 1000 on a GPU; tiny, 10 and 64 on a CPU, where a step of the paper's model takes
    seconds, but the paper's model for a GPU's --roofline bound; the compile backend), then
    --quick's cuts; TF32 as --tf32 says."""
    cuda = device.type == 'cuda'
    default = (lambda on_gpu, on_cpu: on_gpu if cuda else on_cpu)  # noqa: E731
    bench = dataclasses.replace(
        bench, preset=bench.preset or ('ddpm-cifar10' if cuda or bench.roofline and not bench.profile else 'tiny'),
        iters=bench.iters or default(50, 10),
        warmup=default(10, 3) if bench.warmup is None else bench.warmup,
        precision=bench.precision or ('fp32' if (bench.profile or bench.side_by_side) and not cuda else 'bf16'),
        sample_batch=bench.sample_batch or default(1000, 64), compile_backend=(
            bench.compile_backend if bench.compile_backend != 'auto' else 'eager' if bench.quick and not cuda
            else 'inductor'))
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = bench.tf32
    if bench.quick:
        bench = dataclasses.replace(bench, warmup=0, iters=min(bench.iters, 2), batch_size=min(bench.batch_size, 4),
                                    big_batch=min(bench.big_batch, 8), num_images=min(bench.num_images, 256),
                                    num_workers=min(bench.num_workers, 2),
                                    image_size=bench.image_size if cuda else min(bench.image_size, 16))
    return bench


# ----------------------------------------------------------------------------- outputs

def header(bench: BenchConfig, device: torch.device, flops: dict, dataset_name: str) -> dict:
    return {**provenance(device_name(device)), 'cuda': torch.version.cuda if device.type == 'cuda' else None,
            'preset': bench.preset, 'image_size': bench.image_size, 'dataset': dataset_name,
            'tf32_convs': torch.backends.cudnn.allow_tf32, 'tf32_matmul': torch.backends.cuda.matmul.allow_tf32,
            'flops_per_image': flops, 'config': asdict(bench)}


def output_stem(bench: BenchConfig, device: torch.device, mode: str = '') -> str:
    return bench.stem or f"{device_slug(device)}-{bench.preset}{'-' + mode if mode else ''}"


def ladder_table(rows: list) -> str:
    def cells(r):
        if 'skipped' in r or 'failed' in r:
            return [r['name'], r.get('batch_size', ''), f"skipped: {r['skipped']}" if 'skipped' in r
                    else f"FAILED: {r['failed']}"] + [''] * 7
        return [r['name'], r['batch_size'], {'tf32': 'fp32 (TF32 allowed)'}.get(r['precision'], r['precision']),
                f"{r['ms_per_iter']:.2f}", f"{r['img_per_s']:,.0f}", f"{r['tflops']:.2f}",
                format_or_na(r['mfu'], '.1%'),
                f"{r['mfu_a100']:.1%}", format_or_na(r.get('speedup'), '.2f') + ('x' if r.get('speedup') else ''),
                format_or_na(r['peak_mem_gb'], '.2f')]
    return markdown_table(['Version', 'Batch', 'Precision', 'ms/iter', 'img/s', 'TFLOP/s', 'MFU', 'MFU (A100 peak)',
                           'Speedup', 'Peak mem (GB)'], [cells(r) for r in rows])


def summary_lines(meta: dict, peers: list) -> str:
    flops = meta['flops_per_image']
    lines = [f"{meta['preset']} at {meta['image_size']}x{meta['image_size']}. FLOPs per image, forward+backward: "
             f"{flops['train'] / 1e9:.2f} GFLOP ({flops['method']}); torchinfo MACs x 2 x 3: "
             f"{flops['torchinfo_train'] / 1e9:.2f} GFLOP (the reference table's method, no attention). TFLOP/s and "
             f"MFU below use the first."]
    what = {'model': 'UNet2DModel (the same function) under the same settings',
            'recipe': 'training recipe (its loop and data path from PNG files, eager; the same network, images, '
                      'batch size and precision)'}
    for peer in [p for p in peers if p.get('ratio')]:
        lines.append(f"Our fastest row ({peer['ours']}), timed again right after the {peer['kind']} peer: "
                     f"{peer['ours_again']['img_per_s']:,.0f} img/s, {peer['ratio']:.2f}x the "
                     f"{peer['img_per_s']:,.0f} img/s of diffusers {peer.get('diffusers', '')} {what[peer['kind']]} "
                     f"(first timing of our row: {peer['ratio_first_timing']:.2f}x).")
    return '\n'.join(lines)


def write_ladder(stem: str, meta: dict, rows: list, peers: dict, bench: BenchConfig, final: bool = True) -> dict:
    """The ladder's report, rewritten after every row (final=False: quietly, with 'complete':
    false in the JSON), so that a run killed at a time limit keeps its rows; the chart and the
    printed table at the end. peers: {'peer': the model peer, 'recipe': the system peer}."""
    result = {**meta, 'complete': final, 'rows': rows, 'peer': peers.get('peer'), 'recipe': peers.get('recipe')}
    measured_peers = [p for p in (peers.get('peer'), peers.get('recipe')) if p]
    table = ladder_table(rows + measured_peers)
    if meta.get('sampling'):
        table += '\n\nSampling (one batch; FLOPs = steps x forward FLOPs per image):\n\n' + sampling_table(
            meta['sampling'])
    status = '' if final else '\n\n(incomplete: the run was still going, or was stopped, when this was written)'
    png = write_report(bench.out_dir, stem, result, f"Training speed: {meta['preset']} on {meta['device']}",
                       table + status, notes='\n\n' + summary_lines(meta, measured_peers))
    if final:  # the chart once, at the end (matplotlib costs about a second)
        shown = [r for r in rows + measured_peers if 'img_per_s' in r]
        bar_chart(png, [r['name'] for r in shown], [r['img_per_s'] for r in shown],
                  f"{meta['preset']} training, {meta['device']}, torch {meta['torch']}",
                  'training images per second (higher is better)', ['tab:gray' if 'kind' in r else 'tab:blue'
                                                                     for r in shown],
                  [f" {r['img_per_s']:,.0f} img/s" + (f"  ({r['speedup']:.2f}x)" if r.get('speedup') else '')
                   for r in shown])
        print(table, summary_lines(meta, measured_peers), f'wrote {png[:-4]}.json, .md and .png', sep='\n')
    return result


# ----------------------------------------------------------------------------- the ladder

def prepare(bench: BenchConfig, need_data: bool = True):
    """(the bench config resolved for the device, the device, the data set's name, the data set, the
    FLOP counts). fp32 rows run true fp32 unless --tf32: TF32 convolutions (PyTorch's default) are 8x
    the fp32 peak, and would make the fp32 rows' MFU against 19.5 TFLOP/s read several hundred %."""
    device = pick_device(bench.device)
    bench = resolve(bench, device)
    dataset_name, dataset = load_data(bench) if need_data else ('none', None)
    config = model_config(bench)
    flops, torchinfo = count_flops(config, bench.image_size), count_torchinfo_flops(config, bench.image_size)
    flops.update(torchinfo_forward=torchinfo['forward'], torchinfo_train=torchinfo['train'],
                 torchinfo_method=torchinfo['method'], params=count_params(UNet(config)))
    return bench, device, dataset_name, dataset, flops


def run_ladder(bench: BenchConfig) -> dict:
    """The ladder, one row at a time; the report is rewritten after every row, the peer and
    each sampler, and a row that fails is reported as failed while the others go on."""
    device = pick_device(bench.device)
    plan = resolve(bench, device)
    rows = selected_rows(plan, device)
    print(f"ladder: {len(rows)} rows of {plan.preset} at {plan.image_size}x{plan.image_size} on {device_name(device)}"
          f", batch {plan.batch_size} then {plan.big_batch}, each 1 + {plan.warmup} + {plan.iters} iterations"
          + ("; then the two diffusers peers and our fastest row again after each" if plan.peer else '')
          + (f"; then sampling speed (5 samplers, batches of {plan.sample_batch})" if plan.sampling else '')
          + ('. Compiled rows first build their kernels: minutes each on a CPU' if device.type == 'cpu' else '')
          + '. Loading the data and counting FLOPs first ...', flush=True)
    bench, device, dataset_name, dataset, flops = prepare(bench)
    meta = {**header(bench, device, flops, dataset_name), 'rows_planned': [row.name for row in rows]}
    stem, results, peers, start = output_stem(bench, device), [], {}, time.perf_counter()
    for index, row in enumerate(rows, 1):
        print(f'[{index}/{len(rows)}] {row.name} ...', flush=True)
        results.append(measure_row(row, bench, device, dataset, dataset_name, flops))
        add_speedups(results)
        print(row_line(index, len(rows), results[-1]) + f'; {(time.perf_counter() - start) / 60:.1f} min so far',
              flush=True)
        write_ladder(stem, meta, results, peers, bench, final=False)
    measured = [(row, r) for row, r in zip(rows, results) if 'img_per_s' in r]
    if bench.peer and measured:
        fastest = max(measured, key=lambda pair: pair[1]['img_per_s'])
        for key, measure, what in (('peer', measure_peer, 'diffusers UNet2DModel'),
                                   ('recipe', measure_recipe, "diffusers' training recipe")):
            print(f'peer: {what}, then our fastest row again ...', flush=True)
            peers[key] = measure(fastest[0], fastest[1], bench, device, dataset, dataset_name, flops)
            add_speedups([results[0], peers[key]])
            print(row_line(len(rows) + len(peers), len(rows) + 2, peers[key]), flush=True)
            write_ladder(stem, meta, results, peers, bench, final=False)
    if bench.sampling:
        meta['sampling'] = []
        for sampler_row in run_sampling(bench, device, flops):
            meta['sampling'].append(sampler_row)
            write_ladder(stem, meta, results, peers, bench, final=False)
    return write_ladder(stem, meta, results, peers, bench)


# ----------------------------------------------------------------------------- sampling speed

def run_sampling_only(bench: BenchConfig) -> dict:
    bench, device, dataset_name, _, flops = prepare(bench, need_data=False)
    meta, rows = header(bench, device, flops, dataset_name), []

    def report(final: bool) -> dict:
        result = {**meta, 'complete': final, 'sampling': rows}
        write_report(bench.out_dir, output_stem(bench, device, 'sampling'), result,
                     f"Sampling speed: {meta['preset']} on {meta['device']}", sampling_table(rows))
        return result
    for row in run_sampling(bench, device, flops):
        rows.append(row)
        report(final=False)
    print(sampling_table(rows))
    return report(final=True)


def sampling_table(rows: list) -> str:
    return markdown_table(['Sampler', 'Batch', 'Precision', 'Settings', 's/batch', 'img/s', 'TFLOP/s', 'MFU',
                           '50k images'],
                          [[r['name'], '', f"failed: {r['error']}"] + [''] * 6 if 'error' in r else
                           [r['name'], r['batch_size'], r['precision'], r['settings'], f"{r['seconds_per_batch']:.3f}",
                            f"{r['img_per_s']:,.1f}", f"{r['tflops']:.2f}", format_or_na(r['mfu'], '.1%'),
                            f"{r['seconds_for_50k'] / 60:.1f} min"] for r in rows])


# ----------------------------------------------------------------------------- quality

def train_for_quality(row: Row, bench: BenchConfig, device, dataset, dataset_name, seed: int) -> dict:
    """Trains `bench.steps` steps under a row's settings; held-out losses of the model and the EMA
    (and on digits the digits score of 450 EMA samples), evaluated the same way for every row: fp32,
    eager, on the same images, timesteps and noise."""
    row_cfg = dataclasses.replace(row_train_config(row, bench, device, dataset_name), seed=seed)
    with row_settings(row):
        run = build_row_run(row_cfg, bench, device, dataset, network_of(row), row.compile_scope)
        start, stream, loss_sum = time.perf_counter(), train.batches(run, 0), torch.zeros((), device=device)
        for step in tqdm(range(bench.steps), desc=f'  {row.name[:40]}', leave=False):
            loss_sum += train.train_step(run, next(stream), step)
    train_loss, seconds = loss_sum.item() / bench.steps, time.perf_counter() - start
    eval_cfg = dataclasses.replace(row_cfg, amp='off', channels_last=False)
    heldout = evaluation.make_heldout(eval_cfg, device, run.sched.num_steps)
    losses = {name: evaluation.heldout_losses(module, run.sched, heldout, eval_cfg, device)
              for name, module in (('model', run.model), ('ema', run.ema))}
    result = {'name': row.name, 'seed': seed, 'settings': asdict(row), 'precision': precision_of(row_cfg.amp, device),
              'train_loss': train_loss, 'seconds': seconds, 'losses': losses,
              'heldout_loss': losses['model'].mean().item(), 'heldout_loss_ema': losses['ema'].mean().item()}
    if dataset_name == 'digits':  # DPM-Solver++ at 20 calls, from the seed's noise
        judge = evaluation.DigitsJudge(bench.image_size, bench.data_dir)
        with torch.no_grad():
            x = diffusion.run_sampler('dpm++', run.ema, run.sched, (450, 1, bench.image_size, bench.image_size), 20,
                                      torch.Generator(device).manual_seed(seed), device)
        result.update(judge.score(judge.features(drawing.to_uint8(x).cpu())))
    release(device)
    return result


def compare(run: dict, baseline: dict, weights: str) -> dict:
    """Relative difference of held-out losses, with the paired standard error of the difference
    (same images, timesteps and noise in both), so that evaluation noise is accounted for."""
    diff, base = run['losses'][weights] - baseline['losses'][weights], baseline['losses'][weights].mean().item()
    return {'relative_difference': diff.mean().item() / base,
            'paired_stderr_relative': (diff.std() / len(diff) ** 0.5).item() / base}


def run_quality(bench: BenchConfig) -> dict:
    bench, device, dataset_name, dataset, flops = prepare(bench)
    bench = dataclasses.replace(bench, steps=min(bench.steps, 20)) if bench.quick else bench
    baseline = Row('Baseline (fp32, eager, manual attention, DataLoader)', bench.batch_size)
    fast = dataclasses.replace(start_row(bench, device), name='All speed-ups', batch_size=bench.batch_size)
    runs = []
    for row, seed in [(baseline, bench.seed), (fast, bench.seed), (baseline, bench.seed + 1)]:
        print(f'quality: {row.name}, seed {seed}, {bench.steps} steps ...', flush=True)
        runs.append(train_for_quality(row, bench, device, dataset, dataset_name, seed))
    base, fast_run, other_seed = runs
    comparison = {weights: {'all_speedups': compare(fast_run, base, weights),
                            'baseline_other_seed': compare(other_seed, base, weights)} for weights in ('model', 'ema')}
    # Agreement: the speed-ups move the held-out loss no more than changing the seed does, or than
    # two paired standard errors of the evaluation.
    agree = {w: abs(c['all_speedups']['relative_difference']) <= max(
        abs(c['baseline_other_seed']['relative_difference']), 2 * c['all_speedups']['paired_stderr_relative'])
        for w, c in comparison.items()}
    result = {**header(bench, device, flops, dataset_name), 'steps': bench.steps, 'batch_size': bench.batch_size,
              'runs': [{k: v for k, v in r.items() if k != 'losses'} for r in runs], 'comparison': comparison,
              'agree_within_noise': agree}
    digits = 'digits_fd' in result['runs'][0]
    table = markdown_table(['Run', 'Seed', 'Precision', 'train loss', 'held-out loss', 'held-out loss (EMA)'] + (
        ['digits FD (EMA)'] if digits else []) + ['time (s)'], [
        [r['name'], r['seed'], r['precision'], f"{r['train_loss']:.5f}", f"{r['heldout_loss']:.5f}",
         f"{r['heldout_loss_ema']:.5f}"] + ([f"{r['digits_fd']:.2f}"] if digits else []) + [f"{r['seconds']:.1f}"]
        for r in result['runs']]) + '\n\n' + markdown_table(
        ['Weights', 'speed-ups vs baseline', 'paired s.e.', 'other seed vs baseline', 'agree within noise'], [
            [w, f"{c['all_speedups']['relative_difference']:+.2%}",
             f"{c['all_speedups']['paired_stderr_relative']:.2%}",
             f"{c['baseline_other_seed']['relative_difference']:+.2%}", agree[w]] for w, c in comparison.items()])
    write_report(bench.out_dir, bench.stem or f'quality-{device_slug(device)}-{bench.preset}', result,
                 f"Quality: {bench.preset} on {dataset_name}, {bench.steps} steps of batch {bench.batch_size} on "
                 f"{result['device']}", table, notes=f"; held-out loss on {train.TrainConfig.heldout_size} fixed "
                                                     f"images, timesteps and noise, evaluated in fp32" +
                 ('; digits FD: 450 EMA samples of DPM-Solver++ at 20 calls in the digit classifier\'s features '
                  '(floor about 7)' if digits else '') + '.')
    print(table)
    return result


# ----------------------------------------------------------------------------- the physical limit

def roofline_step(bench: BenchConfig, device: torch.device) -> tuple:
    """(row, train config): the start row at --big-batch and --precision, eager off CUDA."""
    row = start_row(bench, device)
    row = dataclasses.replace(row, batch_size=bench.big_batch, amp={'fp32': 'off'}.get(bench.precision, 'bf16'),
                              compile=row.compile and device.type == 'cuda')
    return row, row_train_config(row, bench, device, 'digits' if bench.dataset == 'digits' else 'shapes')


def run_roofline(bench: BenchConfig) -> dict:
    """--roofline: the start row's step at --big-batch and --precision, counted (roofline.count_step)
    and bounded on a GPU (roofline.bounds). --profile: the same step also run and profiled here (a
    trace, the top ops), each category's time beside its bound on this device: a GPU's from its
    data sheet, a CPU's from its peaks measured now (the step run eagerly, a profile of aten ops)."""
    device = pick_device(bench.device)
    bench, target = resolve(bench, device), roofline.target(bench, device)
    counted_on = device if bench.profile else torch.device('cuda')  # the GPU's step, wherever it is counted
    row, cfg = roofline_step(bench, counted_on)
    print(f'counting a step: {bench.preset}, {row.name}, {bench.precision}, batch {cfg.batch_size}', flush=True)
    ops = roofline.count_step(cfg, cuda=counted_on.type == 'cuda')
    target = target or roofline.cpu_peaks(bench.quick, {'fp32': torch.float32}.get(bench.precision, torch.bfloat16))
    bounds = roofline.bounds(ops, cfg.batch_size, target['peak_tflops'], target['bandwidth_gbs'])
    flops = {'train': 1e9 * bounds['total']['gflop_per_image'], 'method': "FlopCounterMode's formulas, op by op"}
    precision = ('tf32' if bench.tf32 else 'fp32') if bench.precision == 'fp32' else bench.precision
    result = {**header(bench, device, flops, cfg.dataset), 'target': target, 'row': row.name, 'settings': asdict(row),
              'precision': precision, 'batch_size': cfg.batch_size, 'ops_counted': len(ops), **bounds}
    named = '' if precision == ('fp32' if target['slug'] == 'cpu' else 'bf16') else '-' + precision  # not the default
    quick = '-quick' if bench.quick else ''  # a smoke run's small bound never takes a committed result's name
    stem = bench.stem or (f"{target['slug']}-{bench.preset}-roofline{named}{quick}" if bench.roofline
                          else output_stem(bench, device, 'profile' + quick))
    if bench.profile:
        print(f'profiling the same step on {device_name(device)} ...', flush=True)
        channels = data.channels_of(cfg.dataset)  # what the pixels show does not change the step's time
        images = data.ImageTensorDataset(data.make_shapes(4 * cfg.batch_size, cfg.image_size)[:, :channels])
        trace = os.path.join(bench.out_dir, 'traces', f'{stem}.json')
        with row_settings(row):
            prof, active = profiling.profile_steps(build_row_run(cfg, bench, device, images, network_of(row),
                                                                 row.compile_scope), bench.quick, trace)
        ops = profiling.profile_rows(prof, device, active)
        result['cases']['measured'] = roofline.add_measured(bounds, ops, cfg.batch_size)
        result.update(measured_against='fused' if row.compile else 'eager', trace=trace, active_iterations=active,
                      top_ops=ops[:40])
    roofline.write(result, bench.out_dir, stem)
    return result


def run_side_by_side(bench: BenchConfig) -> dict:
    """--side-by-side: the start row's step (roofline_step's) for our UNet, then for diffusers'
    UNet2DModel of the same function under the same settings, in one process: each counted op by op
    (its bounds, per category and per module group) and profiled as it runs (compiled on CUDA: per
    kernel category) and eagerly with module scopes (per module group; on a CPU the step is eager and
    one profile gives both). The peer failing costs its half, not ours."""
    device = pick_device(bench.device)
    bench = resolve(bench, device)
    row, cfg = roofline_step(bench, device)
    target = roofline.target(dataclasses.replace(bench, profile=True), device) or roofline.cpu_peaks(
        bench.quick, {'fp32': torch.float32}.get(bench.precision, torch.bfloat16))
    tflops, gbs = target['peak_tflops'], target['bandwidth_gbs']
    channels = data.channels_of(cfg.dataset)  # what the pixels show does not change the step's time
    images = data.ImageTensorDataset(data.make_shapes(4 * cfg.batch_size, cfg.image_size)[:, :channels])
    stem = bench.stem or output_stem(bench, device, 'profile-side-by-side' + ('-quick' if bench.quick else ''))
    networks, active = {}, None

    def profiled(make_model, compiled: bool, trace: str = None) -> tuple:
        run_cfg = cfg if compiled else dataclasses.replace(cfg, compile=False)
        with row_settings(row):
            run = build_row_run(run_cfg, bench, device, images, make_model, row.compile_scope)
            scopes = None if compiled else profiling.ModuleScopes(record=True)  # hooks would enter the graph
            prof, steps = profiling.profile_steps(run, bench.quick, trace, scopes)
        ops = profiling.profile_rows(prof, device, steps)
        categories = profiling.by_category(ops)
        part = {'compiled': compiled, 'ms_per_step': sum(categories.values()), 'categories': categories,
                'top_ops': ops[:20]}
        part['img_per_s'] = 1e3 * cfg.batch_size / part['ms_per_step']
        if scopes:
            part['modules'] = profiling.module_times(prof, device, steps)
        release(device)
        return part, steps
    for key, make_model in (('ours', None), ('diffusers', DiffusersUNet)):
        entry = networks[key] = {'name': 'UNet (model.py)' if key == 'ours' else 'UNet2DModel (diffusers)'}
        if key == 'diffusers' and (reason := diffusers_missing_reason()):
            entry['error'] = reason
            continue
        print(f"side by side: {key}: counting the step, then profiling it on {device_name(device)} ...", flush=True)
        try:
            if key == 'diffusers':
                from diffusers import __version__
                entry['name'] = f'UNet2DModel (diffusers {__version__})'
            ops = roofline.count_step(cfg, cuda=device.type == 'cuda', make_model=make_model,
                                      scopes=profiling.ModuleScopes())
            entry['bounds'] = {**roofline.bounds(ops, cfg.batch_size, tflops, gbs),
                               'modules': profiling.module_bounds(ops, tflops, gbs)}
            trace = os.path.join(bench.out_dir, 'traces', f'{stem}-{key}.json')
            entry['shipped'], active = profiled(make_model, cfg.compile, trace)
            entry['eager'] = entry['shipped'] if not cfg.compile else profiled(make_model, False)[0]
        except Exception as error:  # noqa: BLE001 (a network that fails here is reported beside the other)
            if key == 'ours':
                raise
            entry['error'] = brief(error, 300)
            release(device)
    total = networks['ours']['bounds']['total']
    flops = {'train': 1e9 * total['gflop_per_image'], 'method': "FlopCounterMode's formulas, op by op"}
    result = {**header(bench, device, flops, cfg.dataset), 'target': target, 'row': row.name,
              'settings': asdict(row), 'precision': bench.precision, 'batch_size': cfg.batch_size,
              'compiled': cfg.compile, 'active_iterations': active, 'networks': networks}
    profiling.write_side_by_side(result, bench.out_dir, stem)
    return result


# ----------------------------------------------------------------------------- sweeps and data paths

def peer_comparison(rows: list) -> dict | None:
    """--sweep peer: our row's and the peer's img/s in each round (A B A B), the mean of each one's two
    medians, their ratio (the target: >= 1.15), and each round's ratio."""
    ours, peer = ([r['img_per_s'] for r in rows if r['settings']['network'] == network and 'img_per_s' in r]
                  for network in ('ours', 'diffusers'))
    if not ours or not peer:
        return None
    return {'ours_img_per_s': ours, 'peer_img_per_s': peer, 'ours_mean_img_per_s': sum(ours) / len(ours),
            'peer_mean_img_per_s': sum(peer) / len(peer), 'ratio': (sum(ours) / len(ours)) / (sum(peer) / len(peer)),
            'ratio_per_round': [o / p for o, p in zip(ours, peer)], 'target_ratio': 1.15}


def write_sweep(stem: str, meta: dict, rows: list, bench: BenchConfig, final: bool = True) -> dict:
    """The sweep's report, rewritten after every row (final=False: 'complete': false), as the ladder's;
    the chart and the printed table at the end."""
    result, table = {**meta, 'complete': final, 'rows': rows}, ladder_table(rows)
    notes = ''
    if meta['sweep'] == 'peer' and (comparison := peer_comparison(rows)):
        result['comparison'] = comparison
        notes = (f"\n\nOurs ('{meta['base_row']}') {comparison['ours_mean_img_per_s']:,.0f} img/s, diffusers' "
                 f"UNet2DModel under its settings {comparison['peer_mean_img_per_s']:,.0f} img/s (each the mean of "
                 f"its rounds' medians, alternated A B A B in one process): ours {comparison['ratio']:.3f}x (rounds: "
                 f"{', '.join(f'{r:.3f}x' for r in comparison['ratio_per_round'])}; the target is >= 1.15x).")
    status = '' if final else '\n\n(incomplete: the run was still going, or was stopped, when this was written)'
    png = write_report(bench.out_dir, stem, result, f"Sweep of {meta['sweep']} around '{meta['base_row']}': "
                       f"{meta['preset']} on {meta['device']}", table + status, notes=notes)
    if final:
        measured = [r for r in rows if 'img_per_s' in r]
        bar_chart(png, [r['name'] for r in measured], [r['img_per_s'] for r in measured],
                  f"{meta['preset']}: sweep of {meta['sweep']}, {meta['device']}, torch {meta['torch']}",
                  'training images per second (higher is better)', texts=[
                      f" {r['img_per_s']:,.0f} img/s, MFU {format_or_na(r['mfu'], '.1%')}" for r in measured])
        print(table + notes)
    return result


def run_sweep(bench: BenchConfig) -> dict:
    bench, device, dataset_name, dataset, flops = prepare(bench)
    best, results = start_row(bench, device), []
    rows = sweep_rows(bench.sweep, best, bench, device)
    meta = {**header(bench, device, flops, dataset_name), 'sweep': bench.sweep, 'base_row': best.name,
            'rows_planned': [row.name for row in rows]}
    stem = output_stem(bench, device, f'sweep-{bench.sweep}')
    for index, row in enumerate(rows, 1):
        print(f'[{index}/{len(rows)}] {row.name} ...', flush=True)
        results.append(measure_row(row, bench, device, dataset, dataset_name, flops))
        add_speedups(results)  # relative to the sweep's first point
        print(row_line(index, len(rows), results[-1]), flush=True)
        write_sweep(stem, meta, results, bench, final=False)
    return write_sweep(stem, meta, results, bench)


def run_loader_only(bench: BenchConfig) -> dict:
    bench, device, dataset_name, dataset, flops = prepare(bench)
    best = start_row(bench, device)
    batch, num_batches, results = best.batch_size, (5 if bench.quick else 100), []
    for kind, workers in [('torch', n) for n in ([0, 2] if bench.quick else [0, 2, 4, 8])] + [('gpu', 0), ('ffcv', 0)]:
        name = {'torch': f'torch DataLoader, {workers} workers', 'gpu': 'gpu (device-resident)', 'ffcv': 'FFCV'}[kind]
        print(f'{name} ...', flush=True)
        if kind == 'ffcv' and data.ffcv_missing_reason():
            results.append({'name': name, 'skipped': data.ffcv_missing_reason()})
            continue
        workers = bench.num_workers if kind == 'ffcv' else workers
        source = beton_for(bench, dataset_name, dataset) if kind == 'ffcv' else dataset
        loader = loaders.make_loader(kind, source, batch, bench.seed, device, workers, progress=False)
        results.append({'name': f'FFCV ({loader.num_workers} threads)' if kind == 'ffcv' else name, 'loader': kind,
                        'num_workers': workers, 'img_per_s': time_loader(loader, num_batches, device)})
        del loader
    step = measure_row(best, bench, device, dataset, dataset_name, flops).get('img_per_s')
    result = {**header(bench, device, flops, dataset_name), 'batch_size': batch, 'step_row': best.name,
              'step_img_per_s': step, 'loaders': results}
    table = markdown_table(['Loader', 'img/s', 'x the step\'s consumption'], [
        [r['name'], f"skipped: {r['skipped']}", ''] if 'skipped' in r else
        [r['name'], f"{r['img_per_s']:,.0f}", format_or_na(r['img_per_s'] / step if step else None, '.1f')]
        for r in results])
    png = write_report(bench.out_dir, output_stem(bench, device, 'loaders'), result,
                       f"Data paths: images/s delivered to {result['device']} ({dataset_name}, batch {batch})", table,
                       notes=f"; the training step ('{best.name}') consumes {format_or_na(step, ',.0f')} img/s.")
    measured = [r for r in results if 'img_per_s' in r]
    bar_chart(png, [r['name'] for r in measured], [r['img_per_s'] for r in measured],
              f"data paths, {bench.preset}, {result['device']}, torch {result['torch']}",
              'images per second delivered (log scale)', ['tab:green'] * len(measured), log=True,
              lines={'training step consumes': step, '2x the step (target)': 2 * step} if step else None)
    print(table)
    return result


# ----------------------------------------------------------------------------- main

# The modes besides the ladder: the flag that asks for each, and what runs it.
MODES = {'roofline': run_roofline, 'profile': run_roofline, 'sweep': run_sweep, 'loader_only': run_loader_only,
         'quality': run_quality, 'sampling_only': run_sampling_only, 'side_by_side': run_side_by_side}
# Which mode reads which flag: a flag given to a mode that does not read it is refused, not ignored.
# A flag not named here (the model, the data, the device, the rows' settings, the outputs) is read by
# every mode. 'profile' is --profile on a GPU (with or without --roofline: the bound from the GPU's
# peaks); 'profile_cpu' the same on a CPU, whose peaks are measured, not given; 'side_by_side' and
# 'side_by_side_cpu' likewise.
TIMED = ('ladder', 'sweep', 'sampling_only')  # the modes that time iterations and report MFU
MODE_READS = {
    'rows': ('ladder',), 'peer': ('ladder',), 'sampling': ('ladder',),
    'iters': TIMED, 'warmup': TIMED,
    'sample_batch': ('ladder', 'sampling_only'), 'sample_compile_mode': ('ladder', 'sampling_only'),
    'peak_tflops': TIMED + ('roofline', 'profile', 'side_by_side'),
    'peak_tflops_fp32': TIMED + ('roofline', 'profile', 'side_by_side'),
    'from_row': ('roofline', 'profile', 'profile_cpu', 'side_by_side', 'side_by_side_cpu', 'sweep', 'loader_only',
                 'quality', 'sampling_only'),
    'sweep_values': ('sweep',), 'steps': ('quality',),
    'gpu': ('roofline', 'profile', 'side_by_side'), 'bandwidth_gbs': ('roofline', 'profile', 'side_by_side'),
    'precision': ('roofline', 'profile', 'profile_cpu', 'side_by_side', 'side_by_side_cpu'),
}


def mode_name(mode: str) -> str:
    return {'ladder': 'the ladder (no mode flag)', 'profile_cpu': '--profile on a CPU',
            'side_by_side_cpu': '--side-by-side on a CPU'}.get(mode, '--' + mode.replace('_', '-'))


def mode_of(bench: BenchConfig, device: torch.device) -> str:
    """The mode a run is in, as MODE_READS names it."""
    mode = 'profile' if bench.profile else next((name for name in MODES if getattr(bench, name)), 'ladder')
    return mode + ('_cpu' if mode in ('profile', 'side_by_side') and device.type != 'cuda' else '')


def validate(bench: BenchConfig) -> BenchConfig:
    """Every flag checked before any work (ConfigError, one line); fills --out-dir."""
    check_ranges(bench)
    device = pick_device(bench.device)
    mode = mode_of(bench, device)
    for name in sorted(changed_fields(bench) & set(MODE_READS)):
        if mode not in MODE_READS[name]:
            given = flag_name(name) if getattr(bench, name) is not False else flag_name(name).replace('--', '--no-', 1)
            raise ConfigError(f"{given} is not read by {mode_name(mode)}; it is read only by "
                              f"{', '.join(mode_name(m) for m in MODE_READS[name])}")
    asked_size, bench = bench.image_size, resolve(bench, device)  # --quick on a CPU cuts the size: check the asked one
    modes = [name for name in MODES if getattr(bench, name)]
    if len(modes) > 1 and modes != ['roofline', 'profile']:  # --roofline --profile: the bound beside a profile
        raise ConfigError(f"choose one mode, not {' and '.join('--' + m.replace('_', '-') for m in modes)}")
    with refused_as(f'--image-size {asked_size}'):
        model_config(dataclasses.replace(bench, image_size=asked_size))
    selected_rows(bench, device)  # a --rows part that matches no row is an error now
    if bench.from_row:
        start_row(bench, device)  # an unknown row is an error now, not after the data is loaded
    if bench.roofline or bench.profile or bench.side_by_side:
        roofline.target(dataclasses.replace(bench, profile=bench.profile or bench.side_by_side), device)
    if bench.stem:
        check_plain_name(bench.stem, '--stem')
    if bench.sweep_values and bench.sweep not in ('batch', 'workers'):  # amp, compile, layout: fixed points
        raise ConfigError(f'--sweep-values is not read by --sweep {bench.sweep}; it is read only by --sweep batch, '
                          f'--sweep workers')
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
    mode = next((name for name in MODES if getattr(bench, name)), None)  # --roofline --profile: run_roofline once
    return MODES[mode](bench) if mode else run_ladder(bench)


def cli(argv=None) -> int:
    return run_main(main, argv)


if __name__ == '__main__':
    sys.exit(cli())

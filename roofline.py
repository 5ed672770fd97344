"""The physical limit of a training step, computed: every aten op of train.py's step counted on
fake tensors (no memory, no device) with its FLOPs (torch.utils.flop_counter's formulas) and the
bytes it reads and writes, then bounded on a device's peaks, each op max(FLOPs / peak, bytes /
bandwidth): every op its own kernel, the elementwise work fused away, and the FLOPs alone.

What is computed here is a bound, not a measurement: benchmark.py --roofline writes it, and with
--profile sets a profile of the same step beside it (docs/benchmark.md#the-physical-limit).
"""
import contextlib
import copy
import dataclasses
import math
import os
import re
import statistics
import timeit

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

import bookkeeping
import diffusion
import loaders
import train
from cli import ConfigError
from devices import GPU_BANDWIDTH, device_name, device_slug, peak_tflops
from model import UNet
from reports import format_or_na, markdown_table, pyplot, save_figure, write_report

# Profiler kernel/op names -> what they do. First match wins; the optimizer goes first since
# its multi-tensor kernels are also elementwise.
CATEGORIES = [
    ('optimizer', r'adam|multi_tensor|foreach|lerp|clip_grad|vector_norm|_amp_'),
    ('attention', r'flash|fmha|attention|sdpa|softmax|bmm'),
    ('norm', r'norm(?!al)|welford'),  # not aten::normal_, the noise draw
    ('conv / matmul', r'conv|cudnn|implicit|xmma|cutlass|gemm|winograd|dgrad|wgrad|fprop|mm\b|addmm|matmul|sm\d\d_'),
    ('elementwise', r'elementwise|vectorized|triton_|silu|add|mul|copy|fill|cat|where|index|gather|reduce|'
                    r'sum|mean|div|sub|pow|exp|clamp|flip|unrolled|normal|rand'),
]


def categorise(name: str) -> str:
    lowered = name.lower()
    return next((category for category, pattern in CATEGORIES if re.search(pattern, lowered)), 'other')


# The profile's categories as the roofline names them (kernel names cannot tell a linear layer's
# GEMM from a 1x1 convolution's); 'data' is the loader's gather, flip and conversion.
ROOFLINE_CATEGORIES = {'conv / matmul': 'convolution and matmul', 'attention': 'attention', 'norm': 'normalisation',
                       'elementwise': 'elementwise and activation', 'other': 'elementwise and activation',
                       'optimizer': 'optimizer and EMA', 'data': 'data'}


def op_flops(func, args, kwargs, out) -> int:
    """FlopCounterMode's formula for an op; attention's backward as the four matmuls of its gradient,
    as FlopCounterMode counts attention written as matmuls (model.count_flops): the flash kernels'
    recompute of the scores is not the model's work."""
    name = func.__name__
    if name.startswith('_scaled_dot_product'):  # the CPU's flash kernels, and CUDA's
        q, k, v = args[1:4] if 'backward' in name else args[:3]
        return (2 if 'backward' in name else 1) * sdpa_flop_count(q.shape, k.shape, v.shape)
    formula = flop_registry.get(func._overloadpacket)
    return formula(*args, **kwargs, out_val=out) if formula else 0


def footprint(t: torch.Tensor) -> int:
    """Bytes a tensor argument covers: a broadcast (stride-0) dimension once."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st) * t.element_size() if t.numel() else 0


class StepCounter(TorchDispatchMode):
    """Every aten op below autograd, with real shapes and dtypes: its FLOPs (op_flops) and bytes, each
    tensor read or written once (a view or an allocation moves none, a gather reads what it returns,
    an in-place op reads and writes its tensor), and its category: 'data' until `phase` is 'step',
    then the network's by op name (categorise), and after the backward the optimizer's; with `scopes`
    (profiling.ModuleScopes) also its module group."""

    def __init__(self, scopes=None):
        super().__init__()
        self.ops, self.phase, self.backward_seen, self.scopes = [], 'data', False, scopes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != 'aten':
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage()._cdata for t in ins}
        fresh = [t for t in tree_leaves(out) if torch.is_tensor(t) and t.untyped_storage()._cdata not in storages]
        written = [t for a, v in zip(func._schema.arguments, args) if a.alias_info and a.alias_info.is_write
                   for t in tree_leaves(v) if torch.is_tensor(t)]
        reads = fresh + ins[1:] if func.__name__.startswith('index.') else ins  # a gather reads what it returns
        moved = bool(fresh or written) and not func.__name__.startswith(('empty', 'new_empty'))
        backward = torch._C._current_graph_task_id() != -1
        self.backward_seen |= backward
        category = categorise(str(func)) if self.phase == 'step' else self.phase
        category = 'optimizer and EMA' if self.backward_seen and not backward else ROOFLINE_CATEGORIES[category]
        self.ops.append({'op': str(func), 'flops': op_flops(func, args, kwargs or {}, out),
                         'bytes': sum(map(footprint, reads + written + fresh)) if moved else 0, 'category': category})
        if self.scopes:
            self.ops[-1]['module'] = self.scopes.group(str(func), backward, category)
        return out


# Where CUDA's eager step differs from the CPU's: its autocast (ATen's autocast_mode.h) runs these in
# fp32 (the CPU's: in their input's dtype) and casts no cat or stack input; its dropout is one fused
# kernel (native_dropout), the CPU's a mask drawn, scaled and multiplied.
CUDA_FP32_OPS = (torch.ops.aten.group_norm.default, torch.ops.aten.upsample_nearest2d.default,
                 torch.ops.aten.softmax.int)


@contextlib.contextmanager
def cuda_policy():
    """The CPU's autocast and dropout made CUDA's (CUDA_FP32_OPS), for a count on CPU fake tensors:
    a backward on CUDA fake tensors needs a real CUDA context."""
    def fp32(op):
        def kernel(*args, **kwargs):  # as CUDA's autocast: half inputs cast, autocast off inside
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
                return op(*[a.float() if torch.is_tensor(a) and a.dtype in (torch.bfloat16, torch.float16) else a
                            for a in args], **kwargs)
        return kernel

    def dropout(x, p, train):  # ATen's is_fused_kernel_acceptable, as on CUDA
        fused = train and 0 < p < 1 and x.numel() > 0
        return torch.native_dropout(x, p, train)[0] if fused else torch.ops.aten.dropout.default.decompose(x, p, train)
    with torch.library._scoped_library('aten', 'IMPL') as lib:
        for op in CUDA_FP32_OPS:
            lib.impl(op, fp32(op), 'AutocastCPU')
        for name in ('cat', 'stack'):
            lib.impl(name, torch.library.fallthrough_kernel, 'AutocastCPU')
        lib.impl('dropout', dropout, 'AutogradCPU')
        yield


FUSED_AWAY = 'elementwise and activation'
FUSED_ASSUMPTIONS = ('elementwise and activation ops (SiLU, adds, casts, layout copies, padding, concatenation, '
                     'upsampling, dropout, the noise and the loss) move no bytes: each is folded into the kernel '
                     'that produces its input or consumes its output; convolutions, matmuls, attention and GroupNorm '
                     'read their inputs and write their outputs once, in the dtypes of the eager step; the data '
                     'path, the optimizer and the EMA are unchanged (train.py runs them outside the compiled graph)')


def bounds(ops: list, batch: int, tflops: float, gbs: float) -> dict:
    """Per category and in total: GFLOP and MB per image and the bound in ms per step, each op
    max(FLOPs / peak, bytes / bandwidth), summed: every op its own kernel ('eager'), the elementwise
    work fused away ('fused': FUSED_ASSUMPTIONS), the FLOPs alone; and the step's ceilings."""
    rows = {c: dict.fromkeys(('gflop_per_image', 'mb_per_image', 'eager_ms', 'fused_ms', 'flops_ms'), 0.0)
            for c in dict.fromkeys(ROOFLINE_CATEGORIES.values())}
    for op in ops:
        row, ms = rows[op['category']], 1e3 * max(op['flops'] / tflops / 1e12, op['bytes'] / gbs / 1e9)
        row['gflop_per_image'] += op['flops'] / batch / 1e9
        row['mb_per_image'] += op['bytes'] / batch / 1e6
        row['eager_ms'] += ms
        row['fused_ms'] += 0.0 if op['category'] == FUSED_AWAY else ms
        row['flops_ms'] += 1e3 * op['flops'] / tflops / 1e12
    total = {key: sum(row[key] for row in rows.values()) for key in rows[FUSED_AWAY]}
    return {'categories': rows, 'total': total,
            'cases': {case: ceiling(total[f'{case}_ms'], batch, total) for case in ('eager', 'fused', 'flops')}}


def ceiling(ms: float, batch: int, total: dict) -> dict:
    return {'ms_per_step': ms, 'img_per_s': 1e3 * batch / ms, 'mfu': total['flops_ms'] / ms}


def add_measured(bounds: dict, profiled: list, batch: int) -> dict:
    """Each category's measured time (a profile's self times per step, summed by categorise's
    category) written beside its bound; the measured case of the step's ceilings."""
    categories = {**bounds['categories'], 'total': bounds['total']}
    for c in categories.values():
        c['measured_ms'] = 0.0
    for op in profiled:
        for name in (ROOFLINE_CATEGORIES[op['category']], 'total'):
            categories[name]['measured_ms'] += op['ms_per_iter']
    return ceiling(bounds['total']['measured_ms'], batch, bounds['total'])


# ----------------------------------------------------------------------------- the step, counted

def count_step(cfg: train.TrainConfig, cuda: bool = True, make_model=None, scopes=None) -> list:
    """train.py's step op by op (StepCounter) on fake tensors (shapes, no memory): the loader's
    next batch, then train.train_step over what train.build_run makes (made here by the same
    functions: build_run reads real data), after a step that creates the optimizer's state; as on
    CUDA (cuda_policy) or as on the CPU. make_model: another network (the benchmark's peer); scopes
    (profiling.ModuleScopes): each op's module group too."""
    with torch.device('meta'):
        model = (make_model or UNet)(train.model_config_of(cfg))
    model = model.to(memory_format=torch.channels_last) if cfg.channels_last else model
    ema, counter, cpu = copy.deepcopy(model).eval().requires_grad_(False), StepCounter(scopes), torch.device('cpu')
    with (cuda_policy() if cuda else contextlib.nullcontext(), FakeTensorMode(allow_non_fake_inputs=True),
          scopes.on(model) if scopes else contextlib.nullcontext()):
        model, ema, sched = model.to(cpu), ema.to(cpu), diffusion.make_schedule(train.NUM_TIMESTEPS, cfg.schedule)
        images = torch.zeros(2 * cfg.batch_size, model.config.in_channels, cfg.image_size, cfg.image_size,
                             dtype=torch.uint8)
        loss = train.make_loss(dataclasses.replace(cfg, compile=False), model, sched, cpu)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=cfg.fused_adam or None)
        run = bookkeeping.Run(cfg, cpu, 0, 1, model, ema, loss, optimizer, torch.amp.GradScaler('cpu', enabled=False),
                              sched, loaders.GPULoader(images, cfg.batch_size, cfg.seed, cpu), 'gpu', {})
        stream = train.batches(run, 0)
        train.train_step(run, next(stream), 0)
        with counter:
            x0 = next(stream)
            counter.phase = 'step'
            train.train_step(run, x0, 1)
    return counter.ops


def target(bench, device: torch.device) -> dict | None:
    """The peaks of the bound: --gpu's, this GPU's or the H100 SXM's, from the tables unless the flags
    give them (bench: benchmark.py's config); None where they are this CPU's, measured (--profile on
    a CPU)."""
    if bench.profile and device.type == 'cpu':
        if bench.gpu:
            raise ConfigError("--gpu: with --profile on a CPU the bound is the CPU's, from its measured peaks")
        return None
    slug = bench.gpu or (device_slug(device) if device.type == 'cuda' else 'h100-sxm')
    if slug == 'a100':
        slug += '-80gb' if '80GB' in device_name(device).upper() else '-40gb'
    name, gbs = GPU_BANDWIDTH.get(slug, (device_name(device), None))
    gbs, fp32 = bench.bandwidth_gbs or gbs, bench.precision == 'fp32'
    tflops = (bench.peak_tflops_fp32 if fp32 else bench.peak_tflops) or peak_tflops(
        name, ('tf32' if bench.tf32 else 'fp32') if fp32 else bench.precision or 'bf16')
    if not (tflops and gbs):
        raise ConfigError(f"--roofline: no peaks known for {name}: give --peak-tflops{'-fp32' if fp32 else ''} "
                          f"and --bandwidth-gbs")
    given = bench.bandwidth_gbs or (bench.peak_tflops_fp32 if fp32 else bench.peak_tflops)
    return {'name': f"{name} ({'peaks as given' if given else 'computed'})", 'slug': slug, 'peak_tflops': tflops,
            'bandwidth_gbs': gbs}


def cpu_peaks(quick: bool, dtype: torch.dtype) -> dict:
    """This CPU's peaks, measured: a large matmul's TFLOP/s in the step's dtype and a large copy's
    GB/s (read and written), each the median of repeats after warm-up calls."""
    n, size, repeats = (512, 2 ** 22, 3) if quick else (2048, 2 ** 25, 15)
    a, source = torch.randn(n, n, dtype=dtype), torch.randn(size)
    target = torch.empty_like(source)
    seconds = [statistics.median(timeit.repeat(work, number=1, repeat=repeats + 3)[3:])  # 3 warm up: clocks, pages
               for work in (lambda: torch.mm(a, a), lambda: target.copy_(source))]
    return {'name': f'CPU ({os.cpu_count()} cores, measured peaks)', 'slug': 'cpu',
            'peak_tflops': 2 * n ** 3 / seconds[0] / 1e12, 'bandwidth_gbs': 2 * source.nbytes / seconds[1] / 1e9}


# ----------------------------------------------------------------------------- the report

def write(result: dict, out_dir: str, stem: str):
    """Bounds per category and in total, the measured times beside them and the top ops; the step's
    ceilings; a stacked bar chart of the cases."""
    target, cases, against = result['target'], result['cases'], result.get('measured_against')

    def measured(c):
        ms, bound = c['measured_ms'], c[f'{against}_ms']
        return ([f'{ms:.3f}', format_or_na(ms / bound if bound else None, '.2f'), f'{bound / ms:.1%}'] if ms
                else ['(profiled with the elementwise ops)', '', ''])
    labels = {'eager': 'every op its own kernel (eager)', 'fused': 'elementwise fused into its neighbours',
              'flops': 'FLOPs alone', 'measured': 'measured (profile: self times summed)'}
    tables = [markdown_table(
        ['Category', 'GFLOP/image', 'MB/image', 'eager bound (ms/step)', 'fused bound', 'FLOPs alone'] + (
            ['measured (ms/step)', f'measured / {against} bound', 'share of the bound reached'] if against else []),
        [[name, f"{c['gflop_per_image']:.3f}", f"{c['mb_per_image']:.2f}", f"{c['eager_ms']:.3f}",
          f"{c['fused_ms']:.3f}", f"{c['flops_ms']:.3f}"] + (measured(c) if against else [])
         for name, c in {**result['categories'], 'total': result['total']}.items()]),
        markdown_table(['Case', 'ms/step', 'img/s', 'MFU'], [
            [labels[k], f"{c['ms_per_step']:.3f}", f"{c['img_per_s']:,.0f}", f"{c['mfu']:.1%}"]
            for k, c in cases.items()]), f'The fused case assumes: {FUSED_ASSUMPTIONS}.']
    if against:
        total = result['total']['measured_ms']
        tables.append(markdown_table(['Op / kernel (self time)', 'category', 'calls', 'ms/iter', 'share'], [
            [f"`{op['name'][:87] + '...' if len(op['name']) >= 90 else op['name']}`", op['category'], op['calls'],
             f"{op['ms_per_iter']:.3f}", f"{op['ms_per_iter'] / total:.1%}"] for op in result['top_ops'][:25]], left=2))
    what = (f"{result['preset']} at {result['image_size']}x{result['image_size']}, {result['precision']}, batch "
            f"{result['batch_size']}, on {target['name']}")
    png = write_report(out_dir, stem, result, f'The physical limit: {what}', '\n\n'.join(tables), notes=(
        f"; peaks {target['peak_tflops']:.4g} TFLOP/s, {target['bandwidth_gbs']:,.4g} GB/s; one step of "
        f"'{result['row']}' counted op by op ({result['ops_counted']} ops, each reading its inputs and writing its "
        f"outputs at their dtypes)" + (f"; measured: a profile of that step here, mean of {result['active_iterations']}"
                                       f" steps (trace for ui.perfetto.dev: `{result['trace']}`)" if against else '')))
    fig, ax = pyplot().subplots(figsize=(11, 0.6 * len(cases) + 2))
    for i, case in enumerate(cases):
        widths = [c[f'{case}_ms'] for c in result['categories'].values()]
        for j, name in enumerate(result['categories']):
            ax.barh(labels[case], widths[j], left=sum(widths[:j]), color=f'C{j}', label=None if i else name)
    ax.invert_yaxis()
    ax.set_xlabel('ms per training step')
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))
    ax.set_title(f"{what}, torch {result['torch']}", fontsize=9)
    save_figure(fig, png, dpi=110)
    print('\n\n'.join(tables))

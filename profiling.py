"""Where a training step's time goes, profiled: torch.profiler over train.py's steps, each kernel (or
CPU op) in its category, and each op in the module group that ran it, for our UNet and diffusers'
UNet2DModel alike; the same groups in roofline.py's count of the step, so that each stands beside
its bound (benchmark.py --profile and --side-by-side).

Module groups: forward hooks open a scope around each hooked module (the innermost scope wins); an
op of the backward belongs to the scope of the forward op that made its autograd node (matched by
autograd's sequence numbers); what runs outside the network is grouped by its op's name. A compiled
step fuses across modules, so its kernels have no module: the groups are measured on the same step
run eagerly.
"""
import contextlib
import os
import re

import torch

import bookkeeping
import roofline
import train
from devices import synchronize
from reports import format_or_na, markdown_table, pyplot, save_figure, write_report

RES_NORM, RES_CONV = 'ResBlocks: GroupNorm', 'ResBlocks: convolutions'
RES_REST = 'ResBlocks: the rest (time projection, SiLU, dropout, adds)'
ATTENTION = 'attention blocks (norm, q/k/v, attention, projection, add)'
SAMPLING = 'down- and upsampling'
NETWORK_REST = 'the rest of the network (stem, time embedding, skips, head)'
OUTSIDE = 'outside the network (data, noise, loss, autograd)'
OPTIMIZER, EMA = 'optimizer and gradient clipping', 'EMA update'
MODULE_GROUPS = (RES_NORM, RES_CONV, RES_REST, ATTENTION, SAMPLING, NETWORK_REST, OUTSIDE, OPTIMIZER, EMA)
SCOPE = 'module group::'  # the profiler's name of a scope
BACKWARD = 'autograd::engine::evaluate_function'

# Our classes and diffusers' that do the same job (diffusers' Attention holds its own GroupNorm).
RESBLOCKS, ATTENTIONS = ('ResBlock', 'ResnetBlock2D'), ('AttnBlock', 'Attention')
SAMPLERS = ('Downsample', 'Upsample', 'Downsample2D', 'Upsample2D')


def outside_group(name: str) -> str:
    """The group of an op outside every hooked module, by its name (or the name of its scope)."""
    if re.search(r'_foreach_lerp', name):  # bookkeeping.ema_update
        return EMA
    if re.search(r'adam|Optimizer\.|_foreach_norm|vector_norm|_foreach_mul_|_amp_', name, re.IGNORECASE):
        return OPTIMIZER
    return OUTSIDE


def hooked_modules(model: torch.nn.Module) -> list:
    """(module, group) for every module that opens a scope: the network, its residual blocks and the
    GroupNorms and convolutions directly inside them, its attention blocks, its down- and upsamplers."""
    hooked = [(model, NETWORK_REST)]
    for module in model.modules():
        kind = type(module).__name__
        if kind in RESBLOCKS:
            hooked.append((module, RES_REST))
            hooked += [(child, RES_NORM if isinstance(child, torch.nn.GroupNorm) else RES_CONV)
                       for child in module.children() if isinstance(child, (torch.nn.GroupNorm, torch.nn.Conv2d))]
        elif kind in ATTENTIONS:
            hooked.append((module, ATTENTION))
        elif kind in SAMPLERS:
            hooked.append((module, SAMPLING))
    return hooked


class ModuleScopes:
    """Forward hooks that keep the stack of module groups the running op is in: as profiler scopes
    (record=True) for a profile, or read by roofline.StepCounter through group() for a count."""

    def __init__(self, record: bool = False):
        self.record, self.stack, self.scopes, self.node_groups = record, [], [], {}

    @contextlib.contextmanager
    def on(self, model: torch.nn.Module):
        def enter(group):
            def hook(module, args):
                self.stack.append(group)
                if self.record:
                    self.scopes.append(torch.autograd.profiler.record_function(SCOPE + group))
                    self.scopes[-1].__enter__()
            return hook

        def leave(module, args, output):
            self.stack.pop()
            if self.record:
                self.scopes.pop().__exit__(None, None, None)
        handles = [h for module, group in hooked_modules(model)
                   for h in (module.register_forward_pre_hook(enter(group)), module.register_forward_hook(leave))]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def group(self, name: str, backward: bool, category: str) -> str:
        """The group of an op seen below autograd (roofline.StepCounter): in the forward the innermost
        scope, which is also noted for the autograd node the op made (the first op to see the node
        made it); in the backward the group of the forward op that made the running node; after the
        backward the optimizer's or the EMA's."""
        if backward:
            node = torch._C._current_autograd_node()
            return (self.node_groups.get(node._sequence_nr()) if node is not None else None) or outside_group(name)
        if category == 'optimizer and EMA':
            return EMA if 'lerp' in name else OPTIMIZER
        here = self.stack[-1] if self.stack else None
        self.node_groups.setdefault(torch._C._autograd._get_sequence_nr() - 1, here)
        return here or outside_group(name)


def event_groups(events) -> dict:
    """{event id: group} for a profile's events (prof.events()): a scope's events are in its group;
    a backward's (under autograd's evaluate_function) in the group of the forward op with its sequence
    number (the last forward event that started with that number made the node); the rest by name."""
    def chain(event):
        while event is not None:
            yield event
            event = event.cpu_parent

    def scope(event):
        return next((e.name[len(SCOPE):] for e in chain(event) if e.name.startswith(SCOPE)), None)
    forward = {}
    for event in sorted(events, key=lambda e: e.time_range.start):
        if event.sequence_nr >= 0 and not any(e.name.startswith(BACKWARD) for e in chain(event)):
            forward[event.sequence_nr] = scope(event) or outside_group(event.name)

    def group(event):
        for e in chain(event):
            if e.name.startswith(SCOPE):
                return e.name[len(SCOPE):]
            if e.name.startswith(BACKWARD) and e.sequence_nr in forward:
                return forward[e.sequence_nr]
            if outside_group(e.name) != OUTSIDE:
                return outside_group(e.name)
        return OUTSIDE
    return {event.id: group(event) for event in events}


def module_times(prof, device: torch.device, active: int) -> dict:
    """ms per step of each module group: the self time of every CPU op (on a CPU), or the kernels each
    launched (on CUDA), summed by event_groups' group."""
    events = [e for e in prof.events() if str(e.device_type) == 'DeviceType.CPU' and not e.is_async]
    groups, times = event_groups(events), dict.fromkeys(MODULE_GROUPS, 0.0)
    for event in events:
        if event.name.startswith(('ProfilerStep', SCOPE)):
            continue  # scopes: their ops are counted
        us = sum(k.duration for k in event.kernels) if device.type == 'cuda' else event.self_cpu_time_total
        times[groups[event.id]] += us / 1e3 / active
    return times


# ----------------------------------------------------------------------------- profiling train.py's steps

def profile_rows(prof, device: torch.device, active: int) -> list:
    """Per op (CPU) or kernel (CUDA): self time in ms per iteration of `active`, with its category."""
    rows = []
    for event in prof.key_averages():
        if device.type == 'cuda' and str(event.device_type) != 'DeviceType.CUDA':
            continue  # CPU ops that launch kernels: their kernels are counted instead
        self_us = event.self_device_time_total if device.type == 'cuda' else event.self_cpu_time_total
        if self_us > 0 and not event.key.startswith(('ProfilerStep', SCOPE)):  # the profiler's records: host time
            rows.append({'name': event.key, 'category': roofline.categorise(event.key), 'calls': event.count,
                         'self_us': self_us, 'ms_per_iter': self_us / 1e3 / active})
    return sorted(rows, key=lambda r: -r['self_us'])


def profile_steps(run: bookkeeping.Run, quick: bool, trace: str = None, scopes: ModuleScopes = None) -> tuple:
    """(torch.profiler over train.py's steps, data included, after 3 that compile and warm up; the
    number of steps it profiled); its trace written to TRACE (Chrome/Perfetto JSON) where given;
    with `scopes`, each module group a profiler scope (an eager step: hooks would enter a compiled graph)."""
    stream, active = train.batches(run, 0), 3 if quick else 10
    with scopes.on(run.model) if scopes else contextlib.nullcontext():
        for step in range(3):  # compile and warm up outside the profile
            train.train_step(run, next(stream), step)
        synchronize(run.device)
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if run.device.type == 'cuda' else [])
        with torch.profiler.profile(activities=activities,
                                    schedule=torch.profiler.schedule(wait=1, warmup=2, active=active)) as prof:
            for step in range(3, 3 + 3 + active):
                train.train_step(run, next(stream), step)
                prof.step()
            synchronize(run.device)
    if trace:
        os.makedirs(os.path.dirname(trace), exist_ok=True)
        prof.export_chrome_trace(trace)
    return prof, active


def by_category(ops: list) -> dict:
    """A profile's rows (profile_rows) summed into roofline's categories, ms per step."""
    times = dict.fromkeys(dict.fromkeys(roofline.ROOFLINE_CATEGORIES.values()), 0.0)
    for op in ops:
        times[roofline.ROOFLINE_CATEGORIES[op['category']]] += op['ms_per_iter']
    return times


def module_bounds(ops: list, tflops: float, gbs: float) -> dict:
    """Each module group's bound in ms per step from a count (roofline.count_step with scopes): every
    op its own kernel ('eager'), and the elementwise work fused away ('fused')."""
    rows = {group: {'eager_ms': 0.0, 'fused_ms': 0.0} for group in MODULE_GROUPS}
    for op in ops:
        ms = 1e3 * max(op['flops'] / tflops / 1e12, op['bytes'] / gbs / 1e9)
        rows[op['module']]['eager_ms'] += ms
        rows[op['module']]['fused_ms'] += 0.0 if op['category'] == roofline.FUSED_AWAY else ms
    return rows


# ----------------------------------------------------------------------------- the report

def differences(result: dict, key: str) -> list:
    """(name, ours, peer) of the shipped step's categories (key 'categories') or the eager step's module
    groups ('modules'), the largest difference first."""
    ours, peer = (result['networks'][n] for n in ('ours', 'diffusers'))
    part = 'shipped' if key == 'categories' else 'eager'
    if 'error' in peer or part not in peer or part not in ours:
        return []
    names = ours[part][key]
    return sorted(((n, ours[part][key][n], peer[part][key][n]) for n in names), key=lambda d: -abs(d[1] - d[2]))


def write_side_by_side(result: dict, out_dir: str, stem: str):
    """STEM.json, .md and .png: per category (the shipped step) and per module group (the same step
    run eagerly), ours beside the peer, each beside its bound."""
    ours, peer = result['networks']['ours'], result['networks']['diffusers']
    peer_ok = 'error' not in peer

    def ms(network, part, key, name):
        return format_or_na(network.get(part, {}).get(key, {}).get(name), '.3f')

    def bound(network, key, name, case):
        return format_or_na(network.get('bounds', {}).get(key, {}).get(name, {}).get(case), '.3f')
    case = 'fused' if result['compiled'] else 'eager'
    step = 'compiled' if result['compiled'] else 'eager'
    tables = []
    for key, part, what, case_here in (('categories', 'shipped', f'Kernel category (the {step} step)', case),
                                       ('modules', 'eager', 'Module group (the step run eagerly)', 'eager')):
        names = list(ours[part][key])
        totals = [ours[part]['ms_per_step'], peer[part]['ms_per_step'] if peer_ok else None]
        tables.append(markdown_table(
            [what, 'ours (ms/step)', 'diffusers (ms/step)', 'diffusers - ours', f'{case_here} bound: ours',
             f'{case_here} bound: diffusers'],
            [[n, ms(ours, part, key, n), ms(peer, part, key, n),
              format_or_na(peer[part][key][n] - ours[part][key][n] if peer_ok else None, '+.3f'),
              bound(ours, key, n, f'{case_here}_ms'), bound(peer, key, n, f'{case_here}_ms')] for n in names]
            + [['total', f'{totals[0]:.3f}', format_or_na(totals[1], '.3f'),
                format_or_na(totals[1] - totals[0] if peer_ok else None, '+.3f'),
                format_or_na(ours['bounds']['total'][f'{case_here}_ms'], '.3f'),
                format_or_na(peer.get('bounds', {}).get('total', {}).get(f'{case_here}_ms'), '.3f')]]))
    lines = [f"Profiled ({step} step, self times summed): ours {ours['shipped']['ms_per_step']:.2f} ms/step"]
    if peer_ok:
        ratio = peer['shipped']['ms_per_step'] / ours['shipped']['ms_per_step']
        lines[0] += (f", diffusers {peer['shipped']['ms_per_step']:.2f} ms/step: ours {ratio:.2f}x its speed by the "
                     f"profile (the timed comparison is --sweep peer's).")
        for key, what in (('categories', 'by category'), ('modules', 'by module group, eager')):
            lines.append(f'Largest differences {what} (diffusers - ours): ' + '; '.join(
                f'{n} {p - o:+.2f} ms ({o:.2f} against {p:.2f})' for n, o, p in differences(result, key)[:3]) + '.')
    else:
        lines += [f"diffusers: {peer['error']}"]
    target = result['target']
    body = '\n\n'.join(['\n'.join(f'- {line}' for line in lines)] + tables + [
        f"Bounds: each op max(FLOPs / peak, bytes / bandwidth) on {target['name']} ({target['peak_tflops']:.4g} "
        f"TFLOP/s, {target['bandwidth_gbs']:,.4g} GB/s), counted op by op for each network (roofline.py); the "
        f"fused case assumes: {roofline.FUSED_ASSUMPTIONS}. Module groups: "
        f"{' '.join(__doc__.split('groups: ')[1].split())}"])
    what = (f"{result['preset']} at {result['image_size']}x{result['image_size']}, {result['precision']}, batch "
            f"{result['batch_size']}")
    png = write_report(out_dir, stem, result, f"Ours beside diffusers' UNet2DModel: where a step's time goes ({what})",
                       body, notes=f"; '{result['row']}', {result['active_iterations']} profiled steps each")
    fig, axes = pyplot().subplots(2, 1, figsize=(11, 6))
    for ax, (key, part, case_here) in zip(axes, (('categories', 'shipped', case), ('modules', 'eager', 'eager'))):
        how = f'{step} step' if part == 'shipped' else 'eager step, by module'
        bars = [(f'ours ({how})', ours[part][key])] + ([(f'diffusers ({how})', peer[part][key])] if peer_ok else [])
        bars.append((f'{case_here} bound, ours', {n: b[f'{case_here}_ms'] for n, b in ours['bounds'][key].items()}))
        for label, values in bars:
            widths = list(values.values())
            for j, name in enumerate(values):
                ax.barh(label, widths[j], left=sum(widths[:j]), color=f'C{j % 10}',
                        label=name if label == bars[0][0] else None)
        ax.invert_yaxis()
        ax.set_xlabel('ms per training step')
        ax.legend(fontsize=6, loc='upper left', bbox_to_anchor=(1.01, 1))
    axes[0].set_title(f"{what} on {result['device']}, torch {result['torch']}", fontsize=9)
    save_figure(fig, png, dpi=110)
    print(body)

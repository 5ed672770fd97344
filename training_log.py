"""train.py's log of a run, which a researcher rarely edits: the clock of training time
(evaluations, grids and checkpoints left out), metrics.jsonl rows (and TensorBoard), the progress
bar and curves.png (`Metrics`); and what the loop calls to log: the interval's loss and its
held-out losses, the sample grids, the start and the end of a run (a bookkeeping.Run)."""
import contextlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
from tqdm import tqdm

import evaluation
from bookkeeping import Run, any_rank, on_all_ranks, ranks_identical
from cli import StopRequested, brief
from devices import device_name, own_rng, peak_tflops, precision_of, synchronize
from drawing import write_grid
from files import JsonLines
from model import count_flops, count_params
from reports import provenance, pyplot, save_figure


class Metrics:
    """metrics.jsonl (and TensorBoard, with --tensorboard), curves.png and the progress bar (written
    on rank 0 only), and the clock of training time.

    Speed is of the training steps alone: the clock is paused while a grid, a checkpoint, the
    held-out loss or an evaluation runs, and the first step of a process (which compiles) is
    timed on its own as `first_step_s`. `train_seconds` sums the timed training time."""

    def __init__(self, run: Run, step: int, total_steps: int, train_seconds: float = 0.0,
                 wall_seconds: float = 0.0):
        cfg, self.run = run.cfg, run
        self.active = run.rank == 0
        self.path = os.path.join(cfg.out_dir, 'metrics.jsonl')
        self.flops = count_flops(run.model.config, cfg.image_size)
        name = torch.cuda.get_device_name(run.device) if run.device.type == 'cuda' else ''
        self.peak = peak_tflops(name, precision_of(cfg.amp, run.device)) if name else None
        self.bar = tqdm(total=total_steps, initial=step, disable=not self.active, dynamic_ncols=True, desc='train')
        self.first_step_s, self.untimed_steps = None, 1  # the first step compiles: timed apart
        self.interval_start, self.paused_s, self.train_seconds = time.perf_counter(), 0.0, train_seconds
        self.wall_before, self.loop_start = wall_seconds, time.perf_counter()  # earlier processes' wall, this one's
        self.last, self.grids, self.curves_drawn = {}, [], 0.0
        self.out = JsonLines(self.path, cfg.tensorboard and os.path.join(cfg.out_dir, 'tb')) if self.active else None
        if self.active:
            self.out.drop_after(step)  # a killed run's rows past its last checkpoint
            made_by = provenance(device_name(run.device))  # torch, date, commit, command: what the rows came from
            self.write({'config': asdict(cfg), 'flags': run.flags, 'model_config': asdict(run.model.config),
                        'start_step': step, 'world_size': run.world_size, 'loader': run.loader_kind,
                        'device': str(run.device), 'device_name': made_by.pop('device'), **made_by,
                        'data': run.data_identity})
            self.print(f'{cfg.preset}: {count_params(run.model) / 1e6:.2f}M parameters, '
                       f'{self.flops["train"] / 1e9:.2f} GFLOP/image per training step; {run.data_identity["count"]} '
                       f'images, loader {run.loader_kind}, {run.world_size} rank(s), {total_steps} steps of batch '
                       f'{cfg.batch_size} on {run.device} (amp {cfg.amp}, compile {cfg.compile})')

    def print(self, message: str, file=None):
        if self.active:
            tqdm.write(message, file=file)

    def write(self, row: dict):
        if self.active:
            self.out.write(row)
        if row.get('kind') == 'train':
            self.last = row

    def draw_curves(self, force: bool = False):
        """Redraws OUT/curves.png from metrics.jsonl: after an evaluation or a log row at most once
        every 30 s (matplotlib costs about a second, as much as a small run's evaluation), and at the
        end of the run (force)."""
        if not self.active or (not force and time.perf_counter() - self.curves_drawn < 30):
            return
        with self.paused():
            write_curves(self.path, os.path.join(self.run.cfg.out_dir, 'curves.png'))
        self.curves_drawn = time.perf_counter()

    def after_step(self):
        """Moves the bar; after the first step of the process, waits for it (one host sync) and
        starts the clock."""
        self.bar.update(1)
        if self.first_step_s is None:
            synchronize(self.run.device)
            self.first_step_s = time.perf_counter() - self.interval_start
            self.restart_clock()

    def restart_clock(self):
        self.interval_start, self.paused_s = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside is not training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - start

    def start_loop(self):
        self.loop_start = time.perf_counter()

    def wall_seconds(self) -> float:
        """Wall time of the training loop so far, over every process of the run (a resumed run
        counts on from its checkpoint's), evaluations, grids and checkpoints included."""
        return self.wall_before + time.perf_counter() - self.loop_start

    def training_seconds(self) -> float:
        """Training time so far: the logged intervals and the current one, pauses left out."""
        return self.train_seconds + time.perf_counter() - self.interval_start - self.paused_s

    def train_row(self, step: int, steps: int, mean_loss: float, lr: float) -> dict:
        """The row of the `steps` steps since the last one (`lr`: its last step's learning rate), and
        a new interval. img/s is the whole job's; MFU is per GPU (one rank's share of the throughput
        over one GPU's peak)."""
        cfg = self.run.cfg
        seconds = time.perf_counter() - self.interval_start - self.paused_s
        timed, self.untimed_steps = steps - self.untimed_steps, 0
        self.train_seconds += seconds
        img_per_s = timed * cfg.batch_size / seconds if timed > 0 and seconds > 0 else None
        per_gpu = img_per_s / self.run.world_size if img_per_s else None
        row = {'kind': 'train', 'step': step, 'images_seen': step * cfg.batch_size,
               'epoch': step / self.run.loader.batches_per_epoch, 'loss': mean_loss,
               'lr': lr, 'img_per_s': img_per_s, 'img_per_s_per_gpu': per_gpu,
               'mfu': per_gpu * self.flops['train'] / (self.peak * 1e12) if self.peak and per_gpu else None,
               'train_hours': self.train_seconds / 3600}
        if not self.last:
            row['first_step_s'] = self.first_step_s  # compilation and the first step, kept out of img/s
        self.restart_clock()
        return row


# ----------------------------------------------------------------------------- what the loop calls

def start_logging(run: Run, step: int, train_seconds: float, wall_seconds: float = 0.0) -> tuple:
    """(Metrics, the held-out set, the Evaluator or None). Their start-up work (held-out images,
    Inception network, reference statistics) runs on every rank or on rank 0; if it fails on
    any rank, every rank stops with an error instead of leaving the others in a collective."""
    cfg = run.cfg

    def make():  # the progress bar last: an error before it is one clean line
        heldout = evaluation.make_heldout(cfg, run.device, run.sched.num_steps) if run.rank == 0 else None
        evaluator = evaluation.Evaluator(run) if cfg.eval_every else None
        return Metrics(run, step, run.total_steps, train_seconds, wall_seconds), heldout, evaluator
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


def log_interval(run: Run, log: Metrics, heldout, step: int, steps: int, mean_loss: float, lr: float,
                 with_heldout: bool):
    """A metrics.jsonl row: loss, speed and (unless a stop is under way) the held-out losses of
    the model and the EMA, which a signal cuts short."""
    row = log.train_row(step, steps, mean_loss, lr)
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


def write_sample_grid(run: Run, log: Metrics, path: str, step: int):
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


def finish_run(run: Run, step: int, stopped, log: Metrics, ckpt_path: str) -> dict:
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


# ----------------------------------------------------------------------------- curves.png

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
    panels += [(name, eval_rows) for name in ('bpd', 'fid', 'digits_class_fd') if any(name in r for r in eval_rows)]
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
            if name == 'digits_class_fd' and points:
                ax.axhline(points[-1]['digits_class_fd_floor'], color='gray', linestyle=':',
                           label='floor (held-out digits)')
                ax.set_yscale('log')
                ax.legend(fontsize=8)
        ax.set_ylabel({'loss': 'loss (eps MSE)', 'bpd': 'bits/dim (EMA, held-out)', 'fid': 'FID (EMA samples)',
                       'digits_class_fd': 'digits score (class FD; lower is better)'}[name])
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

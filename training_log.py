"""train.py's bookkeeping of progress, which a researcher rarely edits: the clock of training
time (evaluations, grids and checkpoints left out), metrics.jsonl rows (and TensorBoard), the
progress bar and curves.png."""
import contextlib
import os
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

import evaluation
from devices import device_name, peak_tflops, precision_of, synchronize
from files import JsonLines
from model import count_flops, count_params
from reports import provenance


class Metrics:
    """metrics.jsonl (and TensorBoard, with --tensorboard), curves.png and the progress bar (written
    on rank 0 only), and the clock of training time.

    Speed is of the training steps alone: the clock is paused while a grid, a checkpoint, the
    held-out loss or an evaluation runs, and the first step of a process (which compiles) is
    timed on its own as `first_step_s`. `train_seconds` sums the timed training time."""

    def __init__(self, run, step: int, total_steps: int, train_seconds: float = 0.0,
                 wall_seconds: float = 0.0):  # run: a train.Run
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
            evaluation.write_curves(self.path, os.path.join(self.run.cfg.out_dir, 'curves.png'))
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

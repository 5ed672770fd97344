"""Train a DDPM UNet: python train.py --help

Single process:  python train.py --dataset digits --preset tiny --image-size 16 --epochs 20 --device cpu
Multi-GPU (DDP): torchrun --nproc_per_node 8 train.py --batch-size 1024
Exit codes: 0 done (or stopped by SIGTERM/Ctrl-C with a checkpoint saved), 1 a write failed,
2 bad input, 3 non-finite loss (the last good checkpoint is kept), 130 a second Ctrl-C.

The file reads in the order a run happens: the lr and EMA schedules, building the run, the step,
the loop, main. What a researcher rarely edits lives beside it: the flags, their defaults and
validation in train_config.py; what every training loop shares (the data and its loader, the EMA
update, resume states, the non-finite checks) in bookkeeping.py; the checkpoint's state in
checkpoint.py; the log (metrics.jsonl, the bar, grids, curves) in training_log.py; the evaluations
in evaluation.py.
"""
import contextlib
import copy
import math
import os
import sys
import typing
from dataclasses import asdict

import torch
import torch.distributed as dist

import data
import diffusion
from bookkeeping import (Ranks, Run, agreed_stop, any_rank, ema_update, finite_mean_loss, init_process_group,
                         setup_distributed, training_data)
from checkpoint import (already_done, check_resumable, check_same_data, initial_weights, restore, resume_settings,
                        save_if_good, warn_of_changes)
from cli import StopFlag, StopRequested, changed_fields, given_fields, parse_config, run_main
from devices import autocast, pick_device
from evaluation import evaluate, score_reached
from model import UNet
from train_config import (NUM_TIMESTEPS, TrainConfig, attention_note, claim_outputs, model_config_of, resolve_defaults,
                          validate, with_recipe)
from training_log import finish_run, log_interval, start_logging, write_sample_grid

# ----------------------------------------------------------------------------- schedules

def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warm-up to cfg.lr over cfg.warmup steps, then constant (the paper's schedule), or with
    --lr-decay a cosine or linear decay to 0 at the planned last step, total_steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_decay == 'none':
        return cfg.lr
    done = min(1.0, (step - cfg.warmup + 1) / max(1, total_steps - cfg.warmup))  # 1 at the last step
    return cfg.lr * (0.5 * (1 + math.cos(math.pi * done)) if cfg.lr_decay == 'cosine' else 1 - done)


def ema_decay_at(step: int, cfg: TrainConfig) -> float:
    """The EMA decay ramps up from 0.1 so that short runs have a useful EMA; it reaches the
    paper's 0.9999 after ~90k steps. With --ema-length r (Karras et al. 2022) its half-life is
    r times the images seen: decay 0.5^(batch / (r * images)) = 0.5^(1 / (r (step + 1)))."""
    if cfg.ema_length:
        return min(cfg.ema_decay, 0.5 ** (1 / (cfg.ema_length * (step + 1))))
    return min(cfg.ema_decay, (1 + step) / (10 + step))


# ----------------------------------------------------------------------------- building the run

def build_run(cfg: TrainConfig, device, rank=0, world_size=1, dataset=None, progress=True, make_model=None,
              stop=None, control_group=None, flags=None, init: dict = None) -> Run:
    """Model, EMA, optimizer, schedule and loader for a resolved config (see resolve_defaults).
    make_model(config) builds another network in place of ours (the benchmark's peer row); `init`
    is a state dict that the model and the EMA start from (--init-from)."""
    torch.manual_seed(cfg.seed)
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    if dataset is None:
        dataset = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.shapes_count, cfg.class_cond)
    train_data = training_data(dataset, cfg.image_size, cfg.data_dir, cfg.batch_size, cfg.seed, device,
                               data.flipped_in_training(cfg.dataset), cfg.loader, cfg.num_workers,
                               Ranks(rank, world_size), progress, classes=cfg.class_cond)
    model = (make_model or UNet)(model_config_of(cfg)).to(device)
    if init is not None:
        model.load_state_dict(init)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = copy.deepcopy(model).eval().requires_grad_(False) if rank == 0 else None
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.adam_beta2),
                                 fused=cfg.fused_adam or None)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == 'fp16')
    torch.manual_seed(cfg.seed + rank)  # each rank its own timesteps, noise and dropout
    net = model
    if world_size > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)  # a single-device module: no device_ids needed
    sched = diffusion.make_schedule(NUM_TIMESTEPS, cfg.schedule).to(device)
    compute_loss = make_loss(cfg, net, sched, device, fullgraph=world_size == 1)  # dynamo breaks at DDP's forward
    return Run(cfg, device, rank, world_size, model, ema, compute_loss, optimizer, scaler, sched, train_data.loader,
               train_data.kind, train_data.identity, stop or StopFlag(), control_group, flags or {})


# ----------------------------------------------------------------------------- the training step

def make_loss(cfg: TrainConfig, net, sched: diffusion.Schedule, device, **compile_options) -> typing.Callable:
    """x0 -> L_simple of the batch (diffusion.training_loss) in the run's layout and precision.
    With --compile it is one graph from the batch to the loss: timesteps, noise, q_sample, the
    network and the MSE, forward and backward, so that CUDA graphs (reduce-overhead,
    max-autotune) cover all of it and the elementwise work fuses into the network's kernels.
    The learning rate and the EMA decay stay outside the graph: their schedules cannot cause
    recompiles. compile_options go to torch.compile (the tests and the benchmark pick backends)."""
    t_probs = None if cfg.t_sampling == 'uniform' else diffusion.timestep_probabilities(
        sched, cfg.t_sampling, cfg.t_mean, cfg.t_scale).to(device)
    net_classes = getattr(net, 'module', net).config.num_classes if cfg.class_cond else 0

    def compute_loss(x0, labels=None, noise=None):
        if cfg.channels_last:
            x0 = x0.contiguous(memory_format=torch.channels_last)
        if labels is not None:  # --class-cond: some labels become "no class" (index num_classes)
            labels = diffusion.drop_labels(labels, cfg.label_drop, net_classes)
        with autocast(cfg.amp, device):
            return diffusion.training_loss(net, sched, x0, noise=noise, prediction=cfg.prediction,
                                           loss_weight=cfg.loss_weight, snr_gamma=cfg.snr_gamma or 5.0,
                                           t_probs=t_probs, t_reweight=cfg.t_reweight,
                                           input_perturbation=cfg.input_perturbation, labels=labels)
    if cfg.compile:
        mode = None if cfg.compile_mode == 'default' else cfg.compile_mode
        compute_loss = torch.compile(compute_loss, **{'fullgraph': True, 'mode': mode, **compile_options})
    if not cfg.immiscible:
        return compute_loss
    # scipy's assignment cannot enter a graph: the noise is drawn and assigned before it, then passed in
    return lambda x0, labels=None: compute_loss(x0, labels, diffusion.immiscible_noise(x0, torch.randn_like(x0)))


def train_step(run: Run, batch, step: int) -> torch.Tensor:
    """One optimizer step on a batch (images, or (images, labels) with --class-cond); returns the
    loss without synchronising with the host."""
    cfg = run.cfg
    for group in run.optimizer.param_groups:
        group['lr'] = lr_at(step, cfg, run.total_steps)  # a float argument of fused Adam's kernel: no sync
    loss = run.compute_loss(*batch) if isinstance(batch, tuple) else run.compute_loss(batch)
    run.scaler.scale(loss).backward()
    if cfg.grad_clip > 0:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)  # no host sync
    run.scaler.step(run.optimizer)  # fused Adam takes the inf check on the device: no host sync
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        ema_update(run.ema, run.model, ema_decay_at(step, cfg))
    return loss.detach()


def batches(run: Run, step: int):
    """The run's batches from `step` on, across epochs."""
    return run.loader.batches(step)


# ----------------------------------------------------------------------------- the loop

def evaluate_for_stop(run: Run, evaluator, log, step: int) -> tuple:
    """The evaluation due at `step`: (still owed, since a stop cut it short; reached --stop-at-score, on
    every rank's word)."""
    scored = evaluate(run, evaluator, log, step)
    if scored is None:
        return True, False
    return False, any_rank(score_reached(run.cfg, scored), run.control_group)


def train(run: Run, step: int, log, heldout=None, evaluator=None, eval_owed: bool = False) -> dict:
    """Training steps; after each, when due: a log row with the held-out losses, an evaluation,
    a checkpoint, a sample grid. The device is synchronised only at log rows and checkpoints.
    On SIGTERM or Ctrl-C the step finishes and the checkpoint is saved at once: no evaluation
    (the resumed run owes it), no grid."""
    cfg, per_epoch = run.cfg, run.loader.batches_per_epoch
    total_steps = run.total_steps
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    last_good = f'{cfg.resume} (step {step}, resumed from)' if cfg.resume else None
    loss_sum, unlogged, stopped, row = torch.zeros((), device=run.device), 0, None, {}
    log.start_loop()
    eval_owed = eval_owed and evaluator is not None
    if eval_owed:  # the last process was stopped at an evaluation: it comes first
        eval_owed, reached = evaluate_for_stop(run, evaluator, log, step)
        # The run ends here as the uninterrupted one would have: at its target, at --stop-at-score
        # (the owed score reached it), or stopped again during this evaluation (still owed, at this step).
        if step >= total_steps or reached or eval_owed:
            save_if_good(run, step, log, eval_owed, ckpt_path, heldout, row, last_good)
            return finish_run(run, step, run.stop.reason if eval_owed else None, log, ckpt_path)
    try:
        for x0 in batches(run, step):
            # Step.
            loss_sum += train_step(run, x0, step)
            step, unlogged = step + 1, unlogged + 1
            log.after_step()
            at_end = step >= total_steps
            stopped = agreed_stop(run.stop, run.control_group, ask=step % 10 == 0 or at_end)
            eval_owed = eval_owed or (evaluator is not None and evaluator.due(step))
            must_save = (cfg.ckpt_every and step % cfg.ckpt_every == 0) or at_end or stopped
            # Log: the interval's mean loss (its one host sync; never past a non-finite loss). With
            # --stop-at-score also before each evaluation, which may end the run.
            if step % cfg.log_every == 0 or at_end or (must_save and unlogged) or (eval_owed and cfg.stop_at_score):
                mean_loss = finite_mean_loss(loss_sum, unlogged, step, last_good, run.ranks)
                row = log_interval(run, log, heldout, step, unlogged, mean_loss, lr_at(step - 1, cfg, total_steps),
                                   with_heldout=not stopped)
                loss_sum.zero_()
                unlogged = 0
            # Evaluate: FID and bits/dim of the EMA, every --eval-every training images.
            if eval_owed and not stopped:
                eval_owed, reached = evaluate_for_stop(run, evaluator, log, step)
                if eval_owed:  # cut short by a stop: save now
                    stopped = must_save = run.stop.reason
                elif reached:  # --stop-at-score: the run's end
                    at_end = must_save = True
            # Checkpoint, once proven good (finite weights and held-out losses), before the grid.
            if must_save:
                save_if_good(run, step, log, eval_owed, ckpt_path, heldout, row, last_good)
                last_good = f'{ckpt_path} (step {step})'
            if at_end or stopped:
                break
            # Sample grid at the end of every --sample-every'th epoch.
            if step % per_epoch == 0 and cfg.sample_every and (step // per_epoch) % cfg.sample_every == 0:
                write_sample_grid(run, log, os.path.join(cfg.samples_dir, f'epoch_{step // per_epoch:04d}.png'), step)
    finally:
        log.bar.close()
    return finish_run(run, step, stopped, log, ckpt_path)


# ----------------------------------------------------------------------------- main

def main(cfg: TrainConfig, given: set = None) -> dict:
    """A run of cfg. `given`: the fields set on the command line (default: those that differ
    from their defaults); a resumed run replays its checkpoint's flags with these on top."""
    rank, local_rank, world_size = setup_distributed()
    stop, release_lock = StopFlag(), lambda: None
    restore_signals = stop.install()  # first thing: a stop during start-up ends the run cleanly too
    try:
        given = changed_fields(cfg) if given is None else given
        cfg, flags, ckpt = resume_settings(cfg, given)
        device = pick_device(cfg.device, local_rank)
        cfg = resolve_defaults(cfg, device)
        validate(cfg, device, world_size, resuming=ckpt is not None)
        if rank == 0 and (note := attention_note(cfg)):
            print(note, flush=True)
        if ckpt is not None and 'init_from' in given and rank == 0:
            print(f'--init-from {cfg.init_from} is not read: a resumed run continues from the weights of '
                  f'{cfg.resume}', flush=True)
        if ckpt is not None:
            check_resumable(ckpt, f'--resume {cfg.resume}', asdict(cfg), model_config_of(cfg), world_size)
            warn_of_changes(ckpt, cfg)
            if done := already_done(ckpt, cfg):
                return done
        init = (initial_weights(cfg.init_from, model_config_of(cfg), cfg.prediction) if cfg.init_from and ckpt is None
                else None)
        release_lock = claim_outputs(cfg, rank, fresh=ckpt is None)
        control_group = init_process_group(device, rank, world_size)
        # A stop during start-up (data, model, reference statistics) ends one process at once:
        # nothing was trained. Under DDP the ranks first meet in the loop, where they agree on stops.
        with stop.interruptible() if world_size == 1 else contextlib.nullcontext():
            run = build_run(cfg, device, rank, world_size, progress=rank == 0, stop=stop,
                            control_group=control_group, flags=flags, init=init)
            if ckpt is not None:
                check_same_data(ckpt, f'--resume {cfg.resume}', run.data_identity, cfg.data_dir)
            step = restore(run, ckpt) if ckpt else 0
            log, heldout, evaluator = start_logging(run, step, *(ckpt.get(key, 0.0) if ckpt else 0.0
                                                                 for key in ('train_seconds', 'wall_seconds')))
        return train(run, step, log, heldout, evaluator, eval_owed=bool(ckpt and ckpt.get('eval_owed')))
    except StopRequested:
        print(f'stopped by {stop.reason} before training started: nothing to save', flush=True)
        return {'step': ckpt['step'] if ckpt else 0, 'stopped': stop.reason, 'last': {}, 'checkpoint': cfg.resume}
    finally:
        restore_signals()
        release_lock()
        if dist.is_initialized():
            dist.destroy_process_group()


def cli(argv=None) -> int:
    argv = with_recipe(sys.argv[1:] if argv is None else argv)
    return run_main(main, parse_config(argv, TrainConfig, __doc__), given_fields(argv, TrainConfig))


if __name__ == '__main__':
    sys.exit(cli())

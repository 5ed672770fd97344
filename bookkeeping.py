"""A training run's bookkeeping, written once for every training loop (train.py's, distill.py's): the
training data with its loader and identity, the EMA update, the states that an exact resume puts back
(weights, optimizer, grad scaler, random generators), the checks that keep a non-finite loss or weight
out of every checkpoint, and the ranks under torchrun with the small collectives through which they
agree (a stop, a start-up failure, gathered results, identical weights). `Run` is what one train.py
process holds; the modules that log, evaluate and save it import it from here, so that its fields are
visible where they are read."""
import contextlib
import dataclasses
import math
import os
import typing
from dataclasses import dataclass

import torch
import torch.distributed as dist

import data
import diffusion
import loaders
from cli import ConfigError, NonFiniteLoss, StopFlag, brief


@dataclass(frozen=True)
class Ranks:
    """Where a process stands under DDP: its rank, the number of ranks, and the CPU process group of
    their control messages (None in one process)."""
    rank: int = 0
    world_size: int = 1
    control_group: typing.Any = None


# ----------------------------------------------------------------------------- the training data

@dataclass
class TrainingData:
    """A loader of the training set and what a resume must find again: `identity` holds the image
    count, the fingerprint (data.fingerprint) and, for a class-conditional run, the class names."""
    loader: typing.Any  # loaders.make_loader's: .batches(step), .batches_per_epoch
    kind: str  # 'gpu', 'torch' or 'ffcv' (loaders.choose_loader)
    identity: dict


def data_identity(dataset, classes: bool) -> dict:
    """What a resumed or distilled run checks against its checkpoint: the same images (and classes)."""
    identity = {'count': len(dataset), 'fingerprint': data.fingerprint(dataset)}
    if classes:  # the classes are part of what was learnt: a resume must see the same ones
        identity['classes'] = list(dataset.class_names)
    return identity


def training_data(dataset, image_size: int, data_dir: str, batch_size: int, seed: int, device, flip: bool,
                  loader: str = 'auto', workers: int = 4, ranks: Ranks = Ranks(), progress: bool = True,
                  classes: bool = False) -> TrainingData:
    """The loader of `dataset` (loaders.choose_loader picks it for 'auto'), after checking that it holds
    images of `image_size`; each rank draws batch_size / world_size images of every batch."""
    first = data.first_image(dataset, image_size, data_dir)
    kind = loaders.choose_loader(loader, len(dataset) * first.numel(), device)
    made = loaders.make_loader(kind, dataset, batch_size // ranks.world_size, seed, device, workers, ranks.rank,
                               ranks.world_size, progress, flip)
    return TrainingData(made, kind, data_identity(dataset, classes))


# ----------------------------------------------------------------------------- what one train.py process holds

@dataclass
class Run:
    """Everything one train.py process holds. `compute_loss` is what the step calls: the loss of a batch
    (train.make_loss; the model inside it maybe wrapped in DDP, the whole of it in torch.compile);
    `model` the plain module whose state is saved; `ema` exists on rank 0 only. `stop` is set by
    SIGTERM/Ctrl-C; `control_group` is a CPU process group for the ranks' control messages under DDP."""
    cfg: typing.Any  # train_config.TrainConfig (not imported: train_config imports the evaluation module)
    device: torch.device
    rank: int
    world_size: int
    model: torch.nn.Module
    ema: torch.nn.Module | None
    compute_loss: typing.Callable  # x0 -> L_simple of the batch, without a host sync
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sched: diffusion.Schedule
    loader: typing.Any
    loader_kind: str
    data_identity: dict  # {'count', 'fingerprint'} of the training images, checked on resume
    stop: StopFlag = dataclasses.field(default_factory=StopFlag)
    control_group: typing.Any = None
    flags: dict = dataclasses.field(default_factory=dict)  # the settings given, replayed by --resume

    @property
    def total_steps(self) -> int:  # the run's planned length
        return self.cfg.steps or self.cfg.epochs * self.loader.batches_per_epoch

    @property
    def ranks(self) -> Ranks:
        return Ranks(self.rank, self.world_size, self.control_group)


# ----------------------------------------------------------------------------- the EMA

@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float):
    """ema = decay * ema + (1 - decay) * model, in one fused multi-tensor kernel."""
    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - decay)


# ----------------------------------------------------------------------------- states an exact resume puts back

def rng_states(device) -> dict:
    """This process's random generators: the CPU's, and the GPU's on a CUDA device."""
    return {'cpu': torch.get_rng_state(), 'cuda': torch.cuda.get_rng_state(device) if device.type == 'cuda' else None}


def set_rng_states(states: dict, device):
    torch.set_rng_state(states['cpu'])
    if device.type == 'cuda' and states.get('cuda') is not None:
        torch.cuda.set_rng_state(states['cuda'], device)


@contextlib.contextmanager
def replayed_randomness(device):
    """Runs the block, then puts the random state back as it was before it, so that a second pass draws
    the same dropout masks (ECT's shared dropout between the two sides of the consistency loss)."""
    states = rng_states(device)
    yield
    set_rng_states(states, device)


def load_states(named_as: str, pairs: list):
    """Each (module, optimizer or scaler; its saved state) pair loaded; a state that does not fit is one
    line naming the checkpoint (`named_as`, such as '--resume PATH'). A None holder is skipped."""
    try:
        for holder, state in pairs:
            if holder is not None:
                holder.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as error:
        raise ConfigError(f'{named_as}: its states do not fit this run ({brief(error)})') from None


# ----------------------------------------------------------------------------- nothing non-finite is kept

def last_good_note(last_good: str | None) -> str:
    return f'The last good checkpoint is {last_good}.' if last_good else 'No checkpoint was written by this run.'


def finite_mean_loss(loss_sum: torch.Tensor, steps: int, step: int, last_good: str | None,
                     ranks: Ranks = Ranks()) -> float:
    """The mean loss of the last `steps` steps (up to `step`) over all ranks: a loop's one host
    synchronisation per log interval. A non-finite one stops the run before anything is logged or saved."""
    if ranks.world_size > 1:
        loss_sum = loss_sum.clone()
        dist.all_reduce(loss_sum)
    mean_loss = loss_sum.item() / (steps * ranks.world_size)
    if not math.isfinite(mean_loss):
        raise NonFiniteLoss(f'the loss became {mean_loss} between steps {step - steps + 1} and {step}; stopping. '
                            + last_good_note(last_good))
    return mean_loss


def weights_finite(module: torch.nn.Module) -> bool:
    return bool(torch.stack([p.isfinite().all() for p in module.parameters()]).all())  # one host sync


# ----------------------------------------------------------------------------- ranks under torchrun

def setup_distributed():
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) without it."""
    world_size = int(os.environ.get('WORLD_SIZE', 1))
    if world_size == 1:
        return 0, 0, 1
    return int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), world_size


def init_process_group(device: torch.device, rank: int, world_size: int):
    """NCCL (GPU) or gloo (CPU) for the gradients; returns a CPU group for control messages (a
    stop, a start-up failure, gathered results), which then need no GPU synchronisation. None
    in one process."""
    if world_size == 1:
        return None
    if device.type == 'cuda':
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo', rank=rank, world_size=world_size)
    return dist.new_group(backend='gloo')


def any_rank(flag: bool, group) -> bool:
    """Whether the flag is set on any rank (every rank must call); the flag itself in one process."""
    if group is None:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def on_all_ranks(make, group):
    """make() on this rank; if it raised one of our errors (an `exit_code`) or an OSError on any
    rank, every rank raises (a lone failure would leave the others waiting in a collective)."""
    error = None
    try:
        result = make()
    except Exception as failure:
        if not (isinstance(failure, OSError) or hasattr(failure, 'exit_code')):
            raise
        error, result = failure, None
    if any_rank(error is not None, group):
        raise error or ConfigError('another rank failed during start-up (its error is above)')
    return result


def gather_to_rank0(values: tuple, rank: int, world_size: int, group) -> list:
    """For each of the values, the list of every rank's on rank 0 (None elsewhere)."""
    if world_size == 1:
        return [[item] for item in values]
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(values, gathered, dst=0, group=group)
    return [list(items) for items in zip(*gathered)] if rank == 0 else [None] * len(values)


@torch.no_grad()
def ranks_identical(model: torch.nn.Module, group) -> bool:
    """Whether every rank's weights equal rank 0's, bit for bit."""
    # reshape, not parameters_to_vector's view: channels-last weights are not contiguous in NCHW order
    weights = torch.cat([p.reshape(-1) for p in model.parameters()])
    reference = weights.clone()
    dist.broadcast(reference, src=0)
    return not any_rank(not torch.equal(weights, reference), group)


def agreed_stop(stop, group, ask: bool):
    """The stop the ranks agree on (`stop` a cli.StopFlag): its signal in one process; under DDP (a
    control `group`) a signal to any rank, asked only when `ask` is true on every rank at once,
    since each must take part."""
    if group is None:
        return stop.reason
    if ask and any_rank(stop.reason is not None, group):
        return stop.reason or 'a signal on another rank'
    return None

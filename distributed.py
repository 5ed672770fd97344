"""Ranks under torchrun: the process groups, and the small collectives through which the ranks agree
(a stop, a start-up failure, gathered results, identical weights)."""
import os

import torch
import torch.distributed as dist

from cli import ConfigError


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

"""The loaders: how batches reach the step. Every loader yields float images in [-1, 1] on the
device, and the order of each epoch (a permutation and a flip per image, no flips for digits) is a
function of (seed, epoch) alone, the same for every loader, so that a resumed run sees exactly the
batches an uninterrupted one would have. `gpu` keeps the whole uint8 set on the device and gathers,
flips and converts each batch there, with no host work per step; `torch` is a DataLoader with
workers and pinned memory; `ffcv` reads a .beton file (optional). The data sets are data.py's."""
import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from data import LOADERS, BetonDataset, DataError, _ffcv_pipeline, dataset_images


def epoch_order(num_images: int, seed: int, epoch: int):
    """The permutation and horizontal flips of one epoch: a function of (seed, epoch) only."""
    state = np.random.SeedSequence([seed, epoch]).generate_state(1)[0]
    generator = torch.Generator().manual_seed(int(state))
    permutation = torch.randperm(num_images, generator=generator)
    flips = torch.rand(num_images, generator=generator) < 0.5
    return permutation, flips


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without stalling the host: from pinned memory, a copy that
    is queued on the stream (a pageable source makes .to() wait for the copy). The pinned
    buffer is not reused before the copy ends (the caching host allocator records it)."""
    if torch.device(device).type != 'cuda':
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_model_input(images: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, H, W) and (B,) flip flags -> float32 in [-1, 1], flipped where asked."""
    images = torch.where(flips[:, None, None, None], images.flip(-1), images)
    return images.float() / 127.5 - 1.0


class Loader:
    """Batches of one rank: `epoch(e, start)` yields batches start, start+1, ... of epoch e.

    Each rank takes every world_size-th image of the epoch's permutation, and every epoch
    has num_images // world_size // batch_size full batches (drop-last). flip=False: no image
    is flipped (the permutation is the same). Given `labels` ((N,) int64, on the host), each
    batch comes with its images' labels on the device: (images, labels)."""

    def __init__(self, num_images: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 flip: bool = True, labels: torch.Tensor = None):
        self.num_images, self.batch_size, self.seed = num_images, batch_size, seed
        self.rank, self.world_size, self.flip, self.labels = rank, world_size, flip, labels
        self.batches_per_epoch = num_images // world_size // batch_size
        if self.batches_per_epoch < 1:
            raise DataError(f'batch size {batch_size * world_size} is larger than the data set '
                            f'({num_images} images): pass a smaller --batch-size')

    def batches(self, step: int):
        """The batches from the run's `step` on, across epochs (train.py's and distill.py's loops)."""
        while True:
            epoch, start = divmod(step, self.batches_per_epoch)
            for batch in self.epoch(epoch, start):
                yield batch
                step += 1

    def shard(self, epoch: int):
        permutation, flips = epoch_order(self.num_images, self.seed, epoch)
        flips &= self.flip
        used = self.batches_per_epoch * self.batch_size * self.world_size
        return permutation[self.rank:used:self.world_size], flips[self.rank:used:self.world_size]


def as_batch(images: torch.Tensor, labels: torch.Tensor = None):
    """A batch as the training loop takes it: the images, or (images, labels) for a labelled set."""
    return images if labels is None else (images, labels)


class GPULoader(Loader):
    """The whole uint8 set on the device; gather, flip and convert there: no host work per step."""

    def __init__(self, images: torch.Tensor, batch_size: int, seed: int, device, rank=0, world_size=1, flip=True,
                 labels: torch.Tensor = None):
        super().__init__(len(images), batch_size, seed, rank, world_size, flip, labels)
        self.images = images.to(device)
        self.device_labels = labels.to(device) if labels is not None else None
        self.device = device

    def epoch(self, epoch: int, start: int = 0):
        indices, flips = (to_device_async(t, self.device) for t in self.shard(epoch))
        for b in range(start, self.batches_per_epoch):
            batch = slice(b * self.batch_size, (b + 1) * self.batch_size)
            labels = self.device_labels[indices[batch]] if self.device_labels is not None else None
            yield as_batch(to_model_input(self.images[indices[batch]], flips[batch]), labels)


class _BatchList:
    """A batch sampler whose batches are set before each epoch; persistent workers keep it."""

    def __init__(self):
        self.batches = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class TorchLoader(Loader):
    """A DataLoader (workers, pinned memory, persistent workers) that yields uint8 batches;
    the conversion to float and the flips happen on the device."""

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, device, num_workers: int = 4,
                 rank=0, world_size=1, flip=True, labels: torch.Tensor = None):
        super().__init__(len(dataset), batch_size, seed, rank, world_size, flip, labels)
        self.device = torch.device(device)
        self.batch_list = _BatchList()
        # Its own generator: the DataLoader draws a worker seed per epoch, which must not move
        # the global RNG (timesteps, noise, dropout) or a resumed run would drift.
        self.loader = DataLoader(dataset, batch_sampler=self.batch_list, num_workers=num_workers,
                                 pin_memory=self.device.type == 'cuda', persistent_workers=num_workers > 0,
                                 generator=torch.Generator().manual_seed(seed))

    def epoch(self, epoch: int, start: int = 0):
        indices, flips = self.shard(epoch)
        flips = flips.to(self.device)
        self.batch_list.batches = [indices[b * self.batch_size:(b + 1) * self.batch_size].tolist()
                                   for b in range(start, self.batches_per_epoch)]
        for b, images in zip(range(start, self.batches_per_epoch), self.loader):
            batch = slice(b * self.batch_size, (b + 1) * self.batch_size)
            labels = to_device_async(self.labels[indices[batch]], self.device) if self.labels is not None else None
            yield as_batch(to_model_input(images.to(self.device, non_blocking=True), flips[batch]), labels)


def choose_loader(kind: str, dataset_bytes: int, device) -> str:
    """'auto': the device-resident loader ('gpu') when the uint8 set takes under a quarter of
    the device's free memory (RAM for the CPU), else the DataLoader."""
    if kind != 'auto':
        return kind
    device = torch.device(device)
    if device.type == 'cuda':
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
    return 'gpu' if dataset_bytes < free / 4 else 'torch'


class _FixedOrder:
    """An FFCV traversal order that is exactly the given indices (FFCV's own orders would not
    match the other loaders' epoch order)."""

    def __init__(self, indices):
        self.indices = np.asarray(indices, dtype='uint64')

    def sample_order(self, epoch):
        return self.indices


class FFCVLoader(Loader):
    """FFCV's Loader: JIT-compiled decoding in worker threads, the batch moved to the device
    inside its pipeline; the epoch order, flips and conversion are the same as the other
    loaders' (flips and conversion run on the device, like theirs)."""

    def __init__(self, dataset: BetonDataset, batch_size: int, seed: int, device, num_workers: int = 4,
                 rank=0, world_size=1, flip=True, labels: torch.Tensor = None):
        import numba
        from ffcv.loader import Loader as FFCVLoaderBase
        from ffcv.loader import OrderOption
        super().__init__(len(dataset), batch_size, seed, rank, world_size, flip, labels)
        self.device = torch.device(device)
        self.num_workers = max(1, min(num_workers, numba.config.NUMBA_NUM_THREADS))  # numba's ceiling: the cores
        self.ffcv = FFCVLoaderBase(dataset.path, batch_size=batch_size, num_workers=self.num_workers, drop_last=True,
                                   order=OrderOption.SEQUENTIAL, os_cache=True,
                                   pipelines={'image': _ffcv_pipeline(self.device), 'label': None})

    def epoch(self, epoch: int, start: int = 0):
        indices, flips = self.shard(epoch)
        self.ffcv.traversal_order = _FixedOrder(indices[start * self.batch_size:].numpy())
        flips = flips.to(self.device)
        for b, (images,) in zip(range(start, self.batches_per_epoch), self.ffcv):
            batch = slice(b * self.batch_size, (b + 1) * self.batch_size)
            labels = to_device_async(self.labels[indices[batch]], self.device) if self.labels is not None else None
            yield as_batch(to_model_input(images, flips[batch]), labels)


def make_loader(kind: str, dataset: Dataset, batch_size: int, seed: int, device, num_workers: int = 4,
                rank: int = 0, world_size: int = 1, progress: bool = True, flip: bool = True):
    """The loader `kind` of a data set; with the set's labels where it holds them (load_dataset(labels=True))."""
    labels = getattr(dataset, 'labels', None)
    if kind == 'gpu':
        return GPULoader(dataset_images(dataset, progress), batch_size, seed, device, rank, world_size, flip, labels)
    if kind == 'torch':
        return TorchLoader(dataset, batch_size, seed, device, num_workers, rank, world_size, flip, labels)
    if kind == 'ffcv':
        if not isinstance(dataset, BetonDataset):
            raise DataError('--loader ffcv reads a .beton file: pass --data-dir FILE.beton '
                            '(write one with python data.py --write-beton FILE.beton --dataset ...)')
        return FFCVLoader(dataset, batch_size, seed, device, num_workers, rank, world_size, flip, labels)
    raise DataError(f"unknown loader {kind!r}; choose one of {', '.join(LOADERS)}")

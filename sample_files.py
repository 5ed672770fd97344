"""sample.py's files: one PNG per image or one .npz, written batch by batch (each file whole or not at
all), continued where a stopped run left them, read back for scoring, and OUT/samples.json, the settings
a folder's samples were drawn with, which a rerun must match. `cfg` is sample.SampleConfig (these read
its ckpt, out, num, batch_size, format and the SETTINGS); `config` the model's UNetConfig."""
import hashlib
import json
import math
import os
import shutil
import typing
import zipfile

import numpy as np
import torch

from cli import ConfigError
from files import atomic_open, atomic_path

MANIFEST = 'samples.json'  # the settings a folder's samples were drawn with: a rerun must match them
SETTINGS = ('weights', 'num', 'sampler', 'steps', 'eta', 'spacing', 'variance', 'clip', 'batch_size', 'format',
            'grid', 'seed', 'amp', 'label', 'guidance')


def sample_settings(cfg) -> dict:
    """What decides the images: the checkpoint (its path and the sha256 of its bytes, or of a
    diffusers folder's files) and the sampling flags."""
    digest = hashlib.sha256()
    files = [cfg.ckpt] if os.path.isfile(cfg.ckpt) else sorted(
        os.path.join(folder, name) for folder, _, names in os.walk(cfg.ckpt) for name in names)
    for path in files:
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 24), b''):
                digest.update(block)
    mid = {} if getattr(cfg, 'mid_timestep', None) is None else {'mid_timestep': cfg.mid_timestep}  # consistency-2
    return {'ckpt': os.path.realpath(cfg.ckpt), 'ckpt_sha256': digest.hexdigest(),
            **{name: getattr(cfg, name) for name in SETTINGS}, **mid}


def batch_paths(cfg, index: int) -> list:
    """The files batch `index` is written to: its PNGs, or its part of the .npz."""
    if cfg.format == 'npz':
        return [os.path.join(cfg.out, 'parts', f'batch_{index:06d}.npy')]
    first = index * cfg.batch_size
    return [os.path.join(cfg.out, f'{i:06d}.png') for i in range(first, min(first + cfg.batch_size, cfg.num))]


def npz_path(cfg, size: int) -> str:
    """OUT/samples_NxS.npz: one uint8 (N, S, S, C) array."""
    return os.path.join(cfg.out, f'samples_{cfg.num}x{size}.npz')


def write_batch(images: torch.Tensor, paths: list, file_format: str):
    """One batch of uint8 (B, C, H, W) images, each file written whole or not at all: PNGs in RGB,
    or grey ('L') for one channel."""
    from PIL import Image
    pixels = images.permute(0, 2, 3, 1).numpy()  # (B, H, W, C)
    if file_format == 'npz':
        with atomic_open(paths[0], 'wb', durable=False) as f:
            np.save(f, pixels)
        return
    for path, image in zip(paths, pixels):
        with atomic_open(path, 'wb', durable=False) as f:
            Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(f, format='png')


def assemble_npz(cfg, config, num_batches: int) -> str:
    """The parts, in order, as one uint8 (N, H, W, C) array 'arr_0' of an .npz, streamed: memory
    holds one part at a time."""
    size = config.image_size
    path = npz_path(cfg, size)
    header = {'descr': '|u1', 'fortran_order': False, 'shape': (cfg.num, size, size, config.in_channels)}
    with atomic_path(path) as tmp, zipfile.ZipFile(tmp, 'w') as archive, \
            archive.open('arr_0.npy', 'w', force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, header)
        for index in range(num_batches):
            f.write(np.load(batch_paths(cfg, index)[0]).tobytes())
    shutil.rmtree(os.path.join(cfg.out, 'parts'))
    return path


def written_batches(cfg, config) -> typing.Iterator[torch.Tensor]:
    """The samples on disk, as uint8 (B, C, H, W) batches: what FID measures (and what any other
    tool would read)."""
    from PIL import Image
    size, channels = config.image_size, config.in_channels
    if cfg.format == 'png':
        for index in range(math.ceil(cfg.num / cfg.batch_size)):
            images = []
            for path in batch_paths(cfg, index):
                with Image.open(path) as image:
                    pixels = np.asarray(image.convert('L' if channels == 1 else 'RGB')).reshape(size, size, channels)
                    images.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1))
            yield torch.stack(images)
        return
    with zipfile.ZipFile(npz_path(cfg, size)) as archive, archive.open('arr_0.npy') as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
        count = read_header(f)[0][0]
        for start in range(0, count, cfg.batch_size):
            n = min(cfg.batch_size, count - start)
            pixels = np.frombuffer(f.read(n * size * size * channels), np.uint8).reshape(n, size, size, channels)
            yield torch.from_numpy(pixels.copy()).permute(0, 3, 1, 2)


def our_samples(cfg, settings: dict) -> bool:
    """Whether --out (claimed by this run) holds samples of these very settings, to continue. Samples
    are written only into an empty folder or one of ours (its samples.json): a folder of other files
    is refused, since a user's 000000.png or grid.png would be overwritten, and so is one holding
    samples drawn with other settings."""
    path = os.path.join(cfg.out, MANIFEST)
    others = sorted(set(os.listdir(cfg.out)) - {'lock', MANIFEST})
    if others and not os.path.isfile(path):
        raise ConfigError(f"--out {cfg.out} holds files that sample.py did not write ({', '.join(others[:3])}"
                          f"{', ...' if len(others) > 3 else ''}; no {MANIFEST}): pass an empty or new folder")
    if not (any(name.endswith(('.png', '.npz')) for name in others) or 'parts' in others):
        return False
    try:
        with open(path) as f:
            saved = json.load(f)
    except ValueError:
        saved = {}
    differing = [f'{k} {saved.get(k)!r}, now {v!r}' for k, v in settings.items() if saved.get(k) != v]
    if differing:
        raise ConfigError(f"--out {cfg.out} holds samples drawn with other settings ({'; '.join(differing[:3])}): "
                          f"pass another --out, or empty that one")
    return True


def continue_or_start(cfg, config) -> list:
    """The batches still to draw in --out: all of them, or those a stopped run of the same settings
    left (our_samples); refused when the disk cannot hold them. Records the settings."""
    settings = sample_settings(cfg)
    size, channels = config.image_size, config.in_channels
    batches = range(math.ceil(cfg.num / cfg.batch_size))
    todo = batches
    if our_samples(cfg, settings):
        # A batch's files are written in order, each whole: its last file is there once all are.
        todo = [] if cfg.format == 'npz' and os.path.isfile(npz_path(cfg, size)) else \
            [b for b in batches if not os.path.isfile(batch_paths(cfg, b)[-1])]
    count = cfg.num if todo is batches else sum(min(cfg.batch_size, cfg.num - b * cfg.batch_size) for b in todo)
    per_image = size * size * channels  # npz: the parts and the archive; png: a file takes a 4 kB block at least
    need = count * (2 * per_image if cfg.format == 'npz' else max(per_image, 4096))
    free = shutil.disk_usage(cfg.out).free
    if need > free:
        raise ConfigError(f'--num {cfg.num}: the samples need about {need / 1e9:.1f} GB and {cfg.out} has '
                          f'{free / 1e9:.1f} GB free: pass a smaller --num or another --out')
    write_manifest(cfg, settings)  # once every check has passed: a refused run leaves no settings behind
    return todo


def write_manifest(cfg, settings: dict):
    """OUT/samples.json: the settings the folder's samples are drawn with, which a rerun must match."""
    with atomic_open(os.path.join(cfg.out, MANIFEST)) as f:
        json.dump(settings, f, indent=1)

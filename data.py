"""The data sets. They hold uint8 images (N, C, H, W): `cifar10` (torchvision), `folder` (any tree
of PNG/JPEG files) and `shapes` (procedural, no download), RGB; `digits` (scikit-learn's 1,797
handwritten digits, no download), one channel, split once into training and held-out parts;
`beton`, an FFCV .beton file (optional), which this module also writes. The loaders that turn
them into batches on the device are loaders.py's.
Labels, for class-conditional training: CIFAR-10's ten classes, the ten digits, a folder's
subfolders (one per class) or a .beton's label field; a loader given them yields (images, labels).

    python data.py --write-beton OUT.beton --dataset cifar10|folder|shapes|digits   # a .beton for FFCV
"""
import functools
import os
import socket
import sys
import typing
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from tqdm import tqdm

from cli import ConfigError, brief, check_ranges, flag, parse_config, run_main
from files import atomic_path, check_writable

IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg')
HIGH_BIT_DEPTH_MODES = ('I;16', 'I;16B', 'I;16L', 'I;16N', 'I')
DATASETS = ('cifar10', 'folder', 'shapes', 'digits', 'beton')
LOADERS = ('auto', 'gpu', 'torch', 'ffcv')
SHAPES_HELDOUT_SEED = 1_000_003  # the held-out shapes come from their own stream
DIGITS_HELDOUT_SHARE = 0.25  # of each class: 450 held-out digits, 1,347 for training
DIGITS_SPLIT_SEED = 0  # the split is fixed: every run, seed and script holds out the same digits
CIFAR10_CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')


class DataError(Exception):
    """Bad or missing input data: one line on stderr, exit code 2."""
    exit_code = 2


# ----------------------------------------------------------------------------- data sets

class ImageTensorDataset(Dataset):
    """An in-memory uint8 image set: `images` is (N, C, H, W); `labels` (N,) int64 or None, the
    classes named by `class_names`."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor = None, class_names: list = None):
        self.images, self.labels, self.class_names = images, labels, class_names

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index]


class ImageFolderDataset(Dataset):
    """Every PNG/JPEG under a folder, decoded lazily, converted to RGB, resized (shorter side)
    and centre-cropped to image_size. Grayscale, RGBA and odd sizes are converted. With labels=True,
    each image's class is its top-level subfolder (folder_labels)."""

    def __init__(self, root: str, image_size: int, labels: bool = False):
        self.paths = list_image_files(root)
        self.image_size = image_size
        self.labels, self.class_names = folder_labels(root, self.paths) if labels else (None, None)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        return load_image(self.paths[index], self.image_size)

    def to_tensor(self, progress: bool = True) -> torch.Tensor:
        """Decodes every file into one (N, 3, S, S) uint8 tensor, in worker processes."""
        images = torch.empty(len(self), 3, self.image_size, self.image_size, dtype=torch.uint8)
        load = functools.partial(_load_array, image_size=self.image_size)
        for i, image in enumerate(map_files(load, self.paths, 'decoding images', progress)):
            images[i] = torch.from_numpy(image)
        return images


@functools.lru_cache(maxsize=None)
def _resize_and_crop(image_size: int):
    from torchvision import transforms
    return transforms.Compose([
        transforms.Resize(image_size, interpolation=transforms.InterpolationMode.BICUBIC, antialias=True),
        transforms.CenterCrop(image_size),
        transforms.PILToTensor(),
    ])


def load_image(path: str, image_size: int) -> torch.Tensor:
    """One file as (3, S, S) uint8: RGB, resized (shorter side, bicubic) and centre-cropped."""
    return _resize_and_crop(image_size)(open_rgb(path))


def _load_array(path: str, image_size: int) -> np.ndarray:
    return load_image(path, image_size).numpy()  # numpy crosses processes cheaply; tensors go through shared memory


def map_files(function, paths: list, desc: str, progress: bool = True) -> typing.Iterator:
    """function(path) for every path, in order, in worker processes for large sets. Processes,
    not threads: for small images most of the work is PIL's Python, under the GIL (measured in
    results/NOTES.md, "Decoding image folders")."""
    workers = min(16, os.cpu_count() or 1)
    bar = functools.partial(tqdm, total=len(paths), desc=desc, leave=False, disable=not progress or len(paths) < 2000)
    if workers == 1 or len(paths) < PARALLEL_FROM:
        yield from bar(map(function, paths))
        return
    from concurrent.futures import ProcessPoolExecutor
    pool = ProcessPoolExecutor(workers)
    try:
        yield from bar(pool.map(function, paths, chunksize=256))
    finally:  # a broken file found early: the chunks not yet started are dropped
        pool.shutdown(cancel_futures=True)


PARALLEL_FROM = 2000  # files; below it, starting the worker processes costs more than it saves


def list_image_files(root: str) -> list:
    if not os.path.isdir(root):
        raise DataError(f'image folder {root!r} does not exist: pass --data-dir DIR with PNG/JPEG files in it')
    paths = sorted(os.path.join(dirpath, name) for dirpath, _, names in os.walk(root)
                   for name in names if name.lower().endswith(IMAGE_EXTENSIONS))
    if not paths:
        raise DataError(f'no PNG or JPEG files under {root!r}')
    return paths


def folder_labels(root: str, paths: list) -> tuple:
    """(labels (N,) int64, class names) of image files under `root`, one class per top-level
    subfolder in sorted order (torchvision's ImageFolder convention); a file outside every
    subfolder, a subfolder without images, or fewer than two classes, is refused with one line."""
    tops = [os.path.relpath(path, root).split(os.sep) for path in paths]
    loose = [parts[0] for parts in tops if len(parts) == 1]
    if loose:
        raise DataError(f'--class-cond: {len(loose)} image(s) of {root!r} lie outside any class subfolder (such as '
                        f'{loose[0]!r}): put each image in the subfolder of its class')
    names = sorted({parts[0] for parts in tops})
    empty = sorted(set(entry for entry in os.listdir(root) if os.path.isdir(os.path.join(root, entry))
                       and not entry.startswith('.')) - set(names))
    if empty:  # as torchvision's ImageFolder: a class without images would shift every later class's index
        raise DataError(f'--class-cond: class subfolder {empty[0]!r} of {root!r} holds no images: fill it or remove it')
    if len(names) < 2:
        raise DataError(f'--class-cond: {root!r} holds {len(names)} class subfolder(s) ({", ".join(names)}); '
                        f'class-conditional training needs at least two')
    index = {name: i for i, name in enumerate(names)}
    return torch.tensor([index[parts[0]] for parts in tops], dtype=torch.long), names


def class_names(name: str, data_dir: str) -> list:
    """The classes of a data set's labels, in label order (what --class-cond conditions on), or a
    one-line DataError for a set without labels."""
    if name == 'cifar10':
        return list(CIFAR10_CLASSES)
    if name == 'digits':
        return [str(digit) for digit in range(10)]
    if name == 'folder':
        return folder_labels(data_dir, list_image_files(data_dir))[1]
    if name == 'beton':
        names = BetonDataset(data_dir).class_names
        if names is None:
            raise DataError(f'--class-cond: {data_dir!r} holds no labels: write it from a labelled set (cifar10, '
                            f'digits, or a folder with a subfolder per class) with python data.py --write-beton')
        return names
    raise DataError(f'--class-cond: the {name} set has no labels; use cifar10, digits, or --dataset folder with '
                    f'one subfolder per class')


def open_rgb(path: str):
    """A PIL image in RGB with its true levels: 16-bit grayscale is scaled to 8 bits (PIL's
    own convert('RGB') would clip it, turning most of the image white)."""
    from PIL import Image
    try:
        with Image.open(path) as image:
            image.load()
            if image.mode in HIGH_BIT_DEPTH_MODES:
                levels = np.asarray(image, dtype=np.float64)
                top = 65535.0 if image.mode.startswith('I;16') or levels.max() > 255 else 255.0
                return Image.fromarray(np.round(levels * (255.0 / top)).clip(0, 255).astype(np.uint8)).convert('RGB')
            return image.convert('RGB')
    except Exception as error:  # PIL raises several types for unreadable files
        raise DataError(f'cannot read image {path!r}: {brief(error)}') from None


def check_images(paths: list, progress: bool = True):
    """Decodes every file (a header check misses truncated data), so that a broken file stops
    the run before training, with its name: the first broken one in sorted order."""
    for path, problem in zip(paths, map_files(_decode_problem, paths, 'checking images', progress)):
        if problem:
            raise DataError(f'cannot read image {path!r}: {problem}')


def _decode_problem(path: str):
    try:
        open_rgb(path)
    except DataError as error:
        return str(error).split("': ", 1)[-1]
    return None


def resize_images(images: torch.Tensor, image_size: int) -> torch.Tensor:
    if images.shape[-1] == image_size and images.shape[-2] == image_size:
        return images
    resized = F.interpolate(images.float(), size=(image_size, image_size), mode='bicubic', antialias=True)
    return resized.round().clamp(0, 255).to(torch.uint8)


def load_cifar10(data_dir: str, train: bool, download: bool = True, flag: str = '--dataset',
                 labels: bool = False) -> torch.Tensor:
    """CIFAR-10 through torchvision, as (N, 3, 32, 32) uint8 (and with labels=True its (N,) int64
    labels: (images, labels)); downloads into data_dir if it is missing, and says what to pass
    instead when that is impossible (offline): `flag` is the caller's flag that names the data set."""
    on_disk = os.path.isdir(os.path.join(data_dir, 'cifar-10-batches-py'))
    if on_disk or download:  # importing torchvision costs seconds (it loads torch._dynamo): only to read or fetch
        from torchvision.datasets import CIFAR10
    if on_disk:
        try:
            return _cifar10_images(CIFAR10(data_dir, train=train, download=False), labels)
        except RuntimeError:
            pass  # corrupt: try the download
    hint = (f"put the python version of CIFAR-10 (cifar-10-batches-py/ from "
            f"https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz) under {data_dir!r} or pass "
            f"--data-dir to where it is; or do without a download: {flag} digits (scikit-learn's 1,797 real "
            f"handwritten digits, one channel), {flag} shapes, or {flag} folder --data-dir DIR")
    if not download:
        raise DataError(f'CIFAR-10 not found in {data_dir!r}: {hint}')
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)
    try:
        dataset = CIFAR10(data_dir, train=train, download=True)
    except Exception as error:
        raise DataError(f'CIFAR-10 not found in {data_dir!r} and the download failed ({brief(error)}): '
                        f'{hint}') from None
    finally:
        socket.setdefaulttimeout(previous_timeout)
    return _cifar10_images(dataset, labels)


def _cifar10_images(dataset, labels: bool = False):
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # (N, 32, 32, 3) -> (N, 3, 32, 32)
    return (images, torch.tensor(dataset.targets, dtype=torch.long)) if labels else images


def make_shapes(count: int, image_size: int = 32, seed: int = 0) -> torch.Tensor:
    """Procedural images: a two-colour gradient background with one to three coloured circles,
    squares and triangles. Image i depends on (i, image_size, seed) only, so a larger count
    extends a smaller one. Drawn at twice the size and averaged down, for anti-aliased edges.
    Returns (count, 3, S, S) uint8."""
    chunk = 256
    out = np.empty((count, 3, image_size, image_size), dtype=np.uint8)
    for start in range(0, count, chunk):
        n = min(chunk, count - start)
        out[start:start + n] = _draw_shapes(np.random.default_rng([seed, start // chunk]), chunk, image_size)[:n]
    return torch.from_numpy(out)


def _draw_shapes(rng, n: int, image_size: int) -> np.ndarray:
    size2 = 2 * image_size
    coords = ((np.arange(size2) + 0.5) / size2).astype(np.float32)
    y, x = coords[None, :, None], coords[None, None, :]  # (1, S2, 1), (1, 1, S2)
    colour = lambda: rng.uniform(0, 1, (n, 3, 1, 1)).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi, (n, 1, 1)).astype(np.float32)
    ramp = (np.cos(angle) * (x - 0.5) + np.sin(angle) * (y - 0.5) + 0.5)[:, None]  # (n, 1, S2, S2)
    canvas = colour() * (1 - ramp) + colour() * ramp  # (n, 3, S2, S2)
    num_shapes = rng.integers(1, 4, n)
    for k in range(3):
        kind = rng.integers(0, 3, (n, 1, 1))
        cx, cy = rng.uniform(0.2, 0.8, (2, n, 1, 1)).astype(np.float32)
        r = rng.uniform(0.12, 0.3, (n, 1, 1)).astype(np.float32)
        circle = (x - cx) ** 2 + (y - cy) ** 2 < r ** 2
        square = (np.abs(x - cx) < r * 0.85) & (np.abs(y - cy) < r * 0.85)
        triangle = (y > cy - r) & (y < cy + r) & (np.abs(x - cx) < (y - (cy - r)) / 2)
        mask = np.where(kind == 0, circle, np.where(kind == 1, square, triangle)) & (num_shapes > k)[:, None, None]
        canvas = np.where(mask[:, None], colour(), canvas)
    small = canvas.reshape(n, 3, image_size, 2, image_size, 2).mean(axis=(3, 5))  # 2x2 box filter
    return np.round(small * 255).astype(np.uint8)


def load_digits_split(image_size: int, heldout: bool) -> tuple:
    """scikit-learn's handwritten digits (UCI; 8x8, 17 grey levels, ink bright on black), one of
    the two parts of a stratified split fixed by DIGITS_SPLIT_SEED: (uint8 (N, 1, S, S), labels (N,)).
    Levels 0..16 become 0..255; the 8x8 images are resized (bicubic) to image_size."""
    images, labels = _digits_split(heldout)
    return resize_images(images, image_size), labels


@functools.lru_cache(maxsize=2)
def _digits_split(heldout: bool) -> tuple:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise DataError('--dataset digits reads the digits shipped with scikit-learn: '
                        'pip install scikit-learn') from None
    digits = load_digits()
    levels = np.round(digits.images * (255 / 16)).astype(np.uint8)[:, None]  # (1797, 1, 8, 8)
    parts = train_test_split(levels, digits.target, test_size=DIGITS_HELDOUT_SHARE, stratify=digits.target,
                             random_state=DIGITS_SPLIT_SEED)
    images, labels = (parts[1], parts[3]) if heldout else (parts[0], parts[2])
    return torch.from_numpy(images), torch.from_numpy(labels)


def channels_of(name: str) -> int:
    """Colour channels of a data set's images, which the UNet's input and output follow."""
    return 1 if name == 'digits' else 3


def flipped_in_training(name: str) -> bool:
    """Random horizontal flips, except for digits: a mirrored 2 or 7 is not a digit."""
    return name != 'digits'


def load_dataset(name: str, data_dir: str, image_size: int, shapes_count: int = 8192, labels: bool = False) -> Dataset:
    """The training set: an ImageTensorDataset, a lazily decoded ImageFolderDataset, or the
    images of a .beton file (BetonDataset); with labels=True each image's class in its `labels`
    (class_names names them; a set without labels is refused with one line)."""
    if labels:
        names = class_names(name, data_dir)  # the refusal of a set without labels, before any decoding
    if name == 'beton':
        return BetonDataset(data_dir, labels)
    if name == 'cifar10':
        images, targets = load_cifar10(data_dir, train=True, labels=True)
        return ImageTensorDataset(resize_images(images, image_size), *((targets, names) if labels else ()))
    if name == 'shapes':
        return ImageTensorDataset(make_shapes(shapes_count, image_size, seed=0))
    if name == 'digits':
        images, targets = load_digits_split(image_size, heldout=False)
        return ImageTensorDataset(images, *((targets.long(), names) if labels else ()))
    if name == 'folder':
        dataset = ImageFolderDataset(data_dir, image_size, labels)
        check_images(dataset.paths)
        return dataset
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def first_image(dataset: Dataset, image_size: int, data_dir: str) -> torch.Tensor:
    """The set's first image, decoded once (decoding is not free for a folder or a .beton), after
    checking that the set holds images of --image-size."""
    first = dataset[0]
    stored = tuple(first.shape[-2:])
    if stored != (image_size, image_size):
        raise DataError(f'the images of {data_dir} are {stored[0]}x{stored[1]}, not --image-size {image_size}: '
                        f'pass --image-size {stored[0]} or rewrite the .beton')
    return first


def load_heldout(name: str, data_dir: str, image_size: int, count: int) -> torch.Tensor:
    """A fixed set of images for the held-out loss: CIFAR-10's test split, shapes from another
    seed, the held-out digits, or, for a folder or .beton (no split), its first `count` images.
    A split holds what it holds: fewer than `count` images where it is smaller."""
    if name == 'cifar10':
        return resize_images(load_cifar10(data_dir, train=False)[:count], image_size)
    if name == 'shapes':
        return make_shapes(count, image_size, seed=SHAPES_HELDOUT_SEED)
    if name == 'digits':
        return load_digits_split(image_size, heldout=True)[0][:count]
    if name == 'beton':
        dataset = BetonDataset(data_dir)
        return dataset.images(range(min(count, len(dataset))))
    dataset = ImageFolderDataset(data_dir, image_size)
    return torch.stack([dataset[i] for i in range(min(count, len(dataset)))])


def dataset_images(dataset: Dataset, progress: bool = True) -> torch.Tensor:
    """The whole set as one (N, C, H, W) uint8 tensor (decoding a folder if needed)."""
    if isinstance(dataset, ImageTensorDataset):
        return dataset.images
    return dataset.to_tensor(progress)  # ImageFolderDataset, BetonDataset


def fingerprint(dataset: Dataset, samples: int = 64) -> str:
    """A data set's identity for resume checks: sha256 of its size and of the pixels of
    `samples` images spread evenly over it (decoding all of a large folder would cost minutes)."""
    import hashlib
    count = len(dataset)
    indices = sorted({i * count // samples for i in range(min(samples, count))})
    if isinstance(dataset, BetonDataset):
        images = dataset.images(indices)
    else:
        images = torch.stack([dataset[i] for i in indices])
    digest = hashlib.sha256(str(count).encode())
    digest.update(images.contiguous().numpy().tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- FFCV

FFCV_INSTALL = ('ffcv is not installed: apt-get install -y libturbojpeg0-dev libopencv-dev pkg-config && '
                'pip install -r requirements-ffcv.txt')


def ffcv_missing_reason():
    """None if the FFCV loader can run here, else why not and how to fix it."""
    try:
        import ffcv  # noqa: F401
    except ImportError:
        return FFCV_INSTALL
    return None


def _require_ffcv():
    reason = ffcv_missing_reason()
    if reason:
        raise DataError(reason)


class _HWCImages:
    """A data set seen as FFCV's writer wants it: index -> (H, W, 3 uint8 array,), and its label
    after it for a labelled set. FFCV's image field holds three channels: a one-channel image is
    stored grey in all three."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image = self.dataset[index].expand(3, -1, -1).permute(1, 2, 0).contiguous().numpy()
        labels = getattr(self.dataset, 'labels', None)
        return (image,) if labels is None else (image, int(labels[index]))


def write_beton(dataset: Dataset, path: str, jpeg: bool = False, jpeg_quality: int = 90, num_workers: int = 4):
    """Writes every image of a data set to an FFCV .beton file (raw RGB, or JPEG), and its labels
    where it has them (a 'label' field: the class indices; their names are not kept), through a
    temporary file: a killed write leaves no truncated .beton behind."""
    _require_ffcv()
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    fields = {'image': RGBImageField(write_mode='jpg' if jpeg else 'raw', jpeg_quality=jpeg_quality)}
    if getattr(dataset, 'labels', None) is not None:
        fields['label'] = IntField()
    with atomic_path(path, unique=True) as tmp:  # concurrent writers of one .beton never share a file
        DatasetWriter(tmp, fields, num_workers=num_workers).from_indexed_dataset(_HWCImages(dataset))


def _ffcv_pipeline(device):
    from ffcv.fields.decoders import SimpleRGBImageDecoder
    from ffcv.transforms import ToDevice, ToTensor, ToTorchImage
    return [SimpleRGBImageDecoder(), ToTensor(), ToDevice(torch.device(device), non_blocking=True),
            ToTorchImage(channels_last=False)]


class BetonDataset(Dataset):
    """The images of a .beton file as a data set of uint8 (3, H, W) tensors (decoded by FFCV). Its
    label field, where it has one, is read from the file's metadata (no decoding): `class_names`
    are then the indices 0..K-1 as text, and with labels=True `labels` holds them."""

    def __init__(self, path: str, labels: bool = False):
        _require_ffcv()
        if not os.path.isfile(path):
            raise DataError(f'.beton file {path!r} does not exist: write one with python data.py --write-beton')
        from ffcv.reader import Reader
        try:
            reader = Reader(path)
            self.path, self.count = path, reader.num_samples
            field = reader.field_names.index('label') if 'label' in reader.field_names else None
            stored = None if field is None else torch.from_numpy(reader.metadata[f'f{field}'].astype(np.int64))
        except Exception as error:
            raise DataError(f'cannot read {path!r} as an FFCV .beton file: {brief(error)}') from None
        self.class_names = None if stored is None else [str(i) for i in range(int(stored.max()) + 1)]
        self.labels = stored if labels else None

    def __len__(self):
        return self.count

    def images(self, indices) -> torch.Tensor:
        from ffcv.loader import Loader as FFCVLoaderBase
        from ffcv.loader import OrderOption
        indices = list(indices)
        loader = FFCVLoaderBase(self.path, batch_size=len(indices), num_workers=1, order=OrderOption.SEQUENTIAL,
                                indices=indices, pipelines={'image': _ffcv_pipeline('cpu'), 'label': None})
        (batch,) = next(iter(loader))
        return batch.clone()

    def __getitem__(self, index):
        return self.images([index])[0]

    def to_tensor(self, progress: bool = True) -> torch.Tensor:
        return torch.cat([self.images(range(start, min(start + 4096, self.count)))
                          for start in tqdm(range(0, self.count, 4096), desc='decoding .beton', disable=not progress)])


# ----------------------------------------------------------------------------- command line

@dataclass
class BetonConfig:
    write_beton: str = flag('', 'the .beton file to write')
    dataset: str = flag('cifar10', 'data set to convert (digits are stored as RGB, grey in all three channels)',
                        choices=('cifar10', 'folder', 'shapes', 'digits'))
    data_dir: str = flag('./data', 'CIFAR-10 root or image folder')
    image_size: int = flag(32, 'resolution the images are stored at', at_least=1)
    shapes_count: int = flag(8192, 'images in the shapes set', at_least=1)
    jpeg: bool = flag(False, 'store JPEG instead of raw RGB (smaller, slower to decode)')
    jpeg_quality: int = flag(90, 'JPEG quality', at_least=1, at_most=100)
    num_workers: int = flag(4, 'writer processes', at_least=1)


def write_beton_main(cfg: BetonConfig):
    check_ranges(cfg)
    if not cfg.write_beton:
        raise ConfigError('nothing to do: pass --write-beton OUT.beton')
    if os.path.isdir(cfg.write_beton):
        raise ConfigError(f'--write-beton {cfg.write_beton}: a folder; pass the path of the .beton file to write')
    check_writable(os.path.dirname(os.path.abspath(cfg.write_beton)), '--write-beton')
    try:  # labels where the set has them, for class-conditional training from the .beton
        dataset = load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.shapes_count, labels=True)
    except DataError as unlabelled:
        if cfg.dataset == 'folder' and not os.path.isdir(cfg.data_dir):
            raise
        dataset = load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.shapes_count)
        print(f'no labels written: {str(unlabelled).removeprefix("--class-cond: ")}')
    write_beton(dataset, cfg.write_beton, cfg.jpeg, cfg.jpeg_quality, cfg.num_workers)
    labels = f', labels of {len(dataset.class_names)} classes' if getattr(dataset, 'labels', None) is not None else ''
    print(f'wrote {len(dataset)} images ({cfg.image_size}x{cfg.image_size}, {"JPEG" if cfg.jpeg else "raw RGB"}'
          f'{labels}) to {cfg.write_beton}')


def main(argv=None) -> int:
    """python data.py --write-beton OUT.beton --dataset cifar10|folder|shapes|digits [...]"""
    return run_main(write_beton_main, parse_config(argv, BetonConfig, main.__doc__))


if __name__ == '__main__':
    sys.exit(main())

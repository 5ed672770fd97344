"""Measuring a model's quality: FID, the digits score, bits/dim, held-out losses, and the evaluation that
train.py runs during training.

- FID: torch-fidelity's InceptionV3 features and Frechet distance, against a data set's
  statistics (cached in an .npz).
- The digits score: the same statistics (and KID) in the features of a small digit classifier
  trained on the digits' training split: no download, a floor from held-out real digits. The score
  that decides is the class FD (each digit against its own training digits), averaged over draws.
- Bits/dim: the variational bound (diffusion.vlb_bits_per_dim) over a data set, exact or as an
  unbiased Monte Carlo estimate.
- During training: the held-out loss on fixed images, timesteps and noise; `Evaluator`
  (--eval-every), whose rows training_log.write_curves draws (the check before a checkpoint is
  written: checkpoint.weights_problem).
"""
import contextlib
import copy
import hashlib
import json
import math
import os
import time
import typing

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data
import diffusion
import loaders
from bookkeeping import Run, any_rank, gather_to_rank0
from cli import ConfigError, StopRequested, brief
from devices import autocast, own_rng
from drawing import Sampling, draw
from files import atomic_open, check_writable, remove_dead_writers
from model import UNetConfig

REFERENCE_SETS = ('cifar10', 'shapes', 'digits', 'folder', 'beton')


# ----------------------------------------------------------------------------- FID

def inception_extractor(weights_path: str, device) -> typing.Callable:
    """torch-fidelity's InceptionV3 (pool3, 2048 features), as uint8 (B, 3, H, W) -> (B, 2048)."""
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3
    check_inception_weights(weights_path)
    try:
        network = FeatureExtractorInceptionV3('inception-v3-compat', ['2048'],
                                              feature_extractor_weights_path=weights_path or None)
    except Exception as error:
        if weights_path:
            raise ConfigError(f'--inception-weights {weights_path}: cannot load it ({brief(error)})') from None
        raise ConfigError(
            f'FID needs the InceptionV3 weights, and downloading them failed ({brief(error)}). '
            f'Offline, fetch {URL_INCEPTION_V3} on a machine with network and pass --inception-weights PATH') from None
    network = network.to(device).eval()
    return lambda images: network(images.to(device))[0].double().cpu()


def check_inception_weights(path: str):
    """--inception-weights, when given, must be a file (whether it loads, inception_extractor says)."""
    if path and not os.path.isfile(path):
        raise ConfigError(f'--inception-weights {path}: no such file')


def features_of(batches: typing.Iterable[torch.Tensor], extractor: typing.Callable) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([extractor(batch) for batch in batches]).numpy()


def statistics(features: np.ndarray) -> dict:
    """Mean and covariance of the features, as torch-fidelity computes them."""
    from torch_fidelity.metric_fid import fid_features_to_statistics
    return fid_features_to_statistics(torch.from_numpy(features))


def frechet_distance(stats_a: dict, stats_b: dict) -> float:
    """||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a S_b)^1/2) (Heusel et al., 2017), via torch-fidelity."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric
    return fid_statistics_to_metric(stats_a, stats_b, verbose=False)[KEY_METRIC_FID]


def reference_images(name: str, data_dir: str, image_size: int, split_train: bool,
                     flag: str = '--fid-data') -> torch.Tensor:
    """A reference set: the training split (FID) or the held-out one (bits/dim); `flag` names it."""
    if name == 'cifar10':
        return data.resize_images(data.load_cifar10(data_dir, split_train, True, flag), image_size)
    if name == 'shapes':
        return data.make_shapes(50000 if split_train else 10000, image_size,
                                seed=0 if split_train else data.SHAPES_HELDOUT_SEED)
    if name == 'digits':
        return data.load_digits_split(image_size, heldout=not split_train)[0]
    if name not in ('folder', 'beton'):
        raise ConfigError(f"unknown data set {name!r}: use {', '.join(REFERENCE_SETS)}")
    return data.dataset_images(data.load_dataset(name, data_dir, image_size))  # no split: all of it


def reference_statistics(name: str, data_dir: str, image_size: int, extractor, batch_size: int,
                         cache: str = '') -> dict:
    """Statistics of the FID reference set (the training split of `name`), cached in an .npz
    (default: DATA_DIR/fid_stats_<name>_<size>.npz, beside a .beton file) so that they are computed once."""
    folder = os.path.dirname(data_dir) if os.path.isfile(data_dir) else data_dir  # a .beton is a file
    path = cache or os.path.join(folder, f'fid_stats_{name}_{image_size}.npz')
    if os.path.isfile(path):
        cached = np.load(path)
        return {'mu': cached['mu'], 'sigma': cached['sigma']}
    images = reference_images(name, data_dir, image_size, split_train=True)
    batches = tqdm(images.split(batch_size), desc=f'reference features ({name})', leave=False)
    stats = statistics(features_of(batches, extractor))
    with atomic_open(path, 'wb') as f:  # a run killed mid-write leaves no half cache
        np.savez(f, mu=stats['mu'], sigma=stats['sigma'])
    return stats


# ----------------------------------------------------------------------------- the digits score

# FID's recipe in another feature space: Inception cannot be downloaded everywhere and was never
# meant for 1-channel digits, so the digits are judged in the features of a small classifier
# trained on their training split (seconds on a CPU, cached). The statistics and the distances
# are torch-fidelity's, as for FID.
DIGITS_CLASSIFIER_VERSION = 1  # part of the cache key: a change to the network or its training retrains it
DIGITS_TRAINING = {'epochs': 20, 'batch_size': 64, 'lr': 2e-3, 'seed': 0, 'resolution': 16}
CONFIDENT = 0.9  # a sample labelled with at least this probability counts as a recognisable digit
COPY_QUANTILE = 0.01  # a near copy: closer to a training digit than the closest 1% of unseen real digits


class DigitsClassifier(torch.nn.Module):
    """Two convolutions and 64 features before a linear read-out of the 10 classes. Every input
    size is resized to 16x16 first, so one network (and its cost) serves every --image-size."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 32, 8, 8)
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),  # (B, 64, 4, 4)
            nn.Flatten(), nn.Linear(64 * 16, 64), nn.ReLU())  # (B, 64): the features
        self.head = nn.Linear(64, 10)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 1, S, S) -> (B, 64)."""
        x = torch.nn.functional.interpolate(images.float() / 127.5 - 1, size=DIGITS_TRAINING['resolution'],
                                            mode='bilinear', antialias=True, align_corners=False)
        return self.body(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def train_digits_classifier(image_size: int) -> tuple:
    """(classifier, held-out accuracy): Adam on the training split at image_size, from a fixed
    seed, on the CPU, leaving the global RNG where it was."""
    settings = DIGITS_TRAINING
    images, labels = data.load_digits_split(image_size, heldout=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings['seed'])
        classifier = DigitsClassifier()
        optimizer = torch.optim.Adam(classifier.parameters(), lr=settings['lr'])
        for _ in range(settings['epochs']):
            for batch in torch.randperm(len(images)).split(settings['batch_size']):
                loss = torch.nn.functional.cross_entropy(classifier(images[batch]), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    heldout, heldout_labels = data.load_digits_split(image_size, heldout=True)
    with torch.no_grad():
        accuracy = (classifier.eval()(heldout).argmax(1) == heldout_labels).double().mean().item()
    return classifier, accuracy


def digits_classifier(image_size: int, cache_dir: str) -> tuple:
    """The trained classifier and its held-out accuracy, from CACHE_DIR/digits_classifier_<size>_<key>.pt
    when there, else trained and cached; the key hashes what decides the weights (the version,
    the settings, the image size and the training images)."""
    images = data.load_digits_split(image_size, heldout=False)[0]
    key = hashlib.sha256(json.dumps([DIGITS_CLASSIFIER_VERSION, DIGITS_TRAINING, image_size]).encode()
                         + images.numpy().tobytes()).hexdigest()[:16]
    path = os.path.join(cache_dir, f'digits_classifier_{image_size}_{key}.pt')
    classifier = DigitsClassifier()
    remove_dead_writers(path)  # the temporary file of a writer killed mid-write
    if os.path.isfile(path):
        with contextlib.suppress(Exception):  # an unreadable or non-finite cache is retrained, not an error
            saved = torch.load(path, map_location='cpu', weights_only=True)
            classifier.load_state_dict(saved['weights'])
            if all(w.isfinite().all() for w in classifier.state_dict().values()) and 0 <= saved['accuracy'] <= 1:
                return classifier.eval(), saved['accuracy']
    classifier, accuracy = train_digits_classifier(image_size)
    check_writable(cache_dir, '--data-dir')
    with atomic_open(path, 'wb', unique=True) as f:  # processes training it at once each write their own
        torch.save({'weights': classifier.state_dict(), 'accuracy': accuracy}, f)
    return classifier, accuracy


def cubic_kernel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """KID's kernel k(x, y) = (x.y / d + 1)^3 (Binkowski et al. 2018), the cube as two products:
    numpy's ** 3 calls pow() per entry, and KID of 450 samples took four times as long."""
    k = x @ y.T
    k /= x.shape[1]
    k += 1
    return k * k * k


def kernel_distance(features: np.ndarray, reference: np.ndarray, seed: int = 0, subsets: int = 100) -> tuple:
    """KID (Binkowski et al. 2018): the mean and spread of the unbiased estimate of MMD^2 with the
    cubic kernel over `subsets` random subsets of equal size, drawn as torch-fidelity's
    kid_features_to_metric draws them (tests/test_digits.py checks the two agree). The samples are
    put in one canonical order first, so that their order does not change which subsets are drawn."""
    features = features[np.lexsort(features.T[::-1])]
    m = min(len(features), len(reference), 1000)
    rng, mmds = np.random.RandomState(seed), np.zeros(subsets)
    for i in range(subsets):
        x = features[rng.choice(len(features), m, replace=False)]
        y = reference[rng.choice(len(reference), m, replace=False)]
        k_xx, k_yy = cubic_kernel(x, x), cubic_kernel(y, y)
        within = (k_xx.sum() - np.trace(k_xx) + k_yy.sum() - np.trace(k_yy)) / (m * (m - 1))
        mmds[i] = within - 2 * cubic_kernel(x, y).mean()
    return float(mmds.mean()), float(mmds.std())


FLOORS = {}  # DigitsJudge's floor by image size and classifier weights: the same numbers every time


class DigitsJudge:
    """The digits score of a set of 1-channel images: Frechet distance and KID between their
    classifier features and those of the training split, the share the classifier labels
    confidently, and the entropy of the labels (log2(10) = 3.32 bits for balanced digits)."""

    def __init__(self, image_size: int, cache_dir: str):
        self.classifier, self.accuracy = digits_classifier(image_size, cache_dir)
        images, self.reference_labels = data.load_digits_split(image_size, heldout=False)
        self.reference = self.features(images)
        self.reference_stats = statistics(self.reference)
        self.class_stats = [statistics(self.reference[(self.reference_labels == c).numpy()]) for c in range(10)]
        # The floor: real digits the classifier never saw (the 450 held-out ones) against the same statistics.
        heldout, self.heldout_labels = data.load_digits_split(image_size, heldout=True)
        self.heldout = self.features(heldout)
        key = (image_size, hashlib.sha256(b''.join(w.numpy().tobytes() for w in self.classifier.state_dict().values()))
               .hexdigest())
        if key not in FLOORS:  # its KID over 450 digits costs a second or more: once per process and classifier
            FLOORS[key] = self.score(self.heldout)
        self.training_pixels = images.flatten(1).double() / 255
        self.calibrate_copies(heldout)
        self.floor = {**FLOORS[key], **self.memorisation(self.floor_half)}

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> np.ndarray:
        """uint8 (N, 1, S, S) -> float64 (N, 64), in batches on the CPU."""
        return torch.cat([self.classifier.features(b.cpu()).double() for b in images.split(512)]).numpy()

    @torch.no_grad()
    def score(self, features: np.ndarray, kid: bool = True) -> dict:
        """kid=False leaves KID out (a third of the cost of a score of 450 samples)."""
        kid, kid_std = kernel_distance(features, self.reference) if kid else (None, None)
        probs = self.classifier.head(torch.from_numpy(features).float()).softmax(1)
        counts = torch.bincount(probs.argmax(1), minlength=10).double()
        shares = counts[counts > 0] / len(features)
        return {'digits_class_fd': self.class_fd(features, probs.argmax(1).numpy()),
                'digits_fd': frechet_distance(statistics(features), self.reference_stats),
                'digits_kid': kid, 'digits_kid_std': kid_std,
                'digits_confident': (probs.max(1).values >= CONFIDENT).double().mean().item(),
                'digits_class_entropy': abs((shares * shares.log2()).sum().item()), 'digits_samples': len(features),
                'digits_features': f'digits classifier v{DIGITS_CLASSIFIER_VERSION} (64 features, held-out '
                                   f'accuracy {self.accuracy:.4f})'}

    def class_fd(self, features: np.ndarray, labels: np.ndarray) -> float:
        """The score that decides (docs/sampling.md, "A score that decides"): the mean over the ten
        digits of the Frechet distance between the samples the classifier labels as that digit and
        the training digits of that digit. Each digit weighs 1/10 whatever its share, so the draw's
        class mix (the plain FD's largest noise) moves it less. A digit drawn fewer than twice (no
        covariance) is judged by the whole set against that digit: a set that lacks digits scores
        far worse."""
        distances = []
        for c, reference in enumerate(self.class_stats):
            mine = features[labels == c]
            distances.append(frechet_distance(statistics(mine if len(mine) > 1 else features), reference))
        return float(np.mean(distances))

    def nearest_training_distance(self, images: torch.Tensor) -> np.ndarray:
        """Each image's distance to its nearest training digit: the root mean square of the pixel
        differences, grey levels in [0, 1], at the judge's resolution (the training digits resized
        as the model saw them)."""
        pixels, reference = images.flatten(1).cpu().double() / 255, self.training_pixels  # samples on any device
        if pixels.shape[1] != reference.shape[1]:
            raise ValueError(f'images of {pixels.shape[1]} pixels; the judge compares {reference.shape[1]}')
        nearest = []
        for part in pixels.split(1024):  # |x - r|^2 = |x|^2 - 2 x.r + |r|^2, without an (N, M, D) array
            squared = (part ** 2).sum(1, keepdim=True) - 2 * part @ reference.T + (reference ** 2).sum(1)
            nearest.append(squared.min(1).values.clamp_min(0))
        return (torch.cat(nearest) / reference.shape[1]).sqrt().numpy()

    def calibrate_copies(self, heldout: torch.Tensor):
        """The memorisation measure's yardstick, from half the held-out digits (a fixed half): how close
        unseen real digits come to the training set. The other half is the floor."""
        order = np.random.RandomState(0).permutation(len(heldout))
        half = len(heldout) // 2
        calibration = self.nearest_training_distance(heldout[torch.from_numpy(order[:half])])
        self.copy_distance = float(np.quantile(calibration, COPY_QUANTILE))
        self.heldout_median_distance = float(np.median(calibration))
        self.floor_half = heldout[torch.from_numpy(order[half:])]

    def memorisation(self, images: torch.Tensor) -> dict:
        """Whether samples copy the training digits: the share of samples closer to their nearest
        training digit than the closest 1% of unseen real digits are (near copies; the other half of the
        held-out digits: about 1%; the training digits themselves: 100%), and the median distance to the
        nearest training digit over that of unseen digits (1 for real digits; below 1: closer than they)."""
        distance = self.nearest_training_distance(images)
        return {'digits_near_copies': float((distance < self.copy_distance).mean()),
                'digits_nn_ratio': float(np.median(distance) / self.heldout_median_distance)}

    @torch.no_grad()
    def conditioning(self, images: torch.Tensor, asked: torch.Tensor) -> dict:
        """Whether each image is the digit asked of it (a class-conditional model's samples): the share
        the classifier labels as the class asked, overall and per class, and each class's digits FD
        against the training split's digits of that class. Beside them: the floor, the held-out real
        digits with their true labels (the classifier's own accuracy and the per-class FDs of real
        digits), and a control that must fail, the same samples judged against shuffled labels
        (about 10% for balanced classes; None when one class was asked of all, which no shuffle moves)."""
        features, asked = self.features(images), asked.cpu().long()
        judged = self.classifier.head(torch.from_numpy(features).float()).argmax(1)
        heldout_judged = self.classifier.head(torch.from_numpy(self.heldout).float()).argmax(1)
        shuffled = asked[torch.randperm(len(asked), generator=torch.Generator().manual_seed(0))]
        per_class = {}
        for c in sorted(set(asked.tolist())):
            reference = self.class_stats[c]
            real = (self.heldout_labels == c).numpy()
            mine = (asked == c).numpy()
            per_class[c] = {'accuracy': (judged[mine] == c).double().mean().item(), 'samples': int(mine.sum()),
                            'digits_fd': frechet_distance(statistics(features[mine]), reference) if mine.sum() > 1
                            else None,
                            'floor_accuracy': (heldout_judged[real] == c).double().mean().item(),
                            'floor_digits_fd': frechet_distance(statistics(self.heldout[real]), reference)}
        one_class = len(per_class) == 1  # shuffling one class's labels changes nothing: no control
        return {'accuracy': (judged == asked).double().mean().item(), 'samples': len(images),
                'shuffled_labels_accuracy': None if one_class else (judged == shuffled).double().mean().item(),
                'floor_accuracy': (heldout_judged == self.heldout_labels).double().mean().item(),
                'per_class': per_class}


def conditioning_summary(result: dict, guidance: float) -> str:
    """DigitsJudge.conditioning in a few lines."""
    classes = ', '.join(f"{c}: {r['accuracy']:.0%}" for c, r in result['per_class'].items())
    fds = ', '.join(f"{c}: {r['digits_fd']:.1f} ({r['floor_digits_fd']:.1f})" for c, r in result['per_class'].items()
                    if r['digits_fd'] is not None)
    control = result['shuffled_labels_accuracy']
    control = (f"control, the samples against shuffled labels: {control:.1%}" if control is not None else
               "no control: one class asked of every sample")
    lines = [f"judged as the digit asked (guidance {guidance:g}): {result['accuracy']:.1%} of {result['samples']} "
             f"samples (floor, held-out real digits: {result['floor_accuracy']:.1%}; {control}); per class {classes}"]
    if fds:  # a class needs two samples for a Frechet distance
        lines.append(f"digits FD per class against the training digits of that class (floor in brackets): {fds}")
    return '\n'.join(lines)


# ----------------------------------------------------------------------------- bits/dim

def bits_per_image(model, sched: diffusion.Schedule, images: torch.Tensor, batch_size: int, device,
                   generator: torch.Generator, timesteps: int = 0, amp: str = 'off', progress: bool = True,
                   prediction: str = 'eps') -> dict:
    """Per image (uint8 (N, 3, H, W) in): the full bound (timesteps=0, T model calls each) or its
    unbiased Monte Carlo estimate from `timesteps` timesteps; {'total', 'prior', 'decoder'} (N,)."""
    sched = sched.to(device)
    parts = {'total': [], 'prior': [], 'decoder': []}
    calls = model_calls_per_image(timesteps, sched.num_steps)
    for batch in tqdm(images.split(batch_size), desc=f'bits/dim ({calls} model calls per image)', leave=False,
                      disable=not progress):
        x0 = batch.to(device).float() / 127.5 - 1
        with autocast(amp, device):
            if timesteps:
                result = diffusion.vlb_bits_per_dim_mc(model, sched, x0, timesteps, generator=generator,
                                                       prediction=prediction)
            else:
                result = diffusion.vlb_bits_per_dim(model, sched, x0, generator=generator, prediction=prediction)
        for key in parts:
            parts[key].append(result[key].double().cpu())
    return {key: torch.cat(value) for key, value in parts.items()}


def model_calls_per_image(timesteps: int, num_steps: int) -> int:
    """The full bound calls the model once per timestep; the estimate once per drawn timestep
    plus once for the decoder term."""
    return timesteps + 1 if timesteps else num_steps


def summarise_bits(per_image: dict, timesteps: int, num_steps: int) -> dict:
    """The mean bits/dim and its standard error over images (which, for the Monte Carlo
    estimate, holds the spread of the timestep draws too)."""
    total = per_image['total']
    return {'bits_per_dim': total.mean().item(),
            'stderr': (total.std() / math.sqrt(len(total))).item() if len(total) > 1 else None,
            'prior': per_image['prior'].mean().item(), 'decoder': per_image['decoder'].mean().item(),
            'images': len(total), 'model_calls_per_image': model_calls_per_image(timesteps, num_steps),
            'estimate': f'Monte Carlo, {timesteps} stratified timesteps' if timesteps else 'full bound'}


def bits_per_dim(model, config: UNetConfig, sched: diffusion.Schedule, cfg, device,
                 prediction: str = 'eps') -> dict:
    images = reference_images(cfg.bpd_data, cfg.data_dir, config.image_size, split_train=False, flag='--bpd-data')
    if len(images) < cfg.bpd_num:
        print(f'--bpd-num {cfg.bpd_num}: {cfg.bpd_data} holds {len(images)} images to evaluate; bits/dim on all '
              f'of them')
    images = images[:cfg.bpd_num]
    amp = 'off' if cfg.amp == 'auto' else cfg.amp  # the likelihood in fp32 unless asked otherwise
    generator = torch.Generator(device).manual_seed(cfg.seed)
    per_image = bits_per_image(model, sched, images, cfg.batch_size, device, generator, cfg.bpd_timesteps, amp,
                               prediction=prediction)
    return {**summarise_bits(per_image, cfg.bpd_timesteps, sched.num_steps), 'data': cfg.bpd_data}


# ----------------------------------------------------------------------------- evaluation during training

# The held-out loss's noise comes from its own generator, the same for every run and seed, and
# never from the training streams: a resumed run and an uninterrupted one measure alike.
HELDOUT_NOISE_SEED = 12345


def make_heldout(cfg, device, num_steps: int) -> tuple:
    """The held-out set of train.py's held-out loss: cfg.heldout_size fixed images, one timestep
    each, spread evenly over 0..T-1, and noise from HELDOUT_NOISE_SEED."""
    images = data.load_heldout(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.heldout_size).to(device)
    generator = torch.Generator().manual_seed(HELDOUT_NOISE_SEED)
    t = (torch.arange(len(images)) * num_steps // len(images)).to(device)
    noise = torch.randn(images.shape, generator=generator).to(device)
    return images, t, noise


@torch.no_grad()
def heldout_losses(model, sched: diffusion.Schedule, heldout: tuple, cfg, device) -> torch.Tensor:
    """Per-image training loss on the fixed images, timesteps and noise (no flips, no dropout):
    comparable across steps, runs and settings, since it is always L_simple, the eps MSE (a v
    model's output is read as the eps it stands for; no Min-SNR weights). Returns (N,) on the CPU."""
    was_training = model.training
    model.eval()
    eps_model = diffusion.as_eps_model(model, sched, cfg.prediction)
    images, t, noise = heldout
    losses = []
    try:
        for chunk in torch.arange(len(images), device=device).split(cfg.batch_size):
            x0 = loaders.to_model_input(images[chunk], torch.zeros_like(chunk, dtype=torch.bool))
            if cfg.channels_last:
                x0 = x0.contiguous(memory_format=torch.channels_last)
            with autocast(cfg.amp, device):
                losses.append(diffusion.training_loss(eps_model, sched, x0, t[chunk], noise[chunk], per_example=True))
    finally:  # also when a stop cuts the evaluation short: training goes on in training mode
        model.train(was_training)
    return torch.cat(losses).cpu()


def evaluation_seed(seed: int, step: int, rank: int) -> int:
    """The seed of an evaluation's bits/dim draws: one stream per (run seed, step, rank), none of
    them the training's (a function of the three alone, so a resumed run draws what it would have)."""
    return int(np.random.SeedSequence([seed, step, rank, 1]).generate_state(1)[0])


def sampling_seed(seed: int, images_seen: int, eval_every: int, noise: str, draw: int = 0) -> int:
    """The seed of an evaluation's `draw`th set of samples: the same at every evaluation ('fixed': a
    curve shows the model's change alone, but one draw's luck stays with the run; draw 0 is the run's
    seed), or a fresh one per evaluation, a function of the run's seed and the evaluation's index in
    images ('fresh': runs that share a seed and a batch size draw the same noise at the same image
    count). Every draw of an evaluation has its own seed."""
    if noise == 'fixed':
        return seed if draw == 0 else int(np.random.SeedSequence([seed, draw, 3]).generate_state(1)[0])
    return int(np.random.SeedSequence([seed, images_seen // eval_every, 2] + ([draw] if draw else []))
               .generate_state(1)[0])


# The digits score the demo and the ladder train to (the class FD, mean of 3 draws of 450 samples):
# a level the model holds, chosen in docs/sampling.md's "A score that decides".
DIGITS_TARGET = 80.0


def score_key(dataset: str) -> str:
    """The evaluation row's key of a data set's score: the digits class FD for digits, FID for the rest."""
    return 'digits_class_fd' if dataset == 'digits' else 'fid'


class Evaluator:
    """FID of EMA samples (the digits score for digits) and a Monte Carlo estimate of the EMA's
    bits/dim on held-out images, for train.py --eval-every. Every rank takes a share (batches of
    samples, held-out images), so that none waits idle into a timeout; rank 0 gathers and returns
    the row. The reference statistics are computed (or read from their cache) here, at the
    start, so that a missing data set or Inception network shows before training, not after."""

    def __init__(self, run: Run):
        cfg, self.run = run.cfg, run
        self.images = data.load_heldout(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.eval_bpd_images)
        self.extractor = self.reference = self.judge = None
        self.fid_left_out = None  # why FID is left out (offline without Inception weights)
        if cfg.eval_fid and cfg.dataset == 'digits':
            self.judge = DigitsJudge(cfg.image_size, cfg.data_dir) if run.rank == 0 else None
        elif cfg.eval_fid:
            try:
                self.extractor = inception_extractor(cfg.inception_weights, run.device)
            except ConfigError as error:
                if cfg.inception_weights:  # the user's file: its error stops the run, as in sample.py
                    raise
                self.fid_left_out = str(error)
        if self.extractor is not None and run.rank == 0:
            self.reference = reference_statistics(cfg.dataset, cfg.data_dir, cfg.image_size, self.extractor,
                                                  self.batch_size)
        # A class-conditional model draws each class in turn at --guidance: the score is of all classes together.
        # Digits are drawn 450 at a time: on 2 CPU cores batch 32 draws 110 img/s, 500 draws 235 (tiny, 10 calls).
        draw_batch = max(self.batch_size, min(cfg.eval_samples, 500)) if cfg.dataset == 'digits' else self.batch_size
        self.sampling = Sampling(num=cfg.eval_samples, batch_size=draw_batch, sampler=cfg.sampler,
                                 steps=cfg.sample_steps, seed=cfg.seed, amp='auto', guidance=cfg.guidance or 1.0)

    @property
    def batch_size(self) -> int:
        return max(self.run.cfg.batch_size // self.run.world_size, 1)

    def due(self, step: int) -> bool:
        """At the first step at or past each multiple of --eval-every images (so runs of any batch
        size evaluate at the same image counts, and a resumed run keeps the schedule)."""
        every, batch = self.run.cfg.eval_every, self.run.cfg.batch_size
        return bool(every) and step * batch // every > (step - 1) * batch // every

    def ema_on_every_rank(self) -> torch.nn.Module:
        run = self.run
        if run.world_size == 1:
            return run.ema
        ema = run.ema if run.rank == 0 else copy.deepcopy(run.model).eval()
        for tensor in ema.state_dict().values():
            dist.broadcast(tensor, src=0)
        return ema

    @torch.no_grad()
    def __call__(self, step: int, train_hours: float) -> dict:
        run, cfg = self.run, self.run.cfg
        start = time.perf_counter()
        ema = self.ema_on_every_rank()
        generator = torch.Generator(run.device).manual_seed(evaluation_seed(cfg.seed, step, run.rank))
        mine = self.images[run.rank::run.world_size]
        bits = bits_per_image(ema, run.sched, mine, self.batch_size, run.device, generator,
                              cfg.eval_bpd_timesteps, amp='off', progress=False, prediction=cfg.prediction)
        bits = gather_to_rank0((bits,), run.rank, run.world_size, run.control_group)[0]
        images_seen = step * cfg.batch_size
        scored = self.scored(ema, [sampling_seed(cfg.seed, images_seen, cfg.eval_every, cfg.eval_noise, draw)
                                   for draw in range(cfg.eval_draws)])
        key = score_key(cfg.dataset)
        # A stop must hold: a score at or under --stop-at-score is drawn again with other seeds, and the
        # run stops only if that score is under it too (score_reached), so one lucky draw stops nothing.
        candidate = scored is not None and scored.get(key) is not None and scored[key] <= (cfg.stop_at_score or -1)
        confirm = None
        if any_rank(run.rank == 0 and candidate, run.control_group):
            confirm = self.scored(ema, [sampling_seed(cfg.seed, images_seen, cfg.eval_every, cfg.eval_noise, draw)
                                        for draw in range(cfg.eval_draws, 2 * cfg.eval_draws)])
        if run.rank != 0:
            return {}
        row = {'kind': 'eval', 'step': step, 'images_seen': images_seen, 'train_hours': train_hours}
        summary = summarise_bits({k: torch.cat([b[k] for b in bits]) for k in bits[0]},
                                 cfg.eval_bpd_timesteps, run.sched.num_steps)
        row.update(bpd=summary['bits_per_dim'], bpd_stderr=summary['stderr'], bpd_images=summary['images'],
                   bpd_model_calls_per_image=summary['model_calls_per_image'])
        row.update(scored or {})
        if confirm is not None:
            row[f'{key}_confirm'] = confirm[key]
        row['eval_seconds'] = time.perf_counter() - start
        return row

    def scored(self, ema, seeds: list) -> dict | None:
        """The score of --eval-draws independent draws of --eval-samples EMA samples (one per seed),
        each scored alone and the scores averaged, so that each stays comparable with a floor of
        --eval-samples real images; rank 0 gets the row's fields, the other ranks None (and None
        when there is no score to compute)."""
        run, cfg = self.run, self.run.cfg
        if self.extractor is None and not (cfg.dataset == 'digits' and cfg.eval_fid):
            return None
        rows, every_image = [], []
        for seed in seeds:
            self.sampling.seed = seed
            samples = draw(ema, run.model.config, run.sched, self.sampling, run.device, progress=False,
                           rank=run.rank, world_size=run.world_size, prediction=cfg.prediction)
            features = features_of(samples, self.extractor).astype('float32') if self.extractor else torch.cat(
                list(samples))
            features = gather_to_rank0((features,), run.rank, run.world_size, run.control_group)[0]
            if run.rank != 0:
                continue
            if self.extractor is not None:
                stats = statistics(np.concatenate(features).astype('float64'))
                rows.append({'fid': frechet_distance(stats, self.reference)})
            else:
                images = torch.cat(features)
                every_image.append(images)
                # KID of the first draw only: it decides nothing, and costs 0.4 s a draw on 2 cores.
                rows.append(self.judge.score(self.judge.features(images), kid=not rows))
        if run.rank != 0:
            return None
        steps = run.sched.num_steps if cfg.sampler == 'ddpm' else cfg.sample_steps
        row = {name: float(np.mean([r[name] for r in rows if r[name] is not None])) for name, value in rows[0].items()
               if isinstance(value, float)}
        key = score_key(cfg.dataset)
        if len(rows) > 1:
            row[f'{key}_per_draw'] = [r[key] for r in rows]
        if self.extractor is not None:
            return {**row, 'fid_samples': cfg.eval_samples, 'fid_draws': len(rows),
                    'fid_sampler': f'{cfg.sampler}-{steps}'}
        return {**row, **self.judge.memorisation(torch.cat(every_image)), 'digits_samples': cfg.eval_samples,
                'digits_draws': len(rows), 'digits_features': rows[0]['digits_features'],
                'digits_sampler': f'{cfg.sampler}-{steps}', 'digits_fd_floor': self.judge.floor['digits_fd'],
                'digits_class_fd_floor': self.judge.floor['digits_class_fd'],
                'digits_near_copies_floor': self.judge.floor['digits_near_copies']}


def digits_summary(score: dict) -> str:
    """The digits score in one paragraph, its floor beside it and the feature space named."""
    floor = score['floor']
    return (f"digits score of {score['digits_samples']} samples, in the features of a digit classifier (not "
            f"Inception: no FID), against the training split: class FD {score['digits_class_fd']:.1f} (the score "
            f"that decides; floor, the held-out real digits: {floor['digits_class_fd']:.1f}), FD "
            f"{score['digits_fd']:.2f} (floor {floor['digits_fd']:.2f}), KID {score['digits_kid']:.1f} +- "
            f"{score['digits_kid_std']:.1f} "
            f"(floor {floor['digits_kid']:.1f}); {score['digits_confident']:.1%} labelled with p >= {CONFIDENT} "
            f"(floor {floor['digits_confident']:.1%}); label entropy {score['digits_class_entropy']:.2f} bits "
            f"(balanced: 3.32); {score['digits_features']}"
            + (f"\nmemorisation: {score['digits_near_copies']:.1%} of the samples are nearer a training digit than "
               f"the closest 1% of unseen real digits (floor, held-out digits: {floor['digits_near_copies']:.1%}; "
               f"copies: 100%); median distance to the nearest training digit {score['digits_nn_ratio']:.2f}x "
               f"that of unseen digits (floor {floor['digits_nn_ratio']:.2f}x). A digits FD under its floor with "
               f"no near copies is a model close to the training digits' statistics, not a copier"
               if 'digits_near_copies' in score else ''))


# ----------------------------------------------------------------------------- what the training loop calls

def evaluate(run: Run, evaluator: Evaluator, log, step: int) -> dict | None:
    """An evaluation row (evaluation.Evaluator; {} on ranks other than 0); None if a stop cut it
    short (in one process; under DDP the ranks are inside its collectives, so it finishes)."""
    hours = log.training_seconds() / 3600
    with log.paused():
        try:
            with run.stop.interruptible() if run.world_size == 1 else contextlib.nullcontext(), own_rng(run.device):
                row = evaluator(step, hours)
        except StopRequested:
            log.print(f'evaluation at step {step} left out: a stop was requested; the resumed run owes it')
            return None
    if row:  # rank 0
        log.write(row)
        fid = f", FID {row['fid']:.2f} ({row['fid_samples']} samples)" if 'fid' in row else ''
        if 'digits_fd' in row:
            fid = (f", digits score {row['digits_class_fd']:.1f} (floor {row['digits_class_fd_floor']:.1f}; mean of "
                   f"{row['digits_draws']} x {row['digits_samples']} samples), FD {row['digits_fd']:.2f} (floor "
                   f"{row['digits_fd_floor']:.2f}), {row['digits_confident']:.0%} confident, "
                   f"{row['digits_near_copies']:.1%} near copies of training digits (floor "
                   f"{row['digits_near_copies_floor']:.1%})")
        key = f'{score_key(evaluator.run.cfg.dataset)}_confirm'
        if key in row:
            fid += f"; drawn again for --stop-at-score: {row[key]:.2f}"
        log.print(f"eval at {row['images_seen']:,} images ({row['train_hours']:.3f} training hours): bits/dim "
                  f"{row['bpd']:.4f} +- {row['bpd_stderr'] or 0:.4f}{fid}; {row['eval_seconds']:.1f} s")
        log.draw_curves()
    return row


def score_reached(cfg, row: dict) -> bool:
    """Whether an evaluation's score (rank 0's row) is at or below --stop-at-score, and stayed there
    when drawn again with other seeds (Evaluator adds that second score only to a row under the target)."""
    key = score_key(cfg.dataset)
    scores = (row.get(key), row.get(f'{key}_confirm')) if cfg.stop_at_score else (None,)
    return all(score is not None and score <= cfg.stop_at_score for score in scores)

"""Shared test helpers: small on-disk data sets, a quick train.py invocation, a stand-in for the
Inception network and the exit code and message of a refused command."""
import os
import pickle
import signal

import numpy as np
import torch
from PIL import Image

import diffusion
import students

# Why a proof against diffusers is skipped, as the end of a test run reports it (pytest -rs).
NO_DIFFUSERS = 'a proof against diffusers: diffusers is not installed (pip install -r requirements-dev.txt)'


def write_cifar10(root, train_per_batch=20, test_count=20, seed=0):
    """A small CIFAR-10 in the real on-disk format: cifar-10-batches-py/ with pickled dicts of
    uint8 rows (N, 3072: 1024 red, then green, then blue values, row-major)."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, 'cifar-10-batches-py')
    os.makedirs(folder, exist_ok=True)
    names = [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch']
    for name in names:
        count = test_count if name == 'test_batch' else train_per_batch
        batch = {'batch_label': name, 'labels': rng.integers(0, 10, count).tolist(),
                 'data': rng.integers(0, 256, (count, 3072), dtype=np.uint8),
                 'filenames': [f'{name}_{i}.png' for i in range(count)]}
        with open(os.path.join(folder, name), 'wb') as f:
            pickle.dump(batch, f)
    with open(os.path.join(folder, 'batches.meta'), 'wb') as f:
        pickle.dump({'label_names': ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog',
                                     'horse', 'ship', 'truck'], 'num_cases_per_batch': train_per_batch}, f)
    return root


def write_image_folder(root, count=12, seed=0):
    """PNGs and JPEGs in nested folders, in RGB, grayscale, RGBA and palette modes, odd sizes."""
    rng = np.random.default_rng(seed)
    modes = ['RGB', 'L', 'RGBA', 'P']
    for i in range(count):
        sub = os.path.join(root, f'part{i % 3}')
        os.makedirs(sub, exist_ok=True)
        w, h = int(rng.integers(17, 60)), int(rng.integers(17, 60))
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(modes[i % 4])
        ext = '.jpg' if i % 5 == 4 and image.mode in ('RGB', 'L') else '.png'
        image.save(os.path.join(sub, f'img{i}{ext}'))
    return root


def train_args(tmp_path, *extra):
    """Arguments for a seconds-long train.py run: tiny model, 16x16 shapes, batch 8."""
    return ['--preset', 'tiny', '--dataset', 'shapes', '--shapes-count', '96', '--image-size', '16',
            '--batch-size', '8', '--device', 'cpu', '--heldout-size', '16', '--num-samples', '4',
            '--sample-steps', '2', '--log-every', '5', '--out-dir', str(tmp_path / 'run'),
            '--samples-dir', str(tmp_path / 'samples'), *extra]


def stand_in_extractor(images: torch.Tensor) -> torch.Tensor:
    """A fixed, linear feature map (per-channel means and a few pixels): no download needed."""
    x = images.double() / 255
    return torch.cat([x.mean(dim=(2, 3)), x[:, :, 0, :4].flatten(1)], dim=1)


def refusal(capsys, call, *args) -> tuple:
    """(exit code, stderr) of call(*args) run as a script: an argparse error exits (SystemExit), ours
    return their code."""
    try:
        code = call(*args)
    except SystemExit as exit:
        code = exit.code
    return code, capsys.readouterr().err.strip()


class Fixed(torch.nn.Module):
    """A stand-in model that returns a given output (a noise or v prediction), whatever x_t and t."""
    def __init__(self, output):
        super().__init__()
        self.output = output

    def forward(self, x, t):
        return self.output


def signal_on_call(fn, n: int, sig=signal.SIGTERM):
    """`fn`, sending this process `sig` just before its n-th call (a stop that lands inside that call)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), sig)
        return fn(*args, **kwargs)
    return wrapped


# The Gaussian closed form of the few-step tests (test_distill.py, test_consistency.py): data x0 ~ N(MU, diag(S^2)).
GAUSS_SCHED = diffusion.make_schedule(1000)
MU, S = torch.tensor([0.3, -0.2], dtype=torch.float64), torch.tensor([0.25, 0.4], dtype=torch.float64)


def exact_eps(z, t):
    """The exact eps-denoiser of x0 ~ N(MU, diag(S^2)): E[x0 | z_t] = MU + alpha S^2 / (alpha^2 S^2 + sigma^2)
    (z_t - alpha MU), and eps = (z_t - alpha E[x0 | z_t]) / sigma."""
    mu, s = MU.to(z.dtype), S.to(z.dtype)
    alpha, sigma = students.alpha_sigma(GAUSS_SCHED, t, z)
    return (z - alpha * (mu + alpha * s ** 2 / (alpha ** 2 * s ** 2 + sigma ** 2) * (z - alpha * mu))) / sigma


def exact_map(z, t, t_to, scale=1.0):
    """The probability-flow ODE from t to t_to for that data (with `scale`: for data of S * scale): each
    coordinate's marginal N(alpha mu, alpha^2 s^2 + sigma^2) carried onto the next by the monotone affine map."""
    mu, s = MU.to(z.dtype), scale * S.to(z.dtype)
    alpha, sigma = students.alpha_sigma(GAUSS_SCHED, t, z)
    alpha_to, sigma_to = students.alpha_sigma(GAUSS_SCHED, t_to, z)
    return alpha_to * mu + ((alpha_to ** 2 * s ** 2 + sigma_to ** 2) / (alpha ** 2 * s ** 2 + sigma ** 2)).sqrt() * (
        z - alpha * mu)


def sigterm_after_steps(step_fn, steps: set):
    """distill.distill_step that sends SIGTERM to this process once each step of `steps` has been taken."""
    pending = set(steps)

    def step_then_sigterm(d, batch, step):
        loss = step_fn(d, batch, step)
        if step + 1 in pending:
            pending.discard(step + 1)
            os.kill(os.getpid(), signal.SIGTERM)
        return loss
    return step_then_sigterm


def spy_on_unet(monkeypatch, record) -> list:
    """Every UNet call appends record(x, t, labels) to the list returned (and runs as before)."""
    import model
    seen, forward = [], model.UNet.forward

    def spy(self, x, t, labels=None):
        seen.append(record(x, t, labels))
        return forward(self, x, t, labels)
    monkeypatch.setattr(model.UNet, 'forward', spy)
    return seen

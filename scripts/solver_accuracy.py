"""How close each sampler comes to exact answers, by model calls: DDIM (unclipped, the default; and
with x_0 clipped, diffusers' clip_sample), DDPM and DPM-Solver++ (linspace, trailing, logsnr) at 5 to 1000 calls.

On a 2-D Gaussian mixture with its closed-form denoiser (GaussianMixture): the error of the
samples' mean and covariance, their sliced Wasserstein-1 distance to true samples, and their RMS
distance to the converged probability-flow ODE solution from the same noise (DPM-Solver++ over
every timestep). With --ckpt, the same distance for a trained model's images, in grey levels too.

    python scripts/solver_accuracy.py --ckpt runs/ckpt.pt --out-dir results --stem cpu-tiny-digits-solver-accuracy
    python scripts/solver_accuracy.py --quick --out-dir /tmp/acc          # the wiring: 5 and 20 calls
"""
import os
import sys
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import diffusion  # noqa: E402
import sample  # noqa: E402
from cli import check_plain_name, check_ranges, flag, parse_config, run_main  # noqa: E402
from devices import pick_device  # noqa: E402
from files import check_writable  # noqa: E402
from reports import format_or_na, markdown_table, provenance, pyplot, save_figure, write_report  # noqa: E402


@dataclass
class AccuracyConfig:
    ckpt: str = flag('', 'a trained checkpoint (or diffusers folder) to measure too')
    sample_batch: int = flag(64, "the trained model's images", at_least=1)
    quick: bool = flag(False, "5 and 20 calls, 1000 mixture samples, the trained model's reference at 200 calls: "
                              'the wiring')
    device: str = flag('cpu', 'where the trained model runs')
    seed: int = flag(0, 'seed of the noise', at_least=0, at_most=2 ** 32 - 1)
    out_dir: str = flag('runs/solver-accuracy', 'where the JSON, Markdown and PNG go (results/ only when named: '
                                                'a run never replaces the committed evidence by default)')
    stem: str = flag('solver-accuracy', 'output file name stem, a plain name (--out-dir says where)')


CALLS = (5, 10, 20, 50, 100, 1000)
SAMPLERS = ('ddim', 'ddim-clip-x0', 'ddpm', 'dpm++-linspace', 'dpm++-trailing', 'dpm++-logsnr')


class GaussianMixture(torch.nn.Module):
    """Data from a mixture of isotropic Gaussians N(mu_k, s^2 I) with weights w_k, and its exact
    denoiser, in closed form: x_t | k ~ N(alpha mu_k, v I) with v = alpha^2 s^2 + sigma^2, so
    E[x_0 | x_t] = sum_k gamma_k (mu_k + alpha s^2 / v (x_t - alpha mu_k)), gamma_k the posterior
    weight of component k, and the perfect model predicts eps = (x_t - alpha E[x_0 | x_t]) / sigma.
    A sampler's error is then measured without a trained network. Data are (N, D, 1, 1)."""

    def __init__(self, sched, means, std: float, weights):
        super().__init__()
        self.abar = sched.alphas_cumprod.double()
        self.means, self.std = torch.as_tensor(means, dtype=torch.float64), std  # (K, D)
        self.weights = torch.as_tensor(weights, dtype=torch.float64)

    def forward(self, xt, t):
        x = xt.double().flatten(1)  # (B, D)
        abar = self.abar.to(x.device)[t].view(-1, 1, 1)  # (B, 1, 1)
        alpha, sigma2 = abar.sqrt(), 1 - abar
        v = abar * self.std ** 2 + sigma2
        centred = x[:, None, :] - alpha * self.means.to(x.device)  # (B, K, D)
        logits = self.weights.log().to(x.device) - centred.square().sum(-1) / (2 * v[:, :, 0])  # (B, K)
        gamma = logits.softmax(-1)[:, :, None]
        x0 = (gamma * (self.means.to(x.device) + alpha * self.std ** 2 / v * centred)).sum(1)
        eps = (x - alpha[:, 0] * x0) / sigma2[:, 0].sqrt()
        return eps.view_as(xt).to(xt.dtype)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        noise = torch.randn(n, self.means.shape[1], generator=generator, dtype=torch.float64)
        return (self.means[k] + self.std * noise)[:, :, None, None]

    def moments(self) -> tuple:
        mean = self.weights @ self.means
        second = (self.weights[:, None, None] * (self.means[:, :, None] * self.means[:, None, :])).sum(0)
        return mean, second + self.std ** 2 * torch.eye(len(mean), dtype=torch.float64) - mean[:, None] * mean[None]


def sliced_wasserstein(a: torch.Tensor, b: torch.Tensor, projections: int = 128, seed: int = 0) -> float:
    """The sliced Wasserstein-1 distance of two equal-sized sets of points: the W1 distance of
    their 1-D projections (sorted and matched), averaged over random directions."""
    a, b = a.flatten(1).double(), b.flatten(1).double()
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(a.shape[1], projections, generator=generator, dtype=torch.float64)
    directions /= directions.norm(dim=0)
    return ((a @ directions).sort(0).values - (b @ directions).sort(0).values).abs().mean().item()


def solve(sampler: str, calls: int, model, sched, shape, seed: int, device, prediction: str = 'eps') -> torch.Tensor:
    """x_0 from x_T drawn with `seed` (the same x_T for every sampler) in `calls` model calls.
    'ddim' and 'ddpm' below T calls (DDIM at eta 1) take the DDIM code's grid, 'leading'; only
    'ddim-clip-x0' clips the predicted x_0, so the others solve one ODE (or SDE)."""
    dtype = torch.float64 if isinstance(model, GaussianMixture) else torch.float32
    kind, _, option = sampler.partition('-')
    common = dict(generator=torch.Generator(device).manual_seed(seed), device=device, dtype=dtype,
                  prediction=prediction)
    if kind == 'dpm++':
        return diffusion.run_sampler('dpm++', model, sched, shape, calls, spacing=option, **common)
    if kind == 'ddpm' and calls == sched.num_steps:
        return diffusion.run_sampler('ddpm', model, sched, shape, clip='none', **common)
    return diffusion.run_sampler('ddim', model, sched, shape, calls, eta=1.0 if kind == 'ddpm' else 0.0,
                                 clip='x0' if option == 'clip-x0' else 'none', spacing='leading', **common)


def mixture_rows(calls: tuple, n: int, seed: int) -> tuple:
    sched = diffusion.make_schedule(1000)
    mixture = GaussianMixture(sched, [[-0.5, -0.4], [0.5, -0.3], [0.0, 0.6]], 0.08, [0.3, 0.3, 0.4])
    true_mean, true_cov = mixture.moments()
    truth, shape, cpu = mixture.sample(n, torch.Generator().manual_seed(seed + 1)), (n, 2, 1, 1), torch.device('cpu')
    ode = solve('dpm++-linspace', sched.num_steps, mixture, sched, shape, seed, cpu)
    rows = []
    for sampler in SAMPLERS:
        for k in calls:
            print(f'mixture: {sampler}, {k} calls ...', flush=True)
            x = solve(sampler, k, mixture, sched, shape, seed, cpu)
            flat = x.flatten(1)
            rows.append({'data': 'gaussian mixture (2-D)', 'sampler': sampler, 'calls': k,
                         'mean_error': (flat.mean(0) - true_mean).norm().item(),
                         'cov_error': (torch.cov(flat.T) - true_cov).norm().item(),
                         'sliced_w1': sliced_wasserstein(x, truth),
                         'to_ode': None if sampler == 'ddpm' else (x - ode).square().mean().sqrt().item()})
    floor = sliced_wasserstein(mixture.sample(n, torch.Generator().manual_seed(seed + 2)), truth)
    return rows, floor


def checkpoint_rows(loaded: tuple, path: str, calls: tuple, batch: int, seed: int, device,
                    reference_calls: int = 0) -> list:
    """RMS distance (in [-1, 1] units and in grey levels) of a trained model's N-call images to its
    own converged ODE solution from the same noise (DPM-Solver++ over every timestep, or over
    `reference_calls` of them). `loaded`: sample.load_model's (model, config, schedule, prediction) of `path`."""
    model, config, sched, prediction = loaded
    shape = (batch, config.in_channels, config.image_size, config.image_size)
    reference = solve('dpm++-linspace', reference_calls or sched.num_steps, model, sched, shape, seed, device,
                      prediction)
    rows = []
    for sampler in [s for s in SAMPLERS if s != 'ddpm']:
        for k in calls:
            print(f'{path}: {sampler}, {k} calls ...', flush=True)
            x = solve(sampler, k, model, sched, shape, seed, device, prediction)
            rms = (x - reference).float().square().mean().sqrt().item()
            rows.append({'data': f'trained model ({path})', 'sampler': sampler, 'calls': k, 'to_ode': rms,
                         'to_ode_levels': rms * 127.5})
    return rows


def main(argv=None) -> int:
    return run_main(study, parse_config(argv, AccuracyConfig, __doc__))


def study(args: AccuracyConfig):
    check_ranges(args)
    check_plain_name(args.stem, '--stem')
    calls, n = ((5, 20), 1000) if args.quick else (CALLS, 20000)
    device = pick_device(args.device)
    checked = sample.load_model(args.ckpt, 'ema', device) if args.ckpt else None  # a bad --ckpt fails first
    check_writable(args.out_dir, '--out-dir')
    rows, floor = mixture_rows(calls, n, args.seed)
    if checked:
        # --quick's reference: 200 calls, ten times the most compared (the wiring, in a fifth of the time)
        rows += checkpoint_rows(checked, args.ckpt, calls, args.sample_batch, args.seed, device, 200 * args.quick)
    result = {**provenance('CPU' if args.device == 'cpu' else args.device), 'config': asdict(args), 'samples': n,
              'rows': rows,
              'floor': {'sliced_w1': floor}}
    table = markdown_table(
        ['Data', 'Sampler', 'Model calls', 'mean error', 'covariance error', 'sliced W1', 'RMS to the ODE solution',
         'in grey levels'],
        [[r['data'], r['sampler'], r['calls']] + [format_or_na(r.get(key), spec) for key, spec in (
            ('mean_error', '.4f'), ('cov_error', '.4f'), ('sliced_w1', '.4f'), ('to_ode', '.2e'),
            ('to_ode_levels', '.2f'))] for r in rows], left=2)
    png = write_report(args.out_dir, args.stem, result, 'Sampler accuracy against exact answers', table,
                       notes=f'; {n} samples of a 2-D Gaussian mixture with its exact denoiser (sliced W1 between two '
                             f'sets of true samples: {floor:.4f}, the noise floor)')
    plot(rows, png, floor)
    print(table)


def plot(rows: list, path: str, floor: float):
    """Error against model calls, log-log: one panel per measure and data, one colour per sampler."""
    colours = {'ddim': 'tab:blue', 'ddim-clip-x0': 'tab:red', 'ddpm': 'tab:gray', 'dpm++-linspace': 'tab:orange',
               'dpm++-trailing': 'tab:purple', 'dpm++-logsnr': 'tab:green'}
    panels = [('gaussian mixture (2-D)', 'sliced_w1', 'sliced W1 to the true distribution'),
              ('gaussian mixture (2-D)', 'to_ode', 'RMS distance to the ODE solution')]
    panels += [(d, 'to_ode', 'RMS distance to the ODE solution') for d in dict.fromkeys(r['data'] for r in rows)
               if d.startswith('trained')]
    fig, axes = pyplot().subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (source, key, label) in zip(axes[0], panels):
        for sampler, colour in colours.items():
            points = [(r['calls'], r[key]) for r in rows if r['data'] == source and r['sampler'] == sampler
                      and r.get(key)]
            if points:
                ax.loglog(*zip(*points), 'o-', color=colour, label=sampler)
        if key == 'sliced_w1':
            ax.axhline(floor, color='black', linestyle=':', label='two true samples (noise floor)')
        ax.set(xlabel='model calls per image', ylabel=label, title=source if len(source) < 48 else source[:45] + '...')
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3, which='both')
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


if __name__ == '__main__':
    sys.exit(main())

"""The few-step students' maths: progressive distillation's grid, targets and sampler, and consistency
students' noise levels, gap schedule, boundary condition and sampler (distill.py trains the students,
sample.py draws them). Built on diffusion.py's schedule and parameterisations."""
import torch
from tqdm import tqdm

from diffusion import PREDICTIONS, Schedule, gather, standard_normal, eps_and_x0

# Progressive distillation (Salimans & Ho 2022, "Progressive Distillation for Fast Sampling of Diffusion
# Models"; their code: google-research diffusion_distillation, dpm.py, Model.training_losses). A student
# of N steps learns to land, in one deterministic DDIM step, where two DDIM steps of its teacher (of 2N
# steps) land; it then teaches a student of N/2. Here z_t = alpha_t x + sigma_t eps (eq. 4), alpha_t =
# sqrt(abar_t), sigma_t = sqrt(1 - abar_t), and timestep -1 is the clean endpoint (alpha 1, sigma 0).

STUDENT_PREDICTIONS = ('v', 'x')


def student_timesteps(steps: int, num_steps: int = 1000) -> list:
    """The time grid of an N-step student, its teacher and its sampler alike: t_i = round(T i / N) - 1
    for i = N, N-1, ..., 0 ("trailing" spacing), from the last timestep T-1 (so that one step starts
    from pure noise) down to -1, the clean endpoint; N + 1 entries. Rounded half up in integers,
    (2 T i + N) // (2 N) - 1, so that the grids nest exactly: the 2N-step grid at 2i is
    (4 T i + 2N) // (4N) - 1, the N-step grid at i, and a student's every other teacher point is its
    own. It is diffusers' 'trailing' grid where T / N is whole (1, 2, 4 and 8 steps at T = 1000)."""
    if not 1 <= steps <= num_steps:
        raise ValueError(f'a student takes 1 to {num_steps} steps, got {steps}')
    return [(2 * num_steps * i + steps) // (2 * steps) - 1 for i in range(steps, -1, -1)]


def alpha_sigma(sched: Schedule, t: torch.Tensor, like: torch.Tensor) -> tuple:
    """(alpha_t, sigma_t) at per-image timesteps t as (B, 1, ...) tensors in like's dtype (eq. 4);
    t = -1 is the clean endpoint, (1, 0) exactly."""
    alphas = torch.cat([sched.sqrt_alphas_cumprod.new_ones(1), sched.sqrt_alphas_cumprod])
    sigmas = torch.cat([sched.sqrt_one_minus_alphas_cumprod.new_zeros(1), sched.sqrt_one_minus_alphas_cumprod])
    return gather(alphas, t + 1, like), gather(sigmas, t + 1, like)


def x_and_eps(output: torch.Tensor, z: torch.Tensor, alpha, sigma, prediction: str) -> tuple:
    """(x, eps) that a network's output stands for at z = alpha x + sigma eps: 'eps' and 'v' as
    eps_and_x0; 'x' (Salimans & Ho 2022, section 4): the output is x itself, eps = (z - alpha x) / sigma
    (eq. 4 solved for eps; sigma > 0 at every timestep the network sees)."""
    if prediction == 'x':
        return output, (z - alpha * output) / sigma
    eps, x = eps_and_x0(output, z, alpha, sigma, prediction)
    return x, eps


def output_for(x: torch.Tensor, eps: torch.Tensor, alpha, sigma, prediction: str) -> torch.Tensor:
    """What a network of `prediction` outputs for (x, eps): eps, x, or v = alpha eps - sigma x
    (Salimans & Ho 2022, section 4); x_and_eps inverts it."""
    if prediction == 'eps':
        return eps
    if prediction == 'x':
        return x
    if prediction == 'v':
        return alpha * eps - sigma * x
    raise ValueError(f"prediction must be one of {PREDICTIONS + ('x',)}, got {prediction!r}")


def ddim_to(x: torch.Tensor, eps: torch.Tensor, alpha_to, sigma_to) -> torch.Tensor:
    """DDIM's deterministic update (Song et al. 2021, eq. 12 with sigma = 0) from a prediction (x, eps)
    to the noise level (alpha_to, sigma_to): alpha_to x + sigma_to eps; at the clean endpoint, x."""
    return alpha_to * x + sigma_to * eps


def distillation_target(z: torch.Tensor, z_teacher: torch.Tensor, alpha, sigma, alpha_to, sigma_to) -> torch.Tensor:
    """The x that one student DDIM step from z (at alpha, sigma) must predict to land on the teacher's
    z'' (at alpha'', sigma''): x~ = (z'' - (sigma''/sigma) z) / (alpha'' - (sigma''/sigma) alpha)
    (Salimans & Ho 2022, Algorithm 2). At the clean endpoint (sigma'' = 0, alpha'' = 1) it is z''
    itself, the teacher's x prediction at its second step, exactly. The denominator vanishes only
    where the two points have one SNR: never on a grid."""
    ratio = sigma_to / sigma
    return (z_teacher - ratio * z) / (alpha_to - ratio * alpha)


@torch.no_grad()
def student_sample(model, sched: Schedule, shape, steps: int, generator: torch.Generator = None, device='cpu',
                   progress: bool = False, dtype=torch.float32, prediction: str = 'v', x: torch.Tensor = None):
    """A distilled student's sampler: `steps` deterministic DDIM steps (ddim_to) on student_timesteps,
    the grid it was trained on, from x_T ~ N(0, I) (or `x`) at t = T-1 to the clean endpoint, one call
    per step, unclipped as in training. Returns images clamped to [-1, 1]."""
    grid = student_timesteps(steps, sched.num_steps)
    z = standard_normal(shape, generator, device, dtype) if x is None else x
    for step, to in tqdm(list(zip(grid[:-1], grid[1:])), disable=not progress, desc='student'):
        t = torch.full((shape[0],), step, device=device, dtype=torch.long)
        alpha, sigma = alpha_sigma(sched, t, z)
        x0, eps = x_and_eps(model(z, t).to(z.dtype), z, alpha, sigma, prediction)
        z = ddim_to(x0, eps, *alpha_sigma(sched, torch.full_like(t, to), z))
    return z.clamp(-1, 1)


# Consistency models (Song et al. 2023, "Consistency Models"), tuned from a trained diffusion model as ECT
# does (Geng et al. 2025, "Consistency Models Made Easy"; their code: locuslab/ect, training/loss.py). The
# student f(z_t, t) maps any point of a probability-flow trajectory to its clean end. ECT works in EDM's
# noise level s = sigma / alpha: z_t / alpha_t = x + s_t eps, so a VP timestep t is the level s_t, and the
# clean endpoint (timestep -1) is s = 0.

ECT_Q, ECT_K, ECT_B = 2.0, 8.0, 1.0  # the gap's halving factor and the sigmoid's k, b (ECT's defaults, ct_train.py)
ECT_P_MEAN, ECT_P_STD = -1.1, 2.0  # ln s ~ N(P_mean, P_std^2), the levels the loss visits (ECT's, EDM's P_mean)


def noise_levels(sched: Schedule) -> torch.Tensor:
    """s_t = sigma_t / alpha_t for t = 0..T-1, increasing (float64): EDM's sigma of each VP timestep."""
    return sched.sqrt_one_minus_alphas_cumprod / sched.sqrt_alphas_cumprod


def ect_gap(s: torch.Tensor, stage: int, q: float = ECT_Q, k: float = ECT_K, b: float = ECT_B) -> torch.Tensor:
    """ECT's r(t) at stage `stage` (0, 1, ...): r = s (1 - (1 + k sigmoid(-b s)) / q^(stage + 1)), clamped
    at 0 (their t_to_r_sigmoid): at stage 0 r is the clean end wherever 1 + k sigmoid(-b s) >= q (small s),
    so the first stage is mostly denoising; each stage shrinks the relative gap (s - r) / s by q."""
    return (s * (1 - (1 + k * torch.sigmoid(-b * s)) / q ** (stage + 1))).clamp(min=0)


def level_timestep(levels: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The largest timestep whose level is at most s; -1 (the clean end) below the first level."""
    return torch.searchsorted(levels.to(s.device, s.dtype), s.contiguous(), right=True) - 1


def consistency_pair(sched: Schedule, stage: int, batch: int, device, generator: torch.Generator = None,
                     mean: float = ECT_P_MEAN, std: float = ECT_P_STD) -> tuple:
    """(t, r) per image: s ~ lognormal(mean, std^2) (ECT's P_mean, P_std) taken to the timestep nearest in
    ln s (clamped to 0..T-1), r the timestep at or below ect_gap(s_t), which is under s_t, so r < t: the VP
    grid's discrete form of ECT's pair."""
    levels = noise_levels(sched).to(device)
    log_s = mean + std * torch.randn(batch, generator=generator, device=device, dtype=torch.float64)
    t = (levels.log()[None, :] - log_s[:, None]).abs().argmin(1)
    return t, level_timestep(levels, ect_gap(levels[t], stage))


def consistency_fn(output: torch.Tensor, z: torch.Tensor, t: torch.Tensor, alpha, sigma, prediction: str):
    """f(z_t, t): the x that the network's output stands for (x_and_eps; for 'v', x = alpha z - sigma v,
    EDM's c_skip = 1 / (1 + s^2) and c_out = -s / sqrt(1 + s^2) with sigma_data = 1, in z / alpha), and z
    itself at the clean end t = -1: the boundary condition f(x, t_min) = x holds exactly, whatever the
    network outputs there."""
    x, _ = x_and_eps(output, z, alpha, sigma, prediction)
    return torch.where(t.reshape(-1, *([1] * (z.dim() - 1))) < 0, z, x)


def pseudo_huber(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """Per image sqrt(||a - b||^2 + c^2) - c (Song & Dhariwal 2024, iCT; c = 0: the L2 distance, ECT's)."""
    return ((a - b).square().flatten(1).sum(1) + c ** 2).sqrt() - c


def consistency_timesteps(steps: int, mid: int, num_steps: int = 1000) -> list:
    """The timesteps a consistency student is called at: T-1, then (two calls) `mid`."""
    if steps not in (1, 2):
        raise ValueError(f'a consistency student draws in 1 or 2 calls, got {steps}')
    if steps == 2 and not 0 <= mid < num_steps - 1:
        raise ValueError(f'the second call\'s timestep must be in 0..{num_steps - 2}, got {mid}')
    return [num_steps - 1] + ([mid] if steps == 2 else [])


@torch.no_grad()
def consistency_sample(model, sched: Schedule, shape, timesteps: list, generator: torch.Generator = None,
                       device='cpu', dtype=torch.float32, prediction: str = 'v', x: torch.Tensor = None):
    """Multistep consistency sampling (Song et al. 2023, Algorithm 1): x = f(z, T-1) from z ~ N(0, I) (or
    `x`); then at each further timestep m, z = alpha_m x + sigma_m eps with fresh noise, x = f(z, m). One
    call per timestep. Returns images clamped to [-1, 1]."""
    z = standard_normal(shape, generator, device, dtype) if x is None else x
    for i, step in enumerate(timesteps):
        t = torch.full((shape[0],), step, device=device, dtype=torch.long)
        alpha, sigma = alpha_sigma(sched, t, z)
        if i > 0:
            z = alpha * z + sigma * standard_normal(shape, generator, device, dtype)
        z = consistency_fn(model(z, t).to(z.dtype), z, t, alpha, sigma, prediction)
    return z.clamp(-1, 1)

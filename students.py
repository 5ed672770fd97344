"""The few-step students' maths: progressive distillation's grid, targets and sampler (distill.py
trains the students, sample.py draws them). Built on diffusion.py's schedule and parameterisations."""
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

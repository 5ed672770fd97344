"""DDPM maths as small functions over a precomputed schedule.

Equation numbers refer to Ho, Jain & Abbeel (2020), "Denoising Diffusion Probabilistic
Models" unless another paper is named. Tables are computed in float64 and each function
gathers what it needs for a batch of timesteps and casts it to the images' dtype.

The network predicts the noise eps (the paper's choice, prediction='eps') or
v = alpha_t eps - sigma_t x_0 (Salimans & Ho 2022, prediction='v'): every sampler and bound
reads its output through eps_and_x0 alone, and the loss takes its target from prediction_target.
"""
import math
from dataclasses import dataclass, fields

import numpy as np
import torch
from tqdm import tqdm


@dataclass
class Schedule:
    betas: torch.Tensor
    alphas_cumprod: torch.Tensor
    alphas_cumprod_prev: torch.Tensor
    sqrt_alphas_cumprod: torch.Tensor
    sqrt_one_minus_alphas_cumprod: torch.Tensor
    sqrt_recip_alphas_cumprod: torch.Tensor
    sqrt_recipm1_alphas_cumprod: torch.Tensor
    posterior_variance: torch.Tensor
    posterior_log_variance_clipped: torch.Tensor
    posterior_mean_coef1: torch.Tensor
    posterior_mean_coef2: torch.Tensor

    @property
    def num_steps(self) -> int:
        return len(self.betas)

    def to(self, device) -> 'Schedule':
        return Schedule(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def make_betas(num_steps: int = 1000, kind: str = 'linear') -> np.ndarray:
    """Linear betas from 1e-4 to 0.02 (section 4; the paper uses T=1000), or the cosine
    schedule of Nichol & Dhariwal (2021, eq. 17)."""
    if kind == 'linear':
        return np.linspace(1e-4, 0.02, num_steps, dtype=np.float64)
    if kind == 'cosine':
        s = 0.008
        steps = np.arange(num_steps + 1, dtype=np.float64) / num_steps
        f = np.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
        return np.clip(1 - f[1:] / f[:-1], 0, 0.999)
    raise ValueError(f"unknown schedule {kind!r}: use 'linear' or 'cosine'")


def make_schedule(num_steps: int = 1000, kind: str = 'linear') -> Schedule:
    """Every table the samplers and losses need, in float64 (eqs. 4, 6, 7)."""
    betas = make_betas(num_steps, kind)
    alphas_cumprod = np.cumprod(1.0 - betas)
    alphas_cumprod_prev = np.append(1.0, alphas_cumprod[:-1])
    posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)  # eq. 7
    tables = dict(
        betas=betas,
        alphas_cumprod=alphas_cumprod,
        alphas_cumprod_prev=alphas_cumprod_prev,
        sqrt_alphas_cumprod=np.sqrt(alphas_cumprod),
        sqrt_one_minus_alphas_cumprod=np.sqrt(1.0 - alphas_cumprod),
        sqrt_recip_alphas_cumprod=np.sqrt(1.0 / alphas_cumprod),
        sqrt_recipm1_alphas_cumprod=np.sqrt(1.0 / alphas_cumprod - 1),
        posterior_variance=posterior_variance,
        # The variance is 0 at t=0; its log is clipped to the t=1 value, as in the paper's code.
        posterior_log_variance_clipped=np.log(np.append(posterior_variance[1], posterior_variance[1:])),
        posterior_mean_coef1=betas * np.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod),  # eq. 7
        posterior_mean_coef2=(1.0 - alphas_cumprod_prev) * np.sqrt(1.0 - betas) / (1.0 - alphas_cumprod),
    )
    return Schedule(**{name: torch.from_numpy(value) for name, value in tables.items()})


def schedule_kind(sched: Schedule) -> str:
    """Which of make_betas' schedules `sched` is, 'linear' or 'cosine' (ValueError for another)."""
    for kind in ('linear', 'cosine'):
        if torch.allclose(sched.betas.cpu(), torch.from_numpy(make_betas(sched.num_steps, kind)), rtol=1e-12):
            return kind
    raise ValueError('neither the linear nor the cosine beta schedule')


def gather(table: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """table[t] as a (B, 1, 1, 1) tensor in like's dtype, on like's device."""
    return table.to(like.device)[t].to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


PREDICTIONS = ('eps', 'v')


def eps_and_x0(output: torch.Tensor, xt: torch.Tensor, alpha, sigma, prediction: str = 'eps') -> tuple:
    """(eps, x_0) that the network's output stands for at x_t = alpha x_0 + sigma eps (eq. 4, with
    alpha = sqrt(abar_t), sigma = sqrt(1 - abar_t): python floats or gathered tensors).
    'eps': x_0 = (x_t - sigma eps) / alpha, eq. 4 solved for x_0 (as in eq. 15).
    'v': v = alpha eps - sigma x_0 (Salimans & Ho 2022, section 4); as alpha^2 + sigma^2 = 1,
    x_0 = alpha x_t - sigma v and eps = sigma x_t + alpha v."""
    if prediction == 'eps':
        return output, (xt - sigma * output) / alpha
    if prediction == 'v':
        return sigma * xt + alpha * output, alpha * xt - sigma * output
    raise ValueError(f'prediction must be one of {PREDICTIONS}, got {prediction!r}')


def prediction_target(sched: 'Schedule', x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                      prediction: str = 'eps') -> torch.Tensor:
    """What the network learns to output at x_t = q_sample(x0, t, noise): the noise itself (eq. 14),
    or v = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0 (Salimans & Ho 2022, section 4)."""
    if prediction == 'eps':
        return noise
    if prediction == 'v':
        return (gather(sched.sqrt_alphas_cumprod, t, x0) * noise
                - gather(sched.sqrt_one_minus_alphas_cumprod, t, x0) * x0)
    raise ValueError(f'prediction must be one of {PREDICTIONS}, got {prediction!r}')


def q_sample(sched: Schedule, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, a sample of q(x_t | x_0) (eq. 4)."""
    return gather(sched.sqrt_alphas_cumprod, t, x0) * x0 + gather(sched.sqrt_one_minus_alphas_cumprod, t, x0) * noise


LOSS_WEIGHTS = ('uniform', 'min-snr')


def loss_weight_table(sched: Schedule, loss_weight: str = 'uniform', snr_gamma: float = 5.0,
                      prediction: str = 'eps') -> torch.Tensor:
    """The per-timestep weight of the training loss, a (T,) float64 table on sched's device.
    'uniform': 1, L_simple (eq. 14). 'min-snr' (Hang et al. 2023): min(SNR_t, gamma) on the x_0
    error, SNR_t = abar_t / (1 - abar_t). As x_0 - x0_pred = -(eps - eps_pred) / sqrt(SNR_t) and
    v - v_pred = (eps - eps_pred) / sqrt(abar_t), that is min(SNR_t, gamma) / SNR_t on the eps error
    and min(SNR_t, gamma) / (SNR_t + 1) on the v error."""
    if loss_weight == 'uniform':
        return torch.ones_like(sched.alphas_cumprod)
    if loss_weight != 'min-snr':
        raise ValueError(f'loss_weight must be one of {LOSS_WEIGHTS}, got {loss_weight!r}')
    if not snr_gamma > 0:
        raise ValueError(f'snr_gamma must be positive, got {snr_gamma}')
    snr = sched.alphas_cumprod / (1 - sched.alphas_cumprod)
    if prediction == 'eps':
        return (snr_gamma / snr).clamp(max=1.0)  # min(SNR, gamma) / SNR, finite where SNR underflows
    if prediction == 'v':
        return snr.clamp(max=snr_gamma) / (snr + 1)
    raise ValueError(f'prediction must be one of {PREDICTIONS}, got {prediction!r}')


T_SAMPLINGS = ('uniform', 'lognormal', 'laplace')
T_SAMPLING_DEFAULTS = {'lognormal': (-1.2, 1.2), 'laplace': (0.0, 0.5)}  # (mean, scale) of their papers


def timestep_probabilities(sched: Schedule, kind: str = 'uniform', mean: float = None,
                           scale: float = None) -> torch.Tensor:
    """p(t) of the training timesteps, a (T,) float64 table. 'uniform': 1/T (Algorithm 1).
    'lognormal' (Karras et al. 2022, EDM's P_mean -1.2, P_std 1.2): ln sigma ~ N(mean, scale^2), with
    sigma_t = sqrt((1 - abar_t) / abar_t). 'laplace' (Hang et al. 2024, mean 0, scale 0.5): the log-SNR
    lambda_t = -2 ln sigma_t ~ Laplace(mean, scale). Timestep t takes the continuous law's mass between
    the midpoints of its neighbours' ln sigma (the T steps partition the line)."""
    T = sched.num_steps
    if kind == 'uniform':
        return torch.full((T,), 1.0 / T, dtype=torch.float64, device=sched.alphas_cumprod.device)
    if kind not in T_SAMPLING_DEFAULTS:
        raise ValueError(f't sampling must be one of {T_SAMPLINGS}, got {kind!r}')
    default_mean, default_scale = T_SAMPLING_DEFAULTS[kind]
    mean, scale = default_mean if mean is None else mean, default_scale if scale is None else scale
    if not scale > 0:
        raise ValueError(f'the scale of the {kind} timestep law must be positive, got {scale}')
    ln_sigma = 0.5 * (torch.log1p(-sched.alphas_cumprod) - torch.log(sched.alphas_cumprod))  # increasing in t
    edges = torch.cat([ln_sigma.new_tensor([-math.inf]), (ln_sigma[1:] + ln_sigma[:-1]) / 2,
                       ln_sigma.new_tensor([math.inf])])
    if kind == 'lognormal':
        cdf = 0.5 * (1 + torch.special.erf((edges - mean) / (scale * math.sqrt(2))))
    else:  # ln sigma = -lambda / 2 ~ Laplace(-mean / 2, scale / 2)
        z = (edges + mean / 2) / (scale / 2)
        cdf = torch.where(z < 0, 0.5 * torch.exp(z.clamp(max=0)), 1 - 0.5 * torch.exp(-z.clamp(min=0)))
    mass = (cdf[1:] - cdf[:-1]).clamp(min=0)
    return mass / mass.sum()


def immiscible_noise(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Immiscible diffusion's noise assignment (Li et al. 2024, arXiv 2406.12303): the batch's noise
    draws handed out to its images so that the summed L2 distance sum_i ||x0_i - noise_pi(i)|| is the
    smallest over all permutations pi (a linear assignment; scipy's linear_sum_assignment). Every
    image still gets one draw of N(0, I) and the set of draws is unchanged: only which image gets
    which. Solved on the host: one synchronisation per step on a GPU."""
    from scipy.optimize import linear_sum_assignment
    cost = torch.cdist(x0.flatten(1).double(), noise.flatten(1).double())  # (B, B)
    _, pick = linear_sum_assignment(cost.cpu().numpy())
    return noise[torch.as_tensor(pick, device=noise.device)]


def training_loss(model, sched: Schedule, x0: torch.Tensor, t=None, noise=None, per_example=False,
                  prediction: str = 'eps', loss_weight: str = 'uniform', snr_gamma: float = 5.0,
                  t_probs: torch.Tensor = None, t_reweight: bool = False,
                  input_perturbation: float = 0.0, labels: torch.Tensor = None) -> torch.Tensor:
    """L_simple (eq. 14, Algorithm 1): MSE between the model's output and its target (the noise, or
    v with prediction='v'), with t uniform on {0, ..., T-1} and eps ~ N(0, I) unless given; with
    loss_weight='min-snr' each image's MSE is weighted by loss_weight_table at its t, a table
    gathered on the device (no host sync, nothing that depends on t traced as a constant).
    t_probs: t drawn from this (T,) table instead (timestep_probabilities), weighted by
    (1/T) / p(t) with t_reweight, so that the objective stays L_simple's. input_perturbation gamma
    (Ning et al. 2023, DDPM-IP): the network sees x_t made with eps + gamma xi, xi ~ N(0, I), and
    still learns the target of eps alone. labels: the images' classes, for a class-conditional
    network (drop_labels decides which it sees). A scalar, or (B,) per image."""
    if t is None:
        t = (torch.randint(0, sched.num_steps, (x0.shape[0],), device=x0.device) if t_probs is None
             else torch.multinomial(t_probs.float(), x0.shape[0], replacement=True))
    if noise is None:
        noise = torch.randn_like(x0)
    target = prediction_target(sched, x0, t, noise, prediction)
    seen = noise + input_perturbation * torch.randn_like(x0) if input_perturbation else noise
    xt = q_sample(sched, x0, t, seen)
    squared_error = ((model(xt, t) if labels is None else model(xt, t, labels)).float() - target).square()
    if loss_weight == 'uniform' and not t_reweight:  # L_simple exactly as the paper computes it
        return squared_error.flatten(1).mean(1) if per_example else squared_error.mean()
    per_image = squared_error.flatten(1).mean(1)
    weights = loss_weight_table(sched, loss_weight, snr_gamma, prediction)
    if t_reweight and t_probs is not None:
        weights = weights / (sched.num_steps * t_probs)
    per_image = per_image * gather(weights, t, per_image)
    return per_image if per_example else per_image.mean()


def drop_labels(labels: torch.Tensor, probability: float, null_label: int) -> torch.Tensor:
    """Classifier-free guidance's training (Ho & Salimans 2022, Algorithm 1): each label replaced by
    the 'no class' label with `probability` (p_uncond), so that one network learns the conditional
    and the unconditional model. Drawn on the labels' device: no host sync."""
    dropped = torch.rand(labels.shape, device=labels.device) < probability
    return torch.where(dropped, torch.full_like(labels, null_label), labels)


def guided(model, labels: torch.Tensor, scale: float, null_label: int):
    """Classifier-free guidance (Ho & Salimans 2022, eq. 6) as a model(x_t, t) that every sampler
    calls as it calls the network:

        out = out(x_t, t, no class) + scale * (out(x_t, t, c) - out(x_t, t, no class))

    diffusers' guidance_scale convention: scale 1 is the conditional model alone, 0 the
    unconditional one, above 1 guidance (the paper's w is scale - 1: (1 + w) out_c - w out_u).
    Applied to the network's output, eps or v: at a fixed x_t each is an affine function of the
    other with the same coefficients for both terms, and the weights (1 - scale, scale) sum to 1,
    so guiding v is guiding eps. The conditional and unconditional halves run as one batched call."""
    null = torch.full_like(labels, null_label)
    if scale == 1:
        return lambda xt, t: model(xt, t, labels)
    if scale == 0:
        return lambda xt, t: model(xt, t, null)

    def output_of(xt, t):
        conditional, unconditional = model(torch.cat([xt, xt]), torch.cat([t, t]), torch.cat([labels, null])).chunk(2)
        return unconditional + scale * (conditional - unconditional)
    return output_of


def as_eps_model(model, sched: Schedule, prediction: str = 'eps'):
    """The network as a predictor of the noise (eps_and_x0 applied to its output): what the held-out
    loss measures, so that eps and v runs are compared in one unit, the eps MSE of eq. 14."""
    if prediction == 'eps':
        return model

    def eps_of(xt, t):
        alpha, sigma = gather(sched.sqrt_alphas_cumprod, t, xt), gather(sched.sqrt_one_minus_alphas_cumprod, t, xt)
        return eps_and_x0(model(xt, t).to(xt.dtype), xt, alpha, sigma, prediction)[0]
    return eps_of


def predict_x0(sched: Schedule, xt: torch.Tensor, t: torch.Tensor, eps: torch.Tensor,
               prediction: str = 'eps') -> torch.Tensor:
    """x_0 from the network's output `eps` (the noise, or v with prediction='v') at per-image
    timesteps t: eq. 4 solved for x_0 (used in eq. 15), through eps_and_x0."""
    alpha, sigma = gather(sched.sqrt_alphas_cumprod, t, xt), gather(sched.sqrt_one_minus_alphas_cumprod, t, xt)
    return eps_and_x0(eps, xt, alpha, sigma, prediction)[1]


def q_posterior(sched: Schedule, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor):
    """Mean, variance and clipped log variance of q(x_{t-1} | x_t, x_0) (eqs. 6 and 7)."""
    mean = gather(sched.posterior_mean_coef1, t, xt) * x0 + gather(sched.posterior_mean_coef2, t, xt) * xt
    return mean, gather(sched.posterior_variance, t, xt), gather(sched.posterior_log_variance_clipped, t, xt)


def model_log_variance(sched: Schedule, t: torch.Tensor, like: torch.Tensor, variance: str) -> torch.Tensor:
    """log sigma_t^2 of p(x_{t-1} | x_t) (section 3.2): 'fixedlarge' is sigma^2 = beta_t (with
    the t=0 entry set to the posterior variance at t=1, as in the paper's code), 'fixedsmall'
    is sigma^2 = beta-tilde_t."""
    if variance == 'fixedlarge':
        log_var = torch.log(torch.cat([sched.posterior_variance[1:2], sched.betas[1:]]))
    elif variance == 'fixedsmall':
        log_var = sched.posterior_log_variance_clipped
    else:
        raise ValueError(f"variance must be 'fixedlarge' or 'fixedsmall', got {variance!r}")
    return gather(log_var, t, like)


def p_mean_variance(model, sched: Schedule, xt: torch.Tensor, t: torch.Tensor,
                    variance: str = 'fixedlarge', clip_denoised: bool = True, prediction: str = 'eps'):
    """Mean and log variance of p(x_{t-1} | x_t) and the predicted x_0. The mean is eq. 11,
    computed as the posterior mean (eq. 7) at the predicted x_0 (eq. 15, from the model's eps or
    v), optionally clipped to [-1, 1] as the paper's sampler does."""
    output = model(xt, t).to(xt.dtype)  # bf16 under autocast: the maths in the images' precision
    x0 = predict_x0(sched, xt, t, output, prediction)
    if clip_denoised:
        x0 = x0.clamp(-1, 1)
    mean, _, _ = q_posterior(sched, x0, xt, t)
    return mean, model_log_variance(sched, t, xt, variance), x0


def standard_normal(shape, generator: torch.Generator, device, dtype=torch.float32) -> torch.Tensor:
    """Standard normal noise drawn on `device`, from `generator` (which must live there)."""
    if generator is not None and torch.device(generator.device).type != torch.device(device).type:
        raise ValueError(f'the generator is on {generator.device}, the samples on {device}: '
                         f'create it with torch.Generator(device)')
    return torch.randn(shape, generator=generator, device=device, dtype=dtype)


@torch.no_grad()
def ddpm_sample(model, sched: Schedule, shape, generator: torch.Generator = None, device='cpu',
                variance: str = 'fixedlarge', clip_denoised: bool = True, progress: bool = False,
                dtype=torch.float32, prediction: str = 'eps'):
    """Ancestral sampling, Algorithm 2: x_T ~ N(0, I), then x_{t-1} ~ p(x_{t-1} | x_t) for
    t = T-1, ..., 0, with no noise added at the last step. The noise comes from `generator`,
    on `device`. Returns images in [-1, 1]."""
    x = standard_normal(shape, generator, device, dtype)
    for step in tqdm(range(sched.num_steps - 1, -1, -1), disable=not progress, desc='ddpm'):
        t = torch.full((shape[0],), step, device=device, dtype=torch.long)
        mean, log_var, _ = p_mean_variance(model, sched, x, t, variance, clip_denoised, prediction)
        x = mean + (0.5 * log_var).exp() * standard_normal(shape, generator, device, dtype) if step > 0 else mean
    return x.clamp(-1, 1)


# The timestep grids of the few-call samplers, named and computed as diffusers' schedulers name and
# compute them (`timestep_spacing`; `use_lu_lambdas` for 'logsnr'), decreasing. The defaults are the
# grids measured best, or not worse than the best by more than the score's 5% noise on paired seeds, at
# every number of calls from 1 to 50 (results/cpu-digits-solver-grids*.md; docs/sampling.md, "Which grid").
SPACINGS = {'ddim': ('leading', 'trailing', 'linspace'), 'dpm++': ('leading', 'trailing', 'linspace', 'logsnr')}
DEFAULT_SPACING = {'ddim': 'trailing', 'dpm++': 'leading'}


def spacing_for(sampler: str, spacing: str = None, steps: int = None) -> str:
    """The grid `sampler` takes: `spacing`, or when None the sampler's default (DEFAULT_SPACING), except
    for DPM-Solver++ at one call, where 'leading' would start from pure noise at t = T // 2: 'trailing'
    ([T-1]) there."""
    if sampler not in SPACINGS:
        raise ValueError(f'{sampler} takes no --spacing (only {" and ".join(SPACINGS)} do)')
    if spacing is None and sampler == 'dpm++' and steps == 1:
        return 'trailing'
    spacing = DEFAULT_SPACING[sampler] if spacing is None else spacing
    if spacing not in SPACINGS[sampler]:
        raise ValueError(f'{sampler} takes spacing {", ".join(SPACINGS[sampler])}, got {spacing!r}')
    return spacing


def _trailing(num_steps: int, steps: int) -> list:
    """diffusers' 'trailing': round(arange(T, 0, -T/S)) - 1, from T-1 down, S of them. Where float
    arange yields S + 1 entries (S = 61, 103, ...: diffusers then ends at -1), the first S."""
    return [int(t) - 1 for t in np.arange(num_steps, 0, -num_steps / steps).round()[:steps]]


def ddim_timesteps(num_steps: int, sample_steps: int, spacing: str = None) -> list:
    """The `sample_steps` timesteps DDIM calls the model at, decreasing (diffusers' DDIMScheduler):
    'leading' every (T // S)-th from 0 (the DDIM code's 'uniform' skip, Song et al. 2021, section
    4.2: 980, 960, ..., 0 for S = 50; one call lands at t = 0, from pure noise); 'trailing' the same
    stride from T-1 down; 'linspace' round(linspace(0, T-1, S)). Each step goes to the next timestep of
    the grid and the last to the data (abar = 1). diffusers' DDIMScheduler steps to t - T // S
    instead: the same point on 'leading' and, where T / S is whole, on 'trailing', but not on
    'linspace' (docs/sampling.md, "Which grid")."""
    if not 1 <= sample_steps <= num_steps:
        raise ValueError(f'sample steps must be in [1, {num_steps}], got {sample_steps}')
    spacing = spacing_for('ddim', spacing)  # None: DEFAULT_SPACING['ddim']
    if spacing == 'leading':
        return [int(t) for t in (np.arange(sample_steps) * (num_steps // sample_steps)).round()[::-1]]
    if spacing == 'trailing':
        return _trailing(num_steps, sample_steps)
    return [int(t) for t in np.linspace(0, num_steps - 1, sample_steps).round()[::-1]]


DDIM_CLIPS = ('none', 'x0', 'x0+eps')


def ddim_clip(clip: str = None, clip_denoised: bool = None) -> str:
    """The DDIM clip mode from `clip` or the older boolean `clip_denoised` (True: 'x0', False: 'none');
    neither: 'none'."""
    if clip_denoised is not None:
        if clip is not None:
            raise ValueError('give clip or clip_denoised, not both')
        return 'x0' if clip_denoised else 'none'
    if clip is None:
        return 'none'
    if clip not in DDIM_CLIPS:
        raise ValueError(f'clip must be one of {DDIM_CLIPS}, got {clip!r}')
    return clip


def ddim_step(sched: Schedule, xt: torch.Tensor, output: torch.Tensor, step: int, prev_step: int,
              eta: float = 0.0, noise: torch.Tensor = None, clip_denoised: bool = None, clip: str = None,
              prediction: str = 'eps') -> torch.Tensor:
    """One DDIM update (Song, Meng & Ermon, 2021, eq. 12, sigma from eq. 16 scaled by eta):
    x_prev = sqrt(abar_prev) x0_pred + sqrt(1 - abar_prev - sigma^2) eps + sigma z, with (eps, x0_pred)
    from the model's output (eps_and_x0). prev_step=-1 means abar_prev = 1: return x0_pred.
    clip (ddim_clip): 'none' (default) is the DDIM paper's update, a first-order solver of the
    model's probability-flow ODE that meets DPM-Solver++ as steps grow; 'x0' clips x0_pred and keeps
    eps (diffusers' clip_sample: no consistent solver); 'x0+eps' also re-derives eps from the clipped
    x0 (use_clipped_model_output: consistent, but for the clipped denoiser's ODE). The measurement
    that chose 'none': docs/sampling.md, DDIM unclipped."""
    clip = ddim_clip(clip, clip_denoised)
    abar = float(sched.alphas_cumprod[step])
    alpha, sigma_t = math.sqrt(abar), math.sqrt(1 - abar)
    eps, x0 = eps_and_x0(output, xt, alpha, sigma_t, prediction)
    if clip != 'none':
        x0 = x0.clamp(-1, 1)
    if clip == 'x0+eps':
        eps = (xt - alpha * x0) / sigma_t  # eq. 4 solved for eps at the clipped x_0
    if prev_step < 0:
        return x0
    abar_prev = float(sched.alphas_cumprod[prev_step])
    sigma = eta * math.sqrt((1 - abar_prev) / (1 - abar) * (1 - abar / abar_prev))
    x_prev = math.sqrt(abar_prev) * x0 + math.sqrt(1 - abar_prev - sigma ** 2) * eps
    return x_prev + sigma * noise if sigma > 0 else x_prev


@torch.no_grad()
def ddim_sample(model, sched: Schedule, shape, steps: int = 50, eta: float = 0.0,
                generator: torch.Generator = None, device='cpu', clip_denoised: bool = None,
                progress: bool = False, dtype=torch.float32, clip: str = None, prediction: str = 'eps',
                spacing: str = None):
    """DDIM sampling over the `steps` timesteps of ddim_timesteps(`spacing`, default DEFAULT_SPACING),
    each step to the next of the grid, the last to the predicted x_0.
    eta=0 is deterministic given x_T; eta=1 has DDPM's posterior variance. clip as in ddim_step
    (default 'none': converges to the probability-flow ODE as steps grow). The noise comes from
    `generator`, on `device`. Returns images clamped to [-1, 1]."""
    clip = ddim_clip(clip, clip_denoised)
    timesteps = ddim_timesteps(sched.num_steps, steps, spacing)
    sched_cpu = sched.to('cpu')  # coefficients as python floats: no device sync per step
    x = standard_normal(shape, generator, device, dtype)
    for i in tqdm(range(len(timesteps)), disable=not progress, desc='ddim'):
        step, prev_step = timesteps[i], (timesteps[i + 1] if i + 1 < len(timesteps) else -1)
        output = model(x, torch.full((shape[0],), step, device=device, dtype=torch.long)).to(x.dtype)
        noise = standard_normal(shape, generator, device, dtype) if eta > 0 and prev_step >= 0 else None
        x = ddim_step(sched_cpu, x, output, step, prev_step, eta, noise, clip=clip, prediction=prediction)
    return x.clamp(-1, 1)


def log_snr(sched: Schedule, step: int) -> float:
    """lambda_t = log(alpha_t / sigma_t) with alpha_t = sqrt(abar_t), sigma_t = sqrt(1 - abar_t): the
    half log signal-to-noise ratio that DPM-Solver integrates over (Lu et al. 2022, section 3.1).
    step=-1 is the data itself (sigma = 0): +inf."""
    if step < 0:
        return math.inf
    abar = float(sched.alphas_cumprod[step])
    return 0.5 * (math.log(abar) - math.log1p(-abar))


def dpm_solver_timesteps(sched: Schedule, steps: int, spacing: str = None) -> list:
    """The `steps` timesteps DPM-Solver++ calls the model at, decreasing; after the last, the solver
    steps to the data (sigma = 0), so no call is spent at t = 0. As diffusers'
    DPMSolverMultistepScheduler computes them: 'linspace' the largest S of round(linspace(0, T-1,
    S + 1)); 'leading' the largest S of (T // (S + 1)) * (0, 1, ..., S); 'trailing' as DDIM's
    (_trailing, from T-1). 'logsnr' is uniform in lambda_t (Lu et al. 2022, section 3.3; diffusers'
    use_lu_lambdas: S + 1 levels from lambda_{T-1} to lambda_0, each at the timestep interpolated in
    log sigma and rounded), less the last, lambda_0, where diffusers' own grid of S levels spends its
    last call. Timesteps that round to one are moved apart, within 1..T-1 (_distinct; with steps = T,
    every timestep)."""
    num_steps = sched.num_steps
    if not 1 <= steps <= num_steps:
        raise ValueError(f'sample steps must be in [1, {num_steps}], got {steps}')
    spacing = spacing_for('dpm++', spacing, steps)
    if spacing == 'linspace':
        grid = np.linspace(0, num_steps - 1, steps + 1).round()[::-1][:-1]
    elif spacing == 'leading':
        grid = (np.arange(steps + 1) * (num_steps // (steps + 1))).round()[::-1][:-1]
    elif spacing == 'trailing':
        grid = _trailing(num_steps, steps)
    else:
        abar = sched.alphas_cumprod.double().numpy()
        log_sigmas = 0.5 * (np.log1p(-abar) - np.log(abar))  # -lambda_t, increasing in t
        levels = np.linspace(log_sigmas[-1], log_sigmas[0], steps + 1)[:-1]
        grid = np.interp(levels, log_sigmas, np.arange(num_steps)).round()
    return _distinct([int(t) for t in grid], 0 if steps == num_steps else 1)  # t = 0 only when every t is


def _distinct(timesteps: list, lowest: int) -> list:
    """Decreasing timesteps where neighbours rounded to one step are moved apart: down from the
    top (where lambda may move slowly), then, where that passed below `lowest`, up from it (where
    lambda moves fast)."""
    for i in range(1, len(timesteps)):
        timesteps[i] = min(timesteps[i], timesteps[i - 1] - 1)
    if timesteps[-1] < lowest:
        timesteps[-1] = lowest
        for i in range(len(timesteps) - 2, -1, -1):
            timesteps[i] = max(timesteps[i], timesteps[i + 1] + 1)
    return timesteps


def dpm_solver_step(sched: Schedule, xt: torch.Tensor, output: torch.Tensor, step: int, prev_step: int,
                    history: tuple = None, prediction: str = 'eps') -> tuple:
    """One DPM-Solver++ update of the probability-flow ODE for the data prediction x0 (from the
    model's eps or v, eps_and_x0; Lu et al. 2022, "DPM-Solver++", eq. 9), from timestep
    `step` to `prev_step` (-1: to sigma = 0), with h = lambda_prev - lambda_step:
    first order (DPM-Solver++(1), DDIM's update): x_prev = sigma_prev / sigma_t x_t - alpha_prev (e^-h - 1) x0;
    second order, multistep (2M, Algorithm 2), given `history` = (x0, step) of the update before:
    x0 replaced by D = x0 + (x0 - x0_before) / (2 r), r = h_before / h. Returns (x_prev, x0)."""
    abar = float(sched.alphas_cumprod[step])
    abar_prev = float(sched.alphas_cumprod[prev_step]) if prev_step >= 0 else 1.0
    _, x0 = eps_and_x0(output, xt, math.sqrt(abar), math.sqrt(1 - abar), prediction)
    h = log_snr(sched, prev_step) - log_snr(sched, step)
    data = x0
    if history is not None:
        x0_before, step_before = history
        r = (log_snr(sched, step) - log_snr(sched, step_before)) / h
        data = x0 + (x0 - x0_before) / (2 * r)
    return math.sqrt((1 - abar_prev) / (1 - abar)) * xt - math.sqrt(abar_prev) * math.expm1(-h) * data, x0


@torch.no_grad()
def dpm_solver_sample(model, sched: Schedule, shape, steps: int = 20, spacing: str = None,
                      generator: torch.Generator = None, device='cpu', progress: bool = False,
                      dtype=torch.float32, x: torch.Tensor = None, prediction: str = 'eps'):
    """DPM-Solver++(2M) (Lu et al. 2022, "DPM-Solver++", Algorithm 2): the probability-flow ODE
    from x_T ~ N(0, I) (or `x`) over dpm_solver_timesteps, one model call per step, second order
    multistep except at the first step and the last (to sigma = 0), which are first order (as
    diffusers' DPMSolverMultistepScheduler with lower_order_final and final sigma 0). The
    predicted x_0 is not clipped. Returns images clamped to [-1, 1]."""
    timesteps = dpm_solver_timesteps(sched, steps, spacing)
    sched_cpu = sched.to('cpu')  # coefficients as python floats: no device sync per step
    x = standard_normal(shape, generator, device, dtype) if x is None else x
    history = None
    for i in tqdm(range(len(timesteps)), disable=not progress, desc='dpm-solver++'):
        step, prev_step = timesteps[i], (timesteps[i + 1] if i + 1 < len(timesteps) else -1)
        output = model(x, torch.full((shape[0],), step, device=device, dtype=torch.long)).to(x.dtype)
        x, x0 = dpm_solver_step(sched_cpu, x, output, step, prev_step, history if prev_step >= 0 else None,
                                prediction)
        history = (x0, step)
    return x.clamp(-1, 1)


# The samplers of a trained model. A distilled student draws with its own ('student' in sample.py and
# drawing.draw: students.student_sample on the grid it learnt), never with these.
SAMPLERS = ('ddpm', 'ddim', 'dpm++')


def run_sampler(name: str, model, sched: Schedule, shape, steps: int = None, generator: torch.Generator = None,
                device='cpu', eta: float = 0.0, spacing: str = None, variance: str = 'fixedlarge',
                prediction: str = 'eps', dtype=torch.float32, progress: bool = False, clip: str = None):
    """Images from the sampler `name`, each taking the arguments it has and ignoring the rest:
    'ddpm' (ddpm_sample: all T steps, `variance`; clip 'none' turns off the paper's clipping of x_0,
    which is on by default), 'ddim' (ddim_sample: `steps` calls, default 50, `eta`, `clip` as in
    ddim_step, `spacing`) or 'dpm++' (dpm_solver_sample: `steps` calls, default 20, `spacing`; no
    clipping), `spacing` None for the sampler's DEFAULT_SPACING (a distilled student's sampler:
    students.student_sample). Returns images clamped to [-1, 1]."""
    common = dict(generator=generator, device=device, progress=progress, dtype=dtype, prediction=prediction)
    if name == 'ddpm':
        if clip is not None and clip not in DDIM_CLIPS:
            raise ValueError(f'clip must be one of {DDIM_CLIPS}, got {clip!r}')
        # The posterior mean (eq. 7) reads x_0 alone: 'x0' and 'x0+eps' are one sampler here.
        return ddpm_sample(model, sched, shape, variance=variance, clip_denoised=clip != 'none', **common)
    if name == 'ddim':
        return ddim_sample(model, sched, shape, 50 if steps is None else steps, eta, clip=clip, spacing=spacing,
                           **common)
    if name == 'dpm++':
        if clip not in (None, 'none'):
            raise ValueError(f"dpm++ does not clip the predicted x_0: clip must be 'none', got {clip!r}")
        return dpm_solver_sample(model, sched, shape, 20 if steps is None else steps, spacing, **common)
    raise ValueError(f'sampler must be one of {SAMPLERS}, got {name!r}')


def normal_kl(mean1, log_var1, mean2, log_var2) -> torch.Tensor:
    """KL(N(mean1, exp(log_var1)) || N(mean2, exp(log_var2))), elementwise, in nats."""
    return 0.5 * (-1.0 + log_var2 - log_var1 + (log_var1 - log_var2).exp()
                  + (mean1 - mean2).square() * (-log_var2).exp())


def discretized_gaussian_log_likelihood(x0: torch.Tensor, mean: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    """log p(x_0 | x_1) of the discretized Gaussian decoder (eq. 13), elementwise, in nats:
    the Gaussian's mass on each pixel's bin of width 2/255, with the edge bins open."""
    inv_std = (-0.5 * log_var).exp()
    upper = inv_std * (x0 - mean + 1 / 255)
    lower = inv_std * (x0 - mean - 1 / 255)
    log_cdf_upper = torch.special.log_ndtr(upper)
    log_sf_lower = torch.special.log_ndtr(-lower)
    log_bin = torch.log((torch.special.ndtr(upper) - torch.special.ndtr(lower)).clamp(min=1e-12))
    return torch.where(x0 < -0.999, log_cdf_upper, torch.where(x0 > 0.999, log_sf_lower, log_bin))


def vlb_term(model, sched: Schedule, x0: torch.Tensor, t: torch.Tensor, generator: torch.Generator = None,
             variance: str = 'fixedlarge', clip_denoised: bool = True, prediction: str = 'eps') -> torch.Tensor:
    """One term of the bound per image, in nats, at per-image timesteps t (eq. 5): the decoder's
    NLL -log p(x_0 | x_1) (eq. 13) where t = 0, KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t))
    elsewhere, with x_t drawn from q(x_t | x_0). One model call. Returns (B,)."""
    xt = q_sample(sched, x0, t, standard_normal(x0.shape, generator, x0.device, x0.dtype))
    mean, log_var, _ = p_mean_variance(model, sched, xt, t, variance, clip_denoised, prediction)
    true_mean, _, true_log_var = q_posterior(sched, x0, xt, t)
    decoder = -discretized_gaussian_log_likelihood(x0, mean, log_var)
    kl = normal_kl(true_mean, true_log_var, mean, log_var)
    at_zero = (t == 0).view(-1, *([1] * (x0.dim() - 1)))
    return torch.where(at_zero, decoder, kl).flatten(1).sum(1)


def prior_bits(sched: Schedule, x0: torch.Tensor) -> torch.Tensor:
    """L_T = KL(q(x_T | x_0) || N(0, I)) per image, in bits per dimension (no model call)."""
    t_last = torch.full((x0.shape[0],), sched.num_steps - 1, device=x0.device, dtype=torch.long)
    mean = gather(sched.sqrt_alphas_cumprod, t_last, x0) * x0
    log_var = torch.log(gather(1.0 - sched.alphas_cumprod, t_last, x0)).expand_as(x0)
    return normal_kl(mean, log_var, torch.zeros_like(x0), torch.zeros_like(x0)).flatten(1).sum(1) / _dims_ln2(x0)


def _dims_ln2(x0: torch.Tensor) -> float:
    return math.log(2.0) * x0[0].numel()  # nats per image -> bits per dimension


@torch.no_grad()
def vlb_bits_per_dim(model, sched: Schedule, x0: torch.Tensor, generator: torch.Generator = None,
                     variance: str = 'fixedlarge', clip_denoised: bool = True, progress: bool = False,
                     prediction: str = 'eps') -> dict:
    """The variational bound L = L_T + sum_{t>1} L_{t-1} + L_0 (eq. 5) in bits per dimension,
    per image: the prior term, one KL per t and the decoder's NLL at t=0 (vlb_term). One model
    call per timestep. x0 must be data in [-1, 1] on 256 levels.
    Returns {'total', 'prior', 'decoder', 'terms'}: (B,), (B,), (B,), (B, T)."""
    B, T = x0.shape[0], sched.num_steps
    terms = torch.zeros(B, T, device=x0.device, dtype=x0.dtype)
    for step in tqdm(range(T - 1, -1, -1), disable=not progress, desc='bits/dim'):
        t = torch.full((B,), step, device=x0.device, dtype=torch.long)
        terms[:, step] = vlb_term(model, sched, x0, t, generator, variance, clip_denoised, prediction) / _dims_ln2(x0)
    prior = prior_bits(sched, x0)
    return {'total': prior + terms.sum(1), 'prior': prior, 'decoder': terms[:, 0], 'terms': terms}


@torch.no_grad()
def vlb_bits_per_dim_mc(model, sched: Schedule, x0: torch.Tensor, num_timesteps: int,
                        generator: torch.Generator = None, variance: str = 'fixedlarge',
                        clip_denoised: bool = True, prediction: str = 'eps') -> dict:
    """An unbiased Monte Carlo estimate of vlb_bits_per_dim at 1 + num_timesteps model calls
    instead of T: the prior and the decoder term exactly, the sum of the T-1 KL terms from
    stratified timesteps (t = 1..T-1 cut into num_timesteps strata of sizes n_j, one t_j drawn
    uniformly in each, per image: sum_j n_j KL(t_j), whose expectation is the full sum).
    Returns {'total', 'prior', 'decoder', 'kl'} per image, in bits per dimension."""
    B, T = x0.shape[0], sched.num_steps
    if not 1 <= num_timesteps <= T - 1:
        raise ValueError(f'num_timesteps must be in [1, {T - 1}], got {num_timesteps}')
    zero = torch.zeros(B, device=x0.device, dtype=torch.long)
    decoder = vlb_term(model, sched, x0, zero, generator, variance, clip_denoised, prediction) / _dims_ln2(x0)
    bounds = [1 + j * (T - 1) // num_timesteps for j in range(num_timesteps + 1)]
    kl = torch.zeros(B, device=x0.device, dtype=x0.dtype)
    for low, high in zip(bounds, bounds[1:]):
        u = torch.rand(B, generator=generator, device=x0.device, dtype=torch.float64)
        t = low + (u * (high - low)).long().clamp(max=high - low - 1)  # uniform on [low, high)
        kl += (high - low) * vlb_term(model, sched, x0, t, generator, variance, clip_denoised,
                                      prediction) / _dims_ln2(x0)
    prior = prior_bits(sched, x0)
    return {'total': prior + decoder + kl, 'prior': prior, 'decoder': decoder, 'kl': kl}

import math

import numpy as np
import pytest
import torch

from diffusion import (ddim_sample, ddim_step, ddim_timesteps, ddpm_sample, discretized_gaussian_log_likelihood,
                       make_schedule, p_mean_variance, q_posterior, q_sample, training_loss, vlb_bits_per_dim)
from model import UNet, get_config


def test_linear_schedule_matches_paper_closed_forms():
    sched = make_schedule(1000, 'linear')
    T = 1000
    betas = [1e-4 + (0.02 - 1e-4) * i / (T - 1) for i in range(T)]  # section 4
    abar, prod = [], 1.0
    for b in betas:
        prod *= 1 - b
        abar.append(prod)
    abar_prev = [1.0] + abar[:-1]
    post_var = [betas[i] * (1 - abar_prev[i]) / (1 - abar[i]) for i in range(T)]  # eq. 7
    coef1 = [betas[i] * math.sqrt(abar_prev[i]) / (1 - abar[i]) for i in range(T)]
    coef2 = [(1 - abar_prev[i]) * math.sqrt(1 - betas[i]) / (1 - abar[i]) for i in range(T)]
    for table, expected in [(sched.betas, betas), (sched.alphas_cumprod, abar),
                            (sched.alphas_cumprod_prev, abar_prev), (sched.posterior_variance, post_var),
                            (sched.posterior_mean_coef1, coef1), (sched.posterior_mean_coef2, coef2)]:
        assert table.dtype == torch.float64
        assert np.allclose(table.numpy(), expected, rtol=0, atol=1e-6)
    assert math.isclose(sched.posterior_log_variance_clipped[0].item(), math.log(post_var[1]), rel_tol=1e-9)
    assert sched.alphas_cumprod[-1] < 5e-5  # x_T is nearly pure noise (paper: L_T ~ 1e-5 bits/dim)


def test_cosine_schedule():
    sched = make_schedule(1000, 'cosine')
    abar = sched.alphas_cumprod.numpy()
    s = 0.008
    f = lambda t: math.cos((t / 1000 + s) / (1 + s) * math.pi / 2) ** 2  # Nichol & Dhariwal eq. 17
    for t in [0, 100, 500, 900]:
        assert math.isclose(abar[t], f(t + 1) / f(0), rel_tol=1e-6)
    assert (sched.betas <= 0.999).all()
    with pytest.raises(ValueError):
        make_schedule(10, 'quadratic')


def test_q_sample_mean_and_variance():
    sched = make_schedule()
    g = torch.Generator().manual_seed(0)
    x0 = torch.tensor([0.5, -0.3]).repeat(200_000, 1)
    t = torch.full((x0.shape[0],), 300, dtype=torch.long)
    xt = q_sample(sched, x0, t, torch.randn(x0.shape, generator=g))
    abar = sched.alphas_cumprod[300].item()
    assert torch.allclose(xt.mean(0), math.sqrt(abar) * x0[0], atol=0.01)
    assert torch.allclose(xt.var(0), torch.full((2,), 1 - abar), atol=0.01)


def test_posterior_matches_bayes_rule():
    # q(x_{t-1} | x_t, x_0) is proportional to q(x_t | x_{t-1}) q(x_{t-1} | x_0): multiply the two
    # Gaussians in x_{t-1} and compare with eqs. 6-7.
    sched = make_schedule()
    x0, xt = torch.tensor([[0.7, -0.2]], dtype=torch.float64), torch.tensor([[0.1, 1.3]], dtype=torch.float64)
    for step in [1, 10, 500, 999]:
        beta, abar_prev = sched.betas[step].item(), sched.alphas_cumprod_prev[step].item()
        precision = (1 - beta) / beta + 1 / (1 - abar_prev)
        mean = (math.sqrt(1 - beta) * xt / beta + math.sqrt(abar_prev) * x0 / (1 - abar_prev)) / precision
        got_mean, got_var, got_log_var = q_posterior(sched, x0, xt, torch.tensor([step]))
        assert torch.allclose(got_mean, mean, atol=1e-10)
        assert math.isclose(got_var.item(), 1 / precision, rel_tol=1e-9)
        assert math.isclose(got_log_var.item(), math.log(1 / precision), rel_tol=1e-9)


class FixedEps(torch.nn.Module):
    """A stand-in model that returns a given noise prediction."""
    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def forward(self, x, t):
        return self.eps


def _float64_tables(ref):
    # diffusers builds its tables in float32, which costs it ~1e-4 relative precision in
    # beta_t = 1 - abar_t / abar_{t-1} at small t; rebuild them the way its __init__ does,
    # in float64, so that the comparison checks the formulas rather than rounding.
    ref.betas = ref.betas.double()
    ref.alphas = 1.0 - ref.betas
    ref.alphas_cumprod = torch.cumprod(ref.alphas, dim=0)
    ref.final_alpha_cumprod = torch.tensor(1.0, dtype=torch.float64)
    return ref


def test_schedule_matches_diffusers():
    diffusers = pytest.importorskip('diffusers')
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4, beta_end=0.02)
    assert np.allclose(ref.alphas_cumprod.numpy(), make_schedule().alphas_cumprod.numpy(), rtol=0, atol=1e-6)


def test_ddpm_step_matches_diffusers():
    diffusers = pytest.importorskip('diffusers')
    ref = _float64_tables(diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4,
                                                  beta_end=0.02, variance_type='fixed_large', clip_sample=True))
    sched = make_schedule()
    g = torch.Generator().manual_seed(0)
    x, eps = (torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    z = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for step in [999, 500, 10, 1]:
        mean, log_var, _ = p_mean_variance(FixedEps(eps), sched, x, torch.full((2,), step), 'fixedlarge')
        ours = mean + (0.5 * log_var).exp() * z
        # diffusers draws its noise from the generator it is given: the same draw as z.
        theirs = ref.step(eps, step, x, generator=torch.Generator().manual_seed(7)).prev_sample
        assert (ours - theirs).abs().max() < 1e-6


def test_ddim_step_matches_diffusers():
    diffusers = pytest.importorskip('diffusers')
    ref = _float64_tables(diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4,
                                                  beta_end=0.02, clip_sample=True, set_alpha_to_one=True))
    ref.set_timesteps(50)  # 'leading' spacing: 980, 960, ..., 0, stride 20
    sched = make_schedule()
    g = torch.Generator().manual_seed(1)
    x, eps, z = (torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for step, eta in [(980, 0.0), (500, 0.0), (20, 0.0), (500, 1.0), (0, 0.0)]:
        ours = ddim_step(sched, x, eps, step, step - 20, eta=eta, noise=z)
        theirs = ref.step(eps, step, x, eta=eta, variance_noise=z).prev_sample
        assert (ours - theirs).abs().max() < 1e-6


def test_ddim_timesteps():
    assert ddim_timesteps(1000, 1000) == list(range(1000))
    steps = ddim_timesteps(1000, 50)
    assert len(steps) == 50 and steps[0] == 0 and steps[-1] == 999
    with pytest.raises(ValueError):
        ddim_timesteps(1000, 0)


def _trained_like_model(seed=0):
    torch.manual_seed(seed)
    model = UNet(get_config('tiny', image_size=16)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def test_ddim_eta0_deterministic_and_samplers_reproducible():
    model, sched = _trained_like_model(), make_schedule(1000)
    shape = (2, 3, 16, 16)
    run = lambda seed, **kw: ddim_sample(model, sched, shape, steps=5, generator=torch.Generator().manual_seed(seed), **kw)
    a, b = run(0), run(0)
    assert torch.equal(a, b)
    assert not torch.equal(a, run(1))  # the seed matters
    # eta=0: the output is a function of x_T alone; eta=1 draws fresh noise at each step.
    assert not torch.equal(run(0, eta=1.0), a)
    assert torch.equal(run(0, eta=1.0), run(0, eta=1.0))
    sched20 = make_schedule(20)
    d1 = ddpm_sample(model, sched20, shape, generator=torch.Generator().manual_seed(3))
    d2 = ddpm_sample(model, sched20, shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(d1, d2) and d1.shape == shape
    assert d1.min() >= -1 and d1.max() <= 1


def test_sampling_under_bf16_autocast():
    model, sched = _trained_like_model(), make_schedule(20)
    g = torch.Generator().manual_seed(0)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        ddim = ddim_sample(model, sched, (2, 3, 16, 16), steps=4, generator=g)
        ddpm = ddpm_sample(model, sched, (2, 3, 16, 16), generator=g, variance='fixedsmall')
    for x in (ddim, ddpm):
        assert x.dtype == torch.float32 and torch.isfinite(x).all()
    ref = ddim_sample(model, sched, (2, 3, 16, 16), steps=4, generator=torch.Generator().manual_seed(0))
    assert (ddim - ref).abs().max() < 0.1  # bf16 keeps about 3 significant digits


def test_training_loss_is_the_noise_mse():
    sched = make_schedule()
    x0 = torch.rand(4, 3, 8, 8) * 2 - 1
    noise, t = torch.randn_like(x0), torch.tensor([0, 10, 500, 999])
    assert training_loss(FixedEps(noise), sched, x0, t, noise) == 0
    zero = training_loss(FixedEps(torch.zeros_like(x0)), sched, x0, t, noise)
    assert torch.isclose(zero, noise.square().mean())
    torch.manual_seed(0)
    assert training_loss(FixedEps(torch.zeros_like(x0)), sched, x0).item() > 0.5  # draws t and noise


def test_discretized_decoder_sums_to_one():
    # The bins partition the real line: the probabilities of all 256 levels sum to 1.
    levels = torch.arange(256, dtype=torch.float64) / 127.5 - 1
    for mean, log_var in [(0.3, -6.0), (-0.95, -4.0), (0.0, 0.0)]:
        log_p = discretized_gaussian_log_likelihood(levels, torch.full_like(levels, mean), torch.full_like(levels, log_var))
        assert math.isclose(log_p.exp().sum().item(), 1.0, rel_tol=1e-6)


class TrueNoise(torch.nn.Module):
    """An oracle that knows x_0 and returns the exact noise of x_t."""
    def __init__(self, sched, x0):
        super().__init__()
        self.sched, self.x0 = sched, x0

    def forward(self, xt, t):
        a = self.sched.sqrt_alphas_cumprod[t].float().view(-1, 1, 1, 1)
        s = self.sched.sqrt_one_minus_alphas_cumprod[t].float().view(-1, 1, 1, 1)
        return (xt - a * self.x0) / s


def test_vlb_bits_per_dim():
    sched = make_schedule(50)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, 256, (2, 3, 8, 8), generator=g).float() / 127.5 - 1
    oracle = vlb_bits_per_dim(TrueNoise(sched, x0), sched, x0, generator=torch.Generator().manual_seed(0))
    zeros = vlb_bits_per_dim(FixedEps(torch.zeros_like(x0)), sched, x0, generator=torch.Generator().manual_seed(0))
    for result in (oracle, zeros):
        assert torch.isfinite(result['total']).all() and (result['total'] > 0).all()
        assert result['terms'].shape == (2, 50)
        total = result['prior'] + result['terms'].sum(1)
        assert torch.allclose(result['total'], total)
    assert (oracle['total'] < zeros['total']).all()
    assert (oracle['total'] < 8).all()  # better than a uniform model over 256 levels


def test_vlb_runs_on_unet():
    sched = make_schedule(10)
    x0 = torch.rand(1, 3, 16, 16) * 2 - 1
    result = vlb_bits_per_dim(_trained_like_model(), sched, x0, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(result['total']).all()

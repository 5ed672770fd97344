import math

import numpy as np
import pytest
import torch
from helpers import NO_DIFFUSERS, Fixed

from diffusion import (ddim_sample, ddim_step, ddim_timesteps, ddpm_sample, discretized_gaussian_log_likelihood,
                       dpm_solver_sample, dpm_solver_timesteps, log_snr, make_betas, make_schedule, p_mean_variance,
                       q_posterior, q_sample, run_sampler, training_loss, vlb_bits_per_dim, vlb_bits_per_dim_mc)
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
    assert (sched.betas <= 0.999).all() and sched.betas[-1] == 0.999  # the last steps are clipped
    with pytest.raises(ValueError):
        make_schedule(10, 'quadratic')


def test_cosine_schedule_matches_diffusers():
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule='squaredcos_cap_v2')
    assert np.allclose(ref.betas.numpy(), make_schedule(1000, 'cosine').betas.numpy(), rtol=1e-5, atol=1e-7)


def test_q_sample_mean_and_variance():
    sched = make_schedule()
    g = torch.Generator().manual_seed(0)
    x0 = torch.tensor([0.5, -0.3]).repeat(200_000, 1)
    t = torch.full((x0.shape[0],), 300, dtype=torch.long)
    xt = q_sample(sched, x0, t, torch.randn(x0.shape, generator=g))
    abar = sched.alphas_cumprod[300].item()
    assert torch.allclose(xt.mean(0), math.sqrt(abar) * x0[0], atol=0.01)
    assert torch.allclose(xt.var(0), torch.full((2,), 1 - abar), atol=0.01)


def test_each_image_gets_its_own_timestep():
    sched = make_schedule()
    x0, noise = torch.ones(3, 1, 2, 2, dtype=torch.float64), torch.zeros(3, 1, 2, 2, dtype=torch.float64)
    t = torch.tensor([0, 500, 999])
    abar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000))
    xt = q_sample(sched, x0, t, noise)
    assert torch.allclose(xt[:, 0, 0, 0], torch.from_numpy(np.sqrt(abar[[0, 500, 999]])))


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


def _float64_tables(ref):
    # diffusers builds its tables in float32, which costs it ~1e-4 relative precision in
    # beta_t = 1 - abar_t / abar_{t-1} at small t; rebuild them the way its __init__ does,
    # from the same betas in float64 (their float32 betas are checked against ours above), so
    # that the comparison checks the formulas rather than rounding.
    ref.betas = torch.from_numpy(make_betas(len(ref.betas), 'linear'))
    ref.alphas = 1.0 - ref.betas
    ref.alphas_cumprod = torch.cumprod(ref.alphas, dim=0)
    ref.final_alpha_cumprod = torch.tensor(1.0, dtype=torch.float64)
    return ref


def test_schedule_matches_diffusers():
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4, beta_end=0.02)
    assert np.allclose(ref.alphas_cumprod.numpy(), make_schedule().alphas_cumprod.numpy(), rtol=0, atol=1e-6)


def test_ddpm_step_matches_diffusers():
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    ref = _float64_tables(diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4,
                                                  beta_end=0.02, variance_type='fixed_large', clip_sample=True))
    sched = make_schedule()
    g = torch.Generator().manual_seed(0)
    x, eps = (torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    z = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for step in [999, 500, 10, 1]:
        mean, log_var, _ = p_mean_variance(Fixed(eps), sched, x, torch.full((2,), step), 'fixedlarge')
        ours = mean + (0.5 * log_var).exp() * z
        # diffusers draws its noise from the generator it is given: the same draw as z.
        theirs = ref.step(eps, step, x, generator=torch.Generator().manual_seed(7)).prev_sample
        assert (ours - theirs).abs().max() < 1e-6


# Our DDIM clip modes as diffusers' DDIMScheduler configurations: (clip_sample, use_clipped_model_output).
DDIM_CLIP_IN_DIFFUSERS = {'none': (False, False), 'x0': (True, False), 'x0+eps': (True, True)}
PREDICTION_IN_DIFFUSERS = {'eps': 'epsilon', 'v': 'v_prediction'}


@pytest.mark.parametrize('prediction', ['eps', 'v'])
@pytest.mark.parametrize('clip', ['none', 'x0', 'x0+eps'])
def test_ddim_step_matches_diffusers(clip, prediction):
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    clip_sample, use_clipped = DDIM_CLIP_IN_DIFFUSERS[clip]
    ref = _float64_tables(diffusers.DDIMScheduler(
        num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4, beta_end=0.02, clip_sample=clip_sample,
        set_alpha_to_one=True, prediction_type=PREDICTION_IN_DIFFUSERS[prediction]))
    ref.set_timesteps(50)  # 'leading' spacing: 980, 960, ..., 0, stride 20
    sched = make_schedule()
    g = torch.Generator().manual_seed(1)
    x, output, z = (torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for step, eta in [(980, 0.0), (500, 0.0), (20, 0.0), (500, 1.0), (0, 0.0)]:
        ours = ddim_step(sched, x, output, step, step - 20, eta=eta, noise=z, clip=clip, prediction=prediction)
        theirs = ref.step(output, step, x, eta=eta, variance_noise=z, use_clipped_model_output=use_clipped).prev_sample
        assert (ours - theirs).abs().max() < 1e-12


def test_timesteps_refuse_counts_outside_the_schedule():
    for bad in (0, 1001):
        with pytest.raises(ValueError):
            ddim_timesteps(1000, bad)
        with pytest.raises(ValueError):
            dpm_solver_timesteps(make_schedule(1000), bad)


class SmoothEps(torch.nn.Module):
    """A deterministic stand-in for a trained network: the exact noise prediction for data
    ~ N(0.3, 0.5^2) per pixel under the linear schedule (written out here), plus a nonlinear
    term, so that samples keep their spread instead of collapsing to one point."""

    abar = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000))

    def forward(self, x, t):
        a = torch.from_numpy(self.abar)[t].to(x.dtype).view(-1, 1, 1, 1)
        return (1 - a).sqrt() * (x - a.sqrt() * 0.3) / (a * 0.25 + 1 - a) + 0.05 * torch.sin(3 * x)


def diffusers_scheduler(kind, prediction='eps', clip_sample=True, **kwargs):
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    cls = {'ddpm': diffusers.DDPMScheduler, 'ddim': diffusers.DDIMScheduler}[kind]
    return _float64_tables(cls(num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4, beta_end=0.02,
                               clip_sample=clip_sample, prediction_type=PREDICTION_IN_DIFFUSERS[prediction], **kwargs))


def diffusers_loop(scheduler, shape, seed, steps, **step_kwargs):
    """diffusers' own sampling loop (as in its pipelines), in float64, from a CPU generator. The
    model is SmoothEps, its output read as eps or v as the scheduler is configured: any smooth
    function serves to compare two implementations of one sampler."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    scheduler.set_timesteps(steps)
    model = SmoothEps()
    for t in scheduler.timesteps:
        output = model(x, torch.full((shape[0],), int(t)))
        x = scheduler.step(output, t, x, generator=generator, **step_kwargs).prev_sample
    return x.clamp(-1, 1)


@pytest.mark.parametrize('prediction', ['eps', 'v'])
@pytest.mark.parametrize('variance', ['fixedlarge', 'fixedsmall'])
def test_whole_ddpm_sampler_matches_diffusers(variance, prediction):
    # All 1000 ancestral steps, the same noise in the same order: the timestep sequence, the
    # variance, the clipping, the reading of the model's output and the noise-free last step are
    # all checked at once.
    scheduler = diffusers_scheduler('ddpm', prediction, variance_type={'fixedlarge': 'fixed_large',
                                                                       'fixedsmall': 'fixed_small'}[variance])
    shape = (2, 3, 4, 4)
    theirs = diffusers_loop(scheduler, shape, seed=11, steps=1000)
    ours = ddpm_sample(SmoothEps(), make_schedule(1000), shape, torch.Generator().manual_seed(11),
                       variance=variance, dtype=torch.float64, prediction=prediction)
    assert ours.dtype == torch.float64
    assert (ours - theirs).abs().max() < 1e-10
    assert theirs.std() > 0.1  # not a trivial output


@pytest.mark.parametrize('prediction', ['eps', 'v'])
@pytest.mark.parametrize('clip', ['none', 'x0', 'x0+eps'])
@pytest.mark.parametrize('steps, eta', [(50, 0.0), (50, 1.0), (7, 0.5)])
def test_whole_ddim_sampler_matches_diffusers(steps, eta, clip, prediction):
    clip_sample, use_clipped = DDIM_CLIP_IN_DIFFUSERS[clip]
    scheduler = diffusers_scheduler('ddim', prediction, clip_sample, set_alpha_to_one=True)
    shape = (2, 3, 4, 4)
    theirs = diffusers_loop(scheduler, shape, seed=5, steps=steps, eta=eta, use_clipped_model_output=use_clipped)
    ours = ddim_sample(SmoothEps(), make_schedule(1000), shape, steps, eta, torch.Generator().manual_seed(5),
                       dtype=torch.float64, clip=clip, prediction=prediction, spacing='leading')  # their default
    assert (ours - theirs).abs().max() < 1e-10
    assert theirs.std() > 0.1


def test_training_timesteps_cover_every_step_uniformly():
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, x, t):
            seen.append(t)
            return torch.zeros_like(x)
    torch.manual_seed(0)
    sched = make_schedule(1000)
    x0 = torch.zeros(50_000, 1, 1, 1)
    loss = training_loss(Recorder(), sched, x0)
    t = torch.cat(seen)
    assert t.min() == 0 and t.max() == 999
    counts = torch.bincount(t // 100, minlength=10).float()  # 10 bins of 100 steps, 5000 expected in each
    assert (counts - 5000).abs().max() < 350  # ~5 standard deviations
    # The default noise is standard normal: with x_0 = 0 and a zero prediction the loss is E[eps^2] = 1.
    assert abs(loss.item() - 1) < 0.03


def test_bits_per_dim_of_the_oracle_by_hand():
    """A model that knows x_0 predicts the posterior mean exactly, so every KL term is the KL
    between N(m, beta-tilde_t) and N(m, sigma_t^2), whatever x_t is; the decoder's mean is x_0.
    All terms are computed here from the paper's formulas with the math module."""
    T = 6
    betas = [1e-4 + (0.02 - 1e-4) * i / (T - 1) for i in range(T)]
    abar = [math.prod(1 - b for b in betas[:i + 1]) for i in range(T)]
    tilde = [betas[i] * (1 - (abar[i - 1] if i else 1.0)) / (1 - abar[i]) for i in range(T)]  # eq. 7
    levels = torch.tensor([0, 1, 77, 128, 254, 255], dtype=torch.float64)
    x0 = (levels / 127.5 - 1).view(1, 1, 2, 3).repeat(2, 1, 1, 1)
    x0[1] = x0[1].flip(-1)  # a second image with the same levels elsewhere

    class Oracle(torch.nn.Module):
        def forward(self, xt, t):
            a = torch.tensor([abar[s] for s in t.tolist()], dtype=xt.dtype).view(-1, 1, 1, 1)
            return (xt - a.sqrt() * x0) / (1 - a).sqrt()
    sched = make_schedule(T)
    D = x0[0].numel()
    bits = 1 / (D * math.log(2))
    prior = sum(0.5 * (-1 - math.log(1 - abar[-1]) + (1 - abar[-1]) + abar[-1] * v ** 2)
                for v in (levels / 127.5 - 1).tolist()) * bits  # KL(N(sqrt(abar_T) x0, 1 - abar_T) || N(0, 1))
    for variance, sigma2 in [('fixedlarge', [tilde[1]] + betas[1:]), ('fixedsmall', [tilde[1]] + tilde[1:])]:
        kl = [0.5 * (math.log(sigma2[t] / tilde[t]) + tilde[t] / sigma2[t] - 1) * D * bits for t in range(1, T)]
        half_bin = (1 / 255) / math.sqrt(sigma2[0])
        phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
        per_level = {0: -math.log(phi(half_bin)), 255: -math.log(phi(half_bin))}  # open edge bins
        decoder = sum(per_level.get(int(v), -math.log(phi(half_bin) - phi(-half_bin))) for v in levels.tolist()) * bits
        result = vlb_bits_per_dim(Oracle(), sched, x0, generator=torch.Generator().manual_seed(0), variance=variance)
        for image in range(2):
            assert result['prior'][image].item() == pytest.approx(prior, rel=1e-9)
            assert result['decoder'][image].item() == pytest.approx(decoder, rel=1e-9)
            assert result['terms'][image, 1:].tolist() == pytest.approx(kl, rel=1e-6, abs=1e-12)
            assert result['total'][image].item() == pytest.approx(prior + decoder + sum(kl), rel=1e-9)
    assert kl == [0.0] * (T - 1)  # fixedsmall: the oracle's p equals the posterior


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
    def run(seed, **kw):
        return ddim_sample(model, sched, shape, steps=5, generator=torch.Generator().manual_seed(seed), **kw)
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
    assert training_loss(Fixed(noise), sched, x0, t, noise) == 0
    zero = training_loss(Fixed(torch.zeros_like(x0)), sched, x0, t, noise)
    assert torch.isclose(zero, noise.square().mean())
    per_image = training_loss(Fixed(torch.zeros_like(x0)), sched, x0, t, noise, per_example=True)
    assert torch.allclose(per_image, torch.stack([n.square().mean() for n in noise]))


def test_discretized_decoder_sums_to_one():
    # The bins partition the real line: the probabilities of all 256 levels sum to 1.
    levels = torch.arange(256, dtype=torch.float64) / 127.5 - 1
    for mean, log_var in [(0.3, -6.0), (-0.95, -4.0), (0.0, 0.0)]:
        log_p = discretized_gaussian_log_likelihood(levels, torch.full_like(levels, mean),
                                                    torch.full_like(levels, log_var))
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
    zeros = vlb_bits_per_dim(Fixed(torch.zeros_like(x0)), sched, x0, generator=torch.Generator().manual_seed(0))
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


def test_monte_carlo_bound_with_every_timestep_is_the_full_bound():
    # With T-1 strata every stratum is one timestep, so for a model whose KL terms do not depend
    # on x_t (the oracle above) the estimate is the full bound exactly.
    T = 12
    x0 = torch.randint(0, 256, (3, 3, 4, 4), generator=torch.Generator().manual_seed(1)).double() / 127.5 - 1
    sched = make_schedule(T)
    full = vlb_bits_per_dim(TrueNoise(sched, x0), sched, x0, generator=torch.Generator().manual_seed(0))
    mc = vlb_bits_per_dim_mc(TrueNoise(sched, x0), sched, x0, T - 1, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(mc['total'], full['total'], rtol=1e-9)
    assert torch.allclose(mc['kl'], full['terms'][:, 1:].sum(1), rtol=1e-9)
    with pytest.raises(ValueError):
        vlb_bits_per_dim_mc(TrueNoise(sched, x0), sched, x0, T)


def test_monte_carlo_bound_is_unbiased():
    # An imperfect model (the oracle blended with a function of x_t, so every KL term depends on
    # the x_t drawn), T=40: the estimate from 4 of the 39 KL terms, over 400 independent draws
    # (copies of the 4 images in one batch), agrees with the full bound (over 20 draws) within
    # the standard error.
    sched = make_schedule(40)
    images = torch.randint(0, 256, (4, 3, 8, 8), generator=torch.Generator().manual_seed(2)).double() / 127.5 - 1

    def estimates(copies, bound, *args):
        x0 = images.repeat(copies, 1, 1, 1)
        oracle = TrueNoise(sched, x0)
        model = lambda xt, t: 0.8 * oracle(xt, t) + 0.3 * torch.tanh(2 * xt)
        return bound(model, sched, x0, *args)['total'].view(copies, 4)
    g = torch.Generator().manual_seed(3)
    full, mc = estimates(20, vlb_bits_per_dim, g), estimates(400, vlb_bits_per_dim_mc, 4, g)
    stderr = (mc.var(0) / 400 + full.var(0) / 20).sqrt()
    z = (mc.mean(0) - full.mean(0)) / stderr
    assert z.abs().max() < 4, z
    assert mc.std(0).min() > 10 * full.std(0).max()  # the timestep draws are what varies


def test_monte_carlo_strata_by_hand_and_every_timestep_reachable(monkeypatch):
    # The oracle's KL terms depend on t alone, so the estimate must be the prior, the decoder and
    # sum_j n_j KL(t_j) over the timesteps t_j it drew, n_j its stratum's size: T=12 and 3 strata,
    # [1, 4), [4, 8), [8, 12). Over 600 images every t in 1..11 is drawn, each about equally often
    # within its stratum.
    import diffusion
    T, K, copies = 12, 3, 600
    sched = make_schedule(T)
    x0 = (torch.randint(0, 256, (copies, 3, 2, 2), generator=torch.Generator().manual_seed(4)).double() / 127.5 - 1)
    oracle = TrueNoise(sched, x0)
    full = vlb_bits_per_dim(oracle, sched, x0, generator=torch.Generator().manual_seed(0))
    drawn, term = [], diffusion.vlb_term
    monkeypatch.setattr(diffusion, 'vlb_term',
                        lambda model, sched, x0, t, *a: drawn.append(t) or term(model, sched, x0, t, *a))
    mc = vlb_bits_per_dim_mc(oracle, sched, x0, K, generator=torch.Generator().manual_seed(1))
    decoder_t, *strata = drawn
    assert (decoder_t == 0).all() and len(strata) == K
    sizes, lows = [3, 4, 4], [1, 4, 8]
    by_hand = sum(n * full['terms'][torch.arange(copies), t] for n, t in zip(sizes, strata))
    assert torch.allclose(mc['kl'], by_hand, rtol=1e-9)
    assert torch.allclose(mc['total'], full['prior'] + full['decoder'] + by_hand, rtol=1e-9)
    for t, low, n in zip(strata, lows, sizes):
        counts = torch.bincount(t - low, minlength=n)
        assert len(counts) == n and counts.min() > copies / n - 5 * (copies / n) ** 0.5  # all reached, uniformly


class SmoothModel(torch.nn.Module):
    """A closed-form epsilon model that depends on x_t and t nonlinearly (any such model will do
    to compare two implementations of one solver)."""
    def forward(self, xt, t):
        scale = (t.to(xt.dtype) / 1000 + 0.1).view(-1, 1, 1, 1)
        return torch.tanh(1.5 * xt * scale) + 0.3 * torch.sin(2 * xt + scale)


@pytest.mark.parametrize('prediction', ['eps', 'v'])
@pytest.mark.parametrize('kind', ['linear', 'cosine'])
@pytest.mark.parametrize('spacing', ['linspace', 'logsnr'])
@pytest.mark.parametrize('steps', [7, 20])
def test_whole_dpm_solver_matches_diffusers(monkeypatch, kind, spacing, steps, prediction):
    # Our DPM-Solver++(2M) loop against diffusers' DPMSolverMultistepScheduler driven by its own
    # step(), same timesteps and initial noise, in float64. Two precision fixes on their side: their
    # sigmas are float32 (given ours in float64 instead) and step() casts the sample to float32
    # (an upcast for fp16 models, a downcast here: mapped to float64 while it runs).
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    sched, model, shape = make_schedule(1000, kind), SmoothModel(), (2, 3, 4, 4)
    ours = dpm_solver_sample(model, sched, shape, steps, spacing, generator=torch.Generator().manual_seed(0),
                             dtype=torch.float64, prediction=prediction)
    theirs = diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=1000, beta_schedule={'linear': 'linear', 'cosine': 'squaredcos_cap_v2'}[kind],
        algorithm_type='dpmsolver++', solver_order=2, solver_type='midpoint', lower_order_final=True,
        final_sigmas_type='zero', prediction_type=PREDICTION_IN_DIFFUSERS[prediction], thresholding=False)
    timesteps = dpm_solver_timesteps(sched, steps, spacing)
    if spacing == 'linspace':
        theirs.set_timesteps(steps)
        assert theirs.timesteps.tolist() == timesteps  # their own 'linspace' spacing is ours (tests/test_grids.py)
    else:
        theirs.set_timesteps(timesteps=timesteps)
    abar = sched.alphas_cumprod[timesteps]
    theirs.sigmas = torch.cat([((1 - abar) / abar).sqrt(), torch.zeros(1, dtype=torch.float64)])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with monkeypatch.context() as patch:
        patch.setattr(torch, 'float32', torch.float64)
        for t in theirs.timesteps:
            x = theirs.step(model(x, t.repeat(shape[0])), t, x).prev_sample
    assert x.dtype == torch.float64
    assert (ours - x.clamp(-1, 1)).abs().max() < 1e-10
    assert (ours - x.clamp(-1, 1)).abs().max() < 1e-10 < (ours - ddim_sample(
        model, sched, shape, steps, generator=torch.Generator().manual_seed(0), dtype=torch.float64,
        prediction=prediction, spacing='leading')).abs().max()  # DDIM at as many steps is another path


def test_dpm_solver_logsnr_timesteps():
    sched = make_schedule(1000)
    steps = dpm_solver_timesteps(sched, 10, 'logsnr')
    assert steps[0] == 999 and steps[-1] > 0 and steps == sorted(steps, reverse=True)
    lambdas = [log_snr(sched, t) for t in steps]
    gaps = np.diff(lambdas)
    assert np.allclose(gaps, (log_snr(sched, 0) - log_snr(sched, 999)) / 10, rtol=0.2)  # 11 even levels, less the last
    assert log_snr(sched, -1) == math.inf
    assert log_snr(sched, 3) == pytest.approx(0.5 * math.log(sched.alphas_cumprod[3].item()
                                                             / (1 - sched.alphas_cumprod[3].item())), rel=1e-12)


class GaussianDenoiser(torch.nn.Module):
    """The exact epsilon model of data N(mu, s^2 I): x_t ~ N(alpha mu, (alpha^2 s^2 + sigma^2) I), so
    E[x_0 | x_t] = mu + alpha s^2 / (alpha^2 s^2 + sigma^2) (x_t - alpha mu), and
    eps = (x_t - alpha E[x_0 | x_t]) / sigma."""
    def __init__(self, sched, mu, s):
        super().__init__()
        self.abar, self.mu, self.s = sched.alphas_cumprod, mu.view(1, -1, 1, 1), s

    def forward(self, xt, t):
        abar = self.abar[t].view(-1, 1, 1, 1)
        alpha, sigma2 = abar.sqrt(), 1 - abar
        x0 = self.mu + alpha * self.s ** 2 / (abar * self.s ** 2 + sigma2) * (xt - alpha * self.mu)
        return (xt - alpha * x0) / sigma2.sqrt()


def test_dpm_solver_reaches_the_exact_ode_solution_at_second_order():
    # For Gaussian data the probability-flow ODE carries each marginal to the next by an affine map:
    # x_T goes to mu + s (x_T - alpha_T mu) / sqrt(alpha_T^2 s^2 + sigma_T^2), exactly. DDIM (DPM-Solver++
    # of order 1) approaches it at order 1, DPM-Solver++(2M) at order 2, and at every timestep (1000
    # calls) both come within what the discrete schedule allows.
    sched = make_schedule(1000)
    mu, s, shape = torch.tensor([0.2, -0.1], dtype=torch.float64), 0.2, (500, 2, 1, 1)
    model = GaussianDenoiser(sched, mu, s)
    x_T = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    abar_T = sched.alphas_cumprod[-1].item()
    exact = model.mu + s * (x_T - math.sqrt(abar_T) * model.mu) / math.sqrt(abar_T * s ** 2 + 1 - abar_T)

    def error(sampler, calls, **kwargs):
        x = sampler(model, sched, shape, calls, generator=torch.Generator().manual_seed(0), dtype=torch.float64,
                    **kwargs)
        return (x - exact).square().mean().sqrt().item()
    ddim = [error(ddim_sample, n, clip_denoised=False) for n in (20, 40, 80)]
    dpm = [error(dpm_solver_sample, n, spacing='linspace') for n in (20, 40, 80)]
    assert 0.8 < math.log2(ddim[0] / ddim[2]) / 2 < 1.2, ddim  # first order
    assert math.log2(dpm[0] / dpm[2]) / 2 > 1.6, dpm  # second order
    assert error(dpm_solver_sample, 1000, spacing="linspace") < 2e-4
    assert error(ddim_sample, 1000, clip_denoised=False) < 2e-3
    assert error(dpm_solver_sample, 20, spacing='logsnr') < error(ddim_sample, 50, clip_denoised=False) / 5


def test_the_accuracy_studys_gaussian_mixture_is_the_exact_denoiser():
    from solver_accuracy import GaussianMixture
    sched = make_schedule(1000)
    mu = torch.tensor([0.2, -0.1], dtype=torch.float64)
    x = torch.randn(6, 2, 1, 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t = torch.tensor([0, 10, 200, 500, 900, 999])
    one = GaussianMixture(sched, [mu.tolist()], 0.2, [1.0])
    assert torch.allclose(one(x, t), GaussianDenoiser(sched, mu, 0.2)(x, t), rtol=1e-12, atol=1e-12)
    two = GaussianMixture(sched, [[0.5, 0.0], [-0.5, 0.0]], 0.1, [0.25, 0.75])
    mean, cov = two.moments()
    assert torch.allclose(mean, torch.tensor([-0.25, 0.0], dtype=torch.float64))
    assert torch.allclose(cov, torch.tensor([[0.01 + 0.1875, 0.0], [0.0, 0.01]], dtype=torch.float64))
    # Far from one component, the posterior is the other's: E[x_0 | x_t] of a single Gaussian.
    near = torch.tensor([[[[-0.5]], [[0.0]]]], dtype=torch.float64)
    other = GaussianMixture(sched, [[-0.5, 0.0]], 0.1, [1.0])
    step = torch.tensor([5])
    assert torch.allclose(two(near, step), other(near, step), rtol=1e-6)


class ImperfectDenoiser(torch.nn.Module):
    """The exact noise prediction of data N(mu, s^2) per channel (GaussianDenoiser: mu = +-0.9, s = 0.3,
    37% of the mass outside [-1, 1]) plus 0.05 sin(3 x_t), an error such as a trained network makes:
    divided by alpha_T ~ 0.006 in eq. 4 solved for x_0, it puts the x_0 prediction far outside
    [-1, 1] at high noise, as a network's is. The model's output is read as eps, or (`inner`
    given) is `inner`'s eps re-derived from its clipped x_0 prediction."""
    def __init__(self, sched, inner=None):
        super().__init__()
        self.sched, self.inner = sched, inner
        self.exact = GaussianDenoiser(sched, torch.tensor([0.9, -0.9], dtype=torch.float64), 0.3)

    def forward(self, xt, t):
        if self.inner is None:
            return self.exact(xt, t) + 0.05 * torch.sin(3 * xt)
        alpha, sigma = (table[t].view(-1, 1, 1, 1) for table in (self.sched.sqrt_alphas_cumprod,
                                                                  self.sched.sqrt_one_minus_alphas_cumprod))
        x0 = ((xt - sigma * self.inner(xt, t)) / alpha).clamp(-1, 1)
        return (xt - alpha * x0) / sigma


def test_ddim_converges_to_the_probability_flow_ode_by_default():
    # DDIM is DPM-Solver++(1): N steps and 2N steps must come closer at the first-order rate and
    # meet DPM-Solver++(2M) at 1000 calls (the converged ODE solution from the same x_T). Clipping
    # x_0 but keeping the model's eps drifts away from it as N grows; re-deriving eps from the
    # clipped x_0 converges, to the ODE of the clipped denoiser instead.
    sched = make_schedule(1000)
    model, shape = ImperfectDenoiser(sched), (500, 2, 1, 1)
    x_T = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t_T = torch.full((shape[0],), 999)
    x0_T = (x_T - sched.sqrt_one_minus_alphas_cumprod[-1] * model(x_T, t_T)) / sched.sqrt_alphas_cumprod[-1]
    assert x0_T.abs().mean() > 2  # the x_0 predictions leave [-1, 1]

    def ddim(steps, **kwargs):
        return ddim_sample(model, sched, shape, steps, generator=torch.Generator().manual_seed(0),
                           dtype=torch.float64, **kwargs)

    def converged(denoiser):
        return dpm_solver_sample(denoiser, sched, shape, 1000, 'linspace', generator=torch.Generator().manual_seed(0),
                                 dtype=torch.float64)
    dist = lambda a, b: (a - b).abs().mean().item()  # in units of [-1, 1]: 1/127.5 is a grey level
    ode = converged(model)
    default = {n: ddim(n) for n in (25, 50, 100, 200, 1000)}
    gaps = [dist(default[n], default[2 * n]) for n in (25, 50, 100)]
    errors = [dist(default[n], ode) for n in (25, 50, 100, 200)]
    for sequence in (gaps, errors):
        for a, b in zip(sequence, sequence[1:]):
            assert 1.7 < a / b < 2.3, sequence  # first order
    assert dist(default[1000], ode) < 1e-3, dist(default[1000], ode)

    clipped = [dist(ddim(n, clip='x0'), ode) for n in (25, 100, 1000)]
    assert clipped[0] < clipped[1] < clipped[2] and clipped[2] > 50 * dist(default[1000], ode), clipped

    rederived = {n: ddim(n, clip='x0+eps') for n in (25, 50, 100, 1000)}
    gaps = [dist(rederived[n], rederived[2 * n]) for n in (25, 50)]
    assert 1.7 < gaps[0] / gaps[1] < 2.3, gaps
    clipped_ode = converged(ImperfectDenoiser(sched, inner=model))
    to_clipped_ode = dist(rederived[1000], clipped_ode)
    assert to_clipped_ode < 1e-3 and dist(rederived[1000], ode) > 10 * to_clipped_ode, to_clipped_ode


@pytest.mark.parametrize('prediction', ['eps', 'v'])
def test_run_sampler_is_each_sampler(prediction):
    # One entry point for every caller: the same images as calling each sampler with the same
    # arguments, every argument passed through (a model that reads t, non-default settings).
    model, sched, shape = SmoothModel(), make_schedule(100), (2, 3, 4, 4)
    seed = lambda: torch.Generator().manual_seed(3)
    cases = [
        (dict(name='ddpm', variance='fixedsmall'),
         lambda: ddpm_sample(model, sched, shape, seed(), variance='fixedsmall', prediction=prediction)),
        (dict(name='ddpm', clip='none'),
         lambda: ddpm_sample(model, sched, shape, seed(), clip_denoised=False, prediction=prediction)),
        (dict(name='ddim', steps=7, eta=0.5),
         lambda: ddim_sample(model, sched, shape, 7, 0.5, seed(), prediction=prediction)),
        (dict(name='ddim', steps=7, clip='x0+eps'),
         lambda: ddim_sample(model, sched, shape, 7, generator=seed(), clip='x0+eps', prediction=prediction)),
        (dict(name='ddim'), lambda: ddim_sample(model, sched, shape, 50, generator=seed(), prediction=prediction)),
        (dict(name='dpm++', steps=6, spacing='linspace'),
         lambda: dpm_solver_sample(model, sched, shape, 6, 'linspace', seed(), prediction=prediction)),
        (dict(name='dpm++'),
         lambda: dpm_solver_sample(model, sched, shape, 20, generator=seed(), prediction=prediction)),
    ]
    outputs = []
    for kwargs, direct in cases:
        name = kwargs.pop('name')
        got = run_sampler(name, model, sched, shape, generator=seed(), prediction=prediction, **kwargs)
        assert torch.equal(got, direct()), (name, kwargs)
        outputs.append(got)
    assert all(not torch.equal(a, b) for i, a in enumerate(outputs) for b in outputs[i + 1:])  # settings matter
    misread = run_sampler('ddim', model, sched, shape, 7, seed(), eta=0.5,
                          prediction={'eps': 'v', 'v': 'eps'}[prediction])
    assert not torch.equal(misread, outputs[2])  # the prediction matters
    bad = [('gan', {}), ('dpm++', dict(clip='x0')), ('ddim', dict(clip='yes')), ('ddpm', dict(clip='on'))]
    for name, kwargs in bad:
        with pytest.raises(ValueError):
            run_sampler(name, model, sched, shape, 3, seed(), **kwargs)


def test_ddim_clip_denoised_is_the_older_name_of_clip():
    model, sched, shape = SmoothModel(), make_schedule(100), (2, 3, 4, 4)
    draw = lambda **kwargs: ddim_sample(model, sched, shape, 5, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(draw(clip_denoised=True), draw(clip='x0'))
    assert torch.equal(draw(clip_denoised=False), draw(clip='none'))
    assert torch.equal(draw(), draw(clip='none'))
    assert not torch.equal(draw(clip='x0'), draw(clip='none'))
    with pytest.raises(ValueError):
        draw(clip_denoised=True, clip='x0')

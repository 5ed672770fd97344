"""v-prediction (Salimans & Ho 2022) and Min-SNR-gamma loss weighting (Hang et al. 2023): the
conversions, the losses and the bound. The samplers' v-prediction loops are proved against
diffusers in test_diffusion.py."""
import math

import pytest
import torch
from helpers import Fixed, refusal

from diffusion import (eps_and_x0, loss_weight_table, make_schedule, q_sample, training_loss, vlb_bits_per_dim,
                       vlb_bits_per_dim_mc)


def _abar(T=1000):
    """abar_t of the linear schedule (section 4 of the DDPM paper), with the math module."""
    betas = [1e-4 + (0.02 - 1e-4) * i / (T - 1) for i in range(T)]
    return [math.prod(1 - b for b in betas[:i + 1]) for i in range(T)]


def test_eps_and_x0_reads_eps_and_v():
    # x_t built from x_0 and eps by eq. 4, v = alpha eps - sigma x_0 by its definition: both outputs
    # must give back the same (eps, x_0).
    g = torch.Generator().manual_seed(0)
    x0, eps = (torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64) for _ in range(2))
    for abar in (0.9999, 0.5, 4e-5):
        alpha, sigma = math.sqrt(abar), math.sqrt(1 - abar)
        xt, v = alpha * x0 + sigma * eps, alpha * eps - sigma * x0
        for output, prediction in [(eps, 'eps'), (v, 'v')]:
            got_eps, got_x0 = eps_and_x0(output, xt, alpha, sigma, prediction)
            assert torch.allclose(got_eps, eps, atol=1e-9) and torch.allclose(got_x0, x0, atol=1e-9 / alpha)
    with pytest.raises(ValueError):
        eps_and_x0(eps, eps, 0.5, 0.5, 'x0')


def test_training_loss_with_v_is_the_v_mse_by_hand():
    T, abar = 1000, _abar()
    sched = make_schedule(T)
    g = torch.Generator().manual_seed(1)
    x0 = torch.rand(4, 3, 8, 8, generator=g, dtype=torch.float64) * 2 - 1
    noise, output = (torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    t = torch.tensor([0, 10, 500, 999])
    v = torch.stack([math.sqrt(abar[s]) * noise[i] - math.sqrt(1 - abar[s]) * x0[i] for i, s in enumerate(t.tolist())])
    by_hand = torch.stack([(output[i] - v[i]).square().mean() for i in range(4)])
    per_image = training_loss(Fixed(output), sched, x0, t, noise, per_example=True, prediction='v')
    assert torch.allclose(per_image, by_hand, rtol=1e-6)
    assert torch.isclose(training_loss(Fixed(output), sched, x0, t, noise, prediction='v'), by_hand.mean(), rtol=1e-6)
    assert training_loss(Fixed(v), sched, x0, t, noise, prediction='v') < 1e-12  # the exact v scores 0
    assert training_loss(Fixed(noise), sched, x0, t, noise, prediction='v') > 0.1  # eps is not v
    with pytest.raises(ValueError):
        training_loss(Fixed(output), sched, x0, t, noise, prediction='x0')


def test_min_snr_weights_are_their_closed_forms():
    # w_t = min(SNR_t, gamma) / SNR_t for eps and min(SNR_t, gamma) / (SNR_t + 1) for v, with
    # SNR_t = abar_t / (1 - abar_t) from the math module; 'uniform' is 1. SNR_t falls through gamma = 5
    # between t = 129 and 130 (through 1 between 258 and 259): the chosen t lie on both sides.
    abar, gamma = _abar(), 5.0
    sched = make_schedule(1000)
    eps_w, v_w = (loss_weight_table(sched, 'min-snr', gamma, p) for p in ('eps', 'v'))
    assert eps_w.dtype == torch.float64 and eps_w.shape == (1000,)
    for t in (0, 10, 100, 129, 130, 300, 500, 999):
        snr = abar[t] / (1 - abar[t])
        assert eps_w[t].item() == pytest.approx(min(snr, gamma) / snr, rel=1e-9)
        assert v_w[t].item() == pytest.approx(min(snr, gamma) / (snr + 1), rel=1e-9)
    assert eps_w[0] < 1e-3 and eps_w[999] == 1 and v_w[0] == pytest.approx(gamma / (abar[0] / (1 - abar[0]) + 1))
    assert torch.equal(loss_weight_table(sched, 'uniform', gamma, 'v'), torch.ones(1000, dtype=torch.float64))
    one = loss_weight_table(sched, 'min-snr', 1.0, 'eps')
    snr = [a / (1 - a) for a in abar]
    assert one.tolist() == pytest.approx([min(s, 1.0) / s for s in snr], rel=1e-9)
    for bad in [dict(loss_weight='p2'), dict(snr_gamma=0.0), dict(prediction='x0')]:
        with pytest.raises(ValueError):
            loss_weight_table(sched, **{'loss_weight': 'min-snr', **bad})


@pytest.mark.parametrize('prediction', ['eps', 'v'])
def test_training_loss_applies_min_snr_per_image(prediction):
    sched = make_schedule(1000)
    g = torch.Generator().manual_seed(2)
    x0 = torch.rand(5, 3, 8, 8, generator=g) * 2 - 1
    noise, output = (torch.randn(5, 3, 8, 8, generator=g) for _ in range(2))
    t = torch.tensor([0, 20, 129, 600, 999])
    plain = training_loss(Fixed(output), sched, x0, t, noise, per_example=True, prediction=prediction)
    weighted = training_loss(Fixed(output), sched, x0, t, noise, per_example=True, prediction=prediction,
                             loss_weight='min-snr', snr_gamma=5.0)
    weights = loss_weight_table(sched, 'min-snr', 5.0, prediction)[t].float()
    assert torch.allclose(weighted, plain * weights, rtol=1e-6)
    mean = training_loss(Fixed(output), sched, x0, t, noise, prediction=prediction, loss_weight='min-snr')
    assert torch.isclose(mean, (plain * weights).mean(), rtol=1e-6)


def test_min_snr_is_min_snr_gamma_times_the_x0_error_for_either_prediction():
    # Hang et al. weight the x_0 error by min(SNR_t, gamma). One denoiser written as an eps-model
    # and as a v-model must then have the same weighted loss, and both must equal
    # min(SNR_t, gamma) ||x_0 - x0_pred||^2, computed here from the x_0 it predicts.
    sched, gamma = make_schedule(1000), 3.0
    g = torch.Generator().manual_seed(3)
    x0 = torch.rand(6, 2, 4, 4, generator=g, dtype=torch.float64) * 2 - 1
    noise = torch.randn(6, 2, 4, 4, generator=g, dtype=torch.float64)
    t = torch.tensor([0, 5, 60, 200, 700, 999])
    alpha = sched.sqrt_alphas_cumprod[t].view(-1, 1, 1, 1)
    sigma = sched.sqrt_one_minus_alphas_cumprod[t].view(-1, 1, 1, 1)
    x0_pred = torch.tanh(1.3 * q_sample(sched, x0, t, noise))  # any denoiser
    xt = q_sample(sched, x0, t, noise)
    as_eps, as_v = (xt - alpha * x0_pred) / sigma, alpha * (xt - alpha * x0_pred) / sigma - sigma * x0_pred
    snr = (alpha / sigma).square().flatten()
    by_hand = snr.clamp(max=gamma) * (x0 - x0_pred).square().flatten(1).mean(1)
    for output, prediction in [(as_eps, 'eps'), (as_v, 'v')]:
        got = training_loss(Fixed(output), sched, x0, t, noise, per_example=True, prediction=prediction,
                            loss_weight='min-snr', snr_gamma=gamma)
        assert torch.allclose(got, by_hand, rtol=1e-6), prediction


def test_weighted_v_loss_is_one_graph_that_never_recompiles():
    # train.make_loss compiles the loss with fullgraph=True: the weights must be gathered on the
    # device (a graph break, such as a python float read from t, fails here) and nothing in the
    # graph may depend on the timesteps drawn (a recompile shows as a second graph).
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    sched, net = make_schedule(1000), torch.nn.Conv2d(3, 3, 1)
    loss = torch.compile(lambda x0: training_loss(lambda x, t: net(x), sched, x0, prediction='v',
                                                  loss_weight='min-snr', snr_gamma=5.0),
                         backend=count, fullgraph=True)
    x0 = torch.rand(8, 3, 4, 4) * 2 - 1
    values = [loss(x0).item() for _ in range(4)]
    assert len(graphs) == 1 and len(set(values)) == 4  # new timesteps and noise each call, one graph
    torch._dynamo.reset()


class SmoothV(torch.nn.Module):
    """A closed-form model whose output is read as v: nonlinear in x_t and t."""
    def forward(self, xt, t):
        scale = (t.to(xt.dtype) / 50 + 0.1).view(-1, 1, 1, 1)
        return torch.tanh(1.5 * xt * scale) + 0.3 * torch.sin(2 * xt + scale)


class VAsEps(torch.nn.Module):
    """The same function written as an eps-model: eps = sigma_t x_t + alpha_t v (v = alpha eps - sigma x_0
    with x_t = alpha x_0 + sigma eps, solved for eps), alpha and sigma from the abar given here."""
    def __init__(self, abar):
        super().__init__()
        self.abar = torch.tensor(abar, dtype=torch.float64)

    def forward(self, xt, t):
        a = self.abar[t].view(-1, 1, 1, 1)
        return (1 - a).sqrt() * xt + a.sqrt() * SmoothV()(xt, t)


@pytest.mark.parametrize('variance, clip', [('fixedlarge', True), ('fixedsmall', False)])
def test_bits_per_dim_of_a_v_model_is_that_of_its_eps_form(variance, clip):
    # The bound depends on the function p(x_{t-1} | x_t), not on how the network writes it: a v-model
    # read with prediction='v' and its eps form read as eps must give the same bits/dim, term by term
    # (the same x_t drawn from the same generator), for the full bound and its Monte Carlo estimate.
    T = 50
    sched = make_schedule(T)
    x0 = torch.randint(0, 256, (3, 3, 4, 4), generator=torch.Generator().manual_seed(4)).double() / 127.5 - 1
    kwargs = dict(variance=variance, clip_denoised=clip)
    as_v = vlb_bits_per_dim(SmoothV(), sched, x0, torch.Generator().manual_seed(0), prediction='v', **kwargs)
    as_eps = vlb_bits_per_dim(VAsEps(_abar(T)), sched, x0, torch.Generator().manual_seed(0), **kwargs)
    assert torch.allclose(as_v['terms'], as_eps['terms'], rtol=1e-9, atol=1e-12)
    assert torch.allclose(as_v['total'], as_eps['total'], rtol=1e-9)
    misread = vlb_bits_per_dim(SmoothV(), sched, x0, torch.Generator().manual_seed(0), **kwargs)
    assert (misread['total'] - as_v['total']).abs().min() > 0.01  # the reading matters
    mc_v = vlb_bits_per_dim_mc(SmoothV(), sched, x0, 7, torch.Generator().manual_seed(1), prediction='v', **kwargs)
    mc_eps = vlb_bits_per_dim_mc(VAsEps(_abar(T)), sched, x0, 7, torch.Generator().manual_seed(1), **kwargs)
    for key in ('total', 'decoder', 'kl'):
        assert torch.allclose(mc_v[key], mc_eps[key], rtol=1e-9), key


# ----------------------------------------------------------------------------- the flags, end to end

def _train(tmp_path, *extra):
    from helpers import train_args

    import train
    return train.cli(train_args(tmp_path, '--sample-every', '0', *extra))


def test_the_run_trains_what_its_flags_say(monkeypatch, tmp_path):
    import diffusion
    seen = []
    real = diffusion.training_loss

    def spy(*args, **kwargs):
        seen.append({k: kwargs.get(k) for k in ('prediction', 'loss_weight', 'snr_gamma')})
        return real(*args, **kwargs)
    monkeypatch.setattr(diffusion, 'training_loss', spy)
    assert _train(tmp_path / 'a', '--steps', '1', '--prediction', 'v', '--loss-weight', 'min-snr') == 0
    assert seen[0] == {'prediction': 'v', 'loss_weight': 'min-snr', 'snr_gamma': 5.0}
    assert _train(tmp_path / 'b', '--steps', '1', '--loss-weight', 'min-snr', '--snr-gamma', '2') == 0
    assert [s for s in seen if s['loss_weight'] == 'min-snr'][-1] == {'prediction': 'eps', 'loss_weight': 'min-snr',
                                                                      'snr_gamma': 2.0}
    ckpt = torch.load(tmp_path / 'a' / 'run' / 'ckpt.pt', weights_only=True)
    assert ckpt['config']['prediction'] == 'v' and ckpt['config']['snr_gamma'] == 5.0


def test_a_min_snr_run_resumes_with_uniform_weights_and_a_warning(tmp_path, capsys):
    # docs/training.md: --loss-weight may change on resume, with a warning; the saved gamma goes with
    # the saved weighting (it weighs nothing under uniform) instead of refusing the run.
    assert _train(tmp_path, '--steps', '2', '--loss-weight', 'min-snr', '--snr-gamma', '3') == 0
    ckpt = str(tmp_path / 'run' / 'ckpt.pt')
    capsys.readouterr()
    assert _train(tmp_path, '--steps', '4', '--resume', ckpt, '--loss-weight', 'uniform') == 0
    assert '--loss-weight uniform (the checkpoint\'s: min-snr)' in capsys.readouterr().err
    config = torch.load(ckpt, weights_only=True)['config']
    assert (config['loss_weight'], config['snr_gamma'], torch.load(ckpt, weights_only=True)['step']) == ('uniform',
                                                                                                       None, 4)
    # and back: the gamma given now is the one used
    assert _train(tmp_path, '--steps', '6', '--resume', ckpt, '--loss-weight', 'min-snr', '--snr-gamma', '2') == 0
    assert torch.load(ckpt, weights_only=True)['config']['snr_gamma'] == 2.0


def test_the_heldout_loss_is_the_eps_mse_for_either_prediction():
    import evaluation
    import train
    sched = make_schedule(1000)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8, generator=generator)
    t = torch.tensor([0, 100, 400, 700, 900, 999])
    noise = torch.randn(6, 3, 8, 8, generator=generator)
    v_out = torch.randn(6, 3, 8, 8, generator=generator)
    cfg = train.TrainConfig(batch_size=8, prediction='v', amp='off', channels_last=False)
    losses = evaluation.heldout_losses(Fixed(v_out), sched, (images, t, noise), cfg, torch.device('cpu'))
    x0 = images.float() / 127.5 - 1
    alpha, sigma = sched.sqrt_alphas_cumprod[t].float().view(-1, 1, 1, 1), \
        sched.sqrt_one_minus_alphas_cumprod[t].float().view(-1, 1, 1, 1)
    xt = alpha * x0 + sigma * noise
    eps = sigma * xt + alpha * v_out  # the eps a v output stands for
    assert torch.allclose(losses, (eps - noise).square().flatten(1).mean(1), atol=1e-5)


@pytest.mark.parametrize('extra, expected', [
    (['--snr-gamma', '3'], '--snr-gamma 3.0 weights nothing without --loss-weight min-snr'),
    (['--loss-weight', 'min-snr', '--snr-gamma', '0'], '--snr-gamma must be a positive number'),
    (['--prediction', 'x0'], 'invalid choice'),
])
def test_bad_prediction_flags_are_one_line(tmp_path, capsys, extra, expected):
    code, err = refusal(capsys, _train, tmp_path, '--steps', '1', *extra)
    assert code == 2 and expected in err and err.count('\n') == 0, err


def test_resume_or_init_from_across_predictions_is_refused(tmp_path, capsys):
    assert _train(tmp_path / 'eps', '--steps', '2') == 0
    ckpt = str(tmp_path / 'eps' / 'run' / 'ckpt.pt')
    capsys.readouterr()
    import train
    assert train.cli(['--resume', ckpt, '--steps', '4', '--prediction', 'v']) == 2
    assert '--prediction eps, this run v' in capsys.readouterr().err
    assert _train(tmp_path / 'v', '--steps', '1', '--prediction', 'v', '--init-from', ckpt) == 2
    assert 'its network predicts eps, this run --prediction v' in capsys.readouterr().err
    assert _train(tmp_path / 'w', '--steps', '1', '--loss-weight', 'min-snr', '--init-from', ckpt) == 0  # weights: ok


def test_a_v_model_exports_with_its_prediction_type_and_samples_in_diffusers_as_ours(tmp_path):
    diffusers = pytest.importorskip('diffusers')
    import numpy as np

    import diffusion
    import drawing
    import sample
    assert _train(tmp_path, '--steps', '2', '--prediction', 'v') == 0
    ckpt = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    for tensor in ckpt['ema'].values():  # random weights, so that the samples depend on them
        tensor.add_(0.05 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(0)))
    torch.save(ckpt, tmp_path / 'v.pt')
    assert sample.cli(['--ckpt', str(tmp_path / 'v.pt'), '--export-diffusers', str(tmp_path / 'pipe'),
                       '--device', 'cpu']) == 0
    pipeline = diffusers.DDPMPipeline.from_pretrained(str(tmp_path / 'pipe'))
    assert pipeline.scheduler.config.prediction_type == 'v_prediction'
    theirs = pipeline(batch_size=1, num_inference_steps=1000, output_type='np',
                      generator=torch.Generator().manual_seed(3)).images
    model, _, sched, prediction = sample.load_model(str(tmp_path / 'pipe'), 'ema', torch.device('cpu'))
    assert prediction == 'v'
    with torch.no_grad():
        x = diffusion.ddpm_sample(model, sched, (1, 3, 16, 16), torch.Generator().manual_seed(3), prediction='v')
    mine = drawing.to_uint8(x).permute(0, 2, 3, 1).numpy().astype(int)
    theirs = np.round(theirs * 255).astype(int)
    assert np.abs(mine - theirs).max() <= 1 and (mine == theirs).mean() > 0.99 and mine.std() > 10

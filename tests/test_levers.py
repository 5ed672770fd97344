"""The levers of the images needed, each against a closed form on the whole function: timestep laws
(their tables against scipy's CDFs, draws against the table, the reweighted objective equal to
L_simple exactly), input perturbation (the network's input variance, the target unchanged), the
learning-rate decay (values written out), the EMA length (the weight of every past step), Adam's
beta2, immiscible noise assignment (against every permutation), exact resume with every lever on,
and their bad input."""
import math

import numpy as np
import pytest
import torch
from helpers import train_args

import bookkeeping
import diffusion
import train


@pytest.fixture(scope='module')
def sched():
    return diffusion.make_schedule(1000)


def ln_sigma(sched) -> np.ndarray:
    abar = sched.alphas_cumprod.numpy()
    return 0.5 * np.log((1 - abar) / abar)


def test_the_lognormal_law_is_edms_on_ln_sigma(sched):
    from scipy.stats import norm
    s = ln_sigma(sched)
    edges = np.concatenate([[-np.inf], (s[1:] + s[:-1]) / 2, [np.inf]])
    expected = np.diff(norm.cdf(edges, loc=-1.2, scale=1.2))
    got = diffusion.timestep_probabilities(sched, 'lognormal').numpy()
    assert np.allclose(got, expected / expected.sum(), atol=1e-12, rtol=0) and got.sum() == pytest.approx(1.0)
    other = diffusion.timestep_probabilities(sched, 'lognormal', mean=0.5, scale=0.3).numpy()
    assert np.allclose(other, np.diff(norm.cdf(edges, loc=0.5, scale=0.3)), atol=1e-12)


def test_the_laplace_law_is_on_the_log_snr(sched):
    # Written in the log-SNR itself, lambda = -2 ln sigma, decreasing in t: t's mass lies between the
    # midpoints of its neighbours' lambdas.
    from scipy.stats import laplace
    lam = -2 * ln_sigma(sched)
    upper = np.concatenate([[np.inf], (lam[1:] + lam[:-1]) / 2])
    lower = np.concatenate([(lam[1:] + lam[:-1]) / 2, [-np.inf]])
    expected = laplace.cdf(upper, loc=0.0, scale=0.5) - laplace.cdf(lower, loc=0.0, scale=0.5)
    got = diffusion.timestep_probabilities(sched, 'laplace').numpy()
    assert np.allclose(got, expected, atol=1e-12, rtol=0)
    assert int(np.argmax(got)) == int(np.argmin(np.abs(lam)))  # the mode at log-SNR 0
    assert torch.equal(diffusion.timestep_probabilities(sched), torch.full((1000,), 1e-3, dtype=torch.float64))


class Recorder(torch.nn.Module):
    """Returns a fixed function of (x, t) and keeps what it was given."""
    def forward(self, x, t):
        self.x, self.t = x, t
        return x * 0 + (t.float() / 1000)[:, None, None, None]


@pytest.mark.parametrize('kind', ['lognormal', 'laplace'])
def test_the_drawn_timesteps_follow_the_table(sched, kind):
    probs = diffusion.timestep_probabilities(sched, kind)
    model, x0 = Recorder(), torch.zeros(200_000, 1, 1, 1)
    torch.manual_seed(0)
    diffusion.training_loss(model, sched, x0, t_probs=probs)
    counts = torch.bincount(model.t, minlength=1000).double()
    # A chi-square test on 20 bins of about equal probability: 19 degrees of freedom, 43.8 is p = 0.001.
    edges = np.searchsorted(np.cumsum(probs.numpy()), np.linspace(0, 1, 21)[1:-1])
    bins = np.split(np.arange(1000), edges)
    observed = np.array([counts[b].sum().item() for b in bins])
    expected = np.array([probs[b].sum().item() * len(x0) for b in bins])
    assert ((observed - expected) ** 2 / expected).sum() < 43.8
    uniform = Recorder()
    diffusion.training_loss(uniform, sched, x0[:20_000])
    assert abs(uniform.t.double().mean().item() - 499.5) < 5  # no table: uniform, as before


@pytest.mark.parametrize('prediction', ['eps', 'v'])
def test_reweighting_keeps_l_simple_exactly(sched, prediction):
    # E_{t ~ p}[(1/T)/p(t) L(t)] = (1/T) sum_t L(t): computed over every t, not sampled.
    probs = diffusion.timestep_probabilities(sched, 'lognormal')
    t = torch.arange(1000)
    torch.manual_seed(1)
    x0, noise = torch.randn(1, 1, 4, 4).expand(1000, 1, 4, 4), torch.randn(1, 1, 4, 4).expand(1000, 1, 4, 4)
    plain = diffusion.training_loss(Recorder(), sched, x0, t, noise, per_example=True, prediction=prediction)
    weighted = diffusion.training_loss(Recorder(), sched, x0, t, noise, per_example=True, prediction=prediction,
                                       t_probs=probs, t_reweight=True)
    assert (probs * weighted.double()).sum().item() == pytest.approx(plain.double().mean().item(), rel=1e-6)
    assert torch.allclose(weighted.double(), plain.double() / (1000 * probs), rtol=1e-6)
    unweighted = diffusion.training_loss(Recorder(), sched, x0, t, noise, per_example=True, prediction=prediction,
                                         t_probs=probs)
    assert torch.equal(unweighted, plain)  # without --t-reweight the law changes the objective


def test_input_perturbation_widens_the_input_and_keeps_the_target(sched):
    model, t = Recorder(), torch.full((4096,), 500)
    x0, noise = torch.zeros(4096, 1, 4, 4), torch.randn(4096, 1, 4, 4, generator=torch.Generator().manual_seed(2))
    diffusion.training_loss(model, sched, x0, t, noise, input_perturbation=0.1)
    variance = (1 - sched.alphas_cumprod[500]).item() * (1 + 0.1 ** 2)
    assert model.x.var().item() == pytest.approx(variance, rel=0.02)
    assert not torch.allclose(model.x, diffusion.q_sample(sched, x0, t, noise))

    class Oracle(torch.nn.Module):  # predicts the true noise: the loss is 0 only if the target is eps alone
        def forward(self, x, t):
            return noise
    assert diffusion.training_loss(Oracle(), sched, x0, t, noise, input_perturbation=0.1).item() == 0.0
    torch.manual_seed(3)
    off = diffusion.training_loss(Recorder(), sched, x0 + 1, t, noise, input_perturbation=0.0)
    torch.manual_seed(3)
    assert torch.equal(off, diffusion.training_loss(Recorder(), sched, x0 + 1, t, noise))  # 0: the paper's


def test_immiscible_assignment_is_the_cheapest_permutation():
    # Against every one of the 720 permutations of 6 draws: the summed L2 distance of the assignment
    # is the least, and the draws are the same set (the noise's law is unchanged).
    import itertools
    g = torch.Generator().manual_seed(4)
    x0, noise = torch.rand(6, 1, 3, 3, generator=g) * 2 - 1, torch.randn(6, 1, 3, 3, generator=g)
    got = diffusion.immiscible_noise(x0, noise)
    cost = torch.cdist(x0.flatten(1).double(), noise.flatten(1).double())
    best = min(sum(cost[i, p[i]].item() for i in range(6)) for p in itertools.permutations(range(6)))
    assert (x0.double() - got.double()).flatten(1).norm(dim=1).sum().item() == pytest.approx(best, rel=1e-12)
    assert (x0.double() - noise.double()).flatten(1).norm(dim=1).sum().item() > best  # this draw's own order is not it
    assert sorted(map(tuple, got.flatten(1).tolist())) == sorted(map(tuple, noise.flatten(1).tolist()))


def test_immiscible_training_loss_is_l_simple_on_the_assigned_noise(sched):
    net, x0 = Recorder(), torch.rand(8, 1, 4, 4, generator=torch.Generator().manual_seed(5)) * 2 - 1
    config = train.TrainConfig(amp='off', compile=False, channels_last=False, immiscible=True)
    torch.manual_seed(6)
    got = train.make_loss(config, net, sched, torch.device('cpu'))(x0)
    torch.manual_seed(6)
    noise = diffusion.immiscible_noise(x0, torch.randn_like(x0))
    assert torch.equal(got, diffusion.training_loss(Recorder(), sched, x0, noise=noise))
    torch.manual_seed(6)
    plain = train.make_loss(train.TrainConfig(amp='off', compile=False, channels_last=False), net, sched,
                            torch.device('cpu'))(x0)
    torch.manual_seed(6)
    assert torch.equal(plain, diffusion.training_loss(Recorder(), sched, x0))  # off: the paper's draw, unchanged


def cfg(**kw):
    return train.TrainConfig(**{'lr': 1.0, 'warmup': 10, **kw})


def test_the_learning_rate_at_chosen_steps():
    total = 110  # 10 warm-up steps, then 100 of decay; the last step has index 109
    for step, expected in ((0, 0.1), (4, 0.5), (9, 1.0), (10, 1.0), (109, 1.0)):
        assert train.lr_at(step, cfg(), total) == pytest.approx(expected)
    cosine = {10: 0.5 * (1 + math.cos(math.pi / 100)), 59: 0.5, 108: 0.5 * (1 + math.cos(math.pi * 0.99)), 109: 0.0}
    for step, expected in cosine.items():
        assert train.lr_at(step, cfg(lr_decay='cosine'), total) == pytest.approx(expected, abs=1e-12)
    for step, expected in ((9, 1.0), (10, 0.99), (59, 0.5), (109, 0.0)):
        assert train.lr_at(step, cfg(lr_decay='linear'), total) == pytest.approx(expected, abs=1e-12)
    assert train.lr_at(0, cfg(warmup=0, lr_decay='linear'), 100) == pytest.approx(0.99)


def test_the_ema_length_gives_each_past_step_edms_weight():
    # The EMA after N steps is sum_k w_k theta_k with w_k = (1 - b_k) prod_{j>k} b_j, and EDM's
    # b_k = 0.5^(batch / (r * images seen)) = 0.5^(1 / (r (k + 1))), capped by --ema-decay.
    config, steps = cfg(ema_length=0.05, ema_decay=0.9999, batch_size=8), 400
    ema, model = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(ema.weight)
    for k in range(steps):
        model.weight.data.fill_(float(k))
        bookkeeping.ema_update(ema, model, train.ema_decay_at(k, config))
    beta = [min(0.9999, 0.5 ** (1 / (0.05 * (k + 1)))) for k in range(steps)]
    weights = [(1 - beta[k]) * math.prod(beta[k + 1:]) for k in range(steps)]
    assert ema.weight.item() == pytest.approx(sum(w * k for k, w in enumerate(weights)), rel=1e-5)
    # Half of the weight lies within the last 5% of the steps (its half-life), give or take the discreteness.
    assert sum(weights[-20:]) == pytest.approx(0.5, abs=0.02)
    assert train.ema_decay_at(5, cfg()) == pytest.approx(6 / 15)  # 0: the paper's ramp, unchanged


def run(tmp_path, *extra):
    return train.cli(train_args(tmp_path, *extra))


LEVERS = ['--t-sampling', 'laplace', '--t-reweight', '--input-perturbation', '0.1', '--lr-decay', 'cosine',
          '--adam-beta2', '0.99', '--ema-length', '0.05', '--immiscible', '--warmup', '2', '--dropout', '0.1',
          '--ckpt-every', '0']


def test_resume_is_exact_with_every_lever_on(tmp_path, monkeypatch):
    assert run(tmp_path / 'whole', *LEVERS, '--steps', '16') == 0
    real = train.train_step

    def stop_at_ten(run_, x0, step):  # SIGTERM during step 10: the loop stops there and saves, mid-decay
        if step == 9:
            run_.stop.reason = 'SIGTERM'
        return real(run_, x0, step)
    monkeypatch.setattr(train, 'train_step', stop_at_ten)
    assert run(tmp_path / 'split', *LEVERS, '--steps', '16') == 0
    monkeypatch.undo()
    ckpt = tmp_path / 'split' / 'run' / 'ckpt.pt'
    assert torch.load(ckpt, weights_only=True)['step'] == 10
    assert train.cli(['--resume', str(ckpt)]) == 0
    whole, split = (torch.load(p / 'run' / 'ckpt.pt', weights_only=True) for p in (tmp_path / 'whole',
                                                                                   tmp_path / 'split'))
    for key in ('model', 'ema'):
        for name, tensor in whole[key].items():
            assert torch.equal(tensor, split[key][name]), (key, name)
    assert tuple(whole['optimizer']['param_groups'][0]['betas']) == (0.9, 0.99)
    plain = tmp_path / 'plain'
    assert run(plain, '--steps', '16', '--warmup', '2', '--dropout', '0.1') == 0  # the levers change the run
    assert not torch.equal(torch.load(plain / 'run' / 'ckpt.pt', weights_only=True)['model']['conv_out.weight'],
                           whole['model']['conv_out.weight'])


def test_a_lever_changed_at_a_resume_warns_and_applies(tmp_path, capsys):
    assert run(tmp_path, '--steps', '4', '--sample-every', '0', '--lr-decay', 'cosine', '--warmup', '2') == 0
    path = str(tmp_path / 'run' / 'ckpt.pt')
    capsys.readouterr()
    assert train.cli(['--resume', path, '--steps', '6', '--adam-beta2', '0.95']) == 0
    err = capsys.readouterr().err
    assert "warning: --adam-beta2 0.95 (the checkpoint's: 0.999)" in err
    assert 'warning: --lr-decay cosine now decays to --steps 6' in err  # another planned length
    ckpt = torch.load(path, weights_only=True)
    assert tuple(ckpt['optimizer']['param_groups'][0]['betas']) == (0.9, 0.95)  # applied, not the saved one


@pytest.mark.parametrize('extra, expected', [
    (['--t-mean', '0'], '--t-mean shapes nothing without --t-sampling'),
    (['--t-reweight'], '--t-reweight shapes nothing'),
    (['--t-sampling', 'lognormal', '--t-scale', '0'], '--t-scale'),
    (['--input-perturbation', '2'], '--input-perturbation'),
    (['--adam-beta2', '1'], '--adam-beta2'),
    (['--ema-length', '1'], '--ema-length'),
    (['--lr-decay', 'step'], "invalid choice: 'step'"),
])
def test_bad_lever_flags_are_one_line_before_any_work(tmp_path, capsys, extra, expected):
    try:
        code = run(tmp_path, '--steps', '2', *extra)
    except SystemExit as exit:
        code = exit.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and expected in err[-1] and not (tmp_path / 'run').exists(), err

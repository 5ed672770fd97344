"""Consistency students (distill.py --method consistency, students.py): ECT's gap schedule at hand-computed
points, the boundary condition, the loss against the Gaussian closed form (the exact consistency function
has zero loss under the exact ODE step, a wrong one does not, and consistency training's gradient points
at it), the shared dropout, the sampler, and distill.py / sample.py around them: exact resume, a stop,
the refusals."""
import json

import pytest
import torch
from helpers import GAUSS_SCHED, MU, S, exact_eps, exact_map, sigterm_after_steps, spy_on_unet
from test_distill import load, one_error

import distill
import sample
import students


def consistency_args(teacher, out, *extra):
    """Two stages of three steps, batch 8, 8x8 digits."""
    return ['--ckpt', teacher, '--method', 'consistency', '--stages', '2', '--steps-per-stage', '3', '--batch-size',
            '8', '--num-workers', '0', '--log-every', '1', '--device', 'cpu', '--out-dir', str(out), *extra]


def clean_end(t):
    return torch.full_like(t, -1)


# ----------------------------------------------------------------------------- the maths

def test_the_gap_is_ects_formula_at_hand_computed_points():
    # r = s (1 - (1 + 8 sigmoid(-s)) / 2^(stage + 1)), clamped at 0; sigmoid(-1) = 0.26894142, sigmoid(-5) = 0.00669285
    s = torch.tensor([1.0, 5.0, 1.0, 5.0, 0.1], dtype=torch.float64)
    stage = [0, 0, 3, 3, 9]
    expected = [0.0, 5 * (1 - 1.0535428 / 2), 1 - 3.1515314 / 16, 5 * (1 - 1.0535428 / 16),
                0.1 * (1 - (1 + 8 * 0.47502081) / 1024)]
    got = [students.ect_gap(s[i:i + 1], stage[i]).item() for i in range(5)]
    assert got == pytest.approx(expected, abs=1e-6)
    # The pairs on the VP grid: r under t, its level at or under the gap's, the next timestep's above it.
    levels = students.noise_levels(GAUSS_SCHED)
    for stage in (0, 2, 6):
        t, r = students.consistency_pair(GAUSS_SCHED, stage, 4000, 'cpu', torch.Generator().manual_seed(stage))
        gap = students.ect_gap(levels[t], stage)
        assert (r < t).all() and (r >= -1).all() and (t <= 999).all()
        inside = r >= 0
        assert (levels[r[inside]] <= gap[inside] + 1e-12).all()
        assert (levels[r + 1] > gap).all()  # the largest such timestep
        assert (gap[r == -1] < levels[0]).all()  # the clean end only where the gap falls under the first level
        if stage == 0:  # the first stage is mostly denoising: r the clean end wherever 1 + 8 sigmoid(-s) >= 2
            assert (r[levels[t] <= torch.log(torch.tensor(7.0, dtype=torch.float64))] == -1).all()
    # ln s ~ N(-1.1, 2^2): its median level -1.1 within sampling error (4000 draws)
    t, _ = students.consistency_pair(GAUSS_SCHED, 0, 4000, 'cpu', torch.Generator().manual_seed(9))
    assert abs(levels[t].log().median().item() + 1.1) < 0.12


@pytest.mark.parametrize('prediction', ['eps', 'v', 'x'])
def test_the_boundary_condition_holds_exactly_and_elsewhere_f_is_the_x_prediction(prediction):
    g = torch.Generator().manual_seed(0)
    z, output = torch.randn(6, 3, 4, 4, generator=g), 1e6 * torch.randn(6, 3, 4, 4, generator=g)
    t = torch.tensor([-1, 0, 10, -1, 500, 999])
    alpha, sigma = students.alpha_sigma(GAUSS_SCHED, t, z)
    f = students.consistency_fn(output, z, t, alpha, sigma, prediction)
    assert torch.equal(f[t == -1], z[t == -1])  # bit for bit, whatever the network said there
    x, _ = students.x_and_eps(output, z, alpha, sigma, prediction)
    assert torch.equal(f[t >= 0], x[t >= 0])
    nan = torch.full_like(output, float('nan'))
    assert torch.equal(students.consistency_fn(nan, z, t, alpha, sigma, prediction)[t == -1], z[t == -1])


def exact_student(scale=1.0):
    """A student in 'x' whose f is the exact consistency function of data N(MU, (scale S)^2): the
    probability-flow map from t to the clean end (scale 1: the true one)."""
    return lambda z, t: exact_map(z, t, clean_end(t), scale)


def exact_ode_step(z, t, r):
    return exact_map(z, t, r)


def gaussian(n, seed):
    return MU + S * torch.randn(n, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize('huber_c', [0.0, 0.03])
def test_the_exact_consistency_function_has_zero_loss_under_the_exact_ode_step_and_a_wrong_one_does_not(huber_c):
    x0 = gaussian(4000, 0)
    for stage in (0, 3, 8):
        torch.manual_seed(stage)
        exact = distill.consistency_loss(exact_student(), GAUSS_SCHED, x0, stage, 'x', exact_ode_step, huber_c)
        assert exact.item() < 1e-10
        for scale in (0.8, 1.25):
            torch.manual_seed(stage)
            wrong = distill.consistency_loss(exact_student(scale), GAUSS_SCHED, x0, stage, 'x', exact_ode_step,
                                             huber_c)
            assert wrong.item() > 1e-4, (stage, scale, wrong.item())
    # The same exact student read through the v parameterisation (what distill.py trains): zero again.
    def as_v(z, t):
        alpha, sigma = students.alpha_sigma(GAUSS_SCHED, t, z)
        f = exact_map(z, t, clean_end(t))
        return students.output_for(f, (z - alpha * f) / sigma, alpha, sigma, 'v')
    torch.manual_seed(1)
    assert distill.consistency_loss(as_v, GAUSS_SCHED, x0, 2, 'v', exact_ode_step, huber_c).item() < 1e-6


def test_the_teachers_ddim_step_tends_to_the_exact_step_as_the_gap_shrinks():
    # Consistency distillation with a perfect teacher: its DDIM step is first order, so the exact student's loss
    # (the L2 distance, weighted by 1 / (s_t - s_r)) shrinks with the gap, stage by stage.
    x0, losses = gaussian(8000, 1), []
    teacher_step = lambda z, t, r: distill.teacher_step(exact_eps, GAUSS_SCHED, z, t, r, 'eps')  # noqa: E731
    for stage in (1, 4, 7):
        torch.manual_seed(0)
        losses.append(distill.consistency_loss(exact_student(), GAUSS_SCHED, x0, stage, 'x', teacher_step).item())
    assert losses[1] < losses[0] / 3 and losses[2] < losses[1] / 3, losses


def test_consistency_trainings_gradient_points_at_the_exact_function():
    # The family f_a: the exact consistency function of data N(MU, (a S)^2). Consistency training (the same noise
    # at r, no ODE step) leaves a non-zero loss even at a = 1, but its gradient (Song et al. 2023, Theorem 2; a
    # nearly squared distance, c = 10) points at a = 1 from either side, and vanishes there as the gap shrinks.
    x0 = gaussian(100000, 2)
    grads = {}
    for stage, a0 in [(2, 1.0)] + [(stage, a0) for stage in (5, 8) for a0 in (0.7, 1.0, 1.3)]:
        a = torch.tensor(a0, dtype=torch.float64, requires_grad=True)
        torch.manual_seed(stage)
        distill.consistency_loss(exact_student(a), GAUSS_SCHED, x0, stage, 'x', huber_c=10.0).backward()
        grads[stage, a0] = a.grad.item()
    for stage in (5, 8):
        assert grads[stage, 0.7] < 0 < grads[stage, 1.3], grads
        assert abs(grads[stage, 1.0]) < 0.15 * min(abs(grads[stage, 0.7]), grads[stage, 1.3]), grads
    assert abs(grads[8, 1.0]) < abs(grads[2, 1.0]) / 5, grads  # the bias shrinks with the gap


@pytest.mark.parametrize('huber_c', [0.0, 0.5])
def test_the_loss_is_the_distance_of_the_two_sides_over_their_level_gap(huber_c):
    # A student whose f is z itself (prediction 'x', output z): f(z_t) - f(z_r) = z_t - z_r, by hand.
    x0, noise = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    t, r = torch.tensor([10, 400, 999]), torch.tensor([-1, 300, 990])
    abar = GAUSS_SCHED.alphas_cumprod
    z_t = abar[t, None].sqrt() * x0 + (1 - abar[t, None]).sqrt() * noise
    z_r = torch.stack([x0[0], *(abar[r[1:], None].sqrt() * x0[1:] + (1 - abar[r[1:], None]).sqrt() * noise[1:])])
    level = lambda k: ((1 - abar[k]) / abar[k]).sqrt() if k >= 0 else 0.0  # noqa: E731
    expected = [(((z_t[i] - z_r[i]).square().sum() + huber_c ** 2).sqrt() - huber_c) / (level(t[i]) - level(r[i]))
                for i in range(3)]
    got = distill.consistency_loss(lambda z, t: z, GAUSS_SCHED, x0, 0, 'x', huber_c=huber_c, t=t, r=r, noise=noise,
                                   per_example=True)
    assert torch.allclose(got, torch.stack(expected), rtol=1e-12)


def test_both_sides_of_the_loss_draw_the_same_dropout_and_only_one_carries_the_gradient():
    drawn = []

    class Dropping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, z, t):
            mask = torch.nn.functional.dropout(torch.ones_like(z), 0.5)
            drawn.append((mask, torch.is_grad_enabled()))
            return self.w * z * mask
    net = Dropping()
    x0 = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    loss = distill.consistency_loss(net, GAUSS_SCHED, x0, 5, 'x')
    (first, grad_first), (second, grad_second) = drawn
    assert torch.equal(first, second) and grad_first and not grad_second
    loss.backward()
    assert net.w.grad is not None and net.w.grad != 0


def test_one_and_two_call_sampling_with_the_exact_function():
    # f exact: one call lands on the exact map's image of the noise; two calls re-noise it to the mid timestep
    # and map it back: the exact function's images are the data's law both times (mean and sd per coordinate).
    n = 40000
    z = torch.randn(n, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    one = students.consistency_sample(exact_student(), GAUSS_SCHED, z.shape, [999], x=z.clone(), dtype=torch.float64,
                                      prediction='x')
    assert torch.allclose(one, exact_map(z, torch.full((n,), 999), torch.full((n,), -1)).clamp(-1, 1))
    calls = []

    def counting(z, t):
        calls.append(sorted(set(t.tolist())))
        return exact_student()(z, t)
    two = students.consistency_sample(counting, GAUSS_SCHED, (n, 2), [999, 222], torch.Generator().manual_seed(4),
                                      dtype=torch.float64, prediction='x')
    assert calls == [[999], [222]]
    for drawn in (one, two):
        assert torch.allclose(drawn.mean(0), MU, atol=0.01) and torch.allclose(drawn.std(0), S, atol=0.01)
    assert students.consistency_timesteps(2, 222) == [999, 222] and students.consistency_timesteps(1, 222) == [999]
    with pytest.raises(ValueError):
        students.consistency_timesteps(3, 222)


# ----------------------------------------------------------------------------- distill.py --method consistency

@pytest.fixture(scope='module')
def tuned(teachers, tmp_path_factory):
    """An uninterrupted consistency run: OUT/consistency-1.pt, consistency-2.pt, distill.pt."""
    out = tmp_path_factory.mktemp('tuned') / 'run'
    assert distill.cli(consistency_args(teachers['uncond'], out)) == 0
    return out


def rows(folder):
    return [json.loads(line) for line in open(folder / 'metrics.jsonl')]


def test_a_run_writes_one_student_of_one_and_two_calls_per_stage_keeping_its_optimizer(tuned):
    one, two, run = load(tuned / 'consistency-1.pt'), load(tuned / 'consistency-2.pt'), load(tuned / 'distill.pt')
    assert one['student'] | {'steps': 2, 'timesteps': [999, 400]} == two['student']
    assert one['student']['method'] == 'consistency' and one['student']['timesteps'] == [999]
    assert one['student']['ode_step'] == 'data' and one['student']['prediction'] == 'v'
    for name, tensor in one['ema'].items():
        assert torch.equal(tensor, two['ema'][name]) and torch.equal(tensor, run['ema'][name])
    assert not torch.equal(one['ema']['conv_out.weight'], run['model']['conv_out.weight'])  # an EMA by default
    # The optimizer ran through both stages (6 steps, never reset) at a constant lr (ECT's): a fifth of the teacher's.
    assert all(state['step'] == 6 for state in run['optimizer']['state'].values())
    trained = [row for row in rows(tuned) if row.get('kind') == 'train']
    teacher_lr = load(run['distill']['ckpt'])['config']['lr']
    assert one['model_config']['dropout'] == load(run['distill']['ckpt'])['model_config']['dropout']  # the teacher's
    assert [row['step'] for row in trained] == [1, 2, 3, 4, 5, 6] and {row['lr'] for row in trained} == {teacher_lr / 5}
    assert [row['stage'] for row in trained] == [0, 0, 0, 1, 1, 1]
    # The teacher stays the trained model; the student left it.
    teacher = load(run['distill']['ckpt'])['ema']
    assert all(torch.equal(teacher[name], tensor) for name, tensor in run['teacher'].items())
    assert not torch.equal(teacher['conv_out.weight'], one['ema']['conv_out.weight'])


def test_each_stage_trains_on_its_own_gap(teachers, tmp_path, monkeypatch):
    stages, loss = [], distill.consistency_loss

    def spy(student, sched, x0, stage, *args, **kwargs):
        stages.append(stage)
        return loss(student, sched, x0, stage, *args, **kwargs)
    monkeypatch.setattr(distill, 'consistency_loss', spy)
    assert distill.cli(consistency_args(teachers['uncond'], tmp_path / 'run', '--stages', '3',
                                        '--steps-per-stage', '2', '--dropout', '0.25')) == 0
    assert stages == [0, 0, 1, 1, 2, 2]
    assert load(tmp_path / 'run' / 'consistency-1.pt')['model_config']['dropout'] == 0.25


def test_the_pairs_levels_follow_the_lognormal_asked_for(teachers, tmp_path, monkeypatch):
    # ln s ~ N(mean, std^2) on the grid: median and quartiles of the drawn levels where asked (4000 draws),
    # ECT's -1.1 and 2 by default, and --level-mean / --level-std reach the pairs of a run.
    levels = students.noise_levels(GAUSS_SCHED).log()
    for mean, std in ((-1.1, 2.0), (1.0, 0.5), (2.5, 1.0)):
        t, _ = students.consistency_pair(GAUSS_SCHED, 3, 4000, 'cpu', torch.Generator().manual_seed(1), mean, std)
        q1, median, q3 = levels[t].quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
        assert abs(median - mean) < 0.1 * std and abs((q3 - q1) / 1.349 - std) < 0.1 * std, (mean, std)
    drawn, pair = [], students.consistency_pair

    def spy(*args):
        drawn.append(args[5:])
        return pair(*args)
    monkeypatch.setattr(students, 'consistency_pair', spy)
    assert distill.cli(consistency_args(teachers['uncond'], tmp_path / 'run', '--stages', '1', '--steps-per-stage',
                                        '2', '--level-mean', '1.5', '--level-std', '0.75')) == 0
    assert drawn == [(1.5, 0.75)] * 2
    assert distill.DistillConfig().level_mean == 0.0  # measured better than ECT's -1.1 on digits
    # A run begun before the flags existed (its checkpoint without them) resumes with the levels it drew: ECT's.
    ckpt = load(tmp_path / 'run' / 'distill.pt')
    for name in ('level_mean', 'level_std'):
        del ckpt['distill'][name]
    torch.save(ckpt, tmp_path / 'old.pt')
    cfg, _ = distill.check_settings(distill.DistillConfig(resume=str(tmp_path / 'old.pt')), {'resume'})
    assert (cfg.level_mean, cfg.level_std) == (students.ECT_P_MEAN, students.ECT_P_STD)


def test_each_method_fills_its_measured_defaults_and_a_flag_given_wins(teachers, tmp_path):
    # Progressive: the teacher's lr, no EMA; guided, x students, a first stage of 1,000 steps and 400 after; unguided,
    # v and 1,000 steps a stage. Consistency: v, half the teacher's training images over the stages, a fifth of
    # its lr, an EMA of 0.998.
    teacher = load(teachers['uncond'])
    images = teacher['step'] * teacher['config']['batch_size']
    cfg, _ = distill.check_settings(distill.DistillConfig(ckpt=teachers['uncond'], out_dir=str(tmp_path)), set())
    assert (cfg.prediction, cfg.first_stage_steps, cfg.steps_per_stage, cfg.lr, cfg.ema_decay) == (
        'v', 1000, 1000, teacher['config']['lr'], 0.0)
    for guidance, expected in ((1.5, ('x', 1000, 400)), (1.0, ('v', 1000, 1000))):
        cfg, _ = distill.check_settings(distill.DistillConfig(ckpt=teachers['cond'], guidance=guidance,
                                                              out_dir=str(tmp_path)), set())
        assert (cfg.prediction, cfg.first_stage_steps, cfg.steps_per_stage) == expected, guidance
    cfg, _ = distill.check_settings(distill.DistillConfig(ckpt=teachers['uncond'], method='consistency', stages=2,
                                                          batch_size=4, out_dir=str(tmp_path)), set())
    assert (cfg.prediction, cfg.steps_per_stage, cfg.lr, cfg.ema_decay, cfg.first_stage_steps) == (
        'v', max(1, images // (2 * 2 * 4)), teacher['config']['lr'] / 5, 0.998, None)
    cfg, _ = distill.check_settings(distill.DistillConfig(ckpt=teachers['uncond'], method='consistency', lr=1e-3,
                                                          ema_decay=0.0, steps_per_stage=7, prediction='x',
                                                          out_dir=str(tmp_path)), set())
    assert (cfg.prediction, cfg.steps_per_stage, cfg.lr, cfg.ema_decay) == ('x', 7, 1e-3, 0.0)


def test_resume_is_exact_within_a_stage_and_across_its_end(teachers, tuned, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, 'distill_step', sigterm_after_steps(distill.distill_step, {2, 3}))
    out = tmp_path / 'split'
    assert distill.cli(consistency_args(teachers['uncond'], out)) == 0  # a stop saves and exits 0
    assert load(out / 'distill.pt')['step'] == 2 and not (out / 'consistency-1.pt').exists()
    assert distill.cli(['--resume', str(out / 'distill.pt')]) == 0
    assert load(out / 'distill.pt')['step'] == 3 and (out / 'consistency-2.pt').exists()
    assert distill.cli(['--resume', 'auto', '--out-dir', str(out)]) == 0
    for name in ('consistency-1.pt', 'consistency-2.pt', 'distill.pt'):
        a, b = load(tuned / name), load(out / name)
        assert a['step'] == b['step'] == 6 and a['student'] == b['student']
        for key in ('model', 'ema'):
            assert all(torch.equal(tensor, b[key][n]) for n, tensor in a[key].items()), (name, key)
    a, b = load(tuned / 'distill.pt')['optimizer']['state'], load(out / 'distill.pt')['optimizer']['state']
    assert all(torch.equal(a[i]['exp_avg_sq'], b[i]['exp_avg_sq']) for i in a)
    assert [row['step'] for row in rows(out) if row.get('kind') == 'train'] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize('case', ['stages', 'down-to', 'first-stage', 'mid', 'guided-data', 'progressive-flag',
                                  'dropout'])
def test_a_bad_flag_is_one_line_and_writes_nothing(case, teachers, tmp_path, capsys):
    out = tmp_path / 'out'
    args, says = {
        'stages': (consistency_args(teachers['uncond'], out, '--stages', '0'), '--stages'),
        'down-to': (consistency_args(teachers['uncond'], out, '--down-to', '2'), 'a flag of --method progressive'),
        'first-stage': (consistency_args(teachers['uncond'], out, '--first-stage-steps', '5'),
                        'a flag of --method progressive'),
        'mid': (consistency_args(teachers['uncond'], out, '--mid-timestep', '999'), '--mid-timestep'),
        'guided-data': (consistency_args(teachers['cond'], out, '--guidance', '2', '--ode-step', 'data'),
                        'consistency training learns the data'),
        'progressive-flag': (['--ckpt', teachers['uncond'], '--stages', '2', '--out-dir', str(out)],
                             'a flag of --method consistency'),
        'dropout': (consistency_args(teachers['uncond'], out, '--dropout', '1'), '--dropout'),
    }[case]
    assert distill.cli(args) == 2 and says in one_error(capsys)
    assert not out.exists()


def test_a_guided_teacher_is_distilled_through_its_ddim_step_and_the_student_draws_in_one_pass(teachers, tmp_path,
                                                                                              monkeypatch):
    calls = spy_on_unet(monkeypatch, lambda x, t, labels: (len(x), torch.is_grad_enabled(),
                                                          None if labels is None else 10 in labels.tolist()))
    out = tmp_path / 'guided'
    assert distill.cli(consistency_args(teachers['cond'], out, '--guidance', '1.5', '--stages', '2',
                                        '--steps-per-stage', '1')) == 0
    # per step (stage 0, then 1: the teacher stays the trained model): the guided teacher's step (both halves
    # batched, 16, the null label among them), then the student with the gradient and again without it (8 each,
    # told the label)
    assert calls == [(16, False, True), (8, True, False), (8, False, False)] * 2
    record = load(out / 'consistency-1.pt')['student']
    assert record['ode_step'] == 'teacher' and record['guidance'] == 1.5
    calls.clear()
    assert sample.cli(['--ckpt', str(out / 'consistency-2.pt'), '--num', '4', '--label', '3', '--device', 'cpu',
                       '--out', str(tmp_path / 'drawn')]) == 0
    assert [n for n, _, _ in calls] == [4, 4]  # two calls, one pass each


# ----------------------------------------------------------------------------- sample.py

def test_sample_draws_a_consistency_student_with_its_own_calls(tuned, tmp_path, monkeypatch):
    seen = spy_on_unet(monkeypatch, lambda x, t, labels: sorted(set(t.tolist())))
    common = ['--num', '3', '--batch-size', '2', '--device', 'cpu']
    assert sample.cli(['--ckpt', str(tuned / 'consistency-2.pt'), '--out', str(tmp_path / 'two')] + common) == 0
    assert seen == [[999], [400]] * 2
    assert json.loads((tmp_path / 'two' / 'samples.json').read_text())['sampler'] == 'consistency'
    seen.clear()
    assert sample.cli(['--ckpt', str(tuned / 'consistency-2.pt'), '--out', str(tmp_path / 'moved'),
                       '--mid-timestep', '500'] + common) == 0
    assert seen == [[999], [500]] * 2
    seen.clear()
    assert sample.cli(['--ckpt', str(tuned / 'consistency-1.pt'), '--out', str(tmp_path / 'one')] + common) == 0
    assert seen == [[999]] * 2


@pytest.mark.parametrize('student,flags,says', [
    ('consistency-1.pt', ['--steps', '2'], '1-call consistency student'),
    ('consistency-1.pt', ['--mid-timestep', '100'], 'only a 2-call consistency student'),
    ('consistency-2.pt', ['--sampler', 'ddim'], 'consistency sampling'),
    ('consistency-2.pt', ['--export-diffusers', 'x'], 'not DDIM'),
    ('consistency-2.pt', ['--bpd'], 'few-step sampler')])
def test_sample_refuses_what_a_consistency_student_cannot_do(tuned, tmp_path, capsys, student, flags, says):
    args = ['--ckpt', str(tuned / student), '--num', '2', '--device', 'cpu', '--out', str(tmp_path / 's')]
    assert sample.cli(args + flags) == 2
    assert says in one_error(capsys) and not (tmp_path / 's').exists()


def test_sample_refuses_a_mid_timestep_for_a_trained_model(teachers, tmp_path, capsys):
    assert sample.cli(['--ckpt', teachers['uncond'], '--num', '2', '--device', 'cpu', '--mid-timestep', '100',
                       '--out', str(tmp_path / 's')]) == 2
    assert 'not a consistency student' in one_error(capsys)


# ----------------------------------------------------------------------------- scripts/few_step_study.py

def test_the_study_scores_consistency_students_beside_progressive_ones_and_sweeps_the_mid_timestep(
        teachers, tuned, tmp_path, monkeypatch):
    import few_step_study
    from test_distill import StandInJudge
    monkeypatch.setattr(few_step_study.evaluation, 'DigitsJudge', StandInJudge)
    progressive = tmp_path / 'progressive'
    assert distill.cli(['--ckpt', teachers['uncond'], '--teacher-steps', '2', '--steps-per-stage', '1',
                        '--first-stage-steps', '1',
                        '--batch-size', '8', '--num-workers', '0', '--device', 'cpu', '--out-dir',
                        str(progressive)]) == 0
    seen = spy_on_unet(monkeypatch, lambda x, t, labels: sorted(set(t.tolist())))
    assert few_step_study.main([
        '--teacher', teachers['uncond'], '--students', f'{progressive},{tuned}', '--calls', '1', '--seeds', '0',
        '--num', '4', '--batch-size', '4', '--solvers', 'ddim-trailing', '--no-ddpm', '--no-speed',
        '--mid-timesteps', '100,600', '--device', 'cpu', '--out-dir', str(tmp_path / 'r')]) == 0
    rows = json.load(open(tmp_path / 'r' / 'cpu-digits-few-step.json'))['scores']['unconditional']
    assert [(r['model'], r['sampler'], r['calls']) for r in rows] == [
        ('teacher', 'ddim-trailing', 1), ('student-1', 'student', 1), ('consistency-2@100', 'consistency', 2),
        ('consistency-2@600', 'consistency', 2), ('consistency-1', 'consistency', 1)]
    assert seen[-5:] == [[999], [100], [999], [600], [999]]  # each row its own second timestep
    assert few_step_study.main(['--teacher', teachers['uncond'], '--students', str(tuned), '--mid-timesteps', '999',
                                '--device', 'cpu', '--out-dir', str(tmp_path / 'bad')]) == 2

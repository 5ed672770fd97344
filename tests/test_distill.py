"""distill.py and its maths (diffusion.py's few-step section): the distillation target against the
teacher's two DDIM steps, a perfect teacher on Gaussian data against the exact probability-flow map,
the grid, exact resume across a stage's end, the refusals, and sample.py drawing a student."""
import os

import pytest
import torch
from helpers import MU, S, exact_eps, exact_map, sigterm_after_steps, signal_on_call, train_args

import diffusion
import distill
import model
import sample
import students
import train

SCHED = diffusion.make_schedule(1000)


def distill_args(teacher, out, *extra):
    """Two stages of three steps (a teacher of 4 steps, students of 2 and 1), batch 8, 8x8 digits; every stage
    of --steps-per-stage steps unless --first-stage-steps is given."""
    steps = extra[extra.index('--steps-per-stage') + 1] if '--steps-per-stage' in extra else '3'
    first = [] if '--first-stage-steps' in extra else ['--first-stage-steps', steps]
    return ['--ckpt', teacher, '--teacher-steps', '4', '--steps-per-stage', '3', '--batch-size', '8',
            '--num-workers', '0', '--log-every', '1', '--device', 'cpu', '--out-dir', str(out), *first, *extra]


@pytest.fixture(scope='module')
def whole(teachers, tmp_path_factory):
    """An uninterrupted distillation: OUT/student-2.pt, student-1.pt, distill.pt."""
    out = tmp_path_factory.mktemp('whole') / 'run'
    assert distill.cli(distill_args(teachers['uncond'], out)) == 0
    return out


def load(path):
    return torch.load(path, weights_only=True)


# ----------------------------------------------------------------------------- the maths

def test_the_grid_starts_at_the_last_timestep_ends_clean_and_halves_exactly():
    assert students.student_timesteps(1) == [999, -1]  # a 1-step student starts from pure noise
    assert students.student_timesteps(2) == [999, 499, -1]
    for n in list(range(1, 501)) + [1000]:
        grid = students.student_timesteps(n)
        assert len(grid) == n + 1 and grid[0] == 999 and grid[-1] == -1
        assert all(a > b for a, b in zip(grid, grid[1:]))
        if 2 * n <= 1000:
            assert students.student_timesteps(2 * n)[::2] == grid  # every other teacher point is the student's
    assert students.student_timesteps(1000) == list(range(999, -2, -1))


def test_eps_x_and_v_round_trip():
    g = torch.Generator().manual_seed(0)
    x, eps = torch.randn(64, 3, generator=g, dtype=torch.float64), torch.randn(64, 3, generator=g, dtype=torch.float64)
    t = torch.randint(0, 1000, (64,), generator=g)
    alpha, sigma = students.alpha_sigma(SCHED, t, x)
    assert torch.allclose(alpha ** 2 + sigma ** 2, torch.ones_like(alpha), atol=1e-14)
    z = alpha * x + sigma * eps
    for prediction in ('eps', 'x', 'v'):
        output = students.output_for(x, eps, alpha, sigma, prediction)
        back_x, back_eps = students.x_and_eps(output, z, alpha, sigma, prediction)
        assert torch.allclose(back_x, x, atol=1e-9, rtol=0) and torch.allclose(back_eps, eps, atol=1e-9, rtol=0)
        assert torch.allclose(students.output_for(back_x, back_eps, alpha, sigma, prediction), output, atol=1e-9)
    v = students.output_for(x, eps, alpha, sigma, 'v')  # the house's own v reads the same
    assert torch.allclose(diffusion.eps_and_x0(v, z, alpha, sigma, 'v')[1], x, atol=1e-12)
    assert torch.allclose(diffusion.prediction_target(SCHED, x, t, eps, 'v'), v, atol=1e-12)


def nonlinear_teacher(z, t):
    """A fixed, smooth stand-in for a trained eps network."""
    return torch.tanh(1.3 * z + 0.001 * t.view(-1, *[1] * (z.dim() - 1))) + 0.1 * z.flip(-1)


@pytest.mark.parametrize('steps', [1, 2, 4, 64])
def test_one_student_step_driven_by_the_target_lands_where_the_teacher_lands(steps):
    g = torch.Generator().manual_seed(steps)
    z = torch.randn(200, 5, generator=g, dtype=torch.float64)
    grid = torch.tensor(students.student_timesteps(2 * steps))
    k = torch.randint(0, steps, (200,), generator=g)
    t, t_mid, t_to = grid[2 * k], grid[2 * k + 1], grid[2 * k + 2]
    z_teacher = distill.teacher_two_steps(nonlinear_teacher, SCHED, z, t, t_mid, t_to, 'eps')
    alpha, sigma = students.alpha_sigma(SCHED, t, z)
    alpha_to, sigma_to = students.alpha_sigma(SCHED, t_to, z)
    target = students.distillation_target(z, z_teacher, alpha, sigma, alpha_to, sigma_to)
    x, eps = students.x_and_eps(target, z, alpha, sigma, 'x')  # a student that predicts x~
    landed = students.ddim_to(x, eps, alpha_to, sigma_to)
    assert (landed - z_teacher).abs().max() < 1e-10
    clean = t_to == -1  # the step to the clean endpoint: x~ is the teacher's x prediction at its second step
    alpha_mid, sigma_mid = students.alpha_sigma(SCHED, t_mid, z)
    z_mid = students.ddim_to(*students.x_and_eps(nonlinear_teacher(z, t), z, alpha, sigma, 'eps'), alpha_mid,
                              sigma_mid)
    x_mid, _ = students.x_and_eps(nonlinear_teacher(z_mid, t_mid), z_mid, alpha_mid, sigma_mid, 'eps')
    assert clean.any() and torch.equal(target[clean], x_mid[clean])


def test_the_loss_weighs_the_x_error_by_the_truncated_snr():
    g = torch.Generator().manual_seed(3)
    x0, noise = (torch.randn(300, 4, generator=g, dtype=torch.float64) for _ in range(2))
    k = torch.randint(0, 8, (300,), generator=g)
    grid = torch.tensor(students.student_timesteps(16))
    t, t_to = grid[2 * k], grid[2 * k + 2]
    alpha, sigma = students.alpha_sigma(SCHED, t, x0)
    z = alpha * x0 + sigma * noise
    z_teacher = distill.teacher_two_steps(nonlinear_teacher, SCHED, z, t, grid[2 * k + 1], t_to, 'eps')
    target = students.distillation_target(z, z_teacher, alpha, sigma, *students.alpha_sigma(SCHED, t_to, z))
    off_by = 0.1 * torch.randn(300, 4, generator=g, dtype=torch.float64)
    for prediction in ('x', 'v'):  # a student whose x misses x~ by off_by, in either parameterisation
        output = students.output_for(target + off_by, students.x_and_eps(target + off_by, z, alpha, sigma, 'x')[1],
                                      alpha, sigma, prediction)
        loss = distill.distillation_loss(lambda z_, t_: output, nonlinear_teacher, SCHED, x0, 8, prediction, 'eps',
                                           k=k, noise=noise, per_example=True)
        snr = (alpha / sigma).square().flatten()
        expected = torch.maximum(snr, torch.ones_like(snr)) * off_by.square().mean(1)
        assert torch.allclose(loss, expected, rtol=1e-8, atol=0)
    assert (snr > 1).any() and (snr < 1).any()  # both sides of the truncation were weighed


def test_training_and_sampling_call_the_student_on_one_grid(monkeypatch):
    for steps in (1, 2, 8):
        seen = {'train': set(), 'sample': [], 'teacher': set()}

        def student(z, t, into='train'):
            (seen[into].update if into == 'train' else seen[into].extend)(t.tolist())
            return torch.zeros_like(z)

        def teacher(z, t):
            seen['teacher'].update(t.tolist())
            return torch.zeros_like(z)
        distill.distillation_loss(student, teacher, SCHED, torch.zeros(400, 1), steps)
        students.student_sample(lambda z, t: student(z, t, 'sample'), SCHED, (1, 1), steps)
        grid = students.student_timesteps(steps)
        assert seen['sample'] == grid[:-1] and seen['train'] == set(grid[:-1])
        assert seen['teacher'] == set(students.student_timesteps(2 * steps)[:-1])
    assert seen['sample'] == [999, 874, 749, 624, 499, 374, 249, 124]
    # One function: another grid moves training and sampling together.
    monkeypatch.setattr(students, 'student_timesteps', lambda n, num_steps=1000: [999 - 600 // n * i for i in range(n)]
                        + [-1])
    seen = {'train': set(), 'sample': [], 'teacher': set()}
    distill.distillation_loss(student, teacher, SCHED, torch.zeros(400, 1), 2)
    students.student_sample(lambda z, t: student(z, t, 'sample'), SCHED, (1, 1), 2)
    assert seen['sample'] == [999, 699] and seen['train'] == {999, 699}


# ----------------------------------------------------------------------------- a perfect teacher on Gaussian data

def rms(a, b):
    return (a - b).square().mean().sqrt().item()


def test_ddim_with_the_exact_denoiser_converges_to_the_exact_map():
    z = torch.randn(2000, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = exact_map(z, torch.full((2000,), 999), torch.full((2000,), -1)).clamp(-1, 1)  # as the sampler returns
    errors = [rms(students.student_sample(exact_eps, SCHED, z.shape, n, prediction='eps', x=z.clone(),
                                           dtype=torch.float64), exact) for n in (2, 8, 32, 128, 512)]
    ratios = [b / a for a, b in zip(errors, errors[1:])]
    assert max(ratios) < 0.5 and max(ratios[1:]) < 0.3, errors  # first order: a quarter per 4x the steps
    assert errors[-1] < 4e-3, errors


def test_the_exact_map_has_a_vanishing_distillation_loss_and_a_wrong_one_does_not():
    g = torch.Generator().manual_seed(1)
    losses, wrong = {}, {}
    for steps in (16, 64, 256):
        grid = torch.tensor(students.student_timesteps(steps))

        def student_of(scale):  # predicts the x~ of the exact map of data scaled by `scale`
            def student(z, t):
                t_to = grid[(grid[:-1, None] == t).double().argmax(0) + 1]
                alpha, sigma = students.alpha_sigma(SCHED, t, z)
                alpha_to, sigma_to = students.alpha_sigma(SCHED, t_to, z)
                landed = exact_map(z, t, t_to, scale)
                return students.distillation_target(z, landed, alpha, sigma, alpha_to, sigma_to)
            return student
        x0 = MU + S * torch.randn(4000, 2, generator=g, dtype=torch.float64)
        noise, k = torch.randn(4000, 2, generator=g, dtype=torch.float64), torch.randint(0, steps, (4000,), generator=g)
        common = dict(prediction='x', teacher_prediction='eps', k=k, noise=noise)
        losses[steps] = distill.distillation_loss(student_of(1.0), exact_eps, SCHED, x0, steps, **common).item()
        wrong[steps] = distill.distillation_loss(student_of(1.5), exact_eps, SCHED, x0, steps, **common).item()
    # The teacher's two steps tend to the ODE at second order: the exact map's loss falls as steps^-2.
    assert losses[64] < losses[16] / 8 and losses[256] < losses[64] / 8 and losses[256] < 1e-5, losses
    assert min(wrong.values()) > 0.5 * max(wrong.values()) and wrong[256] > 1e3 * losses[256], (losses, wrong)


class TinyStudent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64), torch.nn.SiLU(),
                                     torch.nn.Linear(64, 2))

    def forward(self, z, t):
        return self.f(torch.cat([z, t[:, None].float() / 1000], 1))


def test_a_tiny_network_distilled_progressively_approaches_the_exact_map():
    """Salimans & Ho's procedure on Gaussian data: the exact denoiser's DDIM-32 is the first teacher, each
    student (v) teaches the next, down to one step; the 1-step student lands near the exact ODE map, where
    the denoiser's own DDIM-1 is far from it."""
    torch.manual_seed(0)
    z = torch.randn(2000, 2)
    exact = exact_map(z, torch.full((2000,), 999), torch.full((2000,), -1)).float().clamp(-1, 1)
    ddim = {n: rms(students.student_sample(exact_eps, SCHED, z.shape, n, prediction='eps', x=z.clone()), exact)
            for n in (1, 32)}
    teacher, teacher_prediction, student, steps = exact_eps, 'eps', TinyStudent(), 16
    while steps >= 1:
        optimizer = torch.optim.Adam(student.parameters(), 3e-3)
        for _ in range(250):
            loss = distill.distillation_loss(student, teacher, SCHED, MU.float() + S.float() * torch.randn(256, 2),
                                               steps, 'v', teacher_prediction)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        landed = students.student_sample(student, SCHED, z.shape, steps, prediction='v', x=z.clone())
        if steps < 16:  # each student lands near where its teacher's two steps per step land (the first learns
            # 16 timesteps from a random start: slower)
            assert rms(landed, students.student_sample(teacher, SCHED, z.shape, 2 * steps, prediction='v',
                                                        x=z.clone())) < 0.015
        teacher, teacher_prediction = model_copy(student), 'v'
        steps //= 2
    assert rms(landed, exact) < ddim[32] + 0.02 and rms(landed, exact) < ddim[1] / 4, (rms(landed, exact), ddim)


def model_copy(net):
    import copy
    return copy.deepcopy(net).requires_grad_(False)


# ----------------------------------------------------------------------------- distill.py

def test_resume_is_exact_within_a_stage_and_across_its_end(teachers, whole, tmp_path, monkeypatch):
    # stage 0 has steps 1-3: a stop mid-stage, then at its end
    monkeypatch.setattr(distill, 'distill_step', sigterm_after_steps(distill.distill_step, {2, 3}))
    out = tmp_path / 'split'
    assert distill.cli(distill_args(teachers['uncond'], out)) == 0
    assert load(out / 'distill.pt')['step'] == 2 and not (out / 'student-2.pt').exists()
    assert distill.cli(['--resume', str(out / 'distill.pt')]) == 0
    assert load(out / 'distill.pt')['step'] == 3 and (out / 'student-2.pt').exists()
    assert distill.cli(['--resume', 'auto', '--out-dir', str(out)]) == 0
    for name in ('student-2.pt', 'student-1.pt', 'distill.pt'):
        a, b = load(whole / name), load(out / name)
        assert a['step'] == b['step'] and a['student'] == b['student']
        for key in ('model', 'ema') + (('teacher',) if name == 'distill.pt' else ()):
            for tensor_name, tensor in a[key].items():
                assert torch.equal(tensor, b[key][tensor_name]), (name, key, tensor_name)
    a, b = load(whole / 'distill.pt')['optimizer']['state'], load(out / 'distill.pt')['optimizer']['state']
    assert all(torch.equal(a[i]['exp_avg_sq'], b[i]['exp_avg_sq']) for i in a)
    assert all(state['step'] == 3 for state in a.values())  # reset at the stage's start: 3 steps, not 6
    steps = [[row['step'] for row in map(eval_json, open(folder / 'metrics.jsonl')) if row.get('kind') == 'train']
             for folder in (whole, out)]
    assert steps[0] == steps[1] == [1, 2, 3, 4, 5, 6]  # each step logged once
    # The stages did what they name: the 1-step student left its teacher (the 2-step one).
    student_1, student_2 = load(whole / 'student-1.pt'), load(whole / 'student-2.pt')
    assert student_1['student']['steps'] == 1 and student_2['student']['timesteps'] == [999, 499, -1]
    assert torch.equal(load(whole / 'distill.pt')['teacher']['conv_out.weight'], student_2['ema']['conv_out.weight'])
    assert not torch.equal(student_1['ema']['conv_out.weight'], student_2['ema']['conv_out.weight'])


@pytest.mark.parametrize('where', ['loss', 'weights'])
def test_a_non_finite_loss_or_weight_stops_with_the_last_good_checkpoint_kept(where, teachers, tmp_path, monkeypatch,
                                                                             capsys):
    # Checkpoints every 2 steps; step 3 turns the loss NaN (or, with a finite loss, the student's weights):
    # exit 3, naming the checkpoint of step 2, which stays as it was; nothing of step 3 or later is written.
    step_once = distill.distill_step

    def breaks_at_step_3(d, batch, step):
        loss = step_once(d, batch, step)
        if step + 1 == 3:
            if where == 'loss':
                return loss * float('nan')
            with torch.no_grad():
                next(d.student.parameters()).fill_(float('inf'))
        return loss
    monkeypatch.setattr(distill, 'distill_step', breaks_at_step_3)
    out = tmp_path / 'broken'
    assert distill.cli(distill_args(teachers['uncond'], out, '--ckpt-every', '2')) == 3
    message = capsys.readouterr().err
    assert ('the loss became nan between steps 3 and 3' if where == 'loss' else "weights became non-finite at step 3") \
        in message and f"{out / 'distill.pt'} (step 2)" in message
    kept = load(out / 'distill.pt')
    assert kept['step'] == 2 and all(t.isfinite().all() for t in kept['model'].values())
    assert not (out / 'student-2.pt').exists()  # the stage's end (step 3) was never reached


def eval_json(line):
    import json
    return json.loads(line)


def one_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: '), lines
    return lines[0]


@pytest.mark.parametrize('case', ['junk', 'missing', 'folder', 'halving', 'down-to', 'guidance', 'student',
                                  'resume-student', 'resume-teacher', 'range', 'prediction-eps', 'batch'])
def test_a_bad_flag_is_one_line_and_writes_nothing(case, teachers, whole, tmp_path, capsys):
    junk = tmp_path / 'junk.pt'
    junk.write_text('not a checkpoint')
    teacher, out = teachers['uncond'], tmp_path / 'out'
    args, says = {
        'junk': (distill_args(str(junk), out), 'not a train.py checkpoint'),
        'missing': (distill_args(str(tmp_path / 'none.pt'), out), 'no such checkpoint'),
        'folder': (distill_args(str(tmp_path), out), 'must be a train.py checkpoint'),
        'halving': (distill_args(teacher, out, '--teacher-steps', '48'), 'does not halve'),
        'down-to': (distill_args(teacher, out, '--down-to', '4'), 'does not halve'),
        'guidance': (distill_args(teacher, out, '--guidance', '1.5'), 'unconditional'),
        'student': (distill_args(str(whole / 'student-1.pt'), out), 'student of distill.py'),
        'resume-student': (['--resume', str(whole / 'student-2.pt'), '--out-dir', str(out)], 'not a distill.py run'),
        'resume-teacher': (['--resume', teacher, '--out-dir', str(out)], 'not a distill.py run'),
        'range': (distill_args(teacher, out, '--teacher-steps', '2048'), 'teacher-steps'),
        'prediction-eps': (distill_args(teacher, out, '--prediction', 'eps'), 'prediction'),
        'batch': (distill_args(teacher, out, '--batch-size', '5000'), '--batch-size 5000 is larger than the data set'),
    }[case]
    code = distill.cli(args) if case != 'prediction-eps' else pytest.raises(SystemExit, distill.cli, args).value.code
    assert code == 2 and says in one_error(capsys)
    assert not out.exists()


def test_a_changed_setting_on_resume_is_refused_and_a_student_is_refused_by_train_py(whole, tmp_path, capsys):
    before = sorted(os.listdir(whole)), os.path.getmtime(whole / 'distill.pt')
    assert distill.cli(['--resume', str(whole / 'distill.pt'), '--prediction', 'x']) == 2
    assert 'an exact resume needs the same value' in one_error(capsys)
    for path in (whole / 'student-1.pt', whole / 'distill.pt'):
        assert train.cli(['--resume', str(path), '--steps', '4']) == 2
        assert 'student of distill.py' in one_error(capsys)
        assert train.cli(train_args(tmp_path, '--init-from', str(path), '--steps', '1')) == 2
        assert 'student of distill.py' in one_error(capsys)
    assert (sorted(os.listdir(whole)), os.path.getmtime(whole / 'distill.pt')) == before
    assert not (tmp_path / 'run').exists()
    os.chdir(os.path.dirname(whole))  # the same teacher by another spelling is the same teacher
    try:
        relative = os.path.relpath(load(whole / 'distill.pt')['distill']['ckpt'])
        assert not os.path.isabs(relative)
        rows = (whole / 'metrics.jsonl').read_text()
        assert distill.cli(['--resume', 'auto', '--out-dir', str(whole), '--ckpt', relative]) == 0
        assert (whole / 'metrics.jsonl').read_text() == rows  # a finished run adds no rows
        assert 'finished already' in capsys.readouterr().out
        assert distill.cli(['--resume', 'auto', '--out-dir', str(whole), '--ckpt', str(whole / 'student-1.pt')]) == 2
        assert 'an exact resume needs the same value' in one_error(capsys)
    finally:
        os.chdir(os.path.dirname(os.path.dirname(__file__)))


def test_a_guided_teacher_runs_both_halves_and_its_student_one_pass(teachers, tmp_path, monkeypatch):
    calls, forward = [], model.UNet.forward

    def spy(self, x, t, labels=None):
        calls.append((len(x), None if labels is None else sorted(set(labels.tolist()))))
        return forward(self, x, t, labels)
    monkeypatch.setattr(model.UNet, 'forward', spy)
    out = tmp_path / 'guided'
    args = distill_args(teachers['cond'], out, '--teacher-steps', '2', '--steps-per-stage', '2', '--guidance', '1.5')
    assert distill.cli(args) == 0
    assert len(calls) == 6  # per step: the teacher twice, both halves batched (16), the student once (8)
    assert [n for n, _ in calls] == [16, 16, 8] * 2
    assert all(10 in labels for n, labels in calls if n == 16) and all(10 not in labels for n, labels in calls
                                                                        if n == 8)
    record = load(out / 'student-1.pt')['student']
    assert record['guidance'] == 1.5 and record['steps'] == 1
    calls.clear()
    assert sample.cli(['--ckpt', str(out / 'student-1.pt'), '--num', '4', '--label', '3', '--device', 'cpu',
                       '--out', str(tmp_path / 'drawn')]) == 0
    assert calls == [(4, [3])]  # one pass, at t = T-1, told the label
    assert eval_json(open(tmp_path / 'drawn' / 'samples.json').read())['guidance'] == 1.5  # the scale it learnt


def test_a_later_stages_teacher_is_the_last_student_read_as_students_are(teachers, tmp_path, monkeypatch):
    # Stage 0's teacher is the trained model: its own prediction (eps), guided in two halves. From stage 1
    # on, the teacher is the last student: its output read as it predicts (--prediction), one pass told the label
    # (it learnt the guided output; guiding it again would guide twice).
    read_as, loss = [], distill.distillation_loss

    def spy(student, teacher, sched, x0, steps, prediction='v', teacher_prediction='eps', **kwargs):
        read_as.append((steps, teacher_prediction))
        return loss(student, teacher, sched, x0, steps, prediction, teacher_prediction, **kwargs)
    monkeypatch.setattr(distill, 'distillation_loss', spy)
    assert distill.cli(distill_args(teachers['uncond'], tmp_path / 'plain', '--steps-per-stage', '2')) == 0
    assert read_as == [(2, 'eps'), (2, 'eps'), (1, 'v'), (1, 'v')]  # v: the unguided default
    read_as.clear()
    assert distill.cli(distill_args(teachers['uncond'], tmp_path / 'as-x', '--steps-per-stage', '1',
                                    '--prediction', 'x')) == 0
    assert read_as == [(2, 'eps'), (1, 'x')]
    calls, forward = [], model.UNet.forward

    def count(self, x, t, labels=None):
        calls.append(len(x))
        return forward(self, x, t, labels)
    monkeypatch.setattr(model.UNet, 'forward', count)
    assert distill.cli(distill_args(teachers['cond'], tmp_path / 'guided', '--steps-per-stage', '1',
                                    '--guidance', '1.5')) == 0
    assert calls == [16, 16, 8, 8, 8, 8]  # stage 0: the teacher's two halves twice, the student; stage 1: one pass each


# ----------------------------------------------------------------------------- sample.py

def test_sample_draws_a_student_on_its_grid_and_continues(whole, tmp_path, monkeypatch):
    seen, forward = [], model.UNet.forward

    def spy(self, x, t, labels=None):
        seen.append(sorted(set(t.tolist())))
        return forward(self, x, t, labels)
    monkeypatch.setattr(model.UNet, 'forward', spy)
    common = ['--ckpt', str(whole / 'student-2.pt'), '--num', '5', '--batch-size', '2', '--device', 'cpu']
    result = sample.main(sample.parse_config(common + ['--out', str(tmp_path / 'png')], sample.SampleConfig))
    assert result['images'] == 5 and seen == [[999], [499]] * 3
    assert eval_json(open(tmp_path / 'png' / 'samples.json').read())['sampler'] == 'student'
    seen.clear()
    assert sample.cli(common + ['--out', str(tmp_path / 'png')]) == 0 and seen == []  # all drawn: nothing to do
    assert sample.cli(common + ['--out', str(tmp_path / 'npz'), '--format', 'npz']) == 0
    assert sample.cli(['--ckpt', str(whole / 'student-1.pt'), '--num', '4', '--grid', '--device', 'cpu',
                       '--out', str(tmp_path / 'grid')]) == 0
    assert seen[-1] == [999]


@pytest.mark.parametrize('flags', [['--steps', '4'], ['--sampler', 'dpm++'], ['--sampler', 'ddim', '--steps', '2'],
                                   ['--eta', '0.5'], ['--bpd']])
def test_sample_refuses_another_sampler_for_a_student(whole, tmp_path, capsys, flags):
    args = ['--ckpt', str(whole / 'student-2.pt'), '--num', '2', '--device', 'cpu', '--out', str(tmp_path / 's')]
    assert sample.cli(args + flags) == 2
    assert 'student of distill.py' in one_error(capsys) and not (tmp_path / 's').exists()


# ----------------------------------------------------------------------------- scripts/few_step_study.py

class StandInJudge:
    """The digits judge's interface without its classifier (trained in seconds, but not in this test)."""
    floor = {'digits_class_fd': 7.0}

    def __init__(self, image_size, cache_dir):
        pass

    def features(self, images):
        return images.float().mean((1, 2, 3)).numpy()

    def score(self, features):
        return {'digits_class_fd': float(features.mean())}

    def conditioning(self, images, asked):
        return {'accuracy': 0.5}

    def memorisation(self, images):
        return {'digits_near_copies': 0.0, 'digits_nn_ratio': 1.0}


def test_the_study_writes_its_rows_and_keeps_them_at_a_stop(teachers, whole, tmp_path, monkeypatch):
    import json

    import few_step_study
    monkeypatch.setattr(few_step_study.evaluation, 'DigitsJudge', StandInJudge)
    args = ['--teacher', teachers['uncond'], '--students', str(whole), '--calls', '1,2', '--seeds', '0,1', '--num', '4',
            '--solvers', 'ddim-trailing,dpm++-logsnr,diffusers-unipc',
            '--batch-size', '4', '--no-ddpm', '--speed-batch', '2', '--speed-repeats', '1', '--latency-images', '2',
            '--device', 'cpu',
            '--out-dir', str(tmp_path / 'r'), '--picture', str(tmp_path / 'p.png')]
    assert few_step_study.main(args) == 0
    result = json.load(open(tmp_path / 'r' / 'cpu-digits-few-step.json'))
    rows = result['scores']['unconditional']
    assert [(r['model'], r['sampler'], r['calls']) for r in rows if r['seed'] == 0] == [
        ('teacher', 'ddim-trailing', 1), ('teacher', 'ddim-trailing', 2), ('teacher', 'dpm++-logsnr', 1),
        ('teacher', 'dpm++-logsnr', 2), ('teacher', 'diffusers-unipc', 1), ('teacher', 'diffusers-unipc', 2),
        ('student-2', 'student', 2), ('student-1', 'student', 1)]
    assert len(rows) == 16 and all(s['seeds'] == 2 for s in result['summary']['unconditional'])
    assert [(r['model'], r['batch']) for r in result['speed']['unconditional']] == [
        ('teacher', 1), ('teacher', 2), ('student-2', 1), ('student-2', 2), ('student-1', 1), ('student-1', 2)]
    assert (tmp_path / 'p.png').exists() and (tmp_path / 'r' / 'cpu-digits-few-step.png').exists()
    monkeypatch.setattr(few_step_study, 'draw', signal_on_call(few_step_study.draw, 3))  # SIGTERM in the third draw
    assert few_step_study.main(args[:-4] + ['--out-dir', str(tmp_path / 's'), '--picture', '']) == 0
    stopped = json.load(open(tmp_path / 's' / 'cpu-digits-few-step.json'))
    assert len(stopped['scores']['unconditional']) == 2 and not stopped['speed']  # the two draws that finished
    assert few_step_study.main(args[:2] + ['--out-dir', str(tmp_path / 'g'), '--calls', '1', '--seeds', '0', '--num',
                                           '4', '--batch-size', '4', '--no-ddpm', '--device', 'cpu']) == 0
    alone = json.load(open(tmp_path / 'g' / 'cpu-digits-few-step.json'))  # no students: every solver, no speed
    assert [r['sampler'] for r in alone['scores']['unconditional']] == list(few_step_study.SOLVERS)
    assert not alone['speed'] and '| solver | 1 calls |' in (tmp_path / 'g' / 'cpu-digits-few-step.md').read_text()


def test_the_studys_quick_form_times_every_repeat_and_draws_the_picture_alone(teachers, whole, tmp_path):
    import json

    import few_step_study
    common = ['--teacher', teachers['uncond'], '--students', str(whole), '--device', 'cpu']
    assert few_step_study.main(common + ['--quick', '--speed-batch', '2', '--speed-repeats', '3', '--latency-images',
                                         '2', '--out-dir', str(tmp_path / 'q')]) == 0
    timed = json.load(open(tmp_path / 'q' / 'cpu-digits-few-step.json'))
    assert not timed['scores'] and [len(r['seconds']) for r in timed['speed']['unconditional']] == [3] * 6
    assert few_step_study.main(common + ['--quick', '--no-speed', '--picture', str(tmp_path / 'p.png'),
                                         '--out-dir', str(tmp_path / 'p')]) == 0
    drawn = json.load(open(tmp_path / 'p' / 'cpu-digits-few-step.json'))
    assert (tmp_path / 'p.png').exists() and not drawn['scores'] and not drawn['speed']


def test_the_studys_timed_runs_take_turns_so_a_drifting_machine_moves_every_row_alike(teachers, whole, tmp_path,
                                                                                       monkeypatch):
    import json

    import few_step_study
    drawn = []

    def recording(model, sched, sampling, device, first, config, prediction):
        drawn.append((sampling.steps, sampling.batch_size))
        return few_step_study.torch.zeros(1)
    monkeypatch.setattr(few_step_study, 'draw_batch', recording)
    assert few_step_study.main(['--teacher', teachers['uncond'], '--students', str(whole), '--device', 'cpu',
                                '--quick', '--speed-batch', '2', '--speed-repeats', '2', '--latency-images', '1',
                                '--out-dir', str(tmp_path / 'q')]) == 0
    rows = [(20, 1), (20, 2), (2, 1), (2, 2), (1, 1), (1, 2)]  # teacher, student-2, student-1; batch 1, then 2
    assert drawn == rows * 3  # a warm-up round, then two timed rounds, each running every row once
    timed = json.load(open(tmp_path / 'q' / 'cpu-digits-few-step.json'))['speed']['unconditional']
    assert [(r['calls'], r['batch'], len(r['seconds'])) for r in timed] == [row + (2,) for row in rows]
    assert [r['sampler'] for r in timed] == ['dpm++'] * 2 + ['student'] * 4
    report = (tmp_path / 'q' / 'cpu-digits-few-step.md').read_text()  # each row over the teacher's at its batch
    teacher_2 = next(r for r in timed if r['model'] == 'teacher' and r['batch'] == 2)
    student_2 = next(r for r in timed if r['model'] == 'student-1' and r['batch'] == 2)
    assert f"| {student_2['img_per_s']:.1f} | {student_2['img_per_s'] / teacher_2['img_per_s']:.1f}x |" in report
    assert f"| {teacher_2['img_per_s']:.1f} |  |" in report and 'img/s alone' in report
    assert few_step_study.main(['--teacher', teachers['uncond'], '--quick', '--compile-mode', 'reduce-overhead',
                                '--device', 'cpu', '--out-dir', str(tmp_path / 'bad')]) == 2  # without --compile
    for bad in ('4,0', '4,4', '1001'):  # the last one past the teacher's 1000 timesteps, known once it is loaded
        assert few_step_study.main(['--teacher', teachers['uncond'], '--quick', '--speed-calls', bad, '--device',
                                    'cpu', '--out-dir', str(tmp_path / 'bad')]) == 2 and not (tmp_path / 'bad').exists()
    # A stop in the third round (the second timed one) keeps every row with the one round that finished.
    monkeypatch.setattr(few_step_study, 'draw_batch', signal_on_call(recording, 2 * len(rows) + 2))
    assert few_step_study.main(['--teacher', teachers['uncond'], '--students', str(whole), '--device', 'cpu',
                                '--quick', '--speed-batch', '2', '--speed-repeats', '2', '--latency-images', '1',
                                '--out-dir', str(tmp_path / 's')]) == 0
    stopped = json.load(open(tmp_path / 's' / 'cpu-digits-few-step.json'))['speed']['unconditional']
    assert [(r['calls'], r['batch'], len(r['seconds'])) for r in stopped] == [row + (1,) for row in rows]


def test_the_gpu_scripts_few_step_part_times_the_carried_teacher_and_students(teachers, whole, tmp_path):
    # bash scripts/measure_gpu.sh fewstep OUT --quick: the GPU part's wiring on the CPU, from a packed folder.
    import json
    import shutil
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    packed = tmp_path / 'packed'
    (packed / 'uncond').mkdir(parents=True)
    shutil.copy(teachers['uncond'], packed / 'teacher-uncond.pt')
    for name in ('student-2.pt', 'student-1.pt'):
        shutil.copy(whole / name, packed / 'uncond' / name)
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'FEW_STEP_DIR': str(packed)}
    run = subprocess.run(['bash', 'scripts/measure_gpu.sh', 'fewstep', str(tmp_path / 'out'), '--quick'], cwd=root,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / 'out' / 'fewstep-default.json').read_text())['speed']['unconditional']
    assert [(r['model'], r['calls'], r['batch']) for r in rows] == [
        (model, calls, batch) for model, calls in (('teacher', 4), ('teacher', 8), ('teacher', 20), ('student-2', 2),
                                                   ('student-1', 1)) for batch in (1, 2)]
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == [
        'fewstep-default.json', 'fewstep-default.md', 'fewstep-environment.txt', 'fewstep.log']
    env['FEW_STEP_DIR'] = str(tmp_path / 'nothing')
    refused = subprocess.run(['bash', 'scripts/measure_gpu.sh', 'fewstep', str(tmp_path / 'out2'), '--quick'],
                             cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and 'lacks teacher-uncond.pt' in refused.stderr
    assert not (tmp_path / 'out2').exists()  # refused before anything is written
    assert 'the guided family is skipped' in (tmp_path / 'out' / 'fewstep.log').read_text()  # no cond/ packed


def teacher_rows(solver, calls, fds):
    return [{'model': 'teacher', 'sampler': solver, 'calls': calls, 'seed': s, 'digits_class_fd': fd,
             'evaluations': calls} for s, fd in enumerate(fds)]


def test_the_study_pairs_each_score_with_the_best_solver_on_the_same_noise():
    import math
    import statistics

    import few_step_study
    rows = teacher_rows('dpm++-trailing', 20, (10.0, 20.0, 40.0)) + teacher_rows('ddim-trailing', 20, (12, 24.5, 48))
    rows += teacher_rows('dpm++-trailing', 1, (100, 200, 400)) + teacher_rows('ddim-leading', 1, (300, 199, 385))
    rows += teacher_rows('dpm++-linspace', 20, (10.3, 20.6, 41.2))  # 3% worse on every seed: within the noise
    rows += [{'model': 'student-1', 'sampler': 'student', 'calls': 1, 'seed': s, 'digits_class_fd': fd,
              'evaluations': 1} for s, fd in ((0, 11.0), (1, 24.0), (2, 40.0))]
    summary = {(s['model'], s['sampler'], s['calls']): s for s in few_step_study.summarise(rows)}
    student = summary['student-1', 'student', 1]
    assert student['best_solver'] == 'dpm++-trailing' and student['best_at_20'] == 'dpm++-trailing'
    logs = [math.log(1.1), math.log(1.2), 0.0]  # each seed against the best's score on that seed, not its mean
    half = 4.302652730 * statistics.stdev(logs) / math.sqrt(3)  # t(0.975), 2 degrees of freedom
    assert student['paired_vs_best20']['ratio'] == pytest.approx(math.exp(statistics.mean(logs)))
    assert student['paired_vs_best20']['low'] == pytest.approx(math.exp(statistics.mean(logs) - half))
    assert student['paired_vs_best20']['high'] == pytest.approx(math.exp(statistics.mean(logs) + half))
    assert student['paired_vs_best']['high'] < 1  # far under the best one-call solver on every seed
    ddim_20, ddim_1 = summary['teacher', 'ddim-trailing', 20], summary['teacher', 'ddim-leading', 1]
    assert ddim_20['paired_vs_best']['low'] > 1 and not ddim_20['not_worse_than_best']  # worse on every seed
    assert ddim_1['paired_vs_best']['low'] < 1 and ddim_1['not_worse_than_best']  # a 3x worse seed is not a decision
    assert summary['teacher', 'dpm++-trailing', 1]['not_worse_than_best'] and student['not_worse_than_best']
    assert summary['teacher', 'dpm++-trailing', 20]['paired_vs_best'] is None  # the best is not paired with itself
    linspace = summary['teacher', 'dpm++-linspace', 20]
    assert linspace['paired_vs_best']['low'] == pytest.approx(1.03) and linspace['not_worse_than_best']


@pytest.fixture(scope='module')
def others(teachers, digits_cache, tmp_path_factory):
    """What the study must refuse beside `teachers`: a second unconditional teacher (seed 1), a
    class-conditional one at 16x16, and guided students (scale 1.5) of teachers['cond']."""
    made = {}
    for name, extra in (('seed1', ('--seed', '1')), ('cond16', ('--class-cond', '--image-size', '16'))):
        tmp = tmp_path_factory.mktemp(name)
        assert train.cli(train_args(tmp, '--dataset', 'digits', '--steps', '1', '--sample-every', '0', '--data-dir',
                                    digits_cache, *(('--image-size', '8') if name == 'seed1' else ()), *extra)) == 0
        made[name] = str(tmp / 'run' / 'ckpt.pt')
    guided = tmp_path_factory.mktemp('guided') / 'run'
    assert distill.cli(distill_args(teachers['cond'], guided, '--teacher-steps', '2', '--steps-per-stage', '1',
                                    '--guidance', '1.5')) == 0
    made['guided'] = str(guided)
    return made


@pytest.mark.parametrize('case', ['another-teacher', 'twice', 'cond-size', 'guidance', 'stem', 'missing', 'solver'])
def test_the_study_refuses_in_one_line_before_any_work(case, teachers, whole, others, tmp_path, capsys, monkeypatch):
    import few_step_study
    monkeypatch.setattr(few_step_study.evaluation, 'DigitsJudge', StandInJudge)
    monkeypatch.setattr(few_step_study, 'draw', lambda *a, **k: pytest.fail('sampled before refusing'))
    student = str(whole / 'student-2.pt')
    flags, says = {
        'another-teacher': (['--teacher', others['seed1'], '--students', str(whole)], 'distilled from another model'),
        'twice': (['--teacher', teachers['uncond'], '--students', f'{student},{student}'], 'are both student-2'),
        'cond-size': (['--teacher', teachers['uncond'], '--cond-teacher', others['cond16'], '--guidance', '1.5'],
                      'one judge scores both'),
        'guidance': (['--teacher', teachers['uncond'], '--cond-teacher', teachers['cond'], '--cond-students',
                      others['guided'], '--guidance', '3'], 'learnt 1.5'),
        'stem': (['--teacher', teachers['uncond'], '--stem', '../escaped'], 'a plain file name'),
        'missing': (['--teacher', str(tmp_path / 'nope.pt')], '--teacher '),
        'solver': (['--teacher', teachers['uncond'], '--solvers', 'dpm++-time'], '--solvers'),
    }[case]
    out = tmp_path / 'out'
    assert few_step_study.main(flags + ['--out-dir', str(out), '--device', 'cpu', '--no-ddpm']) == 2
    assert says in one_error(capsys) and not out.exists()


def test_the_study_writes_under_runs_unless_told_and_labels_a_guided_family(teachers, others, tmp_path, monkeypatch):
    # By default nothing lands in results/ or the README's picture: a short run never replaces evidence.
    import json

    import few_step_study
    monkeypatch.setattr(few_step_study.evaluation, 'DigitsJudge', StandInJudge)
    monkeypatch.chdir(tmp_path)
    assert few_step_study.main(['--teacher', teachers['uncond'], '--cond-teacher', teachers['cond'], '--cond-students',
                                others['guided'], '--calls', '1', '--seeds', '0', '--num', '4', '--batch-size', '4',
                                '--solvers', 'dpm++-trailing', '--no-ddpm', '--no-speed', '--device', 'cpu',
                                '--only', 'guided']) == 0
    assert sorted(p.name for p in (tmp_path / 'runs' / 'few-step').iterdir()) == [
        'cpu-digits-few-step.json', 'cpu-digits-few-step.md', 'cpu-digits-few-step.png']
    assert sorted(p.name for p in tmp_path.iterdir()) == ['runs']
    result = json.load(open(tmp_path / 'runs' / 'few-step' / 'cpu-digits-few-step.json'))
    assert list(result['scores']) == ['guided']  # --only guided: the unconditional teacher sets the size alone
    assert {(r['model'], r['calls'], r['evaluations']) for r in result['scores']['guided']} == {
        ('teacher', 1, 2), ('student-1', 1, 1)}  # the guided teacher runs both halves each call, its student one pass
    assert result['guidance'] == 1.5 and 'guidance 1.5' in (tmp_path / 'runs' / 'few-step' /
                                                             'cpu-digits-few-step.md').read_text()


def test_each_stage_decays_the_learning_rate_linearly_to_zero(teachers, tmp_path, monkeypatch):
    # The paper's schedule, seen by the optimizer itself at each step: --lr at a stage's first step, down by
    # lr / steps_per_stage a step, and again from --lr at the next stage.
    seen, step = [], torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        seen.append(self.param_groups[0]['lr'])
        return step(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.Adam, 'step', spy)
    assert distill.cli(distill_args(teachers['uncond'], tmp_path / 'run', '--steps-per-stage', '4',
                                    '--lr', '0.001')) == 0
    assert seen == pytest.approx([0.001, 0.00075, 0.0005, 0.00025] * 2, rel=1e-12)


def test_a_longer_first_stage_decays_over_its_own_length_and_saves_each_student_at_its_end(teachers, tmp_path,
                                                                                          monkeypatch):
    # --first-stage-steps 5, --steps-per-stage 2, students of 2 and 1 steps: stage 0 is steps 1-5 (lr down by
    # lr/5 a step), stage 1 steps 6-7 (from lr again, down by lr/2), each student saved at its own stage's end.
    assert distill.stage_lengths(distill.DistillConfig(teacher_steps=8, steps_per_stage=3, first_stage_steps=5)) == [
        5, 3, 3]
    cfg = distill.DistillConfig(teacher_steps=8, steps_per_stage=3, first_stage_steps=5)
    assert [distill.stage_at(cfg, step) for step in (0, 4, 5, 7, 8, 10, 11)] == [
        (0, 0), (0, 4), (1, 0), (1, 2), (2, 0), (2, 2), (3, 0)]
    consistency = distill.DistillConfig(method='consistency', stages=3, steps_per_stage=3, first_stage_steps=5)
    assert distill.stage_lengths(consistency) == [3, 3, 3]  # a consistency run's stages are all alike
    seen, step = [], torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        seen.append(self.param_groups[0]['lr'])
        return step(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.Adam, 'step', spy)
    out = tmp_path / 'run'
    assert distill.cli(distill_args(teachers['uncond'], out, '--steps-per-stage', '2', '--first-stage-steps', '5',
                                    '--lr', '0.001')) == 0
    assert seen == pytest.approx([0.001, 0.0008, 0.0006, 0.0004, 0.0002, 0.001, 0.0005], rel=1e-12)
    assert load(out / 'student-2.pt')['step'] == 5 and load(out / 'student-1.pt')['step'] == 7
    rows = [row for row in map(eval_json, open(out / 'metrics.jsonl')) if row.get('kind') in ('train', 'stage')]
    assert [(row['step'], row['stage']) for row in rows if row['kind'] == 'stage'] == [(5, 0), (7, 1)]
    assert [row['stage'] for row in rows if row['kind'] == 'train'] == [0, 0, 0, 0, 0, 1, 1]
    # A stop inside the long first stage resumes exactly: the same students, bit for bit.
    monkeypatch.setattr(distill, 'distill_step', sigterm_after_steps(distill.distill_step, {4}))
    split = tmp_path / 'split'
    assert distill.cli(distill_args(teachers['uncond'], split, '--steps-per-stage', '2', '--first-stage-steps', '5',
                                    '--lr', '0.001')) == 0
    assert load(split / 'distill.pt')['step'] == 4 and not (split / 'student-2.pt').exists()
    assert distill.cli(['--resume', str(split / 'distill.pt')]) == 0
    for name in ('student-2.pt', 'student-1.pt'):
        a, b = load(out / name), load(split / name)
        assert all(torch.equal(tensor, b['ema'][key]) for key, tensor in a['ema'].items()), name

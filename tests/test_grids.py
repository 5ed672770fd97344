"""The few-call samplers' timestep grids and whole samplers against diffusers' own schedulers, driven
by their own set_timesteps and step() on one model and one noise, in float64: DDIM ('leading',
'trailing', 'linspace') against DDIMScheduler, DPM-Solver++ (the same and 'logsnr') against
DPMSolverMultistepScheduler, unguided and guided; and diffusers' solvers as peers (peers.peer_sample)."""
import numpy as np
import pytest
import torch
from helpers import NO_DIFFUSERS

import diffusion
import peers
from diffusion import ddim_sample, ddim_timesteps, dpm_solver_sample, dpm_solver_timesteps, make_betas, make_schedule

CALLS = (1, 2, 3, 4, 5, 8, 20)
SCHED = make_schedule(1000)
SHAPE = (2, 3, 4, 4)


class SmoothCond(torch.nn.Module):
    """A closed-form network of x_t, t and a class (10 is the null class): nonlinear in each, so that
    two implementations of one solver agree only if they call it at the same points."""
    def forward(self, xt, t, labels=None):
        scale = (t.to(xt.dtype) / 1000 + 0.1).view(-1, 1, 1, 1)
        out = torch.tanh(1.5 * xt * scale) + 0.3 * torch.sin(2 * xt + scale)
        if labels is not None:
            out = out + 0.2 * torch.cos(xt * (labels.to(xt.dtype).view(-1, 1, 1, 1) + 1) / 3)
        return out


def model_of(guided: bool):
    if not guided:
        return SmoothCond()
    return diffusion.guided(SmoothCond(), torch.tensor([3, 7]), 2.0, 10)


def noise():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def ours(sampler: str, model, steps: int, spacing: str) -> torch.Tensor:
    return diffusion.run_sampler(sampler, model, SCHED, SHAPE, steps, torch.Generator().manual_seed(0),
                                 spacing=spacing, dtype=torch.float64)


def run_theirs(scheduler, model, monkeypatch) -> torch.Tensor:
    """diffusers' loop, as its pipelines run it, in float64: step() casts to float32 for its own
    arithmetic (an upcast meant for fp16 models), mapped to float64 while it runs."""
    x = noise()
    with monkeypatch.context() as patch:
        patch.setattr(torch, 'float32', torch.float64)
        for t in scheduler.timesteps:
            x = scheduler.step(model(x, t.repeat(SHAPE[0])), t, x).prev_sample
    assert x.dtype == torch.float64
    return x.clamp(-1, 1)


def ddim_scheduler(diffusers, spacing: str):
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4,
                                        beta_end=0.02, clip_sample=False, set_alpha_to_one=True,
                                        timestep_spacing=spacing)
    scheduler.alphas_cumprod = torch.cumprod(1 - torch.from_numpy(make_betas(1000)), 0)  # their tables in float64
    scheduler.final_alpha_cumprod = torch.tensor(1.0, dtype=torch.float64)
    return scheduler


def dpm_scheduler(diffusers, **settings):
    settings = {'solver_order': 2, **settings}
    return diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000, beta_schedule='linear', beta_start=1e-4,
                                                 beta_end=0.02, algorithm_type='dpmsolver++', lower_order_final=True,
                                                 final_sigmas_type='zero', **settings)


def float64_sigmas(scheduler, timesteps: list):
    """Their sigmas (float32) rebuilt in float64 from our tables at the same timesteps, then sigma = 0."""
    abar = SCHED.alphas_cumprod[timesteps]
    scheduler.sigmas = torch.cat([((1 - abar) / abar).sqrt(), torch.zeros(1, dtype=torch.float64)])
    return scheduler


@pytest.mark.parametrize('guided', [False, True])
@pytest.mark.parametrize('spacing', ['leading', 'trailing', 'linspace'])
def test_ddim_grids_are_diffusers(monkeypatch, spacing, guided):
    # Their grid is ours at every count. Their step goes from t to t - T // S: where that is the next
    # point of the grid, their whole sampler is ours; where it is not ('linspace', and 'trailing' at 3
    # calls), ours steps to the next point, which is DPM-Solver++'s first-order step over the same
    # timesteps (diffusers' DPMSolverMultistepScheduler at solver_order 1), and theirs is another path.
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    model = model_of(guided)
    mismatched = 0
    for steps in CALLS:
        theirs = ddim_scheduler(diffusers, spacing)
        theirs.set_timesteps(steps)
        grid = ddim_timesteps(1000, steps, spacing)
        assert theirs.timesteps.tolist() == grid, (spacing, steps)
        x = ours('ddim', model, steps, spacing)
        lands = [t - 1000 // steps for t in grid]  # where their step goes: the next point, or below 0 (the data)
        to_next = lands[:-1] == grid[1:] and lands[-1] < 0
        if to_next:
            assert (x - run_theirs(theirs, model, monkeypatch)).abs().max() < 1e-10, (spacing, steps)
        else:
            mismatched += 1
            first_order = dpm_scheduler(diffusers, solver_order=1)
            first_order.set_timesteps(timesteps=grid)
            float64_sigmas(first_order, grid)
            assert (x - run_theirs(first_order, model, monkeypatch)).abs().max() < 1e-10, (spacing, steps)
            assert (x - run_theirs(theirs, model, monkeypatch)).abs().max() > 1e-4
    assert mismatched == {'leading': 0, 'trailing': 1, 'linspace': len(CALLS) - 1}[spacing]


@pytest.mark.parametrize('guided', [False, True])
@pytest.mark.parametrize('spacing', ['leading', 'trailing', 'linspace'])
def test_dpm_solver_grids_are_diffusers(monkeypatch, spacing, guided):
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    model = model_of(guided)
    for steps in CALLS:
        theirs = dpm_scheduler(diffusers, timestep_spacing=spacing)
        theirs.set_timesteps(steps)
        grid = dpm_solver_timesteps(SCHED, steps, spacing)
        assert theirs.timesteps.tolist() == grid and min(grid) > 0, (spacing, steps)
        x = ours('dpm++', model, steps, spacing)
        assert (x - run_theirs(float64_sigmas(theirs, grid), model, monkeypatch)).abs().max() < 1e-10, (spacing, steps)


@pytest.mark.parametrize('guided', [False, True])
def test_dpm_solver_logsnr_is_diffusers_lu_lambdas_without_the_call_at_zero(monkeypatch, guided):
    # 'logsnr' takes diffusers' use_lu_lambdas levels for S + 1 calls, less the last (lambda_0, t = 0),
    # and steps from the S-th to sigma = 0. diffusers' own S-level grid spends its last call at t = 0.
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    model = model_of(guided)
    for steps in CALLS:
        lu = dpm_scheduler(diffusers, use_lu_lambdas=True)
        lu.set_timesteps(steps + 1)
        grid = dpm_solver_timesteps(SCHED, steps, 'logsnr')
        assert lu.timesteps.tolist()[:-1] == grid and lu.timesteps[-1] == 0 and min(grid) > 0, steps
        own = dpm_scheduler(diffusers, use_lu_lambdas=True)
        own.set_timesteps(steps)
        assert own.timesteps[-1] == (0 if steps > 1 else 999)  # where their grid spends a call
        theirs = dpm_scheduler(diffusers)
        theirs.set_timesteps(timesteps=grid)
        x = ours('dpm++', model, steps, 'logsnr')
        assert (x - run_theirs(float64_sigmas(theirs, grid), model, monkeypatch)).abs().max() < 1e-10, steps


def test_grids_keep_their_shape_at_every_count():
    # Distinct, decreasing, inside [0, T-1]; DPM-Solver++ never calls at t = 0 below T calls, and
    # 'trailing' starts from pure noise (T-1) at any count.
    for steps in list(range(1, 60)) + [61, 103, 500, 999, 1000]:
        for spacing in diffusion.SPACINGS['dpm++']:
            grid = dpm_solver_timesteps(SCHED, steps, spacing)
            assert grid == sorted(set(grid), reverse=True) and len(grid) == steps and grid[0] <= 999
            assert min(grid) == (0 if steps == 1000 else min(grid)) and (steps == 1000 or min(grid) >= 1)
        for spacing in diffusion.SPACINGS['ddim']:
            grid = ddim_timesteps(1000, steps, spacing)
            assert grid == sorted(set(grid), reverse=True) and len(grid) == steps and 0 <= grid[-1] <= grid[0] <= 999
        assert ddim_timesteps(1000, steps, 'trailing')[0] == dpm_solver_timesteps(SCHED, steps, 'trailing')[0] == 999
    assert ddim_timesteps(1000, 50, 'leading') == list(range(980, -1, -20))  # the DDIM code's skip
    assert ddim_timesteps(1000, 61, 'trailing')[-1] == 15  # diffusers' float arange gives 62 entries here, to -1
    assert dpm_solver_timesteps(SCHED, 4, 'linspace') == [999, 749, 500, 250]


def test_dpm_solver_at_first_order_is_ddim_on_the_same_grid():
    # At 1 and 2 calls every DPM-Solver++ step is first order (the first, and the last into sigma = 0):
    # DDIM on the same ('trailing') grid; at 3 the middle step is second order and they part.
    model = SmoothCond()
    for steps in (1, 2):
        assert (ours('dpm++', model, steps, 'trailing') - ours('ddim', model, steps, 'trailing')).abs().max() < 1e-12
    assert (ours('dpm++', model, 3, 'trailing') - ours('ddim', model, 3, 'trailing')).abs().max() > 1e-3


def test_spacings_each_sampler_refuses():
    for sampler, spacing in (('ddim', 'logsnr'), ('ddpm', 'trailing'), ('dpm++', 'time'), ('student', None)):
        with pytest.raises(ValueError, match='spacing'):
            diffusion.spacing_for(sampler, spacing)
    with pytest.raises(ValueError, match='logsnr'):
        ours('ddim', SmoothCond(), 4, 'logsnr')
    assert diffusion.spacing_for('dpm++') == diffusion.DEFAULT_SPACING['dpm++']
    assert diffusion.spacing_for('dpm++', None, 1) == 'trailing' == diffusion.spacing_for('ddim', None, 1)
    assert dpm_solver_timesteps(SCHED, 1) == [999] and dpm_solver_timesteps(SCHED, 4) == [800, 600, 400, 200]


def test_the_defaults_are_the_measured_best_at_every_count():
    # The committed table that chose them (scripts/few_step_study.py on a digits model, paired seeds):
    # at every count measured, DPM-Solver++ on its default grid is the best solver or not decided worse
    # than it, ours or diffusers'; DDIM's default grid is the best of DDIM's grids or not decided worse.
    import json
    import os
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'results')
    counts = set()
    for stem in ('cpu-digits-solver-grids', 'cpu-digits-solver-grids-50'):
        with open(os.path.join(root, f'{stem}.json')) as f:
            summary = json.load(f)['summary']['unconditional']
        cells = {(s['sampler'], s['calls']): s for s in summary}
        for (solver, calls), s in cells.items():
            if solver == f"dpm++-{diffusion.spacing_for('dpm++', None, calls)}":
                assert s['not_worse_than_best'], (calls, s['best_solver'], s['paired_vs_best'])
                counts.add(calls)
        for calls in {n for _, n in cells}:
            ddim = {solver: s for (solver, n), s in cells.items() if n == calls and solver.startswith('ddim-')}
            if ddim:
                best = min(ddim.values(), key=lambda s: s['fd_mean'])
                assert ddim[f"ddim-{diffusion.DEFAULT_SPACING['ddim']}"]['fd_mean'] <= best['fd_mean'] * 1.05, calls
    assert {1, 2, 3, 4, 5, 8, 10, 20, 50} <= counts


@pytest.mark.parametrize('name', list(peers.PEER_SOLVERS))
def test_peer_solvers_run_diffusers_schedulers_on_our_noise(name, monkeypatch):
    # The adapter draws the same x_T as our samplers from a seed, and runs their scheduler as its
    # pipelines do. Where a peer is one of ours it gives our images (float32 tables: to 1e-4).
    pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    model = SmoothCond()
    shape = (2, 3, 4, 4)
    theirs = peers.peer_sample(name, model, SCHED, shape, 4, torch.Generator().manual_seed(0))
    same = {'diffusers-dpm++': ('dpm++', 'linspace'), 'diffusers-ddim-trailing': ('ddim', 'trailing')}.get(name)
    if same:
        mine = diffusion.run_sampler(same[0], model, SCHED, shape, 4, torch.Generator().manual_seed(0), spacing=same[1])
        assert (theirs - mine).abs().max() < 1e-4
    else:  # another solver or grid: other images
        mine = diffusion.run_sampler('dpm++', model, SCHED, shape, 4, torch.Generator().manual_seed(0),
                                     spacing='linspace')
        assert (theirs - mine).abs().max() > 1e-4
    scheduler = peers.peer_scheduler(name, make_schedule(1000, 'cosine'), 'v')
    assert scheduler.config.beta_schedule == 'squaredcos_cap_v2' and scheduler.config.prediction_type == 'v_prediction'
    assert np.isclose(peers.peer_scheduler(name, SCHED).betas[-1].item(), 0.02)


@pytest.mark.parametrize('prediction, theirs_named', [('v', 'v_prediction'), ('x', 'sample')])
def test_a_student_exports_to_ddim_pipeline_and_loads_back(prediction, theirs_named, tmp_path, monkeypatch):
    # A 2-step v- or x-student: diffusers' DDIMPipeline from the exported folder ('trailing', v_prediction or sample,
    # set_alpha_to_one, 2 steps) draws its images from the same noise as our student sampler, in float64;
    # sample.py draws the same from the checkpoint and from the folder; 16-step students are refused.
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    import sample
    import students
    from model import MODEL_VERSION, UNet, get_config
    torch.manual_seed(0)
    net = UNet(get_config('tiny', image_size=8, in_channels=1, channel_mults=(1, 2))).eval()
    for p in net.parameters():  # away from the zero-initialised start, so that the network matters
        p.data += 0.05 * torch.randn_like(p)
    record = {'steps': 2, 'grid': 'trailing', 'timesteps': students.student_timesteps(2),
              'prediction': prediction, 'guidance': None}
    ckpt = tmp_path / 'student-2.pt'
    torch.save({'model': net.state_dict(), 'ema': net.state_dict(), 'config': {'schedule': 'linear'},
                'model_config': dict(vars(net.config)), 'model_version': MODEL_VERSION, 'student': record, 'step': 1},
               ckpt)
    folder = tmp_path / 'exported'
    assert sample.cli(['--ckpt', str(ckpt), '--export-diffusers', str(folder), '--device', 'cpu']) == 0
    pipe = diffusers.DDIMPipeline.from_pretrained(folder).to(torch.float64)
    assert pipe.scheduler.config.timestep_spacing == 'trailing'
    assert pipe.scheduler.config.prediction_type == theirs_named
    pipe.scheduler.alphas_cumprod = SCHED.alphas_cumprod.clone()  # their float32 table in float64
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(batch_size=3, num_inference_steps=2, generator=torch.Generator().manual_seed(5), eta=0.0,
                  output_type='np').images
    ours = students.student_sample(net.double(), SCHED, (3, 1, 8, 8), 2, torch.Generator().manual_seed(5),
                                   dtype=torch.float64, prediction=prediction)
    assert np.abs(theirs - (ours / 2 + 0.5).permute(0, 2, 3, 1).numpy()).max() < 1e-10
    assert ours.std() > 0.05
    drawn = {}
    for source in (ckpt, folder):
        out = tmp_path / f'drawn-{source.name}'
        assert sample.cli(['--ckpt', str(source), '--num', '3', '--format', 'npz', '--device', 'cpu',
                           '--out', str(out)]) == 0
        drawn[source.name] = np.load(next(out.glob('*.npz')))['arr_0']
    assert np.array_equal(drawn['student-2.pt'], drawn['exported'])  # the folder loads back as the student
    record16 = {**record, 'steps': 16, 'timesteps': students.student_timesteps(16)}
    torch.save({**torch.load(ckpt, weights_only=True), 'student': record16}, tmp_path / 'student-16.pt')
    assert sample.cli(['--ckpt', str(tmp_path / 'student-16.pt'), '--export-diffusers', str(tmp_path / 'e16'),
                       '--device', 'cpu']) == 2
    record3 = {**record, 'steps': 3, 'timesteps': students.student_timesteps(3)}  # 666 -> 333 in diffusers, not 332
    torch.save({**torch.load(ckpt, weights_only=True), 'student': record3}, tmp_path / 'student-3.pt')
    assert sample.cli(['--ckpt', str(tmp_path / 'student-3.pt'), '--export-diffusers', str(tmp_path / 'e3'),
                       '--device', 'cpu']) == 2

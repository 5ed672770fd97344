"""scripts/time_to_quality.py: the ladder of training minutes to a score. End to end on a tiny budget,
reach and speed-ups on hand-made curves, reuse after a kill, stops and failures that end it at once,
the recipe's EMA judged through our network, and bad input refused before any run."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import refusal

import time_to_quality as ttq
import train

TINY = ['--images', '64', '--eval-every', '32', '--eval-samples', '8', '--sample-steps', '2', '--seeds', '1']


def ladder_args(tmp_path, *extra):
    return [*TINY, '--runs-dir', str(tmp_path / 'runs'), '--data-dir', str(tmp_path / 'data'),
            '--out-dir', str(tmp_path / 'out'), '--stem', 'ladder', *extra]


def test_two_arms_and_the_recipe_end_to_end_then_reused(tmp_path, monkeypatch):
    assert ttq.main(ladder_args(tmp_path, '--arms', 'baseline,+ channels-last,diffusers recipe')) == 0
    result = json.loads((tmp_path / 'out' / 'ladder.json').read_text())
    assert list(result['arms']) == ['baseline', '+ channels-last', 'diffusers recipe']
    assert result['config']['images'] == 64 and result['torch'] == torch.__version__ and result['command']
    for name, runs in result['runs'].items():
        assert [[p['images'] for p in run['curve']] for run in runs] == [[32, 64]], name
        assert all(p['minutes'] > 0 and p['score'] > result['floor'] for run in runs for p in run['curve'])
    baseline = result['arms']['baseline']
    assert result['targets']['final_target'] == result['runs']['baseline'][0]['curve'][-1]['score']
    assert baseline['final_target']['reached'] == 1 and baseline['vs_baseline']['ratio'] == 1.0
    assert result['targets']['harder_target'] == 12.3 and baseline['harder_target']['minutes'] is None
    markdown = (tmp_path / 'out' / 'ladder.md').read_text()
    assert 'not reached (0 of 1 seeds)' in markdown and '| diffusers recipe |' in markdown
    assert (tmp_path / 'out' / 'ladder.png').read_bytes()[:4] == b'\x89PNG'
    # The same command again trains nothing: every finished run is reused.
    monkeypatch.setattr(train, 'cli', lambda argv: pytest.fail('a finished run was trained again'))
    monkeypatch.setattr(ttq, 'recipe_arm', lambda *args: pytest.fail('a finished recipe run was trained again'))
    assert ttq.main(ladder_args(tmp_path, '--arms', 'baseline,+ channels-last,diffusers recipe',
                                '--stem', 'again')) == 0
    assert json.loads((tmp_path / 'out' / 'again.json').read_text())['runs'] == result['runs']


def test_a_half_written_run_is_trained_again_from_its_start(tmp_path, monkeypatch):
    assert ttq.main(ladder_args(tmp_path)[:-2] + ['--arms', 'baseline', '--stem', 'first']) == 0
    finished = tmp_path / 'runs' / 'baseline-seed0'
    kept = json.loads((finished / 'curve.json').read_text())
    half = tmp_path / 'runs' / 'baseline-seed1'  # killed mid-run: a checkpoint and metrics, no curve.json
    half.mkdir()
    (half / 'metrics.jsonl').write_text('{"kind": "train", "step": 1}\n')
    (half / 'ckpt.pt').write_bytes(b'not a finished run')
    trained = []
    real = train.cli

    def spy(argv):
        trained.append(argv[argv.index('--seed') + 1])
        return real(argv)
    monkeypatch.setattr(train, 'cli', spy)
    assert ttq.main(ladder_args(tmp_path, '--arms', 'baseline', '--seeds', '2')) == 0
    assert trained == ['1']  # seed 0 reused, seed 1 redone
    assert json.loads((finished / 'curve.json').read_text()) == kept
    assert not (half / 'ckpt.pt').read_bytes().startswith(b'not a')
    runs = json.loads((tmp_path / 'out' / 'ladder.json').read_text())['runs']['baseline']
    assert len(runs) == 2 and runs[0] == kept


def test_reach_interpolates_and_never_extrapolates():
    curve = [{'images': 100, 'score': 40.0, 'minutes': 1.0}, {'images': 200, 'score': 10.0, 'minutes': 3.0},
             {'images': 400, 'score': 5.0, 'minutes': 7.0}]
    # 20 lies half-way between 40 and 10 in log score: half-way in log images, the minutes linear in images.
    images, minutes = ttq.reach(curve, 20.0)
    assert images == pytest.approx(100 * 2 ** 0.5) and minutes == pytest.approx(1 + 2 * (2 ** 0.5 - 1))
    assert ttq.reach(curve, 50.0) == (100, 1.0)  # there at the first evaluation: its own time, not earlier
    assert ttq.reach(curve, 10.0) == pytest.approx((200, 3.0))
    assert ttq.reach(curve, 4.0) is None  # below the last score: not reached, never extrapolated


def test_the_summary_reports_reach_ratios_and_bounds():
    def run(*points):  # (score, minutes) at 100, 200, ... images
        return {'curve': [{'images': 100 * (i + 1), 'score': s, 'minutes': m, 'eval_seconds': 6.0}
                          for i, (s, m) in enumerate(points)], 'img_per_s': 50.0, 'train_minutes': points[-1][1]}
    runs = {'baseline': [run((40, 2), (20, 4), (10, 6)), run((40, 2), (10, 4), (10, 6))],
            'fast': [run((40, 1), (10, 2), (8, 3))],
            'diffusers recipe': [run((60, 3), (30, 6), (20, 9))]}
    summary = ttq.summarise(runs, {'final_target': 10.0, 'harder_target': 8.0})
    base, fast, recipe = summary['baseline'], summary['fast'], summary['diffusers recipe']
    assert base['final_target']['minutes'] == (5.0, pytest.approx(1.4142, rel=1e-3))  # 6 and 4
    assert base['final_target']['images'][0] == pytest.approx(250) and base['harder_target']['reached'] == 0
    assert base['harder_target']['minutes'] is None and fast['harder_target']['minutes'] == pytest.approx((3.0, None))
    assert fast['vs_baseline'] == {'ratio': pytest.approx(2.5), 'bound': False}
    assert recipe['final_target']['minutes'] is None and recipe['vs_baseline'] is None
    assert fast['vs_recipe'] == {'ratio': pytest.approx(4.5), 'bound': True}  # the recipe's 9 minutes never got there
    assert base['eval_minutes'] == pytest.approx((0.3, 0.0)) and fast['final'] == (8, None)


def test_a_lever_stays_for_the_arms_below_only_where_it_paid(tmp_path, monkeypatch):
    # Hand-made runs: bf16 trains slower than the baseline, channels-last faster, v-prediction reaches the
    # baseline's final score (12) sooner, Min-SNR later. The arms below must build on what paid only.
    def run(img_per_s, *points):  # (score, minutes) at 100, 200, ... images
        return {'curve': [{'images': 100 * (i + 1), 'score': s, 'minutes': m, 'eval_seconds': 1.0}
                          for i, (s, m) in enumerate(points)], 'img_per_s': img_per_s, 'train_minutes': points[-1][1]}
    made = {'baseline': run(100, (40, 2), (12, 4)), '+ bf16': run(90, (40, 2), (11, 4)),
            '+ channels-last': run(120, (40, 2), (12, 3.5)), '+ fused Adam': run(120, (40, 2), (12, 3.5)),
            '+ compile': run(110, (40, 2), (12, 3.7)), '+ v-prediction': run(120, (12, 1.5), (9, 3.5)),
            '+ Min-SNR-5': run(120, (20, 2), (12, 3.5)), '+ batch 64': run(150, (11, 1.2), (9, 2.4)),
            'diffusers recipe': run(80, (60, 3), (30, 6)), 'diffusers recipe at our lr': run(80, (50, 3), (20, 6))}
    seen = {}

    def fake(jobs, cfg, stop):
        for arm, _ in jobs:
            seen[arm.name] = arm.flags
        return {name: [made[name]] * sum(a.name == name for a, _ in jobs) for name in {a.name for a, _ in jobs}}
    cpu = torch.device('cpu')
    monkeypatch.setattr(ttq, 'cpu_has_native_bf16', lambda: True)
    monkeypatch.setattr(ttq, 'run_group', fake)
    cfg = ttq.LadderConfig(seeds=2, other_seeds=1)
    arms, runs, built = ttq.climb(ttq.speed_arms(cpu, cfg), cfg, ttq.StopFlag())
    kept = {name: (b['builds_on'], b['kept']) for name, b in built.items()}
    assert kept == {'+ bf16': ('baseline', False), '+ channels-last': ('baseline', True),
                    '+ fused Adam': ('+ channels-last', False), '+ compile': ('+ channels-last', False),
                    '+ v-prediction': ('+ channels-last', True), '+ Min-SNR-5': ('+ v-prediction', False),
                    '+ batch 64': ('+ v-prediction', True)}
    assert seen['+ batch 64'] == ttq.BASELINE + ['--channels-last', '--prediction', 'v', '--batch-size', '64',
                                                 '--lr', '3e-3']
    assert seen['+ compile'] == ttq.BASELINE + ['--channels-last', '--compile']
    assert [a.name for a in arms][-2:] == ['diffusers recipe', 'diffusers recipe at our lr']
    assert len(runs['baseline']) == len(runs['diffusers recipe']) == 2 and len(runs['+ bf16']) == 1


def test_the_recipes_ema_is_judged_through_our_network_as_the_same_function():
    import diffusers_io
    from model import get_config
    config = get_config('tiny', image_size=16, in_channels=1)
    torch.manual_seed(0)
    parts = diffusers_io.recipe_parts(config, torch.device('cpu'), 4, 'off', total_steps=4)
    for p in parts['unet'].parameters():  # weights far from their initial values, so that every one counts
        p.data.normal_(0, 0.05)
    parts['ema'].step(parts['unet'].parameters())
    ours = ttq.ema_as_our_unet(parts, config).double()
    from diffusers import UNet2DModel
    theirs = UNet2DModel(**diffusers_io.diffusers_config(config))
    parts['ema'].copy_to(theirs.parameters())
    theirs = theirs.double().eval()
    x, t = torch.randn(3, 1, 16, 16, dtype=torch.float64), torch.tensor([0, 400, 999])
    with torch.no_grad():
        assert torch.allclose(ours(x, t), theirs(x, t).sample, atol=1e-12, rtol=0)
    # and they are the EMA's weights, not the model's
    assert not torch.equal(next(parts['unet'].parameters()).double(), next(theirs.parameters()))


@pytest.mark.parametrize('extra, expected', [
    (['--arms', 'warp drive'], "no arm named 'warp drive'"),
    (['--target', '5'], 'below the floor of the digits score'),
    (['--images', '20', '--eval-every', '100'], 'before its first evaluation'),  # batch 32: it ends at 32
    (['--image-size', '6'], '--image-size 6'),  # train.py's own check, not a copy of it
    (['--arms', 'baseline', '--stem', '../x'], 'a plain file name'),
])
def test_bad_input_is_one_line_before_any_run(tmp_path, capsys, extra, expected):
    args = ladder_args(tmp_path)[:-2] + extra
    code, err = refusal(capsys, ttq.main, args)
    assert code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / 'runs').exists() and not (tmp_path / 'out').exists()


def test_another_ladders_runs_are_refused(tmp_path, capsys):
    assert ttq.main(ladder_args(tmp_path, '--arms', 'baseline')) == 0
    before = sorted(os.listdir(tmp_path / 'runs'))
    code, err = refusal(capsys, ttq.main, ladder_args(tmp_path, '--arms', 'baseline', '--eval-samples', '9'))
    assert code == 2 and 'holds the runs of another ladder' in err
    assert sorted(os.listdir(tmp_path / 'runs')) == before


def test_bf16_on_a_cpu_without_it_is_refused_and_the_defaults_follow_the_capability(monkeypatch, tmp_path, capsys):
    import devices
    cpu = torch.device('cpu')
    every_lever = {'amp': 'bf16', 'compile': True, 'channels_last': True, 'fused_adam': True}
    monkeypatch.setattr(train, 'CPU_FAST_PATH', every_lever)  # so that either way is seen, whatever the table holds

    def defaults():
        cfg = train.resolve_defaults(train.TrainConfig(preset='tiny'), cpu)
        return {name: getattr(cfg, name) for name in every_lever}
    for module in (devices, train, ttq):
        monkeypatch.setattr(module, 'cpu_has_native_bf16', lambda: False)
    assert defaults() == {'amp': 'off', 'compile': False, 'channels_last': False, 'fused_adam': False}
    code, err = refusal(capsys, train.cli, ['--device', 'cpu', '--amp', 'bf16', '--preset', 'tiny', '--out-dir',
                                            str(tmp_path / 'run')])
    assert code == 2 and 'no native bf16' in err and not (tmp_path / 'run').exists()
    assert '+ bf16' not in [a.name for a in ttq.speed_arms(cpu, ttq.LadderConfig())]
    monkeypatch.setattr(train, 'cpu_has_native_bf16', lambda: True)
    monkeypatch.setattr(ttq, 'cpu_has_native_bf16', lambda: True)
    assert defaults() == every_lever
    given = train.resolve_defaults(train.TrainConfig(preset='tiny', amp='off', compile=False), cpu)
    assert (given.amp, given.compile, given.channels_last) == ('off', False, True)  # a flag given wins
    assert '+ bf16' in [a.name for a in ttq.speed_arms(cpu, ttq.LadderConfig())]


def _script(root, tmp_path, *extra):
    return [sys.executable, os.path.join(root, 'scripts', 'time_to_quality.py'), *ladder_args(tmp_path), *extra]


def test_a_failing_run_in_a_worker_ends_the_ladder_at_once(tmp_path, root):
    # A run fails inside a worker process (a corrupt image in the folder, found when train.py loads
    # it): one line naming the run, exit 1, no hang, no report.
    from PIL import Image
    folder = tmp_path / 'images'
    folder.mkdir()
    for i in range(40):
        Image.new('L', (16, 16), i * 5).save(folder / f'{i}.png')
    (folder / 'broken.png').write_bytes(b'not a png')
    args = _script(root, tmp_path, '--dataset', 'folder', '--arms', 'baseline,+ channels-last', '--workers', '2',
                   '--other-seeds', '1')
    args[args.index('--data-dir') + 1] = str(folder)
    result = subprocess.run(args, capture_output=True, text=True, timeout=240,
                            env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith('error: ') and ('baseline, seed 0' in last or '+ channels-last, seed 0' in last), last
    assert not (tmp_path / 'out' / 'ladder.json').exists()  # no report


def test_a_stop_stops_the_ladder_without_a_report_and_the_rerun_continues(tmp_path, root):
    args = _script(root, tmp_path, '--arms', 'baseline,+ channels-last', '--images', '3200', '--eval-every', '1600')
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / 'runs' / 'baseline-seed0' / 'metrics.jsonl'
    deadline = time.time() + 120
    while not (metrics.exists() and '"kind": "train"' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and 'no report written' in out, err[-2000:]
    assert not (tmp_path / 'out' / 'ladder.json').exists()  # nothing built on a cut run
    assert not (tmp_path / 'runs' / 'baseline-seed0' / 'curve.json').exists()
    assert not (tmp_path / 'runs' / 'channels-last-seed0').exists()  # the ladder did not go on
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    result = json.loads((tmp_path / 'out' / 'ladder.json').read_text())
    assert [p['images'] for p in result['runs']['baseline'][0]['curve']] == [1600, 3200]

"""time_to_quality/ (python -m time_to_quality): the ladder of training minutes to a score. End to end on
a tiny budget, reach, the keep rule and the intervals on hand-made runs, the fair peer's data, the reuse rule of a
finished curve and its refusals (damaged, impossible or edited files, another ladder's runs, another
target, other flags or code; --retrain), stops at any moment, workers that die with the ladder, and bad
input refused before any run."""
import dataclasses
import json
import evaluation
import loaders
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import pytest
import torch
from helpers import refusal

import train
import train_config
from time_to_quality import ladder as ttq
from time_to_quality import recompute, speed, stats

TINY = ['--images', '64', '--speed-rounds', '3', '--speed-steps', '1', '--screen-images', '64', '--easy-at', '32',
        '--eval-every', '32', '--eval-samples', '8', '--sample-steps', '2', '--seeds', '2', '--lever-seeds', '2']


CACHE = {}  # the digit classifier's cache, shared by every test (training it takes seconds)


@pytest.fixture(autouse=True, scope='module')
def shared_cache(digits_cache, digits_judge):  # the judge: its classifier trained before any ladder starts
    CACHE['data'] = digits_cache


def ladder_args(tmp_path, *extra):
    return [*TINY, '--runs-dir', str(tmp_path / 'runs'), '--data-dir', CACHE['data'],
            '--out-dir', str(tmp_path / 'out'), '--stem', 'ladder', *extra]


@pytest.fixture(scope='module')
def baseline_part(tmp_path_factory):
    """A finished baseline part (2 seeds of 64 images, `--arms '+ channels-last'`): trained once, copied
    into each test that starts from it."""
    base = tmp_path_factory.mktemp('baseline-part')
    assert ttq.main(ladder_args(base, '--arms', '+ channels-last', '--train', 'baseline')) == 0
    return base


def copy_part(part, tmp_path):
    import shutil
    for name in ('runs', 'out'):
        shutil.copytree(part / name, tmp_path / name)
    (tmp_path / 'runs' / 'lock').unlink(missing_ok=True)


def test_a_small_ladder_end_to_end_then_reused(tmp_path, monkeypatch):
    assert ttq.main(ladder_args(tmp_path, '--arms', '+ channels-last,+ v-prediction')) == 0
    result = json.loads((tmp_path / 'out' / 'ladder.json').read_text())
    levers = result['levers']
    timed_only = [] if levers['+ channels-last']['kept'] else ['+ channels-last']  # kept by noise: v-prediction's base
    assert list(result['arms']) == [n for n in ('baseline', '+ channels-last', '+ v-prediction', 'diffusers recipe')
                                    if n not in timed_only]
    assert result['config']['images'] == 64 and result['torch'] == torch.__version__ and result['command']
    for name, runs in result['runs'].items():
        planned = [32] if name == 'diffusers recipe' else [32, 64]  # its final seeds plan --decay-images, 64 / 2
        assert all([p['images'] for p in run['curve']] == (
            [32, 64] if run['run']['stop_at'] is None else planned) for run in runs), name
        assert all(p['minutes'] > 0 and p['score'] > result['floor'] for run in runs for p in run['curve'])
    assert [len(result['runs'][name]) for name in result['arms']] == [2] * (len(result['arms']) - 1) + [3]  # its screen
    assert result['targets'] == {'target': evaluation.DIGITS_TARGET, 'easy_target': max(
        run['curve'][0]['score'] for run in result['runs']['baseline'])}  # the worst seed's score at 32 images
    below = '+ channels-last' if levers['+ channels-last']['kept'] else 'baseline'  # img/s of 3 one-step rounds: noise
    assert [levers[n]['builds_on'] for n in levers] == ['baseline', below]
    assert levers['+ channels-last']['judged_by'] == 'speed' and levers['+ v-prediction']['n'] == 2
    assert levers['+ channels-last']['n'] == 3 and levers['+ channels-last']['timed']['rounds'] == 3
    assert levers['+ channels-last']['timed']['hash'] == ttq.timing_code()['hash']
    assert not levers['+ v-prediction']['kept']  # no seed reached the target sooner: none reached it
    headline = result['headline']
    # No run reaches the target, so no ratio to it; one to the easier target (the baseline's worst seed's score)
    # exists when a kept-by-noise channels-last's two seeds happen to score under it.
    assert result['best_peer'] == 'diffusers recipe' and all(
        value is None for label, value in headline.items() if f'to {evaluation.DIGITS_TARGET:.2f}' in label)
    assert any('against the best diffusers variant (diffusers recipe)' in label for label in headline)
    curves = sorted(n for n in os.listdir(tmp_path / 'out' / 'ladder-runs') if not n.startswith('channels-last-64'))
    assert curves == ['baseline-64-seed0.json', 'baseline-64-seed1.json', 'channels-last-speed.json',
                      'diffusers-recipe-32-seed0.json',
                      'diffusers-recipe-32-seed1.json', 'diffusers-recipe-64-screen-seed0.json',
                      'v-prediction-64-seed0.json', 'v-prediction-64-seed1.json']
    markdown = (tmp_path / 'out' / 'ladder.md').read_text()
    assert 'not reached (0 of 2 seeds)' in markdown and '| diffusers recipe |' in markdown and 'Levers' in markdown
    assert '| + channels-last | baseline | speed (interleaved) | 3 rounds |' in markdown
    assert '- + channels-last: timed against baseline, 3 rounds of 1 steps' in markdown
    assert (tmp_path / 'out' / 'ladder.png').read_bytes()[:4] == b'\x89PNG'
    # The same command again, even with an empty runs folder (another machine), trains nothing.
    monkeypatch.setattr(train, 'cli', lambda argv: pytest.fail('a finished run was trained again'))
    monkeypatch.setattr(ttq, 'recipe_arm', lambda *args: pytest.fail('a finished recipe run was trained again'))
    monkeypatch.setattr(speed, 'interleave', lambda *args, **kw: pytest.fail('a lever was timed again'))
    assert ttq.main(ladder_args(tmp_path, '--arms', '+ channels-last,+ v-prediction', '--runs-dir',
                                str(tmp_path / 'elsewhere'))) == 0
    assert json.loads((tmp_path / 'out' / 'ladder.json').read_text())['runs'] == result['runs']
    # The report recomputed from the curves alone (python -m time_to_quality.recompute): the same decisions.
    assert recompute.main(ladder_args(tmp_path, '--arms', '+ channels-last,+ v-prediction')) == 0
    again = json.loads((tmp_path / 'out' / 'ladder.json').read_text())
    assert again['levers'] == result['levers'] and again['runs'] == result['runs']


def test_a_half_written_run_is_trained_again_from_its_start(tmp_path, monkeypatch, baseline_part):
    args = ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline')
    copy_part(baseline_part, tmp_path)
    kept = (tmp_path / 'out' / 'ladder-runs' / 'baseline-64-seed0.json').read_text()
    (tmp_path / 'out' / 'ladder-runs' / 'baseline-64-seed1.json').unlink()
    half = tmp_path / 'runs' / 'baseline-64-seed1'  # killed mid-run: a checkpoint and metrics, no curve
    (half / 'ckpt.pt').write_bytes(b'not a finished run')
    trained, real = [], train.cli

    def spy(argv):
        trained.append(argv[argv.index('--seed') + 1])
        return real(argv)
    monkeypatch.setattr(train, 'cli', spy)
    assert ttq.main(args) == 0
    assert trained == ['1']  # seed 0 reused, seed 1 redone
    assert (tmp_path / 'out' / 'ladder-runs' / 'baseline-64-seed0.json').read_text() == kept
    assert not (half / 'ckpt.pt').read_bytes().startswith(b'not a')
    assert "part 'speed'" in json.loads((tmp_path / 'out' / 'ladder.json').read_text())['unfinished']


def test_a_part_stops_where_the_ladder_needs_a_run_it_does_not_train(tmp_path, capsys, baseline_part):
    copy_part(baseline_part, tmp_path)
    assert ttq.main(ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline')) == 0
    out = capsys.readouterr().out
    assert "part 'speed'" in out and '--train speed' in out
    assert sorted(os.listdir(tmp_path / 'out' / 'ladder-runs')) == ['baseline-64-seed0.json', 'baseline-64-seed1.json']
    # The report of the finished parts says so, on its first line.
    result = json.loads((tmp_path / 'out' / 'ladder.json').read_text())
    assert result['levers'] == {} and result['headline'] == {} and list(result['arms']) == ['baseline']
    assert '**Unfinished**' in (tmp_path / 'out' / 'ladder.md').read_text()


def test_reach_interpolates_and_never_extrapolates():
    curve = [{'images': 100, 'score': 40.0, 'minutes': 1.0}, {'images': 200, 'score': 10.0, 'minutes': 3.0},
             {'images': 400, 'score': 5.0, 'minutes': 7.0}]
    # 20 lies half-way between 40 and 10 in log score: half-way in log images, the minutes linear in images.
    images, minutes = stats.reach(curve, 20.0)
    assert images == pytest.approx(100 * 2 ** 0.5) and minutes == pytest.approx(1 + 2 * (2 ** 0.5 - 1))
    assert stats.reach(curve, 50.0) == (100, 1.0)  # there at the first evaluation: its own time, not earlier
    assert stats.reach(curve, 10.0) == pytest.approx((200, 3.0))
    assert stats.reach(curve, 4.0) is None  # below the last score: not reached, never extrapolated


def run(minutes_to_10, img_per_s=100.0, reached=True):
    """A hand-made run whose score falls from 40 to 10 (or, not reached, to 20) at `minutes_to_10`."""
    last = 10.0 if reached else 20.0
    return {'curve': [{'images': 100, 'score': 40.0, 'minutes': minutes_to_10 / 2, 'eval_seconds': 1.0},
                      {'images': 200, 'score': last, 'minutes': minutes_to_10, 'eval_seconds': 1.0}],
            'img_per_s': img_per_s, 'train_minutes': minutes_to_10}


def test_a_speed_lever_is_judged_over_the_planned_run_with_its_compiling_once():
    # A compile-like lever: 30 s of first step, then 600 img/s, against 500 img/s and a 0.1 s first step,
    # batch 32. In a 25,000-image screen it is slower; over the planned 400,000 images it is faster.
    def screen(first, steady):
        seconds = first + (25_000 - 32) / steady
        return {'curve': [], 'img_per_s': 25_000 / seconds, 'steady_img_per_s': steady, 'first_step_s': first,
                'batch': 32, 'train_minutes': seconds / 60}
    assert stats.planned_img_per_s(screen(30.0, 600.0), 400_000) == pytest.approx(400_000 / (30 + 399_968 / 600))
    lever, below = [screen(30.0, 600.0 + s) for s in range(3)], [screen(0.1, 500.0 + s) for s in range(3)]
    assert lever[0]['img_per_s'] < below[0]['img_per_s']
    gain = stats.paired_gain('speed', lever, below, 10.0, planned=400_000, confirm=3)
    gains = [400_000 / (30 + 399_968 / (600 + s)) - 400_000 / (0.1 + 399_968 / (500 + s)) for s in range(3)]
    assert gain['kept'] and gain['gains'] == pytest.approx(gains) and gain['mean'] == pytest.approx(sum(gains) / 3)
    assert gain['unit'] == 'img/s' and not stats.paired_gain('speed', lever, below, 10.0, confirm=3)['kept']


def curve_in_images(at20: float, at10: float, img_per_s: float = 100.0) -> dict:
    """A hand-made curve: 40 at 100 images, 20 at `at20` images, 10 at `at10`, at a steady img/s."""
    return {'curve': [{'images': n, 'score': score, 'minutes': n / img_per_s / 60, 'eval_seconds': 1.0}
                      for n, score in ((100, 40.0), (at20, 20.0), (at10, 10.0))],
            'img_per_s': img_per_s, 'train_minutes': at10 / img_per_s / 60}


def timing(lever_rates, below_rates, lever_warmup=1.0, below_warmup=1.0):
    """A saved interleaved timing, hand-made: the lever ('L') and the arm below ('B'), batch 32, 10 warm-up steps."""
    return {'lever': {'name': 'L', 'flags': ['--compile']}, 'below': {'name': 'B', 'flags': []},
            'img_per_s': {'L': lever_rates, 'B': below_rates}, 'warmup_s': {'L': lever_warmup, 'B': below_warmup},
            'batch': 32, 'warmup_steps': 10, 'rounds': len(lever_rates), 'steps': 30,
            'code': {'hash': 'h', 'commit': 'c' * 40}}


def test_a_timed_speed_lever_pays_its_warm_up_once_over_the_planned_run():
    # A compile-like lever: 120 s of warm-up, then 1.2x the rate of the arm below (whose warm-up is its 10
    # steps at its own rate). Over 400,000 planned images it wins, over 10,000 it loses; each round a pair.
    below = [100.0, 90.0, 110.0, 95.0, 105.0]
    lever = [120.0, 110.0, 130.0, 112.0, 128.0]
    saved = timing(lever, below, lever_warmup=120.0, below_warmup=2.0 + 10 * 32 / 100.0)
    start = 120.0 - 10 * 32 / statistics.median(lever)
    assert speed.start_seconds(120.0, lever, 32, 10) == pytest.approx(start)
    assert speed.start_seconds(2.0 + 10 * 32 / 100.0, below, 32, 10) == pytest.approx(2.0)
    assert speed.start_seconds(1.0, below, 32, 10) == 0.0  # never below 0
    for planned, kept in ((400_000, True), (10_000, False)):
        got = speed.decide(saved, planned, screen=3, confirm=5)
        gains = [planned / (start + planned / m) - planned / (2.0 + planned / b) for m, b in zip(lever, below)]
        assert got['gains'] == pytest.approx(gains) and got['kept'] is kept and got['n'] == 5
    logs = [math.log(m / b) for m, b in zip(lever, below)]
    assert got['timed']['ratio'] == pytest.approx(math.exp(statistics.mean(logs)))
    half = 2.776445105 * statistics.stdev(logs) / math.sqrt(5)
    assert got['timed']['low'] == pytest.approx(math.exp(statistics.mean(logs) - half))
    assert speed.decide(timing(lever[:3], below[:3]), 400_000, 3, 5)['status'] == 'pending'


def fake_interleave(calls, faster=1.0):
    def interleave(arms, common, device, rounds, steps, stop=None):
        calls.append(list(arms))
        below, lever = list(arms)
        return {'img_per_s': {below: [100.0 + r for r in range(rounds)],
                              lever: [faster * (100.0 + r) + (-1) ** r for r in range(rounds)]},
                'warmup_s': {below: 1.0, lever: 1.0}, 'batch': {below: 32, lever: 32}}
    return interleave


def test_a_speed_timing_is_reused_or_refused_in_one_line_like_a_curve(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(speed, 'interleave', fake_interleave(calls, faster=1.2))
    monkeypatch.setattr(ttq, 'run_all', lambda jobs, *args: [{'run': j.identity(), **curve_in_images(300, 600)}
                                                             for j in jobs])
    cfg = ttq.LadderConfig(arms='+ channels-last', seeds=3, lever_seeds=3, images=1000, screen_images=200,
                           easy_at=200, out_dir=str(tmp_path))
    identity = {'ladder': 'this one'}
    first = ttq.climb(cfg, 10.0, ttq.StopFlag(), identity)['decisions']['+ channels-last']
    assert first['kept'] and first['timed']['ratio'] > 1.19 and len(calls) == 1
    path = tmp_path / 'cpu-digits-time-to-quality-runs' / 'channels-last-speed.json'
    saved = json.loads(path.read_text())
    assert saved['code'] == ttq.timing_code() and saved['ladder'] == identity and saved['rounds'] == 10
    assert ttq.climb(cfg, 10.0, ttq.StopFlag(), identity)['decisions']['+ channels-last'] == first
    assert len(calls) == 1  # reused, not timed again
    ttq.check_curves(cfg, identity, 10.0)  # the timing passes the scan of every file too

    def refused(expected, changed_cfg=cfg, changed_identity=identity):
        for check in (lambda: ttq.check_curves(changed_cfg, changed_identity, 10.0),
                      lambda: ttq.climb(changed_cfg, 10.0, ttq.StopFlag(), changed_identity)):
            with pytest.raises(ttq.ConfigError) as error:
                check()
            assert str(path) in str(error.value) and expected in str(error.value), str(error.value)
            assert '\n' not in str(error.value) and '--retrain channels-last-speed' in str(error.value)
    refused('timed with other settings: rounds 10 (now 11)', dataclasses.replace(cfg, speed_rounds=11))
    refused('timed with other settings: steps 30 (now 31)', dataclasses.replace(cfg, speed_steps=31))
    path.write_text(json.dumps(ttq.sealed({**saved, 'below': {'name': 'baseline', 'flags': ['--amp', 'bf16']}})))
    with pytest.raises(ttq.ConfigError, match='timed other arms: below'):  # the scan has no arms; the ladder has
        ttq.climb(cfg, 10.0, ttq.StopFlag(), identity)
    path.write_text(json.dumps(saved))
    refused('made by another ladder', changed_identity={'ladder': 'another'})
    path.write_text(json.dumps({**saved, 'img_per_s': {**saved['img_per_s'], '+ channels-last': [
        r * 2 for r in saved['img_per_s']['+ channels-last']]}}))
    refused('edited since it was written')
    path.write_text(path.read_text()[:40])
    refused('damaged')
    path.write_text(json.dumps(saved))
    monkeypatch.setattr(ttq, 'code_identity', lambda: {'hash': 'other', 'commit': 'x'})
    refused('made by other code (hash ')
    # --retrain names it: timed again, its file replaced (here, no faster: not kept).
    monkeypatch.setattr(speed, 'interleave', fake_interleave(calls, faster=1.0))
    again = ttq.climb(dataclasses.replace(cfg, retrain='channels-last-speed'), 10.0, ttq.StopFlag(), identity)
    assert len(calls) == 2 and not again['decisions']['+ channels-last']['kept']
    assert json.loads(path.read_text())['code']['hash'] == ttq.timing_code()['hash'] != saved['code']['hash']


def test_a_stop_during_a_timing_writes_nothing_and_a_part_not_trained_is_missing(monkeypatch, tmp_path):
    import types
    monkeypatch.setattr(speed, 'build', lambda flags, *args: (types.SimpleNamespace(
        cfg=types.SimpleNamespace(batch_size=32)), None))
    monkeypatch.setattr(speed.data, 'load_dataset', lambda *args, **kwargs: None)
    monkeypatch.setattr(speed, 'timed', lambda *args: 100.0)
    for at in (0, 1, 3, 5):  # in the builds, the warm-ups, the first round, a later round
        stopped, calls = types.SimpleNamespace(reason=None), []

        def building(flags, *args):
            calls.append('build')
            stopped.reason = 'SIGTERM' if len(calls) > at else None
            return types.SimpleNamespace(cfg=types.SimpleNamespace(batch_size=32)), None

        def timing(*args):
            calls.append('timed')
            stopped.reason = 'SIGTERM' if len(calls) > at else None
            return 100.0
        monkeypatch.setattr(speed, 'build', building)
        monkeypatch.setattr(speed, 'timed', timing)
        assert speed.interleave({'a': [], 'b': []}, ['--device', 'cpu'], torch.device('cpu'), 3, 1,
                                       stop=stopped, say=lambda line: None) is None
        assert len(calls) == max(at + 1, 1), (at, calls)  # nothing more once the signal came
    monkeypatch.setattr(ttq, 'run_all', lambda jobs, *args: [{'run': j.identity(), **curve_in_images(300, 600)}
                                                             for j in jobs])
    cfg = ttq.LadderConfig(arms='+ channels-last', seeds=3, lever_seeds=3, images=1000, screen_images=200,
                           easy_at=200, out_dir=str(tmp_path))
    monkeypatch.setattr(speed, 'interleave', lambda *args, **kwargs: None)  # a signal mid-timing
    assert ttq.climb(cfg, 10.0, ttq.StopFlag(), {}) is None
    assert not os.path.exists(tmp_path / 'cpu-digits-time-to-quality-runs' / 'channels-last-speed.json')
    done = ttq.climb(dataclasses.replace(cfg, train='baseline'), 10.0, ttq.StopFlag(), {})
    assert "part 'speed': + channels-last's timing against baseline is not finished" in done['missing']


def test_a_timings_code_is_the_runs_and_its_own(monkeypatch, tmp_path, root):
    # An edit of speed.py (how a timing is made) changes the hash its timings are reused under.
    import shutil
    (tmp_path / 'time_to_quality').mkdir()
    shutil.copy(os.path.join(root, 'time_to_quality', 'speed.py'), tmp_path / 'time_to_quality')
    before = ttq.timing_code()
    monkeypatch.setattr(ttq, 'ROOT', str(tmp_path))
    assert ttq.timing_code() == before and before['hash'] != ttq.code_identity()['hash']
    with open(tmp_path / 'time_to_quality' / 'speed.py', 'a') as f:
        f.write('\nWARMUP_STEPS = 20\n')
    assert ttq.timing_code()['hash'] != before['hash']


def test_a_pending_lever_of_short_runs_is_confirmed_by_a_new_ladder(monkeypatch, tmp_path):
    # A ladder recorded before the interleaved timing: its speed lever's 3 short runs pass the screen, and
    # no command trains such runs any more, so the command that confirms it is a new ladder's.
    cfg = ttq.LadderConfig(arms='+ channels-last', seeds=5, lever_seeds=3, images=1000, screen_images=200,
                           easy_at=200, out_dir=str(tmp_path))
    made = {'baseline': lambda s: {**curve_in_images(300, 600), 'img_per_s': 100.0 + s},
            '+ channels-last': lambda s: {**curve_in_images(300, 600), 'img_per_s': 103.0 + s}}

    def read(job, cfg, identity, replaced=False):
        if job.arm.name in made and (job.images == 1000 and job.arm.name == 'baseline' or job.seed < 3):
            return {'run': job.identity(), 'code': {'hash': 'h'}, **made[job.arm.name](job.seed)}
        return None
    monkeypatch.setattr(ttq, 'read_result', read)
    for arm in (ttq.BASELINE_ARM, ttq.Arm('+ channels-last', '', ttq.BASELINE + ['--channels-last'])):
        for seed in range(3):  # the short runs' files, as such a ladder left them
            path = ttq.curve_path(ttq.Job(arm, seed, cfg.speed_images, 10.0), cfg)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, 'w').write('{}')
    monkeypatch.setattr(speed, 'interleave', lambda *args, **kwargs: pytest.fail('timed, not read'))
    done = ttq.climb(cfg, 10.0, ttq.StopFlag(), {}, dry=True, trains=set())
    decision = ttq.record(done, cfg, None)['levers']['+ channels-last']
    assert (decision['status'], decision['n'], 'timed' in decision) == ('pending', 3, False)
    assert '--train baseline,speed' in decision['command'] and '-confirm-channels-last' in decision['command']


def test_a_lever_that_wins_at_one_target_and_loses_at_the_other_follows_the_target(monkeypatch, tmp_path):
    # Hand-made runs: v-prediction reaches 20 (the easy score) in fewer images on every seed but 10 (the
    # target) in more; Min-SNR the other way round. Only the target decides: v-prediction is left out at
    # the screen, Min-SNR passes it on 3 pairs and is kept on 4 (its confirmation trains seed 3). Channels-
    # last, a speed lever, times no faster against the baseline, interleaved: left out, no run trained.
    made = {'baseline': lambda s: curve_in_images(300 + 10 * s, 600 + 10 * s, 100 + s),
            '+ channels-last': lambda s: curve_in_images(300, 600, 100 + (-1) ** s),
            '+ v-prediction': lambda s: curve_in_images(200 + 10 * s, 700 + 10 * s),
            '+ Min-SNR-5': lambda s: curve_in_images(400 + 10 * s, 500 + 10 * s + s % 2),
            'diffusers recipe': lambda s: curve_in_images(800, 1000)}
    seen = []

    def fake(jobs, cfg, identity, stop):
        seen.extend((job.arm.name, job.arm.flags, job.images, job.seed, job.target) for job in jobs)
        return [{'run': job.identity(), **made[job.arm.name](job.seed)} for job in jobs]
    monkeypatch.setattr(ttq, 'run_all', fake)
    timed = []

    def interleave(arms, common, device, rounds, steps, stop=None):  # channels-last no faster, round by round
        timed.append((arms, rounds, steps))
        return {'img_per_s': {'baseline': [100.0 + r for r in range(rounds)],
                              '+ channels-last': [100.0 + r - (-1) ** r for r in range(rounds)]},
                'warmup_s': {'baseline': 1.0, '+ channels-last': 1.0}, 'batch': {'baseline': 32, '+ channels-last': 32}}
    monkeypatch.setattr(speed, 'interleave', interleave)
    cfg = ttq.LadderConfig(arms='+ channels-last,+ v-prediction,+ Min-SNR-5', seeds=4, lever_seeds=3, images=1000,
                           screen_images=200, easy_at=200, out_dir=str(tmp_path))
    done = ttq.climb(cfg, 10.0, ttq.StopFlag(), {})
    assert {n: (d['builds_on'], d['status']) for n, d in done['decisions'].items()} == {
        '+ channels-last': ('baseline', 'screen failed'), '+ v-prediction': ('baseline', 'screen failed'),
        '+ Min-SNR-5': ('baseline', 'kept')}
    assert done['decisions']['+ Min-SNR-5']['n'] == 4 and done['decisions']['+ v-prediction']['n'] == 3
    runs = {(name, images, seed, target) for name, _, images, seed, target in seen}
    assert timed == [({'baseline': ttq.BASELINE, '+ channels-last': ttq.BASELINE + ['--channels-last']}, 10, 30)]
    assert done['decisions']['+ channels-last']['n'] == 10 and not any(n == '+ channels-last' for n, *_ in runs)
    assert {(name, images, seed) for name, images, seed, _ in runs if name == 'baseline'} == {
        ('baseline', 1000, s) for s in range(4)}  # no short runs beside a speed lever
    assert {seed for name, _, _, seed, _ in seen if name == '+ v-prediction'} == {0, 1, 2}  # no confirmation
    assert ('+ Min-SNR-5', ttq.BASELINE + ['--loss-weight', 'min-snr'], 1000, 3, 10.0) in seen  # its 4th pair
    assert ('diffusers recipe', ['--batch-size', '16', '--lr', '1e-4'], 200, 0, None) in seen  # the screen: no stop
    assert done['fastest'] == '+ Min-SNR-5' and done['best_peer'] == 'diffusers recipe'
    assert done['targets']['easy_target'] == 20.0


def test_a_kept_lr_decay_plans_its_own_length_for_the_arms_above_and_the_peer(monkeypatch, tmp_path):
    # The decay lever's runs plan --decay-images against the arm below at --images; once kept, the arms
    # above it and the headline arm plan the same length; the peer's final seeds always do (its lr decays).
    made = {'baseline': lambda s: curve_in_images(150, 200 + 10 * s),
            '+ cosine lr decay': lambda s: curve_in_images(120, 150 + 10 * s + s % 2),
            '+ Adam beta2 0.99': lambda s: curve_in_images(120, 140 + 20 * s),
            'diffusers recipe': lambda s: curve_in_images(150, 250)}
    seen = []

    def fake(jobs, cfg, identity, stop):
        seen.extend((job.arm.name, job.images, job.seed) for job in jobs)
        return [{'run': job.identity(), **made[job.arm.name](job.seed)} for job in jobs]
    monkeypatch.setattr(ttq, 'run_all', fake)
    cfg = ttq.LadderConfig(arms='+ cosine lr decay,+ Adam beta2 0.99', seeds=4, lever_seeds=3, images=400,
                           decay_images=250, screen_images=200, easy_at=200, out_dir=str(tmp_path))
    assert ttq.decay_plan(dataclasses.replace(cfg, decay_images=None)) == 200  # the default: half of --images
    done = ttq.climb(cfg, 10.0, ttq.StopFlag(), {})
    assert done['decisions']['+ cosine lr decay']['kept'] and done['fastest'] == '+ cosine lr decay'
    assert done['decisions']['+ Adam beta2 0.99']['builds_on'] == '+ cosine lr decay'
    assert {(n, i) for n, i, _ in seen} == {('baseline', 400), ('+ cosine lr decay', 250), ('+ Adam beta2 0.99', 250),
                                           ('diffusers recipe', 200), ('diffusers recipe', 250)}
    assert ('+ cosine lr decay', 250, 3) in seen and ('diffusers recipe', 250, 3) in seen  # the headline's seeds
    assert done['planned'] == {'+ cosine lr decay': 250, '+ Adam beta2 0.99': 250, 'diffusers recipe': 250}


def test_with_no_lever_kept_the_baseline_is_the_headline_arm_against_the_peer(monkeypatch, tmp_path):
    def curve(at10):
        return {'curve': [{'images': 100, 'score': 40.0, 'minutes': 1.0, 'eval_seconds': 1.0},
                          {'images': 200, 'score': 10.0, 'minutes': at10, 'eval_seconds': 1.0}],
                'img_per_s': 100.0, 'train_minutes': at10}
    made = {'baseline': lambda s: curve(6 + 0.1 * s), '+ Adam beta2 0.99': lambda s: curve(6 + 0.1 * s + s % 2),
            'diffusers recipe': lambda s: curve(12 + 0.5 * s)}
    monkeypatch.setattr(ttq, 'run_all', lambda jobs, *args: [{'run': job.identity(), **made[job.arm.name](job.seed)}
                                                             for job in jobs])
    cfg = ttq.LadderConfig(arms='+ Adam beta2 0.99', seeds=3, lever_seeds=2, images=400, screen_images=200,
                           easy_at=200, out_dir=str(tmp_path))
    done = ttq.climb(cfg, 10.0, ttq.StopFlag(), {})
    headline = ttq.record(done, cfg, None)['headline']
    assert done['fastest'] == 'baseline' and list(headline)[0].startswith('no lever was kept')
    ratio = headline['baseline against the best diffusers variant (diffusers recipe), to 10.00 (independent runs, '
                     'Welch)']
    logs = [math.log(12 + 0.5 * s) - math.log(6 + 0.1 * s) for s in range(3)]
    assert ratio['ratio'] == pytest.approx(math.exp(sum(logs) / 3)) and not ratio['paired']


def test_the_intervals_on_hand_made_numbers():
    # The paired interval: mean +- t(0.975, n-1) sd / sqrt(n), with t from a table (4 degrees of freedom).
    values = [1.0, 2.0, 4.0, 3.5, 2.5]
    mean = sum(values) / 5
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 4)
    got = stats.interval(values)
    assert got['mean'] == pytest.approx(2.6) and got['sd'] == pytest.approx(sd)
    assert (got['low'], got['high']) == pytest.approx((mean - 2.776445105 * sd / math.sqrt(5),
                                                       mean + 2.776445105 * sd / math.sqrt(5)))
    # The headline ratio, paired: the geometric mean of base/fast seed by seed, the interval on log ratios.
    base, fast = [10, 12, 9, 11, 10], [4, 5, 4, 4, 5]
    ratio = stats.paired_ratio([run(m) for m in base], [run(m) for m in fast], 10.0)
    logs = [math.log(b / f) for b, f in zip(base, fast)]
    centre = sum(logs) / 5
    half = 2.776445105 * math.sqrt(sum((x - centre) ** 2 for x in logs) / 4) / math.sqrt(5)
    assert ratio['ratio'] == pytest.approx(math.exp(centre)) and not ratio['bound']
    assert (ratio['low'], ratio['high']) == pytest.approx((math.exp(centre - half), math.exp(centre + half)))
    # The peer, unpaired: equal variances and counts give Welch's 2(n-1) = 8 degrees of freedom (t 2.306004135).
    peer, ours = [20, 24, 22, 26, 18], [10, 12, 11, 13, 9]  # the same spread in log: ours = peer / 2
    got = stats.unpaired_ratio([run(m) for m in peer], [run(m) for m in ours], 10.0)
    var = statistics.variance([math.log(m) for m in peer]) / 5
    assert got['ratio'] == pytest.approx(2.0)
    assert got['low'] == pytest.approx(2.0 * math.exp(-2.306004135 * math.sqrt(2 * var)), rel=1e-6)
    # A peer run that never reached the target: its whole training is counted, and the ratio is a bound.
    assert stats.unpaired_ratio([run(30, reached=False)] + [run(m) for m in peer[1:]], [run(m) for m in ours],
                              10.0)['bound']
    assert stats.paired_ratio([run(m) for m in base], [run(4, reached=False)] + [run(m) for m in fast[1:]], 10.) is None


def test_the_recipe_loader_on_digits_gives_our_images_unmirrored(tmp_path):
    import data
    from peers import recipe_loader, write_image_folder
    ours = data.load_dataset('digits', str(tmp_path), 16)
    write_image_folder(ours, str(tmp_path / 'png'))

    def as_bytes(images):  # [-1, 1] -> each image's uint8 bytes, sorted: the set up to order
        return sorted(((x + 1) * 127.5).round().to(torch.uint8).numpy().tobytes() for x in images)

    def recipe(flip):
        return as_bytes(torch.cat([x for x, _ in recipe_loader(str(tmp_path / 'png'), 16, 100, 0, channels=1,
                                                                 flip=flip)]))
    mine = sorted(ours[i].numpy().tobytes() for i in range(len(ours)))
    assert recipe(flip=data.flipped_in_training('digits')) == mine  # the same 1,347 images, none mirrored
    loader = loaders.make_loader('gpu', ours, 449, 0, 'cpu', flip=data.flipped_in_training('digits'))
    assert as_bytes(torch.cat(list(loader.epoch(0, 0)))) == mine  # as our runs see them
    assert recipe(flip=True) != mine  # the example's --random_flip would mirror about half of them


def test_the_recipes_ema_is_judged_through_our_network_as_the_same_function():
    import diffusers_io
    import peers
    from model import get_config
    from time_to_quality import recipe
    config = get_config('tiny', image_size=16, in_channels=1)
    torch.manual_seed(0)
    parts = peers.recipe_parts(config, torch.device('cpu'), 4, 'off', total_steps=4)
    for p in parts['unet'].parameters():  # weights far from their initial values, so that every one counts
        p.data.normal_(0, 0.05)
    parts['ema'].step(parts['unet'].parameters())
    ours = recipe.ema_as_our_unet(parts, config).double()
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
    (['--arms', 'warp drive'], "no lever or variant named 'warp drive'"),
    (['--train', 'warp'], 'no part named warp'),
    (['--target', '5', '--arms', '+ channels-last'], 'below the floor of the digits score'),
    (['--images', '20', '--screen-images', '20', '--eval-every', '100'],
     'before its first evaluation'),  # batch 32: it ends at 32
    (['--arms', '+ channels-last', '--speed-rounds', '3', '--seeds', '4'], '--speed-rounds 3: fewer than the pairs'),
    (['--screen-images', '10', '--eval-every', '20'], "'diffusers recipe' ends at 16 images"),  # its batch 16
    (['--easy-at', '1000'], '--easy-at 1000'),
    (['--lever-seeds', '1'], '--lever-seeds'),
    (['--image-size', '6'], '--image-size 6'),  # train.py's own check, not a copy of it
    (['--stem', '../x'], 'a plain file name'),
    (['--arms', ','], "--arms ',': names nothing"), (['--arms', ' '], 'names nothing'),  # not every arm
    (['--train', ','], 'names nothing'),
    (['--arms', '+ cosine lr decay'], 'lasts the whole run'),  # its 32-image runs end inside the warm-up
])
def test_bad_input_is_one_line_before_any_run(tmp_path, capsys, extra, expected):
    code, err = refusal(capsys, ttq.main, ladder_args(tmp_path, *extra))
    assert code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / 'runs').exists() and not (tmp_path / 'out').exists()


@pytest.mark.parametrize('made', ['missing', 'empty'])
def test_an_image_folder_without_images_is_refused_before_anything_is_made(tmp_path, capsys, made):
    folder = tmp_path / 'images'
    if made == 'empty':
        folder.mkdir()
    args = ladder_args(tmp_path, '--dataset', 'folder')
    args[args.index('--data-dir') + 1] = str(folder)
    code, err = refusal(capsys, ttq.main, args)
    assert code == 2 and len(err.splitlines()) == 1 and str(folder) in err, err
    assert not (tmp_path / 'runs').exists() and not (tmp_path / 'out').exists()


def test_a_part_that_cannot_start_is_refused_not_done(tmp_path, capsys, baseline_part):
    code, err = refusal(capsys, ttq.main, ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'speed'))
    assert code == 2 and len(err.splitlines()) == 1 and "--train speed: cannot start before part 'baseline'" in err
    assert not (tmp_path / 'runs').exists() and not (tmp_path / 'out').exists()


def test_another_ladders_runs_are_refused_and_nothing_is_deleted(tmp_path, capsys, baseline_part):
    args = ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline')
    copy_part(baseline_part, tmp_path)
    before = sorted(os.listdir(tmp_path / 'runs')), sorted(os.listdir(tmp_path / 'out' / 'ladder-runs'))
    for changed in (args + ['--eval-samples', '9'], ladder_args(tmp_path, '--ladder', 'prediction', '--stem', 'p')):
        code, err = refusal(capsys, ttq.main, changed)
        assert code == 2 and 'holds the runs of another ladder' in err and len(err.splitlines()) == 1, err
    # A fresh runs folder, but the curves beside the report are of another ladder.
    code, err = refusal(capsys, ttq.main, args + ['--eval-samples', '9', '--runs-dir', str(tmp_path / 'fresh')])
    assert code == 2 and 'made by another ladder' in err and len(err.splitlines()) == 1, err
    # Refused before any folder is made: neither the fresh runs folder nor a fresh report folder.
    code, err = refusal(capsys, ttq.main, args + ['--eval-samples', '9', '--out-dir', str(tmp_path / 'new')])
    assert code == 2 and 'holds the runs of another ladder' in err, err
    assert not (tmp_path / 'fresh').exists() and not (tmp_path / 'new').exists()
    assert (sorted(os.listdir(tmp_path / 'runs')), sorted(os.listdir(tmp_path / 'out' / 'ladder-runs'))) == before


def test_a_runs_folder_of_other_images_is_refused(tmp_path):
    from helpers import write_image_folder
    write_image_folder(tmp_path / 'a', count=40, seed=0)
    write_image_folder(tmp_path / 'b', count=40, seed=1)

    def ladder_of(folder):  # the same settings, another folder of images
        return ttq.LadderConfig(dataset='folder', data_dir=str(tmp_path / folder), image_size=16,
                                runs_dir=str(tmp_path / 'runs'))
    ttq.claim_runs_dir(ladder_of('a'), ttq.ladder_identity(ladder_of('a')))()  # made, then released
    ttq.claim_runs_dir(ladder_of('a'), ttq.ladder_identity(ladder_of('a')))()  # the same images: accepted
    with pytest.raises(ttq.ConfigError, match='holds the runs of another ladder'):
        ttq.claim_runs_dir(ladder_of('b'), ttq.ladder_identity(ladder_of('b')))
    assert os.listdir(tmp_path / 'runs') == ['ladder.json']


@pytest.mark.parametrize('damage', ['cut', 'no run key', 'empty curve'])
def test_a_damaged_curve_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch, damage, baseline_part):
    args = ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline')
    copy_part(baseline_part, tmp_path)
    path = tmp_path / 'out' / 'ladder-runs' / 'baseline-64-seed1.json'
    saved = json.loads(path.read_text())
    if damage == 'cut':
        path.write_text(path.read_text()[:50])
    else:
        saved.pop('run') if damage == 'no run key' else saved.update(curve=[])
        path.write_text(json.dumps(saved))
    code, err = refusal(capsys, ttq.main, args + ['--runs-dir', str(tmp_path / 'fresh')])
    assert code == 2 and len(err.splitlines()) == 1 and str(path) in err and 'remove it' in err, err
    assert not (tmp_path / 'fresh').exists()  # refused before any folder (and its ladder.json) is made
    path.unlink()  # as it says: the run is trained again (for real once; a stand-in run otherwise)
    if damage != 'cut':
        monkeypatch.setattr(ttq, 'train_arm', lambda job, cfg, folder: {
            'made': {}, 'img_per_s': 100.0, 'train_minutes': 0.1,
            'curve': [{'images': 32, 'score': 900.0, 'minutes': 0.1, 'eval_seconds': 0.1}]})
    assert ttq.main(args) == 0 and json.loads(path.read_text())['curve']


def snapshot(tmp_path) -> dict:
    """Every file under the ladder's folders, by content: what a refused command must leave as it was."""
    return {str(p.relative_to(tmp_path)): p.read_bytes() for p in sorted(tmp_path.rglob('*'))
            if p.is_file() and p.parts[len(tmp_path.parts)] in ('runs', 'out')}


@pytest.mark.parametrize('case', ['valid', 'a target that stops it alike', 'another target', 'other flags',
                                  'other code', 'edited', 'named in --retrain'])
def test_one_rule_reuses_refuses_or_replaces_a_finished_curve(tmp_path, capsys, monkeypatch, baseline_part, case):
    # The reuse rule (reuse_or_refuse): a curve that records the run asked for is reused; one of another
    # target (that would end the run elsewhere), other flags, other code, or edited is refused in one line
    # naming it and --retrain, with nothing trained, deleted or written; --retrain NAME replaces it.
    copy_part(baseline_part, tmp_path)
    args = ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline')
    runs = tmp_path / 'out' / 'ladder-runs'
    path = runs / 'baseline-64-seed1.json'
    saved = json.loads(path.read_text())
    first = max(json.loads((runs / f'baseline-64-seed{s}.json').read_text())['curve'][0]['score'] for s in (0, 1))
    refused = {'another target': (['--target', f'{first + 1:.1f}'],
                                  f'made to stop at --target {evaluation.DIGITS_TARGET}'),
               'other flags': ([], 'made with other settings'), 'other code': ([], 'made by other code'),
               'edited': ([], 'edited since its run wrote it')}
    if case == 'other flags':  # as code that writes the arm's flags otherwise would have made it
        saved['run']['arm']['flags'] = saved['run']['arm']['flags'][:-1]
        path.write_text(json.dumps(ttq.sealed(saved)))
    elif case == 'other code':
        monkeypatch.setattr(ttq, 'code_identity', lambda: {'hash': 'other', 'commit': 'other'})
    elif case == 'edited':
        saved['curve'][-1]['score'] *= 0.9  # a plausible value: only the digest tells
        path.write_text(json.dumps(saved))
    before = snapshot(tmp_path)
    if case in refused:
        monkeypatch.setattr(train, 'cli', lambda argv: pytest.fail('a refused command trained'))
        extra, expected = refused[case]
        code, err = refusal(capsys, ttq.main, args + extra)
        assert code == 2 and len(err.splitlines()) == 1 and expected in err and str(path.parent) in err, err
        assert '--retrain baseline-64-seed' in err and snapshot(tmp_path) == before
        return
    if case == 'named in --retrain':  # trained again (a stand-in run: the rule is under test, not training)
        trained = []

        def stand_in(job, cfg, folder):
            trained.append(job.name)
            return {'made': {}, 'curve': [{'images': 32, 'score': 900.0, 'minutes': 0.1, 'eval_seconds': 0.1},
                                          {'images': 64, 'score': 800.0, 'minutes': 0.2, 'eval_seconds': 0.1}],
                    'img_per_s': 100.0, 'train_minutes': 0.2}
        monkeypatch.setattr(ttq, 'train_arm', stand_in)
        assert ttq.main(args + ['--retrain', 'baseline-64-seed1']) == 0 and trained == ['baseline-64-seed1']
        new = json.loads(path.read_text())
        assert new['curve'][-1]['score'] == 800.0 and new['code']['hash'] == ttq.code_identity()['hash']
        assert (runs / 'baseline-64-seed0.json').read_bytes() == before['out/ladder-runs/baseline-64-seed0.json']
        assert ttq.code_identity()['hash'] in (tmp_path / 'out' / 'ladder.md').read_text()  # the report shows it
        return
    monkeypatch.setattr(train, 'cli', lambda argv: pytest.fail('a finished run was trained again'))
    alike = case == 'a target that stops it alike'
    extra = ['--target', str(evaluation.DIGITS_TARGET - 1)] if alike else []  # neither is reached
    assert ttq.main(args + extra) == 0
    assert {k: v for k, v in snapshot(tmp_path).items() if 'ladder-runs' in k} == {
        k: v for k, v in before.items() if 'ladder-runs' in k}


@pytest.mark.parametrize('field, value, expected', [
    ('score', 'abc', "score 'abc'"), ('score', float('nan'), 'score nan'), ('images', 'x', "images 'x'"),
    ('score', 1.0, 'at or above the floor'), ('minutes', -3.0, 'minutes -3.0')])
def test_impossible_values_in_a_curve_are_one_line_naming_it(tmp_path, capsys, baseline_part, field, value,
                                                            expected):
    # A curve edited so that it still parses, as the committed ones are (no digest): its values are checked.
    copy_part(baseline_part, tmp_path)
    path = tmp_path / 'out' / 'ladder-runs' / 'baseline-64-seed1.json'
    saved = json.loads(path.read_text())
    saved.pop('digest')
    saved['curve'][0][field] = value
    path.write_text(json.dumps(saved))
    cfg = ttq.parse_config(ladder_args(baseline_part), ttq.LadderConfig)  # its data: the floor computed once
    with pytest.raises(ttq.ConfigError) as error:
        ttq.reuse_or_refuse(str(path), cfg, saved['ladder'], 12.3)
    assert str(path) in str(error.value) and expected in str(error.value) and '\n' not in str(error.value)
    if field == 'images':  # and the ladder says so in its one line, before anything is written
        before = snapshot(tmp_path)
        code, err = refusal(capsys, ttq.main, ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline'))
        assert code == 2 and len(err.splitlines()) == 1 and expected in err and snapshot(tmp_path) == before, err


def test_a_run_past_an_unconfirmed_score_is_read_and_one_ending_above_its_stop_is_refused(tmp_path, baseline_part):
    # train.py stops at a score at or under --stop-at-score only when a second draw holds it there: a run may
    # train on past such a score (its curve is read), but never end above its stop with room for another
    # evaluation in its budget (refused in one line).
    copy_part(baseline_part, tmp_path)
    path = tmp_path / 'out' / 'ladder-runs' / 'baseline-64-seed1.json'
    saved = json.loads(path.read_text())
    saved.pop('digest')
    stop = saved['run']['stop_at']
    cfg = ttq.parse_config(ladder_args(baseline_part), ttq.LadderConfig)
    saved['curve'][0]['score'], saved['curve'][1]['score'] = stop - 1, stop - 2  # the first not held; the second
    path.write_text(json.dumps(saved))
    assert ttq.reuse_or_refuse(str(path), cfg, saved['ladder'], stop)['curve'][-1]['score'] == stop - 2
    saved['curve'] = saved['curve'][:1]
    saved['curve'][0]['score'] = stop + 1  # ended at 32 of 64 images, above its stop
    path.write_text(json.dumps(saved))
    with pytest.raises(ttq.ConfigError, match='its end above its stop'):
        ttq.reuse_or_refuse(str(path), cfg, saved['ladder'], stop)


def test_the_committed_report_is_the_keep_rule_on_the_committed_curves(root, monkeypatch, tmp_path):
    # results/: every committed curve read back under the reuse rule (they predate code hashes: read for a
    # report, refused beside a new run), nothing trained, and the committed report's decisions, headline,
    # runs, rule and provenance come back.
    committed = json.loads(open(os.path.join(root, 'results', 'cpu-digits-time-to-quality.json')).read())
    monkeypatch.chdir(root)  # its folders as its command gave them
    cfg = ttq.LadderConfig(**committed['config'])
    monkeypatch.setattr(ttq, 'floor_of', lambda *args: committed['floor'])  # its classifier's, not retrained here
    monkeypatch.setattr(train, 'cli', lambda argv: pytest.fail('a committed run was trained again'))
    identity = ttq.ladder_identity(cfg)
    ttq.check_curves(cfg, identity, 12.3)
    done = ttq.climb(cfg, 12.3, ttq.StopFlag(), identity, dry=True, trains=set())
    assert done['stopped_at'] is None
    got = json.loads(json.dumps(ttq.record(done, cfg, committed['floor'])))
    # Its commands now name --out-dir results, where its curves are: no longer the default (a run with the
    # defaults writes under runs/), so a command that continues this ladder must say so. Else the same.
    commands = [d['command'] for d in got['levers'].values() if d.get('command')]
    assert commands and all(' --out-dir results ' in c for c in commands)
    as_then = json.loads(json.dumps(got).replace(' --out-dir results ', ' '))
    for key in ('targets', 'fastest', 'best_peer', 'baseline_at_easy', 'levers', 'headline', 'arms', 'runs', 'rule',
                'resolution', 'run_code'):
        assert as_then[key] == committed[key], key
    # What the docs and README state of it: no lever kept (the cosine decay not confirmed on its 5 pairs,
    # in images), those screened on it judged there, the screen-passed ones pending with their commands.
    levers = got['levers']
    assert got['fastest'] == 'baseline' and not any(d['kept'] for d in levers.values())
    cosine = levers['+ cosine lr decay']
    assert (cosine['status'], cosine['n'], cosine['judged_by']) == ('not confirmed', 5, 'images') and cosine['low'] < 0
    later = list(levers)[list(levers).index('+ cosine lr decay') + 1:]
    assert all(levers[n]['elsewhere'] and levers[n]['builds_on'] == '+ cosine lr decay' for n in later)
    pending = {n: d['needs'] for n, d in levers.items() if d['status'] == 'pending'}
    assert pending == {n: 2 for n in ('+ channels-last', '+ fused Adam', '+ compile', '+ v-prediction', '+ Min-SNR-5',
                                      '+ Adam beta2 0.99', '+ peak lr 4e-3')}
    assert all(f"--stem cpu-digits-time-to-quality-confirm-{ttq.slug(n)} " in levers[n]['command'] and
               '--train baseline,' in levers[n]['command'] for n in pending)  # a new ladder: no hash here
    assert got['rule']['false_keep'] <= 0.05 and got['rule']['confirm_pairs'] == 5
    # The committed Markdown is this report as written (below its date and command): each run's commit,
    # not one for all, and the peer's screen score labelled with the run it comes from.
    ttq.report(got, dataclasses.replace(cfg, out_dir=str(tmp_path)))
    markdown = (tmp_path / 'cpu-digits-time-to-quality.md').read_text()
    body = open(os.path.join(root, 'results', 'cpu-digits-time-to-quality.md')).read().split('\n')[5:]
    assert markdown.replace(' --out-dir results ', ' ').split('\n')[5:] == body
    assert all(commit in markdown for commit in ('072fcfe', '26815be', 'fb25676', 'dea7c54', '1bb4c64', '40efe7f'))
    assert "each run's own is listed under 'The runs and their code'" in markdown.split('\n')[2]
    assert '15.26 (its 100,000-image run, seed 0)' in markdown
    with pytest.raises(ttq.ConfigError, match="recorded before curves held their code's hash"):
        ttq.refuse_unhashed(cfg)


def test_a_training_command_refuses_a_curve_recorded_before_code_hashes(tmp_path, capsys, monkeypatch, baseline_part):
    # A curve without its code's hash (as the committed ones) makes reports; a command that would train a
    # run beside it is refused in one line naming it, with nothing trained or written.
    copy_part(baseline_part, tmp_path)
    path = tmp_path / 'out' / 'ladder-runs' / 'baseline-64-seed1.json'
    saved = json.loads(path.read_text())
    del saved['code'], saved['digest']
    path.write_text(json.dumps(saved))
    monkeypatch.setattr(train, 'cli', lambda argv: pytest.fail('trained beside a curve of unknown code'))
    before = snapshot(tmp_path)
    code, err = refusal(capsys, ttq.main, ladder_args(tmp_path, '--arms', '+ channels-last', '--train',
                                                      'baseline,speed'))
    assert code == 2 and len(err.splitlines()) == 1 and str(path) in err, err
    assert "recorded before curves held their code's hash" in err and '--retrain baseline-64-seed1' in err
    assert snapshot(tmp_path) == before
    # Commands that train nothing read it: the finished part's report, and the report recomputed alone.
    assert ttq.main(ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline')) == 0
    assert recompute.main(ladder_args(tmp_path, '--arms', '+ channels-last')) == 0
    markdown = (tmp_path / 'out' / 'ladder.md').read_text()
    assert 'seed 1: ' in markdown and '(no hash)' in markdown and ttq.code_identity()['hash'] in markdown


def test_a_lever_that_passes_the_screen_waits_for_its_confirmation_pairs(monkeypatch, tmp_path):
    # v-prediction saves 39 or 40 images on each of its 3 screen pairs: it passes the screen; with 2 of
    # its 5 pairs not run and not trained by the command it is pending, and the report names the command
    # that runs them; a command that trains its part runs seeds 3 and 4 and keeps it on 5 pairs.
    made = {'baseline': lambda s: curve_in_images(300, 600 + 10 * s),
            '+ v-prediction': lambda s: curve_in_images(300, 560 + 10 * s + s % 2),
            'diffusers recipe': lambda s: curve_in_images(300, 900)}
    finished = {('baseline', s) for s in range(5)} | {('+ v-prediction', s) for s in range(3)} | {
        ('diffusers recipe', s) for s in range(5)}

    def read(job, cfg, identity, replaced=False):
        return {'run': job.identity(), 'code': {'hash': 'h'}, **made[job.arm.name](job.seed)} if (
            job.arm.name, job.seed) in finished else None
    trained = []

    def train_them(jobs, cfg, identity, stop):
        trained.extend((job.arm.name, job.seed) for job in jobs if read(job, cfg, identity) is None)
        finished.update((job.arm.name, job.seed) for job in jobs)
        return [read(job, cfg, identity) for job in jobs]
    monkeypatch.setattr(ttq, 'read_result', read)
    monkeypatch.setattr(ttq, 'run_all', train_them)
    cfg = ttq.LadderConfig(arms='+ v-prediction', seeds=5, lever_seeds=3, images=1000, screen_images=200,
                           easy_at=200, out_dir=str(tmp_path))
    done = ttq.climb(cfg, 10.0, ttq.StopFlag(), {}, dry=True, trains=set())
    decision = done['decisions']['+ v-prediction']
    assert (decision['status'], decision['needs'], decision['n'], decision['kept']) == ('pending', 2, 3, False)
    assert decision['gains'] == pytest.approx([40, 39, 40]) and done['fastest'] == 'baseline' and not trained
    command = ttq.record(done, cfg, None)['levers']['+ v-prediction']['command']
    assert command == (f"python scripts/time_to_quality.py --images 1000 --screen-images 200 --easy-at 200 "
                       f"--out-dir {tmp_path} --train quality --arms '+ v-prediction'")
    assert ttq.climb(cfg, 10.0, ttq.StopFlag(), {}, dry=True, trains={'quality'})['stopped_at'].trainable
    done = ttq.climb(dataclasses.replace(cfg, train='quality'), 10.0, ttq.StopFlag(), {})
    decision = done['decisions']['+ v-prediction']
    assert (decision['status'], decision['n']) == ('kept', 5)
    assert trained == [('+ v-prediction', 3), ('+ v-prediction', 4)]
    assert done['fastest'] == '+ v-prediction'


def test_a_damaged_ladder_json_is_one_line(tmp_path, capsys, baseline_part):
    args = ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline')
    copy_part(baseline_part, tmp_path)
    (tmp_path / 'runs' / 'ladder.json').write_text('{"ladder": ')
    code, err = refusal(capsys, ttq.main, args)
    assert code == 2 and len(err.splitlines()) == 1 and 'ladder.json: damaged' in err, err


def test_a_run_written_by_two_processes_is_never_reported(tmp_path, monkeypatch, capsys):
    def two_writers(argv):
        folder = argv[argv.index('--out-dir') + 1]
        row = {'kind': 'eval', 'images_seen': 32, 'digits_fd': 50.0, 'train_hours': 0.01, 'eval_seconds': 1}
        done = {'kind': 'done', 'step': 2, 'wall_s': 1.0, 'train_seconds': 1.0}
        with open(os.path.join(folder, 'metrics.jsonl'), 'w') as f:
            f.write('\n'.join(json.dumps(r) for r in (row, done, row, done)) + '\n')
        return 0
    monkeypatch.setattr(train, 'cli', two_writers)
    code, err = refusal(capsys, ttq.main, ladder_args(tmp_path, '--arms', '+ channels-last', '--train', 'baseline'))
    assert code == 1 and 'more than one process' in err
    assert not (tmp_path / 'out' / 'ladder-runs').exists()


def test_a_stop_in_a_runs_start_up_is_the_clean_stop(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, 'cli', lambda argv: 0)  # what train.py does when stopped before training started
    assert ttq.main(ladder_args(tmp_path, '--arms', '+ channels-last')) == 0
    assert 'no report written' in capsys.readouterr().out
    assert not (tmp_path / 'out' / 'ladder.json').exists() and not (tmp_path / 'out' / 'ladder-runs').exists()


def test_the_stem_follows_the_dataset_and_the_ladder():
    assert ttq.stem_of(ttq.LadderConfig()) == 'cpu-digits-time-to-quality'
    assert ttq.stem_of(ttq.LadderConfig(dataset='shapes')) == 'cpu-shapes-time-to-quality'
    assert ttq.stem_of(ttq.LadderConfig(ladder='prediction')) == 'cpu-digits-prediction-study'
    assert ttq.stem_of(ttq.LadderConfig(stem='mine')) == 'mine'


def test_bf16_on_a_cpu_without_it_is_refused_and_the_defaults_follow_the_capability(monkeypatch, tmp_path, capsys):
    import devices
    cpu = torch.device('cpu')
    every_lever = {'amp': 'bf16', 'compile': True, 'channels_last': True, 'fused_adam': True}
    # so that either way is seen, whatever the table holds
    monkeypatch.setattr(train_config, 'CPU_FAST_PATH', every_lever)

    def defaults():
        cfg = train.resolve_defaults(train.TrainConfig(preset='tiny'), cpu)
        return {name: getattr(cfg, name) for name in every_lever}
    for module in (devices, train_config, ttq):
        monkeypatch.setattr(module, 'cpu_has_native_bf16', lambda: False)
    assert defaults() == {'amp': 'off', 'compile': False, 'channels_last': False, 'fused_adam': False}
    code, err = refusal(capsys, train.cli, ['--device', 'cpu', '--amp', 'bf16', '--preset', 'tiny', '--out-dir',
                                            str(tmp_path / 'run')])
    assert code == 2 and 'no native bf16' in err and not (tmp_path / 'run').exists()
    assert '+ bf16' not in [lv.name for lv in ttq.speed_levers(cpu, ttq.LadderConfig())]
    monkeypatch.setattr(train_config, 'cpu_has_native_bf16', lambda: True)
    monkeypatch.setattr(ttq, 'cpu_has_native_bf16', lambda: True)
    assert defaults() == every_lever
    given = train.resolve_defaults(train.TrainConfig(preset='tiny', amp='off', compile=False), cpu)
    assert (given.amp, given.compile, given.channels_last) == ('off', False, True)  # a flag given wins
    assert '+ bf16' in [lv.name for lv in ttq.speed_levers(cpu, ttq.LadderConfig())]


def _script(root, tmp_path, *extra):  # run from the repository's root (cwd=root), as python -m runs a package
    return [sys.executable, '-m', 'time_to_quality', *ladder_args(tmp_path), *extra]


def test_a_failing_run_in_a_worker_ends_the_ladder_at_once(tmp_path, root, baseline_part):
    # A run's folder is still written by a live process (here: this test's): the worker refuses to delete or
    # share it, and its failure ends the ladder: one line naming the run, exit 1, no hang, no report. Run
    # through the old command, scripts/time_to_quality.py (a shim of python -m time_to_quality): it still runs.
    args = [sys.executable, os.path.join(root, 'scripts', 'time_to_quality.py'), *ladder_args(tmp_path), '--arms',
            '+ channels-last', '--train', 'baseline']
    copy_part(baseline_part, tmp_path)
    (tmp_path / 'out' / 'ladder-runs' / 'baseline-64-seed1.json').unlink()
    for suffix in ('json', 'md', 'png'):  # the report of the finished part
        (tmp_path / 'out' / f'ladder.{suffix}').unlink()
    held = tmp_path / 'runs' / 'baseline-64-seed1'
    (held / 'lock').write_text(json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'started': 'now'}))
    result = subprocess.run(args + ['--workers', '2'], capture_output=True, text=True, timeout=240,
                            env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith('error: ') and 'baseline, seed 1' in last and 'still written by pid' in result.stderr, last
    assert (held / 'ckpt.pt').exists()  # not deleted
    assert not (tmp_path / 'out' / 'ladder.json').exists()  # no report


def test_a_stop_stops_the_ladder_without_a_report_and_the_rerun_continues(tmp_path, root):
    args = _script(root, tmp_path, '--arms', '+ channels-last', '--images', '1600',
                   '--screen-images', '1600', '--eval-every', '800', '--easy-at', '800', '--seeds', '2',
                   '--lever-seeds', '2')  # two seeds: the rerun's part stays short
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root)
    metrics = tmp_path / 'runs' / 'baseline-1600-seed0' / 'metrics.jsonl'
    deadline = time.time() + 120
    while not (metrics.exists() and '"kind": "eval"' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.2)  # its first evaluation, half-way: the second half is training
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and 'no report written' in out, err[-2000:]
    assert 'baseline-1600-seed0: stopped; the ladder does not resume its runs' in out
    assert not (tmp_path / 'out' / 'ladder.json').exists()  # nothing built on a cut run
    assert not (tmp_path / 'out' / 'ladder-runs').exists()
    assert not (tmp_path / 'runs' / 'baseline-1600-seed1').exists()  # the ladder did not go on
    rerun = subprocess.run(args + ['--train', 'baseline'], capture_output=True, text=True, timeout=300, cwd=root)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    curve = json.loads((tmp_path / 'out' / 'ladder-runs' / 'baseline-1600-seed0.json').read_text())
    assert [p['images'] for p in curve['curve']] == [800, 1600]


def children_of(pid: int) -> set:
    found = set()
    for task in os.listdir(f'/proc/{pid}/task'):
        with open(f'/proc/{pid}/task/{task}/children') as f:
            found |= {int(p) for p in f.read().split()}
    return found


def alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().split(')')[-1].split()[0] != 'Z'
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists('/proc/self/task'), reason='reads children from /proc (Linux)')
def test_workers_die_with_a_killed_ladder_and_the_rerun_reports_no_mixed_run(tmp_path, root):
    args = _script(root, tmp_path, '--arms', '+ channels-last', '--workers', '2', '--train', 'baseline', '--images',
                   '1600', '--screen-images', '1600', '--eval-every', '800',
                   '--easy-at', '800', '--seeds', '2', '--lever-seeds', '2')  # the two runs the workers hold
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=root)
    started = [tmp_path / 'runs' / f'baseline-1600-seed{s}' / 'metrics.jsonl' for s in (0, 1)]
    deadline = time.time() + 180
    while not all(m.exists() and '"kind": "train"' in m.read_text() for m in started) and time.time() < deadline:
        time.sleep(0.2)
    workers = {p for p in children_of(process.pid) if alive(p)}
    assert len(workers) >= 2
    process.kill()  # kill -9: no handler runs in the ladder
    process.wait()
    deadline = time.time() + 60
    while any(alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in workers), 'a worker trained on after its ladder was killed'
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    for seed in (0, 1):
        rows = [json.loads(x) for x in (tmp_path / 'runs' / f'baseline-1600-seed{seed}' / 'metrics.jsonl').open()]
        assert sum(r.get('kind') == 'done' for r in rows) == 1
        curve = json.loads((tmp_path / 'out' / 'ladder-runs' / f'baseline-1600-seed{seed}.json').read_text())['curve']
        assert [p['images'] for p in curve] == [800, 1600]


def test_each_lever_changes_the_settings_it_names_and_no_other(monkeypatch):
    # The arms are data: a typo in one (a flag that means something else, a value off by ten) would
    # measure another lever under its name. Each lever's resolved config differs from the ladder's
    # common one in exactly the fields below (on a CPU without native bf16, so that no speed lever is
    # already a default of this machine).
    monkeypatch.setattr(train_config, 'cpu_has_native_bf16', lambda: False)
    cfg = ttq.LadderConfig()
    base = dataclasses.asdict(ttq.ours(cfg))
    expected = {'+ channels-last': {'channels_last': True}, '+ fused Adam': {'fused_adam': True},
                '+ compile': {'compile': True}, '+ v-prediction': {'prediction': 'v'},
                '+ Min-SNR-5': {'loss_weight': 'min-snr', 'snr_gamma': 5.0},
                '+ batch 64': {'batch_size': 64, 'lr': 3e-3},
                '+ cosine lr decay': {'lr_decay': 'cosine'}, '+ log-normal t': {'t_sampling': 'lognormal'},
                '+ Laplace t': {'t_sampling': 'laplace'}, '+ input perturbation': {'input_perturbation': 0.1},
                '+ Adam beta2 0.99': {'adam_beta2': 0.99}, '+ EMA half-life 5%': {'ema_length': 0.05},
                '+ immiscible noise': {'immiscible': True},
                '+ reweighted log-normal t': {'t_sampling': 'lognormal', 't_reweight': True},
                '+ reweighted Laplace t': {'t_sampling': 'laplace', 't_reweight': True},
                '+ peak lr 4e-3': {'lr': 2 * base['lr']}, '+ dropout 0.1': {'dropout': 0.1},
                '+ warm-up 500': {'warmup': 10 * base['warmup']}}
    levers = [lv for lv in ttq.speed_levers(torch.device('cpu'), cfg) if lv.name != '+ bf16']
    assert [lv.name for lv in levers] == list(expected)
    for lever in levers:
        got = dataclasses.asdict(train_config.check_flags(ttq.base_flags(cfg) + lever.flags))
        assert {k: v for k, v in got.items() if v != base[k]} == expected[lever.name], lever.name

"""The scripts under scripts/, each run end to end in its quick form: the samplers' accuracy
study and the digits score's checks (the time-to-quality ladder: test_time_to_quality.py)."""
import dataclasses
import json
import math
import os
import re

import digits_figure
import digits_score
import pytest
import solver_accuracy
from helpers import refusal, train_args

import train
from time_to_quality import ladder


def test_solver_accuracy_against_exact_answers(tmp_path, monkeypatch):
    # The quick form: the 2-D Gaussian mixture with its exact denoiser, and a trained checkpoint's
    # distance to its 1000-call ODE solution. Its report goes under runs/ by default, never into results/.
    assert train.cli(train_args(tmp_path, '--steps', '2', '--sample-every', '0')) == 0
    monkeypatch.chdir(tmp_path)
    assert solver_accuracy.main(['--quick', '--stem', 'acc', '--sample-batch', '4',
                                 '--ckpt', str(tmp_path / 'run' / 'ckpt.pt')]) == 0
    assert not (tmp_path / 'results').exists()
    tmp_path = tmp_path / 'runs' / 'solver-accuracy'
    result = json.loads((tmp_path / 'acc.json').read_text())
    rows = {(r['data'][:7], r['sampler'], r['calls']): r for r in result['rows']}
    assert {calls for _, _, calls in rows} == {5, 20}
    for sampler in ('ddim', 'dpm++-linspace', 'dpm++-trailing', 'dpm++-logsnr'):
        assert rows['gaussia', sampler, 20]['to_ode'] < rows['gaussia', sampler, 5]['to_ode']
        assert rows['trained', sampler, 20]['to_ode'] < rows['trained', sampler, 5]['to_ode']
    assert rows['gaussia', 'ddpm', 5]['to_ode'] is None and ('trained', 'ddpm', 5) not in rows
    assert rows['gaussia', 'dpm++-logsnr', 20]['sliced_w1'] < rows['gaussia', 'ddim', 20]['sliced_w1']
    assert rows['trained', 'ddim-clip-x0', 20]['to_ode_levels'] == rows['trained', 'ddim-clip-x0', 20]['to_ode'] * 127.5
    assert 0 < result['floor']['sliced_w1'] < 0.05 and result['torch'] and result['command']
    assert (tmp_path / 'acc.png').read_bytes()[:4] == b'\x89PNG' and '| Data |' in (tmp_path / 'acc.md').read_text()


def test_the_digits_score_check_orders_its_sets(tmp_path, digits_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its report goes under runs/ by default, never into results/
    assert digits_score.main(['--image-size', '8', '--data-dir', digits_cache]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ['runs']
    report = tmp_path / 'runs' / 'digits-score' / 'digits-score-8.json'
    rows = {r['set']: r for r in json.loads(report.read_text())['rows']}
    for key in ('digits_fd', 'digits_class_fd'):  # the plain FD and the score that decides, from one run
        floor = rows['held-out digits (the floor)'][key]
        assert rows['uniform noise'][key] > 5 * floor and rows['held-out digits, pixels shuffled'][key] > 5 * floor
        blur = [rows[f'held-out digits, Gaussian blur sigma {s}'][key] for s in (0.5, 1.0, 1.5, 2.0, 3.0)]
        assert blur == sorted(blur) and blur[0] > floor, key
        half = [rows[f'held-out digits, a random half mirrored (draw {k} of 5)'][key] for k in range(1, 6)]
        assert min(half) > 1.5 * floor and rows['held-out digits, all mirrored'][key] > max(half), key
        collapsed = [name for name in rows if name.startswith('only 1s and 7s')]
        balanced = [name for name in rows if name.startswith('training digits, balanced')]
        assert rows[collapsed[0]][key] > 5 * rows[balanced[0]][key], key


def test_a_stop_of_the_noise_table_keeps_the_checkpoints_measured(tmp_path, monkeypatch, capsys):
    # SIGTERM while the second checkpoint's pool is drawn: it is measured, the report holds the first two
    # (written after each), the third is never drawn, exit 0. Stand-ins for the checkpoints, the sampler and
    # the judge: the loop is under test, not the score.
    import os
    import signal
    import types

    import torch
    monkeypatch.setattr(digits_score.sample, 'load_model', lambda *args, **kwargs: (
        None, types.SimpleNamespace(in_channels=1, image_size=16), None, 'eps'))
    floor = {'digits_fd': 7.0, 'digits_class_fd': 40.0}
    monkeypatch.setattr(digits_score.evaluation, 'DigitsJudge', lambda *args: types.SimpleNamespace(
        floor=floor, features=lambda images: images.flatten(1).double().numpy(), score=lambda features, kid=True: {
            'digits_fd': 10.0 + float(features.mean()), 'digits_class_fd': 50.0 + float(features.mean()),
            'digits_confident': 0.9}))
    drawn = []

    def draw(model, config, sched, sampling, device, **kwargs):
        drawn.append(sampling.num)
        if len(drawn) == 2:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                pytest.fail('no stop handling: a SIGTERM would kill the script and lose the checkpoints measured')
            os.kill(os.getpid(), signal.SIGTERM)
        yield torch.randint(0, 256, (sampling.num, 1, 16, 16), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(len(drawn)))
    monkeypatch.setattr(digits_score, 'draw', draw)
    assert digits_score.main(['--ckpt', 'a.pt,b.pt,c.pt', '--pool', '4000', '--out-dir', str(tmp_path),
                              '--data-dir', str(tmp_path / 'data')]) == 0
    result = json.loads((tmp_path / 'digits-score-16-noise-10.json').read_text())
    assert drawn == [4000, 4000] and [d['ckpt'] for d in result['checkpoints']] == ['a.pt', 'b.pt']
    assert not result['complete'] and result['stopped'] == 'SIGTERM' and result['planned'] == 3
    assert 'stopped by SIGTERM after 2 of 3 checkpoints' in capsys.readouterr().out


@pytest.mark.parametrize('script, args, expected', [
    (digits_figure, [], '--ckpt is required'),
    (digits_figure, ['--ckpt', 'x.pt', '--scale', '0'], '--scale must be in [1, 32]'),
    (digits_score, ['--image-size', '4'], '--image-size must be in [8, 256]'),
    (digits_figure, ['--ckpt', 'x.pt', '--out', 'fig.jpg'], 'a file name ending in .png'),
    (digits_figure, ['--ckpt', 'x.pt', '--out', 'a-file/fig.png'], '--out a-file: cannot write there'),
    (digits_figure, ['--ckpt', 'missing.pt', '--out', 'new/fig.png'], 'missing.pt'),  # new/ is not created
    (digits_score, ['--image-size', '8', '--data-dir', 'a-file/cache'], '--data-dir a-file/cache: cannot write'),
    (ladder, ['--out-dir', 'a-file/out'], '--out-dir a-file/out: cannot write there'),
    (ladder, ['--runs-dir', 'a-file/runs'], '--runs-dir a-file/runs: cannot write there'),
    (digits_score, ['--bogus'], 'unrecognized arguments'),
    (digits_score, ['--pool', '5000'], '--pool 5000 measures checkpoints: pass --ckpt'),  # not ignored
    (digits_score, ['--ckpt', 'x.pt', '--pool', '1000'], '--pool must be in [4000, 1000000]'),
    (digits_score, ['--ckpt', 'x.pt', '--stem', '../x'], 'a plain file name'),
    (solver_accuracy, ['--sample-batch', '0'], '--sample-batch must be at least 1'),
    (solver_accuracy, ['--stem', 'a/b'], 'a plain file name'),
    (ladder, ['--eval-samples', '1'], '--eval-samples must be at least 2'),
    (ladder, ['--workers', '0'], '--workers must be at least 1'),
    (ladder, ['--images', '100'], 'before its first evaluation'),
    (ladder, ['--stem', '../x'], 'a plain file name'),
])
def test_the_scripts_refuse_bad_flags_in_one_line_and_write_nothing(script, args, expected, tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)  # where their default output folders would be
    (tmp_path / 'a-file').write_text('not a folder')
    code, err = refusal(capsys, script.main, args)
    assert code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ['a-file']



@pytest.mark.parametrize('script', ['time_demo', 'solver_accuracy', 'digits_score', 'guidance_sweep', 'few_step_study',
                                    'digits_figure', 'study_pairs', 'time_to_quality.arm_speed',
                                    'time_to_quality.ladder'])
def test_no_script_writes_into_the_committed_evidence_unless_told(script):
    # results/ and the README's pictures change only when a command names them: a short run with the
    # defaults (the ones tested end to end above write there) never replaces a committed report.
    import importlib

    from cli import parse_config
    module = importlib.import_module(script)
    config_class = next(c for c in vars(module).values() if dataclasses.is_dataclass(c) and isinstance(c, type)
                        and c.__module__ == module.__name__ and c.__name__.endswith('Config'))
    config = parse_config([], config_class)
    out = os.path.normpath(getattr(config, 'out_dir', None) or config.out)
    assert out.split(os.sep)[0] == 'runs', (script, out)


# ----------------------------------------------------------------------------- the README's demo, timed whole

def test_the_readme_runs_the_demo_command_that_time_demo_times():
    import shlex

    import time_demo
    import train_config
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for page in ('README.md', 'docs/training.md'):  # the README's command, and the copy in the CPU demo's page
        text = open(os.path.join(root, page)).read()
        command = re.search(r'python train\.py --recipe .*?\n', text).group(0)
        assert shlex.split(command.split('#')[0]) == ['python', 'train.py', *time_demo.DEMO_FLAGS], page
    # The flags the recipe stands for, as docs/training.md writes them out.
    text = open(os.path.join(root, 'docs/training.md')).read()
    command = re.search(r'python train\.py --dataset digits .*?(?<!\\)\n', text, re.S).group(0)
    assert shlex.split(command.replace('\\\n', ' '))[2:] == list(train_config.RECIPES['digits-demo'])
    recipe = train_config.check_flags(time_demo.DEMO_FLAGS)
    assert recipe.recipe == 'digits-demo'
    assert dataclasses.replace(recipe, recipe='') == train_config.check_flags(list(train_config.RECIPES['digits-demo']))


def test_time_demo_times_each_seed_from_a_fresh_folder_and_keeps_the_seeds_done(tmp_path, monkeypatch, capsys):
    import types

    import time_demo
    launched = []

    class FakeRun:  # what train.py leaves: its metrics.jsonl, stopped at the evaluation that reached 12.3
        def __init__(self, command):
            launched.append(command)
            seed, out = int(command[command.index('--seed') + 1]), command[command.index('--out-dir') + 1]
            os.makedirs(out)
            target = time_demo.TARGET  # the first above it, the second under it and held when drawn again
            rows = [eval_row(12_500, 0.01, 2 * target),
                    {**eval_row(25_000 * (seed + 1), 0.02 * (seed + 1), target - seed),
                     'digits_class_fd_confirm': target - 1}, {'kind': 'done', 'wall_s': 90.0 * (seed + 1)}]
            with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
                f.writelines(json.dumps(r) + '\n' for r in rows)

        def wait(self):
            return 0
    monkeypatch.setattr(time_demo, 'subprocess', types.SimpleNamespace(Popen=FakeRun))  # git's stays real
    args = ['--seeds', '2', '--runs-dir', str(tmp_path / 'runs'), '--out-dir', str(tmp_path / 'out')]
    assert time_demo.main(args) == 0
    data_dirs = [c[c.index('--data-dir') + 1] for c in launched]
    assert len(set(data_dirs)) == 2 and all(c[2:2 + len(time_demo.DEMO_FLAGS)] == time_demo.DEMO_FLAGS
                                            for c in launched)
    result = json.loads((tmp_path / 'out' / 'cpu-digits-demo.json').read_text())
    assert [s['images'] for s in result['seeds']] == [25_000, 50_000]
    assert [s['train_minutes'] for s in result['seeds']] == pytest.approx([1.2, 2.4])
    assert [s['loop_minutes'] for s in result['seeds']] == pytest.approx([1.5, 3.0])
    assert result['seeds'][0]['img_per_s'] == pytest.approx(25_000 / 72)
    assert result['summary']['reached'] == 2 and result['summary']['within_goals'] == 1  # seed 1: 2.4 training min
    assert result['summary']['images']['sd'] == pytest.approx(17_677.67, abs=0.01)
    assert [s['eval_share'] for s in result['seeds']] == pytest.approx([2 / 72, 2 / 144])  # 1 s an evaluation
    assert [s['score_again'] for s in result['seeds']] == [time_demo.TARGET - 1] * 2
    code, err = refusal(capsys, time_demo.main, args)  # the folders are there now: refused before any run
    assert code == 2 and 'seed0 is there already' in err and len(launched) == 2
    (tmp_path / 'a-file').write_text('not a folder')
    for bad, message in ((['--stem', ''], 'a plain file name'), (['--out-dir', str(tmp_path / 'a-file' / 'out')],
                                                                   'cannot write there')):
        code, err = refusal(capsys, time_demo.main, ['--runs-dir', str(tmp_path / 'runs2'), *bad])
        assert code == 2 and message in err and len(launched) == 2  # before the first seed's ten minutes


def eval_row(images: int, hours: float, score: float) -> dict:
    """An evaluation row of a digits run, as train.py writes it (the fields time_demo reads)."""
    return {'kind': 'eval', 'images_seen': images, 'train_hours': hours, 'digits_class_fd': score,
            'digits_confident': 0.9, 'eval_seconds': 1.0}


def test_a_stop_of_time_demo_stops_its_run_and_keeps_the_seeds_timed(tmp_path, monkeypatch, capsys):
    import signal
    import types

    import time_demo
    signals = []

    class FakeRun:
        def __init__(self, command):
            self.seed, self.waits = int(command[command.index('--seed') + 1]), 0
            out = command[command.index('--out-dir') + 1]
            os.makedirs(out)
            with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
                f.write(json.dumps(eval_row(100_000, 0.05, 11.0)) + '\n' + json.dumps({'kind': 'done', 'wall_s': 200.0})
                        + '\n')

        def wait(self):
            self.waits += 1
            if self.seed == 1 and self.waits == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the script is stopped while seed 1 trains
            return 0

        def send_signal(self, signum):
            signals.append((self.seed, signum))
    monkeypatch.setattr(time_demo, 'subprocess', types.SimpleNamespace(Popen=FakeRun))
    args = ['--seeds', '3', '--runs-dir', str(tmp_path / 'runs'), '--out-dir', str(tmp_path / 'out')]
    assert time_demo.main(args) == 0
    assert signals == [(1, signal.SIGTERM)] and 'seed 1 not timed' in capsys.readouterr().err
    result = json.loads((tmp_path / 'out' / 'cpu-digits-demo.json').read_text())
    assert [s['seed'] for s in result['seeds']] == [0] and not (tmp_path / 'runs' / 'seed2').exists()
    assert not isinstance(signal.getsignal(signal.SIGTERM), time_demo.StopFlag)  # the handlers put back


@pytest.mark.parametrize('exit_code, rows, code, message', [
    (3, [], 3, 'exited with 3'),  # a NaN loss: train.py's own code, not a usage error's 2
    (0, [{'kind': 'eval', 'images_seen': 12_500, 'train_hours': 0.01, 'digits_class_fd': 40.0}], 1, 'did not finish'),
])  # the second: a run stopped from outside (exit 0, no 'done' row) is not timed as a finished seed
def test_time_demo_does_not_time_a_failed_or_unfinished_run(exit_code, rows, code, message, tmp_path, monkeypatch,
                                                             capsys):
    import types

    import time_demo

    class FakeRun:
        def __init__(self, command):
            out = command[command.index('--out-dir') + 1]
            os.makedirs(out)
            with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
                f.writelines(json.dumps(r) + '\n' for r in rows)

        def wait(self):
            return exit_code
    monkeypatch.setattr(time_demo, 'subprocess', types.SimpleNamespace(Popen=FakeRun))
    got, err = refusal(capsys, time_demo.main, ['--seeds', '2', '--runs-dir', str(tmp_path / 'runs'), '--out-dir',
                                                str(tmp_path / 'out')])
    assert got == code and message in err and len(err.splitlines()) == 1
    assert not list((tmp_path / 'out').iterdir()) and not (tmp_path / 'runs' / 'seed1').exists()  # ended at seed 0


def test_no_committed_result_or_page_names_a_local_path():
    # A path of the machine that made a result (/tmp/..., a home folder) serves no reader: a checkpoint
    # is named by the command and commit that made it, a folder by a placeholder (DATA_DIR, OUT_DIR, CKPT).
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    local = re.compile(r'(?<![\w.])/(?:tmp|root|home|work|Users)/\S')
    pages = [root / 'README.md', *(root / 'docs').glob('*.md'), *(p for p in (root / 'results').rglob('*')
                                                                  if p.suffix in ('.md', '.json', '.jsonl', '.log'))]
    named = [f'{p.relative_to(root)}: {m.group(0)}' for p in pages for m in local.finditer(p.read_text())]
    assert not named, named[:10]


NUMBER = r'(?<![\d.,])\d[\d,]*(?:\.\d+)?(?:%|x)?'  # 5,750 or 4.08 or 52.7% or 1.07x, whole


def readme_tables_and_sources(text: str) -> list:
    """(section title, results files it links, numeric cells of its tables) for each README section
    that links a file in results/."""
    found = []
    for section in re.split(r'\n(?=## )', text):
        sources = [a or b for a, b in re.findall(r'\((results/[\w./-]+\.md)\)|\]: (results/[\w./-]+\.md)', section)]
        cells = [cell.strip() for line in section.splitlines() if line.startswith('| ') and ':-' not in line
                 for cell in line.strip('|').split('|')]
        numbers = [n for cell in cells if cell[:1].isdigit() for n in re.findall(NUMBER, cell)]
        if sources:
            found.append((section.splitlines()[0], sources, numbers))
    return found


def test_the_readme_tables_hold_the_figures_of_the_results_they_cite():
    # A figure of a README table is copied from the result file its section links, never typed: each number
    # of a table's cells appears in one of those files as written there (a whole number there, not a part of one).
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    sections = readme_tables_and_sources((root / 'README.md').read_text())
    assert {'## Speed on a GPU', '## On a CPU: minutes to a digits score'} <= {title for title, _, _ in sections}
    for title, sources, numbers in sections:
        written = {n for source in sources for n in re.findall(NUMBER, (root / source).read_text())}
        written |= {n.rstrip(',.') for n in written}  # a number that ends a clause
        missing = [n for n in numbers if n not in written]
        assert not missing, f'{title}: {missing} are in no file of {sources}'
    assert sum(len(numbers) for _, _, numbers in sections) >= 25


def test_the_readme_check_finds_a_typed_figure():
    section = '## S\n\n([a](results/x.md))\n\n| a | b |\n| :- | -: |\n| row | 5,750 +- 12 |\n| fp32 | 1.07x |\n'
    assert readme_tables_and_sources(section) == [('## S', ['results/x.md'], ['5,750', '12', '1.07x'])]


def test_reports_name_no_path_of_the_machine_that_made_them(tmp_path):
    # write_report keeps a path inside the repository relative to it, and one elsewhere (a scratch folder,
    # a checkpoint on another disk) as its last two parts: nothing a reader cannot use.
    import reports
    outside = str(tmp_path / 'runs' / 'teacher' / 'ckpt.pt')
    inside = os.path.join(reports.ROOT, 'results', 'x.md')
    result = {'device': 'cpu', 'torch': '2', 'date': 'today', 'commit': 'abc',
              'command': f'python x.py --ckpt {outside}',
              'config': {'ckpt': outside, 'out_dir': inside, 'url': 'https://example.org/tmp/kept'}}
    reports.write_report(str(tmp_path), 'r', result, f'Study of {outside}', f'| {outside} |', notes=f'; {inside}')
    for name in ('r.json', 'r.md'):
        text = (tmp_path / name).read_text()
        assert str(tmp_path) not in text and '.../teacher/ckpt.pt' in text and 'results/x.md' in text, text
        assert reports.ROOT not in text
    assert 'https://example.org/tmp/kept' in (tmp_path / 'r.json').read_text()  # not a path of this machine
    assert json.loads((tmp_path / 'r.json').read_text())['config']['out_dir'] == os.path.join('results', 'x.md')


@pytest.mark.parametrize('root', ['/check/work/main', '/opt/ddpm', '/tmp/ddpm'])
def test_reports_make_the_repository_relative_wherever_it_lies(monkeypatch, root):
    # A clone in a folder of no usual name (CI's /check, /opt) is still the repository: its paths become relative.
    import reports
    monkeypatch.setattr(reports, 'ROOT', root)
    text = f'cd {root} && python x.py --out-dir {root}/results/few, then {root}-old/x and /tmp/scratch/run/ckpt.pt'
    assert reports.portable(text) == ('cd . && python x.py --out-dir results/few, then '
                                      + reports.portable(f'{root}-old/x') + ' and .../run/ckpt.pt')
    assert f'{root}/' not in reports.portable(text)


# ----------------------------------------------------------------------------- a screen's reports, paired

def study_report(path, teacher_sha, scores, lr, seeds=(0, 1)):
    """A few_step_study JSON as the study writes it: score rows per (model, solver, calls, seed) and what made
    each model. `scores`: {(model, solver, calls): [score per seed]}."""
    import few_step_study
    rows = [{'model': model, 'sampler': solver, 'calls': calls, 'evaluations': calls, 'seed': seed,
             few_step_study.SCORE: value}
            for (model, solver, calls), values in scores.items() for seed, value in zip(seeds, values)]
    students = {model: {'distill': {'lr': lr, 'ema_decay': 0.0}} for model, _, _ in scores if model != 'teacher'}
    path.write_text(json.dumps({'device': 'CPU', 'scores': {'unconditional': rows}, 'made_by': {
        'unconditional': {'teacher': {'sha256': teacher_sha}, 'students': students}}}))
    return str(path)


def test_study_pairs_pairs_each_arms_students_by_seed_with_the_base_and_the_teachers_best(tmp_path, capsys):
    import study_pairs
    teacher = {('teacher', 'dpm++', 20): [50.0, 80.0], ('teacher', 'unipc', 20): [40.0, 110.0]}  # means 65, 75
    base = study_report(tmp_path / 'base.json', 'T', {**teacher, ('consistency-1', 'consistency', 1): [100.0, 160.0]},
                        2e-4)
    arm = study_report(tmp_path / 'faster.json', 'T', {**teacher, ('consistency-1', 'consistency', 1): [90.0, 176.0]},
                       4e-4)
    out = tmp_path / 'out'
    assert study_pairs.main(['--base', base, '--arms', arm, '--out-dir', str(out), '--stem', 'screen']) == 0
    rows = {row['arm']: row for row in json.loads((out / 'screen.json').read_text())['rows']}
    # By hand: to the best at 20 (DPM-Solver++, the lower mean): sqrt(100/50 * 160/80) = 2 exactly for the base;
    # the arm over the base: sqrt(0.9 * 1.1) = 0.99499, its interval from the logs' spread, 1 degree of freedom.
    assert rows['base']['vs_teacher20']['ratio'] == pytest.approx(2.0) and rows['base']['vs_base'] is None
    got = rows['faster']['vs_base']
    assert got['ratio'] == pytest.approx((0.9 * 1.1) ** 0.5) and got['pairs'] == 2
    half = 12.706205 * abs(math.log(1.1) - math.log(0.9)) / 2 ** 0.5 / 2 ** 0.5  # t(0.975, 1) sd / sqrt(2)
    assert got['low'] == pytest.approx(got['ratio'] * math.exp(-half), rel=1e-5)
    assert rows['faster']['settings']['lr'] == 4e-4 and '| faster | consistency-1 | 0.0004 |' in (
        out / 'screen.md').read_text()


def test_study_pairs_shows_each_student_the_settings_its_method_reads():
    import study_pairs
    shared = {'lr': 4e-4, 'level_mean': 0.0, 'ode_step': 'teacher', 'stages': 8, 'first_stage_steps': 1000}
    consistency = study_pairs.settings_of({**shared, 'method': 'consistency'})
    progressive = study_pairs.settings_of({**shared, 'method': 'progressive'})
    assert consistency['ode_step'] == 'teacher' and consistency['stages'] == 8 and consistency['level_mean'] == 0.0
    assert consistency['first_stage_steps'] == '' and progressive['first_stage_steps'] == 1000
    assert progressive['lr'] == consistency['lr'] == 4e-4
    assert all(progressive[key] == '' for key in ('level_mean', 'level_std', 'ode_step', 'huber_c', 'stages'))
    assert progressive['dropout'] == '' and study_pairs.settings_of({'dropout': 0.1, 'method': 'consistency'})[
        'dropout'] == 0.1  # progressive distillation keeps the teacher's dropout: not a setting of its own
    before = study_pairs.settings_of({'method': 'progressive', 'steps_per_stage': 1000, 'first_stage_steps': None})
    assert before['first_stage_steps'] == 1000  # made before --first-stage-steps: its first stage as long as the rest
    old = study_pairs.settings_of({'lr': 2e-4, 'method': 'consistency'})  # made before --level-mean had its flag
    assert (old['level_mean'], old['level_std']) == (study_pairs.students.ECT_P_MEAN, study_pairs.students.ECT_P_STD)


@pytest.mark.parametrize('case', ['teacher', 'seeds', 'missing', 'junk', 'required'])
def test_study_pairs_refuses_arms_that_do_not_pair_in_one_line(case, tmp_path, capsys):
    import study_pairs
    scores = {('teacher', 'dpm++', 20): [50.0, 80.0], ('consistency-1', 'consistency', 1): [100.0, 160.0]}
    base = study_report(tmp_path / 'base.json', 'T', scores, 2e-4)
    (tmp_path / 'junk.json').write_text('[1, 2]')
    arms, says = {
        'teacher': (study_report(tmp_path / 'a.json', 'U', scores, 4e-4), 'another teacher'),
        'seeds': (study_report(tmp_path / 'b.json', 'T', scores, 4e-4, seeds=(0, 2)), 'pairs need the same seeds'),
        'missing': (str(tmp_path / 'none.json'), 'no such file'),
        'junk': (str(tmp_path / 'junk.json'), 'not a few_step_study report'),
        'required': ('', '--base and --arms are required'),
    }[case]
    code, err = refusal(capsys, study_pairs.main, ['--base', base, '--arms', arms, '--out-dir', str(tmp_path / 'out')])
    assert code == 2 and says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / 'out').exists()

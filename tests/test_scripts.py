"""The scripts under scripts/, each run end to end in its quick form: the samplers' accuracy
study, the digits score's checks, and the images-to-quality study of v-prediction and Min-SNR."""
import json

import digits_figure
import digits_score
import prediction_study
import pytest
import solver_accuracy
from helpers import refusal, train_args

import train


def test_solver_accuracy_against_exact_answers(tmp_path):
    # The quick form: the 2-D Gaussian mixture with its exact denoiser, and a trained checkpoint's
    # distance to its 1000-call ODE solution.
    assert train.cli(train_args(tmp_path, '--steps', '2', '--sample-every', '0')) == 0
    assert solver_accuracy.main(['--quick', '--out-dir', str(tmp_path), '--stem', 'acc', '--sample-batch', '4',
                                 '--ckpt', str(tmp_path / 'run' / 'ckpt.pt')]) == 0
    result = json.loads((tmp_path / 'acc.json').read_text())
    rows = {(r['data'][:7], r['sampler'], r['calls']): r for r in result['rows']}
    assert {calls for _, _, calls in rows} == {5, 20}
    for sampler in ('ddim', 'dpm++-time', 'dpm++-logsnr'):
        assert rows['gaussia', sampler, 20]['to_ode'] < rows['gaussia', sampler, 5]['to_ode']
        assert rows['trained', sampler, 20]['to_ode'] < rows['trained', sampler, 5]['to_ode']
    assert rows['gaussia', 'ddpm', 5]['to_ode'] is None and ('trained', 'ddpm', 5) not in rows
    assert rows['gaussia', 'dpm++-logsnr', 20]['sliced_w1'] < rows['gaussia', 'ddim', 20]['sliced_w1']
    assert rows['trained', 'ddim-clip-x0', 20]['to_ode_levels'] == rows['trained', 'ddim-clip-x0', 20]['to_ode'] * 127.5
    assert 0 < result['floor']['sliced_w1'] < 0.05 and result['torch'] and result['command']
    assert (tmp_path / 'acc.png').read_bytes()[:4] == b'\x89PNG' and '| Data |' in (tmp_path / 'acc.md').read_text()


def test_the_digits_score_check_orders_its_sets(tmp_path):
    assert digits_score.main(['--image-size', '8', '--data-dir', str(tmp_path), '--out-dir', str(tmp_path)]) == 0
    rows = {r['set']: r for r in json.loads((tmp_path / 'digits-score-8.json').read_text())['rows']}
    floor = rows['held-out digits (the floor)']['digits_fd']
    assert rows['uniform noise']['digits_fd'] > 20 * floor
    blur = [rows[f'held-out digits, Gaussian blur sigma {s}']['digits_fd'] for s in (0.5, 1.0, 1.5, 2.0, 3.0)]
    assert blur == sorted(blur)


def test_the_prediction_study_reports_images_to_the_recipes_score(tmp_path):
    small = ['--images', '64', '--eval-every', '32', '--seeds', '2', '--batch-size', '16', '--eval-samples', '64',
             '--runs-dir', str(tmp_path / 'runs'), '--data-dir', str(tmp_path / 'data'), '--out-dir', str(tmp_path)]
    assert prediction_study.main(small + ['--stem', 'study']) == 0
    result = json.loads((tmp_path / 'study.json').read_text())
    assert set(result['settings']) == set(prediction_study.SETTINGS)
    paper = result['settings']['paper (eps, uniform)']
    assert paper['final_mean'] == result['targets']['final'] and len(paper['finals']) == 2
    for curves in result['curves'].values():
        assert [[p['images'] for p in run] for run in curves] == [[32, 64]] * 2
        assert all(run[-1]['heldout_loss_ema'] > 0 and run[-1]['train_minutes'] > 0 for run in curves)
    # A finished study is not trained again: the runs' folders are reused (here by two worker processes).
    assert prediction_study.main(small + ['--stem', 'again', '--workers', '2']) == 0
    assert json.loads((tmp_path / 'again.json').read_text())['curves'] == result['curves']


def test_images_to_reach_interpolates_in_log_images_and_log_score():
    curve = [{'images': 100, 'score': 40.0}, {'images': 200, 'score': 10.0}, {'images': 400, 'score': 5.0}]
    # 20 lies half-way between 40 and 10 in log score, so half-way between 100 and 200 in log images.
    assert prediction_study.images_to_reach(curve, 20.0) == pytest.approx(100 * 2 ** 0.5)
    assert prediction_study.images_to_reach(curve, 50.0) == 100  # reached at the first evaluation
    assert prediction_study.images_to_reach(curve, 10.0) == pytest.approx(200)
    assert prediction_study.images_to_reach(curve, 4.0) is None


def test_the_study_summary_pairs_seeds_and_names_both_targets():
    def curve(*scores):
        return [{'images': 100 * (i + 1), 'score': s} for i, s in enumerate(scores)]
    paper_runs = [curve(80, 40, 10, 10), curve(80, 40, 20, 10)]  # reach 10 at 300 and 400 images
    curves = {name: paper_runs for name in prediction_study.SETTINGS}
    curves['v-prediction'] = [curve(40, 20, 10, 9.5), curve(40, 10, 8, 8)]  # reach 10 at 300 and 200
    curves['min-snr-5 (eps)'] = [curve(80, 40, 10, 8), curve(80, 40, 20, 8.5)]
    summary = prediction_study.summarise(curves)
    assert summary['targets'] == {'final': 10, 'halfway': 40} and summary['halfway_images'] == 200
    v, paper = summary['settings']['v-prediction'], summary['settings']['paper (eps, uniform)']
    # Paired by seed: 300/300 and 200/400 (not 300/400 and 200/300).
    final, halfway = v['reach']['final'], v['reach']['halfway']
    assert final['images'] == pytest.approx([300, 200]) and final['ratio_mean'] == pytest.approx(0.75)
    assert halfway['images'] == [100, 100] and halfway['ratio_mean'] == pytest.approx(0.5)
    assert paper['reach']['final']['ratio_mean'] == 1 and paper['reach']['final']['ratio_sd'] == 0
    assert final['ratios'] == 2
    # Seed noise: twice the standard error of the difference of means (paper's sd 0 here).
    assert v['final_mean'] == 8.75 and v['exceeds_seed_noise'] is False  # 1.25 < 2 x 0.75
    assert summary['settings']['min-snr-5 (eps)']['exceeds_seed_noise'] is True  # 1.75 > 2 x 0.25


@pytest.mark.parametrize('script, args, expected', [
    (digits_figure, [], '--ckpt is required'),
    (digits_figure, ['--ckpt', 'x.pt', '--scale', '0'], '--scale must be in [1, 32]'),
    (digits_score, ['--image-size', '4'], '--image-size must be in [8, 256]'),
    (digits_figure, ['--ckpt', 'x.pt', '--out', 'fig.jpg'], 'a file name ending in .png'),
    (digits_figure, ['--ckpt', 'x.pt', '--out', 'a-file/fig.png'], '--out a-file: cannot write there'),
    (digits_figure, ['--ckpt', 'missing.pt', '--out', 'new/fig.png'], 'missing.pt'),  # new/ is not created
    (digits_score, ['--image-size', '8', '--data-dir', 'a-file/cache'], '--data-dir a-file/cache: cannot write'),
    (prediction_study, ['--out-dir', 'a-file/out'], '--out-dir a-file/out: cannot write there'),
    (prediction_study, ['--runs-dir', 'a-file/runs'], '--runs-dir a-file/runs: cannot write there'),
    (digits_score, ['--bogus'], 'unrecognized arguments'),
    (solver_accuracy, ['--sample-batch', '0'], '--sample-batch must be at least 1'),
    (solver_accuracy, ['--stem', 'a/b'], 'a plain file name'),
    (prediction_study, ['--eval-samples', '1'], '--eval-samples must be at least 2'),
    (prediction_study, ['--workers', '0'], '--workers must be at least 1'),
    (prediction_study, ['--images', '100'], '--images must be at least --eval-every'),
    (prediction_study, ['--stem', '../x'], 'a plain file name'),
])
def test_the_scripts_refuse_bad_flags_in_one_line_and_write_nothing(script, args, expected, tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)  # where their default output folders would be
    (tmp_path / 'a-file').write_text('not a folder')
    code, err = refusal(capsys, script.main, args)
    assert code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ['a-file']


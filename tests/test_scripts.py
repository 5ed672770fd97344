"""The scripts under scripts/, each run end to end in its quick form: the samplers' accuracy
study, the digits score's checks, and the images-to-quality study of v-prediction and Min-SNR."""
import json

import digits_score
import prediction_study
import solver_accuracy
import train
from helpers import train_args


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
    assert paper['final_mean'] == result['target'] and len(paper['finals']) == 2
    for curves in result['curves'].values():
        assert [[p['images'] for p in run] for run in curves] == [[32, 64]] * 2
    # A finished study is not trained again: the runs' folders are reused (here by two worker processes).
    assert prediction_study.main(small + ['--stem', 'again', '--workers', '2']) == 0
    assert json.loads((tmp_path / 'again.json').read_text())['curves'] == result['curves']

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torchvision

import train
from helpers import train_args, write_cifar10, write_image_folder


def run(tmp_path, *extra):
    return train.cli(train_args(tmp_path, *extra))


def metrics(tmp_path):
    with open(tmp_path / 'run' / 'metrics.jsonl') as f:
        return [json.loads(line) for line in f]


def load_ckpt(tmp_path):
    return torch.load(tmp_path / 'run' / 'ckpt.pt', map_location='cpu', weights_only=True)


def test_train_on_shapes_writes_everything(tmp_path):
    assert run(tmp_path, '--epochs', '2') == 0  # 12 steps per epoch
    ckpt = load_ckpt(tmp_path)
    assert ckpt['step'] == 24 and ckpt['epoch'] == 2 and ckpt['batch_in_epoch'] == 0
    for key in ('model', 'ema', 'optimizer', 'scaler', 'config', 'rng'):
        assert key in ckpt
    assert not any(k.startswith(('_orig_mod', 'module')) for k in ckpt['model'])
    assert ckpt['config']['preset'] == 'tiny'
    lines = metrics(tmp_path)
    assert lines[0]['config']['batch_size'] == 8
    rows = [row for row in lines if 'step' in row]
    assert [row['step'] for row in rows] == [5, 10, 15, 20, 24]
    for row in rows:
        assert {'loss', 'lr', 'img_per_s', 'heldout_loss', 'heldout_loss_ema'} <= set(row)
    assert sorted(os.listdir(tmp_path / 'samples')) == ['epoch_0001.png', 'epoch_0002.png']
    grid = torchvision.io.read_image(str(tmp_path / 'samples' / 'epoch_0002.png'))
    assert grid.shape[0] == 3 and grid.shape[1] > 16 and grid.float().std() > 1  # not blank
    # The EMA moved away from the initial weights but is not the raw model.
    name = 'conv_out.weight'
    assert ckpt['ema'][name].abs().sum() > 0 and not torch.equal(ckpt['ema'][name], ckpt['model'][name])


def test_loss_goes_down_on_shapes(tmp_path):
    assert run(tmp_path, '--steps', '60', '--log-every', '20', '--sample-every', '0', '--lr', '2e-3') == 0
    rows = [row for row in metrics(tmp_path) if 'step' in row]
    assert rows[-1]['heldout_loss'] < 0.6 * rows[0]['heldout_loss']


def test_train_on_image_folder(tmp_path):
    write_image_folder(tmp_path / 'images', count=20)
    assert run(tmp_path, '--dataset', 'folder', '--data-dir', str(tmp_path / 'images'), '--steps', '3',
               '--batch-size', '4', '--loader', 'torch', '--num-workers', '0') == 0
    assert load_ckpt(tmp_path)['step'] == 3


def test_train_on_cifar10_files(tmp_path, monkeypatch):
    monkeypatch.setattr(torchvision.datasets.cifar, 'check_integrity', lambda *a, **k: True)
    write_cifar10(tmp_path / 'cifar', train_per_batch=8, test_count=16)
    assert run(tmp_path, '--dataset', 'cifar10', '--data-dir', str(tmp_path / 'cifar'), '--steps', '6',
               '--image-size', '32') == 0
    assert load_ckpt(tmp_path)['step'] == 6


@pytest.mark.parametrize('loader', ['gpu', 'torch'])
def test_resume_is_exact_mid_epoch(tmp_path, loader):
    # 12 batches per epoch: the split at step 10 falls mid-epoch, and both runs cross an epoch.
    common = ['--loader', loader, '--num-workers', '0', '--dropout', '0.1', '--ckpt-every', '0']
    assert run(tmp_path / 'whole', *common, '--steps', '20') == 0
    assert run(tmp_path / 'split', *common, '--steps', '10') == 0
    ckpt = tmp_path / 'split' / 'run' / 'ckpt.pt'
    assert torch.load(ckpt, weights_only=True)['batch_in_epoch'] == 10
    assert run(tmp_path / 'split', *common, '--steps', '20', '--resume', str(ckpt)) == 0
    whole, split = load_ckpt(tmp_path / 'whole'), load_ckpt(tmp_path / 'split')
    for key in ('model', 'ema'):
        for name, tensor in whole[key].items():
            assert torch.equal(tensor, split[key][name]), (key, name)
    assert whole['step'] == split['step'] == 20


def test_resume_without_dropout_rng_restore_would_differ(tmp_path):
    # Guards the test above: a different seed changes the weights, so equality is meaningful.
    assert run(tmp_path / 'a', '--steps', '4', '--dropout', '0.1') == 0
    assert run(tmp_path / 'b', '--steps', '4', '--dropout', '0.1', '--seed', '1') == 0
    a, b = load_ckpt(tmp_path / 'a'), load_ckpt(tmp_path / 'b')
    assert not torch.equal(a['model']['conv_out.weight'], b['model']['conv_out.weight'])


def test_interrupted_checkpoint_write_keeps_the_previous(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')
    train.save_checkpoint({'step': 1, 'w': torch.ones(3)}, path)

    def crash_mid_write(obj, f, *args, **kwargs):
        f.write(b'partial garbage')
        raise OSError('disk full')
    monkeypatch.setattr(torch, 'save', crash_mid_write)
    with pytest.raises(OSError):
        train.save_checkpoint({'step': 2, 'w': torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)['step'] == 1


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    assert run(tmp_path, '--steps', '4') == 0
    before = (tmp_path / 'run' / 'ckpt.pt').read_bytes()
    ckpt = str(tmp_path / 'run' / 'ckpt.pt')
    # An absurd learning rate overflows the weights within two steps.
    code = run(tmp_path, '--steps', '40', '--resume', ckpt, '--lr', '1e30', '--ckpt-every', '2', '--log-every', '100')
    err = capsys.readouterr().err
    assert code == 3
    assert 'non-finite' in err or 'nan' in err or 'inf' in err
    assert 'last good checkpoint' in err
    assert (tmp_path / 'run' / 'ckpt.pt').read_bytes() == before


def _stderr_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: '), err
    assert 'Traceback' not in err[0]
    return err[0]


@pytest.mark.parametrize('extra, expected', [
    (['--preset', 'huge'], 'invalid choice'),
    (['--image-size', '18'], 'cannot be halved'),
    (['--batch-size', '0'], 'at least 1'),
    (['--batch-size', '200'], 'larger than the data set'),
    (['--amp', 'fp16'], 'needs a CUDA device'),
    (['--dataset', 'folder', '--data-dir', '/nonexistent/images'], 'does not exist'),
    (['--resume', '/nonexistent/ckpt.pt'], 'no such checkpoint'),
    (['--steps', '0'], 'at least 1'),
    pytest.param(['--device', 'cuda'], 'use --device cpu',
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is available here')),
    (['--batch-size', 'many'], 'invalid'),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, expected):
    try:
        code = run(tmp_path, '--steps', '2', *extra)  # a case that wrongly passes stays short
    except SystemExit as exit:  # argparse errors
        code = exit.code
    assert code == 2
    assert expected in _stderr_line(capsys)


def test_bad_image_files_are_named(tmp_path, capsys):
    write_image_folder(tmp_path / 'images', count=10)
    (tmp_path / 'images' / 'broken.jpg').write_bytes(b'\xff\xd8 definitely not a jpeg')
    assert run(tmp_path, '--dataset', 'folder', '--data-dir', str(tmp_path / 'images'), '--steps', '1') == 2
    assert 'broken.jpg' in _stderr_line(capsys)


def test_cifar10_missing_offline(tmp_path, capsys, monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError('network unreachable')
    monkeypatch.setattr(torchvision.datasets.cifar, 'download_and_extract_archive', no_network)
    assert run(tmp_path, '--dataset', 'cifar10', '--data-dir', str(tmp_path / 'nothing'), '--steps', '1') == 2
    assert '--dataset shapes' in _stderr_line(capsys)


def test_resume_from_another_architecture(tmp_path, capsys):
    assert run(tmp_path, '--steps', '2') == 0
    capsys.readouterr()
    ckpt = str(tmp_path / 'run' / 'ckpt.pt')
    assert run(tmp_path / 'other', '--steps', '4', '--resume', ckpt, '--preset', 'small', '--batch-size', '8') == 2
    assert 'another architecture' in _stderr_line(capsys)
    assert run(tmp_path / 'other', '--steps', '4', '--resume', ckpt, '--batch-size', '4') == 2
    assert '--batch-size' in _stderr_line(capsys)


def test_real_cli_exit_code_and_stderr(tmp_path, root):
    result = subprocess.run([sys.executable, 'train.py', *train_args(tmp_path, '--steps', '2', '--image-size', '14')],
                            cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert 'cannot be halved' in result.stderr and 'Traceback' not in result.stderr


def test_sigterm_saves_and_exits_cleanly(tmp_path, root):
    args = train_args(tmp_path, '--steps', '100000', '--log-every', '1', '--sample-every', '0', '--ckpt-every', '0')
    process = subprocess.Popen([sys.executable, 'train.py', *args], cwd=root, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    metrics_file = tmp_path / 'run' / 'metrics.jsonl'
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics_file.exists() and metrics_file.read_text().count('"step"') >= 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert 'stopped by SIGTERM' in out + err
    step = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)['step']
    assert 3 <= step < 100000
    # ... and the run resumes from there.
    assert run(tmp_path, '--steps', str(step + 2), '--resume', str(tmp_path / 'run' / 'ckpt.pt'),
               '--sample-every', '0') == 0
    assert load_ckpt(tmp_path)['step'] == step + 2


def test_ddp_two_gloo_ranks_end_identical(tmp_path, root):
    args = train_args(tmp_path, '--steps', '6', '--dropout', '0.1')
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                             'train.py', *args],
                            cwd=root, capture_output=True, text=True, timeout=240,
                            env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'ranks hold identical weights' in result.stdout + result.stderr
    ckpt = load_ckpt(tmp_path)
    assert ckpt['step'] == 6 and len(ckpt['rng']) == 2
    # Only rank 0 writes: one header line (world size 2) and one set of rows.
    lines = metrics(tmp_path)
    assert lines[0]['world_size'] == 2 and sum('step' in row for row in lines) == 2


def test_ffcv_without_ffcv_says_how_to_install(tmp_path, capsys, monkeypatch):
    import data
    monkeypatch.setattr(data, 'ffcv_missing_reason', lambda: data.FFCV_INSTALL)
    assert run(tmp_path, '--loader', 'ffcv', '--data-dir', str(tmp_path / 'x.beton'), '--steps', '2') == 2
    line = _stderr_line(capsys)
    assert 'apt-get install' in line and 'requirements-ffcv.txt' in line

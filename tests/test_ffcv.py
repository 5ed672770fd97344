import subprocess
import sys

import pytest
import torch

import data
import train
from helpers import train_args

ffcv = pytest.importorskip('ffcv', reason='the optional FFCV extra is not installed (see requirements-ffcv.txt)')


@pytest.fixture(scope='module')
def beton(tmp_path_factory):
    path = tmp_path_factory.mktemp('beton') / 'shapes.beton'
    data.write_beton(data.ImageTensorDataset(data.make_shapes(96, 16)), str(path), num_workers=1)
    return str(path)


def test_write_and_read_back_exactly(beton):
    dataset = data.BetonDataset(beton)
    assert len(dataset) == 96
    assert torch.equal(dataset.images(range(96)), data.make_shapes(96, 16))  # raw RGB: lossless


def test_jpeg_beton_is_close(tmp_path):
    source = data.make_shapes(8, 32)
    data.write_beton(data.ImageTensorDataset(source), str(tmp_path / 'j.beton'), jpeg=True, num_workers=1)
    decoded = data.BetonDataset(str(tmp_path / 'j.beton')).images(range(8))
    assert decoded.shape == source.shape
    assert (decoded.float() - source.float()).abs().mean() < 8  # lossy, but the same images


def test_ffcv_loader_yields_the_same_batches_as_the_others(beton):
    loader = data.FFCVLoader(data.BetonDataset(beton), 8, seed=0, device='cpu', num_workers=2)
    reference = data.GPULoader(data.make_shapes(96, 16), 8, seed=0, device='cpu')
    for epoch, start in [(0, 0), (1, 5)]:
        ours, theirs = list(loader.epoch(epoch, start)), list(reference.epoch(epoch, start))
        assert len(ours) == len(theirs) == 12 - start
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_data_py_command_line(tmp_path, root):
    out = tmp_path / 'cli.beton'
    result = subprocess.run([sys.executable, 'data.py', '--write-beton', str(out), '--dataset', 'shapes',
                             '--shapes-count', '40', '--image-size', '16', '--num-workers', '1'],
                            cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert 'wrote 40 images' in result.stdout and len(data.BetonDataset(str(out))) == 40


def test_train_from_beton_and_resume_exactly(beton, tmp_path):
    common = ['--loader', 'ffcv', '--data-dir', beton, '--num-workers', '1', '--dropout', '0.1', '--ckpt-every', '0']
    assert train.cli(train_args(tmp_path / 'whole', *common, '--steps', '16')) == 0
    assert train.cli(train_args(tmp_path / 'split', *common, '--steps', '7')) == 0
    ckpt = tmp_path / 'split' / 'run' / 'ckpt.pt'
    assert train.cli(train_args(tmp_path / 'split', *common, '--steps', '16', '--resume', str(ckpt))) == 0
    whole = torch.load(tmp_path / 'whole' / 'run' / 'ckpt.pt', weights_only=True)
    split = torch.load(ckpt, weights_only=True)
    assert whole['config']['dataset'] == 'beton' and whole['step'] == 16
    for key in ('model', 'ema'):
        assert all(torch.equal(t, split[key][name]) for name, t in whole[key].items())
    # ... and the FFCV run trained on the same batches as the in-memory loader would have.
    assert train.cli(train_args(tmp_path / 'gpu', '--loader', 'gpu', '--dropout', '0.1', '--ckpt-every', '0',
                                '--steps', '16')) == 0
    gpu = torch.load(tmp_path / 'gpu' / 'run' / 'ckpt.pt', weights_only=True)
    assert all(torch.equal(t, gpu['model'][name]) for name, t in whole['model'].items())

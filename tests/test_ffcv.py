import pytest
import torch
from helpers import train_args

import data
import loaders
import train

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
    loader = loaders.FFCVLoader(data.BetonDataset(beton), 8, seed=0, device='cpu', num_workers=2)
    reference = loaders.GPULoader(data.make_shapes(96, 16), 8, seed=0, device='cpu')
    for epoch, start in [(0, 0), (1, 5)]:
        ours, theirs = list(loader.epoch(epoch, start)), list(reference.epoch(epoch, start))
        assert len(ours) == len(theirs) == 12 - start
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_data_py_command_line(tmp_path, capsys):
    out = tmp_path / 'cli.beton'
    assert data.main(['--write-beton', str(out), '--dataset', 'shapes', '--shapes-count', '40', '--image-size', '16',
                      '--num-workers', '1']) == 0
    assert 'wrote 40 images' in capsys.readouterr().out and len(data.BetonDataset(str(out))) == 40
    assert not (tmp_path / 'cli.beton.tmp').exists()  # written beside, then renamed


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


def test_data_py_unwritable_destination_is_one_error_line(tmp_path, capsys):
    (tmp_path / 'a-file').write_text('')
    assert data.main(['--write-beton', str(tmp_path / 'a-file' / 'x.beton'), '--dataset', 'shapes',
                      '--shapes-count', '8', '--image-size', '16']) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: --write-beton') and len(err.strip().splitlines()) == 1


def test_fid_statistics_of_a_beton_are_cached_beside_it(beton):
    import os

    from helpers import stand_in_extractor

    import evaluation
    stats = evaluation.reference_statistics('beton', beton, 16, stand_in_extractor, 32)
    cache = os.path.join(os.path.dirname(beton), 'fid_stats_beton_16.npz')
    assert os.path.isfile(cache) and not os.path.exists(cache + '.tmp')
    again = evaluation.reference_statistics('beton', beton, 16, stand_in_extractor, 32)
    # The cache is read back whole.
    assert (again['mu'] == stats['mu']).all() and (again['sigma'] == stats['sigma']).all()


def test_digits_are_written_grey_in_three_channels(tmp_path, capsys):
    path = str(tmp_path / 'digits.beton')
    assert data.main(['--write-beton', path, '--dataset', 'digits', '--image-size', '8', '--num-workers', '1']) == 0
    stored = data.BetonDataset(path).images(range(1347))
    assert torch.equal(stored, data.load_digits_split(8, heldout=False)[0].expand(-1, 3, -1, -1))


def test_two_benchmarks_on_one_data_dir_share_the_beton(tmp_path, root):
    # Both write their own temporary file and rename it into place: neither dies, neither waits
    # forever, and one whole .beton of the images is left, with no temporary files.
    import subprocess
    import sys
    script = f"""
import sys
sys.path.insert(0, {root!r})
import benchmark, data
import timing
bench = benchmark.BenchConfig(data_dir={str(tmp_path)!r}, image_size=16, num_workers=1)
print(len(timing.beton_for(bench, 'shapes', data.ImageTensorDataset(data.make_shapes(64, 16)))))
"""
    writers = [subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [w.communicate(timeout=300)[0].strip().splitlines()[-1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0] and outputs == ['64', '64']
    assert [p.name for p in tmp_path.iterdir()] == ['bench-shapes-64x16.beton']
    assert torch.equal(data.BetonDataset(str(tmp_path / 'bench-shapes-64x16.beton')).images(range(64)),
                       data.make_shapes(64, 16))

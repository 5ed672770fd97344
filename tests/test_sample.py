import numpy as np
import pytest
import torch

import sample
import train
from helpers import train_args


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('ckpt')
    assert train.cli(train_args(tmp, '--steps', '4', '--sample-every', '0')) == 0
    return str(tmp / 'run' / 'ckpt.pt')


def test_png_npz_and_grid_outputs(ckpt, tmp_path):
    common = ['--ckpt', ckpt, '--num', '5', '--batch-size', '2', '--steps', '3', '--device', 'cpu']
    result = sample.main(sample.parse_config(common + ['--out', str(tmp_path / 'png')], sample.SampleConfig))
    files = sorted(p.name for p in (tmp_path / 'png').iterdir())
    assert files == [f'{i:06d}.png' for i in range(5)]
    assert result['images'] == 5 and result['img_per_s'] > 0
    assert sample.cli(common + ['--out', str(tmp_path / 'npz'), '--format', 'npz']) == 0
    assert sample.cli(common + ['--out', str(tmp_path / 'npz2'), '--format', 'npz']) == 0
    a = np.load(tmp_path / 'npz' / 'samples_5x16.npz')['arr_0']
    b = np.load(tmp_path / 'npz2' / 'samples_5x16.npz')['arr_0']
    assert a.shape == (5, 16, 16, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)  # reproducible from the seed
    assert sample.cli(common + ['--out', str(tmp_path / 'grid'), '--grid']) == 0
    assert [p.name for p in (tmp_path / 'grid').iterdir()] == ['grid.png']


def test_ddpm_sampler_and_raw_weights(ckpt, tmp_path):
    assert sample.cli(['--ckpt', ckpt, '--num', '2', '--sampler', 'ddpm', '--weights', 'model', '--device', 'cpu',
                       '--out', str(tmp_path), '--format', 'npz']) == 0
    images = np.load(tmp_path / 'samples_2x16.npz')['arr_0']
    assert images.std() > 0


def test_bits_per_dim(ckpt, tmp_path):
    cfg = sample.SampleConfig(ckpt=ckpt, bpd=True, bpd_data='shapes', bpd_num=2, batch_size=2, device='cpu',
                              data_dir=str(tmp_path))
    result = sample.main(cfg)['bpd']
    assert result['images'] == 2 and 0 < result['bits_per_dim'] < 20 and np.isfinite(result['bits_per_dim'])
    assert result['prior'] < 0.01  # x_T is almost pure noise: L_T is tiny


def stand_in_extractor(images: torch.Tensor) -> torch.Tensor:
    """A fixed, linear feature map (per-channel means and a few pixels): no download needed."""
    x = images.double() / 255
    return torch.cat([x.mean(dim=(2, 3)), x[:, :, 0, :4].flatten(1)], dim=1)


def test_frechet_distance_closed_forms():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 6))
    stats = sample.statistics(features)
    assert np.allclose(stats['mu'], features.mean(0)) and np.allclose(stats['sigma'], np.cov(features, rowvar=False))
    assert abs(sample.frechet_distance(stats, stats)) < 1e-6
    delta = np.array([0.5, -1.0, 0.0, 2.0, 0.1, 0.0])
    shifted = sample.statistics(features + delta)  # same covariance, mean moved by delta
    assert sample.frechet_distance(stats, shifted) == pytest.approx(delta @ delta, rel=1e-6)
    # Independent Gaussians with covariances a^2 I and b^2 I: FID = d (a - b)^2.
    a_stats = {'mu': np.zeros(4), 'sigma': 4.0 * np.eye(4)}
    b_stats = {'mu': np.zeros(4), 'sigma': 1.0 * np.eye(4)}
    assert sample.frechet_distance(a_stats, b_stats) == pytest.approx(4 * (2 - 1) ** 2)


def test_fid_path_with_stand_in_extractor(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(sample, 'inception_extractor', lambda weights, device: stand_in_extractor)
    cfg = sample.SampleConfig(ckpt=ckpt, num=8, batch_size=4, steps=2, device='cpu', fid=True, fid_data='shapes',
                              data_dir=str(tmp_path / 'data'), out=str(tmp_path / 'out'), format='npz')
    result = sample.main(cfg)
    assert np.isfinite(result['fid']) and result['fid'] > 0
    assert (tmp_path / 'data' / 'fid_stats_shapes_16.npz').exists()  # reference statistics cached
    # Features of the reference set against themselves: FID 0.
    reference = sample.reference_images('shapes', '', 16, split_train=True)[:200]
    stats = sample.statistics(sample.features_of(reference.split(50), stand_in_extractor))
    assert abs(sample.frechet_distance(stats, stats)) < 1e-6


def test_fid_offline_says_how_to_point_at_local_weights(ckpt, tmp_path, monkeypatch, capsys):
    import torch_fidelity.feature_extractor_inceptionv3 as inception

    def offline(*args, **kwargs):
        raise OSError('<urlopen error [Errno -3] Temporary failure in name resolution>')
    monkeypatch.setattr(inception, 'load_state_dict_from_url', offline)
    assert sample.cli(['--ckpt', ckpt, '--num', '2', '--fid', '--device', 'cpu', '--out', str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('error: ') and '--inception-weights' in err and len(err.splitlines()) == 1


def test_bad_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert sample.cli(['--ckpt', str(tmp_path / 'missing.pt')]) == 2
    assert 'no such checkpoint' in capsys.readouterr().err
    (tmp_path / 'junk.pt').write_bytes(b'junk')
    assert sample.cli(['--ckpt', str(tmp_path / 'junk.pt')]) == 2
    assert 'not a train.py checkpoint' in capsys.readouterr().err

import json
import os
import signal
import sys

import numpy as np
import pytest
import torch
from helpers import NO_DIFFUSERS, refusal, stand_in_extractor, train_args

import data
import diffusion
import drawing
import evaluation
import sample
import train
from model import UNet, UNetConfig


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('ckpt')
    assert train.cli(train_args(tmp, '--steps', '4', '--sample-every', '0')) == 0
    return str(tmp / 'run' / 'ckpt.pt')


def test_png_npz_and_grid_outputs(ckpt, tmp_path):
    common = ['--ckpt', ckpt, '--num', '5', '--batch-size', '2', '--steps', '3', '--device', 'cpu']
    result = sample.main(sample.parse_config(common + ['--out', str(tmp_path / 'png')], sample.SampleConfig))
    files = sorted(p.name for p in (tmp_path / 'png').iterdir())
    assert files == [f'{i:06d}.png' for i in range(5)] + ['samples.json']
    assert result['images'] == 5 and result['img_per_s'] > 0
    assert sample.cli(common + ['--out', str(tmp_path / 'npz'), '--format', 'npz']) == 0
    assert sample.cli(common + ['--out', str(tmp_path / 'npz2'), '--format', 'npz']) == 0
    a = np.load(tmp_path / 'npz' / 'samples_5x16.npz')['arr_0']
    b = np.load(tmp_path / 'npz2' / 'samples_5x16.npz')['arr_0']
    assert a.shape == (5, 16, 16, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)  # reproducible from the seed
    assert sample.cli(common + ['--out', str(tmp_path / 'grid'), '--grid']) == 0
    assert sorted(p.name for p in (tmp_path / 'grid').iterdir()) == ['grid.png', 'samples.json']  # marked ours


def test_raw_weights_differ_from_the_ema(ckpt, tmp_path):
    common = ['--ckpt', ckpt, '--num', '2', '--steps', '3', '--device', 'cpu', '--format', 'npz']
    assert sample.cli(common + ['--weights', 'model', '--out', str(tmp_path / 'model')]) == 0
    assert sample.cli(common + ['--out', str(tmp_path / 'ema')]) == 0
    raw, ema = (np.load(tmp_path / name / 'samples_2x16.npz')['arr_0'] for name in ('model', 'ema'))
    assert raw.std() > 0 and not np.array_equal(raw, ema)


def test_bits_per_dim(tmp_path):
    # A pipeline folder with T=100 (its scheduler config): 100 model calls per image, not 1000.
    save_diffusers_pipeline(tmp_path / 'pipe')
    cfg = sample.SampleConfig(ckpt=str(tmp_path / 'pipe'), bpd=True, bpd_data='shapes', bpd_num=3, batch_size=2,
                              device='cpu', data_dir=str(tmp_path))
    result = sample.main(cfg)['bpd']
    assert result['images'] == 3 and 0 < result['bits_per_dim'] < 20 and result['stderr'] > 0
    model, _, sched, _ = sample.load_model(str(tmp_path / 'pipe'), 'ema', torch.device('cpu'))
    assert sched.num_steps == 100
    images = data.make_shapes(10000, 16, seed=data.SHAPES_HELDOUT_SEED)[:3]  # the held-out shapes, as --bpd reads
    generator = torch.Generator().manual_seed(0)
    totals = torch.cat([diffusion.vlb_bits_per_dim(model, sched, batch.float() / 127.5 - 1, generator)['total']
                        for batch in images.split(2)])
    assert result['bits_per_dim'] == pytest.approx(totals.mean().item(), rel=1e-5)


def test_frechet_distance_closed_forms():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 6))
    stats = evaluation.statistics(features)
    assert np.allclose(stats['mu'], features.mean(0)) and np.allclose(stats['sigma'], np.cov(features, rowvar=False))
    assert abs(evaluation.frechet_distance(stats, stats)) < 1e-6
    delta = np.array([0.5, -1.0, 0.0, 2.0, 0.1, 0.0])
    shifted = evaluation.statistics(features + delta)  # same covariance, mean moved by delta
    assert evaluation.frechet_distance(stats, shifted) == pytest.approx(delta @ delta, rel=1e-6)
    # Independent Gaussians with covariances a^2 I and b^2 I: FID = d (a - b)^2.
    a_stats = {'mu': np.zeros(4), 'sigma': 4.0 * np.eye(4)}
    b_stats = {'mu': np.zeros(4), 'sigma': 1.0 * np.eye(4)}
    assert evaluation.frechet_distance(a_stats, b_stats) == pytest.approx(4 * (2 - 1) ** 2)


def test_fid_path_with_stand_in_extractor(ckpt, tmp_path, monkeypatch, shapes_fid_dir, shapes_fid_stats):
    monkeypatch.setattr(sample, 'inception_extractor', lambda weights, device: stand_in_extractor)
    assert not list(shapes_fid_stats.parent.glob('*.tmp'))  # the cache was written whole, then renamed

    def recomputed(*args, **kwargs):
        raise AssertionError('the cached reference statistics should have been read')
    monkeypatch.setattr(evaluation, 'reference_images', recomputed)
    cfg = sample.SampleConfig(ckpt=ckpt, num=8, batch_size=4, steps=2, device='cpu', fid=True, fid_data='shapes',
                              data_dir=shapes_fid_dir(tmp_path), out=str(tmp_path / 'out'), format='npz')
    result = sample.main(cfg)
    assert np.isfinite(result['fid']) and result['fid'] > 0
    # Features of the reference set (its first 200 shapes) against themselves: FID 0.
    stats = evaluation.statistics(evaluation.features_of(data.make_shapes(200, 16).split(50), stand_in_extractor))
    assert abs(evaluation.frechet_distance(stats, stats)) < 1e-6


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
    torch.save({'weights': torch.zeros(1)}, tmp_path / 'dict.pt')  # a torch file, but not ours
    assert sample.cli(['--ckpt', str(tmp_path / 'dict.pt')]) == 2
    assert 'not a train.py checkpoint' in capsys.readouterr().err


def test_checkpoint_whose_weights_do_not_fit_is_a_clear_error(ckpt, tmp_path, capsys):
    state = torch.load(ckpt, weights_only=True)
    state['ema'] = {name: tensor[..., :1] for name, tensor in state['ema'].items()}
    torch.save(state, tmp_path / 'cut.pt')
    assert sample.cli(['--ckpt', str(tmp_path / 'cut.pt'), '--device', 'cpu', '--out', str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert 'do not fit its model_config' in err and len(err.splitlines()) == 1 and len(err) < 500


def batch_seed(seed: int, index: int) -> int:
    """The seed of batch `index` as sample.py documents it: SeedSequence((seed, index))."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def test_samples_use_the_checkpoints_schedule(tmp_path):
    assert train.cli(train_args(tmp_path, '--steps', '3', '--sample-every', '0', '--schedule', 'cosine')) == 0
    path = tmp_path / 'run' / 'ckpt.pt'
    ckpt = torch.load(path, weights_only=True)
    generator = torch.Generator().manual_seed(0)
    for tensor in ckpt['ema'].values():  # weights whose output matters (the untrained last layer is ~0)
        tensor.add_(0.02 * torch.randn(tensor.shape, generator=generator))
    torch.save(ckpt, path)
    assert sample.cli(['--ckpt', str(path), '--num', '3', '--batch-size', '3', '--steps', '4', '--eta', '0.5',
                       '--sampler', 'ddim', '--device', 'cpu', '--format', 'npz', '--out', str(tmp_path / 'out')]) == 0
    got = torch.from_numpy(np.load(tmp_path / 'out' / 'samples_3x16.npz')['arr_0']).permute(0, 3, 1, 2)
    model = UNet(UNetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in ckpt['model_config'].items()}))
    model.load_state_dict(ckpt['ema'])
    expected = {kind: drawing.to_uint8(diffusion.ddim_sample(model.eval(), diffusion.make_schedule(1000, kind),
                                                            (3, 3, 16, 16), 4, 0.5,
                                                            torch.Generator().manual_seed(batch_seed(0, 0))))
                for kind in ('cosine', 'linear')}
    assert torch.equal(got, expected['cosine']) and not torch.equal(got, expected['linear'])


def save_diffusers_pipeline(path, num_train_timesteps=100, variance_type='fixed_large'):
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    import diffusers_io
    import model as unet
    config = unet.get_config('tiny', image_size=16, dropout=0.0)
    theirs = diffusers.UNet2DModel(**diffusers_io.diffusers_config(config))
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=num_train_timesteps, variance_type=variance_type)
    pipeline = diffusers.DDPMPipeline(unet=theirs.eval(), scheduler=scheduler)
    pipeline.save_pretrained(path)
    return pipeline


def test_sample_from_a_diffusers_pipeline_folder_matches_the_pipeline(tmp_path):
    # A pipeline with its own schedule (T=100): sample.py must read it, and then draw what
    # diffusers' DDPMPipeline draws from the same generator.
    pipeline = save_diffusers_pipeline(tmp_path / 'pipe')
    assert sample.cli(['--ckpt', str(tmp_path / 'pipe'), '--num', '2', '--batch-size', '2', '--sampler', 'ddpm',
                       '--device', 'cpu', '--format', 'npz', '--out', str(tmp_path / 'out')]) == 0
    ours = np.load(tmp_path / 'out' / 'samples_2x16.npz')['arr_0'].astype(int)
    theirs = pipeline(batch_size=2, num_inference_steps=100, output_type='np',
                      generator=torch.Generator().manual_seed(batch_seed(0, 0))).images
    theirs = np.round(theirs * 255).astype(int)
    assert ours.shape == theirs.shape == (2, 16, 16, 3)
    assert np.abs(ours - theirs).max() <= 1 and (ours == theirs).mean() > 0.99  # float32 rounding at .5
    assert ours.std() > 10


def test_diffusers_folder_errors(tmp_path, capsys):
    save_diffusers_pipeline(tmp_path / 'pipe')
    config_path = tmp_path / 'pipe' / 'unet' / 'config.json'
    import json
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, 'norm_eps': 1e-5}))
    assert sample.cli(['--ckpt', str(tmp_path / 'pipe'), '--num', '1', '--device', 'cpu']) == 2
    assert 'norm_eps' in capsys.readouterr().err
    (tmp_path / 'empty').mkdir()
    assert sample.cli(['--ckpt', str(tmp_path / 'empty'), '--num', '1', '--device', 'cpu']) == 2
    assert 'config.json' in capsys.readouterr().err
    config_path.write_text('[1, 2]')
    assert sample.cli(['--ckpt', str(tmp_path / 'pipe'), '--num', '1', '--device', 'cpu']) == 2
    assert 'not a JSON object' in capsys.readouterr().err
    config_path.write_text(json.dumps(config))
    (tmp_path / 'pipe' / 'scheduler' / 'scheduler_config.json').write_text('{"beta_sch')
    assert sample.cli(['--ckpt', str(tmp_path / 'pipe'), '--num', '1', '--device', 'cpu']) == 2
    assert 'not a scheduler configuration' in capsys.readouterr().err


@pytest.mark.parametrize('extra, expected', [
    (['--steps', '1001'], 'only T=1000 steps'),
    (['--num', '0'], '--num must be at least 1'),
    (['--eta=-1'], '--eta must be in [0, 1]'),
    (['--sampler', 'ddim', '--eta', '1.5'], '--eta must be in [0, 1]'),
    (['--device', 'meta'], '--device'),
    (['--bpd', '--bpd-timesteps', '1000'], '--bpd-timesteps must be in [0, 999]'),
    (['--inception-weights', '/nonexistent.pth', '--fid'], 'no such file'),
    (['--sampler', 'euler'], 'invalid choice'),
    (['--sampler', 'ddpm', '--steps', '5'], '--steps 5: --sampler ddpm is the ancestral sampler of all T=1000 steps'),
    (['--sampler', 'ddpm', '--spacing', 'trailing'], '--spacing trailing: ddpm takes no --spacing'),
    (['--sampler', 'ddim', '--spacing', 'logsnr'], '--spacing logsnr: ddim takes spacing leading, trailing, linspace'),
    (['--spacing', 'time'], 'invalid choice'),
])
def test_bad_flags_fail_before_sampling(ckpt, tmp_path, capsys, extra, expected):
    code, err = refusal(capsys, sample.cli, ['--ckpt', ckpt, '--device', 'cpu', '--out', str(tmp_path / 'out'),
                                             *extra])
    assert code == 2 and expected in err and len(err.splitlines()) == 1


def test_unwritable_out_fails_before_drawing(ckpt, tmp_path, capsys, monkeypatch):
    drawn = []
    monkeypatch.setattr(sample, 'draw', lambda *args, **kwargs: drawn.append(1) or iter(()))
    (tmp_path / 'a-file').write_text('')
    assert sample.cli(['--ckpt', ckpt, '--device', 'cpu', '--out', str(tmp_path / 'a-file' / 'out')]) == 2
    assert 'cannot write there' in capsys.readouterr().err and not drawn


# ----------------------------------------------------------------------------- sampling that survives

def test_non_finite_weights_and_samples_are_refused(ckpt, tmp_path, capsys):
    saved = torch.load(ckpt, weights_only=True)
    broken = dict(saved, ema={k: v.clone() for k, v in saved['ema'].items()})
    broken['ema']['conv_out.bias'][0] = float('nan')
    torch.save(broken, tmp_path / 'nan.pt')
    assert sample.cli(['--ckpt', str(tmp_path / 'nan.pt'), '--num', '2', '--device', 'cpu',
                       '--out', str(tmp_path / 'a')]) == 2
    assert 'ema weights are not finite' in capsys.readouterr().err
    assert not (tmp_path / 'a').exists() or not list((tmp_path / 'a').glob('*.png'))
    huge = dict(saved, ema={k: v * (1e30 if k.startswith('conv_out') else 1) for k, v in saved['ema'].items()})
    torch.save(huge, tmp_path / 'huge.pt')  # finite weights whose samples overflow
    assert sample.cli(['--ckpt', str(tmp_path / 'huge.pt'), '--num', '2', '--steps', '3', '--device', 'cpu',
                       '--out', str(tmp_path / 'b')]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith('error: the model drew NaN or inf in batch 0')
    assert not list((tmp_path / 'b').glob('*.png'))


@pytest.mark.parametrize('fmt', ['png', 'npz'])
def test_a_stopped_run_continues_to_the_images_of_one_run(ckpt, tmp_path, monkeypatch, capsys, fmt):
    common = ['--ckpt', ckpt, '--num', '7', '--batch-size', '2', '--steps', '3', '--device', 'cpu', '--format', fmt]
    assert sample.cli(common + ['--out', str(tmp_path / 'whole')]) == 0
    write, events = sample.write_batch, []

    def sigterm_after_the_second_batch(images, paths, fmt):
        write(images, paths, fmt)
        events.append(len(images))
        if len(events) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(sample, 'write_batch', sigterm_after_the_second_batch)
    assert sample.cli(common + ['--out', str(tmp_path / 'cut')]) == 0
    assert events == [2, 2] and 'stopped by SIGTERM' in capsys.readouterr().out  # the batch under way was written
    on_disk = sorted(p.name for p in (tmp_path / 'cut').rglob('*') if p.is_file())
    assert on_disk == (['000000.png', '000001.png', '000002.png', '000003.png', 'samples.json'] if fmt == 'png' else
                       ['batch_000000.npy', 'batch_000001.npy', 'samples.json'])
    assert sample.cli(common + ['--out', str(tmp_path / 'cut')]) == 0  # the same command continues
    assert events == [2, 2, 2, 1]  # only the two batches left were drawn
    for name in ([f'{i:06d}.png' for i in range(7)] if fmt == 'png' else ['samples_7x16.npz']):
        assert (tmp_path / 'cut' / name).read_bytes() == (tmp_path / 'whole' / name).read_bytes(), name
    if fmt == 'npz':
        assert not (tmp_path / 'cut' / 'parts').exists()
        assert np.load(tmp_path / 'cut' / 'samples_7x16.npz')['arr_0'].shape == (7, 16, 16, 3)
    assert sample.cli(common + ['--out', str(tmp_path / 'cut')]) == 0 and events == [2, 2, 2, 1]  # nothing left
    assert 'nothing to do' in capsys.readouterr().out


def test_samples_stream_to_disk_batch_by_batch(ckpt, tmp_path, monkeypatch):
    # Memory holds one batch: each batch is on disk before the next is drawn.
    draw, order = sample.draw, []

    def watched(*args, **kwargs):
        for images in draw(*args, **kwargs):
            order.append(('drawn', len(list((tmp_path / 'out').glob('*.png')))))
            yield images
    monkeypatch.setattr(sample, 'draw', watched)
    assert sample.cli(['--ckpt', ckpt, '--num', '5', '--batch-size', '2', '--steps', '2', '--device', 'cpu',
                       '--out', str(tmp_path / 'out')]) == 0
    assert order == [('drawn', 0), ('drawn', 2), ('drawn', 4)]


def test_a_folder_of_other_samples_or_in_use_is_refused(ckpt, tmp_path, capsys):
    common = ['--ckpt', ckpt, '--num', '3', '--steps', '2', '--device', 'cpu', '--out', str(tmp_path / 'out')]
    assert sample.cli(common) == 0
    before = (tmp_path / 'out' / '000000.png').read_bytes()
    capsys.readouterr()
    assert sample.cli(common + ['--seed', '1']) == 2
    err = capsys.readouterr().err.strip()
    assert 'holds samples drawn with other settings (seed 0, now 1)' in err and len(err.splitlines()) == 1
    assert (tmp_path / 'out' / '000000.png').read_bytes() == before
    import socket
    (tmp_path / 'out' / 'lock').write_text(json.dumps({'pid': os.getppid(), 'host': socket.gethostname()}))
    assert sample.cli(common) == 2 and 'in use by another run' in capsys.readouterr().err


def test_samples_that_cannot_fit_are_refused_before_drawing(ckpt, tmp_path, monkeypatch, capsys):
    import shutil
    one_megabyte_free = shutil._ntuple_diskusage(10 ** 12, 10 ** 12 - 10 ** 6, 10 ** 6)
    monkeypatch.setattr(shutil, 'disk_usage', lambda path: one_megabyte_free)
    assert sample.cli(['--ckpt', ckpt, '--num', '100000000', '--device', 'cpu', '--out', str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err
    assert 'need about 409.6 GB' in err and not list((tmp_path / 'out').glob('*.png'))
    assert sample.cli(['--ckpt', ckpt, '--num', '5000', '--grid', '--device', 'cpu', '--out', str(tmp_path)]) == 2
    assert '--grid draws at most 4096 images' in capsys.readouterr().err


def test_unreadable_weight_files_are_one_line(tmp_path, capsys, monkeypatch):
    save_diffusers_pipeline(tmp_path / 'pipe')
    weights = tmp_path / 'pipe' / 'unet' / 'diffusion_pytorch_model.safetensors'
    good = weights.read_bytes()
    weights.write_bytes(good[:100])  # cut short
    assert sample.cli(['--ckpt', str(tmp_path / 'pipe'), '--num', '1', '--device', 'cpu']) == 2
    err = capsys.readouterr().err.strip()
    assert 'not readable weights' in err and len(err.splitlines()) == 1
    weights.write_bytes(good)
    monkeypatch.setitem(sys.modules, 'safetensors.torch', None)  # the package missing
    assert sample.cli(['--ckpt', str(tmp_path / 'pipe'), '--num', '1', '--device', 'cpu']) == 2
    assert 'pip install safetensors' in capsys.readouterr().err
    monkeypatch.undo()
    weights.unlink()
    (tmp_path / 'pipe' / 'unet' / 'diffusion_pytorch_model.bin').write_bytes(os.urandom(500))
    assert sample.cli(['--ckpt', str(tmp_path / 'pipe'), '--num', '1', '--device', 'cpu']) == 2
    err = capsys.readouterr().err.strip()
    assert 'diffusion_pytorch_model.bin: not readable weights' in err and len(err.splitlines()) == 1
    (tmp_path / 'random.pt').write_bytes(os.urandom(4096))
    assert sample.cli(['--ckpt', str(tmp_path / 'random.pt'), '--num', '1', '--device', 'cpu']) == 2
    assert 'not a train.py checkpoint (not a file written by torch.save)' in capsys.readouterr().err


def test_dpm_solver_from_the_command_line(ckpt, tmp_path):
    saved = torch.load(ckpt, weights_only=True)
    generator = torch.Generator().manual_seed(0)
    for tensor in saved['ema'].values():  # weights whose output matters (the untrained last layer is ~0)
        tensor.add_(0.02 * torch.randn(tensor.shape, generator=generator))
    torch.save(saved, tmp_path / 'trained.pt')
    model, _, sched, _ = sample.load_model(str(tmp_path / 'trained.pt'), 'ema', torch.device('cpu'))
    for spacing in ('logsnr', 'linspace'):
        assert sample.cli(['--ckpt', str(tmp_path / 'trained.pt'), '--sampler', 'dpm++', '--steps', '4', '--spacing',
                           spacing, '--num', '3', '--batch-size', '3', '--device', 'cpu', '--format', 'npz',
                           '--out', str(tmp_path / spacing)]) == 0
        got = torch.from_numpy(np.load(tmp_path / spacing / 'samples_3x16.npz')['arr_0']).permute(0, 3, 1, 2)
        x = diffusion.dpm_solver_sample(model, sched, (3, 3, 16, 16), 4, spacing,
                                        generator=torch.Generator().manual_seed(batch_seed(0, 0)))
        assert torch.equal(got, drawing.to_uint8(x))
    assert not np.array_equal(*(np.load(tmp_path / s / 'samples_3x16.npz')['arr_0'] for s in ('logsnr', 'linspace')))



def test_a_refused_run_leaves_no_settings_and_a_touched_checkpoint_continues(ckpt, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / 'out')
    assert sample.cli(['--ckpt', ckpt, '--num', '100000000', '--device', 'cpu', '--out', out]) == 2
    assert not os.path.exists(os.path.join(out, 'samples.json'))
    common = ['--ckpt', ckpt, '--num', '4', '--batch-size', '2', '--steps', '2', '--device', 'cpu', '--out', out]
    write, calls = sample.write_batch, []

    def sigterm_after_the_first(*args):
        write(*args)
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(sample, 'write_batch', sigterm_after_the_first)
    assert sample.cli(common) == 0 and len(calls) == 1
    os.utime(ckpt)  # the same bytes at a new time: the same settings
    assert sample.cli(common) == 0 and len(calls) == 2  # continued: only the second batch drawn


def test_corrupt_local_inception_weights_are_named(ckpt, tmp_path, capsys):
    (tmp_path / 'inception.pth').write_bytes(b'not weights')
    assert sample.cli(['--ckpt', ckpt, '--num', '2', '--fid', '--device', 'cpu', '--out', str(tmp_path / 'o'),
                       '--inception-weights', str(tmp_path / 'inception.pth')]) == 2
    err = capsys.readouterr().err
    assert 'inception.pth: cannot load it' in err and 'download' not in err

"""Into the ecosystem and back: export to a diffusers pipeline, fine-tune from released
weights (--init-from), and TensorBoard."""
import dataclasses
import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from helpers import NO_DIFFUSERS, train_args

import checkpoint
import diffusers_io
import diffusion
import drawing
import model as unet
import sample
import train


def trained_checkpoint(tmp_path, *extra) -> str:
    """A tiny checkpoint whose EMA weights are randomised (so that samples depend on them)."""
    assert train.cli(train_args(tmp_path, '--steps', '2', '--sample-every', '0', *extra)) == 0
    path = tmp_path / 'run' / 'ckpt.pt'
    ckpt = torch.load(path, weights_only=True)
    generator = torch.Generator().manual_seed(0)
    for tensor in ckpt['ema'].values():
        tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    torch.save(ckpt, path)
    return str(path)


@pytest.mark.parametrize('dataset, channels', [('shapes', 3), ('digits', 1)])
def test_export_loads_back_exactly_and_the_pipeline_samples_as_we_do(tmp_path, dataset, channels):
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    ckpt = trained_checkpoint(tmp_path, '--dataset', dataset)
    assert sample.cli(['--ckpt', ckpt, '--export-diffusers', str(tmp_path / 'pipe'), '--device', 'cpu']) == 0
    assert sorted(os.listdir(tmp_path / 'pipe')) == ['model_index.json', 'scheduler', 'unet']
    ours = checkpoint.model_from_checkpoint(torch.load(ckpt, weights_only=True), 'ema', ckpt)
    back = diffusers_io.load_diffusers(str(tmp_path / 'pipe'))  # our reader of their format: the same weights
    assert back.config == ours.config and ours.config.in_channels == channels
    assert all(torch.equal(t, back.state_dict()[k]) for k, t in ours.state_dict().items())
    # DDPMPipeline samples what our 1000-step ancestral sampler samples from the same generator.
    pipeline = diffusers.DDPMPipeline.from_pretrained(str(tmp_path / 'pipe'))
    theirs = pipeline(batch_size=1, num_inference_steps=1000, output_type='np',
                      generator=torch.Generator().manual_seed(5)).images
    with torch.no_grad():
        x = diffusion.ddpm_sample(ours, diffusion.make_schedule(1000), (1, channels, 16, 16),
                                  torch.Generator().manual_seed(5))
    mine = drawing.to_uint8(x).permute(0, 2, 3, 1).numpy().astype(int)
    theirs = np.round(theirs * 255).astype(int)
    assert np.abs(mine - theirs).max() <= 1 and (mine == theirs).mean() > 0.99 and mine.std() > 10
    # The raw weights on request.
    assert sample.cli(['--ckpt', ckpt, '--export-diffusers', str(tmp_path / 'raw'), '--weights', 'model',
                       '--device', 'cpu']) == 0
    raw = torch.load(ckpt, weights_only=True)['model']
    back = diffusers_io.load_diffusers(str(tmp_path / 'raw')).state_dict()
    assert all(torch.equal(t, back[k]) for k, t in raw.items())


def test_a_cosine_checkpoint_keeps_its_schedule(tmp_path):
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    ckpt = trained_checkpoint(tmp_path, '--schedule', 'cosine')
    assert sample.cli(['--ckpt', ckpt, '--export-diffusers', str(tmp_path / 'pipe'), '--device', 'cpu']) == 0
    _, _, sched, _ = sample.load_model(str(tmp_path / 'pipe'), 'ema', torch.device('cpu'))
    assert sched.num_steps == 1000 and torch.equal(sched.betas, diffusion.make_schedule(1000, 'cosine').betas)
    theirs = diffusers.DDPMScheduler.from_pretrained(str(tmp_path / 'pipe'), subfolder='scheduler')
    assert torch.allclose(theirs.alphas_cumprod.double(), sched.alphas_cumprod, rtol=1e-5)


def test_export_refusals_are_one_line(tmp_path, capsys):
    # Several heads with attention at levels of different widths: diffusers sets heads from one head size.
    config = unet.UNetConfig(image_size=16, base_channels=16, channel_mults=(1, 2, 2), blocks_per_level=1,
                             attn_resolutions=(16, 8), num_heads=2, dropout=0.0, norm_groups=8)
    weights = unet.UNet(config).state_dict()
    torch.save({'model': weights, 'ema': weights, 'config': {'schedule': 'linear'},
                'model_config': dataclasses.asdict(config), 'model_version': unet.MODEL_VERSION}, tmp_path / 'c.pt')
    assert sample.cli(['--ckpt', str(tmp_path / 'c.pt'), '--export-diffusers', str(tmp_path / 'pipe'),
                       '--device', 'cpu']) == 2
    err = capsys.readouterr().err.strip()
    assert 'diffusers cannot represent' in err and 'heads' in err and len(err.splitlines()) == 1
    assert not (tmp_path / 'pipe').exists() and not list(tmp_path.glob('pipe.tmp*'))
    (tmp_path / 'full').mkdir()
    (tmp_path / 'full' / 'x').write_text('')
    assert sample.cli(['--ckpt', str(tmp_path / 'c.pt'), '--export-diffusers', str(tmp_path / 'full')]) == 2
    assert 'not an empty folder' in capsys.readouterr().err


def small_diffusers_folder(path, seed=0):
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    theirs = diffusers.UNet2DModel(**diffusers_io.diffusers_config(unet.get_config('tiny', image_size=16, dropout=0.0)))
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    theirs.save_pretrained(path)
    return theirs.eval()


def test_init_from_a_diffusers_folder_trains_the_loaded_model(tmp_path):
    theirs = small_diffusers_folder(tmp_path / 'released')
    cpu = torch.device('cpu')
    cfg = train.resolve_defaults(train.TrainConfig(preset='tiny', dataset='shapes', shapes_count=64, image_size=16,
                                                   batch_size=4, device='cpu', channels_last=False), cpu)
    # NCHW, as diffusers' side below: randn_like draws a channels-last batch's noise in another order
    init = checkpoint.initial_weights(str(tmp_path / 'released'), train.model_config_of(cfg))
    run = train.build_run(cfg, cpu, progress=False, init=init)
    assert all(torch.equal(t, run.ema.state_dict()[k]) for k, t in run.model.state_dict().items())
    x0 = next(train.batches(run, 0))
    rng = torch.get_rng_state()
    loss = train.train_step(run, x0, 0).item()
    # The same batch, timesteps and noise through diffusers' own model loaded from the folder.
    torch.set_rng_state(rng)
    sched = diffusion.make_schedule(1000)
    t = torch.randint(0, 1000, (4,))
    noise = torch.randn_like(x0)
    with torch.no_grad():
        prediction = theirs(diffusion.q_sample(sched, x0, t, noise), t).sample
    assert loss == pytest.approx((prediction - noise).square().mean().item(), rel=1e-5)


def test_init_from_our_checkpoint_and_its_refusals(tmp_path, capsys):
    ckpt = trained_checkpoint(tmp_path / 'first')
    ema = torch.load(ckpt, weights_only=True)['ema']
    cfg = train.resolve_defaults(train.TrainConfig(preset='tiny', dataset='shapes', shapes_count=96, image_size=16,
                                                   batch_size=8, device='cpu'), torch.device('cpu'))
    init = checkpoint.initial_weights(ckpt, train.model_config_of(cfg))
    assert all(torch.equal(t, init[k]) for k, t in ema.items())  # the EMA weights start the new run
    assert train.cli(train_args(tmp_path / 'second', '--steps', '3', '--sample-every', '0', '--init-from', ckpt)) == 0
    second = torch.load(tmp_path / 'second' / 'run' / 'ckpt.pt', weights_only=True)
    assert second['step'] == 3 and second['flags']['init_from'] == ckpt  # a fresh run: its own step count
    assert train.cli(train_args(tmp_path / 'third', '--steps', '3', '--preset', 'small', '--init-from', ckpt)) == 2
    assert 'another architecture' in capsys.readouterr().err
    assert train.cli(train_args(tmp_path / 'third', '--steps', '3', '--init-from', str(tmp_path / 'nothing'))) == 2
    assert 'no such checkpoint or folder' in capsys.readouterr().err


def test_tensorboard_holds_what_metrics_jsonl_holds(tmp_path):
    pytest.importorskip('tensorboard', reason='the optional tensorboard extra is not installed')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    assert train.cli(train_args(tmp_path, '--epochs', '1', '--log-every', '4', '--tensorboard')) == 0  # 12 steps
    rows = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    rows = [r for r in rows if r.get('kind') == 'train']
    events = EventAccumulator(str(tmp_path / 'run' / 'tb'), size_guidance={'images': 0, 'scalars': 0}).Reload()
    for key in ('loss', 'heldout_loss', 'heldout_loss_ema', 'lr', 'img_per_s', 'train_hours'):
        logged = [(e.step, e.value) for e in events.Scalars(f'train/{key}')]
        assert logged == [(r['images_seen'], pytest.approx(r[key], rel=1e-6)) for r in rows], key
    (image,) = events.Images('samples')  # the grid at the epoch's end, at 96 images
    assert image.step == 96 and image.encoded_image_string[:4] == b'\x89PNG'


def test_tensorboard_missing_is_one_line(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'tensorboard' else real(name, *a))
    assert train.cli(train_args(tmp_path, '--steps', '2', '--tensorboard')) == 2
    err = capsys.readouterr().err.strip()
    assert err == 'error: --tensorboard needs the tensorboard package: pip install tensorboard'

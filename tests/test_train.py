import copy
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torchvision
from helpers import signal_on_call, stand_in_extractor, train_args, write_cifar10, write_image_folder

import checkpoint
import cli
import data
import diffusion
import drawing
import evaluation
import files
import loaders
import train
import train_config
import training_log
from model import AttnBlock, UNet, get_config


def run(tmp_path, *extra):
    return train.cli(train_args(tmp_path, *extra))


def metrics(tmp_path):
    with open(tmp_path / 'run' / 'metrics.jsonl') as f:
        return [json.loads(line) for line in f]


def load_ckpt(tmp_path):
    return torch.load(tmp_path / 'run' / 'ckpt.pt', map_location='cpu', weights_only=True)


# ----------------------------------------------------------------------------- the step, against closed forms

def test_defaults_are_the_papers_recipe():
    cpu = torch.device('cpu')
    paper = train.resolve_defaults(train.TrainConfig(), cpu)
    assert (paper.lr, paper.warmup, paper.batch_size, paper.grad_clip, paper.ema_decay, paper.dropout) == \
        (2e-4, 5000, 128, 1.0, 0.9999, 0.1)
    tiny = train.resolve_defaults(train.TrainConfig(preset='tiny'), cpu)
    assert (tiny.lr, tiny.warmup, tiny.batch_size, tiny.dropout) == (2e-3, 50, 32, 0.0)
    assert train.resolve_defaults(train.TrainConfig(preset='tiny', dropout=0.3, lr=1e-3), cpu).dropout == 0.3


def test_seed_initialises_the_network_as_torch_manual_seed_does():
    # --seed S gives the weights of torch.manual_seed(S); UNet(config), whatever the loader does.
    import model as unet
    cfg = train.resolve_defaults(train.TrainConfig(preset='tiny', dataset='shapes', shapes_count=64, image_size=16,
                                                   seed=3, batch_size=8), torch.device('cpu'))
    built = train.build_run(cfg, torch.device('cpu'), progress=False).model
    torch.manual_seed(3)
    reference = unet.UNet(train.model_config_of(cfg))
    assert all(torch.equal(t, reference.state_dict()[k]) for k, t in built.state_dict().items())


def test_ema_samples_and_evaluates_without_dropout(tmp_path):
    # The EMA is never trained: grids and evaluations must not draw dropout masks from it.
    cfg = train.resolve_defaults(train.TrainConfig(preset='tiny', dataset='shapes', shapes_count=64, image_size=16,
                                                   batch_size=8, dropout=0.5, num_samples=4, sample_steps=3),
                                 torch.device('cpu'))
    ema = train.build_run(cfg, torch.device('cpu'), progress=False).ema
    with torch.no_grad():
        for p in ema.parameters():  # weights that make dropout visible (the untrained output conv is zero)
            p.add_(0.05 * torch.randn_like(p))
    for name in ('a.png', 'b.png'):
        drawing.write_grid(ema, diffusion.make_schedule(1000), cfg, torch.device('cpu'), str(tmp_path / name))
    assert (tmp_path / 'a.png').read_bytes() == (tmp_path / 'b.png').read_bytes()


def test_learning_rate_warmup_closed_form():
    cfg = train.TrainConfig(lr=2e-4, warmup=5000)
    # The k-th optimizer update (k = step + 1) uses lr * min(1, k / warmup).
    assert train.lr_at(0, cfg, 800_000) == pytest.approx(2e-4 / 5000)
    assert train.lr_at(2499, cfg, 800_000) == pytest.approx(1e-4)
    assert train.lr_at(4999, cfg, 800_000) == pytest.approx(2e-4)
    assert train.lr_at(123_456, cfg, 800_000) == pytest.approx(2e-4)
    assert train.lr_at(7, train.TrainConfig(lr=3e-4, warmup=0), 800_000) == 3e-4


def test_ema_decay_closed_form():
    cfg = train.TrainConfig(ema_decay=0.9999)
    assert train.ema_decay_at(0, cfg) == pytest.approx(0.1)
    assert train.ema_decay_at(90, cfg) == pytest.approx(91 / 100)
    assert train.ema_decay_at(10**6, cfg) == 0.9999  # the ramp passes 0.9999 at step 89,991
    assert train.ema_decay_at(50, train.TrainConfig(ema_decay=0.5)) == 0.5


def reference_step(model, ema, optimizer, x0, step, lr, clip, generator_state):
    """A DDPM training step written out from the paper (Algorithm 1) with the schedule built
    here: t and eps drawn as training_loss draws them, x_t by eq. 4, the MSE, the global norm
    clipped, Adam at lr, then ema <- d ema + (1 - d) model with d = min(0.9999, (1+k)/(10+k))."""
    abar = torch.from_numpy(np.cumprod(1 - np.linspace(1e-4, 0.02, 1000)))
    torch.set_rng_state(generator_state)
    t = torch.randint(0, 1000, (x0.shape[0],))
    noise = torch.randn_like(x0)
    a = abar[t].view(-1, 1, 1, 1)
    loss = (model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t) - noise).square().mean()
    loss.backward()
    norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters()))
    for p in model.parameters():
        p.grad *= min(1.0, clip / (norm.item() + 1e-6))
    for group in optimizer.param_groups:
        group['lr'] = lr
    optimizer.step()
    optimizer.zero_grad()
    decay = min(0.9999, (1 + step) / (10 + step))
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.copy_(decay * e + (1 - decay) * p)
    return loss.item(), norm.item()


def test_train_step_is_the_papers_step():
    cpu = torch.device('cpu')
    cfg = train.resolve_defaults(train.TrainConfig(preset='tiny', dataset='shapes', image_size=16, batch_size=4,
                                                   lr=1e-3, warmup=10, grad_clip=0.5, dropout=0.0, device='cpu',
                                                   channels_last=False), cpu)  # the reference's NCHW noise
    run = train.build_run(cfg, cpu, dataset=data.ImageTensorDataset(data.make_shapes(16, 16)), progress=False)
    run.model.double(), run.ema.double()  # float64: Adam's first steps are sign(grad) x lr, so in float32
    # rounding decides the sign of the near-zero gradients
    with torch.no_grad():  # trained-like weights, and an EMA that differs from them
        for p, e in zip(run.model.parameters(), run.ema.parameters()):
            p.add_(0.05 * torch.randn_like(p))
            e.copy_(p + 0.05 * torch.randn_like(p))
    model, ema = copy.deepcopy(run.model), copy.deepcopy(run.ema)
    optimizer = torch.optim.Adam(model.parameters())
    x0 = loaders.to_model_input(data.make_shapes(4, 16), torch.zeros(4, dtype=torch.bool)).double()
    clipped = 0
    for step in range(4):
        state = torch.get_rng_state()
        loss = train.train_step(run, x0, step)
        ref_loss, norm = reference_step(model, ema, optimizer, x0, step, 1e-3 * min(1, (step + 1) / 10), 0.5, state)
        clipped += norm > 0.5
        assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
        for ours, theirs in [(run.model, model), (run.ema, ema)]:
            for name, p in ours.named_parameters():
                q = dict(theirs.named_parameters())[name]
                if name.endswith('qkv.bias'):  # the key bias has a zero gradient (softmax ignores it),
                    p, q = p[torch.arange(len(p)) // (len(p) // 3) != 1], q[torch.arange(len(q)) // (len(q) // 3) != 1]
                    # so Adam turns rounding noise into lr-sized steps: left out
                assert (p - q).abs().max() <= 1e-7, (step, name)  # a step moves weights by ~lr = 1e-4
        assert run.optimizer.param_groups[0]['lr'] == pytest.approx(1e-3 * (step + 1) / 10)
    assert clipped >= 2  # the clipping was exercised


def tiny_run(**overrides):
    cpu = torch.device('cpu')
    cfg = train.resolve_defaults(train.TrainConfig(**{**dict(preset='tiny', dataset='shapes', shapes_count=64,
                                                             image_size=16, batch_size=8, device='cpu'), **overrides}),
                                 cpu)
    run = train.build_run(cfg, cpu, progress=False)
    with torch.no_grad():  # trained-like weights: the untrained last layer makes every output ~0
        for p in run.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return run


def test_the_compiled_loss_is_one_graph_without_recompiles_and_trains_as_eager():
    # --compile compiles the whole loss (timesteps, noise, q_sample, the network, the MSE) with
    # fullgraph=True. 30 steps through warm-up and the EMA ramp, with dropout (random in the
    # graph too): one graph, compiled once, and the weights and EMA of eager training. aot_eager
    # traces forward and backward as inductor gets them, without minutes of C++ builds.
    graphs = []

    def counting_backend(graph, inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend('aot_eager')(graph, inputs)
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        run = tiny_run(warmup=10, dropout=0.1, ema_decay=0.999, channels_last=False)  # NCHW on every CPU: the
        # key bias's zero gradient turns rounding into lr-sized Adam steps, and the rounding differs by layout
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()  # reset() leaves them: earlier tests' graphs would count
            cfg = dataclasses.replace(run.cfg, compile=True)
            run.compute_loss = train.make_loss(cfg, run.model, run.sched, run.device, backend=counting_backend)
        stream = train.batches(run, 0)
        torch.manual_seed(1)
        losses = [train.train_step(run, next(stream), step) for step in range(30)]
        runs.append((run, torch.stack(losses)))
    (eager, eager_losses), (compiled, compiled_losses) = runs
    assert len(graphs) == 1 and torch._dynamo.utils.counters['stats']['unique_graphs'] == 1
    assert torch.allclose(compiled_losses, eager_losses, rtol=1e-4)
    for ours, theirs in [(compiled.model, eager.model), (compiled.ema, eager.ema)]:
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.allclose(p, q, atol=1e-4), name  # 30 steps of lr 2e-3 moved them by ~1e-2
    assert compiled.optimizer.param_groups[0]['lr'] == pytest.approx(2e-3)  # past the warm-up


@pytest.mark.parametrize('amp, channels_last', [('off', False), ('bf16', True)])
def test_the_loss_runs_the_model_in_the_runs_precision_and_layout(amp, channels_last):
    run = tiny_run(amp=amp, channels_last=channels_last)
    seen = []
    run.model.register_forward_pre_hook(lambda _, args: seen.append((
        torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu'),
        args[0].is_contiguous(memory_format=torch.channels_last), args[0].is_contiguous())))
    run.compute_loss(next(train.batches(run, 0)))
    assert seen == [(amp == 'bf16' and torch.bfloat16, channels_last, not channels_last)]


def test_build_run_compiles_the_whole_loss_in_one_graph(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, 'compile', lambda function, **options: compiled.append((function, options)) or function)
    run = tiny_run(compile=True, compile_mode='max-autotune', channels_last=False)  # NCHW noise, as below
    ((function, options),) = compiled
    assert function is run.compute_loss and options == {'fullgraph': True, 'mode': 'max-autotune'}
    x0 = next(train.batches(run, 0))
    torch.manual_seed(3)
    loss = run.compute_loss(x0)
    torch.manual_seed(3)
    assert torch.equal(loss, diffusion.training_loss(run.model, run.sched, x0))


def test_heldout_loss_is_deterministic_and_without_dropout():
    run = tiny_run(dropout=0.5, heldout_size=16)
    heldout = evaluation.make_heldout(run.cfg, run.device, 1000)
    assert run.model.training
    a = evaluation.heldout_losses(run.model, run.sched, heldout, run.cfg, run.device)
    b = evaluation.heldout_losses(run.model, run.sched, heldout, run.cfg, run.device)
    assert torch.equal(a, b) and run.model.training  # eval mode inside, training mode after
    images, t, noise = heldout
    assert sorted(t.tolist()) == [i * 1000 // 16 for i in range(16)]  # timesteps spread over 0..T-1
    with torch.no_grad():
        x0 = images.float() / 127.5 - 1
        expected = diffusion.training_loss(run.model.eval(), run.sched, x0, t, noise, per_example=True)
    assert torch.allclose(a, expected)


@pytest.mark.parametrize('sampler', ['ddim', 'dpm++'])
def test_sample_grid_holds_the_samplers_images(tmp_path, sampler):
    run = tiny_run(num_samples=4, sample_steps=3, seed=7, sampler=sampler)
    drawing.write_grid(run.model.eval(), run.sched, run.cfg, run.device, str(tmp_path / 'grid.png'))
    grid = torchvision.io.read_image(str(tmp_path / 'grid.png'))
    assert grid.shape == (3, 2 * 16 + 3 * 2, 2 * 16 + 3 * 2)  # 2 x 2 images, 2-pixel padding
    draw = {'ddim': diffusion.ddim_sample, 'dpm++': diffusion.dpm_solver_sample}[sampler]
    with torch.no_grad():
        x = draw(run.model, run.sched, (4, 3, 16, 16), 3, generator=torch.Generator().manual_seed(7))
    expected = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    for i in range(4):
        row, col = divmod(i, 2)
        tile = grid[:, 2 + row * 18:2 + row * 18 + 16, 2 + col * 18:2 + col * 18 + 16]
        assert (tile.int() - expected[i].int()).abs().max() <= 1, i


# ----------------------------------------------------------------------------- whole runs

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
    # What the rows came from, and the run's time: the first row and the last.
    assert lines[0]['torch'] == torch.__version__ and lines[0]['commit'] and lines[0]['device_name'].startswith('CPU')
    assert lines[-1]['kind'] == 'done' and lines[-1]['step'] == 24
    assert 0 < lines[-1]['train_seconds'] <= lines[-1]['wall_s']
    rows = [row for row in lines if row.get('kind') == 'train']
    assert [row['step'] for row in rows] == [5, 10, 15, 20, 24]
    for row in rows:
        assert {'loss', 'lr', 'img_per_s', 'heldout_loss', 'heldout_loss_ema'} <= set(row)
        assert row['lr'] == pytest.approx(2e-3 * min(1, row['step'] / 50))  # tiny: the last update's lr
    assert sorted(os.listdir(tmp_path / 'samples')) == ['epoch_0001.png', 'epoch_0002.png']
    grid = torchvision.io.read_image(str(tmp_path / 'samples' / 'epoch_0002.png'))
    assert grid.shape[0] == 3 and grid.shape[1] > 16 and grid.float().std() > 1  # not blank
    # The EMA moved away from the initial weights but is not the raw model.
    name = 'conv_out.weight'
    assert ckpt['ema'][name].abs().sum() > 0 and not torch.equal(ckpt['ema'][name], ckpt['model'][name])


def test_loss_goes_down_on_shapes(tmp_path):
    assert run(tmp_path, '--steps', '60', '--log-every', '20', '--sample-every', '0', '--lr', '2e-3') == 0
    rows = [row for row in metrics(tmp_path) if row.get('kind') == 'train']
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
    checkpoint.save_checkpoint({'step': 1, 'w': torch.ones(3)}, path)
    assert os.listdir(tmp_path) == ['ckpt.pt']  # no temporary file left behind

    def crash_mid_write(obj, f, *args, **kwargs):
        f.write(b'partial garbage')
        raise OSError('disk full')
    monkeypatch.setattr(torch, 'save', crash_mid_write)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint({'step': 2, 'w': torch.zeros(3)}, path)
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
    (['--lr=-1e-4'], '--lr must be a positive number'),
    (['--lr', 'nan'], '--lr must be a finite number, got nan'),
    (['--dropout', '2'], '--dropout must be in [0, 1)'),
    (['--ema-decay', '1.5'], '--ema-decay must be in [0, 1)'),
    (['--grad-clip', '-1'], '--grad-clip must be 0'),
    (['--warmup', '-5'], '--warmup must be 0 or more'),
    (['--loader', 'torch', '--num-workers', '-1'], '--num-workers must be 0 or more'),
    (['--sample-steps', '2000'], '--sample-steps must be in [1, 1000]'),
    (['--ckpt-every', '-1'], '--ckpt-every must be 0'),
    (['--device', 'tpu'], 'unknown device'),
    (['--device', 'mps'], 'unknown device'),
    (['--eval-bpd-timesteps', '1000'], '--eval-bpd-timesteps must be in [1, 999]'),
    (['--eval-every=-1'], '--eval-every must be 0'),
    (['--inception-weights', '/nonexistent.pth'], 'no such file'),
    (['--channel-mults', '1,,2'], "--channel-mults '1,,2': give positive whole numbers"),
    (['--channel-mults', '1,0'], "--channel-mults '1,0': give positive whole numbers"),
    (['--attn-resolutions', 'x'], "--attn-resolutions 'x': give positive whole numbers"),
    (['--channel-mults='], "--channel-mults '': give positive whole numbers"),  # not "the preset's"
    (['--attn-resolutions='], "--attn-resolutions '': give positive whole numbers separated by commas, such as "
                              "16,8, or none"),
    (['--attn-resolutions', '5'], "--attn-resolutions 5: this UNet's levels are at 16, 8, 4 pixels"),
    (['--channel-mults', '1,2', '--attn-resolutions', '4'], "levels are at 16, 8 pixels"),
    (['--base-channels', '12'], '12 channels are not divisible by norm_groups=8'),
    (['--channel-mults', '1,2,2,2,2,2'], 'cannot be halved 5 times'),
    (['--blocks-per-level', '0'], '--blocks-per-level must be at least 1'),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, expected):
    try:
        code = run(tmp_path, '--steps', '2', *extra)  # a case that wrongly passes stays short
    except SystemExit as exit:  # argparse errors
        code = exit.code
    assert code == 2
    assert expected in _stderr_line(capsys)


def test_unwritable_output_folders_fail_before_training(tmp_path, capsys):
    (tmp_path / 'a-file').write_text('not a folder')
    for flag in ('--out-dir', '--samples-dir'):
        assert run(tmp_path, '--steps', '2', flag, str(tmp_path / 'a-file' / 'sub')) == 2
        line = _stderr_line(capsys)
        assert flag in line and 'cannot write there' in line
    assert not (tmp_path / 'run' / 'metrics.jsonl').exists()  # nothing was started


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
    cfg = train.resolve_defaults(cli.parse_config(train_args(tmp_path, '--steps', '4'), train.TrainConfig),
                                 torch.device('cpu'))
    with pytest.raises(cli.ConfigError, match='written by 1 ranks, this run has 2'):
        checkpoint.check_resumable(checkpoint.read_checkpoint(ckpt, 'x'), 'x', dataclasses.asdict(cfg),
                              train.model_config_of(cfg), world_size=2)


def test_the_shape_flags_build_that_unet_and_a_resume_keeps_it(tmp_path, capsys):
    shape = ['--base-channels', '8', '--channel-mults', '1,2', '--blocks-per-level', '2', '--attn-resolutions',
             '16,8']
    assert run(tmp_path, '--steps', '2', *shape) == 0
    ckpt = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=False)
    expected = get_config('tiny', image_size=16, base_channels=8, channel_mults=(1, 2), blocks_per_level=2,
                          attn_resolutions=(16, 8))
    assert ckpt['model_config'] == dataclasses.asdict(expected)
    model = UNet(expected)
    model.load_state_dict(ckpt['model'])  # the weights are that network's, every tensor
    attention = [m for m in model.modules() if isinstance(m, AttnBlock)]
    assert len(attention) == 2 * 2 + 1 + 2 * 3  # at 16 and 8: 2 blocks down and 3 up per level; the middle's
    # --resume alone replays the shape; another shape is another architecture.
    path = str(tmp_path / 'run' / 'ckpt.pt')
    assert run(tmp_path, '--steps', '3', '--resume', path) == 0
    assert torch.load(path, weights_only=False)['model_config'] == dataclasses.asdict(expected)
    capsys.readouterr()
    assert run(tmp_path, '--steps', '4', '--resume', path, '--attn-resolutions', 'none') == 2
    assert 'another architecture' in _stderr_line(capsys)
    assert run(tmp_path / 'none', '--steps', '1', '--attn-resolutions', 'none') == 0  # no attention at all
    none = UNet(get_config('tiny', image_size=16, attn_resolutions=()))
    none.load_state_dict(torch.load(tmp_path / 'none' / 'run' / 'ckpt.pt', weights_only=False)['model'])
    assert [m for m in none.modules() if isinstance(m, AttnBlock)] == [none.mid[1]]  # the middle block's alone


def test_real_cli_exit_code_and_stderr(tmp_path, root):
    result = subprocess.run([sys.executable, 'train.py', *train_args(tmp_path, '--steps', '2', '--image-size', '14')],
                            cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert 'cannot be halved' in result.stderr and 'Traceback' not in result.stderr


def test_a_signal_cuts_evaluation_short_but_not_training():
    stop = cli.StopFlag()
    restore = stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # outside an interruptible section: only noted
        assert stop.reason == 'SIGTERM'
        with pytest.raises(cli.StopRequested):
            with stop.interruptible():  # none starts once a stop is requested
                pass
        stop.reason = None
        with pytest.raises(cli.StopRequested):
            with stop.interruptible():
                os.kill(os.getpid(), signal.SIGTERM)  # inside: raised at once
                time.sleep(5)
        assert stop.reason == 'SIGTERM' and not stop.in_interruptible
    finally:
        restore()


def test_sigterm_saves_and_exits_cleanly(tmp_path, root):
    # Large held-out set and grids: if the stop evaluated or sampled first, it would take long.
    args = train_args(tmp_path, '--steps', '100000', '--log-every', '2', '--ckpt-every', '0',
                      '--heldout-size', '1000', '--num-samples', '64', '--sample-steps', '200', '--sample-every', '1')
    process = subprocess.Popen([sys.executable, 'train.py', *args], cwd=root, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    metrics_file = tmp_path / 'run' / 'metrics.jsonl'
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics_file.exists() and metrics_file.read_text().count('"step"') >= 1):
        time.sleep(0.1)
    time.sleep(0.5)  # most likely inside the next held-out evaluation (1000 images, twice), which is cut short
    process.send_signal(signal.SIGTERM)
    signalled = time.time()
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert time.time() - signalled < 15  # one step, one checkpoint; no evaluation, no grid
    assert 'stopped by SIGTERM' in out + err
    step = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)['step']
    assert 2 <= step < 100000
    last = metrics(tmp_path)[-1]
    assert last['step'] == step and 'heldout_loss' not in last  # the stop's row: loss only
    assert not list((tmp_path / 'samples').glob('step_*.png'))
    # ... and the run resumes from there with the printed hint (every other setting is replayed).
    hint = (out + err).split('continue with ')[1].split()
    assert hint[:4] == ['python', 'train.py', '--resume', str(tmp_path / 'run' / 'ckpt.pt')]
    assert train.cli([*hint[2:4], '--steps', str(step + 2), '--sample-every', '0', '--heldout-size', '16']) == 0
    assert load_ckpt(tmp_path)['step'] == step + 2


def test_ddp_two_gloo_ranks_end_identical(tmp_path, root):
    args = train_args(tmp_path, '--steps', '6', '--dropout', '0.1', '--eval-every', '24', '--no-eval-fid',
                      '--eval-bpd-images', '6', '--eval-bpd-timesteps', '2',
                      '--channels-last')  # as on a GPU: the ranks' final check reads non-contiguous weights
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
    assert lines[0]['world_size'] == 2 and sum(row.get('kind') == 'train' for row in lines) == 2
    evaluations = eval_rows(tmp_path)  # at 24 and 48 images, the ranks' halves gathered on rank 0
    assert [r['step'] for r in evaluations] == [3, 6]
    assert all(r['bpd_images'] == 6 and r['bpd'] > 0 for r in evaluations)


def test_ffcv_without_ffcv_says_how_to_install(tmp_path, capsys, monkeypatch):
    import data
    monkeypatch.setattr(data, 'ffcv_missing_reason', lambda: data.FFCV_INSTALL)
    assert run(tmp_path, '--loader', 'ffcv', '--data-dir', str(tmp_path / 'x.beton'), '--steps', '2') == 2
    line = _stderr_line(capsys)
    assert 'apt-get install' in line and 'requirements-ffcv.txt' in line



# ----------------------------------------------------------------------------- never lose work, never hang

def test_truncated_jpeg_is_found_before_training(tmp_path, capsys):
    write_image_folder(tmp_path / 'images', count=10)
    from PIL import Image
    big = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    big.save(tmp_path / 'images' / 'cut.jpg', quality=95)
    whole = (tmp_path / 'images' / 'cut.jpg').read_bytes()
    (tmp_path / 'images' / 'cut.jpg').write_bytes(whole[:len(whole) // 2])  # the header is intact
    with Image.open(tmp_path / 'images' / 'cut.jpg') as image:
        image.verify()  # ... which a header check accepts
    assert run(tmp_path, '--dataset', 'folder', '--data-dir', str(tmp_path / 'images'), '--steps', '1',
               '--batch-size', '4') == 2
    assert 'cut.jpg' in _stderr_line(capsys)
    assert not (tmp_path / 'run' / 'ckpt.pt').exists()


def test_finished_run_resumed_exits_at_once_and_leaves_the_checkpoint(tmp_path, capsys):
    assert run(tmp_path, '--steps', '4', '--sample-every', '0') == 0
    ckpt = tmp_path / 'run' / 'ckpt.pt'
    before, rows_before = ckpt.read_bytes(), (tmp_path / 'run' / 'metrics.jsonl').read_text()
    capsys.readouterr()
    start = time.perf_counter()
    assert run(tmp_path, '--steps', '4', '--sample-every', '0', '--resume', str(ckpt)) == 0
    assert 'at the target --steps 4' in capsys.readouterr().out
    assert run(tmp_path, '--steps', '2', '--sample-every', '0', '--resume', 'auto') == 0
    out = capsys.readouterr().out
    assert 'holds step 4' in out and 'past the target --steps 2' in out
    assert time.perf_counter() - start < 10  # no data loading, no model building
    assert ckpt.read_bytes() == before and (tmp_path / 'run' / 'metrics.jsonl').read_text() == rows_before
    # Counted in epochs too: 12 steps per epoch, so 24 steps are two whole epochs.
    assert run(tmp_path / 'e', '--epochs', '2', '--sample-every', '0') == 0
    capsys.readouterr()
    assert run(tmp_path / 'e', '--epochs', '2', '--sample-every', '0', '--resume', 'auto') == 0
    assert 'at the target --epochs 2' in capsys.readouterr().out


def test_fresh_run_never_overwrites_a_checkpoint(tmp_path, capsys):
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    before = (tmp_path / 'run' / 'ckpt.pt').read_bytes()
    capsys.readouterr()
    assert run(tmp_path, '--steps', '3', '--sample-every', '0') == 2
    line = _stderr_line(capsys)
    assert 'ckpt.pt exists' in line and '--resume' in line
    assert (tmp_path / 'run' / 'ckpt.pt').read_bytes() == before


def test_resume_auto_starts_fresh_then_continues_exactly(tmp_path):
    assert run(tmp_path / 'whole', '--steps', '8', '--sample-every', '0') == 0
    assert run(tmp_path / 'auto', '--steps', '5', '--sample-every', '0', '--resume', 'auto') == 0  # fresh
    assert load_ckpt(tmp_path / 'auto')['step'] == 5
    assert run(tmp_path / 'auto', '--steps', '8', '--sample-every', '0', '--resume', 'auto') == 0  # resumed
    whole, auto = load_ckpt(tmp_path / 'whole'), load_ckpt(tmp_path / 'auto')
    assert auto['step'] == 8
    assert all(torch.equal(t, auto['model'][k]) for k, t in whole['model'].items())
    # Resumed twice in a row at the target: still the same checkpoint.
    assert run(tmp_path / 'auto', '--steps', '8', '--sample-every', '0', '--resume', 'auto') == 0
    assert torch.equal(load_ckpt(tmp_path / 'auto')['model']['conv_out.weight'], whole['model']['conv_out.weight'])


def test_a_run_killed_after_logging_past_its_checkpoint_logs_each_step_once(tmp_path):
    # kill -9 between a log row and the next checkpoint: the resumed run repeats those steps, and
    # metrics.jsonl must not hold them twice (curves would double back). Emulated by putting back
    # the step-2 checkpoint after a run logged steps 3 and 4.
    common = ['--sample-every', '0', '--log-every', '1']
    assert run(tmp_path, '--steps', '2', *common) == 0
    step2 = (tmp_path / 'run' / 'ckpt.pt').read_bytes()
    assert run(tmp_path, '--steps', '4', *common, '--resume', 'auto') == 0
    killed = [r for r in metrics(tmp_path) if r.get('kind') == 'train']
    (tmp_path / 'run' / 'ckpt.pt').write_bytes(step2)
    with open(tmp_path / 'run' / 'metrics.jsonl', 'a') as f:
        f.write('{"kind": "train", "step": 5, "lo')  # and a row cut short by the kill
    assert run(tmp_path, '--steps', '4', *common, '--resume', 'auto') == 0
    rows = metrics(tmp_path)
    assert [r['step'] for r in rows if r.get('kind') == 'train'] == [1, 2, 3, 4]
    assert [r['start_step'] for r in rows if 'config' in r] == [0, 2, 2]  # every start stays on record
    resumed = [r for r in rows if r.get('kind') == 'train'][2:]
    assert [r['loss'] for r in resumed] == [r['loss'] for r in killed[2:]]  # the same steps, exactly


def test_metrics_rows_are_strict_json(tmp_path):
    log = files.JsonLines(str(tmp_path / 'm.jsonl'))
    log.write({'kind': 'eval', 'step': 1, 'bpd': 3.5, 'bpd_stderr': float('nan'), 'fid': [float('inf'), 1.0]})
    text = (tmp_path / 'm.jsonl').read_text()
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f'{name} is not JSON')) == {
        'kind': 'eval', 'step': 1, 'bpd': 3.5, 'bpd_stderr': None, 'fid': [None, 1.0]}


def test_stale_temporary_checkpoint_is_removed(tmp_path, capsys):
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    (tmp_path / 'run' / 'ckpt.pt.tmp').write_bytes(b'half a checkpoint')
    capsys.readouterr()
    assert run(tmp_path, '--steps', '3', '--sample-every', '0', '--resume', 'auto') == 0
    assert 'removed' in capsys.readouterr().out
    assert not (tmp_path / 'run' / 'ckpt.pt.tmp').exists() and load_ckpt(tmp_path)['step'] == 3


def test_resume_on_another_folder_is_refused(tmp_path, capsys):
    write_image_folder(tmp_path / 'a', count=12, seed=0)
    write_image_folder(tmp_path / 'b', count=12, seed=1)
    common = ['--dataset', 'folder', '--batch-size', '4', '--loader', 'gpu', '--sample-every', '0']
    assert run(tmp_path, *common, '--data-dir', str(tmp_path / 'a'), '--steps', '2') == 0
    capsys.readouterr()
    ckpt = str(tmp_path / 'run' / 'ckpt.pt')
    assert run(tmp_path, *common, '--data-dir', str(tmp_path / 'b'), '--steps', '4', '--resume', ckpt) == 2
    assert 'another data set' in _stderr_line(capsys)
    assert run(tmp_path, *common, '--data-dir', str(tmp_path / 'a'), '--steps', '4', '--resume', ckpt) == 0


def test_resume_into_another_runs_folder_is_refused(tmp_path, capsys):
    assert run(tmp_path / 'a', '--steps', '2', '--sample-every', '0') == 0
    assert run(tmp_path / 'b', '--steps', '2', '--sample-every', '0') == 0
    before = (tmp_path / 'b' / 'run' / 'ckpt.pt').read_bytes()
    capsys.readouterr()
    other = str(tmp_path / 'a' / 'run' / 'ckpt.pt')
    assert run(tmp_path / 'b', '--steps', '4', '--sample-every', '0', '--resume', other) == 2
    assert 'that the resumed run would overwrite: pass another --out-dir' in _stderr_line(capsys)
    assert (tmp_path / 'b' / 'run' / 'ckpt.pt').read_bytes() == before


def test_a_fresh_run_sets_aside_metrics_left_without_a_checkpoint(tmp_path):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'metrics.jsonl').write_text('{"left": "by a run that died before its checkpoint"}\n')
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    assert 'left' in (tmp_path / 'run' / 'metrics.jsonl.1').read_text()
    assert 'config' in metrics(tmp_path)[0] and not any('left' in row for row in metrics(tmp_path))


def test_resume_from_a_file_that_is_no_checkpoint(tmp_path, capsys):
    torch.save({'weights': torch.zeros(1)}, tmp_path / 'other.pt')
    assert run(tmp_path, '--steps', '2', '--resume', str(tmp_path / 'other.pt')) == 2
    assert 'other.pt' in _stderr_line(capsys)


@pytest.mark.parametrize('failure', [OSError(28, 'No space left on device'),
                                     RuntimeError("DefaultCPUAllocator: can't allocate memory")])
def test_failing_grid_costs_no_checkpoint(tmp_path, monkeypatch, capsys, failure):
    def disk_full(*args, **kwargs):  # a full disk, or a grid too large for memory
        raise failure
    monkeypatch.setattr(training_log, 'write_grid', disk_full)
    assert run(tmp_path, '--epochs', '2') == 0  # a grid at each epoch's end
    captured = capsys.readouterr()
    assert captured.err.count('could not write the sample grid') == 2 and 'samples in' not in captured.out
    assert load_ckpt(tmp_path)['step'] == 24


def test_logged_speed_leaves_out_grids_checkpoints_and_compilation(tmp_path, monkeypatch, shapes_fid_dir):
    # Grids, checkpoints, the FID reference statistics and evaluations that take 1000 s of a fake
    # clock: had they been counted, the logged img/s would imply over 1000 s per interval.
    offset, real_clock = [0.0], time.perf_counter
    monkeypatch.setattr(time, 'perf_counter', lambda: real_clock() + offset[0])

    def slow(real):
        def wrapper(*args, **kwargs):
            offset[0] += 1000.0
            return real(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(training_log, 'write_grid', slow(training_log.write_grid))
    monkeypatch.setattr(checkpoint, 'save_checkpoint', slow(checkpoint.save_checkpoint))
    monkeypatch.setattr(evaluation, 'inception_extractor', lambda weights, device: stand_in_extractor)
    monkeypatch.setattr(evaluation, 'reference_statistics', slow(evaluation.reference_statistics))
    monkeypatch.setattr(evaluation, 'bits_per_image', slow(evaluation.bits_per_image))
    step_once, first = train.train_step, [True]

    def first_step_compiles(*args):  # the first step of a process takes 1000 s, as a compilation may
        if first[0]:
            offset[0] += 1000.0
            first[0] = False
        return step_once(*args)
    monkeypatch.setattr(train, 'train_step', first_step_compiles)
    # 12 steps per epoch: a row, a checkpoint and a grid at every epoch's end; an evaluation every 2 epochs.
    assert run(tmp_path, '--epochs', '3', '--log-every', '12', '--ckpt-every', '12', '--eval-every', '192',
               *EVAL[:-2], '--data-dir', shapes_fid_dir(tmp_path)) == 0
    assert [row['step'] for row in eval_rows(tmp_path)] == [24]
    assert eval_rows(tmp_path)[0]['train_hours'] * 3600 < 100
    rows = [row for row in metrics(tmp_path) if row.get('kind') == 'train']
    assert [row['step'] for row in rows] == [12, 24, 36]
    assert 1000 < rows[0]['first_step_s'] < 1100 and 'first_step_s' not in rows[1]
    implied = [(11 if i == 0 else 12) * 8 / row['img_per_s'] for i, row in enumerate(rows)]  # first step apart
    assert max(implied) < 100
    assert rows[-1]['train_hours'] * 3600 == pytest.approx(sum(implied), rel=1e-6)


def test_mfu_is_per_gpu(monkeypatch):
    cpu = torch.device('cpu')
    cfg = train.resolve_defaults(train.TrainConfig(preset='tiny', dataset='shapes', shapes_count=64, image_size=16,
                                                   batch_size=8, device='cpu', out_dir='unused'), cpu)
    run = train.build_run(cfg, cpu, progress=False)
    from training_log import Metrics
    log = Metrics(dataclasses.replace(run, world_size=2, rank=1), 0, 10)  # rank 1 writes nothing
    log.peak = 1.0  # TFLOP/s
    log.untimed_steps, log.interval_start = 0, time.perf_counter() - 2.0
    row = log.train_row(10, 10, 0.5, 2e-3)
    assert row['img_per_s'] == pytest.approx(10 * 8 / 2.0, rel=0.01)  # the whole job's throughput
    assert row['img_per_s_per_gpu'] == pytest.approx(row['img_per_s'] / 2)
    assert row['mfu'] == pytest.approx(row['img_per_s'] / 2 * log.flops['train'] / 1e12)
    assert not os.path.exists('unused')


def test_modules_import_only_the_layers_below_them():
    # cli at the bottom; the plumbing (files, devices, ranks, reports, sample.py's files); then the model, the
    # maths and the data sets; the loaders, diffusers' formats and the students' maths; the peers (diffusers'
    # UNet, recipe and solvers) and a run's bookkeeping; drawing images (with any solver, the peers' too);
    # evaluation; our checkpoints (saved only once evaluation's checks pass); sampling, training's config and
    # log; training and distillation; the step's bound and its profile; the benchmark. The Triton kernels sit
    # under the model, which calls them.
    import ast
    layer = {'cli': 0, 'kernels': 0, 'files': 1, 'devices': 1, 'reports': 2, 'model': 3,
             'diffusion': 3, 'data': 3, 'sample_files': 2, 'loaders': 4, 'diffusers_io': 4, 'students': 4,
             'peers': 5, 'bookkeeping': 5, 'drawing': 6,
             'evaluation': 7, 'checkpoint': 8, 'sample': 9, 'train_config': 9, 'training_log': 9, 'train': 10,
             'distill': 10, 'roofline': 11, 'timing': 11, 'profiling': 12, 'benchmark': 13}
    folder = os.path.dirname(train.__file__)
    assert sorted(f[:-3] for f in os.listdir(folder) if f.endswith('.py')) == sorted(layer)  # a flat set of modules
    for name in layer:
        tree = ast.parse(open(os.path.join(folder, f'{name}.py')).read())
        found = {alias.name.split('.')[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names} | {node.module.split('.')[0] for node in ast.walk(tree)
                                             if isinstance(node, ast.ImportFrom) and node.module}
        assert all(layer[other] < layer[name] for other in found & set(layer)), (name, found & set(layer))
        assert name != 'train' or 'sample' not in found  # the grid writer lives in drawing.py, below both


def test_the_presets_attention_at_no_level_is_said_and_a_given_one_refused(tmp_path, capsys):
    # --channel-mults 1 leaves tiny one level at 16 and its attention at 8 nowhere: the levels have none, as a
    # run of it always had (so that it resumes), and the start-up says so; asked for by --attn-resolutions, it
    # is refused in one line.
    assert run(tmp_path / 'one', '--steps', '1', '--sample-every', '0', '--channel-mults', '1') == 0
    out = capsys.readouterr().out
    assert "the preset's attention at 8 pixels is at no level of this UNet (levels at 16)" in out
    model = train.UNet(train.model_config_of(train_config.check_flags(train_args(tmp_path, '--channel-mults', '1'))))
    assert not any(type(m).__name__ == 'AttnBlock' for m in model.down.modules())
    assert model.config.attn_resolutions == (8,)
    assert run(tmp_path / 'given', '--steps', '1', '--channel-mults', '1', '--attn-resolutions', '8') == 2
    assert "--attn-resolutions 8: this UNet's levels are at 16 pixels" in _stderr_line(capsys)
    assert run(tmp_path / 'tiny', '--steps', '1', '--sample-every', '0') == 0
    assert 'at no level' not in capsys.readouterr().out


def test_a_recipe_stands_for_its_flags_and_a_flag_beside_it_wins():
    import train_config
    demo = list(train_config.RECIPES['digits-demo'])
    for argv in (['--recipe', 'digits-demo'], ['--recipe=digits-demo'], ['--rec', 'digits-demo']):  # as argparse reads
        assert train_config.with_recipe(argv) == demo + argv
    assert train_config.with_recipe(['--seed', '3']) == ['--seed', '3']
    cfg = train_config.check_flags(['--recipe', 'digits-demo', '--steps', '20000', '--seed', '3'])
    assert (cfg.steps, cfg.seed, cfg.dataset, cfg.stop_at_score) == (20000, 3, 'digits', evaluation.DIGITS_TARGET)
    epochs = train_config.with_recipe(['--recipe', 'digits-demo', '--epochs', '300'])
    assert '--steps' not in epochs  # --epochs given: not the recipe's steps
    assert train_config.check_flags(epochs).steps is None


def test_checkpoints_of_the_old_network_are_refused(tmp_path, capsys):
    import sample
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    path = tmp_path / 'run' / 'ckpt.pt'
    ckpt = torch.load(path, weights_only=True)
    del ckpt['model_version']  # as written before the network was made the paper's
    torch.save(ckpt, path)
    capsys.readouterr()
    assert run(tmp_path, '--steps', '4', '--resume', str(path)) == 2
    assert 'UNet version 1' in _stderr_line(capsys)
    assert sample.cli(['--ckpt', str(path), '--num', '1', '--device', 'cpu', '--out', str(tmp_path / 's')]) == 2
    assert 'retrain' in _stderr_line(capsys)


# ----------------------------------------------------------------------------- evaluation during training

EVAL = ['--eval-samples', '8', '--eval-bpd-images', '12', '--eval-bpd-timesteps', '3', '--sample-every', '0']


def eval_rows(tmp_path):
    return [row for row in metrics(tmp_path) if row.get('kind') == 'eval']


def test_stop_at_score_ends_the_run_at_the_first_evaluation_that_reaches_it(tmp_path, monkeypatch, shapes_fid_dir,
                                                                           capsys):
    monkeypatch.setattr(evaluation, 'inception_extractor', lambda weights, device: stand_in_extractor)
    common = ['--eval-every', '20', *EVAL, '--data-dir', shapes_fid_dir(tmp_path), '--steps', '12']
    scores = iter([50.0, 30.0, 9.0, 5.0])  # the run's FIDs, evaluation by evaluation
    monkeypatch.setattr(evaluation, 'frechet_distance', lambda *args: next(scores))
    assert run(tmp_path, *common, '--stop-at-score', '10') == 0
    assert [r['fid'] for r in eval_rows(tmp_path)] == [50.0, 30.0, 9.0]  # at 24, 40, 64 images: 9 <= 10
    done = metrics(tmp_path)[-1]
    assert done['kind'] == 'done' and done['step'] == 8 and load_ckpt(tmp_path)['step'] == 8  # saved there
    monkeypatch.setattr(evaluation, 'frechet_distance', lambda *args: 5.0)
    assert run(tmp_path, *common, '--out-dir', str(tmp_path / 'other'), '--stop-at-score', '1') == 0  # never reached
    assert json.loads((tmp_path / 'other' / 'metrics.jsonl').read_text().splitlines()[-1])['step'] == 12
    capsys.readouterr()
    assert run(tmp_path, '--steps', '2', '--stop-at-score', '10', '--out-dir', str(tmp_path / 'none')) == 2
    assert 'needs evaluations with a score' in _stderr_line(capsys) and not (tmp_path / 'none').exists()


def test_one_lucky_draw_under_the_target_does_not_stop_the_run(tmp_path, monkeypatch, shapes_fid_dir):
    # The second evaluation's score (9) is under the target (10), but drawn again with other seeds it is 30:
    # the model does not hold the target, and the run goes on. At the third both draws are under: it stops.
    monkeypatch.setattr(evaluation, 'inception_extractor', lambda weights, device: stand_in_extractor)
    scores = iter([50.0, 9.0, 30.0, 8.0, 7.0])
    monkeypatch.setattr(evaluation, 'frechet_distance', lambda *args: next(scores))
    assert run(tmp_path, '--eval-every', '20', *EVAL, '--data-dir', shapes_fid_dir(tmp_path), '--steps', '12',
               '--stop-at-score', '10') == 0
    assert [(r['step'], r['fid'], r.get('fid_confirm')) for r in eval_rows(tmp_path)] == [
        (3, 50.0, None), (5, 9.0, 30.0), (8, 8.0, 7.0)]
    assert metrics(tmp_path)[-1]['step'] == 8 and load_ckpt(tmp_path)['step'] == 8
    row = {'fid': 9.0}
    cfg = train_config.check_flags(['--stop-at-score', '10', '--eval-every', '20'])
    assert not evaluation.score_reached(cfg, row)  # a score never drawn again stops nothing
    assert evaluation.score_reached(cfg, {**row, 'fid_confirm': 10.0})
    assert not evaluation.score_reached(cfg, {**row, 'fid_confirm': 10.5})


def test_an_evaluation_averages_its_draws_each_drawn_with_its_own_noise(tmp_path, monkeypatch, shapes_fid_dir):
    monkeypatch.setattr(evaluation, 'inception_extractor', lambda weights, device: stand_in_extractor)
    scores = iter([50.0, 30.0, 10.0, 20.0])
    monkeypatch.setattr(evaluation, 'frechet_distance', lambda *args: next(scores))
    seeds, drawing = [], evaluation.draw

    def recorded(model, config, sched, sampling, *args, **kwargs):
        seeds.append(sampling.seed)
        return drawing(model, config, sched, sampling, *args, **kwargs)
    monkeypatch.setattr(evaluation, 'draw', recorded)
    assert run(tmp_path, '--eval-every', '20', *EVAL, '--data-dir', shapes_fid_dir(tmp_path), '--steps', '6',
               '--eval-draws', '2', '--eval-noise', 'fresh') == 0
    assert [(r['fid'], r['fid_per_draw'], r['fid_samples']) for r in eval_rows(tmp_path)] == [
        (40.0, [50.0, 30.0], 8), (15.0, [10.0, 20.0], 8)]
    assert len(set(seeds)) == 4  # every draw its own noise
    # A first draw's noise is what it was before draws were averaged: runs recorded then draw it again.
    assert seeds[0] == int(np.random.SeedSequence([0, 1, 2]).generate_state(1)[0])
    assert evaluation.sampling_seed(5, 40, 20, 'fixed') == 5 != evaluation.sampling_seed(5, 40, 20, 'fixed', 1)
    assert evaluation.sampling_seed(5, 40, 20, 'fixed', 1) == evaluation.sampling_seed(5, 80, 20, 'fixed', 1)


def test_evaluations_at_image_counts_and_across_a_resume(tmp_path, monkeypatch, shapes_fid_dir):
    monkeypatch.setattr(evaluation, 'inception_extractor', lambda weights, device: stand_in_extractor)
    common = ['--eval-every', '20', *EVAL, '--data-dir', shapes_fid_dir(tmp_path)]
    assert run(tmp_path, *common, '--steps', '7') == 0
    assert run(tmp_path, *common, '--steps', '12', '--resume', 'auto') == 0
    rows = eval_rows(tmp_path)
    # Batch 8: the first steps at or past 20, 40, 60 and 80 images are 3, 5, 8 and 10.
    assert [(r['step'], r['images_seen']) for r in rows] == [(3, 24), (5, 40), (8, 64), (10, 80)]
    for row in rows:
        assert row['bpd'] > 0 and row['bpd_stderr'] > 0 and row['bpd_images'] == 12
        assert row['bpd_model_calls_per_image'] == 4 and row['fid'] > 0 and row['fid_samples'] == 8
    hours = [r['train_hours'] for r in rows]
    assert hours == sorted(hours) and hours[0] > 0  # training time, counted on across the resume
    from PIL import Image
    with Image.open(tmp_path / 'run' / 'curves.png') as image:
        assert image.size[0] > 600 and image.size[1] > 200  # three panels: losses, bits/dim, FID


def test_fid_during_training_is_sample_pys_fid(tmp_path, monkeypatch, shapes_fid_dir):
    import sample
    for module in (evaluation, sample):  # the evaluation during training, and sample.py's
        monkeypatch.setattr(module, 'inception_extractor', lambda weights, device: stand_in_extractor)
    data_dir = shapes_fid_dir(tmp_path)
    assert run(tmp_path, '--steps', '12', '--eval-every', '96', *EVAL, '--data-dir', data_dir) == 0
    (row,) = eval_rows(tmp_path)  # at step 12, on the EMA that the checkpoint holds
    result = sample.main(sample.SampleConfig(ckpt=str(tmp_path / 'run' / 'ckpt.pt'), num=8, batch_size=8, steps=2,
                                             device='cpu', fid=True, fid_data='shapes', data_dir=data_dir,
                                             out=str(tmp_path / 'samples'), format='npz'))
    assert row['fid'] == pytest.approx(result['fid'], rel=1e-4)  # features kept in float32 between ranks


def test_offline_evaluation_leaves_out_fid_with_one_warning(tmp_path, monkeypatch, capsys):

    def offline(weights, device):
        raise cli.ConfigError('FID needs the InceptionV3 weights, and downloading them failed')
    monkeypatch.setattr(evaluation, 'inception_extractor', offline)
    assert run(tmp_path, '--steps', '10', '--eval-every', '40', *EVAL) == 0
    assert capsys.readouterr().err.count('FID is left out of the evaluations') == 1
    rows = eval_rows(tmp_path)
    assert len(rows) == 2 and all('fid' not in r and r['bpd'] > 0 for r in rows)


def test_an_evaluation_cut_by_a_stop_is_owed_to_the_resumed_run(tmp_path, monkeypatch, shapes_fid_dir):
    monkeypatch.setattr(evaluation, 'inception_extractor', lambda weights, device: stand_in_extractor)
    step_once = train.train_step

    def step_then_sigterm_at_3(run, x0, step):
        loss = step_once(run, x0, step)
        if step == 2 and not run.cfg.resume:  # the step that makes 3, where an evaluation is due
            os.kill(os.getpid(), signal.SIGTERM)
        return loss
    monkeypatch.setattr(train, 'train_step', step_then_sigterm_at_3)
    common = ['--eval-every', '20', *EVAL, '--data-dir', shapes_fid_dir(tmp_path)]
    assert run(tmp_path, *common, '--steps', '6') == 0
    assert load_ckpt(tmp_path)['step'] == 3 and load_ckpt(tmp_path)['eval_owed'] and not eval_rows(tmp_path)
    assert run(tmp_path, *common, '--steps', '6', '--resume', 'auto') == 0
    assert [row['step'] for row in eval_rows(tmp_path)] == [3, 5]  # the owed one first, at the step it was due
    assert not load_ckpt(tmp_path)['eval_owed']


# ----------------------------------------------------------------------------- never keep a broken model

def heldout_loss_of(path, cfg_args=()):
    """The held-out losses (model, EMA) of a checkpoint's weights, as train.py computes them."""
    ckpt = torch.load(path, weights_only=True)
    cfg = train.resolve_defaults(train.TrainConfig(**ckpt['flags']), torch.device('cpu'))
    heldout = evaluation.make_heldout(cfg, torch.device('cpu'), 1000)
    sched = diffusion.make_schedule(1000)
    losses = []
    for weights in ('model', 'ema'):
        net = checkpoint.model_from_checkpoint(ckpt, weights, str(path))
        losses.append(evaluation.heldout_losses(net, sched, heldout, cfg, torch.device('cpu')).mean().item())
    return losses


def test_divergence_keeps_the_last_good_checkpoint_and_names_it(tmp_path, capsys):
    assert run(tmp_path, '--steps', '4', '--sample-every', '0') == 0
    path = tmp_path / 'run' / 'ckpt.pt'
    capsys.readouterr()
    # A learning rate that breaks the weights within a few updates, a checkpoint at every step.
    assert train.cli(['--resume', str(path), '--steps', '40', '--lr', '1e6', '--ckpt-every', '1']) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    ckpt = torch.load(path, weights_only=True)
    assert f"The last good checkpoint is {path} (step {ckpt['step']})" in err or \
        (ckpt['step'] == 4 and f'{path} (step 4, resumed from)' in err), err
    for weights in ('model', 'ema'):
        assert all(t.isfinite().all() for t in ckpt[weights].values())
    assert all(math.isfinite(loss) for loss in heldout_loss_of(path))  # what was kept is a working model
    assert train.cli(['--resume', str(path), '--steps', str(ckpt['step'] + 2)]) == 0  # ... and it trains on


def test_nan_weights_are_never_saved(tmp_path, monkeypatch, capsys):
    step_once = train.train_step

    def poison_at_3(run, x0, step):
        loss = step_once(run, x0, step)  # the loss of this step is finite: it was computed before the update
        if step == 2:
            with torch.no_grad():
                next(run.ema.parameters()).view(-1)[0] = float('nan')
        return loss
    monkeypatch.setattr(train, 'train_step', poison_at_3)
    assert run(tmp_path, '--steps', '6', '--ckpt-every', '3', '--log-every', '100', '--sample-every', '0') == 3
    err = capsys.readouterr().err
    assert 'at step 3: non-finite EMA weights' in err and 'No checkpoint was written by this run' in err
    assert not (tmp_path / 'run' / 'ckpt.pt').exists()


def test_resume_alone_continues_the_run_as_it_was(tmp_path, capsys):
    # Every setting replayed from the checkpoint: `--resume PATH` (and a longer --steps) is enough.
    flags = ['--lr', '1e-3', '--warmup', '4', '--grad-clip', '0.5', '--ema-decay', '0.99', '--dropout', '0.1',
             '--seed', '3', '--ckpt-every', '0', '--log-every', '2', '--sample-every', '0']
    assert run(tmp_path / 'whole', *flags, '--steps', '10') == 0
    assert run(tmp_path / 'split', *flags, '--steps', '5') == 0
    path = tmp_path / 'split' / 'run' / 'ckpt.pt'
    capsys.readouterr()
    assert train.cli(['--resume', str(path), '--steps', '10']) == 0
    assert 'warning' not in capsys.readouterr().err
    whole, split = load_ckpt(tmp_path / 'whole'), load_ckpt(tmp_path / 'split')
    for key in ('model', 'ema'):
        assert all(torch.equal(t, split[key][name]) for name, t in whole[key].items()), key
    elsewhere = ('out_dir', 'samples_dir', 'resume')  # where the two runs write, and whence the split one resumed
    assert {k: v for k, v in split['config'].items() if k not in elsewhere} == \
        {k: v for k, v in whole['config'].items() if k not in elsewhere}
    rows = [r for r in metrics(tmp_path / 'split') if r.get('kind') == 'train']
    assert [r['lr'] for r in rows] == pytest.approx([1e-3 * min(1, r['step'] / 4) for r in rows])


def test_the_done_rows_wall_time_covers_every_process_of_a_resumed_run(tmp_path, monkeypatch):
    # The first process trains slowly, the resumed one fast: the run's wall time holds both, the first
    # up to its checkpoint (what came after the save, on a loaded machine a second or more, is not in it)
    # and the second whole, so it is never smaller than the training time inside it.
    real, common = train.train_step, ['--ckpt-every', '0', '--log-every', '2', '--sample-every', '0']
    monkeypatch.setattr(train, 'train_step', lambda *args: (time.sleep(0.5), real(*args))[1])
    assert run(tmp_path, *common, '--steps', '4') == 0
    first, saved = metrics(tmp_path)[-1], load_ckpt(tmp_path)
    monkeypatch.undo()
    assert train.cli(['--resume', str(tmp_path / 'run' / 'ckpt.pt'), '--steps', '6']) == 0
    done = metrics(tmp_path)[-1]
    assert done['kind'] == 'done' and done['train_seconds'] > first['train_seconds'] >= 1.5  # 3 timed slow steps
    assert first['wall_s'] >= saved['wall_seconds'] >= saved['train_seconds'] > 1.0
    # the first process's wall at its save, and all of the second's: at least its training time
    assert done['wall_s'] >= saved['wall_seconds'] + done['train_seconds'] - saved['train_seconds']


def test_resume_applies_optimisation_changes_with_a_warning_and_refuses_others(tmp_path, capsys):
    assert run(tmp_path, '--steps', '4', '--sample-every', '0', '--lr', '1e-3', '--no-channels-last') == 0
    path = str(tmp_path / 'run' / 'ckpt.pt')
    capsys.readouterr()
    assert train.cli(['--resume', path, '--steps', '6', '--lr', '5e-4']) == 0
    err = capsys.readouterr().err
    assert "warning: --lr 0.0005 (the checkpoint's: 0.001)" in err
    assert train.cli(['--resume', path, '--steps', '7', '--channels-last']) == 0  # the layout: not bit-exact
    assert "warning: --channels-last True (the checkpoint's: False)" in capsys.readouterr().err
    last = [row for row in metrics(tmp_path) if row.get('kind') == 'train'][-1]
    assert load_ckpt(tmp_path)['config']['lr'] == 5e-4 and last['lr'] == pytest.approx(5e-4 * last['step'] / 50)
    for flag, value in (('--seed', '4'), ('--batch-size', '4'), ('--schedule', 'cosine')):
        assert train.cli(['--resume', path, '--steps', '8', flag, value]) == 2
        assert f'the checkpoint has {flag}' in _stderr_line(capsys)


def test_a_second_run_in_the_same_folder_is_refused(tmp_path, root, capsys):
    args = train_args(tmp_path, '--steps', '100000', '--log-every', '1', '--sample-every', '0', '--ckpt-every', '0')
    first = subprocess.Popen([sys.executable, 'train.py', *args], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / 'run' / 'metrics.jsonl').exists():
            time.sleep(0.1)
        before = (tmp_path / 'run' / 'metrics.jsonl').read_text()
        for second in ([*args, '--steps', '3'], [*args, '--steps', '3', '--resume', 'auto']):  # short if let in
            assert train.cli(second) == 2
            line = _stderr_line(capsys)
            assert f'in use by another run (pid {first.pid} on {__import__("socket").gethostname()}' in line
        assert (tmp_path / 'run' / 'metrics.jsonl').read_text().startswith(before)  # untouched by the second
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 0 and not (tmp_path / 'run' / 'lock').exists()  # released at the end


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path, capsys):
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
    (tmp_path / 'run').mkdir()
    lock = {'pid': int(dead.stdout), 'host': __import__('socket').gethostname(), 'started': 'then'}
    (tmp_path / 'run' / 'lock').write_text(json.dumps(lock))
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    assert 'taking over the lock' in capsys.readouterr().out and not (tmp_path / 'run' / 'lock').exists()


def test_full_disk_is_one_line_exit_1_and_resume_auto_works_once_freed(tmp_path, monkeypatch, capsys):
    save, calls = torch.save, []

    def disk_full_on_the_second(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # as torch's zip writer reports ENOSPC: a RuntimeError
            f.write(b'the first bytes of a checkpoint')
            raise RuntimeError('[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: file write failed')
        return save(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, 'save', disk_full_on_the_second)
    common = ['--steps', '6', '--ckpt-every', '3', '--sample-every', '0', '--resume', 'auto']
    assert run(tmp_path, *common) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith('error')]  # and the bar
    assert 'writing' in line and 'ckpt.pt failed' in line and 'file write failed' in line and 'GB free' in line
    assert sorted(os.listdir(tmp_path / 'run')) == ['ckpt.pt', 'metrics.jsonl']  # no partial file, no lock
    assert load_ckpt(tmp_path)['step'] == 3
    monkeypatch.undo()
    assert run(tmp_path, *common) == 0 and load_ckpt(tmp_path)['step'] == 6


def test_resume_is_exact_with_fid_evaluation_on(tmp_path, monkeypatch, shapes_fid_dir):
    import evaluation as sample_module

    def inception_like(weights, device):
        torch.nn.Linear(64, 64)  # building the Inception network draws its initial weights from the global RNG
        return stand_in_extractor
    monkeypatch.setattr(sample_module, 'inception_extractor', inception_like)
    common = ['--eval-every', '24', *EVAL, '--dropout', '0.1', '--ckpt-every', '0', '--log-every', '100',
              '--data-dir', shapes_fid_dir(tmp_path)]
    assert run(tmp_path / 'whole', *common, '--steps', '5') == 0  # an evaluation at step 3
    assert run(tmp_path / 'split', *common, '--steps', '2') == 0
    assert run(tmp_path / 'split', *common, '--steps', '5', '--resume', 'auto') == 0
    whole, split = load_ckpt(tmp_path / 'whole'), load_ckpt(tmp_path / 'split')
    assert all(torch.equal(t, split['model'][k]) for k, t in whole['model'].items())
    assert [r['fid'] for r in eval_rows(tmp_path / 'whole')] == [r['fid'] for r in eval_rows(tmp_path / 'split')]


def test_sigint_stops_and_saves_like_sigterm(tmp_path, monkeypatch, capsys):
    step_once = train.train_step

    def ctrl_c_at_3(run, x0, step):
        loss = step_once(run, x0, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return loss
    monkeypatch.setattr(train, 'train_step', ctrl_c_at_3)
    assert run(tmp_path, '--steps', '50') == 0
    assert 'stopped by SIGINT at step 3' in capsys.readouterr().out and load_ckpt(tmp_path)['step'] == 3


def test_a_resume_that_owes_an_evaluation_without_eval_every(tmp_path):
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    ckpt = load_ckpt(tmp_path)
    ckpt['eval_owed'] = True  # stopped at an evaluation, resumed without --eval-every
    torch.save(ckpt, tmp_path / 'run' / 'ckpt.pt')
    assert run(tmp_path, '--steps', '4', '--sample-every', '0', '--resume', 'auto') == 0
    assert load_ckpt(tmp_path)['step'] == 4 and not load_ckpt(tmp_path)['eval_owed']


@pytest.mark.parametrize('seed', ['-1', str(2 ** 64)])
def test_seeds_outside_their_range_are_one_line(tmp_path, capsys, seed):
    assert run(tmp_path, '--steps', '2', '--seed', seed) == 2
    assert '--seed must be in [0, 4294967295]' in _stderr_line(capsys)


def test_evaluation_measures_the_ema_on_held_out_images():
    run_ = tiny_run(eval_every=8, eval_bpd_images=6, eval_bpd_timesteps=3, eval_fid=False, seed=2)
    with torch.no_grad():  # an EMA unlike the model
        for p, e in zip(run_.model.parameters(), run_.ema.parameters()):
            e.copy_(p + 0.05 * torch.randn_like(p))
    row = evaluation.Evaluator(run_)(5, 0.25)
    assert (row['step'], row['images_seen'], row['train_hours'], row['bpd_images']) == (5, 40, 0.25, 6)

    def bits(net):
        # the evaluation's stream at step 5
        generator = torch.Generator().manual_seed(evaluation.evaluation_seed(2, 5, 0))
        images = data.load_heldout('shapes', '', 16, 6)
        return evaluation.bits_per_image(net, run_.sched, images, 8, torch.device('cpu'), generator, 3)['total']
    ema = bits(run_.ema)
    assert row['bpd'] == pytest.approx(ema.mean().item(), rel=1e-9)
    assert row['bpd_stderr'] == pytest.approx((ema.std() / 6 ** 0.5).item(), rel=1e-9)
    assert abs(bits(run_.model).mean().item() - row['bpd']) > 1e-3  # the raw weights would read otherwise


def test_evaluation_reads_the_test_split_and_fid_the_training_split(tmp_path, monkeypatch):
    import evaluation as sample_module
    monkeypatch.setattr(torchvision.datasets.cifar, 'check_integrity', lambda *a, **k: True)
    monkeypatch.setattr(sample_module, 'inception_extractor', lambda weights, device: stand_in_extractor)
    write_cifar10(tmp_path / 'cifar', train_per_batch=8, test_count=16)
    run_ = tiny_run(dataset='cifar10', data_dir=str(tmp_path / 'cifar'), image_size=32, eval_every=8,
                    eval_bpd_images=6)
    evaluator = evaluation.Evaluator(run_)
    test, train_split = (data.load_cifar10(str(tmp_path / 'cifar'), train=split) for split in (False, True))
    assert torch.equal(evaluator.images, test[:6])
    expected = evaluation.statistics(stand_in_extractor(train_split).numpy())
    assert np.allclose(evaluator.reference['mu'], expected['mu']) and np.allclose(evaluator.reference['sigma'],
                                                                                   expected['sigma'])



# ----------------------------------------------------------------------------- tried as a tester would

def test_a_lock_naming_this_process_is_taken_over(tmp_path, capsys):
    # A container restarted after kill -9 may give the new run the pid the lock names.
    (tmp_path / 'run').mkdir()
    lock = {'pid': os.getpid(), 'host': __import__('socket').gethostname(), 'started': 'before the restart'}
    (tmp_path / 'run' / 'lock').write_text(json.dumps(lock))
    assert run(tmp_path, '--steps', '2', '--sample-every', '0', '--resume', 'auto') == 0
    assert 'taking over the lock' in capsys.readouterr().out


def test_out_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / 'afile').write_text('')
    assert run(tmp_path, '--steps', '2', '--out-dir', str(tmp_path / 'afile')) == 2
    assert 'cannot write there' in _stderr_line(capsys)


@pytest.mark.parametrize('damage, expected', [
    (lambda ckpt: ckpt.pop('optimizer'), 'not a complete train.py checkpoint (it lacks optimizer)'),
    (lambda ckpt: ckpt['ema']['conv_out.bias'].fill_(float('nan')), 'its ema weights are not finite'),
    (lambda ckpt: ckpt['optimizer']['param_groups'].append({}), 'its states do not fit this run'),
])
def test_damaged_checkpoints_are_refused_at_resume(tmp_path, capsys, damage, expected):
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    path = tmp_path / 'run' / 'ckpt.pt'
    ckpt = torch.load(path, weights_only=True)
    damage(ckpt)
    torch.save(ckpt, path)
    capsys.readouterr()
    assert run(tmp_path, '--steps', '4', '--sample-every', '0', '--resume', 'auto') == 2
    assert expected in _stderr_line(capsys)


def test_resume_from_a_file_that_is_not_a_checkpoint_says_so(tmp_path, capsys):
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    capsys.readouterr()
    assert train.cli(['--resume', str(tmp_path / 'run' / 'metrics.jsonl')]) == 2
    assert 'not a train.py checkpoint (not a file written by torch.save)' in _stderr_line(capsys)


def test_epochs_at_a_resume_set_the_length_of_a_run_begun_with_steps(tmp_path):
    assert run(tmp_path, '--steps', '4', '--sample-every', '0') == 0
    assert train.cli(['--resume', str(tmp_path / 'run' / 'ckpt.pt'), '--epochs', '1']) == 0  # 12 steps per epoch
    assert load_ckpt(tmp_path)['step'] == 12


def test_a_copy_resumed_elsewhere_keeps_its_grids_in_its_own_folder(tmp_path):
    assert run(tmp_path / 'a', '--steps', '2') == 0
    (tmp_path / 'copy').mkdir()
    __import__('shutil').copy(tmp_path / 'a' / 'run' / 'ckpt.pt', tmp_path / 'copy' / 'ckpt.pt')
    assert train.cli(['--resume', str(tmp_path / 'copy' / 'ckpt.pt'), '--steps', '4']) == 0
    assert (tmp_path / 'copy' / 'samples' / 'step_0000004.png').exists()
    assert not (tmp_path / 'a' / 'samples' / 'step_0000004.png').exists()  # the original's folder untouched


def test_a_stop_during_an_evaluation_saves_that_step_and_owes_it(tmp_path, monkeypatch, shapes_fid_dir):
    import evaluation as sample_module
    monkeypatch.setattr(sample_module, 'inception_extractor', lambda weights, device: stand_in_extractor)
    # SIGTERM in the first evaluation
    monkeypatch.setattr(sample_module, 'bits_per_image', signal_on_call(sample_module.bits_per_image, 1))
    common = ['--eval-every', '24', *EVAL, '--data-dir', shapes_fid_dir(tmp_path)]
    assert run(tmp_path, *common, '--steps', '6') == 0  # the first evaluation is due at step 3
    ckpt = load_ckpt(tmp_path)
    assert ckpt['step'] == 3 and ckpt['eval_owed'] and not eval_rows(tmp_path)  # that step, not the next
    assert run(tmp_path, *common, '--steps', '3', '--resume', 'auto') == 0  # at the target: it runs what it owes
    assert [r['step'] for r in eval_rows(tmp_path)] == [3] and not load_ckpt(tmp_path)['eval_owed']


def test_an_owed_evaluation_that_reaches_the_stop_score_ends_the_run_as_the_uninterrupted_one(tmp_path, monkeypatch,
                                                                                              shapes_fid_dir):
    # --stop-at-score reached at the first evaluation (step 3): the uninterrupted run ends there; one stopped
    # during that evaluation and resumed runs it first, and ends there too (not at the next one, step 6).
    monkeypatch.setattr(evaluation, 'inception_extractor', lambda weights, device: stand_in_extractor)
    monkeypatch.setattr(evaluation, 'frechet_distance', lambda *args: 5.0)
    common = ['--eval-every', '24', *EVAL, '--data-dir', shapes_fid_dir(tmp_path), '--stop-at-score', '10',
              '--steps', '9']
    assert run(tmp_path / 'whole', *common) == 0
    # SIGTERM in the first evaluation
    monkeypatch.setattr(evaluation, 'bits_per_image', signal_on_call(evaluation.bits_per_image, 1))
    assert run(tmp_path / 'split', *common) == 0
    assert load_ckpt(tmp_path / 'split')['eval_owed']
    assert run(tmp_path / 'split', *common, '--resume', 'auto') == 0
    for folder in ('whole', 'split'):
        assert metrics(tmp_path / folder)[-1] == {**metrics(tmp_path / folder)[-1], 'kind': 'done', 'step': 3}
        assert [r['step'] for r in eval_rows(tmp_path / folder)] == [3]
    whole, split = load_ckpt(tmp_path / 'whole'), load_ckpt(tmp_path / 'split')
    assert split['step'] == 3 and not split['eval_owed']
    assert all(torch.equal(whole['ema'][k], split['ema'][k]) for k in whole['ema'])


def test_a_stop_during_start_up_exits_cleanly(tmp_path, monkeypatch, capsys):
    validate = train.validate

    def sigterm_while_validating(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # before the data and the model are built
        return validate(*args, **kwargs)
    monkeypatch.setattr(train, 'validate', sigterm_while_validating)
    assert run(tmp_path, '--steps', '5') == 0
    assert 'stopped by SIGTERM before training started' in capsys.readouterr().out
    assert not (tmp_path / 'run' / 'ckpt.pt').exists() and not (tmp_path / 'run' / 'lock').exists()

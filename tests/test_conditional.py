"""Class-conditional training and classifier-free guidance: the guidance formula against a case
computed by hand, labels through every loader, a folder's classes, exact resume and its refusals,
sampling to order, and the digits judge of conditioning (its floor and a control that must fail).
The network against diffusers' UNet2DModel(num_class_embeds) is in test_reference_unet.py."""
import os
import pickle
import signal
from unittest import mock

import numpy as np
import pytest
import torch
import torchvision
from helpers import NO_DIFFUSERS, refusal, write_cifar10

import checkpoint
import data
import diffusion
import drawing
import evaluation
import loaders
import sample
import train
import train_config


class LabelledToy(torch.nn.Module):
    """out = x * (label + 1) + t / 1000: an output that a hand computation can follow, counting calls."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, t, labels):
        self.calls.append(len(x))
        return x * (labels + 1).to(x.dtype)[:, None, None, None] + t.to(x.dtype)[:, None, None, None] / 1000


def test_guidance_is_eq_6_computed_by_hand():
    toy, x = LabelledToy(), torch.full((2, 1, 1, 1), 2.0)
    t, labels = torch.tensor([100, 500]), torch.tensor([3, 0])
    out = diffusion.guided(toy, labels, 2.5, null_label=10)(x, t)
    # Image 0: conditional 2 * 4 + 0.1 = 8.1, unconditional 2 * 11 + 0.1 = 22.1: 22.1 + 2.5 (8.1 - 22.1) = -12.9.
    # Image 1: conditional 2 * 1 + 0.5 = 2.5, unconditional 22.5: 22.5 + 2.5 (2.5 - 22.5) = -27.5.
    assert torch.allclose(out.flatten(), torch.tensor([-12.9, -27.5]))
    assert toy.calls == [4]  # the two halves in one batched call
    assert torch.allclose(diffusion.guided(toy, labels, 1.0, 10)(x, t).flatten(), torch.tensor([8.1, 2.5]))
    assert torch.allclose(diffusion.guided(toy, labels, 0.0, 10)(x, t).flatten(), torch.tensor([22.1, 22.5]))
    assert toy.calls[1:] == [2, 2]  # scale 1 and 0: one half alone


def test_guiding_v_is_guiding_eps():
    # The docstring's claim: eps is affine in v at a fixed x_t, so guiding either output is the same.
    sched, toy = diffusion.make_schedule(1000), LabelledToy()
    x, t, labels = torch.randn(3, 1, 4, 4, dtype=torch.float64), torch.tensor([10, 400, 990]), torch.tensor([1, 2, 5])

    def eps_of_v(xt, tt, y):  # the eps a v network's output stands for
        alpha = diffusion.gather(sched.sqrt_alphas_cumprod.double(), tt, xt)
        sigma = diffusion.gather(sched.sqrt_one_minus_alphas_cumprod.double(), tt, xt)
        return diffusion.eps_and_x0(toy(xt, tt, y), xt, alpha, sigma, 'v')[0]
    guided_v = diffusion.guided(toy, labels, 3.0, 10)(x, t)
    alpha = diffusion.gather(sched.sqrt_alphas_cumprod.double(), t, x)
    sigma = diffusion.gather(sched.sqrt_one_minus_alphas_cumprod.double(), t, x)
    guided_then_eps = diffusion.eps_and_x0(guided_v, x, alpha, sigma, 'v')[0]
    eps_then_guided = diffusion.guided(eps_of_v, labels, 3.0, 10)(x, t)
    assert torch.allclose(guided_then_eps, eps_then_guided, atol=1e-12)
    assert (eps_then_guided - eps_of_v(x, t, labels)).abs().max() > 0.1  # the guidance did something


def test_drop_labels_replaces_the_share_asked_with_no_class():
    torch.manual_seed(0)
    labels = torch.arange(20000) % 10
    dropped = diffusion.drop_labels(labels, 0.1, 10)
    share = (dropped == 10).double().mean().item()
    assert abs(share - 0.1) < 0.01  # 0.1 +- 4.7 sd
    kept = dropped != 10
    assert torch.equal(dropped[kept], labels[kept])
    assert torch.equal(diffusion.drop_labels(labels, 0.0, 10), labels)


def labelled_images(count=64):
    """Images whose every pixel tells their label: image i is class i mod 7, all pixels 30 x class."""
    labels = torch.arange(count) % 7
    images = (labels * 30).to(torch.uint8)[:, None, None, None].expand(count, 1, 4, 4).contiguous()
    return data.ImageTensorDataset(images, labels, [str(c) for c in range(7)])


def label_of_pixels(batch: torch.Tensor) -> torch.Tensor:
    return ((batch[:, 0, 0, 0] + 1) * 127.5 / 30).round().long()


@pytest.mark.parametrize('kind', ['gpu', 'torch', 'ffcv'])
def test_every_loader_yields_each_images_own_label(kind, tmp_path):
    dataset = labelled_images()
    if kind == 'ffcv':
        pytest.importorskip('ffcv', reason='the optional FFCV extra (requirements-ffcv.txt)')
        data.write_beton(dataset, str(tmp_path / 'l.beton'), num_workers=1)
        dataset = data.BetonDataset(str(tmp_path / 'l.beton'), labels=True)
        assert dataset.class_names == [str(c) for c in range(7)]
    loader = loaders.make_loader(kind, dataset, 8, seed=3, device='cpu', num_workers=0, flip=False)
    seen = []
    for epoch in (0, 1):
        for images, labels in loader.epoch(epoch, start=1):
            assert labels.dtype == torch.long and torch.equal(labels, label_of_pixels(images))
            seen.append(labels)
    assert len(seen) == 2 * 7 and len(torch.cat(seen).unique()) == 7
    unlabelled = loaders.make_loader(kind, data.ImageTensorDataset(dataset.images) if kind != 'ffcv' else
                                  data.BetonDataset(str(tmp_path / 'l.beton')), 8, 3, 'cpu', 0)
    assert isinstance(next(unlabelled.epoch(0)), torch.Tensor)  # unconditional: images alone, as before


def test_a_folders_classes_are_its_subfolders_and_bad_folders_are_refused(tmp_path):
    from PIL import Image
    for name, shade in (('cat', 40), ('dog', 200), ('dog/puppies', 210)):
        os.makedirs(tmp_path / 'set' / name, exist_ok=True)
        for i in range(2):
            Image.new('RGB', (8, 8), (shade + i,) * 3).save(tmp_path / 'set' / name / f'{i}.png')
    dataset = data.load_dataset('folder', str(tmp_path / 'set'), 8, labels=True)
    assert dataset.class_names == ['cat', 'dog']
    shades = [int(dataset[i][0, 0, 0]) for i in range(len(dataset))]
    assert [int(label) for label in dataset.labels] == [0 if s < 100 else 1 for s in shades]  # nested ones: dog
    Image.new('RGB', (8, 8)).save(tmp_path / 'set' / 'loose.png')
    with pytest.raises(data.DataError, match='outside any class subfolder.*loose.png'):
        data.class_names('folder', str(tmp_path / 'set'))
    os.makedirs(tmp_path / 'one' / 'only')
    Image.new('RGB', (8, 8)).save(tmp_path / 'one' / 'only' / 'a.png')
    with pytest.raises(data.DataError, match='1 class subfolder'):
        data.load_dataset('folder', str(tmp_path / 'one'), 8, labels=True)
    os.makedirs(tmp_path / 'gap' / 'b')  # an empty class between two: the later one's index would shift
    for name in ('a', 'c'):
        os.makedirs(tmp_path / 'gap' / name)
        Image.new('RGB', (8, 8)).save(tmp_path / 'gap' / name / 'x.png')
    with pytest.raises(data.DataError, match="class subfolder 'b' .* holds no images"):
        data.load_dataset('folder', str(tmp_path / 'gap'), 8, labels=True)
    with pytest.raises(data.DataError, match='shapes set has no labels'):
        data.load_dataset('shapes', '', 8, labels=True)


def test_cifar10_labels_are_its_files_labels(tmp_path, monkeypatch):
    monkeypatch.setattr(torchvision.datasets.cifar, 'check_integrity', lambda *args, **kwargs: True)
    write_cifar10(tmp_path, train_per_batch=4, test_count=2)
    dataset = data.load_dataset('cifar10', str(tmp_path), 32, labels=True)
    with open(tmp_path / 'cifar-10-batches-py' / 'data_batch_2', 'rb') as f:
        second = pickle.load(f)['labels']
    assert dataset.labels[4:8].tolist() == second and dataset.class_names[0] == 'airplane'


def digits_args(tmp_path, *extra):
    return ['--preset', 'tiny', '--dataset', 'digits', '--image-size', '8', '--batch-size', '16', '--device', 'cpu',
            '--heldout-size', '16', '--sample-every', '0', '--log-every', '3', '--data-dir', str(tmp_path / 'data'),
            '--out-dir', str(tmp_path / 'run'), '--class-cond', *extra]


def test_class_conditional_training_resumes_exactly_and_refuses_a_change(tmp_path, capsys):
    assert train.cli(digits_args(tmp_path / 'whole', '--steps', '6')) == 0
    assert train.cli(digits_args(tmp_path / 'split', '--steps', '3')) == 0
    ckpt = str(tmp_path / 'split' / 'run' / 'ckpt.pt')
    assert train.cli(['--resume', ckpt, '--steps', '6']) == 0
    whole, split = (torch.load(tmp_path / p / 'run' / 'ckpt.pt', weights_only=True) for p in ('whole', 'split'))
    assert whole['model_config']['num_classes'] == 10 and whole['data']['classes'] == [str(d) for d in range(10)]
    assert whole['config']['label_drop'] == 0.1 and whole['config']['guidance'] == 1.0
    for name, tensor in whole['model'].items():
        assert torch.equal(tensor, split['model'][name]), name
    for change, expected in ((['--label-drop', '0.2'], '--label-drop 0.1, this run 0.2'),
                             (['--no-class-cond'], 'num_classes=10 (now 0: --class-cond differs)')):
        capsys.readouterr()
        code, err = refusal(capsys, train.cli, ['--resume', ckpt, '--steps', '9', *change])
        assert code == 2 and expected in err and len(err.splitlines()) == 1
    # The labels reach the network: the same run without them learns other weights.
    assert train.cli(digits_args(tmp_path / 'nolabels', '--steps', '6', '--label-drop', '0.9999')) == 0
    other = torch.load(tmp_path / 'nolabels' / 'run' / 'ckpt.pt', weights_only=True)
    assert not torch.equal(other['model']['conv_out.weight'], whole['model']['conv_out.weight'])


@pytest.mark.parametrize('extra, expected', [
    (['--dataset', 'shapes', '--image-size', '8'], 'shapes set has no labels'),
    (['--no-class-cond', '--label-drop', '0.2'], '--label-drop 0.2 has no labels to act on without --class-cond'),
    (['--no-class-cond', '--guidance', '2'], '--guidance 2.0 has no labels to act on'),
    (['--label-drop', '1'], '--label-drop'), (['--guidance', '-1'], '--guidance'),
])
def test_conditioning_flags_are_refused_before_any_work(tmp_path, capsys, extra, expected):
    code, err = refusal(capsys, train.cli, digits_args(tmp_path, '--steps', '2', *extra))
    assert code == 2 and expected in err and len(err.splitlines()) == 1
    assert not (tmp_path / 'run').exists() or not os.listdir(tmp_path / 'run')


@pytest.fixture(scope='module')
def conditional_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('conditional')
    assert train.cli(digits_args(tmp, '--steps', '2')) == 0
    return str(tmp / 'run' / 'ckpt.pt')


def test_sample_py_draws_to_order_and_refuses_what_cannot_be(conditional_ckpt, tmp_path, capsys):
    common = ['--ckpt', conditional_ckpt, '--steps', '2', '--device', 'cpu']
    for extra, expected in ((['--label', '10'], '--label 10: the model has 10 classes, 0 to 9'),
                            (['--guidance', '-0.5'], '--guidance must be 0 or more')):
        code, err = refusal(capsys, sample.cli, [*common, '--num', '4', '--out', str(tmp_path / 'no'), *extra])
        assert code == 2 and expected in err and not (tmp_path / 'no').exists()
    ckpt = torch.load(conditional_ckpt, weights_only=True)
    ckpt['model_config']['num_classes'] = 0
    ckpt['model'] = ckpt['ema'] = {k: v for k, v in ckpt['ema'].items() if not k.startswith('class_emb')}
    torch.save(ckpt, tmp_path / 'plain.pt')
    code, err = refusal(capsys, sample.cli, ['--ckpt', str(tmp_path / 'plain.pt'), '--guidance', '2', '--num', '4',
                                             '--out', str(tmp_path / 'no'), '--device', 'cpu'])
    assert code == 2 and 'unconditional model' in err and not (tmp_path / 'no').exists()
    # One class for every image, or each in turn: the labels the model is called with.
    calls = []
    original = diffusion.guided

    def spy(model, labels, scale, null_label):
        calls.append((labels.tolist(), scale))
        return original(model, labels, scale, null_label)
    import drawing as drawing_module
    drawing_module.diffusion.guided = spy
    try:
        assert sample.cli([*common, '--num', '12', '--batch-size', '5', '--out', str(tmp_path / 'each')]) == 0
        assert sample.cli([*common, '--num', '3', '--label', '7', '--guidance', '3', '--out', str(tmp_path / 's')]) == 0
        capsys.readouterr()
        assert sample.cli([*common, '--num', '15', '--grid', '--out', str(tmp_path / 'g')]) == 0
        assert '15 images are not a whole row of each of the 10 classes' in capsys.readouterr().out
    finally:
        drawing_module.diffusion.guided = original
    assert calls == [(list(range(5)), 1.0), ([5, 6, 7, 8, 9], 1.0), ([0, 1], 1.0), ([7, 7, 7], 3.0),
                     ([i % 10 for i in range(15)], 1.0)]


def test_a_grid_of_each_class_has_a_row_per_class(tmp_path):
    from PIL import Image
    images = (drawing.class_labels(0, 30, 10)[:, None, None, None] * 20).to(torch.uint8).expand(30, 1, 4, 4)
    drawing.write_grid_png(images.contiguous(), str(tmp_path / 'g.png'), num_classes=10)
    grid = np.asarray(Image.open(tmp_path / 'g.png'))
    # make_grid pads 2 pixels around each 4x4 image: row r's images start at 2 + 6 r.
    rows = [grid[2 + 6 * r, 2::6][:3].tolist() for r in range(10)]
    assert rows == [[20 * r] * 3 for r in range(10)]


def test_the_judge_of_conditioning_has_its_floor_and_a_control_that_fails(digits_judge):
    judge = digits_judge
    real, labels = data.load_digits_split(16, heldout=True)
    right = judge.conditioning(real, labels)
    assert right['accuracy'] == right['floor_accuracy'] > 0.9  # real digits asked as what they are: the floor
    assert 0.03 < right['shuffled_labels_accuracy'] < 0.2  # the control fails: about 10%
    for c, row in right['per_class'].items():
        assert abs(row['digits_fd'] - row['floor_digits_fd']) < 1e-9 and row['samples'] == (labels == c).sum()
    threes = labels == 3  # one class asked of all: no shuffle moves the labels, so no control
    alone = judge.conditioning(real[threes], labels[threes])
    assert alone['shuffled_labels_accuracy'] is None and alone['accuracy'] > 0.9
    assert 'no control: one class asked' in evaluation.conditioning_summary(alone, 1.0)
    wrong = judge.conditioning(real, (labels + 1) % 10)  # every digit asked as another
    assert wrong['accuracy'] < 0.05
    assert all(w['digits_fd'] > 5 * r['digits_fd'] for w, r in zip(wrong['per_class'].values(),
                                                                  right['per_class'].values()))


def test_a_conditional_export_is_diffusers_with_class_labels_and_starts_a_run(conditional_ckpt, tmp_path, capsys):
    diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    ckpt = torch.load(conditional_ckpt, weights_only=True)
    generator = torch.Generator().manual_seed(0)
    for tensor in ckpt['ema'].values():  # weights far from their initial near-zero output
        tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    torch.save(ckpt, tmp_path / 'ckpt.pt')
    assert sample.cli(['--ckpt', str(tmp_path / 'ckpt.pt'), '--export-diffusers', str(tmp_path / 'pipe'), '--device',
                       'cpu']) == 0
    assert 'DDPMPipeline cannot draw it (it passes no class labels)' in capsys.readouterr().out
    ours = checkpoint.model_from_checkpoint(ckpt, 'ema', 'ckpt')
    theirs = diffusers.UNet2DModel.from_pretrained(str(tmp_path / 'pipe' / 'unet')).eval()
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([3, 300, 900]), torch.tensor([0, 9, 10])
    with torch.no_grad():
        a, b = ours(x, t, y), theirs(x, t, class_labels=y).sample
    assert (a - b).abs().max() <= 1e-5 * a.abs().max() and a.abs().max() > 0.1
    start = train.build_run(train_config.check_flags(digits_args(tmp_path / 'init', '--steps', '1', '--init-from',
                                                          str(tmp_path / 'pipe'))), torch.device('cpu'),
                            init=checkpoint.initial_weights(str(tmp_path / 'pipe'), ours.config))
    assert all(torch.equal(v, start.model.state_dict()[k]) for k, v in ours.state_dict().items())



def test_the_guidance_sweep_reports_each_scale_with_its_floor_control_and_checkpoint(tmp_path, digits_cache,
                                                                                      digits_judge, capsys):
    import json
    import guidance_sweep
    cache = digits_cache  # the session's classifier, cached
    assert train.cli(digits_args(tmp_path, '--steps', '2', '--image-size', '16', '--data-dir', cache)) == 0
    out = tmp_path / 'out'
    sweep = ['--ckpt', str(tmp_path / 'run' / 'ckpt.pt'), '--num', '20', '--steps', '2', '--batch-size', '10',
             '--data-dir', cache, '--out-dir', str(out)]
    for bad, expected in ((['--scales', '1,-1'], 'each 0 or more'), (['--scales', '1,1'], 'distinct'),
                          (['--scales', 'x'], 'numbers separated by commas'),
                          (['--scales', '1,,2'], 'numbers separated by commas')):
        code, err = refusal(capsys, guidance_sweep.main, [*sweep, *bad])
        assert code == 2 and expected in err and not out.exists()
    assert guidance_sweep.main([*sweep, '--scales', '0,2']) == 0
    result = json.loads((out / 'cpu-digits-guidance.json').read_text())
    assert [r['scale'] for r in result['rows']] == [0, 2]
    assert result['floor']['accuracy'] == digits_judge.accuracy
    assert result['floor']['digits_fd'] == digits_judge.floor['digits_fd']
    for row in result['rows']:  # 20 samples, two of each digit
        assert [c['samples'] for c in row['per_class'].values()] == [2] * 10
        assert row['accuracy'] == sum(c['accuracy'] * 2 for c in row['per_class'].values()) / 20
        assert 0 <= row['digits_near_copies'] <= 1 and row['digits_fd_450'] == row['digits_fd']  # 20 < 450: all
    trained = result['trained']
    assert trained['steps'] == 2 and trained['images'] == 32 and trained['flags']['class_cond'] is True
    assert '`python train.py --batch-size 16 --class-cond' in (out / 'cpu-digits-guidance.md').read_text()
    assert (out / 'cpu-digits-guidance.png').stat().st_size > 0
    # SIGTERM while the second scale draws: exit 0, the first scale's reports written, the second's abandoned.
    real_draw = guidance_sweep.draw

    def draw_then_stop(model, config, sched, sampling, *args, **kwargs):
        if sampling.guidance == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        yield from real_draw(model, config, sched, sampling, *args, **kwargs)
    stopped = tmp_path / 'stopped'
    capsys.readouterr()
    with mock.patch.object(guidance_sweep, 'draw', draw_then_stop):
        assert guidance_sweep.main([*sweep[:-1], str(stopped), '--scales', '0,2,3']) == 0
    assert 'stopped by SIGTERM: the reports in' in capsys.readouterr().out
    assert [r['scale'] for r in json.loads((stopped / 'cpu-digits-guidance.json').read_text())['rows']] == [0]
    assert (stopped / 'cpu-digits-guidance.png').stat().st_size > 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or not isinstance(
        signal.getsignal(signal.SIGTERM), guidance_sweep.StopFlag)  # the handlers put back

"""The scripts used as a tester would: requeued fine-tunes, folders of other files, broken
files given by flags, failed and racing writes, and the evaluation's own guards. Each case
behaves as docs/robustness.md says, in one line where it refuses."""
import json
import os

import pytest
import torch
from helpers import train_args

import evaluation
import sample
import train


def run(tmp_path, *extra):
    return train.cli(train_args(tmp_path, *extra))


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith('error')]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope='module')
def tiny_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('source')
    assert run(tmp, '--steps', '2', '--sample-every', '0') == 0
    return str(tmp / 'run' / 'ckpt.pt')


@pytest.fixture(scope='module')
def exported(tiny_ckpt, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp('export') / 'pipe')
    assert sample.cli(['--ckpt', tiny_ckpt, '--export-diffusers', folder, '--device', 'cpu']) == 0
    return folder


# ----------------------------------------------------------------------------- fine-tuning and resume

def test_a_fine_tune_requeues_after_its_source_is_gone(tmp_path, tiny_ckpt, capsys):
    source = tmp_path / 'source.pt'
    source.write_bytes(open(tiny_ckpt, 'rb').read())
    command = ['--init-from', str(source), '--resume', 'auto', '--sample-every', '0', '--ckpt-every', '2']
    assert run(tmp_path, *command, '--steps', '2') == 0
    source.unlink()  # the released weights are gone from the scratch disk before the requeue
    capsys.readouterr()
    assert run(tmp_path, *command, '--steps', '4') == 0
    assert 'is not read' in capsys.readouterr().out
    assert torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)['step'] == 4
    assert train.cli(['--resume', str(tmp_path / 'run' / 'ckpt.pt'), '--steps', '6']) == 0


def test_init_from_with_resume_of_another_architecture_is_named_not_read(tmp_path, tiny_ckpt, capsys):
    other = tmp_path / 'other'
    assert run(other, '--steps', '1', '--sample-every', '0', '--dataset', 'digits') == 0  # 1 channel
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 0
    capsys.readouterr()
    ckpt = str(tmp_path / 'run' / 'ckpt.pt')
    assert train.cli(['--resume', ckpt, '--steps', '3', '--init-from', str(other / 'run' / 'ckpt.pt')]) == 0
    out = capsys.readouterr().out
    assert f"--init-from {other / 'run' / 'ckpt.pt'} is not read" in out


def test_init_from_non_finite_weights_is_refused_before_any_work(tmp_path, tiny_ckpt, capsys):
    ckpt = torch.load(tiny_ckpt, weights_only=True)
    ckpt['ema']['conv_out.bias'].fill_(float('nan'))
    torch.save(ckpt, tmp_path / 'nan.pt')
    assert run(tmp_path, '--steps', '2', '--init-from', str(tmp_path / 'nan.pt')) == 2
    assert 'weights are not finite' in one_error_line(capsys)
    assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('flags, expected', [
    (['--t-sampling', 'laplace', '--t-mean', 'nan'], '--t-mean must be a finite number, got nan'),
    (['--t-sampling', 'lognormal', '--t-mean=-inf'], '--t-mean must be a finite number, got -inf'),
    (['--t-sampling', 'lognormal', '--t-mean', '30'], '--t-mean 30.0: outside [-4.61, 5.06]'),
    (['--lr-decay', 'cosine', '--warmup', '50'], 'the warm-up (50 steps) lasts the whole run (4 steps)'),
    (['--stop-at-score', '10', '--eval-every', '100000'], 'no evaluation would ever score it'),
])
def test_flags_that_would_fail_or_do_nothing_later_are_refused_before_any_work(tmp_path, capsys, flags, expected):
    # Each passed validation before and then crashed at the first step (a NaN mean: an invalid multinomial),
    # or ran without the effect it names (a decay that never begins, a stop that is never scored).
    assert run(tmp_path, '--steps', '4', *flags) == 2
    assert expected in one_error_line(capsys) and not (tmp_path / 'run').exists()


def test_a_resume_turns_the_timestep_law_off(tmp_path, capsys):
    # The replayed --t-mean, --t-scale and --t-reweight belong to the law saved with them: another law given
    # at the resume drops them (with the warnings of a changed lever) instead of refusing the resume.
    assert run(tmp_path, '--steps', '2', '--sample-every', '0', '--t-sampling', 'laplace', '--t-mean', '0.5',
               '--t-scale', '0.8', '--t-reweight') == 0
    path = str(tmp_path / 'run' / 'ckpt.pt')
    capsys.readouterr()
    assert train.cli(['--resume', path, '--steps', '3', '--t-sampling', 'uniform']) == 0
    assert "warning: --t-sampling uniform (the checkpoint's: laplace)" in capsys.readouterr().err
    config = torch.load(path, weights_only=True)['config']
    assert (config['t_sampling'], config['t_mean'], config['t_scale'], config['t_reweight']) == ('uniform', None, None,
                                                                                              False)


# ----------------------------------------------------------------------------- files given by flags

@pytest.mark.parametrize('key, value', [('layers_per_block', '1'), ('norm_num_groups', 0),
                                        ('block_out_channels', [0, 0, 0]), ('sample_size', -16),
                                        ('dropout', 'high'), ('attention_head_dim', 2.5)])
def test_odd_values_in_a_diffusers_config_are_one_line(tmp_path, exported, capsys, key, value):
    import shutil
    folder = tmp_path / 'pipe'
    shutil.copytree(exported, folder)
    config_path = folder / 'unet' / 'config.json'
    config = json.loads(config_path.read_text())
    config[key] = value
    config_path.write_text(json.dumps(config))
    assert run(tmp_path, '--steps', '1', '--init-from', str(folder)) == 2
    assert key in one_error_line(capsys)
    assert sample.cli(['--ckpt', str(folder), '--num', '1', '--device', 'cpu', '--out', str(tmp_path / 's')]) == 2
    assert key in one_error_line(capsys)


def test_unreadable_inception_weights_stop_the_training_run_before_it_starts(tmp_path, capsys):
    junk = tmp_path / 'inception.pth'
    junk.write_bytes(b'not weights')
    assert run(tmp_path, '--steps', '4', '--eval-every', '16', '--inception-weights', str(junk)) == 2
    line = one_error_line(capsys)
    assert str(junk) in line and 'cannot load it' in line
    assert not (tmp_path / 'run' / 'ckpt.pt').exists()


def test_sample_py_never_overwrites_files_it_did_not_write(tmp_path, tiny_ckpt, capsys):
    from PIL import Image
    out = tmp_path / 'mine'
    out.mkdir()
    Image.new('RGB', (64, 64), 'red').save(out / '000000.png')
    before = (out / '000000.png').read_bytes()
    assert sample.cli(['--ckpt', tiny_ckpt, '--num', '2', '--steps', '2', '--device', 'cpu', '--out', str(out)]) == 2
    assert 'did not write' in one_error_line(capsys)
    assert (out / '000000.png').read_bytes() == before and sorted(os.listdir(out)) == ['000000.png']


def test_bits_per_dim_offline_names_its_own_flag(tmp_path, tiny_ckpt, capsys, monkeypatch):
    import torchvision

    def no_network(*args, **kwargs):
        raise OSError('network unreachable')
    monkeypatch.setattr(torchvision.datasets.cifar, 'download_and_extract_archive', no_network)
    assert sample.cli(['--ckpt', tiny_ckpt, '--bpd', '--device', 'cpu', '--data-dir', str(tmp_path / 'none')]) == 2
    line = one_error_line(capsys)
    assert '--bpd-data shapes' in line and '--dataset' not in line


# ----------------------------------------------------------------------------- failed and racing writes

def test_a_failed_export_leaves_nothing_and_names_the_path(tmp_path, tiny_ckpt, capsys, monkeypatch):
    import safetensors.torch

    def disk_full(tensors, filename, *args, **kwargs):
        with open(filename, 'wb') as f:
            f.write(b'part of the weights')
        raise Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull })')
    monkeypatch.setattr(safetensors.torch, 'save_file', disk_full)
    target = tmp_path / 'pipe'
    assert sample.cli(['--ckpt', tiny_ckpt, '--export-diffusers', str(target), '--device', 'cpu']) == 1
    line = one_error_line(capsys)
    assert str(target) in line and 'GB free' in line and 'StorageFull' in line
    assert os.listdir(tmp_path) == []


def test_of_two_racing_exports_the_loser_leaves_nothing(tmp_path, tiny_ckpt, capsys, monkeypatch):
    import safetensors.torch
    save_file, target = safetensors.torch.save_file, tmp_path / 'pipe'

    def the_other_export_finishes_first(tensors, filename, *args, **kwargs):
        save_file(tensors, filename, *args, **kwargs)
        target.mkdir()
        (target / 'model_index.json').write_text('{"the": "winner"}')
    monkeypatch.setattr(safetensors.torch, 'save_file', the_other_export_finishes_first)
    assert sample.cli(['--ckpt', tiny_ckpt, '--export-diffusers', str(target), '--device', 'cpu']) == 2
    assert 'another export' in one_error_line(capsys)
    assert os.listdir(tmp_path) == ['pipe'] and os.listdir(target) == ['model_index.json']


def test_a_checkpoint_flush_that_fails_names_the_path_and_the_free_space(tmp_path, capsys, monkeypatch):
    def no_space(descriptor):
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(os, 'fsync', no_space)
    assert run(tmp_path, '--steps', '2', '--sample-every', '0') == 1
    line = one_error_line(capsys)
    assert 'ckpt.pt' in line and 'GB free' in line
    assert not (tmp_path / 'run' / 'ckpt.pt').exists() and not (tmp_path / 'run' / 'ckpt.pt.tmp').exists()


def test_a_tensorboard_folder_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'tb').write_text('a file')
    assert run(tmp_path, '--steps', '2', '--tensorboard') == 2
    assert '--tensorboard' in one_error_line(capsys)
    assert sorted(os.listdir(tmp_path / 'run')) == ['tb']  # no metrics, no lock left


# ----------------------------------------------------------------------------- the evaluation's guards

@pytest.mark.parametrize('flag', ['--eval-bpd-images', '--heldout-size', '--eval-samples'])
def test_evaluation_counts_of_zero_are_one_line(tmp_path, capsys, flag):
    assert run(tmp_path, '--steps', '2', '--eval-every', '16', flag, '0') == 2
    assert flag in one_error_line(capsys)


def test_a_batch_cut_mid_way_is_drawn_again_to_the_bytes_of_one_run(tmp_path, tiny_ckpt):
    common = ['--ckpt', tiny_ckpt, '--num', '6', '--batch-size', '3', '--steps', '2', '--device', 'cpu']
    assert sample.cli(common + ['--out', str(tmp_path / 'whole')]) == 0
    assert sample.cli(common + ['--out', str(tmp_path / 'cut')]) == 0
    for name in ('000004.png', '000005.png'):  # batch 1 cut after its first image
        os.remove(tmp_path / 'cut' / name)
    assert sample.cli(common + ['--out', str(tmp_path / 'cut')]) == 0
    for i in range(6):
        assert (tmp_path / 'cut' / f'{i:06d}.png').read_bytes() == (tmp_path / 'whole' / f'{i:06d}.png').read_bytes()


def test_finite_weights_with_an_infinite_heldout_loss_are_never_saved(tmp_path, capsys, monkeypatch):
    losses = evaluation.heldout_losses

    def infinite_after_step_two(model, *args, **kwargs):
        result = losses(model, *args, **kwargs)
        return result + float('inf') if infinite_after_step_two.calls >= 2 else result
    infinite_after_step_two.calls = 0
    real_step = train.train_step

    def counting_step(*args, **kwargs):
        infinite_after_step_two.calls += 1
        return real_step(*args, **kwargs)
    monkeypatch.setattr(evaluation, 'heldout_losses', infinite_after_step_two)
    monkeypatch.setattr(train, 'train_step', counting_step)
    assert run(tmp_path, '--steps', '4', '--log-every', '2', '--ckpt-every', '2', '--sample-every', '0') == 3
    assert 'held-out loss of inf' in one_error_line(capsys)
    assert not (tmp_path / 'run' / 'ckpt.pt').exists()


def test_heldout_losses_of_a_resumed_run_are_those_of_the_uninterrupted_run(tmp_path):
    common = ['--log-every', '2', '--sample-every', '0', '--ckpt-every', '0', '--dropout', '0.1']
    assert run(tmp_path / 'whole', *common, '--steps', '8') == 0
    assert run(tmp_path / 'split', *common, '--steps', '4') == 0
    assert train.cli(['--resume', str(tmp_path / 'split' / 'run' / 'ckpt.pt'), '--steps', '8']) == 0

    def heldout(folder):
        rows = [json.loads(line) for line in open(folder / 'run' / 'metrics.jsonl')]
        return {r['step']: (r['heldout_loss'], r['heldout_loss_ema']) for r in rows if r.get('kind') == 'train'}
    whole, split = heldout(tmp_path / 'whole'), heldout(tmp_path / 'split')
    assert set(whole) == set(split) == {2, 4, 6, 8}
    assert whole == split


# ----------------------------------------------------------------------------- sample.py's flags, found by a tester

def test_a_rerun_with_another_clip_is_refused_not_mixed(tmp_path, tiny_ckpt, capsys):
    common = ['--ckpt', tiny_ckpt, '--num', '2', '--steps', '2', '--sampler', 'ddim', '--device', 'cpu', '--out',
              str(tmp_path / 's')]
    assert sample.cli(common + ['--clip', 'x0']) == 0
    assert sample.cli(common + ['--clip', 'none']) == 2
    assert 'clip' in one_error_line(capsys)


def test_a_grid_never_overwrites_files_it_did_not_write(tmp_path, tiny_ckpt, capsys):
    from PIL import Image
    common = ['--ckpt', tiny_ckpt, '--num', '4', '--steps', '2', '--device', 'cpu', '--grid']
    mine = tmp_path / 'mine'
    mine.mkdir()
    Image.new('RGB', (8, 8), 'red').save(mine / 'grid.png')
    before = (mine / 'grid.png').read_bytes()
    assert sample.cli(common + ['--out', str(mine)]) == 2
    assert 'did not write' in one_error_line(capsys) and (mine / 'grid.png').read_bytes() == before
    ours = tmp_path / 'ours'
    assert sample.cli(common + ['--out', str(ours)]) == 0 and sample.cli(common + ['--out', str(ours)]) == 0
    assert sorted(os.listdir(ours)) == ['grid.png', 'samples.json']  # its own folder: drawn again, the same
    assert sample.cli(common[:-1] + ['--out', str(ours)]) == 2  # separate images into a grid's folder: refused
    assert 'other settings' in one_error_line(capsys)


@pytest.mark.parametrize('flags, expected', [
    (['--sampler', 'dpm++', '--clip', 'x0'], 'does not clip'),
    (['--grid', '--format', 'npz'], '--grid writes one PNG'),
    (['--fid', '--num', '1'], 'too few'),
])
def test_sample_flags_that_cannot_work_together_are_one_line_before_any_work(tmp_path, tiny_ckpt, capsys, flags,
                                                                             expected):
    assert sample.cli(['--ckpt', tiny_ckpt, '--steps', '2', '--device', 'cpu', '--out', str(tmp_path / 's'),
                       *flags]) == 2
    assert expected in one_error_line(capsys) and not (tmp_path / 's').exists()


def test_a_grid_of_digits_is_a_grey_png(tmp_path, capsys):
    from PIL import Image
    assert run(tmp_path, '--dataset', 'digits', '--steps', '1', '--num-samples', '4') == 0
    grids = list((tmp_path / 'samples').iterdir())
    with Image.open(grids[0]) as grid:
        assert grid.mode == 'L'

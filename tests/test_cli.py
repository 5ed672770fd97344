"""cli.py: the flags of every script (frozen), declared ranges, errors to exit codes, atomic writes."""
import dataclasses
import os
import re

import pytest
import torch

import benchmark
import cli
import data
import files
import sample
import train

# Every script's flags, frozen: a refactor that drops or renames one turns this red.
FLAGS = {
    'train': ['--recipe', '--preset', '--base-channels', '--channel-mults', '--blocks-per-level', '--attn-resolutions',
              '--dataset', '--data-dir', '--image-size', '--shapes-count', '--batch-size', '--epochs',
              '--steps', '--lr', '--warmup', '--grad-clip', '--ema-decay', '--dropout', '--schedule', '--prediction',
              '--loss-weight', '--snr-gamma', '--t-sampling', '--t-mean', '--t-scale', '--t-reweight',
              '--no-t-reweight', '--input-perturbation', '--lr-decay', '--adam-beta2', '--ema-length', '--class-cond',
              '--no-class-cond', '--label-drop', '--guidance', '--immiscible', '--no-immiscible', '--attention',
              '--compile', '--no-compile', '--compile-mode', '--amp', '--channels-last', '--no-channels-last',
              '--fused-adam', '--no-fused-adam', '--fused-norm', '--no-fused-norm', '--loader', '--num-workers',
              '--log-every', '--heldout-size',
              '--sample-every', '--sampler', '--sample-steps', '--num-samples', '--eval-every', '--eval-fid',
              '--no-eval-fid', '--eval-samples', '--eval-draws', '--eval-noise', '--stop-at-score', '--eval-bpd-images',
              '--eval-bpd-timesteps', '--inception-weights',
              '--ckpt-every', '--out-dir', '--samples-dir', '--resume', '--init-from', '--tensorboard',
              '--no-tensorboard', '--seed', '--device'],
    'sample': ['--ckpt', '--num', '--sampler', '--steps', '--spacing', '--eta', '--variance', '--clip', '--label',
               '--guidance', '--mid-timestep',
               '--batch-size',
               '--out',
               '--format', '--grid', '--no-grid', '--weights', '--seed', '--device', '--amp', '--compile',
               '--no-compile', '--fid', '--no-fid', '--fid-data', '--data-dir', '--fid-stats', '--inception-weights',
               '--bpd', '--no-bpd', '--bpd-data', '--bpd-num', '--export-diffusers', '--bpd-timesteps'],
    'benchmark': ['--preset', '--image-size', '--dataset', '--data-dir', '--num-images', '--device', '--batch-size',
                  '--big-batch', '--amp-dtype', '--num-workers', '--warmup', '--iters', '--rows', '--from-row',
                  '--tf32', '--no-tf32', '--stem', '--peer', '--no-peer', '--peak-tflops', '--peak-tflops-fp32',
                  '--quick', '--no-quick', '--compile-backend', '--profile', '--no-profile', '--sweep',
                  '--sweep-values', '--side-by-side', '--no-side-by-side', '--loader-only', '--no-loader-only',
                  '--sampling', '--no-sampling',
                  '--sampling-only', '--no-sampling-only', '--sample-batch', '--sample-compile-mode',
                  '--quality', '--no-quality', '--steps',
                  '--roofline', '--no-roofline', '--gpu', '--precision', '--bandwidth-gbs', '--out-dir', '--seed'],
    'data': ['--write-beton', '--dataset', '--data-dir', '--image-size', '--shapes-count', '--jpeg', '--no-jpeg',
             '--jpeg-quality', '--num-workers'],
}
SCRIPTS = {'train': train.cli, 'sample': sample.cli, 'benchmark': benchmark.cli, 'data': data.main}


@pytest.mark.parametrize('script', sorted(SCRIPTS))
def test_help_lists_the_same_flags_as_before(script, capsys):
    with pytest.raises(SystemExit) as exit:
        SCRIPTS[script](['--help'])
    assert exit.value.code == 0
    listed = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith('  -'):  # an option's line: its invocation, then maybe its help after two spaces
            listed += [f for f in re.findall(r'--[a-z0-9-]+', re.split(r'\s{2,}', line.strip())[0]) if f != '--help']
    assert listed == FLAGS[script]


@dataclasses.dataclass
class Ranges:
    count: int = cli.flag(1, 'a count', at_least=1)
    every: int = cli.flag(0, '0: never', at_least=0)
    rate: float | None = cli.flag(None, 'a rate', positive=True)
    decay: float = cli.flag(0.5, 'a decay', at_least=0, below=1)
    steps: int = cli.flag(5, 'steps', at_least=1, at_most=10)
    mean: float | None = cli.flag(None, 'a mean, any finite number')


@pytest.mark.parametrize('field, value, message', [
    ('count', 0, '--count must be at least 1, got 0'),
    ('every', -1, '--every must be 0 or more, got -1'),
    ('rate', 0.0, '--rate must be a positive number, got 0.0'),
    ('rate', float('inf'), '--rate must be a finite number, got inf'),
    ('decay', 1.0, '--decay must be in [0, 1), got 1.0'),
    ('decay', float('nan'), '--decay must be a finite number, got nan'),
    ('steps', 11, '--steps must be in [1, 10], got 11'),
    ('mean', float('nan'), '--mean must be a finite number, got nan'),  # a float without a declared range too
    ('mean', float('-inf'), '--mean must be a finite number, got -inf'),
])
def test_declared_ranges_refuse_what_is_outside(field, value, message):
    with pytest.raises(cli.ConfigError) as error:
        cli.check_ranges(dataclasses.replace(Ranges(), **{field: value}))
    assert str(error.value) == message


def test_declared_ranges_accept_their_edges_and_unresolved_defaults():
    cli.check_ranges(Ranges(count=1, every=0, rate=None, decay=0.0, steps=10))
    cli.check_ranges(Ranges(rate=1e-300, decay=0.999999, steps=1, mean=-1e300))
    assert '(in [0, 1))' in cli.build_parser(Ranges, '').format_help()  # the range is in --help


class Broken(Exception):
    exit_code = 7


@pytest.mark.parametrize('error, code, line', [
    (cli.ConfigError('--x: bad'), 2, 'error: --x: bad'),
    (data.DataError('Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n'
                    '  File "x.py", line 1\ndata.DataError: cannot read image a.png'), 2,
     'error: cannot read image a.png'),
    (cli.NonFiniteLoss('the loss became nan'), 3, 'error: the loss became nan'),
    (Broken('custom'), 7, 'error: custom'),
    (OSError(28, 'No space left on device'), 1, 'error: OSError: [Errno 28] No space left on device'),
    (KeyboardInterrupt(), 130, 'aborted by Ctrl-C (files are written whole or not at all)'),
    (MemoryError('Unable to allocate 6.98 TiB'), 1, 'error: out of memory (MemoryError: Unable to allocate 6.98 TiB): '
                                                   'ask for less'),
    # torch's allocators raise RuntimeError, not MemoryError (the CPU's, as --base-channels 100000 met it; CUDA's)
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 160000000000 bytes."), 1,
     "error: out of memory (RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
     "allocate memory: you tried to allocate 160000000000 bytes.): ask for less (a smaller model, batch or --num)"),
    (torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB'), 1,
     'error: out of memory (OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB): ask for less (a '
     'smaller model, batch or --num)'),
])
def test_errors_become_one_line_and_their_exit_code(capsys, error, code, line):
    def main():
        raise error
    assert cli.run_main(main) == code
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_bug_keeps_its_traceback():
    def main():
        raise ZeroDivisionError('a bug')
    with pytest.raises(ZeroDivisionError):
        cli.run_main(main)
    with pytest.raises(RuntimeError):  # a RuntimeError that is not memory running out is a bug too
        cli.run_main(lambda: torch.zeros(2, 3) @ torch.zeros(2, 3))
    assert cli.run_main(lambda: None) == 0


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path):
    path = str(tmp_path / 'out' / 'report.json')  # the folder is created
    with files.atomic_open(path) as f:
        f.write('first')
    with pytest.raises(OSError):
        with files.atomic_open(path) as f:
            f.write('half of the seco')
            raise OSError(28, 'No space left on device')
    assert open(path).read() == 'first' and os.listdir(tmp_path / 'out') == ['report.json']  # no .tmp left
    with files.atomic_open(path, 'wb') as f:
        f.write(b'second')
    assert open(path).read() == 'second' and os.listdir(tmp_path / 'out') == ['report.json']


def test_unwritable_folder_is_a_config_error(tmp_path):
    (tmp_path / 'a-file').write_text('')
    with pytest.raises(cli.ConfigError, match='--out a-file/sub: cannot write there|cannot write there'):
        files.check_writable(str(tmp_path / 'a-file' / 'sub'), '--out')
    files.check_writable(str(tmp_path / 'new' / 'sub'), '--out')
    assert os.listdir(tmp_path / 'new' / 'sub') == []  # the probe file is gone


def test_write_beton_to_a_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(data, 'load_dataset', lambda *args: pytest.fail('the data set was loaded first'))
    assert data.main(['--write-beton', str(tmp_path), '--dataset', 'shapes']) == 2
    assert 'a folder; pass the path of the .beton file' in capsys.readouterr().err


# ----------------------------------------------------------------------------- provenance

def _git(folder, *args):
    import subprocess
    subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@t', *args], cwd=folder, check=True,
                   capture_output=True)


def test_the_commit_is_recorded_only_where_it_holds_this_code(tmp_path):
    import shutil

    import reports
    (tmp_path / 'theirs.txt').write_text('another project')
    _git(tmp_path, 'init', '-q')
    _git(tmp_path, 'add', 'theirs.txt')
    _git(tmp_path, 'commit', '-qm', 'theirs')
    for name in ('reports.py', 'files.py', 'cli.py'):  # our code copied in, untracked
        shutil.copy(os.path.join(os.path.dirname(reports.__file__), name), tmp_path)
    assert reports.git_commit(str(tmp_path)) == 'unknown'
    _git(tmp_path, 'add', 'reports.py', 'files.py')
    _git(tmp_path, 'commit', '-qm', 'ours, but one module')
    assert reports.git_commit(str(tmp_path)).endswith('-dirty')  # cli.py is not in the commit
    _git(tmp_path, 'add', 'cli.py')
    _git(tmp_path, 'commit', '-qm', 'all of ours')
    clean = reports.git_commit(str(tmp_path))
    assert len(clean) == 40 and int(clean, 16) >= 0
    (tmp_path / 'cli.py').write_text('# changed\n')
    assert reports.git_commit(str(tmp_path)) == clean + '-dirty'


def test_the_recorded_command_replays_as_it_ran(monkeypatch):
    import shlex

    import reports
    for variable in ('TORCHELASTIC_RUN_ID', 'LOCAL_WORLD_SIZE', 'WORLD_SIZE'):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr('sys.argv', ['train.py', '--out-dir', 'run 1', '--data-dir', "it's"])
    command = reports.command_line()
    assert shlex.split(command) == ['python', 'train.py', '--out-dir', 'run 1', '--data-dir', "it's"]
    monkeypatch.setenv('TORCHELASTIC_RUN_ID', 'x')
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '4')
    monkeypatch.setenv('WORLD_SIZE', '8')
    assert shlex.split(reports.command_line())[:6] == ['torchrun', '--nnodes', '2', '--nproc_per_node', '4',
                                                      'train.py']

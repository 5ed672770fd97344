"""What every script's command line shares, written once.

- A config dataclass becomes flags: `flag(default, help, ...)` fields, each with its help text,
  choices and range; `parse_config` builds them, `check_ranges` checks the ranges.
- Errors become one line and an exit code: `run_main` wraps every script's main (exit 2 for
  bad input, 1 for a failed write such as a full disk, 130 for Ctrl-C, an error's own
  `exit_code` otherwise).
- Files are written whole or not at all: `atomic_open` / `atomic_path`; one run per output
  folder: `claim_folder`; a JSON-lines log, mirrored to TensorBoard on request: `JsonLines`.
- A stop that lets the work finish its step: `StopFlag` (SIGTERM, Ctrl-C).
- The device: `pick_device`, `synchronize`, `autocast`, and the GPUs' peaks that MFU is measured
  against (`peak_tflops`); reports with their provenance (`write_report`, `markdown_table`) and
  plots without a display (`pyplot`, `save_figure`), for benchmark.py and scripts/ alike.
- Ranks under torchrun: `setup_distributed`, `init_process_group` and the small collectives the
  scripts agree through (`any_rank`, `on_all_ranks`, `gather_to_rank0`, `ranks_identical`).

It sits at the bottom of the import graph: it imports none of the project's modules.
"""
import argparse
import contextlib
import datetime
import errno
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import typing
from dataclasses import field, fields

import torch
import torch.distributed as dist


class ConfigError(Exception):
    """A bad flag or file: one line on stderr, exit code 2."""
    exit_code = 2


# ----------------------------------------------------------------------------- flags

def flag(default, help, *, choices=None, at_least=None, at_most=None, below=None, positive=False):
    """A config field with its --help text, its choices and its range: `at_least` <= value,
    value <= `at_most` or value < `below`, or (positive) 0 < value. Floats must also be finite."""
    bounds = {'at_least': at_least, 'at_most': at_most, 'below': below, 'positive': positive or None}
    return field(default=default, metadata={'help': help, 'choices': choices,
                                            'bounds': {k: v for k, v in bounds.items() if v is not None}})


def range_text(bounds: dict) -> str:
    """'at least 1', '0 or more', 'in [0, 1)', 'a positive number'."""
    if bounds.get('positive'):
        return 'a positive number'
    low, high = bounds.get('at_least'), bounds.get('at_most', bounds.get('below'))
    if high is None:
        return f'at least {low}' if low else f'{low} or more'
    return f"in [{low}, {high}{']' if 'at_most' in bounds else ')'}"


def in_range(value, bounds: dict) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return ((not bounds.get('positive') or value > 0)
            and ('at_least' not in bounds or value >= bounds['at_least'])
            and ('at_most' not in bounds or value <= bounds['at_most'])
            and ('below' not in bounds or value < bounds['below']))


def check_ranges(config):
    """Every field's declared range, checked; a field left at None (a default still to be
    resolved) is skipped. The first failure is a ConfigError naming the flag."""
    for f in fields(config):
        value, bounds = getattr(config, f.name), f.metadata.get('bounds')
        if bounds and value is not None and not in_range(value, bounds):
            raise ConfigError(f'{flag_name(f.name)} must be {range_text(bounds)}, got {value}')


def check_plain_name(value: str, flag: str):
    """A file name without folders: where it goes is another flag's (--out-dir)."""
    if os.path.basename(value) != value or value in ('', '.', '..') or len(value) > 200:
        raise ConfigError(f'{flag} {value!r}: a plain file name (no folders, at most 200 characters); --out-dir '
                          f'sets where it goes')


@contextlib.contextmanager
def refused_as(what: str):
    """A ValueError inside (a library's refusal of a value) as a ConfigError line starting with
    `what`, such as '--image-size 18'."""
    try:
        yield
    except ValueError as error:
        raise ConfigError(f'{what}: {error}') from None


def flag_name(field_name: str) -> str:
    return '--' + field_name.replace('_', '-')


def build_parser(config_class, description: str) -> argparse.ArgumentParser:
    """One flag per dataclass field, with its help text, choices and default. A bad flag is
    one 'error:' line and exit code 2, as every other bad input."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(config_class):
        kind = next((a for a in typing.get_args(f.type) if a is not type(None)), f.type)
        text = f.metadata['help']
        if f.metadata.get('bounds'):
            text += f" ({range_text(f.metadata['bounds'])})"
        if f.default not in (None, '') and 'default' not in text:
            text += f' (default: {f.default})'
        kwargs = dict(default=f.default, help=text)
        if kind is bool:
            kwargs['action'] = argparse.BooleanOptionalAction
        else:
            kwargs['type'] = kind
        if f.metadata.get('choices'):
            kwargs['choices'] = f.metadata['choices']
        parser.add_argument(flag_name(f.name), **kwargs)

    def usage_error(message):
        print(f'error: {message}', file=sys.stderr)
        sys.exit(2)
    parser.error = usage_error
    return parser


def parse_config(argv, config_class, description: str = None):
    """A config dataclass from command-line arguments (sys.argv when argv is None)."""
    return config_class(**vars(build_parser(config_class, description).parse_args(argv)))


def changed_fields(config) -> set:
    """The fields whose value differs from their default (what a command line would have given)."""
    return {f.name for f in fields(config) if getattr(config, f.name) != f.default}


def given_fields(argv, config_class) -> set:
    """The fields whose flags the command line gives (whatever their value), as opposed to
    those left at their defaults."""
    parser = build_parser(config_class, None)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------- errors and exit codes

def run_main(main, *args) -> int:
    """main(*args) as a script runs it: 0 when it returns; our errors (ConfigError, data.DataError,
    anything with an `exit_code`) as one 'error:' line and their code; a failed write (OSError:
    a full disk, an unwritable file) or memory running out as one line and 1; a Ctrl-C that got
    through as 130."""
    try:
        main(*args)
    except KeyboardInterrupt:
        print('aborted by Ctrl-C (files are written whole or not at all)', file=sys.stderr)
        return 130
    except OSError as error:
        print(f'error: {brief(error, 300)}', file=sys.stderr)
        return 1
    except MemoryError as error:  # a count far beyond the machine (--num, --shapes-count, ...)
        print(f'error: out of memory ({brief(error, 200)}): ask for less', file=sys.stderr)
        return 1
    except Exception as error:
        code = getattr(error, 'exit_code', None)
        if code is None:
            raise  # a bug: the traceback is the useful report
        print(f'error: {last_line(error)}', file=sys.stderr)
        return code
    return 0


def last_line(error: Exception) -> str:
    """Our error's message as one line, also when a DataLoader worker wrapped it in a traceback
    (whose last line is 'DataError: <message>')."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else type(error).__name__
    return text.split(f'{type(error).__name__}: ', 1)[-1]


def brief(error: Exception, limit: int = 160) -> str:
    """A library's error, for quoting inside ours: its type and first line, cut to `limit`."""
    lines = str(error).strip().splitlines()
    text = f'{type(error).__name__}: {lines[0] if lines else ""}'.rstrip(': ')
    return text if len(text) <= limit else text[:limit - 3] + '...'


# ----------------------------------------------------------------------------- stopping

class StopRequested(Exception):
    """Raised by a signal inside an interruptible section (an evaluation, a grid)."""


class StopFlag:
    """Set by SIGTERM or Ctrl-C: the work finishes its step, saves and exits. A signal that
    comes during an interruptible section (an evaluation, a grid) cuts it short, since a
    preempted job has seconds, not minutes. A second Ctrl-C aborts at once."""

    def __init__(self):
        self.reason, self.in_interruptible = None, 0

    def __call__(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        if self.in_interruptible:
            raise StopRequested(self.reason)

    def install(self):
        """Handles SIGTERM and SIGINT; returns the function that puts the old handlers back."""
        previous = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(s, h) for s, h in previous.items()]

    def agreed(self, group, ask: bool):
        """The stop the ranks agree on: this process's signal in one process; under DDP (a
        control `group`) a signal to any rank, asked only when `ask` is true on every rank at
        once, since each must take part."""
        if group is None:
            return self.reason
        if ask and any_rank(self.reason is not None, group):
            return self.reason or 'a signal on another rank'
        return None

    @contextlib.contextmanager
    def interruptible(self):
        """Work inside may be abandoned by a signal (StopRequested); none of it starts once a
        stop is requested."""
        if self.reason is not None:
            raise StopRequested(self.reason)
        self.in_interruptible += 1
        try:
            yield
        finally:
            self.in_interruptible -= 1


# ----------------------------------------------------------------------------- files

@contextlib.contextmanager
def atomic_path(path: str, durable: bool = True, unique: bool = False):
    """Yields PATH.tmp to write, a file or a folder; once written it is renamed over `path`, so a
    crash leaves the previous file whole. `durable`: flushed to disk first (so a power loss cannot
    leave an empty file either), as checkpoints must be. `unique`: PATH.tmp-PID, so that concurrent
    writers never share one (of two folders, the one renamed second is discarded: the first is
    whole). If writing fails (a full disk), the temporary is removed."""
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    tmp = f'{path}.tmp-{os.getpid()}' if unique else path + '.tmp'
    try:
        yield tmp
        if durable:
            with open(tmp, 'rb+') as f:
                os.fsync(f.fileno())
        try:
            os.replace(tmp, path)
        except OSError:
            if not (unique and os.path.isdir(tmp) and os.path.isdir(path)):
                raise
            _remove(tmp)  # another writer's folder is in place
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str):
    with contextlib.suppress(OSError):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def remove_dead_writers(path: str):
    """Removes PATH.tmp-PID left by writers (atomic_path(unique=True)) killed on this host."""
    for leftover in glob.glob(glob.escape(path) + '.tmp-*'):
        pid = leftover.rsplit('-', 1)[-1]
        if pid.isdigit() and _dead_here({'host': socket.gethostname(), 'pid': int(pid)}):
            _remove(leftover)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = 'w', durable: bool = True, unique: bool = False):
    """open(path, mode) for writing, through atomic_path: the file appears whole or not at all."""
    with atomic_path(path, durable, unique) as tmp, open(tmp, mode) as f:
        yield f


def write_once(path: str, what: str, write) -> str:
    """PATH, written once by write(tmp) into PATH.tmp-PID and renamed into place: it is whole or
    absent. Concurrent writers each write their own and share the one renamed first (the others'
    copies are discarded); a killed writer's copy is removed by the next one."""
    if not os.path.exists(path):
        print(f'writing {path} for {what} ...', flush=True)
        remove_dead_writers(path)
        with atomic_path(path, durable=False, unique=True) as tmp:
            write(tmp)
    return path


def claim_folder(folder: str, flag: str, leftovers: tuple = (), set_aside: tuple = ()):
    """One run per output folder. Creates FOLDER/lock (pid, host, start time) or refuses with a
    ConfigError naming the run that holds it; the lock of a dead process on this host is taken
    over. Then removes the temporary files (glob patterns `leftovers`, such as 'ckpt.pt.tmp')
    that a killed run left, since no live run writes them now, keeps the files `set_aside` (an
    earlier run's log, say) as NAME.1, NAME.2, ..., and checks that the folder is writable.
    Returns the function that releases the lock."""
    lock = os.path.join(folder, 'lock')
    me = {'pid': os.getpid(), 'host': socket.gethostname(),
          'started': datetime.datetime.now().isoformat(timespec='seconds')}
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise ConfigError(f'{flag} {folder}: cannot write there ({error.strerror or error})') from None
    try:
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        holder = _lock_holder(lock)
        if not _dead_here(holder):
            raise ConfigError(f"{flag} {folder} is in use by another run (pid {holder.get('pid', '?')} on "
                              f"{holder.get('host', '?')}, since {holder.get('started', '?')}); wait for it, stop "
                              f"it or pass another {flag} (if no run uses it, delete {lock})") from None
        print(f"{lock}: taking over the lock of pid {holder['pid']}, which is no longer running", flush=True)
        os.remove(lock)
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError as error:
        raise ConfigError(f'{flag} {folder}: cannot write there ({error.strerror or error})') from None
    with os.fdopen(descriptor, 'w') as f, contextlib.suppress(OSError):  # a full disk: an empty lock still locks
        f.write(json.dumps(me))

    def release():
        if _lock_holder(lock).get('pid') in (me['pid'], None):
            with contextlib.suppress(OSError):
                os.remove(lock)
    try:
        for pattern in leftovers:
            for tmp in glob.glob(os.path.join(glob.escape(folder), pattern)):
                os.remove(tmp)
                print(f'removed {tmp}, left by a write that did not finish (the file it was to replace is whole)',
                      flush=True)
        for name in set_aside:
            old = os.path.join(folder, name)
            if os.path.exists(old):
                number = next(n for n in range(1, 10 ** 6) if not os.path.exists(f'{old}.{n}'))
                os.replace(old, f'{old}.{number}')
                print(f'{old} of an earlier run kept as {old}.{number}', flush=True)
        check_writable(folder, flag)
    except BaseException:
        release()
        raise
    return release


def _lock_holder(path: str) -> dict:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}  # unreadable, or empty: written by a run on a full disk


def _dead_here(holder: dict) -> bool:
    """Whether the lock's process is known to be gone: it ran on this host and no longer runs (or
    its pid is this process's, which holds no lock yet)."""
    if holder.get('host') != socket.gethostname() or not isinstance(holder.get('pid'), int):
        return False
    if holder['pid'] == os.getpid():  # a lock left by a killed process whose pid this one got again
        return True
    try:
        os.kill(holder['pid'], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def disk_full_error(path: str, error: Exception) -> OSError:
    """The OSError to raise for a write that failed, saying how much room is left."""
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:
        free = None
    room = f'{free / 1e9:.2f} GB free there' if free is not None else 'free space unknown'
    code = errno.ENOSPC if free is not None and free < 1e8 else errno.EIO
    return OSError(code, f'writing {path} failed ({brief(error, 200)}); {room}')


def _finite(value):
    """NaN and infinities as null: JSON has no literal for them (Python's NaN would not parse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _step_of(line: str) -> float:
    """A log line's step (0 for rows without one); a line that does not parse is a torn write."""
    try:
        return json.loads(line).get('step', 0)
    except (json.JSONDecodeError, AttributeError):
        return math.inf


class JsonLines:
    """A log of one JSON object per line, appended to `path`; with `tensorboard_dir`, every number
    of a row that has a 'kind' and 'images_seen' also goes to TensorBoard as KIND/NAME, at the
    row's image count (so that runs of different batch sizes line up), and `image` adds a PNG."""

    def __init__(self, path: str, tensorboard_dir: str = None):
        self.path, self.tensorboard = path, None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(tensorboard_dir)

    def write(self, row: dict):
        with open(self.path, 'a') as f:
            f.write(json.dumps(_finite(row), allow_nan=False) + '\n')
        if self.tensorboard is not None and 'kind' in row and 'images_seen' in row:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != 'images_seen':
                    self.tensorboard.add_scalar(f"{row['kind']}/{key}", value, row['images_seen'])
            self.tensorboard.flush()

    def drop_after(self, step: int):
        """Removes the rows of steps past `step` (those a killed run logged after its last
        checkpoint: the resumed run logs them again), so that the log has each step once, and a
        last line cut short by the kill."""
        if not os.path.isfile(self.path):
            return
        with open(self.path) as f:
            lines = f.readlines()
        kept = [line for line in lines if _step_of(line) <= step]
        if len(kept) < len(lines):
            with atomic_open(self.path) as f:
                f.writelines(kept)

    def image(self, tag: str, png_path: str, images_seen: int):
        if self.tensorboard is not None:
            from torchvision.io import read_image
            self.tensorboard.add_image(tag, read_image(png_path), images_seen)
            self.tensorboard.flush()


def check_creatable(folder: str, flag: str):
    """That the folder exists, or that its nearest existing parent is a folder this process may
    write in, creating nothing: for checking several folders before any is made."""
    parent = os.path.abspath(folder)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f'{flag} {folder}: cannot write there ({parent} is not a writable folder)')


def check_writable(folder: str, flag: str):
    """Creates the folder and writes a file in it, so that a bad path fails now, not after
    hours of work."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f'.write-test-{os.getpid()}')
        with open(probe, 'w') as f:
            f.write('ok')
        os.remove(probe)
    except OSError as error:
        raise ConfigError(f'{flag} {folder}: cannot write there ({error.strerror or error})') from None


# ----------------------------------------------------------------------------- the device

def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' (CUDA when there is one), 'cpu', 'cuda' (this rank's GPU) or 'cuda:N'."""
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ('cpu', 'cuda'):
        raise ConfigError(f'--device {name}: unknown device; use cpu, cuda or cuda:N')
    if device.type == 'cuda':
        if not torch.cuda.is_available():
            raise ConfigError(f'--device {name}: CUDA is not available here; use --device cpu')
        if device.index is None:
            device = torch.device('cuda', local_rank)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f'--device {name}: this machine has {torch.cuda.device_count()} GPU(s)')
    return device


def synchronize(device: torch.device):
    """Waits for the device's queued work (a no-op on the CPU, where work is synchronous)."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def own_rng(device: torch.device):
    """Work inside draws from the global RNGs (CPU, and the device's) without moving them: what
    evaluation builds or draws leaves the training run's random streams where they were."""
    return torch.random.fork_rng(devices=[device] if device.type == 'cuda' else [])


def autocast(amp: str, device: torch.device):
    """Autocast at 'bf16' or 'fp16'; 'off' runs as the weights are (fp32)."""
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# Dense (no sparsity) peak TFLOP/s by precision, from NVIDIA's data sheets. 'tf32' is what
# fp32 convolutions and matmuls reach when TF32 is allowed; 'fp32' is plain CUDA-core FP32.
GPU_PEAK_TFLOPS = {
    'H200': {'fp32': 67.0, 'tf32': 494.5, 'bf16': 989.5, 'fp16': 989.5},
    'H100 SXM': {'fp32': 67.0, 'tf32': 494.5, 'bf16': 989.5, 'fp16': 989.5},
    'H100 NVL': {'fp32': 60.0, 'tf32': 417.5, 'bf16': 835.5, 'fp16': 835.5},
    'H100 PCIe': {'fp32': 51.0, 'tf32': 378.0, 'bf16': 756.0, 'fp16': 756.0},
    'A100': {'fp32': 19.5, 'tf32': 156.0, 'bf16': 312.0, 'fp16': 312.0},
    'L40S': {'fp32': 91.6, 'tf32': 183.0, 'bf16': 362.05, 'fp16': 362.05},
    'A10G': {'fp32': 31.2, 'tf32': 62.5, 'bf16': 125.0, 'fp16': 125.0},
    'RTX 4090': {'fp32': 82.6, 'tf32': 82.6, 'bf16': 165.2, 'fp16': 165.2},
    'RTX 3090': {'fp32': 35.6, 'tf32': 35.6, 'bf16': 71.0, 'fp16': 71.0},
}
A100_PEAK_TFLOPS = GPU_PEAK_TFLOPS['A100']
# The GPUs benchmark.py --roofline knows by name: (data-sheet name, memory bandwidth in GB/s).
GPU_BANDWIDTH = {'h100-sxm': ('H100 SXM', 3350), 'h200': ('H200', 4800), 'a100-40gb': ('A100 40GB', 1555),
                 'a100-80gb': ('A100 80GB', 2039)}


def gpu_peak_key(device_name: str):
    """Maps a CUDA device name ('NVIDIA H100 80GB HBM3') to a GPU_PEAK_TFLOPS key, or None."""
    name = device_name.upper()
    if 'H200' in name:
        return 'H200'
    if 'H100' in name:
        if 'NVL' in name:
            return 'H100 NVL'
        return 'H100 PCIe' if 'PCIE' in name else 'H100 SXM'
    for key in ('A100', 'L40S', 'A10G', 'RTX 4090', 'RTX 3090'):
        if key.replace('RTX ', '') in name:
            return key
    return None


def device_slug(device: torch.device) -> str:
    """'cpu', or the GPU's data-sheet name as a file name ('h100-sxm'): the reports' stems."""
    if device.type != 'cuda':
        return 'cpu'
    name = torch.cuda.get_device_name(device)
    return re.sub(r'[^a-z0-9]+', '-', (gpu_peak_key(name) or name).lower()).strip('-')


def device_name(device: torch.device) -> str:
    """The GPU's name, or 'CPU (N cores, <model name from /proc/cpuinfo>)': what a report ran on."""
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    model = ''
    with contextlib.suppress(OSError), open('/proc/cpuinfo') as f:
        model = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), '')
    return f'CPU ({os.cpu_count()} cores{", " + model if model else ""})'


def precision_of(amp: str, device: torch.device) -> str:
    """The precision a run computes in, as GPU_PEAK_TFLOPS names it: its autocast dtype, else
    fp32, or tf32 where CUDA lets fp32 convolutions use TF32 tensor cores."""
    if amp != 'off':
        return amp
    return 'tf32' if device.type == 'cuda' and torch.backends.cudnn.allow_tf32 else 'fp32'


def peak_tflops(device_name: str, precision: str):
    """Dense peak for a device name and 'fp32' | 'tf32' | 'bf16' | 'fp16'; None if unknown."""
    key = gpu_peak_key(device_name)
    return GPU_PEAK_TFLOPS[key][precision] if key else None


# ----------------------------------------------------------------------------- reports

def git_commit() -> str:
    """The checkout's commit, '-dirty' when tracked files differ from it: what a report was made by."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run = lambda *args: subprocess.run(['git', *args], cwd=here, capture_output=True, text=True)  # noqa: E731
        commit = run('rev-parse', 'HEAD').stdout.strip() or 'unknown'
        return commit + ('-dirty' if run('status', '--porcelain', '--untracked-files=no').stdout.strip() else '')
    except OSError:
        return 'unknown'


def provenance(device: str) -> dict:
    """What every report states beside its numbers: the device, torch, the date, the commit, the command."""
    return {'device': device, 'torch': torch.__version__,
            'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
            'commit': git_commit(), 'command': 'python ' + ' '.join(sys.argv)}


def format_or_na(value, spec: str, missing: str = 'n/a') -> str:
    return missing if value is None else format(value, spec)


def markdown_table(headers: list, rows: list, left: int = 1) -> str:
    """A Markdown table: the first `left` columns aligned left (names), the others right (numbers)."""
    lines = ['| ' + ' | '.join(headers) + ' |', '| ' + ' | '.join(':-' if i < left else '-:'
                                                                   for i in range(len(headers))) + ' |']
    return '\n'.join(lines + ['| ' + ' | '.join(str(cell) for cell in row) + ' |' for row in rows])


def write_report(out_dir: str, stem: str, result: dict, title: str, body: str, notes: str = '') -> str:
    """OUT_DIR/STEM.json (the result, with its provenance) and STEM.md (the title; device, torch,
    date, commit; `notes`; the command; the `body`), each written whole or not at all. Returns the
    path of the .png that goes beside them (each caller draws its own)."""
    path = os.path.join(out_dir, stem)
    markdown = (f"# {title}\n\n{result['device']}, torch {result['torch']}, {result['date']}, commit "
                f"{result['commit']}{notes}\n\nCommand: `{result['command']}`\n\n{body}\n")
    for ext, text in (('.json', json.dumps(result, indent=1)), ('.md', markdown)):
        with atomic_open(path + ext) as f:
            f.write(text)
    return path + '.png'


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str, dpi: int = 100):
    """Lays out a matplotlib figure, writes it as a PNG (whole or not at all) and closes it."""
    fig.tight_layout()
    with atomic_open(path, 'wb') as f:
        fig.savefig(f, format='png', dpi=dpi)
    pyplot().close(fig)


def bar_chart(path: str, names: list, values: list, title: str, xlabel: str, colours=None, texts=None,
              lines: dict = None, log: bool = False):
    """One horizontal bar per name, top to bottom, with optional text after each bar and vertical
    reference lines ({label: x})."""
    fig, ax = pyplot().subplots(figsize=(9, 0.45 * len(names) + 1.5))
    bars = ax.barh(names[::-1], values[::-1], color=(colours or ['tab:blue'] * len(names))[::-1])
    for bar, text in zip(bars, (texts or [])[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va='center', fontsize=8)
    for (label, x), style in zip((lines or {}).items(), ('--', ':')):
        ax.axvline(x, color='tab:red', linestyle=style, label=label)
    if lines:
        ax.legend(fontsize=8)
    ax.set_xscale('log') if log else ax.set_xlim(0, max(values) * 1.35 if values else 1)
    ax.set(xlabel=xlabel)
    ax.set_title(title, fontsize=9)
    save_figure(fig, path, dpi=120)


# ----------------------------------------------------------------------------- ranks (torchrun)

def setup_distributed():
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) without it."""
    world_size = int(os.environ.get('WORLD_SIZE', 1))
    if world_size == 1:
        return 0, 0, 1
    return int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), world_size


def init_process_group(device: torch.device, rank: int, world_size: int):
    """NCCL (GPU) or gloo (CPU) for the gradients; returns a CPU group for control messages (a
    stop, a start-up failure, gathered results), which then need no GPU synchronisation. None
    in one process."""
    if world_size == 1:
        return None
    if device.type == 'cuda':
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo', rank=rank, world_size=world_size)
    return dist.new_group(backend='gloo')


def any_rank(flag: bool, group) -> bool:
    """Whether the flag is set on any rank (every rank must call); the flag itself in one process."""
    if group is None:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def on_all_ranks(make, group):
    """make() on this rank; if it raised one of our errors (an `exit_code`) or an OSError on any
    rank, every rank raises (a lone failure would leave the others waiting in a collective)."""
    error = None
    try:
        result = make()
    except Exception as failure:
        if not (isinstance(failure, OSError) or hasattr(failure, 'exit_code')):
            raise
        error, result = failure, None
    if any_rank(error is not None, group):
        raise error or ConfigError('another rank failed during start-up (its error is above)')
    return result


def gather_to_rank0(values: tuple, rank: int, world_size: int, group) -> list:
    """For each of the values, the list of every rank's on rank 0 (None elsewhere)."""
    if world_size == 1:
        return [[item] for item in values]
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(values, gathered, dst=0, group=group)
    return [list(items) for items in zip(*gathered)] if rank == 0 else [None] * len(values)


@torch.no_grad()
def ranks_identical(model: torch.nn.Module, group) -> bool:
    """Whether every rank's weights equal rank 0's, bit for bit."""
    weights = torch.nn.utils.parameters_to_vector(model.parameters())
    reference = weights.clone()
    dist.broadcast(reference, src=0)
    return not any_rank(not torch.equal(weights, reference), group)

"""Files that survive a crash: written whole or not at all, one run per folder, a JSON-lines log.

`atomic_open` / `atomic_path` rename a finished temporary over the target; `write_once` for a file
that concurrent writers share; `claim_folder` takes an output folder's lock (a dead run's lock is
taken over); `JsonLines` appends rows that a resumed run trims back to its checkpoint;
`check_writable` / `check_creatable` check an output path before any work.
"""
import contextlib
import datetime
import errno
import glob
import json
import math
import os
import shutil
import socket

from cli import ConfigError, brief


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


def folder_in_use(folder: str) -> dict | None:
    """The holder of FOLDER/lock (claim_folder's) while its process may still run, else None."""
    lock = os.path.join(folder, 'lock')
    if not os.path.exists(lock):
        return None
    holder = _lock_holder(lock)
    return None if _dead_here(holder) else holder


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

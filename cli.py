"""What every script's command line shares, written once: flags, their checks, errors, stops.

- A config dataclass becomes flags: `flag(default, help, ...)` fields, each with its help text,
  choices and range; `parse_config` builds them, `check_ranges` checks the ranges.
- Errors become one line and an exit code: `run_main` wraps every script's main (exit 2 for
  bad input, 1 for a failed write such as a full disk, 130 for Ctrl-C, an error's own
  `exit_code` otherwise).
- A stop that lets the work finish its step: `StopFlag` (SIGTERM, Ctrl-C).

It sits at the bottom of the import graph: it imports none of the project's modules.
"""
import argparse
import contextlib
import math
import os
import signal
import sys
import typing
from dataclasses import field, fields


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
    """Every field's declared range, checked, and every float finite (a NaN or an infinity passes
    argparse's float() and no comparison catches it: it would fail at the first step instead); a
    field left at None (a default still to be resolved) is skipped. The first failure is a
    ConfigError naming the flag."""
    for f in fields(config):
        value, bounds = getattr(config, f.name), f.metadata.get('bounds')
        if isinstance(value, float) and not math.isfinite(value):  # first: 'inf' is '0 or more', only not finite
            raise ConfigError(f'{flag_name(f.name)} must be a finite number, got {value}')
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


def int_list(text: str, flag: str, example: str = 'such as 1,2,2') -> tuple:
    """'1,2,2' -> (1, 2, 2): positive whole numbers, comma-separated, or a ConfigError naming the flag
    (an empty text too)."""
    try:
        values = tuple(int(part) for part in text.split(','))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(f'{flag} {text!r}: give positive whole numbers separated by commas, {example}')
    return values


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

class NonFiniteLoss(Exception):
    """The loss became NaN or inf: one line, exit code 3."""
    exit_code = 3


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
    except RuntimeError as error:
        if not out_of_memory(error):
            raise  # a bug: the traceback is the useful report
        print(f'error: out of memory ({brief(error, 200)}): ask for less (a smaller model, batch or --num)',
              file=sys.stderr)
        return 1
    except Exception as error:
        code = getattr(error, 'exit_code', None)
        if code is None:
            raise  # a bug: the traceback is the useful report
        print(f'error: {last_line(error)}', file=sys.stderr)
        return code
    return 0


def out_of_memory(error: RuntimeError) -> bool:
    """torch's allocators raise RuntimeError, not MemoryError: the CPU's "DefaultCPUAllocator: can't
    allocate memory", CUDA's torch.OutOfMemoryError ("CUDA out of memory")."""
    text = str(error)
    return type(error).__name__ == 'OutOfMemoryError' or "can't allocate memory" in text or 'CUDA out of memory' in text


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
        """Handles SIGTERM and SIGINT; returns the function that puts the old handlers back. Nested in
        another StopFlag (a script that runs train.py in its process), no stop is lost: one the outer
        flag already holds is this one's from the start, and one this flag takes is the outer's too."""
        previous = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}
        outer = [h for h in previous.values() if isinstance(h, StopFlag)]
        if outer and outer[0].reason:
            self.reason = outer[0].reason

        def restore():
            for s, h in previous.items():
                signal.signal(s, h)
            if outer and self.reason and not outer[0].reason:
                outer[0].reason = self.reason
        return restore

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

"""Reports beside their numbers: provenance (device, torch, date, commit, command), Markdown tables,
JSON + Markdown files written whole, and charts drawn without a display."""
import datetime
import json
import os
import re
import sys

import torch

from files import atomic_open


def git_commit(folder: str = None) -> str:
    """The commit that holds this code, '-dirty' when a module here is changed or not yet tracked;
    'unknown' without a git checkout or when none of the modules here is tracked (the code copied
    into another repository, whose HEAD does not hold it)."""
    import subprocess
    here = folder or os.path.dirname(os.path.abspath(__file__))
    ours = sorted(name for name in os.listdir(here) if name.endswith('.py'))
    try:
        run = lambda *args: subprocess.run(['git', *args], cwd=here, capture_output=True, text=True)  # noqa: E731
        commit, tracked = run('rev-parse', 'HEAD').stdout.strip(), run('ls-files', '--', *ours).stdout.split()
        if not commit or not tracked:
            return 'unknown'
        changed = run('status', '--porcelain', '--untracked-files=no').stdout.strip() or len(tracked) < len(ours)
        return commit + ('-dirty' if changed else '')
    except OSError:
        return 'unknown'


def command_line() -> str:
    """The command that started this process, shell-quoted so that it replays as it ran: under
    torchrun (its environment), the torchrun launch with its node and process counts; a module run
    with -m (python -m time_to_quality) by its name, not its file's path."""
    import shlex
    launch = 'python'
    if 'TORCHELASTIC_RUN_ID' in os.environ or 'LOCAL_WORLD_SIZE' in os.environ:
        per_node = int(os.environ.get('LOCAL_WORLD_SIZE', 1))
        nodes = max(int(os.environ.get('WORLD_SIZE', per_node)) // per_node, 1)
        launch = f'torchrun --nnodes {nodes} --nproc_per_node {per_node}'
    main, argv = sys.modules.get('__main__'), sys.argv
    if getattr(main, '__spec__', None) and argv[:1] == [getattr(main, '__file__', None)]:  # python -m NAME: its name
        argv = ['-m', main.__spec__.name.removesuffix('.__main__'), *argv[1:]]
    return f'{launch} {shlex.join(argv)}'


def provenance(device: str) -> dict:
    """What every report states beside its numbers: the device, torch, the date, the commit, the command."""
    return {'device': device, 'torch': torch.__version__,
            'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
            'commit': git_commit(), 'command': command_line()}


def format_or_na(value, spec: str, missing: str = 'n/a') -> str:
    return missing if value is None else format(value, spec)


def markdown_table(headers: list, rows: list, left: int = 1) -> str:
    """A Markdown table: the first `left` columns aligned left (names), the others right (numbers)."""
    lines = ['| ' + ' | '.join(headers) + ' |', '| ' + ' | '.join(':-' if i < left else '-:'
                                                                   for i in range(len(headers))) + ' |']
    return '\n'.join(lines + ['| ' + ' | '.join(str(cell) for cell in row) + ' |' for row in rows])


ROOT = os.path.dirname(os.path.abspath(__file__))
LOCAL_PATH = re.compile(r'(?<![\w.])/(?:tmp|root|home|work|Users|var)/[^\s"\'`,;)\]|]*')


def portable(text: str) -> str:
    """A report's text without the paths of the machine that made it: one inside the repository
    relative to it, one elsewhere as its last two parts after '.../' (a checkpoint is named by the
    command, commit and sha256 beside it, not by where it lay)."""
    # The repository first, wherever it lies (a clone under /check or /opt is no usual home folder).
    inside = re.compile(r'(?<![\w.])' + re.escape(ROOT) + r'(?:/([^\s"\'`,;)\]|]*)|(?![\w.-]))')
    text = inside.sub(lambda match: match.group(1) or '.', text)
    return LOCAL_PATH.sub(lambda match: '.../' + '/'.join(match.group(0).rstrip('/').split('/')[-2:]), text)


def write_report(out_dir: str, stem: str, result: dict, title: str, body: str, notes: str = '') -> str:
    """OUT_DIR/STEM.json (the result, with its provenance) and STEM.md (the title; device, torch,
    date, commit; `notes`; the command; the `body`), each written whole or not at all, the machine's
    own paths made portable. Returns the path of the .png that goes beside them (each caller draws its
    own)."""
    path = os.path.join(out_dir, stem)
    markdown = (f"# {title}\n\n{result['device']}, torch {result['torch']}, {result['date']}, commit "
                f"{result['commit']}{notes}\n\nCommand: `{result['command']}`\n\n{body}\n")
    for ext, text in (('.json', json.dumps(result, indent=1)), ('.md', markdown)):
        with atomic_open(path + ext) as f:
            f.write(portable(text))
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

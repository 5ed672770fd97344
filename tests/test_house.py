"""The house rules that keep the repo readable, checked on the source: module sizes, line lengths, no
function name that means two things in two top-level modules, and one home for a run's bookkeeping. (The
layers, and so no import cycle: tests/test_train.py.)"""
import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = sorted(glob.glob(os.path.join(ROOT, '*.py')))
PACKAGE = sorted(glob.glob(os.path.join(ROOT, 'time_to_quality', '*.py')))
EVERY = TOP + PACKAGE + sorted(glob.glob(os.path.join(ROOT, 'scripts', '*.py'))) + sorted(
    glob.glob(os.path.join(ROOT, 'tests', '*.py')))
ENTRY_POINTS = {'main', 'cli', 'validate'}  # every script's own: the same meaning in each


def name_of(path: str) -> str:
    return os.path.relpath(path, ROOT)


def lines_of(path: str) -> list:
    with open(path, encoding='utf-8') as f:
        return f.read().splitlines()


def test_no_module_over_700_lines_and_the_two_scripts_under_450():
    sizes = {name_of(p): len(lines_of(p)) for p in TOP + PACKAGE}
    assert {n: s for n, s in sizes.items() if s > 700} == {}
    assert sizes['train.py'] <= 450 and sizes['sample.py'] <= 450


def test_no_code_line_over_120_characters():
    long = [f'{name_of(p)}:{i}' for p in EVERY for i, line in enumerate(lines_of(p), 1) if len(line) > 120]
    assert long == []


def test_no_function_name_defined_in_two_top_level_modules():
    where = {}
    for path in TOP:
        for node in ast.parse(open(path, encoding='utf-8').read()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in ENTRY_POINTS:
                where.setdefault(node.name, set()).add(name_of(path))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


@pytest.mark.parametrize('module', ['train.py', 'distill.py'])
def test_the_training_loops_share_their_bookkeeping(module):
    """The loops take the data, the EMA, the resume states and the non-finite checks from bookkeeping.py,
    and write none of them again."""
    source = open(os.path.join(ROOT, module), encoding='utf-8').read()
    assert 'from bookkeeping import' in source
    for copy in ('torch._foreach_lerp_', 'torch.get_rng_state', 'torch.set_rng_state', 'loaders.make_loader',
                 'data.fingerprint', 'math.isfinite'):
        assert copy not in source, f'{module} writes {copy} again: bookkeeping.py holds it'

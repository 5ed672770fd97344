import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# pytest.ini runs two workers (pytest-xdist): a thread each on the 2-core reference machine, and one
# for every process a test starts (train.py, a ladder, a benchmark part), or two workers' children
# would run four threads on two cores.
if os.environ.get('PYTEST_XDIST_WORKER'):
    os.environ['OMP_NUM_THREADS'] = '1'
torch.set_num_threads(1 if os.environ.get('PYTEST_XDIST_WORKER') else min(2, os.cpu_count() or 1))


@pytest.fixture(scope='session')
def root():
    return ROOT


@pytest.fixture(scope='session')
def shapes_fid_stats(tmp_path_factory):
    """The FID reference statistics of `shapes` at 16x16 under the stand-in extractor, computed
    once (50,000 shapes take seconds to draw) for the tests that train with FID evaluations."""
    from helpers import stand_in_extractor

    import evaluation
    folder = tmp_path_factory.mktemp('fid-stats')
    evaluation.reference_statistics('shapes', str(folder), 16, stand_in_extractor, 1000)
    return folder / 'fid_stats_shapes_16.npz'


@pytest.fixture
def shapes_fid_dir(shapes_fid_stats):
    """shapes_fid_dir(tmp_path): a --data-dir holding those statistics, as a run would have cached them."""
    import shutil

    def make(tmp_path):
        folder = tmp_path / 'data'
        folder.mkdir(exist_ok=True)
        shutil.copy(shapes_fid_stats, folder)
        return str(folder)
    return make
sys.path.insert(1, os.path.join(ROOT, 'scripts'))  # the scripts' modules (solver_accuracy, ...) for their tests


@pytest.fixture(scope='session')
def digits_cache(tmp_path_factory):
    """A --data-dir for the digit classifier's cache that both test workers share (the base temporary
    folder's parent): the classifier is trained once per test run, not once per test."""
    cache = tmp_path_factory.getbasetemp().parent / 'digits-cache'
    cache.mkdir(exist_ok=True)
    return str(cache)


@pytest.fixture(scope='session')
def digits_judge(digits_cache):
    """The digits judge at 16x16, its classifier in the shared cache."""
    import evaluation
    return evaluation.DigitsJudge(16, digits_cache)


@pytest.fixture(scope='session')
def teachers(tmp_path_factory, digits_cache):
    """Tiny 8x8 digits teachers of train.py: unconditional and class-conditional (2 steps each)."""
    import train
    from helpers import train_args
    made = {}
    for name, extra in (('uncond', ()), ('cond', ('--class-cond',))):
        tmp = tmp_path_factory.mktemp(f'teacher-{name}')
        assert train.cli(train_args(tmp, '--dataset', 'digits', '--image-size', '8', '--steps', '2',
                                    '--sample-every', '0', '--data-dir', digits_cache, *extra)) == 0
        made[name] = str(tmp / 'run' / 'ckpt.pt')
    return made

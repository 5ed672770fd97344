import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope='session')
def root():
    return ROOT

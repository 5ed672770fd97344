"""CUDA-only checks of the fast path; skipped on the CPU (CI). Run them on a GPU machine:
python -m pytest -q tests/test_gpu.py"""
import dataclasses

import pytest
import torch
from helpers import train_args

import cli
import data
import loaders
import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


def gpu_run(tmp_path, **overrides):
    args = train_args(tmp_path, '--device', 'cuda', '--shapes-count', '512', '--batch-size', '64')
    cfg = cli.parse_config(args, train.TrainConfig)
    cfg = train.resolve_defaults(cfg, torch.device('cuda'))
    cfg = dataclasses.replace(cfg, **overrides)
    return train.build_run(cfg, torch.device('cuda'), progress=False)


def test_fast_path_defaults_on_cuda(tmp_path):
    run = gpu_run(tmp_path)
    cfg = run.cfg
    settings = (cfg.amp, cfg.compile, cfg.channels_last, cfg.fused_adam, run.loader_kind)
    assert settings == ('bf16', True, False, True, 'gpu')  # NCHW: channels-last measured slower (H200)


@pytest.mark.parametrize('compile', [False, True])
def test_hot_loop_does_not_synchronise(tmp_path, compile):
    run = gpu_run(tmp_path, compile=compile)  # compiling may sync; the steady state must not
    stream = train.batches(run, 0)
    for step in range(3):
        train.train_step(run, next(stream), step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        for step in range(3, 12):  # into the second epoch (8 batches each): its order goes up pinned, async
            train.train_step(run, next(stream), step)
    finally:
        torch.cuda.set_sync_debug_mode('default')


@pytest.mark.parametrize('amp', ['bf16', 'fp16'])
def test_compiled_mixed_precision_trains(tmp_path, amp):
    assert train.cli(train_args(tmp_path, '--device', 'cuda', '--amp', amp, '--steps', '30', '--lr', '2e-3',
                                '--log-every', '10', '--sample-every', '0')) == 0
    ckpt = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    assert not any(k.startswith(('_orig_mod', 'module')) for k in ckpt['model'])
    assert all(torch.isfinite(t).all() for t in ckpt['model'].values())


def test_gpu_and_torch_loaders_agree_on_cuda():
    images = data.make_shapes(64, 16)
    gpu = loaders.GPULoader(images, 16, seed=0, device='cuda')
    dl = loaders.TorchLoader(data.ImageTensorDataset(images), 16, seed=0, device='cuda', num_workers=2)
    assert all(torch.equal(a, b) for a, b in zip(gpu.epoch(0), dl.epoch(0), strict=True))

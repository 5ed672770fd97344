"""kernels.py on the CPU: the fused GroupNorm + add + SiLU run through Triton's interpreter against
torch.nn.GroupNorm and F.silu (values and the gradients of x, weight, bias and the add), its
custom op checked by opcheck and under torch.compile, and its kernels compiled for an H100.

Triton interprets only where TRITON_INTERPRET=1 was set before triton was first imported (its
@jit reads it then, for tl.sum and tl.sigmoid as for our kernels); in a pytest worker another
module (or model.py) may have imported it first. So the interpreted_* checks run in a child
process that test_under_the_interpreter starts with the variable set; to run them alone:
TRITON_INTERPRET=1 python -m pytest -n 0 -o python_functions='interpreted_*' tests/test_kernels.py
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
from triton.runtime.interpreter import InterpretedFunction

import kernels
from kernels import group_norm_act, group_norm_reference

EPS = 1e-6  # the model's GroupNorm eps


def test_under_the_interpreter(root):
    """The interpreted_* checks below, in a child process with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET='1')
    command = [sys.executable, '-m', 'pytest', '-q', '-n', '0', '-p', 'no:cacheprovider',
               '-o', 'python_functions=interpreted_*', os.path.abspath(__file__)]
    child = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-2000:]
    assert ' passed' in child.stdout and 'skipped' not in child.stdout, child.stdout[-2000:]


class _Recorded:
    """A kernel launched as it is, its name written down at each launch."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(self.kernel.fn.__name__)
        return self.kernel[grid]


@pytest.fixture
def interpreted(monkeypatch):
    """The names of the kernels this test launched, each through Triton's interpreter."""
    assert kernels.INTERPRETED, 'run with TRITON_INTERPRET=1 set before triton is imported'
    launched = []
    for name in ('_group_norm_fwd_kernel', '_group_norm_bwd_kernel'):
        kernel = getattr(kernels, name)
        assert isinstance(kernel, InterpretedFunction)
        monkeypatch.setattr(kernels, name, _Recorded(kernel, launched))
    return launched


def make_inputs(batch, channels, height, width, add, scale=1.0, seed=0):
    """Activations with a mean of their own per channel (so that a wrong mean shows), an affine
    away from (1, 0) and an add of the size of the activations (fp32)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, channels, height, width, generator=g)
         + torch.randn(1, channels, 1, 1, generator=g)) * scale
    weight = 1 + 0.5 * torch.randn(channels, generator=g)
    bias = 0.5 * torch.randn(channels, generator=g)
    temb = torch.randn(batch, channels, generator=g) * scale if add else None
    return x, weight, bias, temb


def expected(x, weight, bias, groups, eps, add, silu):
    """torch.nn.GroupNorm and F.silu themselves, the add broadcast as the ResBlock does it."""
    norm = nn.GroupNorm(groups, x.shape[1], eps=eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.bias.copy_(bias)
    h = x + add[:, :, None, None] if add is not None else x
    y = norm(h)
    return (F.silu(y) if silu else y), (norm.weight, norm.bias)


def assert_close(actual, wanted, tol, what):
    """Agreement to tol of the larger of 1 and the wanted tensor's largest magnitude."""
    scale = max(1.0, wanted.abs().max().item())
    err = (actual.float() - wanted.float()).abs().max().item()
    assert err <= tol * scale, f'{what}: max error {err:.3g} > {tol:g} x {scale:.3g}'


def check_against_torch(launched, x, weight, bias, groups, temb, silu, dtype, tol, eps=EPS, memory_format=None):
    """Values and gradients of group_norm_act at dtype (weight and bias kept fp32, as under
    autocast) against GroupNorm + SiLU in fp32 on the same (rounded) values; one launch of each
    kernel made."""
    launched.clear()
    x, temb = x.to(dtype), temb.to(dtype) if temb is not None else None
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    ours = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias, temb)]
    y = group_norm_act(ours[0], ours[1], ours[2], groups, eps, ours[3], silu)
    assert y.dtype == dtype and y.shape == x.shape
    if memory_format is not None:
        assert y.is_contiguous(memory_format=memory_format)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    leaves = [t for t in ours if t is not None]
    grads = torch.autograd.grad(y, leaves, dy)

    ref_x = x.float().requires_grad_()
    ref_add = temb.float().requires_grad_() if temb is not None else None
    ref_y, (ref_w, ref_b) = expected(ref_x, weight, bias, groups, eps, ref_add, silu)
    ref_leaves = [t for t in (ref_x, ref_w, ref_b, ref_add) if t is not None]
    ref_grads = torch.autograd.grad(ref_y, ref_leaves, dy.float())
    assert launched == ['_group_norm_fwd_kernel', '_group_norm_bwd_kernel']
    assert_close(y, ref_y, tol, 'y')
    for name, grad, ref_grad, leaf in zip(['dx', 'dweight', 'dbias', 'd(add)'], grads, ref_grads, leaves):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        assert_close(grad, ref_grad, tol, name)


# (batch, channels, groups, height, width, add, silu): the presets' channel and group counts at
# their resolutions (ddpm-cifar10: 128 and 256 channels, 32 groups; tiny: 16 and 32, 8 groups).
CASES = {
    'cifar-128ch-32x32': (1, 128, 32, 32, 32, True, True),
    'cifar-256ch-16x16': (2, 256, 32, 16, 16, False, True),
    'cifar-256ch-8x8-no-silu': (2, 256, 32, 8, 8, True, False),
    'cifar-256ch-4x4': (1, 256, 32, 4, 4, True, True),
    'tiny-16ch-16x16': (2, 16, 8, 16, 16, True, True),
    'tiny-32ch-8x8-plain': (2, 32, 8, 8, 8, False, False),
    'tiny-32ch-4x4': (2, 32, 8, 4, 4, True, True),
}


@pytest.mark.parametrize('case', list(CASES))
def interpreted_fused_matches_groupnorm_silu_fp32(interpreted, case):
    batch, channels, groups, height, width, add, silu = CASES[case]
    x, weight, bias, temb = make_inputs(batch, channels, height, width, add)
    check_against_torch(interpreted, x, weight, bias, groups, temb, silu, torch.float32, 1e-5)


def interpreted_odd_sizes_and_small_activations(interpreted):
    # 3x5 and 6 channels a group pad every block dimension; at a scale of 1e-3 the variance (1e-6)
    # is the size of eps, so the eps must be where GroupNorm puts it.
    x, weight, bias, temb = make_inputs(2, 36, 3, 5, add=True, scale=1e-3)
    check_against_torch(interpreted, x, weight, bias, 6, temb, True, torch.float32, 1e-5)
    x, weight, bias, temb = make_inputs(1, 24, 3, 5, add=False)
    check_against_torch(interpreted, x, weight, bias, 6, temb, False, torch.float32, 1e-5)


def interpreted_looped_path(interpreted, monkeypatch):
    # A group larger than one block: 2 channels of 96x96 are looped over in blocks of 4096 (the
    # last one partial), both ways; then small blocks forced on an odd size, channels-last, at a
    # scale where eps counts.
    x, weight, bias, temb = make_inputs(1, 2, 96, 96, add=True)
    check_against_torch(interpreted, x, weight, bias, 1, temb, True, torch.float32, 1e-5)
    for name, size in [('FORWARD_MAX_BLOCK', 32), ('BACKWARD_MAX_BLOCK', 32), ('LOOP_BLOCK', 16)]:
        monkeypatch.setattr(kernels, name, size)
    x, weight, bias, temb = make_inputs(2, 24, 3, 5, add=True, scale=1e-3, seed=1)
    check_against_torch(interpreted, x, weight, bias, 6, temb, True, torch.float32, 1e-5,
                        memory_format=torch.channels_last)
    x, weight, bias, temb = make_inputs(2, 24, 3, 5, add=False, seed=2)
    check_against_torch(interpreted, x, weight, bias, 6, temb, False, torch.float32, 1e-5)


def interpreted_channels_last_read_in_place(interpreted):
    x, weight, bias, temb = make_inputs(2, 32, 8, 8, add=True)
    check_against_torch(interpreted, x, weight, bias, 8, temb, True, torch.float32, 1e-5,
                        memory_format=torch.channels_last)


@pytest.mark.parametrize('dtype, case, tol', [(torch.bfloat16, 'cifar-128ch-32x32', 1e-2),
                                              (torch.bfloat16, 'tiny-16ch-16x16', 1e-2),
                                              (torch.float16, 'tiny-32ch-4x4', 2e-3)])
def interpreted_half_precision_inputs(interpreted, dtype, case, tol):
    # Statistics in fp32: only the rounding of y, dx and d(add) to the input's dtype is lost (a
    # half of its last place: 4e-3 of the largest value in bf16, 3e-4 in fp16).
    batch, channels, groups, height, width, add, silu = CASES[case]
    x, weight, bias, temb = make_inputs(batch, channels, height, width, add)
    check_against_torch(interpreted, x, weight, bias, groups, temb, silu, dtype, tol)


def test_reference_is_groupnorm_then_silu():
    x, weight, bias, temb = (t.double() for t in make_inputs(2, 24, 3, 5, add=True))
    for silu in (True, False):
        want, _ = expected(x, weight, bias, 6, EPS, temb, silu)
        torch.testing.assert_close(group_norm_reference(x, weight, bias, 6, EPS, temb, silu), want, rtol=0, atol=1e-12)
        # The add as the model writes it, (B, C, 1, 1).
        torch.testing.assert_close(group_norm_reference(x, weight, bias, 6, EPS, temb[:, :, None, None], silu), want,
                                   rtol=0, atol=1e-12)


def test_cpu_without_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, 'INTERPRETED', False)
    monkeypatch.setattr(kernels, '_group_norm_fwd_kernel', None)  # a launch would fail
    x, weight, bias, temb = make_inputs(2, 32, 4, 4, add=True)
    torch.testing.assert_close(group_norm_act(x, weight, bias, 8, EPS, temb),
                               group_norm_reference(x, weight, bias, 8, EPS, temb), rtol=0, atol=0)
    with pytest.raises(ValueError, match='groups'):
        group_norm_act(x, weight, bias, 5, EPS)


def interpreted_custom_op_opcheck(interpreted):
    # Schema, autograd registration, the fake implementations (forward and backward) and AOT
    # dispatch with dynamic shapes, each against the real op.
    x, weight, bias, temb = make_inputs(2, 8, 3, 4, add=True)
    for add in (temb, None):
        args = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(),
                add.requires_grad_() if add is not None else None, 4, EPS, True)
        torch.library.opcheck(torch.ops.ddpm.group_norm_act.default, args)
    x_cl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    torch.library.opcheck(torch.ops.ddpm.group_norm_act.default, (x_cl, weight, bias, temb, 4, EPS, False),
                          test_utils=('test_faketensor',))


def interpreted_compiles_into_one_graph(interpreted):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend('aot_eager')(gm, example_inputs)

    def block(x, weight, bias, temb):  # the ResBlock's add, norm2 and SiLU, and a use of them
        return group_norm_act(x, weight, bias, 8, EPS, temb[:, :, None, None]) * 2

    x, weight, bias, temb = (t.requires_grad_() for t in make_inputs(2, 16, 4, 4, add=True))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    y = compiled(x, weight, bias, temb)
    grads = torch.autograd.grad(y.square().sum(), [x, weight, bias, temb])
    assert len(graphs) == 1
    assert torch.ops.ddpm.group_norm_act.default in [node.target for node in graphs[0].graph.nodes]
    want = group_norm_reference(x, weight, bias, 8, EPS, temb) * 2
    want_grads = torch.autograd.grad(want.square().sum(), [x, weight, bias, temb])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    for grad, want_grad in zip(grads, want_grads):
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-4)


def test_kernels_compile_for_an_h100():
    # The interpreter runs Python, not the compiler: compile every branch of both kernels to a
    # cubin for sm_90 (no GPU needed) so that what only the compiler rejects shows here.
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernels.INTERPRETED:
        pytest.skip('TRITON_INTERPRET=1: the kernels are Python functions, not compiled ones')
    shapes = dict(C='i32', HW='i32', GROUPS='i32', CG='i32', stride_c='i32', stride_hw='i32')
    forward = dict(X='*bf16', ADD='*bf16', W='*fp32', B='*fp32', Y='*bf16', MEAN='*fp32', RSTD='*fp32',
                   **shapes, eps='fp32')
    backward = dict(DY='*bf16', X='*bf16', ADD='*bf16', W='*fp32', B='*fp32', MEAN='*fp32', RSTD='*fp32',
                    DX='*bf16', DW='*fp32', DB='*fp32', DADD='*fp32', **shapes)
    for kernel, signature in [(kernels._group_norm_fwd_kernel, forward), (kernels._group_norm_bwd_kernel, backward)]:
        for single in (True, False):
            constants = dict(HAS_ADD=True, SILU=True, SINGLE=single, BLOCK_C=8, BLOCK_HW=256)
            signature = dict(signature, **{name: 'constexpr' for name in constants})
            compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget('cuda', 90, 32),
                                      options=dict(num_warps=4))
            assert compiled.asm['cubin']


def interpreted_the_unet_with_the_fused_norm_is_the_same_function(interpreted):
    # model.py's wiring: every GroupNorm of the tiny UNet through the kernel (the ResBlocks' second
    # norm with the timestep added in it, the attention's without SiLU), values and every gradient
    # equal to the same network on PyTorch's ops.
    from dataclasses import replace

    from model import UNet, get_config
    config = get_config('tiny', image_size=8, dropout=0.0)
    torch.manual_seed(0)
    plain, fused = UNet(config), UNet(replace(config, fused_norm=True))
    fused.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for p in plain.parameters():  # away from the near-zero start, so that every norm matters
            p.add_(0.1 * torch.randn_like(p))
        fused.load_state_dict(plain.state_dict())
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([3, 700])
    a, b = plain(x, t), fused(x, t)
    a.square().sum().backward()
    b.square().sum().backward()
    norms = sum(isinstance(m, nn.GroupNorm) for m in fused.modules())
    assert interpreted.count('_group_norm_fwd_kernel') == norms == interpreted.count('_group_norm_bwd_kernel')
    assert_close(b, a, 1e-4, 'output')
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert_close(q.grad, p.grad, 1e-4, name)

"""Fused kernels (Triton) beside the PyTorch functions they replace: GroupNorm with the timestep add
before it and the SiLU after it, forward and backward, as one custom op.

A ResBlock runs `silu(group_norm(h + temb[:, :, None, None]))`: eager PyTorch reads and writes the
activation once for the add, once for the norm and once for the SiLU (and as often again going
back). `group_norm_act` does it in one read and one write: one Triton program per (image, group)
holds the group on chip where it fits (statistics in fp32 for fp32, bf16 and fp16 inputs), folds
the add in before the statistics and the SiLU in after the affine. The backward recomputes the
normalised value from x, the mean and the rstd rather than saving it, and returns the add's
gradient (the sum over H, W of dx) from the same pass. The benchmark row that shows it is
'fused GroupNorm (Triton)': no GPU measurement yet.

Layout: NCHW-contiguous and channels-last inputs are read in place and the output keeps the
input's layout; any other layout is first copied to NCHW. On the CPU the op runs only under
Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported); otherwise, and for
float64, `group_norm_act` runs the reference.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# A group up to this many elements (channels and H*W each rounded up to a power of two) is held
# whole and read once; a larger one is looped over in blocks of LOOP_BLOCK. A thread holds 16
# values (32 at the forward's largest); beyond that the backward spills registers (ptxas, sm_90).
FORWARD_MAX_BLOCK = 16384
BACKWARD_MAX_BLOCK = 8192
LOOP_BLOCK = 4096
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def group_norm_reference(x, weight, bias, groups: int, eps: float, add=None, silu: bool = True):
    """silu(group_norm(x + add)) in plain PyTorch: add (B, C) or (B, C, 1, 1), broadcast over H, W."""
    if add is not None:
        x = x + add.reshape(*add.shape[:2], 1, 1)
    y = F.group_norm(x, groups, weight, bias, eps)
    return F.silu(y) if silu else y


@triton.jit
def _load_block(X, channels, c_mask, start, HW, stride_c, stride_hw, a, HAS_ADD: tl.constexpr,
                BLOCK_HW: tl.constexpr):
    """One block of a group's H*W from `start`: x (+ the add) in fp32, its mask and offsets."""
    hw = start + tl.arange(0, BLOCK_HW)
    mask = c_mask[:, None] & (hw < HW)[None, :]
    offsets = channels[:, None] * stride_c + hw[None, :] * stride_hw
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        x = x + a
    return x, mask, offsets


@triton.jit
def _grad_of_norm(DY, offsets, mask, xhat, w, b, SILU: tl.constexpr):
    """The gradient at z = xhat * w + b: dy, through the SiLU when there is one
    (d silu(z) / dz = s * (1 + z * (1 - s)), s = sigmoid(z))."""
    dz = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        z = xhat * w + b
        s = tl.sigmoid(z)
        dz = dz * s * (1.0 + z * (1.0 - s))
    return dz


@triton.jit
def _group_norm_fwd_kernel(X, ADD, W, B, Y, MEAN, RSTD, C, HW, GROUPS, CG, stride_c, stride_hw, eps,
                           HAS_ADD: tl.constexpr, SILU: tl.constexpr, SINGLE: tl.constexpr,
                           BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr):
    pid = tl.program_id(0)  # one program per (image, group)
    batch = pid // GROUPS
    lane_c = tl.arange(0, BLOCK_C)
    c_mask = lane_c < CG
    channels = (pid % GROUPS) * CG + lane_c
    X += batch.to(tl.int64) * C * HW
    Y += batch.to(tl.int64) * C * HW
    w = tl.load(W + channels, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    b = tl.load(B + channels, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_ADD:
        a = tl.load(ADD + batch * C + channels, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    else:
        a = 0.0  # unread: _load_block adds it only with HAS_ADD
    n = CG * HW
    if SINGLE:  # the whole group in registers: one read, one write
        x, mask, offsets = _load_block(X, channels, c_mask, 0, HW, stride_c, stride_hw, a, HAS_ADD, BLOCK_HW)
        x = tl.where(mask, x, 0.0)
        mean = tl.sum(x) / n
        centred = tl.where(mask, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred) / n + eps)
        z = centred * rstd * w + b
        if SILU:
            z = z * tl.sigmoid(z)
        tl.store(Y + offsets, z.to(Y.dtype.element_ty), mask=mask)
    else:  # looped: Welford per lane, lanes merged (Chan et al.), then a second pass writes
        count = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        lane_mean = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        lane_m2 = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        for start in range(0, HW, BLOCK_HW):
            x, mask, offsets = _load_block(X, channels, c_mask, start, HW, stride_c, stride_hw, a, HAS_ADD,
                                           BLOCK_HW)
            count_new = count + mask.to(tl.float32)
            delta = x - lane_mean
            lane_mean = tl.where(mask, lane_mean + delta / tl.maximum(count_new, 1.0), lane_mean)
            lane_m2 = tl.where(mask, lane_m2 + delta * (x - lane_mean), lane_m2)
            count = count_new
        mean = tl.sum(lane_mean * count) / n
        spread = lane_mean - mean
        rstd = tl.rsqrt((tl.sum(lane_m2) + tl.sum(count * spread * spread)) / n + eps)
        for start in range(0, HW, BLOCK_HW):
            x, mask, offsets = _load_block(X, channels, c_mask, start, HW, stride_c, stride_hw, a, HAS_ADD,
                                           BLOCK_HW)
            z = (x - mean) * rstd * w + b
            if SILU:
                z = z * tl.sigmoid(z)
            tl.store(Y + offsets, z.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + pid, mean)
    tl.store(RSTD + pid, rstd)


@triton.jit
def _group_norm_bwd_kernel(DY, X, ADD, W, B, MEAN, RSTD, DX, DW, DB, DADD, C, HW, GROUPS, CG,
                           stride_c, stride_hw,
                           HAS_ADD: tl.constexpr, SILU: tl.constexpr, SINGLE: tl.constexpr,
                           BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr):
    """dx, and per image the channel sums of dz * xhat, dz and dx: dweight, dbias (summed over the
    batch outside) and d(add). z = xhat * w + b is recomputed from x, mean and rstd."""
    pid = tl.program_id(0)
    batch = pid // GROUPS
    lane_c = tl.arange(0, BLOCK_C)
    c_mask = lane_c < CG
    channels = (pid % GROUPS) * CG + lane_c
    X += batch.to(tl.int64) * C * HW
    DY += batch.to(tl.int64) * C * HW
    DX += batch.to(tl.int64) * C * HW
    w_c = tl.load(W + channels, mask=c_mask, other=0.0).to(tl.float32)
    w = w_c[:, None]
    b = tl.load(B + channels, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_ADD:
        a = tl.load(ADD + batch * C + channels, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    else:
        a = 0.0  # unread: _load_block adds it only with HAS_ADD
    mean = tl.load(MEAN + pid)
    rstd = tl.load(RSTD + pid)
    n = CG * HW
    if SINGLE:
        x, mask, offsets = _load_block(X, channels, c_mask, 0, HW, stride_c, stride_hw, a, HAS_ADD, BLOCK_HW)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        dz = _grad_of_norm(DY, offsets, mask, xhat, w, b, SILU)
        dxhat = dz * w
        c1 = tl.sum(dxhat * xhat) / n
        c2 = tl.sum(dxhat) / n
        dx = tl.where(mask, (dxhat - xhat * c1 - c2) * rstd, 0.0)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        d_w = tl.sum(dz * xhat, axis=1)
        d_b = tl.sum(dz, axis=1)
        d_add = tl.sum(dx, axis=1)
    else:  # looped: the channel sums first, then dx
        d_w = tl.zeros([BLOCK_C], dtype=tl.float32)
        d_b = tl.zeros([BLOCK_C], dtype=tl.float32)
        xhat_sum = tl.zeros([BLOCK_C], dtype=tl.float32)
        for start in range(0, HW, BLOCK_HW):
            x, mask, offsets = _load_block(X, channels, c_mask, start, HW, stride_c, stride_hw, a, HAS_ADD,
                                           BLOCK_HW)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            dz = _grad_of_norm(DY, offsets, mask, xhat, w, b, SILU)
            d_w += tl.sum(dz * xhat, axis=1)
            d_b += tl.sum(dz, axis=1)
            xhat_sum += tl.sum(xhat, axis=1)
        c1 = tl.sum(d_w * w_c) / n  # the group means of dxhat * xhat and of dxhat
        c2 = tl.sum(d_b * w_c) / n
        for start in range(0, HW, BLOCK_HW):
            x, mask, offsets = _load_block(X, channels, c_mask, start, HW, stride_c, stride_hw, a, HAS_ADD,
                                           BLOCK_HW)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            dz = _grad_of_norm(DY, offsets, mask, xhat, w, b, SILU)
            dx = (dz * w - xhat * c1 - c2) * rstd
            tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        d_add = (w_c * d_b - xhat_sum * c1 - HW * c2) * rstd  # the sum over H, W of dx
    out = batch * C + channels
    tl.store(DW + out, d_w, mask=c_mask)
    tl.store(DB + out, d_b, mask=c_mask)
    tl.store(DADD + out, d_add, mask=c_mask)


# Triton's interpreter runs the kernels on the CPU only where TRITON_INTERPRET=1 was set before
# triton was first imported: @triton.jit reads it then, for triton's own library (tl.sum,
# tl.sigmoid, ...) as for these kernels, and setting it later changes nothing.
INTERPRETED = isinstance(tl.sum, InterpretedFunction) and isinstance(_group_norm_fwd_kernel, InterpretedFunction)


def _check_device(x):
    if x.device.type == 'cpu' and not INTERPRETED:
        raise RuntimeError('ddpm::group_norm_act runs on the CPU only under Triton\'s interpreter: '
                           'TRITON_INTERPRET=1 set before triton is imported')


def _layout(x):
    """channels-last where x is (and is not also NCHW-contiguous); NCHW otherwise."""
    if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _launch_args(x, groups: int, max_block: int):
    """The grid, the shape and stride arguments and the block sizes of either kernel."""
    batch, channels, height, width = x.shape
    hw, cg = height * width, channels // groups
    block_c, block_hw = triton.next_power_of_2(cg), triton.next_power_of_2(hw)
    if block_c > LOOP_BLOCK:
        raise ValueError(f'group_norm_act: {cg} channels a group is more than {LOOP_BLOCK}')
    single = block_c * block_hw <= max_block
    if not single:
        block_hw = LOOP_BLOCK // block_c
    strides = (1, channels) if _layout(x) == torch.channels_last else (hw, 1)
    meta = dict(SINGLE=single, BLOCK_C=block_c, BLOCK_HW=block_hw,
                num_warps=min(16, max(1, block_c * block_hw // 512)))
    return (batch * groups,), (channels, hw, groups, cg, *strides), meta


@torch.library.custom_op('ddpm::group_norm_act', mutates_args=())
def _group_norm_act_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       add: Optional[torch.Tensor], groups: int, eps: float, silu: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, and the mean and rstd (fp32, (B, groups)) the backward reads."""
    _check_device(x)
    x = x.contiguous(memory_format=_layout(x))
    y = torch.empty_like(x, memory_format=_layout(x))
    mean = x.new_empty((x.shape[0], groups), dtype=torch.float32)
    rstd = torch.empty_like(mean)
    grid, sizes, meta = _launch_args(x, groups, FORWARD_MAX_BLOCK)
    add = add.contiguous() if add is not None else None
    _group_norm_fwd_kernel[grid](x, add, weight.contiguous(), bias.contiguous(), y, mean, rstd, *sizes, eps,
                                 HAS_ADD=add is not None, SILU=silu, **meta)
    return y, mean, rstd


@_group_norm_act_op.register_fake
def _(x, weight, bias, add, groups, eps, silu):
    stats = x.new_empty((x.shape[0], groups), dtype=torch.float32)
    return torch.empty_like(x, memory_format=_layout(x)), stats, torch.empty_like(stats)


@torch.library.custom_op('ddpm::group_norm_act_backward', mutates_args=())
def _group_norm_act_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                add: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor,
                                groups: int, silu: bool
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dweight, dbias and d(add) ((B, C); computed with or without an add)."""
    _check_device(x)
    x = x.contiguous(memory_format=_layout(x))
    dy = dy.contiguous(memory_format=_layout(x))
    dx = torch.empty_like(x, memory_format=_layout(x))
    partial = x.new_empty((3, *x.shape[:2]), dtype=torch.float32)  # per image: dweight, dbias, d(add)
    grid, sizes, meta = _launch_args(x, groups, BACKWARD_MAX_BLOCK)
    add = add.contiguous() if add is not None else None
    _group_norm_bwd_kernel[grid](dy, x, add, weight.contiguous(), bias.contiguous(), mean, rstd,
                                 dx, partial[0], partial[1], partial[2], *sizes,
                                 HAS_ADD=add is not None, SILU=silu, **meta)
    d_add = partial[2].to(add.dtype if add is not None else x.dtype)
    return dx, partial[0].sum(0).to(weight.dtype), partial[1].sum(0).to(bias.dtype), d_add


@_group_norm_act_backward_op.register_fake
def _(dy, x, weight, bias, add, mean, rstd, groups, silu):
    d_add = x.new_empty(x.shape[:2], dtype=add.dtype if add is not None else x.dtype)
    return torch.empty_like(x, memory_format=_layout(x)), torch.empty_like(weight), torch.empty_like(bias), d_add


def _setup_context(ctx, inputs, output):
    x, weight, bias, add, groups, eps, silu = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, add, mean, rstd)
    ctx.groups, ctx.silu, ctx.has_add = groups, silu, add is not None
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, add, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias, d_add = _group_norm_act_backward_op(dy, x, weight, bias, add, mean, rstd, ctx.groups, ctx.silu)
    return dx, dweight, dbias, d_add if ctx.has_add else None, None, None, None


_group_norm_act_op.register_autograd(_backward, setup_context=_setup_context)


def group_norm_act(x, weight, bias, groups: int, eps: float, add=None, silu: bool = True):
    """silu(group_norm(x + add)), as group_norm_reference: the fused op on CUDA (and on the CPU under
    TRITON_INTERPRET=1) for a (B, C, H, W) x in fp32, bf16 or fp16; the reference otherwise. The
    op returns x's dtype whatever autocast says (the reference's F.group_norm returns fp32 under it)."""
    if x.shape[1] % groups:
        raise ValueError(f'group_norm_act: {x.shape[1]} channels do not split into {groups} groups')
    fused = x.is_cuda or (x.device.type == 'cpu' and INTERPRETED)
    if not fused or x.dim() != 4 or x.dtype not in DTYPES:
        return group_norm_reference(x, weight, bias, groups, eps, add, silu)
    if add is not None:
        add = add.reshape(*x.shape[:2])
    return _group_norm_act_op(x, weight, bias, add, groups, eps, silu)[0]

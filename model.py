"""The DDPM UNet (Ho et al., 2020, appendix B), its presets and FLOP counting (of the network, and
of a whole training step op by op, FLOPs and bytes, for the roofline): the network and nothing else
(its files: checkpoint.py for ours, diffusers_io.py for diffusers' folders).

The network is the paper's (its TF code, diffusion_tf/models/unet.py): a sinusoidal
timestep embedding and a 2-layer MLP; residual blocks of GroupNorm(eps 1e-6), SiLU, 3x3
conv, the timestep embedding through a SiLU and a projection added, dropout, and a last
conv initialised at scale 1e-10; single-head self-attention at 16x16; strided-conv
downsampling padded like TF's 'SAME' (right and bottom); nearest-neighbour upsampling and
a conv; a skip connection from every down block; TF's variance-scaling initialisation.
diffusers' UNet2DModel in the configuration of google/ddpm-cifar10-32 is the same function
(tests/test_model.py checks it in float64), and diffusers_io.load_diffusers reads its weights.
"""
import contextlib
import math
import re
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

NORM_EPS = 1e-6  # tf.contrib.layers.group_norm's default, used by the paper's code
ZERO_INIT_SCALE = 1e-10  # the paper's default_init(scale=0.): variance scaling at 1e-10, not exact zeros
# Written into every checkpoint; checkpoints of an older, different network do not load.
MODEL_VERSION = 2


@dataclass(frozen=True)
class UNetConfig:
    image_size: int = 32  # resolution the attention levels are placed for
    in_channels: int = 3
    base_channels: int = 128
    channel_mults: tuple = (1, 2, 2, 2)
    blocks_per_level: int = 2
    attn_resolutions: tuple = (16,)
    num_heads: int = 1
    dropout: float = 0.1
    norm_groups: int = 32
    attention: str = 'sdpa'  # 'sdpa' (F.scaled_dot_product_attention) or 'manual'

    def __post_init__(self):
        if self.attention not in ('sdpa', 'manual'):
            raise ValueError(f"attention must be 'sdpa' or 'manual', got {self.attention!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f'dropout must be in [0, 1), got {self.dropout}')
        factor = 2 ** (len(self.channel_mults) - 1)
        if self.image_size < factor or self.image_size % factor:
            raise ValueError(
                f'image size {self.image_size} cannot be halved {len(self.channel_mults) - 1} times '
                f'by this UNet: use a multiple of {factor}')
        for mult in self.channel_mults:
            channels = self.base_channels * mult
            if channels % self.norm_groups or channels % self.num_heads:
                raise ValueError(f'{channels} channels are not divisible by norm_groups='
                                 f'{self.norm_groups} and num_heads={self.num_heads}')


PRESETS = {
    # The paper's CIFAR-10 model: 35.7M parameters.
    'ddpm-cifar10': UNetConfig(),
    # Half the width: about 9M parameters, the size of the reference speedup table's UNet.
    'small': UNetConfig(base_channels=64),
    # For CPU tests and demos: 0.28M parameters, GroupNorm(8) since it has only 16 channels.
    'tiny': UNetConfig(base_channels=16, channel_mults=(1, 2, 2), blocks_per_level=1,
                       attn_resolutions=(8,), dropout=0.0, norm_groups=8),
}


def get_config(preset: str, **overrides) -> UNetConfig:
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[preset], **overrides)


def timestep_embedding(t: torch.Tensor, dim: int, dtype=torch.float32) -> torch.Tensor:
    """Sinusoidal embedding of integer timesteps (Vaswani et al. 2017) as the paper's code
    computes it: frequencies exp(-ln(10000) i / (dim/2 - 1)), sines then cosines, in float32
    (as there and in diffusers, so that the two agree bit for bit), returned in `dtype`."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - 1))
    angles = t.float()[:, None] * freqs[None, :]  # (B, half)
    return torch.cat([angles.sin(), angles.cos()], dim=1).to(dtype)  # (B, dim)


def variance_scaling_(weight: torch.Tensor, scale: float = 1.0, fans=None) -> torch.Tensor:
    """TF's variance_scaling(scale, mode='fan_avg', distribution='uniform'), the paper's
    default_init: U(-a, a) with a = sqrt(3 scale / ((fan_in + fan_out) / 2)), where a conv's
    fans include its kernel area."""
    fan_in, fan_out = fans or nn.init._calculate_fan_in_and_fan_out(weight)
    limit = math.sqrt(3.0 * scale / ((fan_in + fan_out) / 2))
    with torch.no_grad():
        return weight.uniform_(-limit, limit)


def _init(layer: nn.Module, scale: float = 1.0) -> nn.Module:
    """A conv or linear layer initialised as the paper's: variance scaling, zero bias."""
    variance_scaling_(layer.weight, scale)
    nn.init.zeros_(layer.bias)
    return layer


def _norm(groups: int, channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels, eps=NORM_EPS)


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, temb_ch: int, dropout: float, groups: int):
        super().__init__()
        self.norm1 = _norm(groups, in_ch)
        self.conv1 = _init(nn.Conv2d(in_ch, out_ch, 3, padding=1))
        self.temb_proj = _init(nn.Linear(temb_ch, out_ch))
        self.norm2 = _norm(groups, out_ch)
        self.dropout = nn.Dropout(dropout)
        # At scale 1e-10 every block starts as (nearly) the identity, as in the paper.
        self.conv2 = _init(nn.Conv2d(out_ch, out_ch, 3, padding=1), ZERO_INIT_SCALE)
        # The paper's 'nin_shortcut': a 1x1 conv where the channel count changes.
        self.skip = _init(nn.Conv2d(in_ch, out_ch, 1)) if in_ch != out_ch else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb_proj(F.silu(temb))[:, :, None, None]  # (B, C, 1, 1) broadcast over H, W
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int, num_heads: int, groups: int, attention: str):
        super().__init__()
        self.num_heads = num_heads
        self.attention = attention
        self.norm = _norm(groups, channels)
        # One 1x1 conv for q, k and v: one matmul instead of three. Each third is initialised
        # as the paper's separate q, k and v layers (fans C and C, not C and 3C).
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        for part in self.qkv.weight.data.chunk(3):
            variance_scaling_(part, fans=(channels, channels))
        nn.init.zeros_(self.qkv.bias)
        self.proj = _init(nn.Conv2d(channels, channels, 1), ZERO_INIT_SCALE)

    def forward(self, x):
        B, C, H, W = x.shape
        heads, head_dim = self.num_heads, C // self.num_heads
        tokens = self.qkv(self.norm(x)).flatten(2).transpose(1, 2)  # (B, HW, 3C), a view
        # The fused SDPA kernels (flash, memory-efficient, cuDNN) need a unit stride on the
        # last dimension, or SDPA falls back to the math kernel: channels-last gives it for
        # free, NCHW pays one copy of q, k and v together.
        channels_last = tokens.stride(-1) == 1
        if not channels_last:
            tokens = tokens.contiguous()
        q, k, v = tokens.unflatten(2, (3, heads, head_dim)).permute(2, 0, 3, 1, 4)  # each (B, heads, HW, head_dim)
        if self.attention == 'sdpa':
            h = F.scaled_dot_product_attention(q, k, v)
        else:
            weights = (q @ k.transpose(-1, -2)) * head_dim ** -0.5  # (B, heads, HW, HW)
            h = weights.softmax(dim=-1) @ v  # (B, heads, HW, head_dim)
        # Back in the input's layout (a mixed-layout conv pays for conversions): no copy in
        # channels-last with one head, one in NCHW.
        if channels_last:
            h = h.transpose(1, 2).reshape(B, H, W, C).permute(0, 3, 1, 2)  # (B, C, H, W), NHWC in memory
        else:
            h = h.transpose(-1, -2).reshape(B, C, H, W).contiguous()
        return x + self.proj(h)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = _init(nn.Conv2d(channels, channels, 3, stride=2, padding=0))

    def forward(self, x):
        # TF's 'SAME' padding for a stride-2 3x3 conv on an even size: one row and one
        # column of zeros, at the bottom and on the right only.
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # (B, C, H, W) -> (B, C, H/2, W/2)


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = _init(nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode='nearest'))  # (B, C, 2H, 2W)


class UNet(nn.Module):
    def __init__(self, config: UNetConfig):
        super().__init__()
        self.config = config
        ch, groups = config.base_channels, config.norm_groups
        temb_ch = 4 * ch
        self.temb = nn.Sequential(_init(nn.Linear(ch, temb_ch)), nn.SiLU(), _init(nn.Linear(temb_ch, temb_ch)))
        self.conv_in = _init(nn.Conv2d(config.in_channels, ch, 3, padding=1))

        def res(in_ch, out_ch):
            return ResBlock(in_ch, out_ch, temb_ch, config.dropout, groups)

        def attn(channels):
            return AttnBlock(channels, config.num_heads, groups, config.attention)

        # Down path: every block's output is kept for a skip connection.
        self.down = nn.ModuleList()
        skip_channels, in_ch, res_now = [ch], ch, config.image_size
        for level, mult in enumerate(config.channel_mults):
            out_ch = ch * mult
            for _ in range(config.blocks_per_level):
                use_attn = res_now in config.attn_resolutions
                self.down.append(nn.ModuleList([res(in_ch, out_ch)] + ([attn(out_ch)] if use_attn else [])))
                in_ch = out_ch
                skip_channels.append(in_ch)
            if level != len(config.channel_mults) - 1:
                self.down.append(Downsample(in_ch))
                skip_channels.append(in_ch)
                res_now //= 2

        self.mid = nn.ModuleList([res(in_ch, in_ch), attn(in_ch), res(in_ch, in_ch)])

        # Up path: one more block per level than the down path, each eating one skip.
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(config.channel_mults))):
            out_ch = ch * mult
            for _ in range(config.blocks_per_level + 1):
                use_attn = res_now in config.attn_resolutions
                self.up.append(nn.ModuleList([res(in_ch + skip_channels.pop(), out_ch)]
                                             + ([attn(out_ch)] if use_attn else [])))
                in_ch = out_ch
            if level != 0:
                self.up.append(Upsample(in_ch))
                res_now *= 2

        self.norm_out = _norm(groups, in_ch)
        self.conv_out = _init(nn.Conv2d(in_ch, config.in_channels, 3, padding=1), ZERO_INIT_SCALE)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x: (B, C, H, W) noisy images; t: (B,) integer timesteps. Returns predicted noise."""
        temb = self.temb(timestep_embedding(t, self.config.base_channels, x.dtype))  # (B, 4 * base)
        h = self.conv_in(x)  # (B, base, H, W)
        skips = [h]
        for block in self.down:
            h = _run(block, h, temb)
            skips.append(h)
        h = _run(self.mid, h, temb)
        for block in self.up:
            if not isinstance(block, Upsample):
                h = torch.cat([h, skips.pop()], dim=1)  # (B, C + C_skip, H, W)
            h = _run(block, h, temb)
        return self.conv_out(F.silu(self.norm_out(h)))  # (B, C_in, H, W)


def _run(block, h, temb):
    """Applies a down/mid/up entry: a sampler, or a list of (ResBlock, optional AttnBlock)."""
    if isinstance(block, (Downsample, Upsample)):
        return block(h)
    for layer in block:
        h = layer(h, temb) if isinstance(layer, ResBlock) else layer(h)
    return h


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_flops(config: UNetConfig, image_size: int = None, batch_size: int = 2) -> dict:
    """Exact FLOPs per image, counted by torch.utils.flop_counter.FlopCounterMode.

    Counts matmuls, convolutions and attention (2 FLOPs per multiply-add); normalisations
    and pointwise ops are not counted, as is usual for MFU. Runs on the meta device with the
    matmul-softmax-matmul attention, which has the same FLOPs as SDPA and is counted the same
    way on every torch version. Returns {'forward': ..., 'train': forward + backward}.
    """
    image_size = image_size or config.image_size
    with torch.device('meta'):
        model = UNet(replace(config, attention='manual'))
        x = torch.randn(batch_size, config.in_channels, image_size, image_size)
        t = torch.zeros(batch_size, dtype=torch.long)
    with FlopCounterMode(display=False) as forward_counter:
        out = model(x, t)
    with FlopCounterMode(display=False) as backward_counter:
        out.sum().backward()
    forward = forward_counter.get_total_flops() / batch_size
    backward = backward_counter.get_total_flops() / batch_size
    return {'forward': forward, 'train': forward + backward,
            'method': 'torch.utils.flop_counter.FlopCounterMode (attention included)'}


def count_torchinfo_flops(config: UNetConfig, image_size: int = None) -> dict:
    """torchinfo's multiply-adds x 2 x 3: the reference speedup table's method.

    torchinfo sees nn.Module layers only, so the attention matmuls are left out.
    """
    import torchinfo
    image_size = image_size or config.image_size
    model = UNet(config)
    x = torch.zeros(1, config.in_channels, image_size, image_size)
    t = torch.zeros(1, dtype=torch.long)
    macs = torchinfo.summary(model, input_data=[x, t], verbose=0).total_mult_adds
    return {'forward': 2 * macs, 'train': 6 * macs,
            'method': 'torchinfo total_mult_adds x 2 (x 3 for training; attention left out)'}


# ----------------------------------------------------------------------------- a step op by op

# Profiler kernel/op names -> what they do. First match wins; the optimizer goes first since
# its multi-tensor kernels are also elementwise.
CATEGORIES = [
    ('optimizer', r'adam|multi_tensor|foreach|lerp|clip_grad|vector_norm|_amp_'),
    ('attention', r'flash|fmha|attention|sdpa|softmax|bmm'),
    ('norm', r'norm|welford'),
    ('conv / matmul', r'conv|cudnn|implicit|xmma|cutlass|gemm|winograd|dgrad|wgrad|fprop|mm\b|addmm|matmul|sm\d\d_'),
    ('elementwise', r'elementwise|vectorized|triton_|silu|add|mul|copy|fill|cat|where|index|gather|reduce|'
                    r'sum|mean|div|sub|pow|exp|clamp|flip|unrolled'),
]


def categorise(name: str) -> str:
    lowered = name.lower()
    return next((category for category, pattern in CATEGORIES if re.search(pattern, lowered)), 'other')


# The profile's categories as the roofline names them (kernel names cannot tell a linear layer's
# GEMM from a 1x1 convolution's); 'data' is the loader's gather, flip and conversion.
ROOFLINE_CATEGORIES = {'conv / matmul': 'convolution and matmul', 'attention': 'attention', 'norm': 'normalisation',
                       'elementwise': 'elementwise and activation', 'other': 'elementwise and activation',
                       'optimizer': 'optimizer and EMA', 'data': 'data'}


def op_flops(func, args, kwargs, out) -> int:
    """FlopCounterMode's formula for an op; attention's backward as the four matmuls of its gradient,
    as FlopCounterMode counts attention written as matmuls (model.count_flops): the flash kernels'
    recompute of the scores is not the model's work."""
    name = func.__name__
    if name.startswith('_scaled_dot_product'):  # the CPU's flash kernels, and CUDA's
        q, k, v = args[1:4] if 'backward' in name else args[:3]
        return (2 if 'backward' in name else 1) * sdpa_flop_count(q.shape, k.shape, v.shape)
    formula = flop_registry.get(func._overloadpacket)
    return formula(*args, **kwargs, out_val=out) if formula else 0


def footprint(t: torch.Tensor) -> int:
    """Bytes a tensor argument covers: a broadcast (stride-0) dimension once."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st) * t.element_size() if t.numel() else 0


class StepCounter(TorchDispatchMode):
    """Every aten op below autograd, with real shapes and dtypes: its FLOPs (op_flops) and bytes, each
    tensor read or written once (a view or an allocation moves none, a gather reads what it returns,
    an in-place op reads and writes its tensor), and its category: 'data' until `phase` is 'step',
    then the network's by op name (categorise), and after the backward the optimizer's."""

    def __init__(self):
        super().__init__()
        self.ops, self.phase, self.backward_seen = [], 'data', False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != 'aten':
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage()._cdata for t in ins}
        fresh = [t for t in tree_leaves(out) if torch.is_tensor(t) and t.untyped_storage()._cdata not in storages]
        written = [t for a, v in zip(func._schema.arguments, args) if a.alias_info and a.alias_info.is_write
                   for t in tree_leaves(v) if torch.is_tensor(t)]
        reads = fresh + ins[1:] if func.__name__.startswith('index.') else ins  # a gather reads what it returns
        moved = bool(fresh or written) and not func.__name__.startswith(('empty', 'new_empty'))
        backward = torch._C._current_graph_task_id() != -1
        self.backward_seen |= backward
        category = categorise(str(func)) if self.phase == 'step' else self.phase
        self.ops.append({'op': str(func), 'flops': op_flops(func, args, kwargs or {}, out),
                         'bytes': sum(map(footprint, reads + written + fresh)) if moved else 0,
                         'category': 'optimizer and EMA' if self.backward_seen and not backward
                         else ROOFLINE_CATEGORIES[category]})
        return out


# Where CUDA's eager step differs from the CPU's: its autocast (ATen's autocast_mode.h) runs these in
# fp32 (the CPU's: in their input's dtype) and casts no cat or stack input; its dropout is one fused
# kernel (native_dropout), the CPU's a mask drawn, scaled and multiplied.
CUDA_FP32_OPS = (torch.ops.aten.group_norm.default, torch.ops.aten.upsample_nearest2d.default,
                 torch.ops.aten.softmax.int)


@contextlib.contextmanager
def cuda_policy():
    """The CPU's autocast and dropout made CUDA's (CUDA_FP32_OPS), for a count on CPU fake tensors:
    a backward on CUDA fake tensors needs a real CUDA context."""
    def fp32(op):
        def kernel(*args, **kwargs):  # as CUDA's autocast: half inputs cast, autocast off inside
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
                return op(*[a.float() if torch.is_tensor(a) and a.dtype in (torch.bfloat16, torch.float16) else a
                            for a in args], **kwargs)
        return kernel

    def dropout(x, p, train):  # ATen's is_fused_kernel_acceptable, as on CUDA
        fused = train and 0 < p < 1 and x.numel() > 0
        return torch.native_dropout(x, p, train)[0] if fused else torch.ops.aten.dropout.default.decompose(x, p, train)
    with torch.library._scoped_library('aten', 'IMPL') as lib:
        for op in CUDA_FP32_OPS:
            lib.impl(op, fp32(op), 'AutocastCPU')
        for name in ('cat', 'stack'):
            lib.impl(name, torch.library.fallthrough_kernel, 'AutocastCPU')
        lib.impl('dropout', dropout, 'AutogradCPU')
        yield


FUSED_AWAY = 'elementwise and activation'
FUSED_ASSUMPTIONS = ('elementwise and activation ops (SiLU, adds, casts, layout copies, padding, concatenation, '
                     'upsampling, dropout, the noise and the loss) move no bytes: each is folded into the kernel '
                     'that produces its input or consumes its output; convolutions, matmuls, attention and GroupNorm '
                     'read their inputs and write their outputs once, in the dtypes of the eager step; the data '
                     'path, the optimizer and the EMA are unchanged (train.py runs them outside the compiled graph)')


def roofline_bounds(ops: list, batch: int, tflops: float, gbs: float) -> dict:
    """Per category and in total: GFLOP and MB per image and the bound in ms per step, each op
    max(FLOPs / peak, bytes / bandwidth), summed: every op its own kernel ('eager'), the elementwise
    work fused away ('fused': FUSED_ASSUMPTIONS), the FLOPs alone; and the step's ceilings."""
    rows = {c: dict.fromkeys(('gflop_per_image', 'mb_per_image', 'eager_ms', 'fused_ms', 'flops_ms'), 0.0)
            for c in dict.fromkeys(ROOFLINE_CATEGORIES.values())}
    for op in ops:
        row, ms = rows[op['category']], 1e3 * max(op['flops'] / tflops / 1e12, op['bytes'] / gbs / 1e9)
        row['gflop_per_image'] += op['flops'] / batch / 1e9
        row['mb_per_image'] += op['bytes'] / batch / 1e6
        row['eager_ms'] += ms
        row['fused_ms'] += 0.0 if op['category'] == FUSED_AWAY else ms
        row['flops_ms'] += 1e3 * op['flops'] / tflops / 1e12
    total = {key: sum(row[key] for row in rows.values()) for key in rows[FUSED_AWAY]}
    return {'categories': rows, 'total': total,
            'cases': {case: ceiling(total[f'{case}_ms'], batch, total) for case in ('eager', 'fused', 'flops')}}


def ceiling(ms: float, batch: int, total: dict) -> dict:
    return {'ms_per_step': ms, 'img_per_s': 1e3 * batch / ms, 'mfu': total['flops_ms'] / ms}

"""The DDPM UNet (Ho et al., 2020, appendix B), its presets, FLOP counting, and its files: our
checkpoints (save, load and every compatibility check) and diffusers' UNet2DModel folders.

The network is the paper's (its TF code, diffusion_tf/models/unet.py): a sinusoidal
timestep embedding and a 2-layer MLP; residual blocks of GroupNorm(eps 1e-6), SiLU, 3x3
conv, the timestep embedding through a SiLU and a projection added, dropout, and a last
conv initialised at scale 1e-10; single-head self-attention at 16x16; strided-conv
downsampling padded like TF's 'SAME' (right and bottom); nearest-neighbour upsampling and
a conv; a skip connection from every down block; TF's variance-scaling initialisation.
diffusers' UNet2DModel in the configuration of google/ddpm-cifar10-32 is the same function
(tests/test_model.py checks it in float64), and `load_diffusers` reads its weights.
"""
import json
import math
import os
import sys
import zipfile
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from cli import ConfigError, atomic_open, brief, disk_full_error

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


# Dense (no sparsity) peak TFLOP/s by precision, from NVIDIA's data sheets. 'tf32' is what
# fp32 convolutions and matmuls reach when TF32 is allowed; 'fp32' is plain CUDA-core FP32.
GPU_PEAK_TFLOPS = {
    'H200': {'fp32': 67.0, 'tf32': 494.5, 'bf16': 989.5, 'fp16': 989.5},
    'H100 SXM': {'fp32': 67.0, 'tf32': 494.5, 'bf16': 989.5, 'fp16': 989.5},
    'H100 NVL': {'fp32': 60.0, 'tf32': 417.5, 'bf16': 835.5, 'fp16': 835.5},
    'H100 PCIe': {'fp32': 51.0, 'tf32': 378.0, 'bf16': 756.0, 'fp16': 756.0},
    'A100': {'fp32': 19.5, 'tf32': 156.0, 'bf16': 312.0, 'fp16': 312.0},
    'L40S': {'fp32': 91.6, 'tf32': 183.0, 'bf16': 362.05, 'fp16': 362.05},
    'A10G': {'fp32': 31.2, 'tf32': 62.5, 'bf16': 125.0, 'fp16': 125.0},
    'RTX 4090': {'fp32': 82.6, 'tf32': 82.6, 'bf16': 165.2, 'fp16': 165.2},
    'RTX 3090': {'fp32': 35.6, 'tf32': 35.6, 'bf16': 71.0, 'fp16': 71.0},
}
A100_PEAK_TFLOPS = GPU_PEAK_TFLOPS['A100']


def gpu_peak_key(device_name: str):
    """Maps a CUDA device name ('NVIDIA H100 80GB HBM3') to a GPU_PEAK_TFLOPS key, or None."""
    name = device_name.upper()
    if 'H200' in name:
        return 'H200'
    if 'H100' in name:
        if 'NVL' in name:
            return 'H100 NVL'
        return 'H100 PCIe' if 'PCIE' in name else 'H100 SXM'
    for key in ('A100', 'L40S', 'A10G', 'RTX 4090', 'RTX 3090'):
        if key.replace('RTX ', '') in name:
            return key
    return None


def precision_of(amp: str, device: torch.device) -> str:
    """The precision a run computes in, as GPU_PEAK_TFLOPS names it: its autocast dtype, else
    fp32, or tf32 where CUDA lets fp32 convolutions use TF32 tensor cores."""
    if amp != 'off':
        return amp
    return 'tf32' if device.type == 'cuda' and torch.backends.cudnn.allow_tf32 else 'fp32'


def peak_tflops(device_name: str, precision: str):
    """Dense peak for a device name and 'fp32' | 'tf32' | 'bf16' | 'fp16'; None if unknown."""
    key = gpu_peak_key(device_name)
    return GPU_PEAK_TFLOPS[key][precision] if key else None


# ----------------------------------------------------------------------------- diffusers

# UNet2DModel's defaults for the fields a config.json may leave out (diffusers 0.42).
_DIFFUSERS_DEFAULTS = {
    'in_channels': 3, 'out_channels': 3, 'center_input_sample': False, 'time_embedding_type': 'positional',
    'time_embedding_dim': None, 'freq_shift': 0, 'flip_sin_to_cos': True, 'mid_block_type': 'UNetMidBlock2D',
    'layers_per_block': 2, 'mid_block_scale_factor': 1, 'downsample_padding': 1, 'downsample_type': 'conv',
    'upsample_type': 'conv', 'dropout': 0.0, 'act_fn': 'silu', 'attention_head_dim': 8, 'norm_num_groups': 32,
    'attn_norm_num_groups': None, 'norm_eps': 1e-5, 'resnet_time_scale_shift': 'default', 'add_attention': True,
    'class_embed_type': None, 'num_class_embeds': None,
}
# What a UNet2DModel config must say to be the paper's network (the google/ddpm-cifar10-32 values).
_DIFFUSERS_REQUIRED = {
    'center_input_sample': False, 'time_embedding_type': 'positional', 'freq_shift': 1, 'flip_sin_to_cos': False,
    'mid_block_type': 'UNetMidBlock2D', 'mid_block_scale_factor': 1, 'downsample_padding': 0,
    'downsample_type': 'conv', 'upsample_type': 'conv', 'act_fn': 'silu', 'norm_eps': NORM_EPS,
    'resnet_time_scale_shift': 'default', 'add_attention': True, 'class_embed_type': None, 'num_class_embeds': None,
}


def diffusers_config(config: UNetConfig) -> dict:
    """The UNet2DModel(**kwargs) that computes the same function as UNet(config): for
    ddpm-cifar10, the configuration of the released google/ddpm-cifar10-32 model."""
    levels = range(len(config.channel_mults))
    has_attn = [config.image_size // 2 ** i in config.attn_resolutions for i in levels]
    channels = [config.base_channels * m for m in config.channel_mults]
    attn_channels = {c for c, a in zip(channels, has_attn) if a} | {channels[-1]}  # the middle has attention
    if config.num_heads > 1 and len(attn_channels) > 1:
        raise ValueError('diffusers sets heads per block from one head size: with several heads, every '
                         'attention block needs the same channel count')
    return dict(
        sample_size=config.image_size, in_channels=config.in_channels, out_channels=config.in_channels,
        block_out_channels=tuple(channels), layers_per_block=config.blocks_per_level,
        down_block_types=tuple('AttnDownBlock2D' if a else 'DownBlock2D' for a in has_attn),
        up_block_types=tuple('AttnUpBlock2D' if a else 'UpBlock2D' for a in reversed(has_attn)),
        attention_head_dim=None if config.num_heads == 1 else max(attn_channels) // config.num_heads,
        norm_num_groups=config.norm_groups, dropout=config.dropout, **_DIFFUSERS_REQUIRED)


class DiffusersConfigError(ValueError):
    """A UNet2DModel configuration that is not the paper's network."""


def config_from_diffusers(theirs: dict, attention: str = 'sdpa') -> UNetConfig:
    """Our UNetConfig for a UNet2DModel config.json, or DiffusersConfigError naming the field
    that our network cannot represent."""
    if not isinstance(theirs, dict):
        raise DiffusersConfigError(f'config.json holds a {type(theirs).__name__}, not a JSON object')
    if theirs.get('_class_name', 'UNet2DModel') != 'UNet2DModel':
        raise DiffusersConfigError(f"_class_name is {theirs['_class_name']!r}: only UNet2DModel is supported")
    get = lambda key: theirs.get(key, _DIFFUSERS_DEFAULTS.get(key))
    for key, wanted in _DIFFUSERS_REQUIRED.items():
        value = get(key)
        if value != wanted and not (isinstance(wanted, float) and isinstance(value, float)
                                    and math.isclose(value, wanted, rel_tol=1e-6)):
            raise DiffusersConfigError(f'{key}={value!r}: the paper\'s network needs {key}={wanted!r}')
    channels = list(get('block_out_channels') or ())
    down, up = list(get('down_block_types') or ()), list(get('up_block_types') or ())
    if not channels or any(c % channels[0] for c in channels):
        raise DiffusersConfigError(f'block_out_channels={channels!r}: each must be a multiple of the first')
    if set(down) - {'DownBlock2D', 'AttnDownBlock2D'} or len(down) != len(channels):
        raise DiffusersConfigError(f'down_block_types={down!r}: one DownBlock2D or AttnDownBlock2D per level')
    mirror = ['AttnUpBlock2D' if d == 'AttnDownBlock2D' else 'UpBlock2D' for d in reversed(down)]
    if up != mirror:
        raise DiffusersConfigError(f'up_block_types={up!r}: must mirror down_block_types ({mirror!r})')
    if get('in_channels') != get('out_channels'):
        raise DiffusersConfigError(f"out_channels={get('out_channels')!r}: must equal in_channels")
    if get('time_embedding_dim') not in (None, 4 * channels[0]):
        raise DiffusersConfigError(f"time_embedding_dim={get('time_embedding_dim')!r}: must be 4 x the first channels")
    if get('attn_norm_num_groups') not in (None, get('norm_num_groups')):
        raise DiffusersConfigError(f"attn_norm_num_groups={get('attn_norm_num_groups')!r}: must be norm_num_groups")
    size = get('sample_size')
    size = size[0] if isinstance(size, (list, tuple)) and len(set(size)) == 1 else size
    if not isinstance(size, int):
        raise DiffusersConfigError(f'sample_size={size!r}: a square size is needed')
    head_dim = get('attention_head_dim')
    attn_channels = {c for c, d in zip(channels, down) if d == 'AttnDownBlock2D'} | {channels[-1]}
    heads = {1} if head_dim is None else {c // head_dim for c in attn_channels}
    if len(heads) != 1 or (head_dim is not None and any(c % head_dim for c in attn_channels)):
        raise DiffusersConfigError(f'attention_head_dim={head_dim!r}: every attention block must have the same '
                                   f'number of heads (channels {sorted(attn_channels)})')
    try:
        return UNetConfig(image_size=size, in_channels=get('in_channels'), base_channels=channels[0],
                          channel_mults=tuple(c // channels[0] for c in channels),
                          blocks_per_level=get('layers_per_block'),
                          attn_resolutions=tuple(size // 2 ** i for i, d in enumerate(down) if d == 'AttnDownBlock2D'),
                          num_heads=heads.pop(), dropout=get('dropout'), norm_groups=get('norm_num_groups'),
                          attention=attention)
    except ValueError as error:
        raise DiffusersConfigError(str(error)) from None


def diffusers_module_names(model: UNet) -> list:
    """(our module, UNet2DModel's module) for every layer that holds weights, in order."""
    names = [('temb.0', 'time_embedding.linear_1'), ('temb.2', 'time_embedding.linear_2'), ('conv_in', 'conv_in')]
    for ours, theirs, sampler in (('down', 'down_blocks', 'downsamplers'), ('up', 'up_blocks', 'upsamplers')):
        level, index = 0, 0
        for i, block in enumerate(getattr(model, ours)):
            if isinstance(block, (Downsample, Upsample)):
                names.append((f'{ours}.{i}.conv', f'{theirs}.{level}.{sampler}.0.conv'))
                level, index = level + 1, 0
                continue
            names.append((f'{ours}.{i}.0', f'{theirs}.{level}.resnets.{index}'))
            if len(block) > 1:
                names.append((f'{ours}.{i}.1', f'{theirs}.{level}.attentions.{index}'))
            index += 1
    names += [('mid.0', 'mid_block.resnets.0'), ('mid.1', 'mid_block.attentions.0'), ('mid.2', 'mid_block.resnets.1'),
              ('norm_out', 'conv_norm_out'), ('conv_out', 'conv_out')]
    return names


_RESBLOCK_NAMES = {'norm1': 'norm1', 'conv1': 'conv1', 'temb_proj': 'time_emb_proj', 'norm2': 'norm2',
                   'conv2': 'conv2', 'skip': 'conv_shortcut'}
# Attention key names of diffusers checkpoints written before 0.15 (the released DDPM ones).
_OLD_ATTENTION_NAMES = {'query': 'to_q', 'key': 'to_k', 'value': 'to_v', 'proj_attn': 'to_out.0'}


def _weight_pairs(model: UNet) -> tuple:
    """(pairs, attention) for mapping weights between our UNet and UNet2DModel: (our key, their
    key) of every tensor that maps one to one, and (our module, theirs, channels) of each
    attention block, whose q, k and v projections ours fuses into one 1x1 conv."""
    pairs, attention = [], []
    for our_name, their_name in diffusers_module_names(model):
        module = model.get_submodule(our_name)
        if isinstance(module, ResBlock):
            parts = [(f'{our_name}.{a}', f'{their_name}.{b}') for a, b in _RESBLOCK_NAMES.items()
                     if not isinstance(getattr(module, a), nn.Identity)]
        elif isinstance(module, AttnBlock):
            attention.append((our_name, their_name, module.proj.weight.shape[0]))
            parts = [(f'{our_name}.norm', f'{their_name}.group_norm')]
        else:
            parts = [(our_name, their_name)]
        pairs += [(f'{a}.{p}', f'{b}.{p}') for a, b in parts for p in ('weight', 'bias')]
    return pairs, attention


def state_dict_from_diffusers(model: UNet, theirs: dict) -> dict:
    """A UNet2DModel state dict as our UNet's state dict (same function, our layout: the
    three attention projections fused into one 1x1 conv)."""
    theirs = {_new_attention_name(k): v for k, v in theirs.items()}
    used = set()

    def take(key):
        if key not in theirs:
            raise KeyError(f'the diffusers weights have no {key!r}')
        used.add(key)
        return theirs[key]

    pairs, attention = _weight_pairs(model)
    ours = {a: take(b) for a, b in pairs}
    for our_name, their_name, channels in attention:
        for p, shape in (('weight', (channels, channels, 1, 1)), ('bias', (channels,))):
            ours[f'{our_name}.qkv.{p}'] = torch.cat([take(f'{their_name}.to_{x}.{p}') for x in 'qkv']).reshape(
                (3 * channels, *shape[1:]))
            ours[f'{our_name}.proj.{p}'] = take(f'{their_name}.to_out.0.{p}').reshape(shape)
    unused = sorted(set(theirs) - used)
    if unused:
        raise KeyError(f'the diffusers weights hold tensors our network has no place for: {", ".join(unused[:5])}')
    return ours


def state_dict_to_diffusers(model: UNet) -> dict:
    """Our UNet's weights under UNet2DModel's names and shapes: the inverse of
    state_dict_from_diffusers (the fused q, k, v conv split into three linear layers)."""
    ours = model.state_dict()
    pairs, attention = _weight_pairs(model)
    theirs = {b: ours[a] for a, b in pairs}
    for our_name, their_name, channels in attention:
        for p, shape in (('weight', (channels, channels)), ('bias', (channels,))):
            for x, part in zip('qkv', ours[f'{our_name}.qkv.{p}'].chunk(3)):
                theirs[f'{their_name}.to_{x}.{p}'] = part.reshape(shape)
            theirs[f'{their_name}.to_out.0.{p}'] = ours[f'{our_name}.proj.{p}'].reshape(shape)
    return {k: v.detach().cpu().contiguous().clone() for k, v in theirs.items()}


def _new_attention_name(key: str) -> str:
    parts = key.split('.')
    if 'attentions' in parts and len(parts) >= 2 and parts[-2] in _OLD_ATTENTION_NAMES:
        return '.'.join(parts[:-2] + [_OLD_ATTENTION_NAMES[parts[-2]], parts[-1]])
    return key


DIFFUSERS_VERSION = '0.42.1'  # the diffusers whose DDPMPipeline.from_pretrained the export is tested with


def save_diffusers(model: UNet, schedule: str, num_steps: int, folder: str):
    """A diffusers DDPMPipeline folder that DDPMPipeline.from_pretrained loads: model_index.json,
    unet/ (config.json and diffusion_pytorch_model.safetensors) and scheduler/ (a DDPMScheduler of
    this schedule: 'linear' 1e-4..0.02 or 'cosine', T steps, fixed-large variance, clipped x_0,
    as the paper's sampler). Written beside `folder` and renamed: a folder appears whole. Raises
    ValueError when diffusers cannot represent the configuration."""
    from safetensors.torch import save_file
    unet = {'_class_name': 'UNet2DModel', '_diffusers_version': DIFFUSERS_VERSION, **diffusers_config(model.config)}
    betas = {'linear': {'beta_schedule': 'linear', 'beta_start': 1e-4, 'beta_end': 0.02},
             'cosine': {'beta_schedule': 'squaredcos_cap_v2'}}[schedule]
    scheduler = {'_class_name': 'DDPMScheduler', '_diffusers_version': DIFFUSERS_VERSION,
                 'num_train_timesteps': num_steps, **betas, 'trained_betas': None, 'variance_type': 'fixed_large',
                 'clip_sample': True, 'clip_sample_range': 1.0, 'prediction_type': 'epsilon', 'thresholding': False}
    index = {'_class_name': 'DDPMPipeline', '_diffusers_version': DIFFUSERS_VERSION,
             'scheduler': ['diffusers', 'DDPMScheduler'], 'unet': ['diffusers', 'UNet2DModel']}
    tmp = f'{folder.rstrip(os.sep)}.tmp-{os.getpid()}'
    os.makedirs(os.path.join(tmp, 'unet'))
    os.makedirs(os.path.join(tmp, 'scheduler'))
    for path, content in ((('model_index.json',), index), (('unet', 'config.json'), unet),
                          (('scheduler', 'scheduler_config.json'), scheduler)):
        with open(os.path.join(tmp, *path), 'w') as f:
            json.dump(content, f, indent=2)
    save_file(state_dict_to_diffusers(model), os.path.join(tmp, 'unet', 'diffusion_pytorch_model.safetensors'))
    os.replace(tmp, folder)


def _new_attention_name(key: str) -> str:
    parts = key.split('.')
    if 'attentions' in parts and len(parts) >= 2 and parts[-2] in _OLD_ATTENTION_NAMES:
        return '.'.join(parts[:-2] + [_OLD_ATTENTION_NAMES[parts[-2]], parts[-1]])
    return key


def diffusers_folder(path: str) -> str:
    """The folder holding a UNet2DModel's config.json: path itself, or path/unet (a pipeline)."""
    for folder in (path, os.path.join(path, 'unet')):
        if os.path.isfile(os.path.join(folder, 'config.json')):
            return folder
    raise FileNotFoundError(f'{path}: no config.json there or in {os.path.join(path, "unet")} '
                            f'(a diffusers UNet2DModel or pipeline folder is expected)')


def _read_weights(folder: str) -> dict:
    """The state dict of a UNet2DModel folder; a file that cannot be read is a DiffusersConfigError
    naming it (safetensors' and pickle's own errors would be tracebacks)."""
    safetensors = os.path.join(folder, 'diffusion_pytorch_model.safetensors')
    bin_path = os.path.join(folder, 'diffusion_pytorch_model.bin')
    if os.path.isfile(safetensors):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise DiffusersConfigError(f'{safetensors}: reading it needs the safetensors package '
                                       f'(pip install safetensors)') from None
        path, read = safetensors, load_file
    elif os.path.isfile(bin_path):
        path, read = bin_path, lambda p: torch.load(p, map_location='cpu', weights_only=True)
    else:
        raise FileNotFoundError(f'{folder}: neither diffusion_pytorch_model.safetensors nor .bin is there')
    try:
        weights = read(path)
    except Exception as error:
        raise DiffusersConfigError(f'{path}: not readable weights ({brief(error)})') from None
    if not isinstance(weights, dict):
        raise DiffusersConfigError(f'{path}: holds a {type(weights).__name__}, not a state dict')
    return weights


def load_diffusers(path: str, attention: str = 'sdpa') -> UNet:
    """Our UNet with the weights of a diffusers UNet2DModel saved by save_pretrained (a folder
    with config.json and diffusion_pytorch_model.safetensors or .bin), or of a pipeline folder
    with one under unet/ (the layout of google/ddpm-cifar10-32). Raises DiffusersConfigError
    naming the field when the configuration is not the paper's network, FileNotFoundError
    when files are missing. The model is returned in float32, in eval mode."""
    folder = diffusers_folder(path)
    with open(os.path.join(folder, 'config.json')) as f:
        config = config_from_diffusers(json.load(f), attention)
    model = UNet(config)
    model.load_state_dict(state_dict_from_diffusers(model, _read_weights(folder)))
    return model.float().eval()


# ----------------------------------------------------------------------------- checkpoints

# The one checkpoint format, of train.py, sample.py and benchmark.py: a dict that loads with
# torch.load(weights_only=True) and holds plain state dicts 'model' and 'ema', the run's
# 'config' and 'model_config' (as dicts), 'model_version', and what an exact resume needs:
# 'optimizer', 'scaler', 'step', 'epoch', 'batch_in_epoch', 'rng' (one entry per rank), 'data'
# (image count and fingerprint), 'train_seconds' and 'eval_owed'. train.checkpoint_state
# writes it, train.restore reads it back.
CHECKPOINT_REQUIRED = ('model', 'ema', 'config', 'model_config')
RESUME_REQUIRED = ('optimizer', 'scaler', 'step', 'epoch', 'batch_in_epoch', 'rng')  # and an exact resume these
# The resume rule. A resumed run replays the settings given to the run (its 'flags'), with those
# given at the resume on top, except where it resumes from and where its files go (by default
# the checkpoint's folder). Given with another value: refused (an exact resume needs them), or
# applied with a warning (the run then differs from an uninterrupted one), or applied (the rest:
# length, logging, outputs, speed). Settings that 'auto' resolves per device are resolved again.
NOT_REPLAYED = ('resume', 'out_dir')
RESUME_MUST_MATCH = ('preset', 'dataset', 'image_size', 'shapes_count', 'batch_size', 'seed', 'schedule', 'dropout')
CHANGED_WITH_WARNING = ('lr', 'warmup', 'grad_clip', 'ema_decay', 'amp')
RESOLVED_PER_DEVICE = ('amp', 'compile', 'channels_last', 'fused_adam', 'loader')


def resume_path(resume: str, out_dir: str) -> str:
    """What train.py --resume means: 'auto' is OUT_DIR/ckpt.pt when it exists and a fresh run
    otherwise. A fresh run never overwrites a checkpoint (nor appends to another run's
    metrics.jsonl), and a run is never resumed into another run's folder."""
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    if resume == 'auto':
        return ckpt_path if os.path.isfile(ckpt_path) else ''
    if not resume and os.path.isfile(ckpt_path):
        raise ConfigError(f'{ckpt_path} exists: continue that run with --resume {ckpt_path} (or --resume auto), '
                          f'or pass another --out-dir')
    if resume and os.path.isfile(resume) and not zipfile.is_zipfile(resume):
        raise ConfigError(f'--resume {resume}: not a train.py checkpoint (not a file written by torch.save)')
    if resume and os.path.isfile(resume) and os.path.isfile(ckpt_path) and not os.path.samefile(resume, ckpt_path):
        raise ConfigError(f'--resume {resume} into --out-dir {out_dir}, which holds {ckpt_path} (another run\'s, '
                          f'or a later one of this run) that the resumed run would overwrite: pass another --out-dir')
    return resume


def resume_settings(cfg, given: set) -> tuple:
    """(config, flags, checkpoint or None) of train.py's config `cfg` whose fields `given` were
    set on the command line. A resumed run replays the checkpoint's flags with the given ones on
    top, so `train.py --resume PATH` alone continues the run as it was, in PATH's folder; `flags`
    is what the next checkpoint saves for the next resume."""
    if cfg.resume not in ('', 'auto') and 'out_dir' not in given:
        cfg = replace(cfg, out_dir=os.path.dirname(cfg.resume) or '.')
    cfg = replace(cfg, resume=resume_path(cfg.resume, cfg.out_dir))
    now = {name: getattr(cfg, name) for name in sorted(given) if name not in NOT_REPLAYED}
    if not cfg.resume:
        return cfg, now, None
    ckpt = read_checkpoint(cfg.resume, f'--resume {cfg.resume}')
    saved = ckpt.get('flags')
    if saved is None:  # a checkpoint from before flags were saved: its settings, less those resolved per device
        saved = {k: v for k, v in ckpt['config'].items() if k not in NOT_REPLAYED + RESOLVED_PER_DEVICE}
    saved = dict(saved)
    if 'epochs' in given and 'steps' not in given:
        saved.pop('steps', None)  # --epochs given now sets the length; a replayed --steps would win over it
    moved = os.path.realpath(str(ckpt['config'].get('out_dir'))) != os.path.realpath(cfg.out_dir)
    if moved and 'samples_dir' not in given:  # a copy resumed elsewhere keeps its grids in its own folder
        saved['samples_dir'] = os.path.join(cfg.out_dir, 'samples')
    flags = {k: v for k, v in {**saved, **now}.items() if k in {f.name for f in fields(cfg)}}
    return type(cfg)(**flags, resume=cfg.resume, out_dir=cfg.out_dir), flags, ckpt


def warn_of_changes(ckpt: dict, cfg):
    """A warning for each CHANGED_WITH_WARNING setting of the resumed run (resolved) that
    differs from the checkpoint's."""
    for name in CHANGED_WITH_WARNING:
        if ckpt['config'].get(name) != getattr(cfg, name):
            print(f"warning: --{name.replace('_', '-')} {getattr(cfg, name)} (the checkpoint's: "
                  f"{ckpt['config'][name]}): the resumed run trains on with it, and will differ from an uninterrupted "
                  f"one", file=sys.stderr)


def already_done(ckpt: dict, cfg) -> dict | None:
    """If the checkpoint holds the run's last step (--steps, or --epochs whole epochs), says so
    and returns the result of a run with nothing left to do; else None (also when an evaluation
    cut short by a stop is owed: the resumed run runs it)."""
    if ((ckpt['step'] < cfg.steps) if cfg.steps else (ckpt['epoch'] < cfg.epochs)) or (
            ckpt.get('eval_owed') and cfg.eval_every):
        return None
    target = f'--steps {cfg.steps}' if cfg.steps else f'--epochs {cfg.epochs}'
    past = ckpt['step'] > cfg.steps if cfg.steps else (ckpt['epoch'], ckpt['batch_in_epoch']) > (cfg.epochs, 0)
    print(f"{cfg.resume} holds step {ckpt['step']} (epoch {ckpt['epoch']}, batch {ckpt['batch_in_epoch']}), "
          f"{'past' if past else 'at'} the target {target}: nothing to train. Raise {target.split()[0]} to "
          f"train on.", flush=True)
    return {'step': ckpt['step'], 'stopped': None, 'last': {}, 'checkpoint': cfg.resume, 'already_done': True}


def save_checkpoint(state: dict, path: str):
    """torch.save through a temporary file and a rename: a crash mid-write leaves the previous
    checkpoint whole, and a failed write (a full disk) leaves no partial file and is an OSError
    (torch's writer reports it as a RuntimeError)."""
    try:
        with atomic_open(path, 'wb') as f:
            torch.save(state, f)
    except RuntimeError as error:
        raise disk_full_error(path, error) from None


def read_checkpoint(path: str, what: str) -> dict:
    """A checkpoint, loaded without running code from the file. Anything else (no file, junk, a
    dict of something else, a checkpoint of the network before it was made the paper's) is a
    one-line ConfigError starting with `what` (such as '--resume PATH')."""
    if not os.path.isfile(path):
        raise ConfigError(f'{what}: no such checkpoint')
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
        raise ConfigError(f'{what}: not a train.py checkpoint (not a file written by torch.save)')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as error:
        raise ConfigError(f'{what}: not a train.py checkpoint (cannot load it: {brief(error)})') from None
    if not isinstance(ckpt, dict) or not set(CHECKPOINT_REQUIRED) <= set(ckpt):
        raise ConfigError(f'{what}: not a train.py checkpoint (it lacks the model, EMA or config)')
    # Version 1 (no SiLU before the timestep projections, symmetric downsampling padding,
    # GroupNorm eps 1e-5) has the same tensors but computes another function.
    version = ckpt.get('model_version', 1)
    if version != MODEL_VERSION:
        raise ConfigError(f'{what}: written for UNet version {version}, and model.py is version {MODEL_VERSION} '
                          f'(the paper\'s network); its weights do not compute the same function, so retrain')
    return ckpt


def checkpoint_model_config(ckpt: dict, what: str) -> UNetConfig:
    try:
        return UNetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in ckpt['model_config'].items()})
    except (TypeError, ValueError, AttributeError) as error:
        raise ConfigError(f'{what}: not a train.py checkpoint (its model_config: {brief(error)})') from None


def model_from_checkpoint(ckpt: dict, weights: str, what: str) -> UNet:
    """The UNet of a checkpoint with its 'ema' or 'model' weights, in eval mode on the CPU."""
    if ckpt.get(weights) is None:
        raise ConfigError(f'{what} holds no {weights} weights')
    model = UNet(checkpoint_model_config(ckpt, what))
    try:
        model.load_state_dict(ckpt[weights])
    except (RuntimeError, TypeError, AttributeError) as error:
        raise ConfigError(f'{what}: its {weights} weights do not fit its model_config ({brief(error, 300)})') from None
    return model.eval()


def check_resumable(ckpt: dict, what: str, config: dict, model_config: UNetConfig, world_size: int):
    """An exact resume needs the same architecture, the same RESUME_MUST_MATCH settings and the
    same number of ranks (one RNG state each). Checked before any data is loaded."""
    missing = [key for key in RESUME_REQUIRED if key not in ckpt]
    if missing:
        raise ConfigError(f'{what}: not a complete train.py checkpoint (it lacks {", ".join(missing)})')
    diffs = architecture_differences(ckpt['model_config'], model_config)
    if diffs:
        raise ConfigError(f'{what}: the checkpoint is another architecture: {", ".join(diffs)}')
    for weights in ('model', 'ema'):
        if ckpt[weights] is not None and not all(t.isfinite().all() for t in ckpt[weights].values()):
            raise ConfigError(f'{what}: its {weights} weights are not finite (NaN or inf): resume an earlier '
                              f'checkpoint')
    try:
        saved, ranks = ckpt['config'], len(ckpt['rng'])
        differing = [name for name in RESUME_MUST_MATCH if saved[name] != config[name]]
    except (KeyError, TypeError) as error:
        raise ConfigError(f'{what}: not a complete train.py checkpoint ({brief(error)})') from None
    for name in differing:
        raise ConfigError(f'{what}: the checkpoint has --{name.replace("_", "-")} {saved[name]}, this run '
                          f'{config[name]}; an exact resume needs the same value')
    if ranks != world_size:
        raise ConfigError(f'{what}: written by {ranks} ranks, this run has {world_size}')


def check_same_data(ckpt: dict, what: str, data_identity: dict, data_dir: str):
    """An exact resume needs the same images: the checkpoint's image count and fingerprint
    (data.fingerprint) against those of the data set loaded now."""
    saved = ckpt.get('data')
    if saved is None:
        return  # a checkpoint from before fingerprints: the settings check is all there is
    if saved != data_identity:
        raise ConfigError(f"{what}: the checkpoint was trained on another data set ({saved['count']} images, "
                          f"fingerprint {saved['fingerprint'][:12]}); {data_dir} has {data_identity['count']} "
                          f"images, fingerprint {data_identity['fingerprint'][:12]}")


def architecture_differences(theirs, config: UNetConfig) -> list:
    """'field=theirs (now ours)' for every field of the network in which a saved model_config
    (a dict) differs from `config`; attention and dropout hold no weights and may differ."""
    theirs = theirs if isinstance(theirs, dict) else {}
    return [f'{k}={theirs.get(k)!r} (now {v!r})' for k, v in asdict(config).items()
            if _plain(theirs.get(k)) != _plain(v) and k not in ('attention', 'dropout')]


def initial_weights(path: str, config: UNetConfig) -> dict:
    """The state dict that train.py --init-from starts from: a checkpoint of ours (its EMA weights)
    or a diffusers UNet2DModel / pipeline folder, refused with one line unless it is the network
    of `config`."""
    what = f'--init-from {path}'
    if os.path.isdir(path):
        try:
            model = load_diffusers(path)
        except (DiffusersConfigError, OSError, KeyError, ValueError, RuntimeError) as error:
            raise ConfigError(f"{what}: cannot load it as the paper's UNet ({brief(error, 300)})") from None
        theirs = asdict(model.config)
    else:
        ckpt = read_checkpoint(path, what)
        model, theirs = model_from_checkpoint(ckpt, 'ema', what), ckpt['model_config']
    diffs = architecture_differences(theirs, config)
    if diffs:
        raise ConfigError(f'{what}: another architecture than --preset and --image-size give: {", ".join(diffs)}')
    return model.state_dict()


def _plain(value):
    return list(value) if isinstance(value, tuple) else value

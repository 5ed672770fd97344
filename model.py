"""The DDPM UNet (Ho et al., 2020, appendix B), its presets, and FLOP counting.

Architecture as in the paper's CIFAR-10 model: a sinusoidal timestep embedding and MLP,
residual blocks (GroupNorm, SiLU, 3x3 conv, timestep projection, dropout, zero-initialised
last conv), single-head self-attention at 16x16, and a UNet with skip connections between
every down and up block. `PRESETS['ddpm-cifar10']` has the paper's 35.7M parameters.
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode


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


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of integer timesteps (Vaswani et al. 2017, as in DDPM's code)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / (half - 1))
    angles = t.float()[:, None] * freqs[None, :]  # (B, half)
    return torch.cat([angles.sin(), angles.cos()], dim=1)  # (B, dim)


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, temb_ch: int, dropout: float, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.temb_proj = nn.Linear(temb_ch, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        # Zero init makes every block start as the identity (paper's code: init_scale=0).
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb_proj(temb)[:, :, None, None]  # (B, C, 1, 1) broadcast over H, W
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int, num_heads: int, groups: int, attention: str):
        super().__init__()
        self.num_heads = num_heads
        self.attention = attention
        self.norm = nn.GroupNorm(groups, channels)
        # One 1x1 conv for q, k and v: same parameters as three, one matmul instead of three.
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        B, C, H, W = x.shape
        heads, head_dim = self.num_heads, C // self.num_heads
        qkv = self.qkv(self.norm(x)).reshape(B, 3, heads, head_dim, H * W)
        q, k, v = qkv.transpose(-1, -2).unbind(1)  # each (B, heads, HW, head_dim)
        if self.attention == 'sdpa':
            h = F.scaled_dot_product_attention(q, k, v)
        else:
            weights = (q @ k.transpose(-1, -2)) * head_dim ** -0.5  # (B, heads, HW, HW)
            h = weights.softmax(dim=-1) @ v  # (B, heads, HW, head_dim)
        h = h.transpose(-1, -2).reshape(B, C, H, W)
        return x + self.proj(h)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode='nearest'))


class UNet(nn.Module):
    def __init__(self, config: UNetConfig):
        super().__init__()
        self.config = config
        ch, groups = config.base_channels, config.norm_groups
        temb_ch = 4 * ch
        self.temb = nn.Sequential(nn.Linear(ch, temb_ch), nn.SiLU(), nn.Linear(temb_ch, temb_ch))
        self.conv_in = nn.Conv2d(config.in_channels, ch, 3, padding=1)

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

        self.norm_out = nn.GroupNorm(groups, in_ch)
        self.conv_out = nn.Conv2d(in_ch, config.in_channels, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x: (B, C, H, W) noisy images; t: (B,) integer timesteps. Returns predicted noise."""
        temb = self.temb(timestep_embedding(t, self.config.base_channels))  # (B, 4 * base)
        h = self.conv_in(x)
        skips = [h]
        for block in self.down:
            h = _run(block, h, temb)
            skips.append(h)
        h = _run(self.mid, h, temb)
        for block in self.up:
            if not isinstance(block, Upsample):
                h = torch.cat([h, skips.pop()], dim=1)  # (B, C + C_skip, H, W)
            h = _run(block, h, temb)
        return self.conv_out(F.silu(self.norm_out(h)))


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


def peak_tflops(device_name: str, precision: str):
    """Dense peak for a device name and 'fp32' | 'tf32' | 'bf16' | 'fp16'; None if unknown."""
    key = gpu_peak_key(device_name)
    return GPU_PEAK_TFLOPS[key][precision] if key else None

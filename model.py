"""The DDPM UNet (Ho et al., 2020, appendix B), its presets and FLOP counting: the network alone.

The paper's TF network (diffusion_tf/models/unet.py): a sinusoidal timestep embedding and a
2-layer MLP; residual blocks of GroupNorm(eps 1e-6), SiLU, 3x3 conv, the timestep embedding
through a SiLU and a projection added, dropout, a last conv initialised at scale 1e-10;
single-head self-attention at 16x16; strided-conv downsampling padded like TF's 'SAME';
nearest-neighbour upsampling and a conv; a skip from every down block; TF's variance-scaling
initialisation. diffusers' UNet2DModel (google/ddpm-cifar10-32) is the same function, checked in
float64 by tests/test_model.py. Files: checkpoint.py (ours), diffusers_io.py (diffusers').
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

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

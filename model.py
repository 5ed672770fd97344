"""The DDPM UNet (Ho et al., 2020, appendix B), its presets and FLOP counting: the network alone.

The paper's TF network (diffusion_tf/models/unet.py): a sinusoidal timestep embedding and a
2-layer MLP; residual blocks of GroupNorm(eps 1e-6), SiLU, 3x3 conv, the timestep embedding
through a SiLU and a projection added, dropout, a last conv initialised at scale 1e-10;
single-head self-attention at 16x16; strided-conv downsampling padded like TF's 'SAME';
nearest-neighbour upsampling and a conv; a skip from every down block; TF's variance-scaling
initialisation. diffusers' UNet2DModel (google/ddpm-cifar10-32) is the same function, checked in
float64 by tests/test_model.py. Files: checkpoint.py (ours), diffusers_io.py (diffusers').
"""
import functools
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
    num_classes: int = 0  # > 0: class-conditional, with one more embedding for 'no class' (guidance)
    fused_norm: bool = False  # GroupNorm (+ add, + SiLU) as one Triton kernel (kernels.py); no GPU measurement yet

    def __post_init__(self):
        if self.attention not in ('sdpa', 'manual'):
            raise ValueError(f"attention must be 'sdpa' or 'manual', got {self.attention!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f'dropout must be in [0, 1), got {self.dropout}')
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 0:
            raise ValueError(f'num_classes must be an integer >= 0, got {self.num_classes!r}')
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


def norm_act(norm: nn.GroupNorm, x: torch.Tensor, fused: bool, silu: bool = True, add: torch.Tensor = None):
    """silu(norm(x + add[:, :, None, None])), the SiLU and the add optional: PyTorch's ops, or with
    `fused` one kernel that reads and writes the activation once (kernels.group_norm_act: Triton on
    CUDA, the same ops elsewhere)."""
    if fused:
        from kernels import group_norm_act  # Triton is imported only where the kernel is asked for
        return group_norm_act(x, norm.weight, norm.bias, norm.num_groups, norm.eps, add, silu)
    if add is not None:
        x = x + add[:, :, None, None]  # (B, C, 1, 1) broadcast over H, W
    x = norm(x)
    return F.silu(x) if silu else x


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, temb_ch: int, dropout: float, groups: int, fused_norm: bool = False):
        super().__init__()
        self.fused_norm = fused_norm
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
        h = self.conv1(norm_act(self.norm1, x, self.fused_norm))
        h = norm_act(self.norm2, h, self.fused_norm, add=self.temb_proj(F.silu(temb)))  # the timestep added first
        h = self.conv2(self.dropout(h))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int, num_heads: int, groups: int, attention: str, fused_norm: bool = False):
        super().__init__()
        self.fused_norm = fused_norm
        self.num_heads = num_heads
        self.attention = attention
        self.norm = _norm(groups, channels)
        # q, k and v as one matmul in token layout, as diffusers' Linear layers (the paper's 1x1 'nin'
        # layers are the same function). Each third is initialised as the paper's separate q, k and v.
        self.qkv = nn.Linear(channels, 3 * channels)
        for part in self.qkv.weight.data.chunk(3):
            variance_scaling_(part, fans=(channels, channels))
        nn.init.zeros_(self.qkv.bias)
        self.proj = _init(nn.Linear(channels, channels), ZERO_INIT_SCALE)
        self._register_load_state_dict_pre_hook(_conv_weights_as_linear)

    def forward(self, x):
        B, C, H, W = x.shape
        heads, head_dim = self.num_heads, C // self.num_heads
        # Token layout without a copy: in NCHW a transposed view that the matmul reads as it is; in
        # channels-last already (B, HW, C) in memory.
        tokens = norm_act(self.norm, x, self.fused_norm, silu=False).flatten(2).transpose(1, 2)  # (B, HW, C)
        qkv = self.qkv(tokens)  # (B, HW, 3C), contiguous: q, k and v get the unit last stride SDPA's kernels need
        q, k, v = qkv.unflatten(2, (3, heads, head_dim)).permute(2, 0, 3, 1, 4)  # each (B, heads, HW, head_dim)
        if self.attention == 'sdpa':
            h = F.scaled_dot_product_attention(q, k, v)
        else:
            weights = (q @ k.transpose(-1, -2)) * head_dim ** -0.5  # (B, heads, HW, HW)
            h = weights.softmax(dim=-1) @ v  # (B, heads, HW, head_dim)
        h = self.proj(h.transpose(1, 2).reshape(B, H * W, C))  # (B, HW, C); a view with one head
        # Back to (B, C, H, W) as a view (NHWC in memory): the layout change is folded into the residual add.
        return x + h.transpose(1, 2).unflatten(2, (H, W))


def _conv_weights_as_linear(state_dict, prefix, *args):
    """Checkpoints written when q, k, v and the output projection were 1x1 convs, (out, in, 1, 1):
    the same numbers as the Linear layers' (out, in) weights."""
    for name in ('qkv.weight', 'proj.weight'):
        weight = state_dict.get(prefix + name)
        if weight is not None and weight.dim() == 4 and weight.shape[2:] == (1, 1):
            state_dict[prefix + name] = weight.flatten(1)


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
        # Class-conditional: an embedding per class and one for 'no class' (index num_classes), added to
        # the timestep embedding (diffusers' UNet2DModel with num_class_embeds; initialised as its N(0, 1)).
        self.class_emb = nn.Embedding(config.num_classes + 1, temb_ch) if config.num_classes else None
        self.conv_in = _init(nn.Conv2d(config.in_channels, ch, 3, padding=1))

        def res(in_ch, out_ch):
            return ResBlock(in_ch, out_ch, temb_ch, config.dropout, groups, config.fused_norm)

        def attn(channels):
            return AttnBlock(channels, config.num_heads, groups, config.attention, config.fused_norm)

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

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor = None) -> torch.Tensor:
        """x: (B, C, H, W) noisy images; t: (B,) integer timesteps; labels: (B,) classes of a
        class-conditional network (num_classes: 'no class'; None: no class for all). Returns the
        network's prediction (the noise, or v)."""
        temb = self.temb(timestep_embedding(t, self.config.base_channels, x.dtype))  # (B, 4 * base)
        if self.class_emb is not None:
            if labels is None:
                labels = torch.full((x.shape[0],), self.config.num_classes, device=x.device, dtype=torch.long)
            temb = temb + self.class_emb(labels).to(temb.dtype)
        elif labels is not None:
            raise ValueError('labels given to an unconditional network (num_classes=0)')
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
        return self.conv_out(norm_act(self.norm_out, h, self.config.fused_norm))  # (B, C_in, H, W)


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
    forward, train = _counted_flops(config, image_size or config.image_size, batch_size)
    return {'forward': forward, 'train': train,
            'method': 'torch.utils.flop_counter.FlopCounterMode (attention included)'}


@functools.lru_cache(maxsize=None)  # a process that builds many runs (a ladder, benchmark rows) counts once: ~1 s each
def _counted_flops(config: UNetConfig, image_size: int, batch_size: int) -> tuple:
    with torch.device('meta'):
        model = UNet(replace(config, attention='manual'))
        x = torch.randn(batch_size, config.in_channels, image_size, image_size)
        t = torch.zeros(batch_size, dtype=torch.long)
    with FlopCounterMode(display=False) as forward_counter:
        out = model(x, t)
    with FlopCounterMode(display=False) as backward_counter:
        out.sum().backward()
    forward = forward_counter.get_total_flops() / batch_size
    return forward, forward + backward_counter.get_total_flops() / batch_size


def count_torchinfo_flops(config: UNetConfig, image_size: int = None) -> dict:
    """torchinfo's multiply-adds x 2 x 3: the reference speedup table's method.

    torchinfo sees nn.Module layers only, so the attention matmuls are left out, and it counts a
    Linear layer's multiply-adds once per image, so the attention's q, k, v and output projections
    (Linear layers over HW tokens) count 1/HW of their work: 11.44 GFLOP forward for ddpm-cifar10,
    where the same network with 1x1 convs there counted 12.12.
    """
    import torchinfo
    image_size = image_size or config.image_size
    model = UNet(config)
    x = torch.zeros(1, config.in_channels, image_size, image_size)
    t = torch.zeros(1, dtype=torch.long)
    macs = torchinfo.summary(model, input_data=[x, t], verbose=0).total_mult_adds
    return {'forward': 2 * macs, 'train': 6 * macs,
            'method': 'torchinfo total_mult_adds x 2 (x 3 for training; attention left out, its projections '
                      'counted once per image)'}

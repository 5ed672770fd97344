import pytest
import torch
import torch.nn as nn

from devices import gpu_peak_key, peak_tflops
from model import PRESETS, AttnBlock, UNet, count_flops, count_params, count_torchinfo_flops, get_config


@pytest.mark.parametrize('preset', list(PRESETS))
def test_output_shape_every_preset(preset):
    model = UNet(PRESETS[preset]).eval()
    x = torch.randn(2, 3, 32, 32)
    out = model(x, torch.tensor([0, 999]))
    assert out.shape == x.shape
    assert torch.isfinite(out).all()


def test_paper_parameter_count():
    # Ho et al. (2020), appendix B: 35.7M parameters for the CIFAR-10 model.
    assert count_params(UNet(PRESETS['ddpm-cifar10'])) == 35_746_307


def test_small_and_tiny_sizes():
    assert 8.5e6 < count_params(UNet(PRESETS['small'])) < 9.5e6
    assert count_params(UNet(PRESETS['tiny'])) < 0.5e6


def test_other_image_sizes_and_heads():
    config = get_config('tiny', image_size=16, num_heads=2)
    out = UNet(config)(torch.randn(1, 3, 16, 16), torch.tensor([5]))
    assert out.shape == (1, 3, 16, 16)


def test_image_size_that_cannot_be_halved_is_rejected():
    with pytest.raises(ValueError, match='cannot be halved'):
        get_config('ddpm-cifar10', image_size=36)


def test_unknown_preset():
    with pytest.raises(KeyError, match='unknown preset'):
        get_config('huge')


def _perturbed(model):
    # Zero-initialised output layers make attention an identity at init: perturb them so the
    # comparison exercises the attention maths.
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize('heads', [1, 2])
def test_sdpa_and_manual_attention_agree(heads):
    torch.manual_seed(0)
    sdpa = _perturbed(UNet(get_config('tiny', num_heads=heads, attention='sdpa')).eval())
    manual = UNet(get_config('tiny', num_heads=heads, attention='manual')).eval()
    manual.load_state_dict(sdpa.state_dict())
    x, t = torch.randn(3, 3, 32, 32), torch.tensor([1, 500, 999])
    # float32 with different reduction orders: agreement to 1e-5 relative to the output scale.
    a, b = sdpa(x, t), manual(x, t)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    assert a.abs().max() > 0.1  # the perturbation made the output non-trivial


def _attention_by_hand(block, x):
    """softmax(q k^T / sqrt(d)) v per head, written out in float64 from the block's weights."""
    B, C, H, W = x.shape
    heads = block.num_heads
    h = block.norm.double()(x.double()).flatten(2)  # (B, C, HW)
    weight, bias = block.qkv.weight.double(), block.qkv.bias.double()
    q, k, v = (torch.einsum('oc,bcn->bon', w, h) + b[:, None] for w, b in zip(weight.chunk(3), bias.chunk(3)))
    q, k, v = (t.unflatten(1, (heads, C // heads)) for t in (q, k, v))  # (B, heads, d, HW)
    weights = torch.einsum('bhdn,bhdm->bhnm', q, k).mul((C // heads) ** -0.5).softmax(-1)
    out = torch.einsum('bhnm,bhdm->bhdn', weights, v).reshape(B, C, H, W)
    block.norm.float()
    return x.double() + torch.einsum('oc,bchw->bohw', block.proj.weight.double(), out) + block.proj.bias.double()[
        :, None, None]


@pytest.mark.parametrize('heads', [1, 2])
@pytest.mark.parametrize('memory_format', [torch.contiguous_format, torch.channels_last])
def test_attention_runs_on_the_fused_kernel_in_both_layouts(heads, memory_format):
    # Fused SDPA kernels need q, k and v with a unit last stride; flash is the CPU's fused one.
    # Restricted to it, the block must run in NCHW and NHWC, equal the math kernel and the
    # closed form, and keep the layout it was given; the projection works in token layout.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    block = _perturbed(AttnBlock(32, heads, 8, 'sdpa')).eval()
    x = torch.randn(2, 32, 8, 8).contiguous(memory_format=memory_format)
    layouts = []  # the attention's output reaches the projection as (B, HW, C) tokens, C contiguous
    block.proj.register_forward_pre_hook(lambda _, args: layouts.append(args[0].shape == (2, 64, 32)
                                                                        and args[0].stride(-1) == 1))
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fused = block(x)
        with sdpa_kernel(SDPBackend.MATH):
            math = block(x)
        expected = _attention_by_hand(block, x)
    assert torch.allclose(fused, math, atol=1e-5) and torch.allclose(fused.double(), expected, atol=1e-5)
    assert (fused - x).abs().max() > 0.1  # the attention contributes
    assert fused.is_contiguous(memory_format=memory_format) and all(layouts)


@pytest.mark.parametrize('heads', [1, 2])
@pytest.mark.parametrize('memory_format', [torch.contiguous_format, torch.channels_last])
def test_attention_output_reaches_the_residual_add_as_a_view_of_the_projection(heads, memory_format):
    # The token-layout rewrite removed a copy back to NCHW after the projection; the GPU step's speed
    # depends on it staying gone. Every aten op the block runs is recorded: after the projection's
    # matmul only views and the residual add may follow, never a clone or copy (a .contiguous()).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    block = _perturbed(AttnBlock(32, heads, 8, 'sdpa')).eval()
    x = torch.randn(2, 32, 8, 8).contiguous(memory_format=memory_format)
    with torch.no_grad(), Ops() as ops:
        out = block(x)
    last_matmul = max(i for i, name in enumerate(ops.names) if name in ('addmm', 'mm', 'bmm', 'matmul', 'linear'))
    after = ops.names[last_matmul + 1:]
    views = {'view', 'transpose', 'unflatten', 'permute', '_unsafe_view', 'as_strided', 'alias', 'expand'}
    assert set(after) - views == {'add'} and after.count('add') == 1, after
    assert torch.allclose(out.double(), _attention_by_hand(block, x), atol=1e-5)


def test_attention_changes_output_when_perturbed():
    # Guards the test above: the attention block must contribute to the output.
    torch.manual_seed(0)
    model = _perturbed(UNet(PRESETS['tiny']).eval())
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([3, 4])
    before = model(x, t)
    attn = [m for m in model.modules() if m.__class__.__name__ == 'AttnBlock'][0]
    with torch.no_grad():
        attn.proj.weight.zero_()
        attn.proj.bias.zero_()
    assert not torch.allclose(before, model(x, t))


def test_flop_counter_matches_hand_count():
    # One 3x3 conv, 3 -> 8 channels, 16x16 output: 2 * Cin * Cout * k * k * H * W FLOPs.
    from torch.utils.flop_counter import FlopCounterMode
    conv = nn.Conv2d(3, 8, 3, padding=1)
    with FlopCounterMode(display=False) as counter:
        conv(torch.randn(1, 3, 16, 16))
    assert counter.get_total_flops() == 2 * 3 * 8 * 9 * 16 * 16


def flops_by_hand(model: UNet, image_size: int) -> dict:
    """Per image: 2 x (multiply-adds) of every conv and linear layer, from their shapes, plus
    the two attention matmuls (QK^T and AV: 2 x 2 x (HW)^2 x C). The backward pass costs twice
    the forward (input and weight gradients), except for the layers whose input needs no
    gradient (conv_in and the first timestep-MLP layer): they only get weight gradients."""
    layers, attention, per_image = {}, [], {}

    def layer_hook(module, inputs, output):
        if isinstance(module, nn.Conv2d):
            layers[module] = 2 * output[0].numel() * module.in_channels * module.kernel_size[0] * module.kernel_size[1]
        else:  # per vector it maps: the timestep embedding's one, or the attention's HW tokens
            layers[module] = 2 * module.in_features * output[0].numel()
        # torchinfo's rule: a Linear layer's multiply-adds once per image, whatever its token count
        per_image[module] = layers[module] if isinstance(module, nn.Conv2d) else 2 * module.weight.numel()

    def attention_hook(module, inputs, output):
        _, channels, height, width = inputs[0].shape
        attention.append(4 * (height * width) ** 2 * channels)
    handles = [m.register_forward_hook(layer_hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    handles += [m.register_forward_hook(attention_hook) for m in model.modules() if isinstance(m, AttnBlock)]
    with torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size), torch.zeros(1, dtype=torch.long))
    for handle in handles:
        handle.remove()
    forward = sum(layers.values()) + sum(attention)
    return {'forward': forward, 'train': 3 * forward - layers[model.conv_in] - layers[model.temb[0]],
            'layers': sum(layers.values()), 'torchinfo_layers': sum(per_image.values())}


@pytest.mark.parametrize('preset', ['tiny', 'ddpm-cifar10'])
def test_flops_match_a_count_by_hand(preset):
    config = PRESETS[preset]
    by_hand = flops_by_hand(UNet(config), 32)
    flops = count_flops(config)
    assert flops['forward'] == by_hand['forward'] and flops['train'] == by_hand['train']
    torchinfo = count_torchinfo_flops(config)
    assert torchinfo['train'] == 3 * torchinfo['forward']
    # torchinfo counts the conv and linear layers (and the norms' affine parameters), not attention,
    # and a Linear layer once per image: the attention's projections at 1/HW of their work.
    assert abs(torchinfo['forward'] / by_hand['torchinfo_layers'] - 1) < 0.01
    if preset == 'ddpm-cifar10':  # the figures the spec quotes, about 12.4 / 37.3 GFLOP; torchinfo 11.4 / 34.3
        print(f"\nddpm-cifar10 @32x32: {flops['forward'] / 1e9:.3f} GFLOP forward, {flops['train'] / 1e9:.3f} "
              f"forward+backward per image; torchinfo {torchinfo['forward'] / 1e9:.3f} / "
              f"{torchinfo['train'] / 1e9:.3f}")
        assert round(flops['forward'] / 1e9, 1) == 12.4 and round(flops['train'] / 1e9, 1) == 37.3
        assert round(torchinfo['forward'] / 1e9, 2) == 11.44 and round(torchinfo['train'] / 1e9, 2) == 34.32


def test_dropout_out_of_range_is_rejected():
    for dropout in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match='dropout'):
            get_config('tiny', dropout=dropout)


def test_flops_same_for_sdpa_and_manual_attention():
    # count_flops uses the manual path; SDPA's flop formula must give the same total on CPU. The
    # math kernel: FlopCounterMode has no formula for the CPU's flash kernel (it counts it as 0).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    config = PRESETS['tiny']
    model = UNet(config)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long))
    assert counter.get_total_flops() / 2 == count_flops(config)['forward']


def test_flops_scale_with_image_size():
    small = count_flops(PRESETS['tiny'], image_size=16)['forward']
    large = count_flops(PRESETS['tiny'], image_size=32)['forward']
    assert 3.5 < large / small < 4.5  # convs scale with pixels, attention a bit faster


def test_gpu_peak_lookup():
    assert gpu_peak_key('NVIDIA H100 80GB HBM3') == 'H100 SXM'
    assert gpu_peak_key('NVIDIA H100 PCIe') == 'H100 PCIe'
    assert gpu_peak_key('NVIDIA H200') == 'H200'
    assert gpu_peak_key('NVIDIA A100-SXM4-80GB') == 'A100'
    assert gpu_peak_key('NVIDIA A10G') == 'A10G'
    assert gpu_peak_key('NVIDIA GeForce RTX 4090') == 'RTX 4090'
    assert peak_tflops('NVIDIA H100 80GB HBM3', 'bf16') == 989.5
    assert peak_tflops('Tesla T4', 'bf16') is None  # unknown: no guess

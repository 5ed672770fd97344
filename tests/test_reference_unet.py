"""The UNet against independent references: diffusers' UNet2DModel (the released
google/ddpm-cifar10-32 configuration) in float64, the paper's initialisation and padding
written out by hand, and load_diffusers on models saved locally."""
import json
import math

import pytest
import torch
import torch.nn as nn
from helpers import NO_DIFFUSERS

import diffusers_io
import model as unet
from model import PRESETS, UNet, get_config

diffusers = pytest.importorskip('diffusers', reason=NO_DIFFUSERS)

# config.json of the released google/ddpm-cifar10-32 UNet (the paper's CIFAR-10 model).
GOOGLE_DDPM_CIFAR10_32 = {
    '_class_name': 'UNet2DModel', 'act_fn': 'silu', 'attention_head_dim': None,
    'block_out_channels': [128, 256, 256, 256], 'center_input_sample': False,
    'down_block_types': ['DownBlock2D', 'AttnDownBlock2D', 'DownBlock2D', 'DownBlock2D'],
    'downsample_padding': 0, 'flip_sin_to_cos': False, 'freq_shift': 1, 'in_channels': 3, 'layers_per_block': 2,
    'mid_block_scale_factor': 1, 'norm_eps': 1e-06, 'norm_num_groups': 32, 'out_channels': 3, 'sample_size': 32,
    'time_embedding_type': 'positional', 'up_block_types': ['UpBlock2D', 'UpBlock2D', 'AttnUpBlock2D', 'UpBlock2D'],
}


def randomised(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter drawn afresh, the zero-initialised ones and the norms' too, at scales
    that keep activations O(1): a comparison then exercises every weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if p.dim() > 1:
                p.copy_(noise / math.sqrt(p[0].numel()))
            elif 'norm' in name:
                p.copy_((1 + 0.3 * noise) if name.endswith('weight') else 0.3 * noise)
            else:
                p.copy_(0.3 * noise)
    return module


def pair(preset: str, seed: int = 0):
    config = get_config(preset, dropout=0.0)
    theirs = randomised(diffusers.UNet2DModel(**diffusers_io.diffusers_config(config)).double().eval(), seed)
    ours = UNet(config).double().eval()
    ours.load_state_dict(diffusers_io.state_dict_from_diffusers(ours, theirs.state_dict()))
    return ours, theirs


@pytest.mark.parametrize('preset', ['tiny', 'ddpm-cifar10'])
def test_same_function_as_diffusers_in_float64(preset):
    ours, theirs = pair(preset)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t = torch.tensor([0, 417, 999])
    with torch.no_grad():
        a, b = ours(x, t), theirs(x, t).sample
    assert a.dtype == torch.float64
    assert a.abs().max() > 0.5  # every layer contributes: not a comparison of near-zeros
    assert (a - b).abs().max() <= 1e-12 * a.abs().max()
    # The timestep matters in both (the embedding and every block's projection are used).
    with torch.no_grad():
        assert (ours(x, t.flip(0)) - a).abs().max() > 1e-3
        # Channels-last (attention without its layout copy) is the same function.
        nhwc = ours.to(memory_format=torch.channels_last)(x.contiguous(memory_format=torch.channels_last), t)
    assert (nhwc - b).abs().max() <= 1e-12 * a.abs().max()


def test_dropout_where_diffusers_has_it(monkeypatch):
    """In training mode, with dropout replaced by a fixed, layout-independent mask (the CPU
    RNG fills masks in memory order, which differs between the two implementations' layouts),
    the outputs still agree: dropout sits at the same place, at the same rate."""
    import torch.nn.functional as F

    def fixed_mask_dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        keep = (torch.arange(x.numel()).reshape(x.shape) * 7919 % 10 >= 10 * p).to(x.dtype)
        return x * keep / (1 - p)
    monkeypatch.setattr(F, 'dropout', fixed_mask_dropout)
    config = get_config('tiny', dropout=0.3)
    theirs = randomised(diffusers.UNet2DModel(**diffusers_io.diffusers_config(config)).double().train(), 2)
    ours = UNet(config).double().train()
    ours.load_state_dict(diffusers_io.state_dict_from_diffusers(ours, theirs.state_dict()))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t = torch.tensor([3, 700])
    with torch.no_grad():
        a, b, without = ours(x, t), theirs(x, t).sample, ours.eval()(x, t)
    assert (a - b).abs().max() <= 1e-12 * a.abs().max()
    assert (a - without).abs().max() > 0.1 * a.abs().max()  # the dropout did change the output


def test_benchmark_peer_is_the_released_configuration():
    kwargs = diffusers_io.diffusers_config(PRESETS['ddpm-cifar10'])
    released = {k: v for k, v in GOOGLE_DDPM_CIFAR10_32.items() if not k.startswith('_')}
    built = diffusers.UNet2DModel(**kwargs).config
    for key, value in released.items():
        assert built[key] == (tuple(value) if isinstance(value, list) else value), key
    import benchmark
    peer = benchmark.DiffusersUNet(PRESETS['ddpm-cifar10'])
    assert {k: peer.unet.config[k] for k in released} == {k: built[k] for k in released}
    assert diffusers_io.config_from_diffusers(GOOGLE_DDPM_CIFAR10_32) == get_config('ddpm-cifar10', dropout=0.0)


def test_variance_scaling_init_is_the_papers():
    """TF's variance_scaling(1, 'fan_avg', 'uniform'): U(-a, a), a = sqrt(6 / (fan_in + fan_out)),
    a conv's fans counting its kernel area; scale 1e-10 for the layers the paper zero-initialises
    (each block's last conv, the attention output, conv_out); zero biases; q, k, v each their own
    (C, C) layer."""
    torch.manual_seed(0)
    model = UNet(PRESETS['ddpm-cifar10'])
    zero_init = {n for n, m in model.named_modules() if n.endswith(('.conv2', '.proj')) or n == 'conv_out'}
    assert len(zero_init) == (8 + 2 + 12) + (2 + 1 + 3) + 1  # residual blocks, attention blocks, conv_out
    checked = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, (nn.Conv2d, nn.Linear)):
            continue
        weight = layer.weight.detach()
        out_ch, in_ch = weight.shape[:2]
        area = weight[0, 0].numel()
        parts = weight.chunk(3) if name.endswith('qkv') else [weight]
        fan_out = (out_ch // len(parts)) * area
        scale = 1e-10 if name in zero_init else 1.0
        limit = math.sqrt(3 * scale / ((in_ch * area + fan_out) / 2))
        for part in parts:
            assert part.abs().max() <= limit, name
            assert part.abs().max() > 0.9 * limit, name  # uniform on the whole interval
            assert abs(part.std().item() - limit / math.sqrt(3)) < 0.15 * limit / math.sqrt(3), name
        assert torch.equal(layer.bias, torch.zeros_like(layer.bias)), name
        checked += 1
    assert checked == len(list(model.parameters())) // 2 - sum(isinstance(m, nn.GroupNorm) for m in model.modules())
    for norm in (m for m in model.modules() if isinstance(m, nn.GroupNorm)):
        assert norm.eps == 1e-6 and torch.equal(norm.weight, torch.ones_like(norm.weight))


def test_every_block_starts_as_the_identity():
    """At initialisation each residual and attention block returns its input (through the
    shortcut where channels change), to within the 1e-10-scale last layer."""
    torch.manual_seed(0)
    model = UNet(get_config('ddpm-cifar10', dropout=0.0)).eval()
    seen = []

    def check(block, inputs, output):
        x = inputs[0]
        expected = block.skip(x) if isinstance(block, unet.ResBlock) else x
        seen.append(((output - expected).abs().max() / expected.abs().max()).item())
    for block in model.modules():
        if isinstance(block, (unet.ResBlock, unet.AttnBlock)):
            block.register_forward_hook(check)
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32), torch.tensor([5, 900]))
    assert len(seen) == (8 + 2 + 12) + (2 + 1 + 3)  # down, middle and up blocks
    assert max(seen) < 1e-4
    assert out.abs().max() < 1e-4  # conv_out at scale 1e-10: the untrained model predicts ~0


def test_downsampling_pads_right_and_bottom_like_tf_same():
    down = unet.Downsample(1)
    x = torch.arange(36.0).reshape(1, 1, 6, 6)
    with torch.no_grad():
        down.conv.bias.zero_()
        down.conv.weight.zero_()
        down.conv.weight[0, 0, 0, 0] = 1.0  # the top-left tap reads x[2i, 2j]: no padding on top or left
        assert torch.equal(down(x), x[..., ::2, ::2])
        down.conv.weight.zero_()
        down.conv.weight[0, 0, 2, 2] = 1.0  # the bottom-right tap reads x[2i+2, 2j+2]: zeros past the edge
        expected = torch.zeros(1, 1, 3, 3)
        expected[..., :2, :2] = x[..., 2::2, 2::2]
        assert torch.equal(down(x), expected)


def test_timestep_embedding_closed_form_and_dtype():
    t = torch.tensor([0, 1, 999])
    emb = unet.timestep_embedding(t, 8)
    for i, step in enumerate([0, 1, 999]):
        for j in range(4):
            angle = step * math.exp(-math.log(10000) * j / 3)
            assert emb[i, j].item() == pytest.approx(math.sin(angle), abs=1e-4)
            assert emb[i, 4 + j].item() == pytest.approx(math.cos(angle), abs=1e-4)
    assert unet.timestep_embedding(t, 8, torch.float64).dtype == torch.float64
    model = UNet(PRESETS['tiny']).double()
    assert model(torch.randn(1, 3, 32, 32, dtype=torch.float64), torch.tensor([3])).dtype == torch.float64


# ----------------------------------------------------------------------------- load_diffusers

def small_diffusers_model(seed=0, **overrides):
    kwargs = {**diffusers_io.diffusers_config(get_config('tiny', image_size=16, dropout=0.0)), **overrides}
    return randomised(diffusers.UNet2DModel(**kwargs).eval(), seed)


def same_outputs(ours, theirs):
    x, t = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3)), torch.tensor([7, 640])
    with torch.no_grad():
        a, b = ours(x, t), theirs(x, t).sample
    return a.abs().max() > 0.1 and (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_load_diffusers_model_folder(tmp_path):
    theirs = small_diffusers_model()
    theirs.save_pretrained(tmp_path / 'unet-safetensors')
    theirs.save_pretrained(tmp_path / 'unet-bin', safe_serialization=False)
    for folder in ('unet-safetensors', 'unet-bin'):
        ours = diffusers_io.load_diffusers(str(tmp_path / folder))
        assert not ours.training and ours.config.image_size == 16 and ours.config.base_channels == 16
        assert same_outputs(ours, theirs)


def test_load_diffusers_pipeline_folder(tmp_path):
    theirs = small_diffusers_model(seed=4)
    diffusers.DDPMPipeline(unet=theirs, scheduler=diffusers.DDPMScheduler()).save_pretrained(tmp_path / 'pipe')
    assert (tmp_path / 'pipe' / 'unet' / 'config.json').exists()
    assert same_outputs(diffusers_io.load_diffusers(str(tmp_path / 'pipe')), theirs)


def test_load_diffusers_with_the_old_attention_names(tmp_path):
    # Checkpoints written before diffusers 0.15 (the released DDPM ones) name the attention
    # layers query, key, value and proj_attn.
    theirs = small_diffusers_model(seed=5)
    old = {}
    for key, value in theirs.state_dict().items():
        for new, previous in (('to_q', 'query'), ('to_k', 'key'), ('to_v', 'value'), ('to_out.0', 'proj_attn')):
            key = key.replace(f'.{new}.', f'.{previous}.')
        old[key] = value
    assert any('.proj_attn.' in k for k in old)
    (tmp_path / 'old').mkdir()
    torch.save(old, tmp_path / 'old' / 'diffusion_pytorch_model.bin')
    (tmp_path / 'old' / 'config.json').write_text(json.dumps(dict(theirs.config)))
    assert same_outputs(diffusers_io.load_diffusers(str(tmp_path / 'old')), theirs)


@pytest.mark.parametrize('field, value', [
    ('flip_sin_to_cos', True), ('freq_shift', 0), ('downsample_padding', 1), ('norm_eps', 1e-5),
    ('act_fn', 'gelu'), ('time_embedding_type', 'fourier'), ('resnet_time_scale_shift', 'scale_shift'),
    ('center_input_sample', True), ('block_out_channels', [16, 24, 32]), ('out_channels', 6),
    ('up_block_types', ['UpBlock2D', 'UpBlock2D', 'UpBlock2D']), ('attention_head_dim', 12),
])
def test_load_diffusers_names_the_field_it_cannot_represent(tmp_path, field, value):
    config = {**GOOGLE_DDPM_CIFAR10_32, 'block_out_channels': [16, 32, 32], 'norm_num_groups': 8,
              'down_block_types': ['DownBlock2D', 'DownBlock2D', 'AttnDownBlock2D'],
              'up_block_types': ['AttnUpBlock2D', 'UpBlock2D', 'UpBlock2D'], 'layers_per_block': 1, field: value}
    (tmp_path / 'config.json').write_text(json.dumps(config))
    with pytest.raises(diffusers_io.DiffusersConfigError, match=field):
        diffusers_io.load_diffusers(str(tmp_path))


def test_load_diffusers_refuses_weights_it_has_no_place_for(tmp_path):
    theirs = small_diffusers_model()
    theirs.save_pretrained(tmp_path)
    weights = theirs.state_dict()
    weights['class_embedding.weight'] = torch.zeros(10, 64)  # an unconditional config.json: no place for it
    ours = UNet(diffusers_io.config_from_diffusers(dict(theirs.config)))
    with pytest.raises(KeyError, match='class_embedding'):
        diffusers_io.state_dict_from_diffusers(ours, weights)
    del weights['class_embedding.weight'], weights['conv_out.bias']
    with pytest.raises(KeyError, match='conv_out.bias'):
        diffusers_io.state_dict_from_diffusers(ours, weights)


def test_load_diffusers_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match='config.json'):
        diffusers_io.load_diffusers(str(tmp_path))
    (tmp_path / 'config.json').write_text(json.dumps(dict(small_diffusers_model().config)))
    with pytest.raises(FileNotFoundError, match='safetensors'):
        diffusers_io.load_diffusers(str(tmp_path))


def test_class_conditional_network_is_diffusers_with_num_class_embeds(tmp_path):
    # num_classes=10: diffusers' UNet2DModel(num_class_embeds=11), the last embedding 'no class'.
    # Same function in float64 for every label and for 'no class' (labels=None); exported and
    # loaded back both ways with every weight, the class embedding's included.
    config = get_config('tiny', dropout=0.0, num_classes=10, in_channels=1, image_size=16)
    assert diffusers_io.diffusers_config(config)['num_class_embeds'] == 11
    theirs = randomised(diffusers.UNet2DModel(**diffusers_io.diffusers_config(config)).double().eval(), 7)
    ours = UNet(config).double().eval()
    ours.load_state_dict(diffusers_io.state_dict_from_diffusers(ours, theirs.state_dict()))
    x = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t, labels = torch.tensor([0, 300, 600, 999]), torch.tensor([3, 0, 9, 10])
    null = torch.full((4,), 10)
    with torch.no_grad():
        a, b = ours(x, t, labels), theirs(x, t, class_labels=labels).sample
        unconditional = ours(x, t)
        assert (a - b).abs().max() <= 1e-12 * a.abs().max() and a.abs().max() > 0.5
        assert torch.equal(unconditional, ours(x, t, null))
        assert (unconditional - theirs(x, t, class_labels=null).sample).abs().max() <= 1e-12 * a.abs().max()
        assert (ours(x, t, labels.roll(1)) - a).abs().max() > 1e-3  # the label matters
    assert torch.equal(diffusers_io.state_dict_to_diffusers(ours)['class_embedding.weight'],
                       theirs.state_dict()['class_embedding.weight'])
    theirs.float().save_pretrained(tmp_path / 'unet')
    loaded = diffusers_io.load_diffusers(str(tmp_path / 'unet'))
    assert loaded.config.num_classes == 10
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, ours.float().state_dict()[key]), key
    with pytest.raises(ValueError, match='unconditional'):
        UNet(get_config('tiny'))(torch.zeros(1, 3, 32, 32), torch.zeros(1, dtype=torch.long), torch.zeros(1).long())


def test_checkpoints_with_the_attention_as_1x1_convs_still_load():
    # The attention's projections were 1x1 convs, (out, in, 1, 1): the same numbers as the Linear layers'.
    torch.manual_seed(0)
    model = randomised(UNet(get_config('tiny', dropout=0.0)).double().eval(), 3)
    old = {k: (v[:, :, None, None] if k.endswith(('.qkv.weight', '.1.proj.weight')) else v)
           for k, v in model.state_dict().items()}
    assert sum(v.dim() == 4 and v.shape[2:] == (1, 1) for v in old.values()) >= 2 * 3
    loaded = UNet(get_config('tiny', dropout=0.0)).double().eval()
    loaded.load_state_dict(old)
    x, t = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.tensor([5, 900])
    with torch.no_grad():
        assert torch.equal(loaded(x, t), model(x, t))

"""diffusers' formats, read and written: a UNet2DModel folder, or a pipeline folder with one under
unet/, as our UNet; its scheduler's settings; our UNet exported as a DDPMPipeline folder. The two
networks compute the same function (tests/test_reference_unet.py); only the names and the layout
of the weights differ (ours fuses q, k and v into one linear layer). The peers that benchmark.py and
the time-to-quality ladder time beside ours are peers.py's."""
import json
import math
import os
import shutil

import torch
import torch.nn as nn

from cli import ConfigError, brief
from files import disk_full_error
from model import NORM_EPS, AttnBlock, Downsample, ResBlock, UNet, UNetConfig, Upsample

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
    'resnet_time_scale_shift': 'default', 'add_attention': True, 'class_embed_type': None,
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
        norm_num_groups=config.norm_groups, dropout=config.dropout,
        num_class_embeds=config.num_classes + 1 if config.num_classes else None, **_DIFFUSERS_REQUIRED)


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
    for key in ('in_channels', 'out_channels', 'layers_per_block', 'norm_num_groups'):
        _check_positive_int(key, get(key))
    if not isinstance(get('block_out_channels'), (list, tuple)):
        raise DiffusersConfigError(f"block_out_channels={get('block_out_channels')!r}: a list of channel counts")
    for value in get('block_out_channels'):
        _check_positive_int('block_out_channels', value)
    if get('attention_head_dim') is not None:
        _check_positive_int('attention_head_dim', get('attention_head_dim'))
    class_embeds = get('num_class_embeds')
    if class_embeds is not None:  # the last embedding is read as 'no class', as ours
        _check_positive_int('num_class_embeds', class_embeds)
        if class_embeds < 3:
            raise DiffusersConfigError(f'num_class_embeds={class_embeds!r}: at least 2 classes and the "no class" '
                                       f'embedding are needed')
    dropout = get('dropout')
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise DiffusersConfigError(f'dropout={dropout!r}: a number in [0, 1)')
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
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
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
                          attention=attention, num_classes=class_embeds - 1 if class_embeds else 0)
    except ValueError as error:
        raise DiffusersConfigError(str(error)) from None


def _check_positive_int(key: str, value):
    """A config.json count is read as strictly as a flag: a positive integer, not "1", 0 or 2.0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DiffusersConfigError(f'{key}={value!r}: a positive integer is needed')


def diffusers_module_names(model: UNet) -> list:
    """(our module, UNet2DModel's module) for every layer that holds weights, in order."""
    names = [('temb.0', 'time_embedding.linear_1'), ('temb.2', 'time_embedding.linear_2'), ('conv_in', 'conv_in')]
    if model.class_emb is not None:
        names.append(('class_emb', 'class_embedding'))
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
    attention block, whose q, k and v projections ours fuses into one linear layer."""
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
        kinds = ('weight',) if isinstance(module, nn.Embedding) else ('weight', 'bias')
        pairs += [(f'{a}.{p}', f'{b}.{p}') for a, b in parts for p in kinds]
    return pairs, attention


def state_dict_from_diffusers(model: UNet, theirs: dict) -> dict:
    """A UNet2DModel state dict as our UNet's state dict (same function, our layout: the
    three attention projections fused into one matmul)."""
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
        for p, shape in (('weight', (channels, channels)), ('bias', (channels,))):
            ours[f'{our_name}.qkv.{p}'] = torch.cat([take(f'{their_name}.to_{x}.{p}') for x in 'qkv']).reshape(
                (3 * channels, *shape[1:]))
            ours[f'{our_name}.proj.{p}'] = take(f'{their_name}.to_out.0.{p}').reshape(shape)
    unused = sorted(set(theirs) - used)
    if unused:
        raise KeyError(f'the diffusers weights hold tensors our network has no place for: {", ".join(unused[:5])}')
    return ours


def state_dict_to_diffusers(model: UNet) -> dict:
    """Our UNet's weights under UNet2DModel's names and shapes: the inverse of
    state_dict_from_diffusers (the fused q, k, v layer split into three)."""
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


STUDENT_FILE = 'student.json'  # an exported student's record (distill.py's), beside model_index.json
DIFFUSERS_PREDICTION = {'eps': 'epsilon', 'v': 'v_prediction', 'x': 'sample'}


def save_diffusers(model: UNet, schedule: str, num_steps: int, folder: str, prediction: str = 'eps',
                   student: dict = None):
    """A diffusers pipeline folder that from_pretrained loads: model_index.json, unet/ (config.json and
    diffusion_pytorch_model.safetensors) and scheduler/. A model of every timestep: a DDPMPipeline with
    a DDPMScheduler of this schedule ('linear' 1e-4..0.02 or 'cosine', T steps, fixed-large variance,
    clipped x_0, as the paper's sampler). A distill.py `student` (its record): a DDIMPipeline whose
    DDIMScheduler ('trailing', set_alpha_to_one, unclipped) at the student's steps is its sampler, and
    its record as student.json. Written beside `folder` and renamed: a folder appears whole. Raises
    ValueError when diffusers cannot represent the configuration."""
    from safetensors.torch import save_file
    unet = {'_class_name': 'UNet2DModel', '_diffusers_version': DIFFUSERS_VERSION, **diffusers_config(model.config)}
    betas = {'linear': {'beta_schedule': 'linear', 'beta_start': 1e-4, 'beta_end': 0.02},
             'cosine': {'beta_schedule': 'squaredcos_cap_v2'}}[schedule]
    common = {'_diffusers_version': DIFFUSERS_VERSION, 'num_train_timesteps': num_steps, **betas,
              'trained_betas': None, 'thresholding': False, 'prediction_type': DIFFUSERS_PREDICTION[prediction]}
    if student is None:
        pipeline, scheduler = 'DDPMPipeline', {'_class_name': 'DDPMScheduler', **common, 'variance_type': 'fixed_large',
                                               'clip_sample': True, 'clip_sample_range': 1.0}
    else:
        pipeline, scheduler = 'DDIMPipeline', {'_class_name': 'DDIMScheduler', **common, 'clip_sample': False,
                                               'set_alpha_to_one': True, 'steps_offset': 0,
                                               'timestep_spacing': 'trailing'}
    index = {'_class_name': pipeline, '_diffusers_version': DIFFUSERS_VERSION,
             'scheduler': ['diffusers', scheduler['_class_name']], 'unet': ['diffusers', 'UNet2DModel']}
    files = [(('model_index.json',), index), (('unet', 'config.json'), unet),
             (('scheduler', 'scheduler_config.json'), scheduler)] + [((STUDENT_FILE,), student)] * (student is not None)
    tmp = f'{folder.rstrip(os.sep)}.tmp-{os.getpid()}'
    try:
        for path, content in files:
            os.makedirs(os.path.join(tmp, *path[:-1]), exist_ok=True)
            with open(os.path.join(tmp, *path), 'w') as f:
                json.dump(content, f, indent=2)
        save_file(state_dict_to_diffusers(model), os.path.join(tmp, 'unet', 'diffusion_pytorch_model.safetensors'))
        os.replace(tmp, folder)  # refused if another export filled `folder` meanwhile
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed or losing export leaves nothing behind
        if isinstance(error, OSError) and os.path.isdir(folder) and os.listdir(folder):
            raise ConfigError(f'{folder}: written meanwhile by another export; this one is discarded') from None
        if isinstance(error, Exception):  # a full disk (safetensors' own error type included)
            raise disk_full_error(folder, error) from None
        raise


def diffusers_scheduler(path: str, named_as: str) -> dict:
    """{'schedule': 'linear' | 'cosine', 'num_steps': T, 'prediction': 'eps' | 'v'} of a diffusers
    folder: its pipeline's scheduler/scheduler_config.json, or the paper's (linear, T=1000, eps)
    where there is none. Anything else is one ConfigError line naming the file (`named_as`: the flag)."""
    unet_folder = diffusers_folder(path)
    candidates = [os.path.join(path, 'scheduler', 'scheduler_config.json'),
                  os.path.join(os.path.dirname(os.path.normpath(unet_folder)), 'scheduler', 'scheduler_config.json')]
    config_path = next((p for p in candidates if os.path.isfile(p)), None)
    if config_path is None:
        return {'schedule': 'linear', 'num_steps': 1000, 'prediction': 'eps'}
    try:
        with open(config_path) as f:
            theirs = json.load(f)
        if not isinstance(theirs, dict):
            raise ValueError(f'it holds a {type(theirs).__name__}, not a JSON object')
        steps = theirs.get('num_train_timesteps', 1000)
        _check_positive_int('num_train_timesteps', steps)
        start, end = theirs.get('beta_start', 1e-4), theirs.get('beta_end', 0.02)
        if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (start, end)):
            raise ValueError(f'beta_start={start!r}, beta_end={end!r}: numbers are needed')
    except (OSError, ValueError) as error:
        raise ConfigError(f'{named_as}: {config_path} is not a scheduler configuration ({brief(error)})') from None
    kind = {'linear': 'linear', 'squaredcos_cap_v2': 'cosine'}.get(theirs.get('beta_schedule', 'linear'))
    paper_betas = math.isclose(start, 1e-4) and math.isclose(end, 0.02)
    if kind is None or theirs.get('trained_betas') is not None or (kind == 'linear' and not paper_betas):
        raise ConfigError(f'{named_as}: {config_path}: only the linear 1e-4..0.02 and the cosine beta schedules are '
                          f'supported')
    prediction = {v: k for k, v in DIFFUSERS_PREDICTION.items()}.get(theirs.get('prediction_type', 'epsilon'))
    if prediction is None:
        raise ConfigError(f"{named_as}: {config_path}: prediction_type={theirs['prediction_type']!r}; epsilon, "
                          f"v_prediction and (a student's) sample are supported")
    return {'schedule': kind, 'num_steps': steps, 'prediction': prediction}


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


def read_diffusers(path: str, named_as: str) -> UNet:
    """load_diffusers for a path given by a flag (`named_as`): whatever is wrong with the folder is one
    ConfigError line naming it (a load_state_dict mismatch would run to pages)."""
    try:
        return load_diffusers(path)
    except (DiffusersConfigError, OSError, KeyError, ValueError, TypeError, AttributeError, RuntimeError) as error:
        raise ConfigError(f"{named_as}: cannot load it as the paper's UNet ({brief(error, 300)})") from None

"""The README's picture: 64 digits drawn by a checkpoint (EMA weights, its default sampler: DDIM-50
from seed 0) beside 64 real held-out digits, enlarged without smoothing so that each pixel shows.

    python scripts/digits_figure.py --ckpt runs/ckpt.pt --out ddpm_samples/readme_digits.png
"""
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchvision.utils import make_grid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import diffusion  # noqa: E402
import drawing  # noqa: E402
import sample  # noqa: E402
from cli import ConfigError, check_ranges, flag, parse_config, run_main  # noqa: E402
from files import atomic_open, check_creatable, check_writable  # noqa: E402


@dataclass
class FigureConfig:
    ckpt: str = flag('', 'a checkpoint of a digits run (required)')
    out: str = flag('runs/digits_figure.png', 'the PNG to write, a file name ending in .png (the README\'s: '
                                             'ddpm_samples/readme_digits.png, only when named)')
    scale: int = flag(4, 'pixels per image pixel', at_least=1, at_most=32)


def main(argv=None) -> int:
    return run_main(draw_figure, parse_config(argv, FigureConfig, __doc__))


def draw_figure(args: FigureConfig):
    check_ranges(args)
    if not args.ckpt:
        raise ConfigError('--ckpt is required: a checkpoint of a digits run')
    if not args.out.lower().endswith('.png') or os.path.isdir(args.out):
        raise ConfigError(f'--out {args.out}: a file name ending in .png')
    check_creatable(os.path.dirname(args.out) or '.', '--out')  # created only once the checkpoint is proven good
    model, config, sched, prediction = sample.load_model(args.ckpt, 'ema', torch.device('cpu'))
    if config.in_channels != 1:
        raise ConfigError(f'--ckpt {args.ckpt}: a model of {config.in_channels}-channel images; the figure sets a '
                          f'digits model (one channel) beside real digits')
    check_writable(os.path.dirname(args.out) or '.', '--out')
    shape = (64, config.in_channels, config.image_size, config.image_size)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        drawn = drawing.to_uint8(diffusion.run_sampler('ddim', model, sched, shape, 50, generator,  # the README's
                                                      prediction=prediction, spacing='leading'))  # picture's grid
    real = data.load_digits_split(config.image_size, heldout=True)[0][:64]
    grids = [make_grid(images.float() / 255, nrow=8, padding=1, pad_value=0.5) for images in (drawn, real)]
    gap = torch.ones(3, grids[0].shape[1], 4 * config.image_size // 8)  # a white band between the two
    figure = F.interpolate(torch.cat([grids[0], gap, grids[1]], dim=2)[None], scale_factor=args.scale, mode='nearest')
    from PIL import Image
    pixels = (figure[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    with atomic_open(args.out, 'wb') as f:
        Image.fromarray(pixels).save(f, format='png')
    print(f'wrote {args.out}: drawn by {args.ckpt} (left), held-out digits (right)')


if __name__ == '__main__':
    sys.exit(main())

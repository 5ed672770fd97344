"""The diffusers arm of the time-to-quality ladder: diffusers' training
example's loop (diffusers_io's recipe) on the same images as PNG files, its EMA scored by the judge
that scores our runs, through our network (the same function)."""
import math
import os
import time

import torch

import data
import diffusion
import evaluation
from devices import device_name, pick_device
from diffusers_io import diffusers_config, state_dict_from_diffusers
from drawing import Sampling, draw
from files import write_once
from model import UNet, get_config
from peers import recipe_batches, recipe_loader, recipe_parts, recipe_step, write_image_folder
from reports import provenance


def recipe_arm(job, cfg, stop) -> dict | None:
    """diffusers' example loop (diffusers_io's recipe) on the same images as PNG files, flipped only where
    our runs flip, with its EMA scored every --eval-every images by the same judge, through our network."""
    device = pick_device(cfg.device)
    config = get_config(cfg.preset, image_size=cfg.image_size, in_channels=data.channels_of(cfg.dataset))
    batch, lr = recipe_settings(job.arm)
    with stop.interruptible():
        pngs = write_once(os.path.join(cfg.runs_dir, f'{cfg.dataset}-{cfg.image_size}-png'), 'the recipe',
                          lambda tmp: write_image_folder(data.load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size),
                                                         tmp))
        loader = recipe_loader(pngs, cfg.image_size, batch, 0, config.in_channels,
                               flip=data.flipped_in_training(cfg.dataset))
        steps = math.ceil(job.images / batch)
        torch.manual_seed(job.seed)
        parts = recipe_parts(config, device, len(loader), 'off', total_steps=steps, lr=lr)
        stream = recipe_batches(loader)
        score, sched = judge(cfg, device), diffusion.make_schedule(1000)
    curve, seconds, start = [], 0.0, time.perf_counter()
    made = {('device_name' if k == 'device' else k): v for k, v in provenance(device_name(device)).items()
            if k in ('device', 'torch', 'date', 'commit')}
    for step in range(1, steps + 1):
        recipe_step(parts, next(stream))
        if stop.reason:
            return None
        if step * batch // cfg.eval_every > (step - 1) * batch // cfg.eval_every:
            seconds += time.perf_counter() - start
            evaluated = time.perf_counter()
            sampling = Sampling(num=cfg.eval_samples, batch_size=batch, sampler=cfg.sampler, steps=cfg.sample_steps,
                                seed=evaluation.sampling_seed(job.seed, step * batch, cfg.eval_every, 'fresh'))
            images = torch.cat(list(draw(ema_as_our_unet(parts, config).to(device), config, sched, sampling,
                                         device, progress=False)))
            curve.append({'images': step * batch, 'score': score(images), 'minutes': seconds / 60,
                          'eval_seconds': time.perf_counter() - evaluated})
            print(f'{job.arm.name}, seed {job.seed}: {step * batch:,} images, score {curve[-1]["score"]:.2f}, '
                  f'{seconds / 60:.2f} training minutes', flush=True)
            if job.target is not None and curve[-1]['score'] <= job.target:
                return {'made': made, 'curve': curve, 'img_per_s': step * batch / seconds, 'first_step_s': None,
                        'train_minutes': seconds / 60, 'wall_minutes': None}
            start = time.perf_counter()
    seconds += time.perf_counter() - start
    return {'made': made, 'curve': curve, 'img_per_s': steps * batch / seconds, 'first_step_s': None,
            'train_minutes': seconds / 60, 'wall_minutes': None}


def recipe_settings(arm) -> tuple:
    """(batch, lr) of a recipe arm, from its flags."""
    return int(arm.flags[arm.flags.index('--batch-size') + 1]), float(arm.flags[arm.flags.index('--lr') + 1])


def ema_as_our_unet(parts: dict, config) -> UNet:
    """The recipe's EMA weights (diffusers' UNet2DModel) in our UNet, the same function."""
    from diffusers import UNet2DModel
    theirs = UNet2DModel(**diffusers_config(config))
    parts['ema'].copy_to(theirs.parameters())
    ours_ = UNet(config)
    ours_.load_state_dict(state_dict_from_diffusers(ours_, theirs.state_dict()))
    return ours_.eval().requires_grad_(False)


def judge(cfg, device):
    """images (uint8) -> the score our runs log: the digits score, or FID against the training split."""
    if cfg.dataset == 'digits':
        digits = evaluation.DigitsJudge(cfg.image_size, cfg.data_dir)
        return lambda images: digits.score(digits.features(images))[evaluation.score_key('digits')]
    extractor = evaluation.inception_extractor('', device)
    reference = evaluation.reference_statistics(cfg.dataset, cfg.data_dir, cfg.image_size, extractor, 256)
    return lambda images: evaluation.frechet_distance(evaluation.statistics(evaluation.features_of(
        images.split(256), extractor)), reference)

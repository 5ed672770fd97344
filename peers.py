"""The peers we are measured against: diffusers' UNet2DModel as a model of ours (DiffusersUNet, the
same function: diffusers_io.diffusers_config) and the training loop of diffusers' unconditional
example (RECIPE and recipe_*: its scheduler, optimizer, EMA, lr schedule and data path from image
files). benchmark.py times both beside our fastest row; the time-to-quality ladder trains the recipe."""
import importlib.util
import os

import torch

from devices import autocast
from diffusers_io import diffusers_config

class DiffusersUNet(torch.nn.Module):
    """diffusers' UNet2DModel in the configuration that computes the same function as our
    UNet (diffusers_config: google/ddpm-cifar10-32's for ddpm-cifar10), as model(x, t)."""

    def __init__(self, config):
        super().__init__()
        from diffusers import UNet2DModel
        self.config = config
        self.unet = UNet2DModel(**diffusers_config(config))

    def forward(self, x, t):
        return self.unet(x, t).sample


# diffusers' unconditional training example (examples/unconditional_image_generation/
# train_unconditional.py) as its README runs it (--center_crop --random_flip --use_ema) with its
# default hyperparameters, except that it flips only where our runs flip (never digits: a mirrored 2 is
# no digit; recipe_loader's `flip`); the worker count and the precision are ours (--num-workers, the
# fastest row's), since its defaults (0 workers, fp32) would only flatter us.
RECIPE = {'lr': 1e-4, 'betas': (0.95, 0.999), 'weight_decay': 1e-6, 'eps': 1e-8, 'lr_schedule': 'cosine',
          'lr_warmup_steps': 500, 'epochs': 100, 'grad_clip': 1.0, 'ema_max_decay': 0.9999, 'ema_inv_gamma': 1.0,
          'ema_power': 3 / 4, 'center_crop': True, 'random_flip': 'as our runs flip'}


def recipe_parts(config, device: torch.device, steps_per_epoch: int, amp: str, total_steps: int = None,
                 lr: float = None) -> dict:
    """The example's objects around our network's function (diffusers_config): UNet2DModel,
    DDPMScheduler, AdamW, the cosine schedule with warm-up (over `total_steps`, else its 100
    epochs), EMAModel with its warm-up, and the grad scaler that accelerate's fp16 uses (a no-op
    otherwise). `lr`: another learning rate than the example's."""
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel
    unet = UNet2DModel(**diffusers_config(config)).to(device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=lr or RECIPE['lr'], betas=RECIPE['betas'],
                                  weight_decay=RECIPE['weight_decay'], eps=RECIPE['eps'])
    ema = EMAModel(unet.parameters(), decay=RECIPE['ema_max_decay'], use_ema_warmup=True,
                   inv_gamma=RECIPE['ema_inv_gamma'], power=RECIPE['ema_power'], model_cls=UNet2DModel,
                   model_config=unet.config)
    ema.to(device)
    return {'unet': unet, 'noise_scheduler': DDPMScheduler(num_train_timesteps=1000),
            'optimizer': optimizer, 'ema': ema, 'device': device, 'amp': amp,
            'scaler': torch.amp.GradScaler(device.type, enabled=amp == 'fp16'),
            'lr_scheduler': get_scheduler(RECIPE['lr_schedule'], optimizer=optimizer,
                                          num_warmup_steps=RECIPE['lr_warmup_steps'],
                                          num_training_steps=total_steps or steps_per_epoch * RECIPE['epochs'])}


def recipe_step(parts: dict, clean_images: torch.Tensor) -> torch.Tensor:
    """One iteration of the example's loop: the batch to the device in the weight dtype, noise,
    timesteps, add_noise, the UNet under autocast (accelerate's mixed precision), MSE in fp32,
    backward, clipping, AdamW, the lr schedule, zero_grad, the EMA, and the step's log values
    (loss.item(): the host waits for the step, as the example's progress bar does). Its tqdm and
    tracker calls are left out; under fp16 accelerate also skips the lr step when the scaler skips
    the optimizer's (the first few steps only)."""
    unet, noise_scheduler, device, scaler = parts['unet'], parts['noise_scheduler'], parts['device'], parts['scaler']
    weight_dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(parts['amp'], torch.float32)
    clean_images = clean_images.to(device, weight_dtype)
    noise = torch.randn(clean_images.shape, dtype=weight_dtype, device=device)
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean_images.shape[0],), device=device)
    noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
    with autocast(parts['amp'], device):
        model_output = unet(noisy_images, timesteps).sample
    loss = torch.nn.functional.mse_loss(model_output.float(), noise.float())
    scaler.scale(loss).backward()
    scaler.unscale_(parts['optimizer'])
    torch.nn.utils.clip_grad_norm_(unet.parameters(), RECIPE['grad_clip'])
    scaler.step(parts['optimizer'])
    scaler.update()
    parts['lr_scheduler'].step()
    parts['optimizer'].zero_grad()
    parts['ema'].step(unet.parameters())
    parts['logs'] = {'loss': loss.detach().item(), 'lr': parts['lr_scheduler'].get_last_lr()[0],
                     'ema_decay': parts['ema'].cur_decay_value}
    return loss.detach()


def recipe_loader(folder: str, image_size: int, batch_size: int, num_workers: int, channels: int = 3,
                  flip: bool = True):
    """The example's data path: image files decoded by PIL in DataLoader workers, its transforms
    (resize, centre crop, random flip with --random_flip, to [-1, 1]), shuffled; no pinned memory.
    `flip`: our data rule (data.flipped_in_training: never for digits), where the example's README
    passes --random_flip. ImageFolder reads RGB; for a one-channel network (digits) the images are
    made grey again, which the example, written for RGB, never does."""
    from torchvision import datasets, transforms
    augmentations = transforms.Compose([transforms.Grayscale(1)] * (channels == 1) + [
        transforms.Resize(image_size, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(image_size)] + [transforms.RandomHorizontalFlip()] * flip + [transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5])])
    images = datasets.ImageFolder(folder, transform=augmentations)
    return torch.utils.data.DataLoader(images, batch_size=batch_size, shuffle=True, num_workers=num_workers)


def recipe_batches(loader):
    while True:  # the example's epoch loop: each epoch starts the loader's workers anew
        for images, _ in loader:
            yield images


def diffusers_missing_reason() -> str | None:
    """Why diffusers cannot be used, or None; found without importing it (that loads torch._dynamo:
    seconds), so that a check before any work stays cheap."""
    if importlib.util.find_spec('diffusers') is None:
        return 'diffusers is not installed (pip install diffusers)'
    return None


def write_image_folder(dataset, folder: str):
    """The images as FOLDER/images/NNNNNN.png: the layout recipe_loader (ImageFolder) reads."""
    from torchvision.io import write_png
    os.makedirs(os.path.join(folder, 'images'))
    for index in range(len(dataset)):
        write_png(dataset[index], os.path.join(folder, 'images', f'{index:06d}.png'))


# ----------------------------------------------------------------------------- diffusers' solvers

# diffusers' few-step solvers as a user would pick them, run on our model through peer_sample: the
# default DPMSolverMultistepScheduler (DPM-Solver++(2M), 'linspace'), the same on its log-SNR grid
# (use_lu_lambdas: its last call at t = 0), UniPC (bh2, order 2) on its default and 'trailing' grids,
# and DDIMScheduler on 'trailing' (set_alpha_to_one, unclipped). Name: (class, settings).
PEER_SOLVERS = {
    'diffusers-dpm++': ('DPMSolverMultistepScheduler', {}),
    'diffusers-dpm++-lu': ('DPMSolverMultistepScheduler', {'use_lu_lambdas': True}),
    'diffusers-unipc': ('UniPCMultistepScheduler', {}),
    'diffusers-unipc-trailing': ('UniPCMultistepScheduler', {'timestep_spacing': 'trailing'}),
    'diffusers-ddim-trailing': ('DDIMScheduler', {'timestep_spacing': 'trailing', 'clip_sample': False,
                                                  'set_alpha_to_one': True}),
}


def peer_scheduler(name: str, sched, prediction: str = 'eps'):
    """The diffusers scheduler PEER_SOLVERS[name] over our training schedule (linear or cosine betas,
    T steps) for a network that predicts `prediction`."""
    import diffusers
    from diffusion import schedule_kind
    cls, settings = PEER_SOLVERS[name]
    betas = {'linear': dict(beta_schedule='linear', beta_start=float(sched.betas[0]),
                            beta_end=float(sched.betas[-1])),
             'cosine': dict(beta_schedule='squaredcos_cap_v2')}[schedule_kind(sched)]
    return getattr(diffusers, cls)(num_train_timesteps=sched.num_steps, **betas, **settings,
                                   prediction_type={'eps': 'epsilon', 'v': 'v_prediction'}[prediction])


@torch.no_grad()
def peer_sample(name: str, model, sched, shape, steps: int, generator: torch.Generator = None, device='cpu',
                dtype=torch.float32, prediction: str = 'eps') -> torch.Tensor:
    """Images from diffusers' solver `name` (PEER_SOLVERS) in `steps` calls of model(x, t), from the
    noise our samplers draw first from `generator` (so a seed gives every solver the same x_T), driven
    by the scheduler's own set_timesteps and step(), as its pipelines drive it. Clamped to [-1, 1]."""
    scheduler = peer_scheduler(name, sched, prediction)
    scheduler.set_timesteps(steps)
    x = torch.randn(shape, generator=generator, device=device, dtype=dtype) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        output = model(scheduler.scale_model_input(x, t), t.to(device).repeat(shape[0])).to(dtype)
        x = scheduler.step(output, t, x).prev_sample.to(dtype)
    return x.clamp(-1, 1)

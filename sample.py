"""Sample from a checkpoint: draw, write and continue images, a grid, FID or the digits score and
bits/dim of them (measured by evaluation.py), or an export to a diffusers pipeline.

    python sample.py --ckpt runs/ckpt.pt --num 50000 --sampler ddim --steps 50 --batch-size 1000 --out samples/
    python sample.py --ckpt runs/ckpt.pt --num 64 --grid                 # one grid PNG
    python sample.py --ckpt runs/ckpt.pt --num 50000 --fid                # FID vs CIFAR-10 train
    python sample.py --ckpt runs/ckpt.pt --bpd --bpd-num 10000            # bits/dim on CIFAR-10 test
    python sample.py --ckpt runs/ckpt.pt --export-diffusers runs/pipeline # a diffusers DDPMPipeline folder
    python sample.py --ckpt runs/ckpt.pt --num 100 --grid --guidance 2     # class-conditional: a row per class

EMA weights (--weights model: the raw ones); images go to disk batch by batch, and after a stop the
same command continues (OUT/samples.json holds the settings). The file reads in the order a command
runs: its flags, load and validate, draw, score, export, main; the files it writes: sample_files.py.
Exit codes: 0 done (or stopped with what was drawn written), 1 a write failed, 2 bad input, 3 the model
drew NaN or inf.
"""
import dataclasses
import math
import os
import sys
import time
import typing
from dataclasses import dataclass

import torch
from tqdm import tqdm

import data
import diffusion
import students
from checkpoint import model_from_checkpoint, read_checkpoint, read_student_record, require_finite
from cli import ConfigError, StopFlag, changed_fields, check_ranges, flag, given_fields, parse_config, run_main
from devices import pick_device
from diffusers_io import diffusers_scheduler, read_diffusers, save_diffusers
from drawing import GRID_LIMIT, STUDENT_SAMPLERS, class_labels, draw, write_grid_png
from evaluation import (REFERENCE_SETS, DigitsJudge, bits_per_dim, check_inception_weights, conditioning_summary,
                        digits_summary, features_of, frechet_distance, inception_extractor, reference_statistics,
                        statistics)
from files import check_writable, claim_folder
from model import UNetConfig, count_flops
from sample_files import (MANIFEST, assemble_npz, batch_paths, continue_or_start, npz_path, our_samples,
                          sample_settings, write_batch, write_manifest, written_batches)


@dataclass
class SampleConfig:
    ckpt: str = flag('runs/ckpt.pt', 'checkpoint written by train.py, or a diffusers UNet2DModel or pipeline '
                                     'folder (such as google/ddpm-cifar10-32)')
    num: int = flag(64, 'images to draw', at_least=1)
    sampler: str = flag('dpm++', 'ddim (any --steps), dpm++ (DPM-Solver++(2M), any --steps; its accuracy by steps: '
                                'docs/sampling.md) or ddpm (all T steps, ancestral)',
                        choices=('ddim', 'dpm++', 'ddpm'))
    steps: typing.Optional[int] = flag(None, 'model calls of ddim and dpm++ (default 50); ddpm always takes all T '
                                             'steps and refuses the flag', at_least=1)
    spacing: typing.Optional[str] = flag(None, 'timestep grid of ddim and dpm++, named as diffusers names it: leading, '
                                               'trailing, linspace, or logsnr (dpm++ only); default: each sampler\'s '
                                               'best, measured (docs/sampling.md, "Which grid")',
                                         choices=diffusion.SPACINGS['dpm++'])
    eta: float = flag(0.0, 'DDIM eta (0: deterministic given the noise; above 1 would ask for more noise than the '
                           'step\'s posterior has)', at_least=0, at_most=1)
    variance: str = flag('fixedlarge', 'DDPM variance', choices=('fixedlarge', 'fixedsmall'))
    clip: str = flag('auto', 'clipping of the predicted x0 to [-1, 1]: auto is each sampler\'s own (ddpm clips, as the '
                             'paper\'s sampler; ddim and dpm++ do not, so that more steps converge to the ODE\'s '
                             'solution); x0 clips it (diffusers\' clip_sample), x0+eps also re-derives eps from it '
                             '(use_clipped_model_output; for ddpm the same as x0, its mean reads x0 alone); none '
                             'never clips; dpm++ takes auto or none', choices=('auto',) + diffusion.DDIM_CLIPS)
    label: typing.Optional[int] = flag(None, 'a class-conditional model\'s class for every image (default: each '
                                             'class in turn, image i of class i mod K)', at_least=0)
    guidance: typing.Optional[float] = flag(None, 'classifier-free guidance scale of a class-conditional model: '
                                                  'out_uncond + s (out_cond - out_uncond); 1 the conditional model '
                                                  'alone (the default), 0 the unconditional one', at_least=0)
    mid_timestep: typing.Optional[int] = flag(None, 'a 2-call consistency student\'s second timestep, where its '
                                                    'first image is re-noised to (default: the one it records)',
                                              at_least=0, at_most=998)
    batch_size: int = flag(256, 'images per sampling batch', at_least=1)
    out: str = flag('samples', 'output folder')
    format: str = flag('png', 'png (one file per image) or npz (one uint8 NHWC array, key arr_0)',
                       choices=('png', 'npz'))
    grid: bool = flag(False, 'write one grid PNG (out/grid.png) instead of separate images')
    weights: str = flag('ema', 'which weights to use', choices=('ema', 'model'))
    seed: int = flag(0, 'seed of the sampling noise', at_least=0, at_most=2 ** 32 - 1)
    device: str = flag('auto', 'auto, cpu, cuda or cuda:N')
    amp: str = flag('auto', 'autocast for sampling (auto: bf16 on CUDA); bits/dim always runs in fp32 unless '
                            'set explicitly', choices=('auto', 'off', 'bf16'))
    compile: typing.Optional[bool] = flag(None, 'torch.compile the model (default: on for CUDA)')
    fid: bool = flag(False, 'compute FID of the drawn images against --fid-data (for digits: the digits score, in '
                            'the features of a digit classifier, not Inception)')
    fid_data: str = flag('auto', 'reference set for FID: cifar10 (train split), shapes, digits (train split), folder '
                                 'or beton (--data-dir DIR or FILE.beton); auto: digits for a 1-channel model, else '
                                 'cifar10', choices=('auto',) + REFERENCE_SETS)
    data_dir: str = flag('./data', 'where the FID / bits/dim data set lives (digits: where the digit classifier is '
                                   'cached; the digits come with scikit-learn)')
    fid_stats: str = flag('', 'cache of the reference statistics (.npz; default: DATA_DIR/fid_stats_<set>_<size>.npz)')
    inception_weights: str = flag('', 'local InceptionV3 weights for FID (torch-fidelity\'s '
                                      'weights-inception-2015-12-05-6726825d.pth); default: download')
    bpd: bool = flag(False, 'compute the variational bound in bits/dim (T model calls per image)')
    bpd_data: str = flag('auto', 'data set for bits/dim: cifar10 (test split), shapes, digits (held-out split), '
                                 'folder or beton; auto: digits for a 1-channel model, else cifar10',
                         choices=('auto',) + REFERENCE_SETS)
    bpd_num: int = flag(10000, 'images for bits/dim, at most what the data set holds (CIFAR-10 test: 10000, '
                               'held-out digits: 450)', at_least=1)
    export_diffusers: str = flag('', 'instead of sampling, write the checkpoint\'s --weights as a diffusers '
                                     'DDPMPipeline folder here (DDPMPipeline.from_pretrained loads it)')
    bpd_timesteps: int = flag(0, 'bits/dim: 0 for the full bound (T model calls per image), K for its unbiased '
                                 'Monte Carlo estimate from K stratified timesteps (K + 1 calls per image)')


# ----------------------------------------------------------------------------- load and validate

DEFAULT_STEPS = 50  # ddim's and dpm++'s model calls where --steps is not given


def load_model(path: str, weights: str, device, student: bool = False, named_as: str = None) -> tuple:
    """(model in eval mode, its UNetConfig, its diffusion.Schedule, what it predicts: 'eps' or 'v')
    from a train.py checkpoint or a diffusers folder (its scheduler/scheduler_config.json, or the
    paper's schedule without one); with `student`, from a distill.py student ('v' or 'x'). Errors
    name the file as `named_as` (default: --ckpt PATH)."""
    named_as = named_as or f'--ckpt {path}'
    if os.path.isdir(path):
        model, scheduler = read_diffusers(path, named_as), diffusers_scheduler(path, named_as)
        kind, num_steps, prediction = scheduler['schedule'], scheduler['num_steps'], scheduler['prediction']
        if prediction not in (students.STUDENT_PREDICTIONS if student else diffusion.PREDICTIONS):
            raise ConfigError(f'{named_as}: its scheduler predicts {prediction!r}, which only a student exported with '
                              f'its student.json draws from')
    else:
        ckpt = read_checkpoint(path, named_as, student_ok=student)
        model, num_steps = model_from_checkpoint(ckpt, weights, named_as), 1000
        kind, prediction = ckpt['config'].get('schedule'), ckpt['config'].get('prediction', 'eps')
        if student:
            prediction = ckpt['student'].get('prediction')
        if kind not in ('linear', 'cosine') or prediction not in (students.STUDENT_PREDICTIONS if student
                                                                  else diffusion.PREDICTIONS):
            raise ConfigError(f'{named_as}: not a train.py checkpoint (its schedule {kind!r}, '
                              f'prediction {prediction!r})')
    require_finite(model.state_dict(), f'{named_as}: its {weights} weights', 'sample an earlier checkpoint')
    return model.to(device).requires_grad_(False), model.config, diffusion.make_schedule(num_steps, kind), prediction


def validate(cfg: SampleConfig, config: UNetConfig, sched: diffusion.Schedule) -> SampleConfig:
    """The flags that depend on the model (its schedule, its channels), and the output folder
    (created and checked writable); check_ranges checked the others before the model was loaded.
    Returns cfg with --fid-data, --bpd-data and, for a class-conditional model, --label and
    --guidance resolved."""
    cfg = check_conditioning(cfg, config)
    for name in ('fid_data', 'bpd_data'):
        value = getattr(cfg, name)
        if value == 'auto':
            cfg = dataclasses.replace(cfg, **{name: 'digits' if config.in_channels == 1 else 'cifar10'})
        elif data.channels_of(value) != config.in_channels:
            raise ConfigError(f'--{name.replace("_", "-")} {value}: its images have {data.channels_of(value)} '
                              f'channel(s), the model draws {config.in_channels}')
    if cfg.fid_stats and cfg.fid_data == 'digits':
        raise ConfigError(f'--fid-stats {cfg.fid_stats}: the digits score reads no Inception statistics (its '
                          f'reference is the digit classifier\'s features of the training split); drop the flag')
    if cfg.sampler == 'ddpm' and cfg.steps is not None:
        raise ConfigError(f'--steps {cfg.steps}: --sampler ddpm is the ancestral sampler of all T={sched.num_steps} '
                          f'steps and takes no step count; use --sampler ddim or dpm++ for fewer')
    cfg = dataclasses.replace(cfg, steps=DEFAULT_STEPS if cfg.steps is None else cfg.steps)
    if cfg.sampler in diffusion.SPACINGS or cfg.spacing is not None:  # resolved, so that samples.json names it
        try:
            cfg = dataclasses.replace(cfg, spacing=diffusion.spacing_for(cfg.sampler, cfg.spacing, cfg.steps))
        except ValueError as error:
            raise ConfigError(f'--spacing {cfg.spacing}: {error}') from None
    if cfg.sampler != 'ddpm' and cfg.steps > sched.num_steps:
        raise ConfigError(f'--steps {cfg.steps}: the model\'s schedule has only T={sched.num_steps} steps')
    if not 0 <= cfg.bpd_timesteps < sched.num_steps:
        raise ConfigError(f'--bpd-timesteps must be in [0, {sched.num_steps - 1}], got {cfg.bpd_timesteps}')
    check_inception_weights(cfg.inception_weights)
    if cfg.export_diffusers:
        if os.path.exists(cfg.export_diffusers) and (not os.path.isdir(cfg.export_diffusers)
                                                     or os.listdir(cfg.export_diffusers)):
            raise ConfigError(f'--export-diffusers {cfg.export_diffusers}: exists and is not an empty folder')
        check_writable(os.path.dirname(os.path.abspath(cfg.export_diffusers)), '--export-diffusers')
        return cfg
    if cfg.grid and cfg.num > GRID_LIMIT:
        raise ConfigError(f'--grid draws at most {GRID_LIMIT} images into one PNG, got --num {cfg.num}')
    if cfg.grid and cfg.format != 'png':
        raise ConfigError(f'--grid writes one PNG: --format {cfg.format} has no meaning with it')
    if cfg.sampler == 'dpm++' and cfg.clip not in ('auto', 'none'):
        raise ConfigError(f'--clip {cfg.clip}: DPM-Solver++ solves the ODE of the model as it is; it does not clip x0')
    if cfg.fid and cfg.num < 2:
        raise ConfigError(f'--fid compares statistics of the samples (a mean and a covariance): --num {cfg.num} is too '
                          f'few; papers draw 50,000 (digits: 450, the size of the floor\'s set)')
    if not cfg.bpd or cfg.fid:  # images will be written
        check_writable(cfg.out, '--out')
    return cfg


def check_conditioning(cfg: SampleConfig, config: UNetConfig) -> SampleConfig:
    """--label and --guidance against the model: refused for an unconditional one, --label checked
    against its classes; resolved to each class in turn (-1) at scale 1 where not given."""
    given = [f'--{name} {getattr(cfg, name)}' for name in ('label', 'guidance') if getattr(cfg, name) is not None]
    if not config.num_classes:
        if given:
            raise ConfigError(f'{", ".join(given)}: {cfg.ckpt} is an unconditional model (trained without '
                              f'--class-cond): it has no classes to guide towards')
        return cfg
    if cfg.label is not None and cfg.label >= config.num_classes:
        raise ConfigError(f'--label {cfg.label}: the model has {config.num_classes} classes, 0 to '
                          f'{config.num_classes - 1}')
    return dataclasses.replace(cfg, label=-1 if cfg.label is None else cfg.label,
                               guidance=1.0 if cfg.guidance is None else cfg.guidance)


def for_student(cfg: SampleConfig, given: set, student: dict) -> SampleConfig:
    """A distill.py student draws with its own sampler: its steps on the grid it was trained on
    (students.student_timesteps; sampler 'student'), or a consistency student its 1 or 2 calls (sampler
    'consistency'; --mid-timestep may move a 2-call one's second call). Another --steps or --sampler, the
    flags of another sampler, --guidance (it learnt one scale) and what needs all T steps are refused in
    one line."""
    steps, named = student['steps'], f"{cfg.ckpt} is a {student['steps']}-step student of distill.py"
    consistency = student.get('method') == 'consistency'
    if consistency:
        named = f"{cfg.ckpt} is a {steps}-call consistency student of distill.py"
    if cfg.steps is not None and cfg.steps != steps:
        raise ConfigError(f'--steps {cfg.steps}: {named}, drawn with its own {steps} steps on the grid it was trained '
                          f'on; leave --steps out')
    if cfg.mid_timestep is not None and not (consistency and steps == 2):
        raise ConfigError(f'--mid-timestep {cfg.mid_timestep}: {named}; only a 2-call consistency student has a '
                          f'second call to move')
    if consistency:
        if cfg.export_diffusers:
            raise ConfigError(f'--export-diffusers: {named}; its sampler is not DDIM, which the export\'s '
                              f'DDIMPipeline runs')
        mid = student['timesteps'][-1] if cfg.mid_timestep is None and steps == 2 else cfg.mid_timestep
        cfg = dataclasses.replace(cfg, mid_timestep=mid)
    learnt = f", guidance {student['guidance']} learnt" if student.get('guidance') is not None else ''
    own = 'consistency sampling' if consistency else 'DDIM on its grid'
    for name in ('sampler', 'eta', 'spacing', 'variance', 'clip', 'guidance'):
        if name in given:
            raise ConfigError(f'--{name} {getattr(cfg, name)}: {named}, drawn with its own sampler ({own}'
                              f'{learnt}); leave --{name} out')
    if cfg.bpd:
        raise ConfigError(f'--bpd: {named}, a few-step sampler; this needs a model of every timestep (its teacher)')
    grid = students.student_timesteps(steps)  # diffusers' DDIM steps from t to t - T // N: it must land on the grid
    if cfg.export_diffusers and any(t - 1000 // steps != after for t, after in zip(grid, grid[1:])):
        raise ConfigError(f'--export-diffusers: {named}; diffusers\' DDIMScheduler steps by 1000 // {steps} from t = '
                          f'999, which is not its grid (a student of 1, 2, 4 or 8 steps is)')
    # --guidance names the scale it learnt (recorded and reported); drawing.draw_batch draws it in one pass
    return dataclasses.replace(cfg, sampler='consistency' if consistency else 'student', steps=steps,
                               guidance=student.get('guidance'))


def load(cfg: SampleConfig, given: set, device) -> tuple:
    """(cfg resolved, model, its UNetConfig, its schedule, what it predicts, its student record or None): a
    distill.py student redirected to its own sampler (for_student), the weights loaded, every flag checked
    against the model (validate)."""
    student = read_student_record(cfg.ckpt)
    if student is not None:
        cfg = for_student(cfg, given, student)
    elif cfg.mid_timestep is not None:
        raise ConfigError(f'--mid-timestep {cfg.mid_timestep}: {cfg.ckpt} is not a consistency student of distill.py; '
                          f'only a 2-call one has a second call to move')
    model, config, sched, prediction = load_model(cfg.ckpt, cfg.weights, device, student is not None)
    return validate(cfg, config, sched), model, config, sched, prediction, student


# ----------------------------------------------------------------------------- draw

def stream_samples(model, config: UNetConfig, sched: diffusion.Schedule, cfg: SampleConfig, device,
                   prediction: str = 'eps') -> dict:
    """Draws the batches --out still lacks, writing each as soon as it is drawn (memory: one
    batch); a rerun with the same arguments continues a stopped run, with the images one run
    would have drawn. SIGTERM or Ctrl-C: the batch under way is drawn and written, then the run
    stops (exit 0). The .npz is assembled once every batch is on disk."""
    size, num_batches = config.image_size, math.ceil(cfg.num / cfg.batch_size)
    todo = continue_or_start(cfg, config)
    stop, drawn, start = StopFlag(), 0, time.perf_counter()
    restore_signals = stop.install()
    try:
        for index, images in zip(todo, draw(model, config, sched, cfg, device, batches=todo, prediction=prediction)):
            write_batch(images, batch_paths(cfg, index), cfg.format)
            drawn += len(images)
            if stop.reason is not None:
                break
    finally:
        restore_signals()
    seconds = time.perf_counter() - start
    complete = drawn == sum(min(cfg.batch_size, cfg.num - b * cfg.batch_size) for b in todo)
    path = cfg.out
    if complete:
        path = (npz_path(cfg, size) if os.path.isfile(npz_path(cfg, size)) else assemble_npz(cfg, config, num_batches)
                ) if cfg.format == 'npz' else os.path.join(cfg.out, f'{0:06d}.png ... {cfg.num - 1:06d}.png')
    return {'images': drawn, 'seconds': seconds, 'complete': complete, 'stopped': None if complete else stop.reason,
            'path': path}


def draw_grid(model, config: UNetConfig, sched: diffusion.Schedule, cfg: SampleConfig, device,
              prediction: str) -> tuple:
    """--grid: every image into OUT/grid.png (a row per class for a class-conditional model); (what was
    drawn, the images as batches)."""
    release_lock = claim_folder(cfg.out, '--out', ('grid.png.tmp', MANIFEST + '.tmp'))
    try:
        settings = sample_settings(cfg)
        our_samples(cfg, settings)  # into a folder of ours, as the separate images are
        write_manifest(cfg, settings)
        start = time.perf_counter()
        images = torch.cat(list(draw(model, config, sched, cfg, device, prediction=prediction)))
        drawn = {'images': len(images), 'seconds': time.perf_counter() - start, 'complete': True, 'stopped': None,
                 'path': os.path.join(cfg.out, 'grid.png')}
        by_class = config.num_classes if cfg.label == -1 else 0
        if by_class and len(images) % by_class:
            print(f'--grid: {len(images)} images are not a whole row of each of the {by_class} classes: one square '
                  f'grid, image i of class i mod {by_class} (--num {by_class * max(1, len(images) // by_class)} '
                  f'gives a row per class)')
        write_grid_png(images, drawn['path'], by_class)
    finally:
        release_lock()
    return drawn, images.split(cfg.batch_size)


def draw_files(model, config: UNetConfig, sched: diffusion.Schedule, cfg: SampleConfig, device,
               prediction: str) -> tuple:
    """The images into --out, one file each or one .npz (stream_samples); (what was drawn, the samples on
    disk as batches)."""
    leftovers = ('[0-9]*.png.tmp', '*.npz.tmp', 'parts/batch_*.npy.tmp', MANIFEST + '.tmp')
    release_lock = claim_folder(cfg.out, '--out', leftovers)
    try:
        drawn = stream_samples(model, config, sched, cfg, device, prediction)
    finally:
        release_lock()
    return drawn, written_batches(cfg, config)


def speed_of(drawn: dict, cfg: SampleConfig, config: UNetConfig, sched: diffusion.Schedule) -> dict:
    """img/s and TFLOP/s of the drawing (model calls x forward FLOPs; a guided call is two halves)."""
    steps = sched.num_steps if cfg.sampler == 'ddpm' else cfg.steps
    if not drawn['images'] or drawn['seconds'] <= 0:
        return {}
    guided = config.num_classes and cfg.guidance not in (0, 1) and cfg.sampler not in STUDENT_SAMPLERS
    flops = count_flops(config)['forward'] * steps * drawn['images'] * (2 if guided else 1)
    speed = {'img_per_s': drawn['images'] / drawn['seconds'], 'tflops': flops / drawn['seconds'] / 1e12}
    print(f"{drawn['images']} images ({cfg.sampler}, {steps} steps) in {drawn['seconds']:.1f}s: "
          f"{speed['img_per_s']:.1f} img/s, {speed['tflops']:.2f} TFLOP/s (first batch includes compilation)")
    return speed


# ----------------------------------------------------------------------------- score

def references(cfg: SampleConfig, config: UNetConfig, device) -> tuple:
    """(the digits judge, or the Inception extractor and the reference statistics) of --fid, made before any
    drawing: a missing data set or network fails first, not after the sampling."""
    judge = DigitsJudge(config.image_size, cfg.data_dir) if cfg.fid and cfg.fid_data == 'digits' else None
    extractor = inception_extractor(cfg.inception_weights, device) if cfg.fid and not judge else None
    reference = (reference_statistics(cfg.fid_data, cfg.data_dir, config.image_size, extractor, cfg.batch_size,
                                      cfg.fid_stats) if extractor else None)
    return judge, extractor, reference


def score(batches, cfg: SampleConfig, config: UNetConfig, judge, extractor, reference) -> dict:
    """The digits score (and, for a class-conditional digits model, whether each sample is the digit asked)
    or FID of the samples."""
    if judge:
        images = torch.cat(list(batches))
        result = {'digits': {**judge.score(judge.features(images)), **judge.memorisation(images), 'floor': judge.floor}}
        print(digits_summary(result['digits']))
        if config.num_classes == 10:
            asked = class_labels(0, len(images), config.num_classes, cfg.label)
            result['conditioning'] = judge.conditioning(images, asked)
            print(conditioning_summary(result['conditioning'], cfg.guidance))
        return result
    fake = statistics(features_of(tqdm(batches, desc='sample features', leave=False), extractor))
    result = {'fid': frechet_distance(fake, reference)}
    print(f"FID against {cfg.fid_data} ({cfg.num} samples): {result['fid']:.3f}")
    return result


def measure_bpd(model, config: UNetConfig, sched: diffusion.Schedule, cfg: SampleConfig, device,
                prediction: str) -> dict:
    bpd = bits_per_dim(model, config, sched, cfg, device, prediction)
    print(f"bits/dim on {cfg.bpd_data} ({bpd['images']} images): {bpd['bits_per_dim']:.4f} +- {bpd['stderr'] or 0:.4f} "
          f"(standard error over images)")
    return bpd


def export_diffusers(model, sched: diffusion.Schedule, cfg: SampleConfig, prediction: str,
                     student: dict = None) -> dict:
    try:
        save_diffusers(model.cpu().float(), diffusion.schedule_kind(sched), sched.num_steps, cfg.export_diffusers,
                       prediction, student)
    except ValueError as error:
        raise ConfigError(f'--export-diffusers: diffusers cannot represent this network or schedule '
                          f'({error})') from None
    pipeline = 'DDPMPipeline' if student is None else f"DDIMPipeline (draw with num_inference_steps={student['steps']})"
    print(f'wrote {cfg.export_diffusers}: a diffusers {pipeline} of the {cfg.weights} weights of {cfg.ckpt} '
          f'({diffusion.schedule_kind(sched)} schedule, T={sched.num_steps})')
    if model.config.num_classes:  # the pipelines pass no class_labels: the UNet is called directly
        print(f'  class-conditional ({model.config.num_classes} classes, "no class" = {model.config.num_classes}): '
              f'{pipeline.split()[0]} cannot draw it (it passes no class labels); call pipeline.unet(x, t, '
              f'class_labels=...) in your own loop, or sample it here with sample.py --ckpt {cfg.export_diffusers}')
    return {'ckpt': cfg.ckpt, 'weights': cfg.weights, 'export': cfg.export_diffusers}


# ----------------------------------------------------------------------------- main

def main(cfg: SampleConfig, given: set = None) -> dict:
    check_ranges(cfg)
    device = pick_device(cfg.device, 0)
    cfg, model, config, sched, prediction, student = load(cfg, changed_fields(cfg) if given is None else given, device)
    if cfg.export_diffusers:
        return export_diffusers(model, sched, cfg, prediction, student)
    if (device.type == 'cuda') if cfg.compile is None else cfg.compile:
        model = torch.compile(model)
    result = {'ckpt': cfg.ckpt, 'weights': cfg.weights, 'sampler': cfg.sampler, 'device': str(device)}
    if cfg.bpd:
        result['bpd'] = measure_bpd(model, config, sched, cfg, device, prediction)
        if not cfg.fid:
            return result  # --bpd alone evaluates; add --fid to sample as well
    scorers = references(cfg, config, device) if cfg.fid else None
    drawn, batches = (draw_grid if cfg.grid else draw_files)(model, config, sched, cfg, device, prediction)
    result.update(drawn, **speed_of(drawn, cfg, config, sched))
    if not drawn['complete']:
        print(f"stopped by {drawn['stopped']}: {cfg.out} holds what was drawn; the same command continues it")
        return result
    print(f"{cfg.num} images in {drawn['path']}" + ('' if drawn['images'] else ' (all drawn before: nothing to do)'))
    return {**result, **(score(batches, cfg, config, *scorers) if scorers else {})}


def cli(argv=None) -> int:
    return run_main(main, parse_config(argv, SampleConfig, __doc__), given_fields(argv, SampleConfig))


if __name__ == '__main__':
    sys.exit(cli())

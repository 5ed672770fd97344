"""Time to quality: training minutes until samples reach a score, for the paper's recipe as train.py
runs it, for each lever added on top of it, and for diffusers' training recipe on the same images, in
one ladder. Every run is scored every --eval-every images and ends when its score reaches --target
(12.3 for digits); the clock counts training alone (the first, compiling step included).

The ladder, in the order it runs (each step a part that `--train` can run alone, once those above it
are finished):
  baseline    the paper's recipe, --seeds seeds (the headline's reference);
  speed       levers of the step's speed, each on the levers kept so far, --lever-seeds seeds paired
              with the arm below at --speed-images, judged by img/s;
  quality     levers of the images needed, each on the levers kept so far, --lever-seeds seeds paired
              with the arm below, judged by the minutes to --target;
  fastest     the arm with every kept lever (the headline) to --seeds seeds;
  peer        diffusers' recipe: its lr over a grid at its batch and at ours (one seed each at
              --screen-images), then the best variant at --seeds seeds.
A lever is kept when its mean paired gain exceeds the standard deviation of its paired gains (the
pairs' spread); the report shows each gain with its 95% interval, and the headline ratios with theirs.

    python scripts/time_to_quality.py                          # the CPU ladder on digits (hours; in parts)
    python scripts/time_to_quality.py --train baseline         # one part; the others' finished runs are read
    python scripts/time_to_quality.py --ladder prediction --seeds 3   # v-prediction and Min-SNR, side by side
    python scripts/time_to_quality.py --dataset cifar10 --preset ddpm-cifar10 --device cuda \\
        --images 20000000 --eval-every 2000000 --eval-samples 10000 --target 5   # FID on a GPU

Each finished run's curve is OUT_DIR/STEM-runs/<arm>-<images>-seed<k>.json (commit it: a ladder on
another machine continues from these); RUNS_DIR holds the runs in progress. The report,
OUT_DIR/STEM.{json,md,png}, is written by every command that gets past the baseline; until the last
part has run it holds the finished parts and says so on its first line.
"""
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import diffusion  # noqa: E402
import evaluation  # noqa: E402
import train  # noqa: E402
from cli import (ConfigError, StopFlag, StopRequested, brief, check_plain_name, check_ranges, flag,  # noqa: E402
                 parse_config, run_main)
from devices import cpu_has_native_bf16, device_name, device_slug, pick_device  # noqa: E402
from diffusers_io import (diffusers_config, diffusers_missing_reason, recipe_batches,  # noqa: E402
                          recipe_loader, recipe_parts, recipe_step, state_dict_from_diffusers, write_image_folder)
from drawing import Sampling, draw  # noqa: E402
from files import (atomic_open, check_creatable, check_writable, claim_folder, folder_in_use,  # noqa: E402
                   write_once)
from ladder_stats import (mean_sd, paired_gain, paired_ratio, score_at, screen_score, summarise,  # noqa: E402
                          unpaired_ratio)
from model import UNet, get_config  # noqa: E402
from reports import markdown_table, provenance, pyplot, save_figure, write_report  # noqa: E402

PARTS = ('baseline', 'speed', 'quality', 'fastest', 'peer')


@dataclass
class LadderConfig:
    ladder: str = flag('speed', 'which arms: speed (the baseline, the levers, the diffusers recipe) or prediction '
                                '(the paper\'s eps and L_simple against v-prediction, Min-SNR-5 and both)',
                       choices=('speed', 'prediction'))
    arms: str = flag('', 'comma-separated levers and diffusers variants in the ladder (default: all; the baseline and '
                         'the diffusers recipe at its own settings always run): a smaller ladder')
    train: str = flag('', 'comma-separated parts whose runs this command trains (' + ', '.join(PARTS) + '; default: '
                          'all); the other parts\' runs are read back finished, and the ladder stops where one is '
                          'missing')
    seeds: int = flag(5, 'seeds of the baseline, the best diffusers variant and the fastest arm (the headline '
                         'ratios); of every arm in the prediction ladder', at_least=1)
    lever_seeds: int = flag(3, 'seeds of each lever, the same seeds as the arm below it (paired)', at_least=2)
    images: int = flag(400_000, 'planned training images of a run (its lr schedule\'s length); it ends at its first '
                                'evaluation at or below --target', at_least=1)
    decay_images: int | None = flag(None, 'planned images of the runs whose lr decays to their end: the diffusers '
                                             'recipe\'s final seeds, the lr-decay lever\'s and, once it is kept, the '
                                             'arms above it (default: half of --images, 200,000: about the demo\'s '
                                             'plan, what a user would plan for this target)', at_least=1)
    speed_images: int = flag(25_000, 'training images of each run of the speed levers and of the arm below them '
                                     '(judged by img/s alone)', at_least=1)
    screen_images: int = flag(100_000, 'training images of each diffusers variant\'s screen (one seed; judged by '
                                       'the mean of its last two scores)', at_least=1)
    easy_at: int = flag(100_000, 'the easier target: the score the baseline\'s worst seed has after this many '
                                 'images', at_least=1)
    eval_every: int = flag(12_500, 'training images between evaluations', at_least=1)
    eval_samples: int = flag(450, 'samples per score (digits: 450, the size of the floor\'s held-out set)', at_least=2)
    target: float | None = flag(None, 'the target score (default for the digits score, whose floor is about 7: 12.3, '
                                      'what the paper\'s objective reaches in about 242k images; FID: needed)',
                                positive=True)
    sampler: str = flag('dpm++', 'sampler of the evaluations', choices=('ddim', 'dpm++', 'ddpm'))
    sample_steps: int = flag(20, 'its model calls', at_least=1)
    dataset: str = flag('digits', 'digits (the digits score) or another train.py data set (FID)',
                        choices=('digits', 'cifar10', 'shapes', 'folder'))
    preset: str = flag('tiny', 'UNet preset')
    image_size: int = flag(16, 'image resolution', at_least=4)
    device: str = flag('cpu', 'cpu, cuda or cuda:N')
    data_dir: str = flag('./data', 'the data (and the digit classifier\'s cache)')
    runs_dir: str = flag('runs/time-to-quality', 'where the runs in progress go (and the recipe\'s PNG copy of the '
                                                 'data)')
    out_dir: str = flag('results', 'where the report and the finished runs\' curves go')
    stem: str = flag('', 'report file name stem (default: <device>-<dataset>-time-to-quality, or -prediction-study)')
    workers: int = flag(1, 'runs trained at once, each in its own process (then set OMP_NUM_THREADS; times are '
                           'then of a shared machine)', at_least=1)


@dataclass
class Arm:
    name: str
    changes: str  # what it changes, in words
    flags: list = field(default_factory=list)  # train.py flags on top of the common ones; a recipe's --batch-size, --lr
    recipe: bool = False  # diffusers' training example instead of train.py


@dataclass
class Lever:
    name: str
    changes: str
    flags: list
    judged_by: str  # 'speed': img/s at --speed-images; 'time': minutes to --target
    images: int | None = None  # the planned images of its runs and, once kept, of the arms above it (None: unchanged)


BASELINE = ['--amp', 'off', '--no-compile', '--no-channels-last', '--no-fused-adam']  # fp32 eager, as the paper's
BASELINE_ARM = Arm('baseline', "the paper's recipe as train.py runs it here: fp32, eager, NCHW, foreach Adam", BASELINE)


def ours(cfg: LadderConfig) -> train.TrainConfig:
    return train.check_flags(base_flags(cfg))


def speed_levers(device, cfg: LadderConfig) -> list:
    """The levers in the order of the speed-up table: how fast a step runs, then how many images the
    samples need (the batch lever doubles the preset's batch, its learning rate x sqrt(2); the ones
    after it are the literature's, docs/training.md#levers-of-the-images-needed, then the preset's own
    settings: its peak lr, dropout and warm-up)."""
    batch, lr = doubled_batch(cfg)
    preset = ours(cfg)
    peak_lr = one_digit(2 * preset.lr)
    levers = [Lever('+ bf16', 'bf16 autocast', ['--amp', 'bf16'], 'speed')] if (
        device.type == 'cuda' or cpu_has_native_bf16()) else []
    return chosen(cfg, levers + [
        Lever('+ channels-last', 'channels-last memory format', ['--channels-last'], 'speed'),
        Lever('+ fused Adam', 'one fused Adam kernel', ['--fused-adam'], 'speed'),
        Lever('+ compile', 'torch.compile of the whole loss (Inductor; its compile time is counted)', ['--compile'],
              'speed'),
        Lever('+ v-prediction', 'the network predicts v (Salimans & Ho, 2022)', ['--prediction', 'v'], 'time'),
        Lever('+ Min-SNR-5', 'loss weights min(SNR, 5) (Hang et al., 2023)', ['--loss-weight', 'min-snr'], 'time'),
        Lever(f'+ batch {batch}', f"twice the {cfg.preset} preset's batch, the learning rate x sqrt(2) ({lr})",
              ['--batch-size', str(batch), '--lr', lr], 'time'),
        Lever('+ cosine lr decay', f'the lr decays with a cosine to 0 at the planned end, {decay_plan(cfg):,} images '
              "(diffusers' recipe; Loshchilov & Hutter, 2017)", ['--lr-decay', 'cosine'], 'time', decay_plan(cfg)),
        Lever('+ log-normal t', "t drawn so that ln sigma ~ N(-1.2, 1.2^2) (EDM, Karras et al., 2022)",
              ['--t-sampling', 'lognormal'], 'time'),
        Lever('+ Laplace t', 't drawn so that the log-SNR ~ Laplace(0, 0.5) (Hang et al., 2024); replaces a kept '
              'log-normal t', ['--t-sampling', 'laplace'], 'time'),
        Lever('+ input perturbation', "the network's input made with eps + 0.1 xi, its target eps (DDPM-IP, Ning et "
              'al., 2023)', ['--input-perturbation', '0.1'], 'time'),
        Lever('+ Adam beta2 0.99', "Adam's beta2 0.99 (the paper's: 0.999)", ['--adam-beta2', '0.99'], 'time'),
        Lever('+ EMA half-life 5%', "the EMA's half-life 5% of the images seen (EDM)", ['--ema-length', '0.05'],
              'time'),
        Lever('+ immiscible noise', "each image paired with the nearest of its batch's noise draws (Li et al., 2024)",
              ['--immiscible'], 'time'),
        Lever('+ reweighted log-normal t', "t drawn as by '+ log-normal t', each loss weighted by (1/T) / p(t): "
              "L_simple's objective kept, its variance changed", ['--t-sampling', 'lognormal', '--t-reweight'], 'time'),
        Lever('+ reweighted Laplace t', "t drawn as by '+ Laplace t', each loss weighted by (1/T) / p(t); replaces "
              'a kept reweighted log-normal t', ['--t-sampling', 'laplace', '--t-reweight'], 'time'),
        Lever(f'+ peak lr {peak_lr}', f"twice the {cfg.preset} preset's peak learning rate", ['--lr', peak_lr],
              'time'),
        Lever('+ dropout 0.1', "dropout 0.1 in the residual blocks (the paper's CIFAR-10 setting)",
              ['--dropout', '0.1'], 'time'),
        Lever(f'+ warm-up {10 * preset.warmup}', f"a warm-up ten times the {cfg.preset} preset's",
              ['--warmup', str(10 * preset.warmup)], 'time')])


def decay_plan(cfg: LadderConfig) -> int:
    return cfg.decay_images or max(1, cfg.images // 2)


def chosen(cfg: LadderConfig, items: list) -> list:
    names = {n.strip() for n in cfg.arms.split(',') if n.strip()}
    return [i for i in items if not names or i.name in names or i.name == 'diffusers recipe']


def doubled_batch(cfg: LadderConfig) -> tuple:
    """The batch lever's setting: twice the preset's batch, its lr x sqrt(2) to one digit (2e-3 -> '3e-3')."""
    preset = ours(cfg)
    return 2 * preset.batch_size, one_digit(preset.lr * math.sqrt(2))


def one_digit(lr: float) -> str:
    mantissa, exponent = f'{lr:.0e}'.split('e')
    return f'{mantissa}e{int(exponent)}'  # 2.83e-3 -> '3e-3'


def recipe_variants(cfg: LadderConfig) -> list:
    """diffusers' recipe at its own settings (batch 16, lr 1e-4), its lr over a grid at its batch and at
    ours, and at the batch lever's batch and lr: the tuning our arms had."""
    mine, (batch, lr) = ours(cfg), doubled_batch(cfg)
    grid = [(16, lr_) for lr_ in ('1e-4', '3e-4', '1e-3')] + [(mine.batch_size, lr_) for lr_ in (
        '3e-4', '1e-3', one_digit(mine.lr))] + [(batch, lr)]
    return chosen(cfg, [Arm('diffusers recipe' if (batch, lr) == (16, '1e-4') else f'diffusers b{batch} lr {lr}',
                            "diffusers' train_unconditional.py loop and settings (AdamW, cosine to the run's "
                            f"planned end, EMAModel warm-up, 0 workers, our flip rule), batch {batch}, lr {lr}",
                            ['--batch-size', str(batch), '--lr', lr], recipe=True)
                        for batch, lr in dict.fromkeys(grid)])


def prediction_arms() -> list:
    """The paper's objective against v-prediction, Min-SNR-5 and both, at the baseline's speed."""
    return [BASELINE_ARM,
            Arm('v-prediction', 'v-prediction', BASELINE + ['--prediction', 'v']),
            Arm('Min-SNR-5', 'Min-SNR-5 weights (eps)', BASELINE + ['--loss-weight', 'min-snr']),
            Arm('v + Min-SNR-5', 'both', BASELINE + ['--prediction', 'v', '--loss-weight', 'min-snr'])]


def slug(name: str) -> str:
    return '-'.join(''.join(c if c.isalnum() else ' ' for c in name.lower()).split())  # '+ bf16' -> 'bf16'


# ----------------------------------------------------------------------------- one run

def base_flags(cfg: LadderConfig) -> list:
    return ['--dataset', cfg.dataset, '--preset', cfg.preset, '--image-size', str(cfg.image_size),
            '--device', cfg.device, '--data-dir', cfg.data_dir, '--eval-every', str(cfg.eval_every),
            '--eval-samples', str(cfg.eval_samples), '--eval-bpd-images', '50', '--eval-bpd-timesteps', '4',
            '--sampler', cfg.sampler, '--sample-steps', str(cfg.sample_steps), '--sample-every', '0',
            '--log-every', '100', '--eval-noise', 'fresh']


def run_flags(cfg: LadderConfig, job, folder: str) -> tuple:
    """train.py's flags of one run (the budget, the stop at the target, the evaluations, the outputs,
    the arm's) and the config train.py resolves them to."""
    batch = train.check_flags(base_flags(cfg) + job.arm.flags).batch_size
    flags = base_flags(cfg) + ['--steps', str(math.ceil(job.images / batch)), '--seed', str(job.seed),
                               '--out-dir', folder, *(['--stop-at-score', str(job.target)] if job.target else []),
                               *job.arm.flags]
    return flags, train.check_flags(flags)


@dataclass(frozen=True)
class Job:
    arm: Arm
    seed: int
    images: int  # planned
    target: float | None  # where it stops (None: it runs its whole budget)

    @property
    def name(self) -> str:
        return f'{slug(self.arm.name)}-{self.images}{"-screen" if self.target is None else ""}-seed{self.seed}'

    def identity(self) -> dict:
        return {'arm': {'name': self.arm.name, 'flags': self.arm.flags, 'recipe': self.arm.recipe},
                'seed': self.seed, 'images': self.images, 'stop_at': self.target}

    def __hash__(self):
        return hash(self.name)


def train_arm(job: Job, cfg: LadderConfig, folder: str) -> dict | None:
    """One train.py run; its curve, or None when a signal stopped it."""
    flags, run_cfg = run_flags(cfg, job, folder)
    if train.cli(flags) != 0:
        raise RunFailed(f'{job.arm.name}, seed {job.seed}: train.py failed (its error is above)')
    if not os.path.isfile(os.path.join(folder, 'metrics.jsonl')):
        return None  # stopped in its start-up: nothing trained
    with open(os.path.join(folder, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    done = [r for r in rows if r.get('kind') == 'done']
    if not done:
        return None
    if len(done) > 1 or rows[-1] is not done[0]:  # never report a run two processes wrote
        raise RunFailed(f'{folder}/metrics.jsonl holds rows of more than one process: remove {folder} and rerun')
    first_step = sum(r.get('first_step_s') or 0 for r in rows if r.get('kind') == 'train')  # each process's first
    key, evals = evaluation.score_key(cfg.dataset), {}
    for r in rows:
        if r.get('kind') == 'eval':
            evals[r['images_seen']] = r  # the last of each
    curve = [{'images': n, 'score': r[key], 'minutes': (60 * r['train_hours'] + first_step / 60),
              'eval_seconds': r['eval_seconds']} for n, r in sorted(evals.items())]
    images = done[0]['step'] * run_cfg.batch_size
    made = {key: rows[0].get(key) for key in ('device_name', 'torch', 'date', 'commit')}  # train.py's record
    return {'made': made, 'curve': curve, 'img_per_s': images / (done[0]['train_seconds'] + first_step),
            'steady_img_per_s': (images - run_cfg.batch_size) / done[0]['train_seconds'], 'batch': run_cfg.batch_size,
            'first_step_s': first_step, 'train_minutes': (done[0]['train_seconds'] + first_step) / 60,
            'wall_minutes': done[0]['wall_s'] / 60}


def recipe_arm(job: Job, cfg: LadderConfig, stop: StopFlag) -> dict | None:
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


def recipe_settings(arm: Arm) -> tuple:
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


def judge(cfg: LadderConfig, device):
    """images (uint8) -> the score our runs log: the digits score, or FID against the training split."""
    if cfg.dataset == 'digits':
        digits = evaluation.DigitsJudge(cfg.image_size, cfg.data_dir)
        return lambda images: digits.score(digits.features(images))['digits_fd']
    extractor = evaluation.inception_extractor('', device)
    reference = evaluation.reference_statistics(cfg.dataset, cfg.data_dir, cfg.image_size, extractor, 256)
    return lambda images: evaluation.frechet_distance(evaluation.statistics(evaluation.features_of(
        images.split(256), extractor)), reference)


class RunFailed(Exception):
    exit_code = 1


class Missing(Exception):
    """A run the ladder needs is not finished and its part is not trained by this command."""


def curve_path(job: Job, cfg: LadderConfig) -> str:
    return os.path.join(curves_dir(cfg), job.name + '.json')


def curves_dir(cfg: LadderConfig) -> str:
    return os.path.join(cfg.out_dir, stem_of(cfg) + '-runs')


def read_result(job: Job, cfg: LadderConfig, identity: dict) -> dict | None:
    """The finished run's result from its curve file; None when there is none, or it is of another arm
    (trained again). A damaged file, or one of another ladder, is one line and exit 2: nothing is deleted."""
    path = curve_path(job, cfg)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        run, ladder_of, curve = saved['run'], saved['ladder'], saved['curve']
        if not (isinstance(curve, list) and curve and all({'images', 'score', 'minutes', 'eval_seconds'} <= set(p)
                                                          for p in curve)):
            raise ValueError('no curve')
        float(saved['img_per_s']), float(saved['train_minutes'])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f'{path}: damaged ({brief(error, 80)}); remove it and the run is trained again') from None
    if ladder_of != identity:
        raise ConfigError(f'{path} was made by another ladder ({ladder_of}; this one: {identity}): pass another '
                          f'--out-dir or --stem') from None
    return saved if run == job.identity() else None


def run_job(job: Job, cfg: LadderConfig, identity: dict, stop: StopFlag = None) -> dict | None:
    """One run, read back when finished; else trained from its start in RUNS_DIR/<job>/ (never in a
    folder a live process still writes). Its curve file is written only when it has a curve."""
    if (saved := read_result(job, cfg, identity)) is not None:
        return saved
    folder = os.path.join(cfg.runs_dir, job.name)
    if holder := folder_in_use(folder):
        raise RunFailed(f'{folder} is still written by pid {holder.get("pid")} (a run of an earlier ladder that '
                        f'was killed?): stop it, then rerun')
    stop = stop or StopFlag()
    if stop.reason:
        return None
    shutil.rmtree(folder, ignore_errors=True)  # unfinished, or made with other flags: from its start
    os.makedirs(folder)
    restore = stop.install() if job.arm.recipe else (lambda: None)
    try:
        result = recipe_arm(job, cfg, stop) if job.arm.recipe else train_arm(job, cfg, folder)
    except StopRequested:
        result = None
    finally:
        restore()
    if result is None:
        return None
    if not result['curve']:
        raise RunFailed(f'{job.arm.name}, seed {job.seed}: the run ended before its first evaluation')
    result = {'run': job.identity(), 'ladder': identity, **result}
    os.makedirs(curves_dir(cfg), exist_ok=True)
    with atomic_open(curve_path(job, cfg)) as f:
        json.dump(result, f, indent=1)
    return result


# ----------------------------------------------------------------------------- the ladder

class Ladder:
    """The runs of one ladder: trained or read back (Missing when a needed run is not finished and its
    part is not trained now), with --workers processes when several are asked for at once."""

    def __init__(self, cfg: LadderConfig, identity: dict, stop: StopFlag):
        self.cfg, self.identity, self.stop = cfg, identity, stop
        self.parts = {p.strip() for p in cfg.train.split(',') if p.strip()} or set(PARTS)
        self.runs = {}  # arm name -> {Job: result}

    def get(self, part: str, arm: Arm, seeds, images: int, target: float) -> list | None:
        """The arm's results for `seeds`, in order; None when a signal stopped the ladder."""
        jobs = [Job(arm, seed, images, target) for seed in seeds]
        todo = [j for j in jobs if read_result(j, self.cfg, self.identity) is None]
        if todo and part not in self.parts:
            raise Missing(f'part {part!r}: {todo[0].arm.name}, seed {todo[0].seed} ({images:,} images) is not '
                          f'finished; run it with --train {part}')
        results = run_all(jobs, self.cfg, self.identity, self.stop)
        if results is None:
            return None
        self.runs.setdefault(arm.name, {}).update(zip(jobs, results))
        return results


def climb(cfg: LadderConfig, target: float, stop: StopFlag, identity: dict) -> dict | None:
    """The speed ladder (see the docstring at the top). Returns its record, as far as its finished parts
    go ('missing' says where it stopped), or None when a signal stopped it."""
    ladder, device = Ladder(cfg, identity, stop), pick_device(cfg.device)
    seeds, lever_seeds = range(cfg.seeds), range(cfg.lever_seeds)
    base = ladder.get('baseline', BASELINE_ARM, seeds, cfg.images, target)
    if base is None:
        return None
    done = {'ladder': ladder, 'decisions': {}, 'screened': {}, 'best_peer': None, 'fastest': None, 'missing': None,
            'planned': {},  # the headline arms' planned images where they are not --images
            'targets': {'target': target, 'easy_target': max(score_at(r, cfg.easy_at) for r in base)}}
    try:
        # The levers, each on the levers kept so far; `planned` is the kept arms' planned length.
        stack, below, planned = list(BASELINE), BASELINE_ARM, cfg.images
        for lever in speed_levers(device, cfg):
            arm = Arm(lever.name, lever.changes, stack + lever.flags)
            part, images = ('speed', cfg.speed_images) if lever.judged_by == 'speed' else ('quality', planned)
            theirs = ladder.get(part, below, lever_seeds, images, target)
            mine = theirs and ladder.get(part, arm, lever_seeds, lever.images or images, target)
            if mine is None:
                return None
            decision = done['decisions'][arm.name] = {'builds_on': below.name, 'judged_by': lever.judged_by,
                                                      **paired_gain(lever, mine, theirs, target, cfg.images)}
            print(f"{arm.name}: {'kept' if decision['kept'] else 'left out'} for the arms below (on top of "
                  f"{below.name})", flush=True)
            if decision['kept']:
                stack, below, planned = arm.flags, arm, lever.images or planned
        # The headline arm: every kept lever, at --seeds seeds and the full budget.
        if ladder.get('fastest', below, seeds, planned, target) is None:
            return None
        done['fastest'], done['planned'][below.name] = below.name, planned
        # The peer: the grid screened on one seed, the best variant at --seeds seeds.
        for arm in recipe_variants(cfg):  # the screen runs its whole budget: it is judged by its end
            got = ladder.get('peer', arm, [0], cfg.screen_images, None)
            if got is None:
                return None
            done['screened'][arm.name] = screen_score(got[0])
        best = min(recipe_variants(cfg), key=lambda a: done['screened'][a.name])
        if ladder.get('peer', best, seeds, decay_plan(cfg), target) is None:  # its lr always decays: that plan
            return None
        done['best_peer'], done['planned'][best.name] = best.name, decay_plan(cfg)
    except Missing as missing:
        done['missing'] = str(missing)
    return done


def side_by_side(cfg: LadderConfig, target: float, stop: StopFlag, identity: dict) -> dict | None:
    """The prediction ladder: every arm on the baseline, --seeds seeds each."""
    ladder = Ladder(cfg, identity, stop)
    base = ladder.get('baseline', BASELINE_ARM, range(cfg.seeds), cfg.images, target)
    if base is None:
        return None
    done = {'ladder': ladder, 'decisions': {}, 'screened': {}, 'best_peer': None, 'fastest': None, 'missing': None,
            'planned': {},  # the headline arms' planned images where they are not --images
            'targets': {'target': target, 'easy_target': max(score_at(r, cfg.easy_at) for r in base)}}
    try:
        for arm in chosen(cfg, prediction_arms()[1:]):
            if ladder.get('quality', arm, range(cfg.seeds), cfg.images, target) is None:
                return None
    except Missing as missing:
        done['missing'] = str(missing)
    return done


def run_all(jobs: list, cfg: LadderConfig, identity: dict, stop: StopFlag) -> list | None:
    """The jobs' results in order; None when a signal stopped the ladder. A failed run ends it: with
    --workers N, each run is a process of its own (which dies with the ladder, even a killed one),
    and the others are stopped (SIGTERM: their train.py saves and exits) and waited for."""
    if cfg.workers == 1:
        results = []
        for job in jobs:
            result = run_job(job, cfg, identity, stop)
            if result is None or stop.reason:
                return None
            results.append(result)
        return results
    import multiprocessing
    queue = [job for job in jobs if read_result(job, cfg, identity) is None]  # finished ones are read back below
    context, running, failed = multiprocessing.get_context('spawn'), {}, None
    try:
        while (queue or running) and not (stop.reason or failed):
            while queue and len(running) < cfg.workers:
                job = queue.pop(0)
                process = context.Process(target=job_process, args=(job, cfg, identity, os.getpid()))
                process.start()
                running[process] = job
            time.sleep(0.2)
            for process in [p for p in running if not p.is_alive()]:
                job = running.pop(process)
                if process.exitcode == STOPPED:
                    stop.reason = stop.reason or 'a stop in a worker'
                elif process.exitcode != 0:
                    failed = (f'{job.arm.name}, seed {job.seed}: its run failed (exit code {process.exitcode}; the '
                              f'error is above)')
    finally:
        for process in running:  # their runs save and exit
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        for process in running:
            process.join(60)
            if process.is_alive():
                process.kill()
    if stop.reason:  # a worker cut by the same signal may have failed in its start-up: a stop, not a failure
        return None
    if failed:
        raise RunFailed(failed)
    return [read_result(job, cfg, identity) for job in jobs]  # each worker wrote its own


STOPPED = 3  # a worker's exit code when a signal stopped its run


def die_with_parent(parent: int):
    """SIGTERM this process when its parent dies, even by kill -9 (Linux's parent-death signal), so that
    no orphan trains on beside a rerun; where there is none, a thread watches the parent."""
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:  # PR_SET_PDEATHSIG
            raise OSError
    except (OSError, AttributeError):
        import threading

        def watch():
            while os.getppid() == parent:
                time.sleep(1)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def job_process(job: Job, cfg: LadderConfig, identity: dict, parent: int):
    """A worker: one run; exit 0 when finished, STOPPED when a signal cut it, 1 with its error."""
    stop = StopFlag()
    stop.install()  # a signal before train.py installs its own handler is a stop too
    die_with_parent(parent)
    try:
        result = None if stop.reason else run_job(job, cfg, identity, stop)
    except Exception as error:
        print(f'error: {job.arm.name}, seed {job.seed}: {brief(error, 300)}', file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(0 if result is not None and not stop.reason else STOPPED)


# ----------------------------------------------------------------------------- checks and main

def stem_of(cfg: LadderConfig) -> str:
    return cfg.stem or (f'{device_slug(pick_device(cfg.device))}-{cfg.dataset}-'
                        f'{"time-to-quality" if cfg.ladder == "speed" else "prediction-study"}')


def ladder_identity(cfg: LadderConfig) -> dict:
    """What decides every run of the ladder: its kind, the data (their fingerprint) and the settings
    of the runs and their scores. A finished run made under other values is never reused."""
    images = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size)
    return {'ladder': cfg.ladder, 'dataset': cfg.dataset, 'data': data.fingerprint(images), 'preset': cfg.preset,
            'image_size': cfg.image_size, 'device': cfg.device, 'eval_every': cfg.eval_every,
            'eval_samples': cfg.eval_samples, 'sampler': cfg.sampler, 'sample_steps': cfg.sample_steps,
            'eval_noise': 'fresh'}


def check_arms(cfg: LadderConfig):
    """Every arm's flags through train.py's own validation, and every run (recipe runs too) reaching its
    first evaluation, before any run starts."""
    device = pick_device(cfg.device)
    levers = speed_levers(device, cfg) if cfg.ladder == 'speed' else []
    budgets = [(BASELINE_ARM, cfg.images)] + [(Arm(lv.name, '', BASELINE + lv.flags), cfg.speed_images if
                                               lv.judged_by == 'speed' else lv.images or cfg.images) for lv in levers]
    if cfg.ladder == 'prediction':
        budgets = [(arm, cfg.images) for arm in chosen(cfg, prediction_arms())]
    else:
        if reason := diffusers_missing_reason():
            raise ConfigError(f'the diffusers recipe arms: {reason}')
        budgets += [(arm, images) for arm in recipe_variants(cfg) for images in (cfg.screen_images, decay_plan(cfg))]
    speed_batch = max(train.check_flags(base_flags(cfg) + BASELINE + lv.flags).batch_size for lv in levers
                      if lv.judged_by == 'speed') if any(lv.judged_by == 'speed' for lv in levers) else 1
    if math.ceil(cfg.speed_images / speed_batch) < 2:
        raise ConfigError(f'--speed-images {cfg.speed_images}: a speed run needs two steps at least (batch '
                          f'{speed_batch}): its steady img/s is timed after the first')
    for arm, images in budgets:
        batch = recipe_settings(arm)[0] if arm.recipe else train.check_flags(base_flags(cfg) + arm.flags).batch_size
        if math.ceil(images / batch) * batch < cfg.eval_every:
            raise ConfigError(f'at batch {batch} a {images:,}-image run of {arm.name!r} ends at '
                              f'{math.ceil(images / batch) * batch:,} images, before its first evaluation '
                              f'(--eval-every {cfg.eval_every}): raise its budget or lower --eval-every')
    if not cfg.eval_every <= cfg.easy_at <= cfg.images:
        raise ConfigError(f'--easy-at {cfg.easy_at}: between --eval-every ({cfg.eval_every}) and --images '
                          f'({cfg.images}), so that the baseline has a score there')


def check_names(cfg: LadderConfig):
    every = {a.name for a in prediction_arms()} if cfg.ladder == 'prediction' else {
        x.name for x in speed_levers(pick_device(cfg.device), dataclasses.replace(cfg, arms='')) +
        recipe_variants(dataclasses.replace(cfg, arms=''))}
    unknown = [n.strip() for n in cfg.arms.split(',') if n.strip() and n.strip() not in every]
    if unknown:
        raise ConfigError(f"--arms: no lever or variant named {', '.join(map(repr, unknown))}; those of --ladder "
                          f"{cfg.ladder} are: {', '.join(sorted(every))}")


def validate(cfg: LadderConfig) -> tuple:
    """Every check before any run: flags, each arm, the data, the target against the floor, the folders
    (checked before any is made). Returns (floor or None, target, the ladder's identity)."""
    check_ranges(cfg)
    check_plain_name(stem_of(cfg), '--stem')
    unknown = {p.strip() for p in cfg.train.split(',') if p.strip()} - set(PARTS)
    if unknown:
        raise ConfigError(f"--train: no part named {', '.join(sorted(unknown))}; the parts are {', '.join(PARTS)}")
    check_names(cfg)
    check_arms(cfg)
    identity = ladder_identity(cfg)  # loads the data: a missing or empty folder is refused here
    folders = ((cfg.runs_dir, '--runs-dir'), (cfg.data_dir, '--data-dir'), (cfg.out_dir, '--out-dir'))
    for folder, name in folders:
        check_creatable(folder, name)
    floor, target = None, cfg.target
    if cfg.dataset == 'digits':
        floor = evaluation.DigitsJudge(cfg.image_size, cfg.data_dir).floor['digits_fd']
        target = 12.3 if target is None else target
        if target <= floor:
            raise ConfigError(f'--target {target}: below the floor of the digits score at {cfg.image_size}x'
                              f'{cfg.image_size} ({floor:.2f}, real held-out digits): no model can reach it')
    else:
        if target is None:
            raise ConfigError('--target: needed for FID (no default outside digits)')
        evaluation.inception_extractor('', pick_device(cfg.device))  # offline without its weights: one line here
    for folder, name in folders:  # created only now that every check has passed
        check_writable(folder, name)
    return floor, target, identity


def claim_runs_dir(cfg: LadderConfig, identity: dict):
    """RUNS_DIR holds this ladder's runs or nothing: another ladder's runs (other settings or data), a
    damaged ladder.json, files that are no ladder's, or a ladder running there now are refused, and
    nothing is deleted. Returns the lock's release."""
    manifest = os.path.join(cfg.runs_dir, 'ladder.json')
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                saved = json.load(f)
        except (OSError, ValueError) as error:
            raise ConfigError(f'{manifest}: damaged ({brief(error, 80)}); remove it if --runs-dir holds only this '
                              f'ladder\'s runs, or pass another --runs-dir') from None
        if saved != identity:
            raise ConfigError(f'--runs-dir {cfg.runs_dir} holds the runs of another ladder ({saved}): pass another '
                              f'folder')
    elif os.path.isdir(cfg.runs_dir) and set(os.listdir(cfg.runs_dir)) - {'lock'}:
        raise ConfigError(f'--runs-dir {cfg.runs_dir} holds files but no ladder.json: pass a new or empty folder')
    release = claim_folder(cfg.runs_dir, '--runs-dir')  # one ladder at a time: it deletes unfinished runs
    with atomic_open(manifest) as f:
        json.dump(identity, f)
    return release


def ladder(cfg: LadderConfig) -> dict | None:
    floor, target, identity = validate(cfg)
    release = claim_runs_dir(cfg, identity)
    stop = StopFlag()
    restore = stop.install()
    try:
        done = (climb if cfg.ladder == 'speed' else side_by_side)(cfg, target, stop, identity)
    except Missing as missing:  # before the baseline is whole: nothing to report
        print(f'this part is done; the ladder needs more runs before its report: {missing}', flush=True)
        return None
    finally:
        restore()
        release()
    if done is None:
        print(f'stopped by {stop.reason or "a signal"}: no report written (it would hold unfinished runs); the same '
              f'command continues, reusing the finished runs', flush=True)
        return None
    result = record(done, cfg, floor)
    report(result, cfg)
    if done['missing']:
        print(f"this part is done; the report holds the finished parts only: {done['missing']}", flush=True)
    return result


def record(done: dict, cfg: LadderConfig, floor) -> dict:
    """The report's record: provenance, the targets, every arm's runs and summary, the levers' paired
    gains and the headline ratios (the arm with every kept lever against the baseline, seed by seed,
    and against the best diffusers variant; in the prediction ladder each arm against the baseline)."""
    ladder, targets, target = done['ladder'], done['targets'], done['targets']['target']
    runs = {name: [got[j] for j in sorted(got, key=lambda j: (j.images, j.seed))] for name, got in ladder.runs.items()}
    planned = {name: done['planned'].get(name, cfg.images) for name in runs}
    full = {name: {r['run']['seed']: r for r in rs if r['run']['images'] == planned[name]
                   and r['run']['seed'] < cfg.seeds} for name, rs in runs.items()}
    summary = summarise({n: list(full[n].values()) or rs for n, rs in runs.items()}, targets)  # speed arms: short

    def paired(name, against='baseline', to=target):
        seeds = sorted(set(full[name]) & set(full[against]))
        return paired_ratio([full[against][s] for s in seeds], [full[name][s] for s in seeds], to) if seeds else None
    headline, name = {}, done['fastest']
    if name == 'baseline':
        headline['no lever was kept: the headline arm is the baseline'] = None
    elif name:
        headline[f'{name} against the baseline, to {target:.2f} (paired by seed)'] = paired(name)
    if name and done['best_peer']:  # the baseline too: the paper's recipe as train.py runs it, against diffusers'
        headline[f"{name} against the best diffusers variant ({done['best_peer']}), to {target:.2f} "
                 f"(independent runs, Welch)"] = unpaired_ratio(list(full[done['best_peer']].values()),
                                                                list(full[name].values()), target)
    if name and name != 'baseline':
        headline[f"{name} against the baseline, to {targets['easy_target']:.2f} (paired by seed)"] = paired(
            name, to=targets['easy_target'])
    if cfg.ladder == 'prediction':
        headline = {f'{name} against the baseline, to {target:.2f} (paired by seed)': paired(name)
                    for name in full if name != 'baseline'}
    arms = {name: {**asdict(next(iter(ladder.runs[name])).arm), **summary[name],
                   'images_per_run': planned[name] if full[name] else runs[name][0]['run']['images'],
                   **({'screen': done['screened'][name]} if name in done['screened'] else {})} for name in runs}
    at_easy = [score_at(r, cfg.easy_at) for r in full['baseline'].values()]  # one training length, across seeds
    machines = sorted({r.get('made', {}).get('device_name') for rs in runs.values() for r in rs} - {None})
    return {**provenance(device_name(pick_device(cfg.device))), 'config': asdict(cfg), 'floor': floor,
            'machines': machines, 'baseline_at_easy': {'images': cfg.easy_at, 'scores': at_easy,
                                                       'mean_sd': mean_sd(at_easy)},
            'unfinished': done['missing'], 'targets': targets, 'fastest': done['fastest'],
            'best_peer': done['best_peer'], 'headline': headline, 'levers': done['decisions'], 'arms': arms,
            'runs': runs}


# ----------------------------------------------------------------------------- the report

def report(result: dict, cfg: LadderConfig):
    targets, arms = result['targets'], result['arms']

    def ms(pair, spec):
        return '-' if pair is None or pair[0] is None else format(pair[0], spec) + (
            f' +- {pair[1]:{spec}}' if pair[1] is not None else '')

    def to(arm, key, what, spec):
        got = arm.get(key)
        if got is None:
            return '-'
        return ms(got[what], spec) if got[what] else f"not reached ({got['reached']} of {got['of']} seeds)"

    def ci(value, spec):
        if value is None:
            return '-'
        return f"{value['mean']:{spec}} [{fmt(value['low'], spec)}, {fmt(value['high'], spec)}]"
    hard, easy = f"{targets['target']:.2f}", f"{targets['easy_target']:.2f}"
    headers = ['Arm', 'what it changes', 'planned images', 'seeds', 'img/s', f'minutes to {hard}', f'images to {hard}',
               f'minutes to {easy}', 'last score', 'evaluation minutes (apart)', 'screen score']
    rows = [[name, arm['changes'], f"{arm['images_per_run']:,}", arm.get('seeds', '-'),
             ms(arm.get('img_per_s'), ',.0f'),
             to(arm, 'target', 'minutes', '.2f'), to(arm, 'target', 'images', ',.0f'),
             to(arm, 'easy_target', 'minutes', '.2f'), ms(arm.get('last'), '.2f'), ms(arm.get('eval_minutes'), '.2f'),
             fmt(arm.get('screen'), '.2f')] for name, arm in arms.items()]
    lever_rows = [[name, d['builds_on'], d['judged_by'], d['n'],
                   f"{'>= ' if d['lower_bound'] else ''}{ci(d, '.3g')} {d['unit']}", fmt(d['sd'], '.3g'),
                   'kept' if d['kept'] else 'left out'] for name, d in result['levers'].items()]
    body = markdown_table(headers, rows, left=2)  # a short (speed) run's targets are out of its reach by design
    if lever_rows:
        body += ('\n\n### Levers: paired gains (the same seeds as the arm below)\n\n' + markdown_table(
            ['Lever', 'on top of', 'judged by', 'pairs', 'mean gain [95% interval]', 'spread (sd)', 'decision'],
            lever_rows, left=3))
    if result['unfinished']:
        body = f"**Unfinished**: the parts that have run so far ({result['unfinished']}).\n\n" + body
    if result['headline']:
        body += '\n\n### Headline: minutes to the target, ratio [95% interval]\n\n' + '\n'.join(
            f"- {label}" + (f": {ratio_text(value)}" if value is not None or 'no lever' not in label else '')
            for label, value in result['headline'].items())
    if len(result['machines']) > 1:
        body += f"\n\nThe runs were made on more than one machine ({', '.join(result['machines'])}): minutes and " \
                f"img/s compare only within one."
    score = 'digits FD (classifier features)' if cfg.dataset == 'digits' else 'FID'
    ladder_rule = (f"speed levers run {cfg.speed_images:,} images (judged by img/s over a planned run: the first step "
                   f"once, the rest at their steady rate), the diffusers grid's screen {cfg.screen_images:,} (one "
                   f"seed, to its end, scored by its last two evaluations' mean); a lever is kept when its mean "
                   f"paired gain exceeds the sd of its paired gains ('>=': an arm below did not reach the target, "
                   f"its whole training counted); " if cfg.ladder == 'speed' else 'every arm on the baseline; ')
    notes = (f"; {cfg.preset} preset, {cfg.dataset} {cfg.image_size}x{cfg.image_size}; {score} of {cfg.eval_samples} "
             f"EMA samples ({cfg.sampler}, {cfg.sample_steps} calls, fresh noise at every evaluation) every "
             f"{cfg.eval_every:,} images" + (f"; floor {result['floor']:.2f}" if result['floor'] else '') +
             f". Runs plan {cfg.images:,} images, those whose lr decays {decay_plan(cfg):,} ('planned images'; "
             f"the recipe's cosine decays to its run's plan), and end at their first score at or below {hard}. "
             f"Targets: {hard}, and {easy}, the baseline's worst seed's score at {cfg.easy_at:,} images. Mean +- sd "
             f"over seeds; " + ladder_rule +
             "training minutes count the first (compiling) step, not the evaluations; a target not reached by every "
             "seed is 'not reached', never extrapolated; '>' marks a ratio to runs that did not all reach it (their "
             "whole training time)")
    title = 'Time to quality: training minutes to a score, ' + ('per lever' if cfg.ladder == 'speed' else
                                                                 'per objective')
    png = write_report(cfg.out_dir, stem_of(cfg), result, title, body, notes=notes)
    plot(result, cfg, png, score)
    print(body)


def fmt(value, spec: str) -> str:
    return '-' if value is None else format(value, spec)


def ratio_text(value) -> str:
    if value is None:
        return 'the fast arm did not reach it on every seed'
    bound = '> ' if value['bound'] else ''
    seeds = value['seeds'] if value['paired'] else f"{value['seeds'][0]} and {value['seeds'][1]}"
    return (f"{bound}{value['ratio']:.2f}x [{bound}{fmt(value['low'], '.2f')}, {fmt(value['high'], '.2f')}] "
            f"({seeds} seeds)")


def plot(result: dict, cfg: LadderConfig, png: str, score: str):
    fig, ax = pyplot().subplots(figsize=(9, 5.5))
    for name, colour in zip(result['arms'], pyplot().cm.tab10.colors * 3):
        curves = [r for r in result['runs'][name] if r['run']['images'] == result['arms'][name]['images_per_run']]
        if not curves:
            continue
        points = min(len(c['curve']) for c in curves)
        minutes = [statistics.mean(c['curve'][i]['minutes'] for c in curves) for i in range(points)]
        scores = [[c['curve'][i]['score'] for c in curves] for i in range(points)]
        ax.plot(minutes, [statistics.mean(s) for s in scores], marker='o', color=colour, markersize=3,
                label=f'{name} ({len(curves)} seed{"s" if len(curves) > 1 else ""})',
                linestyle='--' if result['arms'][name]['recipe'] else '-')
        if len(curves) > 1:
            ax.fill_between(minutes, [min(s) for s in scores], [max(s) for s in scores], color=colour, alpha=0.12)
    for key, style in (('easy_target', ':'), ('target', '-.')):
        ax.axhline(result['targets'][key], color='gray', linestyle=style, label=f"target {result['targets'][key]:.2f}")
    if result['floor']:
        ax.axhline(result['floor'], color='black', linewidth=0.8, label=f"floor {result['floor']:.2f}")
    ax.set(xlabel='training minutes (evaluations left out; curves up to the seeds\' shortest)', ylabel=score,
           yscale='log')
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7)
    ax.set_title(f"{result['device']}, torch {result['torch']}, {result['date'][:10]}", fontsize=8)
    save_figure(fig, png, dpi=110)


def main(argv=None) -> int:
    return run_main(ladder, parse_config(argv, LadderConfig, __doc__))


if __name__ == '__main__':
    sys.exit(main())

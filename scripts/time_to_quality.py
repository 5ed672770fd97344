"""Time to quality: training minutes until samples reach a score, for the paper's recipe as train.py
runs it, for each lever added on top of it (one per arm, in the order of the speed-up table; a lever
stays for the arms below only where it paid: faster steps, or the baseline's score in fewer minutes),
and for diffusers' training recipe on the same images, all in one ladder. Each run trains with an evaluation
every --eval-every images; the clock counts training alone (the first, compiling step included),
evaluations are timed apart. Targets: the baseline's final score (its worst seed's), and --target.

    python scripts/time_to_quality.py --out-dir results                    # the CPU ladder on digits
    python scripts/time_to_quality.py --ladder prediction --seeds 3         # v-prediction and Min-SNR, by seed
    python scripts/time_to_quality.py --arms 'baseline,diffusers recipe' --seeds 1 --images 2000 --eval-every 1000 \\
        --out-dir /tmp/q --runs-dir /tmp/q/runs                             # a smoke run
    python scripts/time_to_quality.py --dataset cifar10 --preset ddpm-cifar10 --device cuda \\
        --images 20000000 --eval-every 2000000 --eval-samples 10000 --target 5  # FID on a GPU

Runs go to RUNS_DIR/<arm>-seed<k>/ and a finished one (its curve.json) is reused, so a stopped or
killed ladder continues with the same command; an unfinished run is trained again from its start.
The report: OUT_DIR/STEM.{json,md,png}.
"""
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
from cli import (ConfigError, StopFlag, brief, check_plain_name, check_ranges, flag, parse_config,  # noqa: E402
                 run_main)
from devices import cpu_has_native_bf16, device_name, pick_device  # noqa: E402
from diffusers_io import (diffusers_config, diffusers_missing_reason, recipe_batches,  # noqa: E402
                          recipe_loader, recipe_parts, recipe_step, state_dict_from_diffusers, write_image_folder)
from drawing import Sampling, draw  # noqa: E402
from files import atomic_open, check_creatable, check_writable, claim_folder, write_once  # noqa: E402
from model import UNet, get_config  # noqa: E402
from reports import markdown_table, provenance, pyplot, save_figure, write_report  # noqa: E402


@dataclass
class LadderConfig:
    ladder: str = flag('speed', 'which arms: speed (the baseline, one lever added per arm, the diffusers recipe) or '
                                'prediction (the paper\'s eps and L_simple against v-prediction, Min-SNR-5 and both)',
                       choices=('speed', 'prediction'))
    arms: str = flag('', 'comma-separated arm names to run (default: all of --ladder; the baseline always runs)')
    seeds: int = flag(3, 'seeds of the baseline, the recipe and the fastest arm', at_least=1)
    other_seeds: int = flag(1, 'seeds of every other arm', at_least=1)
    images: int = flag(100_000, 'training images per run', at_least=1)
    eval_every: int = flag(12_500, 'training images between evaluations', at_least=1)
    eval_samples: int = flag(450, 'samples per score (digits: 450, the size of the floor\'s held-out set)', at_least=2)
    target: float | None = flag(None, 'the harder target score (default for the digits score, whose floor is about '
                                      '7: 12.3, what the paper\'s objective reaches in 242k images; none for FID)',
                                positive=True)
    sampler: str = flag('dpm++', 'sampler of the evaluations', choices=('ddim', 'dpm++', 'ddpm'))
    sample_steps: int = flag(20, 'its model calls', at_least=1)
    dataset: str = flag('digits', 'digits (the digits score) or another train.py data set (FID)',
                        choices=('digits', 'cifar10', 'shapes', 'folder'))
    preset: str = flag('tiny', 'UNet preset')
    image_size: int = flag(16, 'image resolution', at_least=4)
    device: str = flag('cpu', 'cpu, cuda or cuda:N')
    data_dir: str = flag('./data', 'the data (and the digit classifier\'s cache; the recipe\'s PNG copy)')
    runs_dir: str = flag('runs/time-to-quality', 'where the runs go')
    out_dir: str = flag('results', 'where the report goes')
    stem: str = flag('cpu-digits-time-to-quality', 'report file name stem')
    workers: int = flag(1, 'runs trained at once, each in its own process (then set OMP_NUM_THREADS; times are '
                           'then of a shared machine)', at_least=1)


@dataclass
class Arm:
    name: str
    changes: str  # what it changes, in words
    flags: list = field(default_factory=list)  # train.py flags on top of the common ones
    recipe: str = ''  # a diffusers recipe arm: 'its own' settings, or 'ours' (our lr and batch); '': train.py


BASELINE = ['--amp', 'off', '--no-compile', '--no-channels-last', '--no-fused-adam']  # fp32 eager, as the paper's


@dataclass
class Lever:
    name: str
    changes: str
    flags: list
    judged_by: str  # 'speed': kept below when it trains faster; 'time': when it reaches the baseline's score sooner


def speed_levers(device, cfg: LadderConfig) -> list:
    """The speed ladder's levers in the order of the speed-up table: how fast a step runs, then how many
    images the samples need (the batch lever doubles the preset's batch, its learning rate x sqrt(2))."""
    preset = train.check_flags(base_flags(cfg))
    mantissa, exponent = f'{preset.lr * math.sqrt(2):.0e}'.split('e')
    batch, lr = 2 * preset.batch_size, f'{mantissa}e{int(exponent)}'  # 2e-3 -> '3e-3'
    levers = [Lever('+ bf16', 'bf16 autocast', ['--amp', 'bf16'], 'speed')] if (
        device.type == 'cuda' or cpu_has_native_bf16()) else []
    return levers + [
        Lever('+ channels-last', 'channels-last memory format', ['--channels-last'], 'speed'),
        Lever('+ fused Adam', 'one fused Adam kernel', ['--fused-adam'], 'speed'),
        Lever('+ compile', 'torch.compile of the whole loss (Inductor; its compile time is counted)', ['--compile'],
              'speed'),
        Lever('+ v-prediction', 'the network predicts v (Salimans & Ho, 2022)', ['--prediction', 'v'], 'time'),
        Lever('+ Min-SNR-5', 'loss weights min(SNR, 5) (Hang et al., 2023)', ['--loss-weight', 'min-snr'], 'time'),
        Lever(f'+ batch {batch}', f"twice the {cfg.preset} preset's batch, the learning rate x sqrt(2) ({lr})",
              ['--batch-size', str(batch), '--lr', lr], 'time')]


BASELINE_ARM = Arm('baseline', "the paper's recipe as train.py runs it here: fp32, eager, NCHW, foreach Adam", BASELINE)
RECIPE_ARMS = [Arm('diffusers recipe', "diffusers' train_unconditional.py loop and settings (AdamW 1e-4, cosine, "
                                       "EMAModel warm-up, batch 16, 0 workers), fp32 eager", recipe='its own'),
               Arm('diffusers recipe at our lr', "the same at our preset's learning rate and batch", recipe='ours')]


def speed_arms(device, cfg: LadderConfig, names=()) -> list:
    """The baseline, each lever (of `names`, or all) on top of every one above it, and the two recipes:
    the ladder's arms as they run when every lever is kept (climb() keeps only those that pay)."""
    arms, stack = [BASELINE_ARM], list(BASELINE)
    for lever in speed_levers(device, cfg):
        if not names or lever.name in names:
            stack = stack + lever.flags
            arms.append(Arm(lever.name, lever.changes, stack))
    return arms + [a for a in RECIPE_ARMS if not names or a.name in names]


def prediction_arms(device) -> list:
    """The paper's objective against v-prediction, Min-SNR-5 and both, at the baseline's speed."""
    return [Arm('baseline', "the paper's recipe (eps, L_simple)", BASELINE),
            Arm('v-prediction', 'v-prediction', BASELINE + ['--prediction', 'v']),
            Arm('Min-SNR-5', 'Min-SNR-5 weights (eps)', BASELINE + ['--loss-weight', 'min-snr']),
            Arm('v + Min-SNR-5', 'both', BASELINE + ['--prediction', 'v', '--loss-weight', 'min-snr'])]


def slug(name: str) -> str:
    return '-'.join(''.join(c if c.isalnum() else ' ' for c in name.lower()).split())  # '+ bf16' -> 'bf16'


# ----------------------------------------------------------------------------- one run

def run_flags(cfg: LadderConfig, seed: int, folder: str, extra: list) -> tuple:
    """train.py's flags of one run (the budget, the evaluations, the outputs; `extra` the arm's) and
    the config train.py resolves them to."""
    batch = train.check_flags(base_flags(cfg) + extra).batch_size
    flags = base_flags(cfg) + ['--steps', str(math.ceil(cfg.images / batch)), '--seed', str(seed),
                               '--out-dir', folder, *extra]
    return flags, train.check_flags(flags)


def base_flags(cfg: LadderConfig) -> list:
    return ['--dataset', cfg.dataset, '--preset', cfg.preset, '--image-size', str(cfg.image_size),
            '--device', cfg.device, '--data-dir', cfg.data_dir, '--eval-every', str(cfg.eval_every),
            '--eval-samples', str(cfg.eval_samples), '--eval-bpd-images', '50', '--eval-bpd-timesteps', '4',
            '--sampler', cfg.sampler, '--sample-steps', str(cfg.sample_steps), '--sample-every', '0',
            '--log-every', '100']


SCORE_OF = {'digits': 'digits_fd'}  # every other data set: FID


def train_arm(arm: Arm, seed: int, cfg: LadderConfig, folder: str) -> dict | None:
    """One train.py run of the arm; its curve, or None when a signal stopped it."""
    flags, run_cfg = run_flags(cfg, seed, folder, arm.flags)
    if train.cli(flags) != 0:
        raise RunFailed(f'{arm.name}, seed {seed}: train.py failed (its error is above)')
    with open(os.path.join(folder, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    done = next((r for r in rows if r.get('kind') == 'done'), None)
    if done is None:
        return None
    first_step = sum(r.get('first_step_s') or 0 for r in rows if r.get('kind') == 'train')  # each process's first
    key, evals = SCORE_OF.get(cfg.dataset, 'fid'), {}
    for r in rows:
        if r.get('kind') == 'eval':
            evals[r['images_seen']] = r  # the last of each
    curve = [{'images': n, 'score': r[key], 'minutes': (60 * r['train_hours'] + first_step / 60),
              'eval_seconds': r['eval_seconds']} for n, r in sorted(evals.items())]
    images = done['step'] * run_cfg.batch_size
    return {'curve': curve, 'img_per_s': images / (done['train_seconds'] + first_step),
            'first_step_s': first_step, 'train_minutes': (done['train_seconds'] + first_step) / 60,
            'wall_minutes': done['wall_s'] / 60}


def recipe_arm(arm: Arm, seed: int, cfg: LadderConfig, folder: str, stop: StopFlag) -> dict | None:
    """diffusers' example loop (diffusers_io's recipe) on the same images as PNG files, with its EMA
    scored every --eval-every images by the same judge as our runs, through our network."""
    device = pick_device(cfg.device)
    config = get_config(cfg.preset, image_size=cfg.image_size, in_channels=data.channels_of(cfg.dataset))
    ours = train.check_flags(base_flags(cfg))
    batch, lr = (16, None) if arm.recipe == 'its own' else (ours.batch_size, ours.lr)  # 16: the example's default
    pngs = write_once(os.path.join(cfg.data_dir, f'{cfg.dataset}-{cfg.image_size}-png'), 'the recipe',
                      lambda tmp: write_image_folder(data.load_dataset(cfg.dataset, cfg.data_dir, cfg.image_size), tmp))
    loader = recipe_loader(pngs, cfg.image_size, batch, 0, config.in_channels)
    steps = math.ceil(cfg.images / batch)
    torch.manual_seed(seed)
    parts, stream = recipe_parts(config, device, len(loader), 'off', total_steps=steps, lr=lr), recipe_batches(loader)
    score, sched = judge(cfg, device), diffusion.make_schedule(1000)
    curve, seconds, start = [], 0.0, time.perf_counter()
    for step in range(1, steps + 1):
        recipe_step(parts, next(stream))
        if stop.reason:
            return None
        if step * batch // cfg.eval_every > (step - 1) * batch // cfg.eval_every:
            seconds += time.perf_counter() - start
            evaluated = time.perf_counter()
            sampling = Sampling(num=cfg.eval_samples, batch_size=256, sampler=cfg.sampler, steps=cfg.sample_steps,
                                seed=seed)
            images = torch.cat(list(draw(ema_as_our_unet(parts, config).to(device), config, sched, sampling,
                                         device, progress=False)))
            curve.append({'images': step * batch, 'score': score(images), 'minutes': seconds / 60,
                          'eval_seconds': time.perf_counter() - evaluated})
            print(f'{arm.name}, seed {seed}: {step * batch:,} images, score {curve[-1]["score"]:.2f}, '
                  f'{seconds / 60:.2f} training minutes', flush=True)
            start = time.perf_counter()
    seconds += time.perf_counter() - start
    return {'curve': curve, 'img_per_s': steps * batch / seconds, 'first_step_s': None,
            'train_minutes': seconds / 60, 'wall_minutes': None}


def ema_as_our_unet(parts: dict, config) -> UNet:
    """The recipe's EMA weights (diffusers' UNet2DModel) in our UNet, the same function."""
    from diffusers import UNet2DModel
    theirs = UNet2DModel(**diffusers_config(config))
    parts['ema'].copy_to(theirs.parameters())
    ours = UNet(config)
    ours.load_state_dict(state_dict_from_diffusers(ours, theirs.state_dict()))
    return ours.eval().requires_grad_(False)


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


def run_folder(arm: Arm, seed: int, cfg: LadderConfig) -> str:
    return os.path.join(cfg.runs_dir, f'{slug(arm.name)}-seed{seed}')


def read_result(arm: Arm, seed: int, cfg: LadderConfig) -> dict | None:
    """The run's result when its folder holds it finished with these flags (its curve.json), else None."""
    path = os.path.join(run_folder(arm, seed, cfg), 'curve.json')
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    return saved if saved['run'] == {'arm': asdict(arm), 'seed': seed} else None


def run_job(arm: Arm, seed: int, cfg: LadderConfig, stop: StopFlag = None) -> dict | None:
    """One run, reused when its folder holds it finished with these flags; else trained from its start."""
    if (saved := read_result(arm, seed, cfg)) is not None:
        return saved
    folder, what = run_folder(arm, seed, cfg), {'arm': asdict(arm), 'seed': seed}
    done_path = os.path.join(folder, 'curve.json')
    shutil.rmtree(folder, ignore_errors=True)  # unfinished, or made with other flags: from its start
    os.makedirs(folder)
    stop = stop or StopFlag()
    restore = stop.install() if arm.recipe else (lambda: None)
    try:
        result = recipe_arm(arm, seed, cfg, folder, stop) if arm.recipe else train_arm(arm, seed, cfg, folder)
    finally:
        restore()
    if result is None:
        return None
    result = {'run': what, **result}
    with atomic_open(done_path) as f:
        json.dump(result, f, indent=1)
    return result


# ----------------------------------------------------------------------------- reach and summary

def reach(curve: list, target: float):
    """(images, training minutes) at which the score first falls to `target`: interpolated in log
    images and log score between the evaluations on either side (the minutes linearly in images);
    the first evaluation's own when it is already there; None if it never does (no extrapolation)."""
    previous = None
    for point in curve:
        if point['score'] <= target:
            if previous is None:
                return point['images'], point['minutes']
            share = math.log(previous['score'] / target) / math.log(previous['score'] / point['score'])
            images = math.exp(math.log(previous['images']) + share * math.log(point['images'] / previous['images']))
            part = (images - previous['images']) / (point['images'] - previous['images'])
            return images, previous['minutes'] + part * (point['minutes'] - previous['minutes'])
        previous = point
    return None


def mean_sd(values: list):
    return (statistics.mean(values) if values else None, statistics.stdev(values) if len(values) > 1 else None)


def summarise(runs: dict, targets: dict) -> dict:
    """Per arm, over its seeds: minutes and images to each target (mean and sd when every seed reaches
    it, else 'not reached' by how many), the final score, img/s; the speed-up in minutes to the
    first target against the baseline and the recipe (a bound when the recipe never reaches it)."""
    out = {}
    for name, results in runs.items():
        arm = {'seeds': len(results), 'final': mean_sd([r['curve'][-1]['score'] for r in results]),
               'img_per_s': mean_sd([r['img_per_s'] for r in results]),
               'train_minutes': mean_sd([r['train_minutes'] for r in results]),
               'eval_minutes': mean_sd([sum(p['eval_seconds'] for p in r['curve']) / 60 for r in results])}
        for key, target in targets.items():
            reached = [reach(r['curve'], target) for r in results]
            whole = all(reached)
            arm[key] = {'reached': sum(bool(x) for x in reached), 'of': len(reached),
                        'minutes': mean_sd([x[1] for x in reached]) if whole else None,
                        'images': mean_sd([x[0] for x in reached]) if whole else None}
        out[name] = arm
    for name, arm in out.items():
        for peer, label in (('baseline', 'vs_baseline'), ('diffusers recipe', 'vs_recipe')):
            theirs, ours = out.get(peer, {}).get('final_target'), arm['final_target']['minutes']
            if theirs is None or ours is None:
                arm[label] = None
            elif theirs['minutes'] is not None:
                arm[label] = {'ratio': theirs['minutes'][0] / ours[0], 'bound': False}
            else:  # the peer never reached it: its whole training time is a lower bound of its time to it
                arm[label] = {'ratio': out[peer]['train_minutes'][0] / ours[0], 'bound': True}
    return out


# ----------------------------------------------------------------------------- the ladder

def plan(cfg: LadderConfig) -> list:
    """The arms to run, each checked by train.py's own validation before any run starts."""
    device = pick_device(cfg.device)
    every = speed_arms(device, cfg) if cfg.ladder == 'speed' else prediction_arms(device)
    names = [n.strip() for n in cfg.arms.split(',') if n.strip()]
    unknown = [n for n in names if n not in {a.name for a in every}]
    if unknown:
        raise ConfigError(f"--arms: no arm named {', '.join(map(repr, unknown))}; the arms of --ladder {cfg.ladder} "
                          f"are: {', '.join(a.name for a in every)}")
    if cfg.ladder == 'speed':
        arms = speed_arms(device, cfg, names)
    else:
        arms = [a for a in every if not names or a.name in names or a.name == 'baseline']
    for arm in arms:
        if arm.recipe:
            if reason := diffusers_missing_reason():
                raise ConfigError(f'--arms {arm.name}: {reason}')
            continue
        run_cfg = run_flags(cfg, 0, os.path.join(cfg.runs_dir, 'check'), arm.flags)[1]
        steps = math.ceil(cfg.images / run_cfg.batch_size)
        if steps * run_cfg.batch_size < cfg.eval_every:
            raise ConfigError(f'--images {cfg.images}: at batch {run_cfg.batch_size} the {arm.name!r} run ends at '
                              f'{steps * run_cfg.batch_size} images, before its first evaluation (--eval-every '
                              f'{cfg.eval_every})')
    return arms


def decides(cfg: LadderConfig) -> dict:
    return {k: getattr(cfg, k) for k in ('dataset', 'preset', 'image_size', 'device', 'images', 'eval_every',
                                         'eval_samples', 'sampler', 'sample_steps')}


def claim_runs_dir(cfg: LadderConfig):
    """RUNS_DIR holds this ladder's runs or nothing: another ladder's runs (other settings that decide
    them), files that are no ladder's, or a ladder running there now are refused. Returns the
    lock's release."""
    manifest = os.path.join(cfg.runs_dir, 'ladder.json')
    if os.path.isfile(manifest):
        with open(manifest) as f:
            saved = json.load(f)
        if saved != decides(cfg):
            raise ConfigError(f'--runs-dir {cfg.runs_dir} holds the runs of another ladder ({saved}): pass another '
                              f'folder')
    elif os.path.isdir(cfg.runs_dir) and set(os.listdir(cfg.runs_dir)) - {'lock'}:
        raise ConfigError(f'--runs-dir {cfg.runs_dir} holds files but no ladder.json: pass a new or empty folder')
    check_writable(cfg.runs_dir, '--runs-dir')
    release = claim_folder(cfg.runs_dir, '--runs-dir')  # one ladder at a time: it deletes unfinished runs
    with atomic_open(manifest) as f:
        json.dump(decides(cfg), f)
    return release


def validate(cfg: LadderConfig) -> tuple:
    """Every check before any run: flags, each arm's train.py flags, the target against the floor,
    the folders (checked before any is made). Returns (arms, floor or None, harder target)."""
    check_ranges(cfg)
    check_plain_name(cfg.stem, '--stem')
    arms = plan(cfg)
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
    for folder, name in folders:  # created only now that every check has passed
        check_writable(folder, name)
    return arms, floor, target


def run_all(jobs: list, cfg: LadderConfig, stop: StopFlag) -> list | None:
    """The runs' results in order; None when a signal stopped the ladder. A failed run ends it: with
    --workers N, each run is a process of its own, and the others are stopped (SIGTERM: their
    train.py saves and exits) and waited for, so that nothing is left running."""
    if cfg.workers == 1:
        results = []
        for arm, seed in jobs:
            result = run_job(arm, seed, cfg, stop)
            if result is None or stop.reason:
                return None
            results.append(result)
        return results
    import multiprocessing
    context, queue, running, failed = multiprocessing.get_context('spawn'), list(jobs), {}, None
    try:
        while (queue or running) and not (stop.reason or failed):
            while queue and len(running) < cfg.workers:
                arm, seed = queue.pop(0)
                process = context.Process(target=job_process, args=(arm, seed, cfg))
                process.start()
                running[process] = (arm, seed)
            time.sleep(0.2)
            for process in [p for p in running if not p.is_alive()]:
                arm, seed = running.pop(process)
                if process.exitcode == STOPPED:
                    stop.reason = stop.reason or 'a stop in a worker'
                elif process.exitcode != 0:
                    failed = (f'{arm.name}, seed {seed}: its run failed (exit code {process.exitcode}; the error is '
                              f'above)')
    finally:
        for process in running:  # their runs save and exit
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        for process in running:
            process.join(60)
            if process.is_alive():
                process.kill()
    if failed:
        raise RunFailed(failed)
    return None if stop.reason else [read_result(arm, seed, cfg) for arm, seed in jobs]  # each worker wrote its own


STOPPED = 3  # a worker's exit code when a signal stopped its run


def job_process(arm: Arm, seed: int, cfg: LadderConfig):
    """A worker: one run; exit 0 when finished, STOPPED when a signal cut it, 1 with its error."""
    try:
        result = run_job(arm, seed, cfg)
    except Exception as error:
        print(f'error: {arm.name}, seed {seed}: {brief(error, 300)}', file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(0 if result is not None else STOPPED)


def run_group(jobs: list, cfg: LadderConfig, stop: StopFlag) -> dict | None:
    """{arm name: its runs' results} of (arm, seed) jobs; None when a signal stopped them."""
    results = run_all(jobs, cfg, stop)
    if results is None:
        return None
    grouped = {}
    for (arm, _), result in zip(jobs, results):
        grouped.setdefault(arm.name, []).append(result)
    return grouped


def final_target(runs: dict) -> float:
    """The baseline's final score, as the worst of its seeds ends: a score every baseline seed reaches."""
    return max(r['curve'][-1]['score'] for r in runs['baseline'])


def pays(lever: Lever, got: list, base: list, target: float) -> bool:
    """Whether a lever stays for the arms below: a speed lever when its runs train faster (mean img/s,
    the compiling step counted) than those of the arm it builds on; a lever of the images needed when
    every seed reaches the baseline's final score, in fewer mean training minutes than that arm's (or
    that arm's seeds do not all reach it)."""
    if lever.judged_by == 'speed':
        return statistics.mean(r['img_per_s'] for r in got) > statistics.mean(r['img_per_s'] for r in base)
    ours, theirs = ([reach(r['curve'], target) for r in runs] for runs in (got, base))
    if not all(ours):
        return False
    return not all(theirs) or statistics.mean(x[1] for x in ours) < statistics.mean(x[1] for x in theirs)


def climb(arms: list, cfg: LadderConfig, stop: StopFlag) -> tuple | None:
    """The speed ladder: the baseline's and the recipes' seeds, then each lever on top of the levers
    kept so far (pays() decides). Returns (the arms as they ran, their runs, {arm: the arm it builds on,
    whether it was kept}), or None when a signal stopped it."""
    levers = {lever.name: lever for lever in speed_levers(pick_device(cfg.device), cfg)}
    fixed = [a for a in arms if a.name not in levers]
    runs = run_group([(a, seed) for a in fixed for seed in range(cfg.seeds if a.name in (
        'baseline', 'diffusers recipe') else cfg.other_seeds)], cfg, stop)
    if runs is None:
        return None
    target, on, stack, ran, built = final_target(runs), 'baseline', list(BASELINE), [BASELINE_ARM], {}
    for lever in (levers[a.name] for a in arms if a.name in levers):
        arm = Arm(lever.name, lever.changes, stack + lever.flags)
        got = run_group([(arm, seed) for seed in range(cfg.other_seeds)], cfg, stop)
        if got is None:
            return None
        runs[arm.name], kept = got[arm.name], pays(lever, got[arm.name], runs[on], target)
        built[arm.name] = {'builds_on': on, 'kept': kept}
        print(f'{arm.name}: {"kept" if kept else "left out"} for the arms below (on top of {on})', flush=True)
        ran.append(arm)
        if kept:
            on, stack = arm.name, arm.flags
    return ran + [a for a in fixed if a.recipe], runs, built


def side_by_side(arms: list, cfg: LadderConfig, stop: StopFlag) -> tuple | None:
    """The prediction ladder: every arm on the baseline, --seeds seeds each."""
    runs = run_group([(arm, seed) for arm in arms for seed in range(cfg.seeds)], cfg, stop)
    return None if runs is None else (arms, runs, {})


def ladder(cfg: LadderConfig) -> dict | None:
    arms, floor, harder = validate(cfg)
    release = claim_runs_dir(cfg)
    stop = StopFlag()
    restore = stop.install()
    try:
        done = (climb if cfg.ladder == 'speed' else side_by_side)(arms, cfg, stop)
        if done is None:
            return stopped(stop)
        arms, runs, built = done
        targets = {'final_target': final_target(runs), **({'harder_target': harder} if harder is not None else {})}
        summary = summarise(runs, targets)
        fastest = min((name for name in runs if summary[name]['final_target']['minutes']),
                      key=lambda name: summary[name]['final_target']['minutes'][0])
        more = run_group([(arm, seed) for arm in arms if arm.name == fastest
                          for seed in range(len(runs[fastest]), cfg.seeds)], cfg, stop)
        if more is None:
            return stopped(stop)
        runs[fastest] += more.get(fastest, [])
    finally:
        restore()
        release()
    summary = summarise(runs, targets)
    result = {**provenance(device_name(pick_device(cfg.device))), 'config': asdict(cfg), 'floor': floor,
              'targets': targets, 'fastest': fastest, 'runs': runs,
              'arms': {a.name: {**asdict(a), **built.get(a.name, {}), **summary[a.name]} for a in arms}}
    report(result, cfg)
    return result


def stopped(stop: StopFlag):
    print(f'stopped by {stop.reason or "a signal"}: no report written (it would hold unfinished runs); the same '
          f'command continues, reusing the finished runs', flush=True)
    return None


# ----------------------------------------------------------------------------- the report

def report(result: dict, cfg: LadderConfig):
    targets, arms = result['targets'], result['arms']

    def ms(pair, spec):
        return '-' if pair is None or pair[0] is None else format(pair[0], spec) + (
            f' +- {pair[1]:{spec}}' if pair[1] is not None else '')

    def to(arm, key, what, spec):
        got = arm[key]
        return ms(got[what], spec) if got[what] else f"not reached ({got['reached']} of {got['of']} seeds)"

    def ratio(value):
        return '-' if value is None else ('> ' if value['bound'] else '') + f"{value['ratio']:.2f}x"
    headers = ['Arm', 'what it changes', 'on top of', 'kept below', 'seeds', 'img/s',
               f"minutes to {targets['final_target']:.2f}",
               f"images to {targets['final_target']:.2f}"]
    if 'harder_target' in targets:
        headers += [f"minutes to {targets['harder_target']:.2f}", f"images to {targets['harder_target']:.2f}"]
    headers += ['final score', 'vs baseline (minutes)', 'vs the recipe (minutes)', 'evaluation minutes (apart)']
    rows = []
    for name, arm in arms.items():
        row = [name, arm['changes'], arm.get('builds_on', '-'), {True: 'yes', False: 'no'}.get(arm.get('kept'), '-'),
               arm['seeds'], ms(arm['img_per_s'], ',.0f'),
               to(arm, 'final_target', 'minutes', '.2f'), to(arm, 'final_target', 'images', ',.0f')]
        if 'harder_target' in targets:
            row += [to(arm, 'harder_target', 'minutes', '.2f'), to(arm, 'harder_target', 'images', ',.0f')]
        row += [ms(arm['final'], '.2f'), ratio(arm['vs_baseline']), ratio(arm['vs_recipe']),
                ms(arm['eval_minutes'], '.2f')]
        rows.append(row)
    score = 'digits FD (classifier features)' if cfg.dataset == 'digits' else 'FID'
    notes = (f"; {cfg.preset} preset, {cfg.dataset} {cfg.image_size}x{cfg.image_size}, {cfg.images:,} training images "
             f"per run, {score} of {cfg.eval_samples} EMA samples ({cfg.sampler}, {cfg.sample_steps} calls) every "
             f"{cfg.eval_every:,} images" + (f"; floor {result['floor']:.2f}" if result['floor'] else '') +
             f". Targets: the baseline's final score (the worst of its seeds) and "
             f"{targets.get('harder_target', 'none')}. Mean +- sd over seeds; a lever stays for the arms below "
             f"('kept below') when it trains faster (img/s; levers of speed) or reaches the first target in fewer "
             f"minutes (levers of the images needed) than the arm it is on top of; training minutes count the first "
             f"(compiling) step, not the evaluations; a target not reached by every seed is 'not reached', never "
             f"extrapolated; '>' marks a ratio to a peer that never "
             f"reached it (its whole training time)")
    png = write_report(cfg.out_dir, cfg.stem, result, 'Time to quality: training minutes to a score, per lever',
                       markdown_table(headers, rows, left=4), notes=notes)
    fig, ax = pyplot().subplots(figsize=(9, 5.5))
    for name, colour in zip(arms, pyplot().cm.tab10.colors * 2):
        curves = result['runs'][name]
        points = min(len(c['curve']) for c in curves)
        minutes = [statistics.mean(c['curve'][i]['minutes'] for c in curves) for i in range(points)]
        scores = [[c['curve'][i]['score'] for c in curves] for i in range(points)]
        ax.plot(minutes, [statistics.mean(s) for s in scores], marker='o', color=colour, markersize=3,
                label=f'{name} ({len(curves)} seed{"s" if len(curves) > 1 else ""})',
                linestyle='--' if arms[name]['recipe'] else '-')
        if len(curves) > 1:
            ax.fill_between(minutes, [min(s) for s in scores], [max(s) for s in scores], color=colour, alpha=0.12)
    for key, style in (('final_target', ':'), ('harder_target', '-.')):
        if key in targets:
            ax.axhline(targets[key], color='gray', linestyle=style, label=f"target {targets[key]:.2f}")
    if result['floor']:
        ax.axhline(result['floor'], color='black', linewidth=0.8, label=f"floor {result['floor']:.2f}")
    ax.set(xlabel='training minutes (evaluations left out)', ylabel=score, yscale='log')
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7)
    ax.set_title(f"{result['device']}, torch {result['torch']}, {result['date'][:10]}", fontsize=8)
    save_figure(fig, png, dpi=110)
    print(markdown_table(headers, rows, left=4))


def main(argv=None) -> int:
    return run_main(ladder, parse_config(argv, LadderConfig, __doc__))


if __name__ == '__main__':
    sys.exit(main())

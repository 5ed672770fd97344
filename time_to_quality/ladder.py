"""The time-to-quality ladder's runner (`python -m time_to_quality`; what the ladder is: the package's
docstring, its --help): its flags (LadderConfig), the code a curve records and the one rule that reuses
or refuses a finished curve, the runs read back or trained (Ladder), the parts in order (climb, or
side_by_side for a study), every check before any run, and main."""
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
import shutil
from dataclasses import dataclass

import evaluation
import time_to_quality
import train
import train_config
from cli import (ConfigError, StopFlag, StopRequested, brief, check_plain_name, check_ranges, flag, parse_config,
                 run_main)
from devices import cpu_has_native_bf16, device_name, pick_device
from files import atomic_open, check_creatable, check_writable, folder_in_use
from peers import diffusers_missing_reason
from reports import git_commit

from . import arms, speed
from .arms import BASELINE, BASELINE_ARM, STUDIES, Arm, Lever, chosen, decay_plan, slug
from .curves import check_runs_dir, claim_runs_dir, impossible, ladder_identity, sealed, stop_index
from .recipe import recipe_arm, recipe_settings
from .report import record, report, stem_of
from .runs import Job, RunFailed, base_flags, curve_path, curves_dir, run_flags, train_arm
from .stats import paired_gain, score_at, screen_score
from .workers import run_processes

PARTS = ('baseline', 'speed', 'quality', 'fastest', 'peer')


@dataclass
class LadderConfig:
    ladder: str = flag('speed', 'which arms: speed (the baseline, the levers, the diffusers recipe), prediction '
                                '(the paper\'s eps and L_simple against v-prediction, Min-SNR-5 and both) or shape '
                                '(the tiny UNet narrower, wider, deeper, without attention, with two levels)',
                       choices=('speed', *STUDIES))
    arms: str = flag('', 'comma-separated levers and diffusers variants in the ladder (default: all; the baseline and '
                         'the diffusers recipe at its own settings always run): a smaller ladder')
    train: str = flag('', 'comma-separated parts whose runs this command trains (' + ', '.join(PARTS) + '; default: '
                          'all); the other parts\' runs are read back finished, and the ladder stops where one is '
                          'missing')
    seeds: int = flag(5, 'seeds of the baseline, the best diffusers variant and the fastest arm (the headline '
                         'ratios), and the pairs that confirm a lever that passes the screen; of every arm in the '
                         'prediction ladder', at_least=1)
    lever_seeds: int = flag(3, "pairs of each lever's screen (the same seeds as the arm below it)", at_least=2)
    images: int = flag(400_000, 'planned training images of a run (its lr schedule\'s length); it ends at its first '
                                'evaluation at or below --target', at_least=1)
    decay_images: int | None = flag(None, 'planned images of the runs whose lr decays to their end: the diffusers '
                                             'recipe\'s final seeds, the lr-decay lever\'s and, once it is kept, the '
                                             'arms above it (default: half of --images, 200,000: about the demo\'s '
                                             'plan, what a user would plan for this target)', at_least=1)
    speed_rounds: int = flag(10, 'rounds of a speed lever\'s timing against the arm below, interleaved in one '
                                 'process: the keep rule\'s pairs (at least --seeds)', at_least=3)
    speed_steps: int = flag(30, 'training steps of each arm per round of that timing', at_least=1)
    speed_images: int = flag(25_000, 'the images of the speed levers\' separate short runs in ladders recorded '
                                     'before the interleaved timing (their curves are read, never trained)',
                             at_least=1)
    screen_images: int = flag(100_000, 'training images of each diffusers variant\'s screen (one seed; judged by '
                                       'the mean of its last two scores)', at_least=1)
    easy_at: int = flag(100_000, 'the easier target: the score the baseline\'s worst seed has after this many '
                                 'images', at_least=1)
    eval_every: int = flag(12_500, 'training images between evaluations', at_least=1)
    eval_samples: int = flag(450, 'samples per score (digits: 450, the size of the floor\'s held-out set)', at_least=2)
    target: float | None = flag(None, 'the target score (default for the digits score, whose floor is about 40: '
                                      f'{evaluation.DIGITS_TARGET:g}, the demo\'s; FID: needed)',
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
    out_dir: str = flag('runs/time-to-quality-reports', 'where the report and the finished runs\' curves go '
                                                        '(results/ only when named: a run never replaces the '
                                                        'committed evidence by default)')
    stem: str = flag('', 'report file name stem (default: <device>-<dataset>-time-to-quality, or -<ladder>-study)')
    workers: int = flag(1, 'runs trained at once, each in its own process (then set OMP_NUM_THREADS; times are '
                           'then of a shared machine)', at_least=1)
    retrain: str = flag('', 'comma-separated finished runs to train again, replacing their curves (the names of '
                            'their files in OUT_DIR/STEM-runs, without .json; <lever>-speed: a speed timing): the '
                            'one way a finished curve is replaced; each is trained whatever --train says')


def ours(cfg: LadderConfig) -> train.TrainConfig:
    return train_config.check_flags(base_flags(cfg))


def speed_levers(device, cfg: LadderConfig) -> list:
    """The ladder's levers (arms.levers, as --arms chooses): bf16 where the device runs it natively,
    or where --arms names it (its finished runs are then read back; training it is refused without it)."""
    bf16 = device.type == 'cuda' or cpu_has_native_bf16() or '+ bf16' in names_in(cfg.arms, '--arms')
    return chosen(cfg, arms.levers(cfg, ours(cfg), bf16))


def recipe_variants(cfg: LadderConfig) -> list:
    return arms.recipe_variants(cfg, ours(cfg))


class Missing(Exception):
    """A run the ladder needs is not finished and this command does not train it (its part is not in
    --train, and --retrain does not name it). `trainable`: a dry pass (validate) stopped at a run that
    the command itself would train."""

    def __init__(self, part: str, what: str, trainable: bool = False):
        super().__init__(f'part {part!r}: {what} is not finished; run it with --train {part}')
        self.part, self.trainable = part, trainable


def names_in(value: str, name: str) -> list:
    """The names a comma-separated flag gives; one that names nothing (',' or ' ') is refused, since
    leaving the flag out is what means 'all'."""
    names = [n.strip() for n in value.split(',') if n.strip()]
    if value and not names:
        raise ConfigError(f'{name} {value!r}: names nothing; leave {name} out for its default')
    return names


# ----------------------------------------------------------------------------- finished runs: the reuse rule

# What a run's numbers come from besides its flags (the code a curve records): train.py and every module
# its training and evaluation run through, the diffusers recipe's parts and its arm (recipe.py), and the
# functions that make a run and read its curve (runs.py's, by their source).
TRAINING_CODE = ('train.py', 'train_config.py', 'model.py', 'diffusion.py', 'data.py', 'loaders.py', 'checkpoint.py',
                 'evaluation.py', 'training_log.py', 'cli.py', 'devices.py', 'bookkeeping.py', 'drawing.py', 'files.py',
                 'diffusers_io.py', 'peers.py', 'time_to_quality/recipe.py')
RUN_MAKERS = ('base_flags', 'run_flags', 'train_arm')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=1)
def code_identity() -> dict:
    """The code of the runs this process trains: a hash of TRAINING_CODE's files and of RUN_MAKERS'
    source, and the commit (informative: the hash decides)."""
    digest = hashlib.sha256()
    for name in TRAINING_CODE:
        path = os.path.join(ROOT, name)
        content = open(path, 'rb').read() if os.path.isfile(path) else b'(missing)'
        digest.update(name.encode() + b'\0' + hashlib.sha256(content).digest())
    for name in RUN_MAKERS:
        digest.update(name.encode() + b'\0' + inspect.getsource(globals()[name]).encode())
    return {'hash': digest.hexdigest()[:16], 'commit': git_commit()}


def timing_code() -> dict:  # a speed timing's code: the runs' (code_identity) and its own (speed.py)
    mine = hashlib.sha256(open(os.path.join(ROOT, 'time_to_quality', 'speed.py'), 'rb').read()).digest()
    return {'hash': hashlib.sha256(code_identity()['hash'].encode() + b'\0' + mine).hexdigest()[:16],
            'commit': code_identity()['commit']}


@functools.lru_cache(maxsize=4)
def floor_of(dataset: str, image_size: int, data_dir: str):
    """The lowest score a run can have: the digits score of real held-out digits; 0 for FID."""
    return evaluation.DigitsJudge(image_size, data_dir).floor['digits_class_fd'] if dataset == 'digits' else 0.0


def retrain_names(cfg: LadderConfig) -> set:
    return set(names_in(cfg.retrain, '--retrain'))


def reuse_or_refuse(path: str, cfg: LadderConfig, identity: dict, target, job: Job = None) -> dict:
    """The one rule for a finished run's curve file (OUT_DIR/STEM-runs/NAME.json): the saved record to
    reuse, or a ConfigError (one line naming the file and how to train the run again on purpose) that
    deletes and trains nothing. A curve is reused when it is whole, possible and unedited, and records
    the run asked for:
      - this ladder (ladder_identity: the data, preset, size, device and scoring);
      - the code its numbers come from (code_identity's hash); a curve written before curves recorded
        their code (the committed ones) is read for a report, and a command that trains refuses it
        (refuse_unhashed);
      - the same run: arm (name, flags, recipe), seed and planned images (`job`; without it, only the
        checks that need no job: validate's scan of every file);
      - a stop that ends the run where `target` would: the same target, or one at which the run stops
        at the same evaluation (the last one it has; or neither target reached and its whole budget
        run). A curve trained to another target otherwise holds other evaluations, and is refused.
    Only a command that names the run in --retrain replaces its curve (removing the file does too)."""
    name = os.path.basename(path)[:-len('.json')]
    again = f'to train it again, pass --retrain {name} (its curve is replaced) or remove it'
    try:
        with open(path) as f:
            saved = json.load(f)
        run, ladder_of, curve = saved['run'], saved['ladder'], saved['curve']
        if not (isinstance(curve, list) and curve and all(isinstance(p, dict) and {
                'images', 'score', 'minutes', 'eval_seconds'} <= set(p) for p in curve)):
            raise ValueError('no curve')
        problem = impossible(saved, floor_of(cfg.dataset, cfg.image_size, cfg.data_dir))
        named = problem or Job(Arm(run['arm']['name'], ''), run['seed'], run['images'], run['stop_at']).name
        if problem is None and named != name:
            problem = f'its name: it holds the run {named}'
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f'{path}: damaged ({brief(error, 80)}); {again}') from None
    if problem:
        raise ConfigError(f'{path}: impossible values, {problem}; {again}')
    if 'digest' in saved and sealed(saved)['digest'] != saved['digest']:
        raise ConfigError(f'{path}: edited since its run wrote it (its digest differs); {again}')
    if ladder_of != identity:
        raise ConfigError(f'{path} was made by another ladder ({ladder_of}; this one: {identity}): pass another '
                          f'--out-dir or --stem')
    code = saved.get('code')
    if code is not None and code.get('hash') != code_identity()['hash']:
        raise ConfigError(f"{path}: made by other code (hash {code.get('hash')}, commit {code.get('commit')}; this "
                          f"code: {code_identity()['hash']}); {again}, or run the ladder at its commit")
    recorded = run['stop_at']
    asked = job.target if job is not None else (target if recorded is not None else None)
    at = stop_index(curve, asked)
    if recorded != asked and not (at == len(curve) - 1 or (at is None and stop_index(curve, recorded) is None)):
        cut = 'stopped at an earlier evaluation' if at is not None else 'trained on past its last evaluation'
        raise ConfigError(f'{path}: made to stop at --target {recorded}; at --target {asked} its run would have '
                          f'{cut}: pass --target {recorded} to reuse it; {again}')
    if job is not None:
        mine = job.identity()
        differ = [f'{key} {run.get(key)!r} (now {mine[key]!r})' for key in ('arm', 'seed', 'images')
                  if run.get(key) != mine[key]]
        if differ:
            raise ConfigError(f"{path}: made with other settings than this ladder's run of that name: "
                              f"{'; '.join(differ)}; {again}")
    return saved


def read_result(job: Job, cfg: LadderConfig, identity: dict, replaced: bool = False) -> dict | None:
    """The finished run's result from its curve file, under the reuse rule (reuse_or_refuse); None when
    there is none, or --retrain names it (replaced: this command has trained it, and its new curve is
    read)."""
    path = curve_path(job, cfg)
    if not os.path.isfile(path) or (job.name in retrain_names(cfg) and not replaced):
        return None
    return reuse_or_refuse(path, cfg, identity, job.target, job)


def check_curves(cfg: LadderConfig, identity: dict, target):
    """Before anything is made: every --retrain name is a finished run, and every other curve file of
    this ladder passes the checks of the reuse rule that need no job (parsed, possible, unedited, this
    ladder's, this code's, this target's)."""
    folder = curves_dir(cfg)
    files = sorted(n[:-len('.json')] for n in os.listdir(folder) if n.endswith('.json')) if os.path.isdir(
        folder) else []
    unknown = sorted(retrain_names(cfg) - set(files))
    if unknown:
        raise ConfigError(f"--retrain {', '.join(unknown)}: no finished run of that name in {folder} (a name is its "
                          f"curve file's, without .json)")
    for name in files:
        if name not in retrain_names(cfg):
            path = os.path.join(folder, name + '.json')
            if name.endswith('-speed'):
                speed.checked(path, cfg, identity, timing_code()['hash'])
            else:
                reuse_or_refuse(path, cfg, identity, target)


def run_job(job: Job, cfg: LadderConfig, identity: dict, stop: StopFlag = None) -> dict | None:
    """One run, read back when finished; else trained from its start in RUNS_DIR/<job>/ (never in a
    folder a live process still writes). Its curve file is written only when it has a curve, with the
    code it was made by and its digest."""
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
        if not job.arm.recipe and os.path.isfile(os.path.join(folder, 'ckpt.pt')):  # train.py's hint is not ours
            print(f'{job.name}: stopped; the ladder does not resume its runs, so a rerun of the ladder trains it '
                  f'from its start (the --resume hint above is for train.py alone)', flush=True)
        return None
    if not result['curve']:
        raise RunFailed(f'{job.arm.name}, seed {job.seed}: the run ended before its first evaluation')
    result = sealed({'run': job.identity(), 'ladder': identity, 'code': code_identity(), **result})
    os.makedirs(curves_dir(cfg), exist_ok=True)
    with atomic_open(curve_path(job, cfg)) as f:
        json.dump(result, f, indent=1)
    return result

# ----------------------------------------------------------------------------- the ladder

class Ladder:
    """The runs of one ladder: trained or read back (Missing when a needed run is not finished and this
    command does not train it), with --workers processes when several are asked for at once. A run is
    read or trained once per command. dry: read back only (validate's pass), Missing at the first run
    not finished. trains: the parts whose runs it trains (default: --train's)."""

    def __init__(self, cfg: LadderConfig, identity: dict, stop: StopFlag, dry: bool = False, trains: set = None):
        self.cfg, self.identity, self.stop, self.dry = cfg, identity, stop, dry
        self.parts = (set(names_in(cfg.train, '--train')) or set(PARTS)) if trains is None else trains
        self.runs = {}  # arm name -> {Job: result}
        self.trained = set()  # the names of the runs this command trained

    def get(self, part: str, arm: Arm, seeds, images: int, target: float) -> list | None:
        """The arm's results for `seeds`, in order; None when a signal stopped the ladder."""
        jobs = [Job(arm, seed, images, target) for seed in seeds]
        known = self.runs.get(arm.name, {})
        new = [j for j in jobs if j not in known]
        todo = [j for j in new if read_result(j, self.cfg, self.identity) is None]
        named = retrain_names(self.cfg)
        if todo and (self.dry or (part not in self.parts and not {j.name for j in todo} <= named)):
            raise Missing(part, f'{todo[0].arm.name}, seed {todo[0].seed} ({todo[0].images:,} images)',
                          trainable=part in self.parts or {j.name for j in todo} <= named)
        results = run_all(new, self.cfg, self.identity, self.stop) if new else []
        if results is None:
            return None
        self.trained |= {j.name for j in todo}
        known = self.runs.setdefault(arm.name, {})
        known.update(zip(new, results))
        return [known[j] for j in jobs]

    def finished(self, arm: Arm, seeds, images: int, target: float) -> dict:
        """{seed: result} of the arm's finished runs among `seeds`: read back, never trained."""
        got = {}
        for job in (Job(arm, seed, images, target) for seed in seeds):
            result = self.runs.get(arm.name, {}).get(job) or read_result(job, self.cfg, self.identity)
            if result is not None:
                self.runs.setdefault(arm.name, {})[job] = got[job.seed] = result
        return got

    def elsewhere(self, lever: Lever, seeds, target: float):
        """The lever's finished runs of `seeds` built on another arm of this ladder than the one it would
        run on now (an arm left out since they ran), at that arm's planned images, with that arm's runs:
        ((arm, its results), (the lever's arm, its results), images), or None."""
        folder, found = curves_dir(self.cfg), {}
        for name in sorted(os.listdir(folder)) if lever.images is None and os.path.isdir(folder) else []:
            if name.startswith(slug(lever.name) + '-') and name.endswith('.json') and not name.endswith('-speed.json'):
                saved = reuse_or_refuse(os.path.join(folder, name), self.cfg, self.identity, target)
                run, flags, cut = saved['run'], saved['run']['arm']['flags'], -len(lever.flags)
                if run['arm']['name'] == lever.name and flags[cut:] == lever.flags:
                    found.setdefault((tuple(flags[:cut]), run['images']), {})[run['seed']] = saved
        for (flags, images), mine in found.items():
            for jobs in list(self.runs.values()):
                theirs = {j.seed: r for j, r in jobs.items() if j.arm.flags == list(flags) and j.images == images}
                if all(s in mine and s in theirs for s in seeds):
                    below, arm = next(iter(jobs)).arm, Arm(lever.name, lever.changes, list(flags) + lever.flags)
                    self.runs.setdefault(lever.name, {}).update({Job(arm, s, images, target): mine[s] for s in seeds})
                    return (below, [theirs[s] for s in seeds]), (arm, [mine[s] for s in seeds]), images
        return None


def climb(cfg: LadderConfig, target: float, stop: StopFlag, identity: dict, dry: bool = False,
          trains: set = None) -> dict | None:
    """The speed ladder (see the docstring at the top). Returns its record, as far as its finished parts
    go ('missing' says where it stopped, 'stopped_at' is that Missing), or None when a signal stopped it.
    dry: only what is finished, read back (Ladder); trains: the parts it may train (Ladder)."""
    ladder, device = Ladder(cfg, identity, stop, dry, trains), pick_device(cfg.device)
    seeds = range(cfg.seeds)
    base = ladder.get('baseline', BASELINE_ARM, seeds, cfg.images, target)
    if base is None:
        return None
    done = {'ladder': ladder, 'decisions': {}, 'screened': {}, 'best_peer': None, 'fastest': None, 'missing': None,
            'stopped_at': None, 'planned': {},  # each arm's planned images where they are not --images
            'targets': {'target': target, 'easy_target': max(score_at(r, cfg.easy_at) for r in base)}}
    try:
        # The levers, each on the levers kept so far; `planned` is the kept arms' planned length.
        stack, below, planned, kept = list(BASELINE), BASELINE_ARM, cfg.images, []
        for lever in speed_levers(device, cfg):
            arm = Arm(lever.name, lever.changes, stack + lever.flags)
            if lever.judged_by == 'speed':
                decision = judge_speed(ladder, lever, arm, below, planned, target, list(kept))
            else:
                decision = judge_lever(ladder, lever, arm, below, planned, target, list(kept))
            if decision is None:
                return None
            done['decisions'][lever.name], done['planned'][lever.name] = decision, decision.pop('images')
            if not dry:
                print(f"{lever.name}: {decision['status']} (on top of {decision['builds_on']})", flush=True)
            if decision['kept'] and not decision['elsewhere']:
                stack, below, planned = arm.flags, arm, lever.images or planned
                kept.append(lever.name)
        # The headline arm: every kept lever, at --seeds seeds and the full budget.
        if ladder.get('fastest', below, seeds, planned, target) is None:
            return None
        done['fastest'], done['planned'][below.name] = below.name, planned
        # The peer: the grid screened on one seed, the best variant at --seeds seeds.
        for arm in recipe_variants(cfg):  # the screen runs its whole budget: it is judged by its end
            got = ladder.get('peer', arm, [0], cfg.screen_images, None)
            if got is None:
                return None
            done['screened'][arm.name] = {'score': screen_score(got[0]), 'images': cfg.screen_images, 'seed': 0}
        best = min(recipe_variants(cfg), key=lambda a: done['screened'][a.name]['score'])
        if ladder.get('peer', best, seeds, decay_plan(cfg), target) is None:  # its lr always decays: that plan
            return None
        done['best_peer'], done['planned'][best.name] = best.name, decay_plan(cfg)
    except Missing as missing:
        done['missing'], done['stopped_at'] = str(missing), missing
    return done


def judge_lever(ladder: Ladder, lever: Lever, arm: Arm, below: Arm, images: int, target: float,
                kept: list, part: str = None) -> dict | None:
    """The keep rule (stats.keep_rule) on one lever: its screen's pairs against the arm below and,
    when it passes, the pairs that confirm it, trained when this command trains the lever's part; left
    'pending' when it does not. A lever whose screen ran here on an arm since left out (Ladder.elsewhere)
    is judged on those runs against that arm, and never stacked. None when a signal stopped the ladder."""
    cfg, part = ladder.cfg, part or lever.part
    screen, confirm, mine_at = range(cfg.lever_seeds), range(max(cfg.seeds, cfg.lever_seeds)), lever.images or images
    elsewhere = False
    try:
        theirs = ladder.get(part, below, screen, images, target)
        mine = theirs and ladder.get(part, arm, screen, mine_at, target)
    except Missing as missing:
        found = None if missing.trainable else ladder.elsewhere(lever, screen, target)
        if found is None:
            raise
        (below, theirs), (arm, mine), mine_at = found
        elsewhere = True
    if mine is None:
        return None
    decide = functools.partial(paired_gain, lever.judged_by, target=target, planned=cfg.images,
                               screen=cfg.lever_seeds, confirm=len(confirm))
    decision = decide(mine, theirs)
    if decision['status'] == 'pending' and not elsewhere:
        try:
            theirs = ladder.get(part, below, confirm, images, target)
            mine = theirs and ladder.get(part, arm, confirm, mine_at, target)
            if mine is None:
                return None
        except Missing as missing:
            if missing.trainable:
                raise
            got, under = ladder.finished(arm, confirm, mine_at, target), ladder.finished(below, confirm, images, target)
            mine, theirs = [got[s] for s in confirm if s in got and s in under], [
                under[s] for s in confirm if s in got and s in under]
        decision = decide(mine, theirs)
    return {'lever': lever.name, 'builds_on': below.name, 'judged_by': lever.judged_by, 'elsewhere': elsewhere,
            'kept_below': kept, 'fresh': elsewhere or not all(r.get('code') for r in mine + theirs),
            'images': mine_at, **decision}


def judge_speed(ladder: Ladder, lever: Lever, arm: Arm, below: Arm, planned: int, target: float,
                kept: list) -> dict | None:
    """The keep rule on a speed lever timed against the arm below (speed.py), the timing saved as
    STEM-runs/<lever>-speed.json; a ladder recorded before this timing: its short runs, read as they were."""
    cfg, name = ladder.cfg, f'{slug(lever.name)}-speed'
    path = os.path.join(curves_dir(cfg), name + '.json')
    arms = {'lever': {'name': lever.name, 'flags': arm.flags}, 'below': {'name': below.name, 'flags': below.flags}}
    again = name in retrain_names(cfg)
    if os.path.isfile(path) and not again:
        saved = speed.checked(path, cfg, ladder.identity, timing_code()['hash'], arms)
    elif not again and all(os.path.isfile(curve_path(Job(a, s, cfg.speed_images, target), cfg)) for a in (arm, below)
                           for s in range(cfg.lever_seeds)):
        decision = judge_lever(ladder, lever, arm, below, cfg.speed_images, target, kept, part='speed (short runs)')
        return decision and {**decision, 'fresh': True}  # never more short runs: a new ladder confirms it
    elif ladder.dry or ('speed' not in ladder.parts and not again):
        raise Missing('speed', f"{lever.name}'s timing against {below.name}", 'speed' in ladder.parts or again)
    else:  # a signal is heeded after each arm's build and warm-up, and each round
        print(f'{lever.name}: timed against {below.name}, interleaved', flush=True)
        device = pick_device(cfg.device)
        got = speed.interleave({below.name: below.flags, lever.name: arm.flags}, base_flags(cfg), device,
                                      cfg.speed_rounds, cfg.speed_steps, stop=ladder.stop)
        if got is None:
            return None
        saved = speed.record(arms, got, cfg, ladder.identity, timing_code(), device_name(device))
        os.makedirs(curves_dir(cfg), exist_ok=True)
        with atomic_open(path) as f:
            json.dump(saved, f, indent=1)
        ladder.trained.add(name)
    return {'lever': lever.name, 'builds_on': below.name, 'judged_by': 'speed', 'elsewhere': False, 'kept_below': kept,
            'fresh': False, 'images': planned,
            **speed.decide(saved, planned, cfg.lever_seeds, max(cfg.seeds, cfg.lever_seeds))}


def side_by_side(cfg: LadderConfig, target: float, stop: StopFlag, identity: dict, dry: bool = False,
                 trains: set = None) -> dict | None:
    """A study (--ladder prediction or shape): every arm on the baseline, --seeds seeds each."""
    ladder = Ladder(cfg, identity, stop, dry, trains)
    base = ladder.get('baseline', BASELINE_ARM, range(cfg.seeds), cfg.images, target)
    if base is None:
        return None
    done = {'ladder': ladder, 'decisions': {}, 'screened': {}, 'best_peer': None, 'fastest': None, 'missing': None,
            'stopped_at': None, 'planned': {},  # the headline arms' planned images where they are not --images
            'targets': {'target': target, 'easy_target': max(score_at(r, cfg.easy_at) for r in base)}}
    try:
        for arm in chosen(cfg, STUDIES[cfg.ladder]()[1:]):
            if ladder.get('quality', arm, range(cfg.seeds), cfg.images, target) is None:
                return None
    except Missing as missing:
        done['missing'], done['stopped_at'] = str(missing), missing
    return done


def run_all(jobs: list, cfg: LadderConfig, identity: dict, stop: StopFlag) -> list | None:
    """The jobs' results in order; None when a signal stopped the ladder. A failed run ends it; with
    --workers N, each run is a process of its own (workers.py)."""
    if cfg.workers == 1:
        results = []
        for job in jobs:
            result = run_job(job, cfg, identity, stop)
            if result is None or stop.reason:
                return None
            results.append(result)
        return results
    failed = run_processes([job for job in jobs if read_result(job, cfg, identity) is None], run_job, cfg, identity,
                           stop)  # finished ones are read back below
    if stop.reason:  # a worker cut by the same signal may have failed in its start-up: a stop, not a failure
        return None
    if failed:
        raise RunFailed(failed)
    return [read_result(job, cfg, identity, replaced=True) for job in jobs]  # each worker wrote its own


# ----------------------------------------------------------------------------- checks and main

def check_arms(cfg: LadderConfig):
    """Every arm's flags through train.py's own validation, and every run (recipe runs too) reaching its
    first evaluation, before any run starts."""
    device = pick_device(cfg.device)
    levers = speed_levers(device, cfg) if cfg.ladder == 'speed' else []
    budgets = [(BASELINE_ARM, cfg.images)] + [(Arm(lv.name, '', BASELINE + lv.flags), lv.images or cfg.images)
                                              for lv in levers]
    if cfg.ladder in STUDIES:
        budgets = [(arm, cfg.images) for arm in chosen(cfg, STUDIES[cfg.ladder]())]
    else:
        if reason := diffusers_missing_reason():
            raise ConfigError(f'the diffusers recipe arms: {reason}')
        budgets += [(arm, images) for arm in recipe_variants(cfg) for images in (cfg.screen_images, decay_plan(cfg))]
    if any(lv.judged_by == 'speed' for lv in levers) and cfg.speed_rounds < max(cfg.seeds, cfg.lever_seeds):
        raise ConfigError(f'--speed-rounds {cfg.speed_rounds}: fewer than the pairs that keep a lever '
                          f'({max(cfg.seeds, cfg.lever_seeds)}, --seeds): no speed lever could be kept')
    for arm, images in budgets:
        batch = (recipe_settings(arm)[0] if arm.recipe else
                 train_config.check_flags(base_flags(cfg) + arm.flags).batch_size)
        if math.ceil(images / batch) * batch < cfg.eval_every:
            raise ConfigError(f'at batch {batch} a {images:,}-image run of {arm.name!r} ends at '
                              f'{math.ceil(images / batch) * batch:,} images, before its first evaluation '
                              f'(--eval-every {cfg.eval_every}): raise its budget or lower --eval-every')
    if not cfg.eval_every <= cfg.easy_at <= cfg.images:
        raise ConfigError(f'--easy-at {cfg.easy_at}: between --eval-every ({cfg.eval_every}) and --images '
                          f'({cfg.images}), so that the baseline has a score there')


def check_names(cfg: LadderConfig):
    every = {a.name for a in STUDIES[cfg.ladder]()} if cfg.ladder in STUDIES else {
        x.name for x in arms.levers(cfg, ours(cfg), bf16=True) +
        recipe_variants(dataclasses.replace(cfg, arms=''))}
    unknown = [n for n in names_in(cfg.arms, '--arms') if n not in every]
    if unknown:
        raise ConfigError(f"--arms: no lever or variant named {', '.join(map(repr, unknown))}; those of --ladder "
                          f"{cfg.ladder} are: {', '.join(sorted(every))}")


def check_run_lengths(cfg: LadderConfig, target: float):
    """Every train.py run the ladder may make, with its own --steps and stop, through train.py's validation:
    each lever alone at its budget, and every chosen lever at once (the arm with all of them kept) at the
    budgets of the arms above the levers. A lever that cannot work over its run (an lr decay whose warm-up
    outlasts the run) is refused now, not when its run starts."""
    device = pick_device(cfg.device)
    levers = speed_levers(device, cfg) if cfg.ladder == 'speed' else []
    arms = [(BASELINE_ARM, cfg.images)] + [(Arm(lv.name, '', BASELINE + lv.flags), lv.images or cfg.images)
                                           for lv in levers]
    if levers:
        every = Arm('every lever', '', BASELINE + [f for lv in levers for f in lv.flags])
        arms += [(every, images) for images in {cfg.images, decay_plan(cfg)}]
    if cfg.ladder in STUDIES:
        arms = [(arm, cfg.images) for arm in chosen(cfg, STUDIES[cfg.ladder]())]
    for arm, images in arms:
        try:
            run_flags(cfg, Job(arm, 0, images, target), os.path.join(cfg.runs_dir, 'check'))
        except ConfigError as error:
            raise ConfigError(f'the runs of {arm.name!r} ({images:,} images): {error}') from None


def check_parts(cfg: LadderConfig, target: float, identity: dict) -> bool:
    """A dry pass over the ladder as far as its finished runs go, each read back under the reuse rule (a
    curve of other flags is refused here, before anything is made), to the first run not finished: when
    this command does not train that run, every part it asks for beyond it cannot start, and the command
    is refused rather than saying that its part is done. Returns whether the command trains a run."""
    try:
        done = (climb if cfg.ladder == 'speed' else side_by_side)(cfg, target, StopFlag(), identity, dry=True)
        first = done['stopped_at']
    except Missing as missing:
        first = missing
    if first is None or first.trainable:
        return first is not None or bool(retrain_names(cfg))
    beyond = [p for p in PARTS if p in names_in(cfg.train, '--train') and PARTS.index(p) > PARTS.index(first.part)]
    if beyond:
        raise ConfigError(f"--train {','.join(beyond)}: cannot start before {first}")
    return bool(retrain_names(cfg))


def refuse_unhashed(cfg: LadderConfig):
    """A command that trains pairs no new run with a curve recorded before curves held their code's hash
    (the committed ones): that its code trained as this code does cannot be shown. Such a curve makes
    reports (python -m time_to_quality.recompute) only; the command is refused in one line naming it."""
    folder = curves_dir(cfg)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if name.endswith('.json') and name[:-len('.json')] not in retrain_names(cfg):
            with open(path) as f:
                saved = json.load(f)
            if saved.get('code') is None:
                raise ConfigError(f"{path}: recorded before curves held their code's hash (commit "
                                  f"{saved.get('made', {}).get('commit')}): read for a report "
                                  f"(python -m time_to_quality.recompute), never beside a new run; pass a new "
                                  f"--out-dir, or --retrain {name[:-len('.json')]}")


def validate(cfg: LadderConfig) -> tuple:
    """Every check before any run and before any folder is made: flags, each arm and each run's length,
    the data, the target against the floor, the runs folder, every finished curve (reuse_or_refuse) and
    whether the parts asked for can start. Returns (floor or None, target, the ladder's identity)."""
    check_ranges(cfg)
    check_plain_name(stem_of(cfg), '--stem')
    parts = set(PARTS) if cfg.ladder == 'speed' else {'baseline', 'quality'}
    unknown = set(names_in(cfg.train, '--train')) - parts
    if unknown:
        raise ConfigError(f"--train: no part named {', '.join(sorted(unknown))}; the parts of --ladder {cfg.ladder} "
                          f"are {', '.join(p for p in PARTS if p in parts)}")
    check_names(cfg)
    check_arms(cfg)
    identity = ladder_identity(cfg)  # loads the data: a missing or empty folder is refused here
    folders = ((cfg.runs_dir, '--runs-dir'), (cfg.data_dir, '--data-dir'), (cfg.out_dir, '--out-dir'))
    for folder, name in folders:
        check_creatable(folder, name)
    floor, target = None, evaluation.DIGITS_TARGET if cfg.target is None and cfg.dataset == 'digits' else cfg.target
    if target is None:
        raise ConfigError('--target: needed for FID (no default outside digits)')
    check_run_lengths(cfg, target)
    if cfg.dataset == 'digits':
        floor = floor_of(cfg.dataset, cfg.image_size, cfg.data_dir)
        if target <= floor:
            raise ConfigError(f'--target {target}: below the floor of the digits score at {cfg.image_size}x'
                              f'{cfg.image_size} ({floor:.2f}, real held-out digits): no model can reach it')
    else:
        evaluation.inception_extractor('', pick_device(cfg.device))  # offline without its weights: one line here
    check_runs_dir(cfg, identity)
    check_curves(cfg, identity, target)
    if check_parts(cfg, target, identity):
        refuse_unhashed(cfg)
    for folder, name in folders:  # created only now that every check has passed
        check_writable(folder, name)
    return floor, target, identity


def ladder(cfg: LadderConfig) -> dict | None:
    floor, target, identity = validate(cfg)
    release = claim_runs_dir(cfg, identity)
    stop = StopFlag()
    restore = stop.install()
    try:
        done = (climb if cfg.ladder == 'speed' else side_by_side)(cfg, target, stop, identity)
    except Missing as missing:  # before the baseline is whole (validate's dry pass lets no such command start)
        print(f'nothing trained: the ladder needs more runs before its report: {missing}', flush=True)
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
    if first := done['stopped_at']:
        beyond = [p for p in PARTS if p in names_in(cfg.train, '--train') and PARTS.index(p) > PARTS.index(first.part)]
        print((f"--train {','.join(beyond)}: not started, the ladder stopped before them" if beyond else
               'this part is done') + f"; the report holds the finished parts only: {first}", flush=True)
    if left := retrain_names(cfg) - done['ladder'].trained:
        print(f"--retrain {', '.join(sorted(left))}: not reached by this command (the ladder stopped before it, or "
              f"its arm is not in --arms): its curve is kept", flush=True)
    return result


def main(argv=None) -> int:
    return run_main(ladder, parse_config(argv, LadderConfig, time_to_quality.__doc__))

"""Quality per model call: the teacher's solvers on every grid (ours, DDIM and DPM-Solver++ on diffusers'
grids, and diffusers' own schedulers through peers.peer_sample) and distill.py's students, each scored by the
digits score of --num samples over --seeds sampling seeds (the same noise for every model of a seed), each
paired seed by seed with the best solver at its number of calls and with the best at 20; the teacher's
1000-step DDPM as the reference (a guided class-conditional teacher and its students also with the share
judged as the digit asked). Then img/s at batch 1 and at --speed-batch, eager (and compiled with --compile),
of DPM-Solver++ at 20 calls against each student. Without --students, the solvers alone: the table that
chose the samplers' default grids (docs/sampling.md, "Which grid"). Writes OUT_DIR/STEM.{json,md,png} after
every group of rows (a stop keeps what finished); --picture draws the students at 1, 2 and 4 calls beside
the teacher's DPM-Solver++ at 20, from the same noise.

    python scripts/few_step_study.py --teacher runs/ckpt.pt --calls 1,2,3,4,5,8,10,20,50 --seeds 0,1,2,3,4
    python scripts/few_step_study.py --teacher runs/ckpt.pt --students runs/distill \\
        --cond-teacher runs/cond/ckpt.pt --cond-students runs/distill-cond
    python scripts/few_step_study.py --teacher T --students S --quick --device cuda --compile  # timing only
    python scripts/few_step_study.py --teacher T --students S --quick --no-speed --picture PNG  # the picture only
"""
import glob
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import diffusion  # noqa: E402
import evaluation  # noqa: E402
import sample  # noqa: E402
from checkpoint import read_checkpoint, read_student_record, weights_fingerprint  # noqa: E402
from cli import (ConfigError, StopFlag, StopRequested, check_plain_name, check_ranges, flag, int_list,  # noqa: E402
                 parse_config, run_main)
from devices import device_name, device_slug, pick_device, synchronize  # noqa: E402
from drawing import Sampling, class_labels, draw, draw_batch  # noqa: E402
from files import atomic_open, check_creatable, check_writable  # noqa: E402
from peers import PEER_SOLVERS  # noqa: E402
from reports import markdown_table, provenance, pyplot, save_figure, write_report  # noqa: E402


SAME_WITHIN = 1.05  # a score within 5% of another is within its noise: the spec's target for the digits score

# The teacher's solvers: ours on each of diffusers' grids, then diffusers' own schedulers (peers.py).
SOLVERS = tuple(f'{sampler}-{spacing}' for sampler in ('ddim', 'dpm++') for spacing in diffusion.SPACINGS[sampler]) \
    + tuple(PEER_SOLVERS)

SCORE = evaluation.score_key('digits')  # the class FD (docs/sampling.md, "A score that decides")


@dataclass
class StudyConfig:
    teacher: str = flag('', 'the unconditional teacher: a train.py digits checkpoint (required)')
    students: str = flag('', 'its students: distill.py --out-dirs (their student-N.pt and consistency-N.pt) or '
                             'checkpoints, comma-separated '
                             '(none: the teacher\'s solvers alone)')
    cond_teacher: str = flag('', 'a class-conditional teacher (train.py --class-cond), optional')
    cond_students: str = flag('', 'its guided students, as --students')
    guidance: float | None = flag(None, 'the class-conditional teacher\'s scale (default: the one its students '
                                        'learnt)', at_least=0)
    calls: str = flag('1,2,4,8,20', 'model calls of the teacher\'s solvers')
    mid_timesteps: str = flag('', '2-call consistency students\' second timesteps to try, comma-separated, each a '
                                  'row "consistency-2@M" (default: each student\'s own)')
    only: str = flag('', 'score and time one family alone (--teacher still sets the judge\'s image size)',
                     choices=('', 'unconditional', 'guided'))
    solvers: str = flag(','.join(SOLVERS), 'the teacher\'s solvers, comma-separated: ours as SAMPLER-GRID, diffusers\' '
                                          'own as diffusers-NAME (peers.PEER_SOLVERS)')
    seeds: str = flag('0,1,2', 'sampling seeds (the spread is over these)')
    num: int = flag(450, 'samples per score (450: the size of the held-out digits that set the floor)', at_least=2)
    batch_size: int = flag(450, 'images per sampling batch', at_least=1)
    ddpm: bool = flag(True, 'the teacher\'s 1000-step DDPM as the reference, on the first seed (1000 calls per image: '
                            'the slow part)')
    speed: bool = flag(True, 'the img/s rows')
    speed_batch: int = flag(500, 'the large batch of the img/s rows', at_least=2)
    latency_images: int = flag(32, 'images drawn one at a time for the batch-1 img/s rows', at_least=1)
    speed_repeats: int = flag(3, 'timed runs per img/s row (the median is kept), after one untimed', at_least=1)
    compile: bool = flag(False, 'also time torch.compile\'d networks (minutes of compiling on a CPU)')
    compile_mode: str = flag('default', 'torch.compile\'s mode for --compile (reduce-overhead: CUDA graphs)',
                             choices=('default', 'reduce-overhead', 'max-autotune'))
    speed_calls: str = flag('20', 'the teacher\'s DPM-Solver++ calls in the img/s rows, comma-separated')
    quick: bool = flag(False, 'no scores: the img/s rows alone (--speed-repeats timed runs per row) and the picture '
                              'if asked; a GPU\'s short window')
    recompute: bool = flag(False, 'no sampling: the report again from OUT_DIR/STEM.json\'s rows (after a change to '
                                  'its summary)')
    data_dir: str = flag('./data', 'where the digit classifier is cached')
    out_dir: str = flag('runs/few-step', 'where the JSON, Markdown and PNG go (results/ only when named: a run '
                                         'never replaces the committed evidence by default)')
    stem: str = flag('', 'the reports\' file name (default: DEVICE-digits-few-step, such as cpu-digits-few-step)')
    picture: str = flag('', 'a side-by-side PNG of the students and the teacher (the README\'s: '
                            'ddpm_samples/readme_few_step.png; empty: none)')
    device: str = flag('auto', 'auto, cpu, cuda or cuda:N')


def main(argv=None) -> int:
    return run_main(study, parse_config(argv, StudyConfig, __doc__))


# ----------------------------------------------------------------------------- models

def student_paths(text: str) -> list:
    """The comma-separated files given, each distill.py output folder among them as its student-N.pt and
    consistency-N.pt."""
    paths = []
    for part in (part for part in text.split(',') if part):
        paths += sorted(glob.glob(os.path.join(glob.escape(part), 'student-*.pt')) + glob.glob(os.path.join(
            glob.escape(part), 'consistency-*.pt'))) if os.path.isdir(part) else [part]
    return paths


def student_name(record: dict) -> str:
    """'student-N' (progressive distillation) or 'consistency-N', N its calls."""
    return f"{'consistency' if record.get('method') == 'consistency' else 'student'}-{record['steps']}"


def student_runs(family: dict, mids: list = ()) -> list:
    """(name, sampler, calls, (model, config, schedule, prediction), Sampling's other fields) per student; a
    2-call consistency student once per timestep of `mids` (as NAME@M), or at its own second timestep."""
    runs = []
    for name, (*model, record, _) in family['students'].items():
        if record.get('method') != 'consistency':
            runs.append((name, 'student', record['steps'], tuple(model), {}))
        elif record['steps'] == 1:
            runs.append((name, 'consistency', 1, tuple(model), {}))
        else:
            runs += [(f'{name}@{mid}' if mids else name, 'consistency', 2, tuple(model), {'mid_timestep': mid})
                     for mid in mids or [record['timesteps'][-1]]]
    return runs


def load_family(teacher_path: str, students_text: str, device, flag_name: str, students_flag: str) -> dict:
    """{'teacher': (model, config, sched, prediction), 'students': {name: (model, ..., record, path)}, ...},
    each student checked to be a student of this teacher: its record's fingerprint of the teacher's
    weights (or, for a student made before fingerprints, the teacher's train.py settings)."""
    teacher = sample.load_model(teacher_path, 'ema', device, named_as=f'--{flag_name} {teacher_path}')
    if teacher[1].in_channels != 1:
        raise ConfigError(f'--{flag_name} {teacher_path}: not a digits model ({teacher[1].in_channels} channels)')
    fingerprint, teacher_settings = None, None
    students = {}
    for path in student_paths(students_text):
        record = read_student_record(path)
        if record is None:
            raise ConfigError(f'--{students_flag}: {path} is not a distill.py student (OUT/student-N.pt)')
        if student_name(record) in students:
            raise ConfigError(f'--{students_flag}: {students[student_name(record)][5]} and {path} are both '
                              f'{student_name(record)}; give one student of a kind per number of calls')
        if record.get('first_teacher_fingerprint'):
            fingerprint = fingerprint or weights_fingerprint(teacher[0].state_dict())
            ours = record['first_teacher_fingerprint'] == fingerprint
        else:
            teacher_settings = teacher_settings or read_checkpoint(teacher_path, teacher_path)['config']
            ours = read_checkpoint(path, path, student_ok=True)['config'] == teacher_settings
        if not ours:
            raise ConfigError(f'--{students_flag}: {path} was distilled from another model than --{flag_name} '
                              f'{teacher_path}')
        students[student_name(record)] = (*sample.load_model(path, 'ema', device, student=True,
                                                        named_as=f'--{students_flag} {path}'), record, path)
    if students_text and not students:
        raise ConfigError(f'--{students_flag}: no student-N.pt in {students_text!r}: pass distill.py\'s --out-dir or '
                          f'the files')
    order = sorted(students, key=lambda name: (name.startswith('consistency'), -students[name][4]['steps']))
    return {'teacher': teacher, 'students': {name: students[name] for name in order}, 'path': teacher_path}


def made_by(path: str) -> dict:
    """What a checkpoint came from: its sha256, its train.py or distill.py settings, images and seconds."""
    with open(path, 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    ckpt = read_checkpoint(path, path, student_ok=True)
    if 'student' in ckpt:
        return {'sha256': digest, 'distill': ckpt['distill'], 'images': ckpt['images_seen'], 'seconds': ckpt['seconds']}
    return {'sha256': digest, 'flags': ckpt.get('flags', {}), 'images': ckpt['step'] * ckpt['config']['batch_size'],
            'seconds': ckpt.get('train_seconds')}


# ----------------------------------------------------------------------------- scores

def solver_sampling(solver: str, calls: int) -> dict:
    """Sampling's fields for a solver name of SOLVERS: ours as SAMPLER-GRID, a peer by its own name."""
    if solver in PEER_SOLVERS or solver in ('student', 'consistency', 'ddpm'):
        return {'sampler': solver, 'steps': calls}
    sampler, _, spacing = solver.rpartition('-')
    return {'sampler': sampler, 'spacing': spacing, 'steps': calls}


def score_rows(args, family: dict, judge, guidance, seeds: list, calls: list, solvers: list, device,
               stop: StopFlag, write, rows: list):
    """Appends to `rows` one row per (model, solver, calls, seed): the digits score of --num samples, and
    for a class-conditional family the share judged as the digit asked; write() after each seed."""
    config = family['teacher'][1]
    runs = [('teacher', solver, n, family['teacher'], {}) for solver in solvers for n in calls] + student_runs(
        family, int_list(args.mid_timesteps, '--mid-timesteps') if args.mid_timesteps else ())
    asked = class_labels(0, args.num, 10)
    for seed in seeds:  # the 1000-call reference on the first seed only: it costs as much as all the rest
        reference = [('teacher', 'ddpm', 1000, family['teacher'], {})] if args.ddpm and seed == seeds[0] else []
        for name, solver, n, (net, net_config, net_sched, net_prediction), more in runs + reference:
            sampling = Sampling(num=args.num, batch_size=args.batch_size, seed=seed, **solver_sampling(solver, n),
                                guidance=1.0 if name != 'teacher' else (guidance or 1.0), **more)
            with stop.interruptible():
                images = torch.cat(list(draw(net, net_config, net_sched, sampling, device, progress=False,
                                             prediction=net_prediction)))
            row = {'model': name, 'sampler': solver, 'calls': n, 'seed': seed,
                   'evaluations': evaluations(name, n, guidance),
                   **judge.score(judge.features(images)), **judge.memorisation(images)}
            if config.num_classes:
                row['accuracy'] = judge.conditioning(images, asked)['accuracy']
            rows.append(row)
            print(f"{name} {solver} {n} calls, seed {seed}: digits score {row[SCORE]:.1f}"
                  + (f", {row['accuracy']:.1%} as asked" if 'accuracy' in row else ''), flush=True)
        write()


def paired_ratio(group: list, reference: dict) -> dict:
    """The geometric mean over seeds of FD / the reference's FD on the same seed (the same noise), with
    its 95% t-interval from the log ratios; None under two pairs."""
    logs = [math.log(r[SCORE] / reference[r['seed']]) for r in group if r['seed'] in reference]
    if len(logs) < 2:
        return None
    spread = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.mean(logs)
    return {'ratio': math.exp(mean), 'low': math.exp(mean - spread), 'high': math.exp(mean + spread),
            'pairs': len(logs)}


def summarise(rows: list) -> list:
    """Per (model, solver, calls): mean, sd and the 95% t-interval of the FD over the seeds; paired seed by
    seed (the same seed draws the same noise for every model), the FD ratio to the best teacher solver at
    the same number of calls (the lowest mean; 'best_solver') and to the best at 20 calls, each as
    paired_ratio. 'not_worse_than_best': it is the best, or not decided worse by more than the score's
    target noise (the first's interval reaches SAME_WITHIN or below: solvers that converge to one ODE
    solution differ by fractions of a percent, consistently, which decides nothing a user would see)."""
    groups = {}
    for row in rows:
        groups.setdefault((row['model'], row['sampler'], row['calls']), []).append(row)
    means = {key: statistics.mean(r[SCORE] for r in group) for key, group in groups.items()}
    best = {}
    for (name, solver, n), mean in means.items():
        if name == 'teacher' and solver != 'ddpm' and (n not in best or mean < means[best[n]]):
            best[n] = (name, solver, n)
    by_seed = {n: {r['seed']: r[SCORE] for r in groups[key]} for n, key in best.items()}
    out = []
    for (name, solver, n), group in groups.items():
        fds = [r[SCORE] for r in group]
        sd = statistics.stdev(fds) if len(fds) > 1 else None
        half = t_quantile(len(fds) - 1) * sd / math.sqrt(len(fds)) if sd is not None else None
        vs_best = paired_ratio(group, by_seed[n]) if n in best and best[n] != (name, solver, n) else None
        out.append({'model': name, 'sampler': solver, 'calls': n, 'evaluations': group[0]['evaluations'],
                    'seeds': len(fds), 'fd_mean': statistics.mean(fds), 'fd_sd': sd, 'fd_ci95': half,
                    'best_solver': best[n][1] if n in best else None, 'paired_vs_best': vs_best,
                    'not_worse_than_best': n in best and (best[n] == (name, solver, n) or
                                                           bool(vs_best and vs_best['low'] <= SAME_WITHIN)),
                    'best_at_20': best[20][1] if 20 in best else None,
                    'paired_vs_best20': paired_ratio(group, by_seed[20]) if 20 in best and best[20] != (
                        name, solver, n) else None,
                    'near_copies_mean': statistics.mean(r['digits_near_copies'] for r in group)
                    if 'digits_near_copies' in group[0] else None,
                    'accuracy_mean': statistics.mean(r['accuracy'] for r in group) if 'accuracy' in group[0]
                    else None})
    return out


def t_quantile(dof: int) -> float:
    """The two-sided 95% quantile of Student's t (scipy's; 1.96 without scipy or with many seeds)."""
    try:
        from scipy.stats import t
        return float(t.ppf(0.975, dof))
    except ImportError:
        return 1.96


# ----------------------------------------------------------------------------- speed

def speed_rows(args, speed_calls: tuple, family: dict, guidance, device, stop: StopFlag, write, rows: list):
    """img/s of DPM-Solver++ at --speed-calls (guided: both halves each) and of each student, at batch 1 (latency:
    --latency-images one at a time) and at --speed-batch (throughput), eager and with --compile compiled; the median
    of --speed-repeats timed runs after an untimed one. The runs are interleaved, one of every row a round, so a
    machine that speeds up or slows down moves every row of a ratio alike."""
    candidates = [('teacher', 'dpm++', n, family['teacher'], {}) for n in speed_calls]
    candidates += student_runs(family)
    for compiled in (False, True) if args.compile else (False,):
        cases = []
        for name, sampler, n, (net, config, sched, prediction), more in candidates:
            runner = torch.compile(net, mode=args.compile_mode) if compiled else net
            for batch in (1, args.speed_batch):
                sampling = Sampling(num=args.latency_images if batch == 1 else batch, batch_size=batch,
                                    sampler=sampler, steps=n, seed=0,
                                    guidance=1.0 if name != 'teacher' else (guidance or 1.0), **more)
                cases.append((name, n, batch, (runner, sched.to(device), sampling, config, prediction)))
        times, before = [[] for _ in cases], len(rows)
        for repeat in range(1 + args.speed_repeats):  # the first round warms up (and compiles)
            for (name, n, batch, (runner, sched, sampling, config, prediction)), kept in zip(cases, times):
                with stop.interruptible():
                    synchronize(device)
                    start = time.perf_counter()
                    for first in range(0, sampling.num, batch):
                        draw_batch(runner, sched, sampling, device, first, config, prediction)
                    synchronize(device)
                if repeat:
                    kept.append(time.perf_counter() - start)
            if repeat:  # the rows so far after every round: a stop keeps the rounds that finished
                rows[before:] = [speed_row(name, n, batch, sampling, compiled, guidance, kept)
                                 for (name, n, batch, (_, _, sampling, _, _)), kept in zip(cases, times)]
                write()
        for row in rows[before:]:
            print(f"{row['model']} ({row['calls']} calls) batch {row['batch']}{' compiled' if compiled else ''}: "
                  f"{row['img_per_s']:.1f} img/s", flush=True)


def speed_ratio(row: dict, rows: list) -> str:
    """A row's img/s over the teacher's with the most calls at the same batch and compile ('' for that row or
    without it): the ratio of the targets (a 2-call student against the 20-call solver)."""
    teacher = [r for r in rows if r['model'] == 'teacher' and r['batch'] == row['batch']
               and r['compiled'] == row['compiled']]
    top = max(teacher, key=lambda r: r['calls'], default=None)
    return '' if top is None or top is row else f"{row['img_per_s'] / top['img_per_s']:.1f}x"


def evaluations(name: str, calls: int, guidance) -> int:
    """Network evaluations of a draw: a guided teacher runs both halves at each call, a student one pass."""
    return calls * (2 if name == 'teacher' and guidance not in (None, 0, 1) else 1)


def speed_row(name: str, calls: int, batch: int, sampling: Sampling, compiled: bool, guidance, seconds: list) -> dict:
    """One img/s row: the median of its timed runs (`seconds`, as many as the rounds that finished)."""
    return {'model': name, 'sampler': sampling.sampler, 'calls': calls, 'batch': batch, 'compiled': compiled,
            'evaluations': evaluations(name, calls, guidance),
            'images': sampling.num, 'img_per_s': sampling.num / statistics.median(seconds), 'seconds': list(seconds)}


# ----------------------------------------------------------------------------- the study

def study(args: StudyConfig):
    check_ranges(args)
    calls, seeds = int_list(args.calls, '--calls'), parse_seeds(args.seeds)
    speed_calls = int_list(args.speed_calls, '--speed-calls')  # refused here, before any model is loaded
    if len(set(speed_calls)) < len(speed_calls):
        raise ConfigError(f'--speed-calls {args.speed_calls}: each count once')
    if args.compile_mode != 'default' and not args.compile:
        raise ConfigError(f'--compile-mode {args.compile_mode} times compiled networks: add --compile')
    mids = int_list(args.mid_timesteps, '--mid-timesteps') if args.mid_timesteps else []
    if any(not 0 <= mid <= 998 for mid in mids):
        raise ConfigError(f'--mid-timesteps {args.mid_timesteps}: each a timestep in 0..998')
    solvers = [part for part in args.solvers.split(',') if part]
    unknown = [name for name in solvers if name not in SOLVERS]
    if unknown or not solvers:
        raise ConfigError(f'--solvers {args.solvers!r}: each one of {", ".join(SOLVERS)}')
    if not args.teacher:
        raise ConfigError('--teacher is required: a train.py digits checkpoint')
    if args.stem:
        check_plain_name(args.stem, '--stem')
    if args.only == 'guided' and not args.cond_teacher:
        raise ConfigError('--only guided needs --cond-teacher')
    if args.cond_students and not args.cond_teacher:
        raise ConfigError('--cond-students needs --cond-teacher, the model they were distilled from')
    check_creatable(args.out_dir, '--out-dir')
    device = pick_device(args.device, 0)
    families = {'unconditional': load_family(args.teacher, args.students, device, 'teacher', 'students')}
    if args.cond_teacher:
        families['guided'] = load_family(args.cond_teacher, args.cond_students, device, 'cond-teacher',
                                         'cond-students')
        size = families['guided']['teacher'][1].image_size
        teacher_size = families['unconditional']['teacher'][1].image_size
        if families['guided']['teacher'][1].num_classes != 10:
            raise ConfigError(f'--cond-teacher {args.cond_teacher}: not a class-conditional digits model')
        if size != teacher_size:
            raise ConfigError(f'--cond-teacher {args.cond_teacher}: {size}x{size} digits, --teacher {args.teacher} '
                              f'{teacher_size}x{teacher_size}; one judge scores both: train them at one size')
    most = min(family['teacher'][2].num_steps for family in families.values())
    for flag_name, counts in (('--calls', calls), ('--speed-calls', speed_calls)):
        if max(counts) > most:
            raise ConfigError(f'{flag_name} {",".join(map(str, counts))}: the teacher has {most} timesteps, '
                              f'so at most {most} calls')
    guidance = study_guidance(args.guidance, families)
    judge = None if args.quick else evaluation.DigitsJudge(families['unconditional']['teacher'][1].image_size,
                                                           args.data_dir)
    check_writable(args.out_dir, '--out-dir')
    stem = args.stem or f'{device_slug(device)}-digits-few-step'
    result = {**provenance(device_name(device)), 'config': asdict(args), 'guidance': guidance,
              'made_by': {name: {'teacher': made_by(f['path']), 'students': {n: made_by(s[5]) for n, s in
                                                                              f['students'].items()}}
                          for name, f in families.items()}, 'scores': {}, 'speed': {}}
    if args.recompute:
        try:
            with open(os.path.join(args.out_dir, f'{stem}.json')) as f:
                result = {**json.load(f), 'plotted': None}
            result['summary_recomputed'] = {k: v for k, v in provenance(device_name(device)).items()
                                            if k in ('date', 'commit', 'command')}
        except (OSError, ValueError) as error:
            raise ConfigError(f'--recompute: cannot read {args.out_dir}/{stem}.json ({error})') from None
        return report(args, stem, result, judge)
    write = lambda: report(args, stem, result, judge)  # noqa: E731 (the plot redrawn when the scores grew)
    stop = StopFlag()
    restore = stop.install()
    try:
        if args.picture:
            picture(families['unconditional'], args.picture)
        for name, family in families.items():
            if args.only and name != args.only:
                continue
            scale = guidance if name == 'guided' else None
            if not args.quick:
                score_rows(args, family, judge, scale, seeds, calls, solvers, device, stop, write,
                           result['scores'].setdefault(name, []))
            if args.speed and family['students']:
                speed_rows(args, speed_calls, family, scale, device, stop, write,
                           result['speed'].setdefault(name, []))
    except StopRequested:
        print(f'stopped by {stop.reason}: {args.out_dir}/{stem}.* hold the rows that finished', flush=True)
    finally:
        restore()
        write()


def study_guidance(given: float | None, families: dict) -> float | None:
    """The one scale of the guided family: the scale its students learnt, which --guidance may name
    but not change (a teacher at another scale than its students is another comparison)."""
    if 'guided' not in families:
        return given
    learnt = {r[4].get('guidance') for r in families['guided']['students'].values()}
    if len(learnt) > 1:
        raise ConfigError(f'--cond-students learnt different guidance scales ({sorted(learnt)}); give the students of '
                          f'one scale')
    scale = learnt.pop() if learnt else given
    if scale is None:
        raise ConfigError('--guidance: the scale of the guided teacher, needed where there are no guided students')
    if given is not None and given != scale:
        raise ConfigError(f'--guidance {given}: the guided students learnt {scale}; the teacher is compared at the '
                          f'scale its students learnt (leave --guidance out)')
    return scale


def parse_seeds(text: str) -> list:
    try:
        seeds = [int(part) for part in text.split(',')]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ConfigError(f'--seeds {text!r}: distinct whole numbers, 0 or more, separated by commas, such as 0,1,2')
    return seeds


def interval(paired: dict) -> str:
    return f"{paired['ratio']:.2f} [{paired['low']:.2f}, {paired['high']:.2f}]" if paired else ''


def grid_table(summary: list) -> str:
    """The teacher's solvers by calls: each cell the mean FD, bold where best at its calls, and marked
    '~' where not decided worse by more than 5% (summarise), 'x' where decided worse."""
    solvers = list(dict.fromkeys(s['sampler'] for s in summary if s['model'] == 'teacher' and s['sampler'] != 'ddpm'))
    cells = {(s['sampler'], s['calls']): s for s in summary if s['model'] == 'teacher'}
    calls = sorted({n for _, n in cells if _ in solvers})

    def cell(s):
        if s is None:
            return ''
        if s['best_solver'] == s['sampler']:
            return f"**{s['fd_mean']:.1f}**"
        return f"{s['fd_mean']:.1f} {'~' if s['not_worse_than_best'] else 'x'}"
    rows = [[solver] + [cell(cells.get((solver, n))) for n in calls] +
            [sum(1 for n in calls if (solver, n) in cells and cells[solver, n]['not_worse_than_best'])]
            for solver in solvers]
    return markdown_table(['solver'] + [f'{n} calls' for n in calls] + ['calls where best or not worse'], rows)


def report(args: StudyConfig, stem: str, result: dict, judge):
    """STEM.json and .md from the rows so far, and STEM.png when there are more scores than it shows."""
    result['summary'] = {name: summarise(rows) for name, rows in result['scores'].items() if rows}
    tables = []
    for name, summary in result['summary'].items():
        label = f"{name} (teacher and students at guidance {result['guidance']})" if name == 'guided' else name
        tables.append(f'### {label}: the teacher\'s solvers, digits score by calls (bold: best; ~: not decided '
                      f'worse by more than 5% on the seeds\' paired interval; x: worse)\n\n'
                      + grid_table(summary))
        tables.append(f'### {label}: every model\n\n' + markdown_table(
            ['model', 'solver', 'calls', 'network evaluations', 'digits score, mean +- sd', '95% interval',
             'best solver at these calls', 'paired with it, same noise [95%]', 'paired with the best at 20 [95%]',
             'near copies'] + (['judged as asked'] if name == 'guided' else []),
            [[s['model'], s['sampler'], s['calls'], s['evaluations'],
              f"{s['fd_mean']:.2f} +- {s['fd_sd'] or 0:.2f}", f"+- {s['fd_ci95']:.2f}" if s['fd_ci95'] else '',
              s['best_solver'] or '', interval(s['paired_vs_best']), interval(s['paired_vs_best20']),
              '' if s.get('near_copies_mean') is None else f"{s['near_copies_mean']:.1%}"] +
             ([f"{s['accuracy_mean']:.1%}"] if name == 'guided' else []) for s in summary], left=2))
    for name, rows in result['speed'].items():
        tables.append(f'### images per second, {name}\n\n' + markdown_table(
            ['model', 'calls', 'network evaluations', 'batch', 'compiled', 'img/s', 'x the teacher\'s most calls'],
            [[r['model'], r['calls'], r['evaluations'], r['batch'], 'yes' if r['compiled'] else 'no',
              f"{r['img_per_s']:.1f}", speed_ratio(r, rows)] for r in rows]))
    floor = (f'; the digits score is the class FD (lower is better); its floor (450 held-out digits): '
             f'{judge.floor[SCORE]:.1f}' if judge else '')
    notes = f'; {args.num} samples per score, seeds {args.seeds}{floor}' if result['scores'] else '; img/s alone'
    path = write_report(args.out_dir, stem, result, 'The teacher\'s solvers and its few-step students',
                        '\n\n'.join(tables) or '(no rows yet)', notes=notes)
    scored = sum(len(rows) for rows in result['scores'].values())
    if scored and scored != result.get('plotted'):
        plot(result['summary'], judge, path)
        result['plotted'] = scored


STUDENT_STYLES = {'student': ('D-', 'black', 'students (progressive distillation)'),
                  'consistency': ('s-', 'tab:red', 'consistency students (ECT)')}


def plot(summaries: dict, judge, path: str):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 4.5), squeeze=False)
    for ax, (name, summary) in zip(axes[0], summaries.items()):
        for solver in dict.fromkeys(s['sampler'] for s in summary if s['sampler'] != 'ddpm'):
            points = sorted((s['evaluations'], s['fd_mean'], s['fd_sd'] or 0) for s in summary
                            if s['sampler'] == solver)
            x, y, e = zip(*points)
            student = STUDENT_STYLES.get(solver)
            style = student[0] if student else ('--' if solver in PEER_SOLVERS else '-')
            ax.errorbar(x, y, yerr=e if student else None, fmt=style, capsize=3, lw=2.5 if student else 1,
                        color=student[1] if student else None, label=student[2] if student else solver)
        ddpm = [s for s in summary if s['sampler'] == 'ddpm']
        if ddpm:
            ax.axhline(ddpm[0]['fd_mean'], color='grey', ls=':', label='teacher, DDPM 1000 calls')
        if judge:
            ax.axhline(judge.floor[SCORE], color='green', ls='--', label='floor: held-out digits')
        ax.set(xscale='log', yscale='log', xlabel='network evaluations per image',
               ylabel='digits score, class FD (lower is better)', title=name)
        ax.legend(fontsize=6, ncol=2)
    save_figure(fig, path)


def picture(family: dict, path: str, count: int = 10):
    """The students at 1, 2 and 4 calls (progressive, then consistency) beside the teacher's DPM-Solver++ at
    20, a row each, from the same noise (seed 0: every sampler's first batch draws the same x_T)."""
    import torch.nn.functional as F
    from PIL import Image
    from torchvision.utils import make_grid
    model, config, sched, prediction = family['teacher']
    device = next(model.parameters()).device
    teacher_at_20 = Sampling(num=count, batch_size=count, sampler='dpm++', steps=20)
    rows = [draw_batch(model, sched.to(device), teacher_at_20, device, 0, config, prediction)]
    drawn = [run for run in student_runs(family) if run[2] in (4, 2, 1)]
    for name, sampler, n, (net, net_config, net_sched, net_prediction), more in drawn:
        rows.append(draw_batch(net, net_sched.to(device), Sampling(num=count, batch_size=count, sampler=sampler,
                                                                  steps=n, **more), device, 0, net_config,
                               net_prediction))
    grid = make_grid(torch.cat(rows).float().cpu() / 255, nrow=count, padding=1, pad_value=0.5)
    pixels = (F.interpolate(grid[None], scale_factor=4, mode='nearest')[0].permute(1, 2, 0) * 255).round().byte()
    check_writable(os.path.dirname(path) or '.', '--picture')
    with atomic_open(path, 'wb') as f:
        Image.fromarray(pixels.numpy()).save(f, format='png')
    print(f"wrote {path}: rows the teacher's DPM-Solver++ at 20 calls, then {', '.join(run[0] for run in drawn)}, "
          f"from the same noise")


if __name__ == '__main__':
    sys.exit(main())

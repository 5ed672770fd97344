"""A screen of distill.py settings, judged: several few_step_study reports made on the same sampling seeds
with the same teacher, one arm each (the study takes one student of a kind per number of calls), paired
seed by seed. Each arm's students stand beside the base arm's at the same calls and beside the teacher's
best solver at 20 calls, as the geometric mean over the seeds of the score ratios with its 95% t-interval
(the same noise for every model of a seed, so a ratio's spread is the models', not the draws').

    python scripts/study_pairs.py --base runs/few-step/base.json --arms runs/few-step/a.json,runs/few-step/b.json
"""
import json
import os
import statistics
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from few_step_study import SCORE, paired_ratio, summarise  # noqa: E402

import distill  # noqa: E402
import students  # noqa: E402
from cli import ConfigError, check_plain_name, flag, parse_config, run_main  # noqa: E402
from files import check_creatable, check_writable  # noqa: E402
from reports import markdown_table, provenance, write_report  # noqa: E402

# What tells the arms apart: the distill.py settings a screen moves.
SETTINGS = ('lr', 'level_mean', 'level_std', 'ode_step', 'ema_decay', 'dropout', 'huber_c', 'steps_per_stage',
            'stages', 'first_stage_steps', 'prediction', 'batch_size', 'seed')
# The settings that one method alone reads (blank for the other's students, whatever their config holds).
METHOD_OF = {key: method for method, keys in distill.METHOD_FLAGS.items() for key in keys}
# What a student made before a setting had its flag ran at (distill.py's constants then).
BEFORE_ITS_FLAG = {'level_mean': students.ECT_P_MEAN, 'level_std': students.ECT_P_STD}


@dataclass
class PairsConfig:
    base: str = flag('', 'the base arm: a few_step_study JSON (required)')
    arms: str = flag('', 'the other arms\' few_step_study JSONs, comma-separated (required)')
    family: str = flag('unconditional', 'which family of the reports to pair', choices=('unconditional', 'guided'))
    out_dir: str = flag('runs/study-pairs', 'where the JSON and Markdown go (results/ only when named: a run never '
                                            'replaces the committed evidence by default)')
    stem: str = flag('study-pairs', 'the reports\' file name')


def read_arm(path: str, family: str) -> dict:
    """{'name', 'rows' (the family's score rows), 'teacher' (its sha256), 'students' ({name: settings})}."""
    try:
        with open(path) as f:
            report = json.load(f)
        rows, made = report['scores'][family], report['made_by'][family]
    except FileNotFoundError:
        raise ConfigError(f'{path}: no such file') from None
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f'{path}: not a few_step_study report with a {family} family') from None
    students = {name: settings_of(record['distill']) for name, record in made.get('students', {}).items()}
    return {'name': os.path.splitext(os.path.basename(path))[0], 'path': path, 'rows': rows,
            'device': report.get('device', ''),
            'teacher': made['teacher']['sha256'], 'students': students}


def settings_of(config: dict) -> dict:
    """The SETTINGS of a student's distill.py config that its method reads ('' for the others)."""
    method = config.get('method', 'progressive')
    settings = {key: config.get(key, BEFORE_ITS_FLAG.get(key)) if METHOD_OF.get(key, method) == method else ''
                for key in SETTINGS}
    if method == 'progressive' and settings['first_stage_steps'] is None:  # before its flag: as long as the rest
        settings['first_stage_steps'] = settings['steps_per_stage']
    return settings


def check(cfg: PairsConfig) -> list:
    """The arms, base first, each proven comparable to the base before anything is written."""
    if not cfg.base or not cfg.arms:
        raise ConfigError('--base and --arms are required: few_step_study JSONs made on the same seeds')
    check_plain_name(cfg.stem, '--stem')
    arms = [read_arm(path, cfg.family) for path in [cfg.base, *cfg.arms.split(',')] if path]
    base = arms[0]
    for arm in arms[1:]:
        if arm['teacher'] != base['teacher']:
            raise ConfigError(f'{arm["path"]}: another teacher than {base["path"]}\'s: its students pair with nothing')
        if seeds_of(arm['rows']) != seeds_of(base['rows']):
            raise ConfigError(f'{arm["path"]}: seeds {sorted(seeds_of(arm["rows"]))}, the base '
                              f'{sorted(seeds_of(base["rows"]))}: pairs need the same seeds')
    if len({arm['name'] for arm in arms}) < len(arms):
        raise ConfigError('two arms share a file name: each arm is named by its file')
    check_creatable(cfg.out_dir, '--out-dir')
    check_writable(cfg.out_dir, '--out-dir')
    return arms


def seeds_of(rows: list) -> set:
    return {row['seed'] for row in rows}


def by_seed(rows: list, model: str) -> dict:
    return {row['seed']: row[SCORE] for row in rows if row['model'] == model}


def best_at_20(rows: list) -> dict:
    """The teacher's best solver at 20 calls, as the study chose it (few_step_study.summarise): its scores by seed."""
    best = next((row['best_at_20'] for row in summarise(rows) if row['best_at_20']), None)
    return {r['seed']: r[SCORE] for r in rows if r['model'] == 'teacher' and r['calls'] == 20
            and r['sampler'] == best} if best else {}


def pair_rows(arms: list) -> list:
    """One row per (arm, student): its mean and sd, and its paired ratios to the teacher's best at 20 and to
    the base arm's student of the same name."""
    base, out = arms[0], []
    for arm in arms:
        teacher = best_at_20(arm['rows'])
        calls = {row['model']: row['calls'] for row in arm['rows'] if row['model'] != 'teacher'}
        for name in sorted(calls, key=lambda name: (-calls[name], name)):  # most calls first
            group = [row for row in arm['rows'] if row['model'] == name]
            scores = [row[SCORE] for row in group]
            base_scores = by_seed(base['rows'], name)
            out.append({'arm': arm['name'], 'student': name, 'calls': group[0]['calls'], 'seeds': len(scores),
                        'mean': statistics.mean(scores), 'sd': statistics.stdev(scores) if len(scores) > 1 else None,
                        'vs_teacher20': paired_ratio(group, teacher) if teacher else None,
                        'vs_base': paired_ratio(group, base_scores) if arm is not base and base_scores else None,
                        'settings': arm['students'].get(name.split('@')[0], {})})
    return out


def interval(pair: dict | None) -> str:
    return '' if pair is None else f"{pair['ratio']:.3f} [{pair['low']:.3f}, {pair['high']:.3f}]"


def body_of(arms: list, rows: list) -> str:
    moved = [key for key in SETTINGS if len({str(row['settings'].get(key)) for row in rows}) > 1]
    table = markdown_table(
        ['arm', 'student', *moved, 'score, mean +- sd', '/ teacher\'s best at 20 [95%]', f'/ {arms[0]["name"]} [95%]'],
        [[row['arm'], row['student'], *(str(row['settings'].get(key)) for key in moved),
          f"{row['mean']:.2f} +- {row['sd']:.2f}" if row['sd'] is not None else f"{row['mean']:.2f}",
          interval(row['vs_teacher20']), interval(row['vs_base'])] for row in rows], left=2 + len(moved))
    return (f'{SCORE} (lower is better) on seeds {sorted(seeds_of(arms[0]["rows"]))}; each ratio the geometric '
            f'mean over the seeds of the score over the other\'s on the same seed, with its 95% t-interval.\n\n'
            f'{table}\n\nReports: ' + ', '.join(f'{arm["name"]} ({arm["path"]})' for arm in arms))


def pairs(cfg: PairsConfig) -> dict:
    arms = check(cfg)
    rows = pair_rows(arms)
    # The scores were made where the arms' reports say (their device); this only pairs them.
    result = {**provenance(f'the scores of reports made on: {arms[0]["device"]}'), 'config': vars(cfg).copy(),
              'rows': rows}
    body = body_of(arms, rows)
    write_report(cfg.out_dir, cfg.stem, result, 'distill.py settings, paired by seed', body)
    print(body)
    return result


def main(argv=None) -> int:
    return run_main(pairs, parse_config(argv, PairsConfig, __doc__))


if __name__ == '__main__':
    sys.exit(main())

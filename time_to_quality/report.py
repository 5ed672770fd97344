"""The time-to-quality ladder's report: its record (every arm's runs and summary, the levers' decisions,
the headline ratios, the keep rule's false-keep rate and power, the evaluation grid against the pairs'
spread, each run's commit and code), OUT_DIR/STEM.{json,md,png}. Written by the ladder (ladder.py) and,
from the finished curves alone, by recompute.py."""
import dataclasses
import shlex
import statistics
from dataclasses import asdict

from devices import device_name, device_slug, pick_device
from reports import markdown_table, provenance, pyplot, save_figure, write_report
from train_config import default_eval_draws

from .arms import decay_plan, slug
from .speed import WARMUP_STEPS
from .stats import images_to, keep_rate, mean_sd, paired_ratio, pooled_sd, score_at, summarise, unpaired_ratio

TRIALS = 200_000  # Monte Carlo levers behind the stated false-keep rate and power


def stem_of(cfg) -> str:
    return cfg.stem or (f'{device_slug(pick_device(cfg.device))}-{cfg.dataset}-'
                        f'{"time-to-quality" if cfg.ladder == "speed" else cfg.ladder + "-study"}')


def record(done: dict, cfg, floor) -> dict:
    """The report's record: provenance, the targets, every arm's runs and summary, the levers' paired
    gains and decisions (with the command that confirms a pending one), the headline ratios (the arm
    with every kept lever against the baseline, seed by seed, and against the best diffusers variant;
    in the prediction ladder each arm against the baseline), the rule's false-keep rate and power, the
    grid's resolution, and each run's commit and code."""
    ladder, targets, target = done['ladder'], done['targets'], done['targets']['target']
    runs = {name: [got[j] for j in sorted(got, key=lambda j: (j.images, j.seed))] for name, got in ladder.runs.items()}
    planned = {name: done['planned'].get(name, cfg.images) for name in runs}
    full = {name: {r['run']['seed']: r for r in rs if r['run']['images'] == planned[name]
                   and r['run']['seed'] < cfg.seeds} for name, rs in runs.items()}
    summary = summarise({n: list(full[n].values()) or rs for n, rs in runs.items()}, targets)  # speed arms: short

    def paired(name, against='baseline', to=target, measure=None):
        seeds = sorted(set(full[name]) & set(full[against]))
        return paired_ratio([full[against][s] for s in seeds], [full[name][s] for s in seeds], to,
                            measure) if seeds else None
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
    if cfg.ladder != 'speed':  # a study: each arm on the baseline, in minutes and in images
        headline = {f'{name} against the baseline, to {target:.2f} (paired by seed{", in images" * by_images})':
                    paired(name, measure=images_to if by_images else None)
                    for name in full if name != 'baseline' for by_images in (False, True)}
    arms = {name: {**asdict(next(iter(ladder.runs[name])).arm), **summary[name],
                   'images_per_run': planned[name] if full[name] else runs[name][0]['run']['images'],
                   **({'screen': done['screened'][name]} if name in done['screened'] else {})} for name in runs}
    at_easy = [score_at(r, cfg.easy_at) for r in full['baseline'].values()]  # one training length, across seeds
    machines = sorted({r.get('made', {}).get('device_name') for rs in runs.values() for r in rs} - {None})
    levers = {name: {**d, **({'command': confirm_command(cfg, d)} if d['status'] == 'pending' else {})}
              for name, d in done['decisions'].items()}
    return {**provenance(device_name(pick_device(cfg.device))), 'config': asdict(cfg), 'floor': floor,
            'machines': machines, 'baseline_at_easy': {'images': cfg.easy_at, 'scores': at_easy,
                                                       'mean_sd': mean_sd(at_easy)},
            'unfinished': done['missing'], 'targets': targets, 'fastest': done['fastest'],
            'best_peer': done['best_peer'], 'headline': headline, 'levers': levers, 'arms': arms,
            **rule_and_resolution(cfg, levers, arms), 'run_code': run_code(runs), 'runs': runs}


def rule_and_resolution(cfg, levers: dict, arms: dict) -> dict:
    """The keep rule's false-keep rate and its power against gains of 10% and 20% of the baseline's
    images to the target, with the pairs' spread (the sd of paired images saved, pooled over the levers
    judged on images whose runs all reached it); the evaluation grid against that spread, and how many
    pairs first reach the target at the same evaluation (their difference then the interpolation's alone)."""
    screen, confirm = cfg.lever_seeds, max(cfg.seeds, cfg.lever_seeds)
    judged = [d for d in levers.values() if d['judged_by'] != 'speed' and d['reached'] and not d['lower_bound']]
    spread = pooled_sd([d['sides']['images']['values'] for d in judged if d['judged_by'] == 'images'])
    base = (arms.get('baseline', {}).get('target') or {}).get('images')
    power = {f'{share:.0%}': {'gain': share * base[0], 'rate': keep_rate(share * base[0], spread, screen, confirm,
                                                                          TRIALS)}
             for share in (0.1, 0.2)} if spread and base and base[0] else {}
    return {'rule': {'screen_pairs': screen, 'confirm_pairs': confirm, 'trials': TRIALS,
                     'false_keep': keep_rate(0.0, 1.0, screen, confirm, TRIALS), 'pairs_sd_images': spread,
                     'power': power},
            'resolution': {'eval_every': cfg.eval_every, 'pairs_sd_images': spread,
                           'grid_over_sd': cfg.eval_every / spread if spread else None,
                           'same_evaluation': sum(d.get('same_evaluation', 0) for d in judged),
                           'pairs': sum(d['n'] for d in judged)}}


def run_code(runs: dict) -> dict:
    """Per arm, its runs grouped by planned images, commit and code hash: [{images, seeds, commit, hash}]
    (hash None: recorded before curves held their code's hash)."""
    out = {}
    for name, results in runs.items():
        groups = {}
        for r in results:
            code = r.get('code') or {}
            commit = r.get('made', {}).get('commit') or code.get('commit') or 'unknown'
            groups.setdefault((r['run']['images'], commit, code.get('hash')), []).append(r['run']['seed'])
        out[name] = [{'images': i, 'seeds': s, 'commit': c, 'hash': h} for (i, c, h), s in groups.items()]
    return out


def confirm_command(cfg, decision: dict) -> str:
    """The command that runs a pending lever's confirmation pairs: this ladder's own with --train PART
    when every run it pairs records its code; otherwise (curves recorded before code hashes, which no
    training command reuses, or runs on an arm since left out) a new ladder of the kept levers and this
    one, with a runs folder and a report stem of its own."""
    fresh, part = decision['fresh'], 'speed' if decision['judged_by'] == 'speed' else 'quality'
    flags = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
             if getattr(cfg, f.name) != f.default and f.name not in ('train', 'retrain', 'workers', 'arms')}
    flags['train'], flags['arms'] = (f'baseline,{part}', ','.join(decision['kept_below'] + [decision['lever']])) \
        if fresh else (part, cfg.arms)
    if fresh:
        flags['stem'] = f"{stem_of(cfg)}-confirm-{slug(decision['lever'])}"
        flags['runs_dir'] = f"{cfg.runs_dir.rstrip('/')}-confirm-{slug(decision['lever'])}"
    words = [w for key, value in flags.items() if value not in ('', None)
             for w in (f"--{key.replace('_', '-')}", str(value))]
    return 'python scripts/time_to_quality.py ' + shlex.join(words)  # as committed reports give it (a shim)


# ----------------------------------------------------------------------------- the report

DECISIONS = {'kept': 'kept', 'screen failed': 'left out at the screen', 'not confirmed': 'left out: not confirmed',
             'pending': 'screen passed, not confirmed'}


def report(result: dict, cfg):
    targets, arms, rule, grid = result['targets'], result['arms'], result['rule'], result['resolution']
    levers = result['levers']

    def ms(pair, spec):
        return '-' if pair is None or pair[0] is None else format(pair[0], spec) + (
            f' +- {pair[1]:{spec}}' if pair[1] is not None else '')

    def to(arm, key, what, spec):
        got = arm.get(key)
        if got is None:
            return '-'
        return ms(got[what], spec) if got[what] else f"not reached ({got['reached']} of {got['of']} seeds)"

    def ci(value, spec):
        if value is None or value['mean'] is None:
            return '-'
        return f"{value['mean']:{spec}} [{fmt(value['low'], spec)}, {fmt(value['high'], spec)}]"

    def screen(arm):
        got = arm.get('screen')
        if got is None:
            return '-'
        own = got['images'] == arm['images_per_run']
        return f"{got['score']:.2f}" + ('' if own else f" (its {got['images']:,}-image run, seed {got['seed']})")

    def decision(d):
        text = DECISIONS[d['status']]
        if d['status'] == 'pending':
            text += f": needs {d['needs']} more pair{'s' if d['needs'] > 1 else ''}"
        elif d['status'] == 'not confirmed':
            text += f" on {d['n']} pairs"
        elif not d['reached']:
            text += ' (a lever seed never reached the target)'
        return text
    hard, easy = f"{targets['target']:.2f}", f"{targets['easy_target']:.2f}"
    headers = ['Arm', 'what it changes', 'planned images', 'seeds', 'img/s', f'minutes to {hard}', f'images to {hard}',
               f'minutes to {easy}', 'last score', 'evaluation minutes (apart)', 'screen score']
    rows = [[name, arm['changes'], f"{arm['images_per_run']:,}", arm.get('seeds', '-'),
             ms(arm.get('img_per_s'), ',.0f'),
             to(arm, 'target', 'minutes', '.2f'), to(arm, 'target', 'images', ',.0f'),
             to(arm, 'easy_target', 'minutes', '.2f'), ms(arm.get('last'), '.2f'), ms(arm.get('eval_minutes'), '.2f'),
             screen(arm)] for name, arm in arms.items()]
    lever_rows = [[name, d['builds_on'] + (' (left out since; not run on the arms kept)' if d['elsewhere'] else ''),
                   d['judged_by'] + (' (interleaved)' if 'timed' in d else ''),
                   f"{d['n']} rounds" if 'timed' in d else d['n'],
                   f"{'>= ' if d['lower_bound'] else ''}{ci(d, ',.3g')} {d['unit']}",
                   ci(d['sides'].get('images'), ',.0f'), ci(d['sides'].get('img/s'), ',.0f'),
                   ci(d['sides'].get('minutes'), '.2f'), decision(d)] for name, d in result['levers'].items()]
    body = markdown_table(headers, rows, left=2)  # a short (speed) run's targets are out of its reach by design
    if lever_rows:
        body += ('\n\n### Levers: paired gains (the same seeds as the arm below)\n\n' + markdown_table(
            ['Lever', 'on top of', 'judged by', 'pairs', 'the gain that decides [95% interval]', 'images saved',
             'img/s gained', 'minutes saved', 'decision'], lever_rows, left=3))
    if pending := {n: d['command'] for n, d in result['levers'].items() if d['status'] == 'pending'}:
        body += ('\n\n### To confirm: the commands that run the pending levers\' pairs (nothing is kept until they '
                 'have run)\n\n' + '\n'.join(f'- {name}: `{command}`' for name, command in pending.items()))
    if result['unfinished']:
        body = f"**Unfinished**: the parts that have run so far ({result['unfinished']}).\n\n" + body
    if result['headline']:
        what = 'minutes to the target' if cfg.ladder == 'speed' else 'minutes to the target (images where said)'
        body += f'\n\n### Headline: {what}, ratio [95% interval]\n\n' + '\n'.join(
            f"- {label}" + (f": {ratio_text(value)}" if value is not None or 'no lever' not in label else '')
            for label, value in result['headline'].items())
    if len(result['machines']) > 1:
        body += f"\n\nThe runs were made on more than one machine ({', '.join(result['machines'])}): minutes and " \
                f"img/s compare only within one."
    body += ("\n\n### The runs and their code\n\nEach arm's runs by planned images: their seeds, the commit train.py "
             "recorded and the hash of the code they trained with (time_to_quality.code_identity); 'no hash': "
             "recorded before curves held one, read for this report, never reused beside a new run.\n\n" + '\n'.join(
                 f"- {name}: " + '; '.join(
                     f"{g['images']:,} images, seed{'s' if len(g['seeds']) > 1 else ''} "
                     f"{','.join(map(str, g['seeds']))}: {g['commit'][:7]}{'-dirty' if 'dirty' in g['commit'] else ''}"
                     f" ({'hash ' + g['hash'] if g['hash'] else 'no hash'})" for g in groups)
                 for name, groups in result['run_code'].items()) + ''.join(
                 f"\n- {name}: timed against {d['builds_on']}, {d['timed']['rounds']} rounds of {d['timed']['steps']} "
                 f"steps, img/s {d['timed']['ratio']:.3f}x [{d['timed']['low']:.3f}, {d['timed']['high']:.3f}] the "
                 f"arm below's, {d['timed']['start_s']:.1f} s paid once beyond the steady rate "
                 f"({d['timed']['start_s_below']:.1f} s below), on {d['timed']['device']}: {d['timed']['commit'][:7]} "
                 f"(hash {d['timed']['hash']})"
                 for name, d in result['levers'].items() if 'timed' in d))
    # the ladder's runs take train.py's default number of draws
    score = ('the digits class FD (each digit against its own real digits, in the digit classifier\'s features), '
             f'the mean of {default_eval_draws(cfg.dataset)} draws' if cfg.dataset == 'digits' else 'FID')
    power = ', '.join(f"{p['rate']:.0%} against a gain of {share} of the baseline's images ({p['gain']:,.0f})"
                      for share, p in rule['power'].items())
    ladder_rule = (
        ('; '.join(([f"speed levers marked 'interleaved' timed against the arm below in one process "
                    f"({cfg.speed_rounds} rounds of {cfg.speed_steps} steps, the two arms in turn, after "
                    f"{WARMUP_STEPS} warm-up steps into an empty Inductor cache; each round a pair), judged by img/s "
                    f"over the planned run (the warm-up's seconds beyond the steady rate paid once, every image at "
                    f"the round's rate)"] if any('timed' in d for d in levers.values()) else []) +
                  ([f"speed levers run {cfg.speed_images:,} images (judged by img/s over a planned run: the first "
                    f"step once, the rest at their steady rate)"] if any(
                      d['judged_by'] == 'speed' and 'timed' not in d for d in levers.values()) else []))
         or 'no speed lever judged') +
        f", the diffusers grid's screen {cfg.screen_images:,} (one seed, to its end, "
        f"scored by its last two evaluations' mean). The keep rule: a lever is judged on images to the target "
        f"when it leaves the step's work unchanged (so that the machine's speed cannot decide it), on minutes "
        f"when it changes the work, on img/s when it is a speed lever; it passes the screen when the mean of its "
        f"first {rule['screen_pairs']} paired gains is above zero (and every lever seed reaches the target), and "
        f"is kept when the 95% t-interval of its mean gain on {rule['confirm_pairs']} pairs or more lies above "
        f"zero: a lever of no effect is kept {rule['false_keep']:.1%} of the time (at most 2.5%; a Monte Carlo of "
        f"{rule['trials']:,} levers)" + (f", a real one {power}, at the pairs' spread above" if power else '') +
        "; '>=': an arm below did not reach the target, its whole training counted; " if cfg.ladder == 'speed'
        else 'every arm on the baseline; ')
    resolution = (f" The evaluation grid, {grid['eval_every']:,} images, is {grid['grid_over_sd']:.2f} times the "
                  f"pairs' spread (the sd of paired images saved, pooled over the levers judged on images: "
                  f"{grid['pairs_sd_images']:,.0f}); {grid['same_evaluation']} of {grid['pairs']} lever pairs first "
                  f"reach the target at the same evaluation, their difference the interpolation's alone."
                  if grid['grid_over_sd'] else '')
    notes = (f" (this report's code; each run's own is listed under 'The runs and their code'); {cfg.preset} "
             f"preset, {cfg.dataset} {cfg.image_size}x{cfg.image_size}; {score} of {cfg.eval_samples} "
             f"EMA samples ({cfg.sampler}, {cfg.sample_steps} calls, fresh noise at every evaluation) every "
             f"{cfg.eval_every:,} images" + (f"; floor {result['floor']:.2f}" if result['floor'] else '') +
             f". Runs plan {cfg.images:,} images, those whose lr decays {decay_plan(cfg):,} ('planned images'; "
             f"the recipe's cosine decays to its run's plan), and end at their first score at or below {hard}. "
             f"Targets: {hard}, and {easy}, the baseline's worst seed's score at {cfg.easy_at:,} images. Images and "
             f"minutes to a target are interpolated between the two evaluations around it, linearly in log images "
             f"against log score (the minutes linearly in images: images over the run's img/s there); a target not "
             f"reached by every seed is 'not reached', never extrapolated.{resolution} Mean +- sd over seeds; "
             + ladder_rule + "training minutes count the first (compiling) step, not the evaluations; '>' marks a "
             "ratio to runs that did not all reach the target (their whole training time)")
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


def plot(result: dict, cfg, png: str, score: str):
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

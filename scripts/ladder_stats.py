"""The statistics of the time-to-quality ladder (scripts/time_to_quality.py): when a run reaches a
score, a lever's paired gain and the keep rule, the headline ratios with their 95% intervals, and
each arm's summary over its seeds. Pure functions of the runs' curves, tested on hand-made numbers."""
import math
import statistics


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


def minutes_to(result: dict, target: float) -> tuple:
    """(minutes to the target, reached): a run that never reached it counts its whole training time,
    a lower bound of its time to it."""
    got = reach(result['curve'], target)
    return (got[1], True) if got else (result['train_minutes'], False)


def t_quantile(df: float) -> float:
    from scipy.stats import t
    return float(t.ppf(0.975, df))


def interval(values: list) -> dict:
    """Mean, sd and the 95% t-interval of the mean of `values` (paired differences, or log ratios)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return {'mean': mean, 'sd': None, 'low': None, 'high': None, 'n': len(values)}
    sd = statistics.stdev(values)
    half = t_quantile(len(values) - 1) * sd / math.sqrt(len(values))
    return {'mean': mean, 'sd': sd, 'low': mean - half, 'high': mean + half, 'n': len(values)}


def paired_gain(lever, got: list, below: list, target: float, planned: int = None) -> dict:
    """The lever's gain over the arm below, seed by seed (the same seeds): img/s gained over a run of
    `planned` images (lever.judged_by 'speed': projected from a short run), or minutes to the target
    saved ('time'; a run that never reached it counts its whole training, and any lever seed that did not
    reach it makes the lever lose). Kept: the mean gain is larger than the pairs' spread (the sd of
    the gains)."""
    if lever.judged_by == 'speed':
        planned = planned if all('steady_img_per_s' in r for r in got + below) else None  # both sides alike
        gains = [planned_img_per_s(g, planned) - planned_img_per_s(b, planned) for g, b in zip(got, below)]
        reached = below_reached = True
    else:
        mine, theirs = [[minutes_to(r, target) for r in runs] for runs in (got, below)]
        gains, reached = [b[0] - g[0] for g, b in zip(mine, theirs)], all(g[1] for g in mine)
        below_reached = all(b[1] for b in theirs)
    gain = interval(gains)
    return {**gain, 'gains': gains, 'unit': 'img/s' if lever.judged_by == 'speed' else 'minutes',
            'lower_bound': not below_reached,  # a run below never reached the target: the gain is at least this
            'kept': reached and gain['sd'] is not None and gain['mean'] > gain['sd']}


def planned_img_per_s(result: dict, planned: int = None) -> float:
    """img/s over a run of `planned` images: its first (compiling) step once, every other step at the
    measured run's steady rate; the measured run's own img/s without `planned`."""
    if planned is None or 'steady_img_per_s' not in result:
        return result['img_per_s']
    return planned / (result['first_step_s'] + (planned - result['batch']) / result['steady_img_per_s'])


def paired_ratio(base: list, fast: list, target: float) -> dict | None:
    """Minutes to the target, base over fast, seed by seed: the geometric mean ratio with its 95%
    interval (a t-interval of the log ratios). None unless every fast seed reaches it; a bound when a
    base seed does not (its whole training time counted)."""
    theirs, mine = [[minutes_to(r, target) for r in runs] for runs in (base, fast)]
    if not all(m[1] for m in mine):
        return None
    logs = interval([math.log(t[0] / m[0]) for t, m in zip(theirs, mine)])
    return {'ratio': math.exp(logs['mean']), 'low': exp_or_none(logs['low']), 'high': exp_or_none(logs['high']),
            'seeds': len(mine), 'bound': not all(t[1] for t in theirs), 'paired': True}


def unpaired_ratio(peer: list, fast: list, target: float) -> dict | None:
    """Minutes to the target, the peer's over ours, from independent runs: the ratio of geometric means
    with a Welch 95% interval on the log times. A bound when a peer run never reached it."""
    theirs, mine = [[minutes_to(r, target) for r in runs] for runs in (peer, fast)]
    if not all(m[1] for m in mine):
        return None
    a, b = [math.log(t[0]) for t in theirs], [math.log(m[0]) for m in mine]
    diff = statistics.mean(a) - statistics.mean(b)
    low = high = None
    if len(a) > 1 and len(b) > 1:
        va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
        df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb > 0 else 1e9
        half = t_quantile(df) * math.sqrt(va + vb)
        low, high = math.exp(diff - half), math.exp(diff + half)
    return {'ratio': math.exp(diff), 'low': low, 'high': high, 'seeds': [len(a), len(b)],
            'bound': not all(t[1] for t in theirs), 'paired': False}


def exp_or_none(value):
    return None if value is None else math.exp(value)


def mean_sd(values: list):
    return (statistics.mean(values) if values else None, statistics.stdev(values) if len(values) > 1 else None)


def summarise(runs: dict, targets: dict) -> dict:
    """Per arm, over its seeds: minutes and images to each target (mean and sd when every seed reaches
    it, else 'not reached' by how many), the last score, img/s, training and evaluation minutes."""
    out = {}
    for name, results in runs.items():
        arm = {'seeds': len(results), 'last': mean_sd([r['curve'][-1]['score'] for r in results]),
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
    return out


def score_at(result: dict, images: int) -> float:
    """The score of the first evaluation at or past `images` (the last, if the run ended before)."""
    return next((p['score'] for p in result['curve'] if p['images'] >= images), result['curve'][-1]['score'])


def screen_score(result: dict) -> float:
    """A screened variant's score: the mean of its last two evaluations (one is noisier)."""
    return statistics.mean(p['score'] for p in result['curve'][-2:])

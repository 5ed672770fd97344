"""The statistics of the time-to-quality ladder: when a run reaches a
score, a lever's paired gain and the keep rule (with its false-keep rate and power), the headline
ratios with their 95% intervals, and each arm's summary over its seeds. Pure functions of the runs'
curves, tested on hand-made numbers."""
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
    if not values:
        return {'mean': None, 'sd': None, 'low': None, 'high': None, 'n': 0}
    mean = statistics.mean(values)
    if len(values) < 2:
        return {'mean': mean, 'sd': None, 'low': None, 'high': None, 'n': len(values)}
    sd = statistics.stdev(values)
    half = t_quantile(len(values) - 1) * sd / math.sqrt(len(values))
    return {'mean': mean, 'sd': sd, 'low': mean - half, 'high': mean + half, 'n': len(values)}


def images_to(result: dict, target: float) -> tuple:
    """(images to the target, reached): a run that never reached it counts every image it trained (its
    last evaluation's count), a lower bound of its images to it."""
    got = reach(result['curve'], target)
    return (got[0], True) if got else (result['curve'][-1]['images'], False)


def keep_rule(gains: list, reached: bool, screen: int, confirm: int) -> dict:
    """The keep rule on a lever's paired gains (seed by seed, the screen's pairs first): it passes the
    screen when the mean of its first `screen` gains is above zero and every lever seed reached the
    target; it is kept when, on `confirm` pairs or more, the 95% t-interval of the mean gain lies above
    zero. Statuses: 'screen failed', 'pending' (screen passed, `needs` more pairs), 'not confirmed', 'kept'.
    Under a lever of no effect (normal gains) the keep rate is at most P(t > t_0.975) = 2.5%, whatever
    the screen (keep_rate gives it exactly); the screen spares confirmation runs to about half of them."""
    if not reached or len(gains) < screen or statistics.mean(gains[:screen]) <= 0:
        return {'status': 'screen failed', 'kept': False, 'needs': 0}
    if len(gains) < confirm:
        return {'status': 'pending', 'kept': False, 'needs': confirm - len(gains)}
    low = interval(gains)['low']
    kept = low is not None and low > 0
    return {'status': 'kept' if kept else 'not confirmed', 'kept': kept, 'needs': 0}


def keep_rate(gain: float, sd: float, screen: int = 3, confirm: int = 5, trials: int = 200_000,
              seed: int = 0) -> float:
    """The share of levers that keep_rule keeps when each pair's gain is drawn from N(gain, sd^2): the
    false-keep rate at gain 0, the power above it (a seeded Monte Carlo of `trials` levers)."""
    import numpy as np
    draws = np.random.default_rng(seed).normal(gain, sd, (trials, confirm))
    mean, spread = draws.mean(1), draws.std(1, ddof=1)
    low = mean - t_quantile(confirm - 1) * spread / math.sqrt(confirm)
    return float(np.mean((draws[:, :screen].mean(1) > 0) & (low > 0)))


def pooled_sd(groups: list) -> float | None:
    """The pairs' spread: the sd of paired gains pooled over levers (each group's variance weighted by
    its degrees of freedom), what the keep rule's power is stated against."""
    groups = [g for g in groups if len(g) > 1]
    df = sum(len(g) - 1 for g in groups)
    return math.sqrt(sum(statistics.variance(g) * (len(g) - 1) for g in groups) / df) if df else None


def paired_gain(judged_by: str, got: list, below: list, target: float, planned: int = None, screen: int = 3,
                confirm: int = 5) -> dict:
    """A lever's gain over the arm below, seed by seed (the same seeds, the screen's first), decided by
    keep_rule on what judges it: img/s gained over a run of `planned` images ('speed': projected from a
    short run), images to the target saved ('images'), or training minutes to it saved ('minutes').
    A run that never reached the target counts all it trained; a lever seed that did not reach it makes
    the lever lose. Beside the deciding gain, each of images saved, img/s gained and minutes saved with
    its own 95% interval (minutes = images / img/s)."""
    if judged_by == 'speed':
        planned = planned if all('steady_img_per_s' in r for r in got + below) else None  # both sides alike
        side = {'img/s': [planned_img_per_s(g, planned) - planned_img_per_s(b, planned) for g, b in zip(got, below)]}
        reached = below_reached = True
    else:
        mine, theirs = [[(images_to(r, target), minutes_to(r, target)) for r in runs] for runs in (got, below)]
        side = {'images': [b[0][0] - g[0][0] for g, b in zip(mine, theirs)],
                'img/s': [g['img_per_s'] - b['img_per_s'] for g, b in zip(got, below)],
                'minutes': [b[1][0] - g[1][0] for g, b in zip(mine, theirs)]}
        reached, below_reached = all(g[0][1] for g in mine), all(b[0][1] for b in theirs)
    gains = side['img/s' if judged_by == 'speed' else judged_by]
    return {**interval(gains), **keep_rule(gains, reached, screen, confirm), 'gains': gains,
            'unit': 'img/s' if judged_by == 'speed' else judged_by, 'reached': reached,
            'lower_bound': not below_reached,  # a run below never reached the target: the gain is at least this
            'sides': {key: {**interval(values), 'values': values} for key, values in side.items()},
            'same_evaluation': 0 if judged_by == 'speed' else sum(same_evaluation(g, b, target)
                                                                    for g, b in zip(got, below))}


def same_evaluation(got: dict, below: dict, target: float) -> bool:
    """Whether two runs first reach the target at the same evaluation (where the grid, not the runs,
    sets their difference: it comes from the interpolation alone)."""
    first = [next((p['images'] for p in r['curve'] if p['score'] <= target), None) for r in (got, below)]
    return first[0] is not None and first[0] == first[1]


def planned_img_per_s(result: dict, planned: int = None) -> float:
    """img/s over a run of `planned` images: its first (compiling) step once, every other step at the
    measured run's steady rate; the measured run's own img/s without `planned`."""
    if planned is None or 'steady_img_per_s' not in result:
        return result['img_per_s']
    return planned / (result['first_step_s'] + (planned - result['batch']) / result['steady_img_per_s'])


def paired_ratio(base: list, fast: list, target: float, measure=None) -> dict | None:
    """Minutes (or, with measure=images_to, images) to the target, base over fast, seed by seed: the
    geometric mean ratio with its 95% interval (a t-interval of the log ratios). None unless every fast
    seed reaches it; a bound when a base seed does not (its whole training time counted)."""
    theirs, mine = [[(measure or minutes_to)(r, target) for r in runs] for runs in (base, fast)]
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

"""The README's GPU speed table, generated from result files, never typed: a `benchmark.py --sweep
peer` JSON (our fastest row and diffusers' UNet2DModel under its settings, A B A B in one process)
and, optionally, the metrics.jsonl of a `train.py` run (its own logged img/s). Markdown on stdout;
every number is read from the files named, and the files are named under the table.

    python scripts/speed_table.py results/h100-sxm-step-peer.json [results/h100-sxm-step-train-metrics.jsonl]
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cli import ConfigError, run_main  # noqa: E402
from reports import format_or_na, markdown_table  # noqa: E402


def read(path: str, lines: bool = False):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()] if lines else json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError(f'{path}: cannot be read as {"JSON lines" if lines else "JSON"} ({error})') from None


def train_row(rows: list) -> dict | None:
    """train.py's speed from its metrics: the median img/s of its logged intervals after the first
    (the first holds the warm-up after compiling), with that interval's MFU."""
    config = next((r['config'] for r in rows if 'config' in r), None)
    logged = [r for r in rows if r.get('kind') == 'train' and r.get('img_per_s')]
    steady = logged[1:] or logged
    if config is None or not steady:
        return None
    img_per_s = statistics.median(r['img_per_s'] for r in steady)
    mfu = statistics.median(r['mfu'] for r in steady) if all(r.get('mfu') is not None for r in steady) else None
    return {'batch_size': config['batch_size'], 'precision': {'off': 'fp32'}.get(config['amp'], config['amp']),
            'img_per_s': img_per_s, 'mfu': mfu,
            'intervals': len(steady), 'steps': logged[-1]['step']}


def table(sweep: dict, metrics: list = None, names: tuple = ()) -> str:
    """The table and the lines under it."""
    if sweep.get('sweep') != 'peer' or 'rows' not in sweep:
        raise ConfigError(f'{names[0]}: not the JSON of benchmark.py --sweep peer')
    comparison = sweep.get('comparison')
    peer = comparison['peer_mean_img_per_s'] if comparison else None
    rows = [[r['name'], r['batch_size'], r['precision'], f"{r['ms_per_iter']:.2f}", f"{r['img_per_s']:,.0f}",
             format_or_na(r['mfu'], '.1%'), format_or_na(r['img_per_s'] / peer if peer else None, '.3f') + 'x']
            for r in sweep['rows'] if 'img_per_s' in r]
    rows += [[r['name'], r.get('batch_size', ''), f"not measured: {r.get('skipped') or r.get('failed')}", '', '', '',
              ''] for r in sweep['rows'] if 'img_per_s' not in r]
    trained = train_row(metrics) if metrics else None
    if trained:
        rows.append([f"train.py (its own log: median of {trained['intervals']} intervals after the first, "
                     f"{trained['steps']} steps)", trained['batch_size'], trained['precision'],
                     f"{1e3 * trained['batch_size'] / trained['img_per_s']:.2f}", f"{trained['img_per_s']:,.0f}",
                     format_or_na(trained['mfu'], '.1%'),
                     format_or_na(trained['img_per_s'] / peer if peer else None, '.3f') + 'x'])
    lines = [markdown_table(['Version', 'Batch', 'Precision', 'ms/iter', 'img/s', 'MFU', "x diffusers' UNet2DModel"],
                            rows), '']
    if comparison:
        lines.append(f"Ours {comparison['ratio']:.3f}x diffusers' UNet2DModel in our loop (the mean of each one's "
                     f"{len(comparison['ours_img_per_s'])} alternated timings; per round "
                     f"{', '.join(f'{r:.3f}x' for r in comparison['ratio_per_round'])}; the target: >= "
                     f"{comparison['target_ratio']}x).")
    commit = str(sweep.get('commit', 'unknown'))[:12]
    lines.append(f"Measured on {sweep['device']}, torch {sweep['torch']}, commit {commit}, {sweep['date']}; "
                 f"{sweep['preset']} at {sweep['image_size']}x{sweep['image_size']} on {sweep['dataset']}: "
                 + ', '.join(f'`{name}`' for name in names) + '.')
    return '\n'.join(lines)


def main(argv: list):
    if not 1 <= len(argv) <= 2:
        raise ConfigError('usage: python scripts/speed_table.py PEER_SWEEP.json [TRAIN_METRICS.jsonl]')
    print(table(read(argv[0]), read(argv[1], lines=True) if len(argv) > 1 else None, tuple(argv)))


if __name__ == '__main__':
    sys.exit(run_main(main, sys.argv[1:]))

"""The time-to-quality ladder's report again, from the finished curves alone: nothing is trained, every
curve is read under the reuse rule, and a run not finished leaves the report unfinished there, or its
lever pending. It takes the ladder's flags (a lever of a capability this machine lacks, such as
'+ bf16', is read back when --arms names it):

    python -m time_to_quality.recompute --arms '...' --runs-dir RUNS --data-dir DATA --out-dir results
"""
import sys

import evaluation
from cli import ConfigError, StopFlag, check_ranges, parse_config, run_main

from . import ladder
from .curves import ladder_identity
from .report import record, report


def recompute(cfg: ladder.LadderConfig) -> dict:
    """The report (OUT_DIR/STEM.{json,md,png}) of the ladder's finished runs, read back by its dry pass."""
    check_ranges(cfg)
    ladder.check_names(cfg)
    target = evaluation.DIGITS_TARGET if cfg.target is None and cfg.dataset == 'digits' else cfg.target
    if target is None:
        raise ConfigError('--target: needed for FID (no default outside digits)')
    identity = ladder_identity(cfg)
    ladder.check_curves(cfg, identity, target)
    floor = ladder.floor_of(cfg.dataset, cfg.image_size, cfg.data_dir) if cfg.dataset == 'digits' else None
    try:
        done = (ladder.climb if cfg.ladder == 'speed' else ladder.side_by_side)(cfg, target, StopFlag(), identity,
                                                                                 dry=True, trains=set())
    except ladder.Missing as missing:
        raise ConfigError(f'nothing to report: {missing}') from None
    result = record(done, cfg, floor)
    report(result, cfg)
    return result


def main(argv=None) -> int:
    return run_main(recompute, parse_config(argv, ladder.LadderConfig, __doc__))


if __name__ == '__main__':
    sys.exit(main())

"""Time to quality: training minutes until samples reach a score, for the paper's recipe as train.py
runs it, for each lever added on top of it, and for diffusers' training recipe on the same images, in
one ladder. Every run is scored every --eval-every images and ends when its score reaches --target
and holds there on a second draw (for digits the class FD, evaluation.DIGITS_TARGET); the clock counts
training alone (the first, compiling step included).

The ladder, in the order it runs (each step a part that `--train` can run alone, once those above it
are finished):
  baseline    the paper's recipe, --seeds seeds (the headline's reference);
  speed       levers of the step's speed, each on the levers kept so far, timed against the arm below
              interleaved in one process (--speed-rounds rounds, each a pair), judged by img/s over
              the planned run;
  quality     levers of the images needed, each on the levers kept so far, --lever-seeds seeds paired
              with the arm below, judged by the images to --target (by the minutes when the lever
              changes the step's work);
  fastest     the arm with every kept lever (the headline) to --seeds seeds;
  peer        diffusers' recipe: its lr over a grid at its batch and at ours (one seed each at
              --screen-images), then the best variant at --seeds seeds.
The keep rule (stats.keep_rule): a lever passes the screen when its mean paired gain over its
--lever-seeds pairs is above zero, and is kept when the 95% t-interval of its mean gain over --seeds
pairs (the screen's and more, run in its part) lies above zero: at most 2.5% of levers of no effect
are kept.

    python -m time_to_quality                          # the CPU ladder on digits (hours; in parts)
    python -m time_to_quality --train baseline         # one part; the others' finished runs are read
    python -m time_to_quality --ladder prediction --seeds 3   # v-prediction and Min-SNR, side by side
    python -m time_to_quality --dataset cifar10 --preset ddpm-cifar10 --device cuda \\
        --images 20000000 --eval-every 2000000 --eval-samples 10000 --target 5   # FID on a GPU
    python -m time_to_quality.recompute --arms ARMS    # the report again from the finished curves
    python -m time_to_quality.arm_speed --ladder shape # arms' img/s, interleaved in one process

Each finished run's curve is OUT_DIR/STEM-runs/<arm>-<images>-seed<k>.json (commit it: a ladder on
another machine continues from these); RUNS_DIR holds the runs in progress. A finished curve is reused
or refused by one rule (ladder.reuse_or_refuse), never trained again unless --retrain names it; one
recorded before curves held their code's hash makes reports only, and a command that trains refuses it.
The report, OUT_DIR/STEM.{json,md,png}, is written by every command that gets past the baseline; until
the last part has run it holds the finished parts and says so on its first line.

The package: ladder.py the runner (its flags, the reuse rule, the parts in order, the checks before any
run), runs.py one train.py run and its curve, arms.py the arms as data, stats.py the statistics,
speed.py the speed levers' interleaved timing, recipe.py diffusers' arm, workers.py the --workers
processes, curves.py the runs folder and the curves' seals, report.py the report, recompute.py the
report again from the curves alone, arm_speed.py any arms' img/s. The old commands
(python scripts/time_to_quality.py, scripts/ladder_report.py, scripts/arm_speed.py) are kept as shims
of these, so that the commands in committed results and pages still run.
"""

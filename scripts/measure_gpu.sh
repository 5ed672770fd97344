#!/usr/bin/env bash
# The GPU measurements, as parts that each end inside 10 minutes on one H100 by construction
# (what a part runs is under `timeout`, its commands sharing $PART_LIMIT, 540 s unless set (450 s
# for `step`; 1800 s in the --quick CPU form, which checks the wiring on a loaded CI machine, not
# time); JSON is rewritten after every row in the ladder and sweep modes, so a part cut short keeps
# the rows it finished and says so in its log; a mode that writes at the end says that nothing was
# measured) and leave at most 8 files (no checkpoints) in the output folder. Run from the repository
# root:
#
#   bash scripts/measure_gpu.sh PART OUT_DIR            # on the GPU machine
#   bash scripts/measure_gpu.sh PART OUT_DIR --quick    # the same wiring on a CPU, tiny preset (tested)
#
# Parts, in the order of results/NOTES.md's playbook (the headline first):
#   step      at most 8 minutes: our fastest default row and diffusers' UNet2DModel under its settings,
#             alternated A B A B in one process (benchmark.py --sweep peer); train.py's own img/s at batch
#             512; both networks' steps profiled side by side (--side-by-side); the README's table
#             generated from the JSON (scripts/speed_table.py, into the log)
#   knobs     the rows tried on top of the fastest default row, each against it in one process: fused
#             GroupNorm (Triton), twice the batch, cuDNN attention, Inductor's coordinate-descent tuning
#             (in that order: a cut keeps the rows finished)
#   headline  the baseline, our fastest default-compile row and the diffusers peers: its UNet2DModel in
#             our loop, and its training recipe (train_unconditional.py's loop, data from PNG files)
#   ladder    every default-compile row of the ladder, in one process
#   profile   torch.profiler of the fastest default-compile row's step, each category beside its bound on
#             this GPU (counted op by op: benchmark.py --roofline), and sampling speed
#   gputests  tests/test_gpu.py and a short train.py run with --compile (img/s as train.py logs it; in
#             the --quick form eager: Inductor's C++ build of the step took minutes of the CPU tests)
#   autotune  the compile max-autotune row without CUDA graphs (minutes of autotuning)
#   graphs    the reduce-overhead row (CUDA graphs, no autotuning), then max-autotune + CUDA graphs
#             (autotunes again: no cache survives between commands)
#   quality   the equivalence check: baseline vs all default speed-ups, 600 steps
#   loaders   images/s of each data path beside the step's consumption
#   sweep     batch sizes 128, 512 and 2048 around the fastest default-compile row
#   small     the ladder for the ~9M `small` preset
#   fewstep   sampling speed of the digits teacher (DPM-Solver++ at 4, 8 and 20 calls) and its default
#             students (each at its own calls), batch 1 and 1000, eager (bf16 autocast) and compiled, then
#             compiled with CUDA graphs (reduce-overhead); from $FEW_STEP_DIR (runs/gpu-few-step unless
#             set: teacher-uncond.pt and uncond/, optionally teacher-cond.pt and cond/; results/NOTES.md
#             packs it), carried with the working tree
#   all       every part above in turn (fewstep's models packed first)
#
# The GPU image lacks diffusers, torchinfo and torch-fidelity: they travel as pure-Python wheels
# in .whl/ (git-ignored), pinned to the versions below and checked before anything runs:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#       diffusers==0.42.1 torchinfo==1.8.0 torch-fidelity==0.4.0
set -euo pipefail
PARTS=(step knobs headline profile ladder gputests autotune graphs quality loaders sweep small fewstep)
usage="usage: bash scripts/measure_gpu.sh $(IFS='|'; echo "${PARTS[*]}")|all OUT_DIR [--quick]"
# Every argument is checked before anything is written: a refused call leaves no folder and no file.
[ $# -ge 2 ] && [ $# -le 3 ] && [[ " ${PARTS[*]} all " == *" $1 "* ]] && [[ "${3:-}" =~ ^(--quick)?$ ]] || {
  echo "$usage" >&2; exit 2; }
part=$1
out=$2
quick=${3:-}
[ -n "$out" ] && { [ ! -e "$out" ] || [ -d "$out" ]; } || {
  echo "error: OUT_DIR '$out' must be a folder (it is created if missing)" >&2; exit 2; }
parent=$out  # the nearest existing folder must take the output (checked without creating anything)
while [ ! -e "$parent" ]; do parent=$(dirname "$parent"); done
[ -d "$parent" ] && [ -w "$parent" ] && [ -x "$parent" ] || {
  echo "error: OUT_DIR '$out': cannot write there ($parent is not a writable folder)" >&2; exit 2; }
PINNED=(diffusers==0.42.1 torchinfo==1.8.0 torch-fidelity==0.4.0)
DEFAULT_ROWS="Baseline,Scale up,torch.compile,PyTorch SDPA,Mixed precision,Channels-last,Fused Adam,FFCV,resident data"
KNOB_ROWS="resident data,fused GroupNorm,Twice the batch,cuDNN attention,coordinate-descent"
export PYTHONUNBUFFERED=1

scratch=$(mktemp -d)  # data, .beton files and training runs: never in the output folder
trap 'rm -rf "$scratch"' EXIT

limit=${PART_LIMIT:-540}
step_limit=${PART_LIMIT:-450}  # the step part: 8 minutes at most with the wheels' install and the checks
if [ "$quick" = "--quick" ]; then
  limit=${PART_LIMIT:-1800}  # a loaded 2-core CI machine: the CPU form checks wiring, not time
  step_limit=$limit
fi
[[ "$limit" =~ ^[1-9][0-9]*$ ]] && (( limit >= 3 )) || {
  echo "error: PART_LIMIT must be whole seconds, at least 3, not '$limit'" >&2; exit 2; }
few_step_dir=${FEW_STEP_DIR:-runs/gpu-few-step}  # fewstep's models, checked before anything is written
if [ "$part" = fewstep ] || [ "$part" = all ]; then
  [ -f "$few_step_dir/teacher-uncond.pt" ] && [ -d "$few_step_dir/uncond" ] || {
    echo "error: $few_step_dir lacks teacher-uncond.pt and uncond/ (the digits teacher and its students:" \
         "results/NOTES.md packs them; FEW_STEP_DIR names another folder)" >&2; exit 2; }
fi

if [ "$quick" = "--quick" ]; then
  common=(--device cpu --quick --data-dir "$scratch/data")
  preset=tiny; small_preset=tiny; small_rows=Baseline  # the other rows are the ladder part's, with tiny too
  sweep_values=4,8,16
  train_flags=(--device cpu --preset tiny --image-size 16 --steps 6 --log-every 3)
  step_train=(--device cpu --preset tiny --image-size 16 --batch-size 8 --shapes-count 64 --steps 6 --log-every 3)
  fewstep_flags=(--device cpu --speed-batch 2 --latency-images 2 --speed-repeats 1)  # eager: Inductor's C++
  fewstep_modes=(default)                                                            # build takes minutes
else
  for pin in "${PINNED[@]}"; do
    name=${pin%%==*}; version=${pin##*==}
    ls .whl/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1 || {
      echo "error: .whl/ lacks $pin; on a machine with network: python3 -m pip download --no-deps" \
           "--only-binary=:all: -d .whl ${PINNED[*]}" >&2; exit 2; }
  done
  # The device before anything is installed or written: without a GPU the parts measure nothing.
  python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "error: no CUDA device here (torch.cuda.is_available() is False): the parts measure a GPU; add --quick" \
         "for their CPU form" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch/site" \
    .whl/*.whl  # into the scratch folder, removed at exit
  export PYTHONPATH=$scratch/site
  python3 -c '
import importlib.metadata, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    found = importlib.metadata.version(name)
    if found != version:
        sys.exit(f"error: {name} {found} is installed, the pinned version is {version}")
import diffusers, torch_fidelity, torchinfo  # they must import with the image'"'"'s packages
' "${PINNED[@]}"
  common=(--device cuda --data-dir "$scratch/data")
  preset=ddpm-cifar10; small_preset=small; small_rows=$DEFAULT_ROWS
  sweep_values=128,512,2048  # each size compiles anew: three fit in one 10-minute command
  train_flags=(--device cuda --steps 600 --log-every 100)
  step_train=(--device cuda --batch-size 512 --shapes-count 16384 --steps 300 --log-every 50)  # ~30 s of steps
  fewstep_flags=(--device cuda --compile --speed-batch 1000 --latency-images 32 --speed-repeats 5)
  fewstep_modes=(default reduce-overhead)
fi
mkdir -p "$out"

environment() {  # what ran it
  { date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
    python3 -c "import importlib.util, os, runpy  # torch's version without the seconds of importing it
v = runpy.run_path(os.path.join(os.path.dirname(importlib.util.find_spec('torch').origin), 'version.py'))
print('torch', v['__version__'], 'cuda', v['cuda'])"; } > "$out/$1-environment.txt"
}

ended() {  # ended LOG STATUS SECONDS WHAT, after a command under timeout: a cut is logged with what it
           # kept, any other failure ends the script
  case "$2" in
    0) ;;
    124|137) echo "cut at $3 s (exit $2: the time limit, or a kill): $4" | tee -a "$1" ;;
    *) exit "$2" ;;
  esac
}

bench() {  # bench PART STEM ARGS...: benchmark.py's files as OUT_DIR/STEM.*, its output in OUT_DIR/PART.log;
           # at most $budget seconds (default: the part's limit)
  local log=$out/$1.log stem=$2 seconds=${budget:-$limit} status=0; shift 2
  rm -f "$out/$stem.json" "$out/$stem.md" "$out/$stem.png"  # what is there after the cut is this run's
  timeout --kill-after=15 "$seconds" python3 benchmark.py "${common[@]}" --preset "$preset" --out-dir "$out" \
    --stem "$stem" "$@" 2>&1 | tee -a "$log" || status=$?
  if [ -f "$out/$stem.json" ]; then  # the ladder's modes rewrite it after every row
    ended "$log" "$status" "$seconds" "$stem.json holds the rows finished before (\"complete\": false)"
  else
    ended "$log" "$status" "$seconds" "before $stem.json was written: nothing measured"
  fi
}

left() {  # left RESERVE: seconds of the step part's limit not yet spent, less RESERVE for what follows (>= 3)
  local seconds=$(( step_limit - (SECONDS - step_start) - $1 ))
  echo $(( seconds > 3 ? seconds : 3 ))
}

run_part() {
  environment "$1"
  case "$1" in
    step)     local step_start=$SECONDS status=0 log=$out/step.log seconds
              # The headline first: A B A B, each one's first timing compiling (~2 min each on an H200);
              # 170 s kept for train.py and the profile, whose graphs Inductor's cache then holds. 16,384
              # shapes, as train.py's below: the resident loader's step does not depend on the set's size.
              budget=$(left 170) bench step step-peer --sweep peer --iters 30 --warmup 5 --num-images 16384
              rm -f "$out/step-peer.png"  # 8 files come back from a command; the chart is redrawn from the JSON
              seconds=$(left 80)
              timeout --kill-after=15 "$seconds" python3 train.py "${step_train[@]}" --dataset shapes \
                --sample-every 0 --out-dir "$scratch/step-train" 2>&1 | tee -a "$log" || status=$?
              if [ -f "$scratch/step-train/metrics.jsonl" ]; then
                cp "$scratch/step-train/metrics.jsonl" "$out/step-train-metrics.jsonl"
              fi
              ended "$log" "$status" "$seconds" "train.py's metrics so far are kept"
              budget=$(left 5) bench step step-profile --side-by-side
              rm -rf "$out/traces"  # Perfetto traces: too large to come back, and out of git anyway
              local metrics=()
              if [ -f "$out/step-train-metrics.jsonl" ]; then metrics=("$out/step-train-metrics.jsonl"); fi
              if [ -f "$out/step-peer.json" ]; then  # the README's table, from the JSON just written
                { python3 scripts/speed_table.py "$out/step-peer.json" "${metrics[@]}" \
                    || echo "scripts/speed_table.py: exit $?"; } 2>&1 | tee -a "$log"
              fi ;;
    knobs)    bench knobs knobs --rows "$KNOB_ROWS" --no-peer --no-sampling --iters 20 --warmup 5 --num-images 16384 ;;
    headline) bench headline headline --rows "Baseline,resident data" --no-sampling ;;
    ladder)   bench ladder ladder --rows "$DEFAULT_ROWS" --no-peer --no-sampling --iters 20 --warmup 5 ;;
    profile)  budget=$((limit * 2 / 3)) bench profile profile --profile
              if [ -f "$out/traces/profile.json" ]; then
                gzip -c "$out/traces/profile.json" > "$out/profile-trace.json.gz"
              fi
              rm -rf "$out/traces"
              budget=$((limit / 3)) bench profile sampling --sampling-only ;;
    gputests) local status=0 log=$out/gputests.log
              # One process (-n 0): the tests share one GPU and each pays its compile alone; -v names each
              # test as it starts, so that a cut names the test it cut.
              { timeout --kill-after=15 $((limit * 5 / 9)) python3 -m pytest -v -n 0 tests/test_gpu.py \
                  || echo "tests/test_gpu.py: exit $? (a failure, or cut at $((limit * 5 / 9)) s)"; } 2>&1 | tee "$log"
              timeout --kill-after=15 $((limit * 4 / 9)) python3 train.py "${train_flags[@]}" --dataset shapes \
                --shapes-count 4096 --sample-every 0 --out-dir "$scratch/train" 2>&1 | tee -a "$log" || status=$?
              if [ -f "$scratch/train/metrics.jsonl" ]; then
                cp "$scratch/train/metrics.jsonl" "$out/gputests-train-metrics.jsonl"
              fi
              ended "$log" "$status" $((limit * 4 / 9)) "train.py's metrics so far are kept" ;;
    autotune) bench autotune autotune --rows "Baseline,no CUDA graphs" --no-peer --no-sampling --iters 20 ;;
    graphs)   bench graphs graphs --rows "Baseline,reduce-overhead,+ CUDA graphs" --no-peer --no-sampling --iters 20 ;;
    quality)  bench quality quality --quality --steps 600 ;;
    loaders)  bench loaders loaders --loader-only ;;
    sweep)    bench sweep sweep --sweep batch --sweep-values "$sweep_values" --iters 20 ;;
    small)    preset=$small_preset bench small small --rows "$small_rows" --no-peer --no-sampling ;;
    fewstep)  local dir=$few_step_dir log=$out/fewstep.log family=() status mode
              if [ -f "$dir/teacher-cond.pt" ] && [ -d "$dir/cond" ]; then
                family=(--cond-teacher "$dir/teacher-cond.pt" --cond-students "$dir/cond")
              else
                echo "the guided family is skipped: $dir lacks teacher-cond.pt or cond/" | tee -a "$log"
              fi
              for mode in "${fewstep_modes[@]}"; do  # each mode its share of the limit; a cut keeps the
                status=0                               # families finished (the JSON is written after each)
                timeout --kill-after=15 $((limit / ${#fewstep_modes[@]})) python3 scripts/few_step_study.py \
                  --teacher "$dir/teacher-uncond.pt" --students "$dir/uncond" ${family[@]+"${family[@]}"} --quick \
                  --speed-calls 4,8,20 "${fewstep_flags[@]}" --compile-mode "$mode" --data-dir "$scratch/data" \
                  --out-dir "$out" --stem "fewstep-$mode" 2>&1 | tee -a "$log" || status=$?
                ended "$log" "$status" $((limit / ${#fewstep_modes[@]})) "fewstep-$mode.json holds the families finished"
              done ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
}

if [ "$part" = all ]; then
  for p in "${PARTS[@]}"; do run_part "$p"; done
else
  run_part "$part"
fi

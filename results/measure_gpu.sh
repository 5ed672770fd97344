#!/usr/bin/env bash
# The GPU measurements the README and results/ are waiting for, one part per call of at most
# 10 minutes (the device tool's limit). Run from the repository root on the GPU machine:
#
#   bash results/measure_gpu.sh warm       # compile every ladder row once: fills the caches
#   bash results/measure_gpu.sh ladder     # the ddpm-cifar10 ladder + diffusers peer + sampling speed
#   bash results/measure_gpu.sh small      # the ladder for the ~9M `small` preset
#   bash results/measure_gpu.sh profile    # torch.profiler of the best row
#   bash results/measure_gpu.sh loaders    # data paths vs the step's consumption, + batch sweep
#   bash results/measure_gpu.sh quality    # the equivalence check, ddpm-cifar10, 2000 steps
#   bash results/measure_gpu.sh train      # a short bf16 + compile train.py run (img/s as train.py sees it)
#
# Outputs go to $OUT (the device tool's folder) or results/gpu-out; copy them into results/
# with the command that made them. Inductor's caches live in .cache/ (git-ignored), which
# the device tool keeps between calls while the machine stays warm, so `warm` first makes the
# timed parts compile from cache.
#
# Packages the GPU image lacks travel as wheels in .whl/ (git-ignored; carry ".whl"):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl diffusers torchinfo torch-fidelity
set -euo pipefail
part=${1:?usage: bash results/measure_gpu.sh warm|ladder|small|profile|loaders|quality|train}
out=${OUT:-results/gpu-out}
mkdir -p "$out" .cache
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/nvidia-smi-$part.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
log="$out/$part.log"
case "$part" in
  warm)     python3 benchmark.py --iters 2 --warmup 0 --no-sampling --no-peer --out-dir "$out/warm" 2>&1 | tee "$log" ;;
  ladder)   python3 benchmark.py --preset ddpm-cifar10 --out-dir "$out" 2>&1 | tee "$log" ;;
  small)    python3 benchmark.py --preset small --no-sampling --out-dir "$out" 2>&1 | tee "$log" ;;
  profile)  python3 benchmark.py --preset ddpm-cifar10 --profile --out-dir "$out" 2>&1 | tee "$log"
            gzip -f "$out/traces/"*.json && mv "$out/traces/"*.json.gz "$out/" ;;
  loaders)  python3 benchmark.py --preset ddpm-cifar10 --loader-only --out-dir "$out" 2>&1 | tee "$log"
            python3 benchmark.py --preset ddpm-cifar10 --sweep batch --out-dir "$out" 2>&1 | tee -a "$log" ;;
  quality)  python3 benchmark.py --preset ddpm-cifar10 --quality --steps 2000 --out-dir "$out" 2>&1 | tee "$log" ;;
  train)    python3 -m pytest -q tests/test_gpu.py 2>&1 | tee "$out/test_gpu.log" || echo "GPU tests failed: see test_gpu.log"
            python3 train.py --dataset shapes --shapes-count 50000 --steps 600 --log-every 100 --sample-every 0 \
              --out-dir "$out/train-run" 2>&1 | tee "$log"
            cp "$out/train-run/metrics.jsonl" "$out/train-metrics.jsonl" ;;
  *) echo "unknown part: $part" >&2; exit 2 ;;
esac

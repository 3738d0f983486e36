#!/usr/bin/env bash
# Pipeline parallelism on the lent 2-GPU machine, after shared/gpu/unpack.sh has unpacked the carried environment to
# /tmp/g (docs/gpu.md): the pipeline GPU tests (-s prints each stage's update time and the parameter difference vs
# the unsplit model), then pp 2 vs dp 2 on the same 2 GPUs (bench/bench_pipeline_gpu.py). Run from a copy of the
# repository: `bash bench/device_pipeline.sh`; everything lands in $OUT (default bench/results/pipeline-gpu-logs):
# pipeline-gpu.log (the device log) and pipeline-gpu-<host>.json/.md.
set -u
OUT=${OUT:-bench/results/pipeline-gpu-logs}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"  # G, PY and the environment of the carried engine
LOG="$OUT/pipeline-gpu.log"
nvidia-smi -L | tee "$LOG"
git log -1 --format='code: %H %s' 2>/dev/null | tee -a "$LOG"
if [[ "${PIPELINE_TESTS:-1}" == 1 ]]; then  # PIPELINE_TESTS=0: bench only (after bench/device_gpu_tests.sh ran them)
  echo "== pytest tests/gpu/test_gpu_pipeline.py" | tee -a "$LOG"
  env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${PIPELINE_TESTS_TIMEOUT:-200}" $PY -m pytest -q -rs -s \
    -p no:cacheprovider tests/gpu/test_gpu_pipeline.py 2>&1 | tee -a "$LOG"
fi
echo "== python -m bench.bench_pipeline_gpu" | tee -a "$LOG"
timeout "${PIPELINE_BENCH_TIMEOUT:-300}" $PY -m bench.bench_pipeline_gpu --out "$OUT" "$@" 2>&1 | tee -a "$LOG"

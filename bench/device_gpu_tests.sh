#!/usr/bin/env bash
# Every GPU test (tests/gpu) on the lent 2-GPU machine, after shared/gpu/unpack.sh has unpacked the carried environment
# to /tmp/g (docs/gpu.md). Run from a copy of the repository: `bash bench/device_gpu_tests.sh [pytest args]`.
# The log lands in $OUT/gpu-tests.log (default bench/results/gpu-tests-logs).
set -u
OUT=${OUT:-bench/results/gpu-tests-logs}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"  # G, PY and the environment of the carried engine
nvidia-smi -L | tee "$OUT/gpu-tests.log"
git log -1 --format='code: %H %s' 2>/dev/null | tee -a "$OUT/gpu-tests.log"
env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${GPU_TESTS_TIMEOUT:-540}" $PY -m pytest -q -rs -p no:cacheprovider \
  tests/gpu "$@" 2>&1 | tee -a "$OUT/gpu-tests.log"

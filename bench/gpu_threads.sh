#!/usr/bin/env bash
# The engine's intra-op threads per CUDA rank against the step time at 1 and 4 GPUs (the reason CUDA ranks sharing a
# host default to 1 thread: DistributedConfig.default_threads). From the repository root, on a host with 4 GPUs:
#
#   ORTFLOW_PY=/path/to/python3.11 bash bench/gpu_threads.sh
#
# ORTFLOW_PY: the Python with ortflow's GPU environment; ORTFLOW_PYTHONPATH: put before the repository on its
# PYTHONPATH; MPIEXEC: the MPI launcher (default: mpiexec on PATH); ROUNDS (default 2); OUT: where gpu-threads.txt goes
# (default bench/results/gpu-threads). Each row is `bench/bench_mixed.py steps` (the loop's update: forward + backward,
# NCCL exchange, device update) with ORTFLOW_THREADS_PER_RANK set as the row says: the host's cores shared by the
# ranks, or 1; the figures are the medians of 30 timed steps after 10 warm-up steps, per rank and of the slowest rank.
set -u
cd "$(dirname "$0")/.."
PY=${ORTFLOW_PY:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
OUT=${OUT:-bench/results/gpu-threads}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
export PYTHONPATH=${ORTFLOW_PYTHONPATH:+$ORTFLOW_PYTHONPATH:}$PWD
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
WORK=$(mktemp -d)
CORES=$("$PY" -c "import os; print(len(os.sched_getaffinity(0)))")  # nproc follows OMP_NUM_THREADS
REPORT=$OUT/gpu-threads.txt
{
  echo "# threads per CUDA rank, $(date -u +%F' '%H:%M) UTC, commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' with local changes')"
  echo "cores: $CORES; GPUs:"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "MPI: $($MPIEXEC --version 2>&1 | head -1)"
} > "$REPORT"
$PY bench/bench_mixed.py prepare "$WORK" --precisions '' --shape bench --device cuda >/dev/null 2>&1
$PY bench/bench_mixed.py prepare "$WORK" --precisions fp16,bf16,fp32 --shape bench --device cuda --reuse-model \
  >/dev/null 2>&1 || { echo "prepare failed" | tee -a "$REPORT"; exit 1; }
row() { # label, ranks, precision, threads
  local line
  line=$(ORTFLOW_THREADS_PER_RANK=$4 timeout 180 "$MPIEXEC" -n "$2" "$PY" bench/bench_mixed.py steps "$WORK/$3" \
    --steps 30 --warmup 10 2>"$WORK/err.txt" | grep step_time_s | tail -1)
  "$PY" - "$1" "$line" <<'PY'
import json, sys
label, line = sys.argv[1], sys.argv[2]
try:
    r = json.loads(line[line.index("{"):])
    ms = lambda xs: "/".join(f"{x * 1e3:.2f}" for x in xs)
    print(f"{label:30s} step {r['step_time_s'] * 1e3:6.2f} fb {r['forward_backward_s'] * 1e3:6.2f} "
          f"update {r['update_time_s'] * 1e3:5.2f} | per rank: step {ms(r['per_rank']['step_s'])} "
          f"fb {ms(r['per_rank']['forward_backward_s'])}")
except Exception as err:
    print(f"{label:30s} FAILED {err}: {line[:200]}")
PY
}
echo "ms: step = the update's wall time, fb = the engine's forward + backward call (slowest rank)" >> "$REPORT"
for round in $(seq "$ROUNDS"); do
  for prec in fp16 bf16 fp32; do
    row "r$round $prec x1 threads=$CORES" 1 $prec "$CORES"
    row "r$round $prec x1 threads=1" 1 $prec 1
    row "r$round $prec x4 threads=$(( $CORES / 4 ))" 4 $prec "$(( $CORES / 4 ))"
    row "r$round $prec x4 threads=1" 4 $prec 1
  done
done | tee -a "$REPORT"
rm -rf "$WORK"

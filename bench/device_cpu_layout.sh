#!/usr/bin/env bash
# Layouts at one global batch on the 32-core nvidia-h200-x2 device machine's CPUs (GPUs unused), issue 20:
#   * ortflow `--np auto` (distributed.num_ranks auto + train.global_batch_size) vs PyTorch's default (1 process x 32
#     threads) and PyTorch DDP at several layouts (the best of them is "PyTorch at its best layout"), same GPT, same
#     samples per weight update;
#   * MPIComm.average_gradients vs a bare mpi4py Allreduce of the same bytes at 16 ranks (bench/bench_exchange.py).
# Run from the repository root (the same wheels in .whl/ as bench/device_cpu_scaling.sh; docs/benchmarks.md):
#
#   run(kind="nvidia-h200-x2", command="bash bench/device_cpu_layout.sh", carry=[".whl"], timeout_s=600)
#
# Writes $OUT/layout-*.json/.md, $OUT/exchange-*.json/.md and a log archive. Knobs (environment): GLOBAL_BATCH (128),
# ORTFLOW_LAYOUTS (auto,16x1), TORCH_LAYOUTS (1x32,32x1,16x2,8x4), ROUNDS (1), WARMUP (2), STEPS (6), DISPLAY (2),
# EXCHANGE_RANKS (16), SKIP_INSTALL=1 and PYTHON to try the logic elsewhere, BENCH_MPIEXEC.
# Try it here: SKIP_INSTALL=1 PYTHON=.venv/bin/python OUT=/tmp/out GLOBAL_BATCH=16 ORTFLOW_LAYOUTS=auto,1x2 \
#   TORCH_LAYOUTS=1x2,2x1 EXCHANGE_RANKS=2 bash bench/device_cpu_layout.sh
set -euo pipefail

OUT=${OUT:?set OUT to the folder for the results}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    ls .whl/*.whl >/dev/null || { echo "no wheels in .whl/: download them first (docs/benchmarks.md)" >&2; exit 2; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:/tmp/site-jit:$PWD  # site-jit: Numba, when bench/device_optim.sh jit ran
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [[ -z "${BENCH_MPIEXEC:-}" ]]; then
    if command -v mpirun >/dev/null; then
        export BENCH_MPIEXEC="mpirun --allow-run-as-root --bind-to none --oversubscribe"
    else
        export BENCH_MPIEXEC="$(dirname "$(command -v "$PYTHON")")/mpiexec"
    fi
fi
export CUDA_VISIBLE_DEVICES="" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

"$PYTHON" - <<'PY'
import os, numpy, onnxruntime, torch, mpi4py
from ortflow.trainer.layout import host_resources
print("python", __import__("sys").version.split()[0], "| numpy", numpy.__version__, "| onnxruntime",
      onnxruntime.__version__, "| torch", torch.__version__, "| mpi4py", mpi4py.__version__, "| host", host_resources())
from ortflow.engine import api  # noqa: F401 - the training API must import before anything is timed
PY
echo "launcher: $BENCH_MPIEXEC; cores: $(nproc); load: $(cat /proc/loadavg)"
lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA)" || true

STAMP="$(hostname)-$(date +%Y%m%d-%H%M)"
status=0
timeout 420 "$PYTHON" -m bench.bench_layout --global-batch "${GLOBAL_BATCH:-128}" \
    --ortflow "${ORTFLOW_LAYOUTS:-auto,16x1}" --torch "${TORCH_LAYOUTS:-1x32,32x1,16x2,8x4}" \
    --rounds "${ROUNDS:-1}" --warmup "${WARMUP:-2}" --steps "${STEPS:-6}" --display "${DISPLAY:-2}" \
    --work /tmp/bench-layout --out "$OUT" --name "layout-$STAMP" || status=$?
# shellcheck disable=SC2086 - the launcher prefix is a command line
timeout 120 $BENCH_MPIEXEC -n "${EXCHANGE_RANKS:-16}" "$PYTHON" -m bench.bench_exchange --rounds 10 --calls 10 \
    --out "$OUT" || status=$?
if [[ -d "$OUT/layout-$STAMP-logs" ]]; then
    tar -czf "$OUT/layout-$STAMP-logs.tgz" -C "$OUT" "layout-$STAMP-logs" && rm -rf "${OUT:?}/layout-$STAMP-logs"
fi
ls -la "$OUT"
exit $status

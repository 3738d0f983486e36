#!/usr/bin/env bash
# CPU scaling run on the 32-core nvidia-h200-x2 device machine (GPUs unused): ortflow's trainer vs PyTorch DDP (gloo)
# at 1, 2, 4, 8 and 16 ranks x 1 thread (weak scaling, fixed batch per rank), 1 rank x all cores, the bare engine
# loop, the GEMM ceiling, all-reduce at 16 ranks and checkpoint save time. Run from the repository root:
#
#   bash bench/device_cpu_scaling.sh            # writes $OUT/device-cpu-*.json, .md, logs.tgz
#
# That machine has Python 3.12, a system Open MPI with mpi4py, its own PyTorch, no network, and numpy/onnx too new
# for the engine: the engine and what ortflow's ranks import that the machine lacks come as cp312 wheels in .whl/
# (see docs/benchmarks.md for the download command and the `run` call). Knobs (environment): RANKS (1,2,4,8,16),
# ROUNDS (2), STEPS (10), WARMUP (5), SKIP_INSTALL=1 and PYTHON to try the script's logic elsewhere, BENCH_MPIEXEC.
set -euo pipefail

source "$(dirname "$0")/device_cpu_env.sh"  # OUT, PYTHON, PYTHONPATH, BENCH_MPIEXEC, CPU-only environment

"$PYTHON" - <<'EOF'
import numpy, onnx, onnxruntime, pydantic, pyarrow, yaml, tensorboard, mpi4py, torch
print("python", __import__("sys").version.split()[0], "| numpy", numpy.__version__, "| onnx", onnx.__version__,
      "| onnxruntime", onnxruntime.__version__, onnxruntime.__file__, "| torch", torch.__version__,
      "| mpi4py", mpi4py.__version__, "| pyarrow", pyarrow.__version__, "| pydantic", pydantic.__version__)
from ortflow.engine import api  # noqa: F401 - the training API must import before anything is timed
EOF
echo "launcher: $BENCH_MPIEXEC; cores: $(nproc)"

NAME="device-cpu-$(hostname)-$(date +%Y%m%d-%H%M)"
status=0
"$PYTHON" -m bench --ranks "${RANKS:-1,2,4,8,16}" --rounds "${ROUNDS:-2}" --steps "${STEPS:-10}" \
    --warmup "${WARMUP:-5}" --skip dataprep --out "$OUT" --work /tmp/bench-work --name "$NAME" || status=$?
# $OUT brings back at most 8 files, 2 folders deep: the per-run logs travel as one archive.
if [[ -d "$OUT/$NAME-logs" ]]; then
    tar -czf "$OUT/$NAME-logs.tgz" -C "$OUT" "$NAME-logs" && rm -rf "${OUT:?}/$NAME-logs"
fi
ls -la "$OUT"
exit $status

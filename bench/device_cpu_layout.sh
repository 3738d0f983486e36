#!/usr/bin/env bash
# Layouts at one global batch on the 32-CPU nvidia-h200-x2 device machine's CPUs (GPUs unused), issue 20:
#   * MPIComm.average_gradients vs a bare mpi4py Allreduce of the same bytes, on the engine's own gradient buffers,
#     at 2 and at 16 ranks (bench/bench_exchange.py), then, alone and at 2 ranks, the MPI derived-datatype scheme
#     (Open MPI may accept what MPICH refuses; it runs last and alone so a failure cannot take the rest down);
#   * ortflow `--np auto` (distributed.num_ranks auto + train.global_batch_size) and hand-picked 16 x 1 and 32 x 1
#     vs PyTorch's default (1 process x 32 threads) and PyTorch DDP at 16 x 1, 32 x 1, 16 x 2 and 8 x 4 (the best of
#     them is "PyTorch at its best layout"), same GPT, same samples per weight update (bench/bench_layout.py; its
#     report is rewritten after every contender, so a run cut short by the time limit keeps what it measured).
# Run from the repository root (the same wheels in .whl/ as bench/device_cpu_scaling.sh; docs/benchmarks.md):
#
#   run(kind="nvidia-h200-x2", command="bash bench/device_cpu_layout.sh", carry=[".whl"], timeout_s=600)
#
# Writes $OUT/exchange-*.json/.md, $OUT/layout-*.json/.md and a log archive, in about 8 minutes. Knobs (environment):
# GLOBAL_BATCH (128), ORTFLOW_LAYOUTS (auto,16x1,32x1), TORCH_LAYOUTS (1x32,16x1,32x1,16x2,8x4; empty: no PyTorch),
# ROUNDS (1), WARMUP (2), STEPS (6), DISPLAY (2), EXCHANGE_RANKS (2,16; empty: none), EXCHANGE_ROUNDS (10),
# LAYOUT_TIMEOUT (360), HINDEXED (1; 0 skips the derived-datatype runs), SKIP_INSTALL=1 and PYTHON to try the logic
# elsewhere, BENCH_MPIEXEC. Try it on the 2-core machine (no PyTorch):
#   SKIP_INSTALL=1 PYTHON=.venv/bin/python OUT=/tmp/out GLOBAL_BATCH=4 ORTFLOW_LAYOUTS=auto TORCH_LAYOUTS= \
#   STEPS=2 EXCHANGE_RANKS=2 EXCHANGE_ROUNDS=2 bash bench/device_cpu_layout.sh
set -euo pipefail

source "$(dirname "$0")/device_cpu_env.sh"  # OUT, PYTHON, PYTHONPATH, BENCH_MPIEXEC, CPU-only environment
TORCH_LAYOUTS=${TORCH_LAYOUTS-1x32,16x1,32x1,16x2,8x4}
started=$SECONDS

# Everything the driver and the ranks import, checked before anything is timed: a missing one is named, not hit
# half-way through (the ranks: the trainer, checkpoints (h5py), data (pyarrow), metrics (tensorboard), config (yaml)).
WANT_TORCH=$([[ -n "$TORCH_LAYOUTS" ]] && echo 1 || echo 0) "$PYTHON" - <<'PY'
import importlib, os, sys
names = ["numpy", "onnx", "onnxruntime", "pydantic", "pyarrow", "yaml", "tensorboard", "h5py", "mpi4py",
         "google.protobuf", "flatbuffers"] + (["torch"] if os.environ["WANT_TORCH"] == "1" else [])
found, missing = {}, []
for name in names:
    try:
        found[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as err:  # noqa: BLE001 - name every missing piece at once
        missing.append(f"{name} ({type(err).__name__}: {err})")
print("python", sys.version.split()[0], "|", " | ".join(f"{k} {v}" for k, v in found.items()))
try:  # the host update's fused kernels: a pinned dependency, carried separately (bench/device_optim.sh jit)
    import numba
    print("update kernels: fused (numba", numba.__version__ + ")")
except ImportError:
    print("update kernels: numpy (no numba here: run `bash bench/device_optim.sh jit` first for what users get)")
if missing:
    sys.exit("missing on this machine (add cp312 wheels to .whl/, docs/benchmarks.md): " + "; ".join(missing))
import ortflow.trainer.__main__, ortflow.trainer.loop, ortflow.checkpoints, ortflow.build.configure  # noqa: E401,F401
from ortflow.engine import api  # noqa: F401 - the training API must import before anything is timed
from ortflow.launch.layout import host_resources
import mpi4py.MPI
print("host", host_resources(), "|", mpi4py.MPI.Get_library_version().splitlines()[0])
PY
echo "launcher: $BENCH_MPIEXEC; cpus: $(nproc); load: $(cat /proc/loadavg)"
lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA)" || true

STAMP="$(hostname)-$(date +%Y%m%d-%H%M)"
LOGS="$OUT/layout-$STAMP-logs"
mkdir -p "$LOGS"
status=0
IFS=, read -r -a exchange_ranks <<< "${EXCHANGE_RANKS-2,16}"
for ranks in "${exchange_ranks[@]+"${exchange_ranks[@]}"}"; do
    echo "== exchange at $ranks ranks ($((SECONDS - started)) s)"
    # shellcheck disable=SC2086 - the launcher prefix is a command line
    timeout 100 $BENCH_MPIEXEC -n "$ranks" "$PYTHON" -m bench.bench_exchange --rounds "${EXCHANGE_ROUNDS:-10}" \
        --calls 10 --contenders ortflow,packed,posted-tensors,bare-scaled,bare-runs --out "$OUT" \
        2>&1 | grep -v "^BENCH_RESULT" | tee "$LOGS/exchange-${ranks}r.log" || status=$?
done
echo "== layouts ($((SECONDS - started)) s)"
timeout "${LAYOUT_TIMEOUT:-360}" "$PYTHON" -m bench.bench_layout --global-batch "${GLOBAL_BATCH:-128}" \
    --ortflow "${ORTFLOW_LAYOUTS:-auto,16x1,32x1}" --torch "$TORCH_LAYOUTS" \
    --rounds "${ROUNDS:-1}" --warmup "${WARMUP:-2}" --steps "${STEPS:-6}" --display "${DISPLAY:-2}" \
    --work /tmp/bench-layout --out "$OUT" --name "layout-$STAMP" || status=$?
# The trainer's arena (1 run: the type is one block) and a session's own (5 runs spread over ~46 TB of addresses).
for arena in $([[ "${HINDEXED:-1}" == 1 ]] && echo trainer session); do
    echo "== derived datatype at 2 ranks, $arena arena ($((SECONDS - started)) s)"
    # shellcheck disable=SC2086 - the launcher prefix is a command line
    timeout 60 $BENCH_MPIEXEC -n 2 "$PYTHON" -m bench.bench_exchange --rounds 3 --calls 10 --arena "$arena" \
        --contenders hindexed,ortflow > "$LOGS/exchange-hindexed-$arena-2r.log" 2>&1 \
        || echo "derived datatype run: exit $? (see its log)"
    grep -v "^BENCH_RESULT" "$LOGS/exchange-hindexed-$arena-2r.log" | tail -14 || true
done
tar -czf "$OUT/layout-$STAMP-logs.tgz" -C "$OUT" "layout-$STAMP-logs" && rm -rf "${LOGS:?}"
echo "done in $((SECONDS - started)) s"
ls -la "$OUT"
exit $status

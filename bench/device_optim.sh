#!/usr/bin/env bash
# The update benchmarks of issue 15 on the lent nvidia-h200-x2 machine, by stage (docs/benchmarks.md, "Optimizer
# update on the device machine"). Run from the repository root: `bash bench/device_optim.sh STAGES`, STAGES a
# comma-separated list of:
#   jit  unpack Numba + llvmlite for cp312, carried in .whl-jit/ (jit.tar.xz, 42 MiB; or the wheels), into
#        /tmp/site-jit: a call of its own, since with .whl/ they exceed one call's 64 MiB (the machine keeps /tmp
#        while it stays warm between calls). Without it the cpu stage runs the host update's numpy backend (it says
#        which backend ran);
#   cpu  on the 32 CPU cores with the system python3.12 + Open MPI and the wheels of .whl/ (+ /tmp/site-jit):
#        ZeRO-1 vs ZeRO-0 at RANKS (bench.optim_zero, one run per rank count, then bench.optim_zero_report), and the
#        1-rank update vs the engine's step at CPU_THREADS (bench.optim_cpu);
#   gpu  in the carried GPU environment (shared/gpu/unpack.sh finished: /tmp/g; bench/device_env.sh): the fused
#        device update vs HBM peak, a D2D copy and the engine's CUDA optimizer step (bench/optim_gpu.py).
# Writes everything under $OUT. Knobs (environment): RANKS (1,2,4,8,16), ROUNDS (3), CPU_THREADS (1,2,4),
# CPU_ROUNDS (7), GPU_ARGS (extra bench/optim_gpu.py arguments), SKIP_INSTALL=1 and PYTHON to try the cpu stage
# elsewhere, BENCH_MPIEXEC. Try the cpu stage here:
#   SKIP_INSTALL=1 PYTHON=.venv/bin/python OUT=/tmp/out RANKS=1,2 ROUNDS=1 CPU_THREADS=1 CPU_ROUNDS=1 \
#     bash bench/device_optim.sh cpu
set -uo pipefail

STAGES=",${1:-cpu},"
OUT=${OUT:?set OUT to the folder for the results}
mkdir -p "$OUT"
has() { [[ $STAGES == *",$1,"* ]]; }
status=0

if has jit; then
    mkdir -p /tmp/site-jit
    if ls .whl-jit/*.tar.xz >/dev/null 2>&1; then
        tar -C /tmp/site-jit -xJf .whl-jit/*.tar.xz || status=$?
    elif ls .whl-jit/*.whl >/dev/null 2>&1; then
        ${PYTHON:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site-jit .whl-jit/*.whl || status=$?
    else
        echo "nothing in .whl-jit/ (docs/benchmarks.md)" >&2; exit 2
    fi
    ls /tmp/site-jit
fi

if has cpu; then
    PYTHON=${PYTHON:-python3}
    if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
        ls .whl/*.whl >/dev/null || { echo "no wheels in .whl/: download them first (docs/benchmarks.md)" >&2; exit 2; }
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl
        export PYTHONPATH=/tmp/site:/tmp/site-jit:$PWD
    else
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
    if [[ -z "${BENCH_MPIEXEC:-}" ]]; then
        if command -v mpirun >/dev/null; then
            export BENCH_MPIEXEC="mpirun --allow-run-as-root --bind-to none --oversubscribe"
        else
            export BENCH_MPIEXEC="$(dirname "$(command -v "$PYTHON")")/mpiexec"
        fi
    fi
    export CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
    "$PYTHON" - <<'PY'
import sys, numpy, onnxruntime
from ortflow.trainer.optim.base import default_backend
from ortflow.engine import api  # noqa: F401 - the training API must import before anything is timed
print("python", sys.version.split()[0], "| numpy", numpy.__version__, "| onnxruntime", onnxruntime.__version__,
      "| host update backend:", default_backend())
PY
    echo "launcher: $BENCH_MPIEXEC; cores: $(nproc); load: $(cat /proc/loadavg)"
    lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA)" || true
    IFS=, read -ra ranks <<< "${RANKS:-1,2,4,8,16}"
    for n in "${ranks[@]}"; do
        echo "== ZeRO at $n rank(s) $(date +%T)"
        # shellcheck disable=SC2086 - the launcher prefix is a command line
        timeout 150 $BENCH_MPIEXEC -n "$n" "$PYTHON" -m bench.optim_zero --rounds "${ROUNDS:-3}" \
            --out "$OUT/optim-zero-${n}ranks.md" > "$OUT/optim-zero-${n}ranks.log" 2>&1 || status=$?
        tail -5 "$OUT/optim-zero-${n}ranks.log"
    done
    "$PYTHON" -m bench.optim_zero_report "$OUT" || status=$?
    echo "== 1-rank update vs the engine's step $(date +%T)"
    timeout 200 "$PYTHON" -m bench.optim_cpu --rounds "${CPU_ROUNDS:-7}" --threads "${CPU_THREADS:-1,2,4}" \
        --out "$OUT/optim-cpu-device.md" > "$OUT/optim-cpu-device.log" 2>&1 || status=$?
    tail -40 "$OUT/optim-cpu-device.log"
fi

if has gpu; then
    source "$(dirname "$0")/device_env.sh"  # G, PY and the environment of the carried engine
    nvidia-smi -L
    # shellcheck disable=SC2086 - extra arguments
    timeout "${GPU_TIMEOUT:-480}" $PY bench/optim_gpu.py --out "$OUT" ${GPU_ARGS:-} 2>&1 | tee "$OUT/optim-gpu.log"
    status=$(( status || PIPESTATUS[0] ))
fi
ls -la "$OUT"
exit $status

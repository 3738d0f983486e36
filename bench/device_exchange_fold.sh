#!/usr/bin/env bash
# bench/bench_exchange_fold.py on the 32-CPU device machine's Open MPI (issue 20, item 5): the exchange with the mean's
# scale folded into the norm and the update vs the eager passes and a bare Allreduce, at 2 and 16 ranks, on the
# engine's gradient buffers (trainer arena). Same wheels as bench/device_cpu_layout.sh (about 3 minutes):
#   run(kind="nvidia-h200-x2", command="OUT=\$OUT bash bench/device_exchange_fold.sh", carry=[".whl"], timeout_s=600)
# Knobs: RANKS (2,16), ROUNDS (30), CALLS (10), THREADS (1: the update's threads per rank). Without Numba in the
# carried set the update runs its numpy kernels (the same bits; the report's absolute update times are then numpy's).
# Try it here: SKIP_INSTALL=1 PYTHON=.venv/bin/python OUT=/tmp/out RANKS=2 ROUNDS=2 bash bench/device_exchange_fold.sh
set -uo pipefail
source "$(dirname "$0")/device_cpu_env.sh"  # OUT, PYTHON, PYTHONPATH, BENCH_MPIEXEC, CPU-only environment
{ echo "load: $(cat /proc/loadavg)"; lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA)"; \
  "$PYTHON" -c "import numba; print('numba', numba.__version__)" 2>&1 | tail -1; } | tee "$OUT/exchange-fold-host.txt"
export OPENBLAS_NUM_THREADS="${THREADS:-1}" OMP_NUM_THREADS="${THREADS:-1}"  # as `ortflow train` sets them per rank
IFS=, read -r -a ranks <<< "${RANKS:-2,16}"
status=0
for n in "${ranks[@]}"; do
    echo "== $n ranks"
    # shellcheck disable=SC2086 - the launcher prefix is a command line
    timeout 240 $BENCH_MPIEXEC -n "$n" "$PYTHON" -m bench.bench_exchange_fold --rounds "${ROUNDS:-30}" \
        --calls "${CALLS:-10}" --threads "${THREADS:-1}" --out "$OUT" 2>&1 | grep -v "^BENCH_RESULT" | tail -24 \
        || status=$?
done
exit $status

#!/usr/bin/env bash
# Every GPU test (tests/gpu) under one time budget, on a host with the GPU engine installed (docs/gpu.md "Testing on
# GPUs"). From the repository root:
#
#   ORTFLOW_PY=/path/to/python3.11 bash bench/gpu_tests.sh [tests/gpu files or tests] [extra pytest arguments]
#
# ORTFLOW_PY: the Python with ortflow's GPU environment (onnxruntime-training, CuPy, mpi4py, pytest; with
# pytest-timeout each test gets its own limit); ORTFLOW_PYTHONPATH: put before the repository on its PYTHONPATH;
# MPIEXEC: the MPI launcher, when the one on PATH is not it; BUDGET_S: seconds for the whole run (default 1500);
# TEST_S: seconds per test (default 170); OUT: where gpu-tests.log, gpu-tests.xml (JUnit) and gpu-tests-summary.txt
# go (default bench/out/gpu-tests).
#
# The 4-GPU layouts and the tests of the training loop's GPU paths run first, so a budget that runs out cuts the
# least telling ones; the summary lists every collected test as PASS, FAIL, ERROR, SKIP or NOT RUN, and as CRASH the
# test the test process died in (an abort in a native library leaves no JUnit file: tests/gpu/progress.py).
set -u
cd "$(dirname "$0")/.."
PY=${ORTFLOW_PY:-python3}
OUT=${OUT:-bench/out/gpu-tests}
BUDGET_S=${BUDGET_S:-1500}
TEST_S=${TEST_S:-170}
mkdir -p "$OUT"
LOG=$OUT/gpu-tests.log XML=$OUT/gpu-tests.xml SUMMARY=$OUT/gpu-tests-summary.txt PLAN=$OUT/gpu-tests-plan.txt
PROGRESS=$OUT/gpu-tests-progress.jsonl  # each test's start and end as they happen (tests/gpu/progress.py)
rm -f "$XML" "$SUMMARY" "$PLAN" "$PROGRESS"
export ORTFLOW_TEST_PROGRESS=$PROGRESS
export PYTHONPATH=${ORTFLOW_PYTHONPATH:+$ORTFLOW_PYTHONPATH:}$PWD
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off: NCCL's NVLS init fails on some hosts
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # only the plugins named below
[ -n "${MPIEXEC:-}" ] && export PATH=$(dirname "$MPIEXEC"):$PATH  # the tests call the first mpiexec on PATH
if [ "$(id -u)" = 0 ]; then  # Open MPI refuses root unless told (containers run as root)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# Most telling first: the 4-GPU layouts, then the loop's GPU paths, then the rest; any other file comes last.
FIRST="test_gpu_four_layouts test_gpu_training test_gpu_cuda_graphs test_gpu_pipeline test_gpu_tensor test_gpu_mixed_precision test_gpu_split_precision
test_gpu_adasum test_gpu_cuda_kernels test_gpu_sums_allreduce test_gpu_optim test_gpu_setup"
FILES=()
for name in $FIRST; do [ -f "tests/gpu/$name.py" ] && FILES+=("tests/gpu/$name.py"); done
for file in tests/gpu/test_*.py; do
  case " ${FILES[*]} " in *" $file "*) ;; *) FILES+=("$file") ;; esac
done

# Arguments naming files or tests under tests/gpu run only those (in the order above); the others go to pytest.
PICKED=() EXTRA=()
for arg in "$@"; do
  case "$arg" in tests/gpu/test_*) PICKED+=("$arg") ;; *) EXTRA+=("$arg") ;; esac
done
if [ ${#PICKED[@]} -gt 0 ]; then
  ORDERED=()
  for file in "${FILES[@]}"; do
    for arg in "${PICKED[@]}"; do [ "${arg%%::*}" = "$file" ] && ORDERED+=("$arg"); done
  done
  for arg in "${PICKED[@]}"; do
    [ -f "${arg%%::*}" ] || { echo "no such GPU test file: ${arg%%::*}" >&2; exit 2; }
  done
  FILES=("${ORDERED[@]}")
fi
set -- ${EXTRA[@]+"${EXTRA[@]}"}

ARGS=(-q -rA --durations=20 -p no:cacheprovider -p tests.gpu.progress --junitxml="$XML" -o junit_family=xunit1)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  ARGS+=(-p pytest_timeout --timeout "$TEST_S")  # SIGALRM: the test fails, its mpiexec is killed, the run goes on
  LIMITS="$TEST_S s per test, $BUDGET_S s in all"
  if [ "$BUDGET_S" -gt 60 ] && "$PY" -c "import pytest_timeout as t, sys; sys.exit(not hasattr(t, 'SESSION_TIMEOUT_KEY'))" \
      2>/dev/null; then
    ARGS+=(--session-timeout $((BUDGET_S - 30)))  # no new test starts in the last 30 s
  fi
else
  LIMITS="$BUDGET_S s in all (pytest-timeout is not installed: no per-test limit)"
fi

{
  echo "# GPU tests, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | grep -q . && echo '(with local changes)')"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "nvidia-smi failed"
  "$PY" -c "import sys, importlib.metadata as m
def v(d):
    try: return m.version(d)
    except m.PackageNotFoundError: return '-'
print('python', sys.version.split()[0], *(f'{d} {v(d)}' for d in ('onnxruntime-training', 'cupy-cuda12x', 'cupy-cuda13x', 'mpi4py', 'pytest', 'pytest-timeout')))"
  echo "mpiexec: $(command -v mpiexec) ($(mpiexec --version 2>&1 | head -1))"
  echo "limits: $LIMITS"
  echo "order: ${FILES[*]}"
} 2>&1 | tee "$LOG"

"$PY" -m pytest --collect-only -q -p no:cacheprovider "${FILES[@]}" "$@" 2>/dev/null | grep '::' > "$PLAN"
echo "collected $(wc -l < "$PLAN") tests" | tee -a "$LOG"

start=$(date +%s)
# SIGINT at the budget: pytest stops like at Ctrl-C and still writes the JUnit file (the handler is set again because
# a shell that starts this script in the background hands its children SIGINT ignored); the test's mpiexec is killed.
PYTEST='import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); import pytest
sys.exit(pytest.main(sys.argv[1:]))'
timeout -s INT -k 20 "$BUDGET_S" "$PY" -c "$PYTEST" "${ARGS[@]}" "${FILES[@]}" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
echo "pytest exit status $status after $(( $(date +%s) - start )) s" | tee -a "$LOG"

# The exit status is the summary's: 0 when every collected test passed or skipped (pytest's own status is 1 when its
# session limit is reached as the last test ends), else pytest's status, or 1 where pytest returned 0.
"$PY" bench/gpu_tests_summary.py "$XML" "$PLAN" "$PROGRESS" "$status" > "$SUMMARY"
summary_status=$?
tee -a "$LOG" < "$SUMMARY"
if [ "$summary_status" = 0 ]; then exit 0; fi
if [ "$status" = 0 ]; then exit 1; fi
exit "$status"

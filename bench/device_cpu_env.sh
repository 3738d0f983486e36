# Sourced by the device CPU scripts (bench/device_cpu_scaling.sh, device_cpu_layout.sh, device_exchange_memory.sh),
# run from the repository root on the 32-CPU device machine: installs the cp312 wheels of .whl/ into /tmp/site
# (docs/benchmarks.md) unless SKIP_INSTALL=1, and sets PYTHON, PYTHONPATH, BENCH_MPIEXEC and the environment of a
# CPU-only run. Needs OUT set by the caller.
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

# Open MPI refuses root unless told; ranks must not be pinned to one core each (1 x 32 threads needs them all).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [[ -z "${BENCH_MPIEXEC:-}" ]]; then
    if command -v mpirun >/dev/null; then
        export BENCH_MPIEXEC="mpirun --allow-run-as-root --bind-to none --oversubscribe"
    else
        export BENCH_MPIEXEC="$(dirname "$(command -v "$PYTHON")")/mpiexec"
    fi
fi
# CPU-only run: keep PyTorch off the GPUs; the workplace's NVLink multicast settings stay off in every child.
export CUDA_VISIBLE_DEVICES="" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

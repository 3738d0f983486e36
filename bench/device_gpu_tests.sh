#!/usr/bin/env bash
# Every GPU test (tests/gpu) on the lent 2-GPU machine, after shared/gpu/unpack.sh has unpacked the carried environment
# to /tmp/g (docs/gpu.md). Run from a copy of the repository: `bash bench/device_gpu_tests.sh [pytest args]`.
# The log lands in $OUT/gpu-tests.log (default bench/results/gpu-tests-logs).
set -u
OUT=${OUT:-bench/results/gpu-tests-logs}; mkdir -p "$OUT"
G=/tmp/g; PY=$G/py311/usr/bin/python3.11
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
NCCLDIR=$(dirname "$(find / -name libnccl.so.2 -path '*site-packages*' 2>/dev/null | head -1)")
NVRTC=$(dirname "$(find /usr/local/cuda/ -name 'libnvrtc.so.1[23]' 2>/dev/null | head -1)")
export ORTFLOW_CUDA_LIB_DIRS=$G/cuda11:$NCCLDIR CUDA_PATH=/usr/local/cuda
export LD_LIBRARY_PATH=$G/site/lib:$NVRTC
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
mkdir -p $G/extra && tar -C $G/extra -xzf /tmp/gpay/extra.tgz 2>/dev/null || true
export PYTHONPATH=$G/site:$G/extra:$PWD
nvidia-smi -L | tee "$OUT/gpu-tests.log"
git log -1 --format='code: %H %s' 2>/dev/null | tee -a "$OUT/gpu-tests.log"
env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${GPU_TESTS_TIMEOUT:-540}" $PY -m pytest -q -rs -p no:cacheprovider \
  tests/gpu "$@" 2>&1 | tee -a "$OUT/gpu-tests.log"

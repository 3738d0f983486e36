#!/usr/bin/env bash
# The GPU suite (docs/design.md "GPU suite"): ortflow fp32/fp16/bf16 at 1, 2 and 4 GPUs, ZeRO-1, PyTorch at its
# best (eager, compile, DDP, FSDP2), and the real GPT-2/BERT exports trained through the CLI, in 3 interleaved rounds
# under one time budget. Run from the repository root on a host with the GPU engine installed:
#
#   ORTFLOW_PY=/path/to/python3.11 TORCH_PY=python3 bash bench/gpu_suite.sh [extra bench/gpu_suite.py options]
#
# ORTFLOW_PY: the Python with ortflow's GPU environment (onnxruntime-training, CuPy, mpi4py); ORTFLOW_PYTHONPATH: put
# before the repository on its PYTHONPATH; TORCH_PY: a Python with PyTorch for CUDA; MPIEXEC: the MPI launcher;
# BUDGET_S: seconds for the whole suite (default 540); OUT: where gpu-suite.json, gpu-suite.md and logs.tgz go.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off: NCCL's NVLS init fails on some hosts
export PYTHONUNBUFFERED=1
if [ "$(id -u)" = 0 ]; then  # Open MPI refuses root unless told (containers run as root)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
ORTFLOW_PY=${ORTFLOW_PY:-python3}
TORCH_PY=${TORCH_PY:-python3}
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || echo "$(dirname "$ORTFLOW_PY")/mpiexec")}
OUT=${OUT:-bench/out/gpu-suite}
DRIVER_PY=${DRIVER_PY:-$(command -v python3 || echo "$ORTFLOW_PY")}  # the driver needs only the standard library
exec "$DRIVER_PY" bench/gpu_suite.py --out "$OUT" --ortflow-py "$ORTFLOW_PY" --torch-py "$TORCH_PY" \
  --ortflow-pythonpath "${ORTFLOW_PYTHONPATH:-}" --mpiexec "$MPIEXEC" --budget-s "${BUDGET_S:-540}" "$@"

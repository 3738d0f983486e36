#!/usr/bin/env bash
# On the 2-GPU device machine, after shared/gpu/unpack.sh has unpacked the carried environment to /tmp/g:
# GPU tests, the 1-vs-2-rank equivalence run through the real trainer, ortflow 1/2 GPUs vs PyTorch DDP 1/2 GPUs,
# and the all-reduce bandwidth table. Logs and gpu.json land in $OUT (default bench/results/gpu-logs).
set -u
OUT=${OUT:-bench/results/gpu-logs}; mkdir -p "$OUT"
G=/tmp/g; PY=$G/py311/usr/bin/python3.11
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# The machine's own NCCL (from its PyTorch) stands in for the nvidia-nccl wheel; ortflow finds it and the carried
# CUDA 11.8 / cuDNN 8 libraries through ORTFLOW_CUDA_LIB_DIRS, not LD_LIBRARY_PATH.
NCCLDIR=$(dirname "$(find / -name libnccl.so.2 -path '*site-packages*' 2>/dev/null | head -1)")
NVRTC=$(dirname "$(find /usr/local/cuda/ -name 'libnvrtc.so.1[23]' 2>/dev/null | head -1)")
export ORTFLOW_CUDA_LIB_DIRS=$G/cuda11:$NCCLDIR CUDA_PATH=/usr/local/cuda
export LD_LIBRARY_PATH=$G/site/lib:$NVRTC   # mpich's libmpi (pip --target layout) and NVRTC for CuPy's kernels
# pip --target installs the mpich wheel's launcher but not its libmpi, so the ranks use the machine's Open MPI 4.1.6
# (mpi4py 4.1's wheel binds whichever MPI it finds). The engine's pure-Python dependencies that build-payload.sh
# installs --no-deps (flatbuffers, sympy) and pytest ride in the last piece as extra.tgz.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
mkdir -p $G/extra && tar -C $G/extra -xzf /tmp/gpay/extra.tgz 2>/dev/null || true
export PYTHONPATH=$G/site:$G/extra:$PWD
echo "nccl: $NCCLDIR nvrtc: $NVRTC"; nvidia-smi -L
W=/tmp/gb; L=$W/logs; rm -rf $W; mkdir -p $L
# One log per stage in $L (read by the equivalence and report stages), all of them appended to $OUT/all.log.
t() { local name=$1; shift; echo "== $name" | tee -a "$OUT/all.log"; timeout "$@" 2>&1 | tee "$L/$name.log" >> "$OUT/all.log"; tail -8 "$L/$name.log"; }
t doctor 60 $PY -m ortflow.cli doctor
t pytest-gpu 150 env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $PY -m pytest -q -p no:cacheprovider tests/gpu -x
t prepare 120 $PY bench/bench_gpu.py prepare $W
t train-c1 90 mpiexec -n 1 $PY -m ortflow.trainer $W/c1
t train-c2 90 mpiexec -n 2 --tag-output $PY -m ortflow.trainer $W/c2
t equivalence 60 $PY bench/bench_gpu.py equivalence $W/c1 $W/c2 "$L/train-c2.log"
t ortflow1 90 mpiexec -n 1 $PY bench/bench_gpu.py steps $W/t1
t ortflow2 90 mpiexec -n 2 $PY bench/bench_gpu.py steps $W/t2
t ddp1 90 env -u PYTHONPATH -u LD_LIBRARY_PATH python3 -m torch.distributed.run --nproc_per_node=1 bench/bench_gpu.py ddp
t ddp2 90 env -u PYTHONPATH -u LD_LIBRARY_PATH python3 -m torch.distributed.run --nproc_per_node=2 bench/bench_gpu.py ddp
t allreduce 90 mpiexec -n 2 $PY bench/bench_gpu.py allreduce $W/hb
$PY bench/bench_gpu.py report "$L" "$OUT"

# Sourced by the device scripts (bench/device_gpu_tests.sh, bench/device_mixed.sh) after shared/gpu/unpack.sh has
# unpacked the carried environment to /tmp/g (docs/gpu.md): the machine's NCCL and NVRTC, the carried CUDA 11.8 /
# cuDNN 8 libraries, Open MPI as root, NVLink multicast off. Sets G and PY.
G=/tmp/g; PY=$G/py311/usr/bin/python3.11
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
NCCLDIR=$(dirname "$(find / -name libnccl.so.2 -path '*site-packages*' 2>/dev/null | head -1)")
NVRTC=$(dirname "$(find /usr/local/cuda/ -name 'libnvrtc.so.1[23]' 2>/dev/null | head -1)")
export ORTFLOW_CUDA_LIB_DIRS=$G/cuda11:$NCCLDIR CUDA_PATH=/usr/local/cuda
export LD_LIBRARY_PATH=$G/site/lib:$NVRTC
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
mkdir -p $G/extra && tar -C $G/extra -xzf /tmp/gpay/extra.tgz 2>/dev/null || true
export PYTHONPATH=$G/site:$G/extra:$PWD

// Sum of one value per thread over a block of 256 threads, by a fixed tree (the same order on every run and rank).
// Called once per kernel (the result is read after the last barrier; optim/update.cu keeps a variant safe to call
// twice in a row). Prepended to the kernels that reduce (comm/multi_tensor.cu, comm/packed_allreduce.cu) by their
// loaders: NVRTC compiles one source string per module, without include paths.
__device__ double block_sum(double acc) {
    __shared__ double part[256];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    return part[0];
}
// The end of the chunk that starts at ``start`` in a tensor of ``n`` elements (the multi-tensor chunk tables of
// nccl.py: every chunk ``chunk`` elements long but a tensor's last).
__device__ __forceinline__ long long chunk_end(long long start, long long chunk, long long n) {
    return start + chunk < n ? start + chunk : n;
}

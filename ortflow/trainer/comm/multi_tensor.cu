// Multi-tensor kernels launched by nccl.py: one launch for a whole list of tensors, blockIdx.y picks the tensor.
// block_sum (comm/block_sum.cu) is prepended by nccl.py.
extern "C" __global__ void sum_squares(const unsigned long long* ptrs, const long long* counts, double* out) {
    const float* x = (const float*)ptrs[blockIdx.y];
    long long n = counts[blockIdx.y];
    double acc = 0.0;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        double v = x[i];
        acc += v * v;
    }
    // One partial per block, summed in a fixed order by sum_in_order: an atomicAdd here would make the norm (and so
    // the clipping factor) depend on block timing and differ between ranks in the last bits.
    double total = block_sum(acc);
    if (threadIdx.x == 0) out[blockIdx.y * gridDim.x + blockIdx.x] = total;
}
extern "C" __global__ void sum_in_order(const double* parts, long long n, double* out) {
    // One block of 256 threads: each thread sums a fixed strided share, then a fixed tree: the same order every time.
    double acc = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += parts[i];
    double total = block_sum(acc);
    if (threadIdx.x == 0) *out = total;
}
extern "C" __global__ void scale(const unsigned long long* ptrs, const long long* counts, float factor) {
    float* x = (float*)ptrs[blockIdx.y];
    long long n = counts[blockIdx.y];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= factor;
}

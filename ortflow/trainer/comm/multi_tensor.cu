// Multi-tensor kernels launched by nccl.py: one launch for a whole list of tensors (or a bucket of it: the chunks
// first .. first + gridDim.x - 1), cut into chunks of equal size (the last chunk of a tensor shorter): block b handles
// chunk c = first + b, elements [chunk_start[c], chunk_start[c] + chunk) of tensor chunk_tensor[c]. One block per
// chunk, so no block idles on a small tensor, and one partial sum per chunk, at index c.
// block_sum and chunk_end (comm/block_sum.cu) are prepended by nccl.py.
extern "C" __global__ void sum_squares(const unsigned long long* ptrs, const long long* counts, const int* chunk_tensor,
                                       const long long* chunk_start, long long chunk, int first, double* out) {
    const int c = first + blockIdx.x, t = chunk_tensor[c];
    const float* x = (const float*)ptrs[t];
    const long long start = chunk_start[c], end = chunk_end(start, chunk, counts[t]);
    double acc = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        double v = x[i];
        acc += v * v;
    }
    // One partial per chunk, summed in a fixed order by sum_in_order: an atomicAdd here would make the norm (and so
    // the clipping factor) depend on block timing and differ between ranks in the last bits.
    double total = block_sum(acc);
    if (threadIdx.x == 0) out[c] = total;
}
extern "C" __global__ void sum_in_order(const double* parts, long long n, double* out) {
    // One block of 256 threads: each thread sums a fixed strided share, then a fixed tree: the same order every time.
    double acc = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += parts[i];
    double total = block_sum(acc);
    if (threadIdx.x == 0) *out = total;
}
extern "C" __global__ void scale(const unsigned long long* ptrs, const long long* counts, const int* chunk_tensor,
                                 const long long* chunk_start, long long chunk, int first, float factor) {
    const int c = first + blockIdx.x, t = chunk_tensor[c];
    float* x = (float*)ptrs[t];
    const long long start = chunk_start[c], end = chunk_end(start, chunk, counts[t]);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) x[i] *= factor;
}

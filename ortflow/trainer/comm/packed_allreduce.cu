// The packed gradient all-reduce (packed_allreduce.py): pack every fp32 gradient into one fp32/fp16/bf16 buffer,
// NCCL sums it, unpack back into the fp32 buffers. One launch per bucket (the chunks first .. first + gridDim.x - 1),
// one block per chunk of a tensor (multi_tensor.cu's chunk table; block_sum.cu, with chunk_end, is prepended).
// to_half / from_half (comm/half.cu) are prepended too.
#define CHUNK_ARGS const unsigned long long* ptrs, const long long* counts, const int* chunk_tensor, \
                   const long long* chunk_start, long long chunk, int first, const long long* offsets
#define CHUNK_RANGE const int c = first + blockIdx.x, t = chunk_tensor[c]; \
                    const long long start = chunk_start[c], end = chunk_end(start, chunk, counts[t]);
extern "C" __global__ void pack_half(CHUNK_ARGS, unsigned short* flat, float pre, int bf16) {
    CHUNK_RANGE
    const float* x = (const float*)ptrs[t];
    unsigned short* out = flat + offsets[t];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) out[i] = to_half(x[i] * pre, bf16);
}
// Back to fp32 times ``post``, and each block's sum of squares of what it wrote (the gradient norm's partials, in
// the layout of multi_tensor.cu's sum_squares: summed in a fixed order by sum_in_order).
extern "C" __global__ void unpack_half(CHUNK_ARGS, const unsigned short* flat, float post, int bf16,
                                       double* partials) {
    CHUNK_RANGE
    float* x = (float*)ptrs[t];
    const unsigned short* in = flat + offsets[t];
    double acc = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float v = from_half(in[i], bf16) * post;
        x[i] = v;
        acc += (double)v * (double)v;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) partials[c] = total;
}
// float32: the same packing without the type change (one buffer, one NCCL call instead of one per tensor).
extern "C" __global__ void pack_f32(CHUNK_ARGS, float* flat, float pre) {
    CHUNK_RANGE
    const float* x = (const float*)ptrs[t];
    float* out = flat + offsets[t];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) out[i] = x[i] * pre;
}
extern "C" __global__ void unpack_f32(CHUNK_ARGS, const float* flat, float post, double* partials) {
    CHUNK_RANGE
    float* x = (float*)ptrs[t];
    const float* in = flat + offsets[t];
    double acc = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float v = in[i] * post;
        x[i] = v;
        acc += (double)v * (double)v;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) partials[c] = total;
}

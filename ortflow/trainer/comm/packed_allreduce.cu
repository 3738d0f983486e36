// The packed gradient all-reduce (packed_allreduce.py): pack every fp32 gradient into one fp32/fp16/bf16 buffer,
// NCCL sums it, unpack back into the fp32 buffers. One launch for the whole list, one block per chunk of a tensor
// (multi_tensor.cu's chunk table; block_sum.cu, with chunk_end, is prepended).
// No headers (NVRTC finds no cuda_fp16.h on some machines): fp16 through PTX cvt, bf16 by bits.
__device__ __forceinline__ unsigned short to_half(float v, int bf16) {
    if (bf16) {  // round to nearest even, NaN kept a quiet NaN
        unsigned int u = __float_as_uint(v);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (unsigned short)(u >> 16);
    }
    unsigned short h;  // round to nearest even; beyond +-65504 gives +-inf, which the overflow check then sees
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
__device__ __forceinline__ float from_half(unsigned short h, int bf16) {
    if (bf16) return __uint_as_float(((unsigned int)h) << 16);
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(h));
    return v;
}
#define CHUNK_ARGS const unsigned long long* ptrs, const long long* counts, const int* chunk_tensor, \
                   const long long* chunk_start, long long chunk, const long long* offsets
#define CHUNK_RANGE const int t = chunk_tensor[blockIdx.x]; \
                    const long long start = chunk_start[blockIdx.x], end = chunk_end(start, chunk, counts[t]);
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
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
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
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// float32 <-> fp16/bf16 bits for the half-precision gradient exchange (comm/packed_allreduce.cu and ZeRO-1's
// reduce-scatter in optim/update.cu): prepended to those modules' sources by their loaders.
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

// Fused multi-tensor update kernels launched by optim/device.py: one launch updates every tensor of the step
// (blockIdx.y picks the tensor, blocks stride over its elements). Each kernel performs the float32 operations of its
// numpy rule (adamw.py, sgd.py, lamb.py) in the same order with round-to-nearest intrinsics (no FMA contraction), so
// a device update gives the bits of the host update on the same inputs.
// Tables: p, g and the states are device addresses (unsigned long long) per tensor; counts are elements; decay is 0/1.

#define TENSOR_LOOP(n) for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
                            i += (long long)gridDim.x * blockDim.x)

extern "C" __global__ void adamw_torch(const unsigned long long* P, const unsigned long long* G,
                                       const unsigned long long* M, const unsigned long long* V,
                                       const long long* counts, const int* decay, float keep, float c1, float b1,
                                       float c2, float b2, float eps_hat, float step_size) {
    const int t = blockIdx.y;
    float* p = (float*)P[t]; const float* g = (const float*)G[t]; float* m = (float*)M[t]; float* v = (float*)V[t];
    const bool d = decay[t] && keep != 1.0f;
    TENSOR_LOOP(counts[t]) {
        float pi = p[i], gi = g[i];
        if (d) pi = __fmul_rn(pi, keep);
        float mi = __fadd_rn(__fmul_rn(m[i], b1), __fmul_rn(gi, c1));
        float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(gi, gi), c2));
        float u = __fmul_rn(__fdiv_rn(mi, __fadd_rn(__fsqrt_rn(vi), eps_hat)), step_size);
        m[i] = mi; v[i] = vi; p[i] = __fsub_rn(pi, u);
    }
}

// The engine rule's arithmetic (ONNX Runtime adam_mode=1) with an exact square root. Bit-identical to the host
// engine rule only where the engine's own sqrt is exact; see engine_sqrt.py (the CPU engine's is approximate).
extern "C" __global__ void adamw_engine(const unsigned long long* P, const unsigned long long* G,
                                        const unsigned long long* M, const unsigned long long* V,
                                        const long long* counts, const int* decay, float c1, float b1, float c2,
                                        float b2, float eps, float lr_c, float lr_wd) {
    const int t = blockIdx.y;
    float* p = (float*)P[t]; const float* g = (const float*)G[t]; float* m = (float*)M[t]; float* v = (float*)V[t];
    const bool d = decay[t] && lr_wd != 0.0f;
    TENSOR_LOOP(counts[t]) {
        float gi = g[i];
        float mi = __fadd_rn(__fmul_rn(m[i], b1), __fmul_rn(gi, c1));
        float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(gi, c2), gi));
        float pi = __fsub_rn(p[i], __fdiv_rn(__fmul_rn(mi, lr_c), __fadd_rn(__fsqrt_rn(vi), eps)));
        if (d) pi = __fsub_rn(pi, __fmul_rn(pi, lr_wd));
        m[i] = mi; v[i] = vi; p[i] = pi;
    }
}

// SGD; B is the momentum table (ignored when momentum is 0).
extern "C" __global__ void sgd(const unsigned long long* P, const unsigned long long* G, const unsigned long long* B,
                               const long long* counts, const int* decay, float wd, float lr, float mu, float damp,
                               int nesterov, int first, int has_momentum) {
    const int t = blockIdx.y;
    float* p = (float*)P[t]; const float* g = (const float*)G[t];
    float* b = has_momentum ? (float*)B[t] : 0;
    const bool d = decay[t] && wd != 0.0f;
    TENSOR_LOOP(counts[t]) {
        float gi = g[i];
        if (d) gi = __fadd_rn(gi, __fmul_rn(p[i], wd));
        if (has_momentum) {
            float bi = first ? gi : __fadd_rn(__fmul_rn(b[i], mu), __fmul_rn(gi, damp));
            b[i] = bi;
            gi = nesterov ? __fadd_rn(gi, __fmul_rn(bi, mu)) : bi;
        }
        p[i] = __fsub_rn(p[i], __fmul_rn(gi, lr));
    }
}

__device__ double block_sum(double acc) {
    __shared__ double part[256];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    double total = part[0];
    __syncthreads();
    return total;
}

// Lamb phase 1: moments, the direction r written over the gradient, and per-block partial sums of p^2 and r^2
// (partials[(t * gridDim.x + block) * 2 + {0, 1}], summed in a fixed order by sum_pairs).
extern "C" __global__ void lamb_moments(const unsigned long long* P, const unsigned long long* G,
                                        const unsigned long long* M, const unsigned long long* V,
                                        const long long* counts, const int* decay, float c1, float b1, float c2,
                                        float b2, float eps_hat, float scale, float wd, double* partials) {
    const int t = blockIdx.y;
    const float* p = (const float*)P[t]; float* g = (float*)G[t]; float* m = (float*)M[t]; float* v = (float*)V[t];
    const bool d = decay[t] && wd != 0.0f;
    double pp = 0.0, rr = 0.0;
    TENSOR_LOOP(counts[t]) {
        float gi = g[i], pi = p[i];
        float mi = __fadd_rn(__fmul_rn(m[i], b1), __fmul_rn(gi, c1));
        float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(gi, gi), c2));
        float r = __fdiv_rn(mi, __fadd_rn(__fsqrt_rn(vi), eps_hat));
        if (scale != 1.0f) r = __fmul_rn(r, scale);
        if (d) r = __fadd_rn(r, __fmul_rn(pi, wd));
        m[i] = mi; v[i] = vi; g[i] = r;
        pp += (double)pi * pi; rr += (double)r * r;
    }
    double sp = block_sum(pp), sr = block_sum(rr);
    if (threadIdx.x == 0) {
        partials[(t * gridDim.x + blockIdx.x) * 2] = sp;
        partials[(t * gridDim.x + blockIdx.x) * 2 + 1] = sr;
    }
}

// One block per tensor: its partial sums in a fixed order -> sums[t] (p^2) and sums[T + t] (r^2).
extern "C" __global__ void sum_pairs(const double* partials, int blocks, int num_tensors, const int* index,
                                     double* sums) {
    const int t = blockIdx.x;
    double sp = 0.0, sr = 0.0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
        sp += partials[(t * blocks + b) * 2];
        sr += partials[(t * blocks + b) * 2 + 1];
    }
    sp = block_sum(sp); sr = block_sum(sr);
    if (threadIdx.x == 0) { sums[index[t]] = sp; sums[num_tensors + index[t]] = sr; }
}

// Lamb phase 2: p -= (lr * trust ratio of the tensor) * r, the factor computed on the host per tensor.
extern "C" __global__ void lamb_apply(const unsigned long long* P, const unsigned long long* G,
                                      const long long* counts, const float* factor) {
    const int t = blockIdx.y;
    float* p = (float*)P[t]; const float* r = (const float*)G[t];
    const float f = factor[t];
    TENSOR_LOOP(counts[t]) p[i] = __fsub_rn(p[i], __fmul_rn(r[i], f));
}

// ZeRO-1's packs over a chunk table (comm/nccl.py TensorTable): block b copies chunk first + b, the elements
// [chunk_start[c], chunk_start[c] + chunk) of tensor chunk_tensor[c], to or from offsets[t] of the flat buffer. One
// block per chunk, so no block idles on a small tensor (a grid sized by the largest tensor left most blocks idle).
#define CHUNK_ARGS const unsigned long long* ptrs, const long long* counts, const int* chunk_tensor, \
                   const long long* chunk_start, long long chunk, int first, const long long* offsets
#define CHUNK_LOOP const int c = first + blockIdx.x, t = chunk_tensor[c]; \
                   const long long start = chunk_start[c], end = start + chunk < counts[t] ? start + chunk : counts[t]; \
                   for (long long i = start + threadIdx.x; i < end; i += blockDim.x)
// Direction 0: tensors -> flat; 1: flat -> tensors.
extern "C" __global__ void pack(CHUNK_ARGS, float* flat, int to_tensors) {
    float* x = (float*)ptrs[chunk_tensor[first + blockIdx.x]];
    float* f = flat + offsets[chunk_tensor[first + blockIdx.x]];
    CHUNK_LOOP {
        if (to_tensors) x[i] = f[i]; else f[i] = x[i];
    }
}

// ZeRO-1: the shard times factor, with per-block partial sums of squares (summed in a fixed order afterwards).
extern "C" __global__ void scale_square(float* x, long long n, float factor, double* partials) {
    double acc = 0.0;
    TENSOR_LOOP(n) {
        float y = __fmul_rn(x[i], factor);
        x[i] = y;
        acc += (double)y * y;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// ZeRO-1 with a half-precision reduce-scatter (distributed.allreduce_dtype float16/bfloat16): every gradient times
// pre (1 / ranks) into its place of the fp16/bf16 flat buffer (to_half: comm/half.cu, prepended by device.py) ...
extern "C" __global__ void pack_half(CHUNK_ARGS, unsigned short* flat, float pre, int bf16) {
    const float* x = (const float*)ptrs[chunk_tensor[first + blockIdx.x]];
    unsigned short* f = flat + offsets[chunk_tensor[first + blockIdx.x]];
    CHUNK_LOOP f[i] = to_half(__fmul_rn(x[i], pre), bf16);
}
// ... and the reduced shard back to float32 times factor, with per-block partial sums of squares (as scale_square).
extern "C" __global__ void widen_square(const unsigned short* h, float* x, long long n, float factor, int bf16,
                                        double* partials) {
    double acc = 0.0;
    TENSOR_LOOP(n) {
        float y = __fmul_rn(from_half(h[i], bf16), factor);
        x[i] = y;
        acc += (double)y * y;
    }
    double total = block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

extern "C" __global__ void sum_in_order(const double* parts, long long n, double* out) {
    double acc = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += parts[i];
    double total = block_sum(acc);
    if (threadIdx.x == 0) *out = total;
}

extern "C" __global__ void scale(float* x, long long n, float factor) {
    TENSOR_LOOP(n) x[i] = __fmul_rn(x[i], factor);
}

// norm.cu -- RMSNorm and LayerNorm over the last dimension (reference §3.1, §3.4; NumpyBackend.rms_norm /
// layer_norm). fp32 throughout; IEEE division and sqrt, no fused multiply-add where numpy rounds twice.
#include "coli_common.cuh"

// rmsnorm(x, w, y, D, eps): y[r, :] = w * (x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)))
//   x, y [R, D] fp32 (y may alias x), w [D].  grid R, block NORM_THREADS.
//   A decode row is one block, so the row's latency is the kernel's: every thread issues all its loads (the row's
//   and the weight's) before it uses any, and where the row fits one round (D <= NORM_U * NORM_THREADS = 8,192:
//   every GLM-5 norm) the values stay in registers for the second pass -- one round trip to memory, one block sum,
//   the stores. 256 threads x 24 values in two rounds, the row re-read for the second pass, took ~9 us (event-timed)
//   for D = 6,144 on the H200. The sum runs in the order of a plain loop over each thread's elements (thread t:
//   t, t + NORM_THREADS, ... in turn), so rmsnorm, add_rmsnorm and norms3 give the same bits.
#define NORM_U 8
#define NORM_THREADS 1024

// One row's RMSNorm: the body of rmsnorm, add_rmsnorm and norms3, so the three give the same bits. ADD: the row
// is a + b, or a + (b + c) where c is given (each fp32 add rounded as the add kernel rounds it, in that order), stored
// to h before it is normed; else the row is a (b, c, h unused). Each thread reads back only the elements it wrote to
// h, so the second pass needs no extra barrier.
template <bool ADD>
__device__ __forceinline__ void rms_row(const float *a, const float *b, const float *c, float *h, const float *w,
                                        float *y, int D, float eps, float *red) {
    const int B = blockDim.x;
    const bool one_round = D <= NORM_U * B;    // the row in registers across the block sum
    float v[NORM_U], g[NORM_U];
    float ss = 0.f;
    for (int i0 = threadIdx.x; i0 < D; i0 += NORM_U * B) {
#pragma unroll
        for (int u = 0; u < NORM_U; u++) {
            const int i = i0 + u * B;
            v[u] = i < D ? (ADD ? __fadd_rn(a[i], c ? __fadd_rn(b[i], c[i]) : b[i]) : a[i]) : 0.f;
            if (one_round) g[u] = i < D ? w[i] : 0.f;
        }
        if (ADD) {
#pragma unroll
            for (int u = 0; u < NORM_U; u++)
                if (i0 + u * B < D) h[i0 + u * B] = v[u];
        }
#pragma unroll
        for (int u = 0; u < NORM_U; u++)
            if (i0 + u * B < D) ss = fmaf(v[u], v[u], ss);
    }
    ss = block_sum(ss, red);
    const float inv = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D), eps)));
    if (one_round) {
        const int i0 = threadIdx.x;
#pragma unroll
        for (int u = 0; u < NORM_U; u++)
            if (i0 + u * B < D) y[i0 + u * B] = __fmul_rn(g[u], __fmul_rn(v[u], inv));
        return;
    }
    const float *x = ADD ? h : a;
    for (int i0 = threadIdx.x; i0 < D; i0 += NORM_U * B) {
#pragma unroll
        for (int u = 0; u < NORM_U; u++) {
            const int i = i0 + u * B;
            v[u] = i < D ? x[i] : 0.f;
            g[u] = i < D ? w[i] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < NORM_U; u++)
            if (i0 + u * B < D) y[i0 + u * B] = __fmul_rn(g[u], __fmul_rn(v[u], inv));
    }
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm(const float *x, const float *w, float *y, int D,
                                                                   float eps) {
    COLI_PDL_ENTRY();
    __shared__ float red[32];
    const long long r = (long long)blockIdx.x * D;
    rms_row<false>(x + r, nullptr, nullptr, nullptr, w, y + r, D, eps, red);
}

// add_rmsnorm(a, b, c, w, h, y, D, eps): h = a + b, or a + (b + c) with c non-null (the residual add of a MoE layer's
//   routed and shared sums), y = rmsnorm(h, w) -- one launch for the forward's add(s) followed by the next RMSNorm
//   (Backend.add_rms_norm), the same bits as add (add) then rmsnorm.
//   a, b, c, h, y [R, D] fp32 (h, y distinct from the inputs and from each other), w [D].
//   grid R, block NORM_THREADS.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rmsnorm(const float *a, const float *b, const float *c,
                                                                       const float *w, float *h, float *y, int D,
                                                                       float eps) {
    COLI_PDL_ENTRY();
    __shared__ float red[32];
    const long long r = (long long)blockIdx.x * D;
    rms_row<true>(a + r, b + r, c ? c + r : nullptr, h + r, w, y + r, D, eps, red);
}

// One row's LayerNorm: the body of layernorm and norms3, so the two give the same bits.
__device__ __forceinline__ void ln_row(const float *xr, const float *w, const float *b, float *yr, int D, float eps,
                                       float *red) {
    float s = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) s += xr[i];
    const float mu = __fdiv_rn(block_sum(s, red), (float)D);
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float c = __fsub_rn(xr[i], mu);
        ss = fmaf(c, c, ss);
    }
    const float sd = __fsqrt_rn(__fadd_rn(__fdiv_rn(block_sum(ss, red), (float)D), eps));
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        yr[i] = __fadd_rn(__fmul_rn(__fdiv_rn(__fsub_rn(xr[i], mu), sd), w[i]), b[i]);
}

// layernorm(x, w, b, y, D, eps): xc = x - mean(x); y = xc / sqrt(mean(xc^2) + eps) * w + b
//   x, y [R, D] fp32 (y may alias x), w, b [D].  grid R, block NORM_THREADS.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) layernorm(const float *x, const float *w, const float *b,
                                                                     float *y, int D, float eps) {
    COLI_PDL_ENTRY();
    __shared__ float red[32];
    const long long r = (long long)blockIdx.x * D;
    ln_row(x + r, w, b, y + r, D, eps, red);
}

// norms3(x0, w0, y0, D0, x1, w1, y1, D1, eps, x2, w2, b2, y2, D2, eps2): the norms of an attention's first
//   projections in one launch (Backend.norm_many): rmsnorm of x0 and x1 (the q_a and kv_a latents, eps), and with
//   gridDim.y = 3 the layernorm of x2 (the indexer key, w2, b2, eps2); each tensor R rows, blockIdx.y picks it.
//   grid (R, 2 or 3), block NORM_THREADS.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) norms3(const float *x0, const float *w0, float *y0, int D0,
                                                                  const float *x1, const float *w1, float *y1, int D1,
                                                                  float eps, const float *x2, const float *w2,
                                                                  const float *b2, float *y2, int D2, float eps2) {
    COLI_PDL_ENTRY();
    __shared__ float red[32];
    const int k = blockIdx.y;
    if (k == 2) {
        const long long r = (long long)blockIdx.x * D2;
        ln_row(x2 + r, w2, b2, y2 + r, D2, eps2, red);
        return;
    }
    const int D = k == 1 ? D1 : D0;
    const long long r = (long long)blockIdx.x * D;
    rms_row<false>((k == 1 ? x1 : x0) + r, nullptr, nullptr, nullptr, k == 1 ? w1 : w0, (k == 1 ? y1 : y0) + r, D, eps,
                   red);
}

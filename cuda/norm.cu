// norm.cu -- RMSNorm and LayerNorm over the last dimension (reference §3.1, §3.4; NumpyBackend.rms_norm /
// layer_norm). fp32 throughout; IEEE division and sqrt, no fused multiply-add where numpy rounds twice.
#include "coli_common.cuh"

// rmsnorm(x, w, y, D, eps): y[r, :] = w * (x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)))
//   x, y [R, D] fp32 (y may alias x), w [D].  grid R, block 256.
extern "C" __global__ void rmsnorm(const float *x, const float *w, float *y, int D, float eps) {
    __shared__ float red[32];
    const float *xr = x + (long long)blockIdx.x * D;
    float *yr = y + (long long)blockIdx.x * D;
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    const float inv = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D), eps)));
    for (int i = threadIdx.x; i < D; i += blockDim.x) yr[i] = __fmul_rn(w[i], __fmul_rn(xr[i], inv));
}

// layernorm(x, w, b, y, D, eps): xc = x - mean(x); y = xc / sqrt(mean(xc^2) + eps) * w + b
//   x, y [R, D] fp32 (y may alias x), w, b [D].  grid R, block 256.
extern "C" __global__ void layernorm(const float *x, const float *w, const float *b, float *y, int D, float eps) {
    __shared__ float red[32];
    const float *xr = x + (long long)blockIdx.x * D;
    float *yr = y + (long long)blockIdx.x * D;
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

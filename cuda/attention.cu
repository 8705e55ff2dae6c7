// attention.cu -- absorbed MLA attention over the compressed cache (reference §3.3, NumpyBackend.mla_attend).
//
// The host computes q_abs = q_nope @ w_kb per head (gemm_nn) before, and o = ctx @ w_vb.T per head
// (gemm_nt) after; this kernel does the part in between, for every query row s and head h:
//
//   score[t] = (q_abs[s,h] . lat[t] + q_pe[s,h] . k_pe[t]) * scale      for the keys t row s may see
//   ctx[s,h] = sum_t softmax(score)[t] * lat[t]                          (fp32 softmax)
//
// Keys of row s: with idx == NULL, t = 0 .. start+s (dense causal: the indexer selected everything);
// otherwise the cnt[s] keys idx[s*kmax + j], j < cnt[s] (the indexer's top-k, ascending).
//
// mla_attend_<NJ>(qa, q, dq, pe_off, lat, kpe, idx, cnt, kmax, start, nh, Lkv, dr, scale, ctx)
//   qa [S, nh, Lkv], q [S, nh, dq] whose rope part is q[..., pe_off : pe_off+dr], lat [T, Lkv], kpe [T, dr],
//   ctx [S, nh, Lkv]; Lkv <= 32*NJ (NJ in 1,2,4,8,16), dr <= 64.
//   grid (nh, S), block 256 (8 warps), dynamic smem = 8 * Lkv * 4 bytes.
//   Each warp takes every 8th key with an online softmax (lane holds NJ latent dims); the 8 partial
//   (max, sum, ctx) are merged at the end. One pass over the selected keys, no score buffer.
#include "coli_common.cuh"

template <int NJ>
__device__ void mla_attend_body(const float *qa, const float *q, int dq, int pe_off, const float *lat,
                                const float *kpe, const int *idx, const int *cnt, int kmax, int start, int nh,
                                int Lkv, int dr, float scale, float *ctx) {
    extern __shared__ float sc[];                // [nwarps][Lkv]
    __shared__ float sm[32], sl[32];
    const int h = blockIdx.x, s = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float *qa_r = qa + ((long long)s * nh + h) * Lkv;
    const float *qp_r = q + ((long long)s * nh + h) * dq + pe_off;
    float qv[NJ], cv[NJ], qp[2];
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int d = lane + 32 * j;
        qv[j] = d < Lkv ? qa_r[d] : 0.f;
        cv[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < 2; j++) qp[j] = lane + 32 * j < dr ? qp_r[lane + 32 * j] : 0.f;
    const int n = idx ? cnt[s] : start + s + 1;
    float m = -INFINITY, l = 0.f;
    for (int jj = warp; jj < n; jj += nw) {
        const int t = idx ? idx[(long long)s * kmax + jj] : jj;
        const float *lr = lat + (long long)t * Lkv;
        const float *pr = kpe + (long long)t * dr;
        float lv[NJ];
        float d1 = 0.f, d2 = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            int d = lane + 32 * j;
            lv[j] = d < Lkv ? lr[d] : 0.f;
            d1 = fmaf(qv[j], lv[j], d1);
        }
#pragma unroll
        for (int j = 0; j < 2; j++)
            if (lane + 32 * j < dr) d2 = fmaf(qp[j], pr[lane + 32 * j], d2);
        const float score = __fmul_rn(__fadd_rn(warp_sum(d1), warp_sum(d2)), scale);
        const float mn = fmaxf(m, score);
        const float corr = expf(m - mn);           // 0 on the first key (m = -inf)
        const float p = expf(score - mn);
        l = fmaf(l, corr, p);
#pragma unroll
        for (int j = 0; j < NJ; j++) cv[j] = fmaf(cv[j], corr, p * lv[j]);
        m = mn;
    }
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int d = lane + 32 * j;
        if (d < Lkv) sc[warp * Lkv + d] = cv[j];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < nw; w++) M = fmaxf(M, sm[w]);
    float L = 0.f;
    for (int w = 0; w < nw; w++)
        if (sm[w] != -INFINITY) L = fmaf(sl[w], expf(sm[w] - M), L);
    float *out = ctx + ((long long)s * nh + h) * Lkv;
    for (int d = threadIdx.x; d < Lkv; d += blockDim.x) {
        float c = 0.f;
        for (int w = 0; w < nw; w++)
            if (sm[w] != -INFINITY) c = fmaf(sc[w * Lkv + d], expf(sm[w] - M), c);
        out[d] = __fdiv_rn(c, L);
    }
}

#define MLA_KERNEL(NJ)                                                                                        \
    extern "C" __global__ void mla_attend_##NJ(const float *qa, const float *q, int dq, int pe_off,           \
                                               const float *lat, const float *kpe, const int *idx,            \
                                               const int *cnt, int kmax, int start, int nh, int Lkv, int dr,  \
                                               float scale, float *ctx) {                                     \
        mla_attend_body<NJ>(qa, q, dq, pe_off, lat, kpe, idx, cnt, kmax, start, nh, Lkv, dr, scale, ctx);     \
    }
MLA_KERNEL(1)
MLA_KERNEL(2)
MLA_KERNEL(4)
MLA_KERNEL(8)
MLA_KERNEL(16)

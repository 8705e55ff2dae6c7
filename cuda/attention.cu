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

// ==== split over the context (flash-decoding): mla_attend_part_<NJ> + mla_attend_combine ======================
// The kernel above gives a decode step (S = 1) only nh blocks, each walking its whole context: at GLM-5's
// shape (64 heads, 2,048 keys) 64 of 132 SMs and ~256 dependent key steps per warp. Here the selected keys of
// row s are cut into chunks of `chunk` positions; block (c, g, s) takes chunk c for ATT_HPB heads at once, so
// the grid is (nchunk, ceil(nh / ATT_HPB), S) and every key's latent row is read from L2 once per head group
// (into shared memory, ATT_TK keys at a time) instead of once per head. Each block leaves per head its
// partial (max m, sum l of exp(score - m), ctx = sum exp(score - m) * lat) and mla_attend_combine merges the
// chunks: M = max m_c, L = sum l_c e^(m_c - M), ctx = sum ctx_c e^(m_c - M) / L. fp32 throughout.
//
// Keys of row s (the first n_s of them, in order): as above, but with T_dev != NULL the dense case reads the
// cache length from device memory (start = *T_dev - S), so a captured CUDA graph replays for every T up to
// the capacity its grid was sized for; blocks whose chunk starts at or past n_s return at once and the
// combine reads only the ceil(n_s / chunk) chunks that exist.
//
// mla_attend_part_<NJ>(qa, q, dq, pe_off, lat, kpe, idx, cnt, kmax, start, T_dev, S, nh, Lkv, dr, scale, chunk,
//                      nchunk, pm, pl, pc)
//   shapes as mla_attend_<NJ>; Lkv % 4 == 0, dr % 4 == 0, dr <= 64, lat/kpe 16-byte aligned; chunk % ATT_TK == 0;
//   pm, pl [S, nh, nchunk], pc [S, nh, nchunk, Lkv]. pm == NULL (nchunk == 1): no combine, the block writes the
//   normalised ctx [S, nh, Lkv] into pc itself.
//   grid (nchunk, ceil(nh / ATT_HPB), S), block 32 * ATT_WARPS, dynamic smem = ATT_TK * (Lkv + dr) * 4 bytes.
//   Warp w takes heads g * ATT_HPB + ATT_HPW * w + i (i < ATT_HPW): a lane holds NJ latent dims and 2 rope dims
//   of each one's query, so one shared-memory read of a key's value serves ATT_HPW heads; per tile every lane
//   forms its partial dots for ATT_TK keys x ATT_HPW heads, the warp sums them, and the online softmax takes
//   the tile at once (one rescale per tile, not per key).
// mla_attend_combine(pm, pl, pc, idx, cnt, start, T_dev, S, nh, Lkv, chunk, nchunk, ctx)
//   grid (nh, S), block 128; ctx [S, nh, Lkv].
#define ATT_TK 16
#define ATT_HPW 2
#define ATT_WARPS 8
#define ATT_HPB (ATT_HPW * ATT_WARPS)
#define ATT_RPW (ATT_TK / ATT_WARPS)   // rows of a tile each warp stages

__device__ inline int attend_keys(const int *idx, const int *cnt, int start, const int *T_dev, int S, int s) {
    if (idx) return cnt[s];
    return (T_dev ? *T_dev - S : start) + s + 1;
}

template <int NJ, bool PIPE>
__device__ void mla_part_body(const float *qa, const float *q, int dq, int pe_off, const float *lat,
                              const float *kpe, const int *idx, const int *cnt, int kmax, int start,
                              const int *T_dev, int S, int nh, int Lkv, int dr, float scale, int chunk,
                              int nchunk, float *pm, float *pl, float *pc) {
    extern __shared__ float4 att_sh4[];
    float *lt = reinterpret_cast<float *>(att_sh4);          // [ATT_TK][Lkv]
    float *pt = lt + ATT_TK * Lkv;                             // [ATT_TK][dr]
    __shared__ int keys[ATT_TK];
    const int c = blockIdx.x, s = blockIdx.z;
    const int n = attend_keys(idx, cnt, start, T_dev, S, s);
    const int lo = c * chunk;
    if (lo >= n) return;                                      // uniform over the block
    const int hi = min(lo + chunk, n);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h0 = blockIdx.y * ATT_HPB + warp * ATT_HPW;
    float qv[ATT_HPW][NJ], qp[ATT_HPW][2], cv[ATT_HPW][NJ], m[ATT_HPW], l[ATT_HPW];
#pragma unroll
    for (int i = 0; i < ATT_HPW; i++) {
        const int h = h0 + i;
        const bool on = h < nh;
        const float *qa_r = qa + ((long long)s * nh + (on ? h : 0)) * Lkv;
        const float *qp_r = q + ((long long)s * nh + (on ? h : 0)) * dq + pe_off;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int d = lane + 32 * j;
            qv[i][j] = on && d < Lkv ? qa_r[d] : 0.f;
            cv[i][j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < 2; j++) qp[i][j] = on && lane + 32 * j < dr ? qp_r[lane + 32 * j] : 0.f;
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    const int l4 = Lkv >> 2, r4 = dr >> 2;
    const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int t0 = lo; t0 < hi; t0 += ATT_TK) {
        const int nt = min(ATT_TK, hi - t0);
        if (PIPE) {
            // Warp w stages keys w + ATT_WARPS k (k < ATT_RPW): every 16-byte load of its rows is issued into
            // registers first -- before the barrier, while other warps finish the previous tile -- so a tile costs
            // one memory round trip, not one per loop step; then the next tile's rows are prefetched into L2.
            constexpr int U4 = (NJ + 3) / 4;                  // float4s of a latent row per lane (Lkv <= 32 NJ)
            int tk[ATT_RPW];
            float4 lv[ATT_RPW][U4], pv[ATT_RPW];
#pragma unroll
            for (int k = 0; k < ATT_RPW; k++) {
                const int r = warp + ATT_WARPS * k, jj = t0 + r;
                tk[k] = r < nt ? (idx ? __ldg(idx + (long long)s * kmax + jj) : jj) : -1;
            }
#pragma unroll
            for (int k = 0; k < ATT_RPW; k++) {
                const float4 *ls = reinterpret_cast<const float4 *>(lat + (long long)max(tk[k], 0) * Lkv);
                const float4 *ps = reinterpret_cast<const float4 *>(kpe + (long long)max(tk[k], 0) * dr);
#pragma unroll
                for (int u = 0; u < U4; u++) {
                    const int i = lane + 32 * u;
                    lv[k][u] = tk[k] >= 0 && i < l4 ? __ldg(ls + i) : z4;
                }
                pv[k] = tk[k] >= 0 && lane < r4 ? __ldg(ps + lane) : z4;
            }
            __syncthreads();                                  // the previous tile is consumed
#pragma unroll
            for (int k = 0; k < ATT_RPW; k++) {
                const int r = warp + ATT_WARPS * k;
                float4 *ld = reinterpret_cast<float4 *>(lt + r * Lkv);
#pragma unroll
                for (int u = 0; u < U4; u++)
                    if (lane + 32 * u < l4) ld[lane + 32 * u] = lv[k][u];
                if (lane < r4) reinterpret_cast<float4 *>(pt + r * dr)[lane] = pv[k];
            }
            if (lane == 0) {
#pragma unroll
                for (int k = 0; k < ATT_RPW; k++) {
                    const int jj = t0 + ATT_TK + warp + ATT_WARPS * k;
                    if (jj < hi) {
                        const int tn = idx ? __ldg(idx + (long long)s * kmax + jj) : jj;
                        l2_prefetch(reinterpret_cast<const u8 *>(lat + (long long)tn * Lkv), 4 * Lkv);
                        l2_prefetch(reinterpret_cast<const u8 *>(kpe + (long long)tn * dr), 4 * dr);
                    }
                }
            }
            __syncthreads();
        } else {
            __syncthreads();                                  // the previous tile is consumed
            if (threadIdx.x < ATT_TK) {
                const int jj = t0 + threadIdx.x;
                keys[threadIdx.x] = (int)threadIdx.x < nt ? (idx ? idx[(long long)s * kmax + jj] : jj) : -1;
            }
            __syncthreads();
            // stage the tile: warp w copies keys w, w + ATT_WARPS, ... (16-byte loads; absent keys are zeros)
            for (int r = warp; r < ATT_TK; r += ATT_WARPS) {
                const int t = keys[r];
                const float4 *ls = reinterpret_cast<const float4 *>(lat + (long long)(t < 0 ? 0 : t) * Lkv);
                const float4 *ps = reinterpret_cast<const float4 *>(kpe + (long long)(t < 0 ? 0 : t) * dr);
                float4 *ld = reinterpret_cast<float4 *>(lt + r * Lkv);
                float4 *pd = reinterpret_cast<float4 *>(pt + r * dr);
                for (int i = lane; i < l4; i += 32) ld[i] = t >= 0 ? ls[i] : z4;
                for (int i = lane; i < r4; i += 32) pd[i] = t >= 0 ? ps[i] : z4;
            }
            __syncthreads();
        }
        float sc[ATT_HPW][ATT_TK];                            // scores, then probabilities
#pragma unroll
        for (int r = 0; r < ATT_TK; r++) {
            float a[ATT_HPW];
#pragma unroll
            for (int i = 0; i < ATT_HPW; i++) a[i] = 0.f;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int d = lane + 32 * j;
                const float v = d < Lkv ? lt[r * Lkv + d] : 0.f;
#pragma unroll
                for (int i = 0; i < ATT_HPW; i++) a[i] = fmaf(qv[i][j], v, a[i]);
            }
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int d = lane + 32 * j;
                const float v = d < dr ? pt[r * dr + d] : 0.f;
#pragma unroll
                for (int i = 0; i < ATT_HPW; i++) a[i] = fmaf(qp[i][j], v, a[i]);
            }
#pragma unroll
            for (int i = 0; i < ATT_HPW; i++) sc[i][r] = a[i];
        }
#pragma unroll
        for (int i = 0; i < ATT_HPW; i++) {
            float mt = -INFINITY;
#pragma unroll
            for (int r = 0; r < ATT_TK; r++) {
                sc[i][r] = r < nt ? __fmul_rn(warp_sum(sc[i][r]), scale) : -INFINITY;
                mt = fmaxf(mt, sc[i][r]);
            }
            const float mn = fmaxf(m[i], mt);                 // finite: the tile has >= 1 key
            const float corr = expf(m[i] - mn);               // 0 on the first tile (m = -inf)
            float ps = 0.f;
#pragma unroll
            for (int r = 0; r < ATT_TK; r++) {
                sc[i][r] = expf(sc[i][r] - mn);               // 0 for absent keys
                ps += sc[i][r];
            }
            l[i] = fmaf(l[i], corr, ps);
            m[i] = mn;
#pragma unroll
            for (int j = 0; j < NJ; j++) cv[i][j] *= corr;
        }
#pragma unroll
        for (int r = 0; r < ATT_TK; r++) {
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int d = lane + 32 * j;
                const float v = d < Lkv ? lt[r * Lkv + d] : 0.f;
#pragma unroll
                for (int i = 0; i < ATT_HPW; i++) cv[i][j] = fmaf(sc[i][r], v, cv[i][j]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ATT_HPW; i++) {
        const int h = h0 + i;
        if (h >= nh) continue;
        const long long p = ((long long)s * nh + h) * nchunk + c;
        float *out = pc + p * Lkv;
        if (pm) {
            if (lane == 0) { pm[p] = m[i]; pl[p] = l[i]; }
#pragma unroll
            for (int j = 0; j < NJ; j++)
                if (lane + 32 * j < Lkv) out[lane + 32 * j] = cv[i][j];
        } else {
#pragma unroll
            for (int j = 0; j < NJ; j++)
                if (lane + 32 * j < Lkv) out[lane + 32 * j] = __fdiv_rn(cv[i][j], l[i]);
        }
    }
}

#define MLA_PART_KERNEL(NAME, NJ, PIPE)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) NAME##_##NJ(                                 \
        const float *qa, const float *q, int dq, int pe_off, const float *lat, const float *kpe,              \
        const int *idx, const int *cnt, int kmax, int start, const int *T_dev, int S, int nh, int Lkv,        \
        int dr, float scale, int chunk, int nchunk, float *pm, float *pl, float *pc) {                        \
        mla_part_body<NJ, PIPE>(qa, q, dq, pe_off, lat, kpe, idx, cnt, kmax, start, T_dev, S, nh, Lkv, dr,    \
                                scale, chunk, nchunk, pm, pl, pc);                                            \
    }
// mla_attend_part_<NJ>: the staging with every load of a tile in flight at once and the next tile prefetched into L2;
// mla_attend_part1_<NJ>: the first split version (a loop of load-then-store steps per tile: ~10 dependent memory
// round trips per tile, ~9 us per tile on the H200), kept for the benchmark's comparison (COLI_ATTN_KERNELS=split1).
MLA_PART_KERNEL(mla_attend_part, 1, true)
MLA_PART_KERNEL(mla_attend_part, 2, true)
MLA_PART_KERNEL(mla_attend_part, 4, true)
MLA_PART_KERNEL(mla_attend_part, 8, true)
MLA_PART_KERNEL(mla_attend_part, 16, true)
MLA_PART_KERNEL(mla_attend_part1, 1, false)
MLA_PART_KERNEL(mla_attend_part1, 2, false)
MLA_PART_KERNEL(mla_attend_part1, 4, false)
MLA_PART_KERNEL(mla_attend_part1, 8, false)
MLA_PART_KERNEL(mla_attend_part1, 16, false)

extern "C" __global__ void mla_attend_combine(const float *pm, const float *pl, const float *pc, const int *idx,
                                              const int *cnt, int start, const int *T_dev, int S, int nh, int Lkv,
                                              int chunk, int nchunk, float *ctx) {
    const int h = blockIdx.x, s = blockIdx.y;
    const int n = attend_keys(idx, cnt, start, T_dev, S, s);
    const int nc = min(nchunk, (n + chunk - 1) / chunk);
    const long long p0 = ((long long)s * nh + h) * nchunk;
    float M = -INFINITY;
    for (int c = 0; c < nc; c++) M = fmaxf(M, pm[p0 + c]);
    float L = 0.f;
    for (int c = 0; c < nc; c++) L = fmaf(pl[p0 + c], expf(pm[p0 + c] - M), L);
    float *out = ctx + ((long long)s * nh + h) * Lkv;
    for (int d = threadIdx.x; d < Lkv; d += blockDim.x) {
        float a = 0.f;
        for (int c = 0; c < nc; c++) a = fmaf(pc[(p0 + c) * Lkv + d], expf(pm[p0 + c] - M), a);
        out[d] = __fdiv_rn(a, L);
    }
}

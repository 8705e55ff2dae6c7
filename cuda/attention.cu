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
        COLI_PDL_ENTRY();                                                                                     \
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
        COLI_PDL_ENTRY();                                                                                     \
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
    COLI_PDL_ENTRY();
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

// ==== the context as two small GEMMs per tile: mla_attend_tile<NBUF> + mla_attend_combine4 =====================
// mla_attend_part_<NJ> keeps one warp per 2 heads: every key costs each warp 2 x 16 dependent shuffle-sums and 34
// shared-memory reads for ~70 FMAs, ~8 us per 16-key tile on the H200. Absorbed MLA makes the context two
// GEMM-like products shared by the heads of a block -- scores [HB x TK] = Q [HB x D] . K [D x TK] (D = Lkv + dr),
// then ctx [HB x Lkv] += P [HB x TK] . V [TK x Lkv] -- so here every thread owns a register tile of outputs:
//   scores: the D columns are split over AT2_KS half-warps (float4 column f goes to slice f % AT2_KS); a lane owns
//           4 heads x 4 keys (heads hq + 4i, keys kq + 4j: 8 16-byte reads per 64 FMAs), the slices' partial dots
//           meet in shared memory and thread (h, t) sums them: no shuffle reductions over the dot;
//   softmax: thread (h, t) holds one score; the tile's max and sum over a head's 16 keys are 4 shuffle steps of a
//           half-warp; one rescale factor per head and tile (as the part kernel);
//   context: thread (hh, d4) owns 8 heads x 4 latent dims (32 accumulators): per key one 16-byte read of the latent
//           row and two broadcast reads of the 8 probabilities, 32 FMAs.
// The tiles are staged with cp.async (sm_80+), zero-filled past the chunk's keys. NBUF = 2: the next tile's copy is
// in flight while the block computes this one (129 KB of shared memory at GLM-5's shape: one block per SM);
// NBUF = 1: one buffer (92 KB), two blocks per SM overlap each other's copies instead. Same grid, partials,
// key selection (idx/cnt, T_dev) and arguments as mla_attend_part_<NJ>; the same online softmax per tile of
// AT2_TK = ATT_TK keys, so the chunks (attention_split.split_chunks) and the combine are the same.
//   Lkv % 4 == 0, dr % 4 == 0, Lkv <= 4 * 128, lat/kpe 16-byte aligned; grid (nchunk, ceil(nh / AT2_HB), S),
//   block AT2_THREADS, dynamic smem = at2_smem_floats(Lkv + dr, NBUF) * 4 bytes (attention_split.tile_smem_bytes).
// mla_attend_combine4: mla_attend_combine with a thread per 4 latent dims (16-byte reads of the partials, the
//   chunk loop unrolled so several are in flight); grid (nh, S), block 128, Lkv <= 512.
#define AT2_TK 16        // keys per tile
#define AT2_HB 16        // heads per block
#define AT2_KS 16        // slices of the score dot (one half-warp each)
#define AT2_THREADS 256

__device__ inline int at2_row_stride(int D) { return ((D + 31) & ~31) + 4; }   // rows 16 bytes apart in the banks

__device__ inline void at2_cp16(float *dst, const float *src, bool on) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa), "l"(src), "r"(on ? 16 : 0));
}

__device__ inline void at2_cp4(float *dst, const float *src, bool on) {   // any 4-byte aligned float; off: 0
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(sa), "l"(src), "r"(on ? 4 : 0));
}

// Pieces of a tile each thread stages: D <= 576 (Lkv <= 512, dr <= 64) is at most 144 float4s per key.
#define AT2_MAXE ((AT2_TK * 144 + AT2_THREADS - 1) / AT2_THREADS)

__device__ inline void fma4(float4 &c, float p, const float4 &v) {
    c.x = fmaf(p, v.x, c.x); c.y = fmaf(p, v.y, c.y); c.z = fmaf(p, v.z, c.z); c.w = fmaf(p, v.w, c.w);
}

// The block's HB query rows (q_abs | q_pe of heads h0.., row s; heads past nh: zeros) into qs (row stride DP floats)
// as 4-byte cp.async pieces, THREADS threads: any alignment (tile3 takes 16-byte pieces where it can).
template <int HB, int THREADS>
__device__ inline void stage_queries_4b(float *qs, const float *qa, const float *q, int dq, int pe_off, int s, int nh,
                                        int h0, int Lkv, int D, int DP, int tid) {
    for (int e = tid; e < HB * D; e += THREADS) {
        const int hl = e / D, d = e - hl * D, h = min(h0 + hl, nh - 1);
        const long long row = (long long)s * nh + h;
        const float *src = d < Lkv ? qa + row * Lkv + d : q + row * dq + pe_off + d - Lkv;
        at2_cp4(qs + hl * DP + d, src, h0 + hl < nh);
    }
}

// A lane's register tile of the scores (tile2 / tile1: NK = 4 keys, tile3: 8): a[i][j] = slice sl's part of
// q_abs|q_pe of head hq + 4 i . lat|k_pe of key kq + 4 j, over the float4 columns f = sl, sl + KS, ... < D4 of the
// staged query rows qs and tile rows kb (row stride DP floats); UF: how far the column loop is unrolled.
template <int NK, int KS, int UF>
__device__ inline void tile_scores(const float *qs, const float *kb, int DP, int D4, int sl, int hq, int kq,
                                   float (&a)[4][NK]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NK; j++) a[i][j] = 0.f;
#pragma unroll UF
    for (int f = sl; f < D4; f += KS) {
        float4 qv[4], kv[NK];
#pragma unroll
        for (int i = 0; i < 4; i++) qv[i] = *reinterpret_cast<const float4 *>(qs + (hq + 4 * i) * DP + 4 * f);
#pragma unroll
        for (int j = 0; j < NK; j++) kv[j] = *reinterpret_cast<const float4 *>(kb + (kq + 4 * j) * DP + 4 * f);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < NK; j++) {
                a[i][j] = fmaf(qv[i].x, kv[j].x, a[i][j]);
                a[i][j] = fmaf(qv[i].y, kv[j].y, a[i][j]);
                a[i][j] = fmaf(qv[i].z, kv[j].z, a[i][j]);
                a[i][j] = fmaf(qv[i].w, kv[j].w, a[i][j]);
            }
    }
}

template <int NBUF>
__device__ void mla_tile_body(const float *qa, const float *q, int dq, int pe_off, const float *lat,
                              const float *kpe, const int *idx, const int *cnt, int kmax, int start,
                              const int *T_dev, int S, int nh, int Lkv, int dr, float scale, int chunk,
                              int nchunk, float *pm, float *pl, float *pc) {
    extern __shared__ float4 at2_sh4[];
    const int D = Lkv + dr, D4 = D >> 2, L4 = Lkv >> 2, DP = at2_row_stride(D);
    float *qs = reinterpret_cast<float *>(at2_sh4);           // [HB][DP]: q_abs | q_pe of the block's heads
    float *ks = qs + AT2_HB * DP;                              // [NBUF][TK][DP]: lat | k_pe of a tile's keys
    float *sp = ks + NBUF * AT2_TK * DP;                       // [KS][HB][TK]: the slices' partial scores
    float *pt = sp + AT2_KS * AT2_HB * AT2_TK;                 // [TK][HB]: probabilities of the tile
    float *cs = pt + AT2_TK * AT2_HB;                          // [HB]: this tile's rescale of the old context
    float *ls = cs + AT2_HB;                                   // [HB]: running sum l
    const int c = blockIdx.x, s = blockIdx.z, tid = threadIdx.x, h0 = blockIdx.y * AT2_HB;
    const int n = attend_keys(idx, cnt, start, T_dev, S, s);
    const int lo = c * chunk;
    if (lo >= n) return;                                       // uniform over the block
    const int hi = min(lo + chunk, n), ntiles = (hi - lo + AT2_TK - 1) / AT2_TK;

    // Every copy is asynchronous (cp.async) and every key index a thread needs is loaded before the first copy is
    // issued: a loop of load-then-store steps would wait one memory round trip per step (the first version of this
    // kernel staged the queries so: 36 dependent round trips, ~18 us per block on the H200).
    // NBUF = 2 loads a thread's key indices into registers; NBUF = 1 (128 registers, which that would spill) has
    // 16 threads put the tile's keys in shared memory first (one round trip and a barrier more per tile).
    __shared__ int keys_sh[AT2_TK];
    constexpr int STAGE_UNROLL = NBUF == 2 ? AT2_MAXE : 1;    // tile1: a loop (its unrolled copies spilled)
    auto stage = [&](int i, int b) {                          // tile i -> buffer b, every 16-byte piece in flight
        float *dst = ks + b * AT2_TK * DP;
        int tk[NBUF == 2 ? AT2_MAXE : 1];
        if (NBUF == 2) {
#pragma unroll
            for (int k = 0; k < AT2_MAXE; k++) {
                const int e = tid + k * AT2_THREADS, jj = lo + i * AT2_TK + e / D4;
                const bool on = e < AT2_TK * D4 && jj < hi;
                tk[NBUF == 2 ? k : 0] = on ? (idx ? __ldg(idx + (long long)s * kmax + jj) : jj) : -1;
            }
        } else {
            const int jj = lo + i * AT2_TK + tid;
            if (tid < AT2_TK) keys_sh[tid] = jj < hi ? (idx ? __ldg(idx + (long long)s * kmax + jj) : jj) : -1;
            __syncthreads();
        }
#pragma unroll STAGE_UNROLL
        for (int k = 0; k < AT2_MAXE; k++) {
            const int e = tid + k * AT2_THREADS, r = e / D4, f = e - r * D4;
            if (e < AT2_TK * D4) {
                const int t = NBUF == 2 ? tk[NBUF == 2 ? k : 0] : keys_sh[r];
                const float *src = f < L4 ? lat + (long long)max(t, 0) * Lkv + 4 * f
                                          : kpe + (long long)max(t, 0) * dr + 4 * (f - L4);
                at2_cp16(dst + r * DP + 4 * f, src, t >= 0);   // absent keys: zero rows (p = 0 must not meet NaN)
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    stage_queries_4b<AT2_HB, AT2_THREADS>(qs, qa, q, dq, pe_off, s, nh, h0, Lkv, D, DP, tid);   // with tile 0
    stage(0, 0);
    // score-phase ownership: slice sl, heads hq + 4i, keys kq + 4j; softmax: head sh, key st; context: heads
    // 8 hh + i, latent dims 4 d4 .. 4 d4 + 3
    const int sl = tid >> 4, hq = tid & 3, kq = (tid >> 2) & 3;
    const int sh = tid >> 4, st = tid & 15;
    const int hh = tid >> 7, d4 = tid & 127;
    float m_r = -INFINITY, l_r = 0.f;                          // head sh's running max and sum
    float4 cv[8];
#pragma unroll
    for (int i = 0; i < 8; i++) cv[i] = make_float4(0.f, 0.f, 0.f, 0.f);

    for (int it = 0; it < ntiles; it++) {
        const int b = NBUF == 2 ? it & 1 : 0;
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();                                       // tile it landed; tile it - 1 is consumed
        if (NBUF == 2 && it + 1 < ntiles) stage(it + 1, b ^ 1);
        const float *kb = ks + b * AT2_TK * DP;
        {   // scores, slice sl's part                                                   a [4 heads][4 keys]
            float a[4][4];
            tile_scores<4, AT2_KS, 2>(qs, kb, DP, D4, sl, hq, kq, a);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) sp[(sl * AT2_HB + hq + 4 * i) * AT2_TK + kq + 4 * j] = a[i][j];
        }
        __syncthreads();
        {   // softmax step of head sh over the tile (16 lanes of a half-warp, one key each)
            float sum = 0.f;
#pragma unroll
            for (int k = 0; k < AT2_KS; k++) sum += sp[(k * AT2_HB + sh) * AT2_TK + st];
            const float sc = lo + it * AT2_TK + st < hi ? __fmul_rn(sum, scale) : -INFINITY;
            float mt = sc;
#pragma unroll
            for (int o = 8; o; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float mn = fmaxf(m_r, mt);                   // finite: the tile has >= 1 key
            const float corr = expf(m_r - mn);                 // 0 on the first tile (m = -inf)
            const float p = expf(sc - mn);                     // 0 for absent keys
            float ps = p;
#pragma unroll
            for (int o = 8; o; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l_r = fmaf(l_r, corr, ps);
            m_r = mn;
            pt[st * AT2_HB + sh] = p;
            if (st == 0) { cs[sh] = corr; ls[sh] = l_r; }
        }
        __syncthreads();
        if (d4 < L4) {   // context += P . V over the tile's keys                         cv [8 heads] x 4 dims
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float r = cs[8 * hh + i];
                cv[i].x *= r; cv[i].y *= r; cv[i].z *= r; cv[i].w *= r;
            }
#pragma unroll 4
            for (int r = 0; r < AT2_TK; r++) {
                const float4 v = *reinterpret_cast<const float4 *>(kb + r * DP + 4 * d4);
                const float4 pa = *reinterpret_cast<const float4 *>(pt + r * AT2_HB + 8 * hh);
                const float4 pb = *reinterpret_cast<const float4 *>(pt + r * AT2_HB + 8 * hh + 4);
                fma4(cv[0], pa.x, v); fma4(cv[1], pa.y, v); fma4(cv[2], pa.z, v); fma4(cv[3], pa.w, v);
                fma4(cv[4], pb.x, v); fma4(cv[5], pb.y, v); fma4(cv[6], pb.z, v); fma4(cv[7], pb.w, v);
            }
        }
        if (NBUF == 1 && it + 1 < ntiles) {
            __syncthreads();                                   // the buffer is consumed
            stage(it + 1, 0);
        }
    }
    if (pm && st == 0 && h0 + sh < nh) {
        const long long p = ((long long)s * nh + h0 + sh) * nchunk + c;
        pm[p] = m_r;
        pl[p] = l_r;
    }
    if (d4 >= L4) return;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int h = h0 + 8 * hh + i;
        if (h >= nh) continue;
        const long long p = ((long long)s * nh + h) * nchunk + c;
        float4 o = cv[i];
        if (!pm) {                                             // one chunk: normalise here (ls: the last tile's l)
            const float L = ls[8 * hh + i];
            o = make_float4(__fdiv_rn(o.x, L), __fdiv_rn(o.y, L), __fdiv_rn(o.z, L), __fdiv_rn(o.w, L));
        }
        reinterpret_cast<float4 *>(pc + p * Lkv)[d4] = o;
    }
}

#define MLA_TILE_KERNEL(NBUF, MINB)                                                                           \
    extern "C" __global__ void __launch_bounds__(AT2_THREADS, MINB) mla_attend_tile##NBUF(                    \
        const float *qa, const float *q, int dq, int pe_off, const float *lat, const float *kpe,              \
        const int *idx, const int *cnt, int kmax, int start, const int *T_dev, int S, int nh, int Lkv,        \
        int dr, float scale, int chunk, int nchunk, float *pm, float *pl, float *pc) {                        \
        COLI_PDL_ENTRY();                                                                                     \
        mla_tile_body<NBUF>(qa, q, dq, pe_off, lat, kpe, idx, cnt, kmax, start, T_dev, S, nh, Lkv, dr, scale, \
                            chunk, nchunk, pm, pl, pc);                                                       \
    }
MLA_TILE_KERNEL(2, 1)
MLA_TILE_KERNEL(1, 2)

extern "C" __global__ void mla_attend_combine4(const float *pm, const float *pl, const float *pc, const int *idx,
                                               const int *cnt, int start, const int *T_dev, int S, int nh, int Lkv,
                                               int chunk, int nchunk, float *ctx) {
    COLI_PDL_ENTRY();
    // M and L as block reductions (each thread one chunk's m, l per step: one round trip for up to 128 chunks, not
    // one per chunk), the chunks' weights e^(m_c - M) in shared memory, 128 at a time
    __shared__ float red[4], wsh[128];
    const int h = blockIdx.x, s = blockIdx.y, d4 = threadIdx.x, lane = d4 & 31, warp = d4 >> 5;
    const int n = attend_keys(idx, cnt, start, T_dev, S, s);
    const int nc = min(nchunk, (n + chunk - 1) / chunk);
    const long long p0 = ((long long)s * nh + h) * nchunk;
    float M = -INFINITY;
    for (int c = d4; c < nc; c += 128) M = fmaxf(M, pm[p0 + c]);
    M = warp_max(M);
    if (lane == 0) red[warp] = M;
    __syncthreads();
    M = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    float L = 0.f;
    for (int c = d4; c < nc; c += 128) L = fmaf(pl[p0 + c], expf(pm[p0 + c] - M), L);
    L = warp_sum(L);
    if (lane == 0) red[warp] = L;
    __syncthreads();
    L = (red[0] + red[1]) + (red[2] + red[3]);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c0 = 0; c0 < nc; c0 += 128) {
        __syncthreads();                                       // the previous weights are consumed
        if (c0 + d4 < nc) wsh[d4] = expf(pm[p0 + c0 + d4] - M);
        __syncthreads();
        const int m = min(128, nc - c0);
        if (4 * d4 < Lkv) {
#pragma unroll 16
            for (int c = 0; c < m; c++) fma4(a, wsh[c], reinterpret_cast<const float4 *>(pc + (p0 + c0 + c) * Lkv)[d4]);
        }
    }
    if (4 * d4 < Lkv)
        reinterpret_cast<float4 *>(ctx + ((long long)s * nh + h) * Lkv)[d4] =
            make_float4(__fdiv_rn(a.x, L), __fdiv_rn(a.y, L), __fdiv_rn(a.z, L), __fdiv_rn(a.w, L));
}

// ==== two 16-key tiles per pass: mla_attend_tile3 (+ mla_attend_combine4) =====================================
// mla_attend_tile2 at GLM-5's shape spends ~5,600 clk per 16-key tile against ~2,200 clk of FMA issue (docs/perf-notes.md
// "Where the context's time goes"): its score pass reads 8 16-byte values from shared memory per 64 FMAs of a lane,
// every tile pays the softmax's chain between two barriers and three barriers, and staging a piece of the tile costs
// a division. tile3 takes AT3_TK = 32 keys per tile, the same block (AT3_HB = 16 heads, 256 threads) and ownership
// otherwise:
//   scores: a lane owns 4 heads x 8 keys (heads hq + 4i, keys kq + 4j, j < 8): 12 16-byte reads per 128 FMAs (25 %
//           fewer per FMA), 32 independent accumulators; the slices' partials go to shared memory at a swizzled key
//           column (at3_sp_col) so that neither the writes nor the softmax's reads meet a bank twice in a warp;
//   softmax: thread (sh, st) takes keys st and st + 16 of head sh: one max and one sum over the half-warp per 32 keys;
//   context: as tile2 (8 heads x 4 latent dims per thread), 32 keys per pass;
//   staging: a thread's pieces of a tile are the same (row, float4) for every tile -- only the key index changes -- so
//           the pattern is computed once per block (one division) and stepped by additions.
// The query and key rows are at3_row_stride() floats apart (8 past a multiple of 32: the 4 heads and the 2 slices a
// warp's score pass reads at once fall in 8 distinct 16-byte bank groups). Two key buffers: 217 KB of shared memory
// at GLM-5's shape (sm_90/sm_100 only; "auto" elsewhere falls back to tile2, tile1, the part kernel). The same grid,
// arguments, chunks (multiples of 16 keys: a chunk of 16 or 48 ends in a half-empty tile, which only costs work),
// partials and combine as tile2.
//   Lkv % 4 == 0, dr % 4 == 0, Lkv <= 4 * 128, Lkv + dr <= 576, lat/kpe 16-byte aligned; grid (nchunk, ceil(nh /
//   AT3_HB), S), block AT3_THREADS, dynamic smem = attention_split.tile3_smem_bytes(Lkv, dr).
#define AT3_TK 32        // keys per tile
#define AT3_HB 16        // heads per block
#define AT3_KS 16        // slices of the score dot (one half-warp each)
#define AT3_THREADS 256
#define AT3_PTS 20       // floats per key row of the probabilities [TK][PTS]: 16 heads, 16-byte rows, 2-way writes
#define AT3_MAXE ((AT3_TK * 144 + AT3_THREADS - 1) / AT3_THREADS)   // pieces of a tile per thread (D <= 576)
#define AT3_QE ((AT3_HB * 144 + AT3_THREADS - 1) / AT3_THREADS)     // 16-byte query pieces per thread

__device__ inline int at3_row_stride(int D) { return ((D + 31) & ~31) + 8; }

// The column of key `key` in row (slice sl, head h) of the partial scores [KS][HB][TK]: a bijection of 0..31 per row.
// A score-pass warp writes (slices 2w', 2w'+1) x (heads h = hq + 4i, hq < 4) x (keys kq + 4j, kq < 4): bits 0-1 from
// kq, bit 2 from hq's bit 1, bit 3 from the slice's parity, bit 4 from hq's bit 0 -> 32 banks. A softmax warp reads,
// for one slice, heads 2w, 2w + 1 x keys st (< 16) or st + 16: st XOR a per-(slice, head pair) constant below 16 is a
// permutation of 0..15, and bit 4 tells the heads apart -> 32 banks.
__device__ inline int at3_sp_col(int sl, int h, int key) {
    return key ^ ((h & 1) << 4) ^ ((h & 2) << 1) ^ ((sl & 1) << 3);
}

__device__ void mla_tile3_body(const float *qa, const float *q, int dq, int pe_off, const float *lat, const float *kpe,
                               const int *idx, const int *cnt, int kmax, int start, const int *T_dev, int S, int nh,
                               int Lkv, int dr, float scale, int chunk, int nchunk, float *pm, float *pl, float *pc) {
    extern __shared__ float4 at3_sh4[];
    const int D = Lkv + dr, D4 = D >> 2, L4 = Lkv >> 2, DP = at3_row_stride(D);
    float *qs = reinterpret_cast<float *>(at3_sh4);           // [HB][DP]: q_abs | q_pe of the block's heads
    float *ks = qs + AT3_HB * DP;                              // [2][TK][DP]: lat | k_pe of a tile's keys
    float *sp = ks + 2 * AT3_TK * DP;                          // [KS][HB][TK]: the slices' partial scores (swizzled)
    float *pt = sp + AT3_KS * AT3_HB * AT3_TK;                 // [TK][PTS]: probabilities of the tile
    float *cs = pt + AT3_TK * AT3_PTS;                         // [HB]: this tile's rescale of the old context
    float *ls = cs + AT3_HB;                                   // [HB]: running sum l
    const int c = blockIdx.x, s = blockIdx.z, tid = threadIdx.x, h0 = blockIdx.y * AT3_HB;
    const int n = attend_keys(idx, cnt, start, T_dev, S, s);
    const int lo = c * chunk;
    if (lo >= n) return;                                       // uniform over the block
    const int hi = min(lo + chunk, n), ntiles = (hi - lo + AT3_TK - 1) / AT3_TK;
    const int *idx_s = idx ? idx + (long long)s * kmax : nullptr;

    // Piece e = tid + k * THREADS of a tile (k < AT3_MAXE) is float4 f of row r, e = r * D4 + f: computed here once,
    // then each next piece is (r, f) + (SR, SF) with one carry (SF < D4). Rows past the tile (r >= TK) are not pieces.
    const int r0 = tid / D4, f0 = tid - r0 * D4, SR = AT3_THREADS / D4, SF = AT3_THREADS - SR * D4;
    auto stage = [&](int i, int b) {                           // tile i -> buffer b, every 16-byte piece in flight
        float *dst = ks + b * AT3_TK * DP;
        const int j0 = lo + i * AT3_TK;
        int tk[AT3_MAXE];                                      // every key index loaded before the first copy
        int r = r0, f = f0;
#pragma unroll
        for (int k = 0; k < AT3_MAXE; k++) {
            const int jj = j0 + r;
            tk[k] = r < AT3_TK && jj < hi ? (idx_s ? __ldg(idx_s + jj) : jj) : -1;
            r += SR;
            f += SF;
            if (f >= D4) { f -= D4; r++; }
        }
        r = r0;
        f = f0;
#pragma unroll
        for (int k = 0; k < AT3_MAXE; k++) {
            if (r < AT3_TK) {
                const int t = max(tk[k], 0);
                const float *src = f < L4 ? lat + (long long)t * Lkv + 4 * f : kpe + (long long)t * dr + 4 * (f - L4);
                at2_cp16(dst + r * DP + 4 * f, src, tk[k] >= 0);   // absent keys: zero rows (p = 0 must not meet NaN)
            }
            r += SR;
            f += SF;
            if (f >= D4) { f -= D4; r++; }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // the queries (heads past nh: zeros), with tile 0. Rows of 16-byte pieces where q_abs and q's rope part allow
    // (GLM-5: 9 copies a thread, the tile's stepping pattern with heads for keys) -- 4-byte copies otherwise (36 a
    // thread at GLM-5's shape, a division each: ~1 us of issue ahead of tile 0's copies)
    const bool q16 = ((reinterpret_cast<unsigned long long>(qa) | reinterpret_cast<unsigned long long>(q)) & 15) == 0
                     && (dq & 3) == 0 && (pe_off & 3) == 0;
    if (q16) {
        int hl = r0, f = f0;
#pragma unroll
        for (int k = 0; k < AT3_QE; k++) {
            if (hl < AT3_HB) {
                const long long row = (long long)s * nh + min(h0 + hl, nh - 1);
                const float *src = f < L4 ? qa + row * Lkv + 4 * f : q + row * dq + pe_off + 4 * (f - L4);
                at2_cp16(qs + hl * DP + 4 * f, src, h0 + hl < nh);
            }
            hl += SR;
            f += SF;
            if (f >= D4) { f -= D4; hl++; }
        }
    } else {
        stage_queries_4b<AT3_HB, AT3_THREADS>(qs, qa, q, dq, pe_off, s, nh, h0, Lkv, D, DP, tid);
    }
    stage(0, 0);
    // score-phase ownership: slice sl, heads hq + 4i, keys kq + 4j; softmax: head sh, keys st and st + 16; context:
    // heads 8 hh + i, latent dims 4 d4 .. 4 d4 + 3
    const int sl = tid >> 4, hq = tid & 3, kq = (tid >> 2) & 3;
    const int sh = tid >> 4, st = tid & 15;
    const int hh = tid >> 7, d4 = tid & 127;
    float m_r = -INFINITY, l_r = 0.f;                          // head sh's running max and sum
    float4 cv[8];
#pragma unroll
    for (int i = 0; i < 8; i++) cv[i] = make_float4(0.f, 0.f, 0.f, 0.f);

    for (int it = 0; it < ntiles; it++) {
        const int b = it & 1;
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();                                       // tile it landed; tile it - 1 is consumed
        if (it + 1 < ntiles) stage(it + 1, b ^ 1);
        const float *kb = ks + b * AT3_TK * DP;
        {   // scores, slice sl's part                                                   a [4 heads][8 keys]
            float a[4][8];
            tile_scores<8, AT3_KS, 1>(qs, kb, DP, D4, sl, hq, kq, a);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int h = hq + 4 * i;
#pragma unroll
                for (int j = 0; j < 8; j++) sp[(sl * AT3_HB + h) * AT3_TK + at3_sp_col(sl, h, kq + 4 * j)] = a[i][j];
            }
        }
        __syncthreads();
        {   // softmax step of head sh over the tile (16 lanes of a half-warp, keys st and st + 16 each)
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int k = 0; k < AT3_KS; k++) {
                const float *row = sp + (k * AT3_HB + sh) * AT3_TK;
                s0 += row[at3_sp_col(k, sh, st)];
                s1 += row[at3_sp_col(k, sh, st + 16)];
            }
            const int j0 = lo + it * AT3_TK + st;
            s0 = j0 < hi ? __fmul_rn(s0, scale) : -INFINITY;
            s1 = j0 + 16 < hi ? __fmul_rn(s1, scale) : -INFINITY;
            float mt = fmaxf(s0, s1);
#pragma unroll
            for (int o = 8; o; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float mn = fmaxf(m_r, mt);                   // finite: key 0 of the tile is present
            const float corr = expf(m_r - mn);                 // 0 on the first tile (m = -inf)
            const float p0 = expf(s0 - mn), p1 = expf(s1 - mn);   // 0 for absent keys
            float ps = p0 + p1;
#pragma unroll
            for (int o = 8; o; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l_r = fmaf(l_r, corr, ps);
            m_r = mn;
            pt[st * AT3_PTS + sh] = p0;
            pt[(st + 16) * AT3_PTS + sh] = p1;
            if (st == 0) { cs[sh] = corr; ls[sh] = l_r; }
        }
        __syncthreads();
        if (d4 < L4) {   // context += P . V over the tile's keys                         cv [8 heads] x 4 dims
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float r = cs[8 * hh + i];
                cv[i].x *= r; cv[i].y *= r; cv[i].z *= r; cv[i].w *= r;
            }
#pragma unroll 4
            for (int r = 0; r < AT3_TK; r++) {
                const float4 v = *reinterpret_cast<const float4 *>(kb + r * DP + 4 * d4);
                const float4 pa = *reinterpret_cast<const float4 *>(pt + r * AT3_PTS + 8 * hh);
                const float4 pb = *reinterpret_cast<const float4 *>(pt + r * AT3_PTS + 8 * hh + 4);
                fma4(cv[0], pa.x, v); fma4(cv[1], pa.y, v); fma4(cv[2], pa.z, v); fma4(cv[3], pa.w, v);
                fma4(cv[4], pb.x, v); fma4(cv[5], pb.y, v); fma4(cv[6], pb.z, v); fma4(cv[7], pb.w, v);
            }
        }
    }
    if (pm && st == 0 && h0 + sh < nh) {
        const long long p = ((long long)s * nh + h0 + sh) * nchunk + c;
        pm[p] = m_r;
        pl[p] = l_r;
    }
    if (d4 >= L4) return;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int h = h0 + 8 * hh + i;
        if (h >= nh) continue;
        const long long p = ((long long)s * nh + h) * nchunk + c;
        float4 o = cv[i];
        if (!pm) {                                             // one chunk: normalise here (ls: the last tile's l)
            const float L = ls[8 * hh + i];
            o = make_float4(__fdiv_rn(o.x, L), __fdiv_rn(o.y, L), __fdiv_rn(o.z, L), __fdiv_rn(o.w, L));
        }
        reinterpret_cast<float4 *>(pc + p * Lkv)[d4] = o;
    }
}

extern "C" __global__ void __launch_bounds__(AT3_THREADS, 1) mla_attend_tile3(
    const float *qa, const float *q, int dq, int pe_off, const float *lat, const float *kpe, const int *idx,
    const int *cnt, int kmax, int start, const int *T_dev, int S, int nh, int Lkv, int dr, float scale, int chunk,
    int nchunk, float *pm, float *pl, float *pc) {
    COLI_PDL_ENTRY();
    mla_tile3_body(qa, q, dq, pe_off, lat, kpe, idx, cnt, kmax, start, T_dev, S, nh, Lkv, dr, scale, chunk, nchunk, pm,
                   pl, pc);
}

// mla_attend_combine_onepass: tile3's combine. combine4 (64 blocks at GLM-5's decode shape: one per head) waits on
// ~5 dependent L2 round trips -- the chunks' m for M, m and l again for L, m again for the weights, then the partial
// contexts in two unrolled batches. Here every block first issues its share of the partial contexts (they do not
// depend on the weights), then reads m and l (a thread per chunk, read-only and L1-resident for the second look), so
// a decode row's combine is about one round trip. Block (x, h, s) takes float4 columns x * CMB_COLS .. + CMB_COLS - 1
// of head h's context (2 blocks per head at Lkv 512: 128 blocks); thread (g, u) = (tid / CMB_COLS, tid % CMB_COLS)
// sums chunks g, g + CMB_LANES, ... of column u, CMB_BATCH of them per batch in registers; the CMB_LANES sums meet in
// shared memory. Same arguments as combine4; grid (ceil(Lkv / 4 / CMB_COLS), nh, S), block CMB_THREADS, Lkv % 4 == 0.
#define CMB_COLS 64
#define CMB_LANES 2
#define CMB_BATCH 16
#define CMB_THREADS 128  // CMB_COLS * CMB_LANES (a literal: the launch bounds read it)
#define CMB_PER (CMB_LANES * CMB_BATCH)   // chunks per batch of a block
static_assert(CMB_THREADS == CMB_COLS * CMB_LANES, "a thread per (column, chunk lane)");
static_assert(CMB_LANES == 2, "the lanes' sums meet in one shared-memory step (other[])");
static_assert(CMB_PER <= CMB_THREADS, "a thread per chunk weight of a batch");

extern "C" __global__ void __launch_bounds__(CMB_THREADS) mla_attend_combine_onepass(
    const float *pm, const float *pl, const float *pc, const int *idx, const int *cnt, int start, const int *T_dev,
    int S, int nh, int Lkv, int chunk, int nchunk, float *ctx) {
    COLI_PDL_ENTRY();
    __shared__ float red[CMB_THREADS / 32], wsh[CMB_PER];
    __shared__ float4 other[CMB_COLS];
    const int L4 = Lkv >> 2, h = blockIdx.y, s = blockIdx.z, tid = threadIdx.x;
    if (blockIdx.x * CMB_COLS >= L4) return;                   // uniform over the block
    const int u = tid % CMB_COLS, g = tid / CMB_COLS, col = blockIdx.x * CMB_COLS + u, lane = tid & 31, warp = tid >> 5;
    const bool on = col < L4;
    const int n = attend_keys(idx, cnt, start, T_dev, S, s);
    const int nc = min(nchunk, (n + chunk - 1) / chunk);
    const long long p0 = ((long long)s * nh + h) * nchunk;
    const float4 *pc4 = reinterpret_cast<const float4 *>(pc);
    const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 v[CMB_BATCH];                                       // chunk cb + g + CMB_LANES k of column col
    auto load_batch = [&](int cb) {
#pragma unroll
        for (int k = 0; k < CMB_BATCH; k++) {
            const int c = cb + g + CMB_LANES * k;
            v[k] = on && c < nc ? __ldg(pc4 + (p0 + c) * L4 + col) : z4;
        }
    };
    load_batch(0);                                             // in flight while M and L are found
    float M = -INFINITY;
    for (int c = tid; c < nc; c += CMB_THREADS) M = fmaxf(M, __ldg(pm + p0 + c));
    M = warp_max(M);
    if (lane == 0) red[warp] = M;
    __syncthreads();
    M = red[0];
#pragma unroll
    for (int w = 1; w < CMB_THREADS / 32; w++) M = fmaxf(M, red[w]);
    __syncthreads();                                           // red is read by all before it is reused
    float L = 0.f;
    for (int c = tid; c < nc; c += CMB_THREADS) L = fmaf(__ldg(pl + p0 + c), expf(__ldg(pm + p0 + c) - M), L);
    L = warp_sum(L);
    if (lane == 0) red[warp] = L;
    __syncthreads();
    L = red[0];
#pragma unroll
    for (int w = 1; w < CMB_THREADS / 32; w++) L += red[w];
    float4 a = z4;
    for (int cb = 0; cb < nc; cb += CMB_PER) {
        if (cb > 0) load_batch(cb);                            // rows of many chunks (prefill): a round trip per batch
        __syncthreads();                                       // the previous batch's weights are consumed
        if (tid < CMB_PER && cb + tid < nc) wsh[tid] = expf(__ldg(pm + p0 + cb + tid) - M);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < CMB_BATCH; k++)
            if (cb + g + CMB_LANES * k < nc) fma4(a, wsh[g + CMB_LANES * k], v[k]);   // stale weights never read
    }
    if (g == 1) other[u] = a;
    __syncthreads();
    if (g == 0 && on) {
        a.x += other[u].x; a.y += other[u].y; a.z += other[u].z; a.w += other[u].w;
        reinterpret_cast<float4 *>(ctx + ((long long)s * nh + h) * Lkv)[col] =
            make_float4(__fdiv_rn(a.x, L), __fdiv_rn(a.y, L), __fdiv_rn(a.z, L), __fdiv_rn(a.w, L));
    }
}

// ==== the decode projections around the context: mla_qabs_<fmt> (q_abs) and mla_o_<fmt> (o) ===================
// gemv_t_<fmt> / gemv2_<fmt> ran q_abs (64 heads x 192 rows x 512 cols of kv_b) on 64 blocks, one per head (11 us on
// the H200 for 6.3 MB of int8), and o took 9.6 us for 8.4 MB. Both are a per-head product with a slice of kv_b that
// is read once; here each block takes 128 columns (q_abs) or 32 rows (o) of one head, so the grid is 4-8 blocks per
// head (256-512 blocks) and every weight load of a thread is issued before any is used.
//
// mla_qabs_<fmt>(w, wrow0, wz, K, x, x_z, y, y_z):  y[z][n] = sum_k x[z][k] * W[wrow0 + z*wz + k, n], k < K, n < cols
//   grid (ceil(nchunks / QA_CPB), Z), block 256, no dynamic smem. QA_CPB = 128 / VALS chunks (128 columns) per
//   block; thread (rl, cc) = (tid / CPB, tid % CPB) reads chunk cc of rows rl, rl + RL, ... (RL = 256 / CPB), up to
//   QA_U at once, and keeps the chunk's VALS column sums; the RL partial sums of a column are added in order of rl.
//   Each term is x[k] * (v * s), the stored weight exactly (dequantize()), as in gemv_t.
// mla_o_<fmt>(w, wrow0, wz, N, x, x_z, y, y_z):  y[z][n] = W[wrow0 + z*wz + n] . x[z], n < N
//   grid (ceil(N / 32), Z), block 256 (warp w: rows 32 bx + 4 w .. + 3), dynamic smem = nchunks * VALS * 4 bytes;
//   the rows are prefetched into L2 before x is staged, then warp_rows_dot (the GEMV's inner loop).
#define QA_U 8
// MLA_O_PF (scripts/gemv_kernel_sweep.py builds variants with -D): 1 prefetches mla_o's rows into L2 before x is
// staged, 0 (shipped since the 2026-12-02 sweep, as the GEMVs': within noise alone, 0.4 us) does not.
#ifndef MLA_O_PF
#define MLA_O_PF 0
#endif

template <int FMT>
__device__ void mla_qabs_body(QMat W, int wrow0, int wz, int K, const float *x, long long x_z, float *y,
                              long long y_z) {
    constexpr int V = Chunk<FMT>::VALS, CPB = 128 / V, RL = 256 / CPB;
    __shared__ float part[RL][128];                            // [row lane][column of the block]
    const int z = blockIdx.y, nchunks = W.row_data / 16;
    const int cc = threadIdx.x % CPB, rl = threadIdx.x / CPB, c = blockIdx.x * CPB + cc;
    const float *xz = x + z * x_z;
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = 0.f;
    if (c < nchunks) {
        for (int k0 = rl; k0 < K; k0 += QA_U * RL) {
            uint4 w[QA_U];
            float s[QA_U], xk[QA_U];
#pragma unroll
            for (int u = 0; u < QA_U; u++) {
                const int k = k0 + u * RL;
                s[u] = 0.f;
                xk[u] = 0.f;
                if (k < K) {
                    const u8 *d, *m;
                    qmat_row(W, wrow0 + z * wz + k, d, m);
                    w[u] = ld_stream(d + 16 * c);
                    s[u] = chunk_scale<FMT>(m, c, W.group) * row_scale<FMT>(m);
                    xk[u] = xz[k];
                }
            }
#pragma unroll
            for (int u = 0; u < QA_U; u++) {
                if (k0 + u * RL < K) {
                    float v[V];
                    chunk_vals<FMT>(w[u], v);
#pragma unroll
                    for (int i = 0; i < V; i++) acc[i] = fmaf(xk[u], v[i] * s[u], acc[i]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < V; i++) part[rl][cc * V + i] = acc[i];
    __syncthreads();
    const int n = blockIdx.x * 128 + threadIdx.x;
    if (threadIdx.x < 128 && n < W.cols) {
        float a = 0.f;
        for (int r = 0; r < RL; r++) a += part[r][threadIdx.x];
        y[z * y_z + n] = a;
    }
}

template <int FMT>
__device__ void mla_o_body(QMat W, int wrow0, int wz, int N, const float *x, long long x_z, float *y, long long y_z) {
    extern __shared__ float4 at_xs4[];
    float *xs = reinterpret_cast<float *>(at_xs4);
    constexpr int V = Chunk<FMT>::VALS;
    const int z = blockIdx.y, nchunks = W.row_data / 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n0 = blockIdx.x * 32 + warp * 4;
    const u8 *d[4], *m[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        qmat_row(W, wrow0 + z * wz + min(n0 + r, N - 1), d[r], m[r]);
        if (MLA_O_PF && lane == r && n0 + r < N) l2_prefetch(d[r], W.row_data);  // in flight while x stages
    }
    stage_x<FMT>(xs, x + z * x_z, W.cols, nchunks * V);
    __syncthreads();
    float out[4];
    warp_rows_dot<FMT, 4, 2>(d, m, nchunks, W.group, xs, lane, out);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < 4; r++)
            if (n0 + r < N) y[z * y_z + n0 + r] = out[r];
    }
}

#define MLA_PROJ_KERNELS(NAME, FMT)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) mla_qabs_##NAME(QMAT_PARAMS(w), int wrow0, int wz, int K, \
                                                                      const float *x, long long x_z, float *y, \
                                                                      long long y_z) {                         \
        COLI_PDL_ENTRY();                                                                                      \
        mla_qabs_body<FMT>(QMAT_MAKE(w, FMT), wrow0, wz, K, x, x_z, y, y_z);                                  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) mla_o_##NAME(QMAT_PARAMS(w), int wrow0, int wz, int N,    \
                                                                   const float *x, long long x_z, float *y,    \
                                                                   long long y_z) {                            \
        COLI_PDL_ENTRY();                                                                                      \
        mla_o_body<FMT>(QMAT_MAKE(w, FMT), wrow0, wz, N, x, x_z, y, y_z);                                     \
    }
COLI_FOR_FORMATS(MLA_PROJ_KERNELS)

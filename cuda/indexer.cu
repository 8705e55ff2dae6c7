// indexer.cu -- the DSA indexer on the GPU: scores, then per-row top-k selection (reference §3.4,
// NumpyBackend.indexer_scores / indexer_select).
//
// Row s (absolute position start+s) sees keys t < n_vis = min(start+s+1, T). It keeps the
// k = min(topk, n_vis) best of them; a row with n_vis <= topk keeps all of them and needs no scores.
#include "coli_common.cuh"

// ---- indexer_scores ------------------------------------------------------------------------------------
// score[s, t] = sum_h (hw[s,h] * wscale) * relu((iq[s,h] . kidx[t]) * qscale)     t < n_vis, rows with n_vis > topk
//   iq [S, ih, ihd], kidx [T, ihd], hw [S, ih] (weights_proj output), score [S, T] (other entries untouched)
//   qscale = ihd^-0.5, wscale = ih^-0.5.
//   grid (ceil(T / 64), S), block 256 (8 warps; warp per key, lane per head), dynamic smem = ih*(ihd+1)*4 + ih*4.
#define IDX_KEYS_PER_BLOCK 64
__device__ __forceinline__ void indexer_scores_body(const float *iq, const float *kidx, const float *hw, int ih,
                                                    int ihd, int start, int T, float qscale, float wscale, int topk,
                                                    float *score) {
    extern __shared__ float smem[];
    float *qs = smem;                       // [ih][ihd + 1] (padded: lanes = heads hit distinct banks)
    float *ws = smem + ih * (ihd + 1);      // [ih]
    const int s = blockIdx.y;
    const int n_vis = min(start + s + 1, T);
    const int t0 = blockIdx.x * IDX_KEYS_PER_BLOCK;
    if (n_vis <= topk || t0 >= n_vis) return;
    const float *q = iq + (long long)s * ih * ihd;
    for (int i = threadIdx.x; i < ih * ihd; i += blockDim.x) qs[(i / ihd) * (ihd + 1) + i % ihd] = q[i];
    for (int i = threadIdx.x; i < ih; i += blockDim.x) ws[i] = __fmul_rn(hw[(long long)s * ih + i], wscale);
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int t1 = min(t0 + IDX_KEYS_PER_BLOCK, n_vis);
    for (int t = t0 + warp; t < t1; t += nw) {
        const float *kr = kidx + (long long)t * ihd;
        float tot = 0.f;
        for (int hh = lane; hh < ih; hh += 32) {
            const float *qr = qs + hh * (ihd + 1);
            float d = 0.f;
            for (int k = 0; k < ihd; k++) d = fmaf(qr[k], kr[k], d);
            tot = fmaf(ws[hh], fmaxf(__fmul_rn(d, qscale), 0.f), tot);
        }
        tot = warp_sum(tot);
        if (lane == 0) score[(long long)s * T + t] = tot;
    }
}

extern "C" __global__ void indexer_scores(const float *iq, const float *kidx, const float *hw, int ih, int ihd,
                                          int start, int T, float qscale, float wscale, int topk, float *score) {
    COLI_PDL_ENTRY();
    indexer_scores_body(iq, kidx, hw, ih, ihd, start, T, qscale, wscale, topk, score);
}

// indexer_scores_dyn: the same with (start, T) = (posT[0], posT[1]) read from device memory, for a decode step
// replayed from a CUDA graph (coli/gpu/graphs.py): grid (ceil(capacity / 64), S); blocks past T return at once.
extern "C" __global__ void indexer_scores_dyn(const float *iq, const float *kidx, const float *hw, int ih, int ihd,
                                              const int *posT, float qscale, float wscale, int topk, float *score) {
    COLI_PDL_ENTRY();
    indexer_scores_body(iq, kidx, hw, ih, ihd, posT[0], posT[1], qscale, wscale, topk, score);
}

// ---- topk_select ---------------------------------------------------------------------------------------
// idx[s, 0 .. k) = the k = min(topk, n_vis) best visible keys of row s in ascending key order (ties at the
// threshold: the lowest key indices), cnt[s] = k.  idx [S, kmax] int32 (kmax >= k), cnt [S] int32.
//   grid S, block 1024. Radix select on the order-preserving uint32 image of the fp32 scores (4 passes of
//   8 bits over the row, histograms in shared memory), then one ordered compaction pass.
__device__ inline uint32_t order_key(float f) {
    uint32_t u = __float_as_uint(f);
    return u ^ ((u >> 31) ? 0xffffffffu : 0x80000000u);
}

// Warp 0: v[0..nw) <- exclusive prefix sums of v, *total <- their sum.
__device__ inline void block_exclusive_scan(int *v, int nw, int lane, int *total) {
    const int a = lane < nw ? v[lane] : 0;
    int x = a;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane < nw) v[lane] = x - a;
    if (lane == 31) *total = x;
}

__device__ __forceinline__ void topk_select_body(const float *score, int T, int start, int topk, int kmax, int *idx,
                                                 int *cnt) {
    __shared__ unsigned hist[256];
    __shared__ unsigned s_prefix, s_mask;
    __shared__ int s_krem, s_base_eq, s_base_out;
    __shared__ int w_eq[32], w_sel[32], s_tot;
    const int s = blockIdx.x;
    const int n = min(start + s + 1, T);
    int *out = idx + (long long)s * kmax;
    if (n <= topk) {
        for (int j = threadIdx.x; j < n; j += blockDim.x) out[j] = j;
        if (threadIdx.x == 0) cnt[s] = n;
        return;
    }
    const float *row = score + (long long)s * T;
    if (threadIdx.x == 0) { s_prefix = 0; s_mask = 0; s_krem = topk; s_base_eq = 0; s_base_out = 0; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const unsigned prefix = s_prefix, mask = s_mask;
        for (int t = threadIdx.x; t < n; t += blockDim.x) {
            uint32_t u = order_key(row[t]);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int krem = s_krem, cum = 0;
            for (int d = 255; d >= 0; d--) {
                int hcount = (int)hist[d];
                if (cum + hcount >= krem) {
                    s_prefix = prefix | ((unsigned)d << shift);
                    s_mask = mask | (255u << shift);
                    s_krem = krem - cum;
                    break;
                }
                cum += hcount;
            }
        }
        __syncthreads();
    }
    const uint32_t thr = s_prefix;
    const int need_eq = s_krem;                  // keys equal to the threshold to take (the first ones)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const unsigned lt_mask = (1u << lane) - 1u;
    for (int c0 = 0; c0 < n; c0 += blockDim.x) {
        const int t = c0 + threadIdx.x;
        const uint32_t u = t < n ? order_key(row[t]) : 0u;
        const bool gt = t < n && u > thr, eq = t < n && u == thr;
        const unsigned b_eq = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) w_eq[warp] = __popc(b_eq);
        __syncthreads();
        if (warp == 0) block_exclusive_scan(w_eq, nw, lane, &s_tot);
        __syncthreads();
        const int eq_rank = s_base_eq + w_eq[warp] + __popc(b_eq & lt_mask);
        const int tot_eq = s_tot;
        const bool sel = gt || (eq && eq_rank < need_eq);
        const unsigned b_sel = __ballot_sync(0xffffffffu, sel);
        if (lane == 0) w_sel[warp] = __popc(b_sel);
        __syncthreads();
        if (warp == 0) block_exclusive_scan(w_sel, nw, lane, &s_tot);
        __syncthreads();
        if (sel) out[s_base_out + w_sel[warp] + __popc(b_sel & lt_mask)] = t;
        const int tot_sel = s_tot;
        __syncthreads();
        if (threadIdx.x == 0) { s_base_eq += tot_eq; s_base_out += tot_sel; }
        __syncthreads();
    }
    if (threadIdx.x == 0) cnt[s] = topk;
}

extern "C" __global__ void __launch_bounds__(1024) topk_select(const float *score, int T, int start, int topk,
                                                               int kmax, int *idx, int *cnt) {
    COLI_PDL_ENTRY();
    topk_select_body(score, T, start, topk, kmax, idx, cnt);
}

// topk_select_dyn: the same with (start, T) = (posT[0], posT[1]) read from device memory (graph replay). A row
// with n_vis <= topk gets idx = 0 .. n_vis-1 and cnt = n_vis, which mla_attend reads exactly as the dense mask.
extern "C" __global__ void __launch_bounds__(1024) topk_select_dyn(const float *score, const int *posT, int topk,
                                                                   int kmax, int *idx, int *cnt) {
    COLI_PDL_ENTRY();
    topk_select_body(score, posT[1], posT[0], topk, kmax, idx, cnt);
}

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

// ---- indexer_scores_rows -------------------------------------------------------------------------------
// indexer_scores for a prefill, bit for bit (hence the same top-k, the same tokens), with each loaded value feeding
// several FMAs: a block takes IDXR_ROWS consecutive rows and a run of key tiles; a tile of IDXR_TILE keys is staged in
// shared memory, warp w takes its keys w*IDXR_KPW .. +IDXR_KPW, lane h is index head h (as in indexer_scores) and
// keeps an IDXR_ROWS x IDXR_KPW register tile of dot products: per 4 columns, IDXR_ROWS q float4s (its head's
// rows, conflict-free: swizzled) and IDXR_KPW key float4s (the same address on every lane: broadcast) feed
// 4 * IDXR_ROWS * IDXR_KPW FMAs (indexer_scores: one FMA per two loads).
// The arithmetic per score is indexer_scores' own: each dot an fmaf chain over k = 0 .. ihd-1 from 0, then
// tot = fmaf(ws[h], relu(d * qscale), 0) per head (idle lanes h >= ih: +0) and warp_sum's butterfly tree over the 32
// lanes, done as a reduce-scatter (the same additions; each sum on one lane, below).
//   iq [S, ih, ihd], kidx [T, ihd], hw [S, ih], score [S, T]: as indexer_scores; ih <= 32, ihd % 4 == 0 (the host
//   takes indexer_scores otherwise). Rows with n_vis <= topk and entries t >= n_vis of a row are not written.
//   grid (ceil(ceil(T / IDXR_TILE) / tiles_per_block), ceil(S / IDXR_ROWS)), block 32 * IDXR_WARPS = 128; block y
//   takes the rows of group gridDim.y-1-y (the longest rows first: they have the most keys), block x the key tiles
//   x*tiles_per_block .. +tiles_per_block (blocks past the group's last row's n_vis return at once).
//   dynamic smem = (IDXR_ROWS * ih + IDXR_TILE) * ihd * 4 bytes (96 KiB at GLM-5's ih 32, ihd 128: within sm_86/89's
//   99 KiB; 2 blocks per SM on sm_90). One key buffer: a block waits for its tile's copy, another block on the SM
//   computes meanwhile (two tile buffers would not fit 99 KiB). Copies are cp.async (sm_80+): q 4 bytes a piece (any
//   alignment), keys 16 bytes where kidx is 16-byte aligned, else 4; keys past T zero-filled (computed, never written).
#define IDXR_ROWS 4          // rows per block (R)
#define IDXR_WARPS 4         // warps per block
#define IDXR_KPW 16          // keys per warp per tile (J)
#define IDXR_TILE (IDXR_WARPS * IDXR_KPW)   // keys per tile
static_assert(IDXR_ROWS * IDXR_KPW == 64, "the head sum's reduce-scatter leaves a lane 2 of a thread's 64 scores");

__device__ inline void idxr_cp16(void *dst, const void *src, bool on) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa), "l"(src), "r"(on ? 16 : 0));
}

__device__ inline void idxr_cp4(void *dst, const void *src, bool on) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(sa), "l"(src), "r"(on ? 4 : 0));
}

// One step of the head sum's reduce-scatter over lane bit O: of v[0 .. 2 HALF), keep the half lane bit O selects, in
// v[0 .. HALF), plus lane ^ O's copy of it (warp_sum's addition at this step: own + partner's).
template <int O, int HALF>
__device__ __forceinline__ void idxr_scatter_step(float *v, int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int p = 0; p < HALF; p++) {
        const float send = up ? v[p] : v[p + HALF];
        const float keep = up ? v[p + HALF] : v[p];
        v[p] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

extern "C" __global__ void __launch_bounds__(32 * IDXR_WARPS) indexer_scores_rows(
        const float *iq, const float *kidx, const float *hw, int ih, int ihd, int start, int S, int T, float qscale,
        float wscale, int topk, int tiles_per_block, float *score) {
    COLI_PDL_ENTRY();
    extern __shared__ float4 idxr_smem[];
    const int nc = ihd >> 2;                          // float4s per q / key row
    const int sw = min(nc & -nc, 8) - 1;              // q's swizzle: float4 c of head h at c ^ (h & sw) (< nc)
    float4 *qs = idxr_smem;                           // [IDXR_ROWS][ih][nc], swizzled
    float4 *ks = idxr_smem + IDXR_ROWS * ih * nc;     // [IDXR_TILE][nc]
    const int s0 = (gridDim.y - 1 - blockIdx.y) * IDXR_ROWS;
    const int nmax = min(start + min(s0 + IDXR_ROWS, S), T);     // n_vis of the block's last row: the most keys
    if (nmax <= topk) return;                         // no row of the block needs scores
    const int t_begin = blockIdx.x * tiles_per_block * IDXR_TILE;
    const int t_end = min(t_begin + tiles_per_block * IDXR_TILE, nmax);
    if (t_begin >= t_end) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = min(lane, ih - 1);                  // lanes past ih compute head ih-1's dots and add 0

    // the block's q rows (rows past S: zeros) and this lane's head weights
    const int qn = ih * ihd;                          // floats of one row's q
    for (int i = threadIdx.x; i < IDXR_ROWS * qn; i += blockDim.x) {
        const int r = i / qn, hk = i - r * qn, hh = hk / ihd, k = hk - hh * ihd;
        const bool on = s0 + r < S;
        float *dst = reinterpret_cast<float *>(qs + (r * ih + hh) * nc + ((k >> 2) ^ (hh & sw))) + (k & 3);
        idxr_cp4(dst, on ? iq + (long long)(s0 + r) * qn + hk : iq, on);
    }
    float wsv[IDXR_ROWS];
#pragma unroll
    for (int r = 0; r < IDXR_ROWS; r++)
        wsv[r] = s0 + r < S ? __fmul_rn(hw[(long long)(s0 + r) * ih + h], wscale) : 0.f;
    const bool k16 = (reinterpret_cast<unsigned long long>(kidx) & 15ull) == 0;

    for (int t0 = t_begin; t0 < t_end; t0 += IDXR_TILE) {
        __syncthreads();                              // every warp is done with the previous tile
        if (k16) {
            for (int i = threadIdx.x; i < IDXR_TILE * nc; i += blockDim.x) {
                const int t = t0 + i / nc;
                const float *src = t < T ? kidx + ((long long)t0 * nc + i) * 4 : kidx;
                idxr_cp16(ks + i, src, t < T);
            }
        } else {
            for (int i = threadIdx.x; i < IDXR_TILE * ihd; i += blockDim.x) {
                const int t = t0 + i / ihd;
                idxr_cp4(reinterpret_cast<float *>(ks) + i, t < T ? kidx + (long long)t0 * ihd + i : kidx, t < T);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();

        float acc[IDXR_ROWS][IDXR_KPW];               // [row][key] dots of head h
#pragma unroll
        for (int r = 0; r < IDXR_ROWS; r++)
#pragma unroll
            for (int j = 0; j < IDXR_KPW; j++) acc[r][j] = 0.f;
        const float4 *kw = ks + warp * IDXR_KPW * nc;  // this warp's keys
        const float4 *qh = qs + h * nc;
        const int hs = h & sw;
#pragma unroll 2
        for (int c = 0; c < nc; c++) {                // columns 4c .. 4c+3, in order: each dot a sequential chain
            float4 qv[IDXR_ROWS];
#pragma unroll
            for (int r = 0; r < IDXR_ROWS; r++) qv[r] = qh[r * ih * nc + (c ^ hs)];
#pragma unroll
            for (int j = 0; j < IDXR_KPW; j++) {
                const float4 kv = kw[j * nc + c];
#pragma unroll
                for (int r = 0; r < IDXR_ROWS; r++) {
                    float d = acc[r][j];
                    d = fmaf(qv[r].x, kv.x, d);
                    d = fmaf(qv[r].y, kv.y, d);
                    d = fmaf(qv[r].z, kv.z, d);
                    d = fmaf(qv[r].w, kv.w, d);
                    acc[r][j] = d;
                }
            }
        }
        // per (row, key): indexer_scores' head sum over the lanes, as a reduce-scatter: at the step over lane bit o,
        // of the m values a lane still holds, it keeps the half its bit o selects, sends the other half to lane ^ o
        // and adds what that lane sends -- the pairs warp_sum adds at that step, the same additions in the same tree
        // (each sum lands on one lane instead of all), 62 shuffles for the 64 values instead of 320. Value x =
        // r * IDXR_KPW + j ends on lane x / 2 (its bits 1..5 are the lane's bits 0..4, kept in order), in v[x % 2].
        float v[IDXR_ROWS * IDXR_KPW];
#pragma unroll
        for (int r = 0; r < IDXR_ROWS; r++)
#pragma unroll
            for (int j = 0; j < IDXR_KPW; j++)
                v[r * IDXR_KPW + j] = lane < ih ? fmaf(wsv[r], fmaxf(__fmul_rn(acc[r][j], qscale), 0.f), 0.f) : 0.f;
        idxr_scatter_step<16, 32>(v, lane);
        idxr_scatter_step<8, 16>(v, lane);
        idxr_scatter_step<4, 8>(v, lane);
        idxr_scatter_step<2, 4>(v, lane);
        idxr_scatter_step<1, 2>(v, lane);
        const int r = lane >> 3, s = s0 + r;          // lane's values: x = 2 lane, 2 lane + 1
        const int n_vis = min(start + s + 1, T);
        const int t = t0 + warp * IDXR_KPW + 2 * (lane & 7);
        if (s < S && n_vis > topk) {
            if (t < n_vis) score[(long long)s * T + t] = v[0];
            if (t + 1 < n_vis) score[(long long)s * T + t + 1] = v[1];
        }
    }
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

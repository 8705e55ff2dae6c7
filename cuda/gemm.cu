// gemm.cu -- tiled fp32 GEMM over stored (quantised) weights, for prefill (S > 1) and the per-head
// products of absorbed MLA; plus the grouped MoE prefill (a batched GEMM per expert over its tokens).
//
// Tile 64 x 64 x 16, 256 threads, 4 x 4 outputs per thread, fp32 FFMA (no TF32). Weights are dequantised
// element by element into shared memory (deq() in coli_common.cuh gives exactly numpy's dequantize()).
// Instantiated per weight format: NAME_f32, NAME_bf16, NAME_int8, NAME_int4.
#include "coli_common.cuh"

#define BM 64
#define BN 64
#define BK 16
#define GEMM_THREADS 256

// acc[b][i][j] += sum_k A[arow(m0 + ty + 16 i), k] * B_b[k, n0 + tx + 16 j]
//   A rows: a_rows ? a_rows[m] : m (m < M), row stride lda; B_b from stored matrix W[b]:
//   NT: B_b[k, n] = W_b[wrow0[b] + n, k] (n < N over rows, k < K over columns)
//   NN: B_b[k, n] = W_b[wrow0[b] + k, n] (k < K over rows, n < N over columns)
template <int FMT, bool NN, int NB>
__device__ inline void gemm_mainloop(const float *A, long long lda, const int *a_rows, int m0, int M,
                                     const QMat *W, const int *wrow0, int n0, int N, int K,
                                     float (&acc)[NB][4][4]) {
    __shared__ float As[BK][BM + 4];
    __shared__ float Bs[NB][BK][BN + 4];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int am = tid >> 2, ak = (tid & 3) * 4;
    const float *arow = nullptr;
    if (m0 + am < M) arow = A + (long long)(a_rows ? a_rows[m0 + am] : m0 + am) * lda;
    const int bn = tid >> 2, bk = (tid & 3) * 4;        // NT loader: fixed row n0 + bn
    const int nk = tid >> 4, nn = (tid & 15) * 4;       // NN loader: row k0 + nk, columns n0 + nn ..
    const u8 *bd[NB], *bm[NB];
#pragma unroll
    for (int b = 0; b < NB; b++) {
        bd[b] = bm[b] = nullptr;
        if (!NN && n0 + bn < N) qmat_row(W[b], wrow0[b] + n0 + bn, bd[b], bm[b]);
    }
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[b][i][j] = 0.f;

    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int k = k0 + ak + i;
            As[ak + i][am] = (arow && k < K) ? arow[k] : 0.f;
        }
#pragma unroll
        for (int b = 0; b < NB; b++) {
            if (NN) {
                int row = k0 + nk;
                const u8 *d = nullptr, *m = nullptr;
                if (row < K) qmat_row(W[b], wrow0[b] + row, d, m);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int n = n0 + nn + i;
                    Bs[b][nk][nn + i] = (row < K && n < N) ? deq<FMT>(d, m, n, W[b].group) : 0.f;
                }
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int k = k0 + bk + i;
                    Bs[b][bk + i][bn] = (bd[b] && k < K) ? deq<FMT>(bd[b], bm[b], k, W[b].group) : 0.f;
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk++) {
            float a[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int b = 0; b < NB; b++) {
                float bv[4];
#pragma unroll
                for (int j = 0; j < 4; j++) bv[j] = Bs[b][kk][tx + 16 * j];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) acc[b][i][j] = fmaf(a[i], bv[j], acc[b][i][j]);
            }
        }
        __syncthreads();
    }
}

// ---- gemm_nt_<fmt> / gemm_nn_<fmt> ------------------------------------------------------------------
// For z = blockIdx.z (a head, or 0):
//   NT: C[z][m, n] = sum_k A[z][m, k] * W[wrow0 + z*wz + n, k]     (x @ W.T, the linear layer)
//   NN: C[z][m, n] = sum_k A[z][m, k] * W[wrow0 + z*wz + k, n]     (q_nope @ w_kb, absorbed MLA)
//   A[z][m, k] = A[z*a_z + m*lda + k]; C[z][m, n] = C[z*c_z + m*ldc + n]; m < M, n < N, k < K.
//   grid (ceil(N/64), ceil(M/64), Z), block 256.
template <int FMT, bool NN>
__device__ void gemm_body(const float *A, long long lda, long long a_z, int M, QMat W, int wrow0, int wz,
                          int N, int K, float *C, long long ldc, long long c_z) {
    const int z = blockIdx.z, m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int r0 = wrow0 + z * wz;
    float acc[1][4][4];
    gemm_mainloop<FMT, NN, 1>(A + z * a_z, lda, nullptr, m0, M, &W, &r0, n0, N, K, acc);
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int m = m0 + ty + 16 * i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int n = n0 + tx + 16 * j;
            if (n < N) C[z * c_z + m * ldc + n] = acc[0][i][j];
        }
    }
}

#define GEMM_KERNELS(NAME, FMT)                                                                               \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                                \
    gemm_nt_##NAME(const float *A, long long lda, long long a_z, int M, QMAT_PARAMS(w), int wrow0, int wz,    \
                   int N, int K, float *C, long long ldc, long long c_z) {                                    \
        COLI_PDL_ENTRY();                                                                                     \
        gemm_body<FMT, false>(A, lda, a_z, M, QMAT_MAKE(w, FMT), wrow0, wz, N, K, C, ldc, c_z);              \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                                \
    gemm_nn_##NAME(const float *A, long long lda, long long a_z, int M, QMAT_PARAMS(w), int wrow0, int wz,    \
                   int N, int K, float *C, long long ldc, long long c_z) {                                    \
        COLI_PDL_ENTRY();                                                                                     \
        gemm_body<FMT, true>(A, lda, a_z, M, QMAT_MAKE(w, FMT), wrow0, wz, N, K, C, ldc, c_z);               \
    }
COLI_FOR_FORMATS(GEMM_KERNELS)

// ---- grouped MoE prefill ----------------------------------------------------------------------------
// The host sorts the (token, slot) pairs of a layer's routing by expert: pair p has token pair_token[p],
// slot pair_slot[p] (0..K-1) and routing weight pair_w[p]; experts' pairs are contiguous. A work tile
// covers up to 64 pairs of one expert: tiles[3 t .. 3 t + 2] = (expert table index g, first pair, count).
//
// moe_gateup_gemm_<fmt>: Hb[p, j] = silu(x[token p] . gate_g[j]) * (x[token p] . up_g[j])
//   x [S, cols] fp32, Hb [P, rows] fp32; records table[g] (+ gate_off / up_off), gate/up [rows=Im, cols=H].
//   grid (n_tiles, ceil(Im/64)), block 256.
template <int FMT>
__device__ void moe_gateup_gemm_body(const u8 *const *table, long long gate_off, long long up_off, int rows,
                                     int cols, int group, int rpt, long long tile_bytes, const int *tiles,
                                     const int *pair_token, const float *x, float *hb) {
    const int g = tiles[3 * blockIdx.x], p0 = tiles[3 * blockIdx.x + 1], cnt = tiles[3 * blockIdx.x + 2];
    const int n0 = blockIdx.y * BN;
    QMat W[2];
    W[0] = make_qmat<FMT>(table[g] + gate_off, rows, cols, group, rpt, tile_bytes);
    W[1] = make_qmat<FMT>(table[g] + up_off, rows, cols, group, rpt, tile_bytes);
    const int r0[2] = {0, 0};
    float acc[2][4][4];
    gemm_mainloop<FMT, false, 2>(x, cols, pair_token + p0, 0, cnt, W, r0, n0, rows, cols, acc);
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int m = ty + 16 * i;
        if (m >= cnt) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int n = n0 + tx + 16 * j;
            if (n < rows) hb[(long long)(p0 + m) * rows + n] = __fmul_rn(silu_f(acc[0][i][j]), acc[1][i][j]);
        }
    }
}

// moe_down_gemm_<fmt>: Y[token p, slot p, n] = pair_w[p] * (Hb[p] . down_g[n])
//   Hb [P, cols=Im], down [rows=H, cols=Im] at down_off, Y [S, K, H] fp32 (every (token, slot) written once).
//   grid (n_tiles, ceil(H/64)), block 256.
template <int FMT>
__device__ void moe_down_gemm_body(const u8 *const *table, long long down_off, int rows, int cols, int group,
                                   int rpt, long long tile_bytes, const int *tiles, const int *pair_token,
                                   const int *pair_slot, const float *pair_w, const float *hb, int K, float *Y) {
    const int g = tiles[3 * blockIdx.x], p0 = tiles[3 * blockIdx.x + 1], cnt = tiles[3 * blockIdx.x + 2];
    const int n0 = blockIdx.y * BN;
    QMat W = make_qmat<FMT>(table[g] + down_off, rows, cols, group, rpt, tile_bytes);
    const int r0 = 0;
    float acc[1][4][4];
    gemm_mainloop<FMT, false, 1>(hb + (long long)p0 * cols, cols, nullptr, 0, cnt, &W, &r0, n0, rows, cols, acc);
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int m = ty + 16 * i;
        if (m >= cnt) continue;
        const int p = p0 + m;
        float *yrow = Y + ((long long)pair_token[p] * K + pair_slot[p]) * rows;
        const float w = pair_w[p];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int n = n0 + tx + 16 * j;
            if (n < rows) yrow[n] = __fmul_rn(acc[0][i][j], w);
        }
    }
}

#define MOE_GEMM_KERNELS(NAME, FMT)                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                                \
    moe_gateup_gemm_##NAME(const u8 *const *table, long long gate_off, long long up_off, int rows, int cols,  \
                           int group, int rpt, long long tile_bytes, const int *tiles, const int *pair_token,  \
                           const float *x, float *hb) {                                                       \
        COLI_PDL_ENTRY();                                                                                     \
        moe_gateup_gemm_body<FMT>(table, gate_off, up_off, rows, cols, group, rpt, tile_bytes, tiles,          \
                                  pair_token, x, hb);                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                                \
    moe_down_gemm_##NAME(const u8 *const *table, long long down_off, int rows, int cols, int group, int rpt,  \
                         long long tile_bytes, const int *tiles, const int *pair_token, const int *pair_slot,  \
                         const float *pair_w, const float *hb, int K, float *Y) {                             \
        COLI_PDL_ENTRY();                                                                                     \
        moe_down_gemm_body<FMT>(table, down_off, rows, cols, group, rpt, tile_bytes, tiles, pair_token,        \
                                pair_slot, pair_w, hb, K, Y);                                                 \
    }
COLI_FOR_FORMATS(MOE_GEMM_KERNELS)

// ---- moe_reduce ---------------------------------------------------------------------------------------
// out[s, n] (+)= sum_{k < K} Y[s, k, n], slots summed in order; with a mask (uint8 [S, K], non-null) only the slots
// whose mask[s, k] is set: a batch of a prefill's experts wrote those rows of Y and the others are never read (without
// a mask they had to be zeroed: the same bits, a skipped slot being a zero added).  grid-stride over S * H, block 256.
extern "C" __global__ void moe_reduce(const float *Y, const unsigned char *mask, int S, int K, int H, float *out,
                                      int accumulate) {
    COLI_PDL_ENTRY();
    const long long total = (long long)S * H;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long s = i / H, n = i - s * H;
        const float *y = Y + s * K * H + n;
        const unsigned char *m = mask ? mask + s * K : nullptr;
        float a = accumulate ? out[i] : 0.f;
        for (int k = 0; k < K; k++)
            if (!m || m[k]) a = __fadd_rn(a, y[(long long)k * H]);
        out[i] = a;
    }
}

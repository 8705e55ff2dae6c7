// moe_mma.cu -- the fused routed-expert MoE decode for int4 weights on the tensor cores (integer MMA), exact.
//
// Why: the scalar kernels (gemv.cu, v1-v3) spend ~4 instructions per int4 weight (nibble -> float, bias, FMA,
// share of the x reads) and stall at ~45 % of the device copy rate while a kernel that only READS the same bytes
// reaches ~91 % (scripts/moe_kernel_sweep.py). Here a weight costs ~0.4 integer instructions to unpack and the
// multiply-adds run as mma.sync.m16n8k32 (u8 x s8 -> s32), 4096 multiply-adds per warp instruction.
//
// Exactness. The weights enter as their unsigned nibbles q (0..15); x is cut into 64-column blocks and each block
// into FOUR int8 parts with a shared exponent E (2^E <= max |x| < 2^(E+1)):
//     x = 2^(E-5) (b0 + b1 / 2^7 + b2 / 2^14 + b3 / 2^21) + (an error below 2^(E-27) per element),
// |b_p| <= 64. Every product q * b_p and every sum of them is an exact integer (|sum| < 2^24), and
// sum (q - 8) b_p = sum q b_p - 8 sum b_p (the block's part sums, precomputed), so a 64-column block's
// dot product for part p is an exact integer; it is then scaled by 2^(E-5-7p) and by the row's group scale in
// fp32. The only roundings are those fp32 scalings/additions and the 2^(E-27) truncation of elements much
// smaller than their block's largest -- far below the fp32 rounding the numpy reference itself makes.
//
// Layouts (dimension legend: C = columns, nchunk = C / 32, nblk = C / 64; a "chunk" is 32 columns = 16 bytes of
// int4 weights, what one lane loads at once):
//   split x:  q [nchunk][4 parts][8 words] int8, word 2i holds the part at chunk columns 8i + 0, 2, 4, 6 and
//             word 2i + 1 at 8i + 1, 3, 5, 7 (the order the lane's unpacked nibbles come in: low, high nibbles);
//             cx [nblk][4] int32 (sum of b_p over the block), fx [nblk][4] fp32 (2^(E-5-7p); NaN if the block
//             has a non-finite value, so that NaN/inf propagate as in the reference).
//   MMA tile: 16 weight rows; lane (g = lane / 4, t = lane % 4) holds rows g and g + 8, and at step s loads chunk
//             4 s + t of both (step = 128 columns = two 64-column x blocks: t = 0, 1 -> block 2 s, t = 2, 3 ->
//             block 2 s + 1). The MMA's n = 8 columns are (x block of the step, part): n = 4 (t / 2) + p; lane
//             (g, t) feeds n = g's part, zero unless its block is g / 4 -- the two blocks' sums stay apart, so each
//             gets its own exponent and group scale. D lane (g, t): n = 2t, 2t + 1 = block t / 2, parts 2 (t % 2),
//             2 (t % 2) + 1, rows g and g + 8.
// Requirements (the host checks them in mma_layout_ok / _mma_fits; otherwise the gemv.cu kernels run): int4,
// group 64 or 128, C % 128 == 0, gate/up rows % 64 == 0, down rows % (16 MMA_DT) == 0, 1 <= K <= 8, and the
// shared memory of both kernels within the device's per-block limit.
#include "coli_common.cuh"

#define MMA_MAXK 8
#define MMA_WARPS 8                // warps per block (both kernels): MMA_THREADS in cuda_backend.py
#ifndef MMA_D
#define MMA_D 4                    // gate/up: steps of weights in flight per warp (register ring)
#endif
#ifndef MMA_DT
#define MMA_DT 2                   // down: 16-row tiles per warp (block = 16 MMA_DT output rows): B read once
#endif
#ifndef MMA_DD
#define MMA_DD 2                   // down: steps in flight per warp (each MMA_DT x 2 rows)
#endif
#ifndef MMA_L2PF
#define MMA_L2PF 128               // L2 fetch size hint of the weight loads in bytes (0: none; 64, 128 or 256)
#endif
#ifndef MMA_MINB
#define MMA_MINB 2                 // blocks per SM asked of the register allocator
#endif

// 16-byte streaming load of weights with an L2 fetch-size hint: a lane reads 16 bytes of a row per step and the
// row's next bytes in the following steps, so asking L2 to fetch MMA_L2PF bytes around the access turns the
// next steps' loads into L2 hits.
__device__ inline uint4 ld_weights(const u8 *p) {
#if MMA_L2PF == 256
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#elif MMA_L2PF == 128
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#elif MMA_L2PF == 64
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::64B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return ld_stream(p);
#endif
}

// D (int32 x 4) += A (16 x 32 u8, row) * B (32 x 8 s8, col)
__device__ inline void mma_u8s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- splitting 64 columns into four int8 parts --------------------------------------------------------------
// One warp, 64 values v[0..63] (lane: columns 2 lane, 2 lane + 1) of x block X -> its q words, cx[4], fx[4].
// q points at the block's first chunk (two chunks: [2][4][8] words).
__device__ inline void split_block64(float v0, float v1, int lane, u8 *q, int *cx, float *fx) {
    // fmaxf drops NaNs, so finiteness is voted on separately
    const bool finite = !__any_sync(0xffffffffu, !(isfinite(v0) && isfinite(v1)));
    const float m = finite ? warp_max(fmaxf(fabsf(v0), fabsf(v1))) : 0.f;
    int e;
    frexpf(m, &e);                       // m = f 2^e, f in [0.5, 1): 2^(e-1) <= m < 2^e
    const int E = m > 0.f ? e - 1 : 0;
    float u[2] = {finite ? ldexpf(v0, 5 - E) : 0.f, finite ? ldexpf(v1, 5 - E) : 0.f};   // |u| < 64, exact
#pragma unroll
    for (int p = 0; p < 4; p++) {
        int b[2];
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const float r = rintf(u[c]);
            b[c] = (int)r;
            u[c] = (u[c] - r) * 128.f;  // exact: |u - r| <= 1/2
        }
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int col = 2 * lane + c;             // column in the block
            const int chunk = col >> 5, cc = col & 31, i = cc >> 3, jj = cc & 7;
            q[((chunk * 4 + p) * 8 + 2 * i + (jj & 1)) * 4 + (jj >> 1)] = (u8)(signed char)b[c];
        }
        int s = b[0] + b[1];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) {
            cx[p] = s;
            fx[p] = finite ? ldexpf(1.f, E - 5 - 7 * p) : __int_as_float(0x7fc00000);
        }
    }
}

// ---- moe_split_x4 --------------------------------------------------------------------------------------------
// v [nvec, cols] fp32 -> q [nvec][cols / 32][4][8] words, cx [nvec][cols / 64][4], fx [nvec][cols / 64][4].
//   grid (cols / 64, nvec), block 32. (Splitting x inside the gate/up kernel instead -- every block for itself,
//   while its first weights are in flight -- measured 13 % slower on the H200: the split's ~1200 instructions
//   per warp do not hide behind the loads.)
extern "C" __global__ void moe_split_x4(const float *v, int nvec, int cols, u8 *q, int *cx, float *fx) {
    COLI_PDL_ENTRY();
    const int X = blockIdx.x, z = blockIdx.y, lane = threadIdx.x;
    const float *src = v + (long long)z * cols + 64 * X;
    const long long nchunk = cols / 32, nblk = cols / 64;
    split_block64(src[2 * lane], src[2 * lane + 1], lane, q + (z * nchunk + 2 * X) * 128,
                  cx + (z * nblk + X) * 4, fx + (z * nblk + X) * 4);
}

// ---- the shared step ------------------------------------------------------------------------------------------
// One warp's pass over steps [s0, s1) of T 16-row tiles over the same columns: tile u's rows (g, g + 8) at data
// rs.d[2u], rs.d[2u + 1] (+ chunk offsets) and metadata rs.m[..]; B (the split x of those columns) in shared
// memory at xq/xc/xf, read once per step for all T tiles. Returns each row's partial dot product in acc[2u + r],
// not yet summed over the four lanes t. D steps of weights are in flight (a register ring). stage() is called
// by every warp after its first weight loads are issued and must fill xq/xc/xf and synchronise the block (so
// every warp of the block calls mma_rows, those without work with s0 == s1).
template <int T>
struct RowSet {
    const u8 *d[2 * T], *m[2 * T];
};

template <int T, int D, typename Stage>
__device__ inline void mma_rows(const RowSet<T> &rs, int s0, int s1, int gsh, const u8 *xq, const int *xc,
                                const float *xf, int lane, float (&acc)[2 * T], Stage stage) {
    constexpr int NR = 2 * T;
    const int g = lane >> 2, t = lane & 3;
    const int half = t >> 1, p0 = 2 * (t & 1);
    const bool feeds = (g >> 2) == half;      // this lane's B column n = g belongs to its x block
    const int pg = g & 3;
    uint4 w[D][NR];
    float sc[D][NR];
    auto load = [&](int i, int s) {
        if (s < s1) {
            const int chunk = 4 * s + t, X = 2 * s + half;
#pragma unroll
            for (int r = 0; r < NR; r++) {
                w[i][r] = ld_weights(rs.d[r] + 16 * (long long)chunk);
                sc[i][r] = ld_half_nc(rs.m[r] + 2 * (X >> gsh));
            }
        }
    };
#pragma unroll
    for (int i = 0; i < D; i++) load(i, s0 + i);
    stage();      // the block's shared inputs (B), staged while the first weights are on their way
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.f;
    for (int s = s0; s < s1; s += D) {
#pragma unroll
        for (int i = 0; i < D; i++) {
            if (s + i < s1) {
                const int chunk = 4 * (s + i) + t, X = 2 * (s + i) + half;
                uint4 bq0 = make_uint4(0, 0, 0, 0), bq1 = bq0;
                if (feeds) {
                    const uint4 *bp = reinterpret_cast<const uint4 *>(xq + (chunk * 4 + pg) * 32);
                    bq0 = bp[0];
                    bq1 = bp[1];
                }
                const int2 cc = *reinterpret_cast<const int2 *>(xc + 4 * X + p0);
                const float2 ff = *reinterpret_cast<const float2 *>(xf + 4 * X + p0);
                const uint32_t bw[8] = {bq0.x, bq0.y, bq0.z, bq0.w, bq1.x, bq1.y, bq1.z, bq1.w};
#ifdef MMA_READONLY       // diagnostic build (scripts/moe_kernel_sweep.py): the same loads, no arithmetic
#pragma unroll
                for (int r = 0; r < NR; r++)
                    acc[r] += __int_as_float((w[i][r].x ^ w[i][r].y ^ w[i][r].z ^ w[i][r].w ^ bw[0] ^ cc.x) & 0x3fffffu)
                              * sc[i][r] * ff.x;
#else
#pragma unroll
                for (int u = 0; u < T; u++) {
                    const uint4 wa = w[i][2 * u], wb = w[i][2 * u + 1];
                    const uint32_t a0w[4] = {wa.x, wa.y, wa.z, wa.w}, a1w[4] = {wb.x, wb.y, wb.z, wb.w};
                    int d[4] = {0, 0, 0, 0};
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        // word k of the chunk: low nibbles = columns 8k + 0, 2, 4, 6; high = 8k + 1, 3, 5, 7
                        const uint32_t lo0 = a0w[k] & 0x0f0f0f0fu, hi0 = (a0w[k] >> 4) & 0x0f0f0f0fu;
                        const uint32_t lo1 = a1w[k] & 0x0f0f0f0fu, hi1 = (a1w[k] >> 4) & 0x0f0f0f0fu;
                        mma_u8s8(d, lo0, lo1, hi0, hi1, bw[2 * k], bw[2 * k + 1]);
                    }
                    const float sa = sc[i][2 * u], sb = sc[i][2 * u + 1];
                    acc[2 * u] = fmaf(sa * ff.x, (float)(d[0] - 8 * cc.x), acc[2 * u]);
                    acc[2 * u] = fmaf(sa * ff.y, (float)(d[1] - 8 * cc.y), acc[2 * u]);
                    acc[2 * u + 1] = fmaf(sb * ff.x, (float)(d[2] - 8 * cc.x), acc[2 * u + 1]);
                    acc[2 * u + 1] = fmaf(sb * ff.y, (float)(d[3] - 8 * cc.y), acc[2 * u + 1]);
                }
#endif
                load(i, s + i + D);
            }
        }
    }
}

// Sum over the 4 lanes t of a row group (every lane gets it).
__device__ inline float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Start copying n bytes (multiple of 16) global -> shared with the whole block, every 16-byte piece in flight
// at once (cp.async, sm_80+); stage_wait() waits for them and synchronises the block.
__device__ inline void stage_bytes(u8 *dst, const u8 *src, int n) {
    for (int i = threadIdx.x; i < n / 16; i += blockDim.x) {
        const unsigned sa = (unsigned)__cvta_generic_to_shared(dst + 16 * i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src + 16 * (long long)i));
    }
}

__device__ inline void stage_wait() {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

// ---- moe_gateup_mma_int4 ---------------------------------------------------------------------------------------
// h[k][j] = silu(gate_k[j] . x) * (up_k[j] . x) for the K routed experts (table [K] record pointers, gate/up at
// byte offsets gate_off/up_off, [rows = Im, cols = H]); also writes h split for the down kernel
// (hq [K][Im / 32][4][8] words, hc/hf [K][Im / 64][4]). x arrives split (moe_split_x4: xq, xc, xf) and is
// staged into shared memory while the first weights are in flight.
//   grid (K * rows / 64), block 256 (8 warps), dynamic smem = cols / 32 * 128 + cols / 64 * 32 + 256 bytes.
//   Block b: expert k = b / (rows / 64), rows j0 = 64 (b % (rows / 64)) ..; warp w: MMA tile of gate rows
//   j0 + 8w .. + 7 (tile rows 0..7) and up rows j0 + 8w .. + 7 (tile rows 8..15), over all columns.
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, MMA_MINB) moe_gateup_mma_int4(
    const u8 *const *table, long long gate_off, long long up_off, int rows, int cols, int group, int rpt,
    long long tile_bytes, int K, const u8 *xq, const int *xc, const float *xf, float *h, u8 *hq, int *hc,
    float *hf) {
    COLI_PDL_ENTRY();
    extern __shared__ float4 smem4[];
    u8 *sq = reinterpret_cast<u8 *>(smem4);
    const int nchunk = cols / 32, nblk = cols / 64;
    int *sc = reinterpret_cast<int *>(sq + nchunk * 128);
    float *sf = reinterpret_cast<float *>(sc + nblk * 4);
    float *hblk = sf + nblk * 4;                               // [64] this block's h values
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int per_k = rows / 64, k = blockIdx.x / per_k, j0 = 64 * (blockIdx.x - k * per_k) + 8 * warp;
    const QMat proto = make_qmat<FMT_INT4>(nullptr, rows, cols, group, rpt, tile_bytes);
    const u8 *rec = table[k];
    RowSet<1> rs;
    long long doff, moff;
    qmat_row_off(proto, j0 + g, doff, moff);
    rs.d[0] = rec + gate_off + doff; rs.m[0] = rec + gate_off + moff;
    rs.d[1] = rec + up_off + doff;   rs.m[1] = rec + up_off + moff;
    float acc[2];
    mma_rows<1, MMA_D>(rs, 0, cols / 128, group == 128 ? 1 : 0, sq, sc, sf, lane, acc, [&] {
        stage_bytes(sq, xq, nchunk * 128);
        stage_bytes(reinterpret_cast<u8 *>(sc), reinterpret_cast<const u8 *>(xc), nblk * 16);
        stage_bytes(reinterpret_cast<u8 *>(sf), reinterpret_cast<const u8 *>(xf), nblk * 16);
        stage_wait();
    });
    const float gv = quad_sum(acc[0]), uv = quad_sum(acc[1]);
    const float hv = __fmul_rn(silu_f(gv), uv);
    if ((lane & 3) == 0) {
        h[(long long)k * rows + j0 + g] = hv;
        hblk[8 * warp + g] = hv;
    }
    __syncthreads();
    if (warp == 0) {     // split this block's 64 values of h_k (one 64-column block of the down kernel's input)
        const int X = j0 / 64;
        const long long hchunk = rows / 32, hblkn = rows / 64;
        split_block64(hblk[2 * lane], hblk[2 * lane + 1], lane, hq + (k * hchunk + 2 * X) * 128,
                      hc + (k * hblkn + X) * 4, hf + (k * hblkn + X) * 4);
    }
}

// ---- moe_down_mma_int4 -----------------------------------------------------------------------------------------
// y[o] (+)= sum_k wts[k] * (down_k[o] . h[k]), K <= 8, h split (hq, hc, hf as the gate/up kernel writes them);
// down matrices [rows = H, cols = Im] at byte offset down_off of each record.
//   grid (rows / (16 MMA_DT)), block 256 (8 warps), dynamic smem = K * (cols / 32 * 128 + cols / 64 * 32) bytes.
//   Block b: output rows 16 MMA_DT b .. (MMA_DT tiles of 16). Warp w: expert w / S, column slice w % S of
//   S = 8 / K slices (K = 8: one expert per warp, all columns), all MMA_DT tiles at once (B read once per step).
//   Partials summed in a fixed order: deterministic.
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, MMA_MINB) moe_down_mma_int4(
    const u8 *const *table, long long down_off, int rows, int cols, int group, int rpt, long long tile_bytes,
    int K, const float *wts, const u8 *hq, const int *hc, const float *hf, float *y, int accumulate) {
    COLI_PDL_ENTRY();
    constexpr int T = MMA_DT;
    extern __shared__ float4 smem4[];
    __shared__ float red[MMA_WARPS][16 * T];
    const int nchunk = cols / 32, nblk = cols / 64;
    const int qbytes = nchunk * 128, mbytes = nblk * 16;
    u8 *sq = reinterpret_cast<u8 *>(smem4);
    int *sc = reinterpret_cast<int *>(sq + K * qbytes);
    float *sf = reinterpret_cast<float *>(sc + K * nblk * 4);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int S = MMA_WARPS / K, k = warp / S, slice = warp - k * S;
    const int o0 = 16 * T * blockIdx.x;
    const QMat proto = make_qmat<FMT_INT4>(nullptr, rows, cols, group, rpt, tile_bytes);
    const int kk = k < K ? k : 0;         // warps without an expert run an empty pass (they still stage)
    const u8 *rec = table[kk] + down_off;
    RowSet<T> rs;
#pragma unroll
    for (int r = 0; r < 2 * T; r++) {     // tile u = r / 2, row g + 8 (r % 2)
        long long doff, moff;
        qmat_row_off(proto, o0 + 16 * (r >> 1) + g + 8 * (r & 1), doff, moff);
        rs.d[r] = rec + doff;
        rs.m[r] = rec + moff;
    }
    const int nsteps = cols / 128;
    const int s0 = k < K ? slice * nsteps / S : 0, s1 = k < K ? (slice + 1) * nsteps / S : 0;
    float acc[2 * T];
    mma_rows<T, MMA_DD>(rs, s0, s1, group == 128 ? 1 : 0, sq + kk * qbytes, sc + kk * nblk * 4, sf + kk * nblk * 4,
                        lane, acc, [&] {
        stage_bytes(sq, hq, K * qbytes);
        stage_bytes(reinterpret_cast<u8 *>(sc), reinterpret_cast<const u8 *>(hc), K * mbytes);
        stage_bytes(reinterpret_cast<u8 *>(sf), reinterpret_cast<const u8 *>(hf), K * mbytes);
        stage_wait();
    });
    const float wk = k < K ? wts[k] : 0.f;
#pragma unroll
    for (int r = 0; r < 2 * T; r++) {
        const float v = wk * quad_sum(acc[r]);
        if ((lane & 3) == 0) red[warp][16 * (r >> 1) + g + 8 * (r & 1)] = v;
    }
    __syncthreads();
    if (threadIdx.x < 16 * T) {
        float s = 0.f;
        for (int w = 0; w < MMA_WARPS; w++) s += red[w][threadIdx.x];
        const int o = o0 + threadIdx.x;
        y[o] = accumulate ? y[o] + s : s;
    }
}

// prefill_mma.cu -- int4 prefill GEMMs (S > 1) on the tensor cores: integer MMA with exact integer dot products per
// 64 columns, fp32 scaling. The dense linear (pf_linear_int4) and the grouped MoE prefill (pf_gateup_int4: gate and
// up with SiLU * up fused, h written split for down; pf_down_int4: down times the routing weight into each
// (token, slot) row) share one main loop.
//
// Why: the fp32 tiled GEMM (gemm.cu) runs at 2.7-15 TFLOP/s; a 2,048-token GLM-5 prompt needs ~1.24 TFLOP per MoE
// layer, so the layer's compute (83 ms at 15) would not hide under its expert copies (93 ms at 55 GB/s). The
// prediction (docs/perf-notes.md, "prefill on the tensor cores") and the measured figures are there.
//
// Exactness (as moe_mma.cu, with tokens as the MMA's N dimension): activations are cut into 64-column blocks, each
// into FOUR int8 parts with a shared exponent E (2^E <= max |x| < 2^(E+1)):
//     x = 2^(E-5) (b0 + b1 / 2^7 + b2 / 2^14 + b3 / 2^21) + (an error below 2^(E-27) per element),  |b_p| <= 64.
// The weights enter as unsigned nibbles q (0..15); mma.sync.m16n8k32 (u8 x s8 -> s32) sums q * b_p exactly, and its
// accumulator starts at C = MAGIC - 8 sum(b_p) (MAGIC = the bits of 1.5 * 2^23), so after a block's two MMAs it holds
// MAGIC + sum (q - 8) b_p, |sum| <= 8 * 64 * 64 = 2^15: reinterpreted as a float that is 1.5 * 2^23 + the exact dot
// product, and one FADD gives the product itself (no int -> float conversion, which is quarter rate). The four parts
// combine exactly in pairs (F0 + F1 / 2^7 needs 23 bits), then once rounded; the block adds sc * 2^(E-5) * that to
// an fp32 accumulator (one FFMA per 64 columns). The only roundings: that combination, the FFMA per block, and the
// 2^(E-27) truncation of elements much smaller than their block's largest -- below fp32's own summation error
// (tests/gpu/test_gpu_prefill.py measures both against float64).
//
// Layouts (dimension legend: R activation rows, C columns, nG = C / 64 blocks):
//   split x  xq [R][nG][4 parts][4 pieces][16 B] int8: piece t of part p holds the block's columns 16 t + (0 2 4 6
//            1 3 5 7 8 10 12 14 9 11 13 15) -- the order one lane's B fragments need (see the MMA mapping below);
//            xm [R][nG][12] int32: c_A = (ci0, ci1, ci0, ci1), c_B = (ci2, ci3, ci2, ci3), ci_p = MAGIC - 8 sum(b_p)
//            (the MMA accumulators' starts, in D's register order), fe = 2^(E-5) as float bits (NaN if the block holds
//            a non-finite value, so NaN/inf propagate as in the reference), 3 zero words.
//   MMA      one 64-column block = 2 MMAs (m = 0, 1); lane (g, t) feeds, for weight row g (and g + 8), the word 2t + m
//            of the row's 32 bytes: its low nibbles are k = 4t .. 4t+3 (columns 8(2t+m) + 0, 2, 4, 6), its high
//            nibbles k = 16 + 4t .. (columns 8(2t+m) + 1, 3, 5, 7). N = 8 columns = 4 tokens x 2 parts: column n is
//            token n / 2 of the quad, part n % 2 (MMA "A": parts 0, 1; MMA "B": parts 2, 3), so D lane (g, t) holds
//            token t's two parts for rows g and g + 8 and a thread owns all four parts of its (row, token) outputs.
//   Block    PF_ROWS = 256 weight rows x PF_TOKS = 32 activation rows (pairs), 8 warps: warp w covers rows 64 (w % 4)
//            .. + 63 (4 MMA row tiles) and activation rows 16 (w / 4) .. + 15 (4 quads). (256 x 32 rather than
//            128 x 64: a MoE expert's ~64 pairs fill 32-pair tiles better, and a column costs 128 + 128 bytes of
//            staging instead of 64 + 256.) K runs in 64-column blocks through a PF_STAGES-deep
//            cp.async pipeline (weights 8 KiB, split x 8 KiB, its metadata 1.5 KiB per stage); the block's fp16 group
//            scales are staged once. Other shapes (warps of 64 rows x 16 activation rows, PF_THREADS of them) and the
//            variants below are compile-time settings for scripts/pf_kernel_sweep.py; the defaults are the build.
// Requirements (pf_layout_ok in cuda_backend.py; otherwise gemm.cu runs): int4, group 64 or 128 dividing C, C % 64,
// rows % PF_ROWS (linear, down) or Im % (PF_ROWS / 2) (gate/up), 16-byte aligned rows, the shared memory within the
// device's limit.
//
// int8 weights (pf_linear_int8; pf_int8_layout_ok): the same loop over signed bytes q (-127..127, one fp16 scale per
// row). A row's 64 columns stage as 64 bytes; lane (g, t) reads bytes 16 t .. 16 t + 15 of rows g and g + 8 and
// sorts each 8 of them into the even columns (k = 4t ..) and the odd ones (k = 16 + 4t ..) with two PRMTs -- the
// same k order as the nibbles, so the split x is the int4 kernel's. mma.sync s8 x s8 starts at C = MAGIC (no offset:
// the weights are signed), |sum q b_p| <= 64 * 127 * 64 < 2^19, so D read as a float is again 1.5 * 2^23 + the exact
// dot product. The flush is the int4 one with the scale 1 (every PF_EPI variant then gives the same bits); the row's
// scale multiplies the sum once at the end. One difference in rounding: F0 + F1 / 2^7 needs up to 27 bits here (23
// for int4), so the two pairs round too -- two more roundings of 2^-24 of the block's partial sum (the bound in
// tests/test_prefill_mma_formulas.py and tests/gpu/test_gpu_prefill.py counts them). Shared memory: 3 stages of
// 25.5 KiB, no scales: 80.6 KiB, within sm_86/89's 99 KB; rows need not fill whole blocks of PF_ROWS (the rows past
// the end repeat the last one and are not written: kv_a's 576, the indexer's wk 128).
#include "coli_common.cuh"

#ifndef PF_ROWS
#define PF_ROWS 256                    // weight rows per block: PF_ROWS / 64 row warps ...
#endif
#ifndef PF_TOKS
#define PF_TOKS 32                     // ... x PF_TOKS / 16 token warps = 8 warps (cuda_backend.py: the same two)
#endif
#define PF_RW (PF_ROWS / 64)
#define PF_EXLD (PF_ROWS / 2 + 8)      // gate/up's exchange rows, padded: 4 x 8 lanes of a store hit 32 banks
// a warp per 64 rows x 16 activation rows (cuda_backend.pf_threads: the same count); today's 256 x 32 = 8 warps.
// A constant, not a parenthesised macro: __launch_bounds__ takes it, and its text stays one word after -E
// (tests/test_kernels_compile.py reads the kernels' signatures from the preprocessed source)
constexpr int pf_block_threads = 32 * PF_RW * (PF_TOKS / 16);
#define PF_THREADS pf_block_threads
static_assert(PF_ROWS % 64 == 0 && PF_TOKS % 16 == 0 && PF_TOKS <= 64, "warps of 64 rows x 16 activation rows");
static_assert(PF_ROWS <= PF_THREADS && 3 * PF_TOKS <= PF_THREADS, "a thread a row (and a metadata piece) per block");
static_assert(PF_ROWS * 2 % PF_THREADS == 0 && PF_TOKS * 16 % PF_THREADS == 0, "whole copy rounds per stage");
#define PF_SPLIT_THREADS 256           // pf_split_rows: a warp a 64-column block, 8 a block (the host's grid)
#ifndef PF_STAGES
#define PF_STAGES 3
#endif
#ifndef PF_MINB
#define PF_MINB 2                      // blocks per SM asked of the register allocator
#endif
// The flush of a 64-column block (variants for scripts/pf_kernel_sweep.py; every one gives the default's bits):
//   0: f_p = D_p read as a float - MAGIC (4 FADD), the pairs and h (3 FFMA), sc * fe (FMUL), acc (FFMA): 9 per output
//   1: the magic folded into the pairs' FFMA: (M + D0) - (M + M / 128) = D0 - M / 128 exactly, then
//      fma(M + D1, 2^-7, that) = D0 + D1 / 2^7 exactly as before: 2 FADD + 3 FFMA + FMUL + FFMA = 7
//   2: also fe (a power of two) folded in: fma(M + D0, fe, -(M + M / 128) fe) = (D0 - M / 128) fe exactly, the pairs
//      then fe (D0 + D1 / 2^7), h fe rounded once as h was, acc = fma(sc, h fe, acc): 6 FFMA. The same bits while
//      fe M and the products stay normal floats: a block's largest |x| in [2^-98, 2^100] (outside: float range ends)
#ifndef PF_EPI
#define PF_EPI 1                       // the default since the 2026-12-02 sweep: epi1-skip 101.8 vs 98.7 TFLOP/s
#endif
// 1: each thread's copy sources (weight rows, split-x rows, metadata) found once per block, not at every stage
// 2: the same in fewer registers and instructions: a thread copies its split-x pieces from ONE activation row (16 / XK
//    lanes a row, each copy instruction reading contiguous bytes of it), so one pointer where 1 had XK and their
//    sizes; an absent row (past the first nact) copies the last present row instead of zeros -- any valid bytes
//    do, since an MMA column (a token's part) never mixes with another's and no caller writes an absent row's
//    outputs; and the stages' offsets advance by an add instead of G % PF_STAGES (int8's four weight pieces a row
//    keep the table loads: four pointers would not fit its registers)
#ifndef PF_HOIST
#define PF_HOIST 0
#endif
// 1: warps and quads of 4 activation rows past the block's last present row (a partial tile: an expert's last
// pairs, the prompt's last tokens) skip their MMAs and flushes -- the other block on the SM gets those issue slots
// 2: the same, and a warp with all 16 rows present runs its four quads without the per-quad tests (one basic block:
// scripts/pf_sass_counts.py shows a branch between quads keeps ptxas from overlapping one quad's flush with the next
// quad's B loads and MMAs)
#ifndef PF_SKIP
#define PF_SKIP 1                      // the default since the H200 sweep
#endif
// 1: DIAGNOSTIC ONLY, wrong results by design: the flush is one IADD chain + FADD per output (the MMAs and the loads
// as before) -- how fast the loop runs when the per-64-column epilogue costs next to nothing
#ifndef PF_DIAG
#define PF_DIAG 0
#endif
#define PF_MAGIC 0x4B400000            // bits of 1.5 * 2^23
#define PF_MAGIC_F 12582912.0f
#define PF_MAGIC1_F 12681216.0f        // MAGIC + MAGIC / 2^7 (PF_EPI 1, 2: the second part's magic, pre-subtracted)
#define PF_W_BYTES (PF_ROWS * 32)      // one stage: 32 bytes (64 int4 columns) per weight row
#define PF_X_BYTES (PF_TOKS * 256)     //            4 parts x 64 bytes per activation row
#define PF_M_BYTES (PF_TOKS * 48)      //            12 words of metadata per activation row
#define PF_STAGE_BYTES (PF_W_BYTES + PF_X_BYTES + PF_M_BYTES)
// per weight format (FMT_INT4: the macros above; FMT_INT8: 64 bytes per row per 64-column block, no group scales)
template <int FMT>
struct PfFmt {
    static constexpr int WB = FMT == FMT_INT8 ? 64 : 32;              // staged bytes per weight row per block
    static constexpr int W_BYTES = PF_ROWS * WB;
    static constexpr int STAGE = W_BYTES + PF_X_BYTES + PF_M_BYTES;
};
static_assert(PfFmt<FMT_INT4>::STAGE == PF_STAGE_BYTES, "int4's stage is the macros'");

template <bool B>
struct PfBool {                        // a compile-time flag for the main loop's generic lambda
    static constexpr bool value = B;
};

#define PF_LINEAR 0
#define PF_GATEUP 1
#define PF_DOWN 2

__device__ inline void pf_mma(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same with the accumulator's start c in other registers (d = a b + c): the four row tiles of a quad share one c,
// loaded as it is laid out in shared memory, so no copies per tile.
__device__ inline void pf_mma_c(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, const int4 &c) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c.x), "r"(c.y), "r"(c.z),
                   "r"(c.w));
}

// s8 x s8 (int8 weights, signed): d = a b + c.
__device__ inline void pf_mma_ss_c(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, const int4 &c) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c.x), "r"(c.y), "r"(c.z),
                   "r"(c.w));
}
__device__ inline void pf_mma_ss(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, in flight until pf_wait; n = 0 fills zeros (rows past the tile's end).
__device__ inline void pf_cp16(void *dst, const void *src, int n) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa), "l"(src), "r"(n));
}
__device__ inline void pf_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ inline void pf_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// ---- splitting 64 columns into four int8 parts --------------------------------------------------------------
// One warp, the block's values v0, v1 at columns 2 lane, 2 lane + 1 -> q (the block's 256 bytes) and m (12 words).
__device__ inline void pf_split64(float v0, float v1, int lane, u8 *q, int *m) {
    // fmaxf drops NaNs, so finiteness is voted on separately
    const bool finite = !__any_sync(0xffffffffu, !(isfinite(v0) && isfinite(v1)));
    const float mx = finite ? warp_max(fmaxf(fabsf(v0), fabsf(v1))) : 0.f;
    int e;
    frexpf(mx, &e);                       // mx = f 2^e, f in [0.5, 1): 2^(e-1) <= mx < 2^e
    const int E = mx > 0.f ? e - 1 : 0;
    float u[2] = {finite ? ldexpf(v0, 5 - E) : 0.f, finite ? ldexpf(v1, 5 - E) : 0.f};   // |u| < 64, exact
#pragma unroll
    for (int p = 0; p < 4; p++) {
        int b[2];
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const float r = rintf(u[c]);
            b[c] = (int)r;
            u[c] = (u[c] - r) * 128.f;    // exact: |u - r| <= 1/2
            const int col = 2 * lane + c, t = col >> 4, cc = col & 15, w = cc & 7;
            q[p * 64 + t * 16 + 8 * (cc >> 3) + 4 * (w & 1) + (w >> 1)] = (u8)(signed char)b[c];
        }
        int s = b[0] + b[1];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        // the MMA accumulator starts of parts (0, 1) and (2, 3) as D lays them out: c = (p0, p1, p0, p1), (p2, p3, ..)
        if (lane == 0) m[4 * (p >> 1) + (p & 1)] = m[4 * (p >> 1) + (p & 1) + 2] = PF_MAGIC - 8 * s;
    }
    if (lane == 0) {
        m[8] = __float_as_int(finite ? ldexpf(1.f, E - 5) : __int_as_float(0x7fc00000));
        m[9] = m[10] = m[11] = 0;
    }
}

// ---- pf_split_rows ----------------------------------------------------------------------------------------------
// x [R, C] fp32 (row stride ldx) -> xq, xm (layouts above).   grid (ceil(R * C / 64 / 8)), block 256: a warp a block.
extern "C" __global__ void __launch_bounds__(PF_SPLIT_THREADS) pf_split_rows(const float *x, int R, int C,
                                                                             long long ldx, u8 *xq, int *xm) {
    COLI_PDL_ENTRY();
    const int nG = C / 64, lane = threadIdx.x & 31;
    const long long i = (long long)blockIdx.x * (PF_SPLIT_THREADS / 32) + (threadIdx.x >> 5);
    if (i >= (long long)R * nG) return;
    const long long r = i / nG;
    const int G = (int)(i - r * nG);
    const float *src = x + r * ldx + 64 * G;
    pf_split64(src[2 * lane], src[2 * lane + 1], lane, xq + i * 256, xm + i * 12);
}

// ---- the shared main loop -------------------------------------------------------------------------------------
// acc[i][q][r] = sum over C of W[row] * x[act] for the block's row 64 (w & 1) + 16 i + g + 8 r and activation row
// 16 (w >> 1) + 4 q + t (lane g = lane / 4, t = lane % 4). rowd / rowm: the 128 rows' data / scale addresses;
// act[PF_TOKS]: split-x row of each activation row (-1: none, zeros); the first nact are present (PF_SKIP: quads of
// 4 absent rows skip their MMAs; their accumulators stay 0 and no caller writes them). Leaves every cp.async
// drained and the block synchronised, so the caller may reuse the shared memory.
// FMT_INT4: acc includes the group scales; FMT_INT8: acc is the sum before the row's scale (the caller's).
template <int FMT>
__device__ inline void pf_mainloop(u8 *smem, const u8 *const *rowd, const u8 *const *rowm, const int *act, int nact,
                                   int C, int group, const u8 *xq, const int *xm, float (&acc)[4][4][2]) {
    constexpr bool I8 = FMT == FMT_INT8;
    constexpr int WB = PfFmt<FMT>::WB, WP = WB / 16, WPS = WP == 4 ? 2 : 1;   // bytes, 16-byte pieces per row
    constexpr int W_BYTES = PfFmt<FMT>::W_BYTES, STAGE = PfFmt<FMT>::STAGE;
    const int nG = C / 64, ng = I8 ? 1 : C / group, gsh = group == 128 ? 1 : 0;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wr = warp % PF_RW, wt = warp / PF_RW;
    __half *scs = reinterpret_cast<__half *>(smem + PF_STAGES * STAGE);     // [PF_ROWS][ng] (int4 only)

    constexpr int WK = PF_ROWS * WP / PF_THREADS, XK = PF_TOKS * 16 / PF_THREADS;    // copies per thread per stage
    static_assert(PF_ROWS * WP % PF_THREADS == 0 && (1 << WPS) == WP, "whole weight copy rounds per stage");
#if PF_HOIST == 1
    // this thread's sources at G = 0 (an absent activation row: xq / xm with 0 bytes, zeros), advanced per stage
    const u8 *wsrc[WK], *xsrc[XK];
    int xn[XK];
#pragma unroll
    for (int k = 0; k < WK; k++) {
        const int idx = tid + PF_THREADS * k;
        wsrc[k] = rowd[idx >> WPS] + 16 * (idx & (WP - 1));
    }
#pragma unroll
    for (int k = 0; k < XK; k++) {
        const int idx = tid + PF_THREADS * k, r = act[idx >> 4];
        xsrc[k] = r >= 0 ? xq + (long long)r * nG * 256 + 16 * (idx & 15) : xq;
        xn[k] = r >= 0 ? 16 : 0;
    }
    const int ma = tid / 3, mr = tid < 3 * PF_TOKS ? act[ma] : -1;
    const int *msrc = mr >= 0 ? xm + (long long)mr * nG * 12 + 4 * (tid - 3 * ma) : xm;
#endif
#if PF_HOIST == 2
    constexpr int XPR = 16 / XK;             // lanes per activation row; this thread's pieces xp + XPR j of row xa
    static_assert(16 % XK == 0, "whole activation rows per copy round");
    const int xa = tid / XPR, xp = tid % XPR, ma = tid / 3;
    const u8 *xsrc = xq + (long long)act[min(xa, nact - 1)] * nG * 256 + 16 * xp;
    const int *msrc = xm + (long long)act[min(ma, nact - 1)] * nG * 12 + 4 * (tid - 3 * ma);   // tid < 3 PF_TOKS
    const u8 *wsrc[I8 ? 1 : WK];
    if constexpr (!I8) {
#pragma unroll
        for (int k = 0; k < WK; k++) {
            const int idx = tid + PF_THREADS * k;
            wsrc[k] = rowd[idx >> WPS] + 16 * (idx & (WP - 1));
        }
    }
#endif
    // G: the 64-column block to copy; so: its stage's byte offset (= (G % PF_STAGES) * STAGE)
    auto issue = [&](int G, int so) {
        if (G < nG) {
            u8 *st = smem + (PF_HOIST == 2 ? so : (G % PF_STAGES) * STAGE);
#pragma unroll
            for (int k = 0; k < WK; k++) {   // weights: WP pieces per row (int4 2, int8 4)
                const int idx = tid + PF_THREADS * k, row = idx >> WPS, pc = idx & (WP - 1);
#if PF_HOIST == 2
                if constexpr (!I8)
                    pf_cp16(st + row * WB + 16 * pc, wsrc[k] + WB * G, 16);
                else
                    pf_cp16(st + row * WB + 16 * pc, rowd[row] + WB * G + 16 * pc, 16);
#elif PF_HOIST == 1
                pf_cp16(st + row * WB + 16 * pc, wsrc[k] + WB * G, 16);
#else
                pf_cp16(st + row * WB + 16 * pc, rowd[row] + WB * G + 16 * pc, 16);
#endif
            }
#if PF_HOIST == 2
#pragma unroll
            for (int j = 0; j < XK; j++)    // split x: this thread's pieces of its one row
                pf_cp16(st + W_BYTES + xa * 256 + 16 * (xp + XPR * j), xsrc + 256 * G + 16 * XPR * j, 16);
            if (tid < 3 * PF_TOKS)          // metadata: 3 pieces per activation row
                pf_cp16(st + W_BYTES + PF_X_BYTES + ma * 48 + 16 * (tid - 3 * ma), msrc + 12 * G, 16);
#else
#pragma unroll
            for (int k = 0; k < XK; k++) {  // split x: 16 pieces per activation row
                const int idx = tid + PF_THREADS * k, a = idx >> 4, pc = idx & 15;
#if PF_HOIST == 1
                pf_cp16(st + W_BYTES + a * 256 + 16 * pc, xsrc[k] + (xn[k] ? G * 256 : 0), xn[k]);
#else
                const int r = act[a];
                const u8 *src = r >= 0 ? xq + ((long long)r * nG + G) * 256 + 16 * pc : xq;
                pf_cp16(st + W_BYTES + a * 256 + 16 * pc, src, r >= 0 ? 16 : 0);
#endif
            }
            if (tid < 3 * PF_TOKS) {        // metadata: 3 pieces per activation row
                const int a = tid / 3, pc = tid - 3 * a;
#if PF_HOIST == 1
                pf_cp16(st + W_BYTES + PF_X_BYTES + a * 48 + 16 * pc, msrc + (mr >= 0 ? G * 12 : 0),
                        mr >= 0 ? 16 : 0);
#else
                const int r = act[a];
                const int *src = r >= 0 ? xm + ((long long)r * nG + G) * 12 + 4 * pc : xm;
                pf_cp16(st + W_BYTES + PF_X_BYTES + a * 48 + 16 * pc, src, r >= 0 ? 16 : 0);
#endif
            }
#endif
        }
        pf_commit();                         // an empty group past the end keeps the wait counts uniform
    };

#pragma unroll
    for (int s = 0; s < PF_STAGES - 1; s++) issue(s, s * STAGE);
    if constexpr (!I8)
        for (int i = tid; i < PF_ROWS * ng; i += PF_THREADS)   // the group scales, once (plain loads)
            scs[i] = __ushort_as_half(__ldg(reinterpret_cast<const unsigned short *>(rowm[i / ng]) + i % ng));
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[i][q][0] = acc[i][q][1] = 0.f;

    int cso = 0, iso = (PF_STAGES - 1) * STAGE;     // PF_HOIST 2: stage G's offset, stage G + PF_STAGES - 1's
    for (int G = 0; G < nG; G++) {
        pf_wait<PF_STAGES - 2>();
        __syncthreads();                     // stage G landed for every thread; stage G - 1 is free again
        issue(G + PF_STAGES - 1, iso);
        const int so = cso;
        iso = cso;                           // the next step refills this step's stage
        cso = cso + STAGE == PF_STAGES * STAGE ? 0 : cso + STAGE;
        if (PF_SKIP && 16 * wt >= nact) continue;   // a warp whose 16 activation rows are all absent (warp-uniform)
        const u8 *st = smem + (PF_HOIST == 2 ? so : (G % PF_STAGES) * STAGE);
        const u8 *xs = st + W_BYTES;
        const int *ms = reinterpret_cast<const int *>(st + W_BYTES + PF_X_BYTES);
        uint32_t a[4][2][4];
        float sc[4][2];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = 64 * wr + 16 * i + g;
            if (I8) {
                // bytes 16 t .. 16 t + 15 of rows g, g + 8 (a quarter warp reads 128 contiguous bytes: no conflict);
                // MMA m takes columns 16 t + 8 m .. + 7: even ones -> a0 / a1 (k = 4t ..), odd ones -> a2 / a3
                const uint4 w0 = *reinterpret_cast<const uint4 *>(st + row * 64 + 16 * t);
                const uint4 w1 = *reinterpret_cast<const uint4 *>(st + (row + 8) * 64 + 16 * t);
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const uint32_t lo0 = m ? w0.z : w0.x, hi0 = m ? w0.w : w0.y;
                    const uint32_t lo1 = m ? w1.z : w1.x, hi1 = m ? w1.w : w1.y;
                    a[i][m][0] = __byte_perm(lo0, hi0, 0x6420);
                    a[i][m][1] = __byte_perm(lo1, hi1, 0x6420);
                    a[i][m][2] = __byte_perm(lo0, hi0, 0x7531);
                    a[i][m][3] = __byte_perm(lo1, hi1, 0x7531);
                }
                sc[i][0] = sc[i][1] = 1.f;   // the row's scale: applied once by the caller
            } else {
                const uint2 w0 = *reinterpret_cast<const uint2 *>(st + row * 32 + 8 * t);
                const uint2 w1 = *reinterpret_cast<const uint2 *>(st + (row + 8) * 32 + 8 * t);
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const uint32_t x0 = m ? w0.y : w0.x, x1 = m ? w1.y : w1.x;
                    a[i][m][0] = x0 & 0x0f0f0f0fu;
                    a[i][m][1] = x1 & 0x0f0f0f0fu;
                    a[i][m][2] = (x0 >> 4) & 0x0f0f0f0fu;
                    a[i][m][3] = (x1 >> 4) & 0x0f0f0f0fu;
                }
                sc[i][0] = __half2float(scs[row * ng + (G >> gsh)]);
                sc[i][1] = __half2float(scs[(row + 8) * ng + (G >> gsh)]);
            }
        }
        // the warp's four quads; FULL: all four present, no per-quad test (PF_SKIP 2 runs those warps here)
        auto quads = [&](auto full) {
            constexpr bool FULL = decltype(full)::value;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                // 4 absent rows: the MMAs would multiply zeros
                if (!FULL && PF_SKIP && 16 * wt + 4 * q >= nact) continue;
                const int tb = 16 * wt + 4 * q + (g >> 1), td = 16 * wt + 4 * q + t;
                const float fe = __int_as_float(ms[td * 12 + 8]);
#if PF_EPI == 2
                const float fe7 = fe * 0.0078125f, nm = -PF_MAGIC1_F * fe;   // exact: fe a power of two
#endif
                uint4 b[2];
                int4 ci[2];
#pragma unroll
                for (int ab = 0; ab < 2; ab++) {
                    b[ab] = *reinterpret_cast<const uint4 *>(xs + tb * 256 + (2 * ab + (g & 1)) * 64 + 16 * t);
                    // int8: signed weights need no offset, the accumulators start at MAGIC itself
                    ci[ab] = I8 ? make_int4(PF_MAGIC, PF_MAGIC, PF_MAGIC, PF_MAGIC)
                                : *reinterpret_cast<const int4 *>(ms + td * 12 + 4 * ab);
                }
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int d[2][4];
#pragma unroll
                    for (int ab = 0; ab < 2; ab++) {
                        if (I8) {
                            pf_mma_ss_c(d[ab], a[i][0], b[ab].x, b[ab].y, ci[ab]);
                            pf_mma_ss(d[ab], a[i][1], b[ab].z, b[ab].w);
                        } else {
                            pf_mma_c(d[ab], a[i][0], b[ab].x, b[ab].y, ci[ab]);
                            pf_mma(d[ab], a[i][1], b[ab].z, b[ab].w);
                        }
                    }
#pragma unroll
                    for (int r = 0; r < 2; r++) {
#if PF_DIAG
                        acc[i][q][r] = fmaf(__int_as_float(d[0][2 * r] + d[0][2 * r + 1] + d[1][2 * r] +
                                                            d[1][2 * r + 1]),
                                            sc[i][r], acc[i][q][r]);
#elif PF_EPI == 2
                        // (parts 0 + 1) fe and (2 + 3) fe exactly, then the one rounding of the block (h fe)
                        const float p01 = fmaf(__int_as_float(d[0][2 * r + 1]), fe7,
                                               fmaf(__int_as_float(d[0][2 * r]), fe, nm));
                        const float p23 = fmaf(__int_as_float(d[1][2 * r + 1]), fe7,
                                               fmaf(__int_as_float(d[1][2 * r]), fe, nm));
                        acc[i][q][r] = fmaf(sc[i][r], fmaf(p23, 6.103515625e-05f, p01), acc[i][q][r]);
#elif PF_EPI == 1
                        // parts 0 + 1 and 2 + 3 exactly (23 bits each), then the one rounding of the block
                        const float p01 = fmaf(__int_as_float(d[0][2 * r + 1]), 0.0078125f,
                                               __int_as_float(d[0][2 * r]) - PF_MAGIC1_F);
                        const float p23 = fmaf(__int_as_float(d[1][2 * r + 1]), 0.0078125f,
                                               __int_as_float(d[1][2 * r]) - PF_MAGIC1_F);
                        acc[i][q][r] = fmaf(sc[i][r] * fe, fmaf(p23, 6.103515625e-05f, p01), acc[i][q][r]);
#else
                        const float f0 = __int_as_float(d[0][2 * r]) - PF_MAGIC_F;
                        const float f1 = __int_as_float(d[0][2 * r + 1]) - PF_MAGIC_F;
                        const float f2 = __int_as_float(d[1][2 * r]) - PF_MAGIC_F;
                        const float f3 = __int_as_float(d[1][2 * r + 1]) - PF_MAGIC_F;
                        // parts 0 + 1 and 2 + 3 exactly (23 bits each), then the one rounding of the block
                        const float h = fmaf(fmaf(f3, 0.0078125f, f2), 6.103515625e-05f, fmaf(f1, 0.0078125f, f0));
                        acc[i][q][r] = fmaf(sc[i][r] * fe, h, acc[i][q][r]);
#endif
                    }
                }
            }
        };
        // PF_SKIP 2: a warp whose 16 activation rows are all present (most of them) runs its quads as one
        // straight-line body, so the scheduler may start quad q + 1's loads and MMAs under quad q's flush; only the
        // warp holding the tile's last pair takes the per-quad tests
        if (PF_SKIP == 2 && 16 * wt + 16 <= nact)
            quads(PfBool<true>{});
        else
            quads(PfBool<false>{});
    }
    pf_wait<0>();
    __syncthreads();
}

// Per-block tables in shared memory after the pipeline's stages and the scales: row addresses and activation rows.
struct PfTables {
    const u8 **rowd, **rowm;
    int *act;
};

template <int FMT = FMT_INT4>
__device__ inline PfTables pf_tables(u8 *smem, int C, int group) {
    u8 *p = smem + PF_STAGES * PfFmt<FMT>::STAGE + (FMT == FMT_INT8 ? 0 : align16(PF_ROWS * (C / group) * 2));
    PfTables tb;
    tb.rowd = reinterpret_cast<const u8 **>(p);
    tb.rowm = tb.rowd + PF_ROWS;
    tb.act = reinterpret_cast<int *>(tb.rowm + PF_ROWS);
    return tb;
}

__device__ inline void pf_row(const QMat &m, int r, const u8 **rowd, const u8 **rowm, int slot) {
    const u8 *d, *mm;
    qmat_row(m, r, d, mm);
    rowd[slot] = d;
    rowm[slot] = mm;
}

// ---- pf_linear_int4, pf_linear_int8 ----------------------------------------------------------------------------
// Y[s, n] = sum_k x[s, k] W[n, k] for s < S, n < N (= W rows), x split (pf_split_rows: xq, xm, C = W cols).
//   int4: grid (N / PF_ROWS, ceil(S / PF_TOKS)), block PF_THREADS (256), dynamic smem = pf_smem(C, group).
//   int8 (one fp16 scale per row: Y[s, n] = scale[n] * sum_k q[n, k] x[s, k]): N need not be a multiple of PF_ROWS --
//   the block's rows past N read row N - 1 (valid memory) and are not written; grid (ceil(N / PF_ROWS), ceil(S /
//   PF_TOKS)), dynamic smem = pf_smem_int8().
template <int FMT>
__device__ __forceinline__ void pf_linear_body(QMat W, int S, const u8 *xq, const int *xm, float *Y, long long ldy) {
    extern __shared__ float4 pf_linear_sh4[];
    u8 *smem = reinterpret_cast<u8 *>(pf_linear_sh4);
    constexpr bool I8 = FMT == FMT_INT8;
    const int n0 = PF_ROWS * blockIdx.x, s0 = PF_TOKS * blockIdx.y;
    PfTables tb = I8 ? pf_tables<FMT_INT8>(smem, W.cols, 0) : pf_tables(smem, W.cols, W.group);
    static_assert(PF_ROWS <= PF_THREADS, "a thread a row in the tables");
    if (threadIdx.x < PF_ROWS)
        pf_row(W, I8 ? min(n0 + (int)threadIdx.x, W.rows - 1) : n0 + threadIdx.x, tb.rowd, tb.rowm, threadIdx.x);
    if (threadIdx.x < PF_TOKS) tb.act[threadIdx.x] = s0 + (int)threadIdx.x < S ? s0 + (int)threadIdx.x : -1;
    __syncthreads();
    float acc[4][4][2];
    pf_mainloop<FMT>(smem, tb.rowd, tb.rowm, tb.act, min(PF_TOKS, S - s0), W.cols, I8 ? 0 : W.group, xq, xm, acc);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float sc[4][2];                          // int8: the rows' scales (the tables survive the main loop)
    if (I8) {
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                sc[i][r] = __half2float(__ushort_as_half(__ldg(
                    reinterpret_cast<const unsigned short *>(tb.rowm[64 * (warp % PF_RW) + 16 * i + g + 8 * r]))));
    }
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int s = s0 + 16 * (warp / PF_RW) + 4 * q + t;
        if (s >= S) continue;
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                if (!I8) {
                    Y[s * ldy + n0 + 64 * (warp % PF_RW) + 16 * i + g + 8 * r] = acc[i][q][r];
                } else {
                    const int n = n0 + 64 * (warp % PF_RW) + 16 * i + g + 8 * r;
                    if (n < W.rows) Y[s * ldy + n] = __fmul_rn(acc[i][q][r], sc[i][r]);
                }
            }
    }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS, PF_MINB) pf_linear_int4(
    QMAT_PARAMS(w), int S, const u8 *xq, const int *xm, float *Y, long long ldy) {
    COLI_PDL_ENTRY();
    pf_linear_body<FMT_INT4>(QMAT_MAKE(w, FMT_INT4), S, xq, xm, Y, ldy);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS, PF_MINB) pf_linear_int8(
    QMAT_PARAMS(w), int S, const u8 *xq, const int *xm, float *Y, long long ldy) {
    COLI_PDL_ENTRY();
    pf_linear_body<FMT_INT8>(QMAT_MAKE(w, FMT_INT8), S, xq, xm, Y, ldy);
}

// ---- pf_gateup_int4 ---------------------------------------------------------------------------------------------
// The grouped MoE's first half. The host sorts the layer's (token, slot) pairs by expert; tiles[3 u .. 3 u + 2] =
// (expert table index e, first pair p0, count <= PF_TOKS). For pair p (token pair_token[p]) and
// j in [j0, j0 + PF_ROWS / 2):
//   h[p, j] = silu(x[token] . gate_e[j]) * (x[token] . up_e[j]), written split (hq, hm: rows P, columns Im) for
//   pf_down_int4. x arrives split (xq, xm over [S, H]). Block rows: gate j0 .. + PF_ROWS / 2 - 1, then up the same.
//   grid (Im / (PF_ROWS / 2), n_tiles), block PF_THREADS (256), dynamic smem = pf_smem(H, group).
extern "C" __global__ void __launch_bounds__(PF_THREADS, PF_MINB) pf_gateup_int4(
    const u8 *const *table, long long gate_off, long long up_off, int rows, int cols, int group, int rpt,
    long long tile_bytes, const int *tiles, const int *pair_token, const u8 *xq, const int *xm, u8 *hq, int *hm) {
    COLI_PDL_ENTRY();
    extern __shared__ float4 smem4[];
    u8 *smem = reinterpret_cast<u8 *>(smem4);
    const int e = tiles[3 * blockIdx.y], p0 = tiles[3 * blockIdx.y + 1], cnt = tiles[3 * blockIdx.y + 2];
    constexpr int HALF = PF_ROWS / 2;
    static_assert(HALF % 64 == 0, "whole 64-column blocks of h per block");
    const int j0 = HALF * blockIdx.x;
    PfTables tb = pf_tables(smem, cols, group);
    if (threadIdx.x < PF_ROWS) {
        const int half = threadIdx.x / HALF;
        const QMat W = make_qmat<FMT_INT4>(table[e] + (half ? up_off : gate_off), rows, cols, group, rpt, tile_bytes);
        pf_row(W, j0 + (threadIdx.x % HALF), tb.rowd, tb.rowm, threadIdx.x);
    }
    if (threadIdx.x < PF_TOKS) tb.act[threadIdx.x] = (int)threadIdx.x < cnt ? pair_token[p0 + threadIdx.x] : -1;
    __syncthreads();
    float acc[4][4][2];
    pf_mainloop<FMT_INT4>(smem, tb.rowd, tb.rowm, tb.act, cnt, cols, group, xq, xm, acc);
    // gate (block rows < HALF) and up meet in shared memory: ex[half][pair][j], rows padded to PF_EXLD floats
    static_assert(2 * PF_TOKS * PF_EXLD * 4 <= PF_STAGES * PF_STAGE_BYTES, "the exchange fits the drained stages");
    float *ex = reinterpret_cast<float *>(smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wr = warp % PF_RW, wt = warp / PF_RW;
#pragma unroll
    for (int q = 0; q < 4; q++)
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int R = 64 * wr + 16 * i + g + 8 * r;
                ex[((R / HALF) * PF_TOKS + 16 * wt + 4 * q + t) * PF_EXLD + R % HALF] = acc[i][q][r];
            }
    __syncthreads();
    const int nGh = rows / 64;
    constexpr int NS = HALF / 64;                              // 64-column blocks of h per pair in this block
    for (int w = warp; w < cnt * NS; w += PF_THREADS / 32) {   // a warp a (pair, block of h)
        const int a = w / NS, hh = w - a * NS;
        const float *gv = ex + a * PF_EXLD + 64 * hh, *uv = ex + (PF_TOKS + a) * PF_EXLD + 64 * hh;
        const float h0 = __fmul_rn(silu_f(gv[2 * lane]), uv[2 * lane]);
        const float h1 = __fmul_rn(silu_f(gv[2 * lane + 1]), uv[2 * lane + 1]);
        const long long blk = (long long)(p0 + a) * nGh + NS * blockIdx.x + hh;
        pf_split64(h0, h1, lane, hq + blk * 256, hm + blk * 12);
    }
}

// ---- pf_down_int4 -----------------------------------------------------------------------------------------------
// The grouped MoE's second half: Y[token p, slot p, n] = pair_w[p] * (h[p] . down_e[n]) for the tiles' pairs,
// n in [n0, n0 + 128); h split as pf_gateup_int4 writes it ([P, Im]); down [rows = H, cols = Im] at down_off.
// Y [S, K, H] fp32: every (token, slot) row written by exactly one block column (no atomics: deterministic).
//   grid (H / PF_ROWS, n_tiles), block PF_THREADS (256), dynamic smem = pf_smem(Im, group).
extern "C" __global__ void __launch_bounds__(PF_THREADS, PF_MINB) pf_down_int4(
    const u8 *const *table, long long down_off, int rows, int cols, int group, int rpt, long long tile_bytes,
    const int *tiles, const int *pair_token, const int *pair_slot, const float *pair_w, const u8 *hq, const int *hm,
    int K, float *Y) {
    COLI_PDL_ENTRY();
    extern __shared__ float4 smem4[];
    u8 *smem = reinterpret_cast<u8 *>(smem4);
    const int e = tiles[3 * blockIdx.y], p0 = tiles[3 * blockIdx.y + 1], cnt = tiles[3 * blockIdx.y + 2];
    const int n0 = PF_ROWS * blockIdx.x;
    PfTables tb = pf_tables(smem, cols, group);
    if (threadIdx.x < PF_ROWS) {
        const QMat W = make_qmat<FMT_INT4>(table[e] + down_off, rows, cols, group, rpt, tile_bytes);
        pf_row(W, n0 + threadIdx.x, tb.rowd, tb.rowm, threadIdx.x);
    }
    if (threadIdx.x < PF_TOKS) tb.act[threadIdx.x] = (int)threadIdx.x < cnt ? p0 + (int)threadIdx.x : -1;
    __syncthreads();
    float acc[4][4][2];
    pf_mainloop<FMT_INT4>(smem, tb.rowd, tb.rowm, tb.act, cnt, cols, group, hq, hm, acc);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int a = 16 * (warp / PF_RW) + 4 * q + t;
        if (a >= cnt) continue;
        const int p = p0 + a;
        float *yrow = Y + ((long long)pair_token[p] * K + pair_slot[p]) * rows + n0 + 64 * (warp % PF_RW);
        const float w = pair_w[p];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int r = 0; r < 2; r++) yrow[16 * i + g + 8 * r] = __fmul_rn(acc[i][q][r], w);
    }
}

// ---- pf_mma_peak (only in a build with -DPF_PEAK=1: scripts/pf_kernel_sweep.py) --------------------------------
// The legacy MMA's own rate on this device: every warp runs 8 independent accumulator chains of
// mma.sync.m16n8k32 u8 x s8 on register operands, nothing else (no loads, no flush). iters rounds of 8 MMAs per
// warp; out[0] is written only if the chains' XOR hits a value they never reach, so nothing is optimised away.
#if PF_PEAK
extern "C" __global__ void __launch_bounds__(256) pf_mma_peak(int iters, int *out) {
    COLI_PDL_ENTRY();
    const uint32_t v = threadIdx.x * 0x01030507u;
    const uint32_t a[4] = {v & 0x0f0f0f0fu, (v >> 4) & 0x0f0f0f0fu, (v ^ 0x0a0b0c0du) & 0x0f0f0f0fu, 0x01020304u};
    const uint32_t b0 = v ^ 0x5a5a5a5au, b1 = v * 3u;
    int d[8][4];
#pragma unroll
    for (int c = 0; c < 8; c++) d[c][0] = d[c][1] = d[c][2] = d[c][3] = c;
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int c = 0; c < 8; c++) pf_mma(d[c], a, b0, b1);
    }
    int s = 0;
#pragma unroll
    for (int c = 0; c < 8; c++) s ^= d[c][0] ^ d[c][1] ^ d[c][2] ^ d[c][3];
    if (s == 0x7fffffff) out[0] = s;
}
#endif

// coli_common.cuh -- shared device code for the ColiStream kernels.
//
// Weight matrices stay on the device exactly as the container stores them (coli/container/format.py):
// a matrix [rows, cols] is a run of tiles of `rpt` whole rows; a tile is [meta section | data section],
// each section padded to 16 bytes; every tile but the last is `tile_bytes` long. Per row:
//
//   fmt  code  data                                   meta
//   f32   0    cols float32                           -
//   bf16  1    cols bfloat16                          -
//   int8  2    cols int8            w = q * scale     one fp16 scale
//   int4  3    ng*g/2 bytes, col 2j low nibble of     ng fp16 scales (ng = ceil(cols/g))
//              byte j, 2j+1 high; w = (nib-8)*scale
//
// A matrix is passed to a kernel as six scalars (base, rows, cols, group, rpt, tile_bytes) and rebuilt
// here as a QMat. All arithmetic is fp32 (FFMA, never TF32); dequantisation happens in registers.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

// ---- programmatic dependent launch (PDL, sm_90+) -------------------------------------------------------
// Every __global__ kernel opens with COLI_PDL_ENTRY() (tests/test_pdl.py fails on one that does not). With COLI_PDL=1
// the replayed graphs' kernel->kernel edges are programmatic (coli/gpu/pdl.py): a kernel's grid may be launched
// while its predecessor still runs, and `griddepcontrol.wait` holds every thread until the predecessor grids have
// COMPLETED and their memory is visible -- so a kernel that waits first thing reads exactly what it reads today.
// `launch_dependents` first lets the next kernel's launch (its fixed 2-3 us of launch and ramp) overlap this one's
// run. Without a programmatic edge both instructions are no-ops; below sm_90 (no such instructions) nothing at all.
// The "memory" clobber keeps the compiler from moving any load or store above the wait.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define COLI_PDL_ENTRY() asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory")
#else
#define COLI_PDL_ENTRY() do {} while (0)
#endif

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_INT8 2
#define FMT_INT4 3

typedef unsigned char u8;

// Kernel parameter list of a stored matrix, and the matching argument names.
#define QMAT_PARAMS(p) const u8 *p##_base, int p##_rows, int p##_cols, int p##_group, int p##_rpt, \
                       long long p##_tile_bytes
#define QMAT_MAKE(p, FMT) make_qmat<FMT>(p##_base, p##_rows, p##_cols, p##_group, p##_rpt, p##_tile_bytes)

struct QMat {
    const u8 *base;
    long long tile_bytes;
    int rows, cols, group, rpt;
    int row_data, row_meta;   // bytes per row of data / metadata
};

__host__ __device__ inline int align16(int n) { return (n + 15) & ~15; }

template <int FMT>
__device__ inline QMat make_qmat(const u8 *base, int rows, int cols, int group, int rpt, long long tile_bytes) {
    QMat m;
    m.base = base; m.rows = rows; m.cols = cols; m.group = group; m.rpt = rpt; m.tile_bytes = tile_bytes;
    if (FMT == FMT_F32) { m.row_data = 4 * cols; m.row_meta = 0; }
    else if (FMT == FMT_BF16) { m.row_data = 2 * cols; m.row_meta = 0; }
    else if (FMT == FMT_INT8) { m.row_data = cols; m.row_meta = 2; }
    else { int ng = (cols + group - 1) / group; m.row_data = ng * group / 2; m.row_meta = 2 * ng; }
    return m;
}

// Byte addresses of row r's data and metadata.
__device__ inline void qmat_row(const QMat &m, int r, const u8 *&data, const u8 *&meta) {
    int t = r / m.rpt;
    int i = r - t * m.rpt;
    const u8 *tile = m.base + (long long)t * m.tile_bytes;
    int n = min(m.rpt, m.rows - t * m.rpt);
    meta = tile + i * m.row_meta;
    data = tile + align16(n * m.row_meta) + (long long)i * m.row_data;
}

__device__ inline float half_at(const u8 *p) {
    return __half2float(*reinterpret_cast<const __half *>(p));
}

// One dequantised weight: element `col` of a row whose data/meta start at the given addresses.
// Exactly numpy's dequantize(): (nib - 8) * scale and q * scale are exact in fp32.
template <int FMT>
__device__ inline float deq(const u8 *data, const u8 *meta, int col, int group) {
    if (FMT == FMT_F32) return reinterpret_cast<const float *>(data)[col];
    if (FMT == FMT_BF16) return __uint_as_float(((uint32_t)reinterpret_cast<const uint16_t *>(data)[col]) << 16);
    if (FMT == FMT_INT8) return (float)reinterpret_cast<const int8_t *>(data)[col] * half_at(meta);
    uint32_t b = data[col >> 1];
    int nib = (col & 1) ? (int)(b >> 4) : (int)(b & 15u);
    return (float)(nib - 8) * half_at(meta + 2 * (col / group));
}

// ---- 16-byte chunks (the GEMV path) -------------------------------------------------------------------
// A chunk is 16 bytes of a row's data: 4 (f32), 8 (bf16), 16 (int8) or 32 (int4) consecutive columns.
// int4 groups are >= 32 columns, so a chunk never straddles a scale group.
template <int FMT> struct Chunk {
    static constexpr int VALS = FMT == FMT_F32 ? 4 : FMT == FMT_BF16 ? 8 : FMT == FMT_INT8 ? 16 : 32;
    static constexpr int F4 = VALS / 4;            // float4s of x per chunk
    // swizzle of the float4s of x in shared memory: 8 consecutive lanes read 8 distinct 16-byte bank groups
    static constexpr int SHIFT = F4 == 8 ? 0 : F4 == 4 ? 1 : F4 == 2 ? 2 : 3;
};

template <int FMT>
__device__ inline void chunk_vals(const uint4 &w, float *v) {   // a 16-byte chunk's codes as floats, before scales
                                                                // (the GEMVs' and MLA's projections: gemv.cu, attention.cu)
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (FMT == FMT_F32) v[i] = __uint_as_float(ws[i]);
        else if (FMT == FMT_BF16) {
            v[2 * i] = __uint_as_float(ws[i] << 16);
            v[2 * i + 1] = __uint_as_float(ws[i] & 0xffff0000u);
        } else if (FMT == FMT_INT8) {
#pragma unroll
            for (int k = 0; k < 4; k++) v[4 * i + k] = (float)(int8_t)((ws[i] >> (8 * k)) & 0xffu);
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const uint32_t b = (ws[i] >> (8 * k)) & 0xffu;
                v[8 * i + 2 * k] = (float)(int)(b & 15u) - 8.f;
                v[8 * i + 2 * k + 1] = (float)(int)(b >> 4) - 8.f;
            }
        }
    }
}

template <int FMT>
__device__ inline int xs_slot(int chunk, int k) {  // float4 slot of x's float4 k of `chunk`
    constexpr int F4 = Chunk<FMT>::F4;
    return chunk * F4 + (k ^ ((chunk >> Chunk<FMT>::SHIFT) & (F4 - 1)));
}

// Stage n floats of x (global) into shared memory in the swizzled chunk layout, zero-filled to npad.
template <int FMT>
__device__ inline void stage_x(float *xs, const float *x, int n, int npad) {
    constexpr int V = Chunk<FMT>::VALS;
    for (int i = threadIdx.x; i < npad; i += blockDim.x) {
        int c = i / V, w = i - c * V;
        xs[xs_slot<FMT>(c, w >> 2) * 4 + (w & 3)] = i < n ? x[i] : 0.f;
    }
}

// Streaming 16-byte load of weights (read once: do not keep in L1).
__device__ inline uint4 ld_stream(const u8 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Dot product of one chunk of weights with its x values (registers), WITHOUT the row/group scale.
// int4: the nibble becomes a float by OR-ing it into the mantissa of 2^23 (no int->float conversion);
// the high nibble is taken in place (x16) and its accumulator is scaled by 1/16 at the end -- exact.
template <int FMT>
__device__ inline float chunk_dot(const uint4 &w, const float *xv) {
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    if (FMT == FMT_F32) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) a = fmaf(__uint_as_float(ws[i]), xv[i], a);
        return a;
    } else if (FMT == FMT_BF16) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            a = fmaf(__uint_as_float(ws[i] << 16), xv[2 * i], a);
            a = fmaf(__uint_as_float(ws[i] & 0xffff0000u), xv[2 * i + 1], a);
        }
        return a;
    } else if (FMT == FMT_INT8) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                // byte k, sign flipped into 0..255, in the mantissa of 2^23: (2^23 + q + 128) - (2^23 + 128) = q
                uint32_t b = __byte_perm(ws[i], 0x4b000000u, 0x7440 + k) ^ 0x80u;
                a = fmaf(__uint_as_float(b) - 8388736.0f, xv[4 * i + k], a);
            }
        }
        return a;
    } else {
        float lo = 0.f, hi = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                uint32_t b = __byte_perm(ws[i], 0x4b000000u, 0x7440 + k);  // 0x4b0000bb
                float fl = __uint_as_float(b & 0x4b00000fu) - 8388616.0f;   // nib_lo - 8
                float fh = __uint_as_float(b & 0x4b0000f0u) - 8388736.0f;   // 16 * (nib_hi - 8)
                lo = fmaf(fl, xv[8 * i + 2 * k], lo);
                hi = fmaf(fh, xv[8 * i + 2 * k + 1], hi);
            }
        }
        return fmaf(hi, 0.0625f, lo);
    }
}

// Load chunk c's x values from the swizzled shared copy.
template <int FMT>
__device__ inline void load_x(const float *xs, int c, float *xv) {
    constexpr int F4 = Chunk<FMT>::F4;
#pragma unroll
    for (int k = 0; k < F4; k++) {
        float4 v = reinterpret_cast<const float4 *>(xs)[xs_slot<FMT>(c, k)];
        xv[4 * k] = v.x; xv[4 * k + 1] = v.y; xv[4 * k + 2] = v.z; xv[4 * k + 3] = v.w;
    }
}

// Scale that applies to chunk c of a row (int4: its group's; otherwise 1, int8's row scale is applied once).
template <int FMT>
__device__ inline float chunk_scale(const u8 *meta, int c, int group) {
    if (FMT == FMT_INT4) return half_at(meta + 2 * ((c * 32) / group));
    return 1.f;
}

template <int FMT>
__device__ inline float row_scale(const u8 *meta) {
    return FMT == FMT_INT8 ? half_at(meta) : 1.f;
}

__device__ inline float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ inline float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// NR rows (data/meta pointers) against the same staged x: out[r] = sum over the row of w * x, full scale
// applied, summed over the warp (every lane gets the totals). nchunks = row_data / 16.
template <int FMT, int NR, int U>
__device__ inline void warp_rows_dot(const u8 *const *data, const u8 *const *meta, int nchunks, int group,
                                     const float *xs, int lane, float *out) {
    constexpr int V = Chunk<FMT>::VALS;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.f;
    for (int c0 = lane; c0 < nchunks; c0 += 32 * U) {
        uint4 w[NR][U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 32 * u;
#pragma unroll
            for (int r = 0; r < NR; r++)
                if (c < nchunks) w[r][u] = ld_stream(data[r] + 16 * (long long)c);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 32 * u;
            if (c < nchunks) {
                float xv[V];
                load_x<FMT>(xs, c, xv);
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    float d = chunk_dot<FMT>(w[r][u], xv);
                    if (FMT == FMT_INT4) acc[r] = fmaf(chunk_scale<FMT>(meta[r], c, group), d, acc[r]);
                    else acc[r] += d;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) out[r] = warp_sum(acc[r]) * row_scale<FMT>(meta[r]);
}

// ---- second version of the decode GEMV inner loop (moe_gateup_<fmt>, moe_down_<fmt>) ------------------------

// Row r's data/metadata as byte offsets from the matrix start (qmat_row without a base).
__device__ inline void qmat_row_off(const QMat &m, int r, long long &doff, long long &moff) {
    int t = r / m.rpt;
    int i = r - t * m.rpt;
    long long tile = (long long)t * m.tile_bytes;
    int n = min(m.rpt, m.rows - t * m.rpt);
    moff = tile + (long long)i * m.row_meta;
    doff = tile + align16(n * m.row_meta) + (long long)i * m.row_data;
}

// Hint: bring [p, p + bytes) into L2 (widened to 16-byte boundaries, which stay inside a tile's padded
// sections). sm_90+: one bulk prefetch by the copy engine; older: one prefetch per 128-byte line.
__device__ inline void l2_prefetch(const u8 *p, int bytes) {
    if (bytes <= 0) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned long long a = reinterpret_cast<unsigned long long>(p) & ~15ull;
    unsigned long long e = (reinterpret_cast<unsigned long long>(p) + bytes + 15ull) & ~15ull;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((unsigned)(e - a)));
#else
    for (int o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
#endif
}

// fp16 scale read through the read-only path (independent of the weights: issued with them).
__device__ inline float ld_half_nc(const u8 *p) {
    return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short *>(p))));
}

// 2^23's bit pattern in a register the compiler cannot fold (runtime_nonneg >= 0, so the shift adds nothing):
// with the nibble mask AND this constant as immediates, (w & mask) | M compiles to two LOP3s; with M in a
// register, to one.
__device__ inline uint32_t opaque_magic(int runtime_nonneg) { return 0x4b000000u | ((uint32_t)runtime_nonneg >> 31); }

// chunk_dot with fewer integer instructions for int4 (M = opaque_magic(...)): nibble q of a 32-bit word is column 8i+q; nibbles
// q = 0..3 are taken IN PLACE (bits 4q..4q+3 OR-ed into 2^23's mantissa: 2^23 + nib * 16^q), nibbles 4..7
// the same way from the word shifted right by 16. One LOP3 per weight + one shift per word (instead of a
// byte permute per byte and a LOP3 per weight). Each position q has its own accumulator holding 16^q x the
// plain partial sum (scaling by a power of two is exact), and they are combined once per chunk. Other formats:
// chunk_dot.
template <int FMT>
__device__ inline float chunk_dot2(const uint4 &w, const float *xv, uint32_t M) {
    if (FMT != FMT_INT4) return chunk_dot<FMT>(w, xv);
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t lo = ws[i], hi = ws[i] >> 16;
        a0 = fmaf(__uint_as_float((lo & 0x000fu) | M) - 8388616.0f, xv[8 * i + 0], a0);  // nib - 8
        a1 = fmaf(__uint_as_float((lo & 0x00f0u) | M) - 8388736.0f, xv[8 * i + 1], a1);  // 16 (nib - 8)
        a2 = fmaf(__uint_as_float((lo & 0x0f00u) | M) - 8390656.0f, xv[8 * i + 2], a2);  // 256 (nib - 8)
        a3 = fmaf(__uint_as_float((lo & 0xf000u) | M) - 8421376.0f, xv[8 * i + 3], a3);  // 4096 (nib - 8)
        a0 = fmaf(__uint_as_float((hi & 0x000fu) | M) - 8388616.0f, xv[8 * i + 4], a0);
        a1 = fmaf(__uint_as_float((hi & 0x00f0u) | M) - 8388736.0f, xv[8 * i + 5], a1);
        a2 = fmaf(__uint_as_float((hi & 0x0f00u) | M) - 8390656.0f, xv[8 * i + 6], a2);
        a3 = fmaf(__uint_as_float((hi & 0xf000u) | M) - 8421376.0f, xv[8 * i + 7], a3);
    }
    return fmaf(a3, 1.f / 4096.f, fmaf(a2, 1.f / 256.f, fmaf(a1, 0.0625f, a0)));
}

// NR rows against the same staged x, U chunks per lane per row loaded (with their int4 group scales) before any
// is used: NR * U * 16 bytes per lane in flight. gshift = log2(group / 32) (int4). Every lane gets the totals.
template <int FMT, int NR, int U>
__device__ inline void warp_rows_dot2(const u8 *const *data, const u8 *const *meta, int nchunks, int gshift,
                                      const float *xs, int lane, float *out) {
    constexpr int V = Chunk<FMT>::VALS;
    const uint32_t M = opaque_magic(gshift);
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.f;
    for (int c0 = lane; c0 < nchunks; c0 += 32 * U) {
        uint4 w[NR][U];
        float sc[NR][U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 32 * u;
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (c < nchunks) {
                    w[r][u] = ld_stream(data[r] + 16 * (long long)c);
                    sc[r][u] = FMT == FMT_INT4 ? ld_half_nc(meta[r] + 2 * (c >> gshift)) : 1.f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + 32 * u;
            if (c < nchunks) {
                float xv[V];
                load_x<FMT>(xs, c, xv);
#pragma unroll
                for (int r = 0; r < NR; r++) acc[r] = fmaf(sc[r][u], chunk_dot2<FMT>(w[r][u], xv, M), acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) out[r] = warp_sum(acc[r]) * row_scale<FMT>(meta[r]);
}

__device__ inline float silu_f(float g) { return __fdiv_rn(g, __fadd_rn(1.f, expf(-g))); }

// Block-wide sum (blockDim.x a multiple of 32, <= 1024); every thread gets the result. `red` >= 32 floats.
__device__ inline float block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_sum(t);
}

// Instantiate a templated kernel body for the four weight formats as extern "C" kernels NAME_f32 ... NAME_int4.
#define COLI_FOR_FORMATS(M) M(f32, FMT_F32) M(bf16, FMT_BF16) M(int8, FMT_INT8) M(int4, FMT_INT4)

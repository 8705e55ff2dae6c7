// elementwise.cu -- small element-wise kernels of the forward: residual add, SwiGLU's silu(g) * u, column
// split of a row-major matrix, and the embedding gather (dequantised from the stored table).
#include "coli_common.cuh"

// add(a, b, y, n): y = a + b.  n fp32 elements; grid-stride, block 256.
extern "C" __global__ void add(const float *a, const float *b, float *y, long long n) {
    COLI_PDL_ENTRY();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(a[i], b[i]);
}

// silu_mul(g, u, h, n): h = g / (1 + exp(-g)) * u.  grid-stride, block 256.
extern "C" __global__ void silu_mul(const float *g, const float *u, float *h, long long n) {
    COLI_PDL_ENTRY();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        h[i] = __fmul_rn(silu_f(g[i]), u[i]);
}

// copy_cols(src, ld, c0, ncols, dst, rows): dst[r, j] = src[r * ld + c0 + j], dst [rows, ncols].
//   grid-stride over rows * ncols, block 256.
extern "C" __global__ void copy_cols(const float *src, int ld, int c0, int ncols, float *dst, int rows) {
    COLI_PDL_ENTRY();
    const long long n = (long long)rows * ncols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / ncols, j = i - r * ncols;
        dst[i] = src[r * ld + c0 + j];
    }
}

// embed_<fmt>(table, ids, out): out[s, :] = dequantised row ids[s] of the stored table [V, H].
//   ids [S] int32, out [S, H] fp32.  grid S, block 256.
template <int FMT>
__device__ void embed_body(QMat W, const int *ids, float *out) {
    const u8 *d, *m;
    qmat_row(W, ids[blockIdx.x], d, m);
    float *o = out + (long long)blockIdx.x * W.cols;
    for (int c = threadIdx.x; c < W.cols; c += blockDim.x) o[c] = deq<FMT>(d, m, c, W.group);
}
#define EMBED_KERNEL(NAME, FMT)                                                                     \
    extern "C" __global__ void embed_##NAME(QMAT_PARAMS(w), const int *ids, float *out) {          \
        COLI_PDL_ENTRY();                                                                          \
        embed_body<FMT>(QMAT_MAKE(w, FMT), ids, out);                                               \
    }
COLI_FOR_FORMATS(EMBED_KERNEL)

// dequant_<fmt>(table, r0, nrows, out): out[i, :] = dequantised row r0 + i (tests and host fallbacks).
//   out [nrows, cols] fp32.  grid nrows, block 256.
template <int FMT>
__device__ void dequant_body(QMat W, int r0, float *out) {
    const u8 *d, *m;
    qmat_row(W, r0 + blockIdx.x, d, m);
    float *o = out + (long long)blockIdx.x * W.cols;
    for (int c = threadIdx.x; c < W.cols; c += blockDim.x) o[c] = deq<FMT>(d, m, c, W.group);
}
#define DEQUANT_KERNEL(NAME, FMT)                                                                   \
    extern "C" __global__ void dequant_##NAME(QMAT_PARAMS(w), int r0, float *out) {                 \
        COLI_PDL_ENTRY();                                                                           \
        dequant_body<FMT>(QMAT_MAKE(w, FMT), r0, out);                                              \
    }
COLI_FOR_FORMATS(DEQUANT_KERNEL)

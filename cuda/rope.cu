// rope.cu -- rotary embedding, interleaved pairs, transformers' permuted output layout (reference §3.2,
// NumpyBackend.rope).
#include "coli_common.cuh"

// Element e of y for x [S, n, d]: the body of rope and rope4, so the two give the same bits.
__device__ __forceinline__ void rope_elem(const float *x, const float *cs, const float *sn, float *y, long long e,
                                          int n, int d, int off, int half) {
    const int j = (int)(e % d);
    const long long v = e - j;                       // start of this vector
    const int s = (int)(e / ((long long)n * d));
    int i = j - off;
    if (i < 0 || i >= 2 * half) { y[e] = x[e]; return; }
    const bool second = i >= half;
    if (second) i -= half;
    const float a = x[v + off + 2 * i], b = x[v + off + 2 * i + 1];
    const float c = cs[(long long)s * half + i], si = sn[(long long)s * half + i];
    y[e] = second ? __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, si)) : __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, si));
}

// rope(x, cos, sin, y, S, n, d, off, half): for x [S, n, d] the span [off, off + 2*half) of every vector holds
// interleaved pairs (a_i, b_i) = (x[off+2i], x[off+2i+1]); it comes out as
//   y[off + i] = a_i cos - b_i sin,   y[off + half + i] = b_i cos + a_i sin      (cos/sin [S, half])
// and everything outside the span is copied. y must not alias x.  grid-stride over S*n*d, block 256.
extern "C" __global__ void rope(const float *x, const float *cs, const float *sn, float *y, int S, int n, int d,
                                int off, int half) {
    COLI_PDL_ENTRY();
    const long long total = (long long)S * n * d;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x)
        rope_elem(x, cs, sn, y, e, n, d, off, half);
}

// rope4(cos, sin, S, half, x0, y0, n0, d0, off0, ..., x3, y3, n3, d3, off3): rope of up to four tensors xk [S, nk, dk]
//   with the same angles in one launch (a layer's q, k_pe, indexer q and indexer key: Backend.rope_many);
//   blockIdx.y = k picks the tensor, gridDim.y how many there are (the unused ones' arguments are not read).
//   grid (blocks, count), block 256; each y-slice grid-strides over its own tensor.
extern "C" __global__ void rope4(const float *cs, const float *sn, int S, int half,
                                 const float *x0, float *y0, int n0, int d0, int off0,
                                 const float *x1, float *y1, int n1, int d1, int off1,
                                 const float *x2, float *y2, int n2, int d2, int off2,
                                 const float *x3, float *y3, int n3, int d3, int off3) {
    COLI_PDL_ENTRY();
    const int k = blockIdx.y;
    const float *x = k == 0 ? x0 : k == 1 ? x1 : k == 2 ? x2 : x3;
    float *y = k == 0 ? y0 : k == 1 ? y1 : k == 2 ? y2 : y3;
    const int n = k == 0 ? n0 : k == 1 ? n1 : k == 2 ? n2 : n3;
    const int d = k == 0 ? d0 : k == 1 ? d1 : k == 2 ? d2 : d3;
    const int off = k == 0 ? off0 : k == 1 ? off1 : k == 2 ? off2 : off3;
    const long long total = (long long)S * n * d;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x)
        rope_elem(x, cs, sn, y, e, n, d, off, half);
}

// rope.cu -- rotary embedding, interleaved pairs, transformers' permuted output layout (reference §3.2,
// NumpyBackend.rope).
#include "coli_common.cuh"

// rope(x, cos, sin, y, S, n, d, off, half): for x [S, n, d] the span [off, off + 2*half) of every vector holds
// interleaved pairs (a_i, b_i) = (x[off+2i], x[off+2i+1]); it comes out as
//   y[off + i] = a_i cos - b_i sin,   y[off + half + i] = b_i cos + a_i sin      (cos/sin [S, half])
// and everything outside the span is copied. y must not alias x.  grid-stride over S*n*d, block 256.
extern "C" __global__ void rope(const float *x, const float *cs, const float *sn, float *y, int S, int n, int d,
                                int off, int half) {
    COLI_PDL_ENTRY();
    const long long total = (long long)S * n * d;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(e % d);
        const long long v = e - j;                       // start of this vector
        const int s = (int)(e / ((long long)n * d));
        int i = j - off;
        if (i < 0 || i >= 2 * half) { y[e] = x[e]; continue; }
        const bool second = i >= half;
        if (second) i -= half;
        const float a = x[v + off + 2 * i], b = x[v + off + 2 * i + 1];
        const float c = cs[(long long)s * half + i], si = sn[(long long)s * half + i];
        y[e] = second ? __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, si)) : __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, si));
    }
}

// argmax.cu -- greedy decoding's argmax over the logits on the GPU (first maximum, like np.argmax).
#include "coli_common.cuh"

__device__ inline void better(float &v, int &i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

// Block-wide (value, index) max; thread 0 gets the result. blockDim.x <= 1024.
__device__ inline void block_argmax(float &v, int &i) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { sv[w] = v; si[w] = i; }
    __syncthreads();
    if (w == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sv[lane] : -INFINITY;
        i = lane < (int)(blockDim.x >> 5) ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
}

// argmax_partial(x, n, pv, pi): for row s = blockIdx.y of x [S, n], block b = blockIdx.x of G finds the first
// maximum of its strided share; pv/pi [S, G].  grid (G, S), block 1024.
extern "C" __global__ void argmax_partial(const float *x, int n, float *pv, int *pi) {
    COLI_PDL_ENTRY();
    const float *r = x + (long long)blockIdx.y * n;
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) better(v, i, r[j], j);
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        pv[(long long)blockIdx.y * gridDim.x + blockIdx.x] = v;
        pi[(long long)blockIdx.y * gridDim.x + blockIdx.x] = i;
    }
}

// argmax_final(pv, pi, G, out): out[s] = index of the first maximum of row s (from argmax_partial's G partials).
//   grid S, block 1024.
extern "C" __global__ void argmax_final(const float *pv, const int *pi, int G, int *out) {
    COLI_PDL_ENTRY();
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int j = threadIdx.x; j < G; j += blockDim.x)
        better(v, i, pv[(long long)blockIdx.x * G + j], pi[(long long)blockIdx.x * G + j]);
    block_argmax(v, i);
    if (threadIdx.x == 0) out[blockIdx.x] = i;
}

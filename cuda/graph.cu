// graph.cu -- the small kernels a decode step replayed from a CUDA graph needs (coli/gpu/graphs.py): what the
// eager step does with a host value (an address offset by the position, a table of expert pointers built on
// the host) is done here from device memory, so the captured graph stays valid for every token.
//
// kv_put(src, n, pos, dst)
//   dst[(*pos) * n + i] = src[i], i < n: one new cache row (the eager step's write_rows at `start`).
//   src [n] fp32, dst [capacity, n] fp32, pos: the step's cache length before it (device int32).
//   grid ceil(n / 256) (at most a few blocks), block 256.
//
// expert_table(idx, K, slots, table)
//   table[k] = slots[idx[k]], k < K: the record pointers of the K chosen experts, in the router's order (the
//   eager step uploads the same table from the host). idx [K] int32 (every entry in 0 .. E-1: the router never
//   prunes in a replayed step), slots [E] uint64 (one layer's row of the slot table), table [K] uint64.
//   grid 1, block 32.
//
// kv_put3(pos, src0, n0, dst0, src1, n1, dst1, src2, n2, dst2)
//   kv_put of up to three rows in one launch (a layer's latent, rope key and indexer key: Backend.write_rows_many):
//   blockIdx.y = k picks the row, gridDim.y how many there are (the unused ones' arguments are not read).
//   grid (ceil(max n / 256), count), block 256.
#include "coli_common.cuh"

extern "C" __global__ void kv_put(const float *src, long long n, const int *pos, float *dst) {
    COLI_PDL_ENTRY();
    float *row = dst + (long long)pos[0] * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        row[i] = src[i];
}

extern "C" __global__ void kv_put3(const int *pos, const float *src0, long long n0, float *dst0, const float *src1,
                                   long long n1, float *dst1, const float *src2, long long n2, float *dst2) {
    COLI_PDL_ENTRY();
    const int k = blockIdx.y;
    const float *src = k == 0 ? src0 : k == 1 ? src1 : src2;
    const long long n = k == 0 ? n0 : k == 1 ? n1 : n2;
    float *row = (k == 0 ? dst0 : k == 1 ? dst1 : dst2) + (long long)pos[0] * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        row[i] = src[i];
}

extern "C" __global__ void expert_table(const int *idx, int K, const unsigned long long *slots,
                                        unsigned long long *table) {
    COLI_PDL_ENTRY();
    for (int k = threadIdx.x; k < K; k += blockDim.x) table[k] = slots[idx[k]];
}

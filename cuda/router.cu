// router.cu -- MoE routing after the router logits (reference §3.7 steps 1-5, NumpyBackend.route).
//
// route_topk(logits, bias, E, n_group, topk_group, K, norm, scaling, idx, w)
//   logits [S, E] = x @ gate.T (fp32, from gemv/gemm), bias [E] (e_score_correction_bias);
//   p = sigmoid(logits); c = p + bias (only for choosing); with n_group > 1 a group's score is the sum of its
//   two largest c, the topk_group best groups stay and the other groups' experts get c = -inf;
//   idx[s] = the K largest c (descending; ties -> lower expert id), w[s, k] = p[idx[s, k]],
//   normalised by (sum_k w + 1e-20) when norm, then times `scaling`.
//   idx [S, K] int32, w [S, K] fp32.  grid S, block 256, dynamic smem = 2 * E * 4 + n_group * 8 bytes.
//   Selection runs in warp 0 (E = 256, K = 8: a few hundred instructions).
#include "coli_common.cuh"

__device__ inline void warp_argmax(float &v, int &i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
    }
}

extern "C" __global__ void route_topk(const float *logits, const float *bias, int E, int n_group, int topk_group,
                                      int K, int norm, float scaling, int *idx, float *w) {
    COLI_PDL_ENTRY();
    extern __shared__ float smem[];
    float *p = smem, *c = smem + E;
    float *gscore = c + E;
    int *gkeep = reinterpret_cast<int *>(gscore + n_group);
    const int s = blockIdx.x;
    const float *lg = logits + (long long)s * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float pe = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-lg[e])));
        p[e] = pe;
        c[e] = __fadd_rn(pe, bias[e]);
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    if (n_group > 1) {
        const int gs = E / n_group;
        for (int g = lane; g < n_group; g += 32) {       // top-2 sum of the group
            float a = -INFINITY, b = -INFINITY;            // a >= b
            for (int e = g * gs; e < (g + 1) * gs; e++) {
                float v = c[e];
                if (v > a) { b = a; a = v; } else if (v > b) b = v;
            }
            gscore[g] = __fadd_rn(b, a);
            gkeep[g] = 0;
        }
        __syncwarp();
        for (int r = 0; r < topk_group; r++) {
            float v = -INFINITY;
            int i = 0x7fffffff;
            for (int g = lane; g < n_group; g += 32)
                if (!gkeep[g] && (i == 0x7fffffff || gscore[g] > v)) { v = gscore[g]; i = g; }
            warp_argmax(v, i);
            if (lane == 0) gkeep[i] = 1;
            __syncwarp();
        }
        for (int e = lane; e < E; e += 32)
            if (!gkeep[e / gs]) c[e] = -INFINITY;
        __syncwarp();
    }
    float wk[32];
    int ik[32];
    float sum = 0.f;
    for (int k = 0; k < K && k < 32; k++) {
        float v = -INFINITY;
        int i = 0x7fffffff;
        for (int e = lane; e < E; e += 32)
            if (c[e] == c[e] && (i == 0x7fffffff || c[e] > v)) { v = c[e]; i = e; }   // skip taken (NaN)
        warp_argmax(v, i);
        __syncwarp();
        if (lane == 0) c[i] = NAN;            // taken: never chosen again (NaN fails every comparison)
        __syncwarp();
        ik[k] = i;
        wk[k] = p[i];
        sum = __fadd_rn(sum, wk[k]);
    }
    if (lane == 0) {
        const float denom = __fadd_rn(sum, 1e-20f);
        for (int k = 0; k < K; k++) {
            float v = norm ? __fdiv_rn(wk[k], denom) : wk[k];
            idx[(long long)s * K + k] = ik[k];
            w[(long long)s * K + k] = __fmul_rn(v, scaling);
        }
    }
}

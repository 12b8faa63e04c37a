// decode_cluster.cuh: the per-item split's merge inside a thread-block
// cluster (launch option debug 256, sm_90): the nsplit parts of one (item,
// kv head) are the CTAs of one cluster (grid z), each leaves its partial
// state in its own shared memory (dec_finish, kOutCluster) and the cluster's
// CTA of rank 0 reads them through distributed shared memory and writes the
// output, so that a split step needs neither the merge kernel nor the
// workspace round trip (a small batch's launch sequence loses a launch and a
// grid-completion wait). The merge is merge.cu's merge_split_kernel's:
// out = sum_s w_s o_s / sum_s w_s, w_s = exp(lset_s - max lset), lse = log
// sum_s exp(lse_s); parts with no visible key weigh nothing.
#pragma once

#include <cooperative_groups.h>

#include "decode_chunk.cuh"

namespace attnd {

// Partial state of a cluster part, as dec_finish leaves it: o (normalized by
// the part's own sum) in warp 0's rows of the merge area, [MV][D]; lse and
// lset in the first 32 floats of the (m, l, lt) area.
template <class C> __device__ __forceinline__ float *dec_cl_o(uint8_t *smem) {
  return reinterpret_cast<float *>(smem + C::kStages) + 3 * C::NW * 16;
}
template <class C> __device__ __forceinline__ float *dec_cl_l(uint8_t *smem) {
  return reinterpret_cast<float *>(smem + C::kStages);
}

template <class C>
__device__ __forceinline__ void dec_cluster_merge(const DecodeParams &P, uint8_t *smem, const attnd_kitem_t &it,
                                                  int kvh) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int D = C::D, MV = C::MV;
  cg::cluster_group cl = cg::this_cluster();
  cl.sync(); // every part's state is in its shared memory
  if (cl.block_rank() == 0) {
    const int ncl = (int)cl.num_blocks(), tid = threadIdx.x, G = P.group, nvec = it.n * G;
    float *so = dec_cl_o<C>(smem), *sl = dec_cl_l<C>(smem);
    // Rank 0's own merge area past its o rows is free: the weights
    // [ncl][MV], then 1 / sum and the merged lse per vector.
    float *wt = so + MV * D, *inv = wt + ncl * MV, *mlse = inv + MV;
    if (tid < nvec) {
      float m = -INFINITY, ml = -INFINITY;
      for (int s = 0; s < ncl; s++) {
        const float *r = cl.map_shared_rank(sl, s);
        m = fmaxf(m, r[16 + tid]);
        ml = fmaxf(ml, r[tid]);
      }
      float sum = 0.f, suml = 0.f;
      for (int s = 0; s < ncl; s++) {
        const float *r = cl.map_shared_rank(sl, s);
        const float lt = r[16 + tid], ll = r[tid];
        const float w = m == -INFINITY || lt == -INFINITY ? 0.f : expf(lt - m);
        wt[s * MV + tid] = w;
        sum += w;
        suml += ml == -INFINITY || ll == -INFINITY ? 0.f : expf(ll - ml);
      }
      inv[tid] = sum > 0.f ? 1.f / sum : 0.f;
      mlse[tid] = sum > 0.f ? ml + logf(suml) : -INFINITY;
    }
    __syncthreads();
    using A = Act<C::DT>;
    for (int idx = tid; idx < nvec * D; idx += C::NTH) {
      const int r = idx / D, d = idx % D;
      float acc = 0.f;
      for (int s = 0; s < ncl; s++) {
        const float w = wt[s * MV + r];
        if (w != 0.f)
          acc += w * cl.map_shared_rank(so, s)[r * D + d];
      }
      const int row = it.q_row + r / G, h = kvh * G + r % G;
      const size_t ob = ((size_t)row * P.q_heads + h) * D + d;
      const float x = acc * inv[r];
      if (P.out_fp32)
        reinterpret_cast<float *>(P.out)[ob] = x;
      else
        reinterpret_cast<typename A::T *>(P.out)[ob] = A::from_f(x);
      if (P.lse && d == 0)
        P.lse[(size_t)row * P.q_heads + h] = mlse[r];
    }
  }
  cl.sync(); // the parts' shared memory lives until rank 0 has read it
#else
  (void)P;
  (void)smem;
  (void)it;
  (void)kvh;
#endif
}

// Launches a per-item split whose grid.z parts form one cluster (<= 16;
// over 8 is a non-portable size), with programmatic dependent launch as
// launch_ex (common.cuh).
template <class K, class... Args>
cudaError_t launch_decode_cluster(K kernel, dim3 grid, dim3 block, size_t smem, bool pdl, cudaStream_t st,
                                  Args... args) {
  if (LaunchPrint *lp = t_print) {
    print_launch(lp, kernel, grid, block, smem, 2u | (pdl ? 1u : 0u), args...);
    return cudaSuccess;
  }
  if (grid.z > 8) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess)
      return e;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = grid.z;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e != cudaSuccess && pdl) { // PDL refused (beside clusters, or at all): plain stream order
    cudaGetLastError();
    cfg.numAttrs = 1;
    e = cudaLaunchKernelEx(&cfg, kernel, args...);
  }
  return e;
}

} // namespace attnd

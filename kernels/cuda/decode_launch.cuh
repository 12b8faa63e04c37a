// decode_launch.cuh: the decode kernel's host side per instantiation: its
// launch (plain, PDL or cluster), the cluster and occupancy queries the
// planner (split_plan.cu) asks, and the explicit-instantiation macros the
// generated decode_inst_<kv>.cu files use.
#pragma once

#include "decode_kernel.cuh"

namespace attnd {

template <int D, int DT, int KV, bool TR>
cudaError_t launch_decode_one(const DecodeParams &p, dim3 grid, size_t extra_smem, bool pdl, cudaStream_t st) {
  using C = Dec<D, DT, KV, TR>;
  static bool attr_done = false; // per instantiation; benign race: both set the same value
  if (!attr_done) {
    cudaError_t e = cudaFuncSetAttribute(decode_kernel<D, DT, KV, TR>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)C::kBytes);
    if (e != cudaSuccess)
      return e;
    attr_done = true;
  }
  (void)extra_smem;
  using C16 = Dec<D, DT, KV, TR, true>;
  if constexpr (C16::kPv16) {
    static_assert(C16::kBytes == C::kBytes, "one layout");
    if (p.debug & 32768) {
      static bool attr16 = false;
      if (!attr16) {
        cudaError_t e = cudaFuncSetAttribute(decode_kernel<D, DT, KV, TR, true>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::kBytes);
        if (e != cudaSuccess)
          return e;
        attr16 = true;
      }
      if (p.cluster > 1)
        return launch_decode_cluster(decode_kernel<D, DT, KV, TR, true>, grid, dim3(C::NTH), C::kBytes, pdl, st, p);
      return launch_ex(decode_kernel<D, DT, KV, TR, true>, grid, dim3(C::NTH), C::kBytes, pdl, st, p);
    }
  }
  if (p.cluster > 1)
    return launch_decode_cluster(decode_kernel<D, DT, KV, TR>, grid, dim3(C::NTH), C::kBytes, pdl, st, p);
  return launch_ex(decode_kernel<D, DT, KV, TR>, grid, dim3(C::NTH), C::kBytes, pdl, st, p);
}

// Whether clusters of n (<= 16) parts of this instantiation can be resident
// (a cluster lives on one GPC; over 8 needs the non-portable size).
template <int D, int DT, int KV, bool TR> bool decode_cluster_ok(int n) {
  using C = Dec<D, DT, KV, TR>;
  static signed char ok[17]; // 0 unknown, 1 yes, -1 no
  if (n < 2 || n > 16)
    return false;
  if (ok[n] == 0) {
    auto k = decode_kernel<D, DT, KV, TR>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::kBytes);
    if (n > 8)
      cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1, 1, (unsigned)n);
    cfg.blockDim = dim3(C::NTH);
    cfg.dynamicSmemBytes = C::kBytes;
    cudaLaunchAttribute a[1];
    a[0].id = cudaLaunchAttributeClusterDimension;
    a[0].val.clusterDim.x = 1;
    a[0].val.clusterDim.y = 1;
    a[0].val.clusterDim.z = (unsigned)n;
    cfg.attrs = a;
    cfg.numAttrs = 1;
    int nc = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&nc, k, &cfg);
    if (e != cudaSuccess)
      cudaGetLastError();
    ok[n] = e == cudaSuccess && nc > 0 ? 1 : -1;
  }
  return ok[n] > 0;
}

// Resident CTAs per SM (planning), from the occupancy calculator.
template <int D, int DT, int KV, bool TR> int decode_occupancy() {
  using C = Dec<D, DT, KV, TR>;
  static int n = 0;
  if (n == 0) {
    cudaFuncSetAttribute(decode_kernel<D, DT, KV, TR>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::kBytes);
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, decode_kernel<D, DT, KV, TR>, C::NTH, C::kBytes) !=
            cudaSuccess ||
        b < 1) {
      cudaGetLastError();
      b = 1;
    }
    n = b;
  }
  return n;
}

// Largest item count whose prefix sums fit the stage area (flat split).
template <int D, int DT, int KV, bool TR> int decode_flat_items() {
  return (int)(Dec<D, DT, KV, TR>::kStageArea / 4) - 1;
}

// Explicit instantiations of one cache type (the generated decode_inst_<kv>.cu).
#define ATTND_DECODE_INST_ONE(D, DT, KV, TR)                                                                   \
  template cudaError_t launch_decode_one<D, DT, KV, TR>(const DecodeParams &, dim3, size_t, bool, cudaStream_t); \
  template int decode_occupancy<D, DT, KV, TR>();                                                              \
  template int decode_flat_items<D, DT, KV, TR>();                                                             \
  template bool decode_cluster_ok<D, DT, KV, TR>(int);
#define ATTND_DECODE_INST(D, DT, KV)                                                                           \
  ATTND_DECODE_INST_ONE(D, DT, KV, true)                                                                       \
  ATTND_DECODE_INST_ONE(D, DT, KV, false)

} // namespace attnd

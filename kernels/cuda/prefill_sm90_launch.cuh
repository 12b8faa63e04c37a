// prefill_sm90_launch.cuh: the host side of the Hopper prefill kernel
// (prefill_sm90_impl.cuh): its tensor map, grid and launch order, the choice
// of instantiation, and the explicit instantiations of one cache type
// (ATTND_SM90_INST, used by the prefill_sm90_<kv>.cu files).
#pragma once

#include "prefill_sm90_impl.cuh"

namespace attnd {

namespace sm90 {
// Sets the kernel's shared-memory limit (once) and launches it.
template <int D, int DT, int KV, bool LO, bool FF>
cudaError_t launch_k(const Sm90Params &P, dim3 grid, bool pdl, cudaStream_t st) {
  using C = Cfg<D, DT, KV>;
  static bool attr_done = false; // per instantiation; benign race: both set the same value
  if (!attr_done) {
    const cudaError_t e =
        cudaFuncSetAttribute(prefill_sm90_kernel<D, DT, KV, LO, FF>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::kBytes);
    if (e != cudaSuccess)
      return e;
    attr_done = true;
  }
  return launch_ex(prefill_sm90_kernel<D, DT, KV, LO, FF>, grid, dim3(C::kThreads), C::kBytes, pdl, st,
                   P);
}
} // namespace sm90

template <int D, int DT, int KV>
int launch_sm90_t(const FlashParams &p, int sched, int gchunk, int nitems, cudaStream_t st) {
  using C = sm90::Cfg<D, DT, KV>;
  Sm90Params P;
  memset(&P, 0, sizeof P);
  P.f = p;
  P.sched = sched;
  if constexpr (C::kDirect) {
    TensorMapEncodeFn enc = tensor_map_encoder();
    if (!enc)
      return set_error(__FILE__, __LINE__, "cuTensorMapEncodeTiled entry point",
                       cudaErrorNotSupported);
    // The pool's size is not part of the batch; block ids come from the block
    // tables, so the view only needs to be large enough for any of them.
    const cuuint64_t nblk = (cuuint64_t)((1ull << 46) / p.block_bytes) < 0x7fffffffull
                                ? (cuuint64_t)((1ull << 46) / p.block_bytes)
                                : 0x7fffffffull;
    const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)p.bs, (cuuint64_t)(2 * p.kv_heads),
                                nblk};
    const cuuint64_t strides[3] = {(cuuint64_t)D * 2, (cuuint64_t)p.bs * D * 2,
                                   (cuuint64_t)p.block_bytes};
    const cuuint32_t box[4] = {64, (cuuint32_t)(p.bs < C::BN ? p.bs : C::BN), 1, 1};
    const cuuint32_t estr[4] = {1, 1, 1, 1};
    const CUresult r =
        enc(&P.tmap, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, (void *)p.cache, dims, strides, box, estr,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return set_error(__FILE__, __LINE__, "cuTensorMapEncodeTiled", cudaErrorInvalidValue);
  }
  const long tiles = ((long)p.max_vec + sm90::kBMq - 1) / sm90::kBMq;
  const long groups = (long)nitems * p.kv_heads;
  if (tiles * groups > 0x7fffffffL)
    return set_invalid(__FILE__, __LINE__, "too many query tiles for the grid");
  // Enough groups per chunk to fill the GPU once (one CTA per SM), unless
  // the launch options say how many (A/B timing of the launch order).
  long chunk = gchunk > 0 ? gchunk : (num_sms() + tiles - 1) / tiles;
  chunk = chunk < 1 ? 1 : chunk > groups ? groups : chunk;
  P.qtiles = (int)tiles;
  P.gchunk = (int)chunk;
  P.ngroups_items = nitems;
  dim3 grid((unsigned)(tiles * groups), 1u, (unsigned)p.nsplit);
  // q's hi + lo split: per-channel static scales (int4 always).
  cudaError_t e;
  // The FFMA score form (sched bit 3): 16-bit caches in the activation dtype only.
  if constexpr (KV == ATTND_KV_INT8 || KV == ATTND_KV_FP8)
    e = p.per_channel ? sm90::launch_k<D, DT, KV, true, false>(P, grid, p.pdl != 0, st)
                      : sm90::launch_k<D, DT, KV, false, false>(P, grid, p.pdl != 0, st);
  else if constexpr (C::kDirect)
    e = (sched & 8) ? sm90::launch_k<D, DT, KV, false, true>(P, grid, p.pdl != 0, st)
                    : sm90::launch_k<D, DT, KV, false, false>(P, grid, p.pdl != 0, st);
  else
    e = sm90::launch_k<D, DT, KV, KV == ATTND_KV_INT4, false>(P, grid, p.pdl != 0, st);
  if (e != cudaSuccess)
    return set_error(__FILE__, __LINE__, "prefill_sm90_kernel launch", e);
  return 0;
}

#define ATTND_SM90_INST(KVT)                                                                       \
  template int launch_sm90_t<64, ATTND_DT_BF16, KVT>(const FlashParams &, int, int, int,           \
                                                     cudaStream_t);                                \
  template int launch_sm90_t<128, ATTND_DT_BF16, KVT>(const FlashParams &, int, int, int,          \
                                                      cudaStream_t);                               \
  template int launch_sm90_t<256, ATTND_DT_BF16, KVT>(const FlashParams &, int, int, int,          \
                                                      cudaStream_t);                               \
  template int launch_sm90_t<64, ATTND_DT_FP16, KVT>(const FlashParams &, int, int, int,           \
                                                     cudaStream_t);                                \
  template int launch_sm90_t<128, ATTND_DT_FP16, KVT>(const FlashParams &, int, int, int,          \
                                                      cudaStream_t);                               \
  template int launch_sm90_t<256, ATTND_DT_FP16, KVT>(const FlashParams &, int, int, int,          \
                                                      cudaStream_t);

} // namespace attnd

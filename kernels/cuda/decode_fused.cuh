// decode_fused.cuh: the decode kernel's fused step (DecodeParams.fuse,
// attnd_cuda_step): the new k / v rows written by the CTA that owns them and
// q rotated as it loads, in the write kernel's operations (write_row.cuh), so
// that the fused launch stores what the write kernel would. Included by
// decode_kernel.cuh; README.md, "The fused step", says how it is planned.
#pragma once

#include "decode_chunk.cuh"
#include "write_row.cuh"

namespace attnd {

// The fused step (DecodeParams.fuse). Channel d of a q row (its elements
// from q + qb0) rotated at RoPE position pos and rounded to the activation
// dtype: the value the write kernel stores (wr_row_load's operations).
template <class C>
__device__ __forceinline__ float dec_q_rope(const DecodeParams &P, size_t qb0, int d, int pos, float x) {
  using A = Act<C::DT>;
  const RopeParams &R = P.rp;
  if (R.rope != ATTND_ROPE_NONE && d < R.rd) {
    int p, f;
    float sign;
    rope_partner(R.rope, R.rd, d, p, sign, f);
    const float other = A::to_f(reinterpret_cast<const typename A::T *>(P.q)[qb0 + p]);
    x = rope_rotate(x, other, sign, pos, R.inv_freq[f]);
  }
  return round_dt(C::DT, x);
}

// The fused step's phase 1 in CTA (item it, kv head kvh, part split): the k
// and v rows of kvh for the item's new tokens whose keys this part covers
// (the per-item split's part (pos - b0) / split_keys, clamped, so that every
// new row has exactly one writer), before the part's loads read them. A warp
// per row (unit u: token u / 2, v when u is odd). The rows are computed
// (loads, RoPE, rounding: inputs of this launch) before the wait for the
// previous kernel and staged in the stage area, which is free until
// dec_piece issues its first copies, where they fit (dec_fused_fits), and
// stored after it (dec_fused_store); else both after it (dec_fused_write).
// The stores reach the copies of every warp through a CTA fence and barrier.
__device__ __forceinline__ bool dec_owns(const DecodeParams &P, const attnd_kitem_t &it, int r, int split, int b0) {
  return P.nsplit <= 1 || min(P.nsplit - 1, max(0, (it.start + r - b0) / P.split_keys)) == split;
}
template <class C> __device__ __forceinline__ bool dec_fused_fits(const attnd_kitem_t &it) {
  return (size_t)(C::NW * 256 + 2 * it.n * C::D) * sizeof(float) <= C::kStageArea;
}
template <class C> __device__ __forceinline__ WrCache dec_wr_cache(const DecodeParams &P) {
  return WrCache{C::KV, C::D, P.bs, P.kv_heads, P.per_channel, P.k_scale, P.v_scale, P.k_zero, P.v_zero};
}
template <class C>
__device__ __forceinline__ void dec_fused_load(const DecodeParams &P, uint8_t *smem, const attnd_kitem_t &it, int kvh,
                                               int u, float (&x)[kWrMaxEpl]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = u >> 1;
  const bool isv = u & 1;
  float *buf = reinterpret_cast<float *>(smem + C::kStages) + warp * 256;
  wr_row_load(x, C::DT, C::D, isv ? P.v : P.k, ((size_t)(it.kv_row + r) * P.kv_heads + kvh) * C::D, !isv, P.rp,
              it.start + r + it.pos_base, buf, lane);
}
template <class C>
__device__ __forceinline__ void dec_fused_put(const DecodeParams &P, const attnd_kitem_t &it, int kvh, int u,
                                              const float (&x)[kWrMaxEpl]) {
  const int lane = threadIdx.x & 31, pos = it.start + (u >> 1);
  const int32_t *bt = P.meta + it.block_table;
  uint8_t *blk = const_cast<uint8_t *>(P.cache) + (size_t)bt[pos / P.bs] * P.block_bytes;
  wr_row_store_kv(x, dec_wr_cache<C>(P), kvh, u & 1, blk, pos % P.bs, lane);
}
// Staged rows: [2 n][D] floats after the warps' RoPE buffers.
template <class C> __device__ __forceinline__ float *dec_fused_rows(uint8_t *smem) {
  return reinterpret_cast<float *>(smem + C::kStages) + C::NW * 256;
}
template <class C>
__device__ void dec_fused_stage(const DecodeParams &P, uint8_t *smem, const attnd_kitem_t &it, int kvh, int split,
                                int b0) {
  const int warp = threadIdx.x >> 5, c0 = (threadIdx.x & 31) * (C::D / 32);
  float *rows = dec_fused_rows<C>(smem);
  for (int u = warp; u < 2 * it.n; u += C::NW) {
    if (!dec_owns(P, it, u >> 1, split, b0))
      continue;
    float x[kWrMaxEpl];
    dec_fused_load<C>(P, smem, it, kvh, u, x);
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < C::D / 32; e++)
      rows[u * C::D + c0 + e] = x[e];
  }
}
template <class C>
__device__ void dec_fused_store(const DecodeParams &P, uint8_t *smem, const attnd_kitem_t &it, int kvh, int split,
                                int b0) {
  const int warp = threadIdx.x >> 5, c0 = (threadIdx.x & 31) * (C::D / 32);
  const float *rows = dec_fused_rows<C>(smem);
  for (int u = warp; u < 2 * it.n; u += C::NW) {
    if (!dec_owns(P, it, u >> 1, split, b0))
      continue;
    float x[kWrMaxEpl];
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < C::D / 32; e++)
      x[e] = rows[u * C::D + c0 + e];
    dec_fused_put<C>(P, it, kvh, u, x);
  }
  __threadfence_block();
  __syncthreads(); // the rows are visible, the staging area is free for the stages
}
template <class C>
__device__ void dec_fused_write(const DecodeParams &P, uint8_t *smem, const attnd_kitem_t &it, int kvh, int split,
                                int b0) {
  const int warp = threadIdx.x >> 5;
  for (int u = warp; u < 2 * it.n; u += C::NW) {
    if (!dec_owns(P, it, u >> 1, split, b0))
      continue;
    float x[kWrMaxEpl];
    dec_fused_load<C>(P, smem, it, kvh, u, x);
    dec_fused_put<C>(P, it, kvh, u, x);
  }
  __threadfence_block();
}

// The fused step's rotated q of (item it, kv head kvh) back in place, by part
// 0 once every part has loaded it (after the cluster's last barrier, or
// after the piece of a single part).
template <class C>
__device__ void dec_fused_q(const DecodeParams &P, uint8_t *smem, const attnd_kitem_t &it, int kvh) {
  constexpr int D = C::D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = P.group;
  __syncthreads(); // the piece's last reads of shared memory are done
  float *buf = reinterpret_cast<float *>(smem + C::kStages) + warp * 256;
  for (int u = warp; u < it.n * G; u += C::NW) {
    const int t = u / G, h = kvh * G + u % G;
    const size_t base = ((size_t)(it.q_row + t) * P.q_heads + h) * D;
    float x[kWrMaxEpl];
    wr_row_load(x, C::DT, D, P.q, base, true, P.rp, it.start + t + it.pos_base, buf, lane);
    wr_row_store_q(x, C::DT, D, const_cast<void *>(P.q), base, lane);
  }
}

} // namespace attnd

// decode.cu: the split-KV side of attention. Batches with few query rows per
// item (decode) give too few CTAs to fill the GPU with one CTA per (item, kv
// head); their key range is then split across CTAs, each writing a partial
// output normalized by its own sum plus that part's lse, and merge_kernel
// combines the parts by lse (FlashDecoding; FlashInfer's cascade merge).
#include <math.h>
#include <stdlib.h>

#include "decode.cuh"

namespace attnd {
namespace {

constexpr int kMaxSplits = 32;

// One warp per (query row, q head): out = sum_s w_s o_s, w_s = exp(lse_s - lse).
__global__ void merge_kernel(const float *__restrict__ ws_o, const float *__restrict__ ws_lse, int nsplit,
                             int rows, int q_heads, int d, int dt, int out_fp32, void *out, float *lse) {
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (gw >= rows * q_heads)
    return;
  const size_t stride_o = (size_t)rows * q_heads * d, stride_l = (size_t)rows * q_heads;
  float m = -INFINITY;
  for (int s = 0; s < nsplit; s++)
    m = fmaxf(m, ws_lse[s * stride_l + gw]);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum = 0.f;
  if (m != -INFINITY) {
    for (int s = 0; s < nsplit; s++) {
      const float l = ws_lse[s * stride_l + gw];
      if (l == -INFINITY)
        continue;
      const float w = expf(l - m);
      sum += w;
      const float *o = ws_o + s * stride_o + (size_t)gw * d;
      for (int e = 0; e < d / 32; e++)
        acc[e] += w * o[lane + 32 * e];
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int e = 0; e < d / 32; e++)
    store_dt(out_fp32 ? ATTND_DT_FP32 : dt, out, (size_t)gw * d + lane + 32 * e, acc[e] * inv);
  if (lse && lane == 0)
    lse[gw] = sum > 0.f ? m + logf(sum) : -INFINITY;
}

} // namespace

size_t split_bytes_per_part(const attnd_kshape_t *s, int32_t total_q) {
  return (size_t)total_q * s->q_heads * (s->head_dim + 1) * sizeof(float);
}

bool direct_decode(const attnd_kshape_t *s, int max_vec) {
  static const int off = getenv("ATTND_FLASH_DEBUG") ? (atoi(getenv("ATTND_FLASH_DEBUG")) & 4) : 0;
  const bool eight = s->kv == ATTND_KV_INT8 || s->kv == ATTND_KV_FP8 || s->kv == ATTND_KV_INT8_DYNAMIC ||
                     s->kv == ATTND_KV_FP8_DYNAMIC;
  return !off && s->head_dim <= 128 &&
         (eight ? max_vec <= 16 : s->kv == ATTND_KV_INT4 && max_vec <= 8);
}

template <int D, int DT> static int occ_kv(int kv, int mv) {
  switch (kv) {
  case ATTND_KV_INT8: return direct_occupancy<D, DT, ATTND_KV_INT8>(mv);
  case ATTND_KV_FP8: return direct_occupancy<D, DT, ATTND_KV_FP8>(mv);
  case ATTND_KV_INT8_DYNAMIC: return direct_occupancy<D, DT, ATTND_KV_INT8_DYNAMIC>(mv);
  case ATTND_KV_INT4: return direct_occupancy<D, DT, ATTND_KV_INT4>(mv);
  default: return direct_occupancy<D, DT, ATTND_KV_FP8_DYNAMIC>(mv);
  }
}

int direct_ctas_per_sm(const attnd_kshape_t *s, int mv) {
  if (s->head_dim == 64)
    return s->dtype == ATTND_DT_BF16 ? occ_kv<64, ATTND_DT_BF16>(s->kv, mv) : occ_kv<64, ATTND_DT_FP16>(s->kv, mv);
  return s->dtype == ATTND_DT_BF16 ? occ_kv<128, ATTND_DT_BF16>(s->kv, mv) : occ_kv<128, ATTND_DT_FP16>(s->kv, mv);
}

// Resident CTAs per SM of the attention kernel's decode variant (shared memory
// bound): 16-bit caches stage 2x32 KB per tile, the quantized ones less.
static int slots_per_sm(const attnd_kshape_t *s, int max_vec) {
  if (direct_decode(s, max_vec))
    return direct_ctas_per_sm(s, max_vec);
  if (s->head_dim > 128)
    return 1;
  return (s->kv == ATTND_KV_BF16 || s->kv == ATTND_KV_FP16) ? 2 : 3;
}

int plan_splits(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes, int *split_keys) {
  const int G = s->q_heads / s->kv_heads;
  const long tiles = ((long)b->max_n * G + kBM - 1) / kBM;
  const long base = (long)b->nitems * s->kv_heads * tiles;
  const long slots = (long)num_sms() * slots_per_sm(s, b->max_n * G);
  int nsplit = 1;
  if (b->total_q > 0 && base < 4 * slots) {
    // The fewest parts whose CTAs fill their waves to 90% (an idle slot in
    // the last wave is time lost; every extra part costs a prologue, a shorter
    // pipeline and merge traffic), else the best filling. Two waves measured
    // worse than one or four on the H200 (bench/RESULTS.md): skip them.
    long limit = b->max_kv_len / (2 * kBN); // at least two key tiles per part
    const long by_ws = (long)(ws_bytes / split_bytes_per_part(s, b->total_q));
    if (limit > by_ws)
      limit = by_ws;
    if (limit > kMaxSplits)
      limit = kMaxSplits;
    double best = 0.0;
    for (long k = 1; k <= limit; k++) {
      const long ctas = base * k, waves = (ctas + slots - 1) / slots;
      const double eff = (double)ctas / (double)(waves * slots);
      if (eff > best + 0.02 && waves != 2) {
        best = eff;
        nsplit = (int)k;
      }
      if (eff >= 0.9 && waves != 2)
        break;
    }
  }
  int keys = (b->max_kv_len + nsplit - 1) / nsplit;
  keys = (keys + kBN - 1) / kBN * kBN;
  if (keys < kBN)
    keys = kBN;
  *split_keys = keys;
  return nsplit > 1 ? (b->max_kv_len + keys - 1) / keys : 1;
}

int launch_merge(const attnd_kshape_t *s, const attnd_kbatch_t *b, const FlashParams &p, cudaStream_t st) {
  const long warps = (long)b->total_q * s->q_heads;
  const int threads = 256;
  const long blocks = (warps * 32 + threads - 1) / threads;
  merge_kernel<<<(unsigned)blocks, threads, 0, st>>>(p.ws_o, p.ws_lse, p.nsplit, b->total_q, s->q_heads,
                                                     s->head_dim, s->dtype, b->out_fp32, b->out, b->lse);
  ATTND_CU_LAUNCH("merge_kernel launch");
  return 0;
}

} // namespace attnd

extern "C" size_t attnd_cuda_attend_workspace(const attnd_kshape_t *s, int32_t total_q) {
  return attnd::kMaxSplits * attnd::split_bytes_per_part(s, total_q);
}

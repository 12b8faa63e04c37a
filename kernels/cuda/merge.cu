// merge.cu: the merge of partial attention states. A part is an output
// normalized by its own sum, that sum's log (lset) and the part's lse; parts of
// the same query row combine as out = sum_s w_s o_s / sum_s w_s with
// w_s = exp(lset_s - max lset) and lse = log sum_s exp(lse_s) (FlashDecoding;
// FlashInfer's cascade merge). The kernels write lse = lset (the log of the
// sum each output was normalized by, the sum of P as rounded for the matrix
// units: docs/numerics.md), so the lse written here is the merged lset and a
// client merging several daemons' answers by lse weighs them consistently.
// Parts with no visible key weigh nothing; a row with none gets 0 and -inf.
#include <math.h>

#include "decode_params.cuh"
#include "primitives.cuh"

namespace attnd {
namespace {

// Per-item split: one warp per (query row, q head) over nsplit <= 32 parts.
// Lane s holds part s's weight; the weighted sum then reads the parts four at
// a time, their loads independent (a loop of dependent loads over 32 parts
// cost ~30 us).
__global__ void merge_split_kernel(const float *__restrict__ ws_o, const float *__restrict__ ws_lse, int nsplit,
                                   int rows, int q_heads, int d, int dt, int out_fp32, void *out, float *lse) {
  pdl_wait();
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (gw >= rows * q_heads)
    return;
  const size_t stride_o = (size_t)rows * q_heads * d, stride_l = (size_t)rows * q_heads;
  const float *ws_lset = ws_lse + (size_t)nsplit * stride_l;
  const float lt = lane < nsplit ? ws_lset[lane * stride_l + gw] : -INFINITY;
  const float ll = lane < nsplit ? ws_lse[lane * stride_l + gw] : -INFINITY;
  float m = lt, ml = ll;
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    ml = fmaxf(ml, __shfl_xor_sync(0xffffffffu, ml, o));
  }
  const float w = m == -INFINITY || lt == -INFINITY ? 0.f : expf(lt - m);
  float sum = w, suml = ml == -INFINITY || ll == -INFINITY ? 0.f : expf(ll - ml);
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    suml += __shfl_xor_sync(0xffffffffu, suml, o);
  }
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int s0 = 0; s0 < nsplit; s0 += 4) {
    float ws4[4], ov[4][8];
#pragma unroll
    for (int u = 0; u < 4; u++)
      ws4[u] = __shfl_sync(0xffffffffu, w, (s0 + u) & 31);
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const bool live = s0 + u < nsplit && ws4[u] != 0.f;
      const float *o = ws_o + (size_t)(s0 + u) * stride_o + (size_t)gw * d;
#pragma unroll
      for (int e = 0; e < 8; e++) // d / 32 of them (constant indices keep acc in registers)
        ov[u][e] = live && e < d / 32 ? o[lane + 32 * e] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const float wu = s0 + u < nsplit ? ws4[u] : 0.f;
#pragma unroll
      for (int e = 0; e < 8; e++)
        acc[e] += wu * ov[u][e];
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int e = 0; e < 8; e++)
    if (e < d / 32)
      store_dt(out_fp32 ? ATTND_DT_FP32 : dt, out, (size_t)gw * d + lane + 32 * e, acc[e] * inv);
  if (lse && lane == 0)
    lse[gw] = sum > 0.f ? ml + logf(suml) : -INFINITY;
}

// Flat split: one CTA per (item, held kv head); nothing to do when one decode
// CTA covered the whole (item, kv head) (it wrote the output). Otherwise the
// parts are, with model CTAs c0..c1 holding its chunks (head-major over the
// model's kv heads, ranges clipped to the held heads': decode_params.cuh) and
// slot pairs numbered from the first model CTA run here (cfirst): the first
// CTA's slot (its first when its range starts with this segment, else its
// second, its last piece), the first slots of the CTAs strictly inside, and
// the first slot of the last CTA; CTAs with no chunks (more CTAs than chunks)
// are skipped. The parts and their order are the whole model's, so a head
// shard merges to the same bits. A warp per query vector: lanes take parts
// for the maxima and sums, then channels (coalesced) for the weighted sum.
__global__ void __launch_bounds__(128) merge_flat_kernel(const __grid_constant__ DecodeParams P, int d, int dt) {
  extern __shared__ float sw[]; // [4 warps][nc] weights of the parts
  pdl_wait();
  const int item = blockIdx.x / P.kv_heads, h = blockIdx.x % P.kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const attnd_kitem_t it = P.items[item];
  if (it.q_row < 0)
    return;
  const int *pre = reinterpret_cast<const int *>(P.ws + flat_prefix_offset(P.nctas, P.max_vec, d));
  const int nc = pre[P.nitems + 1], cfirst = pre[P.nitems + 2]; // the model's CTAs, the first run here
  const long long S = pre[P.nitems], W = (long long)P.mkv * S;
  const long long lo = (long long)P.kvh0 * S, hi = lo + (long long)P.kv_heads * S;
  const int nch = pre[item + 1] - pre[item];
  const long long s0 = (long long)(P.kvh0 + h) * S + pre[item], s1 = s0 + nch;
  const int c0 = flat_cta(s0, nc, W), c1 = flat_cta(s1 - 1, nc, W);
  if (c0 == c1)
    return;
  const int first0 = flat_clip(c0, nc, W, lo, hi) == s0 ? 0 : 1;
  const int G = P.group, nvec = it.n * G, np = c1 - c0 + 1;
  const size_t sf = flat_slot_floats(P.max_vec, d);
  auto slot = [&](int c) -> const float * {
    return P.ws + (size_t)(2 * (c - cfirst) + (c == c0 ? first0 : 0)) * sf;
  };
  auto empty = [&](int c) -> bool {
    return c != c0 && c != c1 && flat_clip(c + 1, nc, W, lo, hi) == flat_clip(c, nc, W, lo, hi);
  };
  const size_t il = (size_t)P.max_vec * d, it2 = (size_t)P.max_vec * (d + 1);
  float *w = sw + warp * P.nctas;
  for (int v = warp; v < nvec; v += 4) {
    float m = -INFINITY, ml = -INFINITY;
    for (int q = lane; q < np; q += 32) {
      const int c = c0 + q;
      if (empty(c))
        continue;
      m = fmaxf(m, slot(c)[it2 + v]);
      ml = fmaxf(ml, slot(c)[il + v]);
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      ml = fmaxf(ml, __shfl_xor_sync(0xffffffffu, ml, o));
    }
    float sum = 0.f, suml = 0.f;
    for (int q = lane; q < np; q += 32) {
      const int c = c0 + q;
      float wq = 0.f;
      if (!empty(c) && m != -INFINITY && slot(c)[it2 + v] != -INFINITY) {
        wq = expf(slot(c)[it2 + v] - m);
        suml += expf(slot(c)[il + v] - ml);
      }
      w[q] = wq;
      sum += wq;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
      suml += __shfl_xor_sync(0xffffffffu, suml, o);
    }
    __syncwarp();
    // The weighted sum, four parts at a time with independent loads.
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int q0 = 0; q0 < np; q0 += 4) {
      float wu[4], ov[4][8];
#pragma unroll
      for (int u = 0; u < 4; u++)
        wu[u] = q0 + u < np ? w[q0 + u] : 0.f;
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const float *o = slot(c0 + q0 + u) + (size_t)v * d;
#pragma unroll
        for (int e = 0; e < 8; e++) // d / 32 of them (constant indices keep acc in registers)
          ov[u][e] = wu[u] != 0.f && e < d / 32 ? o[lane + 32 * e] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < 4; u++)
#pragma unroll
        for (int e = 0; e < 8; e++)
          acc[e] += wu[u] * ov[u][e];
    }
    __syncwarp(); // w is rewritten for the next vector
    const int row = it.q_row + v / G, qh = h * G + v % G;
    const size_t ob = ((size_t)row * P.q_heads + qh) * d;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int e = 0; e < 8; e++)
      if (e < d / 32)
        store_dt(P.out_fp32 ? ATTND_DT_FP32 : dt, P.out, ob + lane + 32 * e, acc[e] * inv);
    if (P.lse && lane == 0)
      P.lse[(size_t)row * P.q_heads + qh] = sum > 0.f ? ml + logf(suml) : -INFINITY;
  }
}

} // namespace

int launch_merge_flat(const attnd_kshape_t *s, const DecodeParams &p, bool pdl, cudaStream_t st) {
  const unsigned blocks = (unsigned)p.nitems * (unsigned)p.kv_heads;
  const size_t smem = (size_t)4 * p.nctas * sizeof(float); // a warp's part weights
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(merge_flat_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
      return set_error(__FILE__, __LINE__, "merge_flat_kernel attribute", e);
  }
  cudaError_t e = launch_ex(merge_flat_kernel, dim3(blocks), dim3(128), smem, pdl, st, p, s->head_dim, (int)s->dtype);
  if (e != cudaSuccess)
    return set_error(__FILE__, __LINE__, "merge_flat_kernel launch", e);
  return 0;
}

int launch_merge_split(const attnd_kshape_t *s, const attnd_kbatch_t *b, const float *ws_o, const float *ws_lse,
                       int nsplit, bool pdl, cudaStream_t st) {
  const long warps = (long)b->total_q * s->q_heads;
  const int threads = 256;
  const long blocks = (warps * 32 + threads - 1) / threads;
  cudaError_t e = launch_ex(merge_split_kernel, dim3((unsigned)blocks), dim3(threads), 0, pdl, st, ws_o, ws_lse,
                            nsplit, (int)b->total_q, (int)s->q_heads, (int)s->head_dim, (int)s->dtype,
                            (int)b->out_fp32, b->out, b->lse);
  if (e != cudaSuccess)
    return set_error(__FILE__, __LINE__, "merge_split_kernel launch", e);
  return 0;
}

} // namespace attnd

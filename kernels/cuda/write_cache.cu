// write_cache.cu: phase 1, fused. For every new token: RoPE on its q heads (in
// place) and k heads, rounding to the activation dtype, quantization to the
// cache type and the paged store of k and v (docs/numerics.md).
//
// One warp per (new token, head row): q heads, then k heads, then v heads of
// the token; 8 warps per CTA. Every row is independent, so a decode step's few
// tokens still spread over many warps (one warp looping over a token's 48 rows
// took ~24 us on the H200; the flat grid takes a few). A lane holds
// D/32 consecutive channels, so an int4 byte (channels 2c, 2c+1) stays in one
// lane and the dynamic scale is one warp reduction. Not templated: the kernel
// moves a few bytes per token and is far from any roofline; runtime switches
// keep the compile time for the op small.
#include <math.h>
#include <string.h>

#include "primitives.cuh"

namespace attnd {
namespace {

constexpr int kWarps = 8;
// Channels per lane at the largest head dim (256 / 32). The per-channel loops
// run to it, unrolled, under the runtime count, so that a lane's x[] stays in
// registers: with a runtime bound it lived in local memory (1 KB stack, each
// element stored and reloaded between the load, RoPE, rounding and
// quantization passes; ncu put one token's write at 5.8 us of device time,
// latency-bound at 12 cycles per issued instruction, bench/RESULTS.md decode4).
constexpr int kMaxEpl = 8;

struct WriteParams {
  attnd_kbatch_t b;
  int q_heads, kv_heads, d, bs, dt, kv, rope, rd;
  float inv_freq[128]; // theta^(-2i/rd), fp64 rounded to fp32 (docs/numerics.md)
};

// The item whose k/v rows hold row t: the last one with kv_row <= t (items
// are packed in order, so kv_row increases). The warp searches 32 items a
// round, so a batch of up to 1024 items costs two dependent loads, not ten.
__device__ int find_item(const attnd_kitem_t *items, int nitems, int t, int lane) {
  int lo = 0, hi = nitems; // items[lo].kv_row <= t; the answer is in [lo, hi)
  while (hi - lo > 1) {
    const int step = (hi - lo + 31) / 32, idx = lo + lane * step;
    const unsigned m = __ballot_sync(0xffffffffu, idx < hi && items[idx].kv_row <= t);
    lo += (31 - __clz(m)) * step;
    hi = min(hi, lo + step);
  }
  return lo;
}

__global__ void __launch_bounds__(kWarps * 32) write_kernel(const __grid_constant__ WriteParams P) {
  __shared__ float buf[kWarps][256];
  // Launched with programmatic dependent launch: the attention kernel after
  // this one may start its prologue now; this kernel reads its inputs at
  // once but waits for the kernel before it (which may still read the cache
  // and q) before its first store.
  pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per_token = P.q_heads + 2 * P.kv_heads;
  const long gw = (long)blockIdx.x * kWarps + warp;
  // Rows past total_kv are attend-only items' q rows (attnd_kbatch_t.q_only_rows).
  if (gw >= ((long)P.b.total_kv + P.b.q_only_rows) * per_token)
    return;
  const int t = (int)(gw / per_token);
  const attnd_kbatch_t &b = P.b;
  const attnd_kitem_t it = b.items[find_item(b.items, b.nitems, t, lane)];
  const int r = t - it.kv_row;
  const int pos = it.start + r;
  const int d = P.d, epl = d / 32, c0 = lane * epl;
  const bool has_q = it.q_row >= 0;
  const int32_t *bt = b.meta + it.block_table;
  // An attend-only item's pos is below its keys' end: a block it holds, never written.
  uint8_t *blk = b.cache + (size_t)bt[pos / P.bs] * b.block_bytes;
  const int off = pos % P.bs;
  const int rb = kv_row_bytes(P.kv, d);

  {
    // Unit order: q heads, then k heads, then v heads.
    const int u = (int)(gw % per_token);
    int kind, h;
    if (u < P.q_heads) {
      if (!has_q)
        return; // kv-only item: no q rows
      kind = 0;
      h = u;
    } else {
      if (t >= b.total_kv)
        return; // attend-only item: no k/v rows, nothing written
      int w = u - P.q_heads;
      kind = w < P.kv_heads ? 1 : 2;
      h = kind == 1 ? w : w - P.kv_heads;
    }
    const void *src;
    size_t base;
    if (kind == 0) {
      src = b.q;
      base = ((size_t)(it.q_row + r) * P.q_heads + h) * d;
    } else {
      src = kind == 1 ? b.k : b.v;
      base = ((size_t)t * P.kv_heads + h) * d;
    }
    float x[8];
    #pragma unroll
    for (int e = 0; e < kMaxEpl && e < epl; e++)
      x[e] = load_dt(P.dt, src, base + c0 + e);
    if (kind != 2 && P.rope != ATTND_ROPE_NONE) {
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e++)
        buf[warp][c0 + e] = x[e];
      __syncwarp();
      const int half = P.rd / 2;
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e++) {
        const int i = c0 + e;
        if (i >= P.rd)
          continue;
        int f;
        float other, sign;
        if (P.rope == ATTND_ROPE_NEOX) {
          f = i < half ? i : i - half;
          other = i < half ? buf[warp][i + half] : buf[warp][i - half];
          sign = i < half ? -1.f : 1.f;
        } else {
          f = i >> 1;
          other = (i & 1) ? buf[warp][i - 1] : buf[warp][i + 1];
          sign = (i & 1) ? 1.f : -1.f;
        }
        // fp32 angle and accurate sin/cos; no contraction into fma, so the
        // result is the correctly rounded fp32 expression of docs/numerics.md.
        const float ang = __fmul_rn((float)(pos + it.pos_base), P.inv_freq[f]); // pos_base: split context
        float sn, cs;
        sincosf(ang, &sn, &cs);
        x[e] = __fadd_rn(__fmul_rn(x[e], cs), sign * __fmul_rn(other, sn));
      }
      __syncwarp();
    }
    #pragma unroll
    for (int e = 0; e < kMaxEpl && e < epl; e++)
      x[e] = round_dt(P.dt, x[e]);
    pdl_wait();
    if (kind == 0) {
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e++)
        store_dt(P.dt, b.q, base + c0 + e, x[e]);
      return;
    }
    const bool isv = kind == 2;
    uint8_t *row = blk + (size_t)(isv ? P.kv_heads * P.bs : 0) * rb + ((size_t)h * P.bs + off) * rb;
    const float *sc = isv ? b.v_scale : b.k_scale;
    switch (P.kv) {
    case ATTND_KV_BF16:
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e++)
        reinterpret_cast<__nv_bfloat16 *>(row)[c0 + e] = __float2bfloat16_rn(x[e]);
      break;
    case ATTND_KV_FP16:
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e++)
        reinterpret_cast<__half *>(row)[c0 + e] = __float2half_rn(x[e]);
      break;
    case ATTND_KV_INT8:
    case ATTND_KV_FP8:
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e++) {
        const float s = b.scale_per_channel ? sc[h * d + c0 + e] : sc[h];
        const float y = __fdiv_rn(x[e], s);
        if (P.kv == ATTND_KV_INT8)
          row[c0 + e] = (uint8_t)(int8_t)max(-127, min(127, __float2int_rn(y)));
        else
          row[c0 + e] = f_to_fp8(y);
      }
      break;
    case ATTND_KV_INT8_DYNAMIC:
    case ATTND_KV_FP8_DYNAMIC: {
      float m = 0.f;
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e++)
        m = fmaxf(m, fabsf(x[e]));
      for (int o = 16; o; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const bool i8 = P.kv == ATTND_KV_INT8_DYNAMIC;
      const float s = __fdiv_rn(m, i8 ? 127.f : 448.f);
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e++) {
        uint8_t qv = 0;
        if (s > 0.f) {
          const float y = __fdiv_rn(x[e], s);
          qv = i8 ? (uint8_t)(int8_t)max(-127, min(127, __float2int_rn(y))) : f_to_fp8(y);
        }
        row[c0 + e] = qv;
      }
      if (lane == 0) {
        float *scales = reinterpret_cast<float *>(blk + (size_t)2 * P.kv_heads * P.bs * rb);
        scales[(isv ? P.kv_heads * P.bs : 0) + h * P.bs + off] = s;
      }
      break;
    }
    case ATTND_KV_INT4: {
      const float *zp = isv ? b.v_zero : b.k_zero;
      #pragma unroll
      for (int e = 0; e < kMaxEpl && e < epl; e += 2) {
        int u2[2];
        for (int j = 0; j < 2; j++) {
          const int c = h * d + c0 + e + j;
          const float y = __fadd_rn(__fdiv_rn(x[e + j], sc[c]), zp[c]);
          u2[j] = max(0, min(15, __float2int_rn(y)));
        }
        row[(c0 + e) >> 1] = (uint8_t)(u2[0] | (u2[1] << 4));
      }
      break;
    }
    }
  }
}

} // namespace
} // namespace attnd

using namespace attnd;

extern "C" int attnd_cuda_write_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *stream,
                                     const attnd_cuda_opts_t *opts) {
  if (attnd_kshape_check(s) != 0)
    return set_invalid(__FILE__, __LINE__, "unsupported shape");
  if ((b->total_kv <= 0 && b->q_only_rows <= 0) || b->nitems <= 0)
    return 0;
  if (!b->cache || !b->items || !b->meta || (b->total_kv > 0 && (!b->k || !b->v)))
    return set_invalid(__FILE__, __LINE__, "batch without cache, items, meta, k or v");
  if (attnd_kv_type_static(s->kv) && (!b->k_scale || !b->v_scale))
    return set_invalid(__FILE__, __LINE__, "static cache type without scales");
  if (s->kv == ATTND_KV_INT4 && (!b->k_zero || !b->v_zero))
    return set_invalid(__FILE__, __LINE__, "int4 cache without zero points");
  WriteParams P;
  P.b = *b;
  P.q_heads = s->q_heads;
  P.kv_heads = s->kv_heads;
  P.d = s->head_dim;
  P.bs = s->block_size;
  P.dt = s->dtype;
  P.kv = s->kv;
  P.rope = s->rope;
  P.rd = s->rotary_dim ? s->rotary_dim : s->head_dim;
  // theta^(-2i/rd) in fp64, kept per thread for the last (theta, rd): a
  // decode step should not pay 64 pow() calls on the submitting thread.
  static thread_local double last_theta = -1.0;
  static thread_local int last_rd = -1;
  static thread_local float inv_freq[128];
  if (last_theta != s->rope_theta || last_rd != P.rd) {
    for (int i = 0; i < 128; i++)
      inv_freq[i] = i < P.rd / 2 ? (float)pow(s->rope_theta, -2.0 * i / (double)P.rd) : 0.f;
    last_theta = s->rope_theta;
    last_rd = P.rd;
  }
  memcpy(P.inv_freq, inv_freq, sizeof(inv_freq));
  const long warps = ((long)b->total_kv + (b->q_only_rows > 0 ? b->q_only_rows : 0)) *
                     (s->q_heads + 2 * s->kv_heads);
  const long ctas = (warps + kWarps - 1) / kWarps;
  if (ctas > 0x7fffffffL)
    return set_invalid(__FILE__, __LINE__, "too many rows for one write launch");
  const bool pdl = !(opts && opts->no_pdl);
  cudaError_t e = launch_ex(write_kernel, dim3((unsigned)ctas), dim3(kWarps * 32), 0, pdl, (cudaStream_t)stream, P);
  if (e != cudaSuccess)
    return set_error(__FILE__, __LINE__, "write_kernel launch", e);
  return 0;
}

extern "C" int attnd_cuda_write(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *stream) {
  return attnd_cuda_write_opts(s, b, stream, nullptr);
}

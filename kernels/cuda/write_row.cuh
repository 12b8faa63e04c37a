// write_row.cuh: phase 1 of one row (docs/numerics.md): RoPE of a q or k row,
// rounding to the activation dtype, and the quantized store of a k or v row
// into its cache block. Shared by the write kernel (write_cache.cu, a warp
// per row) and the decode kernel's fused step (decode_kernel.cuh: the CTA
// whose keys hold a new token writes that token's row before it reads it,
// and rotates its q as it loads it), so that both paths compute every value
// with the same operations in the same order and write the same bytes.
//
// A row is handled by one warp: lane l holds channels [l D/32, (l+1) D/32),
// so an int4 byte (channels 2c, 2c+1) stays in one lane and a dynamic scale
// is one warp reduction. The per-channel loops run to the largest count
// (kWrMaxEpl, D 256), unrolled, under the runtime one, so that a lane's x[]
// stays in registers (with a runtime bound it lived in local memory:
// bench/RESULTS.md, decode4).
#pragma once

#include <math.h>

#include "common.cuh"

namespace attnd {

constexpr int kWrMaxEpl = 8; // channels per lane at the largest head dim (256 / 32)

// RoPE of a step: the kind, the rotated channels and theta^(-2i/rd) (fp64
// rounded to fp32 on the host, docs/numerics.md).
struct RopeParams {
  int rope, rd;
  float inv_freq[128];
};

// Channel i's partner, sign and frequency index under RoPE (i < rd).
__device__ __forceinline__ void rope_partner(int rope, int rd, int i, int &partner, float &sign, int &f) {
  const int half = rd / 2;
  if (rope == ATTND_ROPE_NEOX) {
    f = i < half ? i : i - half;
    partner = i < half ? i + half : i - half;
    sign = i < half ? -1.f : 1.f;
  } else {
    f = i >> 1;
    partner = (i & 1) ? i - 1 : i + 1;
    sign = (i & 1) ? 1.f : -1.f;
  }
}

// x rotated against its partner's value at RoPE position pos: an fp32 angle
// and accurate sin/cos, no contraction into fma, so the result is the
// correctly rounded fp32 expression of docs/numerics.md.
__device__ __forceinline__ float rope_rotate(float x, float other, float sign, int pos, float invf) {
  const float ang = __fmul_rn((float)pos, invf);
  float sn, cs;
  sincosf(ang, &sn, &cs);
  return __fadd_rn(__fmul_rn(x, cs), sign * __fmul_rn(other, sn));
}

// Loads a row (src[base ..]), rotates it when rot (q and k rows) at RoPE
// position pos and rounds it to the activation dtype: the lane's channels in
// x[]. buf: the warp's 256 floats of shared memory (the partners' values).
__device__ __forceinline__ void wr_row_load(float (&x)[kWrMaxEpl], int dt, int d, const void *src, size_t base,
                                            bool rot, const RopeParams &R, int pos, float *buf, int lane) {
  const int epl = d / 32, c0 = lane * epl;
#pragma unroll
  for (int e = 0; e < kWrMaxEpl && e < epl; e++)
    x[e] = load_dt(dt, src, base + c0 + e);
  if (rot && R.rope != ATTND_ROPE_NONE) {
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < epl; e++)
      buf[c0 + e] = x[e];
    __syncwarp();
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < epl; e++) {
      const int i = c0 + e;
      if (i >= R.rd)
        continue;
      int p, f;
      float sign;
      rope_partner(R.rope, R.rd, i, p, sign, f);
      x[e] = rope_rotate(x[e], buf[p], sign, pos, R.inv_freq[f]);
    }
    __syncwarp();
  }
#pragma unroll
  for (int e = 0; e < kWrMaxEpl && e < epl; e++)
    x[e] = round_dt(dt, x[e]);
}

// Stores a rotated, rounded q row back in place.
__device__ __forceinline__ void wr_row_store_q(const float (&x)[kWrMaxEpl], int dt, int d, void *q, size_t base,
                                               int lane) {
  const int epl = d / 32, c0 = lane * epl;
#pragma unroll
  for (int e = 0; e < kWrMaxEpl && e < epl; e++)
    store_dt(dt, q, base + c0 + e, x[e]);
}

// What the store of a k or v row needs of the layer's cache.
struct WrCache {
  int kv, d, bs, kv_heads, per_channel;
  const float *k_scale, *v_scale, *k_zero, *v_zero;
};

// Quantizes the row of kv head h (v when isv) to the cache type and stores
// it at offset off of block blk (with its dynamic scale).
__device__ __forceinline__ void wr_row_store_kv(const float (&x)[kWrMaxEpl], const WrCache &W, int h, bool isv,
                                                uint8_t *blk, int off, int lane) {
  const int d = W.d, epl = d / 32, c0 = lane * epl;
  const int rb = kv_row_bytes(W.kv, d);
  uint8_t *row = blk + (size_t)(isv ? W.kv_heads * W.bs : 0) * rb + ((size_t)h * W.bs + off) * rb;
  const float *sc = isv ? W.v_scale : W.k_scale;
  switch (W.kv) {
  case ATTND_KV_BF16:
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < epl; e++)
      reinterpret_cast<__nv_bfloat16 *>(row)[c0 + e] = __float2bfloat16_rn(x[e]);
    break;
  case ATTND_KV_FP16:
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < epl; e++)
      reinterpret_cast<__half *>(row)[c0 + e] = __float2half_rn(x[e]);
    break;
  case ATTND_KV_INT8:
  case ATTND_KV_FP8:
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < epl; e++) {
      const float s = W.per_channel ? sc[h * d + c0 + e] : sc[h];
      const float y = __fdiv_rn(x[e], s);
      if (W.kv == ATTND_KV_INT8)
        row[c0 + e] = (uint8_t)(int8_t)max(-127, min(127, __float2int_rn(y)));
      else
        row[c0 + e] = f_to_fp8(y);
    }
    break;
  case ATTND_KV_INT8_DYNAMIC:
  case ATTND_KV_FP8_DYNAMIC: {
    float m = 0.f;
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < epl; e++)
      m = fmaxf(m, fabsf(x[e]));
    for (int o = 16; o; o >>= 1)
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const bool i8 = W.kv == ATTND_KV_INT8_DYNAMIC;
    const float s = __fdiv_rn(m, i8 ? 127.f : 448.f);
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < epl; e++) {
      uint8_t qv = 0;
      if (s > 0.f) {
        const float y = __fdiv_rn(x[e], s);
        qv = i8 ? (uint8_t)(int8_t)max(-127, min(127, __float2int_rn(y))) : f_to_fp8(y);
      }
      row[c0 + e] = qv;
    }
    if (lane == 0) {
      float *scales = reinterpret_cast<float *>(blk + (size_t)2 * W.kv_heads * W.bs * rb);
      scales[(isv ? W.kv_heads * W.bs : 0) + h * W.bs + off] = s;
    }
    break;
  }
  case ATTND_KV_INT4: {
    const float *zp = isv ? W.v_zero : W.k_zero;
#pragma unroll
    for (int e = 0; e < kWrMaxEpl && e < epl; e += 2) {
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

// theta^(-2i/rd) for RopeParams, computed once per (theta, rd) on the
// calling thread (a decode step should not pay 64 pow() calls).
void rope_params_fill(const attnd_kshape_t *s, RopeParams *R);

} // namespace attnd

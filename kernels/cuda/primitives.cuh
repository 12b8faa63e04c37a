// primitives.cuh: device building blocks shared by the attention kernels
// (tiled_kernel.cuh, decode_kernel.cuh): tensor-core operand loads and mma,
// the exp2 of the softmax, cp.async copies, programmatic-dependent-launch
// controls, cache-type facts, stored-value conversions and the mask test.
#pragma once

#include <math.h>

#include "common.cuh"

namespace attnd {

// ---- tensor cores -----------------------------------------------------------
__device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                        const void *p) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                          const void *p) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}
// c += a b, m16n8k16, operands in the activation dtype, fp32 accumulators.
template <int DT>
__device__ __forceinline__ void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
  if constexpr (DT == ATTND_DT_BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the special-function unit (relative error ~2^-22; results below
// 2^-126 flush to 0, which only drops weights no fp32 sum would notice).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The running max P is taken relative to, rounded up to an integer (exp2
// domain): P = 2^(s - m) then rounds the same way whatever m is (rounding
// commutes with powers of two) and every rescale is exact, so a row's output
// does not depend on how its keys were tiled or split. A row with nothing
// visible yet keeps m = -inf and uses 0 as the reference (every p is then 0).
__device__ __forceinline__ float softmax_ref(float m_old, float tile_max, float &m_new) {
  m_new = ceilf(fmaxf(m_old, tile_max));
  return m_new == -INFINITY ? 0.f : m_new;
}

// Smallest power of two >= x (x >= 0 finite), at least 2^-126.
__device__ __forceinline__ float pow2_ceil(float x) {
  const uint32_t u = __float_as_uint(fmaxf(x, 0x1p-126f));
  return __uint_as_float((u + 0x7fffffu) & 0x7f800000u);
}

// ---- asynchronous copies ----------------------------------------------------
// nbytes 0: nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async16n(void *smem, const void *gmem, int nbytes) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(nbytes));
}
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
  cp_async16n(smem, gmem, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem, bool valid) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- programmatic dependent launch (sm_90) ------------------------------------
// A kernel launched with the programmatic-serialization attribute may start
// while the previous kernel on its stream still runs; pdl_wait() returns once
// that kernel has finished and its writes are visible (a no-op without the
// attribute). pdl_trigger() lets the next such kernel start launching.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// ---- cache types ---------------------------------------------------------------
template <int KV> struct KvT {
  static constexpr bool k16 = KV == ATTND_KV_BF16 || KV == ATTND_KV_FP16;
  static constexpr bool kI4 = KV == ATTND_KV_INT4;
  static constexpr bool kInt8 = KV == ATTND_KV_INT8 || KV == ATTND_KV_INT8_DYNAMIC;
  static constexpr bool kFp8 = KV == ATTND_KV_FP8 || KV == ATTND_KV_FP8_DYNAMIC;
  static constexpr bool kDyn = KV == ATTND_KV_INT8_DYNAMIC || KV == ATTND_KV_FP8_DYNAMIC;
  static constexpr bool kStatic = KV == ATTND_KV_INT8 || KV == ATTND_KV_FP8 || KV == ATTND_KV_INT4;
  static constexpr int kElemPerChunk = k16 ? 8 : kI4 ? 32 : 16; // elements per 16 bytes
};

// Element e of a 16-byte chunk as a float, before scaling (int4: the nibble u).
template <int KV> __device__ __forceinline__ float chunk_elem(const uint4 &c, int e) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  if constexpr (KV == ATTND_KV_BF16) {
    const uint32_t v = w[e >> 1] >> ((e & 1) * 16);
    return __uint_as_float((v & 0xffffu) << 16);
  } else if constexpr (KV == ATTND_KV_FP16) {
    const uint32_t v = (w[e >> 1] >> ((e & 1) * 16)) & 0xffffu;
    return __half2float(__ushort_as_half((unsigned short)v));
  } else if constexpr (KvT<KV>::kInt8) {
    // Exact and off the (quarter-rate) conversion unit: the biased byte
    // u = x + 128 becomes the low mantissa byte of 2^23, then 2^23 + 128 is
    // subtracted.
    const uint32_t u = w[e >> 2] ^ 0x80808080u;
    return __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650u | (unsigned)(e & 3))) - 8388736.f;
  } else if constexpr (KvT<KV>::kFp8) {
    return fp8_to_f((uint8_t)((w[e >> 2] >> ((e & 3) * 8)) & 0xffu));
  } else { // int4: channel 2c low nibble, 2c+1 high nibble
    return __uint_as_float(0x4B000000u | ((w[e >> 3] >> ((e & 7) * 4)) & 0xfu)) - 8388608.f;
  }
}

// Two stored 8-bit values as one packed operand register (lo in the low half):
// byte bx of word x and byte by of word y. Exact: int8 and e4m3 values are
// representable in bf16 and fp16.
template <int KV, int DT>
__device__ __forceinline__ uint32_t pair8(uint32_t x, uint32_t y, int bx, int by) {
  if constexpr (KvT<KV>::kInt8) {
    if constexpr (DT == ATTND_DT_FP16) {
      // fp16 holds 1024 + u exactly: u in the low mantissa byte of 1024
      // (0x6400), then 1024 + 128 subtracted.
      const uint32_t h =
          (__byte_perm(x ^ 0x80808080u, y ^ 0x80808080u, (unsigned)bx | ((unsigned)(by + 4) << 8)) &
           0x00ff00ffu) |
          0x64006400u;
      const __half2 r =
          __hsub2(*reinterpret_cast<const __half2 *>(&h), __half2(__half(1152.f), __half(1152.f)));
      return *reinterpret_cast<const uint32_t *>(&r);
    } else {
      const uint32_t ux = x ^ 0x80808080u, uy = y ^ 0x80808080u;
      const float fx = __uint_as_float(__byte_perm(ux, 0x4B000000u, 0x7650u | (unsigned)bx)) - 8388736.f;
      const float fy = __uint_as_float(__byte_perm(uy, 0x4B000000u, 0x7650u | (unsigned)by)) - 8388736.f;
      return Act<DT>::pack2(fx, fy);
    }
  } else {
    // e4m3 pairs convert two at a time to fp16 (exact).
    const uint32_t pr = __byte_perm(x, y, (unsigned)bx | ((unsigned)(by + 4) << 4));
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(pr & 0xffffu), __NV_E4M3);
    if constexpr (DT == ATTND_DT_FP16) {
      return (uint32_t)h2.x | ((uint32_t)h2.y << 16);
    } else {
      const float2 f = __half22float2(__half2(h2));
      return Act<DT>::pack2(f.x, f.y);
    }
  }
}

// A word of two stored 16-bit values as an operand register of dtype DT.
// Same type: the bits themselves. Otherwise a conversion: fp16 -> bf16 is
// exact for values a bf16 activation could have written (the cache then
// holds bf16 values inside fp16's range); bf16 -> fp16 rounds, as the
// fp16 activation dtype must.
template <int KV, int DT> __device__ __forceinline__ uint32_t word16(uint32_t w) {
  if constexpr ((KV == ATTND_KV_BF16) == (DT == ATTND_DT_BF16)) {
    return w;
  } else if constexpr (KV == ATTND_KV_FP16) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w));
    return Act<DT>::pack2(f.x, f.y);
  } else {
    const float lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xffff0000u);
    return Act<DT>::pack2(lo, hi);
  }
}

// int4 (values u in 0..15): nibbles i and i + 4 of x as one packed operand
// register (exact): u goes into the low mantissa bits of 128 (bf16) or 1024
// (fp16), which is then subtracted.
template <int DT> __device__ __forceinline__ uint32_t pair4(uint32_t x, int i) {
  if constexpr (DT == ATTND_DT_FP16) {
    const uint32_t h = ((x >> (4 * i)) & 0x000f000fu) | 0x64006400u;
    const __half2 r =
        __hsub2(*reinterpret_cast<const __half2 *>(&h), __half2(__half(1024.f), __half(1024.f)));
    return *reinterpret_cast<const uint32_t *>(&r);
  } else {
    const uint32_t h = ((x >> (4 * i)) & 0x000f000fu) | 0x43004300u;
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162 *>(&h),
                                     __nv_bfloat162(__float2bfloat16(128.f), __float2bfloat16(128.f)));
    return *reinterpret_cast<const uint32_t *>(&r);
  }
}

// The value a packed operand half holds, as a float (lo: the low half).
template <int DT> __device__ __forceinline__ float op_half(uint32_t r, bool hi) {
  const uint32_t h = hi ? r >> 16 : r & 0xffffu;
  if constexpr (DT == ATTND_DT_BF16)
    return __uint_as_float(h << 16);
  else
    return __half2float(__ushort_as_half((unsigned short)h));
}

// ---- masks ----------------------------------------------------------------------
// Key j visible to the query at absolute position p (attnd_kernels.h masks),
// intersected with the layer's window win (> 0: j > p - win; 0: full layer).
__device__ __forceinline__ bool visible(int kind, int param, int causal, const int32_t *iv, int kv_len,
                                        int p, int j, int win) {
  if (j >= kv_len || (win > 0 && j <= p - win))
    return false;
  switch (kind) {
  case ATTND_MASK_CAUSAL:
    return j <= p;
  case ATTND_MASK_FULL:
    return true;
  case ATTND_MASK_SLIDING:
    return j <= p && j >= p - param + 1;
  case ATTND_MASK_PREFIX_LM:
    return j < param || j <= p;
  default: {
    if (causal && j > p)
      return false;
    const int a = iv[j], bb = iv[kv_len + j], c = iv[2 * kv_len + j], dd = iv[3 * kv_len + j];
    return !((a <= p && p < bb) || (c <= p && p < dd));
  }
  }
}

// Keys [lo, hi] that any query row in positions [pmin, pmax] of item it may
// see, in a layer of window win (0: full): keys before the window of the
// first row are never read.
__device__ __forceinline__ void key_range(const attnd_kitem_t &it, int pmin, int pmax, int win, int &lo,
                                          int &hi) {
  const int kind = it.mask_kind, mp = it.mask_param;
  lo = 0;
  hi = it.start + it.n - 1;
  if (kind == ATTND_MASK_CAUSAL || (kind == ATTND_MASK_INTERVALS && it.causal)) {
    hi = min(hi, pmax);
  } else if (kind == ATTND_MASK_SLIDING) {
    hi = min(hi, pmax);
    lo = max(0, pmin - mp + 1);
  } else if (kind == ATTND_MASK_PREFIX_LM) {
    hi = min(hi, max(pmax, mp - 1));
  }
  if (win > 0)
    lo = max(lo, pmin - win + 1);
}

// Whether keys [j0, j0 + n) may hold a key masked for some row of [pmin, pmax]
// inside the visible range [lo, hi] (then the tile is masked per element).
__device__ __forceinline__ bool tile_needs_mask(const attnd_kitem_t &it, int pmin, int pmax, int lo, int hi,
                                                int j0, int n, int win) {
  const int kind = it.mask_kind, mp = it.mask_param, j1 = j0 + n - 1;
  bool m = j0 < lo || j1 > hi || j1 >= it.start + it.n || (win > 0 && j0 <= pmax - win);
  if (kind == ATTND_MASK_CAUSAL || kind == ATTND_MASK_SLIDING)
    m = m || j1 > pmin;
  if (kind == ATTND_MASK_SLIDING)
    m = m || j0 < pmax - mp + 1;
  if (kind == ATTND_MASK_PREFIX_LM)
    m = m || (j1 > pmin && j1 >= mp);
  if (kind == ATTND_MASK_INTERVALS)
    m = true;
  return m;
}

// FlashMask intervals: classifies key tiles [0, min(ntiles, nflags)) of BN
// keys from jfirst for the query rows at positions [pmin, pmax] (keys [lo, hi]
// in range; the window win cuts lo, and its per-row edge masks per element).
// flags[t] bit 0: every key of the tile is masked for every row
// (the tile is skipped); bit 1: some key may be masked for some row (the
// tile is masked per element). One warp per tile (nw warps from warp 0),
// BN / 32 keys per lane. Shared by the tiled kernel and the Hopper path, so
// that both skip the same keys.
template <int BN>
__device__ void classify_tiles(const attnd_kitem_t &it, const int32_t *iv, int kv_len, int lo, int hi,
                               int jfirst, int ntiles, int nflags, int pmin, int pmax, int win, int nw,
                               uint8_t *flags) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int t = warp; t < min(ntiles, nflags); t += nw) {
    bool masked_all = true, vis_all = true;
    for (int h2 = 0; h2 < BN / 32; h2++) {
      const int j = jfirst + t * BN + h2 * 32 + lane;
      if (j < kv_len && j >= lo && j <= hi) {
        const int a = iv[j], bb = iv[kv_len + j], c = iv[2 * kv_len + j], dd = iv[3 * kv_len + j];
        const bool cov1 = a <= pmin && pmax < bb, cov2 = c <= pmin && pmax < dd;
        const bool cov12 = a <= pmin && c <= bb && pmax < dd; // the union covers
        masked_all &= (it.causal && j > pmax) || cov1 || cov2 || cov12;
        const bool hit1 = a < bb && a <= pmax && pmin < bb, hit2 = c < dd && c <= pmax && pmin < dd;
        vis_all &= !(it.causal && j > pmin) && !hit1 && !hit2 && !(win > 0 && j <= pmax - win);
      } else {
        vis_all = false;
      }
    }
    masked_all = __all_sync(0xffffffffu, masked_all);
    vis_all = __all_sync(0xffffffffu, vis_all);
    if (lane == 0)
      flags[t] = (masked_all ? 1 : 0) | (vis_all ? 0 : 2);
  }
}

// ---- logit soft-capping and sinks (docs/numerics.md) ---------------------------
// The scores are kept in the exp2 domain (v = s log2 e); capping there is
// c2 tanh(v / c2) with c2 = c log2 e, the same function of s. Written with
// explicit roundings so that every kernel computes the same bits (a prefix
// hit must equal a full recompute). zc: int4's K zero-point term of the row
// (its scores leave it out otherwise), 0 for the other types.
__device__ __forceinline__ float softcap2(float v, float cap2, float icap2, float zc) {
  return __fmul_rn(cap2, tanhf(__fmul_rn(__fsub_rn(v, zc), icap2)));
}

// Joins a sink logit (natural log) to a finished state (an output normalized
// by its own sum, that sum's log lset, and the lse): the sink is one more
// term exp(sink) of both sums, with no value. Returns the factor of the
// output; lse and lset become logaddexp(., sink). A state with no visible
// key becomes out 0, lse = lset = sink. Applied once per row: in the kernel
// when a row is not split, else to the part of the first key piece only, so
// that a merge by lset counts it once.
__device__ __forceinline__ float sink_join(float sink, float &lse, float &lset) {
  const float w = lset == -INFINITY ? 0.f : 1.f / (1.f + expf(sink - lset));
  auto lae = [](float a, float b) -> float {
    if (a == -INFINITY)
      return b;
    if (b == -INFINITY)
      return a;
    return fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
  };
  lse = lae(lse, sink);
  lset = lae(lset, sink);
  return w;
}

// ---- static scales in the scores --------------------------------------------------
// q.(k s) for a static K scale s: per kv head, s multiplies the fp32 score
// scale (exact). Per channel it must go into q: q s / 2^e (2^e >= max_d s_d,
// so the product neither overflows the operand dtype nor exceeds |q|) is
// kept as two operands, hi = round(x) and lo = round(x - hi), whose sum is x
// to ~2^-17 relative: a single rounded operand put a 2^-9 relative error on
// every score term (docs/numerics.md). The score scale takes 2^e.
__device__ __forceinline__ int scale_exp(float smax) {
  int e;
  (void)frexpf(smax, &e); // smax = f 2^e, f in [0.5, 1): s_d / 2^e < 1
  return e;
}

} // namespace attnd

// flash_impl.cuh: the body of the tiled attention kernel (see flash.cuh).
// Included only by the flash_inst_*.cu explicit instantiation files.
#pragma once

#include <math.h>

#include "flash.cuh"

namespace attnd {

__device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                        const void *p) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                          const void *p) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}
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

// Storage facts of a cache type.
template <int KV> struct KvT {
  static constexpr int kElemPerChunk = (KV == ATTND_KV_BF16 || KV == ATTND_KV_FP16) ? 8
                                       : KV == ATTND_KV_INT4                       ? 32
                                                                                   : 16;
  static constexpr bool kDyn = KV == ATTND_KV_INT8_DYNAMIC || KV == ATTND_KV_FP8_DYNAMIC;
  static constexpr bool kStatic = KV == ATTND_KV_INT8 || KV == ATTND_KV_FP8 || KV == ATTND_KV_INT4;
};

// Element e of a 16-byte chunk as a float, before scaling (int4: u - z is done by the caller).
template <int KV> __device__ __forceinline__ float chunk_elem(const uint4 &c, int e) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  if constexpr (KV == ATTND_KV_BF16) {
    uint32_t v = w[e >> 1] >> ((e & 1) * 16);
    return __uint_as_float((v & 0xffffu) << 16);
  } else if constexpr (KV == ATTND_KV_FP16) {
    uint32_t v = (w[e >> 1] >> ((e & 1) * 16)) & 0xffffu;
    return __half2float(__ushort_as_half((unsigned short)v));
  } else if constexpr (KV == ATTND_KV_INT8 || KV == ATTND_KV_INT8_DYNAMIC) {
    // Exact and off the (quarter-rate) conversion unit: the biased byte
    // u = x + 128 becomes the low mantissa byte of 2^23, then 2^23 + 128 is
    // subtracted.
    const uint32_t u = w[e >> 2] ^ 0x80808080u;
    return __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650u | (unsigned)(e & 3))) - 8388736.f;
  } else if constexpr (KV == ATTND_KV_FP8 || KV == ATTND_KV_FP8_DYNAMIC) {
    return fp8_to_f((uint8_t)((w[e >> 2] >> ((e & 3) * 8)) & 0xffu));
  } else { // int4: channel 2c low nibble, 2c+1 high nibble
    return __uint_as_float(0x4B000000u | ((w[e >> 3] >> ((e & 7) * 4)) & 0xfu)) - 8388608.f;
  }
}

__device__ __forceinline__ bool visible(int kind, int param, int causal, const int32_t *iv, int kv_len,
                                        int p, int j) {
  if (j >= kv_len)
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

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  const int n = valid ? 16 : 0; // 0: nothing is read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
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

constexpr int kMaxTileFlags = 1024; // key tiles with precomputed interval flags (64K keys at 64)

// Shared-memory layout of one instantiation (bytes).
template <int D, int DT, int KV, int NW, int QROWS> struct FlashSmem {
  static constexpr int BN = D == 256 ? 32 : 64; // keys per tile (shared memory bound at D=256)
  static constexpr bool kDirect = (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) ||
                                  (KV == ATTND_KV_FP16 && DT == ATTND_DT_FP16);
  static constexpr int LD = D + 8; // padded operand row (elements): conflict-free ldmatrix
  static constexpr int RB = (KV == ATTND_KV_BF16 || KV == ATTND_KV_FP16) ? 2 * D : KV == ATTND_KV_INT4 ? D / 2 : D;
  // Staged raw row stride (bytes): direct tiles are the mma operands (padded);
  // raw rows are read as whole contiguous rows, so they need no padding.
  static constexpr int RAWLD = kDirect ? 2 * LD : RB;
  static constexpr size_t kQ = 0;
  static constexpr size_t kRaw = kQ + (size_t)QROWS * LD * 2;         // [2 stages][K,V][BN][RAWLD]
  static constexpr size_t kOp = kRaw + (size_t)2 * 2 * BN * RAWLD;  // [K,V][BN][LD] when !kDirect
  static constexpr size_t kDs = kOp + (kDirect ? 0 : (size_t)2 * BN * LD * 2); // [2][K,V][BN] fp32
  static constexpr size_t kScale = kDs + (size_t)2 * 2 * BN * 4;    // [4][D] fp32
  static constexpr size_t kFlags = kScale + (KvT<KV>::kStatic ? (size_t)4 * D * 4 : 0); // [kMaxTileFlags] u8
  static constexpr size_t kC = kFlags + kMaxTileFlags;              // int4: [QROWS] fp32 q'.z_k
  static constexpr size_t kBytes = kC + (KV == ATTND_KV_INT4 ? (size_t)QROWS * 4 : 0);
};

// SPLITW (decode): every query vector of the CTA fits in one warp's 16 rows,
// so instead of one warp computing while three wait, the four warps take a
// quarter of each key tile each, with their own softmax state, merged at the end.
template <int D, int DT, int KV, bool SPLITW>
__global__ void __launch_bounds__((SPLITW ? 4 : 8) * 32) flash_kernel(const __grid_constant__ FlashParams P) {
  using A = Act<DT>;
  using T = typename A::T;
  // Decode (SPLITW): 4 warps share the keys of one 16-row query tile.
  // Prefill: 8 warps of 16 query rows each share every K/V tile loaded.
  constexpr int NW = SPLITW ? 4 : 8, NTH = NW * 32, BMk = SPLITW ? 16 : 16 * NW;
  using L = FlashSmem<D, DT, KV, NW, BMk>;
  constexpr int LD = L::LD, RB = L::RB, RAWLD = L::RAWLD, BN = L::BN;
  constexpr int CPR = RB / 16;                 // 16-byte chunks per row
  constexpr int EPC = KvT<KV>::kElemPerChunk;  // elements per chunk
  constexpr int NT = D / 8;                    // O n-tiles per warp
  constexpr int KW = SPLITW ? BN / kWarpsF : BN; // keys of a tile per warp
  static_assert(KW % 16 == 0 && (!SPLITW || NW == kWarpsF), "a warp's key slice must be whole mma k-steps");
  static_assert(BN * CPR >= 32, "a tile has at least one chunk per lane");

  extern __shared__ __align__(16) uint8_t smem[];
  T *sQ = reinterpret_cast<T *>(smem + L::kQ);
  uint8_t *sRaw = smem + L::kRaw;
  T *sOp = reinterpret_cast<T *>(smem + L::kOp);
  float *sDs = reinterpret_cast<float *>(smem + L::kDs);
  float *sScale = reinterpret_cast<float *>(smem + L::kScale); // ks, vs, kz, vz
  uint8_t *sFlags = smem + L::kFlags;                          // bit0: skip, bit1: needs mask

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int item = blockIdx.x / P.kv_heads, kvh = blockIdx.x % P.kv_heads;
  const attnd_kitem_t it = P.items[item];
  if (it.q_row < 0)
    return;
  const int G = P.group;
  const int nvec = it.n * G;
  const int v0 = (gridDim.y - 1 - blockIdx.y) * BMk; // heaviest (last) tiles first
  if (v0 >= nvec)
    return;
  const int split = blockIdx.z;
  const int kv_len = it.start + it.n;
  const int vend = min(v0 + BMk, nvec);
  const int pmin = it.start + v0 / G, pmax = it.start + (vend - 1) / G;
  const int kind = it.mask_kind, mp = it.mask_param;
  const int32_t *iv = kind == ATTND_MASK_INTERVALS ? P.meta + it.intervals : nullptr;
  const int32_t *bt = P.meta + it.block_table;

  // Keys any row of this tile may see.
  int lo = 0, hi = kv_len - 1;
  if (kind == ATTND_MASK_CAUSAL || (kind == ATTND_MASK_INTERVALS && it.causal))
    hi = min(hi, pmax);
  else if (kind == ATTND_MASK_SLIDING) {
    hi = min(hi, pmax);
    lo = max(0, pmin - mp + 1);
  } else if (kind == ATTND_MASK_PREFIX_LM)
    hi = min(hi, max(pmax, mp - 1));
  if (P.nsplit > 1) {
    lo = max(lo, split * P.split_keys);
    hi = min(hi, (split + 1) * P.split_keys - 1);
  }
  const int jfirst = (lo / BN) * BN;
  const bool dbg_no_load = P.debug & 1, dbg_no_compute = P.debug & 2; // timing experiments only

  // Q tile -> smem (rows past nvec zero) and the static scales of this kv head.
  for (int c = tid; c < BMk * (D / 8); c += NTH) {
    const int v = c / (D / 8), col = (c % (D / 8)) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (v0 + v < nvec) {
      const int vv = v0 + v, r = vv / G, h = kvh * G + vv % G;
      val = *reinterpret_cast<const uint4 *>(reinterpret_cast<const T *>(P.q) +
                                             ((size_t)(it.q_row + r) * P.q_heads + h) * D + col);
      if constexpr (KvT<KV>::kStatic) {
        // Static types: q.(k s) = (q s).k, so the K scale goes into q once
        // per CTA (rounded to the operand dtype) and K stays as stored.
        uint32_t *w = &val.x;
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
          const T *pr = reinterpret_cast<const T *>(&w[e / 2]);
          const bool pc = KV == ATTND_KV_INT4 || P.per_channel;
          const float s0 = pc ? P.k_scale[kvh * D + col + e] : P.k_scale[kvh];
          const float s1 = pc ? P.k_scale[kvh * D + col + e + 1] : P.k_scale[kvh];
          w[e / 2] = A::pack2(A::to_f(pr[0]) * s0, A::to_f(pr[1]) * s1);
        }
      }
    }
    *reinterpret_cast<uint4 *>(sQ + v * LD + col) = val;
  }
  if constexpr (KvT<KV>::kStatic) {
    for (int i = tid; i < D; i += NTH) {
      const bool pc = KV == ATTND_KV_INT4 || P.per_channel;
      sScale[i] = pc ? P.k_scale[kvh * D + i] : P.k_scale[kvh];
      sScale[D + i] = pc ? P.v_scale[kvh * D + i] : P.v_scale[kvh];
      if constexpr (KV == ATTND_KV_INT4) {
        sScale[2 * D + i] = P.k_zero[kvh * D + i];
        sScale[3 * D + i] = P.v_zero[kvh * D + i];
      }
    }
  }
  // FlashMask intervals: classify every key tile once. A tile is skipped when
  // each of its keys is masked for every row of this query tile (causal, or an
  // interval covering [pmin, pmax]); it needs no per-element mask when no key
  // is masked for any row. One warp per tile, two keys per lane.
  const int ntiles = hi >= jfirst ? (hi - jfirst) / BN + 1 : 0;
  if (kind == ATTND_MASK_INTERVALS) {
    for (int t = warp; t < min(ntiles, kMaxTileFlags); t += NW) {
      bool masked_all = true, vis_all = true;
      for (int h2 = 0; h2 < BN / 32; h2++) {
        const int j = jfirst + t * BN + h2 * 32 + lane;
        if (j < kv_len && j >= lo && j <= hi) {
          const int a = iv[j], bb = iv[kv_len + j], c = iv[2 * kv_len + j], dd = iv[3 * kv_len + j];
          const bool cov1 = a <= pmin && pmax < bb, cov2 = c <= pmin && pmax < dd;
          const bool cov12 = a <= pmin && c <= bb && pmax < dd; // the union covers
          masked_all &= (it.causal && j > pmax) || cov1 || cov2 || cov12;
          const bool hit1 = a < bb && a <= pmax && pmin < bb, hit2 = c < dd && c <= pmax && pmin < dd;
          vis_all &= !(it.causal && j > pmin) && !hit1 && !hit2;
        } else {
          vis_all = false;
        }
      }
      masked_all = __all_sync(0xffffffffu, masked_all);
      vis_all = __all_sync(0xffffffffu, vis_all);
      if (lane == 0)
        sFlags[t] = (masked_all ? 1 : 0) | (vis_all ? 0 : 2);
    }
  }
  __syncthreads();
  // int4: (q s).(u - z) = (q s).u - (q s).z, and the second term is the same
  // for every key of a row: softmax ignores it, so K is read as the stored
  // nibbles and only the lse is corrected by it at the end.
  float *sC = reinterpret_cast<float *>(smem + L::kC);
  if constexpr (KV == ATTND_KV_INT4) {
    if (tid < BMk) {
      float c = 0.f;
      for (int d = 0; d < D; d++)
        c += A::to_f(sQ[tid * LD + d]) * sScale[2 * D + d];
      sC[tid] = c;
    }
    __syncthreads();
  }

  auto tile_skip = [&](int t) -> bool {
    return kind == ATTND_MASK_INTERVALS && t < kMaxTileFlags && (sFlags[t] & 1);
  };
  auto next_tile = [&](int t) -> int { // first live tile index >= t, or ntiles
    while (t < ntiles && tile_skip(t))
      t++;
    return t;
  };
  const size_t v_region = (size_t)P.kv_heads * P.bs * RB;
  const size_t scale_region = 2 * v_region;
  const int bs_shift = __ffs(P.bs) - 1, bs_mask = P.bs - 1, kvh_bs = kvh * P.bs;
  // Who copies and dequantizes which keys: in SPLITW each warp its own slice
  // of every tile, so warps never wait for each other inside the key loop;
  // otherwise the whole CTA shares each tile.
  constexpr int IT = SPLITW ? 32 : NTH;  // threads sharing one key range
  constexpr int KEYS = SPLITW ? KW : BN; // keys in that range
  constexpr int CHI = (KEYS * CPR + IT - 1) / IT;
  constexpr bool kGuardI = (KEYS * CPR) % IT != 0;
  const int itid = SPLITW ? lane : tid;
  const int kbase = SPLITW ? warp * KW : 0;
  auto barrier = [&]() {
    if constexpr (SPLITW)
      __syncwarp();
    else
      __syncthreads();
  };
  // Issues the paged cp.async copies of key tile t into stage st (zero-filled
  // past kv_len or hi, so masked keys hold finite values).
  auto issue = [&](int t, int st) {
    const int j0 = jfirst + t * BN;
    if (dbg_no_load) {
      cp_async_commit();
      return;
    }
    // Row addresses first: one block-table read per key a thread copies, all
    // issued before any copy (no dependent load chain), K and V sharing them.
    // Block sizes are powers of two: shifts, not divisions.
    const uint8_t *rowp[CHI];
    bool okv[CHI];
#pragma unroll
    for (int i = 0; i < CHI; i++) {
      const int c = itid + i * IT, key = kbase + c / CPR, cc = c % CPR, j = j0 + key;
      okv[i] = j < kv_len && j <= hi && (!kGuardI || c < KEYS * CPR);
      const int jj = okv[i] ? j : 0; // bt[0] always exists
      rowp[i] = P.cache + (size_t)bt[jj >> bs_shift] * P.block_bytes + (size_t)(kvh_bs + (jj & bs_mask)) * RB + cc * 16;
    }
#pragma unroll
    for (int which = 0; which < 2; which++) {
      uint8_t *dst = sRaw + (size_t)(st * 2 + which) * BN * RAWLD;
#pragma unroll
      for (int i = 0; i < CHI; i++) {
        const int c = itid + i * IT, key = kbase + c / CPR, cc = c % CPR;
        if (kGuardI && c >= KEYS * CPR)
          continue;
        cp_async16(dst + key * RAWLD + cc * 16, okv[i] ? rowp[i] + which * v_region : P.cache, okv[i]);
      }
    }
    if constexpr (KvT<KV>::kDyn) {
      if (itid < 2 * KEYS) {
        const int which = itid / KEYS, key = kbase + itid % KEYS, j = j0 + key;
        const bool ok = j < kv_len && j <= hi;
        const int jj = ok ? j : 0;
        const uint8_t *src = P.cache + (size_t)bt[jj >> bs_shift] * P.block_bytes + scale_region +
                             ((size_t)which * P.kv_heads * P.bs + kvh_bs + (jj & bs_mask)) * 4;
        cp_async4(sDs + (st * 2 + which) * BN + key, ok ? src : P.cache, ok);
      }
    }
    cp_async_commit();
  };

  // Per-thread softmax state for rows lane/4 and lane/4 + 8 of this warp's 16.
  float o[NT][4];
#pragma unroll
  for (int i = 0; i < NT; i++)
    o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
  const int qr0 = SPLITW ? 0 : warp * 16; // this warp's first row in sQ
  const int kb = SPLITW ? warp * KW : 0;  // this warp's first key in each tile
  const int wv0 = v0 + qr0;               // first vector of this warp
  const bool warp_live = wv0 < vend;
  int prow[2];
  bool rvalid[2];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int vv = wv0 + (lane >> 2) + i * 8;
    rvalid[i] = vv < vend;
    prow[i] = it.start + min(vv, vend - 1) / G;
  }
  const float sl2 = P.scale_log2;

  int t = next_tile(0), stage = 0;
  if (t < ntiles)
    issue(t, 0);
  while (t < ntiles) {
    const int tn = next_tile(t + 1);
    if (tn < ntiles) {
      issue(tn, stage ^ 1); // prefetch the next live tile while this one computes
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    barrier();
    const int j0 = jfirst + t * BN;
    bool need_mask;
    if (kind == ATTND_MASK_INTERVALS) {
      need_mask = t >= kMaxTileFlags || (sFlags[t] & 2);
    } else {
      need_mask = j0 < lo || j0 + BN - 1 > hi || j0 + BN > kv_len;
      if (kind == ATTND_MASK_CAUSAL || kind == ATTND_MASK_SLIDING)
        need_mask = need_mask || j0 + BN - 1 > pmin;
      if (kind == ATTND_MASK_SLIDING)
        need_mask = need_mask || j0 < pmax - mp + 1;
      if (kind == ATTND_MASK_PREFIX_LM)
        need_mask = need_mask || (j0 + BN - 1 > pmin && j0 + BN - 1 >= mp);
    }
    const T *sK, *sV;
    if constexpr (L::kDirect) {
      sK = reinterpret_cast<const T *>(sRaw + (size_t)(stage * 2) * BN * RAWLD);
      sV = reinterpret_cast<const T *>(sRaw + (size_t)(stage * 2 + 1) * BN * RAWLD);
    } else {
      // Dequantize the staged raw tile into the operand tiles (registers in
      // between; the cache itself is never copied dequantized).
#pragma unroll
      for (int which = 0; which < 2; which++) {
        const uint8_t *raw = sRaw + (size_t)(stage * 2 + which) * BN * RAWLD;
        T *dst = sOp + which * BN * LD;
#pragma unroll
        for (int i = 0; i < CHI; i++) {
          const int c = itid + i * IT, key = kbase + c / CPR, col = (c % CPR) * EPC;
          if (kGuardI && c >= KEYS * CPR)
            continue;
          const uint4 rv = *reinterpret_cast<const uint4 *>(raw + key * RAWLD + (c % CPR) * 16);
          uint32_t packed[EPC / 2];
#pragma unroll
          for (int e = 0; e < EPC; e += 2) {
            float x0, x1;
            if constexpr (KV == ATTND_KV_FP8 || KV == ATTND_KV_FP8_DYNAMIC) {
              // Two e4m3 values per conversion; e4m3 is exact in fp16.
              const uint32_t wd = (&rv.x)[e >> 2];
              const __half2_raw h2 =
                  __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)((wd >> ((e & 3) * 8)) & 0xffffu), __NV_E4M3);
              if constexpr (KV == ATTND_KV_FP8_DYNAMIC && DT == ATTND_DT_FP16) {
                packed[e / 2] = (uint32_t)h2.x | ((uint32_t)h2.y << 16);
                continue;
              }
              const float2 f2 = __half22float2(__half2(h2));
              x0 = f2.x;
              x1 = f2.y;
            } else {
              x0 = chunk_elem<KV>(rv, e);
              x1 = chunk_elem<KV>(rv, e + 1);
            }
            if constexpr (KvT<KV>::kDyn) {
              // Stored values are exact in the operand dtype; the per-token
              // scales are applied to the scores (K) and to P (V) instead.
            }
            // Static types: no scale or zero point here (K's are in q and the
            // lse, V's are applied to O).
            packed[e / 2] = A::pack2(x0, x1);
          }
#pragma unroll
          for (int q4 = 0; q4 < EPC / 8; q4++)
            reinterpret_cast<uint4 *>(dst + key * LD + col)[q4] =
                make_uint4(packed[q4 * 4], packed[q4 * 4 + 1], packed[q4 * 4 + 2], packed[q4 * 4 + 3]);
        }
      }
      barrier();
      sK = sOp;
      sV = sOp + BN * LD;
    }

    if (warp_live && !dbg_no_compute) {
      // S = Q K^T for this warp's 16 vectors x BN keys.
      float s[KW / 8][4];
#pragma unroll
      for (int i = 0; i < KW / 8; i++)
        s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int kd = 0; kd < D; kd += 16) {
        uint32_t a[4];
        ldsm_x4(a[0], a[1], a[2], a[3], sQ + (qr0 + (lane & 15)) * LD + kd + (lane >> 4) * 8);
#pragma unroll
        for (int n0 = 0; n0 < KW; n0 += 16) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(b0, b1, b2, b3, sK + (kb + n0 + (lane & 7) + (lane >> 4) * 8) * LD + kd + ((lane >> 3) & 1) * 8);
          mma16816<DT>(s[n0 / 8], a, b0, b1);
          mma16816<DT>(s[n0 / 8 + 1], a, b2, b3);
        }
      }
      // Scale into the exp2 domain, mask, online softmax.
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < KW / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float x = s[nt][e] * sl2;
          if constexpr (KvT<KV>::kDyn)
            x *= sDs[(stage * 2) * BN + kb + nt * 8 + (lane & 3) * 2 + (e & 1)];
          if (need_mask) {
            const int jj = nt * 8 + (lane & 3) * 2 + (e & 1), j = j0 + kb + jj, ri = e >> 1;
            bool vis;
            if (kind == ATTND_MASK_INTERVALS) {
              vis = j >= lo && j <= hi && visible(kind, mp, it.causal, iv, kv_len, prow[ri], j);
            } else {
              vis = j >= lo && j <= hi && visible(kind, mp, 0, nullptr, kv_len, prow[ri], j);
            }
            if (!vis)
              x = -INFINITY;
          }
          s[nt][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
      float alpha[2];
#pragma unroll
      for (int ri = 0; ri < 2; ri++) {
        mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
        mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
        const float mnew = ceilf(fmaxf(m_r[ri], mx[ri])); // an integer: see flash.cuh
        // A row with nothing visible so far keeps m = -inf; exp2(-inf - -inf)
        // would be NaN, so use 0 as the reference and every p is exp2(-inf) = 0.
        const float mref = mnew == -INFINITY ? 0.f : mnew;
        alpha[ri] = ex2(m_r[ri] - mref);
        m_r[ri] = mnew;
        mx[ri] = mref;
      }
      float rs[2] = {0.f, 0.f};
      uint32_t pa[KW / 16][4];
#pragma unroll
      for (int nt = 0; nt < KW / 8; nt++) {
        const float p0 = ex2(s[nt][0] - mx[0]), p1 = ex2(s[nt][1] - mx[0]);
        const float p2 = ex2(s[nt][2] - mx[1]), p3 = ex2(s[nt][3] - mx[1]);
        rs[0] += p0 + p1;
        rs[1] += p2 + p3;
        if constexpr (KvT<KV>::kDyn) {
          const float *vs = sDs + (stage * 2 + 1) * BN + kb + nt * 8 + (lane & 3) * 2;
          pa[nt / 2][(nt & 1) * 2 + 0] = A::pack2(p0 * vs[0], p1 * vs[1]);
          pa[nt / 2][(nt & 1) * 2 + 1] = A::pack2(p2 * vs[0], p3 * vs[1]);
        } else {
          pa[nt / 2][(nt & 1) * 2 + 0] = A::pack2(p0, p1);
          pa[nt / 2][(nt & 1) * 2 + 1] = A::pack2(p2, p3);
        }
      }
#pragma unroll
      for (int ri = 0; ri < 2; ri++)
        l_r[ri] = l_r[ri] * alpha[ri] + rs[ri];
#pragma unroll
      for (int i = 0; i < NT; i++) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[0];
        o[i][2] *= alpha[1];
        o[i][3] *= alpha[1];
      }
      // O += P V
#pragma unroll
      for (int kk = 0; kk < KW / 16; kk++) {
#pragma unroll
        for (int n0 = 0; n0 < D; n0 += 16) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(b0, b1, b2, b3, sV + (kb + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n0 + (lane >> 4) * 8);
          mma16816<DT>(o[n0 / 8], pa[kk], b0, b1);
          mma16816<DT>(o[n0 / 8 + 1], pa[kk], b2, b3);
        }
      }
    }
    barrier(); // the stage and operand tiles are rewritten next
    t = tn;
    stage ^= 1;
  }

  if (!warp_live)
    return;
  // Finish: full row sums across the quad, normalize, write.
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 1);
    l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 2);
  }
  if constexpr (SPLITW) {
    // Merge the four warps' states for the same 16 rows (shared memory is
    // free now): weights 2^(m_w - M), then warp 0 sums and writes.
    float *sm = reinterpret_cast<float *>(smem);   // [warps][16] m, then [warps][16] l
    float *so = sm + 2 * kWarpsF * 16;             // [warps][16][D] o
    static_assert((2 * kWarpsF * 16 + kWarpsF * 16 * D) * 4 <= L::kScale, "merge fits in shared memory");
    __syncthreads(); // every warp is past its last tile: sQ and the stages are free
    if ((lane & 3) == 0) {
#pragma unroll
      for (int ri = 0; ri < 2; ri++) {
        sm[warp * 16 + (lane >> 2) + ri * 8] = m_r[ri];
        sm[kWarpsF * 16 + warp * 16 + (lane >> 2) + ri * 8] = l_r[ri];
      }
    }
    __syncthreads();
    float f[2], M[2], Lsum[2];
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
      const int r = (lane >> 2) + ri * 8;
      M[ri] = -INFINITY;
      for (int w = 0; w < kWarpsF; w++)
        M[ri] = fmaxf(M[ri], sm[w * 16 + r]);
      const float mref = M[ri] == -INFINITY ? 0.f : M[ri];
      Lsum[ri] = 0.f;
      for (int w = 0; w < kWarpsF; w++)
        Lsum[ri] += sm[kWarpsF * 16 + w * 16 + r] * ex2(sm[w * 16 + r] - mref);
      f[ri] = ex2(m_r[ri] - mref);
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        so[(warp * 16 + (lane >> 2) + (e >> 1) * 8) * D + nt * 8 + (lane & 3) * 2 + (e & 1)] = o[nt][e] * f[e >> 1];
    __syncthreads();
    if (warp != 0)
      return;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int idx = ((lane >> 2) + (e >> 1) * 8) * D + nt * 8 + (lane & 3) * 2 + (e & 1);
        o[nt][e] = so[idx] + so[16 * D + idx] + so[32 * D + idx] + so[48 * D + idx];
      }
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
      m_r[ri] = M[ri];
      l_r[ri] = Lsum[ri];
    }
  }
  if constexpr (KV == ATTND_KV_INT8 || KV == ATTND_KV_FP8) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        o[nt][e] *= sScale[D + nt * 8 + (lane & 3) * 2 + (e & 1)];
  }
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    if (!rvalid[ri])
      continue;
    const int vv = wv0 + (lane >> 2) + ri * 8;
    const int row = it.q_row + vv / G, h = kvh * G + vv % G;
    const bool any = l_r[ri] > 0.f;
    float inv = any ? 1.f / l_r[ri] : 0.f;
    float lse = any ? (m_r[ri] + log2f(l_r[ri])) * 0.69314718055994531f : -INFINITY;
    if constexpr (KV == ATTND_KV_INT4) {
      // O = sum p (u - z) s / l = s (sum p u / l - z); 0 for a row with no key.
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int k = 0; k < 2; k++) {
          const int d = nt * 8 + (lane & 3) * 2 + k;
          o[nt][ri * 2 + k] = any ? (o[nt][ri * 2 + k] * inv - sScale[3 * D + d]) * sScale[D + d] : 0.f;
        }
      inv = 1.f;
      if (any)
        lse -= P.scale_log2 * 0.69314718055994531f * sC[(lane >> 2) + ri * 8 + qr0];
    }
    const size_t ob = ((size_t)row * P.q_heads + h) * D + (lane & 3) * 2;
    if (P.nsplit > 1) {
      float *dst = P.ws_o + (size_t)split * P.total_q * P.q_heads * D + ob;
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
        *reinterpret_cast<float2 *>(dst + nt * 8) = make_float2(o[nt][ri * 2] * inv, o[nt][ri * 2 + 1] * inv);
      if ((lane & 3) == 0)
        P.ws_lse[((size_t)split * P.total_q + row) * P.q_heads + h] = lse;
    } else {
      if (P.out_fp32) {
        float *dst = reinterpret_cast<float *>(P.out) + ob;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
          *reinterpret_cast<float2 *>(dst + nt * 8) = make_float2(o[nt][ri * 2] * inv, o[nt][ri * 2 + 1] * inv);
      } else {
        uint32_t *dst = reinterpret_cast<uint32_t *>(reinterpret_cast<T *>(P.out) + ob);
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
          dst[nt * 4] = A::pack2(o[nt][ri * 2] * inv, o[nt][ri * 2 + 1] * inv);
      }
      if (P.lse && (lane & 3) == 0)
        P.lse[(size_t)row * P.q_heads + h] = lse;
    }
  }
}

template <int D, int DT, int KV, bool SPLITW>
static cudaError_t launch_one(const FlashParams &p, int nitems, cudaStream_t st) {
  constexpr int NW = SPLITW ? 4 : 8, BM = SPLITW ? 16 : 16 * NW;
  const size_t smem = FlashSmem<D, DT, KV, NW, BM>::kBytes;
  static bool attr_done = false; // per instantiation; benign race: both set the same value
  if (!attr_done) {
    cudaError_t e = cudaFuncSetAttribute(flash_kernel<D, DT, KV, SPLITW>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
      return e;
    attr_done = true;
  }
  const long tiles = ((long)p.max_vec + BM - 1) / BM;
  if (tiles > 65535)
    return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)(nitems * p.kv_heads), (unsigned)tiles, (unsigned)p.nsplit);
  flash_kernel<D, DT, KV, SPLITW><<<grid, NW * 32, smem, st>>>(p);
  return cudaGetLastError();
}

template <int D, int DT, int KV>
cudaError_t launch_flash(const FlashParams &p, int nitems, cudaStream_t st) {
  if constexpr (D <= 128) {
    if (p.max_vec <= 16)
      return launch_one<D, DT, KV, true>(p, nitems, st);
  }
  return launch_one<D, DT, KV, false>(p, nitems, st);
}

#define ATTND_FLASH_INST(KVT)                                                                          \
  template cudaError_t launch_flash<64, ATTND_DT_BF16, KVT>(const FlashParams &, int, cudaStream_t);  \
  template cudaError_t launch_flash<128, ATTND_DT_BF16, KVT>(const FlashParams &, int, cudaStream_t); \
  template cudaError_t launch_flash<256, ATTND_DT_BF16, KVT>(const FlashParams &, int, cudaStream_t); \
  template cudaError_t launch_flash<64, ATTND_DT_FP16, KVT>(const FlashParams &, int, cudaStream_t);  \
  template cudaError_t launch_flash<128, ATTND_DT_FP16, KVT>(const FlashParams &, int, cudaStream_t); \
  template cudaError_t launch_flash<256, ATTND_DT_FP16, KVT>(const FlashParams &, int, cudaStream_t);

} // namespace attnd

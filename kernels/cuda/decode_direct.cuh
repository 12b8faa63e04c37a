// decode_direct.cuh: decode over 8-bit caches (int8, fp8, int8_dynamic,
// fp8_dynamic) with the stored bytes converted straight into tensor-core
// operand registers. Included by the decode_direct_*.cu instantiation files.
//
// Why a second decode kernel. The tiled kernel (flash_impl.cuh) stages raw
// bytes in shared memory, converts them to the operand dtype, stores the
// converted tile back to shared memory and reads it again with ldmatrix: for
// 8-bit caches that round trip, its barriers and its shared-memory footprint
// (three CTAs per SM) kept decode at ~48% of copy bandwidth, bound by latency
// rather than bytes. Here a warp reads its raw K/V bytes from shared memory
// directly in mma fragment order, converts them in registers and feeds
// mma.sync: no converted tile, no CTA barrier in the key loop, and four
// cp.async stages per warp in flight.
//
// Fragment order without shuffles. S = q.k is a sum over the head dimension,
// so any permutation of d applied to both q and k leaves it unchanged: lane
// (g = lane/4, c = lane%4) owns the physical channels of 16-byte chunks
// 4i + c of a key row (i < D/64), so its k operand for k-step t = 4i + u is
// the 32-bit word u of chunk 4i + c (4 channels: the pairs {2c, 2c+1} and
// {2c+8, 2c+9} of the mma's k index). q is stored in shared memory with its
// columns permuted the same way. For O += P V the head dimension is the mma's
// n index: lane g owns the physical channels [g D/8, (g+1) D/8) of the four
// key rows {2c, 2c+1, 2c+8, 2c+9} its B fragment needs, so n-tile j holds
// channel g D/8 + j; O's columns come out permuted and are put back in place
// when the warps' results are merged through shared memory.
//
// A CTA is one (item, kv head, split) with every query vector of the item in
// one 16-row tile (n * group <= 16); its four warps take interleaved 16-key
// chunks of the key range, each with its own online softmax state, merged by
// lse at the end. The numerics are those of the tiled kernel: K and V bytes
// are exact in the operand dtype, per-token scales multiply the scores (K) and
// P (V), static scales go into q (K) and O (V), P is rounded to the operand
// dtype for the matrix units, accumulation is fp32.
#pragma once

#include "flash_impl.cuh"

namespace attnd {

constexpr int kDirKeys = 16; // keys per warp step (one mma k-step of P V)

// NS: cp.async stages per warp (4; 3 for the transposed form, whose 128
// registers and smaller shared memory then fit four CTAs per SM).
template <int D, int NS, int RB_> struct DirSmem {
  static constexpr int RB = RB_;   // bytes of one K or V row (D; int4: D / 2)
  static constexpr int LD = D + 8; // padded q row (elements): conflict-free ldmatrix
  static constexpr int kStage = 2 * kDirKeys * RB + 2 * kDirKeys * 4; // K, V, k scales, v scales
  static constexpr size_t kQ = 0;                                     // [16][LD], permuted columns
  static constexpr size_t kStages = kQ + (size_t)16 * LD * 2;         // [warps][stages][kStage]
  static constexpr size_t kVs =
      kStages + (size_t)kWarpsF * NS * kStage;          // [2][D] static V scale, int4 V zero
  static constexpr size_t kC = kVs + (size_t)2 * D * 4; // int4: [8] q'.z_k per vector
  static constexpr size_t kRow = kC + 8 * 4;            // [16] M, [16] L of the merge
  static constexpr size_t kP = kRow + 2 * 16 * 4;       // TR: [warps][8 vectors][16 keys] P
  static constexpr size_t kBytes = kP + (size_t)kWarpsF * 8 * kDirKeys * 2;
  // After the key loop the stage area holds the merge: [warps][16] m, then [warps][16] l, then
  // [warps][MV][D] o (MV: 16 vectors, 8 in the transposed form).
  template <int MV> static constexpr bool merge_fits() {
    return (2 * kWarpsF * 16 + kWarpsF * MV * D) * 4 <= kWarpsF * NS * kStage;
  }
};

// XOR swizzle of a row's 16-byte chunks in shared memory: the K reads (two
// rows x four chunks per quarter warp) and the V reads (four rows x two chunks)
// hit distinct banks at D = 128.
template <int CPR> __device__ __forceinline__ int dir_swz(int r) {
  return ((((r >> 1) & 3) << 1) ^ ((r & 1) << 2)) & (CPR - 1);
}

__device__ __forceinline__ void cp_async16n(void *smem, const void *gmem, int nbytes) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(nbytes));
}

// int8 byte b of a word already XORed with 0x80808080 (biased u = x + 128),
// as an exact float: u is placed in the low mantissa byte of 2^23.
__device__ __forceinline__ float dir_i8f(uint32_t u, int b) {
  return __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650u | (unsigned)b)) - 8388736.f;
}

// Two stored 8-bit values as one packed operand register (lo in the low half):
// byte bx of word x and byte by of word y.
template <int KV, int DT>
__device__ __forceinline__ uint32_t dir_pair(uint32_t x, uint32_t y, int bx, int by) {
  if constexpr (KV == ATTND_KV_INT8 || KV == ATTND_KV_INT8_DYNAMIC) {
    if constexpr (DT == ATTND_DT_FP16) {
      // fp16 holds 1024 + u exactly: put u in the low mantissa byte of 1024
      // (0x6400), then subtract 1024 + 128.
      const uint32_t h =
          (__byte_perm(x ^ 0x80808080u, y ^ 0x80808080u, (unsigned)bx | ((unsigned)(by + 4) << 8)) &
           0x00ff00ffu) |
          0x64006400u;
      const __half2 r =
          __hsub2(*reinterpret_cast<const __half2 *>(&h), __half2(__half(1152.f), __half(1152.f)));
      return *reinterpret_cast<const uint32_t *>(&r);
    } else {
      return Act<DT>::pack2(dir_i8f(x ^ 0x80808080u, bx), dir_i8f(y ^ 0x80808080u, by));
    }
  } else {
    // e4m3 pairs convert two at a time to fp16 (exact).
    const uint32_t pr = __byte_perm(x, y, (unsigned)bx | ((unsigned)(by + 4) << 4));
    const __half2_raw h2 =
        __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(pr & 0xffffu), __NV_E4M3);
    if constexpr (DT == ATTND_DT_FP16) {
      return (uint32_t)h2.x | ((uint32_t)h2.y << 16);
    } else {
      const float2 f = __half22float2(__half2(h2));
      return Act<DT>::pack2(f.x, f.y);
    }
  }
}

// int4 (values u in 0..15): nibbles i and i + 4 of x as one packed operand
// register (exact): u goes into the low mantissa bits of 128 (bf16) or 1024
// (fp16), which is then subtracted.
template <int DT> __device__ __forceinline__ uint32_t dir_i4pair(uint32_t x, int i) {
  if constexpr (DT == ATTND_DT_FP16) {
    const uint32_t h = ((x >> (4 * i)) & 0x000f000fu) | 0x64006400u;
    const __half2 r =
        __hsub2(*reinterpret_cast<const __half2 *>(&h), __half2(__half(1024.f), __half(1024.f)));
    return *reinterpret_cast<const uint32_t *>(&r);
  } else {
    const uint32_t h = ((x >> (4 * i)) & 0x000f000fu) | 0x43004300u;
    const __nv_bfloat162 r =
        __hsub2(*reinterpret_cast<const __nv_bfloat162 *>(&h),
                __nv_bfloat162(__float2bfloat16(128.f), __float2bfloat16(128.f)));
    return *reinterpret_cast<const uint32_t *>(&r);
  }
}

// TR (at most 8 query vectors): S^T = K q^T and O^T = V^T P^T, so that keys and
// channels fill the mma's 16 rows and the vectors its 8 columns: half the mma
// work of the 16-row form, where a GQA-4 decode fills 4 of 16 rows.
template <int D, int DT, int KV, bool TR>
__global__ void __launch_bounds__(kWarpsF * 32, (D == 64 || TR) ? 4 : 3)
    decode_direct_kernel(const __grid_constant__ FlashParams P) {
  using A = Act<DT>;
  using T = typename A::T;
  constexpr int NS = TR ? 3 : 4;
  constexpr bool kI4 = KV == ATTND_KV_INT4;
  using L = DirSmem<D, NS, kI4 ? D / 2 : D>;
  constexpr int RB = L::RB, LD = L::LD, CPR = RB / 16, NT = D / 8, KS = kDirKeys;
  constexpr int NTH = kWarpsF * 32, MV = TR ? 8 : 16;
  constexpr bool kDyn = KvT<KV>::kDyn;
  static_assert(KV == ATTND_KV_INT8 || KV == ATTND_KV_FP8 || kDyn || (kI4 && TR),
                "8-bit caches, int4 transposed");
  static_assert(D == 64 || D == 128, "D = 256 decodes through the tiled kernel");
  static_assert(L::template merge_fits<MV>(), "the merge fits in the stage area");

  extern __shared__ __align__(16) uint8_t smem[];
  T *sQ = reinterpret_cast<T *>(smem + L::kQ);
  uint8_t *sStages = smem + L::kStages;
  float *sVs = reinterpret_cast<float *>(smem + L::kVs);
  float *sRow = reinterpret_cast<float *>(smem + L::kRow);
  float *sC = reinterpret_cast<float *>(smem + L::kC);
  T *sP = reinterpret_cast<T *>(smem + L::kP) + (threadIdx.x >> 5) * 8 * kDirKeys;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c4 = lane & 3;
  const int item = blockIdx.x / P.kv_heads, kvh = blockIdx.x % P.kv_heads;
  const attnd_kitem_t it = P.items[item];
  if (it.q_row < 0)
    return;
  const int G = P.group, nvec = it.n * G; // <= 16 (the launcher checks max_vec)
  const int split = blockIdx.z, kv_len = it.start + it.n;
  const int pmin = it.start, pmax = it.start + (nvec - 1) / G;
  const int kind = it.mask_kind, mp = it.mask_param;
  const int32_t *iv = kind == ATTND_MASK_INTERVALS ? P.meta + it.intervals : nullptr;
  const int32_t *bt = P.meta + it.block_table;

  // Keys any row may see (as in the tiled kernel), then this split's part.
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
  const int jfirst = lo & ~(KS - 1);
  const int nchunks = hi >= jfirst ? (hi - jfirst) / KS + 1 : 0;

  const size_t v_region = (size_t)P.kv_heads * P.bs * RB;
  const size_t scale_region = 2 * v_region;
  const int bs_shift = __ffs(P.bs) - 1, bs_mask = P.bs - 1;
  const int jmax = hi; // hi < kv_len
  uint8_t *myStages = sStages + (size_t)warp * NS * L::kStage;

  // Copies chunk q (16 keys, all in one block: chunks are 16-aligned and
  // blocks hold >= 16 keys) into stage st; rows past jmax are zero-filled, so
  // a poisoned or stale tail of the block is never read as a value.
  const bool dbg_no_load = P.debug & 1, dbg_no_compute = P.debug & 2; // timing experiments only
  auto issue = [&](int q, int st) {
    if (dbg_no_load)
      return;
    uint8_t *sb = myStages + st * L::kStage;
    const int j0 = jfirst + q * KS;
    const int nval = min(KS, jmax - j0 + 1);
    const size_t blk = (size_t)bt[j0 >> bs_shift] * P.block_bytes;
    const int rib = kvh * P.bs + (j0 & bs_mask); // row in the block's [kv head][token] order
    const uint8_t *kp = P.cache + blk + (size_t)rib * RB;
#pragma unroll
    for (int i = 0; i < (KS * CPR) / 32; i++) {
      const int x = lane + 32 * i, r = x / CPR, cc = x % CPR;
      const bool ok = r < nval;
      const int dst = r * RB + ((cc ^ dir_swz<CPR>(r)) << 4);
      cp_async16(sb + dst, ok ? kp + (size_t)r * RB + cc * 16 : P.cache, ok);
      cp_async16(sb + KS * RB + dst, ok ? kp + v_region + (size_t)r * RB + cc * 16 : P.cache, ok);
    }
    if constexpr (kDyn) {
      if (lane < 8) {
        const int which = lane >> 2, k4 = (lane & 3) * 4;
        const int nb = max(0, min(4, nval - k4)) * 4;
        const uint8_t *src =
            P.cache + blk + scale_region + ((size_t)which * P.kv_heads * P.bs + rib + k4) * 4;
        cp_async16n(sb + 2 * KS * RB + which * KS * 4 + k4 * 4, nb ? src : P.cache, nb);
      }
    }
  };

  constexpr int NO = TR ? D / 16 : NT; // O tiles per warp
  float o[NO][4];
#pragma unroll
  for (int i = 0; i < NO; i++)
    o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // Softmax state of this lane's two vectors: TR: 2c and 2c+1, else g and g+8.
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
  int prow[2];
#pragma unroll
  for (int i = 0; i < 2; i++)
    prow[i] = it.start + min(TR ? 2 * c4 + i : g + 8 * i, nvec - 1) / G;
  const float sl2 = P.scale_log2;

  // Logical (mma k) column of physical channel d in q: lane c's k operand
  // registers hold the channels of its slice of a key row (see the file comment).
  auto qcol = [](int d) -> int {
    if constexpr (kI4) {
      // Slice of lane c: channels [c D/4, (c+1) D/4), 8 per word w; nibble i of
      // word w feeds k-step 2w + ((i & 3) >> 1) as pair member (i >> 2) of
      // logical column 2c (i even) or 2c + 8 (i odd).
      const int c = d / (D / 4), within = d % (D / 4), w = within >> 3, i = within & 7;
      return (2 * w + ((i & 3) >> 1)) * 16 + 2 * c + ((i & 1) << 3) + (i >> 2);
    } else {
      const int ch = d >> 4, t = (ch >> 2) * 4 + ((d >> 2) & 3), e = d & 3;
      return t * 16 + 2 * (ch & 3) + (e & 1) + ((e >> 1) << 3);
    }
  };
  const int cnt = nchunks > warp ? (nchunks - 1 - warp) / kWarpsF + 1 : 0;
#pragma unroll
  for (int n = 0; n < NS - 1; n++) {
    if (n < cnt)
      issue(warp + kWarpsF * n, n);
    cp_async_commit();
  }
  // While the first chunks are on their way: q -> shared memory with its
  // columns permuted (see the file comment); the static K scale goes into q,
  // the static V scale waits in sVs for O.
  for (int idx = tid; idx < 16 * D; idx += NTH) {
    const int r = idx / D, d = idx % D;
    float x = 0.f;
    if (r < nvec) {
      const int row = it.q_row + r / G, h = kvh * G + r % G;
      x = A::to_f(reinterpret_cast<const T *>(P.q)[((size_t)row * P.q_heads + h) * D + d]);
      if constexpr (KvT<KV>::kStatic)
        x *= (kI4 || P.per_channel) ? P.k_scale[kvh * D + d] : P.k_scale[kvh];
    }
    sQ[r * LD + qcol(d)] = A::from_f(x);
  }
  if constexpr (KvT<KV>::kStatic)
    for (int d = tid; d < D; d += NTH) {
      sVs[d] = (kI4 || P.per_channel) ? P.v_scale[kvh * D + d] : P.v_scale[kvh];
      if constexpr (kI4)
        sVs[D + d] = P.v_zero[kvh * D + d];
    }
  __syncthreads();
  if constexpr (kI4) {
    // q'.(u - z) = q'.u - q'.z: the second term is the same for every key of a
    // vector, so the scores leave it out and the lse takes it out at the end.
    if (tid < MV) {
      float c = 0.f;
      for (int d = 0; d < D; d++)
        c += A::to_f(sQ[tid * LD + qcol(d)]) * P.k_zero[kvh * D + d];
      sC[tid] = c;
    }
  }
  // TR: q^T is the B operand of every chunk: held in registers.
  uint32_t qb[TR ? D / 16 : 1][2];
  if constexpr (TR) {
#pragma unroll
    for (int t = 0; t < D / 16; t += 2)
      ldsm_x4(qb[t][0], qb[t][1], qb[t + 1][0], qb[t + 1][1],
              sQ + (lane & 7) * LD + t * 16 + ((lane >> 3) & 1) * 8 + (lane >> 4) * 16);
  }

  for (int n = 0; n < cnt; n++) {
    // The stage of chunk n - 1 is free (the warp passed its end): refill it.
    if (n + NS - 1 < cnt)
      issue(warp + kWarpsF * (n + NS - 1), (n + NS - 1) % NS);
    cp_async_commit();
    cp_async_wait<NS - 1>();
    __syncwarp();
    if (dbg_no_compute)
      continue;

    const uint8_t *sb = myStages + (n % NS) * L::kStage;
    const uint8_t *sK = sb, *sV = sb + KS * RB;
    const float *sKs = reinterpret_cast<const float *>(sb + 2 * KS * RB), *sVsc = sKs + KS;
    const int j0 = jfirst + (warp + kWarpsF * n) * KS;

    // Scale into the exp2 domain, per-token K scale, mask, online softmax.
    bool need_mask = j0 < lo || j0 + KS - 1 > hi;
    if (kind == ATTND_MASK_CAUSAL || kind == ATTND_MASK_SLIDING)
      need_mask = need_mask || j0 + KS - 1 > pmin;
    if (kind == ATTND_MASK_SLIDING)
      need_mask = need_mask || j0 < pmax - mp + 1;
    if (kind == ATTND_MASK_PREFIX_LM)
      need_mask = need_mask || (j0 + KS - 1 > pmin && j0 + KS - 1 >= mp);
    if (kind == ATTND_MASK_INTERVALS)
      need_mask = true;
    if constexpr (TR) {
      // S^T = K q^T: 16 keys x 8 vectors; two accumulators halve the chain.
      float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb2[4] = {0.f, 0.f, 0.f, 0.f};
      if constexpr (kI4) {
        constexpr int KW = D / 32; // words of lane c's slice of a key row
        uint32_t kw[2][KW];
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const int r = h * 8 + g;
          if constexpr (D == 128) {
            const uint4 x =
                *reinterpret_cast<const uint4 *>(sK + r * RB + ((c4 ^ dir_swz<CPR>(r)) << 4));
            kw[h][0] = x.x;
            kw[h][1] = x.y;
            kw[h][2] = x.z;
            kw[h][3] = x.w;
          } else {
            const uint2 x = *reinterpret_cast<const uint2 *>(
                sK + r * RB + (((c4 >> 1) ^ dir_swz<CPR>(r)) << 4) + (c4 & 1) * 8);
            kw[h][0] = x.x;
            kw[h][1] = x.y;
          }
        }
#pragma unroll
        for (int w = 0; w < KW; w++)
#pragma unroll
          for (int hh = 0; hh < 2; hh++) {
            const uint32_t a[4] = {
                dir_i4pair<DT>(kw[0][w], 2 * hh), dir_i4pair<DT>(kw[1][w], 2 * hh),
                dir_i4pair<DT>(kw[0][w], 2 * hh + 1), dir_i4pair<DT>(kw[1][w], 2 * hh + 1)};
            mma16816<DT>(hh ? sb2 : sa, a, qb[2 * w + hh][0], qb[2 * w + hh][1]);
          }
      }
#pragma unroll
      for (int i = 0; i < (kI4 ? 0 : D / 64); i++) {
        uint4 kw[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const int r = h * 8 + g;
          kw[h] = *reinterpret_cast<const uint4 *>(sK + r * RB +
                                                   (((i * 4 + c4) ^ dir_swz<CPR>(r)) << 4));
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
          const uint32_t w0 = (&kw[0].x)[u], w1 = (&kw[1].x)[u];
          const uint32_t a[4] = {dir_pair<KV, DT>(w0, w0, 0, 1), dir_pair<KV, DT>(w1, w1, 0, 1),
                                 dir_pair<KV, DT>(w0, w0, 2, 3), dir_pair<KV, DT>(w1, w1, 2, 3)};
          mma16816<DT>(u & 1 ? sb2 : sa, a, qb[i * 4 + u][0], qb[i * 4 + u][1]);
        }
      }
      // Element e: key g + 8 (e >> 1), vector 2c + (e & 1).
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = g + 8 * (e >> 1);
        float x = (sa[e] + sb2[e]) * sl2;
        if constexpr (kDyn)
          x *= sKs[key];
        if (need_mask) {
          const int j = j0 + key;
          if (!(j >= lo && j <= hi && visible(kind, mp, it.causal, iv, kv_len, prow[e & 1], j)))
            x = -INFINITY;
        }
        sa[e] = x;
        mx[e & 1] = fmaxf(mx[e & 1], x);
      }
      float alpha[2];
#pragma unroll
      for (int vi = 0; vi < 2; vi++) {
        mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 4));
        mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 8));
        mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 16));
        const float mnew = ceilf(fmaxf(m_r[vi], mx[vi]));  // an integer: see flash.cuh
        const float mref = mnew == -INFINITY ? 0.f : mnew; // no key seen yet: every p is 0
        alpha[vi] = ex2(m_r[vi] - mref);
        m_r[vi] = mnew;
        mx[vi] = mref;
      }
      // P^T to the warp's [vector][key] tile (the B operand wants keys along
      // a lane's register pair), V's per-token scale folded in.
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = g + 8 * (e >> 1), v = 2 * c4 + (e & 1);
        const float pe = ex2(sa[e] - mx[e & 1]);
        l_r[e & 1] = (e >> 1) ? l_r[e & 1] + pe : l_r[e & 1] * alpha[e & 1] + pe;
        float pv = pe;
        if constexpr (kDyn)
          pv *= sVsc[key];
        sP[v * KS + key] = A::from_f(pv);
      }
      __syncwarp();
      const uint32_t pb0 = *reinterpret_cast<const uint32_t *>(sP + g * KS + 2 * c4);
      const uint32_t pb1 = *reinterpret_cast<const uint32_t *>(sP + g * KS + 2 * c4 + 8);
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < NO; i++) {
          o[i][0] *= alpha[0];
          o[i][1] *= alpha[1];
          o[i][2] *= alpha[0];
          o[i][3] *= alpha[1];
        }
      }
      // O^T += V^T P^T: m-tile mt holds channels g D/8 + 2 mt (row g) and
      // g D/8 + 2 mt + 1 (row g + 8) of this lane's slice.
      if constexpr (kI4) {
        constexpr int VW4 = D / 64; // words of lane g's slice of a V row (8 channels each)
        uint32_t vw[4][VW4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
          const int r = 2 * c4 + (k & 1) + (k >> 1) * 8;
          if constexpr (D == 128) {
            const uint2 x = *reinterpret_cast<const uint2 *>(
                sV + r * RB + (((g >> 1) ^ dir_swz<CPR>(r)) << 4) + (g & 1) * 8);
            vw[k][0] = x.x;
            vw[k][1] = x.y;
          } else {
            vw[k][0] = *reinterpret_cast<const uint32_t *>(
                sV + r * RB + (((g >> 2) ^ dir_swz<CPR>(r)) << 4) + (g & 3) * 4);
          }
        }
#pragma unroll
        for (int w = 0; w < VW4; w++) {
          // Bytes [a0 a1 b0 b1]: nibble i is channel i of row a, nibble i + 4 of row b.
          const uint32_t x01[2] = {__byte_perm(vw[0][w], vw[1][w], 0x5410),
                                   __byte_perm(vw[0][w], vw[1][w], 0x7632)};
          const uint32_t x89[2] = {__byte_perm(vw[2][w], vw[3][w], 0x5410),
                                   __byte_perm(vw[2][w], vw[3][w], 0x7632)};
#pragma unroll
          for (int k = 0; k < 4; k++) {
            const int i0 = (k & 1) * 2;
            const uint32_t a[4] = {
                dir_i4pair<DT>(x01[k >> 1], i0), dir_i4pair<DT>(x01[k >> 1], i0 + 1),
                dir_i4pair<DT>(x89[k >> 1], i0), dir_i4pair<DT>(x89[k >> 1], i0 + 1)};
            mma16816<DT>(o[4 * w + k], a, pb0, pb1);
          }
        }
      } else {
        constexpr int VW = D / 32;
        uint32_t vw[4][VW];
#pragma unroll
        for (int k = 0; k < 4; k++) {
          const int r = 2 * c4 + (k & 1) + (k >> 1) * 8;
          if constexpr (D == 128) {
            const uint4 x =
                *reinterpret_cast<const uint4 *>(sV + r * RB + ((g ^ dir_swz<CPR>(r)) << 4));
            vw[k][0] = x.x;
            vw[k][1] = x.y;
            vw[k][2] = x.z;
            vw[k][3] = x.w;
          } else {
            const uint2 x = *reinterpret_cast<const uint2 *>(
                sV + r * RB + (((g >> 1) ^ dir_swz<CPR>(r)) << 4) + (g & 1) * 8);
            vw[k][0] = x.x;
            vw[k][1] = x.y;
          }
        }
#pragma unroll
        for (int mt = 0; mt < NO; mt++) {
          const int wd = (2 * mt) >> 2, b = (2 * mt) & 3;
          const uint32_t a[4] = {dir_pair<KV, DT>(vw[0][wd], vw[1][wd], b, b),
                                 dir_pair<KV, DT>(vw[0][wd], vw[1][wd], b + 1, b + 1),
                                 dir_pair<KV, DT>(vw[2][wd], vw[3][wd], b, b),
                                 dir_pair<KV, DT>(vw[2][wd], vw[3][wd], b + 1, b + 1)};
          mma16816<DT>(o[mt], a, pb0, pb1);
        }
      }
    } else {
      // S = q K^T: 16 vectors x 16 keys.
      float s[2][4];
#pragma unroll
      for (int i = 0; i < 2; i++)
        s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int i = 0; i < D / 64; i++) {
        uint4 kw[2];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
          const int r = nt * 8 + g;
          kw[nt] = *reinterpret_cast<const uint4 *>(sK + r * RB +
                                                    (((i * 4 + c4) ^ dir_swz<CPR>(r)) << 4));
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
          uint32_t a[4];
          ldsm_x4(a[0], a[1], a[2], a[3],
                  sQ + (lane & 15) * LD + (i * 4 + u) * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int nt = 0; nt < 2; nt++) {
            const uint32_t w = (&kw[nt].x)[u];
            mma16816<DT>(s[nt], a, dir_pair<KV, DT>(w, w, 0, 1), dir_pair<KV, DT>(w, w, 2, 3));
          }
        }
      }

      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int key = nt * 8 + 2 * c4 + (e & 1);
          float x = s[nt][e] * sl2;
          if constexpr (kDyn)
            x *= sKs[key];
          if (need_mask) {
            const int j = j0 + key;
            if (!(j >= lo && j <= hi && visible(kind, mp, it.causal, iv, kv_len, prow[e >> 1], j)))
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
        const float mnew = ceilf(fmaxf(m_r[ri], mx[ri]));  // an integer: see flash.cuh
        const float mref = mnew == -INFINITY ? 0.f : mnew; // no key seen yet: every p is 0
        alpha[ri] = ex2(m_r[ri] - mref);
        m_r[ri] = mnew;
        mx[ri] = mref;
      }
      float rs[2] = {0.f, 0.f};
      uint32_t pa[4];
#pragma unroll
      for (int nt = 0; nt < 2; nt++) {
        const float p0 = ex2(s[nt][0] - mx[0]), p1 = ex2(s[nt][1] - mx[0]);
        const float p2 = ex2(s[nt][2] - mx[1]), p3 = ex2(s[nt][3] - mx[1]);
        rs[0] += p0 + p1;
        rs[1] += p2 + p3;
        if constexpr (kDyn) {
          const float2 vs = *reinterpret_cast<const float2 *>(sVsc + nt * 8 + 2 * c4);
          pa[nt * 2 + 0] = A::pack2(p0 * vs.x, p1 * vs.y);
          pa[nt * 2 + 1] = A::pack2(p2 * vs.x, p3 * vs.y);
        } else {
          pa[nt * 2 + 0] = A::pack2(p0, p1);
          pa[nt * 2 + 1] = A::pack2(p2, p3);
        }
      }
#pragma unroll
      for (int ri = 0; ri < 2; ri++)
        l_r[ri] = l_r[ri] * alpha[ri] + rs[ri];
      // Past the first chunks the running max rarely moves: alpha is then
      // exactly 1 and the rescale of O is skipped (same result, 64 fewer FMULs).
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < NT; i++) {
          o[i][0] *= alpha[0];
          o[i][1] *= alpha[0];
          o[i][2] *= alpha[1];
          o[i][3] *= alpha[1];
        }
      }

      // O += P V: lane g's channels of key rows 2c, 2c+1, 2c+8, 2c+9.
      constexpr int VW = D / 32; // 32-bit words of a lane's slice of one V row
      uint32_t vw[4][VW];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int r = 2 * c4 + (k & 1) + (k >> 1) * 8;
        if constexpr (D == 128) {
          const uint4 x =
              *reinterpret_cast<const uint4 *>(sV + r * RB + ((g ^ dir_swz<CPR>(r)) << 4));
          vw[k][0] = x.x;
          vw[k][1] = x.y;
          vw[k][2] = x.z;
          vw[k][3] = x.w;
        } else {
          const uint2 x = *reinterpret_cast<const uint2 *>(
              sV + r * RB + (((g >> 1) ^ dir_swz<CPR>(r)) << 4) + (g & 1) * 8);
          vw[k][0] = x.x;
          vw[k][1] = x.y;
        }
      }
#pragma unroll
      for (int wd = 0; wd < VW; wd++)
#pragma unroll
        for (int b = 0; b < 4; b++) {
          const uint32_t b0 = dir_pair<KV, DT>(vw[0][wd], vw[1][wd], b, b);
          const uint32_t b1 = dir_pair<KV, DT>(vw[2][wd], vw[3][wd], b, b);
          mma16816<DT>(o[wd * 4 + b], pa, b0, b1);
        }
    }
    __syncwarp(); // the stage is refilled next iteration
  }
  cp_async_wait<0>();

  // Merge the four warps' states by lse, write in the natural channel order.
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    if constexpr (TR) { // a vector's keys are spread over the lanes of one c
      l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 4);
      l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 8);
      l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 16);
    } else {
      l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 1);
      l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 2);
    }
  }
  float *sm = reinterpret_cast<float *>(sStages); // [warps][16] m, [warps][16] l
  float *so = sm + 2 * kWarpsF * 16;              // [warps][MV][D]
  __syncthreads(); // every warp is past its last chunk: the stages are free
  if (TR ? g == 0 : c4 == 0) {
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
      const int v = TR ? 2 * c4 + ri : g + ri * 8;
      sm[warp * 16 + v] = m_r[ri];
      sm[kWarpsF * 16 + warp * 16 + v] = l_r[ri];
    }
  }
  __syncthreads();
  if (tid < (TR ? 8 : 16)) {
    float M = -INFINITY;
    for (int w = 0; w < kWarpsF; w++)
      M = fmaxf(M, sm[w * 16 + tid]);
    const float mref = M == -INFINITY ? 0.f : M;
    float Ls = 0.f;
    for (int w = 0; w < kWarpsF; w++)
      Ls += sm[kWarpsF * 16 + w * 16 + tid] * ex2(sm[w * 16 + tid] - mref);
    sRow[tid] = mref;
    sRow[16 + tid] = Ls;
  }
  __syncthreads();
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    const int r = TR ? 2 * c4 + ri : g + 8 * ri;
    const float Ls = sRow[16 + r];
    const float f = Ls > 0.f ? ex2(m_r[ri] - sRow[r]) / Ls : 0.f;
    if constexpr (TR) {
#pragma unroll
      for (int mt = 0; mt < NO; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
          so[(warp * MV + r) * D + g * (D / 8) + 2 * mt + h] = o[mt][h * 2 + ri] * f;
    } else {
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 2; e++)
          so[(warp * MV + r) * D + (2 * c4 + e) * (D / 8) + j] = o[j][ri * 2 + e] * f;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < nvec * D; idx += NTH) {
    const int r = idx / D, d = idx % D;
    float x =
        so[r * D + d] + so[(MV + r) * D + d] + so[(2 * MV + r) * D + d] + so[(3 * MV + r) * D + d];
    const float Ls = sRow[16 + r];
    if constexpr (kI4)
      x = Ls > 0.f ? (x - sVs[D + d]) * sVs[d]
                   : 0.f; // O = s (sum p u / l - z); 0 for a row with no key
    else if constexpr (KvT<KV>::kStatic)
      x *= sVs[d];
    const int row = it.q_row + r / G, h = kvh * G + r % G;
    const size_t ob = ((size_t)row * P.q_heads + h) * D + d;
    float lse = Ls > 0.f ? (sRow[r] + log2f(Ls)) * 0.69314718055994531f : -INFINITY;
    if constexpr (kI4)
      if (Ls > 0.f)
        lse -= P.scale_log2 * 0.69314718055994531f * sC[r];
    if (P.nsplit > 1) {
      P.ws_o[(size_t)split * P.total_q * P.q_heads * D + ob] = x;
      if (d == 0)
        P.ws_lse[((size_t)split * P.total_q + row) * P.q_heads + h] = lse;
    } else {
      if (P.out_fp32)
        reinterpret_cast<float *>(P.out)[ob] = x;
      else
        reinterpret_cast<T *>(P.out)[ob] = A::from_f(x);
      if (P.lse && d == 0)
        P.lse[(size_t)row * P.q_heads + h] = lse;
    }
  }
}

template <int D, int DT, int KV, bool TR>
static cudaError_t launch_direct_one(const FlashParams &p, int nitems, cudaStream_t st) {
  const size_t smem = DirSmem < D, TR ? 3 : 4, KV == ATTND_KV_INT4 ? D / 2 : D > ::kBytes;
  static bool attr_done = false; // per instantiation; benign race: both set the same value
  if (!attr_done) {
    cudaError_t e = cudaFuncSetAttribute(decode_direct_kernel<D, DT, KV, TR>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
      return e;
    attr_done = true;
  }
  dim3 grid((unsigned)(nitems * p.kv_heads), 1u, (unsigned)p.nsplit);
  decode_direct_kernel<D, DT, KV, TR><<<grid, kWarpsF * 32, smem, st>>>(p);
  return cudaGetLastError();
}

template <int D, int DT, int KV>
cudaError_t launch_direct(const FlashParams &p, int nitems, cudaStream_t st) {
  if constexpr (KV == ATTND_KV_INT4) // transposed form only (direct_decode checks max_vec <= 8)
    return launch_direct_one<D, DT, KV, true>(p, nitems, st);
  else
    return p.max_vec <= 8 ? launch_direct_one<D, DT, KV, true>(p, nitems, st)
                          : launch_direct_one<D, DT, KV, false>(p, nitems, st);
}

template <int D, int DT, int KV, bool TR> static int direct_occupancy_one() {
  static int n = 0;
  if (n == 0) {
    const size_t smem = DirSmem < D, TR ? 3 : 4, KV == ATTND_KV_INT4 ? D / 2 : D > ::kBytes;
    cudaFuncSetAttribute(decode_direct_kernel<D, DT, KV, TR>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, decode_direct_kernel<D, DT, KV, TR>,
                                                      kWarpsF * 32, smem) != cudaSuccess ||
        b < 1) {
      cudaGetLastError();
      b = 2;
    }
    n = b;
  }
  return n;
}

// Resident CTAs per SM (split planning), from the occupancy calculator.
template <int D, int DT, int KV> int direct_occupancy(int max_vec) {
  if constexpr (KV == ATTND_KV_INT4)
    return direct_occupancy_one<D, DT, KV, true>();
  else
    return max_vec <= 8 ? direct_occupancy_one<D, DT, KV, true>()
                        : direct_occupancy_one<D, DT, KV, false>();
}

#define ATTND_DIRECT_INST(KVT)                                                                     \
  template cudaError_t launch_direct<64, ATTND_DT_BF16, KVT>(const FlashParams &, int,             \
                                                             cudaStream_t);                        \
  template cudaError_t launch_direct<128, ATTND_DT_BF16, KVT>(const FlashParams &, int,            \
                                                              cudaStream_t);                       \
  template cudaError_t launch_direct<64, ATTND_DT_FP16, KVT>(const FlashParams &, int,             \
                                                             cudaStream_t);                        \
  template cudaError_t launch_direct<128, ATTND_DT_FP16, KVT>(const FlashParams &, int,            \
                                                              cudaStream_t);                       \
  template int direct_occupancy<64, ATTND_DT_BF16, KVT>(int);                                      \
  template int direct_occupancy<128, ATTND_DT_BF16, KVT>(int);                                     \
  template int direct_occupancy<64, ATTND_DT_FP16, KVT>(int);                                      \
  template int direct_occupancy<128, ATTND_DT_FP16, KVT>(int);

} // namespace attnd

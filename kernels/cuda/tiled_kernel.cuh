// tiled_kernel.cuh: the tiled attention kernel (see tiled_params.cuh), for items of
// more than 16 query vectors (prefill rows; decode shapes go to
// decode_kernel.cuh). Included by the generated tiled_inst_<kv>.cu files.
//
// A CTA of 8 warps takes 128 query vectors of one (item, kv head, KV split);
// each warp owns 16 of them and every warp shares each K/V tile the CTA
// loads. Tiles of 64 keys (32 at head dim 256) are copied from the paged cache
// with cp.async, double buffered, zero-filled past the visible range; for
// quantized caches the raw tile is converted in registers to the operand
// dtype and stored once more in shared memory for ldmatrix.
//
// Numerics as decode_kernel.cuh: static K scale per kv head in the fp32
// score scale, per channel in q as an exact hi + lo pair (a second product
// from sQlo); int4's K zero point out of the lse (fp64); O normalized by the
// sum of P as rounded for the matrix units (not for the dynamic types), which
// takes V's zero point out exactly.
#pragma once

#include "tiled_params.cuh"
#include "primitives.cuh"

namespace attnd {

constexpr int kMaxTileFlags = 1024; // key tiles with precomputed interval flags (64K keys at 64)

template <int D_, int DT_, int KV_> struct Tiled {
  static constexpr int D = D_, DT = DT_, KV = KV_;
  using K = KvT<KV>;
  static constexpr int NW = 8, NTH = NW * 32, BM = 16 * NW;
  static constexpr int BN = D == 256 ? 32 : 64; // keys per tile (shared memory bound at D = 256)
  static constexpr bool kDirect = (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) ||
                                  (KV == ATTND_KV_FP16 && DT == ATTND_DT_FP16);
  static constexpr int LD = D + 8; // padded operand row (elements): conflict-free ldmatrix
  static constexpr int RB = K::k16 ? 2 * D : K::kI4 ? D / 2 : D;
  // Staged raw row stride: direct tiles are the mma operands (padded); raw
  // rows are read as whole contiguous rows, so they need no padding.
  static constexpr int RAWLD = kDirect ? 2 * LD : RB;
  static constexpr int CPR = RB / 16, EPC = K::kElemPerChunk, NT = D / 8;
  static constexpr int CHI = (BN * CPR + NTH - 1) / NTH; // chunks per thread per K (or V) tile
  static constexpr bool kGuard = (BN * CPR) % NTH != 0;
  static constexpr size_t kQ = 0;                                        // [BM][LD]
  static constexpr size_t kRaw = kQ + (size_t)BM * LD * 2;               // [2 stages][K,V][BN][RAWLD]
  static constexpr size_t kOp = kRaw + (size_t)2 * 2 * BN * RAWLD;       // [K,V][BN][LD] when !kDirect
  static constexpr size_t kDs = kOp + (kDirect ? 0 : (size_t)2 * BN * LD * 2); // [2][K,V][BN] fp32
  static constexpr size_t kScale = kDs + (size_t)2 * 2 * BN * 4;         // [2][D] v scale, v zero
  static constexpr size_t kFlags = kScale + (K::kStatic ? (size_t)2 * D * 4 : 0); // [kMaxTileFlags] u8
  static constexpr size_t kC = kFlags + kMaxTileFlags;                   // int4: [BM] q'.z_k; [8] scratch
  static constexpr size_t kBytes = kC + (size_t)BM * 4 + 32;
  static constexpr size_t kQlo = kBytes; // [BM][LD], only when q is split (extra dynamic smem)
  // P goes to the matrix units as P 2^14 in fp16 (fp16's subnormals start at
  // 2^-14); the dynamic types' P carries V's scale, taken relative to a running
  // power-of-two reference of those scales in fp16 (kSigma, decode_kernel.cuh).
  // The P V product's operand dtype, as the decode kernel's (decode_kernel.cuh):
  // fp16 wherever V's stored values are exact in it, the activation dtype for
  // the dynamic types (their P carries V's scale). Both kernels must round P
  // the same way: a prefix-cache hit (decode kernel) must equal a full
  // recompute (this kernel).
  static constexpr int PDT = (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) ? ATTND_DT_BF16
                             : K::kDyn                                    ? DT
                                                                          : ATTND_DT_FP16;
  static constexpr float kPShift = PDT == ATTND_DT_FP16 ? 14.f : 0.f;
  static constexpr bool kSigma = K::kDyn && PDT == ATTND_DT_FP16;
  static_assert(BN * CPR >= 32, "a tile has at least one chunk per lane");
};

// Per-CTA facts of the tiled kernel.
struct TileCtx {
  attnd_kitem_t it;
  const int32_t *iv, *bt;
  int kvh, v0, vend, nvec, pmin, pmax, lo, hi, jfirst, ntiles, kv_len;
  float sl2;    // score scale into the exp2 domain, static K scale folded in
  bool lo_pass; // q split into hi + lo: a second product from sQlo
};

// Q tile -> shared memory (rows past nvec zero); per channel static K scales
// go in as q s / 2^e, hi in sQ and lo in sQlo.
template <class C>
__device__ void tiled_load_q(const FlashParams &P, const TileCtx &x, float rscale, typename Act<C::DT>::T *sQ,
                             typename Act<C::DT>::T *sQlo) {
  using A = Act<C::DT>;
  using T = typename A::T;
  constexpr int D = C::D, LD = C::LD;
  const int G = P.group;
  for (int c = threadIdx.x; c < C::BM * (D / 8); c += C::NTH) {
    const int v = c / (D / 8), col = (c % (D / 8)) * 8;
    uint4 val = make_uint4(0, 0, 0, 0), vlo = make_uint4(0, 0, 0, 0);
    if (x.v0 + v < x.nvec) {
      const int vv = x.v0 + v, r = vv / G, h = x.kvh * G + vv % G;
      val = *reinterpret_cast<const uint4 *>(reinterpret_cast<const T *>(P.q) +
                                             ((size_t)(x.it.q_row + r) * P.q_heads + h) * D + col);
      if (x.lo_pass) {
        uint32_t *w = &val.x, *wl = &vlo.x;
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
          const T *pr = reinterpret_cast<const T *>(&w[e / 2]);
          const float a = A::to_f(pr[0]) * (P.k_scale[x.kvh * D + col + e] * rscale);
          const float b = A::to_f(pr[1]) * (P.k_scale[x.kvh * D + col + e + 1] * rscale);
          const uint32_t hw = A::pack2(a, b);
          w[e / 2] = hw;
          wl[e / 2] = A::pack2(a - op_half<C::DT>(hw, false), b - op_half<C::DT>(hw, true));
        }
      }
    }
    *reinterpret_cast<uint4 *>(sQ + v * LD + col) = val;
    if (x.lo_pass)
      *reinterpret_cast<uint4 *>(sQlo + v * LD + col) = vlo;
  }
}

// FlashMask intervals: classify every key tile once (primitives.cuh). A tile
// is skipped when each of its keys is masked for every row of this query tile
// (causal, or an interval covering [pmin, pmax]); it needs no per-element
// mask when no key is masked for any row.
template <class C> __device__ void tiled_classify(const FlashParams &P, const TileCtx &x, uint8_t *sFlags) {
  classify_tiles<C::BN>(x.it, x.iv, x.kv_len, x.lo, x.hi, x.jfirst, x.ntiles, kMaxTileFlags, x.pmin, x.pmax, P.window,
                        C::NW, sFlags);
}

// Issues the paged cp.async copies of key tile t into stage st (zero-filled
// past kv_len or hi, so masked keys hold finite values). Row addresses first:
// one block-table read per key a thread copies, all issued before any copy
// (no dependent load chain), K and V sharing them.
template <class C>
__device__ __forceinline__ void tiled_issue(const FlashParams &P, const TileCtx &x, int t, int st, uint8_t *sRaw,
                                            float *sDs) {
  constexpr int BN = C::BN, RB = C::RB, CPR = C::CPR, RAWLD = C::RAWLD;
  const int tid = threadIdx.x, j0 = x.jfirst + t * BN;
  const int bs_shift = __ffs(P.bs) - 1, bs_mask = P.bs - 1, kvh_bs = x.kvh * P.bs;
  const size_t v_region = (size_t)P.kv_heads * P.bs * RB;
  const uint8_t *rowp[C::CHI];
  bool okv[C::CHI];
#pragma unroll
  for (int i = 0; i < C::CHI; i++) {
    const int c = tid + i * C::NTH, key = c / CPR, cc = c % CPR, j = j0 + key;
    okv[i] = j < x.kv_len && j <= x.hi && (!C::kGuard || c < BN * CPR);
    const int jj = okv[i] ? j : 0; // bt[0] always exists
    rowp[i] = P.cache + (size_t)x.bt[jj >> bs_shift] * P.block_bytes + (size_t)(kvh_bs + (jj & bs_mask)) * RB + cc * 16;
  }
#pragma unroll
  for (int which = 0; which < 2; which++) {
    uint8_t *dst = sRaw + (size_t)(st * 2 + which) * BN * RAWLD;
#pragma unroll
    for (int i = 0; i < C::CHI; i++) {
      const int c = tid + i * C::NTH, key = c / CPR, cc = c % CPR;
      if (C::kGuard && c >= BN * CPR)
        continue;
      cp_async16(dst + key * RAWLD + cc * 16, okv[i] ? rowp[i] + which * v_region : P.cache, okv[i]);
    }
  }
  if constexpr (C::K::kDyn) {
    if (tid < 2 * BN) {
      const int which = tid / BN, key = tid % BN, j = j0 + key;
      const bool ok = j < x.kv_len && j <= x.hi;
      const int jj = ok ? j : 0;
      const uint8_t *src = P.cache + (size_t)x.bt[jj >> bs_shift] * P.block_bytes + 2 * v_region +
                           ((size_t)which * P.kv_heads * P.bs + kvh_bs + (jj & bs_mask)) * 4;
      cp_async4(sDs + (st * 2 + which) * BN + key, ok ? src : P.cache, ok);
    }
  }
  cp_async_commit();
}

// Converts the staged raw tile into the operand tiles (registers in between):
// stored values, exact in the operand dtype; scales and zero points are
// applied elsewhere (scores, P, O).
template <class C, int ODT>
__device__ __forceinline__ void tiled_dequant_one(const uint8_t *raw, uint16_t *dst) {
  using A = Act<ODT>;
  constexpr int BN = C::BN, CPR = C::CPR, EPC = C::EPC, LD = C::LD, RAWLD = C::RAWLD;
  {
#pragma unroll
    for (int i = 0; i < C::CHI; i++) {
      const int c = threadIdx.x + i * C::NTH, key = c / CPR, col = (c % CPR) * EPC;
      if (C::kGuard && c >= BN * CPR)
        continue;
      const uint4 rv = *reinterpret_cast<const uint4 *>(raw + key * RAWLD + (c % CPR) * 16);
      uint32_t packed[EPC / 2];
#pragma unroll
      for (int e = 0; e < EPC; e += 2) {
        if constexpr (C::K::kFp8) {
          packed[e / 2] = pair8<C::KV, ODT>((&rv.x)[e >> 2], (&rv.x)[e >> 2], e & 3, (e & 3) + 1);
        } else if constexpr (C::K::k16) {
          packed[e / 2] = word16<C::KV, ODT>((&rv.x)[e >> 1]);
        } else {
          packed[e / 2] = A::pack2(chunk_elem<C::KV>(rv, e), chunk_elem<C::KV>(rv, e + 1));
        }
      }
#pragma unroll
      for (int q4 = 0; q4 < EPC / 8; q4++)
        reinterpret_cast<uint4 *>(dst + key * LD + col)[q4] =
            make_uint4(packed[q4 * 4], packed[q4 * 4 + 1], packed[q4 * 4 + 2], packed[q4 * 4 + 3]);
    }
  }
}

// K in the activation dtype (the Q K product), V in C::PDT (the P V product).
template <class C> __device__ __forceinline__ void tiled_dequant(const uint8_t *sRawStage, uint16_t *sOp) {
  tiled_dequant_one<C, C::DT>(sRawStage, sOp);
  tiled_dequant_one<C, C::PDT>(sRawStage + (size_t)C::BN * C::RAWLD, sOp + C::BN * C::LD);
}

// Per-warp online softmax state: rows lane/4 and lane/4 + 8 of the warp's 16.
template <class C> struct TileAcc {
  float o[C::NT][4];
  float m[2], l[2], lt[2];
  float sig; // kSigma: the power of two V's scales are taken relative to
};

// One key tile for one warp: S = Q K^T, mask, online softmax, O += P V.
template <class C>
__device__ __forceinline__ void tiled_tile(const FlashParams &P, const TileCtx &x, const uint16_t *sQ,
                                           const uint16_t *sQlo, const uint16_t *sK, const uint16_t *sV,
                                           const float *sDsStage, int j0, bool need_mask, const int *prow,
                                           const float *zrow, TileAcc<C> &acc) {
  using A = Act<C::PDT>; // P's dtype
  constexpr int BN = C::BN, D = C::D, LD = C::LD;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, qr0 = warp * 16;
  float s[BN / 8][4];
#pragma unroll
  for (int i = 0; i < BN / 8; i++)
    s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
  for (int kd = 0; kd < D; kd += 16) {
    uint32_t a[4], al[4];
    ldsm_x4(a[0], a[1], a[2], a[3], sQ + (qr0 + (lane & 15)) * LD + kd + (lane >> 4) * 8);
    if (x.lo_pass)
      ldsm_x4(al[0], al[1], al[2], al[3], sQlo + (qr0 + (lane & 15)) * LD + kd + (lane >> 4) * 8);
#pragma unroll
    for (int n0 = 0; n0 < BN; n0 += 16) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4(b0, b1, b2, b3, sK + (n0 + (lane & 7) + (lane >> 4) * 8) * LD + kd + ((lane >> 3) & 1) * 8);
      mma16816<C::DT>(s[n0 / 8], a, b0, b1);
      mma16816<C::DT>(s[n0 / 8 + 1], a, b2, b3);
      if (x.lo_pass) {
        mma16816<C::DT>(s[n0 / 8], al, b0, b1);
        mma16816<C::DT>(s[n0 / 8 + 1], al, b2, b3);
      }
    }
  }
  // Scale into the exp2 domain, soft-cap (a branch per tile, uniform over
  // the CTA: the plain path pays one test), mask, online softmax.
#pragma unroll
  for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      float v = s[nt][e] * x.sl2;
      if constexpr (C::K::kDyn)
        v *= sDsStage[nt * 8 + (lane & 3) * 2 + (e & 1)];
      s[nt][e] = v;
    }
  if (P.cap2 > 0.f) { // window and cap from the parameters (constant bank)
#pragma unroll
    for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        s[nt][e] = softcap2(s[nt][e], P.cap2, P.icap2, zrow[e >> 1]);
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      float v = s[nt][e];
      if (need_mask) {
        const int j = j0 + nt * 8 + (lane & 3) * 2 + (e & 1);
        const bool vis = j >= x.lo && j <= x.hi &&
                         visible(x.it.mask_kind, x.it.mask_param, x.it.causal, x.iv, x.kv_len, prow[e >> 1], j,
                                 P.window);
        if (!vis)
          v = -INFINITY;
      }
      s[nt][e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
  float alpha[2], beta = 1.f, vinv = 1.f;
  if constexpr (C::kSigma) {
    float vm = 0.f;
#pragma unroll
    for (int nt = 0; nt < BN / 8; nt++)
      vm = fmaxf(vm, fmaxf(sDsStage[BN + nt * 8 + (lane & 3) * 2], sDsStage[BN + nt * 8 + (lane & 3) * 2 + 1]));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 1));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 2));
    const float sn = fmaxf(acc.sig, pow2_ceil(vm));
    beta = acc.sig / sn; // exact: powers of two; 0 before the first tile
    acc.sig = sn;
    vinv = 1.f / sn;
  }
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
    mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
    float mnew;
    const float mref = softmax_ref(acc.m[ri], mx[ri], mnew);
    alpha[ri] = ex2(acc.m[ri] - mref);
    acc.m[ri] = mnew;
    mx[ri] = mref;
  }
  float rs[2] = {0.f, 0.f}, rt[2] = {0.f, 0.f};
  uint32_t pa[BN / 16][4];
#pragma unroll
  for (int nt = 0; nt < BN / 8; nt++) {
    // P' = P 2^kPShift, the shift added after the difference (exact).
    const float p0 = ex2((s[nt][0] - mx[0]) + C::kPShift), p1 = ex2((s[nt][1] - mx[0]) + C::kPShift);
    const float p2 = ex2((s[nt][2] - mx[1]) + C::kPShift), p3 = ex2((s[nt][3] - mx[1]) + C::kPShift);
    rs[0] += p0 + p1;
    rs[1] += p2 + p3;
    uint32_t w0, w1;
    if constexpr (C::K::kDyn) {
      const float *vs = sDsStage + BN + nt * 8 + (lane & 3) * 2;
      const float v0 = vs[0] * vinv, v1 = vs[1] * vinv;
      w0 = A::pack2(p0 * v0, p1 * v1);
      w1 = A::pack2(p2 * v0, p3 * v1);
    } else {
      w0 = A::pack2(p0, p1);
      w1 = A::pack2(p2, p3);
    }
    if constexpr (!C::K::kDyn) {
      rt[0] += op_half<C::PDT>(w0, false) + op_half<C::PDT>(w0, true);
      rt[1] += op_half<C::PDT>(w1, false) + op_half<C::PDT>(w1, true);
    }
    pa[nt / 2][(nt & 1) * 2 + 0] = w0;
    pa[nt / 2][(nt & 1) * 2 + 1] = w1;
  }
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    acc.l[ri] = acc.l[ri] * alpha[ri] + rs[ri];
    acc.lt[ri] = acc.lt[ri] * alpha[ri] + rt[ri];
  }
  const float r0 = alpha[0] * beta, r1 = alpha[1] * beta;
#pragma unroll
  for (int i = 0; i < C::NT; i++) {
    acc.o[i][0] *= r0;
    acc.o[i][1] *= r0;
    acc.o[i][2] *= r1;
    acc.o[i][3] *= r1;
  }
  // O += P V
#pragma unroll
  for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
    for (int n0 = 0; n0 < D; n0 += 16) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(b0, b1, b2, b3, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n0 + (lane >> 4) * 8);
      mma16816<C::PDT>(acc.o[n0 / 8], pa[kk], b0, b1);
      mma16816<C::PDT>(acc.o[n0 / 8 + 1], pa[kk], b2, b3);
    }
}

// Normalizes and writes a warp's 16 rows (the output, or a split part).
template <class C>
__device__ __forceinline__ void tiled_write(const FlashParams &P, const TileCtx &x, const float *sScale,
                                            const float *sC, int split, TileAcc<C> &acc) {
  using A = Act<C::DT>;
  constexpr int D = C::D, NT = C::NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = P.group;
  const int wv0 = x.v0 + warp * 16;
  const float *sink =
      P.sinks && (P.items[blockIdx.x / P.kv_heads].flags & ATTND_ITEM_SINK) && (P.nsplit <= 1 || split == 0) ? P.sinks
                                                                                                : nullptr;
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    acc.l[ri] += __shfl_xor_sync(0xffffffffu, acc.l[ri], 1);
    acc.l[ri] += __shfl_xor_sync(0xffffffffu, acc.l[ri], 2);
    if constexpr (!C::K::kDyn) {
      acc.lt[ri] += __shfl_xor_sync(0xffffffffu, acc.lt[ri], 1);
      acc.lt[ri] += __shfl_xor_sync(0xffffffffu, acc.lt[ri], 2);
    }
  }
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    const int vv = wv0 + (lane >> 2) + ri * 8;
    if (vv >= x.vend)
      continue;
    const int row = x.it.q_row + vv / G, h = x.kvh * G + vv % G;
    // O is normalized by the sum of P as rounded for the matrix units (but
    // for the dynamic types, whose P carries V's scale): lset is its log,
    // the weight of this part in a merge. lse is the same log, not that of
    // the unrounded sum, so that a client merging parts by lse weights each
    // output by the sum it was divided by (docs/numerics.md, merging).
    const bool any = acc.l[ri] > 0.f;
    const float ln = C::K::kDyn ? acc.l[ri] : acc.lt[ri];
    const float inv = any ? (C::kSigma ? acc.sig : 1.f) / ln : 0.f;
    // The sums hold P 2^kPShift: the shift comes off their logs (exact), not off m.
    // (Capped int4 scores hold the zero-point term: softcap2.)
    const float ref = acc.m[ri] - (C::K::kI4 && P.cap2 == 0.f ? sC[warp * 16 + (lane >> 2) + ri * 8] : 0.f);
    float lset = any ? (ref + (log2f(ln) - C::kPShift)) * 0.69314718055994531f : -INFINITY;
    float lse = lset;
    // The sink joins the row once: here when it is not split, else in part 0.
    const float wsk = sink ? sink_join(sink[h], lse, lset) : 1.f;
    float o[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int k = 0; k < 2; k++) {
        const int d = nt * 8 + (lane & 3) * 2 + k;
        float v = acc.o[nt][ri * 2 + k] * inv;
        if constexpr (C::K::kI4)
          v = any ? (v - sScale[D + d]) * sScale[d] : 0.f; // s (sum P~ u / sum P~ - z)
        else if constexpr (C::K::kStatic)
          v *= sScale[d];
        o[nt][k] = v * wsk;
      }
    const size_t ob = ((size_t)row * P.q_heads + h) * D + (lane & 3) * 2;
    if (P.nsplit > 1) {
      float *dst = P.ws_o + (size_t)split * P.total_q * P.q_heads * D + ob;
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
        *reinterpret_cast<float2 *>(dst + nt * 8) = make_float2(o[nt][0], o[nt][1]);
      if ((lane & 3) == 0) {
        const size_t li = ((size_t)split * P.total_q + row) * P.q_heads + h;
        P.ws_lse[li] = lse;
        P.ws_lse[(size_t)P.nsplit * P.total_q * P.q_heads + li] = lset;
      }
    } else {
      if (P.out_fp32) {
        float *dst = reinterpret_cast<float *>(P.out) + ob;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
          *reinterpret_cast<float2 *>(dst + nt * 8) = make_float2(o[nt][0], o[nt][1]);
      } else {
        uint32_t *dst = reinterpret_cast<uint32_t *>(reinterpret_cast<typename A::T *>(P.out) + ob);
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
          dst[nt * 4] = A::pack2(o[nt][0], o[nt][1]);
      }
      if (P.lse && (lane & 3) == 0)
        P.lse[(size_t)row * P.q_heads + h] = lse;
    }
  }
}

template <int D, int DT, int KV>
__global__ void __launch_bounds__(256) flash_kernel(const __grid_constant__ FlashParams P) {
  using C = Tiled<D, DT, KV>;
  using T = typename Act<DT>::T;
  constexpr int BN = C::BN, LD = C::LD, RAWLD = C::RAWLD;
  extern __shared__ __align__(16) uint8_t smem[];
  T *sQ = reinterpret_cast<T *>(smem + C::kQ);
  T *sQlo = reinterpret_cast<T *>(smem + C::kQlo);
  uint8_t *sRaw = smem + C::kRaw;
  uint16_t *sOp = reinterpret_cast<uint16_t *>(smem + C::kOp); // K (activation dtype), V (C::PDT)
  float *sDs = reinterpret_cast<float *>(smem + C::kDs);
  float *sScale = reinterpret_cast<float *>(smem + C::kScale); // v scale, v zero
  uint8_t *sFlags = smem + C::kFlags;                          // bit0: skip, bit1: needs mask
  float *sC = reinterpret_cast<float *>(smem + C::kC), *scratch = sC + C::BM;

  pdl_trigger();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  TileCtx x;
  x.kvh = blockIdx.x % P.kv_heads;
  x.it = P.items[blockIdx.x / P.kv_heads];
  if (x.it.q_row < 0)
    return;
  const int G = P.group;
  x.nvec = x.it.n * G;
  x.v0 = (gridDim.y - 1 - blockIdx.y) * C::BM; // heaviest (last) tiles first
  if (x.v0 >= x.nvec)
    return;
  const int split = blockIdx.z;
  x.kv_len = x.it.start + x.it.n;
  x.vend = min(x.v0 + C::BM, x.nvec);
  x.pmin = x.it.start + x.v0 / G;
  x.pmax = x.it.start + (x.vend - 1) / G;
  x.iv = x.it.mask_kind == ATTND_MASK_INTERVALS ? P.meta + x.it.intervals : nullptr;
  x.bt = P.meta + x.it.block_table;
  key_range(x.it, x.pmin, x.pmax, P.window, x.lo, x.hi);
  if (P.nsplit > 1) {
    const int b0 = P.window > 0 ? x.lo : 0; // a sliding layer's parts cover its window only
    x.lo = max(x.lo, b0 + split * P.split_keys);
    x.hi = min(x.hi, b0 + (split + 1) * P.split_keys - 1);
  }
  x.jfirst = (x.lo / BN) * BN;
  x.ntiles = x.hi >= x.jfirst ? (x.hi - x.jfirst) / BN + 1 : 0;
  const bool no_load = P.debug & 1, no_math = P.debug & 2; // timing experiments only

  // Static K scale: per kv head in the score scale; per channel in q (hi + lo).
  x.sl2 = P.scale_log2;
  x.lo_pass = false;
  float rscale = 1.f;
  if constexpr (C::K::kStatic) {
    if (KV == ATTND_KV_INT4 || P.per_channel) {
      x.lo_pass = true;
      float mx = 0.f;
      for (int d = tid; d < D; d += C::NTH)
        mx = fmaxf(mx, P.k_scale[x.kvh * D + d]);
#pragma unroll
      for (int s = 16; s; s >>= 1)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, s));
      if (lane == 0)
        scratch[warp] = mx;
      __syncthreads();
      for (int w = 0; w < C::NW; w++)
        mx = fmaxf(mx, scratch[w]);
      const int e = scale_exp(mx);
      rscale = ldexpf(1.f, -e);
      x.sl2 = ldexpf(x.sl2, e);
    } else {
      x.sl2 *= P.k_scale[x.kvh];
    }
  }
  pdl_wait(); // q and the cache are written by the previous kernel
  tiled_load_q<C>(P, x, rscale, sQ, sQlo);
  if constexpr (C::K::kStatic)
    for (int i = tid; i < D; i += C::NTH) {
      sScale[i] = (KV == ATTND_KV_INT4 || P.per_channel) ? P.v_scale[x.kvh * D + i] : P.v_scale[x.kvh];
      if constexpr (KV == ATTND_KV_INT4)
        sScale[D + i] = P.v_zero[x.kvh * D + i];
    }
  if (x.it.mask_kind == ATTND_MASK_INTERVALS)
    tiled_classify<C>(P, x, sFlags);
  __syncthreads();
  if constexpr (KV == ATTND_KV_INT4) {
    // q'.(u - z) = q'.u - q'.z: the second term is the same for every key of
    // a row, so the scores leave it out and the lse takes it out (fp64 sum).
    if (tid < C::BM) {
      double c = 0.0;
      for (int d = 0; d < D; d++)
        c += ((double)Act<DT>::to_f(sQ[tid * LD + d]) + (double)Act<DT>::to_f(sQlo[tid * LD + d])) *
             (double)P.k_zero[x.kvh * D + d];
      sC[tid] = (float)(c * (double)x.sl2);
    }
    __syncthreads(); // read by other warps at the end, also when no key tile runs
  }

  auto tile_skip = [&](int t) -> bool {
    return x.it.mask_kind == ATTND_MASK_INTERVALS && t < kMaxTileFlags && (sFlags[t] & 1);
  };
  auto next_tile = [&](int t) -> int { // first live tile index >= t, or ntiles
    while (t < x.ntiles && tile_skip(t))
      t++;
    return t;
  };
  auto issue = [&](int t, int st) {
    if (no_load)
      cp_async_commit();
    else
      tiled_issue<C>(P, x, t, st, sRaw, sDs);
  };

  TileAcc<C> acc;
#pragma unroll
  for (int i = 0; i < C::NT; i++)
    acc.o[i][0] = acc.o[i][1] = acc.o[i][2] = acc.o[i][3] = 0.f;
  const int wv0 = x.v0 + warp * 16;
  const bool warp_live = wv0 < x.vend;
  int prow[2];
  float zrow[2]; // int4 under soft-capping: the rows' K zero-point terms (softcap2)
  acc.sig = 0.f;
#pragma unroll
  for (int i = 0; i < 2; i++) {
    acc.m[i] = -INFINITY;
    acc.l[i] = acc.lt[i] = 0.f;
    prow[i] = x.it.start + min(wv0 + (lane >> 2) + i * 8, x.vend - 1) / G;
    zrow[i] = C::K::kI4 ? sC[warp * 16 + (lane >> 2) + i * 8] : 0.f;
  }

  int t = next_tile(0), stage = 0;
  if (t < x.ntiles)
    issue(t, 0);
  while (t < x.ntiles) {
    const int tn = next_tile(t + 1);
    if (tn < x.ntiles) {
      issue(tn, stage ^ 1); // prefetch the next live tile while this one computes
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int j0 = x.jfirst + t * BN;
    const bool need_mask = x.it.mask_kind == ATTND_MASK_INTERVALS
                               ? t >= kMaxTileFlags || (sFlags[t] & 2)
                               : tile_needs_mask(x.it, x.pmin, x.pmax, x.lo, x.hi, j0, BN, P.window);
    const uint16_t *sK, *sV;
    if constexpr (C::kDirect) {
      sK = reinterpret_cast<const uint16_t *>(sRaw + (size_t)(stage * 2) * BN * RAWLD);
      sV = reinterpret_cast<const uint16_t *>(sRaw + (size_t)(stage * 2 + 1) * BN * RAWLD);
    } else {
      tiled_dequant<C>(sRaw + (size_t)(stage * 2) * BN * RAWLD, sOp);
      __syncthreads();
      sK = sOp;
      sV = sOp + BN * LD;
    }
    if (warp_live && !no_math)
      tiled_tile<C>(P, x, reinterpret_cast<const uint16_t *>(sQ), reinterpret_cast<const uint16_t *>(sQlo), sK, sV,
                    sDs + stage * 2 * BN, j0, need_mask, prow, zrow, acc);
    __syncthreads(); // the stage and operand tiles are rewritten next
    t = tn;
    stage ^= 1;
  }
  if (warp_live)
    tiled_write<C>(P, x, sScale, sC, split, acc);
}

template <int D, int DT, int KV>
cudaError_t launch_flash(const FlashParams &p, int nitems, cudaStream_t st) {
  using C = Tiled<D, DT, KV>;
  const bool lo = KvT<KV>::kStatic && (KV == ATTND_KV_INT4 || p.per_channel);
  const size_t smem = C::kBytes + (lo ? (size_t)C::BM * C::LD * 2 : 0);
  static bool attr_done = false; // per instantiation; benign race: both set the same value
  if (!attr_done) {
    const size_t most = C::kBytes + (KvT<KV>::kStatic ? (size_t)C::BM * C::LD * 2 : 0);
    cudaError_t e = cudaFuncSetAttribute(flash_kernel<D, DT, KV>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)most);
    if (e != cudaSuccess)
      return e;
    attr_done = true;
  }
  const long tiles = ((long)p.max_vec + C::BM - 1) / C::BM;
  if (tiles > 65535)
    return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)(nitems * p.kv_heads), (unsigned)tiles, (unsigned)p.nsplit);
  return launch_ex(flash_kernel<D, DT, KV>, grid, dim3(C::NTH), smem, p.pdl != 0, st, p);
}

} // namespace attnd

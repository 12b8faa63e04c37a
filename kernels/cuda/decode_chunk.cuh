// decode_chunk.cuh: one 16-key chunk of the decode kernel for one warp, in
// its two forms (decode_kernel.cuh): the scores on tensor cores, the mask,
// the online softmax and the P V product.
#pragma once

#include "decode_layout.cuh"

namespace attnd {

// What a warp needs to score one chunk.
struct DecPiece {
  const int32_t *iv; // interval mask or NULL
  int kind, mp, causal, kv_len;
  int klo, khi;      // keys of this piece
  int prow[2];       // absolute positions of this lane's two vectors
  float sl2;         // score scale into the exp2 domain (static K scale, q's power of two folded in)
  float zc[2];       // int4 under soft-capping: K zero-point terms of this lane's two vectors
  bool qlo_cols;     // TR: columns 4..7 hold the lo halves of vectors 0..3
  bool lo_pass;      // a second product with the lo halves of q
};

// Per-lane online softmax state.
template <class C> struct DecAcc {
  float o[C::NO][4];
  float m[2], l[2], lt[2]; // running max (exp2 domain), sum of P, sum of P as rounded (!kDyn)
  float sig;               // kSigma: the power of two V's scales are taken relative to
};

// P' (times V's scale) as a P V operand: rounded to PDT, or under kPv16 to
// bf16 first (the tiled kernel's operand) and then carried exactly in fp16
// (decode_layout.cuh, Dec::kPv16).
template <class C> __device__ __forceinline__ typename Act<C::PDT>::T dec_pop(float x) {
  if constexpr (C::kPv16)
    return Act<C::PDT>::from_f(__bfloat162float(__float2bfloat16_rn(x)));
  else
    return Act<C::PDT>::from_f(x);
}
template <class C> __device__ __forceinline__ uint32_t dec_ppack2(float lo, float hi) {
  if constexpr (C::kPv16)
    return Act<C::PDT>::pack2(__bfloat162float(__float2bfloat16_rn(lo)),
                              __bfloat162float(__float2bfloat16_rn(hi)));
  else
    return Act<C::PDT>::pack2(lo, hi);
}

// The chunks of a piece that need the per-element mask, as two bounds: chunk
// [j0, j0 + n) needs it iff j0 < lo or j0 + n - 1 > hi, the same predicate as
// tile_needs_mask (primitives.cuh) term by term, computed once per piece (the
// per-chunk test is ~12 integer instructions of every chunk: 838 -> 814 SASS
// instructions in the int8_dynamic key loop, its masked path left out). The
// static 8-bit types and int4 keep the per-chunk test (dec_piece). Interval
// masks: every chunk (lo = INT_MAX).
struct DecMaskBounds {
  int lo, hi;
};
__device__ __forceinline__ DecMaskBounds dec_mask_bounds(const attnd_kitem_t &it, int pmin, int pmax, int klo,
                                                         int khi, int win) {
  const int kind = it.mask_kind, mp = it.mask_param;
  DecMaskBounds b;
  b.lo = klo;                                // j0 < lo
  b.hi = min(khi, it.start + it.n - 1);      // j1 > hi, j1 >= kv_len
  if (win > 0)
    b.lo = max(b.lo, pmax - win + 1);        // j0 <= pmax - win
  if (kind == ATTND_MASK_CAUSAL || kind == ATTND_MASK_SLIDING)
    b.hi = min(b.hi, pmin);                  // j1 > pmin
  if (kind == ATTND_MASK_SLIDING)
    b.lo = max(b.lo, pmax - mp + 1);         // j0 < pmax - mp + 1
  if (kind == ATTND_MASK_PREFIX_LM)
    b.hi = min(b.hi, max(pmin, mp - 1));     // j1 > pmin && j1 >= mp
  if (kind == ATTND_MASK_INTERVALS)
    b.lo = 0x7fffffff;
  return b;
}

// Masks one score of key j for the vector at absolute position p. The layer's
// window and soft-cap are read from the kernel parameters (constant bank, no
// registers held through the key loop).
__device__ __forceinline__ float dec_mask(const DecodeParams &P, const DecPiece &pc, float x, int j, int p) {
  return j >= pc.klo && j <= pc.khi && visible(pc.kind, pc.mp, pc.causal, pc.iv, pc.kv_len, p, j, P.window)
             ? x
             : -INFINITY;
}

// 1 / x for a power of two x in [2^-126, 2^126] (exact; kSigma's references
// stay below 2^122: a dynamic scale is at most FLT_MAX / 127), by its bits:
// no division and its slow-path call per chunk.
__device__ __forceinline__ float pow2_rcp(float x) { return __uint_as_float(0x7f000000u - __float_as_uint(x)); }

// kSigma: raises the warp's V-scale reference to cover this chunk's largest
// scale (vmax, already reduced over the warp); returns the factor O is
// rescaled by (exact: a ratio of powers of two; 0 before the first chunk).
template <class C> __device__ __forceinline__ float dec_sigma(DecAcc<C> &acc, float vmax) {
  const float sn = fmaxf(acc.sig, pow2_ceil(vmax));
  const float beta = acc.sig / sn;
  acc.sig = sn;
  return beta;
}

// S^T = K q^T of one chunk (transposed form). LO: a second product with the
// lo halves of q (rows 8..15 of sQ); a template argument so that the
// one-product path issues no predicated-off HMMA. The converted types split
// the head dim's 16-column steps over two accumulators (sa even, sb2 odd:
// half the dependency chain). The 16-bit caches keep one chain, the steps in
// order as the prefill kernel's Q K^T takes them: a prefix hit's few rows,
// which come here, then stay within ulps of the full step's prefill (two
// chains moved a score by an ulp, which flipped a P's bf16 rounding now and
// then: up to 1.2e-4 rel L2 between a hit and the full step at d256; one
// chain: <= 2.3e-7 on an H100, bench/RESULTS.md).
template <class C, bool LO>
__device__ __forceinline__ void dec_scores_tr(const uint8_t *sK, const uint32_t (*qb)[2],
                                              const typename Act<C::KDT>::T *sQ, float *sa, float *sb2) {
  constexpr int LD = C::LD;
  const int lane = threadIdx.x & 31, g = lane >> 2, c4 = lane & 3;
#pragma unroll
  for (int p = 0; p < C::NKP; p++) {
    uint32_t w0[C::KPW], w1[C::KPW];
    k_piece<C>(sK, g, c4, p, w0);
    k_piece<C>(sK, g + 8, c4, p, w1);
#pragma unroll
    for (int u = 0; u < C::TPP; u += 2) {
      const int t = p * C::TPP + u;
      uint32_t ql[4];
      if constexpr (LO)
        ldsm_x4(ql[0], ql[1], ql[2], ql[3],
                sQ + (8 + (lane & 7)) * LD + t * 16 + ((lane >> 3) & 1) * 8 + (lane >> 4) * 16);
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const uint32_t a[4] = {k_op<C>(w0, u + h, 0), k_op<C>(w1, u + h, 0), k_op<C>(w0, u + h, 1),
                               k_op<C>(w1, u + h, 1)};
        float *acc = (h && !C::K::k16) ? sb2 : sa;
        mma16816<C::KDT>(acc, a, qb[t + h][0], qb[t + h][1]);
        if constexpr (LO)
          mma16816<C::KDT>(acc, a, ql[2 * h], ql[2 * h + 1]);
      }
    }
  }
}

// One chunk in the transposed form: S^T = K q^T, online softmax, O^T += V^T P^T.
// MASK: the chunk needs the per-element mask (tile_needs_mask); a template
// argument, so that the unmasked chunks (nearly all) carry none of its code
// (~60 instructions of the mask's address and range arithmetic were left in
// the unmasked path of a runtime flag).
template <class C, bool MASK>
__device__ __forceinline__ void dec_chunk_tr(const DecodeParams &P, const DecPiece &pc, const uint8_t *sb,
                                             const uint32_t (*qb)[2], const typename Act<C::KDT>::T *sQ,
                                             typename Act<C::PDT>::T *sP, int j0, DecAcc<C> &acc) {
  using PA = Act<C::PDT>;
  constexpr int KS = C::KS;
  const int lane = threadIdx.x & 31, g = lane >> 2, c4 = lane & 3;
  const uint8_t *sK = sb, *sV = sb + KS * C::RB;
  const float *sKs = reinterpret_cast<const float *>(sb + 2 * KS * C::RB), *sVsc = sKs + KS;

  // S^T: 16 keys x 8 vectors (sb2: the odd steps of the converted types).
  float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb2[4] = {0.f, 0.f, 0.f, 0.f};
  if constexpr (C::K::kStatic) {
    if (pc.lo_pass)
      dec_scores_tr<C, true>(sK, qb, sQ, sa, sb2);
    else
      dec_scores_tr<C, false>(sK, qb, sQ, sa, sb2);
  } else {
    dec_scores_tr<C, false>(sK, qb, sQ, sa, sb2);
  }
  // Element e: key g + 8 (e >> 1), vector 2c + (e & 1). Soft-capping: a
  // branch per chunk, uniform over the CTA.
  if constexpr (!C::K::k16) {
#pragma unroll
    for (int e = 0; e < 4; e++)
      sa[e] += sb2[e];
  }
  if (C::K::kStatic && pc.qlo_cols) {
#pragma unroll
    for (int e = 0; e < 4; e++)
      sa[e] += __shfl_xor_sync(0xffffffffu, sa[e], 2); // lane c ^ 2 holds the other half
  }
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int key = g + 8 * (e >> 1);
    float x = sa[e] * pc.sl2;
    if constexpr (C::K::kDyn)
      x *= sKs[key];
    sa[e] = x;
  }
  if (P.cap2 > 0.f) {
#pragma unroll
    for (int e = 0; e < 4; e++)
      sa[e] = softcap2(sa[e], P.cap2, P.icap2, pc.zc[e & 1]);
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int key = g + 8 * (e >> 1);
    float x = sa[e];
    if constexpr (MASK)
      x = dec_mask(P, pc, x, j0 + key, pc.prow[e & 1]);
    sa[e] = x;
    mx[e & 1] = fmaxf(mx[e & 1], x);
  }
  float alpha[2], beta = 1.f, vinv = 1.f;
  if constexpr (C::kSigma) {
    float vm = fmaxf(sVsc[g], sVsc[g + 8]);
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 4));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 8));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 16));
    beta = dec_sigma(acc, vm);
    vinv = pow2_rcp(acc.sig);
  }
#pragma unroll
  for (int vi = 0; vi < 2; vi++) {
    mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 4));
    mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 8));
    mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 16));
    float mnew;
    const float mref = softmax_ref(acc.m[vi], mx[vi], mnew);
    alpha[vi] = ex2(acc.m[vi] - mref);
    acc.m[vi] = mnew;
    mx[vi] = mref;
  }
  // P^T to the warp's [vector][key] tile (the B operand wants keys along a
  // lane's register pair), V's per-token scale folded in.
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int key = g + 8 * (e >> 1), v = 2 * c4 + (e & 1), vi = e & 1;
    const float pe = ex2((sa[e] - mx[vi]) + C::kPShift); // P' = P 2^kPShift (shift after the difference: exact)
    acc.l[vi] = (e >> 1) ? acc.l[vi] + pe : acc.l[vi] * alpha[vi] + pe;
    float pv = pe;
    if constexpr (C::K::kDyn)
      pv *= C::kSigma ? sVsc[key] * vinv * C::kVShift : sVsc[key];
    const typename PA::T pr = dec_pop<C>(pv);
    sP[v * KS + key] = pr;
    if constexpr (!C::K::kDyn)
      acc.lt[vi] = (e >> 1) ? acc.lt[vi] + PA::to_f(pr) : acc.lt[vi] * alpha[vi] + PA::to_f(pr);
  }
  __syncwarp();
  const uint32_t pb0 = *reinterpret_cast<const uint32_t *>(sP + g * KS + 2 * c4);
  const uint32_t pb1 = *reinterpret_cast<const uint32_t *>(sP + g * KS + 2 * c4 + 8);
  // Past the first chunks the running max rarely moves: alpha is then exactly
  // 1 and the rescale of O is skipped (same result).
  const float r0 = alpha[0] * beta, r1 = alpha[1] * beta;
  if (__any_sync(0xffffffffu, r0 != 1.f || r1 != 1.f)) {
#pragma unroll
    for (int i = 0; i < C::NO; i++) {
      acc.o[i][0] *= r0;
      acc.o[i][1] *= r1;
      acc.o[i][2] *= r0;
      acc.o[i][3] *= r1;
    }
  }
  // O^T += V^T P^T: m-tile mt holds channels 2 mt (row g) and 2 mt + 1 (row
  // g + 8) of this lane's slice.
#pragma unroll
  for (int p = 0; p < C::NVP; p++) {
    uint32_t x[4][C::VPW];
#pragma unroll
    for (int k = 0; k < 4; k++)
      v_piece<C>(sV, 2 * c4 + (k & 1) + (k >> 1) * 8, g, p, x[k]);
#pragma unroll
    for (int jj = 0; jj < C::CPP; jj += 2) {
      const uint32_t a[4] = {v_pair<C>(x[0], x[1], jj), v_pair<C>(x[0], x[1], jj + 1), v_pair<C>(x[2], x[3], jj),
                             v_pair<C>(x[2], x[3], jj + 1)};
      mma16816<C::PDT>(acc.o[(p * C::CPP + jj) / 2], a, pb0, pb1);
    }
  }
}

// Two chunks of a warp in the transposed form (Dec::kPair): chunks A (keys
// from j0, stage sbA) and B (from j1, stage sbB) scored as two independent
// products, one running-max update and one O rescale for both, P^T of both
// to the warp's two [vector][key] tiles (sP, sP + 8 KS), then O^T += V^T P^T
// over both. The reference m is an integer (softmax_ref), so P' of a key is
// the single-chunk loop's value whenever both loops reach the same m; only
// the order of the normalizer's additions differs.
template <class C, bool MASK>
__device__ __forceinline__ void dec_chunk2_tr(const DecodeParams &P, const DecPiece &pc, const uint8_t *sbA,
                                              const uint8_t *sbB, const uint32_t (*qb)[2],
                                              const typename Act<C::KDT>::T *sQ, typename Act<C::PDT>::T *sP,
                                              int j0, int j1, DecAcc<C> &acc) {
  using PA = Act<C::PDT>;
  constexpr int KS = C::KS;
  const int lane = threadIdx.x & 31, g = lane >> 2, c4 = lane & 3;
  const uint8_t *sbs[2] = {sbA, sbB};
  const int js[2] = {j0, j1};

  float s[2][4];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float t2[4] = {0.f, 0.f, 0.f, 0.f};
    s[h][0] = s[h][1] = s[h][2] = s[h][3] = 0.f;
    if constexpr (C::K::kStatic) {
      if (pc.lo_pass)
        dec_scores_tr<C, true>(sbs[h], qb, sQ, s[h], t2);
      else
        dec_scores_tr<C, false>(sbs[h], qb, sQ, s[h], t2);
    } else {
      dec_scores_tr<C, false>(sbs[h], qb, sQ, s[h], t2);
    }
#pragma unroll
    for (int e = 0; e < 4; e++)
      s[h][e] += t2[e];
  }
  if (C::K::kStatic && pc.qlo_cols) {
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        s[h][e] += __shfl_xor_sync(0xffffffffu, s[h][e], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const float *sKs = reinterpret_cast<const float *>(sbs[h] + 2 * KS * C::RB);
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = g + 8 * (e >> 1);
      float x = s[h][e] * pc.sl2;
      if constexpr (C::K::kDyn)
        x *= sKs[key];
      s[h][e] = x;
    }
  }
  if (P.cap2 > 0.f) {
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        s[h][e] = softcap2(s[h][e], P.cap2, P.icap2, pc.zc[e & 1]);
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int h = 0; h < 2; h++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = g + 8 * (e >> 1);
      float x = s[h][e];
      if constexpr (MASK)
        x = dec_mask(P, pc, x, js[h] + key, pc.prow[e & 1]);
      s[h][e] = x;
      mx[e & 1] = fmaxf(mx[e & 1], x);
    }
  float alpha[2], beta = 1.f, vinv = 1.f;
  if constexpr (C::kSigma) {
    const float *va = reinterpret_cast<const float *>(sbA + 2 * KS * C::RB) + KS;
    const float *vb = reinterpret_cast<const float *>(sbB + 2 * KS * C::RB) + KS;
    float vm = fmaxf(fmaxf(va[g], va[g + 8]), fmaxf(vb[g], vb[g + 8]));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 4));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 8));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 16));
    beta = dec_sigma(acc, vm);
    vinv = pow2_rcp(acc.sig);
  }
#pragma unroll
  for (int vi = 0; vi < 2; vi++) {
    mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 4));
    mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 8));
    mx[vi] = fmaxf(mx[vi], __shfl_xor_sync(0xffffffffu, mx[vi], 16));
    float mnew;
    const float mref = softmax_ref(acc.m[vi], mx[vi], mnew);
    alpha[vi] = ex2(acc.m[vi] - mref);
    acc.m[vi] = mnew;
    mx[vi] = mref;
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const float *sVsc = reinterpret_cast<const float *>(sbs[h] + 2 * KS * C::RB) + KS;
    typename PA::T *sPh = sP + h * 8 * KS;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = g + 8 * (e >> 1), v = 2 * c4 + (e & 1), vi = e & 1;
      const bool first = h == 0 && (e >> 1) == 0;
      const float pe = ex2((s[h][e] - mx[vi]) + C::kPShift);
      acc.l[vi] = first ? acc.l[vi] * alpha[vi] + pe : acc.l[vi] + pe;
      float pv = pe;
      if constexpr (C::K::kDyn)
        pv *= C::kSigma ? sVsc[key] * vinv * C::kVShift : sVsc[key];
      const typename PA::T pr = dec_pop<C>(pv);
      sPh[v * KS + key] = pr;
      if constexpr (!C::K::kDyn)
        acc.lt[vi] = first ? acc.lt[vi] * alpha[vi] + PA::to_f(pr) : acc.lt[vi] + PA::to_f(pr);
    }
  }
  __syncwarp();
  uint32_t pb[2][2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    pb[h][0] = *reinterpret_cast<const uint32_t *>(sP + h * 8 * KS + g * KS + 2 * c4);
    pb[h][1] = *reinterpret_cast<const uint32_t *>(sP + h * 8 * KS + g * KS + 2 * c4 + 8);
  }
  const float r0 = alpha[0] * beta, r1 = alpha[1] * beta;
  if (__any_sync(0xffffffffu, r0 != 1.f || r1 != 1.f)) {
#pragma unroll
    for (int i = 0; i < C::NO; i++) {
      acc.o[i][0] *= r0;
      acc.o[i][1] *= r1;
      acc.o[i][2] *= r0;
      acc.o[i][3] *= r1;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const uint8_t *sV = sbs[h] + KS * C::RB;
#pragma unroll
    for (int p = 0; p < C::NVP; p++) {
      uint32_t x[4][C::VPW];
#pragma unroll
      for (int k = 0; k < 4; k++)
        v_piece<C>(sV, 2 * c4 + (k & 1) + (k >> 1) * 8, g, p, x[k]);
#pragma unroll
      for (int jj = 0; jj < C::CPP; jj += 2) {
        const uint32_t a[4] = {v_pair<C>(x[0], x[1], jj), v_pair<C>(x[0], x[1], jj + 1),
                               v_pair<C>(x[2], x[3], jj), v_pair<C>(x[2], x[3], jj + 1)};
        mma16816<C::PDT>(acc.o[(p * C::CPP + jj) / 2], a, pb[h][0], pb[h][1]);
      }
    }
  }
}

// One chunk in the rows form: S = q K^T, online softmax, O += P V (MASK as above).
template <class C, bool MASK>
__device__ __forceinline__ void dec_chunk_rows(const DecodeParams &P, const DecPiece &pc, const uint8_t *sb,
                                               const typename Act<C::KDT>::T *sQ,
                                               const typename Act<C::KDT>::T *sQlo, int j0, DecAcc<C> &acc) {
  using PA = Act<C::PDT>;
  constexpr int KS = C::KS, LD = C::LD;
  const int lane = threadIdx.x & 31, g = lane >> 2, c4 = lane & 3;
  const uint8_t *sK = sb, *sV = sb + KS * C::RB;
  const float *sKs = reinterpret_cast<const float *>(sb + 2 * KS * C::RB), *sVsc = sKs + KS;

  // S: 16 vectors x 16 keys (n-tile nt: keys nt * 8 + g).
  float s[2][4];
#pragma unroll
  for (int i = 0; i < 2; i++)
    s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
  for (int p = 0; p < C::NKP; p++) {
    uint32_t w[2][C::KPW];
    k_piece<C>(sK, g, c4, p, w[0]);
    k_piece<C>(sK, g + 8, c4, p, w[1]);
#pragma unroll
    for (int u = 0; u < C::TPP; u++) {
      const int t = p * C::TPP + u;
      uint32_t a[4];
      ldsm_x4(a[0], a[1], a[2], a[3], sQ + (lane & 15) * LD + t * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int nt = 0; nt < 2; nt++)
        mma16816<C::KDT>(s[nt], a, k_op<C>(w[nt], u, 0), k_op<C>(w[nt], u, 1));
      if (pc.lo_pass) {
        ldsm_x4(a[0], a[1], a[2], a[3], sQlo + (lane & 15) * LD + t * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
          mma16816<C::KDT>(s[nt], a, k_op<C>(w[nt], u, 0), k_op<C>(w[nt], u, 1));
      }
    }
  }
  // Element e of n-tile nt: vector g + 8 (e >> 1), key nt * 8 + 2c + (e & 1).
#pragma unroll
  for (int nt = 0; nt < 2; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = nt * 8 + 2 * c4 + (e & 1);
      float x = s[nt][e] * pc.sl2;
      if constexpr (C::K::kDyn)
        x *= sKs[key];
      s[nt][e] = x;
    }
  if (P.cap2 > 0.f) {
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        s[nt][e] = softcap2(s[nt][e], P.cap2, P.icap2, pc.zc[e >> 1]);
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < 2; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = nt * 8 + 2 * c4 + (e & 1);
      float x = s[nt][e];
      if constexpr (MASK)
        x = dec_mask(P, pc, x, j0 + key, pc.prow[e >> 1]);
      s[nt][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  float alpha[2], beta = 1.f, vinv = 1.f;
  if constexpr (C::kSigma) {
    float vm = fmaxf(fmaxf(sVsc[2 * c4], sVsc[2 * c4 + 1]), fmaxf(sVsc[8 + 2 * c4], sVsc[9 + 2 * c4]));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 1));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 2));
    beta = dec_sigma(acc, vm);
    vinv = pow2_rcp(acc.sig);
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
  float rs[2] = {0.f, 0.f};
  uint32_t pa[4];
  constexpr float sh = C::kPShift; // P' = P 2^kPShift, added after the difference (exact)
#pragma unroll
  for (int nt = 0; nt < 2; nt++) {
    const float p0 = ex2((s[nt][0] - mx[0]) + sh), p1 = ex2((s[nt][1] - mx[0]) + sh);
    const float p2 = ex2((s[nt][2] - mx[1]) + sh), p3 = ex2((s[nt][3] - mx[1]) + sh);
    rs[0] += p0 + p1;
    rs[1] += p2 + p3;
    if constexpr (C::K::kDyn) {
      float2 vs = *reinterpret_cast<const float2 *>(sVsc + nt * 8 + 2 * c4);
      if constexpr (C::kSigma) {
        vs.x = vs.x * vinv * C::kVShift;
        vs.y = vs.y * vinv * C::kVShift;
      }
      pa[nt * 2 + 0] = dec_ppack2<C>(p0 * vs.x, p1 * vs.y);
      pa[nt * 2 + 1] = dec_ppack2<C>(p2 * vs.x, p3 * vs.y);
    } else {
      pa[nt * 2 + 0] = PA::pack2(p0, p1);
      pa[nt * 2 + 1] = PA::pack2(p2, p3);
    }
  }
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    acc.l[ri] = acc.l[ri] * alpha[ri] + rs[ri];
    if constexpr (!C::K::kDyn) {
      const uint32_t r0 = pa[ri], r1 = pa[2 + ri];
      acc.lt[ri] = acc.lt[ri] * alpha[ri] + ((op_half<C::PDT>(r0, false) + op_half<C::PDT>(r0, true)) +
                                             (op_half<C::PDT>(r1, false) + op_half<C::PDT>(r1, true)));
    }
  }
  const float r0 = alpha[0] * beta, r1 = alpha[1] * beta;
  if (__any_sync(0xffffffffu, r0 != 1.f || r1 != 1.f)) {
#pragma unroll
    for (int i = 0; i < C::NO; i++) {
      acc.o[i][0] *= r0;
      acc.o[i][1] *= r0;
      acc.o[i][2] *= r1;
      acc.o[i][3] *= r1;
    }
  }
  // O += P V: n-tile j is channel j of lane g's slice, key rows 2c, 2c+1, 2c+8, 2c+9.
#pragma unroll
  for (int p = 0; p < C::NVP; p++) {
    uint32_t x[4][C::VPW];
#pragma unroll
    for (int k = 0; k < 4; k++)
      v_piece<C>(sV, 2 * c4 + (k & 1) + (k >> 1) * 8, g, p, x[k]);
#pragma unroll
    for (int jj = 0; jj < C::CPP; jj++)
      mma16816<C::PDT>(acc.o[p * C::CPP + jj], pa, v_pair<C>(x[0], x[1], jj), v_pair<C>(x[2], x[3], jj));
  }
}

} // namespace attnd

// decode_kernel.cuh: the decode kernel, for every cache type and head dim:
// items of at most 16 query vectors (n x group) attend over their paged
// cache with the stored bytes converted straight into tensor-core operand
// registers. Included by the generated decode_inst_<kv>.cu files.
//
// A CTA of four warps takes a piece of one (item, kv head): a range of its
// 16-key chunks (decode_params.cuh says how pieces are cut: flat or per-item
// split). Warp w takes chunks w, w + 4, ... of the piece with its own online
// softmax state and its own cp.async stages (no CTA barrier in the key
// loop); the four states are merged by lse through shared memory at the end.
//
// Fragment order without shuffles. S = q.k is a sum over the head dimension,
// so a permutation of d applied to both q and k leaves it unchanged: lane
// (g = lane/4, c = lane%4) reads 16-byte pieces of a key row (chunks 4i + c;
// int4: the contiguous quarter c of the row) and uses their words directly as
// its k-operand registers; q is stored in shared memory with its columns
// permuted the same way (qcol). For O += P V the head dimension is the mma's
// m (transposed form) or n index: lane g owns the physical channels
// [g D/8, (g+1) D/8) of the four key rows {2c, 2c+1, 2c+8, 2c+9} its fragment
// needs, so O's columns come out permuted and are put back in place when the
// warps' results are merged.
//
// Two forms. TR (at most 8 vectors): S^T = K q^T and O^T = V^T P^T, so that
// keys and channels fill the mma's 16 rows and the vectors its 8 columns
// (a GQA-4 decode fills 4 of 16 rows of the other form). Rows (9..16 vectors):
// S = q K^T and O = P V, vectors in the 16 rows.
//
// Numerics (docs/numerics.md): K and V bytes are exact in the operand dtype
// (16-bit caches of the other 16-bit type are converted); per-token scales
// multiply the scores (K) and P (V); a static K scale per kv head multiplies
// the fp32 score scale; per channel it goes into q as an exact hi + lo pair
// (primitives.cuh, scale_exp), the lo half either in the free columns 4..7 of
// a TR product (<= 4 vectors) or in a second product; static V scales
// multiply O. int4: the K zero point is a per-vector constant of the scores,
// dropped from them and taken out of the lse (computed in fp64); V's is taken
// out of O as z * sum(P~) / l, where P~ is P as rounded for the matrix units,
// so O = s sum P~ (u - z) / l with no cancellation of two large terms.
#pragma once

#include "decode_params.cuh"
#include "primitives.cuh"

namespace attnd {

constexpr int dec_clamp(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }
constexpr size_t dec_max(size_t a, size_t b) { return a > b ? a : b; }

// Resident CTAs per SM each instantiation is built for (registers and
// shared memory are sized to it): 16-bit caches move twice the bytes per key
// and need fewer CTAs in flight.
template <int KV, int D> constexpr int dec_minb(bool tr) {
  return KvT<KV>::k16 ? (D == 64 ? 3 : D == 128 ? 2 : 1) : (D == 256 ? 2 : (tr || D == 64) ? 4 : 3);
}

// Sizes and shared-memory layout of one instantiation.
template <int D_, int DT_, int KV_, bool TR_> struct Dec {
  static constexpr int D = D_, DT = DT_, KV = KV_;
  static constexpr bool TR = TR_;
  using K = KvT<KV>;
  static constexpr int KS = kDecKeys, NW = kDecWarps, NTH = NW * 32;
  static constexpr int RB = K::k16 ? 2 * D : K::kI4 ? D / 2 : D; // bytes of one K or V row
  static constexpr int CPR = RB / 16;                            // 16-byte chunks per row
  static constexpr int MV = TR ? 8 : 16;                         // vectors of one product
  static constexpr int NO = TR ? D / 16 : D / 8;                 // O tiles per lane
  static constexpr int LD = D + 8;                               // padded q row: conflict-free ldmatrix
  static constexpr int MINB = dec_minb<KV, D>(TR);
  // Operand dtypes of the two products. fp16 wherever the stored values are
  // exact in it (every cache but bf16): the bytes become operands in one to
  // three instructions per pair instead of the seven of an exact int8 -> bf16
  // conversion. q (bf16 activations) is scaled by a power of two into fp16's
  // range; P goes in as P 2^14 (fp16's subnormals start at 2^-14); the dynamic
  // types' P carries V's scale and keeps the activation dtype (bf16's range),
  // and with fp16 activations it is taken relative to a running power-of-two
  // reference of those scales (kSigma).
  // Static types under bf16 activations keep bf16 for the first product: their
  // q is split into hi + lo exactly as the tiled kernel splits it, so a prefix
  // hit (this kernel) and a full recompute (tiled) see the same scores; with
  // fp16 halves they differed at 2^-17 and P's roundings flipped (1.2e-4
  // against the 1e-4 bound, bench/RESULTS.md decode round 3).
  static constexpr int KDT =
      DT == ATTND_DT_BF16 && (KV == ATTND_KV_BF16 || K::kStatic) ? ATTND_DT_BF16 : ATTND_DT_FP16;
  static constexpr int PDT = (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) ? ATTND_DT_BF16
                             : K::kDyn                                    ? DT
                                                                          : ATTND_DT_FP16;
  static constexpr bool kQScale = KDT != DT;
  static constexpr bool kSigma = K::kDyn && PDT == ATTND_DT_FP16;
  static constexpr float kPShift = PDT == ATTND_DT_FP16 ? 14.f : 0.f;
  // A lane's share of one K row, in 16-byte pieces (int4 at D 64: one 8-byte piece).
  static constexpr int KSB = RB / 4;                 // bytes
  static constexpr int NKP = KSB >= 16 ? KSB / 16 : 1;
  static constexpr int KPW = KSB >= 16 ? 4 : KSB / 4; // words per piece
  static constexpr int TPP = (D / 16) / NKP;         // k-steps per piece
  // A lane's share of one V row (D/8 channels), in pieces of at most 16 bytes.
  static constexpr int VSB = RB / 8;
  static constexpr int NVP = VSB >= 16 ? VSB / 16 : 1;
  static constexpr int VPW = VSB >= 16 ? 4 : VSB / 4;
  static constexpr int CPP = (D / 8) / NVP;          // channels per piece
  // Shared memory (bytes).
  static constexpr int kStage = 2 * KS * RB + (K::kDyn ? 2 * KS * 4 : 0); // K, V rows; k, v scales
  static constexpr size_t kQ = 0; // [16][LD]: TR rows 0..7 hi, 8..15 lo; rows form: hi
  static constexpr size_t kQlo = kQ + (size_t)16 * LD * 2;                         // rows form: lo
  static constexpr size_t kVs = kQlo + (!TR && K::kStatic ? (size_t)16 * LD * 2 : 0); // [2][D] v scale, zero
  static constexpr size_t kMisc = kVs + (K::kStatic ? (size_t)2 * D * 4 : 0); // [16] c, M, L, Lt; [16] scratch
  static constexpr size_t kP = kMisc + 80 * 4;                                 // TR: [warps][8][16] P
  static constexpr size_t kStages = kP + (TR ? (size_t)NW * 8 * KS * 2 : 0);
  static constexpr int kAvail = 233472 / MINB - 1024 - (int)kStages;
  static constexpr int NS = dec_clamp(kAvail / (NW * kStage), 2, 6); // cp.async stages per warp
  // After the key loop the stage area holds the merge: [warps][16] m, l, lt, then [warps][MV][D] o.
  static constexpr size_t kMerge = ((size_t)3 * NW * 16 + (size_t)NW * MV * D) * 4;
  static constexpr size_t kStageArea = dec_max((size_t)NW * NS * kStage, kMerge);
  static constexpr size_t kBytes = kStages + kStageArea;
  static_assert(CPR >= 2 && (KS * CPR) % 32 == 0, "a chunk is whole 16-byte copies per lane");
  static_assert(kQ % 16 == 0 && kVs % 16 == 0 && kP % 16 == 0 && kStages % 16 == 0, "aligned regions");
};

// XOR swizzle of a row's 16-byte chunks: the K and V fragment reads of a
// quarter warp hit distinct banks for most shapes.
template <int CPR> __device__ __forceinline__ int dec_swz(int r) {
  return ((((r >> 1) & 3) << 1) ^ ((r & 1) << 2)) & (CPR - 1);
}

// Logical (mma k) column of physical channel d in q (see the file comment).
template <class C> __device__ __forceinline__ int qcol(int d) {
  constexpr int D = C::D;
  if constexpr (C::K::kI4) {
    // Lane c's quarter [c D/4, (c+1) D/4), 8 channels per word w; nibble i of
    // word w feeds k-step 2w + ((i & 3) >> 1) as pair member (i >> 2) of
    // logical column 2c (i even) or 2c + 8 (i odd).
    const int c = d / (D / 4), within = d % (D / 4), w = within >> 3, i = within & 7;
    return (2 * w + ((i & 3) >> 1)) * 16 + 2 * c + ((i & 1) << 3) + (i >> 2);
  } else if constexpr (C::K::k16) {
    // Chunk 4i + c (8 channels, 4 words); words 2h, 2h + 1 feed k-step 2i + h.
    const int ch = d >> 3, b = d & 7, wd = b >> 1;
    return (2 * (ch >> 2) + (wd >> 1)) * 16 + 2 * (ch & 3) + (b & 1) + ((wd & 1) << 3);
  } else {
    // Chunk 4i + c (16 channels, 4 words); word u feeds k-step 4i + u.
    const int ch = d >> 4, t = (ch >> 2) * 4 + ((d >> 2) & 3), e = d & 3;
    return t * 16 + 2 * (ch & 3) + (e & 1) + ((e >> 1) << 3);
  }
}

// Piece p of lane c's share of K row r (C::KPW words).
template <class C> __device__ __forceinline__ void k_piece(const uint8_t *sK, int r, int c, int p, uint32_t *w) {
  const uint8_t *row = sK + r * C::RB;
  if constexpr (C::K::kI4 && C::KSB < 16) { // D 64: 8 bytes
    const uint2 x = *reinterpret_cast<const uint2 *>(row + (((c >> 1) ^ dec_swz<C::CPR>(r)) << 4) + (c & 1) * 8);
    w[0] = x.x;
    w[1] = x.y;
  } else {
    const int ch = C::K::kI4 ? c * C::NKP + p : 4 * p + c;
    const uint4 x = *reinterpret_cast<const uint4 *>(row + ((ch ^ dec_swz<C::CPR>(r)) << 4));
    w[0] = x.x;
    w[1] = x.y;
    w[2] = x.z;
    w[3] = x.w;
  }
}

// The k-operand register of k-step u of a piece: logical columns {2c, 2c+1}
// (hi = 0) or {2c+8, 2c+9} (hi = 1).
template <class C> __device__ __forceinline__ uint32_t k_op(const uint32_t *w, int u, int hi) {
  if constexpr (C::K::kI4)
    return pair4<C::KDT>(w[u >> 1], 2 * (u & 1) + hi);
  else if constexpr (C::K::k16)
    return word16<C::KV, C::KDT>(w[2 * u + hi]);
  else
    return pair8<C::KV, C::KDT>(w[u], w[u], hi ? 2 : 0, hi ? 3 : 1);
}

// Piece p of lane g's channels of V row r (C::VPW words).
template <class C> __device__ __forceinline__ void v_piece(const uint8_t *sV, int r, int g, int p, uint32_t *w) {
  const uint8_t *row = sV + r * C::RB;
  if constexpr (C::VSB >= 16) {
    const uint4 x =
        *reinterpret_cast<const uint4 *>(row + (((g * C::NVP + p) ^ dec_swz<C::CPR>(r)) << 4));
    w[0] = x.x;
    w[1] = x.y;
    w[2] = x.z;
    w[3] = x.w;
  } else if constexpr (C::VSB == 8) {
    const uint2 x = *reinterpret_cast<const uint2 *>(row + (((g >> 1) ^ dec_swz<C::CPR>(r)) << 4) + (g & 1) * 8);
    w[0] = x.x;
    w[1] = x.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t *>(row + (((g >> 2) ^ dec_swz<C::CPR>(r)) << 4) + (g & 3) * 4);
  }
}

// Channel jj of a V piece in rows a and b as one operand register (a low).
template <class C> __device__ __forceinline__ uint32_t v_pair(const uint32_t *xa, const uint32_t *xb, int jj) {
  if constexpr (C::K::kI4) {
    const uint32_t x = __byte_perm(xa[jj >> 3], xb[jj >> 3], (jj & 4) ? 0x7632 : 0x5410);
    return pair4<C::PDT>(x, jj & 3);
  } else if constexpr (C::K::k16) {
    return word16<C::KV, C::PDT>(__byte_perm(xa[jj >> 1], xb[jj >> 1], (jj & 1) ? 0x7632 : 0x5410));
  } else {
    return pair8<C::KV, C::PDT>(xa[jj >> 2], xb[jj >> 2], jj & 3, jj & 3);
  }
}

// cp.async of the chunk of 16 keys at j0 (all in one block: chunks are
// 16-aligned, blocks hold >= 16 keys) into a stage; rows past jmax are
// zero-filled, so a stale tail of the block is never read as a value. (Reading
// the block-table entry a chunk ahead, in a register, made the copies slower
// on the H200: bench/RESULTS.md, decode round 2.)
template <class C>
__device__ __forceinline__ void dec_issue(const DecodeParams &P, const int32_t *bt, int kvh, int j0, int jmax,
                                          uint8_t *sb, int lane) {
  constexpr int KS = C::KS, RB = C::RB, CPR = C::CPR;
  const int nval = min(KS, jmax - j0 + 1);
  const size_t blk = (size_t)bt[j0 >> (__ffs(P.bs) - 1)] * P.block_bytes;
  const int rib = kvh * P.bs + (j0 & (P.bs - 1)); // row in the block's [kv head][token] order
  const size_t v_region = (size_t)P.kv_heads * P.bs * RB;
  const uint8_t *kp = P.cache + blk + (size_t)rib * RB;
#pragma unroll
  for (int i = 0; i < (KS * CPR) / 32; i++) {
    const int x = lane + 32 * i, r = x / CPR, cc = x % CPR;
    const bool ok = r < nval;
    const int dst = r * RB + ((cc ^ dec_swz<CPR>(r)) << 4);
    cp_async16(sb + dst, ok ? kp + (size_t)r * RB + cc * 16 : P.cache, ok);
    cp_async16(sb + KS * RB + dst, ok ? kp + v_region + (size_t)r * RB + cc * 16 : P.cache, ok);
  }
  if constexpr (C::K::kDyn) {
    if (lane < 8) {
      const int which = lane >> 2, k4 = (lane & 3) * 4;
      const int nb = max(0, min(4, nval - k4)) * 4;
      const uint8_t *src =
          P.cache + blk + 2 * v_region + ((size_t)which * P.kv_heads * P.bs + rib + k4) * 4;
      cp_async16n(sb + 2 * KS * RB + which * KS * 4 + k4 * 4, nb ? src : P.cache, nb);
    }
  }
}

// What a warp needs to score one chunk.
struct DecPiece {
  const int32_t *iv; // interval mask or NULL
  int kind, mp, causal, kv_len;
  int klo, khi;      // keys of this piece
  int prow[2];       // absolute positions of this lane's two vectors
  float sl2;         // score scale into the exp2 domain (static K scale, q's power of two folded in)
  bool qlo_cols;     // TR: columns 4..7 hold the lo halves of vectors 0..3
  bool lo_pass;      // a second product with the lo halves of q
};

// Per-lane online softmax state.
template <class C> struct DecAcc {
  float o[C::NO][4];
  float m[2], l[2], lt[2]; // running max (exp2 domain), sum of P, sum of P as rounded (!kDyn)
  float sig;               // kSigma: the power of two V's scales are taken relative to
};

// Masks one score of key j for the vector at absolute position p.
__device__ __forceinline__ float dec_mask(const DecPiece &pc, float x, int j, int p) {
  return j >= pc.klo && j <= pc.khi && visible(pc.kind, pc.mp, pc.causal, pc.iv, pc.kv_len, p, j) ? x : -INFINITY;
}

// kSigma: raises the warp's V-scale reference to cover this chunk's largest
// scale (vmax, already reduced over the warp); returns the factor O is
// rescaled by (exact: a ratio of powers of two; 0 before the first chunk).
template <class C> __device__ __forceinline__ float dec_sigma(DecAcc<C> &acc, float vmax) {
  const float sn = fmaxf(acc.sig, pow2_ceil(vmax));
  const float beta = acc.sig / sn;
  acc.sig = sn;
  return beta;
}

// One chunk in the transposed form: S^T = K q^T, online softmax, O^T += V^T P^T.
template <class C>
__device__ __forceinline__ void dec_chunk_tr(const DecPiece &pc, const uint8_t *sb, const uint32_t (*qb)[2],
                                             const typename Act<C::KDT>::T *sQ, typename Act<C::PDT>::T *sP,
                                             int j0, bool need_mask, DecAcc<C> &acc) {
  using PA = Act<C::PDT>;
  constexpr int KS = C::KS, LD = C::LD;
  const int lane = threadIdx.x & 31, g = lane >> 2, c4 = lane & 3;
  const uint8_t *sK = sb, *sV = sb + KS * C::RB;
  const float *sKs = reinterpret_cast<const float *>(sb + 2 * KS * C::RB), *sVsc = sKs + KS;

  // S^T: 16 keys x 8 vectors; two accumulators halve the dependency chain.
  float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int p = 0; p < C::NKP; p++) {
    uint32_t w0[C::KPW], w1[C::KPW];
    k_piece<C>(sK, g, c4, p, w0);
    k_piece<C>(sK, g + 8, c4, p, w1);
#pragma unroll
    for (int u = 0; u < C::TPP; u += 2) {
      const int t = p * C::TPP + u;
      uint32_t ql[4];
      if (pc.lo_pass)
        ldsm_x4(ql[0], ql[1], ql[2], ql[3],
                sQ + (8 + (lane & 7)) * LD + t * 16 + ((lane >> 3) & 1) * 8 + (lane >> 4) * 16);
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const uint32_t a[4] = {k_op<C>(w0, u + h, 0), k_op<C>(w1, u + h, 0), k_op<C>(w0, u + h, 1),
                               k_op<C>(w1, u + h, 1)};
        mma16816<C::KDT>(h ? sb2 : sa, a, qb[t + h][0], qb[t + h][1]);
        if (pc.lo_pass)
          mma16816<C::KDT>(h ? sb2 : sa, a, ql[2 * h], ql[2 * h + 1]);
      }
    }
  }
  // Element e: key g + 8 (e >> 1), vector 2c + (e & 1).
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int key = g + 8 * (e >> 1);
    float x = sa[e] + sb2[e];
    if (pc.qlo_cols)
      x += __shfl_xor_sync(0xffffffffu, x, 2); // lane c ^ 2 holds the other half
    x *= pc.sl2;
    if constexpr (C::K::kDyn)
      x *= sKs[key];
    if (need_mask)
      x = dec_mask(pc, x, j0 + key, pc.prow[e & 1]);
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
    vinv = 1.f / acc.sig; // a power of two: exact
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
      pv *= C::kSigma ? sVsc[key] * vinv : sVsc[key];
    const typename PA::T pr = PA::from_f(pv);
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

// One chunk in the rows form: S = q K^T, online softmax, O += P V.
template <class C>
__device__ __forceinline__ void dec_chunk_rows(const DecPiece &pc, const uint8_t *sb,
                                               const typename Act<C::KDT>::T *sQ,
                                               const typename Act<C::KDT>::T *sQlo, int j0, bool need_mask,
                                               DecAcc<C> &acc) {
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
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < 2; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = nt * 8 + 2 * c4 + (e & 1);
      float x = s[nt][e] * pc.sl2;
      if constexpr (C::K::kDyn)
        x *= sKs[key];
      if (need_mask)
        x = dec_mask(pc, x, j0 + key, pc.prow[e >> 1]);
      s[nt][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  float alpha[2], beta = 1.f, vinv = 1.f;
  if constexpr (C::kSigma) {
    float vm = fmaxf(fmaxf(sVsc[2 * c4], sVsc[2 * c4 + 1]), fmaxf(sVsc[8 + 2 * c4], sVsc[9 + 2 * c4]));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 1));
    vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 2));
    beta = dec_sigma(acc, vm);
    vinv = 1.f / acc.sig;
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
        vs.x *= vinv;
        vs.y *= vinv;
      }
      pa[nt * 2 + 0] = PA::pack2(p0 * vs.x, p1 * vs.y);
      pa[nt * 2 + 1] = PA::pack2(p2 * vs.x, p3 * vs.y);
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

// Where a piece's result goes.
enum { kOutFinal = 0, kOutSlot = 1, kOutSplit = 2 };

// Merges the four warps' states by lse and writes the piece's result in the
// natural channel order: the output (kOutFinal) or a partial state (the
// output normalized by this piece's own sum, and its lse).
template <class C>
__device__ __forceinline__ void dec_finish(const DecodeParams &P, uint8_t *smem, const attnd_kitem_t &it, int kvh,
                                           int out_kind, int out_idx, DecAcc<C> &acc) {
  constexpr int D = C::D, NW = C::NW, MV = C::MV;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c4 = lane & 3;
  const int G = P.group, nvec = it.n * G;
  float *sMisc = reinterpret_cast<float *>(smem + C::kMisc);
  float *sC = sMisc, *sM = sMisc + 16, *sL = sMisc + 32, *sLt = sMisc + 48;
  const float *sVs = reinterpret_cast<const float *>(smem + C::kVs);
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
#pragma unroll
    for (int x = C::TR ? 4 : 1; x < (C::TR ? 32 : 4); x <<= 1) {
      acc.l[ri] += __shfl_xor_sync(0xffffffffu, acc.l[ri], x);
      if constexpr (!C::K::kDyn)
        acc.lt[ri] += __shfl_xor_sync(0xffffffffu, acc.lt[ri], x);
    }
  }
  float *sm = reinterpret_cast<float *>(smem + C::kStages); // [warps][16] m, l, lt
  float *so = sm + 3 * NW * 16;                             // [warps][MV][D]
  __syncthreads(); // every warp is past its last chunk: the stages are free
  if (C::TR ? g == 0 : c4 == 0) {
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
      const int v = C::TR ? 2 * c4 + ri : g + ri * 8;
      sm[warp * 16 + v] = acc.m[ri];
      sm[NW * 16 + warp * 16 + v] = acc.l[ri];
      sm[2 * NW * 16 + warp * 16 + v] = acc.lt[ri];
    }
  }
  __syncthreads();
  if (tid < MV) {
    float M = -INFINITY;
    for (int w = 0; w < NW; w++)
      M = fmaxf(M, sm[w * 16 + tid]);
    const float mref = M == -INFINITY ? 0.f : M;
    float Ls = 0.f, Lt = 0.f;
    for (int w = 0; w < NW; w++) {
      const float f = ex2(sm[w * 16 + tid] - mref);
      Ls += sm[NW * 16 + w * 16 + tid] * f;
      Lt += sm[2 * NW * 16 + w * 16 + tid] * f;
    }
    sM[tid] = mref;
    sL[tid] = Ls;
    sLt[tid] = Lt;
  }
  __syncthreads();
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    const int r = C::TR ? 2 * c4 + ri : g + 8 * ri;
    const float Ls = sL[r], Ln = C::K::kDyn ? Ls : sLt[r];
    float f = Ls > 0.f ? ex2(acc.m[ri] - sM[r]) / Ln : 0.f;
    if constexpr (C::kSigma)
      f *= acc.sig; // O was accumulated relative to this warp's V-scale reference
    if constexpr (C::TR) {
#pragma unroll
      for (int mt = 0; mt < C::NO; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
          so[(warp * MV + r) * D + g * (D / 8) + 2 * mt + h] = acc.o[mt][h * 2 + ri] * f;
    } else {
#pragma unroll
      for (int j = 0; j < C::NO; j++)
#pragma unroll
        for (int e = 0; e < 2; e++)
          so[(warp * MV + r) * D + (2 * c4 + e) * (D / 8) + j] = acc.o[j][ri * 2 + e] * f;
    }
  }
  __syncthreads();
  using A = Act<C::DT>; // the output's dtype
  for (int idx = tid; idx < nvec * D; idx += C::NTH) {
    const int r = idx / D, d = idx % D;
    float x = 0.f;
#pragma unroll
    for (int w = 0; w < NW; w++)
      x += so[(w * MV + r) * D + d];
    const float Ls = sL[r];
    if constexpr (C::K::kI4)
      x = Ls > 0.f ? (x - sVs[D + d]) * sVs[d] : 0.f; // s (sum P~ u / sum P~ - z)
    else if constexpr (C::K::kStatic)
      x *= sVs[d];
    // lse from the sum of P; lset from the sum that normalized O (the merge weights).
    float lse = -INFINITY, lset = -INFINITY;
    if (Ls > 0.f) {
      // The sums hold P 2^kPShift: the shift comes off their logs (exact), not off m.
      const float ref = sM[r] - (C::K::kI4 ? sC[r] : 0.f);
      lse = (ref + (log2f(Ls) - C::kPShift)) * 0.69314718055994531f;
      lset = C::K::kDyn ? lse : (ref + (log2f(sLt[r]) - C::kPShift)) * 0.69314718055994531f;
    }
    const int row = it.q_row + r / G, h = kvh * G + r % G;
    const size_t ob = ((size_t)row * P.q_heads + h) * D + d;
    if (out_kind == kOutFinal) {
      if (P.out_fp32)
        reinterpret_cast<float *>(P.out)[ob] = x;
      else
        reinterpret_cast<typename A::T *>(P.out)[ob] = A::from_f(x);
      if (P.lse && d == 0)
        P.lse[(size_t)row * P.q_heads + h] = lse;
    } else if (out_kind == kOutSlot) {
      float *slot = P.ws + (size_t)out_idx * flat_slot_floats(P.max_vec, D);
      slot[r * D + d] = x;
      if (d == 0) {
        slot[(size_t)P.max_vec * D + r] = lse;
        slot[(size_t)P.max_vec * (D + 1) + r] = lset;
      }
    } else {
      const size_t part = (size_t)P.total_q * P.q_heads, li = (size_t)out_idx * part + (size_t)row * P.q_heads + h;
      P.ws[(size_t)out_idx * part * D + ob] = x;
      if (d == 0) {
        P.ws[(size_t)P.nsplit * part * D + li] = lse;
        P.ws[(size_t)P.nsplit * part * (D + 1) + li] = lset;
      }
    }
  }
}

// One piece: keys [klo, khi] of (item it, kv head kvh), every query vector of
// the item.
template <class C>
__device__ void dec_piece(const DecodeParams &P, uint8_t *smem, const attnd_kitem_t &it, int kvh, int klo, int khi,
                          int out_kind, int out_idx) {
  using A = Act<C::DT>;  // the activations (q)
  using KA = Act<C::KDT>; // q and K as the first product's operands
  using KT = typename KA::T;
  constexpr int D = C::D, LD = C::LD, NW = C::NW, NS = C::NS, KS = C::KS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c4 = lane & 3;
  const int G = P.group, nvec = it.n * G;
  KT *sQ = reinterpret_cast<KT *>(smem + C::kQ);
  KT *sQlo = reinterpret_cast<KT *>(smem + C::kQlo);
  float *sVs = reinterpret_cast<float *>(smem + C::kVs);
  float *sMisc = reinterpret_cast<float *>(smem + C::kMisc);
  float *sC = sMisc, *scratch = sMisc + 64;
  auto *sP = reinterpret_cast<typename Act<C::PDT>::T *>(smem + C::kP) + warp * 8 * KS;
  uint8_t *myStages = smem + C::kStages + (size_t)warp * NS * C::kStage;
  const int32_t *bt = P.meta + it.block_table;
  const bool no_load = P.debug & 1, no_math = P.debug & 2; // timing experiments only

  __syncthreads(); // the previous piece (or the work-range scan) is done with shared memory
  const int jfirst = klo & ~(KS - 1);
  const int nchunks = khi >= jfirst ? (khi - jfirst) / KS + 1 : 0;
  const int cnt = nchunks > warp ? (nchunks - 1 - warp) / NW + 1 : 0;
#pragma unroll
  for (int n = 0; n < NS - 1; n++) {
    if (n < cnt && !no_load)
      dec_issue<C>(P, bt, kvh, jfirst + (warp + NW * n) * KS, khi, myStages + n * C::kStage, lane);
    cp_async_commit();
  }

  // While the first chunks are on their way: the static scales, and q.
  DecPiece pc;
  pc.iv = it.mask_kind == ATTND_MASK_INTERVALS ? P.meta + it.intervals : nullptr;
  pc.kind = it.mask_kind;
  pc.mp = it.mask_param;
  pc.causal = it.causal;
  pc.kv_len = it.start + it.n;
  pc.klo = klo;
  pc.khi = khi;
  pc.sl2 = P.scale_log2;
  bool qsplit = false;
  float rscale = 1.f;
  // Block-wide max of x >= 0 (every thread gets it).
  auto block_max = [&](float x) -> float {
#pragma unroll
    for (int o = 16; o; o >>= 1)
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    __syncthreads(); // scratch is free
    if (lane == 0)
      scratch[warp] = x;
    __syncthreads();
    return fmaxf(fmaxf(scratch[0], scratch[1]), fmaxf(scratch[2], scratch[3]));
  };
  if constexpr (C::K::kStatic) {
    qsplit = C::K::kI4 || P.per_channel;
    if (!qsplit) {
      pc.sl2 *= P.k_scale[kvh];
    } else {
      float mx = 0.f;
      for (int d = tid; d < D; d += C::NTH)
        mx = fmaxf(mx, P.k_scale[kvh * D + d]);
      const int e = scale_exp(block_max(mx));
      rscale = ldexpf(1.f, -e);
      pc.sl2 = ldexpf(pc.sl2, e);
    }
  }
  // q element idx of the [16][D] tile (0 past nvec), static K scale folded in.
  auto q_at = [&](int idx) -> float {
    const int r = idx / D, d = idx % D;
    if (r >= nvec)
      return 0.f;
    const int row = it.q_row + r / G, h = kvh * G + r % G;
    float x = A::to_f(reinterpret_cast<const typename A::T *>(P.q)[((size_t)row * P.q_heads + h) * D + d]);
    if constexpr (C::K::kStatic)
      if (qsplit)
        x *= P.k_scale[kvh * D + d] * rscale;
    return x;
  };
  constexpr int QV = C::TR ? 8 : 16; // vectors a form reads
  float qscale = 1.f;
  if constexpr (C::kQScale) {
    // bf16 q into fp16's range: a power of two puts the largest |q| in [2^14, 2^15).
    float mx = 0.f;
    for (int idx = tid; idx < QV * D; idx += C::NTH)
      mx = fmaxf(mx, fabsf(q_at(idx)));
    mx = block_max(mx);
    const int e = mx > 0.f ? scale_exp(mx) - 15 : 0;
    qscale = ldexpf(1.f, -e);
    pc.sl2 = ldexpf(pc.sl2, e);
  }
  pc.qlo_cols = C::TR && qsplit && nvec <= 4;
  pc.lo_pass = qsplit && !pc.qlo_cols;
  for (int idx = tid; idx < QV * D; idx += C::NTH) {
    const int r = idx / D, d = idx % D;
    const float x = q_at(idx) * qscale;
    const KT hi = KA::from_f(x);
    const KT lo = KA::from_f(x - KA::to_f(hi));
    const int col = qcol<C>(d);
    if constexpr (C::TR) {
      sQ[r * LD + col] = hi;
      sQ[(r + 8) * LD + col] = lo; // rows 8..15: lo of vectors 0..7
    } else {
      sQ[r * LD + col] = hi;
      if constexpr (C::K::kStatic)
        sQlo[r * LD + col] = lo;
    }
  }
  if constexpr (C::K::kStatic)
    for (int d = tid; d < D; d += C::NTH) {
      sVs[d] = (C::K::kI4 || P.per_channel) ? P.v_scale[kvh * D + d] : P.v_scale[kvh];
      if constexpr (C::K::kI4)
        sVs[D + d] = P.v_zero[kvh * D + d];
    }
  __syncthreads();
  if constexpr (C::K::kI4) {
    // q'.(u - z) = q'.u - q'.z: the second term is the same for every key of a
    // vector, so the scores leave it out and the lse takes it out (fp64 sum).
    if (tid < C::MV) {
      double c = 0.0;
      for (int d = 0; d < D; d++) {
        const int col = qcol<C>(d);
        const double qv = (double)KA::to_f(sQ[tid * LD + col]) +
                          (double)KA::to_f(C::TR ? sQ[(tid + 8) * LD + col] : sQlo[tid * LD + col]);
        c += qv * (double)P.k_zero[kvh * D + d];
      }
      sC[tid] = (float)(c * (double)pc.sl2);
    }
  }
  uint32_t qb[C::TR ? D / 16 : 1][2];
  if constexpr (C::TR) {
    const int rr = lane & 7, row = pc.qlo_cols && rr >= 4 ? rr + 4 : rr;
#pragma unroll
    for (int t = 0; t < D / 16; t += 2)
      ldsm_x4(qb[t][0], qb[t][1], qb[t + 1][0], qb[t + 1][1],
              sQ + row * LD + t * 16 + ((lane >> 3) & 1) * 8 + (lane >> 4) * 16);
  }

  DecAcc<C> acc;
#pragma unroll
  for (int i = 0; i < C::NO; i++)
    acc.o[i][0] = acc.o[i][1] = acc.o[i][2] = acc.o[i][3] = 0.f;
  acc.sig = 0.f;
#pragma unroll
  for (int i = 0; i < 2; i++) {
    acc.m[i] = -INFINITY;
    acc.l[i] = acc.lt[i] = 0.f;
    int v = C::TR ? 2 * c4 + i : g + 8 * i;
    if (pc.qlo_cols)
      v &= 3;
    pc.prow[i] = it.start + min(v, nvec - 1) / G;
  }
  const int pmin = it.start, pmax = it.start + it.n - 1;
  for (int n = 0; n < cnt; n++) {
    // The stage of chunk n - 1 is free (the warp passed its end): refill it.
    if (n + NS - 1 < cnt && !no_load)
      dec_issue<C>(P, bt, kvh, jfirst + (warp + NW * (n + NS - 1)) * KS, khi,
                   myStages + ((n + NS - 1) % NS) * C::kStage, lane);
    cp_async_commit();
    cp_async_wait<NS - 1>();
    __syncwarp();
    if (no_math)
      continue;
    const uint8_t *sb = myStages + (n % NS) * C::kStage;
    const int j0 = jfirst + (warp + NW * n) * KS;
    const bool need_mask = tile_needs_mask(it, pmin, pmax, klo, khi, j0, KS);
    if constexpr (C::TR)
      dec_chunk_tr<C>(pc, sb, qb, sQ, sP, j0, need_mask, acc);
    else
      dec_chunk_rows<C>(pc, sb, sQ, sQlo, j0, need_mask, acc);
    __syncwarp(); // the stage is refilled next iteration
  }
  cp_async_wait<0>();
  dec_finish<C>(P, smem, it, kvh, out_kind, out_idx, acc);
}

// 16-key chunks of one kv head's share of item it (0 for an item without q),
// and the first key and the visible key range.
__device__ __forceinline__ int dec_item_chunks(const attnd_kitem_t &it, int &jfirst, int &lo, int &hi) {
  if (it.q_row < 0)
    return 0;
  key_range(it, it.start, it.start + it.n - 1, lo, hi);
  jfirst = lo & ~(kDecKeys - 1);
  return hi >= jfirst ? (hi - jfirst) / kDecKeys + 1 : 1;
}

// Flat split: pre[i] = chunks of items 0..i-1 (one kv head's share), pre[n] =
// all; returns the CTAs to use of the nctas launched: when every item with q
// has the same chunk count, a multiple of the segments (each (item, kv head)
// cut into equal parts, no piece straddling two: a balanced batch runs as a
// per-item split would); otherwise all of them (at most one per chunk).
template <class C> __device__ int dec_prefix(const DecodeParams &P, int *pre, int *scratch) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n = P.nitems;
  const int per = (n + C::NTH - 1) / C::NTH, i0 = min(n, tid * per), i1 = min(n, i0 + per);
  int sum = 0, mn = 0x7fffffff, mx = 0, nq = 0, jf, lo, hi;
  for (int i = i0; i < i1; i++) {
    const attnd_kitem_t it = P.items[i];
    const int c = dec_item_chunks(it, jf, lo, hi);
    sum += c;
    if (c > 0) {
      mn = min(mn, c);
      mx = max(mx, c);
      nq++;
    }
  }
  int incl = sum;
#pragma unroll
  for (int x = 1; x < 32; x <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, x);
    if (lane >= x)
      incl += y;
  }
#pragma unroll
  for (int x = 16; x; x >>= 1) {
    mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, x));
    mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, x));
    nq += __shfl_xor_sync(0xffffffffu, nq, x);
  }
  if (lane == 31)
    scratch[warp] = incl;
  if (lane == 0) {
    scratch[4 + warp] = mn;
    scratch[8 + warp] = mx;
    scratch[12 + warp] = nq;
  }
  __syncthreads();
  int run = incl - sum;
  for (int w = 0; w < warp; w++)
    run += scratch[w];
  for (int i = i0; i < i1; i++) {
    pre[i] = run;
    const attnd_kitem_t it = P.items[i];
    run += dec_item_chunks(it, jf, lo, hi);
  }
  if (tid == C::NTH - 1)
    pre[n] = run;
  mn = min(min(scratch[4], scratch[5]), min(scratch[6], scratch[7]));
  mx = max(max(scratch[8], scratch[9]), max(scratch[10], scratch[11]));
  nq = scratch[12] + scratch[13] + scratch[14] + scratch[15];
  __syncthreads();
  const long long w = (long long)P.kv_heads * pre[n];
  if (mn == mx && nq > 0) {
    const long long segs = (long long)P.kv_heads * nq;
    long long k = P.nctas / segs;
    k = k < 1 ? 1 : k > mx ? mx : k;
    return (int)min((long long)P.nctas, segs * k);
  }
  return (int)min((long long)P.nctas, w);
}

template <int D, int DT, int KV, bool TR>
__global__ void __launch_bounds__(kDecWarps * 32, Dec<D, DT, KV, TR>::MINB)
    decode_kernel(const __grid_constant__ DecodeParams P) {
  using C = Dec<D, DT, KV, TR>;
  extern __shared__ __align__(16) uint8_t smem[];
  pdl_trigger(); // the merge may launch now; it waits for this grid's end
  if (!P.flat) {
    const int item = blockIdx.x / P.kv_heads, kvh = blockIdx.x % P.kv_heads, split = blockIdx.z;
    const attnd_kitem_t it = P.items[item];
    if (it.q_row < 0)
      return;
    int lo, hi;
    key_range(it, it.start, it.start + it.n - 1, lo, hi);
    int out_kind = kOutFinal;
    if (P.nsplit > 1) {
      lo = max(lo, split * P.split_keys);
      hi = min(hi, (split + 1) * P.split_keys - 1);
      out_kind = kOutSplit;
    }
    pdl_wait(); // q and the cache are written by the previous kernel
    dec_piece<C>(P, smem, it, kvh, lo, hi, out_kind, split);
    return;
  }
  // Flat split: this CTA's chunks [u, u1) of the W in all, over nc CTAs.
  int *pre = reinterpret_cast<int *>(smem + C::kStages);
  int *scratch = reinterpret_cast<int *>(smem + C::kMisc) + 64;
  const int nc = dec_prefix<C>(P, pre, scratch);
  const int cta = blockIdx.x, KVH = P.kv_heads;
  if (cta >= nc)
    return;
  const long long W = (long long)KVH * pre[P.nitems];
  long long u = flat_start(cta, nc, W);
  const long long u1 = flat_start(cta + 1, nc, W);
  // The item holding chunk u: the last i with KVH pre[i] <= u (it has chunks).
  int i = 0;
  if (u < u1) {
    int a = 0, b = P.nitems - 1;
    while (a < b) {
      const int mid = (a + b + 1) >> 1;
      if ((long long)KVH * pre[mid] <= u)
        a = mid;
      else
        b = mid - 1;
    }
    i = a;
  }
  long long base = (long long)KVH * pre[i];
  pdl_wait(); // q, the cache and the workspace belong to the previous kernel until here
  if (cta == 0 && P.nctas > 1) { // the prefix sums and the CTA count, for the merge
    int *wpre = reinterpret_cast<int *>(P.ws + flat_prefix_offset(P.nctas, P.max_vec, D));
    for (int j = threadIdx.x; j <= P.nitems; j += C::NTH)
      wpre[j] = pre[j];
    if (threadIdx.x == 0)
      wpre[P.nitems + 1] = nc;
  }
  bool first = true;
  while (u < u1) {
    const attnd_kitem_t it = P.items[i];
    int jfirst, lo, hi;
    const int nch = dec_item_chunks(it, jfirst, lo, hi);
    const int h = (int)((u - base) / nch), a = (int)((u - base) % nch);
    const int b = (int)min((long long)nch, a + (u1 - u));
    const bool whole = a == 0 && b == nch;
    const int klo = max(lo, jfirst + a * kDecKeys), khi = min(hi, jfirst + b * kDecKeys - 1);
    dec_piece<C>(P, smem, it, h, klo, khi, whole ? kOutFinal : kOutSlot, 2 * cta + (first ? 0 : 1));
    u += b - a;
    first = false;
    if (b == nch && h == KVH - 1) {
      base += (long long)KVH * nch;
      do
        i++;
      while (i < P.nitems && P.items[i].q_row < 0);
    }
  }
}

template <int D, int DT, int KV, bool TR>
cudaError_t launch_decode_one(const DecodeParams &p, dim3 grid, size_t extra_smem, bool pdl, cudaStream_t st) {
  using C = Dec<D, DT, KV, TR>;
  static bool attr_done = false; // per instantiation; benign race: both set the same value
  if (!attr_done) {
    cudaError_t e = cudaFuncSetAttribute(decode_kernel<D, DT, KV, TR>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)C::kBytes);
    if (e != cudaSuccess)
      return e;
    attr_done = true;
  }
  (void)extra_smem;
  return launch_ex(decode_kernel<D, DT, KV, TR>, grid, dim3(C::NTH), C::kBytes, pdl, st, p);
}

// Resident CTAs per SM (planning), from the occupancy calculator.
template <int D, int DT, int KV, bool TR> int decode_occupancy() {
  using C = Dec<D, DT, KV, TR>;
  static int n = 0;
  if (n == 0) {
    cudaFuncSetAttribute(decode_kernel<D, DT, KV, TR>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::kBytes);
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, decode_kernel<D, DT, KV, TR>, C::NTH, C::kBytes) !=
            cudaSuccess ||
        b < 1) {
      cudaGetLastError();
      b = 1;
    }
    n = b;
  }
  return n;
}

// Largest item count whose prefix sums fit the stage area (flat split).
template <int D, int DT, int KV, bool TR> int decode_flat_items() {
  return (int)(Dec<D, DT, KV, TR>::kStageArea / 4) - 1;
}

// Explicit instantiations of one cache type (the generated decode_inst_<kv>.cu).
#define ATTND_DECODE_INST_ONE(D, DT, KV, TR)                                                                   \
  template cudaError_t launch_decode_one<D, DT, KV, TR>(const DecodeParams &, dim3, size_t, bool, cudaStream_t); \
  template int decode_occupancy<D, DT, KV, TR>();                                                              \
  template int decode_flat_items<D, DT, KV, TR>();
#define ATTND_DECODE_INST(D, DT, KV)                                                                           \
  ATTND_DECODE_INST_ONE(D, DT, KV, true)                                                                       \
  ATTND_DECODE_INST_ONE(D, DT, KV, false)

} // namespace attnd

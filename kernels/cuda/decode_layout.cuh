// decode_layout.cuh: the decode kernel's sizes and shared-memory layout, and
// how a lane reads its operand registers straight out of a staged chunk (the
// fragment order described in decode_kernel.cuh), plus the chunk copy.
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

} // namespace attnd

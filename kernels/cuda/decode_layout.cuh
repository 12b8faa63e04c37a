// decode_layout.cuh: the decode kernel's sizes and shared-memory layout, and
// how a lane reads its operand registers straight out of a staged chunk (the
// fragment order described in decode_kernel.cuh), plus the chunk copy.
#pragma once

#include "decode_params.cuh"
#include "primitives.cuh"

namespace attnd {

constexpr int dec_clamp(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }

// The paired key loop (decode_kernel.cuh, dec_piece): a warp takes two of its
// chunks per step, one online-softmax update for both (32 keys), so that the
// two chunks' products are independent chains and the per-chunk bookkeeping
// is paid once per pair. int4 (TR form, D <= 128) always: 17% fewer
// instructions, 1-2% faster at d128, 14% at d64 (H100, bench/RESULTS.md).
// CMake ATTND_DECODE_PAIR extends it to the 1-byte types (A/B only: they ran
// 4-15% slower with it, the d128 ones at 3 CTAs per SM for its four stages).
#ifndef ATTND_DECODE_PAIR
#define ATTND_DECODE_PAIR 0
#endif
constexpr size_t dec_max(size_t a, size_t b) { return a > b ? a : b; }

// Resident CTAs per SM each instantiation is built for (registers and
// shared memory are sized to it): 16-bit caches move twice the bytes per key
// and need fewer CTAs in flight. The rows form (9-16 query vectors: GQA 16,
// several tokens an item) of the converted types at D 128 was built for 3
// (170 registers) and ran GQA 16 at 61-65% of the read roof, latency bound
// (no-load and no-math variants within 10% of the full kernel); at 4 (128
// registers: 0-20 bytes of spills, ptxas -warn-spills) it has a third more
// warps to hide the chain (bench/RESULTS.md).
template <int KV, int D> constexpr int dec_minb(bool tr) {
  return KvT<KV>::k16 ? (D == 64 ? 3 : D == 128 ? 2 : 1) : (D == 256 ? 2 : 4);
}

// Sizes and shared-memory layout of one instantiation. PV16_ (launch option
// debug 32768, decode_kernel PV16): the dynamic types under bf16 activations take
// the P V product in fp16 (kPv16, below); no effect elsewhere.
template <int D_, int DT_, int KV_, bool TR_, bool PV16_ = false> struct Dec {
  static constexpr int D = D_, DT = DT_, KV = KV_;
  static constexpr bool TR = TR_;
  using K = KvT<KV>;
  static constexpr int KS = kDecKeys, NW = kDecWarps, NTH = NW * 32;
  static constexpr int RB = K::k16 ? 2 * D : K::kI4 ? D / 2 : D; // bytes of one K or V row
  static constexpr int CPR = RB / 16;                            // 16-byte chunks per row
  static constexpr int MV = TR ? 8 : 16;                         // vectors of one product
  static constexpr int NO = TR ? D / 16 : D / 8;                 // O tiles per lane
  static constexpr int LD = D + 8;                               // padded q row: conflict-free ldmatrix
  // kPairC: a candidate for the paired key loop (below): the TR form of int4
  // at head dims 64 and 128 (its default), and with ATTND_DECODE_PAIR of every
  // converted type. kPair: a candidate whose stages hold two chunks being
  // computed and two in flight (NS >= 4).
  static constexpr bool kPairC = TR_ && !K::k16 && (ATTND_DECODE_PAIR || (K::kI4 && D_ <= 128));
  // A paired 1-byte d128 loop needs four stages (16 KB a warp): three CTAs
  // per SM (more registers each, two chains per warp) instead of four.
  static constexpr int MINB = kPairC && D == 128 && !K::kI4 ? 3 : dec_minb<KV, D>(TR);
  // Operand dtypes of the two products. fp16 for the first product wherever
  // the stored values are exact in it (every cache but bf16): int8 bytes
  // become operands in two instructions per pair and e4m3 pairs in one,
  // against five through fp32 for bf16 operands. q (bf16 activations) is
  // scaled by a power of two into fp16's range; P goes in as P 2^14 (fp16's
  // subnormals start at 2^-14); the dynamic types' P carries V's scale and
  // keeps the activation dtype (bf16's range), and with fp16 activations it is
  // taken relative to a running power-of-two reference of those scales
  // (kSigma).
  // Static types under bf16 activations split q s / 2^e into hi + lo exactly
  // as the tiled kernel does (bf16 roundings), then carry those bf16 values
  // scaled by the same power of two as fp16 operands (kBf16Split: exact, 8
  // significant bits fit in fp16's 11, for halves down to 2^-28 of the tile's
  // largest |q s|, where fp16's subnormals start), so a prefix hit (this kernel) and a
  // full recompute (tiled) see the same scores; fp16 roundings of the halves
  // differed at 2^-17 and P's roundings flipped (1.2e-4 against the 1e-4
  // bound, bench/RESULTS.md decode round 3).
  static constexpr int KDT = DT == ATTND_DT_BF16 && KV == ATTND_KV_BF16 ? ATTND_DT_BF16 : ATTND_DT_FP16;
  static constexpr bool kBf16Split = K::kStatic && DT == ATTND_DT_BF16;
  // kPv16: a dynamic type under bf16 activations with P V in fp16 (launch
  // option debug 32768). P' vs is rounded to bf16 exactly as the tiled kernel
  // rounds its P V operand, then carried as fp16 times 2^14 / sig (kSigma's
  // power-of-two reference; kVShift), an exact scaling for every value of at
  // least 2^-31 sig (bf16's 8 significant bits fit fp16's normal range and
  // its top subnormals), so the products are the bf16 path's times a power of
  // two; V's bytes then become operands as for the fp16 activations (int8: one
  // PRMT and one HADD2 per pair instead of a PRMT, two LOP3 and a subtraction;
  // e4m3: one conversion instead of four instructions through fp32).
  static constexpr bool kPv16 = PV16_ && K::kDyn && DT == ATTND_DT_BF16;
  static constexpr int PDT = (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) ? ATTND_DT_BF16
                             : kPv16                                      ? ATTND_DT_FP16
                             : K::kDyn                                    ? DT
                                                                          : ATTND_DT_FP16;
  static constexpr bool kQScale = KDT != DT;
  static constexpr bool kSigma = K::kDyn && PDT == ATTND_DT_FP16;
  // P' = P 2^kPShift: kPv16 keeps P unshifted (the tiled kernel's P under
  // bf16 activations: ex2 of the same argument) and scales P' vs by kVShift.
  static constexpr float kPShift = PDT == ATTND_DT_FP16 && !kPv16 ? 14.f : 0.f;
  static constexpr float kVShift = kPv16 ? 16384.f : 1.f;
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
  static constexpr size_t kStages = kP + (TR ? (size_t)NW * 8 * KS * 2 * (kPairC ? 2 : 1) : 0);
  static constexpr int kAvail = 233472 / MINB - 1024 - (int)kStages;
  static constexpr int NS = dec_clamp(kAvail / (NW * kStage), 2, 6); // cp.async stages per warp
  static constexpr bool kPair = kPairC && NS >= 4;
  // After the key loop the stage area holds the merge: [warps][16] m, l, lt, then [warps][MV][D] o.
  static constexpr size_t kMerge = ((size_t)3 * NW * 16 + (size_t)NW * MV * D) * 4;
  static constexpr size_t kStageArea = dec_max((size_t)NW * NS * kStage, kMerge);
  // kStages is 64 past a 128-byte boundary in every instantiation (the 320
  // bytes of kMisc); the stages start kStagePad later, on the boundary, as
  // bench_loads' probe has them (launch option debug 8192: the old offset,
  // timing A/B, results exact). NS and the CTAs per SM stay.
  static constexpr size_t kStagePad = (128 - kStages % 128) % 128;
  static constexpr size_t kBytes = kStages + kStagePad + kStageArea;
  static_assert(CPR >= 2 && (KS * CPR) % 32 == 0, "a chunk is whole 16-byte copies per lane");
  static_assert(kQ % 16 == 0 && kVs % 16 == 0 && kP % 16 == 0 && kStages % 16 == 0, "aligned regions");
  static_assert(kBytes <= (size_t)(233472 / MINB - 1024), "MINB CTAs per SM fit");
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

// ---- stored bytes -> operand registers (exact) --------------------------------
// Written so that each pair costs the fewest instructions (counted in the
// SASS, bench/RESULTS.md decode-perf): PRMT against a register of magic
// bytes instead of AND + OR, LOP3 with one immediate, HADD2/HFMA2 on the pair.
// fp16 pair h - c (exact where used: integers of at most 11 bits).
__device__ __forceinline__ uint32_t dec_hsub(uint32_t h, uint32_t c) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(h), "r"(c));
  return d;
}
// Biased bytes u = x + 128 of t (sel picks two, each below a byte 0x64) -> the
// fp16 pair (x_lo, x_hi): 1024 + u has u in its low mantissa byte. The magic
// bytes come from the constant bank: as a literal, ptxas made them PRMT's
// immediate and moved the selector into a register before every PRMT (29 moves
// per int8 chunk).
static __constant__ uint32_t dec_magic64 = 0x64646464u;
__device__ __forceinline__ uint32_t dec_u8_f16(uint32_t t, uint32_t sel) {
  return dec_hsub(__byte_perm(t, dec_magic64, sel), 0x64806480u); // - 1152
}
// int8 bytes x (two's complement) at bytes 0 and 2 of t -> the bf16 pair:
// (128 + (x & 127)) - (128 + (x & 128)), both terms exact in bf16.
__device__ __forceinline__ uint32_t dec_s8_bf16(uint32_t t) {
  uint32_t a, b, d;
  asm("lop3.b32 %0, %1, 0x007f007f, %2, 0xEA;" : "=r"(a) : "r"(t), "r"(0x43004300u));
  asm("lop3.b32 %0, %1, 0x00800080, %2, 0xEA;" : "=r"(b) : "r"(t), "r"(0x43004300u));
  const __nv_bfloat162 r =
      __hsub2(*reinterpret_cast<const __nv_bfloat162 *>(&a), *reinterpret_cast<const __nv_bfloat162 *>(&b));
  d = *reinterpret_cast<const uint32_t *>(&r);
  return d;
}
// Nibble i (0..3) of each halfword of x -> the fp16 pair (exact): even i as
// 1024 + u - 1024, odd i as (1024 + 16 u) / 16 - 64 in one HFMA2 (no shift).
__device__ __forceinline__ uint32_t dec_u4_f16(uint32_t x, int i) {
  const uint32_t y = i >= 2 ? x >> 8 : x;
  uint32_t h, d;
  if (i & 1) {
    asm("lop3.b32 %0, %1, 0x00f000f0, %2, 0xEA;" : "=r"(h) : "r"(y), "r"(0x64006400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(h), "r"(0x2c002c00u), "r"(0xd400d400u)); // 1/16, -64
  } else {
    asm("lop3.b32 %0, %1, 0x000f000f, %2, 0xEA;" : "=r"(h) : "r"(y), "r"(0x64006400u));
    d = dec_hsub(h, 0x64006400u);
  }
  return d;
}
// A 16-bit pair of e4m3 values -> the fp16 pair (exact).
__device__ __forceinline__ uint32_t dec_e4m3_f16(uint16_t v) {
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(v));
  return d;
}

// The k-operand register of k-step u of a piece: logical columns {2c, 2c+1}
// (hi = 0) or {2c+8, 2c+9} (hi = 1).
template <class C> __device__ __forceinline__ uint32_t k_op(const uint32_t *w, int u, int hi) {
  static_assert(C::K::k16 || C::KDT == ATTND_DT_FP16, "converted K operands are fp16");
  if constexpr (C::K::kI4)
    return dec_u4_f16(w[u >> 1], 2 * (u & 1) + hi);
  else if constexpr (C::K::k16)
    return word16<C::KV, C::KDT>(w[2 * u + hi]);
  else if constexpr (C::K::kInt8)
    return dec_u8_f16(w[u] ^ 0x80808080u, hi ? 0x4342 : 0x4140); // bytes 2h, 2h + 1
  else
    return dec_e4m3_f16((uint16_t)(hi ? w[u] >> 16 : w[u]));
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
// Channels jj and jj ^ 1 share their first permute (the compiler merges it).
template <class C> __device__ __forceinline__ uint32_t v_pair(const uint32_t *xa, const uint32_t *xb, int jj) {
  if constexpr (C::K::kI4) {
    const uint32_t x = __byte_perm(xa[jj >> 3], xb[jj >> 3], (jj & 4) ? 0x7632 : 0x5410);
    static_assert(C::PDT == ATTND_DT_FP16, "int4 P V operands are fp16");
    return dec_u4_f16(x, jj & 3);
  } else if constexpr (C::K::k16) {
    return word16<C::KV, C::PDT>(__byte_perm(xa[jj >> 1], xb[jj >> 1], (jj & 1) ? 0x7632 : 0x5410));
  } else {
    const uint32_t wa = xa[jj >> 2], wb = xb[jj >> 2];
    const int j = jj & 2; // t = bytes (a.j, b.j, a.j+1, b.j+1)
    const uint32_t t = __byte_perm(wa, wb, (unsigned)(j | (j + 4) << 4 | (j + 1) << 8 | (j + 5) << 12));
    if constexpr (C::K::kInt8 && C::PDT == ATTND_DT_FP16) {
      return dec_u8_f16(t ^ 0x80808080u, (jj & 1) ? 0x4342 : 0x4140);
    } else if constexpr (C::K::kInt8) {
      return dec_s8_bf16(__byte_perm(wa, wb, (unsigned)((jj & 3) | ((jj & 3) + 4) << 8)));
    } else if constexpr (C::PDT == ATTND_DT_FP16) {
      return dec_e4m3_f16((uint16_t)((jj & 1) ? t >> 16 : t));
    } else {
      return pair8<C::KV, C::PDT>(wa, wb, jj & 3, jj & 3);
    }
  }
}

// cp.async of 16 bytes to a shared address; nbytes 0: zero-filled, nothing read.
__device__ __forceinline__ void dec_cp16(uint32_t dst, const void *src, int nbytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(nbytes));
}
__device__ __forceinline__ void dec_cp16(uint32_t dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// A lane's share of every chunk copy of a piece, computed once per piece: a
// chunk's K rows are KS * RB contiguous bytes of its block (so are its V
// rows), so copy i of a lane reads bytes 16 (lane + 32 i) of them and only
// the swizzled shared-memory offsets need registers. (The per-chunk address
// arithmetic was ~110 of the ~740 instructions of an int8 chunk.)
template <class C> struct DecCopy {
  static constexpr int NI = (C::KS * C::CPR) / 32; // 16-byte copies per lane, K and V each
  static constexpr int RSTEP = 32 / C::CPR;        // rows between copy i and i + 1
  uint32_t dst[NI];   // offsets in a stage (K; V at + KS * RB)
  int row0;           // row of copy 0 (copy i: row0 + i * RSTEP)
  int lbs;            // log2 of the block size
  int rowbase;        // first row of the kv head in a block's [kv head][token] order
  size_t vreg;        // bytes from a block's K rows to its V rows
  size_t sc;          // kDyn lanes 0..7: from a block's start to their scales, less 4 rib
  static_assert(C::CPR <= 32 && 32 % C::CPR == 0, "a lane's copies are rows apart by a constant");
};

template <class C> __device__ __forceinline__ void dec_copy_init(const DecodeParams &P, int kvh, int lane,
                                                                 DecCopy<C> &cp) {
  constexpr int CPR = C::CPR, RB = C::RB;
  cp.row0 = lane / CPR;
#pragma unroll
  for (int i = 0; i < DecCopy<C>::NI; i++) {
    const int r = cp.row0 + i * DecCopy<C>::RSTEP, cc = lane % CPR;
    cp.dst[i] = (uint32_t)(r * RB + ((cc ^ dec_swz<CPR>(r)) << 4));
  }
  cp.lbs = __ffs(P.bs) - 1;
  cp.rowbase = kvh * P.bs;
  cp.vreg = (size_t)P.kv_heads * P.bs * RB;
  cp.sc = 2 * cp.vreg + ((size_t)(lane >> 2) * P.kv_heads * P.bs + (lane & 3) * 4) * 4;
}

// cp.async of the chunk of 16 keys at j0 (all in block blk: chunks are
// 16-aligned, blocks hold >= 16 keys) into the stage at shared address sb;
// rows past jmax are zero-filled, so a stale tail of the block is never read
// as a value. The caller reads blk from the block table a chunk ahead (its
// latency then hides behind a chunk's math instead of stalling the copies).
template <class C>
__device__ __forceinline__ void dec_issue(const DecodeParams &P, const DecCopy<C> &cp, int32_t blk, int j0,
                                          int jmax, uint32_t sb, int lane) {
  constexpr int KS = C::KS, RB = C::RB, NI = DecCopy<C>::NI, RS = DecCopy<C>::RSTEP;
  const int nval = min(KS, jmax - j0 + 1);
  const uint8_t *base = P.cache + (size_t)blk * P.block_bytes;
  const int rib = cp.rowbase + (j0 & ((1 << cp.lbs) - 1)); // row in the block's [kv head][token] order
  const uint8_t *kp = base + (size_t)rib * RB + lane * 16, *vp = kp + cp.vreg;
  if (nval == KS) {
#pragma unroll
    for (int i = 0; i < NI; i++) {
      dec_cp16(sb + cp.dst[i], kp + 512 * i);
      dec_cp16(sb + KS * RB + cp.dst[i], vp + 512 * i);
    }
  } else {
#pragma unroll
    for (int i = 0; i < NI; i++) {
      const int nb = cp.row0 + i * RS < nval ? 16 : 0;
      dec_cp16(sb + cp.dst[i], kp + 512 * i, nb);
      dec_cp16(sb + KS * RB + cp.dst[i], vp + 512 * i, nb);
    }
  }
  if constexpr (C::K::kDyn) {
    if (lane < 8) {
      const int k4 = (lane & 3) * 4;
      const int nb = max(0, min(4, nval - k4)) * 4;
      dec_cp16(sb + 2 * KS * RB + (lane >> 2) * KS * 4 + k4 * 4, base + cp.sc + (size_t)rib * 4, nb);
    }
  }
}

// Asks the copy engine to bring n bytes at p into L2 (sm_90; a hint, no data
// moves to the SM). Launch option debug bit 16 (timing A/B): the CTA of kv
// head 0 prefetches whole blocks, every kv head's K and V rows, so that the
// CTAs of one item find them in L2 and DRAM sees one long read per block.
__device__ __forceinline__ void dec_prefetch_l2(const void *p, uint32_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(n) : "memory");
#else
  (void)p;
  (void)n;
#endif
}

// This CTA's rows of block blk into L2: its kv head's K rows and V rows
// (bs RB bytes each, contiguous) and, for the dynamic types, its K and V
// scales (bs floats each), which the chunk copies would otherwise fetch from
// DRAM 64 bytes at a time.
// Every offset comes from the parameters (constant bank) and kvh, so that
// nothing of it stays in registers through the key loop (the refill-read copy
// of debug 32 keeps no DecCopy state live there).
template <class C> __device__ __forceinline__ void dec_prefetch_own(const DecodeParams &P, int kvh, int32_t blk) {
  const size_t vreg = (size_t)P.kv_heads * P.bs * C::RB, rowbase = (size_t)kvh * P.bs;
  const uint8_t *b = P.cache + (size_t)blk * P.block_bytes;
  const uint8_t *k = b + rowbase * C::RB;
  const uint32_t n = (uint32_t)P.bs * C::RB;
  dec_prefetch_l2(k, n);
  dec_prefetch_l2(k + vreg, n);
  if constexpr (C::K::kDyn) {
    const uint8_t *ks = b + 2 * vreg + rowbase * 4;
    dec_prefetch_l2(ks, (uint32_t)P.bs * 4);
    dec_prefetch_l2(ks + (size_t)P.kv_heads * P.bs * 4, (uint32_t)P.bs * 4);
  }
}

// The chunk copy as main had it before decode-perf (launch option debug bit 4,
// timing A/B only, results exact): the block-table entry read at the refill
// and each copy's addresses computed from its row. Its loop spread the 8
// copies of an 8-bit chunk over ~110 instructions, and the light-math types
// ran faster with it (bench/RESULTS.md, decode-perf round).
template <class C>
__device__ __forceinline__ void dec_issue_ref(const DecodeParams &P, const int32_t *bt, int kvh, int j0, int jmax,
                                              uint8_t *sb, int lane) {
  constexpr int KS = C::KS, RB = C::RB, CPR = C::CPR;
  const int nval = min(KS, jmax - j0 + 1);
  const size_t blk = (size_t)bt[j0 >> (__ffs(P.bs) - 1)] * P.block_bytes;
  const int rib = kvh * P.bs + (j0 & (P.bs - 1));
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
      const uint8_t *src = P.cache + blk + 2 * v_region + ((size_t)which * P.kv_heads * P.bs + rib + k4) * 4;
      cp_async16n(sb + 2 * KS * RB + which * KS * 4 + k4 * 4, nb ? src : P.cache, nb);
    }
  }
}

} // namespace attnd

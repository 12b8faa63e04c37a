// prefill_sm90_cfg.cuh: tile shapes, shared-memory layout and the element
// conversion of the Hopper prefill kernel (prefill_sm90_impl.cuh).
#pragma once

#include <stdint.h>

#include "primitives.cuh"

namespace attnd {
namespace sm90 {

constexpr int kThreads = 384; // producer warpgroup + two consumer warpgroups
constexpr int kCvt = 96;      // finishing threads (producer warps 1-3)
// The dynamic types add a fourth warpgroup of finishing warps (warps 12-15,
// Cfg::kThreads 512, D <= 128; sched bit 14 leaves it idle):
// a tile's conversion is then shared by 224 threads instead of 96, so its
// latency (the bound of the converted appends: bench/RESULTS.md) is 2-3 rounds
// of units per thread instead of 5-6, and every scheduler has two finishing
// warps. Registers at 512 threads (64 K / 512 = 128 at launch): 56 for the
// producer and the fourth warpgroup, 200 for the consumers.
constexpr int kThreads4 = 512;
constexpr int kRegsProducerCvt4 = 56, kRegsConsumerCvt4 = 200;
constexpr int kBMq = 128;     // query vectors per CTA (64 per consumer warpgroup)
constexpr int kMaxFlags = 1024;
// Registers per thread after setmaxnreg (384 threads share 64 K): 16-bit
// caches, whose producer warpgroup only copies (or converts a word per
// pair), 40 / 232; the 8-bit and int4 caches 72 / 208, so that the finishing
// loop's units and the opt-in forms' state stay in registers (sched bits 12
// and 13 spilled 52-68 bytes at 40 and 12 at 64; no spill at 72 / 208,
// ptxas -warn-spills). On the H200 (bench/RESULTS.md, prefill5) 72 / 208 ran
// the append over the dynamic types 11% faster, static int8 / fp8 2-3%,
// int4 the same; the fp16 cache under bf16 6% slower (kept at 40 / 232).
// The budget is what the CTA holds at launch, not the register file: 384
// threads launch at 168 registers each (64 K / 384 rounded down to a multiple
// of 8), so the warpgroups' counts after setmaxnreg sum to at most 3 x 168 =
// 504 (40 + 2 x 232); a setmaxnreg.inc past what the others released waits
// forever (48 / 232, 512 in all, hung every launch on the H100).
constexpr int kRegsProducer = 40, kRegsConsumer = 232;
constexpr int kRegsProducerCvt = 72, kRegsConsumerCvt = 208;

// Tile shapes and the shared-memory layout of one instantiation (bytes from a
// 1024-aligned base; every operand tile is 1024-aligned for the swizzle).
template <int D, int DT, int KV> struct Cfg {
  using K = KvT<KV>;
  static constexpr bool kDirect =
      (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) || (KV == ATTND_KV_FP16 && DT == ATTND_DT_FP16);
  static constexpr bool kDyn = K::kDyn;
  static constexpr bool kStatic = K::kStatic;
  // The fourth warpgroup of finishing warps (above): the dynamic types at D
  // <= 128 (at D 256 the P V product's wgmma needs more than the 128
  // registers a thread of 512 has at launch: ptxas refuses it). On the H100
  // (bench/RESULTS.md) it ran the append over int8_dynamic / fp8_dynamic 9% /
  // 8% faster and causal over fp8_dynamic 8%, but static fp8 and int4 5-6%
  // slower and static int8 1-3% slower: those keep 384 threads.
  static constexpr bool kWg3 = kDyn && D <= 128;
  static constexpr int kThreads = kWg3 ? kThreads4 : sm90::kThreads;
  static constexpr int kRegsP = K::k16 ? kRegsProducer : kWg3 ? kRegsProducerCvt4 : kRegsProducerCvt;
  static constexpr int kRegsC = K::k16 ? kRegsConsumer : kWg3 ? kRegsConsumerCvt4 : kRegsConsumerCvt;
  // Registers per thread at launch (__launch_bounds__(kThreads, 1)): 64 K
  // over the threads, in multiples of 8; setmaxnreg moves registers between
  // the warpgroups of the CTA, within that allocation.
  static constexpr int kRegsLaunch = (65536 / kThreads) / 8 * 8;
  static_assert((kWg3 ? 2 * kRegsP + 2 * kRegsC : kRegsP + 2 * kRegsC) <=
                    (kThreads / 128) * kRegsLaunch,
                "the warpgroups' registers after setmaxnreg fit the CTA's allocation at launch");
  // The finishing loop loads the next round's units before this round's
  // stores by default for static int8 / fp8 (5.7% / 3.1% faster on the
  // H200, the append; the dynamic types and int4 within 1%); sched bit 13
  // selects the other form.
  static constexpr bool kPf = kStatic && !K::kI4;
  // The P V product's operand dtype, P's shift and the dynamic types'
  // V-scale reference: the tiled kernel's (Tiled::PDT, tiled_kernel.cuh), so
  // that both round P the same way.
  static constexpr int PDT = (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) ? ATTND_DT_BF16
                             : kDyn                                       ? DT
                                                                          : ATTND_DT_FP16;
  static constexpr float kPShift = PDT == ATTND_DT_FP16 ? 14.f : 0.f;
  static constexpr bool kSigma = kDyn && PDT == ATTND_DT_FP16;
  static constexpr int RB = K::k16 ? 2 * D : K::kI4 ? D / 2 : D;
  // Keys per tile: shared memory bound (Q, and for static types q's lo half,
  // the operand stages, the raw stages). Every converted type at D 128 takes
  // 64, so that three operand and raw stages fit: with tiles of 128 only two
  // fit (dynamic types, int4; static int8/fp8 not even that beside the lo
  // half), and the conversion of a tile then has half a tile's products to
  // hide behind instead of one and a half (bench/RESULTS.md, prefill4: the
  // dynamic types at 2.4x the bf16 time with two stages of 128).
  static constexpr int BN = kDirect ? (D == 256 ? 64 : 128) : D == 64 ? 128 : D == 128 ? 64 : 32;
  static constexpr int CH = D / 64;          // 64-element (128-byte) column chunks
  static constexpr uint32_t KT = BN * D * 2; // one operand tile (K or V)
  static constexpr uint32_t kQ = 0;          // [CH][kBMq][128 B]
  // Static types: q's lo half (per channel scales), the same layout.
  static constexpr uint32_t kQlo = kQ + kBMq * D * 2;
  static constexpr uint32_t kOp =
      kQlo + (kStatic ? kBMq * D * 2 : 0); // [kStages][K, V][CH][BN][128 B]
  // Converting types: a raw stage per stage, each K [BN][RB], V [BN][RB], then
  // (dynamic types) the K and V scales [2][BN] fp32, read there by the consumers.
  static constexpr uint32_t kRawStage = kDirect ? 0 : 2 * BN * RB + (kDyn ? 2 * BN * 4 : 0);
  // Dynamic types: the K and V scales of each operand stage [2][BN] fp32, put
  // there by the finishing warps (from the raw stage, zero past the visible
  // keys) and read there by the consumers, so that the raw stage is free once
  // converted (raw_empty, as the other converted types).
  static constexpr uint32_t kSclStage = kDyn ? 2 * BN * 4 : 0;
  static constexpr uint32_t kTail = 16 * 8 + (KV == ATTND_KV_INT4 ? kBMq * 4 : 0);
  // Pipeline stages: three where shared memory allows (16-bit caches at D <=
  // 128; converted types where three operand and raw stages fit beside every
  // tile flag and the alignment slack: every converted type at D <= 128, the
  // dynamic ones at D 256), else two.
  static constexpr int kStages =
      kDirect ? (D <= 128 ? 3 : 2)
              : (kOp + 3 * (2 * KT + kRawStage + kSclStage) + kMaxFlags + kTail + 16 * 8 + 1024 <=
                         232448
                     ? 3
                     : 2);
  static constexpr uint32_t kRaw = kOp + kStages * 2 * KT;
  static constexpr uint32_t kScl = kRaw + kStages * kRawStage;   // [kStages][2][BN] fp32
  static constexpr uint32_t kFlags = kScl + kStages * kSclStage; // [kNF] u8 interval tile flags
  // Flags for the first kNF key tiles (later tiles are masked per element, never skipped).
  static constexpr int kNF = kFlags + kMaxFlags + kTail <= 232448 ? kMaxFlags : 512;
  static constexpr uint32_t kC = kFlags + kNF; // int4: [kBMq] fp32 q'.z_k
  static constexpr uint32_t kBar = kC + (KV == ATTND_KV_INT4 ? kBMq * 4 : 0);
  static constexpr uint32_t kEnd = kBar + 16 * 8; // mbarriers
  // Slack to align the base to 1024 bytes by hand where it fits; else the
  // kernel relies on dynamic shared memory starting 1024-aligned (it checks).
  static constexpr uint32_t kSlack = kEnd + 1024 <= 232448 ? 1024 : 0;
  static constexpr uint32_t kBytes = kEnd + kSlack;
  static_assert(kBytes <= 232448, "shared memory of one CTA");
  static_assert(RB % 16 == 0, "raw rows are whole 16-byte units");
  static_assert(kQlo % 1024 == 0 && kOp % 1024 == 0 && KT % 1024 == 0,
                "operand tiles 1024-aligned");
};

// 16 raw bytes -> K::kElemPerChunk operand elements of dtype ODT (packed
// pairs), values as stored (exact; int8 and e4m3 through primitives.cuh's
// pair8, 16-bit words through word16, int4 nibbles through chunk_elem), as
// the tiled kernel converts them.
template <int KV, int ODT>
__device__ __forceinline__ void convert16(const uint4 &rv, uint32_t *out) {
  using K = KvT<KV>;
  const uint32_t *w = &rv.x;
#pragma unroll
  for (int e = 0; e < K::kElemPerChunk; e += 2) {
    if constexpr (K::kInt8 || K::kFp8)
      out[e / 2] = pair8<KV, ODT>(w[e >> 2], w[e >> 2], e & 3, (e & 3) + 1);
    else if constexpr (K::k16)
      out[e / 2] = word16<KV, ODT>(w[e >> 1]);
    else
      out[e / 2] = Act<ODT>::pack2(chunk_elem<KV>(rv, e), chunk_elem<KV>(rv, e + 1));
  }
}

// The same conversion with fewer instructions (the default; sched bit 9
// restores convert16), bit for bit the same values: int8 -> bf16 pairs by
// bf16 arithmetic on two lanes at once instead of two fp32 magic-number
// subtractions and a pack (int8 s = l - 128 b with l its low 7 bits and b its
// sign bit: (128 + l) - (128 + 128 b), both bf16 operands and the difference
// exact, 4 instructions per pair instead of 5); int4 nibble pairs (channels
// 2c, 2c + 1: low and high nibble of one byte) moved into the two lanes by one
// byte permute of the word and the word shifted by a nibble, then into the
// low mantissa bits of a magic number as pair4 does (3 instructions per pair
// instead of 9). int8 into
// fp16 and e4m3 are convert16's (already two values per instruction).
// (a & m) | c in one LOP3 (written as C, the compiler splits it into two
// instructions with an immediate each).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t m, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(m), "r"(c));
  return d;
}
// h - c on two lanes of dtype DT (exact here: integers the dtype holds).
template <int DT> __device__ __forceinline__ uint32_t sub2(uint32_t h, uint32_t c) {
  if constexpr (DT == ATTND_DT_FP16) {
    const __half2 r =
        __hsub2(*reinterpret_cast<const __half2 *>(&h), *reinterpret_cast<const __half2 *>(&c));
    return *reinterpret_cast<const uint32_t *>(&r);
  } else {
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162 *>(&h),
                                     *reinterpret_cast<const __nv_bfloat162 *>(&c));
    return *reinterpret_cast<const uint32_t *>(&r);
  }
}
template <int KV, int ODT>
__device__ __forceinline__ void convert16_fast(const uint4 &rv, uint32_t *out) {
  using K = KvT<KV>;
  const uint32_t *w = &rv.x;
  if constexpr (K::kInt8 && ODT == ATTND_DT_BF16) {
#pragma unroll
    for (int e = 0; e < 16; e += 2) {
      // bytes e & 3 and (e & 3) + 1 of the word into the lanes' low bytes
      const uint32_t p =
          __byte_perm(w[e >> 2], 0u, (unsigned)(e & 3) | ((unsigned)((e & 3) + 1) << 8));
      out[e / 2] = sub2<ATTND_DT_BF16>(and_or(p, 0x007f007fu, 0x43004300u),
                                       and_or(p, 0x00800080u, 0x43004300u));
    }
  } else if constexpr (K::kI4) {
    // u + 1024 (fp16) or u + 128 (bf16), then the magic number subtracted.
    constexpr uint32_t kMagic = ODT == ATTND_DT_FP16 ? 0x64006400u : 0x43004300u;
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const uint32_t x = w[q], x4 = x >> 4;
#pragma unroll
      for (int b = 0; b < 4; b++) // byte b: elements 8 q + 2 b (low nibble), 8 q + 2 b + 1
        out[q * 4 + b] = sub2<ODT>(
            and_or(__byte_perm(x, x4, (unsigned)b | ((unsigned)(b + 4) << 8)), 0x000f000fu, kMagic),
            kMagic);
    }
  } else {
    convert16<KV, ODT>(rv, out);
  }
}

// FlashMask intervals: primitives.cuh's classify_tiles (the same bits 0 and
// 1, so that the Hopper path skips exactly the tiled kernel's keys) plus
// bit 2: no interval of any in-range key of the tile meets the rows [pmin,
// pmax], so the tile's per-element mask is the causal / window / range one
// alone (the cheap per-row ranges instead of four interval reads per key; the
// diagonal tiles of a document mask). nw warps from warp 0.
template <int BN>
__device__ void classify_tiles_sm90(const attnd_kitem_t &it, const int32_t *iv, int kv_len, int lo,
                                    int hi, int jfirst, int ntiles, int nflags, int pmin, int pmax,
                                    int win, int nw, uint8_t *flags) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n = min(ntiles, nflags);
  // Two tiles per warp and round, every read at a key clamped into [lo, hi]
  // (0 <= lo <= hi < kv_len when any tile runs) instead of under a branch:
  // 8 BN / 32 loads of a lane in flight together (tiles past n are computed
  // and not stored).
  for (int t0 = warp; t0 < n; t0 += 2 * nw) {
    bool masked_all[2], vis_all[2], nohit[2];
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const int t = t0 + q * nw;
      masked_all[q] = vis_all[q] = nohit[q] = true;
#pragma unroll
      for (int h2 = 0; h2 < BN / 32; h2++) {
        const int j = jfirst + t * BN + h2 * 32 + lane, jc = min(max(j, lo), hi);
        const int a = __ldg(iv + jc), bb = __ldg(iv + kv_len + jc), c = __ldg(iv + 2 * kv_len + jc),
                  dd = __ldg(iv + 3 * kv_len + jc);
        if (j < kv_len && j >= lo && j <= hi) {
          const bool cov1 = a <= pmin && pmax < bb, cov2 = c <= pmin && pmax < dd;
          const bool cov12 = a <= pmin && c <= bb && pmax < dd; // the union covers
          masked_all[q] &= (it.causal && j > pmax) || cov1 || cov2 || cov12;
          const bool hit1 = a < bb && a <= pmax && pmin < bb,
                     hit2 = c < dd && c <= pmax && pmin < dd;
          vis_all[q] &= !(it.causal && j > pmin) && !hit1 && !hit2 && !(win > 0 && j <= pmax - win);
          nohit[q] &= !hit1 && !hit2;
        } else {
          vis_all[q] = false;
        }
      }
    }
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const bool m = __all_sync(0xffffffffu, masked_all[q]),
                 v = __all_sync(0xffffffffu, vis_all[q]), h = __all_sync(0xffffffffu, nohit[q]);
      if (lane == 0 && t0 + q * nw < n)
        flags[t0 + q * nw] = (m ? 1 : 0) | (v ? 0 : 2) | (h ? 4 : 0);
    }
  }
}

} // namespace sm90
} // namespace attnd

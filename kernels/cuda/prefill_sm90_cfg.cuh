// prefill_sm90_cfg.cuh: tile shapes, shared-memory layout and the element
// conversion of the Hopper prefill kernel (prefill_sm90_impl.cuh).
#pragma once

#include <stdint.h>

#include "primitives.cuh"

namespace attnd {
namespace sm90 {

constexpr int kThreads = 384; // producer warpgroup + two consumer warpgroups
constexpr int kCvt = 96;      // finishing threads (producer warps 1-3)
constexpr int kBMq = 128;     // query vectors per CTA (64 per consumer warpgroup)
constexpr int kMaxFlags = 1024;
constexpr int kRegsProducer = 40, kRegsConsumer = 232;

// Tile shapes and the shared-memory layout of one instantiation (bytes from a
// 1024-aligned base; every operand tile is 1024-aligned for the swizzle).
template <int D, int DT, int KV> struct Cfg {
  using K = KvT<KV>;
  static constexpr bool kDirect =
      (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) || (KV == ATTND_KV_FP16 && DT == ATTND_DT_FP16);
  static constexpr bool kDyn = K::kDyn;
  static constexpr bool kStatic = K::kStatic;
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
  // the operand stages, the raw stages). Static int8/fp8 at D 128 take 64:
  // 128 would leave no room for the lo half.
  static constexpr int BN = kDirect    ? (D == 256 ? 64 : 128)
                            : D == 64  ? 128
                            : D == 128 ? (RB <= 128 && !(kStatic && !K::kI4) ? 128 : 64)
                                       : 32;
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
  static constexpr uint32_t kTail = 16 * 8 + (KV == ATTND_KV_INT4 ? kBMq * 4 : 0);
  // Pipeline stages: three where shared memory allows (16-bit caches at D <=
  // 128; converted types where three operand and raw stages fit beside every
  // tile flag and the alignment slack: static int8/fp8 at D <= 128, the
  // others at D 64), else two.
  static constexpr int kStages =
      kDirect
          ? (D <= 128 ? 3 : 2)
          : (kOp + 3 * (2 * KT + kRawStage) + kMaxFlags + kTail + 16 * 8 + 1024 <= 232448 ? 3 : 2);
  static constexpr uint32_t kRaw = kOp + kStages * 2 * KT;
  static constexpr uint32_t kFlags = kRaw + kStages * kRawStage; // [kNF] u8 interval tile flags
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

// prefill_sm90_copy.cuh: the copy side of the Hopper prefill kernel
// (prefill_sm90_impl.cuh, which documents the pipeline): the producer
// thread's copies of every live key tile into the stage ring and the
// finishing warps' conversion of converted tiles into operand tiles (and the
// zeroed V rows of a 16-bit cache's tail tile). Included only by
// prefill_sm90_impl.cuh; both run inside its kernel.
#pragma once

#include <type_traits>

#include "prefill_sm90.cuh"
#include "prefill_sm90_cfg.cuh"
#include "sm90_primitives.cuh"

namespace attnd {
namespace sm90 {

// What the copy side and the consumers of one CTA share: the stage ring
// (kS stages of Cfg's layout from smem, mbarrier i at bar0 + 8 i), the live
// key tiles (ntiles of BN keys from jfirst, interval tiles whose flag bit 0 is
// set skipped, the visible keys ending at lastkey) and the pipeline's choices.
struct Ring {
  uint8_t *smem;
  const uint8_t *flags; // FlashMask interval tile flags (kind ATTND_MASK_INTERVALS)
  const int32_t *bt;    // the item's block table
  uint32_t bar0;
  int kind, ntiles, jfirst, lastkey, kS, kvh;
  bool raw_early, kvsplit;
  // Converted types: 0 convert16_fast (the default), 1 convert16 (sched bit
  // 9, the earlier instructions, the same values), 2 no conversion at all
  // (bit 10, timing only: the operand tiles keep whatever they held).
  int cvt;
  bool swz; // converted 8-bit types: the bank-conflict-free unit order (sched bit 11)
  // Converted types, sched bit 12: the producer warp converts too (nfin =
  // 128 finishing threads, warp 0 lane 0 issuing each tile's copies between
  // its conversions, ring_finish), else warps 1-3 (nfin = kCvt).
  bool merged;
  int nfin;
  bool pf; // the next round's loads before this round's stores (Cfg::kPf, sched bit 13)
  __device__ __forceinline__ uint32_t bar(int i) const {
    return bar0 + 8u * (uint32_t)i;
  }
  // First live tile index >= t, or ntiles (flags exist for the first NF tiles).
  template <int NF> __device__ __forceinline__ int next_tile(int t) const {
    if (kind == ATTND_MASK_INTERVALS)
      while (t < ntiles && t < NF && (flags[t] & 1))
        t++;
    return t;
  }
};

// Converted types: the 1-D bulk copies of live tile t's raw rows (and the
// dynamic types' scales) into raw stage s, completing on raw_full (the
// caller has waited for the stage to be free).
template <int D, int DT, int KV>
__device__ __forceinline__ void ring_copy_raw(const FlashParams &F, const Ring &g, int t, int s) {
  using C = Cfg<D, DT, KV>;
  constexpr int BN = C::BN, RB = C::RB;
  const int R = min(F.bs, BN), nbox = BN / R;
  const int bs_shift = __ffs(F.bs) - 1, bs_mask = F.bs - 1;
  const size_t v_region = (size_t)F.kv_heads * F.bs * RB;
  const int j0 = g.jfirst + t * BN, kvh = g.kvh;
  const int nvalid = min(nbox, (g.lastkey - j0) / R + 1);
  const uint32_t bar = g.bar(s);
  const uint32_t per = 2u * R * RB + (C::kDyn ? 2u * R * 4u : 0u);
  mbar_arrive_expect_tx(bar, (uint32_t)nvalid * per);
  const uint32_t dRaw = smem_u32(g.smem + C::kRaw + s * C::kRawStage), dS = dRaw + 2 * BN * RB;
  for (int b = 0; b < nvalid; b++) {
    const int j = j0 + b * R, blk = g.bt[j >> bs_shift], ro = j & bs_mask;
    const uint8_t *src = F.cache + (size_t)blk * F.block_bytes + (size_t)(kvh * F.bs + ro) * RB;
    bulk_load(dRaw + b * R * RB, src, R * RB, bar);
    bulk_load(dRaw + BN * RB + b * R * RB, src + v_region, R * RB, bar);
    if constexpr (C::kDyn) {
      const uint8_t *ss =
          F.cache + (size_t)blk * F.block_bytes + 2 * v_region + (size_t)(kvh * F.bs + ro) * 4;
      bulk_load(dS + b * R * 4, ss, R * 4, bar);
      bulk_load(dS + BN * 4 + b * R * 4, ss + (size_t)F.kv_heads * F.bs * 4, R * 4, bar);
    }
  }
}

// The producer (warp 0, lane 0): every copy of every live tile, in order.
template <int D, int DT, int KV>
__device__ __forceinline__ void ring_produce(const Sm90Params &P, const Ring &g) {
  using C = Cfg<D, DT, KV>;
  constexpr int BN = C::BN, CH = C::CH, RB = C::RB;
  constexpr uint32_t KT = C::KT;
  const FlashParams &F = P.f;
  uint8_t *const smem = g.smem;
  const int32_t *const bt = g.bt;
  const int ntiles = g.ntiles, jfirst = g.jfirst, lastkey = g.lastkey, kS = g.kS, kvh = g.kvh;
  const bool raw_early = g.raw_early, kvsplit = g.kvsplit;
  auto BAR = [&](int i) { return g.bar(i); };
  auto next_tile = [&](int t) { return g.template next_tile<C::kNF>(t); };
  const int R = min(F.bs, BN), nbox = BN / R; // rows per copy: one paged block or one tile
  const int bs_shift = __ffs(F.bs) - 1, bs_mask = F.bs - 1;
  const size_t v_region = (size_t)F.kv_heads * F.bs * RB;
  if constexpr (C::kDirect)
    tma_prefetch_desc(&P.tmap);
  pdl_wait(); // the cache is written by the previous kernel
  int i = 0;
  for (int t = next_tile(0); t < ntiles; t = next_tile(t + 1), i++) {
    const int j0 = jfirst + t * BN;
    const int nvalid = min(nbox, (lastkey - j0) / R + 1);
    const int s = i % kS;
    if (i >= kS && !kvsplit) // the stage's tile kS back is done with: raw_empty, else empty
      mbar_wait_wd(raw_early ? BAR(13 + s) : BAR(8 + s), ((i / kS) - 1) & 1);
    if (C::kDirect && kvsplit) {
      const uint32_t bytes = (uint32_t)nvalid * (uint32_t)R * D * 2u;
      const uint32_t dK = smem_u32(smem + C::kOp + s * 2 * KT), dV = dK + KT;
      if (i >= kS) // the consumers' Q K^T of the tile kS back is done
        mbar_wait_wd(BAR(3 + 4 * s), ((i / kS) - 1) & 1);
      mbar_arrive_expect_tx(BAR(s), bytes);
      for (int b = 0; b < nvalid; b++) {
        const int j = j0 + b * R, blk = bt[j >> bs_shift], ro = j & bs_mask;
#pragma unroll
        for (int c = 0; c < CH; c++)
          tma_load_4d(dK + (uint32_t)(c * BN * 128 + b * R * 128), &P.tmap, c * 64, ro, kvh, blk,
                      BAR(s));
      }
      if (i >= kS) // and their P V
        mbar_wait_wd(BAR(8 + s), ((i / kS) - 1) & 1);
      const uint32_t vb = lastkey + 1 - j0 < BN ? BAR(12) : BAR(13 + s);
      mbar_arrive_expect_tx(vb, bytes);
      for (int b = 0; b < nvalid; b++) {
        const int j = j0 + b * R, blk = bt[j >> bs_shift], ro = j & bs_mask;
#pragma unroll
        for (int c = 0; c < CH; c++)
          tma_load_4d(dV + (uint32_t)(c * BN * 128 + b * R * 128), &P.tmap, c * 64, ro,
                      F.kv_heads + kvh, blk, vb);
      }
    } else if constexpr (C::kDirect) {
      const uint32_t bar = lastkey + 1 - j0 < BN ? BAR(12) : BAR(s);
      mbar_arrive_expect_tx(bar, (uint32_t)nvalid * 2u * (uint32_t)R * D * 2u);
      const uint32_t dK = smem_u32(smem + C::kOp + s * 2 * KT), dV = dK + KT;
      for (int b = 0; b < nvalid; b++) {
        const int j = j0 + b * R, blk = bt[j >> bs_shift], ro = j & bs_mask;
#pragma unroll
        for (int c = 0; c < CH; c++) {
          const uint32_t off = (uint32_t)(c * BN * 128 + b * R * 128);
          tma_load_4d(dK + off, &P.tmap, c * 64, ro, kvh, blk, bar);
          tma_load_4d(dV + off, &P.tmap, c * 64, ro, F.kv_heads + kvh, blk, bar);
        }
      }
    } else {
      ring_copy_raw<D, DT, KV>(F, g, t, s);
    }
  }
}

// The finishing warps (producer warps 1-3, thread ct of kCvt; with
// Ring::merged every producer warp, below): converted tiles into operand
// tiles, and what lies past the visible keys zeroed.
// Converted types with sched bit 12 (Ring::merged): every thread of the
// producer warpgroup (ct = its index, 0-127), and warp 0 lane 0 (prod) also
// issues the copies, each tile's before the conversion of the tile kS - 1
// back (the raw stage it fills was released by the conversion of the tile
// before that, which this thread has finished; the wait is for the other
// warps'), so that the copies run as far ahead as with a producer of its
// own, and 128 threads instead of 96 share each tile (a tile of 64 keys at
// D 128, 512 units of K and of V: 4 rounds each instead of 5 or 6).
template <int D, int DT, int KV>
__device__ __forceinline__ void ring_finish(const Sm90Params &P, const Ring &g, int ct, bool prod) {
  using C = Cfg<D, DT, KV>;
  constexpr int BN = C::BN, CH = C::CH, RB = C::RB;
  constexpr uint32_t KT = C::KT;
  uint8_t *const smem = g.smem;
  const int ntiles = g.ntiles, jfirst = g.jfirst, lastkey = g.lastkey, kS = g.kS;
  const int nfin = g.nfin;
  const bool raw_early = g.raw_early;
  auto BAR = [&](int i) { return g.bar(i); };
  auto next_tile = [&](int t) { return g.template next_tile<C::kNF>(t); };
  int i = 0;
  int pt = 0, pi = 0; // prod: the next tile to copy and its ordinal
  if (!KvT<KV>::k16 && prod) {
    pdl_wait(); // the cache is written by the previous kernel
    pt = next_tile(0);
  }
  for (int t = next_tile(0); t < ntiles; t = next_tile(t + 1), i++) {
    if constexpr (!KvT<KV>::k16) { // 8-bit and int4 caches only (Cfg::kRegsP)
      if (!C::kWg3 && g.merged) {
        if (prod) {
          for (; pt < ntiles && pi < i + kS; pt = next_tile(pt + 1), pi++) {
            if (pi >= kS) // the tile kS back is converted (raw_empty)
              mbar_wait_wd(BAR(13 + pi % kS), ((pi / kS) - 1) & 1);
            ring_copy_raw<D, DT, KV>(P.f, g, pt, pi % kS);
          }
        }
        if (ct < 32)
          __syncwarp(); // warp 0 converts together again
      }
    }
    const int j0 = jfirst + t * BN;
    const int lim = min(BN, lastkey + 1 - j0); // keys [lim, BN) of the tile are never visible
    const int s = i % kS;
    uint8_t *opK = smem + C::kOp + s * 2 * KT, *opV = opK + KT;
    if constexpr (C::kDirect) {
      // Only the CTA's last tile can reach past the visible keys; the
      // consumers wait for the copy engine directly on every other tile.
      if (lim < BN) {
        mbar_wait_wd(BAR(12), 0);
        const int rows = BN - lim, n16 = CH * rows * 8;
        for (int u = ct; u < n16; u += kCvt) {
          const int c = u / (rows * 8), r = lim + (u % (rows * 8)) / 8, q = u & 7;
          *reinterpret_cast<uint4 *>(opV + c * BN * 128 + r * 128 + q * 16) =
              make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async();
        mbar_arrive(BAR(4 + s));
      }
    } else {
      mbar_wait_wd(BAR(s), (i / kS) & 1);
      if (raw_early && i >= kS) // the consumers are done with the operand tiles kS back
        mbar_wait_wd(BAR(8 + s), ((i / kS) - 1) & 1);
      constexpr int UPR = RB / 16; // raw 16-byte units per row
      constexpr int EPU = KvT<KV>::kElemPerChunk;
      const uint8_t *raw = smem + C::kRaw + s * C::kRawStage;
      // Unit u of K and of V per round, both loads first (the chain is
      // latency bound); K for Q K^T in the activation dtype, V for P V in
      // C::PDT (as tiled_dequant). Zero raw bytes convert to zero operands.
      // fast: convert16_fast, else convert16 (a template argument: no branch
      // inside the loop). (A thread keeping one unit column and stepping over
      // the keys, with no unit index divided per round, spilled registers of
      // the 40 the finishing warps have: D 256 int4 and int8.)
      // swz (sched bit 11, opt-in; 8-bit types with 8 or 16 units a row):
      // the units of two keys k, k + 1 (k even) per 2 UPR lanes, so that each
      // quarter warp stores to 8 distinct 16-byte slots of the swizzled rows
      // and loads from 8 distinct slots of the raw rows: key k takes 4 units
      // of one half of an 8-unit column block, key k + 1 the other half, the
      // next quarter the opposite (the default mapping gives a quarter warp one
      // key: its 8 units fall on 4 slots, two operand chunks apart; ncu:
      // 10.6 wavefronts per shared store request where 4 is the floor).
      // pf (Cfg::kPf, static int8 / fp8; sched bit 13 the other form): the
      // next round's two loads issued before this round's conversion and
      // stores (one round of 16-byte units in flight behind the arithmetic;
      // 8 more live registers: spilled at 40, fits Cfg::kRegsP's 72).
      auto convert_tile = [&](auto fast, auto swz, auto pf) {
        auto unit = [&](int u, int &key, int &cu) {
          if constexpr (decltype(swz)::value) {
            const int b = u % (2 * UPR), qi = b >> 3, lq = b & 7;
            cu = ((qi >> 1) << 3) | lq;
            key = 2 * (u / (2 * UPR)) + ((lq >> 2) ^ (qi & 1));
          } else {
            key = u / UPR;
            cu = u % UPR;
          }
        };
        auto load = [&](int u, uint4 &rk, uint4 &rv) {
          int key, cu;
          unit(u, key, cu);
          rk = make_uint4(0, 0, 0, 0);
          rv = make_uint4(0, 0, 0, 0);
          if (u < BN * UPR && key < lim) {
            rk = *reinterpret_cast<const uint4 *>(raw + key * RB + cu * 16);
            rv = *reinterpret_cast<const uint4 *>(raw + BN * RB + key * RB + cu * 16);
          }
        };
        auto put = [&](int u, const uint4 &rk, const uint4 &rv) {
          int key, cu;
          unit(u, key, cu);
          const int e0 = cu * EPU, q0 = (e0 & 63) >> 3;
          const uint32_t off = (e0 >> 6) * BN * 128 + key * 128;
          uint32_t o[EPU / 2];
          if constexpr (decltype(fast)::value)
            convert16_fast<KV, DT>(rk, o);
          else
            convert16<KV, DT>(rk, o);
#pragma unroll
          for (int q = 0; q < EPU / 8; q++)
            *reinterpret_cast<uint4 *>(opK + off + (((q0 + q) ^ (key & 7)) << 4)) =
                make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
          if constexpr (decltype(fast)::value)
            convert16_fast<KV, C::PDT>(rv, o);
          else
            convert16<KV, C::PDT>(rv, o);
#pragma unroll
          for (int q = 0; q < EPU / 8; q++)
            *reinterpret_cast<uint4 *>(opV + off + (((q0 + q) ^ (key & 7)) << 4)) =
                make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
        };
        if constexpr (decltype(pf)::value) {
          uint4 rk, rv;
          load(ct, rk, rv);
          for (int u = ct; u < BN * UPR; u += nfin) {
            uint4 nk, nv;
            load(u + nfin, nk, nv);
            put(u, rk, rv);
            rk = nk;
            rv = nv;
          }
        } else {
          for (int u = ct; u < BN * UPR; u += nfin) {
            uint4 rk, rv;
            load(u, rk, rv);
            put(u, rk, rv);
          }
        }
      };
      // The types convert16_fast changes (int8 into bf16, int4) get both
      // instruction forms; the 8-bit types with 8 or 16 units a row the swz
      // order; each default and swz loop with and without pf.
      constexpr bool kFastForm =
          (KvT<KV>::kInt8 && (DT == ATTND_DT_BF16 || C::PDT == ATTND_DT_BF16)) || KvT<KV>::kI4;
      constexpr bool kSwzForm = (KvT<KV>::kInt8 || KvT<KV>::kFp8) && UPR % 8 == 0;
      using F0 = std::integral_constant<bool, false>;
      using T1 = std::integral_constant<bool, true>;
      using FF = std::integral_constant<bool, kFastForm>;
      if constexpr (C::kWg3) {
        // 512 threads (Cfg::kWg3): the default form only, so that the
        // finishing code fits its 56 registers (the opt-in forms, sched bits
        // 9, 11 and 13, measured no faster with 96 threads; bit 10 stays).
        if (g.cvt != 2)
          convert_tile(FF{}, F0{}, std::integral_constant<bool, C::kPf>{});
      } else if (g.cvt == 1 && kFastForm) {
        convert_tile(F0{}, F0{}, F0{});
      } else if (g.cvt != 2) {
        bool done = false;
        if constexpr (kSwzForm) {
          if (g.swz && g.cvt == 0) {
            if (g.pf)
              convert_tile(FF{}, T1{}, T1{});
            else
              convert_tile(FF{}, T1{}, F0{});
            done = true;
          }
        }
        if (!done) {
          // pf: 8-bit and int4 caches only (at the 16-bit caches' 40
          // registers its loop spills)
          if constexpr (!KvT<KV>::k16) {
            if (g.pf && g.cvt == 0) {
              convert_tile(FF{}, F0{}, T1{});
              done = true;
            }
          }
          if (!done)
            convert_tile(FF{}, F0{}, F0{});
        }
      }
      if constexpr (C::kDyn) {
        // The stage's scales, where the consumers read them; keys past the
        // visible range 0 (masked keys; stale or poisoned bytes otherwise),
        // as the tiled kernel's zero-filled copies.
        const float *rs = reinterpret_cast<const float *>(raw + 2 * BN * RB);
        float *ss = reinterpret_cast<float *>(smem + C::kScl + s * C::kSclStage);
        for (int k = ct; k < 2 * BN; k += nfin)
          ss[k] = (k % BN) < lim ? rs[k] : 0.f;
      }
      if (raw_early)
        mbar_arrive(BAR(13 + s)); // every read of the raw stage is done (its values are used)
      fence_proxy_async();
      mbar_arrive(BAR(4 + s));
    }
  }
}

} // namespace sm90
} // namespace attnd

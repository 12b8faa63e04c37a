// prefill_sm90_impl.cuh: the body of the Hopper prefill kernel (see
// prefill_sm90.cuh). Included only by prefill_sm90_launch.cuh (the host side and
// the instantiations, for the prefill_sm90_<kv>.cu files); the copy side is
// prefill_sm90_copy.cuh.
//
// One CTA per (item, kv head, tile of kBMq = 128 query vectors, KV split), 384
// threads in three warpgroups:
//   warpgroup 0, producer (40 registers; 8-bit and int4 caches 72, Cfg::kRegsP):
//     warp 0 lane 0 issues the copies of
//     each live key tile into the stage (TMA 4-D tiles, 128B-swizzled, for
//     16-bit caches in the activation dtype; 1-D bulk copies of the raw rows
//     for every other cache type); warps 1-3 finish the stage: quantized and
//     cross-dtype tiles are converted from the raw rows into the swizzled
//     operand tiles (values as stored, exact: K in the activation dtype, V in
//     Cfg::PDT), keys past the visible range are zeroed in the V (and
//     converted K) tile so that P = 0 never meets a non-finite V;
//   warpgroups 1 and 2, consumers (232 registers; 8-bit and int4 caches 208): 64
//     query vectors each;
//     S = Q K^T (wgmma, both operands in shared memory; a second product from
//     q's lo half for per-channel static scales), the online softmax in
//     registers, O += P V (wgmma, P from registers, V N-major).
// Pipeline per key tile i, stage i % kStages: the producer waits for the
// consumers to release the stage (empty), the copy engine completes on
// raw_full, the finishing warps arrive on full, and the consumers wait for
// full. Inside a consumer, tile i's Q K^T is issued together with tile i-1's
// P V and the softmax of tile i runs while P V is still on the tensor cores
// (intra-warpgroup overlap); with pingpong the two consumers also take turns
// issuing their products (named barriers), so one's softmax hides behind the
// other's.
//
// Numerics: line for line the tiled kernel's (tiled_kernel.cuh: tiled_load_q,
// tiled_tile, tiled_write); the fp32 operations that turn a score into P are
// written with explicit rounding (__fmul_rn, __fadd_rn) so that no
// contraction makes them differ from its FMUL, FADD, FADD (but in the opt-in
// FF kernels: one FFMA, within one rounding of P's exponent).
#pragma once

#include <math.h>
#include <string.h>

#include "prefill_sm90.cuh"
#include "prefill_sm90_cfg.cuh"
#include "prefill_sm90_copy.cuh"
#include "sm90_primitives.cuh"

namespace attnd {
namespace sm90 {

// LO: q split into hi + lo halves with a second Q K^T product (per-channel
// static scales; int4 always), a template argument so that no branch sits
// between the wgmma instructions (ptxas would fence them). FF: scores to P
// by one FFMA (opt-in, sched bit 3, 16-bit caches in the activation dtype
// only), a template argument so that the default softmax stays straight-line
// code (as runtime branches, both forms measured ~10% slower on the H200).
template <int D, int DT, int KV, bool LO, bool FF>
__global__ void __launch_bounds__(Cfg<D, DT, KV>::kThreads, 1)
    prefill_sm90_kernel(const __grid_constant__ Sm90Params P) {
#if ATTND_SM90_DEVICE
  using C = Cfg<D, DT, KV>;
  using A = Act<DT>;
  using PA = Act<C::PDT>; // P's dtype
  using T = typename A::T;
  constexpr int BN = C::BN;
  constexpr uint32_t KT = C::KT;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t mis = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
  if (C::kSlack == 0 && mis != 0)
    __trap(); // no room to align by hand (never seen: dynamic shared memory starts 1024-aligned)
  uint8_t *smem = smem_raw + mis;
  const FlashParams &F = P.f;

  pdl_trigger();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // blockIdx.x -> (item, kv head) group and query tile. Groups are taken P.gchunk
  // at a time, their tiles interleaved heaviest (last) first, so that the CTAs
  // resident together read the same few groups' K/V from L2.
  int group, qt;
  {
    const int per = P.gchunk * P.qtiles, chunk = blockIdx.x / per, r = blockIdx.x % per;
    const int ng = F.kv_heads * P.ngroups_items, kk = min(P.gchunk, ng - chunk * P.gchunk);
    group = chunk * P.gchunk + r % kk;
    qt = P.qtiles - 1 - r / kk;
  }
  const int item = group / F.kv_heads, kvh = group % F.kv_heads;
  const attnd_kitem_t it = F.items[item];
  if (it.q_row < 0)
    return;
  const int G = F.group, nvec = it.n * G;
  const int v0 = qt * kBMq;
  if (v0 >= nvec)
    return;
  const int split = blockIdx.z;
  const int kv_len = it.start + it.n;
  const int vend = min(v0 + kBMq, nvec);
  const int pmin = it.start + v0 / G, pmax = it.start + (vend - 1) / G;
  const int kind = it.mask_kind, mp = it.mask_param;
  const int32_t *iv = kind == ATTND_MASK_INTERVALS ? F.meta + it.intervals : nullptr;
  const int32_t *bt = F.meta + it.block_table;

  // Keys any row of this CTA may see (primitives.cuh), cut to the split's part.
  const int win = F.window;
  int lo, hi;
  key_range(it, pmin, pmax, win, lo, hi);
  if (F.nsplit > 1) {
    const int b0 = win > 0 ? lo : 0; // a sliding layer's parts cover its window only
    lo = max(lo, b0 + split * F.split_keys);
    hi = min(hi, b0 + (split + 1) * F.split_keys - 1);
  }
  const int jfirst = (lo / BN) * BN;
  const int ntiles = (hi >= lo && hi >= jfirst) ? (hi - jfirst) / BN + 1 : 0;

  uint8_t *sFlags = smem + C::kFlags;
  const uint32_t bar0 = smem_u32(smem + C::kBar);
  // Per stage s: BAR(s) raw_full (the copy engine's bytes landed), BAR(4 + s)
  // full (finishing warps done: converted tiles, and 16-bit tail tiles only),
  // BAR(8 + s) empty (consumers done with the stage). BAR(12): the bytes of
  // a 16-bit cache's tail tile (the last tile, when it reaches past the
  // visible keys) land there instead of on raw_full, so that the finishing
  // warps, which wait for no other tile, wait on a barrier used once (a
  // parity wait on raw_full could pass on a phase two uses back).
  // Stages in use: C::kStages, but for the converted types with a third
  // stage (prefill_sm90_cfg.cuh), sched bit 6 runs two of them (the earlier
  // pipeline, for the A/B).
  const int kS = C::kDirect || C::kStages < 3 || !(P.sched & 64) ? C::kStages : 2;
  auto BAR = [&](int i) -> uint32_t { return bar0 + 8u * (uint32_t)i; };
  // Converted types (the dynamic ones too: their scales move to the operand
  // stage's, Cfg::kScl): BAR(13 + s) raw_empty, the finishing warps done
  // reading raw stage s, so that the copy of a tile kS ahead is issued as
  // soon as the tile kS back is converted, not when the consumers are done
  // with it; the finishing warps then wait for empty before writing the
  // operand tiles. Copy latency then overlaps the products instead of adding
  // to each conversion (sched bit 6: the producer waits for empty, as before).
  const bool raw_early = !C::kDirect && !(P.sched & 64);
  // Converted types, sched bit 12 (with raw_early): the producer warp
  // converts too, 128 finishing threads (prefill_sm90_copy.cuh, ring_finish).
  const bool merged = !KvT<KV>::k16 && !C::kWg3 && raw_early && (P.sched & 4096) != 0;
  // The fourth warpgroup converts too unless sched bit 14 (Cfg::kWg3): its
  // threads are finishing threads nfin0 .. nfin0 + 127.
  const bool wg3 = C::kWg3 && !(P.sched & 16384);
  const int nfin0 = merged ? 128 : kCvt, nfin = nfin0 + (wg3 ? 128 : 0);
  // 16-bit caches in the activation dtype at D 256 (two stages; 8.0 vs 10.6
  // ms on the H200, causal B4 S8192; sched bit 8 turns it off) and, opt-in,
  // at D <= 128 (sched bit 7; 4-5% slower there): K and V of a stage on
  // barriers of their own, so that K's
  // copy waits only for the consumers' Q K^T of the tile kS back (emptyK,
  // BAR(3 + 4 s)) and V's for their P V (empty), and the consumers wait for V
  // (fullV, BAR(13 + s); the tail tile's V still lands on BAR(12)) only before
  // the P V that reads it, a tile after its Q K^T: each copy gets a tile more
  // to land (two stages at D 256).
  const bool kvsplit = C::kDirect && (D == 256 ? !(P.sched & 256) : (P.sched & 128) != 0);
  if (tid == 0) {
    for (int st = 0; st < C::kStages; st++) {
      mbar_init(BAR(st), 1);
      mbar_init(BAR(4 + st), nfin);
      mbar_init(BAR(8 + st), 256);
    }
    mbar_init(BAR(12), 1);
    for (int st = 0; st < C::kStages; st++) {
      mbar_init(BAR(13 + st), C::kDirect ? 1 : nfin); // fullV, else raw_empty
      mbar_init(BAR(3 + 4 * st), 256);                // emptyK
    }
    mbar_init_fence();
  }
  // Consumers: this warpgroup's q rows, every 16-byte unit's load issued
  // at once into registers (one thread's D / 16 units), before the
  // classification and the CTA barrier, so that one memory latency, not
  // D / 16 of them in a row, precedes the first product (sched bit 4: the
  // unit-at-a-time loop below, for the A/B). Zeros past the last vector.
  constexpr int NQ = D / 16, UQ = D / 8; // units per thread, 16-byte units per q row
  const bool q_batch = !(P.sched & 16);
  uint4 qv[NQ];
  if (tid >= 128 && tid < 384 && q_batch) {
    pdl_wait(); // q is rotated in place by the previous kernel
    const int cq = (tid >> 7) - 1;
#pragma unroll
    for (int k = 0; k < NQ; k++) {
      const int u = (tid & 127) + k * 128, v = u / UQ, cu = u % UQ, vv = v0 + cq * 64 + v;
      qv[k] = make_uint4(0, 0, 0, 0);
      if (vv < nvec) {
        const int r = vv / G, h = kvh * G + vv % G;
        qv[k] =
            *reinterpret_cast<const uint4 *>(reinterpret_cast<const T *>(F.q) +
                                             ((size_t)(it.q_row + r) * F.q_heads + h) * D + cu * 8);
      }
    }
  }
  // FlashMask intervals: every key tile classified once, as the tiled kernel
  // does (skipped: each key masked for every row; bit 1: masked per element;
  // bit 2: only the causal / window ranges mask it, classify_tiles_sm90).
  if (kind == ATTND_MASK_INTERVALS)
    classify_tiles_sm90<BN>(it, iv, kv_len, lo, hi, jfirst, ntiles, C::kNF, pmin, pmax, win,
                            C::kThreads / 32, sFlags);
  __syncthreads();

  const int lastkey = hi;                                         // hi <= kv_len - 1
  const int cvt = (P.sched & 1024) ? 2 : (P.sched & 512) ? 1 : 0; // Ring::cvt
  const Ring g{smem,
               sFlags,
               bt,
               bar0,
               kind,
               ntiles,
               jfirst,
               lastkey,
               kS,
               kvh,
               raw_early,
               kvsplit,
               cvt,
               (P.sched & 2048) != 0,
               merged,
               nfin,
               C::kPf != ((P.sched & 8192) != 0)};
  auto next_tile = [&](int t) -> int { return g.template next_tile<C::kNF>(t); };

  const int wg = tid >> 7;
  if (wg == 3) {
    // ---- the fourth warpgroup (dynamic types, D <= 128): finishing warps ----
    regs_dec<C::kRegsP>();
    if (wg3)
      ring_finish<D, DT, KV>(P, g, nfin0 + (tid - 384), false);
    return;
  }
  if (wg == 0) {
    regs_dec<C::kRegsP>();
    if (warp == 0 && !merged) {
      // ---- producer: one thread issues every copy (prefill_sm90_copy.cuh) ----
      if (lane == 0)
        ring_produce<D, DT, KV>(P, g);
      return;
    }
    // ---- finishing warps 1-3 (merged: 0-3, warp 0 lane 0 also copying):
    // convert, zero what lies past the visible keys ----
    ring_finish<D, DT, KV>(P, g, merged ? tid : tid - 32, merged && tid == 0);
    return;
  }

  // ---- consumers ----
  regs_inc<C::kRegsC>();
  const int c = wg - 1, t128 = tid & 127, cw = t128 >> 5;
  // Static K scale, as the tiled kernel: per kv head in the fp32 score scale;
  // per channel (int4 always) in q as q s / 2^e, 2^e >= every s_d, kept as an
  // exact hi + lo pair of operands (sQ, sQlo: a second Q K^T product), and
  // 2^e in the score scale (primitives.cuh, scale_exp).
  float sl2 = F.scale_log2, rscale = 1.f;
  constexpr bool lo_pass = C::kStatic && LO;
  if constexpr (C::kStatic) {
    if constexpr (LO) {
      float mx = 0.f;
      for (int d = lane; d < D; d += 32)
        mx = fmaxf(mx, F.k_scale[kvh * D + d]);
#pragma unroll
      for (int o = 16; o; o >>= 1)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const int e = scale_exp(mx);
      rscale = ldexpf(1.f, -e);
      sl2 = ldexpf(sl2, e);
    } else {
      sl2 *= F.k_scale[kvh];
    }
  }
  // Q rows of this warpgroup -> shared memory in the swizzled K-major layout
  // (zeros past the last vector), hi and lo halves as tiled_load_q makes them.
  {
    uint8_t *sQ = smem + C::kQ, *sQlo = smem + C::kQlo;
    // Unit u of the warpgroup's rows (val: its 16 bytes as loaded) -> sQ
    // (and its lo half -> sQlo).
    auto put = [&](int u, uint4 val) {
      const int v = u / UQ, cu = u % UQ, vv = v0 + c * 64 + v, col = cu * 8;
      uint4 vlo = make_uint4(0, 0, 0, 0);
      if constexpr (lo_pass) {
        if (vv < nvec) {
          uint32_t *w = &val.x, *wl = &vlo.x;
#pragma unroll
          for (int e = 0; e < 8; e += 2) {
            const T *pr = reinterpret_cast<const T *>(&w[e / 2]);
            // Rounded as tiled_load_q's FMUL, FMUL, FADD (explicit: no contraction).
            const float a =
                __fmul_rn(A::to_f(pr[0]), __fmul_rn(F.k_scale[kvh * D + col + e], rscale));
            const float b =
                __fmul_rn(A::to_f(pr[1]), __fmul_rn(F.k_scale[kvh * D + col + e + 1], rscale));
            const uint32_t hw = A::pack2(a, b);
            w[e / 2] = hw;
            wl[e / 2] =
                A::pack2(__fsub_rn(a, op_half<DT>(hw, false)), __fsub_rn(b, op_half<DT>(hw, true)));
          }
        }
      }
      const uint32_t off = (cu >> 3) * kBMq * 128 + sw128_off(c * 64 + v, cu & 7);
      *reinterpret_cast<uint4 *>(sQ + off) = val;
      if constexpr (lo_pass)
        *reinterpret_cast<uint4 *>(sQlo + off) = vlo;
    };
    if (q_batch) {
#pragma unroll
      for (int k = 0; k < NQ; k++)
        put(t128 + k * 128, qv[k]);
    } else {
      pdl_wait(); // q is rotated in place by the previous kernel
      for (int u = t128; u < 64 * UQ; u += 128) {
        const int v = u / UQ, cu = u % UQ, vv = v0 + c * 64 + v;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (vv < nvec) {
          const int r = vv / G, h = kvh * G + vv % G;
          val = *reinterpret_cast<const uint4 *>(reinterpret_cast<const T *>(F.q) +
                                                 ((size_t)(it.q_row + r) * F.q_heads + h) * D +
                                                 cu * 8);
        }
        put(u, val);
      }
    }
    fence_proxy_async();
    named_sync(1 + c, 128);
    if constexpr (KV == ATTND_KV_INT4) {
      // q'.(u - z) = q'.u - q'.z: the second term is the same for every key
      // of a row, so the scores leave it out and the lse takes it out (fp64
      // sum over the channels in order, of hi + lo, as the tiled kernel).
      if (t128 < 64) {
        const int row = c * 64 + t128;
        double cz = 0.0;
        for (int d = 0; d < D; d++) {
          const uint32_t off = (d >> 6) * kBMq * 128 + sw128_off(row, (d & 63) >> 3) + (d & 7) * 2;
          cz += ((double)A::to_f(*reinterpret_cast<const T *>(sQ + off)) +
                 (double)A::to_f(*reinterpret_cast<const T *>(sQlo + off))) *
                (double)F.k_zero[kvh * D + d];
        }
        reinterpret_cast<float *>(smem + C::kC)[row] = (float)(cz * (double)sl2);
      }
      named_sync(1 + c, 128); // read by the warpgroup's epilogue, also when no key tile runs
    }
  }

  const int ra = cw * 16 + (lane >> 2); // this thread's rows: ra and ra + 8 of the warpgroup's 64
  int prow[2];
  bool rvalid[2];
  float zrow[2]; // int4 under soft-capping: the rows' K zero-point terms (softcap2)
  const float cap2 = F.cap2;
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    const int vv = v0 + c * 64 + ra + ri * 8;
    rvalid[ri] = vv < vend;
    prow[ri] = it.start + min(vv, vend - 1) / G;
    zrow[ri] = KV == ATTND_KV_INT4
                   ? reinterpret_cast<const float *>(smem + C::kC)[c * 64 + ra + ri * 8]
                   : 0.f;
  }
  // Row range of this warpgroup, for the per-tile mask decision.
  int wpmin = pmin, wpmax = pmax;
  if (v0 + c * 64 < vend) {
    wpmin = it.start + (v0 + c * 64) / G;
    wpmax = it.start + (min(v0 + c * 64 + 63, vend - 1)) / G;
  }
  // How tile t is masked: 0 not at all, 1 by per-row key ranges (causal,
  // window, sliding, prefix, the visible range; and interval tiles whose
  // intervals miss these rows: flag bit 2, unless sched bit 5 asks for the
  // interval reads there too), 2 by the intervals, per element.
  const bool iv_ranges = !(P.sched & 32);
  auto mask_mode = [&](int t, int j0) -> int {
    if (kind == ATTND_MASK_INTERVALS) {
      if (t >= C::kNF)
        return 2;
      const int f = sFlags[t];
      return !(f & 2) ? 0 : (iv_ranges && (f & 4)) ? 1 : 2;
    }
    return tile_needs_mask(it, wpmin, wpmax, lo, hi, j0, BN, win) ? 1 : 0;
  };

  const uint32_t sQa = smem_u32(smem + C::kQ), sQloa = smem_u32(smem + C::kQlo),
                 sOp = smem_u32(smem + C::kOp);
  // Dynamic types: stage s's K scales at sDs(s)[0..BN), V scales at [BN, 2 BN).
  auto sDs = [&](int s) {
    return reinterpret_cast<const float *>(smem + C::kScl + s * C::kSclStage);
  };
  auto dQ = [&](uint32_t base, int kd) {
    return desc_sw128(base + (kd >> 2) * kBMq * 128 + c * 64 * 128 + (kd & 3) * 32, 16, 1024);
  };
  auto dK = [&](int s, int kd) {
    return desc_sw128(sOp + s * 2 * KT + (kd >> 2) * BN * 128 + (kd & 3) * 32, 16, 1024);
  };
  auto dV = [&](int s, int kk) {
    return desc_sw128(sOp + s * 2 * KT + KT + kk * 2048, BN * 128, 1024);
  };

  float o[D / 2];
#pragma unroll
  for (int k = 0; k < D / 2; k++)
    o[k] = 0.f;
  float sacc[BN / 2];
  uint32_t pr[BN / 16][4];
  // Running max (exp2 domain), sum of P, sum of P as rounded for P V (not
  // the dynamic types), the V-scale reference (kSigma) and its inverse.
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f}, lt_r[2] = {0.f, 0.f};
  float sig = 0.f, vinv = 1.f;
  const bool pp = P.sched & 1, serial = (P.sched & 2) != 0;
  // FF (opt-in): scores to P' by one FFMA per score against the max of the
  // raw scores (not the dynamic types, whose K scale multiplies each score
  // first, nor soft-capped layers; sl2 > 0 so that -inf * sl2 stays -inf).
  // It moves P's exponent by one rounding against the tiled kernel's, which
  // flips P's bf16 rounding more often: measured 1.17e-4 over the 1e-4 A/B
  // bound on one case (bench/RESULTS.md), so the default is the tiled
  // kernel's FMUL then FADD, bit for bit.
  const bool fused = FF && !C::kDyn && cap2 == 0.f && sl2 > 0.f;
  const int me = 3 + c, other = 3 + (c ^ 1);

  auto issue_qk = [&](int s) {
#pragma unroll
    for (int kd = 0; kd < D / 16; kd++)
      Wgmma<BN, DT>::ss(sacc, dQ(sQa, kd), dK(s, kd), kd > 0);
    if constexpr (lo_pass) {
#pragma unroll
      for (int kd = 0; kd < D / 16; kd++)
        Wgmma<BN, DT>::ss(sacc, dQ(sQloa, kd), dK(s, kd), 1);
    }
  };
  auto issue_pv = [&](int s) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
      Wgmma<D, C::PDT>::rs(o, pr[kk], dV(s, kk), 1);
  };
  // Scores of tile t (stage s) -> P' = P 2^kPShift in sacc, in place, with
  // the tiled kernel's operations: v = s sl2 (dynamic types: times the K
  // scale, before the mask), m the running max rounded up to an integer,
  // P' = 2^((v - m) + kPShift); alpha and beta rescale O (beta: kSigma's
  // change of reference).
  auto softmax = [&](int t, int s, float(&alpha)[2], float &beta) {
    const int j0 = jfirst + t * BN;
    beta = 1.f;
    if (P.sched & 4) { // timing only (sm90_sched bit 2): no softmax at all, wrong results
      alpha[0] = alpha[1] = 1.f;
      return;
    }
    if (!fused) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) { // before the mask: -inf * 0 is NaN
          const float x = __fmul_rn(sacc[nt * 4 + e], sl2);
          sacc[nt * 4 + e] = C::kDyn ? __fmul_rn(x, sDs(s)[nt * 8 + (lane & 3) * 2 + (e & 1)]) : x;
        }
      if (cap2 > 0.f) { // soft-capping (softcap2): a branch per tile, uniform over the CTA
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++)
            sacc[nt * 4 + e] = softcap2(sacc[nt * 4 + e], cap2, F.icap2, zrow[e >> 1]);
      }
    }
    const int mm = mask_mode(t, j0);
    if (mm != 0) {
      if (mm == 2) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
          for (int cb = 0; cb < 2; cb++) {
            const int j = j0 + nt * 8 + (lane & 3) * 2 + cb;
            const bool in = j >= lo && j <= hi;
            // Read at a key clamped into [lo, hi] (0 <= lo <= hi < kv_len
            // whenever a tile runs) rather than under a branch, so that the
            // loads of all the thread's keys are in flight together; keys
            // outside the range are masked by `in` whatever was read.
            const int jc = min(max(j, lo), hi);
            const int a = __ldg(iv + jc), bb = __ldg(iv + kv_len + jc),
                      cc = __ldg(iv + 2 * kv_len + jc), dd = __ldg(iv + 3 * kv_len + jc);
#pragma unroll
            for (int ri = 0; ri < 2; ri++) {
              const int p = prow[ri];
              const bool vis = in && !(it.causal && j > p) && !(win > 0 && j <= p - win) &&
                               !((a <= p && p < bb) || (cc <= p && p < dd));
              if (!vis)
                sacc[nt * 4 + ri * 2 + cb] = -INFINITY;
            }
          }
      } else {
        // Each row's visible keys are one range [rlo, rhi], plus [wlo, phi]
        // for prefix-LM (the prefix); both already cut to [lo, hi] and to
        // the row's window from wlo (primitives.cuh's visible(), as ranges).
        int rlo[2], rhi[2], phi[2], wlo[2];
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
          const int p = prow[ri];
          wlo[ri] = win > 0 ? max(lo, p - win + 1) : lo;
          rlo[ri] = kind == ATTND_MASK_SLIDING ? max(wlo[ri], p - mp + 1) : wlo[ri];
          rhi[ri] = kind == ATTND_MASK_FULL || (kind == ATTND_MASK_INTERVALS && !it.causal)
                        ? hi
                        : min(hi, p);
          phi[ri] = kind == ATTND_MASK_PREFIX_LM ? min(hi, mp - 1) : lo - 1;
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int j = j0 + nt * 8 + (lane & 3) * 2 + (e & 1), ri = e >> 1;
            const bool vis = (j >= rlo[ri] && j <= rhi[ri]) || (j >= wlo[ri] && j <= phi[ri]);
            if (!vis)
              sacc[nt * 4 + e] = -INFINITY;
          }
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        mx[e >> 1] = fmaxf(mx[e >> 1], sacc[nt * 4 + e]);
    if constexpr (C::kSigma) {
      // V's scales taken relative to a running power of two (tiled_tile):
      // the tile's largest, over the quad's keys.
      const float *vs = sDs(s) + BN;
      float vm = 0.f;
#pragma unroll
      for (int nt = 0; nt < BN / 8; nt++)
        vm = fmaxf(vm, fmaxf(vs[nt * 8 + (lane & 3) * 2], vs[nt * 8 + (lane & 3) * 2 + 1]));
      vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 1));
      vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, 2));
      const float sn = fmaxf(sig, pow2_ceil(vm));
      beta = sig / sn; // exact: powers of two; 0 before the first tile
      sig = sn;
      vinv = 1.f / sn;
    }
    float mref[2];
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
      mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
      mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
      if (fused) // the max of rn(s sl2) is rn(max s * sl2): rounding is monotonic, sl2 > 0
        mx[ri] = __fmul_rn(mx[ri], sl2);
      float mnew;
      mref[ri] = softmax_ref(m_r[ri], mx[ri], mnew);
      alpha[ri] = ex2(m_r[ri] - mref[ri]);
      m_r[ri] = mnew;
    }
    float rs[2] = {0.f, 0.f};
    // P' = 2^rn(s sl2 + (kPShift - m)): one FFMA per score (m an integer,
    // kPShift - m exact), which differs from the form below (rn(s sl2)
    // first) by at most half an ulp of s sl2 in the exponent: below 2^-16
    // while |m| < 256 (a relative change of P under 1.1e-5), but at the
    // magnitudes the kernels take (|q|, |k| up to 2^48) as much as 2^76, which
    // would turn the largest P into 0 or inf. So the warp takes the FFMA only
    // while every reference of its rows is that small; else the tiled
    // kernel's FMUL then FADD of the scaled scores (scaled here: the max was
    // taken on the raw ones; mref is the same value either way).
    const bool ffma =
        fused && __all_sync(0xffffffffu, fabsf(mref[0]) < 256.f && fabsf(mref[1]) < 256.f);
    if (fused && !ffma) {
#pragma unroll
      for (int k = 0; k < BN / 2; k++)
        sacc[k] = __fmul_rn(sacc[k], sl2);
    }
    if (ffma) {
      const float nm[2] = {C::kPShift - mref[0], C::kPShift - mref[1]};
#pragma unroll
      for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          sacc[nt * 4 + e] = ex2(fmaf(sacc[nt * 4 + e], sl2, nm[e >> 1]));
    } else {
#pragma unroll
      for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          // P' = P 2^kPShift, the shift added after the difference (exact).
          const float d = __fadd_rn(sacc[nt * 4 + e], -mref[e >> 1]);
          const float p = ex2(C::kPShift != 0.f ? __fadd_rn(d, C::kPShift) : d);
          sacc[nt * 4 + e] = p;
          if constexpr (C::kDyn)
            rs[e >> 1] += p;
        }
    }
    // The sum of the unrounded P' is kept for the dynamic types only (their
    // output is normalized by it); the others normalize by the rounded sum
    // (lt_r, to_p), which is > 0 exactly when this one is.
    if constexpr (C::kDyn) {
#pragma unroll
      for (int ri = 0; ri < 2; ri++)
        l_r[ri] = l_r[ri] * alpha[ri] + rs[ri];
    }
  };
  // P' -> the A fragments of P V, rounded to C::PDT (dynamic V scales, over
  // the reference, multiply P here); the rounded values' sum joins lt.
  auto to_p = [&](int s, const float(&alpha)[2]) {
    float rt[2] = {0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int nt = 2 * kk + h;
        if constexpr (C::kDyn) {
          const float *vs = sDs(s) + BN + nt * 8 + (lane & 3) * 2;
          const float w0 = vs[0] * vinv, w1 = vs[1] * vinv;
          pr[kk][2 * h] = PA::pack2(sacc[nt * 4] * w0, sacc[nt * 4 + 1] * w1);
          pr[kk][2 * h + 1] = PA::pack2(sacc[nt * 4 + 2] * w0, sacc[nt * 4 + 3] * w1);
        } else {
          const uint32_t a0 = PA::pack2(sacc[nt * 4], sacc[nt * 4 + 1]);
          const uint32_t a1 = PA::pack2(sacc[nt * 4 + 2], sacc[nt * 4 + 3]);
          rt[0] += op_half<C::PDT>(a0, false) + op_half<C::PDT>(a0, true);
          rt[1] += op_half<C::PDT>(a1, false) + op_half<C::PDT>(a1, true);
          pr[kk][2 * h] = a0;
          pr[kk][2 * h + 1] = a1;
        }
      }
    if constexpr (!C::kDyn) {
#pragma unroll
      for (int ri = 0; ri < 2; ri++)
        lt_r[ri] = lt_r[ri] * alpha[ri] + rt[ri];
    }
  };
  auto rescale = [&](const float(&alpha)[2], float beta) {
    const float r0 = alpha[0] * beta, r1 = alpha[1] * beta;
    if (r0 == 1.f && r1 == 1.f)
      return;
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
      o[nt * 4] *= r0;
      o[nt * 4 + 1] *= r0;
      o[nt * 4 + 2] *= r1;
      o[nt * 4 + 3] *= r1;
    }
  };

  // Tile i (stage s) is ready: the copy engine's barrier for 16-bit tiles that
  // need no fix-up, else the finishing warps' (used once per CTA for those).
  // kvsplit: K only here (BAR(s), the tail tile's too), V in wait_v.
  auto wait_tile = [&](int t, int s, int i) {
    if (C::kDirect && (kvsplit || lastkey + 1 - (jfirst + t * BN) >= BN))
      mbar_wait(BAR(s), (i / kS) & 1);
    else
      mbar_wait(BAR(4 + s), C::kDirect ? 0 : (i / kS) & 1);
  };
  auto wait_v = [&](int t, int s, int i) {
    if (!kvsplit)
      return;
    if (lastkey + 1 - (jfirst + t * BN) >= BN)
      mbar_wait(BAR(13 + s), (i / kS) & 1);
    else
      mbar_wait(BAR(4 + s), 0); // the tail tile: the finishing warps zeroed V's rows past the keys
  };
  int t = next_tile(0);
  if (t < ntiles) {
    if (pp && c == 1)
      named_arrive(3, 256); // consumer 0 issues first
    float alpha[2], beta;
    wait_tile(t, 0, 0);
    if (pp)
      named_sync(me, 256);
    wgmma_fence();
    issue_qk(0);
    wgmma_commit();
    if (pp)
      named_arrive(other, 256);
    wgmma_wait<0>();
    fence_regs(sacc);
    if (kvsplit)
      mbar_arrive(BAR(3)); // emptyK of stage 0
    softmax(t, 0, alpha, beta);
    to_p(0, alpha); // O is still 0: nothing to rescale
    int sprev = 0, i = 1, tprev = t;
    for (t = next_tile(t + 1); t < ntiles; t = next_tile(t + 1), i++) {
      const int s = i % kS;
      wait_tile(t, s, i);
      wait_v(tprev, sprev, i - 1);
      if (pp)
        named_sync(me, 256);
      wgmma_fence();
      issue_qk(s);
      wgmma_commit();
      issue_pv(sprev);
      wgmma_commit();
      if (pp)
        named_arrive(other, 256);
      if (serial)
        wgmma_wait<0>();
      else
        wgmma_wait<1>(); // Q K^T of this tile done; P V of the last may still run
      fence_regs(sacc);
      if (kvsplit)
        mbar_arrive(BAR(3 + 4 * s)); // the stage's K is read
      softmax(t, s, alpha, beta);
      wgmma_wait<0>();
      fence_regs(o);
#pragma unroll
      for (int kk = 0; kk < BN / 16; kk++)
        fence_regs(pr[kk]);
      mbar_arrive(BAR(8 + sprev)); // the last tile's stage is free
      rescale(alpha, beta);
      to_p(s, alpha);
      sprev = s;
      tprev = t;
    }
    wait_v(tprev, sprev, i - 1);
    if (pp)
      named_sync(me, 256);
    wgmma_fence();
    issue_pv(sprev);
    wgmma_commit();
    if (pp && c == 0)
      named_arrive(other, 256); // consumer 1's last turn; consumer 0 takes none after this
    wgmma_wait<0>();
    fence_regs(o);
    mbar_arrive(BAR(8 + sprev));
  }

  // ---- epilogue (tiled_write): row sums across the quad, normalize, write ----
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 1);
    l_r[ri] += __shfl_xor_sync(0xffffffffu, l_r[ri], 2);
    if constexpr (!C::kDyn) {
      lt_r[ri] += __shfl_xor_sync(0xffffffffu, lt_r[ri], 1);
      lt_r[ri] += __shfl_xor_sync(0xffffffffu, lt_r[ri], 2);
    }
  }
  const float *sC = reinterpret_cast<const float *>(smem + C::kC);
  const float *sink =
      F.sinks && (F.items[item].flags & ATTND_ITEM_SINK) && (F.nsplit <= 1 || split == 0) ? F.sinks
                                                                                          : nullptr;
#pragma unroll
  for (int ri = 0; ri < 2; ri++) {
    if (!rvalid[ri])
      continue;
    const int vv = v0 + c * 64 + ra + ri * 8;
    const int row = it.q_row + vv / G, h = kvh * G + vv % G;
    // O is normalized by the sum of P as rounded for the matrix units (but
    // for the dynamic types, whose P carries V's scale): lset is its log,
    // the weight of this part in a merge. lse is the same log, not that of
    // the unrounded sum, so that a client merging parts by lse weights each
    // output by the sum it was divided by (docs/numerics.md, merging). The
    // sums hold P 2^kPShift: the shift comes off their logs (exact), not off m.
    const bool any = (C::kDyn ? l_r[ri] : lt_r[ri]) > 0.f;
    const float ln = C::kDyn ? l_r[ri] : lt_r[ri];
    const float inv = any ? (C::kSigma ? sig : 1.f) / ln : 0.f;
    // (Capped int4 scores hold the zero-point term: softcap2.)
    const float ref =
        m_r[ri] - (KV == ATTND_KV_INT4 && cap2 == 0.f ? sC[c * 64 + ra + ri * 8] : 0.f);
    float lset = any ? (ref + (log2f(ln) - C::kPShift)) * 0.69314718055994531f : -INFINITY;
    float lse = lset;
    // The sink joins the row once: here when it is not split, else in part 0.
    const float wsk = sink ? sink_join(sink[h], lse, lset) : 1.f;
    // Channel d of this row, normalized; static V scales (and int4's zero
    // point: O = s (sum P~ u / sum P~ - z), 0 for a row with no key) applied here.
    auto fin = [&](int nt, int k) -> float {
      const int d = nt * 8 + (lane & 3) * 2 + k;
      const float x = o[nt * 4 + ri * 2 + k] * inv;
      if constexpr (KV == ATTND_KV_INT4)
        return (any ? (x - F.v_zero[kvh * D + d]) * F.v_scale[kvh * D + d] : 0.f) * wsk;
      else if constexpr (C::kStatic)
        return x * (F.per_channel ? F.v_scale[kvh * D + d] : F.v_scale[kvh]) * wsk;
      else
        return x * wsk;
    };
    const size_t ob = ((size_t)row * F.q_heads + h) * D + (lane & 3) * 2;
    if (F.nsplit > 1 || F.out_fp32) {
      float *dst = F.nsplit > 1 ? F.ws_o + (size_t)split * F.total_q * F.q_heads * D + ob
                                : reinterpret_cast<float *>(F.out) + ob;
#pragma unroll
      for (int nt = 0; nt < D / 8; nt++)
        *reinterpret_cast<float2 *>(dst + nt * 8) = make_float2(fin(nt, 0), fin(nt, 1));
    } else {
      uint32_t *dst = reinterpret_cast<uint32_t *>(reinterpret_cast<T *>(F.out) + ob);
#pragma unroll
      for (int nt = 0; nt < D / 8; nt++)
        dst[nt * 4] = A::pack2(fin(nt, 0), fin(nt, 1));
    }
    if ((lane & 3) == 0) {
      if (F.nsplit > 1) {
        const size_t li = ((size_t)split * F.total_q + row) * F.q_heads + h;
        F.ws_lse[li] = lse;
        F.ws_lse[(size_t)F.nsplit * F.total_q * F.q_heads + li] = lset;
      } else if (F.lse) {
        F.lse[(size_t)row * F.q_heads + h] = lse;
      }
    }
  }
#endif // ATTND_SM90_DEVICE
}

} // namespace sm90

} // namespace attnd

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
// (decode_layout.cuh, Dec: fp16 wherever the stored values are exact in it,
// bf16 for bf16 caches and for static types under bf16 activations); per-token
// scales multiply the scores (K) and P (V); a static K scale per kv head
// multiplies the fp32 score scale; per channel it goes into q as an exact
// hi + lo pair (primitives.cuh, scale_exp), the lo half either in the free
// columns 4..7 of a TR product (<= 4 vectors) or in a second product; static V
// scales multiply O. O is normalized by the sum of P as rounded for the
// matrix units (all but the dynamic types), so int4's V zero point comes out
// exactly: O = s (sum P~ u / sum P~ - z), no cancellation of two large terms;
// the K zero point is a per-vector constant of the scores, dropped from them
// and taken out of the lse (summed in fp64). P goes in as P 2^14 in fp16
// (fp16's subnormals), the shift added after s - m so it stays exact.
#pragma once

#include "decode_chunk.cuh"
#include "decode_cluster.cuh"
#include "decode_fused.cuh"

namespace attnd {

// Where a piece's result goes.
// kOutCluster: a per-item split part merged inside its cluster (decode_cluster.cuh).
enum { kOutFinal = 0, kOutSlot = 1, kOutSplit = 2, kOutCluster = 3 };
// out_kind | kOutSink: the piece holds the first keys of an item with
// ATTND_ITEM_SINK: the sink joins its rows (one bit of a value the key loop
// keeps anyway, not a register of its own).
constexpr int kOutSink = 4;

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
  // The sink joins each row once: in the piece holding the first keys.
  const float *sink = (out_kind & kOutSink) ? P.sinks : nullptr;
  out_kind &= ~kOutSink;
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
      f *= C::kPv16 ? acc.sig * 0x1p-14f : acc.sig; // O was accumulated relative to sig (times kVShift)
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
    // lset from the sum that normalized O (the merge weights); lse the same
    // log, not that of the unrounded sum Ls, so that a client merging parts
    // by lse weights each output by the sum it was divided by
    // (docs/numerics.md, merging split-context results).
    float lse = -INFINITY, lset = -INFINITY;
    if (Ls > 0.f) {
      // The sums hold P 2^kPShift: the shift comes off their logs (exact), not off m.
      // (Capped int4 scores hold the zero-point term: softcap2.)
      const float ref = sM[r] - (C::K::kI4 && P.cap2 == 0.f ? sC[r] : 0.f);
      lset = (ref + (log2f(C::K::kDyn ? Ls : sLt[r]) - C::kPShift)) * 0.69314718055994531f;
      lse = lset;
    }
    const int row = it.q_row + r / G, h = kvh * G + r % G;
    if (sink)
      x *= sink_join(sink[h], lse, lset);
    const size_t ob = ((size_t)row * P.q_heads + h) * D + d;
    if (out_kind == kOutFinal) {
      if (P.out_fp32)
        reinterpret_cast<float *>(P.out)[ob] = x;
      else
        reinterpret_cast<typename A::T *>(P.out)[ob] = A::from_f(x);
      if (P.lse && d == 0)
        P.lse[(size_t)row * P.q_heads + h] = lse;
    } else if (out_kind == kOutCluster) {
      // This thread's own (r, d) of warp 0's rows, read above by it alone;
      // the (m, l, lt) area is not read past the merge (dec_cl_o, dec_cl_l).
      so[r * D + d] = x;
      if (d == 0) {
        sm[r] = lse;
        sm[16 + r] = lset;
      }
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
  auto *sP = reinterpret_cast<typename Act<C::PDT>::T *>(smem + C::kP) + warp * 8 * KS * (C::kPairC ? 2 : 1);
  // The stages start on a 128-byte boundary (kStagePad): 64 bytes off it,
  // every warp's 16-byte cp.async rows straddled one more shared-memory line
  // and the loads ran at 74% of the read roof instead of 89-92% (bf16;
  // bench/RESULTS.md, decode5). Launch option debug 8192 restores the old
  // offset (timing A/B only, results exact).
  uint8_t *myStages = smem + C::kStages + ((P.debug & 8192) ? 0 : C::kStagePad) + (size_t)warp * NS * C::kStage;
  const int32_t *bt = P.meta + it.block_table;
  const bool no_load = P.debug & 1, no_math = P.debug & 2; // timing experiments only

  __syncthreads(); // the previous piece (or the work-range scan) is done with shared memory
  const int jfirst = klo & ~(KS - 1);
  const int nchunks = khi >= jfirst ? (khi - jfirst) / KS + 1 : 0;
  const int cnt = nchunks > warp ? (nchunks - 1 - warp) / NW + 1 : 0;
  DecCopy<C> cpy;
  dec_copy_init<C>(P, kvh, lane, cpy);
  const uint32_t sStages = (uint32_t)__cvta_generic_to_shared(myStages);
  auto chunk_key = [&](int n) { return jfirst + (warp + NW * n) * KS; };
  // Timing A/B only (launch option debug, results exact): bit 4 the copy as
  // main had it (dec_issue_ref), bit 8 one chunk in flight ahead of the one
  // being computed instead of NS - 1, bit 16 whole blocks into L2, the next
  // block at the refill that starts one (dec_prefetch_l2).
  const bool ref_copy = P.debug & 4;
  const bool pf_blocks = (P.debug & 16) && kvh == 0;
  // The paired loop (Dec::kPair) issues every stage before its first pair,
  // then two chunks per pair: the chunks of the pair after next.
  const int la = C::kPair ? NS : (P.debug & 8) ? 1 : NS - 1; // chunks issued ahead
  // Bit 64 (exact: a hint): this CTA's own K and V rows of the block pfb
  // blocks past each refill that starts a block go to L2 through the bulk
  // copy engine (one request per 1..32 KB region instead of 16-byte
  // cp.async misses), ~32 KB ahead per CTA, ~64 KB with bit 128
  // (dec_prefetch_own).
  // (Read from the parameters where used, not held in registers through the
  // key loop: the 8-bit instantiations sit at their 128-register bound.)
  auto pf_own = [&]() { return (P.debug & 64) != 0; };
  auto pfb = [&]() { return max(1, ((P.debug & 128) ? 65536 : 32768) / (2 * P.bs * C::RB)); };
#pragma unroll
  for (int n = 0; n < (C::kPair ? NS : NS - 1); n++) {
    if (n < cnt && n < la && !no_load) {
      if (ref_copy)
        dec_issue_ref<C>(P, bt, kvh, chunk_key(n), khi, myStages + n * C::kStage, lane);
      else
        dec_issue<C>(P, cpy, bt[chunk_key(n) >> cpy.lbs], chunk_key(n), khi, sStages + n * C::kStage, lane);
    }
    cp_async_commit();
  }
  // The block of the next refill, read a chunk ahead.
  int32_t nblk = la < cnt ? bt[chunk_key(la) >> cpy.lbs] : 0;
  if (pf_own() && warp == 0 && lane == 0 && !no_load) {
    // The blocks between the first one a loop refill starts and the first
    // one such a refill prefetches (below).
    const int b0 = ((jfirst + NW * KS * la + P.bs - 1) >> cpy.lbs) << cpy.lbs;
    for (int k = 0; k < pfb() && b0 + k * P.bs <= khi; k++)
      dec_prefetch_own<C>(P, kvh, bt[(b0 + k * P.bs) >> cpy.lbs]);
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
    const size_t qb0 = ((size_t)row * P.q_heads + h) * D;
    float x = A::to_f(reinterpret_cast<const typename A::T *>(P.q)[qb0 + d]);
    if (P.fuse) // the fused step: q as the write kernel would have rotated it (write_row.cuh)
      x = dec_q_rope<C>(P, qb0, d, it.start + r / G + it.pos_base, x);
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
    KT hi, lo;
    if constexpr (C::kBf16Split) {
      // The tiled kernel's bf16 halves, scaled by a power of two into fp16 (exact).
      const float x = q_at(idx);
      const float hb = __bfloat162float(__float2bfloat16_rn(x));
      const float lb = __bfloat162float(__float2bfloat16_rn(x - hb));
      hi = KA::from_f(hb * qscale);
      lo = KA::from_f(lb * qscale);
    } else {
      const float x = q_at(idx) * qscale;
      hi = KA::from_f(x);
      lo = KA::from_f(x - KA::to_f(hi));
    }
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
    if (P.cap2 > 0.f)
      __syncthreads(); // the capped scores read sC (pc.zc)
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
    pc.zc[i] = C::K::kI4 && P.cap2 > 0.f ? sC[v] : 0.f;
  }
  const int pmin = it.start, pmax = it.start + it.n - 1;
  // The piece's mask bounds (dec_mask_bounds) where the registers allow:
  // the 16-bit and dynamic types. The static 8-bit types and int4 sit at
  // their 128-register bound and spilled 4-56 bytes with them (in registers
  // or re-read from shared memory alike): they keep the per-chunk test.
  constexpr bool kMb = C::K::k16 || C::K::kDyn;
  const DecMaskBounds mb = kMb ? dec_mask_bounds(it, pmin, pmax, klo, khi, P.window) : DecMaskBounds{0, 0};
  // Stage of chunk n, counted without a division (NS is 3 to 6).
  int stage = 0;
  if constexpr (C::kPair) {
    // Pairs (n, n + 1): the stages of the previous pair take chunks n + NS - 2
    // and n + NS - 1 (one commit group each, empty past the last chunk), then
    // the warp waits for chunk n + 1 (NS - 2 groups after it stay in flight).
    // The timing options of the copy (debug 4, 8, 16, 64) do not apply.
    for (int n = 0; n < cnt; n += 2) {
      if (n >= 2) {
#pragma unroll
        for (int q = 0; q < 2; q++) {
          const int c = n + NS - 2 + q;
          if (c < cnt && !no_load) {
            const int st = stage + NS - 2 + q >= NS ? stage + q - 2 : stage + NS - 2 + q;
            dec_issue<C>(P, cpy, nblk, chunk_key(c), khi, sStages + st * C::kStage, lane);
            if (c + 1 < cnt)
              nblk = bt[chunk_key(c + 1) >> cpy.lbs];
          }
          cp_async_commit();
        }
      }
      cp_async_wait<NS - 2>();
      __syncwarp();
      const int sB = stage == NS - 1 ? 0 : stage + 1;
      const uint8_t *sbA = myStages + stage * C::kStage, *sbB = myStages + sB * C::kStage;
      stage = sB == NS - 1 ? 0 : sB + 1;
      if (no_math)
        continue;
      const int j0 = chunk_key(n);
      if (n + 1 < cnt) {
        const int j1 = chunk_key(n + 1);
        const bool need_mask = kMb ? j0 < mb.lo || j1 + (KS - 1) > mb.hi
                                   : tile_needs_mask(it, pmin, pmax, klo, khi, j0, KS, P.window) ||
                                         tile_needs_mask(it, pmin, pmax, klo, khi, j1, KS, P.window);
        if (need_mask)
          dec_chunk2_tr<C, true>(P, pc, sbA, sbB, qb, sQ, sP, j0, j1, acc);
        else
          dec_chunk2_tr<C, false>(P, pc, sbA, sbB, qb, sQ, sP, j0, j1, acc);
      } else {
        const bool need_mask = kMb ? j0 < mb.lo || j0 + (KS - 1) > mb.hi
                                   : tile_needs_mask(it, pmin, pmax, klo, khi, j0, KS, P.window);
        if (need_mask)
          dec_chunk_tr<C, true>(P, pc, sbA, qb, sQ, sP, j0, acc);
        else
          dec_chunk_tr<C, false>(P, pc, sbA, qb, sQ, sP, j0, acc);
      }
      __syncwarp(); // the pair's stages are refilled next iteration
    }
  } else
  for (int n = 0; n < cnt; n++) {
    // The stage of chunk n - 1 is free (the warp passed its end): refill it.
    if (n + la < cnt) {
      const int refill = stage + la >= NS ? stage + la - NS : stage + la; // stage of chunk n + la
      if (no_load) {
      } else if (ref_copy) {
        dec_issue_ref<C>(P, bt, kvh, chunk_key(n + la), khi, myStages + refill * C::kStage, lane);
      } else {
        dec_issue<C>(P, cpy, nblk, chunk_key(n + la), khi, sStages + refill * C::kStage, lane);
        if (n + la + 1 < cnt)
          nblk = bt[chunk_key(n + la + 1) >> cpy.lbs];
      }
      const int jr = chunk_key(n + la);
      if ((P.debug & (16 | 64)) && lane == 0 && (jr & (P.bs - 1)) == 0 && !no_load) {
        if (pf_blocks) {
          const int jp = jr + max(P.bs, NW * KS); // the next block (this chunk's block starts at jr)
          if (jp <= khi) {
            const uint8_t *b = P.cache + (size_t)bt[jp >> cpy.lbs] * P.block_bytes;
            dec_prefetch_l2(b, (uint32_t)cpy.vreg);
            dec_prefetch_l2(b + cpy.vreg, (uint32_t)cpy.vreg);
          }
        }
        if (pf_own()) {
          // Every block start is some warp's refill (blocks hold >= 16 keys), so
          // blocks b0 + pfb bs onwards are each prefetched once, pfb blocks early.
          const int jp = jr + pfb() * P.bs;
          if (jp <= khi)
            dec_prefetch_own<C>(P, kvh, bt[jp >> (__ffs(P.bs) - 1)]);
        }
      }
    }
    cp_async_commit();
    if (la == NS - 1)
      cp_async_wait<NS - 1>();
    else
      cp_async_wait<1>();
    __syncwarp();
    const uint8_t *sb = myStages + stage * C::kStage;
    stage = stage == NS - 1 ? 0 : stage + 1;
    if (no_math)
      continue;
    const int j0 = jfirst + (warp + NW * n) * KS;
    const bool need_mask = kMb ? j0 < mb.lo || j0 + (KS - 1) > mb.hi
                               : tile_needs_mask(it, pmin, pmax, klo, khi, j0, KS, P.window);
    if constexpr (C::TR) {
      if (need_mask)
        dec_chunk_tr<C, true>(P, pc, sb, qb, sQ, sP, j0, acc);
      else
        dec_chunk_tr<C, false>(P, pc, sb, qb, sQ, sP, j0, acc);
    } else {
      if (need_mask)
        dec_chunk_rows<C, true>(P, pc, sb, sQ, sQlo, j0, acc);
      else
        dec_chunk_rows<C, false>(P, pc, sb, sQ, sQlo, j0, acc);
    }
    __syncwarp(); // the stage is refilled next iteration
  }
  cp_async_wait<0>();
  dec_finish<C>(P, smem, it, kvh, out_kind, out_idx, acc);
}

// 16-key chunks of one kv head's share of item it (0 for an item without q),
// and the first key and the visible key range.
__device__ __forceinline__ int dec_item_chunks(const attnd_kitem_t &it, int win, int &jfirst, int &lo, int &hi) {
  if (it.q_row < 0)
    return 0;
  key_range(it, it.start, it.start + it.n - 1, win, lo, hi);
  jfirst = lo & ~(kDecKeys - 1);
  return hi >= jfirst ? (hi - jfirst) / kDecKeys + 1 : 1;
}

// Flat split: pre[i] = chunks of items 0..i-1 (one kv head's share), pre[n] =
// all; returns the model's CTAs to use of its budget mctas (the same on every
// head shard: counts are over the model's kv heads): when every item with q
// has the same chunk count, a multiple of the segments (each (item, kv head)
// cut into equal parts, no piece straddling two: a balanced batch runs as a
// per-item split would); otherwise all of them (at most one per chunk).
template <class C> __device__ int dec_prefix(const DecodeParams &P, int *pre, int *scratch) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n = P.nitems;
  const int per = (n + C::NTH - 1) / C::NTH, i0 = min(n, tid * per), i1 = min(n, i0 + per);
  int sum = 0, mn = 0x7fffffff, mx = 0, nq = 0, jf, lo, hi;
  for (int i = i0; i < i1; i++) {
    const attnd_kitem_t it = P.items[i];
    const int c = dec_item_chunks(it, P.window, jf, lo, hi);
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
    run += dec_item_chunks(it, P.window, jf, lo, hi);
  }
  if (tid == C::NTH - 1)
    pre[n] = run;
  mn = min(min(scratch[4], scratch[5]), min(scratch[6], scratch[7]));
  mx = max(max(scratch[8], scratch[9]), max(scratch[10], scratch[11]));
  nq = scratch[12] + scratch[13] + scratch[14] + scratch[15];
  __syncthreads();
  const long long w = (long long)P.mkv * pre[n];
  if (mn == mx && nq > 0) {
    const long long segs = (long long)P.mkv * nq;
    long long k = P.mctas / segs;
    k = k < 1 ? 1 : k > mx ? mx : k;
    return (int)min((long long)P.mctas, segs * k);
  }
  return (int)min((long long)P.mctas, w);
}

// PV16: the kPv16 form (launch option debug 32768, Dec::kPv16), a kernel of
// its own (one kernel holding both pieces spilled ~300 bytes at 128 registers).
template <int D, int DT, int KV, bool TR, bool PV16 = false>
__global__ void __launch_bounds__(kDecWarps * 32, Dec<D, DT, KV, TR>::MINB)
    decode_kernel(const __grid_constant__ DecodeParams P) {
  using C = Dec<D, DT, KV, TR, PV16>;
  extern __shared__ __align__(16) uint8_t smem[];
  pdl_trigger(); // the merge may launch now; it waits for this grid's end
  if (!P.flat) {
    // Launch option debug 4096 (timing A/B, results exact: the same pieces):
    // the CTAs head-major, kv head blockIdx.x / nitems, so that neighbouring
    // (co-resident) CTAs read different items' blocks, as the flat split and
    // bench_loads' probe order them, instead of all kv heads of one block.
    const bool hm = (P.debug & 4096) != 0;
    const int item = hm ? blockIdx.x % P.nitems : blockIdx.x / P.kv_heads;
    const int kvh = hm ? blockIdx.x / P.nitems : blockIdx.x % P.kv_heads, split = blockIdx.z;
    const attnd_kitem_t it = P.items[item];
    if (it.q_row < 0)
      return;
    int lo, hi;
    key_range(it, it.start, it.start + it.n - 1, P.window, lo, hi);
    int out_kind = kOutFinal;
    const int b0 = P.window > 0 ? lo : 0; // a sliding layer's parts cover its window only
    if (P.nsplit > 1) {
      lo = max(lo, b0 + split * P.split_keys);
      hi = min(hi, b0 + (split + 1) * P.split_keys - 1);
      out_kind = P.cluster > 1 ? kOutCluster : kOutSplit;
    }
    // The fused step: the new rows this part owns computed before the wait
    // and staged (stored after it), or, where they do not fit the stage
    // area, both after it.
    const bool fpre = P.fuse && dec_fused_fits<C>(it);
    if (fpre)
      dec_fused_stage<C>(P, smem, it, kvh, split, b0);
    pdl_wait(); // q and the cache are written by the previous kernel
    if (fpre)
      dec_fused_store<C>(P, smem, it, kvh, split, b0);
    else if (P.fuse)
      dec_fused_write<C>(P, smem, it, kvh, split, b0);
    if (split == 0 && P.sinks && (it.flags & ATTND_ITEM_SINK))
      out_kind |= kOutSink;
    dec_piece<C>(P, smem, it, kvh, lo, hi, out_kind, split);
    if (P.cluster > 1)
      dec_cluster_merge<C>(P, smem, it, kvh); // every CTA of the cluster gets here (one item)
    if (P.fuse && split == 0)
      dec_fused_q<C>(P, smem, it, kvh);
    return;
  }
  // Flat split (decode_params.cuh): model CTA cm = cfirst + blockIdx.x takes
  // chunks [u, u1) of the W in all, laid head-major over the model's kv heads
  // and clipped to the held heads' range [lo, hi), so that a head shard cuts
  // every (item, kv head) exactly as the whole model's daemon does.
  int *pre = reinterpret_cast<int *>(smem + C::kStages);
  int *scratch = reinterpret_cast<int *>(smem + C::kMisc) + 64;
  const int nc = dec_prefix<C>(P, pre, scratch); // the model's CTAs
  const long long S = pre[P.nitems], W = (long long)P.mkv * S;
  const long long lo = (long long)P.kvh0 * S, hi = lo + (long long)P.kv_heads * S;
  const int cfirst = W > 0 ? flat_cta(lo, nc, W) : 0, cm = cfirst + (int)blockIdx.x;
  long long u = 0, u1 = 0;
  if (cm < nc) {
    u = flat_clip(cm, nc, W, lo, hi);
    u1 = flat_clip(cm + 1, nc, W, lo, hi);
  }
  if (u >= u1 && blockIdx.x != 0)
    return;
  // Chunk u: model kv head hm, the item i holding it (the last i with
  // pre[i] <= u - hm S: it has chunks), whose first chunk is base. Found
  // before the first piece: dec_piece reuses pre's shared memory.
  int hm = 0, i = 0;
  long long base = 0;
  if (u < u1) {
    hm = (int)(u / S);
    const long long r = u - (long long)hm * S;
    int a = 0, b = P.nitems - 1;
    while (a < b) {
      const int mid = (a + b + 1) >> 1;
      if (pre[mid] <= r)
        a = mid;
      else
        b = mid - 1;
    }
    i = a;
    base = (long long)hm * S + pre[i];
  }
  pdl_wait(); // q, the cache and the workspace belong to the previous kernel until here
  if (blockIdx.x == 0 && P.nctas > 1) { // the prefix sums and the CTA counts, for the merge
    int *wpre = reinterpret_cast<int *>(P.ws + flat_prefix_offset(P.nctas, P.max_vec, D));
    for (int j = threadIdx.x; j <= P.nitems; j += C::NTH)
      wpre[j] = pre[j];
    if (threadIdx.x == 0) {
      wpre[P.nitems + 1] = nc;
      wpre[P.nitems + 2] = cfirst;
    }
  }
  const int slot0 = 2 * (int)blockIdx.x;
  bool first = true;
  while (u < u1) {
    const attnd_kitem_t it = P.items[i];
    int jfirst, klo0, khi0;
    const int nch = dec_item_chunks(it, P.window, jfirst, klo0, khi0);
    const int a = (int)(u - base);
    const int b = (int)min((long long)nch, a + (u1 - u));
    const bool whole = a == 0 && b == nch;
    const int klo = max(klo0, jfirst + a * kDecKeys), khi = min(khi0, jfirst + b * kDecKeys - 1);
    const int sk = a == 0 && P.sinks && (it.flags & ATTND_ITEM_SINK) ? kOutSink : 0;
    dec_piece<C>(P, smem, it, hm - P.kvh0, klo, khi, (whole ? kOutFinal : kOutSlot) | sk, slot0 + (first ? 0 : 1));
    u += b - a;
    first = false;
    if (b == nch) { // the next item with chunks, in this head or from the next head's first
      base += nch;
      do
        i++;
      while (i < P.nitems && P.items[i].q_row < 0);
      if (i == P.nitems) {
        hm++;
        i = 0;
        while (i < P.nitems && P.items[i].q_row < 0)
          i++;
      }
    }
  }
}

} // namespace attnd

// bench_loads.cu: which load mechanism reads a paged KV cache at the read roof.
//
// No attention math: each mechanism moves the K and V rows of every (item, kv
// head) of a paged cache into the SM (shared memory or registers) and XORs
// every word it received, so that the check (the XOR of the whole cache)
// fails if a byte was skipped or read twice. The layout is the decode
// kernel's (kernels/cuda/decode_layout.cuh): a block holds, per kv head, its
// bs K rows of RB bytes contiguous, then (after every kv head's K rows) the V
// rows the same way; a block table maps an item's key blocks to random pool
// blocks. The work is cut as the flat split cuts it: the 16-key chunks of
// every (item, kv head), head-major, CTA c takes chunks [c W / C, (c+1) W / C)
// (no tail effects: C = CTAs per SM x SMs, one wave).
//
// Mechanisms (mode):
//   cpasync   each of 4 warps takes every fourth chunk into its own NS stages,
//             16-byte cp.async per lane (today's decode path), NS - 1 ahead;
//   cpa_touch the same, but only one word of each stage is read back (the
//             decode kernel's no-math timing);
//   bulkwarp  the same private per-warp stages, one lane issuing two bulk
//             copies (cp.async.bulk ... mbarrier::complete_tx) per chunk
//             (the chunk's K rows and its V rows, 16 RB bytes each);
//   bulkrows  the same, every lane one bulk copy of one row (16 K + 16 V
//             rows) into rows padded by 64 bytes (what a bank-conflict-free
//             layout would cost the copy engine);
//   cpa_rot   cpasync with each CTA's chunks from a CTA-dependent start,
//             wrapping (the decode kernel's launch option debug 1024);
//   cpa_kc / cpa_hm  cpasync in the decode kernel's per-item cut: one CTA per
//             (item, kv head), items x kv heads CTAs (two waves at 2 CTA/SM),
//             item-major (the kv heads of one item on neighbouring CTAs, as
//             the decode kernel launches them) or head-major;
//   ring16 / ring64  a producer warp (one lane) fills a CTA-wide ring of NS
//             stages (mbarrier full / empty) with 16 or 64 keys of one
//             (item, kv head) per stage (K and V, two bulk copies; 64 keys
//             is a whole (block, kv head) region, 2 x 4-16 KB); the 4
//             consumer warps take a quarter of each stage and release it;
//   ldg       plain ld.global.nc.v4 into registers, 1-4 chunks (4-32 16-byte
//             loads) in flight per lane, each warp its fourth of the chunks;
//   kcopy_*   the decode kernel's own copy functions (decode_layout.cuh:
//             dec_issue, dec_issue_ref) or a linear copy, in the kernel's own
//             configuration (Dec<>: CTAs per SM, stages, shared memory) and
//             no-math loop (dec_piece), 1 or NS - 1 chunks ahead, on the
//             random and strided tables, in three cuts (kc: one CTA per (item,
//             kv head) as the kernel, hm: the same head-major, flat: this
//             file's).
// Each at 1-4 CTAs per SM (shared memory requested so that exactly that many
// fit) and 2-8 stages, row sizes RB 256 (16-bit d128), 128 (8-bit d128) and
// 64 (int4 d128); B64 ctx4096, 8 kv heads, block 64. The read roof is measured
// in the same run (a flat 4 GiB read, best of a few launch shapes).
//
// Block tables: random (the whole matrix), then bench_common.cu's strided
// permutation and contiguous blocks per item (the decode kernel's
// configurations only).
//
// Output: one line per configuration (mode, RB, CTAs/SM, stages, us, GB/s,
// % of the read roof, check, table), then the best per (mode, RB) on the
// random table; JSON lines to argv[1] if given.
#include <algorithm>
#include <numeric>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench_common.cuh" /* CK */
#include "decode_layout.cuh"
#include "sm90_primitives.cuh"

using namespace attnd::sm90;

namespace {

constexpr int kKeys = 16; // keys per chunk (the decode kernel's kDecKeys)
constexpr int kWarps = 4;

struct Lay {
  const uint8_t *cache;
  const int32_t *bt;
  int items, nb;    // items, blocks per item
  int kvh, bs, lbs; // kv heads, block size, log2
  int rb;           // bytes per row
  size_t vreg;      // K region -> V region of a block
  size_t block_bytes;
  long long W; // chunks in all
  int nch;     // chunks per (item, kv head)
  unsigned *xr;
};

// Global source of K row 0 of chunk u (V at + vreg).
__device__ __forceinline__ const uint8_t *chunk_src(const Lay &L, int u, int keys) {
  const int per = L.items * L.nch;
  const int hm = u / per, r = u - hm * per;
  const int item = r / L.nch, ch = r - item * L.nch;
  const int j0 = ch * keys;
  const int blk = L.bt[item * L.nb + (j0 >> L.lbs)];
  const int row = hm * L.bs + (j0 & (L.bs - 1));
  return L.cache + (size_t)blk * L.block_bytes + (size_t)row * L.rb;
}

__device__ __forceinline__ void cp16(uint32_t dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ uint4 ldg_nc(const void *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t x4(uint4 v) {
  return v.x ^ v.y ^ v.z ^ v.w;
}

// XOR of n bytes of shared memory at s, lane-strided 16-byte reads.
__device__ __forceinline__ uint32_t xor_smem(const uint8_t *s, int n, int lane) {
  uint32_t a = 0;
  for (int o = lane * 16; o < n; o += 512)
    a ^= x4(*reinterpret_cast<const uint4 *>(s + o));
  return a;
}

// mbarrier wait that traps after ~2 s (a broken pipeline fails the launch
// instead of hanging the run).
__device__ __forceinline__ void bwait(uint32_t bar, uint32_t parity) {
  const long long t0 = clock64();
  while (!mbar_try_wait(bar, parity))
    if (clock64() - t0 > 4000000000ll)
      __trap();
}

__device__ __forceinline__ void finish(const Lay &L, uint32_t acc) {
#pragma unroll
  for (int o = 16; o; o >>= 1)
    acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0)
    atomicXor(L.xr, acc);
}

// ---- per-warp private stages: cp.async (mode 0, 1) or bulk copies (2, 3) -------
// mode 0 cpasync, 1 cpa_touch, 2 bulkwarp, 3 bulkrows, 4 cpa_rot; 5 cpa_kc and
// 6 cpa_hm: cpasync in the decode kernel's per-item cut (one CTA per (item,
// kv head), launched with items x kv heads CTAs), item-major (5: CTA b the
// pair of item b / kvh, kv head b % kvh) or head-major (6: pair b of the
// head-major sequence, i.e. the flat cut over that many CTAs); 7 cpa_mis:
// cpasync with the stages 64 bytes past a 128-byte boundary, where the
// decode kernel's are (Dec<>::kStages).
template <int NS> __global__ void __launch_bounds__(128) k_warp(Lay L, int mode) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[kWarps][NS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int RB = L.rb, CB = kKeys * RB;       // chunk bytes, K or V
  const int pitch = mode == 3 ? RB + 64 : RB; // padded rows for bulkrows
  const int stage_bytes = 2 * kKeys * pitch;
  uint8_t *my = smem + (mode == 7 ? 64 : 0) + (size_t)warp * NS * stage_bytes;
  const uint32_t sm = smem_u32(my);
  const int C = gridDim.x;
  int u0 = (int)((long long)blockIdx.x * L.W / C),
      u1 = (int)((long long)(blockIdx.x + 1) * L.W / C);
  if (mode == 5) {
    const int item = blockIdx.x / L.kvh, kvh = blockIdx.x % L.kvh;
    u0 = (kvh * L.items + item) * L.nch;
    u1 = u0 + L.nch;
  }
  const int cnt = u1 - u0 > warp ? (u1 - u0 - 1 - warp) / kWarps + 1 : 0;
  const bool bulk = mode == 2 || mode == 3;
  if (bulk && lane < NS)
    mbar_init(smem_u32(&bars[warp][lane]), 1);
  if (bulk)
    mbar_init_fence();
  __syncwarp();
  // mode 4: cpasync with the CTA's chunks from a CTA-dependent start, wrapping
  // (the decode kernel's launch option debug 1024).
  const int span = u1 - u0;
  const int rot =
      mode == 4 && span > 1 ? (int)(((blockIdx.x * 0x9E3779B1u) >> 8) % (unsigned)span) : 0;
  auto chunk_of = [&](int n) {
    int c = warp + kWarps * n + rot;
    return u0 + (c >= span ? c - span : c);
  };
  auto issue = [&](int n, int s) {
    const uint8_t *k = chunk_src(L, chunk_of(n), kKeys);
    const uint32_t dst = sm + s * stage_bytes;
    if (mode <= 1 || mode >= 4) {
      for (int o = lane * 16; o < CB; o += 512) {
        cp16(dst + o, k + o);
        cp16(dst + CB + o, k + L.vreg + o);
      }
    } else if (mode == 2) {
      if (lane == 0) {
        const uint32_t b = smem_u32(&bars[warp][s]);
        mbar_arrive_expect_tx(b, 2 * CB);
        bulk_load(dst, k, CB, b);
        bulk_load(dst + CB, k + L.vreg, CB, b);
      }
    } else {
      const uint32_t b = smem_u32(&bars[warp][s]);
      if (lane == 0)
        mbar_arrive_expect_tx(b, 2 * CB);
      __syncwarp();
      const int r = lane & 15;
      const uint8_t *src = (lane < 16 ? k : k + L.vreg) + (size_t)r * RB;
      bulk_load(dst + (lane < 16 ? 0 : kKeys * pitch) + r * pitch, src, RB, b);
    }
  };
  uint32_t acc = 0;
#pragma unroll
  for (int n = 0; n < NS - 1; n++) {
    if (n < cnt)
      issue(n, n);
    if (!bulk)
      cp_commit();
  }
  int s = 0;
  uint32_t ph = 0; // bit s: parity of stage s's next phase
  for (int n = 0; n < cnt; n++) {
    if (n + NS - 1 < cnt)
      issue(n + NS - 1, s == 0 ? NS - 1 : s - 1);
    const uint8_t *sb = my + s * stage_bytes;
    if (!bulk) {
      cp_commit();
      cp_wait<NS - 1>();
      __syncwarp();
    } else {
      bwait(smem_u32(&bars[warp][s]), (ph >> s) & 1);
      ph ^= 1u << s;
    }
    if (mode == 1) {
      acc ^= *reinterpret_cast<const uint32_t *>(sb + lane * 4);
    } else if (mode == 3) {
      const int upr = RB / 16; // 16-byte units per row
      for (int q = lane; q < 2 * kKeys * upr; q += 32)
        acc ^= x4(*reinterpret_cast<const uint4 *>(sb + (q / upr) * pitch + (q % upr) * 16));
    } else {
      acc ^= xor_smem(sb, 2 * CB, lane);
    }
    __syncwarp(); // the stage is refilled next iteration
    s = s == NS - 1 ? 0 : s + 1;
  }
  if (!bulk)
    cp_wait<0>();
  finish(L, mode == 1 ? 0u : acc);
}

// ---- CTA ring: a producer warp, 4 consumer warps (modes 4, 5, 6) ---------------
// A stage holds SK keys of one (item, kv head): K rows, then V rows.
template <int NS> __global__ void __launch_bounds__(160) k_ring(Lay L, int sk) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t full[NS], empty[NS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int RB = L.rb, SB = sk * RB, stage_bytes = 2 * SB;
  const uint32_t sm = smem_u32(smem);
  // Units of sk keys (sk a multiple of 16 dividing bs): W / (sk / 16) of them.
  const long long Wu = L.W / (sk / kKeys);
  const int C = gridDim.x, u0 = (int)(blockIdx.x * Wu / C), u1 = (int)((blockIdx.x + 1) * Wu / C);
  const int cnt = u1 - u0;
  if (threadIdx.x < NS) {
    mbar_init(smem_u32(&full[threadIdx.x]), 1);
    mbar_init(smem_u32(&empty[threadIdx.x]), kWarps);
  }
  mbar_init_fence();
  __syncthreads();
  Lay Lu = L;
  Lu.nch = L.nch / (sk / kKeys);
  if (warp == kWarps) { // producer
    if (lane == 0) {
      for (int n = 0; n < cnt; n++) {
        const int s = n % NS;
        if (n >= NS)
          bwait(smem_u32(&empty[s]), ((n / NS) - 1) & 1);
        const uint8_t *k = chunk_src(Lu, u0 + n, sk);
        const uint32_t b = smem_u32(&full[s]);
        mbar_arrive_expect_tx(b, 2 * SB);
        bulk_load(sm + s * stage_bytes, k, SB, b);
        bulk_load(sm + s * stage_bytes + SB, k + L.vreg, SB, b);
      }
    }
    return;
  }
  uint32_t acc = 0;
  for (int n = 0; n < cnt; n++) {
    const int s = n % NS;
    bwait(smem_u32(&full[s]), (n / NS) & 1);
    // Warp w: a quarter of the K rows and a quarter of the V rows.
    const uint8_t *sb = smem + (size_t)s * stage_bytes;
    acc ^= xor_smem(sb + warp * (SB / kWarps), SB / kWarps, lane);
    acc ^= xor_smem(sb + SB + warp * (SB / kWarps), SB / kWarps, lane);
    __syncwarp();
    if (lane == 0)
      mbar_arrive(smem_u32(&empty[s]));
  }
  finish(L, acc);
}

// ---- registers: ld.global.nc.v4, U chunks (U RB / 16 loads) in flight per lane -
template <int RB, int U> __global__ void __launch_bounds__(128) k_ldg(Lay L) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int PER = RB / 16, HALF = PER / 2; // 16-byte loads per lane per chunk (K, then V)
  const int C = gridDim.x, u0 = (int)((long long)blockIdx.x * L.W / C),
            u1 = (int)((long long)(blockIdx.x + 1) * L.W / C);
  const int cnt = u1 - u0 > warp ? (u1 - u0 - 1 - warp) / kWarps + 1 : 0;
  uint32_t acc = 0;
  for (int n = 0; n < cnt; n += U) {
    uint4 v[U][PER];
#pragma unroll
    for (int k = 0; k < U; k++) {
      const bool ok = n + k < cnt;
      const uint8_t *src = chunk_src(L, u0 + warp + kWarps * (ok ? n + k : n), kKeys) + lane * 16;
#pragma unroll
      for (int p = 0; p < PER; p++)
        v[k][p] =
            ok ? ldg_nc(src + (p < HALF ? 0 : L.vreg) + (p % HALF) * 512) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < U; k++)
#pragma unroll
      for (int p = 0; p < PER; p++)
        acc ^= x4(v[k][p]);
  }
  finish(L, acc);
}

// ---- the decode kernel's own copy path (decode_layout.cuh), its own cut ------
// Dec<C>'s CTAs per SM, stages, shared memory, and the no-math loop of
// dec_piece (refill the stage a chunk ahead, wait, nothing read back). mode 0:
// dec_issue with the block-table entry read a refill ahead (the 16-bit types'
// default), 1: dec_issue_ref (the 1-byte types' default), 2: this file's
// linear cp16 copy (no swizzle). la: chunks issued ahead. cut: which CTA
// takes which chunks:
//   0 (kc)   one CTA per (item, kv head), item-major (CTA b: item b / kvh,
//            kv head b % kvh): the per-item split as the decode kernel
//            launches B64, the kv heads of one item on neighbouring CTAs;
//   1 (hm)   one CTA per (item, kv head), head-major (kv head b / items, item
//            b % items): the same pieces, the probe's order of them;
//   2 (flat) the probe's cut: one wave of CTAs, CTA c the head-major chunks
//            [c W / C, (c + 1) W / C) (crossing (item, kv head) pieces).
// Every warp takes every NW-th chunk of its CTA's range.
template <class C>
__global__ void __launch_bounds__(C::NTH, C::MINB)
    k_kcopy(Lay L, attnd::DecodeParams P, int mode, int la, int cut, int al) {
  using namespace attnd;
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int NS = C::NS, KS = C::KS, NW = C::NW;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // [u0, u1): this CTA's chunks in the head-major sequence of all W.
  long long u0, u1;
  if (cut == 2) {
    u0 = (long long)blockIdx.x * L.W / gridDim.x;
    u1 = (long long)(blockIdx.x + 1) * L.W / gridDim.x;
  } else {
    const int item = cut == 0 ? blockIdx.x / L.kvh : blockIdx.x % L.items;
    const int kvh = cut == 0 ? blockIdx.x % L.kvh : blockIdx.x / L.items;
    u0 = ((long long)kvh * L.items + item) * L.nch;
    u1 = u0 + L.nch;
  }
  uint8_t *myStages = smem + C::kStages + (al ? C::kStagePad : 0) + (size_t)warp * NS * C::kStage;
  const uint32_t sStages = (uint32_t)__cvta_generic_to_shared(myStages);
  if (blockIdx.x == 0 && threadIdx.x == 0)
    L.xr[2] = sStages; // where warp 0's stages start (the row prints it mod 128)
  const int khi = L.nch * KS - 1;
  const int span = (int)(u1 - u0);
  const int cnt = span > warp ? (span - 1 - warp) / NW + 1 : 0;
  DecCopy<C> cpy;
  const int kvh0 = (int)(u0 / ((long long)L.items * L.nch));
  dec_copy_init<C>(P, kvh0, lane, cpy);
  // Chunk n of this warp: its kv head, item and first key.
  struct Where {
    int kvh, item, j0;
  };
  auto where = [&](int n) {
    const long long u = u0 + warp + (long long)NW * n;
    const int per = L.items * L.nch;
    const int kvh = (int)(u / per), r = (int)(u - (long long)kvh * per);
    const int item = r / L.nch;
    return Where{kvh, item, (r - item * L.nch) * KS};
  };
  auto entry = [&](const Where &w) { return L.bt[w.item * L.nb + (w.j0 >> cpy.lbs)]; };
  auto issue = [&](int n, int st, int32_t blk) {
    const Where w = where(n);
    if (mode == 0) {
      cpy.rowbase = w.kvh * P.bs;
      dec_issue<C>(P, cpy, blk, w.j0, khi, sStages + st * C::kStage, lane);
    } else if (mode == 1) {
      dec_issue_ref<C>(P, L.bt + w.item * L.nb, w.kvh, w.j0, khi, myStages + st * C::kStage, lane);
    } else {
      const uint8_t *k = P.cache + (size_t)blk * P.block_bytes +
                         (size_t)(w.kvh * P.bs + (w.j0 & (P.bs - 1))) * C::RB;
      const uint32_t dst = sStages + st * C::kStage;
      for (int o = lane * 16; o < KS * C::RB; o += 512) {
        cp16(dst + o, k + o);
        cp16(dst + KS * C::RB + o, k + cpy.vreg + o);
      }
    }
  };
#pragma unroll
  for (int n = 0; n < NS - 1; n++) {
    if (n < cnt && n < la)
      issue(n, n, entry(where(n)));
    cp_commit();
  }
  int32_t nblk = la < cnt ? entry(where(la)) : 0;
  uint32_t acc = 0;
  int stage = 0;
  for (int n = 0; n < cnt; n++) {
    if (n + la < cnt) {
      const int refill = stage + la >= NS ? stage + la - NS : stage + la;
      issue(n + la, refill, nblk);
      if (n + la + 1 < cnt)
        nblk = entry(where(n + la + 1));
    }
    cp_commit();
    if (la == NS - 1)
      cp_wait<NS - 1>();
    else
      cp_wait<1>();
    __syncwarp();
    acc ^= *reinterpret_cast<const uint32_t *>(myStages + stage * C::kStage + lane * 4);
    stage = stage == NS - 1 ? 0 : stage + 1;
  }
  cp_wait<0>();
  if (acc == 0x9e3779b9u)
    atomicXor(L.xr + 1, acc);
}

template <class C>
void run_kcopy(const Lay &L, double roof, size_t bytes, FILE *js, const char *table, int sms) {
  auto kern = k_kcopy<C>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::kBytes));
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, C::NTH, C::kBytes));
  attnd::DecodeParams P = {};
  P.cache = L.cache;
  P.block_bytes = L.block_bytes;
  P.bs = L.bs;
  P.kv_heads = L.kvh;
  const char *names[] = {"kcopy_issue", "kcopy_ref", "kcopy_lin"};
  const char *cuts[] = {"kc", "hm", "flat"};
  // al 0: the stages where the decode kernel has them (Dec<>::kStages), al 1:
  // kStagePad later, on a 128-byte boundary (launch option debug 8192).
  for (int al = 0; al < 2; al++)
    for (int cut = 0; cut < 3; cut++)
      for (int mode = 0; mode < 3; mode++)
        for (int la : {1, C::NS - 1}) {
          const unsigned grid = cut == 2 ? (unsigned)(occ * sms) : (unsigned)(L.items * L.kvh);
          const float us =
              median_us([&] { kern<<<grid, C::NTH, C::kBytes>>>(L, P, mode, la, cut, al); }, 2, 7);
          CK(cudaGetLastError());
          unsigned sst = 0;
          CK(cudaMemcpy(&sst, L.xr + 2, 4, cudaMemcpyDeviceToHost));
          const double gbps = bytes / (us * 1e-6) / 1e9;
          printf(
              "%-11s RB %3d  %d CTA/SM  %d stages, %d ahead  cut %-4s  stages %%128 %3u  %8.1f us  "
              "%6.0f GB/s  %5.1f%%  %s\n",
              names[mode], C::RB, occ, C::NS, la, cuts[cut], sst % 128, us, gbps, 100 * gbps / roof,
              table);
          if (js)
            fprintf(
                js,
                "{\"row\": \"kcopy\", \"mode\": \"%s\", \"rb\": %d, \"per_sm\": %d, \"ns\": %d, "
                "\"ahead\": %d, \"cut\": \"%s\", \"stage_mod128\": %u, "
                "\"us\": %.2f, \"GBps\": %.1f, \"pct\": %.2f, \"table\": \"%s\"}\n",
                names[mode], C::RB, occ, C::NS, la, cuts[cut], sst % 128, us, gbps,
                100 * gbps / roof, table);
        }
}

__global__ void fill(uint32_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = x;
  }
}
template <int U> __global__ void xor_all(const uint4 *p, size_t n, unsigned *out) {
  uint32_t a = 0;
  const size_t st = (size_t)gridDim.x * blockDim.x;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i + (U - 1) * st < n; i += U * st) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; k++)
      v[k] = ldg_nc(p + i + k * st);
#pragma unroll
    for (int k = 0; k < U; k++)
      a ^= x4(v[k]);
  }
  for (; i < n; i += st)
    a ^= x4(ldg_nc(p + i));
#pragma unroll
  for (int o = 16; o; o >>= 1)
    a ^= __shfl_xor_sync(0xffffffffu, a, o);
  if ((threadIdx.x & 31) == 0)
    atomicXor(out, a);
}

template <class F> float median_us(F fn, int warm, int iters) {
  for (int i = 0; i < warm; i++)
    fn();
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int i = 0; i < iters; i++) {
    CK(cudaEventRecord(a));
    fn();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3f);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

const char *kModes[] = {"cpasync", "cpa_touch", "bulkwarp", "bulkrows", "cpa_rot", "cpa_kc",
                        "cpa_hm",  "cpa_mis",   "ring16",   "ring64",   "ldg"};

struct Res {
  std::string mode;
  int rb, per_sm, ns;
  float us;
  double gbps;
};

template <class K> bool fits(K kern, int threads, size_t smem, int per_sm) {
  if (smem > 232448)
    return false;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int b = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kern, threads, smem));
  return b == per_sm;
}

} // namespace

int main(int argc, char **argv) {
  FILE *js = argc > 1 ? fopen(argv[1], "w") : nullptr;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned *xr;
  CK(cudaMalloc(&xr, 16));
  // The read roof: a flat read of 4 GiB.
  double roof = 0;
  {
    const size_t n = (size_t)4 << 30;
    void *buf;
    CK(cudaMalloc(&buf, n));
    fill<<<sms * 8, 256>>>((uint32_t *)buf, n / 4, 7);
    for (int per : {4, 8}) {
      const float a =
          median_us([&] { xor_all<4><<<sms * per, 256>>>((const uint4 *)buf, n / 16, xr); }, 2, 10);
      const float b =
          median_us([&] { xor_all<8><<<sms * per, 256>>>((const uint4 *)buf, n / 16, xr); }, 2, 10);
      roof = std::max(roof, n / (std::min(a, b) * 1e-6) / 1e9);
    }
    CK(cudaFree(buf));
  }
  printf("read roof %.0f GB/s\n", roof);
  if (js)
    fprintf(js, "{\"row\": \"roof\", \"GBps\": %.1f}\n", roof);
  const int B = 64, ctx = 4096, KVH = 8, BS = 64;
  std::vector<Res> all;
  // Block tables: 0 a random permutation of the pool, 1 bench_common.cu's
  // strided permutation (logical block l -> l * 7919 mod blocks: the blocks
  // that the items read at one moment are congruent mod 64), 2 contiguous
  // per item. The whole matrix on 0, the decode kernel's configurations on 1, 2.
  const char *tname[] = {"random", "strided", "contig"};
  for (int table = 0; table < 3; table++)
    for (int rb : {256, 128, 64}) {
      const int nb = ctx / BS, nblk = B * nb;
      const size_t vreg = (size_t)KVH * BS * rb, bbytes = 2 * vreg, bytes = bbytes * nblk;
      uint8_t *cache;
      int32_t *bt;
      CK(cudaMalloc(&cache, bytes));
      CK(cudaMalloc(&bt, nblk * 4));
      fill<<<sms * 8, 256>>>((uint32_t *)cache, bytes / 4, 1234 + rb);
      std::vector<int32_t> h(nblk);
      for (int i = 0; i < nblk; i++)
        h[i] = i;
      srand(rb);
      if (table == 0)
        for (int i = nblk - 1; i > 0; i--)
          std::swap(h[i], h[rand() % (i + 1)]);
      if (table == 1) {
        size_t st = 7919;
        while (std::gcd(st, (size_t)nblk) != 1)
          st++;
        for (int i = 0; i < nblk; i++)
          h[i] = (int32_t)((i * st) % nblk);
      }
      CK(cudaMemcpy(bt, h.data(), nblk * 4, cudaMemcpyHostToDevice));
      CK(cudaMemset(xr, 0, 4));
      xor_all<1><<<sms * 8, 256>>>((const uint4 *)cache, bytes / 16, xr);
      unsigned want;
      CK(cudaMemcpy(&want, xr, 4, cudaMemcpyDeviceToHost));
      Lay L{
          cache,       bt, B, nb, KVH, BS, 6, rb, vreg, bbytes, (long long)B * KVH * (ctx / kKeys),
          ctx / kKeys, xr};
      auto run = [&](const char *mode, int per_sm, int ns, auto launch) {
        CK(cudaMemset(xr, 0, 4));
        launch();
        CK(cudaGetLastError());
        unsigned got;
        CK(cudaMemcpy(&got, xr, 4, cudaMemcpyDeviceToHost));
        const bool ok = strcmp(mode, "cpa_touch") == 0 || got == want;
        const float us = median_us(launch, 2, 7);
        const double gbps = bytes / (us * 1e-6) / 1e9;
        printf(
            "%-9s RB %3d  %d CTA/SM  %d stages/inflight  %8.1f us  %6.0f GB/s  %5.1f%%  %s  %s\n",
            mode, rb, per_sm, ns, us, gbps, 100 * gbps / roof, ok ? "ok" : "MISMATCH",
            tname[table]);
        if (js)
          fprintf(js,
                  "{\"row\": \"load\", \"mode\": \"%s\", \"rb\": %d, \"per_sm\": %d, \"ns\": %d, "
                  "\"us\": %.2f, "
                  "\"GBps\": %.1f, \"pct\": %.2f, \"ok\": %d, \"table\": \"%s\"}\n",
                  mode, rb, per_sm, ns, us, gbps, 100 * gbps / roof, ok, tname[table]);
        if (ok && table == 0)
          all.push_back({mode, rb, per_sm, ns, us, gbps});
      };
      for (int per_sm = 1; per_sm <= 4; per_sm++) {
        if (table > 0 && per_sm != (rb == 256 ? 2 : 4))
          continue; // the decode kernel's CTAs per SM for these row sizes
        const size_t avail = 233472 / per_sm - 1024 - 1024; // static mbarriers and slack
        const dim3 grid(sms * per_sm);
        // Per-warp private stages.
        for (int mode = 0; mode < 8; mode++)
          for (int ns : {2, 3, 4, 6, 8}) {
            if (table > 0 && (mode == 2 || mode == 3 || ns > 3))
              continue;
            if (table == 0 && mode == 4 && ns > 3)
              continue;
            // The per-item cuts: the decode kernel's CTAs per SM only.
            if (mode >= 5 && (per_sm != (rb == 256 ? 2 : 4) || ns > 3))
              continue;
            const dim3 g = mode == 5 || mode == 6 ? dim3(L.items * L.kvh) : grid;
            const int pitch = mode == 3 ? rb + 64 : rb;
            const size_t need = (size_t)kWarps * ns * 2 * kKeys * pitch + (mode == 7 ? 64 : 0);
            auto go = [&](auto kern) {
              if (need > avail || !fits(kern, 128, avail, per_sm))
                return;
              run(kModes[mode], per_sm, ns, [&] { kern<<<g, 128, avail>>>(L, mode); });
            };
            switch (ns) {
            case 2:
              go(k_warp<2>);
              break;
            case 3:
              go(k_warp<3>);
              break;
            case 4:
              go(k_warp<4>);
              break;
            case 6:
              go(k_warp<6>);
              break;
            default:
              go(k_warp<8>);
              break;
            }
          }
        // CTA ring: 16 or 64 keys per stage.
        for (int sk : {16, 64})
          for (int ns : {2, 3, 4, 6, 8}) {
            if (table > 0 && (sk == 16 || ns != 3))
              continue;
            const size_t need = (size_t)ns * 2 * sk * rb;
            auto go = [&](auto kern) {
              if (need > avail || !fits(kern, 160, avail, per_sm))
                return;
              run(sk == 16 ? "ring16" : "ring64", per_sm, ns,
                  [&] { kern<<<grid, 160, avail>>>(L, sk); });
            };
            switch (ns) {
            case 2:
              go(k_ring<2>);
              break;
            case 3:
              go(k_ring<3>);
              break;
            case 4:
              go(k_ring<4>);
              break;
            case 6:
              go(k_ring<6>);
              break;
            default:
              go(k_ring<8>);
              break;
            }
          }
        // Registers.
        // (ns column: 16-byte loads in flight per lane.)
        if (table > 0)
          continue;
        auto go = [&](auto kern, int inflight) {
          if (fits(kern, 128, avail, per_sm))
            run("ldg", per_sm, inflight, [&] { kern<<<grid, 128, avail>>>(L); });
        };
        if (rb == 256) {
          go(k_ldg<256, 1>, 16);
          go(k_ldg<256, 2>, 32);
        } else if (rb == 128) {
          go(k_ldg<128, 1>, 8);
          go(k_ldg<128, 2>, 16);
          go(k_ldg<128, 4>, 32);
        } else {
          go(k_ldg<64, 1>, 4);
          go(k_ldg<64, 2>, 8);
          go(k_ldg<64, 4>, 16);
        }
      }
      // The decode kernel's copy path in its own configuration (d128, bf16
      // activations, transposed form: the B64 decode rows' instantiations).
      if (table < 2) {
        if (rb == 256)
          run_kcopy<attnd::Dec<128, ATTND_DT_BF16, ATTND_KV_BF16, true>>(L, roof, bytes, js,
                                                                         tname[table], sms);
        else if (rb == 128)
          run_kcopy<attnd::Dec<128, ATTND_DT_BF16, ATTND_KV_INT8, true>>(L, roof, bytes, js,
                                                                         tname[table], sms);
        else
          run_kcopy<attnd::Dec<128, ATTND_DT_BF16, ATTND_KV_INT4, true>>(L, roof, bytes, js,
                                                                         tname[table], sms);
      }
      CK(cudaFree(cache));
      CK(cudaFree(bt));
    }
  printf("\nbest per mechanism and row size (%% of the read roof %.0f GB/s):\n", roof);
  for (const char *m : kModes)
    for (int rb : {256, 128, 64}) {
      const Res *b = nullptr;
      for (auto &r : all)
        if (r.mode == m && r.rb == rb && (!b || r.gbps > b->gbps))
          b = &r;
      if (b)
        printf("  %-9s RB %3d: %5.1f%% (%d CTA/SM, %d stages/inflight, %.1f us)\n", m, rb,
               100 * b->gbps / roof, b->per_sm, b->ns, b->us);
    }
  if (js)
    fclose(js);
  return 0;
}

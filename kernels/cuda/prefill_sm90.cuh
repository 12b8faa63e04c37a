// prefill_sm90.cuh: the Hopper (sm_90a) path of the attention kernel for
// steps with many query rows per item (prefill, chunked prefill over a cached
// prefix, mixed batches): wgmma for S = Q K^T and O += P V, K/V tiles brought
// by the bulk copy engine into a multi-stage shared-memory pipeline, one
// producer warpgroup and two consumer warpgroups (setmaxnreg). The kernel body
// is prefill_sm90_impl.cuh, instantiated one cache type per file
// (prefill_sm90_<kv>.cu); prefill_sm90.cu decides eligibility and dispatches.
//
// Same function as the tiled kernel (tiled_params.cuh, tiled_kernel.cuh), to
// fp32 summation order: query vectors are (row, q head of the GQA group)
// pairs; the same operand dtypes (q and K in the activation dtype, P V in
// Tiled::PDT, P as P 2^14 where that is fp16); scores scaled, shifted and
// exponentiated with the same fp32 operations against an integer running max
// (exp2 domain; the opt-in FFMA form, sched bit 3, rounds P's exponent once
// where they round twice); the same placement of every scale (static K scale per kv
// head in the score scale, per channel in q as an exact hi + lo pair, int4's
// K zero point out of the lse in fp64, dynamic scales on the scores and on P,
// O normalized by the sum of P as rounded for the matrix units and V's static
// scale and zero point applied to O; kernels/cuda/README.md tabulates them);
// exact zero output and -inf lse for rows with no visible key. A prefix hit
// served by the decode kernel agrees with it as it does with the tiled kernel.
#pragma once

#include <cuda.h>

#include "tiled_params.cuh"

namespace attnd {

// Kernel parameters. tmap: 16-bit caches whose type is the activation dtype
// only; a 4-D view of the block pool as 16-bit elements
// {head_dim, block_size, 2 * kv_heads (K heads then V heads), blocks}, box
// {64, min(block_size, BN), 1, 1}, 128-byte swizzle (the wgmma operand layout).
// f: the same fields as the tiled kernel (tiled_params.cuh documents each pointer).
// sched: bit 0 = pingpong between the two consumer warpgroups (named
// barriers), bit 1 = no intra-warpgroup overlap (softmax waits for P V),
// bit 2 = skip the softmax (timing experiments only: the output is wrong);
// opt-in forms and the earlier ones, for A/B timing in one run: bit 3 =
// 16-bit caches in the activation dtype: scores to P by one FFMA against the
// max of the raw scores (a second kernel instantiation; P's exponent within
// one rounding of the default's, which is the tiled kernel's FMUL then FADD:
// over the A/B bound once on the H200, so not the default); bit 4 = q rows
// loaded one 16-byte unit at a time after the CTA barrier, instead of every
// unit's load at once before it; bit 5 = every partly masked FlashMask
// interval tile masked per element from the intervals, also those whose
// intervals miss the CTA's rows; bit 6 = converted cache types: two stages
// where the layout has three, and the copy into a raw stage waits for the
// consumers to release the stage's operand tiles, instead of for the
// finishing warps to have read the raw bytes; bits 7 / 8 = 16-bit caches in
// the activation dtype: K and V of a stage awaited and released apart (K's
// copy waits only for Q K^T of the tile a ring back, the consumers wait for V
// only before its P V) at D <= 128 (bit 7; the default at D 256) / not at D
// 256 (bit 8); bit 9 = converted cache types: the earlier conversion
// instructions (convert16 instead of convert16_fast, prefill_sm90_cfg.cuh:
// the same values); bit 10 = converted types: no conversion at all (timing
// only: the output is wrong); bit 11 = opt-in, int8/fp8 caches with 8 or 16
// raw units a row (D 128, 256): the finishing warps take the units in a
// bank-conflict-free order (prefill_sm90_copy.cuh; the same values); bit 12 =
// opt-in, 8-bit and int4 caches (not with bit 6): the producer warp converts too,
// 128 finishing threads instead of 96, its lane 0 issuing each tile's copies
// between its conversions (the same values; measured 7-18% slower on the
// H200); bit 13 = 8-bit and int4 caches: the other form of the finishing loop
// (static int8 / fp8 load the next round's units before this round's stores
// by default, Cfg::kPf; the other types then do, static int8 / fp8 do not;
// the same values); bit 14 = dynamic types at D <= 128: the fourth warpgroup of
// finishing warps idle (the earlier 384-thread split's 96 finishing threads,
// at the 512-thread kernel's registers; the same values). Bit 11 measured
// 2-4% slower than the default. This is
// attnd_cuda_opts_t.sm90_sched with bit 0 inverted (0 there is the default).
// The grid is one-dimensional over (item, kv head) groups x query tiles
// (qtiles per group), taken gchunk groups at a time (nitems * kv_heads groups).
struct Sm90Params { // 64-byte aligned through CUtensorMap
  CUtensorMap tmap;
  FlashParams f;
  int sched;
  int qtiles, gchunk, ngroups_items;
};

// 1 when this launch runs on the Hopper path: the device is compute
// capability 9.0, the build holds sm_90a code, the batch is prefill-shaped
// (more than 16 query vectors in some item) and o.sm90 is 0.
bool sm90_eligible(const attnd_kshape_t *s, const FlashParams &p, const attnd_cuda_opts_t &o);

// Enqueues the Hopper kernel; 0 or an attnd_cuda.h error code (with the call site).
int launch_sm90(const attnd_kshape_t *s, const FlashParams &p, int nitems,
                const attnd_cuda_opts_t &o, cudaStream_t st);

// Per (head dim, activation dtype, cache type); defined in prefill_sm90_launch.cuh.
template <int D, int DT, int KV>
int launch_sm90_t(const FlashParams &p, int sched, int gchunk, int nitems, cudaStream_t st);

// cuTensorMapEncodeTiled through the runtime's driver entry point (no libcuda
// link); NULL when the driver has none.
typedef CUresult (*TensorMapEncodeFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                      const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                      const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                      CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
TensorMapEncodeFn tensor_map_encoder();

} // namespace attnd

// flash.cuh: the tiled attention kernel shared by the decode and prefill
// paths (decode.cu plans split-KV and merges; prefill.cu dispatches).
//
// A CTA takes one (item, kv head, tile of query vectors, KV split). Query
// vectors are (row, q head of the GQA group) pairs numbered row-major, so the
// group's q heads share every K/V tile the CTA loads; a tile is kBM = 64
// vectors, 16 per warp. Each K/V tile of kBN = 64 keys is read from the paged
// cache, dequantized in registers and stored to shared memory in the
// activation dtype (the matrix-unit operand type, DESIGN.md 5); S = Q K^T and
// O += P V run on tensor cores (mma.sync m16n8k16, fp32 accumulators), with an
// online softmax in the exp2 domain guarded for rows with no visible key.
// The running max that P is taken relative to is rounded up to an integer (in
// the exp2 domain): P = 2^(s - m) is then rounded to the operand dtype the same
// way whatever m is (rounding commutes with powers of two), and every rescale
// is exact, so a row's output does not depend on how its keys were tiled or
// split: a prefix-cache hit (new rows only, decode kernels) and a full
// recompute (prefill kernel) agree to fp32 summation order, not to bf16's P.
// Key tiles outside the union of the tile's rows' visible ranges are never
// loaded; FlashMask interval tiles are skipped when every key's intervals
// cover all the tile's rows; per-element masks only run on boundary tiles.
#pragma once

#include "common.cuh"

namespace attnd {

constexpr int kBM = 64, kBN = 64, kWarpsF = 4; // kBM: decode query tile (prefill uses 128)

// Shared between the launchers and the kernel. Pointers are device memory.
struct FlashParams {
  const attnd_kitem_t *items; // [nitems]
  const int32_t *meta;        // block tables and intervals
  const void *q;              // [Tq][q_heads][D] act dtype, already rotated
  void *out;                  // [Tq][q_heads][D] act dtype or fp32 (out_fp32)
  float *lse;                 // [Tq][q_heads] or NULL
  int out_fp32;
  const uint8_t *cache;       // layer's block pool
  size_t block_bytes;
  const float *k_scale, *v_scale; // int8/fp8: [kvh] or [kvh][D]; int4: [kvh][D]
  const float *k_zero, *v_zero;   // int4 only: [kvh][D]
  int per_channel;
  int q_heads, kv_heads, group, bs;
  float scale_log2;           // softmax_scale * log2(e)
  int nsplit, split_keys;     // split-KV: keys [s*split_keys, (s+1)*split_keys)
  float *ws_o;                // nsplit > 1: [nsplit][Tq][q_heads][D] fp32, normalized
  float *ws_lse;              // nsplit > 1: [nsplit][Tq][q_heads] natural-log lse
  int total_q;
  int max_vec;                // max over items of n * group (query vectors)
  int debug;                  // ATTND_FLASH_DEBUG: 1 skip loads, 2 skip math (timing only)
  int direct;                 // decode through decode_direct.cuh (8-bit caches, <= 16 vectors)
};

template <int D, int DT, int KV> cudaError_t launch_flash(const FlashParams &p, int nitems, cudaStream_t st);

} // namespace attnd

// tiled_params.cuh: the tiled attention kernel's parameters (tiled_kernel.cuh), for
// items of more than 16 query vectors (prefill rows). Batches whose items all
// have at most 16 go to the decode kernel (decode_params.cuh, decode_kernel.cuh).
//
// A CTA takes one (item, kv head, tile of 128 query vectors, KV split). Query
// vectors are (row, q head of the GQA group) pairs numbered row-major, so the
// group's q heads share every K/V tile the CTA loads. S = Q K^T and O += P V
// run on tensor cores (mma.sync m16n8k16, fp32 accumulators) with an online
// softmax in the exp2 domain guarded for rows with no visible key; the
// running max is an integer (primitives.cuh, softmax_ref), so a row's output
// does not depend on how its keys were tiled or split: a prefix-cache hit (new
// rows only, decode kernel) and a full recompute (this kernel) agree to fp32
// summation order. Key tiles outside the union of the tile's rows' visible
// ranges are never loaded; FlashMask interval tiles are skipped when every
// key's intervals cover all the tile's rows; per-element masks only run on
// boundary tiles.
#pragma once

#include "common.cuh"

namespace attnd {

constexpr int kBN = 64; // key granularity of split-KV parts

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
  float cap2, icap2;          // soft-capping in the exp2 domain: softcap * log2(e) and its inverse; 0: none
  int window;                 // the layer's window (attnd_kbatch_t.window), 0: full layer
  const float *sinks;         // [q_heads] sink logits or NULL; used by items with ATTND_ITEM_SINK
  int nsplit, split_keys;     // split-KV: part s takes keys [b + s*split_keys, b + (s+1)*split_keys) of
                              // the CTA's range, b = its first key when window > 0, else 0
  float *ws_o;                // nsplit > 1: [nsplit][Tq][q_heads][D] fp32, normalized
  float *ws_lse;              // nsplit > 1: [nsplit][Tq][q_heads] natural-log lse, then as many lset
  int total_q;
  int max_vec;                // max over items of n * group (query vectors)
  int debug;                  // attnd_cuda_opts_t.debug: 1 skip loads, 2 skip math (timing only)
  int pdl;                    // launched with programmatic dependent launch
};

template <int D, int DT, int KV> cudaError_t launch_flash(const FlashParams &p, int nitems, cudaStream_t st);

} // namespace attnd

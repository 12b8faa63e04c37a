// decode.cuh: split-KV planning and the merge of partial outputs (decode.cu).
#pragma once

#include "flash.cuh"

namespace attnd {

size_t split_bytes_per_part(const attnd_kshape_t *s, int32_t total_q);
// Parts to split each item's keys into (1: no split) and the keys per part.
int plan_splits(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes, int *split_keys);
// Enqueues the merge of p.nsplit parts into b->out and b->lse.
int launch_merge(const attnd_kshape_t *s, const attnd_kbatch_t *b, const FlashParams &p, cudaStream_t st);

// The direct 8-bit decode kernel (decode_direct.cuh) serves a batch when the
// cache is int8/fp8 (static or dynamic), D <= 128 and every item's query
// vectors fit one 16-row tile; ATTND_FLASH_DEBUG bit 4 turns it off (A/B timing).
bool direct_decode(const attnd_kshape_t *s, int max_vec);
int direct_ctas_per_sm(const attnd_kshape_t *s, int max_vec);
template <int D, int DT, int KV> cudaError_t launch_direct(const FlashParams &p, int nitems, cudaStream_t st);
template <int D, int DT, int KV> int direct_occupancy(int max_vec);

} // namespace attnd

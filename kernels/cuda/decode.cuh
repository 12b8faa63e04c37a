// decode.cuh: split-KV planning and the merge of partial outputs (decode.cu).
#pragma once

#include "flash.cuh"

namespace attnd {

size_t split_bytes_per_part(const attnd_kshape_t *s, int32_t total_q);
// Parts to split each item's keys into (1: no split) and the keys per part.
int plan_splits(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes, int *split_keys);
// Enqueues the merge of p.nsplit parts into b->out and b->lse.
int launch_merge(const attnd_kshape_t *s, const attnd_kbatch_t *b, const FlashParams &p, cudaStream_t st);

} // namespace attnd

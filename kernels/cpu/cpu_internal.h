/* cpu_internal.h: what the CPU kernel files share (private to kernels/cpu). */
#ifndef ATTND_CPU_INTERNAL_H
#define ATTND_CPU_INTERNAL_H

#include <stddef.h>

#include "attnd_kernels.h"

/* Byte offsets of the four regions of one block (canonical layout, see
 * attnd_kernels.h) and the bytes of one (kv head, token) row of K or V. */
typedef struct {
  size_t row_bytes;
  size_t k_off, v_off, ks_off, vs_off;
  int dynamic;
} kc_layout_t;

static inline kc_layout_t kc_layout(const attnd_kshape_t *s) {
  kc_layout_t L;
  size_t rows = (size_t)s->kv_heads * (size_t)s->block_size;
  switch (s->kv) {
  case ATTND_KV_BF16:
  case ATTND_KV_FP16:
    L.row_bytes = (size_t)s->head_dim * 2;
    break;
  case ATTND_KV_INT4:
    L.row_bytes = (size_t)s->head_dim / 2;
    break;
  default:
    L.row_bytes = (size_t)s->head_dim;
    break;
  }
  L.dynamic = attnd_kv_type_dynamic(s->kv);
  L.k_off = 0;
  L.v_off = rows * L.row_bytes;
  L.ks_off = 2 * rows * L.row_bytes;
  L.vs_off = L.ks_off + rows * sizeof(float);
  return L;
}

/* 0 when the kernels can run the batch: a supported shape, the block size the
 * shape implies, and the static scales (and int4 zero points) that the cache
 * type needs. Nothing a type does not have is ever looked at. */
static inline int kc_batch_check(const attnd_kshape_t *s, const attnd_kbatch_t *b) {
  if (attnd_kshape_check(s) != 0)
    return -1;
  if (b->block_bytes != attnd_kv_block_bytes(s))
    return -1;
  if (b->nitems < 0 || (b->nitems > 0 && (!b->items || !b->meta)))
    return -1;
  if (b->window < 0)
    return -1;
  if (s->kv == ATTND_KV_INT8 || s->kv == ATTND_KV_FP8)
    if (!b->k_scale || !b->v_scale)
      return -1;
  if (s->kv == ATTND_KV_INT4)
    if (!b->k_scale || !b->v_scale || !b->k_zero || !b->v_zero)
      return -1;
  return 0;
}

#endif /* ATTND_CPU_INTERNAL_H */

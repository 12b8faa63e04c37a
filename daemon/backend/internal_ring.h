/* internal_ring.h: what the ring's two files share (cuda_ring_plan.c cuts
 * large steps into chunks, cuda_ring.c moves the chunks through the slots;
 * cuda_ring.c's header comment explains the ring). Private to them. */
#ifndef ATTND_BACKEND_INTERNAL_RING_H
#define ATTND_BACKEND_INTERNAL_RING_H

#include "internal.h"

struct cu_ring_plan_s {
  int ci;             /* the next item to cut */
  int32_t ca;         /* its next row */
  int held;           /* slots held by this run's chunks in flight */
  int nchunks;        /* chunks enqueued */
  int done;           /* every chunk enqueued, or the run failed */
  int finish_pending; /* the run's completion came before its chunks' (an error path) */
  size_t qrow, kvrow, orow, lrow, meta_bytes;
  /* Recorded behind the last chunk's D2H and waited for on the layer
   * stream, so that the run's own completion (and the layer's later jobs)
   * come after every chunk; freed with the plan (a wait may still be queued
   * when the chunk's completion arrives). */
  cudaEvent_t ev_out;
};

/* Rows [a, a + m) of item `item` of the step, and where they go in the chunk. */
typedef struct {
  int32_t item, a, m;
} piece_t;

/* A chunk: a run of its own (completion, slot), then its pieces. */
typedef struct {
  cu_run_t r; /* first: the poller and done queue handle it as a run */
  piece_t *p;
  attnd_kitem_t *items; /* the pieces as items of the chunk's batch */
  int np;
  int32_t tq, tkv, qo, max_kv, max_n;
  size_t iv_ints; /* int32 of cut items' intervals after the step's meta */
  size_t off_meta, off_q, off_k, off_v, off_out, off_lse, in_bytes, total;
  int direct_out;          /* out DMA'd straight into the step's pinned output */
  cudaEvent_t ev_in, ev_k; /* H2D done (the kernels wait), kernels done (the D2H waits) */
} cu_chunk_t;

static inline uint8_t *slot_h(cu_backend_t *be, int slot) {
  return be->ring_h + (size_t)slot * be->slot_bytes;
}

static inline uint8_t *slot_d(cu_backend_t *be, int slot) {
  return be->ring_d + (size_t)slot * be->slot_bytes;
}

/* A cut item with mask intervals carries its own [4][kv_len] of them (the
 * layout depends on kv_len): the bytes they take per key of the piece. */
static inline size_t iv_per_key(const attnd_kitem_t *it) {
  return it->mask_kind == ATTND_MASK_INTERVALS && it->intervals >= 0 ? 4 * sizeof(int32_t) : 0;
}

/* Attend-only items (attnd_kbatch_t.q_only_rows) have virtual k/v rows. */
static inline int q_only(const attnd_kitem_t *it, const attnd_kbatch_t *b) {
  return it->kv_row >= b->total_kv;
}

/* The chunk's pieces from the plan's cursor on, as many as a slot holds,
 * and where its regions lie in the slot. */
void attnd_cu_ring_cut(cu_backend_t *be, cu_run_t *r, cu_chunk_t *ch);

#endif /* ATTND_BACKEND_INTERNAL_RING_H */

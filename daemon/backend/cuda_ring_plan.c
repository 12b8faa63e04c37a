/* cuda_ring_plan.c: the CUDA backend's ring (cuda_ring.c) made at start,
 * and large steps cut into its chunks (internal_ring.h).
 *
 * Why cutting rows is exact. A step's write phase must finish before its
 * attention (attnd_kernels.h); chunks run in stream order, so every row a
 * piece reads was written by it or by an earlier chunk. A row at position p
 * of a causal or sliding-window item reads keys <= p only, so the piece's
 * shorter kv_len (start + a + m) hides nothing it would read; the same for a
 * prefix-LM item whose prefix is already in the cache (mask_param <= start),
 * for a causal item with mask intervals (a document mask; each piece gets
 * its own intervals, the first kv_len of each array, after the step's meta)
 * and for write-only items. Items with other masks (full, prefix-LM over
 * their own rows, intervals without causal) are never cut: each goes into one chunk whole,
 * and a step with such an item too large for a slot is staged in one piece
 * instead (the one-shot path of cuda_enqueue.c, which allocates; counted in
 * oneshot_steps and logged; docs/operations.md says so). The kernels'
 * split-KV plans and rounding depend only on each row's own keys, so a piece
 * gives the rows the bits the whole step would (up to the splits chosen for
 * a different row count). */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal_ring.h"

int attnd_cu_ring_create(cu_backend_t *be, size_t want, const char *opt, char *err, size_t errlen) {
  cudaError_t e;
  size_t room = be->pinned_max > be->pinned_bytes ? be->pinned_max - be->pinned_bytes : 0;
  size_t n = want;
  if (!n) {
    n = CU_RING_DEFAULT < room ? CU_RING_DEFAULT : room;
    if (n < CU_RING_MIN)
      n = CU_RING_MIN; /* the floor holds even under a tiny cap */
  } else if (n < CU_RING_MIN) {
    snprintf(err, errlen, "--%s %zu is below the ring's least size, %zu", opt, n, CU_RING_MIN);
    return ATTND_EINVAL;
  } else if (n > room) {
    snprintf(err, errlen,
             "--%s %zu does not fit the pinned cap of %zu (--cuda-pinned-max) beside the "
             "%zu bytes of pooled staging",
             opt, n, be->pinned_max, be->pinned_bytes);
    return ATTND_EINVAL;
  }
  be->slot_bytes = (n / CU_RING_SLOTS) & ~(CU_ALIGN - 1);
  be->ring_bytes = be->slot_bytes * CU_RING_SLOTS;
  if ((e = cudaHostAlloc((void **)&be->ring_h, be->ring_bytes, cudaHostAllocPortable)) !=
      cudaSuccess) {
    cudaGetLastError();
    be->ring_h = NULL;
    snprintf(err, errlen, "cudaHostAlloc of the %zu-byte ring: %s", be->ring_bytes,
             cudaGetErrorString(e));
    return ATTND_ENOMEM;
  }
  if ((e = cudaMalloc((void **)&be->ring_d, be->ring_bytes)) != cudaSuccess) {
    cudaGetLastError();
    be->ring_d = NULL;
    snprintf(err, errlen, "cudaMalloc of the %zu-byte device ring: %s", be->ring_bytes,
             cudaGetErrorString(e));
    return ATTND_ENOMEM;
  }
  return 0;
}

void attnd_cu_ring_release(cu_backend_t *be) {
  if (be->ring_h)
    cudaFreeHost(be->ring_h);
  if (be->ring_d)
    cudaFree(be->ring_d);
  be->ring_h = be->ring_d = NULL;
}

void attnd_cu_ring_plan_free(cu_backend_t *be, cu_ring_plan_t *p) {
  if (p)
    attnd_cu_ev_put(be, p->ev_out);
  free(p);
}

/* 1 for an item whose rows may go to different chunks (header comment). */
static int splittable(const attnd_kitem_t *it, const attnd_kbatch_t *b) {
  if (it->q_row < 0 && it->kv_row < b->total_kv)
    return 1; /* write only */
  switch (it->mask_kind) {
  case ATTND_MASK_CAUSAL:
  case ATTND_MASK_SLIDING:
    return 1;
  case ATTND_MASK_PREFIX_LM:
    return it->mask_param <= it->start;
  case ATTND_MASK_INTERVALS:
    return it->causal; /* a document mask: intervals on top of causal */
  default:
    return 0;
  }
}

static size_t row_cost(const cu_ring_plan_t *p, const attnd_kitem_t *it, const attnd_kbatch_t *b) {
  size_t c = q_only(it, b) ? 0 : 2 * p->kvrow;
  if (it->q_row >= 0)
    c += p->qrow + p->orow + p->lrow;
  return c;
}

/* Bytes of a slot left for pieces: the meta, and slack for aligning regions. */
static size_t slot_budget(const cu_backend_t *be, const cu_ring_plan_t *p) {
  size_t fixed = attnd_cu_align_up(p->meta_bytes) + 8 * CU_ALIGN;
  return be->slot_bytes > fixed ? be->slot_bytes - fixed : 0;
}

int attnd_cu_ring_plan(cu_backend_t *be, cu_run_t *r) {
  const attnd_job_t *job = r->job;
  const attnd_kbatch_t *b = &job->batch;
  if (!be->ring_h || b->nitems <= 0)
    return 0;
  cu_ring_plan_t pl;
  memset(&pl, 0, sizeof(pl));
  if (b->total_q > 0) {
    pl.qrow = job->q_bytes / (size_t)b->total_q;
    pl.orow = job->out_bytes / (size_t)b->total_q;
    pl.lrow = b->lse ? job->lse_bytes / (size_t)b->total_q : 0;
  }
  if (b->total_kv > 0)
    pl.kvrow = job->kv_bytes / (size_t)b->total_kv;
  pl.meta_bytes = job->nmeta * sizeof(int32_t);
  if (pl.meta_bytes > be->slot_bytes / 2)
    return 0;
  size_t budget = slot_budget(be, &pl);
  for (int i = 0; i < b->nitems; i++) {
    const attnd_kitem_t *it = &b->items[i];
    size_t c = row_cost(&pl, it, b);
    size_t need = sizeof(attnd_kitem_t) + (splittable(it, b) ? c : c * (size_t)it->n) +
                  iv_per_key(it) * (size_t)(it->start + it->n);
    if (need > budget)
      return 0;
  }
  r->plan = attnd_xcalloc(1, sizeof(pl));
  *r->plan = pl;
  return 1;
}

/* The chunk's pieces from the plan's cursor on, as many as a slot holds. */
void attnd_cu_ring_cut(cu_backend_t *be, cu_run_t *r, cu_chunk_t *ch) {
  cu_ring_plan_t *p = r->plan;
  const attnd_kbatch_t *b = &r->job->batch;
  size_t budget = slot_budget(be, p);
  ch->p = attnd_xcalloc((size_t)(b->nitems - p->ci), sizeof(piece_t));
  ch->items = attnd_xcalloc((size_t)(b->nitems - p->ci), sizeof(attnd_kitem_t));
  while (p->ci < b->nitems) {
    const attnd_kitem_t *it = &b->items[p->ci];
    size_t c = row_cost(p, it, b), ivk = iv_per_key(it);
    /* Fixed: the item, and its intervals over the keys before its rows. */
    size_t fixed = sizeof(attnd_kitem_t) + ivk * (size_t)(it->start + p->ca);
    int32_t rows = it->n - p->ca, m = rows;
    if (budget < fixed + c + ivk)
      break;
    if (splittable(it, b)) {
      size_t fit = c + ivk ? (budget - fixed) / (c + ivk) : (size_t)rows;
      if (fit < (size_t)m)
        m = (int32_t)fit;
    } else if (fixed + (c + ivk) * (size_t)rows > budget) {
      break; /* whole in the next chunk (attnd_cu_ring_plan checked it fits one) */
    }
    budget -= fixed + (c + ivk) * (size_t)m;
    piece_t *pc = &ch->p[ch->np];
    attnd_kitem_t *k = &ch->items[ch->np];
    ch->np++;
    pc->item = p->ci;
    pc->a = p->ca;
    pc->m = m;
    *k = *it;
    k->start = it->start + p->ca;
    k->n = m;
    k->q_row = it->q_row >= 0 ? ch->tq : -1;
    if (ivk) {
      /* After the step's meta: this piece's intervals, [4][its kv_len]. */
      k->intervals = (int32_t)(p->meta_bytes / sizeof(int32_t) + ch->iv_ints);
      ch->iv_ints += 4 * (size_t)(k->start + m);
    }
    if (it->q_row >= 0)
      ch->tq += m;
    if (q_only(it, b)) {
      k->kv_row = -1; /* virtual: set below, once the chunk's k/v rows are known */
      ch->qo += m;
    } else {
      k->kv_row = ch->tkv;
      ch->tkv += m;
    }
    if (k->start + k->n > ch->max_kv)
      ch->max_kv = k->start + k->n;
    if (m > ch->max_n)
      ch->max_n = m;
    p->ca += m;
    if (p->ca == it->n) {
      p->ci++;
      p->ca = 0;
    }
  }
  /* Attend-only items follow every other one (attnd_kbatch_t), here as there. */
  int32_t virt = ch->tkv;
  for (int i = 0; i < ch->np; i++)
    if (ch->items[i].kv_row < 0) {
      ch->items[i].kv_row = virt;
      virt += ch->items[i].n;
    }
  size_t items = (size_t)ch->np * sizeof(attnd_kitem_t);
  ch->off_meta = attnd_cu_align_up(items);
  ch->off_q = ch->off_meta + attnd_cu_align_up(p->meta_bytes + ch->iv_ints * sizeof(int32_t));
  ch->off_k = ch->off_q + attnd_cu_align_up((size_t)ch->tq * p->qrow);
  ch->off_v = ch->off_k + attnd_cu_align_up((size_t)ch->tkv * p->kvrow);
  ch->in_bytes = ch->off_v + (size_t)ch->tkv * p->kvrow;
  ch->off_out = attnd_cu_align_up(ch->in_bytes);
  ch->off_lse = ch->off_out + attnd_cu_align_up((size_t)ch->tq * p->orow);
  ch->total = ch->off_lse + (size_t)ch->tq * p->lrow;
}

#endif /* ATTND_HAVE_CUDA */

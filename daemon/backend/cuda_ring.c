/* cuda_ring.c: the CUDA backend's ring (internal.h): a fixed pinned host
 * buffer and its device twin, made at start, through which large steps are
 * staged in chunks, so that no step allocates while serving.
 *
 * Why: allocating for a large step while serving stalls the whole process.
 * cudaHostAlloc of a 32k-token prefill's ~650 MB of staging, and growing a
 * stream's device buffer to match, hold the driver lock that every other CUDA
 * call needs, so another session's decode waited 800-940 ms behind the first
 * such step of the process, even with the allocation on a worker thread
 * (bench/RESULTS.md). The ring is allocated once, before the daemon reports
 * ready, and its size bounds the pinned and device memory large steps use.
 *
 * How. The ring has CU_RING_SLOTS slots; a slot holds one chunk: its items,
 * the step's meta, its rows of q, k and v, and room for its out and lse. A
 * chunk is a set of pieces, rows [a, a + m) of the step's items, each
 * written as an item of its own (start + a, m rows), so that the kernels run
 * on it unchanged. On the run's stream, per chunk: a host function copies
 * the chunk's inputs from the engine's memory into the host slot, one H2D
 * copy moves them to the device slot, attnd_cuda_write and attnd_cuda_attend
 * run on them, one D2H copy brings out and lse back into the host slot, and
 * a second host function copies them into the engine's output buffers (never
 * the loop thread: it only plans pieces and enqueues). A same-host
 * zero-copy step (backend.h device_io) takes the same path, its pieces' q,
 * k, v rows and out, lse rows copied on the device between the client's
 * tensors and the device slot instead. The chunk's
 * completion event gives its slot back; a run holds at most CU_RING_PER_RUN
 * slots, so two large steps share the ring.
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

#include "internal.h"

#define RING_CU(r, call)                                                                           \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      attnd_cu_run_fail_cuda((r), __FILE__, __LINE__, #call, e_);                                  \
      goto enqueued;                                                                               \
    }                                                                                              \
  } while (0)

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

static uint8_t *slot_h(cu_backend_t *be, int slot) {
  return be->ring_h + (size_t)slot * be->slot_bytes;
}

static uint8_t *slot_d(cu_backend_t *be, int slot) {
  return be->ring_d + (size_t)slot * be->slot_bytes;
}

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

/* A cut item with mask intervals carries its own [4][kv_len] of them (the
 * layout depends on kv_len): the bytes they take per key of the piece. */
static size_t iv_per_key(const attnd_kitem_t *it) {
  return it->mask_kind == ATTND_MASK_INTERVALS && it->intervals >= 0 ? 4 * sizeof(int32_t) : 0;
}

/* Attend-only items (attnd_kbatch_t.q_only_rows) have virtual k/v rows. */
static int q_only(const attnd_kitem_t *it, const attnd_kbatch_t *b) {
  return it->kv_row >= b->total_kv;
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
static void cut_chunk(cu_backend_t *be, cu_run_t *r, cu_chunk_t *ch) {
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

/* The chunk's items, the step's meta and the pieces' intervals into the
 * host slot (the slot is free: its last chunk completed). */
static void write_head(const cu_chunk_t *ch, uint8_t *hp) {
  const cu_run_t *r = ch->r.parent;
  const attnd_kbatch_t *b = &r->job->batch;
  const cu_ring_plan_t *p = r->plan;
  memcpy(hp, ch->items, (size_t)ch->np * sizeof(attnd_kitem_t));
  if (p->meta_bytes)
    memcpy(hp + ch->off_meta, b->meta, p->meta_bytes);
  for (int i = 0; i < ch->np; i++) {
    const attnd_kitem_t *it = &b->items[ch->p[i].item], *k = &ch->items[i];
    if (!iv_per_key(it))
      continue;
    /* The first kv_len of each of the item's four interval arrays. */
    size_t kvo = (size_t)it->start + (size_t)it->n, kvn = (size_t)k->start + (size_t)k->n;
    int32_t *dst = (int32_t *)(hp + ch->off_meta) + k->intervals;
    for (size_t a = 0; a < 4; a++)
      memcpy(dst + a * kvn, b->meta + it->intervals + a * kvo, kvn * sizeof(int32_t));
  }
}

/* Host function on the copy stream, before the chunk's H2D copy, for a step
 * whose inputs are not in pinned memory (the frame pool was full): the host
 * copy of the chunk's q, k and v rows from the engine's memory into the host
 * slot. No CUDA calls allowed here. */
static void CUDART_CB stage_fn(void *arg) {
  cu_chunk_t *ch = arg;
  cu_run_t *r = ch->r.parent;
  const attnd_job_t *job = r->job;
  const attnd_kbatch_t *b = &job->batch;
  const cu_ring_plan_t *p = r->plan;
  uint8_t *hp = slot_h(r->be, ch->r.slot);
  size_t bytes = 0;
  for (int i = 0; i < ch->np; i++) {
    const attnd_kitem_t *it = &b->items[ch->p[i].item], *k = &ch->items[i];
    size_t a = (size_t)ch->p[i].a, m = (size_t)ch->p[i].m;
    if (it->q_row >= 0) {
      memcpy(hp + ch->off_q + (size_t)k->q_row * p->qrow,
             (const uint8_t *)b->q + ((size_t)it->q_row + a) * p->qrow, m * p->qrow);
      bytes += m * p->qrow;
    }
    if (!q_only(it, b)) {
      size_t src = ((size_t)it->kv_row + a) * p->kvrow, dst = (size_t)k->kv_row * p->kvrow;
      memcpy(hp + ch->off_k + dst, (const uint8_t *)b->k + src, m * p->kvrow);
      memcpy(hp + ch->off_v + dst, (const uint8_t *)b->v + src, m * p->kvrow);
      bytes += 2 * m * p->kvrow;
    }
  }
  atomic_fetch_add(&r->be->staged_bytes, bytes);
}

/* The chunk's lse rows (lse only: 0) or out and lse rows from the host
 * slot into the step's buffers. */
static void copy_out(const cu_chunk_t *ch, int with_out) {
  const cu_run_t *r = ch->r.parent;
  const attnd_kbatch_t *b = &r->job->batch;
  const cu_ring_plan_t *p = r->plan;
  const uint8_t *hp = slot_h(r->be, ch->r.slot);
  size_t bytes = 0;
  for (int i = 0; i < ch->np; i++) {
    const attnd_kitem_t *it = &b->items[ch->p[i].item], *k = &ch->items[i];
    if (it->q_row < 0)
      continue;
    size_t a = (size_t)ch->p[i].a, m = (size_t)ch->p[i].m;
    if (with_out) {
      memcpy((uint8_t *)b->out + ((size_t)it->q_row + a) * p->orow,
             hp + ch->off_out + (size_t)k->q_row * p->orow, m * p->orow);
      bytes += m * p->orow;
    }
    if (p->lrow)
      memcpy((uint8_t *)b->lse + ((size_t)it->q_row + a) * p->lrow,
             hp + ch->off_lse + (size_t)k->q_row * p->lrow, m * p->lrow);
  }
  atomic_fetch_add(&r->be->staged_bytes, bytes);
}

/* Host function on the copy stream after the chunk's D2H copy, for a step
 * whose output is not pinned memory: its out and lse rows into the
 * engine's buffers. */
static void CUDART_CB out_fn(void *arg) {
  copy_out(arg, 1);
}

void attnd_cu_ring_chunk_outputs(cu_run_t *c) {
  const cu_chunk_t *ch = (const cu_chunk_t *)c;
  const attnd_job_t *job = c->job;
  if (ch->direct_out && job->batch.lse && c->parent->plan->lrow)
    copy_out(ch, 0); /* a few bytes a row; out itself was DMA'd */
}

/* One tensor's rows of every piece, copied between the step's memory (host
 * pinned, or the client's device memory: cudaMemcpyDefault) and the device
 * slot; pieces whose rows continue the previous piece's on both sides are
 * merged into one copy (the pieces of a step's consecutive items usually
 * are). which: 0 q, 1 k, 2 v, 3 out, 4 lse. */
static cudaError_t row_copies(const cu_chunk_t *ch, uint8_t *dp, int which, cudaStream_t st) {
  const cu_run_t *r = ch->r.parent;
  const attnd_kbatch_t *b = &r->job->batch;
  const cu_ring_plan_t *p = r->plan;
  const size_t row = which == 0 ? p->qrow : which < 3 ? p->kvrow : which == 3 ? p->orow : p->lrow;
  const size_t doff = which == 0   ? ch->off_q
                      : which == 1 ? ch->off_k
                      : which == 2 ? ch->off_v
                      : which == 3 ? ch->off_out
                                   : ch->off_lse;
  uint8_t *host = which == 0   ? (uint8_t *)b->q
                  : which == 1 ? (uint8_t *)b->k
                  : which == 2 ? (uint8_t *)b->v
                  : which == 3 ? (uint8_t *)b->out
                               : (uint8_t *)b->lse;
  const int out = which >= 3;
  size_t hs = 0, ds = 0, n = 0; /* the run being merged: host and slot offsets, bytes */
  cudaError_t e = cudaSuccess;
  for (int i = 0; i <= ch->np && e == cudaSuccess; i++) {
    size_t h = 0, d = 0, m = 0;
    if (i < ch->np) {
      const attnd_kitem_t *it = &b->items[ch->p[i].item], *k = &ch->items[i];
      size_t a = (size_t)ch->p[i].a;
      if (which == 0 || out) {
        if (it->q_row < 0)
          continue;
        h = ((size_t)it->q_row + a) * row;
        d = (size_t)k->q_row * row;
      } else {
        if (q_only(it, b))
          continue;
        h = ((size_t)it->kv_row + a) * row;
        d = (size_t)k->kv_row * row;
      }
      m = (size_t)ch->p[i].m * row;
      if (n && h == hs + n && d == ds + n) {
        n += m;
        continue;
      }
    }
    if (n)
      e = out ? cudaMemcpyAsync(host + hs, dp + doff + ds, n, cudaMemcpyDefault, st)
              : cudaMemcpyAsync(dp + doff + ds, host + hs, n, cudaMemcpyDefault, st);
    hs = h;
    ds = d;
    n = m;
  }
  return e;
}

/* Puts the work enqueued on `from` so far before what is enqueued on `to`
 * from now on, through an event of the pool kept in *ev. */
static cudaError_t join(cu_backend_t *be, cudaEvent_t *ev, cudaStream_t from, cudaStream_t to) {
  if (!*ev && !(*ev = attnd_cu_ev_get(be)))
    return cudaErrorMemoryAllocation;
  cudaError_t e = cudaEventRecord(*ev, from);
  return e == cudaSuccess ? cudaStreamWaitEvent(to, *ev, 0) : e;
}

static void chunk_free(cu_backend_t *be, cu_chunk_t *ch) {
  attnd_cu_ev_put(be, ch->ev_in);
  attnd_cu_ev_put(be, ch->ev_k);
  free(ch->p);
  free(ch->items);
  free(ch);
}

/* A failed chunk fails its run (the first reason wins) and ends the cutting. */
static void fail_parent(cu_run_t *r, const cu_run_t *c) {
  if (!r->status) {
    r->status = c->status;
    snprintf(r->msg, sizeof(r->msg), "%s", c->msg);
  }
  r->plan->done = 1;
}

/* Enqueues the next chunk into a free slot, over three streams of its
 * layer: the H2D on the copy stream h2d (by DMA from the pinned frame or
 * the client's memory, else from the host slot that a host function
 * filled), the kernels on the layer's stream once the H2D is done, the D2H
 * on the copy stream d2h once the kernels are (straight into a pinned
 * output, else into the host slot, then a host function). So chunk N + 1's
 * H2D runs while chunk N computes and chunk N - 1's D2H drains, and the
 * chunks' kernels keep the layer's order. The chunk's completion follows
 * its D2H, which follows everything else of it. */
static void enqueue_chunk(cu_backend_t *be, cu_run_t *r, int slot) {
  attnd_job_t *job = r->job;
  cu_stream_t *cs = &be->streams[r->stream];
  const attnd_kshape_t *s = &be->base.shape;
  cu_chunk_t *ch = attnd_xcalloc(1, sizeof(*ch));
  cu_run_t *c = &ch->r;
  c->be = be;
  c->job = job;
  c->stream = r->stream;
  c->parent = r;
  c->slot = slot;
  c->path = 2;
  be->slot_busy[slot] = 1;
  r->plan->held++;
  r->plan->nchunks++;
  be->ring_chunks++;
  cut_chunk(be, r, ch);
  if (r->plan->ci == job->batch.nitems)
    r->plan->done = 1;
  /* A run on a priority twin (a step judged small by chunk_keys but too
   * large for a pooled buffer) shares its layer stream's copy streams. */
  const cu_stream_t *cp = &be->streams[r->stream % be->nstreams];
  cudaStream_t hs = cp->h2d, ks = cs->st, ds = cp->d2h;
  int at = 0; /* 1: the kernels wait for the H2D; 2: the D2H waits for the kernels */
  attnd_kbatch_t db;
  if (attnd_cu_device_batch(be, c, &db) != 0)
    goto enqueued;
  uint8_t *hp = slot_h(be, slot), *dp = slot_d(be, slot);
  /* Pinned inputs (backend.h inputs_pinned) and client memory (device_io)
   * are copied from where they lie; others through the host slot. */
  const int attend = ch->tq > 0 && job->out_bytes;
  ch->direct_out = attend && job->outputs_pinned && !job->device_io;
  write_head(ch, hp);
  if (job->inputs_pinned || job->device_io) {
    RING_CU(c, cudaMemcpyAsync(dp, hp, ch->off_q, cudaMemcpyHostToDevice, hs));
    for (int t = 0; t < 3; t++)
      RING_CU(c, row_copies(ch, dp, t, hs));
  } else {
    RING_CU(c, cudaLaunchHostFunc(hs, stage_fn, ch));
    RING_CU(c, cudaMemcpyAsync(dp, hp, ch->in_bytes, cudaMemcpyHostToDevice, hs));
  }
  RING_CU(c, join(be, &ch->ev_in, hs, ks));
  at = 1;
  db.items = (const attnd_kitem_t *)dp;
  db.nitems = ch->np;
  db.meta = (const int32_t *)(dp + ch->off_meta);
  db.total_q = ch->tq;
  db.total_kv = ch->tkv;
  db.q_only_rows = ch->qo;
  db.max_kv_len = ch->max_kv;
  db.max_n = ch->max_n;
  db.q = ch->tq ? dp + ch->off_q : NULL;
  db.k = dp + ch->off_k;
  db.v = dp + ch->off_v;
  db.out = attend ? dp + ch->off_out : NULL;
  db.lse = attend && r->plan->lrow ? (float *)(dp + ch->off_lse) : NULL;
  int rc = attnd_cuda_write(s, &db, ks);
  if (rc) {
    attnd_cu_run_fail_kernel(c, rc);
    goto enqueued;
  }
  if (attend) {
    rc = attnd_cuda_attend(s, &db, cs->ws, cs->ws ? cs->wcap : 0, ks);
    if (rc) {
      attnd_cu_run_fail_kernel(c, rc);
      goto enqueued;
    }
  }
  RING_CU(c, join(be, &ch->ev_k, ks, ds));
  at = 2;
  if (attend && job->device_io) {
    RING_CU(c, row_copies(ch, dp, 3, ds));
    if (r->plan->lrow)
      RING_CU(c, row_copies(ch, dp, 4, ds));
  } else if (ch->direct_out) {
    /* The output's own buffer is pinned: DMA into it; lse, if asked, through
     * the slot (a few bytes a row: copied at the chunk's completion). */
    RING_CU(c, row_copies(ch, dp, 3, ds));
    if (r->plan->lrow)
      RING_CU(c, cudaMemcpyAsync(hp + ch->off_lse, dp + ch->off_lse, ch->total - ch->off_lse,
                                 cudaMemcpyDeviceToHost, ds));
  } else if (attend) {
    RING_CU(c, cudaMemcpyAsync(hp + ch->off_out, dp + ch->off_out, ch->total - ch->off_out,
                               cudaMemcpyDeviceToHost, ds));
    RING_CU(c, cudaLaunchHostFunc(ds, out_fn, ch));
  }
enqueued:
  if (c->status) {
    fail_parent(r, c);
    /* What was enqueued before the failure still comes before the D2H
     * stream's completion marker, so the slot comes back only once nothing
     * queued reads or writes it. */
    cudaError_t e = cudaSuccess;
    if (at < 1)
      e = join(be, &ch->ev_in, hs, ks);
    if (e == cudaSuccess && at < 2)
      e = join(be, &ch->ev_k, ks, ds);
    if (e != cudaSuccess) {
      cudaGetLastError();
      cudaStreamSynchronize(hs);
      cudaStreamSynchronize(ks);
    }
  }
  /* The run's own completion, tracked on the layer stream once its last
   * chunk is enqueued, and the layer's later jobs come after this D2H. */
  if (r->plan->done && join(be, &r->plan->ev_out, ds, ks) != cudaSuccess) {
    cudaGetLastError();
    cudaStreamSynchronize(ds); /* an error path: the device is most likely gone */
  }
  cudaError_t e = attnd_cu_track(be, c, ds);
  if (e != cudaSuccess) {
    attnd_cu_run_fail_cuda(c, __FILE__, __LINE__, "cudaEventRecord (chunk)", e);
    fail_parent(r, c);
    cudaStreamSynchronize(hs); /* the slot is free once the streams are past it */
    cudaStreamSynchronize(ks);
    cudaStreamSynchronize(ds);
    attnd_cu_complete_untracked(be, c);
  }
}

int attnd_cu_ring_pump(cu_backend_t *be, cu_run_t *r) {
  cu_ring_plan_t *p = r->plan;
  while (!p->done && !r->status && !atomic_load(&be->dead) && p->held < CU_RING_PER_RUN) {
    int slot = -1;
    for (int i = 0; i < CU_RING_SLOTS && slot < 0; i++)
      if (!be->slot_busy[i])
        slot = i;
    if (slot < 0)
      return 1;
    enqueue_chunk(be, r, slot);
  }
  if (!p->done && !r->status && atomic_load(&be->dead)) {
    r->status = ATTND_EDEVICE;
    snprintf(r->msg, sizeof(r->msg), "the CUDA device is unusable after an earlier error");
  }
  if (r->status)
    p->done = 1;
  return p->done ? 0 : 1;
}

int attnd_cu_ring_defer(cu_run_t *r) {
  if (!r->plan || r->plan->held == 0)
    return 0;
  r->plan->finish_pending = 1;
  return 1;
}

cu_run_t *attnd_cu_ring_chunk_done(cu_backend_t *be, cu_run_t *c) {
  cu_run_t *r = c->parent;
  be->slot_busy[c->slot] = 0;
  r->plan->held--;
  if (!c->status && c->async != cudaSuccess) {
    c->status = attnd_cu_sticky(c->async) ? ATTND_EDEVICE : ATTND_ECUDA;
    snprintf(c->msg, sizeof(c->msg), "cuda: layer %d: chunk %d failed: %s", r->job->layer,
             r->plan->nchunks, cudaGetErrorString(c->async));
  }
  if (c->status)
    fail_parent(r, c);
  chunk_free(be, (cu_chunk_t *)c);
  return r->plan->held == 0 && r->plan->finish_pending ? r : NULL;
}

#endif /* ATTND_HAVE_CUDA */

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
 * on it unchanged. Per chunk, over three streams of its layer (internal.h
 * cu_stream_t), joined by events: on the copy stream h2d, its rows of q, k
 * and v go to the device slot, by DMA straight from the request frame when
 * that is the backend's pinned memory (backend.h inputs_pinned; consecutive
 * pieces' rows in one copy), else through the host slot, which a host
 * function on that stream fills from the engine's memory first; on the
 * layer's stream, attnd_cuda_step (write and attention); on the copy
 * stream d2h, its out rows come back, by DMA straight into a pinned output
 * buffer (outputs_pinned; lse rows through the host slot, copied at the
 * chunk's completion), else through the host slot and a second host
 * function. The loop thread only plans pieces, writes the chunk's items and
 * meta into the host slot and enqueues. So chunk N + 1's copy in, chunk N's
 * kernels and chunk N - 1's copy out run at once, while the kernels keep
 * the layer's order. A same-host zero-copy step (backend.h device_io) takes
 * the same path, its pieces' rows copied on the device between the client's
 * tensors and the device slot. The chunk's completion follows its copy out
 * and gives its slot back; a run holds at most CU_RING_PER_RUN slots, so two
 * large steps share the ring. Its last chunk's copy out is joined back into
 * the layer's stream, so the run's own completion and the layer's later
 * jobs come after all of it. How steps are cut into chunks, and why that
 * is exact: cuda_ring_plan.c. */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal_ring.h"

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
  attnd_cu_ring_cut(be, r, ch);
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
    RUN_CU(c, cudaMemcpyAsync(dp, hp, ch->off_q, cudaMemcpyHostToDevice, hs));
    for (int t = 0; t < 3; t++)
      RUN_CU(c, row_copies(ch, dp, t, hs));
  } else {
    RUN_CU(c, cudaLaunchHostFunc(hs, stage_fn, ch));
    RUN_CU(c, cudaMemcpyAsync(dp, hp, ch->in_bytes, cudaMemcpyHostToDevice, hs));
  }
  RUN_CU(c, join(be, &ch->ev_in, hs, ks));
  at = 1;
  db.items = (const attnd_kitem_t *)dp;
  db.nitems = ch->np;
  db.meta = (const int32_t *)(dp + ch->off_meta);
  db.total_q = ch->tq;
  db.total_kv = ch->tkv;
  db.q_only_rows = ch->qo;
  db.max_kv_len = ch->max_kv;
  db.kv_sum = 0; /* a chunk's own sum is not kept: the plan takes it as unknown */
  db.max_n = ch->max_n;
  db.q = ch->tq ? dp + ch->off_q : NULL;
  db.k = dp + ch->off_k;
  db.v = dp + ch->off_v;
  db.out = attend ? dp + ch->off_out : NULL;
  db.lse = attend && r->plan->lrow ? (float *)(dp + ch->off_lse) : NULL;
  /* Both phases (attnd_cuda_step under its default options), or the write
   * alone. */
  int rc = attend ? attnd_cuda_step(s, &db, cs->ws, cs->ws ? cs->wcap : 0, ks)
                  : attnd_cuda_write(s, &db, ks);
  if (rc) {
    attnd_cu_run_fail_kernel(c, rc);
    goto enqueued;
  }
  RUN_CU(c, join(be, &ch->ev_k, ks, ds));
  at = 2;
  if (attend && job->device_io) {
    RUN_CU(c, row_copies(ch, dp, 3, ds));
    if (r->plan->lrow)
      RUN_CU(c, row_copies(ch, dp, 4, ds));
  } else if (ch->direct_out) {
    /* The output's own buffer is pinned: DMA into it; lse, if asked, through
     * the slot (a few bytes a row: copied at the chunk's completion). */
    RUN_CU(c, row_copies(ch, dp, 3, ds));
    if (r->plan->lrow)
      RUN_CU(c, cudaMemcpyAsync(hp + ch->off_lse, dp + ch->off_lse, ch->total - ch->off_lse,
                                 cudaMemcpyDeviceToHost, ds));
  } else if (attend) {
    RUN_CU(c, cudaMemcpyAsync(hp + ch->off_out, dp + ch->off_out, ch->total - ch->off_out,
                               cudaMemcpyDeviceToHost, ds));
    RUN_CU(c, cudaLaunchHostFunc(ds, out_fn, ch));
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

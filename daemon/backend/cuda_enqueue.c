/* cuda_enqueue.c: a job's work, enqueued on its layer's stream from the loop
 * thread (internal.h).
 *
 * Layer l's ordered and large jobs run on stream l % nstreams (FIFO, in
 * submission order), its small unordered ones on the priority twin of that
 * stream; different layers overlap on different streams. A STEP: items and meta (and, for small
 * steps, q, k and v) are copied into a pinned buffer, one H2D copy moves everything to the stream's
 * device buffer, then attnd_cuda_step (the write, the attention), one D2H copy of out (+ lse) and the
 * completion marker (cuda_complete.c); with --cuda-graphs, a small step's sequence is captured
 * and goes as one graph launch (cuda_graph.c). A COPY is one D2D cudaMemcpyAsync per block pair
 * within the layer's pool, a SCALES job one H2D copy into the layer's scales. Nothing here waits
 * for the device. */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "attnd_cuda_ipc.h" /* the done signal */

void attnd_cu_run_fail_cuda(cu_run_t *r, const char *file, int line, const char *what,
                            cudaError_t e) {
  /* A non-sticky error stays in the runtime's last-error slot otherwise and
   * would resurface at the next, unrelated check. */
  cudaGetLastError();
  if (r->status)
    return;
  int sticky = attnd_cu_sticky(e);
  const char *base = strrchr(file, '/');
  r->status = sticky ? ATTND_EDEVICE : ATTND_ECUDA;
  snprintf(r->msg, sizeof(r->msg), "%s:%d: %.60s: %s", base ? base + 1 : file, line, what,
           cudaGetErrorString(e));
  if (sticky)
    atomic_store(&r->be->dead, 1);
}

void attnd_cu_run_fail_kernel(cu_run_t *r, int rc) {
  if (r->status)
    return;
  r->status = attnd_err_from_kernel(rc);
  snprintf(r->msg, sizeof(r->msg), "cuda: %s", attnd_cuda_last_error());
  if (r->status == ATTND_EDEVICE)
    atomic_store(&r->be->dead, 1);
}

static void enqueue_copy(cu_backend_t *be, cu_run_t *r) {
  attnd_job_t *job = r->job;
  cu_stream_t *cs = &be->streams[r->stream];
  uint8_t *base = be->pool + (size_t)job->layer * be->layer_bytes;
  size_t bb = be->base.block_bytes;
  for (int i = 0; i < job->ncopies; i++) {
    int32_t src = job->copies[2 * i], dst = job->copies[2 * i + 1];
    if (src < 0 || dst < 0 || (uint32_t)src >= be->base.num_blocks ||
        (uint32_t)dst >= be->base.num_blocks) {
      r->status = ATTND_EINVAL;
      snprintf(r->msg, sizeof(r->msg), "copy %d: block pair (%d, %d) outside the pool", i, src,
               dst);
      goto enqueued;
    }
    RUN_CU(r, cudaMemcpyAsync(base + (size_t)dst * bb, base + (size_t)src * bb, bb,
                              cudaMemcpyDeviceToDevice, cs->st));
  }
enqueued:
  return;
}

/* A SCALES job: the layer's scales staged through pinned memory and copied
 * on the layer's stream, so the upload is ordered after the layer's earlier
 * kernels and before its later ones without the loop waiting for either.
 * The flags later enqueues read (scales_ok, per_channel) change here, on the
 * loop thread, in submission order. */
static int enqueue_scales(cu_backend_t *be, cu_run_t *r) {
  const attnd_job_t *job = r->job;
  int layer = job->layer;
  if (!be->dscales)
    return 0; /* a type without static scales: nothing the kernels read */
  size_t n =
      (size_t)be->base.shape.kv_heads * (job->per_channel ? (size_t)be->base.shape.head_dim : 1);
  size_t bytes = 4 * be->nsc * sizeof(float);
  int cerr = cudaSuccess;
  r->stage = attnd_cu_stage_get(be, bytes, 0, &cerr);
  if (!r->stage) {
    if (cerr == cudaSuccess)
      return 1; /* every pooled buffer is out: wait for one */
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, "cudaHostAlloc (scales)", (cudaError_t)cerr);
    return 0;
  }
  float *hp = (float *)r->stage->p;
  be->scales_ok[layer] = 0;
  memset(hp, 0, bytes);
  memcpy(hp, job->k_scale, n * sizeof(float));
  memcpy(hp + be->nsc, job->v_scale, n * sizeof(float));
  if (job->k_zero)
    memcpy(hp + 2 * be->nsc, job->k_zero, n * sizeof(float));
  if (job->v_zero)
    memcpy(hp + 3 * be->nsc, job->v_zero, n * sizeof(float));
  RUN_CU(r, cudaMemcpyAsync(be->dscales + (size_t)layer * 4 * be->nsc, hp, bytes,
                            cudaMemcpyHostToDevice, be->streams[r->stream].st));
  be->scales_ok[layer] = 1;
  be->per_channel[layer] = job->per_channel;
enqueued:
  return 0;
}

/* A SINKS job: the layer's sink logits, staged and copied on the layer's
 * stream like scales; steps enqueued after it read them (sinks_ok). 1 when
 * it waits for a pooled buffer. */
static int enqueue_sinks(cu_backend_t *be, cu_run_t *r) {
  const attnd_job_t *job = r->job;
  int layer = job->layer;
  size_t bytes = (size_t)be->base.shape.q_heads * sizeof(float);
  int cerr = cudaSuccess;
  r->stage = attnd_cu_stage_get(be, bytes, 0, &cerr);
  if (!r->stage) {
    if (cerr == cudaSuccess)
      return 1;
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, "cudaHostAlloc (sinks)", (cudaError_t)cerr);
    return 0;
  }
  be->sinks_ok[layer] = 0;
  memcpy(r->stage->p, job->sinks, bytes);
  RUN_CU(r, cudaMemcpyAsync(be->dsinks + (size_t)layer * (size_t)be->base.shape.q_heads,
                            r->stage->p, bytes, cudaMemcpyHostToDevice, be->streams[r->stream].st));
  be->sinks_ok[layer] = 1;
enqueued:
  return 0;
}

/* The device view of a step's batch: the layer's pool and its static scales
 * on the device. 0, or -1 with r->status set (no scales uploaded). */
int attnd_cu_device_batch(cu_backend_t *be, cu_run_t *r, attnd_kbatch_t *db) {
  const attnd_kshape_t *s = &be->base.shape;
  int layer = r->job->layer;
  *db = r->job->batch;
  db->cache = be->pool + (size_t)layer * be->layer_bytes;
  db->block_bytes = be->base.block_bytes;
  db->k_scale = db->v_scale = db->k_zero = db->v_zero = NULL;
  db->scale_per_channel = 0;
  db->sinks = be->sinks_ok[layer] ? be->dsinks + (size_t)layer * (size_t)s->q_heads : NULL;
  if (!attnd_kv_type_static(s->kv))
    return 0;
  if (!be->scales_ok[layer]) {
    r->status = ATTND_EPRECOND;
    snprintf(r->msg, sizeof(r->msg), "layer %d has no static scales on the device", layer);
    return -1;
  }
  float *ls = be->dscales + (size_t)layer * 4 * be->nsc;
  db->k_scale = ls;
  db->v_scale = ls + be->nsc;
  db->scale_per_channel = be->per_channel[layer];
  if (s->kv == ATTND_KV_INT4) {
    db->k_zero = ls + 2 * be->nsc;
    db->v_zero = ls + 3 * be->nsc;
  }
  return 0;
}

/* Where a step's regions lie in its staging buffers (host and device alike). */
typedef struct {
  size_t items, meta; /* bytes */
  size_t off_meta, off_q, off_k, off_v, off_out, off_lse;
  size_t in_bytes, total;
} layout_t;

static void step_layout(const attnd_job_t *job, cu_run_t *r, layout_t *lo) {
  lo->items = (size_t)job->batch.nitems * sizeof(attnd_kitem_t);
  lo->meta = job->nmeta * sizeof(int32_t);
  lo->off_meta = attnd_cu_align_up(lo->items);
  lo->off_q = lo->off_meta + attnd_cu_align_up(lo->meta);
  if (job->device_io) {
    /* Client memory (backend.h device_io): only q's device copy joins the
     * staged items and meta; k, v, out and lse stay where the client has
     * them. */
    lo->off_k = lo->off_v = lo->off_out = lo->off_lse = 0;
    lo->in_bytes = lo->total = lo->off_q + job->q_bytes;
    r->q_off = lo->off_q;
    r->out_off = r->lse_off = r->k_off = r->v_off = 0;
    return;
  }
  lo->off_k = lo->off_q + attnd_cu_align_up(job->q_bytes);
  lo->off_v = lo->off_k + attnd_cu_align_up(job->kv_bytes);
  lo->in_bytes = lo->off_v + job->kv_bytes;
  lo->off_out = attnd_cu_align_up(lo->in_bytes);
  lo->off_lse = lo->off_out + attnd_cu_align_up(job->out_bytes);
  lo->total = lo->off_lse + job->lse_bytes;
  r->out_off = lo->off_out;
  r->lse_off = lo->off_lse;
  r->q_off = lo->off_q;
  r->k_off = lo->off_k;
  r->v_off = lo->off_v;
}

/* The kernels of a staged step, then the D2H copy of its outputs. */
static void enqueue_kernels(cu_backend_t *be, cu_run_t *r, attnd_kbatch_t *db, uint8_t *hp,
                            uint8_t *dp, const layout_t *lo) {
  attnd_job_t *job = r->job;
  const attnd_kshape_t *s = &be->base.shape;
  cu_stream_t *cs = &be->streams[r->stream];
  int attend = db->total_q > 0 && job->out_bytes;
  int rc;
  if (attend) {
    /* The workspace made at start serves every step (it never grows while
     * serving), but for the one-shot path's, which allocates anyway. */
    size_t want = r->path == 3 ? attnd_cuda_attend_workspace(s, db->total_q) : 0;
    if (want > CU_WS_MAX)
      want = CU_WS_MAX;
    if (want &&
        attnd_cu_dev_reserve(cs, &cs->ws, &cs->wcap, want, (size_t)1 << 20) != cudaSuccess) {
      /* The workspace only speeds up long contexts: run without it. */
      cudaGetLastError();
    }
    /* Both phases (attnd_cuda_step: the write kernel, then the attention,
     * under its default options); where a step runs as one fused launch,
     * cuda_trace's kwrite phase is empty and the write is inside attend. */
    attnd_cu_trace_mark(r, 2, cs->st);
    rc = attnd_cuda_step(s, db, cs->ws, cs->ws ? cs->wcap : 0, cs->st);
    if (rc) {
      attnd_cu_run_fail_kernel(r, rc);
      return;
    }
  } else {
    rc = attnd_cuda_write(s, db, cs->st);
    if (rc) {
      attnd_cu_run_fail_kernel(r, rc);
      return;
    }
    attnd_cu_trace_mark(r, 2, cs->st);
  }
  attnd_cu_trace_mark(r, 3, cs->st);
  if (job->device_io) {
    /* The kernels wrote out and lse into the client's memory: nothing to copy. */
  } else if (attend && job->outputs_pinned) {
    /* The output's own buffer is pinned (backend.h): DMA into it; lse, if
     * asked, through the staging buffer. */
    RUN_CU(r, cudaMemcpyAsync(job->batch.out, dp + lo->off_out, job->out_bytes,
                              cudaMemcpyDeviceToHost, cs->st));
    if (lo->total > lo->off_lse)
      RUN_CU(r, cudaMemcpyAsync(hp + lo->off_lse, dp + lo->off_lse, lo->total - lo->off_lse,
                                cudaMemcpyDeviceToHost, cs->st));
  } else if (attend) {
    RUN_CU(r, cudaMemcpyAsync(hp + lo->off_out, dp + lo->off_out, lo->total - lo->off_out,
                              cudaMemcpyDeviceToHost, cs->st));
  }
  attnd_cu_trace_mark(r, 4, cs->st);
enqueued:
  return;
}

/* A step over client memory (backend.h device_io): items and meta through
 * pinned staging, q copied on the device into the stream's buffer (the
 * write phase rotates it in place), k and v read and out and lse written
 * where the client has them. 1 when it must wait for a pinned buffer. */
static int enqueue_step_device(cu_backend_t *be, cu_run_t *r, attnd_kbatch_t *db,
                               const layout_t *lo) {
  attnd_job_t *job = r->job;
  const attnd_kbatch_t *hb = &job->batch;
  cu_stream_t *cs = &be->streams[r->stream];
  int cerr = cudaSuccess;
  int graph = 0; /* the sequence below is being captured (cuda_graph.c) */
  r->stage = attnd_cu_graph_stage_get(be, r, lo->off_q, &cerr);
  if (!r->stage) {
    if (cerr == cudaSuccess)
      return 1;
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, "cudaHostAlloc (pinned staging)",
                           (cudaError_t)cerr);
    return 0;
  }
  uint8_t *hp = r->stage->p;
  memcpy(hp, hb->items, lo->items);
  if (lo->meta)
    memcpy(hp + lo->off_meta, hb->meta, lo->meta);
  RUN_CU(r, attnd_cu_dev_reserve(cs, (void **)&cs->dbuf, &cs->dcap, lo->total, CU_DBUF_MIN));
  uint8_t *dp = cs->dbuf;
  db->items = (const attnd_kitem_t *)dp;
  db->meta = (const int32_t *)(dp + lo->off_meta);
  db->q = job->q_bytes ? dp + lo->off_q : NULL;
  db->k = hb->k;
  db->v = hb->v;
  db->out = job->out_bytes ? hb->out : NULL;
  db->lse = job->lse_bytes ? hb->lse : NULL;
  attnd_cu_trace_begin(be, r);
  attnd_cu_trace_mark(r, 0, cs->st);
  /* A client that steps over the same tensors each time (the same q, k, v,
   * out and lse addresses) launches its shape's graph as it is. */
  graph = attnd_cu_graph_begin(be, r, db, hp, dp);
  if (graph == 2)
    return 0;
sequence:
  RUN_CU(r, cudaMemcpyAsync(dp, hp, lo->off_q, cudaMemcpyHostToDevice, cs->st));
  /* cudaMemcpyDefault: the address says where q is (client device memory;
   * pinned host memory in the backend's test), with unified addressing. */
  if (job->q_bytes)
    RUN_CU(r, cudaMemcpyAsync(dp + lo->off_q, hb->q, job->q_bytes, cudaMemcpyDefault, cs->st));
  attnd_cu_trace_mark(r, 1, cs->st);
  enqueue_kernels(be, r, db, hp, dp, lo);
enqueued:
  if (graph) {
    graph = 0;
    if (attnd_cu_graph_end(be, r))
      goto sequence; /* nothing captured to launch: the same calls, directly */
  }
  return 0;
}

/* 1 when the job must wait for a pinned buffer (nothing was enqueued). */
static int enqueue_step(cu_backend_t *be, cu_run_t *r) {
  attnd_job_t *job = r->job;
  const attnd_kbatch_t *hb = &job->batch;
  cu_stream_t *cs = &be->streams[r->stream];
  attnd_kbatch_t db;
  int graph = 0; /* the sequence below is being captured (cuda_graph.c) */
  if (attnd_cu_device_batch(be, r, &db) != 0)
    return 0;
  layout_t lo;
  step_layout(job, r, &lo);
  if (!r->path) {
    /* Fast: a pooled buffer holds it. Ring: cut into chunks (cuda_ring.c).
     * One-shot: neither (a step with an uncuttable item larger than a
     * slot): staged whole, in buffers allocated for it. */
    if (lo.total <= CU_STAGE_MIN)
      r->path = 1;
    else if (attnd_cu_ring_plan(be, r))
      r->path = 2;
    else
      r->path = 3;
    if (r->path == 3 && be->oneshot_steps++ % 1000 == 0)
      ATTND_LOGW("cuda_oneshot",
                 "layer=%d bytes=%zu steps=%llu err=\"a large step could not be cut "
                 "into ring chunks; staged whole (allocates while serving)\"",
                 job->layer, lo.total, (unsigned long long)be->oneshot_steps);
  }
  if (r->path == 2)
    return attnd_cu_ring_pump(be, r);
  int cerr = cudaSuccess;
  if (job->device_io)
    return enqueue_step_device(be, r, &db, &lo);
  /* The staging buffer of this shape's graph where it is free (a graph
   * launches again as it is only over the buffers it was made with). */
  r->stage = attnd_cu_graph_stage_get(be, r, lo.total, &cerr);
  if (!r->stage) {
    if (cerr == cudaSuccess)
      return 1;
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, "cudaHostAlloc (pinned staging)",
                           (cudaError_t)cerr);
    return 0;
  }
  /* The one host copy of each input on its way to the device: items and
   * meta here; q, k and v here too for small steps, else in a host function
   * on the stream right before the H2D copy that reads them (stream order
   * makes the DMA wait for it, and the loop thread never touches those
   * bytes). Both buffers stay the job's until its done_cb. */
  uint8_t *hp = r->stage->p;
  memcpy(hp, hb->items, lo.items);
  if (lo.meta)
    memcpy(hp + lo.off_meta, hb->meta, lo.meta);
  /* Inputs in a pinned request frame (backend.h inputs_pinned) go to the
   * device by DMA from the frame: no host copy of them at all. */
  const int direct = job->inputs_pinned;
  int hostfn = !direct && job->q_bytes + 2 * job->kv_bytes > be->hostfn_min;
  if (!direct && !hostfn)
    attnd_cu_stage_inputs_fn(r);
  RUN_CU(r, attnd_cu_dev_reserve(cs, (void **)&cs->dbuf, &cs->dcap, lo.total, CU_DBUF_MIN));
  uint8_t *dp = cs->dbuf;
  if (hostfn)
    RUN_CU(r, cudaLaunchHostFunc(cs->st, attnd_cu_stage_inputs_fn, r));
  db.items = (const attnd_kitem_t *)dp;
  db.meta = (const int32_t *)(dp + lo.off_meta);
  db.q = job->q_bytes ? dp + lo.off_q : NULL;
  db.k = dp + lo.off_k;
  db.v = dp + lo.off_v;
  db.out = job->out_bytes ? dp + lo.off_out : NULL;
  db.lse = job->lse_bytes && hb->lse ? (float *)(dp + lo.off_lse) : NULL;
  attnd_cu_trace_begin(be, r);
  attnd_cu_trace_mark(r, 0, cs->st);
  graph = attnd_cu_graph_begin(be, r, &db, hp, dp);
  if (graph == 2)
    return 0; /* launched: the stream's graph of this step, as it was */
sequence:
  if (direct) {
    RUN_CU(r, cudaMemcpyAsync(dp, hp, lo.off_q, cudaMemcpyHostToDevice, cs->st));
    if (job->q_bytes)
      RUN_CU(r,
             cudaMemcpyAsync(dp + lo.off_q, hb->q, job->q_bytes, cudaMemcpyHostToDevice, cs->st));
    if (job->kv_bytes) {
      RUN_CU(r,
             cudaMemcpyAsync(dp + lo.off_k, hb->k, job->kv_bytes, cudaMemcpyHostToDevice, cs->st));
      RUN_CU(r,
             cudaMemcpyAsync(dp + lo.off_v, hb->v, job->kv_bytes, cudaMemcpyHostToDevice, cs->st));
    }
  } else {
    RUN_CU(r, cudaMemcpyAsync(dp, hp, lo.in_bytes, cudaMemcpyHostToDevice, cs->st));
  }
  attnd_cu_trace_mark(r, 1, cs->st);
  enqueue_kernels(be, r, &db, hp, dp, &lo);
enqueued:
  if (graph) {
    graph = 0;
    if (attnd_cu_graph_end(be, r))
      goto sequence; /* nothing captured to launch: the same calls, directly */
  }
  return 0;
}

/* An ordered job on a layer's stream comes after the work of the layer's
 * unordered jobs on the priority twin: an event recorded there, waited for
 * here (both calls only enqueue). 0, or -1 with r->status set. */
static int fence_priority(cu_backend_t *be, cu_run_t *r) {
  cu_stream_t *ps = &be->streams[r->stream + be->nstreams];
  if (r->job->unordered || ps->nrun == 0)
    return 0;
  r->fence_ev = attnd_cu_ev_get(be);
  if (!r->fence_ev) {
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, "cudaEventCreate (fence)",
                           cudaErrorMemoryAllocation);
    return -1;
  }
  cudaError_t e = cudaEventRecord(r->fence_ev, ps->st);
  if (e == cudaSuccess)
    e = cudaStreamWaitEvent(be->streams[r->stream].st, r->fence_ev, 0);
  if (e != cudaSuccess) {
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, "cudaStreamWaitEvent (fence)", e);
    return -1;
  }
  return 0;
}

/* Enqueues a job's work and its completion; 1 when it must wait for a pinned
 * buffer instead (nothing enqueued, the caller queues it). */
static int start_run(cu_backend_t *be, cu_run_t *r) {
  attnd_job_t *job = r->job;
  cudaSetDevice(be->device);
  if (atomic_load(&be->dead)) {
    r->status = ATTND_EDEVICE;
    snprintf(r->msg, sizeof(r->msg), "the CUDA device is unusable after an earlier error");
  } else if (!r->fence_ev && !r->path && r->stream < be->nstreams && fence_priority(be, r) != 0) {
    /* r->status says why; the completion below still follows. (Fenced at the
     * first attempt only: a ring run comes back here for each slot.) */
  } else if (job->kind == ATTND_JOB_COPY) {
    enqueue_copy(be, r);
  } else if (job->kind == ATTND_JOB_SCALES) {
    if (enqueue_scales(be, r))
      return 1;
  } else if (job->kind == ATTND_JOB_SINKS) {
    if (enqueue_sinks(be, r))
      return 1;
  } else if (job->kind == ATTND_JOB_CHECK) {
    if (attnd_cu_ipc_enqueue_check(be, r))
      return 1;
  } else if (enqueue_step(be, r)) {
    return 1;
  } else if (job->done && job->device_io && !r->status) {
    /* The done signal (backend.h): behind the step's last kernel and, for a
     * ring run, its last chunk's copy out (joined back into this stream). */
    int krc = attnd_cuda_signal(job->done, job->done_value, be->streams[r->stream].st);
    if (krc)
      attnd_cu_run_fail_kernel(r, krc);
  }
  /* Even a failed job gets its completion behind what it enqueued, so its
   * pinned buffer returns to the pool only once no copy reads it, and its
   * done_cb comes after those of the layer's earlier jobs (a stream callback
   * runs exactly once, with the error, even after a sticky one). */
  r->t_enq = attnd_cu_now_us();
  be->streams[r->stream].nrun++;
  cudaError_t e = attnd_cu_track(be, r, be->streams[r->stream].st);
  if (e != cudaSuccess) {
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__,
                           be->poll ? "cudaEventRecord (completion)" : "cudaStreamAddCallback", e);
    attnd_cu_complete_untracked(be, r);
  }
  return 0;
}

void attnd_cu_pump_waiting(cu_backend_t *be) {
  while (be->whead) {
    /* Unlinked before it starts: once its completion is enqueued, the done
     * queue (another thread) owns r->next. */
    cu_run_t *r = be->whead;
    be->whead = r->next;
    if (!be->whead)
      be->wtail = NULL;
    r->next = NULL;
    if (start_run(be, r)) {
      /* Still no buffer: back to the head, nothing was enqueued. */
      r->next = be->whead;
      be->whead = r;
      if (!be->wtail)
        be->wtail = r;
      return;
    }
  }
}

int attnd_cu_submit(attnd_backend_t *base, attnd_job_t *job) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (job->layer < 0 || job->layer >= base->layers)
    return ATTND_EINVAL;
  cu_run_t *r = calloc(1, sizeof(*r));
  if (!r)
    return ATTND_ENOMEM;
  r->be = be;
  r->job = job;
  r->stream = job->layer % be->nstreams;
  if (job->unordered && !attnd_backend_job_large(job, be->chunk_keys))
    r->stream += be->nstreams; /* the priority twin */
  job->status = 0;
  job->message[0] = 0;
  job->t_submit_us = attnd_cu_now_us();
  job->t_start_us = job->t_end_us = 0;
  job->dev_timed = 0;
  be->inflight++;
  attnd_cu_update_ref(be);
  /* Behind any waiting job (one FIFO for all layers keeps each layer's
   * order; an unordered job need not keep it), or waiting itself when no
   * pinned buffer is free. */
  if ((be->whead && !job->unordered) || start_run(be, r)) {
    r->next = NULL;
    if (be->wtail)
      be->wtail->next = r;
    else
      be->whead = r;
    be->wtail = r;
  }
  return 0;
}

#endif /* ATTND_HAVE_CUDA */

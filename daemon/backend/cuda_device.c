/* cuda_device.c: the CUDA backend (backend.h) on top of kernels/cuda
 * (attnd_cuda.h): device setup and teardown. The whole design, for the
 * cuda_*.c files (internal.h):
 *
 * Memory. One cudaMalloc holds the KV pool of every layer (layer l's blocks
 * start at l * num_blocks * block_bytes), zeroed once at start so that no
 * kernel can ever read uninitialized bytes as NaN. Static scales (and int4
 * zero points) live in one small device array, [layer][k_scale, v_scale,
 * k_zero, v_zero][kv_heads * head_dim] fp32.
 *
 * Ordering. A small pool of non-blocking streams; layer l's ordered jobs and
 * its large ones always run on stream l % nstreams, so they execute in
 * submission order (a stream is FIFO) and different layers overlap on
 * different streams. Small unordered jobs (backend.h: the engine vouches
 * that they conflict with nothing unfinished; a decode step, a copy) run on
 * a twin stream of the greatest priority, so a decode is not queued behind
 * another session's long prefill on its layer: the device schedules its
 * blocks ahead of the prefill's waiting ones. An ordered job waits on its
 * layer's priority stream through an event when that stream has work of its
 * own. Each stream owns a device staging buffer (inputs and outputs of the
 * small job running on it) and an attention workspace, both made at start.
 *
 * Nothing is allocated while serving (docs/operations.md, "CUDA backend
 * memory"): an allocation then holds the driver lock every other CUDA call
 * of the process needs. A STEP job whose items, meta, q, k, v, out and lse
 * fit CU_STAGE_MIN is copied once (one memcpy each) into a pinned buffer of
 * a pool made at start (two per stream; with all out, jobs wait in
 * submission order for one to come back), one H2D copy moves it to the
 * stream's device buffer, then attnd_cuda_step (write, attention), one D2H
 * copy of out (+ lse) back into the pinned buffer, and the completion. A
 * larger step goes through the ring in chunks (cuda_ring.c), its copies on
 * two copy streams per layer stream beside the kernels; one that cannot be
 * cut so is staged whole in buffers allocated for it (the one-shot path,
 * the old pool's, capped by --cuda-pinned-max; logged). Request frames and
 * step outputs of at least hostfn_min bytes are carved from a pinned frame
 * pool made at start (host_alloc, cuda_stage.c), so that a large step's
 * q, k, v and out move by DMA alone. A COPY job is one D2D cudaMemcpyAsync
 * per block pair within the layer's pool.
 *
 * The loop thread copies only the small items and meta. When q, k and v
 * together exceed hostfn_min (--cuda-hostfn-min, default 1 MiB)
 * their copy (10-20 ms for an 8k-token prefill) runs in a host function
 * (cudaLaunchHostFunc) on the job's stream, right before the H2D copy that
 * reads it: stream order makes the DMA wait for it, and the loop thread never
 * touches those bytes. Smaller inputs (decode) are copied inline, which costs
 * less than the host function's round trip through the driver's thread. The
 * host function reads the engine's q/k/v and writes the pinned buffer; both
 * stay the job's until its done_cb, and the buffer goes back to the pool only
 * from the stream callback, which runs after the host function in stream
 * order. A host function is not called once the context has a sticky error:
 * then the copy simply does not happen, the H2D copy and the kernels do not
 * run either, and the job fails through its stream callback as any other.
 *
 * Completion. Behind a run's work the loop thread records an event and
 * appends the run to a pending list; one poller thread queries the pending
 * events in submission order (so a stream's runs finish in its order),
 * sleeping 3 us between rounds (20 us once nothing finished for a while),
 * and for each finished run copies the pinned outputs into the
 * engine's host buffers, pushes the run onto a mutex-protected done queue and
 * wakes the loop with uv_async_send; the async callback drains the queue on
 * the loop thread and calls done_cb. A sticky error makes every query return
 * it, so every pending run still finishes exactly once, with the error.
 * Measured on the H200 (--cuda-trace, decode of 4 sessions): a stream
 * callback (cudaStreamAddCallback) ran 20-27 us after the device finished;
 * --cuda-completion callback still selects it. (Not cudaLaunchHostFunc: a
 * host function is never called once the context has a sticky error, which
 * would leave the engine waiting forever.) --cuda-completion loop: while
 * runs are out the loop thread polls them itself too (cuda_complete.c), and
 * --cuda-graphs launches a small step's sequence as one graph
 * (cuda_graph.c). The loop thread only enqueues
 * work; it never waits for the device during steps (SCALES jobs enqueue too;
 * destroy synchronizes, once).
 *
 * Errors. A failing CUDA call fails its job with ATTND_ECUDA and the call
 * site in job->message. A sticky error (illegal address, launch failure, ...)
 * fails it with ATTND_EDEVICE and marks the backend dead: every later job
 * fails with ATTND_EDEVICE (wire UNAVAILABLE) without touching the device,
 * still through its stream callback so that a layer's done_cbs keep their
 * order; the engine takes the daemon down so that its supervisor restarts it.
 *
 * Tested against the CPU backend by tests/test_backend_cuda.c, on a GPU and,
 * through tests/cuda_mock.c (host threads as streams), without one. */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int cu_inflight(attnd_backend_t *base) {
  return ((cu_backend_t *)base)->inflight;
}

static void cu_describe(attnd_backend_t *base, char *device, size_t len, uint64_t *mem, int *cc) {
  cu_backend_t *be = (cu_backend_t *)base;
  snprintf(device, len, "%s (cuda device %d)", be->devname, be->device);
  *mem = be->devmem;
  *cc = be->cc;
}

static void cu_stats(attnd_backend_t *base, attnd_backend_stats_t *st) {
  cu_backend_t *be = (cu_backend_t *)base;
  st->pinned_bytes = be->pinned_bytes + be->ring_bytes; /* staging and frames, the ring */
  st->staged_bytes = atomic_load(&be->staged_bytes);
  st->ring_bytes = be->ring_bytes;
  st->ring_chunks = be->ring_chunks;
  st->oneshot_steps = be->oneshot_steps;
  st->loop_done = be->loop_completions;
  st->graph_steps = be->graph_steps;
  st->graph_builds = be->graph_builds;
  st->graph_replays = be->graph_replays;
}

/* Frees the device and pinned memory; the struct itself goes in the async
 * handle's close callback. */
static void release(cu_backend_t *be) {
  cudaSetDevice(be->device);
  attnd_cu_graphs_release(be);
  for (int i = 0; i < 2 * be->nstreams; i++) {
    cu_stream_t *cs = &be->streams[i];
    free(cs->graphs);
    cs->graphs = NULL;
    cs->ngraphs = 0;
    if (!cs->st)
      continue;
    if (cs->dbuf)
      cudaFreeAsync(cs->dbuf, cs->st);
    if (cs->ws)
      cudaFreeAsync(cs->ws, cs->st);
    cudaStreamSynchronize(cs->st);
    cudaStreamDestroy(cs->st);
    cs->st = NULL;
    for (int k = 0; k < 2; k++) {
      cudaStream_t *c = k ? &cs->d2h : &cs->h2d;
      if (*c) {
        cudaStreamSynchronize(*c);
        cudaStreamDestroy(*c);
        *c = NULL;
      }
    }
    cs->dbuf = NULL;
    cs->ws = NULL;
  }
  if (be->pool)
    cudaFree(be->pool);
  if (be->dscales)
    cudaFree(be->dscales);
  if (be->dsinks)
    cudaFree(be->dsinks);
  attnd_cu_ring_release(be);
  be->pool = NULL;
  be->dscales = NULL;
  be->dsinks = NULL;
  for (size_t i = 0; i < be->nowned; i++) {
    cudaFreeHost(be->owned[i]->p);
    free(be->owned[i]);
  }
  free(be->owned);
  be->owned = NULL;
  be->nowned = 0;
  be->free_stages = NULL;
  attnd_cu_frames_release(be);
  free(be->scales_ok);
  free(be->per_channel);
  free(be->sinks_ok);
  be->scales_ok = be->per_channel = be->sinks_ok = NULL;
  for (int i = 0; i < be->nevfree; i++)
    cudaEventDestroy(be->evfree[i]);
  free(be->evfree);
  be->evfree = NULL;
  attnd_cu_ipc_release(be);
  be->nevfree = be->evcap = 0;
  /* A sticky error is cleared only by a reset; nothing here reuses the
   * context, so the last-error slot is simply cleared. */
  cudaGetLastError();
}

void attnd_cu_free_struct(cu_backend_t *be) {
  uv_mutex_destroy(&be->mu);
  uv_mutex_destroy(&be->fmu);
  if (be->poll) {
    uv_cond_destroy(&be->pcv);
    uv_mutex_destroy(&be->pmu);
  }
  free(be->trace);
  free(be);
}

static void async_closed(uv_handle_t *h) {
  cu_backend_t *be = h->data;
  /* A pinned allocation still on the worker pool frees the struct in its
   * callback (cuda_stage.c). */
  be->handle_closed = 1;
  if (!attnd_cu_allocs_inflight(be))
    attnd_cu_free_struct(be);
}

static void spin_closed(uv_handle_t *h) {
  free(h);
}

static void cu_destroy(attnd_backend_t *base) {
  cu_backend_t *be = (cu_backend_t *)base;
  cudaSetDevice(be->device);
  if (be->spin) {
    /* The poller finishes what the loop's polling left (below). */
    uv_close((uv_handle_t *)be->spin, spin_closed);
    be->spin = NULL;
    atomic_store(&be->loop_spinning, 0);
  }
  /* Teardown is the one place that waits for the device: every stream
   * callback has run once its stream is synchronized. */
  for (int i = 0; i < 2 * be->nstreams; i++) {
    cu_stream_t *cs = &be->streams[i];
    if (cs->h2d)
      cudaStreamSynchronize(cs->h2d);
    if (cs->st)
      cudaStreamSynchronize(cs->st);
    if (cs->d2h)
      cudaStreamSynchronize(cs->d2h);
  }
  /* Every pending event is complete now: the poller finishes those runs,
   * then exits. */
  attnd_cu_poller_stop(be);
  /* Nothing is in flight (the contract): a run still queued for the loop
   * is a caller's bug, reported, not run. */
  uv_mutex_lock(&be->mu);
  cu_run_t *r = be->dhead;
  be->dhead = be->dtail = NULL;
  uv_mutex_unlock(&be->mu);
  while (r) {
    cu_run_t *next = r->next;
    fprintf(stderr, "attnd: cuda backend destroyed with a job in flight (layer %d)\n",
            r->job->layer);
    free(r);
    r = next;
  }
  be->closed = 1; /* an allocation finishing from now on frees its buffer (cuda_stage.c) */
  release(be);
  uv_close((uv_handle_t *)&be->async, async_closed);
}

static const attnd_backend_ops_t cu_ops = {
    .name = "cuda",
    .submit = attnd_cu_submit,
    .inflight = cu_inflight,
    .describe = cu_describe,
    .stats = cu_stats,
    .destroy = cu_destroy,
    .host_alloc = attnd_cu_frame_alloc,
    .host_free = attnd_cu_frame_free,
    .ipc_open = attnd_cu_ipc_open,
    .ipc_close = attnd_cu_ipc_close,
};

/* Kernel modules load when the CUDA runtime starts, not at a kernel's first
 * launch: a lazy load while serving holds the driver lock every other CUDA
 * call of the process needs, so the first step that uses a kernel variant
 * would stall every session's steps behind it (docs/operations.md, "CUDA
 * backend memory: all of it at start"). Must run before the first CUDA call;
 * an operator's own CUDA_MODULE_LOADING wins. */
static void eager_modules(void) {
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
}

int attnd_backend_cuda_available(void) {
  eager_modules();
  return attnd_cuda_device_count() > 0;
}

/* The limits and switches of o, with their defaults where o leaves them 0. */
static void apply_opts(cu_backend_t *be, const attnd_backend_opts_t *o) {
  uint64_t ram = uv_get_total_memory();
  be->pinned_max = (size_t)(ram / 8 < (8ull << 30) ? ram / 8 : (8ull << 30));
  if (be->pinned_max < ((size_t)256 << 20))
    be->pinned_max = (size_t)256 << 20;
  if (o->cuda_pinned_max)
    be->pinned_max = (size_t)o->cuda_pinned_max;
  be->hostfn_min = (size_t)o->cuda_hostfn_min;
  be->pinned_warm = (size_t)o->cuda_pinned_warm;
  be->ring_want = (size_t)o->cuda_ring;
  be->frame_want = (size_t)o->cuda_frame_pool;
  be->poll = !o->cuda_callbacks;
  be->loop_spin_us = be->poll ? (uint64_t)o->cuda_spin_us : 0;
  be->chunk_keys = o->chunk_keys;
  be->graphs = o->cuda_graphs;
  be->graph_replay = o->cuda_graph_replay;
  if (o->cuda_trace)
    be->trace = attnd_xcalloc(1, sizeof(cu_trace_t));
}

/* Streams and the static-scale array. */
static int create_streams(cu_backend_t *be, int layers, char *err, size_t errlen) {
  cudaError_t e;
  int least = 0, greatest = 0;
  if ((e = cudaDeviceGetStreamPriorityRange(&least, &greatest)) != cudaSuccess) {
    snprintf(err, errlen, "cudaDeviceGetStreamPriorityRange: %s", cudaGetErrorString(e));
    return ATTND_ECUDA;
  }
  be->nstreams = layers < CU_MAX_STREAMS ? layers : CU_MAX_STREAMS;
  /* Graph slots (cuda_graph.c): CU_GRAPHS_PER_LAYER for each layer a layer
   * stream serves (layer % nstreams); CU_GRAPHS_MIN on the priority twins
   * (unordered steps, the few that jump the queue). */
  int per_stream = (layers + be->nstreams - 1) / be->nstreams * CU_GRAPHS_PER_LAYER;
  if (per_stream < CU_GRAPHS_MIN)
    per_stream = CU_GRAPHS_MIN;
  for (int i = 0; i < 2 * be->nstreams; i++) {
    int n = i < be->nstreams ? per_stream : CU_GRAPHS_MIN;
    be->streams[i].graphs = attnd_xcalloc((size_t)n, sizeof(cu_graph_t));
    be->streams[i].ngraphs = n;
  }
  for (int i = 0; i < 2 * be->nstreams; i++)
    if ((e = cudaStreamCreateWithPriority(&be->streams[i].st, cudaStreamNonBlocking,
                                          i < be->nstreams ? least : greatest)) != cudaSuccess) {
      snprintf(err, errlen, "cudaStreamCreateWithPriority: %s", cudaGetErrorString(e));
      return ATTND_ECUDA;
    }
  /* The layer streams' copy streams: a ring chunk's H2D and D2H overlap the
   * kernels of the chunks beside it (cuda_ring.c). */
  for (int i = 0; i < be->nstreams; i++)
    if ((e = cudaStreamCreateWithPriority(&be->streams[i].h2d, cudaStreamNonBlocking, least)) !=
            cudaSuccess ||
        (e = cudaStreamCreateWithPriority(&be->streams[i].d2h, cudaStreamNonBlocking, least)) !=
            cudaSuccess) {
      snprintf(err, errlen, "cudaStreamCreateWithPriority (copies): %s", cudaGetErrorString(e));
      return ATTND_ECUDA;
    }
  be->scales_ok = attnd_xcalloc((size_t)layers, sizeof(int));
  be->per_channel = attnd_xcalloc((size_t)layers, sizeof(int));
  be->sinks_ok = attnd_xcalloc((size_t)layers, sizeof(int));
  {
    /* Sink logits, a few bytes per layer: always there, used once a SINKS job set them. */
    size_t kb = (size_t)layers * (size_t)be->base.shape.q_heads * sizeof(float);
    if ((e = cudaMalloc((void **)&be->dsinks, kb)) != cudaSuccess ||
        (e = cudaMemset(be->dsinks, 0, kb)) != cudaSuccess) {
      snprintf(err, errlen, "cudaMalloc (%zu bytes of sinks): %s", kb, cudaGetErrorString(e));
      return ATTND_ECUDA;
    }
  }
  if (attnd_kv_type_static(be->base.shape.kv)) {
    size_t sb = (size_t)layers * 4 * be->nsc * sizeof(float);
    if ((e = cudaMalloc((void **)&be->dscales, sb)) != cudaSuccess ||
        (e = cudaMemset(be->dscales, 0, sb)) != cudaSuccess) {
      snprintf(err, errlen, "cudaMalloc (%zu bytes of scales): %s", sb, cudaGetErrorString(e));
      return ATTND_ECUDA;
    }
  }
  return 0;
}

/* The KV pool: what kv_memory allows (0: 90% of free memory, the rest for
 * staging and workspace), zeroed once, so that a kernel that loads a whole
 * tile past kv_len reads zeros, never stale bytes that could be NaN. */
static int create_pool(cu_backend_t *be, int layers, uint64_t kv_memory, char *err, size_t errlen) {
  cudaError_t e;
  size_t free_b = 0, total_b = 0;
  if ((e = cudaMemGetInfo(&free_b, &total_b)) != cudaSuccess) {
    snprintf(err, errlen, "cudaMemGetInfo: %s", cudaGetErrorString(e));
    return ATTND_ECUDA;
  }
  if (!kv_memory)
    kv_memory = (uint64_t)((double)free_b * 0.9);
  size_t bb = attnd_kv_block_bytes(&be->base.shape);
  uint64_t nb = kv_memory / ((uint64_t)bb * (uint64_t)layers);
  if (nb == 0 || nb > INT32_MAX) {
    snprintf(err, errlen, "kv-memory %llu holds %llu blocks of %zu bytes x %d layers",
             (unsigned long long)kv_memory, (unsigned long long)nb, bb, layers);
    return ATTND_EINVAL;
  }
  be->base.num_blocks = (uint32_t)nb;
  be->base.block_bytes = bb;
  be->base.any_alignment = 1; /* q, k, v reach the device through memcpy (cuda_stage.c) */
  be->layer_bytes = (size_t)nb * bb;
  size_t pool_bytes = be->layer_bytes * (size_t)layers;
  if ((e = cudaMalloc((void **)&be->pool, pool_bytes)) != cudaSuccess) {
    cudaGetLastError();
    snprintf(err, errlen, "cudaMalloc of a %zu-byte KV pool (%zu bytes free of %zu): %s",
             pool_bytes, free_b, total_b, cudaGetErrorString(e));
    be->pool = NULL;
    return ATTND_ENOMEM;
  }
  if ((e = cudaMemset(be->pool, 0, pool_bytes)) != cudaSuccess ||
      (e = cudaDeviceSynchronize()) != cudaSuccess) {
    snprintf(err, errlen, "cudaMemset of the KV pool: %s", cudaGetErrorString(e));
    return ATTND_ECUDA;
  }
  return 0;
}

/* Warm pools: two pinned buffers per stream (one job running, the next being
 * staged) and initial device buffers, so that the first steps allocate
 * nothing. All are taken before any goes back, so that each
 * attnd_cu_stage_get allocates a new one. */
static int warm_up(cu_backend_t *be, char *err, size_t errlen) {
  cudaError_t e;
  cu_stage_t *warm[2 * CU_MAX_STREAMS];
  int nwarm = 0, rc = 0;
  for (int i = 0; i < 2 * be->nstreams && !rc; i++) {
    int cerr = cudaSuccess;
    cu_stage_t *st = attnd_cu_stage_get(be, CU_STAGE_MIN, 1, &cerr);
    if (!st) {
      snprintf(err, errlen, "cudaHostAlloc (pinned staging): %s",
               cudaGetErrorString((cudaError_t)cerr));
      rc = ATTND_ECUDA;
    } else {
      warm[nwarm++] = st;
    }
  }
  while (nwarm > 0)
    attnd_cu_stage_put(be, warm[--nwarm]);
  if (rc)
    return rc;
  /* The attention workspace each stream keeps (it never grows while
   * serving: past CU_WS_ROWS rows a decode batch splits less). */
  size_t ws = attnd_cuda_attend_workspace(&be->base.shape, CU_WS_ROWS);
  if (ws > CU_WS_MAX)
    ws = CU_WS_MAX;
  for (int i = 0; i < 2 * be->nstreams; i++) {
    cu_stream_t *cs = &be->streams[i];
    if ((e = attnd_cu_dev_reserve(cs, (void **)&cs->dbuf, &cs->dcap, CU_DBUF_MIN, CU_DBUF_MIN)) !=
            cudaSuccess ||
        (ws && (e = attnd_cu_dev_reserve(cs, &cs->ws, &cs->wcap, ws, ws)) != cudaSuccess)) {
      snprintf(err, errlen, "cudaMallocAsync (device staging): %s", cudaGetErrorString(e));
      return ATTND_ECUDA;
    }
  }
  if ((rc = attnd_cu_frames_create(be, err, errlen)) != 0)
    return rc;
  /* The ring last: by default it takes what the pinned cap leaves, up to
   * CU_RING_DEFAULT. */
  const char *opt = be->ring_want || !be->pinned_warm ? "cuda-ring" : "cuda-pinned-warm";
  size_t want = be->ring_want ? be->ring_want : be->pinned_warm;
  if ((rc = attnd_cu_ring_create(be, want, opt, err, errlen)) != 0)
    return rc;
  if ((e = cudaDeviceSynchronize()) != cudaSuccess) {
    snprintf(err, errlen, "cudaDeviceSynchronize: %s", cudaGetErrorString(e));
    return ATTND_ECUDA;
  }
  return 0;
}

/* The loop's side of completion: the async handle and the poller thread. */
static int start_completion(cu_backend_t *be, uv_loop_t *loop, char *err, size_t errlen) {
  if (uv_mutex_init(&be->mu) != 0) {
    snprintf(err, errlen, "uv_mutex_init failed");
    return ATTND_EINTERNAL;
  }
  if (uv_async_init(loop, &be->async, attnd_cu_async_cb) != 0) {
    uv_mutex_destroy(&be->mu);
    snprintf(err, errlen, "uv_async_init failed");
    return ATTND_EINTERNAL;
  }
  be->async.data = be;
  uv_unref((uv_handle_t *)&be->async);
  if (be->poll) {
    if (uv_mutex_init(&be->pmu) != 0 || uv_cond_init(&be->pcv) != 0 ||
        uv_thread_create(&be->poller, attnd_cu_poller_main, be) != 0) {
      /* No thread: stream callbacks do the same job, a little later. */
      ATTND_LOGW("cuda_poller",
                 "err=\"cannot start the completion thread; using stream callbacks\"");
      be->poll = 0;
    } else {
      be->poller_started = 1;
    }
  }
  if (be->poll && be->loop_spin_us) {
    /* Not started until a run is pending (attnd_cu_track). */
    be->spin = malloc(sizeof(*be->spin));
    if (!be->spin || uv_idle_init(loop, be->spin) != 0) {
      free(be->spin);
      be->spin = NULL;
      ATTND_LOGW("cuda_poller", "err=\"cannot poll on the loop thread; the poller thread alone\"");
    } else {
      be->spin->data = be;
    }
  }
  return 0;
}

int attnd_backend_cuda_create(attnd_backend_t **out, uv_loop_t *loop, const attnd_kshape_t *s,
                              int layers, const attnd_backend_opts_t *o, char *err, size_t errlen) {
  cudaError_t e;
  int device = o->device, rc;
  eager_modules();
  int ndev = attnd_cuda_device_count();
  if (ndev <= 0) {
    snprintf(err, errlen, "no usable CUDA device");
    return ATTND_EUNAVAIL;
  }
  if (device < 0 || device >= ndev) {
    snprintf(err, errlen, "--device %d but %d CUDA device(s)", device, ndev);
    return ATTND_EINVAL;
  }
  if (attnd_kshape_check(s) != 0 || layers <= 0) {
    snprintf(err, errlen, "unsupported model shape for the CUDA kernels");
    return ATTND_EINVAL;
  }
  cu_backend_t *be = attnd_xcalloc(1, sizeof(*be));
  be->base.ops = &cu_ops;
  be->base.shape = *s;
  be->base.layers = layers;
  be->loop = loop;
  be->device = device;
  be->nsc = (size_t)s->kv_heads * (size_t)s->head_dim;
  apply_opts(be, o);
  if ((e = cudaSetDevice(device)) != cudaSuccess) {
    snprintf(err, errlen, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
    rc = ATTND_ECUDA;
    goto fail_dev;
  }
  int major = 0, minor = 0;
  if (attnd_cuda_device_info(device, be->devname, sizeof(be->devname), &be->devmem, &major,
                             &minor) != 0) {
    snprintf(err, errlen, "device info: %s", attnd_cuda_last_error());
    rc = ATTND_ECUDA;
    goto fail_dev;
  }
  be->cc = major * 10 + minor;
  if (attnd_cuda_device_uuid(device, be->base.device_uuid, sizeof(be->base.device_uuid)) != 0)
    be->base.device_uuid[0] = 0; /* zero-copy then refuses every handle */
  if (uv_mutex_init(&be->fmu) != 0) {
    snprintf(err, errlen, "uv_mutex_init failed");
    rc = ATTND_EINTERNAL;
    goto fail_dev;
  }
  /* Scales first (tiny), then the pool takes what the budget allows. */
  if ((rc = create_streams(be, layers, err, errlen)) != 0 ||
      (rc = attnd_cu_ipc_setup(be, err, errlen)) != 0 ||
      (rc = create_pool(be, layers, o->kv_memory, err, errlen)) != 0 ||
      (rc = warm_up(be, err, errlen)) != 0 || (rc = start_completion(be, loop, err, errlen)) != 0)
    goto fail_mem;
  be->started = 1;
  ATTND_LOGI("cuda_ring", "ring_bytes=%zu slots=%d slot_bytes=%zu pinned_bytes=%zu frame_bytes=%zu",
             be->ring_bytes, CU_RING_SLOTS, be->slot_bytes, be->pinned_bytes + be->ring_bytes,
             be->frame_bytes);
  *out = &be->base;
  return 0;

fail_mem:
  cudaGetLastError();
  release(be);
  uv_mutex_destroy(&be->fmu);
fail_dev:
  cudaGetLastError();
  free(be->trace);
  free(be);
  return rc;
}

#endif /* ATTND_HAVE_CUDA */

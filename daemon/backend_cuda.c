/* backend_cuda.c: the CUDA backend (backend.h) on top of kernels/cuda (attnd_cuda.h).
 *
 * Memory. One cudaMalloc holds the KV pool of every layer (layer l's blocks
 * start at l * num_blocks * block_bytes), zeroed once at start so that no
 * kernel can ever read uninitialized bytes as NaN. Static scales (and int4
 * zero points) live in one small device array, [layer][k_scale, v_scale,
 * k_zero, v_zero][kv_heads * head_dim] fp32.
 *
 * Ordering. A small pool of non-blocking streams; layer l always runs on
 * stream l % nstreams, so a layer's jobs execute in submission order (a
 * stream is FIFO) and different layers overlap on different streams. Each
 * stream owns a device staging buffer (inputs and outputs of the job running
 * on it) and an attention workspace; both grow on demand with the
 * stream-ordered allocator (cudaFreeAsync + cudaMallocAsync on that stream),
 * so growing never waits for the device and never frees memory a queued
 * kernel of that stream still reads.
 *
 * A STEP job: its items, meta, q, k and v are copied once (one memcpy each)
 * into a pinned host staging buffer taken from a pool (grown on demand; once
 * warm, nothing is cudaHostAlloc'ed; the pool stops growing at a cap, 1/8 of
 * the host's memory up to 8 GiB or ATTND_CUDA_PINNED_MAX bytes, and jobs then
 * wait, in submission order, for a buffer to come back, so a burst of large
 * prefills cannot pin the host's memory), one H2D copy moves them to the stream's
 * device buffer, then attnd_cuda_write, attnd_cuda_attend, one D2H copy of
 * out (+ lse) back into the pinned buffer, and a stream callback. A COPY job
 * is one D2D cudaMemcpyAsync per block pair within the layer's pool.
 *
 * The loop thread copies only the small items and meta. When q, k and v
 * together exceed hostfn_min (CU_HOSTFN_MIN, or ATTND_CUDA_HOSTFN_MIN bytes)
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
 * Measured on the H200 (ATTND_CUDA_TRACE, decode of 4 sessions): a stream
 * callback (cudaStreamAddCallback) ran 20-27 us after the device finished;
 * ATTND_CUDA_COMPLETION=callback still selects it. (Not cudaLaunchHostFunc: a
 * host function is never called once the context has a sticky error, which
 * would leave the engine waiting forever.) The loop thread only enqueues
 * work; it never waits for the device during steps (set_scales enqueues too;
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "base.h"

#ifndef ATTND_HAVE_CUDA

int attnd_backend_cuda_available(void) {
  return 0;
}

int attnd_backend_cuda_create(attnd_backend_t **out, uv_loop_t *loop, const attnd_kshape_t *s,
                              int layers, uint64_t kv_memory, int device, char *err,
                              size_t errlen) {
  snprintf(err, errlen, "this attnd was built without CUDA");
  return ATTND_EUNAVAIL;
}

#else

#include <cuda_runtime_api.h>
#include <sys/prctl.h>
#include <stdatomic.h>
#include <time.h>

#include "attnd_cuda.h"
#include "cuda_sticky.h"

/* Streams: enough for the layers of one step to overlap, few enough that the
 * per-stream buffers stay small. */
#define CU_MAX_STREAMS 8 /* at most 64: the poller keeps a bit per stream */
/* Pinned staging buffers are allocated in power-of-two sizes from this up. */
#define CU_STAGE_MIN ((size_t)2 << 20)
/* Device staging grows to at least this. */
#define CU_DBUF_MIN ((size_t)4 << 20)
/* The split-KV workspace is an optimization: past this, attend splits less. */
#define CU_WS_MAX ((size_t)256 << 20)
/* Alignment of every region inside a staging buffer (vector loads, DMA). */
#define CU_ALIGN ((size_t)256)
/* q+k+v bytes above which their host copy runs in a host function on the
 * stream instead of on the loop thread (about 100 us of memcpy). */
#define CU_HOSTFN_MIN ((size_t)1 << 20)

typedef struct cu_backend_s cu_backend_t;

typedef struct stage_s {
  uint8_t *p; /* pinned host memory */
  size_t cap;
  struct stage_s *next; /* free list */
} stage_t;

/* One unit of stream work: a job, or an internal scales upload (job NULL). */
typedef struct run_s {
  cu_backend_t *be;
  attnd_job_t *job;
  stage_t *stage;
  int stream;
  int status;         /* set on the loop thread when an enqueue failed */
  char msg[128];
  cudaError_t async;  /* set by the stream callback */
  size_t out_off, lse_off;
  size_t q_off, k_off, v_off; /* where stage_inputs_fn puts q, k and v */
  uint64_t t_start, t_end;
  /* ATTND_CUDA_TRACE: events around H2D, write, attend, D2H; host times at
   * the end of the enqueue (loop thread) and at the stream callback. */
  cudaEvent_t ev[5];
  int traced;
  uint64_t t_enq, t_cb;
  cudaEvent_t done_ev; /* polled completion: recorded behind the run's work */
  struct run_s *pnext; /* pending list of the poller (under pmu) */
  struct run_s *next;  /* wait queue (loop thread), then done queue (under mu) */
} run_t;

/* Where a step's time goes, ATTND_CUDA_TRACE=1 (a diagnostic: five events per
 * step). Medians over each window of CU_TRACE_N steps go to the log. */
#define CU_TRACE_N 256
enum { TR_ENQ, TR_H2D, TR_WRITE, TR_ATTEND, TR_D2H, TR_CB, TR_HOP, TR_COUNT };
typedef struct {
  float v[TR_COUNT][CU_TRACE_N];
  int n;
} cu_trace_t;

typedef struct {
  cudaStream_t st;
  uint8_t *dbuf; /* device staging: inputs then outputs of the running job */
  size_t dcap;
  void *ws; /* attention workspace */
  size_t wcap;
  uint64_t last_end_us; /* end of the last job on this stream (under mu) */
} cu_stream_t;

struct cu_backend_s {
  attnd_backend_t base;
  uv_loop_t *loop;
  uv_async_t async; /* freed with the struct, in its close callback */
  int device;
  uint8_t *pool;      /* KV blocks of every layer */
  size_t layer_bytes; /* num_blocks * block_bytes */
  float *dscales;     /* [layers][4][nsc] */
  size_t nsc;         /* kv_heads * head_dim */
  int *scales_ok;     /* [layers] scales uploaded (loop thread) */
  int *per_channel;   /* [layers] */
  cu_stream_t streams[CU_MAX_STREAMS];
  int nstreams;
  stage_t *free_stages; /* loop thread only */
  stage_t **owned; /* every stage ever allocated, freed at destroy */
  size_t nowned, owned_cap;
  size_t pinned_bytes, pinned_max; /* sum of owned caps; the cap on it */
  size_t hostfn_min;               /* q+k+v bytes copied by a host function past this */
  int stages_out;                  /* stages held by runs */
  struct run_s *whead, *wtail;     /* jobs waiting for a stage, FIFO */
  uv_mutex_t mu; /* guards the done queue and streams[].last_end_us */
  run_t *dhead, *dtail;
  atomic_int dead; /* a sticky device error was seen */
  int inflight;    /* jobs submitted, done_cb not yet called */
  int internal;    /* internal runs not yet drained */
  char devname[128];
  uint64_t devmem;
  int cc;
  cu_trace_t *trace; /* ATTND_CUDA_TRACE, else NULL */
  /* Polled completion (see the header); poll 0: stream callbacks. */
  int poll;
  uv_thread_t poller;
  int poller_started;
  uv_mutex_t pmu;
  uv_cond_t pcv;
  run_t *phead, *ptail; /* runs whose done event is recorded, in submission order */
  int pstop;
  cudaEvent_t *evfree; /* recycled done events (loop thread) */
  int nevfree, evcap;
};

static uint64_t now_us(void) {
  return uv_hrtime() / 1000;
}

static size_t align_up(size_t n) {
  return (n + CU_ALIGN - 1) & ~(CU_ALIGN - 1);
}

/* The errors after which the CUDA context is unusable (one list with the kernels'). */
static int cu_sticky(cudaError_t e) { return attnd_cuda_error_sticky(e); }

/* Records a failed CUDA runtime call in a run (first failure wins). */
#define RUN_CU(r, call)                                                                            \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      run_fail_cuda((r), __LINE__, #call, e_);                                                     \
      goto enqueued;                                                                               \
    }                                                                                              \
  } while (0)

static void run_fail_cuda(run_t *r, int line, const char *what, cudaError_t e) {
  /* A non-sticky error stays in the runtime's last-error slot otherwise and
   * would resurface at the next, unrelated check. */
  cudaGetLastError();
  if (r->status)
    return;
  int sticky = cu_sticky(e);
  r->status = sticky ? ATTND_EDEVICE : ATTND_ECUDA;
  snprintf(r->msg, sizeof(r->msg), "backend_cuda.c:%d: %.60s: %s", line, what,
           cudaGetErrorString(e));
  if (sticky)
    atomic_store(&r->be->dead, 1);
}

/* Records a failed attnd_cuda_* call (its codes match errors.h). */
static void run_fail_kernel(run_t *r, int rc) {
  if (r->status)
    return;
  r->status = rc == ATTND_CUDA_EDEVICE ? ATTND_EDEVICE
              : rc == ATTND_CUDA_EINVAL ? ATTND_EINVAL
                                        : ATTND_ECUDA;
  snprintf(r->msg, sizeof(r->msg), "cuda: %s", attnd_cuda_last_error());
  if (rc == ATTND_CUDA_EDEVICE)
    atomic_store(&r->be->dead, 1);
}

/* ---- pinned staging pool (loop thread) ----------------------------------- */

static void stage_free_unused(cu_backend_t *be) {
  /* Rare (the pool is at its cap): cudaFreeHost may wait for the device. */
  for (stage_t *f = be->free_stages, *next; f; f = next) {
    next = f->next;
    for (size_t i = 0; i < be->nowned; i++)
      if (be->owned[i] == f) {
        be->owned[i] = be->owned[--be->nowned];
        break;
      }
    be->pinned_bytes -= f->cap;
    cudaFreeHost(f->p);
    free(f);
  }
  be->free_stages = NULL;
}

/* A pinned buffer of at least need bytes. NULL with *cerr == cudaSuccess:
 * the pool is at its cap and buffers held by running jobs will come back
 * (the caller waits); force ignores the cap (tiny internal uploads). */
static stage_t *stage_get(cu_backend_t *be, size_t need, int force, int *cerr) {
  *cerr = cudaSuccess;
  stage_t **pp = &be->free_stages, **best = NULL;
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->cap >= need && (!best || (*pp)->cap < (*best)->cap))
      best = pp;
  if (best) {
    stage_t *s = *best;
    *best = s->next;
    s->next = NULL;
    be->stages_out++;
    return s;
  }
  /* Warm-up (or a larger step than ever before): a new pinned buffer. Smaller
   * free ones stay while under the cap: freeing pinned memory may wait for
   * the device. */
  size_t cap = CU_STAGE_MIN;
  while (cap < need)
    cap <<= 1;
  if (!force && be->pinned_bytes + cap > be->pinned_max) {
    size_t free_total = 0;
    for (stage_t *f = be->free_stages; f; f = f->next)
      free_total += f->cap;
    if (be->pinned_bytes - free_total + cap > be->pinned_max && be->stages_out > 0)
      return NULL; /* wait for running jobs to return theirs */
    stage_free_unused(be);
  }
  stage_t *s = calloc(1, sizeof(*s));
  if (!s) {
    *cerr = cudaErrorMemoryAllocation;
    return NULL;
  }
  cudaError_t e = cudaHostAlloc((void **)&s->p, cap, cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    free(s);
    *cerr = e;
    return NULL;
  }
  if (be->nowned == be->owned_cap) {
    size_t nc = be->owned_cap ? 2 * be->owned_cap : 16;
    stage_t **no = realloc(be->owned, nc * sizeof(*no));
    if (!no) {
      cudaFreeHost(s->p);
      free(s);
      *cerr = cudaErrorMemoryAllocation;
      return NULL;
    }
    be->owned = no;
    be->owned_cap = nc;
  }
  be->owned[be->nowned++] = s;
  s->cap = cap;
  be->pinned_bytes += cap;
  be->stages_out++;
  return s;
}

static void stage_put(cu_backend_t *be, stage_t *s) {
  if (!s)
    return;
  be->stages_out--;
  s->next = be->free_stages;
  be->free_stages = s;
}

/* Grows a stream-owned device buffer, ordered on that stream. */
static cudaError_t dev_reserve(cu_stream_t *cs, void **buf, size_t *cap, size_t need, size_t min) {
  if (*cap >= need)
    return cudaSuccess;
  size_t nc = min;
  while (nc < need)
    nc <<= 1;
  if (*buf) {
    cudaError_t e = cudaFreeAsync(*buf, cs->st);
    if (e != cudaSuccess)
      return e;
    *buf = NULL;
    *cap = 0;
  }
  cudaError_t e = cudaMallocAsync(buf, nc, cs->st);
  if (e != cudaSuccess) {
    *buf = NULL;
    return e;
  }
  *cap = nc;
  return cudaSuccess;
}

/* ---- completion ---------------------------------------------------------- */

static void update_ref(cu_backend_t *be) {
  /* The async handle keeps the loop alive only while work is out. */
  if (uv_is_closing((uv_handle_t *)&be->async))
    return;
  if (be->inflight + be->internal > 0)
    uv_ref((uv_handle_t *)&be->async);
  else
    uv_unref((uv_handle_t *)&be->async);
}

static void push_done(cu_backend_t *be, run_t *r) {
  uv_mutex_lock(&be->mu);
  cu_stream_t *cs = &be->streams[r->stream];
  r->t_end = now_us();
  /* The job began when the device reached it: after its submission and
   * after the previous job of its stream ended. */
  r->t_start = cs->last_end_us > 0 && r->job && cs->last_end_us > r->job->t_submit_us
                   ? cs->last_end_us
                   : (r->job ? r->job->t_submit_us : r->t_end);
  if (r->t_start > r->t_end)
    r->t_start = r->t_end;
  cs->last_end_us = r->t_end;
  r->next = NULL;
  if (be->dtail)
    be->dtail->next = r;
  else
    be->dhead = r;
  be->dtail = r;
  uv_mutex_unlock(&be->mu);
  uv_async_send(&be->async);
}

/* Runs on a CUDA-owned thread after the run's stream work: no CUDA calls
 * allowed here, only host copies and the hand-off to the loop. */
static void CUDART_CB stream_cb(cudaStream_t st, cudaError_t status, void *arg) {
  run_t *r = arg;
  cu_backend_t *be = r->be;
  if (r->traced)
    r->t_cb = now_us();
  r->async = status;
  if (status != cudaSuccess && cu_sticky(status))
    atomic_store(&be->dead, 1);
  attnd_job_t *job = r->job;
  if (status == cudaSuccess && !r->status && job && job->kind == ATTND_JOB_STEP) {
    if (job->out_bytes)
      memcpy(job->batch.out, r->stage->p + r->out_off, job->out_bytes);
    if (job->lse_bytes && job->batch.lse)
      memcpy(job->batch.lse, r->stage->p + r->lse_off, job->lse_bytes);
  }
  push_done(be, r);
}

/* ---- polled completion ---------------------------------------------------- */

static cudaEvent_t ev_get(cu_backend_t *be) {
  if (be->nevfree > 0)
    return be->evfree[--be->nevfree];
  cudaEvent_t ev = NULL;
  if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    return NULL;
  }
  return ev;
}

static void ev_put(cu_backend_t *be, cudaEvent_t ev) {
  if (!ev)
    return;
  if (be->nevfree == be->evcap) {
    int cap = be->evcap ? 2 * be->evcap : 64;
    cudaEvent_t *n = realloc(be->evfree, (size_t)cap * sizeof(*n));
    if (!n) {
      cudaEventDestroy(ev);
      cudaGetLastError();
      return;
    }
    be->evfree = n;
    be->evcap = cap;
  }
  be->evfree[be->nevfree++] = ev;
}

/* Puts a run's completion behind everything enqueued on st so far: a stream
 * callback, or an event the poller watches. */
static cudaError_t track(cu_backend_t *be, run_t *r, cudaStream_t st) {
  if (!be->poll)
    return cudaStreamAddCallback(st, stream_cb, r, 0);
  cudaEvent_t ev = ev_get(be);
  if (!ev)
    return cudaErrorMemoryAllocation;
  cudaError_t e = cudaEventRecord(ev, st);
  if (e != cudaSuccess) {
    ev_put(be, ev);
    return e;
  }
  r->done_ev = ev;
  r->pnext = NULL;
  uv_mutex_lock(&be->pmu);
  if (be->ptail)
    be->ptail->pnext = r;
  else
    be->phead = r;
  be->ptail = r;
  uv_cond_signal(&be->pcv);
  uv_mutex_unlock(&be->pmu);
  return cudaSuccess;
}

static void poller_main(void *arg) {
  cu_backend_t *be = arg;
  cudaSetDevice(be->device);
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* 1 us: nanosleep(3 us) sleeps ~3 us, not ~55 */
  int idle = 0; /* rounds without a completion since the last one */
  uv_mutex_lock(&be->pmu);
  for (;;) {
    while (!be->phead && !be->pstop)
      uv_cond_wait(&be->pcv, &be->pmu);
    if (!be->phead)
      break; /* stopping, nothing pending */
    run_t *list = be->phead;
    be->phead = be->ptail = NULL;
    uv_mutex_unlock(&be->pmu);
    run_t *kh = NULL, *kt = NULL;
    int done = 0;
    /* Streams with an unfinished run in this round: their later runs are not
     * even queried, since the stream may finish both between the two queries
     * and the later one must not complete first (per-layer order). */
    uint64_t blocked = 0;
    for (run_t *r = list, *next; r; r = next) {
      next = r->pnext;
      const uint64_t bit = (uint64_t)1 << r->stream;
      cudaError_t q = (blocked & bit) ? cudaErrorNotReady : cudaEventQuery(r->done_ev);
      if (q == cudaErrorNotReady) {
        blocked |= bit;
        r->pnext = NULL;
        if (kt)
          kt->pnext = r;
        else
          kh = r;
        kt = r;
        continue;
      }
      if (q != cudaSuccess)
        cudaGetLastError();
      stream_cb(NULL, q, r); /* r now belongs to the loop */
      done++;
    }
    /* No busy spin: a thread hammering cudaEventQuery contends with the loop
     * thread's launches for the driver's locks (measured on the H200: a
     * sched_yield spin made pipelined decode 40% slower). Short sleeps with a
     * 1 us timer slack poll every few microseconds, then back off to 20 us
     * for long kernels. */
    if (done)
      idle = 0;
    nanosleep(&(struct timespec){0, ++idle > 100 ? 20000 : 3000}, NULL);
    uv_mutex_lock(&be->pmu);
    if (kh) { /* unfinished runs go back in front of newer ones */
      kt->pnext = be->phead;
      be->phead = kh;
      if (!be->ptail)
        be->ptail = kt;
    }
  }
  uv_mutex_unlock(&be->pmu);
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Loop thread, after the stream callback: the run's events are complete. */
static void trace_run(cu_backend_t *be, run_t *r) {
  cu_trace_t *t = be->trace;
  float ms[4] = {0, 0, 0, 0};
  int ok = r->async == cudaSuccess && !r->status;
  for (int i = 0; i < 4 && ok; i++)
    if (cudaEventElapsedTime(&ms[i], r->ev[i], r->ev[i + 1]) != cudaSuccess)
      ok = 0;
  for (int i = 0; i < 5; i++)
    cudaEventDestroy(r->ev[i]);
  cudaGetLastError();
  r->traced = 0;
  if (!ok || !t)
    return;
  const float gpu = (ms[0] + ms[1] + ms[2] + ms[3]) * 1e3f;
  const float v[TR_COUNT] = {(float)(r->t_enq - r->job->t_submit_us), ms[0] * 1e3f, ms[1] * 1e3f,
                             ms[2] * 1e3f, ms[3] * 1e3f,
                             /* callback after the device's end, if the device started at once */
                             (float)(r->t_cb - r->t_enq) - gpu, (float)(now_us() - r->t_cb)};
  for (int i = 0; i < TR_COUNT; i++)
    t->v[i][t->n] = v[i];
  if (++t->n < CU_TRACE_N)
    return;
  for (int i = 0; i < TR_COUNT; i++)
    qsort(t->v[i], CU_TRACE_N, sizeof(float), cmp_float);
  const int m = CU_TRACE_N / 2;
  ATTND_LOGI("cuda_trace",
             "steps=%d enqueue_us=%.1f h2d_us=%.1f write_us=%.1f attend_us=%.1f d2h_us=%.1f "
             "callback_after_device_us=%.1f callback_to_loop_us=%.1f",
             CU_TRACE_N, t->v[TR_ENQ][m], t->v[TR_H2D][m], t->v[TR_WRITE][m], t->v[TR_ATTEND][m],
             t->v[TR_D2H][m], t->v[TR_CB][m], t->v[TR_HOP][m]);
  t->n = 0;
}

static void finish_run(cu_backend_t *be, run_t *r) {
  attnd_job_t *job = r->job;
  if (r->traced)
    trace_run(be, r);
  ev_put(be, r->done_ev);
  r->done_ev = NULL;
  if (!r->status && r->async != cudaSuccess) {
    int sticky = cu_sticky(r->async);
    r->status = sticky ? ATTND_EDEVICE : ATTND_ECUDA;
    snprintf(r->msg, sizeof(r->msg), "cuda: layer %d: device work failed: %s",
             job ? job->layer : -1, cudaGetErrorString(r->async));
  }
  stage_put(be, r->stage);
  if (!job) {
    be->internal--;
    free(r);
    return;
  }
  job->status = r->status;
  if (r->status)
    snprintf(job->message, sizeof(job->message), "%s", r->msg);
  job->t_start_us = r->t_start;
  job->t_end_us = r->t_end;
  be->inflight--;
  free(r);
  job->done_cb(job);
}

static void pump_waiting(cu_backend_t *be);

static void async_cb(uv_async_t *h) {
  cu_backend_t *be = h->data;
  uv_mutex_lock(&be->mu);
  run_t *r = be->dhead;
  be->dhead = be->dtail = NULL;
  uv_mutex_unlock(&be->mu);
  while (r) {
    run_t *next = r->next;
    finish_run(be, r);
    r = next;
  }
  pump_waiting(be);
  update_ref(be);
}

/* Hands a run whose stream work could not be tracked by a callback to the
 * loop. Its stream is drained first (an error path only) so that its pinned
 * buffer is no longer read by a copy already queued. */
static void complete_untracked(cu_backend_t *be, run_t *r) {
  if (r->stage)
    cudaStreamSynchronize(be->streams[r->stream].st);
  cudaGetLastError();
  push_done(be, r);
}

/* ---- submission (loop thread) -------------------------------------------- */

static void enqueue_copy(cu_backend_t *be, run_t *r) {
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

/* Runs on a CUDA-owned thread, in stream order before the H2D copy of the
 * run's inputs: the one host copy of q, k and v. No CUDA calls allowed here. */
static void CUDART_CB stage_inputs_fn(void *arg) {
  run_t *r = arg;
  const attnd_job_t *job = r->job;
  uint8_t *hp = r->stage->p;
  if (job->q_bytes)
    memcpy(hp + r->q_off, job->batch.q, job->q_bytes);
  if (job->kv_bytes) {
    memcpy(hp + r->k_off, job->batch.k, job->kv_bytes);
    memcpy(hp + r->v_off, job->batch.v, job->kv_bytes);
  }
}

/* 1 when the job must wait for a pinned buffer (nothing was enqueued). */
static int enqueue_step(cu_backend_t *be, run_t *r) {
  attnd_job_t *job = r->job;
  const attnd_kbatch_t *hb = &job->batch;
  const attnd_kshape_t *s = &be->base.shape;
  cu_stream_t *cs = &be->streams[r->stream];
  int layer = job->layer;

  attnd_kbatch_t db = *hb;
  db.cache = be->pool + (size_t)layer * be->layer_bytes;
  db.block_bytes = be->base.block_bytes;
  db.k_scale = db.v_scale = db.k_zero = db.v_zero = NULL;
  db.scale_per_channel = 0;
  if (attnd_kv_type_static(s->kv)) {
    if (!be->scales_ok[layer]) {
      r->status = ATTND_EPRECOND;
      snprintf(r->msg, sizeof(r->msg), "layer %d has no static scales on the device", layer);
      return 0;
    }
    float *ls = be->dscales + (size_t)layer * 4 * be->nsc;
    db.k_scale = ls;
    db.v_scale = ls + be->nsc;
    db.scale_per_channel = be->per_channel[layer];
    if (s->kv == ATTND_KV_INT4) {
      db.k_zero = ls + 2 * be->nsc;
      db.v_zero = ls + 3 * be->nsc;
    }
  }

  /* Layout of the staging buffers (host and device alike). */
  size_t items_bytes = (size_t)hb->nitems * sizeof(attnd_kitem_t);
  size_t meta_bytes = job->nmeta * sizeof(int32_t);
  size_t off_meta = align_up(items_bytes);
  size_t off_q = off_meta + align_up(meta_bytes);
  size_t off_k = off_q + align_up(job->q_bytes);
  size_t off_v = off_k + align_up(job->kv_bytes);
  size_t in_bytes = off_v + job->kv_bytes;
  size_t off_out = align_up(in_bytes);
  size_t off_lse = off_out + align_up(job->out_bytes);
  size_t total = off_lse + job->lse_bytes;
  r->out_off = off_out;
  r->lse_off = off_lse;
  r->q_off = off_q;
  r->k_off = off_k;
  r->v_off = off_v;

  int cerr = cudaSuccess;
  r->stage = stage_get(be, total, 0, &cerr);
  if (!r->stage) {
    if (cerr == cudaSuccess)
      return 1;
    run_fail_cuda(r, __LINE__, "cudaHostAlloc (pinned staging)", (cudaError_t)cerr);
    return 0;
  }
  /* The one host copy of each input on its way to the device: items and
   * meta here, q, k and v here or in a host function (see the header). */
  uint8_t *hp = r->stage->p;
  memcpy(hp, hb->items, items_bytes);
  if (meta_bytes)
    memcpy(hp + off_meta, hb->meta, meta_bytes);
  int hostfn = job->q_bytes + 2 * job->kv_bytes > be->hostfn_min;
  if (!hostfn)
    stage_inputs_fn(r);

  RUN_CU(r, dev_reserve(cs, (void **)&cs->dbuf, &cs->dcap, total, CU_DBUF_MIN));
  uint8_t *dp = cs->dbuf;
  if (hostfn)
    RUN_CU(r, cudaLaunchHostFunc(cs->st, stage_inputs_fn, r));
  if (be->trace && !r->traced) {
    r->traced = 1;
    for (int i = 0; i < 5; i++)
      if (cudaEventCreate(&r->ev[i]) != cudaSuccess)
        r->traced = 0;
    if (!r->traced)
      cudaGetLastError();
  }
  if (r->traced)
    cudaEventRecord(r->ev[0], cs->st);
  RUN_CU(r, cudaMemcpyAsync(dp, hp, in_bytes, cudaMemcpyHostToDevice, cs->st));
  if (r->traced)
    cudaEventRecord(r->ev[1], cs->st);
  db.items = (const attnd_kitem_t *)dp;
  db.meta = (const int32_t *)(dp + off_meta);
  db.q = job->q_bytes ? dp + off_q : NULL;
  db.k = dp + off_k;
  db.v = dp + off_v;
  db.out = job->out_bytes ? dp + off_out : NULL;
  db.lse = job->lse_bytes && hb->lse ? (float *)(dp + off_lse) : NULL;

  int rc = attnd_cuda_write(s, &db, cs->st);
  if (rc) {
    run_fail_kernel(r, rc);
    goto enqueued;
  }
  if (r->traced)
    cudaEventRecord(r->ev[2], cs->st);
  if (db.total_q > 0 && job->out_bytes) {
    size_t want = attnd_cuda_attend_workspace(s, db.total_q);
    if (want > CU_WS_MAX)
      want = CU_WS_MAX;
    if (want && dev_reserve(cs, &cs->ws, &cs->wcap, want, (size_t)1 << 20) != cudaSuccess) {
      /* The workspace only speeds up long contexts: run without it. */
      cudaGetLastError();
    }
    rc = attnd_cuda_attend(s, &db, cs->ws, cs->ws ? cs->wcap : 0, cs->st);
    if (rc) {
      run_fail_kernel(r, rc);
      goto enqueued;
    }
  }
  if (r->traced)
    cudaEventRecord(r->ev[3], cs->st);
  if (db.total_q > 0 && job->out_bytes)
    RUN_CU(r, cudaMemcpyAsync(hp + off_out, dp + off_out, total - off_out,
                              cudaMemcpyDeviceToHost, cs->st));
  if (r->traced)
    cudaEventRecord(r->ev[4], cs->st);
enqueued:
  return 0;
}

/* Enqueues a job's work and its callback; 1 when it must wait for a pinned
 * buffer instead (nothing enqueued, the caller queues it). */
static int start_run(cu_backend_t *be, run_t *r) {
  attnd_job_t *job = r->job;
  cudaSetDevice(be->device);
  if (atomic_load(&be->dead)) {
    r->status = ATTND_EDEVICE;
    snprintf(r->msg, sizeof(r->msg), "the CUDA device is unusable after an earlier error");
  } else if (job->kind == ATTND_JOB_COPY) {
    enqueue_copy(be, r);
  } else if (enqueue_step(be, r)) {
    return 1;
  }
  /* Even a failed job gets its callback behind what it enqueued, so its
   * pinned buffer returns to the pool only once no copy reads it, and its
   * done_cb comes after those of the layer's earlier jobs (a stream callback
   * runs exactly once, with the error, even after a sticky one). */
  r->t_enq = now_us();
  cudaError_t e = track(be, r, be->streams[r->stream].st);
  if (e != cudaSuccess) {
    run_fail_cuda(r, __LINE__, be->poll ? "cudaEventRecord (completion)" : "cudaStreamAddCallback", e);
    complete_untracked(be, r);
  }
  return 0;
}

/* Starts waiting jobs, oldest first, while pinned buffers are available. */
static void pump_waiting(cu_backend_t *be) {
  while (be->whead) {
    /* Unlinked before it starts: once its callback is enqueued, the done
     * queue (another thread) owns r->next. */
    run_t *r = be->whead;
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

static int cu_submit(attnd_backend_t *base, attnd_job_t *job) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (job->layer < 0 || job->layer >= base->layers)
    return ATTND_EINVAL;
  run_t *r = calloc(1, sizeof(*r));
  if (!r)
    return ATTND_ENOMEM;
  r->be = be;
  r->job = job;
  r->stream = job->layer % be->nstreams;
  job->status = 0;
  job->message[0] = 0;
  job->t_submit_us = now_us();
  job->t_start_us = job->t_end_us = 0;
  be->inflight++;
  update_ref(be);
  /* Behind any waiting job (one FIFO for all layers keeps each layer's
   * order), or waiting itself when no pinned buffer is free. */
  if (be->whead || start_run(be, r)) {
    r->next = NULL;
    if (be->wtail)
      be->wtail->next = r;
    else
      be->whead = r;
    be->wtail = r;
  }
  return 0;
}

static int cu_set_scales(attnd_backend_t *base, int layer, const float *k_scale,
                         const float *v_scale, const float *k_zero, const float *v_zero,
                         int per_channel) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (layer < 0 || layer >= base->layers || !k_scale || !v_scale)
    return ATTND_EINVAL;
  if (!be->dscales)
    return 0; /* a type without static scales: nothing the kernels read */
  be->scales_ok[layer] = 0;
  if (atomic_load(&be->dead))
    return ATTND_EDEVICE;
  size_t n = (size_t)base->shape.kv_heads * (per_channel ? (size_t)base->shape.head_dim : 1);
  run_t *r = calloc(1, sizeof(*r));
  if (!r)
    return ATTND_ENOMEM;
  r->be = be;
  r->stream = layer % be->nstreams;
  int cerr = cudaSuccess;
  r->stage = stage_get(be, 4 * be->nsc * sizeof(float), 1, &cerr);
  if (!r->stage) {
    free(r);
    return ATTND_ENOMEM;
  }
  /* Staged through pinned memory on the layer's stream: the upload is ordered
   * before the layer's next job without the loop waiting for it. */
  float *hp = (float *)r->stage->p;
  memset(hp, 0, 4 * be->nsc * sizeof(float));
  memcpy(hp, k_scale, n * sizeof(float));
  memcpy(hp + be->nsc, v_scale, n * sizeof(float));
  if (k_zero)
    memcpy(hp + 2 * be->nsc, k_zero, n * sizeof(float));
  if (v_zero)
    memcpy(hp + 3 * be->nsc, v_zero, n * sizeof(float));
  be->internal++;
  update_ref(be);
  cudaSetDevice(be->device);
  cu_stream_t *cs = &be->streams[r->stream];
  cudaError_t e = cudaMemcpyAsync(be->dscales + (size_t)layer * 4 * be->nsc, hp,
                                  4 * be->nsc * sizeof(float), cudaMemcpyHostToDevice, cs->st);
  if (e != cudaSuccess) {
    run_fail_cuda(r, __LINE__, "cudaMemcpyAsync (scales)", e);
  }
  int rc = r->status;
  cudaError_t e2 = track(be, r, cs->st);
  if (e2 != cudaSuccess) {
    run_fail_cuda(r, __LINE__, be->poll ? "cudaEventRecord (completion)" : "cudaStreamAddCallback", e2);
    rc = r->status;
    complete_untracked(be, r);
  }
  if (rc)
    return rc;
  be->scales_ok[layer] = 1;
  be->per_channel[layer] = per_channel;
  return 0;
}

static int cu_inflight(attnd_backend_t *base) {
  return ((cu_backend_t *)base)->inflight;
}

static void cu_describe(attnd_backend_t *base, char *device, size_t len, uint64_t *mem, int *cc) {
  cu_backend_t *be = (cu_backend_t *)base;
  snprintf(device, len, "%s (cuda device %d)", be->devname, be->device);
  *mem = be->devmem;
  *cc = be->cc;
}

/* Frees the device and pinned memory; the struct itself goes in the async
 * handle's close callback. */
static void release(cu_backend_t *be) {
  cudaSetDevice(be->device);
  for (int i = 0; i < be->nstreams; i++) {
    cu_stream_t *cs = &be->streams[i];
    if (!cs->st)
      continue;
    if (cs->dbuf)
      cudaFreeAsync(cs->dbuf, cs->st);
    if (cs->ws)
      cudaFreeAsync(cs->ws, cs->st);
    cudaStreamSynchronize(cs->st);
    cudaStreamDestroy(cs->st);
    cs->st = NULL;
    cs->dbuf = NULL;
    cs->ws = NULL;
  }
  if (be->pool)
    cudaFree(be->pool);
  if (be->dscales)
    cudaFree(be->dscales);
  be->pool = NULL;
  be->dscales = NULL;
  for (size_t i = 0; i < be->nowned; i++) {
    cudaFreeHost(be->owned[i]->p);
    free(be->owned[i]);
  }
  free(be->owned);
  be->owned = NULL;
  be->nowned = 0;
  be->free_stages = NULL;
  free(be->scales_ok);
  free(be->per_channel);
  be->scales_ok = be->per_channel = NULL;
  for (int i = 0; i < be->nevfree; i++)
    cudaEventDestroy(be->evfree[i]);
  free(be->evfree);
  be->evfree = NULL;
  be->nevfree = be->evcap = 0;
  /* A sticky error is cleared only by a reset; nothing here reuses the
   * context, so the last-error slot is simply cleared. */
  cudaGetLastError();
}

static void async_closed(uv_handle_t *h) {
  cu_backend_t *be = h->data;
  uv_mutex_destroy(&be->mu);
  if (be->poll) {
    uv_cond_destroy(&be->pcv);
    uv_mutex_destroy(&be->pmu);
  }
  free(be->trace);
  free(be);
}

static void poller_stop(cu_backend_t *be) {
  if (!be->poller_started)
    return;
  uv_mutex_lock(&be->pmu);
  be->pstop = 1;
  uv_cond_signal(&be->pcv);
  uv_mutex_unlock(&be->pmu);
  uv_thread_join(&be->poller);
  be->poller_started = 0;
}

static void cu_destroy(attnd_backend_t *base) {
  cu_backend_t *be = (cu_backend_t *)base;
  cudaSetDevice(be->device);
  /* Teardown is the one place that waits for the device: every stream
   * callback has run once its stream is synchronized. */
  for (int i = 0; i < be->nstreams; i++)
    if (be->streams[i].st)
      cudaStreamSynchronize(be->streams[i].st);
  /* Every pending event is complete now: the poller finishes those runs,
   * then exits. */
  poller_stop(be);
  /* Nothing is in flight (contract); drain internal runs (scale uploads). */
  uv_mutex_lock(&be->mu);
  run_t *r = be->dhead;
  be->dhead = be->dtail = NULL;
  uv_mutex_unlock(&be->mu);
  while (r) {
    run_t *next = r->next;
    if (r->job)
      fprintf(stderr, "attnd: cuda backend destroyed with a job in flight (layer %d)\n",
              r->job->layer);
    free(r);
    r = next;
  }
  release(be);
  uv_close((uv_handle_t *)&be->async, async_closed);
}

static const attnd_backend_ops_t cu_ops = {
    .name = "cuda",
    .submit = cu_submit,
    .set_scales = cu_set_scales,
    .inflight = cu_inflight,
    .describe = cu_describe,
    .destroy = cu_destroy,
};

int attnd_backend_cuda_available(void) {
  return attnd_cuda_device_count() > 0;
}

int attnd_backend_cuda_create(attnd_backend_t **out, uv_loop_t *loop, const attnd_kshape_t *s,
                              int layers, uint64_t kv_memory, int device, char *err,
                              size_t errlen) {
  cudaError_t e;
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
  cu_backend_t *be = calloc(1, sizeof(*be));
  if (!be)
    return ATTND_ENOMEM;
  be->base.ops = &cu_ops;
  be->base.shape = *s;
  be->base.layers = layers;
  be->loop = loop;
  be->device = device;
  be->nsc = (size_t)s->kv_heads * (size_t)s->head_dim;
  uint64_t ram = uv_get_total_memory();
  be->pinned_max = (size_t)(ram / 8 < (8ull << 30) ? ram / 8 : (8ull << 30));
  if (be->pinned_max < ((size_t)256 << 20))
    be->pinned_max = (size_t)256 << 20;
  const char *pm = getenv("ATTND_CUDA_PINNED_MAX");
  if (pm && *pm)
    be->pinned_max = (size_t)strtoull(pm, NULL, 10);
  const char *cm = getenv("ATTND_CUDA_COMPLETION");
  be->poll = !(cm && strcmp(cm, "callback") == 0);
  const char *tr = getenv("ATTND_CUDA_TRACE");
  if (tr && *tr && strcmp(tr, "0") != 0)
    be->trace = calloc(1, sizeof(cu_trace_t));
  be->hostfn_min = CU_HOSTFN_MIN;
  const char *hm = getenv("ATTND_CUDA_HOSTFN_MIN");
  if (hm && *hm)
    be->hostfn_min = (size_t)strtoull(hm, NULL, 10);
  int rc = ATTND_ECUDA;

  if ((e = cudaSetDevice(device)) != cudaSuccess) {
    snprintf(err, errlen, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
    goto fail_dev;
  }
  int major = 0, minor = 0;
  if (attnd_cuda_device_info(device, be->devname, sizeof(be->devname), &be->devmem, &major,
                             &minor) != 0) {
    snprintf(err, errlen, "device info: %s", attnd_cuda_last_error());
    goto fail_dev;
  }
  be->cc = major * 10 + minor;

  be->nstreams = layers < CU_MAX_STREAMS ? layers : CU_MAX_STREAMS;
  for (int i = 0; i < be->nstreams; i++)
    if ((e = cudaStreamCreateWithFlags(&be->streams[i].st, cudaStreamNonBlocking)) !=
        cudaSuccess) {
      snprintf(err, errlen, "cudaStreamCreateWithFlags: %s", cudaGetErrorString(e));
      goto fail_mem;
    }

  /* Scales first (tiny), then the pool takes what the budget allows. */
  be->scales_ok = calloc((size_t)layers, sizeof(int));
  be->per_channel = calloc((size_t)layers, sizeof(int));
  if (!be->scales_ok || !be->per_channel) {
    rc = ATTND_ENOMEM;
    snprintf(err, errlen, "out of host memory");
    goto fail_mem;
  }
  if (attnd_kv_type_static(s->kv)) {
    size_t sb = (size_t)layers * 4 * be->nsc * sizeof(float);
    if ((e = cudaMalloc((void **)&be->dscales, sb)) != cudaSuccess ||
        (e = cudaMemset(be->dscales, 0, sb)) != cudaSuccess) {
      snprintf(err, errlen, "cudaMalloc (%zu bytes of scales): %s", sb, cudaGetErrorString(e));
      goto fail_mem;
    }
  }

  size_t free_b = 0, total_b = 0;
  if ((e = cudaMemGetInfo(&free_b, &total_b)) != cudaSuccess) {
    snprintf(err, errlen, "cudaMemGetInfo: %s", cudaGetErrorString(e));
    goto fail_mem;
  }
  if (!kv_memory)
    kv_memory = (uint64_t)((double)free_b * 0.9); /* the rest: staging, workspace */
  size_t bb = attnd_kv_block_bytes(s);
  uint64_t nb = kv_memory / ((uint64_t)bb * (uint64_t)layers);
  if (nb == 0 || nb > INT32_MAX) {
    rc = ATTND_EINVAL;
    snprintf(err, errlen, "kv-memory %llu holds %llu blocks of %zu bytes x %d layers",
             (unsigned long long)kv_memory, (unsigned long long)nb, bb, layers);
    goto fail_mem;
  }
  be->base.num_blocks = (uint32_t)nb;
  be->base.block_bytes = bb;
  be->layer_bytes = (size_t)nb * bb;
  size_t pool_bytes = be->layer_bytes * (size_t)layers;
  if ((e = cudaMalloc((void **)&be->pool, pool_bytes)) != cudaSuccess) {
    cudaGetLastError();
    rc = ATTND_ENOMEM;
    snprintf(err, errlen, "cudaMalloc of a %zu-byte KV pool (%zu bytes free of %zu): %s",
             pool_bytes, free_b, total_b, cudaGetErrorString(e));
    be->pool = NULL;
    goto fail_mem;
  }
  /* Zeroed once: a kernel that loads a whole tile past kv_len then reads
   * zeros, never stale bytes that could be NaN. */
  if ((e = cudaMemset(be->pool, 0, pool_bytes)) != cudaSuccess ||
      (e = cudaDeviceSynchronize()) != cudaSuccess) {
    snprintf(err, errlen, "cudaMemset of the KV pool: %s", cudaGetErrorString(e));
    goto fail_mem;
  }

  /* Warm pools: two pinned buffers per stream (one job running, the next
   * being staged) and initial device buffers, so that the first steps
   * allocate nothing. All are taken before any goes back, so that each
   * stage_get allocates a new one. */
  stage_t *warm[2 * CU_MAX_STREAMS];
  int nwarm = 0;
  for (int i = 0; i < 2 * be->nstreams; i++) {
    int cerr = cudaSuccess;
    stage_t *st = stage_get(be, CU_STAGE_MIN, 1, &cerr);
    if (!st) {
      while (nwarm > 0)
        stage_put(be, warm[--nwarm]);
      snprintf(err, errlen, "cudaHostAlloc (pinned staging): %s",
               cudaGetErrorString((cudaError_t)cerr));
      goto fail_mem;
    }
    warm[nwarm++] = st;
  }
  while (nwarm > 0)
    stage_put(be, warm[--nwarm]);
  for (int i = 0; i < be->nstreams; i++) {
    cu_stream_t *cs = &be->streams[i];
    if ((e = dev_reserve(cs, (void **)&cs->dbuf, &cs->dcap, CU_DBUF_MIN, CU_DBUF_MIN)) !=
        cudaSuccess) {
      snprintf(err, errlen, "cudaMallocAsync (device staging): %s", cudaGetErrorString(e));
      goto fail_mem;
    }
  }
  if ((e = cudaDeviceSynchronize()) != cudaSuccess) {
    snprintf(err, errlen, "cudaDeviceSynchronize: %s", cudaGetErrorString(e));
    goto fail_mem;
  }

  if (uv_mutex_init(&be->mu) != 0) {
    rc = ATTND_EINTERNAL;
    snprintf(err, errlen, "uv_mutex_init failed");
    goto fail_mem;
  }
  if (uv_async_init(loop, &be->async, async_cb) != 0) {
    rc = ATTND_EINTERNAL;
    snprintf(err, errlen, "uv_async_init failed");
    goto fail_mutex;
  }
  be->async.data = be;
  uv_unref((uv_handle_t *)&be->async);
  if (be->poll) {
    if (uv_mutex_init(&be->pmu) != 0 || uv_cond_init(&be->pcv) != 0 ||
        uv_thread_create(&be->poller, poller_main, be) != 0) {
      /* No thread: stream callbacks do the same job, a little later. */
      ATTND_LOGW("cuda_poller", "err=\"cannot start the completion thread; using stream callbacks\"");
      be->poll = 0;
    } else {
      be->poller_started = 1;
    }
  }
  *out = &be->base;
  return 0;

fail_mutex:
  uv_mutex_destroy(&be->mu);
fail_mem:
  cudaGetLastError();
  release(be);
fail_dev:
  cudaGetLastError();
  free(be->trace);
  free(be);
  return rc;
}

#endif /* ATTND_HAVE_CUDA */

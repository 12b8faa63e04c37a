/* cuda_stage.c: the CUDA backend's staging (internal.h).
 *
 * Pinned host buffers come from a pool made at start: two of CU_STAGE_MIN
 * per stream, for every step that fits one (larger ones go through the ring,
 * cuda_ring.c); with all of them out, a job waits for one a running job
 * gives back. Request frames likewise come from CU_FRAMES buffers made at
 * start. Nothing here allocates while serving (an allocation then holds the
 * driver lock that every CUDA call of the process needs: bench/RESULTS.md),
 * but for the one-shot path: a large step the ring cannot cut gets a buffer
 * of a power-of-two size, within --cuda-pinned-max, allocated on the worker
 * pool (cudaHostAlloc pins every page: hundreds of milliseconds for ~650 MB)
 * while its job waits as for a full pool. Device buffers belong to a stream
 * (made at start; the one-shot path grows them with the stream-ordered
 * allocator, which never frees memory a queued kernel of that stream still
 * reads). */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define CU_ASYNC_ALLOC_MIN ((size_t)8 << 20)

typedef struct {
  uv_work_t w; /* first: the work request is the struct */
  cu_backend_t *be;
  size_t cap;
  uint8_t *p;
  cudaError_t err;
} cu_alloc_t;

int attnd_cu_allocs_inflight(const cu_backend_t *be) {
  return be->stage_alloc_inflight;
}

static void alloc_work(uv_work_t *w) {
  cu_alloc_t *a = (cu_alloc_t *)w;
  a->err = cudaSetDevice(a->be->device);
  if (a->err == cudaSuccess)
    a->err = cudaHostAlloc((void **)&a->p, a->cap, cudaHostAllocPortable);
  if (a->err != cudaSuccess) {
    a->p = NULL;
    cudaGetLastError();
  }
}

static int owned_add(cu_backend_t *be, cu_stage_t *s) {
  if (be->nowned == be->owned_cap) {
    size_t nc = be->owned_cap ? 2 * be->owned_cap : 16;
    cu_stage_t **no = realloc(be->owned, nc * sizeof(*no));
    if (!no)
      return -1;
    be->owned = no;
    be->owned_cap = nc;
  }
  be->owned[be->nowned++] = s;
  return 0;
}

static void alloc_done(uv_work_t *w, int status) {
  cu_alloc_t *a = (cu_alloc_t *)w;
  cu_backend_t *be = a->be;
  be->stage_alloc_inflight = 0;
  if (be->closed) {
    /* The backend was destroyed meanwhile (its pools are gone): this
     * callback owns the struct once no allocation is left in flight. */
    if (a->p)
      cudaFreeHost(a->p);
    free(a);
    if (!attnd_cu_allocs_inflight(be) && be->handle_closed)
      attnd_cu_free_struct(be);
    return;
  }
  cu_stage_t *s = a->p && status == 0 ? calloc(1, sizeof(*s)) : NULL;
  if (s && owned_add(be, s) != 0) {
    free(s);
    s = NULL;
  }
  if (!s) {
    if (a->p)
      cudaFreeHost(a->p);
    be->pinned_bytes -= a->cap;
    be->stage_alloc_err = a->err != cudaSuccess ? (int)a->err : (int)cudaErrorMemoryAllocation;
  } else {
    s->p = a->p;
    s->cap = a->cap;
    s->next = be->free_stages;
    be->free_stages = s;
  }
  free(a);
  attnd_cu_pump_waiting(be); /* the job that asked for it takes it, or its error */
}

/* Starts a pinned allocation of cap bytes on the worker pool, its bytes
 * counted against the pool's cap from now; -1 when it cannot be queued
 * (the caller then allocates here). */
static int alloc_start(cu_backend_t *be, size_t cap) {
  cu_alloc_t *a = calloc(1, sizeof(*a));
  if (!a)
    return -1;
  a->be = be;
  a->cap = cap;
  if (uv_queue_work(be->loop, &a->w, alloc_work, alloc_done) != 0) {
    free(a);
    return -1;
  }
  be->stage_alloc_inflight = 1;
  be->pinned_bytes += cap;
  return 0;
}

static void stage_free_unused(cu_backend_t *be) {
  /* Rare (the pool is at its cap): cudaFreeHost may wait for the device.
   * Only the one-shot path's buffers: the pooled ones made at start stay
   * (small steps wait for them and never allocate). */
  cu_stage_t **pp = &be->free_stages;
  for (cu_stage_t *f = be->free_stages, *next; f; f = next) {
    next = f->next;
    if (f->cap <= CU_STAGE_MIN) {
      pp = &f->next;
      continue;
    }
    *pp = next;
    for (size_t i = 0; i < be->nowned; i++)
      if (be->owned[i] == f) {
        be->owned[i] = be->owned[--be->nowned];
        break;
      }
    be->pinned_bytes -= f->cap;
    cudaFreeHost(f->p);
    free(f);
  }
}

cu_stage_t *attnd_cu_stage_get(cu_backend_t *be, size_t need, int force, int *cerr) {
  *cerr = cudaSuccess;
  cu_stage_t **pp = &be->free_stages, **best = NULL;
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->cap >= need && (!best || (*pp)->cap < (*best)->cap))
      best = pp;
  if (best) {
    cu_stage_t *s = *best;
    *best = s->next;
    s->next = NULL;
    be->stages_out++;
    be->big_out += s->cap > CU_STAGE_MIN;
    return s;
  }
  /* Every step but the one-shot path's fits a pooled buffer (CU_STAGE_MIN),
   * made at start: wait for one to come back rather than allocate. */
  if (be->started && need <= CU_STAGE_MIN)
    return NULL;
  /* Warm-up (or a larger step than ever before): a new pinned buffer. Smaller
   * free ones stay while under the cap: freeing pinned memory may wait for
   * the device. */
  size_t cap = CU_STAGE_MIN;
  while (cap < need)
    cap <<= 1;
  if (!force && be->pinned_bytes + cap > be->pinned_max) {
    size_t free_total = 0;
    for (cu_stage_t *f = be->free_stages; f; f = f->next)
      if (f->cap > CU_STAGE_MIN) /* what stage_free_unused would free */
        free_total += f->cap;
    if (be->pinned_bytes - free_total + cap > be->pinned_max && be->big_out > 0)
      return NULL; /* wait for running one-shot jobs to return theirs */
    stage_free_unused(be);
  }
  /* Off the loop from CU_ASYNC_ALLOC_MIN, or from --cuda-hostfn-min where
   * that is lower (the large steps; 0 in the tests, which so run this path). */
  const size_t amin = be->hostfn_min < CU_ASYNC_ALLOC_MIN ? be->hostfn_min : CU_ASYNC_ALLOC_MIN;
  if (!force && cap >= amin) {
    if (be->stage_alloc_err) {
      /* The allocation started for this taker failed: its job fails. */
      *cerr = be->stage_alloc_err;
      be->stage_alloc_err = 0;
      return NULL;
    }
    if (be->stage_alloc_inflight || alloc_start(be, cap) == 0)
      return NULL; /* wait: alloc_done pumps the waiting jobs */
  }
  cu_stage_t *s = calloc(1, sizeof(*s));
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
  if (owned_add(be, s) != 0) {
    cudaFreeHost(s->p);
    free(s);
    *cerr = cudaErrorMemoryAllocation;
    return NULL;
  }
  s->cap = cap;
  be->pinned_bytes += cap;
  be->stages_out++;
  be->big_out += cap > CU_STAGE_MIN;
  return s;
}

void attnd_cu_stage_put(cu_backend_t *be, cu_stage_t *s) {
  if (!s)
    return;
  be->stages_out--;
  be->big_out -= s->cap > CU_STAGE_MIN;
  s->next = be->free_stages;
  be->free_stages = s;
}

/* ---- pinned request frames ----
 *
 * A frame buffer is one pinned CU_STAGE_MIN allocation made at start; its
 * cu_stage_t sits in the first CU_ALIGN bytes, the body after them (so the
 * body keeps CU_ALIGN alignment). Only frames of at least hostfn_min bytes
 * (whose staging copy is worth skipping) that fit one are pinned. */

void *attnd_cu_frame_alloc(attnd_backend_t *base, size_t len) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (len < be->hostfn_min || len + CU_ALIGN > CU_STAGE_MIN || atomic_load(&be->dead))
    return NULL;
  /* Only the frames made at start (attnd_cu_frames_create): none is pinned
   * while serving, and a larger body or output goes through the ring. */
  cu_stage_t *s = be->free_frames;
  if (!s)
    return NULL;
  be->free_frames = s->next;
  s->next = NULL;
  be->frames_out++;
  memcpy(s->p, &s, sizeof(s));
  return s->p + CU_ALIGN;
}

int attnd_cu_frames_create(cu_backend_t *be, char *err, size_t errlen) {
  if (be->hostfn_min + CU_ALIGN > CU_STAGE_MIN)
    return 0; /* no frame could qualify */
  for (int i = 0; i < CU_FRAMES; i++) {
    cu_stage_t *s = attnd_xcalloc(1, sizeof(*s));
    cudaError_t e = cudaHostAlloc((void **)&s->p, CU_STAGE_MIN, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      free(s);
      snprintf(err, errlen, "cudaHostAlloc (pinned frames): %s", cudaGetErrorString(e));
      return ATTND_ECUDA;
    }
    s->cap = CU_STAGE_MIN;
    be->frame_bytes += s->cap;
    s->next = be->free_frames;
    be->free_frames = s;
  }
  return 0;
}

void attnd_cu_frame_free(attnd_backend_t *base, void *p) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (!p)
    return;
  cu_stage_t *s;
  memcpy(&s, (uint8_t *)p - CU_ALIGN, sizeof(s));
  be->frames_out--;
  s->next = be->free_frames;
  be->free_frames = s;
}

void attnd_cu_frames_release(cu_backend_t *be) {
  for (cu_stage_t *f = be->free_frames, *next; f; f = next) {
    next = f->next;
    be->frame_bytes -= f->cap;
    cudaFreeHost(f->p);
    free(f);
  }
  be->free_frames = NULL;
  if (be->frames_out)
    fprintf(stderr, "attnd: cuda backend destroyed with %d request frames out\n", be->frames_out);
}

cudaError_t attnd_cu_dev_reserve(cu_stream_t *cs, void **buf, size_t *cap, size_t need,
                                 size_t min) {
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

/* Runs on a CUDA-owned thread, in stream order before the H2D copy of the
 * run's inputs: the one host copy of q, k and v. No CUDA calls allowed here. */
void CUDART_CB attnd_cu_stage_inputs_fn(void *arg) {
  cu_run_t *r = arg;
  const attnd_job_t *job = r->job;
  uint8_t *hp = r->stage->p;
  if (job->q_bytes)
    memcpy(hp + r->q_off, job->batch.q, job->q_bytes);
  if (job->kv_bytes) {
    memcpy(hp + r->k_off, job->batch.k, job->kv_bytes);
    memcpy(hp + r->v_off, job->batch.v, job->kv_bytes);
  }
}

#endif /* ATTND_HAVE_CUDA */

/* cuda_stage.c: the CUDA backend's staging (internal.h).
 *
 * Pinned host buffers come from a pool made at start: two of CU_STAGE_MIN
 * per stream, for every step that fits one (larger ones go through the ring,
 * cuda_ring.c); with all of them out, a job waits for one a running job
 * gives back. Request frames and step outputs come from one pinned region
 * made at start (below). Nothing here allocates while serving (an allocation then holds the
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

cu_stage_t *attnd_cu_stage_get_pref(cu_backend_t *be, size_t need, const uint8_t *const *pref,
                                    int npref, int *cerr) {
  for (int i = 0; i < npref; i++)
    for (cu_stage_t **pp = &be->free_stages; *pp; pp = &(*pp)->next)
      if ((*pp)->p == pref[i] && (*pp)->cap >= need) {
        cu_stage_t *s = *pp;
        *pp = s->next;
        s->next = NULL;
        be->stages_out++;
        be->big_out += s->cap > CU_STAGE_MIN;
        *cerr = cudaSuccess;
        return s;
      }
  return attnd_cu_stage_get(be, need, 0, cerr);
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
 * One pinned region made at start (--cuda-frame-pool), carved first-fit:
 * every block starts with a CU_ALIGN-byte header (its size, a tag), the
 * body after it (so the body keeps CU_ALIGN alignment); a free extent keeps
 * its size and the next free extent in its own first bytes, the list sorted
 * by address so that a freed block merges with its neighbours. Only bodies
 * of at least hostfn_min bytes (whose staging copy is worth skipping) are
 * pinned; when none fits, the caller uses plain memory (and the step its
 * staging copy). A few free extents at most: the walk is short. */

#define FRAME_TAG 0x6672616d65ull /* "frame" */

typedef struct frame_ext_s {
  size_t size; /* bytes, header included */
  struct frame_ext_s *next;
} frame_ext_t;

typedef struct {
  size_t size;
  uint64_t tag;
} frame_hdr_t;

_Static_assert(sizeof(frame_ext_t) <= CU_ALIGN && sizeof(frame_hdr_t) <= CU_ALIGN,
               "frame headers fit CU_ALIGN");

void *attnd_cu_frame_alloc(attnd_backend_t *base, size_t len) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (len < be->hostfn_min || !be->frames_h || atomic_load(&be->dead) || len > be->frame_bytes)
    return NULL;
  const size_t need = CU_ALIGN + attnd_cu_align_up(len ? len : 1);
  uint8_t *blk = NULL;
  uv_mutex_lock(&be->fmu);
  for (frame_ext_t **pp = (frame_ext_t **)&be->frames_free; *pp; pp = &(*pp)->next) {
    frame_ext_t *f = *pp;
    if (f->size < need)
      continue;
    if (f->size - need < 2 * CU_ALIGN) {
      *pp = f->next; /* the whole extent: what is left would hold nothing */
      blk = (uint8_t *)f;
      ((frame_hdr_t *)blk)->size = f->size;
    } else {
      f->size -= need; /* the extent's tail: the list keeps its order */
      blk = (uint8_t *)f + f->size;
      ((frame_hdr_t *)blk)->size = need;
    }
    break;
  }
  if (blk) {
    ((frame_hdr_t *)blk)->tag = FRAME_TAG;
    be->frames_out++;
    be->frames_inuse += ((frame_hdr_t *)blk)->size;
  }
  uv_mutex_unlock(&be->fmu);
  return blk ? blk + CU_ALIGN : NULL;
}

int attnd_cu_frames_create(cu_backend_t *be, char *err, size_t errlen) {
  size_t room = be->pinned_max > be->pinned_bytes ? be->pinned_max - be->pinned_bytes : 0;
  size_t n = be->frame_want;
  if (!n) {
    /* 1/16 of host memory, at most CU_FRAMES_DEFAULT, and half of what the
     * pinned cap leaves (the ring takes from the rest). */
    uint64_t ram = uv_get_total_memory();
    n = (size_t)(ram / 16 < CU_FRAMES_DEFAULT ? ram / 16 : CU_FRAMES_DEFAULT);
    if (n > room / 2)
      n = room / 2;
    if (n < CU_FRAMES_MIN)
      n = CU_FRAMES_MIN; /* the floor holds even under a tiny cap */
  } else if (n < CU_FRAMES_MIN) {
    snprintf(err, errlen, "--cuda-frame-pool %zu is below its least size, %zu", n, CU_FRAMES_MIN);
    return ATTND_EINVAL;
  } else if (n > room) {
    snprintf(err, errlen,
             "--cuda-frame-pool %zu does not fit the pinned cap of %zu (--cuda-pinned-max) "
             "beside the %zu bytes of pooled staging",
             n, be->pinned_max, be->pinned_bytes);
    return ATTND_EINVAL;
  }
  n &= ~(CU_ALIGN - 1);
  cudaError_t e = cudaHostAlloc((void **)&be->frames_h, n, cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    be->frames_h = NULL;
    snprintf(err, errlen, "cudaHostAlloc of the %zu-byte frame pool (--cuda-frame-pool): %s", n,
             cudaGetErrorString(e));
    return ATTND_ENOMEM;
  }
  /* Blocks at CU_ALIGN multiples from an aligned start (a device's pinned
   * memory is page-aligned; the test's stand-in need not be). */
  size_t lead = (CU_ALIGN - (uintptr_t)be->frames_h % CU_ALIGN) % CU_ALIGN;
  frame_ext_t *f = (frame_ext_t *)(be->frames_h + lead);
  f->size = n - (lead ? CU_ALIGN : 0);
  f->next = NULL;
  be->frames_free = f;
  be->frame_bytes = n;
  be->pinned_bytes += n; /* within the cap: the ring's room is what is left */
  return 0;
}

void attnd_cu_frame_free(attnd_backend_t *base, void *p) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (!p)
    return;
  uint8_t *blk = (uint8_t *)p - CU_ALIGN;
  frame_hdr_t *h = (frame_hdr_t *)blk;
  if (blk < be->frames_h || blk >= be->frames_h + be->frame_bytes || h->tag != FRAME_TAG)
    abort(); /* not host_alloc's: freeing it would corrupt the pool */
  size_t size = h->size;
  h->tag = 0;
  uv_mutex_lock(&be->fmu);
  be->frames_out--;
  be->frames_inuse -= size;
  frame_ext_t *prev = NULL, *next = be->frames_free;
  while (next && (uint8_t *)next < blk) {
    prev = next;
    next = next->next;
  }
  frame_ext_t *f = (frame_ext_t *)blk;
  f->size = size;
  f->next = next;
  if (next && blk + size == (uint8_t *)next) {
    f->size += next->size;
    f->next = next->next;
  }
  if (prev && (uint8_t *)prev + prev->size == blk) {
    prev->size += f->size;
    prev->next = f->next;
  } else if (prev) {
    prev->next = f;
  } else {
    be->frames_free = f;
  }
  uv_mutex_unlock(&be->fmu);
}

void attnd_cu_frames_release(cu_backend_t *be) {
  if (be->frames_out)
    fprintf(stderr, "attnd: cuda backend destroyed with %d request frames out\n", be->frames_out);
  if (be->frames_h) {
    cudaFreeHost(be->frames_h);
    be->pinned_bytes -= be->frame_bytes;
  }
  be->frames_h = NULL;
  be->frames_free = NULL;
  be->frame_bytes = 0;
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
  atomic_fetch_add(&r->be->staged_bytes, job->q_bytes + 2 * job->kv_bytes);
  if (job->q_bytes)
    memcpy(hp + r->q_off, job->batch.q, job->q_bytes);
  if (job->kv_bytes) {
    memcpy(hp + r->k_off, job->batch.k, job->kv_bytes);
    memcpy(hp + r->v_off, job->batch.v, job->kv_bytes);
  }
}

#endif /* ATTND_HAVE_CUDA */

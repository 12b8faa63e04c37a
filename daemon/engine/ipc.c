/* ipc.c: same-host zero-copy, the engine's part (engine.h
 * attnd_engine_ipc_open / _close; docs/protocol.md).
 *
 * A client on the daemon's host shares device memory with
 * cudaIpcGetMemHandle and registers it; the backend maps it (ipc_open) on a
 * worker thread, since opening a handle takes about a millisecond. The
 * driver maps a given allocation once per process, and one allocation
 * (a caching allocator's segment) often holds several of a client's
 * tensors, so mappings are kept here by handle bytes and counted: a second
 * registration of the same handle shares the first's mapping, and one that
 * arrives while the first is still opening waits for it. The last
 * reference unmaps it (ipc_close, worker thread again). The device check of
 * a step's tensors is a backend job (CHECK) that the admission queue waits
 * for (queue.c). Everything here but the two work functions runs on the
 * loop thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct ipc_waiter_s {
  attnd_engine_done_cb cb;
  void *arg;
  struct ipc_waiter_s *next;
} ipc_waiter_t;

/* One mapped allocation. The engine keeps them in a list (e->ipc_maps):
 * a client registers a handful of allocations, not thousands. */
typedef struct ipc_map_s {
  uv_work_t work;
  attnd_engine_t *e;
  uint8_t handle[64];
  void *base;    /* device address, once open */
  size_t size;   /* the allocation's bytes */
  uint32_t refs; /* registrations holding it */
  int open;      /* mapped; 0 while opening */
  int rc;        /* the open's outcome */
  char err[160];
  ipc_waiter_t *waiters; /* registrations waiting for the open */
  struct ipc_map_s *next;
} ipc_map_t;

/* "GPU-ABC..." and "abc..." name the same device: the prefix is optional
 * and case does not matter (torch prints the bare UUID, nvidia-smi the
 * prefixed one). */
static int same_device(const char *a, const char *b) {
  if (strncasecmp(a, "GPU-", 4) == 0)
    a += 4;
  if (strncasecmp(b, "GPU-", 4) == 0)
    b += 4;
  return a[0] && strcasecmp(a, b) == 0;
}

static void answer_open(ipc_map_t *m, attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  if (m->rc) {
    r.status = m->rc;
    snprintf(r.message, sizeof(r.message), "%s", m->err);
  } else {
    m->refs++;
    r.ipc = m;
    r.ipc_base = m->base;
    r.ipc_size = m->size;
  }
  cb(arg, &r);
}

static void open_work(uv_work_t *w) {
  ipc_map_t *m = (ipc_map_t *)w;
  attnd_backend_t *be = m->e->be;
  m->rc = be->ops->ipc_open(be, m->handle, &m->base, &m->size, m->err, sizeof(m->err));
}

static void unlink_map(attnd_engine_t *e, ipc_map_t *m) {
  for (ipc_map_t **pp = &e->ipc_maps; *pp; pp = &(*pp)->next)
    if (*pp == m) {
      *pp = m->next;
      return;
    }
}

static void open_done(uv_work_t *w, int status) {
  ipc_map_t *m = (ipc_map_t *)w;
  attnd_engine_t *e = m->e;
  if (status != 0 && !m->rc) {
    m->rc = ATTND_EINTERNAL;
    snprintf(m->err, sizeof(m->err), "the handle's open did not run");
  }
  m->open = m->rc == 0;
  ipc_waiter_t *wt = m->waiters;
  m->waiters = NULL;
  if (m->rc)
    unlink_map(e, m); /* no later registration finds a failed one */
  while (wt) {
    ipc_waiter_t *next = wt->next;
    answer_open(m, wt->cb, wt->arg);
    free(wt);
    wt = next;
  }
  if (m->rc)
    free(m);
  e->pending--;
  attnd_engine_maybe_finish_close(e);
}

void attnd_engine_ipc_open(attnd_engine_t *e, const uint8_t handle[64], uint64_t size,
                           const char *device_uuid, attnd_engine_done_cb cb, void *arg) {
  if (e->closing) {
    attnd_engine_answer(cb, arg, ATTND_EUNAVAIL, "the engine is closing");
    return;
  }
  attnd_backend_t *be = e->be;
  if (!be->ops->ipc_open) {
    attnd_engine_answer(cb, arg, ATTND_EPRECOND,
                        "the %s backend cannot use client device memory: send tensors as bytes",
                        be->ops->name);
    return;
  }
  if (!same_device(device_uuid, be->device_uuid)) {
    attnd_engine_answer(cb, arg, ATTND_EPRECOND,
                        "the buffer is on device %.60s, the daemon runs on %.60s: send tensors "
                        "as bytes",
                        device_uuid[0] ? device_uuid : "(none given)", be->device_uuid);
    return;
  }
  if (size == 0) {
    attnd_engine_answer(cb, arg, ATTND_EINVAL, "register_buffer: size 0");
    return;
  }
  for (ipc_map_t *m = e->ipc_maps; m; m = m->next) {
    if (memcmp(m->handle, handle, 64) != 0)
      continue;
    if (m->open) {
      answer_open(m, cb, arg);
      return;
    }
    ipc_waiter_t *wt = attnd_xcalloc(1, sizeof(*wt));
    wt->cb = cb;
    wt->arg = arg;
    wt->next = m->waiters;
    m->waiters = wt;
    return;
  }
  ipc_map_t *m = attnd_xcalloc(1, sizeof(*m));
  m->e = e;
  memcpy(m->handle, handle, 64);
  m->waiters = attnd_xcalloc(1, sizeof(*m->waiters));
  m->waiters->cb = cb;
  m->waiters->arg = arg;
  m->next = e->ipc_maps;
  e->ipc_maps = m;
  e->pending++;
  if (uv_queue_work(e->loop, &m->work, open_work, open_done) != 0) {
    m->rc = ATTND_EINTERNAL;
    snprintf(m->err, sizeof(m->err), "cannot queue the handle's open");
    open_done(&m->work, 0);
  }
}

static void close_work(uv_work_t *w) {
  ipc_map_t *m = (ipc_map_t *)w;
  m->e->be->ops->ipc_close(m->e->be, m->base);
}

static void close_done(uv_work_t *w, int status) {
  ipc_map_t *m = (ipc_map_t *)w;
  attnd_engine_t *e = m->e;
  free(m);
  e->pending--;
  attnd_engine_maybe_finish_close(e);
}

void attnd_engine_ipc_close(attnd_engine_t *e, void *ipc) {
  ipc_map_t *m = ipc;
  if (!m || --m->refs > 0)
    return;
  unlink_map(e, m);
  e->pending++;
  if (uv_queue_work(e->loop, &m->work, close_work, close_done) != 0) {
    close_work(&m->work); /* cannot happen with valid arguments */
    close_done(&m->work, 0);
  }
}

/* The device check of a step over client memory: scan.c's rule and
 * bounds, as a CHECK job (backend.h) over the device pointers themselves,
 * submitted from the loop thread and completed like a step (no thread waits
 * for it). */
typedef struct {
  attnd_job_t job;
  const attnd_step_req_t *req;
  attnd_scan_t *sc;
  void (*done)(void *arg);
  void *arg;
} ipc_check_t;

static void fill_job(attnd_engine_t *e, const attnd_step_req_t *req, attnd_job_t *job) {
  const attnd_kshape_t *sh = &e->shape;
  attnd_scan_bound_t b[3];
  attnd_scan_bounds(sh, &b[0], &b[1], &b[2]);
  const attnd_tensor_t *t[3] = {&req->q, &req->k, &req->v};
  size_t row_elems[3] = {(size_t)sh->q_heads * sh->head_dim, (size_t)sh->kv_heads * sh->head_dim,
                         (size_t)sh->kv_heads * sh->head_dim};
  job->kind = ATTND_JOB_CHECK;
  job->layer = (int)req->layer; /* its layer's stream: beside other layers' work */
  job->unordered = 1;           /* it reads client memory only */
  for (int i = 0; i < 3; i++) {
    /* A tensor that is absent or of another dtype or shape is left
     * unchecked: the step fails on its shape first. */
    size_t rb = row_elems[i] * 2;
    int ok = t[i]->present && t[i]->data && t[i]->nbytes && t[i]->dtype == sh->dtype &&
             t[i]->nbytes % rb == 0;
    job->check.p[i] = ok ? t[i]->data : NULL;
    job->check.rows[i] = ok ? t[i]->nbytes / rb : 0;
    job->check.row_elems[i] = (uint32_t)row_elems[i];
    job->check.bound[i] = b[i].bits;
  }
}

/* The job's result as the step's scan: the views are the device pointers
 * themselves (nothing is copied); err the job's status. */
static void fill_scan(const attnd_job_t *job, const attnd_step_req_t *req, attnd_scan_t *sc) {
  memset(sc, 0, sizeof(*sc));
  sc->q = req->q.present ? req->q.data : NULL;
  sc->k = req->k.present ? req->k.data : NULL;
  sc->v = req->v.present ? req->v.data : NULL;
  sc->err = job->status;
  sc->bad_q = job->status ? SIZE_MAX : job->check.bad[0];
  sc->bad_k = job->status ? SIZE_MAX : job->check.bad[1];
  sc->bad_v = job->status ? SIZE_MAX : job->check.bad[2];
  sc->bits_q = job->check.bits[0];
  sc->bits_k = job->check.bits[1];
  sc->bits_v = job->check.bits[2];
  sc->us = job->t_end_us > job->t_submit_us ? (uint32_t)(job->t_end_us - job->t_submit_us) : 0;
}

static void check_job_done(attnd_job_t *job) {
  ipc_check_t *k = (ipc_check_t *)job;
  fill_scan(job, k->req, k->sc);
  void (*done)(void *) = k->done;
  void *arg = k->arg;
  free(k);
  done(arg);
}

int attnd_ipc_check_start(attnd_engine_t *e, const attnd_step_req_t *req, attnd_scan_t *sc,
                          void (*done)(void *arg), void *arg) {
  ipc_check_t *k = attnd_xcalloc(1, sizeof(*k));
  k->req = req;
  k->sc = sc;
  k->done = done;
  k->arg = arg;
  fill_job(e, req, &k->job);
  k->job.done_cb = check_job_done;
  int rc = e->be->ops->submit(e->be, &k->job);
  if (rc) {
    k->job.status = rc;
    fill_scan(&k->job, req, sc);
    free(k);
  }
  return rc;
}

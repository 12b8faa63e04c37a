/* queue.c: the engine's public entry points and its admission queue
 * (engine.h, internal.h; docs/sessions.md).
 *
 * Admission runs on the loop thread. A call is validated completely before
 * anything changes (all-or-nothing): the checks run first, then the blocks it
 * needs are counted and, if the pool (free plus evictable) cannot supply them,
 * the call fails with RESOURCE_EXHAUSTED; only then does it commit (allocate,
 * copy-on-write, move len, publish) and submit its jobs.
 *
 * Admission queue. A Step must be rejected before it changes anything when
 * its q, k or v hold a NaN or an infinity, and the scan for them is a linear
 * pass over the tensors (about 20 ms for the 100 MB of an 8k-token prefill),
 * too long for the loop thread. So a Step whose tensors
 * exceed offload_bytes (--engine-offload-bytes) is scanned on the libuv
 * threadpool first, together with the aligned copy of tensors decoded at odd
 * addresses; the scan reads only the request's bytes and records the first
 * row of each tensor holding a non-finite value. Meanwhile the call waits in
 * an engine-wide FIFO of calls not yet admitted, and while that FIFO is not
 * empty every later mutating call (any kind, any session, conn_closed too)
 * waits behind it: calls are still admitted one by one in arrival order, on
 * the loop thread, with every stateful check made at admission exactly as on
 * the direct path, which maps the recorded rows to the item they fall in.
 * With an empty FIFO a small call (every decode step) is admitted at once,
 * scan included, with no extra latency. Stateless refusals (a layer out of
 * range, a plan and inline items together, a salt too long) are answered at
 * arrival: they change nothing, whatever runs before them. A scan cannot be
 * cancelled once started, so a queued call counts as pending work and
 * attnd_engine_close waits for it to be admitted (it arrived before the close).
 *
 * SetScales with persistence on always goes through the queue: at its head
 * (everything before it admitted) it is checked, the table as it will be is
 * written to the state file on the threadpool while the call keeps the head,
 * and only then is it admitted: applied, or, when the file could not be
 * written, answered INTERNAL having changed nothing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum {
  CALL_OPEN = 0,
  CALL_CLOSE,
  CALL_FORK,
  CALL_TRUNCATE,
  CALL_PLAN,
  CALL_STEP,
  CALL_SCALES,
  CALL_SINKS,
  CALL_CONN_CLOSED,
};

/* A mutating call waiting in the admission queue, with what it needs to be
 * admitted later. Pointers inside requests stay the caller's (engine.h: valid
 * until the done callback); what the caller may reuse at once (the request
 * structs and the salt) is copied. */
typedef struct call_s call_t;
struct call_s {
  uv_work_t work; /* the scan of a large step, or a SetScales's file write */
  attnd_engine_t *e;
  attnd_list_t link; /* the admission queue */
  int kind;
  int scanning; /* the scan has not reported back: the call cannot be admitted yet */
  int scanned;  /* scan holds the result (a large step) */
  uint64_t identity, conn, session;
  uint32_t len;           /* Truncate */
  uint32_t base;          /* OpenSession */
  const uint32_t *tokens; /* OpenSession */
  uint32_t ntokens;
  uint8_t salt[ATTND_PREFIX_MAX_SALT];
  size_t saltlen;
  const attnd_item_t *items; /* Plan */
  uint32_t nitems;
  attnd_step_req_t step;
  attnd_scales_req_t scales;
  attnd_sinks_req_t sinks;
  int answered;   /* refused before its admission (a SetScales's checks) */
  int persisting; /* SetScales: its checks ran at the head of the queue */
  int persist_rc; /* and how it went */
  uint8_t *persist_buf;
  size_t persist_len;
  attnd_scan_t scan;
  attnd_engine_done_cb cb;
  void *arg;
};

static int check_open(attnd_engine_t *e, attnd_engine_done_cb cb, void *arg) {
  if (e->closing) {
    attnd_engine_answer(cb, arg, ATTND_EUNAVAIL, "the engine is closing");
    return 0;
  }
  return 1;
}

static call_t *call_new(attnd_engine_t *e, int kind, uint64_t identity, attnd_engine_done_cb cb,
                        void *arg) {
  call_t *c = attnd_xcalloc(1, sizeof(*c));
  c->e = e;
  c->kind = kind;
  c->identity = identity;
  c->cb = cb;
  c->arg = arg;
  return c;
}

static void queue_pump(attnd_engine_t *e);

static void call_admit(attnd_engine_t *e, call_t *c) {
  switch (c->kind) {
  case CALL_OPEN:
    attnd_session_open(e, c->identity, c->base, c->tokens, c->ntokens, c->salt, c->saltlen, c->cb,
                       c->arg);
    break;
  case CALL_CLOSE:
    attnd_session_close(e, c->identity, c->session, c->cb, c->arg);
    break;
  case CALL_FORK:
    attnd_session_fork(e, c->identity, c->session, c->cb, c->arg);
    break;
  case CALL_TRUNCATE:
    attnd_session_truncate(e, c->identity, c->session, c->len, c->cb, c->arg);
    break;
  case CALL_PLAN:
    attnd_plan_admit(e, c->identity, c->conn, c->items, c->nitems, c->cb, c->arg);
    break;
  case CALL_STEP:
    attnd_step_admit(e, c->identity, c->conn, &c->step, c->cb, c->arg,
                     c->scanned ? &c->scan : NULL);
    break;
  case CALL_SCALES:
    free(c->persist_buf);
    if (c->persist_rc)
      attnd_engine_answer(c->cb, c->arg, ATTND_EINTERNAL,
                          "scales not persisted to %.120s (%s): nothing changed", e->sc.path,
                          attnd_strerror(c->persist_rc));
    else
      attnd_scales_commit(e, &c->scales, c->cb, c->arg);
    break;
  case CALL_SINKS:
    free(c->persist_buf);
    if (c->persist_rc)
      attnd_engine_answer(c->cb, c->arg, ATTND_EINTERNAL,
                          "sinks not persisted to %.120s (%s): nothing changed", e->sk.path,
                          attnd_strerror(c->persist_rc));
    else
      attnd_sinks_commit(e, &c->sinks, c->cb, c->arg);
    break;
  case CALL_CONN_CLOSED:
    attnd_plan_conn_closed(e, c->conn);
    break;
  }
}

static void persist_work(uv_work_t *w) {
  call_t *c = (call_t *)w;
  const char *path = c->kind == CALL_SINKS ? c->e->sk.path : c->e->sc.path;
  c->persist_rc = attnd_scales_write_file(path, c->persist_buf, c->persist_len);
}

static void persist_done(uv_work_t *w, int status) {
  call_t *c = (call_t *)w;
  if (status != 0 && !c->persist_rc)
    c->persist_rc = ATTND_EINTERNAL;
  c->scanning = 0;
  queue_pump(c->e);
}

/* A SetScales reaching the head of the queue: everything before it is
 * admitted, so its checks see the state it will change. When they pass, the
 * table as the call leaves it is written first (worker pool) while the call
 * holds the head, so no later call is admitted before the scales are on disk;
 * only then does the admission apply them. 1 when the call now waits for its
 * write; 0 when it can be admitted (or was answered: c->answered). */
static int scales_start(attnd_engine_t *e, call_t *c) {
  char msg[200];
  const int sinks = c->kind == CALL_SINKS; /* SetSinks: the same steps, sinks.c's */
  c->persisting = 1;
  int rc = sinks ? attnd_sinks_check(e, &c->sinks, msg, sizeof(msg))
                 : attnd_scales_check(e, &c->scales, msg, sizeof(msg));
  if (rc) {
    attnd_engine_answer(c->cb, c->arg, rc, "%s", msg);
    c->answered = 1;
    return 0;
  }
  if (!(sinks ? e->sk.path : e->sc.path)[0])
    return 0;
  rc = sinks ? attnd_sinks_snapshot(e, &c->sinks, &c->persist_buf, &c->persist_len)
             : attnd_scales_snapshot(e, &c->scales, &c->persist_buf, &c->persist_len);
  if (rc != 0) {
    c->persist_rc = rc;
    return 0;
  }
  c->scanning = 1;
  if (uv_queue_work(e->loop, &c->work, persist_work, persist_done) != 0) {
    c->scanning = 0; /* cannot happen with valid arguments: fail the call */
    c->persist_rc = ATTND_EINTERNAL;
    return 0;
  }
  return 1;
}

/* Admits queued calls from the head while the head's scan is done. A call's
 * callback may make new calls: they queue behind what is left (or, with the
 * queue empty, run at once), and this loop admits them in turn. */
static void queue_pump(attnd_engine_t *e) {
  if (e->admitting)
    return;
  e->admitting = 1;
  attnd_list_t *first;
  while ((first = attnd_list_first(&e->queue)) != NULL) {
    call_t *c = ATTND_LIST_DATA(first, call_t, link);
    if ((c->kind == CALL_SCALES || c->kind == CALL_SINKS) && !c->persisting && scales_start(e, c))
      break;
    if (c->scanning)
      break;
    attnd_list_remove(&c->link);
    e->nqueued--;
    if (!c->answered)
      call_admit(e, c);
    free(c);
    e->pending--;
  }
  e->admitting = 0;
  attnd_engine_maybe_finish_close(e);
}

static void call_push(attnd_engine_t *e, call_t *c) {
  /* Pending until admitted: a close waits for queued calls and running scans. */
  e->pending++;
  e->nqueued++;
  attnd_list_insert_tail(&e->queue, &c->link);
  queue_pump(e);
}

static void scan_work(uv_work_t *w) {
  call_t *c = (call_t *)w;
  attnd_scan_any(c->e, &c->step, &c->scan);
}

static void scan_done(uv_work_t *w, int status) {
  call_t *c = (call_t *)w;
  /* status is UV_ECANCELED only after uv_cancel, which is never called. */
  (void)status;
  c->scanning = 0;
  queue_pump(c->e);
}

/* 1 when earlier calls wait for admission: a new call queues behind them. */
static int must_queue(attnd_engine_t *e) {
  return !attnd_list_empty(&e->queue);
}

int attnd_queue_busy(const attnd_engine_t *e) {
  return !attnd_list_empty(&e->queue);
}

void attnd_engine_open_session(attnd_engine_t *e, uint64_t identity, const uint32_t *tokens,
                               uint32_t ntokens, const uint8_t *salt, size_t saltlen,
                               attnd_engine_done_cb cb, void *arg) {
  attnd_engine_open_session_at(e, identity, 0, tokens, ntokens, salt, saltlen, cb, arg);
}

void attnd_engine_open_session_at(attnd_engine_t *e, uint64_t identity, uint32_t base,
                                  const uint32_t *tokens, uint32_t ntokens, const uint8_t *salt,
                                  size_t saltlen, attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (base >= (uint32_t)e->cfg.max_context) {
    attnd_engine_answer(cb, arg, ATTND_ERANGE, "base %u >= max_context %d", base,
                        e->cfg.max_context);
    return;
  }
  if (saltlen > ATTND_PREFIX_MAX_SALT) {
    attnd_engine_answer(cb, arg, ATTND_EINVAL, "salt is %zu bytes, at most %d", saltlen,
                        ATTND_PREFIX_MAX_SALT);
    return;
  }
  if (!must_queue(e)) {
    attnd_session_open(e, identity, base, tokens, ntokens, salt, saltlen, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_OPEN, identity, cb, arg);
  c->base = base;
  c->tokens = tokens;
  c->ntokens = ntokens;
  c->saltlen = saltlen;
  if (saltlen)
    memcpy(c->salt, salt, saltlen);
  call_push(e, c);
}

void attnd_engine_close_session(attnd_engine_t *e, uint64_t identity, uint64_t session,
                                attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    attnd_session_close(e, identity, session, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_CLOSE, identity, cb, arg);
  c->session = session;
  call_push(e, c);
}

void attnd_engine_fork(attnd_engine_t *e, uint64_t identity, uint64_t session,
                       attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    attnd_session_fork(e, identity, session, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_FORK, identity, cb, arg);
  c->session = session;
  call_push(e, c);
}

void attnd_engine_truncate(attnd_engine_t *e, uint64_t identity, uint64_t session, uint32_t len,
                           attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    attnd_session_truncate(e, identity, session, len, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_TRUNCATE, identity, cb, arg);
  c->session = session;
  c->len = len;
  call_push(e, c);
}

void attnd_engine_plan(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                       void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    attnd_plan_admit(e, identity, conn, items, nitems, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_PLAN, identity, cb, arg);
  c->conn = conn;
  c->items = items;
  c->nitems = nitems;
  call_push(e, c);
}

static size_t tensor_bytes(const attnd_tensor_t *t) {
  return t->present && t->data ? t->nbytes : 0;
}

void attnd_engine_step(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (req->layer >= (uint32_t)e->layers) {
    attnd_engine_answer(cb, arg, ATTND_EINVAL, "layer %u >= layers %d", req->layer, e->layers);
    return;
  }
  if (req->plan && req->nitems) {
    attnd_engine_answer(cb, arg, ATTND_EINVAL, "a step names a plan or carries items, not both");
    return;
  }
  size_t bytes = tensor_bytes(&req->q) + tensor_bytes(&req->k) + tensor_bytes(&req->v);
  /* Tensors in client device memory are checked on the device, and that
   * check is awaited off the loop thread like a large step's scan. */
  int large = bytes > e->offload_bytes || req->device;
  if (!large && !must_queue(e)) {
    attnd_step_admit(e, identity, conn, req, cb, arg, NULL);
    return;
  }
  call_t *c = call_new(e, CALL_STEP, identity, cb, arg);
  c->conn = conn;
  c->step = *req;
  if (large) {
    c->scanned = 1;
    c->scanning = 1;
    if (uv_queue_work(e->loop, &c->work, scan_work, scan_done) != 0) {
      /* Cannot happen with valid arguments; scan here rather than fail. */
      attnd_scan_any(e, &c->step, &c->scan);
      c->scanning = 0;
    }
  }
  call_push(e, c);
}

void attnd_engine_set_scales(attnd_engine_t *e, const attnd_scales_req_t *req,
                             attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e) && !e->sc.path[0]) {
    /* Nothing to persist: checked and applied at once. */
    char msg[200];
    int rc = attnd_scales_check(e, req, msg, sizeof(msg));
    if (rc)
      attnd_engine_answer(cb, arg, rc, "%s", msg);
    else
      attnd_scales_commit(e, req, cb, arg);
    return;
  }
  /* Through the queue, even when it is empty: the file is written while the
   * call holds the queue's head (scales_start). */
  call_t *c = call_new(e, CALL_SCALES, 0, cb, arg);
  c->scales = *req;
  call_push(e, c);
}

void attnd_engine_set_sinks(attnd_engine_t *e, const attnd_sinks_req_t *req,
                            attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e) && !e->sk.path[0]) {
    char msg[200];
    int rc = attnd_sinks_check(e, req, msg, sizeof(msg));
    if (rc)
      attnd_engine_answer(cb, arg, rc, "%s", msg);
    else
      attnd_sinks_commit(e, req, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_SINKS, 0, cb, arg);
  c->sinks = *req;
  call_push(e, c);
}

void *attnd_engine_host_alloc(attnd_engine_t *e, size_t len, int *pinned) {
  *pinned = 0;
  if (e->be->ops->host_alloc) {
    void *p = e->be->ops->host_alloc(e->be, len);
    if (p) {
      *pinned = 1;
      return p;
    }
  }
  /* Outputs keep the alignment the kernels' vector stores like. */
  return aligned_alloc(64, (len + 63) & ~(size_t)63);
}

void attnd_engine_host_free(attnd_engine_t *e, void *p, int pinned) {
  if (pinned)
    e->be->ops->host_free(e->be, p);
  else
    free(p);
}

void attnd_engine_conn_closed(attnd_engine_t *e, uint64_t conn) {
  /* Behind queued calls, so that a queued Plan of this connection is admitted
   * first and then ends here, as it would have without the queue. */
  if (!must_queue(e)) {
    attnd_plan_conn_closed(e, conn);
    return;
  }
  call_t *c = call_new(e, CALL_CONN_CLOSED, 0, NULL, NULL);
  c->conn = conn;
  call_push(e, c);
}

void attnd_engine_set_offload_bytes(attnd_engine_t *e, size_t bytes) {
  e->offload_bytes = bytes;
}

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
 * the admission queue, and so does every later mutating call that must
 * follow it: one of the same connection, one naming a session it names, and
 * then whatever must follow those (order.c says who waits for whom). Every
 * other call is admitted at once, passing the queued ones: calls not yet
 * answered, so admitting it first is a valid serialization. Queued calls are
 * admitted one by one on the loop thread as what they wait for is admitted,
 * with every stateful check made at admission exactly as on the direct path,
 * which maps the recorded rows to the item they fall in. A small call (every
 * decode step) with nothing to wait for is admitted at once, scan included,
 * with no extra latency. Stateless refusals (a layer out of
 * range, a plan and inline items together, a salt too long) are answered at
 * arrival: they change nothing, whatever runs before them. A scan cannot be
 * cancelled once started, so a queued call counts as pending work and
 * attnd_engine_close waits for it to be admitted (it arrived before the close).
 *
 * SetScales (and SetSinks) with persistence on always goes through the queue,
 * as a barrier: once everything queued before it is admitted it is checked,
 * the table as it will be is written to the state file on the threadpool
 * while the call stays queued (every later call waits for it), and only then
 * is it admitted: applied, or, when the file could not be written, answered
 * INTERNAL having changed nothing.
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
  attnd_qnode_t q; /* its place in the admission order (q.held: its scan or write runs) */
  int kind;
  int scanned; /* scan holds the result (a large step) */
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
  int persisting; /* SetScales: its checks ran, everything queued before it admitted */
  int persist_rc; /* and how it went */
  uint8_t *persist_buf;
  size_t persist_len;
  attnd_scan_t scan;
  struct scan_part_s *parts; /* a large step's scan in parts, nparts of them */
  int nparts, parts_left;
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
  attnd_order_unhold(c->e, &c->q);
  queue_pump(c->e);
}

/* A SetScales whose turn came: everything queued before it is admitted
 * (a barrier), so its checks see the state it will change. When they pass,
 * the table as the call leaves it is written first (worker pool) while the
 * call stays queued, so no later call is admitted before the scales are on disk;
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
  c->q.held = 1;
  if (uv_queue_work(e->loop, &c->work, persist_work, persist_done) != 0) {
    c->q.held = 0; /* cannot happen with valid arguments: fail the call */
    c->persist_rc = ATTND_EINTERNAL;
    return 0;
  }
  return 1;
}

/* Admits queued calls as they become ready (order.c). A call's callback may
 * make new calls: they queue behind what they must follow (or, waiting for
 * nothing, run at once), and this loop admits them in turn. */
static void queue_pump(attnd_engine_t *e) {
  if (e->admitting)
    return;
  e->admitting = 1;
  attnd_qnode_t *n;
  while ((n = attnd_order_next(e)) != NULL) {
    call_t *c = ATTND_LIST_DATA(n, call_t, q);
    if ((c->kind == CALL_SCALES || c->kind == CALL_SINKS) && !c->persisting && scales_start(e, c))
      continue; /* held until its file is written (persist_done) */
    attnd_order_release(e, n);
    if (!c->answered)
      call_admit(e, c);
    free(c);
    e->pending--;
  }
  e->admitting = 0;
  attnd_engine_maybe_finish_close(e);
}

/* Queues c behind what its keys say it must follow; takes the keys. */
static void call_push(attnd_engine_t *e, call_t *c, attnd_qkeys_t *ks) {
  /* Pending until admitted: a close waits for queued calls and running scans. */
  e->pending++;
  attnd_order_push(e, &c->q, ks);
  queue_pump(e);
}

void (*attnd_queue_test_scan_hook)(const attnd_step_req_t *req) = NULL;

/* One part of a large step's scan on the worker pool (scan.c). */
typedef struct scan_part_s {
  uv_work_t work;
  call_t *c;
  int i;
  attnd_scan_part_t res;
} scan_part_t;

static void scan_work(uv_work_t *w) {
  call_t *c = (call_t *)w;
  if (attnd_queue_test_scan_hook)
    attnd_queue_test_scan_hook(&c->step);
  attnd_scan_step(&c->e->shape, &c->step, c->e->be->any_alignment, &c->scan);
}

static void scan_done(uv_work_t *w, int status) {
  call_t *c = (call_t *)w;
  /* status is UV_ECANCELED only after uv_cancel, which is never called. */
  (void)status;
  attnd_order_unhold(c->e, &c->q);
  queue_pump(c->e);
}

static void part_work(uv_work_t *w) {
  scan_part_t *p = (scan_part_t *)w;
  call_t *c = p->c;
  if (p->i == 0 && attnd_queue_test_scan_hook)
    attnd_queue_test_scan_hook(&c->step);
  attnd_scan_part(&c->e->shape, &c->step, &c->scan, p->i, c->nparts, &p->res);
}

/* The last part done (loop thread: no lock) merges and lets the call go. */
static void part_done(uv_work_t *w, int status) {
  call_t *c = ((scan_part_t *)w)->c;
  (void)status; /* as scan_done's */
  if (--c->parts_left > 0)
    return;
  attnd_scan_part_t res[ATTND_SCAN_MAX_PARTS];
  for (int i = 0; i < c->nparts; i++)
    res[i] = c->parts[i].res;
  attnd_scan_end(&c->scan, res, c->nparts);
  free(c->parts);
  c->parts = NULL;
  attnd_order_unhold(c->e, &c->q);
  queue_pump(c->e);
}

/* A device check done (loop thread): the step may be admitted in its turn. */
static void check_done(void *arg) {
  call_t *c = arg;
  attnd_order_unhold(c->e, &c->q);
  queue_pump(c->e);
}

/* A large step's scan, in parts on the worker pool when it is large enough
 * for them to pay (a pass over memory per part: parts on free cores divide
 * its time); the device check of a step over client memory. */
static void scan_start(attnd_engine_t *e, call_t *c) {
  if (c->step.device) {
    /* Its check is a backend job (ipc.c): the call is held until it is done. */
    c->q.held = 1;
    if (attnd_ipc_check_start(e, &c->step, &c->scan, check_done, c) != 0)
      c->q.held = 0; /* not submitted: the step fails with scan.err at admission */
    return;
  }
  int n = attnd_scan_nparts(&c->step, e->scan_parts, e->scan_part_bytes);
  c->q.held = 1;
  if (n > 1) {
    attnd_scan_begin(e, &e->shape, &c->step, e->be->any_alignment, &c->scan);
    c->parts = attnd_xcalloc((size_t)n, sizeof(*c->parts));
    c->nparts = c->parts_left = n;
    for (int i = 0; i < n; i++) {
      c->parts[i].c = c;
      c->parts[i].i = i;
      if (uv_queue_work(e->loop, &c->parts[i].work, part_work, part_done) != 0)
        abort(); /* only with invalid arguments */
    }
    return;
  }
  if (uv_queue_work(e->loop, &c->work, scan_work, scan_done) != 0) {
    /* Cannot happen with valid arguments; scan here rather than fail. */
    attnd_scan_step(&e->shape, &c->step, e->be->any_alignment, &c->scan);
    c->q.held = 0;
  }
}

/* The keys of a call of a connection naming one session (0: none). */
static void keys_conn(attnd_qkeys_t *ks, uint64_t conn, uint64_t session, int named) {
  attnd_qkeys_init(ks);
  attnd_qkeys_add(ks, ATTND_QK_CONN, conn);
  if (named)
    attnd_qkeys_add(ks, ATTND_QK_SESSION, session);
}

/* 1 (and the keys freed) when the call may be admitted at once. */
static int direct(attnd_engine_t *e, attnd_qkeys_t *ks) {
  if (attnd_order_must_wait(e, ks))
    return 0;
  attnd_qkeys_free(ks);
  return 1;
}

void attnd_engine_open_session(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                               const uint32_t *tokens, uint32_t ntokens, const uint8_t *salt,
                               size_t saltlen, attnd_engine_done_cb cb, void *arg) {
  attnd_engine_open_session_at(e, identity, conn, 0, tokens, ntokens, salt, saltlen, cb, arg);
}

/* An OpenSession follows only its connection's queued calls. It may pass a
 * queued step of another connection that would publish the prefix it looks
 * up: that is the order in which the open arrived first (neither has been
 * answered), so it finds what is published at its own admission; its blocks
 * and its session count against the pool and the quotas at its admission,
 * and the step's checks at the step's, as in that order. */
void attnd_engine_open_session_at(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                                  uint32_t base, const uint32_t *tokens, uint32_t ntokens,
                                  const uint8_t *salt, size_t saltlen, attnd_engine_done_cb cb,
                                  void *arg) {
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
  attnd_qkeys_t ks;
  keys_conn(&ks, conn, 0, 0);
  if (direct(e, &ks)) {
    attnd_session_open(e, identity, base, tokens, ntokens, salt, saltlen, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_OPEN, identity, cb, arg);
  c->conn = conn;
  c->base = base;
  c->tokens = tokens;
  c->ntokens = ntokens;
  c->saltlen = saltlen;
  if (saltlen)
    memcpy(c->salt, salt, saltlen);
  call_push(e, c, &ks);
}

void attnd_engine_close_session(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                                uint64_t session, attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  attnd_qkeys_t ks;
  keys_conn(&ks, conn, session, 1);
  if (direct(e, &ks)) {
    attnd_session_close(e, identity, session, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_CLOSE, identity, cb, arg);
  c->conn = conn;
  c->session = session;
  call_push(e, c, &ks);
}

/* The child's id is drawn at admission, so no queued call can name it: a
 * Fork follows its connection and its parent only. */
void attnd_engine_fork(attnd_engine_t *e, uint64_t identity, uint64_t conn, uint64_t session,
                       attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  attnd_qkeys_t ks;
  keys_conn(&ks, conn, session, 1);
  if (direct(e, &ks)) {
    attnd_session_fork(e, identity, session, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_FORK, identity, cb, arg);
  c->conn = conn;
  c->session = session;
  call_push(e, c, &ks);
}

void attnd_engine_truncate(attnd_engine_t *e, uint64_t identity, uint64_t conn, uint64_t session,
                           uint32_t len, attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  attnd_qkeys_t ks;
  keys_conn(&ks, conn, session, 1);
  if (direct(e, &ks)) {
    attnd_session_truncate(e, identity, session, len, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_TRUNCATE, identity, cb, arg);
  c->conn = conn;
  c->session = session;
  c->len = len;
  call_push(e, c, &ks);
}

/* The sessions items name, as keys (ids as given: one that does not exist
 * is refused at admission, and no queued call can create it, ids being
 * drawn at random when a session is made). */
static void keys_items(attnd_qkeys_t *ks, const attnd_item_t *items, uint32_t nitems) {
  for (uint32_t i = 0; i < nitems; i++)
    attnd_qkeys_add(ks, ATTND_QK_SESSION, items[i].session);
}

void attnd_engine_plan(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                       void *arg) {
  if (!check_open(e, cb, arg))
    return;
  attnd_qkeys_t ks;
  keys_conn(&ks, conn, 0, 0);
  keys_items(&ks, items, nitems);
  if (direct(e, &ks)) {
    attnd_plan_admit(e, identity, conn, items, nitems, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_PLAN, identity, cb, arg);
  c->conn = conn;
  c->items = items;
  c->nitems = nitems;
  call_push(e, c, &ks);
}

static size_t tensor_bytes(const attnd_tensor_t *t) {
  return t->present && t->data ? t->nbytes : 0;
}

/* A step follows its connection and the sessions it names: its inline
 * items', or those of the live plan it names (plan ids are drawn at random
 * when a Plan is admitted, so a plan that is not live now can only be one
 * that ended: the step is refused at admission whatever it follows). */
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
  /* Tensors in client device memory are checked on the device (a backend
   * job), and the call waits in the queue for it like a large step's scan. */
  int large = bytes > e->offload_bytes || req->device;
  attnd_qkeys_t ks;
  keys_conn(&ks, conn, 0, 0);
  if (req->plan) {
    const attnd_plan_t *p = attnd_idmap_get(&e->plans, req->plan);
    for (uint32_t i = 0; p && i < p->nitems; i++)
      attnd_qkeys_add(&ks, ATTND_QK_SESSION, p->items[i].s->id);
  } else {
    keys_items(&ks, req->items, req->nitems);
  }
  if (!large && direct(e, &ks)) {
    attnd_step_admit(e, identity, conn, req, cb, arg, NULL);
    return;
  }
  call_t *c = call_new(e, CALL_STEP, identity, cb, arg);
  c->conn = conn;
  c->step = *req;
  if (large) {
    c->scanned = 1;
    scan_start(e, c);
  }
  call_push(e, c, &ks);
}

/* SetScales and SetSinks change what every later step of the layer computes
 * (and drop_cached_kv every session's KV there): barriers. */
static void keys_barrier(attnd_qkeys_t *ks) {
  attnd_qkeys_init(ks);
  ks->barrier = 1;
}

void attnd_engine_set_scales(attnd_engine_t *e, const attnd_scales_req_t *req,
                             attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  attnd_qkeys_t ks;
  keys_barrier(&ks);
  if (!e->sc.path[0] && direct(e, &ks)) {
    /* Nothing queued, nothing to persist: checked and applied at once. */
    char msg[200];
    int rc = attnd_scales_check(e, req, msg, sizeof(msg));
    if (rc)
      attnd_engine_answer(cb, arg, rc, "%s", msg);
    else
      attnd_scales_commit(e, req, cb, arg);
    return;
  }
  /* Through the queue, even when it is empty: the file is written while the
   * call holds every later one back (scales_start). */
  call_t *c = call_new(e, CALL_SCALES, 0, cb, arg);
  c->scales = *req;
  call_push(e, c, &ks);
}

void attnd_engine_set_sinks(attnd_engine_t *e, const attnd_sinks_req_t *req,
                            attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  attnd_qkeys_t ks;
  keys_barrier(&ks);
  if (!e->sk.path[0] && direct(e, &ks)) {
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
  call_push(e, c, &ks);
}

/* A connection's close ends its plans: it follows the connection's queued
 * calls (a queued Plan of it is admitted first and then ends here, as it
 * would have without the queue) and every queued call naming a session of
 * one of its live plans (a step of another connection may name such a plan;
 * docs/sessions.md §4). O(live plans), like the ending itself. */
void attnd_engine_conn_closed(attnd_engine_t *e, uint64_t conn) {
  attnd_qkeys_t ks;
  keys_conn(&ks, conn, 0, 0);
  ATTND_LIST_FOREACH(it, nx, &e->plist) {
    const attnd_plan_t *p = ATTND_LIST_DATA(it, attnd_plan_t, link);
    for (uint32_t i = 0; p->conn == conn && i < p->nitems; i++)
      attnd_qkeys_add(&ks, ATTND_QK_SESSION, p->items[i].s->id);
  }
  if (direct(e, &ks)) {
    attnd_plan_conn_closed(e, conn);
    return;
  }
  call_t *c = call_new(e, CALL_CONN_CLOSED, 0, NULL, NULL);
  c->conn = conn;
  call_push(e, c, &ks);
}

void attnd_engine_set_offload_bytes(attnd_engine_t *e, size_t bytes) {
  e->offload_bytes = bytes;
}

void attnd_engine_set_scan_parts(attnd_engine_t *e, int parts, size_t part_bytes) {
  e->scan_parts = parts < 1 ? 1 : parts > ATTND_SCAN_MAX_PARTS ? ATTND_SCAN_MAX_PARTS : parts;
  e->scan_part_bytes = part_bytes ? part_bytes : 1;
}

/* rpc_fixture.c: the RPC tests' harness (rpc_fixture.h). */
#include "rpc_fixture.h"

fake_engine_t fe;

int attnd_engine_init(attnd_engine_t **out, uv_loop_t *loop, const attnd_config_t *cfg, char *err,
                      size_t errlen) {
  *out = (attnd_engine_t *)&fe;
  return 0;
}
void attnd_engine_close(attnd_engine_t *e, void (*cb)(void *arg), void *arg) {
  if (cb)
    cb(arg);
}
void attnd_engine_info(attnd_engine_t *e, attnd_engine_info_t *info) {
  memset(info, 0, sizeof(*info));
  info->backend = "cpu";
  snprintf(info->device, sizeof(info->device), "fake cpu");
  info->kv_memory = 1 << 20;
  info->kv_blocks = 42;
}
void attnd_engine_stats(attnd_engine_t *e, attnd_engine_stats_t *st) {
  memset(st, 0, sizeof(*st));
  st->sessions = 3;
  st->blocks_total = 42;
  st->prefix_queries = 7;
}
uint32_t attnd_engine_list_sessions(attnd_engine_t *e, uint64_t identity, attnd_session_info_t *out,
                                    uint32_t max) {
  for (uint32_t i = 0; i < 2 && i < max; i++) {
    out[i].session = 100 + i;
    out[i].len = 10 * (i + 1);
    out[i].blocks = i + 1;
    out[i].idle_s = 5;
  }
  return 2;
}

static void finish(attnd_engine_done_cb cb, void *arg, attnd_result_t *r) {
  if (fe.hold) {
    if (fe.nheld == fe.capheld) {
      fe.capheld = fe.capheld ? 2 * fe.capheld : 16;
      fe.held = realloc(fe.held, (size_t)fe.capheld * sizeof(held_t));
      assert_non_null(fe.held);
    }
    fe.held[fe.nheld].cb = cb;
    fe.held[fe.nheld].arg = arg;
    fe.held[fe.nheld].res = *r;
    fe.nheld++;
    return;
  }
  cb(arg, r);
}

/* Completes the i-th held call. */
void fake_complete(int i) {
  held_t h = fe.held[i];
  memmove(&fe.held[i], &fe.held[i + 1], (size_t)(fe.nheld - i - 1) * sizeof(held_t));
  fe.nheld--;
  h.cb(h.arg, &h.res);
}

void fake_complete_all(void) {
  while (fe.nheld > 0)
    fake_complete(fe.nheld - 1);
}

void attnd_engine_open_session(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                               const uint32_t *tokens, uint32_t ntokens, const uint8_t *salt,
                               size_t saltlen, attnd_engine_done_cb cb, void *arg) {
  attnd_engine_open_session_at(e, identity, conn, 0, tokens, ntokens, salt, saltlen, cb, arg);
}
void attnd_engine_open_session_at(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                                  uint32_t base, const uint32_t *tokens, uint32_t ntokens,
                                  const uint8_t *salt, size_t saltlen, attnd_engine_done_cb cb,
                                  void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  fe.last_identity = identity;
  r.session = 0xabcdef0123456789ull;
  r.base = base;          /* echoed: the test sees the decoded base */
  r.cached_len = ntokens; /* echoes the token count so the test sees them */
  r.queued_us = 11;
  r.computing_us = 22;
  finish(cb, arg, &r);
}
void attnd_engine_close_session(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                                uint64_t session, attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  if (session != 0xabcdef0123456789ull) {
    r.status = ATTND_ENOTFOUND;
    snprintf(r.message, sizeof(r.message), "session %llx not found", (unsigned long long)session);
  }
  finish(cb, arg, &r);
}
void attnd_engine_fork(attnd_engine_t *e, uint64_t identity, uint64_t conn, uint64_t session,
                       attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.session = session + 1;
  finish(cb, arg, &r);
}
void attnd_engine_truncate(attnd_engine_t *e, uint64_t identity, uint64_t conn, uint64_t session,
                           uint32_t len, attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  finish(cb, arg, &r);
}
void attnd_engine_plan(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                       void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  fe.plans++;
  for (uint32_t i = 0; i < nitems && i < 8; i++) {
    fe.plan_mask[i] = items[i].mask;
    if (items[i].mask.intervals && items[i].mask.intervals_len <= 64)
      memcpy(fe.plan_iv[i], items[i].mask.intervals, 16 * (size_t)items[i].mask.intervals_len);
  }
  r.plan = ++fe.next_plan;
  int decode = nitems > 0;
  for (uint32_t i = 0; i < nitems; i++)
    decode &= items[i].n == 1;
  fe.plan_decode[r.plan % 64] = (uint8_t)decode;
  finish(cb, arg, &r);
}
void attnd_engine_step(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  fe.step = *req;
  /* The step's kind, as the engine reports it: from its plan, whichever
   * connection made it, or from its inline items. */
  r.decode = req->plan ? fe.plan_decode[req->plan % 64] : req->nitems > 0;
  for (uint32_t i = 0; i < req->nitems; i++)
    r.decode &= req->items[i].n == 1;
  for (uint32_t i = 0; i < req->nitems && i < 8; i++) {
    fe.items[i] = req->items[i];
    for (uint32_t t = 0; t < req->items[i].ntokens && t < 16; t++)
      fe.tokens[i][t] = req->items[i].tokens[t];
  }
  /* Zero copy: tensor bytes must point into the request frame. */
  fe.step_in_frame =
      !req->q.present || (req->q.data >= fe.frame_lo && req->q.data + req->q.nbytes <= fe.frame_hi);
  if (req->q.present) {
    /* Echo q as the output (owned by the callback, as the engine's is). */
    memcpy(fe.echo, req->q.data, req->q.nbytes);
    r.out = malloc(req->q.nbytes);
    memcpy(r.out, fe.echo, req->q.nbytes);
    r.out_bytes = req->q.nbytes;
    r.out_dtype = req->q.dtype;
    r.out_rows = req->q.shape[0];
  }
  if (req->want_lse) {
    r.lse_bytes = r.out_rows * 2 * sizeof(float);
    if (r.lse_bytes > 4096 * sizeof(float))
      r.lse_bytes = 4096 * sizeof(float);
    r.lse = malloc(r.lse_bytes ? r.lse_bytes : 1);
    for (size_t i = 0; i < r.lse_bytes / sizeof(float); i++)
      r.lse[i] = (float)i;
  }
  finish(cb, arg, &r);
}
void attnd_engine_set_scales(attnd_engine_t *e, const attnd_scales_req_t *req,
                             attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  fe.scales_calls++;
  r.version = 5;
  finish(cb, arg, &r);
}
void attnd_engine_set_sinks(attnd_engine_t *e, const attnd_sinks_req_t *req,
                            attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  fe.sinks_calls++;
  fe.sinks_layer = req->layer;
  fe.sinks_bytes = req->sinks.nbytes;
  r.version = 7;
  finish(cb, arg, &r);
}
void attnd_engine_conn_closed(attnd_engine_t *e, uint64_t conn) {
  fe.closed_conn = conn;
}
void *attnd_engine_host_alloc(attnd_engine_t *e, size_t len, int *pinned) {
  *pinned = 0;
  return malloc(len);
}
void attnd_engine_host_free(attnd_engine_t *e, void *p, int pinned) {
  assert_int_equal(pinned, 0); /* the fake transport sends malloc'ed frames */
  free(p);
}

/* ---- fake transport ---------------------------------------------------------- */

void t_send(attnd_rpc_conn_t *rc, uint8_t *buf, size_t len, int close_after) {
  tconn_t *t = (tconn_t *)rc;
  t->nresp++;
  if (t->count_only) {
    free(buf);
    return;
  }
  assert_true(t->nout < 32);
  assert_true(len >= 4);
  uint32_t n =
      ((uint32_t)buf[0] << 24) | ((uint32_t)buf[1] << 16) | ((uint32_t)buf[2] << 8) | buf[3];
  assert_int_equal(n, len - 4);
  t->out[t->nout] = buf;
  t->outlen[t->nout] = len;
  t->close_after[t->nout] = close_after;
  t->nout++;
}
void t_released(attnd_rpc_conn_t *rc) {
  ((tconn_t *)rc)->released++;
}
void t_progress(attnd_rpc_conn_t *rc) {
  ((tconn_t *)rc)->progress++;
}

void tconn_init(fix_t *f, tconn_t *t, uint64_t identity, int need_hello) {
  memset(t, 0, sizeof(*t));
  attnd_rpc_conn_init(&t->rc, &f->rpc, identity, need_hello);
  t->rc.send = t_send;
  t->rc.released = t_released;
  t->rc.progress = t_progress;
}

void tconn_free(tconn_t *t) {
  for (int i = 0; i < t->nout; i++)
    free(t->out[i]);
  t->nout = 0;
  attnd_rpc_conn_closed(&t->rc);
}

/* Decodes response i (without its header). */
void resp(tconn_t *t, int i, attnd_v1_Response *r) {
  assert_true(i < t->nout);
  memset(r, 0, sizeof(*r));
  pb_istream_t s = pb_istream_from_buffer(t->out[i] + 4, t->outlen[i] - 4);
  assert_true(pb_decode(&s, attnd_v1_Response_fields, r));
}

/* Hands a copy of w's bytes to rpc as one frame and frees w. */
void send_frame(tconn_t *t, pbw_t *w) {
  uint8_t *f = malloc(w->n ? w->n : 1);
  memcpy(f, w->b, w->n);
  fe.frame_lo = f;
  fe.frame_hi = f + w->n;
  attnd_rpc_handle_frame(&t->rc, f, w->n);
  pbw_free(w);
}

/* Request{id, <call field> = empty message or sub}. */
void send_call(tconn_t *t, uint64_t id, uint32_t call, pbw_t *sub) {
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, id);
  if (sub)
    pbw_sub(&w, call, sub);
  else if (call)
    pbw_bytes(&w, call, "", 0);
  send_frame(t, &w);
}

int setup(void **state) {
  fix_t *f = calloc(1, sizeof(*f));
  memset(&fe, 0, sizeof(fe));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  attnd_config_defaults(&f->cfg);
  f->cfg.layers = 2;
  f->cfg.shape.q_heads = 4;
  f->cfg.shape.kv_heads = 2;
  f->cfg.shape.head_dim = 64;
  f->cfg.shape.block_size = 16;
  f->cfg.max_plans = 4;
  snprintf(f->dir, sizeof(f->dir), "/tmp/attnd-test-rpc-XXXXXX");
  assert_non_null(mkdtemp(f->dir));
  char err[256];
  assert_int_equal(attnd_config_validate(&f->cfg, err, sizeof(err)), 0);
  assert_int_equal(attnd_engine_init(&f->engine, &f->loop, &f->cfg, err, sizeof(err)), 0);
  assert_int_equal(attnd_rpc_init(&f->rpc, &f->loop, f->engine, &f->cfg, err, sizeof(err)), 0);
  *state = f;
  return 0;
}

int teardown(void **state) {
  fix_t *f = *state;
  attnd_rpc_free(&f->rpc);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  free(fe.held);
  fe.held = NULL;
  fe.nheld = fe.capheld = 0;
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
  assert_int_equal(system(cmd), 0);
  free(f);
  return 0;
}

/* One inline item as the wire carries it. */
void put_item(pbw_t *w, uint32_t field, uint64_t session, uint32_t start, uint32_t n,
              int with_tokens) {
  pbw_t it;
  pbw_init(&it);
  pbw_fixed64(&it, 1, session);
  pbw_uint(&it, 2, start);
  pbw_uint(&it, 3, n);
  if (with_tokens) {
    pbw_t tok;
    pbw_init(&tok);
    for (uint32_t i = 0; i < n; i++)
      pbw_varint(&tok, 500 + start + i);
    pbw_sub(&it, 6, &tok);
  }
  pbw_t mask;
  pbw_init(&mask);
  pbw_uint(&mask, 1, attnd_v1_Mask_Kind_SLIDING_WINDOW);
  pbw_uint(&mask, 2, 8);
  pbw_sub(&it, 5, &mask);
  pbw_sub(w, field, &it);
}

/* Same-host zero-copy: the fake engine is a CPU backend's, which cannot map
 * client memory. */
void attnd_engine_ipc_open(attnd_engine_t *e, const uint8_t handle[64], uint64_t size,
                           const char *device_uuid, attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.status = ATTND_EPRECOND;
  snprintf(r.message, sizeof(r.message), "the cpu backend cannot use client device memory");
  finish(cb, arg, &r);
}
void attnd_engine_ipc_close(attnd_engine_t *e, void *ipc) {}

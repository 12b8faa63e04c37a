/* test_rpc.c: the RPC layer (daemon/rpc/: decoding, the method table,
 * encoding), driven frame by frame without sockets against a fake engine
 * that this file defines (so the linker never pulls the real engine out of
 * its library). The
 * fake engine can hold calls in flight, which makes duplicate ids,
 * out-of-order completion, drain and disconnects deterministic. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pb_decode.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attnd.pb.h"
#include "config.h"
#include "engine.h"
#include "base.h"
#include "rpc.h"
#include "srv_pbw.h"

/* ---- fake engine ---------------------------------------------------------- */

typedef struct {
  attnd_engine_done_cb cb;
  void *arg;
  attnd_result_t res;
} held_t;

static struct {
  int hold; /* 1: calls wait for fake_complete() */
  held_t held[16];
  int nheld;
  /* What the last step saw. */
  attnd_step_req_t step;
  attnd_item_t items[8];
  uint32_t tokens[8][16];
  const uint8_t *frame_lo, *frame_hi;
  int step_in_frame;
  uint64_t last_identity;
  uint64_t closed_conn;
  uint64_t next_plan;
  uint8_t echo[4096];
  /* What the last plan saw: its items' masks, intervals copied. */
  int plans;
  attnd_mask_t plan_mask[8];
  int32_t plan_iv[8][4 * 64];
} fe;

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
    assert_true(fe.nheld < 16);
    fe.held[fe.nheld].cb = cb;
    fe.held[fe.nheld].arg = arg;
    fe.held[fe.nheld].res = *r;
    fe.nheld++;
    return;
  }
  cb(arg, r);
}

/* Completes the i-th held call. */
static void fake_complete(int i) {
  held_t h = fe.held[i];
  memmove(&fe.held[i], &fe.held[i + 1], (size_t)(fe.nheld - i - 1) * sizeof(held_t));
  fe.nheld--;
  h.cb(h.arg, &h.res);
}

void attnd_engine_open_session(attnd_engine_t *e, uint64_t identity, const uint32_t *tokens,
                               uint32_t ntokens, const uint8_t *salt, size_t saltlen,
                               attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  fe.last_identity = identity;
  r.session = 0xabcdef0123456789ull;
  r.cached_len = ntokens; /* echoes the token count so the test sees them */
  r.queued_us = 11;
  r.computing_us = 22;
  finish(cb, arg, &r);
}
void attnd_engine_close_session(attnd_engine_t *e, uint64_t identity, uint64_t session,
                                attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  if (session != 0xabcdef0123456789ull) {
    r.status = ATTND_ENOTFOUND;
    snprintf(r.message, sizeof(r.message), "session %llx not found", (unsigned long long)session);
  }
  finish(cb, arg, &r);
}
void attnd_engine_fork(attnd_engine_t *e, uint64_t identity, uint64_t session,
                       attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.session = session + 1;
  finish(cb, arg, &r);
}
void attnd_engine_truncate(attnd_engine_t *e, uint64_t identity, uint64_t session, uint32_t len,
                           attnd_engine_done_cb cb, void *arg) {
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
  finish(cb, arg, &r);
}
void attnd_engine_step(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  fe.step = *req;
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
  r.version = 5;
  finish(cb, arg, &r);
}
void attnd_engine_conn_closed(attnd_engine_t *e, uint64_t conn) {
  fe.closed_conn = conn;
}

/* ---- fake transport ---------------------------------------------------------- */

typedef struct {
  attnd_rpc_conn_t rc; /* first, so the callbacks can cast */
  uint8_t *out[32];
  size_t outlen[32];
  int close_after[32];
  int nout;
  int released;
  int progress;
} tconn_t;

static void t_send(attnd_rpc_conn_t *rc, uint8_t *buf, size_t len, int close_after) {
  tconn_t *t = (tconn_t *)rc;
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
static void t_released(attnd_rpc_conn_t *rc) {
  ((tconn_t *)rc)->released++;
}
static void t_progress(attnd_rpc_conn_t *rc) {
  ((tconn_t *)rc)->progress++;
}

typedef struct {
  uv_loop_t loop;
  attnd_config_t cfg;
  attnd_rpc_t rpc;
  attnd_engine_t *engine;
  char dir[64];
} fix_t;

static void tconn_init(fix_t *f, tconn_t *t, uint64_t identity, int need_hello) {
  memset(t, 0, sizeof(*t));
  attnd_rpc_conn_init(&t->rc, &f->rpc, identity, need_hello);
  t->rc.send = t_send;
  t->rc.released = t_released;
  t->rc.progress = t_progress;
}

static void tconn_free(tconn_t *t) {
  for (int i = 0; i < t->nout; i++)
    free(t->out[i]);
  t->nout = 0;
  attnd_rpc_conn_closed(&t->rc);
}

/* Decodes response i (without its header). */
static void resp(tconn_t *t, int i, attnd_v1_Response *r) {
  assert_true(i < t->nout);
  memset(r, 0, sizeof(*r));
  pb_istream_t s = pb_istream_from_buffer(t->out[i] + 4, t->outlen[i] - 4);
  assert_true(pb_decode(&s, attnd_v1_Response_fields, r));
}

/* Hands a copy of w's bytes to rpc as one frame and frees w. */
static void send_frame(tconn_t *t, pbw_t *w) {
  uint8_t *f = malloc(w->n ? w->n : 1);
  memcpy(f, w->b, w->n);
  fe.frame_lo = f;
  fe.frame_hi = f + w->n;
  attnd_rpc_handle_frame(&t->rc, f, w->n);
  pbw_free(w);
}

/* Request{id, <call field> = empty message or sub}. */
static void send_call(tconn_t *t, uint64_t id, uint32_t call, pbw_t *sub) {
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, id);
  if (sub)
    pbw_sub(&w, call, sub);
  else if (call)
    pbw_bytes(&w, call, "", 0);
  send_frame(t, &w);
}

static int setup(void **state) {
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

static int teardown(void **state) {
  fix_t *f = *state;
  attnd_rpc_free(&f->rpc);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
  assert_int_equal(system(cmd), 0);
  free(f);
  return 0;
}

/* ---- tests ----------------------------------------------------------------------- */

static void test_health(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  send_call(&t, 1, attnd_v1_Request_health_tag, NULL);
  assert_int_equal(t.nout, 1);
  assert_false(t.close_after[0]);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 1);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.epoch, f->rpc.epoch);
  assert_true(r.has_timing);
  assert_int_equal(r.which_result, attnd_v1_Response_health_tag);
  attnd_v1_HealthResponse *h = &r.result.health;
  assert_string_equal(h->status, "serving");
  assert_string_equal(h->backend, "cpu");
  assert_string_equal(h->device, "fake cpu");
  assert_int_equal(h->epoch, f->rpc.epoch);
  assert_int_equal(h->model.layers, 2);
  assert_int_equal(h->model.q_heads, 4);
  assert_int_equal(h->model.kv_heads, 2);
  assert_int_equal(h->model.head_dim, 64);
  assert_int_equal(h->model.block_size, 16);
  assert_string_equal(h->model.dtype, "bf16");
  assert_string_equal(h->model.kv_cache, "bf16");
  assert_string_equal(h->model.rope, "neox");
  assert_int_equal(h->model.rotary_dim, 64);
  assert_int_equal(h->model.max_context, 131072);
  /* K and V, 2 kv heads, 64 dims, 2 bytes, 2 layers. */
  assert_int_equal(h->model.kv_bytes_per_token, 2 * 2 * 64 * 2 * 2);
  assert_int_equal(h->kv_blocks, 42);
  assert_true(h->model.softmax_scale > 0.1249f && h->model.softmax_scale < 0.1251f);
  tconn_free(&t);
}

static void test_missing_and_unknown_call(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  send_call(&t, 5, 0, NULL); /* no call at all */
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, 6);
  pbw_bytes(&w, 99, "zz", 2); /* a call from the future */
  send_frame(&t, &w);
  assert_int_equal(t.nout, 2);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 5);
  assert_int_equal(r.status.code, ATTND_STATUS_UNIMPLEMENTED);
  assert_false(t.close_after[0]);
  resp(&t, 1, &r);
  assert_int_equal(r.id, 6);
  assert_int_equal(r.status.code, ATTND_STATUS_UNIMPLEMENTED);
  assert_false(t.close_after[1]);
  assert_int_equal(f->rpc.counters.answers[ATTND_M_UNKNOWN].errors, 2);
  tconn_free(&t);
}

static void test_garbled(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  pbw_t w;
  pbw_init(&w);
  pbw_raw(&w, "\xff\xff\xff\xff\xff", 5);
  send_frame(&t, &w);
  assert_int_equal(t.nout, 1);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_true(t.close_after[0]);
  /* A length running past the end of the frame. */
  tconn_t t2;
  tconn_init(f, &t2, 1000, 0);
  pbw_init(&w);
  pbw_uint(&w, 1, 9);
  pbw_raw(&w, "\x1a\x40\x01", 3); /* field 3, 64 bytes announced, 1 present */
  send_frame(&t2, &w);
  resp(&t2, 0, &r);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_true(t2.close_after[0]);
  tconn_free(&t);
  tconn_free(&t2);
}

static void test_duplicate_id_and_out_of_order(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  fe.hold = 1;
  send_call(&t, 3, attnd_v1_Request_open_session_tag, NULL);
  send_call(&t, 4, attnd_v1_Request_fork_tag, NULL);
  assert_int_equal(t.nout, 0);
  assert_int_equal(t.rc.pending, 2);
  send_call(&t, 3, attnd_v1_Request_truncate_tag, NULL);
  assert_int_equal(t.nout, 1);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 3);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "id 3 is already in flight"));
  /* Health is answered at once, between the two held calls. */
  send_call(&t, 9, attnd_v1_Request_health_tag, NULL);
  assert_int_equal(t.nout, 2);
  /* Complete in reverse order: responses come back out of order, by id. */
  fake_complete(1);
  fake_complete(0);
  assert_int_equal(t.nout, 4);
  resp(&t, 2, &r);
  assert_int_equal(r.id, 4);
  assert_int_equal(r.which_result, attnd_v1_Response_fork_tag);
  resp(&t, 3, &r);
  assert_int_equal(r.id, 3);
  assert_int_equal(r.which_result, attnd_v1_Response_open_session_tag);
  assert_int_equal(r.result.open_session.session, 0xabcdef0123456789ull);
  assert_int_equal(r.timing.queued_us, 11);
  assert_int_equal(r.timing.computing_us, 22);
  assert_int_equal(t.rc.pending, 0);
  assert_int_equal(t.rc.req_bytes, 0);
  assert_int_equal(f->rpc.inflight, 0);
  assert_true(t.progress >= 2);
  /* The id is free again. */
  fe.hold = 0;
  send_call(&t, 3, attnd_v1_Request_truncate_tag, NULL);
  resp(&t, 4, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.which_result, attnd_v1_Response_truncate_tag);
  tconn_free(&t);
}

static void test_open_session_tokens_and_errors(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1234, 0);
  pbw_t o;
  pbw_init(&o);
  /* Packed tokens and one unpacked: both forms must decode. */
  pbw_t packed;
  pbw_init(&packed);
  for (int i = 0; i < 300; i++)
    pbw_varint(&packed, (uint64_t)i * 1000);
  pbw_sub(&o, 1, &packed);
  pbw_uint(&o, 1, 77);
  pbw_bytes(&o, 2, "salt", 4);
  send_call(&t, 1, attnd_v1_Request_open_session_tag, &o);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.result.open_session.cached_len, 301);
  assert_int_equal(fe.last_identity, 1234);
  /* Engine errors keep their message and map through attnd_err_status. */
  pbw_init(&o);
  pbw_fixed64(&o, 1, 42);
  send_call(&t, 2, attnd_v1_Request_close_session_tag, &o);
  resp(&t, 1, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_NOT_FOUND);
  assert_non_null(strstr(r.status.message, "not found"));
  /* Salt over 64 bytes: INVALID_ARGUMENT with the id, connection kept. */
  char salt[80];
  memset(salt, 's', sizeof(salt));
  pbw_init(&o);
  pbw_bytes(&o, 2, salt, sizeof(salt));
  send_call(&t, 3, attnd_v1_Request_open_session_tag, &o);
  resp(&t, 2, &r);
  assert_int_equal(r.id, 3);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "salt"));
  assert_false(t.close_after[2]);
  tconn_free(&t);
}

/* One inline item as the wire carries it. */
static void put_item(pbw_t *w, uint32_t field, uint64_t session, uint32_t start, uint32_t n,
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

static void test_step_zero_copy(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  /* Two items, n = 1 and n = 3: T = 4 rows; q [4, 4, 64], k/v [4, 2, 64] bf16. */
  static uint16_t q[4 * 4 * 64], kv[4 * 2 * 64];
  for (size_t i = 0; i < sizeof(q) / 2; i++)
    q[i] = (uint16_t)(i * 7 + 1);
  for (size_t i = 0; i < sizeof(kv) / 2; i++)
    kv[i] = (uint16_t)(i * 3 + 2);
  uint32_t qs[3] = {4, 4, 64}, ks[3] = {4, 2, 64};
  pbw_t st;
  pbw_init(&st);
  pbw_uint(&st, 1, 5); /* layer */
  put_item(&st, 3, 0x1111, 10, 1, 1);
  put_item(&st, 3, 0x2222, 0, 3, 1);
  pbw_tensor(&st, 4, attnd_v1_DType_DTYPE_BF16, qs, 3, q, sizeof(q));
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_tensor(&st, 6, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_uint(&st, 7, 1); /* want_lse */
  send_call(&t, 77, attnd_v1_Request_step_tag, &st);
  assert_int_equal(t.nout, 1);
  assert_true(fe.step_in_frame);
  assert_int_equal(fe.step.layer, 5);
  assert_int_equal(fe.step.plan, 0);
  assert_int_equal(fe.step.nitems, 2);
  assert_int_equal(fe.items[0].session, 0x1111);
  assert_int_equal(fe.items[0].start, 10);
  assert_int_equal(fe.items[0].n, 1);
  assert_int_equal(fe.items[0].ntokens, 1);
  assert_int_equal(fe.tokens[0][0], 510);
  assert_int_equal(fe.items[1].ntokens, 3);
  assert_int_equal(fe.tokens[1][2], 502);
  assert_int_equal(fe.items[1].mask.kind, ATTND_MASK_SLIDING);
  assert_int_equal(fe.items[1].mask.param, 8);
  assert_int_equal(fe.step.q.ndim, 3);
  assert_int_equal(fe.step.q.shape[0], 4);
  assert_int_equal(fe.step.k.nbytes, sizeof(kv));
  assert_true(fe.step.want_lse);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 77);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.which_result, attnd_v1_Response_step_tag);
  assert_true(r.result.step.has_out);
  assert_int_equal(r.result.step.out.shape_count, 3);
  assert_int_equal(r.result.step.out.shape[0], 4);
  assert_int_equal(r.result.step.out.shape[1], 4);
  assert_int_equal(r.result.step.out.shape[2], 64);
  assert_true(r.result.step.has_lse);
  /* The output bytes are exactly the echoed q. */
  const uint8_t *sp, *op, *dp;
  size_t sl, ol, dl;
  assert_int_equal(pbr_find(t.out[0] + 4, t.outlen[0] - 4, 18, &sp, &sl), 0);
  assert_int_equal(pbr_find(sp, sl, 1, &op, &ol), 0);
  assert_int_equal(pbr_find(op, ol, 3, &dp, &dl), 0);
  assert_int_equal(dl, sizeof(q));
  assert_memory_equal(dp, q, sizeof(q));
  assert_int_equal(pbr_find(sp, sl, 2, &op, &ol), 0);
  assert_int_equal(pbr_find(op, ol, 3, &dp, &dl), 0);
  assert_int_equal(dl, 4 * 2 * sizeof(float));
  /* A prefill (an item with n > 1) lands in the prefill histogram. */
  assert_int_equal(f->rpc.counters.step_latency[ATTND_STEP_PREFILL].count, 1);
  assert_int_equal(f->rpc.counters.step_latency[ATTND_STEP_DECODE].count, 0);
  tconn_free(&t);
}

static void test_plan_then_step(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  pbw_t p;
  pbw_init(&p);
  put_item(&p, 1, 0x1, 5, 1, 1);
  put_item(&p, 1, 0x2, 9, 1, 1);
  send_call(&t, 1, attnd_v1_Request_plan_tag, &p);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  uint64_t plan = r.result.plan.plan;
  assert_true(plan != 0);
  pbw_t st;
  pbw_init(&st);
  pbw_uint(&st, 1, 1);
  pbw_fixed64(&st, 2, plan);
  uint16_t kv[2 * 2 * 64] = {0};
  uint32_t ks[3] = {2, 2, 64};
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_tensor(&st, 6, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  send_call(&t, 2, attnd_v1_Request_step_tag, &st);
  resp(&t, 1, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.step.plan, plan);
  assert_int_equal(fe.step.nitems, 0);
  assert_false(fe.step.q.present);
  /* Every item of the plan has n == 1: a decode step. */
  assert_int_equal(f->rpc.counters.step_latency[ATTND_STEP_DECODE].count, 1);
  /* A plan and inline items together is a wire-level error. */
  pbw_init(&st);
  pbw_fixed64(&st, 2, plan);
  put_item(&st, 3, 0x1, 5, 1, 0);
  send_call(&t, 3, attnd_v1_Request_step_tag, &st);
  resp(&t, 2, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "plan"));
  tconn_free(&t);
}

static void test_step_wire_checks(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  uint16_t d[64] = {0};
  /* Five dims. */
  uint32_t s5[5] = {1, 1, 1, 1, 64};
  pbw_t st;
  pbw_init(&st);
  pbw_tensor(&st, 4, attnd_v1_DType_DTYPE_BF16, s5, 5, d, sizeof(d));
  send_call(&t, 21, attnd_v1_Request_step_tag, &st);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 21);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "more than 4 dims"));
  assert_false(t.close_after[0]);
  /* Bytes that do not match the shape. */
  uint32_t s3[3] = {2, 4, 64};
  pbw_init(&st);
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, s3, 3, d, sizeof(d));
  send_call(&t, 22, attnd_v1_Request_step_tag, &st);
  resp(&t, 1, &r);
  assert_int_equal(r.id, 22);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(
      strstr(r.status.message, "k: shape [2, 4, 64] of BF16 needs 1024 bytes, data has 128"));
  /* Unknown dtype. */
  pbw_init(&st);
  pbw_tensor(&st, 6, 9, s3, 3, d, sizeof(d));
  send_call(&t, 23, attnd_v1_Request_step_tag, &st);
  resp(&t, 2, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "v: dtype 9"));
  assert_int_equal(f->rpc.inflight, 0);
  tconn_free(&t);
}

static void test_hello_auth(void **state) {
  fix_t *f = *state;
  attnd_v1_Response r;
  /* A token file, and an rpc that reads it. */
  char path[128];
  snprintf(path, sizeof(path), "%s/tokens", f->dir);
  FILE *fp = fopen(path, "w");
  fputs("# tokens\nsecret-one\n\n  secret-two  \n", fp);
  fclose(fp);
  attnd_rpc_free(&f->rpc);
  snprintf(f->cfg.token_file, sizeof(f->cfg.token_file), "%s", path);
  char err[256];
  assert_int_equal(attnd_rpc_init(&f->rpc, &f->loop, f->engine, &f->cfg, err, sizeof(err)), 0);
  assert_int_equal(f->rpc.ntokens, 2);
  assert_true(attnd_rpc_token_ok(&f->rpc, "secret-two"));
  assert_false(attnd_rpc_token_ok(&f->rpc, "secret-tw"));
  assert_false(attnd_rpc_token_ok(&f->rpc, "secret-twoo"));
  assert_false(attnd_rpc_token_ok(&f->rpc, ""));

  tconn_t t;
  /* Off loopback: anything before Hello is UNAUTHENTICATED, then close. */
  tconn_init(f, &t, ATTND_IDENTITY_ANON, 1);
  send_call(&t, 1, attnd_v1_Request_health_tag, NULL);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAUTHENTICATED);
  assert_true(t.close_after[0]);
  tconn_free(&t);
  /* A wrong token. */
  tconn_init(f, &t, ATTND_IDENTITY_ANON, 1);
  pbw_t h;
  pbw_init(&h);
  pbw_bytes(&h, 1, "nope", 4);
  send_call(&t, 2, attnd_v1_Request_hello_tag, &h);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAUTHENTICATED);
  assert_true(t.close_after[0]);
  tconn_free(&t);
  /* The right token: the token's identity, then calls work. */
  tconn_init(f, &t, ATTND_IDENTITY_ANON, 1);
  pbw_init(&h);
  pbw_bytes(&h, 1, "secret-two", 10);
  send_call(&t, 3, attnd_v1_Request_hello_tag, &h);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.which_result, attnd_v1_Response_hello_tag);
  assert_false(t.close_after[0]);
  assert_true(t.rc.identity & ATTND_IDENTITY_TOKEN_BIT);
  send_call(&t, 4, attnd_v1_Request_open_session_tag, NULL);
  resp(&t, 1, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.last_identity, t.rc.identity);
  uint64_t tok_identity = t.rc.identity;
  tconn_free(&t);
  /* Loopback without Hello: the shared anonymous identity. */
  tconn_init(f, &t, ATTND_IDENTITY_ANON, 0);
  send_call(&t, 5, attnd_v1_Request_open_session_tag, NULL);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.last_identity, ATTND_IDENTITY_ANON);
  assert_true(tok_identity != ATTND_IDENTITY_ANON);
  tconn_free(&t);
}

static int idle_calls;
static void on_idle(void *arg) {
  idle_calls++;
}

static void test_drain(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  fe.hold = 1;
  send_call(&t, 1, attnd_v1_Request_open_session_tag, NULL);
  f->rpc.draining = 1;
  f->rpc.idle_cb = on_idle;
  idle_calls = 0;
  send_call(&t, 2, attnd_v1_Request_open_session_tag, NULL);
  send_call(&t, 3, attnd_v1_Request_health_tag, NULL);
  assert_int_equal(t.nout, 2);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 2);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAVAILABLE);
  resp(&t, 1, &r);
  assert_int_equal(r.id, 3);
  assert_string_equal(r.result.health.status, "draining");
  assert_int_equal(idle_calls, 0);
  fake_complete(0); /* the in-flight call still finishes and is answered */
  assert_int_equal(t.nout, 3);
  resp(&t, 2, &r);
  assert_int_equal(r.id, 1);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(idle_calls, 1);
  tconn_free(&t);
}

static void test_disconnect_mid_request(void **state) {
  fix_t *f = *state;
  tconn_t t;
  tconn_init(f, &t, 1000, 0);
  fe.hold = 1;
  send_call(&t, 1, attnd_v1_Request_open_session_tag, NULL);
  send_call(&t, 2, attnd_v1_Request_fork_tag, NULL);
  assert_int_equal(attnd_rpc_conn_closed(&t.rc), 0); /* still held by 2 requests */
  assert_int_equal(fe.closed_conn, t.rc.id);
  fake_complete(0);
  assert_int_equal(t.released, 0);
  fake_complete(0);
  assert_int_equal(t.nout, 0); /* results dropped */
  assert_int_equal(t.released, 1);
  assert_int_equal(f->rpc.inflight, 0);
  tconn_free(&t);
}

static void test_stats_and_list(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  send_call(&t, 1, attnd_v1_Request_health_tag, NULL);
  send_call(&t, 2, attnd_v1_Request_health_tag, NULL);
  send_call(&t, 3, attnd_v1_Request_fork_tag, NULL);
  send_call(&t, 4, attnd_v1_Request_list_sessions_tag, NULL);
  f->rpc.counters.connections = 1;
  send_call(&t, 5, attnd_v1_Request_stats_tag, NULL);
  resp(&t, 4, &r);
  assert_int_equal(r.which_result, attnd_v1_Response_stats_tag);
  attnd_v1_StatsResponse *s = &r.result.stats;
  assert_int_equal(s->connections, 1);
  assert_int_equal(s->sessions, 3);
  assert_int_equal(s->blocks_total, 42);
  assert_int_equal(s->prefix_queries, 7);
  assert_string_equal(s->kv_cache, "bf16");
  int seen = 0;
  for (pb_size_t i = 0; i < s->methods_count; i++) {
    if (strcmp(s->methods[i].method, "health") == 0) {
      assert_int_equal(s->methods[i].requests, 2);
      seen++;
    }
    if (strcmp(s->methods[i].method, "stats") == 0) {
      assert_int_equal(s->methods[i].requests, 1);
      seen++;
    }
  }
  assert_int_equal(seen, 2);
  assert_true(s->bytes_in > 0);
  assert_true(s->bytes_out > 0);
  /* ListSessions carries the engine's sessions of this identity. */
  const uint8_t *lp, *sp;
  size_t ll, sl;
  assert_int_equal(pbr_find(t.out[3] + 4, t.outlen[3] - 4, 20, &lp, &ll), 0);
  assert_int_equal(pbr_find(lp, ll, 1, &sp, &sl), 0); /* the last SessionInfo */
  attnd_v1_SessionInfo si = attnd_v1_SessionInfo_init_zero;
  pb_istream_t is = pb_istream_from_buffer(sp, sl);
  assert_true(pb_decode(&is, attnd_v1_SessionInfo_fields, &si));
  assert_int_equal(si.session, 101);
  assert_int_equal(si.len, 20);
  tconn_free(&t);
}

/* Mutated and truncated requests never crash and always get exactly one
 * well-formed answer (or the frame is declared unparsable and the connection
 * is told to close). Run under ASan/UBSan (ATTND_SANITIZE=ON) to mean more. */
static void test_fuzz_requests(void **state) {
  fix_t *f = *state;
  srand(12345);
  /* A valid step to mutate. */
  static uint16_t q[2 * 4 * 64], kv[2 * 2 * 64];
  uint32_t qs[3] = {2, 4, 64}, ks[3] = {2, 2, 64};
  pbw_t st;
  pbw_init(&st);
  pbw_uint(&st, 1, 1);
  put_item(&st, 3, 0x1, 0, 2, 1);
  pbw_tensor(&st, 4, attnd_v1_DType_DTYPE_BF16, qs, 3, q, sizeof(q));
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_tensor(&st, 6, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_t base;
  pbw_init(&base);
  pbw_uint(&base, 1, 5);
  pbw_sub(&base, attnd_v1_Request_step_tag, &st);
  int answered = 0, closed = 0;
  for (int iter = 0; iter < 3000; iter++) {
    tconn_t t;
    tconn_init(f, &t, 1000, 0);
    pbw_t w;
    pbw_init(&w);
    size_t n = base.n;
    if (iter % 3 == 0)
      n = (size_t)rand() % base.n + 1; /* truncated */
    pbw_raw(&w, base.b, n);
    int flips = 1 + rand() % 4;
    for (int k = 0; k < flips; k++)
      w.b[(size_t)rand() % w.n] = (uint8_t)rand();
    send_frame(&t, &w);
    assert_int_equal(t.nout, 1);
    attnd_v1_Response r;
    resp(&t, 0, &r);
    assert_true(r.has_status);
    if (t.close_after[0]) {
      assert_int_equal(r.id, 0);
      closed++;
    } else {
      answered++;
    }
    assert_int_equal(t.rc.pending, 0);
    tconn_free(&t);
  }
  pbw_free(&base);
  fprintf(stderr, "fuzz: 3000 mutated steps, %d answered, %d unparsable\n", answered, closed);
  assert_true(answered > 0);
  assert_int_equal(f->rpc.inflight, 0);
}


/* One Plan item with a mask: kind, then (for DOCUMENT) doc_lengths or (for
 * CUSTOM) an INT32 intervals tensor of the given shape. */
static void put_mask_item(pbw_t *w, uint32_t start, uint32_t n, int kind, uint32_t window,
                          const int32_t *vals, uint32_t nvals, const uint32_t *shape, int ndim) {
  pbw_t it, tok, mask;
  pbw_init(&it);
  pbw_fixed64(&it, 1, 0x1111);
  pbw_uint(&it, 2, start);
  pbw_uint(&it, 3, n);
  pbw_init(&tok);
  for (uint32_t i = 0; i < n; i++)
    pbw_varint(&tok, 7);
  pbw_sub(&it, 6, &tok);
  pbw_init(&mask);
  pbw_uint(&mask, 1, (uint64_t)kind);
  if (window)
    pbw_uint(&mask, 2, window);
  if (vals)
    pbw_tensor(&mask, kind == attnd_v1_Mask_Kind_DOCUMENT ? 4 : 5, attnd_v1_DType_DTYPE_INT32,
               shape, ndim, vals, 4 * (size_t)nvals);
  pbw_sub(&it, 5, &mask);
  pbw_sub(w, 1, &it);
}

/* Masks are expanded into the kernels' form while decoding: a document mask
 * hides exactly the keys of other documents from each row (causal does the
 * rest), and a mask that cannot be expanded is refused before the engine
 * sees the call, naming the item. */
static void test_mask_expansion(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  int32_t docs[2] = {5, 9};
  uint32_t dshape[1] = {2};
  pbw_t p;
  pbw_init(&p);
  put_mask_item(&p, 0, 14, attnd_v1_Mask_Kind_DOCUMENT, 0, docs, 2, dshape, 1);
  send_call(&t, 1, attnd_v1_Request_plan_tag, &p);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.plans, 1);
  const attnd_mask_t *m = &fe.plan_mask[0];
  assert_int_equal(m->kind, ATTND_MASK_INTERVALS);
  assert_int_equal(m->causal, 1);
  assert_int_equal(m->intervals_len, 14);
  const int32_t *iv = fe.plan_iv[0];
  for (int pr = 0; pr < 14; pr++)
    for (int j = 0; j <= pr; j++) {
      int masked = (iv[j] <= pr && pr < iv[14 + j]) || (iv[28 + j] <= pr && pr < iv[42 + j]);
      int other_doc = (j < 5) != (pr < 5);
      if (masked != other_doc)
        fail_msg("row %d key %d: masked %d, other document %d", pr, j, masked, other_doc);
    }
  /* Refused while decoding, the engine never called. */
  struct {
    int kind;
    uint32_t start, n, window;
    const int32_t *vals;
    uint32_t nvals, shape[2];
    int ndim, code;
    const char *needle;
  } bad[] = {
      /* Documents that do not sum to kv_len (14). */
      {attnd_v1_Mask_Kind_DOCUMENT, 12, 2, 0, (int32_t[]){5, 5}, 2, {2}, 1,
       attnd_v1_Status_Code_INVALID_ARGUMENT, "item 1: doc lengths"},
      {attnd_v1_Mask_Kind_DOCUMENT, 12, 2, 0, (int32_t[]){20}, 1, {1}, 1,
       attnd_v1_Status_Code_INVALID_ARGUMENT, "item 1: doc lengths"},
      {attnd_v1_Mask_Kind_DOCUMENT, 12, 2, 0, NULL, 0, {0}, 0,
       attnd_v1_Status_Code_INVALID_ARGUMENT, "item 1: doc_lengths must be"},
      /* Intervals past max_context are never allocated. */
      {attnd_v1_Mask_Kind_DOCUMENT, (uint32_t)f->cfg.max_context, 1, 0, (int32_t[]){1}, 1, {1},
       1, attnd_v1_Status_Code_OUT_OF_RANGE, "item 1: start+n"},
      {attnd_v1_Mask_Kind_CUSTOM, 12, 2, 0, (int32_t[4 * 13]){0}, 4 * 13, {4, 13}, 2,
       attnd_v1_Status_Code_INVALID_ARGUMENT, "item 1: intervals must be INT32 [4, 14]"},
      {attnd_v1_Mask_Kind_SLIDING_WINDOW, 12, 2, 0, NULL, 0, {0}, 0,
       attnd_v1_Status_Code_INVALID_ARGUMENT, "item 1: sliding window"},
      {9, 12, 2, 0, NULL, 0, {0}, 0, attnd_v1_Status_Code_INVALID_ARGUMENT,
       "item 1: unknown mask kind 9"},
  };
  for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
    pbw_init(&p);
    put_mask_item(&p, 0, 3, attnd_v1_Mask_Kind_CAUSAL, 0, NULL, 0, NULL, 0);
    put_mask_item(&p, bad[k].start, bad[k].n, bad[k].kind, bad[k].window, bad[k].vals,
                  bad[k].nvals, bad[k].shape, bad[k].ndim);
    send_call(&t, 10 + k, attnd_v1_Request_plan_tag, &p);
    resp(&t, 1 + (int)k, &r);
    if ((int)r.status.code != bad[k].code || !strstr(r.status.message, bad[k].needle))
      fail_msg("case %zu: code %d '%s', expected %d '%s'", k, r.status.code, r.status.message,
               bad[k].code, bad[k].needle);
    assert_int_equal(fe.plans, 1);
  }
  tconn_free(&t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_health, setup, teardown),
      cmocka_unit_test_setup_teardown(test_missing_and_unknown_call, setup, teardown),
      cmocka_unit_test_setup_teardown(test_garbled, setup, teardown),
      cmocka_unit_test_setup_teardown(test_duplicate_id_and_out_of_order, setup, teardown),
      cmocka_unit_test_setup_teardown(test_open_session_tokens_and_errors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_step_zero_copy, setup, teardown),
      cmocka_unit_test_setup_teardown(test_plan_then_step, setup, teardown),
      cmocka_unit_test_setup_teardown(test_mask_expansion, setup, teardown),
      cmocka_unit_test_setup_teardown(test_step_wire_checks, setup, teardown),
      cmocka_unit_test_setup_teardown(test_hello_auth, setup, teardown),
      cmocka_unit_test_setup_teardown(test_drain, setup, teardown),
      cmocka_unit_test_setup_teardown(test_disconnect_mid_request, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stats_and_list, setup, teardown),
      cmocka_unit_test_setup_teardown(test_fuzz_requests, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_engine_order.c: who a queued call waits for (daemon/engine/order.c,
 * docs/sessions.md §5). A large step's scan is held on the worker pool
 * (attnd_queue_test_scan_hook) while other calls arrive: a call of another
 * connection naming other sessions is admitted and answered at once; a call
 * of the step's connection, and one naming the step's session from another
 * connection, wait and are admitted in arrival order after it; a SetScales
 * holds every later call; a connection's close waits for a queued step of
 * another connection that names one of its plans; the idle sweep spares the
 * sessions queued calls name, and only those (engine_fixture.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_fixture.h"
#include "internal.h" /* attnd_queue_test_scan_hook */

/* The hook: while the gate is closed, every scan on the worker pool waits. */
static uv_mutex_t g_mu;
static uv_cond_t g_cv;
static int g_closed;

static void hold_scan(const attnd_step_req_t *req) {
  (void)req;
  uv_mutex_lock(&g_mu);
  while (g_closed)
    uv_cond_wait(&g_cv, &g_mu);
  uv_mutex_unlock(&g_mu);
}

static void hold_on(void) {
  uv_mutex_lock(&g_mu);
  g_closed = 1;
  uv_mutex_unlock(&g_mu);
  attnd_queue_test_scan_hook = hold_scan;
}

/* Lets every held scan go. */
static void hold_release(void) {
  uv_mutex_lock(&g_mu);
  g_closed = 0;
  uv_cond_broadcast(&g_cv);
  uv_mutex_unlock(&g_mu);
}

static void hold_off(void) {
  attnd_queue_test_scan_hook = NULL;
}

/* After a test, failed ones included: no scan stays held (a failed test
 * leaves its engine behind, and its scans must not block the next test's). */
static int teardown(void **state) {
  (void)state;
  hold_off();
  hold_release();
  return 0;
}

/* A call's answer and when it came, against every other answer. */
static int g_seq;
typedef struct {
  int calls, seq;
  attnd_result_t r;
} ans_t;

static void on_ans(void *arg, attnd_result_t *r) {
  ans_t *a = arg;
  a->calls++;
  a->seq = ++g_seq;
  a->r = *r;
  a->r.out = NULL;
  a->r.lse = NULL;
  free(r->out);
  free(r->lse);
}

/* Runs the loop until *flag or ms have passed; returns *flag. */
static int run_until(fx_t *f, const int *flag, int ms) {
  uint64_t end = uv_hrtime() + (uint64_t)ms * 1000000u;
  while (!*flag && uv_hrtime() < end) {
    uv_run(&f->loop, UV_RUN_NOWAIT);
    usleep(200);
  }
  return *flag;
}

/* The request set_scales() sends for a layer, without waiting for it. */
static void scales_req(fx_t *f, int layer, attnd_scales_req_t *r) {
  memset(r, 0, sizeof(*r));
  r->layer = (uint32_t)layer;
  r->k_scale = ftensor(f->ks[layer], 1, KVH, 1);
  r->v_scale = ftensor(f->vs[layer], 1, KVH, 1);
}

/* Tensors larger than this go through the worker pool's scan: a 24-token
 * step of the fixture's shape does (24 KB), a one-token decode (1 KB) does not. */
enum { OFFLOAD = 8192 };
enum { CONN_A = 1, CONN_B = 2, CONN_X = 3, CONN_O = 5 };

static void test_decode_passes_held_scan(void **state) {
  (void)state;
  fx_t *f = fx_new(ATTND_KV_INT8, 64);
  set_all_scales(f);
  attnd_engine_set_offload_bytes(f->e, OFFLOAD);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new(), *o = sim_new();
  fill_tokens(f, a, 0, 200);
  fill_tokens(f, b, 0, 200);
  fill_tokens(f, o, 0, 200);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  open_session(f, c, 0, NULL, 0);
  hold_on();
  static pend_t pa, pb, pd, pf;
  /* A: session a's large step on connection A, its scan held. */
  spec_t sa = {.sim = a, .start = 0, .n = 24};
  step_submit(f, 0, &sa, 1, 0, CONN_A, NULL, &pa);
  assert_int_equal(queued_now(f), 1);
  /* B: a decode of session b on connection B is admitted at once and
   * answered while A's scan is still held. */
  spec_t sb = {.sim = b, .start = 0, .n = 1};
  step_submit(f, 0, &sb, 1, 0, CONN_B, NULL, &pb);
  assert_int_equal(queued_now(f), 1);
  if (!run_until(f, &pb.x.done, 5000))
    fail_msg("the decode of another session and connection waited behind the held scan");
  assert_false(pa.x.done);
  char msg[256];
  if (step_finish(f, &pb, msg, NULL) != 0)
    fail_msg("decode: %s", msg);
  /* An OpenSession of another connection is admitted at once too. */
  ans_t op = {0};
  attnd_engine_open_session(f->e, 1, CONN_O, o->tokens, 40, NULL, 0, on_ans, &op);
  assert_int_equal(op.calls, 1);
  assert_int_equal(op.r.status, 0);
  /* Calls of A's connection (naming session c, which nothing else names)
   * wait, and keep their order. */
  ans_t c1 = {0}, c2 = {0}, sc = {0}, late_open = {0};
  attnd_engine_truncate(f->e, 1, CONN_A, c->id, 0, on_ans, &c1);
  attnd_engine_fork(f->e, 1, CONN_A, c->id, on_ans, &c2);
  /* A call naming session a from another connection waits for A: a decode
   * at position 24, which only a's length after A allows. */
  spec_t sd = {.sim = a, .start = 24, .n = 1};
  step_submit(f, 0, &sd, 1, 0, CONN_X, NULL, &pd);
  /* A barrier, then calls that name nothing queued: they wait for it. */
  attnd_scales_req_t sr;
  scales_req(f, 2, &sr);
  attnd_engine_set_scales(f->e, &sr, on_ans, &sc);
  spec_t sf = {.sim = b, .start = 1, .n = 1};
  step_submit(f, 0, &sf, 1, 0, CONN_B, NULL, &pf);
  attnd_engine_open_session(f->e, 1, CONN_O, NULL, 0, NULL, 0, on_ans, &late_open);
  assert_int_equal(queued_now(f), 7);
  int any = 0;
  run_until(f, &any, 200); /* time for anything wrongly admitted to answer */
  assert_int_equal(c1.calls + c2.calls + sc.calls + late_open.calls, 0);
  assert_false(pd.x.done);
  assert_false(pf.x.done);
  assert_false(pa.x.done);
  assert_int_equal(queued_now(f), 7);
  hold_release();
  if (step_finish(f, &pa, msg, NULL) != 0)
    fail_msg("the held step: %s", msg);
  if (step_finish(f, &pd, msg, NULL) != 0)
    fail_msg("the decode of a from another connection, after a's step: %s", msg);
  if (step_finish(f, &pf, msg, NULL) != 0)
    fail_msg("the decode behind the barrier: %s", msg);
  while (!c1.calls || !c2.calls || !sc.calls || !late_open.calls)
    uv_run(&f->loop, UV_RUN_ONCE);
  assert_int_equal(c1.r.status, 0);
  assert_int_equal(c2.r.status, 0);
  assert_true(c1.seq < c2.seq); /* one connection: arrival order */
  assert_int_equal(session_len(f, a->id), 25);
  assert_int_equal(sc.r.status, 0);
  assert_true(sc.seq > c2.seq); /* the barrier after everything before it */
  assert_int_equal(late_open.r.status, 0);
  assert_true(late_open.seq > sc.seq); /* and everything after it after it */
  assert_int_equal(queued_now(f), 0);
  hold_off();
  check_engine(f);
  sim_free(a);
  sim_free(b);
  sim_free(c);
  sim_free(o);
  fx_free(f);
}

/* A step of connection X names connection A's plan and waits behind another
 * held step of that plan; A's connection then closes. The close ends A's
 * plans, so it must wait for the queued step naming one: the step succeeds,
 * then the plan ends. */
static void test_conn_close_waits_for_plan_user(void **state) {
  (void)state;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  attnd_engine_set_offload_bytes(f->e, OFFLOAD);
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 200);
  open_session(f, a, 0, NULL, 0);
  spec_t sp = {.sim = a, .start = 0, .n = 24};
  uint64_t plan;
  char msg[256];
  assert_int_equal(make_plan(f, &sp, 1, CONN_A, &plan, msg), 0);
  hold_on();
  static pend_t p0, p1;
  step_submit(f, 0, &sp, 1, plan, CONN_X, NULL, &p0); /* large: held */
  step_submit(f, 1, &sp, 1, plan, CONN_B, NULL, &p1); /* names a through the plan */
  assert_int_equal(queued_now(f), 2);
  attnd_engine_conn_closed(f->e, CONN_A);
  assert_int_equal(queued_now(f), 3);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.plans, 1);
  hold_release();
  if (step_finish(f, &p0, msg, NULL) != 0)
    fail_msg("layer 0: %s", msg);
  if (step_finish(f, &p1, msg, NULL) != 0)
    fail_msg("layer 1 through the plan of the closing connection: %s", msg);
  while (queued_now(f) > 0)
    uv_run(&f->loop, UV_RUN_ONCE);
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.plans, 0);
  hold_off();
  check_engine(f);
  sim_free(a);
  fx_free(f);
}

/* Many queued calls of one connection behind a held scan, each naming its own
 * session: a later call of another connection on one of those sessions waits
 * for exactly that chain, and a call on none of them passes all. */
static void test_session_chain(void **state) {
  (void)state;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  attnd_engine_set_offload_bytes(f->e, OFFLOAD);
  enum { NS = 6 };
  sim_t *s[NS];
  for (int i = 0; i < NS; i++) {
    s[i] = sim_new();
    fill_tokens(f, s[i], 0, 200);
    open_session(f, s[i], 0, NULL, 0);
  }
  hold_on();
  static pend_t big;
  spec_t sp = {.sim = s[0], .start = 0, .n = 24};
  step_submit(f, 0, &sp, 1, 0, CONN_A, NULL, &big);
  ans_t t[NS] = {{0}}, other = {0}, free_call = {0};
  for (int i = 1; i < NS; i++) /* connection A: wait for the big step */
    attnd_engine_truncate(f->e, 1, CONN_A, s[i]->id, 0, on_ans, &t[i]);
  attnd_engine_truncate(f->e, 1, CONN_X, s[3]->id, 0, on_ans, &other);
  assert_int_equal(queued_now(f), NS + 1);
  int any = 0;
  run_until(f, &any, 100);
  assert_int_equal(other.calls, 0);
  attnd_engine_close_session(f->e, 1, CONN_B, s[NS - 1]->id + 1, on_ans, &free_call);
  assert_int_equal(free_call.calls, 1); /* names no queued session: answered at once */
  assert_int_equal(free_call.r.status, ATTND_ENOTFOUND);
  hold_release();
  char msg[256];
  if (step_finish(f, &big, msg, NULL) != 0)
    fail_msg("big: %s", msg);
  while (!other.calls)
    uv_run(&f->loop, UV_RUN_ONCE);
  for (int i = 2; i < NS; i++)
    assert_true(t[i - 1].seq < t[i].seq);
  assert_true(other.seq > t[3].seq);
  assert_int_equal(queued_now(f), 0);
  hold_off();
  check_engine(f);
  for (int i = 0; i < NS; i++)
    sim_free(s[i]);
  fx_free(f);
}

/* The idle sweep (every 250 ms with a 1 s idle time) closes an idle
 * session while a large step of another session waits in the admission
 * queue, but not the session that step names: it is in use. */
static void test_idle_sweep_spares_queued(void **state) {
  (void)state;
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  f->rng = 0x1d1e;
  fx_config(f, ATTND_KV_BF16, 64);
  f->cfg.session_idle_s = 1;
  fx_start(f);
  attnd_engine_set_offload_bytes(f->e, OFFLOAD);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 200);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  hold_on();
  static pend_t pa;
  spec_t sa = {.sim = a, .start = 0, .n = 24};
  step_submit(f, 0, &sa, 1, 0, CONN_A, NULL, &pa);
  int never = 0;
  run_until(f, &never, 1700);
  attnd_session_info_t info[4];
  uint32_t n = attnd_engine_list_sessions(f->e, 1, info, 4);
  assert_int_equal(n, 1); /* b was swept */
  assert_int_equal(info[0].session, a->id);
  hold_release();
  char msg[256];
  if (step_finish(f, &pa, msg, NULL) != 0)
    fail_msg("the held step on the spared session: %s", msg);
  hold_off();
  check_engine(f);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_decode_passes_held_scan, teardown),
      cmocka_unit_test_teardown(test_conn_close_waits_for_plan_user, teardown),
      cmocka_unit_test_teardown(test_session_chain, teardown),
      cmocka_unit_test_teardown(test_idle_sweep_spares_queued, teardown),
  };
  if (uv_mutex_init(&g_mu) != 0 || uv_cond_init(&g_cv) != 0)
    return 1;
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  uv_cond_destroy(&g_cv);
  uv_mutex_destroy(&g_mu);
  return rc;
}

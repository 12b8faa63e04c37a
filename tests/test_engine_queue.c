/* test_engine_queue.c: the admission queue (daemon/engine/queue.c): queued
 * calls give the same answers as direct ones, in arrival order, a non-finite
 * value in a queued step is refused, and a close waits for queued calls
 * (engine_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_fixture.h"

enum { SEQ_OUTS = 16 };

/* One fixed sequence of plans and steps (prefill, decode, inline steps with
 * fp32 output, lse and k at an odd address, a rewrite) from a fixed seed;
 * every step's output is kept. */
static int run_sequence(int queued, uint8_t **outs, size_t *sizes) {
  g_queued = queued;
  fx_t *f = fx_new(ATTND_KV_INT8, 64);
  g_queued = 0;
  f->rng = 0x5eed;
  set_all_scales(f);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 200);
  fill_tokens(f, b, 0, 200);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  int no = 0;
  char msg[256];
  spec_t pre[2] = {{.sim = a, .start = 0, .n = 37}, {.sim = b, .start = 0, .n = 20}};
  spec_t dec[2] = {{.sim = a, .start = 37, .n = 1}, {.sim = b, .start = 20, .n = 1}};
  const spec_t *plans[2] = {pre, dec};
  for (int pi = 0; pi < 2; pi++) {
    uint64_t plan;
    assert_int_equal(make_plan(f, plans[pi], 2, 1, &plan, msg), 0);
    for (int l = 0; l < LAYERS; l++) {
      assert_int_equal(step_ex(f, l, plans[pi], 2, plan, 1, NULL, msg, &outs[no]), 0);
      sizes[no++] = (pi == 0 ? 57 : 2) * QH * HD * 2;
    }
  }
  stepopt_t o = {.fp32_out = 1, .want_lse = 1, .wrong_token_item = -1, .odd_offset = 1};
  spec_t rw = {.sim = a, .start = 35, .n = 3}; /* a rewrite of the last positions */
  for (int l = 0; l < LAYERS; l++) {
    assert_int_equal(step_ex(f, l, &rw, 1, 0, 1, &o, msg, &outs[no]), 0);
    sizes[no++] = 3 * QH * HD * 4;
  }
  check_engine(f);
  sim_free(a);
  sim_free(b);
  fx_free(f);
  return no;
}

/* Steps admitted from the queue after a threadpool scan compute exactly what
 * steps admitted at once compute: outputs equal bit for bit. */
static void test_queued_equals_direct(void **state) {
  uint8_t *direct[SEQ_OUTS], *queued[SEQ_OUTS];
  size_t sd[SEQ_OUTS], sq[SEQ_OUTS];
  int nd = run_sequence(0, direct, sd);
  int nq = run_sequence(1, queued, sq);
  assert_int_equal(nd, nq);
  for (int i = 0; i < nd; i++) {
    assert_int_equal(sd[i], sq[i]);
    assert_memory_equal(direct[i], queued[i], sd[i]);
    free(direct[i]);
    free(queued[i]);
  }
  print_message("  %d step outputs equal bit for bit\n", nd);
}

typedef struct {
  int calls;
  attnd_result_t r;
} cnt_t;

static void on_count(void *arg, attnd_result_t *r) {
  cnt_t *c = arg;
  c->calls++;
  c->r = *r;
  c->r.out = NULL;
  c->r.lse = NULL;
  free(r->out);
  free(r->lse);
}

/* A large step followed at once, without waiting, by calls that depend on it
 * (other layers of the same positions, which layer 0 must lead; a Truncate,
 * which needs every layer level; a step after it; a Close; a step after the
 * Close): each sees the effect of the calls before it, as if admitted one by
 * one in arrival order. Run both queued and direct: the same answers. */
static void arrival_order(int queued) {
  g_queued = queued;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  g_queued = 0;
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 200);
  open_session(f, a, 0, NULL, 0);
  spec_t pre = {.sim = a, .start = 0, .n = 20};
  plan_all_layers(f, &pre, 1);
  static pend_t pd[LAYERS + 2];
  spec_t grow = {.sim = a, .start = 20, .n = 8};
  for (int l = 0; l < LAYERS; l++)
    step_submit(f, l, &grow, 1, 0, 1, NULL, &pd[l]);
  if (queued)
    assert_int_equal(queued_now(f), LAYERS); /* the first scan has not reported back */
  cnt_t tr = {0}, cl = {0};
  attnd_engine_truncate(f->e, 1, 1, a->id, 24, on_count, &tr);
  spec_t after = {.sim = a, .start = 24, .n = 2};
  step_submit(f, 0, &after, 1, 0, 1, NULL, &pd[LAYERS]);
  attnd_engine_close_session(f->e, 1, 1, a->id, on_count, &cl);
  step_submit(f, 0, &after, 1, 0, 1, NULL, &pd[LAYERS + 1]);
  if (queued) {
    assert_int_equal(queued_now(f), LAYERS + 4);
    assert_int_equal(tr.calls + cl.calls, 0);
  }
  char msg[256];
  for (int l = 0; l < LAYERS; l++)
    if (step_finish(f, &pd[l], msg, NULL) != 0)
      fail_msg("layer %d: %s", l, msg);
  while (!tr.calls || !cl.calls)
    uv_run(&f->loop, UV_RUN_ONCE);
  assert_int_equal(tr.r.status, 0);
  for (int l = 0; l < LAYERS; l++)
    a->o[l].len = 24;
  if (step_finish(f, &pd[LAYERS], msg, NULL) != 0)
    fail_msg("step after truncate: %s", msg);
  assert_int_equal(cl.r.status, 0);
  int rc = step_finish(f, &pd[LAYERS + 1], msg, NULL);
  if (rc != ATTND_ENOTFOUND)
    fail_msg("step after close: %d %s", rc, msg);
  assert_int_equal(tr.calls, 1);
  assert_int_equal(cl.calls, 1);
  assert_int_equal(queued_now(f), 0);
  check_engine(f);
  sim_free(a);
  fx_free(f);
}

static void test_queued_arrival_order(void **state) {
  arrival_order(1);
  arrival_order(0);
}

/* A queued step with a NaN in k of item 1, or an infinity in q of item 0,
 * answers INVALID_ARGUMENT naming the item and changes nothing; the calls
 * queued behind it are admitted and succeed. */
static void test_queued_nan(void **state) {
  g_queued = 1;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  g_queued = 0;
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 200);
  fill_tokens(f, b, 0, 200);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  spec_t pre[2] = {{.sim = a, .start = 0, .n = 17}, {.sim = b, .start = 0, .n = 9}};
  plan_all_layers(f, pre, 2);
  static pend_t pd[4];
  char msg[256];
  stepopt_t nan_k = {.corrupt = 1, .wrong_token_item = -1};
  stepopt_t inf_q = {.corrupt_q = 1, .wrong_token_item = -1};
  spec_t bad[2] = {{.sim = a, .start = 17, .n = 5}, {.sim = b, .start = 9, .n = 6}};
  step_submit(f, 0, bad, 2, 0, 1, &nan_k, &pd[0]);
  step_submit(f, 0, bad, 2, 0, 1, &inf_q, &pd[1]);
  spec_t good[2] = {{.sim = a, .start = 17, .n = 2}, {.sim = b, .start = 9, .n = 1}};
  step_submit(f, 0, good, 2, 0, 1, NULL, &pd[2]);
  assert_int_equal(queued_now(f), 3);
  int rc = step_finish(f, &pd[0], msg, NULL);
  expect(f, rc, ATTND_EINVAL, msg, "item 1: k holds a non-finite value (NaN)");
  rc = step_finish(f, &pd[1], msg, NULL);
  expect(f, rc, ATTND_EINVAL, msg, "item 0: q holds a non-finite value (infinity)");
  if ((rc = step_finish(f, &pd[2], msg, NULL)) != 0)
    fail_msg("the step behind the bad ones: %d %s", rc, msg);
  assert_int_equal(session_len(f, a->id), 19);
  assert_int_equal(session_len(f, b->id), 10);
  /* The other layers catch up over the same positions and match the oracle. */
  for (int l = 1; l < LAYERS; l++)
    assert_int_equal(step(f, l, good, 2, 0), 0);
  check_engine(f);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* The engine closed while calls wait behind a running scan: every queued
 * call is admitted and answered exactly once before the close completes, a
 * call after the close is refused at once, and a connection that closed
 * while its Plan was queued still ends that plan. */
typedef struct {
  cnt_t *c;
  int n;
  int closed;
  int all_before_close;
} drain_t;

static void drain_closed(void *arg) {
  drain_t *d = arg;
  d->closed = 1;
  d->all_before_close = 1;
  for (int i = 0; i < d->n; i++)
    d->all_before_close &= d->c[i].calls == 1;
}

static void test_queued_drain(void **state) {
  g_queued = 1;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  g_queued = 0;
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 200);
  memcpy(b->tokens, a->tokens, sizeof(b->tokens));
  open_session(f, a, 0, NULL, 0);
  spec_t pre = {.sim = a, .start = 0, .n = 40};
  plan_all_layers(f, &pre, 1);
  /* Behind a large step: a Plan of connection 5 and that connection's close. */
  static pend_t pd[2];
  spec_t g1 = {.sim = a, .start = 40, .n = 6};
  step_submit(f, 0, &g1, 1, 0, 5, NULL, &pd[0]);
  cnt_t c[8] = {{0}};
  itembuf_t ib;
  spec_t p1 = {.sim = a, .start = 46, .n = 1};
  build_items(&p1, 1, &ib);
  attnd_engine_plan(f->e, 1, 5, ib.items, 1, on_count, &c[0]);
  attnd_engine_conn_closed(f->e, 5);
  assert_int_equal(queued_now(f), 3);
  step_finish(f, &pd[0], NULL, NULL);
  while (!c[0].calls)
    uv_run(&f->loop, UV_RUN_ONCE);
  assert_int_equal(c[0].r.status, 0);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.plans, 0); /* ended by the queued conn_closed */
  /* Now close with a scan running and calls of every kind behind it. */
  spec_t g2 = {.sim = a, .start = 46, .n = 5};
  step_submit(f, 0, &g2, 1, 0, 1, NULL, &pd[1]);
  attnd_engine_open_session(f->e, 1, 1, b->tokens, 40, NULL, 0, on_count, &c[1]);
  attnd_engine_fork(f->e, 1, 1, a->id, on_count, &c[2]); /* layers differ: refused */
  attnd_engine_plan(f->e, 1, 1, ib.items, 1, on_count, &c[3]);
  attnd_engine_truncate(f->e, 1, 1, a->id, 3, on_count, &c[4]);
  attnd_engine_close_session(f->e, 1, 1, a->id, on_count, &c[5]);
  assert_int_equal(queued_now(f), 6);
  drain_t d = {.c = c + 1, .n = 5};
  attnd_engine_close(f->e, drain_closed, &d);
  cnt_t late = {0};
  attnd_engine_truncate(f->e, 1, 1, a->id, 3, on_count, &late);
  assert_int_equal(late.calls, 1);
  assert_int_equal(late.r.status, ATTND_EUNAVAIL);
  while (!d.closed)
    uv_run(&f->loop, UV_RUN_ONCE);
  f->e = NULL;
  assert_true(d.all_before_close);
  assert_int_equal(pd[1].x.done, 1);
  assert_int_equal(pd[1].x.r.status, 0);
  res_free(&pd[1].x);
  pend_release(&pd[1]);
  assert_int_equal(c[1].r.status, 0);
  assert_int_equal(c[1].r.cached_len, 32); /* a's published blocks */
  assert_int_equal(c[2].r.status, ATTND_EPRECOND);
  assert_int_equal(c[3].r.status, 0);
  assert_int_equal(c[4].r.status, ATTND_EPRECOND);
  assert_int_equal(c[5].r.status, 0);
  for (int i = 1; i < 6; i++)
    assert_int_equal(c[i].calls, 1);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_queued_equals_direct),
      cmocka_unit_test(test_queued_arrival_order),
      cmocka_unit_test(test_queued_nan),
      cmocka_unit_test(test_queued_drain),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

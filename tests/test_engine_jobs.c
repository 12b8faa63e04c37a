/* test_engine_jobs.c: backend jobs (daemon/engine/jobs.c): steps of many
 * layers in flight at once, in per-layer order, and a backend fault that
 * breaks only the sessions it touched (engine_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h" /* attnd_backend_cpu_fail_next */
#include "engine_fixture.h"

/* Steps in flight while later calls are admitted: a second plan, a fork, a
 * close of a session whose steps still run, and SetScales on a layer with a
 * job in flight (applied once the layer drains, before the steps behind it). */
static void test_pipelined(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8, 64);
  set_all_scales(f);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new(), *d = sim_new();
  fill_tokens(f, a, 0, 100);
  fill_tokens(f, b, 0, 100);
  fill_tokens(f, d, 0, 100);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  static pend_t pd[32];
  int np = 0;
  uint64_t p1, p2;
  char msg[256];
  /* SetScales behind an in-flight job of its layer. Layer 2 must hold no KV
   * (and no block be cached), so the session is closed while its step runs. */
  sim_t *e2 = sim_new();
  fill_tokens(f, e2, 0, 100);
  open_session(f, e2, 0, NULL, 0);
  spec_t se = {.sim = e2, .start = 0, .n = 10};
  step_submit(f, 0, &se, 1, 0, 1, NULL, &pd[np++]);
  step_submit(f, 2, &se, 1, 0, 1, NULL, &pd[np++]);
  assert_int_equal(simple_call(f, 0, e2->id, 0, NULL), 0);
  uint64_t ver;
  g_scale_mult = 0.1;
  assert_int_equal(set_scales(f, 2, 0, &ver), 0); /* layer 2 holds no KV now */
  g_scale_mult = 1.0;
  open_session(f, d, 0, NULL, 0);
  spec_t sd = {.sim = d, .start = 0, .n = 5};
  step_submit(f, 0, &sd, 1, 0, 1, NULL, &pd[np++]);
  step_submit(f, 2, &sd, 1, 0, 1, NULL, &pd[np++]); /* must use the new scales */
  for (int i = 0; i < np; i++)
    assert_int_equal(step_finish(f, &pd[i], msg, NULL), 0);
  np = 0;
  assert_int_equal(simple_call(f, 0, d->id, 0, NULL), 0);
  spec_t s1[2] = {{.sim = a, .start = 0, .n = 20}, {.sim = b, .start = 0, .n = 9}};
  assert_int_equal(make_plan(f, s1, 2, 1, &p1, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    step_submit(f, l, s1, 2, p1, 1, NULL, &pd[np++]);
  spec_t s2[2] = {{.sim = a, .start = 20, .n = 1}, {.sim = b, .start = 9, .n = 3}};
  assert_int_equal(make_plan(f, s2, 2, 1, &p2, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    step_submit(f, l, s2, 2, p2, 1, NULL, &pd[np++]);
  uint64_t cid;
  assert_int_equal(simple_call(f, 1, a->id, 0, &cid), 0); /* fork while in flight */
  assert_int_equal(simple_call(f, 0, b->id, 0, NULL), 0); /* close while in flight */
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.sessions, 2);
  check_engine(f);
  for (int i = 0; i < np; i++)
    assert_int_equal(step_finish(f, &pd[i], msg, NULL), 0);
  np = 0;
  c->id = cid;
  sim_init_oracle(f, c);
  sim_copy(c, a);
  fill_tokens(f, c, 21, 100);
  spec_t s3[2] = {{.sim = a, .start = 21, .n = 2}, {.sim = c, .start = 21, .n = 4}};
  plan_all_layers(f, s3, 2);

  check_engine(f);
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.blocks_used, 3); /* a and c: block 0 shared, block 1 each */
  sim_free(a);
  sim_free(b);
  sim_free(c);
  sim_free(d);
  sim_free(e2);
  fx_free(f);
}

/* A step the backend fails answers its error; its sessions answer ABORTED
 * afterwards (their KV is unknown), others carry on, and nothing cached that
 * the failed step might have touched is reused. */
static void test_backend_fault(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 32);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 100);
  fill_tokens(f, b, 0, 100);
  memcpy(c->tokens, a->tokens, sizeof(a->tokens));
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 20};
  plan_all_layers(f, &pa, 1);
  spec_t pb = {.sim = b, .start = 0, .n = 4};
  plan_all_layers(f, &pb, 1);
  spec_t da = {.sim = a, .start = 20, .n = 1};
  char msg[256];
  uint64_t pl;
  assert_int_equal(make_plan(f, &da, 1, 1, &pl, msg), 0);
  assert_int_equal(step_ex(f, 0, &da, 1, pl, 1, NULL, msg, NULL), 0);
  attnd_backend_cpu_fail_next = ATTND_CPU_FAIL_STEP;
  /* The backend's error (INTERNAL, a failed device call) answers ABORTED:
   * the step's sessions lost their KV. */
  expect(f, step_ex(f, 1, &da, 1, pl, 1, NULL, msg, NULL), ATTND_EABORTED, msg, "lost their KV");
  /* The plan is still live; its next layer finds the session broken. */
  expect(f, step_ex(f, 2, &da, 1, pl, 1, NULL, msg, NULL), ATTND_EABORTED, msg, "item 0");
  expect(f, step_ex(f, 1, &da, 1, 0, 1, NULL, msg, NULL), ATTND_EABORTED, msg, "item 0");
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), ATTND_EABORTED);
  assert_int_equal(simple_call(f, 2, a->id, 0, NULL), ATTND_EABORTED);
  assert_int_equal(open_session(f, c, 40, NULL, 0), 0); /* index dropped */
  spec_t db = {.sim = b, .start = 4, .n = 2};
  plan_all_layers(f, &db, 1);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), 0);
  check_engine(f);
  sim_free(a);
  sim_free(b);
  sim_free(c);
  fx_free(f);
}

/* A decode step does not wait behind another session's long prefill on its
 * layer: the prefill runs in chunks (the fixture's --engine-chunk-keys is
 * tiny) and the decode, submitted right behind it, is answered while the
 * prefill still runs. Both match the oracle, and the decode's next step,
 * pipelined behind it, sees its KV (per-session order). */
static void test_decode_beside_prefill(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 160);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, MAXCTX);
  fill_tokens(f, b, 0, 100);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  spec_t pb = {.sim = b, .start = 0, .n = 20};
  assert_int_equal(step(f, 0, &pb, 1, 0), 0);
  pend_t *pd = calloc(3, sizeof(*pd));
  spec_t pa = {.sim = a, .start = 0, .n = 1000};
  spec_t d1 = {.sim = b, .start = 20, .n = 1}, d2 = {.sim = b, .start = 21, .n = 1};
  step_submit(f, 0, &pa, 1, 0, 1, NULL, &pd[0]);
  step_submit(f, 0, &d1, 1, 0, 1, NULL, &pd[1]);
  step_submit(f, 0, &d2, 1, 0, 1, NULL, &pd[2]);
  while (!pd[2].x.done)
    uv_run(&f->loop, UV_RUN_ONCE);
  assert_true(pd[1].x.done);
  assert_false(pd[0].x.done); /* the prefill is still running */
  char msg[256];
  for (int i = 0; i < 3; i++)
    if (step_finish(f, &pd[i], msg, NULL) != 0)
      fail_msg("step %d: %s", i, msg);
  check_engine(f);
  free(pd);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* A copy-on-write copy that fails in the backend leaves the copy's block
 * unknown: the step that needed it fails unrun (ABORTED), the session holding
 * the copy is broken from then on, and the session it was copied from carries
 * on, its KV intact. */
static void test_copy_fault(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 32);
  sim_t *s = sim_new(), *t = sim_new();
  open_prefill_fork(f, s, t, 20, 100);
  attnd_backend_cpu_fail_next = ATTND_CPU_FAIL_COPY;
  char msg[256];
  spec_t dt = {.sim = t, .start = 20, .n = 1}; /* writes the shared block 1: a copy */
  expect(f, step_ex(f, 0, &dt, 1, 0, 1, NULL, msg, NULL), ATTND_EABORTED, msg, "lost their KV");
  assert_int_equal(attnd_backend_cpu_fail_next, 0); /* the copy did fail */
  expect(f, step_ex(f, 0, &dt, 1, 0, 1, NULL, msg, NULL), ATTND_EABORTED, msg, "item 0");
  assert_int_equal(simple_call(f, 1, t->id, 0, NULL), ATTND_EABORTED);
  spec_t ds = {.sim = s, .start = 20, .n = 2};
  fill_tokens(f, s, 20, 22);
  plan_all_layers(f, &ds, 1);
  assert_int_equal(simple_call(f, 0, t->id, 0, NULL), 0);
  check_engine(f);
  sim_free(s);
  sim_free(t);
  fx_free(f);
}

/* A step that fails in the backend fails the step pipelined behind it that
 * reads what it wrote (unrun, ABORTED), and breaks a session forked from its
 * own while it ran (the fork shares the blocks it wrote); the other layers'
 * steps of the same plan, and other sessions, are not touched. */
static void test_fault_spreads(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 32);
  sim_t *a = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 100);
  fill_tokens(f, c, 0, 100);
  open_session(f, a, 0, NULL, 0);
  open_session(f, c, 0, NULL, 0);
  spec_t pc = {.sim = c, .start = 0, .n = 5};
  plan_all_layers(f, &pc, 1);
  pend_t *pd = calloc(LAYERS + 1, sizeof(*pd));
  spec_t p1 = {.sim = a, .start = 0, .n = 12}, p2 = {.sim = a, .start = 12, .n = 1};
  char msg[256];
  uint64_t plan, fid;
  assert_int_equal(make_plan(f, &p1, 1, 1, &plan, msg), 0);
  attnd_backend_cpu_fail_next = ATTND_CPU_FAIL_STEP; /* layer 0's */
  for (int l = 0; l < LAYERS; l++)
    step_submit(f, l, &p1, 1, plan, 1, NULL, &pd[l]);
  assert_int_equal(simple_call(f, 1, a->id, 0, &fid), 0); /* forked while they run */
  step_submit(f, 0, &p2, 1, 0, 1, NULL, &pd[LAYERS]);
  expect(f, step_finish(f, &pd[0], msg, NULL), ATTND_EABORTED, msg, "lost their KV");
  for (int l = 1; l < LAYERS; l++)
    assert_int_equal(step_finish(f, &pd[l], msg, NULL), 0);
  expect(f, step_finish(f, &pd[LAYERS], msg, NULL), ATTND_EABORTED, msg, "depends on");
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), ATTND_EABORTED);
  assert_int_equal(simple_call(f, 2, fid, 3, NULL), ATTND_EABORTED); /* the fork too */
  /* c never met the failed step. */
  spec_t dc = {.sim = c, .start = 5, .n = 1};
  plan_all_layers(f, &dc, 1);
  free(pd);
  sim_free(a);
  sim_free(c);
  fx_free(f);
}

/* Copy-on-write with both sides pipelined: a fork's first write copies the
 * shared block, and the parent's write into the same block, sent right
 * behind it without waiting, must wait for the copy to read it first. Both
 * sessions match the oracle on every layer. */
static void test_cow_order(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8_DYNAMIC, 32);
  sim_t *s = sim_new(), *t = sim_new();
  open_prefill_fork(f, s, t, 20, 100);
  pend_t *pd = calloc(2 * LAYERS, sizeof(*pd));
  spec_t dt = {.sim = t, .start = 20, .n = 1}, dsp = {.sim = s, .start = 20, .n = 2};
  for (int l = 0; l < LAYERS; l++) {
    step_submit(f, l, &dt, 1, 0, 1, NULL, &pd[2 * l]);
    step_submit(f, l, &dsp, 1, 0, 1, NULL, &pd[2 * l + 1]);
  }
  char msg[256];
  for (int i = 0; i < 2 * LAYERS; i++)
    if (step_finish(f, &pd[i], msg, NULL) != 0)
      fail_msg("step %d: %s", i, msg);
  spec_t next[2] = {{.sim = t, .start = 21, .n = 1}, {.sim = s, .start = 22, .n = 1}};
  plan_all_layers(f, next, 2);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_true(st.cow_copies >= 1);
  free(pd);
  sim_free(s);
  sim_free(t);
  fx_free(f);
}

static void count_fatal(void *arg) {
  (*(int *)arg)++;
}

/* A sticky device error answers UNAVAILABLE, as does a step pipelined behind
 * the failed one (it fails unrun), and tells the daemon once, so that it
 * drains and exits for its supervisor to restart it. */
static void test_device_lost(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 32);
  int fatal = 0;
  attnd_engine_on_fatal(f->e, count_fatal, &fatal);
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 100);
  open_session(f, a, 0, NULL, 0);
  pend_t *pd = calloc(2, sizeof(*pd));
  spec_t p1 = {.sim = a, .start = 0, .n = 12}, p2 = {.sim = a, .start = 12, .n = 1};
  attnd_backend_cpu_fail_next = ATTND_CPU_FAIL_DEVICE;
  step_submit(f, 0, &p1, 1, 0, 1, NULL, &pd[0]);
  step_submit(f, 0, &p2, 1, 0, 1, NULL, &pd[1]);
  char msg[256];
  expect(f, step_finish(f, &pd[0], msg, NULL), ATTND_EDEVICE, msg, NULL);
  expect(f, step_finish(f, &pd[1], msg, NULL), ATTND_EDEVICE, msg, "unusable");
  assert_int_equal(attnd_err_status(ATTND_EDEVICE), ATTND_STATUS_UNAVAILABLE);
  assert_int_equal(fatal, 1);
  free(pd);
  sim_free(a);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pipelined),
      cmocka_unit_test(test_backend_fault),
      cmocka_unit_test(test_decode_beside_prefill),
      cmocka_unit_test(test_copy_fault),
      cmocka_unit_test(test_fault_spreads),
      cmocka_unit_test(test_cow_order),
      cmocka_unit_test(test_device_lost),
      /* Again with every step queued behind a threadpool scan. */
      cmocka_unit_test_setup_teardown(test_pipelined, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_backend_fault, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_copy_fault, queued_on, queued_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

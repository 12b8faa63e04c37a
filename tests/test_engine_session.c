/* test_engine_session.c: sessions (daemon/engine/session.c): fork and
 * truncate with copy-on-write, limits and introspection, the idle sweep
 * (engine_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_fixture.h"

/* Fork shares blocks, both continue differently (copy-on-write); truncate
 * rolls back and the session continues. */
static void test_fork_truncate(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8_DYNAMIC, 64);
  sim_t *a = sim_new(), *b = sim_new();
  open_prefill_fork(f, a, b, 24, 200);
  attnd_engine_stats_t st0, st1;
  attnd_engine_stats(f->e, &st0);
  /* Both write into the shared partial block 1 (positions 16..23 held). */
  spec_t two[2] = {{.sim = a, .start = 24, .n = 5}, {.sim = b, .start = 24, .n = 3}};
  plan_all_layers(f, two, 2);
  attnd_engine_stats(f->e, &st1);
  assert_true(st1.cow_copies > st0.cow_copies);
  /* b rewrites inside the shared block 0 region too. */
  spec_t rw = {.sim = b, .start = 10, .n = 4};
  fill_tokens(f, b, 10, 14);
  plan_all_layers(f, &rw, 1);
  spec_t da = {.sim = a, .start = 29, .n = 1};
  plan_all_layers(f, &da, 1);
  /* Truncate a to 20 and continue. */
  assert_int_equal(simple_call(f, 2, a->id, 20, NULL), 0);
  for (int l = 0; l < LAYERS; l++)
    a->o[l].len = 20;
  fill_tokens(f, a, 20, 40);
  spec_t ta = {.sim = a, .start = 20, .n = 6};
  plan_all_layers(f, &ta, 1);
  spec_t tb = {.sim = b, .start = 14, .n = 2};
  plan_all_layers(f, &tb, 1);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), 0);
  check_engine(f);
  spec_t tb2 = {.sim = b, .start = 16, .n = 1};
  plan_all_layers(f, &tb2, 1);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* --max-sessions, Health facts, salts over 64 bytes, sessions per identity. */
static void test_limits_and_info(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  fx_config(f, ATTND_KV_FP8_DYNAMIC, 10);
  f->cfg.max_sessions = 2;
  f->cfg.max_sessions_per_identity = 2; /* the daemon-wide limit is what is tested */
  fx_start(f);
  attnd_engine_info_t info;
  attnd_engine_info(f->e, &info);
  assert_string_equal(info.backend, "cpu");
  assert_int_equal(info.kv_blocks, 10);
  /* fp8_dynamic: 1 byte per element plus an fp32 scale per token and head. */
  assert_true(fabs(info.kv_bytes_per_token - LAYERS * 2.0 * KVH * (HD + 4)) < 1e-9);
  assert_int_equal(info.kv_memory, 10ull * attnd_kv_block_bytes(&f->sh) * LAYERS);
  sim_t *a = sim_new(), *b = sim_new();
  open_session(f, a, 0, NULL, 0);
  uint8_t salt[65] = {0};
  res_t x = {0};
  attnd_engine_open_session(f->e, 1, 1, NULL, 0, salt, 65, on_done, &x);
  assert_int_equal(x.r.status, ATTND_EINVAL);
  open_session(f, b, 0, NULL, 0);
  res_t y = {0};
  attnd_engine_open_session(f->e, 3, 1, NULL, 0, NULL, 0, on_done, &y);
  assert_int_equal(y.r.status, ATTND_ENOSPC);
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), ATTND_ENOSPC);
  assert_int_equal(attnd_engine_list_sessions(f->e, 1, NULL, 0), 2);
  assert_int_equal(attnd_engine_list_sessions(f->e, 3, NULL, 0), 0);
  assert_int_equal(simple_call(f, 0, b->id, 0, NULL), 0);
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), 0);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.sessions, 2);
  assert_int_equal(st.blocks_total, 10);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* Sessions close after --session-idle without calls. */
static void noop_timer(uv_timer_t *t) {}

static void test_idle_close(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  fx_config(f, ATTND_KV_BF16, 16);
  f->cfg.session_idle_s = 1;
  fx_start(f);
  sim_t *a = sim_new();
  open_session(f, a, 0, NULL, 0);
  uv_timer_t t;
  uv_timer_init(&f->loop, &t);
  uv_timer_start(&t, noop_timer, 1400, 0);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  uv_close((uv_handle_t *)&t, NULL);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.sessions, 0);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), ATTND_ENOTFOUND);
  sim_free(a);
  fx_free(f);
}

static uint64_t open_as(fx_t *f, uint64_t identity, int *status) {
  res_t x = {0};
  attnd_engine_open_session(f->e, identity, 1, NULL, 0, NULL, 0, on_done, &x);
  wait_res(f, &x);
  *status = x.r.status;
  return x.r.session;
}

/* One identity cannot take every session: past its quota (by default a
 * quarter of --max-sessions) OpenSession and Fork answer RESOURCE_EXHAUSTED,
 * while other identities (root's uid 0 among them) still open theirs; a
 * close frees a place. --max-sessions-per-identity sets the quota. */
static void test_identity_quota(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  fx_config(f, ATTND_KV_BF16, 32);
  f->cfg.max_sessions = 9; /* quota 2 */
  fx_start(f);
  int st;
  uint64_t a1 = open_as(f, 1, &st);
  assert_int_equal(st, 0);
  open_as(f, 1, &st);
  assert_int_equal(st, 0);
  res_t x = {0};
  attnd_engine_open_session(f->e, 1, 1, NULL, 0, NULL, 0, on_done, &x);
  wait_res(f, &x);
  expect(f, x.r.status, ATTND_ENOSPC, x.r.message, "--max-sessions-per-identity");
  assert_int_equal(simple_call(f, 1, a1, 0, NULL), ATTND_ENOSPC); /* fork */
  for (uint64_t id = 0; id < 4; id += 3) {                        /* uid 0 and another uid */
    open_as(f, id, &st);
    assert_int_equal(st, 0);
    open_as(f, id, &st);
    assert_int_equal(st, 0);
    open_as(f, id, &st);
    assert_int_equal(st, ATTND_ENOSPC);
  }
  assert_int_equal(simple_call(f, 0, a1, 0, NULL), 0); /* close: room again */
  uint64_t a3 = open_as(f, 1, &st);
  assert_int_equal(st, 0);
  assert_int_equal(simple_call(f, 1, a3, 0, NULL), ATTND_ENOSPC);
  check_engine(f);
  fx_stop(f);
  /* An explicit quota. */
  f->cfg.max_sessions_per_identity = 3;
  fx_start(f);
  for (int i = 0; i < 3; i++) {
    open_as(f, 5, &st);
    assert_int_equal(st, 0);
  }
  open_as(f, 5, &st);
  assert_int_equal(st, ATTND_ENOSPC);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_identity_quota),
      cmocka_unit_test(test_fork_truncate),
      cmocka_unit_test(test_limits_and_info),
      cmocka_unit_test(test_idle_close),
      /* Again with every step queued behind a threadpool scan. */
      cmocka_unit_test_setup_teardown(test_fork_truncate, queued_on, queued_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_engine_kvcache.c: the KV cache (daemon/engine/kvcache.c): prefix hits
 * equal to cold computation, lookups that never trust the hash alone,
 * eviction under pressure and exhaustion that changes nothing, and the
 * engine without prefix caching (engine_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_fixture.h"
#include "internal.h" /* daemon/engine: attnd_prefix_test_force_collision */

/* Prefix hits give the same outputs as a cold session (fp32, rel L2 within
 * ATTND_TOL_PREFIX_HIT):
 * a and c compute the same prefix from the same k/v (c under a salt, so it
 * never shares); b hits a's blocks; b and c then take the same steps. */
static void test_prefix_hit_equals_miss(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 100);
  memcpy(b->tokens, a->tokens, sizeof(a->tokens));
  memcpy(c->tokens, a->tokens, sizeof(a->tokens));
  const uint8_t salt[3] = {1, 2, 3};
  open_session(f, a, 0, NULL, 0);
  assert_int_equal(open_session(f, c, 50, salt, 3), 0);
  uint64_t seed0 = f->rng;
  spec_t pa = {.sim = a, .start = 0, .n = 40};
  plan_all_layers(f, &pa, 1);
  f->rng = seed0;
  spec_t pc = {.sim = c, .start = 0, .n = 40};
  plan_all_layers(f, &pc, 1);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.blocks_used, 6);
  /* b asks for 50 tokens: 32 cached (whole blocks of a). */
  assert_int_equal(open_session(f, b, 50, NULL, 0), 32);
  sim_copy(b, a);
  for (int l = 0; l < LAYERS; l++)
    b->o[l].len = 32;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.prefix_queries, 2);
  assert_int_equal(st.prefix_hit_tokens, 32);
  assert_int_equal(st.prefix_miss_tokens, 50 + 18);
  /* c rolls back to the same point. */
  assert_int_equal(simple_call(f, 2, c->id, 32, NULL), 0);
  for (int l = 0; l < LAYERS; l++)
    c->o[l].len = 32;
  uint64_t seed1 = f->rng, plan;
  char msg[256];
  stepopt_t o32 = {.fp32_out = 1, .wrong_token_item = -1};
  uint8_t *outb[LAYERS], *outc[LAYERS];
  spec_t sb = {.sim = b, .start = 32, .n = 18};
  assert_int_equal(make_plan(f, &sb, 1, 1, &plan, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &sb, 1, plan, 1, &o32, msg, &outb[l]), 0);
  f->rng = seed1;
  spec_t sc = {.sim = c, .start = 32, .n = 18};
  assert_int_equal(make_plan(f, &sc, 1, 1, &plan, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &sc, 1, plan, 1, &o32, msg, &outc[l]), 0);
  for (int l = 0; l < LAYERS; l++) {
    double num = 0, den = 0;
    const float *x = (const float *)outb[l], *y = (const float *)outc[l];
    for (size_t i = 0; i < 18 * QH * HD; i++) {
      num += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
      den += (double)y[i] * y[i];
    }
    double rel = sqrt(num / den);
    print_message("  layer %d: hit vs no-hit rel L2 %.3g\n", l, rel);
    assert_true(rel <= ATTND_TOL_PREFIX_HIT);
    free(outb[l]);
    free(outc[l]);
  }
  check_engine(f);
  sim_free(a);
  sim_free(b);
  sim_free(c);
  fx_free(f);
}

/* With every hash equal, lookups still hit only on equal tokens. */
static void test_forced_collision(void **state) {
  attnd_prefix_test_force_collision = 1;
  fx_t *f = fx_new(ATTND_KV_FP8_DYNAMIC, 64);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 100);
  open_session(f, a, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 33};
  plan_all_layers(f, &pa, 1);
  fill_tokens(f, b, 0, 100); /* different tokens */
  assert_int_equal(open_session(f, b, 40, NULL, 0), 0);
  memcpy(c->tokens, a->tokens, sizeof(c->tokens));
  c->tokens[20] ^= 1; /* first block equal, second differs */
  assert_int_equal(open_session(f, c, 40, NULL, 0), 16);
  sim_copy(c, a);
  c->tokens[20] ^= 1;
  for (int l = 0; l < LAYERS; l++)
    c->o[l].len = 16;
  spec_t pc = {.sim = c, .start = 16, .n = 8};
  plan_all_layers(f, &pc, 1);
  spec_t pb = {.sim = b, .start = 0, .n = 20};
  plan_all_layers(f, &pb, 1);
  attnd_prefix_test_force_collision = 0;
  sim_free(a);
  sim_free(b);
  sim_free(c);
  fx_free(f);
}

/* A small pool: cached prefixes are evicted leaf first; when all blocks are
 * referenced a step fails with RESOURCE_EXHAUSTED and changes nothing. */
static void test_eviction_pressure(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 8);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 200);
  open_session(f, a, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 64}; /* 4 blocks, all published */
  plan_all_layers(f, &pa, 1);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), 0);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.blocks_cached, 4);
  fill_tokens(f, b, 0, 200);
  open_session(f, b, 0, NULL, 0);
  spec_t pb = {.sim = b, .start = 0, .n = 80}; /* 5 blocks: evicts one cached */
  plan_all_layers(f, &pb, 1);
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.evictions, 1);
  /* The evicted block was a's leaf: a's first 3 blocks still hit. */
  memcpy(c->tokens, a->tokens, sizeof(c->tokens));
  assert_int_equal(open_session(f, c, 100, NULL, 0), 48);
  /* Now every block is referenced (b: 5, c: 3): b cannot grow a block. */
  char msg[256];
  spec_t grow = {.sim = b, .start = 80, .n = 1};
  uint64_t plan;
  expect(f, make_plan(f, &grow, 1, 1, &plan, msg), ATTND_ENOSPC, msg, NULL);
  expect(f, step_ex(f, 0, &grow, 1, 0, 1, NULL, msg, NULL), ATTND_ENOSPC, msg, NULL);
  attnd_session_info_t info[8];
  assert_int_equal(attnd_engine_list_sessions(f->e, 1, NULL, 0), 2);
  assert_int_equal(attnd_engine_list_sessions(f->e, 1, info, 8), 2);
  /* Closing c leaves a's 3 blocks cached (evictable): b grows, and its
   * outputs still match the oracle, so the failures changed nothing. */
  assert_int_equal(simple_call(f, 0, c->id, 0, NULL), 0);
  plan_all_layers(f, &grow, 1);
  attnd_engine_stats(f->e, &st);
  assert_true(st.evictions >= 2);
  sim_free(a);
  sim_free(b);
  sim_free(c);
  fx_free(f);
}

/* --no-prefix-cache: nothing is published, nothing hits. */
static void test_no_prefix_cache(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  f->rng = 5;
  fx_config(f, ATTND_KV_BF16, 16);
  f->cfg.prefix_cache = 0;
  fx_start(f);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 100);
  memcpy(b->tokens, a->tokens, sizeof(a->tokens));
  open_session(f, a, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 40};
  plan_all_layers(f, &pa, 1);
  assert_int_equal(open_session(f, b, 40, NULL, 0), 0);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), 0);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.blocks_cached, 0);
  assert_int_equal(st.blocks_used, 0);
  assert_int_equal(st.prefix_queries, 0);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_prefix_hit_equals_miss),
      cmocka_unit_test(test_forced_collision),
      cmocka_unit_test(test_eviction_pressure),
      cmocka_unit_test(test_no_prefix_cache),
      /* Again with every step queued behind a threadpool scan. */
      cmocka_unit_test_setup_teardown(test_prefix_hit_equals_miss, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_eviction_pressure, queued_on, queued_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_engine_step.c: step admission (daemon/engine/step.c) against the
 * oracle: sessions grown over many steps for every cache type, mixed batches
 * with every mask, and every invalid step refused without changing anything
 * (engine_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_fixture.h"

/* A session grown over many steps across block boundaries, every layer, for
 * one cache type; plans reused over layers; then rewrites. */
static void grow_one(attnd_kv_type_t kv) {
  fx_t *f = fx_new(kv, 64);
  set_all_scales(f);
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 200);
  assert_int_equal(open_session(f, a, 0, NULL, 0), 0);
  uint32_t pos = 0;
  uint32_t chunks[] = {20, 1, 1, 13, 1, 17, 1, 1, 40, 3};
  for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
    spec_t sp = {.sim = a, .start = pos, .n = chunks[c]};
    plan_all_layers(f, &sp, 1);
    pos += chunks[c];
  }
  /* Rewrite the last 5 positions (rejected drafts) with new tokens. */
  fill_tokens(f, a, pos - 5, pos);
  spec_t rw = {.sim = a, .start = pos - 5, .n = 3};
  plan_all_layers(f, &rw, 1);
  /* Inline steps, fp32 output and lse, k at an odd address. */
  stepopt_t o = {.fp32_out = 1, .want_lse = 1, .wrong_token_item = -1, .odd_offset = 1};
  spec_t d = {.sim = a, .start = pos - 2, .n = 2};
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &d, 1, 0, 1, &o, NULL, NULL), 0);
  check_engine(f);
  print_message("  %s: %u positions, worst rel L2 %.3g\n", attnd_kv_type_name(kv), pos, f->worst);
  sim_free(a);
  fx_free(f);
}

static void test_grow_bf16(void **state) {
  grow_one(ATTND_KV_BF16);
}

static void test_grow_fp16(void **state) {
  grow_one(ATTND_KV_FP16);
}

static void test_grow_int8(void **state) {
  grow_one(ATTND_KV_INT8);
}

static void test_grow_fp8(void **state) {
  grow_one(ATTND_KV_FP8);
}

static void test_grow_int8_dynamic(void **state) {
  grow_one(ATTND_KV_INT8_DYNAMIC);
}

static void test_grow_fp8_dynamic(void **state) {
  grow_one(ATTND_KV_FP8_DYNAMIC);
}

static void test_grow_int4(void **state) {
  grow_one(ATTND_KV_INT4);
}

/* Several sessions interleaved, mixed prefill and decode in one step, items
 * without q, every mask kind. */
static void test_mixed_batch(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 96);
  sim_t *s[4];
  for (int i = 0; i < 4; i++) {
    s[i] = sim_new();
    fill_tokens(f, s[i], 0, 300);
    open_session(f, s[i], 0, NULL, 0);
  }
  /* Prefill with different masks in one plan. */
  spec_t p[4] = {
      {.sim = s[0], .start = 0, .n = 37},
      {.sim = s[1], .start = 0, .n = 20, .mask = MK_SLIDING, .param = 7},
      {.sim = s[2], .start = 0, .n = 33, .mask = MK_DOCUMENT, .ndocs = 3, .docs = {10, 15, 8}},
      {.sim = s[3], .start = 0, .n = 18, .kv_only = 1},
  };
  plan_all_layers(f, p, 4);
  /* Decode + prefill mixed, prefix-LM, full and custom intervals. */
  int32_t *iv = calloc(4 * 64, sizeof(int32_t));
  uint32_t kv3 = 18 + 9;
  for (uint32_t j = 0; j < kv3; j++) {
    uint32_t a = (uint32_t)(oracle_rng_next(&f->rng) % (kv3 + 1));
    uint32_t b = a + (uint32_t)(oracle_rng_next(&f->rng) % 5);
    iv[j] = (int32_t)a;
    iv[kv3 + j] = (int32_t)b;
    iv[2 * kv3 + j] = (int32_t)kv3 - 2;
    iv[3 * kv3 + j] = (int32_t)kv3;
  }
  for (int round = 0; round < 3; round++) {
    spec_t m[4] = {
        {.sim = s[0], .start = 37 + (uint32_t)round, .n = 1},
        {.sim = s[1], .start = 20 + 5 * (uint32_t)round, .n = 5, .mask = MK_PREFIX_LM, .param = 12},
        {.sim = s[2], .start = 33 + (uint32_t)round, .n = 1, .mask = MK_FULL},
        {.sim = s[3],
         .start = 18,
         .n = 9,
         .mask = MK_CUSTOM,
         .intervals = iv,
         .bidirectional = round == 1},
    };
    plan_all_layers(f, m, 4);
  }
  /* Layers may move unevenly: layer 0 ahead of the others. */
  spec_t d0 = {.sim = s[0], .start = 40, .n = 1};
  assert_int_equal(step(f, 0, &d0, 1, 0), 0);
  spec_t d1 = {.sim = s[0], .start = 41, .n = 1};
  assert_int_equal(step(f, 0, &d1, 1, 0), 0);
  spec_t both = {.sim = s[0], .start = 40, .n = 2};
  for (int l = 1; l < LAYERS; l++)
    assert_int_equal(step(f, l, &both, 1, 0), 0);
  check_engine(f);
  print_message("  mixed batch worst rel L2 %.3g\n", f->worst);
  free(iv);
  for (int i = 0; i < 4; i++)
    sim_free(s[i]);
  fx_free(f);
}

/* Every invalid case fails as specified and changes nothing: the sessions
 * continue afterwards and still match the oracle. */
static void test_invalid_leave_state(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8, 64);
  char msg[256];
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 300);
  fill_tokens(f, b, 0, 300);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  spec_t pre[2] = {{.sim = a, .start = 0, .n = 12}, {.sim = b, .start = 0, .n = 5}};
  /* Static type without scales: FAILED_PRECONDITION. */
  expect(f, step_ex(f, 0, pre, 2, 0, 1, NULL, msg, NULL), ATTND_EPRECOND, msg, "scales");
  set_all_scales(f);
  plan_all_layers(f, pre, 2);
  spec_t good = {.sim = b, .start = 5, .n = 2};
  /* start > len, naming the item. */
  spec_t s1[2] = {good, {.sim = a, .start = 17, .n = 1}};
  expect(f, step_ex(f, 0, s1, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg,
         "item 1: start 17 > len 12");
  /* Session twice. */
  spec_t s2[2] = {{.sim = a, .start = 12, .n = 1}, {.sim = a, .start = 12, .n = 1}};
  expect(f, step_ex(f, 0, s2, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Beyond max_context. */
  spec_t s3[2] = {good, {.sim = a, .start = 12, .n = MAXCTX}};
  expect(f, step_ex(f, 0, s3, 2, 0, 1, NULL, msg, NULL), ATTND_ERANGE, msg, "item 1");
  /* Layer out of range. */
  spec_t s4 = good;
  expect(f, step_ex(f, LAYERS, &s4, 1, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "layer");
  /* Layer 1 past layer 0. */
  spec_t good1 = {.sim = b, .start = 3, .n = 2};
  spec_t s5[2] = {good1, {.sim = a, .start = 12, .n = 1}};
  expect(f, step_ex(f, 1, s5, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Token ids that differ from layer 0's. */
  spec_t s6[2] = {{.sim = b, .start = 3, .n = 2}, {.sim = a, .start = 10, .n = 2}};
  stepopt_t wt = {.wrong_token_item = 1};
  expect(f, step_ex(f, 1, s6, 2, 0, 1, &wt, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Non-finite k. */
  stepopt_t nan = {.corrupt = 1, .wrong_token_item = -1};
  spec_t s7[2] = {good, {.sim = a, .start = 12, .n = 3}};
  expect(f, step_ex(f, 0, s7, 2, 0, 1, &nan, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Wrong dtype. */
  stepopt_t bd = {.bad_dtype = 1, .wrong_token_item = -1};
  expect(f, step_ex(f, 0, s7, 2, 0, 1, &bd, msg, NULL), ATTND_EINVAL, msg, "dtype");
  /* k with more rows than the items. */
  stepopt_t br = {.bad_rows = 1, .wrong_token_item = -1};
  expect(f, step_ex(f, 0, s7, 2, 0, 1, &br, msg, NULL), ATTND_EINVAL, msg, "shape");
  /* Masks: window 0, intervals start > end, intervals of the wrong length,
   * an unknown kind. (Documents that do not sum to kv_len never reach the
   * engine: the RPC layer refuses them while expanding; test_rpc.c.) */
  spec_t s8[2] = {good, {.sim = a, .start = 12, .n = 2, .mask = MK_SLIDING}};
  expect(f, step_ex(f, 0, s8, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "item 1");
  int32_t iv[4 * 14] = {0};
  iv[3] = 5; /* lts[3] = 5 > lte[3] = 0 */
  spec_t s10[2] = {good, {.sim = a, .start = 12, .n = 2, .mask = MK_CUSTOM, .intervals = iv}};
  expect(f, step_ex(f, 0, s10, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Intervals of the wrong length (for kv_len 13 instead of 14). */
  {
    itembuf_t ib;
    spec_t s12[2] = {good, {.sim = a, .start = 12, .n = 2, .mask = MK_CUSTOM, .intervals = iv}};
    build_items(s12, 2, &ib);
    ib.items[1].mask.intervals_len = 13;
    res_t x = {0};
    attnd_engine_plan(f->e, 1, 1, ib.items, 2, on_done, &x);
    wait_res(f, &x);
    expect(f, x.r.status, ATTND_EINVAL, x.r.message, "item 1: intervals");
    ib.items[1].mask.intervals_len = 14;
    ib.items[1].mask.kind = (attnd_mask_kind_t)99;
    res_t z = {0};
    attnd_engine_plan(f->e, 1, 1, ib.items, 2, on_done, &z);
    wait_res(f, &z);
    expect(f, z.r.status, ATTND_EINVAL, z.r.message, "item 1: unknown mask kind");
    /* Steps of another identity. */
    res_t y = {0};
    attnd_engine_plan(f->e, 2, 1, ib.items, 1, on_done, &y);
    wait_res(f, &y);
    expect(f, y.r.status, ATTND_EPERM, y.r.message, "item 0");
    ib_free(&ib);
  }
  /* Unknown session, other identity. */
  sim_t ghost = {.id = 0x1234};
  memcpy(ghost.tokens, a->tokens, sizeof(ghost.tokens));
  spec_t s11[2] = {good, {.sim = &ghost, .start = 0, .n = 1}};
  expect(f, step_ex(f, 0, s11, 2, 0, 1, NULL, msg, NULL), ATTND_ENOTFOUND, msg, "item 1");
  res_t x = {0};
  attnd_engine_close_session(f->e, 2, 1, a->id, on_done, &x);
  wait_res(f, &x);
  assert_int_equal(x.r.status, ATTND_EPERM);
  /* Fork/Truncate need equal lengths; truncate beyond len. */
  spec_t ahead = {.sim = a, .start = 12, .n = 2};
  assert_int_equal(step(f, 0, &ahead, 1, 0), 0);
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), ATTND_EPRECOND);
  assert_int_equal(simple_call(f, 2, a->id, 3, NULL), ATTND_EPRECOND);
  for (int l = 1; l < LAYERS; l++)
    assert_int_equal(step(f, l, &ahead, 1, 0), 0);
  assert_int_equal(simple_call(f, 2, a->id, 99, NULL), ATTND_EINVAL);
  /* Everything above left a and b intact: continue them, all layers. */
  spec_t cont[2] = {{.sim = a, .start = 14, .n = 3}, {.sim = b, .start = 5, .n = 4}};
  plan_all_layers(f, cont, 2);
  spec_t dec[2] = {{.sim = a, .start = 17, .n = 1}, {.sim = b, .start = 9, .n = 1}};
  plan_all_layers(f, dec, 2);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* Finite values past the bounds the kernels are faithful within
 * (docs/numerics.md section 6) are refused like non-finite ones: the step
 * answers INVALID_ARGUMENT naming the item, the tensor and the bound, and
 * nothing is written. At the bound a step is computed, and matches the
 * oracle. bf16 activations: |q|, |k| <= 2^48, |v| <= 2^100; an fp16 cache
 * adds 65504 for v and 65504/sqrt(2) for k (RoPE on). */
static void bounds_case(attnd_kv_type_t kv) {
  fx_t *f = fx_new(kv, 64);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 100);
  fill_tokens(f, b, 0, 100);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  spec_t pre[2] = {{.sim = a, .start = 0, .n = 9}, {.sim = b, .start = 0, .n = 4}};
  plan_all_layers(f, pre, 2);
  spec_t s[2] = {{.sim = a, .start = 9, .n = 3}, {.sim = b, .start = 4, .n = 2}};
  const size_t kvrow = KVH * HD, qrow = QH * HD;
  int fp16 = kv == ATTND_KV_FP16;
  struct {
    char t;
    double over, at;
    const char *bound;
  } cases[] = {
      {'q', 1e19, 0x1p48, "|q| <= 2^48"},
      {'k', 1e19, fp16 ? 46080.0 : 0x1p48, fp16 ? "|k| <= 65504/sqrt(2)" : "|k| <= 2^48"},
      {'k', 0x1p48 + 0x1p41, fp16 ? 32768.0 : 0x1p48, fp16 ? "65504/sqrt(2)" : "2^48"},
      {'v', 3e38, fp16 ? 65280.0 : 0x1p100, fp16 ? "|v| <= 65504" : "|v| <= 2^100"},
      {'v', fp16 ? 65536.0 : 0x1p100 + 0x1p93, fp16 ? 65280.0 : 0x1p100, fp16 ? "65504" : "2^100"},
  };
  char msg[256], need[128];
  uint32_t len_a = 9, len_b = 4;
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    for (int sign = -1; sign <= 1; sign += 2) {
      /* Past the bound in item 1 (its second row): refused, nothing written. */
      size_t row = 4; /* q and k/v rows alike: item 1 starts at row 3 */
      stepopt_t o = {
          .wrong_token_item = -1, .poke = cases[c].t, .poke_value = sign * cases[c].over};
      o.poke_elem = (uint32_t)(row * (cases[c].t == 'q' ? qrow : kvrow) + 7);
      snprintf(need, sizeof(need), "item 1: %c holds", cases[c].t);
      int rc = step_ex(f, 0, s, 2, 0, 1, &o, msg, NULL);
      expect(f, rc, ATTND_EINVAL, msg, need);
      expect(f, rc, ATTND_EINVAL, msg, cases[c].bound);
      assert_int_equal(session_len(f, a->id), len_a);
      assert_int_equal(session_len(f, b->id), len_b);
      /* At the bound: computed, and equal to the oracle within the bound. */
      o.poke_value = sign * cases[c].at;
      rc = step_ex(f, 0, s, 2, 0, 1, &o, msg, NULL);
      if (rc)
        fail_msg("%c = %g at the bound: %d %s", cases[c].t, o.poke_value, rc, msg);
      len_a = 12; /* later cases rewrite the same positions */
      len_b = 6;
    }
  }
  assert_int_equal(session_len(f, a->id), len_a);
  for (int l = 1; l < LAYERS; l++)
    assert_int_equal(step(f, l, s, 2, 0), 0);
  check_engine(f);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

static void test_bounds_bf16(void **state) {
  bounds_case(ATTND_KV_BF16);
}

static void test_bounds_fp16_cache(void **state) {
  bounds_case(ATTND_KV_FP16);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_grow_bf16),
      cmocka_unit_test(test_grow_fp16),
      cmocka_unit_test(test_grow_int8),
      cmocka_unit_test(test_grow_fp8),
      cmocka_unit_test(test_grow_int8_dynamic),
      cmocka_unit_test(test_grow_fp8_dynamic),
      cmocka_unit_test(test_grow_int4),
      cmocka_unit_test(test_mixed_batch),
      cmocka_unit_test(test_invalid_leave_state),
      cmocka_unit_test(test_bounds_bf16),
      cmocka_unit_test(test_bounds_fp16_cache),
      /* Again with every step queued behind a threadpool scan. */
      cmocka_unit_test_setup_teardown(test_grow_bf16, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_grow_int4, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_mixed_batch, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_invalid_leave_state, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_bounds_bf16, queued_on, queued_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

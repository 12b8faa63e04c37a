/* test_engine_scales.c: static scales (daemon/engine/scales.c,
 * scales_file.c): validation, versions, atomic persistence, and SetScales
 * through the engine against the oracle, across a restart. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine_fixture.h"
#include "internal.h" /* daemon/engine: the scales table */

static attnd_kshape_t shape(attnd_kv_type_t kv) {
  attnd_kshape_t s = {.q_heads = 4,
                      .kv_heads = 2,
                      .head_dim = 64,
                      .block_size = 16,
                      .dtype = ATTND_DT_BF16,
                      .kv = kv};
  return s;
}

static float buf[4][128];

static attnd_tensor_t ft(float *p, int ndim, uint32_t a, uint32_t b) {
  attnd_tensor_t t = {.present = 1, .dtype = ATTND_DT_FP32, .ndim = ndim, .data = (uint8_t *)p};
  t.shape[0] = a;
  t.shape[1] = b;
  t.nbytes = (size_t)a * (ndim == 2 ? b : 1) * 4;
  return t;
}

static void fill(float v, float z) {
  for (int i = 0; i < 128; i++) {
    buf[0][i] = buf[1][i] = v + 0.001f * (float)i;
    buf[2][i] = buf[3][i] = z;
  }
}

static void test_validate(void **state) {
  char msg[256];
  attnd_scales_t s;
  attnd_kshape_t sh = shape(ATTND_KV_INT8);
  assert_int_equal(attnd_scales_init(&s, &sh, 3, NULL), 0);
  fill(0.5f, 3.0f);
  attnd_scales_req_t r = {
      .layer = 1, .k_scale = ft(buf[0], 1, 2, 0), .v_scale = ft(buf[1], 1, 2, 0)};
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), 0);
  r.layer = 3;
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  r.layer = 0;
  buf[0][1] = 0.0f; /* scale must be > 0 */
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  assert_non_null(strstr(msg, "k_scale[1]"));
  buf[0][1] = 1.0f / 0.0f;
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  fill(0.5f, 3.0f);
  r.k_zero = ft(buf[2], 2, 2, 64); /* zero points for a type without them */
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  r.k_zero.present = 0;
  r.v_scale = ft(buf[1], 2, 2, 64); /* mixed shapes */
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  r.k_scale = ft(buf[0], 2, 2, 64);
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), 0);
  r.k_scale.dtype = ATTND_DT_BF16;
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  attnd_scales_free(&s);

  /* int4: per channel with zero points in [0, 15]. */
  sh = shape(ATTND_KV_INT4);
  assert_int_equal(attnd_scales_init(&s, &sh, 1, NULL), 0);
  attnd_scales_req_t q = {.k_scale = ft(buf[0], 2, 2, 64), .v_scale = ft(buf[1], 2, 2, 64)};
  assert_int_equal(attnd_scales_validate(&s, &q, msg, sizeof(msg)), ATTND_EINVAL); /* no zeros */
  q.k_zero = ft(buf[2], 2, 2, 64);
  q.v_zero = ft(buf[3], 2, 2, 64);
  assert_int_equal(attnd_scales_validate(&s, &q, msg, sizeof(msg)), 0);
  buf[3][7] = 16.0f;
  assert_int_equal(attnd_scales_validate(&s, &q, msg, sizeof(msg)), ATTND_EINVAL);
  buf[3][7] = 0.0f;
  q.k_scale = ft(buf[0], 1, 2, 0);
  q.v_scale = ft(buf[1], 1, 2, 0);
  assert_int_equal(attnd_scales_validate(&s, &q, msg, sizeof(msg)), ATTND_EINVAL); /* per head */
  attnd_scales_free(&s);

  /* Types without static scales refuse SetScales. */
  sh = shape(ATTND_KV_INT8_DYNAMIC);
  assert_int_equal(attnd_scales_init(&s, &sh, 1, NULL), 0);
  assert_int_equal(attnd_scales_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  attnd_scales_free(&s);
}

static void test_persist(void **state) {
  char dir[] = "/tmp/attnd-scales-XXXXXX", sub[128], err[256];
  assert_non_null(mkdtemp(dir));
  snprintf(sub, sizeof(sub), "%s/state/deeper", dir);
  attnd_kshape_t sh = shape(ATTND_KV_INT4);
  attnd_scales_t s;
  assert_int_equal(attnd_scales_init(&s, &sh, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&s, err, sizeof(err)), 0); /* no file yet */
  fill(0.25f, 7.0f);
  attnd_scales_req_t q = {.layer = 2,
                          .k_scale = ft(buf[0], 2, 2, 64),
                          .v_scale = ft(buf[1], 2, 2, 64),
                          .k_zero = ft(buf[2], 2, 2, 64),
                          .v_zero = ft(buf[3], 2, 2, 64)};
  assert_int_equal(attnd_scales_validate(&s, &q, err, sizeof(err)), 0);
  assert_int_equal(attnd_scales_apply(&s, &q), 1);
  q.layer = 0;
  assert_int_equal(attnd_scales_apply(&s, &q), 2);
  uint8_t *b;
  size_t len;
  assert_int_equal(attnd_scales_serialize(&s, &b, &len), 0);
  assert_int_equal(attnd_scales_write_file(s.path, b, len), 0);
  free(b);
  char tmp[600];
  snprintf(tmp, sizeof(tmp), "%s.tmp", s.path);
  assert_int_not_equal(access(tmp, F_OK), 0); /* renamed, no temp left */

  attnd_scales_t r;
  assert_int_equal(attnd_scales_init(&r, &sh, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&r, err, sizeof(err)), 0);
  assert_int_equal(r.l[2].present, 1);
  assert_int_equal(r.l[1].present, 0);
  assert_int_equal(r.l[2].version, 1);
  assert_int_equal(r.l[0].version, 2);
  assert_memory_equal(r.l[2].k_scale, s.l[2].k_scale, 128 * 4);
  assert_memory_equal(r.l[2].v_zero, s.l[2].v_zero, 128 * 4);
  /* Versions keep growing across restarts. */
  assert_int_equal(attnd_scales_apply(&r, &q), 3);
  attnd_scales_free(&r);

  /* Another shard's heads (same held count, another range or model) ignore
   * the file: its scales are for other heads. */
  attnd_kshape_t shard = sh;
  shard.model_kv_heads = 4;
  shard.kv_head_begin = 2;
  assert_int_equal(attnd_scales_init(&r, &shard, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&r, err, sizeof(err)), 1);
  assert_non_null(strstr(err, "written for kv heads 0:2 of 2, this daemon holds 2:4 of 4"));
  assert_int_equal(r.l[2].present, 0);
  attnd_scales_free(&r);
  /* A file of shard 2:4 is read by that shard only. */
  assert_int_equal(attnd_scales_init(&r, &shard, 3, sub), 0);
  assert_int_equal(attnd_scales_validate(&r, &q, err, sizeof(err)), 0);
  attnd_scales_apply(&r, &q);
  assert_int_equal(attnd_scales_serialize(&r, &b, &len), 0);
  assert_int_equal(attnd_scales_write_file(r.path, b, len), 0);
  free(b);
  attnd_scales_free(&r);
  assert_int_equal(attnd_scales_init(&r, &shard, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&r, err, sizeof(err)), 0);
  assert_int_equal(r.l[0].present, 1);
  attnd_scales_free(&r);
  assert_int_equal(attnd_scales_init(&r, &sh, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&r, err, sizeof(err)), 1);
  assert_int_equal(r.l[0].present, 0);
  attnd_scales_free(&r);
  /* A version-1 file (no range) is the whole model's. */
  assert_int_equal(attnd_scales_init(&r, &sh, 3, sub), 0);
  attnd_scales_apply(&r, &q);
  assert_int_equal(attnd_scales_serialize(&r, &b, &len), 0);
  uint8_t *v1 = malloc(len - 8);
  memcpy(v1, b, 28);
  memcpy(v1 + 28, b + 36, len - 36 - 8);
  v1[7] = '1';
  uint64_t sum = XXH64(v1, len - 16, 0);
  uint8_t *v1s = malloc(len - 8);
  memcpy(v1s, v1, len - 16);
  memcpy(v1s + len - 16, &sum, 8);
  assert_int_equal(attnd_scales_write_file(r.path, v1s, len - 8), 0);
  free(v1);
  free(v1s);
  free(b);
  attnd_scales_free(&r);
  assert_int_equal(attnd_scales_init(&r, &sh, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&r, err, sizeof(err)), 0);
  assert_int_equal(r.l[0].present, 1);
  assert_memory_equal(r.l[0].k_scale, s.l[0].k_scale, 128 * 4);
  attnd_scales_free(&r);
  assert_int_equal(attnd_scales_init(&r, &shard, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&r, err, sizeof(err)), 1);
  attnd_scales_free(&r);
  /* Back to the file of s for the checks below. */
  assert_int_equal(attnd_scales_serialize(&s, &b, &len), 0);
  assert_int_equal(attnd_scales_write_file(s.path, b, len), 0);
  free(b);

  /* Another shape ignores the file; a corrupt file is ignored too. */
  attnd_kshape_t other = shape(ATTND_KV_INT8);
  assert_int_equal(attnd_scales_init(&r, &other, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&r, err, sizeof(err)), 1);
  assert_int_equal(r.l[2].present, 0);
  attnd_scales_free(&r);
  FILE *f = fopen(s.path, "r+b");
  assert_non_null(f);
  fseek(f, 40, SEEK_SET);
  fputc(0x5a, f);
  fclose(f);
  assert_int_equal(attnd_scales_init(&r, &sh, 3, sub), 0);
  assert_int_equal(attnd_scales_load(&r, err, sizeof(err)), 1);
  assert_non_null(strstr(err, "checksum"));
  attnd_scales_free(&r);
  attnd_scales_free(&s);
  char cmd[300];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

/* Scales survive a restart: same inputs, identical outputs. SetScales on a
 * layer holding KV needs drop_cached_kv. */
static void test_scales_persist(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  snprintf(f->state_dir, sizeof(f->state_dir), "/tmp/attnd-eng-XXXXXX");
  assert_non_null(mkdtemp(f->state_dir));
  f->rng = 99;
  fx_config(f, ATTND_KV_INT4, 32);
  fx_start(f);
  set_all_scales(f);
  uint64_t seed = f->rng;
  uint8_t *out1[LAYERS], *out2[LAYERS];
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 100);
  open_session(f, a, 0, NULL, 0);
  spec_t sp = {.sim = a, .start = 0, .n = 21};
  uint64_t plan;
  char msg[256];
  assert_int_equal(make_plan(f, &sp, 1, 1, &plan, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &sp, 1, plan, 1, NULL, msg, &out1[l]), 0);
  /* The layer holds KV: a change needs drop_cached_kv, which zeroes len[1]. */
  uint64_t v1, v2;
  assert_int_equal(set_scales(f, 1, 0, &v1), ATTND_EPRECOND);
  float keep_k[KVH * HD], keep_v[KVH * HD];
  memcpy(keep_k, f->ks[1], sizeof(keep_k));
  memcpy(keep_v, f->vs[1], sizeof(keep_v));
  assert_int_equal(set_scales(f, 1, 1, &v2), 0);
  assert_true(v2 > 3);
  spec_t l1 = {.sim = a, .start = 0, .n = 21};
  a->o[1].len = 0;
  assert_int_equal(step(f, 1, &l1, 1, 0), 0); /* layer 1 recomputed under new scales */
  spec_t bad = {.sim = a, .start = 21, .n = 1};
  fill_tokens(f, a, 21, 22);
  (void)bad;
  sim_free(a);
  fx_stop(f);
  /* Restart on the same state dir; put back layer 1's first scales through
   * the test's copy only, the engine must restore everything itself. */
  float new_k[KVH * HD], new_v[KVH * HD];
  memcpy(new_k, f->ks[1], sizeof(new_k));
  memcpy(new_v, f->vs[1], sizeof(new_v));
  fx_start(f);
  a = sim_new();
  f->rng = seed;
  fill_tokens(f, a, 0, 100);
  open_session(f, a, 0, NULL, 0);
  /* Replaying the same inputs: layers 0 and 2 must match bit for bit; layer 1
   * now has the new scales, so compare it with the oracle only. */
  spec_t sp2 = {.sim = a, .start = 0, .n = 21};
  assert_int_equal(make_plan(f, &sp2, 1, 1, &plan, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &sp2, 1, plan, 1, NULL, msg, &out2[l]), 0);
  assert_memory_equal(out1[0], out2[0], 21 * QH * HD * 2);
  assert_memory_equal(out1[2], out2[2], 21 * QH * HD * 2);
  for (int l = 0; l < LAYERS; l++) {
    free(out1[l]);
    free(out2[l]);
  }
  (void)keep_k;
  (void)keep_v;
  (void)new_k;
  (void)new_v;
  sim_free(a);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", f->state_dir);
  assert_int_equal(system(cmd), 0);
  fx_free(f);
}

/* SetScales is an ordinary backend job in its layer's order: a step still
 * running when new scales are set is computed with the old ones, and a step
 * admitted right after them (not waiting for anything) with the new ones;
 * each is checked against the oracle with the scales of its own time. */
static void test_scales_between_steps(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8, 32);
  set_all_scales(f);
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 100);
  open_session(f, a, 0, NULL, 0);
  spec_t sp = {.sim = a, .start = 0, .n = 16};
  pend_t *pa = calloc(1, sizeof(*pa)), *pb = calloc(1, sizeof(*pb));
  step_submit(f, 0, &sp, 1, 0, 1, NULL, pa);
  /* Layer 0 holds KV now (admitted): new scales must drop it. They clip most
   * of N(0,1) (a tenth of the range), so a step computed with the wrong ones
   * is far outside the bound. */
  uint64_t v;
  g_scale_mult = 0.1;
  assert_int_equal(set_scales(f, 0, 1, &v), 0);
  g_scale_mult = 1.0;
  step_submit(f, 0, &sp, 1, 0, 1, NULL, pb);
  char msg[256];
  if (step_finish(f, pa, msg, NULL) != 0)
    fail_msg("step before the scales: %s", msg);
  a->o[0].len = 0; /* the drop */
  if (step_finish(f, pb, msg, NULL) != 0)
    fail_msg("step after the scales: %s", msg);
  check_engine(f);
  free(pa);
  free(pb);
  sim_free(a);
  fx_free(f);
}

/* A SetScales whose state file cannot be written answers INTERNAL and
 * changes nothing: the layer keeps its KV (drop_cached_kv notwithstanding),
 * the old scales stay in force for the next step, the prefix index keeps its
 * blocks and no version is used up. Once the file can be written again, the
 * same call succeeds. */
static void test_scales_persist_failure(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  snprintf(f->state_dir, sizeof(f->state_dir), "/tmp/attnd-eng-XXXXXX");
  assert_non_null(mkdtemp(f->state_dir));
  f->rng = 7;
  fx_config(f, ATTND_KV_INT8, 32);
  fx_start(f);
  uint64_t v0;
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(set_scales(f, l, 0, &v0), 0);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 100);
  memcpy(b->tokens, a->tokens, sizeof(a->tokens));
  open_session(f, a, 0, NULL, 0);
  spec_t sp = {.sim = a, .start = 0, .n = 2 * BS + 1, .stream = 5};
  plan_all_layers(f, &sp, 1);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  uint32_t cached = st.blocks_used;
  /* The state directory becomes a plain file: no temp file can be made. */
  char moved[96], cmd[256];
  snprintf(moved, sizeof(moved), "%s.away", f->state_dir);
  assert_int_equal(rename(f->state_dir, moved), 0);
  FILE *blocker = fopen(f->state_dir, "w");
  assert_non_null(blocker);
  fclose(blocker);
  float keep_k[KVH * HD], keep_v[KVH * HD];
  memcpy(keep_k, f->ks[0], sizeof(keep_k));
  memcpy(keep_v, f->vs[0], sizeof(keep_v));
  g_scale_mult = 0.1; /* scales that would clip most values: wrong ones show */
  uint64_t v1 = 0;
  int rc = set_scales(f, 0, 1, &v1);
  g_scale_mult = 1.0;
  assert_int_equal(rc, ATTND_EINTERNAL);
  memcpy(f->ks[0], keep_k, sizeof(keep_k)); /* what the engine must still use */
  memcpy(f->vs[0], keep_v, sizeof(keep_v));
  check_engine(f);
  assert_int_equal(session_len(f, a->id), 2 * BS + 1); /* nothing dropped */
  spec_t dec = {.sim = a, .start = 2 * BS + 1, .n = 1};
  fill_tokens(f, a, 2 * BS + 1, 2 * BS + 2);
  plan_all_layers(f, &dec, 1); /* the old scales, checked against the oracle */
  /* The prefix index kept a's full blocks: a new session hits them. */
  assert_int_equal(open_session(f, b, 2 * BS + 1, NULL, 0), 2 * BS);
  attnd_engine_stats(f->e, &st);
  assert_true(st.blocks_used >= cached);
  /* Writable again: the call succeeds, with the next version. */
  assert_int_equal(unlink(f->state_dir), 0);
  assert_int_equal(rename(moved, f->state_dir), 0);
  uint64_t v2 = 0;
  assert_int_equal(set_scales(f, 0, 1, &v2), 0);
  assert_int_equal(v2, v0 + 1);
  assert_int_equal(session_len(f, a->id), 0); /* layer 0 dropped (ListSessions: len[0]) */
  sim_free(a);
  sim_free(b);
  snprintf(cmd, sizeof(cmd), "rm -rf %s", f->state_dir);
  assert_int_equal(system(cmd), 0);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_validate),
      cmocka_unit_test(test_persist),
      cmocka_unit_test(test_scales_persist),
      cmocka_unit_test(test_scales_between_steps),
      cmocka_unit_test(test_scales_persist_failure),
      /* Again with every step queued behind a threadpool scan. */
      cmocka_unit_test_setup_teardown(test_scales_persist, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_scales_between_steps, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_scales_persist_failure, queued_on, queued_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

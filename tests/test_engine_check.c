/* test_engine_check.c: random operations with the bookkeeping checker
 * (daemon/engine/check.c, attnd_engine_check) run after every one and every
 * output against the oracle (engine_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_fixture.h"

/* Random operations, bookkeeping checked after every one (two seconds). */
static void test_random_ops(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 14);
  enum { NS = 6 };
  sim_t *s[NS] = {0};
  uint32_t len[NS] = {0};
  /* Few distinct token streams, so prefixes repeat and hit. */
  uint32_t streams[3][MAXCTX];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < MAXCTX; j++)
      streams[i][j] = (uint32_t)(oracle_rng_next(&f->rng) % 7) + (uint32_t)i * 100;
  uint64_t t0 = uv_hrtime();
  int ops = 0, enospc = 0, hits = 0;
  int stream_of[NS] = {0};
  while (uv_hrtime() - t0 < 2000000000ull && ops < 3000) {
    ops++;
    int i = (int)(oracle_rng_next(&f->rng) % NS);
    int op = (int)(oracle_rng_next(&f->rng) % 10);
    if (!s[i]) {
      s[i] = sim_new();
      int st = (int)(oracle_rng_next(&f->rng) % 3);
      stream_of[i] = st + 1;
      memcpy(s[i]->tokens, streams[st], sizeof(s[i]->tokens));
      uint32_t cached =
          open_session(f, s[i], 1 + (uint32_t)(oracle_rng_next(&f->rng) % 90), NULL, 0);
      hits += cached > 0;
      /* The cached KV is the stream's: the oracle gets the same rows. */
      uint16_t kr[KVH * HD], vr[KVH * HD];
      for (int l = 0; l < LAYERS; l++) {
        oracle_scales_t sc = oscales(f, l);
        for (uint32_t p = 0; p < cached; p++) {
          det_kv(stream_of[i], p, l, kr, vr);
          oracle_session_write(&f->sh, &s[i]->o[l], (int)p, 1, kr, vr, &sc);
        }
      }
      len[i] = cached;
    } else if (op < 6) {
      uint32_t n = 1 + (uint32_t)(oracle_rng_next(&f->rng) % (op < 3 ? 3 : 20));
      uint32_t start = len[i] > 0 && op == 5 ? len[i] - 1 : len[i];
      if (start + n > 200)
        continue;
      spec_t sp = {.sim = s[i], .start = start, .n = n, .stream = stream_of[i]};
      uint64_t plan;
      char msg[256];
      int rc = make_plan(f, &sp, 1, 1, &plan, msg);
      if (rc == ATTND_ENOSPC) {
        enospc++;
        check_engine(f);
        continue;
      }
      assert_int_equal(rc, 0);
      for (int l = 0; l < LAYERS; l++) {
        assert_int_equal(step_ex(f, l, &sp, 1, plan, 1, NULL, msg, NULL), 0);
        check_engine(f);
      }
      len[i] = start + n;
    } else if (op == 6) {
      uint32_t to = len[i] ? (uint32_t)(oracle_rng_next(&f->rng) % (len[i] + 1)) : 0;
      assert_int_equal(simple_call(f, 2, s[i]->id, to, NULL), 0);
      for (int l = 0; l < LAYERS; l++)
        s[i]->o[l].len = (int)to;
      len[i] = to;
    } else if (op == 7) {
      int j = (i + 1) % NS;
      if (s[j])
        continue;
      uint64_t id;
      int rc = simple_call(f, 1, s[i]->id, 0, &id);
      assert_int_equal(rc, 0);
      s[j] = sim_new();
      stream_of[j] = stream_of[i];
      s[j]->id = id;
      sim_init_oracle(f, s[j]);
      sim_copy(s[j], s[i]);
      len[j] = len[i];
    } else {
      assert_int_equal(simple_call(f, 0, s[i]->id, 0, NULL), 0);
      sim_free(s[i]);
      s[i] = NULL;
    }
    check_engine(f);
  }
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  print_message("  %d ops, %d RESOURCE_EXHAUSTED, %d prefix hits, %llu evictions, %llu COW, "
                "worst rel L2 %.3g\n",
                ops, enospc, hits, (unsigned long long)st.evictions,
                (unsigned long long)st.cow_copies, f->worst);
  for (int i = 0; i < NS; i++)
    if (s[i])
      sim_free(s[i]);
  fx_free(f);
}

/* Random multi-session plans with every layer in flight at once, layer 0
 * running ahead of the others through inline steps and catching up later,
 * forks, truncates and closes; bookkeeping checked after every operation and
 * every output against the oracle (two seconds). */
static void test_random_pipelined(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8_DYNAMIC, 20);
  enum { NS = 6, NP = 96 };
  sim_t *s[NS] = {0};
  int stream_of[NS] = {0};
  uint32_t lens[NS][LAYERS];
  memset(lens, 0, sizeof(lens));
  uint32_t streams[3][MAXCTX];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < MAXCTX; j++)
      streams[i][j] = (uint32_t)(oracle_rng_next(&f->rng) % 5) + (uint32_t)i * 100;
  static pend_t pd[NP];
  int np = 0, ops = 0, refused = 0, steps = 0;
  char msg[256];
#define FLUSH()                                                                                    \
  do {                                                                                             \
    for (int q_ = 0; q_ < np; q_++)                                                                \
      if (step_finish(f, &pd[q_], msg, NULL) != 0)                                                 \
        fail_msg("pending step %d: %s", q_, msg);                                                  \
    np = 0;                                                                                        \
  } while (0)
  uint64_t t0 = uv_hrtime();
  while (uv_hrtime() - t0 < 2000000000ull && ops < 2000) {
    ops++;
    if (np > NP - 2 * LAYERS - 2)
      FLUSH();
    int i = (int)(oracle_rng_next(&f->rng) % NS);
    int op = (int)(oracle_rng_next(&f->rng) % 12);
    if (!s[i]) {
      s[i] = sim_new();
      int st = (int)(oracle_rng_next(&f->rng) % 3);
      stream_of[i] = st + 1;
      memcpy(s[i]->tokens, streams[st], sizeof(s[i]->tokens));
      uint32_t cached =
          open_session(f, s[i], 1 + (uint32_t)(oracle_rng_next(&f->rng) % 70), NULL, 0);
      uint16_t kr[KVH * HD], vr[KVH * HD];
      for (int l = 0; l < LAYERS; l++) {
        oracle_scales_t sc = oscales(f, l);
        for (uint32_t p = 0; p < cached; p++) {
          det_kv(stream_of[i], p, l, kr, vr);
          oracle_session_write(&f->sh, &s[i]->o[l], (int)p, 1, kr, vr, &sc);
        }
        lens[i][l] = cached;
      }
    } else if (op < 5) {
      /* A plan over up to three sessions whose layers are level. */
      spec_t sp[3];
      int n = 0;
      for (int k = 0; k < NS && n < 3; k++) {
        int j = (i + k) % NS;
        int level = s[j] != NULL;
        for (int l = 1; level && l < LAYERS; l++)
          level = lens[j][l] == lens[j][0];
        if (!level || (k > 0 && oracle_rng_next(&f->rng) % 2))
          continue;
        uint32_t start = lens[j][0];
        if (start > 0 && oracle_rng_next(&f->rng) % 4 == 0)
          start--; /* a retry: same tokens, same KV */
        uint32_t len = 1 + (uint32_t)(oracle_rng_next(&f->rng) % 12);
        if (start + len > 160)
          continue;
        sp[n++] = (spec_t){.sim = s[j], .start = start, .n = len, .stream = stream_of[j]};
      }
      if (n == 0)
        continue;
      uint64_t plan;
      int rc = make_plan(f, sp, n, 1, &plan, msg);
      if (rc == ATTND_ENOSPC) {
        refused++;
        check_engine(f);
        continue;
      }
      assert_int_equal(rc, 0);
      for (int l = 0; l < LAYERS; l++)
        step_submit(f, l, sp, n, plan, 1, NULL, &pd[np++]);
      steps += LAYERS;
      for (int k = 0; k < n; k++) {
        int j = 0;
        while (s[j] != sp[k].sim)
          j++;
        for (int l = 0; l < LAYERS; l++)
          lens[j][l] = sp[k].start + sp[k].n;
      }
    } else if (op < 7) {
      /* Layer 0 runs ahead (inline). */
      uint32_t len = 1 + (uint32_t)(oracle_rng_next(&f->rng) % 5);
      if (lens[i][0] + len > 160)
        continue;
      spec_t sp = {.sim = s[i], .start = lens[i][0], .n = len, .stream = stream_of[i]};
      step_submit(f, 0, &sp, 1, 0, 1, NULL, &pd[np]);
      if (pd[np].x.done && pd[np].x.r.status) {
        /* Refused at admission (pool exhausted): nothing changed. */
        assert_int_equal(pd[np].x.r.status, ATTND_ENOSPC);
        pd[np].x.r.status = 0;
        pd[np].x.done = 1;
        res_free(&pd[np].x);
        pend_release(&pd[np]);
        refused++;
      } else {
        np++;
        steps++;
        lens[i][0] += len;
      }
    } else if (op < 9) {
      /* The other layers catch up (inline). */
      for (int l = 1; l < LAYERS; l++) {
        if (lens[i][l] >= lens[i][0])
          continue;
        spec_t sp = {
            .sim = s[i], .start = lens[i][l], .n = lens[i][0] - lens[i][l], .stream = stream_of[i]};
        step_submit(f, l, &sp, 1, 0, 1, NULL, &pd[np++]);
        steps++;
        lens[i][l] = lens[i][0];
      }
    } else {
      FLUSH();
      int level = 1;
      for (int l = 1; l < LAYERS; l++)
        level &= lens[i][l] == lens[i][0];
      if (op == 9) {
        uint32_t to = (uint32_t)(oracle_rng_next(&f->rng) % (lens[i][0] + 1));
        int rc = simple_call(f, 2, s[i]->id, to, NULL);
        assert_int_equal(rc, level ? 0 : ATTND_EPRECOND);
        if (rc == 0)
          for (int l = 0; l < LAYERS; l++) {
            s[i]->o[l].len = (int)to;
            lens[i][l] = to;
          }
      } else if (op == 10) {
        int j = (i + 1) % NS;
        if (s[j])
          continue;
        uint64_t id;
        int rc = simple_call(f, 1, s[i]->id, 0, &id);
        assert_int_equal(rc, level ? 0 : ATTND_EPRECOND);
        if (rc == 0) {
          s[j] = sim_new();
          s[j]->id = id;
          sim_init_oracle(f, s[j]);
          sim_copy(s[j], s[i]);
          stream_of[j] = stream_of[i];
          memcpy(lens[j], lens[i], sizeof(lens[i]));
        }
      } else {
        assert_int_equal(simple_call(f, 0, s[i]->id, 0, NULL), 0);
        sim_free(s[i]);
        s[i] = NULL;
      }
    }
    check_engine(f);
  }
  FLUSH();
#undef FLUSH
  check_engine(f);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  print_message("  %d ops, %d steps, %d refused, %llu evictions, %llu COW, %llu hit tokens, "
                "worst rel L2 %.3g\n",
                ops, steps, refused, (unsigned long long)st.evictions,
                (unsigned long long)st.cow_copies, (unsigned long long)st.prefix_hit_tokens,
                f->worst);
  for (int i = 0; i < NS; i++)
    if (s[i])
      sim_free(s[i]);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_ops),
      cmocka_unit_test(test_random_pipelined),
      /* Again with every step queued behind a threadpool scan. */
      cmocka_unit_test_setup_teardown(test_random_ops, queued_on, queued_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

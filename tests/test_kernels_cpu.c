/* test_kernels_cpu.c: the CPU kernels (kernels/cpu) against the float64 oracle,
 * through the harness of kernels_fixture.h: every cache type, shape, mask and
 * batch mix, with every input fresh random data from a seed drawn at start
 * (printed; set ATTND_TEST_SEED to replay). The worst error seen per cache
 * type is printed at the end. The element conversions and the finiteness
 * check are test_kernels_cpu_numeric.c's, inputs at the bounds of
 * docs/numerics.md section 6 test_kernels_cpu_bounds.c's. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels_fixture.h"

/* ---- tests ---------------------------------------------------------------------- */

/* Every cache type with every head dim, block size and GQA group (pairwise):
 * a prefill in two chunks, then decode steps across block boundaries. */
static void test_shapes_all_types(void **state) {
  (void)state;
  static const int cfg[4][3] = {{64, 16, 1}, {128, 32, 4}, {256, 64, 8}, {128, 128, 16}};
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int c = 0; c < 4; c++) {
      int D = cfg[(c + kv) % 4][0], bs = cfg[c][1], G = cfg[c][2];
      if (c == 3 && kv % 2)
        D = 64; /* 64 also meets block 128 */
      attnd_dtype_t dt = (c + kv) % 2 ? ATTND_DT_FP16 : ATTND_DT_BF16;
      attnd_rope_t rope = (attnd_rope_t)((c + kv) % 3);
      int kvh = G >= 8 ? 1 : 2;
      env_t e;
      env_init(&e, D, bs, kvh, G, dt, (attnd_kv_type_t)kv, rope, 64);
      sess_t se;
      int total = bs + 3 + rnd(bs);
      sess_init(&e, &se, total + 8);
      int n1 = 1 + rnd(total - 4);
      titem_t it = item(&se, 0, n1);
      run_step(&e, &it, 1, opts());
      it = item(&se, n1, total - n1);
      run_step(&e, &it, 1, opts());
      for (int st = 0; st < 3; st++) {
        it = item(&se, total + st, 1);
        run_step(&e, &it, 1, opts());
      }
      sess_free(&se);
      env_free(&e);
    }
}

/* Several sessions interleaved, grown over many steps across block boundaries;
 * mixed prefill and decode items in one batch; rewrites of earlier positions;
 * items without q; every batch split into 1-4 parts. */
static void test_sessions_grow_interleaved(void **state) {
  (void)state;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
    env_t e;
    env_init(&e, 64, 16, 2, 4, kv % 2 ? ATTND_DT_BF16 : ATTND_DT_FP16, (attnd_kv_type_t)kv,
             ATTND_ROPE_NEOX, 64);
    enum { NS = 4 };
    sess_t se[NS];
    int len[NS];
    for (int i = 0; i < NS; i++) {
      sess_init(&e, &se[i], 200);
      len[i] = 0;
    }
    for (int step = 0; step < 14; step++) {
      titem_t its[NS];
      int ni = 0;
      for (int i = 0; i < NS; i++) {
        if (rnd(5) == 0)
          continue; /* not every session steps every time */
        int start = len[i], n;
        if (len[i] == 0 || rnd(4) == 0)
          n = 1 + rnd(20); /* prefill chunk */
        else
          n = 1; /* decode */
        if (len[i] > 4 && rnd(5) == 0)
          start = len[i] - 1 - rnd(3); /* rewrite (rejected draft / retry) */
        if (start + n > 190)
          continue;
        its[ni] = item(&se[i], start, n);
        its[ni].has_q = rnd(6) != 0;
        ni++;
        len[i] = start + n;
      }
      if (ni > 0)
        run_step(&e, its, ni, opts());
    }
    for (int i = 0; i < NS; i++)
      sess_free(&se[i]);
    env_free(&e);
  }
}

/* Every mask kind, random FlashMask intervals with and without causal, fully
 * masked rows, lse and fp32 output. */
static void test_masks(void **state) {
  (void)state;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int mk = 0; mk <= ATTND_MASK_INTERVALS; mk++)
      for (int causal = 0; causal < (mk == ATTND_MASK_INTERVALS ? 2 : 1); causal++) {
        env_t e;
        env_init(&e, 64, 32, 2, 2, ATTND_DT_BF16, (attnd_kv_type_t)kv, (attnd_rope_t)rnd(3), 32);
        sess_t a, c;
        sess_init(&e, &a, 120);
        sess_init(&e, &c, 120);
        titem_t pre[2] = {item(&a, 0, 40 + rnd(30)), item(&c, 0, 10)};
        pre[1].has_q = 0;
        run_step(&e, pre, 2, opts());
        titem_t its[2] = {item(&a, pre[0].n, 1 + rnd(24)), item(&c, 10, 1 + rnd(8))};
        for (int i = 0; i < 2; i++) {
          its[i].mask_kind = mk;
          its[i].causal = causal;
          if (mk == ATTND_MASK_SLIDING)
            its[i].mask_param = 1 + rnd(20);
          if (mk == ATTND_MASK_PREFIX_LM)
            its[i].mask_param = rnd(its[i].start + its[i].n + 3);
          if (mk == ATTND_MASK_INTERVALS) {
            int dead = i == 0 ? its[i].start + rnd(its[i].n) : -1;
            its[i].iv = random_intervals(its[i].start, its[i].n, dead);
          }
        }
        run_opts_t o = {.out_fp32 = rnd(2), .want_lse = 1, .chunked = 1};
        run_step(&e, its, 2, o);
        free(its[0].iv);
        free(its[1].iv);
        sess_free(&a);
        sess_free(&c);
        env_free(&e);
      }
}

/* Dynamic types: all-zero k/v rows get scale 0 and zeros, never NaN. */
static void test_dynamic_zero_rows(void **state) {
  (void)state;
  for (int kv = ATTND_KV_INT8_DYNAMIC; kv <= ATTND_KV_FP8_DYNAMIC; kv++) {
    env_t e;
    env_init(&e, 128, 16, 2, 4, ATTND_DT_BF16, (attnd_kv_type_t)kv, ATTND_ROPE_NEOX, 16);
    sess_t se;
    sess_init(&e, &se, 64);
    titem_t it = item(&se, 0, 21);
    it.zero_rows = 1;
    run_step(&e, &it, 1, (run_opts_t){.want_lse = 1});
    it = item(&se, 21, 1);
    it.zero_rows = 1;
    run_step(&e, &it, 1, (run_opts_t){.want_lse = 1});
    sess_free(&se);
    env_free(&e);
  }
}

/* Static int8/fp8 with values far beyond the scale's range: saturation. */
static void test_saturation(void **state) {
  (void)state;
  for (int kv = ATTND_KV_INT8; kv <= ATTND_KV_FP8; kv++) {
    env_t e;
    env_init(&e, 64, 16, 2, 2, ATTND_DT_BF16, (attnd_kv_type_t)kv, ATTND_ROPE_NONE, 16);
    e.amp = 40.0; /* ~10x the representable range: most values clamp */
    sess_t se;
    sess_init(&e, &se, 64);
    titem_t it = item(&se, 0, 33);
    run_step(&e, &it, 1, opts());
    int sat = 0; /* make sure saturation really happened: K rows of the session */
    for (int pos = 0; pos < 33; pos++)
      for (int h = 0; h < 2; h++)
        for (int d = 0; d < 64; d++) {
          uint8_t c =
              e.cache[(size_t)se.table[pos / 16] * e.bb + ((size_t)h * 16 + pos % 16) * 64 + d];
          sat +=
              kv == ATTND_KV_INT8 ? ((int8_t)c == 127 || (int8_t)c == -127) : ((c & 0x7f) == 0x7e);
        }
    assert_true(sat > 33 * 2 * 64 / 2);
    sess_free(&se);
    env_free(&e);
  }
}

/* New tokens over a long cached history for int8/fp8 and the dynamic types,
 * with no zero points (and, for the dynamic ones, no scales at all). */
static void test_long_history(void **state) {
  (void)state;
  static const attnd_kv_type_t types[] = {ATTND_KV_INT8, ATTND_KV_FP8, ATTND_KV_INT8_DYNAMIC,
                                          ATTND_KV_FP8_DYNAMIC};
  for (int i = 0; i < 4; i++) {
    env_t e;
    env_init(&e, 128, 64, 2, 4, ATTND_DT_BF16, types[i], ATTND_ROPE_NEOX, 40);
    assert_null(e.kz);
    assert_null(e.vz);
    if (attnd_kv_type_dynamic(types[i]))
      assert_null(e.ks);
    sess_t se;
    sess_init(&e, &se, 2200);
    titem_t it = item(&se, 0, 2000);
    it.has_q = 0; /* imported KV */
    run_step(&e, &it, 1, opts());
    it = item(&se, 2000, 7);
    run_step(&e, &it, 1, opts());
    it = item(&se, 2007, 1);
    run_step(&e, &it, 1, (run_opts_t){.want_lse = 1});
    sess_free(&se);
    env_free(&e);
  }
}

/* Batches the kernels cannot run are refused, not crashed on. */
static void test_refuses_bad_batches(void **state) {
  (void)state;
  env_t e;
  env_init(&e, 64, 16, 1, 1, ATTND_DT_BF16, ATTND_KV_INT4, ATTND_ROPE_NONE, 4);
  attnd_kitem_t ki = {.start = 0, .n = 1, .q_row = 0, .block_table = 0};
  int32_t meta[1] = {0};
  uint16_t q[64] = {0}, k[64] = {0}, v[64] = {0}, out[64];
  attnd_kbatch_t b = {.items = &ki,
                      .nitems = 1,
                      .meta = meta,
                      .total_q = 1,
                      .total_kv = 1,
                      .q = q,
                      .k = k,
                      .v = v,
                      .out = out,
                      .cache = e.cache,
                      .block_bytes = e.bb,
                      .k_scale = e.ks,
                      .v_scale = e.vs,
                      .k_zero = NULL,
                      .v_zero = e.vz};
  assert_true(attnd_cpu_write(&e.s, &b, 0, 1) < 0); /* int4 without k zero points */
  b.k_zero = e.kz;
  assert_int_equal(attnd_cpu_write(&e.s, &b, 0, 1), 0);
  assert_true(attnd_cpu_write(&e.s, &b, 1, 1) < 0); /* part out of range */
  b.block_bytes = 3;
  assert_true(attnd_cpu_attend(&e.s, &b, 0, 1) < 0);
  attnd_kshape_t bad = e.s;
  bad.head_dim = 96;
  b.block_bytes = e.bb;
  assert_true(attnd_cpu_attend(&bad, &b, 0, 1) < 0);
  env_free(&e);
}

/* ---- speed print: one decode step of one session at 4k context ------------------- */

typedef struct {
  const attnd_kshape_t *s;
  const attnd_kbatch_t *b;
  int part, nparts;
} job_t;

static void *attend_thread(void *arg) {
  job_t *j = arg;
  attnd_cpu_attend(j->s, j->b, j->part, j->nparts);
  return NULL;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void test_speed_decode_4k(void **state) {
  (void)state;
#ifdef ATTND_KC_BASELINE
  skip(); /* the baseline build is for correctness; speed is the dispatched build's */
#endif
  enum { CTX = 4096, NCACHE = 3, ITERS = 30 };
  attnd_kshape_t s = {.q_heads = 32,
                      .kv_heads = 8,
                      .head_dim = 128,
                      .block_size = 64,
                      .dtype = ATTND_DT_BF16,
                      .kv = ATTND_KV_BF16,
                      .rope = ATTND_ROPE_NEOX,
                      .rope_theta = 500000.0,
                      .softmax_scale = (float)(1.0 / sqrt(128.0))};
  size_t bb = attnd_kv_block_bytes(&s);
  int nb = CTX / s.block_size;
  /* Several 16 MiB caches in turn, so a run does not find its KV in cache. */
  uint8_t *cache[NCACHE];
  for (int c = 0; c < NCACHE; c++) {
    cache[c] = malloc(bb * (size_t)nb);
    fill_random(ATTND_DT_BF16, cache[c], bb * (size_t)nb / 2, 1.0);
  }
  int32_t meta[CTX / 16];
  for (int i = 0; i < nb; i++)
    meta[i] = (i * 37) % nb; /* scattered physical blocks */
  uint16_t q[32 * 128], kv[8 * 128], out[32 * 128];
  float lse[32];
  fill_random(ATTND_DT_BF16, q, 32 * 128, 1.0);
  fill_random(ATTND_DT_BF16, kv, 8 * 128, 1.0);
  attnd_kitem_t it = {.start = CTX - 1,
                      .n = 1,
                      .q_row = 0,
                      .kv_row = 0,
                      .mask_kind = ATTND_MASK_CAUSAL,
                      .intervals = -1,
                      .block_table = 0};
  attnd_kbatch_t b = {.items = &it,
                      .nitems = 1,
                      .meta = meta,
                      .total_q = 1,
                      .total_kv = 1,
                      .max_kv_len = CTX,
                      .max_n = 1,
                      .q = q,
                      .k = kv,
                      .v = kv,
                      .out = out,
                      .lse = lse,
                      .block_bytes = bb};
  double t_attend[ITERS], t_write[ITERS];
  for (int i = 0; i < ITERS; i++) {
    b.cache = cache[i % NCACHE];
    double t0 = now_ms();
    assert_int_equal(attnd_cpu_write(&s, &b, 0, 1), 0);
    double t1 = now_ms();
    job_t j1 = {&s, &b, 1, 2};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, attend_thread, &j1), 0);
    assert_int_equal(attnd_cpu_attend(&s, &b, 0, 2), 0);
    pthread_join(th, NULL);
    double t2 = now_ms();
    t_write[i] = t1 - t0;
    t_attend[i] = t2 - t1;
  }
  qsort(t_attend, ITERS, sizeof(double), cmp_double);
  qsort(t_write, ITERS, sizeof(double), cmp_double);
  for (int i = 0; i < 32 * 128; i++)
    assert_true(isfinite(oracle_from_dtype(ATTND_DT_BF16, out, (size_t)i)));
  printf("speed: decode 1 session, ctx %d, 32 q / 8 kv heads, d 128, bf16 cache (%.1f MiB KV), "
         "2 threads: attend %.3f ms/layer median (min %.3f), write %.3f ms\n",
         CTX, (double)(bb * (size_t)nb) / (1 << 20), t_attend[ITERS / 2], t_attend[0],
         t_write[ITERS / 2]);
  for (int c = 0; c < NCACHE; c++)
    free(cache[c]);
}

/* Split context (docs/scale-out.md): pos_base moves only RoPE (an item at
 * start s with pos_base P rotates q and k as one at s + P, and stores at s),
 * and an attend-only item (kv_row past total_kv, counted in q_only_rows)
 * rotates its q rows at pos_base + start + t and writes nothing. */
static void test_pos_base_and_q_only(void **state) {
  (void)state;
  enum { BS = 16, N = 5, S = 3, P = 1000, NB = 2 };
  attnd_kshape_t s = {.q_heads = 2,
                      .kv_heads = 1,
                      .head_dim = 64,
                      .block_size = BS,
                      .dtype = ATTND_DT_BF16,
                      .kv = ATTND_KV_BF16,
                      .rope = ATTND_ROPE_NEOX,
                      .rope_theta = 10000.0,
                      .softmax_scale = 0.125f};
  size_t bb = attnd_kv_block_bytes(&s);
  uint8_t *c1 = calloc(NB * 2, bb), *c2 = calloc(NB * 2, bb);
  uint16_t q1[N * 2 * 64], q2[N * 2 * 64], q3[N * 2 * 64], k[N * 64], v[N * 64];
  fill_random(ATTND_DT_BF16, q1, N * 2 * 64, 1.0);
  fill_random(ATTND_DT_BF16, k, N * 64, 1.0);
  fill_random(ATTND_DT_BF16, v, N * 64, 1.0);
  memcpy(q2, q1, sizeof(q1));
  memcpy(q3, q1, sizeof(q1));
  /* a: start S, pos_base P (blocks 0..); b: start S + P, blocks at P / BS. */
  int32_t meta_a[NB] = {0, 1}, meta_b[(S + P + N) / BS + 1];
  for (int i = 0; i < (int)(sizeof(meta_b) / sizeof(meta_b[0])); i++)
    meta_b[i] = i == (S + P) / BS ? 2 : 3;
  attnd_kitem_t ia = {.start = S, .n = N, .q_row = 0, .kv_row = 0, .pos_base = P};
  attnd_kitem_t ib = {.start = S + P, .n = N, .q_row = 0, .kv_row = 0};
  attnd_kbatch_t b = {.items = &ia,
                      .nitems = 1,
                      .meta = meta_a,
                      .total_q = N,
                      .total_kv = N,
                      .max_kv_len = S + N,
                      .max_n = N,
                      .q = q1,
                      .k = k,
                      .v = v,
                      .cache = c1,
                      .block_bytes = bb};
  assert_int_equal(attnd_cpu_write(&s, &b, 0, 1), 0);
  b.items = &ib;
  b.meta = meta_b;
  b.q = q2;
  b.cache = c2;
  assert_int_equal(attnd_cpu_write(&s, &b, 0, 1), 0);
  assert_memory_equal(q1, q2, sizeof(q1));
  /* (S + P) % BS == (S + 1000) % 16 = 11 and S = 3: compare the rows, not the slots. */
  size_t row = 64 * 2;
  for (int t = 0; t < N; t++) {
    int pa = S + t, pb = S + P + t;
    const uint8_t *ka = c1 + (size_t)meta_a[pa / BS] * bb + (size_t)(pa % BS) * row;
    const uint8_t *kb = c2 + (size_t)meta_b[pb / BS] * bb + (size_t)(pb % BS) * row;
    assert_memory_equal(ka, kb, row);
  }
  /* Attend-only: the same q rows, nothing written, q as rotated above. */
  uint8_t *before = malloc(NB * 2 * bb);
  memcpy(before, c1, NB * 2 * bb);
  attnd_kitem_t iq = {.start = S, .n = N, .q_row = 0, .kv_row = 0, .pos_base = P};
  b.items = &iq;
  b.meta = meta_a;
  b.q = q3;
  b.k = b.v = NULL;
  b.cache = c1;
  b.total_kv = 0;
  b.q_only_rows = N;
  /* q3 holds the unrotated rows (copied before the writes); two parts. */
  assert_memory_not_equal(q3, q1, sizeof(q3));
  assert_int_equal(attnd_cpu_write(&s, &b, 0, 2), 0);
  assert_int_equal(attnd_cpu_write(&s, &b, 1, 2), 0);
  assert_memory_equal(q3, q1, sizeof(q3));
  assert_memory_equal(c1, before, NB * 2 * bb);
  free(before);
  free(c1);
  free(c2);
}

int main(void) {
  kfx_seed();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_refuses_bad_batches),
      cmocka_unit_test(test_shapes_all_types),
      cmocka_unit_test(test_sessions_grow_interleaved),
      cmocka_unit_test(test_masks),
      cmocka_unit_test(test_dynamic_zero_rows),
      cmocka_unit_test(test_saturation),
      cmocka_unit_test(test_long_history),
      cmocka_unit_test(test_speed_decode_4k),
      cmocka_unit_test(test_pos_base_and_q_only),
  };
  return cmocka_run_group_tests(tests, NULL, kfx_print_summary);
}

/* test_kernels_cpu_bound.c: the CPU kernels at the largest magnitudes the
 * kernels promise to compute faithfully (docs/numerics.md): |q|, |k| up to
 * 2^48 and |v| up to 2^100 for bf16 activations; with fp16 activations or an
 * fp16 cache |q|, |k| up to 2^15 (RoPE can grow a pair by sqrt(2), and fp16
 * holds at most 65504) and |v| up to 2^13 here. Three cases per cache type and head dim: q and k
 * near the bound (scores near 2^101: one key takes all the weight), q near
 * the bound over k near 2^-48 (moderate scores from huge operands), and v
 * near the bound. Each must match the float64 oracle within its type's bound,
 * with a finite lse, no Inf, no NaN and no masked-looking zero row. The GPU
 * kernels run the same cases in test_cuda_numerics. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "attnd_kernels.h"
#include "oracle.h"

static uint64_t g_rng;
static const double g_bound[ATTND_KV_COUNT_] = {1e-2, 1e-2, 3e-2, 3e-2, 2e-2, 2e-2, 1e-1};

/* x in [0.25, 1] * mag with a random sign (near the bound), or mag N(0,1)
 * clipped at 4 mag. */
static double draw(double mag, int near) {
  if (near) {
    const double u = 0.25 + 0.75 * oracle_rng_uniform(&g_rng);
    return (oracle_rng_next(&g_rng) & 1 ? -u : u) * mag;
  }
  double x = mag * oracle_rng_normal(&g_rng);
  return x > 4 * mag ? 4 * mag : x < -4 * mag ? -4 * mag : x;
}

/* One session of hist cached tokens and a step of n new ones (causal), q/k
 * at qm/km (near the bound when near), v at vm; returns the worst rel L2. */
static double run(const attnd_kshape_t *s, int hist, int n, double qm, double km, double vm,
                  int near) {
  const int D = s->head_dim, KVH = s->kv_heads, QH = s->q_heads, bs = s->block_size;
  const int len = hist + n, nb = (len + bs - 1) / bs;
  const size_t bb = attnd_kv_block_bytes(s);
  uint8_t *cache = malloc(bb * nb);
  memset(cache, 0xff, bb * nb);
  int32_t *bt = malloc(sizeof(int32_t) * nb);
  for (int i = 0; i < nb; i++)
    bt[i] = nb - 1 - i;
  float *sc[4] = {NULL, NULL, NULL, NULL};
  if (attnd_kv_type_static(s->kv)) {
    const double base = s->kv == ATTND_KV_INT4   ? 0.45
                        : s->kv == ATTND_KV_INT8 ? 3.5 / 127
                                                 : 3.0 / 448;
    for (int w = 0; w < 4; w++) {
      sc[w] = malloc(sizeof(float) * KVH * D);
      for (int i = 0; i < KVH * D; i++)
        sc[w][i] = w < 2 ? (float)(base * (w ? vm : km) * (0.8 + 0.4 * oracle_rng_uniform(&g_rng)))
                         : (float)(7.0 + oracle_rng_uniform(&g_rng));
    }
  }
  oracle_scales_t osc = {sc[0], sc[1], sc[2], sc[3], 1};
  const size_t kvn = (size_t)len * KVH * D;
  uint16_t *k = malloc(2 * kvn), *v = malloc(2 * kvn), *q = malloc(2 * (size_t)n * QH * D);
  uint16_t *q0 = malloc(2 * (size_t)n * QH * D);
  for (size_t i = 0; i < kvn; i++) {
    oracle_to_dtype(s->dtype, k, i, draw(km, near));
    oracle_to_dtype(s->dtype, v, i, draw(vm, 0));
  }
  for (size_t i = 0; i < (size_t)n * QH * D; i++)
    oracle_to_dtype(s->dtype, q, i, draw(qm, near) * (near ? 1.0 : 1.5));
  memcpy(q0, q, 2 * (size_t)n * QH * D);
  attnd_kitem_t it = {.start = 0, .n = hist, .q_row = -1, .kv_row = 0, .block_table = 0};
  attnd_kbatch_t b = {.items = &it,
                      .nitems = 1,
                      .meta = bt,
                      .total_kv = hist,
                      .max_kv_len = hist,
                      .max_n = hist,
                      .k = k,
                      .v = v,
                      .cache = cache,
                      .block_bytes = bb,
                      .k_scale = sc[0],
                      .v_scale = sc[1],
                      .k_zero = sc[2],
                      .v_zero = sc[3],
                      .scale_per_channel = 1};
  assert_int_equal(attnd_cpu_write(s, &b, 0, 1), 0);
  uint16_t *out = malloc(2 * (size_t)n * QH * D);
  float *lse = malloc(sizeof(float) * n * QH);
  attnd_kitem_t st = {.start = hist,
                      .n = n,
                      .q_row = 0,
                      .kv_row = 0,
                      .mask_kind = ATTND_MASK_CAUSAL,
                      .block_table = 0};
  b.items = &st;
  b.total_q = n;
  b.total_kv = n;
  b.max_kv_len = len;
  b.max_n = n;
  b.q = q;
  b.k = k + (size_t)hist * KVH * D;
  b.v = v + (size_t)hist * KVH * D;
  b.out = out;
  b.lse = lse;
  assert_int_equal(attnd_cpu_write(s, &b, 0, 1), 0);
  assert_int_equal(attnd_cpu_attend(s, &b, 0, 1), 0);

  oracle_session_t os;
  oracle_session_init(&os, s, len);
  oracle_session_write(s, &os, 0, len, k, v, &osc);
  double *ref = malloc(sizeof(double) * n * QH * D), *rl = malloc(sizeof(double) * n * QH);
  oracle_session_attend(s, &os, hist, n, q0, ATTND_MASK_CAUSAL, 0, 0, NULL, ref, rl);
  const double err = oracle_rel_l2(ref, s->dtype, out, (size_t)n * QH * D);
  if (!(err <= g_bound[s->kv]))
    fail_msg("kv %s D %d q %g k %g v %g: rel L2 %g > %g", attnd_kv_type_name(s->kv), D, qm, km, vm,
             err, g_bound[s->kv]);
  for (int r = 0; r < n * QH; r++) {
    if (!isfinite(lse[r]) || !(fabs(lse[r] - rl[r]) <= 2e-2 + 1e-3 * fabs(rl[r])))
      fail_msg("kv %s D %d row %d: lse %g, oracle %g", attnd_kv_type_name(s->kv), D, r, lse[r],
               rl[r]);
    double nrm = 0;
    for (int d = 0; d < D; d++)
      nrm += fabs(oracle_from_dtype(s->dtype, out, (size_t)r * D + d));
    if (nrm == 0.0)
      fail_msg("kv %s D %d row %d: a zero output row (nothing is masked)",
               attnd_kv_type_name(s->kv), D, r);
  }
  oracle_session_free(&os);
  for (int w = 0; w < 4; w++)
    free(sc[w]);
  free(cache);
  free(bt);
  free(k);
  free(v);
  free(q);
  free(q0);
  free(out);
  free(lse);
  free(ref);
  free(rl);
  return err;
}

static void test_bound(void **state) {
  (void)state;
  static const int dims[3] = {64, 128, 256};
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int fp16 = 0; fp16 < 2; fp16++) {
        attnd_kshape_t s = {.q_heads = 4,
                            .kv_heads = 2,
                            .head_dim = dims[di],
                            .block_size = 16,
                            .dtype = fp16 ? ATTND_DT_FP16 : ATTND_DT_BF16,
                            .kv = (attnd_kv_type_t)kv,
                            .rope = ATTND_ROPE_NEOX,
                            .rope_theta = 10000.0};
        s.softmax_scale = (float)(1.0 / sqrt((double)s.head_dim));
        const int small = fp16 || kv == ATTND_KV_FP16;
        const double qk = fp16 ? 0x1p15 : 0x1p48, kk = small ? 0x1p15 : 0x1p48,
                     vv = small ? 0x1p13 : 0x1p98;
        double worst = 0, e;
        e = run(&s, 60 + (int)(oracle_rng_next(&g_rng) % 100), 3, qk, kk, 1.0, 1);
        worst = fmax(worst, e);
        e = run(&s, 60, 5, qk, 1.0 / qk, 1.0, 1);
        worst = fmax(worst, e);
        e = run(&s, 60, 2, 1.0, 1.0, vv, 0);
        worst = fmax(worst, e);
        print_message("kv %-13s D %3d %s: worst rel L2 %.3e\n", attnd_kv_type_name(kv), dims[di],
                      fp16 ? "fp16" : "bf16", worst);
      }
}

int main(void) {
  const char *seed = getenv("ATTND_TEST_SEED");
  g_rng = seed ? strtoull(seed, NULL, 0) : ((uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull) | 1;
  print_message("seed %llu\n", (unsigned long long)g_rng);
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_bound)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

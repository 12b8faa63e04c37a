/* test_kernels_cpu_bounds.c: the CPU kernels at the input bounds of
 * docs/numerics.md section 6, against the float64 oracle (kernels_fixture.h).
 *
 * The engine refuses a step past the bounds; up to them the kernels must be
 * faithful: bf16 activations with |q|, |k| <= 2^48 and |v| <= 2^100, and
 * fp16 (activations or cache) with values up to 65504 (65504/sqrt(2) for q
 * and k under RoPE). Before the bounds, q = k = 1e19 gave rows of zeros with
 * lse = -inf and v = 3e38 over 40 keys gave +inf. Cases, every cache type:
 *
 *   ties     q = k = bound in every element, no RoPE: the failing q = k = 1e19
 *            brought to the bound. Every score of a row is the same (2^96 *
 *            head_dim / 8 for bf16), so the output is the mean of the
 *            visible v, and lse is that score plus ln(keys);
 *   k large  k at the bound (random signs), q small enough that scores stay
 *            moderate;
 *   q large  the reverse.
 *
 * Scores this large are only as good as fp32 makes them: a softmax over
 * scores of 2^96 is a hard maximum, which no fp32 evaluation gets right for
 * keys whose scores differ by less than their rounding (2^72), and an lse
 * whose terms cancel is off by as much. So the ties case makes every key the
 * same row of non-negative values, and the others keep scores moderate.
 *
 * v is at its bound in all of them (sums of up to 2^7 such values per row). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_fixture.h"

typedef struct {
  double amp_q, amp_k, amp_v; /* standard deviations; 1e300 with a clip: +-clip */
  double clip_qk, clip_v;
  double ks_mul, vs_mul; /* static scales drawn for N(0,1) data, times these */
} mags_t;

/* Static scales for data of the given spread. ties: every key the same row
 * (and int8/fp8 scales per head, for the saturated codes). */
static void scale_env(env_t *e, const mags_t *m, int ties) {
  attnd_kv_type_t kv = e->s.kv;
  if (!attnd_kv_type_static(kv))
    return;
  if (ties && kv != ATTND_KV_INT4) {
    e->per_channel = 0;
    e->osc.per_channel = 0;
  }
  size_t n = (size_t)e->s.kv_heads * (e->per_channel ? (size_t)e->s.head_dim : 1);
  double fp16_top = 0;
  if (e->s.dtype == ATTND_DT_FP16) /* keep dequantized v within fp16, like the data */
    fp16_top = kv == ATTND_KV_INT8  ? 65504.0 / 127
               : kv == ATTND_KV_FP8 ? 65504.0 / 448
                                    : 65504.0 / 9;
  for (size_t i = 0; i < n; i++) {
    e->ks[i] = (float)(e->ks[i] * m->ks_mul);
    e->vs[i] = fp16_top > 0 ? (float)fp16_top : (float)(e->vs[i] * m->vs_mul);
  }
}

static void run_case(attnd_kv_type_t kv, attnd_dtype_t dt, attnd_rope_t rope, const mags_t *m,
                     int ties) {
  env_t e;
  env_init(&e, 64, 16, 2, 2, dt, kv, rope, 32);
  e.amp_q = m->amp_q;
  e.amp = m->amp_k;
  e.amp_v = m->amp_v;
  e.clip_qk = m->clip_qk;
  e.clip_v = m->clip_v;
  e.same_k = ties;
  e.abs_qk = ties;
  scale_env(&e, m, ties);
  sess_t a, b;
  sess_init(&e, &a, 128);
  sess_init(&e, &b, 128);
  titem_t pre[2] = {item(&a, 0, 40 + rnd(60)), item(&b, 0, 1 + rnd(20))};
  run_step(&e, pre, 2, (run_opts_t){.out_fp32 = rnd(2), .want_lse = 1, .chunked = 1});
  titem_t dec[2] = {item(&a, pre[0].n, 1), item(&b, pre[1].n, 1 + rnd(7))};
  run_step(&e, dec, 2, (run_opts_t){.out_fp32 = rnd(2), .want_lse = 1, .chunked = 1});
  sess_free(&a);
  sess_free(&b);
  env_free(&e);
}

/* bf16 activations: q, k up to 2^48, v up to 2^100 (an fp16 cache instead
 * holds k and v within fp16's range, so it gets the fp16 magnitudes). */
static void test_bounds_bf16(void **state) {
  (void)state;
  const double Q = 0x1p48, V = 0x1p100, H = 1e300;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
    attnd_rope_t rope = (attnd_rope_t)rnd(3);
    if (kv == ATTND_KV_FP16) {
      /* The largest bf16 values within 65504 and 65504/sqrt(2). */
      mags_t ties = {H, H, H, 65280.0, 65280.0, 1, 1};
      run_case(kv, ATTND_DT_BF16, ATTND_ROPE_NONE, &ties, 1);
      double K = rope == ATTND_ROPE_NONE ? 65280.0 : 46080.0;
      mags_t klarge = {0x1p-14, 0x1p14, 0x1p15, K, 65280.0, 1, 1};
      run_case(kv, ATTND_DT_BF16, rope, &klarge, 0);
      continue;
    }
    mags_t ties = {H, H, H, Q, V, Q / 4, V / 4};
    run_case((attnd_kv_type_t)kv, ATTND_DT_BF16, ATTND_ROPE_NONE, &ties, 1);
    mags_t klarge = {0x1p-46, 0x1p46, 0x1p98, Q, V, 0x1p46, 0x1p98};
    run_case((attnd_kv_type_t)kv, ATTND_DT_BF16, rope, &klarge, 0);
    mags_t qlarge = {0x1p46, 0x1p-46, 0x1p98, Q, V, 0x1p-46, 0x1p98};
    run_case((attnd_kv_type_t)kv, ATTND_DT_BF16, rope, &qlarge, 0);
  }
}

/* fp16 activations: every value is fp16 already; q and k up to
 * 65504/sqrt(2) under RoPE (rotated, they are rounded to fp16 again). */
static void test_bounds_fp16(void **state) {
  (void)state;
  const double H = 1e300;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
    attnd_rope_t rope = rnd(2) ? ATTND_ROPE_NEOX : ATTND_ROPE_INTERLEAVED;
    /* A bf16 cache rounds fp16 values from 65408 up to 65536. */
    double V = kv == ATTND_KV_BF16 ? 65376.0 : 65504.0;
    mags_t ties = {H, H, H, 65504.0, V, 65504.0 / 4, 1};
    run_case((attnd_kv_type_t)kv, ATTND_DT_FP16, ATTND_ROPE_NONE, &ties, 1);
    mags_t klarge = {0x1p-14, 0x1p14, 0x1p15, 46304.0, V, 0x1p14, 1};
    run_case((attnd_kv_type_t)kv, ATTND_DT_FP16, rope, &klarge, 0);
    mags_t qlarge = {0x1p14, 0x1p-14, 0x1p15, 46304.0, V, 0x1p-14, 1};
    run_case((attnd_kv_type_t)kv, ATTND_DT_FP16, rope, &qlarge, 0);
  }
}

int main(void) {
  kfx_seed();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bounds_bf16),
      cmocka_unit_test(test_bounds_fp16),
  };
  return cmocka_run_group_tests(tests, NULL, kfx_print_summary);
}

/* test_oracle.c: the float64 oracle against values worked out by hand, so the
 * reference every backend is judged by is itself checked. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "oracle.h"

static uint16_t bits16(attnd_dtype_t dt, double x) {
  uint16_t b;
  oracle_to_dtype(dt, &b, 0, x);
  return b;
}

static void test_bf16_rounding(void **state) {
  (void)state;
  /* 1 + 2^-8 is the exact midpoint of 1 and 1 + 2^-7: ties go to the even 1. */
  assert_int_equal(bits16(ATTND_DT_BF16, 1.0 + 0x1p-8), 0x3f80);
  /* 1 + 3*2^-8 is the midpoint of 1+2^-7 (odd) and 1+2^-6 (even): up. */
  assert_int_equal(bits16(ATTND_DT_BF16, 1.0 + 3 * 0x1p-8), 0x3f82);
  /* Just above a tie rounds up. */
  assert_int_equal(bits16(ATTND_DT_BF16, 1.0 + 0x1p-8 + 0x1p-20), 0x3f81);
  assert_int_equal(bits16(ATTND_DT_BF16, -2.5), 0xc020);
  /* Largest finite bf16 and the overflow threshold (max + half ulp -> inf). */
  assert_int_equal(bits16(ATTND_DT_BF16, 0x1.fep127), 0x7f7f);
  assert_int_equal(bits16(ATTND_DT_BF16, 0x1.ffp127), 0x7f80);
  assert_int_equal(bits16(ATTND_DT_BF16, 0x1.fe8p127), 0x7f7f); /* below the threshold */
  /* Smallest subnormal 2^-133; half of it is a tie that goes to 0. */
  assert_int_equal(bits16(ATTND_DT_BF16, 0x1p-133), 0x0001);
  assert_int_equal(bits16(ATTND_DT_BF16, 0x1p-134), 0x0000);
  assert_int_equal(bits16(ATTND_DT_BF16, 0x1.8p-133), 0x0002); /* 1.5 ulp -> 2 (even) */
  uint16_t b = 0x3fc0;                                         /* 1.5 */
  assert_true(oracle_from_dtype(ATTND_DT_BF16, &b, 0) == 1.5);
  assert_true(oracle_round(ATTND_DT_BF16, 1.0 + 0x1p-8) == 1.0);
}

static void test_fp16_rounding(void **state) {
  (void)state;
  assert_int_equal(bits16(ATTND_DT_FP16, 1.0), 0x3c00);
  assert_int_equal(bits16(ATTND_DT_FP16, 1.0 + 0x1p-11), 0x3c00);     /* tie to even */
  assert_int_equal(bits16(ATTND_DT_FP16, 1.0 + 3 * 0x1p-11), 0x3c02); /* tie to even, up */
  assert_int_equal(bits16(ATTND_DT_FP16, 65504.0), 0x7bff);
  assert_int_equal(bits16(ATTND_DT_FP16, 65519.0), 0x7bff);
  assert_int_equal(bits16(ATTND_DT_FP16, 65520.0), 0x7c00); /* the tie overflows */
  assert_int_equal(bits16(ATTND_DT_FP16, -65520.0), 0xfc00);
  /* Subnormals: quantum 2^-24; 2^-25 is a tie to 0, 3*2^-25 a tie to 2*2^-24. */
  assert_int_equal(bits16(ATTND_DT_FP16, 0x1p-24), 0x0001);
  assert_int_equal(bits16(ATTND_DT_FP16, 0x1p-25), 0x0000);
  assert_int_equal(bits16(ATTND_DT_FP16, 3 * 0x1p-25), 0x0002);
  assert_int_equal(bits16(ATTND_DT_FP16, 0x1.ff8p-15), 0x03ff); /* largest subnormal */
  assert_int_equal(bits16(ATTND_DT_FP16, 0x1.ffcp-15), 0x0400); /* tie: up into the normals */
  uint16_t h = 0x0001;
  assert_true(oracle_from_dtype(ATTND_DT_FP16, &h, 0) == 0x1p-24);
  h = 0x7c00;
  assert_true(isinf(oracle_from_dtype(ATTND_DT_FP16, &h, 0)));
  assert_true(oracle_round(ATTND_DT_FP32, 1.0 + 0x1p-24) == 1.0);
  assert_true(oracle_round(ATTND_DT_FP32, 1.0 + 3 * 0x1p-24) == 1.0 + 0x1p-22);
}

static void test_fp8_e4m3(void **state) {
  (void)state;
  assert_true(oracle_fp8_e4m3(1.0f) == 1.0);
  assert_true(oracle_fp8_e4m3(1.0625f) == 1.0);  /* tie between 1 and 1.125: even */
  assert_true(oracle_fp8_e4m3(1.1875f) == 1.25); /* tie between 1.125 and 1.25: even */
  assert_true(oracle_fp8_e4m3(17.0f) == 16.0);   /* spacing 2 in [16, 32) */
  assert_true(oracle_fp8_e4m3(19.0f) == 20.0);
  assert_true(oracle_fp8_e4m3(448.0f) == 448.0);
  assert_true(oracle_fp8_e4m3(463.0f) == 448.0);
  assert_true(oracle_fp8_e4m3(1e6f) == 448.0); /* saturation, not NaN */
  assert_true(oracle_fp8_e4m3(-1e6f) == -448.0);
  assert_true(oracle_fp8_e4m3(INFINITY) == 448.0);
  /* Subnormals: quantum 2^-9. */
  assert_true(oracle_fp8_e4m3(0x1p-9f) == 0x1p-9);
  assert_true(oracle_fp8_e4m3(0x1p-10f) == 0.0);     /* tie to 0 */
  assert_true(oracle_fp8_e4m3(0x1.8p-9f) == 0x1p-8); /* tie to even (2 quanta) */
  assert_true(oracle_fp8_e4m3(0x1.fp-7f) == 0x1p-6); /* up into the normals */
  assert_true(isnan(oracle_fp8_e4m3(NAN)));
}

static attnd_kshape_t shape(int D, attnd_rope_t rope, attnd_kv_type_t kv) {
  attnd_kshape_t s = {.q_heads = 1,
                      .kv_heads = 1,
                      .head_dim = D,
                      .block_size = 16,
                      .dtype = ATTND_DT_BF16,
                      .kv = kv,
                      .rope = rope,
                      .rope_theta = 10000.0,
                      .rotary_dim = 0,
                      .softmax_scale = 1.0f};
  return s;
}

static void test_rope_by_hand(void **state) {
  (void)state;
  /* D = 4, neox, theta 10000: inv_freq = {1, 10000^-0.5 = 0.01}. Position 1:
   * pair (0, 2) rotates by 1 rad, pair (1, 3) by 0.01 rad. */
  attnd_kshape_t s = shape(4, ATTND_ROPE_NEOX, ATTND_KV_BF16);
  s.head_dim = 4;
  double in[4] = {1.0, 2.0, 0.5, -1.0}, out[4];
  oracle_rope(&s, 1, in, out);
  /* The contract takes cos/sin of the fp32 angle with cosf/sinf. */
  double c1 = cosf(1.0f), s1 = sinf(1.0f), c2 = cosf(0.01f), s2 = sinf(0.01f);
  assert_true(out[0] == oracle_round(ATTND_DT_BF16, 1.0 * c1 - 0.5 * s1));
  assert_true(out[2] == oracle_round(ATTND_DT_BF16, 0.5 * c1 + 1.0 * s1));
  assert_true(out[1] == oracle_round(ATTND_DT_BF16, 2.0 * c2 - (-1.0) * s2));
  assert_true(out[3] == oracle_round(ATTND_DT_BF16, -1.0 * c2 + 2.0 * s2));
  /* By hand: cos 1 = 0.5403, sin 1 = 0.8415: out[0] = 0.5403 - 0.4207 = 0.1196. */
  assert_true(fabs(out[0] - 0.1196) < 1e-3);
  /* Interleaved pairs (0,1) at 1 rad and (2,3) at 0.01 rad. */
  s.rope = ATTND_ROPE_INTERLEAVED;
  oracle_rope(&s, 1, in, out);
  assert_true(out[0] == oracle_round(ATTND_DT_BF16, 1.0 * c1 - 2.0 * s1));
  assert_true(out[1] == oracle_round(ATTND_DT_BF16, 2.0 * c1 + 1.0 * s1));
  /* rotary_dim 2: only pair (0, 1) at inv_freq 1; dims 2, 3 pass through. */
  s.rope = ATTND_ROPE_NEOX;
  s.rotary_dim = 2;
  oracle_rope(&s, 1, in, out);
  assert_true(out[0] == oracle_round(ATTND_DT_BF16, 1.0 * c1 - 2.0 * s1));
  assert_true(out[2] == 0.5 && out[3] == -1.0);
  /* Position 0 is the identity. */
  s.rotary_dim = 0;
  oracle_rope(&s, 0, in, out);
  for (int d = 0; d < 4; d++)
    assert_true(out[d] == in[d]);
}

static void put_bf16(uint16_t *p, const double *x, int n) {
  for (int i = 0; i < n; i++)
    oracle_to_dtype(ATTND_DT_BF16, p, (size_t)i, x[i]);
}

static void test_attention_by_hand(void **state) {
  (void)state;
  /* D = 64 with only dims 0 and 1 used; no RoPE, scale 1, bf16 cache.
   * k0 = (1, 0), k1 = (0, 1), v0 = (1, 0), v1 = (0, 2); q = (ln 3, 0) at
   * position 1 sees both keys: scores ln3 and 0, weights 3/4 and 1/4, output
   * (0.75, 0.5), lse = ln(3 + 1) = ln 4. Bf16 rounds ln 3 to 1.1015625, so
   * the exact numbers use that. */
  attnd_kshape_t s = shape(64, ATTND_ROPE_NONE, ATTND_KV_BF16);
  double kx[2][64] = {{0}}, vx[2][64] = {{0}}, qx[64] = {0};
  kx[0][0] = 1.0;
  kx[1][1] = 1.0;
  vx[0][0] = 1.0;
  vx[1][1] = 2.0;
  qx[0] = log(3.0);
  uint16_t k[128], v[128], q[64];
  put_bf16(k, &kx[0][0], 128);
  put_bf16(v, &vx[0][0], 128);
  put_bf16(q, qx, 64);
  oracle_session_t o;
  oracle_session_init(&o, &s, 4);
  oracle_session_write(&s, &o, 0, 2, k, v, NULL);
  assert_int_equal(o.len, 2);
  double out[64], lse;
  oracle_session_attend(&s, &o, 1, 1, q, ATTND_MASK_CAUSAL, 0, 0, NULL, out, &lse);
  double e = exp(1.1015625);
  assert_true(fabs(out[0] - e / (e + 1)) < 1e-12);
  assert_true(fabs(out[1] - 2.0 / (e + 1)) < 1e-12);
  assert_true(fabs(lse - log(e + 1)) < 1e-12);
  assert_true(fabs(out[0] - 0.75) < 2e-3 && fabs(out[1] - 0.5) < 2e-3);
  assert_true(fabs(lse - log(4.0)) < 5e-3);
  /* Causal at position 0: only k0, so the output is v0 exactly and lse = q.k0. */
  oracle_session_attend(&s, &o, 0, 1, q, ATTND_MASK_CAUSAL, 0, 0, NULL, out, &lse);
  assert_true(out[0] == 1.0 && out[1] == 0.0);
  assert_true(lse == 1.1015625);
  /* Sliding window 1 at position 1: only k1. */
  oracle_session_attend(&s, &o, 1, 1, q, ATTND_MASK_SLIDING, 1, 0, NULL, out, &lse);
  assert_true(out[0] == 0.0 && out[1] == 2.0 && lse == 0.0);
  oracle_session_free(&o);
}

static void test_fully_masked_row(void **state) {
  (void)state;
  attnd_kshape_t s = shape(64, ATTND_ROPE_NONE, ATTND_KV_BF16);
  uint16_t k[128], v[128], q[64];
  double x[128];
  for (int i = 0; i < 128; i++)
    x[i] = 0.25 * (i % 7) - 0.5;
  put_bf16(k, x, 128);
  put_bf16(v, x, 128);
  put_bf16(q, x, 64);
  oracle_session_t o;
  oracle_session_init(&o, &s, 2);
  oracle_session_write(&s, &o, 0, 2, k, v, NULL);
  /* Intervals masking rows [1, 2) from both keys: row 1 sees nothing. */
  int32_t iv[4 * 2] = {1, 1, 2, 2, 0, 0, 0, 0};
  double out[64], lse;
  oracle_session_attend(&s, &o, 1, 1, q, ATTND_MASK_INTERVALS, 0, 1, iv, out, &lse);
  for (int d = 0; d < 64; d++)
    assert_true(out[d] == 0.0);
  assert_true(isinf(lse) && lse < 0);
  assert_true(oracle_mask_visible(ATTND_MASK_INTERVALS, 0, 0, iv, 2, 0, 1)); /* bidirectional */
  assert_false(oracle_mask_visible(ATTND_MASK_INTERVALS, 0, 1, iv, 2, 0, 1));
  oracle_session_free(&o);
}

/* The per-layer variants by hand (docs/numerics.md), with the two keys of
 * test_attention_by_hand: scores ln3' (bf16) and 0 at position 1. */
static void test_variants_by_hand(void **state) {
  (void)state;
  attnd_kshape_t s = shape(64, ATTND_ROPE_NONE, ATTND_KV_BF16);
  double kx[2][64] = {{0}}, vx[2][64] = {{0}}, qx[64] = {0};
  kx[0][0] = 1.0;
  kx[1][1] = 1.0;
  vx[0][0] = 1.0;
  vx[1][1] = 2.0;
  qx[0] = log(3.0);
  uint16_t k[128], v[128], q[64];
  put_bf16(k, &kx[0][0], 128);
  put_bf16(v, &vx[0][0], 128);
  put_bf16(q, qx, 64);
  oracle_session_t o;
  oracle_session_init(&o, &s, 4);
  oracle_session_write(&s, &o, 0, 2, k, v, NULL);
  const double s0 = 1.1015625;
  double out[64], lse;
  /* Window 1 at position 1: only key 1 (j > p - w), whatever the mask. */
  oracle_session_attend_ex(&s, &o, 1, 1, q, ATTND_MASK_CAUSAL, 0, 0, NULL, 1, NULL, out, &lse);
  assert_true(out[0] == 0.0 && out[1] == 2.0 && lse == 0.0);
  /* Window 2 covers both keys: plain causal. */
  oracle_session_attend_ex(&s, &o, 1, 1, q, ATTND_MASK_CAUSAL, 0, 0, NULL, 2, NULL, out, &lse);
  assert_true(fabs(lse - log(exp(s0) + 1.0)) < 1e-12);
  /* The window intersects the mask: SLIDING 1 keeps key 1, window 1 keeps key 1. */
  assert_false(oracle_visible(ATTND_MASK_FULL, 0, 0, NULL, 1, 2, 1, 0));
  assert_true(oracle_visible(ATTND_MASK_FULL, 0, 0, NULL, 2, 2, 0, 1)); /* window hides none */
  assert_false(oracle_visible(ATTND_MASK_CAUSAL, 0, 0, NULL, 2, 2, 0, 1));
  /* Soft-capping at c = 0.5: s0 -> 0.5 tanh(2 s0), 0 stays 0. */
  s.softcap = 0.5f;
  oracle_session_attend(&s, &o, 1, 1, q, ATTND_MASK_CAUSAL, 0, 0, NULL, out, &lse);
  double c0 = 0.5 * tanh(s0 / 0.5);
  assert_true(fabs(lse - log(exp(c0) + 1.0)) < 1e-12);
  assert_true(fabs(out[0] - exp(c0) / (exp(c0) + 1.0)) < 1e-12);
  s.softcap = 0.0f;
  /* A sink of ln 2 per head: denominator e^s0 + 1 + 2. */
  float sinks[1] = {(float)log(2.0)};
  double sk = (double)sinks[0];
  oracle_session_attend_ex(&s, &o, 1, 1, q, ATTND_MASK_CAUSAL, 0, 0, NULL, 0, sinks, out, &lse);
  double den = exp(s0) + 1.0 + exp(sk);
  assert_true(fabs(out[0] - exp(s0) / den) < 1e-12);
  assert_true(fabs(out[1] - 2.0 / den) < 1e-12);
  assert_true(fabs(lse - log(den)) < 1e-12);
  /* A huge sink: m is the sink, nothing overflows; out ~ 0, lse ~ sink. */
  float big[1] = {1e4f};
  oracle_session_attend_ex(&s, &o, 1, 1, q, ATTND_MASK_CAUSAL, 0, 0, NULL, 0, big, out, &lse);
  assert_true(out[0] == 0.0 && lse == 1e4);
  /* A row with no visible key and a sink: out 0, lse = the sink exactly. */
  int32_t iv[4 * 2] = {1, 1, 2, 2, 0, 0, 0, 0};
  oracle_session_attend_ex(&s, &o, 1, 1, q, ATTND_MASK_INTERVALS, 0, 1, iv, 0, sinks, out, &lse);
  for (int d = 0; d < 64; d++)
    assert_true(out[d] == 0.0);
  assert_true(lse == sk);
  /* Split context: keys {0} with the sink merged with keys {1} without it
   * equals the whole with the sink. Part A masks key 1 from every row, part
   * B key 0. */
  int32_t ia[4 * 2] = {0, 0, 0, 1 << 30, 0, 0, 0, 0};
  int32_t ib[4 * 2] = {0, 0, 1 << 30, 0, 0, 0, 0, 0};
  double oa[64], ob[64], la, lb, whole[64], lw, merged[64], lm;
  oracle_session_attend_ex(&s, &o, 1, 1, q, ATTND_MASK_INTERVALS, 0, 1, ia, 0, sinks, oa, &la);
  oracle_session_attend_ex(&s, &o, 1, 1, q, ATTND_MASK_INTERVALS, 0, 1, ib, 0, NULL, ob, &lb);
  oracle_session_attend_ex(&s, &o, 1, 1, q, ATTND_MASK_CAUSAL, 0, 0, NULL, 0, sinks, whole, &lw);
  const double *parts[2] = {oa, ob};
  double lses[2] = {la, lb};
  oracle_merge_lse(2, parts, lses, 64, merged, &lm);
  assert_true(fabs(lm - lw) < 1e-12);
  for (int d = 0; d < 64; d++)
    assert_true(fabs(merged[d] - whole[d]) < 1e-12);
  oracle_session_free(&o);
}

static void test_quantizers(void **state) {
  (void)state;
  attnd_kshape_t s = shape(64, ATTND_ROPE_NONE, ATTND_KV_INT8);
  float ks[1] = {0.5f}, vs[1] = {0.5f};
  oracle_scales_t sc = {.k_scale = ks, .v_scale = vs};
  double x[64] = {0}, q[64];
  float ds;
  x[0] = 0.25;   /* 0.5: tie to even 0 */
  x[1] = 0.75;   /* 1.5 -> 2 */
  x[2] = -100.0; /* saturates at -127 */
  x[3] = 63.25;  /* 126.5 -> 126 */
  oracle_quantize_row(&s, &sc, 0, 0, x, q, &ds);
  assert_true(q[0] == 0.0 && q[1] == 2.0 && q[2] == -127.0 && q[3] == 126.0 && ds == 0.0f);
  /* Dynamic int8: s = 2/127 from max |x| = 2; x = 2 -> 127, x = 1 -> 63.5 -> 64. */
  s.kv = ATTND_KV_INT8_DYNAMIC;
  double y[64] = {0};
  y[0] = 2.0;
  y[1] = 1.0;
  oracle_quantize_row(&s, NULL, 0, 0, y, q, &ds);
  assert_true(ds == 2.0f / 127.0f);
  assert_true(q[0] == 127.0 && q[1] == (double)nearbyintf(1.0f / (2.0f / 127.0f)));
  /* All-zero row: scale 0 and zeros, not NaN. */
  double z[64] = {0};
  oracle_quantize_row(&s, NULL, 0, 0, z, q, &ds);
  assert_true(ds == 0.0f && q[0] == 0.0 && q[63] == 0.0);
  /* int4: s = 1, z = 7.5: x = 0 -> 7.5 -> 8 (even), x = -100 -> 0, x = 100 -> 15. */
  s.kv = ATTND_KV_INT4;
  float s4[64], z4[64];
  for (int d = 0; d < 64; d++) {
    s4[d] = 1.0f;
    z4[d] = 7.5f;
  }
  oracle_scales_t sc4 = {
      .k_scale = s4, .v_scale = s4, .k_zero = z4, .v_zero = z4, .per_channel = 1};
  double w[64] = {0};
  w[1] = -100.0;
  w[2] = 100.0;
  w[3] = 0.75; /* 8.25 -> 8 */
  oracle_quantize_row(&s, &sc4, 0, 1, w, q, &ds);
  assert_true(q[0] == 8.0 && q[1] == 0.0 && q[2] == 15.0 && q[3] == 8.0);
}

static void test_rel_l2_and_rng(void **state) {
  (void)state;
  double ref[2] = {3.0, 4.0};
  float got[2] = {3.0f, 4.5f};
  assert_true(fabs(oracle_rel_l2(ref, ATTND_DT_FP32, got, 2) - 0.1) < 1e-12);
  uint64_t a = 42, b = 42;
  assert_true(oracle_rng_next(&a) == oracle_rng_next(&b));
  double sum = 0, sq = 0;
  for (int i = 0; i < 20000; i++) {
    double g = oracle_rng_normal(&a);
    sum += g;
    sq += g * g;
  }
  assert_true(fabs(sum / 20000) < 0.05 && fabs(sq / 20000 - 1.0) < 0.05);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bf16_rounding),     cmocka_unit_test(test_fp16_rounding),
      cmocka_unit_test(test_fp8_e4m3),          cmocka_unit_test(test_rope_by_hand),
      cmocka_unit_test(test_attention_by_hand), cmocka_unit_test(test_fully_masked_row),
      cmocka_unit_test(test_quantizers),        cmocka_unit_test(test_rel_l2_and_rng),
      cmocka_unit_test(test_variants_by_hand),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

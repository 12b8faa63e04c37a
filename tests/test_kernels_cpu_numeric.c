/* test_kernels_cpu_numeric.c: the CPU kernels' element-level pieces
 * (kernels/cpu): the finiteness check the engine's scan uses, and the
 * element conversions (kernels/cpu/cpu_numeric.h) against the oracle's
 * rounding. Fresh random inputs from a printed seed (ATTND_TEST_SEED
 * replays one). */
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
#include "cpu/cpu_numeric.h" /* the kernels' element conversions, checked below */
#include "oracle.h"

static uint64_t g_rng;

static int rnd(int n) {
  return (int)(oracle_rng_next(&g_rng) % (uint64_t)n);
}

static void fill_random(attnd_dtype_t dt, void *p, size_t count, double amp) {
  for (size_t i = 0; i < count; i++)
    oracle_to_dtype(dt, p, i, amp * oracle_rng_normal(&g_rng));
}

static void test_all_finite(void **state) {
  (void)state;
  uint16_t h[37];
  float f[37];
  fill_random(ATTND_DT_BF16, h, 37, 1.0);
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_BF16, h, 37), 1);
  h[36] = 0x7f80; /* +inf */
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_BF16, h, 37), 0);
  fill_random(ATTND_DT_FP16, h, 37, 1.0);
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_FP16, h, 37), 1);
  h[5] = 0x7e01; /* NaN */
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_FP16, h, 37), 0);
  h[5] = 0x7bff; /* 65504 is finite */
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_FP16, h, 37), 1);
  for (int i = 0; i < 37; i++)
    f[i] = (float)oracle_rng_normal(&g_rng);
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_FP32, f, 37), 1);
  f[0] = -INFINITY;
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_FP32, f, 37), 0);
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_FP32, f, 0), 1);
  /* Request bytes need not be aligned: an odd address works too. */
  uint8_t raw[2 * 37 + 1];
  fill_random(ATTND_DT_BF16, h, 37, 1.0);
  memcpy(raw + 1, h, sizeof(h));
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_BF16, raw + 1, 37), 1);
  raw[1 + 2 * 20] = 0x80; /* element 20 = 0x7f80, +inf, little-endian */
  raw[1 + 2 * 20 + 1] = 0x7f;
  assert_int_equal(attnd_cpu_all_finite(ATTND_DT_BF16, raw + 1, 37), 0);
}

/* The largest magnitude as a pattern: what the engine's scan compares with a
 * bound's pattern (finite values in order, then infinity, then NaN). */
static void test_max_abs_bits(void **state) {
  (void)state;
  uint16_t h[41];
  uint8_t raw[2 * 41 + 1];
  for (int dt = ATTND_DT_BF16; dt <= ATTND_DT_FP16; dt++) {
    fill_random((attnd_dtype_t)dt, h, 41, 1.0);
    uint32_t want = 0;
    for (int i = 0; i < 41; i++)
      want = (h[i] & 0x7fffu) > want ? (h[i] & 0x7fffu) : want;
    assert_int_equal(attnd_cpu_max_abs_bits((attnd_dtype_t)dt, h, 41), want);
    h[17] = 0x8000u | (uint16_t)(want + 1); /* a larger negative value */
    assert_int_equal(attnd_cpu_max_abs_bits((attnd_dtype_t)dt, h, 41), want + 1);
    uint16_t inf = dt == ATTND_DT_BF16 ? 0x7f80u : 0x7c00u;
    h[40] = (uint16_t)(0x8000u | inf); /* -inf */
    assert_int_equal(attnd_cpu_max_abs_bits((attnd_dtype_t)dt, h, 41), inf);
    h[3] = (uint16_t)(inf | 1u); /* NaN */
    memcpy(raw + 1, h, sizeof(h)); /* unaligned */
    assert_int_equal(attnd_cpu_max_abs_bits((attnd_dtype_t)dt, raw + 1, 41), inf | 1u);
    assert_int_equal(attnd_cpu_max_abs_bits((attnd_dtype_t)dt, h, 0), 0);
  }
  float f[5] = {1.0f, -3.0f, 2.0f, 0.5f, -0.0f};
  uint32_t three;
  float t = 3.0f;
  memcpy(&three, &t, 4);
  assert_int_equal(attnd_cpu_max_abs_bits(ATTND_DT_FP32, f, 5), three);
}

/* ---- element conversions of the kernels against the oracle's rounding -------- */

static float f32_of_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* A float x whose rounding is hard: random bit patterns (every exponent,
 * subnormals included), exact ties of a format with `mbits` stored mantissa
 * bits, and values one float ulp either side of such a tie. */
static float hard_float(int mbits) {
  uint32_t u = (uint32_t)oracle_rng_next(&g_rng);
  switch (rnd(4)) {
  case 0:
    return f32_of_bits(u & 0xffffffffu);
  case 1: /* a tie: the first dropped bit set, the rest clear */
    u = (u & ~((1u << (23 - mbits)) - 1)) | (1u << (22 - mbits));
    break;
  case 2:
    u = ((u & ~((1u << (23 - mbits)) - 1)) | (1u << (22 - mbits))) + (rnd(2) ? 1 : -1);
    break;
  default: /* small magnitudes, where the 16- and 8-bit formats go subnormal */
    u = (u & 0x80ffffffu) | ((uint32_t)(100 + rnd(30)) << 23);
    break;
  }
  return f32_of_bits(u);
}

static void test_conversions_match_oracle(void **state) {
  (void)state;
  /* Every 16-bit pattern decodes to the oracle's value. */
  for (uint32_t b = 0; b < 65536; b++) {
    uint16_t h = (uint16_t)b;
    double vb = oracle_from_dtype(ATTND_DT_BF16, &h, 0),
           vh = oracle_from_dtype(ATTND_DT_FP16, &h, 0);
    float fb = kc_bf16_to_f32(h), fh = kc_fp16_to_f32(h);
    assert_true(isnan(vb) ? isnan(fb) : (double)fb == vb);
    assert_true(isnan(vh) ? isnan(fh) : (double)fh == vh);
  }
  /* Every e4m3 code but NaN decodes exactly. */
  for (int b = 0; b < 256; b++) {
    if ((b & 0x7f) == 0x7f)
      continue;
    int e = (b >> 3) & 15, m = b & 7;
    double v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    assert_true((double)kc_e4m3_to_f32((uint8_t)b) == ((b & 0x80) ? -v : v));
  }
  /* Rounding float -> bf16 / fp16 / e4m3 equals the oracle's rounding. */
  for (int i = 0; i < 400000; i++) {
    float f = hard_float(7);
    if (isnan(f))
      continue;
    uint16_t b = kc_f32_to_bf16(f);
    assert_true((double)kc_bf16_to_f32(b) == oracle_round(ATTND_DT_BF16, f));
    f = hard_float(10);
    if (isnan(f))
      continue;
    uint16_t h = kc_f32_to_fp16(f);
    assert_true((double)kc_fp16_to_f32(h) == oracle_round(ATTND_DT_FP16, f));
    f = hard_float(3);
    if (isnan(f))
      continue;
    double e8 = (double)kc_e4m3_to_f32(kc_f32_to_e4m3(f));
    if (e8 != oracle_fp8_e4m3(f))
      fail_msg("e4m3(%a) = %a, oracle %a", (double)f, e8, oracle_fp8_e4m3(f));
  }
}

/* RoPE is evaluated as the contract says (docs/numerics.md §4), as the CUDA
 * kernel does it: x'_a = fp32(fp32(x_a c) - fp32(x_b s)) and x'_b =
 * fp32(fp32(x_b c) + fp32(x_a s)), then rounded to the dtype; not the exact
 * expression rounded once, which differs now and then by one unit of the
 * dtype. Random rows at random positions through attnd_cpu_write; the rows
 * where the two forms differ must take the fp32 one (and some must differ,
 * or the test proves nothing). */
static void test_rope_fp32_contract(void **state) {
  (void)state;
  enum { D = 64, BS = 128 };
  for (int dti = 0; dti < 2; dti++)
    for (int mode = ATTND_ROPE_NEOX; mode <= ATTND_ROPE_INTERLEAVED; mode++) {
      attnd_dtype_t dt = dti ? ATTND_DT_FP16 : ATTND_DT_BF16;
      attnd_kshape_t s = {.q_heads = 1, .kv_heads = 1, .head_dim = D, .block_size = BS,
                          .dtype = dt, .kv = ATTND_KV_BF16, .rope = (attnd_rope_t)mode,
                          .rope_theta = 10000.0, .rotary_dim = D, .softmax_scale = 0.125f};
      size_t bb = attnd_kv_block_bytes(&s);
      uint8_t *cache = calloc(1, bb);
      int32_t table[64] = {0}; /* every logical block in physical block 0 */
      long differ = 0;
      /* bf16's coarse rounding makes the two forms differ ~8 times in 4,000
       * rows: until one differs, more rows (at most 10x), so that no seed
       * leaves the check with nothing to prove (0 of 4,000 happened). */
      for (int trial = 0; trial < 4000 || (differ == 0 && trial < 40000); trial++) {
        int pos = rnd(64 * BS);
        uint16_t q[D], q0[D], k[D] = {0}, v[D] = {0};
        fill_random(dt, q, D, 1.0 + 100.0 * rnd(2));
        memcpy(q0, q, sizeof(q));
        attnd_kitem_t it = {.start = pos, .n = 1, .q_row = 0, .kv_row = 0,
                            .mask_kind = ATTND_MASK_CAUSAL, .intervals = -1, .block_table = 0};
        attnd_kbatch_t b = {.items = &it, .nitems = 1, .meta = table, .total_q = 1,
                            .total_kv = 1, .max_kv_len = pos + 1, .max_n = 1, .q = q, .k = k,
                            .v = v, .cache = cache, .block_bytes = bb};
        assert_int_equal(attnd_cpu_write(&s, &b, 0, 1), 0);
        for (int i = 0; i < D / 2; i++) {
          int ia = mode == ATTND_ROPE_NEOX ? i : 2 * i;
          int ib = mode == ATTND_ROPE_NEOX ? i + D / 2 : 2 * i + 1;
          float inv = (float)pow(10000.0, -2.0 * (double)i / (double)D);
          float ang = (float)pos * inv;
          float c = cosf(ang), sn = sinf(ang);
          float xa = (float)oracle_from_dtype(dt, q0, (size_t)ia);
          float xb = (float)oracle_from_dtype(dt, q0, (size_t)ib);
          /* ISO C: no contraction, each operation rounded to fp32. */
          float p1 = xa * c, p2 = xb * sn, p3 = xb * c, p4 = xa * sn;
          float ra = p1 - p2, rb = p3 + p4;
          double wa = oracle_round(dt, ra), wb = oracle_round(dt, rb);
          double ea = oracle_round(dt, (double)xa * c - (double)xb * sn);
          double eb = oracle_round(dt, (double)xb * c + (double)xa * sn);
          differ += (wa != ea) + (wb != eb);
          double ga = oracle_from_dtype(dt, q, (size_t)ia), gb = oracle_from_dtype(dt, q, (size_t)ib);
          if (ga != wa || gb != wb)
            fail_msg("%s rope %d pos %d pair %d: got (%a, %a), fp32 contract (%a, %a), exact (%a, %a)",
                     dti ? "fp16" : "bf16", mode, pos, i, ga, gb, wa, wb, ea, eb);
        }
      }
      print_message("%s rope %d: %ld rotated values where fp32 and exact-once rounding differ\n",
                    dti ? "fp16" : "bf16", mode, differ);
      assert_true(differ > 0);
      free(cache);
    }
}

int main(void) {
  const char *seed = getenv("ATTND_TEST_SEED");
  if (seed) {
    g_rng = strtoull(seed, NULL, 0);
  } else {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    g_rng = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec;
  }
  printf("seed: ATTND_TEST_SEED=%llu\n", (unsigned long long)g_rng);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_finite),
      cmocka_unit_test(test_max_abs_bits),
      cmocka_unit_test(test_conversions_match_oracle),
      cmocka_unit_test(test_rope_fp32_contract),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

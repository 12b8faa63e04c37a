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
  /* Rounding float -> bf16 / fp16 / e4m3 and double -> bf16 / fp16 (through
   * round-to-odd fp32, as RoPE does) equals the oracle's direct rounding. */
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
    /* A double near a bf16 / fp16 tie, perturbed below fp32 resolution. */
    double x = (double)hard_float(rnd(2) ? 7 : 10);
    if (!isfinite(x))
      continue;
    x += ldexp(x, -30 - rnd(20)) * (rnd(3) - 1);
    float odd = kc_f64_to_f32_odd(x);
    assert_true((double)kc_bf16_to_f32(kc_f32_to_bf16(odd)) == oracle_round(ATTND_DT_BF16, x));
    assert_true((double)kc_fp16_to_f32(kc_f32_to_fp16(odd)) == oracle_round(ATTND_DT_FP16, x));
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
      cmocka_unit_test(test_conversions_match_oracle),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

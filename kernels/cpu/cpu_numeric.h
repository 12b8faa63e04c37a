/* cpu_numeric.h: element conversions of the CPU kernels (private to kernels/cpu).
 *
 * Written with integer shifts so that the conversion loops vectorize and give
 * the same bits on every x86-64 CPU. Rounding is round-to-nearest-even as
 * DESIGN.md 4 requires; e4m3 saturates to +-448 (satfinite).
 */
#ifndef ATTND_CPU_NUMERIC_H
#define ATTND_CPU_NUMERIC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t kc_f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float kc_u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float kc_bf16_to_f32(uint16_t h) {
  return kc_u2f((uint32_t)h << 16);
}

static inline uint16_t kc_f32_to_bf16(float f) {
  uint32_t u = kc_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN stays a quiet NaN */
    return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u); /* RNE on the 16 dropped bits; overflow carries to inf */
  return (uint16_t)(u >> 16);
}

/* fp16 -> fp32, subnormals included: shifting the exponent/mantissa field into
 * fp32 position and scaling by 2^112 rebiases normals and subnormals alike. */
static inline float kc_fp16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  float mag = kc_u2f(em << 13) * 0x1p112f;
  /* Inf/NaN keep their payload; an integer blend (not a branch) vectorizes. */
  uint32_t special = 0u - (uint32_t)(em >= 0x7c00u);
  uint32_t bits = ((0x7f800000u | (em << 13)) & special) | (kc_f2u(mag) & ~special);
  return kc_u2f(sign | bits);
}

static inline uint16_t kc_f32_to_fp16(float f) {
  uint32_t x = kc_f2u(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u)
    return sign | 0x7e00u;
  if (x >= 0x477ff000u) /* >= 65520 rounds to inf */
    return sign | 0x7c00u;
  if (x < 0x38800000u) { /* below 2^-14: subnormal; |f| * 2^24 is exact */
    float a = kc_u2f(x) * 0x1p24f;
    return sign | (uint16_t)nearbyintf(a); /* 1024 is the smallest normal, as encoded */
  }
  x += 0xfffu + ((x >> 13) & 1u);
  return sign | (uint16_t)((x >> 13) - (112u << 10));
}

/* e4m3 satfinite, RNE. 0x7e is +448; 0x7f (NaN) is never produced for numbers. */
static inline uint8_t kc_f32_to_e4m3(float f) {
  uint32_t x = kc_f2u(f);
  uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u)
    return sign | 0x7fu;
  if (x >= 0x43e00000u) /* >= 448, infinities included: saturate */
    return sign | 0x7eu;
  if (x < 0x3c800000u) { /* below 2^-6: subnormal, quantum 2^-9; |f| * 512 is exact */
    float a = kc_u2f(x) * 512.0f;
    return sign | (uint8_t)nearbyintf(a); /* 8 encodes 2^-6, the smallest normal */
  }
  x += 0x7ffffu + ((x >> 20) & 1u);
  uint32_t e = (x >> 20) - (120u << 3);
  if (e > 0x7eu)
    e = 0x7eu;
  return sign | (uint8_t)e;
}

/* e4m3 -> fp32 by table (256 entries, exact). */
static const float kc_e4m3_table[256] = {
    0.0f, 0.001953125f, 0.00390625f, 0.005859375f, 0.0078125f, 0.009765625f, 0.01171875f, 0.013671875f,
    0.015625f, 0.017578125f, 0.01953125f, 0.021484375f, 0.0234375f, 0.025390625f, 0.02734375f, 0.029296875f,
    0.03125f, 0.03515625f, 0.0390625f, 0.04296875f, 0.046875f, 0.05078125f, 0.0546875f, 0.05859375f,
    0.0625f, 0.0703125f, 0.078125f, 0.0859375f, 0.09375f, 0.1015625f, 0.109375f, 0.1171875f,
    0.125f, 0.140625f, 0.15625f, 0.171875f, 0.1875f, 0.203125f, 0.21875f, 0.234375f,
    0.25f, 0.28125f, 0.3125f, 0.34375f, 0.375f, 0.40625f, 0.4375f, 0.46875f,
    0.5f, 0.5625f, 0.625f, 0.6875f, 0.75f, 0.8125f, 0.875f, 0.9375f,
    1.0f, 1.125f, 1.25f, 1.375f, 1.5f, 1.625f, 1.75f, 1.875f,
    2.0f, 2.25f, 2.5f, 2.75f, 3.0f, 3.25f, 3.5f, 3.75f,
    4.0f, 4.5f, 5.0f, 5.5f, 6.0f, 6.5f, 7.0f, 7.5f,
    8.0f, 9.0f, 10.0f, 11.0f, 12.0f, 13.0f, 14.0f, 15.0f,
    16.0f, 18.0f, 20.0f, 22.0f, 24.0f, 26.0f, 28.0f, 30.0f,
    32.0f, 36.0f, 40.0f, 44.0f, 48.0f, 52.0f, 56.0f, 60.0f,
    64.0f, 72.0f, 80.0f, 88.0f, 96.0f, 104.0f, 112.0f, 120.0f,
    128.0f, 144.0f, 160.0f, 176.0f, 192.0f, 208.0f, 224.0f, 240.0f,
    256.0f, 288.0f, 320.0f, 352.0f, 384.0f, 416.0f, 448.0f, NAN,
    -0.0f, -0.001953125f, -0.00390625f, -0.005859375f, -0.0078125f, -0.009765625f, -0.01171875f, -0.013671875f,
    -0.015625f, -0.017578125f, -0.01953125f, -0.021484375f, -0.0234375f, -0.025390625f, -0.02734375f, -0.029296875f,
    -0.03125f, -0.03515625f, -0.0390625f, -0.04296875f, -0.046875f, -0.05078125f, -0.0546875f, -0.05859375f,
    -0.0625f, -0.0703125f, -0.078125f, -0.0859375f, -0.09375f, -0.1015625f, -0.109375f, -0.1171875f,
    -0.125f, -0.140625f, -0.15625f, -0.171875f, -0.1875f, -0.203125f, -0.21875f, -0.234375f,
    -0.25f, -0.28125f, -0.3125f, -0.34375f, -0.375f, -0.40625f, -0.4375f, -0.46875f,
    -0.5f, -0.5625f, -0.625f, -0.6875f, -0.75f, -0.8125f, -0.875f, -0.9375f,
    -1.0f, -1.125f, -1.25f, -1.375f, -1.5f, -1.625f, -1.75f, -1.875f,
    -2.0f, -2.25f, -2.5f, -2.75f, -3.0f, -3.25f, -3.5f, -3.75f,
    -4.0f, -4.5f, -5.0f, -5.5f, -6.0f, -6.5f, -7.0f, -7.5f,
    -8.0f, -9.0f, -10.0f, -11.0f, -12.0f, -13.0f, -14.0f, -15.0f,
    -16.0f, -18.0f, -20.0f, -22.0f, -24.0f, -26.0f, -28.0f, -30.0f,
    -32.0f, -36.0f, -40.0f, -44.0f, -48.0f, -52.0f, -56.0f, -60.0f,
    -64.0f, -72.0f, -80.0f, -88.0f, -96.0f, -104.0f, -112.0f, -120.0f,
    -128.0f, -144.0f, -160.0f, -176.0f, -192.0f, -208.0f, -224.0f, -240.0f,
    -256.0f, -288.0f, -320.0f, -352.0f, -384.0f, -416.0f, -448.0f, NAN,
};

/* double -> float with round-to-odd: a second rounding of the result to a
 * format with at least 2 fewer significand bits (bf16, fp16) then equals one
 * direct rounding of x, so RoPE results are rounded once, like the oracle's. */
static inline float kc_f64_to_f32_odd(double x) {
  float f = (float)x;
  if ((double)f != x && isfinite(x)) {
    uint32_t u = kc_f2u(f);
    if (fabs((double)f) > fabs(x))
      u -= 1; /* step back toward zero: truncation */
    f = kc_u2f(u | 1u);
  }
  return f;
}

#endif /* ATTND_CPU_NUMERIC_H */

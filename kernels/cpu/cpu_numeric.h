/* cpu_numeric.h: element conversions of the CPU kernels (private to kernels/cpu).
 *
 * Written with integer shifts so that the conversion loops vectorize and give
 * the same bits on every x86-64 CPU. Rounding is round-to-nearest-even as
 * docs/numerics.md requires; e4m3 saturates to +-448 (satfinite).
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

/* e4m3 code -> fp32 without a table (a gather does not vectorize): normals
 * rebias the exponent by an integer add, subnormals (exponent 0) are m * 2^-9.
 * 0x7f/0xff (NaN) never occur: the quantizer saturates. */
static inline float kc_e4m3_to_f32(uint8_t b) {
  uint32_t mag = b & 0x7fu;
  uint32_t normal = (mag << 20) + (120u << 23);
  float sub = (float)(int32_t)(b & 7u) * 0x1p-9f;
  uint32_t is_sub = 0u - (uint32_t)((b & 0x78u) == 0);
  uint32_t bits = (kc_f2u(sub) & is_sub) | (normal & ~is_sub);
  return kc_u2f(bits | ((uint32_t)(b & 0x80u) << 24));
}

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

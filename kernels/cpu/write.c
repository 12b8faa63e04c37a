/* write.c: phase 1 of the CPU backend (attnd_cpu_write), attnd_cpu_all_finite
 * and attnd_cpu_max_abs_bits.
 *
 * For every new token: RoPE on k (and on q, in place), rounding to the
 * activation dtype, quantization to the cache type and the store at its slot
 * through the item's block table. Numerics follow docs/numerics.md §2 and §4
 * to the bit: the rotation is evaluated in fp32, every operation correctly
 * rounded (no fused multiply-add), then rounded to the dtype, exactly as the
 * CUDA kernel does; quantizer divisions are fp32, rounding is RNE, so the
 * cache bytes equal the oracle's.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "attnd_kernels.h"
#include "cpu_internal.h"
#include "cpu_numeric.h"

#define KC_MAX_HALF 128 /* rotary_dim / 2 <= head_dim / 2 <= 128 */

/* Rounds to the activation dtype and returns the value as fp32 (exact). */
static inline float round_dt(attnd_dtype_t dt, float f) {
  if (dt == ATTND_DT_BF16)
    return kc_bf16_to_f32(kc_f32_to_bf16(f));
  return kc_fp16_to_f32(kc_f32_to_fp16(f));
}

/* One correctly rounded fp32 product and sum. The double product of two
 * floats is exact, and a double sum of two floats rounded to fp32 equals
 * the fp32 sum (53 >= 2 * 24 + 2 bits: double rounding is innocuous for one
 * operation), so these are the IEEE fp32 operations whatever the compiler's
 * contraction setting: a conversion between them cannot fuse into an FMA. */
static inline float mul_rn(float a, float b) {
  return (float)((double)a * (double)b);
}
static inline float add_rn(float a, float b) {
  return (float)((double)a + (double)b);
}

static inline float load_dt(attnd_dtype_t dt, const uint16_t *p, int i) {
  return dt == ATTND_DT_BF16 ? kc_bf16_to_f32(p[i]) : kc_fp16_to_f32(p[i]);
}

static inline uint16_t store_dt(attnd_dtype_t dt, float x) {
  return dt == ATTND_DT_BF16 ? kc_f32_to_bf16(x) : kc_f32_to_fp16(x);
}

/* cos/sin of one position for every rotary frequency. */
typedef struct {
  int half, rd;
  float c[KC_MAX_HALF], s[KC_MAX_HALF];
} rope_row_t;

static void rope_row_init(rope_row_t *r, const float *inv_freq, int half, int rd, int pos) {
  r->half = half;
  r->rd = rd;
  for (int i = 0; i < half; i++) {
    float angle = mul_rn((float)pos, inv_freq[i]); /* one fp32 multiply (numerics.md §4) */
    r->c[i] = cosf(angle);
    r->s[i] = sinf(angle);
  }
}

/* x: one head vector as fp32 dtype values; rotated in place and rounded:
 * x'_a = fp32(fp32(x_a c) - fp32(x_b s)), x'_b = fp32(fp32(x_b c) +
 * fp32(x_a s)), each then rounded to the dtype. */
static void rope_apply(attnd_rope_t mode, attnd_dtype_t dt, const rope_row_t *r, float *x) {
  for (int i = 0; i < r->half; i++) {
    int a = mode == ATTND_ROPE_NEOX ? i : 2 * i;
    int b = mode == ATTND_ROPE_NEOX ? i + r->half : 2 * i + 1;
    float xa = x[a], xb = x[b];
    x[a] = round_dt(dt, add_rn(mul_rn(xa, r->c[i]), -mul_rn(xb, r->s[i])));
    x[b] = round_dt(dt, add_rn(mul_rn(xb, r->c[i]), mul_rn(xa, r->s[i])));
  }
}

static inline float clampf(float x, float lo, float hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

/* Quantizes one row x[D] (dtype values) of kv head h into dst; *scale_out gets
 * the dynamic scale. Static scales are read only for the types that have them. */
static void quantize_row(const attnd_kshape_t *s, const float *scale, const float *zero,
                         int per_channel, int h, const float *x, uint8_t *dst, float *scale_out) {
  int D = s->head_dim;
  switch (s->kv) {
  case ATTND_KV_BF16: {
    uint16_t *o = (uint16_t *)dst;
    for (int d = 0; d < D; d++)
      o[d] = kc_f32_to_bf16(x[d]);
    break;
  }
  case ATTND_KV_FP16: {
    uint16_t *o = (uint16_t *)dst;
    for (int d = 0; d < D; d++)
      o[d] = kc_f32_to_fp16(x[d]);
    break;
  }
  case ATTND_KV_INT8: {
    int8_t *o = (int8_t *)dst;
    for (int d = 0; d < D; d++) {
      float sd = per_channel ? scale[(size_t)h * D + d] : scale[h];
      o[d] = (int8_t)nearbyintf(clampf(x[d] / sd, -127.0f, 127.0f));
    }
    break;
  }
  case ATTND_KV_FP8:
    for (int d = 0; d < D; d++) {
      float sd = per_channel ? scale[(size_t)h * D + d] : scale[h];
      dst[d] = kc_f32_to_e4m3(x[d] / sd);
    }
    break;
  case ATTND_KV_INT8_DYNAMIC:
  case ATTND_KV_FP8_DYNAMIC: {
    float m = 0.0f;
    for (int d = 0; d < D; d++)
      m = fmaxf(m, fabsf(x[d]));
    int is_int = s->kv == ATTND_KV_INT8_DYNAMIC;
    float sd = m / (is_int ? 127.0f : 448.0f);
    *scale_out = sd;
    if (sd == 0.0f) { /* an all-zero row: scale 0 and zeros, never 0/0 */
      memset(dst, 0, (size_t)D);
      break;
    }
    for (int d = 0; d < D; d++) {
      float t = x[d] / sd;
      if (is_int)
        dst[d] = (uint8_t)(int8_t)nearbyintf(clampf(t, -127.0f, 127.0f));
      else
        dst[d] = kc_f32_to_e4m3(t);
    }
    break;
  }
  case ATTND_KV_INT4:
    for (int d = 0; d < D; d += 2) {
      uint8_t u[2];
      for (int k = 0; k < 2; k++) {
        size_t c = (size_t)h * D + d + k;
        float t = x[d + k] / scale[c];
        t = t + zero[c];
        u[k] = (uint8_t)nearbyintf(clampf(t, 0.0f, 15.0f));
      }
      dst[d / 2] = (uint8_t)(u[0] | (u[1] << 4));
    }
    break;
  default:
    break;
  }
}

int attnd_cpu_write(const attnd_kshape_t *s, const attnd_kbatch_t *b, int part, int nparts) {
  if (kc_batch_check(s, b) != 0 || nparts <= 0 || part < 0 || part >= nparts)
    return -1;
  const int D = s->head_dim, H = s->kv_heads, QH = s->q_heads, bs = s->block_size;
  const int rd = s->rotary_dim ? s->rotary_dim : D;
  const int half = rd / 2;
  const attnd_dtype_t dt = s->dtype;
  const kc_layout_t L = kc_layout(s);
  float inv_freq[KC_MAX_HALF];
  if (s->rope != ATTND_ROPE_NONE)
    for (int i = 0; i < half; i++)
      inv_freq[i] = (float)pow(s->rope_theta, -2.0 * (double)i / (double)rd);

  /* Rows of k/v are split evenly; each row is independent of every other
   * (one session appears once per step, so no two rows share a slot). */
  /* Attend-only items' rows follow the k/v rows (virtual rows, q only). */
  const int64_t T = (int64_t)b->total_kv + (b->q_only_rows > 0 ? b->q_only_rows : 0);
  const int64_t lo = T * part / nparts, hi = T * (part + 1) / nparts;
  float x[256];
  rope_row_t rr;
  for (int it = 0; it < b->nitems; it++) {
    const attnd_kitem_t *item = &b->items[it];
    int64_t r0 = item->kv_row > lo ? item->kv_row : lo;
    int64_t r1 = (int64_t)item->kv_row + item->n < hi ? (int64_t)item->kv_row + item->n : hi;
    const int32_t *table = b->meta + item->block_table;
    const int q_only = item->kv_row >= b->total_kv;
    for (int64_t r = r0; r < r1; r++) {
      int t = (int)(r - item->kv_row);
      int pos = item->start + t;
      if (s->rope != ATTND_ROPE_NONE)
        rope_row_init(&rr, inv_freq, half, rd, item->pos_base + pos);
      for (int h = 0; !q_only && h < H; h++) {
        uint8_t *blk = b->cache + (size_t)table[pos / bs] * b->block_bytes;
        int slot = pos % bs;
        size_t src = ((size_t)r * H + h) * D;
        size_t row = (size_t)h * bs + slot;
        float sc_k = 0.0f, sc_v = 0.0f;
        const uint16_t *k = (const uint16_t *)b->k + src;
        for (int d = 0; d < D; d++)
          x[d] = load_dt(dt, k, d);
        if (s->rope != ATTND_ROPE_NONE)
          rope_apply(s->rope, dt, &rr, x);
        quantize_row(s, b->k_scale, b->k_zero, b->scale_per_channel, h, x,
                     blk + L.k_off + row * L.row_bytes, &sc_k);
        const uint16_t *v = (const uint16_t *)b->v + src;
        for (int d = 0; d < D; d++)
          x[d] = load_dt(dt, v, d);
        quantize_row(s, b->v_scale, b->v_zero, b->scale_per_channel, h, x,
                     blk + L.v_off + row * L.row_bytes, &sc_v);
        if (L.dynamic) {
          memcpy(blk + L.ks_off + row * 4, &sc_k, 4);
          memcpy(blk + L.vs_off + row * 4, &sc_v, 4);
        }
      }
      /* q of the same token, rotated in place for phase 2. */
      if (item->q_row >= 0 && s->rope != ATTND_ROPE_NONE) {
        uint16_t *q = (uint16_t *)b->q + ((size_t)(item->q_row + t) * QH) * D;
        for (int qh = 0; qh < QH; qh++, q += D) {
          for (int d = 0; d < D; d++)
            x[d] = load_dt(dt, q, d);
          rope_apply(s->rope, dt, &rr, x);
          for (int d = 0; d < D; d++)
            q[d] = store_dt(dt, x[d]);
        }
      }
    }
  }
  return 0;
}

int attnd_cpu_all_finite(attnd_dtype_t dt, const void *p, size_t count) {
  /* An OR over the exponent test, not an early exit, so the loop vectorizes.
   * Elements are read through memcpy: this validates raw request bytes, which
   * need not be element-aligned. */
  const uint8_t *c = p;
  uint32_t bad = 0;
  if (dt == ATTND_DT_BF16 || dt == ATTND_DT_FP16) {
    uint16_t mask = dt == ATTND_DT_BF16 ? 0x7f80u : 0x7c00u;
    for (size_t i = 0; i < count; i++) {
      uint16_t h;
      memcpy(&h, c + 2 * i, 2);
      bad |= (uint32_t)((h & mask) == mask);
    }
  } else if (dt == ATTND_DT_FP32) {
    for (size_t i = 0; i < count; i++) {
      uint32_t w;
      memcpy(&w, c + 4 * i, 4);
      bad |= (uint32_t)((w & 0x7f800000u) == 0x7f800000u);
    }
  } else {
    return 1; /* integers are always finite */
  }
  return bad == 0;
}

uint32_t attnd_cpu_max_abs_bits(attnd_dtype_t dt, const void *p, size_t count) {
  /* A max over the magnitude bits, no early exit, so the loop vectorizes;
   * memcpy reads because request bytes need not be element-aligned. */
  const uint8_t *c = p;
  if (dt == ATTND_DT_BF16 || dt == ATTND_DT_FP16) {
    uint16_t m = 0;
    for (size_t i = 0; i < count; i++) {
      uint16_t h;
      memcpy(&h, c + 2 * i, 2);
      h &= 0x7fffu;
      m = h > m ? h : m;
    }
    return m;
  }
  if (dt == ATTND_DT_FP32) {
    uint32_t m = 0;
    for (size_t i = 0; i < count; i++) {
      uint32_t w;
      memcpy(&w, c + 4 * i, 4);
      w &= 0x7fffffffu;
      m = w > m ? w : m;
    }
    return m;
  }
  return 0;
}

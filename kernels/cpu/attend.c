/* attend.c: phase 2 of the CPU backend (attnd_cpu_attend).
 *
 * Flash-style: a work unit is (item, kv head, q-head subgroup, query-row tile)
 * with at most kc_qmax(D) query vectors (rows x q heads of one GQA group). It walks
 * the visible keys in chunks that never cross a block, decodes each K and V
 * chunk ONCE into fp32 for all its query vectors, and keeps an online softmax
 * (running max, sum, output accumulator) in fp32. Scores are kept in log2 units
 * (softmax_scale * log2(e) folded into q) so the exponentials are exp2.
 *
 * Quantization scales never enter the inner loops; the chunk holds the stored
 * codes as floats and the scales are applied where they cost least:
 *   static K scale s_d:   folded into q (q_d * s_d), once per unit;
 *   static V scale s_d:   applied to the normalized output;
 *   int4 zero points z_d: K: q.(u - z)s = (q*s).u - (q*s).z, and the second
 *                         term is the same for every key, so softmax ignores
 *                         it and only lse subtracts it; V: out_d = s_d *
 *                         (sum p u / l - z_d);
 *   dynamic scales s_j:   K: the score of key j times s_j; V: p_j * s_j.
 * int4 chunks are unpacked channel-permuted (all low nibbles, then all high
 * nibbles) so the unpack vectorizes; q is permuted the same way and the output
 * un-permuted, and a dot product does not care about order.
 *
 * Fully masked rows never touch the accumulator: they end with sum 0 and give
 * exactly 0 and lse = -inf (with a sink: lse = the sink), never 0/0.
 *
 * Per-layer variants (docs/numerics.md): a window w hides keys j <= p - w on
 * top of the item's mask, and the keys left of the unit's first row's window
 * are never loaded; soft-capping replaces each score s (after the K scales,
 * before the mask) by c * tanh(s / c), so the int4 zero-point term joins the
 * score before capping instead of being left to lse; a sink logit joins the
 * denominator once, when the unit's rows are normalized.
 *
 * Parts: unit u belongs to part u % nparts, so a single decode session splits
 * over kv heads and causal prefill tiles (of unequal cost) spread evenly.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "attnd_kernels.h"
#include "cpu_internal.h"
#include "cpu_numeric.h"

#define KC_QT 32             /* most query vectors per unit */
#define KC_Q_FLOATS 4096     /* query vectors per unit * head_dim (stack: q and acc) */
#define KC_CHUNK_FLOATS 4096 /* keys per chunk * head_dim */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) &&                             \
    !defined(__SANITIZE_ADDRESS__) && !defined(ATTND_KC_BASELINE)
/* x86-64-v3 (AVX2 + FMA) and a baseline clone, picked at load time by CPU
 * features, so one binary runs on any x86-64. Contraction into FMA is allowed
 * here only: attention has no bit-exact contract (write.c does, and keeps
 * the ISO C default, no contraction). */
#define KC_HOT                                                                                     \
  __attribute__((target_clones("arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
#else
#define KC_HOT
#endif

#define KC_INLINE static inline __attribute__((always_inline))

/* Decodes rows [slot0, slot0 + cn) of one kv head of one block into dst[cn][D]:
 * the stored codes as floats, no scale (see the header comment). */
KC_INLINE void decode_chunk(attnd_kv_type_t kv, int D, const uint8_t *src, int cn,
                            float *restrict dst) {
  const int n = cn * D;
  switch (kv) {
  case ATTND_KV_BF16: {
    const uint16_t *h = (const uint16_t *)src;
    for (int i = 0; i < n; i++)
      dst[i] = kc_u2f((uint32_t)h[i] << 16);
    break;
  }
  case ATTND_KV_FP16: {
    const uint16_t *h = (const uint16_t *)src;
    for (int i = 0; i < n; i++)
      dst[i] = kc_fp16_to_f32(h[i]);
    break;
  }
  case ATTND_KV_INT8:
  case ATTND_KV_INT8_DYNAMIC: {
    const int8_t *v = (const int8_t *)src;
    for (int i = 0; i < n; i++)
      dst[i] = (float)v[i];
    break;
  }
  case ATTND_KV_FP8:
  case ATTND_KV_FP8_DYNAMIC:
    for (int i = 0; i < n; i++)
      dst[i] = kc_e4m3_to_f32(src[i]);
    break;
  case ATTND_KV_INT4: {
    const int H = D / 2;
    for (int c = 0; c < cn; c++) {
      const uint8_t *p = src + (size_t)c * H;
      float *o = dst + (size_t)c * D;
      for (int i = 0; i < H; i++) {
        o[i] = (float)(int32_t)(p[i] & 15u);
        o[H + i] = (float)(int32_t)(p[i] >> 4);
      }
    }
    break;
  }
  default:
    break;
  }
}

/* Channel d's position in a decoded row (int4 rows are permuted). */
static inline int chan_pos(int int4, int D, int d) {
  return int4 ? (d & 1) * (D / 2) + d / 2 : d;
}

/* The inner products are written with GCC vector types (8 floats): the AVX2
 * clone maps one to a ymm register, the baseline clone to two xmm registers.
 * Plain loops left the choice to the vectorizer, which split them badly.
 * Vectors never cross a function boundary (always_inline), so no ABI change. */
typedef float kc_v8 __attribute__((vector_size(32)));

typedef int32_t kc_i8 __attribute__((vector_size(32)));

/* Two-vector shuffle with constant lane indices; GCC and clang name it differently. */
#if defined(__clang__)
#define KC_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KC_SHUF(a, b, ...) __builtin_shuffle(a, b, (kc_i8){__VA_ARGS__})
#endif

#define KC_LD(v, p) memcpy(&(v), (p), sizeof(kc_v8))
#define KC_ST(p, v) memcpy((p), &(v), sizeof(kc_v8))

KC_INLINE float hsum8(const kc_v8 *v) {
  kc_v8 a = *v;
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Score of one query row q against one key row k. */
KC_INLINE float dot(const float *restrict q, const float *restrict k, int D) {
  kc_v8 a0 = {0}, a1 = {0}, x, y;
  for (int d = 0; d < D; d += 16) {
    KC_LD(x, q + d);
    KC_LD(y, k + d);
    a0 += x * y;
    KC_LD(x, q + d + 8);
    KC_LD(y, k + d + 8);
    a1 += x * y;
  }
  a0 += a1;
  return hsum8(&a0);
}

/* Scores of 4 query rows (Q, stride D) against one key row: the key loads once. */
KC_INLINE void dot4(const float *restrict Q, int D, const float *restrict k, float *restrict out) {
  kc_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, kv, x;
  for (int d = 0; d < D; d += 8) {
    KC_LD(kv, k + d);
    KC_LD(x, Q + d);
    a0 += x * kv;
    KC_LD(x, Q + D + d);
    a1 += x * kv;
    KC_LD(x, Q + 2 * D + d);
    a2 += x * kv;
    KC_LD(x, Q + 3 * D + d);
    a3 += x * kv;
  }
  /* Four horizontal sums at once: two rounds of pairwise shuffles and adds
   * leave lanes q and q + 4 holding the two halves of query q's sum. */
#define KC_LO 0, 8, 1, 9, 4, 12, 5, 13
#define KC_HI 2, 10, 3, 11, 6, 14, 7, 15
#define KC_LO2 0, 1, 8, 9, 4, 5, 12, 13
#define KC_HI2 2, 3, 10, 11, 6, 7, 14, 15
  kc_v8 t0 = KC_SHUF(a0, a1, KC_LO) + KC_SHUF(a0, a1, KC_HI);
  kc_v8 t1 = KC_SHUF(a2, a3, KC_LO) + KC_SHUF(a2, a3, KC_HI);
  kc_v8 u = KC_SHUF(t0, t1, KC_LO2) + KC_SHUF(t0, t1, KC_HI2);
  for (int q = 0; q < 4; q++)
    out[q] = u[q] + u[q + 4];
}

/* A[q][:] += sum_c P[q][c] * V[c][:] for 4 query rows (P stride C): the
 * accumulators stay in registers over the chunk and each V row loads once. */
KC_INLINE void axpy4(float *restrict A, int D, const float *restrict P, int C, int cn,
                     const float *restrict V) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    kc_v8 a[4][2], v0, v1;
    for (int q = 0; q < 4; q++) {
      KC_LD(a[q][0], A + q * D + d0);
      KC_LD(a[q][1], A + q * D + d0 + 8);
    }
    for (int c = 0; c < cn; c++) {
      KC_LD(v0, V + (size_t)c * D + d0);
      KC_LD(v1, V + (size_t)c * D + d0 + 8);
      for (int q = 0; q < 4; q++) {
        float p = P[q * C + c];
        a[q][0] += p * v0;
        a[q][1] += p * v1;
      }
    }
    for (int q = 0; q < 4; q++) {
      KC_ST(A + q * D + d0, a[q][0]);
      KC_ST(A + q * D + d0 + 8, a[q][1]);
    }
  }
}

/* The one-row version, for what is left of a unit after groups of 4. */
KC_INLINE void axpy1(float *restrict A, int D, const float *restrict P, int cn,
                     const float *restrict V) {
  for (int d0 = 0; d0 < D; d0 += 32) {
    kc_v8 a[4], v;
    for (int k = 0; k < 4; k++)
      KC_LD(a[k], A + d0 + 8 * k);
    for (int c = 0; c < cn; c++) {
      float p = P[c];
      for (int k = 0; k < 4; k++) {
        KC_LD(v, V + (size_t)c * D + d0 + 8 * k);
        a[k] += p * v;
      }
    }
    for (int k = 0; k < 4; k++)
      KC_ST(A + d0 + 8 * k, a[k]);
  }
}

static inline void prefetch_rows(const uint8_t *p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64)
    __builtin_prefetch(p + off, 0, 3);
}

/* 2^x in place for x <= 0 (or -inf -> 0): Cody-Waite split and a degree-7
 * polynomial, relative error ~1e-7. The clamp at -126 and the flush to 0 are
 * integer operations on the bits: a float select here keeps GCC (which must
 * assume trapping math) from vectorizing the loop. */
KC_INLINE void exp2_neg(float *restrict x, int n) {
  for (int i = 0; i < n; i++) {
    uint32_t mag = kc_f2u(x[i]) & 0x7fffffffu;          /* |x|; x <= 0 */
    uint32_t keep = 0u - (uint32_t)(mag < 0x42fc0000u); /* |x| < 126 */
    float tc = -kc_u2f(mag < 0x42fc0000u ? mag : 0x42fc0000u);
    float k = (tc + 12582912.0f) - 12582912.0f; /* rint: 1.5 * 2^23 */
    float y = (tc - k) * 0.693147180559945309f;
    float p = 1.0f / 5040.0f;
    p = p * y + 1.0f / 720.0f;
    p = p * y + 1.0f / 120.0f;
    p = p * y + 1.0f / 24.0f;
    p = p * y + 1.0f / 6.0f;
    p = p * y + 0.5f;
    p = p * y + 1.0f;
    p = p * y + 1.0f;
    float two_k = kc_u2f(((uint32_t)((int32_t)k + 127) << 23) & keep);
    x[i] = p * two_k;
  }
}

static inline float exp2_one(float t) {
  float x[1] = {t};
  exp2_neg(x, 1);
  return x[0];
}

static inline int visible(const attnd_kitem_t *it, const int32_t *iv, int kv_len, int p, int j) {
  switch (it->mask_kind) {
  case ATTND_MASK_CAUSAL:
    return j <= p;
  case ATTND_MASK_FULL:
    return 1;
  case ATTND_MASK_SLIDING:
    return j <= p && j > p - it->mask_param;
  case ATTND_MASK_PREFIX_LM:
    return j < it->mask_param || j <= p;
  default: /* INTERVALS */
    if (it->causal && j > p)
      return 0;
    if (!iv)
      return 1;
    return !((iv[j] <= p && p < iv[kv_len + j]) ||
             (iv[2 * kv_len + j] <= p && p < iv[3 * kv_len + j]));
  }
}

/* 1 when every key in [j0, j1) is visible to every row in [pmin, pmax]. */
static inline int chunk_all_visible(const attnd_kitem_t *it, int pmin, int pmax, int j0, int j1) {
  switch (it->mask_kind) {
  case ATTND_MASK_CAUSAL:
    return j1 - 1 <= pmin;
  case ATTND_MASK_FULL:
    return 1;
  case ATTND_MASK_SLIDING:
    return j1 - 1 <= pmin && j0 > pmax - it->mask_param;
  case ATTND_MASK_PREFIX_LM:
    return j1 - 1 < it->mask_param || j1 - 1 <= pmin;
  default:
    return 0;
  }
}

typedef struct {
  const attnd_kshape_t *s;
  const attnd_kbatch_t *b;
  kc_layout_t L;
  int G; /* q heads per kv head */
} kc_ctx_t;

/* One unit: item `it`, kv head h, q heads h*G + g0 .. + gn-1, rows r0 .. r0+rn-1. */
KC_HOT static void attend_unit(const kc_ctx_t *cx, const attnd_kitem_t *it, int h, int g0, int gn,
                               int r0, int rn) {
  const attnd_kshape_t *s = cx->s;
  const attnd_kbatch_t *b = cx->b;
  const int D = s->head_dim, QH = s->q_heads, bs = s->block_size;
  const int nq = gn * rn;
  const int kv_len = it->start + it->n;
  const int32_t *table = b->meta + it->block_table;
  const int32_t *iv =
      it->mask_kind == ATTND_MASK_INTERVALS && it->intervals >= 0 ? b->meta + it->intervals : NULL;
  const int int4 = s->kv == ATTND_KV_INT4;
  const int stat = s->kv == ATTND_KV_INT8 || s->kv == ATTND_KV_FP8;
  const int W = b->window > 0 ? b->window : 0;
  const float cap2 = s->softcap > 0.0f ? s->softcap * 1.44269504088896341f : 0.0f; /* log2 units */
  const float *sinks = (it->flags & ATTND_ITEM_SINK) && b->sinks ? b->sinks : NULL;

  float Q[KC_Q_FLOATS];
  float acc[KC_Q_FLOATS];
  float buf[KC_CHUNK_FLOATS]; /* K chunk, then V chunk */
  float S[KC_QT * 64];        /* scores, then probabilities, [nq][C]; C <= 64 */
  float m[KC_QT], l[KC_QT], kbias[KC_QT];
  int pos[KC_QT];

  /* Static scales (and zero points) of this kv head: only for the types
   * that have them, never looked at otherwise. */
  const float *ks = NULL, *vs = NULL, *kz = NULL, *vz = NULL;
  float ks1 = 1.0f, vs1 = 1.0f;
  if (stat && b->scale_per_channel) {
    ks = b->k_scale + (size_t)h * D;
    vs = b->v_scale + (size_t)h * D;
  } else if (stat) {
    ks1 = b->k_scale[h];
    vs1 = b->v_scale[h];
  } else if (int4) {
    ks = b->k_scale + (size_t)h * D;
    vs = b->v_scale + (size_t)h * D;
    kz = b->k_zero + (size_t)h * D;
    vz = b->v_zero + (size_t)h * D;
  }

  /* q in log2 units, fp32, with the static K scale folded in (and permuted
   * like an int4 row). kbias: the int4 zero-point term, for lse only. */
  const float qscale = s->softmax_scale * 1.44269504088896341f;
  for (int ri = 0; ri < rn; ri++)
    for (int gi = 0; gi < gn; gi++) {
      int qi = ri * gn + gi;
      const uint16_t *q = (const uint16_t *)b->q +
                          ((size_t)(it->q_row + r0 + ri) * QH + (size_t)h * cx->G + g0 + gi) * D;
      float *Qi = Q + qi * D;
      float kb = 0.0f;
      for (int d = 0; d < D; d++) {
        float x = s->dtype == ATTND_DT_BF16 ? kc_bf16_to_f32(q[d]) : kc_fp16_to_f32(q[d]);
        x *= qscale * (ks ? ks[d] : ks1);
        if (kz)
          kb += x * kz[d];
        Qi[chan_pos(int4, D, d)] = x;
      }
      kbias[qi] = kb;
      m[qi] = -INFINITY;
      l[qi] = 0.0f;
      pos[qi] = it->start + r0 + ri;
    }
  memset(acc, 0, sizeof(float) * (size_t)nq * D);
  const int pmin = it->start + r0, pmax = it->start + r0 + rn - 1;

  /* Keys no row of this unit can see are skipped before any load. */
  int jlo = 0, jhi = kv_len;
  switch (it->mask_kind) {
  case ATTND_MASK_CAUSAL:
    jhi = pmax + 1;
    break;
  case ATTND_MASK_SLIDING:
    jhi = pmax + 1;
    jlo = pmin - it->mask_param + 1;
    break;
  case ATTND_MASK_PREFIX_LM:
    jhi = pmax + 1 > it->mask_param ? pmax + 1 : it->mask_param;
    break;
  case ATTND_MASK_INTERVALS:
    if (it->causal)
      jhi = pmax + 1;
    break;
  default:
    break;
  }
  if (W && jlo < pmin - W + 1)
    jlo = pmin - W + 1;
  if (jlo < 0)
    jlo = 0;
  if (jhi > kv_len)
    jhi = kv_len;

  const kc_layout_t *L = &cx->L;
  int C = KC_CHUNK_FLOATS / D;
  if (C > bs)
    C = bs;
  for (int j0 = jlo; j0 < jhi;) {
    const int slot0 = j0 % bs;
    int cn = bs - slot0;
    if (cn > C)
      cn = C;
    if (cn > jhi - j0)
      cn = jhi - j0;
    const uint8_t *blk = b->cache + (size_t)table[j0 / bs] * b->block_bytes;
    const size_t row = (size_t)h * bs + slot0;
    const float *kdyn = L->dynamic ? (const float *)(blk + L->ks_off) + row : NULL;
    const float *vdyn = L->dynamic ? (const float *)(blk + L->vs_off) + row : NULL;

    /* Ask for the next chunk's K and V now, so the loads overlap this chunk's math. */
    if (j0 + cn < jhi) {
      int jn = j0 + cn, sn = jn % bs, nn = bs - sn < C ? bs - sn : C;
      const uint8_t *nb = b->cache + (size_t)table[jn / bs] * b->block_bytes;
      size_t nrow = (size_t)h * bs + sn;
      prefetch_rows(nb + L->k_off + nrow * L->row_bytes, (size_t)nn * L->row_bytes);
      prefetch_rows(nb + L->v_off + nrow * L->row_bytes, (size_t)nn * L->row_bytes);
    }
    decode_chunk(s->kv, D, blk + L->k_off + row * L->row_bytes, cn, buf);
    int q4 = nq & ~3;
    for (int qi = 0; qi < q4; qi += 4)
      for (int c = 0; c < cn; c++) {
        float t[4];
        dot4(Q + qi * D, D, buf + c * D, t);
        for (int i = 0; i < 4; i++)
          S[(qi + i) * C + c] = t[i];
      }
    for (int qi = q4; qi < nq; qi++)
      for (int c = 0; c < cn; c++)
        S[qi * C + c] = dot(Q + qi * D, buf + c * D, D);
    if (kdyn)
      for (int qi = 0; qi < nq; qi++)
        for (int c = 0; c < cn; c++)
          S[qi * C + c] *= kdyn[c];
    if (cap2 > 0.0f)
      for (int qi = 0; qi < nq; qi++)
        for (int c = 0; c < cn; c++)
          S[qi * C + c] = cap2 * tanhf((S[qi * C + c] - kbias[qi]) / cap2);
    if (!chunk_all_visible(it, pmin, pmax, j0, j0 + cn) || (W && j0 <= pmax - W))
      for (int qi = 0; qi < nq; qi++)
        for (int c = 0; c < cn; c++)
          if (!visible(it, iv, kv_len, pos[qi], j0 + c) || (W && j0 + c <= pos[qi] - W))
            S[qi * C + c] = -INFINITY;

    /* Online softmax update; rows with nothing visible in the chunk skip it. */
    int need_v = 0;
    int live[KC_QT];
    for (int qi = 0; qi < nq; qi++) {
      float *Si = S + qi * C;
      float mx = -INFINITY;
      for (int c = 0; c < cn; c++)
        mx = Si[c] > mx ? Si[c] : mx;
      live[qi] = mx != -INFINITY;
      if (!live[qi])
        continue;
      need_v = 1;
      float mnew = mx > m[qi] ? mx : m[qi];
      if (mnew > m[qi] && m[qi] != -INFINITY) {
        float corr = exp2_one(m[qi] - mnew);
        l[qi] *= corr;
        float *Ai = acc + qi * D;
        for (int d = 0; d < D; d++)
          Ai[d] *= corr;
      }
      m[qi] = mnew;
      for (int c = 0; c < cn; c++)
        Si[c] -= mnew;
      exp2_neg(Si, cn);
      float sum = 0.0f;
      for (int c = 0; c < cn; c++)
        sum += Si[c];
      l[qi] += sum;
      if (vdyn)
        for (int c = 0; c < cn; c++)
          Si[c] *= vdyn[c];
    }
    if (need_v) {
      decode_chunk(s->kv, D, blk + L->v_off + row * L->row_bytes, cn, buf);
      int qi = 0;
      for (; qi + 4 <= nq; qi += 4) {
        if (live[qi] && live[qi + 1] && live[qi + 2] && live[qi + 3]) {
          axpy4(acc + qi * D, D, S + qi * C, C, cn, buf);
          continue;
        }
        for (int i = qi; i < qi + 4; i++)
          if (live[i])
            axpy1(acc + i * D, D, S + i * C, cn, buf);
      }
      for (; qi < nq; qi++)
        if (live[qi])
          axpy1(acc + qi * D, D, S + qi * C, cn, buf);
    }
    j0 += cn;
  }

  /* Normalize, apply the V scale (and zero point), store; fully masked rows
   * (l == 0) store exact zeros. Scores here are s - kb in log2 units (kb: the
   * int4 zero-point term, already inside capped scores), so the sink enters
   * as sink * log2(e) + kb: m = max(m, sink), l = l * 2^(m_old - m) + 2^(sink - m). */
  for (int ri = 0; ri < rn; ri++)
    for (int gi = 0; gi < gn; gi++) {
      int qi = ri * gn + gi;
      const int head = h * cx->G + g0 + gi;
      size_t orow = (size_t)(it->q_row + r0 + ri) * QH + (size_t)head;
      const int dead = !(l[qi] > 0.0f);
      const float kb = cap2 > 0.0f ? 0.0f : kbias[qi];
      float corr = 1.0f, lk = l[qi];
      if (sinks && !dead) {
        float sk = sinks[head] * 1.44269504088896341f + kb;
        float mnew = sk > m[qi] ? sk : m[qi];
        corr = exp2_one(m[qi] - mnew);
        l[qi] = l[qi] * corr + exp2_one(sk - mnew);
        m[qi] = mnew;
      }
      const float inv = dead ? 0.0f : corr / l[qi];
      /* int4 V: sum_j p_j (u_j - z) = sum_j p_j u_j - z * (the keys' share of
       * the denominator), which is 1 without a sink. */
      const float zshare = sinks ? lk * inv : 1.0f;
      float *Ai = acc + qi * D;
      if (int4) {
        float o[256];
        for (int d = 0; d < D; d++)
          o[d] = dead ? 0.0f : vs[d] * (Ai[chan_pos(1, D, d)] * inv - vz[d] * zshare);
        memcpy(Ai, o, sizeof(float) * (size_t)D);
      } else {
        for (int d = 0; d < D; d++)
          Ai[d] *= inv * (vs ? vs[d] : vs1);
      }
      if (b->out_fp32) {
        float *o = (float *)b->out + orow * D;
        memcpy(o, Ai, sizeof(float) * (size_t)D);
      } else if (s->dtype == ATTND_DT_BF16) {
        uint16_t *o = (uint16_t *)b->out + orow * D;
        for (int d = 0; d < D; d++)
          o[d] = kc_f32_to_bf16(Ai[d]);
      } else {
        uint16_t *o = (uint16_t *)b->out + orow * D;
        for (int d = 0; d < D; d++)
          o[d] = kc_f32_to_fp16(Ai[d]);
      }
      if (b->lse)
        b->lse[orow] = dead ? (sinks ? sinks[head] : -INFINITY)
                            : (m[qi] + log2f(l[qi]) - kb) * 0.693147180559945309f;
    }
}

/* Query rows per unit: past 32 query vectors (16 for d 256) q and the
 * accumulators leave L1 and prefill gets slower again (measured on 2 cores:
 * 16 -> 32 took 512 rows over 4k keys from ~590 to ~420 ms, 64 was back at
 * ~540). At most 16 q heads share a unit, so even a decode step of an MQA
 * model (one kv head) has units for more than one thread. */
static void unit_geometry(const attnd_kshape_t *s, int *gsub, int *rt) {
  const int G = s->q_heads / s->kv_heads;
  const int qmax = KC_Q_FLOATS / s->head_dim < KC_QT ? KC_Q_FLOATS / s->head_dim : KC_QT;
  *gsub = G < 16 ? G : 16;
  *rt = qmax / *gsub;
}

int attnd_cpu_attend_geometry(const attnd_kshape_t *s, int *tile_rows, int *tile_units) {
  if (attnd_kshape_check(s) != 0)
    return -1;
  int gsub, rt;
  unit_geometry(s, &gsub, &rt);
  const int G = s->q_heads / s->kv_heads;
  *tile_rows = rt;
  *tile_units = s->kv_heads * ((G + gsub - 1) / gsub);
  return 0;
}

int attnd_cpu_attend_units(const attnd_kshape_t *s, const attnd_kbatch_t *b, int64_t u0, int64_t u1,
                           int part, int nparts) {
  if (kc_batch_check(s, b) != 0 || nparts <= 0 || part < 0 || part >= nparts || u0 < 0)
    return -1;
  kc_ctx_t cx = {.s = s, .b = b, .L = kc_layout(s), .G = s->q_heads / s->kv_heads};
  int gsub, rt;
  unit_geometry(s, &gsub, &rt);
  const int ngroups = (cx.G + gsub - 1) / gsub;
  const int64_t tu = (int64_t)s->kv_heads * ngroups; /* units per row tile */
  /* Units are numbered item by item (items with q), row tile by row tile
   * (tiles start at each item's first row), then kv head, then q-head group:
   * each computes its own output rows and heads, the same way whichever
   * range or part it falls in. */
  int64_t base = 0;
  for (int i = 0; i < b->nitems && base < u1; i++) {
    const attnd_kitem_t *it = &b->items[i];
    if (it->q_row < 0)
      continue;
    const int64_t ntiles = (it->n + rt - 1) / rt, end = base + ntiles * tu;
    if (end <= u0) {
      base = end;
      continue;
    }
    int64_t u = base > u0 ? base : u0;
    for (; u < end && u < u1; u++) {
      if ((u - u0) % nparts != part)
        continue;
      int64_t k = u - base;
      int r0 = (int)(k / tu) * rt, h = (int)(k % tu) / ngroups, g = (int)(k % ngroups);
      int rn = it->n - r0 < rt ? it->n - r0 : rt;
      int g0 = g * gsub;
      int gn = cx.G - g0 < gsub ? cx.G - g0 : gsub;
      attend_unit(&cx, it, h, g0, gn, r0, rn);
    }
    base = end;
  }
  return 0;
}

int attnd_cpu_attend(const attnd_kshape_t *s, const attnd_kbatch_t *b, int part, int nparts) {
  return attnd_cpu_attend_units(s, b, 0, INT64_MAX, part, nparts);
}

/* oracle.c: the float64 reference of docs/numerics.md (cache formats, attention).
 *
 * Written for obviousness, not speed: rounding goes through frexp/nearbyint on
 * doubles (no bit tricks shared with the kernels), attention is the textbook
 * two-pass softmax over a dense [len][kv_heads][head_dim] array.
 */
#include <assert.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "oracle.h"

/* ---- rounding ------------------------------------------------------------ */

/* Rounds x to a binary format with `prec` significand bits (implicit bit
 * included) and minimum normal exponent emin (subnormals keep the quantum of
 * the smallest normal binade). Round-to-nearest-even via nearbyint in the
 * default rounding mode. No overflow handling: callers check the range. */
static double round_prec(double x, int prec, int emin) {
  if (x == 0.0 || !isfinite(x))
    return x;
  int e;
  (void)frexp(x, &e); /* x = m * 2^e, 0.5 <= |m| < 1: leading bit is 2^(e-1) */
  int lead = e - 1;
  if (lead < emin)
    lead = emin;
  int qexp = lead - (prec - 1); /* weight of the last significand bit */
  return ldexp(nearbyint(ldexp(x, -qexp)), qexp);
}

static double round_ieee(double x, int prec, int emin, double maxv) {
  double r = round_prec(x, prec, emin);
  /* round_prec lands exactly on 2^(emax+1) when x is at or past the overflow
   * threshold (max + half an ulp, ties going to the even 2^(emax+1)). */
  if (r > maxv)
    return INFINITY;
  if (r < -maxv)
    return -INFINITY;
  return r;
}

#define BF16_MAX 3.38953138925153547590470800371487866880e+38 /* (2 - 2^-7) * 2^127 */

double oracle_round(attnd_dtype_t dt, double x) {
  switch (dt) {
  case ATTND_DT_BF16:
    return round_ieee(x, 8, -126, BF16_MAX);
  case ATTND_DT_FP16:
    return round_ieee(x, 11, -14, 65504.0);
  case ATTND_DT_FP32:
    return round_ieee(x, 24, -126, (double)FLT_MAX);
  case ATTND_DT_INT32:
    return nearbyint(x);
  }
  abort();
}

double oracle_fp8_e4m3(float x) {
  double xd = (double)x;
  if (isnan(xd))
    return xd;
  /* e4m3: 3 stored mantissa bits, bias 7, min normal 2^-6, max finite 448;
   * satfinite clamps anything beyond (infinities included) to +-448. */
  if (xd >= 448.0)
    return 448.0;
  if (xd <= -448.0)
    return -448.0;
  double r = round_prec(xd, 4, -6);
  if (r > 448.0)
    r = 448.0;
  if (r < -448.0)
    r = -448.0;
  return r;
}

/* ---- storage conversions (decoded by value, not by shared bit helpers) ----- */

static double decode_bits(uint32_t bits, int ebits, int mbits) {
  uint32_t sign = bits >> (ebits + mbits);
  uint32_t e = (bits >> mbits) & ((1u << ebits) - 1);
  uint32_t m = bits & ((1u << mbits) - 1);
  int bias = (1 << (ebits - 1)) - 1;
  double v;
  if (e == 0)
    v = ldexp((double)m, 1 - bias - mbits);
  else if (e == (1u << ebits) - 1)
    v = m ? NAN : INFINITY;
  else
    v = ldexp((double)(m | (1u << mbits)), (int)e - bias - mbits);
  return sign ? -v : v;
}

/* Bits of an exactly representable value v (already rounded, possibly inf). */
static uint32_t encode_bits(double v, int ebits, int mbits) {
  uint32_t sign = signbit(v) ? 1u : 0u;
  int bias = (1 << (ebits - 1)) - 1;
  uint32_t emax_field = (1u << ebits) - 1;
  uint32_t out;
  v = fabs(v);
  if (isnan(v)) {
    out = (emax_field << mbits) | (1u << (mbits - 1));
  } else if (isinf(v)) {
    out = emax_field << mbits;
  } else if (v == 0.0) {
    out = 0;
  } else {
    int e;
    (void)frexp(v, &e);
    int lead = e - 1;
    if (lead < 1 - bias) { /* subnormal */
      out = (uint32_t)ldexp(v, bias - 1 + mbits);
    } else {
      uint32_t m = (uint32_t)(ldexp(v, mbits - lead)) - (1u << mbits);
      out = ((uint32_t)(lead + bias) << mbits) | m;
    }
  }
  return (sign << (ebits + mbits)) | out;
}

double oracle_from_dtype(attnd_dtype_t dt, const void *p, size_t i) {
  switch (dt) {
  case ATTND_DT_BF16: {
    uint16_t b;
    memcpy(&b, (const uint8_t *)p + 2 * i, 2);
    return decode_bits(b, 8, 7);
  }
  case ATTND_DT_FP16: {
    uint16_t b;
    memcpy(&b, (const uint8_t *)p + 2 * i, 2);
    return decode_bits(b, 5, 10);
  }
  case ATTND_DT_FP32: {
    float f;
    memcpy(&f, (const uint8_t *)p + 4 * i, 4);
    return (double)f;
  }
  case ATTND_DT_INT32: {
    int32_t v;
    memcpy(&v, (const uint8_t *)p + 4 * i, 4);
    return (double)v;
  }
  }
  abort();
}

void oracle_to_dtype(attnd_dtype_t dt, void *p, size_t i, double x) {
  switch (dt) {
  case ATTND_DT_BF16: {
    uint16_t b = (uint16_t)encode_bits(oracle_round(dt, x), 8, 7);
    memcpy((uint8_t *)p + 2 * i, &b, 2);
    return;
  }
  case ATTND_DT_FP16: {
    uint16_t b = (uint16_t)encode_bits(oracle_round(dt, x), 5, 10);
    memcpy((uint8_t *)p + 2 * i, &b, 2);
    return;
  }
  case ATTND_DT_FP32: {
    float f = (float)oracle_round(dt, x);
    memcpy((uint8_t *)p + 4 * i, &f, 4);
    return;
  }
  case ATTND_DT_INT32: {
    int32_t v = (int32_t)nearbyint(x);
    memcpy((uint8_t *)p + 4 * i, &v, 4);
    return;
  }
  }
  abort();
}

/* ---- RoPE ----------------------------------------------------------------- */

static double f32(double x) {
  return oracle_round(ATTND_DT_FP32, x);
}

void oracle_rope(const attnd_kshape_t *s, int pos, const double *in, double *out) {
  int D = s->head_dim;
  int rd = s->rotary_dim ? s->rotary_dim : D;
  for (int d = 0; d < D; d++)
    out[d] = oracle_round(s->dtype, in[d]);
  if (s->rope == ATTND_ROPE_NONE)
    return;
  int half = rd / 2;
  for (int i = 0; i < half; i++) {
    float inv_freq = (float)pow(s->rope_theta, -2.0 * (double)i / (double)rd);
    float angle = (float)f32((double)pos * (double)inv_freq); /* one fp32 multiply */
    double c = (double)cosf(angle), sn = (double)sinf(angle);
    int a, b;
    if (s->rope == ATTND_ROPE_NEOX) {
      a = i;
      b = i + half;
    } else {
      a = 2 * i;
      b = 2 * i + 1;
    }
    /* The rotation in fp32, every operation rounded on its own (no fused
     * multiply-add): a product of two fp32 values is exact in double, and
     * rounding a double sum of two fp32 values to fp32 is the fp32 sum. */
    double x = in[a], y = in[b];
    double xc = f32(x * c), ys = f32(y * sn), yc = f32(y * c), xs = f32(x * sn);
    out[a] = oracle_round(s->dtype, f32(xc - ys));
    out[b] = oracle_round(s->dtype, f32(yc + xs));
  }
}

/* ---- quantization ------------------------------------------------------------ */

static double clampd(double x, double lo, double hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

static float static_at(const float *a, int per_channel, int h, int d, int D) {
  assert(a != NULL);
  return per_channel ? a[(size_t)h * D + d] : a[h];
}

void oracle_quantize_row(const attnd_kshape_t *s, const oracle_scales_t *sc, int kv_head, int is_v,
                         const double *x, double *q, float *dyn_scale) {
  int D = s->head_dim;
  *dyn_scale = 0.0f;
  switch (s->kv) {
  case ATTND_KV_BF16:
  case ATTND_KV_FP16: {
    /* Identity when the cache type matches the activation dtype; a cache of
     * the other 16-bit type rounds once more, to what it can hold. */
    attnd_dtype_t cdt = s->kv == ATTND_KV_BF16 ? ATTND_DT_BF16 : ATTND_DT_FP16;
    for (int d = 0; d < D; d++)
      q[d] = oracle_round(cdt, x[d]);
    return;
  }
  case ATTND_KV_INT8:
  case ATTND_KV_FP8: {
    const float *scale = is_v ? sc->v_scale : sc->k_scale;
    for (int d = 0; d < D; d++) {
      float sd = static_at(scale, sc->per_channel, kv_head, d, D);
      float t = (float)x[d] / sd; /* IEEE fp32 division */
      if (s->kv == ATTND_KV_INT8)
        q[d] = clampd(nearbyint((double)t), -127.0, 127.0);
      else
        q[d] = oracle_fp8_e4m3(t);
    }
    return;
  }
  case ATTND_KV_INT8_DYNAMIC:
  case ATTND_KV_FP8_DYNAMIC: {
    double m = 0.0;
    for (int d = 0; d < D; d++)
      if (fabs(x[d]) > m)
        m = fabs(x[d]);
    float qmax = s->kv == ATTND_KV_INT8_DYNAMIC ? 127.0f : 448.0f;
    float sd = (float)m / qmax; /* fp32(max) / QMAX in fp32 */
    *dyn_scale = sd;
    for (int d = 0; d < D; d++) {
      if (sd == 0.0f) {
        q[d] = 0.0;
        continue;
      }
      float t = (float)x[d] / sd;
      if (s->kv == ATTND_KV_INT8_DYNAMIC)
        q[d] = clampd(nearbyint((double)t), -127.0, 127.0);
      else
        q[d] = oracle_fp8_e4m3(t);
    }
    return;
  }
  case ATTND_KV_INT4: {
    const float *scale = is_v ? sc->v_scale : sc->k_scale;
    const float *zero = is_v ? sc->v_zero : sc->k_zero;
    for (int d = 0; d < D; d++) {
      float sd = scale[(size_t)kv_head * D + d];
      float z = zero[(size_t)kv_head * D + d];
      float t = (float)x[d] / sd;
      t = t + z; /* fp32 add, as the contract says */
      q[d] = clampd(nearbyint((double)t), 0.0, 15.0);
    }
    return;
  }
  default:
    abort();
  }
}

/* Dequantized value of a stored row (what attention must read). */
static void dequant_row(const attnd_kshape_t *s, const oracle_scales_t *sc, int kv_head, int is_v,
                        const double *q, float dyn_scale, double *out) {
  int D = s->head_dim;
  for (int d = 0; d < D; d++) {
    switch (s->kv) {
    case ATTND_KV_BF16:
    case ATTND_KV_FP16:
      out[d] = q[d];
      break;
    case ATTND_KV_INT8:
    case ATTND_KV_FP8: {
      const float *scale = is_v ? sc->v_scale : sc->k_scale;
      out[d] = q[d] * (double)static_at(scale, sc->per_channel, kv_head, d, D);
      break;
    }
    case ATTND_KV_INT8_DYNAMIC:
    case ATTND_KV_FP8_DYNAMIC:
      out[d] = q[d] * (double)dyn_scale;
      break;
    case ATTND_KV_INT4: {
      const float *scale = is_v ? sc->v_scale : sc->k_scale;
      const float *zero = is_v ? sc->v_zero : sc->k_zero;
      out[d] =
          (q[d] - (double)zero[(size_t)kv_head * D + d]) * (double)scale[(size_t)kv_head * D + d];
      break;
    }
    default:
      abort();
    }
  }
}

/* ---- sessions ------------------------------------------------------------------ */

void oracle_session_init(oracle_session_t *o, const attnd_kshape_t *s, int cap) {
  size_t n = (size_t)cap * (size_t)s->kv_heads * (size_t)s->head_dim;
  o->len = 0;
  o->cap = cap;
  o->K = calloc(n ? n : 1, sizeof(double));
  o->V = calloc(n ? n : 1, sizeof(double));
  assert(o->K && o->V);
}

void oracle_session_free(oracle_session_t *o) {
  free(o->K);
  free(o->V);
  o->K = o->V = NULL;
  o->len = o->cap = 0;
}

void oracle_session_write(const attnd_kshape_t *s, oracle_session_t *o, int start, int n,
                          const void *k, const void *v, const oracle_scales_t *sc) {
  int D = s->head_dim, H = s->kv_heads;
  assert(start >= 0 && start <= o->len && start + n <= o->cap);
  double *in = malloc(sizeof(double) * (size_t)D);
  double *x = malloc(sizeof(double) * (size_t)D);
  double *q = malloc(sizeof(double) * (size_t)D);
  assert(in && x && q);
  for (int t = 0; t < n; t++) {
    int pos = start + t;
    for (int h = 0; h < H; h++) {
      size_t src = ((size_t)t * H + h) * D;
      size_t dst = ((size_t)pos * H + h) * D;
      float ds;
      /* K: RoPE at its absolute position, rounded to the activation dtype. */
      for (int d = 0; d < D; d++)
        in[d] = oracle_from_dtype(s->dtype, k, src + d);
      oracle_rope(s, pos, in, x);
      oracle_quantize_row(s, sc, h, 0, x, q, &ds);
      dequant_row(s, sc, h, 0, q, ds, o->K + dst);
      /* V: no RoPE; already in the activation dtype. */
      for (int d = 0; d < D; d++)
        x[d] = oracle_from_dtype(s->dtype, v, src + d);
      oracle_quantize_row(s, sc, h, 1, x, q, &ds);
      dequant_row(s, sc, h, 1, q, ds, o->V + dst);
    }
  }
  o->len = start + n;
  free(in);
  free(x);
  free(q);
}

int oracle_mask_visible(int mask_kind, int mask_param, int causal, const int32_t *intervals,
                        int kv_len, int p, int j) {
  switch (mask_kind) {
  case ATTND_MASK_CAUSAL:
    return j <= p;
  case ATTND_MASK_FULL:
    return 1;
  case ATTND_MASK_SLIDING: {
    int lo = p - mask_param + 1;
    if (lo < 0)
      lo = 0;
    return j >= lo && j <= p;
  }
  case ATTND_MASK_PREFIX_LM:
    return j < mask_param || j <= p;
  case ATTND_MASK_INTERVALS: {
    if (causal && j > p)
      return 0;
    if (!intervals)
      return 1;
    int32_t lts = intervals[j], lte = intervals[kv_len + j];
    int32_t uts = intervals[2 * kv_len + j], ute = intervals[3 * kv_len + j];
    if (lts <= p && p < lte)
      return 0;
    if (uts <= p && p < ute)
      return 0;
    return 1;
  }
  default:
    abort();
  }
}

void oracle_session_attend(const attnd_kshape_t *s, const oracle_session_t *o, int start, int n,
                           const void *q, int mask_kind, int mask_param, int causal,
                           const int32_t *intervals, double *out, double *lse) {
  oracle_session_attend_ex(s, o, start, n, q, mask_kind, mask_param, causal, intervals, 0, NULL,
                           out, lse);
}

int oracle_visible(int mask_kind, int mask_param, int causal, const int32_t *intervals, int window,
                   int kv_len, int p, int j) {
  if (window > 0 && j <= p - window)
    return 0;
  return oracle_mask_visible(mask_kind, mask_param, causal, intervals, kv_len, p, j);
}

/* The textbook form of docs/numerics.md: scaled score, soft-capped, masked
 * (item mask and layer window), then a two-pass softmax whose denominator may
 * hold one more term, the head's sink logit. */
void oracle_session_attend_ex(const attnd_kshape_t *s, const oracle_session_t *o, int start, int n,
                              const void *q, int mask_kind, int mask_param, int causal,
                              const int32_t *intervals, int window, const float *sinks, double *out,
                              double *lse) {
  int D = s->head_dim, H = s->kv_heads, QH = s->q_heads;
  int group = QH / H;
  int kv_len = start + n;
  assert(kv_len <= o->len);
  double *in = malloc(sizeof(double) * (size_t)D);
  double *qr = malloc(sizeof(double) * (size_t)D);
  double *score = malloc(sizeof(double) * (size_t)(kv_len ? kv_len : 1));
  assert(in && qr && score);
  double scale = (double)s->softmax_scale;
  double cap = (double)s->softcap;
  for (int r = 0; r < n; r++) {
    int p = start + r;
    for (int qh = 0; qh < QH; qh++) {
      int h = qh / group;
      size_t qoff = ((size_t)r * QH + qh) * D;
      for (int d = 0; d < D; d++)
        in[d] = oracle_from_dtype(s->dtype, q, qoff + d);
      oracle_rope(s, p, in, qr);
      double m = -INFINITY;
      for (int j = 0; j < kv_len; j++) {
        if (!oracle_visible(mask_kind, mask_param, causal, intervals, window, kv_len, p, j)) {
          score[j] = -INFINITY;
          continue;
        }
        const double *kr = o->K + ((size_t)j * H + h) * D;
        double dot = 0.0;
        for (int d = 0; d < D; d++)
          dot += qr[d] * kr[d];
        score[j] = scale * dot;
        if (cap > 0.0)
          score[j] = cap * tanh(score[j] / cap);
        if (score[j] > m)
          m = score[j];
      }
      double *orow = out + qoff;
      for (int d = 0; d < D; d++)
        orow[d] = 0.0;
      const int has_sink = sinks != NULL;
      const double sink = has_sink ? (double)sinks[qh] : -INFINITY;
      if (m == -INFINITY) { /* no visible key: out 0, lse the sink (or -inf) */
        if (lse)
          lse[(size_t)r * QH + qh] = sink;
        continue;
      }
      if (has_sink && sink > m)
        m = sink;
      double sum = has_sink ? exp(sink - m) : 0.0;
      for (int j = 0; j < kv_len; j++) {
        if (score[j] == -INFINITY)
          continue;
        double w = exp(score[j] - m);
        sum += w;
        const double *vr = o->V + ((size_t)j * H + h) * D;
        for (int d = 0; d < D; d++)
          orow[d] += w * vr[d];
      }
      for (int d = 0; d < D; d++)
        orow[d] /= sum;
      if (lse)
        lse[(size_t)r * QH + qh] = m + log(sum);
    }
  }
  free(in);
  free(qr);
  free(score);
}

void oracle_merge_lse(int nparts, const double *const *outs, const double *lses, int D, double *out,
                      double *lse) {
  double m = -INFINITY;
  for (int i = 0; i < nparts; i++)
    m = lses[i] > m ? lses[i] : m;
  for (int d = 0; d < D; d++)
    out[d] = 0.0;
  if (m == -INFINITY) {
    *lse = -INFINITY;
    return;
  }
  double sum = 0.0;
  for (int i = 0; i < nparts; i++)
    sum += exp(lses[i] - m);
  for (int i = 0; i < nparts; i++) {
    double w = exp(lses[i] - m) / sum;
    for (int d = 0; d < D; d++)
      out[d] += w * outs[i][d];
  }
  *lse = m + log(sum);
}

double oracle_rel_l2(const double *ref, attnd_dtype_t dt, const void *got, size_t count) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < count; i++) {
    double g = oracle_from_dtype(dt, got, i);
    double d = g - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (den == 0.0)
    return sqrt(num);
  return sqrt(num / den);
}

/* ---- random numbers (splitmix64: tiny, good enough, replayable) ------------------ */

uint64_t oracle_rng_next(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double oracle_rng_uniform(uint64_t *state) {
  return (double)(oracle_rng_next(state) >> 11) * 0x1.0p-53;
}

double oracle_rng_normal(uint64_t *state) {
  /* Box-Muller; 1 - u keeps the log argument in (0, 1]. */
  double u1 = 1.0 - oracle_rng_uniform(state);
  double u2 = oracle_rng_uniform(state);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* cuda_harness.c: one GPU kernel case against the float64 oracle, and the CPU
 * backend on the same inputs (cuda_harness.h). */
#include "cuda_harness.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "oracle.h"

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess)                                                                         \
      fail_msg("%s:%d %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_));                 \
  } while (0)

uint64_t g_rng;
double g_hit_worst;
double g_hit_sumsq; /* sum of the squared errors of every check */
int g_hit_over;     /* checks over ATTND_TOL_HIT_RMS */
double g_hit_worst_kv[ATTND_KV_COUNT_];
int g_hit_checks;
int g_hit_asked; /* cases run with out_fp32 and check_hit */

int harness_rnd(int n) {
  return (int)(oracle_rng_next(&g_rng) % (uint64_t)n);
}

double harness_bound(attnd_kv_type_t kv) {
  switch (kv) {
  case ATTND_KV_BF16:
  case ATTND_KV_FP16:
    return 1e-2;
  case ATTND_KV_INT8_DYNAMIC:
  case ATTND_KV_FP8_DYNAMIC:
    return 2e-2;
  case ATTND_KV_INT4:
    return 1e-1;
  default:
    return 3e-2;
  }
}

/* Half an output rounding's worth: rows over one or two keys are exact on the
 * CPU backend (P is fp32 there) and off by a rounding of P on the GPU, where
 * the matrix units take P in bf16 or fp16 (docs/numerics.md: bf16 for a bf16
 * cache under bf16 activations, whose V operand is bf16, and for the dynamic
 * types under bf16; fp16, 8x finer, elsewhere). Sink-like rows
 * (CASE_SINKS: a few tokens of equal scores take about half the attention)
 * are where that rounding does not average out: the sink tokens' equal P
 * round alike, in the numerator and in the rounded-sum normalization both,
 * so the floor there is one unit roundoff of P's type (measured: CUDA up to
 * 2.1x the CPU's error for bf16/bf16 and 3.1x for int8 under fp16 on such
 * rows, bench/RESULTS.md; the other styles stay within the plain floor). */
double harness_ratio_floor(attnd_dtype_t dt, attnd_kv_type_t kv, int style) {
  const double base = dt == ATTND_DT_BF16 ? 0x1p-10 : 0x1p-13;
  if (style != CASE_SINKS)
    return base;
  const int p_bf16 = dt == ATTND_DT_BF16 && (kv == ATTND_KV_BF16 || attnd_kv_type_dynamic(kv));
  const double p_round = p_bf16 ? 0x1p-8 : 0x1p-11;
  return p_round > base ? p_round : base;
}

static size_t dt_size(attnd_dtype_t dt) {
  return dt == ATTND_DT_FP32 ? 4 : 2;
}

static void *dev_copy(const void *h, size_t bytes) {
  void *d = NULL;
  CK(cudaMalloc(&d, bytes ? bytes : 16));
  if (bytes)
    CK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
  return d;
}

static double mag_or(double m, double dflt) {
  return m > 0 ? m : dflt;
}

/* One element of q or k: normal times the magnitude, or near the bound. */
static double draw(const case_opts_t *o, double mag, double sd) {
  if (o->near_bound > 0) {
    const double u = 0.25 + 0.75 * oracle_rng_uniform(&g_rng);
    return (oracle_rng_next(&g_rng) & 1 ? -u : u) * mag;
  }
  return sd * mag * oracle_rng_normal(&g_rng);
}

/* Static scale of channel d of kv head h (K or V). */
static double static_scale(const attnd_kshape_t *s, const oracle_scales_t *sc, int is_v, int h,
                           int d) {
  const float *a = is_v ? sc->v_scale : sc->k_scale;
  if (!a)
    return 0.0;
  return (s->kv == ATTND_KV_INT4 || sc->per_channel) ? a[h * s->head_dim + d] : a[h];
}

/* Rows [0, nrows) of k or v ([rows][kv_heads][D]), row t at absolute position
 * pos0[t]; w: [kv_heads][D] unit directions of the sink keys. */
static void fill_kv(const attnd_kshape_t *s, const case_opts_t *o, const oracle_scales_t *sc,
                    const double *w, int is_v, void *dst, int nrows, const int *pos) {
  const int D = s->head_dim, KVH = s->kv_heads;
  const double mag = mag_or(is_v ? o->v_mag : o->k_mag, 1.0);
  for (int t = 0; t < nrows; t++)
    for (int h = 0; h < KVH; h++) {
      const size_t base = ((size_t)t * KVH + h) * D;
      int kind = 0; /* 0 normal, 1 zero, 2 near the zero point, 3 sink key */
      if (o->style == CASE_ZERO_POINT) {
        const int r = harness_rnd(12);
        kind = is_v ? (r < 4 ? 1 : r < 8 ? 2 : 0) : (r < 3 ? 1 : 0);
      } else if (o->style == CASE_SINKS && pos[t] < 4) {
        kind = is_v ? 1 : 3;
      }
      for (int d = 0; d < D; d++) {
        double x;
        if (kind == 1) {
          x = 0.0;
        } else if (kind == 2) {
          const double st = static_scale(s, sc, is_v, h, d);
          x = (st > 0 ? 0.3 * st : 0.02 * mag) * oracle_rng_normal(&g_rng);
        } else if (kind == 3) {
          x = 8.0 * w[h * D + d];
        } else {
          if (is_v) { /* normal, clipped at 4 magnitudes (the bound tests put v at 2^98) */
            x = mag * oracle_rng_normal(&g_rng);
            x = x > 4 * mag ? 4 * mag : x < -4 * mag ? -4 * mag : x;
          } else {
            x = draw(o, mag, 1.0);
          }
        }
        oracle_to_dtype(s->dtype, dst, base + d, x);
      }
    }
}

/* q rows [Tq][q_heads][D]: 1.5 N (times the magnitude), plus the sink
 * direction of the head's kv head. */
static void fill_q(const attnd_kshape_t *s, const case_opts_t *o, const double *w, void *dst,
                   int rows) {
  const int D = s->head_dim, QH = s->q_heads, G = s->q_heads / s->kv_heads;
  const double mag = mag_or(o->q_mag, 1.0);
  for (int t = 0; t < rows; t++)
    for (int h = 0; h < QH; h++)
      for (int d = 0; d < D; d++) {
        double x = draw(o, mag, 1.5);
        if (o->style == CASE_SINKS)
          x += sqrt((double)D) * w[(h / G) * D + d];
        oracle_to_dtype(s->dtype, dst, ((size_t)t * QH + h) * D + d, x);
      }
}

static int do_write(const attnd_kshape_t *s, const attnd_kbatch_t *b, const case_opts_t *o) {
#ifndef ATTND_HARNESS_OLD_API
  return attnd_cuda_write_opts(s, b, NULL, o->opts);
#else
  (void)o;
  return attnd_cuda_write(s, b, NULL);
#endif
}

static int do_attend(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *ws, size_t ws_bytes,
                     const case_opts_t *o) {
#ifndef ATTND_HARNESS_OLD_API
  /* ATTND_GPU_TEST_SM90_SCHED=N (the tests' own variable; the kernels read no
   * environment): every call also sets these attnd_cuda_opts_t.sm90_sched bits,
   * so that a Hopper pipeline variant runs through a whole matrix (the tiled
   * kernel of the A/B ignores them). */
  const char *e = getenv("ATTND_GPU_TEST_SM90_SCHED");
  if (e && *e) {
    attnd_cuda_opts_t x = {0};
    if (o->opts)
      x = *o->opts;
    x.sm90_sched |= atoi(e);
    return attnd_cuda_attend_opts(s, b, ws, ws_bytes, NULL, &x);
  }
  return attnd_cuda_attend_opts(s, b, ws, ws_bytes, NULL, o->opts);
#else
  (void)o;
  return attnd_cuda_attend(s, b, ws, ws_bytes, NULL);
#endif
}

int g_ab_checks, g_ab_differ;
double g_ab_worst, g_ab_worst_short;
int g_step_cases, g_step_fused;

#ifndef ATTND_HARNESS_OLD_API

/* The Hopper prefill path (kernels/cuda/prefill_sm90.cuh, selected by default
 * on sm_90 for prefill-shaped batches) against the tiled kernel (forced by
 * attnd_cuda_opts_t.sm90 = 1) over the same cache, both with fp32 outputs: one numerics
 * contract, so they agree to the roundings their summation orders move
 * (tests/tolerance.h's A/B bounds), lse included. Outputs that differ in no
 * bit at all mean both ran the same kernel; they are counted so that the
 * report shows the path ran. */
static void check_ab(const attnd_kshape_t *s, int ncase, attnd_kbatch_t b, const tcase_item_t *ti,
                     const attnd_kitem_t *items, int nitems, void *d_ws, size_t ws_bytes,
                     const case_opts_t *o) {
  const int QH = s->q_heads, D = s->head_dim, Tq = b.total_q;
  const size_t n = (size_t)Tq * QH * D;
  float *ho[2], *hl[2];
  /* The same launch options, the tiled kernel asked for. */
  attnd_cuda_opts_t topts = {0};
  if (o->opts)
    topts = *o->opts;
  topts.sm90 = 1;
  const case_opts_t tiled = {.use_ws = o->use_ws, .opts = &topts};
  for (int k = 0; k < 2; k++) {
    float *d_o, *d_l;
    CK(cudaMalloc((void **)&d_o, sizeof(float) * n));
    CK(cudaMalloc((void **)&d_l, sizeof(float) * Tq * QH));
    CK(cudaMemset(d_o, 0xff, sizeof(float) * n));
    CK(cudaMemset(d_l, 0xff, sizeof(float) * Tq * QH));
    b.out = d_o;
    b.out_fp32 = 1;
    b.lse = d_l;
    const int rc = do_attend(s, &b, d_ws, ws_bytes, k == 1 ? &tiled : o);
    if (rc)
      fail_msg("case %d A/B attend %d: %d %s", ncase, k, rc, attnd_cuda_last_error());
    CK(cudaDeviceSynchronize());
    ho[k] = malloc(sizeof(float) * n);
    hl[k] = malloc(sizeof(float) * Tq * QH);
    CK(cudaMemcpy(ho[k], d_o, sizeof(float) * n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl[k], d_l, sizeof(float) * Tq * QH, cudaMemcpyDeviceToHost));
    cudaFree(d_o);
    cudaFree(d_l);
  }
  const int differ = memcmp(ho[0], ho[1], sizeof(float) * n) != 0;
  for (int i = 0; i < nitems; i++) {
    if (!ti[i].has_q)
      continue;
    const size_t o0 = (size_t)items[i].q_row * QH * D, cnt = (size_t)ti[i].n * QH * D;
    double num = 0, den = 0;
    for (size_t e = 0; e < cnt; e++) {
      const double a = ho[0][o0 + e], r = ho[1][o0 + e];
      num += (a - r) * (a - r);
      den += r * r;
    }
    const double err = den > 0 ? sqrt(num / den) : sqrt(num);
    /* P roundings that flip between the two summation orders
     * (tests/tolerance.h, ATTND_TOL_AB_ROWS). */
    double bound = ti[i].n >= 8 ? ATTND_TOL_AB_ROWS : ATTND_TOL_AB_SHORT;
    /* A row a sink dominates is sum P~ v / (sum P~ + e^(sink - m)): nothing
     * divides the rounding of P out of it, and the two kernels round P
     * against different running maxima (tiles of 64 / 128 keys), so they
     * differ by up to two roundoffs of P's type (docs/numerics.md, "Which sum
     * lse is the log of"). */
    if (o->sinks) {
      const int p_bf16 =
          s->dtype == ATTND_DT_BF16 && (s->kv == ATTND_KV_BF16 || attnd_kv_type_dynamic(s->kv));
      const double two_u = p_bf16 ? 2 * 0x1p-8 : 2 * 0x1p-11; /* unit roundoffs of bf16, fp16 */
      if (bound < two_u)
        bound = two_u;
    }
    if (!(err <= bound))
      fail_msg("case %d kv %s D %d bs %d G %d item %d (start %d n %d mask %d): Hopper path vs "
               "tiled kernel rel L2 %g > %g",
               ncase, attnd_kv_type_name(s->kv), D, s->block_size, QH / s->kv_heads, i, ti[i].start,
               ti[i].n, ti[i].mask_kind, err, bound);
    if (ti[i].n >= 8 && err > g_ab_worst)
      g_ab_worst = err;
    if (ti[i].n < 8 && err > g_ab_worst_short)
      g_ab_worst_short = err;
    for (int r = 0; r < ti[i].n * QH; r++) {
      const float a = hl[0][items[i].q_row * QH + r], c = hl[1][items[i].q_row * QH + r];
      /* Each kernel's lse is the log of its sum of P as rounded for the matrix
       * units, against its own running maxima (tests/tolerance.h). */
      if (!(a == c ||
            fabs((double)a - c) <= 2 * ATTND_TOL_CUDA_LSE_ABS + 1e-4 * (1 + fabs((double)c))))
        fail_msg("case %d item %d row %d: lse %g (Hopper path) vs %g (tiled)", ncase, i, r, a, c);
    }
  }
  g_ab_checks++;
  g_ab_differ += differ;
  for (int k = 0; k < 2; k++) {
    free(ho[k]);
    free(hl[k]);
  }
}

#endif /* ATTND_HARNESS_OLD_API */

/* A prefix-cache hit, for a kernel, is new rows over KV already cached. For
 * every item with q and >= 9 rows, its last 8 rows run again alone (their k/v
 * rewritten with the same values, so the cache bytes stay the same) over the
 * cache the full step wrote: fewer query vectors take another kernel (decode
 * instead of tiled, other splits), and the fp32 outputs must still equal the
 * full step's rows up to fp32 summation order (docs/numerics.md: a hit and a
 * full compute agree within 1e-3; the kernels keep it near 1e-6). */
static void check_hit(const attnd_kshape_t *s, int ncase, const tcase_item_t *ti,
                      const attnd_kitem_t *full_items, int nitems, const int32_t *d_meta,
                      uint8_t *d_cache, size_t bb, const float *d_sc[4], int per_channel,
                      const void *q, const void *k, const void *v, const float *full_out,
                      const float *d_sinks, const case_opts_t *o) {
  const int D = s->head_dim, KVH = s->kv_heads, QH = s->q_heads, H = 8;
  const size_t es = dt_size(s->dtype);
  attnd_kitem_t items[8];
  int src[8], n = 0, maxl = 1;
  int64_t ksum = 0;
  for (int i = 0; i < nitems; i++)
    if (ti[i].has_q && ti[i].n > H) {
      items[n] = full_items[i];
      items[n].start = full_items[i].start + full_items[i].n - H;
      items[n].n = H;
      items[n].q_row = n * H;
      items[n].kv_row = n * H;
      if (ti[i].start + ti[i].n > maxl)
        maxl = ti[i].start + ti[i].n;
      ksum += ti[i].start + ti[i].n;
      src[n++] = i;
    }
  if (n == 0)
    return;
  uint8_t *hq = malloc(es * n * H * QH * D), *hk = malloc(es * n * H * KVH * D),
          *hv = malloc(es * n * H * KVH * D);
  for (int j = 0; j < n; j++) {
    const attnd_kitem_t *f = &full_items[src[j]];
    const size_t skip = (size_t)(f->n - H);
    memcpy(hq + es * j * H * QH * D, (const uint8_t *)q + es * (f->q_row + skip) * QH * D,
           es * H * QH * D);
    memcpy(hk + es * j * H * KVH * D, (const uint8_t *)k + es * (f->kv_row + skip) * KVH * D,
           es * H * KVH * D);
    memcpy(hv + es * j * H * KVH * D, (const uint8_t *)v + es * (f->kv_row + skip) * KVH * D,
           es * H * KVH * D);
  }
  attnd_kitem_t *d_items = dev_copy(items, sizeof(attnd_kitem_t) * n);
  void *d_q = dev_copy(hq, es * n * H * QH * D), *d_k = dev_copy(hk, es * n * H * KVH * D),
       *d_v = dev_copy(hv, es * n * H * KVH * D);
  const size_t out_bytes = sizeof(float) * n * H * QH * D;
  float *out = malloc(out_bytes), *d_out, *d_lse;
  CK(cudaMalloc((void **)&d_out, out_bytes));
  CK(cudaMalloc((void **)&d_lse, sizeof(float) * n * H * QH));
  CK(cudaMemset(d_out, 0xff, out_bytes));
  size_t ws_bytes = o->use_ws ? attnd_cuda_attend_workspace(s, n * H) : 0;
  void *d_ws = NULL;
  if (ws_bytes)
    CK(cudaMalloc(&d_ws, ws_bytes));
  attnd_kbatch_t b = {.items = d_items,
                      .nitems = n,
                      .meta = d_meta,
                      .total_q = n * H,
                      .total_kv = n * H,
                      .max_kv_len = maxl,
                      .max_n = H,
                      .q = d_q,
                      .k = d_k,
                      .v = d_v,
                      .out = d_out,
                      .out_fp32 = 1,
                      .lse = d_lse,
                      .cache = d_cache,
                      .block_bytes = bb,
                      .k_scale = d_sc[0],
                      .v_scale = d_sc[1],
                      .k_zero = d_sc[2],
                      .v_zero = d_sc[3],
                      .scale_per_channel = per_channel};
#ifndef ATTND_HARNESS_OLD_API
  b.window = o->window;
  b.sinks = d_sinks;
  b.kv_sum = ksum;
#else
  (void)d_sinks;
  (void)ksum;
#endif
  int rc = do_write(s, &b, o);
  if (rc)
    fail_msg("hit write: %d %s", rc, attnd_cuda_last_error());
  rc = do_attend(s, &b, d_ws, ws_bytes, o);
  if (rc)
    fail_msg("hit attend: %d %s", rc, attnd_cuda_last_error());
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(out, d_out, out_bytes, cudaMemcpyDeviceToHost));
  /* int4: the kernels compute O = s (sum P u / sum P - z) (docs/numerics.md
   * section 8), so the fp32 summation order of the two paths moves O by about
   * ulp(s z), whatever O's own size: V rows at the zero point make O small
   * against s z and the plain relative error grows without any kernel error.
   * The difference is taken relative to |O| + |s z| per channel there. */
  float *vsz = NULL;
  if (s->kv == ATTND_KV_INT4) {
    vsz = malloc(sizeof(float) * 2 * KVH * D);
    CK(cudaMemcpy(vsz, d_sc[1], sizeof(float) * KVH * D, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(vsz + KVH * D, d_sc[3], sizeof(float) * KVH * D, cudaMemcpyDeviceToHost));
  }
  for (int j = 0; j < n; j++) {
    const attnd_kitem_t *f = &full_items[src[j]];
    const float *ref = full_out + (size_t)(f->q_row + f->n - H) * QH * D,
                *got = out + (size_t)j * H * QH * D;
    double num = 0, den = 0;
    for (size_t e = 0; e < (size_t)H * QH * D; e++) {
      num += ((double)got[e] - ref[e]) * ((double)got[e] - ref[e]);
      double mag = fabs((double)ref[e]);
      if (vsz) {
        const size_t c = (size_t)((e / D) % QH / (QH / KVH)) * D + e % D;
        mag += fabs((double)vsz[c] * vsz[KVH * D + c]);
      }
      den += mag * mag;
    }
    const double err = den > 0 ? sqrt(num / den) : sqrt(num);
    if (!(err <= ATTND_TOL_HIT_ITEM))
      fail_msg("case %d kv %s D %d G %d item %d: last %d rows alone (a prefix hit) vs the full "
               "step: rel L2 %g > %g (int4: relative to |O| + |s z|)",
               ncase, attnd_kv_type_name(s->kv), D, QH / KVH, src[j], H, err, ATTND_TOL_HIT_ITEM);
    g_hit_sumsq += err * err;
    if (err > ATTND_TOL_HIT_RMS)
      g_hit_over++;
    if (err > g_hit_worst)
      g_hit_worst = err;
    if (err > g_hit_worst_kv[s->kv])
      g_hit_worst_kv[s->kv] = err;
    g_hit_checks++;
  }
  free(vsz);
  cudaFree(d_items);
  cudaFree(d_q);
  cudaFree(d_k);
  cudaFree(d_v);
  cudaFree(d_out);
  cudaFree(d_lse);
  cudaFree(d_ws);
  free(hq);
  free(hk);
  free(hv);
  free(out);
}

void run_case(const attnd_kshape_t *s, int ncase, const tcase_item_t *ti, int nitems,
              const case_opts_t *o, case_result_t *res) {
  const int D = s->head_dim, KVH = s->kv_heads, QH = s->q_heads, bs = s->block_size;
  const size_t es = dt_size(s->dtype);
  const size_t bb = attnd_kv_block_bytes(s);
  const int per_channel = o->per_channel;
  memset(res, 0, sizeof *res);
  /* Blocks: each session gets its own, in shuffled physical order. */
  int total_blocks = 3;
  for (int i = 0; i < nitems; i++)
    total_blocks += (ti[i].start + ti[i].n + bs - 1) / bs;
  int32_t *perm = malloc(sizeof(int32_t) * total_blocks);
  for (int i = 0; i < total_blocks; i++)
    perm[i] = i;
  for (int i = total_blocks - 1; i > 0; i--) {
    int j = harness_rnd(i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  uint8_t *d_cache, *h_cache = NULL;
  CK(cudaMalloc((void **)&d_cache, bb * total_blocks));
  CK(cudaMemset(d_cache, 0xff, bb * total_blocks)); /* poison: NaN in every float format */
  if (o->cpu) {
    h_cache = malloc(bb * total_blocks);
    memset(h_cache, 0xff, bb * total_blocks);
  }

  /* Static scales (times the magnitudes, so that quantization uses its range). */
  float *sc4[4] = {NULL, NULL, NULL, NULL};
  const int nsc = (s->kv == ATTND_KV_INT4 || per_channel) ? KVH * D : KVH;
  if (attnd_kv_type_static(s->kv)) {
    const double base = s->kv == ATTND_KV_INT4   ? 0.45
                        : s->kv == ATTND_KV_INT8 ? 3.5 / 127
                                                 : 3.0 / 448;
    for (int w = 0; w < 2; w++) {
      sc4[w] = malloc(sizeof(float) * nsc);
      const double m = mag_or(w ? o->v_mag : o->k_mag, 1.0);
      for (int i = 0; i < nsc; i++)
        sc4[w][i] = (float)(m * base * (0.8 + 0.4 * oracle_rng_uniform(&g_rng)));
    }
    if (s->kv == ATTND_KV_INT4)
      for (int w = 2; w < 4; w++) {
        sc4[w] = malloc(sizeof(float) * nsc);
        for (int i = 0; i < nsc; i++) {
          double z = 7.0 + oracle_rng_uniform(&g_rng);
          if (o->style == CASE_ZERO_POINT)
            z = i % 3 == 0 ? 8.0 : i % 3 == 1 ? 7.5 : z;
          sc4[w][i] = (float)z;
        }
      }
  }
  oracle_scales_t sc = {sc4[0], sc4[1], sc4[2], sc4[3], s->kv == ATTND_KV_INT4 ? 1 : per_channel};
  const float *d_sc[4];
  for (int w = 0; w < 4; w++)
    d_sc[w] = sc4[w] ? dev_copy(sc4[w], sizeof(float) * nsc) : NULL;
  /* Sink directions: one unit vector per kv head. */
  double *wdir = calloc((size_t)KVH * D, sizeof(double));
  for (int h = 0; h < KVH; h++) {
    double n2 = 0;
    for (int d = 0; d < D; d++) {
      wdir[h * D + d] = oracle_rng_normal(&g_rng);
      n2 += wdir[h * D + d] * wdir[h * D + d];
    }
    for (int d = 0; d < D; d++)
      wdir[h * D + d] /= sqrt(n2);
  }

  /* Meta: block tables then intervals. */
  size_t nmeta = 0;
  int bt_off[8], iv_off[8];
  for (int i = 0; i < nitems; i++) {
    bt_off[i] = (int)nmeta;
    nmeta += (ti[i].start + ti[i].n + bs - 1) / bs;
  }
  for (int i = 0; i < nitems; i++) {
    iv_off[i] = -1;
    if (ti[i].mask_kind == ATTND_MASK_INTERVALS) {
      iv_off[i] = (int)nmeta;
      nmeta += 4 * (size_t)(ti[i].start + ti[i].n);
    }
  }
  int32_t *meta = malloc(sizeof(int32_t) * (nmeta + 1));
  int pb = 0;
  for (int i = 0; i < nitems; i++)
    for (int l = 0; l < (ti[i].start + ti[i].n + bs - 1) / bs; l++)
      meta[bt_off[i] + l] = perm[pb++];
  for (int i = 0; i < nitems; i++)
    if (iv_off[i] >= 0 && ti[i].docs)
      harness_make_documents(meta + iv_off[i], ti[i].start + ti[i].n);
    else if (iv_off[i] >= 0)
      harness_make_intervals(meta + iv_off[i], ti[i].start + ti[i].n, ti[i].start, ti[i].n);
  int32_t *d_meta = dev_copy(meta, sizeof(int32_t) * nmeta);

  oracle_session_t *os = calloc((size_t)(nitems > 0 ? nitems : 1), sizeof *os);
  for (int i = 0; i < nitems; i++)
    oracle_session_init(&os[i], s, ti[i].start + ti[i].n + 1);

  /* 1. History: one write-only batch of positions 0 .. hist-1 per session. */
  {
    attnd_kitem_t items[8];
    int T = 0, maxl = 1;
    for (int i = 0; i < nitems; i++) {
      items[i] = (attnd_kitem_t){
          .start = 0, .n = ti[i].hist, .q_row = -1, .kv_row = T, .block_table = bt_off[i]};
      T += ti[i].hist;
      if (ti[i].hist > maxl)
        maxl = ti[i].hist;
    }
    int *pos = malloc(sizeof(int) * (T + 1));
    for (int i = 0; i < nitems; i++)
      for (int t = 0; t < ti[i].hist; t++)
        pos[items[i].kv_row + t] = t;
    void *k = malloc(es * T * KVH * D + 16), *v = malloc(es * T * KVH * D + 16);
    fill_kv(s, o, &sc, wdir, 0, k, T, pos);
    fill_kv(s, o, &sc, wdir, 1, v, T, pos);
    for (int i = 0; i < nitems; i++)
      oracle_session_write(s, &os[i], 0, ti[i].hist, (uint8_t *)k + es * items[i].kv_row * KVH * D,
                           (uint8_t *)v + es * items[i].kv_row * KVH * D, &sc);
    attnd_kitem_t *d_items = dev_copy(items, sizeof(attnd_kitem_t) * nitems);
    void *d_k = dev_copy(k, es * T * KVH * D), *d_v = dev_copy(v, es * T * KVH * D);
    attnd_kbatch_t b = {.items = d_items,
                        .nitems = nitems,
                        .meta = d_meta,
                        .total_q = 0,
                        .total_kv = T,
                        .max_kv_len = maxl,
                        .max_n = maxl,
                        .k = d_k,
                        .v = d_v,
                        .cache = d_cache,
                        .block_bytes = bb,
                        .k_scale = d_sc[0],
                        .v_scale = d_sc[1],
                        .k_zero = d_sc[2],
                        .v_zero = d_sc[3],
                        .scale_per_channel = per_channel};
    int rc = do_write(s, &b, o);
    if (rc)
      fail_msg("history write: %d %s", rc, attnd_cuda_last_error());
    CK(cudaDeviceSynchronize());
    if (o->cpu) {
      attnd_kbatch_t hb = b;
      hb.items = items;
      hb.meta = meta;
      hb.k = k;
      hb.v = v;
      hb.cache = h_cache;
      hb.k_scale = sc4[0];
      hb.v_scale = sc4[1];
      hb.k_zero = sc4[2];
      hb.v_zero = sc4[3];
      if (attnd_cpu_write(s, &hb, 0, 1) != 0)
        fail_msg("cpu history write failed");
    }
    cudaFree(d_items);
    cudaFree(d_k);
    cudaFree(d_v);
    free(k);
    free(v);
    free(pos);
  }

  /* 2. The step: write + attend over the mixed batch. */
  attnd_kitem_t items[8];
  int T = 0, Tq = 0, maxl = 1, maxn = 1;
  int64_t ksum = 0; /* attnd_kbatch_t.kv_sum, as the daemon fills it */
  for (int i = 0; i < nitems; i++) {
    items[i] = (attnd_kitem_t){.start = ti[i].start,
                               .n = ti[i].n,
                               .q_row = ti[i].has_q ? Tq : -1,
                               .kv_row = T,
                               .mask_kind = ti[i].mask_kind,
                               .mask_param = ti[i].mask_param,
                               .causal = ti[i].causal,
                               .intervals = iv_off[i] < 0 ? 0 : iv_off[i],
                               .block_table = bt_off[i]};
#ifndef ATTND_HARNESS_OLD_API
    if ((o->sink_items >> i) & 1)
      items[i].flags = ATTND_ITEM_SINK;
#endif
    T += ti[i].n;
    if (ti[i].has_q)
      Tq += ti[i].n;
    if (ti[i].start + ti[i].n > maxl)
      maxl = ti[i].start + ti[i].n;
    ksum += ti[i].start + ti[i].n;
    if (ti[i].n > maxn)
      maxn = ti[i].n;
  }
  int *pos = malloc(sizeof(int) * (T + 1));
  for (int i = 0; i < nitems; i++)
    for (int t = 0; t < ti[i].n; t++)
      pos[items[i].kv_row + t] = ti[i].start + t;
  void *q = malloc(es * Tq * QH * D + 16), *k = malloc(es * T * KVH * D + 16),
       *v = malloc(es * T * KVH * D + 16);
  fill_q(s, o, wdir, q, Tq);
  fill_kv(s, o, &sc, wdir, 0, k, T, pos);
  fill_kv(s, o, &sc, wdir, 1, v, T, pos);
  const attnd_dtype_t odt = o->out_fp32 ? ATTND_DT_FP32 : s->dtype;
  const size_t out_bytes = dt_size(odt) * Tq * QH * D;
  void *out = malloc(out_bytes + 16), *cpu_out = o->cpu ? malloc(out_bytes + 16) : NULL;
  float *lse = malloc(sizeof(float) * Tq * QH + 16),
        *cpu_lse = o->cpu ? malloc(sizeof(float) * Tq * QH + 16) : NULL;
  attnd_kitem_t *d_items = dev_copy(items, sizeof(attnd_kitem_t) * nitems);
  void *d_q = dev_copy(q, es * Tq * QH * D), *d_k = dev_copy(k, es * T * KVH * D),
       *d_v = dev_copy(v, es * T * KVH * D);
  void *d_out, *d_lse, *d_ws = NULL;
  CK(cudaMalloc(&d_out, out_bytes + 16));
  CK(cudaMalloc(&d_lse, sizeof(float) * Tq * QH + 16));
  CK(cudaMemset(d_out, 0xff, out_bytes)); /* poison: an unwritten element is NaN */
  CK(cudaMemset(d_lse, 0xff, sizeof(float) * Tq * QH));
  size_t ws_bytes = o->use_ws ? attnd_cuda_attend_workspace(s, Tq) : 0;
  if (ws_bytes) {
    CK(cudaMalloc(&d_ws, ws_bytes));
    CK(cudaMemset(d_ws, 0xff, ws_bytes));
  }
  attnd_kbatch_t b = {.items = d_items,
                      .nitems = nitems,
                      .meta = d_meta,
                      .total_q = Tq,
                      .total_kv = T,
                      .max_kv_len = maxl,
                      .max_n = maxn,
                      .q = d_q,
                      .k = d_k,
                      .v = d_v,
                      .out = d_out,
                      .out_fp32 = o->out_fp32,
                      .lse = d_lse,
                      .cache = d_cache,
                      .block_bytes = bb,
                      .k_scale = d_sc[0],
                      .v_scale = d_sc[1],
                      .k_zero = d_sc[2],
                      .v_zero = d_sc[3],
                      .scale_per_channel = per_channel};
  const float *d_sinks = NULL;
  int variants = s->softcap > 0.f;
#ifndef ATTND_HARNESS_OLD_API
  if (o->sinks)
    d_sinks = dev_copy(o->sinks, sizeof(float) * QH);
  b.window = o->window;
  b.sinks = d_sinks;
  b.kv_sum = ksum;
  variants |= o->window > 0 || o->sinks;
#endif
  int rc;
  res->fused = 0;
#ifndef ATTND_HARNESS_OLD_API
  res->splits = attnd_cuda_attend_splits_opts(s, &b, ws_bytes, o->opts);
  if (o->step && !getenv("ATTND_GPU_TEST_SM90_SCHED")) {
    /* Both phases in one call: the fused launch where the batch allows it. */
    attnd_cuda_opts_t so = {0};
    if (o->opts)
      so = *o->opts;
    if (so.fuse == 0)
      so.fuse = 1; /* the fused launch is opt-in */
    res->fused = attnd_cuda_step_fused(s, &b, ws_bytes, &so);
    g_step_cases++;
    g_step_fused += res->fused;
    rc = attnd_cuda_step_opts(s, &b, d_ws, ws_bytes, NULL, &so);
    if (rc)
      fail_msg("step: %d %s", rc, attnd_cuda_last_error());
  } else {
    rc = do_write(s, &b, o);
    if (rc)
      fail_msg("write: %d %s", rc, attnd_cuda_last_error());
    rc = do_attend(s, &b, d_ws, ws_bytes, o);
    if (rc)
      fail_msg("attend: %d %s", rc, attnd_cuda_last_error());
  }
#else
  rc = do_write(s, &b, o);
  if (rc)
    fail_msg("write: %d %s", rc, attnd_cuda_last_error());
  res->splits = attnd_cuda_attend_splits(s, &b, ws_bytes);
  rc = do_attend(s, &b, d_ws, ws_bytes, o);
  if (rc)
    fail_msg("attend: %d %s", rc, attnd_cuda_last_error());
#endif
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(out, d_out, out_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse, d_lse, sizeof(float) * Tq * QH, cudaMemcpyDeviceToHost));
  if (o->cpu) {
    void *qc = malloc(es * Tq * QH * D + 16); /* the CPU write rotates q in place */
    memcpy(qc, q, es * Tq * QH * D);
    memset(cpu_out, 0xff, out_bytes);
    attnd_kbatch_t hb = b;
    hb.items = items;
    hb.meta = meta;
    hb.q = qc;
    hb.k = k;
    hb.v = v;
    hb.out = cpu_out;
    hb.lse = cpu_lse;
    hb.cache = h_cache;
    hb.k_scale = sc4[0];
    hb.v_scale = sc4[1];
    hb.k_zero = sc4[2];
    hb.v_zero = sc4[3];
    hb.sinks = o->sinks; /* b.sinks is the device copy */
    if (attnd_cpu_write(s, &hb, 0, 1) != 0 || attnd_cpu_attend(s, &hb, 0, 1) != 0)
      fail_msg("cpu step failed");
    free(qc);
  }

#ifndef ATTND_HARNESS_OLD_API
  if (o->check_ab)
    check_ab(s, ncase, b, ti, items, nitems, d_ws, ws_bytes, o);
#endif
  if (o->out_fp32 && o->check_hit) {
    for (int i = 0; i < nitems; i++)
      if (ti[i].has_q && ti[i].n > 8) {
        g_hit_asked++; /* a case with an item check_hit takes */
        break;
      }
    check_hit(s, ncase, ti, items, nitems, d_meta, d_cache, bb, d_sc, per_channel, q, k, v,
              (const float *)out, d_sinks, o);
  }

  const double floor = harness_ratio_floor(s->dtype, s->kv, o->style);
  for (int i = 0; i < nitems; i++) {
    oracle_session_write(s, &os[i], ti[i].start, ti[i].n,
                         (uint8_t *)k + es * items[i].kv_row * KVH * D,
                         (uint8_t *)v + es * items[i].kv_row * KVH * D, &sc);
    if (!ti[i].has_q)
      continue;
    const size_t cnt = (size_t)ti[i].n * QH * D;
    double *ref = malloc(sizeof(double) * cnt), *rl = malloc(sizeof(double) * ti[i].n * QH);
    int *novis = NULL;
    if (variants) {
      int window = 0;
      const float *sinks = NULL;
#ifndef ATTND_HARNESS_OLD_API
      window = o->window;
      sinks = (o->sink_items >> i) & 1 ? o->sinks : NULL;
#endif
      novis = malloc(sizeof(int) * ti[i].n * QH);
      harness_ref_attend(s, &os[i], ti[i].start, ti[i].n,
                         (uint8_t *)q + es * items[i].q_row * QH * D, ti[i].mask_kind,
                         ti[i].mask_param, ti[i].causal, iv_off[i] >= 0 ? meta + iv_off[i] : NULL,
                         window, sinks, ref, rl, novis);
    } else {
      oracle_session_attend(s, &os[i], ti[i].start, ti[i].n,
                            (uint8_t *)q + es * items[i].q_row * QH * D, ti[i].mask_kind,
                            ti[i].mask_param, ti[i].causal,
                            iv_off[i] >= 0 ? meta + iv_off[i] : NULL, ref, rl);
    }
    const void *got = (uint8_t *)out + dt_size(odt) * items[i].q_row * QH * D;
    const double err = oracle_rel_l2(ref, odt, got, cnt);
    if (!(err <= harness_bound(s->kv)))
      fail_msg(
          "case %d kv %s D %d bs %d G %d item %d (start %d n %d mask %d) splits %d: rel L2 %g > %g",
          ncase, attnd_kv_type_name(s->kv), D, bs, QH / KVH, i, ti[i].start, ti[i].n,
          ti[i].mask_kind, res->splits, err, harness_bound(s->kv));
    if (err > res->cuda_err)
      res->cuda_err = err;
    harness_check_lse(ncase, s, i, ti[i].n * QH, lse + items[i].q_row * QH, rl, novis, odt, got,
                      "cuda");
    if (o->cpu) {
      const void *cgot = (uint8_t *)cpu_out + dt_size(odt) * items[i].q_row * QH * D;
      const double cerr = oracle_rel_l2(ref, odt, cgot, cnt);
      if (!(cerr <= harness_bound(s->kv)))
        fail_msg("cpu case %d kv %s item %d: rel L2 %g", ncase, attnd_kv_type_name(s->kv), i, cerr);
      harness_check_lse(ncase, s, i, ti[i].n * QH, cpu_lse + items[i].q_row * QH, rl, novis, odt,
                        cgot, "cpu");
      if (cerr > res->cpu_err)
        res->cpu_err = cerr;
      const double ratio = err / (2.0 * cerr + floor);
      if (ratio > res->worst_ratio)
        res->worst_ratio = ratio;
    }
    free(ref);
    free(rl);
    free(novis);
  }
  for (int i = 0; i < nitems; i++)
    oracle_session_free(&os[i]);
  free(os);
  cudaFree(d_items);
  cudaFree(d_q);
  cudaFree(d_k);
  cudaFree(d_v);
  cudaFree(d_out);
  cudaFree(d_lse);
  cudaFree(d_ws);
  cudaFree(d_meta);
  cudaFree(d_cache);
  cudaFree((void *)d_sinks);
  for (int w = 0; w < 4; w++) {
    cudaFree((void *)d_sc[w]);
    free(sc4[w]);
  }
  free(wdir);
  free(q);
  free(k);
  free(v);
  free(out);
  free(lse);
  free(cpu_out);
  free(cpu_lse);
  free(h_cache);
  free(meta);
  free(perm);
  free(pos);
}

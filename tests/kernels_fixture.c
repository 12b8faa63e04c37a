/* kernels_fixture.c: the CPU kernel tests' harness (kernels_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels_fixture.h"

uint64_t g_rng;
double g_maxerr[ATTND_KV_COUNT_];
double g_maxerr32[ATTND_KV_COUNT_]; /* items with fp32 output: the kernel's own error */
double g_maxlse[ATTND_KV_COUNT_];
long g_items[ATTND_KV_COUNT_];

int rnd(int n) {
  return (int)(oracle_rng_next(&g_rng) % (uint64_t)n);
}

double unif(double lo, double hi) {
  return lo + (hi - lo) * oracle_rng_uniform(&g_rng);
}

/* ---- a layer's pool and its sessions ---------------------------------------- */

void env_init(env_t *e, int D, int bs, int kvh, int group, attnd_dtype_t dt, attnd_kv_type_t kv,
              attnd_rope_t rope, int nblocks) {
  memset(e, 0, sizeof(*e));
  e->s = (attnd_kshape_t){.q_heads = kvh * group,
                          .kv_heads = kvh,
                          .head_dim = D,
                          .block_size = bs,
                          .dtype = dt,
                          .kv = kv,
                          .rope = rope,
                          .rope_theta = rnd(2) ? 10000.0 : 500000.0,
                          .rotary_dim = rnd(3) == 0 ? D / 2 : 0,
                          .softmax_scale = (float)(1.0 / sqrt((double)D))};
  assert_int_equal(attnd_kshape_check(&e->s), 0);
  e->amp = 1.0;
  e->amp_q = 1.0;
  e->bb = attnd_kv_block_bytes(&e->s);
  e->nblocks = nblocks;
  e->cache = malloc(e->bb * (size_t)nblocks);
  assert_non_null(e->cache);
  for (size_t i = 0; i < e->bb * (size_t)nblocks; i++) /* garbage, never zeros */
    e->cache[i] = (uint8_t)oracle_rng_next(&g_rng);
  e->free_ids = malloc(sizeof(int32_t) * (size_t)nblocks);
  for (int i = 0; i < nblocks; i++)
    e->free_ids[i] = i;
  for (int i = nblocks - 1; i > 0; i--) {
    int j = rnd(i + 1);
    int32_t t = e->free_ids[i];
    e->free_ids[i] = e->free_ids[j];
    e->free_ids[j] = t;
  }
  e->nfree = nblocks;
  /* Static scales only for the types that have them; everything else stays
   * NULL so a stray dereference crashes the test. */
  size_t n = (size_t)kvh * D;
  if (kv == ATTND_KV_INT8 || kv == ATTND_KV_FP8 || kv == ATTND_KV_INT4) {
    e->per_channel = kv == ATTND_KV_INT4 ? 1 : rnd(2);
    size_t ns = e->per_channel ? n : (size_t)kvh;
    e->ks = malloc(sizeof(float) * ns);
    e->vs = malloc(sizeof(float) * ns);
    for (size_t i = 0; i < ns; i++) {
      /* About 3.5 sigma at full range (int8: 127, fp8: 448, int4: 15 steps). */
      double full = kv == ATTND_KV_INT8 ? 127.0 : kv == ATTND_KV_FP8 ? 448.0 : 7.5;
      e->ks[i] = (float)(unif(2.5, 4.5) / full);
      e->vs[i] = (float)(unif(2.5, 4.5) / full);
    }
    if (kv == ATTND_KV_INT4) {
      e->kz = malloc(sizeof(float) * n);
      e->vz = malloc(sizeof(float) * n);
      for (size_t i = 0; i < n; i++) {
        e->kz[i] = (float)unif(6.0, 9.0);
        e->vz[i] = rnd(2) ? 8.0f : (float)unif(6.0, 9.0);
      }
    }
  }
  e->osc = (oracle_scales_t){e->ks, e->vs, e->kz, e->vz, e->per_channel};
}

void env_free(env_t *e) {
  free(e->sinks);
  free(e->k_row);
  free(e->cache);
  free(e->free_ids);
  free(e->ks);
  free(e->vs);
  free(e->kz);
  free(e->vz);
}

void sess_init(env_t *e, sess_t *se, int cap) {
  se->nb = 0;
  se->cap_blocks = (cap + e->s.block_size - 1) / e->s.block_size;
  se->table = malloc(sizeof(int32_t) * (size_t)se->cap_blocks);
  oracle_session_init(&se->o, &e->s, cap);
}

void sess_free(sess_t *se) {
  free(se->table);
  oracle_session_free(&se->o);
}

void sess_reserve(env_t *e, sess_t *se, int len) {
  while (se->nb * e->s.block_size < len) {
    assert_true(e->nfree > 0 && se->nb < se->cap_blocks);
    se->table[se->nb++] = e->free_ids[--e->nfree];
  }
}

void fill_random(attnd_dtype_t dt, void *p, size_t count, double amp) {
  for (size_t i = 0; i < count; i++)
    oracle_to_dtype(dt, p, i, amp * oracle_rng_normal(&g_rng));
}

/* Normal values of standard deviation amp, clamped to +-clip when clip > 0
 * (rounding to the dtype then never passes a representable clip). */
static void fill_clipped(attnd_dtype_t dt, void *p, size_t count, double amp, double clip,
                         int nonneg) {
  for (size_t i = 0; i < count; i++) {
    double x = amp * oracle_rng_normal(&g_rng);
    x = nonneg ? fabs(x) : x;
    if (clip > 0)
      x = x > clip ? clip : x < -clip ? -clip : x;
    oracle_to_dtype(dt, p, i, x);
  }
}

/* Random FlashMask intervals for kv_len keys, rows start..start+n-1; `dead`
 * >= 0 additionally masks row `dead` from every key. */
int32_t *random_intervals(int start, int n, int dead) {
  int kv_len = start + n;
  int32_t *iv = malloc(sizeof(int32_t) * 4 * (size_t)kv_len);
  for (int j = 0; j < kv_len; j++) {
    int a = rnd(kv_len + 2), b = a + rnd(n + 2);
    int c = rnd(kv_len + 2), d = c + rnd(3);
    if (rnd(4) == 0)
      b = a; /* empty */
    iv[j] = a;
    iv[kv_len + j] = b;
    iv[2 * kv_len + j] = c;
    iv[3 * kv_len + j] = d;
    if (dead >= 0) {
      iv[2 * kv_len + j] = dead;
      iv[3 * kv_len + j] = dead + 1;
    }
  }
  return iv;
}

/* ---- checking what a write stored ------------------------------------------- */

static double e4m3_value(uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  double v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
  return (b & 0x80) ? -v : v;
}

static double stored_value(const attnd_kshape_t *s, const uint8_t *row, int d) {
  switch (s->kv) {
  case ATTND_KV_BF16:
    return oracle_from_dtype(ATTND_DT_BF16, row, (size_t)d);
  case ATTND_KV_FP16:
    return oracle_from_dtype(ATTND_DT_FP16, row, (size_t)d);
  case ATTND_KV_INT8:
  case ATTND_KV_INT8_DYNAMIC:
    return (double)(int8_t)row[d];
  case ATTND_KV_FP8:
  case ATTND_KV_FP8_DYNAMIC:
    return e4m3_value(row[d]);
  default:
    return (double)((row[d / 2] >> (4 * (d & 1))) & 15);
  }
}

static size_t row_bytes(const attnd_kshape_t *s) {
  if (s->kv == ATTND_KV_BF16 || s->kv == ATTND_KV_FP16)
    return (size_t)s->head_dim * 2;
  return s->kv == ATTND_KV_INT4 ? (size_t)s->head_dim / 2 : (size_t)s->head_dim;
}

long g_rows_checked;

/* Compares the stored (token, kv head) rows of one item with the oracle's
 * quantizer applied to the same raw input: the bytes must be identical. */
static void check_cache_rows(env_t *e, const titem_t *it, const uint16_t *k, const uint16_t *v) {
  const attnd_kshape_t *s = &e->s;
  int D = s->head_dim, H = s->kv_heads, bs = s->block_size;
  size_t rb = row_bytes(s);
  size_t rows = (size_t)H * bs;
  double in[256], x[256], q[256];
  for (int t = 0; t < it->n; t++) {
    int pos = it->start + t;
    const uint8_t *blk = e->cache + (size_t)it->se->table[pos / bs] * e->bb;
    for (int h = 0; h < H; h++) {
      size_t r = (size_t)h * bs + pos % bs;
      for (int isv = 0; isv < 2; isv++) {
        const uint16_t *src = (isv ? v : k) + ((size_t)t * H + h) * D;
        for (int d = 0; d < D; d++)
          in[d] = oracle_from_dtype(s->dtype, src, (size_t)d);
        if (isv)
          memcpy(x, in, sizeof(double) * (size_t)D);
        else
          oracle_rope(s, pos, in, x);
        float ds;
        oracle_quantize_row(s, &e->osc, h, isv, x, q, &ds);
        const uint8_t *row = blk + (isv ? rows * rb : 0) + r * rb;
        for (int d = 0; d < D; d++)
          if (stored_value(s, row, d) != q[d])
            fail_msg("%s cache %s[pos %d head %d dim %d] = %.9g, oracle %.9g",
                     attnd_kv_type_name(s->kv), isv ? "V" : "K", pos, h, d, stored_value(s, row, d),
                     q[d]);
        if (attnd_kv_type_dynamic(s->kv)) {
          float got;
          memcpy(&got, blk + 2 * rows * rb + (isv ? rows * 4 : 0) + r * 4, 4);
          if (memcmp(&got, &ds, 4) != 0)
            fail_msg("%s scale %s[pos %d head %d] = %.9g, oracle %.9g", attnd_kv_type_name(s->kv),
                     isv ? "V" : "K", pos, h, (double)got, (double)ds);
        }
        g_rows_checked++;
      }
    }
  }
}

/* ---- one step: write + attend, checked ------------------------------------------ */

/* Runs one step and returns the worst relative error of its items. */
double run_step(env_t *e, titem_t *items, int ni, run_opts_t opt) {
  const attnd_kshape_t *s = &e->s;
  const int D = s->head_dim, H = s->kv_heads, QH = s->q_heads, bs = s->block_size;
  int T = 0, Tq = 0, nmeta = 0, max_kv = 0, max_n = 0;
  for (int i = 0; i < ni; i++) {
    int kv_len = items[i].start + items[i].n;
    sess_reserve(e, items[i].se, kv_len);
    T += items[i].n;
    Tq += items[i].has_q ? items[i].n : 0;
    nmeta += (kv_len + bs - 1) / bs + (items[i].iv ? 4 * kv_len : 0);
    max_kv = kv_len > max_kv ? kv_len : max_kv;
    max_n = items[i].n > max_n ? items[i].n : max_n;
  }
  size_t kvc = (size_t)T * H * D, qc = (size_t)Tq * QH * D;
  uint16_t *k = malloc(2 * kvc + 2), *v = malloc(2 * kvc + 2);
  uint16_t *q = malloc(2 * qc + 2), *q_raw = malloc(2 * qc + 2);
  size_t osz = opt.out_fp32 ? 4 : 2;
  uint8_t *out = malloc(osz * qc + 4);
  float *lse = malloc(sizeof(float) * ((size_t)Tq * QH + 1));
  int32_t *meta = malloc(sizeof(int32_t) * ((size_t)nmeta + 1));
  attnd_kitem_t *ki = calloc((size_t)ni + 1, sizeof(attnd_kitem_t));
  fill_clipped(s->dtype, k, kvc, e->amp, e->clip_qk, e->abs_qk);
  fill_clipped(s->dtype, v, kvc, e->amp_v > 0 ? e->amp_v : e->amp, e->clip_v, 0);
  fill_clipped(s->dtype, q, qc, e->amp_q, e->clip_qk, e->abs_qk);
  if (e->same_k && !e->k_row) {
    e->k_row = malloc(2 * (size_t)H * D);
    memcpy(e->k_row, k, 2 * (size_t)H * D);
  }
  for (int t = 0; e->same_k && t < T; t++)
    memcpy(k + (size_t)t * H * D, e->k_row, 2 * (size_t)H * D);
  memcpy(q_raw, q, 2 * qc);
  memset(out, 0xff, osz * qc); /* NaN in bf16, fp16 and fp32 */
  for (size_t i = 0; i < (size_t)Tq * QH; i++)
    lse[i] = NAN;

  int row = 0, qrow = 0, m = 0;
  for (int i = 0; i < ni; i++) {
    titem_t *it = &items[i];
    int kv_len = it->start + it->n;
    if (it->zero_rows)
      for (int t = 0; t < it->n; t += 2) {
        memset(k + ((size_t)(row + t) * H) * D, 0, 2 * (size_t)D);
        memset(v + ((size_t)(row + t) * H) * D, 0, 2 * (size_t)D);
      }
    ki[i] = (attnd_kitem_t){.start = it->start,
                            .n = it->n,
                            .q_row = it->has_q ? qrow : -1,
                            .kv_row = row,
                            .mask_kind = it->mask_kind,
                            .mask_param = it->mask_param,
                            .causal = it->causal,
                            .intervals = -1,
                            .block_table = m,
                            .flags = it->sink ? ATTND_ITEM_SINK : 0};
    int nbt = (kv_len + bs - 1) / bs;
    memcpy(meta + m, it->se->table, sizeof(int32_t) * (size_t)nbt);
    m += nbt;
    if (it->iv) {
      ki[i].intervals = m;
      memcpy(meta + m, it->iv, sizeof(int32_t) * 4 * (size_t)kv_len);
      m += 4 * kv_len;
    }
    row += it->n;
    qrow += it->has_q ? it->n : 0;
  }
  attnd_kbatch_t b = {.items = ki,
                      .nitems = ni,
                      .meta = meta,
                      .total_q = Tq,
                      .total_kv = T,
                      .max_kv_len = max_kv,
                      .max_n = max_n,
                      .q = q,
                      .k = k,
                      .v = v,
                      .out = out,
                      .out_fp32 = opt.out_fp32,
                      .lse = opt.want_lse ? lse : NULL,
                      .cache = e->cache,
                      .block_bytes = e->bb,
                      .k_scale = e->ks,
                      .v_scale = e->vs,
                      .k_zero = e->kz,
                      .v_zero = e->vz,
                      .scale_per_channel = e->per_channel,
                      .window = e->window,
                      .sinks = e->sinks};

  /* Parts run in reverse order: none may depend on another having run. */
  int np = opt.nparts_write ? opt.nparts_write : 1 + rnd(4);
  for (int p = np - 1; p >= 0; p--)
    assert_int_equal(attnd_cpu_write(s, &b, p, np), 0);

  /* Cache bytes and rotated q must equal the oracle's exactly. */
  row = 0;
  qrow = 0;
  for (int i = 0; i < ni; i++) {
    titem_t *it = &items[i];
    check_cache_rows(e, it, k + (size_t)row * H * D, v + (size_t)row * H * D);
    if (it->has_q) {
      double in[256], x[256];
      for (int t = 0; t < it->n; t++)
        for (int h = 0; h < QH; h++) {
          size_t off = ((size_t)(qrow + t) * QH + h) * D;
          for (int d = 0; d < D; d++)
            in[d] = oracle_from_dtype(s->dtype, q_raw, off + d);
          oracle_rope(s, it->start + t, in, x);
          for (int d = 0; d < D; d++)
            if (oracle_from_dtype(s->dtype, q, off + d) != x[d])
              fail_msg("rotated q[pos %d head %d dim %d] differs", it->start + t, h, d);
        }
    }
    row += it->n;
    qrow += it->has_q ? it->n : 0;
  }

  np = opt.nparts_attend ? opt.nparts_attend : 1 + rnd(4);
  if (opt.chunked && Tq > 0) {
    /* The attention again in ranges of units cut at random, run in reverse
     * order, each in its own number of parts: the bytes must equal the whole
     * batch's (the CPU backend cuts large steps like this). The rotated q
     * stays as the write left it: attend does not change it. */
    for (int p = np - 1; p >= 0; p--)
      assert_int_equal(attnd_cpu_attend(s, &b, p, np), 0);
    uint8_t *whole = malloc(osz * qc + 4);
    float *whole_lse = malloc(sizeof(float) * ((size_t)Tq * QH + 1));
    memcpy(whole, out, osz * qc);
    memcpy(whole_lse, lse, sizeof(float) * (size_t)Tq * QH);
    memset(out, 0xff, osz * qc);
    int rt, tu;
    assert_int_equal(attnd_cpu_attend_geometry(s, &rt, &tu), 0);
    int64_t nunits = 0;
    for (int i = 0; i < ni; i++)
      if (ki[i].q_row >= 0)
        nunits += (int64_t)((ki[i].n + rt - 1) / rt) * tu;
    int ncut = 0;
    int64_t *cut = malloc(sizeof(int64_t) * ((size_t)nunits + 2));
    cut[ncut++] = 0;
    for (int64_t u = 1; u < nunits; u++)
      if (rnd(3) == 0)
        cut[ncut++] = u;
    cut[ncut++] = nunits + rnd(2) * 1000; /* past the end is fine */
    for (int c = ncut - 2; c >= 0; c--) {
      int parts = 1 + rnd(3);
      for (int p = 0; p < parts; p++)
        assert_int_equal(attnd_cpu_attend_units(s, &b, cut[c], cut[c + 1], p, parts), 0);
    }
    if (memcmp(whole, out, osz * qc) != 0)
      fail_msg("attention in %d unit ranges differs from the whole batch's", ncut - 1);
    if (opt.want_lse && memcmp(whole_lse, lse, sizeof(float) * (size_t)Tq * QH) != 0)
      fail_msg("lse in %d unit ranges differs from the whole batch's", ncut - 1);
    free(cut);
    free(whole);
    free(whole_lse);
  } else {
    for (int p = np - 1; p >= 0; p--)
      assert_int_equal(attnd_cpu_attend(s, &b, p, np), 0);
  }

  /* The oracle, item by item, in item order. */
  double worst = 0.0;
  attnd_dtype_t odt = opt.out_fp32 ? ATTND_DT_FP32 : s->dtype;
  row = 0;
  qrow = 0;
  for (int i = 0; i < ni; i++) {
    titem_t *it = &items[i];
    oracle_session_write(s, &it->se->o, it->start, it->n, k + (size_t)row * H * D,
                         v + (size_t)row * H * D, &e->osc);
    if (it->has_q) {
      size_t cnt = (size_t)it->n * QH * D;
      double *ref = malloc(sizeof(double) * cnt);
      double *rlse = malloc(sizeof(double) * (size_t)it->n * QH);
      oracle_session_attend_ex(s, &it->se->o, it->start, it->n, q_raw + (size_t)qrow * QH * D,
                               it->mask_kind, it->mask_param, it->causal, it->iv, e->window,
                               it->sink ? e->sinks : NULL, ref, rlse);
      const uint8_t *got = out + osz * (size_t)qrow * QH * D;
      for (size_t j = 0; j < cnt; j++) {
        double g = oracle_from_dtype(odt, got, j);
        if (!isfinite(g))
          fail_msg("item %d: output element %zu is not finite (%g)", i, j, g);
      }
      double err = oracle_rel_l2(ref, odt, got, cnt);
      if (!(err <= attnd_tol_rel_l2(s->kv)))
        fail_msg("%s item %d (start %d n %d mask %d): rel L2 %.3g > %.3g",
                 attnd_kv_type_name(s->kv), i, it->start, it->n, it->mask_kind, err,
                 attnd_tol_rel_l2(s->kv));
      worst = err > worst ? err : worst;
      g_maxerr[s->kv] = err > g_maxerr[s->kv] ? err : g_maxerr[s->kv];
      if (opt.out_fp32 && err > g_maxerr32[s->kv])
        g_maxerr32[s->kv] = err;
      g_items[s->kv]++;
      /* Fully masked rows: exact zeros, lse -inf (with a sink: the sink, exactly). */
      for (int r = 0; r < it->n * QH; r++) {
        size_t o = (size_t)qrow * QH + r;
        int p = it->start + r / QH, dead = 1;
        for (int j = 0; j < it->start + it->n && dead; j++)
          dead = !oracle_visible(it->mask_kind, it->mask_param, it->causal, it->iv, e->window,
                                 it->start + it->n, p, j);
        if (dead) {
          for (int d = 0; d < D; d++)
            assert_true(oracle_from_dtype(odt, out, o * D + d) == 0.0);
          if (opt.want_lse && it->sink && e->sinks)
            assert_true(lse[o] == e->sinks[r % QH]);
          else if (opt.want_lse)
            assert_true(isinf(lse[o]) && lse[o] < 0);
        } else if (opt.want_lse) {
          double dl = fabs((double)lse[o] - rlse[r]);
          if (!(dl <= ATTND_TOL_KERNEL_LSE_ABS + ATTND_TOL_KERNEL_LSE_REL * fabs(rlse[r])))
            fail_msg("lse row %d: %.7g, oracle %.7g", r, (double)lse[o], rlse[r]);
          g_maxlse[s->kv] = dl > g_maxlse[s->kv] ? dl : g_maxlse[s->kv];
        }
      }
      if (it->got_out)
        for (size_t j = 0; j < cnt; j++)
          it->got_out[j] = (float)oracle_from_dtype(odt, got, j);
      if (it->got_lse)
        memcpy(it->got_lse, lse + (size_t)qrow * QH, sizeof(float) * (size_t)it->n * QH);
      free(ref);
      free(rlse);
    }
    row += it->n;
    qrow += it->has_q ? it->n : 0;
  }
  free(k);
  free(v);
  free(q);
  free(q_raw);
  free(out);
  free(lse);
  free(meta);
  free(ki);
  return worst;
}

titem_t item(sess_t *se, int start, int n) {
  return (titem_t){.se = se, .start = start, .n = n, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL};
}

run_opts_t opts(void) {
  return (run_opts_t){.out_fp32 = rnd(4) == 0, .want_lse = rnd(2), .chunked = rnd(2)};
}
void kfx_seed(void) {
  const char *seed = getenv("ATTND_TEST_SEED");
  if (seed) {
    g_rng = strtoull(seed, NULL, 0);
  } else {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    g_rng = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec;
  }
  printf("seed: ATTND_TEST_SEED=%llu\n", (unsigned long long)g_rng);
}

int kfx_print_summary(void **state) {
  (void)state;
  printf("max rel L2 error vs oracle per cache type: all items (bound) | fp32-output items "
         "| max |lse err| | items\n");
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    printf("  %-13s %.3e (%.0e) | %.3e | %.2e | %ld\n", attnd_kv_type_name((attnd_kv_type_t)kv),
           g_maxerr[kv], attnd_tol_rel_l2(kv), g_maxerr32[kv], g_maxlse[kv], g_items[kv]);
  printf("cache rows compared bit-exactly with the oracle's quantizer: %ld\n", g_rows_checked);
  return 0;
}

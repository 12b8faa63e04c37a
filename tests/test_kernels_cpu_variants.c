/* test_kernels_cpu_variants.c: the per-layer attention variants of
 * docs/numerics.md on the CPU kernels, against the float64 oracle through the
 * harness of kernels_fixture.h: layer windows (intersected with every mask
 * kind, smaller and larger than a block and than the history, the keys left of
 * a window never read), sink logits (huge, tiny, fully masked rows with and
 * without them), soft-capping (with scores far past the cap), every cache
 * type, head dim, block size and GQA group, prefill and decode, and the
 * split-context merge of a part with the sink and a part without. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_fixture.h"

static void set_sinks(env_t *e, double lo, double hi) {
  free(e->sinks);
  e->sinks = malloc(sizeof(float) * (size_t)e->s.q_heads);
  for (int h = 0; h < e->s.q_heads; h++)
    e->sinks[h] = (float)unif(lo, hi);
}

/* A window for a session of `hist` keys and blocks of bs: below a block,
 * between a block and the history, or past the history. */
static int pick_window(int bs, int hist) {
  switch (rnd(3)) {
  case 0:
    return 1 + rnd(bs - 1);
  case 1:
    return bs + rnd(hist > bs ? hist - bs + 1 : 1);
  default:
    return hist + 1 + rnd(50);
  }
}

/* Every cache type over the shapes (pairwise), window / sinks / softcap each
 * on or off at random, with a prefill in two chunks and decode steps; every
 * mask kind appears on some step. */
static void test_variants_all_types(void **state) {
  (void)state;
  static const int cfg[4][3] = {{64, 16, 1}, {128, 32, 4}, {256, 64, 8}, {128, 128, 16}};
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int c = 0; c < 4; c++)
      for (int variant = 0; variant < 3; variant++) {
        int D = cfg[(c + kv) % 4][0], bs = cfg[c][1], G = cfg[c][2];
        if (c == 3 && kv % 2)
          D = 64;
        attnd_dtype_t dt = (c + kv + variant) % 2 ? ATTND_DT_FP16 : ATTND_DT_BF16;
        int kvh = G >= 8 ? 1 : 2;
        env_t e;
        env_init(&e, D, bs, kvh, G, dt, (attnd_kv_type_t)kv, (attnd_rope_t)rnd(3), 64);
        int total = 2 * bs + 3 + rnd(bs);
        /* variant 0: window only; 1: window + sinks + softcap; 2: sinks + softcap */
        e.window = variant < 2 ? pick_window(bs, total) : 0;
        if (variant >= 1) {
          set_sinks(&e, -3.0, 3.0);
          e.s.softcap = (float)unif(1.0, 30.0);
        }
        sess_t se;
        sess_init(&e, &se, total + 8);
        int n1 = 1 + rnd(total - 4);
        titem_t it = item(&se, 0, n1);
        it.sink = variant >= 1;
        run_step(&e, &it, 1, opts());
        it = item(&se, n1, total - n1);
        it.sink = variant >= 1 && rnd(2);
        it.mask_kind = rnd(ATTND_MASK_INTERVALS + 1);
        it.causal = rnd(2);
        if (it.mask_kind == ATTND_MASK_SLIDING)
          it.mask_param = 1 + rnd(2 * bs);
        if (it.mask_kind == ATTND_MASK_PREFIX_LM)
          it.mask_param = rnd(total + 2);
        if (it.mask_kind == ATTND_MASK_INTERVALS)
          it.iv = random_intervals(it.start, it.n, it.start + rnd(it.n));
        run_step(&e, &it, 1, (run_opts_t){.out_fp32 = rnd(2), .want_lse = 1, .chunked = 1});
        free(it.iv);
        for (int st = 0; st < 3; st++) {
          it = item(&se, total + st, 1);
          it.sink = variant >= 1;
          run_step(&e, &it, 1, opts());
        }
        sess_free(&se);
        env_free(&e);
      }
}

/* Keys left of a window are never loaded: after the history is written, the
 * block-table entries of every block entirely left of the first new row's
 * window point far outside the pool, so a read of one faults (or ASan
 * reports it); the outputs must still match the oracle. Decode and prefill,
 * windows below and above a block. */
static void test_window_skips_blocks(void **state) {
  (void)state;
  static const int bss[4] = {16, 32, 64, 128};
  for (int t = 0; t < 8; t++) {
    int bs = bss[t % 4];
    attnd_kv_type_t kv = (attnd_kv_type_t)rnd(ATTND_KV_COUNT_);
    env_t e;
    int hist = 6 * bs + rnd(bs);
    env_init(&e, 64, bs, 2, 4, ATTND_DT_BF16, kv, ATTND_ROPE_NEOX, (hist + 64) / bs + 4);
    e.window = t < 4 ? 1 + rnd(bs) : bs + rnd(2 * bs);
    if (t & 1) {
      set_sinks(&e, -1.0, 1.0);
      e.s.softcap = 20.0f;
    }
    sess_t se;
    sess_init(&e, &se, hist + 64);
    titem_t it = item(&se, 0, hist);
    it.has_q = 0;
    run_step(&e, &it, 1, opts());
    int n = t % 2 ? 1 : 1 + rnd(40);
    int first = hist - e.window + 1; /* the first key row `hist` sees */
    int nb_left = first > 0 ? first / bs : 0;
    assert_true(nb_left >= 1);
    int32_t saved[64];
    memcpy(saved, se.table, sizeof(int32_t) * (size_t)nb_left);
    for (int b = 0; b < nb_left; b++)
      se.table[b] = 1 << 28; /* far past the pool */
    it = item(&se, hist, n);
    it.sink = (t & 1) != 0;
    run_step(&e, &it, 1, (run_opts_t){.out_fp32 = rnd(2), .want_lse = 1, .chunked = rnd(2)});
    memcpy(se.table, saved, sizeof(int32_t) * (size_t)nb_left);
    sess_free(&se);
    env_free(&e);
  }
}

/* Sinks at the extremes and rows with nothing to see: a huge sink (the
 * output goes to ~0 and lse to the sink), a tiny one (no effect), fully
 * masked rows with the flag (out 0, lse = the sink exactly) and without it
 * (out 0, lse -inf), in one batch, every cache type. */
static void test_sinks_extremes(void **state) {
  (void)state;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int mode = 0; mode < 3; mode++) {
      env_t e;
      env_init(&e, 128, 32, 2, 4, kv % 2 ? ATTND_DT_FP16 : ATTND_DT_BF16, (attnd_kv_type_t)kv,
               ATTND_ROPE_NEOX, 32);
      if (mode == 0)
        set_sinks(&e, 20.0, 40.0); /* far above the scores */
      else if (mode == 1)
        set_sinks(&e, -1e4, -1e3);
      else
        set_sinks(&e, -2.0, 2.0);
      for (int h = 0; mode == 2 && h < e.s.q_heads; h += 3)
        e.sinks[h] = h % 2 ? 1e4f : -1e4f; /* mixed extremes across heads */
      sess_t a, b;
      sess_init(&e, &a, 200);
      sess_init(&e, &b, 200);
      titem_t pre[2] = {item(&a, 0, 50 + rnd(30)), item(&b, 0, 20)};
      pre[0].sink = pre[1].sink = 1;
      /* Outputs near e^-30 are below fp16's range: fp32 output for huge sinks. */
      run_opts_t po = opts();
      po.out_fp32 |= mode == 0;
      run_step(&e, pre, 2, po);
      titem_t its[2] = {item(&a, pre[0].n, 1 + rnd(20)), item(&b, 20, 1 + rnd(8))};
      for (int i = 0; i < 2; i++) {
        its[i].mask_kind = ATTND_MASK_INTERVALS;
        its[i].causal = 1;
        its[i].iv = random_intervals(its[i].start, its[i].n, its[i].start + rnd(its[i].n));
      }
      its[0].sink = 1;
      its[1].sink = 0;
      run_step(&e, its, 2,
               (run_opts_t){.out_fp32 = mode == 0 || rnd(2), .want_lse = 1, .chunked = 1});
      free(its[0].iv);
      free(its[1].iv);
      sess_free(&a);
      sess_free(&b);
      env_free(&e);
    }
}

/* Soft-capping with scores far past the cap (q and k amplitude 8: raw scaled
 * scores in the hundreds), small caps and Gemma 2's 50, every cache type,
 * prefill and decode, with a window too. */
static void test_softcap_huge_scores(void **state) {
  (void)state;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
    env_t e;
    env_init(&e, 64 << rnd(3), 16 << rnd(4), 2, 1 << rnd(4), ATTND_DT_BF16, (attnd_kv_type_t)kv,
             ATTND_ROPE_NONE, 64);
    e.amp = 3.0;
    e.amp_q = 8.0;
    e.s.softcap = rnd(2) ? 50.0f : (float)unif(0.5, 5.0);
    e.window = rnd(2) ? 0 : 1 + rnd(40);
    sess_t se;
    sess_init(&e, &se, 160);
    titem_t it = item(&se, 0, 70 + rnd(30));
    run_step(&e, &it, 1, (run_opts_t){.out_fp32 = rnd(2), .want_lse = 1, .chunked = 1});
    it = item(&se, it.n, 1);
    run_step(&e, &it, 1, (run_opts_t){.want_lse = 1});
    sess_free(&se);
    env_free(&e);
  }
}

/* Split context: keys [0, m) in a part with the sink and keys [m, kv_len) in
 * a part without it, merged by lse, equal the whole computed at once with the
 * sink (same q, k and v: the generator is rewound before each run). The
 * window applies to both parts, and part A may be all masked by it. */
static void test_split_merge(void **state) {
  (void)state;
  for (int t = 0; t < 2 * ATTND_KV_COUNT_; t++) {
    attnd_kv_type_t kv = (attnd_kv_type_t)(t % ATTND_KV_COUNT_);
    env_t e;
    env_init(&e, 64 << rnd(2), 16 << rnd(3), 2, 1 << rnd(4), ATTND_DT_BF16, kv,
             (attnd_rope_t)rnd(3), 48);
    set_sinks(&e, -2.0, 4.0);
    if (rnd(2))
      e.s.softcap = (float)unif(2.0, 50.0);
    int hist = 40 + rnd(60), n = t < ATTND_KV_COUNT_ ? 1 : 1 + rnd(20);
    e.window = rnd(2) ? 0 : 1 + rnd(hist);
    int m = 1 + rnd(hist - 1);
    sess_t se;
    sess_init(&e, &se, hist + n + 1);
    titem_t it = item(&se, 0, hist);
    it.has_q = 0;
    run_step(&e, &it, 1, opts());
    const int QH = e.s.q_heads, D = e.s.head_dim, kv_len = hist + n;
    const size_t cnt = (size_t)n * QH * D, nl = (size_t)n * QH;
    float *out[3], *lse[3];
    int32_t *iv[2];
    for (int p = 0; p < 2; p++) {
      iv[p] = calloc(4 * (size_t)kv_len, sizeof(int32_t));
      for (int j = 0; j < kv_len; j++)
        if ((p == 0) == (j >= m))
          iv[p][kv_len + j] = 1 << 30; /* masked from every row */
    }
    const uint64_t rewind = g_rng;
    for (int r = 0; r < 3; r++) {
      out[r] = malloc(sizeof(float) * cnt);
      lse[r] = malloc(sizeof(float) * nl);
      g_rng = rewind;
      it = item(&se, hist, n);
      it.got_out = out[r];
      it.got_lse = lse[r];
      it.sink = r != 2; /* 0: whole, 1: part A (keys < m), 2: part B */
      if (r > 0) {
        it.mask_kind = ATTND_MASK_INTERVALS;
        it.causal = 1;
        it.iv = iv[r - 1];
      }
      run_step(&e, &it, 1, (run_opts_t){.out_fp32 = 1, .want_lse = 1, .nparts_attend = 1 + r});
    }
    double num = 0, den = 0;
    for (size_t i = 0; i < nl; i++) {
      double oa[256], ob[256], mo[256], ml;
      for (int d = 0; d < D; d++) {
        oa[d] = out[1][i * D + d];
        ob[d] = out[2][i * D + d];
      }
      const double *parts[2] = {oa, ob};
      double ls[2] = {lse[1][i], lse[2][i]};
      oracle_merge_lse(2, parts, ls, D, mo, &ml);
      if (!(fabs(ml - lse[0][i]) <= 1e-4 * (1.0 + fabs(ml))))
        fail_msg("merged lse %.7g, whole %.7g (row-head %zu)", ml, (double)lse[0][i], i);
      for (int d = 0; d < D; d++) {
        double w = out[0][i * D + d];
        num += (mo[d] - w) * (mo[d] - w);
        den += w * w;
      }
    }
    double err = den > 0 ? sqrt(num / den) : sqrt(num);
    if (!(err <= 1e-5))
      fail_msg("%s: merged parts differ from the whole by rel L2 %.3g", attnd_kv_type_name(kv),
               err);
    for (int r = 0; r < 3; r++) {
      free(out[r]);
      free(lse[r]);
    }
    free(iv[0]);
    free(iv[1]);
    sess_free(&se);
    env_free(&e);
  }
}

int main(void) {
  kfx_seed();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_variants_all_types), cmocka_unit_test(test_window_skips_blocks),
      cmocka_unit_test(test_sinks_extremes),     cmocka_unit_test(test_softcap_huge_scores),
      cmocka_unit_test(test_split_merge),
  };
  return cmocka_run_group_tests(tests, NULL, kfx_print_summary);
}

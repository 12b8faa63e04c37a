/* test_cuda_numerics.c: the numerics of the CUDA kernels, judged against the
 * float64 oracle and against the CPU backend run on the same inputs.
 *
 * Every cache type x head dim 64/128/256, both activation dtypes, every
 * attention kernel: a mixed batch with a short prefill item on the tiled
 * kernel (launch option sm90 = 1), a decode-shaped batch on the decode
 * kernel, and a prefill-shaped batch (chunks of 40..159 rows over cached
 * histories, a prefill from position 0 with documents: several key and query
 * tiles) on the default path, the Hopper kernel of prefill_sm90.cuh on an
 * sm_90 device, checked against the tiled kernel too (the harness's A/B).
 * Three input styles:
 * V rows at or near the zero point with all-zero rows (int4 zero points
 * integers, halves and random), sink-like tokens that take about half the
 * attention with zero values, and plain normal inputs. Each item must stay
 * within its type's bound, and within 2x the CPU backend's error plus half an
 * output rounding (harness_ratio_floor). The magnitude cases put q and k near
 * the largest magnitude the kernels compute faithfully (2^48 for bf16, the
 * fp16 range for fp16 values), q huge over tiny k, and v near 2^100: no Inf,
 * no NaN, no masked-looking zeros, the same bounds.
 * test_variants: soft-capping, sinks and windows at large magnitudes.
 * ATTND_GPU_TEST_PAIRWISE=1 runs a subset, for compute-sanitizer. Built with
 * ATTND_HARNESS_OLD_API it uses only the plain API (attnd_cuda_write /
 * attnd_cuda_attend, every batch on the default path), so the same cases run
 * against an older build of the kernels. */
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

#include "attnd_cuda.h"
#include "attnd_kernels.h"
#include "cuda_harness.h"
#include "oracle.h"

/* Per cache type and activation dtype (0 bf16, 1 fp16). */
static double g_cuda[ATTND_KV_COUNT_][2], g_cpu[ATTND_KV_COUNT_][2], g_ratio[ATTND_KV_COUNT_][2];
static int g_n[ATTND_KV_COUNT_][2], g_bad[ATTND_KV_COUNT_][2];
static double g_kind_ratio[3]; /* worst ratio per batch kind (K_MIXED, ...) */

static int pairwise_mode(void) {
  const char *e = getenv("ATTND_GPU_TEST_PAIRWISE");
  return e && *e && strcmp(e, "0") != 0;
}

static const int k_masks[5] = {ATTND_MASK_CAUSAL, ATTND_MASK_INTERVALS, ATTND_MASK_SLIDING,
                               ATTND_MASK_PREFIX_LM, ATTND_MASK_FULL};

/* Which kernel a case's batch is shaped for. */
enum { K_MIXED = 0, K_DECODE = 1, K_PREFILL = 2, K_KINDS = 3 };
static const char *const k_kind_names[K_KINDS] = {"mixed", "decode", "prefill"};

/* Launch options per batch kind: the mixed batches on the tiled kernel, the
 * others on the default path. */
#ifndef ATTND_HARNESS_OLD_API
static const attnd_cuda_opts_t k_tiled_opts = {.sm90 = 1};
static void kind_opts(int kind, case_opts_t *o) {
  o->opts = kind == K_MIXED ? &k_tiled_opts : NULL;
  o->check_ab = kind == K_PREFILL;
}
#else
static void kind_opts(int kind, case_opts_t *o) {
  (void)kind;
  (void)o;
}
#endif

/* A mixed batch (a short prefill item beside decode rows), a decode-shaped
 * one, or a prefill-shaped one. */
static void make_items(int ncase, int kind, int G, tcase_item_t *ti) {
  if (kind == K_PREFILL) {
    tcase_item_t m[4] = {
        {.hist = 100 + harness_rnd(300),
         .n = 40 + harness_rnd(120),
         .has_q = 1,
         .mask_kind = k_masks[ncase % 5],
         .mask_param = 1 + harness_rnd(200),
         .causal = harness_rnd(2),
         .docs = harness_rnd(2)},
        {.hist = 0,
         .n = 60 + harness_rnd(100),
         .has_q = 1,
         .mask_kind = k_masks[(ncase + 2) % 5],
         .mask_param = 1 + harness_rnd(100),
         .causal = harness_rnd(2),
         .docs = 1},
        {.hist = 100 + harness_rnd(300), .n = 1, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL},
        {.hist = harness_rnd(30), .n = 1 + harness_rnd(10), .has_q = 0},
    };
    memcpy(ti, m, sizeof m);
    for (int i = 0; i < 4; i++) {
      ti[i].start = ti[i].hist;
      if (ti[i].mask_kind == ATTND_MASK_PREFIX_LM)
        ti[i].mask_param = harness_rnd(ti[i].hist + ti[i].n + 1);
    }
    return;
  }
  if (kind == K_MIXED) {
    const int mk = k_masks[ncase % 5];
    tcase_item_t m[4] = {
        {.hist = 100 + harness_rnd(400), .n = 1, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL},
        {.hist = harness_rnd(100),
         .n = 20 + harness_rnd(60),
         .has_q = 1,
         .mask_kind = mk,
         .mask_param = 1 + harness_rnd(60),
         .causal = harness_rnd(2)},
        {.hist = harness_rnd(30), .n = 1 + harness_rnd(10), .has_q = 0},
        {.hist = 20 + harness_rnd(60), .n = 3, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL},
    };
    memcpy(ti, m, sizeof m);
    for (int i = 0; i < 4; i++)
      ti[i].start = ti[i].hist;
    ti[3].start = ti[3].hist - 2;
    if (mk == ATTND_MASK_PREFIX_LM)
      ti[1].mask_param = harness_rnd(ti[1].hist + ti[1].n + 1);
    return;
  }
  const int nmax = (ncase & 1) && G <= 8 ? 8 / G : 16 / G;
  for (int i = 0; i < 4; i++) {
    const int mk = k_masks[(ncase + i) % 5];
    ti[i] = (tcase_item_t){.hist = (i == 0 ? 200 : 1) + harness_rnd(i == 0 ? 600 : 150),
                           .n = 1 + harness_rnd(nmax),
                           .has_q = 1,
                           .mask_kind = mk,
                           .mask_param = 1 + harness_rnd(200),
                           .causal = harness_rnd(2)};
    ti[i].start = ti[i].hist;
    if (mk == ATTND_MASK_PREFIX_LM)
      ti[i].mask_param = harness_rnd(ti[i].hist + ti[i].n + 1);
  }
}

static void record(const attnd_kshape_t *s, int ncase, const case_result_t *r, const char *what,
                   int kind) {
  const int di = s->dtype == ATTND_DT_FP16;
  const int kv = s->kv;
  if (r->cuda_err > g_cuda[kv][di])
    g_cuda[kv][di] = r->cuda_err;
  if (r->cpu_err > g_cpu[kv][di])
    g_cpu[kv][di] = r->cpu_err;
  if (r->worst_ratio > g_ratio[kv][di])
    g_ratio[kv][di] = r->worst_ratio;
  g_n[kv][di]++;
  if (r->worst_ratio > g_kind_ratio[kind])
    g_kind_ratio[kind] = r->worst_ratio;
  if (r->worst_ratio > 1.0) {
    g_bad[kv][di]++;
    print_message("case %d %s (%s batch) kv %s %s D %d G %d: cuda %.3e cpu %.3e: over 2x cpu + "
                  "floor (%.2f)\n",
                  ncase, what, k_kind_names[kind], attnd_kv_type_name(s->kv),
                  s->dtype == ATTND_DT_BF16 ? "bf16" : "fp16", s->head_dim,
                  s->q_heads / s->kv_heads, r->cuda_err, r->cpu_err, r->worst_ratio);
  }
}

static attnd_kshape_t shape(int kv, int d, int bs, int G, int fp16, int rope) {
  attnd_kshape_t s = {.kv_heads = G >= 8 ? 1 : 2,
                      .head_dim = d,
                      .block_size = bs,
                      .dtype = fp16 ? ATTND_DT_FP16 : ATTND_DT_BF16,
                      .kv = (attnd_kv_type_t)kv,
                      .rope = (attnd_rope_t)rope,
                      .rope_theta = 10000.0,
                      .rotary_dim = 0};
  s.q_heads = s.kv_heads * G;
  s.softmax_scale = (float)(1.0 / sqrt((double)d));
  return s;
}

static void test_styles(void **state) {
  (void)state;
  static const int dims[3] = {64, 128, 256}, bss[4] = {16, 32, 64, 128}, groups[3] = {1, 4, 8};
  static const char *const names[3] = {"normal", "zero-point", "sinks"};
  const int pw = pairwise_mode();
  int ncase = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int style = 0; style < 3; style++)
        for (int kind = 0; kind < K_KINDS; kind++, ncase++) {
          if (pw && (kv + di + style + kind) % 5 != 0)
            continue;
          const int G = groups[(ncase / 2) % 3];
          /* Sinks without RoPE: their direction must stay aligned with q's. */
          attnd_kshape_t s = shape(kv, dims[di], bss[ncase % 4], G, (ncase >> 1) & 1,
                                   style == CASE_SINKS ? ATTND_ROPE_NONE : 1 + ncase % 2);
          tcase_item_t ti[4];
          make_items(ncase, kind, G, ti);
          case_opts_t o = {
              .use_ws = ncase % 4 != 2, .per_channel = (ncase >> 2) & 1, .style = style, .cpu = 1};
          kind_opts(kind, &o);
          case_result_t r;
          run_case(&s, 3000 + ncase, ti, 4, &o, &r);
          record(&s, 3000 + ncase, &r, names[style], kind);
        }
}

/* The largest magnitudes the kernels compute faithfully (docs/numerics.md):
 * q and k near 2^48 (scores near 2^101: one key takes all the weight), q near
 * 2^48 over k near 2^-48 (moderate scores from huge operands), v near 2^100.
 * An fp16 cache holds at most 65504, and fp16 activations too. */
static void test_bound(void **state) {
  (void)state;
  static const int dims[3] = {64, 128, 256};
  const int pw = pairwise_mode();
  int ncase = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int which = 0; which < 3; which++)
        for (int fp16 = 0; fp16 < 2; fp16++, ncase++) {
          if (pw && (kv + di + which + fp16) % 4 != 0)
            continue;
          const int G = (ncase % 3) == 0 ? 1 : 4;
          attnd_kshape_t s = shape(kv, dims[di], 64, G, fp16, ATTND_ROPE_NEOX);
          const int kind = ncase % K_KINDS;
          tcase_item_t ti[4];
          make_items(ncase, kind, G, ti);
          const double big_qk = fp16 ? 0x1p15 : 0x1p48;
          const double big_k = fp16 || kv == ATTND_KV_FP16 ? 0x1p15 : 0x1p48;
          const double big_v = fp16 || kv == ATTND_KV_FP16 ? 0x1p13 : 0x1p98;
          case_opts_t o = {.use_ws = 1, .per_channel = ncase & 2 ? 1 : 0, .cpu = 1};
          if (which == 0) {
            o.q_mag = big_qk;
            o.k_mag = big_k;
            o.near_bound = 1;
          } else if (which == 1) {
            o.q_mag = big_qk;
            o.k_mag = 1.0 / big_qk;
            o.near_bound = 1;
          } else {
            o.v_mag = big_v;
          }
          kind_opts(kind, &o);
          case_result_t r;
          run_case(&s, 4000 + ncase, ti, 4, &o, &r);
          record(&s, 4000 + ncase, &r,
                 which == 0   ? "q,k at the bound"
                 : which == 1 ? "q huge, k tiny"
                              : "v at the bound",
                 kind);
        }
}

#ifndef ATTND_HARNESS_OLD_API
/* The per-layer variants at large magnitudes (docs/numerics.md), every cache
 * type x head dim x kernel: soft-capping over scores far past the cap (q at
 * 4: scores of several c, most keys near +-c; and q near the bound over tiny
 * k), sinks over sink-like tokens (sink logits huge, tiny and mixed),
 * windows and sinks together. Not at the magnitude bound itself: capped
 * scores of 2^96 operands keep no digits below 2^72, where the cap lies. The
 * reference is the harness's float64 one (cuda_harness_ref.c); the CPU
 * backend runs the same batches (its kernels have the same semantics), is
 * held to the same bound and enters the CPU-ratio report. */
static void test_variants(void **state) {
  (void)state;
  static const int dims[3] = {64, 128, 256};
  const int pw = pairwise_mode();
  int ncase = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int which = 0; which < 3; which++, ncase++) {
        if (pw && (kv + di + which) % 4 != 0)
          continue;
        const int G = (ncase % 3) == 0 ? 1 : 4, fp16 = (ncase >> 1) & 1;
        attnd_kshape_t s = shape(kv, dims[di], 32 << (ncase % 3), G, fp16,
                                 which == 2 ? ATTND_ROPE_NONE : ATTND_ROPE_NEOX);
        const int kind = ncase % K_KINDS;
        tcase_item_t ti[4];
        make_items(ncase, kind, G, ti);
        float sinks[16];
        case_opts_t o = {.use_ws = 1, .per_channel = ncase & 2 ? 1 : 0, .cpu = 1};
        if (which == 0) {
          s.softcap = 2.f;
          o.q_mag = 4.0;
        } else if (which == 1) {
          s.softcap = 50.f;
          o.q_mag = fp16 || kv == ATTND_KV_FP16 ? 0x1p12 : 0x1p40;
          o.k_mag = 1.0 / o.q_mag;
          o.near_bound = 1;
        } else {
          o.style = CASE_SINKS;
          /* Huge sinks leave outputs of e^-(sink - lse) |v|: fp16 holds them down
           * to e^-16 (subnormals), bf16 far below. */
          const float huge = fp16 ? 16.f : 60.f;
          for (int h = 0; h < s.q_heads; h++)
            sinks[h] = h % 3 == 0   ? huge
                       : h % 3 == 1 ? -60.f
                                    : (float)(3.0 * oracle_rng_normal(&g_rng));
          o.sinks = sinks;
          o.sink_items = 0xbu;
          o.window = ncase % 2 ? 3 + harness_rnd(60) : 0;
        }
        kind_opts(kind, &o);
        case_result_t r;
        run_case(&s, 5000 + ncase, ti, 4, &o, &r);
        record(&s, 5000 + ncase, &r,
               which == 0   ? "softcap 2, q 4"
               : which == 1 ? "softcap 50, q huge, k tiny"
                            : "sinks (and windows)",
               kind);
      }
}
#endif

static void test_report(void **state) {
  (void)state;
  print_message("%-13s %-5s %5s %11s %11s %11s %s\n", "kv", "act", "cases", "cuda err", "cpu err",
                "worst ratio", "(ratio: cuda / (2 cpu + floor), must be <= 1)");
  int bad = 0, n = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 2; di++) {
      if (!g_n[kv][di])
        continue;
      print_message("%-13s %-5s %5d %11.3e %11.3e %11.3f %s\n", attnd_kv_type_name(kv),
                    di ? "fp16" : "bf16", g_n[kv][di], g_cuda[kv][di], g_cpu[kv][di],
                    g_ratio[kv][di], g_bad[kv][di] ? "FAIL" : "");
      bad += g_bad[kv][di];
      n += g_n[kv][di];
    }
  print_message("worst ratio per batch: mixed (tiled kernel) %.3f, decode %.3f, prefill-shaped "
                "(default path) %.3f\n",
                g_kind_ratio[K_MIXED], g_kind_ratio[K_DECODE], g_kind_ratio[K_PREFILL]);
#ifndef ATTND_HARNESS_OLD_API
  print_message("prefill-shaped batches, default path vs tiled kernel (A/B): %d batches, %d with "
                "differing bits, worst rel L2 %.3e (items >= 8 rows, bound %.1e)\n",
                g_ab_checks, g_ab_differ, g_ab_worst, ATTND_TOL_AB_ROWS);
#endif
  assert_true(n > 0);
  assert_int_equal(bad, 0);
}

int main(void) {
  const char *seed = getenv("ATTND_TEST_SEED");
  g_rng = seed ? strtoull(seed, NULL, 0) : ((uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull) | 1;
  print_message("seed %llu\n", (unsigned long long)g_rng);
  if (attnd_cuda_device_count() == 0) {
    print_message("no CUDA device: GPU numerics tests skipped\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_styles),
      cmocka_unit_test(test_bound),
#ifndef ATTND_HARNESS_OLD_API
      cmocka_unit_test(test_variants),
#endif
      cmocka_unit_test(test_report),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

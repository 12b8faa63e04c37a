/* test_cuda_kernels.c: the CUDA kernels (kernels/cuda) against the float64
 * oracle (tests/oracle), on fresh random inputs, outputs poisoned first.
 *
 * Each case is one shape (cache type, head dim, block size, GQA group,
 * activation dtype, RoPE) and one mixed batch over four sessions whose cached
 * histories were written by an earlier write-only batch: a decode row over a
 * long history, a prefill item under a random mask (causal, full, sliding,
 * prefix-LM, FlashMask intervals with fully masked rows), a write-only item
 * and a rewrite of the last tokens. The matrix covers every cache type x head
 * dim x block size, with GQA 1/4/8/16, dtype and RoPE kinds cycling (pairwise).
 * Launch options cycle (flat and per-item split, with and without programmatic
 * dependent launch). ATTND_GPU_TEST_PAIRWISE=1 runs a small subset (one case
 * per cache type), for compute-sanitizer. Skips when no GPU answers. The case
 * runner is tests/cuda_harness.c; test_cuda_numerics.c holds the numerics
 * cases (zero points, sinks, magnitudes at the bound, CPU backend ratio).
 * A prefill-shaped matrix (longer chunks over longer histories, document
 * masks) covers the Hopper path of prefill_sm90.cuh; every case also runs the
 * batch once more on the tiled kernel (launch option sm90 = 1) and requires the two to
 * agree to fp32 summation order. ATTND_GPU_TEST_ONLY=substring runs only the
 * matrices whose name contains it. test_variants_matrix covers the per-layer
 * variants (windows, soft-capping, sinks). */
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
#include <cuda_runtime_api.h>

#include "attnd_cuda.h"
#include "attnd_kernels.h"
#include "cuda_harness.h"
#include "oracle.h"

static double g_max_err[ATTND_KV_COUNT_];
static int g_cases[ATTND_KV_COUNT_];

/* Launch options cycle over the cases: the flat split (tiny pieces, and
 * CTAs spanning several items), the per-item split (and parts of at least 4
 * chunks), with and without programmatic dependent launch, the decode
 * kernel's L2 prefetch of its own rows (debug 64, 128: results exact), the
 * per-item split merged inside thread-block clusters (debug 256), its CTAs
 * head-major (debug 4096: the same pieces in another order), the decode
 * stages at their old offset, off a 128-byte boundary (debug 8192) and the
 * converted types' chunks all in flight (debug 512, their former default),
 * the 1-byte types' refill-read chunk copy (debug 32, their former default)
 * and the dynamic types' P V product in fp16 under bf16 activations (debug
 * 32768);
 * on the Hopper prefill path, the converted types' earlier conversion
 * instructions (sm90_sched 512), the opt-in unit order of the finishing
 * warps (sm90_sched 2048), the producer warp converting too (4096) and the
 * other form of the finishing loop (8192: the next round's loads ahead of the
 * stores, or not, prefill_sm90.cuh) and, for the dynamic types at head
 * dims up to 128, the fourth warpgroup of finishing warps left idle
 * (16384: 96 finishing threads instead of 224). */
#define N_OPTS 9
static const attnd_cuda_opts_t k_opts[N_OPTS] = {
    {.split = 0},
    {.split = 2, .debug = 32768},
    {.split = 1, .min_chunks = 2, .debug = 32, .sm90_sched = 4096},
    {.split = 0, .no_pdl = 1, .debug = 512 | 8192 | 32, .sm90_sched = 16384},
    {.split = 1, .min_chunks = 150, .sm90_sched = 2048, .debug = 32768},
    {.split = 2, .min_chunks = 4, .debug = 64 | 4096 | 8192},
    {.split = 1, .min_chunks = 2, .debug = 64 | 128 | 8192, .sm90_sched = 8192},
    {.split = 2, .debug = 256 | 4096 | 32768, .sm90_sched = 512 | 16384},
    {.split = 0, .debug = 256 | 64, .sm90_sched = 2048 | 4096 | 8192}};

static double case_run(attnd_kshape_t *s, int ncase, const tcase_item_t *ti, int nitems,
                       int out_fp32, int use_ws, int per_channel) {
  case_opts_t o = {.out_fp32 = out_fp32,
                   .use_ws = use_ws,
                   .per_channel = per_channel,
                   .check_hit = 1,
                   .check_ab = 1,
                   .opts = &k_opts[ncase % N_OPTS],
                   .step = ((ncase / N_OPTS) & 1) == 0};
  case_result_t r;
  run_case(s, ncase, ti, nitems, &o, &r);
  return r.cuda_err;
}

static int skip_without_gpu(void) {
  if (attnd_cuda_device_count() == 0) {
    print_message("no CUDA device: skipping\n");
    return 1;
  }
  return 0;
}

/* ATTND_GPU_TEST_ONLY=substring runs only the matrices whose name contains it
 * (for a sanitizer pass over one path). */
static int unselected(const char *name) {
  const char *e = getenv("ATTND_GPU_TEST_ONLY");
  return e && *e && !strstr(name, e);
}

static int pairwise_mode(void) {
  const char *e = getenv("ATTND_GPU_TEST_PAIRWISE");
  return e && *e && strcmp(e, "0") != 0;
}

static void record(attnd_kv_type_t kv, double err) {
  if (err > g_max_err[kv])
    g_max_err[kv] = err;
  g_cases[kv]++;
}

static void test_matrix(void **state) {
  (void)state;
  if (skip_without_gpu() || unselected("test_matrix")) {
    skip();
    return;
  }
  static const int dims[3] = {64, 128, 256}, bss[4] = {16, 32, 64, 128}, groups[4] = {1, 4, 8, 16};
  static const int masks[5] = {ATTND_MASK_CAUSAL, ATTND_MASK_INTERVALS, ATTND_MASK_SLIDING,
                               ATTND_MASK_PREFIX_LM, ATTND_MASK_FULL};
  const int pw = pairwise_mode();
  int ncase = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int bi = 0; bi < 4; bi++) {
        if (pw && (di + bi + kv) % 12 != 0 && !(bi == kv % 4 && di == kv % 3))
          continue;
        const int G = groups[(bi + di + kv) % 4];
        attnd_kshape_t s = {.kv_heads = G >= 8 ? 1 : 2,
                            .head_dim = dims[di],
                            .block_size = bss[bi],
                            .dtype = (ncase & 1) ? ATTND_DT_FP16 : ATTND_DT_BF16,
                            .kv = (attnd_kv_type_t)kv,
                            .rope = (attnd_rope_t)(ncase % 3),
                            .rope_theta = 10000.0 + 490000.0 * (ncase & 1),
                            .rotary_dim = (ncase % 4 == 3) ? dims[di] / 2 : 0};
        s.q_heads = s.kv_heads * G;
        s.softmax_scale = (float)(1.0 / sqrt((double)s.head_dim));
        const int mk = masks[ncase % 5];
        tcase_item_t ti[4] = {
            /* decode over a long history */
            {.hist = 200 + harness_rnd(600), .n = 1, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL},
            /* prefill chunk under a mask */
            {.hist = harness_rnd(150),
             .n = 20 + harness_rnd(110),
             .has_q = 1,
             .mask_kind = mk,
             .mask_param = 1 + harness_rnd(90),
             .causal = harness_rnd(2)},
            /* write-only */
            {.hist = harness_rnd(50), .n = 1 + harness_rnd(30), .has_q = 0},
            /* rewrite of the last two tokens plus one more */
            {.hist = 40 + harness_rnd(100), .n = 3, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL},
        };
        for (int i = 0; i < 4; i++)
          ti[i].start = ti[i].hist;
        ti[3].start = ti[3].hist - 2;
        if (mk == ATTND_MASK_PREFIX_LM)
          ti[1].mask_param = harness_rnd(ti[1].hist + ti[1].n + 1);
        const double e =
            case_run(&s, ncase, ti, 4, ncase % 4 == 2, ncase % 3 != 1, (ncase >> 1) & 1);
        record(s.kv, e);
        ncase++;
      }
}

/* Decode-shaped batches: every item's query vectors (n x group) fit one
 * 16-row tile, the path of the split-KV decode kernels (for int8/fp8 static
 * and dynamic caches at D <= 128, the direct kernel of decode_direct.cuh).
 * Every cache type x head dim x block size, GQA 1/4/8/16, one to 8/G or 16/G
 * tokens per item under every mask kind (intervals with fully masked rows), with and
 * without split-KV, fp32 and 16-bit outputs, per-channel and per-head scales. */
static void test_decode_matrix(void **state) {
  (void)state;
  if (skip_without_gpu() || unselected("test_decode_matrix")) {
    skip();
    return;
  }
  static const int dims[3] = {64, 128, 256}, bss[4] = {16, 32, 64, 128}, groups[4] = {1, 4, 8, 16};
  static const int masks[5] = {ATTND_MASK_CAUSAL, ATTND_MASK_INTERVALS, ATTND_MASK_SLIDING,
                               ATTND_MASK_PREFIX_LM, ATTND_MASK_FULL};
  const int pw = pairwise_mode(), fused0 = g_step_fused;
  int ncase = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int bi = 0; bi < 4; bi++) {
        if (pw && (di + bi + kv) % 12 != 1 && !(bi == (kv + 1) % 4 && di == (kv + 1) % 3))
          continue;
        const int G = groups[(bi + 2 * di + kv + ncase / 7) % 4];
        attnd_kshape_t s = {.kv_heads = G >= 8 ? 1 : 2,
                            .head_dim = dims[di],
                            .block_size = bss[bi],
                            .dtype = (ncase & 2) ? ATTND_DT_FP16 : ATTND_DT_BF16,
                            .kv = (attnd_kv_type_t)kv,
                            .rope = (attnd_rope_t)(ncase % 3),
                            .rope_theta = 10000.0,
                            .rotary_dim = 0};
        s.q_heads = s.kv_heads * G;
        s.softmax_scale = (float)(1.0 / sqrt((double)s.head_dim));
        /* Half the cases keep every item at <= 8 query vectors (the transposed
         * form of the direct decode kernel), the others go up to 16. */
        const int nmax = ((ncase >> 1) & 1) && G <= 8 ? 8 / G : 16 / G;
        tcase_item_t ti[4];
        for (int i = 0; i < 4; i++) {
          const int mk = masks[(ncase + i) % 5];
          ti[i] = (tcase_item_t){.hist = (i == 0 ? 300 : 1) + harness_rnd(i == 0 ? 700 : 200),
                                 .n = 1 + harness_rnd(nmax),
                                 .has_q = 1,
                                 .mask_kind = mk,
                                 .mask_param = 1 + harness_rnd(300),
                                 .causal = harness_rnd(2)};
          ti[i].start = ti[i].hist;
          if (mk == ATTND_MASK_PREFIX_LM)
            ti[i].mask_param = harness_rnd(ti[i].hist + ti[i].n + 1);
        }
        /* A rewrite of the last token. */
        if (ti[3].hist > 0) {
          ti[3].start = ti[3].hist - 1;
        }
        const double e =
            case_run(&s, 2000 + ncase, ti, 4, ncase % 3 == 0, ncase % 4 != 3, ncase & 1);
        record(s.kv, e);
        ncase++;
      }
  /* Half the cases step through attnd_cuda_step: its fused launch must have
   * run (not under ATTND_GPU_TEST_SM90_SCHED, where the harness runs the two
   * phases apart so that every Hopper launch takes the bits). */
  if (!pw && !getenv("ATTND_GPU_TEST_SM90_SCHED"))
    assert_true(g_step_fused > fused0);
}

/* Prefill-shaped batches, the Hopper path's cases (prefill_sm90.cuh): chunked
 * prefill of 40..199 rows over 150..649 cached keys and a prefill from position
 * 0 of 100..299 rows, under every mask (documents: whole key tiles skipped;
 * random intervals: fully masked rows), beside a decode row and a write-only
 * item. Several key tiles and query tiles per item, partial last tiles, every
 * cache type x head dim x block size, GQA 1/4/8/16, with and without split-KV. */
static void test_prefill_matrix(void **state) {
  (void)state;
  if (skip_without_gpu() || unselected("test_prefill_matrix")) {
    skip();
    return;
  }
  static const int dims[3] = {64, 128, 256}, bss[4] = {16, 32, 64, 128}, groups[4] = {1, 4, 8, 16};
  static const int masks[5] = {ATTND_MASK_CAUSAL, ATTND_MASK_INTERVALS, ATTND_MASK_SLIDING,
                               ATTND_MASK_PREFIX_LM, ATTND_MASK_FULL};
  const int pw = pairwise_mode();
  int ncase = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int bi = 0; bi < 4; bi++) {
        if (pw && (di + bi + kv) % 12 != 2 && !(bi == (kv + 2) % 4 && di == (kv + 2) % 3))
          continue;
        const int G = groups[(bi + di + 2 * kv + ncase / 5) % 4];
        attnd_kshape_t s = {.kv_heads = G >= 8 ? 1 : 2,
                            .head_dim = dims[di],
                            .block_size = bss[bi],
                            .dtype = ((ncase >> 1) & 1) ? ATTND_DT_FP16 : ATTND_DT_BF16,
                            .kv = (attnd_kv_type_t)kv,
                            .rope = (attnd_rope_t)(ncase % 3),
                            .rope_theta = 10000.0,
                            .rotary_dim = 0};
        s.q_heads = s.kv_heads * G;
        s.softmax_scale = (float)(1.0 / sqrt((double)s.head_dim));
        const int mk = masks[ncase % 5], mk2 = masks[(ncase + 2) % 5];
        tcase_item_t ti[4] = {
            {.hist = 150 + harness_rnd(500),
             .n = 40 + harness_rnd(160),
             .has_q = 1,
             .mask_kind = mk,
             .mask_param = 1 + harness_rnd(300),
             .causal = harness_rnd(2),
             .docs = harness_rnd(2)},
            {.hist = 0,
             .n = 100 + harness_rnd(200),
             .has_q = 1,
             .mask_kind = mk2,
             .mask_param = 1 + harness_rnd(200),
             .causal = harness_rnd(2),
             .docs = 1},
            {.hist = 100 + harness_rnd(300), .n = 1, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL},
            {.hist = harness_rnd(50), .n = 1 + harness_rnd(30), .has_q = 0},
        };
        for (int i = 0; i < 4; i++) {
          ti[i].start = ti[i].hist;
          if (ti[i].mask_kind == ATTND_MASK_PREFIX_LM)
            ti[i].mask_param = harness_rnd(ti[i].hist + ti[i].n + 1);
        }
        const double e =
            case_run(&s, 3000 + ncase, ti, 4, ncase % 3 == 0, ncase % 4 != 1, ncase & 1);
        record(s.kv, e);
        ncase++;
      }
}

/* New tokens over long cached histories of the int8/fp8 and dynamic types,
 * with the zero-point pointers NULL (only int4 has them), decode and a short
 * prefill chunk: the split-KV path with many parts. */
static void test_long_history(void **state) {
  (void)state;
  if (skip_without_gpu() || unselected("test_long_history")) {
    skip();
    return;
  }
  static const attnd_kv_type_t kvs[5] = {ATTND_KV_INT8, ATTND_KV_FP8, ATTND_KV_INT8_DYNAMIC,
                                         ATTND_KV_FP8_DYNAMIC, ATTND_KV_BF16};
  const int n = pairwise_mode() ? 2 : 5;
  for (int c = 0; c < n; c++) {
    attnd_kshape_t s = {.q_heads = 32,
                        .kv_heads = 8,
                        .head_dim = 128,
                        .block_size = 64,
                        .dtype = ATTND_DT_BF16,
                        .kv = kvs[c],
                        .rope = ATTND_ROPE_NEOX,
                        .rope_theta = 500000.0,
                        .rotary_dim = 0};
    s.softmax_scale = (float)(1.0 / sqrt(128.0));
    tcase_item_t ti[3] = {
        {.hist = 6000 + harness_rnd(3000), .n = 1, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL},
        {.hist = 3000 + harness_rnd(3000),
         .n = 1,
         .has_q = 1,
         .mask_kind = ATTND_MASK_SLIDING,
         .mask_param = 1024},
        {.hist = 2000 + harness_rnd(1000), .n = 4, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL},
    };
    for (int i = 0; i < 3; i++)
      ti[i].start = ti[i].hist;
    record(s.kv, case_run(&s, 1000 + c, ti, 3, 0, 1, c & 1));
  }
}

/* Even decode batches that are not small ((item, kv head) pairs above the SM
 * count), every cache type: for the 1-byte types the split plan reads the
 * batch's kv_sum and runs one CTA per (item, kv head) without a merge (1 part);
 * debug 65536 (kv_sum ignored), an uneven batch, a sliding layer and the
 * 16-bit and int4 caches keep the flat split (several parts). Every run against
 * the float64 oracle, and the two plans of one batch against each other. */
static void test_even_decode(void **state) {
  (void)state;
  if (skip_without_gpu() || unselected("test_even_decode")) {
    skip();
    return;
  }
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    fail_msg("SM count: %s", cudaGetErrorString(cudaGetLastError()));
  const int KVH = 32, nitems = 8; /* 256 pairs */
  if (nitems * KVH <= sms) {
    print_message("%d SMs: every batch of 8 items is small here; skipping\n", sms);
    skip();
    return;
  }
  static const attnd_cuda_opts_t dflt = {0}, nosum = {.debug = 65536};
  const int pw = pairwise_mode();
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
    if (pw && kv != ATTND_KV_INT8_DYNAMIC && kv != ATTND_KV_BF16)
      continue;
    const int one_byte = kv == ATTND_KV_INT8 || kv == ATTND_KV_FP8 ||
                         attnd_kv_type_dynamic((attnd_kv_type_t)kv);
    for (int c = 0; c < 3; c++) { /* 0 even, 1 uneven, 2 even in a sliding layer */
      attnd_kshape_t s = {.q_heads = 4 * KVH,
                          .kv_heads = KVH,
                          .head_dim = 64,
                          .block_size = c == 1 ? 32 : 16,
                          .dtype = (kv & 1) ? ATTND_DT_FP16 : ATTND_DT_BF16,
                          .kv = (attnd_kv_type_t)kv,
                          .rope = ATTND_ROPE_NEOX,
                          .rope_theta = 10000.0,
                          .rotary_dim = 0};
      s.softmax_scale = (float)(1.0 / sqrt(64.0));
      tcase_item_t ti[8];
      for (int i = 0; i < nitems; i++) {
        /* even: 200..219 keys (>= 0.9 of the longest); uneven: 100..119 and one of
         * 240. Spans under 256 keys: the per-item plan does not split them. */
        ti[i] = (tcase_item_t){.hist = c == 1 ? (i == 3 ? 239 : 99 + harness_rnd(20))
                                              : 199 + harness_rnd(20),
                               .n = 1,
                               .has_q = 1,
                               .mask_kind = ATTND_MASK_CAUSAL};
        ti[i].start = ti[i].hist;
      }
      int parts[2];
      for (int k = 0; k < 2; k++) {
        case_opts_t o = {.out_fp32 = 1, .use_ws = 1, .opts = k ? &nosum : &dflt,
                         .window = c == 2 ? 200 : 0};
        case_result_t r;
        run_case(&s, 4000 + 8 * kv + 2 * c + k, ti, nitems, &o, &r);
        record(s.kv, r.cuda_err);
        parts[k] = r.splits;
      }
      const int want_one = one_byte && c == 0;
      if (want_one ? parts[0] != 1 : parts[0] != parts[1])
        fail_msg("kv %s case %d: %d parts by default, %d without kv_sum (want %s)",
                 attnd_kv_type_name(s.kv), c, parts[0], parts[1],
                 want_one ? "1 by default" : "the same plan");
      if (parts[1] <= 1)
        fail_msg("kv %s case %d: the plan without kv_sum did not split (%d parts): the test "
                 "compares nothing",
                 attnd_kv_type_name(s.kv), c, parts[1]);
    }
  }
}

/* Per-layer variants (docs/numerics.md): a sliding layer's window (smaller
 * than a block, than the history, larger than everything), logit soft-capping
 * (strong and Gemma-like), sink logits (moderate, huge, tiny, some items
 * without ATTND_ITEM_SINK), alone and together, over every cache type x head
 * dim, block sizes and GQA cycling, under every mask (intervals with fully
 * masked rows). Even cases are prefill-shaped batches (tiled kernel or Hopper
 * path, A/B against each other; their last 8 rows again alone through the
 * decode kernel: the prefix hit), odd cases decode batches (flat and per-item
 * split), and every other (cache type, head dim) adds a decode row over a
 * long history in a short window (the windowed split plan). The reference is the float64 one of
 * cuda_harness_ref.c. */
static void test_variants_matrix(void **state) {
  (void)state;
  if (skip_without_gpu() || unselected("test_variants_matrix")) {
    skip();
    return;
  }
  static const int dims[3] = {64, 128, 256}, bss[4] = {16, 32, 64, 128}, groups[4] = {1, 4, 8, 16};
  static const int masks[5] = {ATTND_MASK_CAUSAL, ATTND_MASK_INTERVALS, ATTND_MASK_SLIDING,
                               ATTND_MASK_PREFIX_LM, ATTND_MASK_FULL};
  const int pw = pairwise_mode();
  int ncase = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int shape = 0; shape < 2; shape++) {
        if (pw ? shape > 0 || (kv + di) % 3 != 0 : shape == 1 && (kv + di) % 2 != 0)
          continue;
        const int bi = (kv + di + shape) % 4;
        const int G = groups[(bi + di + kv + shape) % 4];
        attnd_kshape_t s = {.kv_heads = G >= 8 ? 1 : 2,
                            .head_dim = dims[di],
                            .block_size = bss[bi],
                            .dtype = (ncase >> 1) & 1 ? ATTND_DT_FP16 : ATTND_DT_BF16,
                            .kv = (attnd_kv_type_t)kv,
                            .rope = (attnd_rope_t)(ncase % 3),
                            .rope_theta = 10000.0};
        s.q_heads = s.kv_heads * G;
        s.softmax_scale = (float)(1.0 / sqrt((double)s.head_dim));
        const int v = ncase % 8; /* which variants: window bit 0, capping bit 1, sinks bit 2 */
        const int prefill = (ncase & 1) == 0, longrow = shape == 1;
        double q_mag = 0;
        if (v & 2) {
          s.softcap = (ncase / 8) % 2 ? 3.0f : 30.0f;
          q_mag = s.softcap > 10 ? 3.0 : 1.0; /* the cap bends the largest scores at either */
        }
        int window = 0;
        if (v & 1 || longrow) {
          const int w4 = (ncase / 2) % 4;
          window = w4 == 0   ? 1 + harness_rnd(s.block_size - 1) /* inside one block */
                   : w4 == 3 ? 5000                              /* larger than any history */
                             : 16 + harness_rnd(200);            /* inside the history */
        }
        float sinks[64];
        const float *sk = NULL;
        if (v & 4 || (longrow && (ncase & 2))) {
          const int kind = (ncase / 4) % 4;
          /* A huge sink leaves outputs of e^-(sink - lse) |v|: fp16 outputs hold
           * them down to e^-16 (subnormals), bf16 and fp32 far below. */
          const double huge = s.dtype == ATTND_DT_FP16 && ncase % 3 != 0 ? 9.0 : 40.0;
          for (int h = 0; h < s.q_heads; h++)
            sinks[h] = kind == 0   ? (float)(huge + harness_rnd(8))  /* huge: takes almost all */
                       : kind == 1 ? (float)(-40.0 - harness_rnd(8)) /* tiny: no effect */
                       : kind == 2
                           ? (float)(2.0 * oracle_rng_normal(&g_rng))
                           : (float)(h % 2 ? 8.0 : -3.0) * (float)oracle_rng_uniform(&g_rng);
          sk = sinks;
        }
        const int mk = masks[ncase % 5];
        tcase_item_t ti[4];
        int nitems = 4;
        if (longrow) {
          /* A decode row over a long history in a short window, and a second one
           * under a sliding mask: the split plan covers the window only. */
          ti[0] = (tcase_item_t){
              .hist = 3000 + harness_rnd(2000), .n = 1, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL};
          ti[1] = (tcase_item_t){.hist = 1500 + harness_rnd(1000),
                                 .n = 16 / G > 2 ? 2 : 1,
                                 .has_q = 1,
                                 .mask_kind = ATTND_MASK_SLIDING,
                                 .mask_param = 1 + harness_rnd(400)};
          nitems = 2;
          if (window == 0 || window == 5000)
            window = 64 + harness_rnd(400);
        } else if (prefill) {
          ti[0] = (tcase_item_t){.hist = 150 + harness_rnd(400),
                                 .n = 20 + harness_rnd(150),
                                 .has_q = 1,
                                 .mask_kind = mk,
                                 .mask_param = 1 + harness_rnd(120),
                                 .causal = harness_rnd(2),
                                 .docs = ncase % 3 == 0};
          ti[1] = (tcase_item_t){
              .hist = 0, .n = 40 + harness_rnd(100), .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL};
          ti[2] = (tcase_item_t){
              .hist = 200 + harness_rnd(300), .n = 1, .has_q = 1, .mask_kind = ATTND_MASK_CAUSAL};
          ti[3] = (tcase_item_t){.hist = harness_rnd(50), .n = 1 + harness_rnd(30), .has_q = 0};
        } else {
          const int nmax = 16 / G;
          for (int i = 0; i < 4; i++) {
            const int m = masks[(ncase + i) % 5];
            ti[i] = (tcase_item_t){.hist = (i == 0 ? 300 : 1) + harness_rnd(i == 0 ? 700 : 200),
                                   .n = 1 + harness_rnd(nmax),
                                   .has_q = 1,
                                   .mask_kind = m,
                                   .mask_param = 1 + harness_rnd(300),
                                   .causal = harness_rnd(2)};
          }
        }
        for (int i = 0; i < nitems; i++) {
          ti[i].start = ti[i].hist;
          if (ti[i].mask_kind == ATTND_MASK_PREFIX_LM)
            ti[i].mask_param = harness_rnd(ti[i].hist + ti[i].n + 1);
        }
        case_opts_t o = {.out_fp32 = ncase % 3 == 0,
                         .use_ws = ncase % 5 != 4,
                         .per_channel = (ncase >> 2) & 1,
                         .q_mag = q_mag,
                         .check_hit = 1,
                         .check_ab = 1,
                         .opts = &k_opts[ncase % 5],
                         .step = ncase & 1,
                         .window = window,
                         .sinks = sk,
                         .sink_items = ncase % 3 == 1 ? 0x5u : 0xfu};
        case_result_t r;
        run_case(&s, 4000 + ncase, ti, nitems, &o, &r);
        record(s.kv, r.cuda_err);
        ncase++;
      }
}

/* ---- the fused step (attnd_cuda_step) ----------------------------------- */

#define CKS(call)                                                                                  \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess)                                                                         \
      fail_msg("%s:%d %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_));                 \
  } while (0)

static void *dev_rand(attnd_dtype_t dt, size_t n, double mag) {
  void *h = malloc(2 * n + 16), *d = NULL;
  for (size_t i = 0; i < n; i++)
    oracle_to_dtype(dt, h, i, mag * ((double)(oracle_rng_next(&g_rng) >> 11) * 0x1p-53 * 2.0 - 1.0));
  CKS(cudaMalloc(&d, 2 * n + 16));
  CKS(cudaMemcpy(d, h, 2 * n, cudaMemcpyHostToDevice));
  free(h);
  return d;
}

static void *dev_floats(size_t n, double lo, double hi, int integer) {
  float *h = malloc(sizeof(float) * n + 16);
  void *d = NULL;
  for (size_t i = 0; i < n; i++) {
    const double u = (double)(oracle_rng_next(&g_rng) >> 11) * 0x1p-53;
    h[i] = (float)(integer ? floor(lo + u * (hi - lo)) : lo + u * (hi - lo));
  }
  CKS(cudaMalloc(&d, sizeof(float) * n + 16));
  CKS(cudaMemcpy(d, h, sizeof(float) * n, cudaMemcpyHostToDevice));
  free(h);
  return d;
}

static int bytes_equal(const void *da, const void *db, size_t n) {
  uint8_t *a = malloc(n + 1), *b = malloc(n + 1);
  CKS(cudaMemcpy(a, da, n, cudaMemcpyDeviceToHost));
  CKS(cudaMemcpy(b, db, n, cudaMemcpyDeviceToHost));
  const int eq = memcmp(a, b, n) == 0;
  free(a);
  free(b);
  return eq;
}

/* attnd_cuda_step's fused launch against attnd_cuda_write followed by
 * attnd_cuda_attend under the same launch options (a per-item plan it keeps:
 * parts merged in clusters, or one part per (item, kv head)), from the same
 * cache over histories an earlier write-only batch wrote: q (rotated in
 * place), the whole cache, out and lse must come out equal bit for bit, over
 * every cache type x head dim, GQA 1/4/8/16, block sizes 16-128, RoPE kinds,
 * partial rotary dims, split-context positions and a rewrite of an item's
 * last token. Every case must have run fused (with fuse = 1; not with 0 or -1), so a
 * fused path that stopped applying fails here. */
static void test_step_fused(void **state) {
  (void)state;
  if (skip_without_gpu() || unselected("test_step_fused")) {
    skip();
    return;
  }
  static const int dims[3] = {64, 128, 256}, bss[4] = {16, 32, 64, 128}, groups[4] = {1, 4, 8, 16};
  const int pw = pairwise_mode();
  int ncase = 0, nfused = 0;
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    for (int di = 0; di < 3; di++)
      for (int r = 0; r < 2; r++) {
        if (pw && (kv + di + r) % 3 != 0)
          continue;
        const int bi = (kv + di + 2 * r) % 4, G = groups[(kv + 2 * di + r) % 4];
        attnd_kshape_t s = {.kv_heads = G >= 8 ? 1 : 2,
                            .head_dim = dims[di],
                            .block_size = bss[bi],
                            .dtype = (ncase & 1) ? ATTND_DT_FP16 : ATTND_DT_BF16,
                            .kv = (attnd_kv_type_t)kv,
                            .rope = (attnd_rope_t)(ncase % 3),
                            .rope_theta = 10000.0,
                            .rotary_dim = ncase % 4 == 3 ? dims[di] / 2 : 0};
        s.q_heads = s.kv_heads * G;
        s.softmax_scale = (float)(1.0 / sqrt((double)s.head_dim));
        const int D = s.head_dim, KVH = s.kv_heads, QH = s.q_heads, bs = s.block_size;
        const int nitems = 1 + ncase % 3;
        attnd_kitem_t hist_items[3], items[3];
        int nblk = 0, T = 0, H = 0, maxl = 0, maxn = 0;
        int start[3], n[3];
        for (int i = 0; i < nitems; i++) {
          start[i] = 20 + harness_rnd(i == 0 ? 1200 : 400);
          n[i] = 1 + harness_rnd(16 / G);
          if (i == 1 && ncase % 2 == 0)
            start[i]--; /* a rewrite of the last cached token */
          nblk += (start[i] + n[i] + bs - 1) / bs;
        }
        int32_t *meta = malloc(sizeof(int32_t) * (nblk + 16));
        int *perm = malloc(sizeof(int) * (nblk + 1));
        for (int b = 0; b < nblk; b++)
          perm[b] = b;
        for (int b = nblk - 1; b > 0; b--) {
          const int j = harness_rnd(b + 1), t = perm[b];
          perm[b] = perm[j];
          perm[j] = t;
        }
        int moff = 0;
        for (int i = 0; i < nitems; i++) {
          const int hist = start[i] + (i == 1 && ncase % 2 == 0 ? 1 : 0);
          const int nb = (start[i] + n[i] + bs - 1) / bs;
          for (int b = 0; b < nb; b++)
            meta[moff + b] = perm[moff + b];
          hist_items[i] = (attnd_kitem_t){.start = 0, .n = hist, .q_row = -1, .kv_row = H,
                                          .mask_kind = ATTND_MASK_CAUSAL, .block_table = moff};
          items[i] = (attnd_kitem_t){.start = start[i], .n = n[i], .q_row = T, .kv_row = T,
                                     .mask_kind = (ncase + i) % 4 == 1 ? ATTND_MASK_FULL : ATTND_MASK_CAUSAL,
                                     .block_table = moff,
                                     .pos_base = ncase % 5 == 4 ? 1000 : 0};
          H += hist;
          T += n[i];
          moff += nb;
          if (start[i] + n[i] > maxl)
            maxl = start[i] + n[i];
          if (n[i] > maxn)
            maxn = n[i];
        }
        const size_t bb = attnd_kv_block_bytes(&s), cache_bytes = bb * (size_t)nblk;
        const int per_channel = kv == ATTND_KV_INT4 || (ncase & 2);
        const size_t nsc = per_channel ? (size_t)KVH * D : (size_t)KVH;
        void *d_sc[4] = {NULL, NULL, NULL, NULL};
        if (attnd_kv_type_static((attnd_kv_type_t)kv)) {
          const double lo = kv == ATTND_KV_INT4 ? 0.2 : 0.01, hi = kv == ATTND_KV_INT4 ? 0.4 : 0.03;
          d_sc[0] = dev_floats(nsc, lo, hi, 0);
          d_sc[1] = dev_floats(nsc, lo, hi, 0);
          if (kv == ATTND_KV_INT4) {
            d_sc[2] = dev_floats(nsc, 4.0, 12.0, 1);
            d_sc[3] = dev_floats(nsc, 4.0, 12.0, 1);
          }
        }
        void *d_meta = NULL, *d_hitems = NULL, *d_items = NULL, *cache[2] = {NULL, NULL};
        CKS(cudaMalloc(&d_meta, sizeof(int32_t) * (moff + 1)));
        CKS(cudaMemcpy(d_meta, meta, sizeof(int32_t) * moff, cudaMemcpyHostToDevice));
        CKS(cudaMalloc(&d_hitems, sizeof(attnd_kitem_t) * nitems));
        CKS(cudaMemcpy(d_hitems, hist_items, sizeof(attnd_kitem_t) * nitems, cudaMemcpyHostToDevice));
        CKS(cudaMalloc(&d_items, sizeof(attnd_kitem_t) * nitems));
        CKS(cudaMemcpy(d_items, items, sizeof(attnd_kitem_t) * nitems, cudaMemcpyHostToDevice));
        for (int c = 0; c < 2; c++)
          CKS(cudaMalloc(&cache[c], cache_bytes));
        CKS(cudaMemset(cache[0], 0, cache_bytes));
        /* The histories, by the write kernel. */
        void *hk = dev_rand(s.dtype, (size_t)H * KVH * D, 2.0), *hv = dev_rand(s.dtype, (size_t)H * KVH * D, 2.0);
        attnd_kbatch_t hb = {.items = d_hitems, .nitems = nitems, .meta = d_meta, .total_kv = H,
                             .max_kv_len = maxl, .max_n = maxl, .k = hk, .v = hv, .cache = cache[0],
                             .block_bytes = bb, .k_scale = d_sc[0], .v_scale = d_sc[1], .k_zero = d_sc[2],
                             .v_zero = d_sc[3], .scale_per_channel = per_channel};
        assert_int_equal(attnd_cuda_write(&s, &hb, NULL), 0);
        CKS(cudaMemcpy(cache[1], cache[0], cache_bytes, cudaMemcpyDeviceToDevice));
        void *q[2], *out[2], *lse[2];
        q[0] = dev_rand(s.dtype, (size_t)T * QH * D, 2.0);
        CKS(cudaMalloc(&q[1], 2 * (size_t)T * QH * D));
        CKS(cudaMemcpy(q[1], q[0], 2 * (size_t)T * QH * D, cudaMemcpyDeviceToDevice));
        void *k = dev_rand(s.dtype, (size_t)T * KVH * D, 2.0), *v = dev_rand(s.dtype, (size_t)T * KVH * D, 2.0);
        const int out32 = ncase % 3 == 2;
        const size_t ob = (out32 ? 4 : 2) * (size_t)T * QH * D;
        for (int c = 0; c < 2; c++) {
          CKS(cudaMalloc(&out[c], ob));
          CKS(cudaMalloc(&lse[c], sizeof(float) * T * QH));
          CKS(cudaMemset(out[c], 0xff, ob));
          CKS(cudaMemset(lse[c], 0xff, sizeof(float) * T * QH));
        }
        const size_t ws_bytes = attnd_cuda_attend_workspace(&s, T);
        void *ws = NULL;
        CKS(cudaMalloc(&ws, ws_bytes));
        /* Parts merged in clusters (2 chunks a part at least: many parts), or
         * one part per (item, kv head). */
        const attnd_cuda_opts_t o = ncase % 2 ? (attnd_cuda_opts_t){.split = 2, .min_chunks = 4096, .fuse = 1}
                                              : (attnd_cuda_opts_t){.split = 2, .min_chunks = 2, .debug = 256, .fuse = 1};
        attnd_cuda_opts_t nf = o, dflt = o;
        nf.fuse = -1;
        dflt.fuse = 0;
        attnd_kbatch_t b[2];
        for (int c = 0; c < 2; c++)
          b[c] = (attnd_kbatch_t){.items = d_items, .nitems = nitems, .meta = d_meta, .total_q = T,
                                  .total_kv = T, .max_kv_len = maxl, .max_n = maxn, .q = q[c], .k = k,
                                  .v = v, .out = out[c], .out_fp32 = out32, .lse = lse[c],
                                  .cache = cache[c], .block_bytes = bb, .k_scale = d_sc[0],
                                  .v_scale = d_sc[1], .k_zero = d_sc[2], .v_zero = d_sc[3],
                                  .scale_per_channel = per_channel};
        assert_int_equal(attnd_cuda_step_fused(&s, &b[1], ws_bytes, &nf), 0);
        assert_int_equal(attnd_cuda_step_fused(&s, &b[1], ws_bytes, &dflt), 0); /* off by default */
        const int fused = attnd_cuda_step_fused(&s, &b[1], ws_bytes, &o);
        if (!fused)
          fail_msg("step case %d kv %s D %d G %d bs %d: not fused", ncase, attnd_kv_type_name(kv), D, G, bs);
        nfused += fused;
        int rc = attnd_cuda_write_opts(&s, &b[0], NULL, &o);
        if (rc == 0)
          rc = attnd_cuda_attend_opts(&s, &b[0], ws, ws_bytes, NULL, &o);
        assert_int_equal(rc, 0);
        CKS(cudaDeviceSynchronize());
        rc = attnd_cuda_step_opts(&s, &b[1], ws, ws_bytes, NULL, &o);
        if (rc)
          fail_msg("step case %d: %d %s", ncase, rc, attnd_cuda_last_error());
        CKS(cudaDeviceSynchronize());
        const char *what = !bytes_equal(cache[0], cache[1], cache_bytes)          ? "cache"
                           : !bytes_equal(q[0], q[1], 2 * (size_t)T * QH * D)      ? "q"
                           : !bytes_equal(out[0], out[1], ob)                       ? "out"
                           : !bytes_equal(lse[0], lse[1], sizeof(float) * T * QH) ? "lse"
                                                                                    : NULL;
        if (what)
          fail_msg("step case %d kv %s D %d G %d bs %d rope %d items %d (%s): fused %s differs from write + "
                   "attend",
                   ncase, attnd_kv_type_name(kv), D, G, bs, (int)s.rope, nitems,
                   ncase % 2 ? "one part" : "clusters", what);
        for (int c = 0; c < 2; c++) {
          cudaFree(cache[c]);
          cudaFree(q[c]);
          cudaFree(out[c]);
          cudaFree(lse[c]);
        }
        for (int j = 0; j < 4; j++)
          cudaFree(d_sc[j]);
        cudaFree(ws);
        cudaFree(k);
        cudaFree(v);
        cudaFree(hk);
        cudaFree(hv);
        cudaFree(d_meta);
        cudaFree(d_hitems);
        cudaFree(d_items);
        free(meta);
        free(perm);
        ncase++;
      }
  print_message("fused step vs write + attend: %d cases, %d fused, every byte equal\n", ncase, nfused);
}

static void test_report(void **state) {
  (void)state;
  if (skip_without_gpu()) {
    skip();
    return;
  }
  const double hit_rms = g_hit_checks ? sqrt(g_hit_sumsq / g_hit_checks) : 0;
  print_message("prefix hit (last 8 rows alone) vs full step, fp32 out: %d checks, rel L2 rms "
                "%.3e (bound %.0e), worst %.3e (bound %.0e), %d over %.0e\n",
                g_hit_checks, hit_rms, ATTND_TOL_HIT_RMS, g_hit_worst, ATTND_TOL_HIT_ITEM,
                g_hit_over, ATTND_TOL_HIT_RMS);
  assert_true(hit_rms <= ATTND_TOL_HIT_RMS);
  /* A matrix that asked for prefix-hit checks must have made some (one
   * matrix alone, e.g. long histories with bf16 outputs, may ask for none). */
  if (g_hit_asked > 0)
    assert_true(g_hit_checks > 0);
  print_message("steps through attnd_cuda_step: %d cases, %d of them fused\n", g_step_cases, g_step_fused);
  print_message("Hopper path vs tiled kernel (A/B, fp32 out): %d batches, %d with differing bits, "
                "worst rel L2 %.3e (items >= 8 rows, bound %.1e), %.3e (shorter, bound %.0e)\n",
                g_ab_checks, g_ab_differ, g_ab_worst, ATTND_TOL_AB_ROWS, g_ab_worst_short,
                ATTND_TOL_AB_SHORT);
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++)
    print_message("kv %-13s cases %3d  max rel L2 %.3e  (bound %.0e)  prefix hit worst %.3e\n",
                  attnd_kv_type_name(kv), g_cases[kv], g_max_err[kv], harness_bound(kv),
                  g_hit_worst_kv[kv]);
}

static void test_device_count(void **state) {
  (void)state;
  /* Must never fail or crash, GPU or not. */
  int n = attnd_cuda_device_count();
  assert_true(n >= 0);
  if (n > 0) {
    char name[128];
    uint64_t mem = 0;
    int ma = 0, mi = 0;
    assert_int_equal(attnd_cuda_device_info(0, name, sizeof name, &mem, &ma, &mi), 0);
    print_message("device 0: %s, %.1f GiB, cc %d.%d\n", name, mem / 1073741824.0, ma, mi);
    assert_true(mem > 0);
  }
}

int main(void) {
  const char *seed = getenv("ATTND_TEST_SEED");
  g_rng = seed ? strtoull(seed, NULL, 0) : ((uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull) | 1;
  print_message("seed %llu\n", (unsigned long long)g_rng);
  /* ctest reads exit code 77 as "skipped" (SKIP_RETURN_CODE in tests/gpu.cmake),
   * so a machine without a GPU reports these tests as not run, never as passed. */
  if (attnd_cuda_device_count() == 0) {
    print_message("no CUDA device: GPU kernel tests skipped\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_device_count), cmocka_unit_test(test_prefill_matrix),
      cmocka_unit_test(test_matrix),       cmocka_unit_test(test_decode_matrix),
      cmocka_unit_test(test_long_history), cmocka_unit_test(test_even_decode),
      cmocka_unit_test(test_variants_matrix), cmocka_unit_test(test_step_fused),
      cmocka_unit_test(test_report),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* cuda_harness.h: one GPU kernel case against the float64 oracle (and,
 * optionally, the CPU backend on the same inputs), shared by the GPU tests.
 *
 * A case is one shape and one batch of items over sessions whose cached
 * histories were written by an earlier write-only batch. Every session gets
 * its own blocks in shuffled physical order; the cache and the outputs are
 * poisoned first (0xff: NaN in every float format). */
#ifndef ATTND_CUDA_HARNESS_H
#define ATTND_CUDA_HARNESS_H

#include <stdint.h>

#include "attnd_cuda.h"
#include "attnd_kernels.h"
#include "oracle.h"
#include "tolerance.h"

typedef struct {
  int start, n, has_q, mask_kind, mask_param, causal, hist;
  int docs; /* INTERVALS: a document mask (whole key tiles masked) instead of random intervals */
} tcase_item_t;

/* How the inputs are drawn. */
typedef enum {
  CASE_NORMAL = 0,     /* q ~ 1.5 N(0,1), k and v ~ N(0,1) (times the magnitudes) */
  CASE_ZERO_POINT = 1, /* a third of the V rows all zero, a third near the zero point
                        * (int4: within half a step of z; others: near 0), a quarter of
                        * the K rows zero; int4 zero points integers, halves and random */
  CASE_SINKS = 2,      /* the first 4 tokens of every session: K along a direction q
                        * shares (they take about half the attention), V all zero */
} case_style_t;

typedef struct {
  int out_fp32, use_ws, per_channel;
  int style;      /* case_style_t */
  double q_mag;   /* scale of q (0: 1) */
  double k_mag;   /* scale of k (0: 1) */
  double v_mag;   /* scale of v (0: 1) */
  int near_bound; /* 1: |q| and |k| elements in [0.25, 1] * q_mag / k_mag, random sign */
  int cpu;        /* also run the CPU backend and record its errors */
  int check_hit;  /* with out_fp32: the last 8 rows alone must equal the full step */
#ifndef ATTND_HARNESS_OLD_API
  int check_ab; /* also run the batch on the tiled kernel (opts with sm90 = 1) and require
                 * the Hopper path (prefill_sm90.cuh) to agree with it (fp32 outputs, lse) */
  const attnd_cuda_opts_t *opts; /* launch options (NULL: defaults) */
  /* Per-layer variants (docs/numerics.md); soft-capping is the shape's softcap. */
  int window;          /* attnd_kbatch_t.window: 0 full layer, else the sliding window */
  const float *sinks;  /* host [q_heads] sink logits, or NULL */
  unsigned sink_items; /* bit i: item i has ATTND_ITEM_SINK */
  int step;            /* both phases through attnd_cuda_step (the fused launch where
                        * it applies) instead of attnd_cuda_write, then attend */
#endif
} case_opts_t;

typedef struct {
  double cuda_err, cpu_err; /* worst rel L2 over the case's items */
  double worst_ratio;       /* worst over items of cuda_err / (2 cpu_err + floor): > 1 fails */
  int splits;               /* attnd_cuda_attend_splits of the step */
  int fused;                /* the step ran as the fused launch (case_opts_t.step) */
} case_result_t;

extern uint64_t g_rng;
extern double g_hit_worst;
extern double g_hit_sumsq; /* prefix hit: sum of squared errors, checks over the RMS bound */
extern int g_hit_over;
extern double g_hit_worst_kv[ATTND_KV_COUNT_]; /* per cache type */
extern int g_hit_checks;
extern int g_hit_asked; /* cases that asked for the prefix-hit check (out_fp32, check_hit) */
/* The A/B of check_ab: batches compared, those whose outputs differed in some bit
 * (0 would mean both runs took the same kernel), worst rel L2 for items of >= 8
 * rows (ATTND_TOL_AB_ROWS) and of fewer (ATTND_TOL_AB_SHORT). */
extern int g_ab_checks, g_ab_differ;
extern int g_step_cases, g_step_fused; /* cases run with case_opts_t.step, and those fused */
extern double g_ab_worst, g_ab_worst_short;

int harness_rnd(int n);
double harness_bound(attnd_kv_type_t kv); /* the error bound of a cache type (docs/numerics.md) */
/* Floor of the CPU-ratio check: the roundings of P and of the outputs the
 * CUDA kernels make and the CPU backend does not (P in bf16 or fp16), for
 * an input style (CASE_*). */
double harness_ratio_floor(attnd_dtype_t dt, attnd_kv_type_t kv, int style);

/* The float64 reference of the per-layer variants (window, soft-capping,
 * sinks: docs/numerics.md) over an oracle session, as oracle_session_attend
 * with those steps added (cuda_harness_ref.c); sinks NULL: none; novis
 * [n][q_heads]: 1 for rows with no visible key. */
void harness_ref_attend(const attnd_kshape_t *s, const oracle_session_t *o, int start, int n,
                        const void *q, int mask_kind, int mask_param, int causal,
                        const int32_t *intervals, int window, const float *sinks, double *out,
                        double *lse, int *novis);

/* Mask inputs for one item (meta intervals, [4][kv_len]): random column
 * intervals plus rows [start+1, start+3) masked from every key; or documents
 * of 30..249 tokens (whole key tiles masked). */
void harness_make_intervals(int32_t *iv, int kv_len, int start, int n);
void harness_make_documents(int32_t *iv, int kv_len);
/* One item's lse against the reference's rl, and rows with no visible key
 * (novis, NULL: those of lse -inf) all zero in got (rows of [q_heads][D] in odt). */
void harness_check_lse(int ncase, const attnd_kshape_t *s, int i, int rows, const float *lse,
                       const double *rl, const int *novis, attnd_dtype_t odt, const void *got,
                       const char *who);

/* Runs one case; fails the test (cmocka fail_msg) on a bound, lse, masked-row
 * or prefix-hit violation. The CPU ratio is only recorded in res. */
void run_case(const attnd_kshape_t *s, int ncase, const tcase_item_t *ti, int nitems,
              const case_opts_t *o, case_result_t *res);

#endif /* ATTND_CUDA_HARNESS_H */

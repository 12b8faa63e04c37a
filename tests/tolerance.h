/* tolerance.h: the one table of the numbers tests judge results by.
 *
 * Every C test that compares outputs includes this; the Python end-to-end
 * tests read the same numbers from tests/e2e/tolerance.py, which parses this
 * file, so a bound is changed in one place. What the bounds mean (relative L2
 * of an item's output against the float64 oracle, per cache type) is the
 * numerics contract, docs/numerics.md. Keep each #define on one line: the
 * Python side reads `#define ATTND_TOL_<NAME> <number>`. */
#ifndef ATTND_TESTS_TOLERANCE_H
#define ATTND_TESTS_TOLERANCE_H

#include "attnd_kernels.h"

/* Relative L2 of an item's output against the oracle, by cache type. */
#define ATTND_TOL_BF16 1e-2
#define ATTND_TOL_FP16 1e-2
#define ATTND_TOL_INT8 3e-2
#define ATTND_TOL_FP8 3e-2
#define ATTND_TOL_INT8_DYNAMIC 2e-2
#define ATTND_TOL_FP8_DYNAMIC 2e-2
#define ATTND_TOL_INT4 1e-1

/* A prefix hit against the same steps computed cold (fp32 outputs): only the
 * order of accumulation may differ. */
#define ATTND_TOL_PREFIX_HIT 1e-3
/* The Hopper prefill path against the tiled kernel over the same cache, fp32
 * outputs (tests/cuda_harness.c check_ab): one numerics contract, but the two
 * sum S in other orders, so a P at a bf16 rounding boundary can round the
 * other way in one of them, moving a row by ~2^-9 of that key's share. Items
 * of 8 rows and more average such flips out; measured worst over thousands
 * of batches 1.17e-4 (a sliding-window item: few keys per row), while a real
 * fault (a tile masked or skipped wrongly, a stage read early) is >= 1e-2.
 * Items of fewer rows (decode rows riding in a prefill batch): the short bound. */
#define ATTND_TOL_AB_ROWS 2.5e-4
#define ATTND_TOL_AB_SHORT 1e-3
/* The CUDA kernels' prefix hit (the last 8 rows of an item run alone: the
 * decode kernel) against the same rows of the full step (the Hopper path or
 * the tiled kernel), fp32 outputs: the same flips as ATTND_TOL_AB_ROWS, felt
 * more at GQA 1, where the 8 rows are only 8 query vectors a kv head (measured
 * worst over many seeds 1.8e-4, D 256 GQA 1, against typical 1e-7 to 6e-5).
 * Each check within ATTND_TOL_HIT_ITEM, the root mean square of every check of
 * a run within ATTND_TOL_HIT_RMS (docs/numerics.md section 7). */
#define ATTND_TOL_HIT_ITEM 5e-4
#define ATTND_TOL_HIT_RMS 1e-4
/* The CUDA backend against the CPU backend on the same jobs: outputs
 * (relative L2); their log-sum-exp: ATTND_TOL_CUDA_LSE_ABS below. */
#define ATTND_TOL_BACKENDS 1e-2
/* The CUDA kernels' lse is the log of the sum their output was normalized by,
 * the sum of P as rounded to the P.V operand type (docs/numerics.md, "Which
 * sum lse is the log of"): within one unit roundoff of bf16 (2^-8, the
 * coarser of the two P types) of the unrounded sum's log, which is what the
 * CPU backend writes. Per element: |cuda - cpu| <= this + 1e-4 (1 + |cpu|);
 * two CUDA kernels that round P against different running maxima: twice it. */
#define ATTND_TOL_CUDA_LSE_ABS 0.00390625
/* The engine's log-sum-exp against the oracle: |got - ref| <= tol * (1 + |ref|). */
#define ATTND_TOL_ENGINE_LSE 2e-2
/* The CPU kernels' log-sum-exp against the oracle: |got - ref| <= abs + rel * |ref|. */
#define ATTND_TOL_KERNEL_LSE_ABS 2e-3
#define ATTND_TOL_KERNEL_LSE_REL 1e-4
/* A static-scale cache (int8, fp8) end to end with scales set through the
 * RPC, against numpy over the unquantized k and v. */
#define ATTND_TOL_STATIC_SCALES_E2E 5e-2

/* The bound of a cache type (attnd_kv_type_t). */
static inline double attnd_tol_rel_l2(attnd_kv_type_t kv) {
  static const double bound[ATTND_KV_COUNT_] = {
      [ATTND_KV_BF16] = ATTND_TOL_BF16,
      [ATTND_KV_FP16] = ATTND_TOL_FP16,
      [ATTND_KV_INT8] = ATTND_TOL_INT8,
      [ATTND_KV_FP8] = ATTND_TOL_FP8,
      [ATTND_KV_INT8_DYNAMIC] = ATTND_TOL_INT8_DYNAMIC,
      [ATTND_KV_FP8_DYNAMIC] = ATTND_TOL_FP8_DYNAMIC,
      [ATTND_KV_INT4] = ATTND_TOL_INT4,
  };
  return (int)kv >= 0 && kv < ATTND_KV_COUNT_ ? bound[kv] : 0.0;
}

#endif /* ATTND_TESTS_TOLERANCE_H */

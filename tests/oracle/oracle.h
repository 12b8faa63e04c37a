/* oracle.h: the independent float64 reference for attention (docs/numerics.md).
 *
 * Dense and unpaged on purpose: it shares no code with kernels/cpu or
 * kernels/cuda (it includes attnd_kernels.h for the shape and enum types only),
 * so a bug in a backend's paging, quantization or softmax cannot hide by being
 * repeated here. Everything is plain loops in double, except the few steps the
 * numerics contract defines in fp32 (quantizer divisions, RoPE angles and
 * rotation), which are done in fp32 exactly as the contract says.
 */
#ifndef ATTND_ORACLE_H
#define ATTND_ORACLE_H

#include <stddef.h>
#include <stdint.h>

#include "attnd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Conversions (round-to-nearest-even; fp8 = e4m3 with saturation to +-448).
 * dt is bf16, fp16, fp32 or int32 (int32 stores round to nearest, ties even). */
double oracle_from_dtype(attnd_dtype_t dt, const void *p, size_t i); /* element i */
void oracle_to_dtype(attnd_dtype_t dt, void *p, size_t i, double x); /* RNE store */
double oracle_round(attnd_dtype_t dt, double x);                     /* bf16/fp16/fp32 rounding */
double oracle_fp8_e4m3(float x);                                     /* e4m3 satfinite value of x */

/* RoPE of one head vector at absolute position pos, result rounded to s->dtype.
 * in and out are [head_dim] and may not alias. rope NONE: out = in rounded. */
void oracle_rope(const attnd_kshape_t *s, int pos, const double *in, double *out);

/* Static quantization of one layer (NULL where the type has none).
 * int8/fp8: scales [kv_heads] or, with per_channel, [kv_heads][head_dim].
 * int4: scales and zero points always [kv_heads][head_dim]. */
typedef struct {
  const float *k_scale, *v_scale, *k_zero, *v_zero;
  int per_channel;
} oracle_scales_t;

/* A dense reference session for ONE layer: what the cache holds, dequantized. */
typedef struct {
  int len, cap;
  double *K, *V; /* [cap][kv_heads][head_dim] */
} oracle_session_t;

void oracle_session_init(oracle_session_t *o, const attnd_kshape_t *s, int cap);
void oracle_session_free(oracle_session_t *o);

/* Writes n tokens at start (start <= len): RoPE on k, rounding to dtype, quantize
 * and dequantize per the cache type; k, v raw [n][kv_heads][head_dim] in s->dtype.
 * Sets len = start + n. */
void oracle_session_write(const attnd_kshape_t *s, oracle_session_t *o, int start, int n,
                          const void *k, const void *v, const oracle_scales_t *sc);

/* Attention of n query rows at positions start..start+n-1 over keys 0..start+n-1:
 * q raw [n][q_heads][head_dim] in s->dtype (RoPE applied here), mask as in
 * attnd_kitem_t (kind, param, causal, intervals = int32 [4][start+n] or NULL).
 * out [n][q_heads][head_dim] double; lse [n][q_heads] (may be NULL);
 * fully masked rows give 0 and lse = -INFINITY. */
void oracle_session_attend(const attnd_kshape_t *s, const oracle_session_t *o, int start, int n,
                           const void *q, int mask_kind, int mask_param, int causal,
                           const int32_t *intervals, double *out, double *lse);

/* Relative L2 error ||got - ref|| / ||ref|| of count elements (got in dtype dt).
 * When ||ref|| == 0 it returns the absolute ||got||, so an expected all-zero
 * output only passes when the kernel wrote zeros. NaN in got gives NaN. */
double oracle_rel_l2(const double *ref, attnd_dtype_t dt, const void *got, size_t count);

/* Random helpers for tests (deterministic per seed, seeds drawn fresh by tests). */
uint64_t oracle_rng_next(uint64_t *state);
double oracle_rng_normal(uint64_t *state);

/* ---- additions beyond the fixed API ------------------------------------- */

/* 1 when key j is visible to the query at absolute position p (kv_len keys). */
int oracle_mask_visible(int mask_kind, int mask_param, int causal, const int32_t *intervals,
                        int kv_len, int p, int j);

/* The stored form of one (token, kv head) row x (already rotated and rounded
 * to the activation dtype), as the cache must hold it:
 *   bf16/fp16: q[d] = x[d];  int8/int8_dynamic: the integer;  fp8/fp8_dynamic:
 *   the e4m3 value;  int4: the unsigned nibble u in 0..15.
 * *dyn_scale gets the per-token fp32 scale of dynamic types (0 otherwise).
 * is_v picks v_scale/v_zero. Lets a test check a backend's cache bytes exactly. */
void oracle_quantize_row(const attnd_kshape_t *s, const oracle_scales_t *sc, int kv_head, int is_v,
                         const double *x, double *q, float *dyn_scale);

/* oracle_session_attend with the per-layer variants of docs/numerics.md:
 * scores are capped by s->softcap (> 0: c * tanh(s / c)) before masking (that
 * applies to oracle_session_attend too); window > 0 additionally hides keys
 * j <= p - window; sinks non-NULL ([q_heads], the item's ATTND_ITEM_SINK set)
 * adds exp(sink) to each row's denominator, lse = log(sum + exp(sink)), and a
 * row with no visible key gives out 0, lse = sink. */
void oracle_session_attend_ex(const attnd_kshape_t *s, const oracle_session_t *o, int start, int n,
                              const void *q, int mask_kind, int mask_param, int causal,
                              const int32_t *intervals, int window, const float *sinks, double *out,
                              double *lse);

/* oracle_mask_visible intersected with a layer window (0: none). */
int oracle_visible(int mask_kind, int mask_param, int causal, const int32_t *intervals, int window,
                   int kv_len, int p, int j);

/* Merges nparts partial attentions of one (row, head) by their lse (the
 * split-context combine): out = sum_i exp(lse_i - L) out_i, L = logsumexp.
 * outs[i] are [D]; all parts -inf give out 0, lse -inf. */
void oracle_merge_lse(int nparts, const double *const *outs, const double *lses, int D, double *out,
                      double *lse);

/* Uniform double in [0, 1). */
double oracle_rng_uniform(uint64_t *state);

#ifdef __cplusplus
}
#endif

#endif /* ATTND_ORACLE_H */

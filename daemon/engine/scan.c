/* scan.c: the finiteness and magnitude scan of a step's q, k and v
 * (internal.h, docs/numerics.md §6).
 *
 * A Step must be rejected before it changes anything when q, k or v hold a
 * NaN, an infinity, or a finite value past the bounds up to which the
 * kernels compute faithfully: |q|, |k| <= 2^48 and |v| <= 2^100 (scores and
 * sums then stay far inside fp32), and a k or v that must fit fp16 (an fp16
 * cache, or fp16 activations: rotated q and k are rounded to fp16, outputs
 * too) within 65504, or 65504/sqrt(2) for q and k under RoPE (a rotation
 * grows a component by up to sqrt(2)), or 65376 for v kept in a bf16 cache
 * for fp16 outputs (larger values round up to 65536). Both checks are one
 * pass: the largest
 * magnitude of each chunk, as its bit pattern, against the bound's pattern
 * (NaN and infinity order above every finite value).
 *
 * The pass is linear in the tensors (about 20 ms for the 100 MB of an
 * 8k-token prefill), so a large step's scan runs on the worker pool behind
 * the admission queue (queue.c) while a small one runs on the loop thread
 * during the step's checks (step.c). Either way it reads only the request
 * and the model shape and records the first row of each tensor past its
 * bound; the admission maps that row to the item it falls in. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The CPU kernels read 16-bit elements through typed pointers, so tensor
 * bytes decoded in place from a frame (any offset) are copied once when they
 * are not 2-byte aligned, for a backend that needs it (backend.h
 * any_alignment; the CUDA backend copies them into staging with memcpy and
 * needs no copy). Returns p or the copy, stored in *keep. */
static const uint8_t *aligned_data(const uint8_t *p, size_t n, void **keep) {
  if (((uintptr_t)p & 1) == 0)
    return p;
  *keep = aligned_alloc(64, (n + 63) & ~(size_t)63);
  if (!*keep)
    abort();
  memcpy(*keep, p, n);
  return *keep;
}

double attnd_scan_value(attnd_dtype_t dt, uint32_t bits) {
  if (dt == ATTND_DT_BF16) {
    uint32_t u = bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  int e = (int)((bits >> 10) & 31), m = (int)(bits & 1023);
  if (e == 31)
    return m ? NAN : INFINITY;
  return e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
}

/* The largest finite magnitude of dt that is <= lim, as its pattern. */
static uint32_t bound_bits(attnd_dtype_t dt, double lim) {
  uint32_t lo = 0, hi = dt == ATTND_DT_BF16 ? 0x7f7fu : 0x7bffu;
  if (attnd_scan_value(dt, hi) <= lim)
    return hi;
  while (lo + 1 < hi) { /* value(lo) <= lim < value(hi) */
    uint32_t mid = (lo + hi) / 2;
    if (attnd_scan_value(dt, mid) <= lim)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

#define FP16_MAX 65504.0
#define FP16_MAX_ROTATED 46318.6 /* 65504 / sqrt(2), rounded down */
/* The largest fp16 value a bf16 cache stores within fp16's range: 65408 and
 * above round (to even) to 65536, which the fp16 output cannot hold. */
#define FP16_MAX_VIA_BF16 65376.0

static void set_bound(attnd_scan_bound_t *b, attnd_dtype_t dt, double lim, const char *name) {
  b->value = lim;
  b->name = name;
  b->bits = bound_bits(dt, lim);
}

void attnd_scan_bounds(const attnd_kshape_t *sh, attnd_scan_bound_t *q, attnd_scan_bound_t *k,
                       attnd_scan_bound_t *v) {
  int rope = sh->rope != ATTND_ROPE_NONE;
  int fp16_act = sh->dtype == ATTND_DT_FP16, fp16_cache = sh->kv == ATTND_KV_FP16;
  attnd_dtype_t dt = sh->dtype;
  if (fp16_act && rope)
    set_bound(q, dt, FP16_MAX_ROTATED, "65504/sqrt(2) (fp16 after RoPE)");
  else
    set_bound(q, dt, 0x1p48, "2^48");
  if ((fp16_act || fp16_cache) && rope)
    set_bound(k, dt, FP16_MAX_ROTATED, "65504/sqrt(2) (fp16 after RoPE)");
  else if (fp16_act || fp16_cache)
    set_bound(k, dt, FP16_MAX, "65504 (fp16)");
  else
    set_bound(k, dt, 0x1p48, "2^48");
  if (fp16_act && sh->kv == ATTND_KV_BF16)
    set_bound(v, dt, FP16_MAX_VIA_BF16, "65376 (within fp16 once rounded to bf16)");
  else if (fp16_act || fp16_cache)
    set_bound(v, dt, FP16_MAX, "65504 (fp16)");
  else
    set_bound(v, dt, 0x1p100, "2^100");
}

/* Rows per attnd_cpu_max_abs_bits call of the scan: large enough that the
 * vectorized pass dominates, small enough that a bad row is found by
 * rescanning one chunk row by row. */
#define SCAN_CHUNK_ELEMS (64u * 1024u)

/* The first row (of row_elems 16-bit elements) of n bytes holding a
 * magnitude past lim (its pattern in *bits), or SIZE_MAX. Elements past the
 * last whole row count as one more row. */
static size_t first_bad_row(attnd_dtype_t dt, const uint8_t *p, size_t n, size_t row_elems,
                            uint32_t lim, uint32_t *bits) {
  size_t elems = n / 2, rows = (elems + row_elems - 1) / row_elems;
  size_t per = SCAN_CHUNK_ELEMS / row_elems ? SCAN_CHUNK_ELEMS / row_elems : 1;
  for (size_t r0 = 0; r0 < rows; r0 += per) {
    size_t r1 = r0 + per < rows ? r0 + per : rows;
    size_t e1 = r1 * row_elems < elems ? r1 * row_elems : elems;
    if (attnd_cpu_max_abs_bits(dt, p + r0 * row_elems * 2, e1 - r0 * row_elems) <= lim)
      continue;
    for (size_t r = r0; r < r1; r++) {
      size_t a = r * row_elems, b = a + row_elems < elems ? a + row_elems : elems;
      uint32_t m = attnd_cpu_max_abs_bits(dt, p + a * 2, b - a);
      if (m > lim) {
        *bits = m;
        return r;
      }
    }
  }
  return SIZE_MAX;
}

/* first_bad_row over odd-aligned bytes without copying them whole: each
 * chunk of whole rows goes through one bounce buffer of at most
 * SCAN_CHUNK_ELEMS elements (it stays in cache; the copy costs a fraction of
 * the scan's memory traffic). */
static size_t first_bad_row_bounced(attnd_dtype_t dt, const uint8_t *p, size_t n, size_t row_elems,
                                    uint32_t lim, uint32_t *bits) {
  size_t per = SCAN_CHUNK_ELEMS / row_elems ? SCAN_CHUNK_ELEMS / row_elems : 1;
  size_t chunk = per * row_elems * 2;
  uint8_t *tmp = malloc(chunk < n ? chunk : n);
  if (!tmp)
    abort();
  size_t bad = SIZE_MAX;
  for (size_t off = 0, r0 = 0; off < n; off += chunk, r0 += per) {
    size_t len = n - off < chunk ? n - off : chunk;
    memcpy(tmp, p + off, len);
    size_t r = first_bad_row(dt, tmp, len, row_elems, lim, bits);
    if (r != SIZE_MAX) {
      bad = r0 + r;
      break;
    }
  }
  free(tmp);
  return bad;
}

/* Scans one tensor of the activation dtype: an aligned view (copying it if
 * needed, unless any_alignment) and its first row past the bound. A tensor
 * that is absent, empty or of another dtype is left unscanned: the step
 * fails on its shape first. */
static void scan_tensor(attnd_dtype_t dt, int any_alignment, const attnd_tensor_t *t,
                        size_t row_elems, const attnd_scan_bound_t *bound, const uint8_t **view,
                        void **buf, size_t *bad, uint32_t *bits) {
  *view = NULL;
  *buf = NULL;
  *bad = SIZE_MAX;
  *bits = 0;
  if (!t->present || !t->data || t->nbytes == 0 || t->dtype != dt)
    return;
  if (any_alignment && ((uintptr_t)t->data & 1)) {
    *view = t->data;
    *bad = first_bad_row_bounced(dt, *view, t->nbytes, row_elems, bound->bits, bits);
    return;
  }
  *view = aligned_data(t->data, t->nbytes, buf);
  *bad = first_bad_row(dt, *view, t->nbytes, row_elems, bound->bits, bits);
}

void attnd_scan_step(const attnd_kshape_t *sh, const attnd_step_req_t *req, int any_alignment,
                     attnd_scan_t *sc) {
  size_t kvrow = (size_t)sh->kv_heads * sh->head_dim, qrow = (size_t)sh->q_heads * sh->head_dim;
  attnd_scan_bound_t bq, bk, bv;
  attnd_scan_bounds(sh, &bq, &bk, &bv);
  const uint64_t t0 = attnd_engine_now_us();
  scan_tensor(sh->dtype, any_alignment, &req->q, qrow, &bq, &sc->q, &sc->qbuf, &sc->bad_q,
              &sc->bits_q);
  scan_tensor(sh->dtype, any_alignment, &req->k, kvrow, &bk, &sc->k, &sc->kbuf, &sc->bad_k,
              &sc->bits_k);
  scan_tensor(sh->dtype, any_alignment, &req->v, kvrow, &bv, &sc->v, &sc->vbuf, &sc->bad_v,
              &sc->bits_v);
  sc->us = (uint32_t)(attnd_engine_now_us() - t0);
}

void attnd_scan_any(attnd_engine_t *e, const attnd_step_req_t *req, attnd_scan_t *sc) {
  if (req->device)
    attnd_scan_device(e, req, sc);
  else
    attnd_scan_step(&e->shape, req, e->be->any_alignment, sc);
}

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

/* Rows of a tensor part i of n scans: [r0, r1) of rows (elements past the
 * last whole row count as one more row, the last part's). */
static void part_rows(size_t elems, size_t row_elems, int i, int n, size_t *r0, size_t *r1) {
  size_t rows = (elems + row_elems - 1) / row_elems;
  *r0 = rows * (size_t)i / (size_t)n;
  *r1 = rows * (size_t)(i + 1) / (size_t)n;
}

/* One tensor of the activation dtype: the view the backend reads and, when
 * that view is a copy, its memory (the copy itself is made by the parts). A
 * tensor that is absent, empty or of another dtype is left unscanned: the
 * step fails on its shape first. The CPU kernels read 16-bit elements
 * through typed pointers, so tensor bytes decoded in place from a frame (any
 * offset) are copied once when they are not 2-byte aligned, for a backend
 * that needs it (backend.h any_alignment; the CUDA backend copies them into
 * staging with memcpy, or reads them by DMA, and needs no copy). */
static void begin_tensor(attnd_engine_t *e, attnd_dtype_t dt, int any_alignment,
                         const attnd_tensor_t *t, const uint8_t **view, void **buf) {
  *view = NULL;
  *buf = NULL;
  if (!t->present || !t->data || t->nbytes == 0 || t->dtype != dt)
    return;
  if (any_alignment || ((uintptr_t)t->data & 1) == 0) {
    *view = t->data;
    return;
  }
  /* The engine's: a large copy reuses memory already faulted in (hostmem.c). */
  if (e)
    *buf = attnd_engine_host_plain(e, t->nbytes);
  else if (!(*buf = aligned_alloc(64, (t->nbytes + 63) & ~(size_t)63)))
    abort();
  *view = *buf;
}

/* Part i of n of one tensor: its rows, chunk by chunk, copied into the view
 * first when the view is a copy (the scan then reads the chunk from cache:
 * one pass over memory, not two), or through a bounce buffer of one chunk
 * when they are odd-aligned and the backend reads them in place. */
static void part_tensor(attnd_dtype_t dt, const attnd_tensor_t *t, const uint8_t *view,
                        size_t row_elems, uint32_t lim, int i, int n, uint8_t *bounce, size_t *bad,
                        uint32_t *bits) {
  *bad = SIZE_MAX;
  *bits = 0;
  if (!view)
    return;
  size_t elems = t->nbytes / 2, r0, r1;
  part_rows(elems, row_elems, i, n, &r0, &r1);
  size_t per = SCAN_CHUNK_ELEMS / row_elems ? SCAN_CHUNK_ELEMS / row_elems : 1;
  int copy = view != t->data, odd = ((uintptr_t)view & 1) != 0;
  for (size_t a = r0; a < r1; a += per) {
    size_t b = a + per < r1 ? a + per : r1;
    size_t off = a * row_elems * 2;
    size_t end = b * row_elems * 2 < t->nbytes ? b * row_elems * 2 : t->nbytes;
    const uint8_t *p = view + off;
    if (copy)
      memcpy((uint8_t *)view + off, t->data + off, end - off);
    if (*bad != SIZE_MAX) /* only the copy is left to finish */
      continue;
    if (odd && !copy) {
      memcpy(bounce, t->data + off, end - off);
      p = bounce;
    }
    size_t r = first_bad_row(dt, p, end - off, row_elems, lim, bits);
    if (r != SIZE_MAX) {
      *bad = a + r;
      if (!copy)
        return;
    }
  }
}

void attnd_scan_begin(attnd_engine_t *e, const attnd_kshape_t *sh, const attnd_step_req_t *req,
                      int any_alignment, attnd_scan_t *sc) {
  memset(sc, 0, sizeof(*sc));
  begin_tensor(e, sh->dtype, any_alignment, &req->q, &sc->q, &sc->qbuf);
  begin_tensor(e, sh->dtype, any_alignment, &req->k, &sc->k, &sc->kbuf);
  begin_tensor(e, sh->dtype, any_alignment, &req->v, &sc->v, &sc->vbuf);
}

void attnd_scan_part(const attnd_kshape_t *sh, const attnd_step_req_t *req, const attnd_scan_t *sc,
                     int i, int n, attnd_scan_part_t *out) {
  size_t kvrow = (size_t)sh->kv_heads * sh->head_dim, qrow = (size_t)sh->q_heads * sh->head_dim;
  attnd_scan_bound_t bq, bk, bv;
  attnd_scan_bounds(sh, &bq, &bk, &bv);
  out->t0_us = attnd_engine_now_us();
  uint8_t *bounce = NULL;
  if ((sc->q && ((uintptr_t)sc->q & 1)) || (sc->k && ((uintptr_t)sc->k & 1)) ||
      (sc->v && ((uintptr_t)sc->v & 1)))
    if (!(bounce = malloc(SCAN_CHUNK_ELEMS * 2 + 2 * qrow + 2 * kvrow)))
      abort();
  part_tensor(sh->dtype, &req->q, sc->q, qrow, bq.bits, i, n, bounce, &out->bad[0], &out->bits[0]);
  part_tensor(sh->dtype, &req->k, sc->k, kvrow, bk.bits, i, n, bounce, &out->bad[1], &out->bits[1]);
  part_tensor(sh->dtype, &req->v, sc->v, kvrow, bv.bits, i, n, bounce, &out->bad[2], &out->bits[2]);
  free(bounce);
  out->t1_us = attnd_engine_now_us();
}

void attnd_scan_end(attnd_scan_t *sc, const attnd_scan_part_t *parts, int n) {
  size_t *bad[3] = {&sc->bad_q, &sc->bad_k, &sc->bad_v};
  uint32_t *bits[3] = {&sc->bits_q, &sc->bits_k, &sc->bits_v};
  uint64_t t0 = UINT64_MAX, t1 = 0;
  for (int t = 0; t < 3; t++)
    *bad[t] = SIZE_MAX;
  /* Parts hold ascending rows: the first part with a bad row has the first. */
  for (int i = 0; i < n; i++) {
    for (int t = 0; t < 3; t++)
      if (*bad[t] == SIZE_MAX && parts[i].bad[t] != SIZE_MAX) {
        *bad[t] = parts[i].bad[t];
        *bits[t] = parts[i].bits[t];
      }
    t0 = parts[i].t0_us < t0 ? parts[i].t0_us : t0;
    t1 = parts[i].t1_us > t1 ? parts[i].t1_us : t1;
  }
  sc->us = n > 0 ? (uint32_t)(t1 - t0) : 0;
}

int attnd_scan_nparts(const attnd_step_req_t *req, int max_parts, size_t part_bytes) {
  size_t bytes = (req->q.present ? req->q.nbytes : 0) + (req->k.present ? req->k.nbytes : 0) +
                 (req->v.present ? req->v.nbytes : 0);
  size_t n = bytes / part_bytes;
  if (req->device || n < 1)
    return 1;
  return n < (size_t)max_parts ? (int)n : max_parts;
}

void attnd_scan_step(const attnd_kshape_t *sh, const attnd_step_req_t *req, int any_alignment,
                     attnd_scan_t *sc) {
  attnd_scan_part_t part;
  attnd_scan_begin(NULL, sh, req, any_alignment, sc);
  attnd_scan_part(sh, req, sc, 0, 1, &part);
  attnd_scan_end(sc, &part, 1);
}

/* scan.c: the finiteness scan of a step's q, k and v (internal.h).
 *
 * A Step must be rejected before it changes anything when q, k or v hold a
 * NaN or an infinity. The scan is a linear pass over the tensors (about 20 ms
 * for the 100 MB of an 8k-token prefill), so a large step's scan runs on the
 * worker pool behind the admission queue (queue.c) while a small one runs on
 * the loop thread during the step's checks (step.c). Either way it reads only
 * the request and records the first non-finite row of each tensor; the
 * admission maps that row to the item it falls in. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The kernels read 16-bit elements through typed pointers, so tensor bytes
 * decoded in place from a frame (any offset) are copied once when they are
 * not 2-byte aligned. Returns p or the copy, stored in *keep. */
static const uint8_t *aligned_data(const uint8_t *p, size_t n, void **keep) {
  if (((uintptr_t)p & 1) == 0)
    return p;
  *keep = aligned_alloc(64, (n + 63) & ~(size_t)63);
  if (!*keep)
    abort();
  memcpy(*keep, p, n);
  return *keep;
}

/* Rows per attnd_cpu_all_finite call of the scan: large enough that the
 * vectorized pass dominates, small enough that a bad row is found by
 * rescanning one chunk row by row. */
#define SCAN_CHUNK_ELEMS (64u * 1024u)

/* The first row (of row_elems 16-bit elements) of n bytes holding a
 * non-finite value, or SIZE_MAX. Elements past the last whole row count as
 * one more row. */
static size_t first_bad_row(attnd_dtype_t dt, const uint8_t *p, size_t n, size_t row_elems) {
  size_t elems = n / 2, rows = (elems + row_elems - 1) / row_elems;
  size_t per = SCAN_CHUNK_ELEMS / row_elems ? SCAN_CHUNK_ELEMS / row_elems : 1;
  for (size_t r0 = 0; r0 < rows; r0 += per) {
    size_t r1 = r0 + per < rows ? r0 + per : rows;
    size_t e1 = r1 * row_elems < elems ? r1 * row_elems : elems;
    if (attnd_cpu_all_finite(dt, p + r0 * row_elems * 2, e1 - r0 * row_elems))
      continue;
    for (size_t r = r0; r < r1; r++) {
      size_t a = r * row_elems, b = a + row_elems < elems ? a + row_elems : elems;
      if (!attnd_cpu_all_finite(dt, p + a * 2, b - a))
        return r;
    }
  }
  return SIZE_MAX;
}

/* Scans one tensor of the activation dtype: an aligned view (copying it if
 * needed) and its first non-finite row. A tensor that is absent, empty or of
 * another dtype is left unscanned: the step fails on its shape first. */
static void scan_tensor(attnd_dtype_t dt, const attnd_tensor_t *t, size_t row_elems,
                        const uint8_t **view, void **buf, size_t *bad) {
  *view = NULL;
  *buf = NULL;
  *bad = SIZE_MAX;
  if (!t->present || !t->data || t->nbytes == 0 || t->dtype != dt)
    return;
  *view = aligned_data(t->data, t->nbytes, buf);
  *bad = first_bad_row(dt, *view, t->nbytes, row_elems);
}

void attnd_scan_step(const attnd_kshape_t *sh, const attnd_step_req_t *req, attnd_scan_t *sc) {
  size_t kvrow = (size_t)sh->kv_heads * sh->head_dim, qrow = (size_t)sh->q_heads * sh->head_dim;
  scan_tensor(sh->dtype, &req->q, qrow, &sc->q, &sc->qbuf, &sc->bad_q);
  scan_tensor(sh->dtype, &req->k, kvrow, &sc->k, &sc->kbuf, &sc->bad_k);
  scan_tensor(sh->dtype, &req->v, kvrow, &sc->v, &sc->vbuf, &sc->bad_v);
}

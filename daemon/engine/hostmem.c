/* hostmem.c: host memory for frames and step outputs (engine.h
 * attnd_engine_host_alloc), with the large plain buffers kept for reuse.
 *
 * A large step's request frame is read from the socket into its own buffer
 * and its output written from another; fresh buffers of that size are mapped
 * anew by malloc each time, and reading into pages not yet faulted in costs
 * as much as the copy out of the socket (a 48 MiB frame over a Unix socket:
 * ~25 ms into fresh pages, ~12 ms into faulted ones on the development host,
 * bench/RESULTS.md). So freed plain buffers of at least HOSTMEM_MIN bytes are
 * kept, up to ATTND_HOSTMEM_SLOTS of them and max_bytes in all (256 MiB, or
 * twice --max-frame when that is more: a largest step's frame and output;
 * at most 1/8 of the host's memory), and handed out again for a request of
 * between half their size and their size.
 * Kept buffers are malloc's, so whoever frees a plain buffer with free()
 * stays right; only frees through attnd_engine_host_free feed the cache. */
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define HOSTMEM_MIN ((size_t)1 << 20)
#define HOSTMEM_FLOOR ((size_t)256 << 20)

void attnd_hostmem_init(attnd_hostmem_t *h, uint64_t max_frame) {
  memset(h, 0, sizeof(*h));
  if (uv_mutex_init(&h->mu) != 0)
    abort();
  uint64_t want = 2 * max_frame > HOSTMEM_FLOOR ? 2 * max_frame : HOSTMEM_FLOOR;
  uint64_t mem = uv_get_total_memory() / 8;
  if (mem && want > mem)
    want = mem > HOSTMEM_FLOOR ? mem : HOSTMEM_FLOOR;
  h->max_bytes = (size_t)want;
}

void attnd_hostmem_free(attnd_hostmem_t *h) {
  for (int i = 0; i < ATTND_HOSTMEM_SLOTS; i++)
    free(h->p[i]);
  memset(h->p, 0, sizeof(h->p));
  h->bytes = 0;
  uv_mutex_destroy(&h->mu);
}

/* The smallest kept buffer of len bytes or more, not twice as large. */
static void *take(attnd_hostmem_t *h, size_t len) {
  int best = -1;
  uv_mutex_lock(&h->mu);
  for (int i = 0; i < ATTND_HOSTMEM_SLOTS; i++)
    if (h->p[i] && h->cap[i] >= len && h->cap[i] / 2 <= len &&
        (best < 0 || h->cap[i] < h->cap[best]))
      best = i;
  void *p = NULL;
  if (best >= 0) {
    p = h->p[best];
    h->p[best] = NULL;
    h->bytes -= h->cap[best];
  }
  uv_mutex_unlock(&h->mu);
  return p;
}

/* Keeps p when there is room; returns 0 when it did, else p is the caller's to free. */
static int keep(attnd_hostmem_t *h, void *p) {
  size_t cap = malloc_usable_size(p);
  if (cap < HOSTMEM_MIN || ((uintptr_t)p & 63) != 0)
    return -1;
  int kept = -1;
  uv_mutex_lock(&h->mu);
  for (int i = 0; i < ATTND_HOSTMEM_SLOTS && h->bytes + cap <= h->max_bytes; i++)
    if (!h->p[i]) {
      h->p[i] = p;
      h->cap[i] = cap;
      h->bytes += cap;
      kept = 0;
      break;
    }
  uv_mutex_unlock(&h->mu);
  return kept;
}

void *attnd_engine_host_plain(attnd_engine_t *e, size_t len) {
  void *p = len >= HOSTMEM_MIN ? take(&e->hm, len) : NULL;
  if (!p && !(p = aligned_alloc(64, (len + 63) & ~(size_t)63)))
    abort();
  return p;
}

void *attnd_engine_host_alloc(attnd_engine_t *e, size_t len, int *pinned) {
  *pinned = 0;
  if (e->be->ops->host_alloc) {
    void *p = e->be->ops->host_alloc(e->be, len);
    if (p) {
      *pinned = 1;
      return p;
    }
  }
  if (len >= HOSTMEM_MIN) {
    void *p = take(&e->hm, len);
    if (p)
      return p;
  }
  /* Outputs keep the alignment the kernels' vector stores like. */
  return aligned_alloc(64, (len + 63) & ~(size_t)63);
}

void attnd_engine_host_free(attnd_engine_t *e, void *p, int pinned) {
  if (!p)
    return;
  if (pinned)
    e->be->ops->host_free(e->be, p);
  else if (keep(&e->hm, p) != 0)
    free(p);
}

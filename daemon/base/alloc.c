/* alloc.c: the allocation wrapper for small bookkeeping (base.h). */
#include <stdlib.h>

#include "internal.h"

static void *checked(void *p, size_t n) {
  if (!p) {
    ATTND_LOGE("oom", "bytes=%zu", n);
    abort();
  }
  return p;
}

void *attnd_xmalloc(size_t n) {
  return checked(malloc(n ? n : 1), n);
}

void *attnd_xcalloc(size_t n, size_t size) {
  return checked(calloc(n ? n : 1, size ? size : 1), n * size);
}

void *attnd_xrealloc(void *p, size_t n) {
  return checked(realloc(p, n ? n : 1), n);
}

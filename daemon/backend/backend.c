/* backend.c: what both backends share (backend.h). */
#include <string.h>

#include "internal.h"

void attnd_backend_opts_defaults(attnd_backend_opts_t *o) {
  memset(o, 0, sizeof(*o));
  o->cuda_hostfn_min = (uint64_t)1 << 20; /* about 100 us of memcpy */
}

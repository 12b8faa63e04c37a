/* backend.c: what both backends share (backend.h). */
#include <string.h>

#include "internal.h"

int attnd_backend_job_large(const attnd_job_t *job, uint64_t chunk_keys) {
  if (!chunk_keys || job->kind != ATTND_JOB_STEP)
    return 0;
  const attnd_kbatch_t *b = &job->batch;
  if (b->total_kv > ATTND_BACKEND_WRITE_ROWS)
    return 1;
  uint64_t work = 0;
  for (int i = 0; i < b->nitems; i++)
    if (b->items[i].q_row >= 0)
      work += (uint64_t)b->items[i].n * (uint64_t)(b->items[i].start + b->items[i].n);
  return work > chunk_keys;
}

void attnd_backend_opts_defaults(attnd_backend_opts_t *o) {
  memset(o, 0, sizeof(*o));
  o->cuda_hostfn_min = (uint64_t)1 << 20; /* about 100 us of memcpy */
  o->chunk_keys = (uint64_t)1 << 14;      /* --engine-chunk-keys */
}

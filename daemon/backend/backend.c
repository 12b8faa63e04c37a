/* backend.c: what both backends share (backend.h). */
#include <stdint.h>
#include <string.h>

#include "attnd_kernels.h"
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
  o->cuda_hostfn_min = (uint64_t)64 << 10; /* about 6 us of memcpy (bench/RESULTS.md) */
  o->chunk_keys = (uint64_t)1 << 14;      /* --engine-chunk-keys */
  o->cuda_graph_replay = 1;               /* --cuda-graph-replay */
}

void attnd_backend_check_host(attnd_job_t *job) {
  for (int i = 0; i < 3; i++) {
    const uint8_t *p = job->check.p[i];
    size_t re = job->check.row_elems[i];
    job->check.bad[i] = SIZE_MAX;
    job->check.bits[i] = 0;
    for (size_t r = 0; p && r < job->check.rows[i]; r++) {
      uint32_t m = attnd_cpu_max_abs_bits(ATTND_DT_BF16, p + r * re * 2, re);
      if (m > job->check.bound[i]) {
        job->check.bad[i] = r;
        job->check.bits[i] = m;
        break;
      }
    }
  }
}

/* cpu.c: the CPU backend (backend.h) on libuv's worker pool.
 *
 * A STEP job runs in two phases, each split into nparts uv_queue_work
 * requests (one per core): attnd_cpu_write for every part, then, once all of
 * them are back on the loop, attnd_cpu_attend for every part. The loop thread
 * only counts completions; no math runs on it. Jobs of one layer form a FIFO
 * and only its head runs, so a layer's jobs never overlap and each sees the
 * writes of the ones before it; different layers run concurrently. COPY jobs
 * memcpy whole blocks (the canonical layout makes a block one byte range);
 * SCALES jobs copy the layer's static scales, in the same FIFO.
 *
 * The pool's size is the daemon's --worker-threads (main.c sets it before
 * libuv first uses the pool); more parts than workers is still correct. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct run_s run_t;

/* The test hook of backend.h. */
int attnd_backend_cpu_fail_next = 0;

typedef struct {
  uv_work_t w;
  run_t *run;
  int part;
  int rc;
} part_t;

typedef struct {
  int present, per_channel;
  float *ks, *vs, *kz, *vz;
} cpu_scales_t;

typedef struct {
  run_t *head, *tail;
} layer_q_t;

typedef struct cpu_backend_s cpu_backend_t;

struct run_s {
  cpu_backend_t *be;
  attnd_job_t *job;
  run_t *next;
  int phase; /* 0: write, 1: attend, 2: copy, 3: scales */
  int nparts;
  int remaining;
  int rc;
  int inject; /* attnd_backend_cpu_fail_next was set when this job started */
  part_t *parts;
};

struct cpu_backend_s {
  attnd_backend_t base;
  uv_loop_t *loop;
  uint8_t **cache; /* [layers] */
  int nparts;
  cpu_scales_t *sc; /* [layers] */
  layer_q_t *lq;    /* [layers] */
  int inflight;
};

static void run_start(run_t *r);

/* A SCALES job: the layer's copy of its static scales. Runs on a worker once
 * the layer's earlier jobs are done and before its later ones start (the
 * layer's FIFO), so no kernel reads the scales while they change. */
static void apply_scales(cpu_backend_t *be, const attnd_job_t *job) {
  cpu_scales_t *sc = &be->sc[job->layer];
  const attnd_kshape_t *s = &be->base.shape;
  size_t n = (size_t)s->kv_heads * (job->per_channel ? (size_t)s->head_dim : 1);
  memcpy(sc->ks, job->k_scale, n * sizeof(float));
  memcpy(sc->vs, job->v_scale, n * sizeof(float));
  if (job->k_zero && sc->kz)
    memcpy(sc->kz, job->k_zero, n * sizeof(float));
  if (job->v_zero && sc->vz)
    memcpy(sc->vz, job->v_zero, n * sizeof(float));
  sc->per_channel = job->per_channel;
  sc->present = 1;
}

static void part_work(uv_work_t *w) {
  part_t *p = (part_t *)w;
  run_t *r = p->run;
  attnd_job_t *job = r->job;
  const attnd_kshape_t *s = &r->be->base.shape;
  if (r->phase == 0)
    p->rc = attnd_cpu_write(s, &job->batch, p->part, r->nparts);
  else if (r->phase == 1)
    p->rc = attnd_cpu_attend(s, &job->batch, p->part, r->nparts);
  else if (r->phase == 3) {
    apply_scales(r->be, job);
    p->rc = 0;
  } else {
    size_t bb = r->be->base.block_bytes;
    uint8_t *base = r->be->cache[job->layer];
    for (int i = 0; i < job->ncopies; i++)
      memcpy(base + (size_t)job->copies[2 * i + 1] * bb, base + (size_t)job->copies[2 * i] * bb,
             bb);
    p->rc = 0;
  }
}

static void run_finish(run_t *r) {
  cpu_backend_t *be = r->be;
  attnd_job_t *job = r->job;
  layer_q_t *q = &be->lq[job->layer];
  job->t_end_us = attnd_backend_now_us();
  job->status = r->rc;
  if (r->rc)
    snprintf(job->message, sizeof(job->message), "cpu backend: %s", attnd_strerror(r->rc));
  /* Pop before the callback so a job submitted from it queues behind. */
  q->head = r->next;
  if (!q->head)
    q->tail = NULL;
  be->inflight--;
  free(r->parts);
  free(r);
  if (q->head)
    run_start(q->head);
  job->done_cb(job);
}

static void submit_phase(run_t *r);

static void part_done(uv_work_t *w, int status) {
  part_t *p = (part_t *)w;
  run_t *r = p->run;
  if (status != 0 && !r->rc)
    r->rc = ATTND_EINTERNAL;
  if (p->rc != 0 && !r->rc)
    r->rc = attnd_err_from_kernel(p->rc);
  if (r->inject && !r->rc)
    r->rc = ATTND_EABORTED;
  if (--r->remaining > 0)
    return;
  /* Attention only after every part of the write phase is back, so every
   * new token is in the cache before any row reads it. */
  if (r->phase == 0 && !r->rc && r->job->batch.total_q > 0) {
    r->phase = 1;
    submit_phase(r);
    return;
  }
  run_finish(r);
}

static void submit_phase(run_t *r) {
  r->remaining = r->nparts;
  for (int i = 0; i < r->nparts; i++) {
    part_t *p = &r->parts[i];
    memset(p, 0, sizeof(*p));
    p->run = r;
    p->part = i;
    if (uv_queue_work(r->be->loop, &p->w, part_work, part_done) != 0) {
      /* Cannot happen with valid arguments; account the part as failed. */
      r->rc = ATTND_EINTERNAL;
      if (--r->remaining == 0)
        run_finish(r);
      return;
    }
  }
}

static void run_start(run_t *r) {
  attnd_job_t *job = r->job;
  cpu_backend_t *be = r->be;
  job->t_start_us = attnd_backend_now_us();
  if (job->kind == ATTND_JOB_COPY || job->kind == ATTND_JOB_SCALES) {
    r->phase = job->kind == ATTND_JOB_COPY ? 2 : 3;
    r->nparts = 1;
  } else {
    attnd_kbatch_t *b = &job->batch;
    cpu_scales_t *sc = &be->sc[job->layer];
    b->cache = be->cache[job->layer];
    b->block_bytes = be->base.block_bytes;
    b->k_scale = b->v_scale = b->k_zero = b->v_zero = NULL;
    b->scale_per_channel = 0;
    if (attnd_kv_type_static(be->base.shape.kv)) {
      if (!sc->present) {
        r->rc = ATTND_EPRECOND;
        run_finish(r);
        return;
      }
      b->k_scale = sc->ks;
      b->v_scale = sc->vs;
      b->scale_per_channel = sc->per_channel;
      if (be->base.shape.kv == ATTND_KV_INT4) {
        b->k_zero = sc->kz;
        b->v_zero = sc->vz;
      }
    }
    r->phase = 0;
    r->nparts = be->nparts;
    r->inject = attnd_backend_cpu_fail_next;
    attnd_backend_cpu_fail_next = 0;
  }
  submit_phase(r);
}

static int cpu_submit(attnd_backend_t *base, attnd_job_t *job) {
  cpu_backend_t *be = (cpu_backend_t *)base;
  if (job->layer < 0 || job->layer >= base->layers)
    return ATTND_EINVAL;
  run_t *r = calloc(1, sizeof(*r));
  if (!r)
    return ATTND_ENOMEM;
  r->parts = calloc((size_t)be->nparts, sizeof(part_t));
  if (!r->parts) {
    free(r);
    return ATTND_ENOMEM;
  }
  r->be = be;
  r->job = job;
  job->status = 0;
  job->message[0] = 0;
  job->t_submit_us = attnd_backend_now_us();
  job->t_start_us = job->t_end_us = 0;
  be->inflight++;
  layer_q_t *q = &be->lq[job->layer];
  if (q->tail) {
    q->tail->next = r;
    q->tail = r;
    return 0;
  }
  q->head = q->tail = r;
  run_start(r);
  return 0;
}

static int cpu_inflight(attnd_backend_t *base) {
  return ((cpu_backend_t *)base)->inflight;
}

static void cpu_describe(attnd_backend_t *base, char *device, size_t len, uint64_t *mem, int *cc) {
  char model[96] = "cpu";
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (f) {
    char line[256];
    while (fgets(line, sizeof(line), f)) {
      if (strncmp(line, "model name", 10) == 0) {
        char *c = strchr(line, ':');
        if (c) {
          c++;
          while (*c == ' ')
            c++;
          c[strcspn(c, "\n")] = 0;
          snprintf(model, sizeof(model), "%s", c);
        }
        break;
      }
    }
    fclose(f);
  }
  snprintf(device, len, "%s (%d threads)", model, ((cpu_backend_t *)base)->nparts);
  *mem = uv_get_total_memory();
  *cc = 0;
}

static void cpu_destroy(attnd_backend_t *base) {
  cpu_backend_t *be = (cpu_backend_t *)base;
  for (int l = 0; l < base->layers; l++) {
    if (be->cache)
      free(be->cache[l]);
    if (be->sc) {
      free(be->sc[l].ks);
      free(be->sc[l].vs);
      free(be->sc[l].kz);
      free(be->sc[l].vz);
    }
  }
  free(be->cache);
  free(be->sc);
  free(be->lq);
  free(be);
}

static const attnd_backend_ops_t cpu_ops = {
    .name = "cpu",
    .submit = cpu_submit,
    .inflight = cpu_inflight,
    .describe = cpu_describe,
    .destroy = cpu_destroy,
};

int attnd_backend_cpu_create(attnd_backend_t **out, uv_loop_t *loop, const attnd_kshape_t *s,
                             int layers, const attnd_backend_opts_t *o, char *err, size_t errlen) {
  uint64_t kv_memory = o->kv_memory;
  int threads = o->threads;
  if (attnd_kshape_check(s) != 0 || layers <= 0) {
    snprintf(err, errlen, "unsupported model shape for the CPU kernels");
    return ATTND_EINVAL;
  }
  int cores = (int)uv_available_parallelism();
  if (cores < 1)
    cores = 1;
  if (threads <= 0)
    threads = cores;
  if (!kv_memory)
    kv_memory = 1ull << 30;
  size_t bb = attnd_kv_block_bytes(s);
  uint64_t nb = kv_memory / ((uint64_t)bb * (uint64_t)layers);
  if (nb == 0 || nb > INT32_MAX) {
    snprintf(err, errlen, "kv-memory %llu holds %llu blocks of %zu bytes x %d layers",
             (unsigned long long)kv_memory, (unsigned long long)nb, bb, layers);
    return ATTND_EINVAL;
  }
  cpu_backend_t *be = calloc(1, sizeof(*be));
  if (!be)
    return ATTND_ENOMEM;
  be->base.ops = &cpu_ops;
  be->base.shape = *s;
  be->base.layers = layers;
  be->base.num_blocks = (uint32_t)nb;
  be->base.block_bytes = bb;
  be->loop = loop;
  be->nparts = threads;
  be->cache = calloc((size_t)layers, sizeof(*be->cache));
  be->sc = calloc((size_t)layers, sizeof(*be->sc));
  be->lq = calloc((size_t)layers, sizeof(*be->lq));
  if (!be->cache || !be->sc || !be->lq)
    goto fail;
  size_t nsc = (size_t)s->kv_heads * (size_t)s->head_dim;
  for (int l = 0; l < layers; l++) {
    /* calloc: the kernel never reads a position it has not written, but
     * zeroed pages cost nothing until touched. */
    be->cache[l] = calloc((size_t)nb, bb);
    be->sc[l].ks = calloc(nsc, sizeof(float));
    be->sc[l].vs = calloc(nsc, sizeof(float));
    if (!be->cache[l] || !be->sc[l].ks || !be->sc[l].vs)
      goto fail;
    if (s->kv == ATTND_KV_INT4) {
      be->sc[l].kz = calloc(nsc, sizeof(float));
      be->sc[l].vz = calloc(nsc, sizeof(float));
      if (!be->sc[l].kz || !be->sc[l].vz)
        goto fail;
    }
  }
  *out = &be->base;
  return 0;
fail:
  cpu_destroy(&be->base);
  snprintf(err, errlen, "out of memory allocating a %llu-byte KV pool",
           (unsigned long long)(nb * bb * (uint64_t)layers));
  return ATTND_ENOMEM;
}

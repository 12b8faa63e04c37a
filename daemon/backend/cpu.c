/* cpu.c: the CPU backend (backend.h) on libuv's worker pool.
 *
 * Work. A STEP job runs in two phases: the write phase (RoPE, quantize,
 * store: attnd_cpu_write over slices of its k/v rows), then, once every write
 * task is back on the loop, the attend phase (attnd_cpu_attend_units over its
 * attention units), so every new token is in the cache before any row reads
 * it. A
 * small job splits each phase into nparts tasks, one per core. A large one
 * (attention reading more than chunk_keys keys per q head over its rows, or
 * more than ATTND_BACKEND_WRITE_ROWS new tokens) is cut into chunks instead:
 * write tasks of that many rows, attend tasks of about chunk_keys key reads
 * per q head each, cut between the kernels' units (a tile of rows for one kv
 * head), so that the result is the same bit for bit however it is cut. COPY jobs memcpy whole
 * blocks (the canonical layout makes a block one byte range), SCALES jobs copy the layer's static
 * scales: one task each. The loop thread only plans and counts tasks; no math runs on it.
 *
 * Scheduling. At most nparts tasks are out on the pool at once, and each
 * free slot takes the next task from two round-robin rings of runs that have
 * tasks left: small jobs first, except that while a large job waits, small
 * tasks take at most nparts - 1 of the slots (with one slot the two take
 * turns). So a decode step arriving
 * during a long prefill waits for at most one running chunk before it gets a
 * core (docs/sessions.md section 5), and a long step still moves beside a
 * stream of small ones.
 *
 * Order. A job the engine marks unordered (backend.h) starts at once: the
 * engine hands it over only when no unfinished job conflicts with it. Any
 * other job keeps its layer's FIFO: it starts once every earlier job of its
 * layer has finished, and the layer's later ordered jobs wait for it.
 *
 * The pool's size is the daemon's --worker-threads (main.c sets it before
 * libuv first uses the pool); more tasks than workers is still correct. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The test hook of backend.h. */
int attnd_backend_cpu_fail_next = 0;

enum { PH_WRITE = 0, PH_ATTEND = 1, PH_COPY = 2, PH_SCALES = 3, PH_CHECK = 4 };

typedef struct run_s run_t;
typedef struct cpu_backend_s cpu_backend_t;

/* One task on the pool: a part of a phase of a run. */
typedef struct task_s {
  uv_work_t w;
  run_t *run;
  int idx;
  int rc;
  struct task_s *next; /* free list */
} task_t;

typedef struct {
  int present, per_channel;
  float *ks, *vs, *kz, *vz;
  int sinks_present;
  float *sinks; /* [q_heads], the layer's sink logits (SINKS jobs) */
} cpu_scales_t;

/* A layer's jobs: how many have started and not finished, and the ordered
 * jobs waiting for them (FIFO). */
typedef struct {
  int nrun;
  run_t *whead, *wtail;
} layer_q_t;

struct run_s {
  cpu_backend_t *be;
  attnd_job_t *job;
  run_t *lnext;    /* the layer's waiting ordered jobs */
  attnd_list_t rl; /* in its ring while it has tasks to hand out */
  int phase;       /* PH_* */
  int large;       /* cut into chunks; the second ring */
  int ntasks;      /* of the phase */
  int next;        /* the next task to hand out */
  int out;         /* tasks on the pool */
  int wparts;      /* write tasks */
  int aparts;      /* attend tasks per chunk: nparts for one chunk, else 1 */
  int nchunks;
  int64_t *bounds; /* attend chunks: attention units [nchunks + 1] */
  int rc;
  int inject; /* the ATTND_CPU_FAIL_* of attnd_backend_cpu_fail_next that hit this job */
};

struct cpu_backend_s {
  attnd_backend_t base;
  uv_loop_t *loop;
  uint8_t **cache; /* [layers] */
  int nparts;
  uint64_t chunk_keys; /* 0: never cut */
  int tile_rows;       /* attnd_cpu_attend_geometry */
  int tile_units;
  cpu_scales_t *sc; /* [layers] */
  layer_q_t *lq;    /* [layers] */
  int inflight;
  attnd_list_t ring[2]; /* runs with tasks to hand out: small, large */
  int out, out_small;   /* tasks on the pool, and how many are small runs' */
  int last_large;       /* the last task handed out was a large run's */
  task_t *tasks, *free_tasks;
};

static void run_start(run_t *r);
static void pump(cpu_backend_t *be);

/* A SCALES job: the layer's copy of its static scales. Runs on a worker with
 * no step of the layer running: the engine orders it (a barrier in its
 * layer), and an ordered one waits in the layer's FIFO. */
static void apply_scales(cpu_backend_t *be, const attnd_job_t *job) {
  cpu_scales_t *sc = &be->sc[job->layer];
  const attnd_kshape_t *s = &be->base.shape;
  if (job->kind == ATTND_JOB_SINKS) { /* a SINKS job: the same order, its own copy */
    memcpy(sc->sinks, job->sinks, (size_t)s->q_heads * sizeof(float));
    sc->sinks_present = 1;
    return;
  }
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

static void task_work(uv_work_t *w) {
  task_t *t = (task_t *)w;
  run_t *r = t->run;
  attnd_job_t *job = r->job;
  const attnd_kshape_t *s = &r->be->base.shape;
  switch (r->phase) {
  case PH_WRITE:
    t->rc = attnd_cpu_write(s, &job->batch, t->idx, r->wparts);
    break;
  case PH_ATTEND: {
    int c = t->idx / r->aparts;
    t->rc = attnd_cpu_attend_units(s, &job->batch, r->bounds[c], r->bounds[c + 1],
                                   t->idx % r->aparts, r->aparts);
    break;
  }
  case PH_SCALES:
    apply_scales(r->be, job);
    t->rc = 0;
    break;
  case PH_CHECK: /* host memory standing in for a device's (tests) */
    attnd_backend_check_host(job);
    t->rc = 0;
    break;
  default: {
    size_t bb = r->be->base.block_bytes;
    uint8_t *base = r->be->cache[job->layer];
    for (int i = 0; i < job->ncopies; i++)
      memcpy(base + (size_t)job->copies[2 * i + 1] * bb, base + (size_t)job->copies[2 * i] * bb,
             bb);
    t->rc = 0;
  }
  }
}

/* The done signal (backend.h) over host memory, for the engine's tests of
 * steps by reference: word = max(word, value), as the CUDA kernel does it. */
static void raise_done(void *word, uint64_t value) {
  uint64_t *w = word, cur = __atomic_load_n(w, __ATOMIC_ACQUIRE);
  while (cur < value &&
         !__atomic_compare_exchange_n(w, &cur, value, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
  }
}

static void run_finish(run_t *r) {
  cpu_backend_t *be = r->be;
  attnd_job_t *job = r->job;
  layer_q_t *q = &be->lq[job->layer];
  job->t_end_us = attnd_backend_now_us();
  if (job->dev_timed)
    job->dev_us[ATTND_DEV_ATTEND] =
        (uint32_t)(job->t_end_us - job->t_start_us) - job->dev_us[ATTND_DEV_WRITE];
  if (!r->rc && r->inject) /* as a failed device call, or a sticky error, would */
    r->rc = r->inject == ATTND_CPU_FAIL_DEVICE ? ATTND_EDEVICE : ATTND_EINTERNAL;
  job->status = r->rc;
  if (r->rc)
    snprintf(job->message, sizeof(job->message), "cpu backend: %s", attnd_strerror(r->rc));
  else if (job->kind == ATTND_JOB_STEP && job->device_io && job->done)
    raise_done(job->done, job->done_value);
  be->inflight--;
  q->nrun--;
  free(r->bounds);
  free(r);
  /* The layer's next ordered job once nothing of the layer runs; popped
   * before the callback so that a job submitted from it queues behind. */
  if (q->nrun == 0 && q->whead) {
    run_t *n = q->whead;
    q->whead = n->lnext;
    if (!q->whead)
      q->wtail = NULL;
    run_start(n);
  }
  job->done_cb(job);
}

/* The tasks of a phase go into the run's ring. */
static void phase_begin(run_t *r, int phase, int ntasks) {
  r->phase = phase;
  r->ntasks = ntasks;
  r->next = 0;
  attnd_list_insert_tail(&r->be->ring[r->large], &r->rl);
}

/* Chunk bounds of the attend phase, in the kernels' units (a row tile's kv
 * heads and q-head groups): each chunk reads about chunk_keys keys per q head
 * (a unit of a tile with rn rows seeing `keys` keys weighs rn * keys times
 * its share of the q heads; causal masks see up to the tile's last row).
 * O(tiles), on the loop thread, when the phase begins. */
static void plan_chunks(run_t *r) {
  const attnd_kbatch_t *b = &r->job->batch;
  cpu_backend_t *be = r->be;
  int cap = 8, n = 0, rt = be->tile_rows, tu = be->tile_units;
  r->bounds = attnd_xcalloc((size_t)cap + 1, sizeof(int64_t));
  uint64_t acc = 0;
  int64_t u = 0;
  for (int i = 0; i < b->nitems; i++) {
    const attnd_kitem_t *it = &b->items[i];
    if (it->q_row < 0)
      continue;
    int64_t kv_len = (int64_t)it->start + it->n;
    int causal = it->mask_kind == ATTND_MASK_CAUSAL || it->mask_kind == ATTND_MASK_SLIDING ||
                 (it->mask_kind == ATTND_MASK_INTERVALS && it->causal);
    for (int r0 = 0; r0 < it->n; r0 += rt) {
      int rn = it->n - r0 < rt ? it->n - r0 : rt;
      int64_t keys = causal ? (int64_t)it->start + r0 + rn : kv_len;
      if (it->mask_kind == ATTND_MASK_SLIDING && keys > (int64_t)it->mask_param + rn)
        keys = (int64_t)it->mask_param + rn;
      uint64_t w = (uint64_t)(rn * keys) / (uint64_t)tu + 1; /* one unit's share */
      for (int k = 0; k < tu; k++, u++) {
        if (acc > 0 && acc + w > be->chunk_keys) {
          if (n + 1 >= cap) {
            cap *= 2;
            r->bounds = attnd_xrealloc(r->bounds, ((size_t)cap + 1) * sizeof(int64_t));
          }
          r->bounds[++n] = u;
          acc = 0;
        }
        acc += w;
      }
    }
  }
  r->bounds[0] = 0;
  r->bounds[++n] = u;
  r->nchunks = n;
}

static void phase_done(run_t *r) {
  attnd_job_t *job = r->job;
  if (r->phase == PH_WRITE && job->kind == ATTND_JOB_STEP) {
    /* The step trace (backend.h): write until now, attend until the end. */
    job->dev_us[ATTND_DEV_WRITE] = (uint32_t)(attnd_backend_now_us() - job->t_start_us);
    job->dev_timed = 1;
  }
  if (r->phase == PH_WRITE && !r->rc && job->batch.total_q > 0) {
    if (r->large) {
      plan_chunks(r);
      r->aparts = r->nchunks == 1 ? r->be->nparts : 1;
    } else {
      r->bounds = attnd_xcalloc(2, sizeof(int64_t));
      r->bounds[1] = INT64_MAX; /* every unit */
      r->nchunks = 1;
      r->aparts = r->be->nparts;
    }
    phase_begin(r, PH_ATTEND, r->nchunks * r->aparts);
    return;
  }
  run_finish(r);
}

static void task_done(uv_work_t *w, int status) {
  task_t *t = (task_t *)w;
  run_t *r = t->run;
  cpu_backend_t *be = r->be;
  if (status != 0 && !r->rc)
    r->rc = ATTND_EINTERNAL;
  if (t->rc != 0 && !r->rc)
    r->rc = attnd_err_from_kernel(t->rc);
  t->next = be->free_tasks;
  be->free_tasks = t;
  be->out--;
  if (!r->large)
    be->out_small--;
  r->out--;
  if (r->next == r->ntasks && r->out == 0)
    phase_done(r);
  pump(be);
}

/* The run whose task goes next: small ones first, but while a large one
 * waits, small tasks fill at most nparts - 1 slots. */
static run_t *pick(cpu_backend_t *be) {
  attnd_list_t *s = attnd_list_first(&be->ring[0]), *l = attnd_list_first(&be->ring[1]);
  int small;
  if (!s || !l)
    small = s != NULL;
  else if (be->nparts == 1) /* one slot: the two rings take turns */
    small = be->last_large;
  else
    small = be->out_small < be->nparts - 1;
  if (!s && !l)
    return NULL;
  be->last_large = !small;
  return small ? ATTND_LIST_DATA(s, run_t, rl) : ATTND_LIST_DATA(l, run_t, rl);
}

static void pump(cpu_backend_t *be) {
  while (be->out < be->nparts && be->free_tasks) {
    run_t *r = pick(be);
    if (!r)
      return;
    task_t *t = be->free_tasks;
    be->free_tasks = t->next;
    memset(t, 0, sizeof(*t));
    t->run = r;
    t->idx = r->next++;
    /* Round robin: the run goes to its ring's end, or leaves it. */
    attnd_list_remove(&r->rl);
    if (r->next < r->ntasks)
      attnd_list_insert_tail(&be->ring[r->large], &r->rl);
    be->out++;
    if (!r->large)
      be->out_small++;
    r->out++;
    if (uv_queue_work(be->loop, &t->w, task_work, task_done) != 0) {
      /* Cannot happen with valid arguments; account the task as failed. */
      r->rc = ATTND_EINTERNAL;
      task_done(&t->w, 0);
      return;
    }
  }
}

static void run_start(run_t *r) {
  attnd_job_t *job = r->job;
  cpu_backend_t *be = r->be;
  be->lq[job->layer].nrun++;
  job->t_start_us = attnd_backend_now_us();
  if (job->kind == ATTND_JOB_CHECK) {
    phase_begin(r, PH_CHECK, 1);
    pump(be);
    return;
  }
  if (job->kind == ATTND_JOB_COPY || job->kind == ATTND_JOB_SCALES ||
      job->kind == ATTND_JOB_SINKS) {
    if (job->kind == ATTND_JOB_COPY && attnd_backend_cpu_fail_next == ATTND_CPU_FAIL_COPY) {
      r->inject = ATTND_CPU_FAIL_COPY;
      attnd_backend_cpu_fail_next = 0;
    }
    phase_begin(r, job->kind == ATTND_JOB_COPY ? PH_COPY : PH_SCALES, 1);
    pump(be);
    return;
  }
  attnd_kbatch_t *b = &job->batch;
  cpu_scales_t *sc = &be->sc[job->layer];
  b->cache = be->cache[job->layer];
  b->block_bytes = be->base.block_bytes;
  b->k_scale = b->v_scale = b->k_zero = b->v_zero = NULL;
  b->scale_per_channel = 0;
  b->sinks = sc->sinks_present ? sc->sinks : NULL;
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
  if (attnd_backend_cpu_fail_next == ATTND_CPU_FAIL_STEP ||
      attnd_backend_cpu_fail_next == ATTND_CPU_FAIL_DEVICE) {
    r->inject = attnd_backend_cpu_fail_next;
    attnd_backend_cpu_fail_next = 0;
  }
  r->large = attnd_backend_job_large(job, be->chunk_keys);
  int wparts = be->nparts;
  if (r->large && (b->total_kv + ATTND_BACKEND_WRITE_ROWS - 1) / ATTND_BACKEND_WRITE_ROWS > wparts)
    wparts = (b->total_kv + ATTND_BACKEND_WRITE_ROWS - 1) / ATTND_BACKEND_WRITE_ROWS;
  r->wparts = wparts;
  phase_begin(r, PH_WRITE, wparts);
  pump(be);
}

static int cpu_submit(attnd_backend_t *base, attnd_job_t *job) {
  cpu_backend_t *be = (cpu_backend_t *)base;
  if (job->layer < 0 || job->layer >= base->layers)
    return ATTND_EINVAL;
  run_t *r = calloc(1, sizeof(*r));
  if (!r)
    return ATTND_ENOMEM;
  r->be = be;
  r->job = job;
  attnd_list_init(&r->rl);
  job->status = 0;
  job->message[0] = 0;
  job->t_submit_us = attnd_backend_now_us();
  job->t_start_us = job->t_end_us = 0;
  job->dev_timed = 0;
  be->inflight++;
  layer_q_t *q = &be->lq[job->layer];
  if (!job->unordered && (q->nrun > 0 || q->whead)) {
    if (q->wtail)
      q->wtail->lnext = r;
    else
      q->whead = r;
    q->wtail = r;
    return 0;
  }
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
      free(be->sc[l].sinks);
    }
  }
  free(be->cache);
  free(be->sc);
  free(be->lq);
  free(be->tasks);
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
  be->chunk_keys = o->chunk_keys;
  attnd_cpu_attend_geometry(s, &be->tile_rows, &be->tile_units);
  attnd_list_init(&be->ring[0]);
  attnd_list_init(&be->ring[1]);
  be->cache = calloc((size_t)layers, sizeof(*be->cache));
  be->sc = calloc((size_t)layers, sizeof(*be->sc));
  be->lq = calloc((size_t)layers, sizeof(*be->lq));
  be->tasks = calloc((size_t)threads, sizeof(*be->tasks));
  if (!be->cache || !be->sc || !be->lq || !be->tasks)
    goto fail;
  for (int i = 0; i < threads; i++) {
    be->tasks[i].next = be->free_tasks;
    be->free_tasks = &be->tasks[i];
  }
  size_t nsc = (size_t)s->kv_heads * (size_t)s->head_dim;
  for (int l = 0; l < layers; l++) {
    /* calloc: the kernel never reads a position it has not written, but
     * zeroed pages cost nothing until touched. */
    be->cache[l] = calloc((size_t)nb, bb);
    be->sc[l].ks = calloc(nsc, sizeof(float));
    be->sc[l].vs = calloc(nsc, sizeof(float));
    be->sc[l].sinks = calloc((size_t)s->q_heads, sizeof(float));
    if (!be->cache[l] || !be->sc[l].ks || !be->sc[l].vs || !be->sc[l].sinks)
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

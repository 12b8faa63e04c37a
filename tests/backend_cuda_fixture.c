/* backend_cuda_fixture.c: the harness of tests/test_backend_cuda.c
 * (backend_cuda_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_fixture.h"

/* The backend options of this run (main() reads them from the arguments). */
attnd_backend_opts_t g_opts;

const attnd_backend_opts_t *opts(uint64_t kv_memory) {
  static attnd_backend_opts_t o;
  o = g_opts;
  o.kv_memory = kv_memory;
  return &o;
}

uint64_t rng_state = 0x9e3779b97f4a7c15ull;

uint64_t rng_next(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}

float rng_unit(void) {
  return (float)((rng_next() >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

attnd_kshape_t make_shape(attnd_kv_type_t kv) {
  attnd_kshape_t s;
  memset(&s, 0, sizeof(s));
  s.q_heads = QH;
  s.kv_heads = KVH;
  s.head_dim = HD;
  s.block_size = BS;
  s.dtype = ATTND_DT_BF16;
  s.kv = kv;
  s.rope = ATTND_ROPE_NEOX;
  s.rope_theta = 10000.0;
  s.rotary_dim = HD;
  s.softmax_scale = 1.0f / sqrtf((float)HD);
  return s;
}

void tjob_done(attnd_job_t *j) {
  tjob_t *t = (tjob_t *)j;
  t->done_seq = ++(*t->ndone);
}

void spec_step(tjob_spec_t *sp, int layer, const titem_t *its, int n, int fp32_out, int want_lse) {
  memset(sp, 0, sizeof(*sp));
  sp->kind = ATTND_JOB_STEP;
  sp->layer = layer;
  sp->nitems = n;
  sp->fp32_out = fp32_out;
  sp->want_lse = want_lse;
  int kv_row = 0, q_row = 0, T = 0;
  for (int i = 0; i < n; i++)
    T += its[i].q_only ? 0 : its[i].n;
  for (int i = 0; i < n; i++) {
    attnd_kitem_t *k = &sp->items[i];
    k->start = its[i].start;
    k->n = its[i].n;
    k->q_row = its[i].has_q || its[i].q_only ? q_row : -1;
    /* Attend-only items: virtual rows after the k/v rows (attnd_kernels.h). */
    k->kv_row = its[i].q_only ? T + sp->q_only_rows : kv_row;
    k->pos_base = its[i].pos_base;
    k->mask_kind = its[i].mask;
    k->mask_param = its[i].param;
    k->block_table = sp->nmeta;
    int kv_len = its[i].start + its[i].n;
    int nb = (kv_len + BS - 1) / BS;
    assert_true(nb <= its[i].nb);
    for (int b = 0; b < nb; b++)
      sp->meta[sp->nmeta++] = its[i].table[b];
    if (kv_len > sp->max_kv)
      sp->max_kv = kv_len;
    if (its[i].n > sp->max_n)
      sp->max_n = its[i].n;
    if (its[i].q_only)
      sp->q_only_rows += its[i].n;
    else
      kv_row += its[i].n;
    if (its[i].has_q || its[i].q_only)
      q_row += its[i].n;
  }
  sp->T = kv_row;
  sp->Tq = q_row;
  size_t nq = (size_t)sp->Tq * QH * HD, nkv = (size_t)sp->T * KVH * HD;
  sp->q = malloc((nq ? nq : 1) * 2);
  sp->k = malloc((nkv ? nkv : 1) * 2);
  sp->v = malloc((nkv ? nkv : 1) * 2);
  for (size_t i = 0; i < nq; i++)
    sp->q[i] = f2bf(rng_unit());
  for (size_t i = 0; i < nkv; i++) {
    sp->k[i] = f2bf(rng_unit());
    sp->v[i] = f2bf(rng_unit());
  }
}

void spec_copy(tjob_spec_t *sp, int layer, int src, int dst) {
  memset(sp, 0, sizeof(*sp));
  sp->kind = ATTND_JOB_COPY;
  sp->layer = layer;
  sp->copies[0] = src;
  sp->copies[1] = dst;
}

void spec_free(tjob_spec_t *sp) {
  free(sp->q);
  free(sp->k);
  free(sp->v);
}

size_t out_bytes(const tjob_spec_t *sp) {
  return (size_t)sp->Tq * QH * HD * (sp->fp32_out ? 4 : 2);
}

size_t lse_bytes(const tjob_spec_t *sp) {
  return sp->want_lse ? (size_t)sp->Tq * QH * sizeof(float) : 0;
}

/* Fills a job from a spec with freshly allocated, poisoned outputs. */
void job_from_spec(tjob_t *t, const tjob_spec_t *sp, int *ndone) {
  memset(t, 0, sizeof(*t));
  attnd_job_t *j = &t->job;
  j->kind = (attnd_job_kind_t)sp->kind;
  j->layer = sp->layer;
  j->done_cb = tjob_done;
  t->ndone = ndone;
  if (sp->kind == ATTND_JOB_COPY) {
    j->copies = sp->copies;
    j->ncopies = 1;
    return;
  }
  attnd_kbatch_t *b = &j->batch;
  b->items = sp->items;
  b->nitems = sp->nitems;
  b->meta = sp->meta;
  j->nmeta = (size_t)sp->nmeta;
  b->total_q = sp->Tq;
  b->total_kv = sp->T;
  b->q_only_rows = sp->q_only_rows;
  b->max_kv_len = sp->max_kv;
  b->max_n = sp->max_n;
  j->q_bytes = (size_t)sp->Tq * QH * HD * 2;
  j->kv_bytes = (size_t)sp->T * KVH * HD * 2;
  t->qcopy = malloc(j->q_bytes ? j->q_bytes : 1);
  memcpy(t->qcopy, sp->q, j->q_bytes);
  b->q = j->q_bytes ? t->qcopy : NULL;
  b->k = sp->k;
  b->v = sp->v;
  b->out_fp32 = sp->fp32_out;
  j->out_bytes = out_bytes(sp);
  j->lse_bytes = lse_bytes(sp);
  if (j->out_bytes) {
    b->out = malloc(j->out_bytes);
    memset(b->out, 0xff, j->out_bytes); /* NaN in bf16 and fp32 */
  }
  if (j->lse_bytes) {
    b->lse = malloc(j->lse_bytes);
    memset(b->lse, 0xff, j->lse_bytes);
  }
}

void job_free(tjob_t *t) {
  free(t->qcopy);
  free(t->job.batch.out);
  free(t->job.batch.lse);
}

double out_val(const tjob_t *t, size_t i) {
  if (t->job.batch.out_fp32)
    return ((const float *)t->job.batch.out)[i];
  return bf2f(((const uint16_t *)t->job.batch.out)[i]);
}

void mock_hold(int on) {
  if (attnd_cuda_mock_hold)
    attnd_cuda_mock_hold(on);
}

/* Submits every job back to back (nothing waits for an earlier one), then
 * runs the loop until all are done. */
void run_all(uv_loop_t *loop, attnd_backend_t *be, tjob_t *jobs, int n) {
  int ndone = 0;
  mock_hold(1);
  for (int i = 0; i < n; i++) {
    jobs[i].ndone = &ndone;
    assert_int_equal(be->ops->submit(be, &jobs[i].job), 0);
  }
  mock_hold(0);
  while (ndone < n)
    uv_run(loop, UV_RUN_ONCE);
  assert_int_equal(be->ops->inflight(be), 0);
}

double rel_l2_out(const tjob_t *a, const tjob_t *ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double x = out_val(a, i), y = out_val(ref, i);
    if (!isfinite(x))
      return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

void destroy_and_close(uv_loop_t *loop, attnd_backend_t *be) {
  be->ops->destroy(be);
  uv_run(loop, UV_RUN_DEFAULT);
}

int g_frames_pinned;

/* Moves a step's q, k and v into one buffer from host_alloc, each at an odd
 * offset as in a request frame, and marks them pinned (backend.h
 * inputs_pinned): the CUDA backend DMAs them from there. Returns the frame. */
void *inputs_in_frame(attnd_backend_t *gpu, attnd_job_t *j) {
  assert_non_null(gpu->ops->host_alloc);
  size_t n = j->q_bytes + 2 * j->kv_bytes + 3;
  uint8_t *f = gpu->ops->host_alloc(gpu, n);
  if (!f)
    return NULL; /* the frames made at start are all out: plain memory, as the transport does */
  g_frames_pinned++;
  assert_int_equal((uintptr_t)f % 16, 0); /* CU_ALIGN past a pinned (mock: malloc) block */
  uint8_t *q = f + 1, *k = q + j->q_bytes + 1, *v = k + j->kv_bytes + 1;
  if (j->q_bytes)
    memcpy(q, j->batch.q, j->q_bytes);
  memcpy(k, j->batch.k, j->kv_bytes);
  memcpy(v, j->batch.v, j->kv_bytes);
  j->batch.q = j->q_bytes ? q : NULL;
  j->batch.k = k;
  j->batch.v = v;
  j->inputs_pinned = 1;
  return f;
}

/* Moves a step's output buffer into host_alloc memory (outputs_pinned: the
 * D2H copy lands there). Returns it; the job's own buffer is freed. */
void *output_in_host_memory(attnd_backend_t *gpu, attnd_job_t *j) {
  if (!j->out_bytes)
    return NULL;
  uint8_t *o = gpu->ops->host_alloc(gpu, j->out_bytes);
  if (!o)
    return NULL;
  memset(o, 0xff, j->out_bytes); /* NaN in bf16 and fp32, as the fixture's */
  free(j->batch.out);
  j->batch.out = o;
  j->outputs_pinned = 1;
  return o;
}

/* jobs.c: the engine's backend jobs (internal.h, backend.h).
 *
 * A job holds a reference on every block it reads or writes (block tables up
 * to kv_len, both sides of a copy), dropped in its done callback. Jobs go to
 * the backend in admission order, and the backend runs each layer's in that
 * order (backend.h): copies before the steps that read them, a SetScales's
 * SCALES job between the steps before and after it. A step the backend could
 * not finish leaves its
 * sessions broken (ABORTED from then on); a sticky device error makes the
 * engine tell the daemon once (attnd_engine_on_fatal). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

attnd_ejob_t *attnd_ejob_new(attnd_engine_t *e, int kind, int layer) {
  attnd_ejob_t *j = attnd_xcalloc(1, sizeof(*j));
  j->e = e;
  j->kind = kind;
  j->layer = layer;
  j->job.kind = kind == EJ_COPY     ? ATTND_JOB_COPY
                : kind == EJ_SCALES ? ATTND_JOB_SCALES
                                    : ATTND_JOB_STEP;
  j->job.layer = layer;
  return j;
}

void attnd_ejob_free(attnd_ejob_t *j) {
  free(j->refs);
  free(j->kitems);
  free(j->meta);
  free(j->out);
  free(j->lse);
  free(j->qbuf);
  free(j->kbuf);
  free(j->vbuf);
  free(j->copies);
  free(j->sessions);
  free(j->sk);
  free(j->sv);
  free(j->zk);
  free(j->zv);
  free(j);
}

/* A step the backend could not finish left its sessions' KV unknown: those
 * sessions answer ABORTED from now on, and since the failed write may sit in
 * published blocks, the whole prefix index is dropped (a rare event; cached
 * KV is only an optimization). */
static void step_failed(attnd_engine_t *e, attnd_ejob_t *j) {
  for (uint32_t i = 0; i < j->nsessions; i++) {
    attnd_session_t *s = attnd_idmap_get(&e->sessions, j->sessions[i]);
    if (s)
      s->broken = 1;
  }
  attnd_prefix_drop_all(e->px);
  ATTND_LIST_FOREACH(it, nx, &e->slist)
  ATTND_LIST_DATA(it, attnd_session_t, link)->npub = 0;
}

static void job_done(attnd_job_t *job) {
  attnd_ejob_t *j = (attnd_ejob_t *)job;
  attnd_engine_t *e = j->e;
  /* A sticky device error: this and every later job fail (UNAVAILABLE), and
   * the daemon is told once, after this job is answered, so that it drains
   * and exits non-zero for its supervisor to restart it. */
  int fatal_now = job->status == ATTND_EDEVICE && !e->fatal;
  if (fatal_now)
    e->fatal = 1;
  if (job->status != 0 && j->kind == EJ_STEP)
    step_failed(e, j);
  if (j->cb) {
    attnd_result_t r;
    memset(&r, 0, sizeof(r));
    r.status = job->status;
    if (job->status) {
      snprintf(r.message, sizeof(r.message), "%s",
               job->message[0] ? job->message : attnd_strerror(job->status));
    } else {
      /* The outputs are the callback's from here on. */
      r.out = j->out;
      r.out_dtype = j->out_dtype;
      r.out_rows = (uint32_t)job->batch.total_q;
      r.out_bytes = job->out_bytes;
      r.lse = j->lse;
      r.lse_bytes = job->lse_bytes;
      r.decode = j->decode;
      j->out = NULL;
      j->lse = NULL;
    }
    if (job->t_start_us >= job->t_submit_us)
      r.queued_us = job->t_start_us - job->t_submit_us;
    if (job->t_end_us >= job->t_start_us)
      r.computing_us = job->t_end_us - job->t_start_us;
    j->cb(j->arg, &r);
  }
  /* Blocks go back only after the callback, which may make new calls. */
  for (uint32_t i = 0; i < j->nrefs; i++)
    attnd_blocks_unref(&e->pool, j->refs[i], 0);
  attnd_ejob_free(j);
  e->pending--;
  attnd_engine_maybe_finish_close(e);
  if (fatal_now && e->fatal_cb)
    e->fatal_cb(e->fatal_arg);
}

static void backend_submit(attnd_engine_t *e, attnd_ejob_t *j) {
  j->job.done_cb = job_done;
  j->job.user = j;
  int rc = e->be->ops->submit(e->be, &j->job);
  if (rc != 0) {
    j->job.status = rc;
    snprintf(j->job.message, sizeof(j->job.message), "backend refused the job: %s",
             attnd_strerror(rc));
    j->job.t_submit_us = j->job.t_start_us = j->job.t_end_us = 0;
    job_done(&j->job);
  }
}

void attnd_ejob_submit(attnd_engine_t *e, attnd_ejob_t *j) {
  e->pending++;
  backend_submit(e, j);
}

/* jobs.c: the engine's backend jobs (internal.h, backend.h).
 *
 * A job holds a reference on every block it reads or writes (block tables up
 * to kv_len, both sides of a copy), dropped in its done callback. Jobs enter
 * the scheduler (sched.c) in admission order and go to the backend once
 * every earlier job of their layer they conflict with is done: copies before
 * the steps that read them, a SetScales's SCALES job between the steps before
 * and after it, a session's steps of a layer in their order.
 *
 * Failures (docs/sessions.md section 9). A job that failed in the backend, or
 * was failed unrun because a job it waited for failed, leaves the blocks it
 * writes unknown: every session holding one of them (its own, and any that
 * forked from them meanwhile) answers ABORTED from then on, a failed step
 * answers ABORTED itself, and since the bad blocks may be published, the
 * whole prefix index is dropped (a rare event; cached KV is only an
 * optimization). A sticky device error instead answers UNAVAILABLE, fails
 * every later job the same way, and makes the engine tell the daemon once
 * (attnd_engine_on_fatal). */
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
                : kind == EJ_SINKS  ? ATTND_JOB_SINKS
                                    : ATTND_JOB_STEP;
  j->job.layer = layer;
  attnd_list_init(&j->llink);
  attnd_list_init(&j->qlink);
  return j;
}

void attnd_ejob_free(attnd_ejob_t *j) {
  free(j->refs);
  free(j->kitems);
  free(j->meta);
  attnd_engine_host_free(j->e, j->out, j->out_pinned);
  free(j->lse);
  attnd_engine_host_free(j->e, j->qbuf, 0);
  attnd_engine_host_free(j->e, j->kbuf, 0);
  attnd_engine_host_free(j->e, j->vbuf, 0);
  free(j->copies);
  free(j->sessions);
  free(j->sk);
  free(j->sv);
  free(j->zk);
  free(j->zv);
  free(j->wblocks);
  free(j->rnodes);
  free(j->waiters);
  free(j);
}

/* The blocks j writes are unknown now: their sessions are broken, and the
 * prefix index (which may hold them) is dropped. */
static void job_failed(attnd_engine_t *e, attnd_ejob_t *j) {
  for (uint32_t i = 0; i < j->nsessions; i++) {
    attnd_session_t *s = attnd_idmap_get(&e->sessions, j->sessions[i]);
    if (s)
      s->broken = 1;
  }
  if (j->nw) {
    uint8_t *bad = attnd_xcalloc(e->pool.n, 1);
    for (uint32_t i = 0; i < j->nw; i++)
      bad[j->wblocks[i]] = 1;
    ATTND_LIST_FOREACH(it, nx, &e->slist) {
      attnd_session_t *s = ATTND_LIST_DATA(it, attnd_session_t, link);
      for (uint32_t b = 0; b < s->nblocks && !s->broken; b++)
        s->broken = bad[s->table[b]];
    }
    free(bad);
  }
  attnd_prefix_drop_all(e->px);
  ATTND_LIST_FOREACH(it, nx, &e->slist)
  ATTND_LIST_DATA(it, attnd_session_t, link)->npub = 0;
}

/* The status a failed job answers: UNAVAILABLE after a sticky device error,
 * else ABORTED (its sessions lost their KV), the backend's reason kept. */
static void failed_result(const attnd_ejob_t *j, attnd_result_t *r) {
  const attnd_job_t *job = &j->job;
  const char *why = job->message[0] ? job->message : attnd_strerror(job->status);
  if (job->status == ATTND_EDEVICE) {
    r->status = ATTND_EDEVICE;
    snprintf(r->message, sizeof(r->message), "%s", why);
    return;
  }
  r->status = ATTND_EABORTED;
  snprintf(r->message, sizeof(r->message),
           "the step failed in the backend (%.150s); its sessions lost their KV: close them", why);
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
  if (job->status != 0 && j->kind != EJ_SCALES && j->kind != EJ_SINKS)
    job_failed(e, j);
  attnd_sched_done(e, j, job->status != 0);
  if (j->cb) {
    attnd_result_t r;
    memset(&r, 0, sizeof(r));
    if (job->status) {
      failed_result(j, &r);
    } else {
      /* The outputs are the callback's from here on. */
      r.out = j->out;
      r.out_pinned = j->out_pinned;
      r.out_dtype = j->out_dtype;
      r.out_rows = (uint32_t)job->batch.total_q;
      r.out_bytes = job->out_bytes;
      r.lse = j->lse;
      r.lse_bytes = job->lse_bytes;
      r.decode = j->decode;
      j->out = NULL;
      j->lse = NULL;
    }
    /* Queued: from admission (the engine's wait included) to the start. */
    if (job->t_start_us >= j->t_admit_us)
      r.queued_us = job->t_start_us - j->t_admit_us;
    if (job->t_end_us >= job->t_start_us)
      r.computing_us = job->t_end_us - job->t_start_us;
    r.scan_us = j->scan_us;
    _Static_assert(ATTND_DEV_COUNT == 4, "attnd_result_t.dev_us follows backend.h");
    if (job->dev_timed) {
      memcpy(r.dev_us, job->dev_us, sizeof(r.dev_us));
      r.dev_timed = 1;
    }
    j->cb(j->arg, &r);
  }
  /* Blocks go back only after the callback, which may make new calls. */
  for (uint32_t i = 0; i < j->nrefs; i++)
    attnd_blocks_unref(&e->pool, j->refs[i], 0);
  attnd_ejob_free(j);
  e->pending--;
  attnd_sched_run(e);
  attnd_engine_maybe_finish_close(e);
  if (fatal_now && e->fatal_cb)
    e->fatal_cb(e->fatal_arg);
}

void attnd_ejob_start(attnd_engine_t *e, attnd_ejob_t *j) {
  j->job.done_cb = job_done;
  j->job.user = j;
  j->job.unordered = 1; /* the scheduler ordered it */
  int rc = e->be->ops->submit(e->be, &j->job);
  if (rc != 0) {
    j->job.status = rc;
    snprintf(j->job.message, sizeof(j->job.message), "backend refused the job: %s",
             attnd_strerror(rc));
    j->job.t_submit_us = j->job.t_start_us = j->job.t_end_us = 0;
    job_done(&j->job);
  }
}

void attnd_ejob_fail_unrun(attnd_engine_t *e, attnd_ejob_t *j) {
  j->job.status = e->fatal ? ATTND_EDEVICE : ATTND_EABORTED;
  snprintf(j->job.message, sizeof(j->job.message), "%s",
           e->fatal ? "the device is unusable after an earlier error"
                    : "a job it depends on failed in the backend");
  j->job.t_submit_us = j->job.t_start_us = j->job.t_end_us = attnd_engine_now_us();
  job_done(&j->job);
}

void attnd_ejob_submit(attnd_engine_t *e, attnd_ejob_t *j) {
  e->pending++;
  j->t_admit_us = attnd_engine_now_us();
  attnd_sched_submit(e, j);
}

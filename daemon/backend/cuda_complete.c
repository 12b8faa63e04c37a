/* cuda_complete.c: how the CUDA backend learns that a run finished and hands
 * it back to the loop thread (internal.h).
 *
 * Behind a run's work the loop thread records an event and appends the run
 * to a pending list; one poller thread queries the pending events in
 * submission order (so a stream's runs finish in its order), sleeping 3 us
 * between rounds (20 us once nothing finished for a while), and for each
 * finished run copies the pinned outputs into the engine's host buffers,
 * pushes the run onto a mutex-protected done queue and wakes the loop with
 * uv_async_send; the async callback drains the queue on the loop thread and
 * calls done_cb. A sticky error makes every query return it, so every pending
 * run still finishes exactly once, with the error. --cuda-completion callback
 * uses stream callbacks (cudaStreamAddCallback) instead: measured on the H200
 * they ran 20-27 us after the device finished (bench/RESULTS.md). Not
 * cudaLaunchHostFunc: a host function is never called once the context has a
 * sticky error, which would leave the engine waiting forever. */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "internal.h"

void attnd_cu_update_ref(cu_backend_t *be) {
  if (uv_is_closing((uv_handle_t *)&be->async))
    return;
  if (be->inflight > 0)
    uv_ref((uv_handle_t *)&be->async);
  else
    uv_unref((uv_handle_t *)&be->async);
}

static void push_done(cu_backend_t *be, cu_run_t *r) {
  uv_mutex_lock(&be->mu);
  cu_stream_t *cs = &be->streams[r->stream];
  r->t_end = attnd_cu_now_us();
  /* The job began when the device reached it: after its submission and
   * after the previous job of its stream ended. */
  r->t_start = cs->last_end_us > 0 && cs->last_end_us > r->job->t_submit_us ? cs->last_end_us
                                                                            : r->job->t_submit_us;
  if (r->t_start > r->t_end)
    r->t_start = r->t_end;
  if (r->parent) {
    /* A ring chunk: its run began with its first chunk. */
    if (!r->parent->t_first)
      r->parent->t_first = r->t_start;
  } else {
    if (r->t_first && r->t_first < r->t_start)
      r->t_start = r->t_first;
    cs->last_end_us = r->t_end;
  }
  r->next = NULL;
  if (be->dtail)
    be->dtail->next = r;
  else
    be->dhead = r;
  be->dtail = r;
  uv_mutex_unlock(&be->mu);
  uv_async_send(&be->async);
}

/* Runs on a CUDA-owned thread after the run's stream work: no CUDA calls
 * allowed here, only host copies and the hand-off to the loop. */
static void CUDART_CB stream_cb(cudaStream_t st, cudaError_t status, void *arg) {
  cu_run_t *r = arg;
  cu_backend_t *be = r->be;
  if (r->traced)
    r->t_cb = attnd_cu_now_us();
  r->async = status;
  if (status != cudaSuccess && attnd_cu_sticky(status))
    atomic_store(&be->dead, 1);
  attnd_job_t *job = r->job;
  /* Ring runs and chunks: the chunks' D2H and host functions placed the
   * outputs, but for the lse rows beside a pinned output (cuda_ring.c). */
  if (status == cudaSuccess && !r->status && r->parent)
    attnd_cu_ring_chunk_outputs(r);
  if (status == cudaSuccess && !r->status && job->kind == ATTND_JOB_STEP && !job->device_io &&
      r->path != 2) {
    if (job->out_bytes && !job->outputs_pinned) { /* pinned: DMA'd there already */
      memcpy(job->batch.out, r->stage->p + r->out_off, job->out_bytes);
      atomic_fetch_add(&be->staged_bytes, job->out_bytes);
    }
    if (job->lse_bytes && job->batch.lse)
      memcpy(job->batch.lse, r->stage->p + r->lse_off, job->lse_bytes);
  }
  push_done(be, r);
}

cudaEvent_t attnd_cu_ev_get(cu_backend_t *be) {
  if (be->nevfree > 0)
    return be->evfree[--be->nevfree];
  cudaEvent_t ev = NULL;
  if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    return NULL;
  }
  return ev;
}

void attnd_cu_ev_put(cu_backend_t *be, cudaEvent_t ev) {
  if (!ev)
    return;
  if (be->nevfree == be->evcap) {
    int cap = be->evcap ? 2 * be->evcap : 64;
    cudaEvent_t *n = realloc(be->evfree, (size_t)cap * sizeof(*n));
    if (!n) {
      cudaEventDestroy(ev);
      cudaGetLastError();
      return;
    }
    be->evfree = n;
    be->evcap = cap;
  }
  be->evfree[be->nevfree++] = ev;
}

cudaError_t attnd_cu_track(cu_backend_t *be, cu_run_t *r, cudaStream_t st) {
  if (!be->poll)
    return cudaStreamAddCallback(st, stream_cb, r, 0);
  cudaEvent_t ev = attnd_cu_ev_get(be);
  if (!ev)
    return cudaErrorMemoryAllocation;
  cudaError_t e = cudaEventRecord(ev, st);
  if (e != cudaSuccess) {
    attnd_cu_ev_put(be, ev);
    return e;
  }
  r->done_ev = ev;
  r->pnext = NULL;
  uv_mutex_lock(&be->pmu);
  if (be->ptail)
    be->ptail->pnext = r;
  else
    be->phead = r;
  be->ptail = r;
  uv_cond_signal(&be->pcv);
  uv_mutex_unlock(&be->pmu);
  return cudaSuccess;
}

void attnd_cu_poller_main(void *arg) {
  cu_backend_t *be = arg;
  cudaSetDevice(be->device);
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* 1 us: nanosleep(3 us) sleeps ~3 us, not ~55 */
  int idle = 0;                              /* rounds without a completion since the last one */
  uv_mutex_lock(&be->pmu);
  for (;;) {
    while (!be->phead && !be->pstop)
      uv_cond_wait(&be->pcv, &be->pmu);
    if (!be->phead)
      break; /* stopping, nothing pending */
    cu_run_t *list = be->phead;
    be->phead = be->ptail = NULL;
    uv_mutex_unlock(&be->pmu);
    cu_run_t *kh = NULL, *kt = NULL;
    int done = 0;
    /* Streams with an unfinished run in this round: their later runs are not
     * even queried, since the stream may finish both between the two queries
     * and the later one must not complete first (per-layer order). */
    uint64_t blocked = 0;
    for (cu_run_t *r = list, *next; r; r = next) {
      next = r->pnext;
      const uint64_t bit = (uint64_t)1 << r->stream;
      cudaError_t q = (blocked & bit) ? cudaErrorNotReady : cudaEventQuery(r->done_ev);
      if (q == cudaErrorNotReady) {
        blocked |= bit;
        r->pnext = NULL;
        if (kt)
          kt->pnext = r;
        else
          kh = r;
        kt = r;
        continue;
      }
      if (q != cudaSuccess)
        cudaGetLastError();
      stream_cb(NULL, q, r); /* r now belongs to the loop */
      done++;
    }
    /* No busy spin: a thread hammering cudaEventQuery contends with the loop
     * thread's launches for the driver's locks (measured on the H200: a
     * sched_yield spin made pipelined decode 40% slower). Short sleeps with a
     * 1 us timer slack poll every few microseconds, then back off to 20 us
     * for long kernels. */
    if (done)
      idle = 0;
    nanosleep(&(struct timespec){0, ++idle > 100 ? 20000 : 3000}, NULL);
    uv_mutex_lock(&be->pmu);
    if (kh) { /* unfinished runs go back in front of newer ones */
      kt->pnext = be->phead;
      be->phead = kh;
      if (!be->ptail)
        be->ptail = kt;
    }
  }
  uv_mutex_unlock(&be->pmu);
}

static void finish_run(cu_backend_t *be, cu_run_t *r) {
  attnd_job_t *job = r->job;
  if (r->traced)
    attnd_cu_trace_run(be, r);
  attnd_cu_ev_put(be, r->done_ev);
  attnd_cu_ev_put(be, r->fence_ev);
  r->done_ev = r->fence_ev = NULL;
  if (r->parent) {
    cu_run_t *run = attnd_cu_ring_chunk_done(be, r);
    if (run)
      finish_run(be, run);
    return;
  }
  if (attnd_cu_ring_defer(r))
    return; /* its chunks' completions come later; the last one finishes it */
  be->streams[r->stream].nrun--;
  attnd_cu_ring_plan_free(be, r->plan);
  if (!r->status && r->async != cudaSuccess) {
    int sticky = attnd_cu_sticky(r->async);
    r->status = sticky ? ATTND_EDEVICE : ATTND_ECUDA;
    snprintf(r->msg, sizeof(r->msg), "cuda: layer %d: device work failed: %s", job->layer,
             cudaGetErrorString(r->async));
  }
  attnd_cu_stage_put(be, r->stage);
  job->status = r->status;
  if (r->status)
    snprintf(job->message, sizeof(job->message), "%s", r->msg);
  job->t_start_us = r->t_start;
  job->t_end_us = r->t_end;
  be->inflight--;
  free(r);
  job->done_cb(job);
}

void attnd_cu_async_cb(uv_async_t *h) {
  cu_backend_t *be = h->data;
  uv_mutex_lock(&be->mu);
  cu_run_t *r = be->dhead;
  be->dhead = be->dtail = NULL;
  uv_mutex_unlock(&be->mu);
  while (r) {
    cu_run_t *next = r->next;
    finish_run(be, r);
    r = next;
  }
  attnd_cu_pump_waiting(be);
  attnd_cu_update_ref(be);
}

/* Its stream is drained first so that its pinned buffer is no longer read by
 * a copy already queued. */
void attnd_cu_complete_untracked(cu_backend_t *be, cu_run_t *r) {
  if (r->stage)
    cudaStreamSynchronize(be->streams[r->stream].st);
  cudaGetLastError();
  push_done(be, r);
}

void attnd_cu_poller_stop(cu_backend_t *be) {
  if (!be->poller_started)
    return;
  uv_mutex_lock(&be->pmu);
  be->pstop = 1;
  uv_cond_signal(&be->pcv);
  uv_mutex_unlock(&be->pmu);
  uv_thread_join(&be->poller);
  be->poller_started = 0;
}

#endif /* ATTND_HAVE_CUDA */

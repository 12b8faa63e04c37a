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
 * sticky error, which would leave the engine waiting forever.
 * --cuda-completion loop adds the loop thread's own polling (attnd_cu_spin_cb)
 * over the same pending list and done queue. */
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
  if (be->spin) {
    be->spin_until = attnd_cu_now_us() + be->loop_spin_us;
    if (!atomic_load(&be->loop_spinning)) {
      atomic_store(&be->loop_spinning, 1);
      uv_idle_start(be->spin, attnd_cu_spin_cb);
    }
  }
  return cudaSuccess;
}

/* Bytes a finished run's completion copies out of its pinned buffer into the
 * engine's (stream_cb). */
static size_t run_copy_bytes(const cu_run_t *r) {
  const attnd_job_t *job = r->job;
  if (r->status || job->kind != ATTND_JOB_STEP || job->device_io || r->path == 2)
    return 0;
  size_t n = job->out_bytes && !job->outputs_pinned ? job->out_bytes : 0;
  return n + (job->lse_bytes && job->batch.lse ? job->lse_bytes : 0);
}

/* One round over the pending runs, with pmu held (it is released during the
 * queries): takes the list unless the other scanner (poller thread or loop
 * thread) has it, queries the runs' events in submission order and hands the
 * finished ones to the done queue, in that order; the rest go back in front
 * of newer ones. Only one scanner at a time, so the done queue keeps each
 * stream's order. by_loop: a finished run whose output copy exceeds
 * hostfn_min is left to the poller thread (the loop does no work of a step's
 * size), and so are its stream's later runs; *handoff is then set. Returns
 * the runs finished, -1 when the list was not taken. */
static int scan_locked(cu_backend_t *be, int by_loop, int *handoff) {
  if (!be->phead || be->pscan)
    return -1;
  cu_run_t *list = be->phead;
  be->phead = be->ptail = NULL;
  be->pscan = 1;
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
    if (q == cudaSuccess && by_loop && run_copy_bytes(r) > be->hostfn_min) {
      *handoff = 1;
      q = cudaErrorNotReady;
    }
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
    r->by_loop = by_loop;
    if (by_loop)
      be->loop_completions++; /* the loop thread's count (stats) */
    stream_cb(NULL, q, r);    /* r now belongs to the loop */
    done++;
  }
  uv_mutex_lock(&be->pmu);
  be->pscan = 0;
  if (kh) { /* unfinished runs go back in front of newer ones */
    kt->pnext = be->phead;
    be->phead = kh;
    if (!be->ptail)
      be->ptail = kt;
  }
  if (be->phead)
    uv_cond_signal(&be->pcv); /* the poller may have waited for this round */
  return done;
}

void attnd_cu_poller_main(void *arg) {
  cu_backend_t *be = arg;
  cudaSetDevice(be->device);
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* 1 us: nanosleep(3 us) sleeps ~3 us, not ~55 */
  int idle = 0;                              /* rounds without a completion since the last one */
  uv_mutex_lock(&be->pmu);
  for (;;) {
    while ((!be->phead || be->pscan) && !be->pstop)
      uv_cond_wait(&be->pcv, &be->pmu);
    if (!be->phead)
      break; /* stopping, nothing pending */
    if (be->pscan || atomic_load(&be->loop_spinning)) {
      /* The loop thread polls these itself on every turn (its done_cbs need
       * that thread anyway): stand by, and take over once it stops, at the
       * short interval first. */
      idle = 0;
      uv_mutex_unlock(&be->pmu);
      nanosleep(&(struct timespec){0, 20000}, NULL);
      uv_mutex_lock(&be->pmu);
      continue;
    }
    int handoff = 0;
    int done = scan_locked(be, 0, &handoff);
    uv_mutex_unlock(&be->pmu);
    /* No busy spin: a thread hammering cudaEventQuery contends with the loop
     * thread's launches for the driver's locks (measured on the H200: a
     * sched_yield spin made pipelined decode 40% slower). Short sleeps with a
     * 1 us timer slack poll every few microseconds, then back off to 20 us
     * for long kernels. */
    if (done > 0)
      idle = 0;
    nanosleep(&(struct timespec){0, ++idle > 100 ? 20000 : 3000}, NULL);
    uv_mutex_lock(&be->pmu);
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
  if (job->kind == ATTND_JOB_CHECK)
    attnd_cu_ipc_check_result(r); /* its pinned slot, read once the device is done */
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

/* Finishes every run on the done queue, in its order (loop thread). */
static void drain_done(cu_backend_t *be) {
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

void attnd_cu_async_cb(uv_async_t *h) {
  drain_done(h->data);
}

/* --cuda-completion loop: while runs are pending, and for at most
 * loop_spin_us after the last submission or completion, the loop thread
 * polls their events itself on every turn (an active idle handle makes the
 * loop poll its sockets without blocking), so a small step's completion
 * reaches done_cb with no thread hop and no wake-up. Only this thread then
 * makes CUDA calls in those microseconds, so the spin does not contend with
 * launches for the driver's locks as a spinning poller thread did. The
 * poller thread stands by meanwhile (checking every 20 us whether the loop
 * stopped) and takes over when the window closes or a finished run has an
 * output copy larger than hostfn_min (long steps, large copies). */
void attnd_cu_spin_cb(uv_idle_t *h) {
  cu_backend_t *be = h->data;
  int handoff = 0, done = -1;
  if (uv_mutex_trylock(&be->pmu) == 0) {
    done = scan_locked(be, 1, &handoff);
    uv_mutex_unlock(&be->pmu);
  }
  const uint64_t now = attnd_cu_now_us();
  if (done > 0)
    be->spin_until = now + be->loop_spin_us;
  /* The poller's completions too: the done queue is one queue in order.
   * Their done_cbs may submit more (attnd_cu_track extends the window). */
  drain_done(be);
  uv_mutex_lock(&be->pmu);
  const int left = be->phead != NULL || be->pscan;
  uv_mutex_unlock(&be->pmu);
  if (handoff || !left || now > be->spin_until) {
    /* A later submission starts it again (attnd_cu_track). */
    uv_idle_stop(h);
    atomic_store(&be->loop_spinning, 0);
  }
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

/* cuda_trace.c: where a CUDA step's time goes (--cuda-trace; internal.h).
 *
 * A diagnostic: five events per traced step (around H2D, write, attend and
 * D2H) plus host times at the end of the enqueue and at completion. Every
 * CU_TRACE_N steps the medians of each interval go to the log as one
 * cuda_trace line (bench/RESULTS.md has numbers), with the completion mode
 * and how many of those steps the loop thread's own polling completed
 * (--cuda-completion loop; the rest came through the poller thread) and
 * how many went as one graph launch (--cuda-graphs: their whole sequence
 * shows as the attend interval, H2D, write and D2H as 0). */
#ifdef ATTND_HAVE_CUDA

#include <stdlib.h>

#include "internal.h"

void attnd_cu_trace_begin(cu_backend_t *be, cu_run_t *r) {
  if (!be->trace || r->traced)
    return;
  r->traced = 1;
  for (int i = 0; i < 5; i++)
    if (cudaEventCreate(&r->ev[i]) != cudaSuccess)
      r->traced = 0;
  if (!r->traced)
    cudaGetLastError();
}

void attnd_cu_trace_mark(cu_run_t *r, int i, cudaStream_t st) {
  /* Not inside a capture: the marks go around the graph's launch instead. */
  if (r->traced && !r->graphed)
    cudaEventRecord(r->ev[i], st);
}

void attnd_cu_trace_mark_graph(cu_run_t *r, int i, cudaStream_t st) {
  if (r->traced)
    cudaEventRecord(r->ev[i], st);
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

void attnd_cu_trace_run(cu_backend_t *be, cu_run_t *r) {
  cu_trace_t *t = be->trace;
  float ms[4] = {0, 0, 0, 0};
  int ok = r->async == cudaSuccess && !r->status;
  for (int i = 0; i < 4 && ok; i++)
    if (cudaEventElapsedTime(&ms[i], r->ev[i], r->ev[i + 1]) != cudaSuccess)
      ok = 0;
  for (int i = 0; i < 5; i++)
    cudaEventDestroy(r->ev[i]);
  cudaGetLastError();
  r->traced = 0;
  if (!ok || !t)
    return;
  if (r->job->kind == ATTND_JOB_STEP) { /* the step trace (backend.h) */
    for (int i = 0; i < ATTND_DEV_COUNT; i++)
      r->job->dev_us[i] = (uint32_t)(ms[i] * 1e3f);
    r->job->dev_timed = 1;
  }
  const float gpu = (ms[0] + ms[1] + ms[2] + ms[3]) * 1e3f;
  const float v[TR_COUNT] = {(float)(r->t_enq - r->job->t_submit_us), ms[0] * 1e3f, ms[1] * 1e3f,
                             ms[2] * 1e3f, ms[3] * 1e3f,
                             /* callback after the device's end, if the device started at once */
                             (float)(r->t_cb - r->t_enq) - gpu,
                             (float)(attnd_cu_now_us() - r->t_cb)};
  for (int i = 0; i < TR_COUNT; i++)
    t->v[i][t->n] = v[i];
  t->nloop += r->by_loop;
  t->ngraph += r->graphed;
  if (++t->n < CU_TRACE_N)
    return;
  for (int i = 0; i < TR_COUNT; i++)
    qsort(t->v[i], CU_TRACE_N, sizeof(float), cmp_float);
  const int m = CU_TRACE_N / 2;
  ATTND_LOGI("cuda_trace",
             "steps=%d enqueue_us=%.1f h2d_us=%.1f write_us=%.1f attend_us=%.1f d2h_us=%.1f "
             "callback_after_device_us=%.1f callback_to_loop_us=%.1f completion=%s "
             "completed_by_loop=%d graph_steps=%d",
             CU_TRACE_N, t->v[TR_ENQ][m], t->v[TR_H2D][m], t->v[TR_WRITE][m], t->v[TR_ATTEND][m],
             t->v[TR_D2H][m], t->v[TR_CB][m], t->v[TR_HOP][m],
             be->poll ? (be->spin ? "loop" : "poll") : "callback", t->nloop, t->ngraph);
  t->n = 0;
  t->nloop = t->ngraph = 0;
}

#endif /* ATTND_HAVE_CUDA */

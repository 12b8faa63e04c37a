/* cuda_graph.c: a small step's launch sequence as one graph launch
 * (--cuda-graphs; internal.h).
 *
 * A small step (the pooled-buffer path of cuda_enqueue.c) is an H2D copy,
 * the write kernel, the attention kernel(s), a D2H copy: five or more
 * runtime calls on the loop thread. With graphs the same calls are captured
 * on the step's stream (capture records, it does not submit), and the
 * stream's executable graph of that step shape takes the captured graph's
 * parameters (cudaGraphExecUpdate: the new staging pointers, the layer's
 * pool, the kernels' plan for this context) and is launched once. A step
 * shape is everything that sizes the sequence: items, rows, meta, tensor
 * bytes, lse, pinned inputs or outputs. Each stream keeps CU_GRAPHS shapes,
 * the least recently used replaced; a shape gets its executable graph at
 * its second step (its first runs directly: no graph memory for a shape
 * seen once), so graph memory is made lazily, a few hundred KiB per shape,
 * at most CU_GRAPHS per stream. An update the runtime refuses (the kernels
 * chose another topology, e.g. a split with a merge) makes a new executable
 * graph in that slot. A capture that fails for any reason but a dead
 * device is thrown away and the same calls are made directly; after a few
 * such failures graphs are turned off with a warning. A faulting graph
 * fails its step like any faulting kernel: the completion event reports
 * the sticky error (ATTND_EDEVICE). */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Capture failures after which graphs are turned off. */
#define CU_GRAPH_FAILS_MAX 3

static uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

static uint64_t shape_key(const attnd_job_t *job) {
  const attnd_kbatch_t *b = &job->batch;
  uint64_t h = 0x2545f4914f6cdd1dull;
  h = mix(h, (uint64_t)b->nitems);
  h = mix(h, (uint64_t)b->total_q);
  h = mix(h, (uint64_t)b->q_only_rows);
  h = mix(h, (uint64_t)b->max_n);
  h = mix(h, (uint64_t)job->nmeta);
  h = mix(h, job->q_bytes);
  h = mix(h, job->kv_bytes);
  h = mix(h, job->out_bytes);
  h = mix(h, job->lse_bytes && b->lse ? job->lse_bytes : 0);
  h = mix(h, (uint64_t)(job->inputs_pinned | job->outputs_pinned << 1));
  return h ? h : 1;
}

static cu_graph_t *find(cu_stream_t *cs, uint64_t key) {
  for (int i = 0; i < CU_GRAPHS; i++)
    if (cs->graphs[i].key == key)
      return &cs->graphs[i];
  return NULL;
}

/* The slot a new shape takes: an empty one, else the least recently used. */
static cu_graph_t *victim(cu_stream_t *cs) {
  cu_graph_t *v = &cs->graphs[0];
  for (int i = 0; i < CU_GRAPHS; i++) {
    if (!cs->graphs[i].key)
      return &cs->graphs[i];
    if (cs->graphs[i].used < v->used)
      v = &cs->graphs[i];
  }
  if (v->exec)
    cudaGraphExecDestroy(v->exec);
  v->exec = NULL;
  v->key = 0;
  return v;
}

int attnd_cu_graph_begin(cu_backend_t *be, cu_run_t *r) {
  const attnd_job_t *job = r->job;
  if (!be->graphs || r->path != 1 || job->kind != ATTND_JOB_STEP || job->device_io ||
      atomic_load(&be->dead))
    return 0;
  cu_stream_t *cs = &be->streams[r->stream];
  const uint64_t key = shape_key(job);
  cu_graph_t *g = find(cs, key);
  if (!g && be->graphs == 1) {
    /* First step of this shape: run directly, remember the shape. */
    g = victim(cs);
    g->key = key;
    g->used = ++be->graph_tick;
    return 0;
  }
  if (cudaStreamBeginCapture(cs->st, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  r->graphed = 1;
  return 1;
}

/* A capture that gave nothing to launch: 1 (the caller makes the same calls
 * directly), with the run's error, if any, cleared; 0 when the device is
 * dead (the run keeps its error). */
static int capture_failed(cu_backend_t *be, cu_run_t *r, const char *what, cudaError_t e) {
  cudaGetLastError();
  r->graphed = 0;
  be->graph_capture_fails++;
  if (atomic_load(&be->dead) || (e != cudaSuccess && attnd_cu_sticky(e))) {
    if (!r->status)
      attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, what, e);
    return 0;
  }
  if (be->graph_capture_fails >= CU_GRAPH_FAILS_MAX && be->graph_builds == 0) {
    ATTND_LOGW("cuda_graphs", "err=\"%s: %s; graphs turned off\"", what, cudaGetErrorString(e));
    be->graphs = 0;
  }
  r->status = 0;
  r->msg[0] = 0;
  return 1;
}

int attnd_cu_graph_end(cu_backend_t *be, cu_run_t *r) {
  cu_stream_t *cs = &be->streams[r->stream];
  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamEndCapture(cs->st, &graph);
  if (r->status || e != cudaSuccess || !graph) {
    if (graph)
      cudaGraphDestroy(graph);
    return capture_failed(be, r, "cudaStreamEndCapture", e);
  }
  const uint64_t key = shape_key(r->job);
  cu_graph_t *g = find(cs, key);
  if (g && g->exec) {
    cudaGraphExecUpdateResultInfo info;
    if (cudaGraphExecUpdate(g->exec, graph, &info) != cudaSuccess) {
      /* Another topology than the one instantiated: a new one below. */
      cudaGetLastError();
      be->graph_update_fails++;
      cudaGraphExecDestroy(g->exec);
      g->exec = NULL;
    }
  }
  if (!g)
    g = victim(cs);
  if (!g->exec) {
    e = cudaGraphInstantiate(&g->exec, graph, 0);
    if (e != cudaSuccess) {
      g->exec = NULL;
      g->key = 0;
      cudaGraphDestroy(graph);
      return capture_failed(be, r, "cudaGraphInstantiate", e);
    }
    be->graph_builds++;
  }
  cudaGraphDestroy(graph);
  g->key = key;
  g->used = ++be->graph_tick;
  /* The trace's marks inside the graph were not recorded: the whole
   * sequence shows as the attend interval (cuda_trace.c). */
  attnd_cu_trace_mark_graph(r, 1, cs->st);
  attnd_cu_trace_mark_graph(r, 2, cs->st);
  e = cudaGraphLaunch(g->exec, cs->st);
  if (e != cudaSuccess) {
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, "cudaGraphLaunch", e);
    return 0;
  }
  attnd_cu_trace_mark_graph(r, 3, cs->st);
  attnd_cu_trace_mark_graph(r, 4, cs->st);
  be->graph_steps++;
  return 0;
}

void attnd_cu_graphs_release(cu_backend_t *be) {
  for (int i = 0; i < 2 * be->nstreams; i++)
    for (int j = 0; j < CU_GRAPHS; j++) {
      cu_graph_t *g = &be->streams[i].graphs[j];
      if (g->exec)
        cudaGraphExecDestroy(g->exec);
      g->exec = NULL;
      g->key = 0;
    }
  cudaGetLastError();
}

#endif /* ATTND_HAVE_CUDA */

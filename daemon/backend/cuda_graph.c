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
 * bytes, lse, pinned inputs or outputs. Each stream keeps CU_GRAPHS_PER_LAYER
 * shapes for each layer it serves (internal.h), the least recently used
 * replaced; a shape gets its executable graph at
 * its second step (its first runs directly: no graph memory for a shape
 * seen once), so graph memory is made lazily, a few hundred KiB per shape,
 * at most ngraphs per stream. An update the runtime refuses (the kernels
 * chose another topology, e.g. a split with a merge) makes a new executable
 * graph in that slot.
 *
 * Replay (--cuda-graph-replay, on by default): capturing and updating cost
 * more host time than the direct calls (every call recorded, then the
 * runtime's comparison of two graphs). Most steps of a decode loop launch
 * exactly what the step before them did on that layer: the staging
 * buffers are the stream's, the kernels read the new context from the items
 * in device memory, and the plan (parts, CTAs) changes only every few dozen
 * tokens. So a slot is one shape of one layer and keeps the launch print of
 * what its graph holds (attnd_cuda_step_print: every kernel, grid and
 * argument, computed on the host without enqueuing) and its staging
 * buffers; a step with the same print and buffers launches the graph as it
 * is: one cudaGraphLaunch. The staging buffer of a shape's graph is handed
 * out to that shape's next step where it is free (cuda_enqueue.c); a shape
 * keeps up to CU_GRAPH_COPIES graphs, each over its own buffer, so that two
 * of its steps in flight at once (two micro-batches of a layer) each find
 * theirs. A step
 * over client memory (same-host zero-copy, backend.h device_io) replays
 * when its tensors' addresses are those its graph was made with (a client
 * that keeps its buffers). Steps with inputs or outputs in pinned frames
 * (their addresses change each step) and write-only steps are captured as
 * before. A capture that fails for any reason but a dead
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
  h = mix(h, (uint64_t)job->layer);
  h = mix(h, (uint64_t)b->nitems);
  h = mix(h, (uint64_t)b->total_q);
  h = mix(h, (uint64_t)b->q_only_rows);
  h = mix(h, (uint64_t)b->max_n);
  h = mix(h, (uint64_t)job->nmeta);
  h = mix(h, job->q_bytes);
  h = mix(h, job->kv_bytes);
  h = mix(h, job->out_bytes);
  h = mix(h, job->lse_bytes && b->lse ? job->lse_bytes : 0);
  h = mix(h, (uint64_t)(job->inputs_pinned | job->outputs_pinned << 1 | job->device_io << 2));
  return h ? h : 1;
}

static cu_graph_t *find(cu_stream_t *cs, uint64_t key) {
  for (int i = 0; i < cs->ngraphs; i++)
    if (cs->graphs[i].key == key)
      return &cs->graphs[i];
  return NULL;
}

/* The slot a new shape takes: an empty one, else the least recently used. */
static cu_graph_t *victim(cu_stream_t *cs) {
  cu_graph_t *v = &cs->graphs[0];
  for (int i = 0; i < cs->ngraphs; i++) {
    if (!cs->graphs[i].key)
      return &cs->graphs[i];
    if (cs->graphs[i].used < v->used)
      v = &cs->graphs[i];
  }
  if (v->exec)
    cudaGraphExecDestroy(v->exec);
  v->exec = NULL;
  v->key = 0;
  v->print = 0;
  v->hp = v->dp = NULL;
  v->qsrc = NULL;
  return v;
}

static int graphable(const cu_backend_t *be, const cu_run_t *r) {
  const attnd_job_t *job = r->job;
  return be->graphs && r->path == 1 && job->kind == ATTND_JOB_STEP && !atomic_load(&be->dead);
}

cu_stage_t *attnd_cu_graph_stage_get(cu_backend_t *be, cu_run_t *r, size_t need, int *cerr) {
  const uint8_t *pref[CU_GRAPH_COPIES];
  int n = 0;
  if (graphable(be, r) && be->graph_replay) {
    const cu_stream_t *cs = &be->streams[r->stream];
    const uint64_t key = shape_key(r->job);
    for (int i = 0; i < cs->ngraphs && n < CU_GRAPH_COPIES; i++)
      if (cs->graphs[i].key == key && cs->graphs[i].exec && cs->graphs[i].hp)
        pref[n++] = cs->graphs[i].hp;
  }
  return attnd_cu_stage_get_pref(be, need, pref, n, cerr);
}

/* The slot a capture of key over the staging buffer hp goes into: the
 * shape's graph over hp, or its placeholder (a shape seen once); with replay
 * a new slot while the shape has fewer than CU_GRAPH_COPIES graphs (NULL:
 * the caller takes a victim), else its least recently used one. Without
 * replay a shape has one graph, updated by every step. */
static cu_graph_t *slot_for(const cu_backend_t *be, cu_stream_t *cs, uint64_t key,
                            const uint8_t *hp) {
  cu_graph_t *lru = NULL;
  int n = 0;
  for (int i = 0; i < cs->ngraphs; i++) {
    cu_graph_t *g = &cs->graphs[i];
    if (g->key != key)
      continue;
    if (!g->exec || !be->graph_replay || g->hp == hp)
      return g;
    n++;
    if (!lru || g->used < lru->used)
      lru = g;
  }
  return n < CU_GRAPH_COPIES ? NULL : lru;
}

/* The stream's graph g, launched as it is (no capture). */
static void launch_as_is(cu_backend_t *be, cu_run_t *r, cu_graph_t *g) {
  cu_stream_t *cs = &be->streams[r->stream];
  r->graphed = 1;
  g->used = ++be->graph_tick;
  attnd_cu_trace_mark_graph(r, 1, cs->st);
  attnd_cu_trace_mark_graph(r, 2, cs->st);
  cudaError_t e = cudaGraphLaunch(g->exec, cs->st);
  if (e != cudaSuccess) {
    attnd_cu_run_fail_cuda(r, __FILE__, __LINE__, "cudaGraphLaunch", e);
    return;
  }
  attnd_cu_trace_mark_graph(r, 3, cs->st);
  attnd_cu_trace_mark_graph(r, 4, cs->st);
  be->graph_steps++;
  be->graph_replays++;
}

int attnd_cu_graph_begin(cu_backend_t *be, cu_run_t *r, const attnd_kbatch_t *db,
                         const uint8_t *hp, const uint8_t *dp) {
  const attnd_job_t *job = r->job;
  r->gprint = 0;
  if (!graphable(be, r))
    return 0;
  cu_stream_t *cs = &be->streams[r->stream];
  const uint64_t key = shape_key(job);
  cu_graph_t *g = find(cs, key);
  /* Replayable: staged inputs and outputs (their copies' addresses are the
   * staging buffers'), or client memory (its addresses: q's copy source
   * below, k, v, out and lse in the kernels' arguments), and the attention
   * (the launch print covers attnd_cuda_step's launches). */
  if (be->graph_replay && !job->inputs_pinned && !job->outputs_pinned && db->total_q > 0 &&
      job->out_bytes) {
    r->gprint = attnd_cuda_step_print(&be->base.shape, db, cs->ws, cs->ws ? cs->wcap : 0);
    const void *qsrc = job->device_io ? job->batch.q : NULL;
    for (int i = 0; r->gprint && i < cs->ngraphs; i++) {
      cu_graph_t *c = &cs->graphs[i];
      if (c->key == key && c->exec && c->print == r->gprint && c->hp == hp && c->dp == dp &&
          c->qsrc == qsrc) {
        launch_as_is(be, r, c);
        return 2;
      }
    }
  }
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
  cu_graph_t *g = slot_for(be, cs, key, r->stage ? r->stage->p : NULL);
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
  /* What the exec now holds: the next step with the same print and buffers
   * launches it as it is. */
  g->print = r->gprint;
  g->hp = r->stage ? r->stage->p : NULL;
  g->dp = cs->dbuf;
  g->qsrc = r->job->device_io ? r->job->batch.q : NULL;
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
    for (int j = 0; j < be->streams[i].ngraphs; j++) {
      cu_graph_t *g = &be->streams[i].graphs[j];
      if (g->exec)
        cudaGraphExecDestroy(g->exec);
      g->exec = NULL;
      g->key = 0;
    }
  cudaGetLastError();
}

#endif /* ATTND_HAVE_CUDA */

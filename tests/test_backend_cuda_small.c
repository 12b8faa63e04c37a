/* test_backend_cuda_small.c: small steps' submission and completion: --cuda-completion
 * loop (daemon/backend/cuda_complete.c) and --cuda-graphs (cuda_graph.c),
 * part of test_backend_cuda (on a GPU and over tests/cuda_mock.c).
 *
 * The loop thread polls pending runs' events itself while they are out, next
 * to the poller thread; both hand completions over in one queue. Checked
 * here with a window long enough that the loop's polling is always on:
 * prefills and decode chains of two layers submitted back to back (each
 * decode reads the keys of the steps before it) give the CPU backend's
 * outputs and lse, each layer's jobs finish in submission order, and the
 * loop did complete some of them (the backend's stats). The whole suite
 * and the fault test run again under --loop (tests/backend_cuda.cmake),
 * once with --hostfn-min=0, which leaves every run with an output copy to
 * the poller thread.
 *
 * --cuda-graphs (daemon/backend/cuda_graph.c): the same chain gives the same
 * outputs and order with small steps launched as graphs, exactly the steps
 * expected go as graphs, and a refused update makes a new graph; the suite
 * and the fault test (a faulting graph) run again under --graphs. With
 * --cuda-graph-replay, a step whose launch print and staging buffers equal
 * its graph's launches that graph as it is (test_graph_replay). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_fixture.h"

enum { DECODES = 6, PER_LAYER = 1 + DECODES, NJOBS = LAYERS * PER_LAYER };

/* The mock's graph counters and knob (tests/cuda_mock.c); NULL on a device. */
int attnd_cuda_mock_graph_launches(void) __attribute__((weak));
void attnd_cuda_mock_refuse_updates(int n) __attribute__((weak));

/* Submits the layers' prefills, then their decodes alternating (layer 0
 * token 0, layer 1 token 0, layer 0 token 1, ...; odd tokens with fp32
 * outputs: two decode shapes), all back to back, on a fresh CUDA backend
 * with g_opts; checks every output and lse against the CPU backend's and
 * each layer's completion order; returns the CUDA backend's stats. seq: the
 * CUDA backend gets one job at a time, each after the one before finished
 * (a decode loop at depth 1). layers: the backends' layer count (LAYERS in
 * run_chain). devio (with seq): each CUDA step over client memory
 * (backend.h device_io), the same pinned block for every step of a shape and
 * layer, as a same-host client that keeps its tensors. pairs (with seq): two
 * sessions a layer, each step of the one submitted together with the same
 * step of the other (two micro-batches of one shape in flight at once: fp32
 * outputs on neither, so one decode shape). */
static attnd_backend_stats_t run_chain_layers(int seq, int layers, int devio, int pairs) {
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *cpu = NULL, *gpu = NULL;
  assert_int_equal(
      attnd_backend_cpu_create(&cpu, &loop, &s, layers, opts(64ull << 20), err, sizeof(err)), 0);
  assert_int_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, layers, opts(64ull << 20), err, sizeof(err)), 0);
  const int ways = pairs ? 2 : 1;
  const int njobs = layers * PER_LAYER * ways;
  tjob_spec_t *sp = calloc((size_t)njobs, sizeof(*sp));
  int *layer_of = calloc((size_t)njobs, sizeof(int));
  tjob_t *jc = calloc((size_t)njobs, sizeof(*jc)), *jg = calloc((size_t)njobs, sizeof(*jg));
  assert_true(sp && layer_of && jc && jg);
  int n = 0;
  /* t -1: the prefills; session w of layer l owns blocks 2 (2l + w) and the next. */
  for (int t = -1; t < DECODES; t++)
    for (int l = 0; l < layers; l++)
      for (int w = 0; w < ways; w++) {
        const int b0 = 2 * (ways * l + w);
        titem_t it = {.start = t < 0 ? 0 : 20 + t,
                      .n = t < 0 ? 20 : 1,
                      .has_q = 1,
                      .mask = ATTND_MASK_CAUSAL,
                      .table = {b0, b0 + 1},
                      .nb = 2};
        layer_of[n] = l;
        spec_step(&sp[n++], l, &it, 1, t >= 0 && !pairs && t % 2, 1);
      }
  assert_int_equal(n, njobs);
  int dummy = 0;
  for (int i = 0; i < njobs; i++) {
    job_from_spec(&jc[i], &sp[i], &dummy);
    job_from_spec(&jg[i], &sp[i], &dummy);
  }
  run_all(&loop, cpu, jc, njobs);
  uint8_t **blocks = calloc((size_t)layers * 3, sizeof(uint8_t *));
  assert_non_null(blocks);
  if (seq && pairs)
    for (int i = 0; i < njobs; i += 2)
      run_all(&loop, gpu, &jg[i], 2);
  else if (seq)
    for (int i = 0; i < njobs; i++) {
      devio_t d;
      memset(&d, 0, sizeof(d));
      if (devio) /* the prefill's block, and one for each decode shape */
        io_in_block(gpu, &jg[i].job, &d,
                    &blocks[layer_of[i] * 3 + (sp[i].Tq > 1 ? 2 : sp[i].fp32_out)]);
      run_all(&loop, gpu, &jg[i], 1);
      if (devio) {
        assert_true(*d.done == d.done_value); /* raised after the kernels, graph or not */
        assert_memory_equal(jg[i].job.batch.q, sp[i].q, jg[i].job.q_bytes); /* q as sent */
        io_out(&jg[i].job, &d);
      }
    }
  else
    run_all(&loop, gpu, jg, njobs);
  double worst = 0, worst_lse = 0;
  for (int i = 0; i < njobs; i++) {
    if (jg[i].job.status)
      fail_msg("cuda job %d: %s", i, jg[i].job.message);
    assert_int_equal(jc[i].job.status, 0);
    const size_t rows = (size_t)sp[i].Tq;
    double r = rel_l2_out(&jg[i], &jc[i], rows * QH * HD);
    if (!(r <= worst))
      worst = r;
    for (size_t e = 0; e < rows * QH; e++) {
      double x = jg[i].job.batch.lse[e], y = jc[i].job.batch.lse[e];
      double dl = fabs(x - y) - 1e-4 * (1 + fabs(y));
      if (!(dl <= worst_lse))
        worst_lse = isfinite(dl) ? dl : INFINITY;
    }
    /* Per-layer order: every earlier job of its layer finished before it
     * (among the jobs submitted together: done_seq counts per run_all). */
    for (int j = seq ? i - i % ways : 0; j < i; j++)
      if (layer_of[j] == layer_of[i] && jg[j].done_seq > jg[i].done_seq)
        fail_msg("layer %d: job %d finished before job %d", layer_of[i], i, j);
  }
  attnd_backend_stats_t st;
  memset(&st, 0, sizeof(st));
  assert_non_null(gpu->ops->stats);
  gpu->ops->stats(gpu, &st);
  print_message("%d jobs: %llu completed by the loop, %llu as graphs (%llu made); worst rel L2 "
                "%.3e, worst |lse - cpu| - 1e-4 (1 + |cpu|) %.3e\n",
                njobs, (unsigned long long)st.loop_done, (unsigned long long)st.graph_steps,
                (unsigned long long)st.graph_builds, worst, worst_lse);
  assert_true(worst <= ATTND_TOL_BACKENDS);
  assert_true(worst_lse <= ATTND_TOL_CUDA_LSE_ABS);
  for (int i = 0; i < njobs; i++) {
    job_free(&jc[i]);
    job_free(&jg[i]);
    spec_free(&sp[i]);
  }
  for (int i = 0; i < layers * 3; i++)
    if (blocks[i])
      gpu->ops->host_free(gpu, blocks[i]);
  free(blocks);
  free(sp);
  free(layer_of);
  free(jc);
  free(jg);
  cpu->ops->destroy(cpu);
  destroy_and_close(&loop, gpu);
  assert_int_equal(uv_loop_close(&loop), 0);
  return st;
}

static attnd_backend_stats_t run_chain(int seq) { return run_chain_layers(seq, LAYERS, 0, 0); }

void test_loop_completion(void **state) {
  (void)state;
  SKIP_WITHOUT_GPU();
  g_opts.cuda_callbacks = 0;                 /* loop polling is the poller's mode */
  g_opts.cuda_spin_us = 10ull * 1000 * 1000; /* always on while runs are out */
  /* --hostfn-min=0: every job here has an lse to copy out, so the loop must
   * leave all of them to the poller thread. */
  const int handoff = g_opts.cuda_hostfn_min == 0;
  attnd_backend_stats_t st = run_chain(0);
  /* The poller thread stands by while the loop polls (its window outlasts
   * the test here): the loop completes every job, or none when each has a
   * copy to leave to the poller. */
  assert_int_equal(st.loop_done, handoff ? 0 : NJOBS);
}

/* --cuda-graphs: a shape's first step on a stream runs directly, the later
 * ones as graph launches (each layer here has its own stream: a prefill
 * shape and two decode shapes per stream, DECODES / 2 steps of each decode
 * shape). Then graphs from a shape's first step, with two updates refused
 * (the mock only): every step a graph, two more executable graphs made. */
void test_graph_steps(void **state) {
  (void)state;
  SKIP_WITHOUT_GPU();
  /* Capture and update only (replay: test_graph_replay): with every job in
   * flight at once, how many steps find their graph's buffers free depends
   * on timing, and with it how many updates the refusals below meet. */
  g_opts.cuda_graph_replay = 0;
  g_opts.cuda_graphs = 1;
  attnd_backend_stats_t st = run_chain(0);
  assert_int_equal(st.graph_steps, (uint64_t)LAYERS * (DECODES - 2));
  if (attnd_cuda_mock_graph_launches)
    assert_int_equal(st.graph_builds, (uint64_t)LAYERS * 2);
  g_opts.cuda_graphs = 2;
  if (attnd_cuda_mock_refuse_updates)
    attnd_cuda_mock_refuse_updates(2);
  st = run_chain(0);
  assert_int_equal(st.graph_steps, (uint64_t)NJOBS);
  if (attnd_cuda_mock_refuse_updates)
    assert_int_equal(st.graph_builds, (uint64_t)LAYERS * 3 + 2);
}

/* --cuda-graph-replay: the chain one step at a time, graphs from a shape's
 * first step. Each layer has a prefill shape and two decode shapes (bf16 and
 * fp32 outputs), DECODES / 2 steps of each; a shape's first step is
 * captured, and its later ones find the same launches (the contexts grow
 * inside the items in device memory; the plan of these short contexts stays)
 * and the same staging buffer (handed back to the shape), so they launch the
 * graph as it is: DECODES - 2 per layer. Outputs and lse as the CPU
 * backend's throughout (run_chain). Replay off: every step captured. */
void test_graph_replay(void **state) {
  (void)state;
  SKIP_WITHOUT_GPU();
  g_opts.cuda_graphs = 2;
  g_opts.cuda_graph_replay = 1;
  attnd_backend_stats_t st = run_chain(1);
  assert_int_equal(st.graph_steps, (uint64_t)NJOBS);
  assert_int_equal(st.graph_replays, (uint64_t)LAYERS * (DECODES - 2));
  g_opts.cuda_graph_replay = 0;
  st = run_chain(1);
  assert_int_equal(st.graph_steps, (uint64_t)NJOBS);
  assert_int_equal(st.graph_replays, 0);
}

/* More layers than streams (40 layers on 8 streams, 5 a stream): a decode
 * loop visits a stream's layers in turn, three shapes each (the prefill and
 * two decode shapes), 15 a stream. Every slot must hold until its shape comes
 * back: with fewer slots than that the least recently used is always the
 * next one needed and nothing would replay. */
void test_graph_replay_layers(void **state) {
  (void)state;
  SKIP_WITHOUT_GPU();
  g_opts.cuda_graphs = 2;
  g_opts.cuda_graph_replay = 1;
  const int layers = 40;
  attnd_backend_stats_t st = run_chain_layers(1, layers, 0, 0);
  assert_int_equal(st.graph_steps, (uint64_t)layers * PER_LAYER);
  assert_int_equal(st.graph_replays, (uint64_t)layers * (DECODES - 2));
  assert_int_equal(st.graph_builds, (uint64_t)layers * 3);
}

/* Same-host zero-copy (backend.h device_io): a client stepping over the same
 * tensors each time (q, k, v, out, lse at the same addresses for a shape)
 * replays as a staged step does, DECODES - 2 steps per layer; the done
 * signal (after the graph) is raised every step, the client's q is left as
 * sent, outputs and lse are the CPU backend's. */
void test_graph_replay_devio(void **state) {
  (void)state;
  SKIP_WITHOUT_GPU();
  g_opts.cuda_hostfn_min = 0; /* every block pinned */
  g_opts.cuda_graphs = 2;
  g_opts.cuda_graph_replay = 1;
  attnd_backend_stats_t st = run_chain_layers(1, LAYERS, 1, 0);
  assert_int_equal(st.graph_steps, (uint64_t)NJOBS);
  assert_int_equal(st.graph_replays, (uint64_t)LAYERS * (DECODES - 2));
}

/* Two micro-batches of one shape on each layer, both in flight at once:
 * they take two staging buffers, and each buffer keeps its own graph
 * (CU_GRAPH_COPIES), so after the first pair of each shape (the prefills,
 * the first decodes: four graphs a layer) every step replays, 2 (DECODES - 1)
 * a layer. One graph a shape would replay one of each pair and capture the
 * other over the buffer its graph no longer holds. */
void test_graph_replay_pairs(void **state) {
  (void)state;
  SKIP_WITHOUT_GPU();
  g_opts.cuda_graphs = 2;
  g_opts.cuda_graph_replay = 1;
  attnd_backend_stats_t st = run_chain_layers(1, LAYERS, 0, 1);
  assert_int_equal(st.graph_steps, (uint64_t)LAYERS * PER_LAYER * 2);
  assert_int_equal(st.graph_replays, (uint64_t)LAYERS * 2 * (DECODES - 1));
  assert_int_equal(st.graph_builds, (uint64_t)LAYERS * 4);
}

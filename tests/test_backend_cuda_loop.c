/* test_backend_cuda_loop.c: --cuda-completion loop (daemon/backend/cuda_complete.c),
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
 * the poller thread. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_fixture.h"

enum { DECODES = 6, PER_LAYER = 1 + DECODES, NJOBS = LAYERS * PER_LAYER };

void test_loop_completion(void **state) {
  (void)state;
  SKIP_WITHOUT_GPU();
  g_opts.cuda_callbacks = 0;                      /* loop polling is the poller's mode */
  g_opts.cuda_spin_us = 10ull * 1000 * 1000; /* always on while runs are out */
  /* --hostfn-min=0: every job here has an lse to copy out, so the loop must
   * leave all of them to the poller thread. */
  const int handoff = g_opts.cuda_hostfn_min == 0;
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *cpu = NULL, *gpu = NULL;
  assert_int_equal(
      attnd_backend_cpu_create(&cpu, &loop, &s, LAYERS, opts(64ull << 20), err, sizeof(err)), 0);
  assert_int_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, LAYERS, opts(64ull << 20), err, sizeof(err)), 0);
  /* Submission order: the layers' prefills, then their decodes alternating
   * (layer 0 token 0, layer 1 token 0, layer 0 token 1, ...). */
  tjob_spec_t sp[NJOBS];
  int layer_of[NJOBS];
  int n = 0;
  for (int l = 0; l < LAYERS; l++) {
    titem_t pre = {.start = 0,
                   .n = 20,
                   .has_q = 1,
                   .mask = ATTND_MASK_CAUSAL,
                   .table = {2 * l, 2 * l + 1},
                   .nb = 2};
    layer_of[n] = l;
    spec_step(&sp[n++], l, &pre, 1, 0, 1);
  }
  for (int t = 0; t < DECODES; t++)
    for (int l = 0; l < LAYERS; l++) {
      titem_t dec = {.start = 20 + t,
                     .n = 1,
                     .has_q = 1,
                     .mask = ATTND_MASK_CAUSAL,
                     .table = {2 * l, 2 * l + 1},
                     .nb = 2};
      layer_of[n] = l;
      spec_step(&sp[n++], l, &dec, 1, t % 2, 1);
    }
  assert_int_equal(n, NJOBS);
  tjob_t jc[NJOBS], jg[NJOBS];
  int dummy = 0;
  for (int i = 0; i < NJOBS; i++) {
    job_from_spec(&jc[i], &sp[i], &dummy);
    job_from_spec(&jg[i], &sp[i], &dummy);
  }
  run_all(&loop, cpu, jc, NJOBS);
  run_all(&loop, gpu, jg, NJOBS);
  double worst = 0, worst_lse = 0;
  for (int i = 0; i < NJOBS; i++) {
    if (jg[i].job.status)
      fail_msg("cuda job %d: %s", i, jg[i].job.message);
    assert_int_equal(jc[i].job.status, 0);
    const size_t rows = (size_t)sp[i].Tq;
    double r = rel_l2_out(&jg[i], &jc[i], rows * QH * HD);
    if (r > worst)
      worst = r;
    for (size_t e = 0; e < rows * QH; e++) {
      double x = jg[i].job.batch.lse[e], y = jc[i].job.batch.lse[e];
      double dl = fabs(x - y) - 1e-4 * (1 + fabs(y));
      if (!(dl <= worst_lse))
        worst_lse = isfinite(dl) ? dl : INFINITY;
    }
    /* Per-layer order: every earlier job of its layer finished before it. */
    for (int j = 0; j < i; j++)
      if (layer_of[j] == layer_of[i] && jg[j].done_seq > jg[i].done_seq)
        fail_msg("layer %d: job %d finished before job %d", layer_of[i], i, j);
  }
  attnd_backend_stats_t st;
  memset(&st, 0, sizeof(st));
  assert_non_null(gpu->ops->stats);
  gpu->ops->stats(gpu, &st);
  print_message("loop completion: %d jobs, %llu completed by the loop, worst rel L2 %.3e, "
                "worst |lse - cpu| - 1e-4 (1 + |cpu|) %.3e\n",
                NJOBS, (unsigned long long)st.loop_done, worst, worst_lse);
  assert_true(worst <= ATTND_TOL_BACKENDS);
  assert_true(worst_lse <= ATTND_TOL_CUDA_LSE_ABS);
  /* The poller thread may win some rounds, not all of them: it sleeps 20 us
   * between its rounds while the loop polls on every turn. */
  if (handoff) {
    assert_int_equal(st.loop_done, 0);
  } else {
    assert_true(st.loop_done >= 1);
    assert_true(st.loop_done <= NJOBS);
  }
  for (int i = 0; i < NJOBS; i++) {
    job_free(&jc[i]);
    job_free(&jg[i]);
    spec_free(&sp[i]);
  }
  cpu->ops->destroy(cpu);
  destroy_and_close(&loop, gpu);
  assert_int_equal(uv_loop_close(&loop), 0);
}

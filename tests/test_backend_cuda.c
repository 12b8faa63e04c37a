/* test_backend_cuda.c: the CUDA backend (daemon/backend/cuda_*.c) against the CPU
 * backend on the same jobs, through a real uv loop.
 *
 * Every test skips when attnd_backend_cuda_available() == 0 (no GPU, or a build
 * without CUDA). With a device: two layers, a prefill step (causal, sliding
 * window and a write-only item, lse asked), a decode step submitted right
 * behind it without waiting (it reads the blocks the prefill wrote: per-layer
 * ordering), a COPY job and a step that reads the copied block, for bf16 and
 * int8_dynamic caches. Every output must match the CPU backend's within
 * ATTND_TOL_BACKENDS (lse within ATTND_TOL_CUDA_LSE_ABS, tests/tolerance.h); outputs are poisoned
 * before the run. Then: jobs of many layers in flight at once, and the loop closes cleanly.
 *
 * Arguments set the backend's options as the daemon's flags would:
 * --callback / --loop (--cuda-completion callback / loop), --graphs
 * (--cuda-graphs, from a shape's first step), --trace (--cuda-trace) and
 * --hostfn-min=N (--cuda-hostfn-min). --fault runs only
 * the fault test instead: a block table that points far outside the pool
 * makes the kernel fault; the job must fail with ATTND_EDEVICE (or
 * ATTND_ECUDA), every later job with ATTND_EDEVICE, and teardown must not
 * hang. It leaves the CUDA context unusable, hence the separate run (also
 * with --hostfn-min=0: host functions that a sticky error skips must not
 * leave a job unanswered); --ring-fault likewise runs only
 * test_backend_cuda_ring.c's fault test
 * (--ring-fault-pinned: with the step's frame and output pinned). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_fixture.h"

/* The scenario, per layer in this order: prefill, a decode right behind it
 * (it reads blocks the prefill writes), a COPY of A's first block into block
 * 40, a step reading the copy (session C) and A's next decode token. Layers
 * interleave irregularly in submission order. */
static int build_scenario(tjob_spec_t *sp) {
  int n = 0;
  for (int l = 0; l < LAYERS; l++) {
    titem_t pre[3] = {
        {.start = 0, .n = 20, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {0, 1}, .nb = 2},
        {.start = 0,
         .n = 7,
         .has_q = 1,
         .mask = ATTND_MASK_SLIDING,
         .param = 4,
         .table = {4},
         .nb = 1},
        {.start = 0, .n = 5, .has_q = 0, .mask = ATTND_MASK_CAUSAL, .table = {6}, .nb = 1},
    };
    spec_step(&sp[n++], l, pre, 3, 0, 1);
    /* Right behind the prefill of the same layer, before the other layer's:
     * any mapping of jobs to streams other than by layer breaks this. */
    titem_t dec[2] = {
        {.start = 20, .n = 1, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {0, 1}, .nb = 2},
        {.start = 7, .n = 1, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {4}, .nb = 1},
    };
    spec_step(&sp[n++], l, dec, 2, 1, 1);
  }
  for (int l = LAYERS - 1; l >= 0; l--)
    spec_copy(&sp[n++], l, 0, 40);
  for (int l = 0; l < LAYERS; l++) {
    titem_t rd[2] = {
        {.start = 16, .n = 1, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {40, 41}, .nb = 2},
        {.start = 21, .n = 1, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {0, 1}, .nb = 2},
    };
    spec_step(&sp[n++], l, rd, 2, 0, 0);
  }
  /* Split context (docs/scale-out.md): a prefill of session D written with
   * RoPE at positions 100.. (pos_base) beside an attend-only item over A's 22
   * keys (no k/v rows, q rotated at 5 + 20.., nothing written); then an
   * attend-only step alone (no k or v at all). */
  for (int l = 0; l < LAYERS; l++) {
    titem_t sc[2] = {
        {.start = 0,
         .n = 3,
         .has_q = 1,
         .mask = ATTND_MASK_CAUSAL,
         .table = {8},
         .nb = 1,
         .pos_base = 100},
        {.start = 20,
         .n = 2,
         .mask = ATTND_MASK_FULL,
         .table = {0, 1},
         .nb = 2,
         .q_only = 1,
         .pos_base = 5},
    };
    spec_step(&sp[n++], l, sc, 2, 1, 1);
    titem_t qo[1] = {
        {.start = 2,
         .n = 1,
         .mask = ATTND_MASK_SLIDING,
         .param = 2,
         .table = {8},
         .nb = 1,
         .q_only = 1,
         .pos_base = 101},
    };
    spec_step(&sp[n++], l, qo, 1, 1, 1);
  }
  return n;
}

/* test_pinned_frames: q, k and v in the backend's frame memory (how many:
 * g_frames_pinned, backend_cuda_fixture.h). */
static int g_frames;
/* test_device_io: q, k, v, out and lse in client device memory. */
static int g_devio;

static void compare_backends(attnd_kv_type_t kv) {
  SKIP_WITHOUT_GPU();
  attnd_kshape_t s = make_shape(kv);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *cpu = NULL, *gpu = NULL;
  uint64_t kvmem = 64ull << 20;
  assert_int_equal(attnd_backend_cpu_create(&cpu, &loop, &s, LAYERS, opts(kvmem), err, sizeof(err)),
                   0);
  int rc = attnd_backend_cuda_create(&gpu, &loop, &s, LAYERS, opts(kvmem), err, sizeof(err));
  if (rc)
    fail_msg("attnd_backend_cuda_create: %s (%s)", attnd_strerror(rc), err);
  assert_int_equal(gpu->num_blocks, cpu->num_blocks);
  assert_int_equal(gpu->block_bytes, cpu->block_bytes);
  assert_string_equal(gpu->ops->name, "cuda");
  char dev[128];
  uint64_t mem = 0;
  int cc = 0;
  gpu->ops->describe(gpu, dev, sizeof(dev), &mem, &cc);
  print_message("device: %s, %llu bytes, cc %d, %u blocks/layer\n", dev, (unsigned long long)mem,
                cc, gpu->num_blocks);
  assert_true(mem > 0);
  assert_true(cc >= 10);

  tjob_spec_t sp[16];
  int n = build_scenario(sp);
  tjob_t jc[16], jg[16];
  void *frames[16] = {NULL}, *outs[16] = {NULL};
  devio_t dio[16] = {{NULL, NULL, NULL, NULL, 0}};
  int dummy = 0;
  for (int i = 0; i < n; i++) {
    job_from_spec(&jc[i], &sp[i], &dummy);
    job_from_spec(&jg[i], &sp[i], &dummy);
    if (g_devio && sp[i].kind == ATTND_JOB_STEP)
      io_in_pinned(gpu, &jg[i].job, &dio[i]);
    if (g_frames && sp[i].kind == ATTND_JOB_STEP) {
      frames[i] = inputs_in_frame(gpu, &jg[i].job);
      outs[i] = output_in_host_memory(gpu, &jg[i].job);
    }
  }
  run_all(&loop, cpu, jc, n);
  uint64_t t0 = uv_hrtime();
  run_all(&loop, gpu, jg, n);
  double ms = (double)(uv_hrtime() - t0) / 1e6;
  double worst = 0, worst_lse = 0;
  for (int i = 0; i < n; i++) {
    if (jc[i].job.status)
      fail_msg("cpu job %d: %s", i, jc[i].job.message);
    if (jg[i].job.status)
      fail_msg("cuda job %d: %s (%s)", i, jg[i].job.message, attnd_strerror(jg[i].job.status));
    if (g_devio && sp[i].kind == ATTND_JOB_STEP && jg[i].job.q_bytes) /* the client's q as sent */
      assert_memory_equal(jg[i].job.batch.q, sp[i].q, jg[i].job.q_bytes);
    if (g_devio && sp[i].kind == ATTND_JOB_STEP) /* the done signal, raised after the kernels */
      assert_true(*dio[i].done == dio[i].done_value);
    assert_true(jg[i].job.t_end_us >= jg[i].job.t_start_us);
    assert_true(jg[i].job.t_start_us >= jg[i].job.t_submit_us);
    if (sp[i].kind == ATTND_JOB_STEP) {
      /* The step trace's phases (backend.h): the CPU backend times its two,
       * the CUDA backend all four when --cuda-trace is on. */
      const attnd_job_t *c = &jc[i].job;
      assert_int_equal(c->dev_timed, 1);
      assert_true(c->dev_us[ATTND_DEV_WRITE] + c->dev_us[ATTND_DEV_ATTEND] <=
                  c->t_end_us - c->t_start_us);
      assert_int_equal(jg[i].job.dev_timed, g_opts.cuda_trace);
    }
    if (sp[i].kind != ATTND_JOB_STEP || !sp[i].Tq)
      continue;
    size_t ne = (size_t)sp[i].Tq * QH * HD;
    double r = rel_l2_out(&jg[i], &jc[i], ne);
    print_message("%s job %d layer %d: Tq %d rel L2 %.3e\n", attnd_kv_type_name(kv), i, sp[i].layer,
                  sp[i].Tq, r);
    if (r > worst)
      worst = r;
    assert_true(r <= ATTND_TOL_BACKENDS);
    if (sp[i].want_lse) {
      /* Per element, absolute: CUDA's lse is the log of the sum of P as
       * rounded for the matrix units (tests/tolerance.h). */
      for (size_t e = 0; e < (size_t)sp[i].Tq * QH; e++) {
        double x = jg[i].job.batch.lse[e], y = jc[i].job.batch.lse[e];
        assert_true(isfinite(x));
        const double dl = fabs(x - y);
        if (dl > worst_lse)
          worst_lse = dl;
        if (!(dl <= ATTND_TOL_CUDA_LSE_ABS + 1e-4 * (1 + fabs(y))))
          fail_msg("%s job %d lse[%zu]: cuda %.7g, cpu %.7g", attnd_kv_type_name(kv), i, e, x, y);
      }
    }
  }
  print_message("%s: %d jobs, worst out rel L2 %.3e, worst |lse - cpu| %.3e, %.2f ms on the GPU "
                "(first run, includes warm-up)\n",
                attnd_kv_type_name(kv), n, worst, worst_lse, ms);
  for (int i = 0; i < n; i++) {
    if (outs[i]) {
      gpu->ops->host_free(gpu, outs[i]);
      jg[i].job.batch.out = NULL;
    }
    if (dio[i].block) {
      gpu->ops->host_free(gpu, dio[i].block);
      jg[i].job.batch.out = dio[i].out;
      jg[i].job.batch.lse = dio[i].lse;
    }
    job_free(&jc[i]);
    job_free(&jg[i]);
    spec_free(&sp[i]);
    if (frames[i])
      gpu->ops->host_free(gpu, frames[i]);
  }
  cpu->ops->destroy(cpu);
  destroy_and_close(&loop, gpu);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_bf16_matches_cpu(void **state) {
  compare_backends(ATTND_KV_BF16);
}

static void test_int8_dynamic_matches_cpu(void **state) {
  compare_backends(ATTND_KV_INT8_DYNAMIC);
}

/* A long context (2000 keys written by a write-only item, then a decode
 * batch over it and a short one): the attention may split the keys over its
 * workspace (split-KV), which the backend sizes and passes per stream. */
static void test_long_context_decode(void **state) {
  SKIP_WITHOUT_GPU();
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *cpu = NULL, *gpu = NULL;
  assert_int_equal(
      attnd_backend_cpu_create(&cpu, &loop, &s, 1, opts(64ull << 20), err, sizeof(err)), 0);
  assert_int_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, 1, opts(64ull << 20), err, sizeof(err)), 0);
  enum { LONG = 2000 };
  titem_t w = {.start = 0, .n = LONG, .has_q = 0, .mask = ATTND_MASK_CAUSAL, .nb = 126};
  for (int b = 0; b < 126; b++)
    w.table[b] = 200 + b; /* not contiguous with anything else */
  titem_t d[2] = {
      w, {.start = 9, .n = 1, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {7}, .nb = 1}};
  d[0].start = LONG;
  d[0].n = 1;
  d[0].has_q = 1;
  titem_t short_w = {
      .start = 0, .n = 9, .has_q = 0, .mask = ATTND_MASK_CAUSAL, .table = {7}, .nb = 1};
  tjob_spec_t sp[3];
  spec_step(&sp[0], 0, &w, 1, 0, 0);
  spec_step(&sp[1], 0, &short_w, 1, 0, 0);
  spec_step(&sp[2], 0, d, 2, 0, 1);
  tjob_t jc[3], jg[3];
  int dummy = 0;
  for (int i = 0; i < 3; i++) {
    job_from_spec(&jc[i], &sp[i], &dummy);
    job_from_spec(&jg[i], &sp[i], &dummy);
  }
  run_all(&loop, cpu, jc, 3);
  run_all(&loop, gpu, jg, 3);
  for (int i = 0; i < 3; i++) {
    if (jg[i].job.status)
      fail_msg("cuda job %d: %s", i, jg[i].job.message);
    assert_int_equal(jc[i].job.status, 0);
  }
  double r = rel_l2_out(&jg[2], &jc[2], (size_t)2 * QH * HD);
  double worst_lse = 0;
  for (int e = 0; e < 2 * QH; e++) {
    double x = jg[2].job.batch.lse[e], y = jc[2].job.batch.lse[e];
    double dl = fabs(x - y) - 1e-4 * (1 + fabs(y));
    if (dl > worst_lse)
      worst_lse = dl;
  }
  print_message("decode over %d keys: rel L2 %.3e, worst |lse - cpu| - 1e-4 (1 + |cpu|) %.3e\n",
                LONG + 1, r, worst_lse);
  assert_true(r <= ATTND_TOL_BACKENDS);
  assert_true(worst_lse <= ATTND_TOL_CUDA_LSE_ABS);
  for (int i = 0; i < 3; i++) {
    job_free(&jc[i]);
    job_free(&jg[i]);
    spec_free(&sp[i]);
  }
  cpu->ops->destroy(cpu);
  destroy_and_close(&loop, gpu);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* A SCALES job setting a layer's scales from a test's arrays. */
static void scales_job(tjob_t *t, int layer, const float *ks, const float *vs, int *ndone) {
  memset(t, 0, sizeof(*t));
  t->job.kind = ATTND_JOB_SCALES;
  t->job.layer = layer;
  t->job.k_scale = ks;
  t->job.v_scale = vs;
  t->job.per_channel = 1;
  t->job.done_cb = tjob_done;
  t->ndone = ndone;
}

/* Static int8 needs its scales set by a SCALES job, which orders with the
 * layer's other jobs: a step submitted before it fails with ATTND_EPRECOND
 * (never runs on zero scales), the same step right behind it, submitted
 * without waiting, runs with the new scales and matches the CPU backend. */
static void test_int8_static_scales(void **state) {
  SKIP_WITHOUT_GPU();
  attnd_kshape_t s = make_shape(ATTND_KV_INT8);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *cpu = NULL, *gpu = NULL;
  assert_int_equal(
      attnd_backend_cpu_create(&cpu, &loop, &s, 1, opts(16ull << 20), err, sizeof(err)), 0);
  assert_int_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, 1, opts(16ull << 20), err, sizeof(err)), 0);
  titem_t it = {.start = 0, .n = 9, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {3}, .nb = 1};
  tjob_spec_t sp;
  spec_step(&sp, 0, &it, 1, 0, 0);
  float ks[KVH * HD], vs[KVH * HD];
  for (int i = 0; i < KVH * HD; i++) {
    ks[i] = 1.0f / 100.0f + (float)(i % 7) * 1e-3f;
    vs[i] = 1.0f / 110.0f + (float)(i % 5) * 1e-3f;
  }
  int dummy = 0;
  tjob_t g[3], c[3];
  for (int b = 0; b < 2; b++) {
    tjob_t *t = b ? g : c;
    job_from_spec(&t[0], &sp, &dummy);
    scales_job(&t[1], 0, ks, vs, &dummy);
    job_from_spec(&t[2], &sp, &dummy);
    run_all(&loop, b ? gpu : cpu, t, 3);
    assert_int_equal(t[0].job.status, ATTND_EPRECOND);
    if (t[1].job.status || t[2].job.status)
      fail_msg("%s: scales %d (%s), step %d (%s)", b ? "cuda" : "cpu", t[1].job.status,
               t[1].job.message, t[2].job.status, t[2].job.message);
  }
  double r = rel_l2_out(&g[2], &c[2], (size_t)sp.Tq * QH * HD);
  print_message("int8 (static, per channel): rel L2 %.3e\n", r);
  assert_true(r <= ATTND_TOL_BACKENDS);
  for (int i = 0; i < 3; i += 2) {
    job_free(&g[i]);
    job_free(&c[i]);
  }
  spec_free(&sp);
  cpu->ops->destroy(cpu);
  destroy_and_close(&loop, gpu);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* Many layers (more than the stream pool), several decode steps per layer in
 * flight at once: every job completes, in submission order per layer, and
 * the loop is not kept alive once nothing is in flight. */
typedef struct {
  attnd_job_t job;
  int *order;
  int *seen;
  int idx;
} ojob_t;

static int order_ok = 1;

static void ojob_done(attnd_job_t *j) {
  ojob_t *o = (ojob_t *)j;
  int l = o->job.layer;
  if (o->idx <= o->seen[l])
    order_ok = 0;
  o->seen[l] = o->idx;
  (*o->order)++;
}

static void many_layers_in_flight(void) {
  enum { NL = 12, PER = 6 };
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *gpu = NULL;
  assert_int_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, NL, opts(64ull << 20), err, sizeof(err)), 0);
  static tjob_spec_t sp[NL * PER];
  static ojob_t oj[NL * PER];
  int seen[NL], ndone = 0;
  for (int l = 0; l < NL; l++)
    seen[l] = -1;
  int n = 0;
  mock_hold(1);
  for (int k = 0; k < PER; k++)
    for (int l = 0; l < NL; l++) {
      titem_t it = {
          .start = k, .n = 1, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {l}, .nb = 1};
      spec_step(&sp[n], l, &it, 1, 0, 0);
      tjob_t tmp;
      int dummy = 0;
      job_from_spec(&tmp, &sp[n], &dummy);
      memset(&oj[n], 0, sizeof(oj[n]));
      oj[n].job = tmp.job;
      free(tmp.qcopy);
      oj[n].job.batch.q = sp[n].q; /* the CUDA backend never writes host q */
      oj[n].job.done_cb = ojob_done;
      oj[n].order = &ndone;
      oj[n].seen = seen;
      oj[n].idx = k;
      assert_int_equal(gpu->ops->submit(gpu, &oj[n].job), 0);
      n++;
    }
  mock_hold(0);
  assert_int_equal(gpu->ops->inflight(gpu), n - ndone);
  /* UV_RUN_DEFAULT returns only when nothing keeps the loop alive: the
   * backend must hold it while jobs are out and release it after. */
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(ndone, n);
  assert_true(order_ok);
  for (int i = 0; i < n; i++) {
    if (oj[i].job.status)
      fail_msg("job %d: %s", i, oj[i].job.message);
    const uint16_t *o = oj[i].job.batch.out;
    for (size_t e = 0; e < (size_t)QH * HD; e++)
      assert_true(isfinite(bf2f(o[e])));
    free(oj[i].job.batch.out);
    spec_free(&sp[i]);
  }
  destroy_and_close(&loop, gpu);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* Per-layer variants through both backends: a SINKS job, then a prefill and a
 * decode on a layer with a window smaller than a block and soft-capped scores,
 * every item with ATTND_ITEM_SINK. The device must see the layer's sinks (the
 * outputs differ from a run without them) and agree with the CPU backend. */
static void run_variants(uv_loop_t *loop, attnd_backend_t *be, const float *sinks,
                         const tjob_spec_t *sp, tjob_t *jobs) {
  int n = 0, dummy = 0;
  if (sinks) {
    memset(&jobs[0], 0, sizeof(jobs[0]));
    jobs[0].job.kind = ATTND_JOB_SINKS;
    jobs[0].job.layer = 0;
    jobs[0].job.sinks = sinks;
    jobs[0].job.done_cb = tjob_done;
    n = 1;
  }
  for (int i = 0; i < 2; i++) {
    job_from_spec(&jobs[n + i], &sp[i], &dummy);
    jobs[n + i].job.batch.window = 7;
  }
  run_all(loop, be, jobs, n + 2);
  for (int i = 0; i < n + 2; i++)
    if (jobs[i].job.status)
      fail_msg("%s job %d: %s", be->ops->name, i, jobs[i].job.message);
}

static void test_sinks_window_softcap(void **state) {
  SKIP_WITHOUT_GPU();
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  s.softcap = 2.0f;
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *cpu = NULL, *gpu = NULL, *plain = NULL;
  assert_int_equal(
      attnd_backend_cpu_create(&cpu, &loop, &s, 1, opts(64ull << 20), err, sizeof(err)), 0);
  assert_int_equal(
      attnd_backend_cpu_create(&plain, &loop, &s, 1, opts(64ull << 20), err, sizeof(err)), 0);
  assert_int_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, 1, opts(64ull << 20), err, sizeof(err)), 0);
  float sinks[QH];
  for (int h = 0; h < QH; h++)
    sinks[h] = 0.5f * (float)h - 1.0f;
  titem_t pre = {
      .start = 0, .n = 40, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {3, 9, 5}, .nb = 3};
  titem_t dec = pre;
  dec.start = 40;
  dec.n = 1;
  tjob_spec_t sp[2];
  spec_step(&sp[0], 0, &pre, 1, 1, 1);
  spec_step(&sp[1], 0, &dec, 1, 1, 1);
  sp[0].items[0].flags = sp[1].items[0].flags = ATTND_ITEM_SINK;
  tjob_t jc[3], jg[3], jp[2];
  run_variants(&loop, cpu, sinks, sp, jc);
  run_variants(&loop, gpu, sinks, sp, jg);
  run_variants(&loop, plain, NULL, sp, jp); /* no SINKS job: the flag is inert */
  for (int i = 0; i < 2; i++) {
    size_t n = (size_t)(i ? 1 : 40) * QH * HD;
    double r = rel_l2_out(&jg[1 + i], &jc[1 + i], n);
    if (!(r <= 1e-2))
      fail_msg("step %d: cuda vs cpu rel L2 %.3g", i, r);
    if (!(rel_l2_out(&jp[i], &jc[1 + i], n) > 1e-2))
      fail_msg("step %d: the sinks changed nothing", i);
    const float *lg = jg[1 + i].job.batch.lse, *lc = jc[1 + i].job.batch.lse;
    for (size_t k = 0; k < (size_t)(i ? 1 : 40) * QH; k++)
      if (!(fabs((double)lg[k] - lc[k]) <=
            ATTND_TOL_CUDA_LSE_ABS + 1e-4 * (1 + fabs((double)lc[k]))))
        fail_msg("step %d lse[%zu]: cuda %g, cpu %g", i, k, (double)lg[k], (double)lc[k]);
  }
  for (int i = 0; i < 3; i++) {
    job_free(&jc[i]);
    job_free(&jg[i]);
  }
  job_free(&jp[0]);
  job_free(&jp[1]);
  spec_free(&sp[0]);
  spec_free(&sp[1]);
  destroy_and_close(&loop, plain);
  destroy_and_close(&loop, gpu);
  destroy_and_close(&loop, cpu);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_many_layers_in_flight(void **state) {
  SKIP_WITHOUT_GPU();
  many_layers_in_flight();
}

/* The same with the pinned staging pool capped at one byte: past the warm
 * buffers, every job waits for one to come back, in submission order. */
static void test_pinned_cap(void **state) {
  SKIP_WITHOUT_GPU();
  g_opts.cuda_pinned_max = 1;
  g_opts.cuda_frame_pool = 0; /* the default: its floor, under the one-byte cap */
  many_layers_in_flight();
}

/* --cuda-pinned-warm: the large steps' staging buffer is made at start
 * (pinning it while serving would stall every CUDA call meanwhile), within
 * the pinned cap: past it the backend is not created and says which option;
 * within it the scenarios run as before. */
static void test_pinned_warm(void **state) {
  SKIP_WITHOUT_GPU();
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *gpu = NULL;
  g_opts.cuda_pinned_warm = 24u << 20; /* a 32 MiB buffer */
  g_opts.cuda_pinned_max = 16u << 20;
  g_opts.cuda_frame_pool = 0; /* the default: what the cap leaves */
  assert_int_not_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, 1, opts(16ull << 20), err, sizeof(err)), 0);
  assert_non_null(strstr(err, "--cuda-pinned-warm"));
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
  g_opts.cuda_pinned_max = 0;
  g_opts.cuda_frame_pool = 32u << 20; /* as main set it */
  many_layers_in_flight();
}

/* The same scenarios with q, k and v staged by a host function on the
 * stream (hostfn-min 0: every step), the path of large prefills:
 * the H2D copy must wait for it in stream order, and with the pool capped a
 * pinned buffer must not be reused before its host function ran. */
static void test_hostfn_staging(void **state) {
  SKIP_WITHOUT_GPU();
  g_opts.cuda_hostfn_min = 0;
  compare_backends(ATTND_KV_BF16);
  compare_backends(ATTND_KV_INT8_DYNAMIC);
  many_layers_in_flight();
  g_opts.cuda_pinned_max = 1;
  g_opts.cuda_frame_pool = 0; /* the default: its floor, under the one-byte cap */
  many_layers_in_flight();
}

/* Large frames received into the backend's pinned host memory: q, k and v
 * go to the device by DMA from the frame (at odd offsets), and outputs come
 * back by DMA into pinned buffers of their own, no staging copy either way;
 * the results match the CPU backend's as on the staged path. The memory is
 * handed back and reused across the runs. */
static void test_pinned_frames(void **state) {
  SKIP_WITHOUT_GPU();
  g_opts.cuda_hostfn_min = 0;
  g_frames = 1;
  compare_backends(ATTND_KV_BF16);
  compare_backends(ATTND_KV_INT8_DYNAMIC);
  assert_true(g_frames_pinned >= 8); /* the pool's frames (16) went to the first steps */
}

/* Same-host zero-copy (backend.h device_io): the steps' q, k, v, out and
 * lse are "client" memory (pinned host memory, which kernels address
 * directly), nothing staged or copied back, q copied on the device first
 * (the write phase rotates it in place; the client's q must not change);
 * results match the CPU backend's. On a GPU this runs under the round's
 * compute-sanitizer too; tests/e2e/test_ipc.py runs the path with a second
 * process's device memory. */
static void test_device_io(void **state) {
  SKIP_WITHOUT_GPU();
  g_opts.cuda_hostfn_min = 0;
  g_devio = 1;
  compare_backends(ATTND_KV_BF16);
  compare_backends(ATTND_KV_INT8_DYNAMIC);
}

/* Unordered jobs (the engine's, which it vouches conflict with nothing
 * unfinished) need not wait for each other: a decode submitted right behind
 * another session's large prefill on the same layer (over 1024 new tokens)
 * finishes first, on the CUDA backend's priority stream as on the CPU
 * backend (which cuts the prefill into chunks). Then an ordered job right
 * behind an unordered decode (nothing else in flight) still waits for it and
 * reads its write: on CUDA through an event on the priority stream (on the
 * mock, whose streams start together, the ordered job would otherwise
 * overtake). Outputs match between the backends. */
static void test_unordered_jobs(void **state) {
  SKIP_WITHOUT_GPU();
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *be[2] = {NULL, NULL};
  assert_int_equal(
      attnd_backend_cpu_create(&be[0], &loop, &s, 1, opts(64ull << 20), err, sizeof(err)), 0);
  assert_int_equal(
      attnd_backend_cuda_create(&be[1], &loop, &s, 1, opts(64ull << 20), err, sizeof(err)), 0);
  enum { BIG = 1100, NJ = 5 };
  titem_t pre = {
      .start = 0, .n = 20, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {0, 1}, .nb = 2};
  titem_t big = {
      .start = 0, .n = BIG, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .nb = (BIG + BS - 1) / BS};
  for (int b = 0; b < big.nb; b++)
    big.table[b] = 100 + b;
  titem_t dec[3] = {pre, pre, pre};
  for (int i = 0; i < 3; i++) {
    dec[i].start = 20 + i;
    dec[i].n = 1;
  }
  tjob_spec_t sp[NJ];
  spec_step(&sp[0], 0, &pre, 1, 0, 0);
  spec_step(&sp[1], 0, &big, 1, 0, 1);
  for (int i = 0; i < 3; i++)
    spec_step(&sp[2 + i], 0, &dec[i], 1, 1, 1);
  tjob_t j[2][NJ];
  int dummy = 0;
  for (int k = 0; k < 2; k++) {
    for (int i = 0; i < NJ; i++)
      job_from_spec(&j[k][i], &sp[i], &dummy);
    for (int i = 1; i <= 3; i++)
      j[k][i].job.unordered = 1;        /* the last one stays ordered */
    run_all(&loop, be[k], &j[k][0], 1); /* the session's prefill, done first */
    run_all(&loop, be[k], &j[k][1], 2); /* the large prefill, then a decode */
    run_all(&loop, be[k], &j[k][3], 2); /* a decode, an ordered decode behind it */
    for (int i = 0; i < NJ; i++)
      if (j[k][i].job.status)
        fail_msg("%s job %d: %s", k ? "cuda" : "cpu", i, j[k][i].job.message);
    print_message("%s: the decode finished %s the large prefill ahead of it\n", k ? "cuda" : "cpu",
                  j[k][2].done_seq < j[k][1].done_seq ? "before" : "after");
    /* On a device the order is the device's to choose; the mock and the CPU
     * backend make it certain. */
    if (!k || attnd_cuda_mock_hold)
      assert_true(j[k][2].done_seq < j[k][1].done_seq);
    assert_true(j[k][4].done_seq > j[k][3].done_seq);
  }
  for (int i = 1; i < NJ; i++) {
    double r = rel_l2_out(&j[1][i], &j[0][i], (size_t)sp[i].Tq * QH * HD);
    print_message("job %d (Tq %d): rel L2 %.3e\n", i, sp[i].Tq, r);
    assert_true(r <= ATTND_TOL_BACKENDS);
  }
  for (int i = 0; i < NJ; i++) {
    job_free(&j[0][i]);
    job_free(&j[1][i]);
    spec_free(&sp[i]);
  }
  be[0]->ops->destroy(be[0]);
  destroy_and_close(&loop, be[1]);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* Without a device, create says so instead of crashing. */
static void test_unavailable_without_device(void **state) {
  if (attnd_backend_cuda_available())
    skip();
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  attnd_backend_t *be = NULL;
  char err[256] = "";
  assert_int_equal(attnd_backend_cuda_create(&be, &loop, &s, 1, opts(0), err, sizeof(err)),
                   ATTND_EUNAVAIL);
  assert_true(err[0] != 0);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* Every test starts from the options and modes main set: a test that fails
 * part-way (cmocka jumps out of it) leaves no mode behind for the next one
 * (a failed test_pinned_frames once left frames on under test_device_io,
 * whose client block then went through free()). */
static attnd_backend_opts_t g_opts0;
static int reset_modes(void **state) { /* the one place a test's modes are undone */
  (void)state;
  g_opts = g_opts0;
  g_frames = 0;
  g_frames_pinned = 0;
  g_devio = 0;
  return 0;
}

int main(int argc, char **argv) {
  attnd_backend_opts_defaults(&g_opts);
  g_opts.threads = 2;
  /* Room for the tests' frames and outputs, not the default's 1/16 of host
   * memory (pinned at every backend's start). */
  g_opts.cuda_frame_pool = 32u << 20;
  int fault = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--fault") == 0)
      fault = 1;
    else if (strcmp(argv[i], "--ring-fault") == 0)
      fault = 2;
    else if (strcmp(argv[i], "--ring-fault-pinned") == 0)
      fault = 2, g_fault_pinned = 1;
    else if (strcmp(argv[i], "--callback") == 0)
      g_opts.cuda_callbacks = 1;
    else if (strcmp(argv[i], "--loop") == 0)
      g_opts.cuda_spin_us = ATTND_CUDA_LOOP_SPIN_US;
    else if (strcmp(argv[i], "--graphs") == 0)
      g_opts.cuda_graphs = 2; /* from a shape's first step: the fault test's too */
    else if (strcmp(argv[i], "--trace") == 0)
      g_opts.cuda_trace = 1;
    else if (strncmp(argv[i], "--hostfn-min=", 13) == 0)
      g_opts.cuda_hostfn_min = strtoull(argv[i] + 13, NULL, 10);
    else if (strncmp(argv[i], "--filter=", 9) == 0)
      cmocka_set_test_filter(argv[i] + 9); /* tests whose names match (* wildcards) */
    else {
      fprintf(stderr,
              "usage: %s [--fault|--ring-fault|--ring-fault-pinned] [--callback|--loop]\n"
              "          [--graphs] [--trace] [--hostfn-min=N] [--filter=PATTERN]\n",
              argv[0]);
      return 2;
    }
  }
  if (fault == 2) {
    const struct CMUnitTest t[] = {cmocka_unit_test(test_ring_fault)};
    return cmocka_run_group_tests_name("backend_cuda_ring_fault", t, NULL, NULL);
  }
  if (fault) {
    const struct CMUnitTest t[] = {cmocka_unit_test(test_device_fault)};
    return cmocka_run_group_tests_name("backend_cuda_fault", t, NULL, NULL);
  }
  if (!attnd_backend_cuda_available()) {
    /* The one check that needs no device still runs; the rest are reported to
     * ctest as skipped (exit code 77, SKIP_RETURN_CODE in tests/backend_cuda.cmake). */
    const struct CMUnitTest t[] = {cmocka_unit_test(test_unavailable_without_device)};
    int rc = cmocka_run_group_tests_name("backend_cuda_no_device", t, NULL, NULL);
    if (rc != 0)
      return rc;
    print_message("no usable CUDA device: GPU backend tests skipped\n");
    return 77;
  }
  g_opts0 = g_opts;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_unavailable_without_device, reset_modes),
      cmocka_unit_test_setup(test_bf16_matches_cpu, reset_modes),
      cmocka_unit_test_setup(test_int8_dynamic_matches_cpu, reset_modes),
      cmocka_unit_test_setup(test_int8_static_scales, reset_modes),
      cmocka_unit_test_setup(test_long_context_decode, reset_modes),
      cmocka_unit_test_setup(test_many_layers_in_flight, reset_modes),
      cmocka_unit_test_setup(test_pinned_cap, reset_modes),
      cmocka_unit_test_setup(test_pinned_warm, reset_modes),
      cmocka_unit_test_setup(test_hostfn_staging, reset_modes),
      cmocka_unit_test_setup(test_pinned_frames, reset_modes),
      cmocka_unit_test_setup(test_device_io, reset_modes),
      cmocka_unit_test_setup(test_ipc_ops, reset_modes),
      cmocka_unit_test_setup(test_unordered_jobs, reset_modes),
      cmocka_unit_test_setup(test_sinks_window_softcap, reset_modes),
      cmocka_unit_test_setup(test_ring_matches_cpu, reset_modes),
      cmocka_unit_test_setup(test_ring_no_alloc, reset_modes),
      cmocka_unit_test_setup(test_ring_oneshot, reset_modes),
      cmocka_unit_test_setup(test_ring_document, reset_modes),
      cmocka_unit_test_setup(test_ring_device_io, reset_modes),
      cmocka_unit_test_setup(test_ring_pinned, reset_modes),
      cmocka_unit_test_setup(test_ring_pool_full, reset_modes),
      cmocka_unit_test_setup(test_frame_pool, reset_modes),
      cmocka_unit_test_setup(test_loop_completion, reset_modes),
      cmocka_unit_test_setup(test_graph_steps, reset_modes),
      cmocka_unit_test_setup(test_graph_replay, reset_modes),
      cmocka_unit_test_setup(test_graph_replay_layers, reset_modes),
      cmocka_unit_test_setup(test_graph_replay_devio, reset_modes),
      cmocka_unit_test_setup(test_graph_replay_pairs, reset_modes),
  };
  return cmocka_run_group_tests_name("backend_cuda", tests, NULL, NULL);
}

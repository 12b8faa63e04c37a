/* test_engine_perf.c: decode-step latency through the engine on the CPU
 * backend, Llama-3-8B-like layer shape (32 q / 8 kv heads, d 128, block 64,
 * bf16 KV). B sessions are filled to C tokens with kv_only steps, then each
 * measured step decodes one token for every session on one layer.
 *
 * Under ctest it runs a tiny configuration (a smoke test of the pipelined
 * path). By hand: test_engine_perf B C THREADS ITERS, e.g. 32 2048 16 20;
 * it prints the median step time and the KV bytes it read per second. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine.h"
#include "base.h"

static int g_b = 4, g_c = 256, g_threads = 2, g_iters = 5;

typedef struct {
  int done, status;
  uint64_t plan;
  char msg[256];
} res_t;

static void on_done(void *arg, attnd_result_t *r) {
  res_t *x = arg;
  free(r->out);
  free(r->lse);
  x->status = r->status;
  x->plan = r->plan;
  snprintf(x->msg, sizeof(x->msg), "%s", r->message);
  x->done = 1;
}

static void wait_res(uv_loop_t *loop, res_t *x) {
  while (!x->done)
    if (uv_run(loop, UV_RUN_ONCE) == 0 && !x->done)
      fail_msg("loop ran dry");
}

static void closed_cb(void *arg) {
  *(int *)arg = 1;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static attnd_tensor_t t3(uint16_t *p, uint32_t rows, uint32_t heads, uint32_t d) {
  attnd_tensor_t t = {.present = 1, .dtype = ATTND_DT_BF16, .ndim = 3, .data = (uint8_t *)p};
  t.shape[0] = rows;
  t.shape[1] = heads;
  t.shape[2] = d;
  t.nbytes = (size_t)rows * heads * d * 2;
  return t;
}

static void test_decode_latency(void **state) {
  enum { LAYERS = 2, QH = 32, KVH = 8, HD = 128, BS = 64 };
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  attnd_config_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  attnd_kshape_t s = {.q_heads = QH,
                      .kv_heads = KVH,
                      .head_dim = HD,
                      .block_size = BS,
                      .dtype = ATTND_DT_BF16,
                      .kv = ATTND_KV_BF16,
                      .rope = ATTND_ROPE_NEOX,
                      .rope_theta = 500000.0,
                      .rotary_dim = HD,
                      .softmax_scale = 0.08838834764831845f};
  cfg.shape = s;
  cfg.layers = LAYERS;
  cfg.backend = ATTND_BACKEND_CPU;
  cfg.max_context = 1 << 20;
  uint64_t blocks = (uint64_t)g_b * ((uint64_t)(g_c + g_iters + BS) / BS + 1);
  cfg.kv_memory = blocks * attnd_kv_block_bytes(&s) * LAYERS;
  cfg.prefix_cache = 1;
  cfg.threads = g_threads;
  cfg.engine_offload_bytes = ATTND_DEFAULT_ENGINE_OFFLOAD_BYTES;
  attnd_engine_t *e;
  char err[256];
  if (attnd_engine_init(&e, &loop, &cfg, err, sizeof(err)) != 0)
    fail_msg("init: %s", err);

  uint64_t *ids = calloc((size_t)g_b, sizeof(uint64_t));
  uint32_t *tokens = calloc((size_t)g_c + (size_t)g_iters + 1, sizeof(uint32_t));
  size_t kvrow = KVH * HD, qrow = QH * HD;
  size_t chunk = 512;
  uint16_t *k = malloc(chunk * kvrow * 2);
  uint64_t rng = 88172645463325252ull;
  for (size_t i = 0; i < chunk * kvrow; i++) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    float x = (float)((double)(rng >> 11) / 9007199254740992.0 * 4.0 - 2.0);
    uint32_t bits;
    memcpy(&bits, &x, 4);
    k[i] = (uint16_t)(bits >> 16); /* bf16 by truncation: any finite value will do */
  }
  for (int i = 0; i < g_b; i++) {
    res_t x = {0};
    attnd_engine_open_session(e, 1, 1, NULL, 0, NULL, 0, on_done, &x);
    assert_int_equal(x.status, 0);
  }
  uint32_t nsess = attnd_engine_list_sessions(e, 1, NULL, 0);
  attnd_session_info_t *info = calloc(nsess, sizeof(*info));
  attnd_engine_list_sessions(e, 1, info, nsess);
  for (uint32_t i = 0; i < nsess; i++)
    ids[i] = info[i].session;
  free(info);
  /* Fill every session with kv_only steps (no attention: it is not measured). */
  for (int i = 0; i < g_b; i++)
    for (uint32_t pos = 0; pos < (uint32_t)g_c; pos += (uint32_t)chunk) {
      uint32_t n = (uint32_t)g_c - pos < chunk ? (uint32_t)g_c - pos : (uint32_t)chunk;
      attnd_item_t it = {.session = ids[i],
                         .start = pos,
                         .n = n,
                         .kv_only = 1,
                         .tokens = tokens + pos,
                         .ntokens = n};
      for (int l = 0; l < LAYERS; l++) {
        attnd_step_req_t r = {.layer = (uint32_t)l, .items = &it, .nitems = 1};
        r.k = t3(k, n, KVH, HD);
        r.v = t3(k, n, KVH, HD);
        res_t x = {0};
        attnd_engine_step(e, 1, 1, &r, on_done, &x);
        wait_res(&loop, &x);
        if (x.status)
          fail_msg("fill: %s", x.msg);
      }
    }
  /* Decode: one plan per token, one step per layer; time each step. */
  attnd_item_t *items = calloc((size_t)g_b, sizeof(*items));
  uint16_t *q = malloc((size_t)g_b * qrow * 2), *kv = malloc((size_t)g_b * kvrow * 2);
  for (size_t i = 0; i < (size_t)g_b * qrow; i++)
    q[i] = k[i % (chunk * kvrow)];
  memcpy(kv, k,
         (size_t)g_b * kvrow * 2 < chunk * kvrow * 2 ? (size_t)g_b * kvrow * 2 : chunk * kvrow * 2);
  uint64_t *lat = calloc((size_t)g_iters * LAYERS, sizeof(uint64_t));
  int nl = 0;
  for (int it = 0; it < g_iters; it++) {
    for (int i = 0; i < g_b; i++)
      items[i] = (attnd_item_t){.session = ids[i],
                                .start = (uint32_t)(g_c + it),
                                .n = 1,
                                .tokens = tokens + g_c + it,
                                .ntokens = 1};
    res_t x = {0};
    attnd_engine_plan(e, 1, 1, items, (uint32_t)g_b, on_done, &x);
    assert_int_equal(x.status, 0);
    for (int l = 0; l < LAYERS; l++) {
      attnd_step_req_t r = {.layer = (uint32_t)l, .plan = x.plan};
      r.q = t3(q, (uint32_t)g_b, QH, HD);
      r.k = t3(kv, (uint32_t)g_b, KVH, HD);
      r.v = t3(kv, (uint32_t)g_b, KVH, HD);
      res_t y = {0};
      uint64_t t0 = uv_hrtime();
      attnd_engine_step(e, 1, 1, &r, on_done, &y);
      wait_res(&loop, &y);
      lat[nl++] = uv_hrtime() - t0;
      if (y.status)
        fail_msg("decode: %s", y.msg);
    }
  }
  qsort(lat, (size_t)nl, sizeof(uint64_t), cmp_u64);
  double med_us = (double)lat[nl / 2] / 1e3;
  double kv_bytes = (double)g_b * (g_c + g_iters / 2.0) * KVH * HD * 2 * 2;
  print_message("  decode B=%d ctx=%d threads=%d: median step %.1f us (min %.1f), "
                "KV read %.2f GB/s\n",
                g_b, g_c, g_threads, med_us, (double)lat[0] / 1e3, kv_bytes / (med_us * 1e3));
  attnd_engine_stats_t st;
  attnd_engine_stats(e, &st);
  assert_int_equal(st.sessions, (uint32_t)g_b);
  int closed = 0;
  attnd_engine_close(e, closed_cb, &closed);
  while (!closed)
    uv_run(&loop, UV_RUN_ONCE);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
  free(lat);
  free(items);
  free(q);
  free(kv);
  free(k);
  free(tokens);
  free(ids);
}

int main(int argc, char **argv) {
  if (argc >= 5) {
    g_b = atoi(argv[1]);
    g_c = atoi(argv[2]);
    g_threads = atoi(argv[3]);
    g_iters = atoi(argv[4]);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_decode_latency),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* bench_window.c: decode cost of a sliding layer (window W) at context L
 * against a full layer at context W, CPU kernels, one thread part.
 *
 *   bench_window [L=32768] [W=4096] [reps=20]
 *
 * Both runs attend one decode row per session (8 sessions, GQA 32/8, d 128,
 * bf16 cache, blocks of 64); only attention (phase 2) is timed. The sliding
 * run must cost about what the full run at the window's length costs (the
 * issue's bound: 1.2x), not what its context costs. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attnd_kernels.h"

enum { SESS = 8 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Best of reps: one decode step of SESS sessions at kv_len keys, window w. */
static double run(const attnd_kshape_t *s, uint8_t *cache, int kv_len, int w, int reps) {
  const int bs = s->block_size, nb = (kv_len + bs - 1) / bs;
  attnd_kitem_t it[SESS];
  int32_t *meta = malloc(sizeof(int32_t) * (size_t)nb * SESS);
  for (int i = 0; i < SESS; i++) {
    for (int b = 0; b < nb; b++)
      meta[i * nb + b] = i * nb + b;
    it[i] = (attnd_kitem_t){.start = kv_len - 1,
                            .n = 1,
                            .q_row = i,
                            .kv_row = i,
                            .mask_kind = ATTND_MASK_CAUSAL,
                            .intervals = -1,
                            .block_table = i * nb,
                            .flags = ATTND_ITEM_SINK};
  }
  size_t qn = (size_t)SESS * s->q_heads * s->head_dim;
  uint16_t *q = calloc(qn, 2), *out = calloc(qn, 2);
  for (size_t i = 0; i < qn; i++)
    q[i] = 0x3c00 + (uint16_t)(i % 7); /* bf16 around 0.008 */
  attnd_kbatch_t b = {.items = it,
                      .nitems = SESS,
                      .meta = meta,
                      .total_q = SESS,
                      .total_kv = SESS,
                      .max_kv_len = kv_len,
                      .max_n = 1,
                      .q = q,
                      .out = out,
                      .cache = cache,
                      .block_bytes = attnd_kv_block_bytes(s),
                      .window = w};
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    if (attnd_cpu_attend(s, &b, 0, 1) != 0) {
      fprintf(stderr, "attend failed\n");
      exit(1);
    }
    double dt = now() - t0;
    best = dt < best ? dt : best;
  }
  free(meta);
  free(q);
  free(out);
  return best;
}

int main(int argc, char **argv) {
  int L = argc > 1 ? atoi(argv[1]) : 32768, W = argc > 2 ? atoi(argv[2]) : 4096;
  int reps = argc > 3 ? atoi(argv[3]) : 20;
  attnd_kshape_t s = {.q_heads = 32,
                      .kv_heads = 8,
                      .head_dim = 128,
                      .block_size = 64,
                      .dtype = ATTND_DT_BF16,
                      .kv = ATTND_KV_BF16,
                      .rope = ATTND_ROPE_NONE,
                      .softmax_scale = 0.0883883476f};
  size_t bb = attnd_kv_block_bytes(&s), nb = (size_t)(L + 63) / 64 * SESS;
  uint8_t *cache = malloc(bb * nb);
  for (size_t i = 0; i < bb * nb; i += 2) { /* small bf16 values, never NaN */
    cache[i] = (uint8_t)(i * 31);
    cache[i + 1] = (uint8_t)(0x3c + (i >> 7) % 3);
  }
  double slide = run(&s, cache, L, W, reps);
  double fullw = run(&s, cache, W, 0, reps);
  double fullL = run(&s, cache, L, 0, reps > 5 ? 5 : reps);
  printf(
      "bench_window: %d sessions, GQA %d/%d, d %d, bf16, one part: sliding W=%d at L=%d %.3f ms, "
      "full at %d %.3f ms (ratio %.2f), full at %d %.3f ms\n",
      SESS, s.q_heads, s.kv_heads, s.head_dim, W, L, 1e3 * slide, W, 1e3 * fullw, slide / fullw, L,
      1e3 * fullL);
  free(cache);
  return 0;
}

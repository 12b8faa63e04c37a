/* bench_interleave.c: how long one session's decode step takes on a layer
 * while another session's long prefill runs on the same layer (through the
 * engine; bench/README.md).
 *
 *   bench_interleave [PREFILL [CTX [THREADS [CHUNK_KEYS [QH KVH [BACKEND
 * [warm|both|ring=BYTES]]]]]]]
 *
 * defaults 16384 1024 2 16384 8 2 cpu (head_dim 128, block 64, bf16, one
 * layer); BACKEND cuda runs the same on device 0 (THREADS is then ignored:
 * the step's ring chunks run one after another on the layer's stream, small
 * steps on its priority twin).
 * Session B is prefilled to CTX tokens; its idle decode latency is the median
 * of 20 decode steps with nothing else running. Then session A's PREFILL-token
 * prefill is submitted as one Step, and B decodes step after step (each sent
 * once the previous one is answered) until A's step is answered: printed are
 * the prefill's time, the decode steps' median and maximum during it, and the
 * target of docs/sessions.md section 5 (twice the idle latency plus one
 * chunk, the largest chunk's time estimated from the prefill's time and the
 * chunks' weights). One JSON line follows for bench/RESULTS.md. `warm` first
 * runs the same prefill once on A and truncates it, so that the measured one
 * is not the process's first step that large; `both` measures the first
 * (cold) and then, in the same process, a second (warm) prefill, one JSON
 * line each: a first large step's one-time costs (the CUDA backend's pinned
 * allocations, before its ring) show as the difference. `ring=BYTES` sets
 * --cuda-ring. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "engine.h"

/* Idle decode steps measured; decode steps at most during the prefill. */
enum { IDLE = 20, MAXDEC = 20000 };

typedef struct {
  int done, status;
  uint64_t plan, session;
  uint64_t t_done;
  uint32_t scan_us; /* a large step's finiteness scan on the worker pool */
  char msg[256];
} res_t;

/* The engine, for freeing outputs in pinned memory (the CUDA backend's). */
static attnd_engine_t *g_engine;

static void on_done(void *arg, attnd_result_t *r) {
  res_t *x = arg;
  if (r->out_pinned)
    attnd_engine_host_free(g_engine, r->out, 1);
  else
    free(r->out);
  free(r->lse);
  x->status = r->status;
  x->plan = r->plan;
  x->session = r->session;
  x->t_done = uv_hrtime();
  x->scan_us = r->scan_us;
  snprintf(x->msg, sizeof(x->msg), "%s", r->message);
  x->done = 1;
}

static void wait_res(uv_loop_t *loop, res_t *x) {
  while (!x->done)
    uv_run(loop, UV_RUN_ONCE);
  if (x->status) {
    fprintf(stderr, "call failed: %d %s\n", x->status, x->msg);
    exit(1);
  }
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

/* Random bf16 values in [-2, 2). */
static uint16_t *random_bf16(size_t n, uint64_t seed) {
  uint16_t *p = malloc(n * 2);
  for (size_t i = 0; i < n; i++) {
    seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
    float x = (float)((double)(seed >> 11) / 9007199254740992.0 * 4.0 - 2.0);
    uint32_t bits;
    memcpy(&bits, &x, 4);
    p[i] = (uint16_t)(bits >> 16);
  }
  return p;
}

typedef struct {
  attnd_engine_t *e;
  uv_loop_t *loop;
  int qh, kvh, hd;
} ctx_t;

/* One inline step of n new tokens of a session at start, q for every row,
 * from connection conn (the sessions' clients use different connections, as
 * two clients would: a connection's calls are admitted in arrival order). */
static void step_send(ctx_t *c, uint64_t conn, uint64_t session, uint32_t start, uint32_t n,
                      uint16_t *q, uint16_t *kv, uint32_t *tokens, attnd_item_t *it, res_t *x) {
  *it = (attnd_item_t){
      .session = session, .start = start, .n = n, .tokens = tokens + start, .ntokens = n};
  attnd_step_req_t r = {.layer = 0, .items = it, .nitems = 1};
  r.q = t3(q, n, (uint32_t)c->qh, (uint32_t)c->hd);
  r.k = t3(kv, n, (uint32_t)c->kvh, (uint32_t)c->hd);
  r.v = t3(kv, n, (uint32_t)c->kvh, (uint32_t)c->hd);
  memset(x, 0, sizeof(*x));
  attnd_engine_step(c->e, 1, conn, &r, on_done, x);
}

/* What one measured prefill needs. */
typedef struct {
  ctx_t *c;
  uint64_t a, b;
  uint32_t *pos;
  uint16_t *q, *kv;
  uint32_t *tokens;
  int prefill, ctxlen, threads, cuda;
  uint64_t chunk_keys;
  double idle_ms;
  const attnd_kshape_t *s;
  unsigned long long ring; /* --cuda-ring, 0 = the default */
} meas_t;

/* Session A's long prefill, then decode steps of B until it is answered;
 * prints the results and one JSON line (`warm` says whether A's prefill had
 * run before in this process). */
static void measure(const meas_t *m, int warm) {
  ctx_t *cx = m->c;
  uv_loop_t *loopp = cx->loop;
  const int prefill = m->prefill, ctxlen = m->ctxlen, threads = m->threads, cuda = m->cuda;
  const int qh = cx->qh, kvh = cx->kvh, hd = cx->hd;
  const uint64_t chunk_keys = m->chunk_keys;
  const attnd_kshape_t s = *m->s;
  uint16_t *q = m->q, *kv = m->kv;
  uint32_t *tokens = m->tokens;
  uint32_t pos = *m->pos;
  const uint64_t a = m->a, b = m->b;
  res_t x;
  attnd_item_t it;
  enum { CONN_A = 1, CONN_B = 2 };
  /* The long prefill, then decode steps of b until it is answered. */
  res_t px;
  attnd_item_t pit;
  uint64_t p0 = uv_hrtime();
  step_send(cx, CONN_A, a, 0, (uint32_t)prefill, q, kv, tokens, &pit, &px);
  static uint64_t dec[MAXDEC], dec_t0[MAXDEC];
  int nd = 0;
  while (!px.done && nd < MAXDEC) {
    uint64_t t0 = uv_hrtime();
    step_send(cx, CONN_B, b, pos++, 1, q, kv, tokens, &it, &x);
    while (!x.done)
      uv_run(loopp, UV_RUN_ONCE);
    if (x.status) {
      fprintf(stderr, "decode failed: %s\n", x.msg);
      exit(1);
    }
    if (!px.done || px.t_done > t0) { /* started while the prefill ran */
      dec_t0[nd] = t0 - p0;
      dec[nd++] = uv_hrtime() - t0;
    }
  }
  wait_res(loopp, &px);
  double pre_ms = (double)(px.t_done - p0) / 1e6;
  /* The decodes sent while the prefill's scan ran (it starts at once on the
   * worker pool): they waited for it when the admission queue kept arrival
   * order across sessions, and wait for nothing now (docs/sessions.md §5). */
  double scan_ms = px.scan_us / 1e3, scan_max_ms = 0;
  int nscan = 0;
  for (int i = 0; i < nd; i++)
    if ((double)dec_t0[i] / 1e6 < scan_ms) {
      nscan++;
      if ((double)dec[i] / 1e6 > scan_max_ms)
        scan_max_ms = (double)dec[i] / 1e6;
    }
  double max_at_ms = 0; /* when the slowest decode was sent, after the prefill */
  for (int i = 0, worst = 0; i < nd; i++)
    if (dec[i] > dec[worst] || i == 0) {
      worst = i;
      max_at_ms = (double)dec_t0[i] / 1e6;
    }
  qsort(dec, (size_t)nd, sizeof(uint64_t), cmp_u64);
  /* Chunks as the CPU backend cuts them (daemon/backend/cpu.c: units of a
   * row tile and kv head, each weighing its rows times the keys it sees,
   * over its share of the heads), and one chunk's time: the prefill ran its
   * chunks one per core on `threads` cores, so a chunk of weight w took
   * about prefill_ms * threads * w / total. */
  int rt, tu;
  attnd_cpu_attend_geometry(&s, &rt, &tu);
  double total = 0, acc = 0, biggest = 0, chunks = 0;
  for (int r0 = 0; r0 < prefill; r0 += rt) {
    int rn = prefill - r0 < rt ? prefill - r0 : rt;
    double w = (double)((uint64_t)rn * (uint64_t)(r0 + rn) / (uint64_t)tu + 1);
    for (int k = 0; k < tu; k++) {
      if (chunk_keys && acc > 0 && acc + w > (double)chunk_keys) {
        biggest = acc > biggest ? acc : biggest;
        chunks++;
        acc = 0;
      }
      acc += w;
      total += w;
    }
  }
  biggest = acc > biggest ? acc : biggest;
  chunks++;
  const int lanes = cuda ? 1 : threads;
  double chunk_ms = pre_ms * lanes * biggest / total;
  double idle_ms = m->idle_ms;
  double med_ms = nd ? (double)dec[nd / 2] / 1e6 : 0, max_ms = nd ? (double)dec[nd - 1] / 1e6 : 0;
  double p90_ms = nd ? (double)dec[nd * 9 / 10] / 1e6 : 0;
  printf("%s backend, shape %d q / %d kv heads, d %d, %d threads, chunk-keys %llu\n",
         cuda ? "cuda" : "cpu", qh, kvh, hd, lanes, (unsigned long long)chunk_keys);
  printf("idle decode at ctx %d: median %.3f ms\n", ctxlen, idle_ms);
  if (cuda) {
    /* The CUDA backend stages a step this large through its ring in chunks
     * (daemon/backend/cuda_ring.c: four slots of a quarter of --cuda-ring,
     * 256M by default), one after another on the layer's stream; decodes
     * run on its priority twin beside them and wait at most for the copy
     * engine to finish a chunk's copy. One chunk's time: the prefill's time
     * over its chunks (rows of q, k, v, out and lse per 64M slot). */
    const double row = (double)qh * hd * 2 * 2 + (double)kvh * hd * 2 * 2 + (double)qh * 4;
    const double slot = (double)((m->ring ? m->ring : (256u << 20)) / 4) - 65536.0;
    chunks = (double)(long)((double)prefill * row / slot) + 1;
    chunk_ms = pre_ms / chunks;
  }
  printf("prefill of %d tokens: %.1f ms (%.0f chunks, the largest about %.2f ms)\n", prefill,
         pre_ms, chunks, chunk_ms);
  printf("decode during the prefill: %d steps, median %.3f ms, p90 %.3f ms, max %.3f ms (target 2 "
         "x idle + one chunk = %.3f ms)\n",
         nd, med_ms, p90_ms, max_ms, 2 * idle_ms + chunk_ms);
  printf("decode during the prefill's scan (%.1f ms): %d steps, max %.3f ms; the slowest decode "
         "was sent %.1f ms into the prefill\n",
         scan_ms, nscan, scan_max_ms, max_at_ms);
  printf("{\"backend\": \"%s\", \"prefill\": %d, \"ctx\": %d, \"threads\": %d, "
         "\"chunk_keys\": %llu, \"q_heads\": %d, \"kv_heads\": %d, \"idle_ms\": %.4f, "
         "\"prefill_ms\": %.2f, \"chunk_ms\": %.3f, \"decodes\": %d, \"during_median_ms\": "
         "%.4f, \"during_p90_ms\": %.4f, \"during_max_ms\": %.4f, \"scan_ms\": %.2f, "
         "\"during_scan_decodes\": %d, \"during_scan_max_ms\": %.4f, \"during_max_at_ms\": %.1f, "
         "\"warm\": %d}\n",
         cuda ? "cuda" : "cpu", prefill, ctxlen, lanes, (unsigned long long)chunk_keys, qh, kvh,
         idle_ms, pre_ms, chunk_ms, nd, med_ms, p90_ms, max_ms, scan_ms, nscan, scan_max_ms,
         max_at_ms, warm);
  *m->pos = pos;
}

int main(int argc, char **argv) {
  int prefill = argc > 1 ? atoi(argv[1]) : 16384;
  int ctxlen = argc > 2 ? atoi(argv[2]) : 1024;
  int threads = argc > 3 ? atoi(argv[3]) : 2;
  uint64_t chunk_keys = argc > 4 ? strtoull(argv[4], NULL, 0) : 16384;
  int qh = argc > 5 ? atoi(argv[5]) : 8, kvh = argc > 6 ? atoi(argv[6]) : 2, hd = 128;
  const int cuda = argc > 7 && strcmp(argv[7], "cuda") == 0;
  const int warm = argc > 8 && strcmp(argv[8], "warm") == 0;
  const int both = argc > 8 && strcmp(argv[8], "both") == 0;
  const unsigned long long ring =
      argc > 8 && strncmp(argv[8], "ring=", 5) == 0 ? strtoull(argv[8] + 5, NULL, 0) : 0;
  if (argc > 7 && !cuda && strcmp(argv[7], "cpu") != 0) {
    fprintf(stderr, "backend must be cpu or cuda, not %s\n", argv[7]);
    return 2;
  }
  uv_loop_t loop;
  uv_loop_init(&loop);
  attnd_config_t cfg;
  /* The daemon's defaults (the CUDA backend's pinned memory, completion and
   * host-function options among them), then this benchmark's shape; no state
   * directory: nothing is persisted. */
  attnd_config_defaults(&cfg);
  cfg.state_dir[0] = 0;
  attnd_kshape_t s = {.q_heads = qh,
                      .kv_heads = kvh,
                      .head_dim = hd,
                      .block_size = 64,
                      .dtype = ATTND_DT_BF16,
                      .kv = ATTND_KV_BF16,
                      .rope = ATTND_ROPE_NEOX,
                      .rope_theta = 500000.0,
                      .rotary_dim = hd,
                      .softmax_scale = 0.08838834764831845f};
  cfg.shape = s;
  cfg.layers = 1;
  cfg.backend = cuda ? ATTND_BACKEND_CUDA : ATTND_BACKEND_CPU;
  /* B decodes up to MAXDEC steps per measured prefill (two with `both`). */
  const int maxdec = (both ? 2 : 1) * MAXDEC;
  cfg.max_context = prefill + ctxlen + maxdec + 64;
  uint64_t blocks = (uint64_t)(prefill + ctxlen + maxdec + 200) / 64 + 8;
  cfg.kv_memory = blocks * attnd_kv_block_bytes(&s);
  cfg.prefix_cache = 0;
  cfg.threads = threads;
  cfg.engine_offload_bytes = ATTND_DEFAULT_ENGINE_OFFLOAD_BYTES;
  cfg.engine_chunk_keys = chunk_keys;
  cfg.cuda_ring = ring;
  attnd_engine_t *e;
  char err[256];
  if (attnd_engine_init(&e, &loop, &cfg, err, sizeof(err)) != 0) {
    fprintf(stderr, "init: %s\n", err);
    return 1;
  }
  g_engine = e;
  ctx_t c = {.e = e, .loop = &loop, .qh = qh, .kvh = kvh, .hd = hd};
  uint32_t *tokens =
      calloc((size_t)prefill + (size_t)ctxlen + (size_t)maxdec + 64, sizeof(uint32_t));
  size_t big = (size_t)(prefill > ctxlen ? prefill : ctxlen);
  uint16_t *q = random_bf16(big * (size_t)qh * hd, 1), *kv = random_bf16(big * (size_t)kvh * hd, 2);
  res_t x;
  attnd_item_t it;
  memset(&x, 0, sizeof(x));
  enum { CONN_A = 1, CONN_B = 2 };
  attnd_engine_open_session(e, 1, CONN_A, NULL, 0, NULL, 0, on_done, &x);
  wait_res(&loop, &x);
  uint64_t a = x.session;
  memset(&x, 0, sizeof(x));
  attnd_engine_open_session(e, 1, CONN_B, NULL, 0, NULL, 0, on_done, &x);
  wait_res(&loop, &x);
  uint64_t b = x.session;
  step_send(&c, CONN_B, b, 0, (uint32_t)ctxlen, q, kv, tokens, &it, &x);
  wait_res(&loop, &x);
  uint32_t pos = (uint32_t)ctxlen;
  uint64_t idle[IDLE];
  for (int i = 0; i < IDLE; i++) {
    uint64_t t0 = uv_hrtime();
    step_send(&c, CONN_B, b, pos++, 1, q, kv, tokens, &it, &x);
    wait_res(&loop, &x);
    idle[i] = uv_hrtime() - t0;
  }
  qsort(idle, IDLE, sizeof(uint64_t), cmp_u64);
  if (warm) {
    res_t wx;
    attnd_item_t wit;
    memset(&wx, 0, sizeof(wx));
    step_send(&c, CONN_A, a, 0, (uint32_t)prefill, q, kv, tokens, &wit, &wx);
    wait_res(&loop, &wx);
    if (wx.status) {
      fprintf(stderr, "warm-up prefill failed: %s\n", wx.msg);
      return 1;
    }
    memset(&x, 0, sizeof(x));
    attnd_engine_truncate(e, 1, CONN_A, a, 0, on_done, &x);
    wait_res(&loop, &x);
  }
  meas_t m = {.c = &c,
              .a = a,
              .b = b,
              .pos = &pos,
              .q = q,
              .kv = kv,
              .tokens = tokens,
              .prefill = prefill,
              .ctxlen = ctxlen,
              .threads = threads,
              .cuda = cuda,
              .chunk_keys = chunk_keys,
              .idle_ms = (double)idle[IDLE / 2] / 1e6,
              .s = &s,
              .ring = ring};
  measure(&m, warm);
  if (both) {
    /* The same again in this process: the first was cold (the process had
     * served no step this large), this one is warm. */
    memset(&x, 0, sizeof(x));
    attnd_engine_truncate(e, 1, CONN_A, a, 0, on_done, &x);
    wait_res(&loop, &x);
    measure(&m, 1);
  }
  int closed = 0;
  attnd_engine_close(e, closed_cb, &closed);
  while (!closed)
    uv_run(&loop, UV_RUN_ONCE);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  free(q);
  free(kv);
  free(tokens);
  return 0;
}

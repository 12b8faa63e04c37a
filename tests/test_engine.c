/* test_engine.c: the engine against the float64 oracle, on a real uv loop
 * with the CPU backend (no sockets).
 *
 * The test keeps, per session and layer, a dense oracle session holding what
 * the cache must hold. Every successful step is replayed on the oracle and
 * each item's output compared (relative L2, per-cache-type bound of DESIGN.md
 * section 5); every failed call leaves the oracle alone, so continuing the
 * session afterwards proves the failure changed nothing. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine.h"
#include "base.h"
#include "oracle.h"
#include "internal.h" /* daemon/engine: the engine's private modules */

enum { LAYERS = 3, QH = 4, KVH = 2, HD = 64, BS = 16, MAXCTX = 1024, MAXSIM = 8 };

/* The masks a test item asks for, as a client would name them. The RPC layer
 * expands them into the engine's (kernel) form; build_items does it here. */
enum { MK_CAUSAL = 0, MK_FULL, MK_SLIDING, MK_DOCUMENT, MK_PREFIX_LM, MK_CUSTOM };

typedef struct {
  uint64_t id;
  oracle_session_t o[LAYERS];
  uint32_t tokens[MAXCTX];
} sim_t;

typedef struct {
  uv_loop_t loop;
  attnd_engine_t *e;
  attnd_config_t cfg;
  attnd_kshape_t sh;
  float ks[LAYERS][KVH * HD], vs[LAYERS][KVH * HD], kz[LAYERS][KVH * HD], vz[LAYERS][KVH * HD];
  int per_channel;
  uint64_t rng;
  double worst;
  char state_dir[64];
} fx_t;

typedef struct {
  int done;
  attnd_result_t r;
  uint8_t *out;
  float *lse;
} res_t;

/* Takes the result, outputs included (they are the callback's). */
static void on_done(void *arg, attnd_result_t *r) {
  res_t *x = arg;
  x->r = *r;
  x->r.out = NULL;
  x->r.lse = NULL;
  free(x->out);
  free(x->lse);
  x->out = r->out_bytes ? r->out : NULL;
  x->lse = r->lse_bytes ? r->lse : NULL;
  if (!r->out_bytes)
    free(r->out);
  if (!r->lse_bytes)
    free(r->lse);
  x->done = 1;
}

static void res_free(res_t *x) {
  free(x->out);
  free(x->lse);
  memset(x, 0, sizeof(*x));
}

static void wait_res(fx_t *f, res_t *x) {
  while (!x->done)
    if (uv_run(&f->loop, UV_RUN_ONCE) == 0 && !x->done)
      fail_msg("loop ran dry before the call completed");
}

static void check_engine(fx_t *f) {
  char err[256];
  if (attnd_engine_check(f->e, err, sizeof(err)) != 0)
    fail_msg("engine bookkeeping: %s", err);
}

static double tol_for(attnd_kv_type_t kv) {
  switch (kv) {
  case ATTND_KV_BF16:
  case ATTND_KV_FP16:
    return 1e-2;
  case ATTND_KV_INT8_DYNAMIC:
  case ATTND_KV_FP8_DYNAMIC:
    return 2e-2;
  case ATTND_KV_INT4:
    return 1e-1;
  default:
    return 3e-2;
  }
}

static void fx_config(fx_t *f, attnd_kv_type_t kv, uint32_t blocks) {
  memset(&f->cfg, 0, sizeof(f->cfg));
  attnd_kshape_t s = {.q_heads = QH,
                      .kv_heads = KVH,
                      .head_dim = HD,
                      .block_size = BS,
                      .dtype = ATTND_DT_BF16,
                      .kv = kv,
                      .rope = ATTND_ROPE_NEOX,
                      .rope_theta = 10000.0,
                      .rotary_dim = HD,
                      .softmax_scale = 0.125f};
  f->cfg.shape = s;
  f->sh = s;
  f->cfg.layers = LAYERS;
  f->cfg.backend = ATTND_BACKEND_CPU;
  f->cfg.max_context = MAXCTX;
  f->cfg.kv_memory = (uint64_t)blocks * attnd_kv_block_bytes(&s) * LAYERS;
  f->cfg.prefix_cache = 1;
  f->cfg.max_plans = 4;
  f->cfg.threads = 2;
  f->cfg.engine_offload_bytes = ATTND_DEFAULT_ENGINE_OFFLOAD_BYTES;
  snprintf(f->cfg.model_id, sizeof(f->cfg.model_id), "test-model");
  snprintf(f->cfg.state_dir, sizeof(f->cfg.state_dir), "%s", f->state_dir);
}

/* Set by the queued variants of the tests: every step with tensors goes
 * through the threadpool scan and the admission queue. */
static int g_queued;

static void fx_start(fx_t *f) {
  char err[256];
  int rc = attnd_engine_init(&f->e, &f->loop, &f->cfg, err, sizeof(err));
  if (rc)
    fail_msg("engine init: %s", err);
  if (g_queued)
    attnd_engine_set_offload_bytes(f->e, 0);
}

static void closed_cb(void *arg) {
  *(int *)arg = 1;
}

static void fx_stop(fx_t *f) {
  int closed = 0;
  attnd_engine_close(f->e, closed_cb, &closed);
  while (!closed)
    uv_run(&f->loop, UV_RUN_ONCE);
  f->e = NULL;
}

static fx_t *fx_new(attnd_kv_type_t kv, uint32_t blocks) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  f->rng = (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)getpid();
  fx_config(f, kv, blocks);
  fx_start(f);
  return f;
}

static void fx_free(fx_t *f) {
  if (f->e)
    fx_stop(f);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  free(f);
}

/* ---- sessions and scales ---------------------------------------------- */

static sim_t *sim_new(void) {
  sim_t *s = calloc(1, sizeof(*s));
  return s;
}

static void sim_init_oracle(fx_t *f, sim_t *s) {
  for (int l = 0; l < LAYERS; l++)
    oracle_session_init(&s->o[l], &f->sh, MAXCTX);
}

static void sim_free(sim_t *s) {
  for (int l = 0; l < LAYERS; l++)
    oracle_session_free(&s->o[l]);
  free(s);
}

static uint32_t open_session(fx_t *f, sim_t *s, uint32_t ntokens, const uint8_t *salt, size_t sl) {
  res_t x = {0};
  attnd_engine_open_session(f->e, 1, ntokens ? s->tokens : NULL, ntokens, salt, sl, on_done, &x);
  wait_res(f, &x);
  assert_int_equal(x.r.status, 0);
  s->id = x.r.session;
  sim_init_oracle(f, s);
  return x.r.cached_len;
}

static int simple_call(fx_t *f, int which, uint64_t session, uint32_t arg, uint64_t *out) {
  res_t x = {0};
  if (which == 0)
    attnd_engine_close_session(f->e, 1, session, on_done, &x);
  else if (which == 1)
    attnd_engine_fork(f->e, 1, session, on_done, &x);
  else
    attnd_engine_truncate(f->e, 1, session, arg, on_done, &x);
  wait_res(f, &x);
  if (out)
    *out = x.r.session;
  return x.r.status;
}

static attnd_tensor_t ftensor(float *p, int ndim, uint32_t a, uint32_t b) {
  attnd_tensor_t t = {.present = 1, .dtype = ATTND_DT_FP32, .ndim = ndim, .data = (uint8_t *)p};
  t.shape[0] = a;
  t.shape[1] = b;
  t.nbytes = (size_t)a * (ndim == 2 ? b : 1) * 4;
  return t;
}

/* Multiplies the scales set_scales() draws: 0.1 clamps most of N(0,1), so a
 * step run with the wrong scales is far off the oracle. */
static double g_scale_mult = 1.0;

/* Static scales that fit N(0,1) data after RoPE. */
static int set_scales(fx_t *f, int layer, int drop, uint64_t *version) {
  attnd_kv_type_t kv = f->sh.kv;
  int pc = kv == ATTND_KV_INT4 || f->per_channel;
  size_t n = pc ? KVH * HD : KVH;
  double qmax = kv == ATTND_KV_FP8 ? 448.0 : kv == ATTND_KV_INT4 ? 7.0 : 127.0;
  for (size_t i = 0; i < n; i++) {
    double amax = (3.5 + 1.5 * oracle_rng_uniform(&f->rng)) * g_scale_mult;
    f->ks[layer][i] = (float)(amax / qmax);
    f->vs[layer][i] = (float)((amax + 0.5) / qmax);
    f->kz[layer][i] = 8.0f;
    f->vz[layer][i] = 7.0f;
  }
  attnd_scales_req_t r = {.layer = (uint32_t)layer, .drop_cached_kv = drop};
  r.k_scale = ftensor(f->ks[layer], pc ? 2 : 1, KVH, HD);
  r.v_scale = ftensor(f->vs[layer], pc ? 2 : 1, KVH, HD);
  if (kv == ATTND_KV_INT4) {
    r.k_zero = ftensor(f->kz[layer], 2, KVH, HD);
    r.v_zero = ftensor(f->vz[layer], 2, KVH, HD);
  }
  res_t x = {0};
  attnd_engine_set_scales(f->e, &r, on_done, &x);
  wait_res(f, &x);
  if (version)
    *version = x.r.version;
  return x.r.status;
}

static void set_all_scales(fx_t *f) {
  if (!attnd_kv_type_static(f->sh.kv))
    return;
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(set_scales(f, l, 0, NULL), 0);
}

static oracle_scales_t oscales(fx_t *f, int layer) {
  oracle_scales_t sc = {0};
  attnd_kv_type_t kv = f->sh.kv;
  if (attnd_kv_type_static(kv)) {
    sc.k_scale = f->ks[layer];
    sc.v_scale = f->vs[layer];
    sc.per_channel = kv == ATTND_KV_INT4 || f->per_channel;
    if (kv == ATTND_KV_INT4) {
      sc.k_zero = f->kz[layer];
      sc.v_zero = f->vz[layer];
    }
  }
  return sc;
}

/* ---- steps ------------------------------------------------------------- */

typedef struct {
  sim_t *sim;
  uint32_t start, n;
  int kv_only;
  int mask; /* MK_* */
  uint32_t param;
  int bidirectional;
  int32_t docs[4];
  int ndocs;
  int32_t *intervals; /* CUSTOM: [4][kv_len], test-owned */
  int stream;         /* > 0: k/v are a function of (stream, position, layer), like a
                       * real model's KV is of the token prefix, so equal prefixes of
                       * different sessions hold equal KV */
} spec_t;

/* Deterministic k and v rows of a stream at a position and layer. */
static void det_kv(int stream, uint32_t pos, int layer, uint16_t *k, uint16_t *v) {
  uint64_t st =
      (uint64_t)stream * 1000003ull + (uint64_t)pos * 7919ull + (uint64_t)layer * 31ull + 1;
  for (size_t i = 0; i < KVH * HD; i++) {
    oracle_to_dtype(ATTND_DT_BF16, k, i, oracle_rng_normal(&st));
    oracle_to_dtype(ATTND_DT_BF16, v, i, oracle_rng_normal(&st));
  }
}

typedef struct {
  attnd_item_t items[MAXSIM];
  int32_t *iv[MAXSIM]; /* the items' intervals (document and custom masks) */
} itembuf_t;

static void oracle_mask(const spec_t *s, int *kind, int *param, int *causal, int32_t **iv);

/* The engine's items for specs: masks in the kernels' form, a document mask
 * expanded as the RPC layer would (the oracle's own expansion, which
 * tests/test_rpc.c checks the RPC layer's against). */
static void build_items(const spec_t *sp, int n, itembuf_t *ib) {
  memset(ib, 0, sizeof(*ib));
  for (int i = 0; i < n; i++) {
    attnd_item_t *it = &ib->items[i];
    it->session = sp[i].sim->id;
    it->start = sp[i].start;
    it->n = sp[i].n;
    it->kv_only = sp[i].kv_only;
    int kind, param, causal;
    oracle_mask(&sp[i], &kind, &param, &causal, &ib->iv[i]);
    it->mask.kind = (attnd_mask_kind_t)kind;
    it->mask.param = param;
    it->mask.causal = causal;
    it->mask.intervals = ib->iv[i];
    it->mask.intervals_len = ib->iv[i] ? sp[i].start + sp[i].n : 0;
    it->tokens = &sp[i].sim->tokens[sp[i].start];
    it->ntokens = sp[i].n;
  }
}

static void ib_free(itembuf_t *ib) {
  for (int i = 0; i < MAXSIM; i++)
    free(ib->iv[i]);
  memset(ib->iv, 0, sizeof(ib->iv));
}

static int make_plan(fx_t *f, const spec_t *sp, int n, uint64_t conn, uint64_t *plan, char *msg) {
  itembuf_t ib;
  build_items(sp, n, &ib);
  res_t x = {0};
  attnd_engine_plan(f->e, 1, conn, ib.items, (uint32_t)n, on_done, &x);
  wait_res(f, &x);
  ib_free(&ib);
  *plan = x.r.plan;
  if (msg)
    snprintf(msg, 256, "%s", x.r.message);
  return x.r.status;
}

static void rand_bf16(fx_t *f, uint16_t *p, size_t n, double scale) {
  for (size_t i = 0; i < n; i++)
    oracle_to_dtype(ATTND_DT_BF16, p, i, scale * oracle_rng_normal(&f->rng));
}

/* Oracle mask of one item, kernel form: kind, param, causal, intervals. */
static void oracle_mask(const spec_t *s, int *kind, int *param, int *causal, int32_t **iv) {
  uint32_t kv = s->start + s->n;
  *iv = NULL;
  *causal = 1;
  *param = 0;
  switch (s->mask) {
  case MK_CAUSAL:
    *kind = ATTND_MASK_CAUSAL;
    break;
  case MK_FULL:
    *kind = ATTND_MASK_FULL;
    break;
  case MK_SLIDING:
    *kind = ATTND_MASK_SLIDING;
    *param = (int)s->param;
    break;
  case MK_PREFIX_LM:
    *kind = ATTND_MASK_PREFIX_LM;
    *param = (int)s->param;
    break;
  case MK_DOCUMENT: {
    /* Independent of the RPC layer's expansion: mask row p from key j when
     * they lie in different documents (causal handles the rest), written as
     * one interval per key: rows from the key's document end onwards. */
    *kind = ATTND_MASK_INTERVALS;
    *iv = calloc(4 * kv, sizeof(int32_t));
    uint32_t pos = 0;
    for (int d = 0; d < s->ndocs; d++) {
      for (uint32_t j = pos; j < pos + (uint32_t)s->docs[d]; j++) {
        (*iv)[j] = (int32_t)(pos + (uint32_t)s->docs[d]);
        (*iv)[kv + j] = INT32_MAX;
      }
      pos += (uint32_t)s->docs[d];
    }
    break;
  }
  case MK_CUSTOM:
    *kind = ATTND_MASK_INTERVALS;
    *causal = !s->bidirectional;
    *iv = calloc(4 * kv, sizeof(int32_t));
    memcpy(*iv, s->intervals, 16 * (size_t)kv);
    break;
  }
}

typedef struct {
  int fp32_out, want_lse;
  int corrupt;          /* 1: NaN in k of the last item */
  int wrong_token_item; /* >= 0: give this item a wrong token id (inline) */
  int bad_dtype;
  int bad_rows;   /* k claims one row more than the items have */
  int odd_offset; /* tensor bytes at an odd address (decoded in place from a frame) */
  int corrupt_q;  /* 1: infinity in q of the first row */
} stepopt_t;

/* One step in flight: its inputs, kept to replay it on the oracle. */
typedef struct {
  int layer;
  spec_t sp[MAXSIM];
  int n;
  stepopt_t opt;
  uint32_t T, Tq;
  uint16_t *k, *v, *q, *q0;
  float ks[KVH * HD], vs[KVH * HD], kz[KVH * HD], vz[KVH * HD]; /* scales at submission */
  uint8_t *kodd;
  /* The request's items and token ids: the engine reads them until the step
   * is done (it may be admitted later, behind a large step's scan). */
  itembuf_t ib;
  uint32_t *tok[MAXSIM];
  res_t x;
} pend_t;

/* Frees what step_submit allocated. */
static void pend_release(pend_t *pd) {
  free(pd->kodd);
  free(pd->k);
  free(pd->v);
  free(pd->q);
  free(pd->q0);
  for (int i = 0; i < MAXSIM; i++)
    free(pd->tok[i]);
  memset(pd->tok, 0, sizeof(pd->tok));
  ib_free(&pd->ib);
}

/* Submits one step (inline when plan == 0) with fresh random q/k/v. */
static void step_submit(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan, uint64_t conn,
                        const stepopt_t *opt, pend_t *pd) {
  stepopt_t o0 = {.wrong_token_item = -1};
  memset(pd, 0, sizeof(*pd));
  pd->opt = opt ? *opt : o0;
  opt = &pd->opt;
  pd->layer = layer;
  pd->n = n;
  if (layer < LAYERS) {
    memcpy(pd->ks, f->ks[layer], sizeof(pd->ks));
    memcpy(pd->vs, f->vs[layer], sizeof(pd->vs));
    memcpy(pd->kz, f->kz[layer], sizeof(pd->kz));
    memcpy(pd->vz, f->vz[layer], sizeof(pd->vz));
  }
  memcpy(pd->sp, sp, sizeof(spec_t) * (size_t)n);
  uint32_t T = 0, Tq = 0;
  for (int i = 0; i < n; i++) {
    T += sp[i].n;
    if (!sp[i].kv_only)
      Tq += sp[i].n;
  }
  pd->T = T;
  pd->Tq = Tq;
  size_t kvrow = KVH * HD, qrow = QH * HD;
  /* k has a spare row: bad_rows claims it, and the engine may scan it. */
  uint16_t *k = calloc((T + 1) * kvrow, 2), *v = malloc(T * kvrow * 2);
  uint16_t *q = malloc((Tq ? Tq : 1) * qrow * 2), *q0 = malloc((Tq ? Tq : 1) * qrow * 2);
  pd->k = k;
  pd->v = v;
  pd->q = q;
  pd->q0 = q0;
  rand_bf16(f, k, T * kvrow, 1.0);
  rand_bf16(f, v, T * kvrow, 1.0);
  rand_bf16(f, q, Tq * qrow, 1.0);
  memcpy(q0, q, Tq * qrow * 2);
  for (int i = 0, r0 = 0; i < n; r0 += (int)sp[i].n, i++)
    if (sp[i].stream)
      for (uint32_t t = 0; t < sp[i].n; t++)
        det_kv(sp[i].stream, sp[i].start + t, layer, k + (r0 + t) * kvrow, v + (r0 + t) * kvrow);
  if (opt->corrupt)
    k[(T - 1) * kvrow + 3] = 0x7fc0; /* bf16 NaN */
  if (opt->corrupt_q && Tq)
    q[5] = 0x7f80; /* bf16 +inf */
  itembuf_t *ib = &pd->ib;
  build_items(sp, n, ib);
  for (int i = 0; i < n; i++) {
    /* An item may run past MAXCTX on purpose (OUT_OF_RANGE): copy what exists. */
    uint32_t have = sp[i].start < MAXCTX ? MAXCTX - sp[i].start : 0;
    pd->tok[i] = calloc(sp[i].n, sizeof(uint32_t));
    memcpy(pd->tok[i], &sp[i].sim->tokens[sp[i].start],
           (sp[i].n < have ? sp[i].n : have) * sizeof(uint32_t));
    ib->items[i].tokens = pd->tok[i];
  }
  if (opt->wrong_token_item >= 0)
    pd->tok[opt->wrong_token_item][0]++;
  attnd_step_req_t r = {
      .layer = (uint32_t)layer, .plan = plan, .want_lse = opt->want_lse, .fp32_out = opt->fp32_out};
  if (!plan) {
    r.items = ib->items;
    r.nitems = (uint32_t)n;
  }
  r.k = (attnd_tensor_t){.present = 1,
                         .dtype = opt->bad_dtype ? ATTND_DT_FP16 : ATTND_DT_BF16,
                         .ndim = 3,
                         .data = (uint8_t *)k,
                         .nbytes = T * kvrow * 2};
  r.k.shape[0] = T;
  r.k.shape[1] = KVH;
  r.k.shape[2] = HD;
  r.v = r.k;
  r.v.dtype = ATTND_DT_BF16;
  r.v.data = (uint8_t *)v;
  if (opt->bad_rows) {
    r.k.shape[0] = T + 1;
    r.k.nbytes += kvrow * 2;
  }
  if (opt->odd_offset) {
    /* Shift k into an odd-aligned buffer the step owns until done. */
    pd->kodd = malloc(T * kvrow * 2 + 1);
    memcpy(pd->kodd + 1, k, T * kvrow * 2);
    r.k.data = pd->kodd + 1;
  }
  if (Tq) {
    r.q = (attnd_tensor_t){.present = 1,
                           .dtype = ATTND_DT_BF16,
                           .ndim = 3,
                           .data = (uint8_t *)q,
                           .nbytes = Tq * qrow * 2};
    r.q.shape[0] = Tq;
    r.q.shape[1] = QH;
    r.q.shape[2] = HD;
  }
  attnd_engine_step(f->e, 1, conn, &r, on_done, &pd->x);
}

/* Waits for a submitted step; on success replays it on the oracle and checks
 * every item. Returns the status; msg gets the message. */
static int step_finish(fx_t *f, pend_t *pd, char *msg, uint8_t **out_copy) {
  wait_res(f, &pd->x);
  const stepopt_t *opt = &pd->opt;
  const spec_t *sp = pd->sp;
  int n = pd->n, layer = pd->layer;
  size_t kvrow = KVH * HD, qrow = QH * HD;
  res_t *x = &pd->x;
  if (msg)
    snprintf(msg, 256, "%s", x->r.message);
  int status = x->r.status;
  if (status == 0) {
    assert_int_equal(x->r.out_rows, pd->Tq);
    assert_int_equal(x->r.out_bytes, pd->Tq * qrow * (opt->fp32_out ? 4 : 2));
    oracle_scales_t sc = oscales(f, layer);
    if (sc.k_scale) {
      sc.k_scale = pd->ks;
      sc.v_scale = pd->vs;
    }
    if (sc.k_zero) {
      sc.k_zero = pd->kz;
      sc.v_zero = pd->vz;
    }
    uint32_t kr = 0, qr = 0;
    double tol = tol_for(f->sh.kv);
    for (int i = 0; i < n; i++) {
      oracle_session_t *os = &sp[i].sim->o[layer];
      oracle_session_write(&f->sh, os, (int)sp[i].start, (int)sp[i].n, pd->k + kr * kvrow,
                           pd->v + kr * kvrow, &sc);
      if (!sp[i].kv_only) {
        int kind = 0, param = 0, causal = 1;
        int32_t *iv;
        oracle_mask(&sp[i], &kind, &param, &causal, &iv);
        double *ref = malloc(sp[i].n * qrow * sizeof(double));
        double *lse = malloc(sp[i].n * QH * sizeof(double));
        oracle_session_attend(&f->sh, os, (int)sp[i].start, (int)sp[i].n, pd->q0 + qr * qrow, kind,
                              param, causal, iv, ref, lse);
        double err = oracle_rel_l2(ref, opt->fp32_out ? ATTND_DT_FP32 : ATTND_DT_BF16,
                                   x->out + qr * qrow * (opt->fp32_out ? 4 : 2), sp[i].n * qrow);
        if (!(err <= tol))
          fail_msg("layer %d item %d (start %u n %u mask %d): rel L2 %g > %g", layer, i,
                   sp[i].start, sp[i].n, sp[i].mask, err, tol);
        if (err > f->worst)
          f->worst = err;
        if (opt->want_lse) {
          for (uint32_t rr = 0; rr < sp[i].n * QH; rr++) {
            double got = x->lse[qr * QH + rr];
            if (isinf(lse[rr]) ? !isinf(got) : fabs(got - lse[rr]) > 2e-2 * (1 + fabs(lse[rr])))
              fail_msg("item %d lse[%u] = %g, oracle %g", i, rr, got, lse[rr]);
          }
        }
        free(ref);
        free(lse);
        free(iv);
        qr += sp[i].n;
      }
      kr += sp[i].n;
    }
    if (out_copy) {
      *out_copy = x->out;
      x->out = NULL;
    }
  }
  res_free(x);
  pend_release(pd);
  return status;
}

static int step_ex(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan, uint64_t conn,
                   const stepopt_t *opt, char *msg, uint8_t **out_copy) {
  pend_t *pd = malloc(sizeof(*pd));
  step_submit(f, layer, sp, n, plan, conn, opt, pd);
  int rc = step_finish(f, pd, msg, out_copy);
  free(pd);
  return rc;
}

static int step(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan) {
  return step_ex(f, layer, sp, n, plan, 1, NULL, NULL, NULL);
}

/* Plan + every layer, all checked. */
static void plan_all_layers(fx_t *f, const spec_t *sp, int n) {
  uint64_t plan;
  char msg[256];
  int rc = make_plan(f, sp, n, 1, &plan, msg);
  if (rc)
    fail_msg("plan: %s", msg);
  for (int l = 0; l < LAYERS; l++) {
    rc = step_ex(f, l, sp, n, plan, 1, NULL, msg, NULL);
    if (rc)
      fail_msg("layer %d: %d %s", l, rc, msg);
  }
  check_engine(f);
}

static void fill_tokens(fx_t *f, sim_t *s, uint32_t from, uint32_t to) {
  for (uint32_t i = from; i < to; i++)
    s->tokens[i] = (uint32_t)(oracle_rng_next(&f->rng) % 50000);
}

/* ---- tests ------------------------------------------------------------- */

/* A session grown over many steps across block boundaries, every layer, for
 * one cache type; plans reused over layers; then rewrites. */
static void grow_one(attnd_kv_type_t kv) {
  fx_t *f = fx_new(kv, 64);
  set_all_scales(f);
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 200);
  assert_int_equal(open_session(f, a, 0, NULL, 0), 0);
  uint32_t pos = 0;
  uint32_t chunks[] = {20, 1, 1, 13, 1, 17, 1, 1, 40, 3};
  for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
    spec_t sp = {.sim = a, .start = pos, .n = chunks[c]};
    plan_all_layers(f, &sp, 1);
    pos += chunks[c];
  }
  /* Rewrite the last 5 positions (rejected drafts) with new tokens. */
  fill_tokens(f, a, pos - 5, pos);
  spec_t rw = {.sim = a, .start = pos - 5, .n = 3};
  plan_all_layers(f, &rw, 1);
  /* Inline steps, fp32 output and lse, k at an odd address. */
  stepopt_t o = {.fp32_out = 1, .want_lse = 1, .wrong_token_item = -1, .odd_offset = 1};
  spec_t d = {.sim = a, .start = pos - 2, .n = 2};
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &d, 1, 0, 1, &o, NULL, NULL), 0);
  check_engine(f);
  print_message("  %s: %u positions, worst rel L2 %.3g\n", attnd_kv_type_name(kv), pos, f->worst);
  sim_free(a);
  fx_free(f);
}

static void test_grow_bf16(void **state) {
  grow_one(ATTND_KV_BF16);
}
static void test_grow_fp16(void **state) {
  grow_one(ATTND_KV_FP16);
}
static void test_grow_int8(void **state) {
  grow_one(ATTND_KV_INT8);
}
static void test_grow_fp8(void **state) {
  grow_one(ATTND_KV_FP8);
}
static void test_grow_int8_dynamic(void **state) {
  grow_one(ATTND_KV_INT8_DYNAMIC);
}
static void test_grow_fp8_dynamic(void **state) {
  grow_one(ATTND_KV_FP8_DYNAMIC);
}
static void test_grow_int4(void **state) {
  grow_one(ATTND_KV_INT4);
}

/* Several sessions interleaved, mixed prefill and decode in one step, items
 * without q, every mask kind. */
static void test_mixed_batch(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 96);
  sim_t *s[4];
  for (int i = 0; i < 4; i++) {
    s[i] = sim_new();
    fill_tokens(f, s[i], 0, 300);
    open_session(f, s[i], 0, NULL, 0);
  }
  /* Prefill with different masks in one plan. */
  spec_t p[4] = {
      {.sim = s[0], .start = 0, .n = 37},
      {.sim = s[1], .start = 0, .n = 20, .mask = MK_SLIDING, .param = 7},
      {.sim = s[2],
       .start = 0,
       .n = 33,
       .mask = MK_DOCUMENT,
       .ndocs = 3,
       .docs = {10, 15, 8}},
      {.sim = s[3], .start = 0, .n = 18, .kv_only = 1},
  };
  plan_all_layers(f, p, 4);
  /* Decode + prefill mixed, prefix-LM, full and custom intervals. */
  int32_t *iv = calloc(4 * 64, sizeof(int32_t));
  uint32_t kv3 = 18 + 9;
  for (uint32_t j = 0; j < kv3; j++) {
    uint32_t a = (uint32_t)(oracle_rng_next(&f->rng) % (kv3 + 1));
    uint32_t b = a + (uint32_t)(oracle_rng_next(&f->rng) % 5);
    iv[j] = (int32_t)a;
    iv[kv3 + j] = (int32_t)b;
    iv[2 * kv3 + j] = (int32_t)kv3 - 2;
    iv[3 * kv3 + j] = (int32_t)kv3;
  }
  for (int round = 0; round < 3; round++) {
    spec_t m[4] = {
        {.sim = s[0], .start = 37 + (uint32_t)round, .n = 1},
        {.sim = s[1],
         .start = 20 + 5 * (uint32_t)round,
         .n = 5,
         .mask = MK_PREFIX_LM,
         .param = 12},
        {.sim = s[2], .start = 33 + (uint32_t)round, .n = 1, .mask = MK_FULL},
        {.sim = s[3],
         .start = 18,
         .n = 9,
         .mask = MK_CUSTOM,
         .intervals = iv,
         .bidirectional = round == 1},
    };
    plan_all_layers(f, m, 4);
  }
  /* Layers may move unevenly: layer 0 ahead of the others. */
  spec_t d0 = {.sim = s[0], .start = 40, .n = 1};
  assert_int_equal(step(f, 0, &d0, 1, 0), 0);
  spec_t d1 = {.sim = s[0], .start = 41, .n = 1};
  assert_int_equal(step(f, 0, &d1, 1, 0), 0);
  spec_t both = {.sim = s[0], .start = 40, .n = 2};
  for (int l = 1; l < LAYERS; l++)
    assert_int_equal(step(f, l, &both, 1, 0), 0);
  check_engine(f);
  print_message("  mixed batch worst rel L2 %.3g\n", f->worst);
  free(iv);
  for (int i = 0; i < 4; i++)
    sim_free(s[i]);
  fx_free(f);
}

static void expect(fx_t *f, int got, int want, const char *msg, const char *needle) {
  if (got != want)
    fail_msg("status %d (%s), expected %d", got, msg, want);
  if (needle && !strstr(msg, needle))
    fail_msg("message '%s' lacks '%s'", msg, needle);
  check_engine(f);
}

/* Every invalid case fails as specified and changes nothing: the sessions
 * continue afterwards and still match the oracle. */
static void test_invalid_leave_state(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8, 64);
  char msg[256];
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 300);
  fill_tokens(f, b, 0, 300);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  spec_t pre[2] = {{.sim = a, .start = 0, .n = 12}, {.sim = b, .start = 0, .n = 5}};
  /* Static type without scales: FAILED_PRECONDITION. */
  expect(f, step_ex(f, 0, pre, 2, 0, 1, NULL, msg, NULL), ATTND_EPRECOND, msg, "scales");
  set_all_scales(f);
  plan_all_layers(f, pre, 2);
  stepopt_t none = {.wrong_token_item = -1};
  spec_t good = {.sim = b, .start = 5, .n = 2};
  /* start > len, naming the item. */
  spec_t s1[2] = {good, {.sim = a, .start = 17, .n = 1}};
  expect(f, step_ex(f, 0, s1, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg,
         "item 1: start 17 > len 12");
  /* Session twice. */
  spec_t s2[2] = {{.sim = a, .start = 12, .n = 1}, {.sim = a, .start = 12, .n = 1}};
  expect(f, step_ex(f, 0, s2, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Beyond max_context. */
  spec_t s3[2] = {good, {.sim = a, .start = 12, .n = MAXCTX}};
  expect(f, step_ex(f, 0, s3, 2, 0, 1, NULL, msg, NULL), ATTND_ERANGE, msg, "item 1");
  /* Layer out of range. */
  spec_t s4 = good;
  expect(f, step_ex(f, LAYERS, &s4, 1, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "layer");
  /* Layer 1 past layer 0. */
  spec_t good1 = {.sim = b, .start = 3, .n = 2};
  spec_t s5[2] = {good1, {.sim = a, .start = 12, .n = 1}};
  expect(f, step_ex(f, 1, s5, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Token ids that differ from layer 0's. */
  spec_t s6[2] = {{.sim = b, .start = 3, .n = 2}, {.sim = a, .start = 10, .n = 2}};
  stepopt_t wt = {.wrong_token_item = 1};
  expect(f, step_ex(f, 1, s6, 2, 0, 1, &wt, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Non-finite k. */
  stepopt_t nan = {.corrupt = 1, .wrong_token_item = -1};
  spec_t s7[2] = {good, {.sim = a, .start = 12, .n = 3}};
  expect(f, step_ex(f, 0, s7, 2, 0, 1, &nan, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Wrong dtype. */
  stepopt_t bd = {.bad_dtype = 1, .wrong_token_item = -1};
  expect(f, step_ex(f, 0, s7, 2, 0, 1, &bd, msg, NULL), ATTND_EINVAL, msg, "dtype");
  /* k with more rows than the items. */
  stepopt_t br = {.bad_rows = 1, .wrong_token_item = -1};
  expect(f, step_ex(f, 0, s7, 2, 0, 1, &br, msg, NULL), ATTND_EINVAL, msg, "shape");
  /* Masks: window 0, intervals start > end, intervals of the wrong length,
   * an unknown kind. (Documents that do not sum to kv_len never reach the
   * engine: the RPC layer refuses them while expanding; test_rpc.c.) */
  spec_t s8[2] = {good, {.sim = a, .start = 12, .n = 2, .mask = MK_SLIDING}};
  expect(f, step_ex(f, 0, s8, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "item 1");
  int32_t iv[4 * 14] = {0};
  iv[3] = 5; /* lts[3] = 5 > lte[3] = 0 */
  spec_t s10[2] = {good,
                   {.sim = a, .start = 12, .n = 2, .mask = MK_CUSTOM, .intervals = iv}};
  expect(f, step_ex(f, 0, s10, 2, 0, 1, NULL, msg, NULL), ATTND_EINVAL, msg, "item 1");
  /* Intervals of the wrong length (for kv_len 13 instead of 14). */
  {
    itembuf_t ib;
    spec_t s12[2] = {good,
                     {.sim = a, .start = 12, .n = 2, .mask = MK_CUSTOM, .intervals = iv}};
    build_items(s12, 2, &ib);
    ib.items[1].mask.intervals_len = 13;
    res_t x = {0};
    attnd_engine_plan(f->e, 1, 1, ib.items, 2, on_done, &x);
    wait_res(f, &x);
    expect(f, x.r.status, ATTND_EINVAL, x.r.message, "item 1: intervals");
    ib.items[1].mask.intervals_len = 14;
    ib.items[1].mask.kind = (attnd_mask_kind_t)99;
    res_t z = {0};
    attnd_engine_plan(f->e, 1, 1, ib.items, 2, on_done, &z);
    wait_res(f, &z);
    expect(f, z.r.status, ATTND_EINVAL, z.r.message, "item 1: unknown mask kind");
    /* Steps of another identity. */
    res_t y = {0};
    attnd_engine_plan(f->e, 2, 1, ib.items, 1, on_done, &y);
    wait_res(f, &y);
    expect(f, y.r.status, ATTND_EPERM, y.r.message, "item 0");
    ib_free(&ib);
  }
  /* Unknown session, other identity. */
  sim_t ghost = {.id = 0x1234};
  memcpy(ghost.tokens, a->tokens, sizeof(ghost.tokens));
  spec_t s11[2] = {good, {.sim = &ghost, .start = 0, .n = 1}};
  expect(f, step_ex(f, 0, s11, 2, 0, 1, NULL, msg, NULL), ATTND_ENOTFOUND, msg, "item 1");
  res_t x = {0};
  attnd_engine_close_session(f->e, 2, a->id, on_done, &x);
  wait_res(f, &x);
  assert_int_equal(x.r.status, ATTND_EPERM);
  /* Fork/Truncate need equal lengths; truncate beyond len. */
  spec_t ahead = {.sim = a, .start = 12, .n = 2};
  assert_int_equal(step(f, 0, &ahead, 1, 0), 0);
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), ATTND_EPRECOND);
  assert_int_equal(simple_call(f, 2, a->id, 3, NULL), ATTND_EPRECOND);
  for (int l = 1; l < LAYERS; l++)
    assert_int_equal(step(f, l, &ahead, 1, 0), 0);
  assert_int_equal(simple_call(f, 2, a->id, 99, NULL), ATTND_EINVAL);
  /* Ended and unknown plans. */
  uint64_t p1, p2;
  spec_t pa = {.sim = a, .start = 14, .n = 1};
  assert_int_equal(make_plan(f, &pa, 1, 1, &p1, msg), 0);
  assert_int_equal(make_plan(f, &pa, 1, 1, &p2, msg), 0); /* ends p1 */
  expect(f, step_ex(f, 0, &pa, 1, p1, 1, NULL, msg, NULL), ATTND_EPRECOND, msg, "plan");
  attnd_engine_conn_closed(f->e, 1);
  expect(f, step_ex(f, 0, &pa, 1, p2, 1, &none, msg, NULL), ATTND_EPRECOND, msg, "plan");
  /* Plans per connection: the oldest ends first (max_plans = 4). */
  sim_t *c[5];
  uint64_t pc[5];
  for (int i = 0; i < 5; i++) {
    c[i] = sim_new();
    fill_tokens(f, c[i], 0, 10);
    open_session(f, c[i], 0, NULL, 0);
    spec_t ps = {.sim = c[i], .start = 0, .n = 3};
    assert_int_equal(make_plan(f, &ps, 1, 7, &pc[i], msg), 0);
  }
  spec_t ps0 = {.sim = c[0], .start = 0, .n = 3}, ps1 = {.sim = c[1], .start = 0, .n = 3};
  expect(f, step_ex(f, 0, &ps0, 1, pc[0], 7, NULL, msg, NULL), ATTND_EPRECOND, msg, "plan");
  assert_int_equal(step_ex(f, 0, &ps1, 1, pc[1], 7, NULL, msg, NULL), 0);
  /* Everything above left a and b intact: continue them, all layers. */
  spec_t cont[2] = {{.sim = a, .start = 14, .n = 3}, {.sim = b, .start = 5, .n = 4}};
  plan_all_layers(f, cont, 2);
  spec_t dec[2] = {{.sim = a, .start = 17, .n = 1}, {.sim = b, .start = 9, .n = 1}};
  plan_all_layers(f, dec, 2);
  for (int i = 0; i < 5; i++)
    sim_free(c[i]);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* Copies the oracle state of one session into another (fork). */
static void sim_copy(sim_t *dst, const sim_t *src) {
  for (int l = 0; l < LAYERS; l++) {
    dst->o[l].len = src->o[l].len;
    memcpy(dst->o[l].K, src->o[l].K, sizeof(double) * MAXCTX * KVH * HD);
    memcpy(dst->o[l].V, src->o[l].V, sizeof(double) * MAXCTX * KVH * HD);
  }
  memcpy(dst->tokens, src->tokens, sizeof(dst->tokens));
}

/* Prefix hits give the same outputs as a cold session (fp32, rel L2 <= 1e-3):
 * a and c compute the same prefix from the same k/v (c under a salt, so it
 * never shares); b hits a's blocks; b and c then take the same steps. */
static void test_prefix_hit_equals_miss(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 100);
  memcpy(b->tokens, a->tokens, sizeof(a->tokens));
  memcpy(c->tokens, a->tokens, sizeof(a->tokens));
  const uint8_t salt[3] = {1, 2, 3};
  open_session(f, a, 0, NULL, 0);
  assert_int_equal(open_session(f, c, 50, salt, 3), 0);
  uint64_t seed0 = f->rng;
  spec_t pa = {.sim = a, .start = 0, .n = 40};
  plan_all_layers(f, &pa, 1);
  f->rng = seed0;
  spec_t pc = {.sim = c, .start = 0, .n = 40};
  plan_all_layers(f, &pc, 1);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.blocks_used, 6);
  /* b asks for 50 tokens: 32 cached (whole blocks of a). */
  assert_int_equal(open_session(f, b, 50, NULL, 0), 32);
  sim_copy(b, a);
  for (int l = 0; l < LAYERS; l++)
    b->o[l].len = 32;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.prefix_queries, 2);
  assert_int_equal(st.prefix_hit_tokens, 32);
  assert_int_equal(st.prefix_miss_tokens, 50 + 18);
  /* c rolls back to the same point. */
  assert_int_equal(simple_call(f, 2, c->id, 32, NULL), 0);
  for (int l = 0; l < LAYERS; l++)
    c->o[l].len = 32;
  uint64_t seed1 = f->rng, plan;
  char msg[256];
  stepopt_t o32 = {.fp32_out = 1, .wrong_token_item = -1};
  uint8_t *outb[LAYERS], *outc[LAYERS];
  spec_t sb = {.sim = b, .start = 32, .n = 18};
  assert_int_equal(make_plan(f, &sb, 1, 1, &plan, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &sb, 1, plan, 1, &o32, msg, &outb[l]), 0);
  f->rng = seed1;
  spec_t sc = {.sim = c, .start = 32, .n = 18};
  assert_int_equal(make_plan(f, &sc, 1, 1, &plan, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &sc, 1, plan, 1, &o32, msg, &outc[l]), 0);
  for (int l = 0; l < LAYERS; l++) {
    double num = 0, den = 0;
    const float *x = (const float *)outb[l], *y = (const float *)outc[l];
    for (size_t i = 0; i < 18 * QH * HD; i++) {
      num += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
      den += (double)y[i] * y[i];
    }
    double rel = sqrt(num / den);
    print_message("  layer %d: hit vs no-hit rel L2 %.3g\n", l, rel);
    assert_true(rel <= 1e-3);
    free(outb[l]);
    free(outc[l]);
  }
  check_engine(f);
  sim_free(a);
  sim_free(b);
  sim_free(c);
  fx_free(f);
}

/* With every hash equal, lookups still hit only on equal tokens. */
static void test_forced_collision(void **state) {
  attnd_prefix_test_force_collision = 1;
  fx_t *f = fx_new(ATTND_KV_FP8_DYNAMIC, 64);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 100);
  open_session(f, a, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 33};
  plan_all_layers(f, &pa, 1);
  fill_tokens(f, b, 0, 100); /* different tokens */
  assert_int_equal(open_session(f, b, 40, NULL, 0), 0);
  memcpy(c->tokens, a->tokens, sizeof(c->tokens));
  c->tokens[20] ^= 1; /* first block equal, second differs */
  assert_int_equal(open_session(f, c, 40, NULL, 0), 16);
  sim_copy(c, a);
  c->tokens[20] ^= 1;
  for (int l = 0; l < LAYERS; l++)
    c->o[l].len = 16;
  spec_t pc = {.sim = c, .start = 16, .n = 8};
  plan_all_layers(f, &pc, 1);
  spec_t pb = {.sim = b, .start = 0, .n = 20};
  plan_all_layers(f, &pb, 1);
  attnd_prefix_test_force_collision = 0;
  sim_free(a);
  sim_free(b);
  sim_free(c);
  fx_free(f);
}

/* Fork shares blocks, both continue differently (copy-on-write); truncate
 * rolls back and the session continues. */
static void test_fork_truncate(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8_DYNAMIC, 64);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 200);
  open_session(f, a, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 24};
  plan_all_layers(f, &pa, 1);
  uint64_t bid;
  assert_int_equal(simple_call(f, 1, a->id, 0, &bid), 0);
  b->id = bid;
  sim_init_oracle(f, b);
  sim_copy(b, a);
  fill_tokens(f, b, 24, 200);
  attnd_engine_stats_t st0, st1;
  attnd_engine_stats(f->e, &st0);
  /* Both write into the shared partial block 1 (positions 16..23 held). */
  spec_t two[2] = {{.sim = a, .start = 24, .n = 5}, {.sim = b, .start = 24, .n = 3}};
  plan_all_layers(f, two, 2);
  attnd_engine_stats(f->e, &st1);
  assert_true(st1.cow_copies > st0.cow_copies);
  /* b rewrites inside the shared block 0 region too. */
  spec_t rw = {.sim = b, .start = 10, .n = 4};
  fill_tokens(f, b, 10, 14);
  plan_all_layers(f, &rw, 1);
  spec_t da = {.sim = a, .start = 29, .n = 1};
  plan_all_layers(f, &da, 1);
  /* Truncate a to 20 and continue. */
  assert_int_equal(simple_call(f, 2, a->id, 20, NULL), 0);
  for (int l = 0; l < LAYERS; l++)
    a->o[l].len = 20;
  fill_tokens(f, a, 20, 40);
  spec_t ta = {.sim = a, .start = 20, .n = 6};
  plan_all_layers(f, &ta, 1);
  spec_t tb = {.sim = b, .start = 14, .n = 2};
  plan_all_layers(f, &tb, 1);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), 0);
  check_engine(f);
  spec_t tb2 = {.sim = b, .start = 16, .n = 1};
  plan_all_layers(f, &tb2, 1);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* A small pool: cached prefixes are evicted leaf first; when all blocks are
 * referenced a step fails with RESOURCE_EXHAUSTED and changes nothing. */
static void test_eviction_pressure(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 8);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 200);
  open_session(f, a, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 64}; /* 4 blocks, all published */
  plan_all_layers(f, &pa, 1);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), 0);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.blocks_cached, 4);
  fill_tokens(f, b, 0, 200);
  open_session(f, b, 0, NULL, 0);
  spec_t pb = {.sim = b, .start = 0, .n = 80}; /* 5 blocks: evicts one cached */
  plan_all_layers(f, &pb, 1);
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.evictions, 1);
  /* The evicted block was a's leaf: a's first 3 blocks still hit. */
  memcpy(c->tokens, a->tokens, sizeof(c->tokens));
  assert_int_equal(open_session(f, c, 100, NULL, 0), 48);
  /* Now every block is referenced (b: 5, c: 3): b cannot grow a block. */
  char msg[256];
  spec_t grow = {.sim = b, .start = 80, .n = 1};
  uint64_t plan;
  expect(f, make_plan(f, &grow, 1, 1, &plan, msg), ATTND_ENOSPC, msg, NULL);
  expect(f, step_ex(f, 0, &grow, 1, 0, 1, NULL, msg, NULL), ATTND_ENOSPC, msg, NULL);
  attnd_session_info_t info[8];
  assert_int_equal(attnd_engine_list_sessions(f->e, 1, NULL, 0), 2);
  assert_int_equal(attnd_engine_list_sessions(f->e, 1, info, 8), 2);
  /* Closing c leaves a's 3 blocks cached (evictable): b grows, and its
   * outputs still match the oracle, so the failures changed nothing. */
  assert_int_equal(simple_call(f, 0, c->id, 0, NULL), 0);
  plan_all_layers(f, &grow, 1);
  attnd_engine_stats(f->e, &st);
  assert_true(st.evictions >= 2);
  sim_free(a);
  sim_free(b);
  sim_free(c);
  fx_free(f);
}

/* Random operations, bookkeeping checked after every one (two seconds). */
static void test_random_ops(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 14);
  enum { NS = 6 };
  sim_t *s[NS] = {0};
  uint32_t len[NS] = {0};
  /* Few distinct token streams, so prefixes repeat and hit. */
  uint32_t streams[3][MAXCTX];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < MAXCTX; j++)
      streams[i][j] = (uint32_t)(oracle_rng_next(&f->rng) % 7) + (uint32_t)i * 100;
  uint64_t t0 = uv_hrtime();
  int ops = 0, enospc = 0, hits = 0;
  int stream_of[NS] = {0};
  while (uv_hrtime() - t0 < 2000000000ull && ops < 3000) {
    ops++;
    int i = (int)(oracle_rng_next(&f->rng) % NS);
    int op = (int)(oracle_rng_next(&f->rng) % 10);
    if (!s[i]) {
      s[i] = sim_new();
      int st = (int)(oracle_rng_next(&f->rng) % 3);
      stream_of[i] = st + 1;
      memcpy(s[i]->tokens, streams[st], sizeof(s[i]->tokens));
      uint32_t cached =
          open_session(f, s[i], 1 + (uint32_t)(oracle_rng_next(&f->rng) % 90), NULL, 0);
      hits += cached > 0;
      /* The cached KV is the stream's: the oracle gets the same rows. */
      uint16_t kr[KVH * HD], vr[KVH * HD];
      for (int l = 0; l < LAYERS; l++) {
        oracle_scales_t sc = oscales(f, l);
        for (uint32_t p = 0; p < cached; p++) {
          det_kv(stream_of[i], p, l, kr, vr);
          oracle_session_write(&f->sh, &s[i]->o[l], (int)p, 1, kr, vr, &sc);
        }
      }
      len[i] = cached;
    } else if (op < 6) {
      uint32_t n = 1 + (uint32_t)(oracle_rng_next(&f->rng) % (op < 3 ? 3 : 20));
      uint32_t start = len[i] > 0 && op == 5 ? len[i] - 1 : len[i];
      if (start + n > 200)
        continue;
      spec_t sp = {.sim = s[i], .start = start, .n = n, .stream = stream_of[i]};
      uint64_t plan;
      char msg[256];
      int rc = make_plan(f, &sp, 1, 1, &plan, msg);
      if (rc == ATTND_ENOSPC) {
        enospc++;
        check_engine(f);
        continue;
      }
      assert_int_equal(rc, 0);
      for (int l = 0; l < LAYERS; l++) {
        assert_int_equal(step_ex(f, l, &sp, 1, plan, 1, NULL, msg, NULL), 0);
        check_engine(f);
      }
      len[i] = start + n;
    } else if (op == 6) {
      uint32_t to = len[i] ? (uint32_t)(oracle_rng_next(&f->rng) % (len[i] + 1)) : 0;
      assert_int_equal(simple_call(f, 2, s[i]->id, to, NULL), 0);
      for (int l = 0; l < LAYERS; l++)
        s[i]->o[l].len = (int)to;
      len[i] = to;
    } else if (op == 7) {
      int j = (i + 1) % NS;
      if (s[j])
        continue;
      uint64_t id;
      int rc = simple_call(f, 1, s[i]->id, 0, &id);
      assert_int_equal(rc, 0);
      s[j] = sim_new();
      stream_of[j] = stream_of[i];
      s[j]->id = id;
      sim_init_oracle(f, s[j]);
      sim_copy(s[j], s[i]);
      len[j] = len[i];
    } else {
      assert_int_equal(simple_call(f, 0, s[i]->id, 0, NULL), 0);
      sim_free(s[i]);
      s[i] = NULL;
    }
    check_engine(f);
  }
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  print_message("  %d ops, %d RESOURCE_EXHAUSTED, %d prefix hits, %llu evictions, %llu COW, "
                "worst rel L2 %.3g\n",
                ops, enospc, hits, (unsigned long long)st.evictions,
                (unsigned long long)st.cow_copies, f->worst);
  for (int i = 0; i < NS; i++)
    if (s[i])
      sim_free(s[i]);
  fx_free(f);
}

/* Random multi-session plans with every layer in flight at once, layer 0
 * running ahead of the others through inline steps and catching up later,
 * forks, truncates and closes; bookkeeping checked after every operation and
 * every output against the oracle (two seconds). */
static void test_random_pipelined(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8_DYNAMIC, 20);
  enum { NS = 6, NP = 96 };
  sim_t *s[NS] = {0};
  int stream_of[NS] = {0};
  uint32_t lens[NS][LAYERS];
  memset(lens, 0, sizeof(lens));
  uint32_t streams[3][MAXCTX];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < MAXCTX; j++)
      streams[i][j] = (uint32_t)(oracle_rng_next(&f->rng) % 5) + (uint32_t)i * 100;
  static pend_t pd[NP];
  int np = 0, ops = 0, refused = 0, steps = 0;
  char msg[256];
#define FLUSH()                                                                                    \
  do {                                                                                             \
    for (int q_ = 0; q_ < np; q_++)                                                                \
      if (step_finish(f, &pd[q_], msg, NULL) != 0)                                                 \
        fail_msg("pending step %d: %s", q_, msg);                                                  \
    np = 0;                                                                                        \
  } while (0)
  uint64_t t0 = uv_hrtime();
  while (uv_hrtime() - t0 < 2000000000ull && ops < 2000) {
    ops++;
    if (np > NP - 2 * LAYERS - 2)
      FLUSH();
    int i = (int)(oracle_rng_next(&f->rng) % NS);
    int op = (int)(oracle_rng_next(&f->rng) % 12);
    if (!s[i]) {
      s[i] = sim_new();
      int st = (int)(oracle_rng_next(&f->rng) % 3);
      stream_of[i] = st + 1;
      memcpy(s[i]->tokens, streams[st], sizeof(s[i]->tokens));
      uint32_t cached =
          open_session(f, s[i], 1 + (uint32_t)(oracle_rng_next(&f->rng) % 70), NULL, 0);
      uint16_t kr[KVH * HD], vr[KVH * HD];
      for (int l = 0; l < LAYERS; l++) {
        oracle_scales_t sc = oscales(f, l);
        for (uint32_t p = 0; p < cached; p++) {
          det_kv(stream_of[i], p, l, kr, vr);
          oracle_session_write(&f->sh, &s[i]->o[l], (int)p, 1, kr, vr, &sc);
        }
        lens[i][l] = cached;
      }
    } else if (op < 5) {
      /* A plan over up to three sessions whose layers are level. */
      spec_t sp[3];
      int n = 0;
      for (int k = 0; k < NS && n < 3; k++) {
        int j = (i + k) % NS;
        int level = s[j] != NULL;
        for (int l = 1; level && l < LAYERS; l++)
          level = lens[j][l] == lens[j][0];
        if (!level || (k > 0 && oracle_rng_next(&f->rng) % 2))
          continue;
        uint32_t start = lens[j][0];
        if (start > 0 && oracle_rng_next(&f->rng) % 4 == 0)
          start--; /* a retry: same tokens, same KV */
        uint32_t len = 1 + (uint32_t)(oracle_rng_next(&f->rng) % 12);
        if (start + len > 160)
          continue;
        sp[n++] = (spec_t){.sim = s[j], .start = start, .n = len, .stream = stream_of[j]};
      }
      if (n == 0)
        continue;
      uint64_t plan;
      int rc = make_plan(f, sp, n, 1, &plan, msg);
      if (rc == ATTND_ENOSPC) {
        refused++;
        check_engine(f);
        continue;
      }
      assert_int_equal(rc, 0);
      for (int l = 0; l < LAYERS; l++)
        step_submit(f, l, sp, n, plan, 1, NULL, &pd[np++]);
      steps += LAYERS;
      for (int k = 0; k < n; k++) {
        int j = 0;
        while (s[j] != sp[k].sim)
          j++;
        for (int l = 0; l < LAYERS; l++)
          lens[j][l] = sp[k].start + sp[k].n;
      }
    } else if (op < 7) {
      /* Layer 0 runs ahead (inline). */
      uint32_t len = 1 + (uint32_t)(oracle_rng_next(&f->rng) % 5);
      if (lens[i][0] + len > 160)
        continue;
      spec_t sp = {.sim = s[i], .start = lens[i][0], .n = len, .stream = stream_of[i]};
      step_submit(f, 0, &sp, 1, 0, 1, NULL, &pd[np]);
      if (pd[np].x.done && pd[np].x.r.status) {
        /* Refused at admission (pool exhausted): nothing changed. */
        assert_int_equal(pd[np].x.r.status, ATTND_ENOSPC);
        pd[np].x.r.status = 0;
        pd[np].x.done = 1;
        res_free(&pd[np].x);
        pend_release(&pd[np]);
        refused++;
      } else {
        np++;
        steps++;
        lens[i][0] += len;
      }
    } else if (op < 9) {
      /* The other layers catch up (inline). */
      for (int l = 1; l < LAYERS; l++) {
        if (lens[i][l] >= lens[i][0])
          continue;
        spec_t sp = {
            .sim = s[i], .start = lens[i][l], .n = lens[i][0] - lens[i][l], .stream = stream_of[i]};
        step_submit(f, l, &sp, 1, 0, 1, NULL, &pd[np++]);
        steps++;
        lens[i][l] = lens[i][0];
      }
    } else {
      FLUSH();
      int level = 1;
      for (int l = 1; l < LAYERS; l++)
        level &= lens[i][l] == lens[i][0];
      if (op == 9) {
        uint32_t to = (uint32_t)(oracle_rng_next(&f->rng) % (lens[i][0] + 1));
        int rc = simple_call(f, 2, s[i]->id, to, NULL);
        assert_int_equal(rc, level ? 0 : ATTND_EPRECOND);
        if (rc == 0)
          for (int l = 0; l < LAYERS; l++) {
            s[i]->o[l].len = (int)to;
            lens[i][l] = to;
          }
      } else if (op == 10) {
        int j = (i + 1) % NS;
        if (s[j])
          continue;
        uint64_t id;
        int rc = simple_call(f, 1, s[i]->id, 0, &id);
        assert_int_equal(rc, level ? 0 : ATTND_EPRECOND);
        if (rc == 0) {
          s[j] = sim_new();
          s[j]->id = id;
          sim_init_oracle(f, s[j]);
          sim_copy(s[j], s[i]);
          stream_of[j] = stream_of[i];
          memcpy(lens[j], lens[i], sizeof(lens[i]));
        }
      } else {
        assert_int_equal(simple_call(f, 0, s[i]->id, 0, NULL), 0);
        sim_free(s[i]);
        s[i] = NULL;
      }
    }
    check_engine(f);
  }
  FLUSH();
#undef FLUSH
  check_engine(f);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  print_message("  %d ops, %d steps, %d refused, %llu evictions, %llu COW, %llu hit tokens, "
                "worst rel L2 %.3g\n",
                ops, steps, refused, (unsigned long long)st.evictions,
                (unsigned long long)st.cow_copies, (unsigned long long)st.prefix_hit_tokens,
                f->worst);
  for (int i = 0; i < NS; i++)
    if (s[i])
      sim_free(s[i]);
  fx_free(f);
}

/* Scales survive a restart: same inputs, identical outputs. SetScales on a
 * layer holding KV needs drop_cached_kv. */
static void test_scales_persist(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  snprintf(f->state_dir, sizeof(f->state_dir), "/tmp/attnd-eng-XXXXXX");
  assert_non_null(mkdtemp(f->state_dir));
  f->rng = 99;
  fx_config(f, ATTND_KV_INT4, 32);
  fx_start(f);
  set_all_scales(f);
  uint64_t seed = f->rng;
  uint8_t *out1[LAYERS], *out2[LAYERS];
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 100);
  open_session(f, a, 0, NULL, 0);
  spec_t sp = {.sim = a, .start = 0, .n = 21};
  uint64_t plan;
  char msg[256];
  assert_int_equal(make_plan(f, &sp, 1, 1, &plan, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &sp, 1, plan, 1, NULL, msg, &out1[l]), 0);
  /* The layer holds KV: a change needs drop_cached_kv, which zeroes len[1]. */
  uint64_t v1, v2;
  assert_int_equal(set_scales(f, 1, 0, &v1), ATTND_EPRECOND);
  float keep_k[KVH * HD], keep_v[KVH * HD];
  memcpy(keep_k, f->ks[1], sizeof(keep_k));
  memcpy(keep_v, f->vs[1], sizeof(keep_v));
  assert_int_equal(set_scales(f, 1, 1, &v2), 0);
  assert_true(v2 > 3);
  spec_t l1 = {.sim = a, .start = 0, .n = 21};
  a->o[1].len = 0;
  assert_int_equal(step(f, 1, &l1, 1, 0), 0); /* layer 1 recomputed under new scales */
  spec_t bad = {.sim = a, .start = 21, .n = 1};
  fill_tokens(f, a, 21, 22);
  (void)bad;
  sim_free(a);
  fx_stop(f);
  /* Restart on the same state dir; put back layer 1's first scales through
   * the test's copy only, the engine must restore everything itself. */
  float new_k[KVH * HD], new_v[KVH * HD];
  memcpy(new_k, f->ks[1], sizeof(new_k));
  memcpy(new_v, f->vs[1], sizeof(new_v));
  fx_start(f);
  a = sim_new();
  f->rng = seed;
  fill_tokens(f, a, 0, 100);
  open_session(f, a, 0, NULL, 0);
  /* Replaying the same inputs: layers 0 and 2 must match bit for bit; layer 1
   * now has the new scales, so compare it with the oracle only. */
  spec_t sp2 = {.sim = a, .start = 0, .n = 21};
  assert_int_equal(make_plan(f, &sp2, 1, 1, &plan, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(step_ex(f, l, &sp2, 1, plan, 1, NULL, msg, &out2[l]), 0);
  assert_memory_equal(out1[0], out2[0], 21 * QH * HD * 2);
  assert_memory_equal(out1[2], out2[2], 21 * QH * HD * 2);
  for (int l = 0; l < LAYERS; l++) {
    free(out1[l]);
    free(out2[l]);
  }
  (void)keep_k;
  (void)keep_v;
  (void)new_k;
  (void)new_v;
  sim_free(a);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", f->state_dir);
  assert_int_equal(system(cmd), 0);
  fx_free(f);
}

/* Steps in flight while later calls are admitted: a second plan, a fork, a
 * close of a session whose steps still run, and SetScales on a layer with a
 * job in flight (applied once the layer drains, before the steps behind it). */
static void test_pipelined(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8, 64);
  set_all_scales(f);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new(), *d = sim_new();
  fill_tokens(f, a, 0, 100);
  fill_tokens(f, b, 0, 100);
  fill_tokens(f, d, 0, 100);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  static pend_t pd[32];
  int np = 0;
  uint64_t p1, p2;
  char msg[256];
  /* SetScales behind an in-flight job of its layer. Layer 2 must hold no KV
   * (and no block be cached), so the session is closed while its step runs. */
  sim_t *e2 = sim_new();
  fill_tokens(f, e2, 0, 100);
  open_session(f, e2, 0, NULL, 0);
  spec_t se = {.sim = e2, .start = 0, .n = 10};
  step_submit(f, 0, &se, 1, 0, 1, NULL, &pd[np++]);
  step_submit(f, 2, &se, 1, 0, 1, NULL, &pd[np++]);
  assert_int_equal(simple_call(f, 0, e2->id, 0, NULL), 0);
  uint64_t ver;
  g_scale_mult = 0.1;
  assert_int_equal(set_scales(f, 2, 0, &ver), 0); /* layer 2 holds no KV now */
  g_scale_mult = 1.0;
  open_session(f, d, 0, NULL, 0);
  spec_t sd = {.sim = d, .start = 0, .n = 5};
  step_submit(f, 0, &sd, 1, 0, 1, NULL, &pd[np++]);
  step_submit(f, 2, &sd, 1, 0, 1, NULL, &pd[np++]); /* must use the new scales */
  for (int i = 0; i < np; i++)
    assert_int_equal(step_finish(f, &pd[i], msg, NULL), 0);
  np = 0;
  assert_int_equal(simple_call(f, 0, d->id, 0, NULL), 0);
  spec_t s1[2] = {{.sim = a, .start = 0, .n = 20}, {.sim = b, .start = 0, .n = 9}};
  assert_int_equal(make_plan(f, s1, 2, 1, &p1, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    step_submit(f, l, s1, 2, p1, 1, NULL, &pd[np++]);
  spec_t s2[2] = {{.sim = a, .start = 20, .n = 1}, {.sim = b, .start = 9, .n = 3}};
  assert_int_equal(make_plan(f, s2, 2, 1, &p2, msg), 0);
  for (int l = 0; l < LAYERS; l++)
    step_submit(f, l, s2, 2, p2, 1, NULL, &pd[np++]);
  uint64_t cid;
  assert_int_equal(simple_call(f, 1, a->id, 0, &cid), 0); /* fork while in flight */
  assert_int_equal(simple_call(f, 0, b->id, 0, NULL), 0); /* close while in flight */
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.sessions, 2);
  check_engine(f);
  for (int i = 0; i < np; i++)
    assert_int_equal(step_finish(f, &pd[i], msg, NULL), 0);
  np = 0;
  c->id = cid;
  sim_init_oracle(f, c);
  sim_copy(c, a);
  fill_tokens(f, c, 21, 100);
  spec_t s3[2] = {{.sim = a, .start = 21, .n = 2}, {.sim = c, .start = 21, .n = 4}};
  plan_all_layers(f, s3, 2);

  check_engine(f);
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.blocks_used, 3); /* a and c: block 0 shared, block 1 each */
  sim_free(a);
  sim_free(b);
  sim_free(c);
  sim_free(d);
  sim_free(e2);
  fx_free(f);
}

extern int attnd_backend_cpu_fail_next; /* backend_cpu.c test hook */

/* A step the backend fails answers its error; its sessions answer ABORTED
 * afterwards (their KV is unknown), others carry on, and nothing cached that
 * the failed step might have touched is reused. */
static void test_backend_fault(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 32);
  sim_t *a = sim_new(), *b = sim_new(), *c = sim_new();
  fill_tokens(f, a, 0, 100);
  fill_tokens(f, b, 0, 100);
  memcpy(c->tokens, a->tokens, sizeof(a->tokens));
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 20};
  plan_all_layers(f, &pa, 1);
  spec_t pb = {.sim = b, .start = 0, .n = 4};
  plan_all_layers(f, &pb, 1);
  spec_t da = {.sim = a, .start = 20, .n = 1};
  char msg[256];
  uint64_t pl;
  assert_int_equal(make_plan(f, &da, 1, 1, &pl, msg), 0);
  assert_int_equal(step_ex(f, 0, &da, 1, pl, 1, NULL, msg, NULL), 0);
  attnd_backend_cpu_fail_next = 1;
  expect(f, step_ex(f, 1, &da, 1, pl, 1, NULL, msg, NULL), ATTND_EABORTED, msg, NULL);
  /* The plan is still live; its next layer finds the session broken. */
  expect(f, step_ex(f, 2, &da, 1, pl, 1, NULL, msg, NULL), ATTND_EABORTED, msg, "item 0");
  expect(f, step_ex(f, 1, &da, 1, 0, 1, NULL, msg, NULL), ATTND_EABORTED, msg, "item 0");
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), ATTND_EABORTED);
  assert_int_equal(simple_call(f, 2, a->id, 0, NULL), ATTND_EABORTED);
  assert_int_equal(open_session(f, c, 40, NULL, 0), 0); /* index dropped */
  spec_t db = {.sim = b, .start = 4, .n = 2};
  plan_all_layers(f, &db, 1);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), 0);
  check_engine(f);
  sim_free(a);
  sim_free(b);
  sim_free(c);
  fx_free(f);
}

/* --no-prefix-cache: nothing is published, nothing hits. */
static void test_no_prefix_cache(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  f->rng = 5;
  fx_config(f, ATTND_KV_BF16, 16);
  f->cfg.prefix_cache = 0;
  fx_start(f);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 100);
  memcpy(b->tokens, a->tokens, sizeof(a->tokens));
  open_session(f, a, 0, NULL, 0);
  spec_t pa = {.sim = a, .start = 0, .n = 40};
  plan_all_layers(f, &pa, 1);
  assert_int_equal(open_session(f, b, 40, NULL, 0), 0);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), 0);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.blocks_cached, 0);
  assert_int_equal(st.blocks_used, 0);
  assert_int_equal(st.prefix_queries, 0);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* --max-sessions, Health facts, salts over 64 bytes, sessions per identity. */
static void test_limits_and_info(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  fx_config(f, ATTND_KV_FP8_DYNAMIC, 10);
  f->cfg.max_sessions = 2;
  fx_start(f);
  attnd_engine_info_t info;
  attnd_engine_info(f->e, &info);
  assert_string_equal(info.backend, "cpu");
  assert_int_equal(info.kv_blocks, 10);
  /* fp8_dynamic: 1 byte per element plus an fp32 scale per token and head. */
  assert_true(fabs(info.kv_bytes_per_token - LAYERS * 2.0 * KVH * (HD + 4)) < 1e-9);
  assert_int_equal(info.kv_memory, 10ull * attnd_kv_block_bytes(&f->sh) * LAYERS);
  sim_t *a = sim_new(), *b = sim_new();
  open_session(f, a, 0, NULL, 0);
  uint8_t salt[65] = {0};
  res_t x = {0};
  attnd_engine_open_session(f->e, 1, NULL, 0, salt, 65, on_done, &x);
  assert_int_equal(x.r.status, ATTND_EINVAL);
  open_session(f, b, 0, NULL, 0);
  res_t y = {0};
  attnd_engine_open_session(f->e, 3, NULL, 0, NULL, 0, on_done, &y);
  assert_int_equal(y.r.status, ATTND_ENOSPC);
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), ATTND_ENOSPC);
  assert_int_equal(attnd_engine_list_sessions(f->e, 1, NULL, 0), 2);
  assert_int_equal(attnd_engine_list_sessions(f->e, 3, NULL, 0), 0);
  assert_int_equal(simple_call(f, 0, b->id, 0, NULL), 0);
  assert_int_equal(simple_call(f, 1, a->id, 0, NULL), 0);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.sessions, 2);
  assert_int_equal(st.blocks_total, 10);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* Sessions close after --session-idle without calls. */
static void noop_timer(uv_timer_t *t) {}

static void test_idle_close(void **state) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  fx_config(f, ATTND_KV_BF16, 16);
  f->cfg.session_idle_s = 1;
  fx_start(f);
  sim_t *a = sim_new();
  open_session(f, a, 0, NULL, 0);
  uv_timer_t t;
  uv_timer_init(&f->loop, &t);
  uv_timer_start(&t, noop_timer, 1400, 0);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  uv_close((uv_handle_t *)&t, NULL);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.sessions, 0);
  assert_int_equal(simple_call(f, 0, a->id, 0, NULL), ATTND_ENOTFOUND);
  sim_free(a);
  fx_free(f);
}

/* ---- the admission queue ------------------------------------------------ */

static int queued_on(void **state) {
  g_queued = 1;
  return 0;
}

static int queued_off(void **state) {
  g_queued = 0;
  return 0;
}

static uint32_t queued_now(fx_t *f) {
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  return st.queued;
}

static uint32_t session_len(fx_t *f, uint64_t id) {
  attnd_session_info_t info[16];
  uint32_t n = attnd_engine_list_sessions(f->e, 1, info, 16);
  for (uint32_t i = 0; i < n && i < 16; i++)
    if (info[i].session == id)
      return info[i].len;
  fail_msg("session %016llx not listed", (unsigned long long)id);
  return 0;
}

enum { SEQ_OUTS = 16 };

/* One fixed sequence of plans and steps (prefill, decode, inline steps with
 * fp32 output, lse and k at an odd address, a rewrite) from a fixed seed;
 * every step's output is kept. */
static int run_sequence(int queued, uint8_t **outs, size_t *sizes) {
  g_queued = queued;
  fx_t *f = fx_new(ATTND_KV_INT8, 64);
  g_queued = 0;
  f->rng = 0x5eed;
  set_all_scales(f);
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 200);
  fill_tokens(f, b, 0, 200);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  int no = 0;
  char msg[256];
  spec_t pre[2] = {{.sim = a, .start = 0, .n = 37}, {.sim = b, .start = 0, .n = 20}};
  spec_t dec[2] = {{.sim = a, .start = 37, .n = 1}, {.sim = b, .start = 20, .n = 1}};
  const spec_t *plans[2] = {pre, dec};
  for (int pi = 0; pi < 2; pi++) {
    uint64_t plan;
    assert_int_equal(make_plan(f, plans[pi], 2, 1, &plan, msg), 0);
    for (int l = 0; l < LAYERS; l++) {
      assert_int_equal(step_ex(f, l, plans[pi], 2, plan, 1, NULL, msg, &outs[no]), 0);
      sizes[no++] = (pi == 0 ? 57 : 2) * QH * HD * 2;
    }
  }
  stepopt_t o = {.fp32_out = 1, .want_lse = 1, .wrong_token_item = -1, .odd_offset = 1};
  spec_t rw = {.sim = a, .start = 35, .n = 3}; /* a rewrite of the last positions */
  for (int l = 0; l < LAYERS; l++) {
    assert_int_equal(step_ex(f, l, &rw, 1, 0, 1, &o, msg, &outs[no]), 0);
    sizes[no++] = 3 * QH * HD * 4;
  }
  check_engine(f);
  sim_free(a);
  sim_free(b);
  fx_free(f);
  return no;
}

/* Steps admitted from the queue after a threadpool scan compute exactly what
 * steps admitted at once compute: outputs equal bit for bit. */
static void test_queued_equals_direct(void **state) {
  uint8_t *direct[SEQ_OUTS], *queued[SEQ_OUTS];
  size_t sd[SEQ_OUTS], sq[SEQ_OUTS];
  int nd = run_sequence(0, direct, sd);
  int nq = run_sequence(1, queued, sq);
  assert_int_equal(nd, nq);
  for (int i = 0; i < nd; i++) {
    assert_int_equal(sd[i], sq[i]);
    assert_memory_equal(direct[i], queued[i], sd[i]);
    free(direct[i]);
    free(queued[i]);
  }
  print_message("  %d step outputs equal bit for bit\n", nd);
}

typedef struct {
  int calls;
  attnd_result_t r;
} cnt_t;

static void on_count(void *arg, attnd_result_t *r) {
  cnt_t *c = arg;
  c->calls++;
  c->r = *r;
  c->r.out = NULL;
  c->r.lse = NULL;
  free(r->out);
  free(r->lse);
}

/* A large step followed at once, without waiting, by calls that depend on it
 * (other layers of the same positions, which layer 0 must lead; a Truncate,
 * which needs every layer level; a step after it; a Close; a step after the
 * Close): each sees the effect of the calls before it, as if admitted one by
 * one in arrival order. Run both queued and direct: the same answers. */
static void arrival_order(int queued) {
  g_queued = queued;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  g_queued = 0;
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 200);
  open_session(f, a, 0, NULL, 0);
  spec_t pre = {.sim = a, .start = 0, .n = 20};
  plan_all_layers(f, &pre, 1);
  static pend_t pd[LAYERS + 2];
  spec_t grow = {.sim = a, .start = 20, .n = 8};
  for (int l = 0; l < LAYERS; l++)
    step_submit(f, l, &grow, 1, 0, 1, NULL, &pd[l]);
  if (queued)
    assert_int_equal(queued_now(f), LAYERS); /* the first scan has not reported back */
  cnt_t tr = {0}, cl = {0};
  attnd_engine_truncate(f->e, 1, a->id, 24, on_count, &tr);
  spec_t after = {.sim = a, .start = 24, .n = 2};
  step_submit(f, 0, &after, 1, 0, 1, NULL, &pd[LAYERS]);
  attnd_engine_close_session(f->e, 1, a->id, on_count, &cl);
  step_submit(f, 0, &after, 1, 0, 1, NULL, &pd[LAYERS + 1]);
  if (queued) {
    assert_int_equal(queued_now(f), LAYERS + 4);
    assert_int_equal(tr.calls + cl.calls, 0);
  }
  char msg[256];
  for (int l = 0; l < LAYERS; l++)
    if (step_finish(f, &pd[l], msg, NULL) != 0)
      fail_msg("layer %d: %s", l, msg);
  while (!tr.calls || !cl.calls)
    uv_run(&f->loop, UV_RUN_ONCE);
  assert_int_equal(tr.r.status, 0);
  for (int l = 0; l < LAYERS; l++)
    a->o[l].len = 24;
  if (step_finish(f, &pd[LAYERS], msg, NULL) != 0)
    fail_msg("step after truncate: %s", msg);
  assert_int_equal(cl.r.status, 0);
  int rc = step_finish(f, &pd[LAYERS + 1], msg, NULL);
  if (rc != ATTND_ENOTFOUND)
    fail_msg("step after close: %d %s", rc, msg);
  assert_int_equal(tr.calls, 1);
  assert_int_equal(cl.calls, 1);
  assert_int_equal(queued_now(f), 0);
  check_engine(f);
  sim_free(a);
  fx_free(f);
}

static void test_queued_arrival_order(void **state) {
  arrival_order(1);
  arrival_order(0);
}

/* A queued step with a NaN in k of item 1, or an infinity in q of item 0,
 * answers INVALID_ARGUMENT naming the item and changes nothing; the calls
 * queued behind it are admitted and succeed. */
static void test_queued_nan(void **state) {
  g_queued = 1;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  g_queued = 0;
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 200);
  fill_tokens(f, b, 0, 200);
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  spec_t pre[2] = {{.sim = a, .start = 0, .n = 17}, {.sim = b, .start = 0, .n = 9}};
  plan_all_layers(f, pre, 2);
  static pend_t pd[4];
  char msg[256];
  stepopt_t nan_k = {.corrupt = 1, .wrong_token_item = -1};
  stepopt_t inf_q = {.corrupt_q = 1, .wrong_token_item = -1};
  spec_t bad[2] = {{.sim = a, .start = 17, .n = 5}, {.sim = b, .start = 9, .n = 6}};
  step_submit(f, 0, bad, 2, 0, 1, &nan_k, &pd[0]);
  step_submit(f, 0, bad, 2, 0, 1, &inf_q, &pd[1]);
  spec_t good[2] = {{.sim = a, .start = 17, .n = 2}, {.sim = b, .start = 9, .n = 1}};
  step_submit(f, 0, good, 2, 0, 1, NULL, &pd[2]);
  assert_int_equal(queued_now(f), 3);
  int rc = step_finish(f, &pd[0], msg, NULL);
  expect(f, rc, ATTND_EINVAL, msg, "item 1: q, k or v holds a non-finite value");
  rc = step_finish(f, &pd[1], msg, NULL);
  expect(f, rc, ATTND_EINVAL, msg, "item 0: q, k or v holds a non-finite value");
  if ((rc = step_finish(f, &pd[2], msg, NULL)) != 0)
    fail_msg("the step behind the bad ones: %d %s", rc, msg);
  assert_int_equal(session_len(f, a->id), 19);
  assert_int_equal(session_len(f, b->id), 10);
  /* The other layers catch up over the same positions and match the oracle. */
  for (int l = 1; l < LAYERS; l++)
    assert_int_equal(step(f, l, good, 2, 0), 0);
  check_engine(f);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

/* The engine closed while calls wait behind a running scan: every queued
 * call is admitted and answered exactly once before the close completes, a
 * call after the close is refused at once, and a connection that closed
 * while its Plan was queued still ends that plan. */
typedef struct {
  cnt_t *c;
  int n;
  int closed;
  int all_before_close;
} drain_t;

static void drain_closed(void *arg) {
  drain_t *d = arg;
  d->closed = 1;
  d->all_before_close = 1;
  for (int i = 0; i < d->n; i++)
    d->all_before_close &= d->c[i].calls == 1;
}

static void test_queued_drain(void **state) {
  g_queued = 1;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  g_queued = 0;
  sim_t *a = sim_new(), *b = sim_new();
  fill_tokens(f, a, 0, 200);
  memcpy(b->tokens, a->tokens, sizeof(b->tokens));
  open_session(f, a, 0, NULL, 0);
  spec_t pre = {.sim = a, .start = 0, .n = 40};
  plan_all_layers(f, &pre, 1);
  /* Behind a large step: a Plan of connection 5 and that connection's close. */
  static pend_t pd[2];
  spec_t g1 = {.sim = a, .start = 40, .n = 6};
  step_submit(f, 0, &g1, 1, 0, 5, NULL, &pd[0]);
  cnt_t c[8] = {{0}};
  itembuf_t ib;
  spec_t p1 = {.sim = a, .start = 46, .n = 1};
  build_items(&p1, 1, &ib);
  attnd_engine_plan(f->e, 1, 5, ib.items, 1, on_count, &c[0]);
  attnd_engine_conn_closed(f->e, 5);
  assert_int_equal(queued_now(f), 3);
  step_finish(f, &pd[0], NULL, NULL);
  while (!c[0].calls)
    uv_run(&f->loop, UV_RUN_ONCE);
  assert_int_equal(c[0].r.status, 0);
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  assert_int_equal(st.plans, 0); /* ended by the queued conn_closed */
  /* Now close with a scan running and calls of every kind behind it. */
  spec_t g2 = {.sim = a, .start = 46, .n = 5};
  step_submit(f, 0, &g2, 1, 0, 1, NULL, &pd[1]);
  attnd_engine_open_session(f->e, 1, b->tokens, 40, NULL, 0, on_count, &c[1]);
  attnd_engine_fork(f->e, 1, a->id, on_count, &c[2]); /* layers differ: refused */
  attnd_engine_plan(f->e, 1, 1, ib.items, 1, on_count, &c[3]);
  attnd_engine_truncate(f->e, 1, a->id, 3, on_count, &c[4]);
  attnd_engine_close_session(f->e, 1, a->id, on_count, &c[5]);
  assert_int_equal(queued_now(f), 6);
  drain_t d = {.c = c + 1, .n = 5};
  attnd_engine_close(f->e, drain_closed, &d);
  cnt_t late = {0};
  attnd_engine_truncate(f->e, 1, a->id, 3, on_count, &late);
  assert_int_equal(late.calls, 1);
  assert_int_equal(late.r.status, ATTND_EUNAVAIL);
  while (!d.closed)
    uv_run(&f->loop, UV_RUN_ONCE);
  f->e = NULL;
  assert_true(d.all_before_close);
  assert_int_equal(pd[1].x.done, 1);
  assert_int_equal(pd[1].x.r.status, 0);
  res_free(&pd[1].x);
  pend_release(&pd[1]);
  assert_int_equal(c[1].r.status, 0);
  assert_int_equal(c[1].r.cached_len, 32); /* a's published blocks */
  assert_int_equal(c[2].r.status, ATTND_EPRECOND);
  assert_int_equal(c[3].r.status, 0);
  assert_int_equal(c[4].r.status, ATTND_EPRECOND);
  assert_int_equal(c[5].r.status, 0);
  for (int i = 1; i < 6; i++)
    assert_int_equal(c[i].calls, 1);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_grow_bf16),
      cmocka_unit_test(test_grow_fp16),
      cmocka_unit_test(test_grow_int8),
      cmocka_unit_test(test_grow_fp8),
      cmocka_unit_test(test_grow_int8_dynamic),
      cmocka_unit_test(test_grow_fp8_dynamic),
      cmocka_unit_test(test_grow_int4),
      cmocka_unit_test(test_mixed_batch),
      cmocka_unit_test(test_invalid_leave_state),
      cmocka_unit_test(test_prefix_hit_equals_miss),
      cmocka_unit_test(test_forced_collision),
      cmocka_unit_test(test_fork_truncate),
      cmocka_unit_test(test_eviction_pressure),
      cmocka_unit_test(test_random_ops),
      cmocka_unit_test(test_random_pipelined),
      cmocka_unit_test(test_limits_and_info),
      cmocka_unit_test(test_scales_persist),
      cmocka_unit_test(test_idle_close),
      cmocka_unit_test(test_pipelined),
      cmocka_unit_test(test_no_prefix_cache),
      cmocka_unit_test(test_backend_fault),
      cmocka_unit_test(test_queued_equals_direct),
      cmocka_unit_test(test_queued_arrival_order),
      cmocka_unit_test(test_queued_nan),
      cmocka_unit_test(test_queued_drain),
      /* The suite again with every step queued behind a threadpool scan. */
      cmocka_unit_test_setup_teardown(test_grow_bf16, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_grow_int4, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_mixed_batch, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_invalid_leave_state, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_prefix_hit_equals_miss, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_fork_truncate, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_eviction_pressure, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_random_ops, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_scales_persist, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_pipelined, queued_on, queued_off),
      cmocka_unit_test_setup_teardown(test_backend_fault, queued_on, queued_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

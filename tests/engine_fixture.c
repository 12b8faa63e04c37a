/* engine_fixture.c: the engine tests' harness (engine_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine_fixture.h"

/* Takes the result, outputs included (they are the callback's). */
void on_done(void *arg, attnd_result_t *r) {
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

void res_free(res_t *x) {
  free(x->out);
  free(x->lse);
  memset(x, 0, sizeof(*x));
}

void wait_res(fx_t *f, res_t *x) {
  while (!x->done)
    if (uv_run(&f->loop, UV_RUN_ONCE) == 0 && !x->done)
      fail_msg("loop ran dry before the call completed");
}

void check_engine(fx_t *f) {
  char err[256];
  if (attnd_engine_check(f->e, err, sizeof(err)) != 0)
    fail_msg("engine bookkeeping: %s", err);
}

double tol_for(attnd_kv_type_t kv) {
  return attnd_tol_rel_l2(kv);
}

void fx_config(fx_t *f, attnd_kv_type_t kv, uint32_t blocks) {
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
  /* Small: every prefill of more than a block or so runs in chunks (one
   * 16-row tile each), so the chunked path is what the oracle judges. */
  f->cfg.engine_chunk_keys = 256;
  snprintf(f->cfg.model_id, sizeof(f->cfg.model_id), "test-model");
  snprintf(f->cfg.state_dir, sizeof(f->cfg.state_dir), "%s", f->state_dir);
}

/* Set by the queued variants of the tests: every step with tensors goes
 * through the threadpool scan and the admission queue. */
int g_queued;

void fx_start(fx_t *f) {
  char err[256];
  int rc = attnd_engine_init(&f->e, &f->loop, &f->cfg, err, sizeof(err));
  if (rc)
    fail_msg("engine init: %s", err);
  if (g_queued) {
    attnd_engine_set_offload_bytes(f->e, 0);
    /* Every scan in 3 parts on the pool, however small: the parts' merge
     * (first bad row, the copies) is what the oracle and the refusals judge. */
    attnd_engine_set_scan_parts(f->e, 3, 1);
  }
}

void closed_cb(void *arg) {
  *(int *)arg = 1;
}

void fx_stop(fx_t *f) {
  int closed = 0;
  attnd_engine_close(f->e, closed_cb, &closed);
  while (!closed)
    uv_run(&f->loop, UV_RUN_ONCE);
  f->e = NULL;
}

fx_t *fx_new(attnd_kv_type_t kv, uint32_t blocks) {
  fx_t *f = calloc(1, sizeof(*f));
  assert_int_equal(uv_loop_init(&f->loop), 0);
  f->rng = (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)getpid();
  fx_config(f, kv, blocks);
  fx_start(f);
  return f;
}

void fx_free(fx_t *f) {
  if (f->e)
    fx_stop(f);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  free(f);
}

/* ---- sessions and scales ---------------------------------------------- */

sim_t *sim_new(void) {
  sim_t *s = calloc(1, sizeof(*s));
  return s;
}

void sim_init_oracle(fx_t *f, sim_t *s) {
  for (int l = 0; l < LAYERS; l++)
    oracle_session_init(&s->o[l], &f->sh, MAXCTX);
}

void sim_free(sim_t *s) {
  for (int l = 0; l < LAYERS; l++)
    oracle_session_free(&s->o[l]);
  free(s);
}

uint32_t open_session(fx_t *f, sim_t *s, uint32_t ntokens, const uint8_t *salt, size_t sl) {
  res_t x = {0};
  attnd_engine_open_session(f->e, 1, 1, ntokens ? s->tokens : NULL, ntokens, salt, sl, on_done, &x);
  wait_res(f, &x);
  assert_int_equal(x.r.status, 0);
  s->id = x.r.session;
  sim_init_oracle(f, s);
  return x.r.cached_len;
}

int simple_call(fx_t *f, int which, uint64_t session, uint32_t arg, uint64_t *out) {
  res_t x = {0};
  if (which == 0)
    attnd_engine_close_session(f->e, 1, 1, session, on_done, &x);
  else if (which == 1)
    attnd_engine_fork(f->e, 1, 1, session, on_done, &x);
  else
    attnd_engine_truncate(f->e, 1, 1, session, arg, on_done, &x);
  wait_res(f, &x);
  if (out)
    *out = x.r.session;
  return x.r.status;
}

attnd_tensor_t ftensor(float *p, int ndim, uint32_t a, uint32_t b) {
  attnd_tensor_t t = {.present = 1, .dtype = ATTND_DT_FP32, .ndim = ndim, .data = (uint8_t *)p};
  t.shape[0] = a;
  t.shape[1] = b;
  t.nbytes = (size_t)a * (ndim == 2 ? b : 1) * 4;
  return t;
}

/* Multiplies the scales set_scales() draws: 0.1 clamps most of N(0,1), so a
 * step run with the wrong scales is far off the oracle. */
double g_scale_mult = 1.0;

/* Static scales that fit N(0,1) data after RoPE. */
int set_scales(fx_t *f, int layer, int drop, uint64_t *version) {
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

void set_all_scales(fx_t *f) {
  if (!attnd_kv_type_static(f->sh.kv))
    return;
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(set_scales(f, l, 0, NULL), 0);
}

oracle_scales_t oscales(fx_t *f, int layer) {
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

/* Deterministic k and v rows of a stream at a position and layer. */
void det_kv(int stream, uint32_t pos, int layer, uint16_t *k, uint16_t *v) {
  uint64_t st =
      (uint64_t)stream * 1000003ull + (uint64_t)pos * 7919ull + (uint64_t)layer * 31ull + 1;
  for (size_t i = 0; i < KVH * HD; i++) {
    oracle_to_dtype(ATTND_DT_BF16, k, i, oracle_rng_normal(&st));
    oracle_to_dtype(ATTND_DT_BF16, v, i, oracle_rng_normal(&st));
  }
}

/* The engine's items for specs: masks in the kernels' form, a document mask
 * expanded as the RPC layer would (the oracle's own expansion, which
 * tests/test_rpc.c checks the RPC layer's against). */
void build_items(const spec_t *sp, int n, itembuf_t *ib) {
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

void ib_free(itembuf_t *ib) {
  for (int i = 0; i < MAXSIM; i++)
    free(ib->iv[i]);
  memset(ib->iv, 0, sizeof(ib->iv));
}

int make_plan(fx_t *f, const spec_t *sp, int n, uint64_t conn, uint64_t *plan, char *msg) {
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

void rand_bf16(fx_t *f, uint16_t *p, size_t n, double scale) {
  for (size_t i = 0; i < n; i++)
    oracle_to_dtype(ATTND_DT_BF16, p, i, scale * oracle_rng_normal(&f->rng));
}

/* Oracle mask of one item, kernel form: kind, param, causal, intervals. */
void oracle_mask(const spec_t *s, int *kind, int *param, int *causal, int32_t **iv) {
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

/* Frees what step_submit allocated. */
void pend_release(pend_t *pd) {
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
void step_submit(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan, uint64_t conn,
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
  if (opt->poke) {
    oracle_to_dtype(ATTND_DT_BF16,
                    opt->poke == 'q'   ? q
                    : opt->poke == 'k' ? k
                                       : v,
                    opt->poke_elem, opt->poke_value);
    if (opt->poke == 'q') /* the oracle replays q0 */
      oracle_to_dtype(ATTND_DT_BF16, q0, opt->poke_elem, opt->poke_value);
  }
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
int step_finish(fx_t *f, pend_t *pd, char *msg, uint8_t **out_copy) {
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
    int decode = 1; /* the kind the latency histograms file it under */
    for (int i = 0; i < n; i++)
      decode &= sp[i].n == 1;
    assert_int_equal(x->r.decode, decode);
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
            if (isinf(lse[rr]) ? !isinf(got)
                               : fabs(got - lse[rr]) > ATTND_TOL_ENGINE_LSE * (1 + fabs(lse[rr])))
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

int step_ex(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan, uint64_t conn,
            const stepopt_t *opt, char *msg, uint8_t **out_copy) {
  pend_t *pd = malloc(sizeof(*pd));
  step_submit(f, layer, sp, n, plan, conn, opt, pd);
  int rc = step_finish(f, pd, msg, out_copy);
  free(pd);
  return rc;
}

int step(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan) {
  return step_ex(f, layer, sp, n, plan, 1, NULL, NULL, NULL);
}

/* Plan + every layer, all checked. */
void plan_all_layers(fx_t *f, const spec_t *sp, int n) {
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

void fill_tokens(fx_t *f, sim_t *s, uint32_t from, uint32_t to) {
  for (uint32_t i = from; i < to; i++)
    s->tokens[i] = (uint32_t)(oracle_rng_next(&f->rng) % 50000);
}

void expect(fx_t *f, int got, int want, const char *msg, const char *needle) {
  if (got != want)
    fail_msg("status %d (%s), expected %d", got, msg, want);
  if (needle && !strstr(msg, needle))
    fail_msg("message '%s' lacks '%s'", msg, needle);
  check_engine(f);
}

/* Every invalid case fails as specified and changes nothing: the sessions
 * continue afterwards and still match the oracle. */

/* Copies the oracle state of one session into another (fork). */
void sim_copy(sim_t *dst, const sim_t *src) {
  for (int l = 0; l < LAYERS; l++) {
    dst->o[l].len = src->o[l].len;
    memcpy(dst->o[l].K, src->o[l].K, sizeof(double) * MAXCTX * KVH * HD);
    memcpy(dst->o[l].V, src->o[l].V, sizeof(double) * MAXCTX * KVH * HD);
  }
  memcpy(dst->tokens, src->tokens, sizeof(dst->tokens));
}

void open_prefill_fork(fx_t *f, sim_t *s, sim_t *t, uint32_t n, uint32_t total) {
  fill_tokens(f, s, 0, total);
  open_session(f, s, 0, NULL, 0);
  spec_t ps = {.sim = s, .start = 0, .n = n};
  plan_all_layers(f, &ps, 1);
  uint64_t tid;
  assert_int_equal(simple_call(f, 1, s->id, 0, &tid), 0);
  t->id = tid;
  sim_init_oracle(f, t);
  sim_copy(t, s);
  fill_tokens(f, t, n, total);
}

/* Prefix hits give the same outputs as a cold session (fp32, rel L2 <= 1e-3):
 * a and c compute the same prefix from the same k/v (c under a salt, so it
 * never shares); b hits a's blocks; b and c then take the same steps. */

int queued_on(void **state) {
  g_queued = 1;
  return 0;
}

int queued_off(void **state) {
  g_queued = 0;
  return 0;
}

uint32_t queued_now(fx_t *f) {
  attnd_engine_stats_t st;
  attnd_engine_stats(f->e, &st);
  return st.queued;
}

uint32_t session_len(fx_t *f, uint64_t id) {
  attnd_session_info_t info[16];
  uint32_t n = attnd_engine_list_sessions(f->e, 1, info, 16);
  for (uint32_t i = 0; i < n && i < 16; i++)
    if (info[i].session == id)
      return info[i].len;
  fail_msg("session %016llx not listed", (unsigned long long)id);
  return 0;
}

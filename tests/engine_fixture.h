/* engine_fixture.h: the shared harness of the engine's tests
 * (tests/test_engine_*.c): an engine on a real uv loop with the CPU backend
 * (no sockets), and per session and layer a dense float64 oracle session
 * (tests/oracle/) holding what the cache must hold. Every successful step is
 * replayed on the oracle and each item's output compared (relative L2, the
 * per-cache-type bound of tests/tolerance.h); every failed call leaves the
 * oracle alone, so continuing the session afterwards proves the failure
 * changed nothing. */
#ifndef ATTND_TESTS_ENGINE_FIXTURE_H
#define ATTND_TESTS_ENGINE_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <uv.h>

#include "base.h"
#include "engine.h"
#include "oracle.h"
#include "tolerance.h"

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

typedef struct {
  attnd_item_t items[MAXSIM];
  int32_t *iv[MAXSIM]; /* the items' intervals (document and custom masks) */
} itembuf_t;

typedef struct {
  int fp32_out, want_lse;
  int corrupt;          /* 1: NaN in k of the last item */
  int wrong_token_item; /* >= 0: give this item a wrong token id (inline) */
  int bad_dtype;
  int bad_rows;   /* k claims one row more than the items have */
  int odd_offset; /* tensor bytes at an odd address (decoded in place from a frame) */
  int corrupt_q;  /* 1: infinity in q of the first row */
  char poke;      /* 'q', 'k' or 'v': element poke_elem of that tensor becomes poke_value */
  uint32_t poke_elem;
  double poke_value; /* rounded to bf16 */
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

/* Set by the queued variants of the tests (queued_on/queued_off): every step
 * with tensors goes through the threadpool scan and the admission queue. */
extern int g_queued;
/* Multiplies the scales set_scales() draws. */
extern double g_scale_mult;

/* Takes the result, outputs included (they are the callback's). */
void on_done(void *arg, attnd_result_t *r);
void res_free(res_t *x);
void wait_res(fx_t *f, res_t *x);
void check_engine(fx_t *f);
double tol_for(attnd_kv_type_t kv);
void fx_config(fx_t *f, attnd_kv_type_t kv, uint32_t blocks);
void fx_start(fx_t *f);
void closed_cb(void *arg);
void fx_stop(fx_t *f);
fx_t *fx_new(attnd_kv_type_t kv, uint32_t blocks);
void fx_free(fx_t *f);
sim_t *sim_new(void);
void sim_init_oracle(fx_t *f, sim_t *s);
void sim_free(sim_t *s);
uint32_t open_session(fx_t *f, sim_t *s, uint32_t ntokens, const uint8_t *salt, size_t sl);
int simple_call(fx_t *f, int which, uint64_t session, uint32_t arg, uint64_t *out);
attnd_tensor_t ftensor(float *p, int ndim, uint32_t a, uint32_t b);
/* Static scales that fit N(0,1) data after RoPE. */
int set_scales(fx_t *f, int layer, int drop, uint64_t *version);
void set_all_scales(fx_t *f);
oracle_scales_t oscales(fx_t *f, int layer);
/* Deterministic k and v rows of a stream at a position and layer. */
void det_kv(int stream, uint32_t pos, int layer, uint16_t *k, uint16_t *v);
/* The engine's items for specs: masks in the kernels' form, a document mask
 * expanded as the RPC layer would (the oracle's own expansion, which
 * tests/test_rpc.c checks the RPC layer's against). */
void build_items(const spec_t *sp, int n, itembuf_t *ib);
void ib_free(itembuf_t *ib);
int make_plan(fx_t *f, const spec_t *sp, int n, uint64_t conn, uint64_t *plan, char *msg);
void rand_bf16(fx_t *f, uint16_t *p, size_t n, double scale);
/* Oracle mask of one item, kernel form: kind, param, causal, intervals. */
void oracle_mask(const spec_t *s, int *kind, int *param, int *causal, int32_t **iv);
/* Frees what step_submit allocated. */
void pend_release(pend_t *pd);
/* Submits one step (inline when plan == 0) with fresh random q/k/v. */
void step_submit(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan, uint64_t conn,
                 const stepopt_t *opt, pend_t *pd);
/* Waits for a submitted step; on success replays it on the oracle and checks
 * every item. Returns the status; msg gets the message. */
int step_finish(fx_t *f, pend_t *pd, char *msg, uint8_t **out_copy);
int step_ex(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan, uint64_t conn,
            const stepopt_t *opt, char *msg, uint8_t **out_copy);
int step(fx_t *f, int layer, const spec_t *sp, int n, uint64_t plan);
/* Plan + every layer, all checked. */
void plan_all_layers(fx_t *f, const spec_t *sp, int n);
void fill_tokens(fx_t *f, sim_t *s, uint32_t from, uint32_t to);
void expect(fx_t *f, int got, int want, const char *msg, const char *needle);
/* Copies the oracle state of one session into another (fork). */
void sim_copy(sim_t *dst, const sim_t *src);
/* Opens s with fresh tokens [0, total), prefills its first n on every layer
 * (checked), and forks it into t, engine and oracle, t's tokens from n on
 * fresh: the start of every copy-on-write test. */
void open_prefill_fork(fx_t *f, sim_t *s, sim_t *t, uint32_t n, uint32_t total);
int queued_on(void **state);
int queued_off(void **state);
uint32_t queued_now(fx_t *f);
uint32_t session_len(fx_t *f, uint64_t id);

#endif /* ATTND_TESTS_ENGINE_FIXTURE_H */

/* kernels_fixture.h: the CPU kernel tests' harness (tests/test_kernels_cpu*.c):
 * a layer's pool of shuffled physical blocks with sessions in it, one step
 * (write + attend) run through the kernels with every part order, and the
 * float64 oracle (tests/oracle/) judging it: cache bytes and rotated q bit for
 * bit, each item's output under its cache type's bound (tests/tolerance.h,
 * docs/numerics.md), fully masked rows exactly 0 with lse -inf. Outputs are
 * poisoned before each run so an element the kernel forgets fails. Inputs
 * come from one seed drawn at start (printed; ATTND_TEST_SEED replays it). */
#ifndef ATTND_TESTS_KERNELS_FIXTURE_H
#define ATTND_TESTS_KERNELS_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "attnd_kernels.h"
#include "oracle.h"
#include "tolerance.h"

extern uint64_t g_rng;
extern double g_maxerr[ATTND_KV_COUNT_];
extern double g_maxerr32[ATTND_KV_COUNT_]; /* items with fp32 output: the kernel's own error */
extern double g_maxlse[ATTND_KV_COUNT_];
extern long g_items[ATTND_KV_COUNT_];
extern long g_rows_checked;

typedef struct {
  attnd_kshape_t s;
  int nblocks, nfree;
  int32_t *free_ids; /* shuffled, so logical neighbours are physically scattered */
  uint8_t *cache;
  size_t bb;
  float *ks, *vs, *kz, *vz;
  int per_channel;
  oracle_scales_t osc;
  double amp;      /* standard deviation of generated k and v */
  double amp_q;    /* of generated q (env_init: 1) */
  double amp_v;    /* of generated v; 0: amp */
  double clip_qk;  /* > 0: generated q and k are clamped to +-clip_qk, before rounding */
  double clip_v;   /* > 0: generated v likewise */
  int abs_qk;      /* 1: generated q and k are >= 0 */
  int same_k;      /* 1: every generated k row (token) repeats the first one ever made */
  uint16_t *k_row; /* that row, [kv_heads][head_dim] (env_free frees it) */
  /* Per-layer variants (docs/numerics.md); the shape's softcap is s.softcap. */
  int window;   /* attnd_kbatch_t.window: 0 full layer */
  float *sinks; /* [q_heads] sink logits or NULL; items with .sink use them (env_free frees) */
} env_t;

typedef struct {
  int nb, cap_blocks;
  int32_t *table;
  oracle_session_t o;
} sess_t;

typedef struct {
  sess_t *se;
  int start, n, has_q;
  int mask_kind, mask_param, causal;
  int32_t *iv;   /* [4][start + n] or NULL */
  int zero_rows; /* dynamic types: every other token of kv head 0 is all zero */
  int sink;      /* ATTND_ITEM_SINK */
  /* Outputs of the last run_step, when the test asks (NULL: not kept):
   * [n][q_heads][head_dim] and [n][q_heads], as the kernel wrote them (fp32
   * output and lse are forced on for such items' step). */
  float *got_out, *got_lse;
} titem_t;

typedef struct {
  int out_fp32, want_lse;
  int nparts_write, nparts_attend; /* 0: random 1..4 */
  int chunked; /* 1: also attend in unit ranges; their bytes must equal the whole's */
} run_opts_t;

/* Seeds g_rng from ATTND_TEST_SEED or the clock, and prints it. */
void kfx_seed(void);
/* cmocka group teardown: the worst error per cache type and the rows compared. */
int kfx_print_summary(void **state);

int rnd(int n);
double unif(double lo, double hi);
void env_init(env_t *e, int D, int bs, int kvh, int group, attnd_dtype_t dt, attnd_kv_type_t kv,
              attnd_rope_t rope, int nblocks);
void env_free(env_t *e);
void sess_init(env_t *e, sess_t *se, int cap);
void sess_free(sess_t *se);
void sess_reserve(env_t *e, sess_t *se, int len);
void fill_random(attnd_dtype_t dt, void *p, size_t count, double amp);
/* Random FlashMask intervals for kv_len keys, rows start..start+n-1; `dead`
 * >= 0 additionally masks row `dead` from every key. */
int32_t *random_intervals(int start, int n, int dead);
/* Runs one step and returns the worst relative error of its items. */
double run_step(env_t *e, titem_t *items, int ni, run_opts_t opt);
titem_t item(sess_t *se, int start, int n);
run_opts_t opts(void);

#endif /* ATTND_TESTS_KERNELS_FIXTURE_H */

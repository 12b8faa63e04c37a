/* internal.h: the engine's private declarations, seen only by engine/'s own
 * files. The engine is these modules, in the order a call meets them:
 *
 *   queue.c     the public entry points and the admission queue
 *   order.c     the admission queue's order: who waits for whom (keys, barriers)
 *   scan.c      the finiteness scan of a step's q, k and v (loop or worker pool)
 *   session.c   sessions and their state changes: open, close, fork, truncate, idle
 *   plan.c      plans: items checked and copied, live plans per connection
 *   step.c      step admission: check -> reserve -> build batch -> commit
 *   qonly.c     attend-only items of a step as kernel items (split context)
 *   kvcache.c   the KV cache: block reservation, copy-on-write, publication,
 *               prefix lookup
 *   blocks.c    the block pool's bookkeeping (free, used, cached LRU)
 *   prefix.c    the prefix index of published blocks (xxh3-128 chained hashes)
 *   jobs.c      backend jobs: submission, completion, failures
 *   sched.c     the order jobs of a layer wait for each other in (per block)
 *   scales.c    SetScales: the static scales table, its versions, persistence
 *   scales_file.c  the scales.bin file
 *   sinks.c     SetSinks: the attention sinks table, its versions, persistence
 *   engine.c    lifetime (backend selection, init, close) and introspection
 *   check.c     attnd_engine_check, the bookkeeping checker for tests
 *   ipc.c       same-host zero-copy: client device memory mapped and
 *               counted, the device check of a step's tensors there
 *   hostmem.c   host memory of frames and outputs, large plain buffers kept
 *               for reuse
 *
 * The tables of blocks.c, prefix.c, scales.c and sinks.c are declared in
 * internal_tables.h. Semantics: docs/sessions.md. Everything here runs on the loop thread except
 * the scan of a large step and the scales file writes (worker pool). */
#ifndef ATTND_ENGINE_INTERNAL_H
#define ATTND_ENGINE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "attnd_kernels.h"
#include "backend.h"
#include "base.h"
#include "config.h"
#include "engine.h"

typedef struct attnd_plan_s attnd_plan_t;
typedef struct attnd_qepoch_s attnd_qepoch_t; /* order.c */
typedef struct attnd_qnode_s attnd_qnode_t;   /* order.c */

#include "internal_tables.h"

/* ---- session.c: one session's state -----------------------------------------
 *
 * A session holds, per layer, len[l] (positions 0..len[l]-1 are cached) and
 * cons[l] (positions below it are consistent with layer 0's current token ids:
 * a rewrite at layer 0 lowers cons of the other layers until they are
 * rewritten too, so a block is published only when every layer holds KV
 * computed from the same tokens). Token ids are layer 0's. The block table maps
 * logical block i to one physical block id used in every layer; it may run
 * past len (blocks reserved by a plan). */
typedef struct attnd_session_s attnd_session_t;

struct attnd_session_s {
  uint64_t id, identity;
  int layers;
  /* Split context (docs/scale-out.md): the session holds absolute positions
   * [base, ...). Every position the engine keeps below (len, cons, taint,
   * ntok, token indices, logical blocks) is relative to base; the public
   * entries translate (plan.c, session.c), and kernel items carry base as
   * pos_base for RoPE. */
  uint32_t base;
  uint32_t *len;  /* [layers] */
  uint32_t *cons; /* [layers] */
  uint32_t taint; /* first position written under a non-causal mask, or UINT32_MAX */
  uint32_t *tokens;
  uint32_t tokens_cap;
  int32_t *table;
  uint32_t nblocks, table_cap;
  uint32_t npub; /* leading blocks that are in the prefix index */
  uint8_t salt[64];
  uint32_t saltlen;
  uint64_t last_used_ms;
  attnd_plan_t *plan; /* the live plan touching this session (at most one) */
  uint32_t ntok;      /* token ids known: positions 0..ntok-1 (may exceed len[0]) */
  uint64_t mark;      /* scratch for the engine: finds a session named twice in one call */
  int broken;         /* a step on it failed in the backend: its KV is unknown (ABORTED) */
  attnd_list_t link;  /* the engine's list of sessions, newest first */
};

attnd_session_t *attnd_session_new(int layers);
void attnd_session_free(attnd_session_t *s);
/* Grow capacity (never shrink; small bookkeeping: aborts without memory). */
void attnd_session_reserve_tokens(attnd_session_t *s, uint32_t cap);
void attnd_session_reserve_table(attnd_session_t *s, uint32_t nblocks);
/* 1 when every layer has the same len. */
int attnd_session_lens_equal(const attnd_session_t *s);

/* ---- plans (plan.c) ---------------------------------------------------------- */

/* One item of a plan, owning copies of everything it needs from the request. */
typedef struct {
  attnd_session_t *s;
  uint32_t start, n; /* start relative to the session's base */
  int has_q;
  int q_only; /* attend only (docs/scale-out.md): no k/v rows, no write, no tokens */
  int32_t kmask, mask_param, causal; /* kernel mask (attnd_mask_kind_t) */
  int plain_causal;                  /* publishable: written under the causal mask */
  int32_t *intervals;                /* [4][kv_len] or NULL; for q_only items the
                                      * absolute [4][start + n] as given (the step
                                      * cuts out the columns the session holds) */
  uint32_t *tokens;                  /* [n] */
} attnd_pitem_t;

struct attnd_plan_s {
  uint64_t id, conn, identity;
  attnd_pitem_t *items;
  uint32_t nitems;
  uint32_t T, Tq;
  attnd_list_t link; /* the engine's list of live plans, oldest first */
  int live;          /* registered (a Plan), not an inline step */
  uint8_t *stepped;  /* [layers]: a step of this plan was admitted on the layer */
  int nstepped;      /* layers with stepped[l] set */
};

/* ---- backend jobs (jobs.c) ----------------------------------------------------- */

enum { EJ_STEP = 0, EJ_COPY = 1, EJ_SCALES = 2, EJ_SINKS = 3 };

typedef struct attnd_ejob_s attnd_ejob_t;

/* A job's place among a block's readers in the scheduler (sched.c). */
typedef struct {
  attnd_list_t link; /* on the (layer, block)'s list of readers */
  attnd_ejob_t *job;
  int32_t block;
} attnd_rnode_t;

/* A job the engine submits, with everything it owns until it is done. */
struct attnd_ejob_s {
  attnd_job_t job; /* first: the backend hands back &job */
  attnd_engine_t *e;
  int kind;
  int layer;
  attnd_engine_done_cb cb;
  void *arg;
  int32_t *refs; /* blocks to unref (non-table) when done */
  uint32_t nrefs;
  attnd_kitem_t *kitems;
  int32_t *meta;
  void *out;
  int out_pinned; /* out is attnd_engine_host_alloc's pinned memory */
  float *lse;
  void *qbuf, *kbuf, *vbuf; /* aligned copies when the request's were not */
  attnd_dtype_t out_dtype;
  int decode; /* EJ_STEP: every item has n == 1 */
  int32_t *copies;
  uint64_t *sessions; /* EJ_STEP: the items' sessions, marked broken on failure */
  uint32_t nsessions;
  /* EJ_SCALES (EJ_SINKS: sk only): the snapshot the backend reads until done */
  float *sk, *sv, *zk, *zv;
  uint64_t t_admit_us; /* handed to the scheduler */
  uint32_t scan_us;    /* EJ_STEP: its finiteness scan (attnd_result_t.phases) */
  /* The scheduler's (sched.c): what it touches, who waits for it. */
  int32_t *wblocks; /* blocks it writes */
  uint32_t nw;
  attnd_rnode_t *rnodes; /* blocks it only reads */
  uint32_t nr;
  attnd_ejob_t **waiters; /* later jobs waiting for this one */
  uint32_t nwaiters, waiters_cap;
  attnd_ejob_t *last_waiter; /* the last one added (each is added once) */
  uint32_t nwait;            /* unfinished jobs this one waits for */
  int dep_failed;            /* one of them failed: this one fails unrun */
  attnd_list_t llink;        /* its layer's unfinished jobs */
  attnd_list_t qlink;        /* the ready queue */
};

/* ---- the finiteness scan (scan.c) ---------------------------------------------- */

typedef struct {
  const uint8_t *q, *k, *v;        /* views of the tensors, 2-byte aligned unless the backend
                                    * reads any alignment (NULL: not scanned) */
  void *qbuf, *kbuf, *vbuf;        /* copies behind the views when the request's were not aligned */
  size_t bad_q, bad_k, bad_v;      /* first row past its bound (non-finite or too large);
                                    * SIZE_MAX: none */
  uint32_t bits_q, bits_k, bits_v; /* that row's largest magnitude, as dtype bits */
  uint32_t us;                     /* how long the scan took (the step trace) */
  int err; /* a device check (ipc.c) that could not run: the step fails with it */
} attnd_scan_t;

/* The largest magnitude a tensor may hold (docs/numerics.md §6). */
typedef struct {
  uint32_t bits;    /* the largest allowed magnitude, as an activation-dtype pattern */
  double value;     /* the bound as a number */
  const char *name; /* the bound as the docs write it ("2^48", ...) */
} attnd_scan_bound_t;

/* ---- the engine ---------------------------------------------------------------- */

/* Large frame bodies and step outputs in plain memory, kept after their free
 * for the next large one (hostmem.c): reading a socket into pages already
 * faulted in runs twice as fast as into fresh ones (bench/RESULTS.md). */
#define ATTND_HOSTMEM_SLOTS 8
typedef struct {
  uv_mutex_t mu; /* frees may come from any thread */
  void *p[ATTND_HOSTMEM_SLOTS];
  size_t cap[ATTND_HOSTMEM_SLOTS];
  size_t bytes;     /* sum of cap[] */
  size_t max_bytes; /* ... at most */
} attnd_hostmem_t;
void attnd_hostmem_init(attnd_hostmem_t *h, uint64_t max_frame);
/* Plain host memory of len bytes, 64-byte aligned, perhaps a kept buffer;
 * aborts when out of memory. attnd_engine_host_free(e, p, 0) takes it back. */
void *attnd_engine_host_plain(attnd_engine_t *e, size_t len);
void attnd_hostmem_free(attnd_hostmem_t *h);

struct attnd_engine_s {
  uv_loop_t *loop;
  attnd_config_t cfg;
  attnd_kshape_t shape;
  int layers;
  uint32_t bs;
  attnd_backend_t *be;
  attnd_blocks_t pool;
  attnd_prefix_t *px;
  attnd_scales_t sc;
  attnd_sinks_t sk;
  attnd_idmap_t sessions, plans;
  attnd_list_t slist; /* sessions, newest first */
  uint32_t nsessions;
  attnd_idmap_t idents;     /* identity -> uint32_t sessions it holds (nonzero identities) */
  uint32_t ident0_sessions; /* ... and identity 0's (an idmap key cannot be 0) */
  attnd_list_t plist;       /* live plans, oldest first */
  uint32_t nplans;
  uint32_t pending; /* jobs, queued calls and persist works not yet done */
  uv_timer_t idle;
  int closing;
  void (*close_cb)(void *);
  void *close_arg;
  attnd_engine_stats_t st;
  uint64_t gen;
  void (*fatal_cb)(void *); /* attnd_engine_on_fatal */
  void *fatal_arg;
  int fatal;          /* the backend reported ATTND_EDEVICE */
  attnd_list_t queue; /* admission queue, oldest first (queue.c, order.c) */
  uint32_t nqueued;
  attnd_list_t qready;     /* queued calls that may be admitted now */
  attnd_idmap_t qconn;     /* conn -> the last queued call of that connection */
  attnd_idmap_t qsess;     /* session -> the last queued call naming it */
  attnd_qnode_t *qbarrier; /* the last queued barrier */
  attnd_qepoch_t *qepoch;  /* the queued calls since it */
  int admitting;           /* the queue is being pumped: a nested call leaves the work to it */
  size_t offload_bytes;    /* a step with more q+k+v bytes is scanned on the threadpool */
  int scan_parts;          /* ... in at most this many parts at once (its workers) */
  size_t scan_part_bytes;  /* ... of at least this many bytes (ATTND_SCAN_PART_BYTES) */
  /* The scheduler (sched.c), per (layer, block) and per layer. */
  attnd_ejob_t **sb_w;        /* [layers * blocks]: last unfinished job writing the block */
  attnd_list_t *sb_r;         /* [layers * blocks]: unfinished jobs reading it since (rnodes) */
  attnd_list_t *ljobs;        /* [layers]: unfinished jobs, in admission order */
  attnd_ejob_t **barrier;     /* [layers]: the unfinished SCALES job */
  attnd_list_t readyq;        /* jobs whose wait ended, to hand to the backend */
  int sched_busy;             /* readyq is being drained */
  struct ipc_map_s *ipc_maps; /* client device memory mapped (ipc.c) */
  attnd_hostmem_t hm;         /* large host buffers kept for reuse (hostmem.c) */
};

/* ---- engine.c ---- */

/* Completes a call without a result: status and a printf-style message. */
void attnd_engine_answer(attnd_engine_done_cb cb, void *arg, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Runs the close callback once closing and nothing is pending any more. */
void attnd_engine_maybe_finish_close(attnd_engine_t *e);

static inline uint32_t attnd_engine_nblocks(const attnd_engine_t *e, uint64_t len) {
  return (uint32_t)((len + e->bs - 1) / e->bs);
}
static inline uint64_t attnd_engine_now_ms(attnd_engine_t *e) {
  return uv_now(e->loop);
}
static inline uint64_t attnd_engine_now_us(void) {
  return uv_hrtime() / 1000;
}

/* ---- the admission order (order.c) ------------------------------------------
 *
 * A call that cannot be admitted on arrival (a large step's scan, or earlier
 * queued calls it must follow) waits in the admission queue. It waits only
 * for the earlier queued calls it shares a key with: its connection, each
 * session it names (a plan's sessions for a step naming a plan), or, for a
 * barrier (SetScales, SetSinks), every earlier queued call, and every later
 * call waits for a barrier. Per key the engine keeps the last queued call
 * naming it (qconn, qsess), so a new call finds what it waits for in
 * O(its keys), never by walking the queue. */

enum { ATTND_QK_CONN = 0, ATTND_QK_SESSION = 1 };

typedef struct {
  int kind; /* ATTND_QK_* */
  uint64_t id;
} attnd_qkey_t;

/* The keys of one call, built on the stack (a few inline, more on the heap). */
typedef struct {
  attnd_qkey_t *k;
  uint32_t n, cap;
  int barrier; /* waits for every earlier queued call; every later one waits for it */
  attnd_qkey_t inl[8];
} attnd_qkeys_t;

/* A queued call's place in the admission order (inside queue.c's call). */
struct attnd_qnode_s {
  attnd_list_t link;  /* e->queue: every queued call, oldest first */
  attnd_list_t rlink; /* e->qready while ready */
  int ready;
  int held;                /* its own work (a scan, a state file write) has not reported back */
  uint32_t nwait;          /* earlier queued calls it still waits for */
  attnd_qnode_t **waiters; /* later calls waiting for this one (one entry per key shared) */
  uint32_t nwaiters, waiters_cap;
  attnd_qkey_t *keys;
  uint32_t nkeys;
  int barrier;
  attnd_qepoch_t *epoch; /* the calls since the last barrier, which the next one waits for */
};

void attnd_qkeys_init(attnd_qkeys_t *ks);
void attnd_qkeys_add(attnd_qkeys_t *ks, int kind, uint64_t id);
void attnd_qkeys_free(attnd_qkeys_t *ks);
/* 1 when a call with these keys must wait for a queued one. O(keys). */
int attnd_order_must_wait(const attnd_engine_t *e, const attnd_qkeys_t *ks);
/* Queues n behind what it must wait for; takes ks's keys (ks is emptied).
 * n->held set by the caller keeps it from being ready until unheld. */
void attnd_order_push(attnd_engine_t *e, attnd_qnode_t *n, attnd_qkeys_t *ks);
/* The next call that may be admitted now (waits for nothing, not held), or NULL. */
attnd_qnode_t *attnd_order_next(attnd_engine_t *e);
/* n's own work reported back: it may become ready. */
void attnd_order_unhold(attnd_engine_t *e, attnd_qnode_t *n);
/* n is being admitted: it leaves the queue and the calls waiting for it may
 * become ready (admitted after n, by the caller's loop). */
void attnd_order_release(attnd_engine_t *e, attnd_qnode_t *n);
/* 1 while a queued call names the session (the idle sweep leaves it alone). */
int attnd_order_names_session(const attnd_engine_t *e, uint64_t session);
void attnd_order_init(attnd_engine_t *e);
void attnd_order_free(attnd_engine_t *e);

/* ---- queue.c ---- */

/* Test hook: when set, a large step's scan on the worker pool calls it first
 * (on the worker thread), so a test can hold a scan while it sends other
 * calls. Never set outside tests. */
extern void (*attnd_queue_test_scan_hook)(const attnd_step_req_t *req);

/* ---- scan.c ---- */

/* The whole scan of a step; reads only the request and the model shape, which
 * never changes, so it may run on a worker thread. any_alignment: the backend
 * reads q, k and v at any offset (backend.h), so an odd-aligned tensor is
 * scanned through a small bounce buffer instead of copied whole. */
void attnd_scan_step(const attnd_kshape_t *sh, const attnd_step_req_t *req, int any_alignment,
                     attnd_scan_t *sc);
/* A large step's scan in n parts over rows that may run in parallel (the
 * queue runs them on the worker pool): attnd_scan_begin on the loop thread
 * (the views, and the memory of the aligned copies: no pass over the data),
 * attnd_scan_part on any thread (part i of n copies and scans its rows of
 * q, k and v), attnd_scan_end once all are done (the first bad row of each
 * tensor; us: from the first part's start to the last one's end). */
#define ATTND_SCAN_PART_BYTES ((size_t)4 << 20) /* bytes per part at least */
#define ATTND_SCAN_MAX_PARTS 16
typedef struct {
  size_t bad[3]; /* q, k, v: first row past its bound, SIZE_MAX: none */
  uint32_t bits[3];
  uint64_t t0_us, t1_us;
} attnd_scan_part_t;
void attnd_scan_begin(attnd_engine_t *e, const attnd_kshape_t *sh, const attnd_step_req_t *req,
                      int any_alignment, attnd_scan_t *sc);
void attnd_scan_part(const attnd_kshape_t *sh, const attnd_step_req_t *req, const attnd_scan_t *sc,
                     int i, int n, attnd_scan_part_t *out);
void attnd_scan_end(attnd_scan_t *sc, const attnd_scan_part_t *parts, int n);
/* How many parts a request's scan takes: one per part_bytes, at most
 * max_parts (1 for device memory). */
int attnd_scan_nparts(const attnd_step_req_t *req, int max_parts, size_t part_bytes);
/* The bounds of q, k and v for a model shape. */
void attnd_scan_bounds(const attnd_kshape_t *sh, attnd_scan_bound_t *q, attnd_scan_bound_t *k,
                       attnd_scan_bound_t *v);
/* A magnitude pattern of the activation dtype (bf16 or fp16) as a number. */
double attnd_scan_value(attnd_dtype_t dt, uint32_t bits);

/* ipc.c: the device check of a step over client device memory
 * (req->device), a CHECK job submitted here (loop thread): once it is done,
 * *sc holds its result as the step's scan (its views the device pointers,
 * err the job's status) and done(arg) is called on the loop thread. A job
 * the backend refuses: *sc holds the error at once, done is never called,
 * and the ATTND_E* is returned. req and sc stay valid until then. */
int attnd_ipc_check_start(attnd_engine_t *e, const attnd_step_req_t *req, attnd_scan_t *sc,
                          void (*done)(void *arg), void *arg);

static inline int attnd_scan_row_in(size_t row, uint32_t first, uint32_t n) {
  return row >= first && row - first < n;
}

/* ---- session.c ---- */

/* The session id of this identity, or NULL with *rc and msg saying why. */
attnd_session_t *attnd_session_get(attnd_engine_t *e, uint64_t identity, uint64_t id, int *rc,
                                   char *msg, size_t msglen);
void attnd_session_destroy(attnd_engine_t *e, attnd_session_t *s);
/* Ends the live plan on s, if any. */
void attnd_session_end_plan(attnd_engine_t *e, attnd_session_t *s);
/* The admissions (every stateful check, then the change), on the loop thread. */
void attnd_session_open(attnd_engine_t *e, uint64_t identity, uint32_t base, const uint32_t *tokens,
                        uint32_t ntokens, const uint8_t *salt, size_t saltlen,
                        attnd_engine_done_cb cb, void *arg);
/* The attnd_kitem_t.flags of an item of session s: ATTND_ITEM_SINK for a
 * session whose first position is 0, none for a split-context part that
 * starts later (its merge must count each sink once, docs/numerics.md). The
 * one place that decides item flags. */
int32_t attnd_session_item_flags(const attnd_session_t *s);
void attnd_session_close(attnd_engine_t *e, uint64_t identity, uint64_t session,
                         attnd_engine_done_cb cb, void *arg);
void attnd_session_fork(attnd_engine_t *e, uint64_t identity, uint64_t session,
                        attnd_engine_done_cb cb, void *arg);
void attnd_session_truncate(attnd_engine_t *e, uint64_t identity, uint64_t session, uint32_t len,
                            attnd_engine_done_cb cb, void *arg);
/* The idle sweep's timer callback (data: the engine). */
void attnd_session_idle_cb(uv_timer_t *t);

/* ---- plan.c ---- */

void attnd_plan_free(attnd_plan_t *p);
/* Ends a live plan; its sessions may publish the blocks it was writing. */
void attnd_plan_end(attnd_engine_t *e, attnd_plan_t *p);
/* Checks items and builds a plan from them (not registered). Returns 0 or an
 * error with msg naming the item. */
int attnd_plan_build(attnd_engine_t *e, uint64_t identity, const attnd_item_t *items,
                     uint32_t nitems, attnd_plan_t **out, char *msg, size_t msglen);
void attnd_plan_admit(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                      const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                      void *arg);
/* The connection closed: its plans end. */
void attnd_plan_conn_closed(attnd_engine_t *e, uint64_t conn);

/* ---- step.c ---- */

/* Admits a step whose layer is in range and which names a plan or carries
 * items, not both (attnd_engine_step checked). sc is the finished scan of a
 * queued step, whose copies this call takes over, or NULL: the step is small
 * and is scanned during its checks. */
void attnd_step_admit(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                      const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg,
                      attnd_scan_t *sc);

/* ---- qonly.c: attend-only items (docs/scale-out.md) ---- */

/* Kernel items, and int32 of meta past the block table, that an attend-only
 * item takes in a step of layer (the session holds len[layer] >= 1 keys). */
uint32_t attnd_qonly_pieces(const attnd_pitem_t *it, uint32_t layer);
size_t attnd_qonly_meta(const attnd_pitem_t *it, uint32_t layer, int32_t window);
/* Appends plan item i's kernel items at j->kitems[*ki] (q rows from q_row;
 * virtual kv rows from total_kv + *qv), its block table and masks at
 * j->meta[*mo], a read reference on each block it holds. window: the layer's. */
void attnd_qonly_batch(attnd_engine_t *e, attnd_ejob_t *j, uint32_t i, const attnd_pitem_t *it,
                       uint32_t q_row, int32_t window, uint32_t *ki, int32_t *qv, size_t *mo);

/* ---- kvcache.c ---- */

/* Copy-on-write pairs (src, dst) collected during one call, copied for every
 * layer afterwards. */
typedef struct {
  int32_t *pairs;
  uint32_t n, cap;
} attnd_cowlist_t;

/* Counts and reserves the blocks of every item of p, all or nothing:
 * ATTND_ENOSPC (msg says why) when the pool, evicting cached leaves, cannot
 * supply them. New blocks past the tables, private copies of shared or
 * published ones (pairs added to cow). */
int attnd_cache_reserve(attnd_engine_t *e, attnd_plan_t *p, attnd_cowlist_t *cow, char *msg,
                        size_t msglen);
/* Submits the copies of one call for every layer and empties cow. */
void attnd_cache_submit_cow(attnd_engine_t *e, attnd_cowlist_t *cow);
/* Publishes the session's blocks that are full and consistent in every layer
 * and were written under the causal mask. */
void attnd_cache_publish(attnd_engine_t *e, attnd_session_t *s);
/* Gives a new session the cached blocks of its prompt's leading whole blocks;
 * returns how many. */
uint32_t attnd_cache_lookup(attnd_engine_t *e, attnd_session_t *s, const uint32_t *tokens,
                            uint32_t ntokens);
/* Drops table entries from index keep on, last first (so a closed chain
 * enters the LRU leaf first and is evicted from its end). */
void attnd_cache_trim(attnd_engine_t *e, attnd_session_t *s, uint32_t keep);

/* ---- jobs.c ---- */

/* A new job of a kind for a layer (attnd_job_t filled as far as it can be). */
attnd_ejob_t *attnd_ejob_new(attnd_engine_t *e, int kind, int layer);
void attnd_ejob_free(attnd_ejob_t *j);
/* Submits an admitted job: to the scheduler, which hands it to the backend
 * once the jobs it depends on are done; pending until done. Its blocks
 * (attnd_sched_write, attnd_sched_read) are set. */
void attnd_ejob_submit(attnd_engine_t *e, attnd_ejob_t *j);
/* The scheduler's two ends: to the backend, or failed without running. */
void attnd_ejob_start(attnd_engine_t *e, attnd_ejob_t *j);
void attnd_ejob_fail_unrun(attnd_engine_t *e, attnd_ejob_t *j);

/* ---- sched.c ---- */

int attnd_sched_init(attnd_engine_t *e);
void attnd_sched_free(attnd_engine_t *e);
/* Room for a job's blocks, then each block it writes or only reads. */
void attnd_sched_reserve(attnd_ejob_t *j, uint32_t nwrite, uint32_t nread);
void attnd_sched_write(attnd_ejob_t *j, int32_t block);
void attnd_sched_read(attnd_ejob_t *j, int32_t block);
/* Enters a job; it starts now (attnd_ejob_start) if it waits for nothing. */
void attnd_sched_submit(attnd_engine_t *e, attnd_ejob_t *j);
/* A job is done (failed: so are those waiting for it): it leaves the
 * scoreboard and jobs whose wait ends join the ready queue. */
void attnd_sched_done(attnd_engine_t *e, attnd_ejob_t *j, int failed);
/* Hands the ready queue to the backend (failing jobs whose wait failed). */
void attnd_sched_run(attnd_engine_t *e);

/* ---- scales.c ---- */

/* SetScales in the order queue.c runs it: every check that can fail (0 or an
 * error with msg); the table as it will be after the call, serialized for
 * the file (the live table unchanged); then, once the file is written (or
 * without persistence), the change itself, answered through cb. */
int attnd_scales_check(attnd_engine_t *e, const attnd_scales_req_t *req, char *msg, size_t msglen);
int attnd_scales_snapshot(attnd_engine_t *e, const attnd_scales_req_t *req, uint8_t **buf,
                          size_t *len);
void attnd_scales_commit(attnd_engine_t *e, const attnd_scales_req_t *req, attnd_engine_done_cb cb,
                         void *arg);
/* Submits a SCALES job with a snapshot of a layer's scales from the table. */
void attnd_scales_submit(attnd_engine_t *e, int layer);
/* Recomputes the prefix fingerprint from the model, the scale versions and
 * the per-layer variants (softcap, windows, sink versions). */
void attnd_scales_update_fingerprint(attnd_engine_t *e);

/* ---- sinks.c: SetSinks in SetScales's three steps (queue.c) ---- */
int attnd_sinks_check(attnd_engine_t *e, const attnd_sinks_req_t *req, char *msg, size_t msglen);
int attnd_sinks_snapshot(attnd_engine_t *e, const attnd_sinks_req_t *req, uint8_t **buf,
                         size_t *len);
void attnd_sinks_commit(attnd_engine_t *e, const attnd_sinks_req_t *req, attnd_engine_done_cb cb,
                        void *arg);
/* Submits a SINKS job with a snapshot of a layer's sinks from the table. */
void attnd_sinks_submit(attnd_engine_t *e, int layer);
/* 0 when a step of the layer may run: sinks off, or the layer's are set;
 * else ATTND_EPRECOND with a reason. */
int attnd_sinks_ready(const attnd_engine_t *e, uint32_t layer, char *msg, size_t msglen);

#endif /* ATTND_ENGINE_INTERNAL_H */

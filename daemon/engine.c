/* engine.c: sessions, plans and steps on top of a backend (DESIGN.md section 6).
 *
 * Admission runs on the loop thread. A call is validated completely before
 * anything changes (all-or-nothing): the checks run first, then the blocks it
 * needs are counted and, if the pool (free plus evictable) cannot supply them,
 * the call fails with RESOURCE_EXHAUSTED; only then does it commit (allocate,
 * copy-on-write, move len, publish) and submit its jobs.
 *
 * Admission queue. A Step must be rejected before it changes anything when
 * its q, k or v hold a NaN or an infinity, and the scan for them is a linear
 * pass over the tensors (about 20 ms for the 100 MB of an 8k-token prefill),
 * too long for the loop thread (DESIGN.md section 2). So a Step whose tensors
 * exceed offload_bytes (--engine-offload-bytes) is scanned on the libuv
 * threadpool first, together with the aligned copy of tensors decoded at odd
 * addresses; the scan reads only the request's bytes and records the first
 * row of each tensor holding a non-finite value. Meanwhile the call waits in
 * an engine-wide FIFO of calls not yet admitted, and while that FIFO is not
 * empty every later mutating call (any kind, any session, conn_closed too)
 * waits behind it: calls are still admitted one by one in arrival order, on
 * the loop thread, with every stateful check made at admission exactly as on
 * the direct path, which maps the recorded rows to the item they fall in.
 * With an empty FIFO a small call (every decode step) is admitted at once,
 * scan included, with no extra latency. Stateless refusals (a layer out of
 * range, a plan and inline items together, a salt too long) are answered at
 * arrival: they change nothing, whatever runs before them. A scan cannot be
 * cancelled once started, so a queued call counts as pending work and
 * attnd_engine_close waits for it to be admitted (it arrived before the close).
 *
 * Choices the design leaves open, made here:
 *  - a session used by another identity answers PERMISSION_DENIED;
 *  - an inline Step is a one-layer plan, so like a Plan it ends the live plan
 *    of every session it names; a Step naming a plan that is not live (ended
 *    or never issued) answers FAILED_PRECONDITION;
 *  - a Plan reserves (allocates and copies-on-write) the blocks of all its
 *    positions for all layers at admission; each Step reserves again what a
 *    publication in between made immutable, so a repeated layer still writes
 *    only private blocks;
 *  - SetScales with drop_cached_kv drops every cached block from the prefix
 *    index (the fingerprint changes anyway) and sets every session's len[l]
 *    of that layer to 0: the client recomputes that layer, nothing else;
 *  - Truncate to more than len answers INVALID_ARGUMENT;
 *  - non-finite q/k/v are found by a scan that finishes before the call is
 *    admitted: on the loop thread for small steps, on the threadpool (see the
 *    admission queue above) for large ones;
 *  - the idle sweep waits while calls are queued, so a session a queued call
 *    names is not closed under it for being idle.
 *
 * A job holds a reference on every block it reads or writes (block tables up
 * to kv_len, both sides of a copy), dropped in its done callback. Per layer,
 * jobs go to the backend in admission order; a SetScales waits in the layer's
 * queue until the layer has no job in flight (the backend contract) and the
 * jobs behind it wait for it. */
#include "engine.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "blocks.h"
#include "base.h"
#include "prefix.h"
#include "scales.h"
#include "session.h"

typedef struct plan_s plan_t;
typedef struct ejob_s ejob_t;

/* One item of a plan, owning copies of everything it needs from the request. */
typedef struct {
  attnd_session_t *s;
  uint32_t start, n;
  int has_q;
  int32_t kmask, mask_param, causal; /* kernel mask (attnd_mask_kind_t) */
  int plain_causal;                  /* publishable: written under the causal mask */
  int32_t *intervals;                /* [4][kv_len] or NULL */
  uint32_t *tokens;                  /* [n] */
} pitem_t;

struct plan_s {
  uint64_t id, conn, identity;
  pitem_t *items;
  uint32_t nitems;
  uint32_t T, Tq;
  plan_t *prev, *next; /* engine list, oldest first */
  int live;            /* registered (a Plan), not an inline step */
  uint8_t *stepped;    /* [layers]: a step of this plan was admitted on the layer */
  int nstepped;        /* layers with stepped[l] set */
};

enum { EJ_STEP = 0, EJ_COPY = 1, EJ_SCALES = 2 };

struct ejob_s {
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
  float *lse;
  void *qbuf, *kbuf, *vbuf; /* aligned copies when the request's were not */
  int out_dtype;
  int32_t *copies;
  uint64_t *sessions; /* EJ_STEP: the items' sessions, marked broken on failure */
  uint32_t nsessions;
  /* EJ_SCALES: a snapshot for the backend */
  float *sk, *sv, *zk, *zv;
  int per_channel;
  ejob_t *hnext; /* layer hold queue */
};

typedef struct {
  int inflight;
  ejob_t *hhead, *htail;
} layer_t;

/* The finiteness scan of a step's q, k and v. */
typedef struct {
  const uint8_t *q, *k, *v;   /* 2-byte aligned views of the tensors (NULL: not scanned) */
  void *qbuf, *kbuf, *vbuf;   /* copies behind the views when the request's were not aligned */
  size_t bad_q, bad_k, bad_v; /* first row holding a non-finite value; SIZE_MAX: none */
} scan_t;

enum {
  CALL_OPEN = 0,
  CALL_CLOSE,
  CALL_FORK,
  CALL_TRUNCATE,
  CALL_PLAN,
  CALL_STEP,
  CALL_SCALES,
  CALL_CONN_CLOSED,
};

/* A mutating call waiting in the admission queue, with what it needs to be
 * admitted later. Pointers inside requests stay the caller's (engine.h: valid
 * until the done callback); what the caller may reuse at once (the request
 * structs and the salt) is copied. */
typedef struct call_s call_t;
struct call_s {
  uv_work_t work; /* the scan of a large step */
  attnd_engine_t *e;
  call_t *next;
  int kind;
  int scanning; /* the scan has not reported back: the call cannot be admitted yet */
  int scanned;  /* scan holds the result (a large step) */
  uint64_t identity, conn, session;
  uint32_t len;           /* Truncate */
  const uint32_t *tokens; /* OpenSession */
  uint32_t ntokens;
  uint8_t salt[ATTND_PREFIX_MAX_SALT];
  size_t saltlen;
  const attnd_item_t *items; /* Plan */
  uint32_t nitems;
  attnd_step_req_t step;
  attnd_scales_req_t scales;
  scan_t scan;
  attnd_engine_done_cb cb;
  void *arg;
};

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
  attnd_idmap_t sessions, plans;
  attnd_session_t *shead;
  uint32_t nsessions;
  plan_t *phead, *ptail;
  uint32_t nplans;
  layer_t *lay;
  uint32_t pending; /* jobs and persist works not yet done */
  uv_timer_t idle;
  int closing;
  void (*close_cb)(void *);
  void *close_arg;
  attnd_engine_stats_t st;
  uint64_t gen;
  uv_mutex_t persist_mu;
  uint64_t persist_seq, persist_written;
  void (*fatal_cb)(void *); /* attnd_engine_on_fatal */
  void *fatal_arg;
  int fatal;             /* the backend reported ATTND_EDEVICE */
  call_t *qhead, *qtail; /* admission queue, oldest first */
  uint32_t nqueued;
  int admitting;        /* queue_pump is running: a nested call leaves the work to it */
  size_t offload_bytes; /* a step with more q+k+v bytes is scanned on the threadpool */
};

/* ---- small helpers ------------------------------------------------------- */

static void *xcalloc(size_t n, size_t sz) {
  void *p = calloc(n ? n : 1, sz ? sz : 1);
  if (!p)
    abort(); /* bookkeeping allocations only (STYLE.md); KV exhaustion is reported */
  return p;
}

static void answer(attnd_engine_done_cb cb, void *arg, int status, const char *fmt, ...) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.status = status;
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r.message, sizeof(r.message), fmt, ap);
    va_end(ap);
  }
  cb(arg, &r);
}

static uint32_t nblocks_for(const attnd_engine_t *e, uint64_t len) {
  return (uint32_t)((len + e->bs - 1) / e->bs);
}

static uint64_t now_ms(attnd_engine_t *e) {
  return uv_now(e->loop);
}

/* ---- plans --------------------------------------------------------------- */

static void plan_free(plan_t *p) {
  if (!p)
    return;
  for (uint32_t i = 0; i < p->nitems; i++) {
    free(p->items[i].intervals);
    free(p->items[i].tokens);
  }
  free(p->items);
  free(p->stepped);
  free(p);
}

static void publish(attnd_engine_t *e, attnd_session_t *s);

/* Ends a plan. Its sessions may now publish the blocks it was writing (a
 * live plan keeps its range unpublished, see publish()). */
static void plan_end(attnd_engine_t *e, plan_t *p) {
  for (uint32_t i = 0; i < p->nitems; i++)
    if (p->items[i].s && p->items[i].s->plan == p) {
      p->items[i].s->plan = NULL;
      publish(e, p->items[i].s);
    }
  attnd_idmap_del(&e->plans, p->id);
  if (p->prev)
    p->prev->next = p->next;
  else
    e->phead = p->next;
  if (p->next)
    p->next->prev = p->prev;
  else
    e->ptail = p->prev;
  e->nplans--;
  plan_free(p);
}

static void session_end_plan(attnd_engine_t *e, attnd_session_t *s) {
  if (s->plan)
    plan_end(e, (plan_t *)s->plan);
}

/* Checks items and builds a plan from them (not registered). Returns 0 or an
 * error with msg naming the item. */
static int plan_build(attnd_engine_t *e, uint64_t identity, const attnd_item_t *items,
                      uint32_t nitems, plan_t **out, char *msg, size_t msglen) {
  if (nitems == 0 || !items) {
    snprintf(msg, msglen, "no items");
    return ATTND_EINVAL;
  }
  plan_t *p = xcalloc(1, sizeof(*p));
  p->items = xcalloc(nitems, sizeof(pitem_t));
  p->nitems = nitems;
  p->identity = identity;
  uint64_t gen = ++e->gen;
  int rc = 0;
  for (uint32_t i = 0; i < nitems; i++) {
    const attnd_item_t *it = &items[i];
    pitem_t *pi = &p->items[i];
    attnd_session_t *s = attnd_idmap_get(&e->sessions, it->session);
    if (!s) {
      snprintf(msg, msglen, "item %u: session %016llx not found", i,
               (unsigned long long)it->session);
      rc = ATTND_ENOTFOUND;
      goto fail;
    }
    if (s->identity != identity) {
      snprintf(msg, msglen, "item %u: session %016llx belongs to another identity", i,
               (unsigned long long)it->session);
      rc = ATTND_EPERM;
      goto fail;
    }
    if (s->broken) {
      snprintf(msg, msglen, "item %u: session %016llx lost its KV in a backend fault; close it", i,
               (unsigned long long)it->session);
      rc = ATTND_EABORTED;
      goto fail;
    }
    if (s->mark == gen) {
      snprintf(msg, msglen, "item %u: session %016llx appears twice", i,
               (unsigned long long)it->session);
      rc = ATTND_EINVAL;
      goto fail;
    }
    s->mark = gen;
    if (it->n < 1) {
      snprintf(msg, msglen, "item %u: n must be >= 1", i);
      rc = ATTND_EINVAL;
      goto fail;
    }
    uint64_t kv_len = (uint64_t)it->start + it->n;
    if (kv_len > (uint64_t)e->cfg.max_context) {
      snprintf(msg, msglen, "item %u: start+n %llu > max_context %d", i, (unsigned long long)kv_len,
               e->cfg.max_context);
      rc = ATTND_ERANGE;
      goto fail;
    }
    if (it->start > s->len[0]) {
      snprintf(msg, msglen, "item %u: start %u > len %u", i, it->start, s->len[0]);
      rc = ATTND_EINVAL;
      goto fail;
    }
    if (!it->tokens || it->ntokens != it->n) {
      snprintf(msg, msglen, "item %u: %u token ids for n = %u", i, it->tokens ? it->ntokens : 0,
               it->n);
      rc = ATTND_EINVAL;
      goto fail;
    }
    pi->s = s;
    pi->start = it->start;
    pi->n = it->n;
    pi->has_q = !it->kv_only;
    pi->causal = 1;
    switch (it->mask_kind) {
    case ATTND_WMASK_CAUSAL:
      pi->kmask = ATTND_MASK_CAUSAL;
      pi->plain_causal = 1;
      break;
    case ATTND_WMASK_FULL:
      pi->kmask = ATTND_MASK_FULL;
      break;
    case ATTND_WMASK_SLIDING_WINDOW:
      if (it->window == 0 || it->window > INT32_MAX) {
        snprintf(msg, msglen, "item %u: sliding window must be >= 1", i);
        rc = ATTND_EINVAL;
        goto fail;
      }
      pi->kmask = ATTND_MASK_SLIDING;
      pi->mask_param = (int32_t)it->window;
      break;
    case ATTND_WMASK_PREFIX_LM:
      pi->kmask = ATTND_MASK_PREFIX_LM;
      pi->mask_param = it->prefix_len > INT32_MAX ? INT32_MAX : (int32_t)it->prefix_len;
      break;
    case ATTND_WMASK_DOCUMENT: {
      const attnd_tensor_t *t = &it->doc_lengths;
      if (!t->present || t->dtype != ATTND_DT_INT32 || t->ndim != 1 || t->shape[0] == 0 ||
          t->nbytes != (size_t)t->shape[0] * 4 || !t->data) {
        snprintf(msg, msglen, "item %u: doc_lengths must be INT32 [ndocs]", i);
        rc = ATTND_EINVAL;
        goto fail;
      }
      pi->kmask = ATTND_MASK_INTERVALS;
      pi->causal = 1;
      pi->intervals = xcalloc(4 * kv_len, sizeof(int32_t));
      int64_t pos = 0;
      for (uint32_t d = 0; d < t->shape[0]; d++) {
        int32_t dl;
        memcpy(&dl, t->data + 4 * (size_t)d, 4);
        if (dl < 0 || pos + dl > (int64_t)kv_len) {
          snprintf(msg, msglen, "item %u: doc lengths do not sum to kv_len %llu", i,
                   (unsigned long long)kv_len);
          rc = ATTND_EINVAL;
          goto fail;
        }
        /* Keys of a document are hidden from every row after it; causal
         * hides them from the rows before it. */
        for (int64_t j = pos; j < pos + dl; j++) {
          pi->intervals[j] = (int32_t)(pos + dl);
          pi->intervals[kv_len + j] = (int32_t)kv_len;
        }
        pos += dl;
      }
      if (pos != (int64_t)kv_len) {
        snprintf(msg, msglen, "item %u: doc lengths sum to %lld, not kv_len %llu", i,
                 (long long)pos, (unsigned long long)kv_len);
        rc = ATTND_EINVAL;
        goto fail;
      }
      break;
    }
    case ATTND_WMASK_CUSTOM: {
      const attnd_tensor_t *t = &it->intervals;
      if (!t->present || t->dtype != ATTND_DT_INT32 || t->ndim != 2 || t->shape[0] != 4 ||
          t->shape[1] != kv_len || t->nbytes != 16 * kv_len || !t->data) {
        snprintf(msg, msglen, "item %u: intervals must be INT32 [4, %llu]", i,
                 (unsigned long long)kv_len);
        rc = ATTND_EINVAL;
        goto fail;
      }
      pi->kmask = ATTND_MASK_INTERVALS;
      pi->causal = !it->bidirectional;
      pi->intervals = xcalloc(4 * kv_len, sizeof(int32_t));
      memcpy(pi->intervals, t->data, 16 * kv_len);
      for (uint64_t j = 0; j < kv_len; j++) {
        const int32_t *iv = pi->intervals;
        if (iv[j] > iv[kv_len + j] || iv[2 * kv_len + j] > iv[3 * kv_len + j]) {
          snprintf(msg, msglen, "item %u: interval of key %llu has start > end", i,
                   (unsigned long long)j);
          rc = ATTND_EINVAL;
          goto fail;
        }
      }
      break;
    }
    default:
      snprintf(msg, msglen, "item %u: unknown mask kind %d", i, it->mask_kind);
      rc = ATTND_EINVAL;
      goto fail;
    }
    pi->tokens = xcalloc(it->n, sizeof(uint32_t));
    memcpy(pi->tokens, it->tokens, (size_t)it->n * sizeof(uint32_t));
    p->T += it->n;
    if (pi->has_q)
      p->Tq += it->n;
  }
  *out = p;
  return 0;
fail:
  plan_free(p);
  return rc;
}

/* ---- layer queues and jobs ----------------------------------------------- */

static void maybe_finish_close(attnd_engine_t *e);
static void layer_pump(attnd_engine_t *e, int layer);

static void ejob_free(ejob_t *j) {
  free(j->refs);
  free(j->kitems);
  free(j->meta);
  free(j->out);
  free(j->lse);
  free(j->qbuf);
  free(j->kbuf);
  free(j->vbuf);
  free(j->copies);
  free(j->sessions);
  free(j->sk);
  free(j->sv);
  free(j->zk);
  free(j->zv);
  free(j);
}

/* A step the backend could not finish left its sessions' KV unknown: those
 * sessions answer ABORTED from now on, and since the failed write may sit in
 * published blocks, the whole prefix index is dropped (a rare event; cached
 * KV is only an optimization). */
static void step_failed(attnd_engine_t *e, ejob_t *j) {
  for (uint32_t i = 0; i < j->nsessions; i++) {
    attnd_session_t *s = attnd_idmap_get(&e->sessions, j->sessions[i]);
    if (s)
      s->broken = 1;
  }
  attnd_prefix_drop_all(e->px);
  for (attnd_session_t *s = e->shead; s; s = s->next)
    s->npub = 0;
}

static void job_done(attnd_job_t *job) {
  ejob_t *j = (ejob_t *)job;
  attnd_engine_t *e = j->e;
  /* A sticky device error: this and every later job fail (UNAVAILABLE), and
   * the daemon is told once, after this job is answered, so that it drains
   * and exits non-zero for its supervisor to restart it. */
  int fatal_now = job->status == ATTND_EDEVICE && !e->fatal;
  if (fatal_now)
    e->fatal = 1;
  e->lay[j->layer].inflight--;
  if (job->status != 0 && j->kind == EJ_STEP)
    step_failed(e, j);
  if (j->cb) {
    attnd_result_t r;
    int out_taken = 0, lse_taken = 0;
    memset(&r, 0, sizeof(r));
    r.status = job->status;
    if (job->status) {
      snprintf(r.message, sizeof(r.message), "%s",
               job->message[0] ? job->message : attnd_strerror(job->status));
    } else {
      r.out = j->out;
      r.out_dtype = j->out_dtype;
      r.out_rows = (uint32_t)job->batch.total_q;
      r.out_bytes = job->out_bytes;
      r.lse = j->lse;
      r.lse_bytes = job->lse_bytes;
      r.out_taken = &out_taken;
      r.lse_taken = &lse_taken;
    }
    if (job->t_start_us >= job->t_submit_us)
      r.queued_us = job->t_start_us - job->t_submit_us;
    if (job->t_end_us >= job->t_start_us)
      r.computing_us = job->t_end_us - job->t_start_us;
    j->cb(j->arg, &r);
    if (out_taken)
      j->out = NULL;
    if (lse_taken)
      j->lse = NULL;
  }
  /* Blocks go back only after the callback: the output lives in the job. */
  for (uint32_t i = 0; i < j->nrefs; i++)
    attnd_blocks_unref(&e->pool, j->refs[i], 0);
  int layer = j->layer;
  ejob_free(j);
  e->pending--;
  layer_pump(e, layer);
  maybe_finish_close(e);
  if (fatal_now && e->fatal_cb)
    e->fatal_cb(e->fatal_arg);
}

static void backend_submit(attnd_engine_t *e, ejob_t *j) {
  j->job.done_cb = job_done;
  j->job.user = j;
  e->lay[j->layer].inflight++;
  int rc = e->be->ops->submit(e->be, &j->job);
  if (rc != 0) {
    j->job.status = rc;
    snprintf(j->job.message, sizeof(j->job.message), "backend refused the job: %s",
             attnd_strerror(rc));
    j->job.t_submit_us = j->job.t_start_us = j->job.t_end_us = 0;
    job_done(&j->job);
  }
}

static void apply_scales_job(attnd_engine_t *e, ejob_t *j) {
  e->be->ops->set_scales(e->be, j->layer, j->sk, j->sv, j->zk, j->zv, j->per_channel);
  ejob_free(j);
  e->pending--;
}

/* Moves held work of a layer to the backend, in order, up to the first
 * SetScales that must wait for the layer to drain. */
static void layer_pump(attnd_engine_t *e, int layer) {
  layer_t *L = &e->lay[layer];
  while (L->hhead) {
    ejob_t *j = L->hhead;
    if (j->kind == EJ_SCALES && L->inflight > 0)
      return;
    L->hhead = j->hnext;
    if (!L->hhead)
      L->htail = NULL;
    if (j->kind == EJ_SCALES)
      apply_scales_job(e, j);
    else
      backend_submit(e, j);
  }
}

static void layer_submit(attnd_engine_t *e, ejob_t *j) {
  layer_t *L = &e->lay[j->layer];
  e->pending++;
  j->hnext = NULL;
  if (L->htail)
    L->htail->hnext = j;
  else
    L->hhead = j;
  L->htail = j;
  layer_pump(e, j->layer);
}

/* ---- block reservation --------------------------------------------------- */

/* Blocks a write of positions [start, start+n) of s needs: new ones past the
 * table, copies of shared or published ones. */
static uint32_t blocks_needed(attnd_engine_t *e, const attnd_session_t *s, uint32_t start,
                              uint32_t n) {
  uint32_t need = 0;
  uint32_t b0 = start / e->bs, b1 = (start + n - 1) / e->bs;
  for (uint32_t b = b0; b <= b1; b++) {
    if (b >= s->nblocks) {
      need++;
      continue;
    }
    const attnd_block_t *blk = &e->pool.b[s->table[b]];
    if (blk->published || blk->tabref > 1)
      need++;
  }
  return need;
}

/* Makes nfree >= need by evicting cached leaves; ATTND_ENOSPC if it cannot.
 * Evicting only drops unreferenced cached blocks, which no session sees. */
static int ensure_free(attnd_engine_t *e, uint32_t need) {
  while (e->pool.nfree < need) {
    if (!attnd_prefix_evict_one(e->px))
      return ATTND_ENOSPC;
    e->st.evictions++;
  }
  return 0;
}

/* COW pairs collected during one call, copied for every layer afterwards. */
typedef struct {
  int32_t *pairs;
  uint32_t n, cap;
} cowlist_t;

/* Gives s private blocks for positions [start, start+n) (nfree suffices). */
static void reserve(attnd_engine_t *e, attnd_session_t *s, uint32_t start, uint32_t n,
                    cowlist_t *cow) {
  uint32_t b0 = start / e->bs, b1 = (start + n - 1) / e->bs;
  if (attnd_session_reserve_table(s, b1 + 1) != 0)
    abort();
  for (uint32_t b = b0; b <= b1; b++) {
    if (b >= s->nblocks) {
      /* Fill any gap too (a plan may jump past reserved blocks only when
       * start <= len[0], so b0 <= nblocks; this loop is the tail). */
      while (s->nblocks <= b) {
        int32_t id = attnd_blocks_alloc(&e->pool, 1);
        if (id < 0)
          abort(); /* ensure_free() ran before */
        s->table[s->nblocks++] = id;
      }
      continue;
    }
    int32_t old = s->table[b];
    const attnd_block_t *blk = &e->pool.b[old];
    if (!blk->published && blk->tabref <= 1)
      continue;
    int32_t nw = attnd_blocks_alloc(&e->pool, 1);
    if (nw < 0)
      abort();
    if (cow->n == cow->cap) {
      cow->cap = cow->cap ? 2 * cow->cap : 8;
      cow->pairs = realloc(cow->pairs, 2 * cow->cap * sizeof(int32_t));
      if (!cow->pairs)
        abort();
    }
    cow->pairs[2 * cow->n] = old;
    cow->pairs[2 * cow->n + 1] = nw;
    cow->n++;
    /* The copy jobs hold old until they ran; the table lets go now. */
    attnd_blocks_ref(&e->pool, old, 0);
    attnd_blocks_unref(&e->pool, old, 1);
    s->table[b] = nw;
    if (s->npub > b)
      s->npub = b;
    e->st.cow_copies++;
  }
}

/* Submits the copies of one call for every layer; each copy job references
 * both blocks of every pair. Consumes the extra ref reserve() took on old. */
static void submit_cow(attnd_engine_t *e, cowlist_t *cow) {
  if (cow->n == 0)
    return;
  for (int l = 0; l < e->layers; l++) {
    ejob_t *j = xcalloc(1, sizeof(*j));
    j->e = e;
    j->kind = EJ_COPY;
    j->layer = l;
    j->job.kind = ATTND_JOB_COPY;
    j->job.layer = l;
    j->copies = xcalloc(2 * cow->n, sizeof(int32_t));
    memcpy(j->copies, cow->pairs, 2 * cow->n * sizeof(int32_t));
    j->job.copies = j->copies;
    j->job.ncopies = (int)cow->n;
    j->refs = xcalloc(2 * cow->n, sizeof(int32_t));
    for (uint32_t i = 0; i < 2 * cow->n; i++) {
      j->refs[i] = cow->pairs[i];
      attnd_blocks_ref(&e->pool, cow->pairs[i], 0);
    }
    j->nrefs = 2 * cow->n;
    layer_submit(e, j);
  }
  for (uint32_t i = 0; i < cow->n; i++)
    attnd_blocks_unref(&e->pool, cow->pairs[2 * i], 0);
  free(cow->pairs);
  cow->pairs = NULL;
  cow->n = cow->cap = 0;
}

/* ---- prefix publication -------------------------------------------------- */

static attnd_h128_t parent_hash(attnd_engine_t *e, const attnd_session_t *s, uint32_t b) {
  attnd_h128_t z = {0, 0};
  return b == 0 ? z : attnd_prefix_block_hash(e->px, s->table[b - 1]);
}

/* Publishes the session's blocks that are full and consistent in every layer
 * and were written under the causal mask. */
static void publish(attnd_engine_t *e, attnd_session_t *s) {
  if (!e->cfg.prefix_cache)
    return;
  uint64_t full = s->taint;
  for (int l = 0; l < e->layers; l++)
    if (s->cons[l] < full)
      full = s->cons[l];
  if (full > s->ntok)
    full = s->ntok;
  uint32_t nfull = (uint32_t)(full / e->bs);
  if (nfull > s->nblocks)
    nfull = s->nblocks;
  /* Blocks a live plan will still write stay private until every layer has
   * stepped it: published they would be immutable, and each further layer
   * would have to copy them again. */
  const plan_t *lp = s->plan;
  if (lp && lp->nstepped >= e->layers)
    lp = NULL;
  for (uint32_t i = 0; lp && i < lp->nitems; i++)
    if (lp->items[i].s == s && lp->items[i].start / e->bs < nfull)
      nfull = lp->items[i].start / e->bs;
  while (s->npub < nfull) {
    uint32_t b = s->npub;
    const uint32_t *tok = &s->tokens[(size_t)b * e->bs];
    attnd_h128_t h =
        attnd_prefix_hash(e->px, parent_hash(e, s, b), s->identity, s->salt, s->saltlen, tok);
    int32_t parent = b == 0 ? -1 : s->table[b - 1];
    int32_t got =
        attnd_prefix_publish(e->px, s->table[b], h, parent, s->identity, s->salt, s->saltlen, tok);
    if (got < 0)
      break; /* the block belongs to another chain: publishing stops here */
    if (got != s->table[b]) {
      /* Someone published the same tokens first: share theirs, so the chain
       * continues through one block per prefix. */
      attnd_blocks_ref(&e->pool, got, 1);
      attnd_blocks_unref(&e->pool, s->table[b], 1);
      s->table[b] = got;
    }
    s->npub++;
  }
}

/* ---- sessions ------------------------------------------------------------ */

static attnd_session_t *session_get(attnd_engine_t *e, uint64_t identity, uint64_t id, int *rc,
                                    char *msg, size_t msglen) {
  attnd_session_t *s = attnd_idmap_get(&e->sessions, id);
  if (!s) {
    snprintf(msg, msglen, "session %016llx not found", (unsigned long long)id);
    *rc = ATTND_ENOTFOUND;
    return NULL;
  }
  if (s->identity != identity) {
    snprintf(msg, msglen, "session %016llx belongs to another identity", (unsigned long long)id);
    *rc = ATTND_EPERM;
    return NULL;
  }
  *rc = 0;
  return s;
}

/* Fork and Truncate refuse a session whose KV a backend fault left unknown. */
static int session_usable(attnd_session_t *s, attnd_engine_done_cb cb, void *arg) {
  if (!s->broken)
    return 1;
  answer(cb, arg, ATTND_EABORTED, "session %016llx lost its KV in a backend fault; close it",
         (unsigned long long)s->id);
  return 0;
}

static attnd_session_t *session_create(attnd_engine_t *e, uint64_t identity) {
  attnd_session_t *s = attnd_session_new(e->layers);
  if (!s)
    abort();
  uint64_t id;
  do
    id = attnd_random_id();
  while (attnd_idmap_get(&e->sessions, id));
  s->id = id;
  s->identity = identity;
  s->last_used_ms = now_ms(e);
  if (attnd_idmap_put(&e->sessions, id, s) != 0)
    abort();
  s->next = e->shead;
  if (e->shead)
    e->shead->prev = s;
  e->shead = s;
  e->nsessions++;
  return s;
}

/* Drops table entries from index `keep` on, last first (so a closed chain
 * enters the LRU leaf first and is evicted from its end). */
static void table_trim(attnd_engine_t *e, attnd_session_t *s, uint32_t keep) {
  while (s->nblocks > keep)
    attnd_blocks_unref(&e->pool, s->table[--s->nblocks], 1);
  if (s->npub > keep)
    s->npub = keep;
}

static void session_destroy(attnd_engine_t *e, attnd_session_t *s) {
  session_end_plan(e, s);
  table_trim(e, s, 0);
  attnd_idmap_del(&e->sessions, s->id);
  if (s->prev)
    s->prev->next = s->next;
  else
    e->shead = s->next;
  if (s->next)
    s->next->prev = s->prev;
  e->nsessions--;
  attnd_session_free(s);
}

static int check_open(attnd_engine_t *e, attnd_engine_done_cb cb, void *arg) {
  if (e->closing) {
    answer(cb, arg, ATTND_EUNAVAIL, "the engine is closing");
    return 0;
  }
  return 1;
}

/* The admissions below run on the loop thread, at once or from the admission
 * queue; the public entries (in the admission queue section) check what needs no state. */

static void open_admit(attnd_engine_t *e, uint64_t identity, const uint32_t *tokens,
                       uint32_t ntokens, const uint8_t *salt, size_t saltlen,
                       attnd_engine_done_cb cb, void *arg) {
  if (e->cfg.max_sessions > 0 && e->nsessions >= (uint32_t)e->cfg.max_sessions) {
    answer(cb, arg, ATTND_ENOSPC, "max sessions (%d) reached", e->cfg.max_sessions);
    return;
  }
  attnd_session_t *s = session_create(e, identity);
  s->saltlen = (uint32_t)saltlen;
  if (saltlen)
    memcpy(s->salt, salt, saltlen);
  uint32_t hit = 0;
  if (e->cfg.prefix_cache && tokens && ntokens > 0) {
    uint32_t maxb = (ntokens - 1) / e->bs;
    if ((uint64_t)maxb * e->bs > (uint64_t)e->cfg.max_context)
      maxb = (uint32_t)(e->cfg.max_context / e->bs);
    if (attnd_session_reserve_table(s, maxb) != 0)
      abort();
    attnd_h128_t ph = {0, 0};
    int32_t parent = -1;
    while (hit < maxb) {
      const uint32_t *tok = &tokens[(size_t)hit * e->bs];
      attnd_h128_t h = attnd_prefix_hash(e->px, ph, identity, salt, saltlen, tok);
      int32_t id = attnd_prefix_find(e->px, h, parent, identity, salt, saltlen, tok);
      if (id < 0)
        break;
      attnd_blocks_ref(&e->pool, id, 1);
      s->table[s->nblocks++] = id;
      ph = h;
      parent = id;
      hit++;
    }
    uint32_t cached = hit * e->bs;
    e->st.prefix_queries++;
    e->st.prefix_hit_tokens += cached;
    e->st.prefix_miss_tokens += ntokens - cached;
    if (cached) {
      if (attnd_session_reserve_tokens(s, cached) != 0)
        abort();
      memcpy(s->tokens, tokens, (size_t)cached * sizeof(uint32_t));
    }
    for (int l = 0; l < e->layers; l++)
      s->len[l] = s->cons[l] = cached;
    s->ntok = cached;
    s->npub = hit;
  }
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.session = s->id;
  r.cached_len = hit * e->bs;
  cb(arg, &r);
}

static void close_admit(attnd_engine_t *e, uint64_t identity, uint64_t session,
                        attnd_engine_done_cb cb, void *arg) {
  char msg[160];
  int rc;
  attnd_session_t *s = session_get(e, identity, session, &rc, msg, sizeof(msg));
  if (!s) {
    answer(cb, arg, rc, "%s", msg);
    return;
  }
  session_destroy(e, s);
  answer(cb, arg, 0, NULL);
}

/* The session a Fork or Truncate acts on, or NULL after answering why not:
 * both need a usable session of this identity with equal lengths in every layer. */
static attnd_session_t *session_for_rollback(attnd_engine_t *e, uint64_t identity,
                                             uint64_t session, attnd_engine_done_cb cb,
                                             void *arg) {
  char msg[160];
  int rc;
  attnd_session_t *s = session_get(e, identity, session, &rc, msg, sizeof(msg));
  if (!s) {
    answer(cb, arg, rc, "%s", msg);
    return NULL;
  }
  if (!session_usable(s, cb, arg))
    return NULL;
  if (!attnd_session_lens_equal(s)) {
    answer(cb, arg, ATTND_EPRECOND, "session %016llx: layers hold different lengths",
           (unsigned long long)session);
    return NULL;
  }
  return s;
}

static void fork_admit(attnd_engine_t *e, uint64_t identity, uint64_t session,
                       attnd_engine_done_cb cb, void *arg) {
  attnd_session_t *s = session_for_rollback(e, identity, session, cb, arg);
  if (!s)
    return;
  if (e->cfg.max_sessions > 0 && e->nsessions >= (uint32_t)e->cfg.max_sessions) {
    answer(cb, arg, ATTND_ENOSPC, "max sessions (%d) reached", e->cfg.max_sessions);
    return;
  }
  session_end_plan(e, s);
  s->last_used_ms = now_ms(e);
  attnd_session_t *f = session_create(e, identity);
  memcpy(f->len, s->len, sizeof(uint32_t) * (size_t)e->layers);
  memcpy(f->cons, s->cons, sizeof(uint32_t) * (size_t)e->layers);
  f->taint = s->taint;
  f->saltlen = s->saltlen;
  memcpy(f->salt, s->salt, sizeof(s->salt));
  f->ntok = s->ntok;
  if (s->ntok) {
    if (attnd_session_reserve_tokens(f, s->ntok) != 0)
      abort();
    memcpy(f->tokens, s->tokens, (size_t)s->ntok * sizeof(uint32_t));
  }
  /* Share the blocks holding positions; blocks a plan reserved past len stay
   * the parent's. */
  uint32_t nb = nblocks_for(e, s->len[0]);
  if (nb > s->nblocks)
    nb = s->nblocks;
  if (attnd_session_reserve_table(f, nb) != 0)
    abort();
  for (uint32_t b = 0; b < nb; b++) {
    attnd_blocks_ref(&e->pool, s->table[b], 1);
    f->table[b] = s->table[b];
  }
  f->nblocks = nb;
  f->npub = s->npub < nb ? s->npub : nb;
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.session = f->id;
  cb(arg, &r);
}

static void truncate_admit(attnd_engine_t *e, uint64_t identity, uint64_t session, uint32_t len,
                           attnd_engine_done_cb cb, void *arg) {
  attnd_session_t *s = session_for_rollback(e, identity, session, cb, arg);
  if (!s)
    return;
  if (len > s->len[0]) {
    answer(cb, arg, ATTND_EINVAL, "len %u > session len %u", len, s->len[0]);
    return;
  }
  session_end_plan(e, s);
  s->last_used_ms = now_ms(e);
  for (int l = 0; l < e->layers; l++) {
    s->len[l] = len;
    if (s->cons[l] > len)
      s->cons[l] = len;
  }
  if (s->ntok > len)
    s->ntok = len;
  if (s->taint >= len)
    s->taint = UINT32_MAX;
  table_trim(e, s, nblocks_for(e, len));
  if (s->npub > len / e->bs)
    s->npub = len / e->bs;
  answer(cb, arg, 0, NULL);
}

/* ---- plans and steps ----------------------------------------------------- */

/* Counts and reserves the blocks of every item of p (all or nothing). */
static int plan_reserve(attnd_engine_t *e, plan_t *p, cowlist_t *cow, char *msg, size_t msglen) {
  uint64_t need = 0;
  for (uint32_t i = 0; i < p->nitems; i++)
    need += blocks_needed(e, p->items[i].s, p->items[i].start, p->items[i].n);
  if (need > e->pool.n || ensure_free(e, (uint32_t)need) != 0) {
    snprintf(msg, msglen, "KV pool exhausted: %llu blocks needed, %u free after eviction",
             (unsigned long long)need, e->pool.nfree);
    return ATTND_ENOSPC;
  }
  for (uint32_t i = 0; i < p->nitems; i++)
    reserve(e, p->items[i].s, p->items[i].start, p->items[i].n, cow);
  return 0;
}

static void plan_admit(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                       void *arg) {
  char msg[200];
  plan_t *p = NULL;
  int rc = plan_build(e, identity, items, nitems, &p, msg, sizeof(msg));
  if (rc) {
    answer(cb, arg, rc, "%s", msg);
    return;
  }
  cowlist_t cow = {0};
  if ((rc = plan_reserve(e, p, &cow, msg, sizeof(msg))) != 0) {
    plan_free(p);
    answer(cb, arg, rc, "%s", msg);
    return;
  }
  submit_cow(e, &cow);
  p->conn = conn;
  p->live = 1;
  p->stepped = xcalloc((size_t)e->layers, 1);
  do
    p->id = attnd_random_id();
  while (attnd_idmap_get(&e->plans, p->id));
  /* The new plan takes its sessions first, then the plans it replaces end:
   * so their ending publishes nothing in the range the new plan writes. */
  plan_t **old = xcalloc(p->nitems, sizeof(plan_t *));
  uint32_t nold = 0;
  for (uint32_t i = 0; i < p->nitems; i++) {
    attnd_session_t *s = p->items[i].s;
    plan_t *o = s->plan;
    int seen = 0;
    for (uint32_t k = 0; k < nold; k++)
      seen |= old[k] == o;
    if (o && !seen)
      old[nold++] = o;
    s->plan = p;
    s->last_used_ms = now_ms(e);
  }
  for (uint32_t k = 0; k < nold; k++)
    plan_end(e, old[k]);
  free(old);
  if (attnd_idmap_put(&e->plans, p->id, p) != 0)
    abort();
  p->prev = e->ptail;
  if (e->ptail)
    e->ptail->next = p;
  else
    e->phead = p;
  e->ptail = p;
  e->nplans++;
  /* A connection holds at most max_plans live plans; the oldest ends first. */
  int maxp = e->cfg.max_plans > 0 ? e->cfg.max_plans : 64;
  int count = 0;
  for (plan_t *q = e->phead; q; q = q->next)
    count += q->conn == conn;
  for (plan_t *q = e->phead; q && count > maxp;) {
    plan_t *next = q->next;
    if (q->conn == conn && q != p) {
      plan_end(e, q);
      count--;
    }
    q = next;
  }
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.plan = p->id;
  cb(arg, &r);
}

static void conn_end_plans(attnd_engine_t *e, uint64_t conn) {
  for (plan_t *q = e->phead; q;) {
    plan_t *next = q->next;
    if (q->conn == conn)
      plan_end(e, q);
    q = next;
  }
}

static int check_tensor(const attnd_tensor_t *t, const char *name, int dtype, uint32_t rows,
                        int heads, int dim, char *msg, size_t msglen) {
  if (!t->present || !t->data) {
    snprintf(msg, msglen, "%s missing", name);
    return ATTND_EINVAL;
  }
  if (t->dtype != dtype) {
    snprintf(msg, msglen, "%s: dtype %d, the activation dtype is %d", name, t->dtype, dtype);
    return ATTND_EINVAL;
  }
  if (t->ndim != 3 || t->shape[0] != rows || t->shape[1] != (uint32_t)heads ||
      t->shape[2] != (uint32_t)dim) {
    snprintf(msg, msglen, "%s: shape must be [%u, %d, %d]", name, rows, heads, dim);
    return ATTND_EINVAL;
  }
  if (t->nbytes != (size_t)rows * heads * dim * 2) {
    snprintf(msg, msglen, "%s: %zu bytes for shape [%u, %d, %d]", name, t->nbytes, rows, heads,
             dim);
    return ATTND_EINVAL;
  }
  return 0;
}

/* The kernels read 16-bit elements through typed pointers, so tensor bytes
 * decoded in place from a frame (any offset) are copied once when they are
 * not 2-byte aligned. Returns p or the copy, stored in *keep. */
static const uint8_t *aligned_data(const uint8_t *p, size_t n, void **keep) {
  if (((uintptr_t)p & 1) == 0)
    return p;
  *keep = aligned_alloc(64, (n + 63) & ~(size_t)63);
  if (!*keep)
    abort();
  memcpy(*keep, p, n);
  return *keep;
}

/* Rows per attnd_cpu_all_finite call of the scan: large enough that the
 * vectorized pass dominates, small enough that a bad row is found by
 * rescanning one chunk row by row. */
#define SCAN_CHUNK_ELEMS (64u * 1024u)

/* The first row (of row_elems 16-bit elements) of n bytes holding a
 * non-finite value, or SIZE_MAX. Elements past the last whole row count as
 * one more row. */
static size_t first_bad_row(attnd_dtype_t dt, const uint8_t *p, size_t n, size_t row_elems) {
  size_t elems = n / 2, rows = (elems + row_elems - 1) / row_elems;
  size_t per = SCAN_CHUNK_ELEMS / row_elems ? SCAN_CHUNK_ELEMS / row_elems : 1;
  for (size_t r0 = 0; r0 < rows; r0 += per) {
    size_t r1 = r0 + per < rows ? r0 + per : rows;
    size_t e1 = r1 * row_elems < elems ? r1 * row_elems : elems;
    if (attnd_cpu_all_finite(dt, p + r0 * row_elems * 2, e1 - r0 * row_elems))
      continue;
    for (size_t r = r0; r < r1; r++) {
      size_t a = r * row_elems, b = a + row_elems < elems ? a + row_elems : elems;
      if (!attnd_cpu_all_finite(dt, p + a * 2, b - a))
        return r;
    }
  }
  return SIZE_MAX;
}

/* Scans one tensor of the activation dtype: an aligned view (copying it if
 * needed) and its first non-finite row. A tensor that is absent, empty or of
 * another dtype is left unscanned: the step fails on its shape first. */
static void scan_tensor(attnd_dtype_t dt, const attnd_tensor_t *t, size_t row_elems,
                        const uint8_t **view, void **buf, size_t *bad) {
  *view = NULL;
  *buf = NULL;
  *bad = SIZE_MAX;
  if (!t->present || !t->data || t->nbytes == 0 || t->dtype != (int)dt)
    return;
  *view = aligned_data(t->data, t->nbytes, buf);
  *bad = first_bad_row(dt, *view, t->nbytes, row_elems);
}

/* The whole scan of a step; reads only the request and the model shape, which
 * never changes, so it may run on a worker thread. */
static void scan_step(const attnd_kshape_t *sh, const attnd_step_req_t *req, scan_t *sc) {
  size_t kvrow = (size_t)sh->kv_heads * sh->head_dim, qrow = (size_t)sh->q_heads * sh->head_dim;
  scan_tensor(sh->dtype, &req->q, qrow, &sc->q, &sc->qbuf, &sc->bad_q);
  scan_tensor(sh->dtype, &req->k, kvrow, &sc->k, &sc->kbuf, &sc->bad_k);
  scan_tensor(sh->dtype, &req->v, kvrow, &sc->v, &sc->vbuf, &sc->bad_v);
}

static int row_in(size_t row, uint32_t first, uint32_t n) {
  return row >= first && row - first < n;
}

/* Admits a step whose layer is in range and which names a plan or carries
 * items, not both (attnd_engine_step checked). sc is the finished scan of a
 * queued step, whose copies this call takes over, or NULL: the step is small
 * and is scanned here, once its tensors' shapes are known to be right. */
static void step_admit(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg,
                       scan_t *sc) {
  char msg[200];
  int rc = 0;
  uint32_t layer = req->layer;
  const attnd_kshape_t *sh = &e->shape;
  cowlist_t cow = {0};
  void *out = NULL, *kbuf = NULL, *vbuf = NULL, *qbuf = NULL;
  float *lse = NULL;
  scan_t local;
  if (sc) {
    kbuf = sc->kbuf;
    vbuf = sc->vbuf;
    qbuf = sc->qbuf;
  }
  plan_t *p = NULL, *inl = NULL;
  if (req->plan) {
    p = attnd_idmap_get(&e->plans, req->plan);
    if (!p || p->identity != identity) {
      snprintf(msg, sizeof(msg), "plan %016llx has ended (or never existed)",
               (unsigned long long)req->plan);
      rc = ATTND_EPRECOND;
      goto fail;
    }
  } else {
    if ((rc = plan_build(e, identity, req->items, req->nitems, &inl, msg, sizeof(msg))) != 0)
      goto fail;
    p = inl;
  }
  if ((rc = check_tensor(&req->k, "k", sh->dtype, p->T, sh->kv_heads, sh->head_dim, msg,
                         sizeof(msg))) ||
      (rc = check_tensor(&req->v, "v", sh->dtype, p->T, sh->kv_heads, sh->head_dim, msg,
                         sizeof(msg))))
    goto fail;
  if (p->Tq > 0) {
    if ((rc = check_tensor(&req->q, "q", sh->dtype, p->Tq, sh->q_heads, sh->head_dim, msg,
                           sizeof(msg))))
      goto fail;
  } else if (req->q.present && req->q.nbytes > 0) {
    snprintf(msg, sizeof(msg), "q given but every item is kv_only");
    rc = ATTND_EINVAL;
    goto fail;
  }
  if (attnd_kv_type_static(sh->kv) && !e->sc.l[layer].present) {
    snprintf(msg, sizeof(msg), "layer %u has no static scales for kv cache type %s", layer,
             attnd_kv_type_name(sh->kv));
    rc = ATTND_EPRECOND;
    goto fail;
  }
  size_t kvrow = (size_t)sh->kv_heads * sh->head_dim, qrow = (size_t)sh->q_heads * sh->head_dim;
  if (!sc) {
    /* Small: scanned here, on the loop thread, like the checks around it. */
    scan_step(sh, req, &local);
    sc = &local;
    kbuf = sc->kbuf;
    vbuf = sc->vbuf;
    qbuf = sc->qbuf;
  }
  const uint8_t *kd = sc->k, *vd = sc->v;
  uint8_t *qd = p->Tq ? (uint8_t *)sc->q : NULL; /* the backend may rotate q in place */
  uint32_t kv_row = 0, q_row = 0;
  for (uint32_t i = 0; i < p->nitems; i++) {
    pitem_t *it = &p->items[i];
    attnd_session_t *s = it->s;
    if (s->broken) {
      snprintf(msg, sizeof(msg), "item %u: session %016llx lost its KV in a backend fault", i,
               (unsigned long long)s->id);
      rc = ATTND_EABORTED;
      goto fail;
    }
    if (it->start > s->len[layer]) {
      snprintf(msg, sizeof(msg), "item %u: start %u > len %u", i, it->start, s->len[layer]);
      rc = ATTND_EINVAL;
      goto fail;
    }
    if (layer > 0 && it->start + it->n > s->len[0]) {
      snprintf(msg, sizeof(msg), "item %u: start+n %u > len %u of layer 0 (layer 0 leads)", i,
               it->start + it->n, s->len[0]);
      rc = ATTND_EINVAL;
      goto fail;
    }
    if (layer > 0)
      for (uint32_t t = 0; t < it->n; t++)
        if (it->tokens[t] != s->tokens[it->start + t]) {
          snprintf(msg, sizeof(msg), "item %u: token %u at position %u differs from layer 0's %u",
                   i, it->tokens[t], it->start + t, s->tokens[it->start + t]);
          rc = ATTND_EINVAL;
          goto fail;
        }
    /* The scan recorded the first bad row of each tensor; no item before
     * this one holds a bad row, so this item fails exactly when it holds
     * that row (the same answer as scanning item by item). */
    if (row_in(sc->bad_k, kv_row, it->n) || row_in(sc->bad_v, kv_row, it->n) ||
        (it->has_q && row_in(sc->bad_q, q_row, it->n))) {
      snprintf(msg, sizeof(msg), "item %u: q, k or v holds a non-finite value", i);
      rc = ATTND_EINVAL;
      goto fail;
    }
    kv_row += it->n;
    if (it->has_q)
      q_row += it->n;
  }
  /* Output buffers before the reservation: a large prefill's output may not
   * fit in memory, which must fail the call before it changes anything. */
  size_t out_bytes = (size_t)p->Tq * qrow * (req->fp32_out ? 4 : 2);
  size_t lse_bytes = req->want_lse ? (size_t)p->Tq * sh->q_heads * sizeof(float) : 0;
  if (out_bytes) {
    out = aligned_alloc(64, (out_bytes + 63) & ~(size_t)63);
    lse = lse_bytes ? calloc(1, lse_bytes) : NULL;
    if (!out || (lse_bytes && !lse)) {
      snprintf(msg, sizeof(msg), "cannot allocate %zu bytes of output", out_bytes + lse_bytes);
      rc = ATTND_ENOMEM;
      goto fail;
    }
  }
  if ((rc = plan_reserve(e, p, &cow, msg, sizeof(msg))) != 0)
    goto fail;

  /* ---- admitted: from here on the call changes state ---- */
  submit_cow(e, &cow);
  if (inl)
    for (uint32_t i = 0; i < p->nitems; i++)
      session_end_plan(e, p->items[i].s);
  else if (!p->stepped[layer]) {
    p->stepped[layer] = 1;
    p->nstepped++;
  }

  ejob_t *j = xcalloc(1, sizeof(*j));
  j->e = e;
  j->kind = EJ_STEP;
  j->layer = (int)layer;
  j->cb = cb;
  j->arg = arg;
  j->job.kind = ATTND_JOB_STEP;
  j->job.layer = (int)layer;
  size_t nmeta = 0, nrefs = 0;
  for (uint32_t i = 0; i < p->nitems; i++) {
    uint32_t kv_len = p->items[i].start + p->items[i].n;
    nmeta += nblocks_for(e, kv_len) + (p->items[i].intervals ? 4 * (size_t)kv_len : 0);
    nrefs += nblocks_for(e, kv_len);
  }
  j->kitems = xcalloc(p->nitems, sizeof(attnd_kitem_t));
  j->sessions = xcalloc(p->nitems, sizeof(uint64_t));
  j->nsessions = p->nitems;
  for (uint32_t i = 0; i < p->nitems; i++)
    j->sessions[i] = p->items[i].s->id;
  j->meta = xcalloc(nmeta, sizeof(int32_t));
  j->refs = xcalloc(nrefs, sizeof(int32_t));
  attnd_kbatch_t *b = &j->job.batch;
  size_t mo = 0;
  int any_prefill = 0;
  kv_row = q_row = 0;
  for (uint32_t i = 0; i < p->nitems; i++) {
    pitem_t *it = &p->items[i];
    attnd_session_t *s = it->s;
    uint32_t kv_len = it->start + it->n, nb = nblocks_for(e, kv_len);
    attnd_kitem_t *k = &j->kitems[i];
    k->start = (int32_t)it->start;
    k->n = (int32_t)it->n;
    k->q_row = it->has_q ? (int32_t)q_row : -1;
    k->kv_row = (int32_t)kv_row;
    k->mask_kind = it->kmask;
    k->mask_param = it->mask_param;
    k->causal = it->causal;
    k->block_table = (int32_t)mo;
    for (uint32_t bi = 0; bi < nb; bi++) {
      j->meta[mo++] = s->table[bi];
      j->refs[j->nrefs++] = s->table[bi];
      attnd_blocks_ref(&e->pool, s->table[bi], 0);
    }
    if (it->intervals) {
      k->intervals = (int32_t)mo;
      memcpy(&j->meta[mo], it->intervals, 4 * (size_t)kv_len * sizeof(int32_t));
      mo += 4 * (size_t)kv_len;
    }
    if ((int32_t)kv_len > b->max_kv_len)
      b->max_kv_len = (int32_t)kv_len;
    if ((int32_t)it->n > b->max_n)
      b->max_n = (int32_t)it->n;
    any_prefill |= it->n > 1;
    kv_row += it->n;
    if (it->has_q)
      q_row += it->n;

    /* Session state moves at admission. */
    uint32_t end = kv_len;
    s->len[layer] = end;
    if (layer == 0) {
      if (attnd_session_reserve_tokens(s, end) != 0)
        abort();
      uint32_t changed = UINT32_MAX;
      uint32_t known = s->ntok < end ? s->ntok : end;
      for (uint32_t pos = it->start; pos < known; pos++)
        if (s->tokens[pos] != it->tokens[pos - it->start]) {
          changed = pos;
          break;
        }
      memcpy(&s->tokens[it->start], it->tokens, (size_t)it->n * sizeof(uint32_t));
      if (s->ntok < end)
        s->ntok = end;
      /* Other layers computed from the old tokens are consistent only up to
       * the first changed one. */
      if (changed != UINT32_MAX)
        for (int l = 1; l < e->layers; l++)
          if (s->cons[l] > changed)
            s->cons[l] = changed;
      if (changed != UINT32_MAX && s->npub > changed / e->bs)
        s->npub = changed / e->bs; /* copies made by reserve() already */
      s->cons[0] = end;
    } else if (it->start <= s->cons[layer]) {
      s->cons[layer] = end;
    }
    if (s->cons[layer] > end)
      s->cons[layer] = end;
    if (!it->plain_causal && it->start < s->taint)
      s->taint = it->start;
    s->last_used_ms = now_ms(e);
    publish(e, s);
  }
  b->items = j->kitems;
  b->nitems = (int32_t)p->nitems;
  b->meta = j->meta;
  j->job.nmeta = nmeta;
  b->total_q = (int32_t)p->Tq;
  b->total_kv = (int32_t)p->T;
  j->job.kv_bytes = (size_t)p->T * kvrow * 2;
  j->job.q_bytes = (size_t)p->Tq * qrow * 2;
  b->k = kd;
  b->v = vd;
  b->q = qd;
  j->kbuf = kbuf;
  j->vbuf = vbuf;
  j->qbuf = qbuf;
  b->out_fp32 = req->fp32_out != 0;
  j->out_dtype = req->fp32_out ? ATTND_DT_FP32 : sh->dtype;
  j->job.out_bytes = out_bytes;
  j->out = out;
  b->out = j->out;
  j->job.lse_bytes = lse ? lse_bytes : 0;
  j->lse = lse;
  b->lse = j->lse;
  e->st.steps++;
  e->st.tokens_written += p->T;
  if (any_prefill)
    e->st.prefill_steps++;
  else
    e->st.decode_steps++;
  plan_free(inl);
  layer_submit(e, j);
  return;
fail:
  free(out);
  free(lse);
  free(kbuf);
  free(vbuf);
  free(qbuf);
  plan_free(inl);
  answer(cb, arg, rc, "%s", msg);
}

/* ---- scales -------------------------------------------------------------- */

typedef struct {
  uv_work_t w;
  attnd_engine_t *e;
  uint8_t *buf;
  size_t len;
  uint64_t seq;
  int rc;
  uint64_t version;
  attnd_engine_done_cb cb;
  void *arg;
} persist_t;

static void persist_work(uv_work_t *w) {
  persist_t *p = (persist_t *)w;
  attnd_engine_t *e = p->e;
  /* Works may run concurrently; the newest snapshot must be the one left. */
  uv_mutex_lock(&e->persist_mu);
  if (p->seq > e->persist_written) {
    p->rc = attnd_scales_write_file(e->sc.path, p->buf, p->len);
    if (p->rc == 0)
      e->persist_written = p->seq;
  }
  uv_mutex_unlock(&e->persist_mu);
}

static void persist_done(uv_work_t *w, int status) {
  persist_t *p = (persist_t *)w;
  attnd_engine_t *e = p->e;
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.status = status ? ATTND_EINTERNAL : p->rc;
  r.version = p->version;
  if (r.status)
    snprintf(r.message, sizeof(r.message),
             "scales set (version %llu) but not persisted to %.120s: %s",
             (unsigned long long)p->version, e->sc.path, attnd_strerror(r.status));
  p->cb(p->arg, &r);
  free(p->buf);
  free(p);
  e->pending--;
  maybe_finish_close(e);
}

static void update_fingerprint(attnd_engine_t *e) {
  uint64_t *v = xcalloc((size_t)e->layers, sizeof(uint64_t));
  attnd_scales_versions(&e->sc, v);
  attnd_prefix_set_fingerprint(e->px,
                               attnd_prefix_fingerprint(&e->shape, e->layers, e->cfg.model_id, v));
  free(v);
}

static void queue_backend_scales(attnd_engine_t *e, int layer) {
  const attnd_layer_scales_t *ls = &e->sc.l[layer];
  size_t n = (size_t)e->shape.kv_heads * (ls->per_channel ? (size_t)e->shape.head_dim : 1);
  ejob_t *j = xcalloc(1, sizeof(*j));
  j->e = e;
  j->kind = EJ_SCALES;
  j->layer = layer;
  j->per_channel = ls->per_channel;
  j->sk = xcalloc(n, sizeof(float));
  j->sv = xcalloc(n, sizeof(float));
  memcpy(j->sk, ls->k_scale, n * sizeof(float));
  memcpy(j->sv, ls->v_scale, n * sizeof(float));
  if (ls->k_zero) {
    j->zk = xcalloc(n, sizeof(float));
    j->zv = xcalloc(n, sizeof(float));
    memcpy(j->zk, ls->k_zero, n * sizeof(float));
    memcpy(j->zv, ls->v_zero, n * sizeof(float));
  }
  layer_submit(e, j);
}

static void scales_admit(attnd_engine_t *e, const attnd_scales_req_t *req, attnd_engine_done_cb cb,
                         void *arg) {
  char msg[200];
  int rc = attnd_scales_validate(&e->sc, req, msg, sizeof(msg));
  if (rc) {
    answer(cb, arg, rc, "%s", msg);
    return;
  }
  uint32_t l = req->layer;
  int holds = attnd_prefix_count(e->px) > 0;
  for (attnd_session_t *s = e->shead; s && !holds; s = s->next)
    holds = s->len[l] > 0;
  if (holds && !req->drop_cached_kv) {
    answer(cb, arg, ATTND_EPRECOND,
           "layer %u holds KV (sessions or cached blocks); set drop_cached_kv to drop it", l);
    return;
  }
  if (holds) {
    /* Cached blocks hold every layer; with new scales for one of them none
     * can be reused. Sessions keep their blocks and recompute this layer. */
    attnd_prefix_drop_all(e->px);
    for (attnd_session_t *s = e->shead; s; s = s->next) {
      s->npub = 0;
      s->len[l] = 0;
      s->cons[l] = 0;
    }
  }
  uint64_t version = attnd_scales_apply(&e->sc, req);
  update_fingerprint(e);
  queue_backend_scales(e, (int)l);
  if (!e->sc.path[0]) {
    attnd_result_t r;
    memset(&r, 0, sizeof(r));
    r.version = version;
    cb(arg, &r);
    return;
  }
  persist_t *p = xcalloc(1, sizeof(*p));
  p->e = e;
  p->cb = cb;
  p->arg = arg;
  p->version = version;
  p->seq = ++e->persist_seq;
  if ((rc = attnd_scales_serialize(&e->sc, &p->buf, &p->len)) != 0 ||
      uv_queue_work(e->loop, &p->w, persist_work, persist_done) != 0) {
    free(p->buf);
    free(p);
    answer(cb, arg, rc ? rc : ATTND_EINTERNAL, "scales set but not persisted");
    return;
  }
  e->pending++;
}

/* ---- admission queue ----------------------------------------------------- */

static call_t *call_new(attnd_engine_t *e, int kind, uint64_t identity, attnd_engine_done_cb cb,
                        void *arg) {
  call_t *c = xcalloc(1, sizeof(*c));
  c->e = e;
  c->kind = kind;
  c->identity = identity;
  c->cb = cb;
  c->arg = arg;
  return c;
}

static void call_admit(attnd_engine_t *e, call_t *c) {
  switch (c->kind) {
  case CALL_OPEN:
    open_admit(e, c->identity, c->tokens, c->ntokens, c->salt, c->saltlen, c->cb, c->arg);
    break;
  case CALL_CLOSE:
    close_admit(e, c->identity, c->session, c->cb, c->arg);
    break;
  case CALL_FORK:
    fork_admit(e, c->identity, c->session, c->cb, c->arg);
    break;
  case CALL_TRUNCATE:
    truncate_admit(e, c->identity, c->session, c->len, c->cb, c->arg);
    break;
  case CALL_PLAN:
    plan_admit(e, c->identity, c->conn, c->items, c->nitems, c->cb, c->arg);
    break;
  case CALL_STEP:
    step_admit(e, c->identity, c->conn, &c->step, c->cb, c->arg, c->scanned ? &c->scan : NULL);
    break;
  case CALL_SCALES:
    scales_admit(e, &c->scales, c->cb, c->arg);
    break;
  case CALL_CONN_CLOSED:
    conn_end_plans(e, c->conn);
    break;
  }
}

/* Admits queued calls from the head while the head's scan is done. A call's
 * callback may make new calls: they queue behind what is left (or, with the
 * queue empty, run at once), and this loop admits them in turn. */
static void queue_pump(attnd_engine_t *e) {
  if (e->admitting)
    return;
  e->admitting = 1;
  while (e->qhead && !e->qhead->scanning) {
    call_t *c = e->qhead;
    e->qhead = c->next;
    if (!e->qhead)
      e->qtail = NULL;
    e->nqueued--;
    call_admit(e, c);
    free(c);
    e->pending--;
  }
  e->admitting = 0;
  maybe_finish_close(e);
}

static void call_push(attnd_engine_t *e, call_t *c) {
  /* Pending until admitted: a close waits for queued calls and running scans. */
  e->pending++;
  e->nqueued++;
  if (e->qtail)
    e->qtail->next = c;
  else
    e->qhead = c;
  e->qtail = c;
  queue_pump(e);
}

static void scan_work(uv_work_t *w) {
  call_t *c = (call_t *)w;
  scan_step(&c->e->shape, &c->step, &c->scan);
}

static void scan_done(uv_work_t *w, int status) {
  call_t *c = (call_t *)w;
  /* status is UV_ECANCELED only after uv_cancel, which is never called. */
  (void)status;
  c->scanning = 0;
  queue_pump(c->e);
}

/* 1 when earlier calls wait for admission: a new call queues behind them. */
static int must_queue(attnd_engine_t *e) {
  return e->qhead != NULL;
}

void attnd_engine_open_session(attnd_engine_t *e, uint64_t identity, const uint32_t *tokens,
                               uint32_t ntokens, const uint8_t *salt, size_t saltlen,
                               attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (saltlen > ATTND_PREFIX_MAX_SALT) {
    answer(cb, arg, ATTND_EINVAL, "salt is %zu bytes, at most %d", saltlen, ATTND_PREFIX_MAX_SALT);
    return;
  }
  if (!must_queue(e)) {
    open_admit(e, identity, tokens, ntokens, salt, saltlen, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_OPEN, identity, cb, arg);
  c->tokens = tokens;
  c->ntokens = ntokens;
  c->saltlen = saltlen;
  if (saltlen)
    memcpy(c->salt, salt, saltlen);
  call_push(e, c);
}

void attnd_engine_close_session(attnd_engine_t *e, uint64_t identity, uint64_t session,
                                attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    close_admit(e, identity, session, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_CLOSE, identity, cb, arg);
  c->session = session;
  call_push(e, c);
}

void attnd_engine_fork(attnd_engine_t *e, uint64_t identity, uint64_t session,
                       attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    fork_admit(e, identity, session, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_FORK, identity, cb, arg);
  c->session = session;
  call_push(e, c);
}

void attnd_engine_truncate(attnd_engine_t *e, uint64_t identity, uint64_t session, uint32_t len,
                           attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    truncate_admit(e, identity, session, len, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_TRUNCATE, identity, cb, arg);
  c->session = session;
  c->len = len;
  call_push(e, c);
}

void attnd_engine_plan(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                       void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    plan_admit(e, identity, conn, items, nitems, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_PLAN, identity, cb, arg);
  c->conn = conn;
  c->items = items;
  c->nitems = nitems;
  call_push(e, c);
}

static size_t tensor_bytes(const attnd_tensor_t *t) {
  return t->present && t->data ? t->nbytes : 0;
}

void attnd_engine_step(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (req->layer >= (uint32_t)e->layers) {
    answer(cb, arg, ATTND_EINVAL, "layer %u >= layers %d", req->layer, e->layers);
    return;
  }
  if (req->plan && req->nitems) {
    answer(cb, arg, ATTND_EINVAL, "a step names a plan or carries items, not both");
    return;
  }
  size_t bytes = tensor_bytes(&req->q) + tensor_bytes(&req->k) + tensor_bytes(&req->v);
  int large = bytes > e->offload_bytes;
  if (!large && !must_queue(e)) {
    step_admit(e, identity, conn, req, cb, arg, NULL);
    return;
  }
  call_t *c = call_new(e, CALL_STEP, identity, cb, arg);
  c->conn = conn;
  c->step = *req;
  if (large) {
    c->scanned = 1;
    c->scanning = 1;
    if (uv_queue_work(e->loop, &c->work, scan_work, scan_done) != 0) {
      /* Cannot happen with valid arguments; scan here rather than fail. */
      scan_step(&e->shape, &c->step, &c->scan);
      c->scanning = 0;
    }
  }
  call_push(e, c);
}

void attnd_engine_set_scales(attnd_engine_t *e, const attnd_scales_req_t *req,
                             attnd_engine_done_cb cb, void *arg) {
  if (!check_open(e, cb, arg))
    return;
  if (!must_queue(e)) {
    scales_admit(e, req, cb, arg);
    return;
  }
  call_t *c = call_new(e, CALL_SCALES, 0, cb, arg);
  c->scales = *req;
  call_push(e, c);
}

void attnd_engine_conn_closed(attnd_engine_t *e, uint64_t conn) {
  /* Behind queued calls, so that a queued Plan of this connection is admitted
   * first and then ends here, as it would have without the queue. */
  if (!must_queue(e)) {
    conn_end_plans(e, conn);
    return;
  }
  call_t *c = call_new(e, CALL_CONN_CLOSED, 0, NULL, NULL);
  c->conn = conn;
  call_push(e, c);
}

void attnd_engine_set_offload_bytes(attnd_engine_t *e, size_t bytes) {
  e->offload_bytes = bytes;
}

/* ---- idle sessions ------------------------------------------------------- */

static void idle_cb(uv_timer_t *t) {
  attnd_engine_t *e = t->data;
  if (e->qhead)
    return; /* a queued call may name an idle session: sweep on a later tick */
  uint64_t now = now_ms(e), idle = (uint64_t)e->cfg.session_idle_s * 1000;
  for (attnd_session_t *s = e->shead; s;) {
    attnd_session_t *next = s->next;
    if (now - s->last_used_ms >= idle)
      session_destroy(e, s);
    s = next;
  }
}

/* ---- lifetime ------------------------------------------------------------ */

int attnd_engine_init(attnd_engine_t **out, uv_loop_t *loop, const attnd_config_t *cfg, char *err,
                      size_t errlen) {
  attnd_engine_t *e = calloc(1, sizeof(*e));
  if (!e)
    return ATTND_ENOMEM;
  int rc;
  e->loop = loop;
  e->cfg = *cfg;
  e->shape = cfg->shape;
  if (e->shape.rotary_dim == 0)
    e->shape.rotary_dim = e->shape.head_dim;
  if (!(e->shape.softmax_scale > 0.0f) && e->shape.head_dim > 0)
    e->shape.softmax_scale = (float)(1.0 / sqrt((double)e->shape.head_dim));
  e->layers = cfg->layers;
  e->bs = (uint32_t)e->shape.block_size;
  e->offload_bytes = (size_t)cfg->engine_offload_bytes;
  if (e->cfg.max_context <= 0)
    e->cfg.max_context = 131072;
  if (e->layers <= 0 || attnd_kshape_check(&e->shape) != 0) {
    snprintf(err, errlen, "unsupported model shape");
    rc = ATTND_EINVAL;
    goto fail_shape;
  }
  int use_cuda = cfg->backend == ATTND_BACKEND_CUDA ||
                 (cfg->backend == ATTND_BACKEND_AUTO && attnd_backend_cuda_available());
  if (cfg->backend == ATTND_BACKEND_CUDA && !attnd_backend_cuda_available()) {
    snprintf(err, errlen, "--backend cuda but no usable CUDA device");
    rc = ATTND_EUNAVAIL;
    goto fail_shape;
  }
  attnd_backend_opts_t bo;
  attnd_backend_opts_defaults(&bo);
  bo.kv_memory = cfg->kv_memory;
  bo.threads = cfg->threads;
  bo.device = cfg->device;
  bo.cuda_pinned_max = cfg->cuda_pinned_max;
  bo.cuda_hostfn_min = cfg->cuda_hostfn_min;
  bo.cuda_callbacks = cfg->cuda_completion == ATTND_COMPLETION_CALLBACK;
  bo.cuda_trace = cfg->cuda_trace;
  if (use_cuda)
    rc = attnd_backend_cuda_create(&e->be, loop, &e->shape, e->layers, &bo, err, errlen);
  else
    rc = attnd_backend_cpu_create(&e->be, loop, &e->shape, e->layers, &bo, err, errlen);
  if (rc)
    goto fail_shape;
  if ((rc = attnd_blocks_init(&e->pool, e->be->num_blocks)) != 0)
    goto fail_pool;
  if ((rc = attnd_prefix_init(&e->px, &e->pool, e->bs)) != 0)
    goto fail_prefix;
  if ((rc = attnd_scales_init(&e->sc, &e->shape, e->layers, cfg->state_dir)) != 0)
    goto fail_scales;
  char lerr[256] = "";
  rc = attnd_scales_load(&e->sc, lerr, sizeof(lerr));
  if (rc < 0) {
    snprintf(err, errlen, "cannot read %s: %s", e->sc.path, attnd_strerror(rc));
    goto fail_load;
  }
  if (rc == 1)
    fprintf(stderr, "attnd: %s\n", lerr);
  e->lay = xcalloc((size_t)e->layers, sizeof(layer_t));
  for (int l = 0; l < e->layers; l++) {
    const attnd_layer_scales_t *ls = &e->sc.l[l];
    if (ls->present)
      e->be->ops->set_scales(e->be, l, ls->k_scale, ls->v_scale, ls->k_zero, ls->v_zero,
                             ls->per_channel);
  }
  if (attnd_idmap_init(&e->sessions) || attnd_idmap_init(&e->plans))
    abort();
  update_fingerprint(e);
  uv_mutex_init(&e->persist_mu);
  uv_timer_init(loop, &e->idle);
  e->idle.data = e;
  if (e->cfg.session_idle_s > 0) {
    uint64_t period = (uint64_t)e->cfg.session_idle_s * 1000 / 4;
    if (period > 1000)
      period = 1000;
    if (period < 10)
      period = 10;
    uv_timer_start(&e->idle, idle_cb, period, period);
  }
  /* The idle sweep alone must not keep a loop alive. */
  uv_unref((uv_handle_t *)&e->idle);
  *out = e;
  return 0;
fail_load:
  attnd_scales_free(&e->sc);
fail_scales:
  attnd_prefix_free(e->px);
fail_prefix:
  attnd_blocks_free(&e->pool);
fail_pool:
  e->be->ops->destroy(e->be);
fail_shape:
  free(e);
  return rc;
}

static void idle_closed(uv_handle_t *h) {
  attnd_engine_t *e = h->data;
  void (*cb)(void *) = e->close_cb;
  void *arg = e->close_arg;
  while (e->shead)
    session_destroy(e, e->shead);
  while (e->phead)
    plan_end(e, e->phead);
  e->be->ops->destroy(e->be);
  attnd_idmap_free(&e->sessions);
  attnd_idmap_free(&e->plans);
  attnd_prefix_free(e->px);
  attnd_blocks_free(&e->pool);
  attnd_scales_free(&e->sc);
  uv_mutex_destroy(&e->persist_mu);
  free(e->lay);
  free(e);
  if (cb)
    cb(arg);
}

static void maybe_finish_close(attnd_engine_t *e) {
  if (e->closing != 1 || e->pending > 0)
    return;
  e->closing = 2;
  uv_close((uv_handle_t *)&e->idle, idle_closed);
}

void attnd_engine_on_fatal(attnd_engine_t *e, void (*cb)(void *arg), void *arg) {
  e->fatal_cb = cb;
  e->fatal_arg = arg;
}

void attnd_engine_close(attnd_engine_t *e, void (*cb)(void *arg), void *arg) {
  if (e->closing)
    return;
  e->closing = 1;
  e->close_cb = cb;
  e->close_arg = arg;
  /* Scales are persisted as they are set; nothing else outlives the process. */
  maybe_finish_close(e);
}

/* ---- introspection ------------------------------------------------------- */

void attnd_engine_info(attnd_engine_t *e, attnd_engine_info_t *info) {
  memset(info, 0, sizeof(*info));
  info->backend = e->be->ops->name;
  e->be->ops->describe(e->be, info->device, sizeof(info->device), &info->device_memory,
                       &info->compute_capability);
  info->kv_blocks = e->be->num_blocks;
  info->kv_memory = (uint64_t)e->be->num_blocks * e->be->block_bytes * (uint64_t)e->layers;
  info->kv_bytes_per_token = attnd_kv_bytes_per_token(&e->shape) * e->layers;
}

void attnd_engine_stats(attnd_engine_t *e, attnd_engine_stats_t *st) {
  *st = e->st;
  st->sessions = e->nsessions;
  st->plans = e->nplans;
  st->blocks_total = e->pool.n;
  st->blocks_used = attnd_blocks_used(&e->pool);
  st->blocks_cached = e->pool.nlru;
  st->queued = e->nqueued;
}

uint32_t attnd_engine_list_sessions(attnd_engine_t *e, uint64_t identity, attnd_session_info_t *out,
                                    uint32_t max) {
  uint32_t n = 0;
  uint64_t now = now_ms(e);
  for (attnd_session_t *s = e->shead; s; s = s->next) {
    if (s->identity != identity)
      continue;
    if (n < max) {
      out[n].session = s->id;
      out[n].len = s->len[0];
      out[n].blocks = s->nblocks;
      out[n].idle_s = (now - s->last_used_ms) / 1000;
    }
    n++;
  }
  return n;
}

int attnd_engine_check(attnd_engine_t *e, char *err, size_t errlen) {
  if (attnd_blocks_check(&e->pool, err, errlen) != 0)
    return -1;
  int32_t *tab = xcalloc(e->pool.n, sizeof(int32_t));
  int rc = -1;
  uint32_t nsess = 0;
  for (attnd_session_t *s = e->shead; s; s = s->next) {
    nsess++;
    if (attnd_idmap_get(&e->sessions, s->id) != s) {
      snprintf(err, errlen, "session %016llx not in the map", (unsigned long long)s->id);
      goto out;
    }
    for (int l = 0; l < e->layers; l++) {
      if (nblocks_for(e, s->len[l]) > s->nblocks || s->cons[l] > s->len[l]) {
        snprintf(err, errlen, "session %016llx layer %d: len %u cons %u with %u blocks",
                 (unsigned long long)s->id, l, s->len[l], s->cons[l], s->nblocks);
        goto out;
      }
    }
    if (s->npub > s->nblocks || s->len[0] > s->ntok) {
      snprintf(err, errlen, "session %016llx: npub %u nblocks %u len0 %u ntok %u",
               (unsigned long long)s->id, s->npub, s->nblocks, s->len[0], s->ntok);
      goto out;
    }
    for (uint32_t b = 0; b < s->nblocks; b++) {
      int32_t id = s->table[b];
      if (id < 0 || (uint32_t)id >= e->pool.n || e->pool.b[id].where != ATTND_BLK_USED) {
        snprintf(err, errlen, "session %016llx block %u -> %d not in use",
                 (unsigned long long)s->id, b, id);
        goto out;
      }
      if (b < s->npub && !e->pool.b[id].published) {
        snprintf(err, errlen, "session %016llx block %u counted published but is not",
                 (unsigned long long)s->id, b);
        goto out;
      }
      tab[id]++;
    }
  }
  if (nsess != e->nsessions || e->sessions.count != nsess) {
    snprintf(err, errlen, "session count %u, list %u, map %u", e->nsessions, nsess,
             e->sessions.count);
    goto out;
  }
  uint32_t npub = 0;
  for (uint32_t id = 0; id < e->pool.n; id++) {
    const attnd_block_t *b = &e->pool.b[id];
    npub += b->published;
    if (b->tabref != tab[id]) {
      snprintf(err, errlen, "block %u: tabref %d but %d table entries", id, b->tabref, tab[id]);
      goto out;
    }
    if (e->pending == 0 && b->ref != b->tabref) {
      snprintf(err, errlen, "block %u: ref %d, tabref %d with nothing in flight", id, b->ref,
               b->tabref);
      goto out;
    }
  }
  if (npub != attnd_prefix_count(e->px)) {
    snprintf(err, errlen, "%u published blocks, index holds %u", npub, attnd_prefix_count(e->px));
    goto out;
  }
  rc = 0;
out:
  free(tab);
  return rc;
}

/* order.c: who a queued call waits for (internal.h; docs/sessions.md §5).
 *
 * A call that cannot be admitted on arrival waits in the admission queue, but
 * only for the earlier queued calls it could observe or conflict with, which
 * it shares a key with:
 *
 *   - its connection: a connection's calls are admitted in arrival order (a
 *     client pipelines a Plan and the Steps of every layer);
 *   - each session it names, directly or through the live plan a Step names:
 *     a session's calls are admitted in arrival order, whatever connection
 *     they come from;
 *   - a barrier (SetScales, SetSinks: they change what every session's steps
 *     compute) waits for every earlier queued call, and every later call waits
 *     for it.
 *
 * Any admission order that keeps these is a valid serialization of the calls:
 * a call passes only queued calls, which have not been answered, so no client
 * can have seen the effect of one it passes; and every check is still made at
 * the call's own admission, against the state its predecessors left.
 *
 * Per key the engine keeps the last queued call holding it (qconn, qsess). A
 * new call waits for that one, which waits for the one before, and so on, so
 * it follows every earlier call with the key while knowing only one: O(keys)
 * per call, never a walk of the queue. Barriers count instead of linking: an
 * epoch counts the queued calls since the last barrier (that barrier
 * included), and the next barrier waits until the count is zero. A call with
 * nothing left to wait for, and its own scan or file write done, is ready;
 * queue.c admits ready calls in the order they became ready. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct attnd_qepoch_s {
  uint32_t n;            /* queued calls in it */
  attnd_qnode_t *closer; /* the barrier waiting for them (NULL: none yet) */
};

void attnd_qkeys_init(attnd_qkeys_t *ks) {
  memset(ks, 0, sizeof(*ks));
  ks->k = ks->inl;
  ks->cap = (uint32_t)(sizeof(ks->inl) / sizeof(ks->inl[0]));
}

void attnd_qkeys_add(attnd_qkeys_t *ks, int kind, uint64_t id) {
  if (ks->n == ks->cap) {
    uint32_t cap = ks->cap * 2;
    attnd_qkey_t *k = attnd_xmalloc(cap * sizeof(*k));
    memcpy(k, ks->k, ks->n * sizeof(*k));
    if (ks->k != ks->inl)
      free(ks->k);
    ks->k = k;
    ks->cap = cap;
  }
  ks->k[ks->n].kind = kind;
  ks->k[ks->n].id = id;
  ks->n++;
}

void attnd_qkeys_free(attnd_qkeys_t *ks) {
  if (ks->k != ks->inl)
    free(ks->k);
  attnd_qkeys_init(ks);
}

static attnd_idmap_t *key_map(attnd_engine_t *e, int kind) {
  return kind == ATTND_QK_SESSION ? &e->qsess : &e->qconn;
}

static const attnd_idmap_t *key_cmap(const attnd_engine_t *e, int kind) {
  return kind == ATTND_QK_SESSION ? &e->qsess : &e->qconn;
}

int attnd_order_must_wait(const attnd_engine_t *e, const attnd_qkeys_t *ks) {
  if (ks->barrier)
    return !attnd_list_empty(&e->queue);
  if (e->qbarrier)
    return 1;
  for (uint32_t i = 0; i < ks->n; i++)
    if (attnd_idmap_get(key_cmap(e, ks->k[i].kind), ks->k[i].id))
      return 1;
  return 0;
}

int attnd_order_names_session(const attnd_engine_t *e, uint64_t session) {
  return attnd_idmap_get(&e->qsess, session) != NULL;
}

static void maybe_ready(attnd_engine_t *e, attnd_qnode_t *n) {
  if (n->ready || n->held || n->nwait > 0)
    return;
  n->ready = 1;
  attnd_list_insert_tail(&e->qready, &n->rlink);
}

/* w waits for p (once more: one entry per key they share). */
static void add_waiter(attnd_qnode_t *p, attnd_qnode_t *w) {
  if (p->nwaiters == p->waiters_cap) {
    p->waiters_cap = p->waiters_cap ? p->waiters_cap * 2 : 4;
    p->waiters = attnd_xrealloc(p->waiters, p->waiters_cap * sizeof(*p->waiters));
  }
  p->waiters[p->nwaiters++] = w;
  w->nwait++;
}

static attnd_qepoch_t *cur_epoch(attnd_engine_t *e) {
  if (!e->qepoch)
    e->qepoch = attnd_xcalloc(1, sizeof(*e->qepoch));
  return e->qepoch;
}

void attnd_order_push(attnd_engine_t *e, attnd_qnode_t *n, attnd_qkeys_t *ks) {
  attnd_list_insert_tail(&e->queue, &n->link);
  e->nqueued++;
  n->barrier = ks->barrier;
  if (n->barrier) {
    /* Waits for the current epoch's calls (the previous barrier among them)
     * and opens the next epoch, which every later call joins behind it. */
    attnd_qepoch_t *ep = cur_epoch(e);
    if (ep->n > 0) {
      ep->closer = n;
      n->nwait++;
    } else {
      free(ep);
    }
    e->qepoch = NULL;
    e->qbarrier = n;
  } else if (e->qbarrier) {
    add_waiter(e->qbarrier, n);
  }
  n->nkeys = ks->n;
  n->keys = NULL;
  if (ks->n) {
    n->keys = attnd_xmalloc(ks->n * sizeof(*n->keys));
    memcpy(n->keys, ks->k, ks->n * sizeof(*n->keys));
  }
  attnd_qkeys_free(ks);
  for (uint32_t i = 0; i < n->nkeys; i++) {
    attnd_idmap_t *m = key_map(e, n->keys[i].kind);
    attnd_qnode_t *prev = attnd_idmap_get(m, n->keys[i].id);
    if (prev == n)
      continue; /* a key named twice (a session twice in one call: refused at admission) */
    if (prev) {
      add_waiter(prev, n);
      attnd_idmap_del(m, n->keys[i].id);
    }
    if (attnd_idmap_put(m, n->keys[i].id, n) != 0)
      abort(); /* small bookkeeping: out of memory aborts, like attnd_xmalloc */
  }
  n->epoch = cur_epoch(e);
  n->epoch->n++;
  maybe_ready(e, n);
}

attnd_qnode_t *attnd_order_next(attnd_engine_t *e) {
  attnd_list_t *first = attnd_list_first(&e->qready);
  if (!first)
    return NULL;
  attnd_qnode_t *n = ATTND_LIST_DATA(first, attnd_qnode_t, rlink);
  attnd_list_remove(&n->rlink);
  n->ready = 0;
  return n;
}

void attnd_order_unhold(attnd_engine_t *e, attnd_qnode_t *n) {
  n->held = 0;
  maybe_ready(e, n);
}

void attnd_order_release(attnd_engine_t *e, attnd_qnode_t *n) {
  attnd_list_remove(&n->link);
  e->nqueued--;
  for (uint32_t i = 0; i < n->nkeys; i++) {
    attnd_idmap_t *m = key_map(e, n->keys[i].kind);
    if (attnd_idmap_get(m, n->keys[i].id) == n)
      attnd_idmap_del(m, n->keys[i].id);
  }
  if (e->qbarrier == n)
    e->qbarrier = NULL;
  attnd_qepoch_t *ep = n->epoch;
  if (--ep->n == 0) {
    if (ep->closer) {
      ep->closer->nwait--;
      maybe_ready(e, ep->closer);
    }
    if (ep != e->qepoch)
      free(ep);
  }
  for (uint32_t i = 0; i < n->nwaiters; i++) {
    n->waiters[i]->nwait--;
    maybe_ready(e, n->waiters[i]);
  }
  free(n->waiters);
  free(n->keys);
  n->waiters = NULL;
  n->keys = NULL;
  n->nwaiters = n->nkeys = 0;
}

void attnd_order_init(attnd_engine_t *e) {
  attnd_list_init(&e->queue);
  attnd_list_init(&e->qready);
  if (attnd_idmap_init(&e->qconn) || attnd_idmap_init(&e->qsess))
    abort();
  e->qbarrier = NULL;
  e->qepoch = NULL;
}

/* At engine close nothing is queued any more (a close waits for queued calls). */
void attnd_order_free(attnd_engine_t *e) {
  attnd_idmap_free(&e->qconn);
  attnd_idmap_free(&e->qsess);
  free(e->qepoch);
  e->qepoch = NULL;
}

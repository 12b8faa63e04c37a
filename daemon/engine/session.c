/* session.c: sessions and their state changes (docs/sessions.md): open
 * (with a prefix-cache lookup), close, fork, truncate, the idle sweep, and
 * the daemon-wide and per-identity session limits. */

#include <stdlib.h>
#include <string.h>
#include <stdio.h>

#include "internal.h"

attnd_session_t *attnd_session_new(int layers) {
  attnd_session_t *s = attnd_xcalloc(1, sizeof(*s));
  s->layers = layers;
  s->len = attnd_xcalloc((size_t)layers, sizeof(uint32_t));
  s->cons = attnd_xcalloc((size_t)layers, sizeof(uint32_t));
  s->taint = UINT32_MAX;
  attnd_list_init(&s->link);
  return s;
}

void attnd_session_free(attnd_session_t *s) {
  if (!s)
    return;
  free(s->len);
  free(s->cons);
  free(s->tokens);
  free(s->table);
  free(s);
}

void attnd_session_reserve_tokens(attnd_session_t *s, uint32_t cap) {
  if (cap <= s->tokens_cap)
    return;
  uint32_t c = s->tokens_cap ? s->tokens_cap : 64;
  while (c < cap)
    c = c > UINT32_MAX / 2 ? cap : c * 2;
  s->tokens = attnd_xrealloc(s->tokens, (size_t)c * sizeof(uint32_t));
  s->tokens_cap = c;
}

void attnd_session_reserve_table(attnd_session_t *s, uint32_t nblocks) {
  if (nblocks <= s->table_cap)
    return;
  uint32_t c = s->table_cap ? s->table_cap : 8;
  while (c < nblocks)
    c *= 2;
  s->table = attnd_xrealloc(s->table, (size_t)c * sizeof(int32_t));
  s->table_cap = c;
}

int attnd_session_lens_equal(const attnd_session_t *s) {
  for (int l = 1; l < s->layers; l++)
    if (s->len[l] != s->len[0])
      return 0;
  return 1;
}

void attnd_session_end_plan(attnd_engine_t *e, attnd_session_t *s) {
  if (s->plan)
    attnd_plan_end(e, s->plan);
}

attnd_session_t *attnd_session_get(attnd_engine_t *e, uint64_t identity, uint64_t id, int *rc,
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
  attnd_engine_answer(cb, arg, ATTND_EABORTED,
                      "session %016llx lost its KV in a backend fault; close it",
                      (unsigned long long)s->id);
  return 0;
}

/* ---- per-identity session counts (docs/sessions.md section 1) ---- */

/* The sessions an identity may hold: --max-sessions-per-identity, or a
 * quarter of --max-sessions (0: no limit, as without --max-sessions). */
static uint32_t identity_quota(const attnd_engine_t *e) {
  if (e->cfg.max_sessions_per_identity > 0)
    return (uint32_t)e->cfg.max_sessions_per_identity;
  if (e->cfg.max_sessions <= 0)
    return 0;
  return e->cfg.max_sessions / 4 > 0 ? (uint32_t)(e->cfg.max_sessions / 4) : 1;
}

static uint32_t identity_sessions(const attnd_engine_t *e, uint64_t identity) {
  if (identity == 0)
    return e->ident0_sessions;
  const uint32_t *n = attnd_idmap_get(&e->idents, identity);
  return n ? *n : 0;
}

static void identity_count(attnd_engine_t *e, uint64_t identity, int delta) {
  if (identity == 0) {
    e->ident0_sessions += (uint32_t)delta;
    return;
  }
  uint32_t *n = attnd_idmap_get(&e->idents, identity);
  if (!n) {
    n = attnd_xcalloc(1, sizeof(*n));
    if (attnd_idmap_put(&e->idents, identity, n) != 0)
      abort();
  }
  *n += (uint32_t)delta;
  if (*n == 0) {
    attnd_idmap_del(&e->idents, identity);
    free(n);
  }
}

/* 0 when identity may open one more session, else ATTND_ENOSPC (answered). */
static int session_room(attnd_engine_t *e, uint64_t identity, attnd_engine_done_cb cb, void *arg) {
  if (e->cfg.max_sessions > 0 && e->nsessions >= (uint32_t)e->cfg.max_sessions) {
    attnd_engine_answer(cb, arg, ATTND_ENOSPC, "max sessions (%d) reached", e->cfg.max_sessions);
    return ATTND_ENOSPC;
  }
  uint32_t quota = identity_quota(e);
  if (quota && identity_sessions(e, identity) >= quota) {
    attnd_engine_answer(cb, arg, ATTND_ENOSPC,
                        "this identity's session quota (%u, --max-sessions-per-identity) reached",
                        quota);
    return ATTND_ENOSPC;
  }
  return 0;
}

static attnd_session_t *session_create(attnd_engine_t *e, uint64_t identity) {
  attnd_session_t *s = attnd_session_new(e->layers);
  uint64_t id;
  do
    id = attnd_random_id();
  while (attnd_idmap_get(&e->sessions, id));
  s->id = id;
  s->identity = identity;
  s->last_used_ms = attnd_engine_now_ms(e);
  if (attnd_idmap_put(&e->sessions, id, s) != 0)
    abort();
  attnd_list_insert_head(&e->slist, &s->link);
  e->nsessions++;
  identity_count(e, identity, 1);
  return s;
}

void attnd_session_destroy(attnd_engine_t *e, attnd_session_t *s) {
  attnd_session_end_plan(e, s);
  attnd_cache_trim(e, s, 0);
  attnd_idmap_del(&e->sessions, s->id);
  attnd_list_remove(&s->link);
  e->nsessions--;
  identity_count(e, s->identity, -1);
  attnd_session_free(s);
}

/* The admissions below run on the loop thread, at once or from the admission
 * queue; the public entries (queue.c) checked what needs no state. */

int32_t attnd_session_item_flags(const attnd_session_t *s) {
  return s->base == 0 ? ATTND_ITEM_SINK : 0;
}

void attnd_session_open(attnd_engine_t *e, uint64_t identity, uint32_t base, const uint32_t *tokens,
                        uint32_t ntokens, const uint8_t *salt, size_t saltlen,
                        attnd_engine_done_cb cb, void *arg) {
  if (session_room(e, identity, cb, arg))
    return;
  attnd_session_t *s = session_create(e, identity);
  s->base = base;
  s->saltlen = (uint32_t)saltlen;
  if (saltlen)
    memcpy(s->salt, salt, saltlen);
  /* A part past 0 never looks up: its KV past layer 0 depends on tokens
   * before its base, which its block hashes cannot name. */
  uint32_t hit = base ? 0 : attnd_cache_lookup(e, s, tokens, ntokens);
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.session = s->id;
  r.cached_len = hit * e->bs;
  r.base = base;
  cb(arg, &r);
}

void attnd_session_close(attnd_engine_t *e, uint64_t identity, uint64_t session,
                         attnd_engine_done_cb cb, void *arg) {
  char msg[160];
  int rc;
  attnd_session_t *s = attnd_session_get(e, identity, session, &rc, msg, sizeof(msg));
  if (!s) {
    attnd_engine_answer(cb, arg, rc, "%s", msg);
    return;
  }
  attnd_session_destroy(e, s);
  attnd_engine_answer(cb, arg, 0, NULL);
}

/* The session a Fork or Truncate acts on, or NULL after answering why not:
 * both need a usable session of this identity with equal lengths in every layer. */
static attnd_session_t *session_for_rollback(attnd_engine_t *e, uint64_t identity, uint64_t session,
                                             attnd_engine_done_cb cb, void *arg) {
  char msg[160];
  int rc;
  attnd_session_t *s = attnd_session_get(e, identity, session, &rc, msg, sizeof(msg));
  if (!s) {
    attnd_engine_answer(cb, arg, rc, "%s", msg);
    return NULL;
  }
  if (!session_usable(s, cb, arg))
    return NULL;
  if (!attnd_session_lens_equal(s)) {
    attnd_engine_answer(cb, arg, ATTND_EPRECOND, "session %016llx: layers hold different lengths",
                        (unsigned long long)session);
    return NULL;
  }
  return s;
}

void attnd_session_fork(attnd_engine_t *e, uint64_t identity, uint64_t session,
                        attnd_engine_done_cb cb, void *arg) {
  attnd_session_t *s = session_for_rollback(e, identity, session, cb, arg);
  if (!s)
    return;
  if (session_room(e, identity, cb, arg))
    return;
  attnd_session_end_plan(e, s);
  s->last_used_ms = attnd_engine_now_ms(e);
  attnd_session_t *f = session_create(e, identity);
  f->base = s->base;
  memcpy(f->len, s->len, sizeof(uint32_t) * (size_t)e->layers);
  memcpy(f->cons, s->cons, sizeof(uint32_t) * (size_t)e->layers);
  f->taint = s->taint;
  f->saltlen = s->saltlen;
  memcpy(f->salt, s->salt, sizeof(s->salt));
  f->ntok = s->ntok;
  if (s->ntok) {
    attnd_session_reserve_tokens(f, s->ntok);
    memcpy(f->tokens, s->tokens, (size_t)s->ntok * sizeof(uint32_t));
  }
  /* Share the blocks holding positions; blocks a plan reserved past len stay
   * the parent's. */
  uint32_t nb = attnd_engine_nblocks(e, s->len[0]);
  if (nb > s->nblocks)
    nb = s->nblocks;
  attnd_session_reserve_table(f, nb);
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

void attnd_session_truncate(attnd_engine_t *e, uint64_t identity, uint64_t session, uint32_t len,
                            attnd_engine_done_cb cb, void *arg) {
  attnd_session_t *s = session_for_rollback(e, identity, session, cb, arg);
  if (!s)
    return;
  if (len < s->base || len - s->base > s->len[0]) {
    attnd_engine_answer(cb, arg, ATTND_EINVAL, "len %u outside the session's [base %u, len %u]",
                        len, s->base, s->base + s->len[0]);
    return;
  }
  len -= s->base; /* relative from here on */
  attnd_session_end_plan(e, s);
  s->last_used_ms = attnd_engine_now_ms(e);
  for (int l = 0; l < e->layers; l++) {
    s->len[l] = len;
    if (s->cons[l] > len)
      s->cons[l] = len;
  }
  if (s->ntok > len)
    s->ntok = len;
  if (s->taint >= len)
    s->taint = UINT32_MAX;
  attnd_cache_trim(e, s, attnd_engine_nblocks(e, len));
  if (s->npub > len / e->bs)
    s->npub = len / e->bs;
  attnd_engine_answer(cb, arg, 0, NULL);
}

/* ---- idle sessions ---- */

void attnd_session_idle_cb(uv_timer_t *t) {
  attnd_engine_t *e = t->data;
  uint64_t now = attnd_engine_now_ms(e), idle = (uint64_t)e->cfg.session_idle_s * 1000;
  ATTND_LIST_FOREACH(it, nx, &e->slist) {
    attnd_session_t *s = ATTND_LIST_DATA(it, attnd_session_t, link);
    /* A session a queued call names is in use: that call is admitted first
     * (and refreshes it). Destroying s also ends its plan, whose other
     * sessions a queued step of it names too, so those keep it as well. */
    if (now - s->last_used_ms >= idle && !attnd_order_names_session(e, s->id))
      attnd_session_destroy(e, s);
  }
}

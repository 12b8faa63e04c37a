/* plan.c: plans (docs/sessions.md): a Plan's items are checked and copied
 * once (sessions, positions, token ids, masks), their blocks for every layer
 * reserved at admission, and the plan stays live for its connection until a
 * newer plan takes its sessions, the connection keeps more than max_plans or
 * closes. An inline Step is a one-layer plan built the same way. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void attnd_plan_free(attnd_plan_t *p) {
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

/* Ends a plan. Its sessions may now publish the blocks it was writing (a
 * live plan keeps its range unpublished, see attnd_cache_publish()). */
void attnd_plan_end(attnd_engine_t *e, attnd_plan_t *p) {
  for (uint32_t i = 0; i < p->nitems; i++)
    if (p->items[i].s && p->items[i].s->plan == p) {
      p->items[i].s->plan = NULL;
      attnd_cache_publish(e, p->items[i].s);
    }
  attnd_idmap_del(&e->plans, p->id);
  attnd_list_remove(&p->link);
  e->nplans--;
  attnd_plan_free(p);
}

/* The kernel mask of one item (checked: the RPC layer built it from the
 * wire, but the engine takes nothing on trust). Masks come in their absolute
 * form (docs/scale-out.md); the kernels see positions relative to the
 * session's base, so a prefix length and custom intervals are shifted by it
 * (causal, full and sliding masks do not change under the shift; keys before
 * base are absent). kv_len is absolute. An attend-only item keeps its
 * intervals absolute: the step cuts out the columns the session holds. */
static int item_mask(attnd_pitem_t *pi, const attnd_mask_t *m, uint32_t i, uint64_t kv_len,
                     uint32_t base, char *msg, size_t msglen) {
  pi->kmask = (int32_t)m->kind;
  pi->mask_param = 0;
  pi->causal = 1;
  switch (m->kind) {
  case ATTND_MASK_CAUSAL:
    pi->plain_causal = 1;
    return 0;
  case ATTND_MASK_FULL:
    return 0;
  case ATTND_MASK_SLIDING:
    if (m->param < 1) {
      snprintf(msg, msglen, "item %u: sliding window must be >= 1", i);
      return ATTND_EINVAL;
    }
    pi->mask_param = m->param;
    return 0;
  case ATTND_MASK_PREFIX_LM:
    pi->mask_param = m->param > (int32_t)base ? m->param - (int32_t)base : 0;
    return 0;
  case ATTND_MASK_INTERVALS:
    if (!m->intervals || m->intervals_len != kv_len) {
      snprintf(msg, msglen, "item %u: intervals must be INT32 [4, %llu]", i,
               (unsigned long long)kv_len);
      return ATTND_EINVAL;
    }
    for (uint64_t j = 0; j < kv_len; j++) {
      const int32_t *iv = m->intervals;
      if (iv[j] > iv[kv_len + j] || iv[2 * kv_len + j] > iv[3 * kv_len + j]) {
        snprintf(msg, msglen, "item %u: interval of key %llu has start > end", i,
                 (unsigned long long)j);
        return ATTND_EINVAL;
      }
    }
    pi->causal = m->causal != 0;
    if (pi->q_only || base == 0) {
      pi->intervals = attnd_xcalloc(4 * kv_len, sizeof(int32_t));
      memcpy(pi->intervals, m->intervals, 16 * kv_len);
      return 0;
    }
    {
      /* Columns base.. of the absolute intervals, rows shifted by base
       * (clamped at 0: rows are >= 0, so a bound below 0 acts as 0). */
      uint64_t rl = kv_len - base;
      pi->intervals = attnd_xcalloc(4 * rl, sizeof(int32_t));
      for (int r = 0; r < 4; r++)
        for (uint64_t j = 0; j < rl; j++) {
          int64_t x = (int64_t)m->intervals[(uint64_t)r * kv_len + base + j] - base;
          pi->intervals[(uint64_t)r * rl + j] = (int32_t)(x < 0 ? 0 : x);
        }
    }
    return 0;
  }
  snprintf(msg, msglen, "item %u: unknown mask kind %d", i, (int)m->kind);
  return ATTND_EINVAL;
}

/* Checks item i against its session and copies it into pi; 0, or an
 * error with msg naming the item. gen marks the sessions of this call. */
static int build_item(attnd_engine_t *e, uint64_t identity, uint64_t gen, uint32_t i,
                      const attnd_item_t *it, attnd_pitem_t *pi, char *msg, size_t msglen) {
  attnd_session_t *s = attnd_idmap_get(&e->sessions, it->session);
  if (!s) {
    snprintf(msg, msglen, "item %u: session %016llx not found", i, (unsigned long long)it->session);
    return ATTND_ENOTFOUND;
  }
  if (s->identity != identity) {
    snprintf(msg, msglen, "item %u: session %016llx belongs to another identity", i,
             (unsigned long long)it->session);
    return ATTND_EPERM;
  }
  if (s->broken) {
    snprintf(msg, msglen, "item %u: session %016llx lost its KV in a backend fault; close it", i,
             (unsigned long long)it->session);
    return ATTND_EABORTED;
  }
  if (s->mark == gen) {
    snprintf(msg, msglen, "item %u: session %016llx appears twice", i,
             (unsigned long long)it->session);
    return ATTND_EINVAL;
  }
  s->mark = gen;
  if (it->n < 1) {
    snprintf(msg, msglen, "item %u: n must be >= 1", i);
    return ATTND_EINVAL;
  }
  uint64_t kv_len = (uint64_t)it->start + it->n;
  if (kv_len > (uint64_t)e->cfg.max_context) {
    snprintf(msg, msglen, "item %u: start+n %llu > max_context %d", i, (unsigned long long)kv_len,
             e->cfg.max_context);
    return ATTND_ERANGE;
  }
  if (it->start < s->base) {
    snprintf(msg, msglen, "item %u: start %u < the session's base %u", i, it->start, s->base);
    return ATTND_EINVAL;
  }
  uint32_t rel = it->start - s->base; /* positions relative to base from here on */
  if (it->q_only) {
    if (it->kv_only) {
      snprintf(msg, msglen, "item %u: q_only and kv_only together", i);
      return ATTND_EINVAL;
    }
    if (it->ntokens) {
      snprintf(msg, msglen, "item %u: q_only items carry no token ids (%u given)", i, it->ntokens);
      return ATTND_EINVAL;
    }
    if (rel < s->len[0]) {
      snprintf(msg, msglen,
               "item %u: q_only start %u < len %u (attend-only rows follow the keys "
               "the session holds)",
               i, it->start, s->base + s->len[0]);
      return ATTND_EINVAL;
    }
  } else {
    if (rel > s->len[0]) {
      snprintf(msg, msglen, "item %u: start %u > len %u", i, it->start, s->base + s->len[0]);
      return ATTND_EINVAL;
    }
    if (!it->tokens || it->ntokens != it->n) {
      snprintf(msg, msglen, "item %u: %u token ids for n = %u", i, it->tokens ? it->ntokens : 0,
               it->n);
      return ATTND_EINVAL;
    }
  }
  pi->s = s;
  pi->start = rel;
  pi->n = it->n;
  pi->has_q = !it->kv_only;
  pi->q_only = it->q_only != 0;
  int rc = item_mask(pi, &it->mask, i, kv_len, s->base, msg, msglen);
  if (rc)
    return rc;
  if (!pi->q_only) {
    pi->tokens = attnd_xcalloc(it->n, sizeof(uint32_t));
    memcpy(pi->tokens, it->tokens, (size_t)it->n * sizeof(uint32_t));
  }
  return 0;
}

int attnd_plan_build(attnd_engine_t *e, uint64_t identity, const attnd_item_t *items,
                     uint32_t nitems, attnd_plan_t **out, char *msg, size_t msglen) {
  if (nitems == 0 || !items) {
    snprintf(msg, msglen, "no items");
    return ATTND_EINVAL;
  }
  attnd_plan_t *p = attnd_xcalloc(1, sizeof(*p));
  attnd_list_init(&p->link);
  p->items = attnd_xcalloc(nitems, sizeof(attnd_pitem_t));
  p->nitems = nitems;
  p->identity = identity;
  uint64_t gen = ++e->gen;
  for (uint32_t i = 0; i < nitems; i++) {
    int rc = build_item(e, identity, gen, i, &items[i], &p->items[i], msg, msglen);
    if (rc) {
      attnd_plan_free(p);
      return rc;
    }
    if (!p->items[i].q_only)
      p->T += items[i].n;
    if (p->items[i].has_q)
      p->Tq += items[i].n;
  }
  *out = p;
  return 0;
}

void attnd_plan_admit(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                      const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                      void *arg) {
  char msg[200];
  attnd_plan_t *p = NULL;
  int rc = attnd_plan_build(e, identity, items, nitems, &p, msg, sizeof(msg));
  if (rc) {
    attnd_engine_answer(cb, arg, rc, "%s", msg);
    return;
  }
  attnd_cowlist_t cow = {0};
  if ((rc = attnd_cache_reserve(e, p, &cow, msg, sizeof(msg))) != 0) {
    attnd_plan_free(p);
    attnd_engine_answer(cb, arg, rc, "%s", msg);
    return;
  }
  attnd_cache_submit_cow(e, &cow);
  p->conn = conn;
  p->live = 1;
  p->stepped = attnd_xcalloc((size_t)e->layers, 1);
  do
    p->id = attnd_random_id();
  while (attnd_idmap_get(&e->plans, p->id));
  /* The new plan takes its sessions first, then the plans it replaces end:
   * so their ending publishes nothing in the range the new plan writes. */
  attnd_plan_t **old = attnd_xcalloc(p->nitems, sizeof(attnd_plan_t *));
  uint32_t nold = 0;
  for (uint32_t i = 0; i < p->nitems; i++) {
    attnd_session_t *s = p->items[i].s;
    attnd_plan_t *o = s->plan;
    int seen = 0;
    for (uint32_t k = 0; k < nold; k++)
      seen |= old[k] == o;
    if (o && !seen)
      old[nold++] = o;
    s->plan = p;
    s->last_used_ms = attnd_engine_now_ms(e);
  }
  for (uint32_t k = 0; k < nold; k++)
    attnd_plan_end(e, old[k]);
  free(old);
  attnd_idmap_put(&e->plans, p->id, p);
  attnd_list_insert_tail(&e->plist, &p->link);
  e->nplans++;
  /* A connection holds at most max_plans live plans; the oldest ends first. */
  int maxp = e->cfg.max_plans > 0 ? e->cfg.max_plans : 64;
  int count = 0;
  ATTND_LIST_FOREACH(it, nx, &e->plist)
  count += ATTND_LIST_DATA(it, attnd_plan_t, link)->conn == conn;
  ATTND_LIST_FOREACH(it, nx, &e->plist) {
    attnd_plan_t *q = ATTND_LIST_DATA(it, attnd_plan_t, link);
    if (count <= maxp)
      break;
    if (q->conn == conn && q != p) {
      attnd_plan_end(e, q);
      count--;
    }
  }
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.plan = p->id;
  cb(arg, &r);
}

void attnd_plan_conn_closed(attnd_engine_t *e, uint64_t conn) {
  ATTND_LIST_FOREACH(it, nx, &e->plist) {
    attnd_plan_t *q = ATTND_LIST_DATA(it, attnd_plan_t, link);
    if (q->conn == conn)
      attnd_plan_end(e, q);
  }
}

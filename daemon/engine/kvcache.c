/* kvcache.c: the engine's side of the KV cache (internal.h): reserving the
 * blocks a write needs (new ones, private copies of shared or published
 * ones: copy-on-write, submitted as COPY jobs for every layer), publishing
 * full consistent blocks to the prefix index, and looking a new session's
 * prompt up in it (docs/sessions.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- reservation and copy-on-write ---- */

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

/* Gives s private blocks for positions [start, start+n) (nfree suffices). */
static void reserve(attnd_engine_t *e, attnd_session_t *s, uint32_t start, uint32_t n,
                    attnd_cowlist_t *cow) {
  uint32_t b0 = start / e->bs, b1 = (start + n - 1) / e->bs;
  attnd_session_reserve_table(s, b1 + 1);
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
      cow->pairs = attnd_xrealloc(cow->pairs, 2 * cow->cap * sizeof(int32_t));
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

/* Each copy job references both blocks of every pair. Consumes the extra ref
 * reserve() took on old. */
void attnd_cache_submit_cow(attnd_engine_t *e, attnd_cowlist_t *cow) {
  if (cow->n == 0)
    return;
  for (int l = 0; l < e->layers; l++) {
    attnd_ejob_t *j = attnd_ejob_new(e, EJ_COPY, l);
    j->copies = attnd_xcalloc(2 * cow->n, sizeof(int32_t));
    memcpy(j->copies, cow->pairs, 2 * cow->n * sizeof(int32_t));
    j->job.copies = j->copies;
    j->job.ncopies = (int)cow->n;
    j->refs = attnd_xcalloc(2 * cow->n, sizeof(int32_t));
    for (uint32_t i = 0; i < 2 * cow->n; i++) {
      j->refs[i] = cow->pairs[i];
      attnd_blocks_ref(&e->pool, cow->pairs[i], 0);
    }
    j->nrefs = 2 * cow->n;
    attnd_sched_reserve(j, cow->n, cow->n);
    for (uint32_t i = 0; i < cow->n; i++) {
      attnd_sched_read(j, cow->pairs[2 * i]);
      attnd_sched_write(j, cow->pairs[2 * i + 1]);
    }
    attnd_ejob_submit(e, j);
  }
  for (uint32_t i = 0; i < cow->n; i++)
    attnd_blocks_unref(&e->pool, cow->pairs[2 * i], 0);
  free(cow->pairs);
  cow->pairs = NULL;
  cow->n = cow->cap = 0;
}

int attnd_cache_reserve(attnd_engine_t *e, attnd_plan_t *p, attnd_cowlist_t *cow, char *msg,
                        size_t msglen) {
  uint64_t need = 0;
  for (uint32_t i = 0; i < p->nitems; i++)
    if (!p->items[i].q_only) /* attend-only items write nothing */
      need += blocks_needed(e, p->items[i].s, p->items[i].start, p->items[i].n);
  if (need > e->pool.n || ensure_free(e, (uint32_t)need) != 0) {
    snprintf(msg, msglen, "KV pool exhausted: %llu blocks needed, %u free after eviction",
             (unsigned long long)need, e->pool.nfree);
    return ATTND_ENOSPC;
  }
  for (uint32_t i = 0; i < p->nitems; i++)
    if (!p->items[i].q_only)
      reserve(e, p->items[i].s, p->items[i].start, p->items[i].n, cow);
  return 0;
}

/* ---- publication and lookup ---- */

static attnd_h128_t parent_hash(attnd_engine_t *e, const attnd_session_t *s, uint32_t b) {
  attnd_h128_t z = {0, 0};
  return b == 0 ? z : attnd_prefix_block_hash(e->px, s->table[b - 1]);
}

void attnd_cache_publish(attnd_engine_t *e, attnd_session_t *s) {
  /* A split-context part past 0 publishes nothing (docs/scale-out.md): its
   * blocks' KV depends on tokens before its base. */
  if (!e->cfg.prefix_cache || s->base)
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
  const attnd_plan_t *lp = s->plan;
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

uint32_t attnd_cache_lookup(attnd_engine_t *e, attnd_session_t *s, const uint32_t *tokens,
                            uint32_t ntokens) {
  if (!e->cfg.prefix_cache || !tokens || ntokens == 0)
    return 0;
  /* Only whole blocks before the last token: the last position must be
   * computed for its output. */
  uint32_t maxb = (ntokens - 1) / e->bs, hit = 0;
  if ((uint64_t)maxb * e->bs > (uint64_t)e->cfg.max_context)
    maxb = (uint32_t)(e->cfg.max_context / e->bs);
  attnd_session_reserve_table(s, maxb);
  attnd_h128_t ph = {0, 0};
  int32_t parent = -1;
  while (hit < maxb) {
    const uint32_t *tok = &tokens[(size_t)hit * e->bs];
    attnd_h128_t h = attnd_prefix_hash(e->px, ph, s->identity, s->salt, s->saltlen, tok);
    int32_t id = attnd_prefix_find(e->px, h, parent, s->identity, s->salt, s->saltlen, tok);
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
    attnd_session_reserve_tokens(s, cached);
    memcpy(s->tokens, tokens, (size_t)cached * sizeof(uint32_t));
  }
  for (int l = 0; l < e->layers; l++)
    s->len[l] = s->cons[l] = cached;
  s->ntok = cached;
  s->npub = hit;
  return hit;
}

void attnd_cache_trim(attnd_engine_t *e, attnd_session_t *s, uint32_t keep) {
  while (s->nblocks > keep)
    attnd_blocks_unref(&e->pool, s->table[--s->nblocks], 1);
  if (s->npub > keep)
    s->npub = keep;
}

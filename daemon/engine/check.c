/* check.c: attnd_engine_check (engine.h), the bookkeeping checker the tests
 * and the fuzzer run after every call: the pool's invariants, every block's
 * table references against the sessions' block tables, published prefixes
 * and, with nothing in flight, that only tables hold blocks. */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

int attnd_engine_check(attnd_engine_t *e, char *err, size_t errlen) {
  if (attnd_blocks_check(&e->pool, err, errlen) != 0)
    return -1;
  int32_t *tab = attnd_xcalloc(e->pool.n, sizeof(int32_t));
  int rc = -1;
  uint32_t nsess = 0;
  ATTND_LIST_FOREACH(it, nx, &e->slist) {
    const attnd_session_t *s = ATTND_LIST_DATA(it, attnd_session_t, link);
    nsess++;
    if (attnd_idmap_get(&e->sessions, s->id) != s) {
      snprintf(err, errlen, "session %016llx not in the map", (unsigned long long)s->id);
      goto out;
    }
    for (int l = 0; l < e->layers; l++) {
      if (attnd_engine_nblocks(e, s->len[l]) > s->nblocks || s->cons[l] > s->len[l]) {
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

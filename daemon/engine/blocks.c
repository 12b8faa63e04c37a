/* blocks.c: the block pool: free list, reference counts and the LRU of
 * cached blocks (internal.h). */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int attnd_blocks_init(attnd_blocks_t *p, uint32_t n) {
  memset(p, 0, sizeof(*p));
  p->b = calloc(n ? n : 1, sizeof(*p->b));
  p->freestack = malloc((n ? n : 1) * sizeof(*p->freestack));
  if (!p->b || !p->freestack) {
    free(p->b);
    free(p->freestack);
    return ATTND_ENOMEM;
  }
  p->n = n;
  /* Low ids on top so a fresh pool hands out 0, 1, 2, ... (readable tests). */
  for (uint32_t i = 0; i < n; i++) {
    p->freestack[i] = (int32_t)(n - 1 - i);
    p->b[i].prev = p->b[i].next = -1;
  }
  p->nfree = n;
  p->lru_head = p->lru_tail = -1;
  return 0;
}

void attnd_blocks_free(attnd_blocks_t *p) {
  free(p->b);
  free(p->freestack);
  memset(p, 0, sizeof(*p));
}

static void lru_remove(attnd_blocks_t *p, int32_t id) {
  attnd_block_t *b = &p->b[id];
  if (b->prev >= 0)
    p->b[b->prev].next = b->next;
  else
    p->lru_head = b->next;
  if (b->next >= 0)
    p->b[b->next].prev = b->prev;
  else
    p->lru_tail = b->prev;
  b->prev = b->next = -1;
  p->nlru--;
}

static void lru_push_tail(attnd_blocks_t *p, int32_t id) {
  attnd_block_t *b = &p->b[id];
  b->prev = p->lru_tail;
  b->next = -1;
  if (p->lru_tail >= 0)
    p->b[p->lru_tail].next = id;
  else
    p->lru_head = id;
  p->lru_tail = id;
  p->nlru++;
  b->where = ATTND_BLK_LRU;
}

static void push_free(attnd_blocks_t *p, int32_t id) {
  p->b[id].where = ATTND_BLK_FREE;
  p->b[id].nchildren = 0;
  p->freestack[p->nfree++] = id;
}

int32_t attnd_blocks_alloc(attnd_blocks_t *p, int table) {
  if (p->nfree == 0)
    return -1;
  int32_t id = p->freestack[--p->nfree];
  attnd_block_t *b = &p->b[id];
  b->ref = 1;
  b->tabref = table ? 1 : 0;
  b->nchildren = 0;
  b->published = 0;
  b->where = ATTND_BLK_USED;
  return id;
}

void attnd_blocks_ref(attnd_blocks_t *p, int32_t id, int table) {
  attnd_block_t *b = &p->b[id];
  if (b->where == ATTND_BLK_LRU) {
    lru_remove(p, id);
    b->where = ATTND_BLK_USED;
  }
  b->ref++;
  if (table)
    b->tabref++;
}

void attnd_blocks_unref(attnd_blocks_t *p, int32_t id, int table) {
  attnd_block_t *b = &p->b[id];
  if (table)
    b->tabref--;
  if (--b->ref > 0)
    return;
  if (b->published)
    lru_push_tail(p, id);
  else
    push_free(p, id);
}

void attnd_blocks_set_published(attnd_blocks_t *p, int32_t id, int published) {
  attnd_block_t *b = &p->b[id];
  b->published = (uint8_t)(published != 0);
  if (!published && b->where == ATTND_BLK_LRU) {
    lru_remove(p, id);
    push_free(p, id);
  }
}

int32_t attnd_blocks_lru_leaf(const attnd_blocks_t *p) {
  for (int32_t id = p->lru_head; id >= 0; id = p->b[id].next)
    if (p->b[id].nchildren == 0)
      return id;
  return -1;
}

uint32_t attnd_blocks_used(const attnd_blocks_t *p) {
  return p->n - p->nfree - p->nlru;
}

int attnd_blocks_check(const attnd_blocks_t *p, char *err, size_t errlen) {
  uint8_t *seen = calloc(p->n ? p->n : 1, 1);
  int rc = -1;
  if (!seen) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  for (uint32_t i = 0; i < p->nfree; i++) {
    int32_t id = p->freestack[i];
    if (id < 0 || (uint32_t)id >= p->n || seen[id]) {
      snprintf(err, errlen, "free list entry %u (block %d) invalid or repeated", i, id);
      goto out;
    }
    seen[id] = 1;
    const attnd_block_t *b = &p->b[id];
    if (b->where != ATTND_BLK_FREE || b->ref != 0 || b->tabref != 0 || b->published) {
      snprintf(err, errlen, "free block %d: where %d ref %d tabref %d published %d", id, b->where,
               b->ref, b->tabref, b->published);
      goto out;
    }
  }
  uint32_t nl = 0;
  int32_t prev = -1;
  for (int32_t id = p->lru_head; id >= 0; id = p->b[id].next) {
    if ((uint32_t)id >= p->n || seen[id] || nl > p->n) {
      snprintf(err, errlen, "LRU list broken at block %d", id);
      goto out;
    }
    seen[id] = 2;
    const attnd_block_t *b = &p->b[id];
    if (b->where != ATTND_BLK_LRU || b->ref != 0 || !b->published || b->prev != prev) {
      snprintf(err, errlen, "LRU block %d: where %d ref %d published %d", id, b->where, b->ref,
               b->published);
      goto out;
    }
    prev = id;
    nl++;
  }
  if (nl != p->nlru || prev != p->lru_tail) {
    snprintf(err, errlen, "LRU count %u != %u or tail mismatch", nl, p->nlru);
    goto out;
  }
  for (uint32_t id = 0; id < p->n; id++) {
    const attnd_block_t *b = &p->b[id];
    if (seen[id])
      continue;
    if (b->where != ATTND_BLK_USED || b->ref <= 0 || b->tabref < 0 || b->tabref > b->ref) {
      snprintf(err, errlen, "block %u: where %d ref %d tabref %d", id, b->where, b->ref, b->tabref);
      goto out;
    }
  }
  rc = 0;
out:
  free(seen);
  return rc;
}

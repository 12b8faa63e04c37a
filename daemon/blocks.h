/* blocks.h: the KV block pool's bookkeeping (DESIGN.md section 6).
 *
 * The backend owns the memory of the blocks (all layers); this module owns who
 * holds which physical block id. A block is in exactly one of three places:
 *
 *   free  - on the free list, ref == 0, not published;
 *   used  - ref > 0 (block tables of sessions and in-flight jobs hold it);
 *   lru   - ref == 0 but published in the prefix index, so it stays cached
 *           until evicted; kept in least-recently-used order (head oldest).
 *
 * ref counts every holder (block-table entries and in-flight jobs); tabref
 * counts only block-table entries, so the engine can tell a block shared by two
 * sessions (copy-on-write needed) from one merely read by a running job.
 * nchildren counts published blocks whose parent in the prefix tree is this
 * block: only blocks with nchildren == 0 (leaves) may be evicted, so a cached
 * chain is always reachable from its root. */
#ifndef ATTND_BLOCKS_H
#define ATTND_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

enum { ATTND_BLK_FREE = 0, ATTND_BLK_USED = 1, ATTND_BLK_LRU = 2 };

typedef struct {
  int32_t ref;
  int32_t tabref;
  int32_t nchildren;
  uint8_t published;
  uint8_t where;      /* ATTND_BLK_* */
  int32_t prev, next; /* LRU links, -1 at the ends */
} attnd_block_t;

typedef struct {
  uint32_t n;
  attnd_block_t *b;
  int32_t *freestack; /* free ids, top at nfree - 1 */
  uint32_t nfree;
  int32_t lru_head, lru_tail; /* head: least recently used */
  uint32_t nlru;
} attnd_blocks_t;

int attnd_blocks_init(attnd_blocks_t *p, uint32_t n);
void attnd_blocks_free(attnd_blocks_t *p);

/* Takes a block from the free list with ref = 1 (tabref = table ? 1 : 0);
 * returns its id, or -1 when the free list is empty (evict first). */
int32_t attnd_blocks_alloc(attnd_blocks_t *p, int table);
/* Adds a holder; a block in the LRU becomes used again. */
void attnd_blocks_ref(attnd_blocks_t *p, int32_t id, int table);
/* Drops a holder. At ref 0 a published block goes to the LRU tail (most
 * recently used), any other block back to the free list. */
void attnd_blocks_unref(attnd_blocks_t *p, int32_t id, int table);
/* Marks a block published or not. Unpublishing an unreferenced block frees it. */
void attnd_blocks_set_published(attnd_blocks_t *p, int32_t id, int published);
/* The least recently used LRU block with no children, or -1. */
int32_t attnd_blocks_lru_leaf(const attnd_blocks_t *p);

/* Blocks a caller could obtain now: free ones plus every cached one (evicting
 * leaves repeatedly frees whole chains). */
static inline uint32_t attnd_blocks_available(const attnd_blocks_t *p) {
  return p->nfree + p->nlru;
}
uint32_t attnd_blocks_used(const attnd_blocks_t *p);

/* Checks the invariants (free list, LRU list, refs, places); 0 or -1 with a
 * reason in err. For tests and debug builds. */
int attnd_blocks_check(const attnd_blocks_t *p, char *err, size_t errlen);

#endif /* ATTND_BLOCKS_H */

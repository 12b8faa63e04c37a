/* prefix.h: the prefix index of published KV blocks (DESIGN.md section 6,
 * issue "prefix caching").
 *
 * Block identity: h_i = XXH3_128(h_{i-1}, fingerprint, identity, salt, token ids
 * of block i), h_{-1} = 0. The fingerprint covers the model shape, model_id,
 * kv cache type, block size and the static-scale versions of all layers, so a
 * change of any of them makes older blocks unreachable. A lookup never trusts
 * the hash alone: a hit must also match the stored parent block, fingerprint,
 * identity, salt and token ids. Entries with equal hashes chain in one bucket,
 * so a collision costs a compare, never a wrong hit.
 *
 * Published blocks are immutable (the engine copies before writing them). They
 * stay in the index while referenced and, once unreferenced, in the block
 * pool's LRU until evicted; eviction takes the least recently used leaf. */
#ifndef ATTND_PREFIX_H
#define ATTND_PREFIX_H

#include <stddef.h>
#include <stdint.h>

#include "attnd_kernels.h"
#include "blocks.h"

typedef struct {
  uint64_t lo, hi;
} attnd_h128_t;

typedef struct attnd_prefix_s attnd_prefix_t;

#define ATTND_PREFIX_MAX_SALT 64

/* The index for a pool of blocks of block_size tokens. */
int attnd_prefix_init(attnd_prefix_t **out, attnd_blocks_t *pool, uint32_t block_size);
void attnd_prefix_free(attnd_prefix_t *px);

/* Fingerprint of the model and cache configuration. versions: [layers]. */
attnd_h128_t attnd_prefix_fingerprint(const attnd_kshape_t *s, int layers, const char *model_id,
                                      const uint64_t *versions);
void attnd_prefix_set_fingerprint(attnd_prefix_t *px, attnd_h128_t fp);

/* h_i for a block with parent hash `parent` (zero for the first block). */
attnd_h128_t attnd_prefix_hash(const attnd_prefix_t *px, attnd_h128_t parent, uint64_t identity,
                               const uint8_t *salt, size_t saltlen, const uint32_t *tokens);
/* The published block continuing `parent` (-1: root) with these tokens, or -1.
 * Does not take a reference. */
int32_t attnd_prefix_find(const attnd_prefix_t *px, attnd_h128_t h, int32_t parent,
                          uint64_t identity, const uint8_t *salt, size_t saltlen,
                          const uint32_t *tokens);
/* Publishes block id. If an equal block is already published, nothing changes
 * and that block's id is returned; if id itself is published under another
 * chain, -1; else id. */
int32_t attnd_prefix_publish(attnd_prefix_t *px, int32_t id, attnd_h128_t h, int32_t parent,
                             uint64_t identity, const uint8_t *salt, size_t saltlen,
                             const uint32_t *tokens);
/* The stored hash of a published block. */
attnd_h128_t attnd_prefix_block_hash(const attnd_prefix_t *px, int32_t id);
/* Evicts the least recently used unreferenced leaf; 1 when one was evicted. */
int attnd_prefix_evict_one(attnd_prefix_t *px);
/* Removes every block from the index (unreferenced ones are freed). */
void attnd_prefix_drop_all(attnd_prefix_t *px);
/* Published blocks in the index (referenced or not). */
uint32_t attnd_prefix_count(const attnd_prefix_t *px);

/* Test hook: when nonzero every block hash is this constant, so lookups must
 * rely on the token comparison. Never set outside tests. */
extern int attnd_prefix_test_force_collision;

#endif /* ATTND_PREFIX_H */

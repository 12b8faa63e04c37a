/* internal_tables.h: the engine's tables, private to engine/ (internal.h
 * includes it): the KV block pool's bookkeeping (blocks.c), the prefix index
 * (prefix.c), the static scales (scales.c, scales_file.c) and the attention
 * sinks (sinks.c). Split from internal.h by concern; seen only by engine/'s
 * own files. */
#ifndef ATTND_ENGINE_INTERNAL_TABLES_H
#define ATTND_ENGINE_INTERNAL_TABLES_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "attnd_kernels.h"
#include "backend.h"
#include "base.h"
#include "config.h"
#include "engine.h"

/* ---- blocks.c: the KV block pool's bookkeeping ------------------------------
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

/* ---- prefix.c: the prefix index of published KV blocks ----------------------
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
/* fp hashed together with more identity (the per-layer attention variants). */
attnd_h128_t attnd_prefix_fingerprint_mix(attnd_h128_t fp, const void *data, size_t len);
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

/* ---- scales.c, scales_file.c: static quantization scales per layer -----------
 *
 * int8/fp8 take fp32 scales per kv head [kv_heads] or per channel
 * [kv_heads, head_dim]; int4 takes per-channel scales and zero points in
 * [0, 15]. Scales must be finite and > 0. Types without static scales (bf16,
 * fp16, the dynamic types) accept no SetScales at all, and zero points are
 * refused for every type but int4, so no code path ever holds a scale or zero
 * point its type does not have (docs/numerics.md).
 *
 * Every accepted SetScales gets a version, larger than every version before it
 * (across restarts too). The whole table is persisted as one file,
 * <state_dir>/scales.bin, written atomically: temp file, fsync, rename, fsync
 * of the directory. The file names the held kv head range and the model's kv
 * heads; a file whose shape or range does not match is ignored (its scales
 * are another shard's heads), so static-scale steps fail FAILED_PRECONDITION
 * until SetScales gives this daemon its own. */
typedef struct {
  int present;
  int per_channel;
  uint64_t version;
  float *k_scale, *v_scale; /* [kv_heads] or [kv_heads][head_dim] */
  float *k_zero, *v_zero;   /* int4 only, else NULL */
} attnd_layer_scales_t;

typedef struct {
  int layers, kv_heads, head_dim;
  int kv_head_begin, model_kv_heads; /* the held range [begin, begin + kv_heads) of
                                      * the model's heads (docs/scale-out.md) */
  attnd_kv_type_t kv;
  attnd_layer_scales_t *l; /* [layers] */
  uint64_t last_version;
  char path[512]; /* empty: no persistence */
} attnd_scales_t;

/* state_dir NULL or "" disables persistence. */
int attnd_scales_init(attnd_scales_t *s, const attnd_kshape_t *shape, int layers,
                      const char *state_dir);
void attnd_scales_free(attnd_scales_t *s);

/* Checks a SetScales request; on error returns ATTND_EINVAL with a reason. */
int attnd_scales_validate(const attnd_scales_t *s, const attnd_scales_req_t *req, char *msg,
                          size_t msglen);
/* Installs a validated request and returns its new version. */
uint64_t attnd_scales_apply(attnd_scales_t *s, const attnd_scales_req_t *req);
/* Versions of all layers (0 where none) into v[layers]. */
void attnd_scales_versions(const attnd_scales_t *s, uint64_t *v);

/* Serializes the whole table (malloc'ed buffer). */
int attnd_scales_serialize(const attnd_scales_t *s, uint8_t **buf, size_t *len);
/* Writes buf to path atomically and durably. Blocking: call off the loop. */
int attnd_scales_write_file(const char *path, const uint8_t *buf, size_t len);
/* Restores from s->path: 0 (restored or no file), 1 (file ignored: other shape
 * or corrupt, reason in err), or a negative ATTND_E*. */
int attnd_scales_load(attnd_scales_t *s, char *err, size_t errlen);

/* ---- sinks.c: attention sink logits per layer ------------------------------
 *
 * With attention-sinks on, every layer takes fp32 [q_heads] finite logits by
 * SetSinks; until a layer has them its steps fail FAILED_PRECONDITION. Every
 * accepted SetSinks gets a version, larger than every version before it
 * (across restarts too); the table is persisted as <state_dir>/sinks.bin
 * (written like scales.bin) and restored at start; its versions enter the
 * prefix fingerprint. Off: no table, SetSinks is INVALID_ARGUMENT. */
typedef struct {
  int present;
  uint64_t version;
  float *v; /* [q_heads] */
} attnd_layer_sinks_t;

typedef struct {
  int enabled, layers, q_heads;
  attnd_layer_sinks_t *l; /* [layers]; NULL when off */
  uint64_t last_version;
  char path[512]; /* empty: no persistence */
} attnd_sinks_t;

int attnd_sinks_init(attnd_sinks_t *s, int enabled, int layers, int q_heads, const char *state_dir);
void attnd_sinks_free(attnd_sinks_t *s);
/* Checks a SetSinks request; on error returns ATTND_EINVAL with a reason. */
int attnd_sinks_validate(const attnd_sinks_t *s, const attnd_sinks_req_t *req, char *msg,
                         size_t msglen);
/* Installs a validated request and returns its new version. */
uint64_t attnd_sinks_apply(attnd_sinks_t *s, const attnd_sinks_req_t *req);
int attnd_sinks_serialize(const attnd_sinks_t *s, uint8_t **buf, size_t *len);
/* Restores from s->path: 0 (restored or no file), 1 (ignored, reason in err),
 * or a negative ATTND_E*. */
int attnd_sinks_load(attnd_sinks_t *s, char *err, size_t errlen);

#endif /* ATTND_ENGINE_INTERNAL_TABLES_H */

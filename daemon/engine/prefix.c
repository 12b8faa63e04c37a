/* prefix.c: the chained-hash index of published blocks, keyed by xxh3-128
 * (internal.h). */

#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "internal.h"

int attnd_prefix_test_force_collision = 0;

typedef struct {
  attnd_h128_t h;
  attnd_h128_t fp;
  int32_t parent; /* -1: first block of a sequence */
  int32_t next;   /* next entry in the same bucket */
  uint64_t identity;
  uint8_t saltlen;
  uint8_t salt[ATTND_PREFIX_MAX_SALT];
} entry_t;

struct attnd_prefix_s {
  attnd_blocks_t *pool;
  uint32_t bs;
  attnd_h128_t fp;
  entry_t *ent;      /* [pool->n] */
  uint32_t *tokens;  /* [pool->n][bs] */
  int32_t *bucket;   /* [nbuckets] heads */
  uint32_t nbuckets; /* power of two */
  uint32_t count;
};

int attnd_prefix_init(attnd_prefix_t **out, attnd_blocks_t *pool, uint32_t block_size) {
  attnd_prefix_t *px = calloc(1, sizeof(*px));
  if (!px)
    return ATTND_ENOMEM;
  uint32_t n = pool->n ? pool->n : 1;
  px->pool = pool;
  px->bs = block_size;
  px->nbuckets = 16;
  while (px->nbuckets < 2 * n)
    px->nbuckets <<= 1;
  px->ent = calloc(n, sizeof(*px->ent));
  px->tokens = calloc((size_t)n * block_size, sizeof(uint32_t));
  px->bucket = malloc(px->nbuckets * sizeof(int32_t));
  if (!px->ent || !px->tokens || !px->bucket) {
    attnd_prefix_free(px);
    return ATTND_ENOMEM;
  }
  for (uint32_t i = 0; i < px->nbuckets; i++)
    px->bucket[i] = -1;
  *out = px;
  return 0;
}

void attnd_prefix_free(attnd_prefix_t *px) {
  if (!px)
    return;
  free(px->ent);
  free(px->tokens);
  free(px->bucket);
  free(px);
}

static attnd_h128_t to_h(XXH128_hash_t x) {
  attnd_h128_t h = {x.low64, x.high64};
  return h;
}

attnd_h128_t attnd_prefix_fingerprint(const attnd_kshape_t *s, int layers, const char *model_id,
                                      const uint64_t *versions) {
  XXH3_state_t *st = XXH3_createState();
  if (!st)
    abort();
  XXH3_128bits_reset(st);
  /* Field by field, so struct padding never enters the hash. */
  int32_t f[10] = {layers,         s->q_heads,
                   s->kv_heads,    s->head_dim,
                   s->block_size,  (int32_t)s->dtype,
                   (int32_t)s->kv, (int32_t)s->rope,
                   s->rotary_dim,  0};
  XXH3_128bits_update(st, f, sizeof(f));
  /* The held head range and the model's kv heads (docs/scale-out.md): a shard's
   * blocks hold other heads than the whole model's, or another shard's. */
  int32_t range[3] = {s->kv_head_begin, s->kv_head_begin + s->kv_heads,
                      attnd_kshape_model_kv_heads(s)};
  XXH3_128bits_update(st, range, sizeof(range));
  XXH3_128bits_update(st, &s->rope_theta, sizeof(s->rope_theta));
  XXH3_128bits_update(st, &s->softmax_scale, sizeof(s->softmax_scale));
  size_t ml = model_id ? strlen(model_id) : 0;
  XXH3_128bits_update(st, &ml, sizeof(ml));
  if (ml)
    XXH3_128bits_update(st, model_id, ml);
  XXH3_128bits_update(st, versions, sizeof(uint64_t) * (size_t)layers);
  attnd_h128_t h = to_h(XXH3_128bits_digest(st));
  XXH3_freeState(st);
  return h;
}

attnd_h128_t attnd_prefix_fingerprint_mix(attnd_h128_t fp, const void *data, size_t len) {
  XXH3_state_t st;
  XXH3_128bits_reset(&st);
  XXH3_128bits_update(&st, &fp, sizeof(fp));
  XXH3_128bits_update(&st, data, len);
  return to_h(XXH3_128bits_digest(&st));
}

void attnd_prefix_set_fingerprint(attnd_prefix_t *px, attnd_h128_t fp) {
  px->fp = fp;
}

attnd_h128_t attnd_prefix_hash(const attnd_prefix_t *px, attnd_h128_t parent, uint64_t identity,
                               const uint8_t *salt, size_t saltlen, const uint32_t *tokens) {
  if (attnd_prefix_test_force_collision) {
    attnd_h128_t c = {0x5eed, 0x5eed};
    return c;
  }
  XXH3_state_t st;
  XXH3_128bits_reset(&st);
  XXH3_128bits_update(&st, &parent, sizeof(parent));
  XXH3_128bits_update(&st, &px->fp, sizeof(px->fp));
  XXH3_128bits_update(&st, &identity, sizeof(identity));
  uint64_t sl = saltlen;
  XXH3_128bits_update(&st, &sl, sizeof(sl));
  if (saltlen)
    XXH3_128bits_update(&st, salt, saltlen);
  XXH3_128bits_update(&st, tokens, sizeof(uint32_t) * px->bs);
  return to_h(XXH3_128bits_digest(&st));
}

static int h_eq(attnd_h128_t a, attnd_h128_t b) {
  return a.lo == b.lo && a.hi == b.hi;
}

static uint32_t bucket_of(const attnd_prefix_t *px, attnd_h128_t h) {
  return (uint32_t)(h.lo ^ (h.hi >> 7)) & (px->nbuckets - 1);
}

static int matches(const attnd_prefix_t *px, int32_t id, attnd_h128_t h, int32_t parent,
                   uint64_t identity, const uint8_t *salt, size_t saltlen, const uint32_t *tokens) {
  const entry_t *e = &px->ent[id];
  return h_eq(e->h, h) && h_eq(e->fp, px->fp) && e->parent == parent && e->identity == identity &&
         e->saltlen == saltlen && (saltlen == 0 || memcmp(e->salt, salt, saltlen) == 0) &&
         memcmp(&px->tokens[(size_t)id * px->bs], tokens, sizeof(uint32_t) * px->bs) == 0;
}

int32_t attnd_prefix_find(const attnd_prefix_t *px, attnd_h128_t h, int32_t parent,
                          uint64_t identity, const uint8_t *salt, size_t saltlen,
                          const uint32_t *tokens) {
  if (saltlen > ATTND_PREFIX_MAX_SALT)
    return -1;
  for (int32_t id = px->bucket[bucket_of(px, h)]; id >= 0; id = px->ent[id].next)
    if (matches(px, id, h, parent, identity, salt, saltlen, tokens))
      return id;
  return -1;
}

int32_t attnd_prefix_publish(attnd_prefix_t *px, int32_t id, attnd_h128_t h, int32_t parent,
                             uint64_t identity, const uint8_t *salt, size_t saltlen,
                             const uint32_t *tokens) {
  int32_t dup = attnd_prefix_find(px, h, parent, identity, salt, saltlen, tokens);
  if (dup >= 0)
    return dup;
  if (px->pool->b[id].published)
    return -1; /* immutable and indexed under another chain */
  entry_t *e = &px->ent[id];
  e->h = h;
  e->fp = px->fp;
  e->parent = parent;
  e->identity = identity;
  e->saltlen = (uint8_t)saltlen;
  if (saltlen)
    memcpy(e->salt, salt, saltlen);
  memcpy(&px->tokens[(size_t)id * px->bs], tokens, sizeof(uint32_t) * px->bs);
  uint32_t b = bucket_of(px, h);
  e->next = px->bucket[b];
  px->bucket[b] = id;
  if (parent >= 0)
    px->pool->b[parent].nchildren++;
  attnd_blocks_set_published(px->pool, id, 1);
  px->count++;
  return id;
}

attnd_h128_t attnd_prefix_block_hash(const attnd_prefix_t *px, int32_t id) {
  return px->ent[id].h;
}

/* Takes id out of its bucket chain and out of its parent's child count. */
static void unlink_entry(attnd_prefix_t *px, int32_t id) {
  entry_t *e = &px->ent[id];
  int32_t *pp = &px->bucket[bucket_of(px, e->h)];
  while (*pp >= 0 && *pp != id)
    pp = &px->ent[*pp].next;
  if (*pp == id)
    *pp = e->next;
  if (e->parent >= 0 && px->pool->b[e->parent].published)
    px->pool->b[e->parent].nchildren--;
  e->next = -1;
  px->count--;
}

int attnd_prefix_evict_one(attnd_prefix_t *px) {
  int32_t id = attnd_blocks_lru_leaf(px->pool);
  if (id < 0)
    return 0;
  unlink_entry(px, id);
  attnd_blocks_set_published(px->pool, id, 0);
  return 1;
}

void attnd_prefix_drop_all(attnd_prefix_t *px) {
  for (uint32_t b = 0; b < px->nbuckets; b++) {
    int32_t id = px->bucket[b];
    while (id >= 0) {
      int32_t next = px->ent[id].next;
      px->ent[id].next = -1;
      px->pool->b[id].nchildren = 0;
      attnd_blocks_set_published(px->pool, id, 0);
      id = next;
    }
    px->bucket[b] = -1;
  }
  for (uint32_t i = 0; i < px->pool->n; i++)
    px->pool->b[i].nchildren = 0;
  px->count = 0;
}

uint32_t attnd_prefix_count(const attnd_prefix_t *px) {
  return px->count;
}

/* test_engine_prefix.c: the prefix index (daemon/engine/prefix.c): chained hashes, confirmed hits,
 * forced collisions, leaf-first eviction. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "internal.h" /* daemon/engine: the engine's private modules */

enum { BS = 4 };

typedef struct {
  attnd_blocks_t pool;
  attnd_prefix_t *px;
} fx_t;

static int setup(void **state) {
  static fx_t f;
  memset(&f, 0, sizeof(f));
  if (attnd_blocks_init(&f.pool, 16) || attnd_prefix_init(&f.px, &f.pool, BS))
    return -1;
  attnd_kshape_t s = {.q_heads = 4,
                      .kv_heads = 2,
                      .head_dim = 64,
                      .block_size = BS,
                      .dtype = ATTND_DT_BF16,
                      .kv = ATTND_KV_BF16};
  uint64_t v[2] = {0, 0};
  attnd_prefix_set_fingerprint(f.px, attnd_prefix_fingerprint(&s, 2, "m", v));
  *state = &f;
  return 0;
}

/* The fingerprint names the held kv head range and the model's heads: shards
 * (and the whole model) never share blocks. 0 as model_kv_heads is the whole. */
static void test_fingerprint_range(void **state) {
  (void)state;
  attnd_kshape_t s = {.q_heads = 4,
                      .kv_heads = 2,
                      .head_dim = 64,
                      .block_size = BS,
                      .dtype = ATTND_DT_BF16,
                      .kv = ATTND_KV_BF16};
  uint64_t v[2] = {0, 0};
  attnd_h128_t whole = attnd_prefix_fingerprint(&s, 2, "m", v);
  s.model_kv_heads = 2;
  attnd_h128_t whole2 = attnd_prefix_fingerprint(&s, 2, "m", v);
  assert_memory_equal(&whole, &whole2, sizeof(whole));
  s.model_kv_heads = 4;
  attnd_h128_t a = attnd_prefix_fingerprint(&s, 2, "m", v);
  s.kv_head_begin = 2;
  attnd_h128_t b = attnd_prefix_fingerprint(&s, 2, "m", v);
  assert_memory_not_equal(&whole, &a, sizeof(a));
  assert_memory_not_equal(&a, &b, sizeof(a));
}

static int teardown(void **state) {
  fx_t *f = *state;
  attnd_prefix_free(f->px);
  attnd_blocks_free(&f->pool);
  attnd_prefix_test_force_collision = 0;
  return 0;
}

/* Publishes a chain of nb blocks of tokens; returns the ids in ids[]. */
static void publish_chain(fx_t *f, uint64_t ident, const uint32_t *tok, int nb, int32_t *ids) {
  attnd_h128_t h = {0, 0};
  int32_t parent = -1;
  for (int b = 0; b < nb; b++) {
    ids[b] = attnd_blocks_alloc(&f->pool, 1);
    h = attnd_prefix_hash(f->px, h, ident, NULL, 0, tok + b * BS);
    assert_int_equal(attnd_prefix_publish(f->px, ids[b], h, parent, ident, NULL, 0, tok + b * BS),
                     ids[b]);
    parent = ids[b];
  }
}

/* Number of leading blocks of tok that hit. */
static int lookup(fx_t *f, uint64_t ident, const uint8_t *salt, size_t sl, const uint32_t *tok,
                  int nb) {
  attnd_h128_t h = {0, 0};
  int32_t parent = -1;
  int b = 0;
  for (; b < nb; b++) {
    h = attnd_prefix_hash(f->px, h, ident, salt, sl, tok + b * BS);
    int32_t id = attnd_prefix_find(f->px, h, parent, ident, salt, sl, tok + b * BS);
    if (id < 0)
      break;
    parent = id;
  }
  return b;
}

static void test_hits(void **state) {
  fx_t *f = *state;
  uint32_t a[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  int32_t ids[3];
  publish_chain(f, 7, a, 3, ids);
  assert_int_equal(attnd_prefix_count(f->px), 3);
  assert_int_equal(lookup(f, 7, NULL, 0, a, 3), 3);
  /* Another identity or a salt never shares. */
  assert_int_equal(lookup(f, 8, NULL, 0, a, 3), 0);
  uint8_t salt[2] = {1, 2};
  assert_int_equal(lookup(f, 7, salt, 2, a, 3), 0);
  /* A change in block 1 stops the chain there. */
  uint32_t b[12];
  memcpy(b, a, sizeof(b));
  b[5] = 99;
  assert_int_equal(lookup(f, 7, NULL, 0, b, 3), 1);
  /* Same tokens in block 1's position but a different first block: miss. */
  b[5] = 6;
  b[0] = 42;
  assert_int_equal(lookup(f, 7, NULL, 0, b, 3), 0);
  /* Publishing the same chain again returns the existing block. */
  attnd_h128_t h = attnd_prefix_hash(f->px, (attnd_h128_t){0, 0}, 7, NULL, 0, a);
  int32_t other = attnd_blocks_alloc(&f->pool, 1);
  assert_int_equal(attnd_prefix_publish(f->px, other, h, -1, 7, NULL, 0, a), ids[0]);
  /* A new fingerprint (scales changed) hides everything. */
  attnd_kshape_t s = {.q_heads = 4,
                      .kv_heads = 2,
                      .head_dim = 64,
                      .block_size = BS,
                      .dtype = ATTND_DT_BF16,
                      .kv = ATTND_KV_INT8};
  uint64_t v[2] = {1, 0};
  attnd_prefix_set_fingerprint(f->px, attnd_prefix_fingerprint(&s, 2, "m", v));
  assert_int_equal(lookup(f, 7, NULL, 0, a, 3), 0);
}

static void test_forced_collision(void **state) {
  fx_t *f = *state;
  attnd_prefix_test_force_collision = 1;
  uint32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {1, 2, 3, 4, 50, 60, 70, 80};
  uint32_t c[8] = {9, 9, 9, 9, 5, 6, 7, 8};
  int32_t ia[2], ib[2];
  publish_chain(f, 1, a, 2, ia);
  /* b shares block 0 with a: publishing it returns a's block (same chain). */
  attnd_h128_t h0 = attnd_prefix_hash(f->px, (attnd_h128_t){0, 0}, 1, NULL, 0, b);
  ib[0] = attnd_blocks_alloc(&f->pool, 1);
  assert_int_equal(attnd_prefix_publish(f->px, ib[0], h0, -1, 1, NULL, 0, b), ia[0]);
  ib[1] = attnd_blocks_alloc(&f->pool, 1);
  attnd_h128_t h1 = attnd_prefix_hash(f->px, h0, 1, NULL, 0, b + 4);
  assert_int_equal(attnd_prefix_publish(f->px, ib[1], h1, ia[0], 1, NULL, 0, b + 4), ib[1]);
  /* Every hash is equal, yet each lookup finds exactly its own tokens. */
  assert_int_equal(lookup(f, 1, NULL, 0, a, 2), 2);
  assert_int_equal(lookup(f, 1, NULL, 0, b, 2), 2);
  assert_int_equal(lookup(f, 1, NULL, 0, c, 2), 0);
  attnd_h128_t z = {0, 0};
  attnd_h128_t hh = attnd_prefix_hash(f->px, z, 1, NULL, 0, a);
  assert_int_equal(attnd_prefix_find(f->px, hh, ia[0], 1, NULL, 0, a + 4), ia[1]);
  assert_int_equal(attnd_prefix_find(f->px, hh, ia[0], 1, NULL, 0, b + 4), ib[1]);
}

static void test_evict_leaves_first(void **state) {
  fx_t *f = *state;
  uint32_t a[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  int32_t ids[3];
  publish_chain(f, 7, a, 3, ids);
  /* Release in table order: the root enters the LRU first (oldest), yet the
   * leaf must go first. */
  for (int b = 0; b < 3; b++)
    attnd_blocks_unref(&f->pool, ids[b], 1);
  assert_int_equal(f->pool.nlru, 3);
  assert_int_equal(attnd_prefix_evict_one(f->px), 1);
  assert_int_equal(lookup(f, 7, NULL, 0, a, 3), 2);
  assert_int_equal(attnd_prefix_evict_one(f->px), 1);
  assert_int_equal(lookup(f, 7, NULL, 0, a, 3), 1);
  assert_int_equal(attnd_prefix_evict_one(f->px), 1);
  assert_int_equal(attnd_prefix_evict_one(f->px), 0);
  assert_int_equal(f->pool.nfree, 16);
  char err[200];
  assert_int_equal(attnd_blocks_check(&f->pool, err, sizeof(err)), 0);
}

static void test_referenced_not_evicted(void **state) {
  fx_t *f = *state;
  uint32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  int32_t ids[2];
  publish_chain(f, 7, a, 2, ids);
  attnd_blocks_unref(&f->pool, ids[1], 1);
  assert_int_equal(attnd_prefix_evict_one(f->px), 1); /* ids[1] */
  assert_int_equal(attnd_prefix_evict_one(f->px), 0); /* ids[0] is held */
  attnd_prefix_drop_all(f->px);
  assert_int_equal(attnd_prefix_count(f->px), 0);
  assert_int_equal(lookup(f, 7, NULL, 0, a, 2), 0);
  attnd_blocks_unref(&f->pool, ids[0], 1);
  assert_int_equal(f->pool.nfree, 16);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fingerprint_range),
      cmocka_unit_test_setup_teardown(test_hits, setup, teardown),
      cmocka_unit_test_setup_teardown(test_forced_collision, setup, teardown),
      cmocka_unit_test_setup_teardown(test_evict_leaves_first, setup, teardown),
      cmocka_unit_test_setup_teardown(test_referenced_not_evicted, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

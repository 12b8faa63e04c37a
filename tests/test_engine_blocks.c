/* test_engine_blocks.c: the block pool (daemon/engine/blocks.c): free list, refcounts and LRU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>

#include "internal.h" /* daemon/engine: the engine's private modules */

static void check(const attnd_blocks_t *p) {
  char err[256];
  int rc = attnd_blocks_check(p, err, sizeof(err));
  if (rc != 0)
    fail_msg("%s", err);
}

static void test_alloc_free(void **state) {
  attnd_blocks_t p;
  assert_int_equal(attnd_blocks_init(&p, 4), 0);
  int32_t ids[4];
  for (int i = 0; i < 4; i++) {
    ids[i] = attnd_blocks_alloc(&p, 1);
    assert_int_equal(ids[i], i);
    check(&p);
  }
  assert_int_equal(attnd_blocks_alloc(&p, 1), -1);
  assert_int_equal(attnd_blocks_used(&p), 4);
  attnd_blocks_ref(&p, ids[1], 0); /* a job */
  attnd_blocks_unref(&p, ids[1], 1);
  assert_int_equal(p.nfree, 0); /* the job still holds it */
  attnd_blocks_unref(&p, ids[1], 0);
  assert_int_equal(p.nfree, 1);
  check(&p);
  assert_int_equal(attnd_blocks_alloc(&p, 0), ids[1]);
  attnd_blocks_free(&p);
}

static void test_lru(void **state) {
  attnd_blocks_t p;
  assert_int_equal(attnd_blocks_init(&p, 3), 0);
  int32_t a = attnd_blocks_alloc(&p, 1), b = attnd_blocks_alloc(&p, 1),
          c = attnd_blocks_alloc(&p, 1);
  attnd_blocks_set_published(&p, a, 1);
  attnd_blocks_set_published(&p, b, 1);
  p.b[a].nchildren = 1; /* b continues a */
  attnd_blocks_unref(&p, b, 1);
  attnd_blocks_unref(&p, a, 1);
  attnd_blocks_unref(&p, c, 1);
  check(&p);
  assert_int_equal(p.nlru, 2);
  assert_int_equal(p.nfree, 1);
  assert_int_equal(attnd_blocks_available(&p), 3);
  /* a is older than... no: b entered first, and a has a child anyway. */
  assert_int_equal(attnd_blocks_lru_leaf(&p), b);
  /* Touching b moves it out of the LRU; a is not a leaf, nothing evictable. */
  attnd_blocks_ref(&p, b, 1);
  assert_int_equal(attnd_blocks_lru_leaf(&p), -1);
  check(&p);
  attnd_blocks_unref(&p, b, 1);
  assert_int_equal(attnd_blocks_lru_leaf(&p), b);
  /* Unpublishing an unreferenced block frees it. */
  attnd_blocks_set_published(&p, b, 0);
  p.b[a].nchildren = 0;
  assert_int_equal(p.nfree, 2);
  assert_int_equal(attnd_blocks_lru_leaf(&p), a);
  check(&p);
  attnd_blocks_free(&p);
}

static void test_random_ops(void **state) {
  /* Random refs/unrefs against a shadow count; invariants after every op. */
  attnd_blocks_t p;
  enum { N = 64 };
  assert_int_equal(attnd_blocks_init(&p, N), 0);
  int tab[N] = {0}, job[N] = {0};
  uint64_t s = 12345;
  for (int it = 0; it < 20000; it++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    int id = (int)((s >> 33) % N), op = (int)((s >> 20) % 5);
    int held = tab[id] + job[id];
    if (op == 0) {
      int32_t x = attnd_blocks_alloc(&p, 1);
      if (x >= 0) {
        assert_int_equal(tab[x] + job[x], 0);
        tab[x] = 1;
      } else {
        assert_int_equal(p.nfree, 0);
      }
    } else if (op == 1 && held) {
      attnd_blocks_ref(&p, id, (s >> 40) & 1);
      if ((s >> 40) & 1)
        tab[id]++;
      else
        job[id]++;
    } else if (op == 2 && tab[id]) {
      attnd_blocks_unref(&p, id, 1);
      tab[id]--;
    } else if (op == 3 && job[id]) {
      attnd_blocks_unref(&p, id, 0);
      job[id]--;
    } else if (op == 4 && held) {
      attnd_blocks_set_published(&p, id, 1);
    } else if (op == 4 && p.b[id].where == ATTND_BLK_LRU) {
      attnd_blocks_set_published(&p, id, 0);
    }
    check(&p);
    for (int i = 0; i < N; i++)
      if (p.b[i].ref != tab[i] + job[i] || p.b[i].tabref != tab[i])
        fail_msg("block %d: ref %d tabref %d, expected %d %d", i, p.b[i].ref, p.b[i].tabref,
                 tab[i] + job[i], tab[i]);
  }
  attnd_blocks_free(&p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_alloc_free),
      cmocka_unit_test(test_lru),
      cmocka_unit_test(test_random_ops),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_engine_hostmem: host memory of frames and outputs (daemon/engine/hostmem.c)
 * on the CPU backend: a freed large plain buffer comes back for the next
 * request of about its size (and not for a much smaller or a larger one),
 * small ones are never kept, at most ATTND_HOSTMEM_SLOTS are kept, every
 * buffer is 64-byte aligned and writable end to end, and the engine's close
 * frees what is kept (ASan's leak check sees it otherwise). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine_fixture.h"
#include "internal.h" /* ATTND_HOSTMEM_SLOTS */

#define MIB ((size_t)1 << 20)

static void *get(fx_t *f, size_t len) {
  int pinned = -1;
  uint8_t *p = attnd_engine_host_alloc(f->e, len, &pinned);
  assert_non_null(p);
  assert_int_equal(pinned, 0); /* the CPU backend has no pinned memory */
  assert_int_equal((uintptr_t)p & 63, 0);
  p[0] = 1;
  p[len - 1] = 2;
  return p;
}

static void test_reuse(void **state) {
  (void)state;
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  void *a = get(f, 8 * MIB);
  attnd_engine_host_free(f->e, a, 0);
  void *b = get(f, 8 * MIB); /* the same size: the kept one */
  assert_ptr_equal(b, a);
  attnd_engine_host_free(f->e, b, 0);
  void *c = get(f, 6 * MIB); /* within half its size: the kept one too */
  assert_ptr_equal(c, a);
  attnd_engine_host_free(f->e, c, 0);
  void *d = get(f, 2 * MIB); /* a quarter: not worth hoarding for it */
  assert_ptr_not_equal(d, a);
  void *g = get(f, 9 * MIB); /* larger than any kept */
  assert_ptr_not_equal(g, a);
  attnd_engine_host_free(f->e, d, 0);
  attnd_engine_host_free(f->e, g, 0);
  /* Small buffers go straight back to malloc (not kept: a small one freed
   * and asked for again may or may not come back, nothing to assert) and
   * are aligned and whole all the same. */
  void *s = get(f, 4096);
  attnd_engine_host_free(f->e, s, 0);
  /* More large buffers freed than the slots: the rest are freed. */
  void *many[ATTND_HOSTMEM_SLOTS + 3];
  for (int i = 0; i < ATTND_HOSTMEM_SLOTS + 3; i++)
    many[i] = get(f, 2 * MIB);
  for (int i = 0; i < ATTND_HOSTMEM_SLOTS + 3; i++)
    attnd_engine_host_free(f->e, many[i], 0);
  int kept = 0;
  for (int i = 0; i < ATTND_HOSTMEM_SLOTS; i++)
    kept += f->e->hm.p[i] != NULL;
  assert_int_equal(kept, ATTND_HOSTMEM_SLOTS);
  assert_true(f->e->hm.bytes <= f->e->hm.max_bytes);
  assert_true(f->e->hm.max_bytes >= (size_t)256 * MIB);
  attnd_engine_host_free(f->e, NULL, 0); /* a no-op */
  fx_free(f);                            /* the close frees the kept ones */
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_reuse)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

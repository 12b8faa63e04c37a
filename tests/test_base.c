/* test_base.c: daemon/base: the error list (enum, texts, wire codes, the
 * kernels' codes mapped in), the intrusive list, the id map, counters and
 * histograms, the allocation wrapper. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"

static void test_codes(void **state) {
  (void)state;
  assert_int_equal(attnd_err_status(0), ATTND_STATUS_OK);
  assert_int_equal(attnd_err_status(ATTND_EINVAL), ATTND_STATUS_INVALID_ARGUMENT);
  assert_int_equal(attnd_err_status(ATTND_ENOTFOUND), ATTND_STATUS_NOT_FOUND);
  assert_int_equal(attnd_err_status(ATTND_ENOSPC), ATTND_STATUS_RESOURCE_EXHAUSTED);
  assert_int_equal(attnd_err_status(ATTND_EPRECOND), ATTND_STATUS_FAILED_PRECONDITION);
  assert_int_equal(attnd_err_status(ATTND_ERANGE), ATTND_STATUS_OUT_OF_RANGE);
  assert_int_equal(attnd_err_status(ATTND_EUNAUTH), ATTND_STATUS_UNAUTHENTICATED);
  assert_int_equal(attnd_err_status(ATTND_EDEVICE), ATTND_STATUS_UNAVAILABLE);
  assert_int_equal(attnd_err_status(-999), ATTND_STATUS_INTERNAL);
  assert_string_equal(attnd_strerror(ATTND_EINVAL), "invalid argument");
  assert_string_equal(attnd_strerror(ATTND_EDEVICE), "device unusable");
  assert_string_equal(attnd_strerror(-999), "unknown error");
}

/* The kernels' codes land on the daemon's, whatever else they return. */
static void test_kernel_codes(void **state) {
  assert_int_equal(attnd_err_from_kernel(0), 0);
  assert_int_equal(attnd_err_from_kernel(ATTND_KERNEL_EINVAL), ATTND_EINVAL);
  assert_int_equal(attnd_err_from_kernel(ATTND_KERNEL_ECUDA), ATTND_ECUDA);
  assert_int_equal(attnd_err_from_kernel(ATTND_KERNEL_EDEVICE), ATTND_EDEVICE);
  assert_int_equal(attnd_err_from_kernel(-2), ATTND_EINTERNAL);
  assert_int_equal(attnd_err_from_kernel(7), ATTND_EINTERNAL);
}

typedef struct {
  int v;
  attnd_list_t link;
} node_t;

static void list_expect(attnd_list_t *h, const int *want, int n) {
  int i = 0;
  ATTND_LIST_FOREACH(it, nx, h) {
    assert_true(i < n);
    assert_int_equal(ATTND_LIST_DATA(it, node_t, link)->v, want[i]);
    i++;
  }
  assert_int_equal(i, n);
}

static void test_list(void **state) {
  attnd_list_t h;
  node_t n[4];
  attnd_list_init(&h);
  assert_true(attnd_list_empty(&h));
  assert_null(attnd_list_first(&h));
  for (int i = 0; i < 4; i++) {
    n[i].v = i;
    attnd_list_insert_tail(&h, &n[i].link);
  }
  list_expect(&h, (int[]){0, 1, 2, 3}, 4);
  /* Removing inside an iteration (the current element) is safe. */
  ATTND_LIST_FOREACH(it, nx, &h)
  if (ATTND_LIST_DATA(it, node_t, link)->v % 2)
    attnd_list_remove(it);
  list_expect(&h, (int[]){0, 2}, 2);
  attnd_list_remove(&n[1].link); /* already out: harmless */
  attnd_list_insert_head(&h, &n[3].link);
  list_expect(&h, (int[]){3, 0, 2}, 3);
  assert_ptr_equal(attnd_list_first(&h), &n[3].link);
  assert_ptr_equal(attnd_list_next(&h, &n[0].link), &n[2].link);
  assert_null(attnd_list_next(&h, &n[2].link));
  attnd_list_remove(&n[3].link);
  attnd_list_remove(&n[0].link);
  attnd_list_remove(&n[2].link);
  assert_true(attnd_list_empty(&h));
}

/* The map grows past its first buckets and keeps every key. */
static void test_idmap(void **state) {
  attnd_idmap_t m;
  assert_int_equal(attnd_idmap_init(&m), 0);
  static int vals[1000];
  for (int i = 0; i < 1000; i++)
    assert_int_equal(attnd_idmap_put(&m, (uint64_t)i * 0x9E3779B97F4A7C15ull + 1, &vals[i]), 0);
  assert_int_equal(m.count, 1000);
  for (int i = 0; i < 1000; i++)
    assert_ptr_equal(attnd_idmap_get(&m, (uint64_t)i * 0x9E3779B97F4A7C15ull + 1), &vals[i]);
  assert_null(attnd_idmap_get(&m, 2));
  for (int i = 0; i < 1000; i += 2)
    attnd_idmap_del(&m, (uint64_t)i * 0x9E3779B97F4A7C15ull + 1);
  assert_int_equal(m.count, 500);
  assert_null(attnd_idmap_get(&m, 1));
  assert_ptr_equal(attnd_idmap_get(&m, 0x9E3779B97F4A7C15ull + 1), &vals[1]);
  attnd_idmap_free(&m);
  uint64_t a = attnd_random_id(), b = attnd_random_id();
  assert_true(a != 0 && b != 0 && a != b);
}

/* Keys a client chose to collide: the inverse of the unseeded finalizer
 * (murmur3's fmix64) applied to i << 20, so that the finalizer alone would
 * put every one of them in bucket 0 of any map up to 2^20 buckets. */
static uint64_t aimed_key(uint64_t i) {
  uint64_t y = i << 20;
  y ^= y >> 33;
  y *= 0x4f74430c22a54005ull; /* the inverse of 0xff51afd7ed558ccd mod 2^64 */
  y ^= y >> 33;
  return y;
}

/* O(1) by structure: with 100k keys, sequential or aimed at one bucket, a
 * lookup compares a handful of entries, never a number that grows with the
 * map. Key 0 is a key like any other. */
static void test_idmap_probes(void **state) {
  enum { N = 100000 };
  static int v;
  for (int kind = 0; kind < 2; kind++) {
    attnd_idmap_t m;
    assert_int_equal(attnd_idmap_init(&m), 0);
    for (uint64_t i = 0; i < N; i++) {
      uint64_t k = kind ? aimed_key(i) : i;
      assert_null(attnd_idmap_get(&m, k));
      assert_int_equal(attnd_idmap_put(&m, k, &v), 0);
    }
    uint64_t total = 0;
    uint32_t worst = 0;
    for (uint64_t i = 0; i < N; i++) {
      uint64_t k = kind ? aimed_key(i) : i;
      assert_ptr_equal(attnd_idmap_get(&m, k), &v);
      uint32_t p = attnd_idmap_probes(&m, k);
      total += p;
      worst = p > worst ? p : worst;
    }
    fprintf(stderr, "idmap %s keys: %d keys, %.2f probes per lookup, worst %u\n",
            kind ? "aimed" : "sequential", N, (double)total / N, worst);
    assert_true(total <= 2 * (uint64_t)N);
    assert_true(worst <= 16);
    assert_true(attnd_idmap_probes(&m, UINT64_MAX - 5) <= 16); /* an absent key */
    for (uint64_t i = 0; i < N; i++)
      attnd_idmap_del(&m, kind ? aimed_key(i) : i);
    assert_int_equal(m.count, 0);
    assert_null(attnd_idmap_get(&m, 0));
    attnd_idmap_free(&m);
  }
}

static void test_counters(void **state) {
  attnd_status_counts_t c;
  memset(&c, 0, sizeof(c));
  attnd_status_count(&c, ATTND_STATUS_OK);
  attnd_status_count(&c, ATTND_STATUS_NOT_FOUND);
  attnd_status_count(&c, 99); /* out of range: counted as INTERNAL */
  assert_int_equal(c.by_code[ATTND_STATUS_OK], 1);
  assert_int_equal(c.by_code[ATTND_STATUS_NOT_FOUND], 1);
  assert_int_equal(c.by_code[ATTND_STATUS_INTERNAL], 1);
  assert_int_equal(c.errors, 2);
  attnd_hist_t h;
  memset(&h, 0, sizeof(h));
  attnd_hist_add(&h, 10);                      /* first bucket */
  attnd_hist_add(&h, attnd_hist_bounds_us[3]); /* on a bound: that bucket */
  attnd_hist_add(&h, 1e9);                     /* +Inf */
  assert_int_equal(h.bucket[0], 1);
  assert_int_equal(h.bucket[3], 1);
  assert_int_equal(h.bucket[ATTND_HIST_BUCKETS], 1);
  assert_int_equal(h.count, 3);
  assert_true(h.sum_us > 1e9);
}

static void test_alloc(void **state) {
  /* Zero sizes still give memory that can be freed (never NULL). */
  void *p = attnd_xmalloc(0), *q = attnd_xcalloc(0, 8);
  assert_non_null(p);
  assert_non_null(q);
  uint8_t *r = attnd_xcalloc(16, 4);
  for (int i = 0; i < 64; i++)
    assert_int_equal(r[i], 0);
  r = attnd_xrealloc(r, 4096);
  r[4095] = 1;
  free(p);
  free(q);
  free(r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_codes),        cmocka_unit_test(test_kernel_codes),
      cmocka_unit_test(test_list),         cmocka_unit_test(test_idmap),
      cmocka_unit_test(test_idmap_probes), cmocka_unit_test(test_counters),
      cmocka_unit_test(test_alloc),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_engine_scan: the finiteness and bounds scan (daemon/engine/scan.c) at
 * an odd address, both ways: copied to an aligned buffer (the CPU backend) or
 * read through a bounce buffer with no copy (a backend that reads any
 * alignment, backend.h any_alignment): the same first bad rows either way,
 * across chunk boundaries, and the view is the request's own bytes; and the
 * same in parts (a large step's scan spread over the worker pool). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "internal.h" /* daemon/engine: the engine's private modules */

#define QH 8
#define KVH 4
#define HD 128
#define ROWS 300 /* kv rows of 512 elements: 128 rows per scan chunk, three chunks */

static void put_bf16(uint8_t *p, size_t i, uint16_t bits) {
  p[2 * i] = (uint8_t)(bits & 0xff);
  p[2 * i + 1] = (uint8_t)(bits >> 8);
}

static void fill(uint8_t *p, size_t elems, unsigned seed) {
  for (size_t i = 0; i < elems; i++) /* finite bf16 values in (-2, 2) */
    put_bf16(p, i,
             (uint16_t)(0x3f00u + ((i * 2654435761u + seed) % 0xffu)) | (uint16_t)((i & 1) << 15));
}

static void scan_both(attnd_kshape_t *sh, attnd_step_req_t *req, attnd_scan_t *copied,
                      attnd_scan_t *bounced) {
  memset(copied, 0, sizeof(*copied));
  memset(bounced, 0, sizeof(*bounced));
  attnd_scan_step(sh, req, 0, copied);
  attnd_scan_step(sh, req, 1, bounced);
}

static void set_tensor(attnd_tensor_t *t, uint8_t *data, uint32_t rows, uint32_t heads) {
  memset(t, 0, sizeof(*t));
  t->present = 1;
  t->dtype = ATTND_DT_BF16;
  t->ndim = 3;
  t->shape[0] = rows;
  t->shape[1] = heads;
  t->shape[2] = HD;
  t->data = data;
  t->nbytes = (size_t)rows * heads * HD * 2;
}

static void test_odd_address(void **state) {
  (void)state;
  attnd_kshape_t sh;
  memset(&sh, 0, sizeof(sh));
  sh.dtype = ATTND_DT_BF16;
  sh.kv = ATTND_KV_BF16;
  sh.q_heads = QH;
  sh.kv_heads = KVH;
  sh.head_dim = HD;
  sh.rope = ATTND_ROPE_NONE;
  const size_t kvn = (size_t)ROWS * KVH * HD, qn = (size_t)ROWS * QH * HD;
  uint8_t *kbase = malloc(2 * kvn + 2), *vbase = malloc(2 * kvn + 2), *qbase = malloc(2 * qn + 2);
  assert_non_null(kbase);
  assert_non_null(vbase);
  assert_non_null(qbase);
  uint8_t *k = kbase + 1, *v = vbase + 1, *q = qbase + 1; /* odd addresses */
  /* Rows to break, each a case: none, the first row, a chunk's last and
   * next rows, the last row. */
  const int cases[] = {-1, 0, 127, 128, 200, ROWS - 1};
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    fill(k, kvn, 1);
    fill(v, kvn, 2);
    fill(q, qn, 3);
    int bad = cases[c];
    if (bad >= 0) {
      put_bf16(k, (size_t)bad * KVH * HD + 5, 0x7fc0);              /* NaN */
      put_bf16(v, (size_t)(ROWS - 1 - bad) * KVH * HD + 3, 0xff80); /* -inf */
      put_bf16(q, (size_t)bad * QH * HD + QH * HD - 1, 0x5f80);     /* 2^64 > 2^48 */
    }
    attnd_step_req_t req;
    memset(&req, 0, sizeof(req));
    set_tensor(&req.q, q, ROWS, QH);
    set_tensor(&req.k, k, ROWS, KVH);
    set_tensor(&req.v, v, ROWS, KVH);
    attnd_scan_t a, b;
    scan_both(&sh, &req, &a, &b);
    assert_int_equal(a.bad_k, b.bad_k);
    assert_int_equal(a.bad_v, b.bad_v);
    assert_int_equal(a.bad_q, b.bad_q);
    assert_int_equal(a.bits_k, b.bits_k);
    assert_int_equal(a.bits_v, b.bits_v);
    assert_int_equal(a.bits_q, b.bits_q);
    if (bad < 0) {
      assert_true(a.bad_k == SIZE_MAX && a.bad_v == SIZE_MAX && a.bad_q == SIZE_MAX);
    } else {
      assert_int_equal(a.bad_k, (size_t)bad);
      assert_int_equal(a.bad_v, (size_t)(ROWS - 1 - bad));
      assert_int_equal(a.bad_q, (size_t)bad);
      assert_int_equal(b.bits_q, 0x5f80);
    }
    /* Copied: aligned copies; bounced: the request's bytes themselves. */
    assert_non_null(a.kbuf);
    assert_ptr_equal(a.k, a.kbuf);
    assert_ptr_equal(b.k, k);
    assert_ptr_equal(b.v, v);
    assert_ptr_equal(b.q, q);
    assert_null(b.kbuf);
    assert_null(b.vbuf);
    assert_null(b.qbuf);
    assert_memory_equal(a.k, k, 2 * kvn);
    /* In parts (a large step's scan on the worker pool), both ways: the
     * same first rows, and the copies whole even past a bad row. */
    for (int any = 0; any < 2; any++) {
      attnd_scan_t p;
      attnd_scan_part_t parts[3];
      attnd_scan_begin(NULL, &sh, &req, any, &p);
      for (int i = 2; i >= 0; i--) /* any order */
        attnd_scan_part(&sh, &req, &p, i, 3, &parts[i]);
      attnd_scan_end(&p, parts, 3);
      assert_int_equal(p.bad_k, a.bad_k);
      assert_int_equal(p.bad_v, a.bad_v);
      assert_int_equal(p.bad_q, a.bad_q);
      assert_int_equal(p.bits_k, a.bits_k);
      assert_int_equal(p.bits_v, a.bits_v);
      assert_int_equal(p.bits_q, a.bits_q);
      if (any) {
        assert_ptr_equal(p.k, k);
        assert_null(p.kbuf);
      } else {
        assert_memory_equal(p.k, k, 2 * kvn);
        assert_memory_equal(p.v, v, 2 * kvn);
        assert_memory_equal(p.q, q, 2 * qn);
      }
      free(p.kbuf);
      free(p.vbuf);
      free(p.qbuf);
    }
    free(a.kbuf);
    free(a.vbuf);
    free(a.qbuf);
  }
  free(kbase);
  free(vbase);
  free(qbase);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_odd_address)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

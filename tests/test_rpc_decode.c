/* test_rpc_decode.c: decoding (daemon/rpc/decode.c): a Step's wire-level
 * checks, and masks expanded into the kernels' form (rpc_fixture.h). */
#include "rpc_fixture.h"

static void test_step_wire_checks(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  uint16_t d[64] = {0};
  /* Five dims. */
  uint32_t s5[5] = {1, 1, 1, 1, 64};
  pbw_t st;
  pbw_init(&st);
  pbw_tensor(&st, 4, attnd_v1_DType_DTYPE_BF16, s5, 5, d, sizeof(d));
  send_call(&t, 21, attnd_v1_Request_step_tag, &st);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 21);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "more than 4 dims"));
  assert_false(t.close_after[0]);
  /* Bytes that do not match the shape. */
  uint32_t s3[3] = {2, 4, 64};
  pbw_init(&st);
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, s3, 3, d, sizeof(d));
  send_call(&t, 22, attnd_v1_Request_step_tag, &st);
  resp(&t, 1, &r);
  assert_int_equal(r.id, 22);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(
      strstr(r.status.message, "k: shape [2, 4, 64] of BF16 needs 1024 bytes, data has 128"));
  /* Unknown dtype. */
  pbw_init(&st);
  pbw_tensor(&st, 6, 9, s3, 3, d, sizeof(d));
  send_call(&t, 23, attnd_v1_Request_step_tag, &st);
  resp(&t, 2, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "v: dtype 9"));
  assert_int_equal(f->rpc.inflight, 0);
  tconn_free(&t);
}

/* One Plan item with a mask: kind, then (for DOCUMENT) doc_lengths or (for
 * CUSTOM) an INT32 intervals tensor of the given shape. */
static void put_mask_item(pbw_t *w, uint32_t start, uint32_t n, int kind, uint32_t window,
                          const int32_t *vals, uint32_t nvals, const uint32_t *shape, int ndim) {
  pbw_t it, tok, mask;
  pbw_init(&it);
  pbw_fixed64(&it, 1, 0x1111);
  pbw_uint(&it, 2, start);
  pbw_uint(&it, 3, n);
  pbw_init(&tok);
  for (uint32_t i = 0; i < n; i++)
    pbw_varint(&tok, 7);
  pbw_sub(&it, 6, &tok);
  pbw_init(&mask);
  pbw_uint(&mask, 1, (uint64_t)kind);
  if (window)
    pbw_uint(&mask, 2, window);
  if (vals)
    pbw_tensor(&mask, kind == attnd_v1_Mask_Kind_DOCUMENT ? 4 : 5, attnd_v1_DType_DTYPE_INT32,
               shape, ndim, vals, 4 * (size_t)nvals);
  pbw_sub(&it, 5, &mask);
  pbw_sub(w, 1, &it);
}

/* Masks are expanded into the kernels' form while decoding: a document mask
 * hides exactly the keys of other documents from each row (causal does the
 * rest), and a mask that cannot be expanded is refused before the engine
 * sees the call, naming the item. */
static void test_mask_expansion(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  int32_t docs[2] = {5, 9};
  uint32_t dshape[1] = {2};
  pbw_t p;
  pbw_init(&p);
  put_mask_item(&p, 0, 14, attnd_v1_Mask_Kind_DOCUMENT, 0, docs, 2, dshape, 1);
  send_call(&t, 1, attnd_v1_Request_plan_tag, &p);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.plans, 1);
  const attnd_mask_t *m = &fe.plan_mask[0];
  assert_int_equal(m->kind, ATTND_MASK_INTERVALS);
  assert_int_equal(m->causal, 1);
  assert_int_equal(m->intervals_len, 14);
  const int32_t *iv = fe.plan_iv[0];
  for (int pr = 0; pr < 14; pr++)
    for (int j = 0; j <= pr; j++) {
      int masked = (iv[j] <= pr && pr < iv[14 + j]) || (iv[28 + j] <= pr && pr < iv[42 + j]);
      int other_doc = (j < 5) != (pr < 5);
      if (masked != other_doc)
        fail_msg("row %d key %d: masked %d, other document %d", pr, j, masked, other_doc);
    }
  /* Refused while decoding, the engine never called. */
  struct {
    int kind;
    uint32_t start, n, window;
    const int32_t *vals;
    uint32_t nvals, shape[2];
    int ndim, code;
    const char *needle;
  } bad[] = {
      /* Documents that do not sum to kv_len (14). */
      {attnd_v1_Mask_Kind_DOCUMENT,
       12,
       2,
       0,
       (int32_t[]){5, 5},
       2,
       {2},
       1,
       attnd_v1_Status_Code_INVALID_ARGUMENT,
       "item 1: doc lengths"},
      {attnd_v1_Mask_Kind_DOCUMENT,
       12,
       2,
       0,
       (int32_t[]){20},
       1,
       {1},
       1,
       attnd_v1_Status_Code_INVALID_ARGUMENT,
       "item 1: doc lengths"},
      {attnd_v1_Mask_Kind_DOCUMENT,
       12,
       2,
       0,
       NULL,
       0,
       {0},
       0,
       attnd_v1_Status_Code_INVALID_ARGUMENT,
       "item 1: doc_lengths must be"},
      /* Intervals past max_context are never allocated. */
      {attnd_v1_Mask_Kind_DOCUMENT,
       (uint32_t)f->cfg.max_context,
       1,
       0,
       (int32_t[]){1},
       1,
       {1},
       1,
       attnd_v1_Status_Code_OUT_OF_RANGE,
       "item 1: start+n"},
      {attnd_v1_Mask_Kind_CUSTOM,
       12,
       2,
       0,
       (int32_t[4 * 13]){0},
       4 * 13,
       {4, 13},
       2,
       attnd_v1_Status_Code_INVALID_ARGUMENT,
       "item 1: intervals must be INT32 [4, 14]"},
      {attnd_v1_Mask_Kind_SLIDING_WINDOW,
       12,
       2,
       0,
       NULL,
       0,
       {0},
       0,
       attnd_v1_Status_Code_INVALID_ARGUMENT,
       "item 1: sliding window"},
      {9,
       12,
       2,
       0,
       NULL,
       0,
       {0},
       0,
       attnd_v1_Status_Code_INVALID_ARGUMENT,
       "item 1: unknown mask kind 9"},
  };
  for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
    pbw_init(&p);
    put_mask_item(&p, 0, 3, attnd_v1_Mask_Kind_CAUSAL, 0, NULL, 0, NULL, 0);
    put_mask_item(&p, bad[k].start, bad[k].n, bad[k].kind, bad[k].window, bad[k].vals, bad[k].nvals,
                  bad[k].shape, bad[k].ndim);
    send_call(&t, 10 + k, attnd_v1_Request_plan_tag, &p);
    resp(&t, 1 + (int)k, &r);
    if ((int)r.status.code != bad[k].code || !strstr(r.status.message, bad[k].needle))
      fail_msg("case %zu: code %d '%s', expected %d '%s'", k, r.status.code, r.status.message,
               bad[k].code, bad[k].needle);
    assert_int_equal(fe.plans, 1);
  }
  tconn_free(&t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_step_wire_checks, setup, teardown),
      cmocka_unit_test_setup_teardown(test_mask_expansion, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

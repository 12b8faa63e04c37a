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

/* An item with n and `ntok` token ids (tokens_first: before n on the wire). */
static void put_tok_item(pbw_t *w, uint64_t session, uint32_t n, uint32_t ntok, int tokens_first) {
  pbw_t it, tok;
  pbw_init(&it);
  pbw_init(&tok);
  for (uint32_t i = 0; i < ntok; i++)
    pbw_varint(&tok, 100 + i);
  pbw_fixed64(&it, 1, session);
  if (tokens_first)
    pbw_sub(&it, 6, &tok);
  pbw_uint(&it, 2, 0);
  pbw_uint(&it, 3, n);
  if (!tokens_first)
    pbw_sub(&it, 6, &tok);
  pbw_sub(w, 1, &it);
}

static int plan_code(tconn_t *t, uint64_t id, pbw_t *p, attnd_v1_Response *r) {
  int before = t->nout;
  send_call(t, id, attnd_v1_Request_plan_tag, p);
  assert_int_equal(t->nout, before + 1);
  resp(t, before, r);
  return (int)r->status.code;
}

/* Lists are bounded before they cost work proportional to their length
 * (docs/protocol.md section 7): an OpenSession's tokens by max_context, a
 * Plan's items by --max-sessions, an item's tokens by its n and max_context,
 * all items' tokens by the KV pool (42 blocks of 16 here), doc_lengths by
 * start + n, the masks' expanded intervals by --max-frame. The engine sees
 * none of the refused calls. */
static void test_decode_bounds(void **state) {
  fix_t *f = *state;
  f->cfg.max_context = 500; /* below the pool's 672 tokens */
  f->cfg.max_sessions = 3;
  f->cfg.max_frame = 4096;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  /* OpenSession: max_context ids pass, one more does not, nor a packed run
   * announcing far more (refused from its length). */
  for (int k = 0; k < 3; k++) {
    uint32_t n = k == 0 ? 500 : k == 1 ? 501 : 200000;
    pbw_t o, tok;
    pbw_init(&o);
    pbw_init(&tok);
    for (uint32_t i = 0; i < n; i++)
      pbw_varint(&tok, i);
    pbw_sub(&o, 1, &tok);
    send_call(&t, 1, attnd_v1_Request_open_session_tag, &o);
    resp(&t, t.nout - 1, &r);
    if (k == 0) {
      assert_int_equal(r.status.code, 0);
      assert_int_equal(r.result.open_session.cached_len, 500); /* the fake echoes the count */
    } else {
      assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
      assert_non_null(strstr(r.status.message, "more than max_context 500 token ids"));
    }
  }
  /* Unpacked ids are counted one by one, and stop one past the bound. */
  pbw_t o;
  pbw_init(&o);
  for (uint32_t i = 0; i < 501; i++)
    pbw_uint(&o, 1, i);
  send_call(&t, 2, attnd_v1_Request_open_session_tag, &o);
  resp(&t, t.nout - 1, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  int plans = fe.plans;
  pbw_t p;
  /* An item's tokens: more than its n (n first), more than max_context (tokens first). */
  pbw_init(&p);
  put_tok_item(&p, 0x11, 4, 5, 0);
  assert_int_equal(plan_code(&t, 3, &p, &r), ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "item 0: more token ids than its n 4"));
  pbw_init(&p);
  put_tok_item(&p, 0x11, 4, 501, 1);
  assert_int_equal(plan_code(&t, 4, &p, &r), ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "item 0: more token ids than max_context 500"));
  /* Items beyond --max-sessions. */
  pbw_init(&p);
  for (int i = 0; i < 4; i++)
    put_tok_item(&p, 0x20 + (uint64_t)i, 1, 1, 0);
  assert_int_equal(plan_code(&t, 5, &p, &r), ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "more than 3 items"));
  /* All items' tokens beyond the pool's 672. */
  pbw_init(&p);
  put_tok_item(&p, 0x31, 400, 400, 0);
  put_tok_item(&p, 0x32, 400, 400, 0);
  assert_int_equal(plan_code(&t, 6, &p, &r), ATTND_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(r.status.message, "KV pool"));
  /* More doc lengths than keys. */
  int32_t docs[6] = {3, 0, 0, 0, 0, 0};
  uint32_t dshape[1] = {5};
  pbw_init(&p);
  put_mask_item(&p, 0, 3, attnd_v1_Mask_Kind_DOCUMENT, 0, docs, 5, dshape, 1);
  assert_int_equal(plan_code(&t, 7, &p, &r), ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "doc_lengths for kv_len 3"));
  /* Document masks expand to 16 bytes a key: 2 x 200 keys > --max-frame 4096. */
  int32_t d1[1] = {200};
  uint32_t s1[1] = {1};
  pbw_init(&p);
  put_mask_item(&p, 0, 200, attnd_v1_Mask_Kind_DOCUMENT, 0, d1, 1, s1, 1);
  put_mask_item(&p, 0, 200, attnd_v1_Mask_Kind_DOCUMENT, 0, d1, 1, s1, 1);
  assert_int_equal(plan_code(&t, 8, &p, &r), ATTND_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(r.status.message, "--max-frame"));
  assert_int_equal(fe.plans, plans); /* none reached the engine */
  /* Within every bound: admitted. */
  pbw_init(&p);
  put_tok_item(&p, 0x41, 300, 300, 1);
  put_tok_item(&p, 0x42, 300, 300, 0);
  assert_int_equal(plan_code(&t, 9, &p, &r), 0);
  assert_int_equal(fe.plans, plans + 1);
  tconn_free(&t);
}

/* Junk fields cost the loop thread nothing beyond a budget: a call holding
 * more fields than any valid one is refused after walking that many (its
 * id answered, the connection kept), a Request with more than 64 top-level
 * fields is not a Request (id 0, close). */
static void test_field_budget(void **state) {
  fix_t *f = *state;
  f->cfg.max_context = 500;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  /* OpenSession: 1024 + max_context fields at most. */
  for (int k = 0; k < 2; k++) {
    pbw_t o;
    pbw_init(&o);
    for (int i = 0; i < (k ? 1600 : 1400); i++)
      pbw_uint(&o, 100, 0);
    send_call(&t, 1 + (uint64_t)k, attnd_v1_Request_open_session_tag, &o);
    resp(&t, t.nout - 1, &r);
    if (k == 0) {
      assert_int_equal(r.status.code, 0); /* unknown fields within the budget are skipped */
    } else {
      assert_int_equal(r.id, 2);
      assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
      assert_non_null(strstr(r.status.message, "open_session: more than 1524 protobuf fields"));
      assert_false(t.close_after[t.nout - 1]);
    }
  }
  /* Inside an item's mask's tensor, as anywhere the decoder goes. */
  pbw_t p, it, mask, ten;
  pbw_init(&ten);
  for (int i = 0; i < 2000; i++)
    pbw_uint(&ten, 100, 0);
  pbw_init(&mask);
  pbw_sub(&mask, 4, &ten);
  pbw_init(&it);
  pbw_sub(&it, 5, &mask);
  pbw_init(&p);
  pbw_sub(&p, 1, &it);
  int plans = fe.plans;
  pbw_t h;
  pbw_init(&h);
  for (int i = 0; i < 1100; i++)
    pbw_uint(&h, 100, 0);
  send_call(&t, 3, attnd_v1_Request_health_tag, &h);
  resp(&t, t.nout - 1, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "health: more than 1024 protobuf fields"));
  /* 65 top-level fields. */
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, 4);
  for (int i = 0; i < 64; i++)
    pbw_uint(&w, 100, 0);
  pbw_bytes(&w, attnd_v1_Request_health_tag, "", 0);
  send_frame(&t, &w);
  resp(&t, t.nout - 1, &r);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_true(t.close_after[t.nout - 1]);
  tconn_free(&t);
  /* A Plan's budget adds its items' (1024 + 672 pool tokens + 16 x 10
   * sessions here), and counts fields nested in an item's mask's tensor. */
  f->cfg.max_sessions = 10;
  tconn_init(f, &t, 1000, 0);
  send_call(&t, 5, attnd_v1_Request_plan_tag, &p);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "plan: more than 1856 protobuf fields"));
  assert_int_equal(fe.plans, plans);
  tconn_free(&t);
}

/* A sliding window wider than any position is valid (the same as causal):
 * 2^31 and 2^32-1 pass, clamped to max_context for the kernels' int32
 * arithmetic; 0 is still refused. */
static void test_window_width(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  uint32_t w[4] = {1, 0x80000000u, 0xFFFFFFFFu, 4000};
  int32_t want[4] = {1, f->cfg.max_context, f->cfg.max_context, 4000};
  for (int k = 0; k < 4; k++) {
    pbw_t p;
    pbw_init(&p);
    put_mask_item(&p, 0, 3, attnd_v1_Mask_Kind_SLIDING_WINDOW, w[k], NULL, 0, NULL, 0);
    assert_int_equal(plan_code(&t, 1 + (uint64_t)k, &p, &r), 0);
    assert_int_equal(fe.plan_mask[0].kind, ATTND_MASK_SLIDING);
    assert_int_equal(fe.plan_mask[0].param, want[k]);
  }
  tconn_free(&t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_step_wire_checks, setup, teardown),
      cmocka_unit_test_setup_teardown(test_mask_expansion, setup, teardown),
      cmocka_unit_test_setup_teardown(test_decode_bounds, setup, teardown),
      cmocka_unit_test_setup_teardown(test_window_width, setup, teardown),
      cmocka_unit_test_setup_teardown(test_field_budget, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

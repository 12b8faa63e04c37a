/* test_rpc.c: the RPC layer's dispatch (daemon/rpc/rpc.c): missing, unknown
 * and garbled calls, duplicate ids and out-of-order completion, the drain,
 * a client leaving mid-request, and mutated requests (rpc_fixture.h). */
#include "rpc_fixture.h"

static void test_missing_and_unknown_call(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  send_call(&t, 5, 0, NULL); /* no call at all */
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, 6);
  pbw_bytes(&w, 99, "zz", 2); /* a call from the future */
  send_frame(&t, &w);
  assert_int_equal(t.nout, 2);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 5);
  assert_int_equal(r.status.code, ATTND_STATUS_UNIMPLEMENTED);
  assert_false(t.close_after[0]);
  resp(&t, 1, &r);
  assert_int_equal(r.id, 6);
  assert_int_equal(r.status.code, ATTND_STATUS_UNIMPLEMENTED);
  assert_false(t.close_after[1]);
  assert_int_equal(f->rpc.counters.answers[ATTND_M_UNKNOWN].errors, 2);
  tconn_free(&t);
}

static void test_garbled(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  pbw_t w;
  pbw_init(&w);
  pbw_raw(&w, "\xff\xff\xff\xff\xff", 5);
  send_frame(&t, &w);
  assert_int_equal(t.nout, 1);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_true(t.close_after[0]);
  /* A length running past the end of the frame. */
  tconn_t t2;
  tconn_init(f, &t2, 1000, 0);
  pbw_init(&w);
  pbw_uint(&w, 1, 9);
  pbw_raw(&w, "\x1a\x40\x01", 3); /* field 3, 64 bytes announced, 1 present */
  send_frame(&t2, &w);
  resp(&t2, 0, &r);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_true(t2.close_after[0]);
  tconn_free(&t);
  tconn_free(&t2);
}

static void test_duplicate_id_and_out_of_order(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  fe.hold = 1;
  send_call(&t, 3, attnd_v1_Request_open_session_tag, NULL);
  send_call(&t, 4, attnd_v1_Request_fork_tag, NULL);
  assert_int_equal(t.nout, 0);
  assert_int_equal(t.rc.pending, 2);
  send_call(&t, 3, attnd_v1_Request_truncate_tag, NULL);
  assert_int_equal(t.nout, 1);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 3);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "id 3 is already in flight"));
  /* Health is answered at once, between the two held calls. */
  send_call(&t, 9, attnd_v1_Request_health_tag, NULL);
  assert_int_equal(t.nout, 2);
  /* Complete in reverse order: responses come back out of order, by id. */
  fake_complete(1);
  fake_complete(0);
  assert_int_equal(t.nout, 4);
  resp(&t, 2, &r);
  assert_int_equal(r.id, 4);
  assert_int_equal(r.which_result, attnd_v1_Response_fork_tag);
  resp(&t, 3, &r);
  assert_int_equal(r.id, 3);
  assert_int_equal(r.which_result, attnd_v1_Response_open_session_tag);
  assert_int_equal(r.result.open_session.session, 0xabcdef0123456789ull);
  assert_int_equal(r.timing.queued_us, 11);
  assert_int_equal(r.timing.computing_us, 22);
  assert_int_equal(t.rc.pending, 0);
  assert_int_equal(t.rc.req_bytes, 0);
  assert_int_equal(f->rpc.inflight, 0);
  assert_true(t.progress >= 2);
  /* The id is free again. */
  fe.hold = 0;
  send_call(&t, 3, attnd_v1_Request_truncate_tag, NULL);
  resp(&t, 4, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.which_result, attnd_v1_Response_truncate_tag);
  tconn_free(&t);
}

/* Ids a client picked to share one bucket of an unseeded 64-bit finalizer
 * (the inverse of murmur3's fmix64 applied to i << 20). */
static uint64_t aimed_id(uint64_t i) {
  uint64_t y = i << 20;
  y ^= y >> 33;
  y *= 0x4f74430c22a54005ull;
  y ^= y >> 33;
  return y;
}

/* A deep pipeline: 20000 calls in flight on one connection, their ids
 * sequential or aimed at one bucket. The duplicate-id check of every new
 * call compares a handful of entries, not one per call in flight (a list
 * walk made 150k pipelined steps take minutes), and still finds a duplicate. */
static void test_deep_pipeline_o1(void **state) {
  fix_t *f = *state;
  enum { N = 20000 };
  for (int kind = 0; kind < 2; kind++) {
    tconn_t t;
    tconn_init(f, &t, 1000, 0);
    t.count_only = 1;
    fe.hold = 1;
    for (uint64_t i = 0; i < N; i++)
      send_call(&t, kind ? aimed_id(i + 1) : i + 1, attnd_v1_Request_truncate_tag, NULL);
    assert_int_equal(t.rc.pending, N);
    assert_int_equal(t.nresp, 0);
    uint64_t total = 0;
    uint32_t worst = 0;
    for (uint64_t i = 0; i < N; i++) {
      uint32_t p = attnd_rpc_conn_id_probes(&t.rc, kind ? aimed_id(i + 1) : i + 1);
      total += p;
      worst = p > worst ? p : worst;
    }
    uint32_t absent = attnd_rpc_conn_id_probes(&t.rc, kind ? aimed_id(N + 7) : N + 7);
    fprintf(stderr, "%s ids, %d in flight: %.2f probes per lookup, worst %u, absent id %u\n",
            kind ? "aimed" : "sequential", N, (double)total / N, worst, absent);
    assert_true(total <= 2 * (uint64_t)N);
    assert_true(worst <= 16 && absent <= 16);
    /* A duplicate deep in the pipeline is still refused, with its id. */
    t.count_only = 0;
    send_call(&t, kind ? aimed_id(N / 2) : N / 2, attnd_v1_Request_truncate_tag, NULL);
    assert_int_equal(t.nout, 1);
    attnd_v1_Response r;
    resp(&t, 0, &r);
    assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(r.status.message, "already in flight"));
    t.count_only = 1;
    fake_complete_all();
    assert_int_equal(t.nresp, N + 1);
    assert_int_equal(t.rc.pending, 0);
    assert_int_equal(attnd_rpc_conn_id_probes(&t.rc, 1), 0);
    fe.hold = 0;
    tconn_free(&t);
  }
  assert_int_equal(f->rpc.inflight, 0);
}

/* A frame that does not parse ends the connection, but only after every
 * call admitted before it has been answered: its Response{id 0} waits for
 * them, frames after it are not requests, and close_after comes with that
 * last answer only. */
static void test_frame_error_after_answers(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  fe.hold = 1;
  send_call(&t, 1, attnd_v1_Request_truncate_tag, NULL);
  send_call(&t, 2, attnd_v1_Request_fork_tag, NULL);
  pbw_t w;
  pbw_init(&w);
  pbw_raw(&w, "\xff\xff\xff", 3);
  send_frame(&t, &w);
  assert_int_equal(t.nout, 0);
  assert_true(t.rc.ending);
  send_call(&t, 3, attnd_v1_Request_health_tag, NULL); /* after the end: dropped */
  assert_int_equal(t.nout, 0);
  fake_complete(1);
  assert_int_equal(t.nout, 1);
  fake_complete(0);
  assert_int_equal(t.nout, 3);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 2);
  assert_false(t.close_after[0]);
  resp(&t, 1, &r);
  assert_int_equal(r.id, 1);
  assert_false(t.close_after[1]);
  resp(&t, 2, &r);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_true(t.close_after[2]);
  fe.hold = 0;
  tconn_free(&t);
}

static int idle_calls;

static void on_idle(void *arg) {
  idle_calls++;
}

static void test_drain(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  fe.hold = 1;
  send_call(&t, 1, attnd_v1_Request_open_session_tag, NULL);
  f->rpc.draining = 1;
  f->rpc.idle_cb = on_idle;
  idle_calls = 0;
  send_call(&t, 2, attnd_v1_Request_open_session_tag, NULL);
  send_call(&t, 3, attnd_v1_Request_health_tag, NULL);
  assert_int_equal(t.nout, 2);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 2);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAVAILABLE);
  resp(&t, 1, &r);
  assert_int_equal(r.id, 3);
  assert_string_equal(r.result.health.status, "draining");
  assert_int_equal(idle_calls, 0);
  fake_complete(0); /* the in-flight call still finishes and is answered */
  assert_int_equal(t.nout, 3);
  resp(&t, 2, &r);
  assert_int_equal(r.id, 1);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(idle_calls, 1);
  tconn_free(&t);
}

static void test_disconnect_mid_request(void **state) {
  fix_t *f = *state;
  tconn_t t;
  tconn_init(f, &t, 1000, 0);
  fe.hold = 1;
  send_call(&t, 1, attnd_v1_Request_open_session_tag, NULL);
  send_call(&t, 2, attnd_v1_Request_fork_tag, NULL);
  assert_int_equal(attnd_rpc_conn_closed(&t.rc), 0); /* still held by 2 requests */
  assert_int_equal(fe.closed_conn, t.rc.id);
  fake_complete(0);
  assert_int_equal(t.released, 0);
  fake_complete(0);
  assert_int_equal(t.nout, 0); /* results dropped */
  assert_int_equal(t.released, 1);
  assert_int_equal(f->rpc.inflight, 0);
  tconn_free(&t);
}

/* Mutated and truncated requests never crash and always get exactly one
 * well-formed answer (or the frame is declared unparsable and the connection
 * is told to close). Run under ASan/UBSan (ATTND_SANITIZE=ON) to mean more. */
static void test_fuzz_requests(void **state) {
  fix_t *f = *state;
  srand(12345);
  /* A valid step to mutate. */
  static uint16_t q[2 * 4 * 64], kv[2 * 2 * 64];
  uint32_t qs[3] = {2, 4, 64}, ks[3] = {2, 2, 64};
  pbw_t st;
  pbw_init(&st);
  pbw_uint(&st, 1, 1);
  put_item(&st, 3, 0x1, 0, 2, 1);
  pbw_tensor(&st, 4, attnd_v1_DType_DTYPE_BF16, qs, 3, q, sizeof(q));
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_tensor(&st, 6, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_t base;
  pbw_init(&base);
  pbw_uint(&base, 1, 5);
  pbw_sub(&base, attnd_v1_Request_step_tag, &st);
  int answered = 0, closed = 0;
  for (int iter = 0; iter < 3000; iter++) {
    tconn_t t;
    tconn_init(f, &t, 1000, 0);
    pbw_t w;
    pbw_init(&w);
    size_t n = base.n;
    if (iter % 3 == 0)
      n = (size_t)rand() % base.n + 1; /* truncated */
    pbw_raw(&w, base.b, n);
    int flips = 1 + rand() % 4;
    for (int k = 0; k < flips; k++)
      w.b[(size_t)rand() % w.n] = (uint8_t)rand();
    send_frame(&t, &w);
    assert_int_equal(t.nout, 1);
    attnd_v1_Response r;
    resp(&t, 0, &r);
    assert_true(r.has_status);
    if (t.close_after[0]) {
      assert_int_equal(r.id, 0);
      closed++;
    } else {
      answered++;
    }
    assert_int_equal(t.rc.pending, 0);
    tconn_free(&t);
  }
  pbw_free(&base);
  fprintf(stderr, "fuzz: 3000 mutated steps, %d answered, %d unparsable\n", answered, closed);
  assert_true(answered > 0);
  assert_int_equal(f->rpc.inflight, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_missing_and_unknown_call, setup, teardown),
      cmocka_unit_test_setup_teardown(test_garbled, setup, teardown),
      cmocka_unit_test_setup_teardown(test_duplicate_id_and_out_of_order, setup, teardown),
      cmocka_unit_test_setup_teardown(test_deep_pipeline_o1, setup, teardown),
      cmocka_unit_test_setup_teardown(test_frame_error_after_answers, setup, teardown),
      cmocka_unit_test_setup_teardown(test_drain, setup, teardown),
      cmocka_unit_test_setup_teardown(test_disconnect_mid_request, setup, teardown),
      cmocka_unit_test_setup_teardown(test_fuzz_requests, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_rpc_methods.c: the method table's rows (daemon/rpc/methods.c,
 * info.c): Health, OpenSession, Step with its tensors left in the frame,
 * Plan then Step, Stats and ListSessions (rpc_fixture.h). */
#include "rpc_fixture.h"

static void test_health(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  send_call(&t, 1, attnd_v1_Request_health_tag, NULL);
  assert_int_equal(t.nout, 1);
  assert_false(t.close_after[0]);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 1);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.epoch, f->rpc.epoch);
  assert_true(r.has_timing);
  assert_int_equal(r.which_result, attnd_v1_Response_health_tag);
  attnd_v1_HealthResponse *h = &r.result.health;
  assert_string_equal(h->status, "serving");
  assert_string_equal(h->backend, "cpu");
  assert_string_equal(h->device, "fake cpu");
  assert_int_equal(h->epoch, f->rpc.epoch);
  assert_int_equal(h->model.layers, 2);
  assert_int_equal(h->model.q_heads, 4);
  assert_int_equal(h->model.kv_heads, 2);
  assert_int_equal(h->model.head_dim, 64);
  assert_int_equal(h->model.block_size, 16);
  assert_string_equal(h->model.dtype, "bf16");
  assert_string_equal(h->model.kv_cache, "bf16");
  assert_string_equal(h->model.rope, "neox");
  assert_int_equal(h->model.rotary_dim, 64);
  assert_int_equal(h->model.max_context, 131072);
  /* K and V, 2 kv heads, 64 dims, 2 bytes, 2 layers. */
  assert_int_equal(h->model.kv_bytes_per_token, 2 * 2 * 64 * 2 * 2);
  assert_int_equal(h->kv_blocks, 42);
  assert_true(h->model.softmax_scale > 0.1249f && h->model.softmax_scale < 0.1251f);
  tconn_free(&t);
}

static void test_open_session_tokens_and_errors(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1234, 0);
  pbw_t o;
  pbw_init(&o);
  /* Packed tokens and one unpacked: both forms must decode. */
  pbw_t packed;
  pbw_init(&packed);
  for (int i = 0; i < 300; i++)
    pbw_varint(&packed, (uint64_t)i * 1000);
  pbw_sub(&o, 1, &packed);
  pbw_uint(&o, 1, 77);
  pbw_bytes(&o, 2, "salt", 4);
  send_call(&t, 1, attnd_v1_Request_open_session_tag, &o);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.result.open_session.cached_len, 301);
  assert_int_equal(fe.last_identity, 1234);
  /* Engine errors keep their message and map through attnd_err_status. */
  pbw_init(&o);
  pbw_fixed64(&o, 1, 42);
  send_call(&t, 2, attnd_v1_Request_close_session_tag, &o);
  resp(&t, 1, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_NOT_FOUND);
  assert_non_null(strstr(r.status.message, "not found"));
  /* Salt over 64 bytes: INVALID_ARGUMENT with the id, connection kept. */
  char salt[80];
  memset(salt, 's', sizeof(salt));
  pbw_init(&o);
  pbw_bytes(&o, 2, salt, sizeof(salt));
  send_call(&t, 3, attnd_v1_Request_open_session_tag, &o);
  resp(&t, 2, &r);
  assert_int_equal(r.id, 3);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "salt"));
  assert_false(t.close_after[2]);
  tconn_free(&t);
}

static void test_step_zero_copy(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  /* Two items, n = 1 and n = 3: T = 4 rows; q [4, 4, 64], k/v [4, 2, 64] bf16. */
  static uint16_t q[4 * 4 * 64], kv[4 * 2 * 64];
  for (size_t i = 0; i < sizeof(q) / 2; i++)
    q[i] = (uint16_t)(i * 7 + 1);
  for (size_t i = 0; i < sizeof(kv) / 2; i++)
    kv[i] = (uint16_t)(i * 3 + 2);
  uint32_t qs[3] = {4, 4, 64}, ks[3] = {4, 2, 64};
  pbw_t st;
  pbw_init(&st);
  pbw_uint(&st, 1, 5); /* layer */
  put_item(&st, 3, 0x1111, 10, 1, 1);
  put_item(&st, 3, 0x2222, 0, 3, 1);
  pbw_tensor(&st, 4, attnd_v1_DType_DTYPE_BF16, qs, 3, q, sizeof(q));
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_tensor(&st, 6, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_uint(&st, 7, 1); /* want_lse */
  send_call(&t, 77, attnd_v1_Request_step_tag, &st);
  assert_int_equal(t.nout, 1);
  assert_true(fe.step_in_frame);
  assert_int_equal(fe.step.layer, 5);
  assert_int_equal(fe.step.plan, 0);
  assert_int_equal(fe.step.nitems, 2);
  assert_int_equal(fe.items[0].session, 0x1111);
  assert_int_equal(fe.items[0].start, 10);
  assert_int_equal(fe.items[0].n, 1);
  assert_int_equal(fe.items[0].ntokens, 1);
  assert_int_equal(fe.tokens[0][0], 510);
  assert_int_equal(fe.items[1].ntokens, 3);
  assert_int_equal(fe.tokens[1][2], 502);
  assert_int_equal(fe.items[1].mask.kind, ATTND_MASK_SLIDING);
  assert_int_equal(fe.items[1].mask.param, 8);
  assert_int_equal(fe.step.q.ndim, 3);
  assert_int_equal(fe.step.q.shape[0], 4);
  assert_int_equal(fe.step.k.nbytes, sizeof(kv));
  assert_true(fe.step.want_lse);
  resp(&t, 0, &r);
  assert_int_equal(r.id, 77);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.which_result, attnd_v1_Response_step_tag);
  assert_true(r.result.step.has_out);
  assert_int_equal(r.result.step.out.shape_count, 3);
  assert_int_equal(r.result.step.out.shape[0], 4);
  assert_int_equal(r.result.step.out.shape[1], 4);
  assert_int_equal(r.result.step.out.shape[2], 64);
  assert_true(r.result.step.has_lse);
  /* The output bytes are exactly the echoed q. */
  const uint8_t *sp, *op, *dp;
  size_t sl, ol, dl;
  assert_int_equal(pbr_find(t.out[0] + 4, t.outlen[0] - 4, 18, &sp, &sl), 0);
  assert_int_equal(pbr_find(sp, sl, 1, &op, &ol), 0);
  assert_int_equal(pbr_find(op, ol, 3, &dp, &dl), 0);
  assert_int_equal(dl, sizeof(q));
  assert_memory_equal(dp, q, sizeof(q));
  assert_int_equal(pbr_find(sp, sl, 2, &op, &ol), 0);
  assert_int_equal(pbr_find(op, ol, 3, &dp, &dl), 0);
  assert_int_equal(dl, 4 * 2 * sizeof(float));
  /* A prefill (an item with n > 1) lands in the prefill histogram. */
  assert_int_equal(f->rpc.counters.step_latency[ATTND_STEP_PREFILL].count, 1);
  assert_int_equal(f->rpc.counters.step_latency[ATTND_STEP_DECODE].count, 0);
  tconn_free(&t);
}

/* Same-host zero-copy (docs/protocol.md): RegisterBuffer is refused before
 * the engine for a TCP peer off loopback, and by the engine's backend (the
 * fake's is a CPU backend) for a Unix peer; a handle that is not 64 bytes,
 * and a step naming a buffer nobody registered, are INVALID_ARGUMENT and
 * never reach the engine. */
static void test_register_buffer_refusals(void **state) {
  fix_t *f = *state;
  tconn_t ux, tcp;
  attnd_v1_Response r;
  tconn_init(f, &ux, 1000, 0);
  tconn_init(f, &tcp, ATTND_IDENTITY_ANON, 0); /* not Unix, not marked same_host */
  uint8_t handle[64];
  memset(handle, 7, sizeof(handle));
  pbw_t rb;
  for (int i = 0; i < 3; i++) { /* off loopback, Unix, Unix with a short handle */
    pbw_init(&rb);
    pbw_bytes(&rb, 1, handle, i == 2 ? 63 : 64);
    pbw_uint(&rb, 2, 1 << 20);
    pbw_bytes(&rb, 3, "GPU-1", 5);
    send_call(i ? &ux : &tcp, 1 + (uint64_t)i, attnd_v1_Request_register_buffer_tag, &rb);
  }
  resp(&tcp, 0, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_FAILED_PRECONDITION);
  assert_non_null(strstr(r.status.message, "daemon's host"));
  resp(&ux, 0, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_FAILED_PRECONDITION);
  assert_non_null(strstr(r.status.message, "cpu backend"));
  resp(&ux, 1, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "64"));
  /* A step whose q names buffer 42: nobody registered it. */
  fe.step.layer = 999;
  pbw_t st, ref;
  pbw_init(&st);
  pbw_uint(&st, 1, 0);
  put_item(&st, 3, 0x1111, 0, 1, 1);
  pbw_init(&ref);
  pbw_uint(&ref, 1, 42);
  pbw_uint(&ref, 2, 0);
  pbw_uint(&ref, 3, attnd_v1_DType_DTYPE_BF16);
  pbw_uint(&ref, 4, 1);
  pbw_sub(&st, 9, &ref);
  send_call(&ux, 4, attnd_v1_Request_step_tag, &st);
  resp(&ux, 2, &r);
  assert_int_equal(r.id, 4);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "not registered"));
  assert_int_equal(fe.step.layer, 999); /* the engine never saw it */
  /* ReleaseBuffer of an unknown id: the same. */
  pbw_t rel;
  pbw_init(&rel);
  pbw_uint(&rel, 1, 42);
  send_call(&ux, 5, attnd_v1_Request_release_buffer_tag, &rel);
  resp(&ux, 3, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  tconn_free(&ux);
  tconn_free(&tcp);
}

static void test_plan_then_step(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  pbw_t p;
  pbw_init(&p);
  put_item(&p, 1, 0x1, 5, 1, 1);
  put_item(&p, 1, 0x2, 9, 1, 1);
  send_call(&t, 1, attnd_v1_Request_plan_tag, &p);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  uint64_t plan = r.result.plan.plan;
  assert_true(plan != 0);
  pbw_t st;
  pbw_init(&st);
  pbw_uint(&st, 1, 1);
  pbw_fixed64(&st, 2, plan);
  uint16_t kv[2 * 2 * 64] = {0};
  uint32_t ks[3] = {2, 2, 64};
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_tensor(&st, 6, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  send_call(&t, 2, attnd_v1_Request_step_tag, &st);
  resp(&t, 1, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.step.plan, plan);
  assert_int_equal(fe.step.nitems, 0);
  assert_false(fe.step.q.present);
  /* Every item of the plan has n == 1: a decode step. */
  assert_int_equal(f->rpc.counters.step_latency[ATTND_STEP_DECODE].count, 1);
  /* A Step naming that plan from another connection of the identity is
   * counted too (the engine reports the kind). */
  tconn_t t2;
  tconn_init(f, &t2, 1000, 0);
  pbw_init(&st);
  pbw_uint(&st, 1, 2);
  pbw_fixed64(&st, 2, plan);
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  pbw_tensor(&st, 6, attnd_v1_DType_DTYPE_BF16, ks, 3, kv, sizeof(kv));
  send_call(&t2, 9, attnd_v1_Request_step_tag, &st);
  resp(&t2, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(f->rpc.counters.step_latency[ATTND_STEP_DECODE].count, 2);
  tconn_free(&t2);
  /* A plan and inline items together is a wire-level error. */
  pbw_init(&st);
  pbw_fixed64(&st, 2, plan);
  put_item(&st, 3, 0x1, 5, 1, 0);
  send_call(&t, 3, attnd_v1_Request_step_tag, &st);
  resp(&t, 2, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(r.status.message, "plan"));
  tconn_free(&t);
}

static void test_stats_and_list(void **state) {
  fix_t *f = *state;
  tconn_t t;
  attnd_v1_Response r;
  tconn_init(f, &t, 1000, 0);
  send_call(&t, 1, attnd_v1_Request_health_tag, NULL);
  send_call(&t, 2, attnd_v1_Request_health_tag, NULL);
  send_call(&t, 3, attnd_v1_Request_fork_tag, NULL);
  send_call(&t, 4, attnd_v1_Request_list_sessions_tag, NULL);
  f->rpc.counters.connections = 1;
  send_call(&t, 5, attnd_v1_Request_stats_tag, NULL);
  resp(&t, 4, &r);
  assert_int_equal(r.which_result, attnd_v1_Response_stats_tag);
  attnd_v1_StatsResponse *s = &r.result.stats;
  assert_int_equal(s->connections, 1);
  assert_int_equal(s->sessions, 3);
  assert_int_equal(s->blocks_total, 42);
  assert_int_equal(s->prefix_queries, 7);
  assert_string_equal(s->kv_cache, "bf16");
  int seen = 0;
  for (pb_size_t i = 0; i < s->methods_count; i++) {
    if (strcmp(s->methods[i].method, "health") == 0) {
      assert_int_equal(s->methods[i].requests, 2);
      seen++;
    }
    if (strcmp(s->methods[i].method, "stats") == 0) {
      assert_int_equal(s->methods[i].requests, 1);
      seen++;
    }
  }
  assert_int_equal(seen, 2);
  assert_true(s->bytes_in > 0);
  assert_true(s->bytes_out > 0);
  /* ListSessions carries the engine's sessions of this identity. */
  const uint8_t *lp, *sp;
  size_t ll, sl;
  assert_int_equal(pbr_find(t.out[3] + 4, t.outlen[3] - 4, 20, &lp, &ll), 0);
  assert_int_equal(pbr_find(lp, ll, 1, &sp, &sl), 0); /* the last SessionInfo */
  attnd_v1_SessionInfo si = attnd_v1_SessionInfo_init_zero;
  pb_istream_t is = pb_istream_from_buffer(sp, sl);
  assert_true(pb_decode(&is, attnd_v1_SessionInfo_fields, &si));
  assert_int_equal(si.session, 101);
  assert_int_equal(si.len, 20);
  tconn_free(&t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_health, setup, teardown),
      cmocka_unit_test_setup_teardown(test_open_session_tokens_and_errors, setup, teardown),
      cmocka_unit_test_setup_teardown(test_step_zero_copy, setup, teardown),
      cmocka_unit_test_setup_teardown(test_plan_then_step, setup, teardown),
      cmocka_unit_test_setup_teardown(test_register_buffer_refusals, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stats_and_list, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_rpc_auth.c: tokens and Hello (daemon/rpc/auth.c) (rpc_fixture.h). */
#include "rpc_fixture.h"

static void test_hello_auth(void **state) {
  fix_t *f = *state;
  attnd_v1_Response r;
  /* A token file, and an rpc that reads it. */
  char path[128];
  snprintf(path, sizeof(path), "%s/tokens", f->dir);
  FILE *fp = fopen(path, "w");
  fputs("# tokens\nsecret-one\n\n  secret-two  \n", fp);
  fclose(fp);
  attnd_rpc_free(&f->rpc);
  snprintf(f->cfg.token_file, sizeof(f->cfg.token_file), "%s", path);
  char err[256];
  assert_int_equal(attnd_rpc_init(&f->rpc, &f->loop, f->engine, &f->cfg, err, sizeof(err)), 0);
  assert_int_equal(f->rpc.ntokens, 2);
  assert_true(attnd_rpc_token_ok(&f->rpc, "secret-two"));
  assert_false(attnd_rpc_token_ok(&f->rpc, "secret-tw"));
  assert_false(attnd_rpc_token_ok(&f->rpc, "secret-twoo"));
  assert_false(attnd_rpc_token_ok(&f->rpc, ""));

  tconn_t t;
  /* Off loopback: anything before Hello is UNAUTHENTICATED, then close. */
  tconn_init(f, &t, ATTND_IDENTITY_ANON, 1);
  send_call(&t, 1, attnd_v1_Request_health_tag, NULL);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAUTHENTICATED);
  assert_true(t.close_after[0]);
  tconn_free(&t);
  /* A wrong token. */
  tconn_init(f, &t, ATTND_IDENTITY_ANON, 1);
  pbw_t h;
  pbw_init(&h);
  pbw_bytes(&h, 1, "nope", 4);
  send_call(&t, 2, attnd_v1_Request_hello_tag, &h);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAUTHENTICATED);
  assert_true(t.close_after[0]);
  tconn_free(&t);
  /* The right token: the token's identity, then calls work. */
  tconn_init(f, &t, ATTND_IDENTITY_ANON, 1);
  pbw_init(&h);
  pbw_bytes(&h, 1, "secret-two", 10);
  send_call(&t, 3, attnd_v1_Request_hello_tag, &h);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.which_result, attnd_v1_Response_hello_tag);
  assert_false(t.close_after[0]);
  assert_true(t.rc.identity & ATTND_IDENTITY_TOKEN_BIT);
  send_call(&t, 4, attnd_v1_Request_open_session_tag, NULL);
  resp(&t, 1, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.last_identity, t.rc.identity);
  uint64_t tok_identity = t.rc.identity;
  tconn_free(&t);
  /* Loopback without Hello: the shared anonymous identity. */
  tconn_init(f, &t, ATTND_IDENTITY_ANON, 0);
  send_call(&t, 5, attnd_v1_Request_open_session_tag, NULL);
  resp(&t, 0, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.last_identity, ATTND_IDENTITY_ANON);
  assert_true(tok_identity != ATTND_IDENTITY_ANON);
  tconn_free(&t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_hello_auth, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

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
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "secret-one"), 1);
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

static void write_tokens(const char *path, const char *text) {
  FILE *fp = fopen(path, "w");
  assert_non_null(fp);
  fputs(text, fp);
  fclose(fp);
}

static int hello_on(tconn_t *t, uint64_t id, const char *tok, attnd_v1_Response *r) {
  pbw_t h;
  pbw_init(&h);
  pbw_bytes(&h, 1, tok, strlen(tok));
  send_call(t, id, attnd_v1_Request_hello_tag, &h);
  resp(t, t->nout - 1, r);
  return (int)r->status.code;
}

/* A SetScales whose tensors are wrong: an operator gets as far as the
 * engine (the fake answers OK), anyone else PERMISSION_DENIED before it. */
static int scales_on(tconn_t *t, uint64_t id, attnd_v1_Response *r) {
  send_call(t, id, attnd_v1_Request_set_scales_tag, NULL);
  resp(t, t->nout - 1, r);
  return (int)r->status.code;
}

/* Daemon-wide state changes only from an operator (docs/protocol.md section
 * 1): root or the daemon's own uid on the Unix socket, or a connection that
 * presented an `operator:` token (on any transport). The check is against
 * the token set in force, so a reload that drops an operator token takes the
 * right away; a reload of a bad file keeps the old set. */
static void test_operators_and_reload(void **state) {
  fix_t *f = *state;
  attnd_v1_Response r;
  char path[128];
  snprintf(path, sizeof(path), "%s/tokens", f->dir);
  write_tokens(path, "plain-tok\noperator: op-tok\n");
  attnd_rpc_free(&f->rpc);
  snprintf(f->cfg.token_file, sizeof(f->cfg.token_file), "%s", path);
  char err[256];
  assert_int_equal(attnd_rpc_init(&f->rpc, &f->loop, f->engine, &f->cfg, err, sizeof(err)), 0);
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "plain-tok"), 1);
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "op-tok"), 2);
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "operator: op-tok"), 0);
  uint64_t me = (uint64_t)geteuid();
  uint64_t other = me == 4242 ? 4243 : 4242; /* neither root nor us */
  tconn_t own, root, stranger, anon, plain, op, unix_op;
  tconn_init(f, &own, me, 0);
  tconn_init(f, &root, 0, 0);
  tconn_init(f, &stranger, other, 0);
  tconn_init(f, &anon, ATTND_IDENTITY_ANON, 0);
  tconn_init(f, &plain, ATTND_IDENTITY_ANON, 0);
  tconn_init(f, &op, ATTND_IDENTITY_ANON, 0);
  tconn_init(f, &unix_op, other, 0);
  assert_int_equal(hello_on(&plain, 1, "plain-tok", &r), 0);
  assert_int_equal(hello_on(&op, 1, "op-tok", &r), 0);
  assert_int_equal(hello_on(&unix_op, 1, "op-tok", &r), 0);
  assert_int_equal(unix_op.rc.identity, other); /* the uid stays its identity */
  fe.scales_calls = 0;
  assert_int_equal(scales_on(&own, 2, &r), 0);
  assert_int_equal(scales_on(&root, 2, &r), 0);
  assert_int_equal(scales_on(&op, 2, &r), 0);
  assert_int_equal(scales_on(&unix_op, 2, &r), 0);
  assert_int_equal(fe.scales_calls, 4);
  tconn_t *denied[] = {&stranger, &anon, &plain};
  for (int i = 0; i < 3; i++) {
    assert_int_equal(scales_on(denied[i], 3, &r), ATTND_STATUS_PERMISSION_DENIED);
    assert_non_null(strstr(r.status.message, "only an operator"));
    assert_false(denied[i]->close_after[denied[i]->nout - 1]);
  }
  assert_int_equal(fe.scales_calls, 4); /* the engine never saw them */
  /* SetSinks is operator-only the same way. */
  fe.sinks_calls = 0;
  send_call(&own, 5, attnd_v1_Request_set_sinks_tag, NULL);
  resp(&own, own.nout - 1, &r);
  assert_int_equal(r.status.code, 0);
  send_call(&stranger, 5, attnd_v1_Request_set_sinks_tag, NULL);
  resp(&stranger, stranger.nout - 1, &r);
  assert_int_equal(r.status.code, ATTND_STATUS_PERMISSION_DENIED);
  assert_int_equal(fe.sinks_calls, 1);
  /* A bad file (a token over 255 bytes, on line 2): the old set stays. */
  char big[400];
  memset(big, 'x', sizeof(big) - 1);
  big[sizeof(big) - 1] = 0;
  char text[512];
  snprintf(text, sizeof(text), "new-tok\n%s\n", big);
  write_tokens(path, text);
  err[0] = 0;
  assert_int_equal(attnd_auth_reload(&f->rpc, err, sizeof(err)), ATTND_EINVAL);
  assert_non_null(strstr(err, ":2: token longer than 255 bytes"));
  assert_null(strstr(err, "xxxx")); /* never a token in a message */
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "op-tok"), 2);
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "new-tok"), 0);
  unlink(path);
  assert_int_equal(attnd_auth_reload(&f->rpc, err, sizeof(err)), ATTND_EINVAL);
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "plain-tok"), 1);
  /* A good one: in force at once. op-tok is a plain token now. */
  write_tokens(path, "# rotated\nop-tok\noperator:new-op\n");
  assert_int_equal(attnd_auth_reload(&f->rpc, err, sizeof(err)), 0);
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "plain-tok"), 0);
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "op-tok"), 1);
  assert_int_equal(attnd_rpc_token_ok(&f->rpc, "new-op"), 2);
  assert_int_equal(scales_on(&op, 4, &r), ATTND_STATUS_PERMISSION_DENIED);
  assert_int_equal(scales_on(&unix_op, 4, &r), ATTND_STATUS_PERMISSION_DENIED);
  assert_int_equal(scales_on(&own, 4, &r), 0);
  assert_int_equal(hello_on(&stranger, 5, "new-op", &r), 0);
  assert_int_equal(scales_on(&stranger, 6, &r), 0);
  /* An operator's empty Hello changes nothing; a wrong token on the Unix
   * socket is UNAUTHENTICATED but keeps the connection and its rights. */
  assert_int_equal(hello_on(&stranger, 7, "", &r), 0);
  assert_int_equal(scales_on(&stranger, 8, &r), 0);
  tconn_t *all[] = {&own, &root, &stranger, &anon, &plain, &op, &unix_op};
  for (int i = 0; i < 7; i++)
    tconn_free(all[i]);
}

/* A wrong token: on the Unix socket the uid stays the identity and the
 * connection stays open (UNAUTHENTICATED answered); on TCP it closes, since
 * going on as the shared anonymous identity would expose the client's
 * sessions to every other anonymous client. */
static void test_wrong_token_per_transport(void **state) {
  fix_t *f = *state;
  attnd_v1_Response r;
  char path[128];
  snprintf(path, sizeof(path), "%s/tokens", f->dir);
  write_tokens(path, "good\n");
  attnd_rpc_free(&f->rpc);
  snprintf(f->cfg.token_file, sizeof(f->cfg.token_file), "%s", path);
  char err[256];
  assert_int_equal(attnd_rpc_init(&f->rpc, &f->loop, f->engine, &f->cfg, err, sizeof(err)), 0);
  tconn_t u, tcp;
  tconn_init(f, &u, 1234, 0);
  tconn_init(f, &tcp, ATTND_IDENTITY_ANON, 0);
  assert_int_equal(hello_on(&u, 1, "bad", &r), ATTND_STATUS_UNAUTHENTICATED);
  assert_false(u.close_after[0]);
  assert_int_equal(u.rc.identity, 1234);
  send_call(&u, 2, attnd_v1_Request_open_session_tag, NULL);
  resp(&u, 1, &r);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(fe.last_identity, 1234);
  assert_int_equal(hello_on(&tcp, 1, "bad", &r), ATTND_STATUS_UNAUTHENTICATED);
  assert_true(tcp.close_after[0]);
  tconn_free(&u);
  tconn_free(&tcp);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_hello_auth, setup, teardown),
      cmocka_unit_test_setup_teardown(test_operators_and_reload, setup, teardown),
      cmocka_unit_test_setup_teardown(test_wrong_token_per_transport, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

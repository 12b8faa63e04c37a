/* test_net_listen.c: the listeners (daemon/net/listen.c, sock.c): start and
 * stop, IPv6 loopback, a stale socket file, refusals at start, the connection
 * limit, many connections, and Hello{token} where it is required
 * (net_fixture.h). */
#include "net_fixture.h"

static void test_start_stop_health(void **state) {
  harness_t *h = h_up(NULL);
  attnd_v1_Response r;
  assert_true(h->tcp_port > 0);
  struct stat st;
  assert_int_equal(stat(h->cfg.socket_path, &st), 0);
  assert_true(S_ISSOCK(st.st_mode));
  assert_int_equal(st.st_mode & 0777, 0660);

  int u = connect_unix(h->cfg.socket_path);
  health_ok(u, 1, &r);
  assert_string_equal(r.result.health.status, "serving");
  assert_int_equal(r.result.health.tcp_port, (uint32_t)h->tcp_port);
  assert_int_equal(r.result.health.epoch, h->epoch);
  assert_int_equal(r.epoch, h->epoch);
  assert_int_equal(r.result.health.model.layers, 2);
  assert_int_equal(r.result.health.model.kv_bytes_per_token, 2 * 2 * 64 * 2 * 2);
  int t = connect_tcp_addr("127.0.0.1", h->tcp_port);
  health_ok(t, 2, &r);
  assert_int_equal(r.result.health.epoch, h->epoch);
  close(u);
  close(t);
  h_down(h);
}

static void tweak_v6(attnd_config_t *c) {
  snprintf(c->listen, sizeof(c->listen), "[::1]:0");
}

/* An IPv6 loopback listener: bound, reported, and loopback (no Hello). */
static void test_ipv6_loopback(void **state) {
  int probe = socket(AF_INET6, SOCK_STREAM, 0);
  struct sockaddr_in6 a;
  memset(&a, 0, sizeof(a));
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  int can = probe >= 0 && bind(probe, (struct sockaddr *)&a, sizeof(a)) == 0;
  if (probe >= 0)
    close(probe);
  if (!can) {
    skip();
    return;
  }
  harness_t *h = h_up(tweak_v6);
  assert_true(h->tcp_port > 0);
  int c = socket(AF_INET6, SOCK_STREAM, 0);
  a.sin6_port = htons((uint16_t)h->tcp_port);
  assert_int_equal(connect(c, (struct sockaddr *)&a, sizeof(a)), 0);
  attnd_v1_Response r;
  health_ok(c, 1, &r);
  assert_int_equal(r.result.health.tcp_port, (uint32_t)h->tcp_port);
  close(c);
  h_down(h);
}

static void test_stale_socket_removed(void **state) {
  harness_t *h = h_new(NULL);
  /* A socket file nobody listens on, as a crashed daemon leaves it. */
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un a;
  sun_set(&a, h->cfg.socket_path);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
  close(fd);
  h_start(h);
  attnd_v1_Response r;
  int u = connect_unix(h->cfg.socket_path);
  health_ok(u, 1, &r);
  close(u);
  h_down(h);
}

/* Refusals at start: a socket directory others may write to, and a socket a
 * live daemon still answers on. Start failures leave nothing open. */
static void test_start_refusals(void **state) {
  harness_t *h = h_up(NULL);
  char err[256];
  uv_loop_t loop;
  attnd_server_t *s = NULL;
  attnd_config_t cfg = h->cfg;
  snprintf(cfg.listen, sizeof(cfg.listen), "%s", "");
  /* The running harness holds cfg.socket_path. */
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_not_equal(attnd_server_start(&s, &loop, &cfg, NULL, err, sizeof(err)), 0);
  assert_non_null(strstr(err, "another daemon"));
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
  /* A world-writable directory. */
  char dir[160];
  snprintf(dir, sizeof(dir), "%s/open", h->dir);
  assert_int_equal(mkdir(dir, 0777), 0);
  assert_int_equal(chmod(dir, 0777), 0);
  snprintf(cfg.socket_path, sizeof(cfg.socket_path), "%s/attnd.sock", dir);
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_not_equal(attnd_server_start(&s, &loop, &cfg, NULL, err, sizeof(err)), 0);
  assert_non_null(strstr(err, "world-writable"));
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
  /* A busy TCP port. */
  snprintf(cfg.socket_path, sizeof(cfg.socket_path), "%s", "");
  snprintf(cfg.listen, sizeof(cfg.listen), "127.0.0.1:%d", h->tcp_port);
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_not_equal(attnd_server_start(&s, &loop, &cfg, NULL, err, sizeof(err)), 0);
  assert_non_null(strstr(err, "--listen"));
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
  h_down(h);
}

static void tweak_maxconn(attnd_config_t *c) {
  c->max_connections = 2;
}

static void test_max_connections(void **state) {
  harness_t *h = h_up(tweak_maxconn);
  attnd_v1_Response r;
  int a = connect_unix(h->cfg.socket_path);
  int b = connect_tcp_addr("127.0.0.1", h->tcp_port);
  health_ok(a, 1, &r);
  health_ok(b, 1, &r);
  int c = connect_unix(h->cfg.socket_path);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_RESOURCE_EXHAUSTED);
  expect_eof(c);
  close(c);
  close(a);
  /* Once one leaves, a new one is served. */
  for (int tries = 0;; tries++) {
    c = connect_unix(h->cfg.socket_path);
    send_call(c, 9, attnd_v1_Request_health_tag);
    assert_int_equal(recv_resp(c, &r), 0);
    if (r.status.code == 0)
      break;
    close(c);
    assert_true(tries < 50); /* the close of a may take a loop turn */
    usleep(20000);
  }
  assert_int_equal(r.id, 9);
  close(c);
  close(b);
  h_down(h);
}

/* Many clients at once, each pipelining: every request on every connection is
 * answered, on its own connection. */
static void test_many_connections(void **state) {
  harness_t *h = h_up(NULL);
  enum { NC = 200, PER = 20 };
  static int fds[NC];
  for (int i = 0; i < NC; i++)
    fds[i] =
        (i % 2) ? connect_unix(h->cfg.socket_path) : connect_tcp_addr("127.0.0.1", h->tcp_port);
  for (int i = 0; i < NC; i++) {
    pbw_t all;
    pbw_init(&all);
    for (int k = 0; k < PER; k++) {
      pbw_t w;
      pbw_init(&w);
      pbw_uint(&w, 1, (uint64_t)i * 1000 + (uint64_t)k);
      pbw_bytes(&w, k % 3 ? attnd_v1_Request_health_tag : attnd_v1_Request_stats_tag, "", 0);
      append_frame(&all, &w);
    }
    write_all(fds[i], all.b, all.n);
    pbw_free(&all);
  }
  attnd_v1_Response r;
  for (int i = 0; i < NC; i++) {
    for (int k = 0; k < PER; k++) {
      assert_int_equal(recv_resp(fds[i], &r), 0);
      assert_int_equal(r.id, (uint64_t)i * 1000 + (uint64_t)k);
    }
  }
  send_call(fds[0], 1, attnd_v1_Request_stats_tag);
  assert_int_equal(recv_resp(fds[0], &r), 0);
  assert_int_equal(r.result.stats.connections, NC);
  for (int i = 0; i < NC; i++)
    close(fds[i]);
  h_down(h);
}

/* A connection that must authenticate says Hello{token} first. Off loopback
 * that is every TCP connection; --require-token extends it to loopback, which
 * is how this test reaches the same path without sending traffic anywhere but
 * 127.0.0.1. */
static char token_path[64];

static void tweak_require_token(attnd_config_t *c) {
  snprintf(c->listen, sizeof(c->listen), "127.0.0.1:0");
  snprintf(c->token_file, sizeof(c->token_file), "%s", token_path);
  c->hello_timeout_ms = 200;
  c->require_token = 1;
}

/* Sends Hello{"tok-123"} with request id `id` and checks it is accepted. */
static void say_hello(int c, uint64_t id, attnd_v1_Response *r) {
  pbw_t w, hello;
  pbw_init(&w);
  pbw_init(&hello);
  pbw_bytes(&hello, 1, "tok-123", 7);
  pbw_uint(&w, 1, id);
  pbw_sub(&w, attnd_v1_Request_hello_tag, &hello);
  send_raw_frame(c, w.b, w.n);
  pbw_free(&w);
  assert_int_equal(recv_resp(c, r), 0);
  assert_int_equal(r->status.code, 0);
}

static void test_tcp_hello_required(void **state) {
  const char *ip = "127.0.0.1";
  snprintf(token_path, sizeof(token_path), "/tmp/attnd-test-token-XXXXXX");
  int tfd = mkstemp(token_path);
  assert_true(tfd >= 0);
  FILE *f = fdopen(tfd, "w");
  fputs("tok-123\n", f);
  fclose(f);
  harness_t *h = h_up(tweak_require_token);
  attnd_v1_Response r;
  /* No Hello: UNAUTHENTICATED, then close. */
  int c = connect_tcp_addr(ip, h->tcp_port);
  send_call(c, 1, attnd_v1_Request_health_tag);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAUTHENTICATED);
  expect_eof(c);
  close(c);
  /* With the token: served. */
  c = connect_tcp_addr(ip, h->tcp_port);
  say_hello(c, 2, &r);
  health_ok(c, 3, &r);
  close(c);
  /* An authenticated connection outlives the Hello deadline. */
  c = connect_tcp_addr(ip, h->tcp_port);
  say_hello(c, 5, &r);
  /* Silence: closed at the Hello deadline. */
  int idle = connect_tcp_addr(ip, h->tcp_port);
  double t0 = now_s();
  assert_int_equal(recv_resp(idle, &r), 0);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAUTHENTICATED);
  expect_eof(idle);
  double waited = now_s() - t0;
  assert_true(waited > 0.1 && waited < 2.0);
  close(idle);
  health_ok(c, 4, &r);
  close(c);
  h_down(h);
  unlink(token_path);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_start_stop_health),  cmocka_unit_test(test_stale_socket_removed),
      cmocka_unit_test(test_ipv6_loopback),      cmocka_unit_test(test_start_refusals),
      cmocka_unit_test(test_max_connections),    cmocka_unit_test(test_many_connections),
      cmocka_unit_test(test_tcp_hello_required),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_net_limits.c: what bounds connections (daemon/net/limits.c,
 * docs/protocol.md §9): fair turns for deep pipelines, the daemon-wide budget
 * of partly received frames and the frame deadline, the idle timeout, and
 * connections per identity (net_fixture.h). */
#include "net_fixture.h"

/* A Request{id, health{}} padded with an unknown field to exactly n bytes. */
static void padded_health(pbw_t *w, uint64_t id, size_t n) {
  pbw_init(w);
  pbw_uint(w, 1, id);
  pbw_bytes(w, attnd_v1_Request_health_tag, "", 0);
  /* field 99, length-delimited: tag (2 bytes) + length varint (3 bytes) */
  size_t pad = n - w->n - 5;
  uint8_t *p = calloc(1, pad);
  pbw_tag(w, 99, 2);
  uint8_t len3[3] = {(uint8_t)(pad | 0x80), (uint8_t)((pad >> 7) | 0x80), (uint8_t)(pad >> 14)};
  pbw_raw(w, len3, 3);
  pbw_raw(w, p, pad);
  free(p);
  assert_int_equal(w->n, n);
}

/* The first `head` bytes of frame w (header included) now, the rest later. */
static void send_part(int fd, const pbw_t *w, size_t from, size_t to) {
  uint8_t hdr[4];
  attnd_rpc_frame_header(hdr, (uint32_t)w->n);
  for (size_t i = from; i < to; i++) {
    /* byte i of header + body */
    uint8_t b = i < 4 ? hdr[i] : w->b[i - 4];
    write_all(fd, &b, 1);
  }
}

static void send_part_fast(int fd, const pbw_t *w, size_t from, size_t to) {
  uint8_t hdr[4];
  attnd_rpc_frame_header(hdr, (uint32_t)w->n);
  if (from < 4) {
    write_all(fd, hdr + from, (to < 4 ? to : 4) - from);
    from = 4;
  }
  if (to > from)
    write_all(fd, w->b + (from - 4), to - from);
}

static void wait_stats(harness_t *h, int (*ok)(const attnd_server_stats_t *), double timeout_s) {
  double t0 = now_s();
  for (;;) {
    h_call(h, snap_stats);
    if (ok(&h->stats))
      return;
    if (now_s() - t0 >= timeout_s)
      fprintf(stderr, "stats: partial %llu waits %llu timeouts %llu\n",
              (unsigned long long)h->stats.partial_bytes, (unsigned long long)h->stats.budget_waits,
              (unsigned long long)h->stats.frame_timeouts);
    assert_true(now_s() - t0 < timeout_s);
    usleep(5000);
  }
}

/* ---- fair turns ---- */

/* 5000 Health calls in one write: the connection gives way every
 * FRAMES_PER_TURN (64) frames, so the loop polls other sockets in between;
 * every call is still answered, in order. */
static void test_turns(void **state) {
  harness_t *h = h_up(NULL);
  enum { N = 5000 };
  int c = connect_unix(h->cfg.socket_path);
  pbw_t all;
  pbw_init(&all);
  for (int i = 0; i < N; i++) {
    pbw_t w;
    pbw_init(&w);
    pbw_uint(&w, 1, (uint64_t)i + 1);
    pbw_bytes(&w, attnd_v1_Request_health_tag, "", 0);
    append_frame(&all, &w);
  }
  write_all(c, all.b, all.n);
  pbw_free(&all);
  attnd_v1_Response r;
  for (int i = 0; i < N; i++) {
    assert_int_equal(recv_resp(c, &r), 0);
    assert_int_equal(r.id, (uint64_t)i + 1);
  }
  h_call(h, snap_stats);
  fprintf(stderr, "turns: %d pipelined calls, %llu turns given way\n", N,
          (unsigned long long)h->stats.turns_deferred);
  assert_true(h->stats.turns_deferred >= N / 64 - 1);
  close(c);
  h_down(h);
}

/* ---- the partial-frame budget and the frame deadline ---- */

static void tweak_budget(attnd_config_t *c) {
  c->max_frame = 256 << 10;
  c->max_inflight = 1 << 20;
  c->max_partial_bytes = 512 << 10;
  c->frame_deadline_ms = 1500;
  c->idle_timeout_s = 0;
}

#define BIG 200000 /* larger than the 64 KiB that never wait */

static int two_partial(const attnd_server_stats_t *s) {
  return s->partial_bytes == 2 * BIG;
}
static int one_waits(const attnd_server_stats_t *s) {
  return s->budget_waits == 1;
}
static int none_partial(const attnd_server_stats_t *s) {
  return s->partial_bytes == 0 && s->frame_timeouts == 2;
}

/* Two 200000-byte frames started and stalled hold most of the 512 KiB
 * budget; a third waits, its deadline not running, while small frames of
 * another connection still pass; it is admitted once the stalled two are
 * closed at their deadline (told why, RESOURCE_EXHAUSTED, id 0); it then
 * completes and is answered although more than the deadline passed since its
 * header. The budget is never exceeded and is whole again at the end. */
static void test_budget_and_deadline(void **state) {
  harness_t *h = h_up(tweak_budget);
  attnd_v1_Response r;
  pbw_t fa, fb, fc;
  padded_health(&fa, 1, BIG);
  padded_health(&fb, 2, BIG);
  padded_health(&fc, 3, BIG);
  int a = connect_unix(h->cfg.socket_path);
  int b = connect_tcp_addr("127.0.0.1", h->tcp_port);
  int c = connect_unix(h->cfg.socket_path);
  health_ok(a, 100, &r); /* served before its frame stalls */
  send_part_fast(a, &fa, 0, 1000);
  send_part_fast(b, &fb, 0, 1000);
  wait_stats(h, two_partial, 5);
  double t_c = now_s();
  send_part_fast(c, &fc, 0, 2000);
  wait_stats(h, one_waits, 5);
  h_call(h, snap_stats);
  assert_int_equal(h->stats.partial_bytes, 2 * BIG); /* c's body is not allocated */
  assert_int_equal(h->stats.partial_budget, 512 << 10);
  /* A small frame (60000 bytes) does not wait behind c. */
  int d = connect_unix(h->cfg.socket_path);
  pbw_t fd;
  padded_health(&fd, 9, 60000);
  send_part_fast(d, &fd, 0, fd.n + 4);
  assert_int_equal(recv_resp(d, &r), 0);
  assert_int_equal(r.id, 9);
  assert_int_equal(r.status.code, 0);
  pbw_free(&fd);
  close(d);
  /* a and b reach their deadline: told, then closed. */
  assert_int_equal(recv_resp(a, &r), 0);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(r.status.message, "--frame-deadline"));
  expect_eof(a);
  assert_int_equal(recv_resp(b, &r), 0);
  assert_int_equal(r.status.code, ATTND_STATUS_RESOURCE_EXHAUSTED);
  expect_eof(b);
  /* c was admitted when they left; it finishes well within a deadline of
   * its admission, although more than a deadline after its header. */
  usleep(300000);
  send_part_fast(c, &fc, 2000, fc.n + 4);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.id, 3);
  assert_int_equal(r.status.code, 0);
  assert_true(now_s() - t_c > 1.5);
  health_ok(c, 4, &r);
  wait_stats(h, none_partial, 5);
  assert_true(h->stats.peak_partial_bytes <= (512 << 10) + 60000);
  assert_true(h->stats.peak_partial_bytes >= 2 * BIG);
  pbw_free(&fa);
  pbw_free(&fb);
  pbw_free(&fc);
  close(a);
  close(b);
  close(c);
  h_down(h);
}

/* A frame sent slowly but steadily within the deadline is fine; a header
 * alone (3 of its 4 bytes) counts as a started frame. */
static void test_deadline_slow_and_header(void **state) {
  harness_t *h = h_up(tweak_budget);
  attnd_v1_Response r;
  pbw_t f;
  padded_health(&f, 7, 300);
  int a = connect_unix(h->cfg.socket_path);
  send_part(a, &f, 0, 100);
  usleep(200000);
  send_part(a, &f, 100, f.n + 4);
  assert_int_equal(recv_resp(a, &r), 0);
  assert_int_equal(r.id, 7);
  assert_int_equal(r.status.code, 0);
  int b = connect_unix(h->cfg.socket_path);
  send_part(b, &f, 0, 3);
  assert_int_equal(recv_resp(b, &r), 0);
  assert_int_equal(r.status.code, ATTND_STATUS_RESOURCE_EXHAUSTED);
  expect_eof(b);
  health_ok(a, 8, &r);
  pbw_free(&f);
  close(a);
  close(b);
  h_down(h);
}

/* Before its Hello, a connection that must authenticate may not start a
 * frame over 64 KiB (a Hello takes a few hundred bytes): UNAUTHENTICATED,
 * id 0, close, and no budget taken. */
static char hello_tokens[64];

static void tweak_require(attnd_config_t *c) {
  tweak_budget(c);
  c->require_token = 1;
  snprintf(c->token_file, sizeof(c->token_file), "%s", hello_tokens);
}

static void test_large_frame_before_hello(void **state) {
  snprintf(hello_tokens, sizeof(hello_tokens), "/tmp/attnd-test-token-XXXXXX");
  int tfd = mkstemp(hello_tokens);
  assert_true(tfd >= 0);
  assert_int_equal(write(tfd, "tok\n", 4), 4);
  close(tfd);
  harness_t *h = h_up(tweak_require);
  attnd_v1_Response r;
  pbw_t f;
  padded_health(&f, 1, BIG);
  int c = connect_tcp_addr("127.0.0.1", h->tcp_port);
  send_part_fast(c, &f, 0, 100);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAUTHENTICATED);
  assert_non_null(strstr(r.status.message, "before Hello"));
  expect_eof(c);
  close(c);
  h_call(h, snap_stats);
  assert_int_equal(h->stats.peak_partial_bytes, 0);
  pbw_free(&f);
  h_down(h);
  unlink(hello_tokens);
}

/* ---- the idle timeout ---- */

static void tweak_idle(attnd_config_t *c) {
  c->idle_timeout_s = 1;
}

/* After 1 s with nothing read, written or in flight, a connection whose
 * identity holds no session gets Response{id 0, UNAVAILABLE} and is closed;
 * one whose identity holds a session (the anonymous TCP identity here)
 * stays, and so does one that keeps calling. */
static void test_idle_timeout(void **state) {
  harness_t *h = h_up(tweak_idle);
  attnd_v1_Response r;
  int idle = connect_unix(h->cfg.socket_path);
  health_ok(idle, 1, &r);
  int owner = connect_tcp_addr("127.0.0.1", h->tcp_port);
  open_session(owner, 2);
  int busy = connect_unix(h->cfg.socket_path);
  double t0 = now_s();
  for (int i = 0; now_s() - t0 < 2.2; i++) {
    health_ok(busy, 10 + (uint64_t)i, &r);
    usleep(100000);
  }
  assert_int_equal(recv_resp(idle, &r), 0);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_UNAVAILABLE);
  assert_non_null(strstr(r.status.message, "--idle-timeout"));
  expect_eof(idle);
  health_ok(owner, 3, &r);
  h_call(h, snap_stats);
  assert_int_equal(h->stats.idle_closed, 1);
  close(idle);
  close(owner);
  close(busy);
  h_down(h);
}

/* ---- connections per identity ---- */

static char token_path[64];

static void tweak_per_identity(attnd_config_t *c) {
  c->max_conns_per_identity = 2;
  snprintf(c->token_file, sizeof(c->token_file), "%s", token_path);
}

static int hello(int fd, uint64_t id, const char *tok, attnd_v1_Response *r) {
  pbw_t w, hw;
  pbw_init(&w);
  pbw_init(&hw);
  pbw_bytes(&hw, 1, tok, strlen(tok));
  pbw_uint(&w, 1, id);
  pbw_sub(&w, attnd_v1_Request_hello_tag, &hw);
  send_raw_frame(fd, w.b, w.n);
  pbw_free(&w);
  assert_int_equal(recv_resp(fd, r), 0);
  return (int)r->status.code;
}

/* Two connections of one uid are served, a third is told RESOURCE_EXHAUSTED
 * and closed; another identity (anonymous TCP) is not affected; a Hello that
 * would make a third connection of a token's identity is refused the same
 * way; a slot freed is usable again. */
static void test_per_identity(void **state) {
  snprintf(token_path, sizeof(token_path), "/tmp/attnd-test-token-XXXXXX");
  int tfd = mkstemp(token_path);
  assert_true(tfd >= 0);
  FILE *f = fdopen(tfd, "w");
  fputs("tok-abc\n", f);
  fclose(f);
  harness_t *h = h_up(tweak_per_identity);
  attnd_v1_Response r;
  int u1 = connect_unix(h->cfg.socket_path), u2 = connect_unix(h->cfg.socket_path);
  health_ok(u1, 1, &r);
  health_ok(u2, 1, &r);
  int u3 = connect_unix(h->cfg.socket_path);
  assert_int_equal(recv_resp(u3, &r), 0);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(r.status.message, "--max-connections-per-identity"));
  expect_eof(u3);
  close(u3);
  /* Anonymous TCP is another identity; a Hello moves a connection to its
   * token's. */
  int t1 = connect_tcp_addr("127.0.0.1", h->tcp_port);
  int t2 = connect_tcp_addr("127.0.0.1", h->tcp_port);
  health_ok(t1, 1, &r);
  health_ok(t2, 1, &r);
  assert_int_equal(hello(t1, 2, "tok-abc", &r), 0);
  assert_int_equal(hello(t2, 2, "tok-abc", &r), 0);
  int t3 = connect_tcp_addr("127.0.0.1", h->tcp_port);
  health_ok(t3, 1, &r);
  assert_int_equal(hello(t3, 2, "tok-abc", &r), ATTND_STATUS_RESOURCE_EXHAUSTED);
  expect_eof(t3);
  close(t3);
  close(u1);
  for (int tries = 0;; tries++) {
    u3 = connect_unix(h->cfg.socket_path);
    send_call(u3, 9, attnd_v1_Request_health_tag);
    assert_int_equal(recv_resp(u3, &r), 0);
    if (r.status.code == 0)
      break;
    close(u3);
    assert_true(tries < 50); /* u1's close may take a loop turn */
    usleep(20000);
  }
  close(u3);
  close(u2);
  close(t1);
  close(t2);
  h_down(h);
  unlink(token_path);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_turns),
      cmocka_unit_test(test_budget_and_deadline),
      cmocka_unit_test(test_deadline_slow_and_header),
      cmocka_unit_test(test_large_frame_before_hello),
      cmocka_unit_test(test_idle_timeout),
      cmocka_unit_test(test_per_identity),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

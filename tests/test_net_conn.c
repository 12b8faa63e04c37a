/* test_net_conn.c: connections (daemon/net/conn.c, frame.c): stats over the
 * wire, bad input, pipelining, backpressure, steps through the real engine
 * and throughput (net_fixture.h). */
#include "net_fixture.h"

static void test_stats_roundtrip(void **state) {
  harness_t *h = h_up(NULL);
  attnd_v1_Response r;
  int a = connect_unix(h->cfg.socket_path);
  int b = connect_tcp_addr("127.0.0.1", h->tcp_port);
  health_ok(a, 1, &r);
  health_ok(b, 2, &r);
  health_ok(b, 3, &r);
  send_call(a, 4, attnd_v1_Request_stats_tag);
  assert_int_equal(recv_resp(a, &r), 0);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.which_result, attnd_v1_Response_stats_tag);
  assert_int_equal(r.result.stats.connections, 2);
  uint64_t health = 0, stats = 0;
  for (pb_size_t i = 0; i < r.result.stats.methods_count; i++) {
    if (strcmp(r.result.stats.methods[i].method, "health") == 0)
      health = r.result.stats.methods[i].requests;
    if (strcmp(r.result.stats.methods[i].method, "stats") == 0)
      stats = r.result.stats.methods[i].requests;
  }
  assert_int_equal(health, 3);
  assert_int_equal(stats, 1);
  assert_true(r.result.stats.bytes_in >= 4 * 6);
  assert_true(r.result.stats.bytes_out > 3 * 100);
  close(a);
  close(b);
  h_down(h);
}

static void test_bad_inputs(void **state) {
  harness_t *h = h_up(NULL);
  attnd_v1_Response r;
  int good = connect_unix(h->cfg.socket_path);
  health_ok(good, 1, &r);

  /* Garbled frame: Response{id 0, INVALID_ARGUMENT}, then close. */
  int c = connect_unix(h->cfg.socket_path);
  send_raw_frame(c, "\xff\xff\xff\xff\xff\xff", 6);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  expect_eof(c);
  close(c);
  health_ok(good, 2, &r);

  /* Oversized: RESOURCE_EXHAUSTED with id 0, then close. */
  c = connect_tcp_addr("127.0.0.1", h->tcp_port);
  uint8_t hdr[4];
  attnd_rpc_frame_header(hdr, 0x7fffffff);
  write_all(c, hdr, 4);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(r.status.message, "max-frame"));
  expect_eof(c);
  close(c);
  health_ok(good, 3, &r);

  /* Zero-length frame. */
  c = connect_unix(h->cfg.socket_path);
  send_raw_frame(c, NULL, 0);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.id, 0);
  assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
  expect_eof(c);
  close(c);

  /* Missing and unknown calls: UNIMPLEMENTED, and the connection stays. */
  c = connect_unix(h->cfg.socket_path);
  send_call(c, 41, 0);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.id, 41);
  assert_int_equal(r.status.code, ATTND_STATUS_UNIMPLEMENTED);
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, 42);
  pbw_bytes(&w, 77, "x", 1);
  send_raw_frame(c, w.b, w.n);
  pbw_free(&w);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.id, 42);
  assert_int_equal(r.status.code, ATTND_STATUS_UNIMPLEMENTED);
  health_ok(c, 43, &r);
  close(c);

  /* A client that leaves mid-frame, and one that leaves without reading. */
  c = connect_unix(h->cfg.socket_path);
  attnd_rpc_frame_header(hdr, 1000);
  write_all(c, hdr, 4);
  write_all(c, "0123456789", 10);
  close(c);
  c = connect_tcp_addr("127.0.0.1", h->tcp_port);
  for (int i = 0; i < 50; i++)
    send_call(c, 100 + (uint64_t)i, attnd_v1_Request_health_tag);
  close(c);
  c = connect_unix(h->cfg.socket_path);
  write_all(c, hdr, 2); /* half a header */
  close(c);

  health_ok(good, 4, &r);
  /* The server sees the other clients leave in its own time. */
  for (int tries = 0;; tries++) {
    send_call(good, 5, attnd_v1_Request_stats_tag);
    assert_int_equal(recv_resp(good, &r), 0);
    if (r.result.stats.connections == 1)
      break;
    assert_true(tries < 100);
    usleep(10000);
  }
  close(good);
  h_down(h);
}

static void test_pipelining(void **state) {
  harness_t *h = h_up(NULL);
  attnd_v1_Response r;
  int c = connect_unix(h->cfg.socket_path);
  /* 200 requests in one write; every id answered exactly once. */
  pbw_t all;
  pbw_init(&all);
  for (int i = 1; i <= 200; i++) {
    pbw_t w;
    pbw_init(&w);
    pbw_uint(&w, 1, (uint64_t)i);
    pbw_bytes(&w, (i % 2) ? attnd_v1_Request_health_tag : attnd_v1_Request_stats_tag, "", 0);
    uint8_t hdr[4];
    attnd_rpc_frame_header(hdr, (uint32_t)w.n);
    pbw_raw(&all, hdr, 4);
    pbw_raw(&all, w.b, w.n);
    pbw_free(&w);
  }
  write_all(c, all.b, all.n);
  pbw_free(&all);
  uint8_t seen[201] = {0};
  for (int i = 0; i < 200; i++) {
    assert_int_equal(recv_resp(c, &r), 0);
    assert_true(r.id >= 1 && r.id <= 200);
    assert_int_equal(seen[r.id], 0);
    seen[r.id] = 1;
    assert_int_equal(r.which_result,
                     (r.id % 2) ? attnd_v1_Response_health_tag : attnd_v1_Response_stats_tag);
  }
  close(c);
  h_down(h);
}

static void tweak_small_inflight(attnd_config_t *c) {
  c->max_frame = 4096;
  c->max_inflight = 16384;
}

/* A client that sends and never reads: the server stops reading once the
 * responses it holds pass the bound, and all are delivered once it reads. */
static void test_backpressure(void **state) {
  harness_t *h = h_up(tweak_small_inflight);
  int c = connect_unix(h->cfg.socket_path);
  int small = 4096;
  setsockopt(c, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  fcntl(c, F_SETFL, O_NONBLOCK);
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, 7);
  pbw_bytes(&w, attnd_v1_Request_health_tag, "", 0);
  uint8_t frame[64];
  attnd_rpc_frame_header(frame, (uint32_t)w.n);
  memcpy(frame + 4, w.b, w.n);
  size_t flen = w.n + 4;
  pbw_free(&w);
  /* Send until the kernel buffers are full in both directions (~1 s max). */
  long sent = 0;
  size_t partial = 0;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int stalls = 0;
  for (;;) {
    ssize_t n = write(c, frame + partial, flen - partial);
    if (n > 0) {
      partial += (size_t)n;
      if (partial == flen) {
        partial = 0;
        sent++;
      }
      stalls = 0;
      continue;
    }
    assert_true(errno == EAGAIN);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (++stalls > 20 || t1.tv_sec - t0.tv_sec > 2)
      break;
    usleep(5000);
  }
  h_call(h, snap_stats);
  uint64_t peak = h->stats.peak_conn_inflight;
  fprintf(stderr,
          "backpressure: sent %ld requests, peak in-flight %llu bytes (bound %llu), paused %llu\n",
          sent, (unsigned long long)peak, (unsigned long long)h->cfg.max_inflight,
          (unsigned long long)h->stats.reads_paused);
  assert_true(h->stats.reads_paused >= 1);
  /* At most one frame and one response over the bound. */
  assert_true(peak <= h->cfg.max_inflight + h->cfg.max_frame + 1024);
  /* Now read everything: every request is answered. */
  if (partial)
    fcntl(c, F_SETFL, 0);
  while (partial) {
    ssize_t n = write(c, frame + partial, flen - partial);
    if (n > 0)
      partial += (size_t)n;
    if (partial == flen) {
      partial = 0;
      sent++;
    }
  }
  fcntl(c, F_SETFL, 0);
  attnd_v1_Response r;
  for (long i = 0; i < sent; i++) {
    assert_int_equal(recv_resp(c, &r), 0);
    assert_int_equal(r.id, 7);
  }
  close(c);
  h_down(h);
}

/* Real steps over a real socket: a step answers with its output; the same id
 * sent again while the first is in flight answers INVALID_ARGUMENT; a client
 * that leaves with a step in flight hurts nobody. */
static void test_steps_real_engine(void **state) {
  harness_t *h = h_up(NULL);
  attnd_v1_Response r;
  int c = connect_unix(h->cfg.socket_path);
  uint64_t s1 = open_session(c, 1);
  uint64_t s2 = open_session(c, 2);
  /* Two steps with the same id in one write: the second finds the first in
   * flight (the engine completes steps off the loop thread). */
  pbw_t all, w;
  pbw_init(&all);
  build_step(&w, 50, s1, 4);
  append_frame(&all, &w);
  build_step(&w, 50, s2, 4);
  append_frame(&all, &w);
  write_all(c, all.b, all.n);
  pbw_free(&all);
  int ok = 0, dup = 0;
  for (int i = 0; i < 2; i++) {
    assert_int_equal(recv_resp(c, &r), 0);
    assert_int_equal(r.id, 50);
    if (r.status.code == 0) {
      ok++;
      assert_int_equal(r.which_result, attnd_v1_Response_step_tag);
      assert_true(r.result.step.has_out);
      assert_int_equal(r.result.step.out.shape[0], 4);
      assert_int_equal(r.result.step.out.shape[1], 4);
      assert_int_equal(r.result.step.out.shape[2], 64);
      assert_true(r.timing.total_us >= r.timing.computing_us);
    } else {
      dup++;
      assert_int_equal(r.status.code, ATTND_STATUS_INVALID_ARGUMENT);
      assert_non_null(strstr(r.status.message, "already in flight"));
    }
  }
  assert_int_equal(ok, 1);
  assert_int_equal(dup, 1);

  /* A client that sends a step and leaves at once. */
  int d = connect_unix(h->cfg.socket_path);
  build_step(&w, 60, s2, 8);
  send_raw_frame(d, w.b, w.n);
  pbw_free(&w);
  close(d);
  /* The first connection still works, and the orphaned step completes. */
  uint64_t steps = 0;
  for (int tries = 0; tries < 100; tries++) {
    send_call(c, 70 + (uint64_t)tries, attnd_v1_Request_stats_tag);
    assert_int_equal(recv_resp(c, &r), 0);
    steps = r.result.stats.steps;
    if (steps >= 2 && r.result.stats.connections == 1)
      break;
    usleep(10000);
  }
  assert_int_equal(steps, 2);
  close(c);
  h_down(h);
}

/* No admitted call is left without an answer while the connection can be
 * written: steps followed by a half-close (shutdown(SHUT_WR)) are all
 * answered before the daemon closes; steps followed by a frame that does not
 * parse (or one over --max-frame) are answered first, then the framing
 * error's Response{id 0}, then the close. */
static void test_answers_before_close(void **state) {
  harness_t *h = h_up(NULL);
  attnd_v1_Response r;
  int c = connect_unix(h->cfg.socket_path);
  uint64_t s1 = open_session(c, 1);
  uint64_t s2 = open_session(c, 2);
  close(c);
  for (int how = 0; how < 3; how++) {
    c = connect_unix(h->cfg.socket_path);
    pbw_t all, w;
    pbw_init(&all);
    build_step(&w, 10, s1, 8);
    append_frame(&all, &w);
    build_step(&w, 11, s2, 8);
    append_frame(&all, &w);
    if (how == 1) {
      pbw_init(&w);
      pbw_raw(&w, "\xff\xff\xff\xff\xff", 5);
      append_frame(&all, &w);
      build_step(&w, 12, s1, 8); /* after the bad frame: not a request */
      append_frame(&all, &w);
    } else if (how == 2) {
      uint8_t hdr[4];
      attnd_rpc_frame_header(hdr, 0x7ffffff0);
      pbw_raw(&all, hdr, 4);
    }
    write_all(c, all.b, all.n);
    pbw_free(&all);
    if (how == 0)
      assert_int_equal(shutdown(c, SHUT_WR), 0);
    int seen10 = 0, seen11 = 0;
    for (int i = 0; i < 2; i++) {
      assert_int_equal(recv_resp(c, &r), 0);
      assert_int_equal(r.status.code, 0);
      assert_int_equal(r.which_result, attnd_v1_Response_step_tag);
      seen10 += r.id == 10;
      seen11 += r.id == 11;
    }
    assert_int_equal(seen10, 1);
    assert_int_equal(seen11, 1);
    if (how) {
      assert_int_equal(recv_resp(c, &r), 0);
      assert_int_equal(r.id, 0);
      assert_int_equal(r.status.code,
                       how == 1 ? ATTND_STATUS_INVALID_ARGUMENT : ATTND_STATUS_RESOURCE_EXHAUSTED);
    }
    expect_eof(c);
    close(c);
  }
  /* The steps really ran: 6, none of them twice, nothing after the bad frame. */
  c = connect_unix(h->cfg.socket_path);
  send_call(c, 3, attnd_v1_Request_stats_tag);
  assert_int_equal(recv_resp(c, &r), 0);
  assert_int_equal(r.result.stats.steps, 6);
  close(c);
  h_down(h);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void tweak_big_frames(attnd_config_t *c) {
  c->max_frame = 80 << 20;
  c->max_inflight = 256 << 20;
}

/* Numbers for the report, with loose floors so a loaded machine still passes:
 * Health round trips, pipelined Health throughput, and large-frame ingest
 * (a 64 MiB frame is read straight into its own buffer). */
static void test_throughput(void **state) {
  harness_t *h = h_up(tweak_big_frames);
  attnd_v1_Response r;
  int c = connect_unix(h->cfg.socket_path);
  /* Round trips. */
  enum { RT = 1000 };
  static double lat[RT];
  for (int i = 0; i < RT; i++) {
    double t0 = now_s();
    health_ok(c, (uint64_t)i + 1, &r);
    lat[i] = (now_s() - t0) * 1e6;
  }
  qsort(lat, RT, sizeof(double), cmp_double);
  /* Pipelined. */
  enum { PN = 20000 };
  pbw_t all;
  pbw_init(&all);
  for (int i = 0; i < PN; i++) {
    pbw_t w;
    pbw_init(&w);
    pbw_uint(&w, 1, (uint64_t)i + 1);
    pbw_bytes(&w, attnd_v1_Request_health_tag, "", 0);
    append_frame(&all, &w);
  }
  double t0 = now_s();
  write_all(c, all.b, all.n);
  pbw_free(&all);
  /* Count response frames from big reads, so the client is not the bottleneck. */
  {
    size_t cap = 1 << 20, have = 0;
    uint8_t *rb = malloc(cap);
    int frames = 0;
    while (frames < PN) {
      struct pollfd pf = {c, POLLIN, 0};
      assert_true(poll(&pf, 1, 5000) > 0);
      ssize_t n = read(c, rb + have, cap - have);
      assert_true(n > 0);
      have += (size_t)n;
      size_t off = 0;
      while (have - off >= 4) {
        uint32_t fl = ((uint32_t)rb[off] << 24) | ((uint32_t)rb[off + 1] << 16) |
                      ((uint32_t)rb[off + 2] << 8) | rb[off + 3];
        if (have - off < 4 + (size_t)fl)
          break;
        off += 4 + fl;
        frames++;
      }
      memmove(rb, rb + off, have - off);
      have -= off;
    }
    assert_int_equal(have, 0);
    free(rb);
  }
  double pipe_s = now_s() - t0;
  /* Large frames: Health plus a 64 MiB field the server skips. */
  size_t big = 64u << 20;
  uint8_t *payload = malloc(big);
  memset(payload, 0x5a, big);
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, 1);
  pbw_bytes(&w, attnd_v1_Request_health_tag, "", 0);
  pbw_bytes(&w, 99, payload, big);
  free(payload);
  uint8_t hdr[4];
  attnd_rpc_frame_header(hdr, (uint32_t)w.n);
  t0 = now_s();
  for (int i = 0; i < 4; i++) {
    write_all(c, hdr, 4);
    write_all(c, w.b, w.n);
    assert_int_equal(recv_resp(c, &r), 0);
    assert_int_equal(r.status.code, 0);
  }
  double big_s = now_s() - t0;
  pbw_free(&w);
  fprintf(stderr,
          "throughput: health round trip p50 %.1f us p99 %.1f us; pipelined %.0f req/s; "
          "64 MiB frames %.2f GB/s\n",
          lat[RT / 2], lat[RT * 99 / 100], PN / pipe_s, 4.0 * (double)big / big_s / 1e9);
  assert_true(lat[RT / 2] < 20000); /* smoke floors: a loaded CI box must pass */
  assert_true(PN / pipe_s > 2000);
  close(c);
  h_down(h);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stats_roundtrip),   cmocka_unit_test(test_bad_inputs),
      cmocka_unit_test(test_pipelining),        cmocka_unit_test(test_backpressure),
      cmocka_unit_test(test_steps_real_engine), cmocka_unit_test(test_answers_before_close),
      cmocka_unit_test(test_throughput),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

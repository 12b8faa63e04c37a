/* test_net_metrics.c: the HTTP endpoint (daemon/net/http.c, metrics.c):
 * /metrics scraped over HTTP (net_fixture.h), the probes, and the HTTP
 * server's limits: idle connections never keep a scrape out, and are closed
 * at their deadline. */
#include <math.h>

#include "net_fixture.h"

/* Sends req, returns the whole reply (malloc'ed). */
static char *http_raw(int port, const char *req) {
  int fd = connect_tcp_addr("127.0.0.1", port);
  write_all(fd, req, strlen(req));
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  for (;;) {
    struct pollfd pf = {fd, POLLIN, 0};
    assert_true(poll(&pf, 1, 5000) > 0);
    ssize_t r = read(fd, buf + n, cap - n - 1);
    if (r <= 0)
      break;
    n += (size_t)r;
    if (n + 1 >= cap) {
      cap *= 2;
      buf = realloc(buf, cap);
    }
  }
  buf[n] = 0;
  close(fd);
  return buf;
}

static char *http_get(int port, const char *path) {
  char req[256];
  snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n", path);
  return http_raw(port, req);
}

static void test_metrics_scrape(void **state) {
  harness_t *h = h_up(NULL);
  attnd_v1_Response r;
  int c = connect_unix(h->cfg.socket_path);
  for (int i = 1; i <= 3; i++)
    health_ok(c, (uint64_t)i, &r);
  send_call(c, 9, 0); /* one UNIMPLEMENTED */
  assert_int_equal(recv_resp(c, &r), 0);
  char *body = http_get(h->metrics_port, "/metrics");
  assert_non_null(strstr(body, "HTTP/1.1 200 OK"));
  assert_non_null(strstr(body, "text/plain; version=0.0.4"));
  assert_non_null(strstr(body, "attnd_requests_total{method=\"health\",code=\"OK\"} 3\n"));
  assert_non_null(
      strstr(body, "attnd_requests_total{method=\"unknown\",code=\"UNIMPLEMENTED\"} 1\n"));
  assert_non_null(strstr(body, "attnd_connections 1\n"));
  assert_non_null(
      strstr(body, "attnd_step_latency_seconds_bucket{kind=\"decode\",le=\"+Inf\"} 0\n"));
  assert_non_null(strstr(body, "attnd_step_queue_seconds_count{kind=\"prefill\"} 0\n"));
  assert_non_null(strstr(body, "attnd_prefix_queries_total"));
  assert_non_null(strstr(body, "attnd_uptime_seconds"));
  /* The backend's counters, 0 on the CPU backend. */
  assert_non_null(strstr(body, "\nattnd_staged_bytes_total 0\n"));
  assert_non_null(strstr(body, "\nattnd_cuda_graph_steps_total 0\n"));
  assert_non_null(strstr(body, "\nattnd_cuda_graph_builds_total 0\n"));
  assert_non_null(strstr(body, "\nattnd_cuda_loop_completions_total 0\n"));
  assert_non_null(strstr(body, "attnd_admission_queued 0\n")); /* idle: nothing behind a scan */
  assert_non_null(strstr(body, "attnd_build_info{version=\"" ATTND_VERSION "\""));
  /* Capacity apart from the states, which sum to it. */
  unsigned cap = 0, used = 9, cached = 9, freeb = 0;
  const char *p = strstr(body, "\nattnd_kv_blocks_capacity ");
  assert_non_null(p);
  assert_int_equal(sscanf(p, "\nattnd_kv_blocks_capacity %u", &cap), 1);
  assert_int_equal(sscanf(strstr(body, "attnd_kv_blocks{state=\"used\"}"),
                          "attnd_kv_blocks{state=\"used\"} %u", &used),
                   1);
  assert_int_equal(sscanf(strstr(body, "attnd_kv_blocks{state=\"cached\"}"),
                          "attnd_kv_blocks{state=\"cached\"} %u", &cached),
                   1);
  assert_int_equal(sscanf(strstr(body, "attnd_kv_blocks{state=\"free\"}"),
                          "attnd_kv_blocks{state=\"free\"} %u", &freeb),
                   1);
  assert_true(cap > 0);
  assert_int_equal(used + cached + freeb, cap);
  assert_null(strstr(body, "state=\"total\""));
  assert_non_null(strstr(body, "attnd_kv_usage_ratio 0.000000\n"));
  /* The process's own numbers. */
  const char *proc[] = {"process_cpu_seconds_total ", "process_resident_memory_bytes ",
                        "process_open_fds ", "process_max_fds ", "process_start_time_seconds "};
  for (size_t i = 0; i < sizeof(proc) / sizeof(proc[0]); i++)
    if (!strstr(body, proc[i]))
      fail_msg("no %s", proc[i]);
  double rss = 0, start = 0;
  sscanf(strstr(body, "\nprocess_resident_memory_bytes ") + 1, "process_resident_memory_bytes %lf",
         &rss);
  sscanf(strstr(body, "\nprocess_start_time_seconds ") + 1, "process_start_time_seconds %lf",
         &start);
  assert_true(rss > 1e5);
  assert_true(fabs(start - (double)time(NULL)) < 600); /* started moments ago */
  free(body);
  body = http_get(h->metrics_port, "/other");
  assert_non_null(strstr(body, "HTTP/1.1 404"));
  free(body);
  body = http_get(h->metrics_port, "/metrics?x=1");
  assert_non_null(strstr(body, "HTTP/1.1 200 OK"));
  free(body);
  close(c);
  h_down(h);
}

static int g_ready;
static void set_ready(void *arg) {
  attnd_metrics_set_ready(((harness_t *)arg)->metrics, g_ready);
}

/* /healthz answers while the loop runs; /readyz 503 until ready, 200 while
 * ready, 503 "draining" after. HEAD has no body; other methods are 405. */
static void test_probes(void **state) {
  harness_t *h = h_up(NULL);
  char *b = http_get(h->metrics_port, "/healthz");
  assert_non_null(strstr(b, "HTTP/1.1 200 OK"));
  assert_non_null(strstr(b, "\r\n\r\nok\n"));
  free(b);
  b = http_get(h->metrics_port, "/readyz");
  assert_non_null(strstr(b, "HTTP/1.1 503"));
  assert_non_null(strstr(b, "starting"));
  free(b);
  g_ready = 1;
  h_call(h, set_ready);
  b = http_get(h->metrics_port, "/readyz");
  assert_non_null(strstr(b, "HTTP/1.1 200 OK"));
  free(b);
  b = http_raw(h->metrics_port, "HEAD /readyz HTTP/1.1\r\nHost: x\r\n\r\n");
  assert_non_null(strstr(b, "HTTP/1.1 200 OK"));
  assert_non_null(strstr(b, "Content-Length: 6\r\n"));
  assert_non_null(strstr(b, "\r\n\r\n"));
  assert_string_equal(strstr(b, "\r\n\r\n"), "\r\n\r\n"); /* no body */
  free(b);
  b = http_raw(h->metrics_port, "POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  assert_non_null(strstr(b, "HTTP/1.1 405"));
  assert_non_null(strstr(b, "Allow: GET, HEAD\r\n"));
  free(b);
  g_ready = 0;
  h_call(h, set_ready);
  b = http_get(h->metrics_port, "/readyz");
  assert_non_null(strstr(b, "HTTP/1.1 503"));
  assert_non_null(strstr(b, "draining"));
  free(b);
  b = http_get(h->metrics_port, "/healthz");
  assert_non_null(strstr(b, "HTTP/1.1 200 OK"));
  free(b);
  h_down(h);
}

/* 70 idle connections (more than ATTND_HTTP_MAX_CONNS) do not keep a scrape
 * or a probe out: each answers at once. The idle ones are closed within a
 * second or two of their deadline, and a request larger than the limit is
 * refused. */
static void test_idle_connections(void **state) {
  harness_t *h = h_up(NULL);
  enum { N = 70 };
  int idle[N];
  for (int i = 0; i < N; i++)
    idle[i] = connect_tcp_addr("127.0.0.1", h->metrics_port);
  /* One of them sends half a request and stalls (slowloris). */
  write_all(idle[N - 1], "GET /metr", 9);
  double t0 = now_s();
  for (int i = 0; i < 5; i++) {
    char *b = http_get(h->metrics_port, i % 2 ? "/healthz" : "/metrics");
    assert_non_null(strstr(b, "HTTP/1.1 200 OK"));
    free(b);
  }
  assert_true(now_s() - t0 < 2.0);
  /* Past the request deadline (plus the sweep's second) every idle one is closed. */
  double deadline = now_s() + ATTND_HTTP_REQUEST_MS / 1000.0 + 3.0;
  int closed = 0;
  for (int i = 0; i < N; i++) {
    for (;;) {
      struct pollfd pf = {idle[i], POLLIN, 0};
      int ms = (int)((deadline - now_s()) * 1000);
      if (ms <= 0 || poll(&pf, 1, ms) <= 0)
        break;
      char x;
      ssize_t r = read(idle[i], &x, 1);
      if (r <= 0) {
        closed++;
        break;
      }
    }
    close(idle[i]);
  }
  assert_int_equal(closed, N);
  /* One byte more than ATTND_HTTP_MAX_REQUEST (all of it read, so the close
   * is a clean one): 413, not a wait. */
  size_t total = ATTND_HTTP_MAX_REQUEST + 1;
  char *req = malloc(total + 1);
  int n = snprintf(req, total + 1, "GET /metrics HTTP/1.1\r\nX-Pad: ");
  memset(req + n, 'a', total - (size_t)n);
  req[total] = 0;
  char *b = http_raw(h->metrics_port, req);
  assert_non_null(strstr(b, "HTTP/1.1 413"));
  free(b);
  free(req);
  h_down(h);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_metrics_scrape),
      cmocka_unit_test(test_probes),
      cmocka_unit_test(test_idle_connections),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_net_metrics.c: Prometheus /metrics (daemon/net/http.c, metrics.c)
 * scraped over HTTP (net_fixture.h). */
#include "net_fixture.h"

/* Plain HTTP/1.0 GET; returns the whole reply (malloc'ed). */
static char *http_get(int port, const char *path) {
  int fd = connect_tcp_addr("127.0.0.1", port);
  char req[256];
  snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n", path);
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
  assert_non_null(strstr(body, "attnd_blocks{state=\"total\"}"));
  assert_non_null(
      strstr(body, "attnd_step_latency_seconds_bucket{kind=\"decode\",le=\"+Inf\"} 0\n"));
  assert_non_null(strstr(body, "attnd_prefix_queries_total"));
  assert_non_null(strstr(body, "attnd_uptime_seconds"));
  assert_non_null(strstr(body, "attnd_admission_queued 0\n")); /* idle: nothing behind a scan */
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

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_metrics_scrape),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* metrics.c: Prometheus text exposition (format 0.0.4) over HTTP, GET /metrics.
 *
 * Metric names (all prefixed attnd_):
 *   attnd_requests_total{method,code}          counter  requests answered, by status code
 *   attnd_errors_total{method}                 counter  requests answered with a non-OK status
 *   attnd_received_bytes_total                 counter  request frame bytes (headers included)
 *   attnd_sent_bytes_total                     counter  response frame bytes (headers included)
 *   attnd_connections                          gauge    open RPC connections
 *   attnd_connections_total                    counter  accepted RPC connections
 *   attnd_connections_refused_total            counter  refused over --max-connections
 *   attnd_frame_errors_total                   counter  framing errors that closed a connection
 *   attnd_sessions                             gauge    open sessions
 *   attnd_plans                                gauge    live plans
 *   attnd_admission_queued                     gauge    calls waiting behind a large step's scan
 *   attnd_blocks{state="total|used|cached"}    gauge    KV blocks
 *   attnd_prefix_queries_total                 counter  prefix-cache lookups
 *   attnd_prefix_hit_tokens_total              counter  tokens served from the prefix cache
 *   attnd_prefix_miss_tokens_total             counter  looked-up tokens not in the cache
 *   attnd_prefix_evictions_total               counter  cached blocks evicted
 *   attnd_cow_copies_total                     counter  copy-on-write block copies
 *   attnd_steps_total{kind="prefill|decode"}   counter  steps run by the engine
 *   attnd_tokens_written_total                 counter  tokens written into the cache
 *   attnd_step_latency_seconds{kind}           histogram frame decoded -> response encoded,
 *                                              successful steps; decode = every item has n == 1
 *   attnd_uptime_seconds                       gauge    seconds since start
 *
 * Each scrape is one HTTP/1.x request on its own connection (Connection:
 * close), parsed with libhttp-parser; anything but GET /metrics is a 404. */
#include "metrics.h"

#include <http_parser.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnd.pb.h"
#include "config.h"
#include "base.h"

/* ---- rendering ------------------------------------------------------------ */

typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} sbuf_t;

static void sb_printf(sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf_t *b, const char *fmt, ...) {
  if (b->oom)
    return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = 1;
      return;
    }
    if ((size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t nc = b->cap * 2 + (size_t)n;
    char *np = realloc(b->p, nc);
    if (!np) {
      b->oom = 1;
      return;
    }
    b->p = np;
    b->cap = nc;
  }
}

static void head(sbuf_t *b, const char *name, const char *type, const char *help) {
  sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

int attnd_metrics_render(const attnd_rpc_counters_t *c, attnd_engine_t *engine, double uptime_s,
                         char **out, size_t *len) {
  sbuf_t b = {malloc(8192), 0, 8192, 0};
  if (!b.p)
    return ATTND_ENOMEM;
  attnd_engine_stats_t es;
  memset(&es, 0, sizeof(es));
  if (engine)
    attnd_engine_stats(engine, &es);

  head(&b, "attnd_requests_total", "counter", "Requests answered, by method and status code.");
  for (int m = 0; m < ATTND_M_COUNT; m++)
    for (int k = 0; k < ATTND_STATUS_COUNT; k++)
      if (c->answers[m].by_code[k] || (k == 0 && m > 0))
        sb_printf(&b, "attnd_requests_total{method=\"%s\",code=\"%s\"} %llu\n",
                  attnd_rpc_method_name(m), attnd_rpc_code_name(k),
                  (unsigned long long)c->answers[m].by_code[k]);
  head(&b, "attnd_errors_total", "counter", "Requests answered with a non-OK status, by method.");
  for (int m = 0; m < ATTND_M_COUNT; m++)
    sb_printf(&b, "attnd_errors_total{method=\"%s\"} %llu\n", attnd_rpc_method_name(m),
              (unsigned long long)c->answers[m].errors);

#define SIMPLE(name, type, help, val)                                                              \
  do {                                                                                             \
    head(&b, name, type, help);                                                                    \
    sb_printf(&b, "%s %llu\n", name, (unsigned long long)(val));                                   \
  } while (0)
  SIMPLE("attnd_received_bytes_total", "counter", "Request frame bytes received.", c->bytes_in);
  SIMPLE("attnd_sent_bytes_total", "counter", "Response frame bytes sent.", c->bytes_out);
  SIMPLE("attnd_connections", "gauge", "Open RPC connections.", c->connections);
  SIMPLE("attnd_connections_total", "counter", "Accepted RPC connections.", c->connections_total);
  SIMPLE("attnd_connections_refused_total", "counter",
         "Connections refused over --max-connections.", c->connections_refused);
  SIMPLE("attnd_frame_errors_total", "counter", "Framing errors that closed a connection.",
         c->frame_errors);
  SIMPLE("attnd_sessions", "gauge", "Open sessions.", es.sessions);
  SIMPLE("attnd_plans", "gauge", "Live plans.", es.plans);
  SIMPLE("attnd_admission_queued", "gauge",
         "Calls waiting for admission behind a large step's finiteness scan.", es.queued);
  head(&b, "attnd_blocks", "gauge", "KV blocks by state.");
  sb_printf(&b, "attnd_blocks{state=\"total\"} %u\n", es.blocks_total);
  sb_printf(&b, "attnd_blocks{state=\"used\"} %u\n", es.blocks_used);
  sb_printf(&b, "attnd_blocks{state=\"cached\"} %u\n", es.blocks_cached);
  SIMPLE("attnd_prefix_queries_total", "counter", "Prefix-cache lookups.", es.prefix_queries);
  SIMPLE("attnd_prefix_hit_tokens_total", "counter", "Tokens served from the prefix cache.",
         es.prefix_hit_tokens);
  SIMPLE("attnd_prefix_miss_tokens_total", "counter", "Looked-up tokens not in the prefix cache.",
         es.prefix_miss_tokens);
  SIMPLE("attnd_prefix_evictions_total", "counter", "Cached blocks evicted.", es.evictions);
  SIMPLE("attnd_cow_copies_total", "counter", "Copy-on-write block copies.", es.cow_copies);
  head(&b, "attnd_steps_total", "counter", "Steps run by the engine, by kind.");
  sb_printf(&b, "attnd_steps_total{kind=\"prefill\"} %llu\n", (unsigned long long)es.prefill_steps);
  sb_printf(&b, "attnd_steps_total{kind=\"decode\"} %llu\n", (unsigned long long)es.decode_steps);
  SIMPLE("attnd_tokens_written_total", "counter", "Tokens written into the KV cache.",
         es.tokens_written);
#undef SIMPLE

  head(&b, "attnd_step_latency_seconds", "histogram",
       "Step latency, frame decoded to response encoded, by kind.");
  for (int k = 0; k < 2; k++) {
    const char *kind = k == ATTND_STEP_DECODE ? "decode" : "prefill";
    const attnd_hist_t *h = &c->step_latency[k];
    uint64_t cum = 0;
    for (int i = 0; i < ATTND_HIST_BUCKETS; i++) {
      cum += h->bucket[i];
      sb_printf(&b, "attnd_step_latency_seconds_bucket{kind=\"%s\",le=\"%g\"} %llu\n", kind,
                attnd_hist_bounds_us[i] / 1e6, (unsigned long long)cum);
    }
    cum += h->bucket[ATTND_HIST_BUCKETS];
    sb_printf(&b, "attnd_step_latency_seconds_bucket{kind=\"%s\",le=\"+Inf\"} %llu\n", kind,
              (unsigned long long)cum);
    sb_printf(&b, "attnd_step_latency_seconds_sum{kind=\"%s\"} %.6f\n", kind, h->sum_us / 1e6);
    sb_printf(&b, "attnd_step_latency_seconds_count{kind=\"%s\"} %llu\n", kind,
              (unsigned long long)h->count);
  }
  head(&b, "attnd_uptime_seconds", "gauge", "Seconds since the daemon started.");
  sb_printf(&b, "attnd_uptime_seconds %.3f\n", uptime_s);
  if (b.oom) {
    free(b.p);
    return ATTND_ENOMEM;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}

/* ---- HTTP ------------------------------------------------------------------- */

struct attnd_metrics_s {
  uv_loop_t *loop;
  uv_tcp_t listener;
  const attnd_rpc_counters_t *counters;
  attnd_engine_t *engine;
  uint64_t start_ns;
  int port;
  int open_handles; /* listener + connections not yet closed */
  int nconns;       /* open HTTP connections */
  int closing;
  struct hconn_s *conns;
  void (*close_cb)(void *arg);
  void *close_arg;
};

#define ATTND_METRICS_MAX_CONNS 64

typedef struct hconn_s {
  uv_tcp_t tcp;
  attnd_metrics_t *m;
  struct hconn_s *next, *prev;
  http_parser parser;
  char url[256];
  size_t url_len;
  int answered;
  int closing;
  char rbuf[2048];
} hconn_t;

typedef struct {
  uv_write_t req;
  char *buf;
} hwrite_t;

static http_parser_settings parser_settings;

static void handle_closed(attnd_metrics_t *m) {
  if (--m->open_handles == 0 && m->closing) {
    void (*cb)(void *) = m->close_cb;
    void *arg = m->close_arg;
    free(m);
    if (cb)
      cb(arg);
  }
}

static void hconn_close_cb(uv_handle_t *h) {
  hconn_t *c = h->data;
  attnd_metrics_t *m = c->m;
  m->nconns--;
  free(c);
  handle_closed(m);
}

static void hconn_close(hconn_t *c) {
  if (c->closing)
    return;
  c->closing = 1;
  attnd_metrics_t *m = c->m;
  if (c->prev)
    c->prev->next = c->next;
  else
    m->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  uv_close((uv_handle_t *)&c->tcp, hconn_close_cb);
}

static void hwrite_cb(uv_write_t *req, int status) {
  hwrite_t *w = (hwrite_t *)req;
  hconn_t *c = req->data;
  free(w->buf);
  free(w);
  hconn_close(c);
}

static void respond(hconn_t *c, int code, const char *ctype, const char *body, size_t blen) {
  const char *reason = code == 200   ? "OK"
                       : code == 404 ? "Not Found"
                       : code == 405 ? "Method Not Allowed"
                                     : "Bad Request";
  char hdr[256];
  int hl = snprintf(
      hdr, sizeof(hdr),
      "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
      code, reason, ctype, blen);
  hwrite_t *w = malloc(sizeof(*w));
  char *buf = malloc((size_t)hl + blen);
  if (!w || !buf) {
    free(w);
    free(buf);
    hconn_close(c);
    return;
  }
  memcpy(buf, hdr, (size_t)hl);
  memcpy(buf + hl, body, blen);
  w->buf = buf;
  w->req.data = c;
  uv_buf_t ub = uv_buf_init(buf, (unsigned)((size_t)hl + blen));
  c->answered = 1;
  uv_read_stop((uv_stream_t *)&c->tcp);
  if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &ub, 1, hwrite_cb) != 0) {
    free(buf);
    free(w);
    hconn_close(c);
  }
}

static int on_url(http_parser *p, const char *at, size_t len) {
  hconn_t *c = p->data;
  if (c->url_len + len >= sizeof(c->url))
    len = sizeof(c->url) - 1 - c->url_len;
  memcpy(c->url + c->url_len, at, len);
  c->url_len += len;
  c->url[c->url_len] = 0;
  return 0;
}

static int on_message_complete(http_parser *p) {
  hconn_t *c = p->data;
  attnd_metrics_t *m = c->m;
  /* The path without a query string. */
  size_t pl = strcspn(c->url, "?");
  int is_metrics = pl == 8 && strncmp(c->url, "/metrics", 8) == 0;
  if (!is_metrics) {
    static const char nf[] = "not found: only GET /metrics is served\n";
    respond(c, 404, "text/plain; charset=utf-8", nf, sizeof(nf) - 1);
  } else if (p->method != HTTP_GET && p->method != HTTP_HEAD) {
    static const char na[] = "method not allowed: use GET\n";
    respond(c, 405, "text/plain; charset=utf-8", na, sizeof(na) - 1);
  } else {
    char *body;
    size_t blen;
    double up = (double)(uv_hrtime() - m->start_ns) / 1e9;
    if (attnd_metrics_render(m->counters, m->engine, up, &body, &blen) != 0) {
      c->answered = 1;
      hconn_close(c);
      return 1;
    }
    respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", body,
            p->method == HTTP_HEAD ? 0 : blen);
    free(body);
  }
  return 1; /* one request per connection */
}

static void h_alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  hconn_t *c = h->data;
  *buf = uv_buf_init(c->rbuf, sizeof(c->rbuf));
}

static void h_read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  hconn_t *c = s->data;
  if (nread < 0) {
    hconn_close(c);
    return;
  }
  if (nread == 0 || c->answered)
    return;
  size_t n = http_parser_execute(&c->parser, &parser_settings, buf->base, (size_t)nread);
  if (!c->answered && (n != (size_t)nread || HTTP_PARSER_ERRNO(&c->parser) != HPE_OK)) {
    static const char br[] = "bad request\n";
    respond(c, 400, "text/plain; charset=utf-8", br, sizeof(br) - 1);
  }
}

static void on_http_conn(uv_stream_t *server, int status) {
  attnd_metrics_t *m = server->data;
  if (status < 0 || m->closing)
    return;
  hconn_t *c = calloc(1, sizeof(*c));
  if (!c)
    return;
  c->m = m;
  uv_tcp_init(m->loop, &c->tcp);
  c->tcp.data = c;
  m->open_handles++;
  m->nconns++;
  c->next = m->conns;
  if (m->conns)
    m->conns->prev = c;
  m->conns = c;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
    hconn_close(c);
    return;
  }
  /* Scrapers send one request and leave; a pile of idle connections is
   * someone else, and is not served. */
  if (m->nconns > ATTND_METRICS_MAX_CONNS) {
    hconn_close(c);
    return;
  }
  http_parser_init(&c->parser, HTTP_REQUEST);
  c->parser.data = c;
  uv_read_start((uv_stream_t *)&c->tcp, h_alloc_cb, h_read_cb);
}

static void listener_close_cb(uv_handle_t *h) {
  handle_closed(h->data);
}

int attnd_metrics_start(attnd_metrics_t **out, uv_loop_t *loop, const char *hostport,
                        const attnd_rpc_counters_t *counters, attnd_engine_t *engine, uint64_t start_ns,
                        char *err, size_t errlen) {
  char host[128];
  int port, rc;
  struct sockaddr_storage ss;
  if (attnd_config_hostport(hostport, host, sizeof(host), &port)) {
    snprintf(err, errlen, "--metrics '%s': expected HOST:PORT", hostport);
    return ATTND_EINVAL;
  }
  if (strcmp(host, "localhost") == 0)
    snprintf(host, sizeof(host), "127.0.0.1");
  if (uv_ip4_addr(host, port, (struct sockaddr_in *)&ss) != 0 &&
      uv_ip6_addr(host, port, (struct sockaddr_in6 *)&ss) != 0) {
    snprintf(err, errlen, "--metrics '%s': host must be a numeric address or localhost", hostport);
    return ATTND_EINVAL;
  }
  http_parser_settings_init(&parser_settings);
  parser_settings.on_url = on_url;
  parser_settings.on_message_complete = on_message_complete;

  attnd_metrics_t *m = calloc(1, sizeof(*m));
  if (!m)
    return ATTND_ENOMEM;
  m->loop = loop;
  m->counters = counters;
  m->engine = engine;
  m->start_ns = start_ns;
  uv_tcp_init(loop, &m->listener);
  m->listener.data = m;
  m->open_handles = 1;
  if ((rc = uv_tcp_bind(&m->listener, (struct sockaddr *)&ss, 0)) != 0 ||
      (rc = uv_listen((uv_stream_t *)&m->listener, 64, on_http_conn)) != 0) {
    snprintf(err, errlen, "--metrics %s: %s", hostport, uv_strerror(rc));
    m->closing = 1;
    uv_close((uv_handle_t *)&m->listener, listener_close_cb);
    return ATTND_EIO;
  }
  struct sockaddr_storage bound;
  int blen = sizeof(bound);
  uv_tcp_getsockname(&m->listener, (struct sockaddr *)&bound, &blen);
  m->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                              : ((struct sockaddr_in *)&bound)->sin_port);
  ATTND_LOGI("metrics_listening", "addr=%s port=%d", host, m->port);
  *out = m;
  return 0;
}

int attnd_metrics_port(const attnd_metrics_t *m) {
  return m->port;
}

void attnd_metrics_close(attnd_metrics_t *m, void (*cb)(void *arg), void *arg) {
  m->closing = 1;
  m->close_cb = cb;
  m->close_arg = arg;
  while (m->conns)
    hconn_close(m->conns);
  uv_close((uv_handle_t *)&m->listener, listener_close_cb);
}

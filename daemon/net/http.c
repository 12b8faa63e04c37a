/* http.c: the small HTTP server behind /metrics, /healthz and /readyz (net.h).
 *
 * Each request is one HTTP/1.x request on its own connection (Connection:
 * close), parsed with libhttp-parser. Nothing here blocks the loop: reads and
 * writes are libuv's, the answer is rendered at once (metrics.c, small and
 * bounded), and a connection that does not finish its request within
 * ATTND_HTTP_REQUEST_MS, or does not take its answer within
 * ATTND_HTTP_WRITE_MS, is closed by a sweep once a second. At most
 * ATTND_HTTP_MAX_CONNS are open: a new connection past that closes the oldest
 * one still waiting for its request (an idle client loses its place to a
 * scraper, not the other way round), and is refused only when every open
 * connection is being answered. */
#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The rate-limit key of this file's log lines (base.h), past the RPC's
 * (method, code) keys. */
#define HTTP_LOG_KEY (ATTND_LOG_RL_KEYS - 1)

enum { READY_STARTING = 0, READY_SERVING = 1, READY_DRAINING = 2 };

struct attnd_metrics_s {
  uv_loop_t *loop;
  uv_tcp_t listener;
  uv_timer_t sweep; /* closes connections past their deadline */
  const attnd_rpc_counters_t *counters;
  attnd_engine_t *engine;
  uint64_t start_ns;
  int port;
  int open_handles; /* listener + sweep timer + connections not yet closed */
  int nconns;       /* open HTTP connections */
  int closing;
  int ready; /* READY_* */
  char backend[16], device[128], kv_cache[24];
  attnd_list_t conns; /* oldest first */
  void (*close_cb)(void *arg);
  void *close_arg;
};

typedef struct hconn_s {
  uv_tcp_t tcp;
  attnd_metrics_t *m;
  attnd_list_t link;
  uint64_t deadline_ms; /* uv_now() past which the sweep closes it */
  http_parser parser;
  char url[256];
  size_t url_len;
  size_t got; /* request bytes read */
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
  free(c);
  handle_closed(m);
}

static void hconn_close(hconn_t *c) {
  if (c->closing)
    return;
  c->closing = 1;
  c->m->nconns--;
  attnd_list_remove(&c->link);
  uv_close((uv_handle_t *)&c->tcp, hconn_close_cb);
}

static void hwrite_cb(uv_write_t *req, int status) {
  hwrite_t *w = (hwrite_t *)req;
  hconn_t *c = req->data;
  free(w->buf);
  free(w);
  hconn_close(c);
}

static const char *reason_of(int code) {
  switch (code) {
  case 200:
    return "OK";
  case 404:
    return "Not Found";
  case 405:
    return "Method Not Allowed";
  case 413:
    return "Payload Too Large";
  case 503:
    return "Service Unavailable";
  default:
    return "Bad Request";
  }
}

/* head: the body is not sent (HEAD), its length still is. */
static void respond(hconn_t *c, int code, const char *ctype, const char *body, size_t blen,
                    int head) {
  char hdr[320];
  int hl = snprintf(hdr, sizeof(hdr),
                    "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                    "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
                    code, reason_of(code), ctype, blen, code == 405 ? "Allow: GET, HEAD\r\n" : "");
  size_t send_len = head ? 0 : blen;
  hwrite_t *w = malloc(sizeof(*w));
  char *buf = malloc((size_t)hl + send_len);
  c->answered = 1;
  uv_read_stop((uv_stream_t *)&c->tcp);
  if (!w || !buf) {
    free(w);
    free(buf);
    hconn_close(c);
    return;
  }
  memcpy(buf, hdr, (size_t)hl);
  memcpy(buf + hl, body, send_len);
  w->buf = buf;
  w->req.data = c;
  c->deadline_ms = uv_now(c->m->loop) + ATTND_HTTP_WRITE_MS;
  uv_buf_t ub = uv_buf_init(buf, (unsigned)((size_t)hl + send_len));
  if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &ub, 1, hwrite_cb) != 0) {
    free(buf);
    free(w);
    hconn_close(c);
  }
}

static void respond_text(hconn_t *c, int code, const char *text, int head) {
  respond(c, code, "text/plain; charset=utf-8", text, strlen(text), head);
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

static void answer_metrics(hconn_t *c, int head) {
  attnd_metrics_t *m = c->m;
  attnd_metrics_src_t src = {
      .counters = m->counters,
      .engine = m->engine,
      .uptime_s = (double)(uv_hrtime() - m->start_ns) / 1e9,
      .backend = m->backend,
      .device = m->device,
      .kv_cache = m->kv_cache,
  };
  char *body;
  size_t blen;
  if (attnd_metrics_render(&src, &body, &blen) != 0) {
    respond_text(c, 503, "out of memory rendering the metrics\n", head);
    return;
  }
  respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", body, blen, head);
  free(body);
}

static int on_message_complete(http_parser *p) {
  hconn_t *c = p->data;
  attnd_metrics_t *m = c->m;
  /* The path without a query string. */
  size_t pl = strcspn(c->url, "?");
  int head = p->method == HTTP_HEAD;
#define IS(path) (pl == sizeof(path) - 1 && strncmp(c->url, path, pl) == 0)
  if (!IS("/metrics") && !IS("/healthz") && !IS("/readyz")) {
    respond_text(c, 404, "not found: GET /metrics, /healthz or /readyz\n", head);
  } else if (p->method != HTTP_GET && !head) {
    respond_text(c, 405, "method not allowed: use GET or HEAD\n", 0);
  } else if (IS("/healthz")) {
    /* Answered by the loop thread itself: that it answers is the liveness. */
    respond_text(c, 200, "ok\n", head);
  } else if (IS("/readyz")) {
    if (m->ready == READY_SERVING)
      respond_text(c, 200, "ready\n", head);
    else
      respond_text(c, 503, m->ready == READY_DRAINING ? "draining\n" : "starting\n", head);
  } else {
    answer_metrics(c, head);
  }
#undef IS
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
  c->got += (size_t)nread;
  if (c->got > ATTND_HTTP_MAX_REQUEST) {
    respond_text(c, 413, "request too large\n", 0);
    return;
  }
  size_t n = http_parser_execute(&c->parser, &parser_settings, buf->base, (size_t)nread);
  if (!c->answered && (n != (size_t)nread || HTTP_PARSER_ERRNO(&c->parser) != HPE_OK))
    respond_text(c, 400, "bad request\n", 0);
}

/* Makes room for a new connection: closes the oldest one still waiting for
 * its request. 0 when there was one, -1 when every connection is answering. */
static int evict_idle(attnd_metrics_t *m) {
  ATTND_LIST_FOREACH(it, nx, &m->conns) {
    hconn_t *c = ATTND_LIST_DATA(it, hconn_t, link);
    if (!c->answered && !c->closing) {
      attnd_log_limited(ATTND_LOG_WARN, HTTP_LOG_KEY, "http_conn_evicted", "port=metrics",
                        "open=%d reason=\"oldest idle connection closed for a new one\"",
                        m->nconns);
      hconn_close(c);
      return 0;
    }
  }
  return -1;
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
  int full = m->nconns >= ATTND_HTTP_MAX_CONNS && evict_idle(m) != 0;
  m->nconns++;
  attnd_list_insert_tail(&m->conns, &c->link);
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0 || full) {
    hconn_close(c);
    return;
  }
  c->deadline_ms = uv_now(m->loop) + ATTND_HTTP_REQUEST_MS;
  http_parser_init(&c->parser, HTTP_REQUEST);
  c->parser.data = c;
  uv_tcp_nodelay(&c->tcp, 1);
  uv_read_start((uv_stream_t *)&c->tcp, h_alloc_cb, h_read_cb);
}

/* Once a second: close what is past its deadline (O(open connections),
 * at most ATTND_HTTP_MAX_CONNS). */
static void sweep_cb(uv_timer_t *t) {
  attnd_metrics_t *m = t->data;
  uint64_t now = uv_now(m->loop);
  ATTND_LIST_FOREACH(it, nx, &m->conns) {
    hconn_t *c = ATTND_LIST_DATA(it, hconn_t, link);
    if (now >= c->deadline_ms) {
      ATTND_LOGD("http_timeout", "stage=%s", c->answered ? "write" : "request");
      hconn_close(c);
    }
  }
}

static void own_close_cb(uv_handle_t *h) {
  handle_closed(h->data);
}

void attnd_metrics_set_ready(attnd_metrics_t *m, int ready) {
  if (ready)
    m->ready = READY_SERVING;
  else if (m->ready == READY_SERVING)
    m->ready = READY_DRAINING;
}

void attnd_metrics_set_build_info(attnd_metrics_t *m, const char *backend, const char *device,
                                  const char *kv_cache) {
  snprintf(m->backend, sizeof(m->backend), "%s", backend ? backend : "");
  snprintf(m->device, sizeof(m->device), "%s", device ? device : "");
  snprintf(m->kv_cache, sizeof(m->kv_cache), "%s", kv_cache ? kv_cache : "");
}

int attnd_metrics_start(attnd_metrics_t **out, uv_loop_t *loop, const char *hostport,
                        const attnd_rpc_counters_t *counters, attnd_engine_t *engine,
                        uint64_t start_ns, char *err, size_t errlen) {
  http_parser_settings_init(&parser_settings);
  parser_settings.on_url = on_url;
  parser_settings.on_message_complete = on_message_complete;
  attnd_metrics_t *m = attnd_xcalloc(1, sizeof(*m));
  m->loop = loop;
  m->counters = counters;
  m->engine = engine;
  m->start_ns = start_ns;
  attnd_list_init(&m->conns);
  char host[128];
  int inited = 0;
  int rc = attnd_net_tcp_listen(loop, &m->listener, hostport, "--metrics", 128, on_http_conn,
                                &inited, &m->port, host, sizeof(host), err, errlen);
  m->listener.data = m;
  if (rc) {
    if (!inited) {
      free(m);
      return rc;
    }
    m->open_handles = 1;
    m->closing = 1;
    uv_close((uv_handle_t *)&m->listener, own_close_cb);
    return rc;
  }
  uv_timer_init(loop, &m->sweep);
  m->sweep.data = m;
  uv_timer_start(&m->sweep, sweep_cb, 1000, 1000);
  uv_unref((uv_handle_t *)&m->sweep); /* alone it keeps no loop alive */
  m->open_handles = 2;
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
  attnd_list_t *it;
  while ((it = attnd_list_first(&m->conns)) != NULL)
    hconn_close(ATTND_LIST_DATA(it, hconn_t, link));
  uv_close((uv_handle_t *)&m->sweep, own_close_cb);
  uv_close((uv_handle_t *)&m->listener, own_close_cb);
}

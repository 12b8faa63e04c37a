/* http.c: the small HTTP server behind Prometheus /metrics (net.h).
 *
 * Each scrape is one HTTP/1.x request on its own connection (Connection:
 * close), parsed with libhttp-parser; anything but GET /metrics is a 404, a
 * method other than GET or HEAD a 405. Scrapers send one request and leave:
 * more than ATTND_METRICS_MAX_CONNS open at once are closed unanswered. */
#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

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
  char host[128];
  int inited = 0;
  int rc = attnd_net_tcp_listen(loop, &m->listener, hostport, "--metrics", 64, on_http_conn,
                                &inited, &m->port, host, sizeof(host), err, errlen);
  m->listener.data = m;
  if (rc) {
    if (!inited) {
      free(m);
      return rc;
    }
    m->open_handles = 1;
    m->closing = 1;
    uv_close((uv_handle_t *)&m->listener, listener_close_cb);
    return rc;
  }
  m->open_handles = 1;
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

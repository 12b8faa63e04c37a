/* server.c: see server.h.
 *
 * Ownership: a connection (conn_t) is freed only when both its libuv handle
 * has closed and no request holds it any more (rpc.c counts them); the server
 * is freed only when every connection and listener is gone. Responses to a
 * connection that closed meanwhile are dropped by rpc.c. */
#include "server.h"

#include <errno.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "base.h"
#include "frame.h"

/* How long a drain waits for responses to be written to clients that do not
 * read before it closes their connections anyway. */
#define DRAIN_FLUSH_TIMEOUT_MS 5000
/* Once the last in-flight request is answered, connections stay readable this
 * long before they close: requests a client sent just before the signal may
 * still sit in the socket buffer, and they get an UNAVAILABLE answer
 * ("draining") instead of a silent close. */
#define DRAIN_READ_GRACE_MS 20

typedef struct conn_s conn_t;

/* Responses produced while one read's frames are handled go out in one
 * writev (pipelined small calls would otherwise cost a syscall each). */
#define WRITE_BATCH 64

struct conn_s {
  union {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } h;
  attnd_server_t *srv;
  attnd_rpc_conn_t rc;
  attnd_frame_reader_t fr;
  conn_t *next, *prev;
  uint64_t write_bytes; /* response bytes queued, not yet written */
  int reading;
  int closing;
  int handle_closed;
  int in_feed;                 /* inside the frame reader: no re-entry */
  int close_when_flushed;      /* close once every queued response is written */
  int counted;                 /* counts against --max-connections */
  uint64_t accepted_ms;        /* uv_now() at accept, for the Hello deadline */
  uv_buf_t batch[WRITE_BATCH]; /* responses waiting for the end of the read */
  unsigned nbatch;
  size_t batch_len;
};

typedef struct {
  uv_write_t req;
  conn_t *conn;
  size_t len; /* bytes in all buffers */
  unsigned n;
  void **owned; /* sendv: what to free when written (NULL: every bufs[i].base) */
  unsigned nowned;
  uv_buf_t bufs[]; /* owned: freed when written */
} wreq_t;

struct attnd_server_s {
  uv_loop_t *loop;
  const attnd_config_t *cfg;
  attnd_engine_t *engine;
  attnd_rpc_t rpc;
  uv_pipe_t unix_l;
  uv_tcp_t tcp_l;
  int has_unix, has_tcp;
  char unix_path[256];
  int tcp_port;
  conn_t *conns;
  int open; /* listeners + connections not yet freed */
  int draining, finishing, done;
  uv_timer_t drain_timer;
  uv_timer_t hello_timer; /* closes off-loopback connections that never say Hello */
  int has_hello_timer;
  void (*drain_cb)(void *arg);
  void *drain_arg;
  attnd_server_stats_t st;
};

#define CONN_OF(rcp) ((conn_t *)((char *)(rcp)-offsetof(conn_t, rc)))

static void flow_update(conn_t *c);
static void conn_close(conn_t *c);
static void flush_batch(conn_t *c);
static void check_done(attnd_server_t *s);

/* ---- connection lifetime --------------------------------------------------- */

static void conn_maybe_free(conn_t *c) {
  if (!c->handle_closed || c->rc.pending > 0)
    return;
  attnd_server_t *s = c->srv;
  free(c);
  s->open--;
  check_done(s);
}

static void conn_close_cb(uv_handle_t *h) {
  conn_t *c = h->data;
  c->handle_closed = 1;
  attnd_frame_reader_free(&c->fr);
  conn_maybe_free(c);
}

static void conn_close(conn_t *c) {
  if (c->closing)
    return;
  attnd_server_t *s = c->srv;
  c->closing = 1;
  flush_batch(c); /* frees what was never sent */
  if (c->reading)
    uv_read_stop(&c->h.stream);
  c->reading = 0;
  if (c->prev)
    c->prev->next = c->next;
  else
    s->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  c->next = c->prev = NULL;
  if (c->counted) {
    s->rpc.counters.connections--;
    s->st.connections--;
  }
  ATTND_LOGD("conn_closed", "conn=%llu pending=%u", (unsigned long long)c->rc.id, c->rc.pending);
  attnd_rpc_conn_closed(&c->rc);
  uv_close(&c->h.handle, conn_close_cb);
}

static void rc_released(attnd_rpc_conn_t *rc) {
  conn_maybe_free(CONN_OF(rc));
}

static void rc_progress(attnd_rpc_conn_t *rc) {
  flow_update(CONN_OF(rc));
}

/* ---- writing ---------------------------------------------------------------- */

static void wreq_free(wreq_t *w) {
  if (w->owned) {
    for (unsigned i = 0; i < w->nowned; i++)
      free(w->owned[i]);
    free(w->owned);
  } else {
    for (unsigned i = 0; i < w->n; i++)
      free(w->bufs[i].base);
  }
  free(w);
}

static void write_cb(uv_write_t *req, int status) {
  wreq_t *w = (wreq_t *)req;
  conn_t *c = w->conn;
  c->write_bytes -= w->len;
  wreq_free(w);
  if (c->closing)
    return;
  if (status < 0) {
    conn_close(c);
    return;
  }
  if (c->close_when_flushed && c->write_bytes == 0) {
    conn_close(c);
    return;
  }
  flow_update(c);
}

static void note_inflight(conn_t *c) {
  uint64_t inflight = c->rc.req_bytes + c->write_bytes;
  if (inflight > c->srv->st.peak_conn_inflight)
    c->srv->st.peak_conn_inflight = inflight;
}

/* owned: NULL when every bufs[i].base is its own allocation, else the list
 * (taken over) of what to free once written. */
static void submit(conn_t *c, const uv_buf_t *bufs, unsigned n, size_t len, void **owned,
                   unsigned nowned) {
  wreq_t *w = malloc(sizeof(*w) + n * sizeof(uv_buf_t));
  if (!w)
    abort();
  w->conn = c;
  w->len = len;
  w->n = n;
  w->owned = owned;
  w->nowned = nowned;
  memcpy(w->bufs, bufs, n * sizeof(uv_buf_t));
  if (uv_write(&w->req, &c->h.stream, w->bufs, n, write_cb) != 0) {
    c->write_bytes -= len;
    wreq_free(w);
    conn_close(c);
  }
}

/* Sends the responses batched during a read (or drops them once closing). */
static void flush_batch(conn_t *c) {
  unsigned n = c->nbatch;
  size_t len = c->batch_len;
  if (n == 0)
    return;
  c->nbatch = 0;
  c->batch_len = 0;
  if (c->closing) {
    c->write_bytes -= len;
    for (unsigned i = 0; i < n; i++)
      free(c->batch[i].base);
    return;
  }
  submit(c, c->batch, n, len, NULL, 0);
}

static void rc_send(attnd_rpc_conn_t *rc, uint8_t *buf, size_t len, int close_after) {
  conn_t *c = CONN_OF(rc);
  if (c->closing) {
    free(buf);
    return;
  }
  uv_buf_t ub = uv_buf_init((char *)buf, (unsigned)len);
  c->write_bytes += len;
  note_inflight(c);
  if (close_after) {
    c->close_when_flushed = 1;
    if (c->reading)
      uv_read_stop(&c->h.stream);
    c->reading = 0;
  }
  if (c->in_feed) {
    c->batch[c->nbatch++] = ub;
    c->batch_len += len;
    if (c->nbatch == WRITE_BATCH)
      flush_batch(c);
    return;
  }
  submit(c, &ub, 1, len, NULL, 0);
}

/* A response in pieces (rpc.h): written after everything queued before it,
 * in one uv_write; the pieces' free_p are freed once it is written. */
static void rc_sendv(attnd_rpc_conn_t *rc, const attnd_rpc_seg_t *segs, int n, int close_after) {
  conn_t *c = CONN_OF(rc);
  void **owned = malloc((size_t)n * sizeof(void *));
  uv_buf_t *bufs = malloc((size_t)n * sizeof(uv_buf_t));
  if (!owned || !bufs)
    abort();
  unsigned nowned = 0;
  size_t len = 0;
  for (int i = 0; i < n; i++) {
    if (segs[i].free_p)
      owned[nowned++] = segs[i].free_p;
    /* uv_buf_t lengths are unsigned int; frames are < 2^32 and a tensor is
     * one piece of one frame. */
    bufs[i] = uv_buf_init((char *)segs[i].p, (unsigned)segs[i].n);
    len += segs[i].n;
  }
  if (c->closing) {
    for (unsigned i = 0; i < nowned; i++)
      free(owned[i]);
    free(owned);
    free(bufs);
    return;
  }
  c->write_bytes += len;
  note_inflight(c);
  if (close_after) {
    c->close_when_flushed = 1;
    if (c->reading)
      uv_read_stop(&c->h.stream);
    c->reading = 0;
  }
  flush_batch(c); /* keep the order of responses already batched */
  submit(c, bufs, (unsigned)n, len, owned, nowned);
  free(bufs);
}

/* ---- reading ---------------------------------------------------------------- */

static int frame_cb(void *arg, uint8_t *frame, size_t len) {
  conn_t *c = arg;
  if (c->closing || c->close_when_flushed) {
    free(frame);
    return -1;
  }
  attnd_rpc_handle_frame(&c->rc, frame, len);
  note_inflight(c);
  if (c->closing || c->close_when_flushed)
    return -1;
  if (c->rc.req_bytes + c->write_bytes > c->srv->cfg->max_inflight)
    return ATTND_FRAME_PAUSE;
  return 0;
}

/* Acts on what the frame reader returned. */
static void feed_result(conn_t *c, int rc) {
  if (rc >= 0 || c->closing || c->close_when_flushed)
    return;
  attnd_server_t *s = c->srv;
  char msg[160];
  if (rc == ATTND_ENOSPC) {
    snprintf(msg, sizeof(msg), "frame of %llu bytes exceeds --max-frame %llu",
             (unsigned long long)c->fr.bad_len, (unsigned long long)s->cfg->max_frame);
    ATTND_LOGI("bad_frame", "conn=%llu reason=too_large len=%llu", (unsigned long long)c->rc.id,
               (unsigned long long)c->fr.bad_len);
    attnd_rpc_frame_error(&c->rc, ATTND_ENOSPC, msg);
  } else if (rc == ATTND_EINVAL) {
    ATTND_LOGI("bad_frame", "conn=%llu reason=zero_length", (unsigned long long)c->rc.id);
    attnd_rpc_frame_error(&c->rc, ATTND_EINVAL, "zero-length frame");
  } else {
    ATTND_LOGW("conn_error", "conn=%llu err=\"%s\"", (unsigned long long)c->rc.id,
               attnd_strerror(rc));
    conn_close(c);
  }
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  conn_t *c = h->data;
  uint8_t *base;
  size_t len;
  if (attnd_frame_reader_buf(&c->fr, &base, &len) != 0) {
    *buf = uv_buf_init(NULL, 0); /* read_cb gets UV_ENOBUFS and closes */
    return;
  }
  /* uv_buf_t lengths are unsigned int; frames are < 2^31. */
  *buf = uv_buf_init((char *)base, (unsigned)len);
}

static void read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  conn_t *c = st->data;
  if (nread < 0) {
    if (nread != UV_EOF)
      ATTND_LOGD("conn_read_error", "conn=%llu err=%s", (unsigned long long)c->rc.id,
                 uv_err_name((int)nread));
    else if (attnd_frame_reader_partial(&c->fr))
      ATTND_LOGI("conn_eof_mid_frame", "conn=%llu", (unsigned long long)c->rc.id);
    conn_close(c);
    return;
  }
  if (nread == 0 || c->closing)
    return;
  c->in_feed = 1;
  int rc = attnd_frame_reader_feed(&c->fr, (const uint8_t *)buf->base, (size_t)nread, frame_cb, c);
  c->in_feed = 0;
  flush_batch(c); /* before any framing error, to keep responses in order */
  feed_result(c, rc);
  flow_update(c);
}

/* Backpressure: stop reading above --max-inflight, resume (first with the
 * bytes a pause left unparsed) once at or below it. */
static void flow_update(conn_t *c) {
  attnd_server_t *s = c->srv;
  if (c->closing || c->close_when_flushed || c->in_feed)
    return;
  for (;;) {
    uint64_t inflight = c->rc.req_bytes + c->write_bytes;
    if (inflight > s->cfg->max_inflight) {
      if (c->reading) {
        uv_read_stop(&c->h.stream);
        c->reading = 0;
        s->st.reads_paused++;
        ATTND_LOGD("conn_paused", "conn=%llu inflight=%llu", (unsigned long long)c->rc.id,
                   (unsigned long long)inflight);
      }
      return;
    }
    if (attnd_frame_reader_paused(&c->fr)) {
      c->in_feed = 1;
      int rc = attnd_frame_reader_resume(&c->fr, frame_cb, c);
      c->in_feed = 0;
      flush_batch(c);
      feed_result(c, rc);
      if (c->closing || c->close_when_flushed)
        return;
      continue; /* re-check the bound after the kept frames */
    }
    if (!c->reading && !s->finishing) {
      if (uv_read_start(&c->h.stream, alloc_cb, read_cb) != 0) {
        conn_close(c);
        return;
      }
      c->reading = 1;
    }
    return;
  }
}

/* ---- accepting --------------------------------------------------------------- */

static conn_t *conn_new(attnd_server_t *s, int is_tcp) {
  conn_t *c = calloc(1, sizeof(*c));
  if (!c)
    abort();
  c->srv = s;
  if (is_tcp)
    uv_tcp_init(s->loop, &c->h.tcp);
  else
    uv_pipe_init(s->loop, &c->h.pipe, 0);
  c->h.handle.data = c;
  c->accepted_ms = uv_now(s->loop);
  attnd_frame_reader_init(&c->fr, s->cfg->max_frame);
  s->open++;
  c->next = s->conns;
  if (s->conns)
    s->conns->prev = c;
  s->conns = c;
  return c;
}

/* Accepted, identity known: either start serving or refuse politely. */
static void conn_start(attnd_server_t *s, conn_t *c, uint64_t identity, int need_hello,
                       const char *peer) {
  attnd_rpc_conn_init(&c->rc, &s->rpc, identity, need_hello);
  c->rc.send = rc_send;
  c->rc.sendv = rc_sendv;
  c->rc.progress = rc_progress;
  c->rc.released = rc_released;
  if (s->rpc.counters.connections >= (uint32_t)s->cfg->max_connections) {
    s->rpc.counters.connections_refused++;
    ATTND_LOGW("conn_refused", "peer=%s reason=max_connections limit=%d", peer,
               s->cfg->max_connections);
    attnd_rpc_send_error(&c->rc, 0, ATTND_ENOSPC, "too many connections (--max-connections)", 1);
    return;
  }
  c->counted = 1;
  s->rpc.counters.connections++;
  s->rpc.counters.connections_total++;
  s->st.connections++;
  ATTND_LOGD("conn_open", "conn=%llu peer=%s need_hello=%d", (unsigned long long)c->rc.id, peer,
             need_hello);
  if (uv_read_start(&c->h.stream, alloc_cb, read_cb) != 0) {
    conn_close(c);
    return;
  }
  c->reading = 1;
}

static void on_unix_conn(uv_stream_t *server, int status) {
  attnd_server_t *s = server->data;
  if (status < 0 || s->draining)
    return;
  conn_t *c = conn_new(s, 0);
  if (uv_accept(server, &c->h.stream) != 0) {
    attnd_rpc_conn_init(&c->rc, &s->rpc, 0, 0);
    conn_close(c);
    return;
  }
  /* The peer's uid is its identity; the kernel vouches for it. */
  uv_os_fd_t fd;
  struct ucred cred;
  socklen_t cl = sizeof(cred);
  uint64_t identity = ATTND_IDENTITY_ANON;
  if (uv_fileno(&c->h.handle, &fd) == 0 && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0)
    identity = (uint64_t)cred.uid;
  char peer[32];
  snprintf(peer, sizeof(peer), "uid:%llu", (unsigned long long)identity);
  conn_start(s, c, identity, 0, peer);
}

static int is_loopback(const struct sockaddr_storage *a) {
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)a;
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (a->ss_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)a;
    if (IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr))
      return 1;
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr))
      return in6->sin6_addr.s6_addr[12] == 127;
  }
  return 0;
}

static void on_tcp_conn(uv_stream_t *server, int status) {
  attnd_server_t *s = server->data;
  if (status < 0 || s->draining)
    return;
  conn_t *c = conn_new(s, 1);
  if (uv_accept(server, &c->h.stream) != 0) {
    attnd_rpc_conn_init(&c->rc, &s->rpc, 0, 0);
    conn_close(c);
    return;
  }
  uv_tcp_nodelay(&c->h.tcp, 1);
  /* A peer that vanished without a FIN is noticed, and its slot freed. */
  uv_tcp_keepalive(&c->h.tcp, 1, 60);
  struct sockaddr_storage peer;
  int pl = sizeof(peer);
  int loop = 0;
  char name[64] = "?";
  if (uv_tcp_getpeername(&c->h.tcp, (struct sockaddr *)&peer, &pl) == 0) {
    loop = is_loopback(&peer);
    if (peer.ss_family == AF_INET)
      uv_ip4_name((struct sockaddr_in *)&peer, name, sizeof(name));
    else
      uv_ip6_name((struct sockaddr_in6 *)&peer, name, sizeof(name));
  }
  /* Off loopback, Hello{token} must come first (DESIGN.md section 7); with
   * --require-token on loopback too. */
  conn_start(s, c, ATTND_IDENTITY_ANON, !loop || s->cfg->require_token, name);
}

/* Off-loopback connections get --hello-timeout to authenticate; after that
 * they are told so and closed. */
static void hello_sweep_cb(uv_timer_t *t) {
  attnd_server_t *s = t->data;
  uint64_t now = uv_now(s->loop);
  conn_t *c = s->conns;
  while (c) {
    conn_t *next = c->next;
    if (c->rc.need_hello && !c->close_when_flushed &&
        now - c->accepted_ms >= (uint64_t)s->cfg->hello_timeout_ms) {
      ATTND_LOGI("hello_timeout", "conn=%llu", (unsigned long long)c->rc.id);
      attnd_rpc_send_error(&c->rc, 0, ATTND_EUNAUTH, "no Hello{token} in time", 1);
    }
    c = next;
  }
}

/* ---- listeners ------------------------------------------------------------------ */

static int mkdir_private(const char *dir, char *err, size_t errlen) {
  char tmp[256];
  snprintf(tmp, sizeof(tmp), "%s", dir);
  for (char *p = tmp + 1; *p; p++) {
    if (*p != '/')
      continue;
    *p = 0;
    if (mkdir(tmp, 0700) != 0 && errno != EEXIST) {
      snprintf(err, errlen, "--socket: cannot create %s: %s", tmp, strerror(errno));
      return ATTND_EIO;
    }
    *p = '/';
  }
  if (mkdir(tmp, 0700) != 0 && errno != EEXIST) {
    snprintf(err, errlen, "--socket: cannot create %s: %s", tmp, strerror(errno));
    return ATTND_EIO;
  }
  return 0;
}

/* A socket file left by a daemon that died is removed; one that still answers
 * belongs to a live daemon and is an error. */
static int clear_stale_socket(const char *path, char *err, size_t errlen) {
  struct stat st;
  if (lstat(path, &st) != 0)
    return 0;
  if (!S_ISSOCK(st.st_mode)) {
    snprintf(err, errlen, "--socket %s: exists and is not a socket", path);
    return ATTND_EINVAL;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    struct sockaddr_un a;
    memset(&a, 0, sizeof(a));
    a.sun_family = AF_UNIX;
    size_t pl = strlen(path);
    if (pl >= sizeof(a.sun_path))
      pl = sizeof(a.sun_path) - 1;
    memcpy(a.sun_path, path, pl);
    int live = connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    close(fd);
    if (live) {
      snprintf(err, errlen, "--socket %s: another daemon is listening there", path);
      return ATTND_EINVAL;
    }
  }
  if (unlink(path) != 0) {
    snprintf(err, errlen, "--socket %s: cannot remove stale socket: %s", path, strerror(errno));
    return ATTND_EIO;
  }
  ATTND_LOGI("stale_socket_removed", "path=%s", path);
  return 0;
}

static void listener_close_cb(uv_handle_t *h) {
  attnd_server_t *s = h->data;
  s->open--;
  check_done(s);
}

static int start_unix(attnd_server_t *s, char *err, size_t errlen) {
  const char *path = s->cfg->socket_path;
  char dir[256];
  int rc;
  snprintf(dir, sizeof(dir), "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash && slash != dir) {
    *slash = 0;
    struct stat st;
    if (stat(dir, &st) != 0 && (rc = mkdir_private(dir, err, errlen)))
      return rc;
    /* A directory someone else controls (a pre-created /tmp/attnd-$UID) could
     * swap our socket for theirs: refuse it. */
    if (lstat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
      snprintf(err, errlen, "--socket: %s is not a directory", dir);
      return ATTND_EINVAL;
    }
    if (st.st_uid != geteuid() && st.st_uid != 0) {
      snprintf(err, errlen, "--socket: %s belongs to uid %u, not to us", dir, (unsigned)st.st_uid);
      return ATTND_EPERM;
    }
    if ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX)) {
      snprintf(err, errlen, "--socket: %s is world-writable", dir);
      return ATTND_EPERM;
    }
  }
  if ((rc = clear_stale_socket(path, err, errlen)))
    return rc;
  uv_pipe_init(s->loop, &s->unix_l, 0);
  s->unix_l.data = s;
  s->has_unix = 1;
  s->open++;
  if ((rc = uv_pipe_bind(&s->unix_l, path)) != 0) {
    snprintf(err, errlen, "--socket %s: %s", path, uv_strerror(rc));
    return ATTND_EIO;
  }
  snprintf(s->unix_path, sizeof(s->unix_path), "%s", path);
  /* Group members may connect too (a service group), nobody else. */
  if (chmod(path, 0660) != 0) {
    snprintf(err, errlen, "--socket %s: chmod: %s", path, strerror(errno));
    return ATTND_EIO;
  }
  if ((rc = uv_listen((uv_stream_t *)&s->unix_l, 511, on_unix_conn)) != 0) {
    snprintf(err, errlen, "--socket %s: %s", path, uv_strerror(rc));
    return ATTND_EIO;
  }
  ATTND_LOGI("listening", "unix=%s", path);
  return 0;
}

static int start_tcp(attnd_server_t *s, char *err, size_t errlen) {
  char host[128];
  int port, rc;
  struct sockaddr_storage ss;
  if (attnd_config_hostport(s->cfg->listen, host, sizeof(host), &port)) {
    snprintf(err, errlen, "--listen '%s': expected HOST:PORT", s->cfg->listen);
    return ATTND_EINVAL;
  }
  if (strcmp(host, "localhost") == 0)
    snprintf(host, sizeof(host), "127.0.0.1");
  if (uv_ip4_addr(host, port, (struct sockaddr_in *)&ss) != 0 &&
      uv_ip6_addr(host, port, (struct sockaddr_in6 *)&ss) != 0) {
    snprintf(err, errlen, "--listen '%s': host must be a numeric address or localhost",
             s->cfg->listen);
    return ATTND_EINVAL;
  }
  uv_tcp_init(s->loop, &s->tcp_l);
  s->tcp_l.data = s;
  s->has_tcp = 1;
  s->open++;
  if ((rc = uv_tcp_bind(&s->tcp_l, (struct sockaddr *)&ss, 0)) != 0 ||
      (rc = uv_listen((uv_stream_t *)&s->tcp_l, 511, on_tcp_conn)) != 0) {
    snprintf(err, errlen, "--listen %s: %s", s->cfg->listen, uv_strerror(rc));
    return ATTND_EIO;
  }
  struct sockaddr_storage bound;
  int bl = sizeof(bound);
  uv_tcp_getsockname(&s->tcp_l, (struct sockaddr *)&bound, &bl);
  s->tcp_port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                  : ((struct sockaddr_in *)&bound)->sin_port);
  s->rpc.tcp_port = s->tcp_port;
  uint64_t period = (uint64_t)s->cfg->hello_timeout_ms / 4;
  if (period < 10)
    period = 10;
  if (period > 1000)
    period = 1000;
  uv_timer_init(s->loop, &s->hello_timer);
  s->hello_timer.data = s;
  s->has_hello_timer = 1;
  s->open++;
  uv_timer_start(&s->hello_timer, hello_sweep_cb, period, period);
  ATTND_LOGI("listening", "tcp=%s port=%d", host, s->tcp_port);
  return 0;
}

static void close_listeners(attnd_server_t *s) {
  if (s->has_unix) {
    s->has_unix = 0;
    uv_close((uv_handle_t *)&s->unix_l, listener_close_cb);
    if (s->unix_path[0])
      unlink(s->unix_path);
  }
  if (s->has_tcp) {
    s->has_tcp = 0;
    uv_close((uv_handle_t *)&s->tcp_l, listener_close_cb);
  }
  if (s->has_hello_timer) {
    s->has_hello_timer = 0;
    uv_close((uv_handle_t *)&s->hello_timer, listener_close_cb);
  }
}

int attnd_server_start(attnd_server_t **out, uv_loop_t *loop, const attnd_config_t *cfg,
                       attnd_engine_t *engine, char *err, size_t errlen) {
  attnd_server_t *s = calloc(1, sizeof(*s));
  int rc;
  if (!s)
    return ATTND_ENOMEM;
  s->loop = loop;
  s->cfg = cfg;
  s->engine = engine;
  if ((rc = attnd_rpc_init(&s->rpc, loop, engine, cfg, err, errlen))) {
    free(s);
    return rc;
  }
  uv_timer_init(loop, &s->drain_timer);
  s->drain_timer.data = s;
  s->open++; /* the timer, closed last */
  if (cfg->socket_path[0] && (rc = start_unix(s, err, errlen)))
    goto fail;
  if (cfg->listen[0] && (rc = start_tcp(s, err, errlen)))
    goto fail;
  *out = s;
  return 0;
fail:
  /* Close what was opened; the struct goes once the loop has run the closes. */
  attnd_server_drain(s, NULL, NULL);
  return rc;
}

attnd_rpc_t *attnd_server_rpc(attnd_server_t *s) {
  return &s->rpc;
}

int attnd_server_tcp_port(const attnd_server_t *s) {
  return s->tcp_port;
}

void attnd_server_stats(const attnd_server_t *s, attnd_server_stats_t *st) {
  *st = s->st;
}

/* ---- drain ------------------------------------------------------------------------ */

static void final_close_cb(uv_handle_t *h) {
  attnd_server_t *s = h->data;
  void (*cb)(void *) = s->drain_cb;
  void *arg = s->drain_arg;
  attnd_rpc_free(&s->rpc);
  free(s);
  ATTND_LOGD("server_closed", "%s", "");
  if (cb)
    cb(arg);
}

static void check_done(attnd_server_t *s) {
  /* Everything but the timer gone: close the timer, then report. */
  if (s->finishing && !s->done && s->open == 1) {
    s->done = 1;
    uv_timer_stop(&s->drain_timer);
    uv_close((uv_handle_t *)&s->drain_timer, final_close_cb);
  }
}

static void drain_timeout_cb(uv_timer_t *t) {
  attnd_server_t *s = t->data;
  ATTND_LOGW("drain_timeout", "reason=unwritten_responses timeout_ms=%d", DRAIN_FLUSH_TIMEOUT_MS);
  while (s->conns)
    conn_close(s->conns);
}

/* The read grace is over: flush and close the connections. */
static void close_drained(uv_timer_t *t) {
  attnd_server_t *s = t->data;
  conn_t *c = s->conns;
  while (c) {
    conn_t *next = c->next;
    if (c->write_bytes == 0) {
      conn_close(c);
    } else {
      c->close_when_flushed = 1;
      if (c->reading)
        uv_read_stop(&c->h.stream);
      c->reading = 0;
    }
    c = next;
  }
  if (s->conns) {
    uv_timer_start(&s->drain_timer, drain_timeout_cb, DRAIN_FLUSH_TIMEOUT_MS, 0);
  }
  check_done(s);
}

/* Every request has been answered: read what clients already sent for a
 * moment (answered UNAVAILABLE), then flush and close the connections. */
static void finish_drain(void *arg) {
  attnd_server_t *s = arg;
  if (s->finishing)
    return;
  s->finishing = 1;
  s->rpc.idle_cb = NULL;
  if (!s->conns) {
    check_done(s);
    return;
  }
  uv_timer_start(&s->drain_timer, close_drained, DRAIN_READ_GRACE_MS, 0);
}

void attnd_server_drain(attnd_server_t *s, void (*cb)(void *arg), void *arg) {
  if (s->draining)
    return;
  s->draining = 1;
  s->rpc.draining = 1;
  s->drain_cb = cb;
  s->drain_arg = arg;
  close_listeners(s);
  ATTND_LOGI("draining", "inflight=%llu connections=%u", (unsigned long long)s->rpc.inflight,
             s->rpc.counters.connections);
  if (s->rpc.inflight == 0) {
    finish_drain(s);
  } else {
    s->rpc.idle_cb = finish_drain;
    s->rpc.idle_arg = s;
  }
}

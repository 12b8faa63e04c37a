/* listen.c: the RPC listeners (net.h, internal.h): the Unix socket (its
 * private directory, a stale socket replaced, the peer's uid as identity)
 * and the TCP listener (loopback or Hello{token}). The Hello deadline of
 * off-loopback connections is kept by the sweep in limits.c. */
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal.h"

/* ---- accepting ---- */

static void on_unix_conn(uv_stream_t *server, int status) {
  attnd_server_t *s = server->data;
  if (status < 0 || s->draining)
    return;
  attnd_conn_t *c = attnd_conn_new(s, 0);
  if (uv_accept(server, &c->h.stream) != 0) {
    attnd_rpc_conn_init(&c->rc, &s->rpc, 0, 0);
    attnd_conn_close(c);
    return;
  }
  /* The peer's uid is its identity; the kernel vouches for it. */
  uv_os_fd_t fd;
  struct ucred cred;
  socklen_t cl = sizeof(cred);
  uint64_t identity = ATTND_IDENTITY_ANON;
  int have_fd = uv_fileno(&c->h.handle, &fd) == 0;
  if (have_fd && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0)
    identity = (uint64_t)cred.uid;
  /* A Unix stream socket's bytes in flight are bounded by the sender's
   * buffer alone: the kernel's default (~208K) cuts a 32 MiB answer into
   * ~160 writes, each a wake-up of both sides. Best effort: the kernel caps
   * it at net.core.wmem_max. TCP keeps its own autotuning. */
  if (have_fd && s->cfg->socket_buffer) {
    int v = (int)s->cfg->socket_buffer, got = 0;
    socklen_t gl = sizeof(got);
    int rc = setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof(v));
    if (!s->sndbuf_logged) {
      /* Once: what the kernel made of it (Linux doubles the value for its
       * own bookkeeping, after capping it at net.core.wmem_max). */
      s->sndbuf_logged = 1;
      if (rc != 0 || getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &gl) != 0)
        got = -1;
      ATTND_LOGI("socket_buffer", "requested=%d effective=%d%s", v, got,
                 got >= 0 && (long)got < 2L * v ? " capped=net.core.wmem_max" : "");
    }
  }
  char peer[32];
  snprintf(peer, sizeof(peer), "uid:%llu", (unsigned long long)identity);
  attnd_conn_start(s, c, identity, 0, peer);
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
  attnd_conn_t *c = attnd_conn_new(s, 1);
  if (uv_accept(server, &c->h.stream) != 0) {
    attnd_rpc_conn_init(&c->rc, &s->rpc, 0, 0);
    attnd_conn_close(c);
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
  /* Off loopback, Hello{token} must come first (docs/protocol.md); with
   * --require-token on loopback too. */
  attnd_conn_start(s, c, ATTND_IDENTITY_ANON, !loop || s->cfg->require_token, name);
  c->rc.same_host = loop; /* may register device buffers (docs/protocol.md) */
}

/* ---- listeners ---- */

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
  attnd_net_check_done(s);
}

int attnd_net_start_unix(attnd_server_t *s, char *err, size_t errlen) {
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

int attnd_net_start_tcp(attnd_server_t *s, char *err, size_t errlen) {
  char host[128];
  int inited = 0;
  int rc = attnd_net_tcp_listen(s->loop, &s->tcp_l, s->cfg->listen, "--listen", 511, on_tcp_conn,
                                &inited, &s->tcp_port, host, sizeof(host), err, errlen);
  if (inited) {
    s->tcp_l.data = s;
    s->has_tcp = 1;
    s->open++;
  }
  if (rc)
    return rc;
  s->rpc.tcp_port = s->tcp_port;
  ATTND_LOGI("listening", "tcp=%s port=%d", host, s->tcp_port);
  return 0;
}

void attnd_net_close_listeners(attnd_server_t *s) {
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
  attnd_net_limits_close(s, 0);
}

/* attnclient_io.c: libattnclient's framing (attnclient.h): requests out,
 * responses in.
 *
 * A request is encoded through a nanopb stream whose callback keeps small
 * writes in one buffer the client reuses and records a large write (a tensor's
 * bytes) as a pointer to the caller's memory, so that a 48 MiB prefill step
 * goes to the socket with writev() and no copy: copying it, into memory freshly
 * mapped for each step, cost more than the socket transfer itself. */
#include <errno.h>
#include <stdatomic.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <pb_decode.h>
#include <pb_encode.h>

#include "attnclient.h"
#include "attnclient_internal.h"

/* Writes of at least this many bytes go to the socket from where they are. */
#define PIECE_MIN ((size_t)64 << 10)
/* Kernel socket buffers asked for: a few large reads and writes per frame
 * instead of hundreds of 200 KiB ones, each a wakeup of the other side. */
#define SOCK_BUF (4 << 20)
/* Response bodies of at least this size are kept for the next one. */
#define SPARE_MIN ((size_t)1 << 20)

/* One spare body for the process: a large response is read into memory that
 * an earlier one already faulted in (reading into fresh pages costs as much
 * as the copy from the socket). resp_free cannot reach its client, so the
 * slot is global; it holds one body at most (the largest recent one). Its
 * capacity sits in the 64 bytes before the body. */
static _Atomic(uint8_t *) spare;
#define BIG_HDR 64

static uint8_t *big_alloc(size_t n) {
  uint8_t *b = atomic_exchange(&spare, NULL);
  if (b) {
    size_t cap;
    memcpy(&cap, b - BIG_HDR, sizeof(cap));
    /* Reuse a body up to 4x the size needed: more would hoard memory. */
    if (cap >= n && cap / 4 <= n)
      return b;
    free(b - BIG_HDR);
  }
  uint8_t *base = malloc(BIG_HDR + n);
  if (!base)
    return NULL;
  memcpy(base, &n, sizeof(n));
  return base + BIG_HDR;
}

static void big_free(uint8_t *b) {
  uint8_t *old = atomic_exchange(&spare, b);
  if (old)
    free(old - BIG_HDR);
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

int attnd_client_fail(attnd_client_t *c, int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->errmsg, sizeof(c->errmsg), fmt, ap);
  va_end(ap);
  return err;
}

void attnd_client_io_free(attnd_client_t *c) {
  free(c->rbuf);
  c->rbuf = NULL;
  c->rpos = c->rlen = 0;
  free(c->sbuf);
  free(c->piece);
  c->sbuf = NULL;
  c->piece = NULL;
  c->slen = c->scap = c->npiece = c->piececap = 0;
}

void attnd_client_io_tune(attnd_client_t *c) {
  /* Best effort: the kernel caps both at its net.core limits. */
  int v = SOCK_BUF;
  (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof(v));
  (void)setsockopt(c->fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof(v));
}

void attnd_client_phases(const attnd_client_t *c, attnd_client_phases_t *out) {
  *out = c->ph;
}

static int push_piece(attnd_client_t *c, const uint8_t *p, size_t off, size_t n) {
  if (c->npiece == c->piececap) {
    size_t cap = c->piececap ? c->piececap * 2 : 16;
    attnd_client_piece_t *np = realloc(c->piece, cap * sizeof(*np));
    if (!np)
      return -1;
    c->piece = np;
    c->piececap = cap;
  }
  c->piece[c->npiece++] = (attnd_client_piece_t){p, off, n};
  return 0;
}

/* Ends the open run of small bytes as one piece. */
static int close_small(attnd_client_t *c) {
  if (c->slen == c->open_off)
    return 0;
  int rc = push_piece(c, NULL, c->open_off, c->slen - c->open_off);
  c->open_off = c->slen;
  return rc;
}

static bool piece_write_cb(pb_ostream_t *s, const pb_byte_t *buf, size_t count) {
  attnd_client_t *c = s->state;
  if (count >= PIECE_MIN)
    return close_small(c) == 0 && push_piece(c, buf, 0, count) == 0;
  if (c->slen + count > c->scap) {
    size_t cap = c->scap ? c->scap : 4096;
    while (cap < c->slen + count)
      cap *= 2;
    uint8_t *nb = realloc(c->sbuf, cap);
    if (!nb)
      return false;
    c->sbuf = nb;
    c->scap = cap;
  }
  memcpy(c->sbuf + c->slen, buf, count);
  c->slen += count;
  return true;
}

/* writev of the pieces, resumed after short writes. */
static int write_pieces(attnd_client_t *c) {
  enum { BATCH = 64 };
  struct iovec iov[BATCH];
  size_t i = 0, done = 0; /* piece i, done bytes of it already written */
  while (i < c->npiece) {
    int n = 0;
    for (size_t j = i; j < c->npiece && n < BATCH; j++, n++) {
      const attnd_client_piece_t *pc = &c->piece[j];
      const uint8_t *base = pc->p ? pc->p : c->sbuf + pc->off;
      size_t skip = j == i ? done : 0;
      iov[n].iov_base = (void *)(base + skip);
      iov[n].iov_len = pc->n - skip;
    }
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    ssize_t w = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return attnd_client_fail(c, ATTND_CLIENT_EIO, "write to %s: %s", c->addr, strerror(errno));
    }
    size_t left = (size_t)w;
    while (left > 0 && i < c->npiece) {
      size_t rest = c->piece[i].n - done;
      if (left < rest) {
        done += left;
        left = 0;
      } else {
        left -= rest;
        i++;
        done = 0;
      }
    }
  }
  return 0;
}

int attnd_client_send(attnd_client_t *c, attnd_v1_Request *req, uint64_t *id) {
  if (!c || c->fd < 0 || !req)
    return ATTND_CLIENT_EINVAL;
  double t0 = now_us();
  if (req->id == 0)
    req->id = c->next_id++;
  size_t size = 0;
  if (!pb_get_encoded_size(&size, attnd_v1_Request_fields, req))
    return attnd_client_fail(c, ATTND_CLIENT_EINVAL, "cannot encode request");
  if (size == 0 || size >= ATTND_CLIENT_MAX_FRAME)
    return attnd_client_fail(c, ATTND_CLIENT_EINVAL, "request of %zu bytes does not fit a frame",
                             size);
  c->slen = c->open_off = c->npiece = 0;
  uint8_t hdr[4] = {(uint8_t)(size >> 24), (uint8_t)(size >> 16), (uint8_t)(size >> 8),
                    (uint8_t)size};
  pb_ostream_t os = {piece_write_cb, c, size + 4, 0, NULL};
  if (!pb_write(&os, hdr, 4) || !pb_encode(&os, attnd_v1_Request_fields, req) ||
      close_small(c) != 0 || os.bytes_written != size + 4)
    return attnd_client_fail(c, ATTND_CLIENT_EINVAL, "cannot encode request: %s",
                             PB_GET_ERROR(&os));
  double t1 = now_us();
  int rc = write_pieces(c);
  c->ph.encode_us = t1 - t0;
  c->ph.send_us = now_us() - t1;
  c->ph.sent_bytes = size + 4;
  if (c->scap > ((size_t)1 << 20) && c->slen < c->scap / 4) {
    /* Release what one odd request (a long token list) grew the buffer to. */
    free(c->sbuf);
    c->sbuf = NULL;
    c->scap = 0;
  }
  if (rc == 0 && id)
    *id = req->id;
  return rc;
}

void attnd_client_set_spin(attnd_client_t *c, int us) {
  c->spin_us = us < 0 ? 0 : us;
}

/* recv without sleeping for up to spin_us: bytes, 0 at EOF, or -1 with the
 * wait left to the blocking recv (nothing came, or an error it reports). */
static ssize_t spin_recv(attnd_client_t *c, uint8_t *p, size_t n) {
  double end = now_us() + c->spin_us;
  for (;;) {
    ssize_t r = recv(c->fd, p, n, MSG_DONTWAIT);
    if (r >= 0)
      return r;
    if ((errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) || now_us() >= end)
      return -1;
  }
}

/* Reads n bytes into p: first what was read ahead, then straight into p for
 * large reads, else through the read-ahead buffer (one recv takes whatever
 * the daemon has sent, up to READ_AHEAD bytes: a small response's body with
 * its header, or several pipelined answers). */
#define READ_AHEAD ((size_t)64 << 10)
static int read_all(attnd_client_t *c, uint8_t *p, size_t n) {
  while (n > 0) {
    if (c->rpos < c->rlen) {
      size_t k = c->rlen - c->rpos < n ? c->rlen - c->rpos : n;
      memcpy(p, c->rbuf + c->rpos, k);
      c->rpos += k;
      p += k;
      n -= k;
      continue;
    }
    if (!c->rbuf && !(c->rbuf = malloc(READ_AHEAD)))
      return attnd_client_fail(c, ATTND_CLIENT_ENOMEM, "out of memory");
    int direct = n >= READ_AHEAD;
    ssize_t r = c->spin_us > 0 ? spin_recv(c, direct ? p : c->rbuf, direct ? n : READ_AHEAD) : -1;
    if (r < 0 && c->timeout_ms > 0) {
      struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
      int pr = poll(&pfd, 1, c->timeout_ms);
      if (pr < 0 && errno == EINTR)
        continue;
      if (pr == 0)
        return attnd_client_fail(c, ATTND_CLIENT_ETIMEDOUT, "no answer from %s within %d ms",
                                 c->addr, c->timeout_ms);
    }
    if (r < 0)
      r = recv(c->fd, direct ? p : c->rbuf, direct ? n : READ_AHEAD, 0);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return attnd_client_fail(c, ATTND_CLIENT_EIO, "read from %s: %s", c->addr, strerror(errno));
    }
    if (r == 0)
      return attnd_client_fail(c, ATTND_CLIENT_EIO, "attnd at %s closed the connection", c->addr);
    if (direct) {
      p += r;
      n -= (size_t)r;
    } else {
      c->rpos = 0;
      c->rlen = (size_t)r;
    }
  }
  return 0;
}

static int read_frame(attnd_client_t *c, attnd_client_resp_t *resp) {
  uint8_t hdr[4];
  double t0 = now_us();
  int rc = read_all(c, hdr, 4);
  if (rc)
    return rc;
  double t1 = now_us();
  uint32_t n = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
  if (n == 0 || n >= ATTND_CLIENT_MAX_FRAME)
    return attnd_client_fail(c, ATTND_CLIENT_EPROTO, "bad frame length %u from %s", n, c->addr);
  memset(resp, 0, sizeof(*resp));
  resp->raw = n >= SPARE_MIN ? big_alloc(n) : malloc(n);
  if (!resp->raw)
    return attnd_client_fail(c, ATTND_CLIENT_ENOMEM, "out of memory for a %u byte frame", n);
  resp->rawlen = n;
  rc = read_all(c, resp->raw, n);
  if (rc) {
    attnd_client_resp_free(resp);
    return rc;
  }
  double t2 = now_us();
  pb_istream_t is = pb_istream_from_buffer(resp->raw, n);
  if (!pb_decode(&is, attnd_v1_Response_fields, &resp->msg)) {
    rc = attnd_client_fail(c, ATTND_CLIENT_EPROTO, "cannot parse a response from %s: %s", c->addr,
                           PB_GET_ERROR(&is));
    attnd_client_resp_free(resp);
    return rc;
  }
  c->ph.wait_us = t1 - t0;
  c->ph.read_us = t2 - t1;
  c->ph.decode_us = now_us() - t2;
  c->ph.recv_bytes = (uint64_t)n + 4;
  return 0;
}

static int finish(attnd_client_t *c, attnd_client_resp_t *resp) {
  if (resp->msg.epoch)
    c->epoch = resp->msg.epoch;
  c->status = 0;
  if (resp->msg.has_status && resp->msg.status.code != attnd_v1_Status_Code_OK) {
    c->status = (int)resp->msg.status.code;
    return attnd_client_fail(c, ATTND_CLIENT_ESTATUS, "%s: %s", attnd_client_status_name(c->status),
                             resp->msg.status.message);
  }
  return 0;
}

int attnd_client_recv(attnd_client_t *c, uint64_t id, attnd_client_resp_t *resp) {
  if (!c || c->fd < 0 || !resp)
    return ATTND_CLIENT_EINVAL;
  for (pending_t **pp = &c->pending; *pp; pp = &(*pp)->next) {
    if (id == 0 || (*pp)->resp.msg.id == id) {
      pending_t *p = *pp;
      *pp = p->next;
      *resp = p->resp;
      free(p);
      return finish(c, resp);
    }
  }
  for (;;) {
    int rc = read_frame(c, resp);
    if (rc)
      return rc;
    /* id 0 from the daemon is about the connection itself (bad frame, too
     * large): it answers whoever waits, so the error is seen. */
    if (id == 0 || resp->msg.id == id || resp->msg.id == 0)
      return finish(c, resp);
    pending_t *p = malloc(sizeof(*p));
    if (!p) {
      attnd_client_resp_free(resp);
      return attnd_client_fail(c, ATTND_CLIENT_ENOMEM, "out of memory");
    }
    p->resp = *resp;
    memset(resp, 0, sizeof(*resp));
    /* Append so that recv(0) returns responses in arrival order. */
    pending_t **tail = &c->pending;
    while (*tail)
      tail = &(*tail)->next;
    p->next = NULL;
    *tail = p;
  }
}

int attnd_client_call(attnd_client_t *c, attnd_v1_Request *req, attnd_client_resp_t *resp) {
  uint64_t id = 0;
  memset(resp, 0, sizeof(*resp));
  int rc = attnd_client_send(c, req, &id);
  if (rc)
    return rc;
  return attnd_client_recv(c, id, resp);
}

void attnd_client_resp_free(attnd_client_resp_t *resp) {
  if (!resp)
    return;
  if (resp->raw && resp->rawlen >= SPARE_MIN)
    big_free(resp->raw);
  else
    free(resp->raw);
  resp->raw = NULL;
  resp->rawlen = 0;
}

/* conn.c: one RPC connection (internal.h): frames read straight into their
 * own buffers and handed to the RPC layer, backpressure (--max-inflight),
 * fair turns between connections, responses written in one writev per read or
 * as pieces from the engine's buffers, and the connection's two-sided
 * lifetime (handle and requests).
 *
 * Ending: a connection stops reading for good when the client half-closed
 * (EOF), when a framing error or a Hello failure closes it, or when a limit
 * (Hello, frame deadline, idle) ends it; it is closed only once every call it
 * admitted has been answered and every answer written (docs/protocol.md §2). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static void flush_batch(attnd_conn_t *c);

/* ---- reading on and off ---- */

static void read_stop(attnd_conn_t *c) {
  if (c->reading)
    uv_read_stop(&c->h.stream);
  c->reading = 0;
}

static int conn_ending(const attnd_conn_t *c) {
  return c->eof || c->close_when_flushed || c->rc.ending;
}

/* Closes an ending connection once nothing it admitted is unanswered or
 * unwritten. */
static void maybe_close(attnd_conn_t *c) {
  if (!c->closing && conn_ending(c) && c->rc.pending == 0 && c->write_bytes == 0 && c->nbatch == 0)
    attnd_conn_close(c);
}

void attnd_conn_close_when_flushed(attnd_conn_t *c) {
  if (!c->close_when_flushed)
    c->ending_ms = uv_now(c->srv->loop);
  c->close_when_flushed = 1;
  read_stop(c);
  attnd_net_unqueue(c);
}

/* ---- lifetime ---- */

static void conn_maybe_free(attnd_conn_t *c) {
  if (!c->handle_closed || c->rc.pending > 0)
    return;
  attnd_server_t *s = c->srv;
  free(c);
  s->open--;
  attnd_net_check_done(s);
}

static void conn_close_cb(uv_handle_t *h) {
  attnd_conn_t *c = h->data;
  c->handle_closed = 1;
  attnd_frame_reader_free(&c->fr);
  conn_maybe_free(c);
}

void attnd_conn_close(attnd_conn_t *c) {
  if (c->closing)
    return;
  attnd_server_t *s = c->srv;
  c->closing = 1;
  flush_batch(c); /* frees what was never sent */
  read_stop(c);
  attnd_net_unqueue(c);
  /* A partial frame's bytes leave the daemon-wide budget now, not at the
   * handle's close callback. */
  attnd_frame_reader_abort(&c->fr);
  attnd_list_remove(&c->link);
  if (c->counted) {
    s->rpc.counters.connections--;
    s->st.connections--;
  }
  attnd_net_ident_drop(s, c);
  ATTND_LOGD("conn_closed", "conn=%llu pending=%u", (unsigned long long)c->rc.id, c->rc.pending);
  attnd_rpc_conn_closed(&c->rc);
  uv_close(&c->h.handle, conn_close_cb);
}

static void rc_released(attnd_rpc_conn_t *rc) {
  conn_maybe_free(ATTND_CONN_OF(rc));
}

static void rc_progress(attnd_rpc_conn_t *rc) {
  attnd_conn_t *c = ATTND_CONN_OF(rc);
  c->active_ms = uv_now(c->srv->loop);
  attnd_conn_flow(c);
}

static int rc_identity(attnd_rpc_conn_t *rc, uint64_t identity) {
  attnd_conn_t *c = ATTND_CONN_OF(rc);
  return attnd_net_ident_move(c->srv, c, identity);
}

/* ---- writing ---- */

typedef struct {
  uv_write_t req;
  attnd_conn_t *conn;
  size_t len; /* bytes in all buffers */
  unsigned n;
  void **owned;                /* sendv: what to free when written (NULL: every bufs[i].base) */
  unsigned char *owned_pinned; /* ... each with free() (0) or attnd_engine_host_free (1) */
  unsigned nowned;
  int kind1;       /* the step trace: a step response's kind + 1 is in it, else 0 */
  uint64_t t0_ns;  /* ... handed to libuv then */
  uv_buf_t bufs[]; /* owned: freed when written */
} wreq_t;

/* What a sendv piece held, freed the way it was allocated (rpc.h seg). */
static void free_owned(attnd_conn_t *c, void **owned, unsigned char *pinned, unsigned n) {
  for (unsigned i = 0; i < n; i++) {
    /* Plain pieces go back through the engine too: large ones are kept for reuse. */
    if (c->srv->engine)
      attnd_engine_host_free(c->srv->engine, owned[i], pinned[i]);
    else
      free(owned[i]);
  }
  free(owned);
  free(pinned);
}

static void wreq_free(wreq_t *w) {
  if (w->owned) {
    free_owned(w->conn, w->owned, w->owned_pinned, w->nowned);
  } else {
    for (unsigned i = 0; i < w->n; i++)
      free(w->bufs[i].base);
  }
  free(w);
}

static void write_cb(uv_write_t *req, int status) {
  wreq_t *w = (wreq_t *)req;
  attnd_conn_t *c = w->conn;
  c->write_bytes -= w->len;
  if (w->kind1)
    attnd_rpc_trace_write(&c->srv->rpc, w->kind1 - 1, (uv_hrtime() - w->t0_ns) / 1000);
  wreq_free(w);
  if (c->closing)
    return;
  if (status < 0) {
    /* The client is gone for writing too: nothing more can be answered. */
    attnd_conn_close(c);
    return;
  }
  c->active_ms = uv_now(c->srv->loop);
  attnd_conn_flow(c);
}

static void note_inflight(attnd_conn_t *c) {
  uint64_t inflight = c->rc.req_bytes + c->write_bytes;
  if (inflight > c->srv->st.peak_conn_inflight)
    c->srv->st.peak_conn_inflight = inflight;
}

/* owned: NULL when every bufs[i].base is its own allocation, else the list
 * (taken over) of what to free once written. */
static void submit(attnd_conn_t *c, const uv_buf_t *bufs, unsigned n, size_t len, void **owned,
                   unsigned char *owned_pinned, unsigned nowned, int kind1) {
  wreq_t *w = malloc(sizeof(*w) + n * sizeof(uv_buf_t));
  if (!w)
    abort();
  w->conn = c;
  w->len = len;
  w->n = n;
  w->owned = owned;
  w->owned_pinned = owned_pinned;
  w->nowned = nowned;
  w->kind1 = c->srv->rpc.trace ? kind1 : 0;
  w->t0_ns = w->kind1 ? uv_hrtime() : 0;
  memcpy(w->bufs, bufs, n * sizeof(uv_buf_t));
  if (uv_write(&w->req, &c->h.stream, w->bufs, n, write_cb) != 0) {
    c->write_bytes -= len;
    wreq_free(w);
    attnd_conn_close(c);
  }
}

/* Sends the responses batched during a read (or drops them once closing). */
static void flush_batch(attnd_conn_t *c) {
  unsigned n = c->nbatch;
  size_t len = c->batch_len;
  int kind1 = c->batch_kind1;
  if (n == 0)
    return;
  c->nbatch = 0;
  c->batch_len = 0;
  c->batch_kind1 = 0;
  if (c->closing) {
    c->write_bytes -= len;
    for (unsigned i = 0; i < n; i++)
      free(c->batch[i].base);
    return;
  }
  submit(c, c->batch, n, len, NULL, NULL, 0, kind1);
}

/* A small response answered outside a read, on a connection with nothing
 * else to write and no state its write callback would move on: written now
 * with uv_try_write. 1 when the socket took all of it (the caller frees buf):
 * no write request, no callback a loop turn later, no epoll change. A
 * partial write queues the rest as a copy. 0: nothing written, the caller
 * queues it. */
#define TRY_WRITE_MAX ((size_t)64 << 10)
static int write_now(attnd_conn_t *c, const uint8_t *buf, size_t len, int kind1) {
  if (len > TRY_WRITE_MAX || c->in_feed || c->bp_paused || conn_ending(c) ||
      uv_stream_get_write_queue_size(&c->h.stream) > 0)
    return 0;
  uint64_t t0 = c->srv->rpc.trace && kind1 ? uv_hrtime() : 0;
  uv_buf_t ub = uv_buf_init((char *)buf, (unsigned)len);
  int r = uv_try_write(&c->h.stream, &ub, 1);
  if (r <= 0)
    return 0;
  if ((size_t)r < len) {
    uint8_t *rest = malloc(len - (size_t)r);
    if (!rest)
      abort();
    memcpy(rest, buf + r, len - (size_t)r);
    c->write_bytes += len - (size_t)r;
    uv_buf_t rb = uv_buf_init((char *)rest, (unsigned)(len - (size_t)r));
    submit(c, &rb, 1, len - (size_t)r, NULL, NULL, 0, kind1);
    return 1;
  }
  if (t0)
    attnd_rpc_trace_write(&c->srv->rpc, kind1 - 1, (uv_hrtime() - t0) / 1000);
  c->active_ms = uv_now(c->srv->loop);
  return 1;
}

static void rc_send(attnd_rpc_conn_t *rc, uint8_t *buf, size_t len, int close_after) {
  attnd_conn_t *c = ATTND_CONN_OF(rc);
  attnd_net_busy_touch(c->srv);
  if (c->closing) {
    free(buf);
    return;
  }
  if (!close_after && write_now(c, buf, len, rc->send_kind1)) {
    free(buf);
    return;
  }
  uv_buf_t ub = uv_buf_init((char *)buf, (unsigned)len);
  c->write_bytes += len;
  note_inflight(c);
  if (close_after)
    attnd_conn_close_when_flushed(c);
  if (c->in_feed) {
    c->batch[c->nbatch++] = ub;
    c->batch_len += len;
    if (rc->send_kind1)
      c->batch_kind1 = rc->send_kind1;
    if (c->nbatch == WRITE_BATCH)
      flush_batch(c);
    return;
  }
  submit(c, &ub, 1, len, NULL, NULL, 0, rc->send_kind1);
}

/* A response in pieces (rpc.h): written after everything queued before it,
 * in one uv_write; the pieces' free_p are freed once it is written. */
static void rc_sendv(attnd_rpc_conn_t *rc, const attnd_rpc_seg_t *segs, int n, int close_after) {
  attnd_conn_t *c = ATTND_CONN_OF(rc);
  attnd_net_busy_touch(c->srv);
  void **owned = malloc((size_t)n * sizeof(void *));
  unsigned char *owned_pinned = malloc((size_t)n);
  uv_buf_t *bufs = malloc((size_t)n * sizeof(uv_buf_t));
  if (!owned || !owned_pinned || !bufs)
    abort();
  unsigned nowned = 0;
  size_t len = 0;
  for (int i = 0; i < n; i++) {
    if (segs[i].free_p) {
      owned_pinned[nowned] = segs[i].pinned != 0;
      owned[nowned++] = segs[i].free_p;
    }
    /* uv_buf_t lengths are unsigned int; frames are < 2^32 and a tensor is
     * one piece of one frame. */
    bufs[i] = uv_buf_init((char *)segs[i].p, (unsigned)segs[i].n);
    len += segs[i].n;
  }
  if (c->closing) {
    free_owned(c, owned, owned_pinned, nowned);
    free(bufs);
    return;
  }
  c->write_bytes += len;
  note_inflight(c);
  if (close_after)
    attnd_conn_close_when_flushed(c);
  flush_batch(c); /* keep the order of responses already batched */
  submit(c, bufs, (unsigned)n, len, owned, owned_pinned, nowned, rc->send_kind1);
  free(bufs);
}

/* ---- reading ---- */

static int frame_cb(void *arg, uint8_t *frame, size_t len) {
  attnd_conn_t *c = arg;
  if (c->closing || conn_ending(c)) {
    attnd_engine_host_free(c->srv->engine, frame, c->fr.last_tag);
    return -1;
  }
  c->rc.frame_t0_ns = c->fr.t0_ns;
  c->rc.frame_pinned = c->fr.last_tag;
  attnd_rpc_handle_frame(&c->rc, frame, len);
  c->rc.frame_t0_ns = 0;
  c->rc.frame_pinned = 0;
  note_inflight(c);
  if (c->closing || conn_ending(c))
    return -1;
  c->turn_frames++;
  if (c->rc.req_bytes + c->write_bytes > c->srv->cfg->max_inflight ||
      c->turn_frames >= FRAMES_PER_TURN)
    return ATTND_FRAME_PAUSE;
  return 0;
}

/* A frame whose header arrived starts its deadline (--frame-deadline). */
static void note_frame_start(attnd_conn_t *c) {
  if (attnd_frame_reader_partial(&c->fr) && c->frame_seq != c->fr.nstarted) {
    c->frame_seq = c->fr.nstarted;
    c->frame_t0_ms = uv_now(c->srv->loop);
  }
}

/* Acts on what the frame reader returned. */
static void feed_result(attnd_conn_t *c, int rc) {
  note_frame_start(c);
  if (rc >= 0 || c->closing || conn_ending(c))
    return;
  attnd_server_t *s = c->srv;
  char msg[160];
  if (rc == ATTND_ENOSPC) {
    snprintf(msg, sizeof(msg), "frame of %llu bytes exceeds --max-frame %llu",
             (unsigned long long)c->fr.bad_len, (unsigned long long)s->cfg->max_frame);
    ATTND_LOGI("bad_frame", "conn=%llu reason=too_large len=%llu", (unsigned long long)c->rc.id,
               (unsigned long long)c->fr.bad_len);
    read_stop(c);
    attnd_rpc_frame_error(&c->rc, ATTND_ENOSPC, msg);
  } else if (rc == ATTND_EUNAUTH) {
    snprintf(msg, sizeof(msg), "frame of %llu bytes before Hello{token}",
             (unsigned long long)c->fr.bad_len);
    ATTND_LOGI("bad_frame", "conn=%llu reason=large_before_hello len=%llu",
               (unsigned long long)c->rc.id, (unsigned long long)c->fr.bad_len);
    read_stop(c);
    attnd_rpc_frame_error(&c->rc, ATTND_EUNAUTH, msg);
  } else if (rc == ATTND_EINVAL) {
    ATTND_LOGI("bad_frame", "conn=%llu reason=zero_length", (unsigned long long)c->rc.id);
    read_stop(c);
    attnd_rpc_frame_error(&c->rc, ATTND_EINVAL, "zero-length frame");
  } else {
    ATTND_LOGW("conn_error", "conn=%llu err=\"%s\"", (unsigned long long)c->rc.id,
               attnd_strerror(rc));
    attnd_conn_close(c);
  }
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  attnd_conn_t *c = h->data;
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
  attnd_conn_t *c = st->data;
  attnd_net_busy_touch(c->srv);
  if (nread == UV_EOF) {
    /* A half-close: the client sends nothing more but may still read. Every
     * call it sent is answered, then the connection closes. */
    if (attnd_frame_reader_partial(&c->fr))
      ATTND_LOGI("conn_eof_mid_frame", "conn=%llu", (unsigned long long)c->rc.id);
    attnd_frame_reader_abort(&c->fr);
    if (!c->eof)
      c->ending_ms = uv_now(c->srv->loop);
    c->eof = 1;
    read_stop(c);
    attnd_net_unqueue(c);
    maybe_close(c);
    return;
  }
  if (nread < 0) {
    ATTND_LOGD("conn_read_error", "conn=%llu err=%s", (unsigned long long)c->rc.id,
               uv_err_name((int)nread));
    attnd_conn_close(c);
    return;
  }
  if (nread == 0 || c->closing)
    return;
  c->active_ms = uv_now(c->srv->loop);
  c->in_feed = 1;
  int rc = attnd_frame_reader_feed(&c->fr, (const uint8_t *)buf->base, (size_t)nread, frame_cb, c);
  c->in_feed = 0;
  flush_batch(c); /* before any framing error, to keep responses in order */
  feed_result(c, rc);
  attnd_conn_flow(c);
}

/* Decides whether the connection reads: not above --max-inflight
 * (backpressure), not while its body waits for the partial-frame budget, not
 * past its turn (FRAMES_PER_TURN frames, then the other connections go
 * first), never once ending. Bytes a pause left unparsed are parsed first. */
void attnd_conn_flow(attnd_conn_t *c) {
  attnd_server_t *s = c->srv;
  if (c->closing || c->in_feed)
    return;
  if (conn_ending(c)) {
    read_stop(c);
    maybe_close(c);
    return;
  }
  if (c->queued) {
    read_stop(c); /* its queue resumes it */
    return;
  }
  for (;;) {
    uint64_t inflight = c->rc.req_bytes + c->write_bytes;
    if (inflight > s->cfg->max_inflight) {
      read_stop(c);
      if (!c->bp_paused) {
        c->bp_paused = 1;
        s->st.reads_paused++;
        ATTND_LOGD("conn_paused", "conn=%llu inflight=%llu", (unsigned long long)c->rc.id,
                   (unsigned long long)inflight);
      }
      return;
    }
    c->bp_paused = 0;
    if (c->turn_frames >= FRAMES_PER_TURN) {
      read_stop(c);
      attnd_net_turn_defer(c);
      return;
    }
    if (attnd_frame_reader_paused(&c->fr)) {
      c->in_feed = 1;
      int rc = attnd_frame_reader_resume(&c->fr, frame_cb, c);
      c->in_feed = 0;
      flush_batch(c);
      feed_result(c, rc);
      if (c->closing || conn_ending(c)) {
        read_stop(c);
        maybe_close(c);
        return;
      }
      if (c->queued) { /* the body waits for the partial-frame budget */
        read_stop(c);
        return;
      }
      continue; /* re-check the bounds after the kept frames */
    }
    if (!c->reading && !s->finishing) {
      if (uv_read_start(&c->h.stream, alloc_cb, read_cb) != 0) {
        attnd_conn_close(c);
        return;
      }
      c->reading = 1;
    }
    return;
  }
}

/* ---- a new connection ---- */

static int fr_admit(void *arg, size_t len) {
  attnd_conn_t *c = arg;
  return attnd_net_budget_admit(c->srv, c, len);
}

static void fr_release(void *arg, size_t len) {
  attnd_conn_t *c = arg;
  attnd_net_budget_release(c->srv, len);
}

/* Frame bodies are the engine's frame memory (pinned for large frames on
 * the CUDA backend: the step's inputs reach the device from there). */
static void *fr_body_alloc(void *arg, size_t len, int *tag) {
  attnd_conn_t *c = arg;
  return attnd_engine_host_alloc(c->srv->engine, len, tag);
}

static void fr_body_free(void *arg, void *p, int tag) {
  attnd_conn_t *c = arg;
  attnd_engine_host_free(c->srv->engine, p, tag);
}

attnd_conn_t *attnd_conn_new(attnd_server_t *s, int is_tcp) {
  attnd_conn_t *c = calloc(1, sizeof(*c));
  if (!c)
    abort();
  c->srv = s;
  if (is_tcp)
    uv_tcp_init(s->loop, &c->h.tcp);
  else
    uv_pipe_init(s->loop, &c->h.pipe, 0);
  c->h.handle.data = c;
  attnd_list_init(&c->link);
  attnd_list_init(&c->qlink);
  c->accepted_ms = c->active_ms = uv_now(s->loop);
  attnd_frame_reader_init(&c->fr, s->cfg->max_frame);
  attnd_frame_reader_hooks(&c->fr, fr_admit, fr_release, c);
  if (s->engine)
    attnd_frame_reader_body_hooks(&c->fr, fr_body_alloc, fr_body_free);
  s->open++;
  attnd_list_insert_head(&s->conns, &c->link);
  return c;
}

void attnd_conn_start(attnd_server_t *s, attnd_conn_t *c, uint64_t identity, int need_hello,
                      const char *peer) {
  attnd_rpc_conn_init(&c->rc, &s->rpc, identity, need_hello);
  c->rc.send = rc_send;
  c->rc.sendv = rc_sendv;
  c->rc.progress = rc_progress;
  c->rc.released = rc_released;
  c->rc.identity_cb = rc_identity;
  if (s->rpc.counters.connections >= (uint32_t)s->cfg->max_connections) {
    s->rpc.counters.connections_refused++;
    ATTND_LOGW("conn_refused", "peer=%s reason=max_connections limit=%d", peer,
               s->cfg->max_connections);
    attnd_rpc_conn_end(&c->rc, ATTND_ENOSPC, "too many connections (--max-connections)");
    return;
  }
  /* Until a Hello names it, an off-loopback connection has no identity to
   * count (the Hello deadline bounds how long it can hold a slot). */
  if (!need_hello && attnd_net_ident_move(s, c, identity) != 0) {
    s->rpc.counters.connections_refused++;
    ATTND_LOGW("conn_refused", "peer=%s reason=max_connections_per_identity limit=%d", peer,
               s->cfg->max_conns_per_identity);
    attnd_rpc_conn_end(&c->rc, ATTND_ENOSPC,
                       "too many connections of this identity (--max-connections-per-identity)");
    return;
  }
  c->counted = 1;
  s->rpc.counters.connections++;
  s->rpc.counters.connections_total++;
  s->st.connections++;
  ATTND_LOGD("conn_open", "conn=%llu peer=%s need_hello=%d", (unsigned long long)c->rc.id, peer,
             need_hello);
  if (uv_read_start(&c->h.stream, alloc_cb, read_cb) != 0) {
    attnd_conn_close(c);
    return;
  }
  c->reading = 1;
}

/* net.h: the daemon's sockets (docs/protocol.md, docs/operations.md): the
 * frame reader, the RPC listeners and connections, the drain, and the small
 * HTTP server for Prometheus /metrics. A frame read from a connection goes to
 * the RPC layer (rpc.h); its answer comes back through the connection's send
 * functions.
 *
 * The RPC listeners: a Unix socket (mode 0660, in a directory created private
 * when missing; a stale socket file is removed; the peer's uid is the
 * identity) and a TCP listener (default 127.0.0.1:7411; port 0 picks a free
 * port). Off loopback a TCP connection must send Hello{token} first; loopback
 * clients that send none share one anonymous identity.
 *
 * Each connection reads frames and hands them to the RPC layer; requests may
 * be pipelined and answered out of order. Backpressure: a connection stops
 * reading while its request bytes in flight plus its response bytes not yet
 * written exceed --max-inflight, and resumes when they drain.
 *
 * Drain (SIGTERM): stop accepting, answer new calls UNAVAILABLE, let in-flight
 * requests finish and their responses be written, then close every handle. */
#ifndef ATTND_NET_H
#define ATTND_NET_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "engine.h"
#include "rpc.h"

/* ---- the frame reader (frame.c) ----------------------------------------------
 *
 * A frame is a 4-byte big-endian length N (0 < N <= max frame) followed by N
 * bytes (the header is written by attnd_rpc_frame_header). The reader is
 * incremental, a pure codec without libuv: bytes may arrive split anywhere
 * and several frames may arrive in one read.
 *
 * Zero copy for large frames: before each read, ask attnd_frame_reader_buf()
 * where to read to. While a frame body is in progress it returns the rest of
 * that frame's own buffer, so the bulk of a large frame (tensor bytes) lands in
 * its final place; otherwise it returns a small scratch buffer from which
 * headers (and small frames) are parsed. Each complete frame is handed to the
 * callback in a malloc'ed buffer that the callback then owns (free()). */
#define ATTND_FRAME_SCRATCH (64 * 1024)

/* Takes ownership of frame (malloc'ed, len bytes). Return 0 to continue,
 * ATTND_FRAME_PAUSE to stop after this frame while keeping the bytes not yet
 * parsed (backpressure: attnd_frame_reader_resume() parses them later), or a
 * negative value to stop for good (the rest of the bytes is dropped). */
#define ATTND_FRAME_PAUSE 1
typedef int (*attnd_frame_cb)(void *arg, uint8_t *frame, size_t len);

/* Optional hooks around a frame body's buffer, for a budget shared by many
 * readers (the daemon-wide budget of partly received frames): admit is asked
 * before a body of len bytes is allocated and returns 0 (go on),
 * ATTND_FRAME_PAUSE (not now: the reader keeps the header and the bytes after
 * it, as for a pause, and asks again at the next resume) or a negative
 * ATTND_E* (never: the reader fails with it, bad_len set); release is told when
 * that body leaves the reader, complete (handed to the frame callback) or not
 * (freed). */
typedef int (*attnd_frame_admit_cb)(void *arg, size_t len);
typedef void (*attnd_frame_release_cb)(void *arg, size_t len);

typedef struct {
  uint64_t max_frame;
  uint8_t hdr[4];
  size_t hdr_got;
  size_t want;   /* the parsed length while the body waits for admission */
  uint8_t *body; /* frame in progress, NULL between frames */
  size_t body_len;
  size_t body_got;
  uint8_t *scratch;  /* ATTND_FRAME_SCRATCH bytes, allocated lazily */
  int err;           /* sticky: ATTND_EINVAL (N == 0), ATTND_ENOSPC (N > max) */
  uint64_t bad_len;  /* the rejected length, for the log */
  uint8_t *pend;     /* bytes received but not parsed because of a pause */
  size_t pend_len;   /* bytes in pend */
  size_t pend_off;   /* the first of them not parsed yet */
  uint64_t nstarted; /* frames whose first header byte arrived, ever */
  uint64_t t0_ns;    /* uv_hrtime() when the latest of them began (the step trace) */
  attnd_frame_admit_cb admit;
  attnd_frame_release_cb release;
  void *hook_arg;
  /* Optional: where a frame body lives (NULL: malloc/free). alloc sets a tag
   * that goes with the buffer (kept in body_tag, then in last_tag for the
   * frame callback) and back to free. */
  void *(*body_alloc)(void *arg, size_t len, int *tag);
  void (*body_free)(void *arg, void *p, int tag);
  int body_tag;
  int last_tag; /* the tag of the frame handed to the callback last */
} attnd_frame_reader_t;

void attnd_frame_reader_init(attnd_frame_reader_t *r, uint64_t max_frame);
/* Sets the budget hooks (NULL: every body is admitted). */
void attnd_frame_reader_hooks(attnd_frame_reader_t *r, attnd_frame_admit_cb admit,
                              attnd_frame_release_cb release, void *arg);
/* Sets where frame bodies are allocated (the daemon: the engine's frame
 * memory, pinned for large frames on the CUDA backend). */
void attnd_frame_reader_body_hooks(attnd_frame_reader_t *r,
                                   void *(*body_alloc)(void *arg, size_t len, int *tag),
                                   void (*body_free)(void *arg, void *p, int tag));

/* Frees everything, a partial body included (released through the hook). */
void attnd_frame_reader_free(attnd_frame_reader_t *r);
/* Drops a partly received frame now (its body is released) and accepts
 * nothing more: for a connection that is being closed. */
void attnd_frame_reader_abort(attnd_frame_reader_t *r);

/* Where the next read should go: the rest of the frame in progress, or scratch.
 * Returns ATTND_ENOMEM if a buffer cannot be allocated. */
int attnd_frame_reader_buf(attnd_frame_reader_t *r, uint8_t **base, size_t *len);

/* Consumes n bytes at data. data may be the buffer returned by
 * attnd_frame_reader_buf (no copy for a frame body) or any other memory.
 * Returns 0, ATTND_FRAME_PAUSE when a callback paused (the unparsed rest is
 * kept), the first negative value a callback returned, or the reader's error:
 * ATTND_EINVAL for a zero-length frame, ATTND_ENOSPC for one over the limit,
 * ATTND_ENOMEM when a frame buffer cannot be allocated. After an error the
 * reader accepts nothing more. Must not be called while paused bytes are kept. */
int attnd_frame_reader_feed(attnd_frame_reader_t *r, const uint8_t *data, size_t n,
                            attnd_frame_cb cb, void *arg);

/* Parses the bytes kept by a pause (and asks admission again for a body
 * that waits for it); returns as attnd_frame_reader_feed. */
int attnd_frame_reader_resume(attnd_frame_reader_t *r, attnd_frame_cb cb, void *arg);
/* 1 while bytes kept by a pause, or a body not admitted yet, wait for
 * attnd_frame_reader_resume() (read nothing more before it). */
int attnd_frame_reader_paused(const attnd_frame_reader_t *r);

/* 1 while a frame is partly received (a header byte or more). */
int attnd_frame_reader_partial(const attnd_frame_reader_t *r);

/* ---- the RPC server (server.c, listen.c, conn.c, drain.c) ---------------------- */

typedef struct attnd_server_s attnd_server_t;

typedef struct {
  uint32_t connections;
  uint64_t peak_conn_inflight; /* largest in-flight bytes seen on one connection */
  uint64_t reads_paused;       /* times a connection stopped reading for backpressure */
  uint64_t turns_deferred;     /* times a connection gave way after FRAMES_PER_TURN frames */
  uint64_t partial_bytes;      /* now: bytes of partly received frames (all connections) */
  uint64_t partial_budget;     /* --max-partial-bytes in force */
  uint64_t peak_partial_bytes; /* the most partial_bytes ever was */
  uint64_t budget_waits;       /* times a frame body waited for the budget */
  uint64_t frame_timeouts;     /* connections closed past --frame-deadline */
  uint64_t idle_closed;        /* connections closed past --idle-timeout */
  uint64_t hello_timeouts;     /* connections closed past --hello-timeout */
} attnd_server_stats_t;

/* Binds the listeners named by cfg (which must outlive the server). On error
 * returns a negative ATTND_E* with a one-line reason in err; nothing is left
 * open then except handles whose close is pending on the loop. */
int attnd_server_start(attnd_server_t **out, uv_loop_t *loop, const attnd_config_t *cfg,
                       attnd_engine_t *engine, char *err, size_t errlen);

/* The rpc state (counters, epoch) shared with metrics. */
attnd_rpc_t *attnd_server_rpc(attnd_server_t *s);
int attnd_server_tcp_port(const attnd_server_t *s);
void attnd_server_stats(const attnd_server_t *s, attnd_server_stats_t *st);

/* Drains and closes everything; cb runs once every handle has closed, after
 * which the server is freed. The engine is not closed here. Calling it twice is
 * harmless (the second cb is ignored). */
void attnd_server_drain(attnd_server_t *s, void (*cb)(void *arg), void *arg);

/* ---- the HTTP endpoint: Prometheus /metrics and the probes (metrics.c, http.c) ----
 *
 * GET (or HEAD) /metrics serves the text exposition format 0.0.4 of the
 * request counters (rpc.h), the engine's stats and the process's own
 * numbers; /healthz answers 200 while the loop runs (liveness); /readyz 200
 * once the daemon serves and 503 while it starts or drains (readiness);
 * anything else is a 404. Metric names are listed at the top of
 * net/metrics.c. The server never blocks the loop: every connection is read
 * and written asynchronously, has a deadline, and the number open is capped
 * (the oldest idle one makes room for a new one), so idle or slow clients
 * cannot keep a scraper or a probe out. */

/* What one exposition is made of. */
typedef struct {
  const attnd_rpc_counters_t *counters;
  attnd_engine_t *engine; /* NULL: no engine numbers */
  double uptime_s;
  double start_time_s; /* Unix time the process started, 0: read /proc */
  /* attnd_build_info's labels (version is ATTND_VERSION). */
  const char *backend, *device, *kv_cache;
} attnd_metrics_src_t;

/* Writes the whole exposition into a malloc'ed string (*out, *len). */
int attnd_metrics_render(const attnd_metrics_src_t *src, char **out, size_t *len);

typedef struct attnd_metrics_s attnd_metrics_t;

/* Connections at most, and how long each may take: to send its request
 * (from accept), and to take its answer (from the answer). */
#define ATTND_HTTP_MAX_CONNS 64
#define ATTND_HTTP_REQUEST_MS 5000
#define ATTND_HTTP_WRITE_MS 10000
/* Request bytes (line, headers, any body) read from one connection at most. */
#define ATTND_HTTP_MAX_REQUEST 16384

/* Listens on HOST:PORT (port 0 picks one) and serves the paths above.
 * start_ns is the daemon's start (uv_hrtime) for the uptime gauge. /readyz
 * answers 503 until attnd_metrics_set_ready(m, 1). */
int attnd_metrics_start(attnd_metrics_t **out, uv_loop_t *loop, const char *hostport,
                        const attnd_rpc_counters_t *c, attnd_engine_t *engine, uint64_t start_ns,
                        char *err, size_t errlen);
int attnd_metrics_port(const attnd_metrics_t *m);
/* Readiness: 1 once the daemon serves (READY=1); 0 again when a drain starts
 * (then /readyz says "draining", before it "starting"). */
void attnd_metrics_set_ready(attnd_metrics_t *m, int ready);
/* The backend, device and KV cache type attnd_build_info reports. */
void attnd_metrics_set_build_info(attnd_metrics_t *m, const char *backend, const char *device,
                                  const char *kv_cache);
/* Closes the listener and open HTTP connections; the struct is freed once
 * every handle has closed (cb, if not NULL, runs then). */
void attnd_metrics_close(attnd_metrics_t *m, void (*cb)(void *arg), void *arg);

#endif /* ATTND_NET_H */

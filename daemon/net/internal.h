/* internal.h: the transport's private declarations, seen only by net/'s own
 * files, in the order a request meets them:
 *
 *   sock.c     the one TCP socket helper (HOST:PORT -> a bound listener)
 *   listen.c   the Unix and TCP listeners, accepting, identities, Hello deadline
 *   conn.c     a connection: reading frames, backpressure, writing (writev)
 *   limits.c   what bounds connections: fair turns, the partial-frame budget,
 *              connections per identity, and the sweep of the Hello deadline,
 *              the frame deadline and the idle timeout
 *   frame.c    the frame reader
 *   drain.c    the drain: stop accepting, answer what is in flight, close
 *   server.c   the server as a whole (start, stats)
 *   http.c     the HTTP server behind /metrics
 *   metrics.c  the Prometheus exposition
 *
 * Ownership: a connection (attnd_conn_t) is freed only when both its libuv
 * handle has closed and no request holds it any more (the RPC layer counts
 * them); the server is freed only when every connection and listener is
 * gone. Responses to a connection that closed meanwhile are dropped by the
 * RPC layer. */
#ifndef ATTND_NET_INTERNAL_H
#define ATTND_NET_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "base.h"
#include "config.h"
#include "engine.h"
#include "net.h"
#include "rpc.h"

/* How long a drain waits for responses to be written to clients that do not
 * read before it closes their connections anyway. */
#define DRAIN_FLUSH_TIMEOUT_MS 5000
/* Once the last in-flight request is answered, connections stay readable this
 * long before they close: requests a client sent just before the signal may
 * still sit in the socket buffer, and they get an UNAVAILABLE answer
 * ("draining") instead of a silent close. */
#define DRAIN_READ_GRACE_MS 20

/* Responses produced while one read's frames are handled go out in one
 * writev (pipelined small calls would otherwise cost a syscall each). */
#define WRITE_BATCH 64

/* A connection handles at most this many frames in a row; then it waits for
 * the next loop iteration, after every other connection that has something to
 * do, so a deep pipeline of tiny calls cannot keep the loop from others. */
#define FRAMES_PER_TURN 64

/* Frames this small are admitted past the partial-frame budget (limits.c);
 * the largest frame a connection may start before its Hello. */
#define SMALL_FRAME ATTND_FRAME_SCRATCH

/* The auto --max-partial-bytes: a quarter of the host's memory, within
 * [--max-frame, PARTIAL_AUTO_MAX]. */
#define PARTIAL_AUTO_MAX (2ull << 30)

/* Where a connection waits (attnd_conn_t.queued). */
enum { CONN_Q_NONE = 0, CONN_Q_TURN = 1, CONN_Q_BUDGET = 2 };

typedef struct attnd_conn_s attnd_conn_t;

struct attnd_conn_s {
  union {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } h;
  attnd_server_t *srv;
  attnd_rpc_conn_t rc;
  attnd_frame_reader_t fr;
  attnd_list_t link;    /* the server's connections */
  uint64_t write_bytes; /* response bytes queued, not yet written */
  int reading;
  int closing;
  int handle_closed;
  int in_feed;            /* inside the frame reader: no re-entry */
  int bp_paused;          /* stopped by backpressure (counted once per pause) */
  int close_when_flushed; /* an answer asked to close: no more reading, close
                           * once every call is answered and written */
  int eof;                /* the client half-closed: the same */
  uint64_t ending_ms;     /* when it started ending (for clients that do not read) */
  int counted;            /* counts against --max-connections */
  uint64_t accepted_ms;   /* uv_now() at accept, for the Hello deadline */
  uint64_t active_ms;     /* last byte read or written, or call answered (--idle-timeout) */
  uint64_t idle_check_ms; /* the identity's sessions are asked again from then */
  uint64_t frame_seq;     /* the reader's nstarted when frame_t0_ms was taken */
  uint64_t frame_t0_ms;   /* the partial frame's header arrived (--frame-deadline) */
  /* The turn and budget queues (limits.c). */
  attnd_list_t qlink;
  int queued;           /* CONN_Q_* */
  unsigned turn_frames; /* frames handled since its last turn began */
  size_t budget_want;   /* CONN_Q_BUDGET: the body it waits to allocate */
  size_t budget_grant;  /* bytes reserved for it when it left the budget queue */
  /* Connections per identity (limits.c). */
  uint64_t ident;
  int ident_counted;
  uv_buf_t batch[WRITE_BATCH]; /* responses waiting for the end of the read */
  unsigned nbatch;
  size_t batch_len;
  int batch_kind1; /* the step trace: a step response's kind + 1 is in the batch */
};

#define ATTND_CONN_OF(rcp) ((attnd_conn_t *)((char *)(rcp)-offsetof(attnd_conn_t, rc)))

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
  attnd_list_t conns;
  int open; /* listeners + connections not yet freed */
  int draining, finishing, done;
  int sndbuf_logged; /* the socket_buffer line (listen.c) is logged once */
  uv_timer_t drain_timer;
  /* Ends connections past the Hello deadline, the frame deadline or the idle
   * timeout (limits.c). */
  uv_timer_t sweep_timer;
  int has_sweep;
  /* Connections waiting for their next turn, run from an idle handle (so
   * the loop polls every socket before it); and connections whose next body
   * waits for the partial-frame budget, in arrival order. */
  uv_idle_t turn_idle;
  int has_turn_idle, turn_active;
  /* --busy-poll-us: an idle handle active until busy_until_ns keeps the loop
   * polling (timeout 0) instead of sleeping (limits.c). */
  uv_idle_t busy_idle;
  int has_busy_idle, busy_active;
  uint64_t busy_until_ns;
  attnd_list_t turn_q, budget_q;
  uint64_t partial_used, partial_max; /* bytes of partly received frames, and the budget */
  attnd_idmap_t ident_conns; /* identity -> open connections (--max-connections-per-identity) */
  void (*drain_cb)(void *arg);
  void *drain_arg;
  attnd_server_stats_t st;
};

/* ---- sock.c ---- */

/* Initializes *tcp on loop and makes it listen on hostport ("HOST:PORT",
 * "[V6]:PORT", "localhost:PORT"; port 0 picks one, written to *port). flag
 * names the option in messages ("--listen", "--metrics"). On error returns a
 * negative ATTND_E* with a reason in err; the handle, if it was initialized,
 * must still be closed (*inited says so). */
int attnd_net_tcp_listen(uv_loop_t *loop, uv_tcp_t *tcp, const char *hostport, const char *flag,
                         int backlog, uv_connection_cb cb, int *inited, int *port, char *host,
                         size_t hostlen, char *err, size_t errlen);

/* --busy-poll-us: RPC activity now (a frame read, an answer written); the
 * loop keeps polling for that long after the last one. O(1); no-op when off. */
void attnd_net_busy_touch(attnd_server_t *s);

/* ---- listen.c ---- */

int attnd_net_start_unix(attnd_server_t *s, char *err, size_t errlen);
int attnd_net_start_tcp(attnd_server_t *s, char *err, size_t errlen);
void attnd_net_close_listeners(attnd_server_t *s);

/* ---- conn.c ---- */

attnd_conn_t *attnd_conn_new(attnd_server_t *s, int is_tcp);
/* Reads, pauses or closes as the connection's state says (backpressure,
 * turns, the budget, ending). */
void attnd_conn_flow(attnd_conn_t *c);
/* Accepted, identity known: either start serving or refuse politely. */
void attnd_conn_start(attnd_server_t *s, attnd_conn_t *c, uint64_t identity, int need_hello,
                      const char *peer);
void attnd_conn_close(attnd_conn_t *c);
/* Stops reading and closes once every queued response is written. */
void attnd_conn_close_when_flushed(attnd_conn_t *c);

/* ---- limits.c ---- */

/* Sets up the turn queue, the budget and the sweep timer. */
int attnd_net_limits_start(attnd_server_t *s, char *err, size_t errlen);
/* Closes the sweep timer (at the start of a drain) and, with all too, the
 * turn handle (once no connection reads any more), resuming whatever waited. */
void attnd_net_limits_close(attnd_server_t *s, int all);
void attnd_net_limits_free(attnd_server_t *s);
/* The connection ran out of its turn: it continues in the next iteration. */
void attnd_net_turn_defer(attnd_conn_t *c);
/* Takes c out of the turn or budget queue (a grant it held is returned). */
void attnd_net_unqueue(attnd_conn_t *c);
/* The frame reader's budget hooks (net.h attnd_frame_admit_cb). */
int attnd_net_budget_admit(attnd_server_t *s, attnd_conn_t *c, size_t len);
void attnd_net_budget_release(attnd_server_t *s, size_t len);
/* Counts c under identity (moving it from the one it had): 0, or ATTND_ENOSPC
 * over --max-connections-per-identity (nothing changes then). */
int attnd_net_ident_move(attnd_server_t *s, attnd_conn_t *c, uint64_t identity);
void attnd_net_ident_drop(attnd_server_t *s, attnd_conn_t *c);

/* ---- drain.c ---- */

/* Reports the drain done once only the drain timer is left open. */
void attnd_net_check_done(attnd_server_t *s);

#endif /* ATTND_NET_INTERNAL_H */

/* rpc.h: one request frame in, one response frame out (docs/protocol.md).
 *
 * The RPC layer decodes attnd.v1.Request with nanopb (tensor bytes are not
 * copied: the engine gets pointers into the request frame, which the request
 * keeps until the engine's done callback), looks the call up in its method
 * table (rpc/methods.c: one row per method, decode -> call -> encode),
 * answers Hello, Health, Stats and ListSessions on the loop thread, maps
 * everything else to engine.h calls, and encodes the Response (epoch and
 * timings included). It knows nothing about sockets: the transport (net/)
 * embeds an attnd_rpc_conn_t per connection and gives it a send function.
 *
 * Lifetime: every request holds its connection. When the transport closes,
 * attnd_rpc_conn_closed() makes the results of requests still in flight be
 * dropped; the transport may free the connection only when no request holds
 * it any more (attnd_rpc_conn_closed() returns 1, or the released callback
 * runs later). */
#ifndef ATTND_RPC_H
#define ATTND_RPC_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "base.h"
#include "config.h"
#include "engine.h"

/* Methods, numbered as the Request.call oneof tags minus one (0: none/unknown). */
enum {
  ATTND_M_UNKNOWN = 0,
  ATTND_M_HELLO,
  ATTND_M_HEALTH,
  ATTND_M_STATS,
  ATTND_M_OPEN_SESSION,
  ATTND_M_CLOSE_SESSION,
  ATTND_M_FORK,
  ATTND_M_TRUNCATE,
  ATTND_M_PLAN,
  ATTND_M_STEP,
  ATTND_M_SET_SCALES,
  ATTND_M_LIST_SESSIONS,
  ATTND_M_SET_SINKS,
  ATTND_M_REGISTER_BUFFER,
  ATTND_M_RELEASE_BUFFER,
  ATTND_M_COUNT
};

enum { ATTND_STEP_PREFILL = 0, ATTND_STEP_DECODE = 1 };

/* The step trace (--step-trace N, trace.c): a Step's phases, in
 * microseconds. read: its frame's first byte to its last; decode: the
 * request decoded; admit: the engine call on the loop thread (checks,
 * reservation, for a small step its scan and the backend's enqueue); scan:
 * the finiteness scan (loop thread or worker pool); queue, compute: the
 * response's Timing; h2d, kwrite (the cache write), attend, d2h: the
 * backend's phases when it timed them (CPU: always, no copies; CUDA:
 * --cuda-trace); encode: the response built; write: the response handed to
 * the transport until the socket took its last byte; total: the first byte
 * of the request to the response encoded. */
enum {
  ATTND_PH_READ,
  ATTND_PH_DECODE,
  ATTND_PH_ADMIT,
  ATTND_PH_SCAN,
  ATTND_PH_QUEUE,
  ATTND_PH_H2D,
  ATTND_PH_KWRITE,
  ATTND_PH_ATTEND,
  ATTND_PH_D2H,
  ATTND_PH_COMPUTE,
  ATTND_PH_ENCODE,
  ATTND_PH_WRITE,
  ATTND_PH_TOTAL,
  ATTND_PH_COUNT
};
typedef struct attnd_rpc_trace_s attnd_rpc_trace_t;
/* The step trace's kinds: ATTND_STEP_PREFILL, ATTND_STEP_DECODE, and steps
 * whose items are all kv_only (no q, no output: filling a cache). */
enum { ATTND_TRACE_KV_ONLY = 2, ATTND_TRACE_KINDS = 3 };

/* The daemon's request counters, written only on the loop thread (by the RPC
 * layer and the transport) and read there by Stats and /metrics. */
typedef struct {
  uint64_t requests[ATTND_M_COUNT];             /* received, by method */
  attnd_status_counts_t answers[ATTND_M_COUNT]; /* answered, by method and code */
  uint64_t bytes_in;
  uint64_t bytes_out;
  uint32_t connections;         /* open now */
  uint64_t connections_total;   /* accepted since start */
  uint64_t connections_refused; /* over --max-connections */
  uint64_t frame_errors;        /* framing errors that closed a connection */
  attnd_hist_t step_latency[2]; /* ATTND_STEP_PREFILL, ATTND_STEP_DECODE */
  attnd_hist_t step_queue[2];   /* the same steps' queued_us: waiting for the backend */
} attnd_rpc_counters_t;

/* "health", "open_session", ... ("unknown" for 0 or out of range). */
const char *attnd_rpc_method_name(int method);
/* "OK", "INVALID_ARGUMENT", ... (the proto's names). */
const char *attnd_rpc_code_name(int code);

/* Identities (docs/sessions.md): a Unix peer's uid as is (< 2^32); the
 * shared identity of loopback TCP clients that send no Hello; a token's
 * identity is a hash of the token with the top bit set. */
#define ATTND_IDENTITY_ANON 0x4000000000000000ull
#define ATTND_IDENTITY_TOKEN_BIT 0x8000000000000000ull

/* The token set read from --token-file (auth.c). */
typedef struct attnd_rpc_tokens_s attnd_rpc_tokens_t;

typedef struct attnd_rpc_s attnd_rpc_t;
typedef struct attnd_rpc_conn_s attnd_rpc_conn_t;
typedef struct attnd_rpc_req_s attnd_rpc_req_t;

/* One piece of a response for sendv: n bytes at p; free_p (p itself, the
 * buffer p points into, or NULL) is freed once the piece is written: with
 * free(), or with attnd_engine_host_free() when pinned (a step's output in
 * the backend's pinned memory). */
typedef struct {
  const void *p;
  size_t n;
  void *free_p;
  int pinned;
} attnd_rpc_seg_t;

struct attnd_rpc_s {
  uv_loop_t *loop;
  attnd_engine_t *engine;
  const attnd_config_t *cfg;
  attnd_rpc_counters_t counters;
  uint64_t epoch;    /* random, drawn at init */
  uint64_t start_ns; /* uv_hrtime() at init */
  int draining;      /* new calls answer UNAVAILABLE (Health and Stats still answer) */
  int tcp_port;      /* bound TCP port for Health, 0 when off */
  uint64_t inflight; /* requests in flight on all connections */
  uint64_t next_conn_id;
  size_t ref_min; /* step tensors this large leave by reference (sendv); --rpc-ref-min */
  /* Runs when inflight drops to 0 while draining. */
  void (*idle_cb)(void *arg);
  void *idle_arg;
  /* The engine's static facts, fetched at the first Health (the backend may
   * read files to describe its device: not on every call). */
  attnd_engine_info_t info;
  int have_info;
  /* Accepted Hello tokens (--token-file); never logged. Replaced as a whole
   * by attnd_auth_reload(). */
  attnd_rpc_tokens_t *tokens;
  uint64_t own_uid; /* the daemon's uid: its peers on the Unix socket are operators */
  attnd_rpc_trace_t *trace; /* --step-trace, else NULL */
  /* Registered device buffers of every connection, by id (buffers.c):
   * a step names only its own connection's. */
  attnd_idmap_t buffers;
};

struct attnd_rpc_conn_s {
  attnd_rpc_t *rpc;
  uint64_t id; /* names the connection to the engine (plans end with it) */
  uint64_t identity;
  int need_hello;    /* off-loopback TCP: a valid Hello must come first */
  int is_unix;       /* identity is a Unix peer's uid (a wrong Hello token keeps it) */
  int same_host;     /* a loopback TCP peer (set by the transport): may register buffers */
  /* Its registered device buffers (buffers.c), released when it closes. */
  attnd_list_t buffers;
  uint32_t nbuffers;
  uint64_t op_token; /* the operator token's identity it presented in Hello, or 0 */
  int closed;        /* the transport is gone: results are dropped */
  /* The step trace, set by the transport before each frame it hands over:
   * uv_hrtime() when that frame's first byte arrived (0: unknown). */
  uint64_t frame_t0_ns;
  /* ... and whether that frame is pinned frame memory (attnd_engine_host_alloc
   * said so): freed with attnd_engine_host_free, and a Step's tensors in it
   * may go to the device without a copy. */
  int frame_pinned;
  /* While a Step's response is handed to send or sendv: its kind + 1 (the
   * step trace's write phase), else 0. */
  int send_kind1;
  attnd_rpc_req_t *calling; /* the request whose engine call runs now (the step trace) */
  /* Ending (attnd_rpc_conn_end): no more requests; the connection-level
   * answer waits in end_* until every call in flight is answered. */
  int ending;
  int end_deferred;
  int end_err;
  char end_msg[200];
  uint32_t pending;   /* requests in flight */
  uint64_t req_bytes; /* bytes of request frames held by requests in flight */
  /* Requests in flight by id, for the duplicate-id check: O(1) per request
   * however deep the pipeline (allocated at the first one, freed once the
   * connection is closed and let go). */
  attnd_idmap_t inflight;
  /* Sends a whole response frame (header included; ownership of buf passes).
   * close_after: close the connection once it is written. */
  void (*send)(attnd_rpc_conn_t *c, uint8_t *buf, size_t len, int close_after);
  /* Optional: the same for a response in pieces written in order (a step's
   * large tensors go out from the engine's buffers instead of being copied on
   * the loop thread); takes ownership of every seg's free_p, freed once
   * written or dropped. NULL: the RPC layer copies into one buffer and calls send. */
  void (*sendv)(attnd_rpc_conn_t *c, const attnd_rpc_seg_t *segs, int n, int close_after);
  /* A request completed: the transport may resume reading (backpressure). */
  void (*progress)(attnd_rpc_conn_t *c);
  /* The last request let go of a closed connection: the owner may free it. */
  void (*released)(attnd_rpc_conn_t *c);
  /* Optional: a Hello is about to make identity the connection's. 0 goes on;
   * ATTND_ENOSPC refuses it (too many connections of that identity): the
   * Hello is answered RESOURCE_EXHAUSTED and the connection closes. */
  int (*identity_cb)(attnd_rpc_conn_t *c, uint64_t identity);
};

/* Draws the epoch and reads the token file. */
int attnd_rpc_init(attnd_rpc_t *r, uv_loop_t *loop, attnd_engine_t *engine,
                   const attnd_config_t *cfg, char *err, size_t errlen);
void attnd_rpc_free(attnd_rpc_t *r);

void attnd_rpc_conn_init(attnd_rpc_conn_t *c, attnd_rpc_t *r, uint64_t identity, int need_hello);
/* Handles one request frame; takes ownership of frame (malloc'ed, or the
 * engine's pinned frame memory when c->frame_pinned is set). */
void attnd_rpc_handle_frame(attnd_rpc_conn_t *c, uint8_t *frame, size_t len);
/* Sends a Response with no result whose status is attnd_err_status(err). */
void attnd_rpc_send_error(attnd_rpc_conn_t *c, uint64_t id, int err, const char *msg,
                          int close_after);
/* Ends the connection (docs/protocol.md §2): no later frame is a request,
 * and once every call in flight has been answered it gets Response{id 0,
 * attnd_err_status(err), msg} with close_after set. The transport stops
 * reading at once (c->ending) and closes once that answer is written. The
 * first reason wins. */
void attnd_rpc_conn_end(attnd_rpc_conn_t *c, int err, const char *msg);
/* A framing error (err: ATTND_EINVAL, ATTND_ENOSPC, ...): counted, then
 * attnd_rpc_conn_end(). */
void attnd_rpc_frame_error(attnd_rpc_conn_t *c, int err, const char *msg);
/* The transport closed. Returns 1 when no request holds the connection. */
int attnd_rpc_conn_closed(attnd_rpc_conn_t *c);

/* The wire framing's header (docs/protocol.md): the 4-byte big-endian length
 * of an n-byte frame, as every response starts; the transport's frame reader
 * (net.h) reads the same. */
void attnd_rpc_frame_header(uint8_t out[4], uint32_t n);

/* How many entries the duplicate-id check compares to find id among this
 * connection's requests in flight: bounded by a small constant however many
 * are in flight (the tests check it). */
uint32_t attnd_rpc_conn_id_probes(const attnd_rpc_conn_t *c, uint64_t id);

/* The step trace: a response of a step of kind (ATTND_STEP_*, ATTND_TRACE_KV_ONLY) whose
 * send_kind1 the transport kept took us microseconds to write. */
void attnd_rpc_trace_write(attnd_rpc_t *r, int kind, uint64_t us);

/* Constant-time comparison of a token against the accepted ones: 0 when it
 * is not accepted, 1 when it is, 2 when it is an operator's. */
int attnd_rpc_token_ok(const attnd_rpc_t *r, const char *token);

/* Whether the connection may change daemon-wide state (SetScales): its
 * Unix peer is root or the daemon's own uid, or it presented a token that is
 * an operator's in the token file as now loaded. */
int attnd_rpc_conn_operator(const attnd_rpc_conn_t *c);

/* Rereads --token-file (on SIGHUP) and puts the new set in force at once, for
 * every later Hello and operator check; a connection already authenticated
 * keeps its identity, but a removed operator token stops being an operator's.
 * On error (the file unreadable or invalid) the old set stays in force and a
 * one-line reason (never a token) is written to err. 0 or a negative ATTND_E*;
 * without --token-file, 0 and nothing changes. Loop thread only. */
int attnd_auth_reload(attnd_rpc_t *r, char *err, size_t errlen);

#endif /* ATTND_RPC_H */

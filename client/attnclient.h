/* attnclient.h: libattnclient, the C client of attnd (docs/protocol.md).
 *
 * One attnd_client_t is one connection (Unix socket or TCP). It is not
 * thread-safe: use one per thread. Calls are either synchronous
 * (attnd_client_call and the wrappers) or pipelined: attnd_client_send() any
 * number of requests, then attnd_client_recv() them by id in any order. A
 * response that arrives for another id than the one asked is kept until it is
 * asked for, so the daemon may answer out of order.
 *
 * Functions return 0 or a negative ATTND_CLIENT_E* code. The text of the last
 * error (the socket tried, the daemon's status message) is in
 * attnd_client_errmsg(); for ATTND_CLIENT_ESTATUS the daemon's status code is in
 * attnd_client_status(). */
#ifndef ATTND_CLIENT_H
#define ATTND_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "attnd.pb.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
  ATTND_CLIENT_OK = 0,
  ATTND_CLIENT_ECONNECT = -1, /* could not connect (no daemon, refused, bad address) */
  ATTND_CLIENT_EIO = -2,      /* read or write failed, or the daemon closed the connection */
  ATTND_CLIENT_EPROTO = -3,   /* a frame that does not parse or is too large */
  ATTND_CLIENT_ESTATUS = -4,  /* the daemon answered with a non-OK Status */
  ATTND_CLIENT_EINVAL = -5,   /* bad argument on the client side */
  ATTND_CLIENT_ENOMEM = -6,
  ATTND_CLIENT_ETIMEDOUT = -7, /* no response within the timeout */
};

typedef struct attnd_client_s attnd_client_t;

/* A received response. msg is the decoded message; callback fields (tensor
 * data, session lists) are not decoded into it but can be read from the raw
 * frame with the accessors below. Free with attnd_client_resp_free(). */
typedef struct {
  attnd_v1_Response msg;
  uint8_t *raw;
  size_t rawlen;
} attnd_client_resp_t;

/* Returns the short name of an error code ("cannot connect", ...). */
const char *attnd_client_strerror(int err);
/* Returns the name of a wire status code ("NOT_FOUND", ...). */
const char *attnd_client_status_name(int code);

/* Writes the default socket path into buf, looking where the daemon puts it
 * (docs/operations.md): $RUNTIME_DIRECTORY/attnd.sock, /run/attnd/attnd.sock
 * for root, $XDG_RUNTIME_DIR/attnd.sock, /tmp/attnd-$UID/attnd.sock. The first
 * candidate that exists wins; a non-root user also tries the system daemon's
 * /run/attnd/attnd.sock last. When none exists, the first candidate that
 * applies is returned so that an error can name it. */
int attnd_client_default_socket(char *buf, size_t len);

/* Connects to addr: a path (anything containing '/') is a Unix socket,
 * "HOST:PORT" or "[V6]:PORT" is TCP, NULL or "" is the default socket. On
 * failure *out is still a valid handle whose errmsg says what was tried
 * (free it with attnd_client_free), unless ENOMEM. */
int attnd_client_connect(attnd_client_t **out, const char *addr);
void attnd_client_free(attnd_client_t *c);

/* The address this client connected to (or tried). */
const char *attnd_client_addr(const attnd_client_t *c);
const char *attnd_client_errmsg(const attnd_client_t *c);
/* The Status code of the last ATTND_CLIENT_ESTATUS answer (0 otherwise). */
int attnd_client_status(const attnd_client_t *c);
/* The daemon's epoch as seen in the latest response (0 before any). */
uint64_t attnd_client_epoch(const attnd_client_t *c);
/* Receive timeout in milliseconds; 0 (the default) waits forever. */
void attnd_client_set_timeout(attnd_client_t *c, int ms);
/* Busy-waiting: a receive that finds nothing polls the socket without
 * sleeping for up to us microseconds before it blocks (0, the default: it
 * blocks at once). A thread waiting for a ~100 us answer then wakes without
 * the scheduler's and the idle CPU's wakeup latency, at the price of a core
 * while it waits. */
void attnd_client_set_spin(attnd_client_t *c, int us);

/* Where the last call's time went on this side, for benchmarks (attnctl
 * bench): the last send's encoding (sizing and the small fields; tensor bytes
 * of 64 KiB or more are not copied but written from the caller's memory) and
 * its write to the socket, the last received frame's wait (the recv call, or
 * the end of the previous frame, until its header), its body's read and its
 * parse. */
typedef struct {
  double encode_us, send_us;
  double wait_us, read_us, decode_us;
  uint64_t sent_bytes, recv_bytes;
} attnd_client_phases_t;
void attnd_client_phases(const attnd_client_t *c, attnd_client_phases_t *out);

/* Sends one request. If req->id is 0 a fresh id is assigned; the id used is
 * written to *id (may be NULL). Nothing is read. */
int attnd_client_send(attnd_client_t *c, attnd_v1_Request *req, uint64_t *id);
/* Receives the response with this id (0: the next response, whatever its id).
 * Returns ESTATUS (resp still filled) when its status is not OK. */
int attnd_client_recv(attnd_client_t *c, uint64_t id, attnd_client_resp_t *resp);
/* send + recv of the same id. */
int attnd_client_call(attnd_client_t *c, attnd_v1_Request *req, attnd_client_resp_t *resp);
void attnd_client_resp_free(attnd_client_resp_t *resp);

/* Step output of a response: the out (which = 0) or lse (which = 1) tensor's
 * data, pointing into resp->raw. Returns EPROTO when the tensor is absent. */
int attnd_client_resp_tensor(const attnd_client_resp_t *resp, int which, const uint8_t **data,
                             size_t *nbytes, attnd_v1_Tensor *meta);
/* ListSessions result: fills up to max entries, *n gets the total count. */
int attnd_client_resp_sessions(const attnd_client_resp_t *resp, attnd_v1_SessionInfo *out,
                               size_t max, size_t *n);

/* Synchronous wrappers. */
int attnd_client_hello(attnd_client_t *c, const char *token);
int attnd_client_health(attnd_client_t *c, attnd_v1_HealthResponse *out);
int attnd_client_stats(attnd_client_t *c, attnd_v1_StatsResponse *out);
int attnd_client_list_sessions(attnd_client_t *c, attnd_v1_SessionInfo *out, size_t max, size_t *n);
int attnd_client_open_session(attnd_client_t *c, const uint32_t *tokens, size_t ntokens,
                              uint64_t *session, uint32_t *cached_len);
int attnd_client_close_session(attnd_client_t *c, uint64_t session);
/* Forks a session (the child shares all its blocks); the child's id goes to *child. */
int attnd_client_fork(attnd_client_t *c, uint64_t session, uint64_t *child);
/* Rolls a session back to len tokens. */
int attnd_client_truncate(attnd_client_t *c, uint64_t session, uint32_t len);
/* Sets a layer's static KV scales: fp32, n = kv_heads (per head) or kv_heads *
 * head_dim (per channel, with dim = head_dim; 0 for per head). zeros may be NULL
 * (int4 only). The new version goes to *version (may be NULL). */
int attnd_client_set_scales(attnd_client_t *c, uint32_t layer, const float *k_scale,
                            const float *v_scale, const float *k_zero, const float *v_zero,
                            uint32_t kv_heads, uint32_t dim, int drop_cached_kv, uint64_t *version);
/* Sets a layer's attention sink logits: fp32 [q_heads] (docs/protocol.md,
 * SetSinks). The new version goes to *version (may be NULL). */
int attnd_client_set_sinks(attnd_client_t *c, uint32_t layer, const float *sinks, uint32_t q_heads,
                           uint64_t *version);

/* One item of a Plan or an inline Step, causal mask. tokens has n entries
 * (may be NULL: no token ids are sent). */
typedef struct {
  uint64_t session;
  uint32_t start;
  uint32_t n;
  int kv_only;
  const uint32_t *tokens;
} attnd_client_item_t;

/* Same-host zero-copy (docs/protocol.md §5a): a tensor at offset of a
 * buffer from attnd_client_register_buffer (buffer 0: absent). */
typedef struct {
  uint64_t buffer;
  uint64_t offset;
} attnd_client_ref_t;
typedef struct {
  attnd_client_ref_t q, k, v; /* shapes and dtype as attnd_client_step_t's bytes */
  attnd_client_ref_t out;     /* [q_rows, q_heads, head_dim], dtype or FP32 (fp32_out) */
  attnd_client_ref_t lse;     /* [q_rows, q_heads] FP32, exactly when want_lse */
} attnd_client_refs_t;

/* Registers device memory shared with cudaIpcGetMemHandle (its 64 bytes),
 * size bytes from the allocation's start, on the device named device_uuid
 * (HealthResponse.device_uuid's form); the id goes to *buffer. The daemon
 * answers FAILED_PRECONDITION (ESTATUS, attnd_client_status() 9) when it
 * cannot share memory with this client: send bytes then. */
int attnd_client_register_buffer(attnd_client_t *c, const uint8_t handle[64], uint64_t size,
                                 const char *device_uuid, uint64_t *buffer);
int attnd_client_release_buffer(attnd_client_t *c, uint64_t buffer);

/* A Step: items inline (plan == 0) or a plan id. q is [q_rows, q_heads,
 * head_dim], k and v are [kv_rows, kv_heads, head_dim], all of dtype
 * (attnd_v1_DType, 2-byte types); q may be NULL when every item is kv_only.
 * With refs, the tensors are refs instead (q, k and v above unused) and the
 * response carries no out or lse: the daemon wrote them. */
typedef struct {
  uint32_t layer;
  uint64_t plan;
  const attnd_client_item_t *items;
  size_t nitems;
  int dtype;
  uint32_t q_heads, kv_heads, head_dim;
  const void *q;
  uint32_t q_rows;
  const void *k, *v;
  uint32_t kv_rows;
  int want_lse;
  int fp32_out;
  const attnd_client_refs_t *refs; /* NULL: bytes */
} attnd_client_step_t;

int attnd_client_plan(attnd_client_t *c, const attnd_client_item_t *items, size_t nitems,
                      uint64_t *plan);
int attnd_client_step_send(attnd_client_t *c, const attnd_client_step_t *s, uint64_t *id);

#ifdef __cplusplus
}
#endif

#endif /* ATTND_CLIENT_H */

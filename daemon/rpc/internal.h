/* internal.h: the RPC layer's private declarations, seen only by rpc/'s own
 * files:
 *
 *   rpc.c      a frame in: the outer Request walked, checks that need no
 *              decoding, the method table's row looked up; a call's end
 *   methods.c  the method table: one row per method (decode, call, encode)
 *   info.c     the rows answered from the daemon's own state: Health, Stats,
 *              ListSessions
 *   auth.c     tokens (--token-file, constant-time comparison) and Hello
 *   decode.c   nanopb callbacks: token ids, tensors (pointers into the
 *              frame), items with their masks expanded to the kernels' form
 *   fields.c   the field budget walked before a call is decoded
 *   encode.c   a Response out: one frame, or pieces for sendv
 *   trace.c    the step trace (--step-trace)
 *   buffers.c  same-host zero-copy: RegisterBuffer, ReleaseBuffer, a Step's
 *              tensor refs resolved against the connection's buffers
 */
#ifndef ATTND_RPC_INTERNAL_H
#define ATTND_RPC_INTERNAL_H

#include <pb_decode.h>
#include <pb_encode.h>
#include <stdint.h>

#include "attnd.pb.h"
#include "base.h"
#include "engine.h"
#include "rpc.h"

/* Token ids being decoded (attnd_rpc_dec_u32_cb). The count is bounded
 * before the ids cost anything: a packed run longer than 10 bytes per id
 * still allowed is refused from its length on the wire, unpacked ids one past
 * the bound. */
typedef struct {
  uint32_t *v;
  uint32_t n, cap;
  uint32_t max;           /* more ids than this are refused (0: no bound) */
  const uint32_t *nfield; /* the item's n as decoded so far (0: not seen yet), or NULL */
  uint64_t *total;        /* ids of the whole request so far, against total_max */
  uint64_t total_max;
  int over; /* 1: more than max (or n); 2: the request's total past total_max */
} attnd_u32vec_t;

/* Bytes a response field encodes from (enc_bytes_cb's argument). */
typedef struct {
  const void *p;
  size_t n;
} attnd_rpc_bytes_t;

struct attnd_rpc_req_s {
  attnd_rpc_conn_t *conn;
  int linked; /* holds the connection (an engine call); in its in-flight map */
  uint64_t id;
  int method;
  uint8_t *frame;
  size_t frame_len;
  int frame_pinned; /* frame is the engine's pinned frame memory (rpc.h) */
  uint64_t t0_ns;   /* frame decoded */
  uint64_t t_read0_ns, t_decoded_ns, t_called_ns; /* the step trace (rpc.h) */
  int close_after; /* close the connection once the answer is written */
  /* The call's message as decoded; tensor and mask data point into frame. */
  union {
    attnd_v1_HelloRequest hello;
    attnd_v1_OpenSessionRequest open;
    attnd_v1_CloseSessionRequest close;
    attnd_v1_ForkRequest fork;
    attnd_v1_TruncateRequest truncate;
    attnd_v1_PlanRequest plan;
    attnd_v1_StepRequest step;
    attnd_v1_SetScalesRequest scales;
    attnd_v1_SetSinksRequest sinks;
    attnd_v1_RegisterBufferRequest reg;
    attnd_v1_ReleaseBufferRequest rel;
  } m;
  /* The native request handed to the engine. */
  attnd_item_t *items;
  uint32_t nitems, cap_items;
  attnd_u32vec_t open_tokens;
  attnd_step_req_t step;
  attnd_scales_req_t scales;
  attnd_sinks_req_t sinks;
  attnd_session_info_t *sessions; /* ListSessions */
  uint32_t nsessions;
  attnd_rpc_bytes_t out, lse; /* a Step's outputs while its response is encoded */
  int out_pinned;             /* out is the engine's pinned host memory (rpc.h seg) */
  int decode_failed;          /* a callback failed for a reason of ours: its ATTND_E* (msg set) */
  uint64_t tokens_total;      /* token ids decoded over all items */
  uint64_t mask_bytes;        /* bytes of the items' masks in the kernels' form */
  /* Same-host zero-copy (buffers.c): the buffers a Step's refs name, held
   * until the request is freed; RegisterBuffer's new id. */
  struct attnd_rpc_buf_s *bufs[6]; /* q, k, v, out, lse and the done signal's */
  int nbufs;
  uint64_t buffer_id;
  char msg[200];
};

/* ---- methods.c: the method table ----
 *
 * Indexed by method (the Request.call oneof tag minus one). */
enum {
  RPC_M_DRAINING = 1, /* answered while the daemon drains */
  RPC_M_NO_HELLO = 2, /* allowed before an off-loopback Hello */
  RPC_M_OPERATOR = 4, /* changes daemon-wide state: operators only (PERMISSION_DENIED) */
};

typedef struct {
  const char *name; /* "open_session", ... (metrics and logs) */
  pb_size_t result; /* the Response.result member: attnd_v1_Response_*_tag */
  unsigned flags;   /* RPC_M_* */
  /* Decodes the call's message s into q (the native request); 0, or an
   * ATTND_E* with q->msg saying what was wrong. */
  int (*decode)(attnd_rpc_req_t *q, pb_istream_t *s);
  /* Runs the call; its end comes through attnd_rpc_done (the engine's
   * callback, or called at once for what the RPC layer answers itself). */
  void (*call)(attnd_rpc_req_t *q);
  /* Fills the Response's result from a successful call's result. */
  void (*encode)(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp);
} attnd_rpc_method_t;

extern const attnd_rpc_method_t attnd_rpc_methods[ATTND_M_COUNT];

/* The rows of info.c and auth.c, and what methods.c shares with them. */
int attnd_rpc_decode_none(attnd_rpc_req_t *q, pb_istream_t *s);
void attnd_rpc_call_health(attnd_rpc_req_t *q);
void attnd_rpc_encode_health(attnd_rpc_req_t *q, const attnd_result_t *res,
                             attnd_v1_Response *resp);
void attnd_rpc_call_stats(attnd_rpc_req_t *q);
void attnd_rpc_encode_stats(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp);
void attnd_rpc_call_list_sessions(attnd_rpc_req_t *q);
void attnd_rpc_encode_list_sessions(attnd_rpc_req_t *q, const attnd_result_t *res,
                                    attnd_v1_Response *resp);
int attnd_rpc_decode_hello(attnd_rpc_req_t *q, pb_istream_t *s);
void attnd_rpc_call_hello(attnd_rpc_req_t *q);

/* ---- buffers.c: same-host zero-copy (docs/protocol.md) ---- */

int attnd_rpc_decode_register(attnd_rpc_req_t *q, pb_istream_t *s);
void attnd_rpc_call_register(attnd_rpc_req_t *q);
void attnd_rpc_encode_register(attnd_rpc_req_t *q, const attnd_result_t *res,
                               attnd_v1_Response *resp);
int attnd_rpc_decode_release(attnd_rpc_req_t *q, pb_istream_t *s);
void attnd_rpc_call_release(attnd_rpc_req_t *q);
/* A decoded Step's refs (m->q_ref ...) into st's tensors as device
 * pointers, each bounds-checked against its buffer, which q holds until it
 * is freed: 0, nothing to do without refs, or an ATTND_E* with q->msg set
 * (INVALID_ARGUMENT: a buffer not registered, a bad offset, dtype, shape or
 * mix of bytes and refs; PERMISSION_DENIED: another connection's buffer). */
int attnd_rpc_step_refs(attnd_rpc_req_t *q, const attnd_v1_StepRequest *m, attnd_step_req_t *st);
/* What a request holds goes with it (req_free). */
void attnd_rpc_bufs_drop(attnd_rpc_req_t *q);
/* The connection closed: its buffers are released (in-flight steps keep
 * theirs mapped until they finish). */
void attnd_rpc_bufs_conn_closed(attnd_rpc_conn_t *c);

/* ---- rpc.c ---- */

/* A call ended (the engine's done callback, or an answer the RPC layer made
 * itself): counted, answered unless the client left, and let go; res->out
 * and res->lse are freed unless the transport took them. */
void attnd_rpc_done(void *arg, attnd_result_t *res);
/* Ends a call with an error status and message (no result). */
void attnd_rpc_fail(attnd_rpc_req_t *q, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Makes q hold its connection (counts as in flight) before an engine call. */
void attnd_rpc_req_hold(attnd_rpc_req_t *q);

static inline uint64_t attnd_rpc_now_ns(void) {
  return uv_hrtime();
}

/* ---- auth.c ---- */

/* Reads --token-file into r->tokens (replacing them). */
int attnd_rpc_load_tokens(attnd_rpc_t *r, const char *path, char *err, size_t errlen);
/* Wipes and frees them. */
void attnd_rpc_free_tokens(attnd_rpc_t *r);

/* ---- decode.c ---- */

/* pb_decode of the call's message, with nanopb's terse errors turned into
 * something a client can act on (q->msg); 0 or ATTND_EINVAL. */
int attnd_rpc_pb_decode(attnd_rpc_req_t *q, pb_istream_t *s, const pb_msgdesc_t *fields, void *msg);
/* nanopb callbacks: token ids into an attnd_u32vec_t, tensor bytes left in
 * the frame, items into q->items. Bounds (docs/protocol.md §7): an
 * OpenSession's tokens at most max_context; a Plan's or Step's items at most
 * --max-sessions, an item's tokens at most its n and max_context, all items'
 * tokens at most what the KV pool holds, an item's doc_lengths at most
 * start + n, all items' masks in the kernels' form at most --max-frame bytes.
 * Each is checked before work proportional to what it bounds. */
bool attnd_rpc_dec_u32_cb(pb_istream_t *s, const pb_field_t *f, void **arg);
bool attnd_rpc_dec_item_cb(pb_istream_t *s, const pb_field_t *f, void **arg);
void attnd_rpc_set_tensor_cb(attnd_v1_Tensor *pb, attnd_tensor_t *t);
/* Bytes per element of a wire DType (attnd.v1.DType), 0 for an unknown one:
 * for tensors' bytes and tensor refs' regions alike. */
size_t attnd_rpc_dtype_size(int dt);
/* Fills t from the decoded message and checks what the wire alone can say:
 * a known dtype, 1 to 4 dims, and as many bytes as the shape needs. */
int attnd_rpc_tensor_finish(attnd_tensor_t *t, bool has, const attnd_v1_Tensor *pb,
                            const char *name, char *msg, size_t cap);
/* The engine's static facts (Health's; fetched once). */
const attnd_engine_info_t *attnd_rpc_info(attnd_rpc_t *r);

/* ---- fields.c ---- */

/* How many protobuf fields a call may hold, its submessages included: more
 * than any valid call needs (unpacked token ids, items with masks and
 * tensors), and little enough to walk in milliseconds. */
uint64_t attnd_rpc_field_budget(attnd_rpc_t *r, uint32_t call_tag);
/* Walks the call's message (n bytes at p) against the budget before it is
 * decoded: 0, or ATTND_EINVAL with q->msg set. */
int attnd_rpc_fields_check(attnd_rpc_req_t *q, uint32_t call_tag, const uint8_t *p, size_t n);

/* ---- encode.c ---- */

/* Encodes resp into a new frame and hands it to the transport. */
void attnd_rpc_send_response(attnd_rpc_conn_t *c, attnd_v1_Response *resp, uint64_t t0_ns,
                             int close_after);
/* The same for a step whose large tensors (q->out, q->lse when at least
 * --rpc-ref-min bytes) go out by reference through the transport's sendv. 1
 * when sent that way: *out_taken / *lse_taken say which buffers now belong
 * to the transport; 0 when nothing was sent (the caller sends a copy). */
int attnd_rpc_send_response_refs(attnd_rpc_req_t *q, attnd_v1_Response *resp, int *out_taken,
                                 int *lse_taken);
bool attnd_rpc_enc_bytes_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg);
/* Counts an answer of this method with this wire code. */
void attnd_rpc_count(attnd_rpc_t *r, int method, int code);

/* ---- trace.c ---- */

/* window 0: no trace. 0 or ATTND_ENOMEM. */
int attnd_rpc_trace_init(attnd_rpc_t *r, int window);
/* One finished step: ph_us[p] for every phase p whose bit is in have. */
void attnd_rpc_trace_step(attnd_rpc_t *r, int kind, const uint64_t ph_us[ATTND_PH_COUNT],
                          uint32_t have);
/* Logs what is left of each window, frees the trace. */
void attnd_rpc_trace_free(attnd_rpc_t *r);

#endif /* ATTND_RPC_INTERNAL_H */

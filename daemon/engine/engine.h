/* engine.h: sessions, plans and steps (docs/sessions.md) behind the RPC layer.
 *
 * The RPC layer decodes a Request into the plain structs below (native types:
 * kernel dtypes and masks, never wire enums) and calls the engine on the loop
 * thread. The engine validates and admits the
 * call on the loop thread (state changes at admission; docs/sessions.md §5
 * says in which order calls are admitted), runs
 * the math on its backend off the loop, and reports completion through
 * attnd_engine_done_cb on the loop thread. Nothing here blocks the loop.
 *
 * Memory: pointers inside a request (tensor data, items, tokens, mask arrays)
 * belong to the caller and stay valid, unchanged and writable until the call's
 * done callback has run (q may be rotated in place; a call queued behind a
 * large step is admitted after it returns). The request structs themselves and
 * the salt may be reused once the call returns. The result passed to the
 * callback is valid during the callback; its out and lse buffers (a Step's
 * outputs) belong to the callback from then on, which frees them (free()) or
 * hands them on. */
#ifndef ATTND_ENGINE_H
#define ATTND_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "attnd_kernels.h"
#include "config.h"

typedef struct attnd_engine_s attnd_engine_t;

/* A tensor as decoded from the wire; data points into the request frame. */
typedef struct {
  int present;         /* the field was set */
  attnd_dtype_t dtype; /* element type (0: none given) */
  int ndim;            /* <= 4 */
  uint32_t shape[4];
  uint8_t *data; /* raw little-endian bytes, possibly unaligned */
  size_t nbytes;
} attnd_tensor_t;

/* An item's mask in the kernels' form (attnd_kernels.h, docs/numerics.md):
 * the RPC layer expands the wire's document masks into intervals. Only
 * ATTND_MASK_CAUSAL items publish their blocks to the prefix cache. */
typedef struct {
  attnd_mask_kind_t kind;   /* ATTND_MASK_* */
  int32_t param;            /* SLIDING: window >= 1; PREFIX_LM: prefix length */
  int causal;               /* INTERVALS: 1 = the intervals apply on top of causal */
  const int32_t *intervals; /* INTERVALS: int32 [4][kv_len] (lts, lte, uts, ute) */
  uint32_t intervals_len;   /* INTERVALS: the kv_len they were made for */
} attnd_mask_t;

typedef struct {
  uint64_t session;
  uint32_t start; /* absolute position (a session with base: >= base) */
  uint32_t n;
  int kv_only;
  int q_only;             /* attend only: q rows over the keys the session holds, nothing
                           * written, no token ids, start >= the session's len (docs/scale-out.md) */
  attnd_mask_t mask;      /* zeroed: causal */
  const uint32_t *tokens; /* ntokens token ids */
  uint32_t ntokens;
} attnd_item_t;

typedef struct {
  uint32_t layer;
  uint64_t plan; /* 0: items are inline */
  const attnd_item_t *items;
  uint32_t nitems;
  attnd_tensor_t q, k, v;
  int want_lse;
  int fp32_out;
  int pinned; /* q, k and v lie in a frame from attnd_engine_host_alloc that said so */
  /* Same-host zero-copy (docs/protocol.md): q, k, v, out and lse are DEVICE
   * memory of registered buffers (attnd_engine_ipc_open), their data device
   * pointers the caller keeps mapped until the done callback. out (shape
   * [Tq, q_heads, head_dim], the activation dtype or fp32) and lse ([Tq,
   * q_heads] fp32, present exactly when want_lse) receive the outputs, which
   * the result then does not carry. Only a backend with ipc_open sees them. */
  int device;
  attnd_tensor_t out, lse;
  /* With device: NULL, or an 8-byte aligned DEVICE word of a registered
   * buffer that the backend raises to done_value (max(word, done_value))
   * after the step's kernels (docs/protocol.md, the done signal; a step
   * that fails may leave it). */
  void *done;
  uint64_t done_value;
} attnd_step_req_t;

typedef struct {
  uint32_t layer;
  attnd_tensor_t k_scale, v_scale, k_zero, v_zero;
  int drop_cached_kv;
} attnd_scales_req_t;

typedef struct {
  uint32_t layer;
  attnd_tensor_t sinks; /* fp32 [q_heads] */
} attnd_sinks_req_t;

/* Completion of one call. status is 0 or a negative ATTND_E*; message names
 * what was wrong (the item index for a step) when status != 0. */
typedef struct {
  int status;
  char message[256];
  uint64_t session;    /* OpenSession, Fork */
  uint32_t cached_len; /* OpenSession */
  uint32_t base;       /* OpenSession: the base the session holds */
  uint64_t plan;       /* Plan */
  uint64_t version;    /* SetScales, SetSinks */
  /* Step: out [Tq, q_heads, head_dim] (activation dtype or fp32) and lse
   * [Tq, q_heads], owned by the callback (it frees them, out with
   * attnd_engine_host_free when out_pinned, or keeps them: the RPC layer
   * writes large outputs to the socket straight from them). */
  void *out;
  size_t out_bytes;
  int out_pinned; /* out is from attnd_engine_host_alloc with pinned = 1 */
  attnd_dtype_t out_dtype;
  uint32_t out_rows; /* Tq */
  float *lse;        /* NULL when not asked */
  size_t lse_bytes;
  int decode; /* Step: every item has n == 1 (else a prefill), whichever plan it names */
  uint64_t queued_us;
  uint64_t computing_us;
  /* Step: its finiteness scan, and its backend phases when the backend timed
   * them (dev_timed; backend.h ATTND_DEV_*: H2D, write, attend, D2H). */
  uint32_t scan_us;
  uint32_t dev_us[4];
  int dev_timed;
  /* attnd_engine_ipc_open: the mapping (for attnd_engine_ipc_close), the
   * device address of the buffer's first byte and the allocation's size
   * (0: unknown). */
  void *ipc;
  uint8_t *ipc_base;
  uint64_t ipc_size;
} attnd_result_t;

typedef void (*attnd_engine_done_cb)(void *arg, attnd_result_t *res);

/* Static facts for Health. */
typedef struct {
  const char *backend; /* "cpu" | "cuda" */
  char device[128];
  uint64_t device_memory;
  int compute_capability;
  uint64_t kv_memory;
  uint32_t kv_blocks;
  double kv_bytes_per_token; /* all layers */
  char device_uuid[48];      /* "GPU-<uuid>" of the CUDA device; "" on the CPU backend */
} attnd_engine_info_t;

/* Counters and gauges for Stats and /metrics. Counters only grow. */
typedef struct {
  uint32_t sessions;
  uint32_t plans;
  uint32_t blocks_total, blocks_used, blocks_cached;
  uint64_t prefix_queries, prefix_hit_tokens, prefix_miss_tokens;
  uint64_t evictions, cow_copies;
  uint64_t steps, prefill_steps, decode_steps, tokens_written;
  uint32_t queued;    /* gauge: calls waiting for admission (behind a large step's scan, a
                       * SetScales's file write, or a queued call they must follow) */
  uint32_t sinks_set; /* layers whose sinks are set (attention-sinks on) */
  /* The backend's (backend.h attnd_backend_stats_t; 0 where it has none). */
  uint64_t pinned_bytes;  /* gauge: pinned host memory held */
  uint64_t ring_chunks;   /* chunks of large steps staged through the CUDA ring */
  uint64_t oneshot_steps; /* large steps staged whole (they allocate) */
  uint64_t staged_bytes;  /* steps' q, k, v and out bytes copied on the host through staging */
  uint64_t loop_done;     /* CUDA runs the loop thread's own polling completed */
  uint64_t graph_steps;   /* CUDA small steps launched as one graph */
  uint64_t graph_builds;  /* CUDA executable graphs made */
  uint64_t graph_replays; /* CUDA graph steps launched as they were (no capture) */
} attnd_engine_stats_t;

typedef struct {
  uint64_t session;
  uint32_t len; /* absolute: positions [base, len) are held */
  uint32_t base;
  uint32_t blocks;
  uint64_t idle_s;
} attnd_session_info_t;

/* Creates the engine: picks the backend, allocates the KV pool, restores
 * persisted scales. On failure returns a negative ATTND_E* with a reason in err. */
int attnd_engine_init(attnd_engine_t **out, uv_loop_t *loop, const attnd_config_t *cfg, char *err,
                      size_t errlen);
/* Finishes in-flight work, persists state, releases the backend, then calls cb. */
void attnd_engine_close(attnd_engine_t *e, void (*cb)(void *arg), void *arg);
/* cb runs once, on the loop thread, when the backend reports its device
 * unusable (a sticky CUDA error, ATTND_EDEVICE): jobs in flight and later ones
 * fail with it (wire UNAVAILABLE); the daemon should drain and exit non-zero. */
void attnd_engine_on_fatal(attnd_engine_t *e, void (*cb)(void *arg), void *arg);

void attnd_engine_info(attnd_engine_t *e, attnd_engine_info_t *info);
void attnd_engine_stats(attnd_engine_t *e, attnd_engine_stats_t *st);
/* Fills up to max sessions of this identity; returns how many there are. */
uint32_t attnd_engine_list_sessions(attnd_engine_t *e, uint64_t identity, attnd_session_info_t *out,
                                    uint32_t max);

/* Every call names the caller's identity (sessions are usable only by the
 * identity that opened them) and the connection (plans end with it; a
 * connection's calls are admitted in arrival order, and so are the calls
 * naming one session, while a call waits for no unrelated queued one). Every call
 * completes exactly once through cb, possibly before returning. */
void attnd_engine_open_session(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                               const uint32_t *tokens, uint32_t ntokens, const uint8_t *salt,
                               size_t saltlen, attnd_engine_done_cb cb, void *arg);
/* OpenSession with a base position (split context, docs/scale-out.md): the
 * session holds positions [base, ...); base < max_context (else ATTND_ERANGE).
 * A session with base > 0 neither looks up (cached_len 0) nor publishes
 * prefix blocks. attnd_engine_open_session is base 0. */
void attnd_engine_open_session_at(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                                  uint32_t base, const uint32_t *tokens, uint32_t ntokens,
                                  const uint8_t *salt, size_t saltlen, attnd_engine_done_cb cb,
                                  void *arg);
void attnd_engine_close_session(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                                uint64_t session, attnd_engine_done_cb cb, void *arg);
void attnd_engine_fork(attnd_engine_t *e, uint64_t identity, uint64_t conn, uint64_t session,
                       attnd_engine_done_cb cb, void *arg);
void attnd_engine_truncate(attnd_engine_t *e, uint64_t identity, uint64_t conn, uint64_t session,
                           uint32_t len, attnd_engine_done_cb cb, void *arg);
void attnd_engine_plan(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                       void *arg);
void attnd_engine_step(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg);
void attnd_engine_set_scales(attnd_engine_t *e, const attnd_scales_req_t *req,
                             attnd_engine_done_cb cb, void *arg);
/* SetSinks (docs/protocol.md): checked, persisted, applied like SetScales. */
void attnd_engine_set_sinks(attnd_engine_t *e, const attnd_sinks_req_t *req,
                            attnd_engine_done_cb cb, void *arg);

/* Host memory of len bytes for a request frame's body that the transport
 * reads the socket into, or a step's output it writes from (loop thread):
 * the backend's (CUDA: pinned, for large ones; *pinned = 1) or malloc's
 * (*pinned = 0). NULL when out of memory. attnd_engine_host_free takes it
 * back with the same pinned; all of it must be back before the engine closes. */
void *attnd_engine_host_alloc(attnd_engine_t *e, size_t len, int *pinned);
void attnd_engine_host_free(attnd_engine_t *e, void *p, int pinned);

/* Same-host zero-copy (docs/protocol.md). Maps device memory another
 * process shared with cudaIpcGetMemHandle (handle: its 64 bytes) of size
 * bytes, on the device named by device_uuid (attnd_engine_info's form),
 * into the daemon's device address space; completes through cb with
 * res->ipc and res->ipc_base. A handle mapped already is shared (counted),
 * so the same allocation may be registered many times. The open runs off
 * the loop thread (it costs about a millisecond). ATTND_EPRECOND: the
 * backend cannot map client memory (the CPU backend), the device differs,
 * or the driver refused the handle (another host's, another device's, a
 * process without access). Loop thread only. */
void attnd_engine_ipc_open(attnd_engine_t *e, const uint8_t handle[64], uint64_t size,
                           const char *device_uuid, attnd_engine_done_cb cb, void *arg);
/* Drops one reference of a mapping from attnd_engine_ipc_open; the last
 * unmaps it (off the loop thread). The caller guarantees that no step
 * in flight still uses it (it holds the buffer until each step's done
 * callback). */
void attnd_engine_ipc_close(attnd_engine_t *e, void *ipc);

/* The connection closed: its plans end. In-flight steps still complete. */
void attnd_engine_conn_closed(attnd_engine_t *e, uint64_t conn);

/* A Step whose q, k and v hold more than cfg->engine_offload_bytes together
 * has its finiteness scan (and any aligned copy) run on the libuv threadpool
 * before it is admitted; calls arriving meanwhile that must follow it (its
 * connection's, its sessions', a barrier) are admitted after it, in arrival
 * order, and the others at once. This sets that threshold later (tests: 0 sends every step
 * through the threadpool scan and the admission queue). */
void attnd_engine_set_offload_bytes(attnd_engine_t *e, size_t bytes);
/* Tests: a queued step's scan runs in up to parts parts (at least 1) of at
 * least part_bytes (at least 1) each; the defaults are one per core but one
 * (and the worker pool's size), 4 MiB. */
void attnd_engine_set_scan_parts(attnd_engine_t *e, int parts, size_t part_bytes);

/* Checks the engine's bookkeeping: the block pool's invariants, every
 * block's table references against the sessions' block tables, published
 * prefixes and, with nothing in flight, that only tables hold blocks.
 * 0, or -1 with a reason in err. For tests; O(blocks + sessions). */
int attnd_engine_check(attnd_engine_t *e, char *err, size_t errlen);

#endif /* ATTND_ENGINE_H */

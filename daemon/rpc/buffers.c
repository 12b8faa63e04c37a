/* buffers.c: same-host zero-copy (internal.h; docs/protocol.md,
 * "Same-host zero-copy"): RegisterBuffer and ReleaseBuffer, and a Step's
 * tensor refs resolved into device pointers.
 *
 * A registered buffer belongs to the connection that registered it (and so
 * to its identity): it is in that connection's list and in the daemon-wide
 * map by id, so that a step naming another connection's buffer is told so
 * (PERMISSION_DENIED) rather than that it does not exist. Ids are random
 * 64-bit values. A buffer is counted: the connection's registration holds
 * one reference, each request in flight that names it one more, so that
 * ReleaseBuffer or a close answers at once and the mapping goes (engine.h
 * attnd_engine_ipc_close) only after the last step using it is done. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Buffers one connection may hold: each costs a mapping of the client's
 * memory in the daemon's address space. */
#define RPC_MAX_BUFFERS 1024
/* Alignment of a ref's offset: the staging buffers' (256), so that every
 * kernel's vector loads and stores see what they see there. */
#define RPC_REF_ALIGN 256

typedef struct attnd_rpc_buf_s {
  uint64_t id, conn;
  void *ipc;     /* the engine's mapping */
  uint8_t *base; /* device address of its first byte */
  uint64_t size;
  uint32_t refs;     /* the registration (until released) + requests in flight */
  attnd_list_t link; /* the connection's buffers */
} rpc_buf_t;

static void buf_unref(attnd_rpc_t *r, rpc_buf_t *b) {
  if (--b->refs > 0)
    return;
  attnd_engine_ipc_close(r->engine, b->ipc);
  free(b);
}

/* Unlinks a registration from its connection and the map and drops its reference. */
static void buf_release(attnd_rpc_conn_t *c, rpc_buf_t *b) {
  attnd_idmap_del(&c->rpc->buffers, b->id);
  attnd_list_remove(&b->link);
  c->nbuffers--;
  buf_unref(c->rpc, b);
}

/* ---- RegisterBuffer ---- */

int attnd_rpc_decode_register(attnd_rpc_req_t *q, pb_istream_t *s) {
  int rc = attnd_rpc_pb_decode(q, s, attnd_v1_RegisterBufferRequest_fields, &q->m.reg);
  if (rc)
    return rc;
  if (q->m.reg.cuda_ipc_handle.size != 64) {
    snprintf(q->msg, sizeof(q->msg),
             "register_buffer: cuda_ipc_handle is %u bytes, a cudaIpcMemHandle_t is 64",
             (unsigned)q->m.reg.cuda_ipc_handle.size);
    return ATTND_EINVAL;
  }
  if (q->m.reg.size == 0) {
    snprintf(q->msg, sizeof(q->msg), "register_buffer: size 0");
    return ATTND_EINVAL;
  }
  return 0;
}

static void register_opened(void *arg, attnd_result_t *res) {
  attnd_rpc_req_t *q = arg;
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_t *r = c->rpc;
  /* ipc_size 0: the driver could not tell (logged by the backend). */
  const int too_large = res->ipc_size && q->m.reg.size > res->ipc_size;
  if (res->status == 0 && (c->closed || c->nbuffers >= RPC_MAX_BUFFERS || too_large)) {
    /* Gone meanwhile (the answer is dropped), over the limit, or larger
     * than the allocation (a step could then reach past it): unmapped again. */
    attnd_engine_ipc_close(r->engine, res->ipc);
    if (!c->closed && too_large) {
      attnd_rpc_fail(q, ATTND_EINVAL,
                     "register_buffer: size %llu is more than the allocation's %llu bytes",
                     (unsigned long long)q->m.reg.size, (unsigned long long)res->ipc_size);
      return;
    }
    if (!c->closed) {
      attnd_rpc_fail(q, ATTND_ENOSPC, "register_buffer: this connection holds %d buffers already",
                     RPC_MAX_BUFFERS);
      return;
    }
  } else if (res->status == 0) {
    rpc_buf_t *b = attnd_xcalloc(1, sizeof(*b));
    do
      b->id = attnd_random_id();
    while (b->id == 0 || attnd_idmap_get(&r->buffers, b->id));
    b->conn = c->id;
    b->ipc = res->ipc;
    b->base = res->ipc_base;
    b->size = q->m.reg.size;
    b->refs = 1;
    if (attnd_idmap_put(&r->buffers, b->id, b) != 0) {
      ATTND_LOGE("out_of_memory", "what=buffer_map conn=%llu", (unsigned long long)c->id);
      abort();
    }
    attnd_list_insert_tail(&c->buffers, &b->link);
    c->nbuffers++;
    q->buffer_id = b->id;
  }
  attnd_rpc_done(q, res);
}

void attnd_rpc_call_register(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_t *r = c->rpc;
  /* The driver decides in the end (a handle from another host or device
   * does not open), but a peer that is not known to be on this host is
   * refused first: its memory cannot be this host's. */
  if (!c->is_unix && !c->same_host) {
    attnd_rpc_fail(q, ATTND_EPRECOND,
                   "register_buffer: only a client on the daemon's host (Unix socket or loopback "
                   "TCP) can share device memory; send tensors as bytes");
    return;
  }
  if (!r->cfg->ipc) {
    attnd_rpc_fail(q, ATTND_EPRECOND,
                   "register_buffer: zero-copy is off (--ipc false); send tensors as bytes");
    return;
  }
  if (c->nbuffers >= RPC_MAX_BUFFERS) {
    attnd_rpc_fail(q, ATTND_ENOSPC, "register_buffer: this connection holds %d buffers already",
                   RPC_MAX_BUFFERS);
    return;
  }
  if (!r->buffers.b && attnd_idmap_init(&r->buffers) != 0) {
    attnd_rpc_fail(q, ATTND_ENOMEM, "register_buffer: out of memory");
    return;
  }
  q->m.reg.device_uuid[sizeof(q->m.reg.device_uuid) - 1] = 0;
  attnd_rpc_req_hold(q);
  attnd_engine_ipc_open(r->engine, q->m.reg.cuda_ipc_handle.bytes, q->m.reg.size,
                        q->m.reg.device_uuid, register_opened, q);
}

void attnd_rpc_encode_register(attnd_rpc_req_t *q, const attnd_result_t *res,
                               attnd_v1_Response *resp) {
  resp->result.register_buffer.buffer = q->buffer_id;
}

/* ---- ReleaseBuffer ---- */

int attnd_rpc_decode_release(attnd_rpc_req_t *q, pb_istream_t *s) {
  return attnd_rpc_pb_decode(q, s, attnd_v1_ReleaseBufferRequest_fields, &q->m.rel);
}

/* The connection's buffer id: 0, or an error with msg set. */
static int lookup(attnd_rpc_req_t *q, uint64_t id, const char *what, rpc_buf_t **out) {
  attnd_rpc_conn_t *c = q->conn;
  rpc_buf_t *b = c->rpc->buffers.b ? attnd_idmap_get(&c->rpc->buffers, id) : NULL;
  if (!b) {
    snprintf(q->msg, sizeof(q->msg), "%s: buffer %016llx is not registered (or was released)", what,
             (unsigned long long)id);
    return ATTND_EINVAL;
  }
  if (b->conn != c->id) {
    snprintf(q->msg, sizeof(q->msg), "%s: buffer %016llx belongs to another connection", what,
             (unsigned long long)id);
    return ATTND_EPERM;
  }
  *out = b;
  return 0;
}

void attnd_rpc_call_release(attnd_rpc_req_t *q) {
  rpc_buf_t *b;
  int rc = lookup(q, q->m.rel.buffer, "release_buffer", &b);
  if (rc) {
    char msg[sizeof(q->msg)];
    snprintf(msg, sizeof(msg), "%s", q->msg);
    attnd_rpc_fail(q, rc, "%s", msg);
    return;
  }
  buf_release(q->conn, b);
  attnd_result_t res;
  memset(&res, 0, sizeof(res));
  attnd_rpc_done(q, &res);
}

/* ---- a Step's refs ---- */

/* One ref into t: its buffer held by q, its region inside the buffer. */
static int resolve(attnd_rpc_req_t *q, const attnd_v1_TensorRef *ref, const char *name,
                   attnd_tensor_t *t) {
  rpc_buf_t *b;
  char what[32];
  snprintf(what, sizeof(what), "%s_ref", name);
  int rc = lookup(q, ref->buffer, what, &b);
  if (rc)
    return rc;
  size_t es = attnd_rpc_dtype_size(ref->dtype);
  if (!es || ref->shape_count < 1) {
    snprintf(q->msg, sizeof(q->msg), "%s: needs a dtype (BF16, FP16, FP32) and a shape", what);
    return ATTND_EINVAL;
  }
  uint64_t n = es;
  memset(t, 0, sizeof(*t));
  for (pb_size_t i = 0; i < ref->shape_count; i++) {
    /* Every factor is < 2^32 and the product is checked against the
     * buffer's size (< 2^64) at each step, so it cannot wrap. */
    n *= ref->shape[i];
    if (n > b->size)
      break;
    t->shape[i] = ref->shape[i];
  }
  if (ref->offset % RPC_REF_ALIGN != 0 || n > b->size || ref->offset > b->size - n) {
    snprintf(q->msg, sizeof(q->msg),
             "%s: %llu bytes at offset %llu do not fit buffer %016llx of %llu bytes (offsets "
             "are multiples of %d)",
             what, (unsigned long long)n, (unsigned long long)ref->offset,
             (unsigned long long)b->id, (unsigned long long)b->size, RPC_REF_ALIGN);
    return ATTND_EINVAL;
  }
  t->present = 1;
  t->dtype = (attnd_dtype_t)ref->dtype;
  t->ndim = (int)ref->shape_count;
  t->data = b->base + ref->offset;
  t->nbytes = (size_t)n;
  b->refs++;
  q->bufs[q->nbufs++] = b;
  return 0;
}

/* The done signal's word (attnd.proto DoneSignal): 8 bytes at a multiple
 * of 8 inside a registered buffer of the connection's. */
static int resolve_done(attnd_rpc_req_t *q, const attnd_v1_DoneSignal *d, attnd_step_req_t *st) {
  rpc_buf_t *b;
  int rc = lookup(q, d->buffer, "done", &b);
  if (rc)
    return rc;
  if (d->offset % 8 != 0 || b->size < 8 || d->offset > b->size - 8) {
    snprintf(q->msg, sizeof(q->msg),
             "done: the 8-byte word at offset %llu does not fit buffer %016llx of %llu bytes "
             "(offsets are multiples of 8)",
             (unsigned long long)d->offset, (unsigned long long)b->id, (unsigned long long)b->size);
    return ATTND_EINVAL;
  }
  st->done = b->base + d->offset;
  st->done_value = d->value;
  b->refs++;
  q->bufs[q->nbufs++] = b;
  return 0;
}

int attnd_rpc_step_refs(attnd_rpc_req_t *q, const attnd_v1_StepRequest *m, attnd_step_req_t *st) {
  if (!m->has_q_ref && !m->has_k_ref && !m->has_v_ref && !m->has_out_ref && !m->has_lse_ref) {
    if (m->has_done) {
      snprintf(q->msg, sizeof(q->msg),
               "step: done is for steps by reference (q, k, v, out and lse as tensor refs); "
               "a step with bytes is complete when its response arrives");
      return ATTND_EINVAL;
    }
    return 0;
  }
  if (m->has_q || m->has_k || m->has_v) {
    snprintf(q->msg, sizeof(q->msg),
             "step: a step is all bytes or all refs: q, k and v as bytes beside tensor refs");
    return ATTND_EINVAL;
  }
  int rc = 0;
  if ((m->has_q_ref && (rc = resolve(q, &m->q_ref, "q", &st->q))) ||
      (m->has_k_ref && (rc = resolve(q, &m->k_ref, "k", &st->k))) ||
      (m->has_v_ref && (rc = resolve(q, &m->v_ref, "v", &st->v))) ||
      (m->has_out_ref && (rc = resolve(q, &m->out_ref, "out", &st->out))) ||
      (m->has_lse_ref && (rc = resolve(q, &m->lse_ref, "lse", &st->lse))) ||
      (m->has_done && (rc = resolve_done(q, &m->done, st))))
    return rc;
  st->device = 1;
  st->pinned = 0;
  return 0;
}

void attnd_rpc_bufs_drop(attnd_rpc_req_t *q) {
  for (int i = 0; i < q->nbufs; i++)
    buf_unref(q->conn->rpc, q->bufs[i]);
  q->nbufs = 0;
}

void attnd_rpc_bufs_conn_closed(attnd_rpc_conn_t *c) {
  ATTND_LIST_FOREACH(it, nx, &c->buffers) {
    buf_release(c, ATTND_LIST_DATA(it, rpc_buf_t, link));
  }
}

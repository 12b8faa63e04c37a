/* rpc.c: a request frame in, its call through the method table, its answer
 * out (rpc.h, internal.h; docs/protocol.md).
 *
 * Errors: anything that is not a well-formed Request at the outer level
 * answers Response{id 0, INVALID_ARGUMENT} and closes; a call that fails to
 * decode or fails a wire-level check answers INVALID_ARGUMENT (OUT_OF_RANGE
 * for a mask past max_context) with the request's id and a message saying
 * what was wrong, and the connection stays. Status codes come from
 * attnd_err_status() only. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "internal.h"

/* ---- the RPC state and connections ---- */

int attnd_rpc_init(attnd_rpc_t *r, uv_loop_t *loop, attnd_engine_t *engine,
                   const attnd_config_t *cfg, char *err, size_t errlen) {
  memset(r, 0, sizeof(*r));
  r->loop = loop;
  r->engine = engine;
  r->cfg = cfg;
  r->start_ns = attnd_rpc_now_ns();
  r->next_conn_id = 1;
  r->ref_min = (size_t)cfg->rpc_ref_min;
  r->own_uid = (uint64_t)geteuid();
  /* The epoch tells clients the daemon restarted; it must not repeat. */
  if (getrandom(&r->epoch, sizeof(r->epoch), 0) != (ssize_t)sizeof(r->epoch)) {
    snprintf(err, errlen, "getrandom: %s", strerror(errno));
    return ATTND_EIO;
  }
  if (r->epoch == 0)
    r->epoch = 1;
  if (cfg->token_file[0]) {
    int rc = attnd_rpc_load_tokens(r, cfg->token_file, err, errlen);
    if (rc) {
      attnd_rpc_free(r);
      return rc;
    }
  }
  if (attnd_rpc_trace_init(r, cfg->step_trace) != 0) {
    snprintf(err, errlen, "--step-trace: out of memory");
    attnd_rpc_free(r);
    return ATTND_ENOMEM;
  }
  return 0;
}

void attnd_rpc_free(attnd_rpc_t *r) {
  attnd_rpc_free_tokens(r);
  if (r->buffers.b)
    attnd_idmap_free(&r->buffers); /* empty: every connection released its own */
  attnd_rpc_trace_free(r);
}

void attnd_rpc_conn_init(attnd_rpc_conn_t *c, attnd_rpc_t *r, uint64_t identity, int need_hello) {
  memset(c, 0, sizeof(*c));
  c->rpc = r;
  c->id = r->next_conn_id++;
  c->identity = identity;
  c->need_hello = need_hello;
  c->is_unix = identity < (1ull << 32); /* rpc.h: only a Unix peer's uid is that small */
  attnd_list_init(&c->buffers);
}

/* The in-flight map goes with the last request of a closed connection. */
static void conn_let_go(attnd_rpc_conn_t *c) {
  if (c->closed && c->pending == 0 && c->inflight.b)
    attnd_idmap_free(&c->inflight);
}

int attnd_rpc_conn_closed(attnd_rpc_conn_t *c) {
  if (c->closed)
    return c->pending == 0;
  c->closed = 1;
  attnd_rpc_bufs_conn_closed(c);
  attnd_engine_conn_closed(c->rpc->engine, c->id);
  conn_let_go(c);
  return c->pending == 0;
}

uint32_t attnd_rpc_conn_id_probes(const attnd_rpc_conn_t *c, uint64_t id) {
  return c->inflight.b ? attnd_idmap_probes(&c->inflight, id) : 0;
}

/* ---- requests ---- */

/* A request frame goes back where it came from (rpc.h frame_pinned). */
static void frame_release(attnd_rpc_t *r, uint8_t *frame, int pinned) {
  if (r->engine)
    attnd_engine_host_free(r->engine, frame, pinned);
  else
    free(frame);
}

static attnd_rpc_req_t *req_new(attnd_rpc_conn_t *c, uint64_t id, int method, uint8_t *frame,
                                size_t len) {
  attnd_rpc_req_t *q = attnd_xcalloc(1, sizeof(*q));
  q->conn = c;
  q->id = id;
  q->method = method;
  q->frame = frame;
  q->frame_len = len;
  q->frame_pinned = c->frame_pinned;
  q->t0_ns = attnd_rpc_now_ns();
  q->t_read0_ns = c->frame_t0_ns ? c->frame_t0_ns : q->t0_ns;
  return q;
}

static void req_free(attnd_rpc_req_t *q) {
  attnd_rpc_bufs_drop(q);
  for (uint32_t i = 0; i < q->nitems; i++) {
    free((void *)q->items[i].tokens);
    free((void *)q->items[i].mask.intervals);
  }
  free(q->items);
  free(q->open_tokens.v);
  free(q->sessions);
  frame_release(q->conn->rpc, q->frame, q->frame_pinned);
  free(q);
}

void attnd_rpc_req_hold(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  q->linked = 1;
  /* Small bookkeeping: a daemon that cannot allocate a map node cannot
   * answer anyone (base.h, allocation). */
  if ((!c->inflight.b && attnd_idmap_init(&c->inflight) != 0) ||
      attnd_idmap_put(&c->inflight, q->id, q) != 0) {
    ATTND_LOGE("out_of_memory", "what=inflight_map conn=%llu", (unsigned long long)c->id);
    abort();
  }
  c->pending++;
  c->req_bytes += q->frame_len + 4;
  c->rpc->inflight++;
}

static void req_release(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  attnd_idmap_del(&c->inflight, q->id);
  c->pending--;
  c->req_bytes -= q->frame_len + 4;
  c->rpc->inflight--;
}

/* ---- a call's end ---- */

/* The step trace's kind of a step answered OK. */
static int trace_kind(const attnd_result_t *res) {
  if (res->out_rows == 0)
    return ATTND_TRACE_KV_ONLY;
  return res->decode ? ATTND_STEP_DECODE : ATTND_STEP_PREFILL;
}

/* The Response for a finished call; a step's large outputs may leave by
 * reference, and are then the transport's (res->out/lse set to NULL). */
static void answer(attnd_rpc_req_t *q, attnd_result_t *res, int code) {
  attnd_rpc_conn_t *c = q->conn;
  const attnd_rpc_method_t *m = &attnd_rpc_methods[q->method];
  attnd_v1_Response resp = attnd_v1_Response_init_zero;
  resp.id = q->id;
  resp.status.code = (attnd_v1_Status_Code)code;
  if (res->status)
    snprintf(resp.status.message, sizeof(resp.status.message), "%s",
             res->message[0] ? res->message : attnd_strerror(res->status));
  resp.timing.queued_us = res->queued_us;
  resp.timing.computing_us = res->computing_us;
  if (code == ATTND_STATUS_OK && m->encode) {
    resp.which_result = m->result;
    m->encode(q, res, &resp);
  }
  int out_taken = 0, lse_taken = 0;
  if (code == ATTND_STATUS_OK && q->method == ATTND_M_STEP)
    c->send_kind1 = 1 + trace_kind(res);
  if (code == ATTND_STATUS_OK && q->method == ATTND_M_STEP &&
      attnd_rpc_send_response_refs(q, &resp, &out_taken, &lse_taken)) {
    if (out_taken)
      res->out = NULL;
    if (lse_taken)
      res->lse = NULL;
    c->send_kind1 = 0;
    return;
  }
  attnd_rpc_send_response(c, &resp, q->t0_ns, q->close_after);
  c->send_kind1 = 0;
}

/* The step trace's sample of a step answered OK (rpc.h ATTND_PH_*). */
static void trace_step(attnd_rpc_req_t *q, const attnd_result_t *res, int kind, uint64_t t_ans,
                       uint64_t t_sent) {
  uint64_t ph[ATTND_PH_COUNT] = {0};
  uint32_t have = 0;
#define PH(p, v) (ph[p] = (v), have |= 1u << (p))
  PH(ATTND_PH_READ, (q->t0_ns - q->t_read0_ns) / 1000);
  if (q->t_decoded_ns)
    PH(ATTND_PH_DECODE, (q->t_decoded_ns - q->t0_ns) / 1000);
  if (q->t_called_ns)
    PH(ATTND_PH_ADMIT, (q->t_called_ns - q->t_decoded_ns) / 1000);
  PH(ATTND_PH_SCAN, res->scan_us);
  PH(ATTND_PH_QUEUE, res->queued_us);
  if (res->dev_timed) {
    PH(ATTND_PH_H2D, res->dev_us[0]);
    PH(ATTND_PH_KWRITE, res->dev_us[1]);
    PH(ATTND_PH_ATTEND, res->dev_us[2]);
    PH(ATTND_PH_D2H, res->dev_us[3]);
  }
  PH(ATTND_PH_COMPUTE, res->computing_us);
  PH(ATTND_PH_ENCODE, (t_sent - t_ans) / 1000);
  PH(ATTND_PH_TOTAL, (t_sent - q->t_read0_ns) / 1000);
#undef PH
  attnd_rpc_trace_step(q->conn->rpc, kind, ph, have);
}

void attnd_rpc_done(void *arg, attnd_result_t *res) {
  attnd_rpc_req_t *q = arg;
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_t *r = c->rpc;
  int code = attnd_err_status(res->status);
  attnd_rpc_count(r, q->method, code);
  ATTND_LOGD(
      "request", "conn=%llu id=%llu method=%s code=%s queued_us=%llu computing_us=%llu%s%s%s%s",
      (unsigned long long)c->id, (unsigned long long)q->id, attnd_rpc_method_name(q->method),
      attnd_rpc_code_name(code), (unsigned long long)res->queued_us,
      (unsigned long long)res->computing_us, c->closed ? " dropped=1" : "",
      res->status ? " msg=\"" : "", res->status ? res->message : "", res->status ? "\"" : "");
  if (code != ATTND_STATUS_OK) {
    /* Failures show at the default level, rate-limited per (method, code)
     * (docs/operations.md section 6). */
    char label[64], msg[300];
    snprintf(label, sizeof(label), "method=%s code=%s", attnd_rpc_method_name(q->method),
             attnd_rpc_code_name(code));
    attnd_log_escape(msg, sizeof(msg),
                     res->message[0] ? res->message : attnd_strerror(res->status));
    attnd_log_limited(attnd_status_log_level(code),
                      (unsigned)(q->method * ATTND_STATUS_COUNT + code), "request_failed", label,
                      "conn=%llu id=%llu msg=\"%s\"", (unsigned long long)c->id,
                      (unsigned long long)q->id, msg);
  }
  /* The engine tells a step's kind, whichever connection made its plan. */
  if (code == ATTND_STATUS_OK && q->method == ATTND_M_STEP) {
    const int kind = res->decode ? ATTND_STEP_DECODE : ATTND_STEP_PREFILL;
    attnd_hist_add(&r->counters.step_latency[kind], (double)(attnd_rpc_now_ns() - q->t0_ns) / 1e3);
    attnd_hist_add(&r->counters.step_queue[kind], (double)res->queued_us);
  }
  if (q->close_after)
    c->ending = 1; /* this answer closes the connection: nothing later is a request */
  if (c->calling == q)
    c->calling = NULL; /* answered inside its engine call */
  const int traced = r->trace && code == ATTND_STATUS_OK && q->method == ATTND_M_STEP;
  const uint64_t t_ans = traced ? attnd_rpc_now_ns() : 0;
  if (!c->closed)
    answer(q, res, code);
  if (traced && !c->closed)
    trace_step(q, res, trace_kind(res), t_ans, attnd_rpc_now_ns());
  if (r->engine)
    attnd_engine_host_free(r->engine, res->out, res->out_pinned);
  else
    free(res->out);
  free(res->lse);
  res->out = NULL;
  res->lse = NULL;
  int linked = q->linked;
  if (linked)
    req_release(q);
  req_free(q);
  if (!linked)
    return;
  /* The connection is ending: its own answer goes after every call's. */
  if (!c->closed && c->end_deferred && c->pending == 0) {
    c->end_deferred = 0;
    attnd_rpc_send_error(c, 0, c->end_err, c->end_msg, 1);
  }
  if (c->closed) {
    conn_let_go(c);
    if (c->pending == 0 && c->released)
      c->released(c);
  } else if (c->progress) {
    c->progress(c);
  }
  if (r->draining && r->inflight == 0 && r->idle_cb)
    r->idle_cb(r->idle_arg);
}

void attnd_rpc_fail(attnd_rpc_req_t *q, int err, const char *fmt, ...) {
  attnd_result_t res;
  memset(&res, 0, sizeof(res));
  res.status = err;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(res.message, sizeof(res.message), fmt, ap);
  va_end(ap);
  attnd_rpc_done(q, &res);
}

/* ---- a frame in ---- */

/* The outer Request, walked by hand (decode.c says why): its id and the
 * call's tag and bytes, in any order, the last call winning as in protobuf.
 * 0, or -1 when the frame is not a Request. More than REQUEST_MAX_FIELDS
 * top-level fields is not one either: the walk must not cost a field per
 * few bytes of a frame of junk. */
#define REQUEST_MAX_FIELDS 64
static int walk_request(const uint8_t *frame, size_t len, uint64_t *id, uint32_t *call_tag,
                        const uint8_t **call_ptr, uint32_t *call_len) {
  pb_istream_t s = pb_istream_from_buffer(frame, len);
  *id = 0;
  *call_tag = 0;
  *call_ptr = NULL;
  *call_len = 0;
  for (int nfields = 0; s.bytes_left; nfields++) {
    if (nfields == REQUEST_MAX_FIELDS)
      return -1;
    pb_wire_type_t wt;
    uint32_t tag;
    bool eof;
    if (!pb_decode_tag(&s, &wt, &tag, &eof))
      return -1;
    if (tag == attnd_v1_Request_id_tag) {
      if (wt != PB_WT_VARINT || !pb_decode_varint(&s, id))
        return -1;
    } else if (tag >= attnd_v1_Request_hello_tag && tag <= attnd_v1_Request_release_buffer_tag) {
      if (wt != PB_WT_STRING || !pb_decode_varint32(&s, call_len) || *call_len > s.bytes_left)
        return -1;
      *call_tag = tag;
      *call_ptr = s.state;
      if (!pb_read(&s, NULL, *call_len))
        return -1;
    } else if (!pb_skip_field(&s, wt)) {
      return -1;
    }
  }
  return 0;
}

/* What can refuse a call before its message is decoded: 0, or answered. */
static int refuse_early(attnd_rpc_req_t *q, uint32_t call_tag) {
  attnd_rpc_conn_t *c = q->conn;
  const attnd_rpc_method_t *m = &attnd_rpc_methods[q->method];
  if (c->need_hello && !(m->flags & RPC_M_NO_HELLO)) {
    q->close_after = 1;
    attnd_rpc_fail(q, ATTND_EUNAUTH, "this connection must send Hello{token} first");
    return 1;
  }
  if (!call_tag) {
    attnd_rpc_fail(q, ATTND_ENOTIMPL, "missing or unknown call");
    return 1;
  }
  if (c->inflight.b && attnd_idmap_get(&c->inflight, q->id)) {
    attnd_rpc_fail(q, ATTND_EINVAL, "id %llu is already in flight on this connection",
                   (unsigned long long)q->id);
    return 1;
  }
  if (c->rpc->draining && !(m->flags & RPC_M_DRAINING)) {
    attnd_rpc_fail(q, ATTND_EUNAVAIL, "the daemon is draining (shutting down)");
    return 1;
  }
  if ((m->flags & RPC_M_OPERATOR) && !attnd_rpc_conn_operator(c)) {
    attnd_rpc_fail(q, ATTND_EPERM,
                   "%s changes daemon-wide state: only an operator may call it (the daemon's "
                   "uid or root on the Unix socket, or an operator token)",
                   m->name);
    return 1;
  }
  return 0;
}

void attnd_rpc_conn_end(attnd_rpc_conn_t *c, int err, const char *msg) {
  if (c->ending || c->closed)
    return;
  c->ending = 1;
  if (c->pending == 0) {
    attnd_rpc_send_error(c, 0, err, msg, 1);
    return;
  }
  c->end_deferred = 1;
  c->end_err = err;
  snprintf(c->end_msg, sizeof(c->end_msg), "%s", msg ? msg : "");
}

void attnd_rpc_handle_frame(attnd_rpc_conn_t *c, uint8_t *frame, size_t len) {
  attnd_rpc_t *r = c->rpc;
  r->counters.bytes_in += len + 4;
  if (c->ending || c->closed) { /* not a request any more (attnd_rpc_conn_end) */
    frame_release(r, frame, c->frame_pinned);
    return;
  }
  uint64_t id;
  uint32_t call_tag, call_len;
  const uint8_t *call_ptr;
  if (walk_request(frame, len, &id, &call_tag, &call_ptr, &call_len) != 0) {
    frame_release(r, frame, c->frame_pinned);
    ATTND_LOGI("bad_frame", "conn=%llu reason=unparsable len=%zu", (unsigned long long)c->id, len);
    attnd_rpc_frame_error(c, ATTND_EINVAL, "frame is not a valid Request");
    return;
  }
  int method = call_tag ? (int)call_tag - 1 : ATTND_M_UNKNOWN;
  attnd_rpc_req_t *q = req_new(c, id, method, frame, len);
  r->counters.requests[method]++;
  if (refuse_early(q, call_tag))
    return;
  const attnd_rpc_method_t *m = &attnd_rpc_methods[method];
  int rc = attnd_rpc_fields_check(q, call_tag, call_ptr, call_len);
  if (rc) {
    char msg[sizeof(q->msg)];
    snprintf(msg, sizeof(msg), "%s", q->msg);
    attnd_rpc_fail(q, rc, "%s", msg);
    return;
  }
  pb_istream_t cs = pb_istream_from_buffer(call_ptr, call_len);
  rc = m->decode(q, &cs);
  if (rc) {
    char msg[sizeof(q->msg)];
    snprintf(msg, sizeof(msg), "%s", q->msg);
    attnd_rpc_fail(q, rc, "%s", msg);
    return;
  }
  if (!r->trace) {
    m->call(q);
    return;
  }
  q->t_decoded_ns = attnd_rpc_now_ns();
  c->calling = q;
  m->call(q);
  if (c->calling == q) /* still in flight: q is alive */
    q->t_called_ns = attnd_rpc_now_ns();
  c->calling = NULL;
}

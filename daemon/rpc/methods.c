/* methods.c: the method table (internal.h; docs/protocol.md): one row per
 * Request.call member, saying how its message is decoded into the engine's
 * native request, what runs it, and how its result becomes the Response's,
 * as in redis's command table. rpc.c does the rest the same way for every
 * method: counting, answering, timing, the connection's bookkeeping. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* ---- sessions ---- */

static int decode_open(attnd_rpc_req_t *q, pb_istream_t *s) {
  const attnd_config_t *cfg = q->conn->rpc->cfg;
  /* A prompt longer than max_context can never be a session's: refused
   * from its length on the wire, before its ids are decoded. */
  q->open_tokens.max = (uint32_t)cfg->max_context;
  q->m.open.tokens.funcs.decode = attnd_rpc_dec_u32_cb;
  q->m.open.tokens.arg = &q->open_tokens;
  int rc = attnd_rpc_pb_decode(q, s, attnd_v1_OpenSessionRequest_fields, &q->m.open);
  if (rc && q->open_tokens.over) {
    snprintf(q->msg, sizeof(q->msg), "open_session: more than max_context %d token ids",
             cfg->max_context);
    return ATTND_EINVAL;
  }
  return rc;
}

static void call_open(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_req_hold(q);
  attnd_engine_open_session_at(c->rpc->engine, c->identity, c->id, q->m.open.base, q->open_tokens.v,
                               q->open_tokens.n, q->m.open.salt.bytes, q->m.open.salt.size,
                               attnd_rpc_done, q);
}

static void encode_open(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp) {
  resp->result.open_session.session = res->session;
  resp->result.open_session.cached_len = res->cached_len;
  resp->result.open_session.base = res->base;
}

static int decode_close(attnd_rpc_req_t *q, pb_istream_t *s) {
  return attnd_rpc_pb_decode(q, s, attnd_v1_CloseSessionRequest_fields, &q->m.close);
}

static void call_close(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_req_hold(q);
  attnd_engine_close_session(c->rpc->engine, c->identity, c->id, q->m.close.session, attnd_rpc_done,
                             q);
}

static int decode_fork(attnd_rpc_req_t *q, pb_istream_t *s) {
  return attnd_rpc_pb_decode(q, s, attnd_v1_ForkRequest_fields, &q->m.fork);
}

static void call_fork(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_req_hold(q);
  attnd_engine_fork(c->rpc->engine, c->identity, c->id, q->m.fork.session, attnd_rpc_done, q);
}

static void encode_fork(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp) {
  resp->result.fork.session = res->session;
}

static int decode_truncate(attnd_rpc_req_t *q, pb_istream_t *s) {
  return attnd_rpc_pb_decode(q, s, attnd_v1_TruncateRequest_fields, &q->m.truncate);
}

static void call_truncate(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_req_hold(q);
  attnd_engine_truncate(c->rpc->engine, c->identity, c->id, q->m.truncate.session,
                        q->m.truncate.len, attnd_rpc_done, q);
}

static void encode_empty(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp) {}

/* ---- plans and steps ---- */

static int decode_plan(attnd_rpc_req_t *q, pb_istream_t *s) {
  q->m.plan.items.funcs.decode = attnd_rpc_dec_item_cb;
  q->m.plan.items.arg = q;
  int rc = attnd_rpc_pb_decode(q, s, attnd_v1_PlanRequest_fields, &q->m.plan);
  return rc ? rc : q->decode_failed;
}

static void call_plan(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_req_hold(q);
  attnd_engine_plan(c->rpc->engine, c->identity, c->id, q->items, q->nitems, attnd_rpc_done, q);
}

static void encode_plan(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp) {
  resp->result.plan.plan = res->plan;
}

static int decode_step(attnd_rpc_req_t *q, pb_istream_t *s) {
  attnd_v1_StepRequest *m = &q->m.step;
  attnd_step_req_t *st = &q->step;
  m->items.funcs.decode = attnd_rpc_dec_item_cb;
  m->items.arg = q;
  attnd_rpc_set_tensor_cb(&m->q, &st->q);
  attnd_rpc_set_tensor_cb(&m->k, &st->k);
  attnd_rpc_set_tensor_cb(&m->v, &st->v);
  int rc = attnd_rpc_pb_decode(q, s, attnd_v1_StepRequest_fields, m);
  if (rc || (rc = q->decode_failed))
    return rc;
  if (attnd_rpc_tensor_finish(&st->q, m->has_q, &m->q, "q", q->msg, sizeof(q->msg)) ||
      attnd_rpc_tensor_finish(&st->k, m->has_k, &m->k, "k", q->msg, sizeof(q->msg)) ||
      attnd_rpc_tensor_finish(&st->v, m->has_v, &m->v, "v", q->msg, sizeof(q->msg)))
    return ATTND_EINVAL;
  st->pinned = q->frame_pinned; /* q, k and v point into the frame (decode.c) */
  if ((rc = attnd_rpc_step_refs(q, m, st))) /* or into registered device buffers */
    return rc;
  if (m->plan != 0 && q->nitems != 0) {
    snprintf(q->msg, sizeof(q->msg), "step: names plan %llu and carries %u inline items; give one",
             (unsigned long long)m->plan, q->nitems);
    return ATTND_EINVAL;
  }
  st->layer = m->layer;
  st->plan = m->plan;
  st->items = q->items;
  st->nitems = q->nitems;
  st->want_lse = m->want_lse;
  st->fp32_out = m->fp32_out;
  return 0;
}

static void call_step(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_req_hold(q);
  attnd_engine_step(c->rpc->engine, c->identity, c->id, &q->step, attnd_rpc_done, q);
}

/* out [Tq, q_heads, head_dim] and lse [Tq, q_heads], written from the
 * engine's buffers (q->out, q->lse; rpc.c may send them by reference). */
static void encode_step(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp) {
  const attnd_config_t *cfg = q->conn->rpc->cfg;
  attnd_v1_StepResponse *sr = &resp->result.step;
  if (res->out) {
    sr->has_out = true;
    sr->out.dtype = (attnd_v1_DType)res->out_dtype;
    sr->out.shape_count = 3;
    sr->out.shape[0] = res->out_rows;
    sr->out.shape[1] = (uint32_t)cfg->shape.q_heads;
    sr->out.shape[2] = (uint32_t)cfg->shape.head_dim;
    q->out = (attnd_rpc_bytes_t){res->out, res->out_bytes};
    q->out_pinned = res->out_pinned;
    sr->out.data.funcs.encode = attnd_rpc_enc_bytes_cb;
    sr->out.data.arg = &q->out;
  }
  if (res->lse) {
    sr->has_lse = true;
    sr->lse.dtype = attnd_v1_DType_DTYPE_FP32;
    sr->lse.shape_count = 2;
    sr->lse.shape[0] = res->out_rows;
    sr->lse.shape[1] = (uint32_t)cfg->shape.q_heads;
    q->lse = (attnd_rpc_bytes_t){res->lse, res->lse_bytes};
    sr->lse.data.funcs.encode = attnd_rpc_enc_bytes_cb;
    sr->lse.data.arg = &q->lse;
  }
}

/* ---- scales ---- */

static int decode_scales(attnd_rpc_req_t *q, pb_istream_t *s) {
  attnd_v1_SetScalesRequest *m = &q->m.scales;
  attnd_scales_req_t *sc = &q->scales;
  attnd_rpc_set_tensor_cb(&m->k_scale, &sc->k_scale);
  attnd_rpc_set_tensor_cb(&m->v_scale, &sc->v_scale);
  attnd_rpc_set_tensor_cb(&m->k_zero, &sc->k_zero);
  attnd_rpc_set_tensor_cb(&m->v_zero, &sc->v_zero);
  int rc = attnd_rpc_pb_decode(q, s, attnd_v1_SetScalesRequest_fields, m);
  if (rc)
    return rc;
  char *msg = q->msg;
  size_t cap = sizeof(q->msg);
  if (attnd_rpc_tensor_finish(&sc->k_scale, m->has_k_scale, &m->k_scale, "k_scale", msg, cap) ||
      attnd_rpc_tensor_finish(&sc->v_scale, m->has_v_scale, &m->v_scale, "v_scale", msg, cap) ||
      attnd_rpc_tensor_finish(&sc->k_zero, m->has_k_zero, &m->k_zero, "k_zero", msg, cap) ||
      attnd_rpc_tensor_finish(&sc->v_zero, m->has_v_zero, &m->v_zero, "v_zero", msg, cap))
    return ATTND_EINVAL;
  sc->layer = m->layer;
  sc->drop_cached_kv = m->drop_cached_kv;
  return 0;
}

static void call_scales(attnd_rpc_req_t *q) {
  attnd_rpc_req_hold(q);
  attnd_engine_set_scales(q->conn->rpc->engine, &q->scales, attnd_rpc_done, q);
}

static void encode_scales(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp) {
  resp->result.set_scales.version = res->version;
}

/* ---- sinks ---- */

static int decode_sinks(attnd_rpc_req_t *q, pb_istream_t *s) {
  attnd_v1_SetSinksRequest *m = &q->m.sinks;
  attnd_sinks_req_t *sk = &q->sinks;
  attnd_rpc_set_tensor_cb(&m->sinks, &sk->sinks);
  int rc = attnd_rpc_pb_decode(q, s, attnd_v1_SetSinksRequest_fields, m);
  if (rc)
    return rc;
  if (attnd_rpc_tensor_finish(&sk->sinks, m->has_sinks, &m->sinks, "sinks", q->msg, sizeof(q->msg)))
    return ATTND_EINVAL;
  sk->layer = m->layer;
  return 0;
}

static void call_sinks(attnd_rpc_req_t *q) {
  attnd_rpc_req_hold(q);
  attnd_engine_set_sinks(q->conn->rpc->engine, &q->sinks, attnd_rpc_done, q);
}

static void encode_sinks(attnd_rpc_req_t *q, const attnd_result_t *res, attnd_v1_Response *resp) {
  resp->result.set_sinks.version = res->version;
}

/* ---- the table ---- */

#define ROW(m, name, tag, flags, dec, call, enc)                                                   \
  [m] = {name, attnd_v1_Response_##tag##_tag, flags, dec, call, enc}

const attnd_rpc_method_t attnd_rpc_methods[ATTND_M_COUNT] = {
    [ATTND_M_UNKNOWN] = {"unknown", 0, 0, NULL, NULL, NULL},
    ROW(ATTND_M_HELLO, "hello", hello, RPC_M_DRAINING | RPC_M_NO_HELLO, attnd_rpc_decode_hello,
        attnd_rpc_call_hello, encode_empty),
    ROW(ATTND_M_HEALTH, "health", health, RPC_M_DRAINING, attnd_rpc_decode_none,
        attnd_rpc_call_health, attnd_rpc_encode_health),
    ROW(ATTND_M_STATS, "stats", stats, RPC_M_DRAINING, attnd_rpc_decode_none, attnd_rpc_call_stats,
        attnd_rpc_encode_stats),
    ROW(ATTND_M_OPEN_SESSION, "open_session", open_session, 0, decode_open, call_open, encode_open),
    ROW(ATTND_M_CLOSE_SESSION, "close_session", close_session, 0, decode_close, call_close,
        encode_empty),
    ROW(ATTND_M_FORK, "fork", fork, 0, decode_fork, call_fork, encode_fork),
    ROW(ATTND_M_TRUNCATE, "truncate", truncate, 0, decode_truncate, call_truncate, encode_empty),
    ROW(ATTND_M_PLAN, "plan", plan, 0, decode_plan, call_plan, encode_plan),
    ROW(ATTND_M_STEP, "step", step, 0, decode_step, call_step, encode_step),
    ROW(ATTND_M_SET_SCALES, "set_scales", set_scales, RPC_M_OPERATOR, decode_scales, call_scales,
        encode_scales),
    ROW(ATTND_M_LIST_SESSIONS, "list_sessions", list_sessions, 0, attnd_rpc_decode_none,
        attnd_rpc_call_list_sessions, attnd_rpc_encode_list_sessions),
    ROW(ATTND_M_SET_SINKS, "set_sinks", set_sinks, RPC_M_OPERATOR, decode_sinks, call_sinks,
        encode_sinks),
    ROW(ATTND_M_REGISTER_BUFFER, "register_buffer", register_buffer, 0, attnd_rpc_decode_register,
        attnd_rpc_call_register, attnd_rpc_encode_register),
    ROW(ATTND_M_RELEASE_BUFFER, "release_buffer", release_buffer, 0, attnd_rpc_decode_release,
        attnd_rpc_call_release, encode_empty),
};

const char *attnd_rpc_method_name(int m) {
  return (m >= 0 && m < ATTND_M_COUNT) ? attnd_rpc_methods[m].name : attnd_rpc_methods[0].name;
}

/* Status code names come from the proto (nanopb's enum_to_string), so they
 * cannot drift from attnd.proto. */
const char *attnd_rpc_code_name(int code) {
  return attnd_v1_Status_Code_name((attnd_v1_Status_Code)code);
}

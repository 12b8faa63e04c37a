/* encode.c: a Response out (internal.h): the frame header, the message,
 * epoch and timings; either one buffer for the transport's send, or, for a
 * step's large tensors, pieces for its sendv so that they are written to the
 * socket from the engine's buffers without a copy on the loop thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void attnd_rpc_frame_header(uint8_t out[4], uint32_t n) {
  out[0] = (uint8_t)(n >> 24);
  out[1] = (uint8_t)(n >> 16);
  out[2] = (uint8_t)(n >> 8);
  out[3] = (uint8_t)n;
}

bool attnd_rpc_enc_bytes_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg) {
  const attnd_rpc_bytes_t *b = *arg;
  return pb_encode_tag_for_field(s, f) && pb_encode_string(s, b->p, b->n);
}

void attnd_rpc_count(attnd_rpc_t *r, int method, int code) {
  if (method < 0 || method >= ATTND_M_COUNT)
    method = ATTND_M_UNKNOWN;
  attnd_status_count(&r->counters.answers[method], code);
}

/* A response going out as pieces: the bytes nanopb writes are copied into one
 * buffer, except the registered tensors, which become pieces of their own. */
typedef struct {
  attnd_rpc_seg_t segs[8];
  int n;
  uint8_t *buf; /* copied bytes: header, fields, protobuf framing */
  size_t len, cap, seg_start;
  const void *refp[2];
  size_t refn[2];
  void *ref_free[2];
  int ref_pinned[2];
  int nref;
} scatter_t;

static void scatter_cut(scatter_t *sc) {
  if (sc->len > sc->seg_start) {
    /* The first copied piece owns the buffer; the others point into it. */
    sc->segs[sc->n++] = (attnd_rpc_seg_t){sc->buf + sc->seg_start, sc->len - sc->seg_start,
                                          sc->seg_start == 0 ? sc->buf : NULL, 0};
    sc->seg_start = sc->len;
  }
}

static bool scatter_write(pb_ostream_t *s, const pb_byte_t *b, size_t count) {
  scatter_t *sc = s->state;
  for (int i = 0; i < sc->nref; i++)
    if (sc->ref_free[i] && b == sc->refp[i] && count == sc->refn[i]) {
      scatter_cut(sc);
      sc->segs[sc->n++] = (attnd_rpc_seg_t){b, count, sc->ref_free[i], sc->ref_pinned[i]};
      sc->ref_free[i] = NULL;
      return true;
    }
  if (sc->len + count > sc->cap || sc->n >= 6)
    return false;
  memcpy(sc->buf + sc->len, b, count);
  sc->len += count;
  return true;
}

/* Sends resp with its large tensors as pieces of their own (see
 * attnd_rpc_send_response_refs). 1 when sent: the registered tensors whose
 * ref_free is now NULL belong to the transport; 0 when nothing was sent. */
static int send_scattered(attnd_rpc_conn_t *c, attnd_v1_Response *resp, uint64_t t0_ns,
                          scatter_t *sc) {
  attnd_rpc_t *r = c->rpc;
  resp->epoch = r->epoch;
  resp->has_status = true;
  resp->has_timing = true;
  if (t0_ns)
    resp->timing.total_us = (attnd_rpc_now_ns() - t0_ns) / 1000;
  size_t sz = 0, refs = 0;
  for (int i = 0; i < sc->nref; i++)
    refs += sc->refn[i];
  if (!pb_get_encoded_size(&sz, attnd_v1_Response_fields, resp) || sz > UINT32_MAX - 4 || sz < refs)
    return 0;
  sc->cap = sz + 4 - refs;
  sc->buf = malloc(sc->cap);
  if (!sc->buf)
    return 0;
  attnd_rpc_frame_header(sc->buf, (uint32_t)sz);
  sc->len = 4;
  pb_ostream_t os = {scatter_write, sc, SIZE_MAX, 0, NULL};
  if (pb_encode(&os, attnd_v1_Response_fields, resp) && sc->len == sc->cap) {
    scatter_cut(sc);
    r->counters.bytes_out += sz + 4;
    c->sendv(c, sc->segs, sc->n, 0);
    return 1;
  }
  /* Not expected; the tensors are still the caller's. */
  free(sc->buf);
  ATTND_LOGW("encode_scatter_failed", "conn=%llu id=%llu", (unsigned long long)c->id,
             (unsigned long long)resp->id);
  return 0;
}

int attnd_rpc_send_response_refs(attnd_rpc_req_t *q, attnd_v1_Response *resp, int *out_taken,
                                 int *lse_taken) {
  attnd_rpc_conn_t *c = q->conn;
  size_t min = c->rpc->ref_min;
  scatter_t sc;
  memset(&sc, 0, sizeof(sc));
  *out_taken = *lse_taken = 0;
  if (!c->sendv)
    return 0;
  int iout = -1, ilse = -1;
  if (q->out.p && q->out.n >= min) {
    iout = sc.nref;
    sc.refp[sc.nref] = q->out.p;
    sc.refn[sc.nref] = q->out.n;
    sc.ref_pinned[sc.nref] = q->out_pinned;
    sc.ref_free[sc.nref++] = (void *)q->out.p;
  }
  if (q->lse.p && q->lse.n >= min) {
    ilse = sc.nref;
    sc.refp[sc.nref] = q->lse.p;
    sc.refn[sc.nref] = q->lse.n;
    sc.ref_free[sc.nref++] = (void *)q->lse.p;
  }
  if (sc.nref == 0 || !send_scattered(c, resp, q->t0_ns, &sc))
    return 0;
  /* A registered tensor nanopb did not write in one piece is still ours. */
  *out_taken = iout >= 0 && !sc.ref_free[iout];
  *lse_taken = ilse >= 0 && !sc.ref_free[ilse];
  return 1;
}

void attnd_rpc_send_response(attnd_rpc_conn_t *c, attnd_v1_Response *resp, uint64_t t0_ns,
                             int close_after) {
  attnd_rpc_t *r = c->rpc;
  resp->epoch = r->epoch;
  resp->has_status = true;
  resp->has_timing = true;
  if (t0_ns)
    resp->timing.total_us = (attnd_rpc_now_ns() - t0_ns) / 1000;
  size_t sz = 0;
  if (!pb_get_encoded_size(&sz, attnd_v1_Response_fields, resp) || sz > UINT32_MAX - 4) {
    ATTND_LOGE("encode_failed", "conn=%llu id=%llu", (unsigned long long)c->id,
               (unsigned long long)resp->id);
    /* Answer anyway: no request may be left without a response. */
    attnd_v1_Response e = attnd_v1_Response_init_zero;
    e.id = resp->id;
    e.has_status = true;
    e.status.code = (attnd_v1_Status_Code)attnd_err_status(ATTND_EINTERNAL);
    snprintf(e.status.message, sizeof(e.status.message), "response could not be encoded");
    e.epoch = r->epoch;
    attnd_rpc_send_response(c, &e, 0, close_after);
    return;
  }
  uint8_t *buf = attnd_xmalloc(sz + 4);
  pb_ostream_t os = pb_ostream_from_buffer(buf + 4, sz);
  if (!pb_encode(&os, attnd_v1_Response_fields, resp)) {
    free(buf);
    ATTND_LOGE("encode_failed", "conn=%llu err=\"%s\"", (unsigned long long)c->id,
               PB_GET_ERROR(&os));
    return;
  }
  attnd_rpc_frame_header(buf, (uint32_t)sz);
  r->counters.bytes_out += sz + 4;
  c->send(c, buf, sz + 4, close_after);
}

void attnd_rpc_send_error(attnd_rpc_conn_t *c, uint64_t id, int err, const char *msg,
                          int close_after) {
  attnd_v1_Response resp = attnd_v1_Response_init_zero;
  resp.id = id;
  resp.status.code = (attnd_v1_Status_Code)attnd_err_status(err);
  if (msg)
    snprintf(resp.status.message, sizeof(resp.status.message), "%s", msg);
  attnd_rpc_send_response(c, &resp, 0, close_after);
}

void attnd_rpc_frame_error(attnd_rpc_conn_t *c, int err, const char *msg) {
  attnd_rpc_t *r = c->rpc;
  r->counters.requests[ATTND_M_UNKNOWN]++;
  r->counters.frame_errors++;
  attnd_rpc_count(r, ATTND_M_UNKNOWN, attnd_err_status(err));
  attnd_rpc_conn_end(c, err, msg);
}

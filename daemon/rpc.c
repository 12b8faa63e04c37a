/* rpc.c: see rpc.h.
 *
 * Decoding. Request.call is a oneof whose members carry callback fields
 * (items, tokens, tensor data). nanopb clears a oneof member before decoding
 * it, which would wipe callbacks set in advance, so the outer Request is
 * walked by hand (id and the call's tag and bytes, in any order, last call
 * wins as in protobuf) and the call's own message is then decoded with
 * pb_decode() into a struct whose callbacks are already set. Tensor data
 * callbacks record a pointer into the frame (the stream is a buffer stream, so
 * stream->state is the current position) and skip the bytes: no copy.
 *
 * Errors: anything that is not a well-formed Request at the outer level
 * answers Response{id 0, INVALID_ARGUMENT} and closes; a call that fails to
 * decode or fails a wire-level check answers INVALID_ARGUMENT with the
 * request's id and a message saying what was wrong, and the connection stays.
 * Status codes come from attnd_err_status() only. */
#include "rpc.h"

#include <errno.h>
#include <pb_decode.h>
#include <pb_encode.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <xxhash.h>

#include "attnd.pb.h"
#include "base.h"
#include "frame.h"

#define TOKEN_MAX 256

typedef struct {
  uint32_t *v;
  uint32_t n, cap;
} u32vec_t;

struct attnd_rpc_req_s {
  attnd_rpc_conn_t *conn;
  attnd_rpc_req_t *next, *prev;
  uint64_t id;
  int method;
  uint8_t *frame;
  size_t frame_len;
  uint64_t t0_ns; /* frame decoded */
  int step_kind;  /* ATTND_STEP_*, or -1 when not known */
  /* Decoded call; tensor and mask data point into frame. */
  attnd_item_t *items;
  uint32_t nitems, cap_items;
  u32vec_t open_tokens;
  attnd_step_req_t step;
  attnd_scales_req_t scales;
  int decode_failed; /* a callback failed for a reason of ours: its ATTND_E* (msg set) */
  char msg[200];
};

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    ATTND_LOGE("oom", "bytes=%zu", n);
    abort();
  }
  return p;
}

static void *xrealloc(void *p, size_t n) {
  p = realloc(p, n ? n : 1);
  if (!p) {
    ATTND_LOGE("oom", "bytes=%zu", n);
    abort();
  }
  return p;
}

static uint64_t now_ns(void) {
  return uv_hrtime();
}

/* ---- tokens ------------------------------------------------------------- */

static int load_tokens(attnd_rpc_t *r, const char *path, char *err, size_t errlen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, errlen, "--token-file '%s': %s", path, strerror(errno));
    return ATTND_EIO;
  }
  char line[1024];
  int lineno = 0;
  while (fgets(line, sizeof(line), f)) {
    lineno++;
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ' ||
                 line[n - 1] == '\t'))
      line[--n] = 0;
    char *s = line;
    while (*s == ' ' || *s == '\t')
      s++;
    n = strlen(s);
    if (n == 0 || s[0] == '#')
      continue;
    if (n >= TOKEN_MAX) {
      /* The line number only: the token itself is never printed. */
      snprintf(err, errlen, "--token-file %s:%d: token longer than %d bytes", path, lineno,
               TOKEN_MAX - 1);
      fclose(f);
      return ATTND_EINVAL;
    }
    r->tokens = xrealloc(r->tokens, (r->ntokens + 1) * sizeof(char *));
    /* Zero-padded to TOKEN_MAX so comparisons always touch every byte. */
    char *t = calloc(1, TOKEN_MAX);
    if (!t)
      abort();
    memcpy(t, s, n);
    r->tokens[r->ntokens++] = t;
  }
  fclose(f);
  return 0;
}

int attnd_rpc_token_ok(const attnd_rpc_t *r, const char *token) {
  char pad[TOKEN_MAX];
  size_t tl = strnlen(token, TOKEN_MAX);
  if (tl == 0 || tl >= TOKEN_MAX)
    return 0;
  memset(pad, 0, sizeof(pad));
  memcpy(pad, token, tl);
  /* Constant time in the token's content: every byte of every accepted token
   * is compared, with no early exit. */
  unsigned ok = 0;
  for (size_t k = 0; k < r->ntokens; k++) {
    volatile unsigned char diff = 0;
    for (size_t i = 0; i < TOKEN_MAX; i++)
      diff |= (unsigned char)(pad[i] ^ r->tokens[k][i]);
    ok |= (unsigned)(diff == 0);
  }
  return ok != 0;
}

/* ---- init --------------------------------------------------------------- */

int attnd_rpc_init(attnd_rpc_t *r, uv_loop_t *loop, attnd_engine_t *engine,
                   const attnd_config_t *cfg, char *err, size_t errlen) {
  memset(r, 0, sizeof(*r));
  r->loop = loop;
  r->engine = engine;
  r->cfg = cfg;
  r->start_ns = now_ns();
  r->next_conn_id = 1;
  r->ref_min = (size_t)cfg->rpc_ref_min;
  /* The epoch tells clients the daemon restarted; it must not repeat. */
  if (getrandom(&r->epoch, sizeof(r->epoch), 0) != (ssize_t)sizeof(r->epoch)) {
    snprintf(err, errlen, "getrandom: %s", strerror(errno));
    return ATTND_EIO;
  }
  if (r->epoch == 0)
    r->epoch = 1;
  if (cfg->token_file[0]) {
    int rc = load_tokens(r, cfg->token_file, err, errlen);
    if (rc) {
      attnd_rpc_free(r);
      return rc;
    }
  }
  return 0;
}

void attnd_rpc_free(attnd_rpc_t *r) {
  for (size_t i = 0; i < r->ntokens; i++) {
    memset(r->tokens[i], 0, TOKEN_MAX);
    free(r->tokens[i]);
  }
  free(r->tokens);
  r->tokens = NULL;
  r->ntokens = 0;
}

void attnd_rpc_conn_init(attnd_rpc_conn_t *c, attnd_rpc_t *r, uint64_t identity, int need_hello) {
  memset(c, 0, sizeof(*c));
  c->rpc = r;
  c->id = r->next_conn_id++;
  c->identity = identity;
  c->need_hello = need_hello;
  c->plan_cap = (uint32_t)(r->cfg->max_plans > 0 ? r->cfg->max_plans : 64);
  c->plan_ids = calloc(c->plan_cap, sizeof(uint64_t));
  c->plan_decode = calloc(c->plan_cap, 1);
  if (!c->plan_ids || !c->plan_decode)
    abort();
}

/* ---- response encoding --------------------------------------------------- */

typedef struct {
  const void *p;
  size_t n;
} bytes_t;

static bool enc_bytes_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg) {
  const bytes_t *b = *arg;
  return pb_encode_tag_for_field(s, f) && pb_encode_string(s, b->p, b->n);
}

typedef struct {
  const attnd_session_info_t *v;
  uint32_t n;
} sessions_t;

static bool enc_sessions_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg) {
  const sessions_t *ss = *arg;
  for (uint32_t i = 0; i < ss->n; i++) {
    attnd_v1_SessionInfo si = attnd_v1_SessionInfo_init_zero;
    si.session = ss->v[i].session;
    si.len = ss->v[i].len;
    si.blocks = ss->v[i].blocks;
    si.idle_s = ss->v[i].idle_s;
    if (!pb_encode_tag_for_field(s, f) ||
        !pb_encode_submessage(s, attnd_v1_SessionInfo_fields, &si))
      return false;
  }
  return true;
}

static void count(attnd_rpc_t *r, int method, int code) {
  if (method < 0 || method >= ATTND_M_COUNT)
    method = ATTND_M_UNKNOWN;
  if (code < 0 || code >= ATTND_CODE_COUNT)
    code = ATTND_STATUS_INTERNAL;
  r->counters.by_code[method][code]++;
  if (code != ATTND_STATUS_OK)
    r->counters.errors[method]++;
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
  int nref;
} scatter_t;

static void scatter_cut(scatter_t *sc) {
  if (sc->len > sc->seg_start) {
    /* The first copied piece owns the buffer; the others point into it. */
    sc->segs[sc->n++] = (attnd_rpc_seg_t){sc->buf + sc->seg_start, sc->len - sc->seg_start,
                                           sc->seg_start == 0 ? sc->buf : NULL};
    sc->seg_start = sc->len;
  }
}

static bool scatter_write(pb_ostream_t *s, const pb_byte_t *b, size_t count) {
  scatter_t *sc = s->state;
  for (int i = 0; i < sc->nref; i++)
    if (sc->ref_free[i] && b == sc->refp[i] && count == sc->refn[i]) {
      scatter_cut(sc);
      sc->segs[sc->n++] = (attnd_rpc_seg_t){b, count, sc->ref_free[i]};
      sc->ref_free[i] = NULL;
      return true;
    }
  if (sc->len + count > sc->cap || sc->n >= 6)
    return false;
  memcpy(sc->buf + sc->len, b, count);
  sc->len += count;
  return true;
}

static void send_response(attnd_rpc_conn_t *c, attnd_v1_Response *resp, uint64_t t0_ns,
                          int close_after);

/* send_response for a step whose large tensors go out by reference through
 * the transport's sendv: no copy of them on the loop thread. 1 when sent: the
 * registered tensors whose ref_free is now NULL belong to the transport (the
 * caller takes them from the engine); 0 when nothing was sent. */
static int send_response_refs(attnd_rpc_conn_t *c, attnd_v1_Response *resp, uint64_t t0_ns,
                              scatter_t *sc) {
  attnd_rpc_t *r = c->rpc;
  resp->epoch = r->epoch;
  resp->has_status = true;
  resp->has_timing = true;
  if (t0_ns)
    resp->timing.total_us = (now_ns() - t0_ns) / 1000;
  size_t sz = 0, refs = 0;
  for (int i = 0; i < sc->nref; i++)
    refs += sc->refn[i];
  if (pb_get_encoded_size(&sz, attnd_v1_Response_fields, resp) && sz <= UINT32_MAX - 4 &&
      sz >= refs) {
    sc->cap = sz + 4 - refs;
    sc->buf = malloc(sc->cap);
    if (sc->buf) {
      attnd_frame_put_header(sc->buf, (uint32_t)sz);
      sc->len = 4;
      pb_ostream_t os = {scatter_write, sc, SIZE_MAX, 0, NULL};
      if (pb_encode(&os, attnd_v1_Response_fields, resp) && sc->len == sc->cap) {
        scatter_cut(sc);
        r->counters.bytes_out += sz + 4;
        c->sendv(c, sc->segs, sc->n, 0);
        return 1;
      }
      /* Not expected; the tensors still belong to the engine. */
      free(sc->buf);
      ATTND_LOGW("encode_scatter_failed", "conn=%llu id=%llu", (unsigned long long)c->id,
                 (unsigned long long)resp->id);
    }
  }
  return 0;
}

/* Encodes resp into a new frame and hands it to the transport. */
static void send_response(attnd_rpc_conn_t *c, attnd_v1_Response *resp, uint64_t t0_ns,
                          int close_after) {
  attnd_rpc_t *r = c->rpc;
  resp->epoch = r->epoch;
  resp->has_status = true;
  resp->has_timing = true;
  if (t0_ns)
    resp->timing.total_us = (now_ns() - t0_ns) / 1000;
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
    send_response(c, &e, 0, close_after);
    return;
  }
  uint8_t *buf = xmalloc(sz + 4);
  pb_ostream_t os = pb_ostream_from_buffer(buf + 4, sz);
  if (!pb_encode(&os, attnd_v1_Response_fields, resp)) {
    free(buf);
    ATTND_LOGE("encode_failed", "conn=%llu err=\"%s\"", (unsigned long long)c->id,
               PB_GET_ERROR(&os));
    return;
  }
  attnd_frame_put_header(buf, (uint32_t)sz);
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
  send_response(c, &resp, 0, close_after);
}

/* ---- decode callbacks ------------------------------------------------------ */

static bool dec_u32_cb(pb_istream_t *s, const pb_field_t *f, void **arg) {
  u32vec_t *v = *arg;
  uint32_t x;
  if (!pb_decode_varint32(s, &x))
    return false;
  if (v->n == v->cap) {
    v->cap = v->cap ? v->cap * 2 : 64;
    v->v = xrealloc(v->v, (size_t)v->cap * sizeof(uint32_t));
  }
  v->v[v->n++] = x;
  return true;
}

/* Zero copy: remember where the bytes are in the frame and skip them. */
static bool dec_tensor_data_cb(pb_istream_t *s, const pb_field_t *f, void **arg) {
  attnd_tensor_t *t = *arg;
  t->data = (uint8_t *)s->state;
  t->nbytes = s->bytes_left;
  return pb_read(s, NULL, s->bytes_left);
}

static void set_tensor_cb(attnd_v1_Tensor *pb, attnd_tensor_t *t) {
  pb->data.funcs.decode = dec_tensor_data_cb;
  pb->data.arg = t;
}

static size_t dtype_size(int dt) {
  switch (dt) {
  case attnd_v1_DType_DTYPE_BF16:
  case attnd_v1_DType_DTYPE_FP16:
    return 2;
  case attnd_v1_DType_DTYPE_FP32:
  case attnd_v1_DType_DTYPE_INT32:
    return 4;
  default:
    return 0;
  }
}

static const char *dtype_name(int dt) {
  switch (dt) {
  case attnd_v1_DType_DTYPE_BF16:
    return "BF16";
  case attnd_v1_DType_DTYPE_FP16:
    return "FP16";
  case attnd_v1_DType_DTYPE_FP32:
    return "FP32";
  case attnd_v1_DType_DTYPE_INT32:
    return "INT32";
  default:
    return "UNSPECIFIED";
  }
}

/* Fills t from the decoded message and checks what the wire alone can say:
 * a known dtype, 1 to 4 dims, and as many bytes as the shape needs. */
static int tensor_finish(attnd_tensor_t *t, bool has, const attnd_v1_Tensor *pb, const char *name,
                         char *msg, size_t cap) {
  uint8_t *data = t->data;
  size_t nbytes = t->nbytes;
  memset(t, 0, sizeof(*t));
  if (!has)
    return 0;
  t->present = 1;
  t->dtype = (attnd_dtype_t)pb->dtype;
  t->ndim = (int)pb->shape_count;
  t->data = data;
  t->nbytes = nbytes;
  size_t es = dtype_size(t->dtype);
  if (!es) {
    snprintf(msg, cap, "%s: dtype %d is not one of BF16, FP16, FP32, INT32", name, t->dtype);
    return ATTND_EINVAL;
  }
  if (t->ndim < 1) {
    snprintf(msg, cap, "%s: tensor has no shape", name);
    return ATTND_EINVAL;
  }
  uint64_t elems = 1;
  char dims[64];
  int dl = 0;
  for (int i = 0; i < t->ndim; i++) {
    t->shape[i] = pb->shape[i];
    /* 4 dims of < 2^32 each may overflow 64 bits: saturate before the
     * multiply (testing after it let a wrapped product such as
     * [2^31, 2^31, 2^31, 8] pass as 0 elements). */
    uint64_t d = pb->shape[i];
    if (elems > UINT64_MAX / 8 || (d && elems > (UINT64_MAX / 8) / d))
      elems = UINT64_MAX / 8 + 1;
    else
      elems *= d;
    dl += snprintf(dims + dl, sizeof(dims) - (size_t)dl, "%s%u", i ? ", " : "", pb->shape[i]);
  }
  if (elems > (UINT64_MAX / 8) || elems * es != (uint64_t)nbytes) {
    snprintf(msg, cap, "%s: shape [%s] of %s needs %llu bytes, data has %zu", name, dims,
             dtype_name(t->dtype), (unsigned long long)(elems * es), nbytes);
    return ATTND_EINVAL;
  }
  return 0;
}

/* An item's mask in the kernels' form (engine.h attnd_mask_t). A document
 * mask becomes intervals: the keys of a document are hidden from every row
 * after it (causal hides them from the rows before it). Interval arrays are
 * the request's own (aligned copies), freed with it. */
static int expand_mask(const attnd_config_t *cfg, attnd_item_t *x, uint32_t i, int kind,
                       const attnd_v1_Mask *m, const attnd_tensor_t *doc, const attnd_tensor_t *iv,
                       char *msg, size_t msglen) {
  uint64_t kv_len = (uint64_t)x->start + x->n;
  attnd_mask_t *mk = &x->mask;
  mk->causal = 1;
  switch (kind) {
  case attnd_v1_Mask_Kind_CAUSAL:
    mk->kind = ATTND_MASK_CAUSAL;
    return 0;
  case attnd_v1_Mask_Kind_FULL:
    mk->kind = ATTND_MASK_FULL;
    return 0;
  case attnd_v1_Mask_Kind_SLIDING_WINDOW:
    if (m->window == 0 || m->window > INT32_MAX) {
      snprintf(msg, msglen, "item %u: sliding window must be >= 1", i);
      return ATTND_EINVAL;
    }
    mk->kind = ATTND_MASK_SLIDING;
    mk->param = (int32_t)m->window;
    return 0;
  case attnd_v1_Mask_Kind_PREFIX_LM:
    mk->kind = ATTND_MASK_PREFIX_LM;
    mk->param = m->prefix_len > INT32_MAX ? INT32_MAX : (int32_t)m->prefix_len;
    return 0;
  case attnd_v1_Mask_Kind_DOCUMENT:
  case attnd_v1_Mask_Kind_CUSTOM:
    break;
  default:
    snprintf(msg, msglen, "item %u: unknown mask kind %d", i, kind);
    return ATTND_EINVAL;
  }
  /* Intervals are as long as the item's context: never past max_context,
   * so a small frame cannot make the daemon allocate gigabytes. */
  if (kv_len > (uint64_t)cfg->max_context) {
    snprintf(msg, msglen, "item %u: start+n %llu > max_context %d", i, (unsigned long long)kv_len,
             cfg->max_context);
    return ATTND_ERANGE;
  }
  mk->kind = ATTND_MASK_INTERVALS;
  mk->intervals_len = (uint32_t)kv_len;
  if (kind == attnd_v1_Mask_Kind_CUSTOM) {
    if (!iv->present || iv->dtype != ATTND_DT_INT32 || iv->ndim != 2 || iv->shape[0] != 4 ||
        iv->shape[1] != kv_len || iv->nbytes != 16 * kv_len || !iv->data) {
      snprintf(msg, msglen, "item %u: intervals must be INT32 [4, %llu]", i,
               (unsigned long long)kv_len);
      return ATTND_EINVAL;
    }
    int32_t *v = attnd_xmalloc(16 * kv_len);
    memcpy(v, iv->data, 16 * kv_len);
    mk->intervals = v;
    mk->causal = !m->bidirectional;
    return 0;
  }
  if (!doc->present || doc->dtype != ATTND_DT_INT32 || doc->ndim != 1 || doc->shape[0] == 0 ||
      doc->nbytes != (size_t)doc->shape[0] * 4 || !doc->data) {
    snprintf(msg, msglen, "item %u: doc_lengths must be INT32 [ndocs]", i);
    return ATTND_EINVAL;
  }
  int32_t *v = attnd_xcalloc(4 * kv_len, sizeof(int32_t));
  mk->intervals = v;
  int64_t pos = 0;
  for (uint32_t d = 0; d < doc->shape[0]; d++) {
    int32_t dl;
    memcpy(&dl, doc->data + 4 * (size_t)d, 4);
    if (dl < 0 || pos + dl > (int64_t)kv_len) {
      snprintf(msg, msglen, "item %u: doc lengths do not sum to kv_len %llu", i,
               (unsigned long long)kv_len);
      return ATTND_EINVAL;
    }
    for (int64_t j = pos; j < pos + dl; j++) {
      v[j] = (int32_t)(pos + dl);
      v[kv_len + j] = (int32_t)kv_len;
    }
    pos += dl;
  }
  if (pos != (int64_t)kv_len) {
    snprintf(msg, msglen, "item %u: doc lengths sum to %lld, not kv_len %llu", i, (long long)pos,
             (unsigned long long)kv_len);
    return ATTND_EINVAL;
  }
  return 0;
}

static bool dec_item_cb(pb_istream_t *s, const pb_field_t *f, void **arg) {
  attnd_rpc_req_t *q = *arg;
  attnd_v1_Item it = attnd_v1_Item_init_zero;
  u32vec_t tok = {0};
  attnd_tensor_t doc = {0}, iv = {0};
  it.tokens.funcs.decode = dec_u32_cb;
  it.tokens.arg = &tok;
  set_tensor_cb(&it.mask.doc_lengths, &doc);
  set_tensor_cb(&it.mask.intervals, &iv);
  if (!pb_decode(s, attnd_v1_Item_fields, &it)) {
    free(tok.v);
    return false;
  }
  if (q->nitems == q->cap_items) {
    q->cap_items = q->cap_items ? q->cap_items * 2 : 8;
    q->items = xrealloc(q->items, (size_t)q->cap_items * sizeof(attnd_item_t));
  }
  attnd_item_t *x = &q->items[q->nitems++];
  memset(x, 0, sizeof(*x));
  x->session = it.session;
  x->start = it.start;
  x->n = it.n;
  x->kv_only = it.kv_only;
  x->mask.kind = ATTND_MASK_CAUSAL;
  x->tokens = tok.v;
  x->ntokens = tok.n;
  char name[48];
  attnd_tensor_t docs = doc, ivs = iv;
  snprintf(name, sizeof(name), "item %u: mask doc_lengths", q->nitems - 1);
  if (!q->decode_failed && tensor_finish(&docs, it.has_mask && it.mask.has_doc_lengths,
                                         &it.mask.doc_lengths, name, q->msg, sizeof(q->msg)))
    q->decode_failed = ATTND_EINVAL;
  snprintf(name, sizeof(name), "item %u: mask intervals", q->nitems - 1);
  if (!q->decode_failed && tensor_finish(&ivs, it.has_mask && it.mask.has_intervals,
                                         &it.mask.intervals, name, q->msg, sizeof(q->msg)))
    q->decode_failed = ATTND_EINVAL;
  if (!q->decode_failed) {
    int rc = expand_mask(q->conn->rpc->cfg, x, q->nitems - 1, it.has_mask ? (int)it.mask.kind : 0,
                         &it.mask, &docs, &ivs, q->msg, sizeof(q->msg));
    if (rc)
      q->decode_failed = rc;
  }
  return true;
}

/* ---- requests ------------------------------------------------------------ */

static void req_free(attnd_rpc_req_t *q) {
  for (uint32_t i = 0; i < q->nitems; i++) {
    free((void *)q->items[i].tokens);
    free((void *)q->items[i].mask.intervals);
  }
  free(q->items);
  free(q->open_tokens.v);
  free(q->frame);
  free(q);
}

static void req_link(attnd_rpc_conn_t *c, attnd_rpc_req_t *q) {
  q->prev = NULL;
  q->next = c->reqs;
  if (c->reqs)
    c->reqs->prev = q;
  c->reqs = q;
  c->pending++;
  c->req_bytes += q->frame_len + 4;
  c->rpc->inflight++;
}

static void req_unlink(attnd_rpc_conn_t *c, attnd_rpc_req_t *q) {
  if (q->prev)
    q->prev->next = q->next;
  else
    c->reqs = q->next;
  if (q->next)
    q->next->prev = q->prev;
  c->pending--;
  c->req_bytes -= q->frame_len + 4;
  c->rpc->inflight--;
}

static int plan_lookup(attnd_rpc_conn_t *c, uint64_t plan) {
  for (uint32_t i = 0; i < c->plan_cap; i++)
    if (c->plan_ids[i] == plan)
      return c->plan_decode[i] ? ATTND_STEP_DECODE : ATTND_STEP_PREFILL;
  return -1;
}

static int items_kind(const attnd_item_t *it, uint32_t n) {
  if (n == 0)
    return -1;
  for (uint32_t i = 0; i < n; i++)
    if (it[i].n != 1)
      return ATTND_STEP_PREFILL;
  return ATTND_STEP_DECODE;
}

/* The engine finished a call: answer (unless the client left) and let go. */
static void engine_done_cb(void *arg, attnd_result_t *res) {
  attnd_rpc_req_t *q = arg;
  attnd_rpc_conn_t *c = q->conn;
  attnd_rpc_t *r = c->rpc;
  int code = attnd_err_status(res->status);
  count(r, q->method, code);
  ATTND_LOGD("request", "conn=%llu id=%llu method=%s code=%s queued_us=%llu computing_us=%llu%s",
             (unsigned long long)c->id, (unsigned long long)q->id, attnd_method_name(q->method),
             attnd_code_name(code), (unsigned long long)res->queued_us,
             (unsigned long long)res->computing_us, c->closed ? " dropped=1" : "");
  if (code == ATTND_STATUS_OK && q->method == ATTND_M_STEP && q->step_kind >= 0)
    attnd_hist_add(&r->counters.step_latency[q->step_kind], (double)(now_ns() - q->t0_ns) / 1e3);
  if (code == ATTND_STATUS_OK && q->method == ATTND_M_PLAN && !c->closed) {
    c->plan_ids[c->plan_next] = res->plan;
    c->plan_decode[c->plan_next] = items_kind(q->items, q->nitems) == ATTND_STEP_DECODE;
    c->plan_next = (c->plan_next + 1) % c->plan_cap;
  }
  if (!c->closed) {
    attnd_v1_Response resp = attnd_v1_Response_init_zero;
    bytes_t out = {0}, lse = {0};
    resp.id = q->id;
    resp.status.code = (attnd_v1_Status_Code)code;
    if (res->status) {
      snprintf(resp.status.message, sizeof(resp.status.message), "%s",
               res->message[0] ? res->message : attnd_strerror(res->status));
    }
    resp.timing.queued_us = res->queued_us;
    resp.timing.computing_us = res->computing_us;
    if (code == ATTND_STATUS_OK) {
      switch (q->method) {
      case ATTND_M_OPEN_SESSION:
        resp.which_result = attnd_v1_Response_open_session_tag;
        resp.result.open_session.session = res->session;
        resp.result.open_session.cached_len = res->cached_len;
        break;
      case ATTND_M_CLOSE_SESSION:
        resp.which_result = attnd_v1_Response_close_session_tag;
        break;
      case ATTND_M_FORK:
        resp.which_result = attnd_v1_Response_fork_tag;
        resp.result.fork.session = res->session;
        break;
      case ATTND_M_TRUNCATE:
        resp.which_result = attnd_v1_Response_truncate_tag;
        break;
      case ATTND_M_PLAN:
        resp.which_result = attnd_v1_Response_plan_tag;
        resp.result.plan.plan = res->plan;
        break;
      case ATTND_M_SET_SCALES:
        resp.which_result = attnd_v1_Response_set_scales_tag;
        resp.result.set_scales.version = res->version;
        break;
      case ATTND_M_STEP: {
        const attnd_config_t *cfg = r->cfg;
        attnd_v1_StepResponse *sr = &resp.result.step;
        resp.which_result = attnd_v1_Response_step_tag;
        if (res->out) {
          sr->has_out = true;
          sr->out.dtype = (attnd_v1_DType)res->out_dtype;
          sr->out.shape_count = 3;
          sr->out.shape[0] = res->out_rows;
          sr->out.shape[1] = (uint32_t)cfg->shape.q_heads;
          sr->out.shape[2] = (uint32_t)cfg->shape.head_dim;
          out.p = res->out;
          out.n = res->out_bytes;
          sr->out.data.funcs.encode = enc_bytes_cb;
          sr->out.data.arg = &out;
        }
        if (res->lse) {
          sr->has_lse = true;
          sr->lse.dtype = attnd_v1_DType_DTYPE_FP32;
          sr->lse.shape_count = 2;
          sr->lse.shape[0] = res->out_rows;
          sr->lse.shape[1] = (uint32_t)cfg->shape.q_heads;
          lse.p = res->lse;
          lse.n = res->lse_bytes;
          sr->lse.data.funcs.encode = enc_bytes_cb;
          sr->lse.data.arg = &lse;
        }
        break;
      }
      default:
        break;
      }
    }
    scatter_t sc;
    memset(&sc, 0, sizeof(sc));
    if (c->sendv && q->method == ATTND_M_STEP && !res->status) {
      /* Large tensors by reference (see send_response_refs). */
      if (out.p && out.n >= r->ref_min) {
        sc.refp[sc.nref] = out.p;
        sc.refn[sc.nref] = out.n;
        sc.ref_free[sc.nref++] = (void *)out.p;
      }
      if (lse.p && lse.n >= r->ref_min) {
        sc.refp[sc.nref] = lse.p;
        sc.refn[sc.nref] = lse.n;
        sc.ref_free[sc.nref++] = (void *)lse.p;
      }
    }
    if (sc.nref > 0 && send_response_refs(c, &resp, q->t0_ns, &sc)) {
      /* The pieces the transport took are its to free. */
      for (int i = 0; i < sc.nref; i++) {
        if (sc.ref_free[i])
          continue; /* not referenced after all: still ours */
        if (sc.refp[i] == res->out)
          res->out = NULL;
        else
          res->lse = NULL;
      }
    } else {
      send_response(c, &resp, q->t0_ns, 0);
    }
  }
  free(res->out);
  free(res->lse);
  req_unlink(c, q);
  req_free(q);
  if (c->closed) {
    if (c->pending == 0 && c->released)
      c->released(c);
  } else if (c->progress) {
    c->progress(c);
  }
  if (r->draining && r->inflight == 0 && r->idle_cb)
    r->idle_cb(r->idle_arg);
}

/* ---- synchronous calls ------------------------------------------------------ */

static void fill_shape(attnd_rpc_t *r, attnd_v1_ModelShape *m) {
  const attnd_config_t *cfg = r->cfg;
  const attnd_kshape_t *s = &cfg->shape;
  m->layers = (uint32_t)cfg->layers;
  m->q_heads = (uint32_t)s->q_heads;
  m->kv_heads = (uint32_t)s->kv_heads;
  m->head_dim = (uint32_t)s->head_dim;
  m->block_size = (uint32_t)s->block_size;
  snprintf(m->dtype, sizeof(m->dtype), "%s", s->dtype == ATTND_DT_FP16 ? "fp16" : "bf16");
  snprintf(m->kv_cache, sizeof(m->kv_cache), "%s", attnd_kv_type_name(s->kv));
  snprintf(m->rope, sizeof(m->rope), "%s",
           s->rope == ATTND_ROPE_NEOX          ? "neox"
           : s->rope == ATTND_ROPE_INTERLEAVED ? "interleaved"
                                               : "none");
  m->rope_theta = s->rope_theta;
  m->rotary_dim = (uint32_t)s->rotary_dim;
  m->softmax_scale = s->softmax_scale;
  m->max_context = (uint32_t)cfg->max_context;
  snprintf(m->model_id, sizeof(m->model_id), "%s", cfg->model_id);
  /* All layers, K and V, scales included; rounded up to whole bytes. */
  double per = attnd_kv_bytes_per_token(s) * (double)cfg->layers;
  m->kv_bytes_per_token = (uint64_t)(per + 0.999999);
}

static void answer_health(attnd_rpc_conn_t *c, uint64_t id, uint64_t t0) {
  attnd_rpc_t *r = c->rpc;
  attnd_v1_Response resp = attnd_v1_Response_init_zero;
  attnd_v1_HealthResponse *h = &resp.result.health;
  if (!r->have_info) {
    memset(&r->info, 0, sizeof(r->info));
    attnd_engine_info(r->engine, &r->info);
    r->have_info = 1;
  }
  const attnd_engine_info_t info = r->info;
  resp.id = id;
  resp.which_result = attnd_v1_Response_health_tag;
  snprintf(h->status, sizeof(h->status), "%s", r->draining ? "draining" : "serving");
  snprintf(h->version, sizeof(h->version), "%s", ATTND_VERSION);
  snprintf(h->backend, sizeof(h->backend), "%s", info.backend ? info.backend : "unknown");
  snprintf(h->device, sizeof(h->device), "%s", info.device);
  h->has_model = true;
  fill_shape(r, &h->model);
  h->uptime_s = (now_ns() - r->start_ns) / 1000000000ull;
  h->epoch = r->epoch;
  h->tcp_port = (uint32_t)r->tcp_port;
  h->kv_memory_bytes = info.kv_memory;
  h->kv_blocks = info.kv_blocks;
  h->device_memory_bytes = info.device_memory;
  h->compute_capability = (uint32_t)info.compute_capability;
  count(r, ATTND_M_HEALTH, 0);
  send_response(c, &resp, t0, 0);
}

static void answer_stats(attnd_rpc_conn_t *c, uint64_t id, uint64_t t0) {
  attnd_rpc_t *r = c->rpc;
  attnd_v1_Response resp = attnd_v1_Response_init_zero;
  attnd_v1_StatsResponse *s = &resp.result.stats;
  attnd_engine_stats_t es;
  memset(&es, 0, sizeof(es));
  attnd_engine_stats(r->engine, &es);
  /* This call counts itself, so the numbers include it. */
  count(r, ATTND_M_STATS, 0);
  resp.id = id;
  resp.which_result = attnd_v1_Response_stats_tag;
  s->connections = r->counters.connections;
  for (int m = 1; m < ATTND_M_COUNT && s->methods_count < 16; m++) {
    attnd_v1_MethodStats *ms = &s->methods[s->methods_count++];
    snprintf(ms->method, sizeof(ms->method), "%s", attnd_method_name(m));
    ms->requests = r->counters.requests[m];
    ms->errors = r->counters.errors[m];
  }
  s->bytes_in = r->counters.bytes_in;
  s->bytes_out = r->counters.bytes_out;
  s->sessions = es.sessions;
  s->blocks_total = es.blocks_total;
  s->blocks_used = es.blocks_used;
  s->blocks_cached = es.blocks_cached;
  s->prefix_queries = es.prefix_queries;
  s->prefix_hit_tokens = es.prefix_hit_tokens;
  s->prefix_miss_tokens = es.prefix_miss_tokens;
  s->evictions = es.evictions;
  s->cow_copies = es.cow_copies;
  s->plans = es.plans;
  s->steps = es.steps;
  s->tokens_written = es.tokens_written;
  snprintf(s->kv_cache, sizeof(s->kv_cache), "%s", attnd_kv_type_name(r->cfg->shape.kv));
  s->kv_bytes_per_token =
      (uint64_t)(attnd_kv_bytes_per_token(&r->cfg->shape) * (double)r->cfg->layers + 0.999999);
  s->uptime_s = (now_ns() - r->start_ns) / 1000000000ull;
  s->admission_queued = es.queued;
  send_response(c, &resp, t0, 0);
}

static void answer_list_sessions(attnd_rpc_conn_t *c, uint64_t id, uint64_t t0) {
  attnd_rpc_t *r = c->rpc;
  attnd_v1_Response resp = attnd_v1_Response_init_zero;
  uint32_t n = attnd_engine_list_sessions(r->engine, c->identity, NULL, 0);
  sessions_t ss = {NULL, 0};
  if (n) {
    attnd_session_info_t *v = xmalloc((size_t)n * sizeof(*v));
    uint32_t got = attnd_engine_list_sessions(r->engine, c->identity, v, n);
    ss.v = v;
    ss.n = got < n ? got : n;
  }
  resp.id = id;
  resp.which_result = attnd_v1_Response_list_sessions_tag;
  resp.result.list_sessions.sessions.funcs.encode = enc_sessions_cb;
  resp.result.list_sessions.sessions.arg = &ss;
  count(r, ATTND_M_LIST_SESSIONS, 0);
  send_response(c, &resp, t0, 0);
  free((void *)ss.v);
}

static void answer_hello(attnd_rpc_conn_t *c, uint64_t id, uint64_t t0, const char *token) {
  attnd_rpc_t *r = c->rpc;
  if (token[0] && attnd_rpc_token_ok(r, token)) {
    /* On the Unix socket the peer uid stays the identity; on TCP the token is. */
    if (c->identity >> 32)
      c->identity = (XXH3_64bits(token, strlen(token)) | ATTND_IDENTITY_TOKEN_BIT);
    c->need_hello = 0;
  } else if (token[0] || c->need_hello) {
    count(r, ATTND_M_HELLO, attnd_err_status(ATTND_EUNAUTH));
    ATTND_LOGW("auth_failed", "conn=%llu", (unsigned long long)c->id);
    attnd_rpc_send_error(c, id, ATTND_EUNAUTH, "token not accepted", 1);
    return;
  }
  attnd_v1_Response resp = attnd_v1_Response_init_zero;
  resp.id = id;
  resp.which_result = attnd_v1_Response_hello_tag;
  count(r, ATTND_M_HELLO, 0);
  send_response(c, &resp, t0, 0);
}

/* ---- dispatch ---------------------------------------------------------------- */

/* Turns nanopb's terse errors into something a client can act on. */
static void decode_error_msg(const char *method, const char *pberr, char *msg, size_t cap) {
  if (strcmp(pberr, "array overflow") == 0)
    snprintf(msg, cap, "%s: a tensor shape has more than 4 dims", method);
  else if (strcmp(pberr, "string overflow") == 0)
    snprintf(msg, cap, "%s: a string field is too long (Hello token: at most 255 bytes)", method);
  else if (strcmp(pberr, "bytes overflow") == 0)
    snprintf(msg, cap, "%s: a bytes field is too long (salt: at most 64 bytes)", method);
  else
    snprintf(msg, cap, "%s: cannot decode: %s", method, pberr);
}

static void fail_req(attnd_rpc_conn_t *c, attnd_rpc_req_t *q, int err, const char *msg,
                     int close_after) {
  int code = attnd_err_status(err);
  count(c->rpc, q->method, code);
  ATTND_LOGD("request", "conn=%llu id=%llu method=%s code=%s msg=\"%s\"", (unsigned long long)c->id,
             (unsigned long long)q->id, attnd_method_name(q->method), attnd_code_name(code), msg);
  attnd_v1_Response resp = attnd_v1_Response_init_zero;
  resp.id = q->id;
  resp.status.code = (attnd_v1_Status_Code)code;
  snprintf(resp.status.message, sizeof(resp.status.message), "%s", msg);
  send_response(c, &resp, q->t0_ns, close_after);
  req_free(q);
}

void attnd_rpc_handle_frame(attnd_rpc_conn_t *c, uint8_t *frame, size_t len) {
  attnd_rpc_t *r = c->rpc;
  r->counters.bytes_in += len + 4;
  /* Walk the outer Request by hand (see the top of this file). */
  pb_istream_t s = pb_istream_from_buffer(frame, len);
  uint64_t id = 0;
  uint32_t call_tag = 0;
  const uint8_t *call_ptr = NULL;
  uint32_t call_len = 0;
  while (s.bytes_left) {
    pb_wire_type_t wt;
    uint32_t tag;
    bool eof;
    if (!pb_decode_tag(&s, &wt, &tag, &eof))
      goto unparsable;
    if (tag == attnd_v1_Request_id_tag) {
      if (wt != PB_WT_VARINT || !pb_decode_varint(&s, &id))
        goto unparsable;
    } else if (tag >= attnd_v1_Request_hello_tag && tag <= attnd_v1_Request_list_sessions_tag) {
      if (wt != PB_WT_STRING || !pb_decode_varint32(&s, &call_len) || call_len > s.bytes_left)
        goto unparsable;
      call_tag = tag;
      call_ptr = s.state;
      if (!pb_read(&s, NULL, call_len))
        goto unparsable;
    } else if (!pb_skip_field(&s, wt)) {
      goto unparsable;
    }
  }

  attnd_rpc_req_t *q = calloc(1, sizeof(*q));
  if (!q)
    abort();
  q->conn = c;
  q->id = id;
  q->frame = frame;
  q->frame_len = len;
  q->t0_ns = now_ns();
  q->step_kind = -1;
  q->method = call_tag ? (int)call_tag - 1 : ATTND_M_UNKNOWN;
  r->counters.requests[q->method]++;

  if (c->need_hello && q->method != ATTND_M_HELLO) {
    fail_req(c, q, ATTND_EUNAUTH, "this connection must send Hello{token} first", 1);
    return;
  }
  if (!call_tag) {
    fail_req(c, q, ATTND_ENOTIMPL, "missing or unknown call", 0);
    return;
  }
  for (attnd_rpc_req_t *p = c->reqs; p; p = p->next) {
    if (p->id == id) {
      char m[96];
      snprintf(m, sizeof(m), "id %llu is already in flight on this connection",
               (unsigned long long)id);
      fail_req(c, q, ATTND_EINVAL, m, 0);
      return;
    }
  }
  if (r->draining && q->method != ATTND_M_HEALTH && q->method != ATTND_M_STATS &&
      q->method != ATTND_M_HELLO) {
    fail_req(c, q, ATTND_EUNAVAIL, "the daemon is draining (shutting down)", 0);
    return;
  }

  pb_istream_t cs = pb_istream_from_buffer(call_ptr, call_len);
  uint64_t t0;
  const char *mname = attnd_method_name(q->method);
  bool ok = true;
  switch (q->method) {
  case ATTND_M_HELLO: {
    attnd_v1_HelloRequest h = attnd_v1_HelloRequest_init_zero;
    ok = pb_decode(&cs, attnd_v1_HelloRequest_fields, &h);
    if (ok) {
      answer_hello(c, id, q->t0_ns, h.token);
      memset(&h, 0, sizeof(h));
      req_free(q);
      return;
    }
    break;
  }
  case ATTND_M_HEALTH:
    t0 = q->t0_ns;
    req_free(q);
    answer_health(c, id, t0);
    return;
  case ATTND_M_STATS:
    t0 = q->t0_ns;
    req_free(q);
    answer_stats(c, id, t0);
    return;
  case ATTND_M_LIST_SESSIONS:
    t0 = q->t0_ns;
    req_free(q);
    answer_list_sessions(c, id, t0);
    return;
  case ATTND_M_OPEN_SESSION: {
    attnd_v1_OpenSessionRequest o = attnd_v1_OpenSessionRequest_init_zero;
    o.tokens.funcs.decode = dec_u32_cb;
    o.tokens.arg = &q->open_tokens;
    if (!(ok = pb_decode(&cs, attnd_v1_OpenSessionRequest_fields, &o)))
      break;
    req_link(c, q);
    attnd_engine_open_session(r->engine, c->identity, q->open_tokens.v, q->open_tokens.n,
                              o.salt.bytes, o.salt.size, engine_done_cb, q);
    return;
  }
  case ATTND_M_CLOSE_SESSION: {
    attnd_v1_CloseSessionRequest m = attnd_v1_CloseSessionRequest_init_zero;
    if (!(ok = pb_decode(&cs, attnd_v1_CloseSessionRequest_fields, &m)))
      break;
    req_link(c, q);
    attnd_engine_close_session(r->engine, c->identity, m.session, engine_done_cb, q);
    return;
  }
  case ATTND_M_FORK: {
    attnd_v1_ForkRequest m = attnd_v1_ForkRequest_init_zero;
    if (!(ok = pb_decode(&cs, attnd_v1_ForkRequest_fields, &m)))
      break;
    req_link(c, q);
    attnd_engine_fork(r->engine, c->identity, m.session, engine_done_cb, q);
    return;
  }
  case ATTND_M_TRUNCATE: {
    attnd_v1_TruncateRequest m = attnd_v1_TruncateRequest_init_zero;
    if (!(ok = pb_decode(&cs, attnd_v1_TruncateRequest_fields, &m)))
      break;
    req_link(c, q);
    attnd_engine_truncate(r->engine, c->identity, m.session, m.len, engine_done_cb, q);
    return;
  }
  case ATTND_M_PLAN: {
    attnd_v1_PlanRequest m = attnd_v1_PlanRequest_init_zero;
    m.items.funcs.decode = dec_item_cb;
    m.items.arg = q;
    if (!(ok = pb_decode(&cs, attnd_v1_PlanRequest_fields, &m)))
      break;
    if (q->decode_failed) {
      char msg[220];
      snprintf(msg, sizeof(msg), "%s", q->msg);
      fail_req(c, q, q->decode_failed, msg, 0);
      return;
    }
    req_link(c, q);
    attnd_engine_plan(r->engine, c->identity, c->id, q->items, q->nitems, engine_done_cb, q);
    return;
  }
  case ATTND_M_STEP: {
    attnd_v1_StepRequest m = attnd_v1_StepRequest_init_zero;
    attnd_step_req_t *st = &q->step;
    m.items.funcs.decode = dec_item_cb;
    m.items.arg = q;
    set_tensor_cb(&m.q, &st->q);
    set_tensor_cb(&m.k, &st->k);
    set_tensor_cb(&m.v, &st->v);
    if (!(ok = pb_decode(&cs, attnd_v1_StepRequest_fields, &m)))
      break;
    char msg[220];
    int bad = q->decode_failed;
    if (!bad && (tensor_finish(&st->q, m.has_q, &m.q, "q", q->msg, sizeof(q->msg)) ||
                 tensor_finish(&st->k, m.has_k, &m.k, "k", q->msg, sizeof(q->msg)) ||
                 tensor_finish(&st->v, m.has_v, &m.v, "v", q->msg, sizeof(q->msg))))
      bad = ATTND_EINVAL;
    if (!bad && m.plan != 0 && q->nitems != 0) {
      snprintf(q->msg, sizeof(q->msg),
               "step: names plan %llu and carries %u inline items; give one",
               (unsigned long long)m.plan, q->nitems);
      bad = ATTND_EINVAL;
    }
    if (bad) {
      snprintf(msg, sizeof(msg), "%s", q->msg);
      fail_req(c, q, bad, msg, 0);
      return;
    }
    st->layer = m.layer;
    st->plan = m.plan;
    st->items = q->items;
    st->nitems = q->nitems;
    st->want_lse = m.want_lse;
    st->fp32_out = m.fp32_out;
    q->step_kind = m.plan ? plan_lookup(c, m.plan) : items_kind(q->items, q->nitems);
    req_link(c, q);
    attnd_engine_step(r->engine, c->identity, c->id, st, engine_done_cb, q);
    return;
  }
  case ATTND_M_SET_SCALES: {
    attnd_v1_SetScalesRequest m = attnd_v1_SetScalesRequest_init_zero;
    attnd_scales_req_t *sc = &q->scales;
    set_tensor_cb(&m.k_scale, &sc->k_scale);
    set_tensor_cb(&m.v_scale, &sc->v_scale);
    set_tensor_cb(&m.k_zero, &sc->k_zero);
    set_tensor_cb(&m.v_zero, &sc->v_zero);
    if (!(ok = pb_decode(&cs, attnd_v1_SetScalesRequest_fields, &m)))
      break;
    if (tensor_finish(&sc->k_scale, m.has_k_scale, &m.k_scale, "k_scale", q->msg, sizeof(q->msg)) ||
        tensor_finish(&sc->v_scale, m.has_v_scale, &m.v_scale, "v_scale", q->msg, sizeof(q->msg)) ||
        tensor_finish(&sc->k_zero, m.has_k_zero, &m.k_zero, "k_zero", q->msg, sizeof(q->msg)) ||
        tensor_finish(&sc->v_zero, m.has_v_zero, &m.v_zero, "v_zero", q->msg, sizeof(q->msg))) {
      char msg[220];
      snprintf(msg, sizeof(msg), "%s", q->msg);
      fail_req(c, q, ATTND_EINVAL, msg, 0);
      return;
    }
    sc->layer = m.layer;
    sc->drop_cached_kv = m.drop_cached_kv;
    req_link(c, q);
    attnd_engine_set_scales(r->engine, sc, engine_done_cb, q);
    return;
  }
  default:
    fail_req(c, q, ATTND_ENOTIMPL, "missing or unknown call", 0);
    return;
  }
  /* The call's message did not decode. */
  (void)ok;
  char msg[240];
  decode_error_msg(mname, PB_GET_ERROR(&cs), msg, sizeof(msg));
  fail_req(c, q, ATTND_EINVAL, msg, 0);
  return;

unparsable:
  free(frame);
  ATTND_LOGI("bad_frame", "conn=%llu reason=unparsable len=%zu", (unsigned long long)c->id, len);
  attnd_rpc_frame_error(c, ATTND_EINVAL, "frame is not a valid Request");
}

void attnd_rpc_frame_error(attnd_rpc_conn_t *c, int err, const char *msg) {
  attnd_rpc_t *r = c->rpc;
  r->counters.requests[ATTND_M_UNKNOWN]++;
  r->counters.frame_errors++;
  count(r, ATTND_M_UNKNOWN, attnd_err_status(err));
  attnd_rpc_send_error(c, 0, err, msg, 1);
}

int attnd_rpc_conn_closed(attnd_rpc_conn_t *c) {
  if (c->closed)
    return c->pending == 0;
  c->closed = 1;
  attnd_engine_conn_closed(c->rpc->engine, c->id);
  free(c->plan_ids);
  free(c->plan_decode);
  c->plan_ids = NULL;
  c->plan_decode = NULL;
  c->plan_cap = 0;
  return c->pending == 0;
}

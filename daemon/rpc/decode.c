/* decode.c: the nanopb side of decoding a call (internal.h).
 *
 * Request.call is a oneof whose members carry callback fields (items,
 * tokens, tensor data). nanopb clears a oneof member before decoding it,
 * which would wipe callbacks set in advance, so rpc.c walks the outer
 * Request by hand and each method's row decodes its own message with
 * pb_decode() into a struct whose callbacks are already set. Tensor data
 * callbacks record a pointer into the frame (the stream is a buffer stream,
 * so stream->state is the current position) and skip the bytes: no copy.
 * Masks are expanded here into the kernels' form (engine.h attnd_mask_t;
 * docs/numerics.md), so the engine sees no wire enum. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

bool attnd_rpc_dec_u32_cb(pb_istream_t *s, const pb_field_t *f, void **arg) {
  attnd_u32vec_t *v = *arg;
  uint32_t x;
  uint32_t max = v->max;
  if (v->nfield && *v->nfield && (!max || *v->nfield < max))
    max = *v->nfield;
  /* nanopb hands a repeated scalar's callback a substream exactly as long as
   * the field's data: a packed run, or one value copied aside. A uint32
   * varint takes at most 10 bytes, so more bytes than 10 per id still
   * allowed means too many ids, known before any is decoded. */
  uint64_t room = max > v->n ? (uint64_t)(max - v->n) : 0;
  if (max && (v->n >= max || s->bytes_left > 10 * room)) {
    v->over = 1;
    return false;
  }
  if (v->total && v->total_max) {
    uint64_t troom = *v->total < v->total_max ? v->total_max - *v->total : 0;
    if (troom == 0 || s->bytes_left > 10 * troom) {
      v->over = 2;
      return false;
    }
    ++*v->total;
  }
  if (!pb_decode_varint32(s, &x))
    return false;
  if (v->n == v->cap) {
    v->cap = v->cap ? v->cap * 2 : 64;
    v->v = attnd_xrealloc(v->v, (size_t)v->cap * sizeof(uint32_t));
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

void attnd_rpc_set_tensor_cb(attnd_v1_Tensor *pb, attnd_tensor_t *t) {
  pb->data.funcs.decode = dec_tensor_data_cb;
  pb->data.arg = t;
}

size_t attnd_rpc_dtype_size(int dt) {
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

int attnd_rpc_tensor_finish(attnd_tensor_t *t, bool has, const attnd_v1_Tensor *pb,
                            const char *name, char *msg, size_t cap) {
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
  size_t es = attnd_rpc_dtype_size(t->dtype);
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

/* A document mask as intervals: the keys of a document are hidden from
 * every row after it (lts = the document's end, lte = kv_len); causal hides
 * them from the rows before it. */
static int expand_documents(attnd_mask_t *mk, const attnd_tensor_t *doc, uint64_t kv_len,
                            uint32_t i, char *msg, size_t msglen) {
  if (!doc->present || doc->dtype != ATTND_DT_INT32 || doc->ndim != 1 || doc->shape[0] == 0 ||
      doc->nbytes != (size_t)doc->shape[0] * 4 || !doc->data) {
    snprintf(msg, msglen, "item %u: doc_lengths must be INT32 [ndocs]", i);
    return ATTND_EINVAL;
  }
  /* More documents than keys would all be empty but the first kv_len:
   * refused before walking them. */
  if (doc->shape[0] > kv_len) {
    snprintf(msg, msglen, "item %u: %u doc_lengths for kv_len %llu (at most one per key)", i,
             doc->shape[0], (unsigned long long)kv_len);
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

/* An item's mask in the kernels' form (engine.h attnd_mask_t). A document
 * mask becomes intervals: the keys of a document are hidden from every row
 * after it (causal hides them from the rows before it). Interval arrays are
 * the request's own (aligned copies), freed with it. */
static int expand_mask(const attnd_config_t *cfg, attnd_item_t *x, uint32_t i, int kind,
                       const attnd_v1_Mask *m, const attnd_tensor_t *doc, const attnd_tensor_t *iv,
                       uint64_t *mask_bytes, char *msg, size_t msglen) {
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
    if (m->window == 0) {
      snprintf(msg, msglen, "item %u: sliding window must be >= 1", i);
      return ATTND_EINVAL;
    }
    /* Every window of at least max_context keys sees every earlier key of
     * any row (positions are below max_context): the same mask, and one
     * the kernels' int32 arithmetic holds. */
    mk->kind = ATTND_MASK_SLIDING;
    mk->param =
        m->window > (uint32_t)cfg->max_context ? (int32_t)cfg->max_context : (int32_t)m->window;
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
  /* A document mask of a few bytes expands to 16 bytes per key: all items'
   * together may not take more than a frame could carry as custom masks. */
  *mask_bytes += 16 * kv_len;
  if (*mask_bytes > cfg->max_frame) {
    snprintf(msg, msglen,
             "item %u: the items' masks take %llu bytes as intervals, more than --max-frame %llu",
             i, (unsigned long long)*mask_bytes, (unsigned long long)cfg->max_frame);
    return ATTND_ENOSPC;
  }
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
  return expand_documents(mk, doc, kv_len, i, msg, msglen);
}

/* The KV pool's tokens: no Plan or Step can write more positions than it
 * has (every position written lies in a block of its own session), so no
 * request needs more token ids. */
static uint64_t pool_tokens(attnd_rpc_t *r) {
  uint64_t t = (uint64_t)attnd_rpc_info(r)->kv_blocks * (uint64_t)r->cfg->shape.block_size;
  return t ? t : 1;
}

bool attnd_rpc_dec_item_cb(pb_istream_t *s, const pb_field_t *f, void **arg) {
  attnd_rpc_req_t *q = *arg;
  attnd_rpc_t *r = q->conn->rpc;
  const attnd_config_t *cfg = r->cfg;
  attnd_v1_Item it = attnd_v1_Item_init_zero;
  attnd_u32vec_t tok = {0};
  attnd_tensor_t doc = {0}, iv = {0};
  /* Items name distinct sessions: never more than --max-sessions. */
  if (q->nitems >= (uint32_t)cfg->max_sessions) {
    snprintf(q->msg, sizeof(q->msg), "more than %d items (--max-sessions; each names a session)",
             cfg->max_sessions);
    q->decode_failed = ATTND_EINVAL;
    return false;
  }
  tok.max = (uint32_t)cfg->max_context;
  tok.nfield = &it.n;
  tok.total = &q->tokens_total;
  tok.total_max = pool_tokens(r);
  it.tokens.funcs.decode = attnd_rpc_dec_u32_cb;
  it.tokens.arg = &tok;
  attnd_rpc_set_tensor_cb(&it.mask.doc_lengths, &doc);
  attnd_rpc_set_tensor_cb(&it.mask.intervals, &iv);
  if (!pb_decode(s, attnd_v1_Item_fields, &it)) {
    free(tok.v);
    if (tok.over == 1) {
      snprintf(q->msg, sizeof(q->msg), "item %u: more token ids than %s %u", q->nitems,
               it.n && it.n < tok.max ? "its n" : "max_context",
               it.n && it.n < tok.max ? it.n : tok.max);
      q->decode_failed = ATTND_EINVAL;
    } else if (tok.over == 2) {
      snprintf(q->msg, sizeof(q->msg),
               "item %u: the items carry more token ids than the KV pool holds (%llu tokens)",
               q->nitems, (unsigned long long)tok.total_max);
      q->decode_failed = ATTND_ENOSPC;
    }
    return false;
  }
  if (q->nitems == q->cap_items) {
    q->cap_items = q->cap_items ? q->cap_items * 2 : 8;
    q->items = attnd_xrealloc(q->items, (size_t)q->cap_items * sizeof(attnd_item_t));
  }
  attnd_item_t *x = &q->items[q->nitems++];
  memset(x, 0, sizeof(*x));
  x->session = it.session;
  x->start = it.start;
  x->n = it.n;
  x->kv_only = it.kv_only;
  x->q_only = it.q_only;
  x->mask.kind = ATTND_MASK_CAUSAL;
  x->tokens = tok.v;
  x->ntokens = tok.n;
  char name[48];
  attnd_tensor_t docs = doc, ivs = iv;
  snprintf(name, sizeof(name), "item %u: mask doc_lengths", q->nitems - 1);
  if (!q->decode_failed &&
      attnd_rpc_tensor_finish(&docs, it.has_mask && it.mask.has_doc_lengths, &it.mask.doc_lengths,
                              name, q->msg, sizeof(q->msg)))
    q->decode_failed = ATTND_EINVAL;
  snprintf(name, sizeof(name), "item %u: mask intervals", q->nitems - 1);
  if (!q->decode_failed &&
      attnd_rpc_tensor_finish(&ivs, it.has_mask && it.mask.has_intervals, &it.mask.intervals, name,
                              q->msg, sizeof(q->msg)))
    q->decode_failed = ATTND_EINVAL;
  if (!q->decode_failed) {
    int rc = expand_mask(cfg, x, q->nitems - 1, it.has_mask ? (int)it.mask.kind : 0, &it.mask,
                         &docs, &ivs, &q->mask_bytes, q->msg, sizeof(q->msg));
    if (rc)
      q->decode_failed = rc;
  }
  return true;
}

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

int attnd_rpc_pb_decode(attnd_rpc_req_t *q, pb_istream_t *s, const pb_msgdesc_t *fields,
                        void *msg) {
  if (pb_decode(s, fields, msg))
    return 0;
  /* A callback that stopped the decode for a reason of ours said why. */
  if (q->decode_failed)
    return q->decode_failed;
  decode_error_msg(attnd_rpc_method_name(q->method), PB_GET_ERROR(s), q->msg, sizeof(q->msg));
  return ATTND_EINVAL;
}

const attnd_engine_info_t *attnd_rpc_info(attnd_rpc_t *r) {
  if (!r->have_info) {
    memset(&r->info, 0, sizeof(r->info));
    attnd_engine_info(r->engine, &r->info);
    r->have_info = 1;
  }
  return &r->info;
}

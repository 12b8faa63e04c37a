/* attnclient_shard.c: head-sharded groups of daemons (attnclient_shard.h).
 *
 * The hot path is attnd_shard_step_send: each daemon's request encodes its
 * heads' slices with a strided callback that writes row by row from the
 * caller's packed tensors, so no slice is copied before the frame is built. */
#include "attnclient_shard.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <pb_encode.h>

typedef struct {
  uint64_t handle; /* the first daemon's id: unique on that daemon */
  uint64_t *ids;   /* one per daemon, in the group's client order */
} shard_session_t;

struct attnd_shard_group_s {
  size_t n;
  attnd_client_t **clients;
  attnd_shard_range_t *ranges;
  attnd_v1_ModelShape model;
  shard_session_t *sessions;
  size_t nsessions, cap;
  char err[512];
};

static int seterr(char *err, size_t len, const char *fmt, ...) {
  if (err && len) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
  }
  return ATTND_CLIENT_EINVAL;
}

static int gfail(attnd_shard_group_t *g, int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->err, sizeof(g->err), fmt, ap);
  va_end(ap);
  return rc;
}

/* Names the first model field two daemons disagree on, or returns NULL. */
static const char *shape_diff(const attnd_v1_ModelShape *a, const attnd_v1_ModelShape *b) {
  if (a->layers != b->layers)
    return "layers";
  if (a->head_dim != b->head_dim)
    return "head_dim";
  if (a->block_size != b->block_size)
    return "block_size";
  if (strcmp(a->dtype, b->dtype) != 0)
    return "dtype";
  if (strcmp(a->kv_cache, b->kv_cache) != 0)
    return "kv_cache";
  if (strcmp(a->rope, b->rope) != 0)
    return "rope";
  if (a->rope_theta != b->rope_theta)
    return "rope_theta";
  if (a->rotary_dim != b->rotary_dim)
    return "rotary_dim";
  if (a->softmax_scale != b->softmax_scale)
    return "softmax_scale";
  if (a->max_context != b->max_context)
    return "max_context";
  if (strcmp(a->model_id, b->model_id) != 0)
    return "model_id";
  return NULL;
}

int attnd_shard_resolve(const attnd_v1_ModelShape *shapes, const uint32_t *declared, size_t n,
                        attnd_shard_range_t *ranges, attnd_v1_ModelShape *model, char *err,
                        size_t errlen) {
  if (!shapes || !ranges || !model || n == 0)
    return seterr(err, errlen, "a sharded group needs at least one daemon");
  const attnd_v1_ModelShape *m0 = &shapes[0];
  if (m0->kv_heads == 0 || m0->q_heads % m0->kv_heads != 0)
    return seterr(err, errlen, "daemon 0: %u q heads are not a multiple of %u kv heads",
                  m0->q_heads, m0->kv_heads);
  const uint32_t g = m0->q_heads / m0->kv_heads;
  uint32_t tq = 0, tkv = 0;
  for (size_t i = 0; i < n; i++) {
    const attnd_v1_ModelShape *m = &shapes[i];
    const char *d = shape_diff(m0, m);
    if (d)
      return seterr(err, errlen, "daemon %zu: %s differs from daemon 0's", i, d);
    if (m->kv_heads == 0 || m->q_heads != m->kv_heads * g)
      return seterr(err, errlen, "daemon %zu: %u q heads for %u kv heads, not %u per kv head", i,
                    m->q_heads, m->kv_heads, g);
    uint32_t b, e;
    const uint32_t db = declared ? declared[2 * i] : 0, de = declared ? declared[2 * i + 1] : 0;
    /* A daemon reporting the whole model of its own shape (no --kv-heads A:B)
     * may be a shard started with the shard's shape: a declared range says
     * which heads it holds. */
    const int whole = m->kv_head_begin == 0 && m->kv_head_end == m->kv_heads &&
                      (m->model_kv_heads == 0 || m->model_kv_heads == m->kv_heads);
    if (m->kv_head_end && !(de && whole)) {
      b = m->kv_head_begin;
      e = m->kv_head_end;
      if (e <= b || e - b != m->kv_heads)
        return seterr(err, errlen, "daemon %zu: Health reports kv heads [%u, %u) but holds %u", i,
                      b, e, m->kv_heads);
      if (de && (db != b || de != e))
        return seterr(err, errlen, "daemon %zu: declared kv heads %u:%u, Health says %u:%u", i, db,
                      de, b, e);
      if (tkv && (m->model_kv_heads != tkv || m->model_q_heads != tq))
        return seterr(err, errlen, "daemon %zu: reports a model of %u/%u heads, another %u/%u", i,
                      m->model_q_heads, m->model_kv_heads, tq, tkv);
      tq = m->model_q_heads;
      tkv = m->model_kv_heads;
    } else if (de) {
      if (de <= db || de - db != m->kv_heads)
        return seterr(err, errlen, "daemon %zu: declared kv heads %u:%u but it holds %u", i, db, de,
                      m->kv_heads);
      b = db;
      e = de;
    } else {
      b = 0;
      e = m->kv_heads;
    }
    ranges[i] = (attnd_shard_range_t){b, e, b * g, e * g};
  }
  /* The ranges must tile [0, total): walk from 0, each step finding the range
   * that starts where the last ended (n is small; quadratic is fine). */
  uint32_t pos = 0;
  for (size_t k = 0; k < n; k++) {
    size_t found = n;
    for (size_t i = 0; i < n; i++)
      if (ranges[i].kv_begin == pos) {
        if (found != n)
          return seterr(err, errlen, "kv heads from %u are held by daemons %zu and %zu", pos, found,
                        i);
        found = i;
      }
    if (found == n)
      return seterr(err, errlen, "kv heads from %u are held by no daemon (or twice)", pos);
    pos = ranges[found].kv_end;
  }
  if (tkv && (tkv != pos || tq != pos * g))
    return seterr(err, errlen, "daemons report a model of %u kv heads but hold %u", tkv, pos);
  *model = *m0;
  model->q_heads = pos * g;
  model->kv_heads = pos;
  model->kv_head_begin = model->kv_head_end = 0;
  model->model_q_heads = model->q_heads;
  model->model_kv_heads = model->kv_heads;
  return 0;
}

void attnd_shard_gather(void *dst, const void *src, uint32_t rows, uint32_t heads, uint32_t hbegin,
                        uint32_t hcount, uint32_t dim, size_t esize) {
  const size_t row = (size_t)heads * dim * esize, part = (size_t)hcount * dim * esize;
  const uint8_t *s = (const uint8_t *)src + (size_t)hbegin * dim * esize;
  uint8_t *d = dst;
  for (uint32_t r = 0; r < rows; r++)
    memcpy(d + r * part, s + r * row, part);
}

void attnd_shard_scatter(void *dst, const void *src, uint32_t rows, uint32_t heads, uint32_t hbegin,
                         uint32_t hcount, uint32_t dim, size_t esize) {
  const size_t row = (size_t)heads * dim * esize, part = (size_t)hcount * dim * esize;
  uint8_t *d = (uint8_t *)dst + (size_t)hbegin * dim * esize;
  const uint8_t *s = src;
  for (uint32_t r = 0; r < rows; r++)
    memcpy(d + r * row, s + r * part, part);
}

/* ---- the group ---- */

int attnd_shard_group_init(attnd_shard_group_t **out, attnd_client_t *const *clients,
                           const uint32_t *declared, size_t n, char *err, size_t errlen) {
  *out = NULL;
  if (!clients || n == 0)
    return seterr(err, errlen, "a sharded group needs at least one daemon");
  attnd_shard_group_t *g = calloc(1, sizeof(*g));
  if (!g)
    return ATTND_CLIENT_ENOMEM;
  g->n = n;
  g->clients = calloc(n, sizeof(*g->clients));
  g->ranges = calloc(n, sizeof(*g->ranges));
  attnd_v1_ModelShape *shapes = calloc(n, sizeof(*shapes));
  int rc = ATTND_CLIENT_ENOMEM;
  if (!g->clients || !g->ranges || !shapes)
    goto fail_alloc;
  for (size_t i = 0; i < n; i++) {
    attnd_v1_HealthResponse h;
    g->clients[i] = clients[i];
    if ((rc = attnd_client_health(clients[i], &h)) != 0) {
      seterr(err, errlen, "daemon %zu (%s): Health: %s", i, attnd_client_addr(clients[i]),
             attnd_client_errmsg(clients[i]));
      goto fail_alloc;
    }
    shapes[i] = h.model;
  }
  if ((rc = attnd_shard_resolve(shapes, declared, n, g->ranges, &g->model, err, errlen)) != 0)
    goto fail_alloc;
  free(shapes);
  *out = g;
  return 0;
fail_alloc:
  free(shapes);
  attnd_shard_group_free(g);
  return rc;
}

void attnd_shard_group_free(attnd_shard_group_t *g) {
  if (!g)
    return;
  for (size_t i = 0; i < g->nsessions; i++)
    free(g->sessions[i].ids);
  free(g->sessions);
  free(g->ranges);
  free(g->clients);
  free(g);
}

const char *attnd_shard_errmsg(const attnd_shard_group_t *g) {
  return g ? g->err : "";
}
const attnd_v1_ModelShape *attnd_shard_model(const attnd_shard_group_t *g) {
  return &g->model;
}
size_t attnd_shard_count(const attnd_shard_group_t *g) {
  return g->n;
}
attnd_shard_range_t attnd_shard_range(const attnd_shard_group_t *g, size_t i) {
  return g->ranges[i];
}

static shard_session_t *find(attnd_shard_group_t *g, uint64_t handle) {
  for (size_t i = 0; i < g->nsessions; i++)
    if (g->sessions[i].handle == handle)
      return &g->sessions[i];
  gfail(g, ATTND_CLIENT_EINVAL, "session %016llx is not a session of this group",
        (unsigned long long)handle);
  return NULL;
}

static int add_session(attnd_shard_group_t *g, uint64_t *ids) {
  if (g->nsessions == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 16;
    shard_session_t *s = realloc(g->sessions, cap * sizeof(*s));
    if (!s)
      return gfail(g, ATTND_CLIENT_ENOMEM, "out of memory for the session table");
    g->sessions = s;
    g->cap = cap;
  }
  g->sessions[g->nsessions++] = (shard_session_t){ids[0], ids};
  return 0;
}

static void drop_session(attnd_shard_group_t *g, shard_session_t *s) {
  free(s->ids);
  *s = g->sessions[--g->nsessions];
}

/* Records the first failure of daemon i in the group's message. */
static int dfail(attnd_shard_group_t *g, size_t i, int rc, int first) {
  if (first == 0)
    gfail(g, rc, "daemon %zu (%s): %s", i, attnd_client_addr(g->clients[i]),
          attnd_client_errmsg(g->clients[i]));
  return first ? first : rc;
}

int attnd_shard_open_session(attnd_shard_group_t *g, const uint32_t *tokens, size_t ntokens,
                             uint64_t *session, uint32_t *cached_len) {
  uint64_t *ids = calloc(g->n, sizeof(*ids));
  if (!ids)
    return gfail(g, ATTND_CLIENT_ENOMEM, "out of memory");
  uint32_t cached = UINT32_MAX;
  size_t i;
  int rc = 0;
  for (i = 0; i < g->n; i++) {
    uint32_t c = 0;
    if ((rc = attnd_client_open_session(g->clients[i], tokens, ntokens, &ids[i], &c)) != 0) {
      rc = dfail(g, i, rc, 0);
      goto fail_open;
    }
    cached = c < cached ? c : cached;
  }
  if ((rc = add_session(g, ids)) != 0)
    goto fail_open;
  *session = ids[0];
  if (cached_len)
    *cached_len = cached;
  return 0;
fail_open:
  while (i-- > 0)
    attnd_client_close_session(g->clients[i], ids[i]);
  free(ids);
  return rc;
}

int attnd_shard_close_session(attnd_shard_group_t *g, uint64_t session) {
  shard_session_t *s = find(g, session);
  if (!s)
    return ATTND_CLIENT_EINVAL;
  int first = 0;
  for (size_t i = 0; i < g->n; i++) {
    int rc = attnd_client_close_session(g->clients[i], s->ids[i]);
    if (rc != 0)
      first = dfail(g, i, rc, first);
  }
  drop_session(g, s);
  return first;
}

int attnd_shard_fork(attnd_shard_group_t *g, uint64_t session, uint64_t *child) {
  shard_session_t *s = find(g, session);
  if (!s)
    return ATTND_CLIENT_EINVAL;
  uint64_t *ids = calloc(g->n, sizeof(*ids));
  if (!ids)
    return gfail(g, ATTND_CLIENT_ENOMEM, "out of memory");
  size_t i;
  int rc = 0;
  for (i = 0; i < g->n; i++)
    if ((rc = attnd_client_fork(g->clients[i], s->ids[i], &ids[i])) != 0) {
      rc = dfail(g, i, rc, 0);
      goto fail_fork;
    }
  if ((rc = add_session(g, ids)) != 0)
    goto fail_fork;
  *child = ids[0];
  return 0;
fail_fork:
  while (i-- > 0)
    attnd_client_close_session(g->clients[i], ids[i]);
  free(ids);
  return rc;
}

int attnd_shard_truncate(attnd_shard_group_t *g, uint64_t session, uint32_t len) {
  shard_session_t *s = find(g, session);
  if (!s)
    return ATTND_CLIENT_EINVAL;
  int first = 0;
  for (size_t i = 0; i < g->n; i++) {
    int rc = attnd_client_truncate(g->clients[i], s->ids[i], len);
    if (rc != 0)
      first = dfail(g, i, rc, first);
  }
  return first;
}

int attnd_shard_plan(attnd_shard_group_t *g, const attnd_client_item_t *items, size_t nitems,
                     uint64_t *plans) {
  attnd_client_item_t *mine = nitems ? malloc(nitems * sizeof(*mine)) : NULL;
  const shard_session_t **ss = nitems ? malloc(nitems * sizeof(*ss)) : NULL;
  int rc = 0;
  if (nitems && (!mine || !ss)) {
    rc = gfail(g, ATTND_CLIENT_ENOMEM, "out of memory");
    goto done;
  }
  for (size_t j = 0; j < nitems; j++)
    if (!(ss[j] = find(g, items[j].session))) {
      rc = gfail(g, ATTND_CLIENT_EINVAL, "item %zu: session %016llx is not of this group", j,
                 (unsigned long long)items[j].session);
      goto done;
    }
  for (size_t i = 0; i < g->n; i++) {
    for (size_t j = 0; j < nitems; j++) {
      mine[j] = items[j];
      mine[j].session = ss[j]->ids[i];
    }
    if ((rc = attnd_client_plan(g->clients[i], mine, nitems, &plans[i])) != 0) {
      rc = dfail(g, i, rc, 0);
      goto done;
    }
  }
done:
  free(mine);
  free(ss);
  return rc;
}

/* ---- steps ---- */

typedef struct {
  const uint8_t *base; /* the caller's packed tensor */
  uint32_t rows;
  size_t row_bytes;  /* a whole row of the model: heads * dim * esize */
  size_t offset;     /* this daemon's first head, in bytes into a row */
  size_t part_bytes; /* this daemon's heads of a row */
} strided_arg_t;

/* Tensor.data of one daemon: its heads' bytes of every row, written row by row
 * straight from the caller's tensor. */
static bool enc_strided_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg) {
  const strided_arg_t *a = *arg;
  if (!a || a->rows == 0 || a->part_bytes == 0)
    return true;
  if (!pb_encode_tag_for_field(s, f) || !pb_encode_varint(s, (uint64_t)a->rows * a->part_bytes))
    return false;
  for (uint32_t r = 0; r < a->rows; r++)
    if (!pb_write(s, a->base + r * a->row_bytes + a->offset, a->part_bytes))
      return false;
  return true;
}

static void set_strided(attnd_v1_Tensor *t, strided_arg_t *a, int dtype, const void *data,
                        uint32_t rows, uint32_t heads, uint32_t hbegin, uint32_t hcount,
                        uint32_t dim) {
  const size_t es = 2;
  t->dtype = (attnd_v1_DType)dtype;
  t->shape_count = 3;
  t->shape[0] = rows;
  t->shape[1] = hcount;
  t->shape[2] = dim;
  *a = (strided_arg_t){data, rows, (size_t)heads * dim * es, (size_t)hbegin * dim * es,
                       (size_t)hcount * dim * es};
  t->data.funcs.encode = enc_strided_cb;
  t->data.arg = a;
}

int attnd_shard_step_send(attnd_shard_group_t *g, const attnd_client_step_t *s,
                          const uint64_t *plans, uint64_t *ids) {
  const attnd_v1_ModelShape *m = &g->model;
  if (s->dtype != attnd_v1_DType_DTYPE_BF16 && s->dtype != attnd_v1_DType_DTYPE_FP16)
    return gfail(g, ATTND_CLIENT_EINVAL, "step activations must be bf16 or fp16");
  if (s->q_heads != m->q_heads || s->kv_heads != m->kv_heads || s->head_dim != m->head_dim)
    return gfail(g, ATTND_CLIENT_EINVAL,
                 "step of %u/%u heads, d %u; the group's model has %u/%u, d %u", s->q_heads,
                 s->kv_heads, s->head_dim, m->q_heads, m->kv_heads, m->head_dim);
  if (!plans || !ids)
    return gfail(g, ATTND_CLIENT_EINVAL, "a sharded step needs the plans of attnd_shard_plan");
  int first = 0;
  for (size_t i = 0; i < g->n; i++) {
    const attnd_shard_range_t *r = &g->ranges[i];
    attnd_v1_Request req = attnd_v1_Request_init_zero;
    strided_arg_t qa, ka, va;
    req.which_call = attnd_v1_Request_step_tag;
    attnd_v1_StepRequest *st = &req.call.step;
    st->layer = s->layer;
    st->plan = plans[i];
    if (s->q && s->q_rows) {
      st->has_q = true;
      set_strided(&st->q, &qa, s->dtype, s->q, s->q_rows, m->q_heads, r->q_begin,
                  r->q_end - r->q_begin, m->head_dim);
    }
    st->has_k = st->has_v = true;
    set_strided(&st->k, &ka, s->dtype, s->k, s->kv_rows, m->kv_heads, r->kv_begin,
                r->kv_end - r->kv_begin, m->head_dim);
    set_strided(&st->v, &va, s->dtype, s->v, s->kv_rows, m->kv_heads, r->kv_begin,
                r->kv_end - r->kv_begin, m->head_dim);
    st->want_lse = s->want_lse != 0;
    st->fp32_out = s->fp32_out != 0;
    ids[i] = 0;
    int rc = attnd_client_send(g->clients[i], &req, &ids[i]);
    if (rc != 0)
      first = dfail(g, i, rc, first);
  }
  return first;
}

/* Joins one daemon's answer into out and lse. */
static int join(attnd_shard_group_t *g, size_t i, const attnd_client_resp_t *resp, void *out,
                size_t out_bytes, float *lse) {
  const attnd_v1_ModelShape *m = &g->model;
  const attnd_shard_range_t *r = &g->ranges[i];
  const uint32_t hq = r->q_end - r->q_begin;
  const uint8_t *data;
  size_t nbytes;
  attnd_v1_Tensor meta;
  if (attnd_client_resp_tensor(resp, 0, &data, &nbytes, &meta) != 0)
    return gfail(g, ATTND_CLIENT_EPROTO, "daemon %zu: step answer without out", i);
  const size_t es = meta.dtype == attnd_v1_DType_DTYPE_FP32 ? 4 : 2;
  if (meta.shape_count != 3 || meta.shape[1] != hq || meta.shape[2] != m->head_dim ||
      nbytes != (size_t)meta.shape[0] * hq * m->head_dim * es)
    return gfail(g, ATTND_CLIENT_EPROTO, "daemon %zu: out of an unexpected shape", i);
  const uint32_t rows = meta.shape[0];
  if ((size_t)rows * m->q_heads * m->head_dim * es != out_bytes)
    return gfail(g, ATTND_CLIENT_EINVAL, "out buffer of %zu bytes; the answer needs %zu", out_bytes,
                 (size_t)rows * m->q_heads * m->head_dim * es);
  attnd_shard_scatter(out, data, rows, m->q_heads, r->q_begin, hq, m->head_dim, es);
  if (lse) {
    if (attnd_client_resp_tensor(resp, 1, &data, &nbytes, &meta) != 0)
      return gfail(g, ATTND_CLIENT_EPROTO, "daemon %zu: step answer without lse", i);
    if (nbytes != (size_t)rows * hq * 4)
      return gfail(g, ATTND_CLIENT_EPROTO, "daemon %zu: lse of an unexpected size", i);
    attnd_shard_scatter(lse, data, rows, m->q_heads, r->q_begin, hq, 1, 4);
  }
  return 0;
}

int attnd_shard_step_recv(attnd_shard_group_t *g, const uint64_t *ids, void *out, size_t out_bytes,
                          float *lse) {
  int first = 0;
  for (size_t i = 0; i < g->n; i++) {
    attnd_client_resp_t resp;
    memset(&resp, 0, sizeof(resp)); /* freed whatever recv returns (free(NULL) when nothing came) */
    if (ids[i] == 0)                /* never sent: step_send failed for it */
      continue;
    int rc = attnd_client_recv(g->clients[i], ids[i], &resp);
    if (rc != 0) {
      first = dfail(g, i, rc, first);
      attnd_client_resp_free(&resp);
      continue;
    }
    if (first == 0)
      first = join(g, i, &resp, out, out_bytes, lse);
    attnd_client_resp_free(&resp);
  }
  return first;
}

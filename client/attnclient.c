/* attnclient.c: libattnclient (see attnclient.h for the contract).
 *
 * Blocking sockets and poll() for the receive timeout: a client library has no
 * event loop of its own to lean on, and blocking calls are what attnctl and
 * simple orchestrators want. Pipelining still works because sends never wait
 * for answers. */
#include "attnclient.h"
#include "attnclient_internal.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <pb_decode.h>
#include <pb_encode.h>

const char *attnd_client_strerror(int err) {
  switch (err) {
  case ATTND_CLIENT_OK:
    return "ok";
  case ATTND_CLIENT_ECONNECT:
    return "cannot connect";
  case ATTND_CLIENT_EIO:
    return "connection error";
  case ATTND_CLIENT_EPROTO:
    return "protocol error";
  case ATTND_CLIENT_ESTATUS:
    return "daemon answered an error";
  case ATTND_CLIENT_EINVAL:
    return "invalid argument";
  case ATTND_CLIENT_ENOMEM:
    return "out of memory";
  case ATTND_CLIENT_ETIMEDOUT:
    return "timed out";
  default:
    return "unknown error";
  }
}

const char *attnd_client_status_name(int code) {
  /* Names come from the proto (nanopb's enum_to_string option). */
  return attnd_v1_Status_Code_name((attnd_v1_Status_Code)code);
}

static int exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

int attnd_client_default_socket(char *buf, size_t len) {
  char cand[5][256];
  int n = 0, first_applicable = -1;
  const char *rt = getenv("RUNTIME_DIRECTORY");
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  int root = geteuid() == 0;

  if (!buf || len == 0)
    return ATTND_CLIENT_EINVAL;
  if (rt && *rt) {
    /* systemd may list several directories separated by ':'; the daemon uses the first. */
    size_t l = strcspn(rt, ":");
    snprintf(cand[n++], sizeof(cand[0]), "%.*s/attnd.sock", (int)(l < 200 ? l : 200), rt);
  }
  if (root)
    snprintf(cand[n++], sizeof(cand[0]), "/run/attnd/attnd.sock");
  if (xdg && *xdg)
    snprintf(cand[n++], sizeof(cand[0]), "%.200s/attnd.sock", xdg);
  snprintf(cand[n++], sizeof(cand[0]), "/tmp/attnd-%u/attnd.sock", (unsigned)getuid());
  first_applicable = 0;
  /* A user in the attnd group talks to the system daemon when it runs no daemon of its own. */
  if (!root)
    snprintf(cand[n++], sizeof(cand[0]), "/run/attnd/attnd.sock");
  for (int i = 0; i < n; i++) {
    if (exists(cand[i])) {
      snprintf(buf, len, "%s", cand[i]);
      return 0;
    }
  }
  snprintf(buf, len, "%s", cand[first_applicable]);
  return 0;
}

static int connect_unix(attnd_client_t *c, const char *path) {
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof(sa));
  sa.sun_family = AF_UNIX;
  if (strlen(path) >= sizeof(sa.sun_path))
    return attnd_client_fail(c, ATTND_CLIENT_ECONNECT, "socket path too long: %s", path);
  memcpy(sa.sun_path, path, strlen(path) + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return attnd_client_fail(c, ATTND_CLIENT_ECONNECT, "socket: %s", strerror(errno));
  if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
    int e = errno;
    close(fd);
    return attnd_client_fail(
        c, ATTND_CLIENT_ECONNECT, "cannot connect to attnd at unix socket %s: %s%s", path,
        strerror(e),
        e == ENOENT || e == ECONNREFUSED ? " (is attnd running? try --socket PATH)" : "");
  }
  c->fd = fd;
  attnd_client_io_tune(c);
  return 0;
}

static int connect_tcp(attnd_client_t *c, const char *addr) {
  char host[256];
  const char *colon = strrchr(addr, ':');
  if (!colon || colon == addr || !colon[1])
    return attnd_client_fail(c, ATTND_CLIENT_ECONNECT, "bad TCP address %s (want HOST:PORT)", addr);
  size_t hl = (size_t)(colon - addr);
  if (addr[0] == '[' && hl >= 2 && addr[hl - 1] == ']') {
    addr++;
    hl -= 2;
  }
  if (hl >= sizeof(host))
    return attnd_client_fail(c, ATTND_CLIENT_ECONNECT, "host name too long");
  memcpy(host, addr, hl);
  host[hl] = 0;

  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int rc = getaddrinfo(host, colon + 1, &hints, &res);
  if (rc != 0)
    return attnd_client_fail(c, ATTND_CLIENT_ECONNECT, "cannot resolve %s: %s", c->addr,
                             gai_strerror(rc));
  int e = 0;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      e = errno;
      continue;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      int one = 1;
      /* Small request/response frames: Nagle would add a delay to every call. */
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      c->fd = fd;
      attnd_client_io_tune(c);
      freeaddrinfo(res);
      return 0;
    }
    e = errno;
    close(fd);
  }
  freeaddrinfo(res);
  return attnd_client_fail(c, ATTND_CLIENT_ECONNECT, "cannot connect to attnd at tcp %s: %s",
                           c->addr, strerror(e));
}

int attnd_client_connect(attnd_client_t **out, const char *addr) {
  attnd_client_t *c = calloc(1, sizeof(*c));
  *out = c;
  if (!c)
    return ATTND_CLIENT_ENOMEM;
  c->fd = -1;
  c->next_id = 1;
  if (!addr || !*addr)
    attnd_client_default_socket(c->addr, sizeof(c->addr));
  else
    snprintf(c->addr, sizeof(c->addr), "%s", addr);
  if (strchr(c->addr, '/'))
    return connect_unix(c, c->addr);
  return connect_tcp(c, c->addr);
}

void attnd_client_free(attnd_client_t *c) {
  if (!c)
    return;
  if (c->fd >= 0)
    close(c->fd);
  while (c->pending) {
    pending_t *p = c->pending;
    c->pending = p->next;
    attnd_client_resp_free(&p->resp);
    free(p);
  }
  attnd_client_io_free(c);
  free(c);
}

const char *attnd_client_addr(const attnd_client_t *c) {
  return c->addr;
}
const char *attnd_client_errmsg(const attnd_client_t *c) {
  return c->errmsg;
}
int attnd_client_status(const attnd_client_t *c) {
  return c->status;
}
uint64_t attnd_client_epoch(const attnd_client_t *c) {
  return c->epoch;
}
void attnd_client_set_timeout(attnd_client_t *c, int ms) {
  c->timeout_ms = ms < 0 ? 0 : ms;
}

/* ---- encoding helpers (callback fields) ---- */

typedef struct {
  const void *p;
  size_t n;
} bytes_arg_t;

static bool enc_bytes_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg) {
  const bytes_arg_t *b = *arg;
  if (!b || b->n == 0)
    return true;
  return pb_encode_tag_for_field(s, f) && pb_encode_string(s, b->p, b->n);
}

typedef struct {
  const uint32_t *v;
  size_t n;
} u32s_arg_t;

/* Packed repeated uint32, as proto3 encodes them by default. */
static bool enc_u32s_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg) {
  const u32s_arg_t *a = *arg;
  if (!a || a->n == 0)
    return true;
  pb_ostream_t sz = PB_OSTREAM_SIZING;
  for (size_t i = 0; i < a->n; i++)
    pb_encode_varint(&sz, a->v[i]);
  if (!pb_encode_tag(s, PB_WT_STRING, f->tag) || !pb_encode_varint(s, sz.bytes_written))
    return false;
  for (size_t i = 0; i < a->n; i++)
    if (!pb_encode_varint(s, a->v[i]))
      return false;
  return true;
}

typedef struct {
  const attnd_client_item_t *items;
  size_t n;
} items_arg_t;

static bool enc_items_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg) {
  const items_arg_t *a = *arg;
  for (size_t i = 0; a && i < a->n; i++) {
    const attnd_client_item_t *it = &a->items[i];
    attnd_v1_Item m = attnd_v1_Item_init_zero;
    u32s_arg_t toks = {it->tokens, it->tokens ? it->n : 0};
    m.session = it->session;
    m.start = it->start;
    m.n = it->n;
    m.kv_only = it->kv_only != 0;
    m.tokens.funcs.encode = enc_u32s_cb;
    m.tokens.arg = &toks;
    if (!pb_encode_tag_for_field(s, f) || !pb_encode_submessage(s, attnd_v1_Item_fields, &m))
      return false;
  }
  return true;
}

/* ---- reading callback fields from the raw frame ---- */

/* Finds length-delimited field `tag` at the top level of buf. nanopb clears
 * callbacks inside a oneof before decoding it, so the callback fields of a
 * result are read with a second pass over the frame instead. */
static int find_field(const uint8_t *buf, size_t len, uint32_t want, const uint8_t **sub,
                      size_t *sublen) {
  pb_istream_t s = pb_istream_from_buffer(buf, len);
  while (s.bytes_left > 0) {
    pb_wire_type_t wt;
    uint32_t tag;
    bool eof;
    if (!pb_decode_tag(&s, &wt, &tag, &eof))
      return ATTND_CLIENT_EPROTO;
    if (tag == want && wt == PB_WT_STRING) {
      uint32_t l;
      if (!pb_decode_varint32(&s, &l) || l > s.bytes_left)
        return ATTND_CLIENT_EPROTO;
      *sub = (const uint8_t *)s.state;
      *sublen = l;
      return 0;
    }
    if (!pb_skip_field(&s, wt))
      return ATTND_CLIENT_EPROTO;
  }
  return ATTND_CLIENT_EPROTO;
}

typedef struct {
  const uint8_t *p;
  size_t n;
} span_t;

static bool dec_span_cb(pb_istream_t *s, const pb_field_t *f, void **arg) {
  span_t *sp = *arg;
  /* A buffer stream's state is the read pointer: the bytes stay in the frame. */
  sp->p = (const uint8_t *)s->state;
  sp->n = s->bytes_left;
  return pb_read(s, NULL, s->bytes_left);
}

int attnd_client_resp_tensor(const attnd_client_resp_t *resp, int which, const uint8_t **data,
                             size_t *nbytes, attnd_v1_Tensor *meta) {
  const uint8_t *sub;
  size_t sublen;
  if (!resp || !resp->raw || (which != 0 && which != 1))
    return ATTND_CLIENT_EINVAL;
  if (find_field(resp->raw, resp->rawlen, attnd_v1_Response_step_tag, &sub, &sublen))
    return ATTND_CLIENT_EPROTO;
  attnd_v1_StepResponse sr = attnd_v1_StepResponse_init_zero;
  span_t out = {0}, lse = {0};
  sr.out.data.funcs.decode = dec_span_cb;
  sr.out.data.arg = &out;
  sr.lse.data.funcs.decode = dec_span_cb;
  sr.lse.data.arg = &lse;
  pb_istream_t is = pb_istream_from_buffer(sub, sublen);
  if (!pb_decode(&is, attnd_v1_StepResponse_fields, &sr))
    return ATTND_CLIENT_EPROTO;
  if (which == 0 ? !sr.has_out : !sr.has_lse)
    return ATTND_CLIENT_EPROTO;
  span_t *sp = which == 0 ? &out : &lse;
  *data = sp->p;
  *nbytes = sp->n;
  if (meta) {
    *meta = which == 0 ? sr.out : sr.lse;
    memset(&meta->data, 0, sizeof(meta->data));
  }
  return 0;
}

typedef struct {
  attnd_v1_SessionInfo *out;
  size_t max, n;
} sessions_arg_t;

static bool dec_session_cb(pb_istream_t *s, const pb_field_t *f, void **arg) {
  sessions_arg_t *a = *arg;
  attnd_v1_SessionInfo si = attnd_v1_SessionInfo_init_zero;
  if (!pb_decode(s, attnd_v1_SessionInfo_fields, &si))
    return false;
  if (a->n < a->max)
    a->out[a->n] = si;
  a->n++;
  return true;
}

int attnd_client_resp_sessions(const attnd_client_resp_t *resp, attnd_v1_SessionInfo *out,
                               size_t max, size_t *n) {
  const uint8_t *sub;
  size_t sublen;
  *n = 0;
  if (!resp || !resp->raw)
    return ATTND_CLIENT_EINVAL;
  if (resp->msg.which_result != attnd_v1_Response_list_sessions_tag)
    return ATTND_CLIENT_EPROTO;
  if (find_field(resp->raw, resp->rawlen, attnd_v1_Response_list_sessions_tag, &sub, &sublen))
    return 0; /* an empty list may be encoded as nothing at all */
  sessions_arg_t a = {out, max, 0};
  attnd_v1_ListSessionsResponse lr = attnd_v1_ListSessionsResponse_init_zero;
  lr.sessions.funcs.decode = dec_session_cb;
  lr.sessions.arg = &a;
  pb_istream_t is = pb_istream_from_buffer(sub, sublen);
  if (!pb_decode(&is, attnd_v1_ListSessionsResponse_fields, &lr))
    return ATTND_CLIENT_EPROTO;
  *n = a.n;
  return 0;
}

/* ---- synchronous wrappers ---- */

static int expect(attnd_client_t *c, attnd_client_resp_t *r, pb_size_t tag) {
  if (r->msg.which_result != tag) {
    attnd_client_resp_free(r);
    return attnd_client_fail(c, ATTND_CLIENT_EPROTO, "unexpected result (field %u) from %s",
                             (unsigned)r->msg.which_result, c->addr);
  }
  return 0;
}

int attnd_client_hello(attnd_client_t *c, const char *token) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_hello_tag;
  snprintf(req.call.hello.token, sizeof(req.call.hello.token), "%s", token ? token : "");
  int rc = attnd_client_call(c, &req, &r);
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_health(attnd_client_t *c, attnd_v1_HealthResponse *out) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_health_tag;
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0 && (rc = expect(c, &r, attnd_v1_Response_health_tag)) == 0)
    *out = r.msg.result.health;
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_stats(attnd_client_t *c, attnd_v1_StatsResponse *out) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_stats_tag;
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0 && (rc = expect(c, &r, attnd_v1_Response_stats_tag)) == 0)
    *out = r.msg.result.stats;
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_list_sessions(attnd_client_t *c, attnd_v1_SessionInfo *out, size_t max,
                               size_t *n) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_list_sessions_tag;
  *n = 0;
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0) {
    rc = attnd_client_resp_sessions(&r, out, max, n);
    if (rc)
      attnd_client_fail(c, rc, "cannot parse the session list from %s", c->addr);
  }
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_open_session(attnd_client_t *c, const uint32_t *tokens, size_t ntokens,
                              uint64_t *session, uint32_t *cached_len) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  u32s_arg_t toks = {tokens, tokens ? ntokens : 0};
  req.which_call = attnd_v1_Request_open_session_tag;
  req.call.open_session.tokens.funcs.encode = enc_u32s_cb;
  req.call.open_session.tokens.arg = &toks;
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0 && (rc = expect(c, &r, attnd_v1_Response_open_session_tag)) == 0) {
    *session = r.msg.result.open_session.session;
    if (cached_len)
      *cached_len = r.msg.result.open_session.cached_len;
  }
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_close_session(attnd_client_t *c, uint64_t session) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_close_session_tag;
  req.call.close_session.session = session;
  int rc = attnd_client_call(c, &req, &r);
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_fork(attnd_client_t *c, uint64_t session, uint64_t *child) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_fork_tag;
  req.call.fork.session = session;
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0 && (rc = expect(c, &r, attnd_v1_Response_fork_tag)) == 0)
    *child = r.msg.result.fork.session;
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_truncate(attnd_client_t *c, uint64_t session, uint32_t len) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_truncate_tag;
  req.call.truncate.session = session;
  req.call.truncate.len = len;
  int rc = attnd_client_call(c, &req, &r);
  attnd_client_resp_free(&r);
  return rc;
}

static void set_f32(attnd_v1_Tensor *t, bool *has, bytes_arg_t *b, const float *v, uint32_t heads,
                    uint32_t dim) {
  if (!v)
    return;
  *has = true;
  t->dtype = attnd_v1_DType_DTYPE_FP32;
  t->shape_count = dim ? 2 : 1;
  t->shape[0] = heads;
  t->shape[1] = dim;
  b->p = v; /* the wire is little-endian, like every host attnd runs on */
  b->n = (size_t)heads * (dim ? dim : 1) * sizeof(float);
  t->data.funcs.encode = enc_bytes_cb;
  t->data.arg = b;
}

int attnd_client_set_scales(attnd_client_t *c, uint32_t layer, const float *k_scale,
                            const float *v_scale, const float *k_zero, const float *v_zero,
                            uint32_t kv_heads, uint32_t dim, int drop_cached_kv,
                            uint64_t *version) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  bytes_arg_t b[4];
  req.which_call = attnd_v1_Request_set_scales_tag;
  attnd_v1_SetScalesRequest *s = &req.call.set_scales;
  s->layer = layer;
  set_f32(&s->k_scale, &s->has_k_scale, &b[0], k_scale, kv_heads, dim);
  set_f32(&s->v_scale, &s->has_v_scale, &b[1], v_scale, kv_heads, dim);
  set_f32(&s->k_zero, &s->has_k_zero, &b[2], k_zero, kv_heads, dim);
  set_f32(&s->v_zero, &s->has_v_zero, &b[3], v_zero, kv_heads, dim);
  s->drop_cached_kv = drop_cached_kv != 0;
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0 && (rc = expect(c, &r, attnd_v1_Response_set_scales_tag)) == 0 && version)
    *version = r.msg.result.set_scales.version;
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_set_sinks(attnd_client_t *c, uint32_t layer, const float *sinks, uint32_t q_heads,
                           uint64_t *version) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  bytes_arg_t b;
  req.which_call = attnd_v1_Request_set_sinks_tag;
  attnd_v1_SetSinksRequest *s = &req.call.set_sinks;
  s->layer = layer;
  set_f32(&s->sinks, &s->has_sinks, &b, sinks, q_heads, 0);
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0 && (rc = expect(c, &r, attnd_v1_Response_set_sinks_tag)) == 0 && version)
    *version = r.msg.result.set_sinks.version;
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_plan(attnd_client_t *c, const attnd_client_item_t *items, size_t nitems,
                      uint64_t *plan) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  items_arg_t ia = {items, nitems};
  req.which_call = attnd_v1_Request_plan_tag;
  req.call.plan.items.funcs.encode = enc_items_cb;
  req.call.plan.items.arg = &ia;
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0 && (rc = expect(c, &r, attnd_v1_Response_plan_tag)) == 0)
    *plan = r.msg.result.plan.plan;
  attnd_client_resp_free(&r);
  return rc;
}

static void set_tensor(attnd_v1_Tensor *t, bytes_arg_t *b, int dtype, uint32_t rows, uint32_t heads,
                       uint32_t dim, const void *data) {
  t->dtype = (attnd_v1_DType)dtype;
  t->shape_count = 3;
  t->shape[0] = rows;
  t->shape[1] = heads;
  t->shape[2] = dim;
  b->p = data;
  b->n = (size_t)rows * heads * dim * 2;
  t->data.funcs.encode = enc_bytes_cb;
  t->data.arg = b;
}

/* A ref of [rows, heads, dim] (dim 0: [rows, heads]); buffer 0: unset. */
static void set_ref(attnd_v1_TensorRef *t, bool *has, const attnd_client_ref_t *r, int dtype,
                    uint32_t rows, uint32_t heads, uint32_t dim) {
  if (!r->buffer)
    return;
  *has = true;
  t->buffer = r->buffer;
  t->offset = r->offset;
  t->dtype = (attnd_v1_DType)dtype;
  t->shape_count = dim ? 3 : 2;
  memcpy(t->shape, (uint32_t[3]){rows, heads, dim}, sizeof(uint32_t[3]));
}

int attnd_client_step_send(attnd_client_t *c, const attnd_client_step_t *s, uint64_t *id) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  items_arg_t ia = {s->items, s->nitems};
  bytes_arg_t qb, kb, vb;
  if (s->dtype != attnd_v1_DType_DTYPE_BF16 && s->dtype != attnd_v1_DType_DTYPE_FP16)
    return attnd_client_fail(c, ATTND_CLIENT_EINVAL, "step activations must be bf16 or fp16");
  req.which_call = attnd_v1_Request_step_tag;
  attnd_v1_StepRequest *st = &req.call.step;
  st->layer = s->layer;
  st->plan = s->plan;
  if (s->plan == 0) {
    st->items.funcs.encode = enc_items_cb;
    st->items.arg = &ia;
  }
  if (s->refs) {
    const attnd_client_refs_t *r = s->refs;
    set_ref(&st->q_ref, &st->has_q_ref, &r->q, s->dtype, s->q_rows, s->q_heads, s->head_dim);
    set_ref(&st->k_ref, &st->has_k_ref, &r->k, s->dtype, s->kv_rows, s->kv_heads, s->head_dim);
    set_ref(&st->v_ref, &st->has_v_ref, &r->v, s->dtype, s->kv_rows, s->kv_heads, s->head_dim);
    set_ref(&st->out_ref, &st->has_out_ref, &r->out,
            s->fp32_out ? attnd_v1_DType_DTYPE_FP32 : s->dtype, s->q_rows, s->q_heads, s->head_dim);
    set_ref(&st->lse_ref, &st->has_lse_ref, &r->lse, attnd_v1_DType_DTYPE_FP32, s->q_rows,
            s->q_heads, 0);
  } else {
    if (s->q && s->q_rows) {
      st->has_q = true;
      set_tensor(&st->q, &qb, s->dtype, s->q_rows, s->q_heads, s->head_dim, s->q);
    }
    st->has_k = st->has_v = true;
    set_tensor(&st->k, &kb, s->dtype, s->kv_rows, s->kv_heads, s->head_dim, s->k);
    set_tensor(&st->v, &vb, s->dtype, s->kv_rows, s->kv_heads, s->head_dim, s->v);
  }
  st->want_lse = s->want_lse != 0;
  st->fp32_out = s->fp32_out != 0;
  return attnd_client_send(c, &req, id);
}

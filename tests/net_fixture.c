/* net_fixture.c: the transport tests' harness (net_fixture.h). */
#include "net_fixture.h"

void h_engine_closed(void *arg) {
  harness_t *h = arg;
  uv_close((uv_handle_t *)&h->async, NULL);
}

void h_drained(void *arg) {
  harness_t *h = arg;
  h->srv = NULL;
  attnd_engine_close(h->engine, h_engine_closed, h);
}

void h_async_cb(uv_async_t *a) {
  harness_t *h = a->data;
  if (h->fn) {
    h->fn(h);
    h->fn = NULL;
    uv_sem_post(&h->sem);
  }
  if (h->stop == 1) {
    h->stop = 2;
    if (h->metrics)
      attnd_metrics_close(h->metrics, NULL, NULL);
    attnd_server_drain(h->srv, h_drained, h);
  }
}

void *h_thread(void *arg) {
  harness_t *h = arg;
  char err[256];
  h->start_rc = -1;
  attnd_log_set_level(ATTND_LOG_WARN);
  uv_loop_init(&h->loop);
  if (attnd_engine_init(&h->engine, &h->loop, &h->cfg, err, sizeof(err)) != 0) {
    fprintf(stderr, "engine init: %s\n", err);
    uv_sem_post(&h->sem);
    return NULL;
  }
  if (attnd_server_start(&h->srv, &h->loop, &h->cfg, h->engine, err, sizeof(err)) != 0) {
    fprintf(stderr, "server start: %s\n", err);
    uv_sem_post(&h->sem);
    return NULL;
  }
  attnd_rpc_t *rpc = attnd_server_rpc(h->srv);
  h->epoch = rpc->epoch;
  if (h->cfg.metrics[0]) {
    if (attnd_metrics_start(&h->metrics, &h->loop, h->cfg.metrics, &rpc->counters, h->engine,
                            rpc->start_ns, err, sizeof(err)) != 0) {
      fprintf(stderr, "metrics: %s\n", err);
      uv_sem_post(&h->sem);
      return NULL;
    }
    h->metrics_port = attnd_metrics_port(h->metrics);
  }
  h->tcp_port = attnd_server_tcp_port(h->srv);
  uv_async_init(&h->loop, &h->async, h_async_cb);
  h->async.data = h;
  h->start_rc = 0;
  uv_sem_post(&h->sem);
  uv_run(&h->loop, UV_RUN_DEFAULT);
  h->loop_close_rc = uv_loop_close(&h->loop);
  return NULL;
}

/* A small model so the real engine's pool is tiny. */
void small_config(attnd_config_t *c, const char *dir) {
  attnd_config_defaults(c);
  c->layers = 2;
  c->shape.q_heads = 4;
  c->shape.kv_heads = 2;
  c->shape.head_dim = 64;
  c->shape.block_size = 16;
  c->kv_memory = 4 << 20;
  c->threads = 1;
  c->max_context = 4096;
  c->max_frame = 1 << 20;
  c->max_inflight = 4 << 20;
  c->backend = ATTND_BACKEND_CPU;
  snprintf(c->socket_path, sizeof(c->socket_path), "%s/attnd.sock", dir);
  snprintf(c->state_dir, sizeof(c->state_dir), "%s/state", dir);
  snprintf(c->listen, sizeof(c->listen), "127.0.0.1:0");
  snprintf(c->metrics, sizeof(c->metrics), "127.0.0.1:0");
  snprintf(c->log_level, sizeof(c->log_level), "warn");
}

harness_t *h_new(void (*tweak)(attnd_config_t *)) {
  harness_t *h = calloc(1, sizeof(*h));
  snprintf(h->dir, sizeof(h->dir), "/tmp/attnd-test-srv-XXXXXX");
  assert_non_null(mkdtemp(h->dir));
  small_config(&h->cfg, h->dir);
  if (tweak)
    tweak(&h->cfg);
  char err[256];
  assert_int_equal(attnd_config_validate(&h->cfg, err, sizeof(err)), 0);
  uv_sem_init(&h->sem, 0);
  return h;
}

void h_start(harness_t *h) {
  assert_int_equal(pthread_create(&h->th, NULL, h_thread, h), 0);
  uv_sem_wait(&h->sem);
  assert_int_equal(h->start_rc, 0);
}

harness_t *h_up(void (*tweak)(attnd_config_t *)) {
  harness_t *h = h_new(tweak);
  h_start(h);
  return h;
}

/* Runs fn on the loop thread and waits for it. */
void h_call(harness_t *h, void (*fn)(void *)) {
  h->fn = fn;
  uv_async_send(&h->async);
  uv_sem_wait(&h->sem);
}

void snap_stats(void *arg) {
  harness_t *h = arg;
  attnd_server_stats(h->srv, &h->stats);
}

void h_down(harness_t *h) {
  h->stop = 1;
  uv_async_send(&h->async);
  assert_int_equal(pthread_join(h->th, NULL), 0);
  /* Every handle closed: the loop closes cleanly. */
  assert_int_equal(h->loop_close_rc, 0);
  struct stat st;
  assert_int_not_equal(stat(h->cfg.socket_path, &st), 0); /* socket file removed */
  uv_sem_destroy(&h->sem);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", h->dir);
  assert_int_equal(system(cmd), 0);
  free(h);
}

void sun_set(struct sockaddr_un *a, const char *path) {
  memset(a, 0, sizeof(*a));
  a->sun_family = AF_UNIX;
  size_t n = strlen(path);
  assert_true(n < sizeof(a->sun_path));
  memcpy(a->sun_path, path, n);
}

int connect_unix(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un a;
  sun_set(&a, path);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
  return fd;
}

int connect_tcp_addr(const char *ip, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, ip, &a.sin_addr);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

void write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR)
      continue;
    assert_true(w > 0);
    b += w;
    n -= (size_t)w;
  }
}

/* Reads exactly n bytes; 0 on success, 1 on EOF, -1 on timeout. */
int read_all(int fd, void *p, size_t n, int timeout_ms) {
  uint8_t *b = p;
  while (n) {
    struct pollfd pf = {fd, POLLIN, 0};
    int pr = poll(&pf, 1, timeout_ms);
    if (pr == 0)
      return -1;
    ssize_t r = read(fd, b, n);
    if (r < 0 && (errno == EINTR || errno == EAGAIN))
      continue;
    if (r < 0 && errno == ECONNRESET)
      return 1;
    if (r == 0)
      return 1;
    assert_true(r > 0);
    b += r;
    n -= (size_t)r;
  }
  return 0;
}

void send_raw_frame(int fd, const void *body, size_t n) {
  uint8_t hdr[4];
  attnd_rpc_frame_header(hdr, (uint32_t)n);
  write_all(fd, hdr, 4);
  if (n)
    write_all(fd, body, n);
}

/* Like send_call, but a peer that already closed is not a failure: -1. */
int try_send_call(int fd, uint64_t id, uint32_t call) {
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, id);
  pbw_bytes(&w, call, "", 0);
  uint8_t buf[64];
  attnd_rpc_frame_header(buf, (uint32_t)w.n);
  memcpy(buf + 4, w.b, w.n);
  ssize_t n = send(fd, buf, w.n + 4, MSG_NOSIGNAL);
  int ok = n == (ssize_t)(w.n + 4);
  pbw_free(&w);
  return ok ? 0 : -1;
}

void send_call(int fd, uint64_t id, uint32_t call) {
  pbw_t w;
  pbw_init(&w);
  pbw_uint(&w, 1, id);
  if (call)
    pbw_bytes(&w, call, "", 0);
  send_raw_frame(fd, w.b, w.n);
  pbw_free(&w);
}

/* Reads one response; 0, or 1 on EOF. */
int recv_resp(int fd, attnd_v1_Response *r) {
  uint8_t hdr[4];
  int rc = read_all(fd, hdr, 4, 5000);
  assert_int_not_equal(rc, -1);
  if (rc)
    return 1;
  uint32_t n =
      ((uint32_t)hdr[0] << 24) | ((uint32_t)hdr[1] << 16) | ((uint32_t)hdr[2] << 8) | hdr[3];
  uint8_t *b = malloc(n ? n : 1);
  assert_int_equal(read_all(fd, b, n, 5000), 0);
  memset(r, 0, sizeof(*r));
  pb_istream_t s = pb_istream_from_buffer(b, n);
  assert_true(pb_decode(&s, attnd_v1_Response_fields, r));
  free(b);
  return 0;
}

void expect_eof(int fd) {
  uint8_t b;
  int rc = read_all(fd, &b, 1, 5000);
  assert_int_equal(rc, 1);
}

void health_ok(int fd, uint64_t id, attnd_v1_Response *r) {
  send_call(fd, id, attnd_v1_Request_health_tag);
  assert_int_equal(recv_resp(fd, r), 0);
  assert_int_equal(r->id, id);
  assert_int_equal(r->status.code, 0);
  assert_int_equal(r->which_result, attnd_v1_Response_health_tag);
}

uint16_t bf16_rand(void) {
  float f = (float)rand() / (float)RAND_MAX - 0.5f;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

/* Request{id, step{layer 0, one inline item (session, start 0, n tokens), q, k, v}}. */
void build_step(pbw_t *w, uint64_t id, uint64_t session, uint32_t n) {
  pbw_t st, it, tok;
  pbw_init(&st);
  pbw_init(&it);
  pbw_init(&tok);
  pbw_uint(&st, 1, 0);
  pbw_fixed64(&it, 1, session);
  pbw_uint(&it, 2, 0);
  pbw_uint(&it, 3, n);
  for (uint32_t i = 0; i < n; i++)
    pbw_varint(&tok, 1000 + i);
  pbw_sub(&it, 6, &tok);
  pbw_sub(&st, 3, &it);
  size_t qn = (size_t)n * 4 * 64, kn = (size_t)n * 2 * 64;
  uint16_t *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2);
  for (size_t i = 0; i < qn; i++)
    q[i] = bf16_rand();
  for (size_t i = 0; i < kn; i++) {
    k[i] = bf16_rand();
    v[i] = bf16_rand();
  }
  uint32_t qs[3] = {n, 4, 64}, ks[3] = {n, 2, 64};
  pbw_tensor(&st, 4, attnd_v1_DType_DTYPE_BF16, qs, 3, q, qn * 2);
  pbw_tensor(&st, 5, attnd_v1_DType_DTYPE_BF16, ks, 3, k, kn * 2);
  pbw_tensor(&st, 6, attnd_v1_DType_DTYPE_BF16, ks, 3, v, kn * 2);
  free(q);
  free(k);
  free(v);
  pbw_init(w);
  pbw_uint(w, 1, id);
  pbw_sub(w, attnd_v1_Request_step_tag, &st);
}

uint64_t open_session(int fd, uint64_t id) {
  attnd_v1_Response r;
  send_call(fd, id, attnd_v1_Request_open_session_tag);
  assert_int_equal(recv_resp(fd, &r), 0);
  assert_int_equal(r.status.code, 0);
  assert_int_equal(r.which_result, attnd_v1_Response_open_session_tag);
  return r.result.open_session.session;
}

void append_frame(pbw_t *all, pbw_t *w) {
  uint8_t hdr[4];
  attnd_rpc_frame_header(hdr, (uint32_t)w->n);
  pbw_raw(all, hdr, 4);
  pbw_raw(all, w->b, w->n);
  pbw_free(w);
}

double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* test_client_shard.c: libattnclient's head-sharded mode (client/attnclient_shard.h).
 *
 * Without a daemon: range resolution from Health shapes (reported, declared,
 * whole model) and every way a group can fail to form one model; head gather
 * and scatter on random data. With the real daemon (skipped when it is not
 * built): two shards (one started with --kv-heads 0:1, one of the shard
 * shape 2 q / 1 kv heads with its range declared)
 * against one of the whole 4 / 2 shape, prefill and pipelined decode, bf16 and
 * fp32 outputs and lse, bit for bit. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "attnclient_shard.h"

static unsigned seed;

static uint32_t rnd(void) {
  seed = seed * 1664525u + 1013904223u;
  return seed >> 8;
}

static attnd_v1_ModelShape shape(uint32_t q, uint32_t kv) {
  attnd_v1_ModelShape m = attnd_v1_ModelShape_init_zero;
  m.layers = 2;
  m.q_heads = q;
  m.kv_heads = kv;
  m.head_dim = 64;
  m.block_size = 16;
  strcpy(m.dtype, "bf16");
  strcpy(m.kv_cache, "bf16");
  strcpy(m.rope, "neox");
  m.rope_theta = 10000;
  m.rotary_dim = 64;
  m.softmax_scale = 0.125f;
  m.max_context = 4096;
  return m;
}

static attnd_v1_ModelShape reported(uint32_t b, uint32_t e, uint32_t tq, uint32_t tkv) {
  attnd_v1_ModelShape m = shape((e - b) * (tq / tkv), e - b);
  m.kv_head_begin = b;
  m.kv_head_end = e;
  m.model_q_heads = tq;
  m.model_kv_heads = tkv;
  return m;
}

static void test_resolve_reported(void **state) {
  attnd_v1_ModelShape s[3] = {reported(4, 8, 32, 8), reported(0, 3, 32, 8), reported(3, 4, 32, 8)};
  attnd_shard_range_t r[3];
  attnd_v1_ModelShape m;
  char err[256] = "";
  assert_int_equal(attnd_shard_resolve(s, NULL, 3, r, &m, err, sizeof(err)), 0);
  assert_int_equal(m.q_heads, 32);
  assert_int_equal(m.kv_heads, 8);
  assert_int_equal(r[0].kv_begin, 4);
  assert_int_equal(r[0].q_begin, 16);
  assert_int_equal(r[0].q_end, 32);
  assert_int_equal(r[1].q_end, 12);
  assert_int_equal(r[2].q_begin, 12);
  assert_int_equal(r[2].q_end, 16);
}

static void test_resolve_declared_and_whole(void **state) {
  attnd_v1_ModelShape s[2] = {shape(2, 1), shape(2, 1)};
  const uint32_t decl[4] = {1, 2, 0, 1};
  attnd_shard_range_t r[2];
  attnd_v1_ModelShape m;
  char err[256] = "";
  assert_int_equal(attnd_shard_resolve(s, decl, 2, r, &m, err, sizeof(err)), 0);
  assert_int_equal(m.q_heads, 4);
  assert_int_equal(r[0].q_begin, 2);
  assert_int_equal(r[1].q_begin, 0);
  /* One daemon with nothing declared holds the whole model. */
  attnd_v1_ModelShape one = shape(8, 2);
  assert_int_equal(attnd_shard_resolve(&one, NULL, 1, r, &m, err, sizeof(err)), 0);
  assert_int_equal(r[0].kv_end, 2);
  assert_int_equal(m.q_heads, 8);
}

static void expect_fail(const attnd_v1_ModelShape *s, const uint32_t *decl, size_t n,
                        const char *what) {
  attnd_shard_range_t r[4];
  attnd_v1_ModelShape m;
  char err[256] = "";
  assert_int_equal(attnd_shard_resolve(s, decl, n, r, &m, err, sizeof(err)), ATTND_CLIENT_EINVAL);
  if (!strstr(err, what))
    fail_msg("error '%s' does not say '%s'", err, what);
}

static void test_resolve_failures(void **state) {
  attnd_v1_ModelShape s[2] = {shape(2, 1), shape(2, 1)};
  /* Two whole-model daemons both claim heads from 0. */
  expect_fail(s, NULL, 2, "held by daemons 0 and 1");
  const uint32_t gap[4] = {0, 1, 2, 3};
  expect_fail(s, gap, 2, "held by no daemon");
  const uint32_t wide[4] = {0, 2, 2, 3};
  expect_fail(s, wide, 2, "declared kv heads 0:2 but it holds 1");
  attnd_v1_ModelShape b[2] = {shape(2, 1), shape(2, 1)};
  b[1].block_size = 32;
  const uint32_t ok[4] = {0, 1, 1, 2};
  expect_fail(b, ok, 2, "block_size");
  strcpy(b[1].model_id, "other");
  b[1].block_size = 16;
  expect_fail(b, ok, 2, "model_id");
  attnd_v1_ModelShape grp[2] = {shape(2, 1), shape(4, 1)};
  expect_fail(grp, ok, 2, "not 2 per kv head");
  attnd_v1_ModelShape rep[2] = {reported(0, 1, 4, 2), reported(1, 2, 4, 2)};
  const uint32_t wrong[4] = {1, 2, 0, 1};
  expect_fail(rep, wrong, 2, "Health says 0:1");
  attnd_v1_ModelShape tot[2] = {reported(0, 1, 6, 3), reported(1, 2, 6, 3)};
  expect_fail(tot, NULL, 2, "model of 3 kv heads but hold 2");
  attnd_v1_ModelShape lie = reported(0, 2, 4, 2);
  lie.kv_heads = 1;
  lie.q_heads = 2;
  expect_fail(&lie, NULL, 1, "holds 1");
  expect_fail(s, NULL, 0, "at least one");
}

static void test_gather_scatter(void **state) {
  enum { R = 5, H = 6, D = 8 };
  uint16_t src[R][H][D], part[R][2][D], back[R][H][D];
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++)
      for (int d = 0; d < D; d++)
        src[r][h][d] = (uint16_t)rnd();
  attnd_shard_gather(part, src, R, H, 3, 2, D, 2);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++)
      assert_memory_equal(part[r][h], src[r][3 + h], sizeof(part[r][h]));
  memset(back, 0xA5, sizeof(back)); /* poisoned: unwritten heads must stay so */
  attnd_shard_scatter(back, part, R, H, 3, 2, D, 2);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++)
      for (int d = 0; d < D; d++)
        assert_int_equal(back[r][h][d], (h == 3 || h == 4) ? src[r][h][d] : 0xA5A5);
}

/* ---- against the real daemon ---- */

typedef struct {
  pid_t pid;
  char dir[256];
  char sock[320];
} daemon_t;

static daemon_t daemons[3];
static int have_daemons;

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* A daemon of q/kv heads qh/kvh; range: "A:B" for a second --kv-heads (the
 * held range, reported in Health), or NULL. */
static int spawn(daemon_t *d, const char *exe, const char *qh, const char *kvh, const char *range) {
  snprintf(d->dir, sizeof(d->dir), "/tmp/attnd-test-shard-XXXXXX");
  if (!mkdtemp(d->dir))
    return -1;
  snprintf(d->sock, sizeof(d->sock), "%s/attnd.sock", d->dir);
  d->pid = fork();
  if (d->pid < 0)
    return -1;
  if (d->pid == 0) {
    char log[320];
    snprintf(log, sizeof(log), "%s/attnd.log", d->dir);
    FILE *f = freopen(log, "w", stdout);
    (void)f;
    dup2(1, 2);
    execl(exe, exe, "--socket", d->sock, "--listen", "", "--metrics", "", "--backend", "cpu",
          "--kv-memory", "32M", "--layers", "2", "--q-heads", qh, "--kv-heads", kvh, "--head-dim",
          "64", "--block-size", "16", "--threads", "1", "--state-dir", d->dir,
          range ? "--kv-heads" : (char *)NULL, range, (char *)NULL);
    _exit(127);
  }
  for (int i = 0; i < 400; i++) {
    int st;
    if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
      fprintf(stderr, "attnd exited at start (status %d); see %s/attnd.log\n", st, d->dir);
      d->pid = -1;
      return -1;
    }
    attnd_client_t *c = NULL;
    int ok = attnd_client_connect(&c, d->sock) == 0;
    if (ok) {
      attnd_v1_HealthResponse h;
      ok = attnd_client_health(c, &h) == 0;
    }
    attnd_client_free(c);
    if (ok)
      return 0;
    sleep_ms(50);
  }
  return -1;
}

static void reap(daemon_t *d) {
  if (d->pid > 0) {
    int st = 0;
    kill(d->pid, SIGTERM);
    for (int i = 0; i < 400 && waitpid(d->pid, &st, WNOHANG) == 0; i++)
      sleep_ms(50);
    if (kill(d->pid, 0) == 0) {
      kill(d->pid, SIGKILL);
      waitpid(d->pid, &st, 0);
    }
    d->pid = -1;
  }
  if (d->dir[0]) {
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", d->dir);
    if (system(cmd) != 0)
      fprintf(stderr, "could not remove %s\n", d->dir);
  }
}

static int start_all(void **state) {
  const char *bd = getenv("ATTND_BUILD_DIR");
  char exe[600];
  snprintf(exe, sizeof(exe), "%s/daemon/attnd", bd ? bd : ".");
  if (access(exe, X_OK) != 0)
    return 0; /* the daemon tests skip */
  /* Shard 0 started with --kv-heads 0:1 (its range reported), shard 1 with
   * the shard's own shape and its range declared: both kinds in one group. */
  if (spawn(&daemons[0], exe, "4", "2", NULL) || spawn(&daemons[1], exe, "4", "2", "0:1") ||
      spawn(&daemons[2], exe, "2", "1", NULL))
    return -1;
  have_daemons = 1;
  return 0;
}

static int stop_all(void **state) {
  for (int i = 0; i < 3; i++)
    reap(&daemons[i]);
  return 0;
}

static void fill_bf16(uint16_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    /* A bf16 in about [-2, 2]: sign, exponent 126..127, random mantissa. */
    uint32_t r = rnd();
    p[i] = (uint16_t)(((r & 1) << 15) | ((126u + ((r >> 1) & 1)) << 7) | ((r >> 2) & 0x7F));
  }
}

/* One layer step on one daemon and on the group; outputs must be identical. */
static void step_both(attnd_client_t *one, uint64_t plan1, attnd_shard_group_t *g,
                      const uint64_t *plans, uint32_t layer, uint32_t rows, int fp32_out) {
  enum { HQ = 4, HKV = 2, D = 64 };
  const size_t es = fp32_out ? 4 : 2;
  uint16_t *q = malloc((size_t)rows * HQ * D * 2), *k = malloc((size_t)rows * HKV * D * 2);
  uint16_t *v = malloc((size_t)rows * HKV * D * 2);
  uint8_t *out = malloc((size_t)rows * HQ * D * es);
  float *lse = malloc((size_t)rows * HQ * 4);
  fill_bf16(q, (size_t)rows * HQ * D);
  fill_bf16(k, (size_t)rows * HKV * D);
  fill_bf16(v, (size_t)rows * HKV * D);
  attnd_client_step_t s = {.layer = layer,
                           .plan = plan1,
                           .dtype = attnd_v1_DType_DTYPE_BF16,
                           .q_heads = HQ,
                           .kv_heads = HKV,
                           .head_dim = D,
                           .q = q,
                           .q_rows = rows,
                           .k = k,
                           .v = v,
                           .kv_rows = rows,
                           .want_lse = 1,
                           .fp32_out = fp32_out};
  uint64_t id, ids[2];
  assert_int_equal(attnd_client_step_send(one, &s, &id), 0);
  assert_int_equal(attnd_shard_step_send(g, &s, plans, ids), 0);
  memset(out, 0xA5, (size_t)rows * HQ * D * es);
  memset(lse, 0xA5, (size_t)rows * HQ * 4);
  int rc = attnd_shard_step_recv(g, ids, out, (size_t)rows * HQ * D * es, lse);
  if (rc)
    fail_msg("sharded step: %s", attnd_shard_errmsg(g));
  attnd_client_resp_t r;
  assert_int_equal(attnd_client_recv(one, id, &r), 0);
  const uint8_t *o1, *l1;
  size_t n1, nl;
  assert_int_equal(attnd_client_resp_tensor(&r, 0, &o1, &n1, NULL), 0);
  assert_int_equal(attnd_client_resp_tensor(&r, 1, &l1, &nl, NULL), 0);
  assert_int_equal(n1, (size_t)rows * HQ * D * es);
  assert_memory_equal(out, o1, n1);
  assert_memory_equal(lse, l1, nl);
  attnd_client_resp_free(&r);
  free(q);
  free(k);
  free(v);
  free(out);
  free(lse);
}

static void test_sharded_equals_one_daemon(void **state) {
  if (!have_daemons) {
    fprintf(stderr, "skipped: attnd is not built yet\n");
    skip();
  }
  attnd_client_t *one, *c[2];
  assert_int_equal(attnd_client_connect(&one, daemons[0].sock), 0);
  assert_int_equal(attnd_client_connect(&c[0], daemons[1].sock), 0);
  assert_int_equal(attnd_client_connect(&c[1], daemons[2].sock), 0);
  const uint32_t decl[4] = {0, 0, 1, 2}; /* shard 0 reports its range */
  char err[256] = "";
  attnd_shard_group_t *g;
  if (attnd_shard_group_init(&g, c, decl, 2, err, sizeof(err)) != 0)
    fail_msg("group: %s", err);
  assert_int_equal(attnd_shard_model(g)->q_heads, 4);
  attnd_v1_HealthResponse h;
  assert_int_equal(attnd_client_health(c[0], &h), 0);
  assert_int_equal(h.model.kv_head_begin, 0);
  assert_int_equal(h.model.kv_head_end, 1);
  assert_int_equal(h.model.model_kv_heads, 2);
  assert_int_equal(h.model.q_heads, 2);
  assert_true(h.split_context);
  uint32_t toks[37];
  for (int i = 0; i < 37; i++)
    toks[i] = rnd() % 1000;
  uint64_t s1, sg;
  uint32_t cached;
  assert_int_equal(attnd_client_open_session(one, toks, 37, &s1, NULL), 0);
  assert_int_equal(attnd_shard_open_session(g, toks, 37, &sg, &cached), 0);
  assert_int_equal(cached, 0);
  uint32_t len = 0;
  for (int stepno = 0; stepno < 4; stepno++) {
    uint32_t n = stepno == 0 ? 37 : 1;
    attnd_client_item_t it1 = {s1, len, n, 0, toks}, itg = {sg, len, n, 0, toks};
    uint64_t p1, pg[2];
    assert_int_equal(attnd_client_plan(one, &it1, 1, &p1), 0);
    if (attnd_shard_plan(g, &itg, 1, pg) != 0)
      fail_msg("plan: %s", attnd_shard_errmsg(g));
    for (uint32_t layer = 0; layer < 2; layer++)
      step_both(one, p1, g, pg, layer, n, stepno == 2);
    len += n;
  }
  uint64_t kid;
  assert_int_equal(attnd_shard_fork(g, sg, &kid), 0);
  assert_int_equal(attnd_shard_truncate(g, kid, 16), 0);
  assert_int_equal(attnd_shard_close_session(g, kid), 0);
  /* A handle the group does not know is refused, not sent. */
  assert_int_equal(attnd_shard_close_session(g, kid), ATTND_CLIENT_EINVAL);
  attnd_client_item_t bad = {kid, 0, 1, 0, NULL};
  uint64_t pb2[2];
  assert_int_equal(attnd_shard_plan(g, &bad, 1, pb2), ATTND_CLIENT_EINVAL);
  /* A step of the wrong head count names the model's. */
  attnd_client_step_t wrong = {
      .dtype = attnd_v1_DType_DTYPE_BF16, .q_heads = 2, .kv_heads = 1, .head_dim = 64};
  uint64_t ids[2];
  assert_int_equal(attnd_shard_step_send(g, &wrong, pb2, ids), ATTND_CLIENT_EINVAL);
  assert_non_null(strstr(attnd_shard_errmsg(g), "4/2"));
  assert_int_equal(attnd_shard_close_session(g, sg), 0);
  attnd_shard_group_free(g);
  attnd_client_free(one);
  attnd_client_free(c[0]);
  attnd_client_free(c[1]);
}

int main(void) {
  const char *s = getenv("ATTND_TEST_SEED");
  seed = s ? (unsigned)strtoul(s, NULL, 10) : (unsigned)time(NULL);
  printf("seed %u\n", seed);
  const struct CMUnitTest unit[] = {
      cmocka_unit_test(test_resolve_reported),
      cmocka_unit_test(test_resolve_declared_and_whole),
      cmocka_unit_test(test_resolve_failures),
      cmocka_unit_test(test_gather_scatter),
  };
  const struct CMUnitTest live[] = {
      cmocka_unit_test(test_sharded_equals_one_daemon),
  };
  int rc = cmocka_run_group_tests_name("shard layout", unit, NULL, NULL);
  return rc | cmocka_run_group_tests_name("sharded group", live, start_all, stop_all);
}

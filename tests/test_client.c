/* test_client.c: libattnclient and attnctl against the real daemon.
 *
 * Tests that need the daemon start $ATTND_BUILD_DIR/daemon/attnd on a temporary
 * socket with a small shape and skip when it is not built yet. The no-daemon
 * cases (exit code 3, the default socket lookup) always run. */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "attnclient.h"

static char build_dir[512];
static char tmpdir[256];
static char sock_path[320];
static pid_t daemon_pid = -1;

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int path_of(char *buf, size_t len, const char *rel) {
  return snprintf(buf, len, "%s/%s", build_dir, rel) < (int)len ? 0 : -1;
}

/* Runs attnctl with args; returns its exit code and its stdout in out. */
static int run_attnctl(char *out, size_t outlen, const char *args) {
  char cmd[2048], exe[600];
  path_of(exe, sizeof(exe), "client/attnctl");
  snprintf(cmd, sizeof(cmd), "%s %s 2>/dev/null", exe, args);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(out, 1, outlen - 1, p);
  out[n] = 0;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int start_daemon(void **state) {
  char exe[600];
  path_of(exe, sizeof(exe), "daemon/attnd");
  if (access(exe, X_OK) != 0)
    return 0; /* tests that need it skip */
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/attnd-test-client-XXXXXX");
  if (!mkdtemp(tmpdir))
    return -1;
  snprintf(sock_path, sizeof(sock_path), "%s/attnd.sock", tmpdir);
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    char log[320];
    snprintf(log, sizeof(log), "%s/attnd.log", tmpdir);
    FILE *f = freopen(log, "w", stdout);
    (void)f;
    dup2(1, 2);
    execl(exe, exe, "--socket", sock_path, "--listen", "127.0.0.1:0", "--metrics", "", "--backend",
          "cpu", "--kv-memory", "64M", "--layers", "2", "--q-heads", "4", "--kv-heads", "2",
          "--head-dim", "64", "--block-size", "16", "--state-dir", tmpdir, (char *)NULL);
    _exit(127);
  }
  daemon_pid = pid;
  /* Wait until Health answers, not just until the socket exists. */
  for (int i = 0; i < 400; i++) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      fprintf(stderr, "attnd exited at start (status %d); see %s/attnd.log\n", st, tmpdir);
      daemon_pid = -1;
      return -1;
    }
    attnd_client_t *c = NULL;
    if (attnd_client_connect(&c, sock_path) == 0) {
      attnd_v1_HealthResponse h;
      int rc = attnd_client_health(c, &h);
      attnd_client_free(c);
      if (rc == 0)
        return 0;
    } else {
      attnd_client_free(c);
    }
    sleep_ms(50);
  }
  fprintf(stderr, "attnd did not answer Health within 20 s\n");
  return -1;
}

static int stop_daemon(void **state) {
  if (daemon_pid > 0) {
    int st = 0;
    kill(daemon_pid, SIGTERM);
    for (int i = 0; i < 400 && waitpid(daemon_pid, &st, WNOHANG) == 0; i++)
      sleep_ms(50);
    if (kill(daemon_pid, 0) == 0) {
      kill(daemon_pid, SIGKILL);
      waitpid(daemon_pid, &st, 0);
    }
    daemon_pid = -1;
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
      fprintf(stderr, "could not remove %s\n", tmpdir);
  }
  return 0;
}

#define NEED_DAEMON()                                                                              \
  do {                                                                                             \
    if (daemon_pid <= 0) {                                                                         \
      fprintf(stderr, "skipped: attnd is not built yet\n");                                        \
      skip();                                                                                      \
    }                                                                                              \
  } while (0)

static void test_connect_without_daemon_names_the_socket(void **state) {
  attnd_client_t *c = NULL;
  int rc = attnd_client_connect(&c, "/nonexistent/attnd.sock");
  assert_int_equal(rc, ATTND_CLIENT_ECONNECT);
  assert_non_null(strstr(attnd_client_errmsg(c), "/nonexistent/attnd.sock"));
  attnd_client_free(c);
  rc = attnd_client_connect(&c, "127.0.0.1:1");
  assert_int_equal(rc, ATTND_CLIENT_ECONNECT);
  assert_non_null(strstr(attnd_client_errmsg(c), "127.0.0.1:1"));
  attnd_client_free(c);
}

static void test_attnctl_exit_codes_without_daemon(void **state) {
  char out[4096];
  assert_int_equal(run_attnctl(out, sizeof(out), "--socket /nonexistent/attnd.sock health"), 3);
  assert_int_equal(run_attnctl(out, sizeof(out), "--tcp 127.0.0.1:1 stats"), 3);
  assert_int_equal(run_attnctl(out, sizeof(out), "frobnicate"), 2);
  assert_int_equal(run_attnctl(out, sizeof(out), "health --no-such-flag"), 2);
  assert_int_equal(run_attnctl(out, sizeof(out), "--socket /a --tcp b:1 health"), 2);
  assert_int_equal(run_attnctl(out, sizeof(out), "--help"), 0);
  assert_non_null(strstr(out, "exit codes"));
  assert_int_equal(run_attnctl(out, sizeof(out), "bench --help"), 0);
  assert_non_null(strstr(out, "--sessions"));
}

static void test_default_socket_lookup(void **state) {
  char buf[256], dir[] = "/tmp/attnd-test-rt-XXXXXX", want[300];
  char *old_rt = getenv("RUNTIME_DIRECTORY") ? strdup(getenv("RUNTIME_DIRECTORY")) : NULL;
  assert_non_null(mkdtemp(dir));
  /* RUNTIME_DIRECTORY comes first, even before the socket exists, and only its
   * first entry counts. */
  char rt[600];
  snprintf(rt, sizeof(rt), "%s:/elsewhere", dir);
  setenv("RUNTIME_DIRECTORY", rt, 1);
  assert_int_equal(attnd_client_default_socket(buf, sizeof(buf)), 0);
  snprintf(want, sizeof(want), "%s/attnd.sock", dir);
  assert_string_equal(buf, want);
  /* Without it: an existing $XDG_RUNTIME_DIR socket is found. */
  unsetenv("RUNTIME_DIRECTORY");
  char *old_xdg = getenv("XDG_RUNTIME_DIR") ? strdup(getenv("XDG_RUNTIME_DIR")) : NULL;
  setenv("XDG_RUNTIME_DIR", dir, 1);
  FILE *f = fopen(want, "w");
  assert_non_null(f);
  fclose(f);
  assert_int_equal(attnd_client_default_socket(buf, sizeof(buf)), 0);
  if (access("/run/attnd/attnd.sock", F_OK) != 0 || geteuid() != 0)
    assert_string_equal(buf, want);
  unlink(want);
  rmdir(dir);
  if (old_xdg)
    setenv("XDG_RUNTIME_DIR", old_xdg, 1);
  else
    unsetenv("XDG_RUNTIME_DIR");
  if (old_rt)
    setenv("RUNTIME_DIRECTORY", old_rt, 1);
  free(old_rt);
  free(old_xdg);
}

static void test_health_and_stats(void **state) {
  NEED_DAEMON();
  attnd_client_t *c = NULL;
  assert_int_equal(attnd_client_connect(&c, sock_path), 0);
  attnd_v1_HealthResponse h;
  assert_int_equal(attnd_client_health(c, &h), 0);
  assert_string_equal(h.status, "serving");
  assert_true(h.has_model);
  assert_int_equal(h.model.layers, 2);
  assert_int_equal(h.model.q_heads, 4);
  assert_int_equal(h.model.kv_heads, 2);
  assert_int_equal(h.model.head_dim, 64);
  assert_int_equal(h.model.block_size, 16);
  assert_true(h.epoch != 0);
  assert_true(h.tcp_port != 0);
  assert_true(attnd_client_epoch(c) == h.epoch);
  attnd_v1_StatsResponse s;
  assert_int_equal(attnd_client_stats(c, &s), 0);
  assert_true(s.connections >= 1);
  attnd_client_free(c);

  /* The same daemon over TCP, on the port Health reports. */
  char addr[64];
  snprintf(addr, sizeof(addr), "127.0.0.1:%u", h.tcp_port);
  assert_int_equal(attnd_client_connect(&c, addr), 0);
  attnd_v1_HealthResponse h2;
  assert_int_equal(attnd_client_health(c, &h2), 0);
  assert_true(h2.epoch == h.epoch);
  attnd_client_free(c);
}

static void test_pipelined_receive_by_id(void **state) {
  NEED_DAEMON();
  attnd_client_t *c = NULL;
  assert_int_equal(attnd_client_connect(&c, sock_path), 0);
  uint64_t ids[8];
  for (int i = 0; i < 8; i++) {
    attnd_v1_Request req = attnd_v1_Request_init_zero;
    req.which_call = i % 2 ? attnd_v1_Request_stats_tag : attnd_v1_Request_health_tag;
    assert_int_equal(attnd_client_send(c, &req, &ids[i]), 0);
  }
  for (int i = 7; i >= 0; i--) {
    attnd_client_resp_t r;
    assert_int_equal(attnd_client_recv(c, ids[i], &r), 0);
    assert_true(r.msg.id == ids[i]);
    assert_int_equal(r.msg.which_result,
                     i % 2 ? attnd_v1_Response_stats_tag : attnd_v1_Response_health_tag);
    attnd_client_resp_free(&r);
  }
  /* A request without a call is UNIMPLEMENTED, and the status is reported. */
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  assert_int_equal(attnd_client_call(c, &req, &r), ATTND_CLIENT_ESTATUS);
  assert_int_equal(attnd_client_status(c), 12);
  assert_non_null(strstr(attnd_client_errmsg(c), "UNIMPLEMENTED"));
  attnd_client_resp_free(&r);
  attnd_client_free(c);
}

/* Prefill and decode through the C client: pipelined layer steps received out of
 * order, outputs of the right size and finite, typed status on a closed session. */
static void test_session_steps(void **state) {
  NEED_DAEMON();
  attnd_client_t *c = NULL;
  assert_int_equal(attnd_client_connect(&c, sock_path), 0);
  attnd_v1_HealthResponse h;
  assert_int_equal(attnd_client_health(c, &h), 0);
  const uint32_t L = h.model.layers, Hq = h.model.q_heads, Hkv = h.model.kv_heads,
                 D = h.model.head_dim;
  uint32_t tokens[40];
  for (uint32_t i = 0; i < 40; i++)
    tokens[i] = 1000 + i * 7;
  uint64_t sid = 0;
  uint32_t cached = 0;
  int rc = attnd_client_open_session(c, tokens, 30, &sid, &cached);
  if (rc == ATTND_CLIENT_ESTATUS && attnd_client_status(c) == 12) {
    fprintf(stderr, "skipped: the daemon answers UNIMPLEMENTED for sessions (engine not landed)\n");
    attnd_client_free(c);
    skip();
  }
  assert_int_equal(rc, 0);
  size_t maxrows = 30;
  uint16_t *buf = malloc(maxrows * Hq * D * 2);
  assert_non_null(buf);
  uint32_t x = 12345;
  for (size_t i = 0; i < maxrows * Hq * D; i++) {
    x = x * 1664525u + 1013904223u;
    /* bf16 with exponent 0x3f/0x3e and random mantissa: finite values in about [-1, 1]. */
    buf[i] = (uint16_t)(((x >> 16) & 0x807f) | 0x3e00 | ((x >> 8) & 0x80));
  }
  uint32_t start = cached;
  for (int step = 0; step < 6; step++) {
    uint32_t n = step == 0 ? 30 - cached : 1;
    attnd_client_item_t it = {sid, start, n, 0, &tokens[start]};
    uint64_t plan = 0;
    assert_int_equal(attnd_client_plan(c, &it, 1, &plan), 0);
    uint64_t ids[64];
    assert_true(L <= 64);
    for (uint32_t l = 0; l < L; l++) {
      attnd_client_step_t st;
      memset(&st, 0, sizeof(st));
      st.layer = l;
      st.plan = plan;
      st.dtype = attnd_v1_DType_DTYPE_BF16;
      st.q_heads = Hq;
      st.kv_heads = Hkv;
      st.head_dim = D;
      st.q = buf;
      st.q_rows = n;
      st.k = buf + 1;
      st.v = buf + 2;
      st.kv_rows = n;
      st.want_lse = 1;
      assert_int_equal(attnd_client_step_send(c, &st, &ids[l]), 0);
    }
    for (uint32_t l = L; l-- > 0;) {
      attnd_client_resp_t r;
      assert_int_equal(attnd_client_recv(c, ids[l], &r), 0);
      const uint8_t *out, *lse;
      size_t nb, nl;
      attnd_v1_Tensor meta;
      assert_int_equal(attnd_client_resp_tensor(&r, 0, &out, &nb, &meta), 0);
      assert_int_equal(nb, (size_t)n * Hq * D * 2);
      assert_int_equal(meta.shape_count, 3);
      assert_int_equal(meta.shape[0], n);
      for (size_t i = 0; i < nb / 2; i++) {
        uint16_t v = (uint16_t)(out[2 * i] | out[2 * i + 1] << 8);
        assert_true((v & 0x7f80) != 0x7f80); /* no Inf or NaN */
      }
      assert_int_equal(attnd_client_resp_tensor(&r, 1, &lse, &nl, NULL), 0);
      assert_int_equal(nl, (size_t)n * Hq * 4);
      attnd_client_resp_free(&r);
    }
    start += n;
  }
  /* Fork shares the blocks; truncate rolls the child back; both then list. */
  uint64_t child = 0;
  assert_int_equal(attnd_client_fork(c, sid, &child), 0);
  assert_true(child != 0 && child != sid);
  assert_int_equal(attnd_client_truncate(c, child, 17), 0);
  attnd_v1_SessionInfo si[16];
  size_t ns = 0;
  assert_int_equal(attnd_client_list_sessions(c, si, 16, &ns), 0);
  int found = 0;
  for (size_t i = 0; i < ns && i < 16; i++)
    if (si[i].session == child) {
      found = 1;
      assert_int_equal(si[i].len, 17);
    }
  assert_true(found);
  assert_int_equal(attnd_client_close_session(c, child), 0);
  /* A bf16 cache has no static scales: asking for them is an error, not a crash. */
  float ks[64];
  for (int i = 0; i < 64; i++)
    ks[i] = 0.01f;
  assert_true(Hkv <= 64);
  rc = attnd_client_set_scales(c, 0, ks, ks, NULL, NULL, Hkv, 0, 0, NULL);
  if (strcmp(h.model.kv_cache, "bf16") == 0)
    assert_int_equal(rc, ATTND_CLIENT_ESTATUS);

  assert_int_equal(attnd_client_list_sessions(c, si, 16, &ns), 0);
  found = 0;
  for (size_t i = 0; i < ns && i < 16; i++)
    if (si[i].session == sid) {
      found = 1;
      assert_int_equal(si[i].len, start);
    }
  assert_true(found);
  assert_int_equal(attnd_client_close_session(c, sid), 0);
  assert_int_equal(attnd_client_close_session(c, sid), ATTND_CLIENT_ESTATUS);
  assert_int_equal(attnd_client_status(c), 5);
  free(buf);
  attnd_client_free(c);
}

/* Same-host zero-copy through libattnclient: the CPU backend refuses a
 * registration with FAILED_PRECONDITION (the client then sends bytes), and a
 * step whose refs name a buffer nobody registered is INVALID_ARGUMENT. */
static void test_zero_copy_refusals(void **state) {
  NEED_DAEMON();
  attnd_client_t *c = NULL;
  assert_int_equal(attnd_client_connect(&c, sock_path), 0);
  attnd_v1_HealthResponse h;
  assert_int_equal(attnd_client_health(c, &h), 0);
  uint8_t handle[64];
  memset(handle, 1, sizeof(handle));
  uint64_t buf = 0;
  int rc = attnd_client_register_buffer(c, handle, 1 << 20, h.device_uuid, &buf);
  if (strcmp(h.backend, "cpu") == 0) {
    assert_int_equal(rc, ATTND_CLIENT_ESTATUS);
    assert_int_equal(attnd_client_status(c), 9);
  }
  uint64_t sid = 0;
  uint32_t cached = 0, tok = 5;
  assert_int_equal(attnd_client_open_session(c, NULL, 0, &sid, &cached), 0);
  attnd_client_item_t it = {.session = sid, .start = 0, .n = 1, .tokens = &tok};
  attnd_client_refs_t refs = {.q = {77, 0}, .k = {77, 256}, .v = {77, 512}, .out = {77, 1024}};
  attnd_client_step_t st = {.items = &it,
                            .nitems = 1,
                            .dtype = attnd_v1_DType_DTYPE_BF16,
                            .q_heads = h.model.q_heads,
                            .kv_heads = h.model.kv_heads,
                            .head_dim = h.model.head_dim,
                            .q_rows = 1,
                            .kv_rows = 1,
                            .refs = &refs};
  uint64_t id = 0;
  assert_int_equal(attnd_client_step_send(c, &st, &id), 0);
  attnd_client_resp_t r;
  assert_int_equal(attnd_client_recv(c, id, &r), ATTND_CLIENT_ESTATUS);
  assert_int_equal(attnd_client_status(c), 3);
  assert_non_null(strstr(r.msg.status.message, "not registered"));
  attnd_client_resp_free(&r);
  assert_int_equal(attnd_client_release_buffer(c, 77), ATTND_CLIENT_ESTATUS);
  assert_int_equal(attnd_client_status(c), 3);
  assert_int_equal(attnd_client_close_session(c, sid), 0);
  attnd_client_free(c);
}

static void test_attnctl_against_daemon(void **state) {
  NEED_DAEMON();
  char out[16384], args[600];
  snprintf(args, sizeof(args), "--socket %s health", sock_path);
  assert_int_equal(run_attnctl(out, sizeof(out), args), 0);
  assert_non_null(strstr(out, "serving"));
  /* --json must parse: checked by a real JSON parser. */
  const char *cmds[] = {"health", "stats", "config"};
  for (size_t i = 0; i < 3; i++) {
    char cmd[1200], exe[600];
    path_of(exe, sizeof(exe), "client/attnctl");
    snprintf(
        cmd, sizeof(cmd),
        "%s --socket %s --json %s | /usr/bin/python3 -c 'import json,sys; json.load(sys.stdin)'",
        exe, sock_path, cmds[i]);
    int st = system(cmd);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
  }
  snprintf(args, sizeof(args), "--socket %s stats", sock_path);
  assert_int_equal(run_attnctl(out, sizeof(out), args), 0);
  assert_non_null(strstr(out, "connections"));
  snprintf(args, sizeof(args), "--socket %s config", sock_path);
  assert_int_equal(run_attnctl(out, sizeof(out), args), 0);
  assert_non_null(strstr(out, "head_dim"));
}

int main(void) {
  const char *b = getenv("ATTND_BUILD_DIR");
  snprintf(build_dir, sizeof(build_dir), "%s", b ? b : ".");
  const struct CMUnitTest standalone[] = {
      cmocka_unit_test(test_connect_without_daemon_names_the_socket),
      cmocka_unit_test(test_attnctl_exit_codes_without_daemon),
      cmocka_unit_test(test_default_socket_lookup),
  };
  const struct CMUnitTest with_daemon[] = {
      cmocka_unit_test(test_health_and_stats),       cmocka_unit_test(test_pipelined_receive_by_id),
      cmocka_unit_test(test_attnctl_against_daemon), cmocka_unit_test(test_session_steps),
      cmocka_unit_test(test_zero_copy_refusals),
  };
  int failed = cmocka_run_group_tests_name("client", standalone, NULL, NULL);
  failed += cmocka_run_group_tests_name("client_daemon", with_daemon, start_daemon, stop_daemon);
  return failed;
}

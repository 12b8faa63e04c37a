/* test_config: defaults, flags, config file, precedence, errors, suffixes,
 * and the binary's --check-config / exit codes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "config.h"
#include "base.h"

static char err[512];

static int parse(attnd_config_t *c, const char *const *args) {
  char *argv[64];
  int argc = 0;
  argv[argc++] = "attnd";
  for (int i = 0; args[i]; i++)
    argv[argc++] = (char *)args[i];
  argv[argc] = NULL;
  attnd_config_defaults(c);
  err[0] = 0;
  return attnd_config_parse(c, argc, argv, err, sizeof(err));
}

static int parse_validate(attnd_config_t *c, const char *const *args) {
  int rc = parse(c, args);
  if (rc)
    return rc;
  return attnd_config_validate(c, err, sizeof(err));
}

static void test_defaults(void **state) {
  attnd_config_t c;
  attnd_config_defaults(&c);
  assert_int_equal(attnd_config_validate(&c, err, sizeof(err)), 0);
  assert_int_equal(c.layers, 32);
  assert_int_equal(c.shape.q_heads, 32);
  assert_int_equal(c.shape.kv_heads, 8);
  assert_int_equal(c.shape.head_dim, 128);
  assert_int_equal(c.shape.block_size, 64);
  assert_int_equal(c.shape.dtype, ATTND_DT_BF16);
  assert_int_equal(c.shape.kv, ATTND_KV_BF16);
  assert_int_equal(c.shape.rope, ATTND_ROPE_NEOX);
  assert_true(c.shape.rope_theta == 500000.0);
  assert_int_equal(c.shape.rotary_dim, 128);
  assert_true(fabsf(c.shape.softmax_scale - 1.0f / sqrtf(128.0f)) < 1e-7f);
  assert_int_equal(c.max_context, 131072);
  assert_int_equal(c.session_idle_s, 600);
  assert_int_equal(c.max_frame, 512ull << 20);
  assert_int_equal(c.max_inflight, 1ull << 30);
  assert_int_equal(c.max_connections, 1024);
  assert_int_equal(c.max_sessions, 65536);
  assert_int_equal(c.max_plans, 64);
  assert_int_equal(c.prefix_cache, 1);
  assert_int_equal(c.backend, ATTND_BACKEND_AUTO);
  assert_int_equal(c.kv_memory, 0);
  assert_string_equal(c.listen, "127.0.0.1:7411");
  assert_string_equal(c.metrics, "127.0.0.1:7412");
  assert_string_equal(c.log_level, "info");
}

static void test_default_paths(void **state) {
  attnd_config_t c;
  setenv("RUNTIME_DIRECTORY", "/run/svc:/run/other", 1);
  setenv("STATE_DIRECTORY", "/var/lib/svc", 1);
  attnd_config_defaults(&c);
  assert_string_equal(c.socket_path, "/run/svc/attnd.sock");
  assert_string_equal(c.state_dir, "/var/lib/svc");
  unsetenv("RUNTIME_DIRECTORY");
  unsetenv("STATE_DIRECTORY");
  setenv("XDG_RUNTIME_DIR", "/xdg/run", 1);
  setenv("XDG_STATE_HOME", "/xdg/state", 1);
  attnd_config_defaults(&c);
  if (geteuid() == 0) {
    assert_string_equal(c.socket_path, "/run/attnd/attnd.sock");
    assert_string_equal(c.state_dir, "/var/lib/attnd");
  } else {
    assert_string_equal(c.socket_path, "/xdg/run/attnd.sock");
    assert_string_equal(c.state_dir, "/xdg/state/attnd");
    unsetenv("XDG_RUNTIME_DIR");
    attnd_config_defaults(&c);
    char want[64];
    snprintf(want, sizeof(want), "/tmp/attnd-%u/attnd.sock", (unsigned)geteuid());
    assert_string_equal(c.socket_path, want);
  }
  unsetenv("XDG_RUNTIME_DIR");
  unsetenv("XDG_STATE_HOME");
}

static void test_flags_both_forms(void **state) {
  attnd_config_t c;
  const char *a[] = {"--layers",
                     "4",
                     "--q-heads=16",
                     "--kv-heads",
                     "4",
                     "--head-dim=64",
                     "--block-size",
                     "16",
                     "--dtype=fp16",
                     "--kv-cache",
                     "int8_dynamic",
                     "--rope=interleaved",
                     "--rope-theta",
                     "10000",
                     "--rotary-dim=32",
                     "--softmax-scale",
                     "0.5",
                     "--max-context=8192",
                     "--model-id",
                     "tiny",
                     "--session-idle=5",
                     "--max-connections",
                     "7",
                     "--max-sessions=9",
                     "--threads",
                     "3",
                     "--backend=cpu",
                     "--device",
                     "1",
                     "--socket=/tmp/x/a.sock",
                     "--listen",
                     "",
                     "--metrics=127.0.0.1:0",
                     "--log-level",
                     "debug",
                     "--no-prefix-cache",
                     "--max-plans=8",
                     NULL};
  assert_int_equal(parse_validate(&c, a), 0);
  assert_int_equal(c.layers, 4);
  assert_int_equal(c.shape.q_heads, 16);
  assert_int_equal(c.shape.kv_heads, 4);
  assert_int_equal(c.shape.head_dim, 64);
  assert_int_equal(c.shape.block_size, 16);
  assert_int_equal(c.shape.dtype, ATTND_DT_FP16);
  assert_int_equal(c.shape.kv, ATTND_KV_INT8_DYNAMIC);
  assert_int_equal(c.shape.rope, ATTND_ROPE_INTERLEAVED);
  assert_true(c.shape.rope_theta == 10000.0);
  assert_int_equal(c.shape.rotary_dim, 32);
  assert_true(c.shape.softmax_scale == 0.5f);
  assert_int_equal(c.max_context, 8192);
  assert_string_equal(c.model_id, "tiny");
  assert_int_equal(c.session_idle_s, 5);
  assert_int_equal(c.max_connections, 7);
  assert_int_equal(c.max_sessions, 9);
  assert_int_equal(c.threads, 3);
  assert_int_equal(c.backend, ATTND_BACKEND_CPU);
  assert_int_equal(c.device, 1);
  assert_string_equal(c.socket_path, "/tmp/x/a.sock");
  assert_string_equal(c.listen, "");
  assert_string_equal(c.metrics, "127.0.0.1:0");
  assert_string_equal(c.log_level, "debug");
  assert_int_equal(c.prefix_cache, 0);
  assert_int_equal(c.max_plans, 8);
  assert_int_equal(c.check_config, 0);
  const char *b[] = {"--check-config", "--help", "--version", NULL};
  assert_int_equal(parse(&c, b), 0);
  assert_true(c.check_config && c.show_help && c.show_version);
}

static void test_sizes(void **state) {
  attnd_config_t c;
  struct {
    const char *v;
    uint64_t want;
  } ok[] = {{"1024", 1024},         {"64K", 64ull << 10}, {"64k", 64ull << 10},
            {"512M", 512ull << 20}, {"2G", 2ull << 30},   {"3GiB", 3ull << 30},
            {"1T", 1ull << 40},     {"100B", 100},        {"8MB", 8ull << 20}};
  for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
    const char *a[] = {"--kv-memory", ok[i].v, NULL};
    assert_int_equal(parse(&c, a), 0);
    assert_int_equal(c.kv_memory, ok[i].want);
  }
  const char *bad[] = {"", "12X", "-1", "G", "1.5G", "1GG", "99999999999999999999"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    const char *a[] = {"--kv-memory", bad[i], NULL};
    assert_int_equal(parse(&c, a), ATTND_EINVAL);
    assert_non_null(strstr(err, "--kv-memory"));
  }
  const char *mf[] = {"--max-frame=1M", "--max-inflight=4M", NULL};
  assert_int_equal(parse_validate(&c, mf), 0);
  assert_int_equal(c.max_frame, 1ull << 20);
  assert_int_equal(c.max_inflight, 4ull << 20);
}

static void test_errors(void **state) {
  attnd_config_t c;
  struct {
    const char *a[6];
    const char *needle;
  } cases[] = {
      {{"--bogus", "1"}, "unknown option '--bogus'"},
      {{"--layers"}, "--layers needs a value"},
      {{"--layers", "x"}, "--layers: 'x' is not an integer"},
      {{"--layers=0"}, "--layers"},
      {{"--dtype", "fp8"}, "--dtype: 'fp8'"},
      {{"--kv-cache", "int3"}, "--kv-cache: 'int3'"},
      {{"--rope", "yarn"}, "--rope: 'yarn'"},
      {{"--backend", "tpu"}, "--backend: 'tpu'"},
      {{"--log-level", "loud"}, "--log-level"},
      {{"--q-heads", "12", "--kv-heads", "8"}, "--q-heads 12 is not a multiple of --kv-heads 8"},
      {{"--head-dim", "96"}, "--head-dim 96"},
      {{"--block-size", "48"}, "--block-size 48"},
      {{"--rotary-dim", "33"}, "--rotary-dim 33"},
      {{"--max-frame", "2G"}, "--max-frame"},
      {{"--max-frame", "1G", "--max-inflight", "512M"}, "--max-inflight"},
      {{"--listen", "nohostport"}, "--listen 'nohostport'"},
      {{"--metrics", "1.2.3.4:99999"}, "--metrics"},
      {{"--socket", "relative.sock"}, "--socket 'relative.sock'"},
      {{"--socket", "", "--listen", ""}, "nothing to listen on"},
      {{"--token-file", "/nonexistent/tokens"}, "--token-file"},
      {{"--check-config=1"}, "--check-config takes no value"},
      {{"positional"}, "unexpected argument 'positional'"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    int rc = parse_validate(&c, cases[i].a);
    if (rc == 0 || !strstr(err, cases[i].needle))
      fail_msg("case %zu: rc %d err '%s', expected '%s'", i, rc, err, cases[i].needle);
    assert_null(strchr(err, '\n')); /* one line */
  }
}

static char tmpdir[64];

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static void test_file_and_precedence(void **state) {
  attnd_config_t c;
  char path[128], arg[160];
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/attnd-test-cfg-XXXXXX");
  assert_non_null(mkdtemp(tmpdir));
  snprintf(path, sizeof(path), "%s/attnd.conf", tmpdir);
  write_file(path, "# comment\n"
                   "; another\n"
                   "layers = 4\n"
                   "q-heads = 8\n"
                   "kv_heads = 2\n"
                   "head-dim = 64\n"
                   "kv-memory = 256M\n"
                   "model-id = from-file\n"
                   "prefix-cache = false\n"
                   "require-token = yes\n"
                   "[attnd]\n"
                   "listen = 127.0.0.1:9000\n");
  snprintf(arg, sizeof(arg), "--config=%s", path);
  /* The flag wins even when it comes before --config. */
  const char *a[] = {"--layers", "6", arg, NULL};
  assert_int_equal(parse_validate(&c, a), 0);
  assert_int_equal(c.layers, 6);
  assert_int_equal(c.shape.q_heads, 8);
  assert_int_equal(c.shape.kv_heads, 2);
  assert_int_equal(c.shape.head_dim, 64);
  assert_int_equal(c.kv_memory, 256ull << 20);
  assert_string_equal(c.model_id, "from-file");
  assert_int_equal(c.prefix_cache, 0);
  assert_int_equal(c.require_token, 1);
  assert_string_equal(c.listen, "127.0.0.1:9000");
  /* Unknown keys name file and line. */
  write_file(path, "layers = 4\n\nbogus = 1\n");
  const char *b[] = {"--config", path, NULL};
  assert_int_equal(parse(&c, b), ATTND_EINVAL);
  char want[200];
  snprintf(want, sizeof(want), "%s:3: unknown option 'bogus'", path);
  assert_string_equal(err, want);
  /* Bad values name the key, file and line. */
  write_file(path, "head-dim = 128\nkv-memory = lots\n");
  assert_int_equal(parse(&c, b), ATTND_EINVAL);
  assert_non_null(strstr(err, ":2: --kv-memory: 'lots'"));
  /* Flags only. */
  write_file(path, "check-config = 1\n");
  assert_int_equal(parse(&c, b), ATTND_EINVAL);
  assert_non_null(strstr(err, ":1:"));
  write_file(path, "[other]\nlayers = 2\n");
  assert_int_equal(parse(&c, b), ATTND_EINVAL);
  assert_non_null(strstr(err, "unknown section"));
  /* A missing file. */
  const char *m[] = {"--config", "/nonexistent/attnd.conf", NULL};
  assert_int_equal(parse(&c, m), ATTND_EINVAL);
  assert_non_null(strstr(err, "cannot open"));
}

/* --require-token is a switch on the command line and a boolean in the file. */
static void test_require_token(void **state) {
  attnd_config_t c;
  const char *none[] = {NULL};
  assert_int_equal(parse(&c, none), 0);
  assert_int_equal(c.require_token, 0);
  const char *flag[] = {"--require-token", NULL};
  assert_int_equal(parse(&c, flag), 0);
  assert_int_equal(c.require_token, 1);
  char path[128];
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/attnd-test-cfg-XXXXXX");
  assert_non_null(mkdtemp(tmpdir));
  snprintf(path, sizeof(path), "%s/bad.conf", tmpdir);
  write_file(path, "require-token = maybe\n");
  const char *bad[] = {"--config", path, NULL};
  assert_int_equal(parse(&c, bad), ATTND_EINVAL);
  assert_non_null(strstr(err, "require-token: 'maybe' is not a boolean"));
  unlink(path);
  rmdir(tmpdir);
}

/* The tuning options (once environment variables): defaults, flags, file
 * keys, their checks, and the worker pool size they imply. */
static void test_tuning(void **state) {
  attnd_config_t c;
  const char *none[] = {NULL};
  assert_int_equal(parse(&c, none), 0);
  assert_int_equal(c.engine_offload_bytes, 1u << 20);
  assert_int_equal(c.rpc_ref_min, 64u << 10);
  assert_int_equal(c.cuda_hostfn_min, 1u << 20);
  assert_int_equal(c.cuda_pinned_max, 0);
  assert_int_equal(c.cuda_completion, ATTND_COMPLETION_POLL);
  assert_int_equal(c.cuda_trace, 0);
  assert_int_equal(c.worker_threads, 0);
  assert_int_equal(c.engine_chunk_keys, 16u << 10);
  assert_int_equal(c.max_sessions_per_identity, 0);
  const char *ck[] = {"--engine-chunk-keys", "1M", "--max-sessions-per-identity=7", NULL};
  assert_int_equal(parse(&c, ck), 0);
  assert_int_equal(c.engine_chunk_keys, 1u << 20);
  assert_int_equal(c.max_sessions_per_identity, 7);
  const char *a[] = {"--engine-offload-bytes",
                     "0",
                     "--rpc-ref-min=0",
                     "--cuda-pinned-max",
                     "1G",
                     "--cuda-hostfn-min",
                     "4K",
                     "--cuda-completion",
                     "callback",
                     "--cuda-trace",
                     "--worker-threads",
                     "6",
                     NULL};
  assert_int_equal(parse(&c, a), 0);
  assert_int_equal(c.engine_offload_bytes, 0);
  assert_int_equal(c.rpc_ref_min, 0);
  assert_int_equal(c.cuda_pinned_max, 1ull << 30);
  assert_int_equal(c.cuda_hostfn_min, 4096);
  assert_int_equal(c.cuda_completion, ATTND_COMPLETION_CALLBACK);
  assert_int_equal(c.cuda_trace, 1);
  assert_int_equal(attnd_config_worker_threads(&c), 6);
  /* Without --worker-threads: the CPU workers, at least 4. */
  const char *t2[] = {"--threads", "2", NULL};
  assert_int_equal(parse(&c, t2), 0);
  assert_int_equal(attnd_config_worker_threads(&c), 4);
  const char *t9[] = {"--threads", "9", NULL};
  assert_int_equal(parse(&c, t9), 0);
  assert_int_equal(attnd_config_worker_threads(&c), 9);
  const char *bad1[] = {"--cuda-completion", "spin", NULL};
  assert_int_equal(parse(&c, bad1), ATTND_EINVAL);
  assert_non_null(strstr(err, "--cuda-completion: 'spin'"));
  const char *bad2[] = {"--rpc-ref-min", "lots", NULL};
  assert_int_equal(parse(&c, bad2), ATTND_EINVAL);
  assert_non_null(strstr(err, "--rpc-ref-min"));
  const char *bad3[] = {"--cuda-trace=1", NULL};
  assert_int_equal(parse(&c, bad3), ATTND_EINVAL);
  assert_non_null(strstr(err, "takes no value"));
  /* In the file: the same keys; cuda-trace is a boolean there. */
  char path[128], arg[160];
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/attnd-test-cfg-XXXXXX");
  assert_non_null(mkdtemp(tmpdir));
  snprintf(path, sizeof(path), "%s/tuning.conf", tmpdir);
  write_file(path, "cuda-trace = yes\ncuda_completion = callback\nengine-offload-bytes = 2M\n"
                   "worker-threads = 3\n");
  snprintf(arg, sizeof(arg), "--config=%s", path);
  const char *f[] = {arg, NULL};
  assert_int_equal(parse(&c, f), 0);
  assert_int_equal(c.cuda_trace, 1);
  assert_int_equal(c.cuda_completion, ATTND_COMPLETION_CALLBACK);
  assert_int_equal(c.engine_offload_bytes, 2u << 20);
  assert_int_equal(attnd_config_worker_threads(&c), 3);
  write_file(path, "cuda-trace = sometimes\n");
  assert_int_equal(parse(&c, f), ATTND_EINVAL);
  assert_non_null(strstr(err, "cuda-trace: 'sometimes' is not a boolean"));
  unlink(path);
  rmdir(tmpdir);
  /* --help names each of them. */
  const char *u = attnd_config_usage();
  const char *names[] = {"--worker-threads",  "--engine-offload-bytes", "--rpc-ref-min",
                         "--cuda-pinned-max", "--cuda-hostfn-min",      "--cuda-completion",
                         "--cuda-trace",      "--engine-chunk-keys"};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (!strstr(u, names[i]))
      fail_msg("--help does not name %s", names[i]);
}

static void test_hostport(void **state) {
  char host[64];
  int port;
  assert_int_equal(attnd_config_hostport("127.0.0.1:7411", host, sizeof(host), &port), 0);
  assert_string_equal(host, "127.0.0.1");
  assert_int_equal(port, 7411);
  assert_int_equal(attnd_config_hostport("[::1]:0", host, sizeof(host), &port), 0);
  assert_string_equal(host, "::1");
  assert_int_equal(port, 0);
  assert_int_not_equal(attnd_config_hostport(":80", host, sizeof(host), &port), 0);
  assert_int_not_equal(attnd_config_hostport("h:", host, sizeof(host), &port), 0);
  assert_int_not_equal(attnd_config_hostport("h:65536", host, sizeof(host), &port), 0);
}

/* The binary's exit codes: 0 for a good --check-config, 2 for bad config. */
static int run_attnd(const char *const *args) {
  const char *bd = getenv("ATTND_BUILD_DIR");
  char bin[512];
  snprintf(bin, sizeof(bin), "%s/daemon/attnd", bd);
  char *argv[32];
  int n = 0;
  argv[n++] = bin;
  for (int i = 0; args[i]; i++)
    argv[n++] = (char *)args[i];
  argv[n] = NULL;
  pid_t pid = fork();
  if (pid == 0) {
    freopen("/dev/null", "w", stdout);
    freopen("/dev/null", "w", stderr);
    execv(bin, argv);
    _exit(127);
  }
  int st;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_binary_exit_codes(void **state) {
  if (!getenv("ATTND_BUILD_DIR")) {
    skip();
    return;
  }
  const char *good[] = {"--check-config", "--layers=2", NULL};
  assert_int_equal(run_attnd(good), 0);
  const char *bad[] = {"--check-config", "--head-dim", "96", NULL};
  assert_int_equal(run_attnd(bad), 2);
  const char *unknown[] = {"--frobnicate", NULL};
  assert_int_equal(run_attnd(unknown), 2);
  const char *ver[] = {"--version", NULL};
  assert_int_equal(run_attnd(ver), 0);
  const char *help[] = {"--help", NULL};
  assert_int_equal(run_attnd(help), 0);
  /* A socket path that cannot be created: a start failure, exit 1. */
  const char *nostart[] = {"--socket",    "/proc/nope/attnd.sock",
                           "--listen",    "",
                           "--metrics",   "",
                           "--layers",    "2",
                           "--q-heads",   "4",
                           "--kv-heads",  "2",
                           "--head-dim",  "64",
                           "--kv-memory", "4M",
                           "--backend",   "cpu",
                           NULL};
  assert_int_equal(run_attnd(nostart), 1);
}

/* deploy/attnd.conf documents every option with its default: loading it must
 * give exactly the built-in defaults. */
static void test_example_config(void **state) {
  const char *sd = getenv("ATTND_SOURCE_DIR");
  if (!sd) {
    skip();
    return;
  }
  char path[512], arg[600];
  snprintf(path, sizeof(path), "%s/deploy/attnd.conf", sd);
  snprintf(arg, sizeof(arg), "--config=%s", path);
  attnd_config_t def, c;
  attnd_config_defaults(&def);
  assert_int_equal(attnd_config_validate(&def, err, sizeof(err)), 0);
  const char *a[] = {arg, NULL};
  if (parse_validate(&c, a) != 0)
    fail_msg("%s", err);
  memset(c.config_file, 0, sizeof(c.config_file));
  assert_memory_equal(&c, &def, sizeof(c));
  if (getenv("ATTND_BUILD_DIR")) {
    const char *chk[] = {arg, "--check-config", NULL};
    assert_int_equal(run_attnd(chk), 0);
  }
}

static int cleanup(void **state) {
  if (tmpdir[0]) {
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    if (system(cmd) != 0)
      return -1;
  }
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),         cmocka_unit_test(test_default_paths),
      cmocka_unit_test(test_flags_both_forms), cmocka_unit_test(test_sizes),
      cmocka_unit_test(test_errors),           cmocka_unit_test(test_file_and_precedence),
      cmocka_unit_test(test_hostport),         cmocka_unit_test(test_binary_exit_codes),
      cmocka_unit_test(test_example_config),   cmocka_unit_test(test_require_token),
      cmocka_unit_test(test_tuning),
  };
  return cmocka_run_group_tests(tests, NULL, cleanup);
}

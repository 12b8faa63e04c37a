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
  assert_int_equal(c.socket_buffer, 0);
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
  const char *sb[] = {"--socket-buffer=4M", NULL};
  assert_int_equal(parse_validate(&c, sb), 0);
  assert_int_equal(c.socket_buffer, 4ull << 20);
  const char *sb2[] = {"--socket-buffer", "16M", NULL};
  assert_int_equal(parse_validate(&c, sb2), 0);
  assert_int_equal(c.socket_buffer, 16ull << 20);
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
      {{"--kv-heads", "2:9"}, "--kv-heads 2:9: the held range must satisfy 0 <= A < B <= 8"},
      {{"--kv-heads", "3:3"}, "--kv-heads: '3:3' is not an integer N or a range A:B"},
      {{"--kv-heads", "4:2"}, "--kv-heads: '4:2'"},
      {{"--kv-heads", "-1:2"}, "--kv-heads: '-1:2'"},
      {{"--kv-heads", "0:"}, "--kv-heads: '0:'"},
      {{"--kv-heads", "x"}, "--kv-heads: 'x' is not an integer in [1, 1024] or a range A:B"},
      {{"--head-dim", "96"}, "--head-dim 96"},
      {{"--block-size", "48"}, "--block-size 48"},
      {{"--rotary-dim", "33"}, "--rotary-dim 33"},
      {{"--max-frame", "2G"}, "--max-frame"},
      {{"--socket-buffer", "2G"}, "--socket-buffer 2147483648: must be at most 1G"},
      {{"--socket-buffer", "4Q"}, "--socket-buffer: '4Q' is not a size"},
      {{"--max-frame", "1G", "--max-inflight", "512M"}, "--max-inflight"},
      {{"--cuda-ring", "64K"}, "--cuda-ring 65536: must be 0 (the default) or at least 1M"},
      {{"--cuda-ring", "1G", "--cuda-pinned-max", "512M"}, "--cuda-ring 1073741824: must fit"},
      {{"--cuda-frame-pool", "4K"},
       "--cuda-frame-pool 4096: must be 0 (the default) or at least 1M"},
      {{"--cuda-frame-pool", "1G", "--cuda-pinned-max", "512M"},
       "--cuda-frame-pool 1073741824: must fit"},
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
  assert_int_equal(c.cuda_hostfn_min, 64u << 10);
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
  const char *loop[] = {"--cuda-completion", "loop", NULL};
  assert_int_equal(parse(&c, loop), 0);
  assert_int_equal(c.cuda_completion, ATTND_COMPLETION_LOOP);
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
                         "--cuda-trace",      "--engine-chunk-keys",    "--cuda-pinned-warm"};
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
    if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr))
      _exit(126);
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
  /* Start-time checks that need no device run under --check-config too: a
   * pool without a single block, or one larger than the host's memory. */
  const char *tiny[] = {"--check-config", "--backend", "cpu", "--kv-memory", "1K", NULL};
  assert_int_equal(run_attnd(tiny), 2);
  const char *huge[] = {"--check-config", "--backend", "cpu", "--kv-memory", "64T", NULL};
  assert_int_equal(run_attnd(huge), 2);
  const char *shorts[] = {"-V", NULL};
  assert_int_equal(run_attnd(shorts), 0);
  const char *shorth[] = {"-h", NULL};
  assert_int_equal(run_attnd(shorth), 0);
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
  memset(c.origin, 0, sizeof(c.origin)); /* where the values came from: the file */
  assert_memory_equal(&c, &def, sizeof(c));
  if (getenv("ATTND_BUILD_DIR")) {
    const char *chk[] = {arg, "--check-config", NULL};
    assert_int_equal(run_attnd(chk), 0);
  }
}

/* --attention-windows, --softcap, --attention-sinks: values, and refusals
 * that name the option and change nothing. */
static void test_variant_options(void **state) {
  attnd_config_t c;
  const char *ok[] = {"--layers",          "6",         "--attention-windows",
                      " 4096, 0 ,0",       "--softcap", "30",
                      "--attention-sinks", "on",        NULL};
  assert_int_equal(parse_validate(&c, ok), 0);
  assert_int_equal(c.nlayer_windows, 3);
  static const int want[6] = {4096, 0, 0, 4096, 0, 0};
  for (int l = 0; l < 6; l++)
    assert_int_equal(attnd_config_layer_window(&c, l), want[l]);
  assert_true(c.shape.softcap == 30.0f);
  assert_int_equal(c.attention_sinks, 1);
  char w[64];
  attnd_config_windows_text(&c, w, sizeof(w));
  assert_string_equal(w, "4096,0,0");
  const char *none[] = {"--attention-windows", "", NULL};
  assert_int_equal(parse_validate(&c, none), 0);
  assert_int_equal(c.nlayer_windows, 0);
  assert_int_equal(attnd_config_layer_window(&c, 5), 0);
  struct {
    const char *flag, *value, *needle;
  } bad[] = {
      {"--attention-windows", "4096,-1", "--attention-windows: '4096,-1': entry 2"},
      {"--attention-windows", "4096;0", "comma-separated"},
      {"--attention-windows", "12x", "comma-separated"},
      {"--attention-windows", "1,", "entry 2"},
      {"--attention-windows", "2000000000", "entry 1"},
      {"--softcap", "-1", "--softcap: '-1'"},
      {"--softcap", "nan", "--softcap: 'nan'"},
      {"--attention-sinks", "maybe", "attention-sinks: 'maybe'"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    const char *a[] = {bad[i].flag, bad[i].value, NULL};
    int rc = parse(&c, a);
    if (rc == 0 || !strstr(err, bad[i].needle))
      fail_msg("case %zu: rc %d err '%s', expected '%s'", i, rc, err, bad[i].needle);
  }
  const char *longer[] = {"--layers", "2", "--attention-windows", "1,2,3", NULL};
  assert_int_equal(parse_validate(&c, longer), ATTND_EINVAL);
  assert_non_null(strstr(err, "3 entries for 2 layers"));
}

/* getopt_long's habits: unique prefixes, ambiguity named, short -h/-V,
 * operands refused (after "--" too), and usage errors flagged as such. */
static void test_getopt_forms(void **state) {
  attnd_config_t c;
  const char *abbrev[] = {"--kv-mem=2G", "--lay", "3", NULL};
  assert_int_equal(parse(&c, abbrev), 0);
  assert_int_equal(c.kv_memory, 2ull << 30);
  assert_int_equal(c.layers, 3);
  assert_int_equal(attnd_config_origin(&c, "layers"), ATTND_FROM_FLAG);
  assert_int_equal(attnd_config_origin(&c, "q-heads"), ATTND_FROM_DEFAULT);
  assert_int_equal(attnd_config_origin(&c, "no-such"), -1);
  const char *amb[] = {"--max=1", NULL};
  assert_int_equal(parse(&c, amb), ATTND_EINVAL);
  assert_non_null(strstr(err, "ambiguous option '--max'"));
  assert_non_null(strstr(err, "--max-frame"));
  assert_int_equal(c.usage_error, 1);
  const char *hv[] = {"-h", "-V", NULL};
  assert_int_equal(parse(&c, hv), 0);
  assert_true(c.show_help && c.show_version);
  const char *dash[] = {"--layers", "2", "--", "extra", NULL};
  assert_int_equal(parse(&c, dash), ATTND_EINVAL);
  assert_non_null(strstr(err, "unexpected argument 'extra'"));
  const char *shortx[] = {"-x", NULL};
  assert_int_equal(parse(&c, shortx), ATTND_EINVAL);
  assert_non_null(strstr(err, "unknown option '-x'"));
  /* A bad value is not a usage error of the command line's shape. */
  const char *badv[] = {"--layers=x", NULL};
  assert_int_equal(parse(&c, badv), ATTND_EINVAL);
  assert_int_equal(c.usage_error, 0);
  /* The same argv parses the same twice (getopt is reset each time). */
  const char *twice[] = {"--layers", "5", NULL};
  assert_int_equal(parse(&c, twice), 0);
  assert_int_equal(parse(&c, twice), 0);
  assert_int_equal(c.layers, 5);
  /* --help lists every option it takes, the generated text included. */
  const char *u = attnd_config_usage();
  const char *names[] = {"--max-plans", "--prefix-cache", "--model-config",
                         "--log-file",  "-h, --help",     "-V, --version"};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (!strstr(u, names[i]))
      fail_msg("--help does not name %s", names[i]);
}

/* --kv-heads N and A:B: the model's heads from one place, the held range from
 * another; validate narrows the shape to the held heads and keeps the totals. */
static void test_kv_head_range(void **state) {
  attnd_config_t c;
  const char *a[] = {"--q-heads", "32", "--kv-heads", "8", "--kv-heads", "2:6", NULL};
  assert_int_equal(parse_validate(&c, a), 0);
  assert_int_equal(c.shape.q_heads, 16);
  assert_int_equal(c.shape.kv_heads, 4);
  assert_int_equal(c.shape.kv_head_begin, 2);
  assert_int_equal(c.shape.model_kv_heads, 8);
  assert_int_equal(c.model_q_heads, 32);
  assert_int_equal(c.model_kv_heads, 8);
  /* Validating again changes nothing (the totals are kept). */
  assert_int_equal(attnd_config_validate(&c, err, sizeof(err)), 0);
  assert_int_equal(c.shape.q_heads, 16);
  assert_int_equal(c.shape.kv_heads, 4);
  /* The range alone: the model's N is the default (8), or the file's. */
  const char *b[] = {"--kv-heads", "0:1", NULL};
  assert_int_equal(parse_validate(&c, b), 0);
  assert_int_equal(c.shape.kv_heads, 1);
  assert_int_equal(c.shape.q_heads, 4);
  assert_int_equal(c.model_kv_heads, 8);
  assert_int_equal(attnd_config_origin(&c, "kv-heads"), ATTND_FROM_DEFAULT);
  /* The whole model: 0:N, or no range. */
  const char *w[] = {"--kv-heads", "0:8", NULL};
  assert_int_equal(parse_validate(&c, w), 0);
  assert_int_equal(c.shape.kv_heads, 8);
  assert_int_equal(c.shape.model_kv_heads, 8);
  const char *n[] = {NULL};
  assert_int_equal(parse_validate(&c, n), 0);
  assert_int_equal(c.shape.kv_head_begin, 0);
  assert_int_equal(c.shape.model_kv_heads, 8);
  /* A file's N with a flag's range, and a model config's N with a flag's range. */
  char dir[64], conf[128], carg[160], model[128], marg[160];
  snprintf(dir, sizeof(dir), "/tmp/attnd-test-range-XXXXXX");
  assert_non_null(mkdtemp(dir));
  snprintf(conf, sizeof(conf), "%s/attnd.conf", dir);
  snprintf(model, sizeof(model), "%s/config.json", dir);
  write_file(conf, "q-heads = 8\nkv-heads = 4\n");
  snprintf(carg, sizeof(carg), "--config=%s", conf);
  const char *f[] = {carg, "--kv-heads", "3:4", NULL};
  assert_int_equal(parse_validate(&c, f), 0);
  assert_int_equal(c.shape.kv_heads, 1);
  assert_int_equal(c.shape.q_heads, 2);
  assert_int_equal(c.shape.kv_head_begin, 3);
  assert_int_equal(c.model_kv_heads, 4);
  write_file(model, "{\"num_hidden_layers\": 2, \"num_attention_heads\": 16,"
                    " \"num_key_value_heads\": 4, \"hidden_size\": 2048}");
  snprintf(marg, sizeof(marg), "--model-config=%s", model);
  const char *m[] = {marg, "--kv-heads", "1:3", NULL};
  assert_int_equal(parse_validate(&c, m), 0);
  assert_int_equal(c.model_kv_heads, 4);
  assert_int_equal(c.model_q_heads, 16);
  assert_int_equal(c.shape.kv_heads, 2);
  assert_int_equal(c.shape.q_heads, 8);
  /* The range checked against the model's N, naming where N came from. */
  const char *mb[] = {marg, "--kv-heads", "2:5", NULL};
  assert_int_not_equal(parse_validate(&c, mb), 0);
  assert_non_null(strstr(err, "0 <= A < B <= 4"));
  assert_non_null(strstr(err, "--model-config"));
  unlink(conf);
  unlink(model);
  rmdir(dir);
}

/* --model-config: values fill only what the file and flags left unset; the
 * rotated dims follow the head dimension in force; refusals name the field. */
static void test_model_config(void **state) {
  attnd_config_t c;
  char dir[64], model[128], conf[128], arg[160], carg[160];
  snprintf(dir, sizeof(dir), "/tmp/attnd-test-model-XXXXXX");
  assert_non_null(mkdtemp(dir));
  snprintf(model, sizeof(model), "%s/config.json", dir);
  snprintf(conf, sizeof(conf), "%s/attnd.conf", dir);
  write_file(model,
             "{\"model_type\": \"phi\", \"num_hidden_layers\": 6, \"num_attention_heads\": 8,"
             " \"num_key_value_heads\": 2, \"hidden_size\": 1024, \"rope_theta\": 250000,"
             " \"partial_rotary_factor\": 0.5, \"max_position_embeddings\": 4096,"
             " \"torch_dtype\": \"float16\", \"rope_scaling\": {\"rope_type\": \"default\"}}");
  snprintf(arg, sizeof(arg), "--model-config=%s", model);
  const char *a[] = {arg, NULL};
  assert_int_equal(parse_validate(&c, a), 0);
  assert_int_equal(c.layers, 6);
  assert_int_equal(c.shape.q_heads, 8);
  assert_int_equal(c.shape.kv_heads, 2);
  assert_int_equal(c.shape.head_dim, 128);
  assert_int_equal(c.shape.rotary_dim, 64);
  assert_true(c.shape.rope_theta == 250000.0);
  assert_int_equal(c.max_context, 4096);
  assert_int_equal(c.shape.dtype, ATTND_DT_FP16);
  assert_string_equal(c.model_id, "phi");
  assert_string_equal(c.model_type, "phi");
  assert_int_equal(attnd_config_origin(&c, "layers"), ATTND_FROM_MODEL);
  assert_int_equal(attnd_config_origin(&c, "block-size"), ATTND_FROM_DEFAULT);
  /* A file key and a flag win; the rotated half follows --head-dim 256. */
  write_file(conf, "[attnd]\nlayers = 3\n");
  snprintf(carg, sizeof(carg), "--config=%s", conf);
  const char *b[] = {"--head-dim", "256", arg, carg, NULL};
  assert_int_equal(parse_validate(&c, b), 0);
  assert_int_equal(c.layers, 3);
  assert_int_equal(attnd_config_origin(&c, "layers"), ATTND_FROM_FILE);
  assert_int_equal(c.shape.head_dim, 256);
  assert_int_equal(c.shape.rotary_dim, 128);
  assert_int_equal(c.shape.q_heads, 8);
  /* The model config named in the file works the same. */
  char text[300];
  snprintf(text, sizeof(text), "model-config = %s\nkv-heads = 4\n", model);
  write_file(conf, text);
  const char *f[] = {carg, NULL};
  assert_int_equal(parse_validate(&c, f), 0);
  assert_int_equal(c.shape.kv_heads, 4);
  assert_int_equal(c.layers, 6);
  /* Refusals, each naming its field, one line. */
  struct {
    const char *json, *needle;
  } bad[] = {
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
       " \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8}}",
       "rope_scaling.rope_type 'llama3'"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
       " \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2}}",
       "rope_scaling.type 'dynamic'"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
       " \"layer_types\": [\"full_attention\", \"sliding_attention\"]}",
       "layer_types[1] sliding_attention without a sliding_window"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
       " \"sliding_window\": 8, \"layer_types\": [\"full_attention\"]}",
       "layer_types: expected an array of 2"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
       " \"sliding_window\": 8, \"layer_types\": [\"full_attention\", \"chunked_attention\"]}",
       "layer_types[1] 'chunked_attention'"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
       " \"attn_logit_softcapping\": -1}",
       "attn_logit_softcapping -1"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
       " \"rope_theta\": 1000000, \"rope_local_base_freq\": 10000}",
       "rope_local_base_freq 10000"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
       " \"kv_lora_rank\": 512}",
       "kv_lora_rank"},
      {"{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 250}",
       "hidden_size 250 is not a multiple"},
      {"{\"num_hidden_layers\": 9000, \"num_attention_heads\": 4, \"hidden_size\": 256}",
       "num_hidden_layers 9000: --layers"},
      {"{\"num_attention_heads\": 4}", "no num_hidden_layers"},
      {"[1, 2]", "not a JSON object"},
      {"{\"num_hidden_layers\": 2,", "line"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    write_file(model, bad[i].json);
    int rc = parse(&c, a);
    if (rc == 0 || !strstr(err, bad[i].needle) || !strstr(err, model) || strchr(err, '\n'))
      fail_msg("case %zu: rc %d err '%s', expected '%s'", i, rc, err, bad[i].needle);
  }
  /* Qwen2-style: a window that is switched off is no window. */
  write_file(model, "{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 256,"
                    " \"sliding_window\": 4096, \"use_sliding_window\": false}");
  assert_int_equal(parse_validate(&c, a), 0);
  /* Windows, soft-capping and sinks from the model: Gemma 2's alternation,
   * Gemma 3's pattern (as its shortest period), gpt-oss's layer_types and
   * sinks, Mistral's one window; a flag wins. */
  write_file(model, "{\"model_type\": \"gemma2\", \"num_hidden_layers\": 4,"
                    " \"num_attention_heads\": 4, \"hidden_size\": 256, \"sliding_window\": 4096,"
                    " \"attn_logit_softcapping\": 50.0, \"query_pre_attn_scalar\": 256}");
  assert_int_equal(parse_validate(&c, a), 0);
  assert_int_equal(c.nlayer_windows, 2);
  assert_int_equal(attnd_config_layer_window(&c, 0), 4096);
  assert_int_equal(attnd_config_layer_window(&c, 1), 0);
  assert_int_equal(attnd_config_layer_window(&c, 2), 4096);
  assert_true(c.shape.softcap == 50.0f);
  assert_true(c.shape.softmax_scale == 0.0625f);
  assert_int_equal(attnd_config_origin(&c, "softcap"), ATTND_FROM_MODEL);
  assert_int_equal(c.attention_sinks, 0);
  write_file(model, "{\"model_type\": \"gemma3_text\", \"num_hidden_layers\": 14,"
                    " \"num_attention_heads\": 4, \"hidden_size\": 256, \"sliding_window\": 512,"
                    " \"rope_local_base_freq\": 10000, \"rope_theta\": 10000}");
  assert_int_equal(parse_validate(&c, a), 0);
  assert_int_equal(c.nlayer_windows, 6);
  for (int l = 0; l < 14; l++)
    assert_int_equal(attnd_config_layer_window(&c, l), (l + 1) % 6 ? 512 : 0);
  write_file(model, "{\"model_type\": \"gpt_oss\", \"num_hidden_layers\": 4,"
                    " \"num_attention_heads\": 8, \"num_key_value_heads\": 2, \"head_dim\": 64,"
                    " \"sliding_window\": 128, \"layer_types\": [\"sliding_attention\","
                    " \"full_attention\", \"sliding_attention\", \"full_attention\"],"
                    " \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 32.0}}");
  assert_int_equal(parse(&c, a), ATTND_EINVAL); /* YaRN: only with rope none */
  assert_non_null(strstr(err, "rope_scaling.rope_type 'yarn'"));
  const char *gpt[] = {arg, "--rope", "none", NULL};
  assert_int_equal(parse_validate(&c, gpt), 0);
  assert_int_equal(c.attention_sinks, 1);
  assert_int_equal(c.nlayer_windows, 2);
  assert_int_equal(attnd_config_layer_window(&c, 2), 128);
  assert_int_equal(attnd_config_layer_window(&c, 3), 0);
  write_file(model, "{\"model_type\": \"mistral\", \"num_hidden_layers\": 3,"
                    " \"num_attention_heads\": 4, \"hidden_size\": 256, \"sliding_window\": 4096}");
  assert_int_equal(parse_validate(&c, a), 0);
  assert_int_equal(c.nlayer_windows, 1);
  assert_int_equal(attnd_config_layer_window(&c, 2), 4096);
  const char *own[] = {arg, "--attention-windows", "0", "--softcap", "0", NULL};
  assert_int_equal(parse_validate(&c, own), 0);
  assert_int_equal(attnd_config_layer_window(&c, 2), 0);
  assert_int_equal(attnd_config_origin(&c, "attention-windows"), ATTND_FROM_FLAG);
  /* A value from the model that the daemon's checks refuse says where it came from. */
  write_file(model, "{\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"hidden_size\": 320}");
  assert_int_equal(parse_validate(&c, a), ATTND_EINVAL);
  assert_non_null(strstr(err, "--head-dim 80 (from --model-config"));
  unlink(model);
  unlink(conf);
  rmdir(dir);
}

/* daemon/config/resources.c, read from a fake /proc/self/cgroup and sysfs. */
uint64_t attnd_config_cgroup_room(const char *cgroup_file, const char *root);

static void mkdirs(const char *path) {
  char cmd[300];
  snprintf(cmd, sizeof(cmd), "mkdir -p '%s'", path);
  assert_int_equal(system(cmd), 0);
}

/* The cgroup's room: v2 and v1 files, the tightest along the path, "max"
 * and missing files meaning no limit. */
static void test_cgroup_room(void **state) {
  char dir[64], p[256], cg[256];
  snprintf(dir, sizeof(dir), "/tmp/attnd-test-cg-XXXXXX");
  assert_non_null(mkdtemp(dir));
  snprintf(cg, sizeof(cg), "%s/cgroup", dir);
  /* v2: the pod limits 2G (1.5G used), the container nothing ("max"). */
  write_file(cg, "0::/kubepods/pod1/ctr\n");
  snprintf(p, sizeof(p), "%s/sys/kubepods/pod1/ctr", dir);
  mkdirs(p);
  snprintf(p, sizeof(p), "%s/sys/kubepods/pod1/ctr/memory.max", dir);
  write_file(p, "max\n");
  snprintf(p, sizeof(p), "%s/sys/kubepods/pod1/memory.max", dir);
  write_file(p, "2147483648\n");
  snprintf(p, sizeof(p), "%s/sys/kubepods/pod1/memory.current", dir);
  write_file(p, "1610612736\n");
  snprintf(p, sizeof(p), "%s/sys", dir);
  assert_int_equal(attnd_config_cgroup_room(cg, p), 512ull << 20);
  /* v1 (a hybrid host): the memory controller's line; usage over the limit is 0. */
  write_file(cg, "4:memory:/job\n3:cpu:/job\n0::/\n");
  snprintf(p, sizeof(p), "%s/sys/memory/job", dir);
  mkdirs(p);
  snprintf(p, sizeof(p), "%s/sys/memory/job/memory.limit_in_bytes", dir);
  write_file(p, "1073741824\n");
  snprintf(p, sizeof(p), "%s/sys/memory/job/memory.usage_in_bytes", dir);
  write_file(p, "268435456\n");
  snprintf(p, sizeof(p), "%s/sys", dir);
  assert_int_equal(attnd_config_cgroup_room(cg, p), 768ull << 20);
  snprintf(p, sizeof(p), "%s/sys/memory/job/memory.usage_in_bytes", dir);
  write_file(p, "2147483648\n");
  snprintf(p, sizeof(p), "%s/sys", dir);
  assert_int_equal(attnd_config_cgroup_room(cg, p), 0);
  /* Nothing to read: no limit. */
  assert_int_equal(attnd_config_cgroup_room("/nonexistent/cgroup", p), UINT64_MAX);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

/* The KV pool against the host: at least one block per layer, and on the
 * CPU backend at most 90% of the memory available. */
static void test_resources(void **state) {
  attnd_config_t c;
  attnd_config_pool_t p;
  const char *def[] = {NULL};
  assert_int_equal(parse_validate(&c, def), 0);
  assert_int_equal(attnd_config_check_resources(&c, 1, &p, err, sizeof(err)), 0);
  assert_int_equal(p.kv_memory, 1ull << 30);
  assert_int_equal(p.block_bytes, 2 * 8 * 64 * 128 * 2); /* K and V, 8 heads, 64 tokens, bf16 */
  assert_int_equal(p.blocks, (1ull << 30) / (p.block_bytes * 32));
  /* On CUDA with kv-memory 0 the device decides: nothing to check here. */
  assert_int_equal(attnd_config_check_resources(&c, 0, &p, err, sizeof(err)), 0);
  assert_int_equal(p.blocks, 0);
  assert_int_equal(p.host_available, 0);
  const char *tiny[] = {"--kv-memory", "1K", NULL};
  assert_int_equal(parse_validate(&c, tiny), 0);
  assert_int_equal(attnd_config_check_resources(&c, 0, &p, err, sizeof(err)), ATTND_EINVAL);
  assert_non_null(strstr(err, "holds no KV block"));
  const char *huge[] = {"--kv-memory", "1000T", NULL};
  assert_int_equal(parse_validate(&c, huge), 0);
  assert_int_equal(attnd_config_check_resources(&c, 0, &p, err, sizeof(err)),
                   0); /* CUDA: ok here */
  assert_int_equal(attnd_config_check_resources(&c, 1, &p, err, sizeof(err)), ATTND_EINVAL);
  assert_non_null(strstr(err, "90%"));
  assert_true(p.host_available > 0 && p.host_limit < p.host_available);
  /* Just under the limit passes. */
  char v[32];
  snprintf(v, sizeof(v), "%llu", (unsigned long long)(p.host_limit / 2));
  const char *half[] = {"--kv-memory", v, NULL};
  assert_int_equal(parse_validate(&c, half), 0);
  assert_int_equal(attnd_config_check_resources(&c, 1, &p, err, sizeof(err)), 0);
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
      cmocka_unit_test(test_tuning),           cmocka_unit_test(test_getopt_forms),
      cmocka_unit_test(test_variant_options),  cmocka_unit_test(test_model_config),
      cmocka_unit_test(test_resources),        cmocka_unit_test(test_cgroup_room),
      cmocka_unit_test(test_kv_head_range),
  };
  return cmocka_run_group_tests(tests, NULL, cleanup);
}

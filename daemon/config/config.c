/* config.c: defaults, command line, config file and validation (DESIGN.md section 3).
 *
 * Flags and file keys go through one setter (set_option), so a key means the
 * same in both places and is checked the same way. The file is read first and
 * flags applied after it, whatever their order on the command line, so that
 * flags always win. */
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "config.h"
#include "base.h"

#define ERR(...)                                                                                   \
  do {                                                                                             \
    snprintf(err, errlen, __VA_ARGS__);                                                            \
    return ATTND_EINVAL;                                                                           \
  } while (0)

static int copy_str(char *dst, size_t cap, const char *v) {
  size_t n = strlen(v);
  if (n >= cap)
    return -1;
  memcpy(dst, v, n + 1);
  return 0;
}

/* Paths per DESIGN.md section 3: systemd's directories first, then root's
 * system directories, then the user's XDG directories. */
static void default_paths(attnd_config_t *c) {
  const char *rt = getenv("RUNTIME_DIRECTORY");
  const char *st = getenv("STATE_DIRECTORY");
  const char *xrt = getenv("XDG_RUNTIME_DIR");
  const char *xst = getenv("XDG_STATE_HOME");
  const char *home = getenv("HOME");
  uid_t uid = geteuid();
  /* systemd may pass several directories separated by ':'; the first is ours. */
  if (rt && rt[0]) {
    size_t n = strcspn(rt, ":");
    snprintf(c->socket_path, sizeof(c->socket_path), "%.*s/attnd.sock", (int)n, rt);
  } else if (uid == 0) {
    snprintf(c->socket_path, sizeof(c->socket_path), "/run/attnd/attnd.sock");
  } else if (xrt && xrt[0]) {
    snprintf(c->socket_path, sizeof(c->socket_path), "%s/attnd.sock", xrt);
  } else {
    snprintf(c->socket_path, sizeof(c->socket_path), "/tmp/attnd-%u/attnd.sock", (unsigned)uid);
  }
  if (st && st[0]) {
    size_t n = strcspn(st, ":");
    snprintf(c->state_dir, sizeof(c->state_dir), "%.*s", (int)n, st);
  } else if (uid == 0) {
    snprintf(c->state_dir, sizeof(c->state_dir), "/var/lib/attnd");
  } else if (xst && xst[0]) {
    snprintf(c->state_dir, sizeof(c->state_dir), "%s/attnd", xst);
  } else if (home && home[0]) {
    snprintf(c->state_dir, sizeof(c->state_dir), "%s/.local/state/attnd", home);
  } else {
    snprintf(c->state_dir, sizeof(c->state_dir), "/tmp/attnd-%u/state", (unsigned)uid);
  }
}

void attnd_config_defaults(attnd_config_t *c) {
  memset(c, 0, sizeof(*c));
  default_paths(c);
  snprintf(c->listen, sizeof(c->listen), "127.0.0.1:7411");
  snprintf(c->metrics, sizeof(c->metrics), "127.0.0.1:7412");
  c->backend = ATTND_BACKEND_AUTO;
  c->device = 0;
  snprintf(c->log_level, sizeof(c->log_level), "info");
  /* Llama-3-8B-like. */
  c->layers = 32;
  c->shape.q_heads = 32;
  c->shape.kv_heads = 8;
  c->shape.head_dim = 128;
  c->shape.block_size = 64;
  c->shape.dtype = ATTND_DT_BF16;
  c->shape.kv = ATTND_KV_BF16;
  c->shape.rope = ATTND_ROPE_NEOX;
  c->shape.rope_theta = 500000.0;
  c->shape.rotary_dim = 0;       /* = head_dim, filled by validate */
  c->shape.softmax_scale = 0.0f; /* = 1/sqrt(head_dim), filled by validate */
  c->max_context = 131072;
  snprintf(c->model_id, sizeof(c->model_id), "llama-3-8b");
  c->kv_memory = 0; /* backend default: 1G on CPU, 90% of free memory on CUDA */
  c->session_idle_s = 600;
  c->max_frame = 512ull << 20;
  c->max_inflight = 1ull << 30;
  c->max_connections = 1024;
  c->max_sessions = 65536;
  c->max_plans = 64;
  c->threads = 0;
  c->prefix_cache = 1;
  c->hello_timeout_ms = 10000;
}

/* Integer in [lo, hi]. */
static int parse_int(const char *v, long lo, long hi, long *out) {
  char *end;
  if (!v[0])
    return -1;
  long x = strtol(v, &end, 10);
  if (*end || x < lo || x > hi)
    return -1;
  *out = x;
  return 0;
}

/* Bytes with an optional binary suffix: 512M, 1G, 64k, 1GiB, 100 (bytes). */
static int parse_size(const char *v, uint64_t *out) {
  char *end;
  if (!v[0] || v[0] < '0' || v[0] > '9')
    return -1;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 10);
  if (errno == ERANGE || end == v)
    return -1;
  uint64_t mul = 1;
  if (*end) {
    switch (*end) {
    case 'k':
    case 'K':
      mul = 1ull << 10;
      break;
    case 'm':
    case 'M':
      mul = 1ull << 20;
      break;
    case 'g':
    case 'G':
      mul = 1ull << 30;
      break;
    case 't':
    case 'T':
      mul = 1ull << 40;
      break;
    case 'b':
    case 'B':
      mul = 1;
      end--;
      break;
    default:
      return -1;
    }
    end++;
    if (strcasecmp(end, "") != 0 && strcasecmp(end, "b") != 0 && strcasecmp(end, "ib") != 0)
      return -1;
  }
  if (mul > 1 && x > UINT64_MAX / mul)
    return -1;
  *out = (uint64_t)x * mul;
  return 0;
}

static int parse_double(const char *v, double *out) {
  char *end;
  if (!v[0])
    return -1;
  double x = strtod(v, &end);
  if (*end || !isfinite(x))
    return -1;
  *out = x;
  return 0;
}

int attnd_config_hostport(const char *s, char *host, size_t hostlen, int *port) {
  const char *colon;
  const char *h = s;
  size_t hl;
  if (s[0] == '[') {
    const char *rb = strchr(s, ']');
    if (!rb || rb[1] != ':')
      return ATTND_EINVAL;
    h = s + 1;
    hl = (size_t)(rb - h);
    colon = rb + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon)
      return ATTND_EINVAL;
    hl = (size_t)(colon - s);
  }
  if (hl == 0 || hl >= hostlen)
    return ATTND_EINVAL;
  long p;
  if (parse_int(colon + 1, 0, 65535, &p))
    return ATTND_EINVAL;
  memcpy(host, h, hl);
  host[hl] = 0;
  *port = (int)p;
  return 0;
}

/* The one place that knows every key. name has no leading dashes; '_' and '-'
 * are equivalent so that file keys may use either. */
/* A boolean config value: true/false, 1/0, yes/no, on/off. */
static int parse_bool(const char *name, const char *v, int *out, char *err, size_t errlen) {
  if (strcmp(v, "true") == 0 || strcmp(v, "1") == 0 || strcmp(v, "yes") == 0 ||
      strcmp(v, "on") == 0) {
    *out = 1;
    return 0;
  }
  if (strcmp(v, "false") == 0 || strcmp(v, "0") == 0 || strcmp(v, "no") == 0 ||
      strcmp(v, "off") == 0) {
    *out = 0;
    return 0;
  }
  snprintf(err, errlen, "%s: '%s' is not a boolean (true/false)", name, v);
  return ATTND_EINVAL;
}

static int set_option(attnd_config_t *c, const char *prefix, const char *name_in, const char *v,
                      char *err, size_t errlen) {
  char name[64];
  long x;
  uint64_t u;
  double d;
  if (copy_str(name, sizeof(name), name_in))
    ERR("unknown option '%s%s'", prefix, name_in);
  for (char *p = name; *p; p++)
    if (*p == '_')
      *p = '-';

#define STR(key, field)                                                                            \
  if (strcmp(name, key) == 0) {                                                                    \
    if (copy_str(c->field, sizeof(c->field), v))                                                   \
      ERR("--%s: value longer than %zu bytes", key, sizeof(c->field) - 1);                         \
    return 0;                                                                                      \
  }
#define INT(key, field, lo, hi)                                                                    \
  if (strcmp(name, key) == 0) {                                                                    \
    if (parse_int(v, lo, hi, &x))                                                                  \
      ERR("--%s: '%s' is not an integer in [%ld, %ld]", key, v, (long)(lo), (long)(hi));           \
    c->field = (int)x;                                                                             \
    return 0;                                                                                      \
  }
#define SIZE(key, field)                                                                           \
  if (strcmp(name, key) == 0) {                                                                    \
    if (parse_size(v, &u))                                                                         \
      ERR("--%s: '%s' is not a size (bytes, or a number with K, M, G or T)", key, v);              \
    c->field = u;                                                                                  \
    return 0;                                                                                      \
  }

  STR("socket", socket_path)
  STR("listen", listen)
  STR("metrics", metrics)
  STR("state-dir", state_dir)
  STR("token-file", token_file)
  STR("model-id", model_id)
  if (strcmp(name, "config") == 0) {
    if (copy_str(c->config_file, sizeof(c->config_file), v))
      ERR("--config: path too long");
    return 0;
  }
  if (strcmp(name, "log-level") == 0) {
    if (attnd_log_level_parse(v) < 0)
      ERR("--log-level: '%s' is not one of error, warn, info, debug", v);
    snprintf(c->log_level, sizeof(c->log_level), "%s", v);
    return 0;
  }
  if (strcmp(name, "backend") == 0) {
    if (strcmp(v, "auto") == 0)
      c->backend = ATTND_BACKEND_AUTO;
    else if (strcmp(v, "cpu") == 0)
      c->backend = ATTND_BACKEND_CPU;
    else if (strcmp(v, "cuda") == 0)
      c->backend = ATTND_BACKEND_CUDA;
    else
      ERR("--backend: '%s' is not one of auto, cpu, cuda", v);
    return 0;
  }
  INT("device", device, 0, 1023)
  INT("layers", layers, 1, 4096)
  INT("q-heads", shape.q_heads, 1, 1024)
  INT("kv-heads", shape.kv_heads, 1, 1024)
  INT("head-dim", shape.head_dim, 1, 4096)
  INT("block-size", shape.block_size, 1, 4096)
  INT("rotary-dim", shape.rotary_dim, 0, 4096)
  INT("max-context", max_context, 1, 1 << 30)
  INT("session-idle", session_idle_s, 0, 1 << 30)
  INT("max-connections", max_connections, 1, 1 << 20)
  INT("max-sessions", max_sessions, 1, 1 << 30)
  INT("max-plans", max_plans, 1, 1 << 16)
  INT("threads", threads, 0, 4096)
  INT("hello-timeout", hello_timeout_ms, 1, 1 << 30)
  SIZE("kv-memory", kv_memory)
  SIZE("max-frame", max_frame)
  SIZE("max-inflight", max_inflight)
  if (strcmp(name, "dtype") == 0) {
    if (strcmp(v, "bf16") == 0)
      c->shape.dtype = ATTND_DT_BF16;
    else if (strcmp(v, "fp16") == 0)
      c->shape.dtype = ATTND_DT_FP16;
    else
      ERR("--dtype: '%s' is not one of bf16, fp16", v);
    return 0;
  }
  if (strcmp(name, "kv-cache") == 0) {
    int t = attnd_kv_type_parse(v);
    if (t < 0)
      ERR("--kv-cache: '%s' is not one of bf16, fp16, int8, fp8, int8_dynamic, fp8_dynamic, int4",
          v);
    c->shape.kv = (attnd_kv_type_t)t;
    return 0;
  }
  if (strcmp(name, "rope") == 0) {
    if (strcmp(v, "none") == 0)
      c->shape.rope = ATTND_ROPE_NONE;
    else if (strcmp(v, "neox") == 0)
      c->shape.rope = ATTND_ROPE_NEOX;
    else if (strcmp(v, "interleaved") == 0)
      c->shape.rope = ATTND_ROPE_INTERLEAVED;
    else
      ERR("--rope: '%s' is not one of none, neox, interleaved", v);
    return 0;
  }
  if (strcmp(name, "rope-theta") == 0) {
    if (parse_double(v, &d) || !(d > 0))
      ERR("--rope-theta: '%s' is not a positive number", v);
    c->shape.rope_theta = d;
    return 0;
  }
  if (strcmp(name, "softmax-scale") == 0) {
    if (parse_double(v, &d) || !(d > 0) || d > 1e30)
      ERR("--softmax-scale: '%s' is not a positive number", v);
    c->shape.softmax_scale = (float)d;
    return 0;
  }
  if (strcmp(name, "prefix-cache") == 0)
    return parse_bool(name, v, &c->prefix_cache, err, errlen);
  if (strcmp(name, "require-token") == 0)
    return parse_bool(name, v, &c->require_token, err, errlen);
  ERR("unknown option '%s%s'", prefix, name_in);
#undef STR
#undef INT
#undef SIZE
}

/* Flags that take no value (of these only require-token is also a file key,
 * with a boolean value there). */
static int is_switch(const char *name) {
  return strcmp(name, "no-prefix-cache") == 0 || strcmp(name, "require-token") == 0 ||
         strcmp(name, "check-config") == 0 ||
         strcmp(name, "help") == 0 || strcmp(name, "version") == 0;
}

typedef struct {
  attnd_config_t *c;
  const char *path;
  char reason[200];
} ini_ctx_t;

static int ini_cb(void *user, const char *section, const char *name, const char *value) {
  ini_ctx_t *x = user;
  char e[200];
  if (section[0] && strcmp(section, "attnd") != 0) {
    if (!x->reason[0])
      snprintf(x->reason, sizeof(x->reason), "unknown section [%s]", section);
    return 0;
  }
  if ((is_switch(name) && strcmp(name, "require-token") != 0) || strcmp(name, "config") == 0) {
    if (!x->reason[0])
      snprintf(x->reason, sizeof(x->reason), "'%s' is a command-line flag, not a file key", name);
    return 0;
  }
  if (set_option(x->c, "", name, value, e, sizeof(e))) {
    if (!x->reason[0])
      snprintf(x->reason, sizeof(x->reason), "%s", e);
    return 0;
  }
  return 1;
}

static int load_file(attnd_config_t *c, const char *path, char *err, size_t errlen) {
  ini_ctx_t x = {.c = c, .path = path};
  int r = ini_parse(path, ini_cb, &x);
  if (r == -1)
    ERR("--config: cannot open '%s'", path);
  if (r == -2)
    ERR("--config: out of memory reading '%s'", path);
  if (r > 0)
    ERR("%s:%d: %s", path, r, x.reason[0] ? x.reason : "syntax error");
  return 0;
}

/* Splits argv[*i] into name and value; consumes the next argument when the
 * flag takes a value and has no '='. */
static int next_flag(int argc, char **argv, int *i, char *name, size_t namecap, const char **val,
                     char *err, size_t errlen) {
  const char *a = argv[*i];
  if (strncmp(a, "--", 2) != 0 || !a[2])
    ERR("unexpected argument '%s' (flags start with --)", a);
  a += 2;
  const char *eq = strchr(a, '=');
  size_t n = eq ? (size_t)(eq - a) : strlen(a);
  if (n >= namecap)
    ERR("unknown option '--%.*s'", (int)n, a);
  memcpy(name, a, n);
  name[n] = 0;
  if (is_switch(name)) {
    if (eq)
      ERR("--%s takes no value", name);
    *val = NULL;
    return 0;
  }
  if (eq) {
    *val = eq + 1;
  } else {
    if (*i + 1 >= argc)
      ERR("--%s needs a value", name);
    *val = argv[++*i];
  }
  return 0;
}

int attnd_config_parse(attnd_config_t *c, int argc, char **argv, char *err, size_t errlen) {
  char name[64];
  const char *v;
  int r;
  /* Pass 1: find --config (and reject malformed flags early). */
  for (int i = 1; i < argc; i++) {
    if ((r = next_flag(argc, argv, &i, name, sizeof(name), &v, err, errlen)))
      return r;
    if (strcmp(name, "config") == 0 && (r = set_option(c, "--", name, v, err, errlen)))
      return r;
  }
  if (c->config_file[0] && (r = load_file(c, c->config_file, err, errlen)))
    return r;
  /* Pass 2: flags override the file. */
  for (int i = 1; i < argc; i++) {
    next_flag(argc, argv, &i, name, sizeof(name), &v, err, errlen);
    if (strcmp(name, "config") == 0)
      continue;
    if (strcmp(name, "no-prefix-cache") == 0)
      c->prefix_cache = 0;
    else if (strcmp(name, "require-token") == 0)
      c->require_token = 1;
    else if (strcmp(name, "check-config") == 0)
      c->check_config = 1;
    else if (strcmp(name, "help") == 0)
      c->show_help = 1;
    else if (strcmp(name, "version") == 0)
      c->show_version = 1;
    else if ((r = set_option(c, "--", name, v, err, errlen)))
      return r;
  }
  return 0;
}

int attnd_config_validate(attnd_config_t *c, char *err, size_t errlen) {
  attnd_kshape_t *s = &c->shape;
  char host[128];
  int port;
  if (s->q_heads % s->kv_heads != 0)
    ERR("--q-heads %d is not a multiple of --kv-heads %d", s->q_heads, s->kv_heads);
  if (s->head_dim != 64 && s->head_dim != 128 && s->head_dim != 256)
    ERR("--head-dim %d: must be 64, 128 or 256", s->head_dim);
  if (s->block_size != 16 && s->block_size != 32 && s->block_size != 64 && s->block_size != 128)
    ERR("--block-size %d: must be 16, 32, 64 or 128", s->block_size);
  if (s->rotary_dim == 0)
    s->rotary_dim = s->head_dim;
  if (s->rotary_dim > s->head_dim || (s->rotary_dim & 1))
    ERR("--rotary-dim %d: must be even and <= --head-dim %d", s->rotary_dim, s->head_dim);
  if (s->softmax_scale == 0.0f)
    s->softmax_scale = (float)(1.0 / sqrt((double)s->head_dim));
  if (attnd_kshape_check(s) != 0)
    ERR("model shape is not one the kernels support");
  if (c->max_frame < 16)
    ERR("--max-frame %llu: must be at least 16 bytes", (unsigned long long)c->max_frame);
  if (c->max_frame >= (1ull << 31))
    ERR("--max-frame %llu: must be below 2G (2^31)", (unsigned long long)c->max_frame);
  if (c->max_inflight < c->max_frame)
    ERR("--max-inflight %llu: must be >= --max-frame %llu", (unsigned long long)c->max_inflight,
        (unsigned long long)c->max_frame);
  if (c->listen[0] && attnd_config_hostport(c->listen, host, sizeof(host), &port))
    ERR("--listen '%s': expected HOST:PORT", c->listen);
  if (c->metrics[0] && attnd_config_hostport(c->metrics, host, sizeof(host), &port))
    ERR("--metrics '%s': expected HOST:PORT", c->metrics);
  if (!c->socket_path[0] && !c->listen[0])
    ERR("--socket and --listen are both empty: nothing to listen on");
  if (c->socket_path[0] && c->socket_path[0] != '/')
    ERR("--socket '%s': must be an absolute path", c->socket_path);
  if (c->socket_path[0] && strlen(c->socket_path) >= 108)
    ERR("--socket '%s': longer than a Unix socket path may be (107 bytes)", c->socket_path);
  if (!c->state_dir[0])
    ERR("--state-dir: empty");
  if (c->token_file[0] && access(c->token_file, R_OK) != 0)
    ERR("--token-file '%s': not readable", c->token_file);
  if (!c->model_id[0])
    ERR("--model-id: empty");
  return 0;
}

const char *attnd_config_usage(void) {
  return "usage: attnd [--flag value | --flag=value]...\n"
         "\n"
         "Listeners:\n"
         "  --socket PATH          Unix socket (default per systemd/XDG, see DESIGN.md)\n"
         "  --listen HOST:PORT     TCP listener, default 127.0.0.1:7411; port 0 picks one; empty "
         "disables\n"
         "  --metrics HOST:PORT    Prometheus /metrics, default 127.0.0.1:7412; empty disables\n"
         "  --token-file FILE      tokens accepted in Hello (one per line); needed off loopback\n"
         "  --max-frame BYTES      largest frame, default 512M (< 2G)\n"
         "  --max-inflight BYTES   in-flight bytes per connection before reading stops, default "
         "1G\n"
         "  --max-connections N    default 1024\n"
         "  --hello-timeout MS     off-loopback TCP clients must send Hello within this, default "
         "10000\n"
         "  --require-token        every TCP client must send Hello{token}, loopback too\n"
         "Engine:\n"
         "  --backend auto|cpu|cuda  --device N  --threads N (CPU workers, 0 = cores)\n"
         "  --kv-memory BYTES      KV pool size (K/M/G suffix); default 1G CPU, 90% free GPU "
         "memory\n"
         "  --max-sessions N       default 65536\n"
         "  --session-idle SECONDS default 600\n"
         "  --no-prefix-cache      disable prefix sharing\n"
         "  --state-dir DIR        persisted scales\n"
         "Model shape (default Llama-3-8B-like):\n"
         "  --layers 32 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 64\n"
         "  --dtype bf16|fp16 --kv-cache bf16|fp16|int8|fp8|int8_dynamic|fp8_dynamic|int4\n"
         "  --rope none|neox|interleaved --rope-theta 500000 --rotary-dim N --softmax-scale X\n"
         "  --max-context 131072 --model-id NAME\n"
         "Other:\n"
         "  --config FILE          INI file, keys named as the flags without dashes; flags win\n"
         "  --log-level error|warn|info|debug\n"
         "  --check-config         validate the configuration and exit (0 ok, 2 bad)\n"
         "  --help  --version\n";
}

/* options.c: flags and config-file keys (docs/operations.md).
 *
 * Which options exist, and whether each takes a value, is the generated table
 * of deploy/options.toml (options_gen.h): getopt_long's table and the --help
 * text are made from it, so neither can drift from the documents. Flags and
 * file keys go through one setter (set_option), so a key means the same in
 * both places and is checked the same way; it records where each value came
 * from (attnd_config_t.origin). The file is read first and flags applied after
 * it, whatever their order on the command line, so that flags always win; a
 * --model-config file then fills only the shape options nobody set. */
#include <errno.h>
#include <getopt.h>
#include <ini.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base.h"
#include "internal.h"
#include "options_gen.h"

_Static_assert(ATTND_OPTION_COUNT <= ATTND_CONFIG_MAX_OPTIONS,
               "deploy/options.toml has more options than attnd_config_t.origin holds");

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

int attnd_config_parse_int(const char *v, long lo, long hi, long *out) {
  char *end;
  if (!v[0])
    return -1;
  long x = strtol(v, &end, 10);
  if (*end || x < lo || x > hi)
    return -1;
  *out = x;
  return 0;
}

int attnd_config_parse_size(const char *v, uint64_t *out) {
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

int attnd_config_option_index(const char *name) {
  for (int i = 0; i < ATTND_OPTION_COUNT; i++)
    if (strcmp(attnd_option_defs[i].name, name) == 0)
      return i;
  return -1;
}

int attnd_config_origin(const attnd_config_t *c, const char *name) {
  int i = attnd_config_option_index(name);
  return i < 0 ? -1 : c->origin[i];
}

const char *attnd_config_usage(void) {
  return ATTND_OPTIONS_HELP;
}

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

/* --attention-windows: "W1,W2,..." (spaces allowed around entries), each 0 (a
 * full layer) or a window in keys; "" or "none": every layer full. Nothing
 * changes on an error. */
static int parse_windows(attnd_config_t *c, const char *v, char *err, size_t errlen) {
  int32_t w[ATTND_CONFIG_MAX_WINDOWS];
  int n = 0;
  const char *p = v;
  while (*p == ' ')
    p++;
  if (*p == 0 || strcmp(p, "none") == 0) {
    c->nlayer_windows = 0;
    return 0;
  }
  for (;;) {
    char *end;
    while (*p == ' ')
      p++;
    errno = 0;
    long x = strtol(p, &end, 10);
    if (end == p || errno || x < 0 || x > (1l << 30))
      ERR("--attention-windows: '%s': entry %d is not a window in 0..%ld (0: full layer)", v, n + 1,
          1l << 30);
    if (n == ATTND_CONFIG_MAX_WINDOWS)
      ERR("--attention-windows: more than %d entries", ATTND_CONFIG_MAX_WINDOWS);
    w[n++] = (int32_t)x;
    p = end;
    while (*p == ' ')
      p++;
    if (*p == 0)
      break;
    if (*p != ',')
      ERR("--attention-windows: '%s': expected a comma-separated list of windows", v);
    p++;
  }
  memcpy(c->layer_windows, w, sizeof(int32_t) * (size_t)n);
  c->nlayer_windows = n;
  return 0;
}

/* The one place that knows what every option's value means. name has no
 * leading dashes; '_' and '-' are equivalent so that file keys may use either.
 * from (attnd_origin_t) is recorded as the option's origin. */
static int set_option(attnd_config_t *c, int from, const char *prefix, const char *name_in,
                      const char *v, char *err, size_t errlen) {
  char name[64];
  long x;
  uint64_t u;
  double d;
  if (copy_str(name, sizeof(name), name_in))
    ERR("unknown option '%s%s'", prefix, name_in);
  for (char *p = name; *p; p++)
    if (*p == '_')
      *p = '-';
  int idx = attnd_config_option_index(name);
  if (idx < 0)
    ERR("unknown option '%s%s'", prefix, name_in);
  uint8_t prev_origin = c->origin[idx];
  c->origin[idx] = (uint8_t)from;

#define STR(key, field)                                                                            \
  if (strcmp(name, key) == 0) {                                                                    \
    if (copy_str(c->field, sizeof(c->field), v))                                                   \
      ERR("--%s: value longer than %zu bytes", key, sizeof(c->field) - 1);                         \
    return 0;                                                                                      \
  }
#define INT(key, field, lo, hi)                                                                    \
  if (strcmp(name, key) == 0) {                                                                    \
    if (attnd_config_parse_int(v, lo, hi, &x))                                                     \
      ERR("--%s: '%s' is not an integer in [%ld, %ld]", key, v, (long)(lo), (long)(hi));           \
    c->field = (int)x;                                                                             \
    return 0;                                                                                      \
  }
#define SIZE(key, field)                                                                           \
  if (strcmp(name, key) == 0) {                                                                    \
    if (attnd_config_parse_size(v, &u))                                                            \
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
  STR("model-config", model_config)
  STR("log-file", log_file)
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
  if (strcmp(name, "kv-heads") == 0) {
    /* N: the model's kv heads; A:B: the range this daemon holds (the model's
     * N then comes from elsewhere: a file key, --model-config, the default),
     * so the range form leaves kv-heads' origin as it was for --model-config. */
    const char *colon = strchr(v, ':');
    if (!colon) {
      if (attnd_config_parse_int(v, 1, 1024, &x))
        ERR("--kv-heads: '%s' is not an integer in [1, 1024] or a range A:B", v);
      c->shape.kv_heads = (int)x;
      return 0;
    }
    c->origin[idx] = prev_origin;
    char a[16];
    long b;
    size_t al = (size_t)(colon - v);
    if (al == 0 || al >= sizeof(a))
      ERR("--kv-heads: '%s' is not an integer N or a range A:B with 0 <= A < B", v);
    memcpy(a, v, al);
    a[al] = 0;
    if (attnd_config_parse_int(a, 0, 1023, &x) || attnd_config_parse_int(colon + 1, 1, 1024, &b) ||
        x >= b)
      ERR("--kv-heads: '%s' is not an integer N or a range A:B with 0 <= A < B", v);
    c->kv_range_begin = (int)x;
    c->kv_range_end = (int)b;
    return 0;
  }
  INT("head-dim", shape.head_dim, 1, 4096)
  INT("block-size", shape.block_size, 1, 4096)
  INT("rotary-dim", shape.rotary_dim, 0, 4096)
  INT("max-context", max_context, 1, 1 << 30)
  INT("session-idle", session_idle_s, 0, 1 << 30)
  INT("max-connections", max_connections, 1, 1 << 20)
  INT("max-sessions", max_sessions, 1, 1 << 30)
  INT("max-sessions-per-identity", max_sessions_per_identity, 0, 1 << 30)
  INT("max-plans", max_plans, 1, 1 << 16)
  INT("threads", threads, 0, 4096)
  INT("hello-timeout", hello_timeout_ms, 1, 1 << 30)
  SIZE("max-partial-bytes", max_partial_bytes)
  INT("frame-deadline", frame_deadline_ms, 0, 1 << 30)
  INT("idle-timeout", idle_timeout_s, 0, 1 << 30)
  INT("max-connections-per-identity", max_conns_per_identity, 0, 1 << 20)
  SIZE("kv-memory", kv_memory)
  SIZE("max-frame", max_frame)
  SIZE("max-inflight", max_inflight)
  SIZE("socket-buffer", socket_buffer)
  INT("worker-threads", worker_threads, 0, 1024)
  SIZE("engine-offload-bytes", engine_offload_bytes)
  SIZE("engine-chunk-keys", engine_chunk_keys)
  SIZE("rpc-ref-min", rpc_ref_min)
  SIZE("cuda-pinned-max", cuda_pinned_max)
  SIZE("cuda-pinned-warm", cuda_pinned_warm)
  SIZE("cuda-ring", cuda_ring)
  SIZE("cuda-frame-pool", cuda_frame_pool)
  SIZE("cuda-hostfn-min", cuda_hostfn_min)
  INT("step-trace", step_trace, 0, 1 << 16)
  INT("busy-poll-us", busy_poll_us, 0, 1000000)
  if (strcmp(name, "cuda-completion") == 0) {
    if (strcmp(v, "poll") == 0)
      c->cuda_completion = ATTND_COMPLETION_POLL;
    else if (strcmp(v, "callback") == 0)
      c->cuda_completion = ATTND_COMPLETION_CALLBACK;
    else if (strcmp(v, "loop") == 0)
      c->cuda_completion = ATTND_COMPLETION_LOOP;
    else
      ERR("--cuda-completion: '%s' is not one of poll, callback, loop", v);
    return 0;
  }
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
  if (strcmp(name, "softcap") == 0) {
    if (parse_double(v, &d) || !(d >= 0) || d > 1e30)
      ERR("--softcap: '%s' is not a number >= 0 (0: none)", v);
    c->shape.softcap = (float)d;
    return 0;
  }
  if (strcmp(name, "attention-windows") == 0)
    return parse_windows(c, v, err, errlen);
  if (strcmp(name, "attention-sinks") == 0)
    return parse_bool(name, v, &c->attention_sinks, err, errlen);
  if (strcmp(name, "prefix-cache") == 0)
    return parse_bool(name, v, &c->prefix_cache, err, errlen);
  if (strcmp(name, "require-token") == 0)
    return parse_bool(name, v, &c->require_token, err, errlen);
  if (strcmp(name, "ipc") == 0)
    return parse_bool(name, v, &c->ipc, err, errlen);
  if (strcmp(name, "cuda-trace") == 0)
    return parse_bool(name, v, &c->cuda_trace, err, errlen);
  if (strcmp(name, "cuda-graphs") == 0)
    return parse_bool(name, v, &c->cuda_graphs, err, errlen);
  if (strcmp(name, "cuda-graph-replay") == 0)
    return parse_bool(name, v, &c->cuda_graph_replay, err, errlen);
  ERR("unknown option '%s%s'", prefix, name_in);
#undef STR
#undef INT
#undef SIZE
}

int attnd_config_set(attnd_config_t *c, int from, const char *name, const char *value, char *err,
                     size_t errlen) {
  return set_option(c, from, "--", name, value, err, errlen);
}

/* A flag that takes no value; on the command line only unless it is a
 * boolean file key (require-token, cuda-trace). */
static int is_switch(int idx) {
  return idx >= 0 && attnd_option_defs[idx].kind == ATTND_OPT_SWITCH;
}

typedef struct {
  attnd_config_t *c;
  const char *path;
  char reason[200];
} ini_ctx_t;

static int ini_cb(void *user, const char *section, const char *name, const char *value) {
  ini_ctx_t *x = user;
  char e[200], key[64];
  if (section[0] && strcmp(section, "attnd") != 0) {
    if (!x->reason[0])
      snprintf(x->reason, sizeof(x->reason), "unknown section [%s]", section);
    return 0;
  }
  snprintf(key, sizeof(key), "%s", name);
  for (char *p = key; *p; p++)
    if (*p == '_')
      *p = '-';
  int idx = attnd_config_option_index(key);
  if (idx >= 0 && !attnd_option_defs[idx].file) {
    if (!x->reason[0])
      snprintf(x->reason, sizeof(x->reason), "'%s' is a command-line flag, not a file key", name);
    return 0;
  }
  if (set_option(x->c, ATTND_FROM_FILE, "", name, value, e, sizeof(e))) {
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

/* A switch given on the command line. */
static void set_switch(attnd_config_t *c, int idx) {
  const char *name = attnd_option_defs[idx].name;
  c->origin[idx] = ATTND_FROM_FLAG;
  if (strcmp(name, "no-prefix-cache") == 0) {
    c->prefix_cache = 0;
    c->origin[attnd_config_option_index("prefix-cache")] = ATTND_FROM_FLAG;
  } else if (strcmp(name, "require-token") == 0) {
    c->require_token = 1;
  } else if (strcmp(name, "cuda-trace") == 0) {
    c->cuda_trace = 1;
  } else if (strcmp(name, "cuda-graphs") == 0) {
    c->cuda_graphs = 1;
  } else if (strcmp(name, "check-config") == 0) {
    c->check_config = 1;
  } else if (strcmp(name, "help") == 0) {
    c->show_help = 1;
  } else if (strcmp(name, "version") == 0) {
    c->show_version = 1;
  }
}

/* The one-line reason for an option getopt_long did not take: argument a
 * ("--bogus=1", "--max", "--check-config=1", "-x"), optopt as getopt left it. */
static int bad_option(const char *a, int optopt_v, char *err, size_t errlen) {
  if (strncmp(a, "--", 2) != 0) {
    if (optopt_v > 0 && optopt_v < 256)
      ERR("unknown option '-%c'", optopt_v);
    ERR("unknown option '%s'", a);
  }
  const char *name = a + 2;
  size_t n = strcspn(name, "=");
  int exact = -1, matches = 0, first = -1;
  char cands[160] = "";
  for (int i = 0; i < ATTND_OPTION_COUNT; i++) {
    const attnd_option_def_t *o = &attnd_option_defs[i];
    if (o->kind == ATTND_OPT_FILE_ONLY || strncmp(o->name, name, n) != 0)
      continue;
    if (strlen(o->name) == n)
      exact = i;
    if (matches++ == 0)
      first = i;
    size_t l = strlen(cands);
    if (l + strlen(o->name) + 5 < sizeof(cands))
      snprintf(cands + l, sizeof(cands) - l, "%s--%s", l ? ", " : "", o->name);
  }
  int idx = exact >= 0 ? exact : matches == 1 ? first : -1;
  if (idx >= 0 && name[n] == '=' && is_switch(idx))
    ERR("--%s takes no value", attnd_option_defs[idx].name);
  if (matches > 1 && exact < 0)
    ERR("ambiguous option '--%.*s' (%s)", (int)n, name, cands);
  ERR("unknown option '--%.*s'", (int)n, name);
}

typedef struct {
  int idx;
  const char *val;
} flag_t;

/* Reads the command line into flags[] (getopt_long), in order. */
static int read_flags(int argc, char **argv, flag_t *flags, int *nflags, char *err, size_t errlen) {
  struct option lo[ATTND_OPTION_COUNT + 1];
  char shortopts[16 + 2 * ATTND_OPTION_COUNT];
  int nl = 0, ns = 0;
  /* '-': operands come back in order as 1 (they are errors), whatever
   * POSIXLY_CORRECT says; ':': a missing value is reported as ':'. */
  shortopts[ns++] = '-';
  shortopts[ns++] = ':';
  for (int i = 0; i < ATTND_OPTION_COUNT; i++) {
    const attnd_option_def_t *o = &attnd_option_defs[i];
    if (o->kind == ATTND_OPT_FILE_ONLY)
      continue;
    int has = o->kind == ATTND_OPT_VALUE ? required_argument : no_argument;
    lo[nl++] = (struct option){o->name, has, NULL, 256 + i};
    if (o->short_name) {
      shortopts[ns++] = o->short_name;
      if (has == required_argument)
        shortopts[ns++] = ':';
    }
  }
  lo[nl] = (struct option){NULL, 0, NULL, 0};
  shortopts[ns] = 0;
  optind = 0; /* GNU: a full reinitialization, so that argv may be parsed again */
  opterr = 0;
  int ch;
  while ((ch = getopt_long(argc, argv, shortopts, lo, NULL)) != -1) {
    const char *a = argv[optind - 1];
    if (ch == 1)
      ERR("unexpected argument '%s' (options start with --)", optarg);
    if (ch == ':')
      ERR("%s needs a value", a);
    int idx = -1;
    if (ch >= 256) {
      idx = ch - 256;
    } else {
      for (int i = 0; i < ATTND_OPTION_COUNT; i++)
        if (attnd_option_defs[i].short_name && attnd_option_defs[i].short_name == ch)
          idx = i;
    }
    if (idx < 0)
      return bad_option(a, optopt, err, errlen);
    flags[(*nflags)++] = (flag_t){idx, optarg};
  }
  if (optind < argc)
    ERR("unexpected argument '%s' (options start with --)", argv[optind]);
  return 0;
}

int attnd_config_parse(attnd_config_t *c, int argc, char **argv, char *err, size_t errlen) {
  flag_t *flags = attnd_xcalloc((size_t)argc + 1, sizeof(*flags));
  int n = 0, r;
  if ((r = read_flags(argc, argv, flags, &n, err, errlen))) {
    c->usage_error = 1;
    goto done;
  }
  /* --config first, then the file, then the other flags over it. */
  for (int i = 0; i < n; i++)
    if (strcmp(attnd_option_defs[flags[i].idx].name, "config") == 0 &&
        (r = set_option(c, ATTND_FROM_FLAG, "--", "config", flags[i].val, err, errlen)))
      goto done;
  if (c->config_file[0] && (r = load_file(c, c->config_file, err, errlen)))
    goto done;
  for (int i = 0; i < n; i++) {
    const char *name = attnd_option_defs[flags[i].idx].name;
    if (strcmp(name, "config") == 0)
      continue;
    if (is_switch(flags[i].idx))
      set_switch(c, flags[i].idx);
    else if ((r = set_option(c, ATTND_FROM_FLAG, "--", name, flags[i].val, err, errlen)))
      goto done;
  }
  /* The model's shape, where nothing above set it. */
  if (c->model_config[0])
    r = attnd_config_model_apply(c, err, errlen);
done:
  free(flags);
  return r;
}

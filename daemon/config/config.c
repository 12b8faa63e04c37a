/* config.c: defaults, cross-field validation, and what --check-config prints.
 * options.c reads flags and the INI file into the same struct (and holds the
 * generated --help text), model_config.c a Hugging Face config.json,
 * resources.c checks the KV pool against the host. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "base.h"
#include "internal.h"

#define ERR(...)                                                                                   \
  do {                                                                                             \
    snprintf(err, errlen, __VA_ARGS__);                                                            \
    return ATTND_EINVAL;                                                                           \
  } while (0)

/* Paths (docs/operations.md): systemd's directories first, then root's
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
  c->socket_buffer = 0;
  c->max_inflight = 1ull << 30;
  c->max_connections = 1024;
  c->max_sessions = 65536;
  c->max_sessions_per_identity = 0; /* a quarter of max_sessions */
  c->max_plans = 64;
  c->threads = 0;
  c->prefix_cache = 1;
  c->ipc = 1;
  c->hello_timeout_ms = 10000;
  c->max_partial_bytes = 0;
  c->frame_deadline_ms = 30000;
  c->idle_timeout_s = 300;
  c->max_conns_per_identity = 0;
  c->engine_offload_bytes = ATTND_DEFAULT_ENGINE_OFFLOAD_BYTES;
  c->engine_chunk_keys = ATTND_DEFAULT_ENGINE_CHUNK_KEYS;
  c->rpc_ref_min = ATTND_DEFAULT_RPC_REF_MIN;
  c->worker_threads = 0;
  c->cuda_pinned_max = 0;
  c->cuda_pinned_warm = 0;
  c->cuda_ring = 0;
  c->cuda_frame_pool = 0;
  c->cuda_hostfn_min = ATTND_DEFAULT_CUDA_HOSTFN_MIN;
  c->cuda_completion = ATTND_COMPLETION_POLL;
  c->cuda_trace = 0;
  c->cuda_graphs = 0;
  c->cuda_graph_replay = 1;
  c->step_trace = 0;
  c->busy_poll_us = 0;
}

int attnd_config_worker_threads(const attnd_config_t *c) {
  if (c->worker_threads > 0)
    return c->worker_threads;
  int n = c->threads > 0 ? c->threads : (int)uv_available_parallelism();
  return n < 4 ? 4 : n;
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
  if (attnd_config_parse_int(colon + 1, 0, 65535, &p))
    return ATTND_EINVAL;
  memcpy(host, h, hl);
  host[hl] = 0;
  *port = (int)p;
  return 0;
}

/* " (from --model-config FILE)" when the model config gave the option its value. */
static const char *from(const attnd_config_t *c, const char *name, char *buf, size_t cap) {
  if (attnd_config_origin(c, name) != ATTND_FROM_MODEL)
    return "";
  snprintf(buf, cap, " (from --model-config %s)", c->model_config);
  return buf;
}

/* A file the daemon may append to: writable, or creatable in its directory.
 * Nothing is created here (--check-config changes nothing). */
static int appendable(const char *path) {
  if (access(path, F_OK) == 0)
    return access(path, W_OK);
  char dir[256];
  snprintf(dir, sizeof(dir), "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash)
    return access(".", W_OK | X_OK);
  if (slash == dir)
    slash[1] = 0;
  else
    *slash = 0;
  return access(dir, W_OK | X_OK);
}

int attnd_config_validate(attnd_config_t *c, char *err, size_t errlen) {
  attnd_kshape_t *s = &c->shape;
  char host[128], f1[300], f2[300];
  int port;
  /* The model's totals: a second validate of the same config sees the held
   * shape in s and the totals already filled. */
  int mq = c->model_kv_heads ? c->model_q_heads : s->q_heads;
  int mkv = c->model_kv_heads ? c->model_kv_heads : s->kv_heads;
  if (mq % mkv != 0)
    ERR("--q-heads %d is not a multiple of --kv-heads %d%s", mq, mkv,
        from(c, "q-heads", f1, sizeof(f1))[0] ? f1 : from(c, "kv-heads", f2, sizeof(f2)));
  int a = 0, b = mkv;
  if (c->kv_range_end) {
    a = c->kv_range_begin;
    b = c->kv_range_end;
    if (a < 0 || a >= b || b > mkv)
      ERR("--kv-heads %d:%d: the held range must satisfy 0 <= A < B <= %d, the model's kv "
          "heads%s",
          a, b, mkv, from(c, "kv-heads", f1, sizeof(f1)));
  }
  c->model_q_heads = mq;
  c->model_kv_heads = mkv;
  s->q_heads = (b - a) * (mq / mkv);
  s->kv_heads = b - a;
  s->kv_head_begin = a;
  s->model_kv_heads = mkv;
  if (s->head_dim != 64 && s->head_dim != 128 && s->head_dim != 256)
    ERR("--head-dim %d%s: must be 64, 128 or 256", s->head_dim,
        from(c, "head-dim", f1, sizeof(f1)));
  if (s->block_size != 16 && s->block_size != 32 && s->block_size != 64 && s->block_size != 128)
    ERR("--block-size %d: must be 16, 32, 64 or 128", s->block_size);
  if (s->rotary_dim == 0)
    s->rotary_dim = s->head_dim;
  if (s->rotary_dim > s->head_dim || (s->rotary_dim & 1))
    ERR("--rotary-dim %d%s: must be even and <= --head-dim %d", s->rotary_dim,
        from(c, "rotary-dim", f1, sizeof(f1)), s->head_dim);
  if (s->softmax_scale == 0.0f)
    s->softmax_scale = (float)(1.0 / sqrt((double)s->head_dim));
  if (!(s->softcap >= 0.0f) || isinf(s->softcap))
    ERR("--softcap %g%s: must be a finite number >= 0", (double)s->softcap,
        from(c, "softcap", f1, sizeof(f1)));
  if (c->nlayer_windows > c->layers)
    ERR("--attention-windows%s: %d entries for %d layers (the list repeats over the layers; it may "
        "not be longer than --layers)",
        from(c, "attention-windows", f1, sizeof(f1)), c->nlayer_windows, c->layers);
  if (attnd_kshape_check(s) != 0)
    ERR("model shape is not one the kernels support");
  if (c->max_frame < 16)
    ERR("--max-frame %llu: must be at least 16 bytes", (unsigned long long)c->max_frame);
  if (c->max_frame >= (1ull << 31))
    ERR("--max-frame %llu: must be below 2G (2^31)", (unsigned long long)c->max_frame);
  if (c->socket_buffer > (1ull << 30))
    ERR("--socket-buffer %llu: must be at most 1G", (unsigned long long)c->socket_buffer);
  if (c->max_inflight < c->max_frame)
    ERR("--max-inflight %llu: must be >= --max-frame %llu", (unsigned long long)c->max_inflight,
        (unsigned long long)c->max_frame);
  /* The CUDA ring's least size (daemon/backend/internal.h CU_RING_MIN); its
   * fit under --cuda-pinned-max is checked at start, beside the pooled
   * buffers whose count depends on the streams. */
  if (c->cuda_ring && c->cuda_ring < (1u << 20))
    ERR("--cuda-ring %llu: must be 0 (the default) or at least 1M",
        (unsigned long long)c->cuda_ring);
  if (c->cuda_ring && c->cuda_pinned_max && c->cuda_ring > c->cuda_pinned_max)
    ERR("--cuda-ring %llu: must fit --cuda-pinned-max %llu", (unsigned long long)c->cuda_ring,
        (unsigned long long)c->cuda_pinned_max);
  /* The frame pool's least size (daemon/backend/internal.h CU_FRAMES_MIN). */
  if (c->cuda_frame_pool && c->cuda_frame_pool < (1u << 20))
    ERR("--cuda-frame-pool %llu: must be 0 (the default) or at least 1M",
        (unsigned long long)c->cuda_frame_pool);
  if (c->cuda_frame_pool && c->cuda_pinned_max && c->cuda_frame_pool > c->cuda_pinned_max)
    ERR("--cuda-frame-pool %llu: must fit --cuda-pinned-max %llu",
        (unsigned long long)c->cuda_frame_pool, (unsigned long long)c->cuda_pinned_max);
  if (c->max_partial_bytes && c->max_partial_bytes < c->max_frame)
    ERR("--max-partial-bytes %llu: must be 0 (auto) or >= --max-frame %llu",
        (unsigned long long)c->max_partial_bytes, (unsigned long long)c->max_frame);
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
  if (c->log_file[0] && appendable(c->log_file) != 0)
    ERR("--log-file '%s': cannot be written or created", c->log_file);
  return 0;
}

int attnd_config_layer_window(const attnd_config_t *c, int layer) {
  if (c->nlayer_windows <= 0 || layer < 0)
    return 0;
  return c->layer_windows[layer % c->nlayer_windows];
}

void attnd_config_windows_text(const attnd_config_t *c, char *buf, size_t cap) {
  size_t n = 0;
  buf[0] = 0;
  for (int i = 0; i < c->nlayer_windows && n + 1 < cap; i++) {
    int w = snprintf(buf + n, cap - n, "%s%d", i ? "," : "", (int)c->layer_windows[i]);
    if (w < 0 || (size_t)w >= cap - n) {
      buf[n] = 0; /* never a cut entry: "..." marks the cut */
      if (n + 4 <= cap)
        memcpy(buf + n, "...", 4);
      return;
    }
    n += (size_t)w;
  }
}

static const char *const rope_names[] = {"none", "neox", "interleaved"};

void attnd_config_print(const attnd_config_t *c, const attnd_config_pool_t *p, FILE *f) {
  const attnd_kshape_t *s = &c->shape;
  static const char *const origin_names[] = {"default", "model config", "config file", "flag"};
  fprintf(f, "# model shape: ");
  if (c->model_config[0])
    fprintf(f, "from --model-config %s (model_type %s); keys and flags win\n", c->model_config,
            c->model_type[0] ? c->model_type : "?");
  else
    fprintf(f, "built-in defaults, keys and flags\n");
  char v[160];
#define LINE(name, fmt, ...)                                                                       \
  do {                                                                                             \
    snprintf(v, sizeof(v), fmt, __VA_ARGS__);                                                      \
    fprintf(f, "%-13s = %-16s # %s\n", name, v, origin_names[attnd_config_origin(c, name) & 3]);   \
  } while (0)
  LINE("layers", "%d", c->layers);
  LINE("q-heads", "%d", c->model_q_heads);
  LINE("kv-heads", "%d", c->model_kv_heads);
  LINE("head-dim", "%d", s->head_dim);
  LINE("rope", "%s", (unsigned)s->rope < 3 ? rope_names[s->rope] : "?");
  LINE("rope-theta", "%.17g", s->rope_theta);
  LINE("rotary-dim", "%d", s->rotary_dim);
  LINE("softmax-scale", "%.9g", (double)s->softmax_scale);
  LINE("softcap", "%.9g", (double)s->softcap);
  {
    char w[160];
    attnd_config_windows_text(c, w, sizeof(w));
    LINE("attention-windows", "%s", w[0] ? w : "none");
  }
  LINE("attention-sinks", "%s", c->attention_sinks ? "true" : "false");
  LINE("max-context", "%d", c->max_context);
  LINE("dtype", "%s", s->dtype == ATTND_DT_FP16 ? "fp16" : "bf16");
  LINE("kv-cache", "%s", attnd_kv_type_name(s->kv));
  LINE("block-size", "%d", s->block_size);
  LINE("model-id", "%s", c->model_id);
#undef LINE
  if (s->kv_heads != c->model_kv_heads)
    fprintf(f, "# held: kv heads %d:%d of %d and their q heads %d:%d (head-sharded)\n",
            s->kv_head_begin, s->kv_head_begin + s->kv_heads, c->model_kv_heads,
            s->kv_head_begin * (c->model_q_heads / c->model_kv_heads),
            (s->kv_head_begin + s->kv_heads) * (c->model_q_heads / c->model_kv_heads));
  char a[32], b[32];
  if (p->kv_memory) {
    uint64_t tokens = p->blocks * (uint64_t)s->block_size;
    attnd_config_fmt_size(a, sizeof(a), p->blocks * p->block_bytes * (uint64_t)c->layers);
    fprintf(f,
            "# KV pool: %s on the %s backend, %llu blocks of %d tokens per layer (%llu tokens, "
            "%zu bytes per block)\n",
            a, p->cpu ? "CPU" : "CUDA", (unsigned long long)p->blocks, s->block_size,
            (unsigned long long)tokens, p->block_bytes);
  } else {
    fprintf(f, "# KV pool: 90%% of the free device memory (CUDA backend), %zu bytes per block\n",
            p->block_bytes);
  }
  if (p->cpu && p->host_available) {
    attnd_config_fmt_size(a, sizeof(a), p->host_limit);
    attnd_config_fmt_size(b, sizeof(b), p->host_available);
    fprintf(f, "# host memory: kv-memory may be up to %s (90%% of the %s available)\n", a, b);
  }
}

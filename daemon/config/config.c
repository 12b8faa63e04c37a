/* config.c: defaults, cross-field validation and the --help text.
 * options.c reads flags and the INI file into the same struct. */
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
  c->max_inflight = 1ull << 30;
  c->max_connections = 1024;
  c->max_sessions = 65536;
  c->max_sessions_per_identity = 0; /* a quarter of max_sessions */
  c->max_plans = 64;
  c->threads = 0;
  c->prefix_cache = 1;
  c->hello_timeout_ms = 10000;
  c->engine_offload_bytes = ATTND_DEFAULT_ENGINE_OFFLOAD_BYTES;
  c->engine_chunk_keys = ATTND_DEFAULT_ENGINE_CHUNK_KEYS;
  c->rpc_ref_min = ATTND_DEFAULT_RPC_REF_MIN;
  c->worker_threads = 0;
  c->cuda_pinned_max = 0;
  c->cuda_hostfn_min = ATTND_DEFAULT_CUDA_HOSTFN_MIN;
  c->cuda_completion = ATTND_COMPLETION_POLL;
  c->cuda_trace = 0;
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
         "  --socket PATH          Unix socket (default per systemd/XDG, see docs/operations.md)\n"
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
         "  --max-sessions-per-identity N  default 0 = max-sessions / 4\n"
         "  --session-idle SECONDS default 600\n"
         "  --no-prefix-cache      disable prefix sharing\n"
         "  --state-dir DIR        persisted scales\n"
         "Tuning (how work is done, never its result):\n"
         "  --worker-threads N     libuv worker pool, default 0 = max(4, --threads or cores)\n"
         "  --engine-offload-bytes BYTES  steps with more q+k+v bytes are scanned on the\n"
         "                         worker pool behind an admission queue, default 1M\n"
         "  --engine-chunk-keys N  large steps' attention runs in chunks of about N keys\n"
         "                         per q head, between other steps; default 16K, 0 = whole\n"
         "  --rpc-ref-min BYTES    step outputs this large go to the socket without a copy, "
         "default 64K\n"
         "  --cuda-pinned-max BYTES  pinned staging cap, default 0 = 1/8 of RAM in [256M, 8G]\n"
         "  --cuda-hostfn-min BYTES  larger q+k+v are staged by a host function, default 1M\n"
         "  --cuda-completion poll|callback  default poll (an event poller thread)\n"
         "  --cuda-trace           log medians of where CUDA steps' time goes, every 256 steps\n"
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

/* config.h: the daemon's configuration (docs/operations.md).
 *
 * Flags and config-file keys share names (`--kv-memory` <-> `kv-memory = ...`;
 * the file is INI-style, parsed with libinih; flags with getopt_long).
 * Precedence: built-in defaults, then a --model-config file (a Hugging Face
 * config.json: it supplies only shape options that are not set explicitly),
 * then the config file, then flags. Everything is fixed at start, and this is
 * the one place that reads options: no other part of the daemon looks at the
 * environment (config reads only the systemd and XDG directories behind the
 * default paths; the logger, systemd's JOURNAL_STREAM). The option list is
 * deploy/options.toml: the getopt table and the --help text are generated
 * from it at build time; deploy/attnd.conf lists every key with its default. */
#ifndef ATTND_CONFIG_H
#define ATTND_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "attnd_kernels.h"

/* Defaults of the tuning options (the rest are set in attnd_config_defaults). */
#define ATTND_DEFAULT_ENGINE_OFFLOAD_BYTES ((uint64_t)1 << 20)
#define ATTND_DEFAULT_ENGINE_CHUNK_KEYS ((uint64_t)1 << 14)
#define ATTND_DEFAULT_RPC_REF_MIN ((uint64_t)64 << 10)
#define ATTND_DEFAULT_CUDA_HOSTFN_MIN ((uint64_t)64 << 10)

/* Where an option's value came from (attnd_config_t.origin), in rising precedence. */
typedef enum {
  ATTND_FROM_DEFAULT = 0,
  ATTND_FROM_MODEL = 1, /* --model-config */
  ATTND_FROM_FILE = 2,  /* --config */
  ATTND_FROM_FLAG = 3,
} attnd_origin_t;

/* Most entries of --attention-windows (the pattern repeats over the layers). */
#define ATTND_CONFIG_MAX_WINDOWS 256

/* Room for the options of deploy/options.toml (checked at compile time). */
#define ATTND_CONFIG_MAX_OPTIONS 128

typedef enum {
  ATTND_BACKEND_AUTO = 0,
  ATTND_BACKEND_CPU = 1,
  ATTND_BACKEND_CUDA = 2
} attnd_backend_kind_t;

/* How the CUDA backend learns that a job finished. */
typedef enum {
  ATTND_COMPLETION_POLL = 0,
  ATTND_COMPLETION_CALLBACK = 1,
  ATTND_COMPLETION_LOOP = 2
} attnd_completion_t;

typedef struct {
  /* Listeners. Empty strings disable a listener. */
  char socket_path[256];        /* --socket; default per docs/operations.md */
  char listen[128];             /* --listen HOST:PORT, default 127.0.0.1:7411; port 0 picks one */
  char metrics[128];            /* --metrics HOST:PORT, default 127.0.0.1:7412 */
  attnd_backend_kind_t backend; /* --backend auto|cpu|cuda */
  int device;                   /* --device N */
  char state_dir[256];          /* --state-dir */
  char token_file[256];         /* --token-file: tokens accepted in Hello, one per line */
  char config_file[256];        /* --config */
  char log_level[16];           /* --log-level error|warn|info|debug */
  char log_file[256];           /* --log-file: append here instead of stderr */

  /* Model shape (attnd_kshape_t carries the kernels' part of it). */
  int layers;           /* --layers, default 32 */
  attnd_kshape_t shape; /* --q-heads --kv-heads --head-dim --block-size --dtype
                         * --kv-cache --rope --rope-theta --rotary-dim --softmax-scale */
  /* Head sharding (docs/scale-out.md): --kv-heads takes the model's kv heads N
   * or the held range A:B. Options carry the model's totals in shape.q_heads and
   * shape.kv_heads; attnd_config_validate then narrows shape to the held heads
   * ((B-A)*g q heads, B-A kv heads: every tensor's head count) and fills the
   * model totals below and shape.model_kv_heads / shape.kv_head_begin. */
  int kv_range_begin, kv_range_end; /* --kv-heads A:B as given; end 0: the whole model */
  int model_q_heads;                /* filled by validate: the model's heads, all shards */
  int model_kv_heads;
  int max_context;        /* --max-context, default 131072 */
  char model_id[128];     /* --model-id */
  char model_config[256]; /* --model-config: a Hugging Face config.json */
  char model_type[64];    /* its model_type, for --check-config */
  /* Per-layer attention variants (docs/numerics.md); softcap is shape.softcap. */
  int32_t layer_windows[ATTND_CONFIG_MAX_WINDOWS]; /* --attention-windows: layer i slides by
                                                    * entry i % nlayer_windows; 0 full */
  int nlayer_windows;                              /* 0: every layer full */
  int attention_sinks; /* --attention-sinks: sink logits per layer and q head (SetSinks) */

  /* Limits. */
  uint64_t kv_memory;            /* --kv-memory bytes; 0 = backend default */
  int session_idle_s;            /* --session-idle, default 600 */
  uint64_t max_frame;            /* --max-frame, default 512M, < 2^31 */
  uint64_t max_inflight;         /* --max-inflight bytes per connection, >= max_frame */
  uint64_t socket_buffer;        /* --socket-buffer: Unix connections' SO_SNDBUF (0, the default: kernel's) */
  int max_connections;           /* --max-connections */
  int max_sessions;              /* --max-sessions */
  int max_sessions_per_identity; /* --max-sessions-per-identity; 0 = max_sessions / 4 */
  int max_plans;                 /* live plans per connection (oldest ends first) */
  int threads;                   /* CPU backend worker parts, 0 = number of cores */
  int prefix_cache;              /* 1: prefix caching on (default) */

  /* Actions asked on the command line (not config-file keys). */
  int check_config; /* --check-config: validate, then exit 0 or 2 */
  int show_help;    /* --help */
  int show_version; /* --version */
  int usage_error;  /* set by attnd_config_parse when the command line itself was wrong */

  /* Off-loopback TCP connections that send no Hello within this many
   * milliseconds are closed, so they cannot hold --max-connections slots. */
  int hello_timeout_ms; /* --hello-timeout, default 10000 */

  /* Require Hello{token} on every TCP connection, loopback included: on a host
   * shared with other users, loopback proves nothing about who connects. */
  int require_token; /* --require-token, default false */
  int ipc;           /* --ipc: same-host clients may register device buffers, default true */

  /* Connection limits (docs/protocol.md §9). */
  uint64_t max_partial_bytes; /* --max-partial-bytes: partly received frames, all
                               * connections; 0 = 1/4 of RAM within [max-frame, 2G] */
  int frame_deadline_ms;      /* --frame-deadline: a started frame must be complete
                               * within this many ms, default 30000; 0 = none */
  int idle_timeout_s;         /* --idle-timeout: idle connections close after this
                               * many seconds, default 300; 0 = never */
  int max_conns_per_identity; /* --max-connections-per-identity, default 0 = no cap */

  /* Tuning: thresholds and switches that change how work is done, never its
   * result (docs/operations.md). */
  uint64_t engine_offload_bytes;      /* --engine-offload-bytes: steps with more q+k+v
                                       * bytes are scanned for non-finite values on
                                       * the worker pool, default 1M */
  uint64_t engine_chunk_keys;         /* --engine-chunk-keys: a large step's attention runs
                                       * in chunks reading about this many keys per q
                                       * head, interleaved with other steps; 0 = whole */
  uint64_t rpc_ref_min;               /* --rpc-ref-min: step outputs this large are written
                                       * to the socket from the engine's buffer, default 64K */
  int worker_threads;                 /* --worker-threads: libuv worker pool size
                                       * (UV_THREADPOOL_SIZE), 0 = max(4, CPU workers) */
  uint64_t cuda_pinned_max;           /* --cuda-pinned-max: pinned staging cap, 0 = 1/8 of
                                       * host memory within [256M, 8G] */
  uint64_t cuda_ring;                 /* --cuda-ring: the pinned ring large steps are staged
                                       * through in chunks, made at start, 0 = 256M */
  uint64_t cuda_pinned_warm;          /* --cuda-pinned-warm: the older name of cuda_ring */
  uint64_t cuda_frame_pool;           /* --cuda-frame-pool: pinned frames and outputs, made
                                       * at start, 0 = 1/16 of host memory, at most 2G */
  uint64_t cuda_hostfn_min;           /* --cuda-hostfn-min: q+k+v bytes copied to pinned
                                       * memory by a host function past this, default 1M */
  attnd_completion_t cuda_completion; /* --cuda-completion poll|callback|loop */
  int cuda_trace;                     /* --cuda-trace: log where steps' time goes */
  int cuda_graphs;                    /* --cuda-graphs: small steps as one graph launch */
  int cuda_graph_replay;              /* --cuda-graph-replay: a graph launched as it is where it can */
  int step_trace;                     /* --step-trace N: log steps' phases every N (0 off) */
  int busy_poll_us;                   /* --busy-poll-us: the loop polls this long after RPC
                                       * activity instead of sleeping (0 off) */

  /* attnd_origin_t of each option, indexed by its row in deploy/options.toml
   * (attnd_config_origin() looks one up by name). */
  uint8_t origin[ATTND_CONFIG_MAX_OPTIONS];
} attnd_config_t;

/* The KV pool the options ask for, and what the host can give it
 * (attnd_config_check_resources). */
typedef struct {
  int cpu;                 /* 1: the CPU backend will serve (else CUDA) */
  uint64_t kv_memory;      /* asked (0 on CUDA: 90% of free device memory) */
  size_t block_bytes;      /* one block of one layer */
  uint64_t blocks;         /* per layer; 0 when the device decides (CUDA, kv-memory 0) */
  uint64_t host_available; /* CPU: MemAvailable + SwapFree, or the cgroup's room; 0 unknown */
  uint64_t host_limit;     /* CPU: 90% of host_available, the most kv-memory may be */
} attnd_config_pool_t;

/* Fills built-in defaults (environment-dependent paths included). */
void attnd_config_defaults(attnd_config_t *c);
/* Parses argv (getopt_long: --flag value, --flag=value, unique prefixes; -h,
 * -V), then the file named by --config, then the --model-config file, with the
 * precedence above. On error returns a negative ATTND_E* and writes a one-line
 * reason into err (a usage error: the daemon exits 2). */
int attnd_config_parse(attnd_config_t *c, int argc, char **argv, char *err, size_t errlen);
/* Checks cross-field constraints; fills derived values (softmax scale, rotary_dim).
 * A value that came from --model-config is named as such in the reason. */
int attnd_config_validate(attnd_config_t *c, char *err, size_t errlen);
/* The start-time checks that need no device (docs/operations.md section 1):
 * the KV pool holds at least one block per layer, and on the CPU backend
 * (cpu_backend: --backend cpu, or auto with no CUDA device) it fits in 90% of
 * the host memory available to the daemon (MemAvailable + SwapFree, or what
 * the cgroup's memory.max leaves). Fills *pool; after attnd_config_validate. */
int attnd_config_check_resources(const attnd_config_t *c, int cpu_backend,
                                 attnd_config_pool_t *pool, char *err, size_t errlen);
/* What --check-config prints after "configuration ok": the model shape as
 * config-file keys (with where it came from) and the KV pool. */
void attnd_config_print(const attnd_config_t *c, const attnd_config_pool_t *pool, FILE *f);
/* attnd_origin_t of the option name ("layers"), or -1 for no such option. */
int attnd_config_origin(const attnd_config_t *c, const char *name);

/* Splits "HOST:PORT" or "[V6HOST]:PORT" into host and port (0..65535). */
int attnd_config_hostport(const char *s, char *host, size_t hostlen, int *port);
/* The --help text (generated from deploy/options.toml). */
const char *attnd_config_usage(void);
/* The window of layer l (0: a full layer), from --attention-windows. */
int attnd_config_layer_window(const attnd_config_t *c, int layer);
/* --attention-windows as text ("4096,0"; "" for none) into buf. */
void attnd_config_windows_text(const attnd_config_t *c, char *buf, size_t cap);

/* The libuv worker pool size the options ask for (--worker-threads, or its
 * default from --threads and the core count). */
int attnd_config_worker_threads(const attnd_config_t *c);

#endif /* ATTND_CONFIG_H */

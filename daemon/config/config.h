/* config.h: the daemon's configuration (docs/operations.md).
 *
 * Flags and config-file keys share names (`--kv-memory` <-> `kv-memory = ...`;
 * the file is INI-style, parsed with libinih). Precedence: built-in defaults,
 * then the config file, then flags. Everything is fixed at start, and this is
 * the one place that reads options: no other part of the daemon looks at the
 * environment (config reads only the systemd and XDG directories behind the
 * default paths). deploy/attnd.conf lists every key with its
 * default; `attnd --help` prints them. */
#ifndef ATTND_CONFIG_H
#define ATTND_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "attnd_kernels.h"

/* Defaults of the tuning options (the rest are set in attnd_config_defaults). */
#define ATTND_DEFAULT_ENGINE_OFFLOAD_BYTES ((uint64_t)1 << 20)
#define ATTND_DEFAULT_ENGINE_CHUNK_KEYS ((uint64_t)1 << 14)
#define ATTND_DEFAULT_RPC_REF_MIN ((uint64_t)64 << 10)
#define ATTND_DEFAULT_CUDA_HOSTFN_MIN ((uint64_t)1 << 20)

typedef enum {
  ATTND_BACKEND_AUTO = 0,
  ATTND_BACKEND_CPU = 1,
  ATTND_BACKEND_CUDA = 2
} attnd_backend_kind_t;

/* How the CUDA backend learns that a job finished. */
typedef enum { ATTND_COMPLETION_POLL = 0, ATTND_COMPLETION_CALLBACK = 1 } attnd_completion_t;

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

  /* Model shape (attnd_kshape_t carries the kernels' part of it). */
  int layers;           /* --layers, default 32 */
  attnd_kshape_t shape; /* --q-heads --kv-heads --head-dim --block-size --dtype
                         * --kv-cache --rope --rope-theta --rotary-dim --softmax-scale */
  int max_context;      /* --max-context, default 131072 */
  char model_id[128];   /* --model-id */

  /* Limits. */
  uint64_t kv_memory;    /* --kv-memory bytes; 0 = backend default */
  int session_idle_s;    /* --session-idle, default 600 */
  uint64_t max_frame;    /* --max-frame, default 512M, < 2^31 */
  uint64_t max_inflight; /* --max-inflight bytes per connection, >= max_frame */
  int max_connections;   /* --max-connections */
  int max_sessions;      /* --max-sessions */
  int max_sessions_per_identity; /* --max-sessions-per-identity; 0 = max_sessions / 4 */
  int max_plans;         /* live plans per connection (oldest ends first) */
  int threads;           /* CPU backend worker parts, 0 = number of cores */
  int prefix_cache;      /* 1: prefix caching on (default) */

  /* Actions asked on the command line (not config-file keys). */
  int check_config; /* --check-config: validate, then exit 0 or 2 */
  int show_help;    /* --help */
  int show_version; /* --version */

  /* Off-loopback TCP connections that send no Hello within this many
   * milliseconds are closed, so they cannot hold --max-connections slots. */
  int hello_timeout_ms; /* --hello-timeout, default 10000 */

  /* Require Hello{token} on every TCP connection, loopback included: on a host
   * shared with other users, loopback proves nothing about who connects. */
  int require_token; /* --require-token, default false */

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
  uint64_t cuda_hostfn_min;           /* --cuda-hostfn-min: q+k+v bytes copied to pinned
                                       * memory by a host function past this, default 1M */
  attnd_completion_t cuda_completion; /* --cuda-completion poll|callback */
  int cuda_trace;                     /* --cuda-trace: log where steps' time goes */
} attnd_config_t;

/* Fills built-in defaults (environment-dependent paths included). */
void attnd_config_defaults(attnd_config_t *c);
/* Parses argv (flags override the file named by --config). On error returns a
 * negative ATTND_E* and writes a one-line reason into err. */
int attnd_config_parse(attnd_config_t *c, int argc, char **argv, char *err, size_t errlen);
/* Checks cross-field constraints; fills derived values (softmax scale, rotary_dim). */
int attnd_config_validate(attnd_config_t *c, char *err, size_t errlen);

/* Splits "HOST:PORT" or "[V6HOST]:PORT" into host and port (0..65535). */
int attnd_config_hostport(const char *s, char *host, size_t hostlen, int *port);
/* The --help text. */
const char *attnd_config_usage(void);
/* The libuv worker pool size the options ask for (--worker-threads, or its
 * default from --threads and the core count). */
int attnd_config_worker_threads(const attnd_config_t *c);

#endif /* ATTND_CONFIG_H */

/* config.h: the daemon's configuration (DESIGN.md section 3).
 *
 * Flags and config-file keys share names (`--kv-memory` <-> `kv-memory = ...`;
 * the file is INI-style, parsed with libinih). Precedence: built-in defaults,
 * then the config file, then flags. Everything is fixed at start. */
#ifndef ATTND_CONFIG_H
#define ATTND_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "attnd_kernels.h"

typedef enum { ATTND_BACKEND_AUTO = 0, ATTND_BACKEND_CPU = 1, ATTND_BACKEND_CUDA = 2 } attnd_backend_kind_t;

typedef struct {
  /* Listeners. Empty strings disable a listener. */
  char socket_path[256];    /* --socket; default per DESIGN.md section 3 */
  char listen[128];         /* --listen HOST:PORT, default 127.0.0.1:7411; port 0 picks one */
  char metrics[128];        /* --metrics HOST:PORT, default 127.0.0.1:7412 */
  attnd_backend_kind_t backend; /* --backend auto|cpu|cuda */
  int device;               /* --device N */
  char state_dir[256];      /* --state-dir */
  char token_file[256];     /* --token-file: tokens accepted in Hello, one per line */
  char config_file[256];    /* --config */
  char log_level[16];       /* --log-level error|warn|info|debug */

  /* Model shape (attnd_kshape_t carries the kernels' part of it). */
  int layers;               /* --layers, default 32 */
  attnd_kshape_t shape;     /* --q-heads --kv-heads --head-dim --block-size --dtype
                             * --kv-cache --rope --rope-theta --rotary-dim --softmax-scale */
  int max_context;          /* --max-context, default 131072 */
  char model_id[128];       /* --model-id */

  /* Limits. */
  uint64_t kv_memory;       /* --kv-memory bytes; 0 = backend default */
  int session_idle_s;       /* --session-idle, default 600 */
  uint64_t max_frame;       /* --max-frame, default 512M, < 2^31 */
  uint64_t max_inflight;    /* --max-inflight bytes per connection, >= max_frame */
  int max_connections;      /* --max-connections */
  int max_sessions;         /* --max-sessions */
  int max_plans;            /* live plans per connection (oldest ends first) */
  int threads;              /* CPU backend worker parts, 0 = number of cores */
  int prefix_cache;         /* 1: prefix caching on (default) */

  /* Actions asked on the command line (not config-file keys). */
  int check_config;         /* --check-config: validate, then exit 0 or 2 */
  int show_help;            /* --help */
  int show_version;         /* --version */

  /* Off-loopback TCP connections that send no Hello within this many
   * milliseconds are closed, so they cannot hold --max-connections slots. */
  int hello_timeout_ms;     /* --hello-timeout, default 10000 */

  /* Require Hello{token} on every TCP connection, loopback included: on a host
   * shared with other users, loopback proves nothing about who connects. */
  int require_token;        /* --require-token, default false */
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

#endif /* ATTND_CONFIG_H */

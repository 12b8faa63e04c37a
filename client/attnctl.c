/* attnctl: command-line client of attnd (DESIGN.md section 8).
 *
 *   attnctl [--socket P | --tcp H:P] [--token-file F] [--json] <command> [options]
 *
 * Exit codes are part of the interface, so scripts can tell a daemon that said
 * no from one that is not there: 0 ok, 1 the daemon answered an error (or the
 * connection broke after it was made), 2 usage, 3 cannot connect. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "attnclient.h"

enum { EXIT_OK = 0, EXIT_DAEMON = 1, EXIT_USAGE = 2, EXIT_CONNECT = 3 };

typedef struct {
  const char *socket_path;
  const char *tcp;
  const char *token_file;
  int json;
  int help;
  double watch;    /* stats --watch N seconds, 0 = once */
  int watch_count; /* stats --count N: stop after N samples (tests) */
  /* bench */
  int sessions;
  int prompt;
  int steps;
  int depth;
  int use_plan;
  int want_lse;
  unsigned seed;
  const char *token; /* from --token-file, for reconnects */
} opts_t;

static const char *const usage_main =
    "usage: attnctl [--socket PATH | --tcp HOST:PORT] [--token-file FILE] [--json] COMMAND "
    "[options]\n"
    "\n"
    "Talks to a running attnd. Without --socket or --tcp it looks for the socket in\n"
    "$RUNTIME_DIRECTORY, /run/attnd (root), $XDG_RUNTIME_DIR, /tmp/attnd-$UID, then /run/attnd.\n"
    "\n"
    "commands:\n"
    "  health     daemon status, version, backend, epoch\n"
    "  stats      counters: connections, sessions, blocks, prefix cache, methods\n"
    "  sessions   this identity's sessions (ListSessions)\n"
    "  config     the model shape and limits the daemon serves\n"
    "  bench      closed-loop load: prefill, then decode steps with random bf16 data\n"
    "\n"
    "options:\n"
    "  --socket PATH      Unix socket of the daemon\n"
    "  --tcp HOST:PORT    TCP address of the daemon\n"
    "  --token-file FILE  send the first line of FILE in Hello (needed off loopback)\n"
    "  --json             machine-readable output (one JSON object per line)\n"
    "  --help             this text; `attnctl COMMAND --help` for a command\n"
    "\n"
    "exit codes: 0 ok, 1 the daemon answered an error, 2 usage, 3 cannot connect\n";

static const char *const usage_health =
    "usage: attnctl [global options] health\n"
    "Prints the daemon's status (serving|draining), version, backend and device, epoch,\n"
    "uptime, bound TCP port and KV memory. Exit 0 when it answers.\n";
static const char *const usage_stats =
    "usage: attnctl [global options] stats [--watch SECONDS] [--count N]\n"
    "Prints the daemon's counters as tables (or JSON with --json). With --watch it\n"
    "prints them every SECONDS with per-second rates since the previous sample,\n"
    "until interrupted or N samples (--count) have been printed. When the daemon\n"
    "goes away it reconnects every SECONDS and reports a restart (new epoch).\n";
static const char *const usage_sessions =
    "usage: attnctl [global options] sessions\n"
    "Lists the sessions of the calling identity: id, length (layer 0), blocks, idle time.\n";
static const char *const usage_config =
    "usage: attnctl [global options] config\n"
    "Prints the model shape (layers, heads, head_dim, block size, dtypes, RoPE) and the\n"
    "limits (max context, KV memory, blocks, token capacity) reported by Health.\n";
static const char *const usage_bench =
    "usage: attnctl [global options] bench [--sessions N] [--prompt N] [--steps N]\n"
    "                                      [--depth N] [--inline] [--lse] [--seed N]\n"
    "Closed-loop load generator. Opens N sessions (default 4), prefills each with a\n"
    "prompt of --prompt tokens (default 64) through every layer, then runs --steps\n"
    "decode steps (default 32): each is a Plan for all sessions and one Step per\n"
    "layer with random bf16 q, k, v. --depth keeps up to N layer steps in flight\n"
    "(default 1), --inline sends items with every Step instead of a Plan. Prints\n"
    "progress, then p50/p99/max latency per layer step and per token, and steps/s.\n";

static int usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "attnctl: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\nTry 'attnctl --help'.\n");
  return EXIT_USAGE;
}

static int parse_int(const char *s, int min, int *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || end == s || v < min || v > 1000000000)
    return -1;
  *out = (int)v;
  return 0;
}

/* ---- JSON output ---- */

static void json_str(const char *s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      printf("\\%c", ch);
    else if (ch == '\n')
      printf("\\n");
    else if (ch < 0x20)
      printf("\\u%04x", ch);
    else
      putchar(ch);
  }
  putchar('"');
}

static void json_kstr(const char *k, const char *v, int *first) {
  printf("%s\"%s\":", *first ? "" : ",", k);
  json_str(v);
  *first = 0;
}

static void json_ku(const char *k, uint64_t v, int *first) {
  printf("%s\"%s\":%" PRIu64, *first ? "" : ",", k, v);
  *first = 0;
}

static void json_kf(const char *k, double v, int *first) {
  printf("%s\"%s\":", *first ? "" : ",", k);
  if (isfinite(v))
    printf("%.6g", v);
  else
    printf("null");
  *first = 0;
}

/* ---- human output helpers ---- */

static const char *human_bytes(uint64_t b, char *buf, size_t len) {
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%" PRIu64 " B", b);
  else
    snprintf(buf, len, "%.1f %s", v, units[u]);
  return buf;
}

static const char *human_duration(uint64_t s, char *buf, size_t len) {
  if (s >= 86400)
    snprintf(buf, len, "%" PRIu64 "d%02" PRIu64 "h%02" PRIu64 "m", s / 86400, s / 3600 % 24,
             s / 60 % 60);
  else if (s >= 3600)
    snprintf(buf, len, "%" PRIu64 "h%02" PRIu64 "m%02" PRIu64 "s", s / 3600, s / 60 % 60, s % 60);
  else if (s >= 60)
    snprintf(buf, len, "%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
  else
    snprintf(buf, len, "%" PRIu64 "s", s);
  return buf;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- errors ---- */

static int report(attnd_client_t *c, int rc, const char *what) {
  if (rc == ATTND_CLIENT_ECONNECT) {
    fprintf(stderr, "attnctl: %s\n", attnd_client_errmsg(c));
    return EXIT_CONNECT;
  }
  fprintf(stderr, "attnctl: %s: %s\n", what, attnd_client_errmsg(c));
  return EXIT_DAEMON;
}

/* ---- health / config ---- */

static int cmd_health(attnd_client_t *c, const opts_t *o) {
  attnd_v1_HealthResponse h;
  int rc = attnd_client_health(c, &h);
  if (rc)
    return report(c, rc, "health");
  char b1[32], b2[32];
  if (o->json) {
    int f = 1;
    printf("{");
    json_kstr("status", h.status, &f);
    json_kstr("version", h.version, &f);
    json_kstr("backend", h.backend, &f);
    json_kstr("device", h.device, &f);
    char ep[24];
    snprintf(ep, sizeof(ep), "%016" PRIx64, h.epoch);
    json_kstr("epoch", ep, &f);
    json_ku("uptime_s", h.uptime_s, &f);
    json_ku("tcp_port", h.tcp_port, &f);
    json_ku("kv_memory_bytes", h.kv_memory_bytes, &f);
    json_ku("kv_blocks", h.kv_blocks, &f);
    json_ku("device_memory_bytes", h.device_memory_bytes, &f);
    json_ku("compute_capability", h.compute_capability, &f);
    json_kstr("socket", attnd_client_addr(c), &f);
    printf("}\n");
    return EXIT_OK;
  }
  printf("attnd %s: %s\n", h.version, h.status);
  printf("  %-14s %s (%s)\n", "backend", h.backend, h.device);
  if (h.compute_capability)
    printf("  %-14s %u.%u\n", "compute cap.", h.compute_capability / 10, h.compute_capability % 10);
  if (h.device_memory_bytes)
    printf("  %-14s %s\n", "device memory", human_bytes(h.device_memory_bytes, b1, sizeof(b1)));
  printf("  %-14s %016" PRIx64 "\n", "epoch", h.epoch);
  printf("  %-14s %s\n", "uptime", human_duration(h.uptime_s, b2, sizeof(b2)));
  printf("  %-14s %s\n", "address", attnd_client_addr(c));
  if (h.tcp_port)
    printf("  %-14s %u\n", "tcp port", h.tcp_port);
  else
    printf("  %-14s off\n", "tcp port");
  printf("  %-14s %s in %u blocks\n", "kv memory", human_bytes(h.kv_memory_bytes, b1, sizeof(b1)),
         h.kv_blocks);
  if (h.has_model)
    printf("  %-14s %u layers, %u q / %u kv heads, head_dim %u, %s, kv %s\n", "model",
           h.model.layers, h.model.q_heads, h.model.kv_heads, h.model.head_dim, h.model.dtype,
           h.model.kv_cache);
  return EXIT_OK;
}

static int cmd_config(attnd_client_t *c, const opts_t *o) {
  attnd_v1_HealthResponse h;
  int rc = attnd_client_health(c, &h);
  if (rc)
    return report(c, rc, "config");
  const attnd_v1_ModelShape *m = &h.model;
  uint64_t capacity = m->kv_bytes_per_token ? h.kv_memory_bytes / m->kv_bytes_per_token : 0;
  if (o->json) {
    int f = 1;
    printf("{");
    json_ku("layers", m->layers, &f);
    json_ku("q_heads", m->q_heads, &f);
    json_ku("kv_heads", m->kv_heads, &f);
    json_ku("head_dim", m->head_dim, &f);
    json_ku("block_size", m->block_size, &f);
    json_kstr("dtype", m->dtype, &f);
    json_kstr("kv_cache", m->kv_cache, &f);
    json_kstr("rope", m->rope, &f);
    json_kf("rope_theta", m->rope_theta, &f);
    json_ku("rotary_dim", m->rotary_dim, &f);
    json_kf("softmax_scale", m->softmax_scale, &f);
    json_ku("max_context", m->max_context, &f);
    json_kstr("model_id", m->model_id, &f);
    json_ku("kv_bytes_per_token", m->kv_bytes_per_token, &f);
    json_ku("kv_memory_bytes", h.kv_memory_bytes, &f);
    json_ku("kv_blocks", h.kv_blocks, &f);
    json_ku("token_capacity", capacity, &f);
    json_kstr("backend", h.backend, &f);
    printf("}\n");
    return EXIT_OK;
  }
  char b[32];
  printf("model\n");
  printf("  %-20s %s\n", "model_id", *m->model_id ? m->model_id : "(none)");
  printf("  %-20s %u\n", "layers", m->layers);
  printf("  %-20s %u\n", "q_heads", m->q_heads);
  printf("  %-20s %u (group %u)\n", "kv_heads", m->kv_heads,
         m->kv_heads ? m->q_heads / m->kv_heads : 0);
  printf("  %-20s %u\n", "head_dim", m->head_dim);
  printf("  %-20s %s\n", "dtype", m->dtype);
  printf("  %-20s %s\n", "rope", m->rope);
  printf("  %-20s %g\n", "rope_theta", m->rope_theta);
  printf("  %-20s %u\n", "rotary_dim", m->rotary_dim);
  printf("  %-20s %g\n", "softmax_scale", m->softmax_scale);
  printf("kv cache\n");
  printf("  %-20s %s\n", "kv_cache", m->kv_cache);
  printf("  %-20s %u\n", "block_size", m->block_size);
  printf("  %-20s %" PRIu64 " B\n", "bytes per token", m->kv_bytes_per_token);
  printf("  %-20s %s\n", "kv memory", human_bytes(h.kv_memory_bytes, b, sizeof(b)));
  printf("  %-20s %u\n", "blocks", h.kv_blocks);
  printf("  %-20s %" PRIu64 "\n", "token capacity", capacity);
  printf("limits\n");
  printf("  %-20s %u\n", "max_context", m->max_context);
  printf("  %-20s %s\n", "backend", h.backend);
  return EXIT_OK;
}

/* ---- stats ---- */

static void print_stats(const attnd_v1_StatsResponse *s, const attnd_v1_StatsResponse *prev,
                        double dt, const opts_t *o) {
  int rates = prev && dt > 0;
  if (o->json) {
    int f = 1;
    printf("{");
    json_ku("connections", s->connections, &f);
    json_ku("sessions", s->sessions, &f);
    json_ku("plans", s->plans, &f);
    json_ku("admission_queued", s->admission_queued, &f);
    json_ku("blocks_total", s->blocks_total, &f);
    json_ku("blocks_used", s->blocks_used, &f);
    json_ku("blocks_cached", s->blocks_cached, &f);
    json_ku("prefix_queries", s->prefix_queries, &f);
    json_ku("prefix_hit_tokens", s->prefix_hit_tokens, &f);
    json_ku("prefix_miss_tokens", s->prefix_miss_tokens, &f);
    json_ku("evictions", s->evictions, &f);
    json_ku("cow_copies", s->cow_copies, &f);
    json_ku("steps", s->steps, &f);
    json_ku("tokens_written", s->tokens_written, &f);
    json_ku("bytes_in", s->bytes_in, &f);
    json_ku("bytes_out", s->bytes_out, &f);
    json_kstr("kv_cache", s->kv_cache, &f);
    json_ku("kv_bytes_per_token", s->kv_bytes_per_token, &f);
    json_ku("uptime_s", s->uptime_s, &f);
    if (rates) {
      json_kf("steps_per_s", (double)(s->steps - prev->steps) / dt, &f);
      json_kf("tokens_per_s", (double)(s->tokens_written - prev->tokens_written) / dt, &f);
    }
    printf(",\"methods\":[");
    for (pb_size_t i = 0; i < s->methods_count; i++) {
      int g = 1;
      printf("%s{", i ? "," : "");
      json_kstr("method", s->methods[i].method, &g);
      json_ku("requests", s->methods[i].requests, &g);
      json_ku("errors", s->methods[i].errors, &g);
      printf("}");
    }
    printf("]}\n");
    fflush(stdout);
    return;
  }
  char b1[32], b2[32];
  uint64_t q = s->prefix_hit_tokens + s->prefix_miss_tokens;
  printf("%-16s %u\n", "connections", s->connections);
  printf("%-16s %u\n", "sessions", s->sessions);
  printf("%-16s %u\n", "plans", s->plans);
  printf("%-16s %u\n", "queued calls", s->admission_queued);
  printf("%-16s %s\n", "uptime", human_duration(s->uptime_s, b1, sizeof(b1)));
  printf("\n%-16s %10s %10s %10s %10s\n", "blocks", "total", "used", "cached", "free");
  printf("%-16s %10u %10u %10u %10u\n", "", s->blocks_total, s->blocks_used, s->blocks_cached,
         s->blocks_total - (s->blocks_used + s->blocks_cached <= s->blocks_total
                                ? s->blocks_used + s->blocks_cached
                                : s->blocks_total));
  printf("\n%-16s %10s %12s %12s %8s %10s %10s\n", "prefix cache", "queries", "hit tokens",
         "miss tokens", "hit %", "evictions", "cow");
  printf("%-16s %10" PRIu64 " %12" PRIu64 " %12" PRIu64 " %8.1f %10" PRIu64 " %10" PRIu64 "\n", "",
         s->prefix_queries, s->prefix_hit_tokens, s->prefix_miss_tokens,
         q ? 100.0 * (double)s->prefix_hit_tokens / (double)q : 0.0, s->evictions, s->cow_copies);
  printf("\n%-16s %12s %14s %12s %12s\n", "traffic", "steps", "tokens", "bytes in", "bytes out");
  printf("%-16s %12" PRIu64 " %14" PRIu64 " %12s %12s\n", "total", s->steps, s->tokens_written,
         human_bytes(s->bytes_in, b1, sizeof(b1)), human_bytes(s->bytes_out, b2, sizeof(b2)));
  if (rates) {
    printf("%-16s %12.1f %14.1f %10s/s %10s/s\n", "per second",
           (double)(s->steps - prev->steps) / dt,
           (double)(s->tokens_written - prev->tokens_written) / dt,
           human_bytes((uint64_t)((double)(s->bytes_in - prev->bytes_in) / dt), b1, sizeof(b1)),
           human_bytes((uint64_t)((double)(s->bytes_out - prev->bytes_out) / dt), b2, sizeof(b2)));
  }
  printf("%-16s %s, %" PRIu64 " B/token\n", "kv cache", s->kv_cache, s->kv_bytes_per_token);
  printf("\n%-16s %12s %10s%s\n", "method", "requests", "errors", rates ? "      req/s" : "");
  for (pb_size_t i = 0; i < s->methods_count; i++) {
    const attnd_v1_MethodStats *m = &s->methods[i];
    printf("%-16s %12" PRIu64 " %10" PRIu64, m->method, m->requests, m->errors);
    if (rates) {
      uint64_t before = 0;
      for (pb_size_t j = 0; j < prev->methods_count; j++)
        if (strcmp(prev->methods[j].method, m->method) == 0)
          before = prev->methods[j].requests;
      printf(" %10.1f", (double)(m->requests - before) / dt);
    }
    printf("\n");
  }
  fflush(stdout);
}

static void sleep_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* With --watch a daemon restart is not the end: reconnect every interval until it
 * answers again, say so, and start the rates afresh (the counters restarted too). */
static int cmd_stats(attnd_client_t *c0, const opts_t *o) {
  attnd_v1_StatsResponse cur, prev;
  attnd_client_t *c = c0;
  double tprev = 0;
  int have_prev = 0, rc = 0;
  uint64_t epoch = 0;
  for (int n = 0;; n++) {
    rc = c ? attnd_client_stats(c, &cur) : ATTND_CLIENT_ECONNECT;
    if (rc && o->watch > 0 && rc != ATTND_CLIENT_ESTATUS) {
      fprintf(stderr, "attnctl: %s; retrying every %gs\n",
              c ? attnd_client_errmsg(c) : "not connected", o->watch);
      if (c && c != c0)
        attnd_client_free(c);
      c = NULL;
      for (;;) {
        sleep_s(o->watch);
        attnd_client_t *nc = NULL;
        if (attnd_client_connect(&nc, attnd_client_addr(c0)) == 0 &&
            (!o->token || attnd_client_hello(nc, o->token) == 0)) {
          c = nc;
          break;
        }
        attnd_client_free(nc);
      }
      have_prev = 0;
      n--;
      continue;
    }
    if (rc)
      break;
    if (epoch && attnd_client_epoch(c) != epoch)
      fprintf(stderr, "attnctl: attnd restarted (epoch %016" PRIx64 " -> %016" PRIx64 ")\n", epoch,
              attnd_client_epoch(c));
    epoch = attnd_client_epoch(c);
    double t = now_s();
    if (o->watch > 0 && !o->json) {
      time_t wall = time(NULL);
      char ts[32];
      strftime(ts, sizeof(ts), "%Y-%m-%d %H:%M:%S", localtime(&wall));
      printf("%s=== %s  %s ===\n", n ? "\n" : "", ts, attnd_client_addr(c));
    }
    print_stats(&cur, have_prev ? &prev : NULL, t - tprev, o);
    if (o->watch <= 0 || (o->watch_count > 0 && n + 1 >= o->watch_count))
      break;
    prev = cur;
    tprev = t;
    have_prev = 1;
    sleep_s(o->watch);
  }
  int code = rc ? report(c, rc, "stats") : EXIT_OK;
  if (c && c != c0)
    attnd_client_free(c);
  return code;
}

/* ---- sessions ---- */

static int cmd_sessions(attnd_client_t *c, const opts_t *o) {
  size_t max = 4096, n = 0;
  attnd_v1_SessionInfo *s = calloc(max, sizeof(*s));
  if (!s)
    return EXIT_DAEMON;
  int rc = attnd_client_list_sessions(c, s, max, &n);
  if (rc) {
    free(s);
    return report(c, rc, "sessions");
  }
  size_t shown = n < max ? n : max;
  if (o->json) {
    printf("{\"count\":%zu,\"sessions\":[", n);
    for (size_t i = 0; i < shown; i++) {
      int f = 1;
      char id[24];
      snprintf(id, sizeof(id), "%016" PRIx64, s[i].session);
      printf("%s{", i ? "," : "");
      json_kstr("session", id, &f);
      json_ku("len", s[i].len, &f);
      json_ku("blocks", s[i].blocks, &f);
      json_ku("idle_s", s[i].idle_s, &f);
      printf("}");
    }
    printf("]}\n");
  } else {
    printf("%-18s %10s %8s %10s\n", "session", "len", "blocks", "idle");
    for (size_t i = 0; i < shown; i++) {
      char b[32];
      printf("%016" PRIx64 "   %10u %8u %10s\n", s[i].session, s[i].len, s[i].blocks,
             human_duration(s[i].idle_s, b, sizeof(b)));
    }
    printf("%zu session%s\n", n, n == 1 ? "" : "s");
  }
  free(s);
  return EXIT_OK;
}

/* ---- bench ---- */

static uint64_t rng_state;
static uint64_t rng_next(void) {
  /* splitmix64: fast, and reproducible from --seed. */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

typedef struct {
  double *v;
  size_t n, cap;
} lat_t;

static void lat_add(lat_t *l, double x) {
  if (l->n == l->cap) {
    l->cap = l->cap ? l->cap * 2 : 256;
    double *nv = realloc(l->v, l->cap * sizeof(double));
    if (!nv)
      abort();
    l->v = nv;
  }
  l->v[l->n++] = x;
}

static double lat_pct(lat_t *l, double p) {
  if (!l->n)
    return NAN;
  size_t i = (size_t)ceil(p / 100.0 * (double)l->n);
  if (i > 0)
    i--;
  if (i >= l->n)
    i = l->n - 1;
  return l->v[i];
}

typedef struct {
  attnd_client_t *c;
  const opts_t *o;
  const attnd_v1_HealthResponse *h;
  const uint16_t *pool; /* random bf16 values */
  size_t pool_elems;
  lat_t step_lat;    /* one layer step, seconds */
  lat_t srv_total;   /* the daemon's Timing.total_us of each decode layer step, seconds */
  lat_t srv_compute; /* its Timing.computing_us */
} bench_t;

static const uint16_t *pool_at(bench_t *b, size_t elems) {
  size_t off = elems < b->pool_elems ? (size_t)(rng_next() % (b->pool_elems - elems + 1)) : 0;
  return b->pool + off;
}

/* One pass of a step through every layer: Plan (unless inline), then one Step per
 * layer with up to --depth in flight. Returns 0 or an attnctl exit code. */
static int bench_pass(bench_t *b, const attnd_client_item_t *items, size_t nitems, uint32_t rows,
                      lat_t *lat) {
  const attnd_v1_ModelShape *m = &b->h->model;
  uint64_t plan = 0;
  double t0 = now_s();
  int rc;
  if (b->o->use_plan && (rc = attnd_client_plan(b->c, items, nitems, &plan)) != 0)
    return report(b->c, rc, "bench plan");
  uint32_t layers = m->layers;
  uint64_t *ids = calloc(layers, sizeof(uint64_t));
  double *sent = calloc(layers, sizeof(double));
  if (!ids || !sent)
    abort();
  uint32_t next = 0, done = 0;
  rc = 0;
  while (done < layers && !rc) {
    while (next < layers && next - done < (uint32_t)b->o->depth) {
      attnd_client_step_t s;
      memset(&s, 0, sizeof(s));
      s.layer = next;
      s.plan = plan;
      s.items = items;
      s.nitems = nitems;
      s.dtype =
          strcmp(m->dtype, "fp16") == 0 ? attnd_v1_DType_DTYPE_FP16 : attnd_v1_DType_DTYPE_BF16;
      s.q_heads = m->q_heads;
      s.kv_heads = m->kv_heads;
      s.head_dim = m->head_dim;
      s.q_rows = rows;
      s.kv_rows = rows;
      s.q = pool_at(b, (size_t)rows * m->q_heads * m->head_dim);
      s.k = pool_at(b, (size_t)rows * m->kv_heads * m->head_dim);
      s.v = pool_at(b, (size_t)rows * m->kv_heads * m->head_dim);
      s.want_lse = b->o->want_lse;
      sent[next] = now_s();
      if ((rc = attnd_client_step_send(b->c, &s, &ids[next])) != 0)
        break;
      next++;
    }
    if (rc)
      break;
    attnd_client_resp_t r;
    rc = attnd_client_recv(b->c, ids[done], &r);
    if (rc == 0) {
      const uint8_t *out;
      size_t nb;
      if (attnd_client_resp_tensor(&r, 0, &out, &nb, NULL) != 0 ||
          nb != (size_t)rows * m->q_heads * m->head_dim * 2) {
        fprintf(stderr, "attnctl: bench: step output of layer %u has the wrong size\n", done);
        attnd_client_resp_free(&r);
        free(ids);
        free(sent);
        return EXIT_DAEMON;
      }
      lat_add(&b->step_lat, now_s() - sent[done]);
      if (r.msg.has_timing) {
        lat_add(&b->srv_total, (double)r.msg.timing.total_us * 1e-6);
        lat_add(&b->srv_compute, (double)r.msg.timing.computing_us * 1e-6);
      }
    }
    attnd_client_resp_free(&r);
    done++;
  }
  free(ids);
  free(sent);
  if (rc)
    return report(b->c, rc, "bench step");
  lat_add(lat, now_s() - t0);
  return 0;
}

static void print_lat_row(const char *name, lat_t *l, double wall, double tokens_per_unit) {
  if (l->n) /* qsort(NULL, 0) is undefined */
    qsort(l->v, l->n, sizeof(double), cmp_double);
  printf("%-16s %8zu %10.3f %10.3f %10.3f", name, l->n, lat_pct(l, 50) * 1e3, lat_pct(l, 99) * 1e3,
         l->n ? l->v[l->n - 1] * 1e3 : NAN);
  if (wall > 0) /* rates only for rows measured against the wall clock */
    printf(" %10.1f %12.1f\n", (double)l->n / wall, tokens_per_unit * (double)l->n / wall);
  else
    printf(" %10s %12s\n", "-", "-");
}

static void json_lat(const char *name, lat_t *l, double wall, double tokens_per_unit, int *first) {
  if (l->n) /* qsort(NULL, 0) is undefined */
    qsort(l->v, l->n, sizeof(double), cmp_double);
  printf("%s\"%s\":{", *first ? "" : ",", name);
  int f = 1;
  json_ku("count", l->n, &f);
  json_kf("p50_ms", lat_pct(l, 50) * 1e3, &f);
  json_kf("p99_ms", lat_pct(l, 99) * 1e3, &f);
  json_kf("max_ms", l->n ? l->v[l->n - 1] * 1e3 : NAN, &f);
  json_kf("per_s", wall > 0 ? (double)l->n / wall : 0, &f);
  json_kf("tokens_per_s", wall > 0 ? tokens_per_unit * (double)l->n / wall : 0, &f);
  printf("}");
  *first = 0;
}

static int cmd_bench(attnd_client_t *c, const opts_t *o) {
  attnd_v1_HealthResponse h;
  int rc = attnd_client_health(c, &h);
  if (rc)
    return report(c, rc, "bench health");
  const attnd_v1_ModelShape *m = &h.model;
  if (!h.has_model || !m->layers || !m->q_heads || !m->kv_heads || !m->head_dim) {
    fprintf(stderr, "attnctl: bench: the daemon reports no model shape\n");
    return EXIT_DAEMON;
  }
  if (m->max_context && (uint64_t)o->prompt + (uint64_t)o->steps > m->max_context) {
    fprintf(stderr, "attnctl: bench: prompt + steps exceeds max_context %u\n", m->max_context);
    return EXIT_USAGE;
  }
  rng_state = o->seed;
  int S = o->sessions;
  uint32_t P = (uint32_t)o->prompt;
  size_t max_rows = (size_t)S * P > (size_t)S ? (size_t)S * P : (size_t)S;
  size_t heads = m->q_heads > m->kv_heads ? m->q_heads : m->kv_heads;
  bench_t b;
  memset(&b, 0, sizeof(b));
  b.c = c;
  b.o = o;
  b.h = &h;
  /* One pool of random values reused at random offsets: generating fresh data for
   * every step would make the client, not the daemon, the bottleneck. */
  b.pool_elems = max_rows * heads * m->head_dim + 4096;
  uint16_t *pool = malloc(b.pool_elems * sizeof(uint16_t));
  uint64_t *sess = calloc((size_t)S, sizeof(uint64_t));
  uint32_t *cached = calloc((size_t)S, sizeof(uint32_t));
  uint32_t *tokens = malloc(((size_t)S * (P + (uint32_t)o->steps) + 1) * sizeof(uint32_t));
  attnd_client_item_t *items = calloc((size_t)S, sizeof(*items));
  if (!pool || !sess || !cached || !tokens || !items)
    abort();
  for (size_t i = 0; i < b.pool_elems; i++) {
    /* Uniform in [-1, 1): finite values of the size real activations have. */
    float x = (float)((double)(rng_next() >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    pool[i] = f32_to_bf16(x);
  }
  b.pool = pool;
  size_t ntok = (size_t)P + (size_t)o->steps;
  for (size_t i = 0; i < (size_t)S * ntok; i++)
    tokens[i] = (uint32_t)(rng_next() % 32000);

  int exit_code = EXIT_OK;
  int opened = 0;
  int tty = isatty(2);
  lat_t prefill = {0}, decode = {0}, prefill_steps = {0};
  double t_prefill = 0, t_decode = 0;
  uint32_t prefill_rows = 0;

  for (; opened < S; opened++) {
    rc = attnd_client_open_session(c, &tokens[(size_t)opened * ntok], P, &sess[opened],
                                   &cached[opened]);
    if (rc) {
      exit_code = report(c, rc, "bench open session");
      goto out;
    }
  }
  /* Prefill: every session's uncached prompt tokens in one step per layer. */
  if (P > 0) {
    uint32_t rows = 0;
    size_t n = 0;
    for (int i = 0; i < S; i++) {
      if (cached[i] >= P)
        continue;
      items[n].session = sess[i];
      items[n].start = cached[i];
      items[n].n = P - cached[i];
      items[n].tokens = &tokens[(size_t)i * ntok + cached[i]];
      rows += items[n].n;
      n++;
    }
    prefill_rows = rows;
    double t0 = now_s();
    if (n > 0 && (exit_code = bench_pass(&b, items, n, rows, &prefill)) != 0)
      goto out;
    t_prefill = now_s() - t0;
    prefill_steps = b.step_lat;
    memset(&b.step_lat, 0, sizeof(b.step_lat));
    b.srv_total.n = b.srv_compute.n = 0; /* server timings are reported for decode only */
    if (tty)
      fprintf(stderr, "prefill: %d sessions x %u tokens in %.3f s\n", S, P, t_prefill);
  }
  double t0 = now_s(), last = 0;
  for (int t = 0; t < o->steps; t++) {
    for (int i = 0; i < S; i++) {
      items[i].session = sess[i];
      items[i].start = P + (uint32_t)t;
      items[i].n = 1;
      items[i].tokens = &tokens[(size_t)i * ntok + P + (size_t)t];
    }
    if ((exit_code = bench_pass(&b, items, (size_t)S, (uint32_t)S, &decode)) != 0)
      goto out;
    double now = now_s();
    if (now - last > 0.2 || t + 1 == o->steps) {
      last = now;
      double el = now - t0;
      if (tty)
        fprintf(stderr, "\rdecode %d/%d  %.1f tokens/s  last %.2f ms   ", t + 1, o->steps,
                el > 0 ? (double)(t + 1) * S / el : 0.0, decode.v[decode.n - 1] * 1e3);
      else if ((t + 1) % (o->steps / 10 ? o->steps / 10 : 1) == 0)
        fprintf(stderr, "decode %d/%d\n", t + 1, o->steps);
    }
  }
  t_decode = now_s() - t0;
  if (tty && o->steps)
    fprintf(stderr, "\n");

  double L = (double)m->layers;
  if (o->json) {
    int f = 1;
    printf("{");
    json_ku("sessions", (uint64_t)S, &f);
    json_ku("prompt", P, &f);
    json_ku("steps", (uint64_t)o->steps, &f);
    json_ku("layers", m->layers, &f);
    json_ku("depth", (uint64_t)o->depth, &f);
    json_kf("prefill_s", t_prefill, &f);
    json_kf("decode_s", t_decode, &f);
    json_ku("prefill_tokens", prefill_rows, &f);
    json_lat("prefill", &prefill, t_prefill, (double)prefill_rows, &f);
    json_lat("prefill_layer_step", &prefill_steps, t_prefill, (double)prefill_rows / L, &f);
    json_lat("decode_layer_step", &b.step_lat, t_decode, (double)S / L, &f);
    json_lat("decode_layer_server_total", &b.srv_total, t_decode, (double)S / L, &f);
    json_lat("decode_layer_server_compute", &b.srv_compute, t_decode, (double)S / L, &f);
    json_lat("decode_token", &decode, t_decode, (double)S, &f);
    printf("}\n");
  } else {
    printf("bench: %d sessions, prompt %u, %d decode steps, %u layers, %s %s, depth %d, %s\n", S, P,
           o->steps, m->layers, m->dtype, m->kv_cache, o->depth,
           o->use_plan ? "plan" : "inline items");
    printf("%-16s %8s %10s %10s %10s %10s %12s\n", "phase", "count", "p50 ms", "p99 ms", "max ms",
           "per s", "tokens/s");
    print_lat_row("prefill", &prefill, t_prefill, (double)prefill_rows);
    print_lat_row("prefill layer", &prefill_steps, t_prefill, (double)prefill_rows / L);
    print_lat_row("decode layer", &b.step_lat, t_decode, (double)S / L);
    if (b.srv_total.n) {
      /* Where the time goes: the daemon's own view of the same steps. */
      print_lat_row("  in daemon", &b.srv_total, 0, 0);
      print_lat_row("  computing", &b.srv_compute, 0, 0);
    }
    print_lat_row("decode token", &decode, t_decode, (double)S);
  }

out:
  for (int i = 0; i < opened; i++)
    attnd_client_close_session(c, sess[i]);
  free(prefill.v);
  free(decode.v);
  free(prefill_steps.v);
  free(b.step_lat.v);
  free(b.srv_total.v);
  free(b.srv_compute.v);
  free(pool);
  free(sess);
  free(cached);
  free(tokens);
  free(items);
  return exit_code;
}

/* ---- main ---- */

typedef struct {
  const char *name;
  int (*fn)(attnd_client_t *, const opts_t *);
  const char *usage;
} command_t;

static const command_t commands[] = {
    {"health", cmd_health, usage_health},       {"stats", cmd_stats, usage_stats},
    {"sessions", cmd_sessions, usage_sessions}, {"config", cmd_config, usage_config},
    {"bench", cmd_bench, usage_bench},
};

static int read_token(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "attnctl: cannot read token file %s: %s\n", path, strerror(errno));
    return -1;
  }
  if (!fgets(buf, (int)len, f))
    buf[0] = 0;
  fclose(f);
  buf[strcspn(buf, "\r\n")] = 0;
  return 0;
}

int main(int argc, char **argv) {
  opts_t o;
  memset(&o, 0, sizeof(o));
  o.sessions = 4;
  o.prompt = 64;
  o.steps = 32;
  o.depth = 1;
  o.use_plan = 1;
  o.seed = 1;
  const command_t *cmd = NULL;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *val = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VAL()                                                                                 \
  do {                                                                                             \
    if (!val)                                                                                      \
      return usage_error("option %s needs a value", a);                                            \
    i++;                                                                                           \
  } while (0)
#define INT_OPT(flag, field, min)                                                                  \
  if (strcmp(a, flag) == 0) {                                                                      \
    NEED_VAL();                                                                                    \
    if (parse_int(val, min, &o.field))                                                             \
      return usage_error("bad value for " flag ": %s", val);                                       \
    continue;                                                                                      \
  }
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      o.help = 1;
    } else if (strcmp(a, "--json") == 0) {
      o.json = 1;
    } else if (strcmp(a, "--socket") == 0) {
      NEED_VAL();
      o.socket_path = val;
    } else if (strcmp(a, "--tcp") == 0) {
      NEED_VAL();
      o.tcp = val;
    } else if (strcmp(a, "--token-file") == 0) {
      NEED_VAL();
      o.token_file = val;
    } else if (strcmp(a, "--watch") == 0) {
      NEED_VAL();
      char *end;
      o.watch = strtod(val, &end);
      if (*end || end == val || !(o.watch > 0))
        return usage_error("bad value for --watch: %s", val);
    } else if (strcmp(a, "--inline") == 0) {
      o.use_plan = 0;
    } else if (strcmp(a, "--lse") == 0) {
      o.want_lse = 1;
    } else if (strcmp(a, "--seed") == 0) {
      NEED_VAL();
      int s;
      if (parse_int(val, 0, &s))
        return usage_error("bad value for --seed: %s", val);
      o.seed = (unsigned)s;
    } else {
      INT_OPT("--count", watch_count, 1)
      INT_OPT("--sessions", sessions, 1)
      INT_OPT("--prompt", prompt, 0)
      INT_OPT("--steps", steps, 0)
      INT_OPT("--depth", depth, 1)
      if (a[0] == '-')
        return usage_error("unknown option %s", a);
      if (cmd)
        return usage_error("unexpected argument %s", a);
      for (size_t k = 0; k < sizeof(commands) / sizeof(commands[0]); k++)
        if (strcmp(a, commands[k].name) == 0)
          cmd = &commands[k];
      if (!cmd)
        return usage_error("unknown command %s", a);
    }
#undef INT_OPT
#undef NEED_VAL
  }
  if (o.help) {
    fputs(cmd ? cmd->usage : usage_main, stdout);
    return EXIT_OK;
  }
  if (!cmd) {
    fputs(usage_main, stderr);
    return EXIT_USAGE;
  }
  if (o.socket_path && o.tcp)
    return usage_error("%s", "--socket and --tcp exclude each other");

  char token[512] = "";
  if (o.token_file && read_token(o.token_file, token, sizeof(token)))
    return EXIT_USAGE;
  if (o.token_file)
    o.token = token;

  attnd_client_t *c = NULL;
  int rc = attnd_client_connect(&c, o.tcp ? o.tcp : o.socket_path);
  if (rc) {
    if (c)
      fprintf(stderr, "attnctl: %s\n", attnd_client_errmsg(c));
    else
      fprintf(stderr, "attnctl: out of memory\n");
    attnd_client_free(c);
    return EXIT_CONNECT;
  }
  /* Interactive commands should not hang on a wedged daemon; bench waits as long
   * as its steps take. */
  if (cmd->fn != cmd_bench)
    attnd_client_set_timeout(c, 30000);
  int code = EXIT_OK;
  if (o.token_file && (rc = attnd_client_hello(c, token)) != 0)
    code = report(c, rc, "hello");
  else
    code = cmd->fn(c, &o);
  attnd_client_free(c);
  return code;
}

/* attnctl_cmds.c: the health, config, stats and sessions commands, and --watch. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attnctl.h"

/* ---- health / config ---- */

static void print_health(const attnd_v1_HealthResponse *h, const char *addr,
                         const attnctl_opts_t *o) {
  char b1[32], b2[32], ep[17];
  attnctl_hex64(h->epoch, ep);
  if (o->json) {
    int f = 1;
    printf("{");
    attnctl_json_kstr("status", h->status, &f);
    attnctl_json_kstr("version", h->version, &f);
    attnctl_json_kstr("backend", h->backend, &f);
    attnctl_json_kstr("device", h->device, &f);
    attnctl_json_kstr("epoch", ep, &f);
    attnctl_json_ku("uptime_s", h->uptime_s, &f);
    attnctl_json_ku("tcp_port", h->tcp_port, &f);
    attnctl_json_ku("kv_memory_bytes", h->kv_memory_bytes, &f);
    attnctl_json_ku("kv_blocks", h->kv_blocks, &f);
    attnctl_json_ku("device_memory_bytes", h->device_memory_bytes, &f);
    attnctl_json_ku("compute_capability", h->compute_capability, &f);
    if (h->device_uuid[0])
      attnctl_json_kstr("device_uuid", h->device_uuid, &f);
    attnctl_json_kstr("socket", addr, &f);
    printf("}\n");
    fflush(stdout);
    return;
  }
  printf("attnd %s: %s\n", h->version, h->status);
  printf("  %-14s %s (%s)\n", "backend", h->backend, h->device);
  if (h->compute_capability)
    printf("  %-14s %u.%u\n", "compute cap.", h->compute_capability / 10,
           h->compute_capability % 10);
  if (h->device_memory_bytes)
    printf("  %-14s %s\n", "device memory", attnctl_bytes(h->device_memory_bytes, b1, sizeof(b1)));
  if (h->device_uuid[0]) /* what same-host zero-copy clients compare with */
    printf("  %-14s %s\n", "device uuid", h->device_uuid);
  printf("  %-14s %s\n", "epoch", ep);
  printf("  %-14s %s\n", "uptime", attnctl_duration(h->uptime_s, b2, sizeof(b2)));
  printf("  %-14s %s\n", "address", addr);
  if (h->tcp_port)
    printf("  %-14s %u\n", "tcp port", h->tcp_port);
  else
    printf("  %-14s off\n", "tcp port");
  printf("  %-14s %s in %u blocks\n", "kv memory",
         attnctl_bytes(h->kv_memory_bytes, b1, sizeof(b1)), h->kv_blocks);
  if (h->has_model)
    printf("  %-14s %u layers, %u q / %u kv heads, head_dim %u, %s, kv %s\n", "model",
           h->model.layers, h->model.q_heads, h->model.kv_heads, h->model.head_dim, h->model.dtype,
           h->model.kv_cache);
  fflush(stdout);
}

int attnctl_cmd_health(attnd_client_t *c, const attnctl_opts_t *o) {
  attnd_v1_HealthResponse h;
  int rc = attnd_client_health(c, &h);
  if (rc)
    return attnctl_report(c, rc, "health");
  print_health(&h, attnd_client_addr(c), o);
  return ATTNCTL_OK;
}

int attnctl_cmd_config(attnd_client_t *c, const attnctl_opts_t *o) {
  attnd_v1_HealthResponse h;
  int rc = attnd_client_health(c, &h);
  if (rc)
    return attnctl_report(c, rc, "config");
  const attnd_v1_ModelShape *m = &h.model;
  uint64_t capacity = m->kv_bytes_per_token ? h.kv_memory_bytes / m->kv_bytes_per_token : 0;
  if (o->json) {
    int f = 1;
    printf("{");
    attnctl_json_ku("layers", m->layers, &f);
    attnctl_json_ku("q_heads", m->q_heads, &f);
    attnctl_json_ku("kv_heads", m->kv_heads, &f);
    attnctl_json_ku("head_dim", m->head_dim, &f);
    attnctl_json_ku("block_size", m->block_size, &f);
    attnctl_json_kstr("dtype", m->dtype, &f);
    attnctl_json_kstr("kv_cache", m->kv_cache, &f);
    attnctl_json_kstr("rope", m->rope, &f);
    attnctl_json_kf("rope_theta", m->rope_theta, &f);
    attnctl_json_ku("rotary_dim", m->rotary_dim, &f);
    attnctl_json_kf("softmax_scale", m->softmax_scale, &f);
    attnctl_json_kf("softcap", m->softcap, &f);
    attnctl_json_kstr("attention_windows", m->attention_windows, &f);
    attnctl_json_ku("attention_sinks", m->attention_sinks, &f);
    attnctl_json_ku("max_context", m->max_context, &f);
    attnctl_json_kstr("model_id", m->model_id, &f);
    attnctl_json_ku("kv_bytes_per_token", m->kv_bytes_per_token, &f);
    attnctl_json_ku("kv_memory_bytes", h.kv_memory_bytes, &f);
    attnctl_json_ku("kv_blocks", h.kv_blocks, &f);
    attnctl_json_ku("token_capacity", capacity, &f);
    attnctl_json_kstr("backend", h.backend, &f);
    printf("}\n");
    return ATTNCTL_OK;
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
  printf("  %-20s %g\n", "softcap", m->softcap);
  printf("  %-20s %s\n", "attention_windows",
         *m->attention_windows ? m->attention_windows : "none");
  printf("  %-20s %s\n", "attention_sinks", m->attention_sinks ? "on" : "off");
  printf("kv cache\n");
  printf("  %-20s %s\n", "kv_cache", m->kv_cache);
  printf("  %-20s %u\n", "block_size", m->block_size);
  printf("  %-20s %" PRIu64 " B\n", "bytes per token", m->kv_bytes_per_token);
  printf("  %-20s %s\n", "kv memory", attnctl_bytes(h.kv_memory_bytes, b, sizeof(b)));
  printf("  %-20s %u\n", "blocks", h.kv_blocks);
  printf("  %-20s %" PRIu64 "\n", "token capacity", capacity);
  printf("limits\n");
  printf("  %-20s %u\n", "max_context", m->max_context);
  printf("  %-20s %s\n", "backend", h.backend);
  return ATTNCTL_OK;
}

/* ---- set-sinks ---- */

int attnctl_cmd_set_sinks(attnd_client_t *c, const attnctl_opts_t *o) {
  /* One logit per q head: at most the 1024 q heads a daemon may have. */
  float v[1024];
  uint32_t n = 0;
  const char *p = o->sinks;
  for (;;) {
    char *end;
    errno = 0;
    double x = strtod(p, &end);
    if (end == p || errno || !isfinite(x) || n == 1024 || (*end && *end != ',')) {
      fprintf(stderr, "attnctl: --sinks '%s': expected comma-separated finite numbers\n", o->sinks);
      return ATTNCTL_USAGE;
    }
    v[n++] = (float)x;
    if (!*end)
      break;
    p = end + 1;
  }
  uint64_t version = 0;
  int rc = attnd_client_set_sinks(c, (uint32_t)o->layer, v, n, &version);
  if (rc)
    return attnctl_report(c, rc, "set-sinks");
  if (o->json) {
    int f = 1;
    printf("{");
    attnctl_json_ku("layer", (uint64_t)o->layer, &f);
    attnctl_json_ku("version", version, &f);
    printf("}\n");
  } else {
    printf("layer %d: sinks set, version %" PRIu64 "\n", o->layer, version);
  }
  return ATTNCTL_OK;
}

/* ---- stats ---- */

static void print_stats_json(const attnd_v1_StatsResponse *s, const attnd_v1_StatsResponse *prev,
                             double dt) {
  int f = 1;
  printf("{");
  attnctl_json_ku("connections", s->connections, &f);
  attnctl_json_ku("sessions", s->sessions, &f);
  attnctl_json_ku("plans", s->plans, &f);
  attnctl_json_ku("admission_queued", s->admission_queued, &f);
  attnctl_json_ku("blocks_total", s->blocks_total, &f);
  attnctl_json_ku("blocks_used", s->blocks_used, &f);
  attnctl_json_ku("blocks_cached", s->blocks_cached, &f);
  attnctl_json_ku("prefix_queries", s->prefix_queries, &f);
  attnctl_json_ku("prefix_hit_tokens", s->prefix_hit_tokens, &f);
  attnctl_json_ku("prefix_miss_tokens", s->prefix_miss_tokens, &f);
  attnctl_json_ku("evictions", s->evictions, &f);
  attnctl_json_ku("cow_copies", s->cow_copies, &f);
  attnctl_json_ku("steps", s->steps, &f);
  attnctl_json_ku("tokens_written", s->tokens_written, &f);
  attnctl_json_ku("bytes_in", s->bytes_in, &f);
  attnctl_json_ku("bytes_out", s->bytes_out, &f);
  attnctl_json_kstr("kv_cache", s->kv_cache, &f);
  attnctl_json_ku("kv_bytes_per_token", s->kv_bytes_per_token, &f);
  attnctl_json_ku("uptime_s", s->uptime_s, &f);
  if (prev) {
    attnctl_json_kf("steps_per_s", (double)(s->steps - prev->steps) / dt, &f);
    attnctl_json_kf("tokens_per_s", (double)(s->tokens_written - prev->tokens_written) / dt, &f);
  }
  printf(",\"methods\":[");
  for (pb_size_t i = 0; i < s->methods_count; i++) {
    int g = 1;
    printf("%s{", i ? "," : "");
    attnctl_json_kstr("method", s->methods[i].method, &g);
    attnctl_json_ku("requests", s->methods[i].requests, &g);
    attnctl_json_ku("errors", s->methods[i].errors, &g);
    printf("}");
  }
  printf("]}\n");
}

/* prev: the previous sample (rates are printed since it), or NULL. */
static void print_stats(const attnd_v1_StatsResponse *s, const attnd_v1_StatsResponse *prev,
                        double dt, const attnctl_opts_t *o) {
  if (!(dt > 0))
    prev = NULL;
  if (o->json) {
    print_stats_json(s, prev, dt);
    fflush(stdout);
    return;
  }
  char b1[32], b2[32];
  uint64_t q = s->prefix_hit_tokens + s->prefix_miss_tokens;
  uint32_t held = s->blocks_used + s->blocks_cached;
  printf("%-16s %u\n", "connections", s->connections);
  printf("%-16s %u\n", "sessions", s->sessions);
  printf("%-16s %u\n", "plans", s->plans);
  printf("%-16s %u\n", "queued calls", s->admission_queued);
  printf("%-16s %s\n", "uptime", attnctl_duration(s->uptime_s, b1, sizeof(b1)));
  printf("\n%-16s %10s %10s %10s %10s\n", "blocks", "total", "used", "cached", "free");
  printf("%-16s %10u %10u %10u %10u\n", "", s->blocks_total, s->blocks_used, s->blocks_cached,
         s->blocks_total - (held <= s->blocks_total ? held : s->blocks_total));
  printf("\n%-16s %10s %12s %12s %8s %10s %10s\n", "prefix cache", "queries", "hit tokens",
         "miss tokens", "hit %", "evictions", "cow");
  printf("%-16s %10" PRIu64 " %12" PRIu64 " %12" PRIu64 " %8.1f %10" PRIu64 " %10" PRIu64 "\n", "",
         s->prefix_queries, s->prefix_hit_tokens, s->prefix_miss_tokens,
         q ? 100.0 * (double)s->prefix_hit_tokens / (double)q : 0.0, s->evictions, s->cow_copies);
  printf("\n%-16s %12s %14s %12s %12s\n", "traffic", "steps", "tokens", "bytes in", "bytes out");
  printf("%-16s %12" PRIu64 " %14" PRIu64 " %12s %12s\n", "total", s->steps, s->tokens_written,
         attnctl_bytes(s->bytes_in, b1, sizeof(b1)), attnctl_bytes(s->bytes_out, b2, sizeof(b2)));
  if (prev) {
    printf(
        "%-16s %12.1f %14.1f %10s/s %10s/s\n", "per second", (double)(s->steps - prev->steps) / dt,
        (double)(s->tokens_written - prev->tokens_written) / dt,
        attnctl_bytes((uint64_t)((double)(s->bytes_in - prev->bytes_in) / dt), b1, sizeof(b1)),
        attnctl_bytes((uint64_t)((double)(s->bytes_out - prev->bytes_out) / dt), b2, sizeof(b2)));
  }
  printf("%-16s %s, %" PRIu64 " B/token\n", "kv cache", s->kv_cache, s->kv_bytes_per_token);
  printf("\n%-16s %12s %10s%s\n", "method", "requests", "errors", prev ? "      req/s" : "");
  for (pb_size_t i = 0; i < s->methods_count; i++) {
    const attnd_v1_MethodStats *m = &s->methods[i];
    printf("%-16s %12" PRIu64 " %10" PRIu64, m->method, m->requests, m->errors);
    if (prev) {
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

int attnctl_cmd_stats(attnd_client_t *c, const attnctl_opts_t *o) {
  attnd_v1_StatsResponse s;
  int rc = attnd_client_stats(c, &s);
  if (rc)
    return attnctl_report(c, rc, "stats");
  print_stats(&s, NULL, 0, o);
  return ATTNCTL_OK;
}

/* ---- sessions ---- */

int attnctl_cmd_sessions(attnd_client_t *c, const attnctl_opts_t *o) {
  size_t max = 4096, n = 0;
  attnd_v1_SessionInfo *s = calloc(max, sizeof(*s));
  if (!s)
    return ATTNCTL_DAEMON;
  int rc = attnd_client_list_sessions(c, s, max, &n);
  if (rc) {
    free(s);
    return attnctl_report(c, rc, "sessions");
  }
  size_t shown = n < max ? n : max;
  char id[17];
  if (o->json) {
    printf("{\"count\":%zu,\"sessions\":[", n);
    for (size_t i = 0; i < shown; i++) {
      int f = 1;
      printf("%s{", i ? "," : "");
      attnctl_json_kstr("session", attnctl_hex64(s[i].session, id), &f);
      attnctl_json_ku("len", s[i].len, &f);
      attnctl_json_ku("blocks", s[i].blocks, &f);
      attnctl_json_ku("idle_s", s[i].idle_s, &f);
      printf("}");
    }
    printf("]}\n");
  } else {
    printf("%-18s %10s %8s %10s\n", "session", "len", "blocks", "idle");
    for (size_t i = 0; i < shown; i++) {
      char b[32];
      printf("%-18s %10u %8u %10s\n", attnctl_hex64(s[i].session, id), s[i].len, s[i].blocks,
             attnctl_duration(s[i].idle_s, b, sizeof(b)));
    }
    printf("%zu session%s\n", n, n == 1 ? "" : "s");
  }
  free(s);
  return ATTNCTL_OK;
}

/* ---- --watch ---- */

typedef struct watch_s watch_t;
struct watch_s {
  const attnctl_opts_t *o;
  const char *what;
  /* Takes and prints one sample; returns 0 or an attnd_client_* error. */
  int (*sample)(watch_t *w, attnd_client_t *c, int n);
  /* Prints an unreachable sample (health), or NULL: say it once on stderr and
   * print nothing until the daemon is back (stats). */
  void (*down)(watch_t *w, const char *addr, const char *why, int n);
  uint64_t epoch; /* of the last answer: a new one means the daemon restarted */
  /* stats: the previous sample, for rates */
  attnd_v1_StatsResponse prev;
  double tprev;
  int have_prev;
};

/* Called by a sample before it prints, so the restart is said before the
 * first sample of the new daemon. */
static void watch_epoch(watch_t *w, attnd_client_t *c) {
  uint64_t e = attnd_client_epoch(c);
  if (w->epoch && e != w->epoch)
    fprintf(stderr, "attnctl: attnd restarted (epoch %016" PRIx64 " -> %016" PRIx64 ")\n", w->epoch,
            e);
  w->epoch = e;
}

static void watch_header(const char *addr, int n) {
  time_t wall = time(NULL);
  char ts[32];
  strftime(ts, sizeof(ts), "%Y-%m-%d %H:%M:%S", localtime(&wall));
  printf("%s=== %s  %s ===\n", n ? "\n" : "", ts, addr);
}

/* One connection attempt (and Hello); 0 with *out set, or an error with the
 * reason and the address tried in why/addr. */
static int watch_connect(const attnctl_opts_t *o, attnd_client_t **out, char *why, size_t whylen,
                         char *addr, size_t addrlen) {
  attnd_client_t *c = NULL;
  int rc = attnd_client_connect(&c, o->addr);
  if (rc == 0 && o->token)
    rc = attnd_client_hello(c, o->token);
  if (rc) {
    snprintf(why, whylen, "%s", c ? attnd_client_errmsg(c) : "out of memory");
    if (c)
      snprintf(addr, addrlen, "%s", attnd_client_addr(c));
    attnd_client_free(c);
    return rc;
  }
  attnd_client_set_timeout(c, 30000);
  *out = c;
  return 0;
}

static int watch(attnd_client_t **cp, const char *addr0, watch_t *w) {
  const attnctl_opts_t *o = w->o;
  int code = ATTNCTL_OK, said_down = 0;
  char why[512] = "", addr[300];
  snprintf(addr, sizeof(addr), "%s", addr0);
  for (int n = 0;;) {
    int rc = 0;
    if (!*cp)
      rc = watch_connect(o, cp, why, sizeof(why), addr, sizeof(addr));
    if (rc == ATTND_CLIENT_ESTATUS) { /* Hello refused: retrying will not help */
      fprintf(stderr, "attnctl: hello: %s\n", why);
      return ATTNCTL_DAEMON;
    }
    if (*cp) {
      snprintf(addr, sizeof(addr), "%s", attnd_client_addr(*cp));
      rc = w->sample(w, *cp, n);
      if (rc == ATTND_CLIENT_ESTATUS)
        return attnctl_report(*cp, rc, w->what);
      if (rc) {
        snprintf(why, sizeof(why), "%s", attnd_client_errmsg(*cp));
        attnd_client_free(*cp);
        *cp = NULL;
      }
    }
    if (*cp) {
      said_down = 0;
      code = ATTNCTL_OK;
      n++;
    } else {
      code = ATTNCTL_CONNECT;
      w->have_prev = 0; /* the counters restart with the daemon: rates start afresh */
      if (w->down) {
        w->down(w, addr, why, n);
        n++;
      } else if (!said_down) {
        fprintf(stderr, "attnctl: %s; retrying every %gs\n", why, o->watch);
        said_down = 1;
      }
    }
    if (o->watch_count > 0 && n >= o->watch_count)
      break;
    attnctl_sleep(o->watch);
  }
  return code;
}

static int health_sample(watch_t *w, attnd_client_t *c, int n) {
  attnd_v1_HealthResponse h;
  int rc = attnd_client_health(c, &h);
  if (rc)
    return rc;
  watch_epoch(w, c);
  if (!w->o->json)
    watch_header(attnd_client_addr(c), n);
  print_health(&h, attnd_client_addr(c), w->o);
  return 0;
}

static void health_down(watch_t *w, const char *addr, const char *why, int n) {
  if (w->o->json) {
    int f = 1;
    printf("{");
    attnctl_json_kstr("status", "unreachable", &f);
    attnctl_json_kstr("socket", addr, &f);
    attnctl_json_kstr("error", why, &f);
    printf("}\n");
  } else {
    watch_header(addr, n);
    printf("unreachable: %s\n", why);
  }
  fflush(stdout);
}

int attnctl_watch_health(attnd_client_t **cp, const char *addr, const attnctl_opts_t *o) {
  watch_t w = {.o = o, .what = "health", .sample = health_sample, .down = health_down};
  return watch(cp, addr, &w);
}

static int stats_sample(watch_t *w, attnd_client_t *c, int n) {
  attnd_v1_StatsResponse cur;
  int rc = attnd_client_stats(c, &cur);
  if (rc)
    return rc;
  double t = attnctl_now();
  watch_epoch(w, c);
  if (!w->o->json)
    watch_header(attnd_client_addr(c), n);
  print_stats(&cur, w->have_prev ? &w->prev : NULL, t - w->tprev, w->o);
  w->prev = cur;
  w->tprev = t;
  w->have_prev = 1;
  return 0;
}

int attnctl_watch_stats(attnd_client_t **cp, const char *addr, const attnctl_opts_t *o) {
  watch_t *w = calloc(1, sizeof(*w)); /* two StatsResponses: too large for some stacks */
  if (!w)
    return ATTNCTL_DAEMON;
  w->o = o;
  w->what = "stats";
  w->sample = stats_sample;
  int code = watch(cp, addr, w);
  free(w);
  return code;
}

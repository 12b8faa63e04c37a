/* metrics.c: the Prometheus text exposition (format 0.0.4) of GET /metrics.
 *
 * Metric names (all prefixed attnd_):
 *   attnd_requests_total{method,code}          counter  requests answered, by status code
 *   attnd_errors_total{method}                 counter  requests answered with a non-OK status
 *   attnd_received_bytes_total                 counter  request frame bytes (headers included)
 *   attnd_sent_bytes_total                     counter  response frame bytes (headers included)
 *   attnd_connections                          gauge    open RPC connections
 *   attnd_connections_total                    counter  accepted RPC connections
 *   attnd_connections_refused_total            counter  refused over --max-connections
 *   attnd_frame_errors_total                   counter  framing errors that closed a connection
 *   attnd_sessions                             gauge    open sessions
 *   attnd_plans                                gauge    live plans
 *   attnd_admission_queued                     gauge    calls waiting behind a large step's scan
 *   attnd_blocks{state="total|used|cached"}    gauge    KV blocks
 *   attnd_prefix_queries_total                 counter  prefix-cache lookups
 *   attnd_prefix_hit_tokens_total              counter  tokens served from the prefix cache
 *   attnd_prefix_miss_tokens_total             counter  looked-up tokens not in the cache
 *   attnd_prefix_evictions_total               counter  cached blocks evicted
 *   attnd_cow_copies_total                     counter  copy-on-write block copies
 *   attnd_steps_total{kind="prefill|decode"}   counter  steps run by the engine
 *   attnd_tokens_written_total                 counter  tokens written into the cache
 *   attnd_step_latency_seconds{kind}           histogram frame decoded -> response encoded,
 *                                              successful steps; decode = every item has n == 1
 *   attnd_uptime_seconds                       gauge    seconds since start
 *
 * Served by http.c. */

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- rendering ------------------------------------------------------------ */

typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} sbuf_t;

static void sb_printf(sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf_t *b, const char *fmt, ...) {
  if (b->oom)
    return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      b->oom = 1;
      return;
    }
    if ((size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t nc = b->cap * 2 + (size_t)n;
    char *np = realloc(b->p, nc);
    if (!np) {
      b->oom = 1;
      return;
    }
    b->p = np;
    b->cap = nc;
  }
}

static void head(sbuf_t *b, const char *name, const char *type, const char *help) {
  sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

int attnd_metrics_render(const attnd_rpc_counters_t *c, attnd_engine_t *engine, double uptime_s,
                         char **out, size_t *len) {
  sbuf_t b = {malloc(8192), 0, 8192, 0};
  if (!b.p)
    return ATTND_ENOMEM;
  attnd_engine_stats_t es;
  memset(&es, 0, sizeof(es));
  if (engine)
    attnd_engine_stats(engine, &es);

  head(&b, "attnd_requests_total", "counter", "Requests answered, by method and status code.");
  for (int m = 0; m < ATTND_M_COUNT; m++)
    for (int k = 0; k < ATTND_STATUS_COUNT; k++)
      if (c->answers[m].by_code[k] || (k == 0 && m > 0))
        sb_printf(&b, "attnd_requests_total{method=\"%s\",code=\"%s\"} %llu\n",
                  attnd_rpc_method_name(m), attnd_rpc_code_name(k),
                  (unsigned long long)c->answers[m].by_code[k]);
  head(&b, "attnd_errors_total", "counter", "Requests answered with a non-OK status, by method.");
  for (int m = 0; m < ATTND_M_COUNT; m++)
    sb_printf(&b, "attnd_errors_total{method=\"%s\"} %llu\n", attnd_rpc_method_name(m),
              (unsigned long long)c->answers[m].errors);

#define SIMPLE(name, type, help, val)                                                              \
  do {                                                                                             \
    head(&b, name, type, help);                                                                    \
    sb_printf(&b, "%s %llu\n", name, (unsigned long long)(val));                                   \
  } while (0)
  SIMPLE("attnd_received_bytes_total", "counter", "Request frame bytes received.", c->bytes_in);
  SIMPLE("attnd_sent_bytes_total", "counter", "Response frame bytes sent.", c->bytes_out);
  SIMPLE("attnd_connections", "gauge", "Open RPC connections.", c->connections);
  SIMPLE("attnd_connections_total", "counter", "Accepted RPC connections.", c->connections_total);
  SIMPLE("attnd_connections_refused_total", "counter",
         "Connections refused over --max-connections.", c->connections_refused);
  SIMPLE("attnd_frame_errors_total", "counter", "Framing errors that closed a connection.",
         c->frame_errors);
  SIMPLE("attnd_sessions", "gauge", "Open sessions.", es.sessions);
  SIMPLE("attnd_plans", "gauge", "Live plans.", es.plans);
  SIMPLE("attnd_admission_queued", "gauge",
         "Calls waiting for admission behind a large step's finiteness scan.", es.queued);
  head(&b, "attnd_blocks", "gauge", "KV blocks by state.");
  sb_printf(&b, "attnd_blocks{state=\"total\"} %u\n", es.blocks_total);
  sb_printf(&b, "attnd_blocks{state=\"used\"} %u\n", es.blocks_used);
  sb_printf(&b, "attnd_blocks{state=\"cached\"} %u\n", es.blocks_cached);
  SIMPLE("attnd_prefix_queries_total", "counter", "Prefix-cache lookups.", es.prefix_queries);
  SIMPLE("attnd_prefix_hit_tokens_total", "counter", "Tokens served from the prefix cache.",
         es.prefix_hit_tokens);
  SIMPLE("attnd_prefix_miss_tokens_total", "counter", "Looked-up tokens not in the prefix cache.",
         es.prefix_miss_tokens);
  SIMPLE("attnd_prefix_evictions_total", "counter", "Cached blocks evicted.", es.evictions);
  SIMPLE("attnd_cow_copies_total", "counter", "Copy-on-write block copies.", es.cow_copies);
  head(&b, "attnd_steps_total", "counter", "Steps run by the engine, by kind.");
  sb_printf(&b, "attnd_steps_total{kind=\"prefill\"} %llu\n", (unsigned long long)es.prefill_steps);
  sb_printf(&b, "attnd_steps_total{kind=\"decode\"} %llu\n", (unsigned long long)es.decode_steps);
  SIMPLE("attnd_tokens_written_total", "counter", "Tokens written into the KV cache.",
         es.tokens_written);
#undef SIMPLE

  head(&b, "attnd_step_latency_seconds", "histogram",
       "Step latency, frame decoded to response encoded, by kind.");
  for (int k = 0; k < 2; k++) {
    const char *kind = k == ATTND_STEP_DECODE ? "decode" : "prefill";
    const attnd_hist_t *h = &c->step_latency[k];
    uint64_t cum = 0;
    for (int i = 0; i < ATTND_HIST_BUCKETS; i++) {
      cum += h->bucket[i];
      sb_printf(&b, "attnd_step_latency_seconds_bucket{kind=\"%s\",le=\"%g\"} %llu\n", kind,
                attnd_hist_bounds_us[i] / 1e6, (unsigned long long)cum);
    }
    cum += h->bucket[ATTND_HIST_BUCKETS];
    sb_printf(&b, "attnd_step_latency_seconds_bucket{kind=\"%s\",le=\"+Inf\"} %llu\n", kind,
              (unsigned long long)cum);
    sb_printf(&b, "attnd_step_latency_seconds_sum{kind=\"%s\"} %.6f\n", kind, h->sum_us / 1e6);
    sb_printf(&b, "attnd_step_latency_seconds_count{kind=\"%s\"} %llu\n", kind,
              (unsigned long long)h->count);
  }
  head(&b, "attnd_uptime_seconds", "gauge", "Seconds since the daemon started.");
  sb_printf(&b, "attnd_uptime_seconds %.3f\n", uptime_s);
  if (b.oom) {
    free(b.p);
    return ATTND_ENOMEM;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}

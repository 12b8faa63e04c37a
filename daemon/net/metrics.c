/* metrics.c: the Prometheus text exposition (format 0.0.4) of GET /metrics.
 *
 * Metric names (docs/operations.md section 5 says what each means):
 *   attnd_build_info{version,backend,device,kv_cache}  gauge  always 1
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
 *   attnd_kv_blocks_capacity                   gauge    KV blocks per layer in the pool
 *   attnd_kv_blocks{state="used|cached|free"}  gauge    the same blocks by state; they sum to
 *                                                       the capacity
 *   attnd_kv_usage_ratio                       gauge    used / capacity (cached blocks are
 *                                                       evictable: not counted)
 *   attnd_prefix_queries_total                 counter  prefix-cache lookups
 *   attnd_prefix_hit_tokens_total              counter  tokens served from the prefix cache
 *   attnd_prefix_miss_tokens_total             counter  looked-up tokens not in the cache
 *   attnd_prefix_evictions_total               counter  cached blocks evicted
 *   attnd_cow_copies_total                     counter  copy-on-write block copies
 *   attnd_steps_total{kind="prefill|decode"}   counter  steps run by the engine
 *   attnd_tokens_written_total                 counter  tokens written into the cache
 *   attnd_step_latency_seconds{kind}           histogram frame decoded -> response encoded,
 *                                              successful steps; decode = every item has n == 1
 *   attnd_step_queue_seconds{kind}             histogram the same steps' wait for the backend
 *                                              (Response.timing.queued_us)
 *   attnd_uptime_seconds                       gauge    seconds since start
 *   process_cpu_seconds_total                  counter  user + system CPU time (/proc/self/stat)
 *   process_resident_memory_bytes              gauge    resident set size
 *   process_virtual_memory_bytes               gauge    virtual memory size
 *   process_open_fds                           gauge    open file descriptors (/proc/self/fd)
 *   process_max_fds                            gauge    RLIMIT_NOFILE
 *   process_start_time_seconds                 gauge    Unix time the process started
 *
 * Served by http.c; rendering reads a few small /proc files and does work
 * proportional to the metrics and the open descriptors, nothing more. */

#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

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

/* A label value as the exposition format wants it: '\\', '"' and newlines escaped. */
static void label_value(char *dst, size_t cap, const char *src) {
  size_t n = 0;
  for (; src && *src && n + 3 < cap; src++) {
    if (*src == '\\' || *src == '"') {
      dst[n++] = '\\';
      dst[n++] = *src;
    } else if (*src == '\n') {
      dst[n++] = '\\';
      dst[n++] = 'n';
    } else {
      dst[n++] = *src;
    }
  }
  dst[n] = 0;
}

static void histogram(sbuf_t *b, const char *name, const attnd_hist_t *hs) {
  for (int k = 0; k < 2; k++) {
    const char *kind = k == ATTND_STEP_DECODE ? "decode" : "prefill";
    const attnd_hist_t *h = &hs[k];
    uint64_t cum = 0;
    for (int i = 0; i < ATTND_HIST_BUCKETS; i++) {
      cum += h->bucket[i];
      sb_printf(b, "%s_bucket{kind=\"%s\",le=\"%g\"} %llu\n", name, kind,
                attnd_hist_bounds_us[i] / 1e6, (unsigned long long)cum);
    }
    cum += h->bucket[ATTND_HIST_BUCKETS];
    sb_printf(b, "%s_bucket{kind=\"%s\",le=\"+Inf\"} %llu\n", name, kind, (unsigned long long)cum);
    sb_printf(b, "%s_sum{kind=\"%s\"} %.6f\n", name, kind, h->sum_us / 1e6);
    sb_printf(b, "%s_count{kind=\"%s\"} %llu\n", name, kind, (unsigned long long)h->count);
  }
}

/* ---- the process's own numbers, from /proc ---- */

static int read_text(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  size_t n = fread(buf, 1, cap - 1, f);
  fclose(f);
  buf[n] = 0;
  return 0;
}

/* The Unix time the process started: boot time (btime of /proc/stat) plus
 * field 22 of /proc/self/stat; it never changes, so it is read once. */
static double start_time_s(unsigned long long start_ticks, long hz) {
  static double cached;
  if (cached > 0)
    return cached;
  char text[4096];
  if (read_text("/proc/stat", text, sizeof(text)) != 0)
    return 0;
  const char *p = strstr(text, "\nbtime ");
  if (!p)
    return 0;
  cached = (double)strtoull(p + 7, NULL, 10) + (double)start_ticks / (double)hz;
  return cached;
}

static void process_metrics(sbuf_t *b) {
  char stat[1024];
  long hz = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
  if (hz <= 0 || page <= 0 || read_text("/proc/self/stat", stat, sizeof(stat)) != 0)
    return;
  /* Fields after the command name, which is in parentheses and may hold
   * spaces: field 3 (state) onwards. */
  const char *p = strrchr(stat, ')');
  if (!p)
    return;
  unsigned long long f[25] = {0};
  int i = 3;
  for (p += 2; *p && i < 25; i++) {
    f[i] = strtoull(p, NULL, 10);
    p = strchr(p, ' ');
    if (!p)
      break;
    p++;
  }
  if (i < 24)
    return;
  head(b, "process_cpu_seconds_total", "counter", "User and system CPU time spent, in seconds.");
  sb_printf(b, "process_cpu_seconds_total %.2f\n", (double)(f[14] + f[15]) / (double)hz);
  head(b, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
  sb_printf(b, "process_resident_memory_bytes %llu\n", f[24] * (unsigned long long)page);
  head(b, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.");
  sb_printf(b, "process_virtual_memory_bytes %llu\n", f[23]);
  int fds = 0;
  DIR *d = opendir("/proc/self/fd");
  if (d) {
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
      if (e->d_name[0] != '.')
        fds++;
    closedir(d);
    fds--; /* the directory's own descriptor */
    head(b, "process_open_fds", "gauge", "Number of open file descriptors.");
    sb_printf(b, "process_open_fds %d\n", fds);
  }
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    head(b, "process_max_fds", "gauge", "Maximum number of open file descriptors.");
    sb_printf(b, "process_max_fds %llu\n", (unsigned long long)rl.rlim_cur);
  }
  double st = start_time_s(f[22], hz);
  if (st > 0) {
    head(b, "process_start_time_seconds", "gauge",
         "Start time of the process since the Unix epoch, in seconds.");
    sb_printf(b, "process_start_time_seconds %.2f\n", st);
  }
}

int attnd_metrics_render(const attnd_metrics_src_t *src, char **out, size_t *len) {
  sbuf_t b = {malloc(16384), 0, 16384, 0};
  if (!b.p)
    return ATTND_ENOMEM;
  const attnd_rpc_counters_t *c = src->counters;
  attnd_engine_stats_t es;
  memset(&es, 0, sizeof(es));
  if (src->engine)
    attnd_engine_stats(src->engine, &es);
  char lb[3][160];
  label_value(lb[0], sizeof(lb[0]), src->backend);
  label_value(lb[1], sizeof(lb[1]), src->device);
  label_value(lb[2], sizeof(lb[2]), src->kv_cache);
  head(&b, "attnd_build_info", "gauge", "The daemon's version, backend, device and KV cache type.");
  sb_printf(&b, "attnd_build_info{version=\"%s\",backend=\"%s\",device=\"%s\",kv_cache=\"%s\"} 1\n",
            ATTND_VERSION, lb[0], lb[1], lb[2]);

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
  /* Capacity apart from the states, so that sum(attnd_kv_blocks) is the capacity. */
  uint32_t held = es.blocks_used + es.blocks_cached;
  uint32_t free_blocks = es.blocks_total > held ? es.blocks_total - held : 0;
  SIMPLE("attnd_kv_blocks_capacity", "gauge", "KV blocks per layer in the pool.", es.blocks_total);
  head(&b, "attnd_kv_blocks", "gauge",
       "KV blocks per layer by state: used (held by sessions or steps), cached (evictable "
       "prefix blocks), free; they sum to the capacity.");
  sb_printf(&b, "attnd_kv_blocks{state=\"used\"} %u\n", es.blocks_used);
  sb_printf(&b, "attnd_kv_blocks{state=\"cached\"} %u\n", es.blocks_cached);
  sb_printf(&b, "attnd_kv_blocks{state=\"free\"} %u\n", free_blocks);
  head(&b, "attnd_kv_usage_ratio", "gauge",
       "Used KV blocks over the capacity (cached blocks are evictable, not counted).");
  sb_printf(&b, "attnd_kv_usage_ratio %.6f\n",
            es.blocks_total ? (double)es.blocks_used / (double)es.blocks_total : 0.0);
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
  SIMPLE("attnd_pinned_bytes", "gauge",
         "Pinned host memory the backend holds (CUDA: staging, frames, the ring).",
         es.pinned_bytes);
  SIMPLE("attnd_ring_chunks_total", "counter",
         "Chunks of large steps staged through the CUDA backend's ring.", es.ring_chunks);
  SIMPLE("attnd_oneshot_steps_total", "counter",
         "Large steps the CUDA ring could not cut, staged whole (they allocate).",
         es.oneshot_steps);
  SIMPLE("attnd_staged_bytes_total", "counter",
         "Bytes of steps' q, k, v and outputs the CUDA backend copied on the host through "
         "pinned staging (0 while frames and outputs are its pinned memory).",
         es.staged_bytes);
  SIMPLE("attnd_cuda_loop_completions_total", "counter",
         "CUDA runs completed by the loop thread's own polling (--cuda-completion loop).",
         es.loop_done);
  SIMPLE("attnd_cuda_graph_steps_total", "counter",
         "Small steps launched as one CUDA graph (--cuda-graphs).", es.graph_steps);
  SIMPLE("attnd_cuda_graph_replays_total", "counter",
         "Graphed small steps launched as their graph was, without a capture (--cuda-graph-replay).",
         es.graph_replays);
  SIMPLE("attnd_cuda_graph_builds_total", "counter",
         "Executable CUDA graphs made (new step shapes, refused updates).", es.graph_builds);
#undef SIMPLE

  head(&b, "attnd_step_latency_seconds", "histogram",
       "Step latency, frame decoded to response encoded, by kind.");
  histogram(&b, "attnd_step_latency_seconds", c->step_latency);
  head(&b, "attnd_step_queue_seconds", "histogram",
       "Time successful steps waited for the backend to start them, by kind.");
  histogram(&b, "attnd_step_queue_seconds", c->step_queue);
  head(&b, "attnd_uptime_seconds", "gauge", "Seconds since the daemon started.");
  sb_printf(&b, "attnd_uptime_seconds %.3f\n", src->uptime_s);
  process_metrics(&b);
  if (b.oom) {
    free(b.p);
    return ATTND_ENOMEM;
  }
  *out = b.p;
  *len = b.len;
  return 0;
}

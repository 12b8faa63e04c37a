/* trace.c: the step trace (--step-trace N; rpc.h): where a Step's time goes,
 * phase by phase, from its frame's first byte to its response's last.
 *
 * Each finished step adds one sample per phase it has (its kind's: prefill,
 * decode and kv_only steps (no q) are traced apart, a prefill's time would
 * hide a decode's); once
 * a kind has N steps, the medians and 90th percentiles of each phase go to
 * the log as one step_trace line, and the window starts again. What is left
 * of a window is logged when the RPC layer is freed (the end of a benchmark).
 * A diagnostic: a few floats per step on the loop thread, sorted once per N. */
#include <stdlib.h>

#include "internal.h"

struct attnd_rpc_trace_s {
  int window;
  float *v[ATTND_TRACE_KINDS][ATTND_PH_COUNT]; /* [kind][phase][window] */
  int n[ATTND_TRACE_KINDS][ATTND_PH_COUNT];
  uint64_t steps[ATTND_TRACE_KINDS];
};

static const char *const phase_name[ATTND_PH_COUNT] = {
    "read",   "decode", "admit",   "scan",   "queue", "h2d",   "kwrite",
    "attend", "d2h",    "compute", "encode", "write", "total",
};

static const char *const kind_name[ATTND_TRACE_KINDS] = {"prefill", "decode", "kv_only"};

int attnd_rpc_trace_init(attnd_rpc_t *r, int window) {
  if (window <= 0)
    return 0;
  attnd_rpc_trace_t *t = calloc(1, sizeof(*t));
  if (!t)
    return ATTND_ENOMEM;
  t->window = window;
  for (int k = 0; k < ATTND_TRACE_KINDS; k++)
    for (int p = 0; p < ATTND_PH_COUNT; p++)
      if (!(t->v[k][p] = malloc((size_t)window * sizeof(float)))) {
        r->trace = t;
        attnd_rpc_trace_free(r);
        return ATTND_ENOMEM;
      }
  r->trace = t;
  return 0;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* One step_trace line for kind: every phase with samples, median/p90. */
static void trace_log(attnd_rpc_trace_t *t, int kind) {
  char line[1024];
  size_t off = 0;
  for (int p = 0; p < ATTND_PH_COUNT; p++) {
    int n = t->n[kind][p];
    if (n == 0 || off >= sizeof(line))
      continue;
    float *v = t->v[kind][p];
    qsort(v, (size_t)n, sizeof(float), cmp_float);
    int w = snprintf(line + off, sizeof(line) - off, " %s_us=%.1f/%.1f", phase_name[p], v[n / 2],
                     v[(n * 9) / 10 < n ? (n * 9) / 10 : n - 1]);
    if (w > 0)
      off += (size_t)w;
    t->n[kind][p] = 0;
  }
  ATTND_LOGI("step_trace", "kind=%s steps=%llu stat=p50/p90%s", kind_name[kind],
             (unsigned long long)t->steps[kind], line);
  t->steps[kind] = 0;
}

static void add(attnd_rpc_trace_t *t, int kind, int phase, double us) {
  int *n = &t->n[kind][phase];
  if (*n < t->window)
    t->v[kind][phase][(*n)++] = (float)us;
}

void attnd_rpc_trace_step(attnd_rpc_t *r, int kind, const uint64_t ph_us[ATTND_PH_COUNT],
                          uint32_t have) {
  attnd_rpc_trace_t *t = r->trace;
  if (!t)
    return;
  for (int p = 0; p < ATTND_PH_COUNT; p++)
    if (have & (1u << p))
      add(t, kind, p, (double)ph_us[p]);
  if (++t->steps[kind] >= (uint64_t)t->window)
    trace_log(t, kind);
}

void attnd_rpc_trace_write(attnd_rpc_t *r, int kind, uint64_t us) {
  if (r->trace && kind >= 0 && kind < ATTND_TRACE_KINDS)
    add(r->trace, kind, ATTND_PH_WRITE, (double)us);
}

void attnd_rpc_trace_free(attnd_rpc_t *r) {
  attnd_rpc_trace_t *t = r->trace;
  if (!t)
    return;
  for (int k = 0; k < ATTND_TRACE_KINDS; k++) {
    if (t->steps[k])
      trace_log(t, k);
    for (int p = 0; p < ATTND_PH_COUNT; p++)
      free(t->v[k][p]);
  }
  free(t);
  r->trace = NULL;
}

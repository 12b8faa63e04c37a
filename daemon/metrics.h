/* metrics.h: the daemon's counters and their Prometheus exposition over HTTP.
 *
 * attnd_counters_t is written only on the loop thread (by rpc.c and server.c)
 * and read on the same thread by Stats and by the /metrics handler, so it needs
 * no locking. The HTTP endpoint serves GET /metrics (text exposition format
 * 0.0.4) and answers 404 to anything else; metric names are listed at the top
 * of metrics.c. */
#ifndef ATTND_METRICS_H
#define ATTND_METRICS_H

#include <stdint.h>
#include <uv.h>

#include "base.h"
#include "engine.h"

/* Methods, numbered as the Request.call oneof tags minus one (0: none/unknown). */
enum {
  ATTND_M_UNKNOWN = 0,
  ATTND_M_HELLO,
  ATTND_M_HEALTH,
  ATTND_M_STATS,
  ATTND_M_OPEN_SESSION,
  ATTND_M_CLOSE_SESSION,
  ATTND_M_FORK,
  ATTND_M_TRUNCATE,
  ATTND_M_PLAN,
  ATTND_M_STEP,
  ATTND_M_SET_SCALES,
  ATTND_M_LIST_SESSIONS,
  ATTND_M_COUNT
};
#define ATTND_CODE_COUNT ATTND_STATUS_COUNT

enum { ATTND_STEP_PREFILL = 0, ATTND_STEP_DECODE = 1 };

typedef struct {
  uint64_t requests[ATTND_M_COUNT];
  uint64_t errors[ATTND_M_COUNT];
  uint64_t by_code[ATTND_M_COUNT][ATTND_CODE_COUNT];
  uint64_t bytes_in;
  uint64_t bytes_out;
  uint32_t connections;         /* open now */
  uint64_t connections_total;   /* accepted since start */
  uint64_t connections_refused; /* over --max-connections */
  uint64_t frame_errors;        /* framing errors that closed a connection */
  attnd_hist_t step_latency[2]; /* ATTND_STEP_PREFILL, ATTND_STEP_DECODE */
} attnd_counters_t;

/* "health", "open_session", ... ("unknown" for 0 or out of range). */
const char *attnd_method_name(int method);
/* "OK", "INVALID_ARGUMENT", ... */
const char *attnd_code_name(int code);

/* Writes the whole exposition into a malloc'ed string (*out, *len). */
int attnd_metrics_render(const attnd_counters_t *c, attnd_engine_t *engine, double uptime_s,
                         char **out, size_t *len);

typedef struct attnd_metrics_s attnd_metrics_t;

/* Listens on HOST:PORT (port 0 picks one) and serves GET /metrics. start_ns is
 * the daemon's start (uv_hrtime) for the uptime gauge. */
int attnd_metrics_start(attnd_metrics_t **out, uv_loop_t *loop, const char *hostport,
                        const attnd_counters_t *c, attnd_engine_t *engine, uint64_t start_ns,
                        char *err, size_t errlen);
int attnd_metrics_port(const attnd_metrics_t *m);
/* Closes the listener and open HTTP connections; the struct is freed once
 * every handle has closed (cb, if not NULL, runs then). */
void attnd_metrics_close(attnd_metrics_t *m, void (*cb)(void *arg), void *arg);

#endif /* ATTND_METRICS_H */

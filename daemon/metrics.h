/* metrics.h: the daemon's counters and their Prometheus exposition over HTTP.
 *
 * attnd_rpc_counters_t (rpc.h) is written only on the loop thread (rpc, server)
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
#include "rpc.h"

/* Writes the whole exposition into a malloc'ed string (*out, *len). */
int attnd_metrics_render(const attnd_rpc_counters_t *c, attnd_engine_t *engine, double uptime_s,
                         char **out, size_t *len);

typedef struct attnd_metrics_s attnd_metrics_t;

/* Listens on HOST:PORT (port 0 picks one) and serves GET /metrics. start_ns is
 * the daemon's start (uv_hrtime) for the uptime gauge. */
int attnd_metrics_start(attnd_metrics_t **out, uv_loop_t *loop, const char *hostport,
                        const attnd_rpc_counters_t *c, attnd_engine_t *engine, uint64_t start_ns,
                        char *err, size_t errlen);
int attnd_metrics_port(const attnd_metrics_t *m);
/* Closes the listener and open HTTP connections; the struct is freed once
 * every handle has closed (cb, if not NULL, runs then). */
void attnd_metrics_close(attnd_metrics_t *m, void (*cb)(void *arg), void *arg);

#endif /* ATTND_METRICS_H */

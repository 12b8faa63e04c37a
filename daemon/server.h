/* server.h: the RPC listeners (DESIGN.md sections 6-8).
 *
 * A Unix socket (mode 0660, in a directory created private when missing; a
 * stale socket file is removed; the peer's uid is the identity) and a TCP
 * listener (default 127.0.0.1:7411; port 0 picks a free port). Off loopback a
 * TCP connection must send Hello{token} first; loopback clients that send none
 * share one anonymous identity.
 *
 * Each connection reads frames (frame.h) and hands them to rpc.c; requests
 * may be pipelined and answered out of order. Backpressure: a connection stops
 * reading while its request bytes in flight plus its response bytes not yet
 * written exceed --max-inflight, and resumes when they drain.
 *
 * Drain (SIGTERM): stop accepting, answer new calls UNAVAILABLE, let in-flight
 * requests finish and their responses be written, then close every handle. */
#ifndef ATTND_SERVER_H
#define ATTND_SERVER_H

#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "engine.h"
#include "rpc.h"

typedef struct attnd_server_s attnd_server_t;

typedef struct {
  uint32_t connections;
  uint64_t peak_conn_inflight; /* largest in-flight bytes seen on one connection */
  uint64_t reads_paused;       /* times a connection stopped reading for backpressure */
} attnd_server_stats_t;

/* Binds the listeners named by cfg (which must outlive the server). On error
 * returns a negative ATTND_E* with a one-line reason in err; nothing is left
 * open then except handles whose close is pending on the loop. */
int attnd_server_start(attnd_server_t **out, uv_loop_t *loop, const attnd_config_t *cfg,
                       attnd_engine_t *engine, char *err, size_t errlen);

/* The rpc state (counters, epoch) shared with metrics. */
attnd_rpc_t *attnd_server_rpc(attnd_server_t *s);
int attnd_server_tcp_port(const attnd_server_t *s);
void attnd_server_stats(const attnd_server_t *s, attnd_server_stats_t *st);

/* Drains and closes everything; cb runs once every handle has closed, after
 * which the server is freed. The engine is not closed here. Calling it twice is
 * harmless (the second cb is ignored). */
void attnd_server_drain(attnd_server_t *s, void (*cb)(void *arg), void *arg);

#endif /* ATTND_SERVER_H */

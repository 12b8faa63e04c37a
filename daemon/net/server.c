/* server.c: the RPC server as a whole (net.h): the RPC state, the
 * listeners the options name, and what Health and the tests ask of it. */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

int attnd_server_start(attnd_server_t **out, uv_loop_t *loop, const attnd_config_t *cfg,
                       attnd_engine_t *engine, char *err, size_t errlen) {
  attnd_server_t *s = attnd_xcalloc(1, sizeof(*s));
  int rc;
  s->loop = loop;
  attnd_list_init(&s->conns);
  s->cfg = cfg;
  s->engine = engine;
  if ((rc = attnd_rpc_init(&s->rpc, loop, engine, cfg, err, errlen))) {
    free(s);
    return rc;
  }
  uv_timer_init(loop, &s->drain_timer);
  s->drain_timer.data = s;
  s->open++; /* the timer, closed last */
  if ((rc = attnd_net_limits_start(s, err, errlen)))
    goto fail;
  if (cfg->socket_path[0] && (rc = attnd_net_start_unix(s, err, errlen)))
    goto fail;
  if (cfg->listen[0] && (rc = attnd_net_start_tcp(s, err, errlen)))
    goto fail;
  *out = s;
  return 0;
fail:
  /* Close what was opened; the struct goes once the loop has run the closes. */
  attnd_server_drain(s, NULL, NULL);
  return rc;
}

attnd_rpc_t *attnd_server_rpc(attnd_server_t *s) {
  return &s->rpc;
}

int attnd_server_tcp_port(const attnd_server_t *s) {
  return s->tcp_port;
}

void attnd_server_stats(const attnd_server_t *s, attnd_server_stats_t *st) {
  *st = s->st;
  st->partial_bytes = s->partial_used;
}

/* drain.c: the server's drain (net.h): stop accepting, answer new calls
 * UNAVAILABLE, let in-flight requests finish, read what clients already sent
 * for a moment, write the responses, then close every handle. */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

static void final_close_cb(uv_handle_t *h) {
  attnd_server_t *s = h->data;
  void (*cb)(void *) = s->drain_cb;
  void *arg = s->drain_arg;
  attnd_rpc_free(&s->rpc);
  attnd_net_limits_free(s);
  free(s);
  ATTND_LOGD("server_closed", "%s", "");
  if (cb)
    cb(arg);
}

void attnd_net_check_done(attnd_server_t *s) {
  /* Everything but the timer gone: close the timer, then report. */
  if (s->finishing && !s->done && s->open == 1) {
    s->done = 1;
    uv_timer_stop(&s->drain_timer);
    uv_close((uv_handle_t *)&s->drain_timer, final_close_cb);
  }
}

static void drain_timeout_cb(uv_timer_t *t) {
  attnd_server_t *s = t->data;
  ATTND_LOGW("drain_timeout", "reason=unwritten_responses timeout_ms=%d", DRAIN_FLUSH_TIMEOUT_MS);
  attnd_list_t *it;
  while ((it = attnd_list_first(&s->conns)) != NULL)
    attnd_conn_close(ATTND_LIST_DATA(it, attnd_conn_t, link));
}

/* The read grace is over: flush and close the connections. */
static void close_drained(uv_timer_t *t) {
  attnd_server_t *s = t->data;
  ATTND_LIST_FOREACH(it, nx, &s->conns) {
    attnd_conn_t *c = ATTND_LIST_DATA(it, attnd_conn_t, link);
    if (c->write_bytes == 0)
      attnd_conn_close(c);
    else
      attnd_conn_close_when_flushed(c);
  }
  attnd_net_limits_close(s, 1);
  if (!attnd_list_empty(&s->conns)) {
    uv_timer_start(&s->drain_timer, drain_timeout_cb, DRAIN_FLUSH_TIMEOUT_MS, 0);
  }
  attnd_net_check_done(s);
}

/* Every request has been answered: read what clients already sent for a
 * moment (answered UNAVAILABLE), then flush and close the connections. */
static void finish_drain(void *arg) {
  attnd_server_t *s = arg;
  if (s->finishing)
    return;
  s->finishing = 1;
  s->rpc.idle_cb = NULL;
  if (attnd_list_empty(&s->conns)) {
    attnd_net_limits_close(s, 1);
    attnd_net_check_done(s);
    return;
  }
  uv_timer_start(&s->drain_timer, close_drained, DRAIN_READ_GRACE_MS, 0);
}

void attnd_server_drain(attnd_server_t *s, void (*cb)(void *arg), void *arg) {
  if (s->draining)
    return;
  s->draining = 1;
  s->rpc.draining = 1;
  s->drain_cb = cb;
  s->drain_arg = arg;
  attnd_net_close_listeners(s);
  ATTND_LOGI("draining", "inflight=%llu connections=%u", (unsigned long long)s->rpc.inflight,
             s->rpc.counters.connections);
  if (s->rpc.inflight == 0) {
    finish_drain(s);
  } else {
    s->rpc.idle_cb = finish_drain;
    s->rpc.idle_arg = s;
  }
}

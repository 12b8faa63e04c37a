/* limits.c: what keeps one client from holding the daemon (internal.h,
 * docs/protocol.md §9):
 *
 *   turns       a connection handles FRAMES_PER_TURN frames in a row, then
 *               waits for the next loop iteration (an idle handle), after
 *               every other ready socket;
 *   budget      bytes of frames not yet completely received, all connections
 *               together, stay within --max-partial-bytes: a body that does
 *               not fit waits (the connection stops reading) until others
 *               complete, in arrival order; bodies of at most SMALL_FRAME
 *               bytes never wait (they count), and before its Hello a
 *               connection may not start a larger one;
 *   identities  at most --max-connections-per-identity connections of one
 *               identity (0: no cap);
 *   sweep       a timer that ends connections past the Hello deadline, past
 *               the frame deadline (a frame whose header arrived must be
 *               complete within --frame-deadline ms; time waiting for the
 *               budget does not count), idle past --idle-timeout, or ending
 *               with answers their client does not read. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- turns ---- */

static void turn_idle_cb(uv_idle_t *h) {
  attnd_server_t *s = h->data;
  attnd_list_t local, *it;
  attnd_list_init(&local);
  if (!attnd_list_empty(&s->turn_q)) {
    local.next = s->turn_q.next;
    local.prev = s->turn_q.prev;
    local.next->prev = &local;
    local.prev->next = &local;
    attnd_list_init(&s->turn_q);
  }
  /* Connections deferred again during this pass wait for the next one. */
  while ((it = attnd_list_first(&local)) != NULL) {
    attnd_conn_t *c = ATTND_LIST_DATA(it, attnd_conn_t, qlink);
    attnd_list_remove(it);
    c->queued = CONN_Q_NONE;
    c->turn_frames = 0;
    attnd_conn_flow(c);
  }
  if (attnd_list_empty(&s->turn_q) && s->turn_active) {
    uv_idle_stop(&s->turn_idle);
    s->turn_active = 0;
  }
}

void attnd_net_turn_defer(attnd_conn_t *c) {
  attnd_server_t *s = c->srv;
  if (c->queued || !s->has_turn_idle)
    return;
  c->queued = CONN_Q_TURN;
  attnd_list_insert_tail(&s->turn_q, &c->qlink);
  s->st.turns_deferred++;
  if (!s->turn_active) {
    uv_idle_start(&s->turn_idle, turn_idle_cb);
    s->turn_active = 1;
  }
}

/* ---- the partial-frame budget ---- */

/* Admits waiting bodies, oldest first, while they fit; each continues in its
 * next turn with its bytes reserved. */
static void budget_wake(attnd_server_t *s) {
  attnd_list_t *it;
  while ((it = attnd_list_first(&s->budget_q)) != NULL) {
    attnd_conn_t *c = ATTND_LIST_DATA(it, attnd_conn_t, qlink);
    if (s->partial_used + c->budget_want > s->partial_max)
      break;
    attnd_list_remove(it);
    c->queued = CONN_Q_NONE;
    s->partial_used += c->budget_want;
    c->budget_grant = c->budget_want;
    c->frame_t0_ms = uv_now(s->loop); /* its deadline starts now */
    attnd_net_turn_defer(c);
  }
  if (s->partial_used > s->st.peak_partial_bytes)
    s->st.peak_partial_bytes = s->partial_used;
}

int attnd_net_budget_admit(attnd_server_t *s, attnd_conn_t *c, size_t len) {
  /* Before its Hello an off-loopback connection holds no large buffer: a
   * Hello is a few hundred bytes. */
  if (c->rc.need_hello && len > SMALL_FRAME)
    return ATTND_EUNAUTH;
  if (c->budget_grant) {
    /* Reserved when it left the queue (the same header, so the same length). */
    s->partial_used = s->partial_used - c->budget_grant + len;
    c->budget_grant = 0;
    return 0;
  }
  if (c->queued == CONN_Q_BUDGET)
    return ATTND_FRAME_PAUSE; /* still waiting (not expected: it reads nothing meanwhile) */
  /* Small frames (decode steps, control calls) never wait behind large
   * ones; they count, so the budget may be passed by SMALL_FRAME bytes per
   * connection at most. */
  if (len <= SMALL_FRAME ||
      (attnd_list_empty(&s->budget_q) && s->partial_used + len <= s->partial_max)) {
    s->partial_used += len;
    if (s->partial_used > s->st.peak_partial_bytes)
      s->st.peak_partial_bytes = s->partial_used;
    return 0;
  }
  c->budget_want = len;
  c->queued = CONN_Q_BUDGET;
  attnd_list_insert_tail(&s->budget_q, &c->qlink);
  s->st.budget_waits++;
  ATTND_LOGD("frame_budget_wait", "conn=%llu len=%zu used=%llu budget=%llu",
             (unsigned long long)c->rc.id, len, (unsigned long long)s->partial_used,
             (unsigned long long)s->partial_max);
  return ATTND_FRAME_PAUSE;
}

void attnd_net_budget_release(attnd_server_t *s, size_t len) {
  s->partial_used -= len;
  budget_wake(s);
}

void attnd_net_unqueue(attnd_conn_t *c) {
  attnd_server_t *s = c->srv;
  int was_budget = c->queued == CONN_Q_BUDGET;
  if (c->queued) {
    attnd_list_remove(&c->qlink);
    c->queued = CONN_Q_NONE;
  }
  if (c->budget_grant) {
    s->partial_used -= c->budget_grant;
    c->budget_grant = 0;
    budget_wake(s);
  } else if (was_budget) {
    budget_wake(s); /* the next one may fit now */
  }
}

/* ---- connections per identity ---- */

int attnd_net_ident_move(attnd_server_t *s, attnd_conn_t *c, uint64_t identity) {
  int cap = s->cfg->max_conns_per_identity;
  if (cap <= 0 || (c->ident_counted && c->ident == identity))
    return 0;
  uintptr_t n = (uintptr_t)attnd_idmap_get(&s->ident_conns, identity);
  if (n >= (uintptr_t)cap)
    return ATTND_ENOSPC;
  attnd_net_ident_drop(s, c);
  n = (uintptr_t)attnd_idmap_get(&s->ident_conns, identity);
  if (n)
    attnd_idmap_del(&s->ident_conns, identity);
  if (attnd_idmap_put(&s->ident_conns, identity, (void *)(n + 1)) != 0) {
    ATTND_LOGE("out_of_memory", "what=identity_map");
    abort();
  }
  c->ident = identity;
  c->ident_counted = 1;
  return 0;
}

void attnd_net_ident_drop(attnd_server_t *s, attnd_conn_t *c) {
  if (!c->ident_counted)
    return;
  c->ident_counted = 0;
  uintptr_t n = (uintptr_t)attnd_idmap_get(&s->ident_conns, c->ident);
  if (!n)
    return;
  attnd_idmap_del(&s->ident_conns, c->ident);
  if (n > 1 && attnd_idmap_put(&s->ident_conns, c->ident, (void *)(n - 1)) != 0) {
    ATTND_LOGE("out_of_memory", "what=identity_map");
    abort();
  }
}

/* ---- the sweep ---- */

static void frame_timeout(attnd_server_t *s, attnd_conn_t *c, uint64_t now) {
  char msg[160];
  s->st.frame_timeouts++;
  ATTND_LOGI("frame_deadline", "conn=%llu got=%zu of=%zu waited_ms=%llu",
             (unsigned long long)c->rc.id, c->fr.body_got, c->fr.body_len,
             (unsigned long long)(now - c->frame_t0_ms));
  snprintf(msg, sizeof(msg), "frame not completed within --frame-deadline %d ms",
           s->cfg->frame_deadline_ms);
  attnd_frame_reader_abort(&c->fr); /* its bytes leave the budget now */
  attnd_rpc_frame_error(&c->rc, ATTND_ENOSPC, msg);
  attnd_conn_flow(c);
}

/* Idle (docs/protocol.md §9): nothing read or written and no call answered
 * for --idle-timeout, no call in flight, no partial frame, and its identity
 * holds no open session; or answers are waiting and its client has read none
 * of them for that long. Asking the engine about sessions walks them, so a
 * connection kept for its sessions is asked again only a timeout later. */
static int idle_now(attnd_server_t *s, attnd_conn_t *c, uint64_t now, uint64_t idle_ms,
                    uint64_t *last_ident, int *last_has) {
  if (c->rc.pending || attnd_frame_reader_partial(&c->fr) || c->queued)
    return 0;
  if (now - c->active_ms < idle_ms || now < c->idle_check_ms)
    return 0;
  if (c->write_bytes)
    return 1;
  int has;
  if (*last_has >= 0 && *last_ident == c->rc.identity) {
    has = *last_has;
  } else {
    has = attnd_engine_list_sessions(s->engine, c->rc.identity, NULL, 0) > 0;
    *last_ident = c->rc.identity;
    *last_has = has;
  }
  if (has)
    c->idle_check_ms = now + idle_ms;
  return !has;
}

static void sweep_cb(uv_timer_t *t) {
  attnd_server_t *s = t->data;
  const attnd_config_t *cfg = s->cfg;
  uint64_t now = uv_now(s->loop);
  uint64_t idle_ms = (uint64_t)cfg->idle_timeout_s * 1000;
  uint64_t last_ident = 0;
  int last_has = -1;
  ATTND_LIST_FOREACH(it, nx, &s->conns) {
    attnd_conn_t *c = ATTND_LIST_DATA(it, attnd_conn_t, link);
    if (c->closing)
      continue;
    if (c->eof || c->close_when_flushed || c->rc.ending) {
      /* Everything is answered but its client reads none of it. */
      if (cfg->frame_deadline_ms && c->rc.pending == 0 && c->write_bytes &&
          now - c->ending_ms >= (uint64_t)cfg->frame_deadline_ms) {
        ATTND_LOGI("conn_unread", "conn=%llu unwritten=%llu", (unsigned long long)c->rc.id,
                   (unsigned long long)c->write_bytes);
        attnd_conn_close(c);
      }
      continue;
    }
    if (c->rc.need_hello) {
      if (now - c->accepted_ms >= (uint64_t)cfg->hello_timeout_ms) {
        s->st.hello_timeouts++;
        ATTND_LOGI("hello_timeout", "conn=%llu", (unsigned long long)c->rc.id);
        attnd_rpc_conn_end(&c->rc, ATTND_EUNAUTH, "no Hello{token} in time");
        attnd_conn_flow(c);
      }
      continue;
    }
    if (cfg->frame_deadline_ms && attnd_frame_reader_partial(&c->fr) &&
        c->queued != CONN_Q_BUDGET && !c->budget_grant &&
        now - c->frame_t0_ms >= (uint64_t)cfg->frame_deadline_ms) {
      frame_timeout(s, c, now);
      continue;
    }
    if (idle_ms && idle_now(s, c, now, idle_ms, &last_ident, &last_has)) {
      char msg[160];
      s->st.idle_closed++;
      ATTND_LOGI("idle_timeout", "conn=%llu idle_s=%llu unwritten=%llu",
                 (unsigned long long)c->rc.id, (unsigned long long)(now - c->active_ms) / 1000,
                 (unsigned long long)c->write_bytes);
      snprintf(msg, sizeof(msg), "connection idle for %d s (--idle-timeout): closed",
               cfg->idle_timeout_s);
      attnd_rpc_conn_end(&c->rc, ATTND_EUNAVAIL, msg);
      attnd_conn_flow(c);
    }
  }
}

/* ---- start and stop ---- */

/* Runs once per loop turn while active: an active idle handle makes the
 * loop poll with a zero timeout, so it never sleeps until the window ends. */
static void busy_idle_cb(uv_idle_t *h) {
  attnd_server_t *s = h->data;
  if (uv_hrtime() >= s->busy_until_ns) {
    uv_idle_stop(&s->busy_idle);
    s->busy_active = 0;
  }
}

void attnd_net_busy_touch(attnd_server_t *s) {
  if (!s->has_busy_idle)
    return;
  s->busy_until_ns = uv_hrtime() + (uint64_t)s->cfg->busy_poll_us * 1000u;
  if (!s->busy_active) {
    s->busy_active = 1;
    uv_idle_start(&s->busy_idle, busy_idle_cb);
  }
}

static void handle_close_cb(uv_handle_t *h) {
  attnd_server_t *s = h->data;
  s->open--;
  attnd_net_check_done(s);
}

int attnd_net_limits_start(attnd_server_t *s, char *err, size_t errlen) {
  const attnd_config_t *cfg = s->cfg;
  attnd_list_init(&s->turn_q);
  attnd_list_init(&s->budget_q);
  if (attnd_idmap_init(&s->ident_conns) != 0) {
    snprintf(err, errlen, "out of memory");
    return ATTND_ENOMEM;
  }
  if (cfg->max_partial_bytes) {
    s->partial_max = cfg->max_partial_bytes;
  } else {
    uint64_t q = uv_get_total_memory() / 4;
    s->partial_max = q < cfg->max_frame     ? cfg->max_frame
                     : q > PARTIAL_AUTO_MAX ? PARTIAL_AUTO_MAX
                                            : q;
    if (s->partial_max < cfg->max_frame)
      s->partial_max = cfg->max_frame;
  }
  s->st.partial_budget = s->partial_max;
  uv_idle_init(s->loop, &s->turn_idle);
  s->turn_idle.data = s;
  s->has_turn_idle = 1;
  s->open++;
  if (cfg->busy_poll_us > 0) {
    uv_idle_init(s->loop, &s->busy_idle);
    s->busy_idle.data = s;
    s->has_busy_idle = 1;
    s->open++;
  }
  /* The sweep runs a few times per shortest timeout, at most once a second. */
  uint64_t period = 1000, t[3] = {(uint64_t)cfg->hello_timeout_ms, (uint64_t)cfg->frame_deadline_ms,
                                  (uint64_t)cfg->idle_timeout_s * 1000};
  for (int i = 0; i < 3; i++)
    if (t[i] && t[i] / 4 < period)
      period = t[i] / 4;
  if (period < 10)
    period = 10;
  uv_timer_init(s->loop, &s->sweep_timer);
  s->sweep_timer.data = s;
  s->has_sweep = 1;
  s->open++;
  uv_timer_start(&s->sweep_timer, sweep_cb, period, period);
  ATTND_LOGD("limits",
             "max_partial_bytes=%llu frame_deadline_ms=%d idle_timeout_s=%d sweep_ms=%llu",
             (unsigned long long)s->partial_max, cfg->frame_deadline_ms, cfg->idle_timeout_s,
             (unsigned long long)period);
  return 0;
}

void attnd_net_limits_close(attnd_server_t *s, int all) {
  if (s->has_sweep) {
    s->has_sweep = 0;
    uv_close((uv_handle_t *)&s->sweep_timer, handle_close_cb);
  }
  if (all && s->has_turn_idle) {
    /* Nobody reads any more: whatever waited for a turn is ending anyway. */
    attnd_list_t *it;
    while ((it = attnd_list_first(&s->turn_q)) != NULL)
      attnd_net_unqueue(ATTND_LIST_DATA(it, attnd_conn_t, qlink));
    s->has_turn_idle = 0;
    s->turn_active = 0;
    uv_close((uv_handle_t *)&s->turn_idle, handle_close_cb);
  }
  if (all && s->has_busy_idle) {
    s->has_busy_idle = 0;
    s->busy_active = 0;
    uv_close((uv_handle_t *)&s->busy_idle, handle_close_cb);
  }
}

void attnd_net_limits_free(attnd_server_t *s) {
  if (s->ident_conns.b)
    attnd_idmap_free(&s->ident_conns);
}

/* engine.c: PLACEHOLDER so the daemon links while the real engine is written.
 * Every session call answers UNIMPLEMENTED. Replaced by the engine work. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "errors.h"

struct attnd_engine_s {
  attnd_config_t cfg;
};

int attnd_engine_init(attnd_engine_t **out, uv_loop_t *loop, const attnd_config_t *cfg,
                      char *err, size_t errlen) {
  attnd_engine_t *e = calloc(1, sizeof(*e));
  if (!e)
    return ATTND_ENOMEM;
  e->cfg = *cfg;
  *out = e;
  return 0;
}

void attnd_engine_close(attnd_engine_t *e, void (*cb)(void *arg), void *arg) {
  free(e);
  if (cb)
    cb(arg);
}

void attnd_engine_info(attnd_engine_t *e, attnd_engine_info_t *info) {
  memset(info, 0, sizeof(*info));
  info->backend = "cpu";
  snprintf(info->device, sizeof(info->device), "cpu");
}

void attnd_engine_stats(attnd_engine_t *e, attnd_engine_stats_t *st) { memset(st, 0, sizeof(*st)); }

uint32_t attnd_engine_list_sessions(attnd_engine_t *e, uint64_t identity,
                                    attnd_session_info_t *out, uint32_t max) {
  return 0;
}

static void unimpl(attnd_engine_done_cb cb, void *arg) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.status = ATTND_ENOTIMPL;
  snprintf(r.message, sizeof(r.message), "sessions are not implemented yet");
  cb(arg, &r);
}

void attnd_engine_open_session(attnd_engine_t *e, uint64_t identity, const uint32_t *tokens,
                               uint32_t ntokens, const uint8_t *salt, size_t saltlen,
                               attnd_engine_done_cb cb, void *arg) {
  unimpl(cb, arg);
}
void attnd_engine_close_session(attnd_engine_t *e, uint64_t identity, uint64_t session,
                                attnd_engine_done_cb cb, void *arg) {
  unimpl(cb, arg);
}
void attnd_engine_fork(attnd_engine_t *e, uint64_t identity, uint64_t session,
                       attnd_engine_done_cb cb, void *arg) {
  unimpl(cb, arg);
}
void attnd_engine_truncate(attnd_engine_t *e, uint64_t identity, uint64_t session, uint32_t len,
                           attnd_engine_done_cb cb, void *arg) {
  unimpl(cb, arg);
}
void attnd_engine_plan(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_item_t *items, uint32_t nitems, attnd_engine_done_cb cb,
                       void *arg) {
  unimpl(cb, arg);
}
void attnd_engine_step(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                       const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg) {
  unimpl(cb, arg);
}
void attnd_engine_set_scales(attnd_engine_t *e, const attnd_scales_req_t *req,
                             attnd_engine_done_cb cb, void *arg) {
  unimpl(cb, arg);
}
void attnd_engine_conn_closed(attnd_engine_t *e, uint64_t conn) {}

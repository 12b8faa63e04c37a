/* info.c: the method rows answered from the daemon's own state (internal.h):
 * Health (model shape, backend, device, epoch), Stats (counters) and
 * ListSessions (this identity's sessions). */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static bool enc_sessions_cb(pb_ostream_t *s, const pb_field_t *f, void *const *arg) {
  const attnd_rpc_req_t *ss = *arg;
  for (uint32_t i = 0; i < ss->nsessions; i++) {
    attnd_v1_SessionInfo si = attnd_v1_SessionInfo_init_zero;
    si.session = ss->sessions[i].session;
    si.len = ss->sessions[i].len;
    si.base = ss->sessions[i].base;
    si.blocks = ss->sessions[i].blocks;
    si.idle_s = ss->sessions[i].idle_s;
    if (!pb_encode_tag_for_field(s, f) ||
        !pb_encode_submessage(s, attnd_v1_SessionInfo_fields, &si))
      return false;
  }
  return true;
}

static void fill_shape(attnd_rpc_t *r, attnd_v1_ModelShape *m) {
  const attnd_config_t *cfg = r->cfg;
  const attnd_kshape_t *s = &cfg->shape;
  m->layers = (uint32_t)cfg->layers;
  m->q_heads = (uint32_t)s->q_heads;
  m->kv_heads = (uint32_t)s->kv_heads;
  /* Head sharding (docs/scale-out.md): q_heads/kv_heads above are the held
   * counts, the range and the model's totals follow (0:N for the whole model). */
  m->kv_head_begin = (uint32_t)s->kv_head_begin;
  m->kv_head_end = (uint32_t)(s->kv_head_begin + s->kv_heads);
  m->model_q_heads = (uint32_t)(cfg->model_q_heads ? cfg->model_q_heads : s->q_heads);
  m->model_kv_heads = (uint32_t)attnd_kshape_model_kv_heads(s);
  m->head_dim = (uint32_t)s->head_dim;
  m->block_size = (uint32_t)s->block_size;
  snprintf(m->dtype, sizeof(m->dtype), "%s", s->dtype == ATTND_DT_FP16 ? "fp16" : "bf16");
  snprintf(m->kv_cache, sizeof(m->kv_cache), "%s", attnd_kv_type_name(s->kv));
  snprintf(m->rope, sizeof(m->rope), "%s",
           s->rope == ATTND_ROPE_NEOX          ? "neox"
           : s->rope == ATTND_ROPE_INTERLEAVED ? "interleaved"
                                               : "none");
  m->rope_theta = s->rope_theta;
  m->rotary_dim = (uint32_t)s->rotary_dim;
  m->softmax_scale = s->softmax_scale;
  m->max_context = (uint32_t)cfg->max_context;
  m->softcap = s->softcap;
  attnd_config_windows_text(cfg, m->attention_windows, sizeof(m->attention_windows));
  m->attention_sinks = cfg->attention_sinks != 0;
  snprintf(m->model_id, sizeof(m->model_id), "%s", cfg->model_id);
  /* All layers, K and V, scales included; rounded up to whole bytes. */
  double per = attnd_kv_bytes_per_token(s) * (double)cfg->layers;
  m->kv_bytes_per_token = (uint64_t)(per + 0.999999);
}

/* Health, Stats and ListSessions need no engine call: they complete at once
 * (no result of the engine's), and their encoders read the daemon's state. */
static void complete_now(attnd_rpc_req_t *q) {
  attnd_result_t res;
  memset(&res, 0, sizeof(res));
  attnd_rpc_done(q, &res);
}

int attnd_rpc_decode_none(attnd_rpc_req_t *q, pb_istream_t *s) {
  return 0;
}

void attnd_rpc_call_health(attnd_rpc_req_t *q) {
  complete_now(q);
}

void attnd_rpc_encode_health(attnd_rpc_req_t *q, const attnd_result_t *res,
                             attnd_v1_Response *resp) {
  attnd_rpc_t *r = q->conn->rpc;
  attnd_v1_HealthResponse *h = &resp->result.health;
  /* The engine's static facts, fetched once (the backend may read files to
   * describe its device: not on every call). */
  const attnd_engine_info_t *info = attnd_rpc_info(r);
  snprintf(h->status, sizeof(h->status), "%s", r->draining ? "draining" : "serving");
  snprintf(h->version, sizeof(h->version), "%s", ATTND_VERSION);
  snprintf(h->backend, sizeof(h->backend), "%s", info->backend ? info->backend : "unknown");
  snprintf(h->device, sizeof(h->device), "%s", info->device);
  h->has_model = true;
  fill_shape(r, &h->model);
  h->split_context = true; /* OpenSession.base and Item.q_only (docs/scale-out.md) */
  h->uptime_s = (attnd_rpc_now_ns() - r->start_ns) / 1000000000ull;
  h->epoch = r->epoch;
  h->tcp_port = (uint32_t)r->tcp_port;
  h->kv_memory_bytes = info->kv_memory;
  h->kv_blocks = info->kv_blocks;
  h->device_memory_bytes = info->device_memory;
  h->compute_capability = (uint32_t)info->compute_capability;
  snprintf(h->device_uuid, sizeof(h->device_uuid), "%s", info->device_uuid);
}

void attnd_rpc_call_stats(attnd_rpc_req_t *q) {
  complete_now(q);
}

/* Encoded after the call was counted, so the numbers include it. */
void attnd_rpc_encode_stats(attnd_rpc_req_t *q, const attnd_result_t *res,
                            attnd_v1_Response *resp) {
  attnd_rpc_t *r = q->conn->rpc;
  attnd_v1_StatsResponse *s = &resp->result.stats;
  attnd_engine_stats_t es;
  memset(&es, 0, sizeof(es));
  attnd_engine_stats(r->engine, &es);
  s->connections = r->counters.connections;
  for (int m = 1; m < ATTND_M_COUNT && s->methods_count < 16; m++) {
    attnd_v1_MethodStats *ms = &s->methods[s->methods_count++];
    snprintf(ms->method, sizeof(ms->method), "%s", attnd_rpc_method_name(m));
    ms->requests = r->counters.requests[m];
    ms->errors = r->counters.answers[m].errors;
  }
  s->bytes_in = r->counters.bytes_in;
  s->bytes_out = r->counters.bytes_out;
  s->sessions = es.sessions;
  s->blocks_total = es.blocks_total;
  s->blocks_used = es.blocks_used;
  s->blocks_cached = es.blocks_cached;
  s->prefix_queries = es.prefix_queries;
  s->prefix_hit_tokens = es.prefix_hit_tokens;
  s->prefix_miss_tokens = es.prefix_miss_tokens;
  s->evictions = es.evictions;
  s->cow_copies = es.cow_copies;
  s->plans = es.plans;
  s->steps = es.steps;
  s->tokens_written = es.tokens_written;
  snprintf(s->kv_cache, sizeof(s->kv_cache), "%s", attnd_kv_type_name(r->cfg->shape.kv));
  s->kv_bytes_per_token =
      (uint64_t)(attnd_kv_bytes_per_token(&r->cfg->shape) * (double)r->cfg->layers + 0.999999);
  s->uptime_s = (attnd_rpc_now_ns() - r->start_ns) / 1000000000ull;
  s->admission_queued = es.queued;
  for (int l = 0; l < r->cfg->layers; l++)
    s->sliding_layers += attnd_config_layer_window(r->cfg, l) > 0 ? 1u : 0u;
  s->sinks_set_layers = es.sinks_set;
}

void attnd_rpc_call_list_sessions(attnd_rpc_req_t *q) {
  attnd_rpc_t *r = q->conn->rpc;
  uint32_t n = attnd_engine_list_sessions(r->engine, q->conn->identity, NULL, 0);
  if (n) {
    q->sessions = attnd_xmalloc((size_t)n * sizeof(*q->sessions));
    uint32_t got = attnd_engine_list_sessions(r->engine, q->conn->identity, q->sessions, n);
    q->nsessions = got < n ? got : n;
  }
  complete_now(q);
}

void attnd_rpc_encode_list_sessions(attnd_rpc_req_t *q, const attnd_result_t *res,
                                    attnd_v1_Response *resp) {
  resp->result.list_sessions.sessions.funcs.encode = enc_sessions_cb;
  resp->result.list_sessions.sessions.arg = q;
}

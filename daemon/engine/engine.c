/* engine.c: the engine's lifetime and introspection (engine.h): the backend
 * chosen and created, the pool, prefix index and scales set up, persisted
 * scales restored; close waits for pending work; Health and Stats facts.
 *
 * Choices the contract (docs/sessions.md) leaves open, made by the engine:
 *  - a session used by another identity answers PERMISSION_DENIED;
 *  - an inline Step is a one-layer plan, so like a Plan it ends the live plan
 *    of every session it names; a Step naming a plan that is not live (ended
 *    or never issued) answers FAILED_PRECONDITION;
 *  - a Plan reserves (allocates and copies-on-write) the blocks of all its
 *    positions for all layers at admission; each Step reserves again what a
 *    publication in between made immutable, so a repeated layer still writes
 *    only private blocks;
 *  - SetScales with drop_cached_kv drops every cached block from the prefix
 *    index (the fingerprint changes anyway) and sets every session's len[l]
 *    of that layer to 0: the client recomputes that layer, nothing else;
 *  - Truncate to more than len answers INVALID_ARGUMENT;
 *  - non-finite q/k/v are found by a scan that finishes before the call is
 *    admitted: on the loop thread for small steps, on the worker pool (the
 *    admission queue, queue.c) for large ones;
 *  - the idle sweep waits while calls are queued, so a session a queued call
 *    names is not closed under it for being idle.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

void attnd_engine_answer(attnd_engine_done_cb cb, void *arg, int status, const char *fmt, ...) {
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.status = status;
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r.message, sizeof(r.message), fmt, ap);
    va_end(ap);
  }
  cb(arg, &r);
}

/* The backend the options ask for: CUDA when asked, or on auto when a device
 * answers; else the CPU. */
static int create_backend(attnd_engine_t *e, const attnd_config_t *cfg, char *err, size_t errlen) {
  int use_cuda = cfg->backend == ATTND_BACKEND_CUDA ||
                 (cfg->backend == ATTND_BACKEND_AUTO && attnd_backend_cuda_available());
  if (cfg->backend == ATTND_BACKEND_CUDA && !attnd_backend_cuda_available()) {
    snprintf(err, errlen, "--backend cuda but no usable CUDA device");
    return ATTND_EUNAVAIL;
  }
  attnd_backend_opts_t bo;
  attnd_backend_opts_defaults(&bo);
  bo.kv_memory = cfg->kv_memory;
  bo.threads = cfg->threads;
  bo.device = cfg->device;
  bo.cuda_pinned_max = cfg->cuda_pinned_max;
  bo.cuda_pinned_warm = cfg->cuda_pinned_warm;
  bo.cuda_ring = cfg->cuda_ring;
  bo.cuda_frame_pool = cfg->cuda_frame_pool;
  bo.cuda_hostfn_min = cfg->cuda_hostfn_min;
  bo.cuda_callbacks = cfg->cuda_completion == ATTND_COMPLETION_CALLBACK;
  bo.cuda_spin_us = cfg->cuda_completion == ATTND_COMPLETION_LOOP ? ATTND_CUDA_LOOP_SPIN_US : 0;
  bo.cuda_trace = cfg->cuda_trace;
  bo.cuda_graphs = cfg->cuda_graphs;
  bo.cuda_graph_replay = cfg->cuda_graph_replay;
  bo.chunk_keys = cfg->engine_chunk_keys;
  if (use_cuda)
    return attnd_backend_cuda_create(&e->be, e->loop, &e->shape, e->layers, &bo, err, errlen);
  return attnd_backend_cpu_create(&e->be, e->loop, &e->shape, e->layers, &bo, err, errlen);
}

/* Reads the persisted scales (a file for another shape is ignored, with a
 * warning) and hands them to the backend as SCALES jobs, ahead of any step. */
static int restore_scales(attnd_engine_t *e, char *err, size_t errlen) {
  char lerr[256] = "";
  int rc = attnd_scales_load(&e->sc, lerr, sizeof(lerr));
  if (rc < 0) {
    snprintf(err, errlen, "cannot read %s: %s", e->sc.path, attnd_strerror(rc));
    return rc;
  }
  if (rc == 1)
    ATTND_LOGW("scales_ignored", "reason=\"%s\"", lerr);
  for (int l = 0; l < e->layers; l++)
    if (e->sc.l[l].present)
      attnd_scales_submit(e, l);
  return 0;
}

/* The persisted sinks likewise, as SINKS jobs ahead of any step. */
static int restore_sinks(attnd_engine_t *e, char *err, size_t errlen) {
  char lerr[256] = "";
  int rc = attnd_sinks_load(&e->sk, lerr, sizeof(lerr));
  if (rc < 0) {
    snprintf(err, errlen, "cannot read %s: %s", e->sk.path, attnd_strerror(rc));
    return rc;
  }
  if (rc == 1)
    ATTND_LOGW("sinks_ignored", "reason=\"%s\"", lerr);
  for (int l = 0; e->sk.enabled && l < e->layers; l++)
    if (e->sk.l[l].present)
      attnd_sinks_submit(e, l);
  return 0;
}

/* Sessions idle for --session-idle seconds close; the sweep runs a few times
 * per idle period (at most every second) and alone keeps no loop alive. */
static void start_idle_sweep(attnd_engine_t *e) {
  uv_timer_init(e->loop, &e->idle);
  e->idle.data = e;
  if (e->cfg.session_idle_s > 0) {
    uint64_t period = (uint64_t)e->cfg.session_idle_s * 1000 / 4;
    if (period > 1000)
      period = 1000;
    if (period < 10)
      period = 10;
    uv_timer_start(&e->idle, attnd_session_idle_cb, period, period);
  }
  uv_unref((uv_handle_t *)&e->idle);
}

int attnd_engine_init(attnd_engine_t **out, uv_loop_t *loop, const attnd_config_t *cfg, char *err,
                      size_t errlen) {
  attnd_engine_t *e = attnd_xcalloc(1, sizeof(*e));
  int rc;
  e->loop = loop;
  e->cfg = *cfg;
  e->shape = cfg->shape;
  if (e->shape.rotary_dim == 0)
    e->shape.rotary_dim = e->shape.head_dim;
  if (!(e->shape.softmax_scale > 0.0f) && e->shape.head_dim > 0)
    e->shape.softmax_scale = (float)(1.0 / sqrt((double)e->shape.head_dim));
  e->layers = cfg->layers;
  e->bs = (uint32_t)e->shape.block_size;
  e->offload_bytes = (size_t)cfg->engine_offload_bytes;
  /* A large scan's parts run on the libuv pool beside other work: at most its
   * size, and one core fewer than the machine has: a woken worker without a
   * core of its own takes the loop thread's (measured on 2 cores: queueing 4
   * parts held the loop 2-17 ms). */
  e->scan_parts = attnd_config_worker_threads(cfg);
  e->scan_part_bytes = ATTND_SCAN_PART_BYTES;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  if (ncpu > 1 && e->scan_parts > ncpu - 1)
    e->scan_parts = (int)(ncpu - 1);
  if (e->scan_parts < 1)
    e->scan_parts = 1;
  if (e->scan_parts > ATTND_SCAN_MAX_PARTS)
    e->scan_parts = ATTND_SCAN_MAX_PARTS;
  if (e->cfg.max_context <= 0)
    e->cfg.max_context = 131072;
  if (e->layers <= 0 || attnd_kshape_check(&e->shape) != 0) {
    snprintf(err, errlen, "unsupported model shape");
    rc = ATTND_EINVAL;
    goto fail_shape;
  }
  if ((rc = create_backend(e, cfg, err, errlen)) != 0)
    goto fail_shape;
  if ((rc = attnd_blocks_init(&e->pool, e->be->num_blocks)) != 0)
    goto fail_pool;
  if ((rc = attnd_prefix_init(&e->px, &e->pool, e->bs)) != 0)
    goto fail_prefix;
  if ((rc = attnd_sched_init(e)) != 0)
    goto fail_sched;
  if ((rc = attnd_scales_init(&e->sc, &e->shape, e->layers, cfg->state_dir)) != 0)
    goto fail_scales;
  if ((rc = restore_scales(e, err, errlen)) != 0)
    goto fail_load;
  if ((rc = attnd_sinks_init(&e->sk, cfg->attention_sinks, e->layers, e->shape.q_heads,
                             cfg->state_dir)) != 0)
    goto fail_load;
  if ((rc = restore_sinks(e, err, errlen)) != 0)
    goto fail_sinks;
  if (attnd_idmap_init(&e->sessions) || attnd_idmap_init(&e->plans) || attnd_idmap_init(&e->idents))
    abort();
  attnd_list_init(&e->slist);
  attnd_list_init(&e->plist);
  attnd_order_init(e);
  attnd_hostmem_init(&e->hm, cfg->max_frame);
  attnd_scales_update_fingerprint(e);
  start_idle_sweep(e);
  *out = e;
  return 0;
fail_sinks:
  attnd_sinks_free(&e->sk);
fail_load:
  attnd_scales_free(&e->sc);
fail_scales:
  attnd_sched_free(e);
fail_sched:
  attnd_prefix_free(e->px);
fail_prefix:
  attnd_blocks_free(&e->pool);
fail_pool:
  e->be->ops->destroy(e->be);
fail_shape:
  free(e);
  return rc;
}

static void idle_closed(uv_handle_t *h) {
  attnd_engine_t *e = h->data;
  void (*cb)(void *) = e->close_cb;
  void *arg = e->close_arg;
  attnd_list_t *it;
  while ((it = attnd_list_first(&e->slist)) != NULL)
    attnd_session_destroy(e, ATTND_LIST_DATA(it, attnd_session_t, link));
  while ((it = attnd_list_first(&e->plist)) != NULL)
    attnd_plan_end(e, ATTND_LIST_DATA(it, attnd_plan_t, link));
  e->be->ops->destroy(e->be);
  attnd_idmap_free(&e->sessions);
  attnd_idmap_free(&e->plans);
  attnd_idmap_free(&e->idents);
  attnd_order_free(e);
  attnd_prefix_free(e->px);
  attnd_sched_free(e);
  attnd_blocks_free(&e->pool);
  attnd_scales_free(&e->sc);
  attnd_sinks_free(&e->sk);
  attnd_hostmem_free(&e->hm);
  free(e);
  if (cb)
    cb(arg);
}

void attnd_engine_maybe_finish_close(attnd_engine_t *e) {
  if (e->closing != 1 || e->pending > 0)
    return;
  e->closing = 2;
  uv_close((uv_handle_t *)&e->idle, idle_closed);
}

void attnd_engine_on_fatal(attnd_engine_t *e, void (*cb)(void *arg), void *arg) {
  e->fatal_cb = cb;
  e->fatal_arg = arg;
}

void attnd_engine_close(attnd_engine_t *e, void (*cb)(void *arg), void *arg) {
  if (e->closing)
    return;
  e->closing = 1;
  e->close_cb = cb;
  e->close_arg = arg;
  /* Scales and sinks are persisted as they are set; nothing else outlives the process. */
  attnd_engine_maybe_finish_close(e);
}

/* ---- introspection ---- */

void attnd_engine_info(attnd_engine_t *e, attnd_engine_info_t *info) {
  memset(info, 0, sizeof(*info));
  info->backend = e->be->ops->name;
  e->be->ops->describe(e->be, info->device, sizeof(info->device), &info->device_memory,
                       &info->compute_capability);
  info->kv_blocks = e->be->num_blocks;
  info->kv_memory = (uint64_t)e->be->num_blocks * e->be->block_bytes * (uint64_t)e->layers;
  info->kv_bytes_per_token = attnd_kv_bytes_per_token(&e->shape) * e->layers;
  snprintf(info->device_uuid, sizeof(info->device_uuid), "%s", e->be->device_uuid);
}

void attnd_engine_stats(attnd_engine_t *e, attnd_engine_stats_t *st) {
  *st = e->st;
  st->sessions = e->nsessions;
  st->plans = e->nplans;
  st->blocks_total = e->pool.n;
  st->blocks_used = attnd_blocks_used(&e->pool);
  st->blocks_cached = e->pool.nlru;
  st->queued = e->nqueued;
  st->sinks_set = 0;
  for (int l = 0; e->sk.enabled && l < e->layers; l++)
    st->sinks_set += e->sk.l[l].present ? 1u : 0u;
  if (e->be->ops->stats) {
    attnd_backend_stats_t bs;
    memset(&bs, 0, sizeof(bs));
    e->be->ops->stats(e->be, &bs);
    st->pinned_bytes = bs.pinned_bytes;
    st->ring_chunks = bs.ring_chunks;
    st->oneshot_steps = bs.oneshot_steps;
    st->staged_bytes = bs.staged_bytes;
    st->loop_done = bs.loop_done;
    st->graph_steps = bs.graph_steps;
    st->graph_builds = bs.graph_builds;
    st->graph_replays = bs.graph_replays;
  }
}

uint32_t attnd_engine_list_sessions(attnd_engine_t *e, uint64_t identity, attnd_session_info_t *out,
                                    uint32_t max) {
  uint32_t n = 0;
  uint64_t now = attnd_engine_now_ms(e);
  ATTND_LIST_FOREACH(it, nx, &e->slist) {
    const attnd_session_t *s = ATTND_LIST_DATA(it, attnd_session_t, link);
    if (s->identity != identity)
      continue;
    if (n < max) {
      out[n].session = s->id;
      out[n].len = s->base + s->len[0];
      out[n].base = s->base;
      out[n].blocks = s->nblocks;
      out[n].idle_s = (now - s->last_used_ms) / 1000;
    }
    n++;
  }
  return n;
}

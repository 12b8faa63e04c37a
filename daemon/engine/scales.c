/* scales.c: static quantization scales (internal.h, docs/numerics.md): the
 * per-layer table, its checks and versions, and SetScales in three steps:
 * checked (validation, KV in the layer), the table as it will be persisted
 * (scales_file.c, on the worker pool, by the admission queue in queue.c),
 * and only then applied (dropping the layer's KV when asked), the prefix
 * fingerprint renewed and the backend's copy updated in the layer's job
 * order. A call whose file cannot be written changes nothing. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static size_t nscales(const attnd_scales_t *s, int per_channel) {
  return (size_t)s->kv_heads * (per_channel ? (size_t)s->head_dim : 1);
}

int attnd_scales_init(attnd_scales_t *s, const attnd_kshape_t *shape, int layers,
                      const char *state_dir) {
  memset(s, 0, sizeof(*s));
  s->layers = layers;
  s->kv_heads = shape->kv_heads;
  s->kv_head_begin = shape->kv_head_begin;
  s->model_kv_heads = attnd_kshape_model_kv_heads(shape);
  s->head_dim = shape->head_dim;
  s->kv = shape->kv;
  s->l = calloc((size_t)layers, sizeof(*s->l));
  if (!s->l)
    return ATTND_ENOMEM;
  size_t n = (size_t)s->kv_heads * (size_t)s->head_dim;
  for (int i = 0; i < layers; i++) {
    s->l[i].k_scale = calloc(n, sizeof(float));
    s->l[i].v_scale = calloc(n, sizeof(float));
    if (!s->l[i].k_scale || !s->l[i].v_scale) {
      attnd_scales_free(s);
      return ATTND_ENOMEM;
    }
    if (s->kv == ATTND_KV_INT4) {
      s->l[i].k_zero = calloc(n, sizeof(float));
      s->l[i].v_zero = calloc(n, sizeof(float));
      if (!s->l[i].k_zero || !s->l[i].v_zero) {
        attnd_scales_free(s);
        return ATTND_ENOMEM;
      }
    }
  }
  if (state_dir && state_dir[0])
    snprintf(s->path, sizeof(s->path), "%s/scales.bin", state_dir);
  return 0;
}

void attnd_scales_free(attnd_scales_t *s) {
  if (s->l) {
    for (int i = 0; i < s->layers; i++) {
      free(s->l[i].k_scale);
      free(s->l[i].v_scale);
      free(s->l[i].k_zero);
      free(s->l[i].v_zero);
    }
    free(s->l);
  }
  memset(s, 0, sizeof(*s));
}

/* Checks one fp32 tensor of shape [kv_heads] or [kv_heads, head_dim]; sets
 * *per_channel. Values must lie in [lo, hi] (scales: finite > 0). */
static int check_tensor(const attnd_scales_t *s, const attnd_tensor_t *t, const char *name,
                        int is_zero, int *per_channel, char *msg, size_t msglen) {
  if (!t->present) {
    snprintf(msg, msglen, "%s missing", name);
    return ATTND_EINVAL;
  }
  if (t->dtype != ATTND_DT_FP32) {
    snprintf(msg, msglen, "%s: dtype must be FP32", name);
    return ATTND_EINVAL;
  }
  int pc;
  if (t->ndim == 1 && t->shape[0] == (uint32_t)s->kv_heads)
    pc = 0;
  else if (t->ndim == 2 && t->shape[0] == (uint32_t)s->kv_heads &&
           t->shape[1] == (uint32_t)s->head_dim)
    pc = 1;
  else {
    snprintf(msg, msglen, "%s: shape must be [%d] or [%d, %d]", name, s->kv_heads, s->kv_heads,
             s->head_dim);
    return ATTND_EINVAL;
  }
  size_t n = nscales(s, pc);
  if (t->nbytes != n * sizeof(float) || !t->data) {
    snprintf(msg, msglen, "%s: %zu bytes for %zu fp32 values", name, t->nbytes, n);
    return ATTND_EINVAL;
  }
  for (size_t i = 0; i < n; i++) {
    float x;
    memcpy(&x, t->data + i * sizeof(float), sizeof(float));
    int ok = is_zero ? (x >= 0.0f && x <= 15.0f) : (isfinite(x) && x > 0.0f);
    if (!ok) {
      snprintf(msg, msglen, "%s[%zu] = %g: %s", name, i, (double)x,
               is_zero ? "zero points must lie in [0, 15]" : "scales must be finite and > 0");
      return ATTND_EINVAL;
    }
  }
  *per_channel = pc;
  return 0;
}

int attnd_scales_validate(const attnd_scales_t *s, const attnd_scales_req_t *req, char *msg,
                          size_t msglen) {
  if (req->layer >= (uint32_t)s->layers) {
    snprintf(msg, msglen, "layer %u >= layers %d", req->layer, s->layers);
    return ATTND_EINVAL;
  }
  if (!attnd_kv_type_static(s->kv)) {
    snprintf(msg, msglen, "kv cache type %s has no static scales", attnd_kv_type_name(s->kv));
    return ATTND_EINVAL;
  }
  int pk, pv, rc;
  if ((rc = check_tensor(s, &req->k_scale, "k_scale", 0, &pk, msg, msglen)) ||
      (rc = check_tensor(s, &req->v_scale, "v_scale", 0, &pv, msg, msglen)))
    return rc;
  if (pk != pv) {
    snprintf(msg, msglen, "k_scale and v_scale must have the same shape");
    return ATTND_EINVAL;
  }
  if (s->kv == ATTND_KV_INT4) {
    int zk, zv;
    if (!pk) {
      snprintf(msg, msglen, "int4 needs per-channel scales [%d, %d]", s->kv_heads, s->head_dim);
      return ATTND_EINVAL;
    }
    if ((rc = check_tensor(s, &req->k_zero, "k_zero", 1, &zk, msg, msglen)) ||
        (rc = check_tensor(s, &req->v_zero, "v_zero", 1, &zv, msg, msglen)))
      return rc;
    if (!zk || !zv) {
      snprintf(msg, msglen, "int4 zero points must be [%d, %d]", s->kv_heads, s->head_dim);
      return ATTND_EINVAL;
    }
  } else if (req->k_zero.present || req->v_zero.present) {
    snprintf(msg, msglen, "kv cache type %s has no zero points", attnd_kv_type_name(s->kv));
    return ATTND_EINVAL;
  }
  return 0;
}

uint64_t attnd_scales_apply(attnd_scales_t *s, const attnd_scales_req_t *req) {
  attnd_layer_scales_t *l = &s->l[req->layer];
  l->per_channel = req->k_scale.ndim == 2;
  size_t n = nscales(s, l->per_channel);
  memcpy(l->k_scale, req->k_scale.data, n * sizeof(float));
  memcpy(l->v_scale, req->v_scale.data, n * sizeof(float));
  if (s->kv == ATTND_KV_INT4) {
    memcpy(l->k_zero, req->k_zero.data, n * sizeof(float));
    memcpy(l->v_zero, req->v_zero.data, n * sizeof(float));
  }
  l->present = 1;
  l->version = ++s->last_version;
  return l->version;
}

void attnd_scales_versions(const attnd_scales_t *s, uint64_t *v) {
  for (int i = 0; i < s->layers; i++)
    v[i] = s->l[i].present ? s->l[i].version : 0;
}

/* ---- SetScales ---- */

void attnd_scales_update_fingerprint(attnd_engine_t *e) {
  uint64_t *v = attnd_xcalloc((size_t)e->layers, sizeof(uint64_t));
  attnd_scales_versions(&e->sc, v);
  attnd_h128_t fp = attnd_prefix_fingerprint(&e->shape, e->layers, e->cfg.model_id, v);
  /* The per-layer variants (docs/numerics.md), only when there are any, so
   * that a model without them keeps the fingerprint it always had. */
  const attnd_config_t *c = &e->cfg;
  if (e->shape.softcap > 0.0f || c->nlayer_windows > 0 || e->sk.enabled) {
    size_t n = 0, cap = 4 + (size_t)c->nlayer_windows + 2 * (size_t)e->layers;
    uint64_t *mix = attnd_xcalloc(cap, sizeof(uint64_t));
    uint32_t capbits;
    memcpy(&capbits, &e->shape.softcap, sizeof(capbits));
    mix[n++] = capbits;
    mix[n++] = (uint64_t)c->nlayer_windows;
    for (int i = 0; i < c->nlayer_windows; i++)
      mix[n++] = (uint64_t)(uint32_t)c->layer_windows[i];
    mix[n++] = (uint64_t)e->sk.enabled;
    for (int l = 0; e->sk.enabled && l < e->layers; l++)
      mix[n++] = e->sk.l[l].present ? e->sk.l[l].version : 0;
    fp = attnd_prefix_fingerprint_mix(fp, mix, n * sizeof(uint64_t));
    free(mix);
  }
  attnd_prefix_set_fingerprint(e->px, fp);
  free(v);
}

void attnd_scales_submit(attnd_engine_t *e, int layer) {
  const attnd_layer_scales_t *ls = &e->sc.l[layer];
  size_t n = (size_t)e->shape.kv_heads * (ls->per_channel ? (size_t)e->shape.head_dim : 1);
  attnd_ejob_t *j = attnd_ejob_new(e, EJ_SCALES, layer);
  j->sk = attnd_xcalloc(n, sizeof(float));
  j->sv = attnd_xcalloc(n, sizeof(float));
  memcpy(j->sk, ls->k_scale, n * sizeof(float));
  memcpy(j->sv, ls->v_scale, n * sizeof(float));
  if (ls->k_zero) {
    j->zk = attnd_xcalloc(n, sizeof(float));
    j->zv = attnd_xcalloc(n, sizeof(float));
    memcpy(j->zk, ls->k_zero, n * sizeof(float));
    memcpy(j->zv, ls->v_zero, n * sizeof(float));
  }
  j->job.k_scale = j->sk;
  j->job.v_scale = j->sv;
  j->job.k_zero = j->zk;
  j->job.v_zero = j->zv;
  j->job.per_channel = ls->per_channel;
  attnd_ejob_submit(e, j);
}

/* 1 when layer l holds KV: a session's KV there, or any cached block (a
 * published block spans every layer). */
static int layer_holds_kv(attnd_engine_t *e, uint32_t l) {
  int holds = attnd_prefix_count(e->px) > 0;
  ATTND_LIST_FOREACH(it, nx, &e->slist)
  holds |= ATTND_LIST_DATA(it, attnd_session_t, link)->len[l] > 0;
  return holds;
}

int attnd_scales_check(attnd_engine_t *e, const attnd_scales_req_t *req, char *msg, size_t msglen) {
  int rc = attnd_scales_validate(&e->sc, req, msg, msglen);
  if (rc)
    return rc;
  if (!req->drop_cached_kv && layer_holds_kv(e, req->layer)) {
    snprintf(msg, msglen,
             "layer %u holds KV (sessions or cached blocks); set drop_cached_kv to drop it",
             req->layer);
    return ATTND_EPRECOND;
  }
  return 0;
}

int attnd_scales_snapshot(attnd_engine_t *e, const attnd_scales_req_t *req, uint8_t **buf,
                          size_t *len) {
  /* The table as the call leaves it: applied to the live table, serialized,
   * and put back, all on the loop thread, so nobody sees the new scales
   * before they are on disk. */
  attnd_scales_t *sc = &e->sc;
  attnd_layer_scales_t *l = &sc->l[req->layer], keep = *l;
  size_t n = (size_t)sc->kv_heads * (size_t)sc->head_dim;
  float *old = attnd_xcalloc(4 * n, sizeof(float));
  memcpy(old, l->k_scale, n * sizeof(float));
  memcpy(old + n, l->v_scale, n * sizeof(float));
  if (l->k_zero) {
    memcpy(old + 2 * n, l->k_zero, n * sizeof(float));
    memcpy(old + 3 * n, l->v_zero, n * sizeof(float));
  }
  uint64_t last = sc->last_version;
  attnd_scales_apply(sc, req);
  int rc = attnd_scales_serialize(sc, buf, len);
  memcpy(l->k_scale, old, n * sizeof(float));
  memcpy(l->v_scale, old + n, n * sizeof(float));
  if (l->k_zero) {
    memcpy(l->k_zero, old + 2 * n, n * sizeof(float));
    memcpy(l->v_zero, old + 3 * n, n * sizeof(float));
  }
  l->present = keep.present;
  l->per_channel = keep.per_channel;
  l->version = keep.version;
  sc->last_version = last;
  free(old);
  return rc;
}

void attnd_scales_commit(attnd_engine_t *e, const attnd_scales_req_t *req, attnd_engine_done_cb cb,
                         void *arg) {
  uint32_t l = req->layer;
  if (req->drop_cached_kv && layer_holds_kv(e, l)) {
    /* Cached blocks hold every layer; with new scales for one of them none
     * can be reused. Sessions keep their blocks and recompute this layer. */
    attnd_prefix_drop_all(e->px);
    ATTND_LIST_FOREACH(it, nx, &e->slist) {
      attnd_session_t *s = ATTND_LIST_DATA(it, attnd_session_t, link);
      s->npub = 0;
      s->len[l] = 0;
      s->cons[l] = 0;
    }
  }
  uint64_t version = attnd_scales_apply(&e->sc, req);
  attnd_scales_update_fingerprint(e);
  attnd_scales_submit(e, (int)l);
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.version = version;
  cb(arg, &r);
}

/* sinks.c: attention sink logits (internal.h, docs/numerics.md): the
 * per-layer table, its checks and versions, its file <state_dir>/sinks.bin,
 * and SetSinks in the three steps of SetScales (queue.c): checked, the table
 * as it will be persisted (written on the worker pool while the call holds
 * the admission queue's head), then applied, the prefix fingerprint renewed
 * and the backend's copy updated in the layer's job order. A call whose file
 * cannot be written changes nothing. Sinks change no cached KV (they enter
 * only the softmax), so no layer's KV is dropped. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "internal.h"

static const char MAGIC[8] = {'A', 'T', 'T', 'N', 'D', 'S', 'K', '1'};

int attnd_sinks_init(attnd_sinks_t *s, int enabled, int layers, int q_heads,
                     const char *state_dir) {
  memset(s, 0, sizeof(*s));
  s->enabled = enabled;
  s->layers = layers;
  s->q_heads = q_heads;
  if (!enabled)
    return 0;
  s->l = calloc((size_t)layers, sizeof(*s->l));
  if (!s->l)
    return ATTND_ENOMEM;
  for (int i = 0; i < layers; i++)
    if (!(s->l[i].v = calloc((size_t)q_heads, sizeof(float)))) {
      attnd_sinks_free(s);
      return ATTND_ENOMEM;
    }
  if (state_dir && state_dir[0])
    snprintf(s->path, sizeof(s->path), "%s/sinks.bin", state_dir);
  return 0;
}

void attnd_sinks_free(attnd_sinks_t *s) {
  if (s->l)
    for (int i = 0; i < s->layers; i++)
      free(s->l[i].v);
  free(s->l);
  memset(s, 0, sizeof(*s));
}

int attnd_sinks_validate(const attnd_sinks_t *s, const attnd_sinks_req_t *req, char *msg,
                         size_t msglen) {
  if (!s->enabled) {
    snprintf(msg, msglen, "the daemon serves no attention sinks (start it with attention-sinks)");
    return ATTND_EINVAL;
  }
  if (req->layer >= (uint32_t)s->layers) {
    snprintf(msg, msglen, "layer %u >= layers %d", req->layer, s->layers);
    return ATTND_EINVAL;
  }
  const attnd_tensor_t *t = &req->sinks;
  if (!t->present) {
    snprintf(msg, msglen, "sinks missing");
    return ATTND_EINVAL;
  }
  if (t->dtype != ATTND_DT_FP32) {
    snprintf(msg, msglen, "sinks: dtype must be FP32");
    return ATTND_EINVAL;
  }
  if (t->ndim != 1 || t->shape[0] != (uint32_t)s->q_heads) {
    snprintf(msg, msglen, "sinks: shape must be [%d] (q heads)", s->q_heads);
    return ATTND_EINVAL;
  }
  if (t->nbytes != (size_t)s->q_heads * sizeof(float) || !t->data) {
    snprintf(msg, msglen, "sinks: %zu bytes for %d fp32 values", t->nbytes, s->q_heads);
    return ATTND_EINVAL;
  }
  for (int i = 0; i < s->q_heads; i++) {
    float x;
    memcpy(&x, t->data + (size_t)i * sizeof(float), sizeof(float));
    if (!isfinite(x)) {
      snprintf(msg, msglen, "sinks[%d] = %g: sink logits must be finite", i, (double)x);
      return ATTND_EINVAL;
    }
  }
  return 0;
}

uint64_t attnd_sinks_apply(attnd_sinks_t *s, const attnd_sinks_req_t *req) {
  attnd_layer_sinks_t *l = &s->l[req->layer];
  memcpy(l->v, req->sinks.data, (size_t)s->q_heads * sizeof(float));
  l->present = 1;
  l->version = ++s->last_version;
  return l->version;
}

/* ---- the file: magic, layers, q_heads, last version, per layer (present,
 * version, values when present), XXH64 of everything before it ---- */

static void put(uint8_t **p, const void *d, size_t n) {
  memcpy(*p, d, n);
  *p += n;
}

int attnd_sinks_serialize(const attnd_sinks_t *s, uint8_t **buf, size_t *len) {
  size_t n = sizeof(MAGIC) + 8 + 8 + 8;
  for (int i = 0; i < s->layers; i++)
    n += 12 + (s->l[i].present ? (size_t)s->q_heads * sizeof(float) : 0);
  uint8_t *b = malloc(n), *p = b;
  if (!b)
    return ATTND_ENOMEM;
  uint32_t layers = (uint32_t)s->layers, qh = (uint32_t)s->q_heads;
  put(&p, MAGIC, sizeof(MAGIC));
  put(&p, &layers, 4);
  put(&p, &qh, 4);
  put(&p, &s->last_version, 8);
  for (int i = 0; i < s->layers; i++) {
    uint32_t present = (uint32_t)s->l[i].present;
    put(&p, &present, 4);
    put(&p, &s->l[i].version, 8);
    if (present)
      put(&p, s->l[i].v, (size_t)s->q_heads * sizeof(float));
  }
  uint64_t sum = XXH64(b, (size_t)(p - b), 0);
  put(&p, &sum, 8);
  *buf = b;
  *len = n;
  return 0;
}

int attnd_sinks_load(attnd_sinks_t *s, char *err, size_t errlen) {
  if (!s->enabled || !s->path[0])
    return 0;
  FILE *f = fopen(s->path, "rb");
  if (!f)
    return errno == ENOENT ? 0 : ATTND_EIO;
  /* The file's size is known from the model: layers * (12 + 4 q_heads) + 40 at most. */
  size_t cap = (size_t)s->layers * (12 + 4 * (size_t)s->q_heads) + 64, len;
  uint8_t *buf = malloc(cap + 1);
  if (!buf) {
    fclose(f);
    return ATTND_ENOMEM;
  }
  len = fread(buf, 1, cap + 1, f);
  fclose(f);
  int rc = 1;
  uint32_t layers, qh;
  uint64_t last, sum;
  if (len > cap || len < sizeof(MAGIC) + 8 + 8 + 8) {
    snprintf(err, errlen, "%s: not a sinks file for this model; ignored", s->path);
    goto out;
  }
  memcpy(&sum, buf + len - 8, 8);
  if (XXH64(buf, len - 8, 0) != sum) {
    snprintf(err, errlen, "%s: checksum mismatch; ignored", s->path);
    goto out;
  }
  memcpy(&layers, buf + 8, 4);
  memcpy(&qh, buf + 12, 4);
  memcpy(&last, buf + 16, 8);
  if (memcmp(buf, MAGIC, sizeof(MAGIC)) != 0 || layers != (uint32_t)s->layers ||
      qh != (uint32_t)s->q_heads) {
    snprintf(err, errlen, "%s: written for another model shape; ignored", s->path);
    goto out;
  }
  /* Walk once to check the layout, then once to fill the live table. */
  for (int pass = 0; pass < 2; pass++) {
    size_t off = 24, end = len - 8;
    for (int i = 0; i < s->layers; i++) {
      uint32_t present;
      uint64_t ver;
      if (off + 12 > end)
        goto truncated;
      memcpy(&present, buf + off, 4);
      memcpy(&ver, buf + off + 4, 8);
      off += 12;
      if (!present)
        continue;
      size_t nb = (size_t)s->q_heads * sizeof(float);
      if (off + nb > end)
        goto truncated;
      if (pass == 1) {
        memcpy(s->l[i].v, buf + off, nb);
        s->l[i].present = 1;
        s->l[i].version = ver;
      }
      off += nb;
    }
    if (off != end)
      goto truncated;
  }
  s->last_version = last;
  rc = 0;
  goto out;
truncated:
  snprintf(err, errlen, "%s: malformed layer table; ignored", s->path);
out:
  free(buf);
  return rc;
}

/* ---- SetSinks ---- */

void attnd_sinks_submit(attnd_engine_t *e, int layer) {
  attnd_ejob_t *j = attnd_ejob_new(e, EJ_SINKS, layer);
  j->sk = attnd_xcalloc((size_t)e->sk.q_heads, sizeof(float));
  memcpy(j->sk, e->sk.l[layer].v, (size_t)e->sk.q_heads * sizeof(float));
  j->job.sinks = j->sk;
  attnd_ejob_submit(e, j);
}

int attnd_sinks_check(attnd_engine_t *e, const attnd_sinks_req_t *req, char *msg, size_t msglen) {
  return attnd_sinks_validate(&e->sk, req, msg, msglen);
}

int attnd_sinks_snapshot(attnd_engine_t *e, const attnd_sinks_req_t *req, uint8_t **buf,
                         size_t *len) {
  /* The table as the call leaves it, serialized, then put back: nobody sees
   * the new sinks before they are on disk. */
  attnd_sinks_t *s = &e->sk;
  attnd_layer_sinks_t *l = &s->l[req->layer], keep = *l;
  float *old = attnd_xcalloc((size_t)s->q_heads, sizeof(float));
  memcpy(old, l->v, (size_t)s->q_heads * sizeof(float));
  uint64_t last = s->last_version;
  attnd_sinks_apply(s, req);
  int rc = attnd_sinks_serialize(s, buf, len);
  memcpy(l->v, old, (size_t)s->q_heads * sizeof(float));
  l->present = keep.present;
  l->version = keep.version;
  s->last_version = last;
  free(old);
  return rc;
}

void attnd_sinks_commit(attnd_engine_t *e, const attnd_sinks_req_t *req, attnd_engine_done_cb cb,
                        void *arg) {
  uint64_t version = attnd_sinks_apply(&e->sk, req);
  attnd_scales_update_fingerprint(e);
  attnd_sinks_submit(e, (int)req->layer);
  attnd_result_t r;
  memset(&r, 0, sizeof(r));
  r.version = version;
  cb(arg, &r);
}

int attnd_sinks_ready(const attnd_engine_t *e, uint32_t layer, char *msg, size_t msglen) {
  if (!e->sk.enabled || e->sk.l[layer].present)
    return 0;
  snprintf(msg, msglen, "layer %u has no attention sinks yet (SetSinks)", layer);
  return ATTND_EPRECOND;
}

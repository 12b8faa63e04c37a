/* step.c: admission of one Step (internal.h, docs/sessions.md).
 *
 * A step is admitted in four stages, on the loop thread:
 *
 *   check        everything that can fail without changing anything: the
 *                plan (or the inline items, built into a one-layer plan), the
 *                tensors' dtypes and shapes, the layer's static scales, the
 *                finiteness scan, and per item the positions and token ids;
 *   reserve      what the step needs that may run out: its output buffers,
 *                then its blocks (all or nothing; copy-on-write pairs are
 *                submitted for every layer and the plans it replaces end);
 *   build batch  the backend job: one attnd_kbatch_t for the layer, with the
 *                items' block tables and mask intervals, holding a reference
 *                on every block it reads or writes;
 *   commit       the sessions' state moves (len, consistency, token ids),
 *                full blocks are published, the job goes to the backend.
 *
 * A failure in check or reserve answers the call and leaves every session
 * and the pool as they were (blocks evicted from the prefix cache to make
 * room stay evicted: nothing a session sees). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* One step on its way through admission. */
typedef struct {
  attnd_engine_t *e;
  uint64_t identity;
  const attnd_step_req_t *req;
  attnd_engine_done_cb cb;
  void *arg;
  attnd_plan_t *p;   /* the named plan, or inl */
  attnd_plan_t *inl; /* the inline items' plan (owned) */
  attnd_scan_t scan; /* its copies are owned until the job takes them */
  int scanned;       /* scan holds a result */
  void *out;
  int out_pinned; /* attnd_engine_host_alloc's */
  float *lse;
  size_t out_bytes, lse_bytes;
  attnd_cowlist_t cow;
  attnd_ejob_t *j;
  char msg[200];
} admit_t;

static int check_tensor(const attnd_tensor_t *t, const char *name, attnd_dtype_t dtype,
                        uint32_t rows, int heads, int dim, char *msg, size_t msglen) {
  if (!t->present || !t->data) {
    snprintf(msg, msglen, "%s missing", name);
    return ATTND_EINVAL;
  }
  if (t->dtype != dtype) {
    snprintf(msg, msglen, "%s: dtype %d, the activation dtype is %d", name, (int)t->dtype,
             (int)dtype);
    return ATTND_EINVAL;
  }
  if (t->ndim != 3 || t->shape[0] != rows || t->shape[1] != (uint32_t)heads ||
      t->shape[2] != (uint32_t)dim) {
    snprintf(msg, msglen, "%s: shape must be [%u, %d, %d]", name, rows, heads, dim);
    return ATTND_EINVAL;
  }
  if (t->nbytes != (size_t)rows * heads * dim * 2) {
    snprintf(msg, msglen, "%s: %zu bytes for shape [%u, %d, %d]", name, t->nbytes, rows, heads,
             dim);
    return ATTND_EINVAL;
  }
  return 0;
}

/* The layer's sliding window as the kernels apply it to every item
 * (attnd_kbatch_t.window; 0: a full layer), fixed at start. Attend-only
 * pieces carry it in their restated masks too (qonly.c): their rows sit
 * earlier in the kernels' coordinates than in the session's, so the
 * kernels' own window is looser than the true one there and the mask
 * decides. */
static int32_t step_layer_window(const attnd_engine_t *e, uint32_t layer) {
  return attnd_config_layer_window(&e->cfg, (int)layer);
}

/* The plan the step runs: the one it names, or its inline items. */
static int check_plan(admit_t *a) {
  attnd_engine_t *e = a->e;
  const attnd_step_req_t *req = a->req;
  if (req->plan) {
    a->p = attnd_idmap_get(&e->plans, req->plan);
    if (!a->p || a->p->identity != a->identity) {
      snprintf(a->msg, sizeof(a->msg), "plan %016llx has ended (or never existed)",
               (unsigned long long)req->plan);
      return ATTND_EPRECOND;
    }
    return 0;
  }
  int rc =
      attnd_plan_build(e, a->identity, req->items, req->nitems, &a->inl, a->msg, sizeof(a->msg));
  a->p = a->inl;
  return rc;
}

/* A step over client device memory (engine.h req->device): where out and
 * lse go, against the plan's rows. */
static int check_device_outputs(admit_t *a) {
  const attnd_kshape_t *sh = &a->e->shape;
  const attnd_step_req_t *req = a->req;
  const attnd_plan_t *p = a->p;
  const attnd_tensor_t *o = &req->out, *l = &req->lse;
  attnd_dtype_t odt = req->fp32_out ? ATTND_DT_FP32 : sh->dtype;
  size_t oes = req->fp32_out ? 4 : 2;
  if (p->Tq == 0) {
    if (o->present || l->present) {
      snprintf(a->msg, sizeof(a->msg), "out_ref/lse_ref given but every item is kv_only");
      return ATTND_EINVAL;
    }
    return 0;
  }
  if (!o->present || o->dtype != odt || o->ndim != 3 || o->shape[0] != p->Tq ||
      o->shape[1] != (uint32_t)sh->q_heads || o->shape[2] != (uint32_t)sh->head_dim ||
      o->nbytes != (size_t)p->Tq * sh->q_heads * sh->head_dim * oes) {
    snprintf(a->msg, sizeof(a->msg), "out_ref: must be %s [%u, %d, %d]",
             req->fp32_out ? "FP32" : "the activation dtype", p->Tq, sh->q_heads, sh->head_dim);
    return ATTND_EINVAL;
  }
  if (!req->want_lse != !l->present) {
    snprintf(a->msg, sizeof(a->msg), "lse_ref: given exactly when want_lse");
    return ATTND_EINVAL;
  }
  if (l->present &&
      (l->dtype != ATTND_DT_FP32 || l->ndim != 2 || l->shape[0] != p->Tq ||
       l->shape[1] != (uint32_t)sh->q_heads || l->nbytes != (size_t)p->Tq * sh->q_heads * 4)) {
    snprintf(a->msg, sizeof(a->msg), "lse_ref: must be FP32 [%u, %d]", p->Tq, sh->q_heads);
    return ATTND_EINVAL;
  }
  return 0;
}

/* q, k and v against the plan's rows, and the layer's static scales and sinks. */
static int check_tensors(admit_t *a) {
  const attnd_kshape_t *sh = &a->e->shape;
  const attnd_step_req_t *req = a->req;
  const attnd_plan_t *p = a->p;
  int rc;
  /* Only attend-only items: no k or v rows, and none need be sent. */
  int no_kv = p->T == 0 && (!req->k.present || req->k.nbytes == 0) &&
              (!req->v.present || req->v.nbytes == 0);
  if (!no_kv && ((rc = check_tensor(&req->k, "k", sh->dtype, p->T, sh->kv_heads, sh->head_dim,
                                    a->msg, sizeof(a->msg))) ||
                 (rc = check_tensor(&req->v, "v", sh->dtype, p->T, sh->kv_heads, sh->head_dim,
                                    a->msg, sizeof(a->msg)))))
    return rc;
  if (p->Tq > 0) {
    if ((rc = check_tensor(&req->q, "q", sh->dtype, p->Tq, sh->q_heads, sh->head_dim, a->msg,
                           sizeof(a->msg))))
      return rc;
  } else if (req->q.present && req->q.nbytes > 0) {
    snprintf(a->msg, sizeof(a->msg), "q given but every item is kv_only");
    return ATTND_EINVAL;
  }
  if (req->device && (rc = check_device_outputs(a)))
    return rc;
  if (attnd_kv_type_static(sh->kv) && !a->e->sc.l[req->layer].present) {
    snprintf(a->msg, sizeof(a->msg), "layer %u has no static scales for kv cache type %s",
             req->layer, attnd_kv_type_name(sh->kv));
    return ATTND_EPRECOND;
  }
  return attnd_sinks_ready(a->e, req->layer, a->msg, sizeof(a->msg));
}

/* Item i holds a value of tensor t (its magnitude pattern: bits) that is
 * non-finite or past the tensor's bound. */
static int bad_value(admit_t *a, uint32_t i, const char *t, uint32_t bits) {
  const attnd_kshape_t *sh = &a->e->shape;
  double x = attnd_scan_value(sh->dtype, bits);
  if (!isfinite(x)) {
    snprintf(a->msg, sizeof(a->msg), "item %u: %s holds a non-finite value (%s)", i, t,
             isnan(x) ? "NaN" : "infinity");
    return ATTND_EINVAL;
  }
  attnd_scan_bound_t b[3];
  attnd_scan_bounds(sh, &b[0], &b[1], &b[2]);
  const attnd_scan_bound_t *bt = &b[t[0] == 'q' ? 0 : t[0] == 'k' ? 1 : 2];
  snprintf(a->msg, sizeof(a->msg),
           "item %u: %s holds %.6g, past the bound |%s| <= %s (docs/numerics.md section 6)", i, t,
           x, t, bt->name);
  return ATTND_EINVAL;
}

/* Per item: the session is usable, the positions follow what the layer
 * holds, layers > 0 repeat layer 0's tokens, and no row is non-finite. */
static int check_items(admit_t *a) {
  const attnd_plan_t *p = a->p;
  uint32_t layer = a->req->layer, kv_row = 0, q_row = 0;
  const attnd_scan_t *sc = &a->scan;
  for (uint32_t i = 0; i < p->nitems; i++) {
    const attnd_pitem_t *it = &p->items[i];
    const attnd_session_t *s = it->s;
    if (s->broken) {
      snprintf(a->msg, sizeof(a->msg), "item %u: session %016llx lost its KV in a backend fault", i,
               (unsigned long long)s->id);
      return ATTND_EABORTED;
    }
    if (it->q_only) {
      /* Attend-only rows follow the keys the layer holds (docs/scale-out.md). */
      if (it->start < s->len[layer]) {
        snprintf(a->msg, sizeof(a->msg), "item %u: q_only start %u < len %u of layer %u", i,
                 s->base + it->start, s->base + s->len[layer], layer);
        return ATTND_EINVAL;
      }
      if (s->len[layer] == 0) {
        snprintf(a->msg, sizeof(a->msg), "item %u: q_only on a session holding no positions", i);
        return ATTND_EPRECOND;
      }
      if (it->kmask == ATTND_MASK_INTERVALS && step_layer_window(a->e, layer) > 0) {
        snprintf(a->msg, sizeof(a->msg),
                 "item %u: q_only with a custom mask on a sliding-window layer is not supported",
                 i);
        return ATTND_EINVAL;
      }
      int rc = 0;
      if (attnd_scan_row_in(sc->bad_q, q_row, it->n))
        rc = bad_value(a, i, "q", sc->bits_q);
      if (rc)
        return rc;
      q_row += it->n;
      continue;
    }
    if (it->start > s->len[layer]) {
      snprintf(a->msg, sizeof(a->msg), "item %u: start %u > len %u", i, s->base + it->start,
               s->base + s->len[layer]);
      return ATTND_EINVAL;
    }
    if (layer > 0 && it->start + it->n > s->len[0]) {
      snprintf(a->msg, sizeof(a->msg), "item %u: start+n %u > len %u of layer 0 (layer 0 leads)", i,
               it->start + it->n, s->len[0]);
      return ATTND_EINVAL;
    }
    if (layer > 0)
      for (uint32_t t = 0; t < it->n; t++)
        if (it->tokens[t] != s->tokens[it->start + t]) {
          snprintf(a->msg, sizeof(a->msg),
                   "item %u: token %u at position %u differs from layer 0's %u", i, it->tokens[t],
                   it->start + t, s->tokens[it->start + t]);
          return ATTND_EINVAL;
        }
    /* The scan recorded the first bad row of each tensor; no item before
     * this one holds a bad row, so this item fails exactly when it holds
     * that row (the same answer as scanning item by item). */
    int rc = 0;
    if (attnd_scan_row_in(sc->bad_k, kv_row, it->n))
      rc = bad_value(a, i, "k", sc->bits_k);
    else if (attnd_scan_row_in(sc->bad_v, kv_row, it->n))
      rc = bad_value(a, i, "v", sc->bits_v);
    else if (it->has_q && attnd_scan_row_in(sc->bad_q, q_row, it->n))
      rc = bad_value(a, i, "q", sc->bits_q);
    if (rc)
      return rc;
    kv_row += it->n;
    if (it->has_q)
      q_row += it->n;
  }
  return 0;
}

static int step_check(admit_t *a) {
  int rc;
  if ((rc = check_plan(a)) || (rc = check_tensors(a)))
    return rc;
  if (a->req->device && !a->scanned) {
    /* Never: device steps are checked on the device before admission. */
    snprintf(a->msg, sizeof(a->msg),
             "a step over client device memory reached admission unchecked");
    return ATTND_EINTERNAL;
  }
  if (a->scan.err) {
    snprintf(a->msg, sizeof(a->msg), "the device check of q, k and v could not run: %s",
             attnd_strerror(a->scan.err));
    return a->scan.err;
  }
  if (!a->scanned) {
    /* Small: scanned here, on the loop thread, like the checks around it. */
    attnd_scan_step(&a->e->shape, a->req, a->e->be->any_alignment, &a->scan);
    a->scanned = 1;
  }
  return check_items(a);
}

/* Output buffers first: a large prefill's output may not fit in memory,
 * which must fail the call before it changes anything. Then the blocks. */
static int step_reserve(admit_t *a) {
  attnd_engine_t *e = a->e;
  const attnd_kshape_t *sh = &e->shape;
  attnd_plan_t *p = a->p;
  size_t qrow = (size_t)sh->q_heads * sh->head_dim;
  a->out_bytes = (size_t)p->Tq * qrow * (a->req->fp32_out ? 4 : 2);
  a->lse_bytes = a->req->want_lse ? (size_t)p->Tq * sh->q_heads * sizeof(float) : 0;
  if (a->out_bytes && !a->req->device) {
    /* Pinned on the CUDA backend when large: D2H lands in it, and the
     * transport writes it to the socket from there. */
    a->out = attnd_engine_host_alloc(e, a->out_bytes, &a->out_pinned);
    a->lse = a->lse_bytes ? calloc(1, a->lse_bytes) : NULL;
    if (!a->out || (a->lse_bytes && !a->lse)) {
      snprintf(a->msg, sizeof(a->msg), "cannot allocate %zu bytes of output",
               a->out_bytes + a->lse_bytes);
      return ATTND_ENOMEM;
    }
  }
  int rc = attnd_cache_reserve(e, p, &a->cow, a->msg, sizeof(a->msg));
  if (rc)
    return rc;
  /* Reserved: from here on the call changes state. The copies go out ahead
   * of the step in every layer, and the sessions are this step's: an inline
   * step ends their live plans, a plan's step marks its layer. */
  attnd_cache_submit_cow(e, &a->cow);
  uint32_t layer = a->req->layer;
  if (a->inl)
    for (uint32_t i = 0; i < p->nitems; i++)
      attnd_session_end_plan(e, p->items[i].s);
  else if (!p->stepped[layer]) {
    p->stepped[layer] = 1;
    p->nstepped++;
  }
  return 0;
}

/* Item i of the job's batch: its rows, mask and block table (meta from mo
 * on, then its intervals), a reference on each of its blocks. */
static void batch_item(attnd_engine_t *e, attnd_ejob_t *j, uint32_t i, const attnd_pitem_t *it,
                       uint32_t q_row, uint32_t kv_row, size_t *mo) {
  attnd_kbatch_t *b = &j->job.batch;
  const attnd_session_t *s = it->s;
  uint32_t kv_len = it->start + it->n, nb = attnd_engine_nblocks(e, kv_len);
  attnd_kitem_t *k = &j->kitems[i];
  k->start = (int32_t)it->start;
  k->n = (int32_t)it->n;
  k->q_row = it->has_q ? (int32_t)q_row : -1;
  k->kv_row = (int32_t)kv_row;
  k->mask_kind = it->kmask;
  k->mask_param = it->mask_param;
  k->causal = it->causal;
  k->block_table = (int32_t)*mo;
  k->pos_base = (int32_t)s->base;
  /* The layer's sinks join the softmax of sessions whose first position is
   * 0; a split-context part that starts later leaves the flag clear, so that
   * merging parts by lse counts each sink once (docs/numerics.md). Without
   * sinks set for the layer the flag is inert. */
  k->flags = attnd_session_item_flags(s);
  uint32_t b0 = it->start / e->bs; /* the first block it writes */
  for (uint32_t bi = 0; bi < nb; bi++) {
    j->meta[(*mo)++] = s->table[bi];
    j->refs[j->nrefs++] = s->table[bi];
    attnd_blocks_ref(&e->pool, s->table[bi], 0);
    if (bi >= b0)
      attnd_sched_write(j, s->table[bi]);
    else if (it->has_q) /* only items with q read their older blocks */
      attnd_sched_read(j, s->table[bi]);
  }
  if (it->intervals) {
    k->intervals = (int32_t)*mo;
    memcpy(&j->meta[*mo], it->intervals, 4 * (size_t)kv_len * sizeof(int32_t));
    *mo += 4 * (size_t)kv_len;
  }
  if ((int32_t)kv_len > b->max_kv_len)
    b->max_kv_len = (int32_t)kv_len;
  b->kv_sum += kv_len;
  if ((int32_t)it->n > b->max_n)
    b->max_n = (int32_t)it->n;
}

/* The job: items, block tables and intervals in meta, the tensors, outputs.
 * Takes a reference on every block an item reads or writes. */
static void step_build_batch(admit_t *a) {
  attnd_engine_t *e = a->e;
  const attnd_kshape_t *sh = &e->shape;
  const attnd_step_req_t *req = a->req;
  attnd_plan_t *p = a->p;
  attnd_ejob_t *j = attnd_ejob_new(e, EJ_STEP, (int)req->layer);
  a->j = j;
  j->cb = a->cb;
  j->arg = a->arg;
  size_t nmeta = 0, nrefs = 0, nw = 0, nr = 0, nk = 0;
  const int32_t window = step_layer_window(e, req->layer);
  for (uint32_t i = 0; i < p->nitems; i++) {
    const attnd_pitem_t *it = &p->items[i];
    if (it->q_only) {
      uint32_t nb = attnd_engine_nblocks(e, it->s->len[req->layer]);
      nmeta += nb + attnd_qonly_meta(it, req->layer, window); /* its block table, its masks */
      nrefs += nb;
      nr += nb;
      nk += attnd_qonly_pieces(it, req->layer);
      continue;
    }
    nk++;
    uint32_t kv_len = p->items[i].start + p->items[i].n, b0 = p->items[i].start / e->bs;
    nmeta += attnd_engine_nblocks(e, kv_len) + (p->items[i].intervals ? 4 * (size_t)kv_len : 0);
    nrefs += attnd_engine_nblocks(e, kv_len);
    nw += attnd_engine_nblocks(e, kv_len) - b0;
    nr += p->items[i].has_q ? b0 : 0;
  }
  attnd_sched_reserve(j, (uint32_t)nw, (uint32_t)nr);
  j->kitems = attnd_xcalloc(nk, sizeof(attnd_kitem_t));
  j->sessions = attnd_xcalloc(p->nitems, sizeof(uint64_t));
  j->nsessions = p->nitems;
  j->meta = attnd_xcalloc(nmeta, sizeof(int32_t));
  j->refs = attnd_xcalloc(nrefs, sizeof(int32_t));
  attnd_kbatch_t *b = &j->job.batch;
  size_t mo = 0;
  uint32_t kv_row = 0, q_row = 0, ki = 0;
  for (uint32_t i = 0; i < p->nitems; i++) {
    if (p->items[i].q_only) {
      q_row += p->items[i].n;
      continue;
    }
    batch_item(e, j, ki++, &p->items[i], q_row, kv_row, &mo);
    j->sessions[i] = p->items[i].s->id;
    kv_row += p->items[i].n;
    if (p->items[i].has_q)
      q_row += p->items[i].n;
  }
  /* Attend-only pieces after every other item (attnd_kbatch_t.q_only_rows). */
  b->total_kv = (int32_t)p->T;
  int32_t qv = 0;
  q_row = 0;
  for (uint32_t i = 0; i < p->nitems; i++) {
    if (p->items[i].q_only)
      attnd_qonly_batch(e, j, i, &p->items[i], q_row, window, &ki, &qv, &mo);
    if (p->items[i].has_q)
      q_row += p->items[i].n;
  }
  b->q_only_rows = qv;
  size_t kvrow = (size_t)sh->kv_heads * sh->head_dim, qrow = (size_t)sh->q_heads * sh->head_dim;
  b->items = j->kitems;
  b->nitems = (int32_t)nk;
  /* The layer's window, fixed at start (docs/numerics.md): every backend
   * intersects it with each item's mask and reads only the window's keys. */
  b->window = window;
  b->meta = j->meta;
  j->job.nmeta = nmeta;
  b->total_q = (int32_t)p->Tq;
  b->total_kv = (int32_t)p->T;
  j->job.kv_bytes = (size_t)p->T * kvrow * 2;
  j->job.q_bytes = (size_t)p->Tq * qrow * 2;
  b->k = a->scan.k;
  b->v = a->scan.v;
  b->q = p->Tq ? (uint8_t *)a->scan.q : NULL; /* the backend may rotate q in place */
  j->kbuf = a->scan.kbuf;
  j->vbuf = a->scan.vbuf;
  j->qbuf = a->scan.qbuf;
  j->scan_us = a->scan.us;
  /* q, k and v are the pinned frame's own bytes unless the scan copied one. */
  j->job.inputs_pinned = req->pinned && !a->scan.qbuf && !a->scan.kbuf && !a->scan.vbuf;
  a->scan.kbuf = a->scan.vbuf = a->scan.qbuf = NULL;
  b->out_fp32 = req->fp32_out != 0;
  j->out_dtype = req->fp32_out ? ATTND_DT_FP32 : sh->dtype;
  j->job.out_bytes = a->out_bytes;
  j->out = a->out;
  j->out_pinned = a->out_pinned;
  j->job.outputs_pinned = a->out_pinned;
  b->out = j->out;
  j->job.lse_bytes = a->lse ? a->lse_bytes : 0;
  j->lse = a->lse;
  b->lse = j->lse;
  a->out = NULL;
  a->lse = NULL;
  if (req->device) {
    /* Client memory throughout (backend.h device_io): the kernels write
     * the outputs where the client has them; the result carries none. */
    j->job.device_io = 1;
    j->job.inputs_pinned = j->job.outputs_pinned = 0;
    b->out = p->Tq ? req->out.data : NULL;
    b->lse = req->want_lse && p->Tq ? (float *)req->lse.data : NULL;
    j->job.lse_bytes = b->lse ? a->lse_bytes : 0;
    j->job.done = req->done;
    j->job.done_value = req->done_value;
  }
}

/* One item's session moves: its layer's length, token ids at layer 0 (a
 * change lowers the other layers' consistency), the taint of non-causal
 * writes, and whatever is now full and consistent is published. */
static void commit_item(attnd_engine_t *e, uint32_t layer, const attnd_pitem_t *it) {
  attnd_session_t *s = it->s;
  if (it->q_only) { /* nothing written, nothing moves */
    s->last_used_ms = attnd_engine_now_ms(e);
    return;
  }
  uint32_t end = it->start + it->n;
  s->len[layer] = end;
  if (layer == 0) {
    attnd_session_reserve_tokens(s, end);
    uint32_t changed = UINT32_MAX;
    uint32_t known = s->ntok < end ? s->ntok : end;
    for (uint32_t pos = it->start; pos < known; pos++)
      if (s->tokens[pos] != it->tokens[pos - it->start]) {
        changed = pos;
        break;
      }
    memcpy(&s->tokens[it->start], it->tokens, (size_t)it->n * sizeof(uint32_t));
    if (s->ntok < end)
      s->ntok = end;
    /* Other layers computed from the old tokens are consistent only up to
     * the first changed one. */
    if (changed != UINT32_MAX)
      for (int l = 1; l < e->layers; l++)
        if (s->cons[l] > changed)
          s->cons[l] = changed;
    if (changed != UINT32_MAX && s->npub > changed / e->bs)
      s->npub = changed / e->bs; /* copies made by the reservation already */
    s->cons[0] = end;
  } else if (it->start <= s->cons[layer]) {
    s->cons[layer] = end;
  }
  if (s->cons[layer] > end)
    s->cons[layer] = end;
  if (!it->plain_causal && it->start < s->taint)
    s->taint = it->start;
  s->last_used_ms = attnd_engine_now_ms(e);
  attnd_cache_publish(e, s);
}

static void step_commit(admit_t *a) {
  attnd_engine_t *e = a->e;
  const attnd_plan_t *p = a->p;
  int any_prefill = 0;
  for (uint32_t i = 0; i < p->nitems; i++) {
    commit_item(e, a->req->layer, &p->items[i]);
    any_prefill |= p->items[i].n > 1;
  }
  e->st.steps++;
  e->st.tokens_written += p->T;
  a->j->decode = !any_prefill;
  if (any_prefill)
    e->st.prefill_steps++;
  else
    e->st.decode_steps++;
  attnd_ejob_submit(e, a->j);
  a->j = NULL;
}

void attnd_step_admit(attnd_engine_t *e, uint64_t identity, uint64_t conn,
                      const attnd_step_req_t *req, attnd_engine_done_cb cb, void *arg,
                      attnd_scan_t *sc) {
  admit_t a;
  memset(&a, 0, sizeof(a));
  a.e = e;
  a.identity = identity;
  a.req = req;
  a.cb = cb;
  a.arg = arg;
  if (sc) {
    a.scan = *sc;
    a.scanned = 1;
  }
  int rc;
  if ((rc = step_check(&a)) != 0 || (rc = step_reserve(&a)) != 0) {
    attnd_engine_host_free(e, a.out, a.out_pinned);
    free(a.lse);
    attnd_engine_host_free(e, a.scan.kbuf, 0);
    attnd_engine_host_free(e, a.scan.vbuf, 0);
    attnd_engine_host_free(e, a.scan.qbuf, 0);
    attnd_plan_free(a.inl);
    attnd_engine_answer(cb, arg, rc, "%s", a.msg);
    return;
  }
  step_build_batch(&a);
  step_commit(&a);
  attnd_plan_free(a.inl);
}

/* model_config.c: the model shape from a Hugging Face config.json
 * (--model-config; docs/operations.md section 1), read with jansson.
 *
 * The file is read into model_t, what it says about attention, in three
 * parts that mirror how transformers describes it, each its own function:
 *
 *   read_shape    layers, heads, KV heads, head_dim, context, dtype, model_type
 *   read_rope     rope_theta, the rotated fraction, rope_scaling /
 *                 rope_parameters (transformers 5), the family's rotary layout
 *   read_variant  what makes a model's attention differ from softmax(q k^T s) v
 *                 over every cached position: sliding windows, soft-capping,
 *                 sinks, latent (MLA) or ALiBi attention, a non-default scale
 *
 * A field that says the attention is something the daemon does not compute is
 * refused where it is read, naming the field: serving such a model would give
 * wrong answers without an error. Per-layer sliding windows (layer_types,
 * sliding_window_pattern, Gemma 2's alternation, one window everywhere),
 * soft-capping and gpt-oss's sinks become options. A RoPE the kernels do not
 * compute (scaled types, per-layer-type bases) is accepted only when rope is
 * set to none by a flag or file key: the client rotates q and k itself.
 *
 * Then apply_model() hands each value to the option it feeds, through the
 * same setter as flags and file keys (the same checks), unless that option was
 * set in the config file or on the command line. */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"
#include "internal.h"

typedef struct {
  /* shape */
  long layers, q_heads, kv_heads, head_dim, hidden, max_pos;
  const char *dtype; /* "bf16", "fp16" or NULL */
  const char *model_type;
  /* rope */
  const char *rope; /* "neox", "interleaved", "none" */
  double theta;
  double rotary_frac; /* 0: not given */
  long rotary_dim;    /* absolute (GPT-J's rotary_dim); 0: not given */
  /* variant */
  double softmax_scale;                      /* 0: 1/sqrt(head_dim) */
  const char *scale_field;                   /* where softmax_scale came from */
  int32_t windows[ATTND_CONFIG_MAX_WINDOWS]; /* the per-layer windows' period */
  int nwindows;                              /* 0: every layer full */
  const char *windows_field;
  double softcap; /* attn_logit_softcapping; 0: none */
  int sinks;      /* gpt_oss */
} model_t;

typedef struct {
  const char *path;
  char *err;
  size_t errlen;
  int rope_none; /* rope set to none by a flag or file key: the client applies RoPE */
} ctx_t;

#define FAIL(x, ...)                                                                               \
  do {                                                                                             \
    int n_ = snprintf((x)->err, (x)->errlen, "--model-config %s: ", (x)->path);                    \
    if (n_ > 0 && (size_t)n_ < (x)->errlen)                                                        \
      snprintf((x)->err + n_, (x)->errlen - (size_t)n_, __VA_ARGS__);                              \
    return ATTND_EINVAL;                                                                           \
  } while (0)

/* A key that is absent or JSON null counts as not given (transformers writes
 * null for "use the default"). */
static json_t *get(json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  return v && !json_is_null(v) ? v : NULL;
}

/* The first of keys that is given (transformers' attribute_map aliases:
 * GPT-2-style configs say n_layer, n_head, n_embd, n_positions). */
static json_t *get_any(json_t *o, const char *const *keys, const char **which) {
  for (; *keys; keys++) {
    json_t *v = get(o, *keys);
    if (v) {
      *which = *keys;
      return v;
    }
  }
  return NULL;
}

/* An integer field: 1 given (*out set), 0 absent, negative: an error reported. */
static int get_int(ctx_t *x, json_t *o, const char *const *keys, long *out) {
  const char *k = keys[0];
  json_t *v = get_any(o, keys, &k);
  if (!v)
    return 0;
  if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > (1ll << 40))
    FAIL(x, "%s: expected a non-negative integer", k);
  *out = (long)json_integer_value(v);
  return 1;
}

static int get_real(ctx_t *x, json_t *o, const char *key, double *out) {
  json_t *v = get(o, key);
  if (!v)
    return 0;
  if (!json_is_number(v) || !isfinite(json_number_value(v)))
    FAIL(x, "%s: expected a number", key);
  *out = json_number_value(v);
  return 1;
}

/* A field whose presence (not null, not false, not 0) alone says "not served". */
static int given(json_t *o, const char *key) {
  json_t *v = get(o, key);
  return v && !json_is_false(v) && !(json_is_integer(v) && json_integer_value(v) == 0);
}

static int read_shape(ctx_t *x, json_t *o, model_t *m) {
  static const char *const layers[] = {"num_hidden_layers", "n_layer", "num_layers", NULL};
  static const char *const heads[] = {"num_attention_heads", "n_head", NULL};
  static const char *const kv[] = {"num_key_value_heads", "num_kv_heads", NULL};
  static const char *const hd[] = {"head_dim", NULL};
  static const char *const hidden[] = {"hidden_size", "n_embd", NULL};
  static const char *const maxpos[] = {"max_position_embeddings", "n_positions", NULL};
  int r;
  if ((r = get_int(x, o, layers, &m->layers)) <= 0) {
    if (r == 0)
      FAIL(x, "no num_hidden_layers: not a transformers model config");
    return r;
  }
  if ((r = get_int(x, o, heads, &m->q_heads)) <= 0) {
    if (r == 0)
      FAIL(x, "no num_attention_heads: not a transformers model config");
    return r;
  }
  if (m->q_heads == 0)
    FAIL(x, "num_attention_heads: 0");
  if ((r = get_int(x, o, kv, &m->kv_heads)) < 0)
    return r;
  if (r == 0) /* multi_query (Falcon, GPT-BigCode): one KV head; else MHA */
    m->kv_heads = given(o, "multi_query") ? 1 : m->q_heads;
  if ((r = get_int(x, o, hd, &m->head_dim)) < 0 || get_int(x, o, hidden, &m->hidden) < 0)
    return -1;
  if (r == 0) {
    if (m->hidden == 0)
      FAIL(x, "neither head_dim nor hidden_size: the head dimension is unknown");
    if (m->hidden % m->q_heads)
      FAIL(x, "hidden_size %ld is not a multiple of num_attention_heads %ld", m->hidden,
           m->q_heads);
    m->head_dim = m->hidden / m->q_heads;
  }
  if (get_int(x, o, maxpos, &m->max_pos) < 0)
    return -1;
  /* transformers 5 writes "dtype", earlier versions "torch_dtype". */
  json_t *dt = get(o, "dtype");
  if (!dt)
    dt = get(o, "torch_dtype");
  if (dt && json_is_string(dt)) {
    if (strcmp(json_string_value(dt), "bfloat16") == 0)
      m->dtype = "bf16";
    else if (strcmp(json_string_value(dt), "float16") == 0)
      m->dtype = "fp16";
  }
  json_t *mt = get(o, "model_type");
  if (mt && json_is_string(mt))
    m->model_type = json_string_value(mt);
  return 0;
}

/* A rope_scaling or rope_parameters object: only the default rotation is
 * what the kernels compute (docs/numerics.md). */
static int read_rope_params(ctx_t *x, json_t *rs, const char *field, model_t *m) {
  if (!json_is_object(rs))
    FAIL(x, "%s: expected an object", field);
  json_t *t = get(rs, "rope_type");
  const char *tk = "rope_type";
  if (!t) {
    t = get(rs, "type");
    tk = "type";
  }
  if (!t && get(rs, "rope_theta") == NULL && json_object_size(rs) > 0) {
    /* transformers 5 keys rope_parameters by layer type when layers differ. */
    const char *k;
    json_t *v;
    json_object_foreach(rs, k, v) {
      if (json_is_object(v) && !x->rope_none)
        FAIL(x, "%s.%s: RoPE parameters per layer type (layer_types) are not supported", field, k);
    }
  }
  if (x->rope_none)
    return 0; /* the client rotates q and k with the model's own embedding */
  if (t && (!json_is_string(t) || strcmp(json_string_value(t), "default") != 0))
    FAIL(x,
         "%s.%s %s%s%s: attnd's RoPE is the default (unscaled) rotation only; llama3, yarn, "
         "linear, dynamic, longrope and other scaled types are refused rather than served wrong "
         "(or set rope = none and rotate q and k in the client, as attnd.hf does)",
         field, tk, json_is_string(t) ? "'" : "", json_is_string(t) ? json_string_value(t) : "?",
         json_is_string(t) ? "'" : "");
  if (get(rs, "mrope_section"))
    FAIL(x, "%s.mrope_section: multimodal (3D) RoPE is not supported", field);
  if (get_real(x, rs, "rope_theta", &m->theta) < 0 ||
      get_real(x, rs, "partial_rotary_factor", &m->rotary_frac) < 0)
    return -1;
  return 0;
}

static int read_rope(ctx_t *x, json_t *o, model_t *m) {
  const char *mt = m->model_type ? m->model_type : "";
  /* The families whose rotary layout is not neox's rotate-half (transformers'
   * rotate_every_two: GPT-J, CodeGen), or which have no RoPE at all (learned
   * absolute positions, added to the embeddings before attention). */
  static const char *const interleaved[] = {"gptj", "codegen", NULL};
  static const char *const learned[] = {"gpt2", "gpt_bigcode", "gpt_neo", "opt", NULL};
  m->rope = "neox";
  for (const char *const *p = interleaved; *p; p++)
    if (strcmp(mt, *p) == 0)
      m->rope = "interleaved";
  for (const char *const *p = learned; *p; p++)
    if (strcmp(mt, *p) == 0)
      m->rope = "none";
  m->theta = 10000.0; /* transformers' default when the file has none */
  if (get_real(x, o, "rope_theta", &m->theta) < 0 ||
      get_real(x, o, "rotary_emb_base", &m->theta) < 0)
    return -1;
  if (get_real(x, o, "partial_rotary_factor", &m->rotary_frac) < 0 ||
      get_real(x, o, "rotary_pct", &m->rotary_frac) < 0)
    return -1;
  static const char *const rdim[] = {"rotary_dim", NULL};
  if (get_int(x, o, rdim, &m->rotary_dim) < 0)
    return -1;
  json_t *rs = get(o, "rope_scaling");
  if (rs && read_rope_params(x, rs, "rope_scaling", m))
    return -1;
  json_t *rp = get(o, "rope_parameters");
  if (rp && read_rope_params(x, rp, "rope_parameters", m))
    return -1;
  if (!(m->theta > 0))
    FAIL(x, "rope_theta %g: must be > 0", m->theta);
  if (m->rotary_frac != 0 && !(m->rotary_frac > 0 && m->rotary_frac <= 1))
    FAIL(x, "partial_rotary_factor %g: must be in (0, 1]", m->rotary_frac);
  return 0;
}

/* The window of every layer (0: full), from layer_types, else the families'
 * patterns, else one window everywhere; then its shortest period. */
static int read_windows(ctx_t *x, json_t *o, model_t *m) {
  const char *mt = m->model_type ? m->model_type : "";
  json_t *use = get(o, "use_sliding_window"); /* Qwen2: false means none */
  int sliding_off = use && json_is_false(use);
  long w = 0, pattern = 0, mwl = -1;
  static const char *const sw[] = {"sliding_window", NULL};
  static const char *const swp[] = {"sliding_window_pattern", NULL};
  static const char *const mw[] = {"max_window_layers", NULL};
  if (get_int(x, o, sw, &w) < 0 || get_int(x, o, swp, &pattern) < 0 || get_int(x, o, mw, &mwl) < 0)
    return -1;
  if (sliding_off)
    w = 0;
  if (w > (1l << 30))
    FAIL(x, "sliding_window %ld: more than %ld", w, 1l << 30);
  long L = m->layers;
  if (L > 4096)
    return 0; /* --layers refuses it, naming num_hidden_layers */
  int32_t *per = attnd_xcalloc((size_t)L, sizeof(int32_t));
  int rc = 0;
  json_t *lt = get(o, "layer_types");
  if (lt) {
    size_t i;
    json_t *v;
    if (!json_is_array(lt) || (long)json_array_size(lt) != L) {
      snprintf(x->err, x->errlen,
               "--model-config %s: layer_types: expected an array of %ld "
               "(num_hidden_layers) layer types",
               x->path, L);
      rc = ATTND_EINVAL;
      goto done;
    }
    json_array_foreach(lt, i, v) {
      const char *t = json_is_string(v) ? json_string_value(v) : "?";
      if (strcmp(t, "sliding_attention") == 0 && w > 0) {
        per[i] = (int32_t)w;
      } else if (strcmp(t, "sliding_attention") == 0 && sliding_off) {
        per[i] = 0;
      } else if (strcmp(t, "sliding_attention") == 0) {
        snprintf(x->err, x->errlen,
                 "--model-config %s: layer_types[%zu] sliding_attention "
                 "without a sliding_window",
                 x->path, i);
        rc = ATTND_EINVAL;
        goto done;
      } else if (strcmp(t, "full_attention") != 0) {
        snprintf(x->err, x->errlen,
                 "--model-config %s: layer_types[%zu] '%s': only "
                 "full_attention and sliding_attention layers are supported",
                 x->path, i, t);
        rc = ATTND_EINVAL;
        goto done;
      }
    }
    m->windows_field = "layer_types";
  } else if (w > 0) {
    /* Gemma 3: every pattern-th layer is full (default 6); Gemma 2: every
     * second; Qwen2: layers from max_window_layers on slide; else all slide. */
    if (pattern == 0 && (strcmp(mt, "gemma3") == 0 || strcmp(mt, "gemma3_text") == 0))
      pattern = 6;
    if (pattern == 0 && strcmp(mt, "gemma2") == 0)
      pattern = 2;
    for (long i = 0; i < L; i++) {
      int slide = pattern > 0 ? (i + 1) % pattern != 0 : mwl >= 0 ? i >= mwl : 1;
      per[i] = slide ? (int32_t)w : 0;
    }
    m->windows_field = pattern > 0 ? "sliding_window_pattern" : "sliding_window";
  }
  /* The shortest period p with per[i] == per[i % p]. */
  int any = 0;
  for (long i = 0; i < L; i++)
    any |= per[i] != 0;
  if (any) {
    long p = 1;
    for (; p <= L; p++) {
      long i = p;
      while (i < L && per[i] == per[i % p])
        i++;
      if (i == L)
        break;
    }
    if (p > ATTND_CONFIG_MAX_WINDOWS) {
      snprintf(x->err, x->errlen,
               "--model-config %s: %s: the layers' windows repeat only "
               "every %ld layers (at most %d)",
               x->path, m->windows_field, p, ATTND_CONFIG_MAX_WINDOWS);
      rc = ATTND_EINVAL;
      goto done;
    }
    memcpy(m->windows, per, sizeof(int32_t) * (size_t)p);
    m->nwindows = (int)p;
  }
done:
  free(per);
  return rc;
}

static int read_variant(ctx_t *x, json_t *o, model_t *m) {
  const char *mt = m->model_type ? m->model_type : "";
  if (read_windows(x, o, m))
    return -1;
  if (get_real(x, o, "attn_logit_softcapping", &m->softcap) < 0)
    return -1;
  if (m->softcap < 0)
    FAIL(x, "attn_logit_softcapping %g: must be >= 0", m->softcap);
  if (strcmp(mt, "gpt_oss") == 0 || given(o, "attention_sinks"))
    m->sinks = 1;
  /* Gemma 3 rotates local (sliding) layers with another base than global ones. */
  double local = 0;
  if (get_real(x, o, "rope_local_base_freq", &local) < 0)
    return -1;
  if (local != 0 && local != m->theta && !x->rope_none)
    FAIL(x,
         "rope_local_base_freq %g: sliding layers use another RoPE base than rope_theta %g; "
         "attnd's RoPE is one per model: set rope = none and rotate q and k in the client "
         "(attnd.hf does)",
         local, m->theta);
  if (given(o, "kv_lora_rank"))
    FAIL(x, "kv_lora_rank: multi-head latent attention (MLA) is not supported");
  if (given(o, "alibi") || strcmp(mt, "bloom") == 0 || strcmp(mt, "mpt") == 0)
    FAIL(x, "%s: ALiBi position biases are not supported",
         given(o, "alibi") ? "alibi" : "model_type");
  /* The scale of q k^T when it is not 1/sqrt(head_dim): Gemma's
   * query_pre_attn_scalar, Granite's attention_multiplier. */
  double q = 0;
  if (get_real(x, o, "query_pre_attn_scalar", &q) < 0)
    return -1;
  if (q != 0) {
    if (!(q > 0))
      FAIL(x, "query_pre_attn_scalar %g: must be > 0", q);
    m->softmax_scale = 1.0 / sqrt(q);
    m->scale_field = "query_pre_attn_scalar";
  }
  double mul = 0;
  if (get_real(x, o, "attention_multiplier", &mul) < 0)
    return -1;
  if (mul != 0) {
    if (!(mul > 0))
      FAIL(x, "attention_multiplier %g: must be > 0", mul);
    m->softmax_scale = mul;
    m->scale_field = "attention_multiplier";
  }
  return 0;
}

/* One option from the model, unless the file or a flag set it. */
static int feed(attnd_config_t *c, ctx_t *x, const char *opt, const char *field, const char *fmt,
                ...) __attribute__((format(printf, 5, 6)));
static int feed(attnd_config_t *c, ctx_t *x, const char *opt, const char *field, const char *fmt,
                ...) {
  if (attnd_config_origin(c, opt) > ATTND_FROM_MODEL)
    return 0;
  char v[160], e[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(v, sizeof(v), fmt, ap);
  va_end(ap);
  if (attnd_config_set(c, ATTND_FROM_MODEL, opt, v, e, sizeof(e)))
    FAIL(x, "%s %s: %s", field, v, e);
  return 0;
}

static int apply_model(attnd_config_t *c, ctx_t *x, const model_t *m) {
  if (feed(c, x, "layers", "num_hidden_layers", "%ld", m->layers) ||
      feed(c, x, "q-heads", "num_attention_heads", "%ld", m->q_heads) ||
      feed(c, x, "kv-heads", "num_key_value_heads", "%ld", m->kv_heads) ||
      feed(c, x, "head-dim", "head_dim", "%ld", m->head_dim) ||
      feed(c, x, "rope", "model_type", "%s", m->rope) ||
      feed(c, x, "rope-theta", "rope_theta", "%.17g", m->theta))
    return ATTND_EINVAL;
  if (m->max_pos > 0 && feed(c, x, "max-context", "max_position_embeddings", "%ld", m->max_pos))
    return ATTND_EINVAL;
  if (m->dtype && feed(c, x, "dtype", "torch_dtype", "%s", m->dtype))
    return ATTND_EINVAL;
  if (m->model_type && m->model_type[0] &&
      feed(c, x, "model-id", "model_type", "%s", m->model_type))
    return ATTND_EINVAL;
  if (m->softmax_scale > 0 && feed(c, x, "softmax-scale", m->scale_field, "%.9g", m->softmax_scale))
    return ATTND_EINVAL;
  if (m->softcap > 0 && feed(c, x, "softcap", "attn_logit_softcapping", "%.9g", m->softcap))
    return ATTND_EINVAL;
  if (m->sinks && feed(c, x, "attention-sinks", "model_type", "%s", "true"))
    return ATTND_EINVAL;
  if (m->nwindows > 0 && attnd_config_origin(c, "attention-windows") <= ATTND_FROM_MODEL) {
    /* Too long for feed()'s buffer: the list itself, through the same setter. */
    char *v = attnd_xcalloc(ATTND_CONFIG_MAX_WINDOWS, 12);
    size_t n = 0;
    for (int i = 0; i < m->nwindows; i++)
      n += (size_t)snprintf(v + n, (size_t)ATTND_CONFIG_MAX_WINDOWS * 12 - n, "%s%d", i ? "," : "",
                            (int)m->windows[i]);
    char e[256];
    int r = attnd_config_set(c, ATTND_FROM_MODEL, "attention-windows", v, e, sizeof(e));
    free(v);
    if (r)
      FAIL(x, "%s: %s", m->windows_field, e);
  }
  /* The rotated dims follow the head dimension in force, whoever set it. */
  long hd = c->shape.head_dim;
  if (m->rotary_frac > 0) {
    double r = m->rotary_frac * (double)hd;
    long ri = lround(r);
    if (fabs(r - (double)ri) > 1e-6 || (ri & 1))
      FAIL(x, "partial_rotary_factor %g of head_dim %ld is %g dims, not a whole even number",
           m->rotary_frac, hd, r);
    if (feed(c, x, "rotary-dim", "partial_rotary_factor", "%ld", ri))
      return ATTND_EINVAL;
  } else if (m->rotary_dim > 0 && feed(c, x, "rotary-dim", "rotary_dim", "%ld", m->rotary_dim)) {
    return ATTND_EINVAL;
  }
  return 0;
}

int attnd_config_model_apply(attnd_config_t *c, char *err, size_t errlen) {
  ctx_t x = {c->model_config, err, errlen,
             attnd_config_origin(c, "rope") > ATTND_FROM_MODEL && c->shape.rope == ATTND_ROPE_NONE};
  json_error_t je;
  json_t *root = json_load_file(c->model_config, JSON_REJECT_DUPLICATES, &je);
  if (!root) {
    if (je.line < 0)
      FAIL(&x, "%s", je.text);
    FAIL(&x, "line %d column %d: %s", je.line, je.column, je.text);
  }
  int rc = ATTND_EINVAL;
  model_t m;
  memset(&m, 0, sizeof(m));
  json_t *o = root;
  if (!json_is_object(root)) {
    snprintf(err, errlen, "--model-config %s: not a JSON object", c->model_config);
    goto done;
  }
  /* A multimodal model (Llava, Gemma 3, ...): the language model's part. */
  json_t *text = get(root, "text_config");
  if (text && json_is_object(text) && !get(root, "num_hidden_layers"))
    o = text;
  if (read_shape(&x, o, &m))
    goto done;
  if (!m.model_type) {
    json_t *mt = get(root, "model_type");
    m.model_type = mt && json_is_string(mt) ? json_string_value(mt) : NULL;
  }
  if (read_rope(&x, o, &m) || read_variant(&x, o, &m))
    goto done;
  snprintf(c->model_type, sizeof(c->model_type), "%s", m.model_type ? m.model_type : "");
  rc = apply_model(c, &x, &m);
done:
  json_decref(root);
  return rc;
}

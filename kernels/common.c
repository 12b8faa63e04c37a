/* common.c: facts about shapes and cache types shared by both backends. */
#include <math.h>
#include <string.h>

#include "attnd_kernels.h"

static const char *const kv_names[ATTND_KV_COUNT_] = {
    "bf16", "fp16", "int8", "fp8", "int8_dynamic", "fp8_dynamic", "int4",
};

const char *attnd_kv_type_name(attnd_kv_type_t t) {
  if ((int)t < 0 || t >= ATTND_KV_COUNT_)
    return "unknown";
  return kv_names[t];
}

int attnd_kv_type_parse(const char *name) {
  for (int i = 0; i < ATTND_KV_COUNT_; i++)
    if (strcmp(name, kv_names[i]) == 0)
      return i;
  return -1;
}

int attnd_kv_type_static(attnd_kv_type_t t) {
  return t == ATTND_KV_INT8 || t == ATTND_KV_FP8 || t == ATTND_KV_INT4;
}

int attnd_kv_type_dynamic(attnd_kv_type_t t) {
  return t == ATTND_KV_INT8_DYNAMIC || t == ATTND_KV_FP8_DYNAMIC;
}

/* Bytes of K (or V) data for one token and one kv head. */
static size_t row_bytes(const attnd_kshape_t *s) {
  switch (s->kv) {
  case ATTND_KV_BF16:
  case ATTND_KV_FP16:
    return (size_t)s->head_dim * 2;
  case ATTND_KV_INT4:
    return (size_t)s->head_dim / 2;
  default:
    return (size_t)s->head_dim;
  }
}

size_t attnd_kv_block_bytes(const attnd_kshape_t *s) {
  size_t tokens = (size_t)s->kv_heads * (size_t)s->block_size;
  size_t bytes = 2 * tokens * row_bytes(s);
  if (attnd_kv_type_dynamic(s->kv))
    bytes += 2 * tokens * sizeof(float);
  return bytes;
}

double attnd_kv_bytes_per_token(const attnd_kshape_t *s) {
  return (double)attnd_kv_block_bytes(s) / (double)s->block_size;
}

int attnd_kshape_check(const attnd_kshape_t *s) {
  if (s->kv_heads <= 0 || s->q_heads <= 0 || s->q_heads % s->kv_heads != 0)
    return -1;
  if (s->head_dim != 64 && s->head_dim != 128 && s->head_dim != 256)
    return -1;
  if (s->block_size != 16 && s->block_size != 32 && s->block_size != 64 && s->block_size != 128)
    return -1;
  if (s->dtype != ATTND_DT_BF16 && s->dtype != ATTND_DT_FP16)
    return -1;
  if ((int)s->kv < 0 || s->kv >= ATTND_KV_COUNT_)
    return -1;
  if (s->rope != ATTND_ROPE_NONE && s->rope != ATTND_ROPE_NEOX && s->rope != ATTND_ROPE_INTERLEAVED)
    return -1;
  if (s->rotary_dim < 0 || s->rotary_dim > s->head_dim || (s->rotary_dim & 1))
    return -1;
  if (!(s->softmax_scale > 0.0f))
    return -1;
  if (!(s->softcap >= 0.0f) || isinf(s->softcap)) /* 0: none; NaN fails the first test */
    return -1;
  if (s->rope != ATTND_ROPE_NONE && !(s->rope_theta > 0.0))
    return -1;
  if (s->model_kv_heads < 0 || s->kv_head_begin < 0 ||
      (s->model_kv_heads == 0 && s->kv_head_begin != 0) ||
      (s->model_kv_heads > 0 && s->kv_head_begin + s->kv_heads > s->model_kv_heads))
    return -1;
  return 0;
}

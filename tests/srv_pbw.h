/* srv_pbw.h: a tiny protobuf writer and field finder for the server tests, so
 * requests (valid or deliberately broken) can be built byte by byte and
 * responses inspected without nanopb's oneof limitations. Header-only. */
#ifndef ATTND_SRV_PBW_H
#define ATTND_SRV_PBW_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  uint8_t *b;
  size_t n, cap;
} pbw_t;

static inline void pbw_init(pbw_t *w) {
  w->cap = 256;
  w->n = 0;
  w->b = malloc(w->cap);
}

static inline void pbw_free(pbw_t *w) {
  free(w->b);
  w->b = NULL;
  w->n = w->cap = 0;
}

static inline void pbw_raw(pbw_t *w, const void *p, size_t n) {
  if (w->n + n > w->cap) {
    while (w->n + n > w->cap)
      w->cap *= 2;
    w->b = realloc(w->b, w->cap);
  }
  if (n)
    memcpy(w->b + w->n, p, n);
  w->n += n;
}

static inline void pbw_varint(pbw_t *w, uint64_t v) {
  uint8_t t[10];
  int k = 0;
  while (v >= 0x80) {
    t[k++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  t[k++] = (uint8_t)v;
  pbw_raw(w, t, (size_t)k);
}

static inline void pbw_tag(pbw_t *w, uint32_t field, int wt) {
  pbw_varint(w, ((uint64_t)field << 3) | (uint64_t)wt);
}

static inline void pbw_uint(pbw_t *w, uint32_t field, uint64_t v) {
  pbw_tag(w, field, 0);
  pbw_varint(w, v);
}

static inline void pbw_fixed64(pbw_t *w, uint32_t field, uint64_t v) {
  uint8_t t[8];
  for (int i = 0; i < 8; i++)
    t[i] = (uint8_t)(v >> (8 * i));
  pbw_tag(w, field, 1);
  pbw_raw(w, t, 8);
}

static inline void pbw_bytes(pbw_t *w, uint32_t field, const void *p, size_t n) {
  pbw_tag(w, field, 2);
  pbw_varint(w, n);
  pbw_raw(w, p, n);
}

/* Appends sub as a length-delimited field and frees it. */
static inline void pbw_sub(pbw_t *w, uint32_t field, pbw_t *sub) {
  pbw_bytes(w, field, sub->b, sub->n);
  pbw_free(sub);
}

/* A tensor message: dtype, shape, data. */
static inline void pbw_tensor(pbw_t *w, uint32_t field, int dtype, const uint32_t *shape, int ndim,
                              const void *data, size_t nbytes) {
  pbw_t t;
  pbw_init(&t);
  pbw_uint(&t, 1, (uint64_t)dtype);
  for (int i = 0; i < ndim; i++)
    pbw_uint(&t, 2, shape[i]);
  pbw_bytes(&t, 3, data, nbytes);
  pbw_sub(w, field, &t);
}

static inline int pbr_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  uint64_t x = 0;
  int s = 0;
  while (*p < end && s < 64) {
    uint8_t c = *(*p)++;
    x |= (uint64_t)(c & 0x7f) << s;
    if (!(c & 0x80)) {
      *v = x;
      return 0;
    }
    s += 7;
  }
  return -1;
}

/* Finds the last length-delimited field `field` in buf; 0 on success. */
static inline int pbr_find(const uint8_t *buf, size_t len, uint32_t field, const uint8_t **out,
                           size_t *outlen) {
  const uint8_t *p = buf, *end = buf + len;
  int found = -1;
  while (p < end) {
    uint64_t key, v;
    if (pbr_varint(&p, end, &key))
      return -1;
    int wt = (int)(key & 7);
    uint32_t f = (uint32_t)(key >> 3);
    if (wt == 0) {
      if (pbr_varint(&p, end, &v))
        return -1;
    } else if (wt == 1) {
      p += 8;
    } else if (wt == 5) {
      p += 4;
    } else if (wt == 2) {
      if (pbr_varint(&p, end, &v) || v > (uint64_t)(end - p))
        return -1;
      if (f == field) {
        *out = p;
        *outlen = (size_t)v;
        found = 0;
      }
      p += v;
    } else {
      return -1;
    }
  }
  return found;
}

#endif /* ATTND_SRV_PBW_H */

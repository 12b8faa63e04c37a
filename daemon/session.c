/* session.c: session allocation, random ids, the id map. */
#include "session.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "errors.h"

attnd_session_t *attnd_session_new(int layers) {
  attnd_session_t *s = calloc(1, sizeof(*s));
  if (!s)
    return NULL;
  s->layers = layers;
  s->len = calloc((size_t)layers, sizeof(uint32_t));
  s->cons = calloc((size_t)layers, sizeof(uint32_t));
  if (!s->len || !s->cons) {
    attnd_session_free(s);
    return NULL;
  }
  s->taint = UINT32_MAX;
  return s;
}

void attnd_session_free(attnd_session_t *s) {
  if (!s)
    return;
  free(s->len);
  free(s->cons);
  free(s->tokens);
  free(s->table);
  free(s);
}

int attnd_session_reserve_tokens(attnd_session_t *s, uint32_t cap) {
  if (cap <= s->tokens_cap)
    return 0;
  uint32_t c = s->tokens_cap ? s->tokens_cap : 64;
  while (c < cap)
    c = c > UINT32_MAX / 2 ? cap : c * 2;
  uint32_t *t = realloc(s->tokens, (size_t)c * sizeof(uint32_t));
  if (!t)
    return ATTND_ENOMEM;
  s->tokens = t;
  s->tokens_cap = c;
  return 0;
}

int attnd_session_reserve_table(attnd_session_t *s, uint32_t nblocks) {
  if (nblocks <= s->table_cap)
    return 0;
  uint32_t c = s->table_cap ? s->table_cap : 8;
  while (c < nblocks)
    c *= 2;
  int32_t *t = realloc(s->table, (size_t)c * sizeof(int32_t));
  if (!t)
    return ATTND_ENOMEM;
  s->table = t;
  s->table_cap = c;
  return 0;
}

int attnd_session_lens_equal(const attnd_session_t *s) {
  for (int l = 1; l < s->layers; l++)
    if (s->len[l] != s->len[0])
      return 0;
  return 1;
}

uint64_t attnd_random_id(void) {
  uint64_t x = 0;
  while (x == 0) {
    if (getrandom(&x, sizeof(x), 0) != (ssize_t)sizeof(x)) {
      /* getrandom on Linux >= 3.17 does not fail for 8 bytes once seeded;
       * keep going with a weaker source rather than abort the daemon. */
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      x ^= (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)rand();
    }
  }
  return x;
}

struct attnd_idnode_s {
  uint64_t key;
  void *val;
  attnd_idnode_t *next;
};

static uint32_t slot(uint64_t key, uint32_t nb) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdull;
  key ^= key >> 33;
  return (uint32_t)key & (nb - 1);
}

int attnd_idmap_init(attnd_idmap_t *m) {
  m->nb = 64;
  m->count = 0;
  m->b = calloc(m->nb, sizeof(*m->b));
  return m->b ? 0 : ATTND_ENOMEM;
}

void attnd_idmap_free(attnd_idmap_t *m) {
  for (uint32_t i = 0; i < m->nb; i++) {
    attnd_idnode_t *n = m->b[i];
    while (n) {
      attnd_idnode_t *next = n->next;
      free(n);
      n = next;
    }
  }
  free(m->b);
  memset(m, 0, sizeof(*m));
}

void *attnd_idmap_get(const attnd_idmap_t *m, uint64_t key) {
  for (attnd_idnode_t *n = m->b[slot(key, m->nb)]; n; n = n->next)
    if (n->key == key)
      return n->val;
  return NULL;
}

int attnd_idmap_put(attnd_idmap_t *m, uint64_t key, void *val) {
  if (m->count + 1 > m->nb) {
    uint32_t nb = m->nb * 2;
    attnd_idnode_t **b = calloc(nb, sizeof(*b));
    if (b) {
      for (uint32_t i = 0; i < m->nb; i++) {
        attnd_idnode_t *n = m->b[i];
        while (n) {
          attnd_idnode_t *next = n->next;
          uint32_t s = slot(n->key, nb);
          n->next = b[s];
          b[s] = n;
          n = next;
        }
      }
      free(m->b);
      m->b = b;
      m->nb = nb;
    }
  }
  attnd_idnode_t *n = malloc(sizeof(*n));
  if (!n)
    return ATTND_ENOMEM;
  uint32_t s = slot(key, m->nb);
  n->key = key;
  n->val = val;
  n->next = m->b[s];
  m->b[s] = n;
  m->count++;
  return 0;
}

void attnd_idmap_del(attnd_idmap_t *m, uint64_t key) {
  attnd_idnode_t **pp = &m->b[slot(key, m->nb)];
  while (*pp) {
    if ((*pp)->key == key) {
      attnd_idnode_t *n = *pp;
      *pp = n->next;
      free(n);
      m->count--;
      return;
    }
    pp = &(*pp)->next;
  }
}

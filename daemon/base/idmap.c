/* idmap.c: random ids and the uint64 -> pointer map (base.h). */
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "internal.h"

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

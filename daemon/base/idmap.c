/* idmap.c: random ids and the uint64 -> pointer map (base.h). */
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "internal.h"

/* Ids are drawn from the kernel 32 at a time: one getrandom per id was one
 * syscall per Plan, i.e. per token of a decode loop, on the loop thread. The
 * pool is per thread, so no lock. */
#define ID_POOL 32
static _Thread_local uint64_t id_pool[ID_POOL];
static _Thread_local int id_left;

uint64_t attnd_random_id(void) {
  uint64_t x = 0;
  while (x == 0) {
    if (id_left == 0 && getrandom(id_pool, sizeof(id_pool), 0) == (ssize_t)sizeof(id_pool))
      id_left = ID_POOL;
    if (id_left > 0) {
      x = id_pool[--id_left];
      id_pool[id_left] = 0; /* a drawn id is not kept around */
    } else {
      /* getrandom on Linux >= 3.17 does not fail for 8 bytes once seeded;
       * keep going with a weaker source rather than abort the daemon. */
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      x ^= (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)rand();
    }
  }
  return x;
}

/* The bucket of key: the seed is mixed in before and after the first
 * multiply of a 64-bit finalizer (murmur3's fmix64), so which keys share a
 * bucket depends on a value the client never sees. Unseeded, the finalizer is
 * invertible and a client could pick thousands of request ids that all land
 * in one bucket, making every lookup walk them. */
static uint32_t slot(const attnd_idmap_t *m, uint64_t key) {
  key ^= m->seed;
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdull;
  key += m->seed >> 1 | 1;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ull;
  key ^= key >> 33;
  return (uint32_t)key & (m->nb - 1);
}

int attnd_idmap_init(attnd_idmap_t *m) {
  m->nb = 64;
  m->count = 0;
  m->seed = 0;
  if (getrandom(&m->seed, sizeof(m->seed), 0) != (ssize_t)sizeof(m->seed)) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    m->seed = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)(uintptr_t)m;
  }
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
  for (attnd_idnode_t *n = m->b[slot(m, key)]; n; n = n->next)
    if (n->key == key)
      return n->val;
  return NULL;
}

uint32_t attnd_idmap_probes(const attnd_idmap_t *m, uint64_t key) {
  uint32_t k = 0;
  for (attnd_idnode_t *n = m->b[slot(m, key)]; n; n = n->next) {
    k++;
    if (n->key == key)
      break;
  }
  return k;
}

int attnd_idmap_put(attnd_idmap_t *m, uint64_t key, void *val) {
  if (m->count + 1 > m->nb) {
    uint32_t onb = m->nb;
    attnd_idnode_t **ob = m->b;
    attnd_idnode_t **b = calloc((size_t)onb * 2, sizeof(*b));
    if (b) {
      m->b = b;
      m->nb = onb * 2;
      for (uint32_t i = 0; i < onb; i++) {
        attnd_idnode_t *n = ob[i];
        while (n) {
          attnd_idnode_t *next = n->next;
          uint32_t s = slot(m, n->key);
          n->next = b[s];
          b[s] = n;
          n = next;
        }
      }
      free(ob);
    }
  }
  attnd_idnode_t *n = malloc(sizeof(*n));
  if (!n)
    return ATTND_ENOMEM;
  uint32_t s = slot(m, key);
  n->key = key;
  n->val = val;
  n->next = m->b[s];
  m->b[s] = n;
  m->count++;
  return 0;
}

void attnd_idmap_del(attnd_idmap_t *m, uint64_t key) {
  attnd_idnode_t **pp = &m->b[slot(m, key)];
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

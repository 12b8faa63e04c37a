/* session.c: session allocation, random ids, the id map. */
#include "session.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "base.h"

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


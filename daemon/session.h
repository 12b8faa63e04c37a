/* session.h: one session's state (DESIGN.md section 6) and the id maps the
 * engine keeps sessions and plans in.
 *
 * A session holds, per layer, len[l] (positions 0..len[l]-1 are cached) and
 * cons[l] (positions below it are consistent with layer 0's current token ids:
 * a rewrite at layer 0 lowers cons of the other layers until they are
 * rewritten too, so a block is published only when every layer holds KV
 * computed from the same tokens). Token ids are layer 0's. The block table maps
 * logical block i to one physical block id used in every layer; it may run
 * past len (blocks reserved by a plan). */
#ifndef ATTND_SESSION_H
#define ATTND_SESSION_H

#include <stddef.h>
#include <stdint.h>

#include "base.h"

typedef struct attnd_session_s attnd_session_t;

struct attnd_session_s {
  uint64_t id, identity;
  int layers;
  uint32_t *len;  /* [layers] */
  uint32_t *cons; /* [layers] */
  uint32_t taint; /* first position written under a non-causal mask, or UINT32_MAX */
  uint32_t *tokens;
  uint32_t tokens_cap;
  int32_t *table;
  uint32_t nblocks, table_cap;
  uint32_t npub; /* leading blocks that are in the prefix index */
  uint8_t salt[64];
  uint32_t saltlen;
  uint64_t last_used_ms;
  void *plan;    /* the live plan touching this session (at most one) */
  uint32_t ntok; /* token ids known: positions 0..ntok-1 (may exceed len[0]) */
  uint64_t mark; /* scratch for the engine: finds a session named twice in one call */
  int broken;    /* a step on it failed in the backend: its KV is unknown (ABORTED) */
  attnd_session_t *prev, *next; /* the engine's list of sessions */
};

attnd_session_t *attnd_session_new(int layers);
void attnd_session_free(attnd_session_t *s);
/* Grow capacity (never shrink); 0 or ATTND_ENOMEM. */
int attnd_session_reserve_tokens(attnd_session_t *s, uint32_t cap);
int attnd_session_reserve_table(attnd_session_t *s, uint32_t nblocks);
/* 1 when every layer has the same len. */
int attnd_session_lens_equal(const attnd_session_t *s);

#endif /* ATTND_SESSION_H */

/* attnclient_shard.h: head-sharded mode of libattnclient (docs/scale-out.md).
 *
 * A group of daemons that each hold a contiguous range of a model's kv heads
 * [A, B) and the q heads that read them, [A*g, B*g) with g = q_heads /
 * kv_heads, is used as one model: every session is opened on every daemon, a
 * Plan is made on each, each layer step sends every daemon its heads' slices
 * of the packed q, k and v (to all daemons before any answer is read), and the
 * outputs are joined along the head axis. Heads are computed independently,
 * so the joined output equals one daemon's bit for bit.
 *
 * A daemon's range comes from its Health (ModelShape.kv_head_begin/end); for
 * a daemon that does not report one (kv_head_end 0) the caller may declare it,
 * and the daemon must then hold exactly B - A kv heads (a daemon started with
 * the shard's own shape). Without either a daemon holds the whole model.
 *
 * The layout helpers (attnd_shard_resolve, _gather, _scatter) need no daemon.
 * A group borrows its clients (the caller connects and frees them) and, like
 * them, is not thread-safe. Functions return 0 or a negative ATTND_CLIENT_E*
 * code; the group's last error text is in attnd_shard_errmsg(). */
#ifndef ATTND_CLIENT_SHARD_H
#define ATTND_CLIENT_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "attnclient.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The heads one daemon holds, in the model's numbering. */
typedef struct {
  uint32_t kv_begin, kv_end;
  uint32_t q_begin, q_end;
} attnd_shard_range_t;

/* Resolves the range of each of n daemons from its ModelShape (shapes[i]) or,
 * when the shape reports none, from declared[2i], declared[2i+1] (declared may
 * be NULL; a pair of 0, 0 declares nothing). Checks that the daemons agree on
 * every other model field and group size and that the ranges tile [0, kv
 * heads) without gap or overlap. On success ranges[i] is daemon i's range and
 * *model the whole model's shape (q_heads, kv_heads the totals; the range
 * fields zero). On failure returns ATTND_CLIENT_EINVAL with the reason in err. */
int attnd_shard_resolve(const attnd_v1_ModelShape *shapes, const uint32_t *declared, size_t n,
                        attnd_shard_range_t *ranges, attnd_v1_ModelShape *model, char *err,
                        size_t errlen);

/* Copies heads [hbegin, hbegin + hcount) of src [rows, heads, dim] (elements of
 * esize bytes) into dst [rows, hcount, dim]. */
void attnd_shard_gather(void *dst, const void *src, uint32_t rows, uint32_t heads, uint32_t hbegin,
                        uint32_t hcount, uint32_t dim, size_t esize);
/* The reverse: src [rows, hcount, dim] into heads [hbegin, hbegin + hcount) of
 * dst [rows, heads, dim]. */
void attnd_shard_scatter(void *dst, const void *src, uint32_t rows, uint32_t heads, uint32_t hbegin,
                         uint32_t hcount, uint32_t dim, size_t esize);

typedef struct attnd_shard_group_s attnd_shard_group_t;

/* Makes a group of n connected clients: asks each for Health and resolves the
 * ranges (declared as for attnd_shard_resolve). The clients stay the caller's
 * and must outlive the group. On failure *out is NULL and err says why. */
int attnd_shard_group_init(attnd_shard_group_t **out, attnd_client_t *const *clients,
                           const uint32_t *declared, size_t n, char *err, size_t errlen);
void attnd_shard_group_free(attnd_shard_group_t *g);
const char *attnd_shard_errmsg(const attnd_shard_group_t *g);
/* The whole model (q_heads, kv_heads the totals). */
const attnd_v1_ModelShape *attnd_shard_model(const attnd_shard_group_t *g);
size_t attnd_shard_count(const attnd_shard_group_t *g);
/* Daemon i's range (i in the order the clients were given). */
attnd_shard_range_t attnd_shard_range(const attnd_shard_group_t *g, size_t i);

/* Opens a session on every daemon. *session is the group's handle for it (the
 * first daemon's session id); *cached_len the smallest of the daemons'. */
int attnd_shard_open_session(attnd_shard_group_t *g, const uint32_t *tokens, size_t ntokens,
                             uint64_t *session, uint32_t *cached_len);
int attnd_shard_close_session(attnd_shard_group_t *g, uint64_t session);
int attnd_shard_fork(attnd_shard_group_t *g, uint64_t session, uint64_t *child);
int attnd_shard_truncate(attnd_shard_group_t *g, uint64_t session, uint32_t len);

/* One Plan per daemon for items naming the group's session handles. plans
 * receives attnd_shard_count(g) plan ids (daemon order). */
int attnd_shard_plan(attnd_shard_group_t *g, const attnd_client_item_t *items, size_t nitems,
                     uint64_t *plans);

/* A layer step of the whole model under plans (from attnd_shard_plan): s->q is
 * [q_rows, q_heads, head_dim] and s->k, s->v [kv_rows, kv_heads, head_dim] of
 * the whole model; s->plan and s->items are ignored (each daemon steps its own
 * plan), s->q_heads/kv_heads/head_dim must be the model's. Each daemon's
 * slices are encoded straight from the caller's tensors (no intermediate
 * copy). ids receives one request id per daemon. */
int attnd_shard_step_send(attnd_shard_group_t *g, const attnd_client_step_t *s,
                          const uint64_t *plans, uint64_t *ids);

/* Receives every daemon's answer to ids (all of them, even after a failure, so
 * none is left queued) and joins them: out [q_rows, q_heads, head_dim] of 2-byte
 * elements, or 4-byte ones for an fp32_out step, out_bytes its size; lse (may be
 * NULL) [q_rows, q_heads] fp32 for a want_lse step. */
int attnd_shard_step_recv(attnd_shard_group_t *g, const uint64_t *ids, void *out, size_t out_bytes,
                          float *lse);

#ifdef __cplusplus
}
#endif

#endif /* ATTND_CLIENT_SHARD_H */

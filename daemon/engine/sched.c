/* sched.c: backend jobs in dependency order (internal.h, docs/sessions.md
 * section 5).
 *
 * A layer's jobs used to run strictly one after another, so one session's
 * 32k-token prefill held every other session's decode step on that layer for
 * seconds. Now a job waits only for the earlier unfinished jobs of its layer
 * it conflicts with, and the backend runs the rest beside them (the CPU
 * backend interleaves a large step's chunks with small jobs; the CUDA backend
 * gives small jobs high-priority streams).
 *
 * Conflicts are found per block, with a scoreboard per (layer, block): the
 * last unfinished job that writes the block, and the unfinished jobs that
 * read it since. A job that reads a block waits for its writer; one that
 * writes a block waits for its writer and for every reader since (they must
 * not see the new bytes). A step writes the blocks of its new positions and
 * reads the rest of its items' tables (only items with q read); a COPY writes
 * its destinations and reads its sources. This covers every way two jobs
 * meet: a session's consecutive steps, a fork sharing blocks a running step
 * writes, copy-on-write sources written again once unshared, and a block
 * freed and reused (a job's references keep a block from reuse until the
 * job is done, and a done job leaves the scoreboard). A SCALES job is a
 * barrier in its layer: it waits for every unfinished job of the layer, and
 * every later job waits for it. Jobs of different layers never wait for each
 * other.
 *
 * Cost: O(blocks a job touches) to enter and to leave, plus one edge per
 * wait (a job waiting on another through many blocks records it once). A job
 * whose wait ends is handed to the backend from a ready queue drained on the
 * loop thread (no recursion through chains of jobs); one that waited for a
 * job that failed is failed without running: what it would read is unknown. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int attnd_sched_init(attnd_engine_t *e) {
  size_t n = (size_t)e->layers * e->pool.n;
  e->sb_w = calloc(n ? n : 1, sizeof(*e->sb_w));
  e->sb_r = malloc((n ? n : 1) * sizeof(*e->sb_r));
  e->ljobs = malloc((size_t)e->layers * sizeof(*e->ljobs));
  e->barrier = calloc((size_t)e->layers, sizeof(*e->barrier));
  if (!e->sb_w || !e->sb_r || !e->ljobs || !e->barrier) {
    attnd_sched_free(e);
    return ATTND_ENOMEM;
  }
  for (size_t i = 0; i < n; i++)
    attnd_list_init(&e->sb_r[i]);
  for (int l = 0; l < e->layers; l++)
    attnd_list_init(&e->ljobs[l]);
  attnd_list_init(&e->readyq);
  return 0;
}

void attnd_sched_free(attnd_engine_t *e) {
  free(e->sb_w);
  free(e->sb_r);
  free(e->ljobs);
  free(e->barrier);
  e->sb_w = NULL;
  e->sb_r = NULL;
  e->ljobs = NULL;
  e->barrier = NULL;
}

void attnd_sched_reserve(attnd_ejob_t *j, uint32_t nwrite, uint32_t nread) {
  j->wblocks = attnd_xcalloc(nwrite ? nwrite : 1, sizeof(int32_t));
  j->rnodes = attnd_xcalloc(nread ? nread : 1, sizeof(attnd_rnode_t));
  j->nw = j->nr = 0;
}

void attnd_sched_write(attnd_ejob_t *j, int32_t block) {
  j->wblocks[j->nw++] = block;
}

void attnd_sched_read(attnd_ejob_t *j, int32_t block) {
  attnd_rnode_t *r = &j->rnodes[j->nr++];
  attnd_list_init(&r->link);
  r->job = j;
  r->block = block;
}

/* j waits for d (once, however many blocks they share). */
static void wait_for(attnd_ejob_t *d, attnd_ejob_t *j) {
  if (d == j || d->last_waiter == j)
    return;
  d->last_waiter = j;
  if (d->nwaiters == d->waiters_cap) {
    d->waiters_cap = d->waiters_cap ? 2 * d->waiters_cap : 4;
    d->waiters = attnd_xrealloc(d->waiters, d->waiters_cap * sizeof(*d->waiters));
  }
  d->waiters[d->nwaiters++] = j;
  j->nwait++;
}

static size_t slot(const attnd_engine_t *e, int layer, int32_t block) {
  return (size_t)layer * e->pool.n + (size_t)block;
}

/* Enters j into its layer's scoreboard; 1 when it waits for nothing. */
static int sched_add(attnd_engine_t *e, attnd_ejob_t *j) {
  int l = j->layer;
  j->nwait = 0;
  if (e->barrier[l])
    wait_for(e->barrier[l], j);
  if (j->kind == EJ_SCALES || j->kind == EJ_SINKS) {
    ATTND_LIST_FOREACH(it, nx, &e->ljobs[l])
    wait_for(ATTND_LIST_DATA(it, attnd_ejob_t, llink), j);
    e->barrier[l] = j;
  }
  for (uint32_t i = 0; i < j->nw; i++) {
    size_t s = slot(e, l, j->wblocks[i]);
    if (e->sb_w[s])
      wait_for(e->sb_w[s], j);
    attnd_list_t *rd = &e->sb_r[s], *it;
    while ((it = attnd_list_first(rd)) != NULL) {
      wait_for(ATTND_LIST_DATA(it, attnd_rnode_t, link)->job, j);
      attnd_list_remove(it); /* the readers are now ordered before j */
    }
    e->sb_w[s] = j;
  }
  for (uint32_t i = 0; i < j->nr; i++) {
    attnd_rnode_t *r = &j->rnodes[i];
    size_t s = slot(e, l, r->block);
    if (e->sb_w[s])
      wait_for(e->sb_w[s], j);
    attnd_list_insert_tail(&e->sb_r[s], &r->link);
  }
  attnd_list_insert_tail(&e->ljobs[l], &j->llink);
  return j->nwait == 0;
}

void attnd_sched_submit(attnd_engine_t *e, attnd_ejob_t *j) {
  if (sched_add(e, j))
    attnd_list_insert_tail(&e->readyq, &j->qlink);
  attnd_sched_run(e);
}

void attnd_sched_done(attnd_engine_t *e, attnd_ejob_t *j, int failed) {
  int l = j->layer;
  for (uint32_t i = 0; i < j->nr; i++)
    attnd_list_remove(&j->rnodes[i].link); /* harmless when a writer took it off */
  for (uint32_t i = 0; i < j->nw; i++) {
    size_t s = slot(e, l, j->wblocks[i]);
    if (e->sb_w[s] == j)
      e->sb_w[s] = NULL;
  }
  if (e->barrier[l] == j)
    e->barrier[l] = NULL;
  attnd_list_remove(&j->llink);
  for (uint32_t i = 0; i < j->nwaiters; i++) {
    attnd_ejob_t *w = j->waiters[i];
    w->dep_failed |= failed;
    if (--w->nwait == 0)
      attnd_list_insert_tail(&e->readyq, &w->qlink);
  }
  j->nwaiters = 0;
}

void attnd_sched_run(attnd_engine_t *e) {
  if (e->sched_busy)
    return; /* the outer call drains what this one would */
  e->sched_busy = 1;
  attnd_list_t *it;
  while ((it = attnd_list_first(&e->readyq)) != NULL) {
    attnd_ejob_t *j = ATTND_LIST_DATA(it, attnd_ejob_t, qlink);
    attnd_list_remove(it);
    if (j->dep_failed)
      attnd_ejob_fail_unrun(e, j);
    else
      attnd_ejob_start(e, j);
  }
  e->sched_busy = 0;
}

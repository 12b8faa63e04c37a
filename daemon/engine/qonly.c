/* qonly.c: attend-only (q_only) items of a step (docs/scale-out.md): a
 * split-context part that does not hold the tail attends the new rows over
 * the keys it holds and writes nothing. The kernels' items cannot say "these
 * rows come after every key" (an item's keys end at start + n), so this file
 * restates such an item as kernel items whose positions and masks are shifted
 * and whose RoPE positions (pos_base) are the true ones. */
#include <stdint.h>
#include <string.h>

#include "internal.h"

/* An attend-only item's rows attend over the L keys the layer holds, all
 * before them (check_items). The kernels' item has kv_len = start + n keys,
 * so the rows go to the kernels in pieces of m <= L rows placed at kernel
 * positions L-m .. L-1 (kv_len L), each piece d = (its first row's position)
 * - (L - m) > 0 positions later in truth; pos_base puts RoPE back at the
 * true absolute positions, and the mask is restated for the shifted rows:
 * causal, full and prefix-LM rows past every key see all of them (FULL);
 * a sliding window w (or the layer's window) becomes SLIDING w - d for a
 * one-row piece and intervals (rows p masked from key j when
 * p >= j + w - d) otherwise; custom intervals are cut to the held columns
 * and shifted by base + d. Pieces of one item share its block table. */
uint32_t attnd_qonly_pieces(const attnd_pitem_t *it, uint32_t layer) {
  uint32_t L = it->s->len[layer];
  return (it->n + L - 1) / L;
}

/* Whether a piece of m rows of item it needs intervals (else FULL/SLIDING). */
static int qonly_needs_intervals(const attnd_pitem_t *it, uint32_t m, int32_t window) {
  if (it->kmask == ATTND_MASK_INTERVALS)
    return 1;
  return (it->kmask == ATTND_MASK_SLIDING || window > 0) && m > 1;
}

size_t attnd_qonly_meta(const attnd_pitem_t *it, uint32_t layer, int32_t window) {
  const uint32_t L = it->s->len[layer];
  size_t meta = 0;
  for (uint32_t r0 = 0; r0 < it->n; r0 += L) {
    uint32_t m = it->n - r0 < L ? it->n - r0 : L;
    /* A one-row sliding piece may need intervals too (a window that ended). */
    int sliding = it->kmask == ATTND_MASK_SLIDING || window > 0;
    meta += qonly_needs_intervals(it, m, window) || sliding ? 4 * (size_t)L : 0;
  }
  return meta;
}

void attnd_qonly_batch(attnd_engine_t *e, attnd_ejob_t *j, uint32_t i, const attnd_pitem_t *it,
                       uint32_t q_row, int32_t window, uint32_t *ki, int32_t *qv, size_t *mo) {
  attnd_kbatch_t *b = &j->job.batch;
  const attnd_session_t *s = it->s;
  const uint32_t L = s->len[j->layer], nb = attnd_engine_nblocks(e, L);
  j->sessions[i] = s->id;
  const int32_t table = (int32_t)*mo;
  for (uint32_t bi = 0; bi < nb; bi++) {
    j->meta[(*mo)++] = s->table[bi];
    j->refs[j->nrefs++] = s->table[bi];
    attnd_blocks_ref(&e->pool, s->table[bi], 0);
    attnd_sched_read(j, s->table[bi]);
  }
  /* The true visible range's width from the sliding mask and the layer's window. */
  int64_t w = it->kmask == ATTND_MASK_SLIDING ? it->mask_param : INT64_MAX;
  if (window > 0 && window < w)
    w = window;
  for (uint32_t r0 = 0; r0 < it->n; r0 += L) {
    const uint32_t m = it->n - r0 < L ? it->n - r0 : L;
    const int64_t d = (int64_t)it->start + r0 - (L - m);
    attnd_kitem_t *k = &j->kitems[(*ki)++];
    k->start = (int32_t)(L - m);
    k->n = (int32_t)m;
    k->q_row = (int32_t)(q_row + r0);
    k->kv_row = b->total_kv + *qv;
    *qv += (int32_t)m;
    k->block_table = table;
    k->pos_base = (int32_t)(s->base + it->start + r0 - (L - m));
    k->flags = attnd_session_item_flags(s);
    k->mask_kind = ATTND_MASK_FULL;
    k->causal = 0;
    if (!qonly_needs_intervals(it, m, window)) {
      if (w != INT64_MAX) {
        if (w - d >= 1) {
          k->mask_kind = ATTND_MASK_SLIDING;
          k->mask_param = (int32_t)(w - d);
        } else {
          /* The window ends before every held key: a fully masked row. */
          k->mask_kind = ATTND_MASK_INTERVALS;
          k->intervals = (int32_t)*mo;
          for (uint32_t c = 0; c < L; c++) {
            j->meta[*mo + c] = 0;
            j->meta[*mo + L + c] = INT32_MAX;
            j->meta[*mo + 2 * L + c] = j->meta[*mo + 3 * L + c] = 0;
          }
          *mo += 4 * (size_t)L;
        }
      }
    } else {
      k->mask_kind = ATTND_MASK_INTERVALS;
      k->intervals = (int32_t)*mo;
      int32_t *iv = &j->meta[*mo];
      const uint64_t kvl = (uint64_t)s->base + it->start + it->n; /* the absolute columns */
      const int64_t shift = (int64_t)s->base + d;
      for (uint32_t c = 0; c < L; c++) {
        int64_t a0 = 0, a1 = 0, u0 = 0, u1 = 0;
        if (it->intervals) {
          const uint64_t col = (uint64_t)s->base + c;
          a0 = it->intervals[col] - shift;
          a1 = it->intervals[kvl + col] - shift;
          u0 = it->intervals[2 * kvl + col] - shift;
          u1 = it->intervals[3 * kvl + col] - shift;
        } else {
          a0 = (int64_t)c + w - d; /* relative row p >= c + w is past the window */
          a1 = INT32_MAX;
        }
        a0 = a0 < 0 ? 0 : a0 > INT32_MAX ? INT32_MAX : a0;
        a1 = a1 < 0 ? 0 : a1 > INT32_MAX ? INT32_MAX : a1;
        u0 = u0 < 0 ? 0 : u0 > INT32_MAX ? INT32_MAX : u0;
        u1 = u1 < 0 ? 0 : u1 > INT32_MAX ? INT32_MAX : u1;
        iv[c] = (int32_t)a0;
        iv[L + c] = (int32_t)(a1 < a0 ? a0 : a1);
        iv[2 * L + c] = (int32_t)u0;
        iv[3 * L + c] = (int32_t)(u1 < u0 ? u0 : u1);
      }
      *mo += 4 * (size_t)L;
    }
    if ((int32_t)L > b->max_kv_len)
      b->max_kv_len = (int32_t)L;
    b->kv_sum += L;
    if ((int32_t)m > b->max_n)
      b->max_n = (int32_t)m;
  }
}

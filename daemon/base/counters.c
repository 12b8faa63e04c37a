/* counters.c: status counters and latency histograms (base.h). */
#include "internal.h"

const double attnd_hist_bounds_us[ATTND_HIST_BUCKETS] = {
    50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 1000000, 5000000,
};

void attnd_status_count(attnd_status_counts_t *c, int code) {
  if (code < 0 || code >= ATTND_STATUS_COUNT)
    code = ATTND_STATUS_INTERNAL;
  c->by_code[code]++;
  if (code != ATTND_STATUS_OK)
    c->errors++;
}

void attnd_hist_add(attnd_hist_t *h, double us) {
  int i = 0;
  while (i < ATTND_HIST_BUCKETS && us > attnd_hist_bounds_us[i])
    i++;
  h->bucket[i]++;
  h->count++;
  h->sum_us += us;
}

/* base.h: what every layer of the daemon uses, and nothing that knows about
 * requests: error codes, the logger, the allocation wrapper, an intrusive
 * list, the id map and random ids, counters and histograms.
 *
 * The daemon is built in layers that read in the order a request travels
 * (README "How a step flows"): net -> rpc -> engine -> backend, with config
 * and base beneath them all. This library links to nothing of the daemon. */
#ifndef ATTND_BASE_H
#define ATTND_BASE_H

#include <stddef.h>
#include <stdint.h>

/* ---- errors ------------------------------------------------------------------
 * Functions return 0 or a negative ATTND_E*. One X-macro list generates the
 * enum, attnd_strerror() and the mapping to wire status codes
 * (attnd.v1.Status.Code, numbered as gRPC's; docs/protocol.md).
 *
 * XX(name, value, wire status code, text) */
#define ATTND_ERRNO_MAP(XX)                                                                        \
  XX(EINVAL, -1, 3, "invalid argument")                                                            \
  XX(ENOTFOUND, -2, 5, "not found")                                                                \
  XX(EPERM, -3, 7, "permission denied")                                                            \
  XX(ENOSPC, -4, 8, "resource exhausted")                                                          \
  XX(EPRECOND, -5, 9, "failed precondition")                                                       \
  XX(EABORTED, -6, 10, "aborted")                                                                  \
  XX(ERANGE, -7, 11, "out of range")                                                               \
  XX(ENOTIMPL, -8, 12, "unimplemented")                                                            \
  XX(EINTERNAL, -9, 13, "internal error")                                                          \
  XX(EUNAVAIL, -10, 14, "unavailable")                                                             \
  XX(EUNAUTH, -11, 16, "unauthenticated")                                                          \
  XX(ECANCELED, -12, 1, "cancelled")                                                               \
  XX(ENOMEM, -13, 8, "out of memory")                                                              \
  XX(EIO, -14, 13, "i/o error")                                                                    \
  XX(ECUDA, -15, 13, "CUDA error")                                                                 \
  XX(EDEVICE, -16, 14, "device unusable")

typedef enum {
  ATTND_OK = 0,
#define ATTND_XX_ENUM(name, val, code, text) ATTND_##name = (val),
  ATTND_ERRNO_MAP(ATTND_XX_ENUM)
#undef ATTND_XX_ENUM
} attnd_err_t;

/* Wire status codes (attnd.v1.Status.Code). */
enum {
  ATTND_STATUS_OK = 0,
  ATTND_STATUS_CANCELLED = 1,
  ATTND_STATUS_INVALID_ARGUMENT = 3,
  ATTND_STATUS_NOT_FOUND = 5,
  ATTND_STATUS_PERMISSION_DENIED = 7,
  ATTND_STATUS_RESOURCE_EXHAUSTED = 8,
  ATTND_STATUS_FAILED_PRECONDITION = 9,
  ATTND_STATUS_ABORTED = 10,
  ATTND_STATUS_OUT_OF_RANGE = 11,
  ATTND_STATUS_UNIMPLEMENTED = 12,
  ATTND_STATUS_INTERNAL = 13,
  ATTND_STATUS_UNAVAILABLE = 14,
  ATTND_STATUS_UNAUTHENTICATED = 16,
  ATTND_STATUS_COUNT = 17 /* codes 0..16 */
};

const char *attnd_strerror(int err);
/* The wire status code for an error (0 for 0, INTERNAL for unknown values). */
int attnd_err_status(int err);

/* The one mapping of the kernels' return codes (kernels/attnd_kernels.h and
 * kernels/cuda/attnd_cuda.h) into this list: 0 stays 0; -1 (a shape or batch
 * the kernels cannot run) is ATTND_EINVAL; -15 (a CUDA call or launch failed)
 * ATTND_ECUDA; -16 (a sticky failure: the context is unusable) ATTND_EDEVICE;
 * any other value ATTND_EINTERNAL. The CUDA backend checks at compile time
 * that the kernels' enum still has these values. */
#define ATTND_KERNEL_EINVAL (-1)
#define ATTND_KERNEL_ECUDA (-15)
#define ATTND_KERNEL_EDEVICE (-16)
int attnd_err_from_kernel(int rc);

/* ---- log ---------------------------------------------------------------------
 * One line per event on stderr (or the --log-file), with key=value fields:
 *
 *   2026-11-29T19:40:00.123Z level=info event=listening unix=/run/attnd/attnd.sock
 *
 * The caller formats the fields (printf-style, already "key=value ..."); the
 * logger adds the time, the level and the event name, and, when stderr is the
 * journal (JOURNAL_STREAM), the syslog priority first ("<3>" for errors), so
 * journald records each line's level. Lines are written with one write(2)
 * each so that lines from different threads never interleave. Secrets
 * (tokens) are never passed to the logger. */
typedef enum {
  ATTND_LOG_ERROR = 0,
  ATTND_LOG_WARN = 1,
  ATTND_LOG_INFO = 2,
  ATTND_LOG_DEBUG = 3,
} attnd_log_level_t;

/* Parses "error|warn|info|debug"; returns the level or -1. */
int attnd_log_level_parse(const char *name);
void attnd_log_set_level(attnd_log_level_t level);
int attnd_log_enabled(attnd_log_level_t level);

/* Where lines go: path NULL or "" is stderr (with priorities when it is the
 * journal), else the file, opened for appending (created 0640). Call once, at
 * start, before other threads log. On error returns a negative ATTND_E* with
 * a reason in err, and lines keep going to stderr. */
int attnd_log_open(const char *path, char *err, size_t errlen);
/* Opens the --log-file path again (after logrotate moved it) in place of the
 * old one; nothing to do for stderr. On error the old file stays in use. */
int attnd_log_reopen(char *err, size_t errlen);
/* The --log-file path, or "" for stderr. */
const char *attnd_log_file(void);
/* 1 when lines carry journald priorities (stderr is the journal). */
int attnd_log_journal(void);

/* Writes one line: time, level, event, then the formatted fields. */
void attnd_log(attnd_log_level_t level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A plain message for a person on stderr ("attnd: ...\n", before the logger
 * is set up: bad options), with the journal priority when stderr is the journal. */
void attnd_log_plain(attnd_log_level_t level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Copies src into dst (cap bytes) so it can stand inside a "quoted" field:
 * '"' and '\\' escaped, control characters as spaces. Returns the length. */
size_t attnd_log_escape(char *dst, size_t cap, const char *src);

/* Rate-limited lines, for events a client can cause at any rate (failed
 * calls): per key, at most ATTND_LOG_RL_BURST lines per ATTND_LOG_RL_WINDOW_MS;
 * the ones past it are counted, and once the window is over one line
 * "event=EVENT LABEL suppressed=K window_s=10" reports them (written by the
 * next line of that key, or by attnd_log_limited_flush(0), which the daemon
 * calls every window; attnd_log_limited_flush(1), at exit, reports every
 * count whatever its window). event must be a string literal; label (up to
 * 95 bytes, e.g. "method=step code=NOT_FOUND") names the key in the lines. */
#define ATTND_LOG_RL_KEYS 512
#define ATTND_LOG_RL_BURST 5
#define ATTND_LOG_RL_WINDOW_MS 10000
void attnd_log_limited(attnd_log_level_t level, unsigned key, const char *event, const char *label,
                       const char *fmt, ...) __attribute__((format(printf, 5, 6)));
void attnd_log_limited_flush(int all);
/* Tests: the clock the windows are measured with (NULL: CLOCK_MONOTONIC), in ms. */
void attnd_log_limited_clock(uint64_t (*now_ms)(void));

/* How loud a call that ended with this wire status code is logged: INTERNAL
 * (and unknown codes) are errors, UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED
 * and CANCELLED warnings (the daemon's state or limits), the caller's
 * mistakes (INVALID_ARGUMENT, NOT_FOUND, ...) info: all are visible at the
 * default level. */
attnd_log_level_t attnd_status_log_level(int code);

#define ATTND_LOGE(ev, ...) attnd_log(ATTND_LOG_ERROR, ev, __VA_ARGS__)
#define ATTND_LOGW(ev, ...) attnd_log(ATTND_LOG_WARN, ev, __VA_ARGS__)
#define ATTND_LOGI(ev, ...) attnd_log(ATTND_LOG_INFO, ev, __VA_ARGS__)
#define ATTND_LOGD(ev, ...)                                                                        \
  do {                                                                                             \
    if (attnd_log_enabled(ATTND_LOG_DEBUG))                                                        \
      attnd_log(ATTND_LOG_DEBUG, ev, __VA_ARGS__);                                                 \
  } while (0)

/* ---- allocation --------------------------------------------------------------
 * Small bookkeeping (sessions, plans, jobs, requests) is allocated through
 * these: on failure they log and abort, since a daemon that cannot allocate a
 * few hundred bytes cannot answer anyone. Memory proportional to a request
 * (tensors, outputs) and KV blocks are NOT allocated here: running out of them
 * is a normal, reported condition (ATTND_ENOMEM, ATTND_ENOSPC). A zero size
 * allocates one byte, so the result is never NULL. */
void *attnd_xmalloc(size_t n);
void *attnd_xcalloc(size_t n, size_t size);
void *attnd_xrealloc(void *p, size_t n);

/* ---- intrusive list ----------------------------------------------------------
 * A circular doubly linked list whose links live inside the listed struct
 * (libuv's queue.h idea): no allocation to list something, O(1) removal from
 * anywhere. The head is an attnd_list_t of its own; an empty list points at
 * itself. ATTND_LIST_DATA turns a link back into its struct. */
typedef struct attnd_list_s {
  struct attnd_list_s *next, *prev;
} attnd_list_t;

#define ATTND_LIST_DATA(link, type, field) ((type *)((char *)(link)-offsetof(type, field)))

static inline void attnd_list_init(attnd_list_t *h) {
  h->next = h->prev = h;
}
static inline int attnd_list_empty(const attnd_list_t *h) {
  return h->next == h;
}
/* The first (oldest when inserted at the tail) element, or NULL. */
static inline attnd_list_t *attnd_list_first(const attnd_list_t *h) {
  return h->next == h ? NULL : h->next;
}
/* The element after x in h, or NULL at the end. */
static inline attnd_list_t *attnd_list_next(const attnd_list_t *h, const attnd_list_t *x) {
  return x->next == h ? NULL : x->next;
}
static inline void attnd_list_insert_tail(attnd_list_t *h, attnd_list_t *x) {
  x->next = h;
  x->prev = h->prev;
  h->prev->next = x;
  h->prev = x;
}
static inline void attnd_list_insert_head(attnd_list_t *h, attnd_list_t *x) {
  x->prev = h;
  x->next = h->next;
  h->next->prev = x;
  h->next = x;
}
/* Unlinks x; x then points at itself, so removing it twice is harmless. */
static inline void attnd_list_remove(attnd_list_t *x) {
  x->prev->next = x->next;
  x->next->prev = x->prev;
  x->next = x->prev = x;
}
/* Iterates with `it` as the current link; the body may remove `it` (the next
 * link is read before the body runs). */
#define ATTND_LIST_FOREACH(it, nx, head)                                                           \
  for (attnd_list_t *it = (head)->next, *nx = it->next; it != (head); it = nx, nx = it->next)

/* ---- ids ---------------------------------------------------------------------
 * A random nonzero 64-bit id (getrandom): session and plan ids, never
 * guessable from one another. */
uint64_t attnd_random_id(void);

/* uint64 -> pointer map (chained, grows at load 1; every operation O(1)
 * expected). Any key, 0 included; a key is put at most once (check with get).
 * Keys may be chosen by clients (request ids), so buckets are picked by a
 * hash keyed with a random seed drawn at init: a client cannot aim many keys
 * at one bucket. */
typedef struct attnd_idnode_s attnd_idnode_t;
typedef struct {
  attnd_idnode_t **b;
  uint32_t nb, count;
  uint64_t seed;
} attnd_idmap_t;

int attnd_idmap_init(attnd_idmap_t *m);
void attnd_idmap_free(attnd_idmap_t *m);
void *attnd_idmap_get(const attnd_idmap_t *m, uint64_t key);
int attnd_idmap_put(attnd_idmap_t *m, uint64_t key, void *val);
void attnd_idmap_del(attnd_idmap_t *m, uint64_t key);
/* How many entries a lookup of key compares (its bucket's chain up to key, or
 * all of it when key is absent): what the tests bound to show O(1). */
uint32_t attnd_idmap_probes(const attnd_idmap_t *m, uint64_t key);

/* ---- counters and histograms -------------------------------------------------
 * Written and read on the loop thread only (no locking). Counters only grow. */

/* Answers by wire status code, and how many were not OK. */
typedef struct {
  uint64_t by_code[ATTND_STATUS_COUNT];
  uint64_t errors;
} attnd_status_counts_t;

/* Counts one answer with this wire code (out of range: INTERNAL). */
void attnd_status_count(attnd_status_counts_t *c, int code);

/* Latency histogram buckets (upper bounds, microseconds), +Inf implied. */
#define ATTND_HIST_BUCKETS 14
extern const double attnd_hist_bounds_us[ATTND_HIST_BUCKETS];

typedef struct {
  uint64_t bucket[ATTND_HIST_BUCKETS + 1]; /* non-cumulative; last is +Inf */
  uint64_t count;
  double sum_us;
} attnd_hist_t;

void attnd_hist_add(attnd_hist_t *h, double us);

#endif /* ATTND_BASE_H */

/* log.h: one line per event on stderr, with key=value fields.
 *
 *   2026-11-29T19:40:00.123Z level=info event=listening unix=/run/attnd/attnd.sock
 *
 * The caller formats the fields (printf-style, already "key=value ..."); the
 * logger adds the time, the level and the event name. Lines are written with
 * one write(2) each so that lines from different threads never interleave.
 * Secrets (tokens) are never passed to the logger. */
#ifndef ATTND_LOG_H
#define ATTND_LOG_H

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

/* Writes one line: time, level, event, then the formatted fields. */
void attnd_log(attnd_log_level_t level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define ATTND_LOGE(ev, ...) attnd_log(ATTND_LOG_ERROR, ev, __VA_ARGS__)
#define ATTND_LOGW(ev, ...) attnd_log(ATTND_LOG_WARN, ev, __VA_ARGS__)
#define ATTND_LOGI(ev, ...) attnd_log(ATTND_LOG_INFO, ev, __VA_ARGS__)
#define ATTND_LOGD(ev, ...)                                                                        \
  do {                                                                                             \
    if (attnd_log_enabled(ATTND_LOG_DEBUG))                                                        \
      attnd_log(ATTND_LOG_DEBUG, ev, __VA_ARGS__);                                                 \
  } while (0)

#endif /* ATTND_LOG_H */

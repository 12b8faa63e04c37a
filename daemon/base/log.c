/* log.c: the logger (base.h). */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *const level_names[] = {"error", "warn", "info", "debug"};
/* Read from worker threads too; a torn read of an int is harmless here. */
static volatile int cur_level = ATTND_LOG_INFO;

int attnd_log_level_parse(const char *name) {
  for (int i = 0; i < 4; i++)
    if (strcmp(name, level_names[i]) == 0)
      return i;
  if (strcmp(name, "warning") == 0)
    return ATTND_LOG_WARN;
  return -1;
}

void attnd_log_set_level(attnd_log_level_t level) {
  cur_level = (int)level;
}

int attnd_log_enabled(attnd_log_level_t level) {
  return (int)level <= cur_level;
}

void attnd_log(attnd_log_level_t level, const char *event, const char *fmt, ...) {
  if (!attnd_log_enabled(level))
    return;
  char line[2048];
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  int n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s event=%s",
                   tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                   ts.tv_nsec / 1000000, level_names[level], event);
  if (n < 0)
    return;
  if (fmt && fmt[0] && (size_t)n < sizeof(line) - 2) {
    line[n++] = ' ';
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    if (m > 0)
      n += m;
    else
      n--; /* no fields: drop the separator */
  }
  if ((size_t)n > sizeof(line) - 2)
    n = (int)sizeof(line) - 2;
  line[n++] = '\n';
  /* One write per line keeps concurrent lines whole. */
  ssize_t w = write(STDERR_FILENO, line, (size_t)n);
  (void)w;
}

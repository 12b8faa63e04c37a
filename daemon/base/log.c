/* log.c: the logger (base.h).
 *
 * Lines go to one file descriptor: stderr, or a --log-file opened for
 * appending. Reopening (SIGHUP, after logrotate moved the file) opens the
 * path again and dup2()s it over that descriptor, so a thread writing at that
 * moment writes whole lines to the old file or the new one, never to a
 * closed descriptor. When stderr is the journal (systemd's JOURNAL_STREAM
 * names its device and inode) every line starts with its syslog priority,
 * "<3>" for errors (sd-daemon(3)), which journald strips and records.
 *
 * Rate-limited lines (attnd_log_limited) keep, per key, a count of lines in
 * the current window; past the burst they are counted, not written, and the
 * count is reported once the window is over, by the next line of that key or
 * by attnd_log_limited_flush(). */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *const level_names[] = {"error", "warn", "info", "debug"};
/* syslog priorities: LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG. */
static const char *const level_prio[] = {"<3>", "<4>", "<6>", "<7>"};
/* Read from worker threads too; a torn read of an int is harmless here. */
static volatile int cur_level = ATTND_LOG_INFO;
static volatile int log_fd = STDERR_FILENO;
static volatile int journal;
static char log_path[256];

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

int attnd_log_journal(void) {
  return journal;
}

/* JOURNAL_STREAM is "DEV:INODE" of the stream systemd connected; it is the
 * journal only if stderr is still that very stream (not redirected since). */
static int stderr_is_journal(void) {
  const char *js = getenv("JOURNAL_STREAM");
  unsigned long long dev, ino;
  struct stat st;
  if (!js || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) != 0)
    return 0;
  return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

static int open_path(const char *path, char *err, size_t errlen) {
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, 0640);
  if (fd < 0)
    snprintf(err, errlen, "--log-file '%s': %s", path, strerror(errno));
  return fd;
}

int attnd_log_open(const char *path, char *err, size_t errlen) {
  if (!path || !path[0]) {
    log_path[0] = 0;
    journal = stderr_is_journal();
    return 0;
  }
  if (strlen(path) >= sizeof(log_path)) {
    snprintf(err, errlen, "--log-file: path too long");
    return ATTND_EINVAL;
  }
  int fd = open_path(path, err, errlen);
  if (fd < 0)
    return ATTND_EIO;
  snprintf(log_path, sizeof(log_path), "%s", path);
  journal = 0; /* a file is not the journal */
  log_fd = fd;
  return 0;
}

int attnd_log_reopen(char *err, size_t errlen) {
  if (!log_path[0])
    return 0;
  int fd = open_path(log_path, err, errlen);
  if (fd < 0)
    return ATTND_EIO;
  if (dup2(fd, log_fd) < 0) {
    snprintf(err, errlen, "--log-file '%s': dup2: %s", log_path, strerror(errno));
    close(fd);
    return ATTND_EIO;
  }
  close(fd);
  return 0;
}

const char *attnd_log_file(void) {
  return log_path;
}

/* One line: [<prio>]time level event [label] fields. */
static void write_line(attnd_log_level_t level, const char *event, const char *label,
                       const char *fmt, va_list ap) {
  char line[2048];
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  int n =
      snprintf(line, sizeof(line), "%s%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s event=%s%s%s",
               journal ? level_prio[level] : "", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
               tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000, level_names[level], event,
               label && label[0] ? " " : "", label ? label : "");
  if (n < 0)
    return;
  if ((size_t)n > sizeof(line) - 2)
    n = (int)sizeof(line) - 2;
  if (fmt && fmt[0] && (size_t)n < sizeof(line) - 2) {
    line[n++] = ' ';
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    if (m > 0)
      n += m;
    else
      n--; /* no fields: drop the separator */
  }
  if ((size_t)n > sizeof(line) - 2)
    n = (int)sizeof(line) - 2;
  line[n++] = '\n';
  /* One write per line keeps concurrent lines whole. */
  ssize_t w = write(log_fd, line, (size_t)n);
  (void)w;
}

void attnd_log(attnd_log_level_t level, const char *event, const char *fmt, ...) {
  if (!attnd_log_enabled(level))
    return;
  va_list ap;
  va_start(ap, fmt);
  write_line(level, event, NULL, fmt, ap);
  va_end(ap);
}

void attnd_log_plain(attnd_log_level_t level, const char *fmt, ...) {
  char text[1024];
  /* Interactive use reads the text as is; the journal gets its priority. */
  size_t p = journal ? 3 : 0;
  memcpy(text, level_prio[level], 3);
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(text + p, sizeof(text) - p, fmt, ap);
  va_end(ap);
  if (n < 0)
    return;
  size_t len = p + (size_t)n < sizeof(text) ? p + (size_t)n : sizeof(text) - 1;
  ssize_t w = write(STDERR_FILENO, text, len);
  (void)w;
}

size_t attnd_log_escape(char *dst, size_t cap, const char *src) {
  size_t n = 0;
  if (cap == 0)
    return 0;
  for (; *src && n + 3 < cap; src++) {
    unsigned char ch = (unsigned char)*src;
    if (ch == '"' || ch == '\\') {
      dst[n++] = '\\';
      dst[n++] = (char)ch;
    } else if (ch < 0x20 || ch == 0x7f) {
      dst[n++] = ' ';
    } else {
      dst[n++] = (char)ch;
    }
  }
  dst[n] = 0;
  return n;
}

/* ---- rate-limited lines ---- */

typedef struct {
  uint64_t window_ms; /* start of the current window; 0 never used */
  uint32_t lines;     /* written in the current window */
  uint64_t suppressed;
  attnd_log_level_t level;
  const char *event;
  char label[96];
} rl_key_t;

static rl_key_t rl[ATTND_LOG_RL_KEYS];
static pthread_mutex_t rl_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t (*rl_clock)(void);

static uint64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

void attnd_log_limited_clock(uint64_t (*now_ms)(void)) {
  rl_clock = now_ms;
}

static void emit_summary(rl_key_t *k) {
  attnd_log(k->level, k->event, "%s suppressed=%llu window_s=%d", k->label,
            (unsigned long long)k->suppressed, ATTND_LOG_RL_WINDOW_MS / 1000);
  k->suppressed = 0;
}

void attnd_log_limited(attnd_log_level_t level, unsigned key, const char *event, const char *label,
                       const char *fmt, ...) {
  if (!attnd_log_enabled(level))
    return;
  uint64_t now = rl_clock ? rl_clock() : mono_ms();
  rl_key_t *k = &rl[key % ATTND_LOG_RL_KEYS];
  int write_it;
  pthread_mutex_lock(&rl_mu);
  if (k->window_ms == 0 || now - k->window_ms >= ATTND_LOG_RL_WINDOW_MS) {
    if (k->suppressed)
      emit_summary(k);
    k->window_ms = now ? now : 1;
    k->lines = 0;
  }
  k->level = level;
  k->event = event;
  snprintf(k->label, sizeof(k->label), "%s", label ? label : "");
  write_it = k->lines < ATTND_LOG_RL_BURST;
  if (write_it)
    k->lines++;
  else
    k->suppressed++;
  pthread_mutex_unlock(&rl_mu);
  if (!write_it)
    return;
  va_list ap;
  va_start(ap, fmt);
  write_line(level, event, label, fmt, ap);
  va_end(ap);
}

void attnd_log_limited_flush(int all) {
  uint64_t now = rl_clock ? rl_clock() : mono_ms();
  pthread_mutex_lock(&rl_mu);
  for (int i = 0; i < ATTND_LOG_RL_KEYS; i++) {
    rl_key_t *k = &rl[i];
    if (k->suppressed && (all || now - k->window_ms >= ATTND_LOG_RL_WINDOW_MS)) {
      emit_summary(k);
      k->window_ms = now ? now : 1;
      k->lines = 0;
    }
  }
  pthread_mutex_unlock(&rl_mu);
}

/* attnctl_out.c: attnctl's output helpers (JSON members, human units, ids),
 * its clock, and the mapping of client errors to exit codes. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <time.h>

#include "attnctl.h"

const char *attnctl_hex64(uint64_t v, char *buf) {
  snprintf(buf, 17, "%016" PRIx64, v);
  return buf;
}

void attnctl_json_str(const char *s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      printf("\\%c", ch);
    else if (ch == '\n')
      printf("\\n");
    else if (ch < 0x20)
      printf("\\u%04x", ch);
    else
      putchar(ch);
  }
  putchar('"');
}

void attnctl_json_kstr(const char *k, const char *v, int *first) {
  printf("%s\"%s\":", *first ? "" : ",", k);
  attnctl_json_str(v);
  *first = 0;
}

void attnctl_json_ku(const char *k, uint64_t v, int *first) {
  printf("%s\"%s\":%" PRIu64, *first ? "" : ",", k, v);
  *first = 0;
}

void attnctl_json_kf(const char *k, double v, int *first) {
  printf("%s\"%s\":", *first ? "" : ",", k);
  if (isfinite(v))
    printf("%.6g", v);
  else
    printf("null");
  *first = 0;
}

const char *attnctl_bytes(uint64_t b, char *buf, size_t len) {
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%" PRIu64 " B", b);
  else
    snprintf(buf, len, "%.1f %s", v, units[u]);
  return buf;
}

const char *attnctl_duration(uint64_t s, char *buf, size_t len) {
  if (s >= 86400)
    snprintf(buf, len, "%" PRIu64 "d%02" PRIu64 "h%02" PRIu64 "m", s / 86400, s / 3600 % 24,
             s / 60 % 60);
  else if (s >= 3600)
    snprintf(buf, len, "%" PRIu64 "h%02" PRIu64 "m%02" PRIu64 "s", s / 3600, s / 60 % 60, s % 60);
  else if (s >= 60)
    snprintf(buf, len, "%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
  else
    snprintf(buf, len, "%" PRIu64 "s", s);
  return buf;
}

double attnctl_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void attnctl_sleep(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

int attnctl_report(attnd_client_t *c, int rc, const char *what) {
  if (rc == ATTND_CLIENT_ECONNECT) {
    fprintf(stderr, "attnctl: %s\n", attnd_client_errmsg(c));
    return ATTNCTL_CONNECT;
  }
  fprintf(stderr, "attnctl: %s: %s\n", what, attnd_client_errmsg(c));
  return ATTNCTL_DAEMON;
}

/* test_base_log: the logger (daemon/base/log.c): journald priorities when
 * stderr is the journal, the log file and its reopening, rate-limited lines
 * with their "suppressed" counts, field escaping, and the level of each
 * status code. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base.h"

static char dir[64];

static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  static char buf[1 << 16];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  return buf;
}

static int count(const char *text, const char *needle) {
  int n = 0;
  for (const char *p = text; (p = strstr(p, needle)) != NULL; p += strlen(needle))
    n++;
  return n;
}

static int setup(void **state) {
  snprintf(dir, sizeof(dir), "/tmp/attnd-test-log-XXXXXX");
  return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state) {
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
  return system(cmd) == 0 ? 0 : -1;
}

/* stderr that is the stream JOURNAL_STREAM names gets "<N>" on every line;
 * the same stderr without the variable (or another stream) does not. */
static void test_journal_priorities(void **state) {
  char path[128], err[256], js[64];
  snprintf(path, sizeof(path), "%s/stderr", dir);
  int saved = dup(STDERR_FILENO);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  assert_true(fd >= 0);
  dup2(fd, STDERR_FILENO);
  close(fd);
  struct stat st;
  assert_int_equal(fstat(STDERR_FILENO, &st), 0);
  snprintf(js, sizeof(js), "%llu:%llu", (unsigned long long)st.st_dev,
           (unsigned long long)st.st_ino);
  setenv("JOURNAL_STREAM", js, 1);
  assert_int_equal(attnd_log_open(NULL, err, sizeof(err)), 0);
  assert_int_equal(attnd_log_journal(), 1);
  ATTND_LOGE("e1", "k=%d", 1);
  ATTND_LOGW("w1", "k=%d", 2);
  ATTND_LOGI("i1", "%s", "");
  attnd_log_plain(ATTND_LOG_ERROR, "attnd: %s\n", "plain");
  setenv("JOURNAL_STREAM", "1:2", 1); /* some other stream */
  assert_int_equal(attnd_log_open(NULL, err, sizeof(err)), 0);
  assert_int_equal(attnd_log_journal(), 0);
  ATTND_LOGI("i2", "%s", "");
  unsetenv("JOURNAL_STREAM");
  dup2(saved, STDERR_FILENO);
  close(saved);
  const char *t = slurp(path);
  assert_non_null(strstr(t, "<3>"));
  assert_true(strncmp(t, "<3>", 3) == 0);
  assert_non_null(strstr(t, "\n<4>"));
  assert_non_null(strstr(t, "level=warn event=w1 k=2\n"));
  assert_non_null(strstr(t, "\n<6>"));
  assert_non_null(strstr(t, "\n<3>attnd: plain\n"));
  /* The last line, after the stream changed, has no priority. */
  const char *last = strstr(t, "event=i2");
  assert_non_null(last);
  while (last > t && last[-1] != '\n')
    last--;
  assert_true(last[0] != '<');
}

/* --log-file: lines are appended; after a rename (logrotate) a reopen
 * starts the file anew at the same path, and no line is lost. */
static void test_log_file_reopen(void **state) {
  char path[128], moved[128], err[256];
  snprintf(path, sizeof(path), "%s/attnd.log", dir);
  snprintf(moved, sizeof(moved), "%s/attnd.log.1", dir);
  assert_int_equal(attnd_log_open(path, err, sizeof(err)), 0);
  assert_string_equal(attnd_log_file(), path);
  assert_int_equal(attnd_log_journal(), 0);
  ATTND_LOGI("before", "n=%d", 1);
  assert_int_equal(rename(path, moved), 0);
  ATTND_LOGI("between", "n=%d", 2); /* still the old file: it is open */
  assert_int_equal(attnd_log_reopen(err, sizeof(err)), 0);
  ATTND_LOGI("after", "n=%d", 3);
  const char *old = slurp(moved);
  assert_non_null(strstr(old, "event=before n=1\n"));
  assert_non_null(strstr(old, "event=between n=2\n"));
  assert_null(strstr(old, "event=after"));
  const char *now = slurp(path);
  assert_non_null(strstr(now, "event=after n=3\n"));
  /* A path that cannot be opened is an error naming it; the old file stays. */
  char bad[160];
  snprintf(bad, sizeof(bad), "%s/no/such/dir/x.log", dir);
  assert_int_not_equal(attnd_log_open(bad, err, sizeof(err)), 0);
  assert_non_null(strstr(err, bad));
  ATTND_LOGI("still", "%s", "");
  assert_non_null(strstr(slurp(path), "event=still"));
  assert_int_equal(attnd_log_open(NULL, err, sizeof(err)), 0); /* back to stderr */
}

static uint64_t fake_now;
static uint64_t fake_clock(void) {
  return fake_now;
}

/* At most ATTND_LOG_RL_BURST lines per key and window; the rest are counted
 * and reported once the window is over; keys do not share a budget. */
static void test_rate_limited(void **state) {
  char path[128], err[256];
  snprintf(path, sizeof(path), "%s/rl.log", dir);
  assert_int_equal(attnd_log_open(path, err, sizeof(err)), 0);
  attnd_log_limited_clock(fake_clock);
  fake_now = 1000;
  for (int i = 0; i < 50; i++)
    attnd_log_limited(ATTND_LOG_INFO, 7, "request_failed", "method=step code=NOT_FOUND", "i=%d", i);
  for (int i = 0; i < 3; i++)
    attnd_log_limited(ATTND_LOG_WARN, 8, "request_failed", "method=plan code=UNAVAILABLE", "i=%d",
                      i);
  const char *t = slurp(path);
  assert_int_equal(count(t, "method=step code=NOT_FOUND i="), ATTND_LOG_RL_BURST);
  assert_int_equal(count(t, "method=plan code=UNAVAILABLE i="), 3);
  assert_int_equal(count(t, "suppressed="), 0);
  /* Within the window a flush reports nothing; after it, the count. */
  fake_now += ATTND_LOG_RL_WINDOW_MS - 1;
  attnd_log_limited_flush(0);
  assert_int_equal(count(slurp(path), "suppressed="), 0);
  fake_now += 1;
  attnd_log_limited_flush(0);
  t = slurp(path);
  assert_non_null(strstr(t, "level=info event=request_failed method=step code=NOT_FOUND "
                            "suppressed=45 window_s=10\n"));
  assert_int_equal(count(t, "suppressed="), 1);
  /* The next window has its own burst; its count comes with its next line. */
  for (int i = 0; i < ATTND_LOG_RL_BURST + 2; i++)
    attnd_log_limited(ATTND_LOG_INFO, 7, "request_failed", "method=step code=NOT_FOUND", "j=%d", i);
  fake_now += ATTND_LOG_RL_WINDOW_MS;
  attnd_log_limited(ATTND_LOG_INFO, 7, "request_failed", "method=step code=NOT_FOUND", "k=1");
  t = slurp(path);
  assert_int_equal(count(t, " j="), ATTND_LOG_RL_BURST);
  assert_non_null(strstr(t, "suppressed=2 window_s=10\n"));
  assert_non_null(strstr(t, "code=NOT_FOUND k=1\n"));
  /* At exit every count is reported, whatever its window. */
  for (int i = 0; i < ATTND_LOG_RL_BURST + 1; i++)
    attnd_log_limited(ATTND_LOG_INFO, 7, "request_failed", "method=step code=NOT_FOUND", "m=%d", i);
  attnd_log_limited_flush(1);
  assert_int_equal(count(slurp(path), "suppressed=2 window_s"), 2);
  /* Below the level: neither written nor counted. */
  attnd_log_set_level(ATTND_LOG_WARN);
  for (int i = 0; i < 20; i++)
    attnd_log_limited(ATTND_LOG_INFO, 9, "quiet", "k=9", "%s", "");
  attnd_log_set_level(ATTND_LOG_INFO);
  fake_now += ATTND_LOG_RL_WINDOW_MS;
  attnd_log_limited_flush(1);
  assert_int_equal(count(slurp(path), "event=quiet"), 0);
  attnd_log_limited_clock(NULL);
  assert_int_equal(attnd_log_open(NULL, err, sizeof(err)), 0);
}

static void test_escape_and_levels(void **state) {
  char out[32];
  attnd_log_escape(out, sizeof(out), "a\"b\\c\nd");
  assert_string_equal(out, "a\\\"b\\\\c d");
  attnd_log_escape(out, 8, "0123456789");
  assert_true(strlen(out) < 8);
  assert_int_equal(attnd_status_log_level(ATTND_STATUS_INTERNAL), ATTND_LOG_ERROR);
  assert_int_equal(attnd_status_log_level(ATTND_STATUS_UNAVAILABLE), ATTND_LOG_WARN);
  assert_int_equal(attnd_status_log_level(ATTND_STATUS_RESOURCE_EXHAUSTED), ATTND_LOG_WARN);
  assert_int_equal(attnd_status_log_level(ATTND_STATUS_INVALID_ARGUMENT), ATTND_LOG_INFO);
  assert_int_equal(attnd_status_log_level(ATTND_STATUS_NOT_FOUND), ATTND_LOG_INFO);
  assert_int_equal(attnd_status_log_level(99), ATTND_LOG_ERROR);
  /* Every failure is visible at the default level (info). */
  for (int code = 1; code < ATTND_STATUS_COUNT; code++)
    assert_true(attnd_status_log_level(code) <= ATTND_LOG_INFO);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_journal_priorities),
      cmocka_unit_test(test_log_file_reopen),
      cmocka_unit_test(test_rate_limited),
      cmocka_unit_test(test_escape_and_levels),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

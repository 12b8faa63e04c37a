/* test_net_frame.c: the frame reader (daemon/net/frame.c) on split, coalesced and bad input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"
#include "net.h"

typedef struct {
  int n;
  uint8_t *frames[16];
  size_t lens[16];
  int pause_after; /* pause after this many frames (0: never) */
} sink_t;

static int sink_cb(void *arg, uint8_t *frame, size_t len) {
  sink_t *s = arg;
  assert_true(s->n < 16);
  s->frames[s->n] = frame;
  s->lens[s->n] = len;
  s->n++;
  if (s->pause_after && s->n == s->pause_after)
    return ATTND_FRAME_PAUSE;
  return 0;
}

static void sink_free(sink_t *s) {
  for (int i = 0; i < s->n; i++)
    free(s->frames[i]);
  s->n = 0;
}

/* Builds frames with bodies of the given lengths; body byte j of frame i is i*31+j. */
static size_t build(uint8_t *out, const size_t *lens, int n) {
  size_t o = 0;
  for (int i = 0; i < n; i++) {
    attnd_rpc_frame_header(out + o, (uint32_t)lens[i]);
    o += 4;
    for (size_t j = 0; j < lens[i]; j++)
      out[o++] = (uint8_t)(i * 31 + j);
  }
  return o;
}

static void check(const sink_t *s, const size_t *lens, int n) {
  assert_int_equal(s->n, n);
  for (int i = 0; i < n; i++) {
    assert_int_equal(s->lens[i], lens[i]);
    for (size_t j = 0; j < lens[i]; j++)
      assert_int_equal(s->frames[i][j], (uint8_t)(i * 31 + j));
  }
}

static void test_coalesced(void **state) {
  uint8_t buf[4096];
  size_t lens[] = {1, 100, 7, 1000};
  size_t n = build(buf, lens, 4);
  attnd_frame_reader_t r;
  sink_t s = {0};
  attnd_frame_reader_init(&r, 1 << 20);
  assert_int_equal(attnd_frame_reader_feed(&r, buf, n, sink_cb, &s), 0);
  check(&s, lens, 4);
  assert_false(attnd_frame_reader_partial(&r));
  sink_free(&s);
  attnd_frame_reader_free(&r);
}

static void test_split_every_byte(void **state) {
  uint8_t buf[4096];
  size_t lens[] = {3, 300, 1};
  size_t n = build(buf, lens, 3);
  attnd_frame_reader_t r;
  sink_t s = {0};
  attnd_frame_reader_init(&r, 1 << 20);
  for (size_t i = 0; i < n; i++) {
    assert_int_equal(attnd_frame_reader_feed(&r, buf + i, 1, sink_cb, &s), 0);
    if (i == 1)
      assert_true(attnd_frame_reader_partial(&r));
  }
  check(&s, lens, 3);
  sink_free(&s);
  attnd_frame_reader_free(&r);
}

/* Splits at every pair of cut points: headers and bodies split anywhere. */
static void test_split_anywhere(void **state) {
  uint8_t buf[256];
  size_t lens[] = {5, 9, 2};
  size_t n = build(buf, lens, 3);
  for (size_t a = 0; a <= n; a++) {
    for (size_t b = a; b <= n; b++) {
      attnd_frame_reader_t r;
      sink_t s = {0};
      attnd_frame_reader_init(&r, 64);
      assert_int_equal(attnd_frame_reader_feed(&r, buf, a, sink_cb, &s), 0);
      assert_int_equal(attnd_frame_reader_feed(&r, buf + a, b - a, sink_cb, &s), 0);
      assert_int_equal(attnd_frame_reader_feed(&r, buf + b, n - b, sink_cb, &s), 0);
      check(&s, lens, 3);
      sink_free(&s);
      attnd_frame_reader_free(&r);
    }
  }
}

/* A large body is read straight into the frame's own buffer: the callback gets
 * the very buffer the reads went into. */
static void test_zero_copy_body(void **state) {
  attnd_frame_reader_t r;
  sink_t s = {0};
  uint8_t *base;
  size_t len;
  const size_t N = 3 * ATTND_FRAME_SCRATCH + 5;
  attnd_frame_reader_init(&r, 1 << 24);
  assert_int_equal(attnd_frame_reader_buf(&r, &base, &len), 0);
  assert_int_equal(len, ATTND_FRAME_SCRATCH);
  attnd_rpc_frame_header(base, (uint32_t)N);
  assert_int_equal(attnd_frame_reader_feed(&r, base, 4, sink_cb, &s), 0);
  uint8_t *first = NULL;
  size_t got = 0;
  while (got < N) {
    assert_int_equal(attnd_frame_reader_buf(&r, &base, &len), 0);
    assert_int_equal(len, N - got);
    if (!first)
      first = base;
    assert_ptr_equal(base, first + got); /* the rest of one buffer */
    size_t chunk = len < 40000 ? len : 40000;
    memset(base, (int)(got & 0xff), chunk);
    assert_int_equal(attnd_frame_reader_feed(&r, base, chunk, sink_cb, &s), 0);
    got += chunk;
  }
  assert_int_equal(s.n, 1);
  assert_ptr_equal(s.frames[0], first);
  assert_int_equal(s.lens[0], N);
  sink_free(&s);
  attnd_frame_reader_free(&r);
}

static void test_zero_length(void **state) {
  uint8_t buf[16] = {0, 0, 0, 0, 0, 0, 0, 1, 'x'};
  attnd_frame_reader_t r;
  sink_t s = {0};
  attnd_frame_reader_init(&r, 64);
  assert_int_equal(attnd_frame_reader_feed(&r, buf, 9, sink_cb, &s), ATTND_EINVAL);
  assert_int_equal(s.n, 0);
  /* Sticky: nothing more is accepted. */
  assert_int_equal(attnd_frame_reader_feed(&r, buf + 4, 5, sink_cb, &s), ATTND_EINVAL);
  assert_int_equal(s.n, 0);
  attnd_frame_reader_free(&r);
}

static void test_limits(void **state) {
  uint8_t buf[256];
  attnd_frame_reader_t r;
  sink_t s = {0};
  /* Exactly the limit is fine. */
  size_t ok[] = {64};
  size_t n = build(buf, ok, 1);
  attnd_frame_reader_init(&r, 64);
  assert_int_equal(attnd_frame_reader_feed(&r, buf, n, sink_cb, &s), 0);
  assert_int_equal(s.n, 1);
  sink_free(&s);
  /* One over is rejected before any body byte is needed. */
  attnd_rpc_frame_header(buf, 65);
  assert_int_equal(attnd_frame_reader_feed(&r, buf, 4, sink_cb, &s), ATTND_ENOSPC);
  assert_int_equal(r.bad_len, 65);
  attnd_frame_reader_free(&r);
  /* The largest header value. */
  attnd_frame_reader_init(&r, (1u << 31) - 1);
  memset(buf, 0xff, 4);
  assert_int_equal(attnd_frame_reader_feed(&r, buf, 4, sink_cb, &s), ATTND_ENOSPC);
  assert_int_equal(r.bad_len, 0xffffffffu);
  attnd_frame_reader_free(&r);
}

static void test_pause_resume(void **state) {
  uint8_t buf[512];
  size_t lens[] = {10, 20, 30, 40};
  size_t n = build(buf, lens, 4);
  attnd_frame_reader_t r;
  sink_t s = {0};
  s.pause_after = 1;
  attnd_frame_reader_init(&r, 1024);
  assert_int_equal(attnd_frame_reader_feed(&r, buf, n - 5, sink_cb, &s), ATTND_FRAME_PAUSE);
  assert_int_equal(s.n, 1);
  assert_true(attnd_frame_reader_paused(&r));
  s.pause_after = 3;
  assert_int_equal(attnd_frame_reader_resume(&r, sink_cb, &s), ATTND_FRAME_PAUSE);
  assert_int_equal(s.n, 3);
  s.pause_after = 0;
  assert_int_equal(attnd_frame_reader_resume(&r, sink_cb, &s), 0);
  assert_false(attnd_frame_reader_paused(&r));
  assert_int_equal(s.n, 3);
  assert_int_equal(attnd_frame_reader_feed(&r, buf + n - 5, 5, sink_cb, &s), 0);
  check(&s, lens, 4);
  sink_free(&s);
  attnd_frame_reader_free(&r);
}

/* Random chunking of a random stream of frames, read half the time through
 * the reader's own buffer: what comes out is what went in. */
static void test_random_chunks(void **state) {
  srand(777);
  for (int round = 0; round < 200; round++) {
    size_t lens[12];
    int nf = 1 + rand() % 12;
    size_t total = 0;
    for (int i = 0; i < nf; i++) {
      lens[i] = 1 + (size_t)(rand() % 3000);
      total += 4 + lens[i];
    }
    uint8_t *buf = malloc(total);
    size_t n = build(buf, lens, nf);
    assert_int_equal(n, total);
    attnd_frame_reader_t r;
    sink_t s = {0};
    attnd_frame_reader_init(&r, 3000);
    size_t off = 0;
    while (off < n) {
      size_t chunk = 1 + (size_t)(rand() % 5000);
      if (chunk > n - off)
        chunk = n - off;
      /* Half the time read through the reader's own buffer, as libuv does. */
      if (rand() & 1) {
        uint8_t *base;
        size_t len;
        assert_int_equal(attnd_frame_reader_buf(&r, &base, &len), 0);
        if (chunk > len)
          chunk = len;
        memcpy(base, buf + off, chunk);
        assert_int_equal(attnd_frame_reader_feed(&r, base, chunk, sink_cb, &s), 0);
      } else {
        assert_int_equal(attnd_frame_reader_feed(&r, buf + off, chunk, sink_cb, &s), 0);
      }
      off += chunk;
    }
    check(&s, lens, nf);
    sink_free(&s);
    attnd_frame_reader_free(&r);
    free(buf);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_coalesced),      cmocka_unit_test(test_split_every_byte),
      cmocka_unit_test(test_split_anywhere), cmocka_unit_test(test_zero_copy_body),
      cmocka_unit_test(test_zero_length),    cmocka_unit_test(test_limits),
      cmocka_unit_test(test_pause_resume),   cmocka_unit_test(test_random_chunks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_engine_sinks.c: the attention sinks table (daemon/engine/sinks.c):
 * validation (and that a refused request changes nothing), versions, the
 * file's round trip, and files that must be ignored (another shape, a flipped
 * byte, a truncated table). End to end (SetSinks over RPC, restarts, served
 * outputs) is tests/e2e/test_variants.py. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "internal.h" /* daemon/engine: the sinks table */

enum { QH = 4, LAYERS = 3 };

static float vals[QH + 1];

static attnd_tensor_t ft(float *p, int ndim, uint32_t a, uint32_t b) {
  attnd_tensor_t t = {.present = 1, .dtype = ATTND_DT_FP32, .ndim = ndim, .data = (uint8_t *)p};
  t.shape[0] = a;
  t.shape[1] = b;
  t.nbytes = (size_t)a * (ndim == 2 ? b : 1) * 4;
  return t;
}

static void test_validate(void **state) {
  char msg[256];
  attnd_sinks_t s;
  assert_int_equal(attnd_sinks_init(&s, 1, LAYERS, QH, NULL), 0);
  for (int i = 0; i < QH; i++)
    vals[i] = (float)i - 1.5f;
  attnd_sinks_req_t r = {.layer = 2, .sinks = ft(vals, 1, QH, 0)};
  assert_int_equal(attnd_sinks_validate(&s, &r, msg, sizeof(msg)), 0);
  struct {
    attnd_sinks_req_t r;
    const char *needle;
  } bad[] = {
      {{.layer = LAYERS, .sinks = ft(vals, 1, QH, 0)}, "layer 3 >= layers 3"},
      {{.layer = 0, .sinks = ft(vals, 1, QH + 1, 0)}, "shape must be [4]"},
      {{.layer = 0, .sinks = ft(vals, 2, QH, 1)}, "shape must be [4]"},
      {{.layer = 0}, "sinks missing"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    assert_int_equal(attnd_sinks_validate(&s, &bad[i].r, msg, sizeof(msg)), ATTND_EINVAL);
    if (!strstr(msg, bad[i].needle))
      fail_msg("case %zu: '%s', expected '%s'", i, msg, bad[i].needle);
  }
  attnd_sinks_req_t wrong = r;
  wrong.sinks.dtype = ATTND_DT_BF16;
  assert_int_equal(attnd_sinks_validate(&s, &wrong, msg, sizeof(msg)), ATTND_EINVAL);
  wrong = r;
  wrong.sinks.nbytes -= 4;
  assert_int_equal(attnd_sinks_validate(&s, &wrong, msg, sizeof(msg)), ATTND_EINVAL);
  vals[1] = 1.0f / 0.0f;
  assert_int_equal(attnd_sinks_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  assert_non_null(strstr(msg, "sinks[1]"));
  vals[1] = 0.0f / 0.0f;
  assert_int_equal(attnd_sinks_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  /* Nothing was applied by any of it. */
  for (int l = 0; l < LAYERS; l++)
    assert_int_equal(s.l[l].present, 0);
  assert_int_equal(s.last_version, 0);
  attnd_sinks_free(&s);
  /* Off: no table, every request refused, saying how to turn sinks on. */
  assert_int_equal(attnd_sinks_init(&s, 0, LAYERS, QH, NULL), 0);
  vals[1] = 0.5f;
  assert_int_equal(attnd_sinks_validate(&s, &r, msg, sizeof(msg)), ATTND_EINVAL);
  assert_non_null(strstr(msg, "attention-sinks"));
  attnd_sinks_free(&s);
}

static void write_bytes(const char *path, const uint8_t *p, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(p, 1, n, f), n);
  fclose(f);
}

static void test_versions_and_file(void **state) {
  char dir[64], path[128], err[256];
  snprintf(dir, sizeof(dir), "/tmp/attnd-test-sinks-XXXXXX");
  assert_non_null(mkdtemp(dir));
  snprintf(path, sizeof(path), "%s/sinks.bin", dir);
  attnd_sinks_t s, t;
  assert_int_equal(attnd_sinks_init(&s, 1, LAYERS, QH, dir), 0);
  assert_string_equal(s.path, path);
  /* No file yet: nothing restored, no error. */
  assert_int_equal(attnd_sinks_load(&s, err, sizeof(err)), 0);
  for (int i = 0; i < QH; i++)
    vals[i] = 0.25f * (float)i - 0.5f;
  attnd_sinks_req_t r = {.layer = 0, .sinks = ft(vals, 1, QH, 0)};
  uint64_t v0 = attnd_sinks_apply(&s, &r);
  r.layer = 2;
  vals[3] = 1e4f;
  uint64_t v2 = attnd_sinks_apply(&s, &r);
  assert_true(v2 > v0 && v0 > 0);
  uint8_t *buf;
  size_t len;
  assert_int_equal(attnd_sinks_serialize(&s, &buf, &len), 0);
  assert_int_equal(attnd_scales_write_file(path, buf, len), 0);
  /* Restored into a fresh table: values, presence, versions, the counter. */
  assert_int_equal(attnd_sinks_init(&t, 1, LAYERS, QH, dir), 0);
  assert_int_equal(attnd_sinks_load(&t, err, sizeof(err)), 0);
  assert_int_equal(t.l[0].present, 1);
  assert_int_equal(t.l[1].present, 0);
  assert_int_equal(t.l[2].present, 1);
  assert_true(t.l[0].version == v0 && t.l[2].version == v2 && t.last_version == v2);
  assert_memory_equal(t.l[2].v, vals, sizeof(float) * QH);
  assert_true(t.l[0].v[3] == 0.25f);
  attnd_sinks_free(&t);
  /* Another shape (more q heads): ignored, with a reason. */
  assert_int_equal(attnd_sinks_init(&t, 1, LAYERS, 2 * QH, dir), 0);
  assert_int_equal(attnd_sinks_load(&t, err, sizeof(err)), 1);
  assert_non_null(strstr(err, "ignored"));
  assert_int_equal(t.l[0].present, 0);
  attnd_sinks_free(&t);
  /* A flipped byte, then a truncated table: ignored, the table untouched. */
  for (int c = 0; c < 2; c++) {
    uint8_t *bad = malloc(len);
    memcpy(bad, buf, len);
    size_t n = len;
    if (c == 0)
      bad[30] ^= 1;
    else
      n = len - 9;
    write_bytes(path, bad, n);
    free(bad);
    assert_int_equal(attnd_sinks_init(&t, 1, LAYERS, QH, dir), 0);
    assert_int_equal(attnd_sinks_load(&t, err, sizeof(err)), 1);
    for (int l = 0; l < LAYERS; l++)
      assert_int_equal(t.l[l].present, 0);
    assert_int_equal(t.last_version, 0);
    attnd_sinks_free(&t);
  }
  free(buf);
  attnd_sinks_free(&s);
  unlink(path);
  rmdir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_validate),
      cmocka_unit_test(test_versions_and_file),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

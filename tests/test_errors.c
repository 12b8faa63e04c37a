/* test_errors: the error list maps to wire codes and texts. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "base.h"

static void test_codes(void **state) {
  (void)state;
  assert_int_equal(attnd_err_status(0), ATTND_STATUS_OK);
  assert_int_equal(attnd_err_status(ATTND_EINVAL), ATTND_STATUS_INVALID_ARGUMENT);
  assert_int_equal(attnd_err_status(ATTND_ENOTFOUND), ATTND_STATUS_NOT_FOUND);
  assert_int_equal(attnd_err_status(ATTND_ENOSPC), ATTND_STATUS_RESOURCE_EXHAUSTED);
  assert_int_equal(attnd_err_status(ATTND_EPRECOND), ATTND_STATUS_FAILED_PRECONDITION);
  assert_int_equal(attnd_err_status(ATTND_ERANGE), ATTND_STATUS_OUT_OF_RANGE);
  assert_int_equal(attnd_err_status(ATTND_EUNAUTH), ATTND_STATUS_UNAUTHENTICATED);
  assert_int_equal(attnd_err_status(-999), ATTND_STATUS_INTERNAL);
  assert_string_equal(attnd_strerror(ATTND_EINVAL), "invalid argument");
  assert_string_equal(attnd_strerror(-999), "unknown error");
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_codes)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

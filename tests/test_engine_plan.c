/* test_engine_plan.c: plans (daemon/engine/plan.c): a step naming an ended
 * plan (replaced by a newer one, or its connection closed) is refused, a
 * connection keeps at most max_plans live plans (the oldest ends first), and
 * none of it changes the sessions (engine_fixture.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine_fixture.h"

static void test_plan_lifetime(void **state) {
  fx_t *f = fx_new(ATTND_KV_INT8, 64);
  char msg[256];
  set_all_scales(f);
  sim_t *a = sim_new();
  fill_tokens(f, a, 0, 300);
  open_session(f, a, 0, NULL, 0);
  spec_t pre = {.sim = a, .start = 0, .n = 14};
  plan_all_layers(f, &pre, 1);
  stepopt_t none = {.wrong_token_item = -1};
  /* Ended and unknown plans. */
  uint64_t p1, p2;
  spec_t pa = {.sim = a, .start = 14, .n = 1};
  assert_int_equal(make_plan(f, &pa, 1, 1, &p1, msg), 0);
  assert_int_equal(make_plan(f, &pa, 1, 1, &p2, msg), 0); /* ends p1 */
  expect(f, step_ex(f, 0, &pa, 1, p1, 1, NULL, msg, NULL), ATTND_EPRECOND, msg, "plan");
  attnd_engine_conn_closed(f->e, 1);
  expect(f, step_ex(f, 0, &pa, 1, p2, 1, &none, msg, NULL), ATTND_EPRECOND, msg, "plan");
  /* Plans per connection: the oldest ends first (max_plans = 4). */
  sim_t *c[5];
  uint64_t pc[5];
  for (int i = 0; i < 5; i++) {
    c[i] = sim_new();
    fill_tokens(f, c[i], 0, 10);
    open_session(f, c[i], 0, NULL, 0);
    spec_t ps = {.sim = c[i], .start = 0, .n = 3};
    assert_int_equal(make_plan(f, &ps, 1, 7, &pc[i], msg), 0);
  }
  spec_t ps0 = {.sim = c[0], .start = 0, .n = 3}, ps1 = {.sim = c[1], .start = 0, .n = 3};
  expect(f, step_ex(f, 0, &ps0, 1, pc[0], 7, NULL, msg, NULL), ATTND_EPRECOND, msg, "plan");
  assert_int_equal(step_ex(f, 0, &ps1, 1, pc[1], 7, NULL, msg, NULL), 0);
  /* None of the refusals above changed a: it continues, all layers. */
  spec_t cont = {.sim = a, .start = 14, .n = 3};
  plan_all_layers(f, &cont, 1);
  spec_t dec = {.sim = a, .start = 17, .n = 1};
  plan_all_layers(f, &dec, 1);
  for (int i = 0; i < 5; i++)
    sim_free(c[i]);
  sim_free(a);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plan_lifetime),
      /* Again with every step queued behind a threadpool scan. */
      cmocka_unit_test_setup_teardown(test_plan_lifetime, queued_on, queued_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

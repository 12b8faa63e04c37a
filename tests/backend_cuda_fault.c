/* backend_cuda_fault.c: test_backend_cuda's --fault run (backend_cuda_fixture.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_fixture.h"

/* Only with --fault (a sticky fault leaves the context unusable, hence
 * its own run): a block table that points far outside the pool makes the
 * kernel fault; the job fails with ATTND_EDEVICE (or ATTND_ECUDA), every
 * later job with ATTND_EDEVICE, and teardown does not hang. */
void test_device_fault(void **state) {
  SKIP_WITHOUT_GPU();
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *gpu = NULL;
  assert_int_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, 1, opts(16ull << 20), err, sizeof(err)), 0);
  titem_t it = {
      .start = 0, .n = 3, .has_q = 1, .mask = ATTND_MASK_CAUSAL, .table = {INT32_MAX / 2}, .nb = 1};
  tjob_spec_t sp;
  spec_step(&sp, 0, &it, 1, 0, 0);
  tjob_t j[2];
  int dummy = 0;
  job_from_spec(&j[0], &sp, &dummy);
  job_from_spec(&j[1], &sp, &dummy);
  /* With host functions staging the inputs, the second job goes in flight
   * behind the faulting one: the fault skips its host function, and it must
   * still be answered. */
  int together = g_opts.cuda_hostfn_min == 0;
  run_all(&loop, gpu, &j[0], together ? 2 : 1);
  print_message("faulting job: status %d (%s), message: %s\n", j[0].job.status,
                attnd_strerror(j[0].job.status), j[0].job.message);
  if (j[0].job.status == 0) {
    /* The kernel's reads stayed in mapped memory: nothing to judge. */
    job_free(&j[0]);
    job_free(&j[1]);
    spec_free(&sp);
    destroy_and_close(&loop, gpu);
    assert_int_equal(uv_loop_close(&loop), 0);
    print_message("no fault happened: skipped\n");
    skip();
  }
  assert_true(j[0].job.status == ATTND_EDEVICE || j[0].job.status == ATTND_ECUDA);
  if (j[0].job.status == ATTND_EDEVICE) {
    if (!together)
      run_all(&loop, gpu, &j[1], 1);
    print_message("next job: status %d, message: %s\n", j[1].job.status, j[1].job.message);
    assert_int_equal(j[1].job.status, ATTND_EDEVICE);
  }
  job_free(&j[0]);
  job_free(&j[1]);
  spec_free(&sp);
  destroy_and_close(&loop, gpu);
  assert_int_equal(uv_loop_close(&loop), 0);
}

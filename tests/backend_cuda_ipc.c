/* backend_cuda_ipc.c: the same-host zero-copy parts of tests/test_backend_cuda.c
 * (backend.h device_io, ipc_open, ipc_close, CHECK jobs): client memory for a
 * step's tensors, and the zero-copy ops on their own. Run on a GPU and over
 * tests/cuda_mock.c, like the rest of the test. */
#include <string.h>

#include "backend_cuda_fixture.h"

/* Moves a step's q, k, v, out and lse into one block from host_alloc and
 * marks the job device_io: pinned host memory is device memory to a kernel
 * (unified addressing), so on a GPU the backend's client-memory path reads
 * and writes it as it would a client's allocation; over the mock it is host
 * memory anyway. out and lse are poisoned (NaN); the step raises a done
 * signal's word there too. */
void io_in_pinned(attnd_backend_t *gpu, attnd_job_t *j, devio_t *d) {
  uint8_t *b = NULL;
  io_in_block(gpu, j, d, &b);
}

void io_in_block(attnd_backend_t *gpu, attnd_job_t *j, devio_t *d, uint8_t **block) {
  static uint64_t seq; /* done values, distinct per step */
  size_t off[6], len[6] = {j->q_bytes, j->kv_bytes, j->kv_bytes, j->out_bytes, j->lse_bytes, 8};
  size_t n = 0;
  for (int i = 0; i < 6; i++) {
    off[i] = n;
    n += (len[i] + 255) & ~(size_t)255;
  }
  if (!*block)
    *block = gpu->ops->host_alloc(gpu, n ? n : 256);
  uint8_t *b = *block;
  assert_non_null(b); /* --cuda-hostfn-min 0: every block is pinned */
  if (j->q_bytes)
    memcpy(b + off[0], j->batch.q, j->q_bytes);
  memcpy(b + off[1], j->batch.k, j->kv_bytes);
  memcpy(b + off[2], j->batch.v, j->kv_bytes);
  memset(b + off[3], 0xff, j->out_bytes + ((len[3] + 255) & ~(size_t)255) - len[3] + j->lse_bytes);
  d->block = b;
  d->out = j->batch.out;
  d->lse = j->batch.lse;
  j->batch.q = j->q_bytes ? b + off[0] : NULL;
  j->batch.k = b + off[1];
  j->batch.v = b + off[2];
  j->batch.out = j->out_bytes ? b + off[3] : NULL;
  j->batch.lse = j->lse_bytes && d->lse ? (float *)(b + off[4]) : NULL;
  j->device_io = 1;
  /* The done signal: raised from 0 to a fresh value after the kernels. */
  d->done = (uint64_t *)(b + off[5]);
  *d->done = 0;
  d->done_value = ++seq << 8 | 0x5a;
  j->done = d->done;
  j->done_value = d->done_value;
}

void io_out(attnd_job_t *j, devio_t *d) {
  if (j->out_bytes)
    memcpy(d->out, j->batch.out, j->out_bytes);
  if (j->batch.lse)
    memcpy(d->lse, j->batch.lse, j->lse_bytes);
  j->batch.out = d->out;
  j->batch.lse = d->lse;
  d->block = NULL;
}

static void check_done(attnd_job_t *j) {
  ++*(int *)j->user;
}

/* The zero-copy ops (backend.h ipc_open, ipc_close, CHECK jobs): the
 * device's UUID is reported; the check (kernels/cuda/ipc.cu) finds the first
 * row past each bound with that row's largest magnitude (NaN above every
 * finite value), and nothing for a clean tensor, twice on one stream (the
 * second check finds its own rows: the first left the stream's state at
 * rest), and a check with no tensors finds nothing. The tensor is pinned host
 * memory (addressable by kernels); ipc_open and ipc_close run over the mock
 * only (a handle is an address there; on a GPU a handle must come from
 * another process: tests/e2e/test_ipc.py). */
void test_ipc_ops(void **state) {
  SKIP_WITHOUT_GPU();
  g_opts.cuda_hostfn_min = 0;
  attnd_kshape_t s = make_shape(ATTND_KV_BF16);
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char err[256] = "";
  attnd_backend_t *gpu = NULL;
  assert_int_equal(
      attnd_backend_cuda_create(&gpu, &loop, &s, 1, opts(16ull << 20), err, sizeof(err)), 0);
  assert_memory_equal(gpu->device_uuid, "GPU-", 4);
  enum { ROWS = 5, RE = 256 };
  uint16_t *x = gpu->ops->host_alloc(gpu, ROWS * RE * 2);
  assert_non_null(x);
  for (int i = 0; i < ROWS * RE; i++)
    x[i] = (i & 1) ? 0xbf80 : 0x3f80; /* -1.0, 1.0 */
  x[2 * RE + 9] = 0xc040;             /* -3.0 in row 2 */
  x[3 * RE + 7] = 0x7fc0;             /* NaN in row 3 */
  uint8_t handle[64] = {0};
  void *p = x, *base = x;
  assert_non_null(gpu->ops->ipc_open);
  if (attnd_cuda_mock_hold) {
    size_t size = 0;
    uint64_t xsize = ROWS * RE * 2;
    memcpy(handle, &p, sizeof(p));
    memcpy(handle + 8, &xsize, sizeof(xsize));
    assert_int_equal(gpu->ops->ipc_open(gpu, handle, &base, &size, err, sizeof(err)), 0);
    assert_ptr_equal(base, x);
    assert_int_equal(size, xsize);
  }
  /* Two checks on layer 0's stream, then one of nothing at all. */
  attnd_job_t j[3];
  int ndone = 0;
  memset(j, 0, sizeof(j));
  for (int i = 0; i < 3; i++) {
    j[i].kind = ATTND_JOB_CHECK;
    j[i].unordered = 1;
    j[i].done_cb = check_done;
    j[i].user = &ndone;
  }
  const size_t rows[3] = {ROWS, ROWS, 2};
  const uint32_t bound[3] = {0x7f7f, 0x4000, 0x7f7f}; /* bf16 max, 2.0, bf16 max */
  for (int t = 0; t < 3; t++) {
    j[0].check.p[t] = base;
    j[0].check.rows[t] = rows[t];
    j[0].check.row_elems[t] = RE;
    j[0].check.bound[t] = bound[t];
  }
  j[1].check = j[0].check;
  j[1].check.p[0] = (const uint16_t *)base + 4 * RE; /* rows 4.. : clean */
  j[1].check.rows[0] = 1;
  j[1].check.rows[1] = 3;       /* rows 0-2 (-3.0 in row 2, the NaN in row 3 left out) */
  j[1].check.bound[1] = 0x4080; /* 4.0: clean */
  for (int i = 0; i < 3; i++)
    assert_int_equal(gpu->ops->submit(gpu, &j[i]), 0);
  while (ndone < 3)
    uv_run(&loop, UV_RUN_ONCE);
  for (int i = 0; i < 3; i++)
    assert_int_equal(j[i].status, 0);
  assert_int_equal(j[0].check.bad[0], 3);
  assert_int_equal(j[0].check.bits[0], 0x7fc0);
  assert_int_equal(j[0].check.bad[1], 2);
  assert_int_equal(j[0].check.bits[1], 0x4040);
  assert_true(j[0].check.bad[2] == SIZE_MAX); /* rows 0 and 1 are clean */
  for (int t = 0; t < 3; t++) {
    assert_true(j[1].check.bad[t] == SIZE_MAX);
    assert_true(j[2].check.bad[t] == SIZE_MAX);
  }
  if (attnd_cuda_mock_hold)
    gpu->ops->ipc_close(gpu, base);
  gpu->ops->host_free(gpu, x);
  destroy_and_close(&loop, gpu);
  assert_int_equal(uv_loop_close(&loop), 0);
}

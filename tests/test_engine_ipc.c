/* test_engine_ipc: the engine's side of same-host zero-copy
 * (daemon/engine/ipc.c, the device-step paths of queue.c and step.c;
 * docs/protocol.md §5a), on the CPU backend given stand-in zero-copy ops:
 * its "device" memory is host memory, a handle is an address, the check (a
 * CHECK job) is the host's max-magnitude rule. So on every CI machine:
 *
 * - RegisterBuffer's open: refused without the ops (the CPU backend as it
 *   is) and for another device; one handle opened twice shares one mapping,
 *   unmapped once, after its last close;
 * - a step over device memory goes through the device check (the admission
 *   queue), writes its output into the given buffer and returns none, with
 *   the same bytes as the same step sent as bytes;
 * - a NaN or a value past its bound in device memory fails the step naming
 *   the item and changes nothing; out_ref/lse_ref of the wrong shape, or
 *   lse_ref without want_lse, are INVALID_ARGUMENT; a check the backend
 *   cannot run fails the step with its status, changing nothing. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_fixture.h"
#include "internal.h" /* daemon/engine: the engine's backend, to give it stand-in ops */

static attnd_backend_ops_t g_ops;
static atomic_int g_opens, g_closes, g_scans;

static int t_ipc_open(attnd_backend_t *b, const uint8_t *handle, void **base, size_t *size,
                      char *err, size_t errlen) {
  atomic_fetch_add(&g_opens, 1);
  memcpy(base, handle, sizeof(*base));
  *size = 1 << 20;
  if (!*base) {
    snprintf(err, errlen, "stand-in: no such handle");
    return ATTND_EPRECOND;
  }
  return 0;
}

static void t_ipc_close(attnd_backend_t *b, void *base) {
  atomic_fetch_add(&g_closes, 1);
}

/* The CPU backend runs CHECK jobs over host memory (backend.h); the
 * stand-in counts them on their way in. */
static int (*g_submit)(attnd_backend_t *b, attnd_job_t *job);
static int g_refuse_check; /* a negative ATTND_E*: the next CHECK job is refused with it */
static int t_submit(attnd_backend_t *b, attnd_job_t *job) {
  if (job->kind == ATTND_JOB_CHECK) {
    atomic_fetch_add(&g_scans, 1);
    if (g_refuse_check) {
      int rc = g_refuse_check;
      g_refuse_check = 0;
      return rc;
    }
  }
  return g_submit(b, job);
}

static fx_t *fx_ipc(void) {
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  attnd_backend_t *be = f->e->be;
  g_ops = *be->ops;
  g_ops.ipc_open = t_ipc_open;
  g_ops.ipc_close = t_ipc_close;
  g_submit = be->ops->submit;
  g_ops.submit = t_submit;
  be->ops = &g_ops;
  snprintf(be->device_uuid, sizeof(be->device_uuid), "GPU-0123abcd");
  atomic_store(&g_opens, 0);
  atomic_store(&g_closes, 0);
  atomic_store(&g_scans, 0);
  return f;
}

static int ipc_open(fx_t *f, void *p, const char *uuid, void **ipc) {
  uint8_t handle[64] = {0};
  memcpy(handle, &p, sizeof(p));
  res_t x = {0};
  attnd_engine_ipc_open(f->e, handle, 1 << 20, uuid, on_done, &x);
  wait_res(f, &x);
  *ipc = x.r.ipc;
  if (x.r.status == 0) {
    assert_ptr_equal(x.r.ipc_base, p);
    assert_int_equal(x.r.ipc_size, 1 << 20);
  }
  return x.r.status;
}

static void test_open_refusals_and_sharing(void **state) {
  fx_t *f = fx_new(ATTND_KV_BF16, 64);
  static uint8_t mem[4096];
  void *ipc = NULL;
  /* The CPU backend as it is: no zero-copy ops. */
  assert_int_equal(ipc_open(f, mem, "", &ipc), ATTND_EPRECOND);
  fx_free(f);

  f = fx_ipc();
  assert_int_equal(ipc_open(f, mem, "GPU-ffff", &ipc), ATTND_EPRECOND); /* another device */
  assert_int_equal(ipc_open(f, NULL, "GPU-0123abcd", &ipc),
                   ATTND_EPRECOND); /* the driver says no */
  void *a = NULL, *b = NULL;
  assert_int_equal(ipc_open(f, mem, "gpu-0123ABCD", &a), 0); /* prefix and case do not matter */
  assert_int_equal(ipc_open(f, mem, "0123abcd", &b), 0);
  assert_ptr_equal(a, b);                     /* one mapping, counted */
  assert_int_equal(atomic_load(&g_opens), 2); /* the refused one and the first */
  attnd_engine_ipc_close(f->e, a);
  uv_run(&f->loop, UV_RUN_NOWAIT);
  assert_int_equal(atomic_load(&g_closes), 0);
  attnd_engine_ipc_close(f->e, b);
  fx_free(f); /* the close runs off the loop; the engine waits for it */
  assert_int_equal(atomic_load(&g_closes), 1);
}

enum { N = 5 };

typedef struct {
  uint64_t done; /* the done signal's word (engine.h req->done) */
  uint64_t want; /* the value a step raises it to; 0: no done signal */
  uint16_t q[N * QH * HD], k[N * KVH * HD], v[N * KVH * HD];
  uint16_t out[N * QH * HD];
  float lse[N * QH];
} devbuf_t;

static int device_step(fx_t *f, uint64_t session, devbuf_t *d, uint32_t *tokens, int want_lse,
                       int out_rows, char *msg) {
  attnd_item_t it = {.session = session, .start = 0, .n = N, .tokens = tokens, .ntokens = N};
  attnd_step_req_t req = {.layer = 0, .items = &it, .nitems = 1, .want_lse = want_lse, .device = 1};
  if (d->want) {
    req.done = &d->done;
    req.done_value = d->want;
  }
  attnd_tensor_t *ts[5] = {&req.q, &req.k, &req.v, &req.out, &req.lse};
  void *ps[5] = {d->q, d->k, d->v, d->out, d->lse};
  uint32_t heads[5] = {QH, KVH, KVH, QH, QH};
  for (int i = 0; i < 5; i++) {
    if (i == 4 && !want_lse)
      continue;
    attnd_tensor_t *t = ts[i];
    t->present = 1;
    t->dtype = i == 4 ? ATTND_DT_FP32 : ATTND_DT_BF16;
    t->ndim = i == 4 ? 2 : 3;
    t->shape[0] = i == 3 ? (uint32_t)out_rows : N;
    t->shape[1] = heads[i];
    t->shape[2] = HD;
    t->data = ps[i];
    t->nbytes = (size_t)t->shape[0] * heads[i] * (i == 4 ? 4 : HD * 2);
  }
  res_t x = {0};
  attnd_engine_step(f->e, 1, 7, &req, on_done, &x);
  wait_res(f, &x);
  assert_null(x.out); /* outputs went to the device buffers */
  snprintf(msg, 256, "%s", x.r.message);
  int rc = x.r.status;
  res_free(&x);
  return rc;
}

static void test_device_step_matches_bytes(void **state) {
  fx_t *f = fx_ipc();
  sim_t *a = sim_new(), *b = sim_new();
  open_session(f, a, 0, NULL, 0);
  open_session(f, b, 0, NULL, 0);
  static devbuf_t d;
  rand_bf16(f, d.q, sizeof(d.q) / 2, 1.0);
  rand_bf16(f, d.k, sizeof(d.k) / 2, 1.0);
  rand_bf16(f, d.v, sizeof(d.v) / 2, 1.0);
  memset(d.out, 0xff, sizeof(d.out)); /* NaN: an unwritten element shows */
  memset(d.lse, 0xff, sizeof(d.lse));
  static uint16_t q2[N * QH * HD];
  memcpy(q2, d.q, sizeof(q2)); /* the bytes path's own q (the CPU backend rotates in place) */
  uint32_t tokens[N] = {3, 1, 4, 1, 5};
  char msg[256];
  d.done = 3;
  d.want = 7;
  assert_int_equal(device_step(f, a->id, &d, tokens, 1, N, msg), 0);
  assert_int_equal(d.done, 7);             /* raised once the outputs were written */
  assert_true(atomic_load(&g_scans) >= 1); /* checked on the "device" */
  assert_int_equal(session_len(f, a->id), N);
  /* The same step as bytes on session b. */
  attnd_item_t it = {.session = b->id, .start = 0, .n = N, .tokens = tokens, .ntokens = N};
  attnd_step_req_t req = {.layer = 0, .items = &it, .nitems = 1, .want_lse = 1};
  attnd_tensor_t *ts[3] = {&req.q, &req.k, &req.v};
  void *ps[3] = {q2, d.k, d.v};
  uint32_t heads[3] = {QH, KVH, KVH};
  for (int i = 0; i < 3; i++)
    *ts[i] = (attnd_tensor_t){.present = 1,
                              .dtype = ATTND_DT_BF16,
                              .ndim = 3,
                              .shape = {N, heads[i], HD},
                              .data = ps[i],
                              .nbytes = (size_t)N * heads[i] * HD * 2};
  res_t x = {0};
  attnd_engine_step(f->e, 1, 7, &req, on_done, &x);
  wait_res(f, &x);
  assert_int_equal(x.r.status, 0);
  assert_non_null(x.out);
  assert_memory_equal(x.out, d.out, sizeof(d.out));
  assert_memory_equal(x.lse, d.lse, sizeof(d.lse));
  res_free(&x);
  check_engine(f);
  sim_free(a);
  sim_free(b);
  fx_free(f);
}

static void test_device_step_refusals_change_nothing(void **state) {
  fx_t *f = fx_ipc();
  sim_t *a = sim_new();
  open_session(f, a, 0, NULL, 0);
  static devbuf_t d;
  rand_bf16(f, d.q, sizeof(d.q) / 2, 1.0);
  rand_bf16(f, d.k, sizeof(d.k) / 2, 1.0);
  rand_bf16(f, d.v, sizeof(d.v) / 2, 1.0);
  uint32_t tokens[N] = {1, 2, 3, 4, 5};
  char msg[256];
  d.want = 9;                     /* every refused step leaves the done signal's word alone */
  d.k[2 * KVH * HD + 3] = 0x7fc0; /* NaN in row 2 of k */
  assert_int_equal(device_step(f, a->id, &d, tokens, 0, N, msg), ATTND_EINVAL);
  assert_non_null(strstr(msg, "item 0: k holds a non-finite value (NaN)"));
  d.k[2 * KVH * HD + 3] = 0x3f80;
  d.v[4 * KVH * HD] = 0x7f00; /* 2^127 in bf16: past |v| <= 2^100 */
  assert_int_equal(device_step(f, a->id, &d, tokens, 0, N, msg), ATTND_EINVAL);
  assert_non_null(strstr(msg, "item 0: v holds"));
  assert_non_null(strstr(msg, "2^100"));
  d.v[4 * KVH * HD] = 0x3f80;
  assert_int_equal(device_step(f, a->id, &d, tokens, 0, N - 1, msg), ATTND_EINVAL);
  assert_non_null(strstr(msg, "out_ref"));
  /* A check the backend cannot run (a dead device): the step fails with its
   * status, unchecked tensors never reach a kernel. */
  g_refuse_check = ATTND_EDEVICE;
  assert_int_equal(device_step(f, a->id, &d, tokens, 0, N, msg), ATTND_EDEVICE);
  assert_non_null(strstr(msg, "device check of q, k and v could not run"));
  assert_int_equal(session_len(f, a->id), 0); /* nothing changed */
  assert_int_equal(d.done, 0);
  assert_int_equal(device_step(f, a->id, &d, tokens, 0, N, msg), 0);
  assert_int_equal(session_len(f, a->id), N);
  assert_int_equal(d.done, 9);
  /* A lower value leaves a higher word as it is (word = max(word, value)). */
  d.want = 4;
  assert_int_equal(device_step(f, a->id, &d, tokens, 0, N, msg), 0); /* a rewrite of the N */
  assert_int_equal(d.done, 9);

  check_engine(f);
  sim_free(a);
  fx_free(f);
}

int main(void) {
  const struct CMUnitTest t[] = {
      cmocka_unit_test(test_open_refusals_and_sharing),
      cmocka_unit_test(test_device_step_matches_bytes),
      cmocka_unit_test(test_device_step_refusals_change_nothing),
  };
  return cmocka_run_group_tests(t, NULL, NULL);
}

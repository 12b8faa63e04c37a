/* backend_cuda_fixture.h: the harness of tests/test_backend_cuda.c (run on a
 * GPU, and over tests/cuda_mock.c without one): jobs described once and built
 * for each backend with poisoned outputs, submitted back to back, and
 * compared between the CPU and the CUDA backend. */
#ifndef ATTND_TESTS_BACKEND_CUDA_FIXTURE_H
#define ATTND_TESTS_BACKEND_CUDA_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <uv.h>

#include "backend.h"
#include "base.h"
#include "tolerance.h"

#define LAYERS 2
#define QH 8
#define KVH 2
#define HD 128
#define BS 16

/* The backend options of this run (main() reads them from the arguments). */
extern attnd_backend_opts_t g_opts;
/* g_opts with a KV pool of kv_memory bytes. */
const attnd_backend_opts_t *opts(uint64_t kv_memory);

/* One item as a test describes it. */
typedef struct {
  int start, n, has_q, mask, param;
  int table[128], nb;
  int q_only;   /* attend-only: no k/v rows (attnd_kbatch_t.q_only_rows); list these last */
  int pos_base; /* RoPE position offset (split context) */
} titem_t;

/* One job's host inputs, shared by both backends (q is copied per backend:
 * the CPU backend rotates it in place). */
typedef struct {
  int kind, layer;
  int nitems;
  attnd_kitem_t items[4];
  int32_t meta[2048];
  int nmeta;
  int T, Tq, max_kv, max_n, q_only_rows;
  uint16_t *q, *k, *v;
  int fp32_out, want_lse;
  int32_t copies[2];
} tjob_spec_t;

typedef struct {
  attnd_job_t job; /* first: done_cb gets &job */
  int *ndone;
  int done_seq; /* *ndone after this one was done: the order jobs finished in */
  void *qcopy;
} tjob_t;

/* Defined only by tests/cuda_mock.c (the GPU-less build of this test): holds
 * the mock's streams while a batch is submitted. NULL on a real device. */
void attnd_cuda_mock_hold(int on) __attribute__((weak));

#define SKIP_WITHOUT_GPU()                                                                         \
  do {                                                                                             \
    if (!attnd_backend_cuda_available()) {                                                         \
      print_message("no usable CUDA device: skipped\n");                                           \
      skip();                                                                                      \
    }                                                                                              \
  } while (0)

uint64_t rng_next(void);
float rng_unit(void);
uint16_t f2bf(float f);
float bf2f(uint16_t h);
attnd_kshape_t make_shape(attnd_kv_type_t kv);
void tjob_done(attnd_job_t *j);
/* A STEP of n items on a layer with fresh random q, k and v. */
void spec_step(tjob_spec_t *sp, int layer, const titem_t *its, int n, int fp32_out, int want_lse);
void spec_copy(tjob_spec_t *sp, int layer, int src, int dst);
void spec_free(tjob_spec_t *sp);
size_t out_bytes(const tjob_spec_t *sp);
size_t lse_bytes(const tjob_spec_t *sp);
/* Fills a job from a spec with freshly allocated, poisoned outputs. */
void job_from_spec(tjob_t *t, const tjob_spec_t *sp, int *ndone);
void job_free(tjob_t *t);
double out_val(const tjob_t *t, size_t i);
/* Holds the mock's streams while a batch is submitted (no-op on a device). */
void mock_hold(int on);
/* Submits every job back to back (nothing waits for an earlier one), then
 * runs the loop until all are done. */
void run_all(uv_loop_t *loop, attnd_backend_t *be, tjob_t *jobs, int n);
double rel_l2_out(const tjob_t *a, const tjob_t *ref, size_t n);
void destroy_and_close(uv_loop_t *loop, attnd_backend_t *be);

/* Pinned frames (test_pinned_frames): a step's q, k and v moved into one
 * host_alloc buffer at odd offsets (inputs_pinned), and its output into
 * another (outputs_pinned); NULL, the job unchanged, when host_alloc has
 * none left. g_frames_pinned counts the input frames that were pinned. */
extern int g_frames_pinned;
void *inputs_in_frame(attnd_backend_t *gpu, attnd_job_t *j);
void *output_in_host_memory(attnd_backend_t *gpu, attnd_job_t *j);

/* Same-host zero-copy (backend_cuda_ipc.c). What io_in_pinned moved, put back
 * (out, lse into the job's batch) and freed (block, with host_free) before
 * the job is freed. */
typedef struct {
  void *block, *out, *lse;
  uint64_t *done;      /* the done signal's word in block (backend.h job->done), 0 before */
  uint64_t done_value; /* what the step raises it to */
} devio_t;
void io_in_pinned(attnd_backend_t *gpu, attnd_job_t *j, devio_t *d);
/* The same in *block (host_alloc'd here when NULL, else reused: the same
 * addresses step after step, as a client that keeps its buffers). */
void io_in_block(attnd_backend_t *gpu, attnd_job_t *j, devio_t *d, uint8_t **block);
/* After the step: out and lse copied back into the job's own buffers, which
 * it points at again; the block stays the caller's. */
void io_out(attnd_job_t *j, devio_t *d);
void test_ipc_ops(void **state);

/* --fault (backend_cuda_fault.c). */
void test_device_fault(void **state);

/* The ring (test_backend_cuda_ring.c); test_ring_fault only with --ring-fault. */
void test_ring_matches_cpu(void **state);
void test_ring_no_alloc(void **state);
void test_ring_oneshot(void **state);
void test_ring_document(void **state);
void test_ring_device_io(void **state);
void test_ring_pinned(void **state);
void test_ring_pool_full(void **state);
void test_frame_pool(void **state);
/* test_ring_fault with the large step's frame and output pinned (--ring-fault-pinned). */
extern int g_fault_pinned;
void test_ring_fault(void **state);

/* --cuda-completion loop and --cuda-graphs (test_backend_cuda_small.c). */
void test_loop_completion(void **state);
void test_graph_steps(void **state);
void test_graph_replay(void **state);
void test_graph_replay_layers(void **state);
void test_graph_replay_devio(void **state);
void test_graph_replay_pairs(void **state);

#endif /* ATTND_TESTS_BACKEND_CUDA_FIXTURE_H */

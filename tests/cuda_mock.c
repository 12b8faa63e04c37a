/* cuda_mock.c: a host-only stand-in for the CUDA runtime calls and the
 * attnd_cuda.h API that the CUDA backend (daemon/backend/cuda_*.c) uses, so that its own
 * logic (staging layout, pointer arithmetic, per-layer stream ordering,
 * completion through the uv_async_t, sticky errors, teardown) runs and is
 * judged against the CPU backend on machines without a GPU.
 *
 * A stream is a thread draining a FIFO of operations; "device" memory is host
 * memory; attnd_cuda_write/attend run the CPU kernels on the stream's thread.
 * Every operation sleeps a little at random, and a large copy or write in
 * proportion to its size, so that a missing ordering (within a stream or
 * between streams) shows as a wrong result rather than passing by luck, and attnd_cuda_mock_hold()
 * lets a test enqueue everything before any stream starts. Host functions
 * (cudaLaunchHostFunc) run on the stream's thread in order, and are skipped
 * after a sticky fault as on a device; cudaStreamWaitEvent holds a stream
 * until another reached the event; stream priorities are accepted and not
 * modelled (every stream runs on its own thread). A write whose block table names a
 * block >= ATTND_CUDA_MOCK_FAULT_BLOCK (default 2^24) reports
 * cudaErrorIllegalAddress to every later callback (a sticky fault).
 * attnd_cuda_mock_allocs() counts the allocation calls (cudaHostAlloc,
 * cudaMalloc, cudaMallocAsync), which must all happen at start. Stream
 * capture records a stream's copies and kernels as a list instead of running
 * them; an executable graph is a copy of that list, updated only from a list
 * of the same operations (attnd_cuda_mock_refuse_updates() makes the next
 * updates fail, as a device refuses a changed topology), and its launch
 * enqueues the list's operations; attnd_cuda_mock_graph_launches() counts
 * launches.
 *
 * Linked only into test_backend_cuda_mock, never into the daemon. */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attnd_cuda.h"
#include "attnd_cuda_ipc.h"
#include "attnd_kernels.h"

enum {
  OP_COPY,
  OP_SET,
  OP_WRITE,
  OP_ATTEND,
  OP_CALLBACK,
  OP_HOSTFN,
  OP_FREE,
  OP_EVENT,
  OP_WAIT,
  OP_SCAN,
  OP_SIGNAL
};

typedef struct op_s {
  int kind;
  void *dst;
  const void *src;
  size_t n;
  int value;
  attnd_kshape_t s;
  attnd_kbatch_t b;
  const void *cp[3]; /* OP_SCAN's tensors */
  int64_t crows[3];
  int32_t celems[3];
  uint32_t cbound[3];
  uint64_t svalue; /* OP_SIGNAL's */
  cudaStreamCallback_t cb;
  cudaHostFn_t fn;
  void *arg;
  struct op_s *next;
} op_t;

struct CUstream_st {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  op_t *head, *tail;
  int busy, stop;
  unsigned seed;
  struct CUstream_st *next_stream;
  /* Stream capture (cudaStreamBeginCapture): operations go to this list
   * instead of the FIFO; invalid once an operation was refused meanwhile.
   * Only the thread that submits to the stream touches these. */
  int capturing, cap_invalid;
  op_t *cap_head, *cap_tail;
};

/* A captured graph and an executable one: the operations, in order. */
struct CUgraph_st {
  op_t *head;
  int n;
};
struct CUgraphExec_st {
  op_t *head;
  int n;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct CUstream_st *g_streams;
static atomic_int g_sticky; /* cudaErrorIllegalAddress once a fault ran */
static atomic_int g_hold;   /* streams start no operation while set */
static atomic_int g_allocs; /* cudaHostAlloc, cudaMalloc and cudaMallocAsync calls */

/* Allocation calls so far: a test reads it after the backend started and
 * again after its steps, which must have allocated nothing (cuda_ring.c). */
int attnd_cuda_mock_allocs(void) {
  return atomic_load(&g_allocs);
}

/* Lets a test enqueue a whole batch of jobs before any stream starts, so that
 * ordering does not depend on how fast the submitting thread happens to run. */
void attnd_cuda_mock_hold(int on) {
  atomic_store(&g_hold, on);
}

static void jitter(struct CUstream_st *st) {
  struct timespec ts = {0, (long)(rand_r(&st->seed) % 300) * 1000};
  nanosleep(&ts, NULL);
}

static int fault_block(const attnd_kbatch_t *b) {
  /* A real device faults on any far-away address; the host would crash. */
  const char *e = getenv("ATTND_CUDA_MOCK_FAULT_BLOCK");
  long lim = e ? atol(e) : 1l << 24;
  for (int i = 0; i < b->nitems; i++) {
    const attnd_kitem_t *it = &b->items[i];
    int nb = (it->start + it->n + 15) / 16; /* tests use block_size 16 */
    for (int k = 0; k < nb; k++)
      if (b->meta[it->block_table + k] >= lim)
        return 1;
  }
  return 0;
}

static void run_op(struct CUstream_st *st, op_t *o) {
  while (atomic_load(&g_hold))
    nanosleep(&(struct timespec){0, 100000}, NULL);
  jitter(st);
  int sticky = atomic_load(&g_sticky);
  switch (o->kind) {
  case OP_COPY:
    /* A large copy takes time, as a DMA does (here ~50 MB/s), reading its
     * source when it starts and writing its destination when it ends: work
     * on another stream that should come before it or wait for it, and does
     * not, is seen in the bytes. */
    if (o->n >= ((size_t)16 << 10) && !sticky) {
      void *tmp = malloc(o->n);
      if (!tmp)
        abort();
      memcpy(tmp, o->src, o->n);
      size_t t = o->n < ((size_t)1 << 20) ? o->n : (size_t)1 << 20;
      nanosleep(&(struct timespec){0, (long)t * 20}, NULL);
      memcpy(o->dst, tmp, o->n);
      free(tmp);
    } else if (!sticky) {
      memcpy(o->dst, o->src, o->n);
    }
    break;
  case OP_SET:
    if (!sticky)
      memset(o->dst, o->value, o->n);
    break;
  case OP_WRITE:
    if (sticky)
      break;
    if (fault_block(&o->b)) {
      atomic_store(&g_sticky, 1);
      break;
    }
    /* Bigger work takes longer, as on a device: a prefill's write ends after
     * a decode's attend that a wrong stream mapping would let overtake it. */
    nanosleep(&(struct timespec){0, (long)o->b.total_kv * 50000}, NULL);
    attnd_cpu_write(&o->s, &o->b, 0, 1);
    break;
  case OP_ATTEND:
    if (!sticky)
      attnd_cpu_attend(&o->s, &o->b, 0, 1);
    break;
  case OP_CALLBACK:
    o->cb(st, atomic_load(&g_sticky) ? cudaErrorIllegalAddress : cudaSuccess, o->arg);
    break;
  case OP_HOSTFN:
    /* As on a device: a host function is skipped once the context is sticky. */
    if (!sticky)
      o->fn(o->arg);
    break;
  case OP_FREE:
    free(o->dst);
    break;
  case OP_WAIT: /* cudaStreamWaitEvent: until another stream reached the event */
    while (atomic_load((_Atomic double *)o->dst) == 0.0 && !atomic_load(&g_sticky))
      nanosleep(&(struct timespec){0, 50000}, NULL);
    break;
  case OP_SCAN: { /* attnd_cuda_check_rows: the three tensors' first bad rows into dst */
    if (sticky)
      break;
    uint64_t res[3];
    for (int t = 0; t < 3; t++) {
      res[t] = UINT64_MAX;
      for (int64_t r = 0; r < o->crows[t] && res[t] == UINT64_MAX; r++) {
        uint32_t m = attnd_cpu_max_abs_bits(
            ATTND_DT_BF16, (const uint8_t *)o->cp[t] + (size_t)r * 2 * (size_t)o->celems[t],
            (size_t)o->celems[t]);
        if (m > o->cbound[t])
          res[t] = ((uint64_t)r << 32) | m;
      }
    }
    memcpy(o->dst, res, sizeof(res));
    break;
  }
  case OP_SIGNAL: /* attnd_cuda_signal: word = max(word, value) */
    if (!sticky) {
      _Atomic uint64_t *w = o->dst;
      uint64_t cur = atomic_load(w);
      while (cur < o->svalue && !atomic_compare_exchange_weak(w, &cur, o->svalue)) {
      }
    }
    break;
  case OP_EVENT: { /* an event is a timestamp taken when the stream reaches it */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    atomic_store((_Atomic double *)o->dst, (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6);
    break;
  }
  }
}

static void *stream_main(void *arg) {
  struct CUstream_st *st = arg;
  pthread_mutex_lock(&st->mu);
  for (;;) {
    while (!st->head && !st->stop)
      pthread_cond_wait(&st->cv, &st->mu);
    if (!st->head && st->stop)
      break;
    op_t *o = st->head;
    st->head = o->next;
    if (!st->head)
      st->tail = NULL;
    st->busy = 1;
    pthread_mutex_unlock(&st->mu);
    run_op(st, o);
    free(o);
    pthread_mutex_lock(&st->mu);
    st->busy = 0;
    pthread_cond_broadcast(&st->cv);
  }
  pthread_mutex_unlock(&st->mu);
  return NULL;
}

/* Appends o to the stream's FIFO, fault or not. Nothing of this kind may
 * happen on a capturing stream (the backend captures copies and kernels
 * only): it invalidates the capture. */
static cudaError_t enqueue(cudaStream_t st, op_t *o) {
  if (st->capturing) {
    st->cap_invalid = 1;
    free(o);
    return cudaErrorStreamCaptureUnsupported;
  }
  pthread_mutex_lock(&st->mu);
  o->next = NULL;
  if (st->tail)
    st->tail->next = o;
  else
    st->head = o;
  st->tail = o;
  pthread_cond_broadcast(&st->cv);
  pthread_mutex_unlock(&st->mu);
  return cudaSuccess;
}

/* An ordinary operation: refused once the context has a sticky fault. */
static cudaError_t push(cudaStream_t st, op_t *o) {
  if (atomic_load(&g_sticky))
    return (free(o), cudaErrorIllegalAddress);
  if (st->capturing && o->kind != OP_EVENT && o->kind != OP_WAIT) {
    o->next = NULL;
    if (st->cap_tail)
      st->cap_tail->next = o;
    else
      st->cap_head = o;
    st->cap_tail = o;
    return cudaSuccess;
  }
  /* An event recorded or waited for inside a capture would be a capture
   * dependency on a device, not a timing or a wait: refused here. */
  return enqueue(st, o);
}

static op_t *op_new(int kind) {
  op_t *o = calloc(1, sizeof(*o));
  if (!o)
    abort();
  o->kind = kind;
  return o;
}

/* ---- attnd_cuda.h -------------------------------------------------------- */

int attnd_cuda_device_count(void) {
  return 1;
}

int attnd_cuda_device_info(int device, char *name, size_t len, uint64_t *total_mem, int *cc_major,
                           int *cc_minor) {
  snprintf(name, len, "mock GPU (host threads)");
  *total_mem = 2ull << 30;
  *cc_major = 9;
  *cc_minor = 0;
  return 0;
}

const char *attnd_cuda_last_error(void) {
  return "mock: sticky fault";
}

int attnd_cuda_write(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *stream) {
  op_t *o = op_new(OP_WRITE);
  o->s = *s;
  o->b = *b;
  return push(stream, o) == cudaSuccess ? 0 : ATTND_CUDA_EDEVICE;
}

size_t attnd_cuda_attend_workspace(const attnd_kshape_t *s, int32_t total_q) {
  return (size_t)total_q * 4096;
}

int attnd_cuda_attend(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                      size_t workspace_bytes, void *stream) {
  op_t *o = op_new(OP_ATTEND);
  o->s = *s;
  o->b = *b;
  return push(stream, o) == cudaSuccess ? 0 : ATTND_CUDA_EDEVICE;
}

int attnd_cuda_attend_splits(const attnd_kshape_t *s, const attnd_kbatch_t *b,
                             size_t workspace_bytes) {
  return 1;
}

/* The step: both phases queued in order (the mock never fuses). */
int attnd_cuda_step(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                    size_t workspace_bytes, void *stream) {
  int rc = attnd_cuda_write(s, b, stream);
  if (rc != 0 || b->total_q <= 0)
    return rc;
  return attnd_cuda_attend(s, b, workspace, workspace_bytes, stream);
}

/* The launch print: what the mock's step would queue (the shape, the batch
 * but for the planning hints, which the CPU kernels do not read, and the
 * workspace), so that equal prints queue equal operations. */
uint64_t attnd_cuda_step_print(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                               size_t workspace_bytes) {
  attnd_kbatch_t c = *b;
  c.max_kv_len = 0;
  c.kv_sum = 0;
  uint64_t h = 0xcbf29ce484222325ull;
  const unsigned char *p[4] = {(const unsigned char *)s, (const unsigned char *)&c,
                               (const unsigned char *)&workspace,
                               (const unsigned char *)&workspace_bytes};
  const size_t n[4] = {sizeof(*s), sizeof(c), sizeof(workspace), sizeof(workspace_bytes)};
  for (int i = 0; i < 4; i++)
    for (size_t j = 0; j < n[i]; j++)
      h = (h ^ p[i][j]) * 0x100000001b3ull;
  return h ? h : 1;
}

/* Same-host zero-copy: "device" memory is host memory, so a mock handle is
 * simply the address, in the handle's first 8 bytes (the test registers
 * its own memory), and the allocation's size in the next 8 (0: 1 GiB). A
 * handle whose address is 0 cannot be opened. */
int attnd_cuda_device_uuid(int device, char *out, size_t len) {
  snprintf(out, len, "GPU-00000000-0000-0000-0000-00000000m0ck");
  return 0;
}

int attnd_cuda_ipc_open(int device, const void *handle, void **base, size_t *size) {
  uint64_t n;
  memcpy(base, handle, sizeof(*base));
  memcpy(&n, (const uint8_t *)handle + 8, sizeof(n));
  *size = n ? (size_t)n : (size_t)1 << 30;
  return *base ? 0 : ATTND_CUDA_ECUDA;
}

int attnd_cuda_ipc_close(int device, void *base) {
  return 0;
}

int attnd_cuda_check_init(void *state, int n, void *stream) {
  return 0; /* the mock's check keeps no state */
}

int attnd_cuda_check_rows(const void *const p[3], const int64_t rows[3], const int32_t row_elems[3],
                          const uint32_t bound_bits[3], void *state, uint64_t *host, void *stream) {
  op_t *o = op_new(OP_SCAN);
  for (int t = 0; t < 3; t++) {
    o->cp[t] = p[t];
    o->crows[t] = p[t] ? rows[t] : 0;
    o->celems[t] = row_elems[t];
    o->cbound[t] = bound_bits[t];
  }
  o->dst = host;
  return push(stream, o) == cudaSuccess ? 0 : ATTND_CUDA_EDEVICE;
}

int attnd_cuda_signal(void *word, uint64_t value, void *stream) {
  if (!word || ((uintptr_t)word & 7))
    return ATTND_CUDA_EINVAL;
  op_t *o = op_new(OP_SIGNAL);
  o->dst = word;
  o->svalue = value;
  return push(stream, o) == cudaSuccess ? 0 : ATTND_CUDA_EDEVICE;
}

/* ---- the CUDA runtime calls the CUDA backend makes ---------------------------- */

cudaError_t cudaSetDevice(int device) {
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  return cudaSuccess;
}

const char *cudaGetErrorString(cudaError_t error) {
  return error == cudaErrorIllegalAddress ? "an illegal memory access (mock)" : "mock error";
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}

/* Priorities are not modelled: every stream is a thread of its own, so a
 * high-priority stream's work is never queued behind another stream's. */
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *pStream, unsigned int flags, int priority) {
  (void)priority;
  return cudaStreamCreateWithFlags(pStream, flags);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
  struct CUstream_st *st = calloc(1, sizeof(*st));
  if (!st)
    return cudaErrorMemoryAllocation;
  pthread_mutex_init(&st->mu, NULL);
  pthread_cond_init(&st->cv, NULL);
  st->seed = (unsigned)(uintptr_t)st;
  pthread_create(&st->th, NULL, stream_main, st);
  pthread_mutex_lock(&g_mu);
  st->next_stream = g_streams;
  g_streams = st;
  pthread_mutex_unlock(&g_mu);
  *pStream = st;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t st) {
  pthread_mutex_lock(&st->mu);
  while (st->head || st->busy)
    pthread_cond_wait(&st->cv, &st->mu);
  pthread_mutex_unlock(&st->mu);
  return atomic_load(&g_sticky) ? cudaErrorIllegalAddress : cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  pthread_mutex_lock(&g_mu);
  for (struct CUstream_st *st = g_streams; st; st = st->next_stream)
    cudaStreamSynchronize(st);
  pthread_mutex_unlock(&g_mu);
  return atomic_load(&g_sticky) ? cudaErrorIllegalAddress : cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t st) {
  pthread_mutex_lock(&st->mu);
  st->stop = 1;
  pthread_cond_broadcast(&st->cv);
  pthread_mutex_unlock(&st->mu);
  pthread_join(st->th, NULL);
  pthread_mutex_lock(&g_mu);
  for (struct CUstream_st **pp = &g_streams; *pp; pp = &(*pp)->next_stream)
    if (*pp == st) {
      *pp = st->next_stream;
      break;
    }
  pthread_mutex_unlock(&g_mu);
  pthread_mutex_destroy(&st->mu);
  pthread_cond_destroy(&st->cv);
  free(st);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t size) {
  atomic_fetch_add(&g_allocs, 1);
  *p = calloc(1, size ? size : 1);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFree(void *p) {
  free(p);
  return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int value, size_t count) {
  memset(p, value, count);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
  *free_b = 1ull << 30;
  *total_b = 2ull << 30;
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t size, unsigned int flags) {
  atomic_fetch_add(&g_allocs, 1);
  *p = malloc(size ? size : 1);
  if (*p)
    memset(*p, 0xa5, size); /* garbage, as fresh pinned memory may hold */
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void *p) {
  free(p);
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t st) {
  atomic_fetch_add(&g_allocs, 1);
  *p = malloc(size ? size : 1);
  if (*p)
    memset(*p, 0x5a, size);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t st) {
  op_t *o = op_new(OP_FREE);
  o->dst = p;
  /* Even after a fault, memory must go (teardown). */
  return enqueue(st, o);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t st) {
  op_t *o = op_new(OP_COPY);
  o->dst = dst;
  o->src = src;
  o->n = count;
  return push(st, o);
}

cudaError_t cudaStreamAddCallback(cudaStream_t st, cudaStreamCallback_t cb, void *arg,
                                  unsigned int flags) {
  op_t *o = op_new(OP_CALLBACK);
  o->cb = cb;
  o->arg = arg;
  /* Callbacks are queued even after a fault: each runs once, with the error. */
  return enqueue(st, o);
}

/* Events (the CUDA backend's --cuda-trace and completion): a cudaEvent_t is an
 * _Atomic double of milliseconds, set by the stream thread. */
cudaError_t cudaEventCreate(cudaEvent_t *ev) {
  _Atomic double *t = malloc(sizeof(*t));
  if (!t)
    return cudaErrorMemoryAllocation;
  atomic_init(t, 0.0);
  *ev = (cudaEvent_t)(void *)t;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned int flags) {
  (void)flags;
  return cudaEventCreate(ev);
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st) {
  atomic_store((_Atomic double *)(void *)ev, 0.0); /* not reached yet */
  op_t *o = op_new(OP_EVENT);
  o->dst = (void *)ev;
  return push(st, o);
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  *ms =
      (float)(atomic_load((_Atomic double *)(void *)b) - atomic_load((_Atomic double *)(void *)a));
  return cudaSuccess;
}

/* As on a device, a sticky fault is what every query answers from then on. */
cudaError_t cudaEventQuery(cudaEvent_t ev) {
  if (atomic_load(&g_sticky))
    return cudaErrorIllegalAddress;
  return atomic_load((_Atomic double *)(void *)ev) > 0.0 ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventDestroy(cudaEvent_t ev) {
  free((void *)ev);
  return cudaSuccess;
}

/* The stream waits until the event's last record (the pool never records an
 * event again before its waits are done) has been reached. */
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned int flags) {
  (void)flags;
  op_t *o = op_new(OP_WAIT);
  o->dst = (void *)ev;
  return push(st, o);
}

cudaError_t cudaLaunchHostFunc(cudaStream_t st, cudaHostFn_t fn, void *userData) {
  op_t *o = op_new(OP_HOSTFN);
  o->fn = fn;
  o->arg = userData;
  return push(st, o);
}

/* ---- graphs: stream capture, instantiate, update, launch ---------------- */

static atomic_int g_graph_launches, g_update_refusals;

/* Graph launches so far, and a test's wish that the next n updates be
 * refused (as a device refuses one whose kernels changed topology). */
int attnd_cuda_mock_graph_launches(void) {
  return atomic_load(&g_graph_launches);
}
void attnd_cuda_mock_refuse_updates(int n) {
  atomic_store(&g_update_refusals, n);
}

static void ops_free(op_t *o) {
  for (op_t *next; o; o = next) {
    next = o->next;
    free(o);
  }
}

static op_t *ops_copy(const op_t *o, int *n) {
  op_t *head = NULL, **pp = &head;
  *n = 0;
  for (; o; o = o->next, ++*n) {
    op_t *c = op_new(o->kind);
    *c = *o;
    c->next = NULL;
    *pp = c;
    pp = &c->next;
  }
  return head;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t st, enum cudaStreamCaptureMode mode) {
  (void)mode;
  if (st->capturing)
    return cudaErrorIllegalState;
  st->capturing = 1;
  st->cap_invalid = 0;
  st->cap_head = st->cap_tail = NULL;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t st, cudaGraph_t *g) {
  *g = NULL;
  if (!st->capturing)
    return cudaErrorIllegalState;
  st->capturing = 0;
  op_t *ops = st->cap_head;
  st->cap_head = st->cap_tail = NULL;
  if (st->cap_invalid) {
    ops_free(ops);
    return cudaErrorStreamCaptureInvalidated;
  }
  struct CUgraph_st *gr = calloc(1, sizeof(*gr));
  if (!gr)
    abort();
  gr->head = ops;
  for (op_t *o = ops; o; o = o->next)
    gr->n++;
  *g = gr;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long flags) {
  (void)flags;
  struct CUgraphExec_st *x = calloc(1, sizeof(*x));
  if (!x)
    abort();
  x->head = ops_copy(g->head, &x->n);
  *exec = x;
  return cudaSuccess;
}

/* Same operations in the same order: the executable graph takes the new
 * parameters (pointers, sizes, batches); anything else is refused. */
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t g,
                                cudaGraphExecUpdateResultInfo *info) {
  memset(info, 0, sizeof(*info));
  int same = exec->n == g->n;
  for (const op_t *a = exec->head, *b = g->head; same && a && b; a = a->next, b = b->next)
    same = a->kind == b->kind;
  if (same && atomic_load(&g_update_refusals) > 0) {
    atomic_fetch_sub(&g_update_refusals, 1);
    same = 0;
  }
  if (!same) {
    info->result = cudaGraphExecUpdateErrorTopologyChanged;
    return cudaErrorGraphExecUpdateFailure;
  }
  ops_free(exec->head);
  exec->head = ops_copy(g->head, &exec->n);
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t st) {
  if (atomic_load(&g_sticky))
    return cudaErrorIllegalAddress;
  if (st->capturing)
    return cudaErrorStreamCaptureUnsupported;
  int n = 0;
  for (op_t *o = ops_copy(exec->head, &n), *next; o; o = next) {
    next = o->next;
    cudaError_t e = push(st, o);
    if (e != cudaSuccess) {
      ops_free(next);
      return e;
    }
  }
  atomic_fetch_add(&g_graph_launches, 1);
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  if (g) {
    ops_free(g->head);
    free(g);
  }
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  if (exec) {
    ops_free(exec->head);
    free(exec);
  }
  return cudaSuccess;
}

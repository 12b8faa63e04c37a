/* backend.h: where the attention math runs (CPU worker threads or a CUDA
 * device): the job contract between the engine and the kernels.
 *
 * The engine owns sessions and block tables; a backend owns the KV pool memory
 * (all layers), the static scales' copies it needs, and execution. The engine
 * submits jobs on the loop thread; the backend runs them off the loop and calls
 * job->done_cb on the loop thread (uv_async_t + queue, or uv_queue_work).
 *
 * Ordering contract: an ordered job (the default) runs after every job of
 * its layer submitted before it has finished (its writes visible), and
 * before the layer's later ordered jobs start; jobs of different layers may
 * run concurrently. COPY jobs (copy-on-write of whole blocks) are submitted
 * once per layer, so they order with that layer's steps. SCALES jobs set a
 * layer's static scales the same way: the layer's jobs submitted before one
 * see the old scales, the jobs after it the new ones; SINKS jobs likewise
 * for the layer's sink logits. An unordered job
 * (job->unordered) carries the submitter's promise that it conflicts with no
 * unfinished job of its layer (reads nothing they write, writes nothing they
 * touch, no SCALES job in between): the backend may run it at once, beside
 * them or before them. The engine submits only unordered jobs, each once
 * the jobs it depends on are done (engine/sched.c). A job holds no reference
 * of its own: the engine keeps the blocks a job reads or writes referenced
 * until done_cb.
 *
 * Large steps (their attention reads more than opts.chunk_keys keys per q
 * head, or they write many tokens) give way to small ones: the CPU backend
 * runs them in chunks interleaved with other jobs' work, the CUDA backend
 * runs small unordered jobs on high-priority streams beside them. */
#ifndef ATTND_BACKEND_H
#define ATTND_BACKEND_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "attnd_kernels.h"

typedef struct attnd_backend_s attnd_backend_t;
typedef struct attnd_job_s attnd_job_t;

/* A step's backend phases, in the order they run (the step trace, rpc.h):
 * host to device copy, the cache write (RoPE, quantize, paged write), the
 * attention kernels, device to host copy. The CPU backend has no copies. */
enum { ATTND_DEV_H2D, ATTND_DEV_WRITE, ATTND_DEV_ATTEND, ATTND_DEV_D2H, ATTND_DEV_COUNT };

typedef enum {
  ATTND_JOB_STEP = 0,
  ATTND_JOB_COPY = 1,
  ATTND_JOB_SCALES = 2,
  ATTND_JOB_SINKS = 3,
  ATTND_JOB_CHECK = 4,
} attnd_job_kind_t;

struct attnd_job_s {
  attnd_job_kind_t kind;
  int layer;
  /* STEP: the batch with HOST pointers for items, meta, q, k, v, out and lse;
   * the backend fills cache, block_bytes and the static-scale pointers itself.
   * out and lse are engine-allocated host buffers the backend writes into. */
  attnd_kbatch_t batch;
  size_t nmeta;             /* int32 elements in batch.meta */
  size_t q_bytes, kv_bytes; /* bytes of q, and of k (== bytes of v) */
  size_t out_bytes, lse_bytes;
  /* COPY: ncopies (src, dst) physical block pairs, this layer only. */
  const int32_t *copies;
  int ncopies;
  /* SCALES: the layer's static scales from this job on (fp32, HOST pointers
   * read until done_cb): k_scale, v_scale [kv_heads] or, per_channel,
   * [kv_heads][head_dim]; int4 also k_zero, v_zero [kv_heads][head_dim]. */
  const float *k_scale, *v_scale, *k_zero, *v_zero;
  int per_channel;
  /* SINKS: the layer's sink logits from this job on, fp32 [q_heads] (HOST,
   * read until done_cb), ordered like SCALES. A layer never given any runs
   * its steps with batch.sinks NULL. */
  const float *sinks;
  /* 1: may run beside or before unfinished jobs of its layer (see above). */
  int unordered;
  /* STEP: batch.q, k and v lie in memory from host_alloc (pinned): the
   * backend may DMA them from there and skip their staging copy; the same
   * for batch.out (outputs_pinned), DMA'd into. */
  int inputs_pinned;
  int outputs_pinned;
  /* STEP: batch.q, k, v, out and lse are DEVICE pointers into client memory
   * mapped with ipc_open (same-host zero-copy): nothing of them is staged or
   * copied back; the kernels read k and v and write out and lse in place,
   * and q is first copied on the device into the job's own buffer (the
   * write phase rotates q in place, which the client's tensor must not see).
   * Only a backend with ipc_open gets such jobs. */
  int device_io;
  /* STEP with device_io: NULL, or an 8-byte aligned DEVICE word of client
   * memory raised to done_value (word = max(word, done_value), one atomic)
   * after the step's last kernel, on the same stream, so that the client's
   * own stream can wait for the outputs (docs/protocol.md, the done
   * signal). Enqueued only when everything before it was; a step that fails
   * may leave the word as it was, never raises it early. */
  void *done;
  uint64_t done_value;
  /* CHECK (same-host zero-copy): the finiteness and magnitude check of a
   * step's q, k and v in client DEVICE memory (engine/scan.c's rule, one
   * small kernel on the layer's stream, completed like any job, so no thread
   * waits for it): for each of the three tensors (p NULL: none) of rows x
   * row_elems 16-bit values, bad becomes the first row whose largest
   * magnitude pattern (sign cleared) exceeds bound, that pattern in bits, or
   * SIZE_MAX. It reads client memory only and conflicts with nothing:
   * always unordered. Only a backend with ipc_open gets one (the CPU backend
   * runs it over host memory, for tests). */
  struct {
    const void *p[3];
    size_t rows[3];
    uint32_t row_elems[3], bound[3];
    size_t bad[3];
    uint32_t bits[3];
  } check;
  /* Filled by the backend. */
  int status; /* 0 or a negative ATTND_E* */
  char message[128];
  uint64_t t_submit_us, t_start_us, t_end_us; /* uv_hrtime()/1000 */
  /* STEP, when the backend timed it (CPU: always; CUDA: --cuda-trace, from
   * events): microseconds per ATTND_DEV_* phase. */
  uint32_t dev_us[ATTND_DEV_COUNT];
  int dev_timed;
  void (*done_cb)(attnd_job_t *job); /* on the loop thread */
  void *user;
};

/* What a backend holds and did, for Health and tests (ops.stats). */
typedef struct {
  uint64_t pinned_bytes;  /* pinned host memory held: staging, frames, the ring */
  uint64_t ring_bytes;    /* of which the ring (CUDA: --cuda-ring) */
  uint64_t ring_chunks;   /* chunks staged through the ring so far */
  uint64_t oneshot_steps; /* large steps that could not be cut, staged whole */
  uint64_t staged_bytes;  /* bytes of steps' q, k, v and out copied on the host into or
                           * out of pinned staging (CUDA; 0 while frames and outputs
                           * are the backend's pinned memory) */
  uint64_t loop_done;     /* CUDA: runs completed by the loop thread's own
                           * polling (--cuda-completion loop) */
  uint64_t graph_steps;   /* CUDA: small steps launched as one graph (--cuda-graphs) */
  uint64_t graph_builds;  /* CUDA: executable graphs made (new shapes, refused updates) */
  uint64_t graph_replays; /* CUDA: of graph_steps, those launched as they were (no capture) */
} attnd_backend_stats_t;

/* --cuda-completion loop's polling window (attnd_backend_opts_t
 * cuda_spin_us): a 64-session decode step's device time; a longer step is left
 * to the poller thread. */
#define ATTND_CUDA_LOOP_SPIN_US 1000

typedef struct {
  const char *name; /* "cpu" | "cuda" */
  /* Runs the job asynchronously; returns 0, or a negative ATTND_E* (then
   * done_cb is never called). */
  int (*submit)(attnd_backend_t *b, attnd_job_t *job);
  /* Jobs in flight (submitted, done_cb not yet called). */
  int (*inflight)(attnd_backend_t *b);
  /* Device name, memory and compute capability for Health. */
  void (*describe)(attnd_backend_t *b, char *device, size_t len, uint64_t *mem, int *cc);
  /* Optional (NULL: nothing to say): attnd_backend_stats_t, loop thread. */
  void (*stats)(attnd_backend_t *b, attnd_backend_stats_t *st);
  /* Frees everything; only called with nothing in flight. */
  void (*destroy)(attnd_backend_t *b);
  /* Optional (NULL: malloc): host memory of len bytes for a request frame's
   * body, which the transport reads the socket straight into, or for a
   * step's output, which the transport writes to the socket straight from
   * (loop thread). The CUDA backend gives pinned memory (carved from a
   * region made at start, --cuda-frame-pool) for those of at least
   * --cuda-hostfn-min bytes, so that q, k and v go to the device by DMA from
   * the frame itself and the output comes back by DMA into its buffer (jobs
   * with inputs_pinned, outputs_pinned), with no staging copy; NULL when it
   * has none to give (the caller mallocs). host_free takes back what
   * host_alloc gave (from any thread). */
  void *(*host_alloc)(attnd_backend_t *b, size_t len);
  void (*host_free)(attnd_backend_t *b, void *p);
  /* Optional (NULL: the backend cannot use client device memory, and the
   * engine refuses RegisterBuffer with FAILED_PRECONDITION): same-host
   * zero-copy (docs/protocol.md). Both BLOCK and run on a worker thread,
   * never the loop's. ipc_open maps the 64-byte cudaIpcMemHandle_t at handle
   * and gives the device address of its first byte and the allocation's size
   * (0, or a negative ATTND_E* with a reason in err); ipc_close unmaps it
   * (every job that read or wrote it is done). A backend with ipc_open runs
   * CHECK jobs (the device check of a step's tensors). */
  int (*ipc_open)(attnd_backend_t *b, const uint8_t *handle, void **base, size_t *size, char *err,
                  size_t errlen);
  void (*ipc_close)(attnd_backend_t *b, void *base);
} attnd_backend_ops_t;

struct attnd_backend_s {
  const attnd_backend_ops_t *ops;
  attnd_kshape_t shape;
  int layers;
  uint32_t num_blocks; /* per layer */
  size_t block_bytes;  /* attnd_kv_block_bytes(&shape) */
  /* 1: reads a step's q, k and v at any byte offset (the CUDA backend copies
   * them into staging with memcpy), so tensors decoded in place from a frame
   * need no aligned copy; 0: they must be 2-byte aligned (the CPU kernels
   * read 16-bit elements through typed pointers). */
  int any_alignment;
  /* "GPU-<uuid>" of the device (same-host zero-copy compares it with the
   * client's); "" for the CPU backend. */
  char device_uuid[48];
};

/* How a backend is set up: sizes and tuning, filled by the engine from the
 * daemon's options (docs/operations.md). attnd_backend_opts_defaults() gives
 * the defaults of every field. */
typedef struct {
  uint64_t kv_memory;        /* KV pool bytes, all layers; 0 = backend default (CPU
                              * 1 GiB, CUDA 90% of free device memory) */
  int threads;               /* CPU: worker parts per phase, 0 = one per core */
  int device;                /* CUDA: device ordinal */
  uint64_t cuda_pinned_max;  /* CUDA: cap on pinned staging, 0 = 1/8 of host
                              * memory within [256 MiB, 8 GiB] */
  uint64_t cuda_ring;        /* CUDA: bytes of the pinned ring (and of its device
                              * twin) through which large steps are staged in
                              * chunks, made at start (--cuda-ring); 0 = 256 MiB,
                              * less where --cuda-pinned-max leaves less */
  uint64_t cuda_pinned_warm; /* CUDA: the older name of cuda_ring (--cuda-pinned-warm),
                              * used when cuda_ring is 0; 0 = none */
  uint64_t cuda_frame_pool;  /* CUDA: bytes of pinned memory made at start for request
                              * frames and step outputs (host_alloc), within
                              * cuda_pinned_max; 0 = 1/16 of host memory, at most
                              * 2 GiB and half of what the cap leaves (--cuda-frame-pool) */
  uint64_t cuda_hostfn_min;  /* CUDA: q+k+v bytes above which their host copy
                              * runs in a host function on the stream */
  int cuda_callbacks;        /* CUDA: 1 = stream callbacks signal completion,
                              * 0 = an event poller thread (default) */
  uint64_t cuda_spin_us;     /* CUDA, with the poller: the loop thread also polls
                              * for completions itself for this long after each
                              * submission or completion (--cuda-completion loop:
                              * ATTND_CUDA_LOOP_SPIN_US); 0 = off */
  int cuda_trace;            /* CUDA: 1 = log where steps' time goes */
  int cuda_graphs;           /* CUDA: 1 = small steps as one graph launch per
                              * shape (--cuda-graphs); 2 = from a shape's first
                              * step, not its second (tests) */
  int cuda_graph_replay;     /* CUDA: 1 = a graphed step whose launches equal its
                              * graph's launches it as it is (no capture) */
  uint64_t chunk_keys;       /* a step whose attention reads more keys per q head
                              * (summed over its rows) is large: the CPU backend
                              * cuts it into chunks of about this much, the CUDA
                              * backend keeps it off the priority streams; 0 =
                              * none is (--engine-chunk-keys) */
} attnd_backend_opts_t;

void attnd_backend_opts_defaults(attnd_backend_opts_t *o);

/* Creates the CPU backend; its pool holds as many blocks per layer as
 * o->kv_memory allows. */
int attnd_backend_cpu_create(attnd_backend_t **out, uv_loop_t *loop, const attnd_kshape_t *s,
                             int layers, const attnd_backend_opts_t *o, char *err, size_t errlen);
/* Test hook: ATTND_CPU_FAIL_STEP makes the CPU backend's next STEP job, and
 * ATTND_CPU_FAIL_COPY its next COPY job, fail with ATTND_EINTERNAL after its
 * work ran, as a failed device call would; ATTND_CPU_FAIL_DEVICE the next
 * STEP with ATTND_EDEVICE, as a sticky device error would (the hook clears
 * itself). Never set outside tests. */
enum { ATTND_CPU_FAIL_STEP = 1, ATTND_CPU_FAIL_COPY = 2, ATTND_CPU_FAIL_DEVICE = 3 };
extern int attnd_backend_cpu_fail_next;

/* 1 when a usable CUDA device exists (any error from cudaGetDeviceCount: 0).
 * Always 0 in builds without CUDA. */
int attnd_backend_cuda_available(void);
/* Creates the CUDA backend on o->device. ATTND_EUNAVAIL in builds without
 * CUDA or with no usable device. */
int attnd_backend_cuda_create(attnd_backend_t **out, uv_loop_t *loop, const attnd_kshape_t *s,
                              int layers, const attnd_backend_opts_t *o, char *err, size_t errlen);

#endif /* ATTND_BACKEND_H */

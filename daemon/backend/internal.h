/* internal.h: the backends' private declarations, seen only by backend/'s
 * own files. The CPU backend (cpu.c) keeps everything static; the CUDA
 * backend is these files over one struct, declared here:
 *
 *   cuda_device.c    device setup and teardown, the ops table, Health facts
 *   cuda_stage.c     pinned host staging and stream-ordered device buffers
 *   cuda_ring.c      the ring: large steps' chunks through its slots
 *   cuda_ring_plan.c the ring made at start, large steps cut into chunks
 *   cuda_enqueue.c   a job's work enqueued on its layer's stream (loop thread)
 *   cuda_complete.c  completion: event poller or stream callbacks -> loop
 *   cuda_trace.c     --cuda-trace: timing of where a step's time goes
 *   cuda_graph.c     --cuda-graphs: a small step's sequence as one graph launch
 *   cuda_ipc.c       same-host zero-copy: client memory mapped, checked
 *
 * cuda_device.c's header comment explains memory, ordering, staging,
 * completion and errors as a whole. */
#ifndef ATTND_BACKEND_INTERNAL_H
#define ATTND_BACKEND_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "base.h"

/* Timestamps of jobs (attnd_job_t t_*_us): uv_hrtime() in microseconds. */
static inline uint64_t attnd_backend_now_us(void) {
  return uv_hrtime() / 1000;
}

/* New tokens per write task of a large step on the CPU backend: a few
 * milliseconds of RoPE and quantization for the default model. */
#define ATTND_BACKEND_WRITE_ROWS 1024

/* 1 for a large step (backend.h): attention reading more than chunk_keys
 * keys per q head over its rows (its rows times their context, an upper
 * bound), or more than ATTND_BACKEND_WRITE_ROWS new tokens. Host batch. */
int attnd_backend_job_large(const attnd_job_t *job, uint64_t chunk_keys);

/* A CHECK job (backend.h) over HOST memory: the CPU backend's, for tests of
 * the engine's device-step path. Any thread. */
void attnd_backend_check_host(attnd_job_t *job);

#ifdef ATTND_HAVE_CUDA

#include <cuda_runtime_api.h>
#include <stdatomic.h>

#include "attnd_cuda.h"
#include "cuda_sticky.h"

/* The kernels' error codes are mapped into base's list by value
 * (attnd_err_from_kernel); a change on either side must not go unnoticed. */
_Static_assert(ATTND_CUDA_EINVAL == ATTND_KERNEL_EINVAL, "attnd_cuda.h EINVAL moved");
_Static_assert(ATTND_CUDA_ECUDA == ATTND_KERNEL_ECUDA, "attnd_cuda.h ECUDA moved");
_Static_assert(ATTND_CUDA_EDEVICE == ATTND_KERNEL_EDEVICE, "attnd_cuda.h EDEVICE moved");

/* Streams: enough for the layers of one step to overlap, few enough that the
 * per-stream buffers stay small. As many again of high priority take the
 * small unordered jobs (backend.h). */
#define CU_MAX_STREAMS 8 /* 2x at most 64: the poller keeps a bit per stream */
/* CHECK runs in flight at most (cuda_ipc.c); more wait for a slot. */
#define CU_CHECK_SLOTS 256
/* Pinned staging buffers are allocated in power-of-two sizes from this up. */
#define CU_STAGE_MIN ((size_t)2 << 20)
/* Device staging grows to at least this. */
#define CU_DBUF_MIN ((size_t)4 << 20)
/* The split-KV workspace is an optimization: past this, attend splits less. */
#define CU_WS_MAX ((size_t)256 << 20)
/* Alignment of every region inside a staging buffer (vector loads, DMA). */
#define CU_ALIGN ((size_t)256)
/* The ring (cuda_ring.c): its default size, its least, its slots, and how
 * many slots one step holds at once (one chunk computing, one staged). */
#define CU_RING_DEFAULT ((size_t)256 << 20)
#define CU_RING_MIN ((size_t)1 << 20)
#define CU_RING_SLOTS 4
#define CU_RING_PER_RUN 3 /* one chunk's H2D, the one before computing, the one before that's D2H  \
                           */
/* The pinned frame pool (cuda_stage.c): its default cap, and its least size. */
#define CU_FRAMES_DEFAULT ((size_t)2 << 30)
#define CU_FRAMES_MIN ((size_t)1 << 20)
/* q rows the per-stream attention workspace is sized for at start: a decode
 * batch of up to this many rows gets all the splits it asks for; a larger
 * one splits less (the workspace never grows while serving). */
#define CU_WS_ROWS 128
/* --cuda-graphs: executable graph slots per stream, one per step shape and
 * layer (cuda_graph.c), the least recently used replaced: CU_GRAPHS_PER_LAYER
 * for each layer the stream serves (a layer of an 80-layer model shares its
 * stream with nine others; a decode loop's steps visit them in turn, so
 * fewer slots than its layers' shapes would replace every one before it is
 * used again), at least CU_GRAPHS_MIN. A slot is ~60 bytes; its graph is
 * made only when its shape comes back. */
#define CU_GRAPHS_PER_LAYER 4
#define CU_GRAPHS_MIN 8
/* Graphs kept of one shape and layer, each over its own staging buffer: two
 * steps of a shape in flight at once (two micro-batches of a layer, or more
 * layer steps in flight than layers) take two buffers, and each goes on
 * replaying its own. */
#define CU_GRAPH_COPIES 2

typedef struct cu_backend_s cu_backend_t;
typedef struct cu_ring_plan_s cu_ring_plan_t; /* internal_ring.h */

typedef struct cu_stage_s {
  uint8_t *p; /* pinned host memory */
  size_t cap;
  struct cu_stage_s *next; /* free list */
} cu_stage_t;

/* One unit of stream work: one job. */
typedef struct cu_run_s {
  cu_backend_t *be;
  attnd_job_t *job;
  cu_stage_t *stage;
  int stream;
  int status; /* set on the loop thread when an enqueue failed */
  char msg[128];
  cudaError_t async; /* set by the stream callback */
  size_t out_off, lse_off;
  size_t q_off, k_off, v_off; /* where attnd_cu_stage_inputs_fn puts q, k and v */
  uint64_t t_start, t_end;
  /* Trace: events around H2D, write, attend, D2H; host times at the end of
   * the enqueue (loop thread) and at the stream callback. */
  cudaEvent_t ev[5];
  int traced;
  uint64_t t_enq, t_cb;
  int by_loop;          /* completed by the loop thread's own polling (--cuda-completion loop) */
  int graphed;          /* its sequence is captured / went as one graph launch (cuda_graph.c) */
  uint64_t gprint;      /* the captured sequence's launch print (0: not replayable) */
  cudaEvent_t done_ev;  /* polled completion: recorded behind the run's work */
  cudaEvent_t fence_ev; /* an ordered run's wait for its layer's priority stream */
  /* The ring (cuda_ring.c). A large step's run has a plan and holds ring
   * slots through its chunks; each chunk is a run of its own (parent set,
   * slot held) whose completion gives the slot back. */
  cu_ring_plan_t *plan;
  struct cu_run_s *parent;
  int slot;               /* a chunk's ring slot; a CHECK run's result slot + 1 (cuda_ipc.c) */
  int path;               /* 0 undecided, 1 fast (pooled stage), 2 ring, 3 one-shot */
  uint64_t t_first;       /* a ring run: when its first chunk began (under mu) */
  struct cu_run_s *pnext; /* pending list of the poller (under pmu) */
  struct cu_run_s *next;  /* wait queue (loop thread), then done queue (under mu) */
} cu_run_t;

/* Where a step's time goes (--cuda-trace; a diagnostic: five events per
 * step). Medians over each window of CU_TRACE_N steps go to the log. */
#define CU_TRACE_N 256
enum { TR_ENQ, TR_H2D, TR_WRITE, TR_ATTEND, TR_D2H, TR_CB, TR_HOP, TR_COUNT };
typedef struct {
  float v[TR_COUNT][CU_TRACE_N];
  int n;
  int nloop;  /* of the window's steps, completed by the loop thread's polling */
  int ngraph; /* of the window's steps, launched as one graph (cuda_graph.c) */
} cu_trace_t;

/* A step shape's executable graph of one layer on one stream (cuda_graph.c);
 * exec NULL: the shape was seen once (it runs directly; the next one is
 * captured). print, hp, dp: what the exec holds (the kernels' launch print,
 * attnd_cuda_step_print; the staging buffers its copies use), so that a
 * step with the same ones launches it again as it is; print 0: unknown. */
typedef struct {
  uint64_t key, used;
  uint64_t print;
  const uint8_t *hp, *dp;
  const void *qsrc; /* a device_io step's q: its copy's source in the graph */
  cudaGraphExec_t exec;
} cu_graph_t;

typedef struct {
  cudaStream_t st;
  /* A layer stream's copy streams (the ring's chunks: H2D on h2d, D2H on
   * d2h, kernels on st, joined by events), NULL on the priority twins. */
  cudaStream_t h2d, d2h;
  cu_graph_t *graphs; /* ngraphs slots (CU_GRAPHS_PER_LAYER) */
  int ngraphs;
  uint8_t *dbuf; /* device staging: inputs then outputs of the running job */
  size_t dcap;
  void *ws; /* attention workspace */
  size_t wcap;
  uint64_t last_end_us; /* end of the last job on this stream (under mu) */
  int nrun;             /* runs enqueued here and not finished (loop thread) */
} cu_stream_t;

struct cu_backend_s {
  attnd_backend_t base;
  uv_loop_t *loop;
  uv_async_t async; /* freed with the struct, in its close callback */
  int device;
  uint8_t *pool;      /* KV blocks of every layer */
  size_t layer_bytes; /* num_blocks * block_bytes */
  float *dscales;     /* [layers][4][nsc] */
  size_t nsc;         /* kv_heads * head_dim */
  int *scales_ok;     /* [layers] scales enqueued (loop thread, in job order) */
  int *per_channel;   /* [layers] */
  float *dsinks;      /* [layers][q_heads] sink logits on the device */
  int *sinks_ok;      /* [layers] sinks enqueued (loop thread, in job order) */
  /* [0, nstreams): layer l's ordered and large jobs on stream l % nstreams;
   * [nstreams, 2 nstreams): its small unordered jobs, high priority. */
  cu_stream_t streams[2 * CU_MAX_STREAMS];
  int nstreams;
  uint64_t chunk_keys;     /* backend.h: a larger step stays off the priority streams */
  cu_stage_t *free_stages; /* loop thread only */
  cu_stage_t **owned;      /* every stage ever allocated, freed at destroy */
  size_t nowned, owned_cap;
  size_t pinned_bytes, pinned_max; /* sum of owned caps; the cap on it */
  size_t hostfn_min;               /* q+k+v bytes copied by a host function past this */
  /* The ring: ring_bytes of pinned host memory and as much device memory,
   * CU_RING_SLOTS slots of slot_bytes, made at start (cuda_ring.c). */
  uint8_t *ring_h, *ring_d;
  size_t ring_bytes, slot_bytes;
  size_t ring_want;   /* --cuda-ring, 0 = the default */
  size_t pinned_warm; /* --cuda-pinned-warm: the ring's older name */
  int slot_busy[CU_RING_SLOTS];
  uint64_t ring_chunks; /* chunks staged through the ring so far (tests, logs) */
  /* Bytes of steps' q, k, v and out copied on the host into or out of
   * pinned staging (0 for a step whose frame and output are pinned). */
  atomic_uint_fast64_t staged_bytes;
  uint64_t oneshot_steps; /* large steps that could not be cut (one-shot staging) */
  int stages_out;         /* stages held by runs */
  int big_out;            /* of which the one-shot path's (over CU_STAGE_MIN) */
  /* Pinned request frames and step outputs (attnd_cu_frame_alloc): one
   * region made at start, apart from the stages (frames are held until their
   * requests finish, which may wait for stages: sharing buffers could
   * deadlock), carved first-fit; when full, frames are plain memory. */
  uv_mutex_t fmu;      /* guards the frame pool (host_free may come from any thread) */
  uint8_t *frames_h;   /* the region */
  void *frames_free;   /* free extents, by address (in-band headers) */
  size_t frame_bytes;  /* the region's size (0: none) */
  size_t frame_want;   /* --cuda-frame-pool, 0 = the default */
  size_t frames_inuse; /* bytes of blocks out */
  int frames_out;
  cu_run_t *whead, *wtail; /* jobs waiting for a stage, FIFO */
  /* The one-shot path's large pinned buffers are allocated on the worker
   * pool (cuda_stage.c), one at a time. */
  int stage_alloc_inflight;
  int stage_alloc_err; /* cudaError_t of the last failed stage allocation, for the next taker */
  int started;         /* create finished: from now on nothing is allocated for a step
                        * (but by the one-shot path, cuda_ring.c) */
  int closed;          /* destroyed: an allocation finishing frees its buffer */
  int handle_closed;   /* async handle closed: the last allocation's callback frees the struct */
  uv_mutex_t mu;       /* guards the done queue and streams[].last_end_us */
  cu_run_t *dhead, *dtail;
  atomic_int dead; /* a sticky device error was seen */
  int inflight;    /* jobs submitted, done_cb not yet called */
  char devname[128];
  uint64_t devmem;
  int cc;
  cu_trace_t *trace; /* --cuda-trace, else NULL */
  /* Polled completion (cuda_complete.c); poll 0: stream callbacks. */
  int poll;
  uv_thread_t poller;
  int poller_started;
  uv_mutex_t pmu;
  uv_cond_t pcv;
  cu_run_t *phead, *ptail; /* runs whose done event is recorded, in submission order */
  int pstop;
  int pscan; /* the pending list is out for a round (poller or loop; under pmu) */
  /* --cuda-completion loop: the loop thread's own polling (an idle handle,
   * allocated, closed at destroy), its window and whether it runs now. */
  uv_idle_t *spin;
  uint64_t loop_spin_us, spin_until;
  atomic_int loop_spinning;
  uint64_t loop_completions; /* runs the loop's polling completed (stats) */
  /* --cuda-graphs (cuda_graph.c): 0 off, 1 from a shape's second step, 2
   * from its first (tests); counts for stats and the trace. */
  int graphs;
  int graph_replay; /* --cuda-graph-replay: a step whose launches equal its graph's launches it unchanged */
  uint64_t graph_tick, graph_steps, graph_replays, graph_builds, graph_update_fails, graph_capture_fails;
  cudaEvent_t *evfree; /* recycled done events (loop thread) */
  int nevfree, evcap;
  /* Same-host zero-copy (cuda_ipc.c): the CHECK jobs' device state, one
   * ATTND_CUDA_CHECK_STATE_BYTES slot per stream (a stream's checks run in
   * its order, each leaving the slot as it found it), made at start. */
  uint8_t *ipc_dstate;
  /* Their pinned results, CU_CHECK_SLOTS of 4 words, and the free slots
   * (loop thread): a CHECK run holds one from its enqueue to its finish. */
  uint64_t *ipc_hres;
  int *ipc_free;
  int ipc_nfree;
};

static inline uint64_t attnd_cu_now_us(void) {
  return attnd_backend_now_us();
}

static inline size_t attnd_cu_align_up(size_t n) {
  return (n + CU_ALIGN - 1) & ~(CU_ALIGN - 1);
}

/* The errors after which the CUDA context is unusable (one list with the kernels'). */
static inline int attnd_cu_sticky(cudaError_t e) {
  return attnd_cuda_error_sticky(e);
}

/* ---- cuda_stage.c: staging (loop thread, except the host function) ---- */

/* A pinned buffer of at least need bytes. NULL with *cerr == cudaSuccess:
 * the pool is at its cap and buffers held by running jobs will come back
 * (the caller waits); force ignores the cap (tiny internal uploads). */
cu_stage_t *attnd_cu_stage_get(cu_backend_t *be, size_t need, int force, int *cerr);
/* The same, taking the first of the npref pooled buffers at pref that is
 * free, where there is one. */
cu_stage_t *attnd_cu_stage_get_pref(cu_backend_t *be, size_t need, const uint8_t *const *pref,
                                    int npref, int *cerr);
void attnd_cu_stage_put(cu_backend_t *be, cu_stage_t *s);
/* Pinned memory for a large request frame's body or step output (backend.h host_alloc),
 * or NULL (too small to be worth it, the frame pool at its cap, or a buffer
 * of that size being allocated off the loop thread for the next one). */
void *attnd_cu_frame_alloc(attnd_backend_t *base, size_t len);
void attnd_cu_frame_free(attnd_backend_t *base, void *p);
/* The frame pool, made at start (size from the options, within pinned_max). */
int attnd_cu_frames_create(cu_backend_t *be, char *err, size_t errlen);
/* Frees the frame pool (teardown). */
void attnd_cu_frames_release(cu_backend_t *be);
/* 1 while an allocation started by attnd_cu_stage_get or attnd_cu_frame_alloc
 * runs on the worker pool (teardown then leaves the struct to its callback). */
int attnd_cu_allocs_inflight(const cu_backend_t *be);
/* Frees the struct and its mutexes (cuda_device.c): the async handle's close
 * callback, or the last allocation's callback after it. */
void attnd_cu_free_struct(cu_backend_t *be);
/* Grows a stream-owned device buffer, ordered on that stream. */
cudaError_t attnd_cu_dev_reserve(cu_stream_t *cs, void **buf, size_t *cap, size_t need, size_t min);
/* The one host copy of a step's q, k and v into its pinned buffer; runs on
 * the loop thread for small steps, else as a host function on the stream. */
void CUDART_CB attnd_cu_stage_inputs_fn(void *arg);

/* ---- cuda_ring.c: the ring (loop thread, except the host functions) ---- */

/* Allocates the ring at start (size from the options, within pinned_max). */
int attnd_cu_ring_create(cu_backend_t *be, size_t want, const char *opt, char *err, size_t errlen);
void attnd_cu_ring_release(cu_backend_t *be);
/* 1 when the step can go through the ring in chunks (then r->plan is set). */
int attnd_cu_ring_plan(cu_backend_t *be, cu_run_t *r);
/* Enqueues the run's next chunks while slots are free: 1 while chunks are
 * left (the run waits for a slot), 0 once all are enqueued or it failed
 * (r->status says which). */
int attnd_cu_ring_pump(cu_backend_t *be, cu_run_t *r);
/* Loop thread: a chunk's work is done; its slot comes back. Returns its run
 * when the run's own completion was deferred for it (now to be finished). */
cu_run_t *attnd_cu_ring_chunk_done(cu_backend_t *be, cu_run_t *c);
/* 1 when a ring run's completion arrived while chunks of it are still out
 * (its completion could not be tracked behind them: an error path); the
 * last chunk's completion then hands it back. */
int attnd_cu_ring_defer(cu_run_t *r);
void attnd_cu_ring_plan_free(cu_backend_t *be, cu_ring_plan_t *p);
/* The completion thread, once a chunk's device work is done: the host copies
 * its outputs still need (lse rows beside an output DMA'd into its own
 * pinned buffer). No CUDA calls. */
void attnd_cu_ring_chunk_outputs(cu_run_t *c);
/* The device view of a step's batch (cuda_enqueue.c): pool, scales, sinks. */
int attnd_cu_device_batch(cu_backend_t *be, cu_run_t *r, attnd_kbatch_t *db);

/* ---- cuda_graph.c: small steps as graphs (loop thread) ---- */

/* A pinned staging buffer of need bytes for r (attnd_cu_stage_get's
 * contract): one that a graph of r's shape and layer on its stream copies
 * through where one of those is free, so that the graph can run again as it
 * is. */
cu_stage_t *attnd_cu_graph_stage_get(cu_backend_t *be, cu_run_t *r, size_t need, int *cerr);
/* r's sequence (H2D from hp to dp, the kernels of db, D2H back into hp):
 * 2 when it went as a launch of the stream's graph for it, unchanged (the
 * same launch print and buffers: no capture, no update; nothing left to
 * enqueue); 1 when it is to be captured (capture has begun on its stream);
 * 0 to enqueue it directly. */
int attnd_cu_graph_begin(cu_backend_t *be, cu_run_t *r, const attnd_kbatch_t *db,
                         const uint8_t *hp, const uint8_t *dp);
/* Ends the capture that attnd_cu_graph_begin began and, unless r failed,
 * updates the stream's graph of that shape (or makes one) and launches it:
 * 0. 1 when the capture gave nothing to launch and the device is alive: r's
 * error is cleared and the caller makes the same calls directly. */
int attnd_cu_graph_end(cu_backend_t *be, cu_run_t *r);
/* Destroys every stream's graphs (teardown). */
void attnd_cu_graphs_release(cu_backend_t *be);

/* ---- cuda_enqueue.c: submission (loop thread) ---- */

/* Records a failed CUDA runtime call in a run (first failure wins). */
void attnd_cu_run_fail_cuda(cu_run_t *r, const char *file, int line, const char *what,
                            cudaError_t e);

/* Records a failed CUDA runtime call in r and leaves the enqueue: jumps to
 * the caller's `enqueued` label (cuda_enqueue.c, cuda_ring.c). */
#define RUN_CU(r, call)                                                                            \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      attnd_cu_run_fail_cuda((r), __FILE__, __LINE__, #call, e_);                                  \
      goto enqueued;                                                                               \
    }                                                                                              \
  } while (0)

/* Records a failed attnd_cuda_* call. */
void attnd_cu_run_fail_kernel(cu_run_t *r, int rc);
int attnd_cu_submit(attnd_backend_t *base, attnd_job_t *job);
/* Starts waiting jobs, oldest first, while pinned buffers are available. */
void attnd_cu_pump_waiting(cu_backend_t *be);

/* ---- cuda_complete.c: completion ---- */

/* The async handle keeps the loop alive only while work is out. */
void attnd_cu_update_ref(cu_backend_t *be);
/* Puts a run's completion behind everything enqueued on st so far: a stream
 * callback, or an event the poller watches. */
cudaError_t attnd_cu_track(cu_backend_t *be, cu_run_t *r, cudaStream_t st);
/* Hands a run whose stream work could not be tracked to the loop (its stream
 * is drained first: an error path only). */
void attnd_cu_complete_untracked(cu_backend_t *be, cu_run_t *r);
void attnd_cu_async_cb(uv_async_t *h);
/* --cuda-completion loop: the loop thread polls pending runs itself. */
void attnd_cu_spin_cb(uv_idle_t *h);
void attnd_cu_poller_main(void *arg);
void attnd_cu_poller_stop(cu_backend_t *be);
/* Events from a recycled pool (loop thread); NULL when none can be made. */
cudaEvent_t attnd_cu_ev_get(cu_backend_t *be);
void attnd_cu_ev_put(cu_backend_t *be, cudaEvent_t ev);

/* ---- cuda_ipc.c: same-host zero-copy (backend.h) ---- */

/* Worker threads (they block). */
int attnd_cu_ipc_open(attnd_backend_t *base, const uint8_t *handle, void **dev, size_t *size,
                      char *err, size_t errlen);
void attnd_cu_ipc_close(attnd_backend_t *base, void *dev);
/* The CHECK jobs' device state (start; 0 or a negative ATTND_E*), and its
 * release (teardown). */
int attnd_cu_ipc_setup(cu_backend_t *be, char *err, size_t errlen);
void attnd_cu_ipc_release(cu_backend_t *be);
/* A CHECK run's kernel on its stream (loop thread, start_run): 1 when it
 * must wait for a pinned buffer (nothing enqueued). Its result, once the
 * run finished (finish_run, loop thread), into the job. */
int attnd_cu_ipc_enqueue_check(cu_backend_t *be, cu_run_t *r);
void attnd_cu_ipc_check_result(cu_run_t *r);

/* ---- cuda_trace.c ---- */

/* Creates a traced run's events (once per run; tracing off: nothing). */
void attnd_cu_trace_begin(cu_backend_t *be, cu_run_t *r);
/* Records trace event i of a traced run on st. */
void attnd_cu_trace_mark(cu_run_t *r, int i, cudaStream_t st);
/* The same around a graph launch (attnd_cu_trace_mark skips graphed runs). */
void attnd_cu_trace_mark_graph(cu_run_t *r, int i, cudaStream_t st);
/* Loop thread, after the run completed: its events are complete. */
void attnd_cu_trace_run(cu_backend_t *be, cu_run_t *r);

#endif /* ATTND_HAVE_CUDA */

#endif /* ATTND_BACKEND_INTERNAL_H */

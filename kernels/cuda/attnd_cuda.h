/* attnd_cuda.h: the CUDA kernels behind attnd_kernels.h, as a C API.
 *
 * Same function as attnd_cpu_write / attnd_cpu_attend over the same canonical
 * block layout, but every pointer in the shape's batch (items and meta
 * included) is DEVICE memory, and work is enqueued on a stream (a
 * cudaStream_t passed as void * so that C callers need no CUDA header).
 * Nothing here synchronizes the device or allocates memory.
 *
 * Errors: 0, or a negative code whose values match daemon/errors.h:
 *   ATTND_CUDA_EINVAL  (-1)  a shape or batch the kernels cannot run;
 *   ATTND_CUDA_ECUDA   (-15) a CUDA call or launch failed;
 *   ATTND_CUDA_EDEVICE (-16) the failure is sticky (illegal address, launch
 *                            failure, ...): the context is unusable.
 * attnd_cuda_last_error() then names the call site ("write_cache.cu:120:
 * cudaLaunchKernel: an illegal memory access ..."); it is per calling thread.
 */
#ifndef ATTND_CUDA_H
#define ATTND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "attnd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
  ATTND_CUDA_EINVAL = -1,
  ATTND_CUDA_ECUDA = -15,
  ATTND_CUDA_EDEVICE = -16,
};

/* Devices usable by this process; any error from cudaGetDeviceCount (no driver,
 * no device, a driver older than the runtime) counts as 0. */
int attnd_cuda_device_count(void);

/* Name, total memory and compute capability of a device, for Health. */
int attnd_cuda_device_info(int device, char *name, size_t len, uint64_t *total_mem,
                           int *cc_major, int *cc_minor);

/* Message of the last error returned on this thread ("" if none). */
const char *attnd_cuda_last_error(void);

/* Launch options, for benchmarks and tests (NULL everywhere means the
 * defaults, all zero). The kernels read no environment. */
typedef struct {
  int debug;      /* timing experiments only, results wrong: 1 skip the K/V
                   * loads, 2 skip the math of the attention kernels; results
                   * exact: decode kernel load-path variants, 4 its chunk copy
                   * with the block-table read at each refill (the earlier
                   * copy), 8 one chunk in flight ahead instead of all stages,
                   * 16 whole blocks prefetched into L2 a block ahead, 32
                   * the per-piece copy where 4's copy is the default (the
                   * 1-byte cache types), 65536 the split plan without
                   * attnd_kbatch_t.kv_sum (as if unknown) */
  int split;      /* decode batches: 0 choose (kernels/cuda/README.md), 1 flat
                   * split (every CTA the same number of key chunks), 2 per-item
                   * split */
  int min_chunks; /* flat split: fewest 16-key chunks per CTA (0: 8) */
  int no_pdl;     /* 1: launch without programmatic dependent launch */
  int sm90;       /* prefill-shaped batches on a Hopper GPU: 0 the Hopper path
                   * (prefill_sm90.cuh) where the build has sm_90a code, 1 the
                   * tiled kernel (A/B checks and timing) */
  int sm90_sched; /* Hopper path, timing only: bit 0 no pingpong between the
                   * consumer warpgroups, bit 1 no softmax / P V overlap inside
                   * one, bit 2 no softmax at all (results wrong); bit 20
                   * another commit's kernels, in a build configured with
                   * ATTND_SM90_BASE_DIR (development A/B; else ignored) */
  int sm90_gchunk; /* Hopper path: (item, kv head) groups whose query tiles
                    * launch together (0: enough to fill the GPU once) */
  int fuse;       /* attnd_cuda_step: 1 the fused launch where the batch's
                   * plan allows it, -1 never (the write kernel, then the
                   * attention), 0 the default (off: kernels/cuda/README.md) */
} attnd_cuda_opts_t;

/* Phase 1: RoPE on q (in place) and the new k, rounding to the activation
 * dtype, quantization and paged write of k and v: one fused kernel. */
int attnd_cuda_write(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *stream);
int attnd_cuda_write_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *stream,
                          const attnd_cuda_opts_t *opts);

/* Bytes of device scratch that attnd_cuda_attend can use to split long
 * contexts (split-KV) for batches of up to total_q query rows. Passing less
 * (even 0) is valid: the kernels then split less or not at all. */
size_t attnd_cuda_attend_workspace(const attnd_kshape_t *s, int32_t total_q);

/* Phase 2: attention of every item with q over its paged cache (decode and
 * prefill rows alike), must be enqueued after attnd_cuda_write of the same
 * batch on the same stream (or after an event of it). */
int attnd_cuda_attend(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                      size_t workspace_bytes, void *stream);
int attnd_cuda_attend_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                           size_t workspace_bytes, void *stream, const attnd_cuda_opts_t *opts);

/* Both phases of a step: attnd_cuda_write, then (for a batch with q rows)
 * attnd_cuda_attend, with the same results bit for bit (q rotated in place,
 * the cache, out and lse). With attnd_cuda_opts_t.fuse, a decode batch whose
 * every item has q and new k/v rows runs as one launch where its plan allows
 * (the fused step, kernels/cuda/README.md): the decode kernel's CTA whose
 * keys hold a new token writes that token's row before reading it, no write
 * kernel runs and split parts merge inside clusters. Every check of both
 * phases comes before anything is enqueued. */
int attnd_cuda_step(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                    size_t workspace_bytes, void *stream);
int attnd_cuda_step_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                         size_t workspace_bytes, void *stream, const attnd_cuda_opts_t *opts);
/* A fingerprint of what attnd_cuda_step(s, b, workspace, workspace_bytes, any
 * stream) would enqueue: every kernel, grid, block, shared memory size,
 * launch attribute and argument (device pointers included), folded into 64
 * bits, computed on the host without enqueuing anything (no stream, no device
 * wait). Equal prints mean the same launches, so a CUDA graph captured from
 * one such call may be launched again for the other unchanged (the daemon's
 * graph replay). 0 where attnd_cuda_step would refuse the batch, else never 0.
 * The planning hints max_kv_len and kv_sum count only where they change a plan. */
uint64_t attnd_cuda_step_print(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                               size_t workspace_bytes);
/* 1 where attnd_cuda_step would run this batch as the fused launch (for
 * tests and benchmarks), else 0. */
int attnd_cuda_step_fused(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t workspace_bytes,
                          const attnd_cuda_opts_t *opts);

/* Parts the attend kernel would cut this batch into (for benchmarks and tests
 * that want to know which path ran): 1 for no split, the number of CTAs of a
 * flat split, the parts per item of a per-item split. */
int attnd_cuda_attend_splits(const attnd_kshape_t *s, const attnd_kbatch_t *b,
                             size_t workspace_bytes);
int attnd_cuda_attend_splits_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b,
                                  size_t workspace_bytes, const attnd_cuda_opts_t *opts);

/* Same-host zero-copy (ipc.cu; docs/protocol.md). */
enum { ATTND_CUDA_IPC_HANDLE_BYTES = 64 };

/* The device's UUID as "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (lower
 * case hex, nvidia-smi -L's form), which a client compares with its own. */
int attnd_cuda_device_uuid(int device, char *out, size_t len);

/* Maps the memory of a cudaIpcMemHandle_t (its 64 bytes at handle) from
 * another process into this one on device: *base is the device address of
 * the allocation's first byte, *size the allocation's bytes (0 when the
 * driver cannot tell). Blocks (about
 * a millisecond): call it off any latency-critical thread. A handle that
 * cannot be opened (another host's, another device's, a closed allocation)
 * is ATTND_CUDA_ECUDA. */
int attnd_cuda_ipc_open(int device, const void *handle, void **base, size_t *size);
/* Unmaps what attnd_cuda_ipc_open mapped, once no queued work reads it. */
int attnd_cuda_ipc_close(int device, void *base);

/* The device check of tensors in client memory: attnd_cuda_ipc.h. */

#ifdef __cplusplus
}
#endif

#endif /* ATTND_CUDA_H */

/* cuda_ipc.c: the CUDA backend's side of same-host zero-copy (backend.h
 * ipc_open, ipc_close, CHECK jobs; docs/protocol.md).
 *
 * Opening and closing a handle block (about a millisecond) and run on a
 * worker thread of the engine's (engine/ipc.c), never on the loop thread.
 * The finiteness check of a step's tensors is a job like any other: one
 * kernel (attnd_cuda_check_rows) enqueued from the loop thread on the
 * layer's priority stream, which writes its result straight into a pinned
 * slot, and the backend's usual completion (cuda_complete.c: the poller
 * thread, the loop's own polling or a stream callback) hands it back. No
 * thread waits for it, no lock is shared between clients' checks, and a
 * check runs beside other layers' work rather than behind everyone's
 * checks. It reads the client's memory only: the client has finished
 * writing it before it sent the step (docs/protocol.md). */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnd_cuda_ipc.h"
#include "internal.h"

int attnd_cu_ipc_open(attnd_backend_t *base, const uint8_t *handle, void **dev, size_t *size,
                      char *err, size_t errlen) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (atomic_load(&be->dead)) {
    snprintf(err, errlen, "the CUDA device is unusable after an earlier error");
    return ATTND_EDEVICE;
  }
  int rc = attnd_cuda_ipc_open(be->device, handle, dev, size);
  if (rc == 0) {
    if (*size == 0)
      ATTND_LOGW("cuda_ipc_size", "err=\"the driver does not tell a mapped allocation's size: "
                                  "registrations are trusted for theirs\"");
    return 0;
  }
  snprintf(err, errlen, "the daemon's device cannot open this handle (%s)",
           attnd_cuda_last_error());
  if (rc == ATTND_CUDA_EDEVICE) {
    atomic_store(&be->dead, 1);
    return ATTND_EDEVICE;
  }
  return ATTND_EPRECOND;
}

void attnd_cu_ipc_close(attnd_backend_t *base, void *dev) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (attnd_cuda_ipc_close(be->device, dev) != 0)
    ATTND_LOGW("cuda_ipc_close", "err=\"%s\"", attnd_cuda_last_error());
}

/* One device state per stream (layer streams and their priority twins), the
 * pinned result slots: at start, like every other allocation. */
int attnd_cu_ipc_setup(cu_backend_t *be, char *err, size_t errlen) {
  const int n = 2 * be->nstreams;
  cudaError_t e = cudaMalloc((void **)&be->ipc_dstate, (size_t)n * ATTND_CUDA_CHECK_STATE_BYTES);
  if (e == cudaSuccess)
    e = cudaHostAlloc((void **)&be->ipc_hres, CU_CHECK_SLOTS * 4 * sizeof(uint64_t),
                      cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    snprintf(err, errlen, "zero-copy check state: %s", cudaGetErrorString(e));
    return ATTND_ECUDA;
  }
  if (attnd_cuda_check_init(be->ipc_dstate, n, be->streams[0].st) != 0 ||
      cudaStreamSynchronize(be->streams[0].st) != cudaSuccess) {
    cudaGetLastError();
    snprintf(err, errlen, "zero-copy check state: %s", attnd_cuda_last_error());
    return ATTND_ECUDA;
  }
  be->ipc_free = attnd_xcalloc(CU_CHECK_SLOTS, sizeof(int));
  for (int i = 0; i < CU_CHECK_SLOTS; i++)
    be->ipc_free[i] = CU_CHECK_SLOTS - 1 - i;
  be->ipc_nfree = CU_CHECK_SLOTS;
  return 0;
}

void attnd_cu_ipc_release(cu_backend_t *be) {
  if (be->ipc_dstate)
    cudaFree(be->ipc_dstate);
  if (be->ipc_hres)
    cudaFreeHost(be->ipc_hres);
  free(be->ipc_free);
  be->ipc_dstate = NULL;
  be->ipc_hres = NULL;
  be->ipc_free = NULL;
  be->ipc_nfree = 0;
}

int attnd_cu_ipc_enqueue_check(cu_backend_t *be, cu_run_t *r) {
  attnd_job_t *job = r->job;
  if (be->ipc_nfree == 0)
    return 1; /* every slot's check in flight: wait for one to finish */
  int slot = be->ipc_free[--be->ipc_nfree];
  r->slot = slot + 1; /* 0: none taken (a run failed before its enqueue) */
  uint64_t *host = be->ipc_hres + 4 * (size_t)slot;
  int64_t rows[3];
  int32_t elems[3];
  for (int i = 0; i < 3; i++) {
    rows[i] = job->check.p[i] ? (int64_t)job->check.rows[i] : 0;
    elems[i] = (int32_t)job->check.row_elems[i];
  }
  int krc = attnd_cuda_check_rows(job->check.p, rows, elems, job->check.bound,
                                  be->ipc_dstate + (size_t)r->stream * ATTND_CUDA_CHECK_STATE_BYTES,
                                  host, be->streams[r->stream].st);
  if (krc)
    attnd_cu_run_fail_kernel(r, krc);
  return 0;
}

void attnd_cu_ipc_check_result(cu_run_t *r) {
  cu_backend_t *be = r->be;
  attnd_job_t *job = r->job;
  const uint64_t *host = r->slot ? be->ipc_hres + 4 * (size_t)(r->slot - 1) : NULL;
  for (int i = 0; i < 3; i++) {
    job->check.bad[i] = SIZE_MAX;
    job->check.bits[i] = 0;
    if (r->status || !host || !job->check.p[i] || host[i] == UINT64_MAX)
      continue;
    job->check.bad[i] = (size_t)(host[i] >> 32);
    job->check.bits[i] = (uint32_t)(host[i] & 0xffffffffu);
  }
  if (r->slot)
    be->ipc_free[be->ipc_nfree++] = r->slot - 1;
  r->slot = 0;
}

#endif /* ATTND_HAVE_CUDA */

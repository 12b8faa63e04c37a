/* cuda_ipc.c: the CUDA backend's side of same-host zero-copy (backend.h
 * ipc_open, ipc_close, ipc_scan; docs/protocol.md).
 *
 * Every function here blocks and runs on a worker thread of the engine's
 * (engine/ipc.c), never on the loop thread: opening a handle costs about a
 * millisecond, and the finiteness check of a step's tensors waits for its
 * kernel. The check runs on a stream of its own, under a mutex (one check
 * at a time: each is a few microseconds of device time), and reads the
 * client's memory only: the client has finished writing it before it sent
 * the step (docs/protocol.md). */
#ifdef ATTND_HAVE_CUDA

#include <stdio.h>
#include <string.h>

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

/* The check's stream and result slots, made at the first check (under ipc_mu). */
static int scan_setup(cu_backend_t *be) {
  if (be->ipc_st)
    return 0;
  if (cudaStreamCreateWithFlags(&be->ipc_st, cudaStreamNonBlocking) != cudaSuccess)
    goto fail;
  if (cudaHostAlloc((void **)&be->ipc_hres, 4 * sizeof(uint64_t), cudaHostAllocPortable) !=
      cudaSuccess)
    goto fail;
  if (cudaMalloc((void **)&be->ipc_dres, 4 * sizeof(uint64_t)) != cudaSuccess)
    goto fail;
  return 0;
fail:
  cudaGetLastError();
  attnd_cu_ipc_release(be);
  return ATTND_ECUDA;
}

int attnd_cu_ipc_scan(attnd_backend_t *base, int n, const void *const *p, const size_t *rows,
                      const size_t *row_elems, const uint32_t *bound, size_t *bad, uint32_t *bits) {
  cu_backend_t *be = (cu_backend_t *)base;
  if (n > 4)
    return ATTND_EINVAL;
  if (atomic_load(&be->dead))
    return ATTND_EDEVICE;
  int rc = 0;
  uv_mutex_lock(&be->ipc_mu);
  cudaSetDevice(be->device);
  if ((rc = scan_setup(be)) != 0)
    goto out;
  for (int i = 0; i < n; i++) {
    bad[i] = SIZE_MAX;
    bits[i] = 0;
    if (!p[i] || rows[i] == 0)
      continue;
    int krc = attnd_cuda_scan_rows(p[i], (int64_t)rows[i], (int32_t)row_elems[i], bound[i],
                                   be->ipc_dres + i, be->ipc_st);
    if (krc) {
      rc = attnd_err_from_kernel(krc);
      goto out;
    }
  }
  cudaError_t e = cudaMemcpyAsync(be->ipc_hres, be->ipc_dres, 4 * sizeof(uint64_t),
                                  cudaMemcpyDeviceToHost, be->ipc_st);
  if (e == cudaSuccess)
    e = cudaStreamSynchronize(be->ipc_st);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (attnd_cu_sticky(e))
      atomic_store(&be->dead, 1);
    rc = attnd_cu_sticky(e) ? ATTND_EDEVICE : ATTND_ECUDA;
    goto out;
  }
  for (int i = 0; i < n; i++) {
    if (!p[i] || rows[i] == 0 || be->ipc_hres[i] == UINT64_MAX)
      continue;
    bad[i] = (size_t)(be->ipc_hres[i] >> 32);
    bits[i] = (uint32_t)(be->ipc_hres[i] & 0xffffffffu);
  }
out:
  uv_mutex_unlock(&be->ipc_mu);
  return rc;
}

void attnd_cu_ipc_release(cu_backend_t *be) {
  if (be->ipc_st) {
    cudaStreamSynchronize(be->ipc_st);
    cudaStreamDestroy(be->ipc_st);
  }
  if (be->ipc_hres)
    cudaFreeHost(be->ipc_hres);
  if (be->ipc_dres)
    cudaFree(be->ipc_dres);
  be->ipc_st = NULL;
  be->ipc_hres = NULL;
  be->ipc_dres = NULL;
}

#endif /* ATTND_HAVE_CUDA */

/* cuda_sticky.h: which CUDA errors leave the context unusable ("sticky"): after
 * one of these every later call fails, so the daemon answers UNAVAILABLE and
 * exits for its supervisor to restart it. One list, shared by the kernels
 * (common.cu) and the CUDA backend (daemon/backend_cuda.c). */
#ifndef ATTND_CUDA_STICKY_H
#define ATTND_CUDA_STICKY_H

#include <cuda_runtime_api.h>

static inline int attnd_cuda_error_sticky(cudaError_t e) {
  switch (e) {
  case cudaErrorIllegalAddress:
  case cudaErrorLaunchFailure:
  case cudaErrorIllegalInstruction:
  case cudaErrorMisalignedAddress:
  case cudaErrorInvalidAddressSpace:
  case cudaErrorInvalidPc:
  case cudaErrorHardwareStackError:
  case cudaErrorAssert:
  case cudaErrorECCUncorrectable:
  case cudaErrorLaunchTimeout:
  case cudaErrorContextIsDestroyed:
    return 1;
  default:
    return 0;
  }
}

#endif /* ATTND_CUDA_STICKY_H */

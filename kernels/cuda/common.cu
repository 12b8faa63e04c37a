// common.cu: device detection and the per-thread error message of the C API.
#include <atomic>

#include <stdio.h>
#include <string.h>

#include "common.cuh"
#include "cuda_sticky.h"

namespace attnd {

static thread_local char g_err[256];
thread_local LaunchPrint *t_print = nullptr;

static bool sticky(cudaError_t e) { return attnd_cuda_error_sticky(e) != 0; }

static const char *base(const char *file) {
  const char *s = strrchr(file, '/');
  return s ? s + 1 : file;
}

int set_error(const char *file, int line, const char *what, cudaError_t e) {
  cudaGetLastError(); // a non-sticky error must not resurface at the next, unrelated check
  snprintf(g_err, sizeof g_err, "%s:%d: %s: %s", base(file), line, what, cudaGetErrorString(e));
  return sticky(e) ? ATTND_CUDA_EDEVICE : ATTND_CUDA_ECUDA;
}

int set_invalid(const char *file, int line, const char *what) {
  snprintf(g_err, sizeof g_err, "%s:%d: %s", base(file), line, what);
  return ATTND_CUDA_EINVAL;
}

// Per device, asked once: the planners call it several times per launch.
int num_sms() {
  constexpr int kDevs = 64;
  static std::atomic<int> g_n[kDevs];
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 132;
  }
  if (dev >= 0 && dev < kDevs && (n = g_n[dev].load(std::memory_order_relaxed)) > 0)
    return n;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    cudaGetLastError();
    return 132;
  }
  if (dev >= 0 && dev < kDevs)
    g_n[dev].store(n, std::memory_order_relaxed);
  return n;
}

} // namespace attnd

extern "C" int attnd_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError(); // not sticky; clear it so later calls start clean
    return 0;
  }
  return n < 0 ? 0 : n;
}

extern "C" int attnd_cuda_device_info(int device, char *name, size_t len, uint64_t *total_mem,
                                      int *cc_major, int *cc_minor) {
  cudaDeviceProp p;
  ATTND_CU(cudaGetDeviceProperties(&p, device));
  if (name && len) {
    strncpy(name, p.name, len - 1);
    name[len - 1] = 0;
  }
  if (total_mem)
    *total_mem = p.totalGlobalMem;
  if (cc_major)
    *cc_major = p.major;
  if (cc_minor)
    *cc_minor = p.minor;
  return 0;
}

extern "C" const char *attnd_cuda_last_error(void) { return attnd::g_err; }

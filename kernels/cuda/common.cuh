// common.cuh: element types, conversions and error reporting shared by the
// CUDA kernels, and the launch helper. Nothing here is an op; see write_cache.cu,
// split_plan.cu, attend.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "attnd_cuda.h"
#include "attnd_kernels.h"

namespace attnd {

// Records "file:line: what: cuda message" for attnd_cuda_last_error() and
// returns the API's error code (sticky errors make the context unusable).
int set_error(const char *file, int line, const char *what, cudaError_t e);
int set_invalid(const char *file, int line, const char *what);

#define ATTND_CU(call)                                                                 \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess)                                                             \
      return ::attnd::set_error(__FILE__, __LINE__, #call, e_);                        \
  } while (0)
#define ATTND_CU_LAUNCH(what)                                                          \
  do {                                                                                 \
    cudaError_t e_ = cudaGetLastError();                                               \
    if (e_ != cudaSuccess)                                                             \
      return ::attnd::set_error(__FILE__, __LINE__, what, e_);                         \
  } while (0)

// Activation dtype as a type. DT is an attnd_dtype_t value.
template <int DT> struct Act;
template <> struct Act<ATTND_DT_BF16> {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ float to_f(T x) { return __bfloat162float(x); }
  static __device__ __forceinline__ T from_f(float x) { return __float2bfloat16_rn(x); }
  // Two floats packed as two elements (lo in the low half), round to nearest even.
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  }
};
template <> struct Act<ATTND_DT_FP16> {
  using T = __half;
  static __device__ __forceinline__ float to_f(T x) { return __half2float(x); }
  static __device__ __forceinline__ T from_f(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  }
};

// Runtime-dtype element access (write kernel, merge kernel: not in inner loops).
__device__ __forceinline__ float load_dt(int dt, const void *p, size_t i) {
  if (dt == ATTND_DT_BF16)
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(p)[i]);
  if (dt == ATTND_DT_FP16)
    return __half2float(reinterpret_cast<const __half *>(p)[i]);
  return reinterpret_cast<const float *>(p)[i];
}
__device__ __forceinline__ void store_dt(int dt, void *p, size_t i, float x) {
  if (dt == ATTND_DT_BF16)
    reinterpret_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(x);
  else if (dt == ATTND_DT_FP16)
    reinterpret_cast<__half *>(p)[i] = __float2half_rn(x);
  else
    reinterpret_cast<float *>(p)[i] = x;
}
__device__ __forceinline__ float round_dt(int dt, float x) {
  if (dt == ATTND_DT_BF16)
    return __bfloat162float(__float2bfloat16_rn(x));
  if (dt == ATTND_DT_FP16)
    return __half2float(__float2half_rn(x));
  return x;
}

__device__ __forceinline__ float fp8_to_f(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
  return __half2float(__half(h));
}
__device__ __forceinline__ uint8_t f_to_fp8(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// Bytes of one (token, kv head) row of K or V data in the cache.
__host__ __device__ __forceinline__ int kv_row_bytes(int kv, int d) {
  return (kv == ATTND_KV_BF16 || kv == ATTND_KV_FP16) ? 2 * d : kv == ATTND_KV_INT4 ? d / 2 : d;
}
__host__ __device__ __forceinline__ bool kv_dynamic(int kv) {
  return kv == ATTND_KV_INT8_DYNAMIC || kv == ATTND_KV_FP8_DYNAMIC;
}

int num_sms();

// Launch prints (attnd_cuda_step_print): while the calling thread has one
// set, launch_ex and launch_decode_cluster fold what they would launch (the
// kernel, grid, block, shared memory, attributes and every argument's bytes)
// into it and return cudaSuccess without launching anything.
struct LaunchPrint {
  uint64_t h;
};
extern thread_local LaunchPrint *t_print;
inline void print_bytes(LaunchPrint *p, const void *bytes, size_t n) {
  const unsigned char *c = static_cast<const unsigned char *>(bytes);
  uint64_t h = p->h;
  for (size_t i = 0; i < n; i++)
    h = (h ^ c[i]) * 0x100000001b3ull; // FNV-1a
  p->h = h;
}
template <class K, class... Args>
void print_launch(LaunchPrint *p, K kernel, dim3 grid, dim3 block, size_t smem, unsigned attrs,
                  const Args &...args) {
  const void *fn = reinterpret_cast<const void *>(kernel);
  print_bytes(p, &fn, sizeof fn);
  const unsigned v[8] = {grid.x, grid.y, grid.z, block.x, block.y, block.z, (unsigned)smem, attrs};
  print_bytes(p, v, sizeof v);
  (print_bytes(p, &args, sizeof(args)), ...);
}

// Launches with the programmatic-serialization attribute (PDL) when pdl.
template <class K, class... Args>
cudaError_t launch_ex(K kernel, dim3 grid, dim3 block, size_t smem, bool pdl, cudaStream_t st, Args... args) {
  if (LaunchPrint *lp = t_print) {
    print_launch(lp, kernel, grid, block, smem, pdl ? 1u : 0u, args...);
    return cudaSuccess;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e == cudaErrorNotSupported && pdl) { // a platform without PDL: plain stream order
    cudaGetLastError();
    cfg.numAttrs = 0;
    e = cudaLaunchKernelEx(&cfg, kernel, args...);
  }
  return e;
}

} // namespace attnd

// ipc.cu: same-host zero-copy (docs/protocol.md): mapping memory another
// process shared with cudaIpcGetMemHandle, the device's UUID that clients
// compare with theirs, and the finiteness and magnitude check of tensors
// that live in such memory (docs/numerics.md section 6: the host scan's
// rule, on the device).
#include <stdio.h>
#include <string.h>

#include "common.cuh"

namespace attnd {

// One warp per row: the row's largest magnitude as a 16-bit pattern (sign
// cleared; NaN and infinity order above every finite value, as in
// attnd_cpu_max_abs_bits), and for a row past the bound an atomicMin of
// (row << 32 | bits), so the result names the first such row with its own
// largest magnitude. Elements are read as 16-bit words: any 2-byte aligned
// address works.
__global__ void scan_rows_kernel(const uint16_t *__restrict__ p, long long rows, int row_elems,
                                 uint32_t bound, unsigned long long *result) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    const uint16_t *row = p + r * (long long)row_elems;
    uint32_t m = 0;
    for (int i = lane; i < row_elems; i += 32) {
      uint32_t h = row[i] & 0x7fffu;
      m = h > m ? h : m;
    }
    for (int o = 16; o > 0; o >>= 1) {
      uint32_t x = __shfl_xor_sync(0xffffffffu, m, o);
      m = x > m ? x : m;
    }
    if (lane == 0 && m > bound)
      atomicMin(result, ((unsigned long long)r << 32) | m);
  }
}

} // namespace attnd

extern "C" int attnd_cuda_device_uuid(int device, char *out, size_t len) {
  cudaDeviceProp p;
  ATTND_CU(cudaGetDeviceProperties(&p, device));
  const unsigned char *u = (const unsigned char *)p.uuid.bytes;
  snprintf(out, len,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
           u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
           u[15]);
  return 0;
}

namespace {

// cuMemGetAddressRange_v2 through the runtime's driver entry point (no link
// against libcuda): the size of the allocation a pointer lies in.
typedef int (*AddressRangeFn)(unsigned long long *base, size_t *size, unsigned long long ptr);

AddressRangeFn address_range() {
  static AddressRangeFn fn = []() -> AddressRangeFn {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<AddressRangeFn>(f);
  }();
  return fn;
}

} // namespace

extern "C" int attnd_cuda_ipc_open(int device, const void *handle, void **base, size_t *size) {
  cudaIpcMemHandle_t h;
  static_assert(sizeof(h) == ATTND_CUDA_IPC_HANDLE_BYTES, "cudaIpcMemHandle_t size");
  memcpy(&h, handle, sizeof(h));
  *base = NULL;
  *size = 0;
  ATTND_CU(cudaSetDevice(device));
  ATTND_CU(cudaIpcOpenMemHandle(base, h, cudaIpcMemLazyEnablePeerAccess));
  // The mapping is the whole allocation: its size bounds every region a
  // step may name, whatever size the client registers. A driver that cannot
  // say leaves *size 0 (unknown).
  AddressRangeFn fn = address_range();
  unsigned long long b = 0;
  size_t n = 0;
  if (fn && fn(&b, &n, (unsigned long long)(uintptr_t)*base) == 0 &&
      b == (unsigned long long)(uintptr_t)*base)
    *size = n;
  return 0;
}

extern "C" int attnd_cuda_ipc_close(int device, void *base) {
  ATTND_CU(cudaSetDevice(device));
  ATTND_CU(cudaIpcCloseMemHandle(base));
  return 0;
}

extern "C" int attnd_cuda_scan_rows(const void *p, int64_t rows, int32_t row_elems,
                                    uint32_t bound_bits, uint64_t *result, void *stream) {
  if (rows < 0 || row_elems <= 0 || ((uintptr_t)p & 1) || ((uintptr_t)result & 7))
    return ::attnd::set_invalid(__FILE__, __LINE__, "scan_rows: bad arguments");
  cudaStream_t st = (cudaStream_t)stream;
  ATTND_CU(cudaMemsetAsync(result, 0xff, sizeof(uint64_t), st));
  if (rows == 0)
    return 0;
  const int threads = 256, per_block = threads / 32;
  long long blocks = (rows + per_block - 1) / per_block;
  const long long cap = 132LL * 16;
  if (blocks > cap)
    blocks = cap;
  ::attnd::scan_rows_kernel<<<(unsigned)blocks, threads, 0, st>>>(
      (const uint16_t *)p, (long long)rows, row_elems, bound_bits,
      (unsigned long long *)result);
  ATTND_CU_LAUNCH("scan_rows_kernel");
  return 0;
}

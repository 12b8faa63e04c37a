// ipc.cu: same-host zero-copy (docs/protocol.md): mapping memory another
// process shared with cudaIpcGetMemHandle, the device's UUID that clients
// compare with theirs, the finiteness and magnitude check of tensors that
// live in such memory (docs/numerics.md section 6: the host scan's rule, on
// the device), and the done signal a step raises in it (attnd_cuda_ipc.h).
#include <stdio.h>
#include <string.h>

#include "attnd_cuda_ipc.h"
#include "common.cuh"

namespace attnd {

struct CheckArgs {
  const uint16_t *p[3];
  long long rows[3];
  int row_elems[3];
  uint32_t bound[3];
};

// The largest 16-bit magnitude pattern (sign cleared) of a row, across the
// warp: NaN and infinity order above every finite value, as in
// attnd_cpu_max_abs_bits. 16-byte loads where the row allows them (the
// protocol's offsets are multiples of 256, and rows of the model's shapes
// multiples of 8 elements), 2-byte ones elsewhere.
__device__ uint32_t row_max(const uint16_t *__restrict__ row, int n, int lane) {
  uint32_t m = 0;
  if ((((uintptr_t)row) & 15) == 0 && (n & 7) == 0) {
    const uint4 *v = reinterpret_cast<const uint4 *>(row);
    for (int i = lane; i < n / 8; i += 32) {
      uint4 x = v[i];
      uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        uint32_t lo = w[j] & 0x7fffu, hi = (w[j] >> 16) & 0x7fffu;
        m = lo > m ? lo : m;
        m = hi > m ? hi : m;
      }
    }
  } else {
    for (int i = lane; i < n; i += 32) {
      uint32_t h = row[i] & 0x7fffu;
      m = h > m ? h : m;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    uint32_t x = __shfl_xor_sync(0xffffffffu, m, o);
    m = x > m ? x : m;
  }
  return m;
}

// One warp per row over the three tensors' rows in turn; a row past its
// bound does an atomicMin of (row << 32 | bits) into its tensor's slot of
// state, so the slot names the first such row with its own largest
// magnitude. The last block to finish (the usual threadfence reduction)
// writes the slots to the host's pinned result and puts state back to rest
// for the stream's next check.
__global__ void check_rows_kernel(CheckArgs a, unsigned long long *state,
                                  unsigned long long *host) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  const long long total = a.rows[0] + a.rows[1] + a.rows[2];
  for (long long g = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; g < total;
       g += warps) {
    int t = 0;
    long long r = g;
    if (r >= a.rows[0]) {
      r -= a.rows[0];
      t = 1;
      if (r >= a.rows[1]) {
        r -= a.rows[1];
        t = 2;
      }
    }
    uint32_t m = row_max(a.p[t] + r * (long long)a.row_elems[t], a.row_elems[t], lane);
    if (lane == 0 && m > a.bound[t])
      atomicMin(&state[t], ((unsigned long long)r << 32) | m);
  }
  __threadfence(); // this thread's atomics before the block's count below
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0)
    last = atomicAdd(&state[3], 1ULL) == (unsigned long long)gridDim.x - 1;
  __syncthreads();
  if (last && threadIdx.x < 3) {
    host[threadIdx.x] = atomicExch(&state[threadIdx.x], ~0ULL);
    if (threadIdx.x == 0)
      atomicExch(&state[3], 0ULL);
    __threadfence_system();
  }
}

__global__ void check_init_kernel(unsigned long long *state, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n * 8) // 8 words a state: 3 slots, the count, spare
    state[i] = (i & 7) < 3 ? ~0ULL : 0ULL;
}

// The done signal (attnd_cuda_ipc.h): one thread, one atomic, so that two
// steps raising the same word in either order leave the larger value.
__global__ void signal_kernel(unsigned long long *word, unsigned long long value) {
  atomicMax(word, value);
  __threadfence_system();
}
} // namespace attnd

extern "C" int attnd_cuda_signal(void *word, uint64_t value, void *stream) {
  if (!word || ((uintptr_t)word & 7))
    return ::attnd::set_invalid(__FILE__, __LINE__, "signal: the word is not 8-byte aligned");
  ::attnd::signal_kernel<<<1, 1, 0, (cudaStream_t)stream>>>((unsigned long long *)word,
                                                             (unsigned long long)value);
  ATTND_CU_LAUNCH("signal_kernel");
  return 0;
}

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

extern "C" int attnd_cuda_check_init(void *state, int n, void *stream) {
  static_assert(ATTND_CUDA_CHECK_STATE_BYTES == 8 * sizeof(unsigned long long), "state words");
  if (n <= 0 || ((uintptr_t)state & 7))
    return ::attnd::set_invalid(__FILE__, __LINE__, "check_init: bad arguments");
  ::attnd::check_init_kernel<<<(n * 8 + 255) / 256, 256, 0, (cudaStream_t)stream>>>(
      (unsigned long long *)state, n);
  ATTND_CU_LAUNCH("check_init_kernel");
  return 0;
}

extern "C" int attnd_cuda_check_rows(const void *const p[3], const int64_t rows[3],
                                     const int32_t row_elems[3], const uint32_t bound_bits[3],
                                     void *state, uint64_t *host, void *stream) {
  ::attnd::CheckArgs a;
  long long total = 0;
  for (int i = 0; i < 3; i++) {
    const int none = !p[i] || rows[i] <= 0;
    if (!none && (row_elems[i] <= 0 || ((uintptr_t)p[i] & 1)))
      return ::attnd::set_invalid(__FILE__, __LINE__, "check_rows: bad tensor");
    a.p[i] = (const uint16_t *)p[i];
    a.rows[i] = none ? 0 : (long long)rows[i];
    a.row_elems[i] = none ? 1 : row_elems[i];
    a.bound[i] = bound_bits[i];
    total += a.rows[i];
  }
  if (((uintptr_t)state & 7) || ((uintptr_t)host & 7))
    return ::attnd::set_invalid(__FILE__, __LINE__, "check_rows: bad state or result");
  const int threads = 256, per_block = threads / 32;
  long long blocks = (total + per_block - 1) / per_block;
  const long long cap = 132LL * 16;
  blocks = blocks < 1 ? 1 : blocks > cap ? cap : blocks; // one block at least writes the result
  ::attnd::check_rows_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream>>>(
      a, (unsigned long long *)state, (unsigned long long *)host);
  ATTND_CU_LAUNCH("check_rows_kernel");
  return 0;
}

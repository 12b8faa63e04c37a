// sm90_primitives.cuh: thin wrappers of the Hopper (sm_90a) instructions the
// prefill kernel of prefill_sm90.cuh is built from: mbarriers, the bulk copy
// engine (TMA tensor tiles and plain 1-D bulk copies completing on an
// mbarrier), wgmma fences and descriptors, named barriers, setmaxnreg and the
// generic-to-async proxy fence. No policy lives here.
//
// Every wrapper compiles to nothing on targets without the sm_90a features, so
// that the translation units that include it still build for any
// CMAKE_CUDA_ARCHITECTURES; the host never launches those stubs (the dispatcher
// checks the device and that the build has sm_90a code, prefill_sm90.cuh).
#pragma once

#include <stdint.h>

#include "sm90_wgmma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTND_SM90_DEVICE 1
#else
#define ATTND_SM90_DEVICE 0
#endif

namespace attnd {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// ---- mbarrier (shared::cta) ----------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if ATTND_SM90_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Makes the initialized barriers visible to the async proxy (the copy engine).
__device__ __forceinline__ void mbar_init_fence() {
#if ATTND_SM90_DEVICE
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if ATTND_SM90_DEVICE
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
#endif
}
// One arrival that also announces tx bytes the copy engine will deliver.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if ATTND_SM90_DEVICE
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
#endif
}
__device__ __forceinline__ uint32_t mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
#if ATTND_SM90_DEVICE
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 "
               "%0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(bar), "r"(parity)
               : "memory");
#endif
  return done;
}
// Blocks until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if ATTND_SM90_DEVICE
  while (!mbar_try_wait(bar, parity)) {
  }
#endif
}
// The same with a watchdog, for the producer warpgroup (registers to spare;
// in the consumers the counter costs spills): after 2^31 failed tries, far
// more than any real wait, only a broken pipeline is left, and the trap makes
// the launch fail with an error instead of hanging its stream forever.
__device__ __forceinline__ void mbar_wait_wd(uint32_t bar, uint32_t parity) {
#if ATTND_SM90_DEVICE
  for (uint32_t n = 0; !mbar_try_wait(bar, parity); n++)
    if (n > (1u << 31))
      __trap();
#endif
}

// ---- bulk copy engine ------------------------------------------------------------
// A 4-D tile of a tensor map into shared memory; completes tx bytes on bar.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void *tmap, int c0, int c1, int c2,
                                            int c3, uint32_t bar) {
#if ATTND_SM90_DEVICE
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
               "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
               : "memory");
#endif
}
// A contiguous byte range (16-byte aligned, a multiple of 16 bytes) into shared memory.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes,
                                          uint32_t bar) {
#if ATTND_SM90_DEVICE
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
#endif
}
__device__ __forceinline__ void tma_prefetch_desc(const void *tmap) {
#if ATTND_SM90_DEVICE
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tmap) : "memory");
#endif
}
// Orders this thread's ordinary shared-memory stores before later reads by the
// async proxy (wgmma operands written with st.shared).
__device__ __forceinline__ void fence_proxy_async() {
#if ATTND_SM90_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---- named barriers (id 0 is __syncthreads) -----------------------------------------
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- register reallocation between warpgroups -------------------------------------
template <int R> __device__ __forceinline__ void regs_dec() {
#if ATTND_SM90_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}
template <int R> __device__ __forceinline__ void regs_inc() {
#if ATTND_SM90_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}

// ---- wgmma ---------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() {
#if ATTND_SM90_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if ATTND_SM90_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
#if ATTND_SM90_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Tells the compiler that registers an in-flight wgmma writes change here, so
// that no read of them moves above the wait before it.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++)
    asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++)
    asm volatile("" : "+r"(r[i])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle (PTX ISA "matrix
// descriptor"): start address, leading and stride byte offsets in 16-byte
// units; bits 62-63 = 1 selects the 128B swizzle. Tiles start 1024-aligned, so
// the base offset field stays 0.
//   K-major operand (Q, K): rows of 128 bytes (64 16-bit elements), 8-row
//     groups 1024 bytes apart (SBO); LBO unused (1).
//   N-major operand (V as B of P V): 64-element runs of the N dimension are
//     the 128-byte rows' content, consecutive runs LBO bytes apart; 8-key
//     groups 1024 bytes apart (SBO).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr, uint32_t lbo_bytes,
                                               uint32_t sbo_bytes) {
  return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         ((uint64_t)((sbo_bytes >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

// Byte offset of the 16-byte unit u (0..7) of row r in a 128B-swizzled region
// whose rows are 128 bytes (the TMA SWIZZLE_128B and wgmma layout).
__device__ __forceinline__ uint32_t sw128_off(int r, int u) {
  return (uint32_t)(r * 128 + ((u ^ (r & 7)) << 4));
}

} // namespace sm90
} // namespace attnd

// prefill_sm90_cfg.cuh: tile shapes, shared-memory layout and the element
// conversion of the Hopper prefill kernel (prefill_sm90_impl.cuh).
#pragma once

#include <stdint.h>

#include "common.cuh"

namespace attnd {
namespace sm90 {

constexpr int kThreads = 384; // producer warpgroup + two consumer warpgroups
constexpr int kCvt = 96;      // finishing threads (producer warps 1-3)
constexpr int kBMq = 128;     // query vectors per CTA (64 per consumer warpgroup)
constexpr int kMaxFlags = 1024;
constexpr int kRegsProducer = 40, kRegsConsumer = 232;

// Tile shapes and the shared-memory layout of one instantiation (bytes from a
// 1024-aligned base; every operand tile is 1024-aligned for the swizzle).
template <int D, int DT, int KV> struct Cfg {
  static constexpr bool kDirect =
      (KV == ATTND_KV_BF16 && DT == ATTND_DT_BF16) || (KV == ATTND_KV_FP16 && DT == ATTND_DT_FP16);
  static constexpr bool kDyn = KV == ATTND_KV_INT8_DYNAMIC || KV == ATTND_KV_FP8_DYNAMIC;
  static constexpr bool kStatic = KV == ATTND_KV_INT8 || KV == ATTND_KV_FP8 || KV == ATTND_KV_INT4;
  static constexpr int RB = (KV == ATTND_KV_BF16 || KV == ATTND_KV_FP16) ? 2 * D
                            : KV == ATTND_KV_INT4                        ? D / 2
                                                                         : D;
  // Keys per tile: shared memory bound (Q, two operand stages, two raw stages).
  static constexpr int BN = kDirect    ? (D == 256 ? 64 : 128)
                            : D == 64  ? 128
                            : D == 128 ? (RB <= 128 ? 128 : 64)
                                       : 32;
  static constexpr int CH = D / 64;          // 64-element (128-byte) column chunks
  static constexpr uint32_t KT = BN * D * 2; // one operand tile (K or V)
  // Pipeline stages: three where shared memory allows (16-bit caches, D <= 128).
  static constexpr int kStages = kDirect && D <= 128 ? 3 : 2;
  static constexpr uint32_t kQ = 0;                  // [CH][kBMq][128 B]
  static constexpr uint32_t kOp = kQ + kBMq * D * 2; // [kStages][K, V][CH][BN][128 B]
  // Converting types: two raw stages, each K [BN][RB], V [BN][RB], then
  // (dynamic types) the K and V scales [2][BN] fp32, read there by the consumers.
  static constexpr uint32_t kRaw = kOp + kStages * 2 * KT;
  static constexpr uint32_t kRawStage = kDirect ? 0 : 2 * BN * RB + (kDyn ? 2 * BN * 4 : 0);
  static constexpr uint32_t kFlags = kRaw + kStages * kRawStage; // [kNF] u8 interval tile flags
  static constexpr uint32_t kTail = 16 * 8 + (KV == ATTND_KV_INT4 ? kBMq * 4 : 0);
  // Flags for the first kNF key tiles (later tiles are masked per element, never skipped).
  static constexpr int kNF = kFlags + kMaxFlags + kTail <= 232448 ? kMaxFlags : 512;
  static constexpr uint32_t kC = kFlags + kNF; // int4: [kBMq] fp32 q'.z_k
  static constexpr uint32_t kBar = kC + (KV == ATTND_KV_INT4 ? kBMq * 4 : 0);
  static constexpr uint32_t kEnd = kBar + 16 * 8; // mbarriers
  // Slack to align the base to 1024 bytes by hand where it fits; else the
  // kernel relies on dynamic shared memory starting 1024-aligned (it checks).
  static constexpr uint32_t kSlack = kEnd + 1024 <= 232448 ? 1024 : 0;
  static constexpr uint32_t kBytes = kEnd + kSlack;
  static_assert(kBytes <= 232448, "shared memory of one CTA");
  static_assert(RB % 16 == 0, "raw rows are whole 16-byte units");
};

__device__ __forceinline__ float ex2f(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 16 raw bytes -> EPU operand elements (packed pairs), values as stored.
template <int KV, int DT>
__device__ __forceinline__ void convert16(const uint4 &rv, uint32_t *out) {
  using A = Act<DT>;
  const uint32_t w[4] = {rv.x, rv.y, rv.z, rv.w};
  if constexpr (KV == ATTND_KV_BF16 || KV == ATTND_KV_FP16) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
      float lo, hi;
      if constexpr (KV == ATTND_KV_BF16) {
        lo = __uint_as_float(w[k] << 16);
        hi = __uint_as_float(w[k] & 0xffff0000u);
      } else {
        lo = __half2float(__ushort_as_half((unsigned short)(w[k] & 0xffffu)));
        hi = __half2float(__ushort_as_half((unsigned short)(w[k] >> 16)));
      }
      out[k] = A::pack2(lo, hi);
    }
  } else if constexpr (KV == ATTND_KV_INT8 || KV == ATTND_KV_INT8_DYNAMIC) {
    // Biased byte u = x + 128 as the low mantissa byte of 2^23, minus 2^23 + 128: exact.
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const uint32_t u = w[k] ^ 0x80808080u;
      const float f0 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650u)) - 8388736.f;
      const float f1 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7651u)) - 8388736.f;
      const float f2 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7652u)) - 8388736.f;
      const float f3 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7653u)) - 8388736.f;
      out[2 * k] = A::pack2(f0, f1);
      out[2 * k + 1] = A::pack2(f2, f3);
    }
  } else if constexpr (KV == ATTND_KV_FP8 || KV == ATTND_KV_FP8_DYNAMIC) {
    // e4m3 pairs -> f16 pairs (exact), then to bf16 when that is the operand type.
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
          (__nv_fp8x2_storage_t)((w[k >> 1] >> ((k & 1) * 16)) & 0xffffu), __NV_E4M3);
      if constexpr (DT == ATTND_DT_FP16) {
        out[k] = (uint32_t)h2.x | ((uint32_t)h2.y << 16);
      } else {
        const float2 f2 = __half22float2(__half2(h2));
        out[k] = A::pack2(f2.x, f2.y);
      }
    }
  } else { // int4: channel 2c in the low nibble, 2c+1 in the high one; u in 0..15, exact
#pragma unroll
    for (int k = 0; k < 16; k++) {
      const uint32_t b = (w[k >> 2] >> ((k & 3) * 8)) & 0xffu;
      const float lo = __uint_as_float(0x4B000000u | (b & 0xfu)) - 8388608.f;
      const float hi = __uint_as_float(0x4B000000u | (b >> 4)) - 8388608.f;
      out[k] = A::pack2(lo, hi);
    }
  }
}

} // namespace sm90
} // namespace attnd

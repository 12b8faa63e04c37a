// prefill_sm90.cu: which launches take the Hopper path (prefill_sm90.cuh) and
// the dispatch of runtime shape values to its instantiations. Everything the
// Hopper kernel does not take falls back to the tiled kernel in prefill.cu.
#include <atomic>
#include <stdlib.h>
#include <string.h>

#include "prefill_sm90.cuh"

namespace attnd {
namespace {

constexpr int kMaxDevices = 64;
std::atomic<int> g_cc[kMaxDevices]; // 0 unknown, else major * 10 + minor (+1000 when queried)

int device_cc() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    return 0;
  }
  int v = g_cc[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int ma = 0, mi = 0;
    if (cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    v = 1000 + ma * 10 + mi;
    g_cc[dev].store(v, std::memory_order_relaxed);
  }
  return v - 1000;
}

template <int D, int DT>
int dispatch_kv(int kv, const FlashParams &p, int sched, int nitems, cudaStream_t st) {
  switch (kv) {
  case ATTND_KV_BF16:
    return launch_sm90_t<D, DT, ATTND_KV_BF16>(p, sched, nitems, st);
  case ATTND_KV_FP16:
    return launch_sm90_t<D, DT, ATTND_KV_FP16>(p, sched, nitems, st);
  case ATTND_KV_INT8:
    return launch_sm90_t<D, DT, ATTND_KV_INT8>(p, sched, nitems, st);
  case ATTND_KV_FP8:
    return launch_sm90_t<D, DT, ATTND_KV_FP8>(p, sched, nitems, st);
  case ATTND_KV_INT8_DYNAMIC:
    return launch_sm90_t<D, DT, ATTND_KV_INT8_DYNAMIC>(p, sched, nitems, st);
  case ATTND_KV_FP8_DYNAMIC:
    return launch_sm90_t<D, DT, ATTND_KV_FP8_DYNAMIC>(p, sched, nitems, st);
  case ATTND_KV_INT4:
    return launch_sm90_t<D, DT, ATTND_KV_INT4>(p, sched, nitems, st);
  default:
    return set_invalid(__FILE__, __LINE__, "unknown cache type");
  }
}

template <int D>
int dispatch_dt(int dt, int kv, const FlashParams &p, int sched, int nitems, cudaStream_t st) {
  return dt == ATTND_DT_BF16 ? dispatch_kv<D, ATTND_DT_BF16>(kv, p, sched, nitems, st)
                             : dispatch_kv<D, ATTND_DT_FP16>(kv, p, sched, nitems, st);
}

} // namespace

TensorMapEncodeFn tensor_map_encoder() {
  static TensorMapEncodeFn fn = []() -> TensorMapEncodeFn {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<TensorMapEncodeFn>(f);
  }();
  return fn;
}

bool sm90_eligible(const attnd_kshape_t *s, const FlashParams &p) {
#ifndef ATTND_SM90A
  (void)s;
  (void)p;
  return false; // the build has no sm_90a code: the kernels are stubs
#else
  // Read on every call (a getenv), so that a benchmark can compare both paths in one process.
  const char *e = getenv("ATTND_SM90");
  if (e && strcmp(e, "0") == 0)
    return false;
  if (p.max_vec <= 16 || p.direct)
    return false; // decode-shaped batches: the decode kernels
  if (s->head_dim != 64 && s->head_dim != 128 && s->head_dim != 256)
    return false;
  if (device_cc() != 90)
    return false;
  const bool direct16 = (s->kv == ATTND_KV_BF16 && s->dtype == ATTND_DT_BF16) ||
                        (s->kv == ATTND_KV_FP16 && s->dtype == ATTND_DT_FP16);
  return !direct16 || tensor_map_encoder() != nullptr;
#endif
}

int launch_sm90(const attnd_kshape_t *s, const FlashParams &p, int nitems, cudaStream_t st) {
  // ATTND_SM90_SCHED: bit 0 pingpong between the consumer warpgroups, bit 1
  // no intra-warpgroup overlap (A/B timing); default 1.
  const char *e = getenv("ATTND_SM90_SCHED");
  const int sched = e && *e ? atoi(e) : 1;
  switch (s->head_dim) {
  case 64:
    return dispatch_dt<64>(s->dtype, s->kv, p, sched, nitems, st);
  case 128:
    return dispatch_dt<128>(s->dtype, s->kv, p, sched, nitems, st);
  case 256:
    return dispatch_dt<256>(s->dtype, s->kv, p, sched, nitems, st);
  default:
    return set_invalid(__FILE__, __LINE__, "head dim of the Hopper path");
  }
}

} // namespace attnd

// prefill_sm90.cu: which launches take the Hopper path (prefill_sm90.cuh) and
// the dispatch of runtime shape values to its instantiations. Everything the
// Hopper kernel does not take goes to the tiled kernel (attend.cu).
#include <atomic>

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
int dispatch_kv(int kv, const FlashParams &p, int sched, int gchunk, int nitems, cudaStream_t st) {
  switch (kv) {
  case ATTND_KV_BF16:
    return launch_sm90_t<D, DT, ATTND_KV_BF16>(p, sched, gchunk, nitems, st);
  case ATTND_KV_FP16:
    return launch_sm90_t<D, DT, ATTND_KV_FP16>(p, sched, gchunk, nitems, st);
  case ATTND_KV_INT8:
    return launch_sm90_t<D, DT, ATTND_KV_INT8>(p, sched, gchunk, nitems, st);
  case ATTND_KV_FP8:
    return launch_sm90_t<D, DT, ATTND_KV_FP8>(p, sched, gchunk, nitems, st);
  case ATTND_KV_INT8_DYNAMIC:
    return launch_sm90_t<D, DT, ATTND_KV_INT8_DYNAMIC>(p, sched, gchunk, nitems, st);
  case ATTND_KV_FP8_DYNAMIC:
    return launch_sm90_t<D, DT, ATTND_KV_FP8_DYNAMIC>(p, sched, gchunk, nitems, st);
  case ATTND_KV_INT4:
    return launch_sm90_t<D, DT, ATTND_KV_INT4>(p, sched, gchunk, nitems, st);
  default:
    return set_invalid(__FILE__, __LINE__, "unknown cache type");
  }
}

template <int D>
int dispatch_dt(int dt, int kv, const FlashParams &p, int sched, int gchunk, int nitems,
                cudaStream_t st) {
  return dt == ATTND_DT_BF16 ? dispatch_kv<D, ATTND_DT_BF16>(kv, p, sched, gchunk, nitems, st)
                             : dispatch_kv<D, ATTND_DT_FP16>(kv, p, sched, gchunk, nitems, st);
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

bool sm90_eligible(const attnd_kshape_t *s, const FlashParams &p, const attnd_cuda_opts_t &o) {
#ifndef ATTND_SM90A
  (void)s;
  (void)p;
  (void)o;
  return false; // the build has no sm_90a code: the kernels are stubs
#else
  if (o.sm90 != 0)
    return false; // the tiled kernel asked for (A/B checks, timing)
  if (p.max_vec <= 16)
    return false; // decode-shaped batches: the decode kernel
  if (s->head_dim != 64 && s->head_dim != 128 && s->head_dim != 256)
    return false;
  if (device_cc() != 90)
    return false;
  const bool direct16 = (s->kv == ATTND_KV_BF16 && s->dtype == ATTND_DT_BF16) ||
                        (s->kv == ATTND_KV_FP16 && s->dtype == ATTND_DT_FP16);
  return !direct16 || tensor_map_encoder() != nullptr;
#endif
}

int launch_sm90(const attnd_kshape_t *s, const FlashParams &p, int nitems,
                const attnd_cuda_opts_t &o, cudaStream_t st) {
  // The kernel's bit 0 means pingpong on; the option's bit 0 turns it off.
  // Bits 3-6, 8-9 and 14 select earlier forms, bits 7 and 11-13 opt-in ones,
  // bit 10 a timing experiment (prefill_sm90.cuh).
  const int sched = (o.sm90_sched & 32767) ^ 1, gchunk = o.sm90_gchunk;
  switch (s->head_dim) {
  case 64:
    return dispatch_dt<64>(s->dtype, s->kv, p, sched, gchunk, nitems, st);
  case 128:
    return dispatch_dt<128>(s->dtype, s->kv, p, sched, gchunk, nitems, st);
  case 256:
    return dispatch_dt<256>(s->dtype, s->kv, p, sched, gchunk, nitems, st);
  default:
    return set_invalid(__FILE__, __LINE__, "head dim of the Hopper path");
  }
}

} // namespace attnd

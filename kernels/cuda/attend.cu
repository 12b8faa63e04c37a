// attend.cu: attnd_cuda_attend, the entry of phase 2, which chooses a
// kernel. Batches whose items all have at most 16 query vectors (n x group)
// go to the decode kernel (split_plan.cu plans the cut, decode_kernel.cuh);
// the others to the Hopper prefill path on an sm_90 device with sm_90a code
// (prefill_sm90.cuh; attnd_cuda_opts_t.sm90 = 1 turns it off), else to the
// tiled kernel (tiled_kernel.cuh); both split over their keys when they have
// too few CTAs to fill the GPU, merged by merge.cu. Runtime shape
// values become template arguments here: head dim, activation dtype and cache
// type; block size, scale mode and masks stay runtime values.
#include <math.h>
#include <string.h>

#include "decode_params.cuh"
#include "prefill_sm90.cuh"

#ifdef ATTND_SM90_BASE
namespace attnd {
// Another commit's Hopper prefill launch, built in for a development A/B.
int base_launch_sm90(const attnd_kshape_t *s, const FlashParams &p, int nitems,
                     const attnd_cuda_opts_t &o, cudaStream_t st);
} // namespace attnd
#endif

namespace attnd {
namespace {

constexpr int kTiledVec = 128; // query vectors per tiled CTA

template <int D, int DT>
cudaError_t dispatch_kv(int kv, const FlashParams &p, int nitems, cudaStream_t st) {
  switch (kv) {
  case ATTND_KV_BF16: return launch_flash<D, DT, ATTND_KV_BF16>(p, nitems, st);
  case ATTND_KV_FP16: return launch_flash<D, DT, ATTND_KV_FP16>(p, nitems, st);
  case ATTND_KV_INT8: return launch_flash<D, DT, ATTND_KV_INT8>(p, nitems, st);
  case ATTND_KV_FP8: return launch_flash<D, DT, ATTND_KV_FP8>(p, nitems, st);
  case ATTND_KV_INT8_DYNAMIC: return launch_flash<D, DT, ATTND_KV_INT8_DYNAMIC>(p, nitems, st);
  case ATTND_KV_FP8_DYNAMIC: return launch_flash<D, DT, ATTND_KV_FP8_DYNAMIC>(p, nitems, st);
  case ATTND_KV_INT4: return launch_flash<D, DT, ATTND_KV_INT4>(p, nitems, st);
  default: return cudaErrorInvalidValue;
  }
}

template <int D>
cudaError_t dispatch_dt(int dt, int kv, const FlashParams &p, int nitems, cudaStream_t st) {
  return dt == ATTND_DT_BF16 ? dispatch_kv<D, ATTND_DT_BF16>(kv, p, nitems, st)
                             : dispatch_kv<D, ATTND_DT_FP16>(kv, p, nitems, st);
}

// Resident tiled CTAs per SM (shared memory bound) for split planning.
int tiled_slots(const attnd_kshape_t *s) { return s->head_dim > 128 ? 1 : 2; }

bool is_decode(const attnd_kshape_t *s, const attnd_kbatch_t *b) {
  return (long)b->max_n * (s->q_heads / s->kv_heads) <= kDecMaxVec;
}

int launch_tiled(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace, size_t workspace_bytes,
                 const attnd_cuda_opts_t &o, cudaStream_t st) {
  FlashParams p;
  memset(&p, 0, sizeof p); // every byte set: attnd_cuda_step_print
  p.items = b->items;
  p.meta = b->meta;
  p.q = b->q;
  p.out = b->out;
  p.lse = b->lse;
  p.out_fp32 = b->out_fp32;
  p.cache = b->cache;
  p.block_bytes = b->block_bytes;
  p.k_scale = b->k_scale;
  p.v_scale = b->v_scale;
  p.k_zero = b->k_zero;
  p.v_zero = b->v_zero;
  p.per_channel = b->scale_per_channel;
  p.q_heads = s->q_heads;
  p.kv_heads = s->kv_heads;
  p.group = s->q_heads / s->kv_heads;
  p.bs = s->block_size;
  p.scale_log2 = s->softmax_scale * 1.4426950408889634f;
  softcap_exp2(s, &p.cap2, &p.icap2);
  p.window = b->window;
  p.sinks = b->sinks;
  p.total_q = b->total_q;
  p.debug = o.debug;
  p.pdl = !o.no_pdl;
  p.max_vec = b->max_n * p.group;
  p.nsplit = plan_splits(s, b, workspace ? workspace_bytes : 0, tiled_slots(s), kTiledVec, &p.split_keys);
  p.ws_o = nullptr;
  p.ws_lse = nullptr;
  if (p.nsplit > 1) {
    p.ws_o = reinterpret_cast<float *>(workspace);
    p.ws_lse = p.ws_o + (size_t)p.nsplit * b->total_q * s->q_heads * s->head_dim;
  }
  if (sm90_eligible(s, p, o)) { // prefill-shaped batches on Hopper: wgmma + TMA (prefill_sm90.cuh)
#ifdef ATTND_SM90_BASE // development A/B (kernels/cuda/CMakeLists.txt, ATTND_SM90_BASE_DIR)
    const int rc = (o.sm90_sched & (1 << 20)) ? base_launch_sm90(s, p, b->nitems, o, st)
                                              : launch_sm90(s, p, b->nitems, o, st);
#else
    const int rc = launch_sm90(s, p, b->nitems, o, st);
#endif
    if (rc != 0)
      return rc;
    return p.nsplit > 1 ? launch_merge_split(s, b, p.ws_o, p.ws_lse, p.nsplit, p.pdl != 0, st) : 0;
  }
  cudaError_t e;
  switch (s->head_dim) {
  case 64: e = dispatch_dt<64>(s->dtype, s->kv, p, b->nitems, st); break;
  case 128: e = dispatch_dt<128>(s->dtype, s->kv, p, b->nitems, st); break;
  default: e = dispatch_dt<256>(s->dtype, s->kv, p, b->nitems, st); break;
  }
  if (e != cudaSuccess)
    return set_error(__FILE__, __LINE__, "flash_kernel launch", e);
  if (p.nsplit > 1)
    return launch_merge_split(s, b, p.ws_o, p.ws_lse, p.nsplit, p.pdl != 0, st);
  return 0;
}

// The fused step (attnd_cuda_step): a decode batch whose every item has q
// and new k/v rows (no write-only or attend-only items), under a per-item
// plan of one part per (item, kv head) or of clusters; *fo: the options it
// launches with. The plan is the batch's own where it is one; else (the flat
// split, or parts the merge kernel would merge: several CTAs reading an
// item's q with no point at which all have) the per-item split merged in
// clusters of parts of at least 32 chunks (512 keys), where its CTAs are at
// most one per SM: clusters over a fuller GPU ran 20-40% slower than the
// flat split (B8 ctx 4096, bench/RESULTS.md). The rest run the write
// kernel, then the attention.
// attnd_cuda_opts_t.fuse 0: off until the fused launch is measured faster
// than the two-launch sequence (at B1 ctx 4096 on the H100 its first form
// ran 2-4 us slower, the second 2.4-5.3 us; bench/RESULTS.md).
constexpr int kFuseDefault = -1;

bool plan_fused(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes, const attnd_cuda_opts_t &o,
                attnd_cuda_opts_t *fo) {
  const int want = o.fuse != 0 ? o.fuse : kFuseDefault;
  if (want < 0 || o.split == 1 || !is_decode(s, b) || b->q_only_rows != 0 || b->total_kv <= 0 ||
      b->total_q != b->total_kv || !b->k || !b->v || !b->out)
    return false;
  DecodePlan pl;
  *fo = o;
  plan_decode(s, b, ws_bytes, *fo, &pl);
  if (!pl.flat && (pl.nsplit == 1 || pl.cluster > 1))
    return true;
  fo->split = 2;
  fo->debug |= 256;
  if (fo->min_chunks <= 0)
    fo->min_chunks = 32;
  plan_decode(s, b, ws_bytes, *fo, &pl);
  return !pl.flat &&
         (pl.nsplit == 1 || (pl.cluster > 1 && (long)b->nitems * s->kv_heads * pl.nsplit <= (long)num_sms()));
}

// attnd_cuda_attend's checks of a batch with q rows.
int attend_check(const attnd_kshape_t *s, const attnd_kbatch_t *b) {
  if (attnd_kshape_check(s) != 0)
    return set_invalid(__FILE__, __LINE__, "unsupported shape");
  if (!b->cache || !b->items || !b->meta || !b->q || !b->out)
    return set_invalid(__FILE__, __LINE__, "batch without cache, items, meta, q or out");
  if (attnd_kv_type_static(s->kv) && (!b->k_scale || !b->v_scale))
    return set_invalid(__FILE__, __LINE__, "static cache type without scales");
  if (s->kv == ATTND_KV_INT4 && (!b->k_zero || !b->v_zero))
    return set_invalid(__FILE__, __LINE__, "int4 cache without zero points");
  if (b->window < 0)
    return set_invalid(__FILE__, __LINE__, "negative window");
  if (!(s->softcap >= 0.f) || isinf(s->softcap))
    return set_invalid(__FILE__, __LINE__, "softcap not a finite value >= 0");
  return 0;
}

} // namespace
} // namespace attnd

using namespace attnd;

static const attnd_cuda_opts_t k_default_opts = {};

extern "C" int attnd_cuda_attend_splits_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes,
                                             const attnd_cuda_opts_t *opts) {
  const attnd_cuda_opts_t &o = opts ? *opts : k_default_opts;
  if (is_decode(s, b)) {
    DecodePlan pl;
    plan_decode(s, b, ws_bytes, o, &pl);
    return pl.flat ? pl.nctas : pl.nsplit;
  }
  int keys;
  return plan_splits(s, b, ws_bytes, tiled_slots(s), kTiledVec, &keys);
}

extern "C" int attnd_cuda_attend_splits(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes) {
  return attnd_cuda_attend_splits_opts(s, b, ws_bytes, nullptr);
}

extern "C" int attnd_cuda_attend_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                                      size_t workspace_bytes, void *stream, const attnd_cuda_opts_t *opts) {
  if (attnd_kshape_check(s) != 0)
    return set_invalid(__FILE__, __LINE__, "unsupported shape");
  if (b->total_q <= 0 || b->nitems <= 0 || b->max_n <= 0)
    return 0;
  const int rc = attend_check(s, b);
  if (rc != 0)
    return rc;
  const attnd_cuda_opts_t &o = opts ? *opts : k_default_opts;
  cudaStream_t st = (cudaStream_t)stream;
  if (!workspace)
    workspace_bytes = 0;
  if (is_decode(s, b))
    return launch_decode(s, b, workspace, workspace_bytes, o, st);
  return launch_tiled(s, b, workspace, workspace_bytes, o, st);
}

extern "C" int attnd_cuda_attend(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                                 size_t workspace_bytes, void *stream) {
  return attnd_cuda_attend_opts(s, b, workspace, workspace_bytes, stream, nullptr);
}

extern "C" int attnd_cuda_step_fused(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t workspace_bytes,
                                     const attnd_cuda_opts_t *opts) {
  attnd_cuda_opts_t fo;
  if (attnd_kshape_check(s) != 0 || b->total_q <= 0 || b->nitems <= 0 || b->max_n <= 0)
    return 0;
  return plan_fused(s, b, workspace_bytes, opts ? *opts : k_default_opts, &fo) ? 1 : 0;
}

extern "C" int attnd_cuda_step_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                                    size_t workspace_bytes, void *stream, const attnd_cuda_opts_t *opts) {
  if (attnd_kshape_check(s) != 0)
    return set_invalid(__FILE__, __LINE__, "unsupported shape");
  if (!workspace)
    workspace_bytes = 0;
  const bool attend = b->total_q > 0 && b->nitems > 0 && b->max_n > 0;
  if (attend) {
    // Every check of both phases before anything is enqueued: a batch the
    // attention refuses changes nothing.
    int rc = attend_check(s, b);
    if (rc != 0)
      return rc;
    attnd_cuda_opts_t fo;
    if (plan_fused(s, b, workspace_bytes, opts ? *opts : k_default_opts, &fo)) {
      if (!b->cache || !b->items || !b->meta)
        return set_invalid(__FILE__, __LINE__, "batch without cache, items or meta");
      rc = launch_decode(s, b, workspace, workspace_bytes, fo, (cudaStream_t)stream, true);
      if (rc != kDecNotFused)
        return rc;
    }
  }
  int rc = attnd_cuda_write_opts(s, b, stream, opts);
  if (rc != 0 || !attend)
    return rc;
  return attnd_cuda_attend_opts(s, b, workspace, workspace_bytes, stream, opts);
}

extern "C" int attnd_cuda_step(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                               size_t workspace_bytes, void *stream) {
  return attnd_cuda_step_opts(s, b, workspace, workspace_bytes, stream, nullptr);
}

extern "C" uint64_t attnd_cuda_step_print(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *workspace,
                                          size_t workspace_bytes) {
  LaunchPrint lp = {0xcbf29ce484222325ull};
  LaunchPrint *const outer = t_print;
  t_print = &lp;
  const int rc = attnd_cuda_step_opts(s, b, workspace, workspace_bytes, nullptr, nullptr);
  t_print = outer;
  if (rc != 0)
    return 0;
  return lp.h ? lp.h : 1;
}

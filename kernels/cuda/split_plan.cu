// split_plan.cu: split-KV planning. Decode batches (every item <= 16 query
// vectors) go to the decode kernel, cut by a flat split (every CTA the same
// number of key chunks, whatever the contexts' lengths) or a per-item split;
// prefill batches to the tiled kernel, split per item when they have too few
// CTAs to fill the GPU. decode_params.cuh describes both cuts.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decode_params.cuh"

namespace attnd {
namespace {

// Runtime shape values to template arguments of the decode kernel.
template <int D, int DT> struct DecDispatch {
  template <int KV> static int occ(bool tr) {
    return tr ? decode_occupancy<D, DT, KV, true>() : decode_occupancy<D, DT, KV, false>();
  }
  template <int KV> static int items(bool tr) {
    return tr ? decode_flat_items<D, DT, KV, true>() : decode_flat_items<D, DT, KV, false>();
  }
  template <int KV> static bool cluster_ok(bool tr, int n) {
    return tr ? decode_cluster_ok<D, DT, KV, true>(n) : decode_cluster_ok<D, DT, KV, false>(n);
  }
  template <int KV> static cudaError_t run(bool tr, const DecodeParams &p, dim3 g, bool pdl, cudaStream_t st) {
    return tr ? launch_decode_one<D, DT, KV, true>(p, g, 0, pdl, st) : launch_decode_one<D, DT, KV, false>(p, g, 0, pdl, st);
  }
};

// Calls F::template call<D, DT, KV>(args...) for the runtime values.
template <class F, class... Args> auto with_types(int d, int dt, int kv, Args &&...a) {
#define ATTND_KV_CASES(D, DT)                                                                                  \
  switch (kv) {                                                                                                \
  case ATTND_KV_BF16: return F::template call<D, DT, ATTND_KV_BF16>(a...);                                     \
  case ATTND_KV_FP16: return F::template call<D, DT, ATTND_KV_FP16>(a...);                                     \
  case ATTND_KV_INT8: return F::template call<D, DT, ATTND_KV_INT8>(a...);                                     \
  case ATTND_KV_FP8: return F::template call<D, DT, ATTND_KV_FP8>(a...);                                       \
  case ATTND_KV_INT8_DYNAMIC: return F::template call<D, DT, ATTND_KV_INT8_DYNAMIC>(a...);                     \
  case ATTND_KV_FP8_DYNAMIC: return F::template call<D, DT, ATTND_KV_FP8_DYNAMIC>(a...);                       \
  default: return F::template call<D, DT, ATTND_KV_INT4>(a...);                                                \
  }
#define ATTND_DT_CASES(D)                                                                                      \
  if (dt == ATTND_DT_BF16) {                                                                                   \
    ATTND_KV_CASES(D, ATTND_DT_BF16)                                                                           \
  } else {                                                                                                     \
    ATTND_KV_CASES(D, ATTND_DT_FP16)                                                                           \
  }
  if (d == 64) {
    ATTND_DT_CASES(64)
  } else if (d == 128) {
    ATTND_DT_CASES(128)
  } else {
    ATTND_DT_CASES(256)
  }
#undef ATTND_DT_CASES
#undef ATTND_KV_CASES
}

struct OccF {
  template <int D, int DT, int KV> static int call(bool tr) { return DecDispatch<D, DT>::template occ<KV>(tr); }
};
struct ItemsF {
  template <int D, int DT, int KV> static int call(bool tr) { return DecDispatch<D, DT>::template items<KV>(tr); }
};
struct ClusterF {
  template <int D, int DT, int KV> static bool call(bool tr, int n) {
    return DecDispatch<D, DT>::template cluster_ok<KV>(tr, n);
  }
};
struct RunF {
  template <int D, int DT, int KV>
  static cudaError_t call(bool tr, const DecodeParams &p, dim3 g, bool pdl, cudaStream_t st) {
    return DecDispatch<D, DT>::template run<KV>(tr, p, g, pdl, st);
  }
};

} // namespace

size_t split_bytes_per_part(const attnd_kshape_t *s, int32_t total_q) {
  return (size_t)total_q * s->q_heads * (s->head_dim + 2) * sizeof(float);
}

long plan_span(const attnd_kbatch_t *b) {
  long span = b->max_kv_len;
  if (b->window > 0 && (long)b->window + b->max_n - 1 < span)
    span = (long)b->window + b->max_n - 1;
  return span;
}

// Head sharding (docs/scale-out.md): a daemon holding some of the model's kv
// heads cuts its work as the whole model's daemon would cut it, so that every
// head it holds comes out in the same bits. Work counts below therefore use
// the model's kv heads (attnd_kshape_model_kv_heads), never the held count.
int plan_splits(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes, int slots_per_sm, int tile_vec,
                int *split_keys, long min_part_keys) {
  const int G = s->q_heads / s->kv_heads;
  // A sliding layer's parts cover the keys of a CTA's rows from its first
  // visible key, not the whole context: a decode row at 32k in a window of
  // 4096 is cut as a full layer at 4096 would be.
  const long span = plan_span(b);
  const long tiles = ((long)b->max_n * G + tile_vec - 1) / tile_vec;
  const long base = (long)b->nitems * attnd_kshape_model_kv_heads(s) * tiles; // sharding: model heads
  const long slots = (long)num_sms() * slots_per_sm;
  int nsplit = 1;
  if (b->total_q > 0 && base < 4 * slots) {
    // The fewest parts whose CTAs fill their waves to 90% (an idle slot in
    // the last wave is time lost; every extra part costs a prologue, a shorter
    // pipeline and merge traffic), else the best filling. Two waves measured
    // worse than one or four on the H200 (bench/RESULTS.md): skip them.
    long limit = span / min_part_keys; // at least two key tiles per part by default
    const long by_ws = (long)(ws_bytes / split_bytes_per_part(s, b->total_q));
    if (limit > by_ws)
      limit = by_ws;
    if (limit > kMaxSplits)
      limit = kMaxSplits;
    double best = 0.0;
    for (long k = 1; k <= limit; k++) {
      const long ctas = base * k, waves = (ctas + slots - 1) / slots;
      const double eff = (double)ctas / (double)(waves * slots);
      if (eff > best + 0.02 && waves != 2) {
        best = eff;
        nsplit = (int)k;
      }
      if (eff >= 0.9 && waves != 2)
        break;
    }
  }
  int keys = (int)((span + nsplit - 1) / nsplit);
  keys = (keys + kBN - 1) / kBN * kBN;
  if (keys < kBN)
    keys = kBN;
  *split_keys = keys;
  return nsplit > 1 ? (int)((span + keys - 1) / keys) : 1;
}

size_t flat_workspace_bytes(int nctas, int max_vec, int d, int nitems) {
  return flat_prefix_offset(nctas, max_vec, d) * sizeof(float) + ((size_t)nitems + kFlatPrefixExtra) * sizeof(int);
}

int plan_decode(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes, const attnd_cuda_opts_t &o,
                DecodePlan *pl) {
  const int G = s->q_heads / s->kv_heads, max_vec = b->max_n * G;
  pl->tr = max_vec <= 8;
  const int occ = with_types<OccF>(s->head_dim, s->dtype, s->kv, pl->tr);
  const long slots = (long)num_sms() * occ;
  pl->flat = 0;
  pl->nctas = 0;
  pl->mctas = 0;
  pl->nsplit = 1;
  pl->split_keys = 0;
  pl->cluster = 0;
  // Launch option debug 256: a per-item split's parts form one cluster and
  // merge there (decode_cluster.cuh), so parts are at most 16 (one GPC).
  const bool want_cluster = (o.debug & 256) != 0;
  const long span = plan_span(b);
  const long cl_keys = want_cluster ? (span + 16 * kBN - 1) / (16 * kBN) * kBN : 0; // <= 16 parts
  auto clustered = [&]() {
    if (want_cluster && pl->nsplit > 1 && pl->nsplit <= 16 &&
        with_types<ClusterF>(s->head_dim, s->dtype, s->kv, pl->tr, pl->nsplit))
      pl->cluster = pl->nsplit;
  };
  // Choosing: where the per-item plan splits the items (few items for the GPU)
  // over long contexts or in batches that are not small (below), it ran faster than the flat split on the H200,
  // balanced or not (B8 ctx 32768: int8 181 vs 201 us); where it does not
  // (one CTA per item), the flat split keeps long items of an uneven batch
  // from running in one CTA each (2x for the 8-bit types) at ~4% on balanced
  // batches (bench/RESULTS.md, decode round 3 and decode3). Spans of at most
  // kFlatSpan keys take the flat split even where the per-item plan splits:
  // the small-batch sequences at ctx 4096 ran 2-13% faster with it (16
  // chunks per CTA; B1 int8_dynamic 23.3 vs 25.9 us, B8 fp8 40.8 vs 46.6 us
  // as graphs; decode3).
  // Only small batches, fewer (item, model kv head) pairs than SMs: at B64
  // ctx 4096 (512 pairs) the flat split ran 5.8% slower than the per-item
  // split for bf16 and fp16 (329 vs 311 us on the H200, bench/RESULTS.md).
  // Model kv heads, never the held count: a head shard plans as its model.
  constexpr long kFlatSpan = 4096;
  const bool small_batch = (long)b->nitems * attnd_kshape_model_kv_heads(s) <= (long)num_sms();
  // The rows form (9-16 query vectors an item: GQA 16, or GQA 4 with 3-4
  // tokens) runs 3 CTAs an SM; where the per-item plan splits a batch that is
  // not small over at most kFlatSpan keys, its parts come in several waves
  // and a merge: the flat split's one wave ran 15-20% faster there (GQA 16,
  // B64 ctx 4096 on the H100: int8 272.7 vs 340.6 us, int8_dynamic 271.9 vs
  // 327.8, fp8_dynamic 266.2 vs 324.2, int4 262.4 vs 304.1; bench/RESULTS.md),
  // so that case takes the flat split. The transposed form keeps the per-item
  // split there (B64 ctx 4096 bf16: 2 parts, 92-93% of the read roof).
  if (o.split == 0) {
    pl->nsplit = plan_splits(s, b, ws_bytes, occ, kDecMaxVec, &pl->split_keys, cl_keys > 2 * kBN ? cl_keys : 2 * kBN);
    if (pl->nsplit > 1 && (span > kFlatSpan || (!small_batch && pl->tr))) {
      clustered();
      return 0;
    }
    // Even contexts (the batch's kv_sum within 10% of nitems x the longest),
    // a full layer, the 1-byte cache types, a batch that is not small: one CTA
    // per (item, kv head) and no merge. The flat split is there for uneven
    // batches; on even ones its pieces and merge cost the 1-byte types 4-6%
    // (B64 ctx 4096 on the H200: int8 141.1 vs 146.5 us, int8_dynamic 147.6
    // vs 154.9, bench/RESULTS.md). kv_sum is the same for a head shard and
    // its model, so both cut alike. Debug 65536 plans as if kv_sum were
    // unknown (A/B); both are exact.
    const bool one_byte = s->kv == ATTND_KV_INT8 || s->kv == ATTND_KV_FP8 || attnd_kv_type_dynamic(s->kv);
    if (pl->nsplit == 1 && one_byte && b->window == 0 && !small_batch && b->kv_sum > 0 &&
        !(o.debug & 65536) && b->kv_sum * 10 >= (int64_t)9 * b->nitems * b->max_kv_len)
      return 0;
    pl->nsplit = 1;
    pl->split_keys = 0;
  }
  if (o.split != 2 && b->nitems <= kFlatMaxItems &&
      b->nitems <= with_types<ItemsF>(s->head_dim, s->dtype, s->kv, pl->tr)) {
    // CTAs: one full wave, fewer when the keys are too few for every CTA to
    // get min_chunks (the bound counts every item at the longest context).
    // Sharding: c is the whole model's budget (model kv heads); the kernel
    // lays the model's heads out head-major and a shard runs only the model
    // CTAs overlapping its heads' range, clipped to it (decode_params.cuh), so
    // every (item, kv head) is cut as on the model's daemon, balanced or not.
    // One daemon runs the same layout (the kernel has no other), so its cut
    // and a shard's are one. Nothing of this plan may depend on the held
    // count: the workspace check below holds for the workspace that
    // attnd_cuda_attend_workspace sizes (room for 8 CTAs per SM).
    const int mkv = attnd_kshape_model_kv_heads(s);
    const long chunks_max = (long)b->nitems * mkv * ((plan_span(b) + kDecKeys - 1) / kDecKeys + 1);
    // 16 chunks per CTA at least: B1 ctx 4096 ran 3-8% faster than with 8
    // (fewer partial pieces to merge), B8 the same (decode3).
    const int min_chunks = o.min_chunks > 0 ? o.min_chunks : 16;
    long c = chunks_max / min_chunks;
    if (c > slots)
      c = slots;
    if (c < 1)
      c = 1;
    while (c > 1 && flat_workspace_bytes((int)c, max_vec, s->head_dim, b->nitems) > ws_bytes)
      c = c * 3 / 4;
    if (c > 1 || o.split == 1) {
      pl->flat = 1;
      pl->mctas = (int)c;
      pl->nctas = (int)c;
      if (mkv != s->kv_heads) {
        // Sharding: the model CTAs that overlap a range of kv_heads / mkv of
        // the chunks, of equal ranges: at most ceil(c kv_heads / mkv) + 1
        // (one more launched for margin; a CTA with nothing to do returns).
        const long share = (c * s->kv_heads + mkv - 1) / mkv + 2;
        if (share < c)
          pl->nctas = (int)share;
      }
      return 0;
    }
  }
  // A forced per-item split takes min_chunks as the fewest 16-key chunks per
  // part (timing the part count of small batches: fewer, longer parts pay
  // fewer prologues and merge reads, more fill the GPU).
  long min_keys = o.split == 2 && o.min_chunks > 0 ? (long)o.min_chunks * kDecKeys : 2L * kBN;
  if (min_keys < cl_keys)
    min_keys = cl_keys;
  pl->nsplit = plan_splits(s, b, ws_bytes, occ, kDecMaxVec, &pl->split_keys, min_keys);
  clustered();
  return 0;
}

int launch_decode(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *ws, size_t ws_bytes,
                  const attnd_cuda_opts_t &o, cudaStream_t st, bool fuse) {
  DecodePlan pl;
  plan_decode(s, b, ws_bytes, o, &pl);
  DecodeParams p;
  // Every byte set (padding and the fields this plan leaves unused too), so
  // that equal batches give equal launch arguments (attnd_cuda_step_print).
  memset(&p, 0, sizeof p);
  // The fused step (attend.cu, plan_fused: a per-item plan of one part or of
  // clusters): phase 1 inside this launch.
  p.fuse = fuse ? 1 : 0;
  p.k = b->k;
  p.v = b->v;
  if (fuse)
    rope_params_fill(s, &p.rp);
  else
    p.rp.rope = ATTND_ROPE_NONE;
  p.items = b->items;
  p.meta = b->meta;
  p.q = b->q;
  p.out = b->out;
  p.lse = b->lse;
  p.cache = b->cache;
  p.block_bytes = b->block_bytes;
  p.k_scale = b->k_scale;
  p.v_scale = b->v_scale;
  p.k_zero = b->k_zero;
  p.v_zero = b->v_zero;
  p.ws = reinterpret_cast<float *>(ws);
  p.nitems = b->nitems;
  p.out_fp32 = b->out_fp32;
  p.per_channel = b->scale_per_channel;
  p.q_heads = s->q_heads;
  p.kv_heads = s->kv_heads;
  p.group = s->q_heads / s->kv_heads;
  p.bs = s->block_size;
  p.total_q = b->total_q;
  p.max_vec = b->max_n * p.group;
  p.scale_log2 = s->softmax_scale * 1.4426950408889634f;
  softcap_exp2(s, &p.cap2, &p.icap2);
  p.window = b->window;
  p.sinks = b->sinks;
  p.flat = pl.flat;
  p.nctas = pl.nctas;
  p.mkv = attnd_kshape_model_kv_heads(s);
  p.kvh0 = s->kv_head_begin;
  p.mctas = pl.mctas;
  p.nsplit = pl.nsplit;
  p.split_keys = pl.split_keys;
  p.cluster = pl.cluster;
  // The chunk copy: every type uses the per-piece copy (dec_issue). The 1-byte
  // caches (int8, fp8 and their dynamic forms) used the copy that reads the
  // block table at each refill, 2-7% faster for them before the stages were
  // aligned (bench/RESULTS.md, decode after decode-perf); with aligned stages
  // the per-piece copy runs 7-12% faster for them (decode6: B64 ctx4096
  // int8_dynamic 174.7 -> 153.3 us, fp8_dynamic 170.5 -> 150.7, int8 155.1 ->
  // 143.7, fp8 152.0 -> 143.4). Debug 32 restores the refill-read copy for the
  // 1-byte types (timing A/B); both are exact.
  p.debug = o.debug;
  const bool one_byte = s->kv == ATTND_KV_INT8 || s->kv == ATTND_KV_FP8 || attnd_kv_type_dynamic(s->kv);
  if (one_byte && (o.debug & 32))
    p.debug |= 4;
  // Chunks in flight per warp: the converted types (1-byte and int4) keep one
  // ahead of the one being computed, not NS - 1: faster or even in every row
  // of three H200 runs (B64 / B8 ctx32768: int4 -2.4 / -2.1%, int8 -0.9 /
  // -2.4%, fp8 -2.8 / -4.9%, fp8_dynamic -1.8 / -0.6%, int8_dynamic even;
  // bench/RESULTS.md, decode3), the 16-bit types even or slower (fp16 B8
  // +2.8%). Debug 512 keeps NS - 1 for the A/B; both are exact.
  if (s->kv != ATTND_KV_BF16 && s->kv != ATTND_KV_FP16 && !(o.debug & 512))
    p.debug |= 8;
  const bool pdl = !o.no_pdl;
  dim3 grid = pl.flat ? dim3((unsigned)pl.nctas) : dim3((unsigned)(b->nitems * s->kv_heads), 1u, (unsigned)pl.nsplit);
  cudaError_t e = with_types<RunF>(s->head_dim, s->dtype, s->kv, pl.tr, p, grid, pdl, st);
  if (e != cudaSuccess && pl.cluster > 0) {
    // The cluster launch refused (its occupancy check passed, the launch did
    // not): the same parts through the workspace and the merge kernel (the
    // plan kept within the workspace either way).
    cudaGetLastError();
    if (fuse)
      return kDecNotFused; // nothing launched: the caller runs the write kernel, then this plan unfused
    pl.cluster = 0;
    p.cluster = 0;
    e = with_types<RunF>(s->head_dim, s->dtype, s->kv, pl.tr, p, grid, pdl, st);
  }
  if (e != cudaSuccess)
    return set_error(__FILE__, __LINE__, "decode_kernel launch", e);
  if (pl.flat && pl.nctas > 1)
    return launch_merge_flat(s, p, pdl, st);
  if (!pl.flat && pl.nsplit > 1 && pl.cluster == 0) {
    const float *ws_o = p.ws, *ws_lse = p.ws + (size_t)pl.nsplit * b->total_q * s->q_heads * s->head_dim;
    return launch_merge_split(s, b, ws_o, ws_lse, pl.nsplit, pdl, st);
  }
  return 0;
}

} // namespace attnd

extern "C" size_t attnd_cuda_attend_workspace(const attnd_kshape_t *s, int32_t total_q) {
  const size_t split = attnd::kMaxSplits * attnd::split_bytes_per_part(s, total_q);
  // Flat split: two slots per CTA, at most 8 CTAs per SM.
  const int G = s->q_heads / s->kv_heads;
  const long mv = (long)total_q * G < attnd::kDecMaxVec ? (long)total_q * G : attnd::kDecMaxVec;
  const size_t flat = attnd::flat_workspace_bytes(attnd::num_sms() * 8, (int)mv, s->head_dim, total_q);
  return split > flat ? split : flat;
}

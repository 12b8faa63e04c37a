// decode_params.cuh: the decode kernel's parameters (decode_kernel.cuh), split-KV
// planning (split_plan.cu) and the merges of partial states (merge.cu).
#pragma once

#include "tiled_params.cuh"
#include "write_row.cuh"

namespace attnd {

constexpr int kDecWarps = 4;      // warps per decode CTA, each with its own softmax state
constexpr int kDecKeys = 16;      // keys per warp step (one mma k-step of P V)
constexpr int kDecMaxVec = 16;    // query vectors (n x group) per item the decode kernel takes
constexpr int kFlatMaxItems = 4096; // flat split: items whose prefix sums a CTA scans
constexpr int kMaxSplits = 32;    // per-item split: most parts per item

// How the decode CTAs share the work.
//   Flat split (flat = 1): the key chunks of every (item, kv head) are laid
//   end to end, head-major over the MODEL's kv heads (all items of head 0,
//   then head 1, ...: S chunks per head, W = mkv S in all); CTA c of the C
//   the model's daemon runs (C from mctas) takes chunks [c W / C,
//   (c + 1) W / C), so every CTA reads the same number of bytes whatever the
//   contexts' lengths. A head shard (kv heads [kvh0, kvh0 + kv_heads)) holds
//   the contiguous range [kvh0 S, (kvh0 + kv_heads) S) of that sequence and
//   runs only the model's CTAs that overlap it, each clipped to it (local
//   CTA l is model CTA cfirst + l): every (item, kv head) piece is cut and
//   merged exactly as on the whole model's daemon, so the shard's bits are
//   the model's (docs/scale-out.md). On one daemon (kvh0 0, mkv = kv_heads)
//   that is the whole sequence. A CTA whose range covers a whole (item, kv
//   head) writes the output; the first and the last piece of a CTA's range
//   may be partial and go to slots 2l and 2l + 1 of the workspace, which
//   merge_flat combines.
//   Per-item split (flat = 0): CTA (item, kv head, split) takes keys
//   [b + split * split_keys, b + (split + 1) * split_keys), b the first key
//   of the item's window in a sliding layer, else 0; merge_split combines.
//   Sinks join the first piece of each (item, kv head) (sink_join), never
//   the others, so that the merge counts them once.
struct DecodeParams {
  const attnd_kitem_t *items;
  const int32_t *meta;
  const void *q;       // [Tq][q_heads][D], rotated
  void *out;           // [Tq][q_heads][D] act dtype, or fp32 when out_fp32
  float *lse;          // [Tq][q_heads] or NULL
  const uint8_t *cache;
  size_t block_bytes;
  const float *k_scale, *v_scale; // static types: [kvh] or [kvh][D] (int4: [kvh][D])
  const float *k_zero, *v_zero;   // int4: [kvh][D]
  float *ws;           // flat: [2 nctas] slots (flat_slot_floats), then int32 [nitems + 1] prefix,
                       // the model's CTA count used and the first model CTA run here;
                       // per-item: [nsplit][Tq][q_heads][D] o, then [nsplit][Tq][q_heads] lse, lset
  int nitems, out_fp32, per_channel;
  int q_heads, kv_heads, group, bs, total_q, max_vec;
  float scale_log2;    // softmax_scale * log2(e)
  float cap2, icap2;   // soft-capping in the exp2 domain (FlashParams), 0: none
  int window;          // the layer's window, 0: full layer
  const float *sinks;  // [q_heads] or NULL (items with ATTND_ITEM_SINK)
  int flat, nctas;     // flat split: CTAs launched (and workspace slot pairs)
  int mkv, kvh0, mctas; // flat split: the model's kv heads, the first held one, the model's CTA budget
  int nsplit, split_keys; // per-item split
  int cluster;         // per-item split: > 1 the parts of a (item, kv head) are one cluster, merged in it
  int debug;           // attnd_cuda_opts_t.debug: 1 skip K/V loads, 2 skip math; 4, 8, 16, 64, 128 load-path variants;
                       // 256 the cluster merge (decode_cluster.cuh); 4096 the per-item split's CTAs
                       // head-major (decode_kernel), 8192 the stages at the old offset,
                       // 64 bytes past a 128-byte boundary (Dec<>::kStagePad); host only: 32 the refill-read copy
                       // for the 1-byte types, 512 the other lookahead than the type's default
                       // (split_plan.cu, launch_decode);
                       // 32768 the dynamic types under bf16 activations
                       // take P V in fp16 (Dec::kPv16, a kernel of its own: launch_decode_one)
  // The fused step (attnd_cuda_step, decode_fused.cuh): phase 1 inside the
  // attention launch. fuse = 1 only with the per-item split, one part per
  // (item, kv head) or the parts of one cluster. The CTA whose keys hold an
  // item's new token writes that token's k and v rows of its kv head
  // (write_row.cuh) before it reads them; every CTA rotates its q as it loads
  // it, and part 0 writes the rotated q back in place once its cluster has
  // read it, so that q, the cache, out and lse come out as the write kernel
  // followed by this kernel would leave them, bit for bit.
  int fuse;
  const void *k, *v;   // [T][kv_heads][D] the step's new rows (fuse)
  RopeParams rp;       // fuse
};

// Offsets in the workspace of the flat split.
// A slot: [max_vec][D] o, [max_vec] lse, [max_vec] lset (the lse of the sum that normalized o).
__host__ __device__ inline size_t flat_slot_floats(int max_vec, int d) { return (size_t)max_vec * (d + 2); }
__host__ __device__ inline size_t flat_prefix_offset(int nctas, int max_vec, int d) {
  return 2 * (size_t)nctas * flat_slot_floats(max_vec, d);
}

// First chunk of CTA c of nctas over w chunks in all (w < 2^40, so c w fits in 64 bits).
__host__ __device__ inline long long flat_start(int c, int nctas, long long w) { return (long long)c * w / nctas; }

// The CTA whose chunk range holds chunk u (the last one starting at or before it).
__host__ __device__ inline int flat_cta(long long u, int nctas, long long w) {
  int c = (int)((u * nctas) / w);
  while (c + 1 < nctas && flat_start(c + 1, nctas, w) <= u)
    c++;
  while (c > 0 && flat_start(c, nctas, w) > u)
    c--;
  return c;
}

// First chunk of CTA c's range clipped to a shard's [lo, hi) (the whole
// sequence on one daemon): clipped ranges tile [lo, hi) as the model's do.
__host__ __device__ inline long long flat_clip(int c, int nctas, long long w, long long lo, long long hi) {
  const long long u = flat_start(c, nctas, w);
  return u < lo ? lo : u > hi ? hi : u;
}

// The flat split's workspace after the slots: int32 prefix sums [nitems + 1],
// the model's CTA count used, and the first model CTA this daemon runs.
constexpr int kFlatPrefixExtra = 3;

// The decode kernel of one instantiation (decode_launch.cuh): launch, resident
// CTAs per SM, most items a flat split can scan.
template <int D, int DT, int KV, bool TR>
cudaError_t launch_decode_one(const DecodeParams &p, dim3 grid, size_t extra_smem, bool pdl, cudaStream_t st);
template <int D, int DT, int KV, bool TR> int decode_occupancy();
template <int D, int DT, int KV, bool TR> int decode_flat_items();
template <int D, int DT, int KV, bool TR> bool decode_cluster_ok(int n);

// A decode batch's cut (plan_decode) and its launch (kernel, then merge).
struct DecodePlan {
  bool tr;               // transposed form: every item <= 8 query vectors
  int flat, nctas;       // flat split over nctas CTAs (launched)
  int mctas;             // flat split: the whole model's CTA budget (= nctas on one daemon)
  int nsplit, split_keys; // per-item split
  int cluster;            // per-item split merged inside clusters of nsplit CTAs (0: by merge_split)
};
int plan_decode(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes, const attnd_cuda_opts_t &o,
                DecodePlan *pl);
// fuse: the fused step (DecodeParams.fuse) under a plan that allows it
// (attend.cu, plan_fused); returns kDecNotFused, having launched nothing,
// where the cluster launch is refused.
constexpr int kDecNotFused = 1;
int launch_decode(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *ws, size_t ws_bytes,
                  const attnd_cuda_opts_t &o, cudaStream_t st, bool fuse = false);
size_t flat_workspace_bytes(int nctas, int max_vec, int d, int nitems);

// Enqueues the merge of the partial states into p.out and p.lse.
int launch_merge_flat(const attnd_kshape_t *s, const DecodeParams &p, bool pdl, cudaStream_t st);
// ws_lse: [nsplit][Tq][q_heads] lse, then as many lset (the merge weights).
int launch_merge_split(const attnd_kshape_t *s, const attnd_kbatch_t *b, const float *ws_o, const float *ws_lse,
                       int nsplit, bool pdl, cudaStream_t st);

// Soft-capping in the exp2 domain of the kernels' scores (primitives.cuh,
// softcap2): softcap log2(e) and its inverse; both 0 without capping.
inline void softcap_exp2(const attnd_kshape_t *s, float *cap2, float *icap2) {
  *cap2 = s->softcap > 0.f ? s->softcap * 1.4426950408889634f : 0.f;
  *icap2 = s->softcap > 0.f ? 1.f / *cap2 : 0.f;
}

// Keys a CTA's rows may see at most from its first visible key (the split
// planning's length): the longest context, or in a sliding layer the window
// plus the rows of an item less one (the first row's window starts the range;
// masks that see later keys (full, prefix-LM, intervals without causal) end
// it at the item's last key).
long plan_span(const attnd_kbatch_t *b);

// The split planning of the tiled kernel (tiled_kernel.cuh) and the decode path.
size_t split_bytes_per_part(const attnd_kshape_t *s, int32_t total_q);
// Parts per item (1: no split) for CTAs of tile_vec query vectors, slots_per_sm
// of them resident per SM, and the keys per part; parts hold at least
// min_part_keys keys (two key tiles unless a launch option says otherwise).
int plan_splits(const attnd_kshape_t *s, const attnd_kbatch_t *b, size_t ws_bytes, int slots_per_sm, int tile_vec,
                int *split_keys, long min_part_keys = 2 * kBN);

} // namespace attnd

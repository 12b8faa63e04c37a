// write_cache.cu: phase 1, fused. For every new token: RoPE on its q heads (in
// place) and k heads, rounding to the activation dtype, quantization to the
// cache type and the paged store of k and v (docs/numerics.md).
//
// One warp per (new token, head row): q heads, then k heads, then v heads of
// the token; 8 warps per CTA. Every row is independent, so a decode step's few
// tokens still spread over many warps (one warp looping over a token's 48 rows
// took ~24 us on the H200; the flat grid takes a few). A row is
// write_row.cuh's, which the decode kernel's fused step (attnd_cuda_step)
// shares. Not templated: the kernel moves a few bytes per token and is far
// from any roofline; runtime switches keep the compile time for the op small.
#include <math.h>
#include <string.h>

#include "primitives.cuh"
#include "write_row.cuh"

namespace attnd {
namespace {

constexpr int kWarps = 8;

struct WriteParams {
  attnd_kbatch_t b;
  int q_heads, kv_heads, d, bs, dt, kv;
  RopeParams rp;
};

// The item whose k/v rows hold row t: the last one with kv_row <= t (items
// are packed in order, so kv_row increases). The warp searches 32 items a
// round, so a batch of up to 1024 items costs two dependent loads, not ten.
__device__ int find_item(const attnd_kitem_t *items, int nitems, int t, int lane) {
  int lo = 0, hi = nitems; // items[lo].kv_row <= t; the answer is in [lo, hi)
  while (hi - lo > 1) {
    const int step = (hi - lo + 31) / 32, idx = lo + lane * step;
    const unsigned m = __ballot_sync(0xffffffffu, idx < hi && items[idx].kv_row <= t);
    lo += (31 - __clz(m)) * step;
    hi = min(hi, lo + step);
  }
  return lo;
}

__global__ void __launch_bounds__(kWarps * 32) write_kernel(const __grid_constant__ WriteParams P) {
  __shared__ float buf[kWarps][256];
  // Launched with programmatic dependent launch: the attention kernel after
  // this one may start its prologue now; this kernel reads its inputs at
  // once but waits for the kernel before it (which may still read the cache
  // and q) before its first store.
  pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per_token = P.q_heads + 2 * P.kv_heads;
  const long gw = (long)blockIdx.x * kWarps + warp;
  // Rows past total_kv are attend-only items' q rows (attnd_kbatch_t.q_only_rows).
  if (gw >= ((long)P.b.total_kv + P.b.q_only_rows) * per_token)
    return;
  const int t = (int)(gw / per_token);
  const attnd_kbatch_t &b = P.b;
  const attnd_kitem_t it = b.items[find_item(b.items, b.nitems, t, lane)];
  const int r = t - it.kv_row;
  const int pos = it.start + r;
  const int d = P.d;
  const bool has_q = it.q_row >= 0;
  const int32_t *bt = b.meta + it.block_table;
  // An attend-only item's pos is below its keys' end: a block it holds, never written.
  uint8_t *blk = b.cache + (size_t)bt[pos / P.bs] * b.block_bytes;
  const int off = pos % P.bs;

  // Unit order: q heads, then k heads, then v heads.
  const int u = (int)(gw % per_token);
  int kind, h;
  if (u < P.q_heads) {
    if (!has_q)
      return; // kv-only item: no q rows
    kind = 0;
    h = u;
  } else {
    if (t >= b.total_kv)
      return; // attend-only item: no k/v rows, nothing written
    int w = u - P.q_heads;
    kind = w < P.kv_heads ? 1 : 2;
    h = kind == 1 ? w : w - P.kv_heads;
  }
  const void *src;
  size_t base;
  if (kind == 0) {
    src = b.q;
    base = ((size_t)(it.q_row + r) * P.q_heads + h) * d;
  } else {
    src = kind == 1 ? b.k : b.v;
    base = ((size_t)t * P.kv_heads + h) * d;
  }
  float x[kWrMaxEpl];
  wr_row_load(x, P.dt, d, src, base, kind != 2, P.rp, pos + it.pos_base, buf[warp], lane); // pos_base: split context
  pdl_wait();
  if (kind == 0) {
    wr_row_store_q(x, P.dt, d, b.q, base, lane);
    return;
  }
  const WrCache W = {P.kv, d, P.bs, P.kv_heads, b.scale_per_channel, b.k_scale, b.v_scale, b.k_zero, b.v_zero};
  wr_row_store_kv(x, W, h, kind == 2, blk, off, lane);
}

} // namespace

void rope_params_fill(const attnd_kshape_t *s, RopeParams *R) {
  R->rope = s->rope;
  R->rd = s->rotary_dim ? s->rotary_dim : s->head_dim;
  // theta^(-2i/rd) in fp64, kept per thread for the last (theta, rd).
  static thread_local double last_theta = -1.0;
  static thread_local int last_rd = -1;
  static thread_local float inv_freq[128];
  if (last_theta != s->rope_theta || last_rd != R->rd) {
    for (int i = 0; i < 128; i++)
      inv_freq[i] = i < R->rd / 2 ? (float)pow(s->rope_theta, -2.0 * i / (double)R->rd) : 0.f;
    last_theta = s->rope_theta;
    last_rd = R->rd;
  }
  memcpy(R->inv_freq, inv_freq, sizeof(inv_freq));
}

} // namespace attnd

using namespace attnd;

extern "C" int attnd_cuda_write_opts(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *stream,
                                     const attnd_cuda_opts_t *opts) {
  if (attnd_kshape_check(s) != 0)
    return set_invalid(__FILE__, __LINE__, "unsupported shape");
  if ((b->total_kv <= 0 && b->q_only_rows <= 0) || b->nitems <= 0)
    return 0;
  if (!b->cache || !b->items || !b->meta || (b->total_kv > 0 && (!b->k || !b->v)))
    return set_invalid(__FILE__, __LINE__, "batch without cache, items, meta, k or v");
  if (attnd_kv_type_static(s->kv) && (!b->k_scale || !b->v_scale))
    return set_invalid(__FILE__, __LINE__, "static cache type without scales");
  if (s->kv == ATTND_KV_INT4 && (!b->k_zero || !b->v_zero))
    return set_invalid(__FILE__, __LINE__, "int4 cache without zero points");
  WriteParams P;
  memset(&P, 0, sizeof P); // every byte set: attnd_cuda_step_print
  P.b = *b;
  // Planning hints the write kernel does not read, cleared so that a decode
  // step's write launch does not change with its context length (a graph of
  // the step replays unchanged, attnd_cuda_step_print).
  P.b.max_kv_len = 0;
  P.b.kv_sum = 0;
  P.q_heads = s->q_heads;
  P.kv_heads = s->kv_heads;
  P.d = s->head_dim;
  P.bs = s->block_size;
  P.dt = s->dtype;
  P.kv = s->kv;
  rope_params_fill(s, &P.rp);
  const long warps = ((long)b->total_kv + (b->q_only_rows > 0 ? b->q_only_rows : 0)) *
                     (s->q_heads + 2 * s->kv_heads);
  const long ctas = (warps + kWarps - 1) / kWarps;
  if (ctas > 0x7fffffffL)
    return set_invalid(__FILE__, __LINE__, "too many rows for one write launch");
  const bool pdl = !(opts && opts->no_pdl);
  cudaError_t e = launch_ex(write_kernel, dim3((unsigned)ctas), dim3(kWarps * 32), 0, pdl, (cudaStream_t)stream, P);
  if (e != cudaSuccess)
    return set_error(__FILE__, __LINE__, "write_kernel launch", e);
  return 0;
}

extern "C" int attnd_cuda_write(const attnd_kshape_t *s, const attnd_kbatch_t *b, void *stream) {
  return attnd_cuda_write_opts(s, b, stream, nullptr);
}

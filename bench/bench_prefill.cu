// bench_prefill: times attnd_cuda_attend on prefill-shaped steps and prints a
// table (JSON to $OUT/prefill.json when OUT is set). Shapes: 32 q / 8 kv heads,
// bf16 activations, block size 64, caches written by attnd_cuda_write from
// random k/v, strided block tables (bench/README.md lists the rows).
//   causal prefill B4 S8192 at head dims 64/128/256: TFLOP/s = 4*B*Hq*S*S*D/2 / t;
//   document mask and sliding window 1024 (d128): effective TFLOP/s over the
//     visible (q, k) pairs; causal over the quantized caches;
//   chunked prefill, 2048 new tokens over 6144 cached (B4), every cache type;
//   small prefills: 1 x 512 over 0 and over 8192 cached, 64 x 64 over 2048.
// Each row runs the Hopper path's variants (attnd_cuda_opts_t.sm90_sched:
// pingpong, intra-warpgroup overlap; sm90_gchunk: the launch order) and the
// tiled kernel (sm90 = 1) in this one process. CUDA events around each call,
// warm-up first, median. By default only the main rows run (causal d128/d64/
// d256, document, sliding, append over bf16 and int8_dynamic, the small
// prefills); ATTND_BENCH_PREFILL=all runs every row (this tool's own
// environment variables: the kernels read none). ATTND_BENCH_FILTER=substring
// runs only the rows whose name contains it.
#include <algorithm>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "attnd_cuda.h"

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));           \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)
#define CKA(x)                                                                                     \
  do {                                                                                             \
    int r_ = (x);                                                                                  \
    if (r_ != 0) {                                                                                 \
      fprintf(stderr, "%s:%d %s: %d %s\n", __FILE__, __LINE__, #x, r_, attnd_cuda_last_error());   \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

__global__ void fill_normalish(__nv_bfloat16 *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    float s = 0.f;
    for (int k = 0; k < 4; k++)
      s += (float)((x >> (16 * k)) & 0xffff) / 65536.f - 0.5f;
    p[i] = __float2bfloat16(s * 2.0f);
  }
}

static std::string g_json = "{";
static bool wanted(const char *name) {
  const char *f = getenv("ATTND_BENCH_FILTER");
  return !f || !*f || strstr(name, f) != nullptr;
}
static void jrow(const char *name, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (g_json.size() > 1)
    g_json += ",\n";
  g_json += std::string("\"") + name + "\": {" + buf + "}";
}

template <class F> static float median_ms(F fn, int warm, int iters) {
  for (int i = 0; i < warm; i++)
    fn();
  CK(cudaDeviceSynchronize());
  std::vector<float> ts;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < iters; i++) {
    CK(cudaEventRecord(a));
    fn();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

struct Setup {
  attnd_kshape_t s;
  attnd_kbatch_t b;
  std::vector<void *> frees;
  void *ws = nullptr;
  size_t ws_bytes = 0;
};

// B items of n new tokens over ctx - n cached ones (ctx keys in all).
static void setup(Setup &S, attnd_kv_type_t kv, int D, int B, int ctx, int n, int mask,
                  int mask_param, const std::vector<int> *doc_lens) {
  attnd_kshape_t &s = S.s;
  s = {};
  s.q_heads = 32;
  s.kv_heads = 8;
  s.head_dim = D;
  s.block_size = 64;
  s.dtype = ATTND_DT_BF16;
  s.kv = kv;
  s.rope = ATTND_ROPE_NEOX;
  s.rope_theta = 500000.0;
  s.softmax_scale = 1.f / sqrtf((float)D);
  const int KVH = 8, QH = 32, bs = 64;
  const int nb = (ctx + bs - 1) / bs;
  const size_t bb = attnd_kv_block_bytes(&s);
  uint8_t *cache;
  CK(cudaMalloc(&cache, bb * nb * B));
  S.frees.push_back(cache);
  std::vector<int32_t> meta((size_t)nb * B);
  for (int i = 0; i < B; i++)
    for (int l = 0; l < nb; l++)
      meta[(size_t)i * nb + l] = (int32_t)(((size_t)l * B + i) % ((size_t)nb * B));
  const size_t iv_off = meta.size();
  if (mask == ATTND_MASK_INTERVALS) {
    for (int i = 0; i < B; i++) {
      std::vector<int32_t> iv(4 * (size_t)ctx, 0);
      int a = 0;
      for (int l : *doc_lens) {
        for (int j = a; j < a + l; j++) {
          iv[j] = a + l;
          iv[ctx + j] = ctx;
        }
        a += l;
      }
      meta.insert(meta.end(), iv.begin(), iv.end());
    }
  }
  int32_t *d_meta;
  CK(cudaMalloc(&d_meta, meta.size() * 4));
  CK(cudaMemcpy(d_meta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice));
  S.frees.push_back(d_meta);
  float *scales;
  CK(cudaMalloc(&scales, 4 * KVH * D * sizeof(float)));
  S.frees.push_back(scales);
  {
    std::vector<float> h(4 * KVH * D);
    for (int i = 0; i < KVH * D; i++) {
      const float base = kv == ATTND_KV_INT4 ? 0.5f : kv == ATTND_KV_INT8 ? 4.f / 127 : 4.f / 448;
      h[i] = h[KVH * D + i] = base;
      h[2 * KVH * D + i] = h[3 * KVH * D + i] = 7.5f;
    }
    CK(cudaMemcpy(scales, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  }
  const bool st = attnd_kv_type_static(kv);
  const size_t T = (size_t)ctx * B;
  __nv_bfloat16 *k, *v, *q;
  CK(cudaMalloc(&k, T * KVH * D * 2));
  CK(cudaMalloc(&v, T * KVH * D * 2));
  CK(cudaMalloc(&q, (size_t)n * B * QH * D * 2));
  fill_normalish<<<1024, 256>>>(k, T * KVH * D, 1);
  fill_normalish<<<1024, 256>>>(v, T * KVH * D, 2);
  fill_normalish<<<1024, 256>>>(q, (size_t)n * B * QH * D, 3);
  CK(cudaGetLastError());
  S.frees.push_back(q);
  std::vector<attnd_kitem_t> hist(B), step(B);
  for (int i = 0; i < B; i++) {
    hist[i] = {0, ctx, -1, ctx * i, 0, 0, 0, 0, nb * i};
    step[i] = {ctx - n, n,          n * i, n * i,
               mask,    mask_param, 1,     (int32_t)(iv_off + (size_t)i * 4 * ctx),
               nb * i};
  }
  attnd_kitem_t *d_hist, *d_step;
  CK(cudaMalloc(&d_hist, B * sizeof(attnd_kitem_t)));
  CK(cudaMalloc(&d_step, B * sizeof(attnd_kitem_t)));
  S.frees.push_back(d_step);
  CK(cudaMemcpy(d_hist, hist.data(), B * sizeof(attnd_kitem_t), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_step, step.data(), B * sizeof(attnd_kitem_t), cudaMemcpyHostToDevice));
  attnd_kbatch_t hb = {};
  hb.items = d_hist;
  hb.nitems = B;
  hb.meta = d_meta;
  hb.total_kv = (int)T;
  hb.max_kv_len = ctx;
  hb.max_n = ctx;
  hb.k = k;
  hb.v = v;
  hb.cache = cache;
  hb.block_bytes = bb;
  hb.k_scale = st ? scales : nullptr;
  hb.v_scale = st ? scales + KVH * D : nullptr;
  hb.k_zero = kv == ATTND_KV_INT4 ? scales + 2 * KVH * D : nullptr;
  hb.v_zero = kv == ATTND_KV_INT4 ? scales + 3 * KVH * D : nullptr;
  hb.scale_per_channel = 1;
  CKA(attnd_cuda_write(&s, &hb, nullptr));
  CK(cudaDeviceSynchronize());
  cudaFree(k); // the history lives in the cache now
  cudaFree(v);
  cudaFree(d_hist);
  attnd_kbatch_t &b = S.b;
  b = hb;
  b.items = d_step;
  b.total_q = n * B;
  b.total_kv = n * B;
  b.max_n = n;
  b.q = q;
  b.k = nullptr; // attend reads only the cache
  b.v = nullptr;
  void *out;
  float *lse;
  CK(cudaMalloc(&out, (size_t)n * B * QH * D * 2));
  CK(cudaMalloc(&lse, (size_t)n * B * QH * 4));
  S.frees.push_back(out);
  S.frees.push_back(lse);
  b.out = out;
  b.lse = lse;
  S.ws_bytes = attnd_cuda_attend_workspace(&s, b.total_q);
  CK(cudaMalloc(&S.ws, S.ws_bytes));
  S.frees.push_back(S.ws);
  CK(cudaDeviceSynchronize());
}

static void teardown(Setup &S) {
  for (void *p : S.frees)
    cudaFree(p);
  S.frees.clear();
}

struct Variant {
  const char *name;
  attnd_cuda_opts_t opts;
};
// Variants timed per row: the Hopper path's schedules (pingpong, no
// intra-warpgroup overlap, the launch order of round 1: every group's tiles
// interleaved, no softmax: a timing experiment with wrong output), then the
// tiled kernel. sm90_sched bit 0 turns pingpong off, bit 1 the overlap, bit 2
// the softmax.
static attnd_cuda_opts_t variant_opts(int sm90, int sched, int gchunk) {
  attnd_cuda_opts_t o = {};
  o.sm90 = sm90;
  o.sm90_sched = sched;
  o.sm90_gchunk = gchunk;
  return o;
}
static const Variant kVariants[] = {{"pp", variant_opts(0, 0, 0)},
                                    {"nopp", variant_opts(0, 1, 0)},
                                    {"pp_serial", variant_opts(0, 2, 0)},
                                    {"nopp_serial", variant_opts(0, 3, 0)},
                                    {"pp_allgroups", variant_opts(0, 0, 1000000)},
                                    {"pp_nosoftmax", variant_opts(0, 4, 0)},
                                    {"tiled", variant_opts(1, 0, 0)}};

struct Row {
  const char *name;
  int kv, D, B, ctx, n, mask, param, all_variants, main_row;
};

int main() {
  if (attnd_cuda_device_count() == 0) {
    printf("no CUDA device\n");
    return 0;
  }
  char name[128];
  uint64_t mem;
  int ma, mi;
  CKA(attnd_cuda_device_info(0, name, sizeof name, &mem, &ma, &mi));
  printf("device: %s, %.0f GiB, cc %d.%d\n", name, mem / 1073741824.0, ma, mi);
  jrow("device", "\"name\": \"%s\", \"cc\": \"%d.%d\"", name, ma, mi);

  const char *which = getenv("ATTND_BENCH_PREFILL");
  const bool all_rows = which && strcmp(which, "all") == 0;
  const int S_ = 8192;
  std::vector<int> lens;
  {
    uint64_t x = 12345;
    int tot = 0;
    while (tot < S_) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      int l = 256 + (int)((x >> 33) % 1792);
      l = std::min(l, S_ - tot);
      lens.push_back(l);
      tot += l;
    }
  }
  const Row rows[] = {
      {"causal_d128_bf16", ATTND_KV_BF16, 128, 4, S_, S_, ATTND_MASK_CAUSAL, 0, 1, 1},
      {"causal_d64_bf16", ATTND_KV_BF16, 64, 4, S_, S_, ATTND_MASK_CAUSAL, 0, 1, 1},
      {"causal_d256_bf16", ATTND_KV_BF16, 256, 4, S_, S_, ATTND_MASK_CAUSAL, 0, 1, 1},
      {"document_d128_bf16", ATTND_KV_BF16, 128, 4, S_, S_, ATTND_MASK_INTERVALS, 0, 1, 1},
      {"sliding1024_d128_bf16", ATTND_KV_BF16, 128, 4, S_, S_, ATTND_MASK_SLIDING, 1024, 1, 1},
      {"causal_d128_int8", ATTND_KV_INT8, 128, 4, S_, S_, ATTND_MASK_CAUSAL, 0, 0, 0},
      {"causal_d128_fp8_dynamic", ATTND_KV_FP8_DYNAMIC, 128, 4, S_, S_, ATTND_MASK_CAUSAL, 0, 0, 0},
      {"append2048_over6144_bf16", ATTND_KV_BF16, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0, 1, 1},
      {"append2048_over6144_fp16", ATTND_KV_FP16, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0, 0, 0},
      {"append2048_over6144_int8", ATTND_KV_INT8, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0, 0, 0},
      {"append2048_over6144_fp8", ATTND_KV_FP8, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0, 0, 0},
      {"append2048_over6144_int8_dynamic", ATTND_KV_INT8_DYNAMIC, 128, 4, 8192, 2048,
       ATTND_MASK_CAUSAL, 0, 0, 1},
      {"append2048_over6144_fp8_dynamic", ATTND_KV_FP8_DYNAMIC, 128, 4, 8192, 2048,
       ATTND_MASK_CAUSAL, 0, 0, 0},
      {"append2048_over6144_int4", ATTND_KV_INT4, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0, 0, 0},
      {"small_1x512_over0", ATTND_KV_BF16, 128, 1, 512, 512, ATTND_MASK_CAUSAL, 0, 1, 1},
      {"small_1x512_over8192", ATTND_KV_BF16, 128, 1, 8704, 512, ATTND_MASK_CAUSAL, 0, 1, 1},
      {"small_64x64_over2048", ATTND_KV_BF16, 128, 64, 2112, 64, ATTND_MASK_CAUSAL, 0, 1, 1},
  };
  printf("\n%-34s %-12s %9s %9s %6s\n", "prefill (32/8 heads, bs 64)", "variant", "ms", "TFLOP/s",
         "splits");
  for (const Row &r : rows) {
    char nm[96];
    snprintf(nm, sizeof nm, "prefill_%s", r.name);
    if (!wanted(nm) || (!r.main_row && !all_rows))
      continue;
    Setup S;
    setup(S, (attnd_kv_type_t)r.kv, r.D, r.B, r.ctx, r.n, r.mask, r.param, &lens);
    // Visible (q, k) pairs of one item and one head.
    double live = 0;
    const int start = r.ctx - r.n;
    if (r.mask == ATTND_MASK_CAUSAL)
      live = (double)r.n * start + (double)r.n * (r.n + 1) / 2;
    else if (r.mask == ATTND_MASK_SLIDING)
      for (int i = 0; i < r.n; i++)
        live += std::min(start + i + 1, r.param);
    else
      for (int l : lens)
        live += (double)l * (l + 1) / 2;
    const double flops = 4.0 * r.B * 32 * live * r.D;
    const int splits = attnd_cuda_attend_splits(&S.s, &S.b, S.ws_bytes);
    const long big = (long)r.n * r.ctx;
    const int iters = big > 10000000L ? 10 : 50;
    std::string js;
    for (const Variant &v : kVariants) {
      if (!r.all_variants && strcmp(v.name, "pp") != 0 && strcmp(v.name, "tiled") != 0)
        continue;
      const float ms = median_ms(
          [&] { CKA(attnd_cuda_attend_opts(&S.s, &S.b, S.ws, S.ws_bytes, nullptr, &v.opts)); }, 2,
          iters);
      const double tf = flops / (ms * 1e-3) / 1e12;
      printf("%-34s %-12s %9.3f %9.1f %6d\n", r.name, v.name, ms, tf, splits);
      char buf[160];
      snprintf(buf, sizeof buf, "%s\"%s\": {\"ms\": %.4f, \"TFLOPs\": %.1f}",
               js.empty() ? "" : ", ", v.name, ms, tf);
      js += buf;
    }
    jrow(nm, "\"splits\": %d, %s", splits, js.c_str());
    teardown(S);
  }
  g_json += "}\n";
  const char *out = getenv("OUT");
  if (out) {
    std::string p = std::string(out) + "/prefill.json";
    FILE *f = fopen(p.c_str(), "w");
    if (f) {
      fputs(g_json.c_str(), f);
      fclose(f);
    }
  }
  return 0;
}

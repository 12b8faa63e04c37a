// bench_kernels: times the CUDA kernels on the shapes of the issue and prints
// a table (JSON to $OUT/bench.json when OUT is set).
//   decode  B=64 ctx 4096 and B=8 ctx 32768, 32 q / 8 kv heads, d 128, every
//           cache type: GB/s of cache bytes read (K, V and dynamic scales);
//   prefill B=4 S=8192 causal bf16: TFLOP/s (4*B*Hq*S*S*D/2 FLOPs);
//           document mask (FlashMask intervals) and sliding window 1024:
//           effective TFLOP/s over the visible (q, k) pairs;
//   copy    device-to-device cudaMemcpy of 2 GiB: GB/s read + written, the
//           ceiling the decode numbers are compared with (same run).
// CUDA events around each launch, warm-up first, median of many runs. The
// caches are 0.1 to 1 GB, far over the 60 MB L2, so one input set suffices.
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

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)
#define CKA(x)                                                                             \
  do {                                                                                     \
    int r_ = (x);                                                                          \
    if (r_ != 0) {                                                                         \
      fprintf(stderr, "%s:%d %s: %d %s\n", __FILE__, __LINE__, #x, r_, attnd_cuda_last_error()); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

__global__ void fill_normalish(__nv_bfloat16 *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    // Sum of four uniforms: roughly normal, mean 0, sd ~1.15.
    float s = 0.f;
    for (int k = 0; k < 4; k++)
      s += (float)((x >> (16 * k)) & 0xffff) / 65536.f - 0.5f;
    p[i] = __float2bfloat16(s * 2.0f);
  }
}

static std::string g_json = "{";
// ATTND_BENCH_FILTER=substring runs only the rows whose name contains it.
static bool wanted(const char *name) {
  const char *f = getenv("ATTND_BENCH_FILTER");
  return !f || !*f || strstr(name, f) != nullptr;
}
static void jrow(const char *name, const char *fmt, ...) {
  char buf[512];
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

// B items of n new tokens over ctx - n cached ones each (ctx total), the cache
// filled by attnd_cuda_write from random k/v; returns the step batch.
static void setup(Setup &S, attnd_kv_type_t kv, int B, int ctx, int n, int mask, int mask_param,
                  const std::vector<int> *doc_lens) {
  attnd_kshape_t &s = S.s;
  s = {};
  s.q_heads = 32;
  s.kv_heads = 8;
  s.head_dim = 128;
  s.block_size = 64;
  s.dtype = ATTND_DT_BF16;
  s.kv = kv;
  s.rope = ATTND_ROPE_NEOX;
  s.rope_theta = 500000.0;
  s.softmax_scale = 1.f / sqrtf(128.f);
  const int D = 128, KVH = 8, QH = 32, bs = 64;
  const int nb = (ctx + bs - 1) / bs;
  const size_t bb = attnd_kv_block_bytes(&s);
  uint8_t *cache;
  CK(cudaMalloc(&cache, bb * nb * B));
  S.frees.push_back(cache);
  // Block tables: item i gets blocks in a strided order (not contiguous).
  std::vector<int32_t> meta((size_t)nb * B);
  for (int i = 0; i < B; i++)
    for (int l = 0; l < nb; l++)
      meta[(size_t)i * nb + l] = (int32_t)(((size_t)l * B + i) % ((size_t)nb * B));
  size_t iv_off = meta.size();
  if (mask == ATTND_MASK_INTERVALS) {
    // Documents: keys of a document are masked for rows after its end.
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
      float base = kv == ATTND_KV_INT4 ? 0.5f : kv == ATTND_KV_INT8 ? 4.f / 127 : 4.f / 448;
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
  S.frees.push_back(k);
  S.frees.push_back(v);
  S.frees.push_back(q);
  fill_normalish<<<1024, 256>>>(k, T * KVH * D, 1);
  fill_normalish<<<1024, 256>>>(v, T * KVH * D, 2);
  fill_normalish<<<1024, 256>>>(q, (size_t)n * B * QH * D, 3);
  // History: positions 0..ctx-1 of every item, written once.
  std::vector<attnd_kitem_t> hist(B), step(B);
  for (int i = 0; i < B; i++) {
    hist[i] = {0, ctx, -1, ctx * i, 0, 0, 0, 0, nb * i};
    step[i] = {ctx - n, n, n * i, n * i, mask, mask_param, 1,
               (int32_t)(iv_off + (size_t)i * 4 * ctx), nb * i};
  }
  attnd_kitem_t *d_hist, *d_step;
  CK(cudaMalloc(&d_hist, B * sizeof(attnd_kitem_t)));
  CK(cudaMalloc(&d_step, B * sizeof(attnd_kitem_t)));
  S.frees.push_back(d_hist);
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
  attnd_kbatch_t &b = S.b;
  b = hb;
  b.items = d_step;
  b.total_q = n * B;
  b.total_kv = n * B;
  b.max_n = n;
  b.q = q;
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

  // Copy ceiling.
  double copy_gbps;
  {
    size_t n = (size_t)2 << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 0x5a, n));
    float ms = median_ms([&] { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); }, 3, 20);
    copy_gbps = 2.0 * n / (ms * 1e-3) / 1e9;
    printf("copy_bw %.0f GB/s (read + write)\n", copy_gbps);
    jrow("copy_bw", "\"GBps\": %.1f", copy_gbps);
    cudaFree(a);
    cudaFree(b);
  }

  printf("\n%-14s %-14s %9s %9s %9s %7s %6s\n", "decode", "cache", "us", "GB/s", "%copy", "splits", "write_us");
  const int dshapes[2][2] = {{64, 4096}, {8, 32768}};
  for (auto &sh : dshapes) {
    for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
      char nm[64];
      snprintf(nm, sizeof nm, "decode_B%d_ctx%d_%s", sh[0], sh[1], attnd_kv_type_name((attnd_kv_type_t)kv));
      if (!wanted(nm))
        continue;
      Setup S;
      setup(S, (attnd_kv_type_t)kv, sh[0], sh[1], 1, ATTND_MASK_CAUSAL, 0, nullptr);
      const int splits = attnd_cuda_attend_splits(&S.s, &S.b, S.ws_bytes);
      float ms = median_ms([&] { CKA(attnd_cuda_attend(&S.s, &S.b, S.ws, S.ws_bytes, nullptr)); }, 5, 50);
      float wms = median_ms([&] { CKA(attnd_cuda_write(&S.s, &S.b, nullptr)); }, 3, 20);
      const double bytes = (double)sh[0] * sh[1] * attnd_kv_bytes_per_token(&S.s);
      const double gbps = bytes / (ms * 1e-3) / 1e9;
      printf("B%-3d ctx%-6d %-14s %9.1f %9.0f %8.1f%% %6d %8.1f\n", sh[0], sh[1],
             attnd_kv_type_name((attnd_kv_type_t)kv), ms * 1e3, gbps, 100.0 * gbps / copy_gbps, splits, wms * 1e3);
      jrow(nm, "\"us\": %.1f, \"GBps\": %.1f, \"pct_copy\": %.1f, \"splits\": %d, \"write_us\": %.1f", ms * 1e3,
           gbps, 100.0 * gbps / copy_gbps, splits, wms * 1e3);
      teardown(S);
    }
  }

  printf("\n%-34s %9s %9s\n", "prefill B4 S8192 32/8 d128 bf16", "ms", "TFLOP/s");
  const int B = 4, S_ = 8192, QH = 32, D = 128;
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
  struct PM {
    const char *name;
    int kv, mask, param;
  } pms[] = {{"causal_bf16", ATTND_KV_BF16, ATTND_MASK_CAUSAL, 0},
             {"document_bf16", ATTND_KV_BF16, ATTND_MASK_INTERVALS, 0},
             {"sliding1024_bf16", ATTND_KV_BF16, ATTND_MASK_SLIDING, 1024},
             {"causal_fp8_dynamic", ATTND_KV_FP8_DYNAMIC, ATTND_MASK_CAUSAL, 0},
             {"causal_int8", ATTND_KV_INT8, ATTND_MASK_CAUSAL, 0}};
  for (auto &pm : pms) {
    char nm[64];
    snprintf(nm, sizeof nm, "prefill_B4_S8192_%s", pm.name);
    if (!wanted(nm))
      continue;
    Setup S;
    setup(S, (attnd_kv_type_t)pm.kv, B, S_, S_, pm.mask, pm.param, &lens);
    double live = 0;
    if (pm.mask == ATTND_MASK_CAUSAL)
      live = (double)S_ * (S_ + 1) / 2;
    else if (pm.mask == ATTND_MASK_SLIDING)
      for (int i = 0; i < S_; i++)
        live += std::min(i + 1, pm.param);
    else
      for (int l : lens)
        live += (double)l * (l + 1) / 2;
    float ms = median_ms([&] { CKA(attnd_cuda_attend(&S.s, &S.b, S.ws, S.ws_bytes, nullptr)); }, 2, 10);
    const double flops = 4.0 * B * QH * live * D;
    const double tf = flops / (ms * 1e-3) / 1e12;
    printf("%-34s %9.3f %9.1f\n", pm.name, ms, tf);
    jrow(nm, "\"ms\": %.3f, \"TFLOPs_effective\": %.1f", ms, tf);
    teardown(S);
  }
  g_json += "}\n";
  const char *out = getenv("OUT");
  if (out) {
    std::string p = std::string(out) + "/bench.json";
    FILE *f = fopen(p.c_str(), "w");
    if (f) {
      fputs(g_json.c_str(), f);
      fclose(f);
    }
  }
  return 0;
}

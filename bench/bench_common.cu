// bench_common.cu: the parts of the kernel benchmarks that bench_kernels and
// bench_prefill share (bench_common.cuh): JSON rows, the row filter, random
// inputs, and the setup of a paged cache filled by attnd_cuda_write.
#include <numeric>

#include "bench_common.cuh"

std::string g_json = "{";

// ATTND_BENCH_FILTER: comma-separated substrings; a row runs when its name holds one.
bool bench_wanted(const char *name) {
  const char *f = getenv("ATTND_BENCH_FILTER");
  if (!f || !*f)
    return true;
  for (const char *p = f; *p;) {
    const char *e = strchr(p, ',');
    const size_t n = e ? (size_t)(e - p) : strlen(p);
    if (n > 0 && std::string(name).find(std::string(p, n)) != std::string::npos)
      return true;
    p += n + (e ? 1 : 0);
  }
  return false;
}

void jrow(const char *name, const char *fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (g_json.size() > 1)
    g_json += ",\n";
  g_json += std::string("\"") + name + "\": {" + buf + "}";
}

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

void setup_ex(Setup &S, const BenchShape &sh, const std::vector<int> &ctx, int n, int mask, int mask_param,
              const std::vector<int> *doc_lens) {
  attnd_kshape_t &s = S.s;
  s = {};
  s.q_heads = sh.q_heads;
  s.kv_heads = sh.kv_heads;
  s.head_dim = sh.head_dim;
  s.block_size = sh.block_size;
  s.dtype = ATTND_DT_BF16;
  s.kv = sh.kv;
  s.rope = ATTND_ROPE_NEOX;
  s.rope_theta = 500000.0;
  s.softmax_scale = 1.f / sqrtf((float)sh.head_dim);
  const int D = sh.head_dim, KVH = sh.kv_heads, QH = sh.q_heads, bs = sh.block_size, B = (int)ctx.size();
  const size_t bb = attnd_kv_block_bytes(&s);
  std::vector<int> nb(B), boff(B + 1, 0), koff(B + 1, 0);
  int maxctx = 1;
  for (int i = 0; i < B; i++) {
    nb[i] = (ctx[i] + bs - 1) / bs;
    boff[i + 1] = boff[i] + nb[i];
    koff[i + 1] = koff[i] + ctx[i];
    maxctx = std::max(maxctx, ctx[i]);
  }
  const size_t nblocks = (size_t)boff[B];
  uint8_t *cache;
  CK(cudaMalloc(&cache, bb * nblocks));
  S.frees.push_back(cache);
  // Block tables: a strided permutation of the pool (not contiguous per
  // session). ATTND_BENCH_TABLE=random: a random permutation (seeded, the same
  // every run); =contig: each session's blocks in order. The strided one makes
  // the blocks the sessions read at one moment congruent modulo their count
  // (B64 x 64 blocks: 64 blocks 16 MB apart at bf16), which bench_loads.cu
  // times against the other two.
  std::vector<int32_t> meta(nblocks);
  const char *tk = getenv("ATTND_BENCH_TABLE");
  size_t stride = 7919;
  while (nblocks > 1 && std::gcd(stride, nblocks) != 1)
    stride++;
  for (size_t l = 0; l < nblocks; l++)
    meta[l] = (int32_t)(tk && !strcmp(tk, "contig") ? l : (l * stride) % nblocks);
  if (tk && !strcmp(tk, "random")) {
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t l = nblocks - 1; l > 0; l--) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(meta[l], meta[(x >> 33) % (l + 1)]);
    }
  }
  const size_t iv_off = meta.size();
  if (mask == ATTND_MASK_INTERVALS) {
    // Documents: keys of a document are masked for rows after its end.
    for (int i = 0; i < B; i++) {
      std::vector<int32_t> iv(4 * (size_t)ctx[i], 0);
      int a = 0;
      for (int l : *doc_lens) {
        for (int j = a; j < a + l && j < ctx[i]; j++) {
          iv[j] = a + l;
          iv[ctx[i] + j] = ctx[i];
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
      float base = sh.kv == ATTND_KV_INT4 ? 0.5f : sh.kv == ATTND_KV_INT8 ? 4.f / 127 : 4.f / 448;
      h[i] = h[KVH * D + i] = base;
      h[2 * KVH * D + i] = h[3 * KVH * D + i] = 7.5f;
    }
    CK(cudaMemcpy(scales, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  }
  const bool st = attnd_kv_type_static(sh.kv);
  const size_t T = (size_t)koff[B];
  __nv_bfloat16 *k, *v, *q;
  CK(cudaMalloc(&k, T * KVH * D * 2));
  CK(cudaMalloc(&v, T * KVH * D * 2));
  CK(cudaMalloc(&q, (size_t)n * B * QH * D * 2));
  fill_normalish<<<1024, 256>>>(k, T * KVH * D, 1);
  fill_normalish<<<1024, 256>>>(v, T * KVH * D, 2);
  fill_normalish<<<1024, 256>>>(q, (size_t)n * B * QH * D, 3);
  // History: positions 0..ctx-1 of every item, written once; the step's k/v
  // are the last n rows of each item's history (rewritten with the same values).
  std::vector<attnd_kitem_t> hist(B), step(B);
  __nv_bfloat16 *sk, *sv;
  CK(cudaMalloc(&sk, (size_t)n * B * KVH * D * 2));
  CK(cudaMalloc(&sv, (size_t)n * B * KVH * D * 2));
  S.frees.push_back(sk);
  S.frees.push_back(sv);
  S.frees.push_back(q);
  size_t ivo = iv_off;
  for (int i = 0; i < B; i++) {
    hist[i] = {0, ctx[i], -1, koff[i], 0, 0, 0, 0, boff[i]};
    step[i] = {ctx[i] - n, n, n * i, n * i, mask, mask_param, 1, (int32_t)ivo, boff[i]};
    if (mask == ATTND_MASK_INTERVALS)
      ivo += 4 * (size_t)ctx[i];
    CK(cudaMemcpy(sk + (size_t)n * i * KVH * D, k + (size_t)(koff[i + 1] - n) * KVH * D, (size_t)n * KVH * D * 2,
                  cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(sv + (size_t)n * i * KVH * D, v + (size_t)(koff[i + 1] - n) * KVH * D, (size_t)n * KVH * D * 2,
                  cudaMemcpyDeviceToDevice));
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
  hb.max_kv_len = maxctx;
  hb.kv_sum = koff[B];
  hb.max_n = maxctx;
  hb.k = k;
  hb.v = v;
  hb.cache = cache;
  hb.block_bytes = bb;
  hb.k_scale = st ? scales : nullptr;
  hb.v_scale = st ? scales + KVH * D : nullptr;
  hb.k_zero = sh.kv == ATTND_KV_INT4 ? scales + 2 * KVH * D : nullptr;
  hb.v_zero = sh.kv == ATTND_KV_INT4 ? scales + 3 * KVH * D : nullptr;
  hb.scale_per_channel = 1;
  CKA(attnd_cuda_write(&s, &hb, nullptr));
  CK(cudaDeviceSynchronize());
  cudaFree(k);
  cudaFree(v);
  cudaFree(d_hist);
  attnd_kbatch_t &b = S.b;
  b = hb;
  b.items = d_step;
  b.total_q = n * B;
  b.total_kv = n * B;
  b.max_n = n;
  b.q = q;
  b.k = sk;
  b.v = sv;
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
  S.cache_bytes = (double)T * attnd_kv_bytes_per_token(&s);
  CK(cudaDeviceSynchronize());
}

void setup(Setup &S, attnd_kv_type_t kv, int B, int ctx, int n, int mask, int mask_param,
           const std::vector<int> *doc_lens) {
  BenchShape sh;
  sh.kv = kv;
  setup_ex(S, sh, std::vector<int>(B, ctx), n, mask, mask_param, doc_lens);
}

void teardown(Setup &S) {
  for (void *p : S.frees)
    cudaFree(p);
  S.frees.clear();
}


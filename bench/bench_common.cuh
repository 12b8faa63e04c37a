// bench_common.cuh: what the kernel benchmark's files share: error checks,
// timing, JSON rows, and the setup of a paged cache filled by attnd_cuda_write.
#pragma once

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

extern std::string g_json;

// ATTND_BENCH_FILTER=substring runs only the rows whose name contains it.
bool bench_wanted(const char *name);
void jrow(const char *name, const char *fmt, ...);
// Roughly normal bf16 values (mean 0, sd ~2.3), deterministic per seed.
__global__ void fill_normalish(__nv_bfloat16 *p, size_t n, uint64_t seed);

// Median of iters timed runs of fn (CUDA events around each), after warm runs.
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

// A layer's shape and one step over it.
struct BenchShape {
  attnd_kv_type_t kv = ATTND_KV_BF16;
  int q_heads = 32, kv_heads = 8, head_dim = 128, block_size = 64;
};

struct Setup {
  attnd_kshape_t s;
  attnd_kbatch_t b;
  std::vector<void *> frees;
  void *ws = nullptr;
  size_t ws_bytes = 0;
  double cache_bytes = 0; // K, V (and dynamic scales) the step's attention reads
};

// Items i with ctx[i] tokens in all, the last n of them new (written by the
// step), the others cached (written once by attnd_cuda_write from random k/v);
// block tables strided, so a session's blocks are not contiguous.
void setup_ex(Setup &S, const BenchShape &sh, const std::vector<int> &ctx, int n, int mask, int mask_param,
              const std::vector<int> *doc_lens);
// B items of the same context, the default shape (32 q / 8 kv heads, d 128, block 64).
void setup(Setup &S, attnd_kv_type_t kv, int B, int ctx, int n, int mask, int mask_param,
           const std::vector<int> *doc_lens);
void teardown(Setup &S);

// The decode and bandwidth rows (bench_decode.cu); returns the read roof in GB/s.
double bench_read_roof();
void bench_decode_rows(double copy_gbps, double read_gbps);

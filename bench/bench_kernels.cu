// bench_kernels: times the CUDA kernels and prints a table (JSON rows to
// $OUT/bench.json when OUT is set). bench/README.md lists the rows:
//   copy, read  the two bandwidth ceilings of this device, same run;
//   decode      (bench_decode.cu) every cache type over paged caches, as GB/s
//               of cache bytes read and a fraction of the read roof; shape
//               sweeps, uneven batches, small-batch launch sequences;
//   prefill     B=4 S=8192 causal bf16: TFLOP/s (4*B*Hq*S*S*D/2 FLOPs);
//               document mask (FlashMask intervals) and sliding window 1024:
//               effective TFLOP/s over the visible (q, k) pairs; the per-layer
//               variants: causal with logit soft-capping 50 (Gemma 2), a
//               sliding layer's window 1024 on the causal mask;
//   window      decode B8, 32/8 d128, one row per item at 32k of history in
//               a sliding layer of window 4096 / 128, against a full layer
//               at the window's length (the target: within 1.2x).
// CUDA events around each launch, warm-up first, median of many runs. The
// caches are 0.1 to 2 GB, far over the 60 MB L2, so one input set suffices
// (the small-batch rows rotate among several).
#include "bench_common.cuh"

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

  // Copy ceiling (bytes read + written).
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
  const double read_gbps = bench_read_roof();
  bench_decode_rows(copy_gbps, read_gbps);

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
    float softcap; // attnd_kshape_t.softcap
    int window;    // attnd_kbatch_t.window
  } pms[] = {{"causal_bf16", ATTND_KV_BF16, ATTND_MASK_CAUSAL, 0, 0.f, 0},
             {"document_bf16", ATTND_KV_BF16, ATTND_MASK_INTERVALS, 0, 0.f, 0},
             {"sliding1024_bf16", ATTND_KV_BF16, ATTND_MASK_SLIDING, 1024, 0.f, 0},
             {"causal_fp8_dynamic", ATTND_KV_FP8_DYNAMIC, ATTND_MASK_CAUSAL, 0, 0.f, 0},
             {"causal_int8", ATTND_KV_INT8, ATTND_MASK_CAUSAL, 0, 0.f, 0},
             {"causal_softcap50_bf16", ATTND_KV_BF16, ATTND_MASK_CAUSAL, 0, 50.f, 0},
             {"window1024_bf16", ATTND_KV_BF16, ATTND_MASK_CAUSAL, 0, 0.f, 1024}};
  for (auto &pm : pms) {
    char nm[64];
    snprintf(nm, sizeof nm, "prefill_B4_S8192_%s", pm.name);
    if (!bench_wanted(nm))
      continue;
    Setup S;
    setup(S, (attnd_kv_type_t)pm.kv, B, S_, S_, pm.mask, pm.param, &lens);
    S.s.softcap = pm.softcap;
    S.b.window = pm.window;
    double live = 0;
    if (pm.window > 0)
      for (int i = 0; i < S_; i++)
        live += std::min(i + 1, pm.window);
    else if (pm.mask == ATTND_MASK_CAUSAL)
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
  // A sliding layer's decode reads its window only: 32k of history in a window
  // of w against a full layer at w (same split plan; the window's first key
  // is not chunk-aligned, so it may read one 16-key chunk more).
  printf("\n%-34s %9s %9s %7s %7s\n", "decode B8 ctx32768 32/8 d128", "us", "full@w", "ratio", "splits");
  struct WR {
    const char *name;
    int kv, window;
  } wrs[] = {{"bf16_w4096", ATTND_KV_BF16, 4096},
             {"bf16_w128", ATTND_KV_BF16, 128},
             {"int8_w4096", ATTND_KV_INT8, 4096},
             {"fp8_dynamic_w128", ATTND_KV_FP8_DYNAMIC, 128}};
  for (auto &w : wrs) {
    char nm[96];
    snprintf(nm, sizeof nm, "decode_B8_ctx32768_%s", w.name);
    if (!bench_wanted(nm))
      continue;
    float us[2];
    int sp[2];
    for (int k = 0; k < 2; k++) {
      Setup S;
      setup(S, (attnd_kv_type_t)w.kv, 8, k == 0 ? 32768 : w.window, 1, ATTND_MASK_CAUSAL, 0, nullptr);
      S.b.window = k == 0 ? w.window : 0;
      sp[k] = attnd_cuda_attend_splits(&S.s, &S.b, S.ws_bytes);
      us[k] = 1e3f * median_ms([&] { CKA(attnd_cuda_attend(&S.s, &S.b, S.ws, S.ws_bytes, nullptr)); }, 5, 50);
      teardown(S);
    }
    printf("%-34s %9.1f %9.1f %7.3f %3d/%-3d\n", w.name, us[0], us[1], us[0] / us[1], sp[0], sp[1]);
    jrow(nm, "\"us\": %.1f, \"full_at_window_us\": %.1f, \"ratio\": %.3f, \"splits\": %d, \"full_splits\": %d",
         us[0], us[1], us[0] / us[1], sp[0], sp[1]);
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

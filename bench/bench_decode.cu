// bench_decode.cu: the bandwidth and decode rows of bench_kernels.
//   read_bw     a kernel that reads a 4 GiB buffer (16-byte loads, several in
//               flight per thread) and writes almost nothing: the roof decode
//               is compared with; a few launch shapes, the best one counts;
//   decode      B64 ctx4096 and B8 ctx32768, 32 q / 8 kv heads, d 128, block 64,
//               every cache type: GB/s of cache bytes read (K, V and dynamic
//               scales) and % of the read roof; per-item split and no-PDL
//               variants of the same launch; no-load / no-math diagnosis;
//   sweep       B64 ctx4096 at d 64 / 256, GQA 1 / 8 / 16, block 16 / 128, as a
//               fraction of the d128 / GQA 4 / block 64 row of the same type;
//   uneven      64 sessions, contexts log-uniform in 128..32768, flat and
//               per-item split, and the default with pfown (debug 64);
//   small       B1 and B8 at ctx 4096: the whole launch sequence of a layer
//               step (write kernel, attention, merge) under the default plan,
//               flat splits of 4-32 chunks per CTA and per-item splits of at
//               least 16-64 chunks per part, with and without the merge
//               inside clusters (debug 256), timed with CUDA events
//               around it, one sequence at a time (median) and as a CUDA graph
//               of sequences (mean); inputs rotate among setups so that the
//               cache is not L2-resident; the step_* columns run the layer
//               step through attnd_cuda_step (one fused launch).
#include <math.h>

#include "bench_common.cuh"

namespace {

const char *kvn(int kv) { return attnd_kv_type_name((attnd_kv_type_t)kv); }

__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Reads n16 16-byte words, UNROLL independent loads in flight per thread;
// writes only if the XOR of everything is a value it never is.
template <int UNROLL> __global__ void read_probe(const uint4 *__restrict__ p, size_t n16, unsigned *out) {
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; k++)
      v[k] = ld_stream(p + i + k * stride);
#pragma unroll
    for (int k = 0; k < UNROLL; k++)
      acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n16; i += stride)
    acc ^= ld_stream(p + i).x;
  if (acc == 0x9e3779b9u)
    out[0] = acc;
}

struct Timed {
  float us;
  int splits;
};

Timed time_attend(Setup &S, const attnd_cuda_opts_t *o, int iters = 50) {
  Timed t;
  t.splits = attnd_cuda_attend_splits_opts(&S.s, &S.b, S.ws_bytes, o);
  t.us = 1e3f * median_ms([&] { CKA(attnd_cuda_attend_opts(&S.s, &S.b, S.ws, S.ws_bytes, nullptr, o)); }, 5, iters);
  return t;
}

double pct(double gbps, double roof) { return 100.0 * gbps / roof; }

// One decode row at the default options, with variants of the same launch.
double decode_row(const char *nm, Setup &S, double copy, double read, bool diag) {
  const attnd_cuda_opts_t dflt = {}, item = {0, 2, 0, 0}, nopdl = {0, 0, 0, 1};
  // The decode kernel's load-path variants (attnd_cuda_opts_t.debug, results
  // exact): the other chunk copy, the refill-read one (4 for the 16-bit types
  // and int4, 32 for the 1-byte types; every type's default is the per-piece
  // copy); the other lookahead (below).
  // pfown (64): each CTA's own rows prefetched into L2 by the bulk copy
  // engine ~32 KB ahead, with either split. ATTND_BENCH_DEC_DEBUG ORs bits into
  // the default launch (a profiler's first decode launch then runs them).
  const bool one_byte = S.s.kv == ATTND_KV_INT8 || S.s.kv == ATTND_KV_FP8 || attnd_kv_type_dynamic(S.s.kv);
  // The other lookahead than the type's default (split_plan.cu): all stages
  // ahead (512) for the converted types, one chunk ahead (8) for the 16-bit.
  const bool k16 = S.s.kv == ATTND_KV_BF16 || S.s.kv == ATTND_KV_FP16;
  const attnd_cuda_opts_t refc = {one_byte ? 32 : 4, 0, 0, 0}, ahead1 = {k16 ? 8 : 512, 0, 0, 0};
  const attnd_cuda_opts_t pfo = {64, 0, 0, 0}, pfi = {64, 2, 0, 0};
  attnd_cuda_opts_t dbg = dflt;
  if (getenv("ATTND_BENCH_DEC_DEBUG"))
    dbg.debug = atoi(getenv("ATTND_BENCH_DEC_DEBUG"));
  const Timed a = time_attend(S, &dbg), b = time_attend(S, &item), c = time_attend(S, &nopdl);
  const Timed r = time_attend(S, &refc), l = time_attend(S, &ahead1);
  const Timed po = time_attend(S, &pfo), pi = time_attend(S, &pfi);
  const attnd_cuda_opts_t clo = {256, 0, 0, 0}; // a per-item split merged in clusters (debug 256)
  const Timed cl = time_attend(S, &clo);
  // hm (debug 4096 with the per-item split): its CTAs head-major, so that
  // co-resident CTAs read different items' blocks (decode_kernel.cuh); flat:
  // the flat split forced (split 1), the cut of bench_loads' probe; mis (debug
  // 8192): the default plan with the stages at their old offset, 64 bytes past
  // a 128-byte boundary (decode_layout.cuh kStagePad); mis hm: both, per-item split.
  const attnd_cuda_opts_t hmo = {4096, 2, 0, 0}, flo = {0, 1, 0, 0}, alo = {8192, 0, 0, 0},
                          ahm = {8192 | 4096, 2, 0, 0};
  const Timed hmt = time_attend(S, &hmo), flt = time_attend(S, &flo), alt = time_attend(S, &alo),
              aht = time_attend(S, &ahm);
  // pv16 (debug 32768): the dynamic types' P V in fp16 under bf16 activations
  // (Dec::kPv16; the default elsewhere).
  const attnd_cuda_opts_t pvo = {32768, 0, 0, 0};
  const Timed pvt = time_attend(S, &pvo);
  const float wus = 1e3f * median_ms([&] { CKA(attnd_cuda_write(&S.s, &S.b, nullptr)); }, 3, 20);
  // The whole step through attnd_cuda_step (the fused launch where its plan
  // allows), and the same unfused (write kernel, then the attention).
  attnd_cuda_opts_t nfo = {}, fuo = {};
  nfo.fuse = -1;
  fuo.fuse = 1;
  const int fused = attnd_cuda_step_fused(&S.s, &S.b, S.ws_bytes, &fuo);
  const float sus =
      1e3f * median_ms([&] { CKA(attnd_cuda_step_opts(&S.s, &S.b, S.ws, S.ws_bytes, nullptr, &fuo)); }, 3, 20);
  const float snf =
      1e3f * median_ms([&] { CKA(attnd_cuda_step_opts(&S.s, &S.b, S.ws, S.ws_bytes, nullptr, &nfo)); }, 3, 20);
  const double gbps = S.cache_bytes / (a.us * 1e-6) / 1e9;
  // ATTND_BENCH_DEC_L2PF set: also debug 16 (whole blocks prefetched into L2),
  // a bulk-copy-engine path the tests do not run: its own process in a round.
  char l2pf[96] = "";
  if (getenv("ATTND_BENCH_DEC_L2PF")) {
    const attnd_cuda_opts_t pf = {16, 0, 0, 0};
    snprintf(l2pf, sizeof l2pf, " | l2pf %7.1f", time_attend(S, &pf).us);
  }
  printf("%-34s %8.1f %7.0f %6.1f%% %6.1f%% %5d | per-item %7.1f (%d) | no-pdl %7.1f | write %5.1f | alt-copy %7.1f "
         "| alt-ahead %7.1f | pfown %7.1f %5.1f%% | pfown per-item %7.1f | cluster %7.1f | hm %7.1f | flat %7.1f | mis %7.1f %5.1f%% | mis hm %7.1f | pv16 %7.1f %5.1f%% | step %7.1f (fused %d) | step-nofuse %7.1f%s\n",
         nm, a.us, gbps, pct(gbps, read), pct(gbps, copy), a.splits, b.us, b.splits, c.us, wus, r.us, l.us, po.us,
         pct(S.cache_bytes / (po.us * 1e-6) / 1e9, read), pi.us, cl.us, hmt.us, flt.us, alt.us,
         pct(S.cache_bytes / (alt.us * 1e-6) / 1e9, read), aht.us, pvt.us, pct(S.cache_bytes / (pvt.us * 1e-6) / 1e9, read),
         sus, fused, snf, l2pf);
  char extra[256] = "";
  if (diag) {
    const attnd_cuda_opts_t nl = {1, 0, 0, 0}, nm2 = {2, 0, 0, 0}, nmi = {2, 2, 0, 0}, nmh = {2 | 4096, 2, 0, 0},
                            nma = {2 | 8192, 0, 0, 0}, nlp = {1 | 32768, 0, 0, 0};
    const Timed x = time_attend(S, &nl), y = time_attend(S, &nm2), w = time_attend(S, &nmi), h = time_attend(S, &nmh),
                z = time_attend(S, &nma), xp = time_attend(S, &nlp);
    printf("%-34s   no-load %7.1f us, no-math %7.1f us, no-math per-item %7.1f us, no-math hm %7.1f us, no-math mis "
           "%7.1f us, no-load pv16 %7.1f us\n",
           "", x.us, y.us, w.us, h.us, z.us, xp.us);
    snprintf(extra, sizeof extra,
             ", \"us_no_load\": %.1f, \"us_no_math\": %.1f, \"us_no_math_per_item\": %.1f, \"us_no_math_hm\": %.1f"
             ", \"us_no_math_mis\": %.1f, \"us_no_load_pv16\": %.1f",
             x.us, y.us, w.us, h.us, z.us, xp.us);
  }
  jrow(nm,
       "\"us\": %.1f, \"GBps\": %.1f, \"pct_read\": %.1f, \"pct_copy\": %.1f, \"splits\": %d, \"us_per_item\": %.1f, "
       "\"splits_per_item\": %d, \"us_no_pdl\": %.1f, \"write_us\": %.1f, \"us_ref_copy\": %.1f, \"us_alt_ahead\": %.1f, "
       "\"us_pfown\": %.1f, \"us_pfown_per_item\": %.1f, \"us_cluster\": %.1f, \"us_hm\": %.1f, \"us_flat\": %.1f, \"us_mis\": %.1f, \"us_mis_hm\": %.1f, \"us_pv16\": %.1f, "
       "\"step_us\": %.1f, \"step_fused\": %d, \"step_nofuse_us\": %.1f, \"bytes\": %.0f%s",
       a.us, gbps, pct(gbps, read), pct(gbps, copy), a.splits, b.us, b.splits, c.us, wus, r.us, l.us, po.us, pi.us,
       cl.us, hmt.us, flt.us, alt.us, aht.us, pvt.us, sus, fused, snf, S.cache_bytes, extra);
  return pct(gbps, read);
}

void rows_main(double copy, double read, double base_pct[ATTND_KV_COUNT_]) {
  printf("\n%-34s %8s %7s %7s %7s %5s\n", "decode (32/8 heads, d128, bs64)", "us", "GB/s", "%read", "%copy", "parts");
  const int shapes[2][2] = {{64, 4096}, {8, 32768}};
  for (auto &sh : shapes)
    for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
      char nm[96];
      snprintf(nm, sizeof nm, "decode_B%d_ctx%d_%s", sh[0], sh[1], kvn(kv));
      if (!bench_wanted(nm))
        continue;
      Setup S;
      setup(S, (attnd_kv_type_t)kv, sh[0], sh[1], 1, ATTND_MASK_CAUSAL, 0, nullptr);
      const bool diag = kv == ATTND_KV_BF16 || kv == ATTND_KV_INT8_DYNAMIC || kv == ATTND_KV_FP8_DYNAMIC || kv == ATTND_KV_INT4;
      const double p = decode_row(nm, S, copy, read, diag);
      if (sh[0] == 64)
        base_pct[kv] = p;
      teardown(S);
    }
}

void rows_sweep(double copy, double read, const double base_pct[ATTND_KV_COUNT_]) {
  struct Sw {
    const char *name;
    int qh, d, bs;
  } sws[] = {{"d64", 32, 64, 64},  {"d256", 32, 256, 64}, {"gqa1", 8, 128, 64},    {"gqa8", 64, 128, 64},
             {"gqa16", 128, 128, 64}, {"bs16", 32, 128, 16}, {"bs128", 32, 128, 128}};
  printf("\n%-34s %8s %7s %7s %9s\n", "sweep B64 ctx4096 (8 kv heads)", "us", "GB/s", "%read", "vs base");
  for (auto &w : sws)
    for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
      char nm[96];
      snprintf(nm, sizeof nm, "sweep_B64_ctx4096_%s_%s", w.name, kvn(kv));
      if (!bench_wanted(nm))
        continue;
      BenchShape sh;
      sh.kv = (attnd_kv_type_t)kv;
      sh.q_heads = w.qh;
      sh.head_dim = w.d;
      sh.block_size = w.bs;
      Setup S;
      setup_ex(S, sh, std::vector<int>(64, 4096), 1, ATTND_MASK_CAUSAL, 0, nullptr);
      const attnd_cuda_opts_t dflt = {};
      const Timed a = time_attend(S, &dflt, 30);
      const double gbps = S.cache_bytes / (a.us * 1e-6) / 1e9, p = pct(gbps, read);
      const double rel = base_pct[kv] > 0 ? p / base_pct[kv] : 0.0;
      printf("%-34s %8.1f %7.0f %6.1f%% %8.2fx %s\n", nm, a.us, gbps, p, rel, fabs(rel - 1.0) > 0.1 ? "(>10%)" : "");
      jrow(nm, "\"us\": %.1f, \"GBps\": %.1f, \"pct_read\": %.1f, \"pct_copy\": %.1f, \"rel_base\": %.3f, \"splits\": %d",
           a.us, gbps, p, pct(gbps, copy), rel, a.splits);
      // ATTND_BENCH_SWEEP_DIAG set: the decode rows' launch variants and
      // no-load / no-math diagnosis of this shape too (a row "<name>_diag").
      if (getenv("ATTND_BENCH_SWEEP_DIAG")) {
        char dn[112];
        snprintf(dn, sizeof dn, "%s_diag", nm);
        decode_row(dn, S, copy, read, true);
      }
      teardown(S);
    }
}

void rows_uneven(double copy, double read) {
  std::vector<int> ctx(64);
  uint64_t x = 0x243f6a8885a308d3ull;
  for (auto &c : ctx) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const double u = (double)(x >> 11) * 0x1.0p-53;
    c = (int)lround(exp(log(128.0) + u * (log(32768.0) - log(128.0))));
  }
  long tot = 0;
  for (int c : ctx)
    tot += c;
  printf("\n%-34s %8s %7s %7s | per-item split (%ld tokens in all)\n", "uneven: 64 sessions, 128..32768", "us", "GB/s",
         "%read", tot);
  for (int kv = 0; kv < ATTND_KV_COUNT_; kv++) {
    char nm[96];
    snprintf(nm, sizeof nm, "uneven_B64_%s", kvn(kv));
    if (!bench_wanted(nm))
      continue;
    BenchShape sh;
    sh.kv = (attnd_kv_type_t)kv;
    Setup S;
    setup_ex(S, sh, ctx, 1, ATTND_MASK_CAUSAL, 0, nullptr);
    const attnd_cuda_opts_t dflt = {}, item = {0, 2, 0, 0}, pfo = {64, 0, 0, 0};
    const Timed a = time_attend(S, &dflt), b = time_attend(S, &item), c = time_attend(S, &pfo);
    const double gbps = S.cache_bytes / (a.us * 1e-6) / 1e9, gb2 = S.cache_bytes / (b.us * 1e-6) / 1e9;
    const double gb3 = S.cache_bytes / (c.us * 1e-6) / 1e9;
    printf("%-34s %8.1f %7.0f %6.1f%% | %7.1f us %6.1f%% | pfown %7.1f us %6.1f%%\n", nm, a.us, gbps, pct(gbps, read),
           b.us, pct(gb2, read), c.us, pct(gb3, read));
    jrow(nm, "\"us\": %.1f, \"GBps\": %.1f, \"pct_read\": %.1f, \"pct_copy\": %.1f, \"splits\": %d, \"us_per_item\": %.1f, "
             "\"pct_read_per_item\": %.1f, \"us_pfown\": %.1f, \"pct_read_pfown\": %.1f",
         a.us, gbps, pct(gbps, read), pct(gbps, copy), a.splits, b.us, pct(gb2, read), c.us, pct(gb3, read));
    teardown(S);
  }
}

// The layer step's launch sequence over R rotating setups.
struct SmallSeq {
  std::vector<Setup> S;
  cudaStream_t st;
  bool step = false; // attnd_cuda_step (the fused launch where it applies)
  void run(int i, const attnd_cuda_opts_t *o) {
    Setup &x = S[i % S.size()];
    if (step) {
      CKA(attnd_cuda_step_opts(&x.s, &x.b, x.ws, x.ws_bytes, st, o));
      return;
    }
    CKA(attnd_cuda_write_opts(&x.s, &x.b, st, o));
    CKA(attnd_cuda_attend_opts(&x.s, &x.b, x.ws, x.ws_bytes, st, o));
  }
};

// Median of single sequences, and the mean per sequence of a graph of 4R of them.
void time_small(SmallSeq &q, const attnd_cuda_opts_t *o, float *single_us, float *graph_us) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int i = 0; i < 210; i++) {
    CK(cudaEventRecord(a, q.st));
    q.run(i, o);
    CK(cudaEventRecord(b, q.st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 10)
      ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  *single_us = 1e3f * ts[ts.size() / 2];
  *graph_us = -1.f;
  const int n = 4 * (int)q.S.size();
  cudaGraph_t g;
  cudaGraphExec_t ge;
  if (cudaStreamBeginCapture(q.st, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
    for (int i = 0; i < n; i++)
      q.run(i, o);
    if (cudaStreamEndCapture(q.st, &g) == cudaSuccess && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess) {
      for (int w = 0; w < 3; w++)
        CK(cudaGraphLaunch(ge, q.st));
      CK(cudaEventRecord(a, q.st));
      const int reps = 20;
      for (int r = 0; r < reps; r++)
        CK(cudaGraphLaunch(ge, q.st));
      CK(cudaEventRecord(b, q.st));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      *graph_us = 1e3f * ms / (reps * n);
      cudaGraphExecDestroy(ge);
      cudaGraphDestroy(g);
    }
  }
  cudaGetLastError();
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
}

void rows_small(double read) {
  const int kvs[4] = {ATTND_KV_BF16, ATTND_KV_INT8_DYNAMIC, ATTND_KV_FP8, ATTND_KV_INT4};
  const int Bs[2] = {1, 8};
  struct V {
    const char *name;
    attnd_cuda_opts_t o;
    bool step;
  } vs[] = {{"flat8", {0, 1, 8, 0}},   {"flat4", {0, 1, 4, 0}},   {"flat16", {0, 1, 16, 0}},
            {"flat32", {0, 1, 32, 0}}, {"peritem", {0, 2, 0, 0}}, {"flat8_nopdl", {0, 1, 8, 1}},
            {"item16", {0, 2, 16, 0}}, {"item32", {0, 2, 32, 0}}, {"item64", {0, 2, 64, 0}},
            {"default", {0, 0, 0, 0}},
            {"cluster", {256, 2, 0, 0}}, {"cluster_i32", {256, 2, 32, 0}}, {"cluster_auto", {256, 0, 0, 0}},
            // attnd_cuda_step: the fused launch (write inside the decode kernel, parts merged in
            // clusters) with its own plan, then with fewer and longer parts, and the step unfused.
            {"step", {0, 0, 0, 0}, true},           {"step_i32", {256, 2, 32, 0}, true},
            {"step_i64", {256, 2, 64, 0}, true},    {"step_i8", {256, 2, 8, 0}, true},
            {"step_nofuse", {}, true}};
  for (auto &v : vs)
    if (v.step)
      v.o.fuse = 1;
  vs[sizeof vs / sizeof vs[0] - 1].o.fuse = -1;
  printf("\n%-30s %8s %8s %8s   (us of device time per layer step: write + attention + merge)\n",
         "small batches, ctx 4096", "single", "graph", "floor");
  for (int B : Bs)
    for (int kv : kvs) {
      char nm[96];
      snprintf(nm, sizeof nm, "small_B%d_ctx4096_%s", B, kvn(kv));
      if (!bench_wanted(nm))
        continue;
      SmallSeq q;
      CK(cudaStreamCreateWithFlags(&q.st, cudaStreamNonBlocking));
      BenchShape sh;
      sh.kv = (attnd_kv_type_t)kv;
      Setup first;
      setup_ex(first, sh, std::vector<int>(B, 4096), 1, ATTND_MASK_CAUSAL, 0, nullptr);
      const int R = std::max(1, std::min(8, (int)ceil(240e6 / first.cache_bytes)));
      q.S.push_back(first);
      for (int r = 1; r < R; r++) {
        Setup x;
        setup_ex(x, sh, std::vector<int>(B, 4096), 1, ATTND_MASK_CAUSAL, 0, nullptr);
        q.S.push_back(x);
      }
      const double floor_us = first.cache_bytes / (read * 1e9) * 1e6;
      // The parts of the default sequence alone: the write kernel, the attention (and merge).
      int rot = 0;
      const float w_us = 1e3f * median_ms([&] { Setup &x = q.S[rot++ % q.S.size()]; CKA(attnd_cuda_write(&x.s, &x.b, nullptr)); }, 5, 100);
      const float a_us = 1e3f * median_ms([&] { Setup &x = q.S[rot++ % q.S.size()]; CKA(attnd_cuda_attend(&x.s, &x.b, x.ws, x.ws_bytes, nullptr)); }, 5, 100);
      printf("%-22s %-12s %8.1f %8s %8s   (write kernel alone)\n", nm, "write", w_us, "", "");
      printf("%-22s %-12s %8.1f %8s %8s   (attention + merge alone, default options)\n", nm, "attend", a_us, "", "");
      char wb[96];
      snprintf(wb, sizeof wb, "\"write_alone_us\": %.2f, \"attend_alone_us\": %.2f", w_us, a_us);
      std::string js = wb;
      // ATTND_BENCH_SMALL_ALONE set: the parts alone only (a profiler's run).
      for (auto &v : vs) {
        if (getenv("ATTND_BENCH_SMALL_ALONE"))
          break;
        float su, gu;
        q.step = v.step;
        if (v.step && v.o.fuse > 0 && !attnd_cuda_step_fused(&q.S[0].s, &q.S[0].b, q.S[0].ws_bytes, &v.o))
          printf("%-22s %-12s (not fused: write kernel, then attention)\n", nm, v.name);
        time_small(q, &v.o, &su, &gu);
        printf("%-22s %-12s %8.1f %8.1f %8.1f\n", nm, v.name, su, gu, floor_us);
        char buf[160];
        snprintf(buf, sizeof buf, ", \"%s_single_us\": %.2f, \"%s_graph_us\": %.2f", v.name, su, v.name, gu);
        js += buf;
      }
      jrow(nm, "%s, \"floor_us\": %.2f, \"rotate\": %d", js.c_str(), floor_us, R);
      for (auto &x : q.S)
        teardown(x);
      CK(cudaStreamDestroy(q.st));
    }
}

} // namespace

double bench_read_roof() {
  const size_t n = (size_t)4 << 30;
  void *buf;
  unsigned *sink;
  CK(cudaMalloc(&buf, n));
  CK(cudaMalloc(&sink, 16));
  CK(cudaMemset(buf, 0x5a, n));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  double best = 0;
  std::string js;
  struct Cfg {
    int per_sm, threads, unroll;
  } cfgs[] = {{4, 512, 4}, {8, 256, 8}, {16, 256, 4}, {2, 1024, 8}};
  for (auto &c : cfgs) {
    const dim3 g(sms * c.per_sm), bl(c.threads);
    const uint4 *p = (const uint4 *)buf;
    const float ms = median_ms(
        [&] {
          if (c.unroll == 4)
            read_probe<4><<<g, bl>>>(p, n / 16, sink);
          else
            read_probe<8><<<g, bl>>>(p, n / 16, sink);
        },
        3, 20);
    CK(cudaGetLastError());
    const double gbps = n / (ms * 1e-3) / 1e9;
    printf("read_bw %dx%d per SM, unroll %d: %.0f GB/s\n", c.per_sm, c.threads, c.unroll, gbps);
    char b[96];
    snprintf(b, sizeof b, "%s\"%dx%d_u%d\": %.1f", js.empty() ? "" : ", ", c.per_sm, c.threads, c.unroll, gbps);
    js += b;
    best = std::max(best, gbps);
  }
  printf("read_bw %.0f GB/s (read only, best launch: the roof)\n", best);
  jrow("read_bw", "\"GBps\": %.1f, %s", best, js.c_str());
  cudaFree(buf);
  cudaFree(sink);
  return best;
}

void bench_decode_rows(double copy, double read) {
  double base[ATTND_KV_COUNT_] = {};
  rows_main(copy, read, base);
  rows_sweep(copy, read, base);
  rows_uneven(copy, read);
  rows_small(read);
}

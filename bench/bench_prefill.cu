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
// environment variables: the kernels read none). ATTND_BENCH_FILTER (comma-
// separated substrings) runs only the rows whose name holds one;
// ATTND_BENCH_VARIANTS (comma-separated names) runs exactly those variants.
#include <time.h>

#include "bench_common.cuh"

// B items of n new tokens over ctx - n cached ones (ctx keys in all), 32 q / 8 kv
// heads, block 64 (bench_common.cu, setup_ex).
static void setup(Setup &S, attnd_kv_type_t kv, int D, int B, int ctx, int n, int mask,
                  int mask_param, const std::vector<int> *doc_lens) {
  BenchShape sh;
  sh.kv = kv;
  sh.head_dim = D;
  setup_ex(S, sh, std::vector<int>(B, ctx), n, mask, mask_param, doc_lens);
}

struct Variant {
  const char *name;
  attnd_cuda_opts_t opts;
};
// Variants timed per row: the Hopper path as it is (pp), with every earlier
// form of round 4's changes at once (old: sm90_sched bits 4-6 and 8, the path
// of the previous rounds) and with each alone (old_q: q loaded a unit at a
// time; old_iv: every partly masked interval tile read per element; old_raw:
// converted types' copies wait for the consumers, two stages; no_kvsplit: K
// and V awaited together at D 256), the opt-in forms (ffma: one FFMA per
// score; kvsplit: K and V apart at D <= 128), its schedules (nopp: no
// pingpong; pp_serial: no intra-warpgroup overlap; no softmax: a timing
// experiment with wrong output), on the converted cache types the earlier
// conversion instructions (old_cvt: the same values), none at all (nocvt:
// timing only, wrong output), the opt-in bank-conflict-free unit order
// (cvt_swz), the producer warp converting too (cvt4), the other form of the
// finishing loop (cvt_pf: the next round's loads ahead of the stores, or for
// static int8 / fp8, whose default that is, not) and their combinations
// (the dynamic types at D <= 128 compile the default form only: there these
// equal pp), the fourth warpgroup of finishing warps idle (cvt3: 96
// finishing threads instead of 224, same values), then the tiled kernel. A row runs the
// variants its flags ask for (Row.all_variants bits, below).
static attnd_cuda_opts_t variant_opts(int sm90, int sched, int gchunk) {
  attnd_cuda_opts_t o = {};
  o.sm90 = sm90;
  o.sm90_sched = sched;
  o.sm90_gchunk = gchunk;
  return o;
}
enum { V_BASE = 1, V_SCHED = 2, V_IV = 4, V_RAW = 8, V_CVT = 16 };
struct VariantSel {
  Variant v;
  int when; // the row's all_variants bits that run it (V_BASE: every row)
};
static const VariantSel kVariants[] = {
    {{"pp", variant_opts(0, 0, 0)}, V_BASE},
    {{"old", variant_opts(0, 16 | 32 | 64 | 256, 0)}, V_BASE},
    {{"ffma", variant_opts(0, 8, 0)}, V_SCHED},
    {{"old_q", variant_opts(0, 16, 0)}, V_SCHED},
    {{"old_iv", variant_opts(0, 32, 0)}, V_IV},
    {{"old_raw", variant_opts(0, 64, 0)}, V_RAW},
    {{"kvsplit", variant_opts(0, 128, 0)}, V_SCHED},
    {{"no_kvsplit", variant_opts(0, 256, 0)}, V_SCHED},
    {{"nopp", variant_opts(0, 1, 0)}, V_SCHED},
    {{"pp_serial", variant_opts(0, 2, 0)}, V_SCHED},
    {{"pp_nosoftmax", variant_opts(0, 4, 0)}, V_SCHED},
    {{"old_cvt", variant_opts(0, 512, 0)}, V_CVT},
    {{"nocvt", variant_opts(0, 1024, 0)}, V_CVT},
    {{"cvt_swz", variant_opts(0, 2048, 0)}, V_CVT},
    {{"cvt4", variant_opts(0, 4096, 0)}, V_CVT},
    {{"cvt_pf", variant_opts(0, 8192, 0)}, V_CVT},
    {{"cvt4_pf", variant_opts(0, 4096 | 8192, 0)}, V_CVT},
    {{"cvt4_swz", variant_opts(0, 4096 | 2048, 0)}, V_CVT},
    {{"cvt4_swz_pf", variant_opts(0, 4096 | 2048 | 8192, 0)}, V_CVT},
    {{"cvt3", variant_opts(0, 16384, 0)}, V_CVT},
#ifdef ATTND_SM90_BASE // another commit's kernels, built in (bench/prefill.cmake)
    {{"base", variant_opts(0, 1 << 20, 0)}, V_BASE},
#endif
    {{"tiled", variant_opts(1, 0, 0)}, V_BASE}};

// Whether the comma-separated list holds name exactly.
static bool name_listed(const char *list, const char *name) {
  const size_t n = strlen(name);
  for (const char *p = list; *p;) {
    const char *e = strchr(p, ',');
    const size_t l = e ? (size_t)(e - p) : strlen(p);
    if (l == n && strncmp(p, name, n) == 0)
      return true;
    p += l + (e ? 1 : 0);
  }
  return false;
}

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
  // ATTND_BENCH_VARIANTS (comma-separated names): exactly these variants on
  // every row, e.g. the opt-in kvsplit beside pp in a process of its own.
  const char *only = getenv("ATTND_BENCH_VARIANTS");
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
  // all_variants: which variants beyond pp, old and tiled (V_SCHED, V_IV, V_RAW, V_CVT).
  // causal_d256_bf16 also runs first and last of all rows (its pp only, as
  // _first and _last): 609.8 TFLOP/s in one H200 round, 536-541 in two
  // later ones with the same SASS; where in a process run it sits, and the
  // clock at that moment (the wall time ends each line), tell clocks from code.
  const Row rows[] = {
      {"causal_d256_bf16_first", ATTND_KV_BF16, 256, 4, S_, S_, ATTND_MASK_CAUSAL, 0, -1, 1},
      {"causal_d128_bf16", ATTND_KV_BF16, 128, 4, S_, S_, ATTND_MASK_CAUSAL, 0, V_SCHED, 1},
      {"causal_d64_bf16", ATTND_KV_BF16, 64, 4, S_, S_, ATTND_MASK_CAUSAL, 0, V_SCHED, 1},
      {"causal_d256_bf16", ATTND_KV_BF16, 256, 4, S_, S_, ATTND_MASK_CAUSAL, 0, V_SCHED, 1},
      {"document_d128_bf16", ATTND_KV_BF16, 128, 4, S_, S_, ATTND_MASK_INTERVALS, 0, V_SCHED | V_IV,
       1},
      {"sliding1024_d128_bf16", ATTND_KV_BF16, 128, 4, S_, S_, ATTND_MASK_SLIDING, 1024, V_SCHED,
       1},
      {"causal_d128_int8", ATTND_KV_INT8, 128, 4, S_, S_, ATTND_MASK_CAUSAL, 0, V_RAW | V_CVT, 0},
      {"causal_d128_fp8_dynamic", ATTND_KV_FP8_DYNAMIC, 128, 4, S_, S_, ATTND_MASK_CAUSAL, 0, V_CVT,
       0},
      {"append2048_over6144_bf16", ATTND_KV_BF16, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0, V_SCHED,
       1},
      {"append2048_over6144_fp16", ATTND_KV_FP16, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0, V_CVT,
       0},
      {"append2048_over6144_int8", ATTND_KV_INT8, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0,
       V_RAW | V_CVT, 0},
      {"append2048_over6144_fp8", ATTND_KV_FP8, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0,
       V_RAW | V_CVT, 0},
      {"append2048_over6144_int8_dynamic", ATTND_KV_INT8_DYNAMIC, 128, 4, 8192, 2048,
       ATTND_MASK_CAUSAL, 0, V_CVT, 1},
      {"append2048_over6144_fp8_dynamic", ATTND_KV_FP8_DYNAMIC, 128, 4, 8192, 2048,
       ATTND_MASK_CAUSAL, 0, V_CVT, 0},
      {"append2048_over6144_int4", ATTND_KV_INT4, 128, 4, 8192, 2048, ATTND_MASK_CAUSAL, 0,
       V_RAW | V_CVT, 0},
      {"small_1x512_over0", ATTND_KV_BF16, 128, 1, 512, 512, ATTND_MASK_CAUSAL, 0, V_SCHED, 1},
      {"small_1x512_over8192", ATTND_KV_BF16, 128, 1, 8704, 512, ATTND_MASK_CAUSAL, 0, V_SCHED, 1},
      {"small_64x64_over2048", ATTND_KV_BF16, 128, 64, 2112, 64, ATTND_MASK_CAUSAL, 0, V_SCHED, 1},
      {"causal_d256_bf16_last", ATTND_KV_BF16, 256, 4, S_, S_, ATTND_MASK_CAUSAL, 0, -1, 1},
  };
  printf("\n%-34s %-12s %9s %9s %6s %s\n", "prefill (32/8 heads, bs 64)", "variant", "ms",
         "TFLOP/s", "splits", "UTC");
  for (const Row &r : rows) {
    char nm[96];
    snprintf(nm, sizeof nm, "prefill_%s", r.name);
    if (!bench_wanted(nm) || (!r.main_row && !all_rows))
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
    // ATTND_BENCH_CHECK: each variant's output and lse, poisoned before one
    // more call, compared bit for bit with the first variant's (variants that
    // change only the schedule compute the same bits; NaN: an output unwritten).
    const bool check = getenv("ATTND_BENCH_CHECK") != nullptr;
    const size_t no = (size_t)S.b.total_q * S.s.q_heads * S.s.head_dim,
                 nl = (size_t)S.b.total_q * S.s.q_heads;
    std::vector<uint16_t> ref_o;
    std::vector<float> ref_l;
    for (const VariantSel &vs : kVariants) {
      const Variant &v = vs.v;
      if (r.all_variants < 0 ? strcmp(v.name, "pp") != 0
          : only             ? !name_listed(only, v.name)
                             : !(vs.when & (r.all_variants | V_BASE)))
        continue; // all_variants -1: pp only
      const float ms = median_ms(
          [&] { CKA(attnd_cuda_attend_opts(&S.s, &S.b, S.ws, S.ws_bytes, nullptr, &v.opts)); }, 2,
          iters);
      const double tf = flops / (ms * 1e-3) / 1e12;
      timespec now;
      clock_gettime(CLOCK_REALTIME, &now);
      const long sod = now.tv_sec % 86400;
      printf("%-34s %-12s %9.3f %9.1f %6d %02ld:%02ld:%02ld.%01ld\n", r.name, v.name, ms, tf,
             splits, sod / 3600, sod / 60 % 60, sod % 60, now.tv_nsec / 100000000);
      if (check) {
        CK(cudaMemset(S.b.out, 0xff, no * 2));
        CK(cudaMemset(S.b.lse, 0xff, nl * 4));
        CKA(attnd_cuda_attend_opts(&S.s, &S.b, S.ws, S.ws_bytes, nullptr, &v.opts));
        CK(cudaDeviceSynchronize());
        std::vector<uint16_t> o(no);
        std::vector<float> l(nl);
        CK(cudaMemcpy(o.data(), S.b.out, no * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(l.data(), S.b.lse, nl * 4, cudaMemcpyDeviceToHost));
        size_t nan = 0, nd = 0, ld = 0;
        for (size_t e = 0; e < no; e++) {
          nan += (o[e] & 0x7fffu) > 0x7f80u;
          nd += !ref_o.empty() && o[e] != ref_o[e];
        }
        for (size_t e = 0; e < nl && !ref_l.empty(); e++)
          ld += memcmp(&l[e], &ref_l[e], 4) != 0;
        printf("check %s %s: %zu NaN outputs of %zu; vs the first variant %zu outputs, %zu lse "
               "differ\n",
               r.name, v.name, nan, no, nd, ld);
        if (ref_o.empty()) {
          ref_o.swap(o);
          ref_l.swap(l);
        }
      }
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

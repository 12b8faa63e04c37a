#!/usr/bin/env bash
# gpu-prefill-wg3.sh: one GPU round of the Hopper prefill path's fourth
# warpgroup of finishing warps (8-bit and int4 caches at D <= 128, 512 threads;
# sm90_sched bit 14 = the 384-thread split's 96 finishing threads).
#
#   scripts/dev/gpu-prefill-wg3.sh build DIR   (build machine, with nvcc)
#       builds test_cuda_kernels, test_cuda_numerics and bench_prefill for
#       sm_90a (build-gpu/) and packs them as gpu-prefill5.sh does (the kernel
#       library as one shared object) into DIR/p5.tar.xz; copies this script
#       to DIR/run.sh.
#   bash DIR/run.sh                            (GPU machine)
#       each step under a timeout of at most what is left of WG3_SECONDS
#       (default 290), logs to $OUT:
#         1. test_cuda_kernels (every matrix) beside test_cuda_numerics
#            (pairwise)                                                  ~90 s
#         2. compute-sanitizer racecheck, then memcheck, over the prefill
#            matrix's pairwise cover                                     ~60 s
#         3. bench_prefill: the converted append and causal rows with pp,
#            cvt3 (bit 14) and nocvt; the bf16 rows (pp)                 ~30 s
#         4. bench/torch_reference.py (prefill, flex, append)            ~70 s
#       and prints a summary last (also $OUT/summary.txt).
set -u
here=$(cd "$(dirname "$0")" && pwd)

build() {
  set -e
  # gpu-prefill5.sh's build: the three executables beside the kernel library
  # as one shared object (what travels is at most 64 MiB), in DIR/p5.tar.xz.
  bash "$here/gpu-prefill5.sh" build "${1:?build DIR}"
  cp "$0" "$1/run.sh"
}

budget=${WG3_SECONDS:-290}
# shellcheck source=round-step.sh
. "$here/round-step.sh"

run() {
  local w
  round_unpack "$here/p5.tar.xz"
  env ATTND_GPU_TEST_PAIRWISE=1 ./test_cuda_numerics >"$out/numerics.log" 2>&1 &
  local npid=$!
  step test_cuda_kernels 110 test.log ./test_cuda_kernels
  wait "$npid"
  summary+=("$(printf '%-20s %-8s %5s  %s' test_cuda_numerics "rc=$?" - numerics.log)")
  step racecheck 70 racecheck.log env ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_prefill_matrix \
    compute-sanitizer --tool racecheck --error-exitcode 3 ./test_cuda_kernels
  step memcheck 60 memcheck.log env ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_prefill_matrix \
    compute-sanitizer --tool memcheck --error-exitcode 3 ./test_cuda_kernels
  step bench_cvt 40 prefill-cvt.log env -u OUT ATTND_BENCH_PREFILL=all ATTND_BENCH_VARIANTS=pp,cvt3,nocvt \
    ATTND_BENCH_FILTER=append2048_over6144_int8,append2048_over6144_fp8,append2048_over6144_int4,causal_d128_int8,causal_d128_fp8_dynamic,small \
    ./bench_prefill
  step bench_bf16 30 prefill-bf16.log env -u OUT ATTND_BENCH_PREFILL=all ATTND_BENCH_VARIANTS=pp \
    ATTND_BENCH_FILTER=bf16 ./bench_prefill
  step torch_reference 80 reference.log env OUT="$out" PYTHONUNBUFFERED=1 \
    ATTND_REF_SECTIONS=prefill,flex,append python3 torch_reference.py
  {
    echo "GPU: $(cat "$out/gpu.txt")"
    grep -E "FAIL|PASSED|rel L2 .* >|Hopper path vs|prefix hit|seed" "$out/test.log" | head -16
    grep -E "FAIL|PASSED|over 2x|A/B|worst ratio|seed" "$out/numerics.log" | head -8
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAIL" "$out/racecheck.log" "$out/memcheck.log" | head -8
    grep -E "^(causal|document|sliding|append|small|d64)" "$out/prefill-cvt.log" "$out/prefill-bf16.log" |
      sed 's/^[^:]*://' | awk '{printf "%s/%s %s ms %s TF; ", $1, $2, $3, $4} END {print ""}'
    grep -E "^(prefill_causal_sdpa_cudnn|flex_|append_)" "$out/reference.log" |
      sed 's/"B": 4, "S": 8192, "Hq": 32, "Hkv": 8, "D": 128, //' | tr '\n' ' '
    echo
    printf '%s\n' "${summary[@]}"
  } >"$out/summary.txt"
  cat "$out/summary.txt"
  rm -f "$out/gpu.txt"
  rm -rf "$w"
}

case "${1:-run}" in
build) build "${2:?build DIR}" ;;
*) run ;;
esac

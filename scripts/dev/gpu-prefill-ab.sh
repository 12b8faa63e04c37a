#!/usr/bin/env bash
# gpu-prefill-ab.sh: one GPU round of the Hopper prefill path's A/B, in two halves.
#
#   scripts/dev/gpu-prefill-ab.sh build DIR   (build machine, with nvcc)
#       builds test_cuda_kernels, test_cuda_numerics and bench_prefill for sm_90a
#       (scripts/dev/gpu-round.sh's recipe, build-gpu/), packs them with libcmocka,
#       bench/torch_reference.py and this script into DIR/ab.tar.xz and copies
#       this script to DIR/run.sh.
#   bash DIR/run.sh                           (GPU machine, from any directory)
#       unpacks into a temporary folder and runs, each step under a timeout of at
#       most what is left of AB_SECONDS (default 228), logs to $OUT (./gpu-out):
#         1. test_cuda_kernels (every matrix; the Hopper path as built, i.e. the
#            defaults, against the tiled kernel and the float64 reference)   ~75 s
#         2. test_cuda_numerics (all; AB_NUMERICS_PAIRWISE=1: the pairwise cover) ~60 s
#         3. bench_prefill, the 16-bit and dynamic rows, every variant (pp = the
#            new defaults, old = the previous round's path, one per change)   ~20 s
#         4. bench/torch_reference.py (prefill, flex, shapes, append)         ~70 s
#         5. bench_prefill, the rows over int8 / fp8 / int4 / fp16 caches     ~10 s
#         6. the opt-in forms (sched bits 3 and 7: FFMA scores, K/V split at
#            every head dim): the prefill matrix's pairwise cover with both
#            (ATTND_GPU_TEST_SM90_SCHED=136)                                   ~10 s
#            and bench_prefill's 16-bit rows, pp beside the variants that
#            change no arithmetic, outputs compared bit for bit               ~15 s
#       and prints a summary last (also $OUT/summary.txt): each step's result
#       and the rows of both tables side by side. $OUT keeps 8 files (at most 8
#       come back): the three test logs, bench_prefill's three logs,
#       reference.json, summary.txt.
set -u
here=$(cd "$(dirname "$0")" && pwd)

build() {
  set -e
  local dir=$1 root
  root=$(cd "$here/../.." && pwd)
  cmake -S "$root" -B "$root/build-gpu" -DPython3_EXECUTABLE=/usr/bin/python3 \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$root/build-gpu" -j2 --target test_cuda_kernels test_cuda_numerics bench_prefill
  local tmp f
  tmp=$(mktemp -d)
  for f in tests/test_cuda_kernels tests/test_cuda_numerics bench/bench_prefill; do
    cp "$root/build-gpu/$f" "$tmp/" && strip --strip-debug "$tmp/$(basename "$f")"
  done
  cp -a /usr/lib/x86_64-linux-gnu/libcmocka.so.0* "$tmp/"
  cp "$root/bench/torch_reference.py" "$tmp/"
  mkdir -p "$dir"
  tar -C "$tmp" -cf - . | xz -9 -T2 >"$dir/ab.tar.xz"
  rm -rf "$tmp"
  cp "$0" "$dir/run.sh"
  cp "$here/round-step.sh" "$dir/"
  echo "staged $dir/ab.tar.xz: $(($(stat -c %s "$dir/ab.tar.xz") / 1048576)) MiB"
}

budget=${AB_SECONDS:-228}
# shellcheck source=round-step.sh
. "$here/round-step.sh"

run() {
  local w
  round_unpack "$here/ab.tar.xz"
  step test_cuda_kernels 95 test.log ./test_cuda_kernels
  local pw=1
  [ "${AB_NUMERICS_PAIRWISE:-0}" = 1 ] || pw=0
  step test_cuda_numerics 70 numerics.log env ATTND_GPU_TEST_PAIRWISE=$pw ./test_cuda_numerics
  # bench_prefill writes $OUT/prefill.json when OUT is set (the GPU machine
  # sets it): unset, so that the files that come back stay 8.
  step bench_main 30 prefill-main.log env -u OUT ATTND_BENCH_PREFILL=all \
    ATTND_BENCH_FILTER=bf16,small,dynamic ./bench_prefill
  step torch_reference 80 reference.log env OUT="$out" PYTHONUNBUFFERED=1 \
    ATTND_REF_SECTIONS=prefill,flex,shapes,append python3 torch_reference.py
  step bench_quant 25 prefill-quant.log env -u OUT ATTND_BENCH_PREFILL=all \
    ATTND_BENCH_FILTER=d128_int8,6144_int8,6144_fp8,int4,fp16 ./bench_prefill
  # The opt-in forms last: the prefill matrix's pairwise cover with the FFMA
  # score form (sched bit 3) and the K/V split at every head dim (bit 7), then
  # the variants that change no arithmetic, their outputs compared bit for bit
  # with the default's (ATTND_BENCH_CHECK).
  step test_optin 30 test-optin.log env ATTND_GPU_TEST_SM90_SCHED=136 ATTND_GPU_TEST_PAIRWISE=1 \
    ATTND_GPU_TEST_ONLY=test_prefill_matrix ./test_cuda_kernels
  step bench_check 25 prefill-check.log env -u OUT ATTND_BENCH_PREFILL=all ATTND_BENCH_CHECK=1 \
    ATTND_BENCH_VARIANTS=pp,old_q,kvsplit,no_kvsplit ATTND_BENCH_FILTER=bf16,small ./bench_prefill
  {
    echo "GPU: $(cat "$out/gpu.txt")"
    grep -E "FAIL|PASSED|rel L2 .* >|Hopper path vs|prefix hit|^kv |seed" "$out/test.log" | head -16
    grep -E "FAIL|PASSED|over 2x|A/B|worst ratio|seed" "$out/numerics.log" | head -8
    grep -E "FAIL|PASSED|Hopper path vs|prefix hit|rel L2 .* >" "$out/test-optin.log" | sed 's/^/opt-in: /' | head -6
    grep -h "^check" "$out/prefill-check.log"
    grep -E "^(causal|document|sliding|append|small)" "$out/prefill-main.log" "$out/prefill-quant.log" \
      "$out/prefill-check.log" |
      sed 's/^[^:]*://' | awk '{printf "%s/%s %s ms %s TF; ", $1, $2, $3, $4} END {print ""}'
    grep -E "^(prefill_causal_sdpa_cudnn|prefill_causal_sdpa_flash|flex_|append_)" "$out/reference.log" |
      sed 's/"B": 4, "S": 8192, "Hq": 32, "Hkv": 8, "D": 128, //' | tr '\n' ' '
    echo
    printf '%s\n' "${summary[@]}"
  } >"$out/summary.txt"
  cat "$out/summary.txt"
  # At most 8 files come back from the GPU machine: the reference's rows are in
  # reference.json, the GPU's line in the summary.
  rm -f "$out/gpu.txt" "$out/reference.log"
  rm -rf "$w"
}

case "${1:-run}" in
build) build "${2:?build DIR}" ;;
*) run ;;
esac

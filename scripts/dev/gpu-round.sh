#!/usr/bin/env bash
# gpu-round.sh: one round of GPU work on the kernels, in two halves.
#
#   scripts/dev/gpu-round.sh build   (on the build machine, with nvcc)
#       builds the GPU tests and benchmarks for sm_90a with the CUDA runtime
#       linked statically into build-gpu/ and packs what the GPU machine needs
#       into build-gpu/stage/round.tar.xz (~18 MB; a round carries at most
#       64 MiB): test_cuda_kernels, test_cuda_numerics, test_cuda_scaleout, bench_kernels,
#       bench_prefill (host debug info stripped), libcmocka beside them,
#       bench/torch_reference.py and bench/summarize.py.
#   scripts/dev/gpu-round.sh run     (on the GPU machine, from the root of the
#       same checkout with build-gpu/stage/ copied there) runs, each step under
#       a timeout of at most what is left of ROUND_SECONDS (default 420):
#         1. test_cuda_kernels (every matrix: decode, mixed, prefill-shaped with
#            the Hopper path against the tiled kernel, long histories, the
#            per-layer variants: windows, soft-capping, sinks)           ~105 s
#         2. test_cuda_numerics (zero points, sinks, magnitudes, CPU ratio) ~60 s
#            test_cuda_scaleout (split-context parts merged by lse vs one
#            call, 1e-3; head shards' out and lse memcmp-equal to the whole) ~20 s
#         3. compute-sanitizer memcheck, pairwise test_cuda_kernels        ~40 s
#         4. compute-sanitizer racecheck, pairwise prefill matrix (the
#            Hopper path and, through the A/B, the tiled kernel; ROUND_RACECHECK_ONLY
#            names another test, e.g. test_matrix for the decode kernel)   ~50 s
#         5. bench_prefill, its main rows (ATTND_BENCH_PREFILL=all: every row) ~30 s
#         6. bench_kernels, the decode rows (B64 ctx4096, B8 ctx32768, every type;
#            sliding decode at 32k in windows of 4096 / 128 against full layers
#            at the window's length) and the soft-capped / windowed prefill rows ~50 s
#         7. bench/torch_reference.py, ATTND_REF_SECTIONS (default
#            copy,read,prefill,flex,decode,variants,shapes,append; sections are
#            dropped from the end when less than ~15 s each is left)      ~100 s
#       and prints a summary table last (also $OUT/summary.txt): each step's
#       result, seconds and key lines. Logs and JSON go to $OUT (default
#       ./gpu-out). A step that would start with less than 10 s left is
#       skipped and says so. The estimates come from the GPU rounds in
#       bench/RESULTS.md (tests under 240 s timeouts, racecheck cut at 16-20 s
#       over the whole pairwise suite, the benchmarks' row counts); the
#       summary prints the measured seconds, to correct them.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
stage=$here/build-gpu/stage

build() {
  set -e
  cmake -S "$here" -B "$here/build-gpu" -DPython3_EXECUTABLE=/usr/bin/python3 \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$here/build-gpu" -j2 --target test_cuda_kernels test_cuda_numerics test_cuda_scaleout \
    bench_kernels bench_prefill
  rm -rf "$stage" && mkdir -p "$stage"
  local tmp
  tmp=$(mktemp -d)
  local f
  for f in tests/test_cuda_kernels tests/test_cuda_numerics tests/test_cuda_scaleout bench/bench_kernels \
    bench/bench_prefill; do
    cp "$here/build-gpu/$f" "$tmp/" && strip --strip-debug "$tmp/$(basename "$f")"
  done
  cp -a /usr/lib/x86_64-linux-gnu/libcmocka.so.0* "$tmp/"
  cp "$here/bench/torch_reference.py" "$here/bench/summarize.py" "$tmp/"
  # The four binaries carry the same device code (compressed already by
  # -Xfatbin=-compress-all): xz's 64 MiB window stores it once (~18 MB in
  # all; gzip's 32 KB window left 67 MiB).
  tar -C "$tmp" -cf - . | xz -9 -T2 >"$stage/round.tar.xz"
  rm -rf "$tmp"
  local bytes
  bytes=$(stat -c %s "$stage/round.tar.xz")
  echo "staged $stage/round.tar.xz: $((bytes / 1048576)) MiB"
  if [ "$bytes" -ge $((64 * 1048576)) ]; then
    echo "over the 64 MiB a round may carry" >&2
    exit 1
  fi
}

# ---- run ----------------------------------------------------------------------
t0=0
budget=0
summary=()

left() { echo $((budget - ($(date +%s) - t0))); }

# step NAME EST CAP LOG CMD...: runs CMD with stdout+stderr to $out/LOG under
# a timeout of min(CAP, what is left); records rc and seconds for the summary.
step() {
  local name=$1 est=$2 cap=$3 log=$4
  shift 4
  local l
  l=$(left)
  if [ "$l" -lt 10 ]; then
    echo "== $name: skipped ($l s left)"
    summary+=("$(printf '%-22s %-8s %5s %5s  %s' "$name" skipped - "$est" "no time left")")
    return 0
  fi
  local lim=$cap
  [ "$lim" -gt "$l" ] && lim=$l
  echo "== $name (limit ${lim} s, estimate ${est} s)"
  local s
  s=$(date +%s)
  timeout -k 5 "$lim" "$@" >"$out/$log" 2>&1
  local rc=$?
  local took=$(($(date +%s) - s))
  local res=ok
  [ "$rc" -ne 0 ] && res="rc=$rc"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && res="timeout"
  [ "$rc" -eq 77 ] && res="no-gpu"
  echo "$name: $res in ${took} s" | tee -a "$out/$log"
  summary+=("$(printf '%-22s %-8s %5s %5s  %s' "$name" "$res" "$took" "$est" "$log")")
}

run() {
  out=${OUT:-$here/gpu-out}
  mkdir -p "$out"
  budget=${ROUND_SECONDS:-420}
  t0=$(date +%s)
  cd "$stage" || exit 1
  [ -f round.tar.xz ] && tar xJf round.tar.xz
  export LD_LIBRARY_PATH=$stage${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
    | tee "$out/gpu.txt"

  step test_cuda_kernels 105 210 test.log ./test_cuda_kernels
  grep -E "FAIL|rel L2 .* >|Hopper path vs|prefix hit|^kv |seed" "$out/test.log" | head -30
  step test_cuda_numerics 60 150 numerics.log ./test_cuda_numerics
  grep -E "FAIL|over 2x|A/B|^\[ *[A-Z]|^kv|^[a-z0-9_]+ +(bf16|fp16) " "$out/numerics.log" | head -30
  step test_cuda_scaleout 20 60 scaleout.log ./test_cuda_scaleout
  grep -E "FAIL|differ|^split context:" "$out/scaleout.log" | head -10
  step memcheck 40 120 memcheck.log env ATTND_GPU_TEST_PAIRWISE=1 \
    compute-sanitizer --tool memcheck --error-exitcode 3 ./test_cuda_kernels
  grep -E "ERROR SUMMARY|Invalid|FAIL" "$out/memcheck.log" | head -10
  step racecheck 50 120 racecheck.log env ATTND_GPU_TEST_PAIRWISE=1 \
    ATTND_GPU_TEST_ONLY="${ROUND_RACECHECK_ONLY:-test_prefill_matrix}" \
    compute-sanitizer --tool racecheck --error-exitcode 3 ./test_cuda_kernels
  grep -E "RACECHECK SUMMARY|hazard|FAIL" "$out/racecheck.log" | head -10
  if [ "${ATTND_ROUND_NO_BENCH:-0}" != 1 ]; then
    step bench_prefill 30 90 prefill.log env OUT="$out" ./bench_prefill
    step bench_kernels_decode 50 100 bench.log env OUT="$out" \
      ATTND_BENCH_FILTER=decode_B,softcap,window1024 ./bench_kernels
    # Sections dropped from the end while less than ~15 s each is left.
    local secs=${ATTND_REF_SECTIONS:-copy,read,prefill,flex,decode,variants,shapes,append}
    local n
    n=$(echo "$secs" | tr ',' '\n' | wc -l)
    while [ "$n" -gt 1 ] && [ "$(left)" -lt $((15 * n)) ]; do
      secs=${secs%,*}
      n=$((n - 1))
    done
    step torch_reference 100 240 reference.log env OUT="$out" PYTHONUNBUFFERED=1 \
      ATTND_REF_SECTIONS="$secs" python3 torch_reference.py
    if [ -f "$out/bench.json" ]; then
      local ref=()
      [ -f "$out/reference.json" ] && ref=("$out/reference.json")
      python3 summarize.py "$out/bench.json" "${ref[@]}" >"$out/decode-summary.txt" 2>&1
    fi
  fi

  {
    echo "ROUND SUMMARY ($(date -u +%FT%TZ), $(head -2 "$out/gpu.txt" | tail -1), budget ${budget} s, used $(($(date +%s) - t0)) s)"
    printf '%-22s %-8s %5s %5s  %s\n' step result s est log
    local r
    for r in "${summary[@]}"; do echo "$r"; done
    echo "-- test_cuda_kernels"
    grep -E "Hopper path vs tiled|prefix hit .* vs full|\[  PASSED|\[  FAILED|FAIL|> 1e-|rel L2 .* >" \
      "$out/test.log" 2>/dev/null | head -10
    echo "-- test_cuda_numerics"
    grep -E "A/B|worst ratio per|^[a-z0-9_]+ +(bf16|fp16) |\[  PASSED|\[  FAILED|FAIL|over 2x" "$out/numerics.log" 2>/dev/null | head -24
    echo "-- test_cuda_scaleout"
    grep -E "^split context:|differ|\[  PASSED|\[  FAILED" "$out/scaleout.log" 2>/dev/null | head -6
    echo "-- sanitizers"
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$out/memcheck.log" "$out/racecheck.log" 2>/dev/null
    # A sanitizer run can fail in the test itself (0 hazards, rc 1): say why
    # here, since the logs may not come back from the GPU machine.
    grep -hE "^seed |\[  ERROR|\[   LINE|\[  FAILED  \] [a-z]|rel L2 .* > " "$out/memcheck.log" "$out/racecheck.log" \
      2>/dev/null | head -8
    echo "-- bench_prefill (ms, TFLOP/s)"
    grep -E "^(causal|document|sliding|append|small)\S* +(pp|tiled) " "$out/prefill.log" 2>/dev/null
    echo "-- decode (bench_kernels, summarize.py)"
    head -12 "$out/decode-summary.txt" 2>/dev/null
    echo "-- per-layer variants (bench_kernels: sliding decode us / full layer at the window; prefill ms, TFLOP/s)"
    grep -E "_w(4096|128) |softcap50|window1024" "$out/bench.log" 2>/dev/null | head -8
    echo "-- PyTorch"
    grep -E "copy_bw|prefill_causal_sdpa|flex_doc|flex_sliding|flex_causal_softcap|decode_sliding|append|decode_bf16_cudnn_B(64|8)_" \
      "$out/reference.log" 2>/dev/null | head -20
  } | tee "$out/summary.txt"
}

case "${1:-run}" in
build) build ;;
run) run ;;
*)
  echo "usage: $0 build|run" >&2
  exit 2
  ;;
esac

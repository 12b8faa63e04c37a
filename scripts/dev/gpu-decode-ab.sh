#!/usr/bin/env bash
# gpu-decode-ab.sh: a decode kernel change against a base build in one GPU run.
#
#   scripts/dev/gpu-decode-ab.sh build DIR BASE   (build machine, with nvcc)
#       packs this checkout's build-gpu/ binaries (test_cuda_kernels,
#       test_cuda_numerics, test_cuda_scaleout, bench_kernels: the change, built
#       by gpu-round.sh build's recipe or with extra CMake options such as
#       -DATTND_DECODE_PAIR=ON) and BASE/bench_kernels (the same tree built
#       without the change, copied aside first) with libcmocka,
#       bench/torch_reference.py and bench/summarize.py into DIR
#       (round.tar.xz + run.sh).
#   bash DIR/run.sh                               (GPU machine) within AB_SECONDS
#       (default 400), each step under a timeout of at most what is left:
#         1. test_cuda_kernels one matrix per process (decode, mixed, long
#            history, variants, the fused step), test_cuda_numerics,
#            test_cuda_scaleout and memcheck over the pairwise decode matrix
#            and fused-step cases, side by side                        ~80 s
#         2. racecheck over the pairwise decode matrix and fused step  ~50 s
#         2b. the small-batch sequences (B1 / B8), change and base      ~20 s
#         3. the decode rows (B64 ctx4096, B8 ctx32768, every type), change
#            and base alternating, twice each                          ~120 s
#         4. the sweep rows (d64, d256, GQA 1/8/16, block 16/128) of the
#            converted types and d256 of bf16/fp16, change and base     ~40 s
#         5. GQA 16's diagnosis rows (ATTND_BENCH_SWEEP_DIAG: launch
#            variants, no-load / no-math; int8, fp8_dynamic, int4), change ~20 s
#         6. bench/torch_reference.py: copy, read, decode (cuDNN)     ~30 s
#         7. ncu: B64 int8, int4 and fp8_dynamic decode, change and base,
#            and GQA 16 int8 (change; with occupancy) (instructions, warp
#            states)                                                   ~70 s
#       then a summary ($OUT/summary.txt); logs in $OUT/logs.tar.xz.
set -u

build() {
  local dest=${1:?usage: gpu-decode-ab.sh build DIR BASE} base=${2:?usage: gpu-decode-ab.sh build DIR BASE}
  local here
  here=$(cd "$(dirname "$0")/../.." && pwd)
  set -e
  local tmp
  tmp=$(mktemp -d)
  local f
  for f in tests/test_cuda_kernels tests/test_cuda_numerics tests/test_cuda_scaleout bench/bench_kernels; do
    cp "$here/build-gpu/$f" "$tmp/" && strip --strip-debug "$tmp/$(basename "$f")"
  done
  cp "$base/bench_kernels" "$tmp/bench_kernels_base" && strip --strip-debug "$tmp/bench_kernels_base"
  cp -a /usr/lib/x86_64-linux-gnu/libcmocka.so.0* "$tmp/"
  cp "$here/bench/torch_reference.py" "$here/bench/summarize.py" "$tmp/"
  mkdir -p "$dest"
  # Each binary is ~35 MB, mostly compressed device code; xz's 64 MiB window
  # shares what two neighbours have in common (the base differs in the
  # decode objects only), so the binaries go in that order.
  (cd "$tmp" && tar -cf - bench_kernels_base bench_kernels test_cuda_kernels test_cuda_numerics \
    test_cuda_scaleout libcmocka.so.0* torch_reference.py summarize.py) | xz -9 -T1 >"$dest/round.tar.xz"
  rm -rf "$tmp"
  cp "$here/scripts/dev/gpu-decode-ab.sh" "$dest/run.sh"
  chmod +x "$dest/run.sh"
  du -sh "$dest"
}

run() {
  local here
  here=$(cd "$(dirname "$0")" && pwd)
  local dst=${OUT:-$here/out} out=$here/work
  mkdir -p "$out" "$dst"
  local budget=${AB_SECONDS:-400} t0
  t0=$(date +%s)
  left() { echo $((budget - ($(date +%s) - t0))); }
  lim() {
    local l
    l=$(left)
    [ "$l" -gt "$1" ] && l=$1
    [ "$l" -lt 1 ] && l=1
    echo "$l"
  }
  cd "$here" || exit 1
  tar xJf round.tar.xz
  export LD_LIBRARY_PATH=$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
  local s times=""
  s=$(date +%s)
  local t pids=() names=()
  for t in test_decode_matrix test_matrix test_long_history test_variants_matrix test_even_decode test_step_fused; do
    ATTND_GPU_TEST_ONLY=$t timeout -k 5 "$(lim 90)" ./test_cuda_kernels >"$out/test_$t.log" 2>&1 &
    pids+=($!)
    names+=("$t")
  done
  timeout -k 5 "$(lim 90)" ./test_cuda_numerics >"$out/numerics.log" 2>&1 &
  pids+=($!)
  names+=(numerics)
  timeout -k 5 "$(lim 90)" ./test_cuda_scaleout >"$out/scaleout.log" 2>&1 &
  pids+=($!)
  names+=(scaleout)
  ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_decode_matrix timeout -k 5 "$(lim 90)" \
    compute-sanitizer --tool memcheck --error-exitcode 3 ./test_cuda_kernels >"$out/memcheck.log" 2>&1 &
  pids+=($!)
  names+=(memcheck)
  ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_step_fused timeout -k 5 "$(lim 90)" \
    compute-sanitizer --tool memcheck --error-exitcode 3 ./test_cuda_kernels >"$out/memcheck_step.log" 2>&1 &
  pids+=($!)
  names+=(memcheck_step)
  local i rcs=""
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rcs="$rcs ${names[$i]}=$?"
  done
  times="$times tests=$(($(date +%s) - s))"
  s=$(date +%s)
  ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_decode_matrix timeout -k 5 "$(lim 60)" \
    compute-sanitizer --tool racecheck --error-exitcode 3 ./test_cuda_kernels >"$out/racecheck.log" 2>&1
  rcs="$rcs racecheck=$?"
  ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_step_fused timeout -k 5 "$(lim 40)" \
    compute-sanitizer --tool racecheck --error-exitcode 3 ./test_cuda_kernels >"$out/racecheck_step.log" 2>&1
  rcs="$rcs racecheck_step=$?"
  times="$times racecheck=$(($(date +%s) - s))"
  # The small-batch launch sequences (B1 / B8 at ctx 4096: write + attention
  # + merge, and the change's attnd_cuda_step columns), change and base.
  s=$(date +%s)
  local sm=small_B1_ctx4096_bf16,small_B8_ctx4096_bf16,small_B1_ctx4096_int8_dynamic,small_B1_ctx4096_int4
  sm=$sm,small_B8_ctx4096_fp8
  for b in change base; do
    local bin=./bench_kernels
    [ "$b" = base ] && bin=./bench_kernels_base
    mkdir -p "$out/small_$b"
    OUT=$out/small_$b ATTND_BENCH_FILTER=$sm timeout -k 5 "$(lim 40)" $bin >"$out/small_$b.log" 2>&1
  done
  times="$times small=$(($(date +%s) - s))"
  local rows=decode_B64_ctx4096_,decode_B8_ctx32768_ r b
  s=$(date +%s)
  for r in 1 2; do
    for b in change base; do
      local bin=./bench_kernels
      [ "$b" = base ] && bin=./bench_kernels_base
      mkdir -p "$out/$b$r"
      OUT=$out/$b$r ATTND_BENCH_FILTER=$rows timeout -k 5 "$(lim 45)" $bin >"$out/bench_$b$r.log" 2>&1
    done
  done
  times="$times rows=$(($(date +%s) - s))"
  s=$(date +%s)
  local sw=
  for t in d64 d256 gqa1 gqa8 gqa16 bs16 bs128; do
    for kv in int8 fp8 int8_dynamic fp8_dynamic int4; do
      sw="$sw${sw:+,}sweep_B64_ctx4096_${t}_$kv"
    done
  done
  # The 16-bit types' longest score chain (one in-order chain, 16 steps at d256).
  sw="$sw,sweep_B64_ctx4096_d256_bf16,sweep_B64_ctx4096_d256_fp16"
  for b in change base; do
    local bin=./bench_kernels
    [ "$b" = base ] && bin=./bench_kernels_base
    mkdir -p "$out/sweep_$b"
    OUT=$out/sweep_$b ATTND_BENCH_FILTER="$sw" timeout -k 5 "$(lim 40)" $bin >"$out/sweep_$b.log" 2>&1
  done
  times="$times sweep=$(($(date +%s) - s))"
  # GQA 16 (the rows form), change build only: the decode rows' launch
  # variants and no-load / no-math times on its shape (bench/README.md).
  s=$(date +%s)
  OUT=$out ATTND_BENCH_SWEEP_DIAG=1 \
    ATTND_BENCH_FILTER=sweep_B64_ctx4096_gqa16_int8,sweep_B64_ctx4096_gqa16_fp8_dynamic,sweep_B64_ctx4096_gqa16_int4 \
    timeout -k 5 "$(lim 40)" ./bench_kernels >"$out/gqa16_diag.log" 2>&1
  times="$times gqa16_diag=$(($(date +%s) - s))"
  s=$(date +%s)
  OUT=$out PYTHONUNBUFFERED=1 ATTND_REF_SECTIONS=copy,read,decode \
    timeout -k 5 "$(lim 45)" python3 torch_reference.py >"$out/reference.log" 2>&1
  times="$times torch=$(($(date +%s) - s))"
  s=$(date +%s)
  local m=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
  m=$m,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active
  {
    for kv in int8 int4 fp8_dynamic; do
      for b in change base; do
        local bin=./bench_kernels
        [ "$b" = base ] && bin=./bench_kernels_base
        echo "== $b B64 $kv decode"
        ATTND_BENCH_FILTER=decode_B64_ctx4096_$kv timeout -k 5 "$(lim 20)" \
          ncu --clock-control none --metrics "$m" --section WarpStateStats \
          -k 'regex:decode_kernel' --launch-count 1 $bin
      done
    done
    echo "== change B64 gqa16 int8 decode"
    ATTND_BENCH_FILTER=sweep_B64_ctx4096_gqa16_int8 timeout -k 5 "$(lim 20)" \
      ncu --clock-control none --metrics "$m" --section WarpStateStats --section Occupancy \
      -k 'regex:decode_kernel' --launch-count 1 ./bench_kernels
  } >"$out/ncu.log" 2>&1
  times="$times ncu=$(($(date +%s) - s))"
  {
    echo "DECODE A/B ($(date -u +%FT%TZ), $(tail -1 "$out/gpu.txt"), used $(($(date +%s) - t0)) s of $budget)"
    echo "rc:$rcs; seconds:$times"
    grep -E "\[  PASSED|\[  FAILED|FAIL|prefix hit .* vs full|worst ratio per|^split context:|> 1e-|rel L2 .* >|^seed" \
      "$out"/test_test_*.log "$out/numerics.log" "$out/scaleout.log" 2>/dev/null | sed "s#$out/##" | head -40
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|fused step vs|attnd_cuda_step:" "$out/memcheck.log" "$out/racecheck.log" \
      "$out/memcheck_step.log" "$out/racecheck_step.log" "$out/test_test_step_fused.log" "$out/test_test_decode_matrix.log"
    for b in change base; do
      echo "-- small, $b"
      grep -E "^small_" "$out/small_$b.log" | sed 's/  */ /g'
    done
    for r in 1 2; do
      for b in change base; do
        echo "-- $b, run $r"
        grep -E "^read_bw [0-9]+ GB/s" "$out/bench_$b$r.log"
        grep -E "^decode_B" "$out/bench_$b$r.log" | grep -v _w | awk '{printf "%s %s %s %s\n", $1, $2, $3, $4}'
      done
    done
    for b in change base; do
      echo "-- sweep, $b"
      grep -E "^sweep_" "$out/sweep_$b.log" | awk '{printf "%s %s %s %s\n", $1, $2, $3, $4}'
    done
    echo "-- gqa16 diagnosis (change)"
    grep -E "_diag|no-load|no-math" "$out/gqa16_diag.log" | sed 's/  */ /g' | head -20
    grep -E "decode_bf16_cudnn|read_bw|copy_bw" "$out/reference.log" | head -8
    grep -E "^== |gpu__time_duration|dram__throughput|inst_executed|issue_active|warps_active|Warp Cycles Per Issued|Stall" \
      "$out/ncu.log" | head -80
  } | tee "$out/summary.txt"
  cp "$out/summary.txt" "$dst/"
  tar -C "$out" -cJf "$dst/logs.tar.xz" .
}

case "${1:-}" in
build)
  shift
  build "$@"
  ;;
run | "") run ;;
*)
  echo "usage: $0 build DIR BASE | run" >&2
  exit 2
  ;;
esac

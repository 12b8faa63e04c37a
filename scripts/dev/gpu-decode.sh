#!/usr/bin/env bash
# gpu-decode.sh: one GPU round of the decode kernel's work (load path, split
# planning, small batches), in two halves like gpu-round.sh.
#
#   scripts/dev/gpu-decode.sh build DIR   (build machine, with nvcc)
#       builds test_cuda_kernels, test_cuda_numerics, test_cuda_scaleout,
#       bench_kernels and bench_loads in build-gpu/ (sm_90a, static CUDA
#       runtime: gpu-round.sh build's recipe) and packs them with libcmocka,
#       bench/torch_reference.py, bench/summarize.py and this script into DIR
#       (round.tar.xz + run.sh).
#   DIR/run.sh                           (GPU machine) runs, each step under a
#       timeout of at most what is left of DECODE_SECONDS (default 225):
#         1. test_cuda_kernels (one process per matrix), test_cuda_numerics
#            and test_cuda_scaleout side by side, with compute-sanitizer
#            memcheck over the pairwise decode matrix (correctness only; ~60 s)
#         2. bench_loads: the load mechanisms on the paged layout        ~5 s
#         3. bench_kernels' decode rows, B64 ctx4096 and B8 ctx32768, every
#            type, with the launch-option columns in the same rows (per-item
#            split, alt copy, alt lookahead, pfown, cluster)          ~40 s;
#            DECODE_BASE_BENCH's build (if packed): its B64 rows      ~12 s
#         4. bench/torch_reference.py: copy, read, decode, b1        ~30 s
#         5. bench_kernels' small-batch rows (B1 / B8 at ctx 4096)    ~20 s
#         6. ncu: the B64 int8_dynamic and fp8_dynamic decode in both P V
#            forms (debug 0 / 32768: instructions, DRAM, warp states); the B1
#            bf16 write kernel's warp states and source counters      ~45 s
#         7. bench_kernels' uneven rows, with what is left            ~15 s
#       and prints a summary last; logs and JSON go to $OUT/logs.tar.xz.
#   DIR/run.sh quick                     (GPU machine) the load-path A/B alone,
#       within DECODE_SECONDS (default 90): test_cuda_kernels' decode matrix
#       beside compute-sanitizer memcheck over its pairwise form (~50 s),
#       bench_loads (every mechanism, the kcopy rows in three cuts) (~5 s),
#       bench_kernels' B64 ctx4096 / B8 ctx32768 decode rows (~5 s); a
#       summary last, logs in $OUT/logs.tar.xz.
set -u

build() {
  local dest=${1:?usage: gpu-decode.sh build DIR}
  local here
  here=$(cd "$(dirname "$0")/../.." && pwd)
  set -e
  cmake -S "$here" -B "$here/build-gpu" -DPython3_EXECUTABLE=/usr/bin/python3 \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$here/build-gpu" -j2 --target test_cuda_kernels test_cuda_numerics test_cuda_scaleout \
    bench_kernels bench_loads
  local tmp
  tmp=$(mktemp -d)
  local f
  for f in tests/test_cuda_kernels tests/test_cuda_numerics tests/test_cuda_scaleout bench/bench_kernels \
    bench/bench_loads; do
    cp "$here/build-gpu/$f" "$tmp/" && strip --strip-debug "$tmp/$(basename "$f")"
  done
  # DECODE_BASE_BENCH: another build's bench_kernels (e.g. main's), timed in the
  # same run as bench_kernels_base (its default path against this one's).
  if [ -n "${DECODE_BASE_BENCH:-}" ]; then
    cp "$DECODE_BASE_BENCH" "$tmp/bench_kernels_base" && strip --strip-debug "$tmp/bench_kernels_base"
  fi
  cp -a /usr/lib/x86_64-linux-gnu/libcmocka.so.0* "$tmp/"
  cp "$here/bench/torch_reference.py" "$here/bench/summarize.py" "$tmp/"
  mkdir -p "$dest"
  tar -C "$tmp" -cf - . | xz -9 -T2 >"$dest/round.tar.xz"
  rm -rf "$tmp"
  cp "$here/scripts/dev/gpu-decode.sh" "$dest/run.sh"
  chmod +x "$dest/run.sh"
  du -sh "$dest"
}

run() {
  local here
  here=$(cd "$(dirname "$0")" && pwd)
  # Everything is written to $here/work and packed into $OUT/logs.tar.xz at
  # the end (a round hands back at most 8 files); the summary also to $OUT.
  local dst=${OUT:-$here/out} out=$here/work
  mkdir -p "$out" "$dst"
  local budget=${DECODE_SECONDS:-225} t0
  t0=$(date +%s)
  left() { echo $((budget - ($(date +%s) - t0))); }
  # lim CAP: the smaller of CAP and what is left (at least 1)
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
  local s
  s=$(date +%s)
  # test_cuda_kernels one matrix per process (ATTND_GPU_TEST_ONLY), all side by
  # side with the other two (a process whose matrix has no prefix hit fails
  # test_report's count of them: read the matrices' own results).
  local t pids=() names=()
  for t in test_decode_matrix test_matrix test_prefill_matrix test_long_history test_variants_matrix; do
    ATTND_GPU_TEST_ONLY=$t timeout -k 5 "$(lim 80)" ./test_cuda_kernels >"$out/test_$t.log" 2>&1 &
    pids+=($!)
    names+=("$t")
  done
  timeout -k 5 "$(lim 80)" ./test_cuda_numerics >"$out/numerics.log" 2>&1 &
  pids+=($!)
  names+=(numerics)
  timeout -k 5 "$(lim 80)" ./test_cuda_scaleout >"$out/scaleout.log" 2>&1 &
  pids+=($!)
  names+=(scaleout)
  ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_decode_matrix timeout -k 5 "$(lim 80)" \
    compute-sanitizer --tool memcheck --error-exitcode 3 ./test_cuda_kernels >"$out/memcheck.log" 2>&1 &
  pids+=($!)
  names+=(memcheck)
  local i rcs=""
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rcs="$rcs ${names[$i]}=$?"
  done
  cat "$out"/test_test_*.log >"$out/test.log"
  local ts=$(($(date +%s) - s))
  # Benchmarks, one process each (a step that runs out of time loses only itself).
  mkdir -p "$out/main" "$out/small" "$out/uneven"
  s=$(date +%s)
  timeout -k 5 "$(lim 30)" ./bench_loads "$out/loads.json" >"$out/loads.log" 2>&1
  local rl=$? tl=$(($(date +%s) - s))
  s=$(date +%s)
  OUT=$out/main ATTND_BENCH_FILTER=decode_B64_ctx4096_,decode_B8_ctx32768_ \
    timeout -k 5 "$(lim 70)" ./bench_kernels >"$out/bench_main.log" 2>&1
  local rb1=$? tb1=$(($(date +%s) - s))
  s=$(date +%s)
  if [ -x bench_kernels_base ]; then
    mkdir -p "$out/base"
    OUT=$out/base ATTND_BENCH_FILTER=decode_B64_ctx4096_ timeout -k 5 "$(lim 25)" ./bench_kernels_base \
      >"$out/bench_base.log" 2>&1
  fi
  local tb0=$(($(date +%s) - s))
  s=$(date +%s)
  OUT=$out PYTHONUNBUFFERED=1 ATTND_REF_SECTIONS=copy,read,decode,b1 \
    timeout -k 5 "$(lim 45)" python3 torch_reference.py >"$out/reference.log" 2>&1
  local rr=$? tr=$(($(date +%s) - s))
  s=$(date +%s)
  OUT=$out/small ATTND_BENCH_FILTER=small_ timeout -k 5 "$(lim 30)" ./bench_kernels >"$out/bench_small.log" 2>&1
  local rb2=$? tb2=$(($(date +%s) - s))
  s=$(date +%s)
  local m=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  m=$m,lts__t_sector_hit_rate.pct,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active
  {
    # The dynamic types' two P V forms (debug 32768: fp16 under bf16
    # activations, Dec::kPv16): instructions issued and warp states.
    local kvd dbg
    for kvd in int8_dynamic fp8_dynamic; do
      for dbg in 0 32768; do
        echo "== B64 $kvd decode, debug $dbg"
        ATTND_BENCH_DEC_DEBUG=$dbg ATTND_BENCH_FILTER=decode_B64_ctx4096_$kvd timeout -k 5 "$(lim 20)" \
          ncu --clock-control none --metrics "$m,smsp__inst_executed.sum" --section WarpStateStats \
          -k 'regex:decode_kernel' --launch-count 1 ./bench_kernels
      done
    done
    echo "== B1 bf16 sequence: write kernel (warp states, source counters)"
    ATTND_BENCH_FILTER=small_B1_ctx4096_bf16 ATTND_BENCH_SMALL_ALONE=1 timeout -k 5 "$(lim 20)" \
      ncu --clock-control none --metrics "$m" --section WarpStateStats --section LaunchStats \
      --section SourceCounters -k 'regex:write_kernel' --launch-skip 60 --launch-count 1 ./bench_kernels
  } >"$out/ncu.log" 2>&1
  local tn=$(($(date +%s) - s))
  s=$(date +%s)
  OUT=$out/uneven ATTND_BENCH_FILTER=uneven_ timeout -k 5 "$(lim 30)" ./bench_kernels >"$out/bench_uneven.log" 2>&1
  local rb3=$? tb3=$(($(date +%s) - s))
  [ -f "$out/main/bench.json" ] && python3 summarize.py "$out/main/bench.json" \
    $([ -f "$out/reference.json" ] && echo "$out/reference.json") >"$out/decode-summary.txt" 2>&1
  {
    echo "DECODE ROUND ($(date -u +%FT%TZ), $(tail -1 "$out/gpu.txt"), used $(($(date +%s) - t0)) s of $budget)"
    echo "tests ${ts} s:$rcs; loads rc=$rl ${tl} s, bench main rc=$rb1 ${tb1} s," \
      "base ${tb0} s, small rc=$rb2 ${tb2} s, torch rc=$rr ${tr} s, uneven rc=$rb3 ${tb3} s, ncu ${tn} s"
    grep -E "\[  PASSED|\[  FAILED|FAIL|prefix hit .* vs full|worst ratio per|^split context:|> 1e-|rel L2 .* >" \
      "$out"/test_test_*.log "$out/numerics.log" "$out/scaleout.log" 2>/dev/null | sed "s#$out/##" | head -40
    grep -E "ERROR SUMMARY" "$out/memcheck.log"
    sed -n '/^read roof/p;/^best per/,$p' "$out/loads.log"
    grep -c MISMATCH "$out/loads.log"
    grep -E "^read_bw [0-9]+ GB/s" "$out/bench_main.log"
    grep -E "^decode_B" "$out/bench_main.log" | grep -v _w | sed -E 's/ +/ /g' | cut -c1-520
    grep -E "no-load" "$out/bench_main.log"
    grep -E "^decode_B" "$out/bench_base.log" 2>/dev/null | awk '{printf "base %s %s %s | item %s\n", $1, $2, $4, $9}'
    grep -E "^kcopy" "$out/loads.log"
    grep -E "^small_" "$out/bench_small.log" | awk '{printf "%s %s %s %s\n", $1, $2, $3, $4}' | head -60
    grep -E "^uneven_" "$out/bench_uneven.log"
    grep -E "decode_bf16_cudnn|b1|read_bw|copy_bw" "$out/reference.log" | head -8
    grep -E "^== |write_kernel|decode_kernel|k_kcopy|gpu__time_duration|dram__throughput|lts__t_sector_hit|dram__bytes_read|sm__warps_active|inst_executed|Stall|Warp Cycles|Achieved|Registers" \
      "$out/ncu.log" | head -60
  } | tee "$out/summary.txt"
  cp "$out/summary.txt" "$dst/"
  tar -C "$out" -cJf "$dst/logs.tar.xz" .
}

quick() {
  local here
  here=$(cd "$(dirname "$0")" && pwd)
  local dst=${OUT:-$here/out} out=$here/work
  mkdir -p "$out" "$dst"
  local budget=${DECODE_SECONDS:-90} t0
  t0=$(date +%s)
  lim() {
    local l=$((budget - ($(date +%s) - t0)))
    [ "$l" -gt "$1" ] && l=$1
    [ "$l" -lt 1 ] && l=1
    echo "$l"
  }
  cd "$here" || exit 1
  tar xJf round.tar.xz
  export LD_LIBRARY_PATH=$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
  local s
  s=$(date +%s)
  ATTND_GPU_TEST_ONLY=test_decode_matrix timeout -k 5 "$(lim 55)" ./test_cuda_kernels \
    >"$out/test_test_decode_matrix.log" 2>&1 &
  local p1=$!
  ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_decode_matrix timeout -k 5 "$(lim 55)" \
    compute-sanitizer --tool memcheck --error-exitcode 3 ./test_cuda_kernels >"$out/memcheck.log" 2>&1 &
  local p2=$!
  wait $p1
  local rt=$?
  wait $p2
  local rm=$? ts=$(($(date +%s) - s))
  mkdir -p "$out/main"
  s=$(date +%s)
  timeout -k 5 "$(lim 20)" ./bench_loads "$out/loads.json" >"$out/loads.log" 2>&1
  local rl=$? tl=$(($(date +%s) - s))
  s=$(date +%s)
  OUT=$out/main ATTND_BENCH_FILTER=decode_B64_ctx4096_,decode_B8_ctx32768_ \
    timeout -k 5 "$(lim 30)" ./bench_kernels >"$out/bench_main.log" 2>&1
  local rb=$? tb=$(($(date +%s) - s))
  {
    echo "DECODE QUICK ($(date -u +%FT%TZ), $(tail -1 "$out/gpu.txt"), used $(($(date +%s) - t0)) s of $budget)"
    echo "tests ${ts} s: test_decode_matrix=$rt memcheck=$rm; loads rc=$rl ${tl} s, bench main rc=$rb ${tb} s"
    grep -E "\[  PASSED|\[  FAILED|FAIL|> 1e-|rel L2 .* >" "$out/test_test_decode_matrix.log" | head -20
    grep -E "ERROR SUMMARY" "$out/memcheck.log"
    sed -n '/^read roof/p;/^best per/,$p' "$out/loads.log"
    grep -c MISMATCH "$out/loads.log"
    grep -E "^kcopy" "$out/loads.log"
    grep -E "^read_bw [0-9]+ GB/s" "$out/bench_main.log"
    grep -E "^decode_B|no-load" "$out/bench_main.log" | grep -v _w | sed -E 's/ +/ /g' | cut -c1-420
  } | tee "$out/summary.txt"
  cp "$out/summary.txt" "$dst/"
  tar -C "$out" -cJf "$dst/logs.tar.xz" .
}

case "${1:-run}" in
build) build "${2:-}" ;;
run) run ;;
quick) quick ;;
*)
  echo "usage: $0 build DIR | run | quick" >&2
  exit 2
  ;;
esac

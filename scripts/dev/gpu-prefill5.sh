#!/usr/bin/env bash
# gpu-prefill5.sh: one GPU round of the Hopper prefill path: the converted
# cache types' finishing warps (sched bits 11-13 beside the defaults) and the
# d256 row's drop (the row first and last in one process, the GPU's clocks
# sampled through the run).
#
#   scripts/dev/gpu-prefill5.sh build DIR [BASE_A]      (build machine, with nvcc)
#       builds test_cuda_kernels, test_cuda_numerics and bench_prefill for sm_90a
#       (build-gpu/), relinks them against the kernel library as one shared
#       object and packs them with it, libcudart, libcmocka,
#       bench/torch_reference.py and, given BASE_A (a libattnd_kernels_cuda.a
#       of the commit to compare against), bench_prefill linked statically
#       with it as bench_prefill_base, into DIR/p5.tar.xz; copies this script
#       to DIR/run.sh.
#   bash DIR/run.sh                                    (GPU machine)
#       unpacks into a temporary folder and runs, each step under a timeout of
#       at most what is left of P5_SECONDS (default 225), logs to $OUT, the
#       GPU's SM clock, power, temperature and throttle reasons sampled every
#       250 ms into $OUT/clocks.csv (bench_prefill ends each line with its UTC):
#         1. test_cuda_kernels' prefill and variants matrices, test_cuda_numerics
#            (pairwise) and compute-sanitizer racecheck over the prefill
#            matrix's pairwise cover with sched bits 11-13 side by side
#         2. the prefill matrix's pairwise cover with bits 12 + 13, then 11-13
#         3. bench_prefill_base's main rows and converted rows (pp)
#         4. bench_prefill, every row (d256 first and last): pp, old_cvt,
#            nocvt, cvt_swz, cvt4, cvt_pf, cvt4_pf, cvt4_swz, cvt4_swz_pf
#         5. bench/torch_reference.py (prefill, flex, shapes, append)
#         6. ncu, one launch of the append over int8_dynamic with bits 11-13
#       and prints a summary last (also $OUT/summary.txt).
set -u
here=$(cd "$(dirname "$0")" && pwd)

build() {
  set -e
  local dir=$1 base=${2:-} root b tmp f libs
  root=$(cd "$here/../.." && pwd)
  b=$root/build-gpu
  cmake -S "$root" -B "$b" -DPython3_EXECUTABLE=/usr/bin/python3 \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$b" -j2 --target test_cuda_kernels test_cuda_numerics bench_prefill
  # Each executable holds the whole CUDA kernel library (~31 MiB compressed),
  # and what travels to the GPU machine is at most 64 MiB: the library once,
  # as a shared object beside the three executables (relinked from the
  # build's objects, with the shared CUDA runtime, which a static runtime in
  # each module would duplicate), RUNPATH $ORIGIN.
  tmp=$(mktemp -d)
  cp /usr/local/cuda/lib64/libcudart.so.13 "$tmp/"
  g++ -shared -Wl,-soname,libattnd_p5.so -o "$tmp/libattnd_p5.so" \
    -Wl,--whole-archive "$b/kernels/cuda/libattnd_kernels_cuda.a" -Wl,--no-whole-archive \
    -Wl,-rpath,'$ORIGIN' -L"$tmp" -l:libcudart.so.13 -L/usr/local/cuda/targets/x86_64-linux/lib \
    -lcudadevrt -lrt -lpthread -ldl -lm
  libs="-Wl,-rpath,\$ORIGIN -L$tmp -lattnd_p5 -l:libcudart.so.13"
  # shellcheck disable=SC2046,SC2086 # the object lists and flags split on purpose
  (cd "$b/tests" &&
    g++ $(cat CMakeFiles/test_cuda_kernels.dir/objects1) -o "$tmp/test_cuda_kernels" \
      libattnd_oracle.a $libs /usr/lib/x86_64-linux-gnu/libcmocka.so ../kernels/libattnd_kernels_cpu.a \
      -lm -ldl -lrt -lpthread &&
    g++ $(cat CMakeFiles/test_cuda_numerics.dir/objects1) -o "$tmp/test_cuda_numerics" \
      $(sed 's/"//g; s|../kernels/cuda/libattnd_kernels_cuda.a||; s|[^ ]*libcudart_static.a||;
             s/-lcudart_static//; s/-lcudadevrt//; s/-Wl,-rpath,[^ ]*//' \
        CMakeFiles/test_cuda_numerics.dir/linkLibs.rsp) $libs)
  # shellcheck disable=SC2046,SC2086
  (cd "$b/bench" &&
    g++ $(cat CMakeFiles/bench_prefill.dir/objects1) -o "$tmp/bench_prefill" $libs \
      ../kernels/libattnd_kernels_cpu.a -lm -ldl -lrt -lpthread)
  strip --strip-unneeded "$tmp/libattnd_p5.so"
  strip --strip-all "$tmp/test_cuda_kernels" "$tmp/test_cuda_numerics" "$tmp/bench_prefill"
  if [ -n "$base" ]; then
    # shellcheck disable=SC2046,SC2086
    (cd "$b/bench" &&
      g++ -Wl,-z,now $(cat CMakeFiles/bench_prefill.dir/objects1) -o "$tmp/bench_prefill_base" \
        $(sed "s/\"//g; s|../kernels/cuda/libattnd_kernels_cuda.a|$base|" CMakeFiles/bench_prefill.dir/linkLibs.rsp) \
        -L/usr/local/cuda/targets/x86_64-linux/lib/stubs -L/usr/local/cuda/targets/x86_64-linux/lib)
    strip --strip-all "$tmp/bench_prefill_base"
  fi
  cp -a /usr/lib/x86_64-linux-gnu/libcmocka.so.0* "$tmp/"
  cp "$root/bench/torch_reference.py" "$tmp/"
  mkdir -p "$dir"
  tar -C "$tmp" -cf - . | xz -9e -T2 >"$dir/p5.tar.xz" # with the work tree: under 64 MiB
  rm -rf "$tmp"
  cp "$0" "$dir/run.sh"
  cp "$here/round-step.sh" "$dir/"
  echo "staged $dir/p5.tar.xz: $(($(stat -c %s "$dir/p5.tar.xz") / 1048576)) MiB"
}

budget=${P5_SECONDS:-225}
# shellcheck source=round-step.sh
. "$here/round-step.sh"

run() {
  local w ncu cp
  round_unpack "$here/p5.tar.xz"
  local gpu
  gpu=$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv,noheader 2>&1)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader -lms 250 >"$out/clocks.csv" 2>&1 &
  cp=$!
  # 1. correctness, side by side (no timing in them)
  step test_cuda_numerics 80 numerics.log env ATTND_GPU_TEST_PAIRWISE=1 ./test_cuda_numerics &
  local np=$!
  local sani
  sani=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$sani" ]; then
    step racecheck 80 racecheck.log env ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_prefill_matrix \
      ATTND_GPU_TEST_SM90_SCHED=14336 "$sani" --tool racecheck --error-exitcode 3 ./test_cuda_kernels &
  fi
  local rp=$!
  step test_prefill 60 test.log env ATTND_GPU_TEST_ONLY=test_prefill_matrix ./test_cuda_kernels
  step test_variants 40 test-variants.log env ATTND_GPU_TEST_ONLY=test_variants ./test_cuda_kernels
  wait $np $rp
  local f
  for f in numerics racecheck; do
    [ -f "$out/$f.log" ] || continue
    summary+=("$(printf '%-20s %-8s %5s  %s' "$f" "$(grep -q PASSED "$out/$f.log" && ! grep -q FAILED "$out/$f.log" && echo ok || echo check)" - "$f.log")")
  done
  # 2. the opt-in bits through the prefill matrix's pairwise cover
  step test_optin 20 test-optin.log env ATTND_GPU_TEST_SM90_SCHED=12288 ATTND_GPU_TEST_PAIRWISE=1 \
    ATTND_GPU_TEST_ONLY=test_prefill_matrix ./test_cuda_kernels
  step test_optin2 20 test-optin2.log env ATTND_GPU_TEST_SM90_SCHED=14336 ATTND_GPU_TEST_PAIRWISE=1 \
    ATTND_GPU_TEST_ONLY=test_prefill_matrix ./test_cuda_kernels
  cat "$out/test-variants.log" "$out/test-optin.log" "$out/test-optin2.log" >>"$out/test.log" 2>/dev/null
  rm -f "$out/test-variants.log" "$out/test-optin.log" "$out/test-optin2.log"
  # 3., 4. bench_prefill writes $OUT/prefill.json when OUT is set: unset
  if [ -x ./bench_prefill_base ]; then
    step bench_base 25 prefill-base.log env -u OUT ATTND_BENCH_PREFILL=all ATTND_BENCH_VARIANTS=pp \
      ATTND_BENCH_FILTER=d256,causal_d128_bf16,append,small ./bench_prefill_base
  fi
  step bench_new 50 prefill-new.log env -u OUT ATTND_BENCH_PREFILL=all \
    ATTND_BENCH_VARIANTS=pp,old_cvt,nocvt,cvt_swz,cvt4,cvt_pf,cvt4_pf,cvt4_swz,cvt4_swz_pf ./bench_prefill
  step torch_reference 60 reference.log env OUT="$out" PYTHONUNBUFFERED=1 \
    ATTND_REF_SECTIONS=prefill,flex,shapes,append python3 torch_reference.py
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  if [ -n "$ncu" ]; then
    step ncu 30 ncu.txt env -u OUT "$ncu" --clock-control none --kernel-name regex:prefill_sm90 \
      --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
      env ATTND_BENCH_PREFILL=all ATTND_BENCH_FILTER=6144_int8_dynamic ATTND_BENCH_VARIANTS=cvt4_swz_pf ./bench_prefill
  fi
  kill "$cp" 2>/dev/null
  {
    echo "GPU: $gpu"
    grep -E "FAIL|PASSED|rel L2 .* >|Hopper path vs|prefix hit|^kv |seed" "$out/test.log" | head -24
    grep -E "FAIL|PASSED|over 2x|A/B|worst ratio|seed" "$out/numerics.log" | head -8
    grep -E "RACECHECK SUMMARY|hazard|FAIL" "$out/racecheck.log" 2>/dev/null | head -4
    echo "new:"
    grep -E "^(causal|document|sliding|append|small)" "$out/prefill-new.log" |
      awk '$2=="pp" || $1 ~ /append2048_over6144_(int|fp)/ {printf "%s/%s %s %s %s; ", $1, $2, $3, $4, $6} END {print ""}'
    echo "base:"
    grep -E "^(causal|document|sliding|append|small)" "$out/prefill-base.log" 2>/dev/null |
      awk '{printf "%s/%s %s %s %s; ", $1, $2, $3, $4, $6} END {print ""}'
    grep -E "^(prefill_causal_sdpa_cudnn|prefill_causal_sdpa_flash|flex_|append_|shape)" "$out/reference.log" |
      sed 's/"B": 4, "S": 8192, "Hq": 32, "Hkv": 8, "D": 128, //' | tr '\n' ' '
    echo
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Bank Conflicts|Executed Ipc" "$out/ncu.txt" 2>/dev/null | head -14
    echo "clocks (SM MHz min/median/max, W max):"
    awk -F', ' '{print $2+0, $3+0}' "$out/clocks.csv" | sort -n | awk '{c[NR]=$1; if ($2>p) p=$2} END {print c[1], c[int(NR/2)+1], c[NR], p}'
    printf '%s\n' "${summary[@]}"
  } >"$out/summary.txt"
  cat "$out/summary.txt"
  rm -f "$out/reference.log"
  rm -rf "$w"
}

case "${1:-run}" in
build) build "${2:?build DIR}" "${3:-}" ;;
*) run ;;
esac

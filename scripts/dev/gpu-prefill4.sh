#!/usr/bin/env bash
# gpu-prefill4.sh: one GPU round of the Hopper prefill path's converted cache
# types (tiles of 64 at D 128, convert16_fast), old beside new in one run.
#
#   scripts/dev/gpu-prefill4.sh build DIR [BASE_BENCH]   (build machine, with nvcc)
#       builds test_cuda_kernels, test_cuda_numerics and bench_prefill for sm_90a
#       (scripts/dev/gpu-round.sh's recipe, build-gpu/), relinks them against
#       the kernel library as one shared object, and packs them with it,
#       libcudart, libcmocka, bench/torch_reference.py and BASE_BENCH (a
#       bench_prefill built from the commit to compare against, as
#       bench_prefill_base) into DIR/p4.tar.xz; copies this script to DIR/run.sh.
#   bash DIR/run.sh                                    (GPU machine)
#       unpacks into a temporary folder and runs, each step under a timeout of
#       at most what is left of P4_SECONDS (default 285), logs to $OUT:
#         1. test_cuda_kernels (every matrix), test_cuda_numerics (the
#            pairwise cover) and compute-sanitizer racecheck over the prefill
#            matrix's pairwise cover side by side (correctness only)      ~90 s
#         2. the opt-in unit order (sched bit 11) through the prefill matrix ~15 s
#         3. bench_prefill_base, every row, its defaults (pp)               ~10 s
#         4. bench_prefill, every row: pp (the defaults), old_cvt (the earlier
#            conversion instructions), nocvt (no conversion: timing only),
#            cvt_swz (the opt-in unit order)                                ~15 s
#         5. bench/torch_reference.py (prefill, flex, shapes, append)        ~35 s
#         6. ncu, one launch of the append over int8_dynamic (--clock-control
#            none): speed of light, warp states, scheduler, shared memory   ~30 s
#       and prints a summary last (also $OUT/summary.txt). 117 s on 2026-12-01
#       (before steps 2 and cvt_swz).
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
  g++ -shared -Wl,-soname,libattnd_p4.so -o "$tmp/libattnd_p4.so" \
    -Wl,--whole-archive "$b/kernels/cuda/libattnd_kernels_cuda.a" -Wl,--no-whole-archive \
    -Wl,-rpath,'$ORIGIN' -L"$tmp" -l:libcudart.so.13 -L/usr/local/cuda/targets/x86_64-linux/lib \
    -lcudadevrt -lrt -lpthread -ldl -lm
  libs="-Wl,-rpath,\$ORIGIN -L$tmp -lattnd_p4 -l:libcudart.so.13"
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
  strip --strip-unneeded "$tmp/libattnd_p4.so"
  strip --strip-all "$tmp/test_cuda_kernels" "$tmp/test_cuda_numerics" "$tmp/bench_prefill"
  if [ -n "$base" ]; then
    cp "$base" "$tmp/bench_prefill_base" && strip --strip-all "$tmp/bench_prefill_base"
  fi
  cp -a /usr/lib/x86_64-linux-gnu/libcmocka.so.0* "$tmp/"
  cp "$root/bench/torch_reference.py" "$tmp/"
  mkdir -p "$dir"
  tar -C "$tmp" -cf - . | xz -9e -T2 >"$dir/p4.tar.xz" # with the work tree: under 64 MiB
  rm -rf "$tmp"
  cp "$0" "$dir/run.sh"
  cp "$here/round-step.sh" "$dir/"
  echo "staged $dir/p4.tar.xz: $(($(stat -c %s "$dir/p4.tar.xz") / 1048576)) MiB"
}

budget=${P4_SECONDS:-285}
# shellcheck source=round-step.sh
. "$here/round-step.sh"

run() {
  out=${OUT:-$PWD/gpu-out}
  mkdir -p "$out"
  local w ncu
  w=$(mktemp -d)
  tar -C "$w" -xJf "$here/p4.tar.xz" || exit 1
  cd "$w" || exit 1
  export LD_LIBRARY_PATH=$w${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  local gpu
  gpu=$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1)
  # 1. the correctness runs at once (no timing in them); the background
  # steps' summary lines are lost with their subshells: rebuilt from the logs
  step test_cuda_numerics 90 numerics.log env ATTND_GPU_TEST_PAIRWISE=1 ./test_cuda_numerics &
  local np=$!
  local sani
  sani=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$sani" ]; then
    step racecheck 90 racecheck.log env ATTND_GPU_TEST_PAIRWISE=1 ATTND_GPU_TEST_ONLY=test_prefill_matrix \
      "$sani" --tool racecheck --error-exitcode 3 ./test_cuda_kernels &
  fi
  local rp=$!
  step test_cuda_kernels 95 test.log ./test_cuda_kernels
  wait $np $rp
  local f
  for f in numerics racecheck; do
    [ -f "$out/$f.log" ] || continue
    summary+=("$(printf '%-20s %-8s %5s  %s' "$f" "$(grep -q PASSED "$out/$f.log" && ! grep -q FAILED "$out/$f.log" && echo ok || echo check)" - "$f.log")")
  done
  # The opt-in unit order (sched bit 11) through the prefill matrix's pairwise cover.
  step test_optin 40 test-optin.log env ATTND_GPU_TEST_SM90_SCHED=2048 ATTND_GPU_TEST_PAIRWISE=1 \
    ATTND_GPU_TEST_ONLY=test_prefill_matrix ./test_cuda_kernels
  # bench_prefill writes $OUT/prefill.json when OUT is set: unset (8 files come
  # back). The base build first, then the new one (in the 22:00 run the new
  # one ran first and its d256 row, whose SASS is the base's, was 11% slower).
  if [ -x ./bench_prefill_base ]; then
    step bench_base 30 prefill-base.log env -u OUT ATTND_BENCH_PREFILL=all ATTND_BENCH_VARIANTS=pp \
      ./bench_prefill_base
  fi
  step bench_new 50 prefill-new.log env -u OUT ATTND_BENCH_PREFILL=all \
    ATTND_BENCH_VARIANTS=pp,old_cvt,nocvt,cvt_swz ./bench_prefill
  step torch_reference 80 reference.log env OUT="$out" PYTHONUNBUFFERED=1 \
    ATTND_REF_SECTIONS=prefill,flex,shapes,append python3 torch_reference.py
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  if [ -n "$ncu" ]; then
    step ncu 40 ncu.txt env -u OUT "$ncu" --clock-control none --kernel-name regex:prefill_sm90 \
      --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
      env ATTND_BENCH_PREFILL=all ATTND_BENCH_FILTER=6144_int8_dynamic ATTND_BENCH_VARIANTS=pp ./bench_prefill
  fi
  {
    echo "GPU: $gpu"
    grep -E "FAIL|PASSED|rel L2 .* >|Hopper path vs|prefix hit|^kv |seed" "$out/test.log" | head -16
    grep -E "FAIL|PASSED|over 2x|A/B|worst ratio|seed" "$out/numerics.log" | head -8
    grep -E "RACECHECK SUMMARY|hazard|FAIL" "$out/racecheck.log" 2>/dev/null | head -4
    grep -E "FAIL|PASSED|Hopper path vs|prefix hit|rel L2 .* >" "$out/test-optin.log" 2>/dev/null |
      sed 's/^/opt-in: /' | head -4
    echo "new:"
    grep -E "^(causal|document|sliding|append|small)" "$out/prefill-new.log" |
      awk '{printf "%s/%s %s ms %s TF; ", $1, $2, $3, $4} END {print ""}'
    echo "base:"
    grep -E "^(causal|document|sliding|append|small)" "$out/prefill-base.log" 2>/dev/null |
      awk '{printf "%s/%s %s ms %s TF; ", $1, $2, $3, $4} END {print ""}'
    grep -E "^(prefill_causal_sdpa_cudnn|prefill_causal_sdpa_flash|flex_|append_|shape)" "$out/reference.log" |
      sed 's/"B": 4, "S": 8192, "Hq": 32, "Hkv": 8, "D": 128, //' | tr '\n' ' '
    echo
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Bank Conflicts|Executed Ipc" "$out/ncu.txt" 2>/dev/null | head -14
    printf '%s\n' "${summary[@]}"
  } >"$out/summary.txt"
  cat "$out/summary.txt"
  rm -f "$out/reference.log" "$out/test-optin.log"
  rm -rf "$w"
}

case "${1:-run}" in
build) build "${2:?build DIR}" "${3:-}" ;;
*) run ;;
esac

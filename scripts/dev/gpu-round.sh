#!/usr/bin/env bash
# gpu-round.sh: one round of GPU work, in two halves.
#
#   scripts/dev/gpu-round.sh build   (on the build machine, with nvcc)
#       builds the GPU test and benchmark for sm_90a with the CUDA runtime
#       linked statically into build-gpu/, and stages what the H200 needs in
#       build-gpu/stage/ (binaries, libcmocka beside them, torch_reference.py).
#   scripts/dev/gpu-round.sh run     (on the GPU machine, with build-gpu/stage/
#       copied into the same checkout there): every GPU test, compute-sanitizer
#       memcheck and racecheck on the pairwise mode, the kernel benchmarks and
#       PyTorch's reference, logs and JSON to $OUT (or ./gpu-out).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
stage=$here/build-gpu/stage

case "${1:-run}" in
build)
  set -e
  cmake -S "$here" -B "$here/build-gpu" -DPython3_EXECUTABLE=/usr/bin/python3 \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$here/build-gpu" -j2 --target test_cuda_kernels bench_kernels bench_prefill
  rm -rf "$stage" && mkdir -p "$stage"
  # Packed: every binary carries all the kernels (~44 MB each), over the 64 MiB
  # a round may carry unpacked.
  tar czf "$stage/bin.tgz" -C "$here/build-gpu/tests" test_cuda_kernels -C "$here/build-gpu/bench" bench_kernels \
    bench_prefill -C /usr/lib/x86_64-linux-gnu $(cd /usr/lib/x86_64-linux-gnu && ls libcmocka.so.0*)
  cp "$here/bench/torch_reference.py" "$stage/"
  du -sh "$stage"
  ;;
run)
  out=${OUT:-$here/gpu-out}
  mkdir -p "$out"
  cd "$stage" || exit 1
  [ -f bin.tgz ] && tar xzf bin.tgz
  export LD_LIBRARY_PATH=$stage${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
  echo "== tests (full matrix)"
  timeout 240 ./test_cuda_kernels >"$out/test.log" 2>&1
  echo "test_cuda_kernels rc=$?" | tee -a "$out/test.log"
  grep -E "kv |FAIL|PASSED|rel L2|lse|seed|device 0" "$out/test.log" | head -40
  echo "== compute-sanitizer memcheck (pairwise mode)"
  ATTND_GPU_TEST_PAIRWISE=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 \
    ./test_cuda_kernels >"$out/memcheck.log" 2>&1
  echo "memcheck rc=$?" | tee -a "$out/memcheck.log"
  grep -E "ERROR SUMMARY|Invalid|FAIL|PASSED" "$out/memcheck.log" | head -20
  echo "== compute-sanitizer racecheck (pairwise mode)"
  ATTND_GPU_TEST_PAIRWISE=1 timeout 240 compute-sanitizer --tool racecheck --error-exitcode 3 \
    ./test_cuda_kernels >"$out/racecheck.log" 2>&1
  echo "racecheck rc=$?" | tee -a "$out/racecheck.log"
  grep -E "RACECHECK SUMMARY|FAIL|PASSED" "$out/racecheck.log" | head -20
  if [ "${ATTND_ROUND_NO_BENCH:-0}" = 1 ]; then exit 0; fi
  echo "== bench_kernels"
  OUT=$out timeout 200 ./bench_kernels 2>&1 | tee "$out/bench.log"
  echo "== bench_prefill"
  OUT=$out timeout 200 ./bench_prefill 2>&1 | tee "$out/prefill.log"
  if [ "${ATTND_ROUND_NO_ANCHORS:-0}" = 1 ]; then exit 0; fi
  echo "== PyTorch reference (bench/torch_reference.py)"
  OUT=$out PYTHONUNBUFFERED=1 timeout 240 python3 torch_reference.py >"$out/reference.log" 2>&1
  echo "anchors rc=$?"
  grep -E "copy_bw|prefill_causal_sdpa|flex_doc|flex_sliding|decode_bf16_(cudnn|flash)_B(64|8)_|int8_dequant" "$out/reference.log"
  ;;
*)
  echo "usage: $0 build|run" >&2
  exit 2
  ;;
esac

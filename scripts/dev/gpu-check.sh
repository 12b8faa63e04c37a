#!/usr/bin/env bash
# gpu-check.sh: a short GPU round after a fix, from the tarballs the round
# scripts stage (build-gpu/stage/round.tar.xz and gpu-e2e.tar.xz): the CUDA
# numerics test, the e2e modules named in GPU_CHECK_MODULES (default
# test_variants) on the CUDA backend, and bench_interleave on CUDA (a decode
# beside a 32k prefill). Logs in $OUT; one summary line last.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$here/gpu-check-out}
mkdir -p "$out"
r=$(mktemp -d) e=$(mktemp -d)
trap 'rm -rf "$r" "$e"' EXIT
xz -dc "$here/build-gpu/stage/round.tar.xz" | tar -C "$r" -xf -
xz -dc "$here/build-gpu/stage/gpu-e2e.tar.xz" | tar -C "$e" -xf -
results=()
note() { results+=("$1=$([ "$2" = 0 ] && echo pass || echo "fail($2)")"); }
LD_LIBRARY_PATH=$r timeout 200 "$r/test_cuda_numerics" >"$out/numerics.log" 2>&1
rc=$?
grep -E 'over 2x|FAIL|worst ratio|^kv |^[a-z0-9_]+ +(bf16|fp16) ' "$out/numerics.log" | tail -20
note numerics $rc
mkdir -p "$out/py" && cp "$e/attnd_pb2.py" "$e/attnd_version.py" "$out/py/"
for m in ${GPU_CHECK_MODULES:-test_variants}; do
  (cd "$here/tests/e2e" && env LD_LIBRARY_PATH="$e" PYTHONPATH="$out/py:$here/client/python" \
    ATTND_E2E_BACKEND=cuda ATTND_BIN="$e/attnd" ATTND_BUILD_DIR="$e" timeout 120 python3 run.py "$m") >"$out/e2e_$m.log" 2>&1
  rc=$?
  grep -E 'Error|FAILED|^OK|Ran ' "$out/e2e_$m.log" | tail -6
  note "e2e:$m" $rc
done
LD_LIBRARY_PATH=$e timeout 90 "$e/bench_interleave" 32768 1024 1 16384 32 8 cuda >"$out/interleave.log" 2>&1
rc=$?
tail -6 "$out/interleave.log"
note interleave $rc
echo "GPU-CHECK SUMMARY: ${results[*]}"

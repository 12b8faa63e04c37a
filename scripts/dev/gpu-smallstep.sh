#!/usr/bin/env bash
# gpu-smallstep.sh: where a small (decode) layer step's time goes, on the GPU
# machine, and the small-step options against the defaults in one run.
#
#   scripts/dev/gpu-smallstep.sh stage DIR   (build machine; a CUDA build in
#       ${GPU_SMALL_BUILD:-build-gpu} with attnd, attnctl and attnd_proto_py built)
#       packs DIR/smallstep.tar.xz: bin/ (attnd, attnctl, attnd_pb2.py,
#       attnd_version.py and the libraries the GPU machine lacks), src/ (this
#       checkout's client/python, bench/bench_e2e.py, tests/e2e) and old/ (the
#       Python client of GPU_SMALL_OLD, default main, for the client's
#       before/after), and copies this script next to it as DIR/run.sh.
#   bash DIR/run.sh                           (GPU machine, DIR carried there)
#
# Steps, each under what is left of GPU_SMALL_BUDGET (default 228 s), logs and
# JSON in $OUT:
#   1. tests/e2e/test_ipc.py on the CUDA daemon (zero-copy against bytes and
#      the float64 reference, refusals);
#   2. bench_e2e.py --breakdown, 8B shape at 4,096, 1/16/64 sessions, Unix
#      socket and by reference, --cuda-trace: per case the client's phases
#      (encode, send, wait, read, parse) beside the daemon's step_trace and
#      cuda_trace; the in-process PyTorch column (SDPA, GQA) first;
#   3. the same without --breakdown or --cuda-trace (the latencies as served);
#   4. the older Python client against the same daemon (1 and 16 sessions);
#   5. --cuda-completion loop --cuda-graphs, with the breakdown;
#   6. --busy-poll-us 300 with loop completion and graphs, the client spinning
#      300 us (1 session);
#   7. attnctl bench (the C client's phases) at 1 x 4096, 16 x 512 and 64 x 512,
#      daemon with --step-trace and --cuda-trace.
# It ends with the key rows and one line: SMALLSTEP SUMMARY: step=rc(s) ...
set -u
case "${1:-run}" in
stage)
  set -e
  dir=${2:?usage: $0 stage DIR}
  here=$(cd "$(dirname "$0")/../.." && pwd)
  b=$here/${GPU_SMALL_BUILD:-build-gpu}
  tmp=$(mktemp -d)
  mkdir -p "$tmp/bin" "$tmp/src/bench" "$tmp/src/tests" "$tmp/old" "$dir"
  for f in daemon/attnd client/attnctl; do
    cp "$b/$f" "$tmp/bin/" && strip --strip-debug "$tmp/bin/$(basename "$f")"
  done
  cp "$b/python/attnd_pb2.py" "$b/python/attnd_version.py" "$tmp/bin/"
  for lib in libuv.so.1 libcmocka.so.0 libinih.so.1 libxxhash.so.0 libhttp_parser.so.2.9 libjansson.so.4; do
    cp -L "/usr/lib/x86_64-linux-gnu/$lib" "$tmp/bin/$lib"
  done
  (cd "$here" && tar -cf - client/python/attnd bench/bench_e2e.py bench/bench_client.py tests/e2e tests/tolerance.h) | tar -C "$tmp/src" -xf -
  (cd "$here" && git archive "${GPU_SMALL_OLD:-main}" client/python/attnd) | tar -C "$tmp/old" -xf -
  (cd "$here" && git rev-parse --short HEAD) >"$tmp/COMMIT"
  find "$tmp" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$tmp" -cf - . | xz -9 -T2 >"$dir/smallstep.tar.xz"
  cp "$here/scripts/dev/gpu-smallstep.sh" "$dir/run.sh"
  du -sh "$dir/smallstep.tar.xz"
  rm -rf "$tmp"
  exit 0
  ;;
run) ;;
*)
  echo "usage: $0 stage DIR | run" >&2
  exit 2
  ;;
esac

here=$(cd "$(dirname "$0")" && pwd)
# Logs and JSON go to a work folder, packed into $OUT/smallstep-logs.tar.xz at
# the end (a round brings back only a few files), the key ones copied beside it.
final=${OUT:-$here/out}
mkdir -p "$final"
W=$(mktemp -d)
out=$W/logs
mkdir -p "$out"
xz -dc "$here/smallstep.tar.xz" | tar -C "$W" -xf -
B=$W/bin
S=$W/src
export LD_LIBRARY_PATH=$B${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export ATTND_PB2_DIR=$B PYTHONPATH=$B:$S/client/python PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
t0=$(date +%s)
budget=${GPU_SMALL_BUDGET:-228}
summary=""

# step NAME CAP CMD...: CMD under min(CAP, what is left), output to $out/NAME.log.
step() {
  local name=$1 cap=$2 left rc s0
  shift 2
  left=$((budget - ($(date +%s) - t0)))
  if [ "$left" -lt 15 ]; then
    summary="$summary $name=skip(time)"
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  s0=$(date +%s)
  timeout -k 5 "$cap" "$@" >"$out/$name.log" 2>&1
  rc=$?
  summary="$summary $name=$rc($(($(date +%s) - s0))s)"
  echo "== $name rc=$rc"
}

echo "commit $(cat "$W/COMMIT")" | tee "$out/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee -a "$out/gpu.txt"
$py -c "import torch, google.protobuf as p; print('torch', torch.__version__, 'protobuf', p.__version__)" 2>&1 | tee -a "$out/gpu.txt"
ldd "$B/attnd" | grep "not found" | tee -a "$out/gpu.txt"

# 1. zero-copy end to end on the CUDA daemon.
step test_ipc 45 bash -c "cd '$S/tests/e2e' && ATTND_E2E_BACKEND=cuda ATTND_BIN='$B/attnd' ATTND_BUILD_DIR='$B' $py run.py test_ipc"
grep -E "^(Ran|OK|FAILED)|SKIPPED|Error|error:" "$out/test_ipc.log" | head -12

e2e=("$py" "$S/bench/bench_e2e.py" --attnd "$B/attnd" --backend cuda --context 4096 --prefill 0
  --kv-memory 48G --transports unix,ipc)
brk() { grep -E "^\| (breakdown|unix|ipc) " "$out/$1.log" | grep -v "^| step_trace" | head -16; }

# 1b. the Python client's fast path: its tests with torch present, then its
# own cost per step (old and new path, one process) against the CUDA daemon.
step client_tests 40 bash -c "cd '$S/tests/e2e' && ATTND_E2E_BACKEND=cuda ATTND_BIN='$B/attnd' ATTND_BUILD_DIR='$B' $py run.py test_frames test_torch_client"
grep -E "^(Ran|OK|FAILED)|SKIPPED|Error|error:" "$out/client_tests.log" | head -12
step bench_client 40 "$py" "$S/bench/bench_client.py" --attnd "$B/attnd" --backend cuda --iters 1500 --rounds 3 \
  --json "$out/bench_client.json"
grep -vE "^\s*$" "$out/bench_client.log" | tail -12
# 2. the breakdown, defaults (+ --cuda-trace), PyTorch column first.
step e2e_breakdown 55 "${e2e[@]}" --sessions 1,16,64 --tokens 8 --breakdown --json "$out/e2e_breakdown.json"
brk e2e_breakdown
# 3. as served.
step e2e_plain 30 "${e2e[@]}" --sessions 1,16,64 --tokens 16 --no-cuda-trace --no-torch --json "$out/e2e_plain.json"
brk e2e_plain
# 4. the older client.
step e2e_oldclient 20 env ATTND_CLIENT_DIR="$W/old/client/python" "${e2e[@]}" --sessions 1,16 --tokens 16 \
  --no-cuda-trace --no-torch --json "$out/e2e_oldclient.json"
brk e2e_oldclient
# 5. loop completion and graphs.
step e2e_loop_graphs 30 "${e2e[@]}" --sessions 1,16,64 --tokens 8 --breakdown --no-torch \
  --daemon-arg=--cuda-completion --daemon-arg=loop --daemon-arg=--cuda-graphs --json "$out/e2e_loop_graphs.json"
brk e2e_loop_graphs
# 6. busy poll on both sides.
step e2e_busy 20 "${e2e[@]}" --sessions 1 --tokens 16 --no-cuda-trace --no-torch --spin 300 \
  --daemon-arg=--busy-poll-us --daemon-arg=300 --daemon-arg=--cuda-completion --daemon-arg=loop \
  --daemon-arg=--cuda-graphs --json "$out/e2e_busy.json"
brk e2e_busy

# 7. attnctl bench: the C client's phases, the daemon's trace in its log.
ctl() {
  local d
  d=$(mktemp -d)
  "$B/attnd" --socket "$d/s" --listen "" --metrics "" --state-dir "$d" --backend cuda --kv-memory 24G \
    --step-trace 256 --cuda-trace >"$out/attnd-attnctl.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do [ -S "$d/s" ] && break; sleep 0.1; done
  for a in "--sessions 1 --prompt 4096" "--sessions 16 --prompt 512" "--sessions 64 --prompt 512"; do
    echo "## attnctl bench $a --steps 64"
    # shellcheck disable=SC2086
    timeout 14 "$B/attnctl" --socket "$d/s" bench $a --steps 64
  done
  kill -TERM $pid
  wait $pid
  grep -E "step_trace|cuda_trace" "$out/attnd-attnctl.log" | tail -8
  rm -rf "$d"
}
export -f ctl
export B out
step attnctl 45 bash -c ctl
grep -E "^## |^(decode layer|  in daemon|  client)" "$out/attnctl.log" | head -30

tar -C "$W" -cJf "$final/smallstep-logs.tar.xz" logs
cp "$out/e2e_breakdown.log" "$out/attnctl.log" "$final/" 2>/dev/null
echo "SMALLSTEP SUMMARY:$summary (total $(($(date +%s) - t0))s)"

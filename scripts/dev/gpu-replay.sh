#!/usr/bin/env bash
# gpu-replay.sh: CUDA graph replay (--cuda-graph-replay) against capture-every-step
# on the GPU machine, in one command, from the root of the checkout with
# build-gpu/stage/gpu-e2e.tar.xz there (scripts/dev/gpu-step.sh stage).
#
#   1. attnctl bench decode at 4,096 through an 80-layer daemon (10 layers a
#      stream), 1 session, --cuda-completion loop --cuda-graphs, replay and
#      capture (gpu-hostpath.sh; its summary has the graph counters);
#   2. bench/bench_e2e.py, 8B shape (32 layers) at 4,096, 1 and 16 sessions,
#      over the Unix socket and same-host zero-copy (ipc), --cuda-completion
#      loop --cuda-graphs, replay on then off (--cuda-graph-replay false):
#      per-token latency and layer round trip, both arms in the same run.
# Logs and JSON in $OUT (default ./gpu-replay-out), within GPU_REPLAY_BUDGET
# seconds (default 240).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$PWD/gpu-replay-out}
budget=${GPU_REPLAY_BUDGET:-240}
py=${PYTHON:-python3}
mkdir -p "$out"
t0=$(date +%s)
left() { echo $((budget - ($(date +%s) - t0))); }

bindir=$(mktemp -d /tmp/gpu-replay-XXXXXX)
xz -dc "$here/build-gpu/stage/gpu-e2e.tar.xz" | tar -C "$bindir" -xf - || exit 1
export LD_LIBRARY_PATH=$bindir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
pb2=$(find "$bindir" -name attnd_pb2.py | head -1)
[ -n "$pb2" ] && export ATTND_PB2_DIR=$(dirname "$pb2")

echo "== 1. 80 layers, 1 session (attnctl bench)"
OUT=$out/hp80 GPU_HOSTPATH_CASES=decode GPU_HOSTPATH_SESSIONS=1 GPU_HOSTPATH_LAYERS=80 \
  GPU_HOSTPATH_MODES="both+capture both" GPU_HOSTPATH_BUDGET=$(($(left) / 3)) \
  bash "$here/scripts/dev/gpu-hostpath.sh" >"$out/hp80.log" 2>&1
tail -12 "$out/hp80.log"

echo "== 2. bench_e2e, 32 layers, unix and ipc, replay then capture"
for arm in replay capture; do
  [ "$arm" = replay ] && t=$(($(left) / 2))
  [ "$arm" = capture ] && t=$(left)
  if [ "$t" -lt 20 ]; then
    echo "$arm: skipped ($t s left)"
    continue
  fi
  extra=()
  [ "$arm" = capture ] && extra=(--daemon-arg=--cuda-graph-replay --daemon-arg=false)
  timeout "$t" "$py" "$here/bench/bench_e2e.py" --attnd "$bindir/attnd" --backend cuda --shape 8b \
    --sessions 1,16 --context 4096 --tokens 16 --prefill 0 --transports unix,ipc --no-torch \
    --no-cuda-trace --daemon-arg=--cuda-completion --daemon-arg=loop --daemon-arg=--cuda-graphs \
    "${extra[@]}" --json "$out/e2e-$arm.json" --log "$out/attnd-e2e-$arm.log" >"$out/e2e-$arm.txt" 2>&1
  echo "$arm: rc=$?"
  "$py" - "$out/e2e-$arm.json" "$arm" <<'EOF' 2>&1 | tee -a "$out/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
for c in r["cases"]:
    if "skipped" in c:
        print(f"{sys.argv[2]} {c['transport']}: skipped: {c['skipped']}")
        continue
    print(f"{sys.argv[2]} {c['transport']} {c['sessions']}x{r['context']}: token p50 {c['token_p50_us']:.0f} us, "
          f"layer RT p50 {c['layer_p50_us']:.1f} us, computing {c['computing_p50_us']:.1f} us")
EOF
done
rm -rf "$bindir"

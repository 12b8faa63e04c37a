#!/usr/bin/env bash
# gpu-scaleout.sh: head sharding and split context on the CUDA backend
# (docs/scale-out.md), on one GPU and on two.
#
#   scripts/dev/gpu-scaleout.sh stage   (build machine) = scripts/dev/gpu-e2e.sh stage:
#       the same attnd and attnd_pb2.py, packed into build-gpu/stage/gpu-e2e.tar.xz
#   scripts/dev/gpu-scaleout.sh run     (one GPU, from the root of the same checkout)
#     1. tests/e2e/test_scaleout_sharded.py and test_scaleout_split.py with
#        ATTND_E2E_BACKEND=cuda: 2 and 4 head shards bit-equal to one daemon,
#        2 and 4 split daemons within 1e-3, bad input; every daemon on the GPU;
#     2. the Llama-3-8B-like shape (32 layers, 32/8 heads, d 128), bf16 and
#        int8_dynamic caches: shards --kv-heads 0:4 and 4:8, two split parts and
#        one whole daemon, all on device 0: scripts/dev/scaleout_check.py
#        (sharded bit for bit, bf16 and fp32 out with lse; split within 1e-3);
#     3. bench/bench_fanout.py on those daemons (per-layer fan-out cost).
#   scripts/dev/gpu-scaleout.sh run2    (two GPUs: the two-GPU scaling run)
#     attnd@0 and attnd@1 as their units start them (--device N, socket
#     $tmp/N/attnd.sock, state dir $tmp/N, TCP 7411+2N, metrics 7412+2N), each
#     head-sharded (0:4 on device 0, 4:8 on device 1), their /metrics and
#     /readyz checked; scaleout_check.py against one whole daemon (device 0),
#     and split context over whole-shape daemons on devices 0 and 1; then the
#     throughput run: 64 sessions at 4096, int8_dynamic, decode through the
#     sharded client vs one daemon (bench_fanout.py; SCALE_LAYERS layers,
#     default 8: the ratio is per layer), reporting tokens/s of both, their
#     ratio (the target is >= 1.8) and the per-layer fan-out overhead.
# Smoke test of the script itself on a machine without a GPU:
#   GPU_SCALEOUT_BACKEND=cpu GPU_SCALEOUT_MEM=256M \
#   GPU_SCALEOUT_SHAPE="--layers 2 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 64" \
#   scripts/dev/gpu-scaleout.sh run     (with build-gpu/ from gpu-e2e.sh stage, or a build)
# and run2 likewise with GPU_SCALEOUT_NGPU=2 SCALE_SESSIONS=4 SCALE_CTX=256.
# Logs and JSON in $OUT (default ./gpu-scaleout-out). GPU_SCALEOUT_BUDGET
# (seconds, default 540) skips steps that would start after it. It always ends
# with one line:
#   GPU-SCALEOUT SUMMARY: pass=N fail=M skip=K | step=result ...
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)

case "${1:-run}" in
stage) exec bash "$here/scripts/dev/gpu-e2e.sh" stage ;;
run | run2) mode=$1 ;;
*)
  echo "usage: $0 stage|run|run2" >&2
  exit 2
  ;;
esac

out=${OUT:-$PWD/gpu-scaleout-out}
mkdir -p "$out"
t_begin=$(date +%s)
budget=${GPU_SCALEOUT_BUDGET:-540}
results=()
npass=0
nfail=0
nskip=0
pids=()
tmp=$(mktemp -d /tmp/gpu-scaleout-XXXXXX)

cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
  echo "GPU-SCALEOUT SUMMARY: pass=$npass fail=$nfail skip=$nskip | ${results[*]}" | tee "$out/summary.txt"
}
trap cleanup EXIT

record() { # NAME RC: 0 pass, 77 skip, else fail (124: timed out)
  local what
  case $2 in
  0) what=pass; npass=$((npass + 1)) ;;
  77) what=skip; nskip=$((nskip + 1)) ;;
  124 | 137) what=timeout; nfail=$((nfail + 1)) ;;
  *) what="fail($2)"; nfail=$((nfail + 1)) ;;
  esac
  results+=("$1=$what")
  echo "== $1: $what"
}

time_left() { [ $(($(date +%s) - t_begin + $1)) -le "$budget" ]; }

# The binaries: gpu-e2e.sh stage's tarball, or a build-gpu/ tree.
bindir=
for t in "$here/build-gpu/stage/gpu-e2e.tar.xz" "$here/build-gpu/gpu-e2e.tar.xz"; do
  if [ -f "$t" ]; then
    bindir=$tmp/bin
    mkdir -p "$bindir" && xz -dc "$t" | tar -C "$bindir" -xf -
    break
  fi
done
find_file() {
  local d
  for d in "$bindir" "$here/build-gpu/stage" "$here/build-gpu" "$here/build-gpu/daemon" "$here/build-gpu/python"; do
    if [ -n "$d" ] && [ -f "$d/$1" ]; then
      echo "$d/$1"
      return 0
    fi
  done
  return 1
}
attnd_bin=$(find_file attnd || true)
pb2=$(find_file attnd_pb2.py || true)
if [ -z "$attnd_bin" ] || [ -z "$pb2" ]; then
  echo "attnd or attnd_pb2.py not found: run scripts/dev/gpu-scaleout.sh stage first"
  record binaries 1
  exit 1
fi
libdir=$(dirname "$attnd_bin")
export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
backend=${GPU_SCALEOUT_BACKEND:-cuda}
mem() { echo "${GPU_SCALEOUT_MEM:-$1}"; } # a daemon's --kv-memory
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
mkdir -p "$tmp/py" && cp "$pb2" "$tmp/py/"
pyver=$(find_file attnd_version.py || true)
if [ -n "$pyver" ]; then cp "$pyver" "$tmp/py/"; else echo '__version__ = "0+unknown"' >"$tmp/py/attnd_version.py"; fi
export PYTHONPATH=$tmp/py:$here/client/python:$here/tests/e2e${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

# start NAME ARGS...: attnd --backend cuda, on $tmp/NAME.sock with state dir
# $tmp/NAME and no TCP or metrics listener unless ARGS give --socket (then
# ARGS say everything); waits for Health; sets sock.
start() {
  local name=$1 a prev=
  shift
  sock=
  for a in "$@"; do
    [ "$prev" = --socket ] && sock=$a
    prev=$a
  done
  if [ -z "$sock" ]; then
    sock=$tmp/$name.sock
    mkdir -p "$tmp/$name"
    set -- --socket "$sock" --state-dir "$tmp/$name" --listen "" --metrics "" "$@"
  fi
  "$attnd_bin" --backend "$backend" "$@" >"$out/attnd-$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  for _ in $(seq 1 600); do
    kill -0 $pid 2>/dev/null || { echo "attnd $name exited:"; tail -5 "$out/attnd-$name.log"; return 1; }
    if [ -S "$sock" ] &&
      $py -c "import sys, attnd; attnd.Client(sys.argv[1], timeout=5).health()" "$sock" >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.1
  done
  echo "attnd $name: no Health within 60 s"
  return 1
}
stop_all() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
}

read -r -a big <<<"${GPU_SCALEOUT_SHAPE:---layers 32 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 64}"

if [ "$mode" = run ]; then
  # ---- 1. the scale-out e2e modules on the CUDA backend ----
  for m in test_scaleout_sharded test_scaleout_split; do
    if ! time_left 150; then record "e2e:$m" 77; continue; fi
    (cd "$here/tests/e2e" && env ATTND_E2E_BACKEND="$backend" ATTND_BIN="$attnd_bin" \
      ATTND_BUILD_DIR="$libdir" timeout 150 $py run.py "$m") >"$out/e2e_$m.log" 2>&1
    rc=$?
    grep -E "^(Ran|OK|FAILED)|max \||differs|Error" "$out/e2e_$m.log" | head -12
    record "e2e:$m" $rc
  done
  # ---- 2-3. the 8B shape, all daemons on device 0 ----
  for kv in bf16 int8_dynamic; do
    if ! time_left 180; then record "8b_$kv" 77; continue; fi
    c=("${big[@]}" --device 0 --kv-cache "$kv")
    if start "whole_$kv" "${c[@]}" --kv-memory "$(mem 16G)" && w=$sock &&
      start "s0_$kv" "${c[@]}" --kv-heads 0:4 --kv-memory "$(mem 8G)" && s0=$sock &&
      start "s1_$kv" "${c[@]}" --kv-heads 4:8 --kv-memory "$(mem 8G)" && s1=$sock &&
      start "p0_$kv" "${c[@]}" --kv-memory "$(mem 16G)" && p0=$sock &&
      start "p1_$kv" "${c[@]}" --kv-memory "$(mem 16G)" && p1=$sock; then
      timeout 240 $py "$here/scripts/dev/scaleout_check.py" --whole "$w" --shards "$s1,$s0" \
        --split "$p0,$p1" --part-len 512 --json "$out/check_8b_$kv.json" >"$out/check_8b_$kv.log" 2>&1
      rc=$?
      tail -2 "$out/check_8b_$kv.log"
      record "8b_$kv" $rc
      if [ $kv = bf16 ] && time_left 120; then
        timeout 120 $py "$here/bench/bench_fanout.py" --connect "$w" --shards "$s0,$s1" --sessions 16 \
          --ctx 1024 --layers 2 --q-heads 32 --kv-heads 8 --iters 10 --json "$out/fanout_1gpu.json" \
          >"$out/fanout_1gpu.log" 2>&1
        rc=$?
        tail -4 "$out/fanout_1gpu.log"
        record fanout_1gpu $rc
      fi
    else
      record "8b_$kv" 1
    fi
    stop_all
  done
  [ $nfail = 0 ] && [ $npass -gt 0 ]
  exit $?
fi

# ---- run2: two GPUs, as attnd@0 / attnd@1 ----
ngpu=${GPU_SCALEOUT_NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
if [ "$ngpu" -lt 2 ]; then
  echo "run2 needs two GPUs; nvidia-smi lists $ngpu"
  record two_gpus 77
  exit 1
fi
inst() { # N KVRANGE KVCACHE KVMEM [ARGS]: attnd@N with its documented socket, state and ports
  local n=$1 r=$2 kv=$3 mem=$4
  shift 4
  mkdir -p "$tmp/$n"
  start "at${n}_$kv" "${big[@]}" --device "$n" --socket "$tmp/$n/attnd.sock" --state-dir "$tmp/$n" \
    --listen "127.0.0.1:$((7411 + 2 * n))" --metrics "127.0.0.1:$((7412 + 2 * n))" \
    --kv-heads "$r" --kv-cache "$kv" --kv-memory "$(mem "$mem")" "$@"
}
if time_left 240 && inst 0 0:4 bf16 24G && a0=$sock && inst 1 4:8 bf16 24G && a1=$sock &&
  start whole "${big[@]}" --device 0 --kv-memory "$(mem 24G)" && w=$sock &&
  start p0 "${big[@]}" --device 0 --kv-memory "$(mem 24G)" && p0=$sock &&
  start p1 "${big[@]}" --device 1 --kv-memory "$(mem 24G)" && p1=$sock; then
  $py - >"$out/probes.txt" 2>&1 <<'EOF'
import urllib.request
for n in (0, 1):
    port = 7412 + 2 * n
    for path in ("/readyz", "/metrics"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            assert r.status == 200, (port, path, r.status)
    print(f"attnd@{n}: /readyz and /metrics on {port} answer 200")
EOF
  record probes $?
  cat "$out/probes.txt"
  timeout 300 $py "$here/scripts/dev/scaleout_check.py" --whole "$w" --shards "$a0,$a1" --split "$p0,$p1" \
    --part-len 512 --json "$out/check_2gpu.json" >"$out/check_2gpu.log" 2>&1
  rc=$?
  tail -2 "$out/check_2gpu.log"
  record check_2gpu $rc
else
  record check_2gpu 1
fi
stop_all
nl=${SCALE_LAYERS:-8}
if time_left 240 && inst 0 0:4 int8_dynamic 8G --layers "$nl" && a0=$sock &&
  inst 1 4:8 int8_dynamic 8G --layers "$nl" && a1=$sock &&
  start whole8 "${big[@]}" --layers "$nl" --device 0 --kv-cache int8_dynamic --kv-memory "$(mem 12G)" &&
  w=$sock; then
  # 64 x 4096 int8_dynamic positions of 8 layers: ~4.5 GB whole, ~2.3 GB per shard.
  timeout 420 $py "$here/bench/bench_fanout.py" --connect "$w" --shards "$a0,$a1" \
    --sessions "${SCALE_SESSIONS:-64}" --ctx "${SCALE_CTX:-4096}" \
    --layers "$nl" --q-heads 32 --kv-heads 8 --kv-cache int8_dynamic --iters 20 \
    --json "$out/throughput_2gpu.json" >"$out/throughput_2gpu.log" 2>&1
  rc=$?
  tail -5 "$out/throughput_2gpu.log"
  record throughput_2gpu $rc
else
  record throughput_2gpu 77
fi
stop_all
[ $nfail = 0 ] && [ $npass -gt 0 ]

#!/usr/bin/env bash
# gpu-sockbuf.sh: a large step over the Unix socket with the daemon's
# send buffer at the kernel's default against --socket-buffer (4M), one run.
#
#   scripts/dev/gpu-sockbuf.sh stage DIR [BUILD]  (build machine: BUILD, default
#       build-gpu, has attnd and attnctl built with CUDA) packs both with the
#       Debian libraries the GPU machine lacks into DIR/sockbuf.tar.xz + DIR/run.sh
#   bash DIR/run.sh                          (GPU machine) within SB_SECONDS (200)
#
# Per arm (--socket-buffer 0, then the default 4M; alternating ROUNDS times,
# default 3) a fresh `attnd --backend cuda --layers 2 --step-trace 4` and
# `attnctl --json bench --sessions 1 --prompt 4096 --steps 8 --repeat 8`: the
# 4,096-token prefill layer step's round trip (48 MiB in, 32 MiB out) and the
# client's send / read phases, the daemon's step_trace write phase, and a
# 1-session decode layer step beside it; then the same over loopback TCP once
# per arm (TCP keeps autotuning: the option leaves it alone, so both arms
# should match). Prints one line per run and `SOCKBUF SUMMARY` last.
# SB_BACKEND=cpu SB_PROMPT=512 checks the script on a machine without a GPU.
set -u

stage() {
  local dest=${1:?usage: gpu-sockbuf.sh stage DIR [BUILD]} b=${2:-build-gpu}
  local here tmp lib
  here=$(cd "$(dirname "$0")/../.." && pwd)
  set -e
  tmp=$(mktemp -d)
  cp "$b/daemon/attnd" "$b/client/attnctl" "$tmp/"
  strip --strip-debug "$tmp/attnd" "$tmp/attnctl"
  for lib in libuv.so.1 libinih.so.1 libxxhash.so.0 libhttp_parser.so.2.9 libjansson.so.4; do
    cp -L "/usr/lib/x86_64-linux-gnu/$lib" "$tmp/$lib"
  done
  mkdir -p "$dest"
  tar -C "$tmp" -cf - . | xz -9 -T2 >"$dest/sockbuf.tar.xz"
  rm -rf "$tmp"
  cp "$here/scripts/dev/gpu-sockbuf.sh" "$dest/run.sh"
  du -sh "$dest"
}

run() {
  local here out t0 budget rounds
  here=$(cd "$(dirname "$0")" && pwd)
  out=${OUT:-$here/out}
  budget=${SB_SECONDS:-200}
  rounds=${ROUNDS:-3}
  t0=$(date +%s)
  mkdir -p "$out" "$here/bin"
  xz -dc "$here/sockbuf.tar.xz" | tar -C "$here/bin" -xf -
  export LD_LIBRARY_PATH=$here/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
  sysctl net.core.wmem_max net.core.wmem_default 2>/dev/null | tee -a "$out/gpu.txt"
  local i arm via n=0
  one() { # ARM VIA N
    local arm=$1 via=$2 n=$3 dir sock port
    dir=$(mktemp -d)
    sock=$dir/a.sock
    port=$((7600 + n))
    "$here/bin/attnd" --backend "${SB_BACKEND:-cuda}" --layers 2 --kv-memory 8G --step-trace 4 --socket-buffer "$arm" \
      --socket "$sock" --listen "127.0.0.1:$port" --metrics "" --state-dir "$dir" \
      >"$out/attnd_$n.log" 2>&1 &
    local pid=$!
    local k
    for k in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    local addr=(--socket "$sock")
    [ "$via" = tcp ] && addr=(--tcp "127.0.0.1:$port")
    timeout 60 "$here/bin/attnctl" "${addr[@]}" --json bench --sessions 1 --prompt "${SB_PROMPT:-4096}" --steps 8 \
      --repeat 8 >"$out/bench_$n.json" 2>"$out/bench_$n.err"
    kill -TERM $pid 2>/dev/null
    wait $pid 2>/dev/null
    python3 - "$arm" "$via" "$out/bench_$n.json" "$out/attnd_$n.log" <<'EOF'
import json, re, sys
arm, via, jf, lf = sys.argv[1:5]
try:
    j = json.loads(open(jf).read().strip().splitlines()[-1])
except Exception as e:
    print(f"{via} socket-buffer={arm}: no result ({e.__class__.__name__})"); sys.exit(0)
def g(k, q="p50_ms"):
    v = j.get(k, {}).get(q)
    return float("nan") if v is None else v
w = [m.group(1) for m in re.finditer(r"kind=prefill .*?write_us=(\d+)", open(lf, errors="replace").read())]
sb = re.search(r"event=socket_buffer (.*)", open(lf, errors="replace").read())
print(f"{via} socket-buffer={arm}: prefill layer RT p50 {g('prefill_layer_step'):.2f} ms"
      f" (p99 {g('prefill_layer_step', 'p99_ms'):.2f}), client send {g('prefill_layer_client_send'):.2f},"
      f" read {g('prefill_layer_client_read'):.2f}, daemon write p50s {','.join(w) or '-'} us;"
      f" decode layer RT p50 {g('decode_layer_step') * 1000:.1f} us;"
      f" {sb.group(1) if sb else 'no socket_buffer line'}")
EOF
    rm -rf "$dir"
  }
  for i in $(seq "$rounds"); do
    for arm in 0 4M; do
      [ $(($(date +%s) - t0)) -lt "$budget" ] || break 2
      n=$((n + 1))
      one "$arm" unix "$n" | tee -a "$out/summary.txt"
    done
  done
  for arm in 0 4M; do
    [ $(($(date +%s) - t0)) -lt "$budget" ] || break
    n=$((n + 1))
    one "$arm" tcp "$n" | tee -a "$out/summary.txt"
  done
  echo "SOCKBUF SUMMARY: runs=$n seconds=$(($(date +%s) - t0))" | tee -a "$out/summary.txt"
}

case "${1:-run}" in
stage)
  shift
  stage "$@"
  ;;
run) run ;;
*)
  echo "usage: gpu-sockbuf.sh stage DIR [BUILD] | run" >&2
  exit 2
  ;;
esac

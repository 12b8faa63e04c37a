#!/usr/bin/env bash
# gpu-step.sh: the step path on the GPU machine: where a step's time goes, end to end.
#
#   scripts/dev/gpu-step.sh stage   (on the build machine, with nvcc)
#       the same binaries as gpu-e2e.sh (attnd, attnctl, test_backend_cuda,
#       attnd_pb2.py and the libraries the GPU machine lacks) packed into
#       build-gpu/stage/gpu-e2e.tar.xz: it runs `gpu-e2e.sh stage` (so
#       GPU_E2E_BUILD / GPU_E2E_NO_BUILD apply), unless that file exists and
#       GPU_STEP_RESTAGE is not 1.
#   scripts/dev/gpu-step.sh run     (on the GPU machine, from the root of the same
#       checkout, with build-gpu/stage/ copied there)
#   scripts/dev/gpu-step.sh hostpath   (on the GPU machine, likewise): only the
#       host path's round, scripts/dev/gpu-hostpath.sh (attnctl bench: a
#       4,096-token prefill over the Unix socket and TCP, 16 x 4,096 in one
#       step, decode at 1/16/64 sessions, with the per-phase breakdown; ~230 s)
#
# Steps of `run`, each under its own timeout, logs and JSON in $OUT (default
# ./gpu-step-out), within GPU_STEP_BUDGET seconds (default 300; a step that
# would start after it is skipped, so a limit on the whole command still
# leaves the summary):
#   1. nvidia-smi; ldd of the binaries;
#   2. test_backend_cuda --trace (the CUDA backend against the CPU backend with
#      the per-step CUDA events on: the step trace's device phases are set);
#   3. bench/bench_e2e.py --backend cuda, 8B shape (32 layers, 32/8 heads,
#      d 128): sessions 1,16,64 at 4,096 over the Unix socket, then 1,16 over
#      loopback TCP, 16 tokens each, one 4,096-token prefill layer step per
#      transport, PyTorch's in-process attention beside it, and on the Unix
#      socket each decode case again over same-host zero-copy (ipc: torch
#      tensors on the GPU by reference); --step-trace only
#      (no CUDA events: the latencies as served). With ipc the contexts are
#      filled by reference (64 sessions to 4,096 is 34 GB of k+v, minutes over
#      the socket); cases run small first, so a timeout keeps the first ones;
#   3b. with GPU_STEP_BASELINE=<an older attnd>, bench_e2e.py against it too
#      (1 and 16 sessions, Unix socket, no --step-trace): before/after in one run;
#   4. the same, 16 sessions, Unix socket only, with --cuda-trace: the device
#      phases (h2d, kwrite, attend, d2h) of decode and prefill steps;
#   4b. tests/e2e/test_torch_client.py (torch tensors in and out, bf16 stays
#      bf16) against the CUDA daemon;
#   4c. bench/bench_generate.py: generate() tokens/s of a random 8-layer Llama
#      (32/8 heads, d 128) with sdpa, attnd over the socket and attnd by
#      reference, batch 1 and 16, in one process (needs transformers);
#   5. attnctl bench (1 session at 4,096 and 16 at 512, depth 1
#      and 32) against one daemon.
# It always ends with a table of the key numbers, then one line:
#   GPU-STEP SUMMARY: pass=N fail=M skip=K | step=result ...
# Record the numbers (before/after per phase) in bench/RESULTS.md.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)

case "${1:-run}" in
stage)
  if [ -f "$here/build-gpu/stage/gpu-e2e.tar.xz" ] && [ "${GPU_STEP_RESTAGE:-0}" != 1 ]; then
    echo "build-gpu/stage/gpu-e2e.tar.xz exists (GPU_STEP_RESTAGE=1 rebuilds it)"
    exit 0
  fi
  exec bash "$here/scripts/dev/gpu-e2e.sh" stage
  ;;
run) ;;
hostpath) exec bash "$here/scripts/dev/gpu-hostpath.sh" ;;
*)
  echo "usage: $0 stage|run|hostpath" >&2
  exit 2
  ;;
esac

out=${OUT:-$PWD/gpu-step-out}
# GPU_STEP_BACKEND=cpu: the same run on the CPU backend with small shapes (to
# check the script anywhere); the build machine's build/ is then enough.
backend=${GPU_STEP_BACKEND:-cuda}
if [ "$backend" = cpu ]; then
  e2e_args=(--backend cpu --sessions 1,4 --context 256 --tokens 8 --prefill 512)
  e2e_tcp_args=(--backend cpu --sessions 1 --context 256 --tokens 8 --prefill 512)
  e2e_trace_args=(--backend cpu --sessions 4 --context 256 --tokens 8 --prefill 512)
  daemon_shape=(--backend cpu --layers 4 --q-heads 8 --kv-heads 2 --head-dim 64 --kv-memory 512M)
  ctl=("--sessions 1 --prompt 256 --steps 64" "--sessions 16 --prompt 256 --steps 64"
    "--sessions 16 --prompt 256 --steps 64 --depth 32")
else
  e2e_args=(--backend cuda --sessions 1,16,64 --context 4096 --tokens 16 --prefill 4096 --no-cuda-trace)
  e2e_tcp_args=(--backend cuda --sessions 1,16 --context 4096 --tokens 16 --prefill 4096 --no-cuda-trace)
  e2e_trace_args=(--backend cuda --sessions 16 --context 4096 --tokens 8 --prefill 4096)
  daemon_shape=(--backend cuda --kv-memory 0)
  # attnctl prefills every session in one step per layer, with q and output:
  # 16 sessions at 4,096 would be 1.3 GB frames, so 16 sessions get 512 here
  # (bench_e2e.py has the 16 x 4,096 decode).
  ctl=("--sessions 1 --prompt 4096 --steps 64" "--sessions 16 --prompt 512 --steps 64"
    "--sessions 16 --prompt 512 --steps 64 --depth 32")
fi
mkdir -p "$out"
t_begin=$(date +%s)
budget=${GPU_STEP_BUDGET:-300}
results=()
npass=0
nfail=0
nskip=0
keys=()

summary() {
  {
    echo "| key numbers | |"
    echo "|---|---|"
    local k
    for k in "${keys[@]}"; do echo "| ${k%%=*} | ${k#*=} |"; done
    echo "GPU-STEP SUMMARY: pass=$npass fail=$nfail skip=$nskip | ${results[*]}"
  } | tee "$out/summary.txt"
}
trap summary EXIT

record() { # NAME RC: 0 pass, 77 skip, else fail (124: timed out)
  local name=$1 rc=$2 what
  case $rc in
  0) what=pass; npass=$((npass + 1)) ;;
  77) what=skip; nskip=$((nskip + 1)) ;;
  124 | 137) what=timeout; nfail=$((nfail + 1)) ;;
  *) what="fail($rc)"; nfail=$((nfail + 1)) ;;
  esac
  results+=("$name=$what")
  echo "== $name: $what"
}

left() { # seconds of the budget left
  echo $((budget - ($(date +%s) - t_begin)))
}

# tmo WANT: WANT, or what is left of the budget if less; 0 when under 20 s.
tmo() {
  local l
  l=$(left)
  if [ "$l" -lt 20 ]; then echo 0; elif [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi
}

bindir=
[ "$backend" = cpu ] || for t in "$here/build-gpu/stage/gpu-e2e.tar.xz" "$here/build-gpu/gpu-e2e.tar.xz"; do
  if [ -f "$t" ]; then
    bindir=${TMPDIR:-/tmp}/gpu-step-bin
    rm -rf "$bindir" && mkdir -p "$bindir" && xz -dc "$t" | tar -C "$bindir" -xf -
    break
  fi
done
find_file() {
  local d
  local dirs=("$bindir" "$here/build-gpu/stage" "$here/build-gpu" "$here/build-gpu/daemon"
    "$here/build-gpu/tests" "$here/build-gpu/client" "$here/build-gpu/python")
  [ "$backend" = cpu ] && dirs=("$here/build/daemon" "$here/build/client" "$here/build/python")
  for d in "${dirs[@]}"; do
    if [ -n "$d" ] && [ -f "$d/$1" ]; then
      echo "$d/$1"
      return 0
    fi
  done
  return 1
}
attnd_bin=$(find_file attnd || true)
test_bin=$(find_file test_backend_cuda || true)
attnctl_bin=$(find_file attnctl || true)
pb2=$(find_file attnd_pb2.py || true)
libdir=$(dirname "${attnd_bin:-${test_bin:-$here/build-gpu/stage/x}}")
export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
[ -n "$pb2" ] && export ATTND_PB2_DIR=$(dirname "$pb2")

# ---- 1. the machine --------------------------------------------------------------
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
$py -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" 2>&1 | tee "$out/python.txt"
if [ -z "$attnd_bin" ] || [ -z "$pb2" ]; then
  echo "attnd or attnd_pb2.py not found: run '$0 stage' and copy build-gpu/stage/"
  record binaries 1
  exit 1
fi
for b in "$attnd_bin" "$test_bin" "$attnctl_bin"; do
  [ -n "$b" ] && { echo "## $b"; ldd "$b"; } >>"$out/ldd.txt" 2>&1
done
if grep -q "not found" "$out/ldd.txt"; then
  grep "not found" "$out/ldd.txt"
  record libraries 1
fi

# ---- 2. the backend test with the per-step trace ------------------------------------
t=$(tmo 45)
if [ -n "$test_bin" ] && [ "$t" -gt 0 ] && [ "$backend" = cuda ]; then
  (cd "$libdir" && timeout "$t" "$test_bin" --trace) >"$out/test_backend_cuda_trace.log" 2>&1
  rc=$?
  grep -E "device:|PASSED|FAILED|\[  (ERROR|FAILED) \]" "$out/test_backend_cuda_trace.log" | head -20
  record test_backend_cuda_trace $rc
else
  record test_backend_cuda_trace 77
fi

# key_rows FILE.json PREFIX: the bench's key numbers into the summary table.
key_rows() {
  local line
  while IFS= read -r line; do keys+=("$line"); done < <($py - "$1" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
p = sys.argv[2]
for c in r["cases"]:
    if "skipped" in c:
        print(f"{p} {c['transport']}=skipped: {c['skipped']}")
        continue
    t = c.get("torch_token_p50_us")
    print(f"{p} {c['transport']} decode {c['sessions']}x{r['context']}=token p50 {c['token_p50_us']:.0f} us "
          f"(torch {t:.0f} us)" if t else
          f"{p} {c['transport']} decode {c['sessions']}x{r['context']}=token p50 {c['token_p50_us']:.0f} us (torch n/a)")
    print(f"{p} {c['transport']} layer step {c['sessions']}x{r['context']}=RT p50 {c['layer_p50_us']:.1f} us, "
          f"computing {c['computing_p50_us']:.1f} us")
for f in r["prefill"]:
    print(f"{p} {f['transport']} prefill {f['tokens']}=RT p50 {f['rt_p50_us'] / 1e3:.2f} ms, {f['gb_s']:.2f} GB/s")
for t in r["trace"]:
    ph = " ".join(f"{k} {v[0]:.0f}" for k, v in t["phases"].items())
    print(f"{p} trace {t['kind']} ({t['steps']})=p50 us: {ph}")
EOF
  )
}

# ---- 3. the end-to-end benchmark, as served (Unix socket, then loopback TCP) ----------
# On the Unix socket each case also runs over same-host zero-copy (transport
# ipc: torch tensors on the GPU by reference, same sessions, right after the
# bytes run; skipped without torch or on the CPU backend).
for tr in unix tcp; do
  if [ $tr = unix ]; then want=130 args=("${e2e_args[@]}"); else want=60 args=("${e2e_tcp_args[@]}"); fi
  trs=$tr
  [ $tr = unix ] && trs=unix,ipc
  t=$(tmo $want)
  if [ "$t" -gt 0 ]; then
    timeout "$t" $py "$here/bench/bench_e2e.py" --attnd "$attnd_bin" "${args[@]}" \
      --transports $trs --json "$out/e2e-$tr.json" --log "$out/attnd-e2e-$tr.log" >"$out/e2e-$tr.txt" 2>&1
    rc=$?
    tail -25 "$out/e2e-$tr.txt"
    record bench_e2e_$tr $rc
    [ -f "$out/e2e-$tr.json" ] && key_rows "$out/e2e-$tr.json" served
  else
    record bench_e2e_$tr 77
  fi
done

# ---- 3b. the baseline: an older attnd (GPU_STEP_BASELINE=path), Unix socket ----------
# For before/after in one run: stage the older build's attnd next to this one
# (same libraries) and name it; it runs without --step-trace.
if [ -n "${GPU_STEP_BASELINE:-}" ] && [ -x "$GPU_STEP_BASELINE" ]; then
  t=$(tmo 90)
  if [ "$t" -gt 0 ]; then
    timeout "$t" $py "$here/bench/bench_e2e.py" --attnd "$GPU_STEP_BASELINE" "${e2e_tcp_args[@]}" \
      --transports unix --no-step-trace --json "$out/e2e-baseline.json" \
      --log "$out/attnd-e2e-baseline.log" >"$out/e2e-baseline.txt" 2>&1
    rc=$?
    tail -12 "$out/e2e-baseline.txt"
    record bench_e2e_baseline $rc
    [ -f "$out/e2e-baseline.json" ] && key_rows "$out/e2e-baseline.json" baseline
  else
    record bench_e2e_baseline 77
  fi
fi

# ---- 4. the device phases (--cuda-trace) ----------------------------------------------
t=$(tmo 45)
if [ "$t" -gt 0 ]; then
  timeout "$t" $py "$here/bench/bench_e2e.py" --attnd "$attnd_bin" "${e2e_trace_args[@]}" \
    --transports unix --trace-window 64 --json "$out/e2e-trace.json" --log "$out/attnd-e2e-trace.log" >"$out/e2e-trace.txt" 2>&1
  rc=$?
  tail -12 "$out/e2e-trace.txt"
  record bench_e2e_cuda_trace $rc
  [ -f "$out/e2e-trace.json" ] && key_rows "$out/e2e-trace.json" traced
else
  record bench_e2e_cuda_trace 77
fi

# ---- 4b. torch tensors through the Python client, on the CUDA daemon ------------------
t=$(tmo 60)
if [ "$t" -gt 0 ]; then
  (cd "$here/tests/e2e" && env ATTND_E2E_BACKEND="$backend" ATTND_BIN="$attnd_bin" ATTND_BUILD_DIR="$libdir" \
    PYTHONPATH="${ATTND_PB2_DIR:-}:$here/client/python:$here/tests/e2e" timeout "$t" $py run.py test_torch_client) \
    >"$out/torch_client.log" 2>&1
  rc=$?
  grep -E "^(Ran|OK|FAILED)|Error|SKIPPED" "$out/torch_client.log" | head -10
  record torch_client $rc
else
  record torch_client 77
fi

# ---- 4c. generate() tokens/s: attnd (socket, zero-copy) beside sdpa --------------------
t=$(tmo 90)
if [ "$t" -gt 0 ] && [ "$backend" = cuda ]; then
  timeout "$t" $py "$here/bench/bench_generate.py" --attnd "$attnd_bin" --budget $((t - 25)) \
    --json "$out/generate.json" >"$out/generate.txt" 2>&1
  rc=$?
  tail -12 "$out/generate.txt"
  record bench_generate $rc
  while IFS= read -r l; do keys+=("$l"); done < <(sed -n 's/^| \(sdpa\|socket\|ipc\) | \([0-9]*\) | \([0-9.]*\) | \([0-9.]*\) |.*/generate \1 batch \2=\3 tok\/s (decode \4 tok\/s)/p' "$out/generate.txt")
else
  record bench_generate 77
fi

# ---- 5. attnctl bench (round trips per layer and per token) --------------------------------------------
t=$(tmo 50)
if [ -n "$attnctl_bin" ] && [ "$t" -gt 0 ]; then
  dtmp=$(mktemp -d /tmp/gpu-step-XXXXXX)
  "$attnd_bin" --socket "$dtmp/attnd.sock" --listen "" --metrics "" --state-dir "$dtmp" \
    "${daemon_shape[@]}" --step-trace 256 >"$out/attnd-attnctl.log" 2>&1 &
  dpid=$!
  for i in $(seq 1 300); do [ -S "$dtmp/attnd.sock" ] && break; sleep 0.1; done
  rc=0
  : >"$out/attnctl-bench.txt"
  for args in "${ctl[@]}"; do
    echo "## attnctl bench $args" >>"$out/attnctl-bench.txt"
    # shellcheck disable=SC2086
    timeout $(($(tmo 20) > 0 ? $(tmo 20) : 1)) "$attnctl_bin" --socket "$dtmp/attnd.sock" bench $args \
      --seed $RANDOM >>"$out/attnctl-bench.txt" 2>&1 || rc=$?
  done
  kill -TERM $dpid 2>/dev/null
  wait $dpid
  drc=$?
  [ $rc = 0 ] && rc=$drc
  grep -E "^## |^(prefill layer|decode layer|  in daemon|decode token)" "$out/attnctl-bench.txt" | head -20
  while IFS= read -r l; do keys+=("$l"); done < <(awk '
    /^## attnctl bench/ { sub(/^## attnctl bench /, ""); sub(/ --steps [0-9]+/, ""); a = $0 }
    /^(prefill layer|decode layer|decode token) / { print "attnctl " a " " $1 " " $2 "=p50 " $4 " ms, p99 " $5 " ms" }
  ' "$out/attnctl-bench.txt")
  rm -rf "$dtmp"
  record attnctl_bench $rc
else
  record attnctl_bench 77
fi
[ $nfail = 0 ] && [ $npass -gt 0 ]

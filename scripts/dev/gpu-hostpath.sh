#!/usr/bin/env bash
# gpu-hostpath.sh: the host path of a step on the GPU machine, in one command:
# where a large step's time goes and what a small step costs beside its kernels.
#
#   scripts/dev/gpu-step.sh stage      (build machine: the same staging as gpu-e2e.sh)
#   scripts/dev/gpu-hostpath.sh        (GPU machine, from the root of the checkout,
#                                       with build-gpu/stage/ copied there)
#
# Everything goes through attnctl bench (the C client) against attnd --backend
# cuda with --step-trace, the 8B shape (32 q / 8 kv heads, d 128, bf16), one
# fresh daemon per case so that its step_trace lines are the case's own:
#   1. prefill: 1 session x 4,096 tokens, one layer step (48 MiB in, 32 MiB out),
#      8 times each over the Unix socket and over loopback TCP (a 2-layer daemon:
#      the per-layer cost is the same, the run is shorter);
#   2. prefill: 16 sessions x 4,096 in one layer step (768 MiB in, 512 MiB out),
#      Unix socket, 3 times (the first step of a size pays its pinned
#      allocation; the p50 of 6 does not): linear in the bytes?
#   3. decode layer steps at 4,096 tokens of context, 1 / 16 / 64 sessions,
#      depth 1 and 8 (layer steps in flight on the connection), Unix socket
#      (an 8-layer daemon; the sessions are filled 4 per prefill step, once:
#      the depth-8 run finds its prompts in the prefix cache), and depth 1
#      again with the client busy-polling for its answers (attnctl bench
#      --spin 300: what a sleeping client's wakeup costs);
#   4. decode at 1 and 16 sessions again with attnd --busy-poll-us 300 (the
#      daemon's loop polls instead of sleeping while traffic flows).
# Per case: the round trip's p50/p99, the daemon's total and computing time
# (the responses' Timing), the client's phases (encode, send, wait, read,
# parse; attnd_client_phases) and the daemon's step_trace p50s (read, scan,
# h2d, kwrite, attend, d2h, encode, write). Logs and JSON in $OUT (default
# ./gpu-hostpath-out), within GPU_HOSTPATH_BUDGET seconds (default 230: a case
# that would start after it is skipped). GPU_HOSTPATH_CASES (default "prefill
# decode") picks the groups; GPU_HOSTPATH_MODES (default "base") runs each
# decode case once per small-step mode, same build, same run (A/B): base (the
# defaults), loop (--cuda-completion loop), graphs (--cuda-graphs), both, and
# parts joined by + (trace: --cuda-trace, e.g. both+trace; hf64: --cuda-hostfn-min
# 64K, frames and outputs of 64 KiB and more pinned; capture: --cuda-graph-replay
# false, every graphed step captured and updated); rows of a mode
# other than base are named decode_SxP_MODE. It always ends
# with the summary table, then one line:
#   GPU-HOSTPATH SUMMARY: pass=N fail=M skip=K | case=result ...
# GPU_HOSTPATH_SESSIONS and GPU_HOSTPATH_LAYERS change the decode cases' sessions
# (default "1 16 64") and the daemon's layers (default 8).
# GPU_STEP_BACKEND=cpu: the same on the CPU backend with cheap compute (every
# layer a sliding window of 1 key, so the host path dominates) and fewer
# sessions, from build/ (to check the script anywhere).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$PWD/gpu-hostpath-out}
backend=${GPU_STEP_BACKEND:-cuda}
budget=${GPU_HOSTPATH_BUDGET:-230}
py=${PYTHON:-python3}
mkdir -p "$out"
t_begin=$(date +%s)
results=()
rows=()
npass=0
nfail=0
nskip=0

summary() {
  {
    echo
    echo "| case | RT p50 / p99 ms | daemon total | computing | client send | wait | read | daemon read | scan | h2d | attend | d2h | encode | write (p50 ms) | GB/s |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    local r
    for r in "${rows[@]}"; do echo "$r"; done
    [ -f "$out/counters.txt" ] && cat "$out/counters.txt"
    echo "GPU-HOSTPATH SUMMARY: pass=$npass fail=$nfail skip=$nskip | ${results[*]}"
  } | tee "$out/summary.txt"
}
trap summary EXIT

record() { # NAME RC
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

left() { echo $((budget - ($(date +%s) - t_begin))); }

# ---- the binaries -------------------------------------------------------------------
bindir=
if [ "$backend" = cpu ]; then
  attnd_bin=$here/build/daemon/attnd
  attnctl_bin=$here/build/client/attnctl
else
  for t in "$here/build-gpu/stage/gpu-e2e.tar.xz" "$here/build-gpu/gpu-e2e.tar.xz"; do
    if [ -f "$t" ]; then
      bindir=${TMPDIR:-/tmp}/gpu-hostpath-bin
      rm -rf "$bindir" && mkdir -p "$bindir" && xz -dc "$t" | tar -C "$bindir" -xf -
      break
    fi
  done
  attnd_bin=
  attnctl_bin=
  for d in "$bindir" "$here/build-gpu/stage" "$here/build-gpu/daemon" "$here/build-gpu/client" "$here/build-gpu"; do
    [ -n "$d" ] || continue
    [ -z "$attnd_bin" ] && [ -f "$d/attnd" ] && attnd_bin=$d/attnd
    [ -z "$attnctl_bin" ] && [ -f "$d/attnctl" ] && attnctl_bin=$d/attnctl
  done
  libdir=$(dirname "${attnd_bin:-/x/x}")
  export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [ ! -x "${attnd_bin:-}" ] || [ ! -x "${attnctl_bin:-}" ]; then
  echo "attnd or attnctl not found: run 'scripts/dev/gpu-step.sh stage' and copy build-gpu/stage/"
  record binaries 1
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

if [ "$backend" = cpu ]; then
  shape=(--backend cpu --q-heads 32 --kv-heads 8 --head-dim 128 --attention-windows 1 --kv-memory 2G)
  big_sessions=2 dec_sessions=(1 4) dec_prompt=1024 dec_layers=4 dec_steps=16
else
  shape=(--backend cuda --kv-memory 24G)
  big_sessions=16 dec_sessions=(1 16 64) dec_prompt=4096 dec_layers=8 dec_steps=64
fi
# GPU_HOSTPATH_SESSIONS="1 16" and GPU_HOSTPATH_LAYERS=80 change the decode cases'
# sessions and the daemon's layers (e.g. an 80-layer model's streams, 10 layers each).
[ -n "${GPU_HOSTPATH_SESSIONS:-}" ] && read -r -a dec_sessions <<<"$GPU_HOSTPATH_SESSIONS"
dec_layers=${GPU_HOSTPATH_LAYERS:-$dec_layers}

# row NAME JSONFILE LOGFILE KIND INDEX: one summary row from attnctl's JSON and
# the daemon's INDEX-th step_trace line of KIND (prefill or decode; -1: the last).
row() {
  "$py" - "$@" <<'EOF'
import json, re, sys
name, jf, lf, kind, index = sys.argv[1:6]
try:
    j = json.loads(open(jf).read().strip().splitlines()[-1])
except Exception as e:
    print(f"| {name} | no result ({e.__class__.__name__}) |"); sys.exit(0)
k = "prefill" if kind == "prefill" else "decode"
def p(key, q="p50_ms"):
    v = j.get(key, {}).get(q)
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")
rt = f"{p(k + '_layer_step')} / {p(k + '_layer_step', 'p99_ms')}"
lines = []
for line in open(lf, errors="replace"):
    m = re.search(r"event=step_trace\b.*?kind=(\w+) steps=(\d+) stat=p50/p90(.*)$", line)
    if m and m.group(1) == k:
        lines.append({a: float(b) / 1e3 for a, b in re.findall(r"(\w+)_us=([\d.]+)/", m.group(3))})
i = int(index)
tr = lines[i] if -len(lines) <= i < len(lines) else {}
def t(x):
    v = tr.get(x)
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")
gbs = "-"
st = j.get(k + "_layer_step", {}).get("p50_ms")
if k == "prefill" and st:
    rows = j["prefill_tokens"] / max(1, j.get("prefill", {}).get("count", 1))
    # q, k, v in and the output back: (32 + 8 + 8 + 32) heads x 128 x 2 bytes a row
    gbs = f"{rows * 80 * 256 / (st * 1e-3) / 1e9:.2f}"
cells = [rt, p(k + "_layer_server_total"), p(k + "_layer_server_compute"),
         p(k + "_layer_client_send"), p(k + "_layer_client_wait"), p(k + "_layer_client_read"),
         t("read"), t("scan"), t("h2d"), t("attend"), t("d2h"), t("encode"), t("write"), gbs]
print(f"| {name} | " + " | ".join(cells) + " |")
EOF
}

# run_case NAME TRANSPORT LAYERS WANT_S KIND TRACE_N "SUB=BENCH ARGS"... [-- DAEMON ARGS...]
# One daemon (--step-trace TRACE_N), then one attnctl bench per SUB against it
# (a later SUB with the same --seed finds the prompts in the prefix cache:
# no second fill); the SUB-th step_trace line of KIND is that SUB's.
run_case() {
  local name=$1 tr=$2 layers=$3 want=$4 kind=$5 tn=$6
  shift 6
  local subs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    subs+=("$1")
    shift
  done
  [ "${1:-}" = -- ] && shift
  if [ "$(left)" -lt 15 ]; then
    record "$name" 77
    return
  fi
  local dtmp dpid port addr i sub sname bargs t idx
  dtmp=$(mktemp -d /tmp/gpu-hostpath-XXXXXX)
  "$attnd_bin" --socket "$dtmp/attnd.sock" --listen 127.0.0.1:0 --metrics 127.0.0.1:0 --state-dir "$dtmp" \
    "${shape[@]}" --layers "$layers" --step-trace "$tn" "$@" >"$out/attnd-$name.log" 2>&1 &
  dpid=$!
  for _ in $(seq 1 600); do
    grep -q "event=ready" "$out/attnd-$name.log" 2>/dev/null && break
    kill -0 $dpid 2>/dev/null || break
    sleep 0.05
  done
  port=$(sed -n 's/.*event=listening tcp=[^ ]* port=\([0-9]*\).*/\1/p' "$out/attnd-$name.log" | head -1)
  if [ "$tr" = tcp ]; then addr=(--tcp "127.0.0.1:$port"); else addr=(--socket "$dtmp/attnd.sock"); fi
  local rcs=()
  for i in "${!subs[@]}"; do
    sub=${subs[$i]}
    sname=$name${sub%%=*}
    bargs=${sub#*=}
    t=$(left)
    [ "$t" -gt "$want" ] && t=$want
    if [ "$t" -lt 10 ]; then
      rcs+=(77)
      continue
    fi
    # shellcheck disable=SC2086
    timeout "$t" "$attnctl_bin" "${addr[@]}" --json bench $bargs >"$out/$sname.json" 2>"$out/$sname.err"
    rcs+=($?)
  done
  # The daemon's graph counters after the case (steps graphed, replayed, graphs made).
  local mport
  mport=$(sed -n 's/.*event=metrics_listening addr=[^ ]* port=\([0-9]*\).*/\1/p' "$out/attnd-$name.log" | head -1)
  if [ -n "$mport" ]; then
    echo "$name $(timeout 5 "$py" -c 'import sys,urllib.request as u; print(" ".join(l.split(" ")[0][17:]+"="+l.split(" ")[1] for l in u.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1]).read().decode().splitlines() if l.startswith("attnd_cuda_graph")))' "$mport" 2>&1 | tail -1)" >>"$out/counters.txt"
  fi
  kill -TERM $dpid 2>/dev/null
  wait $dpid
  rm -rf "$dtmp"
  for i in "${!subs[@]}"; do
    sub=${subs[$i]}
    sname=$name${sub%%=*}
    record "$sname" "${rcs[$i]}"
    if [ "$kind" = prefill ]; then idx=-1; else idx=$i; fi
    rows+=("$(row "$sname" "$out/$sname.json" "$out/attnd-$name.log" "$kind" "$idx")")
    echo "${rows[-1]}"
  done
}

cases=" ${GPU_HOSTPATH_CASES:-prefill decode} "
modes=${GPU_HOSTPATH_MODES:-base}
mode_args() { # MODE: the daemon's flags of a small-step mode (parts joined by +)
  local p
  for p in ${1//+/ }; do
    case $p in
    base) ;;
    loop) echo --cuda-completion loop ;;
    graphs) echo --cuda-graphs ;;
    both) echo --cuda-completion loop --cuda-graphs ;;
    trace) echo --cuda-trace ;;
    busy) echo --busy-poll-us 300 ;;
    hf64) echo --cuda-hostfn-min 64K ;;
    capture) echo --cuda-graph-replay false ;;
    *) echo "unknown GPU_HOSTPATH_MODES part '$p'" >&2 ;;
    esac
  done
}
if [[ $cases == *" prefill "* ]]; then
  # ---- 1. one 4,096-token prefill layer step, Unix socket and TCP -------------------------
  for tr in unix tcp; do
    run_case "prefill_1x4096_$tr" $tr 2 40 prefill 65536 "=--sessions 1 --prompt 4096 --steps 0 --repeat 8"
  done
  # ---- 2. 16 x 4,096 in one layer step ----------------------------------------------------
  run_case "prefill_${big_sessions}x4096_unix" unix 2 60 prefill 65536 \
    "=--sessions $big_sessions --prompt 4096 --steps 0 --repeat 3" -- --max-frame 1G --max-inflight 2G
fi
if [[ $cases == *" decode "* ]]; then
  # ---- 3. decode layer steps at 4,096, depth 1 then 8 (the second run hits the prefix cache),
  # once per small-step mode ----------------------------------------------------------------
  for s in "${dec_sessions[@]}"; do
    for m in $modes; do
      b="--sessions $s --prompt $dec_prompt --prefill-sessions 4 --steps $dec_steps --seed 7"
      suffix=
      [ "$m" = base ] || suffix=_${m//+/-}
      # shellcheck disable=SC2046
      run_case "decode_${s}x${dec_prompt}$suffix" unix $dec_layers 90 decode $((dec_steps * dec_layers)) \
        "_d1=$b --depth 1" "_d8=$b --depth 8" "_d1spin=$b --depth 1 --spin 300" -- $(mode_args "$m")
    done
  done
fi
[ $nfail = 0 ] && [ $npass -gt 0 ]

#!/usr/bin/env bash
# sandbox-check.sh: runs attnd on the CUDA backend under the sandbox of its
# systemd unit, and checks that it computes: Health says cuda, and the tiny
# Llama example generates and matches numpy attention layer by layer.
#
#   sudo deploy/sandbox-check.sh [--unit FILE] [--attnd BIN] [--attnctl BIN]
#                                [--example tiny_llama.py] [--backend cuda|cpu] [--dry-run]
#
# Needs a host booted with systemd, the NVIDIA driver with the nvidia and
# nvidia-uvm modules loaded (see the unit's comments), the attnd user (the
# package's postinst creates it) and python3 with numpy, protobuf and the attnd
# package (the .deb's, or PYTHONPATH=BUILD/python:client/python). The daemon
# runs as a transient unit, attnd-sandbox-check, with every [Service] setting
# of the unit except how it is started and restarted, a socket and state
# directory of its own and a small model shape, so it can run beside a
# production attnd. --dry-run prints the systemd-run command and exits.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
unit=$here/attnd.service
attnd=/usr/bin/attnd
attnctl=/usr/bin/attnctl
example=/usr/share/doc/attnd/examples/tiny_llama.py
backend=cuda
dry=0
while [ $# -gt 0 ]; do
  case $1 in
    --unit) unit=$2; shift 2 ;;
    --attnd) attnd=$2; shift 2 ;;
    --attnctl) attnctl=$2; shift 2 ;;
    --example) example=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "sandbox-check: unknown argument $1" >&2; exit 2 ;;
  esac
done

name="attnd-sandbox-check"
sock=/run/$name/attnd.sock

# The unit's [Service] settings as systemd-run properties, minus the ones that
# say how this unit is started, supervised and where it keeps its files.
props=()
while IFS= read -r line; do
  props+=("-p" "$line")
done < <(awk '
  /^\[/ { svc = ($0 == "[Service]"); next }
  !svc || /^[ \t]*(#|;|$)/ { next }
  {
    key = $0; sub(/=.*/, "", key)
    if (key ~ /^(Type|NotifyAccess|ExecStart|ExecReload|Restart|RestartSec|RestartForceExitStatus|WatchdogSec|TimeoutStartSec|TimeoutStopSec|RuntimeDirectory|StateDirectory)$/) next
    print
  }' "$unit")

cmd=(systemd-run --unit="$name" --collect -p Type=notify -p NotifyAccess=main
  -p RuntimeDirectory="$name" -p StateDirectory="$name" "${props[@]}"
  "$attnd" --backend "$backend" --socket "$sock" --listen= --metrics=
  --state-dir "/var/lib/$name" --layers 2 --q-heads 4 --kv-heads 2 --head-dim 64
  --block-size 16 --kv-memory 256M)

if [ "$dry" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "sandbox-check: run as root (it starts a system unit)" >&2
  exit 2
fi

fail=0
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  systemctl stop "$name" >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "== starting $name under the settings of $unit"
# Type=notify: systemd-run returns once attnd said READY=1 (the KV cache is allocated).
"${cmd[@]}"
echo "== systemd-analyze security $name (the live unit)"
systemd-analyze security --no-pager "$name" | tail -1 || true
echo "== attnctl health"
health=$("$attnctl" --socket "$sock" --json health)
echo "$health"
case $health in
  *"\"backend\":\"$backend\""*) ;;
  *) echo "sandbox-check: FAIL: the daemon does not serve on the $backend backend" >&2; fail=1 ;;
esac
echo "== $example (tiny Llama, attention in attnd)"
if ! python3 "$example" --socket "$sock" --prompt 24 --tokens 32; then
  echo "sandbox-check: FAIL: the tiny Llama example failed under the sandbox" >&2
  fail=1
fi
echo "== journal of $name"
journalctl -u "$name" --no-pager -o cat | tail -40
if journalctl -u "$name" --no-pager -o cat | grep -Eiq 'level=error|cuda.*(error|fail)|Operation not permitted'; then
  echo "sandbox-check: FAIL: errors in the journal (above)" >&2
  fail=1
fi
if [ "$fail" = 0 ]; then
  echo "sandbox-check: PASS: attnd computes on the $backend backend under the unit's sandbox"
fi
exit "$fail"

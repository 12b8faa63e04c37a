#!/usr/bin/env bash
# sandbox-check.sh: runs attnd on the CUDA backend under the sandbox of its
# systemd unit, and checks that it computes: Health says cuda, and the tiny
# Llama example generates and matches numpy attention layer by layer.
#
#   sudo deploy/sandbox-check.sh [--unit FILE] [--attnd BIN] [--attnctl BIN]
#                                [--example tiny_llama.py] [--backend cuda|cpu] [--dry-run]
#                                [--python PYTHON3]
#   deploy/sandbox-check.sh --no-systemd --sandbox-exec BUILD/deploy/attnd-sandbox-exec [...]
#
# Needs a host booted with systemd, the NVIDIA driver with the nvidia and
# nvidia-uvm modules loaded (see the unit's comments), the attnd user (the
# package's postinst creates it) and python3 with numpy, protobuf and the attnd
# package (the .deb's, or PYTHONPATH=BUILD/python:client/python). The daemon
# runs as a transient unit, attnd-sandbox-check, with every [Service] setting
# of the unit except how it is started and restarted, a socket and state
# directory of its own and a small model shape, so it can run beside a
# production attnd. --dry-run prints the systemd-run command and exits.
#
# --no-systemd is for a host or container where systemd cannot start units (a
# Kubernetes pod, CI, a GPU box without systemd as PID 1). It runs the daemon
# under attnd-sandbox-exec (deploy/sandbox/attnd_sandbox_exec.c, built when
# libseccomp-dev is installed) with the unit's SystemCallFilter=,
# SystemCallErrorNumber=, SystemCallArchitectures=, RestrictAddressFamilies=,
# NoNewPrivileges=, LockPersonality= and RestrictNamespaces=, as its own user,
# and checks DevicePolicy=closed + DeviceAllow= after the fact: every device
# the running daemon holds open must be one the unit allows. The mount
# settings (ProtectSystem=, ProtectHome=, PrivateTmp=, ProtectProc=, ...) are
# not applied in this mode; the systemd mode covers them.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
unit=$here/attnd.service
attnd=/usr/bin/attnd
attnctl=/usr/bin/attnctl
example=/usr/share/doc/attnd/examples/tiny_llama.py
backend=cuda
dry=0
nosystemd=0
sandbox_exec=
python=python3
while [ $# -gt 0 ]; do
  case $1 in
    --unit) unit=$2; shift 2 ;;
    --attnd) attnd=$2; shift 2 ;;
    --attnctl) attnctl=$2; shift 2 ;;
    --example) example=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --no-systemd) nosystemd=1; shift ;;
    --sandbox-exec) sandbox_exec=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    -h | --help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "sandbox-check: unknown argument $1" >&2; exit 2 ;;
  esac
done

# ---- --no-systemd: the unit's system call sandbox without systemd ----------
# unit_values KEY: the values of every KEY= line of [Service], one line each.
unit_values() {
  awk -v key="$1" '
    /^\[/ { svc = ($0 == "[Service]"); next }
    !svc || /^[ \t]*(#|;|$)/ { next }
    { k = $0; sub(/=.*/, "", k); if (k == key) { v = $0; sub(/^[^=]*=/, "", v); print v } }' "$unit"
}

# syscall_list GROUP-OR-NAME... -> the names, one per line: @groups from
# systemd-analyze where it exists, else from deploy/sandbox/<group>.list.
syscall_list() {
  local t
  for t in "$@"; do
    case $t in
    @*)
      local f=$here/sandbox/${t#@}.list
      if command -v systemd-analyze >/dev/null 2>&1; then
        (cd "$tmp" && "$python" "$here/sandbox/expand_filter.py" "$t" && cat "${t#@}.list")
      elif [ -f "$f" ]; then
        cat "$f"
      else
        echo "sandbox-check: no list for $t ($f) and no systemd-analyze" >&2
        return 1
      fi
      ;;
    *) echo "$t" ;;
    esac
  done
}

no_systemd() {
  if [ -z "$sandbox_exec" ] || [ ! -x "$sandbox_exec" ]; then
    echo "sandbox-check: --no-systemd needs --sandbox-exec BIN (attnd-sandbox-exec, built with libseccomp-dev)" >&2
    exit 2
  fi
  tmp=$(mktemp -d)
  local allow=$tmp/allow.list deny=$tmp/deny.list line fams errno_name arch
  : >"$allow"
  : >"$deny"
  while IFS= read -r line; do
    [ -z "$line" ] && continue
    if [ "${line#\~}" != "$line" ]; then
      # shellcheck disable=SC2086  # a list of groups and names
      syscall_list ${line#\~} >>"$deny"
    else
      # shellcheck disable=SC2086
      syscall_list $line >>"$allow"
    fi
  done < <(unit_values SystemCallFilter)
  fams=$(unit_values RestrictAddressFamilies | tr ' ' ',' | paste -sd, -)
  errno_name=$(unit_values SystemCallErrorNumber | tail -1)
  arch=$(unit_values SystemCallArchitectures | tail -1)
  if [ "$arch" != native ]; then
    echo "sandbox-check: SystemCallArchitectures=$arch: only native is emulated" >&2
    exit 2
  fi
  local sock=$tmp/run/attnd.sock state=$tmp/state log=$tmp/attnd.log
  mkdir -p "$tmp/run" "$state"
  local runas=()
  # The unit runs as User=attnd: as root, drop to that user when it exists, else nobody.
  if [ "$(id -u)" = 0 ]; then
    local u=attnd
    id "$u" >/dev/null 2>&1 || u=nobody
    runas=(setpriv --reuid="$u" --regid="$(id -g "$u")" --clear-groups --)
    # A build tree under /root is not reachable for that user: stay root then (said below).
    if "${runas[@]}" test -x "$attnd" -a -x "$sandbox_exec" -a -r "$example" 2>/dev/null; then
      # The daemon refuses a socket directory it does not own: give it to that user.
      chown -R "$u" "$tmp/run" "$state"
      chmod 0755 "$tmp"
    else
      echo "sandbox-check: $u cannot run $attnd from here: running as root (the filter still applies)"
      runas=()
    fi
  fi
  echo "== user: $( [ ${#runas[@]} -gt 0 ] && echo "${runas[1]#--reuid=}" || id -un)"
  echo "== starting attnd under $sandbox_exec (the filter of $unit, errno ${errno_name:-EPERM}, families ${fams:-any})"
  local exec_args=(--allow "$allow" --deny "$deny" --errno "${errno_name:-EPERM}")
  [ -n "$fams" ] && exec_args+=(--families "$fams")
  "${runas[@]}" "$sandbox_exec" "${exec_args[@]}" -- \
    "$attnd" --backend "$backend" --socket "$sock" --listen= --metrics= \
    --state-dir "$state" --layers 2 --q-heads 4 --kv-heads 2 --head-dim 64 \
    --block-size 16 --kv-memory 256M --log-level info >"$log" 2>&1 &
  local pid=$! i fail=0
  for i in $(seq 1 600); do
    [ -S "$sock" ] && "$attnctl" --socket "$sock" health >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
  done
  echo "== attnctl health"
  local health
  health=$("$attnctl" --socket "$sock" --json health 2>&1) || true
  echo "$health"
  case $health in
  *"\"backend\":\"$backend\""*) ;;
  *) echo "sandbox-check: FAIL: the daemon does not serve on the $backend backend" >&2; fail=1 ;;
  esac
  echo "== devices the daemon holds open (DevicePolicy=closed, DeviceAllow= of the unit)"
  local allowed_drivers
  allowed_drivers=$(unit_values DeviceAllow | awk '{print $1}' | sed -n 's/^char-//p')
  local fd target major drv
  for fd in /proc/$pid/fd/*; do
    target=$(readlink "$fd" 2>/dev/null) || continue
    [ -c "$target" ] || continue
    major=$((0x$(stat -L -c %t "$target")))
    # Every name /proc/devices gives that major (195 is nvidia and nvidiactl under the open modules).
    drv=$(awk -v m="$major" '/^Character devices:/ { c = 1; next } /^$/ { c = 0 } c && $1 == m { print $2 }' /proc/devices | paste -sd' ' -)
    case $target in
    # Pseudo devices DevicePolicy=closed always allows (systemd.resource-control(5)).
    /dev/null | /dev/zero | /dev/full | /dev/random | /dev/urandom | /dev/tty | /dev/ptmx | /dev/pts/*)
      echo "  $target ($drv): always allowed" ;;
    *)
      local d ok=
      for d in $drv; do
        printf '%s\n' $allowed_drivers | grep -qx "$d" && ok=$d
      done
      if [ -n "$ok" ]; then
        echo "  $target ($drv): allowed by DeviceAllow=char-$ok"
      else
        echo "sandbox-check: FAIL: $target (driver $drv) is not in the unit's DeviceAllow=" >&2
        fail=1
      fi ;;
    esac
  done
  echo "== $example (tiny Llama, attention in attnd)"
  if ! "$python" "$example" --socket "$sock" --prompt 24 --tokens 32; then
    echo "sandbox-check: FAIL: the tiny Llama example failed under the sandbox" >&2
    fail=1
  fi
  kill -TERM $pid 2>/dev/null || true
  local rc=0
  wait $pid || rc=$?
  echo "== attnd's log"
  tail -40 "$log"
  if [ $rc != 0 ]; then
    echo "sandbox-check: FAIL: attnd exited $rc after SIGTERM" >&2
    fail=1
  fi
  if grep -Eiq 'level=error|cuda.*(error|fail)|Operation not permitted|not permitted' "$log"; then
    echo "sandbox-check: FAIL: errors in the log (above)" >&2
    fail=1
  fi
  rm -rf "$tmp"
  if [ "$fail" = 0 ]; then
    echo "sandbox-check: PASS: attnd computes on the $backend backend under the unit's system call sandbox (no systemd)"
  fi
  exit "$fail"
}
[ "$nosystemd" = 1 ] && no_systemd

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
if ! "$python" "$example" --socket "$sock" --prompt 24 --tokens 32; then
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

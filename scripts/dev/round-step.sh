# round-step.sh: the time budget and step runner of the staged GPU rounds
# (gpu-prefill-ab.sh, gpu-prefill5.sh), sourced by them; their stage copies it
# beside run.sh. Expects $budget (seconds) to be set and $out when a step runs.
t0=$(date +%s)
summary=()
left() { echo $((budget - ($(date +%s) - t0))); }

# step NAME CAP LOG CMD...: CMD under min(CAP, what is left), line-buffered.
step() {
  local name=$1 cap=$2 log=$3
  shift 3
  local l lim s rc took res
  l=$(left)
  if [ "$l" -lt 8 ]; then
    summary+=("$(printf '%-20s %-8s %5s  %s' "$name" skipped - "no time left")")
    return 0
  fi
  lim=$cap
  [ "$lim" -gt "$l" ] && lim=$l
  echo "== $name (limit ${lim} s)"
  s=$(date +%s)
  timeout -k 3 "$lim" stdbuf -oL -eL "$@" >"$out/$log" 2>&1
  rc=$?
  took=$(($(date +%s) - s))
  res=ok
  [ "$rc" -ne 0 ] && res="rc=$rc"
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && res=timeout
  summary+=("$(printf '%-20s %-8s %5s  %s' "$name" "$res" "$took" "$log")")
}

# round_unpack ARCHIVE: sets $out (OUT, else ./gpu-out; created) and $w (a fresh
# folder), records the GPU in $out/gpu.txt (name, driver, clocks), unpacks
# ARCHIVE there, cd's into it and puts its libraries first on LD_LIBRARY_PATH.
round_unpack() {
  out=${OUT:-$PWD/gpu-out}
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    >"$out/gpu.txt" 2>&1
  w=$(mktemp -d)
  tar -C "$w" -xJf "$1" || exit 1
  cd "$w" || exit 1
  export LD_LIBRARY_PATH=$w${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

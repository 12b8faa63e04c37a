#!/usr/bin/env bash
# gpu-hf.sh: the transformers adapter check (attnd.hf + examples/hf_llama.py, and
# examples/hf_models.py: random-weight gpt-oss, Gemma 2, Gemma 3 and Mistral models
# with their per-layer windows, sinks and soft-capping, teacher-forced against the
# model's eager attention within the sdpa-vs-eager floor and generate() tokens
# equal) on the GPU machine, whose python3 has torch and transformers. Two halves:
#
#   scripts/dev/gpu-hf.sh stage [BUILD]   (on the build machine)
#       copies what the GPU machine needs into build-gpu/hf/ (ATTND_HF_DIR):
#         attnd            the daemon from BUILD/daemon/attnd (BUILD defaults to
#                          build-gpu; a CUDA build for sm_90a with the CUDA runtime
#                          linked statically, see scripts/dev/README.md; a CPU-only
#                          build runs the CPU half and the CUDA half is skipped)
#         lib*.so*         the daemon's libraries that Ubuntu 24.04 lacks (libuv,
#                          libinih, libxxhash, libhttp_parser, libjansson; libcudart if linked
#                          dynamically), used by the daemon only
#         attnd_pb2.py     from BUILD/python (protoc 3.21 output loads under protobuf 7)
#         attnd_version.py from BUILD/python (the client package's version)
#       The Python client itself comes from client/python in the working tree.
#   scripts/dev/gpu-hf.sh run         (on the GPU machine, with build-gpu/hf/
#       copied into the same checkout there, or build-gpu/stage/gpu-e2e.tar.xz:
#       its daemon, libraries and attnd_pb2.py serve as well): hf_llama.py (bf16 and fp32 weights), the e2e module
#       test_hf_adapter and hf_models.py (every architecture, bf16 and fp32 weights; at
#       most ATTND_HF_MODELS_BUDGET, 240 s, of its own), with the daemon on the CPU backend and, when the binary
#       and the machine have it, on the CUDA backend. Logs and JSON go to $OUT
#       (or ./gpu-out); the last line printed is the one-line summary.
#       Exit 0 when every run that could run passed.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
dir=${ATTND_HF_DIR:-$here/build-gpu/hf}

case "${1:-run}" in
stage)
  set -e
  build=${2:-$here/build-gpu}
  [ -f "$build/CMakeCache.txt" ] || { echo "gpu-hf: $build is not a configured build (see scripts/dev/gpu-round.sh build)" >&2; exit 1; }
  [ -x "$build/daemon/attnd" ] && [ -f "$build/python/attnd_pb2.py" ] ||
    cmake --build "$build" -j2 --target attnd attnd_proto_py
  rm -rf "$dir" && mkdir -p "$dir"
  cp "$build/daemon/attnd" "$build/python/attnd_pb2.py" "$build/python/attnd_version.py" "$dir/"
  ldd "$build/daemon/attnd" | awk '$3 ~ /^\// {print $3}' |
    grep -E '/lib(uv|inih|xxhash|http_parser|jansson|cudart)\.so' | while read -r lib; do
      cp -L "$lib" "$dir/$(basename "$lib")"
    done
  ls -la "$dir" && du -sh "$dir"
  ;;
run)
  out=${OUT:-$here/gpu-out}
  mkdir -p "$out"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # Without build-gpu/hf/, the daemon of gpu-e2e.sh's tarball (the same build,
  # with its libraries and attnd_pb2.py), so that one round carries one copy.
  if [ ! -x "$dir/attnd" ] && [ -f "$here/build-gpu/stage/gpu-e2e.tar.xz" ]; then
    dir=$tmp/bin
    mkdir -p "$dir" && xz -dc "$here/build-gpu/stage/gpu-e2e.tar.xz" | tar -C "$dir" -xf -
  fi
  [ -x "$dir/attnd" ] || { echo "gpu-hf: $dir/attnd missing (run 'scripts/dev/gpu-hf.sh stage' or 'scripts/dev/gpu-e2e.sh stage' on the build machine)"; exit 1; }
  # The staged libraries are the daemon's alone: torch must keep the system's.
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s/attnd "$@"\n' "$dir" "$dir" >"$tmp/attnd"
  chmod +x "$tmp/attnd"
  export PYTHONPATH=$dir:$here/client/python${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
  py=${PYTHON:-python3}
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    $py -c 'import sys, torch, transformers, google.protobuf as pb, numpy
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "transformers", transformers.__version__, "protobuf", pb.__version__, "numpy", numpy.__version__)' 2>&1
  } | tee "$out/hf-env.txt"

  # Does the daemon start on CUDA here? (a CPU-only binary or no GPU: skip that half)
  backends=cpu
  if $py -c "import sys; sys.path.insert(0, '$here/client/python/examples'); import hf_llama
p, s, t = hf_llama.spawn('$tmp/attnd', 'cuda'); p.terminate(); p.wait(20)" >"$out/hf-cuda-probe.log" 2>&1; then
    backends="cpu cuda"
  else
    echo "gpu-hf: the daemon does not start on the CUDA backend here; see hf-cuda-probe.log" | tee -a "$out/hf-env.txt"
    tail -5 "$out/hf-cuda-probe.log"
  fi

  # Narrowing a round: ATTND_HF_BACKENDS (of "cpu cuda"), ATTND_HF_DTYPES (of
  # "bf16 fp32"), ATTND_HF_PARTS (of "llama models": hf_llama.py with the e2e
  # module, hf_models.py).
  if [ -n "${ATTND_HF_BACKENDS:-}" ]; then
    keep=""
    for b in $backends; do
      case " $ATTND_HF_BACKENDS " in *" $b "*) keep="$keep $b" ;; esac
    done
    backends=$keep
  fi
  dtypes=${ATTND_HF_DTYPES:-bf16 fp32}
  parts=${ATTND_HF_PARTS:-llama models}
  fail=0
  summary=""
  budget=${ATTND_HF_BUDGET:-480}  # seconds: leaves room under a 600 s command limit
  for b in $backends; do
    case " $parts " in *" llama "*) ;; *) continue ;; esac
    for dt in $dtypes; do
      if [ "$SECONDS" -gt "$budget" ]; then
        summary="$summary $b/$dt:NOT-RUN(time)"; fail=1; continue
      fi
      log=$out/hf-$b-$dt.log
      timeout -k 5 120 $py "$here/client/python/examples/hf_llama.py" --spawn "$tmp/attnd" --backend "$b" \
        --dtype "$dt" --json "$out/hf-$b-$dt.json" >"$log" 2>&1
      rc=$?
      echo "== hf_llama backend=$b dtype=$dt rc=$rc"
      cat "$log" | tail -25
      [ $rc -eq 0 ] || fail=1
      s=$($py - "$out/hf-$b-$dt.json" "$rc" <<'EOF' 2>/dev/null
import json, sys
rc = int(sys.argv[2])
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("SKIP(no torch/transformers or no engine)" if rc == 77 else "FAIL(rc %d)" % rc); sys.exit()
tf = r["teacher_forced"]
n = sum(len(x) for x in r["ref_tokens"])
p = r["prefix"]
print("%s(relL2 %.1e floor %.1e argmax %d/%d gen %d/%d nocache %.1e prefix-hit %d gen %d/%d)" % (
    "PASS" if rc == 0 else "FAIL", tf["rel_l2"], r["eager_vs_sdpa_rel_l2"], tf["agree"] + tf["near_ties"],
    tf["n"], r["generate_same_tokens"], n, r["no_cache_rel_l2"], p["cached_len"][0], p["same_tokens"][1],
    len(r["ref_tokens"]) * 8))
EOF
)
      summary="$summary $b/$dt:${s:-FAIL(rc $rc)}"
    done
    if [ "$SECONDS" -gt "$budget" ]; then
      summary="$summary e2e-$b:NOT-RUN(time)"; fail=1; continue
    fi
    (cd "$here/tests/e2e" && ATTND_BIN=$tmp/attnd ATTND_E2E_BACKEND=$b timeout -k 5 150 $py run.py test_hf_adapter) \
      >"$out/e2e-hf-$b.log" 2>&1
    rc=$?
    echo "== e2e test_hf_adapter backend=$b rc=$rc"
    grep -E "^(test_|Ran |OK|FAILED|SKIPPED)|runner:|Error|assert" "$out/e2e-hf-$b.log" | head -20
    [ $rc -eq 0 ] || fail=1
    summary="$summary e2e-$b:$([ $rc -eq 0 ] && echo ok || echo "rc$rc")"
  done
  # The architectures with per-layer variants (hf_models.py), on its own budget.
  mstart=$SECONDS
  mbudget=${ATTND_HF_MODELS_BUDGET:-240}
  for b in $backends; do
    case " $parts " in *" models "*) ;; *) continue ;; esac
    for dt in $dtypes; do
      left=$((mbudget - (SECONDS - mstart)))
      if [ "$left" -le 10 ]; then
        summary="$summary models-$b/$dt:NOT-RUN(time)"; fail=1; continue
      fi
      log=$out/hf-models-$b-$dt.log
      timeout -k 5 "$left" $py "$here/client/python/examples/hf_models.py" --spawn "$tmp/attnd" \
        --backend "$b" --dtype "$dt" --json "$out/hf-models-$b-$dt.json" >"$log" 2>&1
      rc=$?
      echo "== hf_models backend=$b dtype=$dt rc=$rc"
      tail -12 "$log"
      [ $rc -eq 0 ] || [ $rc -eq 77 ] || fail=1
      s=$(tail -1 "$log" | sed -n 's/^hf_models [a-z]*\/[a-z0-9]*: //p')
      summary="$summary models-$b/$dt:[$([ $rc -eq 77 ] && echo SKIP || echo "${s:-FAIL(rc $rc)}")]"
    done
  done
  echo "gpu-hf:$summary (${SECONDS}s) => $([ $fail -eq 0 ] && echo PASS || echo FAIL)" | tee "$out/hf-summary.txt"
  exit $fail
  ;;
*)
  echo "usage: $0 stage [BUILD] | run" >&2
  exit 2
  ;;
esac

#!/usr/bin/env bash
# Installs the Debian 12 packages attnd needs to build and test, when missing.
# As root it runs apt-get; otherwise it prints the exact command to run.
set -euo pipefail
PKGS=(
  build-essential cmake pkg-config
  libuv1-dev            # event loop: sockets, timers, signals, worker pool
  libnanopb-dev nanopb protobuf-compiler  # wire protocol (C side) and its generator
  libcmocka-dev         # unit tests
  libinih-dev           # config file parser
  libjansson-dev        # JSON: a Hugging Face config.json for --model-config
  libxxhash-dev         # xxh3-128 block hashes for the prefix cache
  libsystemd-dev        # sd_notify (READY, WATCHDOG, STOPPING)
  libhttp-parser-dev    # parses /metrics HTTP requests
  python3 python3-protobuf python3-numpy  # Python client and end-to-end tests
  python3-uhashring     # consistent-hash ring of the Python client's session placement
  python3-venv python3-yaml  # ctest scaleout_k8s: a venv for kubernetes-validate, PyYAML for the renderer
  systemd               # systemd-analyze verify/security check the units (those tests skip without it)
  python3-setuptools python3-wheel  # pip install ./client/python into a venv without network (e2e_python_package)
  lintian               # checks the .deb (e2e_deb_lintian skips without it)
  bash-completion groff-base  # the generated completions and man pages are exercised (e2e_docs)
  valgrind
  libseccomp-dev        # attnd-sandbox-exec: the unit's system call filter without systemd (e2e_sandbox)
  clang libclang-rt-14-dev  # `make fuzz`: libFuzzer and clang's sanitizer runtimes
)
missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends "${missing[@]}"; then
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
  fi
else
  echo "deps: missing Debian packages. Run:" >&2
  echo "  sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi

#!/usr/bin/env bash
# ctest scaleout_k8s: renders deploy/k8s and validates it offline against the
# Kubernetes schemas (deploy/k8s/validate.py --self-test). kubernetes-validate
# comes from the Python package index into a venv under the build tree, made
# once; without a network that install cannot happen and the test reports
# Skipped (exit 77). Any other failure fails the test.
set -u
src="${ATTND_SOURCE_DIR:?}"
venv="${ATTND_BUILD_DIR:?}/k8s-venv"
pin="kubernetes-validate==1.37.0"
if ! "$venv/bin/python" -c "import kubernetes_validate, jsonschema, yaml" 2>/dev/null; then
  rm -rf "$venv"
  # System site packages: PyYAML comes from Debian (python3-yaml).
  if ! /usr/bin/python3 -m venv --system-site-packages "$venv"; then
    echo "cannot create a venv (Debian: python3-venv)"
    exit 1
  fi
  out=$("$venv/bin/pip" install --disable-pip-version-check --no-input --retries 1 --timeout 20 "$pin" 2>&1)
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "$out" | tail -5
    rm -rf "$venv"
    if echo "$out" | grep -qE "NewConnectionError|Network is unreachable|Temporary failure in name resolution|Name or service not known|No route to host|ConnectTimeout|ProxyError|Max retries exceeded|Connection refused"; then
      echo "SKIPPED: no network to install $pin"
      exit 77
    fi
    exit 1
  fi
fi
exec "$venv/bin/python" "$src/deploy/k8s/validate.py" --self-test "$src/deploy/k8s"

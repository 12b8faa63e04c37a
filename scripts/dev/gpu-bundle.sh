#!/usr/bin/env bash
# gpu-bundle.sh: the staged tarballs of several rounds as one smaller file.
#
# Every staged tarball (gpu-round.sh's round.tar.xz, gpu-e2e.sh's
# gpu-e2e.tar.xz, gpu-smallstep.sh's folder) holds its own statically linked
# copies of the CUDA kernels (~35 MB each uncompressed), and xz cannot share
# them across files: three stages make ~100 MB. Repacked as one tar of their
# contents in one xz block (-9: a 64 MiB dictionary), the copies compress
# against each other.
#
#   scripts/dev/gpu-bundle.sh pack [SMALL_DIR]     (build machine)
#       build-gpu/stage/*.tar.xz (and SMALL_DIR, e.g. build-gpu/small) into
#       build-gpu/bundle/all.tar.xz; the stage folders are left as they are.
#   scripts/dev/gpu-bundle.sh unpack [SMALL_DIR]   (GPU machine, repository root)
#       puts build-gpu/stage/*.tar.xz (and SMALL_DIR) back from the bundle,
#       recompressed fast (xz -0), so the rounds' run halves find them.
set -eu
here=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$here/build-gpu/bundle/all.tar.xz
small=${2:-}
case "${1:-}" in
pack)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/stage"
  for t in "$here"/build-gpu/stage/*.tar.xz; do
    [ -f "$t" ] || continue
    n=$(basename "$t" .tar.xz)
    mkdir -p "$tmp/stage/$n"
    xz -dc "$t" | tar -C "$tmp/stage/$n" -xf -
  done
  if [ -n "$small" ]; then
    mkdir -p "$tmp/small/tar"
    cp "$here/$small/run.sh" "$tmp/small/run.sh"
    xz -dc "$here/$small/smallstep.tar.xz" | tar -C "$tmp/small/tar" -xf -
  fi
  mkdir -p "$(dirname "$bundle")"
  tar -C "$tmp" -cf - . | xz -9 -T1 >"$bundle"
  ls -l "$bundle"
  ;;
unpack)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  xz -dc "$bundle" | tar -C "$tmp" -xf -
  mkdir -p "$here/build-gpu/stage"
  for d in "$tmp"/stage/*/; do
    n=$(basename "$d")
    tar -C "$d" -cf - . | xz -0 -T0 >"$here/build-gpu/stage/$n.tar.xz"
  done
  if [ -n "$small" ] && [ -d "$tmp/small" ]; then
    mkdir -p "$here/$small"
    cp "$tmp/small/run.sh" "$here/$small/run.sh"
    tar -C "$tmp/small/tar" -cf - . | xz -0 -T0 >"$here/$small/smallstep.tar.xz"
  fi
  ;;
*)
  echo "usage: $0 pack|unpack [SMALL_DIR]" >&2
  exit 2
  ;;
esac

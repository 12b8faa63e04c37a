#!/usr/bin/env bash
# sm90-base.sh COMMIT DIR: the Hopper prefill sources of COMMIT (prefill_sm90*,
# sm90_*) into DIR, for a build with -DATTND_SM90_BASE_DIR=DIR: bench_prefill
# then times that commit's kernels ("base" variant) beside this tree's in one
# process. Only those files come from COMMIT; the shared headers (attnd_cuda.h,
# tiled_params.cuh, primitives.cuh) are this tree's, so COMMIT must agree with
# them on the types it reads.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 COMMIT DIR" >&2; exit 2; }
commit=$1 dir=$2
top=$(git rev-parse --show-toplevel)
mkdir -p "$dir"
rm -f "$dir"/prefill_sm90* "$dir"/sm90_*
git -C "$top" archive "$commit" kernels/cuda |
  tar -x -C "$dir" --strip-components=2 --wildcards 'kernels/cuda/prefill_sm90*' 'kernels/cuda/sm90_*'
git -C "$top" rev-parse "$commit" > "$dir/COMMIT"
ls "$dir"

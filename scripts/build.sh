#!/usr/bin/env bash
# Configures and builds kvstep into DIR (default build/) with clang, so that
# -Wthread-safety proves the locking. Extra arguments go to cmake (after
# clang's, so -DCMAKE_CXX_COMPILER=g++ builds with GCC instead).
#   scripts/build.sh [DIR] [-DKVSTEP_SANITIZE=address|thread ...]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
cmake -S . -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++ "$@" >/dev/null
ninja -C "$dir" -j"${KVSTEP_JOBS:-2}"

#!/usr/bin/env bash
# Fuzzes request parsing and validation (tests/fuzz/request_fuzzer.cc) with
# libFuzzer under ASan+UBSan for a bounded time, starting from the committed
# corpus. New crash inputs are written to build-fuzz/ (crash-*); add them to
# tests/fuzz/corpus once fixed, so that the replay test keeps them fixed.
#
#   scripts/fuzz.sh [SECONDS]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSTEP_SANITIZE=address \
  -DKVSTEP_FUZZ=ON -DKVSTEP_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz -j2 --target request_fuzzer
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp tests/fuzz/corpus/* "$work/"
cd build-fuzz
./tests/request_fuzzer -max_total_time="$seconds" -timeout=10 \
  -rss_limit_mb=4096 -print_final_stats=1 "$work"
echo "fuzz: ${seconds}s without a crash"

#!/usr/bin/env bash
# Fuzzes request parsing and validation (tests/fuzz/request_fuzzer.cc) with
# libFuzzer under ASan+UBSan for a bounded time, starting from the committed
# corpus. New crash inputs are written to the build directory (crash-*);
# add them to tests/fuzz/corpus once fixed, so that the replay test keeps
# them fixed.
#
#   scripts/fuzz.sh [SECONDS]   (default 60)
# With KVSTEP_FUZZ_DIR set, the fuzz target of that build directory (one
# configured with -DKVSTEP_SANITIZE=address -DKVSTEP_FUZZ=ON, as
# scripts/test.sh's ASan build is) instead of its own build-fuzz.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
dir="${KVSTEP_FUZZ_DIR:-build-fuzz}"
if [ -z "${KVSTEP_FUZZ_DIR:-}" ]; then
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSTEP_SANITIZE=address \
    -DKVSTEP_FUZZ=ON -DKVSTEP_BUILD_BENCH=OFF >/dev/null
fi
cmake --build "$dir" -j2 --target request_fuzzer
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp tests/fuzz/corpus/* "$work/"
cd "$dir"
./tests/request_fuzzer -max_total_time="$seconds" -timeout=10 \
  -rss_limit_mb=4096 -print_final_stats=1 "$work"
echo "fuzz: ${seconds}s without a crash"

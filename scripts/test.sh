#!/usr/bin/env bash
# Installs the dependencies, builds kvstep and passes its tests: the normal
# build, then the whole suite under ASan+UBSan, then the whole suite under
# TSan, then the whole suite built by GCC (own build directories), then 60
# s of libFuzzer on request parsing and validation. Debian's gRPC, Abseil
# and OpenSSL are not TSan-instrumented: the gRPC-free core suite runs
# under TSan as is, the gRPC suites with tests/tsan.supp, which drops
# reports inside those libraries.
#   scripts/test.sh            everything (what CI runs)
#   scripts/test.sh --quick    the normal build only
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

run_ctest() {  # DIR [ctest args]
  local dir=$1
  shift
  (cd "$dir" && ctest -j2 --output-on-failure --timeout 600 "$@")
}

echo "== build (RelWithDebInfo) and test"
scripts/build.sh build
run_ctest build

if [ "${1:-}" != "--quick" ]; then
  # KVSTEP_FUZZ=ON: the same build also holds the fuzz target (coverage
  # instrumentation beside ASan+UBSan), so that the fuzzing below needs no
  # build of its own (a fourth compile of the core took minutes of CI's 30).
  echo "== ASan+UBSan build and test"
  scripts/build.sh build-asan -DKVSTEP_SANITIZE=address -DKVSTEP_BUILD_BENCH=OFF \
    -DKVSTEP_FUZZ=ON
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 run_ctest build-asan

  echo "== TSan build and test"
  scripts/build.sh build-tsan -DKVSTEP_SANITIZE=thread -DKVSTEP_BUILD_BENCH=OFF
  TSAN_OPTIONS=halt_on_error=1 run_ctest build-tsan -L core
  TSAN_OPTIONS="halt_on_error=1 suppressions=$PWD/tests/tsan.supp" \
    run_ctest build-tsan -L service

  # Debian's default compiler, which a plain `cmake -B DIR` picks: the
  # kernel's sources must build under both (GCC's AMX intrinsics take
  # literal tile numbers only) and pass the same tests.
  echo "== GCC build and test"
  scripts/build.sh build-gcc -DCMAKE_CXX_COMPILER=g++
  run_ctest build-gcc

  echo "== libFuzzer: request parsing and validation, 60 s"
  KVSTEP_FUZZ_DIR=build-asan scripts/fuzz.sh 60
fi

#!/usr/bin/env bash
# Installs kvstep's build and test dependencies from Debian bookworm's
# archive (nothing else is downloaded). Idempotent; fast when all is there.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config clang
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  prometheus-cpp-dev
  # Tests: TLS certificates are made with openssl; the fuzzer needs clang's
  # libFuzzer runtime.
  openssl libclang-rt-14-dev
  # bench/grid_table_test.py and bench/ab_runs_test.py (the bench scripts'
  # tests); the Python client (python/) and its tests, with /usr/bin/python3.
  python3 python3-grpcio python3-protobuf python3-numpy
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

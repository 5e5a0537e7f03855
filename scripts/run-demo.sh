#!/usr/bin/env bash
# The main job: installs, builds, starts a kvstep server on a unix socket
# with the embedded defaults (seed 003's pool: 1000 blocks of 16 tokens),
# runs the demo scheduler against it (allocate, prefill batch, decode steps
# with timings), and stops the server with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build >/dev/null
sock="unix:${TMPDIR:-/tmp}/kvstep-demo-$$.sock"
./build/kvstep-server --listen="$sock" --num_blocks=1000 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
./build/kvstep-cli --target="$sock" demo "$@"

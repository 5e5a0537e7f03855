#!/usr/bin/env bash
# Builds the kvstep image from deploy/Dockerfile with buildah (no Docker
# engine needed), then starts the image's entrypoint and checks it serves.
#
#   deploy/build-image.sh [TAG]        (default kvstep:<version>)
#
# Where no registry is reachable (this project's machines reach only
# Debian's archive), the base image debian:bookworm is made locally from a
# debootstrap of bookworm and stored under that name, so FROM resolves to it
# without a pull. With a registry, pass BASE_FROM_REGISTRY=1 to use the real
# debian:bookworm instead. Needs root (buildah --isolation chroot).
set -euo pipefail
cd "$(dirname "$0")/.."
version="$(sed -n 's/^project(kvstep VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)"
tag="${1:-kvstep:${version}}"
base="docker.io/library/debian:bookworm"

for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || {
    echo "build-image: installing $tool"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$tool" >/dev/null
  }
done

if [ "${BASE_FROM_REGISTRY:-0}" != 1 ] && ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  echo "== making $base from a debootstrap of bookworm"
  rootfs="$(mktemp -d)"
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
  # The archive the image's apt-get will use: the same as this machine's.
  cat > "$rootfs/etc/apt/sources.list" <<'LIST'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
LIST
  ctr="$(buildah from scratch)"
  buildah copy --quiet "$ctr" "$rootfs" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash "$ctr"
  buildah commit --quiet --rm "$ctr" "$base" >/dev/null
fi

echo "== building $tag"
buildah bud --isolation chroot --format docker --pull=false \
  -f deploy/Dockerfile -t "$tag" .

echo "== starting the image's entrypoint"
ctr="$(buildah from "$tag")"
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
# The server from the image's ENTRYPOINT/CMD (a small pool), then the image's
# own health check and the demo scheduler against it, then SIGTERM.
buildah run --isolation chroot "$ctr" -- /bin/sh -c '
  kvstep-server --listen=unix:/run/kvstep/kvstep.sock \
    --metrics_listen=127.0.0.1:9464 --num_blocks=256 &
  pid=$!
  kvstep-cli --target=unix:/run/kvstep/kvstep.sock --wait=30s health &&
  kvstep-cli --target=unix:/run/kvstep/kvstep.sock demo --steps=2 --num_seqs=2 --prompt_len=40 >/dev/null &&
  echo "image: SERVING, demo ran" && ok=1
  kill -TERM $pid; wait $pid; echo "image: server exited $?"
  [ "${ok:-0}" = 1 ]'
echo "== $tag: $(buildah inspect --type image --format '{{.Docker.Config.User}} {{.Docker.Config.Entrypoint}} {{.Docker.Config.Cmd}}' "$tag")"
buildah images "$tag"

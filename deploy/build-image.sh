#!/usr/bin/env bash
# Builds the kvstep image from deploy/Dockerfile with buildah (no Docker
# engine needed), then starts the image's entrypoint and checks it serves.
#
#   deploy/build-image.sh [TAG]        (default kvstep:<version>)
#
# Where no registry is reachable (this project's machines reach only
# Debian's archive), the base image debian:bookworm is made locally from a
# debootstrap of bookworm and stored under that name, so FROM resolves to it
# without a pull (BASE_ROOTFS=DIR reuses a debootstrap made earlier). With a
# registry, pass BASE_FROM_REGISTRY=1 to use the real debian:bookworm
# instead. Needs root (buildah --isolation chroot).
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
  if [ -n "${BASE_ROOTFS:-}" ]; then
    rootfs="$BASE_ROOTFS"  # a debootstrap of bookworm made earlier
  else
    rootfs="$(mktemp -d)"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
  fi
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

if [ "${SKIP_BUILD:-0}" != 1 ]; then  # SKIP_BUILD=1: only run the image
  echo "== building $tag"
  buildah bud --isolation chroot --format docker --pull=false \
    -f deploy/Dockerfile -t "$tag" .
fi

echo "== starting the image's entrypoint"
ctr="$(buildah from "$tag")"
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
# The image's own ENTRYPOINT + CMD and HEALTHCHECK command, verbatim.
entry="$(buildah inspect --type image --format \
  '{{range .Docker.Config.Entrypoint}}{{.}} {{end}}{{range .Docker.Config.Cmd}}{{.}} {{end}}' "$tag")"
health="$(buildah inspect --type image --format \
  '{{range $i, $a := .Docker.Config.Healthcheck.Test}}{{if $i}}{{$a}} {{end}}{{end}}' "$tag")"
echo "entrypoint: $entry"
echo "healthcheck: $health"
# Start it, wait for the health check to pass, run the demo scheduler
# against it, then SIGTERM (it must exit 0).
buildah run --isolation chroot "$ctr" -- /bin/sh -c "
  $entry &
  pid=\$!
  ok=0
  for i in \$(seq 30); do $health >/dev/null 2>&1 && ok=1 && break; sleep 1; done
  [ \$ok = 1 ] && echo 'image: health check SERVING' &&
  kvstep-cli --target=unix:/run/kvstep/kvstep.sock demo --steps=2 --num_seqs=2 \
    --prompt_len=40 >/dev/null && echo 'image: demo ran' || ok=0
  kill -TERM \$pid; wait \$pid; rc=\$?; echo \"image: server exited \$rc\"
  [ \$ok = 1 ] && [ \$rc = 0 ]"
echo "== $tag: user $(buildah inspect --type image --format '{{.Docker.Config.User}}' "$tag")"
buildah images "$tag"

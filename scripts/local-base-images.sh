#!/usr/bin/env bash
# Base images for a host that cannot pull from an image registry: Debian bookworm bootstrapped from
# the Debian mirror this host's apt already uses, then Debian's Python 3.11 and Redis 7 on top.
#
#   sudo scripts/local-base-images.sh [PREFIX]      # PREFIX defaults to carpool-local
#
# Builds PREFIX/debian:bookworm, PREFIX/python:3.11 and PREFIX/redis:7 and prints the variables
# that make the Dockerfile and docker-compose.yml use them (PYTHON_IMAGE=..., REDIS_IMAGE=...).
# Needs root (debootstrap), the debootstrap package and a running Docker engine. DEBIAN_MIRROR
# overrides the mirror (needed on hosts whose apt does not point at a Debian mirror).
set -euo pipefail
cd "$(dirname "$0")/.."

prefix=${1:-carpool-local}
suite=bookworm

say() { echo "local-base-images: $*" >&2; }

# The mirror serving this host's Debian packages (not the security archive), as apt itself reports it.
debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then
    echo "$DEBIAN_MIRROR"
    return
  fi
  apt-get indextargets --format '$(REPO_URI) $(LABEL) $(COMPONENT)' "Identifier: Packages" 2>/dev/null \
    | awk '$2 == "Debian" && $3 == "main" { print $1; exit }'
}

mirror=$(debian_mirror)
if [ -z "$mirror" ]; then
  say "no Debian mirror in this host's apt configuration (run apt-get update?); set DEBIAN_MIRROR"
  exit 1
fi
command -v debootstrap >/dev/null || { say "debootstrap is not installed"; exit 1; }

rootfs=$(mktemp -d /tmp/carpool-rootfs.XXXXXX)
context=$(mktemp -d /tmp/carpool-base-context.XXXXXX)
trap 'rm -rf "$rootfs" "$rootfs.log" "$context" "$context".*.log' EXIT
say "debootstrap $suite from $mirror"
debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
  tail -n 30 "$rootfs.log" >&2
  exit 1
}
rm -f "$rootfs.log"
# apt inside the images needs no recommends and keeps no caches, as in Docker's official Debian images.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import - "$prefix/debian:$suite" >/dev/null

say "building $prefix/python:3.11 and $prefix/redis:7"
build() {
  DOCKER_BUILDKIT=0 docker build -q -t "$prefix/$1" --build-arg "DEBIAN_IMAGE=$prefix/debian:$suite" \
    -f "docker/$2.Dockerfile" "$context" >/dev/null 2>"$context.$2.log" || { cat "$context.$2.log" >&2; return 1; }
}
build python:3.11 python &
python_build=$!
build redis:7 redis
wait "$python_build"

echo "PYTHON_IMAGE=$prefix/python:3.11"
echo "REDIS_IMAGE=$prefix/redis:7"

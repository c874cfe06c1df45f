#!/bin/sh
# Build the base image the Dockerfile starts FROM, without any image registry:
# debootstrap a minimal Debian root filesystem, then `docker import` it.
#
#   sudo deploy/docker/build-base.sh                   # -> image loader-base:bookworm
#   BASE_IMAGE=my-base:12 sudo deploy/docker/build-base.sh
#
# Needs root (debootstrap), debootstrap, and a reachable Debian mirror (DEBIAN_MIRROR,
# default http://deb.debian.org/debian) the first time; the root filesystem is cached as a
# tarball under LOADER_CONTAINER_CACHE (default ~/.cache/loader-service/container), so later
# runs, and machines that are handed that tarball, need no network at all.
#
# Environment: DOCKER (docker CLI, default `docker`; DOCKER_HOST is honoured), BASE_IMAGE,
# DEBIAN_SUITE (bookworm), DEBIAN_MIRROR, LOADER_CONTAINER_CACHE, BASE_ROOTFS_TAR (use this
# tarball instead of building one).
set -eu

DOCKER=${DOCKER:-docker}
BASE_IMAGE=${BASE_IMAGE:-loader-base:bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${LOADER_CONTAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/loader-service/container}
# What the images need from Debian: the interpreter (+ venv, so pip can install wheels into
# /opt/venv), tini as PID 1, CA certificates, and gcc + libjpeg-turbo (runtime and headers) for
# the native JPEG kernel (python3-dev: Python.h, to build it). Everything else comes from wheels.
PACKAGES=python3,python3-venv,python3-dev,tini,ca-certificates,gcc,libc6-dev,libjpeg62-turbo,libjpeg62-turbo-dev
RECIPE_VERSION=1

# The cache key covers everything that changes the tarball.
key=$(printf '%s|%s|%s|%s' "$SUITE" "$PACKAGES" "$RECIPE_VERSION" "$(uname -m)" | sha256sum | cut -c1-12)
tarball=${BASE_ROOTFS_TAR:-$CACHE/rootfs-$SUITE-$key.tar.gz}

if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null 2>&1 || { echo "build-base: debootstrap is not installed (apt-get install debootstrap, or run deploy/install-prerequisites.sh --airgap)" >&2; exit 3; }
    [ "$(id -u)" -eq 0 ] || { echo "build-base: debootstrap needs root" >&2; exit 3; }
    mkdir -p "$CACHE"
    work=$(mktemp -d "$CACHE/debootstrap.XXXXXX")
    trap 'rm -rf "$work"' EXIT INT TERM
    echo "build-base: debootstrap $SUITE (minbase + $PACKAGES) from $MIRROR ..." >&2
    # --keyring: verify the Release file against Debian's archive keys.
    debootstrap --variant=minbase --include="$PACKAGES" \
        --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
        "$SUITE" "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 || {
            echo "build-base: debootstrap failed; last lines of its log:" >&2
            tail -n 30 "$work/debootstrap.log" >&2
            exit 4
        }
    # Trim what an image does not need: package caches, docs, man pages, logs.
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* \
        "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/* "$work"/rootfs/usr/share/info/* \
        "$work"/rootfs/var/log/*.log "$work"/rootfs/var/cache/debconf/*-old "$work"/rootfs/tmp/*
    # debootstrap leaves the host's resolv.conf/hostname; the engine provides its own.
    rm -f "$work/rootfs/etc/resolv.conf" "$work/rootfs/etc/hostname"
    tar --numeric-owner --xattrs -C "$work/rootfs" -czf "$work/rootfs.tar.gz" .
    mv "$work/rootfs.tar.gz" "$tarball"
    rm -rf "$work"
    trap - EXIT INT TERM
    echo "build-base: cached root filesystem at $tarball" >&2
fi

echo "build-base: docker import $tarball -> $BASE_IMAGE" >&2
"$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap $SUITE minbase + $PACKAGES" \
    "$tarball" "$BASE_IMAGE" >/dev/null
echo "$BASE_IMAGE"

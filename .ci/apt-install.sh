#!/bin/sh
# Install Debian packages non-interactively, with sudo when not root: .ci/apt-install.sh PKG...
set -eu
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
echo "installing: $*"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null

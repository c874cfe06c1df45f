#!/bin/sh
# Install what the fleet tests (tests/e2e/test_fleet.py) need on a fresh Debian machine: Debian's
# dnsmasq (the dnsmasq-base package: the binary alone, no system service started). The tests run
# it themselves, unprivileged-style, on 127.0.0.1:<free port>. Idempotent.
#
#   sudo .ci/dns-prereqs.sh
set -eu

if command -v dnsmasq >/dev/null 2>&1 || [ -x /usr/sbin/dnsmasq ]; then
    echo "DNS prerequisites already installed: $(/usr/sbin/dnsmasq --version 2>/dev/null | head -n1)"
    exit 0
fi

sh "$(dirname "$0")/apt-install.sh" dnsmasq-base
echo "installed: $(/usr/sbin/dnsmasq --version | head -n1)"

#!/bin/sh
# Install what the replica-scaling test (tests/deploy/test_scaling_deploy.py) needs on a fresh
# Debian machine: promtool, from Debian's prometheus package, which runs Prometheus' own rule
# unit tests on the stall query offline (no server is started). Idempotent.
#
#   sudo .ci/scaling-prereqs.sh
set -eu

if command -v promtool >/dev/null 2>&1; then
    echo "scaling prerequisites already installed: $(promtool --version 2>&1 | head -n1)"
    exit 0
fi
sh "$(dirname "$0")/apt-install.sh" prometheus
echo "installed: $(promtool --version 2>&1 | head -n1)"

#!/bin/sh
# Install what the status page test (tests/e2e/test_status_page.py) needs on a fresh Debian machine:
# Debian's chromium and chromedriver (same version, from the same archive; no browser download).
# Idempotent: run it as often as you like.
#
#   sudo .ci/browser-prereqs.sh
set -eu

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    echo "browser prerequisites already installed: $(chromium --version 2>/dev/null || echo chromium), $(chromedriver --version 2>/dev/null | cut -d' ' -f1-2)"
    exit 0
fi

sh "$(dirname "$0")/apt-install.sh" chromium chromium-driver fonts-dejavu-core
echo "installed: $(chromium --version 2>/dev/null || echo chromium), $(chromedriver --version | cut -d' ' -f1-2)"

#!/usr/bin/env bash
# The whole test suite as CI runs it (README "Install"; .ci/run is install.sh and this): the
# install (./install.sh without its demo, a no-op when done), the test tools pinned by
# requirements/test.txt, the system packages some tests need (Docker engine and debootstrap,
# chromium, dnsmasq, promtool), then `python -m pytest -q` with any arguments given here.
# A test whose prerequisites were installed must run: LOADER_REQUIRE_* make its skip a failure.
# Idempotent; as root or with sudo; systemd is not needed (the container test starts its own
# dockerd on a private socket).
#
#   ./run-tests.sh                         # everything (~30 min on 2 cores)
#   ./run-tests.sh -m "not slow and not container" -x
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
export VENV
step() { echo "== run-tests.sh: $*"; }
if [ "$(id -u)" -eq 0 ]; then SUDO=(); else SUDO=(sudo); fi

SKIP_DEMO=1 ./install.sh
step "test tools: pip install -c requirements/test.txt -e .[client,service,remote,dev]"
LOADER_REQUIRE_NATIVE_JPEG=1 "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet \
    -c requirements/test.txt -e ".[client,service,remote,dev]"

require() {  # NAME SCRIPT WHAT: install a test's prerequisites; once installed, its test must run
    if "${SUDO[@]}" sh "$2"; then
        export "$1=1"
    else
        echo "== run-tests.sh: $3 could not be installed; those tests will be skipped"
    fi
}
step "test prerequisites (.ci/*-prereqs.sh)"
require LOADER_REQUIRE_CONTAINER .ci/container-prereqs.sh "the Docker engine and debootstrap (container tests)"
require LOADER_REQUIRE_BROWSER .ci/browser-prereqs.sh "chromium (the status page test)"
require LOADER_REQUIRE_DNS .ci/dns-prereqs.sh "dnsmasq (the fleet tests)"
require LOADER_REQUIRE_PROMTOOL .ci/scaling-prereqs.sh "promtool (the stall query's test)"
export LOADER_REQUIRE_NATIVE_JPEG=1   # install.sh built the native JPEG kernel: without it, an import error
export LOADER_TEST_OUTPUT="$PWD/test-output"   # screenshots of the status page land here

# shellcheck disable=SC1091
. "$VENV/bin/activate"
step "python -m pytest -q $*"
python -m pytest -q "$@"

#!/bin/sh
# CI: what the container test (tests/container, `pytest -m container`) needs, installed by the
# user-facing script (docker.io's dockerd, containerd, runc and CLI; debootstrap and Debian's
# archive keyring), with no system dockerd started: the test runs its own on a private socket
# and brings its own Compose v2. See deploy/install-prerequisites.sh.
exec sh "$(dirname "$0")/../deploy/install-prerequisites.sh" --container-test "$@"

#!/bin/sh
# Download every wheel the images install, so `docker build` needs no network.
#
#   deploy/docker/fetch-wheels.sh            # service + trainer wheels
#   deploy/docker/fetch-wheels.sh service    # service wheels only (no torch)
#
# Writes deploy/docker/wheels/service/ (the service's dependencies + the build backend for the
# project itself) and deploy/docker/wheels/trainer/ (torch CPU + its dependencies). The wheels
# are for the image's Python (Debian bookworm: CPython 3.11, glibc 2.36, x86_64 by default),
# whatever Python runs pip here.
#
# Environment:
#   PYTHON          interpreter with pip (default: python3)
#   WHEELS          output folder (default: deploy/docker/wheels next to this script)
#   TORCH_SPEC      torch requirement for the trainer (default torch==2.13.0). An unpinned torch
#                   from PyPI is the multi-GB CUDA build: pin the CPU build, e.g. point pip at a
#                   folder with the CPU wheel (PIP_FIND_LINKS=/opt/wheels) or at PyTorch's CPU
#                   index (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
#   IMAGE_PYTHON    python version of the image (default 3.11)
#   IMAGE_ARCH      machine of the image (default: this machine's, `uname -m`)
#   IMAGE_GLIBC     glibc minor version of the image (default 36: bookworm has glibc 2.36); wheels
#                   tagged manylinux 2.17 (manylinux2014) up to 2.IMAGE_GLIBC are accepted
# Any PIP_* variable (index URL, proxy, find-links) passes through to pip.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$here/wheels}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
IMAGE_PYTHON=${IMAGE_PYTHON:-3.11}
IMAGE_ARCH=${IMAGE_ARCH:-$(uname -m)}
IMAGE_GLIBC=${IMAGE_GLIBC:-36}
what=${1:-all}

# pip does not widen a manylinux_2_N platform to older glibc tags by itself: list them all.
target="--only-binary=:all: --python-version $IMAGE_PYTHON --implementation cp --platform manylinux2014_$IMAGE_ARCH"
v=17
while [ "$v" -le "$IMAGE_GLIBC" ]; do
    target="$target --platform manylinux_2_${v}_$IMAGE_ARCH"
    v=$((v + 1))
done

mkdir -p "$WHEELS/service" "$WHEELS/trainer"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT INT TERM

# The service: its requirements, and the build backend pip needs to build the project from
# source inside the image (offline, with build isolation).
"$PYTHON" "$here/requirements.py" service "$root/pyproject.toml" >"$reqs"
"$PYTHON" - "$root/pyproject.toml" >>"$reqs" <<'PY'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))
PY
echo "fetch-wheels: service -> $WHEELS/service" >&2
# shellcheck disable=SC2086
"$PYTHON" -m pip download --quiet --dest "$WHEELS/service" $target -r "$reqs"

if [ "$what" = "all" ] || [ "$what" = "trainer" ]; then
    # The trainer: the client's requirements with torch pinned to the CPU build.
    "$PYTHON" "$here/requirements.py" trainer "$root/pyproject.toml" | grep -iv '^torch\b' >"$reqs" || true
    echo "$TORCH_SPEC" >>"$reqs"
    echo "fetch-wheels: trainer ($TORCH_SPEC) -> $WHEELS/trainer" >&2
    # shellcheck disable=SC2086
    "$PYTHON" -m pip download --quiet --dest "$WHEELS/trainer" $target -r "$reqs"
    if ls "$WHEELS"/trainer/nvidia_* >/dev/null 2>&1; then
        echo "fetch-wheels: WARNING: pip picked a CUDA build of torch (nvidia-* wheels in $WHEELS/trainer);" \
             "point it at the CPU build (see TORCH_SPEC above)" >&2
    fi
fi
du -sh "$WHEELS/service" "$WHEELS/trainer" >&2

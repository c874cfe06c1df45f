#!/usr/bin/env bash
# From a fresh clone to the demo running, in one command (README "Install"): system packages
# for the native JPEG kernel, a virtual environment, torch (CUDA build where nvidia-smi finds a
# GPU, else the CPU build), the project pinned by requirements/user.txt, then the demo job on
# the embedded dataset. Idempotent: a second run changes nothing and only runs the demo again.
# As root, or as a user with sudo (asked for the system packages only); systemd is not needed.
#
#   ./install.sh                      # venv in .venv
#   VENV=/opt/loader ./install.sh     # elsewhere
#   SKIP_DEMO=1 ./install.sh          # install only
#   TORCH_INDEX_URL=URL ./install.sh  # torch from that index (another CUDA build, a mirror)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-client,service,remote}
LOCK=${LOCK:-requirements/user.txt}
TORCH=2.13.0
step() { echo "== install.sh: $*"; }

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "install.sh: the system packages need root: run it as root, or install sudo" >&2
    exit 1
fi

step "system packages: a C compiler and libjpeg-turbo for the native JPEG kernel (.ci/native-prereqs.sh)"
"${SUDO[@]}" sh .ci/native-prereqs.sh
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    step "system packages: python3-venv"
    "${SUDO[@]}" sh .ci/apt-install.sh python3-venv
fi

if [ -x "$VENV/bin/python" ]; then
    step "virtual environment $VENV: already there"
else
    step "virtual environment $VENV (python3 -m venv, with its own pip)"
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check)

if "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
    step "torch $("$PY" -c 'import torch; print(torch.__version__)'): already installed"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    step "torch==$TORCH from $TORCH_INDEX_URL"
    "${PIP[@]}" "torch==$TORCH" --index-url "$TORCH_INDEX_URL"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "torch==$TORCH, the CUDA build (nvidia-smi lists a GPU)"
    "${PIP[@]}" "torch==$TORCH"
else
    # no GPU: PyPI's default Linux wheel is the multi-GB CUDA build. A local CPU wheel (pip's
    # find-links) alone first, then its dependencies from the index (the torch installed
    # satisfies torch==2.13.0 as it is); without a local wheel, PyTorch's CPU index
    step "torch==$TORCH, the CPU build (no GPU found)"
    if "${PIP[@]}" --quiet --no-index --no-deps "torch==$TORCH" 2>/dev/null; then
        "${PIP[@]}" --quiet "torch==$TORCH"
    else
        "${PIP[@]}" "torch==$TORCH" --index-url https://download.pytorch.org/whl/cpu
    fi
fi

# the constraints pin every package (requirements/lock.sh keeps them): pip does not backtrack,
# and torch, installed above, satisfies the project's torch>=2.1 as it is
step "the project: pip install -c $LOCK -e .[$EXTRAS] (native JPEG kernel required: LOADER_REQUIRE_NATIVE_JPEG=1)"
LOADER_REQUIRE_NATIVE_JPEG=${LOADER_REQUIRE_NATIVE_JPEG:-1} "${PIP[@]}" --quiet -c "$LOCK" -e ".[$EXTRAS]"
"$PY" -c 'import loader_service.decode.jpeg as j; print("== install.sh: JPEG decode:", j.decode_path())'

if [ "${SKIP_DEMO:-0}" != 1 ]; then
    step "the demo job: loader-service demo --epochs 1 (the service and a consumer on the embedded dataset)"
    "$VENV/bin/loader-service" demo --epochs 1
fi
step "done. Next: . $VENV/bin/activate && loader-service serve --demo  (README \"Quick start\")"

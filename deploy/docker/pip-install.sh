#!/bin/sh
# Runs INSIDE the image build (the Dockerfile copies it to /src): install one image's Python
# packages into the active virtual environment (/opt/venv).
#
#   pip-install.sh deps TARGET      the requirements of TARGET (service | trainer), read from
#                                   /src/pyproject.toml by /src/requirements.py
#   pip-install.sh project TARGET   the project itself, from /src, --no-deps
#
# Where from:
#   * wheels in /wheels/TARGET/ (deploy/docker/wheels/TARGET/ in the build context, filled by
#     deploy/docker/fetch-wheels.sh): from those only, `pip install --no-index` (air-gapped);
#   * no wheels there: from the package index (PyPI, or PIP_INDEX_URL if the build sets it). The
#     trainer's torch comes from TORCH_INDEX_URL (PyTorch's CPU-only index by default: torch from
#     PyPI is the multi-GB CUDA build).
# Build arguments (environment here): WHEELS=auto (default: as above) or WHEELS=required (fail
# at once when there are no wheels: the air-gapped build, where the index cannot be reached);
# TORCH_INDEX_URL. WHEELS_DIR (/wheels) and SRC_DIR (/src) move the folders (tests/deploy/test_deploy.py).
set -eu

what=${1:?usage: pip-install.sh deps|project service|trainer}
target=${2:?usage: pip-install.sh deps|project service|trainer}
WHEELS=${WHEELS:-auto}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
W=${WHEELS_DIR:-/wheels}
S=${SRC_DIR:-/src}

case "$target" in
    service) links="--find-links $W/service" ;;
    # the trainer's own wheels, and the service's folder for the project's build backend
    trainer) links="--find-links $W/trainer --find-links $W/service" ;;
    *) echo "pip-install: unknown target $target (service or trainer)" >&2; exit 2 ;;
esac
case "$WHEELS" in auto|required) ;; *) echo "pip-install: WHEELS=$WHEELS: use auto or required" >&2; exit 2 ;; esac

if ls "$W/$target/"*.whl >/dev/null 2>&1; then
    source=wheels
elif [ "$WHEELS" = required ]; then
    echo "pip-install: WHEELS=required but deploy/docker/wheels/$target/ holds no wheels:" \
         "run deploy/docker/fetch-wheels.sh before an air-gapped build" >&2
    exit 3
else
    source=index
fi

case "$what" in
    deps)
        reqs=$(mktemp)
        python3 "$S/requirements.py" "$target" "$S/pyproject.toml" >"$reqs"
        if [ "$source" = wheels ]; then
            echo "pip-install: $target dependencies from the wheels in $W/$target (--no-index)" >&2
            # shellcheck disable=SC2086
            pip install --no-index $links -r "$reqs"
        else
            echo "pip-install: $target dependencies from the package index" >&2
            if [ "$target" = trainer ]; then
                # torch (and its own dependencies) from the CPU-only index first, then the rest
                # (torch is then already satisfied and not looked up on PyPI).
                torch=$(grep -i '^torch\b' "$reqs" || echo torch)
                echo "pip-install: $torch from $TORCH_INDEX_URL" >&2
                pip install --index-url "$TORCH_INDEX_URL" "$torch"
            fi
            pip install -r "$reqs"
        fi
        rm -f "$reqs"
        ;;
    project)
        # --no-deps: the project's own dependency list includes torch, which the service never
        # imports. Its build backend (setuptools) comes from the same place as the rest.
        if [ "$source" = wheels ]; then
            # shellcheck disable=SC2086
            pip install --no-index $links --no-deps "$S"
        else
            pip install --no-deps "$S"
        fi
        ;;
    *) echo "pip-install: unknown step $what (deps or project)" >&2; exit 2 ;;
esac

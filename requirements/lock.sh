#!/bin/sh
# Regenerate the pinned constraints from pyproject.toml, keeping every pin that still fits
# (uv pip compile, like pip-compile, keeps the versions already in its output file; add
# --upgrade to move them all, or --upgrade-package NAME for one):
#   requirements/lock.sh [--upgrade]
# Why uv: it resolves all the extras in seconds (pip-tools drives pip's resolver: minutes of
# backtracking through aiobotocore/boto3/s3fs), and it is one wheel (pip install uv), only
# needed by whoever updates the pins; installing from the files needs only pip.
#   requirements/user.txt  client + service + remote: what a user's install pins
#   requirements/test.txt  the same + dev: what the tests and benchmarks need
# torch is pinned by the install scripts (torch==2.13.0, a CPU or CUDA build as the machine has)
# and left out here, with the CUDA packages only its PyPI build pulls: a constraints file must
# never make pip fetch another torch.
set -eu
cd "$(dirname "$0")/.."
UV=${UV:-uv}
command -v "$UV" >/dev/null 2>&1 || { echo "lock.sh needs uv: pip install uv (or UV=/path/to/uv)" >&2; exit 1; }
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==2.13.0" > "$pin"
skip=""
for p in torch torchmetrics triton cuda-bindings cuda-pathfinder cuda-toolkit nvidia-cublas nvidia-cuda-cupti \
         nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand \
         nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-nccl-cu13 nvidia-nvjitlink \
         nvidia-nvshmem-cu13 nvidia-nvtx; do
    skip="$skip --no-emit-package $p"
done
compile() {  # OUT EXTRA...
    out=$1; shift
    extras=""
    for e in "$@"; do extras="$extras --extra $e"; done
    echo "== $out: extras $*"
    # shellcheck disable=SC2086
    "$UV" pip compile pyproject.toml $extras -c "$pin" --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
        --no-annotate --custom-compile-command "requirements/lock.sh" $skip -o "$out" ${UPGRADE:-}
}
[ "${1:-}" = "--upgrade" ] && UPGRADE=--upgrade
compile requirements/test.txt client service remote dev
cp requirements/test.txt requirements/user.txt.seed 2>/dev/null || true
[ -f requirements/user.txt ] || mv requirements/user.txt.seed requirements/user.txt
rm -f requirements/user.txt.seed
compile requirements/user.txt client service remote

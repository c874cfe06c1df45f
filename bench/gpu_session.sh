#!/usr/bin/env bash
# The GPU run of issue 14, in a few large steps. Each step fits one device command (< 10 min).
#
#   bash bench/gpu_session.sh wheels   # HERE, on a machine that reaches PyPI: the Python packages
#                                      # the GPU image lacks, as cp312 x86-64 wheels, into .whl/
#   bash bench/gpu_session.sh tests    # ON THE GPU: tests/cuda plain, under TORCH_CUDA_SANITIZER=1,
#                                      # and the mutant runs (tests/cuda/run_mutants.py)
#   bash bench/gpu_session.sh suite    # ON THE GPU: the new CPU/GPU tests, then the quick suite
#   bash bench/gpu_session.sh bench    # ON THE GPU: python -m bench.gpu at batch 128 and 256, and 256 co-located
#   bash bench/gpu_session.sh issue41  # ON THE GPU: issue 41's checks in one call: tests/cuda, the
#                                      # copy_read mutant run, bench.gpu at 256 and 128 with a model
#                                      # the service outpaces (--model-passes 5), fed over TCP (data
#                                      # frames, and bulk lanes) and co-located
#   bash bench/gpu_session.sh lease    # ON THE GPU: what one 15-minute lease holds, most telling
#                                      # first, every part cut to what is left of LEASE_S (540 s):
#                                      # tests/cuda, the 1-GPU torchrun example, bench.gpu at 256
#                                      # and 128, the mutant runs, tests/cuda under the sanitizer
#
# On the GPU each step installs .whl/ with pip --no-index (no network there), writes its logs into
# results/gpu-<step>/, prints a summary, and, where the device tool's $OUT is set, packs the logs
# into $OUT/<step>.tar.gz and copies summary.txt and any *.json beside it (few files: the tool
# brings back at most 8). Exit status: 0 if every part of the step did what it should.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STEP=${1:?usage: bash bench/gpu_session.sh wheels|tests|suite|bench|issue41|lease}
PY=${PYTHON:-python3}

# Installed on the GPU image already (or plugin-registering packages better not shadowed there).
ON_IMAGE="numpy pytest pluggy iniconfig packaging hypothesis anyio attrs sortedcontainers pygments rich
markdown-it-py mdurl requests urllib3 certifi charset-normalizer idna pyyaml werkzeug click markupsafe tqdm h11
httpcore httpx prometheus-client"

wheels() {
  local tmp
  tmp=$(mktemp -d)
  # the project's service + dev requirements (torch is on the image; the client extra is torch only)
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" \
    "pyzmq>=26" "msgpack>=1.0" "fastapi>=0.110" "uvicorn>=0.29" "simplejpeg>=1.7" "pydantic>=2" \
    "pytest-timeout>=2.3" "schemathesis>=4.29" "kubernetes-validate>=1.29" \
    "pydantic-settings>=2.7" "python-dotenv>=0.21" "dnspython>=2.4" || return 1
  rm -rf .whl && mkdir -p .whl
  for f in "$tmp"/*.whl; do
    name=$(basename "$f" | cut -d- -f1 | tr 'A-Z_' 'a-z-')
    if ! grep -qw -- "$name" <<<"$ON_IMAGE"; then cp "$f" .whl/; fi
  done
  rm -rf "$tmp"
  echo "== $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (git ignores it; carry it: carry=[\".whl\"])"
}

setup_gpu() {
  export PYTHONPATH=$ROOT
  if [ -d .whl ] && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then  # the wheels' target
    # into the interpreter's own environment (the machine is thrown away after), so that tests
    # which start subprocesses with their own PYTHONPATH still find them; else a --target dir
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "installing .whl/ failed"; exit 1; }
      export PYTHONPATH=/tmp/site:$ROOT
    fi
  else
    echo "== no .whl/ for this Python: assuming the packages are installed"
  fi
  export PYTHONUNBUFFERED=1
  RESULTS=$ROOT/results/gpu-$STEP
  rm -rf "$RESULTS" && mkdir -p "$RESULTS"
  SUMMARY=$RESULTS/summary.txt
  : >"$SUMMARY"
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$PY" -c "import sys, torch, zmq; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'pyzmq', zmq.__version__)" 2>&1
    nproc
    df -h /dev/shm | tail -1
    git -C "$ROOT" log --oneline -1 2>/dev/null || true
  } >"$RESULTS/env.txt"
  cat "$RESULTS/env.txt"
  FAILED=0
}

# part NAME TIMEOUT EXPECT CMD...: run CMD with a deadline into NAME.log; EXPECT is "pass" (rc 0)
# or "fail" (rc 1: tests failed, which a mutant run must produce).
part() {
  local name=$1 limit=$2 expect=$3
  shift 3
  local t0=$SECONDS
  if [ -n "${DEADLINE:-}" ]; then  # the lease step: no part runs past the step's own deadline
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then
      printf '%-22s %-17s %4ss  %s\n' "$name" "NOT RUN (no time)" 0 "$*" | tee -a "$SUMMARY"
      FAILED=1
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name: $*"
  timeout --kill-after=20 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  local verdict=ok
  if { [ "$expect" = pass ] && [ $rc -ne 0 ]; } || { [ "$expect" = fail ] && [ $rc -ne 1 ]; }; then
    verdict=UNEXPECTED
    FAILED=1
  fi
  printf '%-22s rc=%-3s %-10s %4ss  %s\n' "$name" "$rc" "$verdict" $((SECONDS - t0)) "$*" | tee -a "$SUMMARY"
  tail -n 3 "$RESULTS/$name.log"
}

finish() {
  echo
  cat "$SUMMARY"
  if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/$STEP.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
    cp "$SUMMARY" "$OUT/$STEP-summary.txt"
    cp "$RESULTS"/*.json "$OUT/" 2>/dev/null
    echo "== $STEP.tar.gz, $STEP-summary.txt and any .json in \$OUT"
  fi
  exit $FAILED
}

case $STEP in
  wheels)
    wheels
    ;;
  tests)
    setup_gpu
    part cuda-plain 150 pass "$PY" -m pytest tests/cuda -v -rs -p no:cacheprovider
    part cuda-sanitizer 240 pass env TORCH_CUDA_SANITIZER=1 "$PY" -m pytest tests/cuda -v -rs -p no:cacheprovider
    part mutants 180 pass "$PY" tests/cuda/run_mutants.py --out "$RESULTS/mutants"
    cp "$RESULTS/mutants.log" "$RESULTS/mutants.md" 2>/dev/null
    finish
    ;;
  suite)
    setup_gpu
    part new-tests 200 pass "$PY" -m pytest tests/unit/client/test_sinks.py tests/e2e/test_examples.py tests/bench/test_bench_gpu_smoke.py \
      tests/e2e/test_client.py -v -rs -p no:cacheprovider
    part quick-suite 360 pass "$PY" -m pytest -q -rs -m "not slow and not container" -p no:cacheprovider
    finish
    ;;
  bench)
    setup_gpu
    for b in 128 256; do
      part "bench-gpu-$b" 270 pass "$PY" -m bench.gpu --batch-size "$b" --json "$RESULTS/bench-gpu-$b.json"
    done
    finish
    ;;
  issue41)
    setup_gpu
    DEADLINE=$((SECONDS + ${LEASE_S:-480}))
    part cuda-plain 120 pass "$PY" -m pytest tests/cuda -v -rs -p no:cacheprovider
    part mutant-copy-read 100 pass "$PY" tests/cuda/run_mutants.py --only copy_read --out "$RESULTS/mutants"
    for b in 256 128; do
      part "bench-gpu-$b" 200 pass "$PY" -m bench.gpu --batch-size "$b" --steps 100 --model-passes 5 \
        --feeds tcp,lanes,local --json "$RESULTS/bench-gpu-$b.json"
    done
    finish
    ;;
  lease)
    setup_gpu
    DEADLINE=$((SECONDS + ${LEASE_S:-540}))
    part cuda-plain 150 pass "$PY" -m pytest tests/cuda -v -rs -p no:cacheprovider
    part torchrun-1gpu 100 pass "$PY" -m pytest tests/e2e/test_examples.py -m cuda -v -rs -p no:cacheprovider
    part bench-gpu-256 150 pass "$PY" -m bench.gpu --batch-size 256 --steps 100 --json "$RESULTS/bench-gpu-256.json"
    part bench-gpu-128 120 pass "$PY" -m bench.gpu --batch-size 128 --steps 100 --json "$RESULTS/bench-gpu-128.json"
    part mutants 180 pass "$PY" tests/cuda/run_mutants.py --out "$RESULTS/mutants"
    part cuda-sanitizer 240 pass env TORCH_CUDA_SANITIZER=1 "$PY" -m pytest tests/cuda -v -rs -p no:cacheprovider
    finish
    ;;
  *)
    echo "unknown step $STEP: wheels|tests|suite|bench|issue41|lease" >&2
    exit 2
    ;;
esac

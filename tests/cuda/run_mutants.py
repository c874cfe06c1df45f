#!/usr/bin/env python
"""Show that the CUDA race tests can fail: remove each of CudaSink's guarantees in turn and
check that the race tests then fail with wrong bytes (an assertion, not an error).

    python tests/cuda/run_mutants.py [--out DIR] [--only copy_read,...]   # on a machine with an NVIDIA GPU

First the race tests run on the real code (they must pass), then once per mutant with
``LOADER_CUDA_MUTANT=<name>`` (tests/cuda/conftest.py replaces that one method with a stand-in
that skips its guarantee).
Prints a table; exit status 0 only when the real code passes and every mutant is killed.
Without CUDA it says so and exits 0 (nothing to run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the race tests each mutant must fail (others may fail too)
MUST_FAIL = {
    "ring_wait": ("test_race_side_stream_lags_and_the_trainer_reads_at_once",),
    "stream_wait": ("test_race_side_stream_lags_and_the_trainer_reads_at_once",),
    "record_stream": ("test_race_slow_compute_stream_never_sees_a_batch_change_under_it",),
    "copy_read": ("test_race_co_located_copy_reads_the_service_s_slot_before_it_goes_back",
                  "test_race_lanes_buffer_is_received_into_again_only_after_its_copy_ran"),
}


def run(mutant: str, out: str) -> dict:
    """Run the race tests with ``mutant`` ('' = the real code); outcome per test name."""
    xml = os.path.join(out, f"race-{mutant or 'real'}.xml")
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)  # keep a carried site dir
    env = dict(os.environ, LOADER_CUDA_MUTANT=mutant, PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "tests/cuda", "-k", "race", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}"]
    with open(os.path.join(out, f"race-{mutant or 'real'}.log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "").split("[")[0]
        if case.find("failure") is not None:
            outcomes[name] = "failed"  # an assertion: the race was observed
        elif case.find("error") is not None:
            outcomes[name] = "error"  # a crash or fixture error: proves nothing
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "mutants"))
    p.add_argument("--only", default=",".join(MUST_FAIL), help=f"the mutants to run, comma-separated "
                   f"(default: all of {', '.join(MUST_FAIL)})")
    args = p.parse_args()
    only = [m for m in args.only.split(",") if m]
    if not only or set(only) - set(MUST_FAIL):
        p.error(f"--only takes mutants among {', '.join(MUST_FAIL)}")
    import torch

    if not torch.cuda.is_available():
        print("run_mutants.py: no CUDA device (torch.cuda.is_available() is False): nothing to run")
        return 0
    os.makedirs(args.out, exist_ok=True)
    real = run("", args.out)
    ok = bool(real) and all(v == "passed" for v in real.values())
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| build | race tests failed | verdict |\n|---|---|---|")
    print(f"| real code | {', '.join(k for k, v in real.items() if v != 'passed') or 'none'} | "
          f"{'ok' if ok else 'BROKEN: the real code must pass'} |")
    for mutant in only:
        must = MUST_FAIL[mutant]
        got = run(mutant, args.out)
        failed = sorted(k for k, v in got.items() if v == "failed")
        survived = [f"{t}: {got.get(t)}" for t in must if got.get(t) != "failed"]
        ok &= not survived
        verdict = f"SURVIVED ({'; '.join(survived)})" if survived else "killed"
        print(f"| without {mutant} | {', '.join(failed) or 'none'} | {verdict} |")
    print(f"\nlogs and junit XML in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

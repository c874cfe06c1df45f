"""The trainer's work per image, counted in instructions rather than timed (issue 41).

    python -m bench.trainer_instructions [--photos ~/.cache/remote-loader/photos] [--group imagenet]
                                         [--layouts local,tcp,lanes] [--epochs 2] [--batch-size 64]

The trainer's CPU per image (``bench.percore``) is a few microseconds measured beside decode
processes on the same cores: it moves by 10-20% from one run to the next with what else those
cores do, more than most changes to the client move it. Here the trainer's process runs under
valgrind's callgrind, which counts the instructions it executes (every thread of the process,
the ZeroMQ I/O thread included), only while it takes the timed epochs; the service runs natively
beside it. The count does not depend on the machine's load, so a change to the client's receive
path shows as a change in instructions per image however noisy the machine is.

Per layout, one row: ``local`` (co-located: ``RemoteLoader(local=True)``, batches lent in place
from the service's shared memory), ``tcp`` (data frames over loopback TCP) and ``lanes`` (over TCP
with two bulk lanes). Needs ``valgrind`` (``apt-get install valgrind``); under it the trainer is
some 50x slower, so it never waits for a batch, and the count leaves out what a trainer that
waits spends on its waits (the poll, a few percent of its work on a real run).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

from bench.harness import log, machine, start_service, table_head, table_row

LAYOUTS = {"local": "co-located (local=True)", "tcp": "TCP, data frames", "lanes": "TCP, 2 bulk lanes"}
LANES = 2


def child(layout: str, dataset_dir: str, epochs: int, batch_size: int) -> None:
    """Under callgrind: the service (native), a warm-up epoch, then the timed epochs with
    instruction counting on; prints ``images N``."""
    from client import RemoteLoader

    svc = start_service(["--data", dataset_dir, "--workers", "2", *(["--lane-port", "0"] if layout == "lanes" else [])])
    try:
        options = {"local": True} if layout == "local" else {"lanes": LANES} if layout == "lanes" else {}
        # a trainer 50x slower than usual: the service waits for it, never the reverse
        with RemoteLoader(svc.endpoint, batch_size=batch_size, image_size=224, seed=0, prefetch=4, timeout=600,
                          **options) as loader:
            loader.set_epoch(0)
            for _ in loader:
                pass
            if layout == "lanes" and not all(r.lanes is not None for r in loader._conns.replicas):
                raise RuntimeError("the lanes row's loader has no bulk lanes open")
            images = 0
            _counting("on")
            for epoch in range(1, epochs + 1):
                loader.set_epoch(epoch)
                for batch in loader:
                    images += len(batch)
            _counting("off")
        print(f"images {images}", flush=True)
    finally:
        svc.stop()


def _counting(state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True, timeout=60)


def measure(layout: str, dataset_dir: str, epochs: int, batch_size: int) -> Dict[str, float]:
    """Run :func:`child` under callgrind; instructions per image."""
    with tempfile.TemporaryDirectory(prefix="rl-callgrind-") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        proc = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                               sys.executable, "-m", "bench.trainer_instructions", "--child", layout,
                               "--dataset-dir", dataset_dir, "--epochs", str(epochs), "--batch-size", str(batch_size)],
                              capture_output=True, text=True, timeout=3600)
        found = re.search(r"^images (\d+)$", proc.stdout, re.M)
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"the {layout} trainer under callgrind failed (rc {proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        with open(out) as f:  # "totals:" (its "summary:" is 0 when counting starts switched off)
            totals = [int(n) for n in re.findall(r"^totals: (\d+)", f.read(), re.M)]
        if not totals:
            raise RuntimeError(f"{out} holds no instruction count")
        images = int(found.group(1))
        return {"images": images, "instructions": totals[0], "per_image": totals[0] / images}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--photos", default=os.path.expanduser("~/.cache/remote-loader/photos"),
                    help="a photo set of bench.photo_sets (the default is where it puts one)")
    ap.add_argument("--group", default="imagenet", help="the set's folder to read")
    ap.add_argument("--layouts", default="local,tcp,lanes", help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--child", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    ap.add_argument("--dataset-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.dataset_dir, args.epochs, args.batch_size)
        return 0
    layouts = [s for s in args.layouts.split(",") if s]
    unknown = [s for s in layouts if s not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"{' and '.join(missing)} not found: this benchmark counts instructions under valgrind "
              "(apt-get install valgrind)", file=sys.stderr)
        return 2
    dataset_dir = os.path.join(args.photos, args.group)
    if not os.path.isdir(dataset_dir):
        print(f"no photos at {dataset_dir}: python -m bench.photo_sets makes them", file=sys.stderr)
        return 2
    print(f"# Trainer instructions per image ({machine()}; {dataset_dir}, batch {args.batch_size}, "
          f"{args.epochs} epochs counted)\n")
    print(table_head(["layout", "images", "instructions", "per image"], "lrrr"))
    for layout in layouts:
        log(f"{layout}: counting under callgrind ...")
        got = measure(layout, dataset_dir, args.epochs, args.batch_size)
        print(table_row([LAYOUTS[layout], got["images"], f"{got['instructions']:,}", f"{got['per_image']:,.0f}"]),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Freeze recovery: the service process is stopped (SIGSTOP: a VM pause, a swap storm, a
debugger) while two DDP ranks stream, then continued. For each freeze length and each point of
the epoch, how long after SIGCONT the ranks get their next batch and finish the epoch, and
whether every sample came exactly once.

    python -m bench.reliability.freeze --freezes 5 15 25 --repeats 3   # prints a table; exit 1 on a lost or doubled sample
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time

from bench.harness import table_head, table_row
from client import RemoteLoader
from testkit.service import ServiceProcess, free_port

POINTS = {"start": 1 / 15, "middle": 7 / 15, "end": 14 / 15}  # share of each rank's epoch taken first


def one_run(freeze_s: float, point: str, n: int, batch_size: int, heartbeat_s: float) -> dict:
    svc = ServiceProcess(free_port(), ["--demo", "--demo-size", str(n), "--workers", "2"],
                         env={"LOADER_HEARTBEAT_S": str(heartbeat_s)})
    try:
        loaders = [RemoteLoader(svc.endpoint, batch_size=batch_size, image_size=32, seed=1, rank=k, world_size=2,
                                heartbeat_s=heartbeat_s, timeout=60, epoch_lookahead=False) for k in (0, 1)]
        per_rank = len(loaders[0])
        taken = max(1, round(POINTS[point] * per_rank))
        got = {0: [], 1: []}
        iters = [iter(ld) for ld in loaders]
        for k in (0, 1):
            for _ in range(taken):
                got[k] += next(iters[k]).indices
        svc.proc.send_signal(signal.SIGSTOP)
        time.sleep(freeze_s)
        svc.proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        first = {}
        errors = []

        def finish(k):
            try:
                for b in iters[k]:
                    first.setdefault(k, time.monotonic() - resumed)
                    got[k] += b.indices
            except Exception as exc:
                errors.append(f"rank {k}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=finish, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        done = time.monotonic() - resumed
        for ld in loaders:
            ld.close()
        samples = sorted(got[0] + got[1])
        return {"first_s": max(first.values()) if len(first) == 2 else float("nan"), "done_s": done,
                "exact": samples == list(range(n)) and not errors, "errors": errors,
                "lost": len(set(range(n)) - set(samples)), "doubled": len(samples) - len(set(samples))}
    finally:
        svc.proc.send_signal(signal.SIGCONT)
        svc.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--freezes", type=float, nargs="+", default=[5, 15, 25])
    p.add_argument("--points", nargs="+", default=list(POINTS), choices=list(POINTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--demo-size", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--heartbeat", type=float, default=2.0, help="service and client heartbeat (default: the service's)")
    a = p.parse_args()
    print(f"# load average at start: {os.getloadavg()[0]:.2f}; 2 ranks, {a.demo_size} samples, batch {a.batch_size}, "
          f"heartbeat {a.heartbeat}s, loader timeout 60s", flush=True)
    print(table_head(["freeze", "point of the epoch", "first batch after SIGCONT, s (median, range)",
                      "epoch done after SIGCONT, s (median, range)", "exactly once"], "rlrrl"))
    ok = True
    for f in a.freezes:
        for point in a.points:
            runs = [one_run(f, point, a.demo_size, a.batch_size, a.heartbeat) for _ in range(a.repeats)]
            firsts, dones = [r["first_s"] for r in runs], [r["done_s"] for r in runs]
            exact = all(r["exact"] for r in runs)
            ok &= exact
            verdict = (f"yes ({len(runs)}/{len(runs)} runs)" if exact
                       else "NO: " + "; ".join(str(r) for r in runs if not r["exact"]))
            print(table_row([f"{f:g} s", point, f"{statistics.median(firsts):.1f} ({min(firsts):.1f}-{max(firsts):.1f})",
                             f"{statistics.median(dones):.1f} ({min(dones):.1f}-{max(dones):.1f})", verdict]), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

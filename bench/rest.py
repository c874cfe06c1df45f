"""REST responsiveness under load, and live scale-up.

    python -m bench.rest [--workers-before 1 --workers-after 2] [--seconds 8]

Starts a service (separate process) on the demo dataset and a client that consumes batches as
fast as it can (the data plane at full rate), then, in this process:
  1. measures GET /healthz and GET /v1/status latency (p50, p99, max) over --requests calls
     while the client streams, and the same with the data plane idle for reference;
  2. measures the client's throughput for --seconds, scales the pool live with
     PUT /v1/workers, and measures it again.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request

from bench.harness import command, table_head, table_row
from client import RemoteLoader
from testkit.service import ServiceProcess, free_port


def latencies(url: str, n: int) -> list:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as r:
            r.read()
        out.append(time.perf_counter() - t0)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers-before", type=int, default=1)
    p.add_argument("--workers-after", type=int, default=2)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--demo-size", type=int, default=2000)
    args = p.parse_args()
    svc = ServiceProcess(free_port(), ["--demo", "--demo-size", str(args.demo_size), "--workers",
                                       str(args.workers_before)])
    stop = threading.Event()
    delivered = [0]

    def consume():
        with RemoteLoader(svc.endpoint, batch_size=args.batch_size, prefetch=8, timeout=120) as ld:
            while not stop.is_set():
                for b in ld:
                    delivered[0] += len(b)
                    if stop.is_set():
                        break

    def rate(seconds):
        n0, t0 = delivered[0], time.perf_counter()
        time.sleep(seconds)  # a measurement window, not a wait for an event
        return (delivered[0] - n0) / (time.perf_counter() - t0)

    try:
        idle = {path: latencies(svc.url + path, args.requests) for path in ("/healthz", "/v1/status")}
        t = threading.Thread(target=consume)
        t.start()
        while delivered[0] == 0:
            time.sleep(0.05)
        busy = {path: latencies(svc.url + path, args.requests) for path in ("/healthz", "/v1/status")}
        before = rate(args.seconds)
        t_scale = time.perf_counter()
        svc.scale(args.workers_after)
        scale_ms = 1e3 * (time.perf_counter() - t_scale)
        rate(1.0)  # new workers start (spawn) during this second
        after = rate(args.seconds)
        stop.set()
        t.join()
    finally:
        stop.set()
        svc.stop()
    print(f"# CPUs {os.cpu_count()}; command: {command('bench.rest')}\n")
    print(table_head(["endpoint", "data plane", "p50 ms", "p99 ms", "max ms"], "llrrr"))
    for label, table in (("idle", idle), ("streaming at full rate", busy)):
        for path, xs in table.items():
            print(table_row([path, label, f"{1e3 * statistics.median(xs):.2f}", f"{1e3 * pct(xs, 0.99):.2f}",
                             f"{1e3 * max(xs):.2f}"]))
    print("\n" + table_head(["workers", "client img/s"], "lr"))
    print(table_row([args.workers_before, f"{before:.0f}"]))
    print(table_row([f"{args.workers_after} (scaled live; PUT took {scale_ms:.1f} ms)", f"{after:.0f}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

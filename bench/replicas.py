"""One trainer rank fed by two service replicas of unequal speed (1 and 2 workers).

    python -m bench.replicas [--mode latency|cpu|both] [--epochs 3] [--batch-size 32]
                             [--read-delay-ms 10] [--demo-size 2000] [--data DIR] [--runs 3]
                             [--json PATH]

Each replica is a service in its own process on this machine (the demo dataset, or the
ImageFolder / packed dataset ``--data DIR``, e.g. the real-photo set of ``bench.photo_sets``), one
with ``--workers 1`` and one with ``--workers 2``. Three runs of a ``RemoteLoader`` in this
process, each over one warm-up epoch and ``--epochs`` timed ones: the slow replica alone, the fast
one alone, then both (``RemoteLoader([slow, fast])``). The target: both together deliver at least
0.9x the sum of the two solo rates. ``--runs N`` repeats the three (with the same two services)
N times; each cell is the median, and the runs are listed.

Two modes:

* ``latency``: every sample read takes ``--read-delay-ms`` (a FaultSource wrapper: storage
  latency, as with a network file system or an object store), so a replica's speed is set by
  its worker count, not by the cores the two replicas share on this machine. This is the mode
  that tests the flow control: on a cluster each replica has its own cores.
* ``cpu``: plain decoding. On one machine the two replicas compete for the same cores, so the
  sum of the solo rates is more than the machine can do; the row shows what the pair gets.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import List, Optional

from bench.harness import command, save_json, median_of, table_head, table_row
from client import RemoteLoader
from testkit.service import free_port


def _serve(port: int, workers: int, delay_s: float, demo_size: int, data: Optional[str], ready, stop,
           host: str = "127.0.0.1") -> None:
    import logging

    from loader_service.config import ServiceConfig
    from loader_service.service import Service
    from loader_service.sources import open_path
    from loader_service.sources.demo import ensure_demo
    from testkit.fault_source import FaultSource

    logging.basicConfig(level=logging.WARNING)
    src = open_path(data) if data else ensure_demo(demo_size, quiet=True)
    sources = {src.name: FaultSource(src, read_delay_s=delay_s)} if delay_s else None
    dataset = {"data": (data,)} if data else {"demo": True, "demo_size": demo_size}
    svc = Service(ServiceConfig(**dataset, workers=workers, host=host,
                                data_port=port, http_port=0, status_log_s=0), sources=sources).start()
    svc.wait_ready(120)
    ready.set()
    stop.wait()
    svc.stop()


def _rate(endpoints: List[str], epochs: int, batch_size: int) -> float:
    with RemoteLoader(endpoints, batch_size=batch_size, image_size=224, prefetch=4, seed=1, timeout=120) as ld:
        for _ in ld:  # warm-up epoch
            pass
        n, t0 = 0, time.perf_counter()
        for _ in range(epochs):
            for b in ld:
                n += len(b)
        return n / (time.perf_counter() - t0)


def run(mode: str, args) -> dict:
    ctx = mp.get_context("spawn")
    delay = args.read_delay_ms / 1000 if mode == "latency" else 0.0
    stop = ctx.Event()
    procs, endpoints = [], []
    for workers in (1, 2):
        port, ready = free_port(), ctx.Event()
        p = ctx.Process(target=_serve, args=(port, workers, delay, args.demo_size, args.data, ready, stop))
        p.start()
        if not ready.wait(300):
            raise RuntimeError("a service did not start")
        procs.append(p)
        endpoints.append(f"tcp://127.0.0.1:{port}")
    runs = []
    try:
        for i in range(args.runs):
            slow = _rate([endpoints[0]], args.epochs, args.batch_size)
            fast = _rate([endpoints[1]], args.epochs, args.batch_size)
            both = _rate(endpoints, args.epochs, args.batch_size)
            runs.append({"slow_1_worker": slow, "fast_2_workers": fast, "both": both, "ratio_to_sum": both / (slow + fast)})
            print(f"{mode} run {i + 1}/{args.runs}: slow {slow:.1f}, fast {fast:.1f}, both {both:.1f} img/s "
                  f"({both / (slow + fast):.2f} of the sum)", file=sys.stderr, flush=True)
    finally:
        stop.set()
        for p in procs:
            p.join(60)
    med = median_of(runs)
    return {"mode": mode, **med, "runs": runs}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["latency", "cpu", "both"], default="both")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--read-delay-ms", type=float, default=10.0)
    p.add_argument("--demo-size", type=int, default=2000)
    p.add_argument("--data", metavar="DIR", help="ImageFolder or packed dataset (default: the demo set)")
    p.add_argument("--runs", type=int, default=1, help="repeat the three rates; cells are medians")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    if args.data:
        args.data = os.path.abspath(args.data)
    load = os.getloadavg()[0]
    rows = [run(m, args) for m in (["latency", "cpu"] if args.mode == "both" else [args.mode])]
    dataset = args.data or f"demo {args.demo_size} images"
    print(f"\nmachine: {os.cpu_count()} CPUs (load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end) | "
          f"{dataset} | runs: {args.runs} (median) | "
          f"batch {args.batch_size} | 224 px | {args.epochs} timed epochs (+1 warm-up) | read delay "
          f"{args.read_delay_ms:g} ms in latency mode | command: `{command('bench.replicas', argv)}`\n")
    print(table_head(["mode", "slow replica alone (1 worker) img/s", "fast replica alone (2 workers) img/s",
                      "both, one rank img/s", "both / (slow + fast)", "both / (slow + fast), each run"], "lrrrrl"))
    for r in rows:
        print(table_row([r["mode"], f"{r['slow_1_worker']:.1f}", f"{r['fast_2_workers']:.1f}", f"{r['both']:.1f}",
                         f"{r['ratio_to_sum']:.2f}", " / ".join(f"{x['ratio_to_sum']:.2f}" for x in r["runs"])]))
    for r in rows:
        if r["mode"] == "latency":
            verdict = "PASS" if r["ratio_to_sum"] >= 0.9 else "MISS"
            print(f"\n{verdict} two unequal replicas >= 0.9x the sum of their solo rates: {r['ratio_to_sum']:.2f}")
    save_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

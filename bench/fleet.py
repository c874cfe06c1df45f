"""Throughput of one trainer rank while its fleet grows and shrinks: the rank follows a DNS name
(dnsmasq on loopback), and the records change from 1 to 3 to 2 replicas during the run.

    python -m bench.fleet [--batches 60] [--batch-size 16] [--read-delay-ms 10] [--workers 1]
                          [--demo-size 2000] [--json PATH]

Each replica is a service in its own process on 127.0.0.1, .2 and .3 (one port), with
``--workers`` workers and a read delay per sample (storage latency, as in ``bench.replicas``'
latency mode), so a replica's speed is set by its workers, not by the cores the replicas share
on this machine. One ``RemoteLoader("tcp://loader-fleet:PORT", expect_replicas=3)`` iterates
epochs without end; each phase times ``--batches`` batches once the loader streams from the
phase's replicas (the batches while replicas join or leave are counted apart, as the transition).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import List, Optional

from bench.harness import command, save_json, forever, table_head, table_row
from bench.replicas import _serve
from client import RemoteLoader
from testkit.dns import DnsServer, port_free_on

NAME = "loader-fleet"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
PHASES = (("1 replica", HOSTS[:1]), ("3 replicas (2 joined)", HOSTS), ("2 replicas (127.0.0.2 left)",
                                                                       (HOSTS[0], HOSTS[2])))


def _timed(batches, n: int) -> float:
    """img/s over the next ``n`` batches."""
    images, t0 = 0, time.perf_counter()
    for _ in range(n):
        images += len(next(batches))
    return images / (time.perf_counter() - t0)


def run(args) -> List[dict]:
    ctx = mp.get_context("spawn")
    stop, procs = ctx.Event(), []
    port = port_free_on(HOSTS)
    rows = []
    with DnsServer() as dns:
        try:
            for host in HOSTS:
                ready = ctx.Event()
                p = ctx.Process(target=_serve, args=(port, args.workers, args.read_delay_ms / 1000, args.demo_size,
                                                     None, ready, stop, host))
                p.start()
                procs.append(p)
                if not ready.wait(300):
                    raise RuntimeError(f"the service on {host} did not start")
            dns.set({NAME: PHASES[0][1]})
            with RemoteLoader(f"tcp://{NAME}:{port}", batch_size=args.batch_size, image_size=224, seed=1,
                              prefetch=4, expect_replicas=3, dns_server=dns.server, dns_refresh_s=0.5,
                              timeout=120) as ld:
                batches = forever(ld)
                next(batches)  # connected, streaming
                for label, hosts in PHASES:
                    dns.set({NAME: hosts})
                    want = {f"tcp://{h}:{port}" for h in hosts}
                    moved, t0 = 0, time.perf_counter()
                    while set(ld.replicas()) != want:
                        next(batches)
                        moved += 1
                    settle = time.perf_counter() - t0
                    _timed(batches, max(1, args.batches // 4))  # the new replicas' first batches: warm-up
                    rate = _timed(batches, args.batches)
                    rows.append({"phase": label, "replicas": len(hosts), "images_per_s": rate,
                                 "transition_batches": moved, "transition_s": settle})
                    print(f"{label}: {rate:.1f} img/s ({moved} batches, {settle:.2f}s to follow the records)",
                          file=sys.stderr, flush=True)
        finally:
            stop.set()
            for p in procs:
                p.join(60)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=60, help="timed batches per phase")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--read-delay-ms", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=1, help="workers per replica")
    p.add_argument("--demo-size", type=int, default=2000)
    p.add_argument("--json")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    rows = run(args)
    print(f"\nmachine: {os.cpu_count()} CPUs (load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end) | "
          f"demo {args.demo_size} images | batch {args.batch_size} | 224 px | {args.workers} worker(s) per replica | "
          f"read delay {args.read_delay_ms:g} ms | {args.batches} timed batches per phase | records re-read every "
          f"0.5 s | command: `{command('bench.fleet', argv)}`\n")
    print(table_head(["phase", "replicas", "img/s", "x the 1-replica rate", "batches while following",
                      "seconds to follow"], "lrrrrr"))
    base = rows[0]["images_per_s"]
    for r in rows:
        print(table_row([r["phase"], r["replicas"], f"{r['images_per_s']:.1f}", f"{r['images_per_s'] / base:.2f}",
                         r["transition_batches"], f"{r['transition_s']:.2f}"]))
    save_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The cost of CURVE on the data port: the service + RemoteLoader with and without keys.

    python -m bench.curve [--data DIR] [--workers N] [--batch-size 64] [--epochs 2] [--rounds 3]
                          [--io-threads 1,2] [--skip-decode] [--demo-size 2000] [--json PATH]
                          [--split SERVICE_CPUS:CLIENT_CPUS]

Rows, alternated round by round so that a drifting machine hurts them alike:

* **plain**: ``loader-service serve`` with no keys, ZeroMQ I/O threads 1;
* **CURVE, io N**: ``serve --curve-keys DIR`` (keys from ``loader-service keys``) with
  ``LOADER_IO_THREADS=N`` for every N in ``--io-threads``; the client uses the same keys.

Each row is the service in its own process and a RemoteLoader in this one (prefetch
``max(4, 2N)``), one warm-up epoch, then ``--epochs`` timed epochs (the same
``bench.throughput`` measures as its service row). ``--skip-decode`` registers and asks for
the ``blank`` pipeline of bench/doubles.py (workers decode nothing; the transport alone, what
CURVE costs at most; see bench.transport). The table shows each row's median over the rounds, its share of the plain row's
images/s, and the CPU seconds per 1000 images of the client process and of the service's
processes (where encryption and decryption land). ``--split 0:1`` gives the service (and its
decode processes) CPU 0 and this process CPU 1, as two machines would: the trainer's cipher
work and RemoteLoader no longer take time from the service's decoding. Prints PASS/MISS against "CURVE within 10% of
plain"; the exit status does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Dict, List, Optional

from bench import doubles
from bench.harness import (command, machine, median_of, parse_split, run_epochs, set_affinity, start_service,
                           table_head, table_row, warm_page_cache)
from client import RemoteLoader
from loader_service.sources import open_path
from loader_service.sources.demo import ensure_demo
from wire.keys import make_keys
from wire.plan import PlanSpec, make_plan

SEED = 0


def run_row(keys: Optional[str], io_threads: int, args) -> dict:
    data = ["--data", os.path.abspath(args.data)] if args.data else ["--demo", "--demo-size", str(args.demo_size)]
    env = {"LOADER_IO_THREADS": str(io_threads)}
    blank = ["--pipeline", doubles.BLANK] if args.skip_decode else []
    service_cpus, client_cpus = args.split or (None, None)
    try:
        set_affinity(service_cpus)  # the service and its decode processes inherit it
        svc = start_service([*data, "--workers", str(args.workers), *blank] + (["--curve-keys", keys] if keys else []),
                            env)
    finally:
        set_affinity(client_cpus)
    prefetch = max(4, 2 * args.workers)
    try:
        pipeline = dict(pipeline="blank", pipeline_args={"size": 224}) if args.skip_decode else {}
        with RemoteLoader(svc.endpoint, batch_size=args.batch_size, seed=SEED, prefetch=prefetch,
                          curve_keys=keys or "", **pipeline) as loader:
            run = run_epochs(loader, svc, range(1, args.epochs + 1))
    finally:
        svc.stop()
    samples, dt = run.samples, run.seconds
    return {"samples": samples, "seconds": dt, "img_s": samples / dt, "mb_s": run.nbytes / dt / 1e6,
            "client_cpu_per_1000": 1000 * run.client_cpu_s / samples,
            "service_cpu_per_1000": 1000 * run.service_cpu_s / samples}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per row and round (after a warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--io-threads", default="1,2", help="ZeroMQ I/O threads of the service, CURVE rows")
    p.add_argument("--skip-decode", action="store_true", help="workers do not decode: the transport alone")
    p.add_argument("--data", metavar="DIR", help="serve this ImageFolder / packed dataset (real photos) instead of the demo set")
    p.add_argument("--demo-size", type=int, default=2000)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--split", type=parse_split, metavar="SERVICE_CPUS:CLIENT_CPUS",
                   help="pin the service to SERVICE_CPUS and this client process to CLIENT_CPUS (two machines' worth)")
    args = p.parse_args(argv)
    command_line = command("bench.curve", argv)
    if args.data:
        src = open_path(os.path.abspath(args.data))
        n, what = len(src), f"{args.data} ({len(src)} images)"
        warm_page_cache(src)  # no row pays for the first read
    else:
        src = ensure_demo(args.demo_size)
        n, what = len(src), f"demo {len(src)} images"
    src.close()
    expected = sum(make_plan(PlanSpec(n, args.batch_size, SEED, e)).num_samples
                   for e in range(1, args.epochs + 1))
    rows = [("plain, io 1", False, 1)] + [(f"CURVE, io {n}", True, int(n)) for n in args.io_threads.split(",")]
    results: Dict[str, List[dict]] = {name: [] for name, _, _ in rows}
    started = machine()
    with tempfile.TemporaryDirectory(prefix="bench-curve-") as tmp:
        keys = os.path.join(tmp, "keys")
        make_keys(keys)
        for rnd in range(args.rounds):
            for name, curve, io in rows:
                r = run_row(keys if curve else None, io, args)
                if r["samples"] != expected:
                    print(f"warning: {name} delivered {r['samples']} samples, expected {expected}", file=sys.stderr)
                print(f"round {rnd + 1} {name}: {r['img_s']:.1f} img/s, {r['mb_s']:.0f} MB/s", file=sys.stderr,
                      flush=True)
                results[name].append(r)
    med = {name: median_of(rs) for name, rs in results.items()}
    base = med[rows[0][0]]["img_s"]
    print(f"\nmachine: {started} | {what} | batch {args.batch_size} | workers {args.workers} | "
          f"decode {'off' if args.skip_decode else 'on'} | "
          f"{'service CPUs %s, client CPUs %s' % tuple(sorted(c) for c in args.split) if args.split else 'CPUs shared'} | {args.epochs} timed epochs x {args.rounds} rounds | "
          f"command: `{command_line}`\n")
    print(table_head(["row", "images/s (median)", "MB/s", "% of plain", "each round's % of plain",
                      "client CPU s / 1000 img", "service CPU s / 1000 img"], "lrrrlrr"))
    for name, _, _ in rows:
        m = med[name]
        per_round = ", ".join(f"{100 * r['img_s'] / p['img_s']:.0f}" for r, p in zip(results[name], results[rows[0][0]]))
        print(table_row([name, f"{m['img_s']:.1f}", f"{m['mb_s']:.0f}", f"{100 * m['img_s'] / base:.1f}%", per_round,
                         f"{m['client_cpu_per_1000']:.3f}", f"{m['service_cpu_per_1000']:.3f}"]))
    best = max((med[n]["img_s"], n) for n, c, _ in rows if c)
    verdict = "PASS" if best[0] >= 0.9 * base else "MISS"
    print(f"\n{verdict}: best CURVE row ({best[1]}) at {100 * best[0] / base:.1f}% of plain (target >= 90%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command_line, "machine": started, "rounds": results, "median": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

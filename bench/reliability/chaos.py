"""Chaos run: several epochs of several jobs and DDP ranks while workers are SIGKILLed, the
pool is rescaled, clients restart from their state_dict, and the service is SIGKILLed or
SIGTERMed and started again on the same port. Then every (job, epoch) is checked against
its plan: samples lost and doubled must both be 0.

    python -m bench.reliability.chaos --epochs 4 --seed 0   # exit code 0 when nothing was lost or doubled
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import threading
import time

from client import RemoteLoader
from testkit.service import ServiceProcess, free_port
from wire.plan import epoch_permutation

EVENTS = ("kill_worker", "scale", "restart_client", "restart_service_kill", "restart_service_term")


def expected(n: int, world: int, seed: int, epoch: int) -> collections.Counter:
    """What one epoch delivers over all ranks with drop_last=False (plan.py's padding rule)."""
    import numpy as np

    total = -(-n // world) * world
    return collections.Counter(list(range(n)) + np.resize(epoch_permutation(n, seed, epoch, True), total)[n:].tolist())


def run(args) -> dict:
    rng = random.Random(args.seed)
    port = free_port()
    svc_args = ["--demo", "--demo-size", str(args.demo_size), "--workers", str(args.workers)]
    env = {"LOADER_HEARTBEAT_S": "0.5"}
    state = {"svc": ServiceProcess(port, svc_args, env)}
    endpoint = state["svc"].endpoint
    got = collections.defaultdict(list)  # (job, epoch) -> indices from all ranks
    restart_flags = {}
    counts = collections.Counter()
    errors = []
    done = threading.Event()

    def client(job: int, rank: int):
        key = (job, rank)
        kw = dict(batch_size=args.batch_size + job, image_size=32, rank=rank, world_size=args.world, seed=job,
                  timeout=120, job=f"job{job}")
        ld = RemoteLoader(endpoint, **kw)
        try:
            for epoch in range(args.epochs):
                ld.set_epoch(epoch)
                while True:  # until the epoch is complete, across client restarts
                    finished = True
                    for batch in ld:
                        got[(job, epoch)].extend(batch.indices)
                        if restart_flags.pop(key, False):
                            state_dict = ld.state_dict()
                            ld.close()
                            ld = RemoteLoader(endpoint, **kw)
                            ld.load_state_dict(state_dict)
                            ld.set_epoch(epoch)
                            counts["client restarted"] += 1
                            finished = False
                            break
                    if finished:
                        break
        except BaseException as exc:
            errors.append(f"job {job} rank {rank}: {type(exc).__name__}: {exc}")
        finally:
            ld.close()

    def chaos():
        while not done.wait(rng.uniform(args.min_gap, args.max_gap)):
            event = rng.choice(EVENTS)
            svc = state["svc"]
            try:
                if event == "kill_worker":
                    pids = svc.worker_pids()
                    if pids:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                elif event == "scale":
                    svc.scale(rng.randint(1, args.max_workers))
                elif event == "restart_client":
                    restart_flags[(rng.randrange(args.jobs), rng.randrange(args.world))] = True
                else:
                    svc.kill(signal.SIGKILL if event.endswith("kill") else signal.SIGTERM)
                    svc.stop()
                    state["svc"] = ServiceProcess(port, svc_args, env)
                counts[event] += 1
            except (OSError, RuntimeError, ValueError) as exc:  # e.g. a worker already gone
                counts[f"{event} (no effect: {type(exc).__name__})"] += 1

    threads = [threading.Thread(target=client, args=(j, r)) for j in range(args.jobs) for r in range(args.world)]
    chaos_thread = threading.Thread(target=chaos)
    t0 = time.monotonic()
    for t in threads:
        t.start()
    chaos_thread.start()
    try:
        for t in threads:
            t.join()
    finally:
        done.set()
        chaos_thread.join()
        state["svc"].stop()
    lost = doubled = 0
    for job in range(args.jobs):
        for epoch in range(args.epochs):
            want = expected(args.demo_size, args.world, job, epoch)
            have = collections.Counter(got[(job, epoch)])
            lost += sum((want - have).values())
            doubled += sum((have - want).values())
    return {"seconds": round(time.monotonic() - t0, 1), "events": dict(counts), "errors": errors,
            "samples_checked": sum(len(v) for v in got.values()), "lost": lost, "doubled": doubled,
            "config": vars(args)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-workers", type=int, default=4)
    p.add_argument("--demo-size", type=int, default=480)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-gap", type=float, default=0.3, help="seconds between chaos events, at least")
    p.add_argument("--max-gap", type=float, default=1.5)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()
    report = run(args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = report["lost"] == 0 and report["doubled"] == 0 and not report["errors"]
    print(f"samples checked {report['samples_checked']}, lost {report['lost']}, doubled {report['doubled']}: "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

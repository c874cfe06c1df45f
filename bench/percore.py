"""Images per core: the service on a core of its own (the disaggregated layout) and on cores it
shares with its client, each beside the naive single-process loop and the service's own decode
loop on the same cores (issue 28).

    python -m bench.percore [--photos ~/.cache/remote-loader/photos] [--groups imagenet,camera]
                            [--runs 3] [--split 0:1] [--batch-size 64] [--epochs imagenet:8,camera:2]
                            [--profile DIR]

Per photo group, in one run, contenders interleaved (median of ``--runs``):

* **dedicated** (``--split S:C``): every contender pinned to the service's CPUs ``S`` with
  ``os.sched_setaffinity`` (spawned processes inherit it): the naive loop
  (``bench.throughput.naive_sample``: simplejpeg full decode, slice, cv2 resize, flip) in one
  process per CPU of ``S``; the service's own decode loop (``process_sample`` in a loop, the same
  processes); the service with one decode process per CPU of ``S``, its client (a RemoteLoader
  counting batches) pinned to ``C``.
* **shared**: the same three on every CPU of ``S`` and ``C`` together, the service's client
  beside it (the naive row is the naive N-process limit, no transport).
* in both layouts, the service once more with its client **co-located** (issue 41:
  ``RemoteLoader(local=True)``, each batch copied out of the service's shared memory instead of
  received over loopback TCP); its targets: >= 0.9x the decode loop on a core of its own, >= 1.35x
  the naive N-process limit on shared cores, trainer CPU per image <= 10 us.
* and once more over TCP with **bulk lanes** (issue 41: ``--lane-port 0``, ``RemoteLoader(lanes=2)``:
  the batches' bytes on two plain TCP connections, received straight into the batch's buffer).

Each contender is given as images per second of wall time (per core) and as images per
CPU-second of its own processes (the decode processes; for the service also its dispatcher's
process, and the client's where it shares the service's CPUs): the second is what a core gives
when nothing else runs on it, and barely moves when other programs share the machine, which the
first does. For the service rows it also prints CPU per image of the decode processes, of the
dispatcher's process (dispatcher thread, ZeroMQ I/O thread, REST) and of the client (the
trainer), and the decode processes' busy share: their own time on samples (``stage_s`` read +
decode from ``/v1/status``) and the dispatcher's (from a task's assignment to its Done read,
``busy_s_total``; a task queued behind another counts), over wall time x processes.

``--profile DIR``: during the first run's dedicated service row, ``py-spy record`` samples the
decode process and the service's process (raw stacks with idle time, and flame graphs), writes
them to ``DIR`` and prints where the time goes: the top lines by samples, per process.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional

import psutil

from bench import throughput as B
from bench.harness import (command, cpu_seconds, log, machine, parse_split, print_verdicts, raise_on_sigterm, set_affinity,
                           start_service, table_head, table_row)
from client import RemoteLoader
from bench.photos import parse_epochs, photo_args, photo_group
from loader_service.decode.jpeg import decode_path

ROWS = [("naive", "naive loop (simplejpeg, slice, cv2 resize, flip)"), ("loop", "service decode loop (process_sample)"),
        ("service", "service + RemoteLoader (TCP)"),
        ("local", "service + RemoteLoader(local=True) (co-located, shared memory)"),
        ("lanes", "service + RemoteLoader(lanes=2) (TCP, bulk lanes)")]
LANES = 2  # the lanes row's bulk lanes


def pinned(cpus: Optional[set], fn, *args):
    """``fn(*args)`` with this process (and what it spawns) on ``cpus``; the affinity is restored after."""
    before = os.sched_getaffinity(0)
    set_affinity(cpus)
    try:
        return fn(*args)
    finally:
        set_affinity(before)


def service_row(settings: B.Settings, dataset_args: List[str], service_cpus: Optional[set],
                client_cpus: Optional[set], profile: Optional[str] = None, local: bool = False,
                lanes: int = 0) -> dict:
    """The service with ``settings.workers`` decode processes on ``service_cpus``, a RemoteLoader on
    ``client_cpus`` (``local``: co-located, reading the service's shared memory; ``lanes``: over
    TCP with that many bulk lanes): img/s, CPU per image per part, busy shares."""
    before = os.sched_getaffinity(0)
    try:
        set_affinity(service_cpus)  # the service and its decode processes inherit it
        svc = start_service([*dataset_args, "--workers", str(settings.workers),
                             *(["--lane-port", "0"] if lanes else [])])
    finally:
        set_affinity(client_cpus or before)
    spies: List[subprocess.Popen] = []
    try:
        with RemoteLoader(svc.endpoint, batch_size=settings.batch_size, image_size=settings.image_size,
                          seed=settings.seed, prefetch=max(4, 2 * settings.workers),
                          **({"local": True} if local else {}), **({"lanes": lanes} if lanes else {})) as loader:
            loader.set_epoch(0)
            for _ in loader:  # warm-up: workers started, first stream set up
                pass
            if lanes and not all(r.lanes is not None for r in loader._conns.replicas):
                raise RuntimeError("the lanes row's loader has no bulk lanes open")
            main = psutil.Process(svc.proc.pid)
            workers = [p for p in main.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
            me = psutil.Process()
            if profile:
                spies = _spy(profile, {"worker": workers[0].pid, "dispatcher": main.pid})
            st0 = svc.status()
            c_me, c_main, c_work = cpu_seconds([me]), cpu_seconds([main]), cpu_seconds(workers)
            c_io = io_thread_seconds(main.pid)
            t0 = time.perf_counter()
            samples = 0
            for epoch in settings.timed_epochs:
                loader.set_epoch(epoch)
                for images, _ in loader:
                    samples += images.shape[0]
            wall = time.perf_counter() - t0
            c_me, c_main, c_work = cpu_seconds([me]) - c_me, cpu_seconds([main]) - c_main, cpu_seconds(workers) - c_work
            c_io = io_thread_seconds(main.pid) - c_io
            st1 = svc.status()
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for spy in spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
        svc.stop()
        set_affinity(before)
    n, w = samples, settings.workers
    on_samples = sum(st1["stage_s"][k] - st0["stage_s"][k] for k in ("read", "decode_augment"))
    # on shared CPUs the client's CPU comes out of the same cores: counted (the naive limit has none)
    cpu = c_work + c_main + (c_me if client_cpus == service_cpus else 0.0)
    return {"img_s": n / wall, "img_cpu_s": per_cpu_second(n, cpu), "worker_us": 1e6 * c_work / n, "dispatcher_us": 1e6 * c_main / n, "io_us": 1e6 * c_io / n,
            "client_us": 1e6 * c_me / n, "busy_own": on_samples / (wall * w),
            "busy_dispatcher": (st1["workers"]["busy_s_total"] - st0["workers"]["busy_s_total"]) / (wall * w),
            "samples": n, "wall": wall}


def io_thread_seconds(pid: int) -> float:
    """CPU seconds of the ZeroMQ background threads (``ZMQbg/*``: the I/O threads, the reaper) of ``pid``."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if not f.read().startswith("ZMQbg"):
                    continue
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except OSError:  # a thread that ended
            continue
    return total


def _spy(directory: str, pids: Dict[str, int]) -> List[subprocess.Popen]:
    exe = shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    os.makedirs(directory, exist_ok=True)
    spies = []
    for name, pid in pids.items():
        for fmt, extra in (("raw", ["--idle"]), ("flamegraph", [])):
            out = os.path.join(directory, f"{name}.{'txt' if fmt == 'raw' else 'svg'}")
            spies.append(subprocess.Popen([exe, "record", "--nonblocking", "-r", "250", "-f", fmt, "-o", out,
                                           "--pid", str(pid), *extra],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy attaches before the timed epochs start
    return spies


THREADS = {"worker": "worker_main (", "dispatcher": "Dispatcher.run ("}  # the thread each profile is about


def where_time_goes(raw_path: str, root: str, limit: int = 16) -> List[tuple]:
    """From a py-spy raw file: (share of the samples of the thread running ``root``, function,
    leaf share) of its ``limit`` most sampled functions, counted inclusively (once per stack),
    below ``root``; the leaf share is the samples where the function itself was running."""
    inclusive: Dict[str, int] = collections.Counter()
    leaf: Dict[str, int] = collections.Counter()
    total = 0
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            at = next((i for i, fr in enumerate(frames) if fr.startswith(root)), None)
            if at is None:
                continue
            total += int(n)
            below = [fr.split(" (")[0] + " (" + fr.split(" (")[1].split(":")[0] + ")" for fr in frames[at + 1:]]
            for fn in set(below):
                inclusive[fn] += int(n)
            if below:
                leaf[below[-1]] += int(n)
    return [(c / total, fn, leaf[fn] / total) for fn, c in inclusive.most_common(limit)] if total else []


def per_cpu_second(images: int, cpu_s: float) -> float:
    """Images per CPU-second; NaN for a run too short for the CPU clock's ticks (10 ms)."""
    return images / cpu_s if cpu_s > 0 else math.nan


def raw_row(cpus: set, settings: B.Settings) -> dict:
    """A decode loop without transport (``settings.fn``) on ``cpus``: img/s, and images per CPU-second."""
    r = pinned(cpus, B.bench_raw, settings)
    return {"img_s": r.images_per_s, "img_cpu_s": per_cpu_second(r.samples, r.all_cpu_s)}


def run_group(settings: B.Settings, dataset_args: List[str], split, profile: Optional[str]) -> dict:
    service_cpus, client_cpus = split
    dedicated = replace(settings, workers=len(service_cpus))
    everything = service_cpus | client_cpus
    shared = replace(settings, workers=len(everything))
    return {
        "dedicated": {"naive": raw_row(service_cpus, replace(dedicated, fn="naive")),
                      "loop": raw_row(service_cpus, dedicated),
                      "service": service_row(dedicated, dataset_args, service_cpus, client_cpus, profile),
                      "local": service_row(dedicated, dataset_args, service_cpus, client_cpus, local=True),
                      "lanes": service_row(dedicated, dataset_args, service_cpus, client_cpus, lanes=LANES)},
        "shared": {"naive": raw_row(everything, replace(shared, fn="naive")), "loop": raw_row(everything, shared),
                   "service": service_row(shared, dataset_args, everything, everything),
                   "local": service_row(shared, dataset_args, everything, everything, local=True),
                   "lanes": service_row(shared, dataset_args, everything, everything, lanes=LANES)},
    }


def report(group: str, count: int, kib: float, layout: str, cpus: str, runs: List[dict]) -> dict:
    rs = [r[layout] for r in runs]
    med = {k: {m: statistics.median(r[k][m] for r in rs) for m in ("img_s", "img_cpu_s")} for k, _ in ROWS}
    parts = {row: {k: statistics.median(r[row][k] for r in rs) for k in rs[0][row]}
             for row in ("service", "local", "lanes")}
    ncpu = len(cpus.split(","))
    print(f"\n### {group} ({count} photos, {kib:.0f} KiB mean), {layout}: service on CPU {cpus}"
          + (", client on the others" if layout == "dedicated" else ", client beside it") + f"; median of {len(rs)}\n")
    print(table_head(["contender", "img/s per core (wall)", "runs", "vs naive", "vs decode loop",
                      "img per CPU-second", "runs", "vs naive", "vs decode loop"], "lrlrrrlrr"))
    for k, label in ROWS:
        cells = [label]
        for m, per in (("img_s", ncpu), ("img_cpu_s", 1)):
            cells += [f"{med[k][m] / per:.0f}", " / ".join(f"{r[k][m] / per:.0f}" for r in rs),
                      f"{med[k][m] / med['naive'][m]:.2f}x", f"{med[k][m] / med['loop'][m]:.2f}x"]
        print(table_row(cells))
    for row, what in (("service", "service (TCP)"), ("local", "service co-located"),
                      ("lanes", "service (TCP, bulk lanes)")):
        svc = parts[row]
        print(f"\n{what}, CPU per image: decode processes {svc['worker_us']:.0f} us, dispatcher's process "
              f"{svc['dispatcher_us']:.0f} us (of which ZeroMQ's I/O threads {svc['io_us']:.0f} us), client (trainer) "
              f"{svc['client_us']:.0f} us; decode processes busy {100 * svc['busy_own']:.1f}% on samples (their own "
              f"clock), {100 * svc['busy_dispatcher']:.1f}% holding a task (the dispatcher's)")
    base = {k: med[k][m] for k in ("naive", "loop") for m in ("img_s",)} | \
        {f"{k}_cpu": med[k]["img_cpu_s"] for k in ("naive", "loop")}
    return base | parts["service"] | {"local": base | parts["local"], "lanes": base | parts["lanes"]}


def main(argv=None) -> int:
    raise_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    photo_args(p, 64, "imagenet:8,camera:2")
    p.add_argument("--split", type=parse_split, default=parse_split("0:1"), metavar="SERVICE_CPUS:CLIENT_CPUS")
    p.add_argument("--profile", metavar="DIR", help="py-spy the first run's dedicated service row into DIR")
    args = p.parse_args(argv)
    epochs = parse_epochs(args.epochs)
    print(f"machine: {machine()} | decode path: {decode_path()} | command: `{command('bench.percore', argv)}`")
    verdicts = []
    for group in args.groups.split(","):
        with photo_group(args.photos, group, epochs, 1, args.batch_size) as (settings, nbytes, path):
            runs = []
            for r in range(args.runs):
                log(f"{group}: run {r + 1}/{args.runs} (load average {os.getloadavg()[0]:.2f})")
                prof = os.path.join(args.profile, group) if args.profile and r == 0 else None
                runs.append(run_group(settings, ["--data", path], args.split, prof))
                log("  " + "; ".join(f"{lay}: " + ", ".join(
                    f"{k} {v['img_s']:.0f} ({v['img_cpu_s']:.0f} per CPU-s)" for k, v in res.items())
                    for lay, res in runs[-1].items()))
        count = settings.length
        kib = nbytes / count / 1024
        s_cpus, c_cpus = args.split
        ded = report(group, count, kib, "dedicated", ",".join(map(str, sorted(s_cpus))), runs)
        sh = report(group, count, kib, "shared", ",".join(map(str, sorted(s_cpus | c_cpus))), runs)
        if args.profile:
            for part in ("worker", "dispatcher"):
                raw = os.path.join(args.profile, group, f"{part}.txt")
                if os.path.exists(raw):
                    print(f"\n{group}, {part}: where its thread's time goes (py-spy, idle included)\n")
                    print(table_head(["function (file)", "share, inclusive", "share, self"], "lrr"))
                    for share, fn, own in where_time_goes(raw, THREADS[part]):
                        print(table_row([fn.replace("|", "/"), f"{100 * share:.1f}%", f"{100 * own:.1f}%"]))
        camera = group.startswith("camera")
        prepared = group.endswith("-rst")
        target = (3.0 if prepared else 2.3) if camera else (1.35 if prepared else 1.3)
        def check(what: str, row: dict, ref: str, target: float) -> tuple:
            wall, cpu = row["img_s"] / row[ref], row["img_cpu_s"] / row[f"{ref}_cpu"]
            return what, wall >= target, f"{wall:.2f}x (per CPU-second {cpu:.2f}x)"

        verdicts += [
            check(f"{group} dedicated: service >= 0.9x its decode loop", ded, "loop", 0.9),
            check(f"{group} dedicated: service >= {target}x naive", ded, "naive", target),
            check(f"{group} shared: service + client >= 1.2x the naive {len(s_cpus | c_cpus)}-process limit", sh,
                  "naive", 1.2),
            # issue 41: the co-located mode
            check(f"{group} dedicated, co-located: service >= 0.9x its decode loop", ded["local"], "loop", 0.9),
            check(f"{group} shared, co-located: service + client >= 1.35x the naive {len(s_cpus | c_cpus)}-process "
                  "limit", sh["local"], "naive", 1.35),
            (f"{group} shared, co-located: trainer CPU per image <= 10 us", sh["local"]["client_us"] <= 10,
             f"{sh['local']['client_us']:.1f} us (over TCP {sh['client_us']:.1f} us, on bulk lanes "
             f"{sh['lanes']['client_us']:.1f} us)"),
        ]
    print_verdicts(verdicts)
    return 0


if __name__ == "__main__":
    sys.exit(main())

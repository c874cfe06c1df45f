"""What the benchmark scripts share: launching the service, timing epochs through a client,
CPU accounting, medians over runs, markdown tables, CPU pinning, the run's header facts.

Scripts run from the repository root (``python -m bench.<name>``), where ``tests`` is a package
too: the service process comes from :mod:`testkit.service`, the helper the tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import psutil

from testkit.service import ROOT, ServiceProcess  # noqa: F401  (ROOT: the checkout, for the scripts)

START_TIMEOUT_S = 180.0  # for decode processes and the service to come up


# --------------------------------------------------------------------------- the run's facts
def log(msg: str) -> None:
    """Progress goes to stderr; stdout carries the tables."""
    print(msg, file=sys.stderr, flush=True)


def machine() -> str:
    """CPUs, their model and the load average at the start: the header of every table."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = " (load average %.2f at start)" % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    return f"{os.cpu_count()} CPUs, {model or 'unknown model'}{load}"


def command(module: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command that reproduces this run, ``python -m <module> ARGS``; ``argv``: the arguments
    ``main`` was given (None: this process's own)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def raise_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C: a KeyboardInterrupt through every ``finally``, so the service
    and the decode processes are stopped. A forked child (a DataLoader worker) that inherited the
    handler just exits."""
    main_pid = os.getpid()

    def handler(signum, frame) -> None:
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


# --------------------------------------------------------------------------- CPU and pinning
def cpu_seconds(procs: List[psutil.Process]) -> float:
    """User + system CPU of these processes themselves (not of their reaped children). This
    process's own is the kernel's exact count (``time.process_time``); another's comes from
    /proc in clock ticks (10 ms), too coarse for the trainer's few ms per epoch (3,000 images
    at 10 us each are 3 ticks)."""
    total = 0.0
    for p in procs:
        if p.pid == os.getpid():
            total += time.process_time()
            continue
        t = p.cpu_times()
        total += t.user + t.system
    return total


def set_affinity(cpus: Optional[set]) -> None:
    """Pin every thread of this process to ``cpus``; threads and processes started later inherit it."""
    if cpus is None:
        return
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


def parse_split(text: str):
    """``SERVICE_CPUS:CLIENT_CPUS`` (``0:1``, ``0,1:2,3``) as two disjoint sets (an argparse type)."""
    service, _, client = text.partition(":")
    cpus = [{int(c) for c in part.split(",")} for part in (service, client)]
    if not all(cpus) or cpus[0] & cpus[1]:
        raise argparse.ArgumentTypeError("--split needs two disjoint CPU lists, like 0:1 or 0,1:2,3")
    return cpus


# --------------------------------------------------------------------------- the service
def start_service(args: List[str], env: Optional[Dict[str, Optional[str]]] = None) -> ServiceProcess:
    """``loader-service serve ARGS`` on free loopback ports, returned ready. LOADER_AUTOSCALE is
    unset (every contender keeps exactly the workers it is given); ``env`` goes on top. Its output
    is drained as it runs, and its leftovers are swept when it stops."""
    return ServiceProcess(0, args, env={"LOADER_AUTOSCALE": None, **(env or {})}, http_port=0, drain=True, sweep=True,
                          ready_timeout=START_TIMEOUT_S)


def warm_page_cache(source) -> int:
    """Read every sample once, so no contender pays for the first read from disk. Returns bytes."""
    return sum(len(source.read(i)) for i in range(len(source)))


# --------------------------------------------------------------------------- timing
def train_step(seconds: float) -> None:
    """The simulated training step: a sleep (a GPU step leaves the trainer's CPU idle; on a small
    machine a busy loop would take a core from the decoders)."""
    if seconds > 0:
        time.sleep(seconds)


@dataclass
class EpochsRun:
    """What :func:`run_epochs` measured over the timed epochs."""

    samples: int
    nbytes: int  # image bytes delivered
    seconds: float
    client_cpu_s: float  # this process
    service_cpu_s: float  # the service process and its workers
    service_processes: int
    stall_s: float  # the client's time waiting for data (RemoteLoader.stats()["wait_s"])


def run_epochs(loader, svc: ServiceProcess, epochs: Iterable[int], step_s: float = 0.0) -> EpochsRun:
    """Epoch 0 through ``loader`` untimed (the workers start, the first stream is set up), then
    ``epochs`` timed, a ``train_step(step_s)`` after every batch; the CPU of this process and of
    the service's processes is sampled before and after, while all of them are alive."""
    loader.set_epoch(0)
    for _ in loader:  # warm-up
        pass
    me, service_procs = psutil.Process(), svc.processes()
    cpu0, svc0, t0 = cpu_seconds([me]), cpu_seconds(service_procs), time.perf_counter()
    wait0 = loader.stats()["wait_s"]
    samples = nbytes = 0
    for epoch in epochs:
        loader.set_epoch(epoch)
        for images, _ in loader:
            samples += images.shape[0]
            nbytes += images.numel()
            train_step(step_s)
    t1 = time.perf_counter()
    cpu, svc_cpu = cpu_seconds([me]) - cpu0, cpu_seconds(service_procs) - svc0
    return EpochsRun(samples, nbytes, t1 - t0, cpu, svc_cpu, len(service_procs), loader.stats()["wait_s"] - wait0)


def forever(loader) -> Iterator:
    """Batches of epoch 0, 1, 2, ... without end (a benchmark that times a number of batches)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


# --------------------------------------------------------------------------- medians
def upper_median(values: Iterable[float]) -> float:
    """The median, the upper one for an even count (a value that was measured)."""
    values = sorted(values)
    return values[len(values) // 2]


def median_of(runs: Sequence[dict]) -> dict:
    """Each key's median over runs of the same keys."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# --------------------------------------------------------------------------- tables
def save_json(path: Optional[str], data) -> None:
    """Write ``data`` to ``path`` as indented JSON (``--json PATH``); nothing without a path."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def print_verdicts(verdicts: Iterable[tuple]) -> None:
    """``PASS``/``MISS`` lines of (target, met, detail) after a blank line (the exit status never
    depends on them)."""
    print()
    for target, ok, detail in verdicts:
        print(f"{'PASS' if ok else 'MISS'} {target}: {detail}")


def table_row(cells: Iterable) -> str:
    """One row of a markdown table: ``| a | b |``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_head(titles: Sequence[str], align: str) -> str:
    """The title row and the rule of a markdown table; ``align`` has a letter per column: ``l``
    (``---``) or ``r`` (right-aligned, ``---:``)."""
    if len(align) != len(titles):
        raise ValueError(f"{len(titles)} titles but alignment {align!r}")
    return table_row(titles) + "\n|" + "".join("---:|" if a == "r" else "---|" for a in align)

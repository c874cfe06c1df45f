"""A connection flood against one service: a real client's throughput and ``/healthz`` latency
while thousands of ZeroMQ connections each send a Hello, and the service's memory before,
during and after (issue 32). Prints a markdown table (figures in docs/benchmarks.md).

    python -m bench.flood --connections 10000 --procs 4

The flood runs in ``--procs`` processes (each raises its descriptor limit to the hard limit),
each holding ``connections / procs`` DEALER sockets that connect to the data port and send one
Hello for a small job, then sit; they end with SIGKILL, as crashed clients would. Phases:
``before`` (no flood), ``during`` (every flood connection open), ``after`` (the flood processes
killed, and the service's session count back to 0, or ``--settle`` seconds at most).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import signal
import statistics
import threading
import time
import urllib.request
import uuid
from typing import List, Optional

import psutil

from bench.harness import command, log, machine, raise_on_sigterm, table_head, table_row
from testkit.service import ServiceProcess

SERVICE_NOFILE = 20000  # the service's descriptor limit: 10,000 connections and room to spare


def _flood(endpoint: str, n: int, ready) -> None:
    """One flood process: ``n`` DEALER connections, one Hello each, held until killed."""
    import zmq

    from wire import protocol as P
    from wire.jobspec import JobSpec

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx = zmq.Context(1)
    ctx.setsockopt(zmq.LINGER, 0)
    ctx.set(zmq.MAX_SOCKETS, n + 64)
    socks = []
    for _ in range(n):
        try:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
            s.connect(endpoint)
            s.send_multipart(P.encode(P.Hello(stream=1, spec=JobSpec(batch_size=1, image_size=16), slots=1,
                                              client=uuid.uuid4().hex, batches=[0])), zmq.NOBLOCK)
            socks.append(s)
        except zmq.ZMQError as exc:  # out of descriptors: hold what was made
            log(f"flood process {os.getpid()}: {len(socks)} connections, then {exc}")
            break
    ready.put(len(socks))
    while True:  # until SIGKILL
        signal.pause()


def healthz_latencies(url: str, stop: threading.Event, out: List[float], failures: List[str]) -> None:
    """Ask ``/healthz`` every 50 ms until ``stop``; latencies in ms, failures by reason."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=10) as r:
                r.read()
            out.append((time.perf_counter() - t0) * 1000)
        except Exception as exc:  # a 503 (a stuck loop) or a timeout: counted, the run goes on
            failures.append(type(exc).__name__)
        stop.wait(0.05)


def client_run(endpoint: str, batches: int, first: List[float]) -> float:
    """A real client's images per second over ``batches`` batches of the demo set; the seconds
    to its first batch are appended to ``first``."""
    from client import RemoteLoader

    with RemoteLoader(endpoint, batch_size=32, image_size=64, epoch_lookahead=False, timeout=60) as ld:
        n, epoch, t0 = 0, 0, time.perf_counter()
        while n < batches:
            ld.set_epoch(epoch)
            for b in ld:
                if not n:
                    first.append(time.perf_counter() - t0)
                n += 1
                if n >= batches:
                    break
            epoch += 1
        return batches * 32 / (time.perf_counter() - t0)


def rss_mb(svc: ServiceProcess) -> float:
    return psutil.Process(svc.proc.pid).memory_info().rss / 2**20


MEMORY_KINDS = ("heap (brk)", "anonymous maps", "shared memory", "files")


def memory_by_kind(pid: int) -> List[str]:
    """The process's resident MB by kind of mapping (/proc/PID/smaps): the main arena's brk heap;
    anonymous maps (other threads' malloc arenas, Python's object arenas, large allocations);
    /dev/shm segments; files (code, libraries, page cache of mapped files)."""
    mb = dict.fromkeys(MEMORY_KINDS, 0.0)
    kind = "files"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                name = head[5].strip() if len(head) > 5 else ""
                kind = ("heap (brk)" if name == "[heap]" else "shared memory" if name.startswith("/dev/shm")
                        else "anonymous maps" if not name or name.startswith("[") else "files")
            elif head and head[0] == "Rss:":
                mb[kind] += int(head[1]) / 1024
    return [f"{mb[k]:.0f}" for k in MEMORY_KINDS]


def measure(svc: ServiceProcess, phase: str, batches: int) -> list:
    stop, lat, fails, first = threading.Event(), [], [], []
    t = threading.Thread(target=healthz_latencies, args=(svc.url, stop, lat, fails), daemon=True)
    t.start()
    try:
        rate = client_run(svc.endpoint, batches, first)
    except Exception as exc:  # the client's own failure is a result too
        rate, phase = 0.0, f"{phase} (client failed: {type(exc).__name__}: {str(exc)[:80]})"
    stop.set()
    t.join()
    log(f"{phase}: {len(lat)} /healthz answers, {len(fails)} failed")
    lat.sort()
    med = statistics.median(lat) if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")
    t0 = time.perf_counter()
    sessions = svc.status()["connections"]["sessions"] if not fails or lat else -1
    status_ms = (time.perf_counter() - t0) * 1000  # /v1/status with every session of the phase
    return [phase, f"{rate:.0f}", f"{first[0]:.1f}" if first else "-", f"{med:.1f}", f"{p99:.1f}", len(fails),
            f"{rss_mb(svc):.0f}", sessions, f"{status_ms:.0f}", svc.stderr_lines, *memory_by_kind(svc.proc.pid)]


def wait_sessions(svc: ServiceProcess, deadline_s: float) -> float:
    """Seconds until the service lists no client (or ``deadline_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            if not svc.status()["connections"]["sessions"]:
                break
        except Exception:
            pass
        time.sleep(0.25)
    return time.monotonic() - t0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=10000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--batches", type=int, default=200, help="the real client's batches per phase (32 images each)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--settle", type=float, default=60.0, help="after the flood, wait this long at most for 0 sessions")
    ap.add_argument("--service-args", default="", help="extra arguments for loader-service serve")
    args = ap.parse_args(argv)
    raise_on_sigterm()
    svc = ServiceProcess(0, ["--demo", "--workers", str(args.workers), *args.service_args.split()], http_port=0,
                         drain=True, sweep=True, ready_timeout=180, nofile=SERVICE_NOFILE,
                         env={"LOADER_AUTOSCALE": None}, log_level="info")  # the service's default: its log counted
    rows, procs = [], []
    ctx = mp.get_context("spawn")
    try:
        rows.append(measure(svc, "before", args.batches))
        ready = ctx.Queue()
        per = args.connections // args.procs
        for _ in range(args.procs):
            p = ctx.Process(target=_flood, args=(svc.endpoint, per, ready), daemon=True)
            p.start()
            procs.append(p)
        made = sum(ready.get(timeout=300) for _ in procs)
        log(f"{made} flood connections open, each sent a Hello")
        rows.append(measure(svc, f"during ({made} connections)", args.batches))
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join()
        settled = wait_sessions(svc, args.settle)
        rows.append(measure(svc, f"after (sessions settled in {settled:.1f}s)", args.batches))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        svc.stop()
    print(f"{machine()}; {command('bench.flood', argv)}\n")
    print(table_head(["phase", "client img/s", "first batch s", "/healthz median ms", "p99 ms", "/healthz failed",
                      "service RSS MB", "sessions", "/v1/status ms", "log lines"], "lrrrrrrrrr"))
    written = 0
    for r in rows:  # the service's log lines (at its default level, info) since the row before
        print(table_row([*r[:9], r[9] - written]))
        written = r[9]
    print("\nThe service's resident memory by kind of mapping, MB (/proc/PID/smaps):\n")
    print(table_head(["phase", *MEMORY_KINDS], "l" + "r" * len(MEMORY_KINDS)))
    for r in rows:
        print(table_row([r[0], *r[10:]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

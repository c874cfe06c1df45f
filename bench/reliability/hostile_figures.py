"""Figures for docs/reliability.md "Hostile input and connections": what a slowloris flood, a
scale storm and a rogue ZeroMQ peer cost. Prints a markdown table.

    python -m bench.reliability.hostile_figures
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time

os.environ.setdefault("LOADER_CACHE_DIR", tempfile.mkdtemp(prefix="loader-hostile-"))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.harness import table_head, table_row  # noqa: E402
from client import LoaderError, RemoteLoader  # noqa: E402
from testkit.service import ServiceProcess, free_port  # noqa: E402
from testkit.hostile import CLAIM, RoguePeer, half_open  # noqa: E402
from testkit.hostile import workers as _workers, zombies as _zombies  # noqa: E402

N = 240


def slowloris() -> list:
    sp = ServiceProcess(free_port(), ["--demo", "--demo-size", str(N), "--workers", "2", "--max-http-connections", "32",
                                      "--http-receipt", "2"], env=dict(LOADER_HEARTBEAT_S="0.5"), nofile=256)
    me, held, stop, most_fds = psutil.Process(sp.proc.pid), [], threading.Event(), [0]

    def flood():
        while not stop.is_set() and len(held) < 1000:
            try:
                held.append(half_open(sp.http_port, 5))
            except OSError:
                pass

    def watch():
        while not stop.is_set():
            most_fds[0] = max(most_fds[0], me.num_fds())
            time.sleep(0.01)

    fds0 = me.num_fds()
    threads = [threading.Thread(target=flood) for _ in range(4)] + [threading.Thread(target=watch)]
    for t in threads:
        t.start()
    while len(held) < 300:
        time.sleep(0.05)
    with RemoteLoader(sp.endpoint, batch_size=16, image_size=24, epoch_lookahead=False) as ld:
        got = sorted(i for b in ld for i in b.indices)
    flooded = len(held)
    stop.set()
    for t in threads:
        t.join()
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(f"{sp.url}/healthz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
    back = time.monotonic() - t0
    for s in held:
        s.close()
    sp.proc.terminate()
    _, log = sp.proc.communicate(timeout=60)
    sp.stop()
    return [("slowloris: half-open connections held by the flood", flooded),
            ("slowloris: service descriptors before / most during (limit 256, cap 32)", f"{fds0} / {most_fds[0]}"),
            ("slowloris: streamed epoch during the flood", "exact" if got == list(range(N)) else "WRONG"),
            ("slowloris: /healthz answers again after the flood stops (receipt deadline 2 s)", f"{back:.1f} s"),
            ("slowloris: service log lines for the whole run", log.count("\n"))]


def storm() -> list:
    sp = ServiceProcess(free_port(), ["--demo", "--demo-size", str(N), "--workers", "2"],
                        env=dict(LOADER_HEARTBEAT_S="0.5"))
    me = psutil.Process(sp.proc.pid)
    while sp.status()["workers"]["counts"] != {"idle": 2}:
        time.sleep(0.05)
    fds0 = me.num_fds()

    def put(seed):
        rng = random.Random(seed)
        for _ in range(10):
            httpx.put(f"{sp.url}/v1/workers", json={"count": rng.randint(1, 6)}, timeout=30,
                      headers={"Authorization": f"Bearer {sp.token}"})

    ts = [threading.Thread(target=put, args=(s,)) for s in range(10)]
    for t in ts:
        t.start()
    most = 0
    while any(t.is_alive() for t in ts):
        most = max(most, len(_workers(me)) - _zombies(me))
    sp.scale(2)
    t0 = time.monotonic()
    while not (sp.status()["workers"]["counts"] == {"idle": 2} and _zombies(me) == 0 and me.num_fds() <= fds0):
        time.sleep(0.05)
    settle = time.monotonic() - t0
    z, fds = _zombies(me), me.num_fds()
    sp.stop()
    return [("scale storm (100 PUTs, 1-6, 10 threads): most worker processes at once", most),
            ("scale storm: zombies / service fds after (before)", f"{z} / {fds} ({fds0})"),
            ("scale storm: back at 2 idle workers, no zombie, fds at baseline after the last PUT", f"{settle:.1f} s")]


def rogue() -> list:
    peer = RoguePeer()
    me = psutil.Process()
    rss0 = me.memory_info().rss
    ld = RemoteLoader(f"tcp://127.0.0.1:{peer.port}", batch_size=8, image_size=32, timeout=3.0)
    try:
        next(iter(ld))
    except LoaderError:  # the connection is given up once cut (a LoaderTimeout before that was certain)
        pass
    ld.close()
    grew = me.memory_info().rss - rss0
    peer.close()
    return [(f"rogue peer claiming a {CLAIM >> 20} MiB frame: bytes the client let in", f"{peer.sent / 2**20:.1f} MiB"),
            ("rogue peer: client RSS growth", f"{grew / 2**20:.1f} MiB")]


if __name__ == "__main__":
    rows = slowloris() + storm() + rogue()
    print(table_head(["measure", "result"], "lr"))
    for k, v in rows:
        print(table_row([k, v]))

"""What a flood of asks from a stream waiting for memory costs a live service (issue 37).

    python -m bench.door_flood --seconds 10

A holder opens a stream whose slots take most of the batch memory and goes quiet (its slots
lendable only after ``--reclaim-idle``, left at its default); a second client's stream waits
for them and floods Requests of 65,536 batch numbers (the protocol's most per message), saying
Hello again each time its stream is refused. Before the door, everything it sent piled up
(92 -> 3,063 MiB in 11 s). Prints the service's RSS before, at its peak during the flood and
after, what the flooding client was told, and how often its connection was cut for sending
past its allowance (``--client-allowance``; what it sent after a cut is dropped unread).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import psutil
import zmq

from bench.harness import command, machine, table_head, table_row
from testkit.helpers import dealer
from testkit.service import ServiceProcess
from wire import protocol as P
from wire.jobspec import JobSpec

BIG = JobSpec(batch_size=64, image_size=128)  # 3 MiB a slot


def _answer(s: zmq.Socket, timeout_ms: int = 30000) -> P.Message:
    if not s.poll(timeout_ms):
        raise RuntimeError("the service answered nothing")
    return P.decode(s.recv_multipart())[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.door_flood", description=__doc__)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--max-shm-mb", type=int, default=64, help="the holder takes 48 MiB of it")
    a = p.parse_args(argv)
    print(command("bench.door_flood", argv), machine(), sep="\n")
    svc = ServiceProcess(args=["--demo", "--max-shm-mb", str(a.max_shm_mb)], drain=True)
    proc = psutil.Process(svc.proc.pid)
    try:
        holder = dealer(svc.endpoint)
        holder.send_multipart(P.encode(P.Hello(stream=1, spec=BIG, slots=16, batches=[0])))
        assert isinstance(_answer(holder), P.Accept)
        time.sleep(2.0)  # its batch made and read: quiet
        before = proc.memory_info().rss
        flood = dealer(svc.endpoint)
        told: Counter = Counter()
        stream, sent, peak = 0, 0, before
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            stream += 1
            flood.send_multipart(P.encode(P.Hello(stream=stream, spec=BIG, slots=16,
                                                  window=P.MAX_WINDOW)))
            for k in range(4):
                flood.send_multipart(P.encode(P.Request(stream=stream, batches=list(range(k << 16, (k + 1) << 16)))))
                sent += 1
            while flood.poll(0):
                msg = P.decode(flood.recv_multipart())[0]
                told[f"{type(msg).__name__}:{getattr(msg, 'code', '')}"] += 1
            peak = max(peak, proc.memory_info().rss)
        time.sleep(2.0)
        while flood.poll(200):
            msg = P.decode(flood.recv_multipart())[0]
            told[f"{type(msg).__name__}:{getattr(msg, 'code', '')}"] += 1
        after = proc.memory_info().rss
        st = svc.status()
        print(table_head(["seconds", "Requests of 65,536 batches", "Hellos", "service RSS before MiB",
                          "peak during MiB", "after MiB", "the flooder was told", "healthy", "refused asks",
                          "cuts", "dropped unread"], "rrrrrrlllrr"))
        print(table_row([a.seconds, sent, stream, round(before / 2**20, 1), round(peak / 2**20, 1),
                         round(after / 2**20, 1), ", ".join(f"{k} x{v}" for k, v in sorted(told.items())),
                         st["healthy"], st["totals"]["refused_asks"], st["totals"].get("floods_cut", "-"),
                         st["totals"].get("flooded_messages", "-")]))
        holder.close(0)
        flood.close(0)
    finally:
        svc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

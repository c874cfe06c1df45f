"""What a client that asks for batches and does not read them costs a live service (stop 65).

    python -m bench.unread --seconds 30

Hand-made clients (``testkit.hostile.zmtp_dealer``, a 4 KiB receive buffer) say Hello for 32
batches of 16 images, again every second (each a new stream: what the old one had sent still
waits in libzmq), and send a ZMTP PING every 0.25 s so that they are never silent. One kind reads
nothing; the other reads 512 bytes with every PING (slower than it asks). Each runs against its
own service at the defaults (``--heartbeat 2``: a connection is cut once it has read nothing for
6 s), at 32 px (49 KB batches, copied into libzmq's queue) and 224 px (2.4 MB batches, sent
zero-copy from their slots). Prints, per run, when the connection was cut (or "-": still open at
the end), the service's RSS and batch memory at the start, at the peak and after, the cuts, and how many
of its new streams waited for it to read what its earlier ones were sent (``held_back``).
"""

from __future__ import annotations

import argparse
import time

import psutil

from bench.harness import command, machine, table_head, table_row
from testkit.hostile import PING, _frame, zmtp_dealer
from testkit.service import ServiceProcess
from wire import protocol as P
from wire.jobspec import JobSpec


def _run(image: int, reads: bool, seconds: float) -> list:
    svc = ServiceProcess(args=["--demo", "--demo-size", "512", "--workers", "2"], drain=True)
    try:
        proc = psutil.Process(svc.proc.pid)
        rss0, shm0 = proc.memory_info().rss, svc.status()["shm_bytes"]
        conn = zmtp_dealer(svc.data_port, rcvbuf=4096)
        spec = JobSpec(batch_size=16, image_size=image, shuffle=False)
        rss_peak, shm_peak, cut_at, stream = rss0, shm0, None, 0
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < seconds:
                stream += 1
                conn.sendall(_frame(P.encode(P.Hello(stream=stream, spec=spec, slots=8, batches=list(range(32))))[0]))
                for _ in range(4):
                    conn.sendall(PING)
                    if reads:
                        conn.recv(512)
                    time.sleep(0.25)  # the client's pace
                rss_peak = max(rss_peak, proc.memory_info().rss)
                shm_peak = max(shm_peak, svc.status()["shm_bytes"])
        except OSError:  # the service shut the connection down
            cut_at = time.monotonic() - t0
        finally:
            conn.close()
        time.sleep(2.0)  # the cut's disconnect and the slots' return
        st = svc.status()
        mib = 2 ** 20
        return [image, "slowly" if reads else "nothing", "-" if cut_at is None else round(cut_at, 1),
                f"{rss0 / mib:.1f} / {rss_peak / mib:.1f} / {proc.memory_info().rss / mib:.1f}",
                f"{shm0 / mib:.1f} / {shm_peak / mib:.1f} / {st['shm_bytes'] / mib:.1f}",
                st["totals"]["unread_cut"], st["totals"]["silent_cut"], st["totals"]["held_back"], st["healthy"]]
    finally:
        svc.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.unread", description=__doc__)
    p.add_argument("--seconds", type=float, default=30.0, help="how long each client runs if it is not cut")
    a = p.parse_args(argv)
    print(command("bench.unread", argv), machine(), sep="\n")
    print(table_head(["px", "reads", "cut after s", "service RSS start / peak / after MiB",
                      "batch memory start / peak / after MiB", "unread_cut", "silent_cut", "held_back", "healthy"],
                     "rlrllrrrl"))
    for image in (32, 224):
        for reads in (False, True):
            print(table_row(_run(image, reads, a.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

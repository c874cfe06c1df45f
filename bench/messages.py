"""What a co-located trainer sends per batch, and its CPU per image, on real photos (issue 41).

    python -m bench.messages [--photos ~/.cache/remote-loader/photos/imagenet] [--batch-sizes 64,16]
                             [--workers 2] [--prefetch 4] [--epochs 6]

The service (``--workers`` decode processes) and ``RemoteLoader(local=True)`` share this host's
cores, as in ``bench.percore``'s co-located rows; the trainer does nothing but take batches, so it
is faster than the service and waits for most of them (the regime where a batch let go of while
the trainer waits may or may not ride on the next Request). After one warm-up epoch, per batch
size: the messages the loader sent per batch by type (every ``Replica.send``), the batches handed
back inside a Request (``Request.released``) and in Releases of their own, per batch; the
trainer's CPU per image (this process, ZeroMQ's I/O thread included: ``time.process_time``); and
images per second. Make the photos first: ``python -m bench.photo_sets``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

from bench.harness import command, log, machine, start_service, table_head, table_row
from client import RemoteLoader
from client.replica import Replica
from wire import protocol as P

DEFAULT_PHOTOS = os.path.expanduser("~/.cache/remote-loader/photos/imagenet")


class Sent:
    """Counts what every Replica sends while it is entered (wraps ``Replica.send``)."""

    def __init__(self):
        self.kinds: collections.Counter = collections.Counter()
        self.rode = self.alone = 0
        self._real = Replica.send

    def __enter__(self) -> "Sent":
        real = self._real

        def send(replica, msg):
            self.kinds[type(msg).__name__] += 1
            if isinstance(msg, P.Request):
                self.rode += len(msg.released)
            elif isinstance(msg, P.Release):
                self.alone += len(msg.batches)
            return real(replica, msg)

        Replica.send = send
        return self

    def __exit__(self, *exc) -> None:
        Replica.send = self._real

    def reset(self) -> None:
        self.kinds.clear()
        self.rode = self.alone = 0


def measure(endpoint: str, batch_size: int, prefetch: int, epochs: int) -> dict:
    with Sent() as sent, RemoteLoader(endpoint, batch_size=batch_size, image_size=224, seed=0, prefetch=prefetch,
                                      local=True) as loader:
        loader.set_epoch(0)
        for _ in loader:  # warm-up: mappings, page cache, the service's reserves
            pass
        sent.reset()
        batches = images = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        for epoch in range(1, epochs + 1):
            loader.set_epoch(epoch)
            for batch in loader:
                batches += 1
                images += len(batch)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"batch_size": batch_size, "batches": batches, "requests": sent.kinds["Request"] / batches,
            "releases": sent.kinds["Release"] / batches, "rode": sent.rode / batches, "alone": sent.alone / batches,
            "trainer_us": 1e6 * cpu / images, "img_s": images / wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--photos", default=DEFAULT_PHOTOS, help="a folder of JPEGs (python -m bench.photo_sets)")
    p.add_argument("--batch-sizes", default="64,16")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=6)
    a = p.parse_args(argv)
    if not os.path.isdir(a.photos):
        print(f"no photos at {a.photos}: run python -m bench.photo_sets first", file=sys.stderr)
        return 2
    log(f"{command('bench.messages', argv)}\n{machine()}")
    svc = start_service(["--data", a.photos, "--workers", str(a.workers)])
    try:
        rows = [measure(svc.endpoint, int(bs), a.prefetch, a.epochs) for bs in a.batch_sizes.split(",")]
    finally:
        svc.stop()
    print(table_head(["batch size", "batches", "Requests / batch", "Releases / batch",
                      "handed back in a Request / batch", "in a Release / batch", "trainer CPU / image",
                      "img/s"], "rrrrrrrr"))
    for r in rows:
        print(table_row([r["batch_size"], r["batches"], f"{r['requests']:.2f}", f"{r['releases']:.2f}",
                         f"{r['rode']:.2f}", f"{r['alone']:.2f}", f"{r['trainer_us']:.1f} us", f"{r['img_s']:.0f}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

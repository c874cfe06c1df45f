"""A demo consumer: stream epochs from a service and print throughput as it goes.

``python -m client.demo --endpoint tcp://HOST:5555`` (the compose file's trainer runs this).
"""

from __future__ import annotations

import argparse
import sys
import time

from .loader import RemoteLoader


def consume(endpoint: str, epochs: int = 2, batch_size: int = 64, image_size: int = 224, out=sys.stdout,
            **options) -> dict:
    """Iterate ``epochs`` epochs; print a progress line and a summary per epoch. Returns totals."""
    tty = out.isatty()
    totals = {"epochs": 0, "samples": 0, "seconds": 0.0}
    with RemoteLoader(endpoint, batch_size=batch_size, image_size=image_size, **options) as loader:
        n = len(loader)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            samples, t0 = 0, time.perf_counter()
            for i, (images, labels) in enumerate(loader):
                samples += images.shape[0]
                dt = time.perf_counter() - t0
                if tty or i + 1 == n or (i + 1) % max(1, n // 4) == 0:
                    line = (f"epoch {epoch} [{i + 1:>4}/{n}] {samples / dt if dt else 0:8.1f} img/s  "
                            f"{samples * image_size * image_size * 3 / dt / 2**20 if dt else 0:7.1f} MiB/s  "
                            f"stall {loader.stats()['wait_s']:.2f}s")
                    print(("\r" + line) if tty else line, end="" if tty and i + 1 < n else "\n", file=out, flush=True)
            dt = time.perf_counter() - t0
            totals["epochs"] += 1
            totals["samples"] += samples
            totals["seconds"] += dt
            print(f"epoch {epoch}: {samples} images in {dt:.2f}s = {samples / dt:.1f} img/s", file=out, flush=True)
    print(f"done: {totals['samples']} images in {totals['seconds']:.2f}s = "
          f"{totals['samples'] / max(totals['seconds'], 1e-9):.1f} img/s", file=out, flush=True)
    return totals


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m client.demo", description=__doc__)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--timeout", type=float, default=120.0)
    a = p.parse_args()
    consume(a.endpoint, a.epochs, a.batch_size, a.image_size, timeout=a.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

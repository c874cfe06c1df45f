"""A demo consumer: stream epochs from a service and print throughput as it goes.

``python -m client.demo --endpoint tcp://HOST:5555`` (the compose file's trainer runs this).
"""

from __future__ import annotations

import argparse
import os
import sys

from wire.progress import EpochProgress

from client.loader import RemoteLoader


def consume(endpoint: str, epochs: int = 2, batch_size: int = 64, image_size: int = 224, out=sys.stdout,
            **options) -> dict:
    """Iterate ``epochs`` epochs with a progress bar (a line per quarter when not on a terminal)
    and a summary per epoch. Returns totals."""
    totals = {"epochs": 0, "samples": 0, "seconds": 0.0}
    with RemoteLoader(endpoint, batch_size=batch_size, image_size=image_size, **options) as loader:
        n = len(loader)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            progress = EpochProgress(epoch, n, image_size, out)
            for images, labels in loader:
                progress.update(images.shape[0], loader.stats()["wait_s"])
            totals["epochs"] += 1
            totals["seconds"] += progress.close()
            totals["samples"] += progress.samples
        if options.get("local"):
            print(_colocated_line(loader.stats()), file=out, flush=True)
    print(f"done: {totals['samples']} images in {totals['seconds']:.2f}s = "
          f"{totals['samples'] / max(totals['seconds'], 1e-9):.1f} img/s", file=out, flush=True)
    return totals


def _colocated_line(stats: dict) -> str:
    """What ``--local`` did: every batch from the service's shared memory, or why not."""
    local, batches = stats["local_batches"], stats["batches"]
    if batches and local >= batches:
        return f"co-located: all {batches} batches read from the service's shared memory"
    return (f"co-located: {local} of {batches} batches read from the service's shared memory, the rest over the "
            "socket: this container or host does not share the service's /dev/shm (docs/deployment.md, "
            "\"Service and trainer on one host\")")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.demo", description=__doc__)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--local", action="store_true", default=_env_flag("TRAINER_LOCAL"),
                   help="co-located: read batches from the service's shared memory when it is reachable (same "
                   "host or a shared /dev/shm), else over the socket; says which at the end (default: "
                   "TRAINER_LOCAL=1 in the environment, as docker-compose.colocated.yml sets)")
    p.add_argument("--lanes", type=int, default=0, metavar="N", help="receive batch bytes on N bulk lanes per "
                   "replica where the service offers them (loader-service serve --lane-port P); 0: data frames only")
    return p


def main() -> int:
    a = build_parser().parse_args()
    consume(a.endpoint, a.epochs, a.batch_size, a.image_size, timeout=a.timeout, local=a.local, lanes=a.lanes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A consumer without torch: stream epochs from a service as numpy arrays, with a progress bar.

``loader-service demo`` uses it, so the demo runs in the torch-free service image; also
``python -m loader_service.cli.consumer --endpoint tcp://HOST:5555``. It speaks the protocol of
:mod:`wire.protocol` with one DEALER socket and one stream per epoch, and has none of the
client library's recovery (reconnect, replicas, resume): an error ends it loudly. Trainers use
``client.RemoteLoader``.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Iterator, Optional, TextIO, Tuple

import numpy as np
import zmq

from wire import protocol as P
from wire.jobspec import JobSpec
from wire.progress import EpochProgress


class ConsumerError(RuntimeError):
    pass


class Consumer:
    """``for images, labels, indices in Consumer(endpoint, 64).epoch(0)``: uint8 (n, h, w, 3), int64 (n,)
    and the samples' dataset indices."""

    def __init__(self, endpoint: str, batch_size: int, image_size: int = 224, *, seed: int = 0, prefetch: int = 4,
                 timeout: float = 60.0, job: str = "demo", dataset: Optional[str] = None):
        self.endpoint, self.batch_size, self.image_size = endpoint, batch_size, image_size
        self.seed, self.prefetch, self.timeout, self.job, self.dataset = seed, prefetch, timeout, job, dataset
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.stream = 0
        self.num_batches = 0  # of the epoch being read, once accepted
        self.wait_s = 0.0  # seconds spent waiting for a batch, this epoch (sent with credits: the stall)

    def _recv(self) -> Tuple[P.Message, list]:
        if not self.sock.poll(int(self.timeout * 1000)):
            raise ConsumerError(f"no message from {self.endpoint} in {self.timeout:.0f}s (is the service up?)")
        msg, data = P.decode(self.sock.recv_multipart(copy=False))
        if isinstance(msg, P.Error):
            raise ConsumerError(f"{msg.code}: {msg.message}" + (f"\n{msg.traceback}" if msg.traceback else ""))
        return msg, data

    def epoch(self, epoch: int) -> Iterator[Tuple[np.ndarray, np.ndarray, list]]:
        """The batches of one epoch, in the order they arrive."""
        self.stream += 1
        self.wait_s, consumed = 0.0, 0
        spec = JobSpec(batch_size=self.batch_size, image_size=self.image_size, seed=self.seed, dataset=self.dataset)
        self.sock.send_multipart(P.encode(P.Hello(stream=self.stream, spec=spec, epoch=epoch, slots=self.prefetch,
                                                  job=self.job, window=self.prefetch)))
        asked = 0  # batches asked for: the first ``prefetch`` once the epoch's length is known, then one per batch
        reported = 0.0  # of ``wait_s``, what the service was told already (the protocol sends deltas)

        def ask(n: int) -> None:
            nonlocal asked, reported
            more = list(range(asked, min(asked + n, self.num_batches)))
            asked += len(more)
            self.sock.send_multipart(P.encode(P.Request(stream=self.stream, batches=more, wait_s=self.wait_s - reported,
                                                        consumed=consumed, final=asked == self.num_batches)))
            reported = self.wait_s

        while True:
            t0 = time.perf_counter()
            msg, data = self._recv()
            self.wait_s += time.perf_counter() - t0
            if getattr(msg, "stream", self.stream) != self.stream:
                continue  # left over from an earlier stream
            if isinstance(msg, P.Accept):
                self.num_batches = msg.num_batches
                ask(self.prefetch)
            elif isinstance(msg, P.Batch):
                images = np.frombuffer(data[0].buffer, np.uint8).reshape(msg.shape)
                labels = np.frombuffer(data[1].buffer, np.int64)
                consumed += 1
                yield images, labels, msg.indices
                if asked < self.num_batches:
                    ask(1)
            elif isinstance(msg, P.EndOfEpoch):
                if consumed != msg.num_batches:
                    raise ConsumerError(f"epoch {epoch} ended after {consumed} of {msg.num_batches} batches")
                return

    def close(self) -> None:
        try:
            self.sock.send_multipart(P.encode(P.Bye()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.sock.close(linger=100)  # long enough to hand Bye to the kernel, never a hang

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def consume(endpoint: str, epochs: int = 2, batch_size: int = 64, image_size: int = 224, out: TextIO = sys.stdout,
            **options) -> dict:
    """Stream ``epochs`` epochs with a progress bar and a summary per epoch. Returns totals."""
    totals = {"epochs": 0, "samples": 0, "seconds": 0.0}
    with Consumer(endpoint, batch_size, image_size, **options) as c:
        for epoch in range(epochs):
            progress = None
            for images, _, _ in c.epoch(epoch):
                if progress is None:
                    progress = EpochProgress(epoch, c.num_batches, image_size, out)
                progress.update(images.shape[0], c.wait_s)
            seconds = progress.close() if progress is not None else 0.0
            totals["epochs"] += 1
            totals["samples"] += progress.samples if progress is not None else 0
            totals["seconds"] += seconds
    print(f"done: {totals['samples']} images in {totals['seconds']:.2f}s = "
          f"{totals['samples'] / max(totals['seconds'], 1e-9):.1f} img/s", file=out, flush=True)
    return totals


def run(endpoint: str, epochs: int, batch_size: int, image_size: int, name: str = "consumer", **options) -> int:
    """:func:`consume` as a command: exit code 1 and the reason on stderr when the stream fails."""
    try:
        consume(endpoint, epochs, batch_size, image_size, **options)
    except ConsumerError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loader_service.cli.consumer", description=__doc__)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without a message before giving up")
    a = p.parse_args(argv)
    return run(a.endpoint, a.epochs, a.batch_size, a.image_size, timeout=a.timeout)


if __name__ == "__main__":
    sys.exit(main())

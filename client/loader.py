"""RemoteLoader: a drop-in for a DataLoader loop that streams batches from the service.

::

    loader = RemoteLoader("tcp://cpu-node:5555", batch_size=256, rank=rank, world_size=world)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            ...

The loader's cursor (epoch, next batch) is the only progress there is: ``state_dict()``
returns it, ``load_state_dict()`` on a fresh loader continues exactly after it, and after a
service restart the loader starts its stream again from it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import zmq

from loader_service import protocol as P
from loader_service.plan import num_batches

from .batch import Batch
from .config import LoaderConfig
from .errors import LoaderError, LoaderTimeout
from .sinks import make_sink

STATE_VERSION = 1
_RECONNECTED = object()  # _recv's answer when the connection came back (maybe to a new service)
_RECOVERABLE = (P.ErrorCode.UNKNOWN_CLIENT, P.ErrorCode.SHUTTING_DOWN)
_PLAN_KEYS = ("seed", "world_size", "rank", "batch_size", "shuffle", "drop_last", "dataset")


@dataclass
class LoaderStats:
    batches: int = 0
    samples: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # time the trainer spent blocked in next() waiting for data
    h2d_s: float = 0.0  # time spent issuing/waiting for host-to-device copies
    restarts: int = 0  # streams started again after the service forgot this client


class RemoteLoader:
    """Iterate batches served by a loader service. See :class:`client.config.LoaderConfig`
    for every option; the common ones are keyword arguments here."""

    def __init__(self, endpoint: str, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, image_size: int = 224,
                 train: bool = True, prefetch: int = 4, device: str = "cpu", **options):
        self.config = LoaderConfig(endpoint=endpoint, batch_size=batch_size, rank=rank, world_size=world_size,
                                   seed=seed, shuffle=shuffle, drop_last=drop_last, image_size=image_size,
                                   train=train, prefetch=prefetch, device=str(device), **options)
        self._sink = make_sink(self.config)
        self._ctx: Optional[zmq.Context] = None
        self._sock: Optional[zmq.Socket] = None
        self._monitor: Optional[zmq.Socket] = None
        self._connects = 0
        self._lost_at: Optional[float] = None  # when the connection dropped, while it is down
        self._stream = 0
        self._epoch = 0
        self._next_batch = 0
        self._dataset_length: Optional[int] = None
        self._stats = LoaderStats()
        self._closed = False

    # ------------------------------------------------------------------ DataLoader-like API
    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        if self._dataset_length is None:
            self._describe()
        assert self._dataset_length is not None
        c = self.config
        return num_batches(self._dataset_length, c.batch_size, c.world_size, c.drop_last) * c.echo

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration serves (as with DistributedSampler).

        Setting the epoch the cursor is already in keeps its position, so a loader restored
        from a mid-epoch ``state_dict`` resumes where it was.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._next_batch = epoch, 0

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise RuntimeError("this RemoteLoader is closed")
        if self._dataset_length is not None and self._next_batch >= self._raw_len():
            self._epoch, self._next_batch = self._epoch + 1, 0  # like a DataLoader: next epoch
        return self._iterate(self._epoch, self._next_batch)

    def state_dict(self) -> dict:
        """The cursor: where the next iteration starts. Small, JSON-friendly."""
        c = self.config
        state = {"version": STATE_VERSION, "epoch": self._epoch, "next_batch": self._next_batch}
        state.update({k: getattr(c, k) for k in _PLAN_KEYS})
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the plan-defining settings must match this loader's."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported loader state version {state.get('version')!r}")
        mismatched = {k: (state.get(k), getattr(self.config, k)) for k in _PLAN_KEYS
                      if state.get(k) != getattr(self.config, k)}
        if mismatched:
            detail = ", ".join(f"{k}: saved {a!r} vs loader {b!r}" for k, (a, b) in mismatched.items())
            raise ValueError(f"loader state does not match this loader's plan ({detail})")
        self._epoch, self._next_batch = int(state["epoch"]), int(state["next_batch"])

    def stats(self) -> dict:
        """Counters since creation: batches, samples, bytes, wait_s (stall), h2d_s, restarts."""
        return asdict(self._stats)

    def close(self) -> None:
        """Tell the service we are leaving and release the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            try:
                self._sock.send_multipart(P.encode(P.Bye()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(linger=100)  # long enough to hand Bye to the kernel, never a hang
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._sink.close()

    def __enter__(self) -> "RemoteLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ streaming
    def _raw_len(self) -> int:
        c = self.config
        assert self._dataset_length is not None
        return num_batches(self._dataset_length, c.batch_size, c.world_size, c.drop_last)

    def _iterate(self, epoch: int, start: int) -> Iterator[Batch]:
        c = self.config
        stream, total = self._start(epoch, start)
        requested = min(total, start + c.prefetch)
        expect = start
        self._sink.begin(total - start)
        try:
            while expect < total:
                t0 = time.perf_counter()
                msg, payload = self._recv(stream)
                if isinstance(msg, P.Batch):
                    if msg.index != expect:
                        raise LoaderError(P.ErrorCode.INTERNAL, f"expected batch {expect}, got {msg.index}")
                    self._sink.push(msg, payload)
                    expect += 1
                    if requested < total:  # keep `prefetch` batches asked for ahead of the trainer
                        self._credit(stream, 1)
                        requested += 1
                elif isinstance(msg, P.Error) and msg.code == P.ErrorCode.SHUTTING_DOWN:
                    continue  # informational: the reconnect that follows restarts the stream
                elif msg is _RECONNECTED or isinstance(msg, P.Error):
                    # reconnected (perhaps to a restarted service), or the service forgot us:
                    # start the stream again from what we hold; nothing is lost or repeated
                    self._stats.restarts += 1
                    resume_at = expect
                    stream, total = self._start(epoch, resume_at)
                    requested = min(total, resume_at + c.prefetch)
                    continue
                self._stats.wait_s += time.perf_counter() - t0
                self._stats.h2d_s = getattr(self._sink, "h2d_s", 0.0)
                for batch in self._sink.ready(final=expect == total):
                    self._stats.batches += 1
                    self._stats.samples += len(batch)
                    self._next_batch = batch.index + 1
                    for _ in range(c.echo):
                        yield batch
        finally:
            self._sink.end()

    def _start(self, epoch: int, start: int):
        """Send Hello for a new stream; return (stream id, batches in the epoch)."""
        c = self.config
        self._stream += 1
        stream = self._stream
        hello = P.Hello(stream=stream, batch_size=c.batch_size, image_size=c.image_size, seed=c.seed,
                        epoch=epoch, rank=c.rank, world_size=c.world_size, shuffle=c.shuffle,
                        drop_last=c.drop_last, train=c.train, start_batch=start, prefetch=c.prefetch,
                        dataset=c.dataset, scale=list(c.scale), ratio=list(c.ratio), job=c.job)
        self._socket().send_multipart(P.encode(hello))
        while True:
            msg, _ = self._recv(stream)
            if isinstance(msg, P.Accept):
                self._dataset_length = msg.dataset_length
                return stream, msg.num_batches
            if msg is _RECONNECTED:
                return self._start(epoch, start)  # say hello to whoever is there now
            # shutting_down (now, or a stale goodbye from a previous service): the connection
            # events decide what happens next, so keep waiting

    def _credit(self, stream: int, n: int) -> None:
        s = self._stats
        msg = P.Credit(stream=stream, n=n, wait_s=s.wait_s, h2d_s=s.h2d_s, consumed=s.batches)
        self._socket().send_multipart(P.encode(msg))

    def _recv(self, stream: int):
        """Next message of ``stream`` (stale ones are dropped), or ``_RECONNECTED``.

        Raises LoaderError for the service's errors (except the recoverable ones the caller
        handles: unknown_client, shutting_down) and LoaderTimeout after ``timeout`` seconds
        without a message, or without a connection.
        """
        sock = self._socket()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll(self.config.timeout * 1000))
            if not events:
                self._raise_timeout()
            if self._monitor in events:
                if self._on_monitor():
                    return _RECONNECTED, None
                continue
            header = sock.recv(copy=False)
            try:
                msg = P.decode_header(header)
            except P.ProtocolError as exc:
                self._drain(sock)
                raise LoaderError(exc.code, f"malformed message from the service: {exc}") from None
            if getattr(msg, "stream", stream) not in (stream, -1):
                self._drain(sock)  # from a stream we already left
                continue
            payload = None
            if isinstance(msg, P.Batch):
                payload = self._sink.receive(sock, msg)
                self._stats.bytes += msg.image_bytes
            else:
                self._drain(sock)
            if isinstance(msg, P.Error) and msg.code not in _RECOVERABLE:
                raise LoaderError(msg.code, msg.message, msg.traceback)
            return msg, payload

    def _on_monitor(self) -> bool:
        """Handle a connection event; True when a connection came back after a loss."""
        from zmq.utils.monitor import recv_monitor_message

        ev = recv_monitor_message(self._monitor)["event"]
        if ev == zmq.EVENT_DISCONNECTED:
            self._lost_at = time.monotonic()
        elif ev == zmq.EVENT_CONNECTED:
            self._connects += 1
            back = self._lost_at is not None or self._connects > 1
            self._lost_at = None
            return back
        return False

    def _raise_timeout(self) -> None:
        c = self.config
        if self._lost_at is not None:
            raise LoaderTimeout(f"lost the connection to the loader service at {c.endpoint} "
                                f"{time.monotonic() - self._lost_at:.0f}s ago and it has not come back "
                                f"within {c.timeout:g}s")
        raise LoaderTimeout(f"no message from the loader service at {c.endpoint} for {c.timeout:g}s; is it running "
                            "and reachable? (start one with: loader-service serve --demo)")

    @staticmethod
    def _drain(sock: zmq.Socket) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)

    def _describe(self) -> None:
        sock = self._socket()
        sock.send_multipart(P.encode(P.Describe(dataset=self.config.dataset)))
        while True:
            msg, _ = self._recv(-1)
            if isinstance(msg, P.DatasetInfo):
                self._dataset_length = msg.length
                return
            if msg is _RECONNECTED:
                sock.send_multipart(P.encode(P.Describe(dataset=self.config.dataset)))

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            if self._closed:
                raise RuntimeError("this RemoteLoader is closed")
            self._ctx = zmq.Context(1)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # the credits bound what can queue here
            sock.setsockopt(zmq.RECONNECT_IVL, 100)  # reconnect with exponential backoff ...
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)  # ... up to 2 s between tries
            self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(self.config.endpoint)
            self._sock = sock
        return self._sock


__all__ = ["RemoteLoader", "LoaderStats"]

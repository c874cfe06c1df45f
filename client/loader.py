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

import logging
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Union

import zmq

from loader_service import protocol as P
from loader_service.plan import num_batches

from .batch import Batch
from .config import LoaderConfig
from .errors import LoaderError, LoaderTimeout
from .replica import Replica
from .sinks import make_sink

log = logging.getLogger("client")

STATE_VERSION = 1
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

    def __init__(self, endpoint: Union[str, Sequence[str]], batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 image_size: int = 224, train: bool = True, prefetch: int = 4, device: str = "cpu", **options):
        """``endpoint``: one ``tcp://host:port``, or a list of service replicas to spread this
        rank's batches over (see :func:`client.resolve_endpoints` for a DNS name)."""
        endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not endpoints:
            raise ValueError("endpoint: give at least one tcp://host:port")
        self.endpoints = endpoints
        self.config = LoaderConfig(endpoint=endpoints[0], batch_size=batch_size, rank=rank, world_size=world_size,
                                   seed=seed, shuffle=shuffle, drop_last=drop_last, image_size=image_size,
                                   train=train, prefetch=prefetch, device=str(device), **options)
        for e in endpoints[1:]:
            LoaderConfig(endpoint=e, batch_size=batch_size)  # validates the address
        self._sink = make_sink(self.config)
        self._ctx: Optional[zmq.Context] = None
        self._replicas: List[Replica] = []
        self._spare: List[Replica] = []  # a second connection per replica, for epoch lookahead
        self._lookahead: Optional[int] = None  # the epoch already streaming on the spare set
        self._stream = 0
        self._epoch = 0
        self._next_batch = 0
        self._epoch_set = False  # set_epoch since the last iteration: no auto-advance (see __iter__)
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
        from a ``state_dict`` resumes where it was: mid-epoch, the rest of it; at the end of an
        epoch, nothing (the usual ``for epoch in range(saved_epoch, epochs): set_epoch(epoch)``
        loop then goes on with the next epoch, as it should).
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._next_batch = epoch, 0
        self._epoch_set = True

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch. Iterating again without :meth:`set_epoch` once an
        epoch is done starts the next one, like a DataLoader."""
        if self._closed:
            raise RuntimeError("this RemoteLoader is closed")
        if self._dataset_length is None:
            self._describe()
        if not self._epoch_set and self._next_batch >= self._raw_len():
            self._epoch, self._next_batch = self._epoch + 1, 0
        self._epoch_set = False
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
        """Tell the services we are leaving and release the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for r in self._replicas + self._spare:
            r.close()
        self._replicas, self._spare = [], []
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
        """One epoch from batch ``start``: split over the replicas, yielded in plan order."""
        c = self.config
        if self._dataset_length is None:
            self._describe()
        total = self._raw_len()
        reps = self._connect()
        if self._lookahead == epoch and start == 0:
            # this epoch has been streaming on the spare connections since the last one ended
            reps = self._spare
            self._replicas, self._spare = self._spare, self._replicas
            for r in reps:
                r.promote = True
        else:
            self._deal(reps, epoch, start, total)
        self._lookahead = None
        lookahead_sent = not c.epoch_lookahead
        pending: Dict[int, Batch] = {}  # received, waiting for their turn
        limit = c.prefetch * len(reps) + c.device_prefetch  # bound on received-but-not-yielded
        next_yield, received, need = start, 0, total - start
        last_message = time.monotonic()
        poller = zmq.Poller()
        for r in reps:
            poller.register(r.sock, zmq.POLLIN)
            poller.register(r.monitor, zmq.POLLIN)
        self._sink.begin(need)
        try:
            while next_yield < total:
                t0 = time.perf_counter()
                while next_yield not in pending:
                    events = dict(poller.poll(self._poll_ms(reps)))
                    now = time.monotonic()
                    if not events:
                        if now - last_message > c.timeout:
                            self._raise_timeout(reps)
                        self._fail_over_dead(reps, epoch, now)
                        continue
                    for r in reps:
                        if r.monitor in events and r.on_monitor() and not r.dead:
                            self._restart(r, epoch)  # back, maybe to a restarted service
                        if r.sock not in events:
                            continue
                        for _ in range(64):  # bounded per round, so one replica cannot starve the rest
                            if not r.sock.poll(0):
                                break
                            msg, payload = self._recv(r)
                            if msg is None:
                                continue
                            last_message = now
                            if isinstance(msg, P.Accept):
                                if msg.num_batches != total:
                                    raise LoaderError(P.ErrorCode.BAD_JOB, (
                                        f"{r.endpoint} has {msg.num_batches} batches in this epoch, expected {total}: "
                                        "do all replicas serve the same dataset?"))
                            elif isinstance(msg, P.Batch):
                                if not r.received(msg.index):
                                    raise LoaderError(P.ErrorCode.INTERNAL, f"unexpected batch {msg.index} from {r.endpoint}")
                                self._sink.push(msg, payload)
                                received += 1
                                self._credit(r, owed=len(pending) >= limit)
                                if not lookahead_sent and all(x.dead or x.asked >= len(x.todo) for x in reps):
                                    # everything of this epoch is asked for: let the next one start
                                    lookahead_sent = True
                                    self._start_lookahead(epoch + 1, total)
                                for b in self._sink.ready(final=received == need):
                                    pending[b.index] = b
                            elif isinstance(msg, P.Error) and msg.code == P.ErrorCode.UNKNOWN_CLIENT:
                                self._restart(r, epoch)  # the service forgot us: ask again from what we miss
                self._stats.wait_s += time.perf_counter() - t0
                self._stats.h2d_s = getattr(self._sink, "h2d_s", 0.0)
                batch = pending.pop(next_yield)
                self._pay_owed(reps, len(pending), limit)
                next_yield += 1
                self._stats.batches += 1
                self._stats.samples += len(batch)
                self._next_batch = next_yield
                for _ in range(c.echo):
                    yield self._sink.hand_over(batch)  # issue 14: stream wait + record_stream at hand-over
        finally:
            self._sink.end()

    def _deal(self, reps: List[Replica], epoch: int, start: int, total: int, lookahead: bool = False) -> None:
        """Deal batches start..total round-robin to the replicas and start their streams."""
        todo = list(range(start, total))
        for i, r in enumerate(reps):
            r.dead = False
            r.assign(todo[i :: len(reps)])
            self._hello(r, epoch, lookahead)

    def _start_lookahead(self, epoch: int, total: int) -> None:
        """Start ``epoch`` on the spare connections, so the service never idles between epochs.
        Used if the next iteration is that epoch from its start; otherwise replaced."""
        if not self._spare:
            assert self._ctx is not None
            self._spare = [Replica(self._ctx, e, self.config.heartbeat_s, self.config.max_frame_bytes)
                           for e in self.endpoints]
        self._deal(self._spare, epoch, 0, total, lookahead=True)
        self._lookahead = epoch

    def _poll_ms(self, reps: List[Replica]) -> int:
        # with several replicas, wake up in time to notice one that stays down
        t = self.config.timeout
        if len(reps) > 1:
            t = min(t, self.config.replica_timeout / 2)
        return max(1, int(t * 1000))

    def _hello(self, r: Replica, epoch: int, lookahead: bool = False) -> None:
        """Start a new stream on ``r`` for its remaining batches (nothing if none remain)."""
        c = self.config
        todo = r.remaining()
        r.assign(todo)
        r.owed = 0
        if not todo:
            r.stream = -1
            return
        self._stream += 1
        r.stream = self._stream
        contiguous = todo == list(range(todo[0], todo[0] + len(todo))) and todo[-1] == self._raw_len() - 1
        r.asked = min(c.prefetch, len(todo))
        r.promote = False
        r.send(P.Hello(stream=r.stream, batch_size=c.batch_size, image_size=c.image_size, seed=c.seed, epoch=epoch,
                       rank=c.rank, world_size=c.world_size, shuffle=c.shuffle, drop_last=c.drop_last,
                       train=c.train, start_batch=todo[0] if contiguous else 0, prefetch=c.prefetch,
                       dataset=c.dataset, scale=list(c.scale), ratio=list(c.ratio), job=c.job,
                       batches=[] if contiguous else todo, lookahead=lookahead))

    def _restart(self, r: Replica, epoch: int) -> None:
        if r.todo_set:
            self._stats.restarts += 1
            self._hello(r, epoch)

    def _credit(self, r: Replica, owed: bool) -> None:
        """Ask ``r`` for one more batch, or note the debt while the reorder buffer is full."""
        if r.dead or r.stream < 0 or r.asked >= len(r.todo):
            return
        if owed:
            r.owed += 1
            return
        s = self._stats
        r.send(P.Credit(stream=r.stream, n=1, wait_s=s.wait_s, h2d_s=s.h2d_s, consumed=s.batches, promote=r.promote))
        r.asked += 1
        r.promote = False

    def _pay_owed(self, reps: List[Replica], buffered: int, limit: int) -> None:
        for r in reps:
            while r.owed and buffered < limit:
                r.owed -= 1
                self._credit(r, owed=False)

    def _fail_over_dead(self, reps: List[Replica], epoch: int, now: float) -> None:
        """Give the outstanding batches of a replica that stayed down to the live ones."""
        if len(reps) < 2:
            return  # nobody else to ask: wait for it, up to `timeout`
        for r in reps:
            if r.dead or not r.todo_set or r.down_since is None or now - r.down_since < self.config.replica_timeout:
                continue
            live = [x for x in reps if not x.dead and x is not r and x.down_since is None]
            if not live:
                return
            orphans = r.remaining()
            r.dead, r.stream = True, -1
            r.assign([])
            log.warning("service replica %s has been unreachable for %.0fs; its %d batches go to %s", r.endpoint,
                        now - r.down_since, len(orphans), ", ".join(x.endpoint for x in live))
            for i, x in enumerate(live):
                x.assign(sorted(x.remaining() + orphans[i :: len(live)]))
                self._hello(x, epoch)

    def _recv(self, r: Replica):
        """One message from ``r``: (message, payload), or (None, None) for a stale one.

        Raises LoaderError for the service's errors except the recoverable ones.
        """
        header = r.sock.recv(copy=False)
        try:
            msg = P.decode_header(header)
        except P.ProtocolError as exc:
            r.drain()
            raise LoaderError(exc.code, f"malformed message from the service at {r.endpoint}: {exc}") from None
        if getattr(msg, "stream", -1) not in (r.stream, -1):
            r.drain()  # from a stream we already left
            return None, None
        payload = None
        if isinstance(msg, P.Batch):
            payload = self._sink.receive(r.sock, msg)
            self._stats.bytes += msg.image_bytes
        else:
            r.drain()
        if isinstance(msg, P.Error):
            if msg.code == P.ErrorCode.SHUTTING_DOWN:
                return None, None  # informational: the reconnect that follows restarts the stream
            if msg.code != P.ErrorCode.UNKNOWN_CLIENT:
                raise LoaderError(msg.code, f"{msg.message} (from {r.endpoint})" if len(self._replicas) > 1
                                  else msg.message, msg.traceback)
        return msg, payload

    def _raise_timeout(self, reps: List[Replica]) -> None:
        c = self.config
        down = [r for r in reps if r.down_since is not None]
        where = ", ".join(r.endpoint for r in reps)
        cut = [r.endpoint for r in down if not r.retried]
        if cut:
            raise LoaderTimeout(f"the connection to {', '.join(cut)} was cut for breaking the protocol and is not "
                                f"retried: a peer that sends a frame over this loader's cap of {c.max_frame_bytes} "
                                "bytes (batch_size x image_size^2 x 3 + 1 MiB), or that is not a ZeroMQ peer, is "
                                "refused; is this endpoint a loader service?")
        if down and len(down) == len(reps) and any(r.was_connected for r in reps):
            raise LoaderTimeout(f"lost the connection to the loader service at {where} "
                                f"{time.monotonic() - min(r.down_since for r in down):.0f}s ago and it has not "
                                f"come back within {c.timeout:g}s")
        raise LoaderTimeout(f"no message from the loader service at {where} for {c.timeout:g}s; is "
                            "it running and reachable? (start one with: loader-service serve --demo)")

    def _describe(self) -> None:
        """Learn the dataset's length from whichever replica answers first."""
        reps = self._connect()
        describe = P.Describe(dataset=self.config.dataset)
        for r in reps:
            r.send(describe)
        poller = zmq.Poller()
        for r in reps:
            poller.register(r.sock, zmq.POLLIN)
            poller.register(r.monitor, zmq.POLLIN)
        deadline = time.monotonic() + self.config.timeout
        while True:
            left = deadline - time.monotonic()
            events = dict(poller.poll(max(0, left) * 1000)) if left > 0 else {}
            if not events:
                self._raise_timeout(reps)
            for r in reps:
                if r.monitor in events and r.on_monitor():
                    r.send(describe)
                if r.sock in events:
                    msg, _ = self._recv(r)
                    if isinstance(msg, P.DatasetInfo):
                        self._dataset_length = msg.length
                        return

    def _connect(self) -> List[Replica]:
        if not self._replicas:
            if self._closed:
                raise RuntimeError("this RemoteLoader is closed")
            self._ctx = zmq.Context(1)
            self._replicas = [Replica(self._ctx, e, self.config.heartbeat_s, self.config.max_frame_bytes)
                              for e in self.endpoints]
        return self._replicas


def resolve_endpoints(endpoint: str) -> List[str]:
    """``tcp://name:port`` -> one endpoint per address the name resolves to (a Kubernetes
    headless Service, say), sorted so every rank lists the replicas in the same order."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(endpoint)
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise ValueError(f"expected tcp://host:port, got {endpoint!r}")
    infos = socket.getaddrinfo(u.hostname, u.port, type=socket.SOCK_STREAM)
    addrs = sorted({i[4][0] for i in infos})
    return [f"tcp://[{a}]:{u.port}" if ":" in a else f"tcp://{a}:{u.port}" for a in addrs]


__all__ = ["RemoteLoader", "LoaderStats", "resolve_endpoints"]

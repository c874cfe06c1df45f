"""Stand-ins for the client's socket side, so that its stages run without a service: a replica's
connection state with the service's messages queued by the test, a set of them, a clock that
moves only while the run waits, and a sink that records what it is given."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional

from wire import protocol as P

from client.connections import Connections
from client.errors import LoaderError, LoaderTimeout


class Clock:
    """A monotonic clock that only the fakes move."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeReplica:
    """One connection's state (as :class:`client.replica.Replica` keeps it), no socket: the
    service's messages wait in ``inbox``, connection events in ``events`` (True: back after a
    loss); what the loader sent is kept."""

    def __init__(self, index: int, endpoint: str = ""):
        self.index, self.endpoint = index, endpoint or f"tcp://replica-{index}:5555"
        self.dead = self.accepted = self.was_connected = self.draining = False
        self.refused = ""  # quarantined: why (client/connections.py)
        self.shutdown_at: Optional[float] = None  # when its service said it shuts down
        self.down_since: Optional[float] = None
        self.retry_at: Optional[float] = None
        self.stream, self.epoch = -1, 0
        self.local = False  # the current stream asked for its batches in place
        self.stale_batches = self.gone_batches = 0  # batches in a row it could not use (client.epoch)
        self.progress, self.progress_at = None, 0.0
        self.inbox: deque = deque()  # (message, payload) from the service
        self.events: deque = deque()
        self.asked: List[int] = []  # batches asked of the current stream and not yet sent
        self.hellos: List[tuple] = []  # (stream, epoch, batches, lookahead)
        self.requests: List[dict] = []
        self.cut = False
        self.stalled = 0.0
        self.closed = False
        self._answered = -1  # the last stream the service accepted

    # what the loader calls
    def has_message(self) -> bool:
        return bool(self.inbox)

    def has_event(self) -> bool:
        return bool(self.events)

    def wait(self, timeout_ms: float) -> bool:
        return bool(self.inbox)

    def on_monitor(self) -> bool:
        return self.events.popleft()

    def request(self, batches, consumed: int, promote: bool = False, final: bool = False, probe: bool = False):
        self.asked.extend(batches)
        self.requests.append(dict(batches=list(batches), consumed=consumed, promote=promote, final=final,
                                  probe=probe))

    def stall(self, wait_s: float, h2d_s: float) -> None:
        self.stalled += wait_s

    def is_cut(self, now: float) -> bool:
        return self.cut

    def cut_at(self) -> Optional[float]:
        return None

    def close(self) -> None:
        self.closed = True

    # what the test's service does
    def answer_hello(self, num_batches: int) -> None:
        """Accept the current stream, once."""
        if self.stream >= 0 and self._answered != self.stream:
            self._answered = self.stream
            self.accept(num_batches)

    def accept(self, num_batches: int) -> None:
        self.inbox.append((P.Accept(stream=self.stream, epoch=self.epoch, num_batches=num_batches,
                                    num_samples=2 * num_batches, dataset_length=2 * num_batches, dataset="d"), None))

    def send_batch(self, index: int) -> None:
        """Send batch ``index`` of the current stream (two samples; the payload names it)."""
        self.inbox.append((P.Batch(stream=self.stream, epoch=self.epoch, index=index,
                                   indices=[2 * index, 2 * index + 1], shape=[2, 1, 1, 3]), ("payload", index)))

    def finals(self) -> int:
        return sum(r["final"] for r in self.requests)


class FakeConnections:
    """A set of :class:`FakeReplica`. At every poll ``serve(self)`` plays the services (it may
    fill inboxes); a poll that finds nothing moves ``clock`` on by its timeout."""

    start_epoch = Connections.start_epoch  # the real one, over these fakes

    def __init__(self, replicas: int, window: int, clock: Clock,
                 serve: Callable[["FakeConnections"], None] = lambda conns: None):
        self.replicas = [FakeReplica(i) for i in range(replicas)]
        self.window, self.clock, self.serve = window, clock, serve
        self.stream_ids = itertools.count(1)
        self._ids = itertools.count(replicas)
        self.twins: List["FakeConnections"] = []
        self.closed = False
        self.joins: List[tuple] = []  # (endpoint, clock) of each replica that joined
        self.left: List[FakeReplica] = []
        self.colocated: set = set()  # endpoints whose service shares this host's shared memory, as last heard

    def join(self, endpoint: str) -> FakeReplica:
        r = FakeReplica(next(self._ids), endpoint)
        self.replicas.append(r)
        self.joins.append((endpoint, self.clock.now))
        return r

    def leave(self, r: FakeReplica) -> None:
        self.replicas.remove(r)
        self.left.append(r)
        r.close()

    def find(self, endpoint: str) -> Optional[FakeReplica]:
        return next((r for r in self.replicas if r.endpoint == endpoint), None)

    def hello(self, r: FakeReplica, epoch: int, batches: List[int], lookahead: bool = False) -> None:
        r.stream, r.epoch, r.accepted, r.asked = next(self.stream_ids), epoch, False, list(batches)
        r.local = r.endpoint in self.colocated
        r.hellos.append((r.stream, epoch, list(batches), lookahead))

    misplaced = Connections.misplaced  # the real one: the stream's Hello against where its service is
    max_queued = Connections.max_queued

    def healthy(self) -> bool:
        return Connections.healthy(self)

    def twin(self) -> "FakeConnections":
        twin = FakeConnections(len(self.replicas), self.window, self.clock, self.serve)
        twin.colocated = self.colocated  # shared, as the real sets share what they learnt
        self.twins.append(twin)
        return twin

    def close(self) -> None:
        self.closed = True
        for r in self.replicas:
            r.close()

    def send_releases(self, waiting: bool = False) -> None:
        pass  # no batch is held in place here (co-located mode has its own tests)

    def poll(self, timeout_ms: float, waiting: bool = False) -> list:
        self.serve(self)
        events = [(r, bool(r.events), bool(r.inbox)) for r in self.replicas if r.events or r.inbox]
        if not events:
            self.clock.now += timeout_ms / 1000
        return events

    def recv(self, r: FakeReplica, sink):
        msg, payload = r.inbox.popleft()
        if getattr(msg, "stream", -1) not in (r.stream, -1):
            return None, None  # from a stream already left (as the real one drops it)
        if isinstance(msg, P.Error) and msg.code != P.ErrorCode.UNKNOWN_CLIENT:
            raise LoaderError(msg.code, msg.message)
        if isinstance(payload, LoaderError):  # what the sink raises for this batch (its bytes cannot be had)
            raise payload
        return msg, payload

    def check_connections(self, now: float) -> None:
        pass

    def drain_announced(self) -> None:
        pass  # these services never say they shut down (test_replica_fate has the real set's)

    def due_times(self) -> List[float]:
        return []

    def raise_timeout(self) -> None:
        raise LoaderTimeout("nothing came")


@dataclass
class FakeBatch:
    index: int
    samples: int

    def __len__(self) -> int:
        return self.samples


class RecordingSink:
    """A sink that logs ("push" | "hand_over", batch index) in call order."""

    def __init__(self):
        self.log: List[tuple] = []
        self.ended = 0
        self.h2d_s = 0.0

    def push(self, msg: P.Batch, payload) -> FakeBatch:
        assert payload == ("payload", msg.index)
        self.log.append(("push", msg.index))
        return FakeBatch(msg.index, len(msg.indices))

    def hand_over(self, batch: FakeBatch) -> FakeBatch:
        self.log.append(("hand_over", batch.index))
        return batch

    def drop(self, payload) -> None:
        self.log.append(("drop", payload[1]))

    def end(self) -> None:
        self.ended += 1

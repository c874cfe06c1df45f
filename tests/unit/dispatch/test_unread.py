"""Connections that read nothing of what waits for them (loader_service/dispatch/unread.py): the
rule on its own, then through the real dispatch state (testkit/dispatcher.py), where a Probe is
answered with the send sides the test sets, and a model with random interleavings of every event
(peers that read or stop, data that waits or drains, lanes that come and go, reconnects on a
reused fd number, the clock) checked against a recount from each connection's history of looks."""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Dict, Iterator, List, Tuple

import pytest
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig
from loader_service.dispatch import events as E
from loader_service.dispatch.silence import SILENT_AFTER
from loader_service.dispatch.state import refused_log
from loader_service.dispatch.unread import Sending, UnreadWatch
from testkit.dispatcher import close, deliver, loopless

SPEC = JobSpec(batch_size=8, image_size=16, seed=1)
IDLE = Sending(acked=100, unacked=0, unsent=0)


def _stuck(acked: int = 100, unsent: int = 4096) -> Sending:
    return Sending(acked=acked, unacked=0, unsent=unsent)


# ------------------------------------------------------------------ the rule alone
def test_a_connection_that_reads_or_has_nothing_waiting_is_never_unread():
    w = UnreadWatch()
    for k in range(10):
        assert w.observe(5, 1, (Sending(acked=1000 * k, unacked=3, unsent=500),), now=float(k)) == 0.0
    for k in range(10, 20):
        assert w.observe(5, 1, (IDLE,), now=float(k)) == 0.0  # nothing waits: nothing to read


def test_unread_counts_from_the_look_before_the_first_that_found_nothing_acknowledged():
    w = UnreadWatch()
    assert w.observe(5, 1, (_stuck(),), now=0.0) == 0.0  # one look says nothing about progress
    assert w.observe(5, 1, (_stuck(),), now=2.0) == 2.0
    assert w.observe(5, 1, (_stuck(unsent=9000),), now=4.0) == 4.0  # more waiting, nothing read
    assert w.unsent(5) == 9000
    assert w.observe(5, 1, (_stuck(acked=101),), now=6.0) == 0.0  # one byte read: it reads
    assert w.observe(5, 1, (_stuck(acked=101),), now=8.0) == 2.0


def test_data_that_waited_at_only_one_of_two_looks_is_not_a_stall():
    w = UnreadWatch()
    w.observe(5, 1, (IDLE,), now=0.0)
    assert w.observe(5, 1, (_stuck(),), now=2.0) == 0.0  # came since the last look
    w = UnreadWatch()
    w.observe(5, 1, (_stuck(),), now=0.0)
    assert w.observe(5, 1, (IDLE,), now=2.0) == 0.0  # drained (acked is the same: it was all in flight)


def test_one_stuck_lane_makes_the_connection_unread_and_a_change_of_lanes_starts_over():
    def own(t: float) -> Sending:  # the connection's own socket reads all along
        return Sending(acked=int(10 * t), unacked=1, unsent=0)

    w = UnreadWatch()
    w.observe(5, 1, (own(0), _stuck(), IDLE), now=0.0)
    assert w.observe(5, 1, (own(1), _stuck(), IDLE), now=1.0) == 1.0
    assert w.observe(5, 1, (own(2), _stuck(), _stuck()), now=2.0) == 2.0  # both lanes now
    assert w.observe(5, 1, (own(3), IDLE, _stuck()), now=3.0) == 3.0  # the other lane still
    assert w.observe(5, 1, (own(4), IDLE, _stuck(acked=101)), now=4.0) == 0.0  # it read a byte
    w.observe(5, 1, (own(5), _stuck(), IDLE), now=5.0)
    assert w.observe(5, 1, (own(6), _stuck(), IDLE), now=6.0) == 1.0
    assert w.observe(5, 1, (own(6), _stuck()), now=7.0) == 0.0  # a lane set of another size
    assert w.observe(5, 1, (own(6), _stuck()), now=8.0) == 1.0  # the own socket stuck too, now


def test_a_new_connection_on_the_fd_number_and_a_forgotten_one_start_over():
    w = UnreadWatch()
    w.observe(5, 1, (_stuck(),), now=0.0)
    assert w.observe(5, 2, (_stuck(),), now=1.0) == 0.0
    assert w.observe(5, 2, (_stuck(),), now=2.0) == 1.0
    w.forget(5)
    assert w.observe(5, 2, (_stuck(),), now=3.0) == 0.0 and w.unsent(6) == 0
    assert w.observe(5, 2, (), now=4.0) == 0.0  # a kernel that does not count it: never unread


# ------------------------------------------------------------------ through the dispatch state
@pytest.fixture(scope="module")
def source():
    from loader_service.sources.demo import ensure_demo

    src = ensure_demo(64, quiet=True)
    yield src
    src.close()


def _state(source, heartbeat: float = 0.5):
    return loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0,
                                  heartbeat_s=heartbeat), source, workers=1)


def _look(d, sockets: Dict[int, Tuple[Sending, ...]], after: float) -> None:
    d.now += after
    d.sockets.update(sockets)
    d.tick()


def test_a_session_that_reads_nothing_for_three_of_its_heartbeats_is_cut_dropped_and_named(source, caplog,
                                                                                           monkeypatch):
    monkeypatch.setattr(refused_log, "filters", [])
    d = _state(source, heartbeat=0.5)
    try:
        ident, other = uuid.uuid4().bytes, uuid.uuid4().bytes
        deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0], heartbeat=1.0), fd=30)
        deliver(d, other, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=31)
        with caplog.at_level(logging.INFO, logger="loader_service.dispatch"):
            _look(d, {30: (_stuck(),), 31: (_stuck(),)}, after=0.5)
            for k in range(1, 6):  # 30 reads nothing for 2.5 s (its limit: 3 s); 31 reads a byte a look
                _look(d, {31: (_stuck(acked=100 + k),)}, after=0.5)
            assert d.cut == [] and ident in d.sessions
            _look(d, {30: (_stuck(unsent=123456),)}, after=0.5)
        assert d.cut == [30] and ident not in d.sessions and other in d.sessions
        assert (d.totals.unread_cut, d.totals.silent_cut, d.totals.internal_errors) == (1, 0, 0)
        lines = [r.getMessage() for r in caplog.records if r.name == "loader_service.dispatch.refused"]
        assert lines == [f"cut the connection of client {ident.hex()[:12]} from 10.0.0.1: its peer read nothing of "
                         "what waits for it for 3.0 s (123,456 bytes unsent in the kernel, more in libzmq's queue; "
                         f"the limit: 3.0 s, {SILENT_AFTER} of its heartbeats)"]
    finally:
        close(d)


def test_a_connection_both_silent_and_unread_is_cut_once_and_counted_silent(source):
    d = _state(source, heartbeat=0.5)
    try:
        deliver(d, uuid.uuid4().bytes, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=30)
        _look(d, {30: (_stuck(),)}, after=0.5)
        for _ in range(12):
            d.quiet[30] = d.now
            _look(d, {}, after=0.5)
        assert d.cut == [30] and (d.totals.silent_cut, d.totals.unread_cut) == (1, 0)
    finally:
        close(d)


# ------------------------------------------------------------------ a client behind in reading (memory.py)
def _accepted(d, ident: bytes) -> List[int]:
    return [m.stream for i, m in d.sent if i == ident and isinstance(m, P.Accept)]


@contextlib.contextmanager
def _not_reading(source) -> Iterator[Tuple[object, bytes]]:
    """The dispatch state and a client on its second stream: libzmq holds every tracked Accept
    until the test lets go of it (``d.flush``). The connection's first Accept is not tracked
    (nothing is queued before it), so the second stream opened at once; its Accept is."""
    d = _state(source)
    d.reading = False
    try:
        ident = uuid.uuid4().bytes
        deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0, 1]), fd=30)
        assert _accepted(d, ident) == [1] and d.flushing == [] and d.state.sessions.unflushed == {}
        deliver(d, ident, P.Hello(stream=2, spec=SPEC, slots=2, batches=[0, 1]), fd=30)
        assert _accepted(d, ident) == [1, 2] and [e.stream for _, e in d.flushing] == [2]
        yield d, ident
        assert d.totals.internal_errors == 0
    finally:
        close(d)


def test_a_new_stream_waits_until_libzmq_lets_go_of_the_last_accept_then_the_latest_opens(source, caplog):
    with _not_reading(source) as (d, ident):
        with caplog.at_level(logging.INFO, logger="loader_service.dispatch"):
            deliver(d, ident, P.Hello(stream=3, spec=SPEC, slots=2, batches=[0]), fd=30)
            deliver(d, ident, P.Hello(stream=4, spec=SPEC, slots=2, batches=[0]), fd=30)
        assert _accepted(d, ident) == [1, 2] and d.memory.waiting[ident].hello.stream == 4
        assert d.totals.held_back == 2 and d.state.sessions.unflushed == {ident: 2}
        assert f"client {ident.hex()[:12]} stream 4 waits: its client has not yet read what came before the Accept " \
               "of its last stream" in caplog.text
        d.flush()  # what came before stream 2's Accept has gone to the kernel
        assert _accepted(d, ident) == [1, 2, 4] and ident not in d.memory.waiting
        assert d.state.sessions.unflushed == {ident: 4}  # its own Accept, held in turn; stream 3 never opened


def test_a_lookahead_of_a_client_behind_is_refused_and_may_be_asked_again(source):
    with _not_reading(source) as (d, ident):
        deliver(d, ident, P.Hello(stream=3, spec=SPEC, slots=2, batches=[0], lookahead=True), fd=30)
        refused = [m for i, m in d.sent if i == ident and isinstance(m, P.Error)]
        assert [(m.code, m.stream, m.fatal) for m in refused] == [(P.ErrorCode.NO_CAPACITY, 3, False)]
        assert refused[0].message.startswith("lookahead refused: its client has not yet read what came before")
        assert ident not in d.memory.waiting and d.totals.held_back == 0
        d.flush()
        deliver(d, ident, P.Hello(stream=4, spec=SPEC, slots=2, batches=[0], lookahead=True), fd=30)
        assert _accepted(d, ident) == [1, 2, 4]


def test_an_accept_let_go_with_its_connection_frees_the_ident_and_an_older_one_changes_nothing(source):
    with _not_reading(source) as (d, ident):
        deliver(d, ident, P.Bye(), fd=30)  # the session ends, the connection (and its queue) stays
        deliver(d, ident, P.Hello(stream=3, spec=SPEC, slots=2, batches=[0]), fd=30)
        assert _accepted(d, ident) == [1, 2] and ident in d.memory.waiting  # still behind stream 2's Accept
        d.handle(E.Flushed(ident, 1))  # an older Accept's: nothing changes
        assert d.state.sessions.unflushed == {ident: 2} and ident in d.memory.waiting
        d.event(zmq.EVENT_DISCONNECTED, 30)
        d.read_monitor()  # the connection closes: libzmq drops its queue, the Accept with it
        assert d.state.sessions.unflushed == {} and ident not in d.sessions and not d.memory.waiting
        assert _accepted(d, ident) == [1, 2]


def test_only_an_accept_after_a_connection_s_first_is_tracked_and_a_new_connection_starts_again(source):
    with _not_reading(source) as (d, ident):
        d.flush()
        deliver(d, ident, P.Bye(), fd=30)
        deliver(d, ident, P.Hello(stream=3, spec=SPEC, slots=2, batches=[0]), fd=30)
        assert [e.stream for _, e in d.flushing] == [3]  # after a Bye, on the same connection: tracked
        d.event(zmq.EVENT_DISCONNECTED, 30)
        d.read_monitor()
        other = uuid.uuid4().bytes  # the next connection on fd number 30 is new: its first Accept is not
        deliver(d, other, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=30)
        assert _accepted(d, other) == [1] and d.flushing == [] and d.state.sessions.unflushed == {}


# ------------------------------------------------------------------ the model
class UnreadModel(RuleBasedStateMachine):
    """Connections on three fd numbers, each with its own socket and 0-2 lanes: their peers read
    (the acknowledged count moves) or not, data comes to wait or drains, lane sets change, the
    connections say Hello with a heartbeat of their own or not, disconnect and come back on the
    same number; the clock moves and looks run. At every round the cuts must be exactly the
    connections a recount from their history of looks finds unread for their limit."""

    HEARTBEAT, FDS = 0.5, (30, 31, 32)

    def __init__(self):
        super().__init__()
        from loader_service.sources.demo import ensure_demo

        self.src = ensure_demo(64, quiet=True)
        self.d = _state(self.src, heartbeat=self.HEARTBEAT)
        self.ident: Dict[int, bytes] = {}
        self.heartbeat: Dict[int, float] = {}
        self.sockets: Dict[int, List[Sending]] = {}  # fd -> its sockets now (the kernel's counts)
        self.looks: Dict[int, List[Tuple[float, Tuple[Sending, ...]]]] = {}  # fd -> what each look read
        self.streams = 0

    def teardown(self):
        close(self.d)
        self.src.close()

    @rule(fd=st.sampled_from(FDS), lanes=st.integers(0, 2))
    def connect(self, fd, lanes):
        if fd in self.ident:
            return
        self.ident[fd] = uuid.uuid4().bytes
        self.heartbeat[fd] = P.DEFAULT_HEARTBEAT_S
        self.sockets[fd] = [IDLE] * (1 + lanes)
        self.looks[fd] = []
        self.d.event(zmq.EVENT_ACCEPTED, fd)
        deliver(self.d, self.ident[fd], P.Describe(), fd=fd, report=False)

    @rule(fd=st.sampled_from(FDS), heartbeat=st.sampled_from([None, 0.2, 0.5, 1.0]))
    def hello(self, fd, heartbeat):
        if fd not in self.ident:
            return
        extra = {} if heartbeat is None else {"heartbeat": heartbeat}
        self.streams += 1
        deliver(self.d, self.ident[fd], P.Hello(stream=self.streams, spec=SPEC, slots=2, **extra), fd=fd)
        self.heartbeat[fd] = heartbeat or P.DEFAULT_HEARTBEAT_S

    @rule(fd=st.sampled_from(FDS), k=st.integers(0, 2), read=st.integers(1, 5000), drained=st.booleans())
    def peer_reads(self, fd, k, read, drained):
        if fd in self.ident and k < len(self.sockets[fd]):
            s = self.sockets[fd][k]
            self.sockets[fd][k] = s._replace(acked=s.acked + read, unsent=0 if drained else s.unsent)

    @rule(fd=st.sampled_from(FDS), k=st.integers(0, 2), unsent=st.integers(0, 1 << 20), unacked=st.integers(0, 3))
    def data_waits(self, fd, k, unsent, unacked):
        if fd in self.ident and k < len(self.sockets[fd]):
            self.sockets[fd][k] = self.sockets[fd][k]._replace(unsent=unsent, unacked=unacked)

    @rule(fd=st.sampled_from(FDS), lanes=st.integers(0, 2))
    def lanes_change(self, fd, lanes):
        if fd in self.ident:
            self.sockets[fd] = self.sockets[fd][:1] + [IDLE] * lanes

    @rule(fd=st.sampled_from(FDS))
    def disconnect(self, fd):
        if fd in self.ident:
            self.d.event(zmq.EVENT_DISCONNECTED, fd)
            self.d.read_monitor()
            self._gone(fd)

    def _gone(self, fd):
        for table in (self.ident, self.heartbeat, self.sockets, self.looks):
            del table[fd]

    def _unread_s(self, fd) -> float:
        """From the looks at this connection alone: since the earliest look after which every
        interval between looks had a socket with data waiting at both ends and nothing acknowledged."""
        looks = self.looks[fd]
        start = len(looks) - 1
        while start > 0:
            (_, before), (_, after) = looks[start - 1], looks[start]
            if len(before) != len(after) or not any(a.waiting and b.waiting and a.acked == b.acked
                                                    for a, b in zip(before, after)):
                break
            start -= 1
        return looks[-1][0] - looks[start][0]

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.0, 3.0]))
    def time_passes(self, dt):
        self._round(dt)

    @rule(rounds=st.integers(1, 12))
    def heartbeats_pass(self, rounds):
        """Several looks in a row with nothing else happening: long stalls, not only short ones."""
        for _ in range(rounds):
            self._round(self.HEARTBEAT)

    def _round(self, dt):
        probes, cuts = self.d.probes, len(self.d.cut)
        self.d.now += dt
        self.d.sockets = {fd: tuple(s) for fd, s in self.sockets.items()}
        self.d.tick()
        self.d.read_monitor()  # the disconnects of the connections the shell cut
        expected = []
        if self.d.probes > probes:
            for fd in self.ident:
                self.looks[fd].append((self.d.now, tuple(self.sockets[fd])))
                if self._unread_s(fd) >= 3 * max(self.HEARTBEAT, self.heartbeat[fd]):
                    expected.append(fd)
        new_cuts = self.d.cut[cuts:]
        assert sorted(new_cuts) == sorted(expected), (new_cuts, expected, {fd: self.looks[fd][-3:] for fd in expected})
        for fd in new_cuts:
            assert self.ident[fd] not in self.d.sessions
            self._gone(fd)

    @invariant()
    def counted_and_never_silent(self):
        assert self.d.totals.silent_cut == 0 and self.d.totals.internal_errors == 0
        assert self.d.totals.unread_cut == len(self.d.cut)
        assert self.d.sessions.connections == len(self.ident)


TestUnreadModel = UnreadModel.TestCase
TestUnreadModel.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])

"""What one data-port connection may send (loader_service/dispatch/flood.py): the allowance on
its own, checked against a recount of everything a connection did, then through the real
dispatch state (testkit/dispatcher.py): a flood is cut at an exact message, what its identity
sends after is dropped unread, and a client that sends what the project's client sends is
never cut, whatever the allowance."""

from __future__ import annotations

import uuid
from typing import Dict, List, Tuple

import pytest
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig
from loader_service.dispatch import flood
from loader_service.dispatch.flood import EARNED_PER_BATCH, REMEMBER_S, FloodGuard, Verdict
from loader_service.dispatch.streams import Stream
from testkit.dispatcher import Frame, close, deliver, loopless

GARBAGE = [b"\xc1"]  # one frame, a byte msgpack never uses: answered bad_message


def test_a_message_costs_a_unit_per_started_4_kib_and_at_least_one():
    assert [flood.cost([Frame(b"x" * n)]) for n in (0, 1, 4096, 4097, 8192)] == [1, 1, 1, 2, 2]
    assert flood.cost([Frame(b"x" * 4000), Frame(b"y" * 200)]) == 2  # the frames together


def test_a_connection_is_cut_at_the_message_that_takes_it_past_its_allowance_then_dropped():
    g = FloodGuard(burst=10, rate=0)
    verdicts = [g.charge(b"a", 5, 1, 1, now=0.0) for _ in range(13)]
    assert verdicts == [Verdict.PASS] * 10 + [Verdict.CUT] + [Verdict.DROP] * 2
    assert g.charge(b"b", 6, 2, 1, now=0.0) is Verdict.PASS  # another connection: its own allowance


def test_batches_sent_and_time_earn_it_back_up_to_the_burst():
    g = FloodGuard(burst=10, rate=2.0)
    assert g.charge(b"a", 5, 1, 10, now=0.0) is Verdict.PASS
    g.earn(5, 1, batches=1, now=0.0)
    assert g.units(5, 1, now=0.0) == EARNED_PER_BATCH
    assert g.units(5, 1, now=1.0) == EARNED_PER_BATCH + 2
    assert g.units(5, 1, now=100.0) == 10  # never more than the burst
    g.earn(5, 1, batches=5, now=100.0)
    assert g.units(5, 1, now=100.0) == 10


def test_what_a_cut_identity_sends_is_dropped_on_any_connection_until_it_is_forgotten():
    g = FloodGuard(burst=2, rate=0)
    assert [g.charge(b"a", 5, 1, 1, now=0.0) for _ in range(3)][-1] is Verdict.CUT
    g.forget(5)
    assert g.charge(b"a", 5, 2, 1, now=1.0) is Verdict.DROP  # its client reconnected on a reused fd number
    assert g.charge(b"a", 7, 3, 1, now=REMEMBER_S - 0.1) is Verdict.DROP
    assert g.charge(b"a", 7, 3, 1, now=REMEMBER_S) is Verdict.PASS  # 30 s on: served again
    assert g.charge(b"z", 8, 4, 1, now=REMEMBER_S) is Verdict.PASS  # nobody else was ever affected


def test_what_a_cut_identity_left_unread_costs_an_early_connection_on_its_fd_number_nothing():
    g = FloodGuard(burst=2, rate=0)
    assert [g.charge(b"a", 5, 1, 1, now=0.0) for _ in range(3)][-1] is Verdict.CUT
    g.forget(5)  # it closed; its rest comes over fd 5, not open as the state sees it: opened early
    assert [g.charge(b"a", 5, 2, 1, now=0.0, early=True) for _ in range(10)] == [Verdict.DROP] * 10
    assert g.units(5, 2, now=0.0) == 2


def test_earnings_for_a_connection_that_is_gone_do_not_touch_the_next_one_on_its_fd():
    g = FloodGuard(burst=10, rate=0)
    g.charge(b"a", 5, 1, 10, now=0.0)
    g.forget(5)
    g.charge(b"b", 5, 2, 3, now=0.0)  # a new connection on fd 5
    g.earn(5, 1, batches=100, now=0.0)  # a batch counted for the old one
    assert g.units(5, 2, now=0.0) == 7


def test_the_allowances_of_connections_no_longer_open_are_forgotten():
    g = FloodGuard(burst=10, rate=0)
    for fd in (5, 6, 7):
        g.charge(b"%d" % fd, fd, fd, 1, now=0.0)
    g.keep_open({5: 5, 7: 99}.get)  # 6: closed; 7: another connection now
    assert len(g) == 1 and g.units(5, 5, now=0.0) == 9


def test_the_identities_remembered_are_bounded():
    g = FloodGuard(burst=1, rate=0)
    for k in range(flood.REMEMBERED + 10):
        assert g.charge(b"%d" % k, k, 1, 2, now=0.0) is Verdict.CUT
    assert g.remembered == flood.REMEMBERED


class GuardMachine(RuleBasedStateMachine):
    """Random messages, batches, clock steps, disconnects and reconnects on three fd numbers by
    four identities; every verdict checked against a recount from the connection's whole history."""

    BURST, RATE = 12, 1.5

    def __init__(self):
        super().__init__()
        self.g = FloodGuard(self.BURST, self.RATE)
        self.now = 0.0
        self.serial = {fd: 1 for fd in (3, 4, 5)}  # the connection open on each fd
        self.next_serial = 10
        self.history: Dict[Tuple[int, int], List[Tuple[str, float, int]]] = {}  # connection -> events
        self.cut_at: Dict[bytes, float] = {}  # identity -> when its connection was last cut
        self.was_cut: Dict[Tuple[int, int], bool] = {}

    def _recount(self, conn: Tuple[int, int]) -> float:
        """The connection's units now, replayed from its history (the clamp applied at each event)."""
        units, at = float(self.BURST), None
        for kind, t, n in self.history.get(conn, []):
            if at is not None:
                units = min(self.BURST, units + (t - at) * self.RATE)
            at = t
            units = units - n if kind == "charge" else min(self.BURST, units + n * EARNED_PER_BATCH)
        return units if at is None else min(self.BURST, units + (self.now - at) * self.RATE)

    @rule(ident=st.sampled_from([b"a", b"b", b"c", b"d"]), fd=st.sampled_from([3, 4, 5]), units=st.integers(1, 5),
          early=st.sampled_from([False, False, True]))
    def message(self, ident, fd, units, early):
        conn = (fd, self.serial[fd])
        remembered = ident in self.cut_at and self.now < self.cut_at[ident] + REMEMBER_S
        v = self.g.charge(ident, fd, conn[1], units, self.now, early)
        if self.was_cut.get(conn) or remembered and early:
            assert v is Verdict.DROP  # and nothing charged: the recount below would differ
            return
        self.history.setdefault(conn, []).append(("charge", self.now, units))
        if self._recount(conn) < 0:
            assert v is Verdict.CUT
            self.was_cut[conn] = True
            self.cut_at[ident] = self.now
        else:
            assert v is (Verdict.DROP if remembered else Verdict.PASS)

    @rule(fd=st.sampled_from([3, 4, 5]), batches=st.integers(1, 3))
    def batches_sent(self, fd, batches):
        conn = (fd, self.serial[fd])
        if conn in self.history:  # earnings only for a connection that has said something
            self.history[conn].append(("earn", self.now, batches))
        self.g.earn(fd, conn[1], batches, self.now)

    @rule(fd=st.sampled_from([3, 4, 5]), batches=st.integers(1, 3))
    def batches_counted_for_a_connection_gone(self, fd, batches):
        self.g.earn(fd, self.serial[fd] - 1, batches, self.now)  # never the open one's

    @rule(seconds=st.sampled_from([0.1, 1.0, 7.0, REMEMBER_S]))
    def time_passes(self, seconds):
        self.now += seconds

    @rule(fd=st.sampled_from([3, 4, 5]), tidy=st.booleans())
    def reconnect(self, fd, tidy):
        """The connection on ``fd`` closes and a new one gets the same fd number."""
        self.g.forget(fd)
        self.next_serial += 1
        self.serial[fd] = self.next_serial
        if tidy:
            self.g.keep_open(lambda f: self.serial.get(f, 0))

    @invariant()
    def units_are_the_recount(self):
        for fd, serial in self.serial.items():
            if (fd, serial) in self.history and not self.was_cut.get((fd, serial)):
                assert self.g.units(fd, serial, self.now) == pytest.approx(self._recount((fd, serial)))
        assert len(self.g) <= 3  # one allowance per fd number at most


TestGuard = GuardMachine.TestCase
TestGuard.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------- through the dispatch state
SPEC = JobSpec(batch_size=4, image_size=16, shuffle=False)


@pytest.fixture
def source():
    from loader_service.sources.demo import ensure_demo

    src = ensure_demo(64, quiet=True)
    yield src
    src.close()


def _state(source, allowance: int, rate: float = 0.0, workers: int = 4):
    return loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0,
                                  client_allowance=allowance, client_allowance_rate=rate), source, workers=workers)


def test_a_flood_is_cut_at_the_message_past_its_allowance_its_session_dropped_and_the_rest_unread(source):
    d = _state(source, allowance=20)
    try:
        flooder, bystander = uuid.uuid4().bytes, uuid.uuid4().bytes
        deliver(d, bystander, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=31)
        deliver(d, flooder, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=30)
        for _ in range(19):  # the Hello was the first unit: 20 in all
            deliver(d, flooder, GARBAGE, fd=30)
        assert d.cut == [] and d.totals.bad_messages == 19 and flooder in d.sessions
        deliver(d, flooder, GARBAGE, fd=30)  # the 21st
        assert d.cut == [30] and flooder not in d.sessions
        assert (d.totals.floods_cut, d.totals.flooded_messages, d.totals.bad_messages) == (1, 1, 19)
        told = len(d.sent)
        deliver(d, flooder, P.Hello(stream=2, spec=SPEC, slots=2, batches=[0]), fd=30)  # left unread: dropped
        deliver(d, flooder, P.Describe(), fd=44)  # its client reconnected (same identity): dropped for 30 s
        assert len(d.sent) == told and flooder not in d.sessions and d.totals.flooded_messages == 3
        assert d.cut == [30]  # fd 44's allowance is not spent: it is not cut, only what it says is dropped
        assert d.sessions.get(bystander).stream is not None  # the other client is untouched
        d.now += REMEMBER_S
        deliver(d, flooder, P.Describe(), fd=44)
        assert isinstance(d.sent[-1][1], P.DatasetInfo) and d.sent[-1][0] == flooder  # forgiven after 30 s
        assert d.totals.internal_errors == 0
    finally:
        close(d)


def test_a_cut_drops_the_session_in_any_state_of_its_stream_and_frees_its_slots(source):
    d = _state(source, allowance=4)
    try:
        ident = uuid.uuid4().bytes
        deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0, 1]), fd=30)
        d.tick()  # its two tasks go to workers
        assert d.memory.in_use() > 0
        for _ in range(4):
            deliver(d, ident, P.Request(stream=1, batches=[]), fd=30)
        assert d.cut == [30] and ident not in d.sessions
        for w in [w for w, r in d.pool.workers.items() if r.tasks]:
            d.finish(w)  # its tasks end after it is gone: nothing is sent, the slots come back
        d.let_go()
        d.tick()
        assert [i for i, _ in d.batches] == [] and d.memory.in_use() == 0 and d.totals.internal_errors == 0
    finally:
        close(d)


@pytest.mark.parametrize("local", [False, True])
def test_a_client_that_asks_a_batch_at_a_time_and_hands_each_back_is_never_cut(source, local):
    """Two messages a batch (a Request, and for a co-located client a Release), a new Hello and a
    Bye each epoch, for 30 epochs of 16 batches on the least allowance that lets it go on (3: the
    last batch's Release, the next Hello and its first Request) and no time at all: what it is
    sent pays for what it sends."""
    d = _state(source, allowance=3, workers=1)
    try:
        ident = uuid.uuid4().bytes
        for epoch in range(30):
            deliver(d, ident, P.Hello(stream=epoch + 1, spec=SPEC, slots=2, window=1, epoch=epoch, local=local),
                    fd=30)
            s = d.sessions.get(ident).stream
            assert isinstance(s, Stream)
            for b in range(16):
                deliver(d, ident, P.Request(stream=s.id, batches=[b], final=b == 15), fd=30)
                d.tick()
                d.finish(0)
                d.let_go()
                if local:
                    deliver(d, ident, P.Release(stream=s.id, batches=[b]), fd=30)
            d.tick()
            assert [m for i, m in d.sent if i == ident and isinstance(m, P.EndOfEpoch)][-1].epoch == epoch
        deliver(d, ident, P.Bye(), fd=30)
        assert d.cut == [] and d.totals.flooded_messages == 0 and len([1 for i, _ in d.batches if i == ident]) == 480
    finally:
        close(d)


def test_what_a_cut_client_left_unread_costs_the_next_client_on_its_fd_number_nothing(source):
    """libzmq hands over what a connection sent before it closed, with its old fd number, also
    once that number is another client's: those messages are dropped, not charged or answered,
    and cannot take the new client's session (a Hello among them before did: 'connection replaced')."""
    d = _state(source, allowance=20)
    try:
        flooder, renamed, nxt = uuid.uuid4().bytes, b"\0\x00\x00\x00\x07", uuid.uuid4().bytes
        for _ in range(21):
            deliver(d, flooder, GARBAGE, fd=30)
        assert d.cut == [30]
        d.read_monitor()  # the disconnect libzmq reports once the cut connection is closed
        d.event(zmq.EVENT_ACCEPTED, 30)  # the next connection gets fd number 30
        deliver(d, nxt, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=30)
        serial = d.sessions.serial(30)
        units, told = d.state.flood.units(30, serial, d.now), len(d.sent)
        for _ in range(50):  # the rest: under its identity, or the one libzmq renames a pipe to on handover
            for ident in (flooder, renamed):
                deliver(d, ident, GARBAGE, fd=30)
                deliver(d, ident, P.Hello(stream=9, spec=SPEC, slots=2, batches=[0]), fd=30)
        assert len(d.sent) == told and d.totals.stale_messages == 200 and d.cut == [30]
        assert d.state.flood.units(30, serial, d.now) == units
        assert d.sessions.owner(30) == nxt and d.sessions.get(nxt).stream is not None
        assert renamed not in d.sessions and d.totals.internal_errors == 0
    finally:
        close(d)

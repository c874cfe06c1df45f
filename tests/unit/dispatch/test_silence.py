"""Silent and stranded connections (loader_service/dispatch/silence.py): the rule on its own, then
through the real dispatch state (testkit/dispatcher.py), where a Probe is answered with the
quiet times the test sets, and a model with random interleavings of every event checked against
a recount from each connection's history."""

from __future__ import annotations

import logging
import math
import uuid
from typing import Dict

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from wire import protocol as P
from wire.errors import ProtocolError
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig
from loader_service.dispatch import events as E
from loader_service.dispatch.silence import CUTS_PER_ROUND, SILENT_AFTER, STRANDED_AFTER_S, SilenceWatch
from loader_service.dispatch.state import CUTS_LOGGED, refused_log
from testkit.dispatcher import close, deliver, loopless

SPEC = JobSpec(batch_size=8, image_size=16, seed=1)


# ------------------------------------------------------------------ the rule alone
def test_the_limit_is_three_of_the_clients_heartbeats_and_never_less_than_three_of_the_services():
    w = SilenceWatch(every_s=0.5, max_per_address=0)
    assert SILENT_AFTER == 3
    assert w.limit(2.0) == 6.0 and w.limit(30.0) == 90.0
    assert w.limit(0.1) == 1.5  # a client that pings faster is still given 3 of the service's


def test_a_connection_is_cut_once_and_a_new_one_on_its_fd_number_is_its_own():
    w = SilenceWatch(every_s=1.0, max_per_address=0)
    assert not w.silent(5, 1, 5.9, 6.0, now=0.0, address="a")
    assert w.silent(5, 1, 6.0, 6.0, now=0.0, address="a")
    assert not w.silent(5, 1, 60.0, 6.0, now=1.0, address="a") and w.is_cut(5, 1)
    assert w.silent(5, 2, 6.0, 6.0, now=1.0, address="a")  # a later connection on fd 5, its report missed
    w.forget(5)
    assert not w.is_cut(5, 2) and w.next_strand_at() is None


def test_a_cut_connection_never_reported_gone_is_stranded_and_its_address_refused_at_the_cap():
    w = SilenceWatch(every_s=1.0, max_per_address=3)
    for fd, t in ((5, 0.0), (6, 0.5), (7, 1.0), (8, 1.0)):
        w.silent(fd, 1, math.inf, 6.0, now=t, address="10.0.0.9" if fd != 8 else "10.0.0.7")
    assert w.next_strand_at() == STRANDED_AFTER_S
    assert w.strand(STRANDED_AFTER_S - 0.01) == [] and w.stranded == 0
    assert w.strand(STRANDED_AFTER_S + 0.5) == [] and w.stranded == 2  # fds 5 and 6
    w.forget(6)  # closed after all (late): no longer counted
    assert w.stranded == 1 and w.next_strand_at() == 1.0 + STRANDED_AFTER_S
    assert w.strand(10.0) == [] and w.stranded == 3  # 10.0.0.9 has 2 (5, 7), 10.0.0.7 one
    w.silent(9, 1, math.inf, 6.0, now=10.0, address="10.0.0.9")
    assert w.strand(20.0) == ["10.0.0.9"] and w.denied == {"10.0.0.9": 3}
    w.silent(10, 1, math.inf, 6.0, now=20.0, address="10.0.0.9")
    assert w.strand(30.0) == []  # refused once


def test_a_stranded_connection_reported_gone_late_no_longer_counts_towards_its_addresss_cap():
    w = SilenceWatch(every_s=1.0, max_per_address=2)
    w.silent(5, 1, 9.0, 6.0, now=0.0, address="10.0.0.9")
    assert w.strand(10.0) == [] and w.stranded == 1
    w.forget(5)
    w.silent(6, 1, 9.0, 6.0, now=10.0, address="10.0.0.9")
    assert w.strand(20.0) == [] and w.stranded == 1  # one at a time: never two
    w.silent(7, 1, 9.0, 6.0, now=20.0, address="10.0.0.9")
    assert w.strand(30.0) == ["10.0.0.9"]


def test_connections_found_past_their_limit_wait_in_look_order_and_are_taken_so_many_at_a_time():
    w = SilenceWatch(every_s=2.0, max_per_address=0, cuts_per_round=2)
    w.found(5, 1, 5.9, 6.0, "a")  # not past its limit
    w.found(6, 1, 6.0, 6.0, "a")
    w.found(7, 3, math.inf, 6.0, "b")
    w.found(8, 1, 7.0, 6.0, "c")
    assert w.silent(8, 1, 7.0, 6.0, now=0.0, address="c")
    w.found(8, 1, 9.0, 6.0, "c")  # cut already: not found again
    assert w.waiting == 3 and w.to_cut() == [(6, 1, 6.0, 0.0, 6.0, "a"), (7, 3, math.inf, 0.0, 6.0, "b")]
    assert w.to_cut() == [(8, 1, 7.0, 0.0, 6.0, "c")] and w.waiting == 0 and w.to_cut() == []


def test_no_cap_refuses_nobody_and_an_unknown_address_is_never_refused():
    w = SilenceWatch(every_s=1.0, max_per_address=0)
    for fd in range(10):
        w.silent(fd, 1, 9.0, 6.0, now=0.0, address="10.0.0.9")
    assert w.strand(10.0) == [] and w.stranded == 10
    w = SilenceWatch(every_s=1.0, max_per_address=1)
    w.silent(1, 1, 9.0, 6.0, now=0.0, address="")
    assert w.strand(10.0) == [] and w.stranded == 1


# ------------------------------------------------------------------ through the dispatch state
@pytest.fixture(scope="module")
def source():
    from loader_service.sources.demo import ensure_demo

    src = ensure_demo(64, quiet=True)
    yield src
    src.close()


def _state(source, heartbeat: float = 0.5, max_stranded: int = 32):
    return loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0,
                                  heartbeat_s=heartbeat, max_stranded_per_address=max_stranded), source, workers=1)


def _probe(d, quiet: Dict[int, float], after: float) -> None:
    """``after`` seconds on, the shell's next round: each connection reads as quiet for ``quiet[fd]``."""
    d.now += after
    d.quiet.update(quiet)
    d.tick()


def test_probes_run_every_heartbeat_while_a_connection_is_open_and_never_without_one(source):
    d = _state(source, heartbeat=0.5)
    try:
        assert d.state.next_deadline(d.now) is None
        d.tick()
        assert d.probes == 0
        deliver(d, uuid.uuid4().bytes, P.Describe(), fd=30)
        d.tick()
        assert d.probes == 1 and d.state.next_deadline(d.now) == pytest.approx(d.now + 0.5)
        _probe(d, {}, after=0.4)
        assert d.probes == 1
        _probe(d, {}, after=0.1)
        assert d.probes == 2
        d.event(zmq.EVENT_DISCONNECTED, 30)
        d.read_monitor()
        _probe(d, {}, after=5.0)
        assert d.probes == 2 and d.state.next_deadline(d.now) is None
    finally:
        close(d)


@pytest.mark.parametrize("heartbeat, client_heartbeat, limit", [(0.5, None, 6.0), (0.5, 30.0, 90.0), (5.0, None, 15.0),
                                                               (0.5, 0.2, 1.5)])
def test_a_session_is_cut_and_dropped_past_three_of_its_clients_heartbeats(source, heartbeat, client_heartbeat, limit):
    d = _state(source, heartbeat=heartbeat)
    try:
        ident, other = uuid.uuid4().bytes, uuid.uuid4().bytes
        extra = {} if client_heartbeat is None else {"heartbeat": client_heartbeat}
        deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0], **extra), fd=30)
        deliver(d, other, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=31)
        _probe(d, {30: limit - 0.01, 31: 0.0}, after=heartbeat)
        assert d.cut == [] and ident in d.sessions
        _probe(d, {30: limit}, after=heartbeat)
        assert d.cut == [30] and ident not in d.sessions and other in d.sessions
        assert (d.totals.silent_cut, d.state.silence.stranded) == (1, 0)  # the shell's cut closed it
        assert d.memory.waiting.get(ident) is None and d.totals.internal_errors == 0
    finally:
        close(d)


def test_a_connection_that_never_said_hello_is_cut_past_three_default_heartbeats(source):
    d = _state(source, heartbeat=0.1)
    try:
        deliver(d, uuid.uuid4().bytes, P.Describe(), fd=30)
        _probe(d, {30: 3 * P.DEFAULT_HEARTBEAT_S - 0.01}, after=0.1)
        assert d.cut == []
        _probe(d, {30: 3 * P.DEFAULT_HEARTBEAT_S}, after=0.1)
        d.read_monitor()
        assert d.cut == [30] and d.sessions.connections == 0
    finally:
        close(d)


def test_a_connection_its_peer_closed_is_cut_at_the_next_probe_whatever_its_limit(source):
    d = _state(source, heartbeat=0.5)
    try:
        ident = uuid.uuid4().bytes
        deliver(d, ident, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0], heartbeat=600.0), fd=30)
        _probe(d, {30: math.inf}, after=0.5)
        assert d.cut == [30] and ident not in d.sessions
    finally:
        close(d)


def test_a_reading_of_a_connection_gone_since_the_probe_touches_the_next_one_on_its_fd_number(source):
    d = _state(source, heartbeat=0.5)
    try:
        first, second = uuid.uuid4().bytes, uuid.uuid4().bytes
        deliver(d, first, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=30)
        serial = d.sessions.serial(30)
        d.event(zmq.EVENT_DISCONNECTED, 30)
        d.event(zmq.EVENT_ACCEPTED, 30)
        d.read_monitor()
        deliver(d, second, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=30)
        d.handle(E.Quiet(((30, serial, 100.0, "10.0.0.1", ()),)))  # read for the first connection
        assert d.cut == [] and second in d.sessions
    finally:
        close(d)


def test_a_cut_connection_libzmq_never_closes_is_stranded_and_its_address_refused_once(source):
    d = _state(source, heartbeat=0.5, max_stranded=2)
    try:
        d.stranding.update({30, 31, 32})
        for fd in (30, 31, 32):
            deliver(d, uuid.uuid4().bytes, P.Describe(), fd=fd)
        _probe(d, {30: math.inf, 31: math.inf}, after=0.5)
        assert sorted(d.cut) == [30, 31] and d.sessions.connections == 3
        _probe(d, {}, after=STRANDED_AFTER_S - 0.1)
        assert d.state.silence.stranded == 0 and d.denied == []
        _probe(d, {}, after=0.1)
        assert d.state.silence.stranded == 2 and d.denied == ["10.0.0.1"] and d.totals.denied_addresses == 1
        probed = d.probes
        _probe(d, {32: math.inf}, after=0.5)
        assert d.probes == probed + 1 and sorted(d.cut) == [30, 31, 32]  # the stranded ones are not probed again
        _probe(d, {}, after=STRANDED_AFTER_S)
        assert d.state.silence.stranded == 3 and d.denied == ["10.0.0.1"]
    finally:
        close(d)


def test_a_storm_of_silent_connections_is_cut_so_many_a_round_and_logged_in_a_few_lines(source, caplog, monkeypatch):
    """10,000 silent connections cut in one round held /healthz and every client for a second
    (bench.flood, docs/benchmarks.md 18); now a round cuts CUTS_PER_ROUND and the next comes at once.
    What the state writes is counted without the rate limit a service in this process may have
    put on its logger (``http_limits.limit_logs``)."""
    monkeypatch.setattr(refused_log, "filters", [])
    d = _state(source, heartbeat=0.5)
    n = 2 * CUTS_PER_ROUND + 88
    try:
        fds = list(range(100, 100 + n))
        for fd in fds:
            deliver(d, uuid.uuid4().bytes, P.Hello(stream=1, spec=SPEC, slots=1, batches=[0]), fd=fd)
        busy = uuid.uuid4().bytes
        deliver(d, busy, P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=50)
        d.read_monitor()
        d.event(zmq.EVENT_DISCONNECTED, fds[-1])  # gone before its turn: not cut
        with caplog.at_level(logging.INFO, logger="loader_service.dispatch"):
            _probe(d, {fd: 10.0 for fd in fds}, after=0.5)
            rounds = [len(d.cut)]
            while d.state.next_deadline(d.now) == d.now:
                d.read_monitor()
                d.tick()
                rounds.append(len(d.cut) - sum(rounds))
        assert rounds == [CUTS_PER_ROUND, CUTS_PER_ROUND, 87] and sorted(d.cut) == fds[:-1]
        assert d.totals.silent_cut == n - 1 and [s.ident for s in d.sessions] == [busy]
        lines = [r.getMessage() for r in caplog.records if r.name == "loader_service.dispatch.refused"]
        assert len(lines) == CUTS_LOGGED + 1
        assert all(line.startswith("cut the connection of client") for line in lines[:-1])
        assert lines[-1] == (f"cut {n - 1 - CUTS_LOGGED} more silent or unread connections, not logged one by one "
                             f"({n - 1} and 0 in all since the service started: silent_cut and unread_cut in "
                             f"/v1/status)")
        dropped = [r.getMessage() for r in caplog.records if r.name == "loader_service.dispatch.loop"
                   and " was cut: " in r.getMessage()]
        assert len(dropped) == CUTS_LOGGED  # the sessions' own lines, as few
        assert d.state.next_deadline(d.now) == pytest.approx(d.state.silence.next_at)  # back to a look a heartbeat
    finally:
        close(d)


def test_a_hello_says_its_heartbeat_only_when_not_the_default_and_a_bad_one_is_refused():
    plain = msgpack.unpackb(P.encode(P.Hello(stream=1, spec=SPEC))[0])
    assert "heartbeat" not in plain  # what a service without the field reads
    assert msgpack.unpackb(P.encode(P.Hello(stream=1, spec=SPEC, heartbeat=0.5))[0])["heartbeat"] == 0.5
    for bad in (0.0, -1.0, P.MAX_HEARTBEAT_S + 1):
        with pytest.raises(ProtocolError, match="Hello.heartbeat must be in"):
            P.Hello(stream=1, spec=SPEC, heartbeat=bad).check()


# ------------------------------------------------------------------ the model
class SilenceModel(RuleBasedStateMachine):
    """Connections on four fd numbers open, say Hello (with a heartbeat of their own or not),
    go quiet, have their peer close them, disconnect, reconnect on a reused number, or are
    stranded (libzmq never closes them once cut); the clock moves; probes run. Every cut is
    checked against a recount of the connection's history: cut exactly when a probe found it
    past its limit, once; its session gone with it; stranded exactly when cut
    ``STRANDED_AFTER_S`` ago and never reported gone; an address refused once, when its
    stranded connections reach the cap. With ``SHARE`` set, a round cuts at most that many of
    what a look found (:class:`SpreadSilenceModel`): each cut is then one a look found on that
    very connection, and none is left uncut once the state has nothing waiting."""

    HEARTBEAT, CAP, FDS = 0.5, 2, (30, 31, 32, 33)
    SHARE = 0  # cuts a round (0: the service's, more than FDS)

    def __init__(self):
        super().__init__()
        from loader_service.sources.demo import ensure_demo

        self.src = ensure_demo(64, quiet=True)
        self.d = _state(self.src, heartbeat=self.HEARTBEAT, max_stranded=self.CAP)
        self.d.address = "10.0.0.1"
        if self.SHARE:
            self.d.state.silence.cuts_per_round = self.SHARE
        self.ident: Dict[int, bytes] = {}  # fd -> the identity on its open connection
        self.gen: Dict[int, int] = {}  # fd -> how many connections it has had (the open one's number)
        self.found: Dict[int, int] = {}  # fd -> the connection a look found silent there, not cut yet
        self.heartbeat: Dict[int, float] = {}  # fd -> its Hello's heartbeat (default before one)
        self.cut_at: Dict[int, float] = {}  # fd -> when its open connection was cut
        self.refused = False  # the address has had CAP stranded connections at once
        self.streams = 0

    def teardown(self):
        close(self.d)
        self.src.close()

    @rule(fd=st.sampled_from(FDS), stranding=st.sampled_from([True, True, False]))
    def connect(self, fd, stranding):
        if fd in self.ident:
            return
        self.ident[fd] = uuid.uuid4().bytes
        self.gen[fd] = self.gen.get(fd, 0) + 1
        self.heartbeat[fd] = P.DEFAULT_HEARTBEAT_S
        (self.d.stranding.add if stranding else self.d.stranding.discard)(fd)
        self.d.quiet[fd] = 0.0
        self.d.event(zmq.EVENT_ACCEPTED, fd)
        deliver(self.d, self.ident[fd], P.Describe(), fd=fd, report=False)

    @rule(fd=st.sampled_from(FDS), heartbeat=st.sampled_from([None, 0.2, 1.0, 5.0]))
    def hello(self, fd, heartbeat):
        if fd not in self.ident or fd in self.cut_at:
            return
        extra = {} if heartbeat is None else {"heartbeat": heartbeat}
        self.streams += 1
        deliver(self.d, self.ident[fd], P.Hello(stream=self.streams, spec=SPEC, slots=2, **extra), fd=fd)
        self.heartbeat[fd] = heartbeat or P.DEFAULT_HEARTBEAT_S

    @rule(fd=st.sampled_from(FDS), quiet=st.sampled_from([0.0, 1.4, 1.5, 5.9, 6.0, 14.9, 15.0, math.inf, math.inf]))
    def goes_quiet(self, fd, quiet):
        if fd in self.ident:
            self.d.quiet[fd] = quiet

    @rule(fd=st.sampled_from(FDS), late=st.sampled_from([False, False, False, True]))
    def disconnect(self, fd, late):
        """The connection ends; a stranded one's report comes only ``late`` (libzmq never sends it)."""
        if fd not in self.ident or fd in self.cut_at and not late:
            return
        self.d.event(zmq.EVENT_DISCONNECTED, fd)
        self.d.read_monitor()
        self._gone(fd)

    def _gone(self, fd):
        del self.ident[fd]
        self.cut_at.pop(fd, None)
        self.found.pop(fd, None)

    @rule(dt=st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0, 5.0]))
    def time_passes(self, dt):
        before = dict(self.ident)
        limits = {fd: 3 * max(self.HEARTBEAT, self.heartbeat[fd]) for fd in before}
        quiet = {fd: self.d.quiet.get(fd, 0.0) for fd in before}
        probes = self.d.probes
        cuts = len(self.d.cut)
        waiting = self.d.state.silence.waiting
        self.d.now += dt
        self.d.tick()
        self.d.read_monitor()  # the disconnects of the connections the shell cut
        probed = self.d.probes > probes
        new_cuts = self.d.cut[cuts:]
        silent = sorted(fd for fd in before if probed and fd not in self.cut_at and quiet[fd] >= limits[fd])
        if not self.SHARE:
            assert sorted(new_cuts) == silent, (new_cuts, silent, quiet, limits)
        self.found.update((fd, self.gen[fd]) for fd in silent)
        if not probed:  # a round with no look takes its share of what the last ones found
            assert self.d.state.silence.waiting == max(0, waiting - (self.SHARE or 256))
        assert len(new_cuts) <= (self.SHARE or len(self.FDS)) and len(set(new_cuts)) == len(new_cuts)
        for fd in new_cuts:
            assert self.found.pop(fd) == self.gen[fd], (fd, new_cuts)  # found by a look, on this very connection
        for fd in new_cuts:
            assert self.ident[fd] not in self.d.sessions
            if fd in self.d.stranding:
                self.cut_at[fd] = self.d.now
            else:
                self._gone(fd)  # the shell's cut closed it; the monitor said so
        self.refused |= sum(now_s - t >= STRANDED_AFTER_S for t in self.cut_at.values()) >= self.CAP if (
            now_s := self.d.now) else False

    @invariant()
    def stranded_and_refused_as_recounted(self):
        now = self.d.now
        stranded = [fd for fd, t in self.cut_at.items() if now - t >= STRANDED_AFTER_S]
        assert self.d.state.silence.stranded == len(stranded)
        assert self.d.denied == (["10.0.0.1"] if self.refused else [])
        assert self.d.sessions.connections == len(self.ident)
        for fd in self.cut_at:
            assert self.ident[fd] not in self.d.sessions
        assert self.d.totals.internal_errors == 0
        if self.found:  # found silent and not cut yet: the next round comes at once and cuts more
            assert self.d.state.silence.waiting and self.d.state.next_deadline(self.d.now) == self.d.now


TestSilenceModel = SilenceModel.TestCase
TestSilenceModel.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


class SpreadSilenceModel(SilenceModel):
    SHARE = 1


TestSpreadSilenceModel = SpreadSilenceModel.TestCase
TestSpreadSilenceModel.settings = TestSilenceModel.settings

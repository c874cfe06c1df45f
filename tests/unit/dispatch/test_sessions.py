"""Sessions: the client table by identity, and which client a connection's fd belongs to.

The dispatcher uses it so: ``accepted(fd)`` / ``disconnected(fd)`` on monitor events (for one
fd strictly alternately), dropping (``pop``) the identity ``disconnected`` names; a message
over an fd with no open connection once the monitor is read opens it early (``open_early``);
on a client's first Hello ``add`` then ``bind`` to the message's fd; on a message from a known
client over another fd, ``bind`` again; every identity ``bind`` or ``unreported`` reports is
dropped.
``tests/e2e/test_connections.py`` drives the dispatcher through the racy event orders; here the
table is checked on its own.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loader_service.dispatch.sessions import Session, Sessions
from wire.jobspec import JobSpec

X, Y = b"\x01" * 16, b"\x02" * 16


def connected(table: Sessions, ident: bytes, fd: int) -> Session:
    """A new connection on ``fd`` and its first Hello, as the dispatcher handles them."""
    table.accepted(fd)
    s = table.add(ident)
    assert table.bind(s, fd) == []
    return s


# ------------------------------------------------------------------ by identity

def test_an_added_session_is_found_by_its_identity():
    table = Sessions()
    s = table.add(X)
    assert table.get(X) is s and X in table and len(table) == 1
    assert s.ident == X


def test_an_unknown_identity_is_not_found():
    table = Sessions()
    table.add(X)
    assert table.get(Y) is None and Y not in table


def test_a_new_session_has_no_connection_stream_or_counts_yet():
    s = Sessions().add(X)
    assert (s.fd, s.fd_gen, s.stream, s.stream_id, s.rank, s.spec, s.batches, s.samples) == \
        (-1, 0, None, -1, -1, None, 0, 0)


def test_a_popped_session_is_returned_once_and_never_found_again():
    table = Sessions()
    s = table.add(X)
    table.add(Y)
    assert table.pop(X) is s
    assert table.get(X) is None and X not in table and len(table) == 1
    assert table.pop(X) is None


def test_iterating_gives_every_session_and_tolerates_dropping_them_meanwhile():
    table = Sessions()
    a, b = table.add(X), table.add(Y)
    seen = []
    for s in table:  # the dispatcher ends streams, which may drop clients, while it iterates
        seen.append(s)
        table.pop(s.ident)
    assert seen == [a, b] and len(table) == 0


def test_a_sessions_name_is_the_first_twelve_hex_digits_of_its_identity():
    assert Sessions().add(bytes(range(16))).name == "000102030405"


# ------------------------------------------------------------------ by connection

def test_binding_records_the_fd_and_how_many_connections_that_fd_has_had():
    table = Sessions()
    table.accepted(7)
    table.disconnected(7)
    table.accepted(7)
    s = table.add(X)
    assert table.bind(s, 7) == []
    assert (s.fd, s.fd_gen) == (7, 2)
    assert table.fd_owners() == {7: X}


def test_a_disconnect_names_the_session_bound_to_that_fd_and_unbinds_it():
    table = Sessions()
    connected(table, X, 5)
    connected(table, Y, 6)
    assert table.disconnected(5) == X
    assert table.fd_owners() == {6: Y}
    assert X in table  # the caller drops it


def test_a_disconnect_on_an_fd_no_session_is_bound_to_names_nobody():
    table = Sessions()
    connected(table, X, 5)
    table.accepted(9)  # e.g. a connection that never said Hello
    assert table.disconnected(9) is None
    assert table.fd_owners() == {5: X}


def test_a_late_disconnect_after_the_owner_said_bye_names_nobody_and_the_next_client_on_that_fd_is_kept():
    table = Sessions()
    connected(table, X, 5)
    table.pop(X)  # Bye
    assert table.fd_owners() == {}
    assert table.disconnected(5) is None  # the old connection's report, read late
    connected(table, Y, 5)  # the kernel gave the new connection the same number
    assert table.get(Y).fd_gen == 2
    assert table.disconnected(5) == Y  # and its own disconnect still names it


def test_a_session_that_moves_to_another_connection_no_longer_owns_its_old_fd():
    table = Sessions()
    s = connected(table, X, 5)
    table.accepted(8)
    assert table.bind(s, 8) == []
    assert (s.fd, s.fd_gen) == (8, 2) and table.fd_owners() == {8: X}  # the second connection accepted
    assert table.disconnected(5) is None  # the old connection going is not this client leaving
    assert table.disconnected(8) == X


def test_binding_a_session_to_the_fd_another_one_holds_reports_that_one_as_replaced():
    table = Sessions()
    connected(table, X, 5)
    y = table.add(Y)
    assert table.bind(y, 5) == [X]
    assert table.fd_owners() == {5: Y}


def test_dropping_a_replaced_session_leaves_the_new_owner_of_its_fd_bound():
    table = Sessions()
    x = connected(table, X, 5)
    y = table.add(Y)
    table.bind(y, 5)
    assert table.pop(X) is x  # x.fd is still 5, but the fd is no longer its
    assert table.fd_owners() == {5: Y}
    assert table.disconnected(5) == Y


def test_binding_a_session_again_to_its_own_fd_replaces_nobody():
    table = Sessions()
    s = connected(table, X, 5)
    assert table.bind(s, 5) == []
    assert table.fd_owners() == {5: X} and s.fd_gen == 1


def test_dropping_a_bound_session_frees_its_fd():
    table = Sessions()
    connected(table, X, 5)
    table.pop(X)
    assert table.fd_owners() == {}
    assert table.disconnected(5) is None


def test_fd_owners_is_a_copy():
    table = Sessions()
    connected(table, X, 5)
    table.fd_owners().clear()
    assert table.fd_owners() == {5: X}


# ------------------------------------------------------------------ gone connections, pending ones, indexes

def test_binding_to_an_fd_with_no_open_connection_is_refused():
    table = Sessions()
    table.accepted(5)
    table.disconnected(5)
    assert not table.is_open(5)
    with pytest.raises(ValueError, match="no open connection"):
        table.bind(table.add(X), 5)


def test_a_connection_opened_early_is_confirmed_by_its_late_accept_keeping_its_session():
    table = Sessions()
    table.open_early(5, due=10.0)  # its Hello was read before the monitor reported its accept
    s = table.add(X)
    assert table.bind(s, 5) == [] and table.is_early(5) and table.next_early_due() == 10.0
    table.accepted(5)
    assert not table.is_early(5) and table.early == 0 and table.next_early_due() is None
    assert (s.fd_gen, table.connections, table.pending) == (1, 1, 0)
    assert table.unreported(now=99.0) == []
    assert table.disconnected(5) == X  # its own disconnect still names it


def test_a_connection_opened_early_whose_accept_never_comes_is_closed_at_its_deadline():
    table = Sessions()
    table.accepted(5)
    table.disconnected(5)  # gone; then its queued Hello is read
    table.open_early(5, due=10.0)
    table.bind(table.add(X), 5)
    table.open_early(6, due=11.0)  # a Describe, say: nobody binds
    assert table.unreported(now=9.9) == []
    assert table.unreported(now=10.0) == [X] and table.is_open(6) and not table.is_open(5)
    assert table.unreported(now=11.0) == [] and (table.connections, table.pending, table.early) == (0, 0, 0)


def test_a_connection_is_pending_until_a_session_binds_to_it_and_again_once_that_session_goes():
    table = Sessions()
    table.accepted(5)
    table.accepted(6)
    assert (table.connections, table.pending, table.oldest_pending(1)) == (2, 2, [5])
    table.bind(table.add(X), 5)
    assert table.pending == 1 and table.oldest_pending(5) == [6]
    table.pop(X)
    assert table.pending == 2
    table.disconnected(5)
    table.disconnected(6)
    assert (table.connections, table.pending) == (0, 0)


def test_a_popped_session_leaves_every_index():
    table = Sessions()
    table.accepted(5)
    s = table.add(X)
    table.bind(s, 5)
    s.job = "j"
    table.hold(s, JobSpec(batch_size=4))
    table.serve(s, stream := object())
    assert table.of_job("j") == [s] and table.streams() == [stream]
    assert table.pop(X) is s
    assert table.of_job("j") == [] and table.streams() == []
    assert s.stream is stream  # the caller retires it


# ------------------------------------------------------------------ the dispatcher's events in any order

FDS = st.integers(3, 6)  # few numbers, so that they are reused often
JOBS = st.sampled_from(["a", "b"])


@settings(max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
class TableModel(RuleBasedStateMachine):
    """The table's bookkeeping on its own, against a model of who is connected on which fd
    (:class:`SessionsModel` below drives it through queued, racy event orders).

    The monitor reports accept and disconnect alternately per fd; a client's message comes over
    a connection that is open; identities the table reports (replaced, disconnected) are
    dropped at once, as the dispatcher does; a dropped identity may come back (a DEALER that
    reconnects keeps its identity). After every step: every live identity is found and no
    dropped one is; the fd owners are exactly the model's; each session's generation is the
    serial of the connection it bound to."""

    def __init__(self) -> None:
        super().__init__()
        self.table = Sessions()
        self.open: dict[int, bytes | None] = {}  # fd of an open connection -> who spoke on it
        self.serial: dict[int, int] = {}  # fd -> the serial of the connection open on it (one count for all fds)
        self.accepted_so_far = 0
        self.live: dict[bytes, int] = {}  # identity -> serial of the connection it bound to
        self.gone: set[bytes] = set()
        self.made = 0

    def _forget(self, ident: bytes) -> None:
        del self.live[ident]
        self.gone.add(ident)
        for fd, who in self.open.items():
            if who == ident:
                self.open[fd] = None

    def _bind(self, s: Session, fd: int) -> None:
        prev = self.open[fd]
        replaced = self.table.bind(s, fd)
        assert replaced == ([prev] if prev is not None and prev != s.ident else [])
        for ident in replaced:
            assert self.table.pop(ident) is not None
            self._forget(ident)
        for other, who in self.open.items():
            if who == s.ident:
                self.open[other] = None
        self.open[fd] = s.ident
        self.live[s.ident] = self.serial[fd]

    @rule(fd=FDS)
    def accept(self, fd):
        if fd in self.open:
            return  # the monitor never reports two accepts on one fd without a disconnect between
        self.table.accepted(fd)
        self.accepted_so_far += 1
        self.serial[fd] = self.accepted_so_far
        self.open[fd] = None

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def hello_from_a_new_client(self, data):
        self.made += 1
        ident = self.made.to_bytes(16, "big")
        self._bind(self.table.add(ident), data.draw(st.sampled_from(sorted(self.open))))

    @precondition(lambda self: self.open and self.gone)
    @rule(data=st.data())
    def hello_from_a_client_that_was_dropped_and_came_back(self, data):
        ident = data.draw(st.sampled_from(sorted(self.gone)))
        self.gone.discard(ident)
        self._bind(self.table.add(ident), data.draw(st.sampled_from(sorted(self.open))))

    @precondition(lambda self: self.open and self.live)
    @rule(data=st.data())
    def message_from_a_known_client(self, data):
        s = self.table.get(data.draw(st.sampled_from(sorted(self.live))))
        fd = data.draw(st.sampled_from(sorted(self.open)))
        if s.fd != fd:
            self._bind(s, fd)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def bye(self, data):
        ident = data.draw(st.sampled_from(sorted(self.live)))
        s = self.table.get(ident)
        assert self.table.pop(ident) is s
        self._forget(ident)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def disconnect(self, data):
        fd = data.draw(st.sampled_from(sorted(self.open)))
        who = self.open.pop(fd)
        assert self.table.disconnected(fd) == who
        if who is not None:
            assert self.table.pop(who) is not None
            self._forget(who)

    @invariant()
    def every_live_session_is_found_by_its_identity(self):
        for ident, gen in self.live.items():
            s = self.table.get(ident)
            assert s is not None and s.ident == ident and ident in self.table
            assert s.fd_gen == gen
        assert len(self.table) == len(self.live)
        assert {s.ident for s in self.table} == set(self.live)

    @invariant()
    def no_dropped_session_is_found(self):
        for ident in self.gone:
            assert self.table.get(ident) is None and ident not in self.table

    @invariant()
    def fd_owners_are_the_clients_last_heard_on_each_open_connection(self):
        owners = self.table.fd_owners()
        assert owners == {fd: who for fd, who in self.open.items() if who is not None}
        assert all(self.table.get(who).fd == fd for fd, who in owners.items())


TestTableModel = TableModel.TestCase


@settings(max_examples=400, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
class SessionsModel(RuleBasedStateMachine):
    """The table driven as the dispatcher drives it, against the truth of which connections are
    open, with the monitor's events and each connection's messages queued apart and read in any
    interleaving (issue 32: the disconnect may be read before that connection's Hello; with
    several I/O threads libzmq may report a connection's accept after its first messages).

    The driver: monitor events as they are read (a disconnect drops the session it names); a
    message from an unknown identity or over another fd first reads the monitor to the end,
    then opens its fd early if it has no open connection; a Hello opens a session and is
    answered, and an answer to an identity whose connection is gone fails (ROUTER_MANDATORY),
    which drops it; a session may hold a rank of a job and a stream. Heartbeat deadlines close
    silent connections (a disconnect like any other). A connection's accept is reported at
    once or later, but before its disconnect and within the grace; when the grace runs out the
    monitor is read and connections opened early and still unreported are closed. After every
    step: every session has a connection that is open, or whose disconnect is still queued, or
    one opened early whose grace runs; the indexes equal a walk of the sessions; once every
    queue is read and the grace has run out, the sessions are exactly the open connections that
    said Hello, and the table's connections exactly the open ones."""

    def __init__(self) -> None:
        super().__init__()
        self.table = Sessions()
        self.truth: dict[int, list] = {}  # fd -> [ident, connection number] of the connection open on it
        self.monitor: list = []  # queued events: (kind, fd, connection number)
        self.messages: list = []  # queued messages: (ident, fd, connection number, is_hello)
        self.conn = 0
        self.closed_fds: set[int] = set(range(3, 7))  # fd numbers free, as the kernel sees them
        self.hello_read: set[bytes] = set()
        self.displaced: set[bytes] = set()  # live identities a stale message displaced (see _displace)
        self.unreported: dict[int, int] = {}  # fd -> connection number whose accept is not queued yet
        self.clock = 0.0

    def _alive(self, ident: bytes) -> bool:
        return any(who == ident for who, _ in self.truth.values())

    def _drop(self, ident: bytes) -> None:
        self.table.pop(ident)

    def _displace(self, ident: bytes) -> None:
        """``bind`` reported ``ident`` replaced: its fd number now speaks for another identity. A
        live one is displaced only by a stale message of an earlier connection on that fd number,
        read after the fd was reused (the table cannot tell the two connections apart); its client
        is told unknown_client at its next message and says Hello again."""
        if self._alive(ident):
            self.displaced.add(ident)
        self._drop(ident)

    def _read_monitor_event(self) -> None:
        kind, fd, _ = self.monitor.pop(0)
        if kind == "accept":
            self.table.accepted(fd)
        else:
            ident = self.table.disconnected(fd)
            if ident is not None:
                self._drop(ident)

    @rule(data=st.data(), reported_late=st.booleans())
    def connect(self, data, reported_late):
        free = sorted(self.closed_fds)
        if not free:
            return
        fd = data.draw(st.sampled_from(free))
        self.closed_fds.discard(fd)
        self.conn += 1
        self.truth[fd] = [uuid_like(self.conn), self.conn]
        if reported_late:  # the listener's thread posts the accept after the connection is handed on
            self.unreported[fd] = self.conn
        else:
            self.monitor.append(("accept", fd, self.conn))

    @precondition(lambda self: self.unreported)
    @rule(data=st.data())
    def report_accept(self, data):
        fd = data.draw(st.sampled_from(sorted(self.unreported)))
        self.monitor.append(("accept", fd, self.unreported.pop(fd)))

    @precondition(lambda self: not self.unreported)  # every accept is reported within the grace
    @rule()
    def grace_runs_out(self):
        self.clock += ACCEPT_GRACE + 1
        while self.monitor:
            self._read_monitor_event()
        for ident in self.table.unreported(self.clock):
            self._drop(ident)

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def client_sends_hello(self, data):
        fd = data.draw(st.sampled_from(sorted(self.truth)))
        ident, conn = self.truth[fd]
        self.messages.append((ident, fd, conn, True))

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def client_sends_credit(self, data):
        fd = data.draw(st.sampled_from(sorted(self.truth)))
        ident, conn = self.truth[fd]
        self.messages.append((ident, fd, conn, False))

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), heartbeat=st.booleans())
    def disconnect(self, data, heartbeat):
        """The client leaves, is killed, or goes silent past the heartbeat deadline (``heartbeat``):
        zmq closes the connection either way; its queued messages stay readable."""
        fd = data.draw(st.sampled_from(sorted(self.truth)))
        _, conn = self.truth.pop(fd)
        if fd in self.unreported:
            self.monitor.append(("accept", fd, self.unreported.pop(fd)))
        self.monitor.append(("disconnect", fd, conn))
        self.closed_fds.add(fd)

    @precondition(lambda self: self.monitor)
    @rule()
    def read_monitor(self):
        self._read_monitor_event()

    @precondition(lambda self: self.messages)
    @rule(data=st.data(), job=JOBS)
    def read_message(self, data, job):
        ident, fd, conn, hello = self.messages.pop(data.draw(st.integers(0, len(self.messages) - 1)))
        if hello:
            self.hello_read.add(ident)  # whatever the driver makes of it: a live connection's Hello opens a session
        s = self.table.get(ident)
        if s is None or s.fd != fd:
            while self.monitor:
                self._read_monitor_event()
            if not self.table.is_open(fd):
                self.table.open_early(fd, self.clock + ACCEPT_GRACE)  # reported late, or gone
            s = self.table.get(ident)
            if s is not None and s.fd != fd:
                for other in self.table.bind(s, fd):
                    self._displace(other)
        if not hello:
            return
        if s is None:
            s = self.table.add(ident)
            for other in self.table.bind(s, fd):
                self._displace(other)
        s.job = job
        self.table.hold(s, JobSpec(batch_size=4))
        self.table.serve(s, ("stream", ident))
        if not self._alive(ident):  # the Accept cannot be routed: ROUTER_MANDATORY says so
            self._drop(ident)
        else:
            self.displaced.discard(ident)  # displaced earlier, its client's Hello (again) has its session back

    @precondition(lambda self: self.table.streams())
    @rule(data=st.data())
    def stream_ends(self, data):
        ident = data.draw(st.sampled_from(sorted(x[1] for x in self.table.streams())))
        self.table.serve(self.table.get(ident), None)

    @invariant()
    def every_session_has_an_open_connection_or_a_disconnect_still_queued(self):
        queued = {fd for kind, fd, _ in self.monitor if kind == "disconnect"}
        for s in self.table:
            assert self._alive(s.ident) or s.fd in queued, f"session {s.name} outlived its connection"

    @invariant()
    def a_live_connection_whose_hello_was_read_has_its_session(self):
        """At once, however late its accept is reported (dropping it hung the client for good)."""
        for ident, _ in self.truth.values():
            if ident in self.hello_read and ident not in self.displaced:
                assert self.table.get(ident) is not None, f"the Hello of live connection {ident.hex()} opened nothing"

    @invariant()
    def the_indexes_equal_a_walk_of_the_sessions(self):
        walk_streams = sorted(s.stream for s in self.table if s.stream is not None)
        assert sorted(self.table.streams()) == walk_streams
        for job in ("a", "b"):
            assert {x.ident for x in self.table.of_job(job)} == \
                {s.ident for s in self.table if s.spec is not None and s.job == job}
        # the table's open connections once the monitor is read: the open ones it was told of
        # (an accept not reported yet is there only if a message opened it early), and those
        # opened early on a message from a connection already gone, until the grace runs out
        early = {fd for fd in range(3, 7) if self.table.is_early(fd)}
        open_fds = {fd for fd in self.truth if fd not in self.unreported} | early
        if not self.monitor:
            assert self.table.connections == len(open_fds)
            assert self.table.pending == len(open_fds - set(self.table.fd_owners()))

    @invariant()
    def once_everything_is_read_the_sessions_are_the_open_connections_that_said_hello(self):
        if self.monitor or self.messages or self.unreported or self.table.early:
            return
        for s in self.table:
            assert self._alive(s.ident)
        said_hello = {ident for ident, _ in self.truth.values() if ident in self.hello_read} - self.displaced
        assert {s.ident for s in self.table} == said_hello


ACCEPT_GRACE = 10.0


def uuid_like(n: int) -> bytes:
    return n.to_bytes(16, "big")


TestSessionsModel = SessionsModel.TestCase


class _Drawn:
    """Stands for hypothesis' ``data`` in a replayed run: hands out the values given, in order."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


def test_a_client_displaced_by_a_stale_hello_and_saying_hello_again_has_its_session():
    """Found by the model in CI (stop 36): a Hello of a gone connection on fd 4, read after fd 4
    was reused, displaces the live client there; that client's next Hello must bring its session
    back, and the model must count it as having one (the model's bookkeeping kept it displaced)."""
    m = SessionsModel()

    def check():
        m.a_live_connection_whose_hello_was_read_has_its_session()
        m.every_session_has_an_open_connection_or_a_disconnect_still_queued()
        m.once_everything_is_read_the_sessions_are_the_open_connections_that_said_hello()
        m.the_indexes_equal_a_walk_of_the_sessions()

    steps = [
        lambda: m.connect(_Drawn(4), False), lambda: m.grace_runs_out(),
        *[lambda: m.client_sends_hello(_Drawn(4))] * 3,  # three Hellos of connection 1, queued
        lambda: m.disconnect(_Drawn(4), False),  # connection 1 goes; its Hellos stay queued
        lambda: m.connect(_Drawn(3), False), lambda: m.connect(_Drawn(4), False),  # fd 4 reused by connection 3
        lambda: m.connect(_Drawn(5), True), lambda: m.read_message(_Drawn(0), "a"),
        lambda: m.connect(_Drawn(6), True), lambda: m.read_message(_Drawn(0), "a"),
        lambda: m.report_accept(_Drawn(5)), lambda: m.report_accept(_Drawn(6)),
        lambda: m.client_sends_hello(_Drawn(4)), lambda: m.client_sends_hello(_Drawn(4)),  # connection 3's
        lambda: m.read_message(_Drawn(1), "a"),  # connection 3's first Hello: its session
        lambda: m.read_message(_Drawn(0), "a"),  # connection 1's last Hello, stale: displaces it
        lambda: m.read_message(_Drawn(0), "a"),  # connection 3's Hello again: its session is back
    ]
    check()
    for step in steps:
        step()
        check()
    live = m.truth[4][0]
    assert m.table.get(live) is not None and m.table.get(live).fd == 4
    assert live not in m.displaced

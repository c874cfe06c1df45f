"""The service's bulk lanes (loader_service.dispatch.lanes) on real sockets: a lane set against a
model under random interleavings of sends, peers that close a lane, and closes with or without
linger (every batch's ``done`` runs exactly once; what a peer reads is each batch's header and
stripe, in order, whole up to where its lane failed); the listener's hostile cases."""

import contextlib
import socket
import threading
import time

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from loader_service.dispatch.lanes import LaneListener, LaneSet
from wire import protocol as P


def _reader(sock: socket.socket, into: bytearray) -> threading.Thread:
    def run():
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            into.extend(data)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class LaneSetModel(RuleBasedStateMachine):
    """Sends of random batches over 1-3 lanes; a peer may close a lane at any point."""

    def __init__(self):
        super().__init__()
        self.count = 2
        self.set = LaneSet(b"\x07" * 16, self.count, 7)
        self.peers, self.got, self.readers = [], [], []
        for lane in range(self.count):
            ours, theirs = socket.socketpair()
            self.set.add(lane, ours)
            self.peers.append(theirs)
            self.got.append(bytearray())
            self.readers.append(_reader(theirs, self.got[-1]))
        self.sent = []  # (stream, index, the batch's bytes) in send order
        self.done = []
        self.lock = threading.Lock()
        self.peer_closed = set()
        self.closed = False

    @precondition(lambda self: not self.closed)
    @rule(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=3))
    def send(self, sizes):
        k = len(self.sent)
        data = bytes((i * 7 + k) % 256 for i in range(sum(sizes)))
        blocks, at = [], 0
        for n in sizes:
            blocks.append(memoryview(data)[at:at + n])
            at += n
        self.sent.append((1, k, data))
        self.set.send(1, k, blocks, lambda: self._done(k))

    def _done(self, k):
        with self.lock:
            self.done.append(k)

    @precondition(lambda self: not self.closed)
    @rule(lane=st.integers(0, 1))
    def peer_closes_a_lane(self, lane):
        if lane not in self.peer_closed:
            self.peer_closed.add(lane)
            self.peers[lane].shutdown(socket.SHUT_RDWR)

    @rule(linger=st.sampled_from([0.0, 5.0]))
    def close(self, linger):
        if self.closed:  # idempotent: nothing runs twice
            done = list(self.done)
            self.set.close(linger_s=linger)
            assert self.done == done
            return
        self.set.close(linger_s=linger)
        self.closed = True
        self._check(whole=linger > 0 and not self.peer_closed)

    def teardown(self):
        if not self.closed:
            self.set.close(linger_s=5.0)
            self._check(whole=not self.peer_closed)
        for p in self.peers:
            p.close()

    def _check(self, whole: bool):
        for t in self.readers:
            t.join(10)
        assert sorted(self.done) == list(range(len(self.sent)))  # every batch's done, once
        assert not self.set.ready
        for lane in range(self.count):
            expect = b"".join(P.lane_piece(s, k, len(d)) + d[slice(*P.lane_stripe(len(d), lane, self.count))]
                              for s, k, d in self.sent)
            got = bytes(self.got[lane])
            if whole:
                assert got == expect
            else:  # what came is what was sent, up to where the lane failed
                assert expect.startswith(got)


TestLaneSet = LaneSetModel.TestCase
TestLaneSet.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)


@pytest.fixture
def listener():
    adopted = []
    ln = LaneListener("127.0.0.1", 0, lambda *a: adopted.append(a), max_pending=2, hello_s=0.5)
    ln.adopted = adopted
    yield ln
    ln.close()
    for *_, sock in adopted:
        sock.close()


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_lane_that_says_who_it_is_is_handed_on_whole(listener):
    ident = bytes(range(16))
    with socket.create_connection(("127.0.0.1", listener.port)) as s:
        hello = P.lane_hello(ident, 1, 2, 99)
        s.sendall(hello[:5])  # in pieces, as TCP may deliver it
        s.sendall(hello[5:])
        deadline = time.monotonic() + 10
        while not listener.adopted and time.monotonic() < deadline:
            time.sleep(0.01)
        (got_ident, lane, lanes, lane_set, sock), = listener.adopted
        assert (got_ident, lane, lanes, lane_set) == (ident, 1, 2, 99)
        sock.sendall(b"data")  # the lane is a plain blocking socket now
        assert s.recv(4) == b"data"


@pytest.mark.parametrize("first", [b"", P.LANE_MAGIC, b"GET / HTTP/1.1\r\n\r\n" + b"x" * 10,
                                   P.lane_hello(b"\0" * 16, 2, 2, 1), P.lane_hello(b"\0" * 16, 0, P.MAX_LANES + 1, 1)])
def test_a_lane_that_says_nothing_or_something_else_is_closed(listener, first):
    with socket.create_connection(("127.0.0.1", listener.port)) as s:
        if first:
            s.sendall(first)
        assert _closed_by_peer(s)
    assert listener.adopted == []


def test_past_max_pending_a_lane_is_closed_as_it_comes_and_the_listener_goes_on():
    adopted = []
    ln = LaneListener("127.0.0.1", 0, lambda *a: adopted.append(a), max_pending=2, hello_s=30)
    quiet = [socket.create_connection(("127.0.0.1", ln.port)) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", ln.port)) as third:  # accepted after them: no room
            assert _closed_by_peer(third)
        for s in quiet:  # still waiting for their hello (30 s)
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        quiet[0].close()  # one leaves: room for a lane again, once the listener has seen it go
        deadline, tries = time.monotonic() + 10, 0
        while not adopted and time.monotonic() < deadline:
            tries += 1
            with socket.create_connection(("127.0.0.1", ln.port)) as s:
                s.settimeout(0.05)
                try:
                    s.sendall(P.lane_hello(b"\x01" * 16, 0, 1, 5))
                    while not adopted and time.monotonic() < deadline:
                        with contextlib.suppress(socket.timeout):
                            if s.recv(1) == b"":
                                break  # accepted in the same round as quiet[0]'s close, before it: no room yet
                except (BrokenPipeError, ConnectionResetError):
                    pass
        assert [a[:4] for a in adopted] == [(b"\x01" * 16, 0, 1, 5)], f"{tries} tries"
    finally:
        for s in quiet:
            s.close()
        ln.close()
        for *_, sock in adopted:
            sock.close()


def test_close_is_idempotent_and_stops_the_thread():
    ln = LaneListener("127.0.0.1", 0, lambda *a: None)
    ln.close()
    ln.close()
    assert not ln._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", ln.port), timeout=1).close()

"""The bulk lanes' assembly (client.lanes.Assembly) against a model, under random interleavings
of every event: stripes begun and delivered by any lane in any order, takes, stale streams
forgotten, hostile pieces; and the lane framing (wire.protocol) with hostile bytes."""

import socket
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from client.lanes import Assembly, Lanes, LanesLost
from wire import protocol as P

LANES, MAX_BYTES, MAX_BATCHES = 3, 64, 4


def _payload(stream: int, index: int, total: int) -> np.ndarray:
    return ((np.arange(total) * 7 + stream * 31 + index * 13) % 251).astype(np.uint8)


class AssemblyModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = Assembly(LANES, MAX_BYTES, MAX_BATCHES, keep=2)
        self.begun = {}  # (stream, index) -> (total, lanes begun, lanes delivered)
        self.failed = False
        self.taken = []  # buffers handed out, kept (a trainer holding batches)

    def _expect_lost(self, fn, *args):
        with pytest.raises(LanesLost):
            fn(*args)
        self.failed = True

    @rule(stream=st.integers(0, 2), index=st.integers(0, 5), lane=st.integers(0, LANES - 1),
          total=st.sampled_from([3, 17, 64]))
    def begin_and_deliver(self, stream, index, lane, total):
        key = (stream, index)
        entry = self.begun.get(key)
        ok = not self.failed and (entry is None and len(self.begun) < MAX_BATCHES
                                  or entry is not None and entry[0] == total and lane not in entry[1])
        if not ok:
            self._expect_lost(self.a.begin, lane, stream, index, total)
            return
        into = self.a.begin(lane, stream, index, total)
        start, end = P.lane_stripe(total, lane, LANES)
        assert into.nbytes == end - start
        into[:] = _payload(stream, index, total)[start:end]
        self.a.delivered(lane, stream, index)
        if entry is None:
            entry = self.begun[key] = (total, set(), set())
        entry[1].add(lane)
        entry[2].add(lane)

    @rule(total=st.integers(MAX_BYTES + 1, 1 << 40) | st.just(0))
    def begin_too_large_or_empty(self, total):
        self._expect_lost(self.a.begin, 0, 0, 0, total)

    @precondition(lambda self: not self.failed and any(len(e[2]) == LANES for e in self.begun.values()))
    @rule(data=st.data())
    def take_complete(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, e in self.begun.items() if len(e[2]) == LANES)))
        total = self.begun.pop(key)[0]
        buf = self.a.take(key[0], key[1], total, timeout=5)
        assert bytes(buf) == bytes(_payload(key[0], key[1], total))
        if len(self.taken) < 3:
            self.taken.append((buf, bytes(buf)))

    @precondition(lambda self: not self.failed)
    @rule(stream=st.integers(0, 2), index=st.integers(0, 5))
    def take_incomplete_times_out(self, stream, index):
        e = self.begun.get((stream, index))
        if e is not None and len(e[2]) == LANES:
            return
        self._expect_lost(self.a.take, stream, index, e[0] if e else 1, 0.0)

    @rule(before=st.integers(0, 3))
    def forget(self, before):
        self.a.forget(before)
        self.begun = {k: v for k, v in self.begun.items() if k[0] >= before}

    @rule()
    def fail(self):
        self._expect_lost(self.a.fail, "a lane was cut")

    @invariant()
    def kept_batches_keep_their_bytes(self):
        for buf, data in self.taken:
            assert bytes(buf) == data  # a buffer the trainer holds is never reused under it

    @invariant()
    def failed_is_sticky(self):
        assert bool(self.a.failed) == self.failed


TestAssembly = AssemblyModel.TestCase
TestAssembly.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_take_waits_for_the_last_lane_and_a_failure_wakes_it():
    a = Assembly(2, 100, 4, keep=2)
    a.begin(0, 1, 0, 10)[:] = 1
    a.delivered(0, 1, 0)
    got = []
    t = threading.Thread(target=lambda: got.append(a.take(1, 0, 10, timeout=30)))
    t.start()
    a.begin(1, 1, 0, 10)[:] = 2
    a.delivered(1, 1, 0)
    t.join(30)
    assert bytes(got[0]) == b"\x01" * 5 + b"\x02" * 5
    errors = []

    def waiter():
        try:
            a.take(1, 1, 10, timeout=30)
        except LanesLost as exc:
            errors.append(exc.why)

    t = threading.Thread(target=waiter)
    t.start()
    with pytest.raises(LanesLost):
        a.fail("lane 1 was closed by the service")
    t.join(30)
    assert errors == ["lane 1 was closed by the service"]


@given(total=st.integers(0, 1 << 40), lanes=st.integers(1, P.MAX_LANES))
def test_the_stripes_cover_a_batch_once(total, lanes):
    stripes = [P.lane_stripe(total, k, lanes) for k in range(lanes)]
    assert stripes[0][0] == 0 and stripes[-1][1] == total
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(stripes, stripes[1:]))


@given(data=st.binary(max_size=40))
def test_a_lane_hello_is_its_exact_bytes_or_refused(data):
    try:
        ident, lane, lanes, lane_set = P.parse_lane_hello(data)
    except P.ProtocolError:
        return
    assert len(data) == P.LANE_HELLO.size and data[:4] == P.LANE_MAGIC and 0 <= lane < lanes <= P.MAX_LANES
    assert P.lane_hello(ident, lane, lanes, lane_set) == data


def test_a_batch_on_lanes_takes_the_labels_frame_alone():
    msg = P.Batch(stream=1, epoch=0, index=0, indices=[0, 1], shape=[2, 4, 4, 3], lanes=2)
    assert msg.data_frames() == 1
    P.check_data_sizes(msg, [16])
    with pytest.raises(P.ProtocolError):
        P.check_data_sizes(msg, [96, 16])
    frames = P.encode(msg, b"\0" * 16)
    assert P.decode(frames)[0] == msg
    for bad in (dict(lanes=P.MAX_LANES + 1), dict(lanes=-1), dict(lanes=1, local=["seg", [[0, 96]]])):
        with pytest.raises(P.ProtocolError):
            P.decode([P.encode_header(P.Batch(stream=1, epoch=0, index=0, indices=[0, 1], shape=[2, 4, 4, 3],
                                              **bad)), b"\0" * 16])


class _FakeService:
    """A lane port on loopback that accepts ``lanes`` lanes, reads their hellos, and lets a test
    write what it likes on each."""

    def __init__(self, lanes: int):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port, self.lanes, self.conns = self.server.getsockname()[1], lanes, {}

    def accept(self, ident: bytes) -> None:
        for _ in range(self.lanes):
            conn, _ = self.server.accept()
            conn.settimeout(10)
            got_ident, lane, lanes, _ = P.parse_lane_hello(conn.recv(P.LANE_HELLO.size, socket.MSG_WAITALL))
            assert (got_ident, lanes) == (ident, self.lanes)
            self.conns[lane] = conn

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        self.server.close()


def _stripe(data: bytes, lane: int, lanes: int) -> bytes:
    return data[slice(*P.lane_stripe(len(data), lane, lanes))]


@pytest.mark.parametrize("hostile", ["wrong_magic", "too_large", "twice", "cut_mid_batch"])
def test_lanes_from_a_hostile_service_fail_and_free_their_waiter(hostile):
    svc = _FakeService(2)
    ident = b"\x05" * 16
    result = {}

    def connect():
        result["lanes"] = Lanes("127.0.0.1", svc.port, ident, 2, max_bytes=1000, max_batches=4, keep=2)

    t = threading.Thread(target=connect)
    t.start()
    svc.accept(ident)
    t.join(10)
    lanes = result["lanes"]
    try:
        good = bytes(range(100))
        for lane, c in svc.conns.items():  # one good batch first
            c.sendall(P.lane_piece(1, 0, len(good)) + _stripe(good, lane, 2))
        assert bytes(lanes.take(1, 0, len(good), timeout=10)) == good
        c = svc.conns[0]
        if hostile == "wrong_magic":
            c.sendall(b"XXXX" + P.lane_piece(1, 1, 10)[4:])
        elif hostile == "too_large":
            c.sendall(P.lane_piece(1, 1, 1001))
        elif hostile == "twice":
            c.sendall(P.lane_piece(1, 1, 10) + _stripe(b"a" * 10, 0, 2) + P.lane_piece(1, 1, 10))
        else:
            c.sendall(P.lane_piece(1, 1, 100) + b"x" * 7)
            c.shutdown(socket.SHUT_RDWR)
        with pytest.raises(LanesLost) as err:
            lanes.take(1, 1, 10 if hostile != "cut_mid_batch" else 100, timeout=10)
        assert {"wrong_magic": "not b'RLL1'", "too_large": "at most 1000", "twice": "twice",
                "cut_mid_batch": "in the middle of batch 1"}[hostile] in err.value.why
        assert lanes.failed == err.value.why
    finally:
        lanes.close()
        lanes.close()  # idempotent
        svc.close()
    assert not any(t.is_alive() for t in lanes._threads)


def test_lanes_that_cannot_connect_raise_and_leave_nothing_open():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        Lanes("127.0.0.1", port, b"\0" * 16, 2, max_bytes=100, max_batches=2, keep=2, connect_s=2)

"""The dispatcher driven by hand: which client a disconnect belongs to, and a stream that waits
for the slots of one that is ending.

The dispatcher learns of disconnects from a socket monitor that names the connection by its fd,
and of messages from the ROUTER, each tagged with its connection's fd (SRCFD). A client that
leaves and a new one that arrives at once get the same fd number, and the new one's Hello can
be read before the monitor's report of the old one's disconnect. Here the dispatcher is driven
by hand, with monitor events fed in that exact order: the disconnect must not drop the new client.
"""

from __future__ import annotations

import struct
import uuid

import pytest
import zmq

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig
from loader_service.dispatch.dispatcher import Dispatcher

FD = 17  # any number: these connections only exist in the events fed to the dispatcher


class _Frame:
    """What the dispatcher reads of a received zmq.Frame: its bytes and its connection's fd."""

    def __init__(self, data: bytes, fd: int):
        self.bytes, self.buffer, self._fd = data, memoryview(data), fd

    def get(self, option: int) -> int:
        assert option == zmq.SRCFD
        return self._fd


@pytest.fixture
def dispatcher(demo_source):
    d = _loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0), demo_source)
    yield d
    d.feed.close(0)
    d.close()


def _loopless(config: ServiceConfig, source) -> Dispatcher:
    """A dispatcher driven by hand (no loop, no workers), its monitor events fed by ``d.event``."""
    d = Dispatcher(config, {"demo": source})
    d.front.disable_monitor()
    d.monitor.close(0)
    feed = d.ctx.socket(zmq.PAIR)
    feed.bind("inproc://fake-monitor")
    d.monitor = d.ctx.socket(zmq.PAIR)
    d.monitor.connect("inproc://fake-monitor")

    def event(kind: int, fd: int = FD) -> None:
        feed.send_multipart([struct.pack("=hi", kind, fd), b"tcp://127.0.0.1:1"])

    d.event, d.feed = event, feed
    d.sent = []  # (client, message) of every message the dispatcher sent
    d._send = lambda ident, msg: d.sent.append((ident, msg))
    return d


def _sent_to(d: Dispatcher, ident: bytes) -> list:
    return [type(m).__name__ + (f":{m.code}" if isinstance(m, P.Error) else "") for i, m in d.sent if i == ident]


def _send(d: Dispatcher, ident: bytes, msg: P.Message, fd: int = FD) -> None:
    d._on_client([_Frame(ident, fd)] + [_Frame(f, fd) for f in P.encode(msg)])


def _hello(stream: int = 1) -> P.Hello:
    return P.Hello(stream=stream, spec=JobSpec(batch_size=4, image_size=32), prefetch=2)


def test_disconnect_of_an_earlier_connection_on_the_same_fd_keeps_the_new_client(dispatcher):
    d = dispatcher
    old, new = uuid.uuid4().bytes, uuid.uuid4().bytes
    d.event(zmq.EVENT_ACCEPTED)
    _send(d, old, _hello())
    assert d.sessions.get(old).stream is not None
    _send(d, old, P.Bye())
    assert old not in d.sessions
    # the I/O thread reports the old connection gone and the new one (same fd) accepted, but the
    # new client's Hello is handled before the loop gets round to reading the monitor
    d.event(zmq.EVENT_DISCONNECTED)
    d.event(zmq.EVENT_ACCEPTED)
    _send(d, new, _hello())
    d._read_all(d.monitor, d._on_monitor)
    assert new in d.sessions and d.sessions.get(new).stream is not None, "the new client was dropped"
    # its own disconnect still drops it
    d.event(zmq.EVENT_DISCONNECTED)
    d._read_all(d.monitor, d._on_monitor)
    assert new not in d.sessions and d.sessions.fd_owners() == {}


def test_a_vanished_client_is_dropped_when_its_fd_number_is_reused(dispatcher):
    d = dispatcher
    old, new = uuid.uuid4().bytes, uuid.uuid4().bytes
    d.event(zmq.EVENT_ACCEPTED)
    _send(d, old, _hello())
    old_stream = d.sessions.get(old).stream
    # no Bye: the old connection just goes, and a new one takes its fd number
    d.event(zmq.EVENT_DISCONNECTED)
    d.event(zmq.EVENT_ACCEPTED)
    _send(d, new, _hello())
    assert old not in d.sessions
    assert {c.ident for c in d.sessions} == {new} and d.sessions.fd_owners() == {FD: new}
    assert old_stream.state.done and not d.sessions.get(new).stream.state.done


@pytest.fixture
def tight_dispatcher(demo_source):
    """Room for one stream of ``_big_hello`` (2 x 3 MiB of slots), not two."""
    d = _loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0, max_shm_mb=10),
                  demo_source)
    yield d
    d.feed.close(0)
    d.close()


def _big_hello(stream: int = 1, **kw) -> P.Hello:
    return P.Hello(stream=stream, spec=JobSpec(batch_size=64, image_size=128), prefetch=2, **kw)


def test_a_stream_waits_for_the_slots_of_a_stream_that_is_still_ending(tight_dispatcher):
    """A client that has just left still has a task reading its slots; a new job that fits once
    that task is done waits for it instead of being refused (the race CI once lost)."""
    d = tight_dispatcher
    first, second = uuid.uuid4().bytes, uuid.uuid4().bytes
    _send(d, first, _big_hello(), fd=21)
    ending = d.sessions.get(first).stream
    assert ending.state.next_task(0) is not None  # a worker is busy on its first batch
    _send(d, first, P.Bye(), fd=21)
    assert d.retiring == [ending]  # gone, but its slots are still read by the task

    _send(d, second, _big_hello(on_demand=True, batches=[0]), fd=22)
    _send(d, second, P.Request(stream=1, batches=[1, 2], final=True), fd=22)
    assert d.sessions.get(second).stream is None
    assert second in d.waiting and _sent_to(d, second) == []  # no Accept yet, and no refusal

    d._apply(ending, ending.state.task_done(0, [], "", ""))
    d._release_idle_streams()
    s = d.sessions.get(second).stream
    assert s is not None and second not in d.waiting
    assert _sent_to(d, second) == ["Accept"]
    assert d.arena.in_use() == s.segment.size  # the ending stream's memory went back first
    assert s.state.dispatchable()
    assert [s.state.next_task(i).batch for i in range(2)] == [0, 1]  # the Request sent while waiting counts


def test_a_stream_that_cannot_fit_even_after_the_ending_ones_is_refused_at_once(tight_dispatcher):
    d = tight_dispatcher
    first, second = uuid.uuid4().bytes, uuid.uuid4().bytes
    _send(d, first, _big_hello(), fd=21)
    assert d.sessions.get(first).stream.state.next_task(0) is not None
    _send(d, first, _big_hello(stream=2), fd=21)  # its next epoch, while a task reads the old slots
    assert d.sessions.get(first).stream is None and first in d.waiting  # its own old slots: it waits

    _send(d, second, P.Hello(stream=1, spec=JobSpec(batch_size=64, image_size=128), prefetch=4), fd=22)  # 12 MiB > 10
    assert d.sessions.get(second).stream is None and second not in d.waiting
    refusal = [m for i, m in d.sent if i == second]
    assert len(refusal) == 1 and refusal[0].code == P.ErrorCode.NO_CAPACITY and refusal[0].fatal
    assert "this job needs 12.0 MiB of batch slots" in refusal[0].message

    d._apply(ending := d.retiring[0], ending.state.task_done(0, [], "", ""))
    d._release_idle_streams()  # the first client's old slots come back: its next epoch opens on them
    assert d.sessions.get(first).stream is not None and _sent_to(d, first) == ["Accept", "Accept"]

"""Which client a disconnect belongs to, when the kernel reuses a file-descriptor number.

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

from loader_service import protocol as P
from loader_service.config import ServiceConfig
from loader_service.dispatcher import Dispatcher

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
    d = Dispatcher(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0),
                   {"demo": demo_source})
    d.front.disable_monitor()
    d.monitor.close(0)
    feed = d.ctx.socket(zmq.PAIR)
    feed.bind("inproc://fake-monitor")
    d.monitor = d.ctx.socket(zmq.PAIR)
    d.monitor.connect("inproc://fake-monitor")

    def event(kind: int, fd: int = FD) -> None:
        feed.send_multipart([struct.pack("=hi", kind, fd), b"tcp://127.0.0.1:1"])

    d.event = event
    yield d
    feed.close(0)
    d.close()


def _send(d: Dispatcher, ident: bytes, msg: P.Message) -> None:
    d._on_client([_Frame(ident, FD)] + [_Frame(f, FD) for f in P.encode(msg)])


def _hello(stream: int = 1) -> P.Hello:
    return P.Hello(stream=stream, batch_size=4, image_size=32, prefetch=2)


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

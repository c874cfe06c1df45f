"""A dispatcher driven by hand: no loop, no workers, its monitor events fed in by the test and
the messages it sends recorded (``d.sent``), so a test sees exactly what each client is told."""

from __future__ import annotations

import struct
from typing import List, Union

import zmq

from wire import protocol as P
from loader_service.config import ServiceConfig
from loader_service.dispatch.loop import Dispatcher

FD = 17  # any number: these connections only exist in the events fed to the dispatcher


class Frame:
    """What the dispatcher reads of a received zmq.Frame: its bytes and its connection's fd."""

    def __init__(self, data: bytes, fd: int):
        self.bytes, self.buffer, self._fd = data, memoryview(data), fd

    def get(self, option: int) -> int:
        assert option == zmq.SRCFD
        return self._fd


def loopless(config: ServiceConfig, source) -> Dispatcher:
    """A dispatcher serving ``source`` as "demo"; ``d.event(kind, fd)`` feeds a monitor event,
    ``d.sent`` lists (ident, message) of everything it sent. Close with :func:`close`."""
    d = Dispatcher(config, {"demo": source})
    d.front.disable_monitor()
    d.monitor.close(0)
    feed = d.ctx.socket(zmq.PAIR)
    feed.bind("inproc://fake-monitor")
    d.monitor = d.ctx.socket(zmq.PAIR)
    d.monitor.connect("inproc://fake-monitor")

    def event(kind: int, fd: int = FD) -> None:
        d.fds_seen.add(fd)
        feed.send_multipart([struct.pack("=hi", kind, fd), b"tcp://127.0.0.1:1"])

    d.event, d.feed, d.fds_seen = event, feed, set()
    d.sent = []
    d._send = lambda ident, msg: d.sent.append((ident, msg))
    return d


def close(d: Dispatcher) -> None:
    d.feed.close(0)
    d.close()


def deliver(d: Dispatcher, ident: bytes, msg: Union[P.Message, List[bytes]], fd: int = FD,
            report: bool = True) -> None:
    """``msg`` (a message, or frames already made: any bytes at all) from the client at ``ident``
    on connection ``fd``, as the ROUTER hands it over. The first use of an fd no event named yet
    reports its connection accepted first, unless not ``report`` (libzmq may report an accept
    after the connection's first messages)."""
    if report and fd not in d.fds_seen:
        d.event(zmq.EVENT_ACCEPTED, fd)
    frames = msg if isinstance(msg, list) else P.encode(msg)
    d._on_client([Frame(ident, fd)] + [Frame(f, fd) for f in frames])


def sent_to(d: Dispatcher, ident: bytes) -> list:
    """What ``ident`` was sent, as message type names (errors with their code)."""
    return [type(m).__name__ + (f":{m.code}" if isinstance(m, P.Error) else "") for i, m in d.sent if i == ident]

"""A replica's bulk lanes (wire.protocol, "Bulk lanes"): plain TCP connections beside its ZeroMQ
connection, on which its service sends the batches' outputs, each lane a stripe of every batch.

One thread per lane reads a piece header, then ``recv_into`` the batch's host buffer at its
stripe (the GIL is released while the kernel copies), so the bytes land where the trainer
reads them, once. What the service says is checked before anything is allocated: a batch is at
most ``max_bytes``, at most ``max_batches`` are in flight on the lanes at once, each lane
delivers each batch once. The Batch message still comes on the ZeroMQ connection;
:meth:`Lanes.take` waits (up to a deadline) until every lane has delivered that batch's stripe.

A lane that fails (the service stopped, a cut, a peer that broke these rules) fails the whole
set: :meth:`take` raises :class:`LanesLost` at once, and the loader asks for what it misses on a
new stream, which opens a new set (client.epoch), so no batch is lost or doubled.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
import traceback
from typing import Dict, List, Tuple

import numpy as np

from wire import protocol as P

from client.buffers import HostBuffers
from client.errors import LoaderError

JOIN_S = 5.0  # how long close() waits for a reader


class LanesLost(LoaderError):
    """The lanes failed: the batches they still owed must be asked for again. ``stale``: not a
    failure of the lanes this connection has, but a batch sent on a set it already let go of."""

    def __init__(self, why: str, stale: bool = False):
        super().__init__(P.ErrorCode.INTERNAL, f"bulk lanes lost: {why}")
        self.why, self.stale = why, stale


class _Entry:
    """A batch arriving on the lanes: its buffer and the lanes that still owe their stripe."""

    __slots__ = ("buf", "total", "owed")

    def __init__(self, buf: np.ndarray, total: int, lanes: int):
        self.buf, self.total, self.owed = buf, total, set(range(lanes))


class Assembly:
    """The batches arriving on ``lanes`` lanes (thread-safe; no sockets: what the readers and
    the loader's thread share). ``max_bytes``: the largest batch; ``max_batches``: batches begun
    and not yet taken at once; ``keep``: buffers kept for reuse per size, ``pinned``: page-locked
    ones (:class:`HostBuffers`)."""

    def __init__(self, lanes: int, max_bytes: int, max_batches: int, keep: int, pinned: bool = False):
        self.lanes, self.max_bytes, self.max_batches = lanes, max_bytes, max_batches
        self._cond = threading.Condition()
        self._entries: Dict[Tuple[int, int], _Entry] = {}
        self._buffers = HostBuffers(keep, pinned)  # used under the condition's lock only
        self.failed = ""  # why the lanes failed ("" while they are fine)

    @property
    def pinned(self) -> bool:
        """Whether the batches' buffers are page-locked (asked for, and this torch can)."""
        return self._buffers.pinned

    def begin(self, lane: int, stream: int, index: int, total: int) -> np.ndarray:
        """Lane ``lane`` starts its stripe of batch (``stream``, ``index``) of ``total`` bytes:
        the slice of the batch's buffer to receive it into. Raises LanesLost if that breaks the rules."""
        if not 0 < total <= self.max_bytes:
            self.fail(f"a batch of {total} bytes on the lanes (at most {self.max_bytes})")
        with self._cond:
            if self.failed:
                raise LanesLost(self.failed)
            e = self._entries.get((stream, index))
            if e is None:
                if len(self._entries) >= self.max_batches:
                    self._fail(f"more than {self.max_batches} batches in flight on the lanes")
                e = self._entries[(stream, index)] = _Entry(self._buffers.take(total), total, self.lanes)
            if e.total != total or lane not in e.owed:
                self._fail(f"lane {lane} sent batch {index} of stream {stream} twice, or with another size")
            start, end = P.lane_stripe(total, lane, self.lanes)
            return e.buf[start:end]

    def delivered(self, lane: int, stream: int, index: int) -> None:
        """Lane ``lane`` received its stripe of that batch."""
        with self._cond:
            e = self._entries.get((stream, index))
            if e is not None:
                e.owed.discard(lane)
                if not e.owed:
                    self._cond.notify_all()

    def take(self, stream: int, index: int, total: int, timeout: float) -> np.ndarray:
        """The batch's ``total`` bytes once every lane delivered them; raises LanesLost if the
        lanes failed or the deadline passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                e = self._entries.get((stream, index))
                if self.failed:
                    raise LanesLost(self.failed)
                if e is not None and not e.owed:
                    del self._entries[(stream, index)]
                    if e.total != total:
                        self._fail(f"batch {index} has {e.total} bytes on the lanes, its message says {total}")
                    return e.buf
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(f"batch {index}'s bytes did not arrive on the lanes within {timeout:g}s")
                self._cond.wait(left)

    def forget(self, before: int) -> None:
        """Drop what arrived for streams before ``before`` (a new stream replaced them)."""
        with self._cond:
            for key in [k for k in self._entries if k[0] < before]:
                del self._entries[key]

    def fail(self, why: str) -> None:
        with self._cond:
            self._fail(why)

    def _fail(self, why: str) -> None:
        self.failed = self.failed or why
        self._cond.notify_all()
        raise LanesLost(self.failed)


class Lanes:
    """``count`` lanes to ``host``:``port`` for the ZeroMQ connection with routing id
    ``identity``, each read by a thread into an :class:`Assembly` (``keep``: buffers kept for
    reuse, per batch size; ``pinned``: page-locked ones, for a GPU's copy engine). Connecting
    blocks up to ``connect_s``; raises OSError if a lane cannot be opened (the loader goes on
    without)."""

    def __init__(self, host: str, port: int, identity: bytes, count: int, max_bytes: int, max_batches: int,
                 keep: int, pinned: bool = False, connect_s: float = P.LANE_HELLO_S):
        self.count = count
        self.number = secrets.randbits(32)  # this set's (Batch.lane_set); another set of this connection has another
        self.assembly = Assembly(count, max_bytes, max_batches, keep, pinned)
        self._socks: List[socket.socket] = []
        self._threads: List[threading.Thread] = []
        self._closed = False
        try:
            for lane in range(count):
                sock = socket.create_connection((host, port), timeout=connect_s)
                self._socks.append(sock)
                sock.sendall(P.lane_hello(identity, lane, count, self.number))
                sock.settimeout(None)
        except BaseException:
            self.close()
            raise
        for lane, sock in enumerate(self._socks):
            t = threading.Thread(target=self._reader, args=(lane, sock), name=f"lane-{lane}", daemon=True)
            self._threads.append(t)
            t.start()

    @property
    def failed(self) -> str:
        return self.assembly.failed

    @property
    def pinned(self) -> bool:
        return self.assembly.pinned

    def take(self, stream: int, index: int, total: int, timeout: float) -> np.ndarray:
        return self.assembly.take(stream, index, total, timeout)

    def _reader(self, lane: int, sock: socket.socket) -> None:
        head = bytearray(P.LANE_PIECE.size)
        try:
            while True:
                if not _recv_exactly(sock, memoryview(head)):
                    raise LanesLost(f"lane {lane} was closed by the service")
                try:
                    stream, index, total = P.parse_lane_piece(head)
                except P.ProtocolError as exc:
                    raise LanesLost(f"lane {lane}: {exc}") from None
                into = self.assembly.begin(lane, stream, index, total)
                if into.nbytes and not _recv_exactly(sock, memoryview(into)):
                    raise LanesLost(f"lane {lane} was closed by the service in the middle of batch {index}")
                del into
                self.assembly.delivered(lane, stream, index)
        except Exception as exc:  # LanesLost, OSError, or a bug: the loader hears of it at its next take
            why = "closed" if self._closed else exc.why if isinstance(exc, LanesLost) else \
                f"lane {lane}: {exc}" if isinstance(exc, OSError) else \
                f"lane {lane}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            try:
                self.assembly.fail(why)
            except LanesLost:
                pass

    def close(self) -> None:
        """Close every lane and join the readers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # a reader inside recv_into returns at once
            except OSError:
                pass
        for t in self._threads:
            t.join(JOIN_S)
        for s in self._socks:
            s.close()
        try:
            self.assembly.fail("closed")
        except LanesLost:
            pass


def _recv_exactly(sock: socket.socket, into: memoryview) -> bool:
    """Fill ``into`` from ``sock``; False if the peer closed first."""
    got, n = 0, into.nbytes
    while got < n:
        k = sock.recv_into(into[got:])
        if not k:
            return False
        got += k
    return True


__all__ = ["Assembly", "Lanes", "LanesLost"]

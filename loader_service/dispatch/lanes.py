"""Bulk lanes: plain TCP connections a client opens beside its ZeroMQ connection, on which the
service sends its batches' outputs (wire.protocol, "Bulk lanes").

:class:`LaneListener` accepts lanes on a thread of its own: a connection must say who it is
(``LANE_HELLO``: the routing id of its ZeroMQ connection, its lane, the lanes in all, its set)
within ``LANE_HELLO_S``, or it is closed; at most ``max_pending`` connections may be saying it at
once, the rest are closed as they come, so a flood costs bounded descriptors and no thread. A
lane that said who it is is handed to the dispatcher's loop (``adopt``), which keeps it only if
that routing id has a session.

:class:`LaneSet` is one client's lanes: a sender thread per lane, each with a queue of pieces
(a header and views of a batch slot) that it writes with ``sendall`` (the GIL is released while
the kernel copies). Every batch's ``done`` runs once, when each lane's stripe is sent or
dropped; a lane that fails (the client closed it, or died) breaks the whole set: later pieces
are dropped (their ``done`` runs), and the loop sends that client's batches in data frames again.
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from wire import protocol as P
from loader_service.dispatch.unread import Sending

log = logging.getLogger("loader_service.dispatch.lanes")

JOIN_S = 5.0  # how long close() waits for a thread


class LaneSet:
    """The ``count`` lanes of one client that said they are set ``number``; ``ready`` once all
    of them are here and none failed, which must be by ``complete_by`` (the first lane's arrival
    plus ``LANE_HELLO_S``)."""

    def __init__(self, ident: bytes, count: int, number: int):
        self.ident, self.count, self.number = ident, count, number
        self.complete_by = time.monotonic() + P.LANE_HELLO_S
        self._socks: List[Optional[socket.socket]] = [None] * count
        self._queues: List["queue.SimpleQueue"] = [queue.SimpleQueue() for _ in range(count)]
        self._threads: List[threading.Thread] = []
        self.broken = ""  # why the set failed ("" while it is fine)
        self._closed = False

    @property
    def ready(self) -> bool:
        return not self.broken and not self._closed and all(s is not None for s in self._socks)

    def sending(self) -> Tuple[Sending, ...]:
        """The send side of each lane here, for :mod:`.unread` (a lane that cannot be read is left out)."""
        return tuple(r for s in self._socks if s is not None and (r := Sending.read(s)) is not None)

    def has(self, lane: int) -> bool:
        return self._socks[lane] is not None

    def add(self, lane: int, sock: socket.socket) -> None:
        """Lane ``lane`` is here; its sender starts."""
        self._socks[lane] = sock
        t = threading.Thread(target=self._sender, args=(lane, sock), name=f"lane-{self.ident.hex()[:8]}-{lane}",
                             daemon=True)
        self._threads.append(t)
        t.start()

    def send(self, stream: int, index: int, blocks: Sequence[memoryview], done: Callable[[], None]) -> None:
        """Queue one batch: ``blocks`` (its outputs, in order) striped over the lanes; ``done``
        runs once, on the sender that finishes last (every stripe sent, or dropped)."""
        total = sum(b.nbytes for b in blocks)
        header = P.lane_piece(stream, index, total)
        left, lock = [self.count], threading.Lock()

        def stripe_done() -> None:  # one wake-up of the loop per batch, not one per lane
            with lock:
                left[0] -= 1
                last = not left[0]
            if last:
                done()

        for lane, q in enumerate(self._queues):
            start, end = P.lane_stripe(total, lane, self.count)
            q.put((header, _cut(blocks, start, end), stripe_done))

    def _sender(self, lane: int, sock: socket.socket) -> None:
        q = self._queues[lane]
        while True:
            item = q.get()
            if item is None:
                return
            header, views, done = item
            try:
                if not self.broken:
                    sock.sendall(header)
                    for v in views:
                        sock.sendall(v)
            except OSError as exc:  # the client closed the lane, or is gone
                self._fail(sock, f"lane {lane}: {exc}")
            except Exception as exc:  # a bug: loud, and the client's batches go in data frames
                log.exception("bulk lane %d of client %s failed", lane, self.ident.hex()[:12])
                self._fail(sock, f"lane {lane}: {type(exc).__name__}: {exc}")
            finally:
                del views, item
                try:
                    done()
                except Exception:  # never leave the rest of the queue without its done
                    log.exception("a bulk lane's completion failed")

    def _fail(self, sock: socket.socket, why: str) -> None:
        if not self.broken:  # once per set (a close has set it already)
            self.broken = why
            log.info("bulk lanes of client %s fail (%s); its batches go in data frames again",
                     self.ident.hex()[:12], why)
        _shut(sock)

    def close(self, linger_s: float = 0.0) -> None:
        """Stop the senders and close the lanes. ``linger_s``: how long what is queued may still
        go out (a graceful stop, as the data port's LINGER); then, or at once, what is left is
        dropped (its ``done`` runs). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues:
            q.put(None)  # after what is queued: a sender stops once it has sent it
        if linger_s > 0:
            deadline = time.monotonic() + linger_s
            for t in self._threads:
                t.join(max(0.0, deadline - time.monotonic()))
        self.broken = self.broken or "closed"  # a sender still at work drops the rest
        for s in self._socks:
            if s is not None:
                _shut(s)  # a sender inside sendall returns at once
        for t in self._threads:
            t.join(JOIN_S)
        for q in self._queues:  # what no sender took any more
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[2]()
        for s in self._socks:
            if s is not None:
                s.close()


def _cut(blocks: Sequence[memoryview], start: int, end: int) -> List[memoryview]:
    """The views of bytes ``[start, end)`` of ``blocks`` laid end to end."""
    out, at = [], 0
    for b in blocks:
        lo, hi = max(start, at), min(end, at + b.nbytes)
        if lo < hi:
            out.append(b[lo - at:hi - at])
        at += b.nbytes
    return out


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class LaneListener:
    """The lane port: accepts lanes and hands each that said who it is to ``adopt(ident, lane,
    lanes, lane_set, sock)`` (called on the listener's thread: it must only hand the lane on)."""

    def __init__(self, host: str, port: int, adopt: Callable[[bytes, int, int, int, socket.socket], None],
                 max_pending: int = 64, hello_s: Optional[float] = None):
        self._adopt, self.max_pending = adopt, max_pending
        self.hello_s = P.LANE_HELLO_S if hello_s is None else hello_s
        self._sock = socket.create_server((host, port), backlog=max_pending)
        self.port = self._sock.getsockname()[1]
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="lane-listener", daemon=True)
        self._stop = False
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        pending: Dict[socket.socket, list] = {}  # a connection -> [bytes so far, deadline]
        try:
            while not self._stop:
                now = time.monotonic()
                timeout = max(0.0, min(d for _, d in pending.values()) - now) if pending else None
                for key, _ in sel.select(timeout):
                    if key.fileobj is self._sock:
                        self._accept(sel, pending)
                    elif key.fileobj is not self._wake_r:
                        self._read(sel, pending, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, (_, d) in pending.items() if d <= now]:
                    log.info("a bulk lane said nothing in %gs; closed", self.hello_s)
                    self._drop(sel, pending, conn)
        finally:
            for conn in list(pending):
                self._drop(sel, pending, conn)
            sel.close()

    def _accept(self, sel, pending: Dict[socket.socket, list]) -> None:
        for _ in range(self.max_pending):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog waits for the next round
                log.warning("cannot accept a bulk lane: %s", exc)
                return
            if len(pending) >= self.max_pending:
                conn.close()
                continue
            conn.setblocking(False)
            pending[conn] = [b"", time.monotonic() + self.hello_s]
            sel.register(conn, selectors.EVENT_READ)

    def _read(self, sel, pending: Dict[socket.socket, list], conn: socket.socket) -> None:
        got = pending[conn][0]
        try:
            data = conn.recv(P.LANE_HELLO.size - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, pending, conn)
            return
        got += data
        if len(got) < P.LANE_HELLO.size:
            pending[conn][0] = got
            return
        sel.unregister(conn)
        del pending[conn]
        try:
            ident, lane, lanes, lane_set = P.parse_lane_hello(got)
        except P.ProtocolError as exc:
            log.info("refused a bulk lane: %s", exc)
            conn.close()
            return
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._adopt(ident, lane, lanes, lane_set, conn)

    @staticmethod
    def _drop(sel, pending: Dict[socket.socket, list], conn: socket.socket) -> None:
        sel.unregister(conn)
        del pending[conn]
        conn.close()

    def close(self) -> None:
        """Stop accepting; lanes not yet handed on are closed. Idempotent."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(JOIN_S)
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()


__all__ = ["LaneListener", "LaneSet"]

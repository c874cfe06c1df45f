"""Hostile peers and what to watch them by, shared by the tests and bench/reliability: a REST
client that never finishes its headers (:func:`half_open`), a ZeroMQ peer whose frame claims a
gigabyte (:class:`RoguePeer`), a ZeroMQ client made by hand that floods the data port and may
reset its connection (:func:`zmtp_dealer`, :func:`flood_and_reset`), or take its own identity over
and reset (:func:`handover_and_reset`), and a service's worker processes and zombies
(:func:`workers`, :func:`zombies`). Loopback only."""

from __future__ import annotations

import os
import socket
import struct
import threading

import psutil

from wire import protocol as P

HALF_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "  # headers never end


def half_open(port: int, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(HALF_REQUEST)
    return s


def workers(proc: psutil.Process) -> list:
    """The worker processes of the service ``proc`` (its children but the resource tracker)."""
    out = []
    for p in proc.children():
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def zombies(proc: psutil.Process) -> int:
    """How many of ``proc``'s children are zombies (exited, never reaped)."""
    n = 0
    for p in proc.children():
        try:
            n += p.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            pass
    return n


CLAIM = 1 << 30  # the rogue's frame: 1 GiB, streamed for real if the client takes it


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed")
        out += chunk
    return out


GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31  # ZMTP 3.0, NULL


def _prop(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _frame(body: bytes, flags: int = 0) -> bytes:
    """One ZMTP frame (``flags``: 0x01 more, 0x04 command), short or long."""
    if len(body) < 256:
        return bytes([flags]) + bytes([len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def _recv_frame(conn: socket.socket) -> bytes:
    """One ZMTP frame's body, short or long (its flags read and left aside)."""
    flags = _recv_exact(conn, 1)[0]
    size = struct.unpack(">Q", _recv_exact(conn, 8))[0] if flags & 0x02 else _recv_exact(conn, 1)[0]
    return _recv_exact(conn, size)


PING = _frame(b"\x04PING" + struct.pack(">H", 0), 0x04)  # a ZMTP PING command (TTL 0, no context)


def zmtp_dealer(port: int, identity: bytes = b"", rcvbuf: int = 0) -> socket.socket:
    """A DEALER made by hand on a plain socket, its ZMTP 3.0 handshake done (NULL mechanism):
    what it sends next are frames (:func:`zmtp_burst`); it never reconnects. ``rcvbuf``: its
    kernel receive buffer, set before it connects (0: the kernel's)."""
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        conn.settimeout(10)
        conn.connect(("127.0.0.1", port))
        conn.sendall(GREETING)
        _recv_exact(conn, 64)
        conn.sendall(_frame(b"\x05READY" + _prop(b"Socket-Type", b"DEALER")
                            + _prop(b"Identity", identity or os.urandom(8)), 0x04))
        reply = _recv_frame(conn)  # the service's READY, or an ERROR (a ZAP handler refused it)
        if not reply.startswith(b"\x05READY"):
            raise ConnectionError(f"the service refused the handshake: {reply[7:].decode(errors='replace')}")
    except BaseException:
        conn.close()
        raise
    return conn


def zmtp_burst(messages: int, body: bytes = b"\xc1", ping_every: int = 0) -> bytes:
    """``messages`` one-frame messages (``body``; default a byte msgpack never uses), with a ZMTP
    PING after every ``ping_every`` of them (0: none), as one write."""
    burst = bytearray()
    for k in range(messages):
        burst += _frame(body)
        if ping_every and k % ping_every == ping_every - 1:
            burst += PING
    return bytes(burst)


def flood_and_reset(port: int, messages: int = 200, ping_every: int = 10, body: bytes = b"\xc1") -> None:
    """:func:`zmtp_dealer` sends :func:`zmtp_burst` (a PING after every ``ping_every`` messages),
    then resets its connection (SO_LINGER 0). libzmq 4.3.5 aborted a ROUTER that had stopped
    reading such a connection (its receive cap reached) once a PING or its own heartbeat met
    the reset (docs/reliability.md, Known limits)."""
    conn = zmtp_dealer(port)
    try:
        conn.sendall(zmtp_burst(messages, body, ping_every))
    finally:
        _reset(conn)


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()  # a reset, not a FIN


def handover_and_reset(port: int, messages: int = 200, identity: bytes = b"") -> None:
    """Two hand-made connections under one identity: the second takes the identity over
    (``ROUTER_HANDOVER`` ends the first's pipe; the answers to their Describes say the ROUTER has
    attached the first, then the second), then the first sends ``messages`` (libzmq stops
    reading it at the first, which it cannot deliver, for good), and both reset. libzmq 4.3.5
    aborted a ROUTER that sent heartbeats once its timer met the first's reset
    (docs/reliability.md, Known limits)."""
    identity = identity or os.urandom(8)
    first = zmtp_dealer(port, identity)
    try:
        _described(first)  # the ROUTER has attached it: the identity is the first's
        second = zmtp_dealer(port, identity)
        try:
            _described(second)  # and now the second's
            first.sendall(zmtp_burst(messages))
        finally:
            _reset(second)
    finally:
        _reset(first)


def _described(conn: socket.socket) -> None:
    """Send a Describe and read up to its answer: once it comes, the ROUTER reads this connection."""
    conn.sendall(_frame(P.encode(P.Describe())[0]))
    while not _is_answer(_recv_frame(conn)):
        pass


def _is_answer(body: bytes) -> bool:
    """Whether ``body`` is a DatasetInfo header (anything else, a data frame too, is not)."""
    try:
        return isinstance(P.decode_header(body), P.DatasetInfo)
    except P.ProtocolError:
        return False


class RoguePeer:
    """Speaks ZMTP 3.0 (NULL mechanism) as a ROUTER over a raw socket, then sends each client one
    frame that claims :data:`CLAIM` bytes and streams zeros until the client hangs up.
    ``sent`` counts the frame bytes clients accepted; ``connections`` the connections served."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.sent, self.connections, self._stop = 0, 0, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(10)
                try:
                    self._one(conn)
                except OSError:  # the client cut us off: what it should do
                    pass

    def _one(self, conn: socket.socket) -> None:
        conn.sendall(GREETING)
        _recv_exact(conn, 64)  # the client's greeting
        conn.sendall(_frame(b"\x05READY" + _prop(b"Socket-Type", b"ROUTER"), 0x04))
        _recv_frame(conn)  # the client's READY command
        conn.sendall(b"\x02" + struct.pack(">Q", CLAIM))  # a long message frame, no MORE flag
        zeros = bytes(1 << 20)
        while self.sent < CLAIM and not self._stop.is_set():
            conn.sendall(zeros)
            self.sent += len(zeros)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(30)
        self.listener.close()

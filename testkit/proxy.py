"""Loopback TCP peers that stand where a loader service should: an L4 proxy (what HAProxy,
Envoy or a Kubernetes Service does), a stranger briefly holding the data port, and what they
share (:class:`Listener`, :func:`pump`)."""

from __future__ import annotations

import socket
import threading
from typing import Callable, List, Optional, Tuple


def pump(src: socket.socket, dst: socket.socket, on_data: Optional[Callable[[int], None]] = None) -> None:
    """Copy ``src`` to ``dst`` until either ends (``on_data``: told each chunk's size), then end
    both, as a proxy does."""
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
            if on_data is not None:
                on_data(len(data))
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Listener:
    """A TCP listener on 127.0.0.1:``port`` that hands each connection to :meth:`serve` (the
    subclass's) on the accepting thread, with its number (1-based). Sockets kept in
    :meth:`keep` and threads started by :meth:`spawn` end with :meth:`close`, which frees the
    port."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1"):
        self.connections = 0
        self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"tcp://{host}:{self.port}"
        self._lock = threading.Lock()
        self._socks: List[socket.socket] = []
        self._threads: List[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def serve(self, conn: socket.socket, n: int) -> None:
        raise NotImplementedError

    def keep(self, *socks: socket.socket) -> None:
        with self._lock:
            self._socks += socks

    def spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.connections += 1
            self.serve(conn, self.connections)

    def close(self) -> None:
        """Idempotent. Shutting a socket down wakes a thread blocked in its accept or recv."""
        for s in [self._listener] + self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._accepting.join(10)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "relay threads left running"

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Proxy(Listener):
    """An accept-then-close L4 proxy: each connection is forwarded to ``backend`` (host, port)
    while one accepts there, and accepted then closed at once while none does (or ``backend``
    is None). ``closed`` counts those closes."""

    def __init__(self, backend: Optional[Tuple[str, int]] = None, port: int = 0):
        self.backend, self.closed = backend, 0
        super().__init__(port)

    def serve(self, conn: socket.socket, n: int) -> None:
        try:
            if self.backend is None:
                raise ConnectionRefusedError
            upstream = socket.create_connection(self.backend, timeout=5)
            upstream.settimeout(None)
        except OSError:
            conn.close()
            self.closed += 1
            return
        self.keep(conn, upstream)
        self.spawn(pump, conn, upstream)
        self.spawn(pump, upstream, conn)


class Stranger(Listener):
    """A plain TCP listener that is no loader service: it answers each connection with
    ``reply`` (None: nothing) and holds it until :meth:`close`."""

    def __init__(self, port: int = 0, reply: Optional[bytes] = b"HTTP/1.1 400 Bad Request\r\n\r\n",
                 host: str = "127.0.0.1"):
        self.reply = reply
        super().__init__(port, host)

    def serve(self, conn: socket.socket, n: int) -> None:
        self.keep(conn)
        if self.reply is not None:
            try:
                conn.sendall(self.reply)
            except OSError:
                pass

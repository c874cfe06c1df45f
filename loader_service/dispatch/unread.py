"""Connections that read nothing of what waits for them, timed by the kernel's own counters.

A peer that asks for batches and never reads its socket costs the service what waits for it: the
batches libzmq queues (its queue has no cap: the data port sets no ``SNDHWM``), the slots of
those sent zero-copy, and the lanes' sender threads blocked in ``sendall``. Its connection is not
silent (:mod:`.silence`) when it sends a PING now and then. What the kernel knows instead: the
bytes the peer has acknowledged (``TCP_INFO``'s ``bytes_acked``) and what is still unsent or in
flight (``notsent_bytes``, ``unacked``). A peer whose socket reads nothing closes its receive
window, so the acknowledged count stops while data waits.

Every look of :mod:`.silence` reads that for the connection and for each of its bulk lanes
(:class:`Sending`). A connection is *unread* from the look at which one of its sockets had data
waiting, if at each look after it some socket still had data waiting and had acknowledged
nothing since the look before. The caller cuts it once that has lasted as long as a silent
connection may last (3 of its client's heartbeats): the same peer frozen (SIGSTOP) is cut by
either rule, and a trainer that is only busy is by neither, as the project's client reads every
batch it asked for into its own buffers whatever its trainer does (its receive cap is above its
window, and its lanes' readers do not wait for the trainer).

A peer that reads, only slower than it asks, is not cut: its new streams wait instead while it
is behind (:meth:`~.memory.BatchMemory.behind`), so what waits for it stays at two streams' worth.

This module is the rule alone (pure); the shell reads the counters (:class:`~.events.Quiet`).
"""

from __future__ import annotations

import socket
import struct
from typing import Dict, NamedTuple, Optional, Tuple

from loader_service.dispatch import heap

# struct tcp_info (linux/tcp.h): __u32 tcpi_unacked (segments) at byte 24, __u64 tcpi_bytes_acked at 120
# (Linux 4.1), __u32 tcpi_notsent_bytes at 144 (Linux 4.6)
TCP_INFO_UNACKED, TCP_INFO_BYTES_ACKED, TCP_INFO_NOTSENT = 24, 120, 144
SENDING_INFO_BYTES = TCP_INFO_NOTSENT + 4  # the TCP_INFO a reading needs (an older kernel answers less)


class Sending(NamedTuple):
    """One socket's send side, as the kernel counts it (``TCP_INFO``)."""

    acked: int  # bytes the peer has acknowledged since the connection opened
    unacked: int  # segments sent and not acknowledged
    unsent: int  # bytes in the send queue not sent yet (a closed receive window keeps them there)

    @property
    def waiting(self) -> bool:
        return self.unacked > 0 or self.unsent > 0

    @classmethod
    def of(cls, info: bytes) -> Optional["Sending"]:
        """From a ``TCP_INFO`` answer (None: the kernel answered too little)."""
        if len(info) < SENDING_INFO_BYTES:
            return None
        return cls(struct.unpack_from("=Q", info, TCP_INFO_BYTES_ACKED)[0],
                   struct.unpack_from("=I", info, TCP_INFO_UNACKED)[0],
                   struct.unpack_from("=I", info, TCP_INFO_NOTSENT)[0])

    @classmethod
    def read(cls, sock: socket.socket) -> Optional["Sending"]:
        """``sock``'s (None: closed, or not counted)."""
        try:
            return cls.of(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, SENDING_INFO_BYTES))
        except OSError:
            return None


class UnreadWatch:
    """Per connection (fd, serial): its sockets' last reading and since when it has been unread."""

    def __init__(self) -> None:
        # fd -> (serial, the sockets' readings at the last look, when that was, unread since (None: it read))
        self._seen: Dict[int, Tuple[int, Tuple[Sending, ...], float, Optional[float]]] = {}

    def observe(self, fd: int, serial: int, sockets: Tuple[Sending, ...], now: float) -> float:
        """A look read connection (``fd``, ``serial``)'s ``sockets`` (its own first, then its lanes;
        empty where the kernel does not count these) at ``now``: how long it has been unread (0: it
        read what waited, or nothing waited)."""
        last = self._seen.get(fd)
        since = None
        if last is not None and last[0] == serial and len(last[1]) == len(sockets):
            if any(b.waiting and a.waiting and b.acked == a.acked for a, b in zip(last[1], sockets)):
                since = last[3] if last[3] is not None else last[2]  # nothing read since the look before
        self._seen[fd] = (serial, sockets, now, since)
        return 0.0 if since is None else now - since

    def unsent(self, fd: int) -> int:
        """The bytes the last look found waiting unsent on connection ``fd``'s sockets."""
        last = self._seen.get(fd)
        return sum(s.unsent for s in last[1]) if last is not None else 0

    def forget(self, fd: int) -> None:
        """The connection on ``fd`` was reported gone, or a new one on it."""
        self._seen.pop(fd, None)

    def compact(self) -> None:
        heap.shrink(self)

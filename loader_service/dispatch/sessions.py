"""Connections to the data port: their idents, fds and counters (see the glossary in
:mod:`loader_service.dispatch`: an ident is a connection, a client a loader instance).

ZeroMQ's ROUTER names a peer by its identity; the socket monitor names a connection by its file
descriptor. The kernel reuses fd numbers, so a connection is (fd, generation): the n-th
EVENT_ACCEPTED on an fd is its generation n. For one fd the monitor reports accepted and
disconnected strictly alternately (the old connection's disconnect is emitted before its fd
is closed, the new one's accept after the fd is reused), so a late disconnect of an earlier
connection on a reused fd number is recognised and ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from wire.jobspec import JobSpec


@dataclass
class Session:
    """One connection (a DEALER's ident) and what it is doing."""

    ident: bytes
    fd: int = -1
    fd_gen: int = 0
    job: str = ""
    client: str = ""  # the loader instance behind this connection (Hello.client)
    rank: int = -1
    spec: Optional[JobSpec] = None  # its job's spec (dataset resolved) while it holds a rank of a named job (jobs.py)
    run: Optional[Tuple[int, int]] = None  # (epoch, entry) of its rank's stream: ranks of a job resume alike
    stream_id: int = -1  # highest stream started on this connection
    stream: Optional[object] = None  # its current dispatcher Stream, if any
    connected: float = field(default_factory=time.monotonic)
    batches: int = 0
    samples: int = 0

    @property
    def name(self) -> str:
        return self.ident.hex()[:12]


class Sessions:
    """The table of connections, keyed by ident, with the fd bookkeeping above."""

    def __init__(self) -> None:
        self._by_ident: Dict[bytes, Session] = {}
        self._fd_owner: Dict[int, bytes] = {}
        self._fd_gen: Dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._by_ident)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_ident.values()))

    def __contains__(self, ident: bytes) -> bool:
        return ident in self._by_ident

    def fd_owners(self) -> Dict[int, bytes]:
        """fd -> identity of the connection on it (a copy)."""
        return dict(self._fd_owner)

    def get(self, ident: bytes) -> Optional[Session]:
        return self._by_ident.get(ident)

    def add(self, ident: bytes) -> Session:
        s = self._by_ident[ident] = Session(ident)
        return s

    def pop(self, ident: bytes) -> Optional[Session]:
        s = self._by_ident.pop(ident, None)
        if s is not None and self._fd_owner.get(s.fd) == ident:
            del self._fd_owner[s.fd]
        return s

    def accepted(self, fd: int) -> None:
        """The monitor saw a new connection on ``fd``."""
        self._fd_gen[fd] = self._fd_gen.get(fd, 0) + 1

    def disconnected(self, fd: int) -> Optional[bytes]:
        """The monitor saw ``fd`` disconnect: the identity to drop, if it was this connection's."""
        ident = self._fd_owner.get(fd)
        s = self._by_ident.get(ident) if ident is not None else None
        if s is not None and s.fd_gen > self._fd_gen.get(fd, 0):
            return None  # the owner came on a later connection that reused this fd number
        self._fd_owner.pop(fd, None)
        return ident

    def bind(self, s: Session, fd: int) -> List[bytes]:
        """Record that ``s`` speaks on ``fd``; returns identities whose connection that replaced."""
        replaced = []
        owner = self._fd_owner.get(fd)
        if owner is not None and owner != s.ident:
            replaced.append(owner)  # the fd was reused: its previous connection is gone
        if self._fd_owner.get(s.fd) == s.ident:
            del self._fd_owner[s.fd]
        s.fd, s.fd_gen = fd, self._fd_gen.get(fd, 0)
        self._fd_owner[fd] = s.ident
        return replaced

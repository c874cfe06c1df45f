"""Connections to the data port: their idents, fds and counters (see the glossary in
:mod:`loader_service.dispatch`: an ident is a connection, a client a loader instance).

ZeroMQ's ROUTER names a peer by its identity; the socket monitor names a connection by its file
descriptor. The kernel reuses fd numbers, so a connection is (fd, serial): every new connection
gets the next serial, and the table holds only the connections open now. For one fd the
monitor reports accepted and disconnected strictly alternately (the old connection's
disconnect is emitted before its fd is closed, the new one's accept after the fd is reused).
But libzmq reports an accept only after handing the connection to an I/O thread
(``send_attach`` precedes ``event_accepted`` in its listeners), so with several I/O threads a
connection's first messages can reach the ROUTER before its accept reaches the monitor. So
once the monitor has been read to the end, a message whose fd has no open connection came
over one whose accept is still on its way, or over one already gone (its disconnect read
before the message): the two cannot be told apart then. Such a connection is opened early
(:meth:`open_early`) with a deadline: its accept, when it comes, confirms it; a connection
whose accept has not come by then was gone, and whoever is bound to it is dropped
(:meth:`unreported`). A send to a gone connection fails at once (ROUTER_MANDATORY), which
drops its session sooner (issue 32).

The table also keeps what the dispatcher's decisions look up, indexed as they change, so
that no decision walks every session: the streams being served (:meth:`serve`), the
sessions holding a rank of each job (:meth:`hold`), and the connections that have not said
Hello yet (:attr:`pending`), oldest first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

from wire import protocol as P
from wire.jobspec import JobSpec

from loader_service.dispatch import heap


@dataclass
class Session:
    """One connection (a DEALER's ident) and what it is doing."""

    ident: bytes
    fd: int = -1
    fd_gen: int = 0  # the serial of the connection it is bound to (see :class:`Sessions`)
    job: str = ""
    client: str = ""  # the loader instance behind this connection (Hello.client)
    heartbeat_s: float = P.DEFAULT_HEARTBEAT_S  # how often its client sends ZMTP PINGs (Hello.heartbeat)
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
    """The table of connections, keyed by ident, with the fd bookkeeping and indexes above."""

    def __init__(self) -> None:
        self._by_ident: Dict[bytes, Session] = {}
        self._open: Dict[int, int] = {}  # fd -> serial of the connection open on it
        self._fd_owner: Dict[int, bytes] = {}  # fd of an open connection -> the session bound to it
        self._pending: Dict[int, int] = {}  # open connections no session is bound to: fd -> serial, oldest first
        self._early: Dict[int, float] = {}  # fd opened on a message before its accept was reported -> by when it must be
        self._serial = 0
        self._streams: Dict[bytes, object] = {}  # ident -> its stream being served
        self._jobs: Dict[str, Dict[bytes, Session]] = {}  # job -> sessions holding a rank of it
        self._job_of: Dict[bytes, str] = {}  # ident -> the job it is indexed under
        # ident -> the stream whose Accept libzmq still holds: what was sent before it may still
        # wait in libzmq's queue, so a new stream of that ident waits (memory.py). Kept past the
        # session (a Bye leaves the connection and its queue as they were) until libzmq lets go
        # of it: sent, or dropped with its connection (so it holds no more than the connections do).
        self.unflushed: Dict[bytes, int] = {}
        # fds of open connections sent an Accept already (past a Bye too): only a later Accept is
        # tracked, as nothing of a stream is queued before a connection's first (see :meth:`accepting`)
        self._served: Set[int] = set()


    def compact(self) -> None:
        """Size its indexes to what they hold now (after many sessions left: see :mod:`.heap`)."""
        heap.shrink(self)
    def __len__(self) -> int:
        return len(self._by_ident)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_ident.values()))

    def values(self) -> Iterable[Session]:
        """The sessions, without a copy (not to be changed while it is read)."""
        return self._by_ident.values()

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
        if s is None:
            return None
        if self._fd_owner.get(s.fd) == ident:
            del self._fd_owner[s.fd]
            if s.fd in self._open:
                self._pending[s.fd] = self._open[s.fd]  # open still, but nobody's any more
        # out of the indexes; its record keeps its stream and spec for the caller to retire
        self._streams.pop(ident, None)
        job = self._job_of.pop(ident, None)
        if job is not None:
            del self._jobs[job][ident]
            if not self._jobs[job]:
                del self._jobs[job]
        return s

    # ------------------------------------------------------------------ connections
    @property
    def pending(self) -> int:
        """Open connections that no session is bound to (no Hello yet, or their client left)."""
        return len(self._pending)

    @property
    def connections(self) -> int:
        """Open connections, as the monitor has reported them."""
        return len(self._open)

    def oldest_pending(self, n: int) -> List[int]:
        """The fds of the ``n`` longest-pending connections."""
        out = []
        for fd in self._pending:
            if len(out) >= n:
                break
            out.append(fd)
        return out

    def confirmed(self) -> Iterator[Tuple[int, int]]:
        """(fd, serial) of every open connection whose accept the monitor has reported."""
        return ((fd, serial) for fd, serial in self._open.items() if fd not in self._early)

    def serial(self, fd: int) -> int:
        """The serial of the connection open on ``fd`` (0: none is)."""
        return self._open.get(fd, 0)

    def owner(self, fd: int) -> Optional[bytes]:
        """The identity of the session bound to the connection on ``fd``, if any."""
        return self._fd_owner.get(fd)

    def is_open(self, fd: int) -> bool:
        """Whether a connection is open on ``fd`` (per the monitor events read so far)."""
        return fd in self._open

    @property
    def early(self) -> int:
        """Connections opened on a message whose accept the monitor has not reported yet."""
        return len(self._early)

    def is_early(self, fd: int) -> bool:
        return fd in self._early

    def open_early(self, fd: int, due: float) -> None:
        """A message came over ``fd``, which has no open connection once the monitor was read to
        the end: open it now; its accept must be reported by ``due`` (see the module's doc)."""
        self._open_new(fd)
        self._early[fd] = due

    def next_early_due(self) -> Optional[float]:
        """When the oldest connection opened early must have been reported (None: none is)."""
        return next(iter(self._early.values()), None)  # opened in time order, with one grace for all

    def unreported(self, now: float) -> List[bytes]:
        """Close the connections opened early whose accept was not reported by their deadline
        (they were gone before their message was read); the identities bound to them, to drop."""
        gone = []
        while self._early:
            fd, due = next(iter(self._early.items()))
            if due > now:
                break
            ident = self.disconnected(fd)
            if ident is not None:
                gone.append(ident)
        return gone

    def accepted(self, fd: int) -> None:
        """The monitor saw a new connection on ``fd``."""
        if self._early.pop(fd, None) is not None:
            return  # the report of the connection already opened on its first message
        self._open_new(fd)

    def accepting(self, fd: int) -> bool:
        """An Accept goes out on connection ``fd``: whether to track it (libzmq's letting go of it
        comes back as Flushed), which only one after the connection's first needs. Tracking has
        a cost (pyzmq's garbage-collection thread hears of each tracked frame), and a flood of
        new connections that each say one Hello would pay it for nothing."""
        if fd in self._served:
            return True
        if fd in self._open:
            self._served.add(fd)
        return False

    def _open_new(self, fd: int) -> None:
        self._served.discard(fd)  # a new connection on a reused fd number
        self._serial += 1
        self._open[fd] = self._serial
        self._pending.pop(fd, None)  # keeps the order of acceptance
        self._pending[fd] = self._serial

    def disconnected(self, fd: int) -> Optional[bytes]:
        """The monitor saw ``fd`` disconnect: the identity to drop, if it was this connection's."""
        serial = self._open.pop(fd, None)
        self._served.discard(fd)
        self._pending.pop(fd, None)
        self._early.pop(fd, None)
        ident = self._fd_owner.pop(fd, None)
        s = self._by_ident.get(ident) if ident is not None else None
        if s is None or s.fd_gen != serial:
            return None  # nobody spoke on it, or a late report of a connection already replaced
        return ident

    def bind(self, s: Session, fd: int) -> List[bytes]:
        """Record that ``s`` speaks on ``fd`` (an open connection: see :meth:`is_open`); returns
        identities whose connection that replaced."""
        if fd not in self._open:
            raise ValueError(f"fd {fd} has no open connection: its messages come from one that is gone")
        replaced = []
        owner = self._fd_owner.get(fd)
        if owner is not None and owner != s.ident:
            replaced.append(owner)  # the fd was reused: its previous connection is gone
        if s.fd != fd and self._fd_owner.get(s.fd) == s.ident:
            del self._fd_owner[s.fd]
            if s.fd in self._open:
                self._pending[s.fd] = self._open[s.fd]
        s.fd, s.fd_gen = fd, self._open[fd]
        self._fd_owner[fd] = s.ident
        self._pending.pop(fd, None)
        return replaced

    # ------------------------------------------------------------------ indexes
    def serve(self, s: Session, stream: Optional[object]) -> None:
        """``s`` is serving ``stream`` now (None: no stream)."""
        s.stream = stream
        if stream is None:
            self._streams.pop(s.ident, None)
        else:
            self._streams[s.ident] = stream

    def streams(self) -> List[object]:
        """The streams being served, one per session that has one (a copy)."""
        return list(self._streams.values())

    def hold(self, s: Session, spec: Optional[JobSpec]) -> None:
        """``s`` holds a rank of its job under ``spec`` now (None: no longer)."""
        job = self._job_of.pop(s.ident, None)
        if job is not None:
            del self._jobs[job][s.ident]
            if not self._jobs[job]:
                del self._jobs[job]
        s.spec = spec
        if spec is not None:
            self._job_of[s.ident] = s.job
            self._jobs.setdefault(s.job, {})[s.ident] = s

    def of_job(self, job: str) -> List[Session]:
        """The sessions holding a rank of ``job`` (a copy)."""
        return list(self._jobs.get(job, {}).values())

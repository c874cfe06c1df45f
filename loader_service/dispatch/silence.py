"""Silent connections, timed by the kernel's clock instead of ZMTP heartbeats of the service's own;
and the connections libzmq will never close.

(A connection that reads nothing of what waits for it, :mod:`.unread`, is cut by the same
limit and queue: "silent" below means either.)

libzmq 4.3.5 aborts the process (``stream_engine_base.cpp:310``, libzmq issue 4841) when a
connection whose reading has stopped ends in a TCP reset and then meets the heartbeat timer of
the side that sends PINGs. The data port reads every connection (no receive cap: :mod:`.flood`),
but one stop cannot be avoided: when a second connection takes an identity over
(``ROUTER_HANDOVER``), libzmq ends the old connection's pipe, and the old connection's next
message stops its reading for good. Any peer can do that to itself. So the data port sends no
PINGs. Its clients still do (the client's ZMTP heartbeat, ``LoaderConfig.heartbeat_s``, which
libzmq answers without the loop), and the kernel knows when each connection last brought data
(``TCP_INFO``'s ``last_data_recv``). Every service heartbeat the shell reads that for every open
connection (:class:`~.events.Probe`, answered by :class:`~.events.Quiet`), and a connection that
has brought nothing for :data:`SILENT_AFTER` of its client's heartbeats is cut: a frozen or
vanished client, a network partition, a peer that connected and never spoke. A client whose
process runs but whose trainer is busy is not silent: its libzmq thread sends the PINGs.

A connection whose reading libzmq stopped that way is never closed by libzmq (nothing of it runs
any more but its descriptor), cut or not: it is *stranded* until the service stops. Such a
connection is found here as one cut :data:`STRANDED_AFTER_S` ago whose disconnect never came.
They are counted per peer address, and an address with ``max_per_address`` of them is refused
new connections at the handshake (:class:`~.events.Deny`): so a peer cannot take the service's
descriptors one handover at a time. The project's client never strands a connection (it opens a
new one only after its old one is closed).

A look can find thousands of silent connections at once (a flood of peers that connected and
never spoke). They are cut :data:`CUTS_PER_ROUND` per round of the loop, so that one look does
not hold every client and ``/healthz`` for a second (each cut drops a session, and its
disconnect comes back through the monitor).

This module is the rule alone (pure): when to look, the limit for a connection, which
connections are found silent and cut (each once, so many a round), which are stranded, which
addresses to refuse.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

from loader_service.dispatch import heap

SILENT_AFTER = 3  # heartbeats without a byte: the connection is cut
# a cut connection not reported closed by then never will be: one libzmq reads closes within milliseconds;
# the rest is room for a loop or an I/O thread busy with thousands of cuts at once (a wrong count could
# refuse an honest address)
STRANDED_AFTER_S = 5.0
CUTS_PER_ROUND = 256  # as many as the loop reads of one socket in a round


class SilenceWatch:
    """When the open connections are looked at, which were cut for silence (by fd and serial),
    which of those are stranded, and the addresses refused for them."""

    def __init__(self, every_s: float, max_per_address: int, cuts_per_round: int = CUTS_PER_ROUND) -> None:
        self.every_s = every_s  # the service's heartbeat (--heartbeat)
        self.max_per_address = max_per_address  # stranded connections an address may have (0: no limit)
        self.cuts_per_round = cuts_per_round
        self.next_at = 0.0
        self._cut: Dict[int, int] = {}  # fd -> serial of the connection cut there, not reported gone
        # of those, the ones not stranded yet: fd -> (cut when, peer address), oldest first
        self._fresh: Dict[int, Tuple[float, str]] = {}
        self._stranded: Dict[int, str] = {}  # fd -> peer address, of the cut ones found stranded
        self._per_address: Dict[str, int] = {}  # peer address -> its stranded connections
        self.denied: Dict[str, int] = {}  # peer address -> its stranded connections when it was refused
        # found past their limit at a look, not cut yet: (fd, serial, quiet_s, unread_s, limit_s, address), in
        # look order
        self._found: Deque[Tuple[int, int, float, float, float, str]] = deque()

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def looked(self, now: float) -> None:
        self.next_at = now + self.every_s

    def limit(self, heartbeat_s: float) -> float:
        """How long a connection may bring nothing: :data:`SILENT_AFTER` heartbeats of its client
        (``heartbeat_s``: its Hello's, or the default before one), never less than as many of the service's."""
        return SILENT_AFTER * max(self.every_s, heartbeat_s)

    def is_cut(self, fd: int, serial: int) -> bool:
        return self._cut.get(fd) == serial

    def found(self, fd: int, serial: int, quiet_s: float, limit_s: float, address: str, unread_s: float = 0.0) -> None:
        """A look read connection (``fd``, ``serial``) from ``address`` as quiet for ``quiet_s`` and
        unread for ``unread_s`` (:mod:`.unread`): queued to be cut if either is past ``limit_s``
        (:meth:`to_cut`)."""
        if max(quiet_s, unread_s) >= limit_s and not self.is_cut(fd, serial):
            self._found.append((fd, serial, quiet_s, unread_s, limit_s, address))

    def to_cut(self) -> List[Tuple[int, int, float, float, float, str]]:
        """A round's share (``cuts_per_round``) of the connections found silent, oldest first, to
        cut now (after checking each is still open: :meth:`silent` marks it cut)."""
        return [self._found.popleft() for _ in range(min(self.cuts_per_round, len(self._found)))]

    @property
    def waiting(self) -> int:
        """Connections found silent and not cut yet (the next round cuts more of them)."""
        return len(self._found)

    def silent(self, fd: int, serial: int, quiet_s: float, limit_s: float, now: float, address: str,
               unread_s: float = 0.0) -> bool:
        """Whether connection (``fd``, ``serial``) from ``address``, quiet for ``quiet_s`` and unread
        for ``unread_s``, is to be cut now: either past ``limit_s``, and not cut already."""
        if max(quiet_s, unread_s) < limit_s or self.is_cut(fd, serial):
            return False
        self.forget(fd)  # an older connection's marks, had its report been missed
        self._cut[fd] = serial
        self._fresh[fd] = (now, address)
        return True

    def strand(self, now: float) -> List[str]:
        """Mark the connections cut :data:`STRANDED_AFTER_S` ago and still open as stranded; the
        addresses to refuse from now on (each once)."""
        deny = []
        while self._fresh:
            fd, (when, address) = next(iter(self._fresh.items()))
            if now - when < STRANDED_AFTER_S:
                break
            del self._fresh[fd]
            self._stranded[fd] = address
            n = self._per_address[address] = self._per_address.get(address, 0) + 1
            if self.max_per_address and n >= self.max_per_address and address and address not in self.denied:
                self.denied[address] = n
                deny.append(address)
        return deny

    def next_strand_at(self) -> Optional[float]:
        """When the oldest cut connection not stranded yet would be (None: there is none)."""
        if not self._fresh:
            return None
        return next(iter(self._fresh.values()))[0] + STRANDED_AFTER_S

    def forget(self, fd: int) -> None:
        """The connection on ``fd`` was reported gone, or a new one on it."""
        self._cut.pop(fd, None)
        self._fresh.pop(fd, None)
        address = self._stranded.pop(fd, None)
        if address is not None:
            left = self._per_address[address] - 1
            if left:
                self._per_address[address] = left
            else:
                del self._per_address[address]

    @property
    def stranded(self) -> int:
        """Connections libzmq will not close before the service stops."""
        return len(self._stranded)

    def compact(self) -> None:
        heap.shrink(self)

"""What one data-port connection may send: an allowance, so that a flood is cut, not queued.

libzmq reads every connection of the data port as fast as it can (``ZMQ_RCVHWM`` 0). A receive
cap would bound what a connection queues unread, but libzmq 4.3.5 aborts the whole process when
a connection whose reading the cap stopped ends in a TCP reset and then meets its heartbeat
timer or a PING it had sent (``stream_engine_base.cpp:310``, libzmq issue 4841; reproduced by
``tests/e2e/test_flood_reset.py``). So the bound is kept here, from what the dispatcher reads.

A connection's allowance starts at ``burst`` units. Each message read costs one unit per
started :data:`UNIT_BYTES` (a Hello or a Request of a few hundred batches: one). Each batch sent
to the connection earns :data:`EARNED_PER_BATCH` (a client answers a batch with at most a
Request and a Release), and time earns ``rate`` units a second; it never holds more than
``burst``. A connection whose allowance falls below zero is *cut*: the dispatcher shuts its
socket down (the client sees a reset), drops its session, and drops unread whatever it still
had queued, and whatever its identity sends for :data:`REMEMBER_S` after (its client reconnects
with the same identity and would go on where it was). What that identity sends is still charged
to the connection it comes on, so one that reconnects and floods on is cut again; but not to a
connection whose accept is not reported yet, which is how its old connection's rest comes once
that closed (its fd number may be a newcomer's by the time the accept confirms it). The
project's client sends about two
messages per batch it gets, so it is never cut; a peer that sends faster than it is served is
cut after ``burst`` units. What it costs before that: what it sent while the dispatcher read its
first ``burst`` units (docs/benchmarks.md section 16).

Pure: no sockets, no clock of its own (the caller passes ``now``).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Sequence

from loader_service.dispatch import heap

UNIT_BYTES = 4096  # a message costs one unit per started 4 KiB
EARNED_PER_BATCH = 4  # units a batch sent earns its connection
REMEMBER_S = 30.0  # how long a cut identity's messages are dropped unread
REMEMBERED = 4096  # cut identities remembered at most (the oldest forgotten first)


class Verdict(enum.Enum):
    """What to do with a message just read."""

    PASS = "pass"  # within its connection's allowance: through the door
    CUT = "cut"  # past it: cut the connection now (the message is dropped)
    DROP = "drop"  # from a connection already cut, or an identity cut lately: dropped unread


def cost(frames: Sequence) -> int:
    """The units a message costs (its frames' bytes, each started :data:`UNIT_BYTES` one)."""
    size = sum(len(f.buffer) for f in frames)
    return max(1, -(-size // UNIT_BYTES))


@dataclass
class _Allowance:
    serial: int  # the connection it is for (the fd's serial in :class:`~.sessions.Sessions`)
    units: float
    at: float  # when ``units`` was last brought up to date
    cut: bool = False


class FloodGuard:
    """Every open connection's allowance, by fd, and the identities cut lately."""

    def __init__(self, burst: int, rate: float):
        if burst < 1 or rate < 0:
            raise ValueError(f"a connection's allowance needs burst >= 1 and rate >= 0, got {burst} and {rate}")
        self.burst, self.rate = burst, rate
        self._allowances: Dict[int, _Allowance] = {}  # fd -> the allowance of the connection open on it
        self._cut: "OrderedDict[bytes, float]" = OrderedDict()  # identity -> until when it is dropped

    def __len__(self) -> int:
        return len(self._allowances)

    def compact(self) -> None:
        """Size its table to what it holds now (after many connections left: see :mod:`.heap`)."""
        heap.shrink(self)

    @property
    def remembered(self) -> int:
        """Identities whose messages are dropped now (cut lately)."""
        return len(self._cut)

    def units(self, fd: int, serial: int, now: float) -> float:
        """What connection (``fd``, ``serial``) may still send at ``now`` (changes nothing)."""
        a = self._allowances.get(fd)
        if a is None or a.serial != serial:
            return float(self.burst)
        return min(self.burst, a.units + max(0.0, now - a.at) * self.rate)

    def charge(self, ident: bytes, fd: int, serial: int, units: int, now: float, early: bool = False) -> Verdict:
        """A message of ``units`` from ``ident`` was read on connection (``fd``, ``serial``);
        ``early``: that connection's accept has not been reported yet (:mod:`.sessions`)."""
        while self._cut and next(iter(self._cut.values())) <= now:
            self._cut.popitem(last=False)
        a = self._allowance(fd, serial, now)
        if a.cut:
            return Verdict.DROP
        remembered = ident in self._cut
        if remembered and early:
            # what a cut connection left unread comes over its fd number after it closed, an early
            # connection as the state sees it: the one that is confirmed there later owes none of it
            return Verdict.DROP
        a.units -= units
        if a.units < 0:
            a.cut = True
            self._cut.pop(ident, None)
            self._cut[ident] = now + REMEMBER_S
            if len(self._cut) > REMEMBERED:
                self._cut.popitem(last=False)
            return Verdict.CUT
        return Verdict.DROP if remembered else Verdict.PASS

    def earn(self, fd: int, serial: int, batches: int, now: float) -> None:
        """``batches`` batches were sent to connection (``fd``, ``serial``) (nothing if that
        connection is gone: its fd number may be another's now)."""
        a = self._allowances.get(fd)
        if a is not None and a.serial == serial:
            self._refill(a, now)
            a.units = min(self.burst, a.units + batches * EARNED_PER_BATCH)

    def forget(self, fd: int) -> None:
        """The connection on ``fd`` closed, or one opened early there was confirmed: its allowance
        goes (a confirmed one starts afresh; a cut identity stays remembered)."""
        self._allowances.pop(fd, None)

    def keep_open(self, serial_of: Callable[[int], int]) -> None:
        """Forget the allowances of connections no longer open (``serial_of(fd)``: the serial of
        the connection open on ``fd`` now, 0 for none)."""
        for fd in [fd for fd, a in self._allowances.items() if serial_of(fd) != a.serial]:
            del self._allowances[fd]

    def _allowance(self, fd: int, serial: int, now: float) -> _Allowance:
        a = self._allowances.get(fd)
        if a is None or a.serial != serial:  # a new connection on a reused fd number starts afresh
            a = self._allowances[fd] = _Allowance(serial, float(self.burst), now)
        else:
            self._refill(a, now)
        return a

    def _refill(self, a: _Allowance, now: float) -> None:
        if now > a.at:
            a.units = min(self.burst, a.units + (now - a.at) * self.rate)
            a.at = now

"""Which stream gets the next idle worker: the one that has waited longest since it was last
served, or since it joined, goes first within its *tier*; a lower tier goes first (:func:`tier`):
a current epoch whose client reads, then a lookahead stream (the next epoch, started early),
then a current epoch whose client has read nothing it was sent.

The last tier is the policy for clients that do not read (issue 32): a stream that was sent
batches and has asked for nothing since it began (no credit back: its client has consumed none
of them) is served only when no stream of a reading client, and no lookahead, can use the
worker. A fair service shares its workers with every client, but a connection that takes
batches and reads none of them is not a client in need: with a prefetch above one, 10,000 such
connections would each take a task in every round, and a reading client one task in 10,000.
Nothing tells a new client from a new flood connection before its first batch, so a stream
that has been sent nothing is in the first tier (a newcomer's first task waits one round of
the first tier: see below); a client that reads its first batch stays there.

Least recently served, not a turn counter: a counter over the streams that happen to have work
starves a stream that always has work when another one's work comes and goes (one worker
idle per call, B and C alternating, A never served). Waiting longest wins, whatever the pattern.

A new stream joins at the back of the line, not the front: with "never served first", every new
stream went ahead of every stream already served, so a flood of connections that each said
Hello kept a real client from its second batch for as long as new streams kept coming (issue
32: 10,000 one-image streams, 0 images/s for the real client). At the back, every stream that
keeps work gets one task per round of the streams with work, however many join.

The cost of a decision does not grow with the number of streams (a flood holds thousands that
cannot take a task): the scheduler keeps a line of *candidates*, streams that may have a task,
as a heap by the time they last got one. The caller says when a stream may have become able to
take a task (:meth:`offer`: it opened, asked for batches, a slot came free, a task was lost...); a
candidate found unable to take one when its turn comes leaves the line until then.
"""

from __future__ import annotations

import heapq
from typing import Callable, Dict, Generic, Hashable, List, Tuple, TypeVar

from loader_service.dispatch import heap

T = TypeVar("T", bound=Hashable)

READING, LOOKAHEAD, UNREAD = 0, 1, 2  # the tiers, first served first


def tier(lookahead: bool, sent: int, asked: bool) -> int:
    """A stream's tier: :data:`LOOKAHEAD` for a lookahead stream; :data:`UNREAD` for a current
    epoch that was ``sent`` batches while its client has not ``asked`` for anything since the
    stream began (it read none of them); else :data:`READING`."""
    if lookahead:
        return LOOKAHEAD
    return UNREAD if sent and not asked else READING


class Scheduler(Generic[T]):
    """Least recently served first, lower tiers first (:func:`tier`; a bool works as one: a
    lookahead flag). Pure: streams are compared by identity (hashable objects); the caller tells
    it which may take a task (:meth:`offer`), which ended (:meth:`forget`), and at :meth:`pick`
    which really can."""

    def __init__(self) -> None:
        self._tick = 0
        self._served: Dict[T, int] = {}  # each known stream's place: the tick of its last task, or of its joining
        self._line: List[Tuple[int, int, int, T]] = []  # heap of (tier, place, seq, stream); stale entries skipped
        self._queued: Dict[T, Tuple[int, int]] = {}  # a candidate -> its live entry's (tier, place)
        self._seq = 0  # breaks ties without comparing streams


    def compact(self) -> None:
        """Size its indexes to what they hold now (after many sessions left: see :mod:`.heap`)."""
        heap.shrink(self)
    def __len__(self) -> int:
        """Streams known (served or waiting for their first task)."""
        return len(self._served)

    @property
    def candidates(self) -> int:
        """Streams in the line now."""
        return len(self._queued)

    def offer(self, s: T, tier: int) -> None:
        """``s`` may be able to take a task now (or its tier changed). Idempotent."""
        if s not in self._served:
            self._tick += 1
            self._served[s] = self._tick  # joins at the back
        self._enqueue(s, int(tier))

    def forget(self, s: T) -> None:
        """``s`` ended: it leaves the line for good (its heap entry is skipped when met)."""
        self._served.pop(s, None)
        self._queued.pop(s, None)
        if not self._queued:
            self._line.clear()  # all stale: let go of the streams they name
        elif len(self._line) > 64 and len(self._line) > 4 * len(self._queued):  # mostly stale: rebuild
            self._line = [e for e in self._line if self._queued.get(e[3]) == (e[0], e[1])]
            heapq.heapify(self._line)

    def pick(self, idle: int, dispatchable: Callable[[T], bool], tier: Callable[[T], int],
             take: Callable[[T], None]) -> int:
        """Give up to ``idle`` tasks by calling ``take(stream)`` once per task; returns how many
        were given. ``dispatchable`` and ``tier`` are asked of a candidate when its turn comes,
        ``dispatchable`` again after every ``take`` (and ``tier``: a batch sent may change it)."""
        given = 0
        while given < idle and self._line:
            t, place, _, s = heapq.heappop(self._line)
            if self._queued.get(s) != (t, place):
                continue  # stale: forgotten, or queued again since with another place or tier
            del self._queued[s]
            now_t = int(tier(s))
            if t != now_t:  # its tier changed without an offer(): its right place
                self._enqueue(s, now_t)
                continue
            if not dispatchable(s):
                continue  # out of the line until the caller offers it again
            take(s)
            given += 1
            if s not in self._served:
                continue  # ``take`` ended it (forget): it leaves the line
            self._tick += 1
            self._served[s] = self._tick
            if dispatchable(s):
                self._enqueue(s, int(tier(s)))
        return given

    def _enqueue(self, s: T, tier: int) -> None:
        key = (tier, self._served[s])
        if self._queued.get(s) == key:
            return
        self._queued[s] = key
        self._seq += 1
        heapq.heappush(self._line, (tier, key[1], self._seq, s))


__all__: List[str] = ["LOOKAHEAD", "READING", "Scheduler", "UNREAD", "tier"]

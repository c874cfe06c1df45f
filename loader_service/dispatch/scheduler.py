"""Which stream gets the next idle worker: the one that has waited longest since it was last
served, or since it joined, goes first; a lookahead stream (the next epoch, started early) is
served only when no current epoch can use the worker.

Least recently served, not a turn counter: a counter over the streams that happen to be ready
starves a stream that is always ready when another one's readiness comes and goes (one worker
idle per call, B and C alternating, A never served). Waiting longest wins, whatever the pattern.

A new stream joins at the back of the line, not the front: with "never served first", every new
stream went ahead of every stream already served, so a flood of connections that each said
Hello kept a real client from its second batch for as long as new streams kept coming (issue
32: 10,000 one-image streams, 0 images/s for the real client). At the back, every stream that
stays ready gets one task per round of the ready streams, however many join.

The cost of a decision does not grow with the number of streams (a flood holds thousands that
cannot take a task): the scheduler keeps a line of *candidates*, streams that may have a task,
as a heap by the time they last got one. The caller says when a stream may have become able to
take a task (:meth:`ready`: it opened, got credit, a slot came free, a task was lost...); a
candidate found unable to take one when its turn comes leaves the line until then.
"""

from __future__ import annotations

import heapq
from typing import Callable, Dict, Generic, Hashable, List, Tuple, TypeVar

T = TypeVar("T", bound=Hashable)


class Scheduler(Generic[T]):
    """Least recently served first, current epochs before lookahead ones. Pure: streams are
    compared by identity (hashable objects); the caller tells it which may take a task
    (:meth:`ready`), which ended (:meth:`forget`), and at :meth:`pick` which really can."""

    def __init__(self) -> None:
        self._tick = 0
        self._served: Dict[T, int] = {}  # each known stream's place: the tick of its last task, or of its joining
        self._line: List[Tuple[bool, int, int, T]] = []  # heap of (lookahead, place, seq, stream); stale entries skipped
        self._queued: Dict[T, Tuple[bool, int]] = {}  # a candidate -> its live entry's (lookahead, place)
        self._seq = 0  # breaks ties without comparing streams

    def __len__(self) -> int:
        """Streams known (served or waiting for their first task)."""
        return len(self._served)

    @property
    def candidates(self) -> int:
        """Streams in the line now."""
        return len(self._queued)

    def ready(self, s: T, lookahead: bool) -> None:
        """``s`` may be able to take a task now (or its lookahead flag changed). Idempotent."""
        if s not in self._served:
            self._tick += 1
            self._served[s] = self._tick  # joins at the back
        self._enqueue(s, lookahead)

    def forget(self, s: T) -> None:
        """``s`` ended: it leaves the line for good (its heap entry is skipped when met)."""
        self._served.pop(s, None)
        self._queued.pop(s, None)
        if not self._queued:
            self._line.clear()  # all stale: let go of the streams they name
        elif len(self._line) > 64 and len(self._line) > 4 * len(self._queued):  # mostly stale: rebuild
            self._line = [e for e in self._line if self._queued.get(e[3]) == (e[0], e[1])]
            heapq.heapify(self._line)

    def pick(self, idle: int, dispatchable: Callable[[T], bool], lookahead: Callable[[T], bool],
             take: Callable[[T], None]) -> int:
        """Give up to ``idle`` tasks by calling ``take(stream)`` once per task; returns how many
        were given. ``dispatchable`` and ``lookahead`` are asked of a candidate when its turn
        comes, ``dispatchable`` again after every ``take``."""
        given = 0
        while given < idle and self._line:
            la, place, _, s = heapq.heappop(self._line)
            if self._queued.get(s) != (la, place):
                continue  # stale: forgotten, or queued again since with another place or kind
            del self._queued[s]
            if la != lookahead(s):  # promoted (or demoted) without a ready(): its right place
                self._enqueue(s, lookahead(s))
                continue
            if not dispatchable(s):
                continue  # out of the line until the caller says it may be ready again
            take(s)
            given += 1
            self._tick += 1
            self._served[s] = self._tick
            if dispatchable(s):
                self._enqueue(s, la)
        return given

    def _enqueue(self, s: T, lookahead: bool) -> None:
        key = (lookahead, self._served[s])
        if self._queued.get(s) == key:
            return
        self._queued[s] = key
        self._seq += 1
        heapq.heappush(self._line, (lookahead, key[1], self._seq, s))


__all__: List[str] = ["Scheduler"]

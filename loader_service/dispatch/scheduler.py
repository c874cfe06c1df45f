"""Which stream gets the next idle worker: clients take turns, and a lookahead stream (the
next epoch, started early) is served only when no current epoch can use the worker."""

from __future__ import annotations

from typing import Callable, List, Sequence, TypeVar

T = TypeVar("T")


class Scheduler:
    """Round-robin across streams, current epochs before lookahead ones. Pure: the caller says
    which streams can take a task (``dispatchable``) and which are lookahead."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, streams: Sequence[T], idle: int, dispatchable: Callable[[T], bool],
             lookahead: Callable[[T], bool], take: Callable[[T], None]) -> int:
        """Give up to ``idle`` tasks to ``streams`` by calling ``take(stream)`` once per task;
        returns how many were given. ``dispatchable`` is asked again after every ``take``."""
        ready = [s for s in streams if dispatchable(s)]
        if not ready or idle <= 0:
            return 0
        self._turn = (self._turn + 1) % len(ready)
        ready = ready[self._turn:] + ready[: self._turn]
        ready.sort(key=lookahead)  # stable: keeps the turn order within each group
        given = 0
        while given < idle and ready:
            progressed = False
            for s in list(ready):
                if given >= idle:
                    break
                if not dispatchable(s):
                    ready.remove(s)
                    continue
                if lookahead(s) and any(not lookahead(x) and dispatchable(x) for x in ready):
                    break  # a current epoch can still use this worker
                take(s)
                given += 1
                progressed = True
            if not progressed:
                break
        return given


__all__: List[str] = ["Scheduler"]

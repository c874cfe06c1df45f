"""Which stream gets the next idle worker: the one served least recently goes first, and a
lookahead stream (the next epoch, started early) is served only when no current epoch can use
the worker.

Least recently served, not a turn counter: a counter over the streams that happen to be ready
starves a stream that is always ready when another one's readiness comes and goes (one worker
idle per call, B and C alternating, A never served). Waiting longest wins, whatever the pattern."""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, TypeVar

T = TypeVar("T")


class Scheduler:
    """Least recently served first, current epochs before lookahead ones. Pure: the caller says
    which streams can take a task (``dispatchable``) and which are lookahead; streams are
    compared by identity (hashable objects)."""

    def __init__(self) -> None:
        self._tick = 0
        self._served: Dict[T, int] = {}  # the tick of each stream's last task

    def pick(self, streams: Sequence[T], idle: int, dispatchable: Callable[[T], bool],
             lookahead: Callable[[T], bool], take: Callable[[T], None]) -> int:
        """Give up to ``idle`` tasks to ``streams`` by calling ``take(stream)`` once per task;
        returns how many were given. ``dispatchable`` is asked again after every ``take``."""
        ready = [s for s in streams if dispatchable(s)]
        if not ready or idle <= 0:
            return 0
        if len(self._served) > 2 * len(streams):  # forget streams that ended
            self._served = {s: self._served[s] for s in streams if s in self._served}
        # never served first (in the caller's order), then the longest waiting; lookahead last
        ready.sort(key=lambda s: (lookahead(s), self._served.get(s, -1)))
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
                self._tick += 1
                self._served[s] = self._tick
                given += 1
                progressed = True
            if not progressed:
                break
        return given


__all__: List[str] = ["Scheduler"]

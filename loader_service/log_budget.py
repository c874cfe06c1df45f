"""A budget of log lines per kind of line, so that what clients do cannot grow the log without
bound (DESIGN.md invariant 7: a connection, a message or a flood of them costs bounded resources,
and the log is one).

Pure bookkeeping: the clock is passed in. A kind (a line's template, say) may write ``burst``
lines at once and earns them back at ``burst`` per ``interval_s`` (a token bucket). Past that,
its lines are counted instead of written. Nothing is left out silently: the next line of that
kind that is written says how many were left out before it (:meth:`LineBudget.take`), and where
none comes, :meth:`LineBudget.overdue` hands out the count once the kind has earned a line back
(:meth:`LineBudget.next_due` is when), for its owner to write as a summary.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple

# a line earned back "at" a time computed from the rate (next_due) must be there at that time:
# float rounding of (now - at) * rate may fall short of 1.0 by far less than this
_ROUNDING = 1e-9


class _Kind:
    __slots__ = ("tokens", "at", "left_out", "since")

    def __init__(self, tokens: float, at: float):
        self.tokens, self.at = tokens, at  # lines it may write, as of ``at``
        self.left_out = 0  # lines counted and not written since its last written line or summary
        self.since = at  # when the last line of it was written, or its last summary


class LineBudget:
    """At most ``burst`` lines of one kind at once, earned back at ``burst`` per ``interval_s``.
    The kinds are the callers' (their templates: a fixed set, so the table stays small)."""

    def __init__(self, burst: int, interval_s: float):
        if burst < 1 or not interval_s > 0:
            raise ValueError(f"burst must be >= 1 and interval_s > 0, got {burst} and {interval_s}")
        self.burst, self.interval_s = burst, interval_s
        self._rate = burst / interval_s  # lines earned a second
        self._kinds: Dict[Hashable, _Kind] = {}

    def take(self, kind: Hashable, now: float) -> Optional[str]:
        """A line of ``kind`` at ``now``: None if it is left out (counted), else what to add to it:
        "" or, after lines left out, `` [N more like this in the last S s]``."""
        k = self._kinds.get(kind)
        if k is None:
            k = self._kinds[kind] = _Kind(float(self.burst), now)
        self._refill(k, now)
        if k.tokens < 1.0 - _ROUNDING:
            k.left_out += 1
            return None
        k.tokens = max(0.0, k.tokens - 1.0)
        note = f" [{k.left_out} more like this in the last {now - k.since:.0f} s]" if k.left_out else ""
        k.left_out, k.since = 0, now
        return note

    def next_due(self) -> Optional[float]:
        """The first time a kind with lines left out has earned a line back (None: none waits)."""
        due = [self._due(k) for k in self._kinds.values() if k.left_out]
        return min(due) if due else None

    def overdue(self, now: float) -> List[Tuple[Hashable, int, float]]:
        """``(kind, lines left out, over how many seconds)`` for each kind with lines left out that
        has earned a line back by ``now``: the summary spends that line, and the count starts again."""
        out = []
        for kind, k in self._kinds.items():
            if k.left_out and now >= self._due(k):
                self._refill(k, now)
                k.tokens = max(0.0, k.tokens - 1.0)
                out.append((kind, k.left_out, now - k.since))
                k.left_out, k.since = 0, now
        return out

    def _refill(self, k: _Kind, now: float) -> None:
        if now > k.at:
            k.tokens = min(float(self.burst), k.tokens + (now - k.at) * self._rate)
            k.at = now

    def _due(self, k: _Kind) -> float:
        return k.at + max(0.0, 1.0 - k.tokens) / self._rate


__all__ = ["LineBudget"]

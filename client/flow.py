"""Flow control for one epoch of one rank: which batch to ask of which replica, and when.

Pure bookkeeping over batch numbers (no sockets, no clocks), so that
``tests/unit/client/test_flow_control.py`` can drive it with simulated replicas of any speed.

The rules (after torchdata's in-order mapper and SPDL's ordered pipe, with tf.data service's
on-demand sharding):

* **credit tied to plan position**: batch ``b`` may be requested only while
  ``b < next_yield + window``. Every batch between ``next_yield`` and the newest one requested
  is either requested (not yet received) or received (waiting, in the ordering window or the
  device sink), so those two together never exceed ``window``, and the oldest batch not yet
  yielded always has its place: no full buffer can block it;
* **on-demand assignment**: a batch goes to the live replica with a free credit (fewer than
  ``credit`` batches requested and not received) that is expected to deliver it first: its
  outstanding batches plus this one, times its measured time per batch (an average of the
  intervals between its deliveries while it had work; a replica silent for longer than that
  counts as that slow). Nothing is dealt up front, so a slow replica gets a small share and
  its batches come back before the window is exhausted by the fast one's;
* **failover**: a replica given up on (:meth:`lose`) hands its outstanding batches back; they
  are asked of the others first, lowest first;
* **membership**: replicas are named by ids that are never reused; one that joins mid-epoch
  (:meth:`join`) gets batches from the next assignment on, one that leaves (:meth:`leave`)
  hands its outstanding batches back and is forgotten.
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, Iterable, List, Optional, Set, Union


class EpochFlow:
    """Batches ``start .. total-1`` of one epoch over replicas ``0 .. replicas-1`` (or the ids
    ``replicas`` lists)."""

    def __init__(self, start: int, total: int, window: int, credit: int, replicas: Union[int, Iterable[int]]):
        ids = list(range(replicas)) if isinstance(replicas, int) else list(replicas)
        if window < 1 or credit < 1 or not ids:
            raise ValueError("window, credit and replicas must be >= 1")
        self.start, self.total = start, total
        self.window, self.credit = window, credit
        self.next_yield = start  # the next batch the trainer gets
        self.next_new = start  # the lowest batch never asked of anyone
        self._redo: List[int] = []  # heap: batches handed back by a lost replica
        self.outstanding: Dict[int, Set[int]] = {}  # replica -> batches asked of it, not received
        self.received: Set[int] = set()  # received and not yet yielded
        self.per_batch: Dict[int, Optional[float]] = {}  # replica -> measured seconds per batch
        self._busy_since: Dict[int, float] = {}  # replica -> last delivery, or when work was first asked
        self._given_away: Dict[int, Set[int]] = {}  # replica -> its batches asked of the others when it was lost
        for r in ids:
            self.join(r)

    def join(self, replica: int) -> None:
        """``replica`` (a new id) takes batches from the next :meth:`assign` on."""
        if replica in self.outstanding:
            raise ValueError(f"replica {replica} is already in this flow")
        self.outstanding[replica], self.per_batch[replica], self._busy_since[replica] = set(), None, 0.0

    def leave(self, replica: int) -> List[int]:
        """``replica`` is gone for good: its outstanding batches go to the others first."""
        orphans = self.lose(replica)
        del self.outstanding[replica], self.per_batch[replica], self._busy_since[replica]
        return orphans

    @property
    def done(self) -> bool:
        """Every batch of the epoch has been yielded."""
        return self.next_yield >= self.total

    @property
    def fully_asked(self) -> bool:
        """Every batch is requested or received (nothing left to assign)."""
        return self.next_new >= self.total and not self._redo

    def unasked(self) -> bool:
        """A batch waits to be assigned now: one to ask again, or a new one within the window."""
        return bool(self._redo) or (self.next_new < self.total and self.next_new < self.next_yield + self.window)

    def in_flight(self) -> int:
        """Batches requested or received and not yet yielded (bounded by ``window``)."""
        return sum(len(o) for o in self.outstanding.values()) + len(self.received)

    def _eta(self, r: int, now: float, default: float) -> float:
        per = self.per_batch[r] if self.per_batch[r] is not None else default
        if self.outstanding[r]:
            per = max(per, now - self._busy_since[r])  # silent for longer than usual: that slow
        return (len(self.outstanding[r]) + 1) * per

    def assign(self, live: Iterable[int], now: float = 0.0) -> Dict[int, List[int]]:
        """Batches to request now: replica -> batches, in the order to ask for them. ``now``:
        a clock reading (any unit, the same as :meth:`on_batch`'s)."""
        live = list(live)
        known = [p for p in self.per_batch.values() if p is not None]
        default = sum(known) / len(known) if known else 1.0
        out: Dict[int, List[int]] = {}
        while live and self.unasked():
            b = self._redo[0] if self._redo else self.next_new
            free = [r for r in live if len(self.outstanding[r]) < self.credit]
            if not free:
                break
            r = min(free, key=lambda x: (self._eta(x, now, default), x))
            if self._redo:
                heapq.heappop(self._redo)
            else:
                self.next_new += 1
            if not self.outstanding[r]:
                self._busy_since[r] = now
            self.outstanding[r].add(b)
            out.setdefault(r, []).append(b)
        return out

    def on_batch(self, replica: int, batch: int, now: float = 0.0) -> bool:
        """``replica`` delivered ``batch``; False if it was not asked of it (or came already)."""
        if batch not in self.outstanding.get(replica, ()):
            return False
        self.outstanding[replica].discard(batch)
        self.received.add(batch)
        took = max(0.0, now - self._busy_since[replica])
        prev = self.per_batch[replica]
        self.per_batch[replica] = took if prev is None else 0.8 * prev + 0.2 * took
        self._busy_since[replica] = now
        return True

    def next_received(self) -> bool:
        """Whether the next batch to yield has been received."""
        return self.next_yield in self.received

    def take(self) -> int:
        """Yield the next batch (it must be :meth:`next_received`); returns its number."""
        b = self.next_yield
        self.received.remove(b)
        self.next_yield += 1
        return b

    def late(self, replica: int, batch: int) -> bool:
        """Whether ``batch`` was asked of ``replica`` and given to the others when it was lost
        (:meth:`lose`): a copy it sends after all is late, not wrong (the first copy to come is the
        one used; :meth:`on_batch` refuses the other)."""
        return batch in self._given_away.get(replica, ())

    def lose(self, replica: int) -> List[int]:
        """Give up on ``replica``'s outstanding batches; they go to the others first."""
        orphans = sorted(self.outstanding[replica])
        self.outstanding[replica] = set()
        self._given_away.setdefault(replica, set()).update(orphans)
        for b in orphans:
            heapq.heappush(self._redo, b)
        return orphans


class InOrder:
    """The ordering window between the transports and the device sink: batches arrive in any
    order (:meth:`put`) and leave (:meth:`due`) strictly in plan order, at most ``ahead`` beyond
    the next one to yield, so the sink (a device copy) never holds a batch out of order."""

    def __init__(self, first: int, ahead: int):
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {ahead}")
        self.next_out = first  # the next batch to leave the window
        self.ahead = ahead
        self.held: Dict[int, Any] = {}  # received, not yet due

    def put(self, index: int, item: Any) -> None:
        self.held[index] = item

    def due(self, next_yield: int) -> List[Any]:
        """The held items that may go on now, in plan order, removed from the window: the next
        ones in sequence below ``next_yield + ahead`` (``next_yield``: the next batch the
        trainer gets)."""
        out = []
        while self.next_out in self.held and self.next_out < next_yield + self.ahead:
            out.append(self.held.pop(self.next_out))
            self.next_out += 1
        return out


__all__ = ["EpochFlow", "InOrder"]

"""Flow control for one epoch of one rank: which batch to ask of which replica, and when.

Pure bookkeeping over batch numbers (no sockets, no clocks), so that
``tests/test_flow.py`` can drive it with simulated replicas of any speed.

The rules (after torchdata's in-order mapper and SPDL's ordered pipe, with tf.data service's
on-demand sharding):

* **credit tied to plan position**: batch ``b`` may be requested only while
  ``b < next_yield + window``. Every batch between ``next_yield`` and the newest one requested
  is either requested (not yet received) or received (waiting, in the reorder buffer or the
  device sink), so those two together never exceed ``window``, and the oldest batch not yet
  yielded always has its place: no full buffer can block it;
* **on-demand assignment**: a batch goes to whichever live replica has a free credit (fewer
  than ``credit`` batches requested and not received), fewest outstanding first; nothing is
  dealt up front, so a slow replica slows only its own share;
* **failover**: a replica given up on (:meth:`lose`) hands its outstanding batches back; they
  are asked of the others first, lowest first.
"""

from __future__ import annotations

import heapq
from typing import Dict, Iterable, List, Set


class EpochFlow:
    """Batches ``start .. total-1`` of one epoch over replicas ``0 .. replicas-1``."""

    def __init__(self, start: int, total: int, window: int, credit: int, replicas: int):
        if window < 1 or credit < 1 or replicas < 1:
            raise ValueError("window, credit and replicas must be >= 1")
        self.start, self.total = start, total
        self.window, self.credit = window, credit
        self.next_yield = start  # the next batch the trainer gets
        self.next_new = start  # the lowest batch never asked of anyone
        self._redo: List[int] = []  # heap: batches handed back by a lost replica
        self.outstanding: List[Set[int]] = [set() for _ in range(replicas)]
        self.received: Set[int] = set()  # received and not yet yielded

    @property
    def done(self) -> bool:
        """Every batch of the epoch has been yielded."""
        return self.next_yield >= self.total

    @property
    def fully_asked(self) -> bool:
        """Every batch is requested or received (nothing left to assign)."""
        return self.next_new >= self.total and not self._redo

    def in_flight(self) -> int:
        """Batches requested or received and not yet yielded (bounded by ``window``)."""
        return sum(len(o) for o in self.outstanding) + len(self.received)

    def assign(self, live: Iterable[int]) -> Dict[int, List[int]]:
        """Batches to request now: replica -> batches, in the order to ask for them."""
        live = list(live)
        out: Dict[int, List[int]] = {}
        while live:
            if self._redo:
                b = self._redo[0]
            elif self.next_new < self.total and self.next_new < self.next_yield + self.window:
                b = self.next_new
            else:
                break
            free = [r for r in live if len(self.outstanding[r]) < self.credit]
            if not free:
                break
            r = min(free, key=lambda x: (len(self.outstanding[x]), x))
            if self._redo:
                heapq.heappop(self._redo)
            else:
                self.next_new += 1
            self.outstanding[r].add(b)
            out.setdefault(r, []).append(b)
        return out

    def on_batch(self, replica: int, batch: int) -> bool:
        """``replica`` delivered ``batch``; False if it was not asked of it (or came already)."""
        if batch not in self.outstanding[replica]:
            return False
        self.outstanding[replica].discard(batch)
        self.received.add(batch)
        return True

    def ready(self) -> bool:
        """Whether the next batch to yield has been received."""
        return self.next_yield in self.received

    def take(self) -> int:
        """Yield the next batch (it must be :meth:`ready`); returns its number."""
        b = self.next_yield
        self.received.remove(b)
        self.next_yield += 1
        return b

    def lose(self, replica: int) -> List[int]:
        """Give up on ``replica``'s outstanding batches; they go to the others first."""
        orphans = sorted(self.outstanding[replica])
        self.outstanding[replica] = set()
        for b in orphans:
            heapq.heappush(self._redo, b)
        return orphans


__all__ = ["EpochFlow"]

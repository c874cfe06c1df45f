"""Batch slots in shared memory.

Each stream gets one segment of ``n`` equal slots (a worker writes a batch into a slot; the
dispatcher sends it from there). When a stream ends, its segment is kept as its client's
*reserve* for the client's next stream of the same shape, so an epoch starts on memory that
is already mapped by the workers and zmq. Live segments and reserves together never exceed
``max_bytes``; a new stream that would pass it takes the memory of other clients' reserves
(oldest first) before it is refused, so idle connected clients hold no capacity.
"""

from __future__ import annotations

from typing import Dict, Optional, Set

from loader_service.shm import NoSpace, Segment


class NoCapacity(Exception):
    """A segment would take the slots past ``max_bytes``; the message says by how much."""


class NoShmSpace(NoCapacity):
    """Under ``max_bytes``, but the shared-memory filesystem itself is full (every reserve
    already given back): waiting for streams that end would not make it fit."""


class SlotArena:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._live: Set[Segment] = set()
        self._reserve: Dict[bytes, Segment] = {}

    def in_use(self) -> int:
        """Bytes of every live segment and every reserve."""
        return sum(s.size for s in self._live) + self.reserved()

    def reserved(self) -> int:
        """Bytes of every reserve (what :meth:`acquire` may take back)."""
        return sum(s.size for s in self._reserve.values())

    def held_by(self, owner: bytes) -> int:
        return self._reserve[owner].size if owner in self._reserve else 0

    def acquire(self, owner: bytes, nbytes: int, what: str, headroom: int = 0) -> Segment:
        """A segment of ``nbytes`` for ``owner``'s new stream: its reserve if that has the size,
        else a new one. ``headroom``: bytes that must still be free afterwards (an epoch
        lookahead leaves room for a current epoch). Raises :class:`NoCapacity` (``what``
        describes the request); a refused owner keeps its reserve."""
        reserve = self._reserve.pop(owner, None)
        reuse = reserve is not None and reserve.size == nbytes
        if reserve is not None and not reuse:
            reserve.close()  # another shape of job: its memory goes back before the check
        if not reuse or headroom:
            # Reserves are a cache for their owners' next epoch, not a claim: a job that fits the
            # cap is never refused because idle clients keep reserves. Oldest reserves go first.
            while self._reserve and self.in_use() + nbytes + headroom > self.max_bytes:
                self._reserve.pop(next(iter(self._reserve))).close()
            in_use = self.in_use()
            if in_use + nbytes + headroom > self.max_bytes:
                if reuse:
                    self._reserve[owner] = reserve
                if headroom:
                    raise NoCapacity(
                        f"{nbytes / 2**20:.1f} MiB of batch slots ({what}) would leave less than "
                        f"{headroom / 2**20:.1f} MiB for a current epoch ({in_use / 2**20:.1f} of "
                        f"{self.max_bytes / 2**20:.0f} MiB in use)")
                raise NoCapacity(f"this job needs {nbytes / 2**20:.1f} MiB of batch slots ({what}) but "
                                 f"{in_use / 2**20:.1f} of {self.max_bytes / 2**20:.0f} MiB are in use by "
                                 f"{len(self._live)} running streams")
        seg = reserve if reuse else self._create(nbytes, what)
        self._live.add(seg)
        return seg

    def _create(self, nbytes: int, what: str) -> Segment:
        """A new segment; reserves give their filesystem space back (oldest first) if it is full."""
        while True:
            try:
                return Segment.create(nbytes, tag="slots")
            except NoSpace as exc:
                if not self._reserve:
                    raise NoShmSpace(f"this job needs {nbytes / 2**20:.1f} MiB of batch slots ({what}) but "
                                     f"{exc.strerror}") from None
                self._reserve.pop(next(iter(self._reserve))).close()

    def release(self, segment: Segment, owner: Optional[bytes]) -> None:
        """The stream using ``segment`` has ended and nothing reads it any more: keep it as
        ``owner``'s reserve (if it has none and is still connected), else unmap it."""
        self._live.discard(segment)
        if owner is not None and owner not in self._reserve:
            self._reserve[owner] = segment
        else:
            segment.close()

    def forget(self, owner: bytes) -> None:
        """``owner`` is gone: its reserve goes back."""
        seg = self._reserve.pop(owner, None)
        if seg is not None:
            seg.close()

    def close(self) -> None:
        """Unmap everything (after zmq has released every frame). Idempotent."""
        for seg in list(self._live) + list(self._reserve.values()):
            seg.close()
        self._live.clear()
        self._reserve.clear()

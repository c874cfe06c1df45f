"""Batch memory: the slots in shared memory that streams' batches are written into, and who
gets them (README, "Batch memory").

Each stream gets one segment of equal slots (a worker writes a batch into a slot; the
dispatcher sends it from there). Live segments and reserves together never exceed
``max_bytes``. The policy, in the order it gives way:

* **reserves**: when a stream ends, its segment is kept as its connection's reserve for its
  next stream of the same shape, so an epoch starts on memory the workers and zmq have
  mapped already. Reserves are a cache, not a claim: a stream that needs the room takes
  other connections' reserves (oldest first) before it is refused.
* **lending**: the slots of a stream that has asked for nothing, with nothing in flight, for
  ``reclaim_idle_s`` (a *quiet* stream) are lent out (the segment goes back), longest quiet
  first, if that makes room; the stream takes slots again with its next request, and waits
  (``starved``) while none are free.
* **waiting**: a new stream that would fit once streams that are ending, or quiet, give their
  slots back waits for them (``waiting``); one that would not is refused at once. A stream
  caught up with what it was asked, its last sends not yet let go by libzmq, counts as quiet
  here: it is quiet a moment later (a Hello that came in that moment was refused, a race). So a job
  that fits ``max_bytes`` is never refused because a connected client sits on slots.
* **lookahead**: a client's next epoch, started early, is best effort: it must leave room for
  a plain stream as large as the largest one live, lends nothing and never waits.
* **held back**: a client's new stream waits, whatever memory is free, while its client is
  behind in reading what its earlier streams were sent (:meth:`BatchMemory.behind`): libzmq
  still holds the Accept of its last stream (so what came before it still waits in libzmq's
  queue), or more than :data:`RETIRING_HELD_MAX` of its replaced streams still hold slots for
  sends not gone yet. Without it a client that said Hello after Hello and read slowly grew
  libzmq's queue and the slots held for it by a stream's worth each time (docs/reliability.md).

:class:`BatchMemory` keeps all of it. It reads the streams being served from the ``live``
callable it is given and the time from the ``now`` each call passes; it never reads a clock.

No decision walks every stream (issue 32: 10,000 sessions): the quiet streams are an index,
kept by :meth:`BatchMemory.changed`, which the dispatcher calls after every event that may have
changed a stream (its state, its slots, its last ask, its lookahead flag); the index orders them
by their last ask, the ones whose quiet time is up apart, with their bytes counted; the sizes
of the current epochs' slots (what a lookahead must leave free) are counted the same way.
:meth:`BatchMemory.check_counts` asserts that every kept figure equals the walk it replaces.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

from loader_service import shm
from loader_service.dispatch import heap, local
from loader_service.dispatch.door import MAY_BECOME, Life
from loader_service.dispatch.streams import Opening, Stream
from loader_service.shm import NoSpace, Segment

log = logging.getLogger("loader_service.dispatch.memory")

# A client's replaced streams that may still hold slots for sends libzmq has not let go of when
# its new stream opens: one (the epoch that just ended, its last batches on their way), so a
# client that reads what it asks for never waits; a second one means it is behind.
RETIRING_HELD_MAX = 1


def _write_line(level: int, template: str, *args) -> None:
    log.log(level, template, *args)


class NoCapacity(Exception):
    """A segment would take the slots past ``max_bytes``; the message says by how much."""


class NoShmSpace(NoCapacity):
    """Under ``max_bytes``, but the shared-memory filesystem itself is full (every reserve
    already given back): waiting for streams that end would not make it fit."""


@dataclass
class _Quiet:
    """A quiet stream's entry in :class:`BatchMemory`'s index."""

    asked_at: float  # the last ask it was indexed with (a new one indexes it again)
    seq: int  # tells its live queue entry from stale ones
    size: int  # its segment's bytes
    due: bool = False  # quiet for reclaim_idle_s: in ``_due`` (else ``_later``)


@dataclass(frozen=True)
class NoSlots:
    """A stream that cannot have its slots: the ``no_capacity`` error's message."""

    message: str
    fatal: bool = True


@dataclass(frozen=True)
class Broke:
    """Opening a stream that waited raised (a bug): its slots went back, and its client alone
    is failed with this (the others that waited are still retried)."""

    error: str
    traceback: str


Opened = Union[Stream, NoSlots, Broke]


def _new_segment(nbytes: int, tag: str) -> Segment:
    return Segment.create(nbytes, tag=tag)


class BatchMemory:
    """See the module docstring. ``allocate(nbytes, tag)`` makes a segment (shared memory; the
    tests may give another allocator). It calls nothing back: what the dispatcher must act on is
    left in two outboxes it takes after each call, :meth:`take_woken` (streams that have slots
    again) and :meth:`take_unlinked` (segment names the workers must unmap)."""

    def __init__(self, max_bytes: int, reclaim_idle_s: float, live: Callable[[], Iterable[Stream]],
                 connected: Callable[[bytes], bool], hint: str = "raise --max-shm-mb",
                 allocate: Callable[[int, str], Segment] = _new_segment,
                 line: Optional[Callable[..., None]] = None,
                 unflushed: Callable[[bytes], bool] = lambda ident: False):
        self.max_bytes = max_bytes
        # whether libzmq still holds the Accept last sent to an ident (see :meth:`behind`)
        self._unflushed = unflushed
        # how a line about one client's stream is written: ``line(level, template, *args)`` (the
        # dispatch state's, within its budget per kind: a client that opens stream after stream
        # cannot grow the log by a line each); by default straight to this module's log
        self._line = line or _write_line
        self._allocate = allocate
        self._woken: List[Stream] = []  # streams that lent their slots and have slots again
        self._unlinked: List[str] = []  # names of segments unlinked since the last take_unlinked()
        self.reclaim_idle_s = reclaim_idle_s
        self.hint = hint  # what raises max_bytes, for refusals
        self._live = live  # the streams being served now (with their slots or lent)
        self._connected = connected  # whether an ident is still connected (its reserve is worth keeping)
        self._segments: Set[Segment] = set()  # in use by a live or retiring stream
        self._closing: List[Segment] = []  # dropped while a zmq frame still held a view (see _drop)
        self._reserve: Dict[bytes, Segment] = {}  # ident -> its reserve, oldest first
        # the bytes of each, kept with every change (never summed: a decision costs the same
        # whatever the number of sessions; see :meth:`check_counts`)
        self._segment_bytes = 0
        self._reserve_bytes = 0
        self.retiring: List[Stream] = []  # ended streams whose slots a task or send still reads
        self._retiring_held: Dict[bytes, int] = {}  # ident -> its retiring streams holding slots (see :meth:`behind`)
        self.waiting: Dict[bytes, Opening] = {}  # ident -> its new stream, until slots free up for it
        self.starved: List[Stream] = []  # streams that asked for work after lending their slots, none free yet
        self._lend_due: Optional[float] = None  # when a quiet stream's slots become lendable to those
        # a lend freed more than the stream that lent needed: retry what waits (it may fit now)
        self._lent = False
        # The quiet streams (live, holding slots, settled: see :meth:`changed`), each in one of
        # two priority queues (heapq) by (asked_at, seq): ``_due`` (quiet for reclaim_idle_s already: its slots
        # may be lent) or ``_later``. Entries of streams no longer quiet, or indexed again
        # since, are skipped when met, and dropped when they outnumber the live ones.
        self._quiet: Dict[Stream, _Quiet] = {}
        self._due: List[Tuple[float, int, Stream]] = []
        self._later: List[Tuple[float, int, Stream]] = []
        self._due_bytes = 0
        self._later_bytes = 0
        self._seq = itertools.count()
        # streams caught up but for sends libzmq has not let go of yet: quiet once it has (see
        # :meth:`_will_fit`), each with its segment's bytes
        self._settling: Dict[Stream, int] = {}
        self._settling_bytes = 0
        # the current epochs' slot sizes (live streams, not lookahead): size -> count; a priority queue of
        # the sizes (negated, each once; sizes no longer counted are popped when on top)
        self._current: Dict[Stream, int] = {}
        self._current_sizes: Dict[int, int] = {}
        self._largest: List[int] = []
        self._in_largest: Set[int] = set()

    # ------------------------------------------------------------------ outboxes
    def take_woken(self) -> List[Stream]:
        """The streams that lent their slots and have slots again since the last call (each may
        take a task now)."""
        out, self._woken = self._woken, []
        return out

    def take_unlinked(self) -> List[str]:
        """The names of the segments unlinked since the last call (the workers unmap them)."""
        out, self._unlinked = self._unlinked, []
        return out

    # ------------------------------------------------------------------ segments and reserves

    def compact(self) -> None:
        """Size its indexes to what they hold now (after many sessions left: see :mod:`.heap`),
        without the stale entries of its quiet queues (each keeps a stream that left alive)."""
        self._drop_stale(every=True)
        heap.shrink(self)

    def in_use(self) -> int:
        """Bytes of every segment in use and every reserve."""
        return self._segment_bytes + self._reserve_bytes

    def reserved(self) -> int:
        """Bytes of every reserve (what :meth:`acquire` may take back)."""
        return self._reserve_bytes

    def check_counts(self) -> None:
        """Assert the kept byte counts equal the sums they stand for (for the tests)."""
        assert self._segment_bytes == sum(s.size for s in self._segments), "segment bytes drifted"
        held: Dict[bytes, int] = {}
        for s in self.retiring:
            if s.segment is not None:
                held[s.ident] = held.get(s.ident, 0) + 1
        assert self._retiring_held == held, "the retiring streams' count per client drifted"
        assert self._reserve_bytes == sum(s.size for s in self._reserve.values()), "reserve bytes drifted"
        live = list(self._live())
        quiet = {q for q in live if q.segment is not None and q.state.settled}
        assert set(self._quiet) == quiet, "the quiet index differs from the walk"
        assert all(self._quiet[q].asked_at == q.asked_at for q in quiet), "a quiet stream is indexed by an old ask"
        assert self._due_bytes + self._later_bytes == sum(q.segment.size for q in quiet), "quiet bytes drifted"
        settling = {q for q in live if q.segment is not None and q.state.caught_up and not q.state.settled}
        assert set(self._settling) == settling, "the settling index differs from the walk"
        assert self._settling_bytes == sum(q.segment.size for q in settling), "settling bytes drifted"
        headroom = max((x.nbytes for x in live if not x.lookahead), default=0)
        assert self._lookahead_headroom() == headroom, "the largest current epoch's slots drifted"
        assert len(self._due) + len(self._later) <= 64 + 4 * len(self._quiet), "stale quiet entries pile up"
        assert len(self._largest) == len(self._in_largest), "a size is queued twice"

    def _add_segment(self, seg: Segment) -> None:
        self._segments.add(seg)
        self._segment_bytes += seg.size

    def _drop_segment(self, seg: Segment) -> None:
        if seg in self._segments:
            self._segments.remove(seg)
            self._segment_bytes -= seg.size

    def _keep_reserve(self, ident: bytes, seg: Segment) -> None:
        self._reserve[ident] = seg
        self._reserve_bytes += seg.size

    def _take_reserve(self, ident: Optional[bytes] = None) -> Optional[Segment]:
        """``ident``'s reserve (None: the oldest one), no longer a reserve; None if there is none."""
        if ident is None:
            if not self._reserve:
                return None
            ident = next(iter(self._reserve))
        seg = self._reserve.pop(ident, None)
        if seg is not None:
            self._reserve_bytes -= seg.size
        return seg

    def names(self) -> List[str]:
        """The name of every segment it holds and has not unlinked; safe from another thread (each
        copy is made in one step under the GIL)."""
        return [s.name for s in self._held()]

    def _held(self) -> List[Segment]:
        """Every segment it holds: in use, kept as reserves, dropped but still mapped."""
        return list(self._segments) + list(self._reserve.values()) + list(self._closing)

    def held_by(self, ident: bytes) -> int:
        """Bytes of ``ident``'s reserve."""
        return self._reserve[ident].size if ident in self._reserve else 0

    def acquire(self, ident: bytes, nbytes: int, what: str, headroom: int = 0) -> Segment:
        """A segment of ``nbytes`` for ``ident``'s new stream: its reserve if that has the size,
        else a new one. ``headroom``: bytes that must still be free afterwards (a lookahead
        leaves room for a current epoch). Raises :class:`NoCapacity` (``what`` describes the
        request); a refused connection keeps its reserve. Lends nothing (see :meth:`open`)."""
        reserve = self._take_reserve(ident)
        reuse = reserve is not None and reserve.size == nbytes
        if reserve is not None and not reuse:
            self._drop(reserve)  # another shape of job: its memory goes back before the check
        if not reuse or headroom:
            while self._reserve and self.in_use() + nbytes + headroom > self.max_bytes:
                self._drop(self._take_reserve())  # oldest first
            in_use = self.in_use()
            if in_use + nbytes + headroom > self.max_bytes:
                if reuse:
                    self._keep_reserve(ident, reserve)
                if headroom:
                    raise NoCapacity(
                        f"{nbytes / 2**20:.1f} MiB of batch slots ({what}) would leave less than "
                        f"{headroom / 2**20:.1f} MiB for a current epoch ({in_use / 2**20:.1f} of "
                        f"{self.max_bytes / 2**20:.0f} MiB in use)")
                raise NoCapacity(f"this job needs {nbytes / 2**20:.1f} MiB of batch slots ({what}) but "
                                 f"{in_use / 2**20:.1f} of {self.max_bytes / 2**20:.0f} MiB are in use by "
                                 f"{len(self._segments)} running streams")
        seg = reserve if reuse else self._create(nbytes, what)
        self._add_segment(seg)
        return seg

    def _create(self, nbytes: int, what: str) -> Segment:
        """A new segment; reserves give their filesystem space back (oldest first) if it is full."""
        while True:
            try:
                return self._allocate(nbytes, "slots")
            except NoSpace as exc:
                if not self._reserve:
                    raise NoShmSpace(f"this job needs {nbytes / 2**20:.1f} MiB of batch slots ({what}) but "
                                     f"{exc.strerror}") from None
                self._drop(self._take_reserve())

    def release(self, segment: Segment, ident: Optional[bytes]) -> None:
        """Nothing reads ``segment`` any more: keep it as ``ident``'s reserve (if it has none and
        is still connected), else unmap it."""
        self._drop_segment(segment)
        if ident is not None and ident not in self._reserve:
            self._keep_reserve(ident, segment)
        else:
            self._drop(segment)

    def _drop(self, segment: Segment) -> None:
        try:
            segment.close()
        except BufferError:
            # a zmq frame may hold its view a moment after its send tracker said done (pyzmq lets
            # go of zero-copy buffers on a thread of its own): unmapped once it has let go
            self._closing.append(segment)
        self._unlinked.append(segment.name)

    def _close_let_go(self) -> None:
        """Unmap the dropped segments whose last view has gone since."""
        left = []
        for seg in self._closing:
            try:
                seg.close()
            except BufferError:
                left.append(seg)
        self._closing = left

    def forget(self, ident: bytes) -> None:
        """``ident`` is gone: its reserve goes back."""
        seg = self._take_reserve(ident)
        if seg is not None:
            self._drop(seg)

    # ------------------------------------------------------------------ streams
    def open(self, o: Opening, now: float) -> Union[Stream, NoSlots, None]:
        """Slots for a new stream: the :class:`Stream` on them, a refusal, or None: it waits in
        :attr:`waiting` for memory that ending or quiet streams hold, or for its client to catch up
        (:meth:`behind`), and :meth:`retry` (or :meth:`reopen`) opens it."""
        behind = self.behind(o.ident)
        if behind:
            if o.hello.lookahead:
                return NoSlots(f"lookahead refused: {behind}", fatal=False)
            self.waiting[o.ident] = o
            return None
        try:
            if o.hello.lookahead:  # best effort: never at the cost of a current epoch, lent slots included
                segment = self.acquire(o.ident, o.nbytes, o.what, headroom=self._lookahead_headroom())
            else:
                segment = self._acquire_lending(o.ident, o.nbytes, o.what, now)
        except NoCapacity as exc:
            if o.hello.lookahead:  # the client starts the epoch plainly when it comes
                return NoSlots(f"lookahead refused: {exc}", fatal=False)
            if isinstance(exc, NoShmSpace):  # the filesystem is full: streams that end would not help
                return NoSlots(f"{exc}; or lower prefetch or batch size")
            if self._will_fit(o.nbytes):
                self.waiting[o.ident] = o
                return None
            return NoSlots(f"{exc}; lower prefetch or batch size, or {self.hint}")
        try:
            s = o.open(segment, now)
        except BaseException:
            self.release(segment, None)  # never leak the slots of a stream that did not open
            raise
        # indexed at once: a stream that asks for nothing yet is quiet from its first moment, so
        # what waits behind it in this same retry may take its slots (with the reclaim time)
        self.changed(s)
        return s

    def wake(self, s: Stream, now: float) -> None:
        """``s`` was asked for work: if it lent its slots, slots again, or it waits for them."""
        if s.segment is not None or s.state.done or s.state.settled:
            return
        try:
            s.segment = self._acquire_lending(s.ident, s.nbytes, s.what, now)
        except NoCapacity:
            if s.life is not Life.STARVED:
                self.starved.append(s)
                self._moved(s)
                self._line(logging.INFO, "client %s stream %d waits for %.1f MiB of slots (in use by other jobs)",
                           s.ident.hex()[:12], s.id, s.nbytes / 2**20)
            return
        if s.life is Life.STARVED:
            self.starved.remove(s)
        self.changed(s)
        self._woken.append(s)

    def retire(self, s: Stream, now: float) -> List[Tuple[Opening, Opened]]:
        """``s`` is no longer served: its state retires, and its slots go back once no task or
        send still uses them (at once if none does: then what waits is retried, see :meth:`retry`)."""
        if s in self.retiring:
            return []
        s.state.retire()
        self.retiring.append(s)
        if s.segment is not None:  # a retiring stream's segment stays as it is until it goes back
            self._retiring_held[s.ident] = self._retiring_held.get(s.ident, 0) + 1
        self.changed(s)
        return self.release_idle(now)

    def release_idle(self, now: float) -> List[Tuple[Opening, Opened]]:
        """Give back the slots of retired streams that nothing reads any more (as their
        connection's reserve while it is connected); if any came back, :meth:`retry`."""
        if self._closing:
            self._close_let_go()
        if not self.retiring:
            return []
        keep, gone = [], []
        for s in self.retiring:
            if s.state.idle:
                if s.segment is not None:
                    self.release(s.segment, s.ident if self._connected(s.ident) else None)
                    self._retiring_held[s.ident] -= 1
                    if not self._retiring_held[s.ident]:
                        del self._retiring_held[s.ident]
                gone.append(s)
            else:
                keep.append(s)
        released = len(keep) < len(self.retiring)
        self.retiring = keep
        for s in gone:
            self._moved(s)
        return self.retry(now) if released else []

    def leave(self, ident: bytes, s: Optional[Stream], now: float) -> List[Tuple[Opening, Opened]]:
        """Connection ``ident`` is gone, ``s`` the stream it was served: nothing of it waits any
        more, its stream retires, its reserve goes back; then what waits is retried."""
        self.waiting.pop(ident, None)
        self.moved_on(ident, s)
        opened = self.retire(s, now) if s is not None else []
        self.forget(ident)
        return opened + self.retry(now)

    def moved_on(self, ident: bytes, s: Optional[Stream]) -> None:
        """Client ``ident`` moved on (a new Hello, or its connection is gone): it reads nothing more
        of ``s`` or of its retired streams, so what it borrowed of them is theirs again (dispatch/local.py)."""
        for x in [*self.retiring, s]:
            if x is not None and x.ident == ident:
                local.give_back(x)

    def behind(self, ident: bytes) -> str:
        """Why client ``ident`` is behind in reading what its earlier streams were sent (its new
        stream waits till it catches up: see the module docstring), or "" if it is not."""
        if self._unflushed(ident):
            return "its client has not yet read what came before the Accept of its last stream"
        held = self._retiring_held.get(ident, 0)
        if held > RETIRING_HELD_MAX:
            return f"{held} of its replaced streams still hold slots for batches its client has not read"
        return ""

    def reopen(self, ident: bytes, now: float) -> List[Tuple[Opening, Opened]]:
        """Client ``ident`` caught up with what it was sent: its new stream, if one waits, is
        tried again (as :meth:`retry` does)."""
        o = self.waiting.pop(ident, None)
        if o is None:
            return []
        try:
            result: Optional[Opened] = self.open(o, now)
        except Exception as exc:
            result = Broke(f"{type(exc).__name__}: {exc}", traceback.format_exc())
        return [] if result is None else [(o, result)]

    def retry(self, now: float) -> List[Tuple[Opening, Opened]]:
        """Retry whatever waits for slots: new streams first (oldest first), then lent ones.
        Returns the new streams that stopped waiting: opened, or refused now that they no
        longer fit even once the ending and quiet streams give their slots back."""
        out: List[Tuple[Opening, Opened]] = []
        for ident in list(self.waiting):
            out.extend(self.reopen(ident, now))
        for s in list(self.starved):
            if s.state.done:  # retired (a stream that is replaced or whose client left is)
                self.starved.remove(s)
            else:
                self.wake(s, now)
        return out

    def next_lend_at(self, now: float) -> Optional[float]:
        """When the next quiet stream's slots become lendable, if something waits for slots.
        (Streams lendable already were tried when that wait began or memory last came back.)"""
        self._lend_due = None
        if self.waiting or self.starved:
            self._advance(now)
            s = self._top(self._later)
            self._lend_due = None if s is None else self._quiet[s].asked_at + self.reclaim_idle_s
        return self._lend_due

    def lend_if_due(self, now: float) -> List[Tuple[Opening, Opened]]:
        """While something waits for slots: :meth:`retry` it when a quiet stream's slots may be
        lent (its quiet time is up, or it went quiet after its time was up)."""
        if not self.waiting and not self.starved:
            return []
        self._advance(now)
        if (self._lend_due is not None and now >= self._lend_due) or self._top(self._due) is not None or self._lent:
            self._lend_due, self._lent = None, False
            return self.retry(now)
        return []

    def stop(self) -> None:
        """Nothing opens or takes slots again any more (the service is stopping)."""
        self.waiting, self.starved = {}, []

    def close(self) -> None:
        """Unmap everything (after zmq has released every frame). Idempotent."""
        self.stop()
        self.retiring = []
        self._retiring_held.clear()
        for seg in self._held():
            seg.close()
        self._closing = []
        self._segments.clear()
        self._reserve.clear()
        self._segment_bytes = self._reserve_bytes = 0
        self._quiet.clear()
        self._settling.clear()
        self._settling_bytes = 0
        self._current.clear()
        self._current_sizes.clear()
        self._due, self._later, self._largest = [], [], []
        self._in_largest.clear()
        self._due_bytes = self._later_bytes = 0

    # ------------------------------------------------------------------ the indexes
    def changed(self, s: Stream) -> None:
        """An event may have changed ``s`` (its state, slots, last ask or lookahead flag): its
        place in the indexes follows. Cheap; call it after every such event."""
        current = not s.state.done and not s.lookahead
        if current and s not in self._current:
            self._current[s] = s.nbytes
            self._current_sizes[s.nbytes] = self._current_sizes.get(s.nbytes, 0) + 1
            if s.nbytes not in self._in_largest:
                self._in_largest.add(s.nbytes)
                heapq.heappush(self._largest, -s.nbytes)
        elif not current and s in self._current:
            size = self._current.pop(s)
            self._current_sizes[size] -= 1
            if not self._current_sizes[size]:
                del self._current_sizes[size]
        settling = s.segment is not None and s.state.caught_up and not s.state.settled
        if settling != (s in self._settling):
            if settling:
                self._settling[s] = s.segment.size
                self._settling_bytes += s.segment.size
            else:
                self._settling_bytes -= self._settling.pop(s)
        quiet = s.segment is not None and s.state.settled
        entry = self._quiet.get(s)
        if entry is not None and (not quiet or entry.asked_at != s.asked_at):
            self._unquiet(s)
            entry = None
        if quiet and entry is None:
            q = self._quiet[s] = _Quiet(s.asked_at, next(self._seq), s.segment.size)
            self._later_bytes += q.size  # _advance moves it to _due when its quiet time is up
            heapq.heappush(self._later, (q.asked_at, q.seq, s))
        self._drop_stale()
        self._moved(s)

    def _drop_stale(self, every: bool = False) -> None:
        """Rebuild the queues without their stale entries once those are most of them (or ``every``
        time)."""
        if every or len(self._due) + len(self._later) > 64 + 4 * len(self._quiet):
            for queue in (self._due, self._later):
                queue[:] = [e for e in queue if self._quiet.get(e[2]) is not None and self._quiet[e[2]].seq == e[1]]
                heapq.heapify(queue)

    def _unquiet(self, s: Stream) -> None:
        q = self._quiet.pop(s)  # its queue entry is stale from now on
        if q.due:
            self._due_bytes -= q.size
        else:
            self._later_bytes -= q.size

    def _advance(self, now: float) -> None:
        """Quiet streams whose quiet time is up move to ``_due`` (in the order of their last ask)."""
        while self._top(self._later) is not None:
            asked_at, _, s = self._later[0]
            if now - asked_at < self.reclaim_idle_s:
                return
            heapq.heappop(self._later)
            q = self._quiet[s]
            q.due = True
            self._later_bytes -= q.size
            self._due_bytes += q.size
            heapq.heappush(self._due, (asked_at, q.seq, s))

    def _top(self, queue: List[Tuple[float, int, Stream]]) -> Optional[Stream]:
        """The stream of the first live entry of ``queue`` (stale entries are popped)."""
        while queue:
            _, seq, s = queue[0]
            q = self._quiet.get(s)
            if q is not None and q.seq == seq:
                return s
            heapq.heappop(queue)
        return None

    # ------------------------------------------------------------------ status
    def _moved(self, s: Stream) -> None:
        """``s`` may have moved on in its life: its ``life`` follows, if :data:`MAY_BECOME` allows
        the move (else a bug: raised, and the dispatcher fails that client alone)."""
        new = self.life(s)
        if new is not s.life:
            if new not in MAY_BECOME[s.life]:
                raise AssertionError(f"stream {s.id} of client {s.ident.hex()[:12]} cannot go from {s.life.value} "
                                     f"to {new.value}")
            s.life = new

    def life(self, s: Union[Stream, Opening]) -> Life:
        """Where ``s`` is in its life (:class:`~loader_service.dispatch.door.Life`), worked out from
        the one place each part of it is kept: this memory's lists and the stream's state. A
        stream's ``life`` is this, kept at every move (:meth:`_moved`)."""
        if isinstance(s, Opening):
            return Life.WAITING if self.waiting.get(s.ident) is s else Life.ENDED
        if s.state.done:  # ending while a task or a send still reads its slots
            return Life.ENDING if not s.state.idle and s in self.retiring else Life.ENDED
        if s.segment is None:  # a starved stream has no slots either: the list is walked for those alone
            return Life.STARVED if s in self.starved else Life.LENT
        if s.state.settled:
            return Life.QUIET
        return Life.CAUGHT_UP if s.state.caught_up else Life.RUNNING

    def slots_word(self, ident: bytes, s: Optional[Stream]) -> str:
        """The ``slots`` field of ClientStatus for connection ``ident`` serving ``s`` (see there)."""
        if ident in self.waiting or (s is not None and s in self.starved):
            return "waiting"
        if s is not None:
            return "stream" if s.segment is not None else "lent"
        return "reserve" if self.held_by(ident) else ""

    def slot_bytes(self, ident: bytes, s: Optional[Stream]) -> int:
        """Bytes connection ``ident`` holds: its stream's slots and its reserve."""
        return (s.segment.size if s is not None and s.segment is not None else 0) + self.held_by(ident)

    # ------------------------------------------------------------------ internals
    def _acquire_lending(self, ident: bytes, nbytes: int, what: str, now: float) -> Segment:
        """:meth:`acquire`, lending the slots of quiet streams (longest quiet first) if that
        makes room. Raises NoCapacity."""
        while True:
            try:
                return self.acquire(ident, nbytes, what)
            except NoCapacity:
                self._advance(now)
                first = self._top(self._due)
                if first is None or self.in_use() - self._due_bytes - self.reserved() + nbytes > self.max_bytes:
                    raise  # lending would not make room: lend nothing
                if first.segment is None or not first.state.settled:  # an event nobody reported: never lend
                    log.error("client %s stream %d was indexed as quiet while in use", first.ident.hex()[:12], first.id)
                    self.changed(first)
                    continue
                self._lend(first, now)

    def _lend(self, s: Stream, now: float) -> None:
        self._lent = True  # what it frees beyond the need at hand may fit a stream that waits
        self._unquiet(s)
        self._drop_stale()
        self.release(s.segment, None)
        s.segment = None
        self._moved(s)
        self._line(logging.INFO, "client %s stream %d has asked for nothing for %.0fs: its %.1f MiB of slots go to a "
                   "job that needs them", s.ident.hex()[:12], s.id, now - s.asked_at, s.nbytes / 2**20)

    def _will_fit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit once the streams ending now and the quiet ones (when their quiet
        time is up; the caught-up ones once their sends are let go of) give their slots back:
        then a new stream waits rather than being refused."""
        ending = sum(s.segment.size for s in self.retiring if s.segment is not None)
        quiet = self._due_bytes + self._later_bytes + self._settling_bytes
        return self.in_use() - self.reserved() - ending - quiet + nbytes <= self.max_bytes

    def _lookahead_headroom(self) -> int:
        """What a lookahead must leave free: room for a plain stream as large as the largest one
        live, so an early next epoch never crowds out a current one."""
        while self._largest and -self._largest[0] not in self._current_sizes:
            self._in_largest.discard(-heapq.heappop(self._largest))  # no current epoch of that size any more
        return -self._largest[0] if self._largest else 0


def slot_cap(max_shm_bytes: int) -> Tuple[int, str]:
    """The cap on batch slots, and what raises it: --max-shm-mb, or what the shared-memory
    filesystem has free if that is less (a container started without shm_size has 64 MB), so
    the memory policy plans with memory that exists."""
    room = shm.free_bytes()
    if room >= max_shm_bytes:
        return max_shm_bytes, "raise --max-shm-mb"
    log.warning("%s has %.0f MiB free, less than --max-shm-mb %.0f: batch slots are capped at %.0f MiB; raise the "
                "container's shm_size (or the emptyDir's sizeLimit)", shm.SHM_DIR, room / 2**20, max_shm_bytes / 2**20,
                room / 2**20)
    return max(room, 1), (f"raise the container's shm_size or the emptyDir's sizeLimit ({shm.SHM_DIR} had "
                          f"{room / 2**20:.0f} MiB free at start, less than --max-shm-mb)")

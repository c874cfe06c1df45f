"""One stream's batches as a pure state machine: events in, effects out.

A *stream* is one client connection's pass over the batches of one rank's epoch plan that
its client asks of this replica, in the order asked. Its state is which batches were asked
(``order``), which slot each batch is being written into, which batches are done but not yet
sent, and which slots are still read by a send.

No sockets, shared memory, processes or clocks here: the dispatcher turns its I/O into
events (``extend``, ``next_task``, ``task_done``, ``task_lost``, ``send_complete``,
``retire``) and applies the effects they return (:class:`SendBatch`, :class:`Finish`,
:class:`Fail`). That is what lets ``tests/unit/dispatch/test_stream_state.py`` drive it through random
interleavings and check, after every step, that every slot is accounted for exactly once.

Rules:

* a batch is computed only once it is asked for and a slot is free, so memory in flight is
  bounded by the slots;
* batches leave strictly in ``order``, each exactly once;
* a task whose worker was lost (crash, or killed past its deadline) is redone; a batch that
  lost ``isolate_after`` workers is redone one sample per task in its slot, and a sample that
  loses ``max_sample_attempts`` workers by itself is judged by ``on_error``: skipped (reported
  with the batch) or the stream fails naming the file;
* more than ``max_skipped`` skipped samples fail the stream with the list (0: no cap).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

SAMPLE_FAILED = "sample_failed"  # the same string as protocol.ErrorCode.SAMPLE_FAILED
TOO_MANY_SKIPPED = "too_many_skipped"


@dataclass(frozen=True)
class StreamLimits:
    """The failure policy of a stream (from the service configuration)."""

    on_error: str = "raise"  # "raise" | "skip"
    max_skipped: int = 0  # skipped samples a stream may deliver before it fails; 0: no cap
    isolate_after: int = 2  # workers a batch may lose before it is redone one sample per task
    max_sample_attempts: int = 2  # workers one sample may lose before it is judged by on_error

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.max_skipped < 0 or self.isolate_after < 1 or self.max_sample_attempts < 1:
            raise ValueError("max_skipped must be >= 0, isolate_after and max_sample_attempts >= 1")


# ---------------------------------------------------------------------------- effects
@dataclass(frozen=True)
class RunTask:
    """Compute ``batch`` into ``slot``: the whole batch (``pos == -1``), or only the sample at
    position ``pos``, written at that position (a batch being isolated)."""

    task: int
    batch: int
    slot: int
    pos: int = -1


@dataclass(frozen=True)
class SendBatch:
    """Send ``batch`` from ``slot``. ``skipped``: ``(position, dataset index, reason)`` of the
    samples left out. With ``compact`` the kept samples sit at their positions and must be moved
    to the front first; otherwise the worker already wrote them contiguously."""

    batch: int
    slot: int
    skipped: Tuple[Tuple[int, int, str], ...] = ()
    compact: bool = False


@dataclass(frozen=True)
class Finish:
    """Every batch of the stream has been sent."""


@dataclass(frozen=True)
class Fail:
    """The stream cannot go on; tell the client why."""

    code: str
    message: str
    traceback: str = ""


Effect = Union[SendBatch, Finish, Fail]


@dataclass
class _Task:
    batch: int
    slot: int
    pos: int  # -1: whole batch


@dataclass
class _Isolation:
    """A batch being redone one sample per task because it kept losing workers."""

    slot: int
    todo: List[int]  # positions not dispatched yet
    pending: Set[int]  # positions not finished yet (dispatched or not)
    attempts: Dict[int, int] = field(default_factory=dict)  # position -> workers lost on it
    skipped: List[Tuple[int, int, str]] = field(default_factory=list)


class StreamState:
    """See the module docstring. ``batch_indices(b)`` gives the dataset indices of batch ``b``
    (from the epoch plan); ``describe(i)`` names sample ``i`` (a path) for error messages."""

    def __init__(self, order: Sequence[int], num_slots: int,
                 batch_indices: Callable[[int], Sequence[int]], describe: Callable[[int], str],
                 limits: StreamLimits = StreamLimits(), final: bool = False):
        if num_slots < 1:
            raise ValueError("a stream needs at least one slot")
        self.order: List[int] = [int(b) for b in order]  # the batches asked, in the order asked
        self._pos: Dict[int, int] = {b: i for i, b in enumerate(self.order)}
        if len(self._pos) != len(self.order):
            raise ValueError("a stream's order lists a batch twice")
        self.num_slots = num_slots
        self.final = final  # no batch will be added to ``order``
        self.limits = limits
        self._indices, self._describe = batch_indices, describe
        self.free: List[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.tasks: Dict[int, _Task] = {}
        self.redo: List[Tuple[int, int]] = []  # heap of (position in order, batch)
        self.isolated: Dict[int, _Isolation] = {}
        self.attempts: Dict[int, int] = {}  # batch -> workers lost on it
        # batches made and not yet sent (they leave in order): batch -> (slot, skipped, compact)
        self.made: Dict[int, Tuple[int, Tuple[Tuple[int, int, str], ...], bool]] = {}
        self.sending: Set[int] = set()
        self.next_dispatch = 0
        self.next_send = 0
        self.skipped = 0
        self.skipped_list: List[Tuple[int, str]] = []  # (dataset index, reason), capped for the report
        self.done = False  # finished, failed or retired: nothing more is dispatched or sent

    # ------------------------------------------------------------------ events
    def start(self) -> List[Effect]:
        """Effects of creating the stream (an empty stream is finished at once)."""
        return self._flush()

    def extend(self, batches: Sequence[int], final: bool = False) -> List[Effect]:
        """Append the batches a client asked for to the order."""
        for b in batches:
            b = int(b)
            if b in self._pos:
                raise ValueError(f"batch {b} is already part of this stream")
            self._pos[b] = len(self.order)
            self.order.append(b)
        self.final = self.final or final
        return self._flush()

    def has(self, batch: int) -> bool:
        """Whether ``batch`` is part of the order already."""
        return batch in self._pos

    def dispatchable(self) -> bool:
        """Whether :meth:`next_task` would return a task now."""
        if self.done:
            return False
        if any(iso.todo for iso in self.isolated.values()):
            return True
        if not self.free:
            return False
        return bool(self.redo) or self.next_dispatch < len(self.order)

    def next_task(self, task_id: int) -> Optional[RunTask]:
        """The next piece of work for an idle worker, or None."""
        if not self.dispatchable():
            return None
        for batch, iso in self.isolated.items():
            if iso.todo:
                t = _Task(batch, iso.slot, iso.todo.pop(0))
                break
        else:
            if self.redo:
                _, batch = heapq.heappop(self.redo)
            else:
                batch = self.order[self.next_dispatch]
                self.next_dispatch += 1
            t = _Task(batch, self.free.pop(), -1)
        self.tasks[task_id] = t
        return RunTask(task_id, t.batch, t.slot, t.pos)

    def task_done(self, task_id: int, skipped: Sequence[Tuple[int, int, str]] = (), error: str = "",
                  traceback: str = "") -> List[Effect]:
        """A worker finished ``task_id``. ``skipped``: (position in the task, index, reason) of
        samples left out under on_error=skip; ``error``: the task failed (on_error=raise)."""
        t = self.tasks.pop(task_id, None)
        if t is None or self.done:
            return []
        if error:
            self._release(t)
            return self._fail(SAMPLE_FAILED, error, traceback)
        if t.pos >= 0:
            iso = self.isolated[t.batch]
            iso.pending.discard(t.pos)
            iso.skipped += [(t.pos, int(idx), str(why)) for _, idx, why in skipped]
            return self._finish_isolated(t.batch)
        self.made[t.batch] = (t.slot, tuple((int(p), int(i), str(r)) for p, i, r in skipped), False)
        return self._flush()

    def task_lost(self, task_id: int, reason: str) -> List[Effect]:
        """The worker running ``task_id`` is gone (it died, or was killed past its deadline)."""
        t = self.tasks.pop(task_id, None)
        if t is None or self.done:
            return []
        if t.pos >= 0:
            return self._sample_lost(t, reason)
        self.attempts[t.batch] = self.attempts.get(t.batch, 0) + 1
        if self.attempts[t.batch] >= self.limits.isolate_after:
            n = len(self._indices(t.batch))
            self.isolated[t.batch] = _Isolation(t.slot, list(range(n)), set(range(n)))
            return []
        self.free.append(t.slot)
        heapq.heappush(self.redo, (self._position(t.batch), t.batch))
        return []

    def _position(self, batch: int) -> int:
        return self._pos[batch]

    def task_returned(self, task_id: int) -> None:
        """``task_id``'s worker is gone, but not while running it (it was queued behind, or done
        with its Done not read): it is done again, and no loss counts against its batch or sample."""
        t = self.tasks.pop(task_id, None)
        if t is None or self.done:
            return
        if t.pos >= 0:
            self.isolated[t.batch].todo.insert(0, t.pos)
            return
        self.free.append(t.slot)
        heapq.heappush(self.redo, (self._position(t.batch), t.batch))

    def send_complete(self, slot: int) -> None:
        """The send that read ``slot`` is complete: the slot may be written again."""
        self.sending.remove(slot)
        self.free.append(slot)

    def retire(self) -> None:
        """Stop: nothing more is dispatched or sent. Tasks in flight and sends still reading
        slots are waited for (see :attr:`idle`); their results are dropped."""
        if self.done:
            return
        self.done = True
        for slot, _, _ in self.made.values():
            self.free.append(slot)
        for batch, iso in self.isolated.items():
            if not any(t.batch == batch for t in self.tasks.values()):
                self.free.append(iso.slot)  # no one-sample task still writes into it
        self.made.clear()
        self.redo.clear()
        self.isolated.clear()

    # ------------------------------------------------------------------ views
    @property
    def idle(self) -> bool:
        """Retired and nothing (a task or a send) still uses any slot: the memory may go."""
        return self.done and not self.tasks and not self.sending

    @property
    def caught_up(self) -> bool:
        """Live, and every batch asked for is made and sent: at most sends still read slots
        (libzmq lets go of a sent frame a moment later). Settled once they complete."""
        return not self.done and not self.tasks and not self.made and not self.isolated and self.not_started == 0

    @property
    def settled(self) -> bool:
        """Caught up, with no slot in use: its slots could be lent out and taken again later
        without losing anything."""
        return self.caught_up and not self.sending

    @property
    def not_started(self) -> int:
        """Batches asked for that no worker has started yet."""
        return len(self.order) - self.next_dispatch + len(self.redo)

    @property
    def to_send(self) -> int:
        return len(self.order)

    def slot_holders(self) -> Dict[int, str]:
        """Who holds each slot (for invariant checks and status): free, task, isolated, made, sending."""
        out: Dict[int, str] = {}

        def put(slot: int, what: str) -> None:
            if slot in out:
                raise AssertionError(f"slot {slot} is both {out[slot]} and {what}")
            out[slot] = what

        for s in self.free:
            put(s, "free")
        for iso in self.isolated.values():
            put(iso.slot, "isolated")
        for t in self.tasks.values():
            if t.pos < 0:
                put(t.slot, "task")
            elif t.batch not in self.isolated:
                put(t.slot, "task")  # a one-sample task of a batch dropped by retire or fail
        for s, _, _ in self.made.values():
            put(s, "made")
        for s in self.sending:
            put(s, "sending")
        return out

    # ------------------------------------------------------------------ internals
    def _sample_lost(self, t: _Task, reason: str) -> List[Effect]:
        iso = self.isolated[t.batch]
        iso.attempts[t.pos] = iso.attempts.get(t.pos, 0) + 1
        if iso.attempts[t.pos] < self.limits.max_sample_attempts:
            iso.todo.insert(0, t.pos)  # once more, in case it was not this sample's fault
            return []
        idx = int(self._indices(t.batch)[t.pos])
        why = f"{reason} ({iso.attempts[t.pos]} workers lost on this sample)"
        if self.limits.on_error == "skip":
            iso.pending.discard(t.pos)
            iso.skipped.append((t.pos, idx, why))
            return self._finish_isolated(t.batch)
        self._release(t)
        return self._fail(SAMPLE_FAILED, f"sample {idx} ({self._describe(idx)}): {why}")

    def _finish_isolated(self, batch: int) -> List[Effect]:
        iso = self.isolated[batch]
        if iso.pending:
            return []
        del self.isolated[batch]
        skipped = tuple(sorted(iso.skipped))
        self.made[batch] = (iso.slot, skipped, bool(skipped))
        return self._flush()

    def _release(self, t: _Task) -> None:
        """Give back the slot of a task that failed (an isolated batch's slot, once)."""
        if t.pos < 0:
            self.free.append(t.slot)
        elif self.isolated.pop(t.batch, None) is not None and not any(
                x.batch == t.batch for x in self.tasks.values()):
            self.free.append(t.slot)

    def _flush(self) -> List[Effect]:
        out: List[Effect] = []
        while self.next_send < len(self.order) and self.order[self.next_send] in self.made:
            batch = self.order[self.next_send]
            slot, skipped, compact = self.made.pop(batch)
            self.next_send += 1
            if skipped:
                self.skipped += len(skipped)
                self.skipped_list += [(i, r) for _, i, r in skipped][: max(0, 100 - len(self.skipped_list))]
                cap = self.limits.max_skipped
                if cap and self.skipped > cap:
                    self.free.append(slot)
                    listed = "; ".join(f"{i} ({self._describe(i)}): {r}" for i, r in self.skipped_list[:20])
                    return out + self._fail(TOO_MANY_SKIPPED, (
                        f"{self.skipped} samples skipped in this stream, more than max_skipped={cap}; "
                        f"is the dataset damaged? first ones: {listed}"))
            self.sending.add(slot)
            out.append(SendBatch(batch, slot, skipped, compact and bool(skipped)))
        if self.final and self.next_send == len(self.order) and not self.done:
            self.done = True
            out.append(Finish())
        return out

    def _fail(self, code: str, message: str, traceback: str = "") -> List[Effect]:
        self.retire()
        return [Fail(code, message, traceback)]

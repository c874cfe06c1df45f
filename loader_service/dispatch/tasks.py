"""Tasks on workers: which runs where, since when, and until when (its deadline, from
:class:`~loader_service.dispatch.deadlines.TaskDeadlines`).

Pure: the clock is passed in. The loop hands each task's message to the worker pool, kills
the worker of a task that :meth:`Tasks.overdue` marks hung, and reports the task lost when
the worker is reaped (a stream's state then redoes it). A task queued behind its worker's
running one (``pool.QUEUE_DEPTH``) has a deadline after that one's until it :meth:`~Tasks.began`:
then its own clock starts, and only that time teaches the deadlines.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from wire import protocol as P
from loader_service.dispatch.deadlines import TaskDeadlines
from loader_service.dispatch import heap
from loader_service.dispatch.stream_state import RunTask
from loader_service.dispatch.streams import Stream


@dataclass
class Running:
    """A task on a worker."""

    stream: Stream
    worker: int
    samples: int
    started: float  # when it began on its worker (when it was queued, until :meth:`Tasks.began`)
    deadline: float
    hung: bool = False  # marked past its deadline: its worker is killed, its loss reported when it is reaped

    def lost_because(self, exit_described: str) -> str:
        """Why the task was lost, its worker having exited as ``exit_described``."""
        if self.hung:
            return f"hung: still running after its {self.deadline - self.started:.1f}s deadline (worker killed)"
        return f"crashed the decoder (worker {exit_described})"


class Tasks:
    def __init__(self, deadlines: TaskDeadlines, on_error: str):
        self.deadlines = deadlines
        self.on_error = on_error  # what workers do with a sample that fails (the service's --on-error)
        self.running: Dict[int, Running] = {}  # task id -> where it runs
        self._heap: List[Tuple[float, int]] = []  # (deadline, task id); a finished task's entry is dropped lazily
        self._ids = itertools.count()


    def compact(self) -> None:
        """Size its indexes to what they hold now (after many sessions left: see :mod:`.heap`)."""
        heap.shrink(self)
    def next_id(self) -> int:
        return next(self._ids)

    def start(self, s: Stream, t: RunTask, worker: int, now: float, behind: Optional[int] = None) -> P.Task:
        """``t`` of stream ``s`` goes to ``worker``: the message that tells the worker. ``behind``:
        the task it is queued behind on that worker (None: it starts now)."""
        batch = s.plan.batch(t.batch)
        if t.pos >= 0:
            indices, position = [int(batch[t.pos])], t.pos
        else:
            indices, position = batch.tolist(), 0
        h, p = s.hello, s.pipe
        task = P.Task(task=t.task, dataset=s.source.name, shm=s.segment.name, offset=t.slot * s.slot_bytes,
                      indices=indices, seed=h.spec.seed, epoch=h.epoch, on_error=self.on_error, pipeline=p.name,
                      target=p.target, pipeline_args=p.args, capacity=h.spec.batch_size, position=position)
        ahead = self.running.get(behind) if behind is not None else None
        deadline = max(now, ahead.deadline if ahead is not None else now) + self.deadlines.deadline_s(len(indices))
        self.running[t.task] = Running(s, worker, len(indices), now, deadline)
        heapq.heappush(self._heap, (deadline, t.task))
        return task

    def began(self, task_id: int, now: float) -> None:
        """The queued ``task_id`` is its worker's running task from ``now`` (the one ahead is done):
        its deadline counts from here."""
        r = self.running.get(task_id)
        if r is not None and not r.hung:
            r.started, r.deadline = now, now + self.deadlines.deadline_s(r.samples)
            heapq.heappush(self._heap, (r.deadline, task_id))

    def done(self, task_id: int, now: float) -> Optional[Running]:
        """A worker reported ``task_id`` done (its time teaches the deadlines). None: not ours."""
        r = self.running.pop(task_id, None)
        if r is not None:
            self.deadlines.observe(r.samples, now - r.started)
        return r

    def lost(self, task_id: int) -> Optional[Running]:
        """The worker of ``task_id`` is gone. None: not ours."""
        return self.running.pop(task_id, None)

    def overdue(self, now: float, on_it: Callable[[int, int], bool]) -> List[Tuple[int, Running]]:
        """Tasks past their deadline whose worker is still on them (``on_it(worker, task)``),
        now marked hung: their workers are to be killed."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, task_id = heapq.heappop(self._heap)
            r = self.running.get(task_id)
            if r is None or r.hung or r.deadline > now or not on_it(r.worker, task_id):
                continue  # done, marked already, moved by began (its new entry is in the heap), or not yet run
            r.hung = True
            out.append((task_id, r))
        return out

    def next_deadline(self) -> Optional[float]:
        """The earliest deadline of a running task (None: none runs)."""
        heap = self._heap
        while heap and (heap[0][1] not in self.running or self.running[heap[0][1]].deadline != heap[0][0]):
            heapq.heappop(heap)  # that task is done, or began since: no wake-up for this deadline
        return heap[0][0] if heap else None

    def of(self, s: Stream) -> List[Tuple[int, Running]]:
        """The running tasks of stream ``s``."""
        return [(tid, r) for tid, r in self.running.items() if r.stream is s]

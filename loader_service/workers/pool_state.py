"""The worker pool's bookkeeping: which workers exist, in which state, holding which tasks, and
what to start, stop and kill. No processes, no sockets: each decision takes ``now`` and returns the actions for :class:`~loader_service.workers.pool.WorkerPool` (the I/O
edge) to carry out, so every interleaving of scaling, readiness, finished tasks, exits and
deadlines can be driven by hand (tests/unit/workers/test_pool_state.py).

A worker's life: ``starting`` (process started, not Ready) -> ``idle`` <-> ``busy`` (holds tasks)
-> ``leaving`` (dismissed: finishes what it holds, or says Ready, before it is told to stop) ->
``stopping`` (told Stop) -> gone (its process exited, :meth:`PoolState.exited`). A worker whose
Ready carried an error is ``failed``. Scale-down dismisses, so no task is abandoned.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, NamedTuple, Optional, Set, Tuple, Union

log = logging.getLogger("loader_service.workers.pool")

MAX_START_FAILURES = 3
QUEUE_DEPTH = 2  # tasks a worker holds at most: the one it runs and the next
LIVE = ("starting", "idle", "busy")  # the states of workers that are, or will be, taking tasks

# What usually sends these signals to a decode worker: the words an operator needs first.
_SIGNAL_CAUSES = {
    signal.SIGKILL: "the kernel's OOM killer when memory runs out (see dmesg), or another process",
    signal.SIGBUS: "a memory-mapped file or shared memory whose pages could not be had (a full /dev/shm)",
    signal.SIGSEGV: "a crash in native decoding code",
}


def describe_exit(code: Optional[int]) -> str:
    """A worker's exit code in words: ``exit code 3``, or ``killed by SIGKILL (-9: the kernel's ...)``."""
    if code is None:
        return "exit code unknown"
    if code >= 0:
        return f"exit code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"killed by signal {-code}"
    cause = _SIGNAL_CAUSES.get(sig)
    return f"killed by {sig.name} ({code}{': ' + cause if cause else ''})"


@dataclass(frozen=True)
class Spawn:
    """Start the process of worker ``wid`` (its record exists, ``starting``)."""

    wid: int


@dataclass(frozen=True)
class TellStop:
    """Send worker ``wid`` a Stop."""

    wid: int


@dataclass(frozen=True)
class KillWorker:
    """SIGKILL worker ``wid``'s process; its exit is reported as for any other."""

    wid: int


Action = Union[Spawn, TellStop, KillWorker]


class Exit(NamedTuple):
    """What :meth:`PoolState.exited` learned of a worker's exit."""

    held: List[int]  # the tasks it held, in its order
    died_on: Optional[int]  # the one it died on (None: between tasks)
    actions: List[Action]  # replacements to start


@dataclass
class WorkerRecord:
    id: int
    state: str = "starting"  # starting | idle | busy | leaving | stopping | failed
    tasks: Deque[int] = field(default_factory=deque)  # the task ids it holds, in its order: the first runs
    pid: int = 0
    tasks_done: int = 0
    busy_s: float = 0.0
    started_at: float = 0.0
    ready: bool = False  # said Ready (without an error)
    start_hung: bool = False  # killed for not saying Ready within the start deadline
    stop_sent: Optional[float] = None  # when it was told Stop (None: not told)
    stop_hung: bool = False  # killed for not exiting within the stop deadline
    task_started: float = 0.0  # when its running task started (the previous one's Done, or its assignment)
    # Shared with the worker (set by the edge): [position in its task of the sample it is on (-1:
    # none), when that sample began (time.monotonic, one clock for all processes), the task it runs
    # (-1: none)]. Tells a waiting client which file a slow task is stuck on; two stores per sample.
    progress: Optional[Any] = None
    mapped: Set[str] = field(default_factory=set)  # segments its tasks wrote into: it may hold them mapped

    @property
    def killed(self) -> bool:
        """Killed at its start or stop deadline."""
        return self.start_hung or self.stop_hung

    @property
    def task(self) -> Optional[int]:
        """The task it is running (None: none)."""
        return self.tasks[0] if self.tasks else None

    def current_sample(self) -> Tuple[int, float]:
        """(position in the task, seconds on it) of the sample the worker is on; (-1, 0) if unknown."""
        if self.progress is None or self.task is None:
            return -1, 0.0
        pos, since = self.progress[0], self.progress[1]
        return (int(pos), max(0.0, time.monotonic() - since)) if pos >= 0 else (-1, 0.0)


class PoolState:
    """The records of the pool's workers and the decisions about them (see the module's docstring)."""

    def __init__(self, start_s: float = 120.0, stop_s: float = 10.0):
        self.start_s = start_s  # a worker not Ready this long after its start is killed
        self.stop_s = stop_s  # a worker not exited this long after its Stop is killed
        self.workers: Dict[int, WorkerRecord] = {}
        self.target = 0
        self._next_id = 0
        self.version = 0  # bumped whenever the set of processes changes (the edge re-registers sentinels)
        self.deaths = 0
        self.stop_kills = 0  # workers killed for not exiting within stop_s of their Stop
        self.start_failures = 0  # consecutive workers that died or failed before Ready
        self.broken = ""  # why workers cannot start; set after MAX_START_FAILURES in a row
        self._busy_gone = 0.0  # busy seconds of workers that have exited
        self.closed = False

    # ------------------------------------------------------------------ scaling
    def scale(self, n: int, now: float) -> List[Action]:
        """Set the target size. New workers start now; surplus ones leave once their tasks are done."""
        if n < 0:
            raise ValueError(f"worker count must be >= 0, got {n}")
        self.target = n
        return self._converge(now)

    def _converge(self, now: float) -> List[Action]:
        if self.closed:
            return []
        out: List[Action] = []
        # A failed worker is exiting (its Ready said why it could not start): replaced at its exit.
        live = [w for w in self.workers.values() if w.state in LIVE]
        # Coalesce: a worker asked to leave but not yet told Stop (starting, or busy) stays
        # instead of a new one starting, so a burst of scale requests converges to the latest
        # target without starting processes it would stop a moment later.
        for w in sorted(self.workers.values(), key=lambda w: w.id):
            if len(live) >= self.target:
                break
            if w.state == "leaving":
                w.state = "busy" if w.task is not None else ("idle" if w.ready else "starting")
                live.append(w)
        # At most twice the target processes at once (2 for a target of 0 or 1), those on their way
        # out counted: a storm of scale requests alternating small and large targets would start a
        # new set each time while the last is still exiting (their number then depends on how fast
        # processes exit). The rest start as those exit; where none is live, one starts whatever is
        # exiting. The stop deadline bounds how long an exiting one holds its place.
        # A broken pool starts none: they would only fail again (the dispatcher reports why).
        room = 0 if self.broken else max(2 * max(self.target, 1) - len(self.workers), 0 if live else 1)
        for _ in range(min(self.target - len(live), room)):
            wid, self._next_id = self._next_id, self._next_id + 1
            self.workers[wid] = WorkerRecord(wid, started_at=now)
            self.version += 1
            out.append(Spawn(wid))
        surplus = len(live) - self.target
        if surplus > 0:
            # leave idle workers first, then the ones that started last
            order = sorted(live, key=lambda w: (w.state != "idle", w.state != "starting", -w.id))
            for w in order[:surplus]:
                out.extend(self._dismiss(w, now))
        return out

    def _dismiss(self, w: WorkerRecord, now: float) -> List[Action]:
        if w.state == "idle":
            return [self._stop(w, now)]
        w.state = "leaving"  # busy: told to stop when its tasks are done; starting: once it says Ready
        return []

    def _stop(self, w: WorkerRecord, now: float) -> TellStop:
        w.state = "stopping"
        w.stop_sent = now
        return TellStop(w.id)

    # ------------------------------------------------------------------ what workers say
    def ready(self, wid: int, pid: int, error: str, now: float) -> Tuple[Optional[WorkerRecord], List[Action]]:
        """Worker ``wid`` said Ready (``error``: why it could not start, its traceback included)."""
        w = self.workers.get(wid)
        if w is None or w.state not in ("starting", "leaving") or w.ready:
            return w, []  # not one that waits for its Ready: a repeat is ignored
        w.pid = pid
        if error:
            log.error("worker %d could not start: %s", wid, error)
            w.state = "failed"
            self._start_failed(f"worker could not start: {error}")
            return w, []
        self.start_failures = 0
        w.ready = True
        if w.state == "leaving":
            return w, [self._stop(w, now)]
        w.state = "idle"
        return w, []

    def done(self, wid: int, task: int, now: float) -> Tuple[Optional[WorkerRecord], bool, List[Action]]:
        """Worker ``wid`` reported ``task`` done. Returns (its record, whether the report is the task
        it runs, actions)."""
        w = self.workers.get(wid)
        if w is None:
            return None, False, []
        if w.task != task:
            log.warning("worker %d reported task %d but runs %s", w.id, task, w.task)
            return w, False, []
        w.tasks.popleft()
        w.tasks_done += 1
        w.busy_s += now - w.task_started
        w.task_started = now  # its next task, if it holds one, starts now
        if w.tasks:
            return w, True, []
        if w.state == "leaving":
            return w, True, [self._stop(w, now)]
        w.state = "idle"
        return w, True, []

    def exited(self, wid: int, exitcode: Optional[int], on: int, now: float) -> Exit:
        """Worker ``wid``'s process exited (``on``: the task it recorded running, -1 none). Forgets
        it and replaces it if the pool is below target. The task it died on is the one the worker
        itself recorded: the Done of a task ahead of it may still be on its way, and the tasks behind
        it never began."""
        w = self.workers.pop(wid, None)
        if w is None:
            return Exit([], None, [])
        expected = w.state in ("stopping", "failed")
        if self._starting(w):
            self._start_failed(
                f"worker {wid} did not become ready within {self.start_s:g}s and was killed (hung opening a dataset "
                "or importing a pipeline?)" if w.start_hung else
                f"worker {wid} exited before it was ready ({describe_exit(exitcode)})")
        if not expected:
            self.deaths += 1
            log.warning("worker %d (pid %s) died, %s, holding tasks %s",
                        wid, w.pid, describe_exit(exitcode), list(w.tasks))
        self.version += 1
        self._busy_gone += w.busy_s
        return Exit(list(w.tasks), on if on in w.tasks else None, self._converge(now))

    @staticmethod
    def _starting(w: WorkerRecord) -> bool:
        """Started and not Ready yet (a worker dismissed while starting included)."""
        return not w.ready and w.state not in ("stopping", "failed")

    def _start_failed(self, why: str) -> None:
        self.start_failures += 1
        if self.start_failures >= MAX_START_FAILURES and not self.broken:
            self.broken = why
            log.error("%d workers in a row failed to start; not starting more", self.start_failures)

    # ------------------------------------------------------------------ deadlines
    def next_deadline(self) -> Optional[float]:
        """When the earliest starting worker, or the earliest one told to stop, runs out of time
        (None: none is starting or stopping)."""
        ends = [w.started_at + self.start_s for w in self.workers.values() if self._starting(w) and not w.killed]
        ends += [w.stop_sent + self.stop_s for w in self.workers.values() if w.stop_sent is not None and not w.killed]
        return min(ends, default=None)

    def expire(self, now: float) -> List[Action]:
        """Kill every worker that has not said Ready within ``start_s`` (its exit then counts a
        failed start), and every one still alive ``stop_s`` after its Stop (a source whose close
        never returns, a thread the interpreter waits for at exit): it would hold its place among
        the processes the pool allows forever."""
        out: List[Action] = []
        for w in self.workers.values():
            if w.killed:
                continue  # once is enough: its exit is on its way
            if self._starting(w) and now - w.started_at >= self.start_s:
                w.start_hung = True
                log.error("worker %d (pid %s) has not said it is ready after %.0fs; killing it", w.id, w.pid,
                          now - w.started_at)
                out.append(KillWorker(w.id))
            elif w.stop_sent is not None and now - w.stop_sent >= self.stop_s:
                w.stop_hung = True
                self.stop_kills += 1
                log.error("worker %d (pid %s) was told to stop %.0fs ago and has not exited; killing it", w.id, w.pid,
                          now - w.stop_sent)
                out.append(KillWorker(w.id))
        return out

    # ------------------------------------------------------------------ tasks
    def places(self) -> List[WorkerRecord]:
        """A worker per task it can take now (idle or busy, below QUEUE_DEPTH), in the order to
        fill them: every worker's first free place before anyone's second, so tasks spread over
        idle workers before they queue behind running ones."""
        takers = [w for w in self.workers.values() if w.state in ("idle", "busy")]
        return [w for depth in range(QUEUE_DEPTH) for w in takers if len(w.tasks) <= depth]

    def assign(self, w: WorkerRecord, task: int, shm: str, now: float) -> None:
        """``w`` takes ``task``, which writes into segment ``shm``."""
        assert w.state in ("idle", "busy") and len(w.tasks) < QUEUE_DEPTH, w
        if not w.tasks:
            w.task_started = now
        w.state = "busy"
        w.tasks.append(task)
        w.mapped.add(shm)

    def unmap(self, name: str) -> List[int]:
        """Segment ``name`` was unlinked: the workers to tell to drop it (a busy one reads this after
        its task; none is on that segment by now). Those stopping or failed are not told."""
        told = []
        for w in self.workers.values():
            if name in w.mapped:
                w.mapped.discard(name)
                if w.state in ("idle", "busy", "leaving"):
                    told.append(w.id)
        return told

    def close(self, now: float) -> List[Action]:
        """Stop every worker (the edge then waits for them, and terminates and kills the rest)."""
        self.closed = True
        self.target = 0
        return [self._stop(w, now) for w in self.workers.values() if w.state in ("idle", "busy", "leaving", "starting")]

    # ------------------------------------------------------------------ readers
    def pids(self) -> List[int]:
        """The worker processes' pids (a copy: safe to call from another thread)."""
        return [w.pid for w in list(self.workers.values()) if w.pid]

    def busy_seconds(self, now: Optional[float] = None) -> float:
        """Total seconds workers have spent on tasks, including the tasks running now."""
        now = time.monotonic() if now is None else now
        running = sum(now - w.task_started for w in self.workers.values() if w.tasks)
        return self._busy_gone + running + sum(w.busy_s for w in self.workers.values())

    def live_count(self) -> int:
        """Workers that are, or will be, taking tasks."""
        return sum(1 for w in self.workers.values() if w.state in LIVE)

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for w in self.workers.values():
            out[w.state] = out.get(w.state, 0) + 1
        return out

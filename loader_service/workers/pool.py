"""The worker pool: process lifecycle, live scaling, death detection.

The pool owns the internal ROUTER socket the workers connect to and one record per worker.
It never decides what a worker does; the dispatcher does. A worker holds up to
:data:`QUEUE_DEPTH` tasks: the one it runs and the next, already in its socket, so it starts the
next one the moment it reports one done instead of waiting a round trip through the dispatcher
(on a core it shares with the dispatcher, that wait is the dispatcher's whole turn). Scale-down
dismisses: a busy worker chosen to leave finishes its tasks before it is told to stop, so no task
is abandoned.
Shutdown follows the ladder stop -> join -> terminate -> kill and is idempotent.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

import zmq

from wire import protocol as P
from loader_service.decode.jpeg import DEFAULT_OPTIONS, DecodeOptions
from loader_service.sources import SourceSpec
from loader_service.sources.base import kind_modules
from loader_service.workers.worker import worker_main

log = logging.getLogger("loader_service.workers.pool")

MAX_START_FAILURES = 3
QUEUE_DEPTH = 2  # tasks a worker holds at most: the one it runs and the next
REAP_TIMEOUT_S = 2.0  # an exited worker's sentinel fires a moment before it can be waited for

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


@dataclass
class WorkerRecord:
    id: int
    process: mp.process.BaseProcess
    state: str = "starting"  # starting | idle | busy | leaving | stopping | failed
    tasks: Deque[int] = field(default_factory=deque)  # the task ids it holds, in its order: the first runs
    pid: int = 0
    tasks_done: int = 0
    busy_s: float = 0.0
    started_at: float = 0.0
    ready: bool = False  # said Ready (without an error)
    start_hung: bool = False  # killed for not saying Ready within the start deadline
    stop_sent: float = 0.0  # when it was told Stop (0: not told)
    stop_hung: bool = False  # killed for not exiting within the stop deadline
    task_started: float = 0.0  # when its running task started (the previous one's Done, or its assignment)
    # Shared with the worker: [position in its task of the sample it is on (-1: none), when that
    # sample began (time.monotonic, one clock for all processes), the task it runs (-1: none)]. Tells a waiting client which
    # file a slow task is stuck on; two stores per sample in the worker.
    progress: Optional[Any] = None
    mapped: Set[str] = field(default_factory=set)  # segments its tasks wrote into: it may hold them mapped

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


class WorkerPool:
    def __init__(self, ctx: zmq.Context, specs: List[SourceSpec], start_method: str = "spawn",
                 decode: DecodeOptions = DEFAULT_OPTIONS, start_s: float = 120.0, nice: int = 0,
                 stop_s: float = 10.0):
        self._mp = mp.get_context(start_method)
        self.start_s = start_s  # a worker not Ready this long after its start is killed
        self.stop_s = stop_s  # a worker not exited this long after its Stop is killed
        self.nice = nice  # each worker runs this much nicer than this process
        self._specs = specs
        self._kind_modules = kind_modules(specs)  # a kind registered outside loader_service works in workers too
        self._decode = decode
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        # Workers watch the read end: it reports EOF once this process is gone, however it died.
        self._death_r, self._death_w = self._mp.Pipe(duplex=False)
        self.workers: Dict[int, WorkerRecord] = {}
        self.target = 0
        self._next_id = 0
        self.version = 0  # bumped whenever the set of processes changes (re-register sentinels)
        self.deaths = 0
        self.stop_kills = 0  # workers killed for not exiting within stop_s of their Stop
        self.start_failures = 0  # consecutive workers that died or failed before Ready
        self.broken = ""  # why workers cannot start; set after MAX_START_FAILURES in a row
        self._busy_gone = 0.0  # busy seconds of workers that have exited
        self._closed = False
        self._unreaped: List[mp.process.BaseProcess] = []  # exited but not yet waited for (rare)

    # ------------------------------------------------------------------ scaling
    def scale(self, n: int) -> None:
        """Set the target size. New workers start now; surplus ones leave once their task is done."""
        if n < 0:
            raise ValueError(f"worker count must be >= 0, got {n}")
        self.target = n
        self._converge()

    def _converge(self) -> None:
        if self.broken:
            return  # respawning would only fail again; the dispatcher reports why
        live = [w for w in self.workers.values() if w.state not in ("leaving", "stopping")]
        # Coalesce: a worker asked to leave but not yet told Stop (starting, or busy) stays
        # instead of a new one starting, so a burst of scale requests converges to the latest
        # target without starting processes it would stop a moment later.
        for w in sorted(self.workers.values(), key=lambda w: w.id):
            if len(live) >= self.target:
                break
            if w.state == "leaving":
                w.state = "busy" if w.task is not None else "starting"
                live.append(w)
        # At most twice the target processes at once (2 for a target of 0 or 1), those on their way
        # out counted: a storm of scale requests alternating small and large targets would start a
        # new set each time while the last is still exiting (their number then depends on how fast
        # processes exit). The rest start as those exit (reap converges again); where none is live,
        # one starts whatever is exiting.
        room = max(2 * max(self.target, 1) - len(self.workers), 0 if live else 1)
        for _ in range(min(self.target - len(live), room)):
            self._spawn()
        surplus = len(live) - self.target
        if surplus > 0:
            # leave idle workers first, then the ones that started last
            order = sorted(live, key=lambda w: (w.state != "idle", w.state != "starting", -w.id))
            for w in order[:surplus]:
                self._dismiss(w)

    def _spawn(self) -> None:
        wid = self._next_id
        self._next_id += 1
        progress = self._mp.RawArray("d", [-1.0, 0.0, -1.0])
        proc = self._mp.Process(
            target=worker_main,
            args=(wid, self.endpoint, self._specs, self._death_r, self._decode, progress, self._kind_modules, self.nice),
            name=f"loader-worker-{wid}", daemon=True,
        )
        proc.start()
        self.workers[wid] = WorkerRecord(wid, proc, pid=proc.pid or 0, started_at=time.monotonic(), progress=progress)
        self.version += 1
        log.info("worker %d started (pid %s)", wid, proc.pid)

    def _dismiss(self, w: WorkerRecord) -> None:
        if w.state == "busy":
            w.state = "leaving"  # told to stop when its task is done
        elif w.state == "idle":
            self._send_stop(w)
        else:  # starting: stop it as soon as it says Ready
            w.state = "leaving"

    def _send_stop(self, w: WorkerRecord) -> None:
        w.state = "stopping"
        w.stop_sent = time.monotonic()
        self.sock.send_multipart([_ident(w.id), *P.encode(P.Stop())])

    # ------------------------------------------------------------------ events
    def on_message(self, frames: list) -> Tuple[Optional[P.Done], Optional[WorkerRecord]]:
        """Handle one message from a worker. Returns (Done, its worker) for finished tasks."""
        ident, body = frames[0], frames[1:]
        msg, _ = P.decode(body, expect=(P.Ready, P.Done))
        w = self.workers.get(_worker_id(ident))
        if w is None:
            return None, None
        if isinstance(msg, P.Ready):
            w.pid = msg.pid
            if msg.error:
                log.error("worker %d could not start: %s\n%s", w.id, msg.error, msg.traceback)
                w.state = "failed"
                self._start_failed(f"worker could not start: {msg.error}\n{msg.traceback}")
                return None, w
            self.start_failures = 0
            w.ready = True
            if w.state == "leaving":
                self._send_stop(w)
            else:
                w.state = "idle"
            return None, w
        if w.task != msg.task:
            log.warning("worker %d reported task %d but runs %s", w.id, msg.task, w.task)
            return None, w
        w.tasks.popleft()
        w.tasks_done += 1
        now = time.monotonic()
        w.busy_s += now - w.task_started
        w.task_started = now  # its next task, if it holds one, starts now
        if w.tasks:
            return msg, w
        if w.state == "leaving":
            self._send_stop(w)
        else:
            w.state = "idle"
        return msg, w

    def pids(self) -> List[int]:
        """The worker processes' pids (a copy: safe to call from another thread)."""
        return [w.pid for w in list(self.workers.values()) if w.pid]

    def sentinels(self) -> Dict[int, int]:
        """fd -> worker id, for the dispatcher's poller (readable when the process exits)."""
        return {w.process.sentinel: w.id for w in self.workers.values()}

    def reap(self, wid: int) -> Tuple[List[int], Optional[int], Optional[int]]:
        """Forget an exited worker; replace it if the pool is below target.

        Returns (the tasks it held, the one it died on, its exit code). The one it died on is
        what the worker itself recorded (None: it died between tasks): the Done of a task
        ahead of it may still be on its way, and the tasks behind it never began.
        """
        w = self.workers.pop(wid, None)
        if w is None:
            return [], None, None
        on = int(w.progress[2]) if w.progress is not None else -1
        # Its sentinel fired, so it is exiting: wait for that (bounded) and close the handle, or
        # it stays a zombie holding a descriptor until the next start happens to reap it.
        w.process.join(timeout=REAP_TIMEOUT_S)
        expected = w.state in ("stopping", "failed")
        if self._starting(w):
            self._start_failed(
                f"worker {wid} did not become ready within {self.start_s:g}s and was killed (hung opening a dataset "
                "or importing a pipeline?)" if w.start_hung else
                f"worker {wid} exited before it was ready ({describe_exit(w.process.exitcode)})")
        if not expected:
            self.deaths += 1
            log.warning("worker %d (pid %s) died, %s, holding tasks %s",
                        wid, w.pid, describe_exit(w.process.exitcode), list(w.tasks))
        self.version += 1
        self._busy_gone += w.busy_s
        exitcode = w.process.exitcode
        if exitcode is not None:
            w.process.close()
        else:
            log.error("worker %d (pid %s) closed its end but did not exit within %.0fs; reaped at close",
                      wid, w.pid, REAP_TIMEOUT_S)
            self._unreaped.append(w.process)
        if not self._closed:
            self._converge()
        return list(w.tasks), (on if on in w.tasks else None), exitcode

    @staticmethod
    def _starting(w: WorkerRecord) -> bool:
        """Started and not Ready yet (a worker dismissed while starting included)."""
        return not w.ready and w.state not in ("stopping", "failed")

    def next_deadline(self) -> Optional[float]:
        """When the earliest starting worker, or the earliest one told to stop, runs out of time
        (None: none is starting or stopping)."""
        ends = [w.started_at + self.start_s for w in self.workers.values() if self._starting(w) and not w.start_hung]
        ends += [w.stop_sent + self.stop_s for w in self.workers.values() if w.stop_sent and not w.stop_hung]
        return min(ends, default=None)

    def expire(self, now: float) -> None:
        """SIGKILL every worker that has not said Ready within ``start_s`` (:meth:`reap` then counts
        a failed start), and every one still alive ``stop_s`` after its Stop (a source whose close
        never returns, a thread the interpreter waits for at exit): it would hold its place among
        the processes the pool allows forever. Their sentinels then report them."""
        for w in self.workers.values():
            if self._starting(w) and not w.start_hung and now - w.started_at >= self.start_s:
                w.start_hung = True
                log.error("worker %d (pid %s) has not said it is ready after %.0fs; killing it", w.id, w.pid,
                          now - w.started_at)
                _kill(w.pid)
            elif w.stop_sent and not w.stop_hung and now - w.stop_sent >= self.stop_s:
                w.stop_hung = True
                self.stop_kills += 1
                log.error("worker %d (pid %s) was told to stop %.0fs ago and has not exited; killing it", w.id, w.pid,
                          now - w.stop_sent)
                _kill(w.pid)

    def _start_failed(self, why: str) -> None:
        self.start_failures += 1
        if self.start_failures >= MAX_START_FAILURES and not self.broken:
            self.broken = why
            log.error("%d workers in a row failed to start; not starting more", self.start_failures)

    # ------------------------------------------------------------------ tasks
    def places(self) -> List[WorkerRecord]:
        """A worker per task it can take now (idle or busy, below QUEUE_DEPTH), in the order to
        fill them: every worker's first free place before anyone's second, so tasks spread over
        idle workers before they queue behind running ones."""
        takers = [w for w in self.workers.values() if w.state in ("idle", "busy")]
        return [w for depth in range(QUEUE_DEPTH) for w in takers if len(w.tasks) <= depth]

    def assign(self, w: WorkerRecord, task: P.Task) -> None:
        assert w.state in ("idle", "busy") and len(w.tasks) < QUEUE_DEPTH, w
        if not w.tasks:
            w.task_started = time.monotonic()
        w.state = "busy"
        w.tasks.append(task.task)
        w.mapped.add(task.shm)
        self.sock.send_multipart([_ident(w.id), *P.encode(task)])

    def unmap(self, name: str) -> None:
        """Segment ``name`` was unlinked: tell each worker that may hold it mapped to drop it
        (a busy one reads this after its task; none is on that segment by now)."""
        for w in self.workers.values():
            if name in w.mapped:
                w.mapped.discard(name)
                if w.state in ("idle", "busy", "leaving"):
                    try:
                        self.sock.send_multipart([_ident(w.id), *P.encode(P.Unmap(shm=name))], flags=zmq.NOBLOCK)
                    except zmq.ZMQError:  # gone: its mappings went with it
                        pass

    def busy_seconds(self) -> float:
        """Total seconds workers have spent on tasks, including the tasks running now."""
        now = time.monotonic()
        running = sum(now - w.task_started for w in self.workers.values() if w.tasks)
        return self._busy_gone + running + sum(w.busy_s for w in self.workers.values())

    def live_count(self) -> int:
        """Workers that are, or will be, taking tasks."""
        return sum(1 for w in self.workers.values() if w.state in ("starting", "idle", "busy"))

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for w in self.workers.values():
            out[w.state] = out.get(w.state, 0) + 1
        return out

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker: ask, wait, terminate, kill. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.target = 0
        for w in list(self.workers.values()):
            if w.state in ("idle", "busy", "leaving", "starting"):
                try:
                    w.state = "stopping"
                    self.sock.send_multipart([_ident(w.id), *P.encode(P.Stop())], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._death_w.close()  # any worker that missed Stop sees EOF and exits
        deadline = time.monotonic() + timeout
        for w in self.workers.values():
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers.values():
            if w.process.is_alive():
                log.warning("worker %d did not stop in %.1fs; terminating", w.id, timeout)
                w.process.terminate()
                w.process.join(1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.process.close()
        self.workers.clear()
        for p in self._unreaped:
            p.kill()
            p.join(timeout)
        self._unreaped.clear()
        self._death_r.close()
        self.sock.close(0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone: its sentinel reports it


def _ident(wid: int) -> bytes:
    return f"w{wid}".encode()


def _worker_id(ident: bytes) -> int:
    try:
        return int(ident[1:])
    except ValueError:
        return -1

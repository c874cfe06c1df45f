"""The worker pool's I/O edge: the decode processes, the internal ROUTER socket they connect
to, and the carrying out of what :class:`~loader_service.workers.pool_state.PoolState` decides.

The pool never decides what a worker does; the dispatcher does. A worker holds up to
:data:`QUEUE_DEPTH` tasks: the one it runs and the next, already in its socket, so it starts the
next one the moment it reports one done instead of waiting a round trip through the dispatcher
(on a core it shares with the dispatcher, that wait is the dispatcher's whole turn).
Shutdown follows the ladder stop -> join -> terminate -> kill and is idempotent.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Callable, Dict, List, Optional, Tuple

import zmq

from wire import protocol as P
from loader_service.decode.jpeg import DEFAULT_OPTIONS, DecodeOptions
from loader_service.sources import SourceSpec
from loader_service.sources.base import kind_modules
from loader_service.workers.pool_state import (QUEUE_DEPTH, Action, KillWorker, PoolState, Spawn, TellStop,
                                               WorkerRecord, describe_exit)
from loader_service.workers.worker import worker_main

__all__ = ["QUEUE_DEPTH", "WorkerPool", "WorkerRecord", "describe_exit"]

log = logging.getLogger("loader_service.workers.pool")

REAP_TIMEOUT_S = 2.0  # an exited worker's sentinel fires a moment before it can be waited for
CLOSE_SLICE_S = 0.05  # the close's wait for the workers, in slices of this (its caller answers clients between)


class WorkerPool:
    """The decode processes and their socket; :attr:`state` holds the records and decides."""

    def __init__(self, ctx: zmq.Context, specs: List[SourceSpec], start_method: str = "spawn",
                 decode: DecodeOptions = DEFAULT_OPTIONS, start_s: float = 120.0, nice: int = 0,
                 stop_s: float = 10.0):
        self._mp = mp.get_context(start_method)
        self.state = PoolState(start_s, stop_s)
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
        self._processes: Dict[int, mp.process.BaseProcess] = {}
        self._closed = False
        self._unreaped: List[mp.process.BaseProcess] = []  # exited but not yet waited for (rare)

    def scale(self, n: int) -> None:
        """Set the target size. New workers start now; surplus ones leave once their tasks are done."""
        self._carry_out(self.state.scale(n, time.monotonic()))

    def _carry_out(self, actions: List[Action]) -> None:
        for a in actions:
            if isinstance(a, Spawn):
                self._spawn(self.state.workers[a.wid])
            elif isinstance(a, TellStop):
                self.sock.send_multipart([_ident(a.wid), *P.encode(P.Stop())])
            elif isinstance(a, KillWorker):
                try:
                    os.kill(self.state.workers[a.wid].pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass  # already gone: its sentinel reports it
            else:
                raise AssertionError(f"unknown pool action {a!r}")

    def _spawn(self, w: WorkerRecord) -> None:
        w.progress = self._mp.RawArray("d", [-1.0, 0.0, -1.0])
        proc = self._mp.Process(
            target=worker_main,
            args=(w.id, self.endpoint, self._specs, self._death_r, self._decode, w.progress, self._kind_modules,
                  self.nice),
            name=f"loader-worker-{w.id}", daemon=True,
        )
        proc.start()
        self._processes[w.id] = proc
        w.pid = proc.pid or 0
        log.info("worker %d started (pid %s)", w.id, proc.pid)

    def on_message(self, frames: list) -> Tuple[Optional[P.Done], Optional[WorkerRecord]]:
        """Handle one message from a worker. Returns (Done, its worker) for finished tasks."""
        ident, body = frames[0], frames[1:]
        msg, _ = P.decode(body, expect=(P.Ready, P.Done))
        wid, now = _worker_id(ident), time.monotonic()
        if isinstance(msg, P.Ready):
            w, actions = self.state.ready(wid, msg.pid, f"{msg.error}\n{msg.traceback}" if msg.error else "", now)
            self._carry_out(actions)
            return None, w
        w, taken, actions = self.state.done(wid, msg.task, now)
        self._carry_out(actions)
        return (msg if taken else None), w

    def sentinels(self) -> Dict[int, int]:
        """fd -> worker id, for the dispatcher's poller (readable when the process exits)."""
        return {p.sentinel: wid for wid, p in self._processes.items()}

    def reap(self, wid: int) -> Tuple[List[int], Optional[int], Optional[int]]:
        """Forget an exited worker; replace it if the pool is below target.

        Returns (the tasks it held, the one it died on, its exit code): see :meth:`PoolState.exited`.
        """
        proc = self._processes.pop(wid, None)
        if proc is None:
            return [], None, None
        w = self.state.workers.get(wid)
        on = int(w.progress[2]) if w is not None and w.progress is not None else -1
        # Its sentinel fired, so it is exiting: wait for that (bounded) and close the handle, or
        # it stays a zombie holding a descriptor until the next start happens to reap it.
        proc.join(timeout=REAP_TIMEOUT_S)
        exitcode = proc.exitcode
        if exitcode is not None:
            proc.close()
        else:
            log.error("worker %d (pid %s) closed its end but did not exit within %.0fs; reaped at close",
                      wid, proc.pid, REAP_TIMEOUT_S)
            self._unreaped.append(proc)
        held, died_on, actions = self.state.exited(wid, exitcode, on, time.monotonic())
        if not self._closed:
            self._carry_out(actions)
        return held, died_on, exitcode

    def expire(self, now: float) -> None:
        """Kill the workers past their start or stop deadline (:meth:`PoolState.expire`)."""
        self._carry_out(self.state.expire(now))

    def assign(self, w: WorkerRecord, task: P.Task) -> None:
        self.state.assign(w, task.task, task.shm, time.monotonic())
        self.sock.send_multipart([_ident(w.id), *P.encode(task)])

    def unmap(self, name: str) -> None:
        """Segment ``name`` was unlinked: tell each worker that may hold it mapped to drop it."""
        for wid in self.state.unmap(name):
            try:
                self.sock.send_multipart([_ident(wid), *P.encode(P.Unmap(shm=name))], flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # gone: its mappings went with it
                pass

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 5.0, waiting: Optional[Callable[[], None]] = None) -> None:
        """Stop every worker: ask, wait, terminate, kill. Idempotent. ``waiting`` is called every
        :data:`CLOSE_SLICE_S` while the workers are waited for (the dispatcher answers its clients)."""
        if self._closed:
            return
        self._closed = True
        for a in self.state.close(time.monotonic()):
            try:
                self.sock.send_multipart([_ident(a.wid), *P.encode(P.Stop())], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._death_w.close()  # any worker that missed Stop sees EOF and exits
        deadline = time.monotonic() + timeout
        for p in self._processes.values():
            while p.is_alive() and time.monotonic() < deadline:
                if waiting is not None:
                    waiting()
                p.join(min(CLOSE_SLICE_S, max(0.0, deadline - time.monotonic())))
        for wid, p in self._processes.items():
            if p.is_alive():
                log.warning("worker %d did not stop in %.1fs; terminating", wid, timeout)
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(timeout)
            if p.is_alive():  # in uninterruptible sleep (a read from storage that never answers)
                log.error("worker %d (pid %s) is still alive after SIGKILL (in uninterruptible sleep?); "
                          "leaving it", wid, p.pid)
            else:
                p.close()
        self._processes.clear()
        self.state.workers.clear()
        for p in self._unreaped:
            p.kill()
            p.join(timeout)
        self._unreaped.clear()
        self._death_r.close()
        self.sock.close(0)


def _ident(wid: int) -> bytes:
    return f"w{wid}".encode()


def _worker_id(ident: bytes) -> int:
    try:
        return int(ident[1:])
    except ValueError:
        return -1

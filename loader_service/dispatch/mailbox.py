"""Functions other threads hand to the dispatcher's loop thread.

A queue and a wake-up socket pair: :meth:`Mailbox.put` (any thread, never blocks) queues a
function and wakes the loop, which polls :meth:`Mailbox.fileno` and runs what came with
:meth:`Mailbox.run_all`, between events. A function may come with a Future for its answer.
"""

from __future__ import annotations

import queue
import socket
import threading
from concurrent.futures import Future
from typing import Callable, Optional, Tuple


class Mailbox:
    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._calls: "queue.SimpleQueue[Tuple[Callable, Optional[Future]]]" = queue.SimpleQueue()
        # put and close in turn: a call queued after close's sweep would wait for ever
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        """What the loop polls: readable when something was put."""
        return self._r.fileno()

    def put(self, fn: Callable, fut: Optional[Future]) -> None:
        """Queue ``fn`` (its result or exception goes to ``fut``, if given); thread-safe. Once
        closed, ``fut`` fails at once and ``fn`` is dropped."""
        with self._lock:
            if self._closed:
                _fail(fut)
                return
            self._calls.put((fn, fut))
        try:
            self._w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or we are shutting down

    def run_all(self) -> None:
        """Run everything queued, in order (on the loop thread). An exception of a function put
        without a Future is raised: it is the loop's own (and loud)."""
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut is None:
                fn()
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the caller, who raises it
                    fut.set_exception(exc)

    def close(self) -> None:
        """Close the wake-up pair; anyone still waiting on an answer learns that the service is
        gone, and so does anyone who asks later. Idempotent."""
        with self._lock:
            self._closed = True
        self._r.close()
        self._w.close()
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                break
            _fail(fut)


def _fail(fut: Optional[Future]) -> None:
    if fut is not None and fut.set_running_or_notify_cancel():
        fut.set_exception(RuntimeError("the service stopped"))

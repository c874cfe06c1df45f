"""The dispatch state driven by hand: no zmq, no loop, no processes.

:class:`Driven` holds a real :class:`~loader_service.dispatch.state.DispatchState` and plays its
I/O shell the way :mod:`loader_service.dispatch.loop` does, with the test in charge of what the
shell would read: monitor events (queued until the shell would read them), client messages
(any bytes at all), workers that take, finish or lose tasks, and libzmq letting go of a sent
batch. It records what the state commands: every message (``d.sent``), every batch
(``d.batches``), tasks handed out, workers killed, connections cut, segments unmapped.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, List, Optional, Set, Tuple, Union

import zmq

from wire import protocol as P
from loader_service.config import ServiceConfig
from loader_service.decode.pipelines import Registry
from loader_service.dispatch import events as E
from loader_service.dispatch.state import DispatchState
from loader_service.dispatch.unread import Sending
from loader_service.workers.pool_state import PoolState, Spawn

FD = 17  # any number: these connections only exist in the events fed to the state


class Frame:
    """What the state reads of a received zmq.Frame: its bytes."""

    def __init__(self, data: bytes):
        self.bytes, self.buffer = data, memoryview(data)


class Workers(PoolState):
    """The pool's real bookkeeping, its processes played by the test: workers start ready at once
    (pid 10,000 + their id), and finish or die when the test says (:meth:`Driven.finish`,
    :meth:`Driven.lose`)."""

    def __init__(self, n: int):
        super().__init__()
        self.carry_out(self.scale(n, time.monotonic()))

    def carry_out(self, actions) -> None:
        for a in actions:
            assert isinstance(a, Spawn), a  # the tests here never scale down or let deadlines pass
            self.ready(a.wid, 10_000 + a.wid, "", time.monotonic())


class Driven:
    """A :class:`DispatchState` serving ``source`` as "demo", with ``workers`` idle workers.
    ``d.now`` is the clock the events carry (advance it by hand)."""

    def __init__(self, config: ServiceConfig, source, workers: int = 0, authorized=None, probe: str = ""):
        self.pool = Workers(workers)
        self.state = DispatchState(config, {"demo": source}, Registry(config.pipeline), self.pool, "test-instance",
                                   authorized, probe)
        self.now = time.monotonic()
        self.monitor: Deque[E.Event] = deque()  # reported, not yet read
        self.fds_seen: Set[int] = set()
        self.gone: Set[bytes] = set()  # idents a send finds unreachable (ROUTER_MANDATORY)
        self.sent: List[Tuple[bytes, P.Message]] = []
        self.batches: List[Tuple[bytes, P.Batch]] = []
        self.data: List[E.SendData] = []  # every batch's send as commanded (its blocks, its labels)
        self.sending: List[E.LetGo] = []  # batches libzmq has not let go of yet
        # Accepts libzmq has not let go of yet, each with the fd of its connection: only while
        # ``reading`` is off (else let go of at once, as for a client that reads what it is sent);
        # a connection's are let go of when it closes
        self.flushing: List[Tuple[int, E.Flushed]] = []
        self.reading = True
        self.assigned: List[E.Assign] = []
        self.killed: List[int] = []
        self.cut: List[int] = []  # fds of connections cut (flooding, silence)
        # fd -> how long its connection has brought no data (what a Probe reads; 0 if unset)
        self.quiet: Dict[int, float] = {}
        # fd -> the send side of its connection and its lanes (what a Probe reads for unread.py; () if unset)
        self.sockets: Dict[int, Tuple[Sending, ...]] = {}
        self.probes = 0
        self.address = "10.0.0.1"  # every connection's peer address, as a Probe reads it
        self.denied: List[str] = []  # addresses refused at the handshake (Deny)
        self.stranding: Set[int] = set()  # fds whose connection libzmq never closes once cut (its reading stopped)
        self.cut_marks: List[Tuple[int, int, int, float]] = []  # (fd, len(sent), len(batches), now) at each cut
        self.unmapped: List[str] = []
        self.trims = 0
        self.ended = False  # an EndLoop came

    # ------------------------------------------------------------------ the shell's part
    def handle(self, event: E.Event) -> None:
        """``event`` through the door; the commands carried out as the shell does, and the events
        they cause (a send to a gone client, a batch with nothing zero-copy) handled after."""
        queue: Deque[E.Event] = deque([event])
        while queue:
            for c in self.state.handle(queue.popleft(), self.now):
                self._carry_out(c, queue)

    def _carry_out(self, c: E.Command, queue: Deque[E.Event]) -> None:
        if isinstance(c, (E.Send, E.SendData)) and c.ident in self.gone:
            queue.append(E.Unreachable(c.ident))
            if isinstance(c, E.Send) and c.track:
                queue.append(E.Flushed(c.ident, c.message.stream))  # dropped unsent: let go of all the same
            if isinstance(c, E.SendData):
                if c.let_go:
                    queue.append(E.LetGo(c.stream, c.slot))  # unsent frames are let go of all the same
        elif isinstance(c, E.Send):
            self.sent.append((c.ident, c.message))
            if c.track:
                flushed = E.Flushed(c.ident, c.message.stream)
                if self.reading:
                    queue.append(flushed)
                else:
                    self.flushing.append((self.state.sessions.get(c.ident).fd, flushed))
        elif isinstance(c, E.SendData):
            header = P.decode_header(c.header)
            assert isinstance(header, P.Batch)
            self.batches.append((c.ident, header))
            self.data.append(c)
            if c.let_go:  # else the co-located client borrows the slot until its Release
                self.sending.append(E.LetGo(c.stream, c.slot))
        elif isinstance(c, E.Assign):
            self.pool.assign(c.worker, c.task.task, c.task.shm, self.now)
            self.assigned.append(c)
        elif isinstance(c, E.Kill):
            self.killed.append(c.pid)
        elif isinstance(c, E.Cut):
            self.cut.append(c.fd)
            self.cut_marks.append((c.fd, len(self.sent), len(self.batches), self.now))
            if self.state.sessions.serial(c.fd) == c.serial and c.fd not in self.stranding:
                self.event(zmq.EVENT_DISCONNECTED, c.fd)  # libzmq closes it; the monitor says so
        elif isinstance(c, E.Probe):
            self.probes += 1
            queue.append(E.Quiet(tuple((fd, serial, self.quiet.get(fd, 0.0), self.address, self.sockets.get(fd, ()))
                                       for fd, serial, _ in c.connections)))
        elif isinstance(c, E.Deny):
            self.denied.append(c.address)
        elif isinstance(c, E.Unmap):
            self.unmapped.append(c.name)
        elif isinstance(c, E.TrimHeap):
            self.trims += 1
        elif isinstance(c, E.EndLoop):
            self.ended = True
        else:
            raise AssertionError(f"unknown command {c!r}")

    def event(self, kind: int, fd: int = FD) -> None:
        """The monitor reports ``kind`` (zmq.EVENT_ACCEPTED / EVENT_DISCONNECTED) for ``fd``: queued
        until the shell reads the monitor (:meth:`read_monitor`, or a message from an unknown fd)."""
        self.fds_seen.add(fd)
        self.monitor.append(E.Accepted(fd) if kind == zmq.EVENT_ACCEPTED else E.Disconnected(fd))

    def read_monitor(self) -> None:
        while self.monitor:
            ev = self.monitor.popleft()
            self.handle(ev)
            if isinstance(ev, E.Disconnected):  # its queue is dropped: the Accepts in it are let go of
                self.flush(fd=ev.fd)

    def tick(self) -> None:
        """The end of a round of events, as the loop does it after every poll."""
        if self.state.early_due(self.now):
            self.read_monitor()
        self.handle(E.Tick())

    def let_go(self, i: Optional[int] = None) -> None:
        """libzmq lets go of a sent batch (the ``i``-th still held; default: all of them)."""
        for ev in ([self.sending.pop(i)] if i is not None else [self.sending.pop(0) for _ in range(len(self.sending))]):
            self.handle(ev)

    def flush(self, ident: Optional[bytes] = None, fd: Optional[int] = None) -> None:
        """libzmq lets go of the Accepts held (``ident``'s alone, those on connection ``fd``, or all
        of them): their clients read up to them, or their connection closed."""
        held, self.flushing = self.flushing, []
        for on, ev in held:
            if (ident is None or ev.ident == ident) and (fd is None or on == fd):
                self.handle(ev)
            else:
                self.flushing.append((on, ev))

    # ------------------------------------------------------------------ workers
    def finish(self, wid: int, ok: bool = True, error: str = "", skipped=()) -> int:
        """Worker ``wid`` finishes the task it runs (its queued one runs next); the task's id."""
        task = self.pool.workers[wid].task
        w, taken, actions = self.pool.done(wid, task, self.now)
        assert taken and not actions, (w, actions)
        self.handle(E.WorkerDone(P.Done(task=task, worker=wid, ok=ok, error=error, skipped=list(skipped)), w.task))
        return task

    def lose(self, wid: int, died_on_first: bool = True, exitcode: int = -9) -> None:
        """Worker ``wid`` dies holding its tasks (on the first, or between tasks); a new one takes its place."""
        held = tuple(self.pool.workers[wid].tasks)
        lost = self.pool.exited(wid, exitcode, held[0] if held and died_on_first else -1, self.now)
        self.handle(E.WorkerLost(tuple(lost.held), lost.died_on, exitcode))
        self.pool.carry_out(lost.actions)

    def close(self) -> None:
        self.handle(E.Closing())
        self.handle(E.Closed())
        self.state.memory.close()

    # ------------------------------------------------------------------ readers for tests
    @property
    def totals(self):
        return self.state.totals

    @property
    def sessions(self):
        return self.state.sessions

    @property
    def memory(self):
        return self.state.memory


def loopless(config: ServiceConfig, source, workers: int = 0, probe: str = "") -> Driven:
    """The dispatch state serving ``source`` as "demo", driven by hand. Close with :func:`close`."""
    return Driven(config, source, workers, probe=probe)


def close(d: Driven) -> None:
    d.close()


def deliver(d: Driven, ident: bytes, msg: Union[P.Message, List[bytes]], fd: int = FD, report: bool = True) -> None:
    """``msg`` (a message, or frames already made: any bytes at all) from the client at ``ident``
    on connection ``fd``, as the ROUTER hands it over. The first use of an fd no event named yet
    reports its connection accepted first, unless not ``report`` (libzmq may report an accept
    after the connection's first messages). As the shell does, the monitor is read to the end
    first when the message's connection is not the one its session knows."""
    if report and fd not in d.fds_seen:
        d.event(zmq.EVENT_ACCEPTED, fd)
    if not d.state.knows(ident, fd):
        d.read_monitor()
    frames = msg if isinstance(msg, list) else P.encode(msg)
    d.handle(E.ClientMessage(ident, fd, [Frame(bytes(f)) for f in frames]))


def sent_to(d: Driven, ident: bytes) -> list:
    """What ``ident`` was sent, as message type names (errors with their code)."""
    return [type(m).__name__ + (f":{m.code}" if isinstance(m, P.Error) else "") for i, m in d.sent if i == ident]

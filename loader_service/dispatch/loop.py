"""The dispatcher's I/O shell: sockets, worker processes, the mailbox and the clock, around one
:class:`~loader_service.dispatch.state.DispatchState`.

It reads three sockets (clients, workers, the connection monitor), the workers' process
sentinels and a wake-up pipe, turns what it reads into events (:mod:`.events`) for
:meth:`DispatchState.handle <loader_service.dispatch.state.DispatchState.handle>`, the one door
every change goes through, and carries out the commands that come back: messages and batches to
clients, tasks to workers, segments to unmap, workers to kill. It decides nothing itself.

Other threads never touch the state: they submit a function with :meth:`Dispatcher.call` (a
Future comes back) or :meth:`Dispatcher.post`, and the loop runs it between events (through
its :class:`~loader_service.dispatch.mailbox.Mailbox`); the control plane reads the state there.
Every wait of the loop has a deadline: the state's next one (a task deadline, the time a quiet
stream's slots may be lent, a late accept, the end of a draining stop) or a starting worker's.

Failures are loud: a bug met for one client (in the state, or carrying out a command for it)
fails that client alone with the traceback; an exception in the loop itself ends the loop with
:attr:`Dispatcher.failure` set, which makes ``/healthz`` fail and ``serve`` exit non-zero.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import struct
import sys
import threading
import time
import socket
import traceback
import uuid
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import replace
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
import zmq

from wire import protocol as P
from loader_service.config import ServiceConfig
from loader_service.decode.pipelines import Registry
from loader_service.dispatch import events as E
from loader_service.dispatch import heap, local, sending
from loader_service.dispatch.curve import HANDSHAKE_FAILED, secure_router
from loader_service.dispatch.lanes import LaneListener, LaneSet
from loader_service.dispatch.mailbox import Mailbox
from loader_service.dispatch.state import DispatchState, shutting_down
from loader_service.dispatch.unread import SENDING_INFO_BYTES, Sending
from loader_service.sources import Source
from loader_service.sources.base import DiskChange
from loader_service.workers.pool import WorkerPool

log = logging.getLogger("loader_service.dispatch.loop")

CLOSE_LINGER_MS = 500  # on close, how long goodbyes and batches already queued may take to leave
# struct tcp_info (linux/tcp.h): __u8 tcpi_state at byte 0, __u32 tcpi_last_data_recv (ms since
# data last came) at byte 52 (its send side: unread.Sending); the states of a connection its peer has
# closed or reset (net/tcp_states.h)
TCP_INFO_LAST_DATA_RECV = 52
TCP_PEER_CLOSED = (7, 8)  # TCP_CLOSE, TCP_CLOSE_WAIT
TCP_INFO_BYTES = TCP_INFO_LAST_DATA_RECV + 4
SO_PEERNAME = getattr(socket, "SO_PEERNAME", 28)  # Linux's number; the socket module may not name it
SOCKADDR_IN_BYTES, SOCKADDR_IN6_BYTES = 16, 28
MAX_LANES_TOTAL = 256  # bulk lanes of all clients together (a sender thread each); past it a lane is closed


class Dispatcher:
    """The I/O shell around one :class:`~loader_service.dispatch.state.DispatchState` (``state``):
    the sockets, the pool's processes, the mailbox and the clock."""

    def __init__(self, config: ServiceConfig, sources: Dict[str, Source], workers: Optional[int] = None):
        """``workers``: the pool's size at start (default: the configured count)."""
        if not sources:
            raise ValueError("the service needs at least one dataset")
        self.config, self.sources = config, sources
        pipelines = Registry(config.pipeline)  # first: a pipeline that does not import stops the start here
        self.instance = uuid.uuid4().hex[:12]
        self.ctx, self.front, self.guard, self.monitor, self.data_port = _data_port(config)
        self.lane_sets: Dict[bytes, LaneSet] = {}  # a client's routing id -> its bulk lanes (loop thread only)
        self._lanes_due: Optional[float] = None  # when the first set still missing a lane is due (the sweep's)
        self.lanes: Optional[LaneListener] = None
        if config.lane_port >= 0:
            try:
                self.lanes = LaneListener(config.host, config.lane_port, self._lane_arrived)
            except OSError as exc:
                self.monitor.close(0)
                self.front.close(0)
                self.guard.close()
                self.ctx.term()
                raise cannot_bind("lane", config.host, config.lane_port, exc.errno) from None
        # The workers' socket has a context (an I/O thread) of its own: on the data port's, every
        # task and result queued behind the work of every client connection; at 10,000 connections
        # that thread spends most of its time in libzmq's heartbeat timers (issue 32, see
        # docs/benchmarks.md section 12), and one-image tasks ran at ~90/s with the workers idle.
        self.pool_ctx = zmq.Context(1)
        self.pool = WorkerPool(self.pool_ctx, [s.spec() for s in sources.values()], config.start_method,
                               config.decode_options, config.worker_start_s, config.worker_nice,
                               config.worker_stop_s)
        self.mailbox = Mailbox()  # functions other threads hand to this one
        self.colocation = local.Colocation()  # the probe a co-located client reads (issue 41)
        self.state = DispatchState(config, sources, pipelines, self.pool.state, self.instance,
                                   self.guard.authorized if self.guard.curve else None, self.colocation.name,
                                   self.lanes.port if self.lanes is not None else 0)
        self._events: Deque[E.Event] = deque()  # events met while carrying out commands: handled next
        self._gone_queued: Counter = Counter()  # fd -> disconnects of it waiting in _events (see _reported_gone)
        self._handling = False
        self._trim_owed = False  # a trim asked in the chain of events at hand (see handle)
        # dataset name -> DiskChange: written whole by the service's watch thread, read by snapshot
        self.disk_changes: Dict[str, DiskChange] = {}
        self.loop_thread: Optional[int] = None  # the thread running :meth:`run`
        self._running_loop = False
        self._closed = False
        self._close_lock = threading.Lock()
        self.failure = ""  # why the loop died ("" while it is fine)
        self.ready = threading.Event()  # set once a worker has said Ready
        self.started = time.time()
        self.first_workers = config.workers if workers is None else workers

    # ------------------------------------------------------------------ other threads
    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the dispatcher thread; thread-safe. The Future fails with
        RuntimeError if the dispatcher has stopped."""
        fut: Future = Future()
        if self._closed:
            fut.set_exception(RuntimeError(f"the dispatcher has stopped{': ' + self.failure if self.failure else ''}"))
            return fut
        self.mailbox.put(lambda: fn(*args), fut)
        return fut

    def loop_stack(self) -> str:
        """Where the loop thread is now (for a log line when it does not answer); thread-safe."""
        return thread_stack(self.loop_thread, "the loop thread")

    def segment_names(self) -> List[str]:
        """The shared memory it made and has not unlinked (the batch slots and the co-location
        probe); safe from another thread, for a stop that gives up on this one's loop."""
        return self.state.memory.names() + ([self.colocation.name] if self.colocation.name else [])

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the dispatcher thread, no answer; thread-safe, never blocks. Dropped
        once the dispatcher has stopped."""
        if not self._closed:
            self.mailbox.put(fn, None)

    def stop(self, drain_s: float = 0.0) -> None:
        """Ask the loop to end, after letting tasks in flight finish and go out for up to
        ``drain_s`` seconds (thread-safe, idempotent)."""
        self.call(self.handle, E.StopAsked(drain_s))

    # ------------------------------------------------------------------ the one door
    def handle(self, event: E.Event) -> None:
        """Hand ``event`` to the state and carry out its commands; events met on the way (a send
        that found its client gone, a batch sent with no zero-copy frame) are handled after."""
        self._events.append(event)
        if isinstance(event, E.Disconnected):
            self._gone_queued[event.fd] += 1
        if self._handling:
            return
        self._handling = True
        try:
            while self._events or self._trim_owed:
                if not self._events:  # the chain's end: one trim for every departure it met
                    self._trim_owed = False
                    self._trim_heap()
                    continue
                event = self._events.popleft()
                if isinstance(event, E.Disconnected):
                    self._gone_queued[event.fd] -= 1
                for command in self.state.handle(event, time.monotonic()):
                    self._carry_out(command)
        finally:
            self._handling = False
            self._trim_owed = False
            self._events.clear()
            self._gone_queued.clear()

    def _trim_heap(self) -> None:
        before = heap.rss_bytes()
        if heap.trim():
            self._events.append(E.HeapTrimmed(before - heap.rss_bytes()))

    def _carry_out(self, c: E.Command) -> None:
        if isinstance(c, E.Send) and c.track:
            self._guarded(c.ident, "sending a message", self._send_tracked, c)
        elif isinstance(c, E.Send):
            self._guarded(c.ident, "sending a message", self._send_frames, c.ident, P.encode(c.message))
        elif isinstance(c, E.SendData):
            self._guarded(c.ident, "sending a batch", self._send_data, c)
        elif isinstance(c, E.Assign):
            self._guarded(c.ident, "handing its batch to a worker", self._assign, c)
        elif isinstance(c, E.Cut):
            self._cut(c)
        elif isinstance(c, E.Probe):
            self._events.append(E.Quiet(tuple((fd, serial, *reading[:2], self._sockets(ident, reading[2]))
                                              for fd, serial, ident in c.connections
                                              if (reading := quiet_s(fd)) is not None)))
        elif isinstance(c, E.Deny):
            self.guard.deny(c.address)
        elif isinstance(c, E.Unmap):
            self.pool.unmap(c.name)
        elif isinstance(c, E.Kill):
            try:
                os.kill(c.pid, signal.SIGKILL)  # works on a stopped (SIGSTOP) process too
            except (ProcessLookupError, PermissionError):
                pass  # already gone: its sentinel reports it
        elif isinstance(c, E.TrimHeap):
            # at the chain's end: a burst of disconnects read at once (thousands, after a cut)
            # may ask for several trims as it halves the count; one does for all of them
            self._trim_owed = True
        elif isinstance(c, E.EndLoop):
            self._running_loop = False
        else:
            raise TypeError(f"not a dispatch command: {c!r}")

    def _guarded(self, ident: bytes, what: str, fn: Callable, *args) -> None:
        """A command for one client: a bug met carrying it out fails that client alone."""
        try:
            fn(*args)
        except Exception as exc:
            self._events.append(E.CommandFailed(ident, what, f"{type(exc).__name__}: {exc}", traceback.format_exc()))

    def _cut(self, c: E.Cut) -> None:
        """Shut the socket of connection ``c.fd`` down; libzmq then closes it and the monitor
        reports the disconnect. Only if it is still that connection: libzmq reports a
        disconnect before it closes the fd, and the fd is held (a dup) while it is checked, so
        a number reused by a new connection is never the one shut down."""
        if self._reported_gone(c.fd):
            return
        held = held_socket(c.fd)
        if held is None:
            return  # closed meanwhile
        with held:
            if not self._reported_gone(c.fd):
                try:
                    held.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # the peer is gone already

    def _sockets(self, ident: bytes, own: Optional[Sending]) -> Tuple[Sending, ...]:
        """The send side of a connection (``own``) and of its client's bulk lanes, for :mod:`.unread`
        (none if the kernel does not count it)."""
        if own is None:
            return ()
        lanes = self.lane_sets.get(ident) if ident and self.lane_sets else None
        return (own, *lanes.sending()) if lanes is not None else (own,)

    def _reported_gone(self, fd: int) -> bool:
        """Whether the monitor has reported ``fd``'s connection gone since the event at hand
        (the state has not read those reports yet: they wait in :attr:`_events`, counted by fd:
        a scan of them for each of 10,000 connections cut at once held the loop for a minute)."""
        self._read_monitor()
        return self._gone_queued[fd] > 0

    def _send_frames(self, ident: bytes, frames: list, copy: bool = True) -> None:
        """Send to ``ident``. If its connection is gone (ROUTER_MANDATORY says so at once), an
        Unreachable event drops the session after the event at hand, whatever the monitor has said yet."""
        try:
            self.front.send_multipart([ident, *frames], copy=copy)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, errno.EAGAIN):  # EAGAIN: a pipe being torn down (no HWM here)
                raise
            self._events.append(E.Unreachable(ident))

    def _send_tracked(self, c: E.Send) -> None:
        """Send ``c.message`` with its first frame tracked: :class:`~.events.Flushed` once libzmq lets go of it."""
        event = E.Flushed(c.ident, c.message.stream)
        head, *rest = P.encode(c.message)
        frame = sending.tracked(head, lambda: self.post(lambda: self.handle(event)))
        self._send_frames(c.ident, [frame, *rest], copy=False)
        del frame  # unsent (its connection gone): let go of here, Flushed all the same

    def _send_data(self, c: E.SendData) -> None:
        lanes = self.lane_sets.get(c.ident) if c.let_go and self.lane_sets else None
        if lanes is not None and lanes.ready and sum(size for _, size in c.blocks):
            self._send_on_lanes(c, lanes)
            return
        pending = [0]  # zero-copy frames of this batch libzmq still reads: the slot is free at 0

        def sent() -> None:  # a post: runs on this thread, after this method has counted every frame
            pending[0] -= 1
            if not pending[0]:
                self.handle(E.LetGo(c.stream, c.slot))

        frames = []
        for offset, size in c.blocks:
            frame, zero_copy = sending.frame(c.segment, offset, size, lambda: self.post(sent))
            frames.append(frame)
            pending[0] += zero_copy
        self._send_frames(c.ident, [P.encode_header(c.message), *frames, c.labels], copy=False)
        if not pending[0] and c.let_go:
            self._events.append(E.LetGo(c.stream, c.slot))
        del frames  # unsent zero-copy frames are released here: their ``sent`` runs all the same

    def _send_on_lanes(self, c: E.SendData, lanes: LaneSet) -> None:
        """The batch's outputs striped over the client's bulk lanes, the message and the labels in
        data frames; the slot is let go of once every lane is done with its stripe."""
        views = [memoryview(c.segment.array(np.uint8, (size,), offset)) for offset, size in c.blocks]
        lanes.send(c.message.stream, c.message.index, views,
                   lambda: self.post(lambda: self.handle(E.LetGo(c.stream, c.slot))))
        del views  # the senders hold what they still write
        message = replace(c.message, lanes=lanes.count, lane_set=lanes.number)
        self._send_frames(c.ident, [P.encode_header(message), c.labels])

    # ------------------------------------------------------------------ bulk lanes
    def _lane_arrived(self, ident: bytes, lane: int, lanes: int, lane_set: int, sock: socket.socket) -> None:
        """A lane said who it is (the listener's thread): the loop decides whether to keep it."""
        if self._closed:
            sock.close()
        else:
            self.post(lambda: self._adopt_lane(ident, lane, lanes, lane_set, sock))

    def _adopt_lane(self, ident: bytes, lane: int, lanes: int, lane_set: int, sock: socket.socket) -> None:
        """Keep lane ``lane`` of ``lanes`` of set ``lane_set`` for client ``ident`` if it has a
        session here and room is left. A set's first lane takes room for the whole set, past the
        client's old set (it let go of that one, which makes way); a lane its set already has, or
        one of another count, is refused."""
        current = self.lane_sets.get(ident)
        new_set = current is None or current.number != lane_set
        if new_set:
            room = sum(s.count for i, s in self.lane_sets.items() if i != ident) + lanes <= MAX_LANES_TOTAL
        else:
            room = current.count == lanes and not current.has(lane)
        if self._closed or self.state.sessions.get(ident) is None or not room:
            sock.close()
            return
        if new_set:
            if current is not None:
                current.close()
            current = self.lane_sets[ident] = LaneSet(ident, lanes, lane_set)
        current.add(lane, sock)

    def _sweep_lanes(self, now: float) -> None:
        """Close the lanes of clients whose session is gone, sets that failed, and sets still
        missing a lane at their deadline (a client opens all its lanes at once: a half set would
        only hold its room and threads)."""
        due = None
        for ident, lanes in list(self.lane_sets.items()):
            if lanes.broken or self.state.sessions.get(ident) is None or not lanes.ready and now >= lanes.complete_by:
                del self.lane_sets[ident]
                lanes.close()
            elif not lanes.ready:
                due = lanes.complete_by if due is None else min(due, lanes.complete_by)
        self._lanes_due = due

    def _close_lanes(self) -> None:
        """At the end: batches already announced may still finish on their lanes, for as long as
        the data port lets its last messages leave."""
        if self.lanes is not None:
            self.lanes.close()
        for lanes in self.lane_sets.values():
            lanes.close(linger_s=CLOSE_LINGER_MS / 1000)
        self.lane_sets.clear()

    def _assign(self, c: E.Assign) -> None:
        self.pool.assign(c.worker, c.task)
        c.stream.source.prefetch(c.stream.plan, c.batch)  # a queued hint: a remote source downloads on a thread

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve until :meth:`stop`. Cleans up everything it owns on the way out. If the loop
        itself fails, :attr:`failure` says why and the exception propagates."""
        self._running_loop = True
        self.loop_thread = threading.get_ident()
        poller = zmq.Poller()
        for s in (self.front, self.pool.sock, self.monitor):
            poller.register(s, zmq.POLLIN)
        poller.register(self.mailbox.fileno(), zmq.POLLIN)
        sentinels: Dict[int, int] = {}
        pool_version = -1
        try:
            sending.start_letting_go()
            self.pool.scale(self.first_workers)
            while self._running_loop:
                if pool_version != self.pool.state.version:
                    for fd in sentinels:
                        poller.unregister(fd)
                    sentinels = self.pool.sentinels()
                    for fd in sentinels:
                        poller.register(fd, zmq.POLLIN)
                    pool_version = self.pool.state.version
                timeout = self._poll_timeout_ms()
                if not self._running_loop:
                    break
                events = dict(poller.poll(timeout))
                if self.mailbox.fileno() in events:
                    self.mailbox.run_all()
                if self.monitor in events:
                    self._read_all(self.monitor, self._on_monitor)
                if self.pool.sock in events:
                    self._read_all(self.pool.sock, self._on_worker)
                if self.front in events:
                    self._read_all(self.front, self._on_client)
                for fd, wid in sentinels.items():
                    if fd in events:
                        held, died_on, exitcode = self.pool.reap(wid)
                        self.handle(E.WorkerLost(tuple(held), died_on, exitcode))
                self.tick()
        except BaseException as exc:
            self.failure = f"the dispatcher loop crashed: {type(exc).__name__}: {exc}"
            log.critical("%s\n%s", self.failure, traceback.format_exc())
            raise
        finally:
            self.close()

    def tick(self) -> None:
        """The end of a round of events (what the loop does after every poll)."""
        now = time.monotonic()
        if self.state.early_due(now):
            self._read_monitor()  # a report still queued confirms its connection
        self.pool.expire(now)
        self.handle(E.Tick())
        if self.lane_sets:
            self._sweep_lanes(now)

    def _poll_timeout_ms(self) -> Optional[int]:
        """Until the state's next deadline, a starting or stopping worker's deadline, or the end of a
        draining stop (None: no deadline)."""
        now = time.monotonic()
        if self.state.drained(now):
            self._running_loop = False
            return 0
        # the sweep ran in the tick just before (after any lane was adopted): its due time is current
        lanes_due = self._lanes_due if self.lane_sets else None
        ends = [t for t in (self.state.next_deadline(now), self.pool.state.next_deadline(), lanes_due) if t is not None]
        if not ends:
            return None
        return max(1, int((min(ends) - now) * 1000) + 1)

    def _answer_while_closing(self) -> None:
        """While the workers stop, the loop reads nothing, and the data port is open until they
        have: a client that connected after the goodbyes (a validation loader starting as this
        replica stops) would hear nothing until the process is gone, then wait out its
        ``replica_timeout``. Its Hello is answered "shutting down" here instead, so it asks the
        other replicas at once. Anything else is dropped unread; at most 256 messages a call."""
        for _ in range(256):
            try:
                ident, header, *_ = self.front.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, ValueError):  # ValueError: a message of one frame (no header)
                return
            except zmq.ZMQError:
                return
            try:
                msg = P.decode_header(header)
            except P.ProtocolError:
                continue
            if isinstance(msg, P.Hello):
                try:
                    self.front.send_multipart([ident, *P.encode(shutting_down(msg.stream))], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # gone already, or its queue full: it learns from the connection's end

    def _read_all(self, sock: zmq.Socket, handler: Callable, limit: int = 256) -> None:
        for _ in range(limit):  # bounded, so one busy socket cannot starve the others
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handler(frames)

    def _on_monitor(self, frames) -> None:
        ev = monitor_event(frames)
        if ev["event"] == zmq.EVENT_ACCEPTED:
            self.handle(E.Accepted(ev["value"]))
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            self.handle(E.Disconnected(ev["value"]))
        elif self.guard.on_event(ev):
            self.handle(E.HandshakeRefused())

    def _read_monitor(self) -> None:
        """Every monitor event queued now (bounded by the connections the service has)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_monitor(frames)

    def _on_client(self, frames) -> None:
        ident, last = frames[0].bytes, frames[-1]
        try:
            fd = last.get(zmq.SRCFD)
        except zmq.ZMQError:  # no connection metadata (a ZMTP 1.0/2.0 peer, refused by the ZAP domain below)
            fd = -1
        if not self.state.knows(ident, fd):
            # the disconnect of an earlier connection on this fd number must be read before
            # this message, or it would be taken for this one's
            self._read_monitor()
        self.handle(E.ClientMessage(ident, fd, frames[1:], last.get("User-Id") if self.guard.curve else ""))

    def _on_worker(self, frames) -> None:
        try:
            done, w = self.pool.on_message([f.bytes for f in frames])
        except P.ProtocolError as exc:  # a worker of another version; never expected
            log.error("bad message from a worker: %s", exc)
            return
        if w is not None and w.state in ("idle", "busy"):
            self.ready.set()
        if done is not None:
            self.handle(E.WorkerDone(done, w.task if w is not None else None))

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop workers, drop clients, release every segment and socket. Idempotent; a call made
        while another thread is closing returns once that close is done (Service.stop calls it
        after a bounded join, while the loop's own exit may still be closing)."""
        if not self._close_lock.acquire(timeout=3 * self.config.stop_timeout_s + 10):
            log.error("another thread has been closing the dispatcher for too long; not waiting for it")
            return
        try:
            self._close()
        finally:
            self._close_lock.release()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._running_loop = False
        self._handling = False  # a loop that crashed mid-event left it set
        try:
            self.handle(E.Closing())  # clients first, so they start reconnecting while workers stop
        except zmq.ZMQError:
            pass
        try:
            self.pool.close(timeout=self.config.stop_timeout_s, waiting=self._answer_while_closing)
        finally:
            self.handle(E.Closed())
            self._close_lanes()  # before the segments go: a sender may still read a slot
            self.monitor.close(0)
            self.front.close()  # LINGER (CLOSE_LINGER_MS) lets the goodbyes above leave
            self.guard.close()  # the ZAP handler's socket would hold term() up
            self.ctx.term()  # returns once zmq has released every zero-copy frame
            self.pool_ctx.term()
            self.state.memory.close()
            self.colocation.close()
            self.mailbox.close()


def thread_stack(ident: Optional[int], name: str) -> str:
    """Where thread ``ident`` (called ``name`` if it has ended) is now, for a log line about a
    thread that does not answer or did not stop; thread-safe."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else f"({name} is not running)"


def _data_port(config: ServiceConfig):
    """The data port's context, ROUTER socket, CURVE guard and monitor socket, bound; and its
    port number. Whatever was made is closed again if a step fails."""
    ctx = zmq.Context(config.io_threads)
    front = ctx.socket(zmq.ROUTER)
    for opt, val in (
        (zmq.LINGER, CLOSE_LINGER_MS),
        (zmq.SNDHWM, 0),  # credits bound what is queued; a full ROUTER would drop batches
        # no cap on what a connection has sent and the loop has not read: libzmq 4.3.5 aborts the
        # process when a connection whose reading a cap stopped ends in a reset and then meets a
        # heartbeat or a PING (stream_engine_base.cpp:310). A flood is cut from the loop instead,
        # past its connection's allowance (flood.py: E.Cut)
        (zmq.RCVHWM, 0),
        (zmq.MAXMSGSIZE, P.MAX_CLIENT_MESSAGE_BYTES),  # oversized: the peer is disconnected
        # a client's new connection takes over its identity at once: after a freeze or a network
        # blip its old connection may not be torn down yet, and without handover the new one's
        # messages would be dropped until then (the client would wait for an answer forever)
        (zmq.ROUTER_HANDOVER, 1),
        # a send to an identity whose connection is gone fails at once instead of vanishing: the
        # session is dropped then, even when the monitor's disconnect was read before its Hello
        (zmq.ROUTER_MANDATORY, 1),
        # no ZMTP heartbeat of ours (HEARTBEAT_IVL 0, the default): ROUTER_HANDOVER stops libzmq
        # reading the connection whose identity a new one took, and a reset on it then met our
        # heartbeat timer: the abort above. The clients' PINGs (answered by libzmq) keep coming,
        # and the loop cuts a connection that brings nothing for 3 of them (silence.py: E.Probe)
    ):
        front.setsockopt(opt, val)
    try:
        guard = secure_router(ctx, front, config.curve_keys)  # CURVE + ZAP with keys (curve.py)
    except BaseException:  # bad keys: nothing started yet but the socket and its context
        front.close(0)
        ctx.term()
        raise
    monitor = front.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
    try:
        if config.data_port == 0:
            port = front.bind_to_random_port(f"tcp://{config.host}")
        else:
            front.bind(f"tcp://{config.host}:{config.data_port}")
            port = config.data_port
    except zmq.ZMQError as exc:  # a port in use or an address not on this host: a plain error, no leak
        monitor.close(0)
        front.close(0)
        guard.close()
        ctx.term()
        raise cannot_bind("data", config.host, config.data_port, exc.errno) from None
    return ctx, front, guard, monitor, port


def held_socket(fd: int) -> Optional[socket.socket]:
    """A socket object over a dup of libzmq's ``fd`` (closing it leaves libzmq's fd open), or
    None if ``fd`` is closed or no socket now."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def quiet_s(fd: int) -> Optional[Tuple[float, str, Optional[Sending]]]:
    """How long TCP connection ``fd`` has brought no data, by the kernel's clock (``TCP_INFO``'s
    ``last_data_recv``; infinity once its peer has closed or reset it: a connection libzmq reads
    is closed within milliseconds then, so one still open is one it no longer reads), its peer's
    address (``SO_PEERNAME``, which a connection already reset still answers, unlike getpeername;
    "" if unknown), and its send side (:meth:`Sending.of`); None if ``fd`` is no TCP socket now
    (closed meanwhile). The fd
    is read through a dup, so closing the dup leaves libzmq's. A number reused by a newer
    connection reads as that one, quiet for a short while: never cut for it (the cut checks the
    fd again: :meth:`Dispatcher._cut`)."""
    held = held_socket(fd)
    if held is None:
        return None
    with held:
        try:
            info = held.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, SENDING_INFO_BYTES)
        except OSError:
            return None
        try:
            # the kernel answers only a buffer no longer than the address: a sockaddr_in(6)'s size
            size = SOCKADDR_IN6_BYTES if held.family == socket.AF_INET6 else SOCKADDR_IN_BYTES
            address = peer_address(held.getsockopt(socket.SOL_SOCKET, SO_PEERNAME, size))
        except OSError:
            address = ""
    if len(info) < TCP_INFO_BYTES:
        return None
    if info[0] in TCP_PEER_CLOSED:
        return math.inf, address, Sending.of(info)
    return struct.unpack_from("=I", info, TCP_INFO_LAST_DATA_RECV)[0] / 1000.0, address, Sending.of(info)


def peer_address(raw: bytes) -> str:
    """The IP address in a ``struct sockaddr`` (IPv4 or IPv6) as ZAP names it; "" for another family."""
    family = struct.unpack_from("=H", raw)[0] if len(raw) >= 2 else -1
    if family == socket.AF_INET and len(raw) >= 8:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6 and len(raw) >= 24:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return ""


def cannot_bind(port: str, host: str, number: int, err: int) -> OSError:
    """The error for a ``port`` ("data", "REST" or "lane") that cannot be bound, with what to change."""
    option = {"data": "--data-port / LOADER_DATA_PORT", "REST": "--http-port / LOADER_HTTP_PORT",
              "lane": "--lane-port / LOADER_LANE_PORT"}[port]
    if err == errno.EADDRINUSE:
        hint = f"another process listens there: choose another port with {option}, or 0 for any free one"
    elif err == errno.EADDRNOTAVAIL:
        hint = "that address is not one of this machine's: set --host / LOADER_HOST to one of its addresses, or 0.0.0.0"
    elif err == errno.EACCES:
        hint = f"ports below 1024 need privileges: choose one above with {option}"
    else:
        hint = f"check --host / LOADER_HOST and {option}"
    return OSError(err, f"cannot bind the {port} port {host}:{number}: {os.strerror(err)} ({hint})")


def monitor_event(frames) -> dict:
    """A socket monitor message as {"event", "value", "endpoint"}, all plain values. Not pyzmq's
    ``parse_monitor_message``: it makes ``value`` (an fd, an errno) a ``zmq.Event`` flag, and the
    enum keeps a member for every value it meets, forever: one per fd number of a flood's
    connections, each pinning the heap it was allocated in (issue 32)."""
    event, value = struct.unpack("=hi", frames[0].bytes[:6])
    return {"event": event, "value": value, "endpoint": frames[1].bytes if len(frames) > 1 else b""}


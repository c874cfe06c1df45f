"""The dispatcher: the one thread where service state changes, as a thin I/O loop.

It reads three sockets (clients, workers, the connection monitor), the workers' process
sentinels and a wake-up pipe, turns what it reads into events for the pure parts and applies
the effects they return:

* :class:`~loader_service.dispatch.stream_state.StreamState`: one stream's batches, slots, redo and
  isolation rules, and the order batches leave in;
* :class:`~loader_service.dispatch.slots.SlotArena`: shared-memory segments and zero-copy sends;
* :class:`~loader_service.dispatch.sessions.Sessions`: client identities and connections;
* :class:`~loader_service.dispatch.scheduler.Scheduler`: which stream an idle worker serves;
* :class:`~loader_service.dispatch.deadlines.TaskDeadlines`: when a running task counts as hung.

Other threads never touch this state: they submit a function with :meth:`Dispatcher.call` (a
Future comes back) or :meth:`Dispatcher.post`, and the loop runs it between events. Every
wait of the loop has a deadline: the next task deadline or the end of a draining stop.

Failures are loud: an exception while handling a client's message fails that client's stream
with the traceback; an exception in the loop itself ends the loop with :attr:`failure` set,
which makes ``/healthz`` fail and ``serve`` exit non-zero.
"""

from __future__ import annotations

import dataclasses
import errno
import heapq
import itertools
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterator, List, Optional, Tuple, Union

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from wire import protocol as P
from loader_service.config import ServiceConfig
from loader_service.dispatch.curve import HANDSHAKE_FAILED, secure_router
from loader_service.dispatch.deadlines import TaskDeadlines
from loader_service.dispatch.jobs import describe_conflicts
from loader_service.decode.jpeg import decode_path
from loader_service.decode.pipelines import PipelineError, Registry, job_pipeline, named_pipeline
from wire.plan import make_plan
from loader_service.workers.pool import WorkerPool, describe_exit
from loader_service.dispatch import sending
from loader_service.dispatch.scheduler import Scheduler
from loader_service.dispatch.sending import BatchLayout
from loader_service.dispatch.sessions import Session, Sessions
from loader_service.dispatch.memory import BatchMemory, Refused, slot_cap
from loader_service.dispatch.streams import Opening, Stream
from loader_service.sources import Source
from loader_service.dispatch.status import (SKIPS_SHOWN, ClientStatus, ServiceStatus, SkippedSample, StreamStatus, Totals,
                     WorkersStatus, WorkerStatus)
from loader_service.dispatch.stream_state import Effect, Fail, Finish, RunTask, SendBatch, StreamLimits

log = logging.getLogger("loader_service.dispatch.dispatcher")

CLOSE_LINGER_MS = 500  # on close, how long goodbyes and batches already queued may take to leave


class AutoscaleConflict(RuntimeError):
    """A manual scale request while autoscaling is on."""


@dataclass
class _Running:
    """A task on a worker."""

    stream: Stream
    worker: int
    samples: int
    started: float
    deadline: float
    hung: bool = False  # killed past its deadline; its loss is reported when the worker is reaped


class Dispatcher:
    def __init__(self, config: ServiceConfig, sources: Dict[str, Source]):
        if not sources:
            raise ValueError("the service needs at least one dataset")
        self.config, self.sources = config, sources
        self.pipelines = Registry(config.pipeline)  # first: a pipeline that does not import stops the start here
        self.default_dataset = next(iter(sources))
        self.instance = uuid.uuid4().hex[:12]
        self.limits = StreamLimits(on_error=config.on_error, max_skipped=config.max_skipped)
        self.ctx = zmq.Context(config.io_threads)
        self.front = self.ctx.socket(zmq.ROUTER)
        for opt, val in (
            (zmq.LINGER, CLOSE_LINGER_MS),
            (zmq.SNDHWM, 0),  # credits bound what is queued; a full ROUTER would drop batches
            (zmq.RCVHWM, 0),
            (zmq.MAXMSGSIZE, P.MAX_CLIENT_MESSAGE_BYTES),  # oversized: the peer is disconnected
            # a client's new connection takes over its identity at once: after a freeze or a network
            # blip its old connection may not be torn down yet, and without handover the new one's
            # messages would be dropped until then (the client would wait for an answer forever)
            (zmq.ROUTER_HANDOVER, 1),
            (zmq.HEARTBEAT_IVL, int(config.heartbeat_s * 1000)),
            (zmq.HEARTBEAT_TIMEOUT, int(config.heartbeat_s * 3000)),
        ):
            self.front.setsockopt(opt, val)
        try:
            self.guard = secure_router(self.ctx, self.front, config.curve_keys)  # CURVE + ZAP with keys (curve.py)
        except BaseException:  # bad keys: nothing started yet but the socket and its context
            self.front.close(0)
            self.ctx.term()
            raise
        self.monitor = self.front.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        try:
            if config.data_port == 0:
                self.data_port = self.front.bind_to_random_port(f"tcp://{config.host}")
            else:
                self.front.bind(f"tcp://{config.host}:{config.data_port}")
                self.data_port = config.data_port
        except zmq.ZMQError as exc:  # a port in use or an address not on this host: a plain error, no leak
            self.monitor.close(0)
            self.front.close(0)
            self.guard.close()
            self.ctx.term()
            raise cannot_bind("data", config.host, config.data_port, exc.errno) from None
        self.pool = WorkerPool(self.ctx, [s.spec() for s in sources.values()], config.start_method,
                               config.decode_options, config.worker_start_s)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._calls: "queue.SimpleQueue[Tuple[Callable, Optional[Future]]]" = queue.SimpleQueue()
        self.sessions = Sessions()
        cap, hint = slot_cap(config.max_shm_bytes)
        self.memory = BatchMemory(cap, config.reclaim_idle_s, self._live_streams, self.sessions.__contains__, hint)
        self.loop_thread: Optional[int] = None  # the thread running :meth:`run`
        self.scheduler = Scheduler()
        self.deadlines = TaskDeadlines(config.task_deadline_s, config.task_deadline_floor_s)
        self.running: Dict[int, _Running] = {}  # task id -> where it runs
        self._deadline_heap: List[Tuple[float, int]] = []  # (deadline, task id)
        self.totals = Totals()
        self.recent_skips: Deque[SkippedSample] = deque(maxlen=SKIPS_SHOWN)  # for the status page
        self._task_ids = itertools.count()
        self._running_loop = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._stop_by: Optional[float] = None  # a draining stop: end the loop by then
        self.failure = ""  # why the loop died ("" while it is fine)
        self.ready = threading.Event()  # set once a worker has said Ready
        self._rate: Deque[Tuple[float, int]] = deque(maxlen=64)
        self.started = time.time()
        self.autoscaler = None
        if config.autoscale:
            from loader_service.control.autoscale import AutoscalePolicy, Autoscaler

            self.autoscaler = Autoscaler(AutoscalePolicy.parse(config.autoscale, config.autoscale_interval_s))

    # ------------------------------------------------------------------ other threads
    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the dispatcher thread; thread-safe. The Future fails with
        RuntimeError if the dispatcher has stopped."""
        fut: Future = Future()
        if self._closed:
            fut.set_exception(RuntimeError(f"the dispatcher has stopped{': ' + self.failure if self.failure else ''}"))
            return fut
        self._enqueue(lambda: fn(*args), fut)
        return fut

    def loop_stack(self) -> str:
        """Where the loop thread is now (for a log line when it does not answer); thread-safe."""
        frame = sys._current_frames().get(self.loop_thread) if self.loop_thread is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(the loop thread is not running)"

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the dispatcher thread, no answer; thread-safe, never blocks. Dropped
        once the dispatcher has stopped."""
        if not self._closed:
            self._enqueue(fn, None)

    def _enqueue(self, fn: Callable, fut: Optional[Future]) -> None:
        self._calls.put((fn, fut))
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or we are shutting down

    def stop(self, drain_s: float = 0.0) -> None:
        """Ask the loop to end, after letting tasks in flight finish and go out for up to
        ``drain_s`` seconds (thread-safe, idempotent)."""
        self.call(self._request_stop, drain_s)

    def _request_stop(self, drain_s: float) -> None:
        if drain_s <= 0 or not self.running:
            self._running_loop = False
        elif self._stop_by is None:
            self._stop_by = time.monotonic() + drain_s
            log.info("letting %d tasks in flight finish (at most %.1fs) before stopping", len(self.running), drain_s)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve until :meth:`stop`. Cleans up everything it owns on the way out. If the loop
        itself fails, :attr:`failure` says why and the exception propagates."""
        self._running_loop = True
        self.loop_thread = threading.get_ident()
        poller = zmq.Poller()
        for s in (self.front, self.pool.sock, self.monitor):
            poller.register(s, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        sentinels: Dict[int, int] = {}
        pool_version = -1
        workers = self.config.workers
        if self.autoscaler is not None:
            p = self.autoscaler.policy
            workers = min(max(workers, p.min_workers), p.max_workers)
        try:
            self.pool.scale(workers)
            while self._running_loop:
                if pool_version != self.pool.version:
                    for fd in sentinels:
                        poller.unregister(fd)
                    sentinels = self.pool.sentinels()
                    for fd in sentinels:
                        poller.register(fd, zmq.POLLIN)
                    pool_version = self.pool.version
                timeout = self._poll_timeout_ms()
                if not self._running_loop:
                    break
                events = dict(poller.poll(timeout))
                if self._wake_r.fileno() in events:
                    self._run_calls()
                if self.monitor in events:
                    self._read_all(self.monitor, self._on_monitor)
                if self.pool.sock in events:
                    self._read_all(self.pool.sock, self._on_worker)
                if self.front in events:
                    self._read_all(self.front, self._on_client)
                for fd, wid in sentinels.items():
                    if fd in events:
                        self._on_worker_exit(wid)
                self._expire_tasks()
                self.pool.expire_starts(time.monotonic())
                if self.pool.broken:
                    self._fail_all(self.pool.broken)
                self._release_idle_streams()
                self._lend_if_due()
                self._schedule()
        except BaseException as exc:
            self.failure = f"the dispatcher loop crashed: {type(exc).__name__}: {exc}"
            log.critical("%s\n%s", self.failure, traceback.format_exc())
            raise
        finally:
            self.close()

    def _poll_timeout_ms(self) -> Optional[int]:
        """Until the next task deadline, a starting worker's deadline, the next time a quiet
        stream's slots may be lent to one that waits for slots, or the end of a draining stop
        (None: no deadline)."""
        now = time.monotonic()
        heap = self._deadline_heap
        while heap and heap[0][1] not in self.running:
            heapq.heappop(heap)  # that task is done: no wake-up for its deadline
        ends = []
        if heap:
            ends.append(self._deadline_heap[0][0])
        start_due = self.pool.next_start_deadline()
        if start_due is not None:
            ends.append(start_due)
        lend_due = self.memory.next_lend_at(now)
        if lend_due is not None:
            ends.append(lend_due)
        if self._stop_by is not None:
            if now >= self._stop_by or not self.running:
                self._running_loop = False
                return 0
            ends.append(self._stop_by)
        if not ends:
            return None
        return max(1, int((min(ends) - now) * 1000) + 1)

    def _read_all(self, sock: zmq.Socket, handler: Callable, limit: int = 256) -> None:
        for _ in range(limit):  # bounded, so one busy socket cannot starve the others
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception as exc:
                # a bug met by one message must not take the service down for everyone
                tb = traceback.format_exc()
                self.totals.internal_errors += 1
                log.error("error handling a message: %s\n%s", exc, tb)
                if sock is self.front:
                    self._internal_error(frames[0].bytes, exc, tb)

    def _internal_error(self, ident: bytes, exc: Exception, tb: str) -> None:
        session = self.sessions.get(ident)
        msg = f"internal error in the service: {type(exc).__name__}: {exc}"
        try:
            if session is not None and session.stream is not None:
                self._end_stream(session.stream, Fail(P.ErrorCode.INTERNAL, msg, tb))
            else:
                self._send(ident, P.Error(code=P.ErrorCode.INTERNAL, message=msg, traceback=tb))
        except Exception:
            log.exception("could not report an internal error to client %s", ident.hex()[:12])

    def _run_calls(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut is None:
                fn()  # a post: an error here is the loop's own (and loud)
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the caller, who raises it
                    fut.set_exception(exc)

    # ------------------------------------------------------------------ clients
    def _on_monitor(self, frames) -> None:
        ev = parse_monitor_message([f.bytes for f in frames])
        if ev["event"] == zmq.EVENT_ACCEPTED:
            self.sessions.accepted(ev["value"])
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            ident = self.sessions.disconnected(ev["value"])
            if ident is not None:
                self._drop_client(ident, "disconnected")
        elif self.guard.on_event(ev):
            self.totals.refused_handshakes += 1

    def _on_client(self, frames) -> None:
        ident = frames[0].bytes
        fd = frames[-1].get(zmq.SRCFD)
        session = self.sessions.get(ident)
        if session is None or session.fd != fd:
            # A new connection's accept is reported before any of its messages can arrive, but
            # the monitor may not have been read yet: read it now, so that the disconnect of an
            # earlier connection on this fd number is not taken for this one's.
            self._read_all(self.monitor, self._on_monitor)
            session = self.sessions.get(ident)
            if session is not None and session.fd != fd:
                self._bind_fd(session, fd)
        try:
            msg, _ = P.decode(frames[1:], expect=(P.Hello, P.Credit, P.Request, P.Bye, P.Describe))
        except P.ProtocolError as exc:
            self.totals.bad_messages += 1
            log.warning("refused a message from client %s: %s", ident.hex()[:12], exc)
            self._send(ident, P.Error(code=exc.code, message=str(exc), stream=_stream_of(frames[1])))
            return
        if isinstance(msg, P.Hello) and self._stop_by is not None:
            self._send(ident, P.Error(code=P.ErrorCode.SHUTTING_DOWN, stream=msg.stream, fatal=False,
                                      message="the service is shutting down; reconnect and resume"))
            return
        if isinstance(msg, P.Hello):
            if session is None:
                session = self.sessions.add(ident)
                self._bind_fd(session, fd)
            self._start_stream(session, msg)
        elif isinstance(msg, (P.Credit, P.Request)):
            self._on_credit(ident, session, msg)
        elif isinstance(msg, P.Describe):
            self._describe(ident, msg)
        elif isinstance(msg, P.Bye):
            self._drop_client(ident, "said bye")

    def _bind_fd(self, session: Session, fd: int) -> None:
        for other in self.sessions.bind(session, fd):
            self._drop_client(other, "connection replaced")

    def _describe(self, ident: bytes, msg: P.Describe) -> None:
        source = self._source(ident, msg.dataset, stream=-1)
        if source is None:
            return
        outputs = []
        if msg.pipeline:
            try:
                outputs = named_pipeline(self.pipelines, msg.pipeline, msg.pipeline_args).outputs()
            except PipelineError as exc:
                return self._send(ident, P.Error(code=P.ErrorCode.BAD_JOB, message=str(exc)))
        self._send(ident, P.DatasetInfo(dataset=source.name, length=len(source), num_classes=source.num_classes,
                                        outputs=outputs))

    def _source(self, ident: bytes, name: Optional[str], stream: int) -> Optional[Source]:
        source = self.sources.get(name or self.default_dataset)
        if source is None:
            self._send(ident, P.Error(
                code=P.ErrorCode.UNKNOWN_DATASET, stream=stream,
                message=f"unknown dataset {name!r}; this service serves {sorted(self.sources)}"))
        return source

    def _refuse(self, ident: bytes, hello: P.Hello, code: str, message: str, fatal: bool = True) -> None:
        self._send(ident, P.Error(code=code, stream=hello.stream, message=message, fatal=fatal))

    def _start_stream(self, session: Session, hello: P.Hello) -> None:
        ident = session.ident
        if hello.stream <= session.stream_id:
            return self._refuse(ident, hello, P.ErrorCode.BAD_JOB,
                                f"stream {hello.stream} is not newer than this client's stream {session.stream_id}")
        session.stream_id, session.job, session.client = hello.stream, hello.job, hello.client
        self.memory.waiting.pop(ident, None)
        if session.stream is not None:
            self._retire(session.stream)
        source = self._source(ident, hello.spec.dataset, hello.stream)
        if source is None:
            return
        if hello.job and not self._admit_rank(session, hello, source.name):
            return
        if self.pool.broken:
            return self._refuse(ident, hello, P.ErrorCode.INTERNAL, self.pool.broken)
        try:
            plan = make_plan(hello.spec.plan(len(source), hello.epoch, hello.rank))
        except ValueError as exc:
            return self._refuse(ident, hello, P.ErrorCode.BAD_JOB, str(exc))
        nb = plan.num_batches
        if hello.start_batch > nb:
            return self._refuse(ident, hello, P.ErrorCode.BAD_JOB,
                                f"start_batch {hello.start_batch} is past the end of the epoch ({nb} batches)")
        if hello.batches and max(hello.batches) >= nb:
            return self._refuse(ident, hello, P.ErrorCode.BAD_JOB, (
                f"batch {max(hello.batches)} is past the end of the epoch ({nb} batches here); does the "
                "client's plan come from another dataset (replicas serving different data)?"))
        if hello.on_demand:
            order, granted, final = list(hello.batches), len(hello.batches), False
            nslots = max(1, min(hello.prefetch, nb))
        else:
            order = list(hello.batches) if hello.batches else list(range(hello.start_batch, nb))
            granted, final = hello.prefetch, True
            nslots = max(1, min(hello.prefetch, len(order)))
        try:
            pipe = job_pipeline(self.pipelines, hello.spec)
        except PipelineError as exc:
            return self._refuse(ident, hello, P.ErrorCode.BAD_JOB, str(exc))
        layout = BatchLayout.of(pipe, hello.spec.batch_size)
        opening = Opening(session, hello, source, plan, pipe, layout, self.limits, order, granted, final, nslots)
        result = self.memory.open(opening, time.monotonic())
        if result is None:
            log.info("client %s stream %d waits for %.1f MiB of slots that ending streams still hold",
                     session.name, hello.stream, opening.nbytes / 2**20)
        else:
            self._opened([(opening, result)])

    def _opened(self, results: List[Tuple[Opening, Union[Stream, Refused]]]) -> None:
        """Start serving the streams that have their slots now; refuse those that cannot."""
        for o, result in results:
            if isinstance(result, Refused):
                self._refuse(o.ident, o.hello, P.ErrorCode.NO_CAPACITY, result.message, fatal=result.fatal)
            else:
                self._start(o.session, result)

    def _start(self, session: Session, stream: Stream) -> None:
        hello, source, plan = stream.hello, stream.source, stream.plan
        session.stream = stream
        self.totals.streams += 1
        self._send(session.ident, P.Accept(stream=hello.stream, epoch=hello.epoch, num_batches=plan.num_batches,
                                           num_samples=plan.num_samples, dataset_length=len(source),
                                           dataset=source.name, service=self.instance))
        log.info("client %s job %r rank %d/%d epoch %d: stream %d %s %d of %d batches%s", session.name,
                 hello.job, hello.rank, hello.spec.world_size, hello.epoch, hello.stream,
                 "on demand, asked at once for" if hello.on_demand else "serves", len(stream.state.order),
                 plan.num_batches, " (lookahead)" if hello.lookahead else "")
        self._apply(stream, stream.state.start())

    def _admit_rank(self, session: Session, hello: P.Hello, dataset: str) -> bool:
        """The job rules (jobs.py): refuse a rank whose plan differs from its job's connected
        ranks; take a (job, rank) over from an older client. False: refused."""
        spec = hello.spec.on(dataset)
        others = [x for x in self.sessions if x is not session and x.spec is not None and x.job == hello.job
                  and x.client != hello.client]
        for other in others:
            diff = spec.differences(other.spec)
            if diff:
                self._refuse(session.ident, hello, P.ErrorCode.BAD_JOB,
                             describe_conflicts(hello.job, hello.rank, other.rank, diff))
                return False
        for other in others:
            if other.rank == hello.rank:
                why = (f"rank {hello.rank} of job {hello.job!r} was taken over by a newer client "
                       f"({session.name}); two loaders must not serve one rank")
                log.warning("client %s: %s", other.name, why)
                other.spec = None
                if other.stream is not None:
                    self._end_stream(other.stream, Fail(P.ErrorCode.REPLACED, why))
                else:
                    self._send(other.ident, P.Error(code=P.ErrorCode.REPLACED, message=why))
        session.rank, session.spec = hello.rank, spec
        return True

    def _on_credit(self, ident: bytes, session: Optional[Session], msg) -> None:
        """A Credit (more of a plain stream) or a Request (batches of an on-demand stream)."""
        if session is None or msg.stream > session.stream_id:
            # the service restarted or forgot this client: it will start again from its cursor
            self._send(ident, P.Error(code=P.ErrorCode.UNKNOWN_CLIENT, stream=msg.stream, fatal=False,
                                      message="this service has no stream for the client; start it again"))
            return
        s = session.stream
        o = self.memory.waiting.get(ident) if s is None else None  # a stream still waiting for its slots
        if (o is None or o.hello.stream != msg.stream) and (s is None or s.id != msg.stream):
            return  # for a stream that already ended or was replaced
        # the stall figures are deltas since the connection's previous message: add, keep no baseline
        self.totals.wait_s += msg.wait_s
        self.totals.h2d_s += msg.h2d_s
        if s is None:
            o.asked(msg)
            if getattr(msg, "probe", False):
                self._send(ident, self._progress(msg.stream, None, len(o.order), no_slots=True))
            return
        if getattr(msg, "probe", False):
            self._send(ident, self._progress(s.id, s, s.state.not_started, no_slots=s in self.memory.starved))
        if (isinstance(msg, P.Credit) and msg.n) or (isinstance(msg, P.Request) and msg.batches):
            s.asked_at = time.monotonic()
        s.wait_s += msg.wait_s
        s.h2d_s += msg.h2d_s
        if msg.promote:
            s.lookahead = False
        if isinstance(msg, P.Credit):
            if s.hello.on_demand:
                return self._end_stream(s, Fail(P.ErrorCode.BAD_MESSAGE, "Credit on an on_demand stream; send Request"))
            s.state.grant(msg.n)
            self.memory.wake(s, time.monotonic())
            return
        if not s.hello.on_demand:
            return self._end_stream(s, Fail(P.ErrorCode.BAD_MESSAGE, "Request on a stream that is not on_demand"))
        nb = s.plan.num_batches
        bad = [b for b in msg.batches if b >= nb]
        if bad:
            return self._end_stream(s, Fail(P.ErrorCode.BAD_JOB, (
                f"batch {max(bad)} is past the end of the epoch ({nb} batches here); does the client's plan "
                "come from another dataset (replicas serving different data)?")))
        try:
            effects = s.state.extend(msg.batches, final=msg.final)
        except ValueError as exc:  # a batch asked for twice
            return self._end_stream(s, Fail(P.ErrorCode.BAD_JOB, str(exc)))
        self._apply(s, effects)
        self.memory.wake(s, time.monotonic())

    def _progress(self, stream_id: int, s: Optional[Stream], not_started: int, no_slots: bool) -> P.Progress:
        """What the service does for stream ``s`` now (None: not yet opened), for a client that
        has waited a while: its longest-running task, and the sample that task's worker is on."""
        counts = self.pool.counts()
        base = dict(stream=stream_id, workers=self.pool.live_count(),
                    busy=counts.get("busy", 0) + counts.get("leaving", 0), waiting=not_started, no_slots=no_slots)
        mine = [(tid, r) for tid, r in self.running.items() if r.stream is s] if s is not None else []
        if not mine:
            return P.Progress(tasks=0, **base)
        tid, r = min(mine, key=lambda x: x[1].started)
        task = s.state.tasks.get(tid)
        batch = task.batch if task is not None else -1
        sample, file, sample_s = -1, "", 0.0
        w = self.pool.workers.get(r.worker)
        if task is not None and w is not None and w.task == tid:
            pos, sample_s = w.current_sample()
            indices = s.plan.batch(task.batch)
            if task.pos >= 0:  # a one-sample task: its only sample
                pos = task.pos if pos == 0 else -1
            if 0 <= pos < len(indices):
                sample = int(indices[pos])
                try:
                    file = s.source.describe(sample)
                except Exception as exc:  # a name is a courtesy; the progress report still goes
                    file = f"(no name: {type(exc).__name__})"
        return P.Progress(tasks=len(mine), batch=batch, task_s=time.monotonic() - r.started, sample=sample,
                          file=file, sample_s=sample_s, **base)

    def _lend_if_due(self) -> None:
        """Retry what waits for slots if a quiet stream's slots may be lent now."""
        self._opened(self.memory.lend_if_due(time.monotonic()))

    def _live_streams(self) -> Iterator[Stream]:
        """The streams being served (the batch memory's view of them)."""
        return (x.stream for x in self.sessions if x.stream is not None)

    def _drop_client(self, ident: bytes, why: str) -> None:
        session = self.sessions.pop(ident)
        self.memory.waiting.pop(ident, None)
        if session is None:
            return
        if session.stream is not None:
            self._retire(session.stream)
        self.memory.forget(ident)
        log.info("client %s %s", session.name, why)
        self._opened(self.memory.retry(time.monotonic()))

    def _send(self, ident: bytes, msg: P.Message) -> None:
        self.front.send_multipart([ident, *P.encode(msg)])

    # ------------------------------------------------------------------ streams
    def _apply(self, s: Stream, effects: List[Effect]) -> None:
        """Carry out what a stream's state asked for."""
        for e in effects:
            if isinstance(e, SendBatch):
                self._send_batch(s, e)
            else:
                self._end_stream(s, e)

    def _end_stream(self, s: Stream, e: Effect) -> None:
        """Tell the client how its stream ended (``Finish`` or ``Fail``), then retire it."""
        if isinstance(e, Finish):
            self._send(s.ident, P.EndOfEpoch(stream=s.id, epoch=s.hello.epoch, num_batches=s.plan.num_batches))
        elif isinstance(e, Fail):
            log.error("stream %d of client %s failed: %s", s.id, s.ident.hex()[:12], e.message)
            self._send(s.ident, P.Error(code=e.code, message=e.message, stream=s.id, fatal=True,
                                         traceback=e.traceback))
        self._retire(s)

    def _retire(self, s: Stream) -> None:
        """Stop serving ``s``; its slots go back once no task or send still uses them."""
        session = self.sessions.get(s.ident)
        if session is not None and session.stream is s:
            session.stream = None
        self._opened(self.memory.retire(s, time.monotonic()))

    def _release_idle_streams(self) -> None:
        """Retired streams that nothing reads any more give their slots back: retry what waits."""
        self._opened(self.memory.release_idle(time.monotonic()))

    def _send_batch(self, s: Stream, e: SendBatch) -> None:
        out = sending.outgoing(s.layout, s.plan, s.id, s.hello.epoch, e)
        if out.keep is not None:
            for idx, reason in out.message.skipped:
                self.recent_skips.append(SkippedSample(dataset=s.source.name, index=int(idx), reason=str(reason)))
            if e.compact:
                sending.compact(s.segment, s.layout, e.slot, out.keep)
            self.totals.skipped += len(out.message.skipped)
        n = len(out.indices)
        header = P.encode_header(out.message)
        labels = np.ascontiguousarray(s.source.labels[out.indices], dtype=np.int64).tobytes()
        slot, state = e.slot, s.state
        pending = [0]  # zero-copy frames of this batch libzmq still reads: the slot is free at 0

        def sent() -> None:  # a post: runs on this thread, after this method has counted every frame
            pending[0] -= 1
            if not pending[0]:
                self._send_complete(s, slot)

        frames, nbytes = [], 0
        for offset, size in out.blocks:
            frame, zero_copy = sending.frame(s.segment, offset, size, lambda: self.post(sent))
            frames.append(frame)
            pending[0] += zero_copy
            nbytes += size
        self.front.send_multipart([s.ident, header, *frames, labels], copy=False)
        if not pending[0]:
            state.send_complete(slot)
        del frames, frame
        session = self.sessions.get(s.ident)
        if session is not None:
            session.batches += 1
            session.samples += n
        self.totals.samples += n
        self.totals.batches += 1
        self.totals.bytes += nbytes
        self._rate.append((time.monotonic(), self.totals.samples))

    def _send_complete(self, s: Stream, slot: int) -> None:
        # runs as a post, so the loop schedules right after: a stream that waited for this slot
        # can take an idle worker at once
        s.state.send_complete(slot)

    def _fail_all(self, why: str) -> None:
        for session in self.sessions:
            if session.stream is not None:
                self._end_stream(session.stream, Fail(P.ErrorCode.INTERNAL, why))

    # ------------------------------------------------------------------ workers
    def _schedule(self) -> None:
        idle = self.pool.idle()
        if not idle or self._stop_by is not None:
            return
        streams = [c.stream for c in self.sessions if c.stream is not None]
        self.scheduler.pick(streams, len(idle), lambda s: s.segment is not None and s.state.dispatchable(),
                            lambda s: s.lookahead,
                            lambda s: self._dispatch(s, idle.pop()))

    def _dispatch(self, s: Stream, worker) -> None:
        task_id = next(self._task_ids)
        t = s.state.next_task(task_id)
        assert t is not None, "the scheduler picked a stream with nothing to do"
        self._run_task(s, t, worker)

    def _run_task(self, s: Stream, t: RunTask, worker) -> None:
        batch = s.plan.batch(t.batch)
        if t.pos >= 0:
            indices, position = [int(batch[t.pos])], t.pos
        else:
            indices, position = batch.tolist(), 0
        h, p = s.hello, s.pipe
        task = P.Task(task=t.task, dataset=s.source.name, shm=s.segment.name, offset=t.slot * s.slot_bytes,
                      indices=indices, seed=h.spec.seed, epoch=h.epoch, on_error=self.config.on_error, pipeline=p.name,
                      target=p.target, pipeline_args=p.args, capacity=h.spec.batch_size, position=position)
        now = time.monotonic()
        deadline = now + self.deadlines.deadline_s(len(indices))
        self.running[t.task] = _Running(s, worker.id, len(indices), now, deadline)
        heapq.heappush(self._deadline_heap, (deadline, t.task))
        self.pool.assign(worker, task)

    def _on_worker(self, frames) -> None:
        try:
            done, w = self.pool.on_message([f.bytes for f in frames])
        except P.ProtocolError as exc:  # a worker of another version; never expected
            log.error("bad message from a worker: %s", exc)
            return
        if w is not None and w.state in ("idle", "busy"):
            self.ready.set()
        if done is None:
            return
        r = self.running.pop(done.task, None)
        if r is None:
            return
        self.deadlines.observe(r.samples, time.monotonic() - r.started)
        self.totals.read_s += done.read_s
        self.totals.decode_s += done.decode_s
        if not done.ok:
            self.totals.failed_tasks += 1
        skipped = [(int(p), int(i), str(why)) for p, i, why in done.skipped]
        effects = r.stream.state.task_done(done.task, skipped, "" if done.ok else done.error,
                                           "" if done.ok else done.traceback)
        self._apply(r.stream, effects)

    def _on_worker_exit(self, wid: int) -> None:
        task_id, exitcode = self.pool.reap(wid)
        if task_id is None:
            return
        r = self.running.pop(task_id, None)
        if r is None:
            return
        self.totals.redone_tasks += 1
        if r.hung:
            reason = f"hung: still running after its {r.deadline - r.started:.1f}s deadline (worker killed)"
        else:
            reason = f"crashed the decoder (worker {describe_exit(exitcode)})"
        self._apply(r.stream, r.stream.state.task_lost(task_id, reason))

    def _expire_tasks(self) -> None:
        """Kill the worker of every task past its deadline; its loss is handled when it is reaped."""
        now = time.monotonic()
        while self._deadline_heap and self._deadline_heap[0][0] <= now:
            _, task_id = heapq.heappop(self._deadline_heap)
            r = self.running.get(task_id)
            if r is None or r.hung:
                continue
            w = self.pool.workers.get(r.worker)
            if w is None or w.task != task_id:
                continue
            r.hung = True
            self.totals.hung_tasks += 1
            log.warning("task %d (stream %d, %d samples) on worker %d (pid %s) outlived its %.1fs deadline; "
                        "killing the worker, the task is redone", task_id, r.stream.id, r.samples, w.id, w.pid,
                        r.deadline - r.started)
            try:
                os.kill(w.pid, signal.SIGKILL)  # works on a stopped (SIGSTOP) process too
            except (ProcessLookupError, PermissionError):
                pass  # already gone: its sentinel reports it

    # ------------------------------------------------------------------ status and control
    def snapshot(self) -> ServiceStatus:
        """A consistent, typed snapshot (call it through :meth:`call`)."""
        now = time.monotonic()
        rate = 0.0
        if len(self._rate) >= 2 and now - self._rate[0][0] > 0:
            t0, n0 = self._rate[0]
            rate = (self.totals.samples - n0) / (now - t0) if now - self._rate[-1][0] < 5 else 0.0
        pool = self.pool
        workers = [
            WorkerStatus(id=w.id, pid=w.pid, state=w.state, tasks_done=w.tasks_done, busy_s=round(w.busy_s, 3),
                         uptime_s=round(now - w.started_at, 1),
                         task_s=round(now - w.task_started, 3) if w.task is not None else None)
            for w in pool.workers.values()
        ]
        # one entry per client: a loader's second connection (its epoch lookahead) is not another client
        held: Dict[str, int] = {}  # a loader's batch memory over all its connections
        for c in self.sessions:
            key = c.client or c.name
            held[key] = held.get(key, 0) + self.memory.slot_bytes(c.ident, c.stream)
        clients = [self._client_status(c, now, self.memory.slots_word(c.ident, c.stream), held[c.client or c.name])
                   for c in self._one_session_per_client()]
        c = self.totals
        problem = self.failure or pool.broken
        sizes = [s.hello.spec.batch_size for s in (x.stream for x in self.sessions) if s is not None] or [1]
        return ServiceStatus(
            instance=self.instance, uptime_s=round(time.time() - self.started, 1), healthy=not problem,
            problem=problem, data_port=self.data_port, data_port_curve=self.guard.curve,
            datasets={n: {"length": len(s), "num_classes": s.num_classes} for n, s in self.sources.items()},
            workers=WorkersStatus(target=pool.target, counts=pool.counts(), deaths=pool.deaths, hung=c.hung_tasks,
                                  broken=pool.broken, live=pool.live_count(),
                                  busy_s_total=round(pool.busy_seconds(), 3), list=workers),
            clients=clients,
            throughput={"samples_per_s": round(rate, 1)},
            totals=dataclasses.replace(c), stage_s=c.stage_seconds(),
            shm_bytes=self.memory.in_use(),
            task_deadline_s=round(self.deadlines.deadline_s(sorted(sizes)[len(sizes) // 2]), 3),
            autoscaler=self.autoscaler.status() if self.autoscaler else {"enabled": False},
            decode_path=decode_path(),
            shm_limit_bytes=self.memory.max_bytes, skipped_recent=list(self.recent_skips),
        )

    def status(self) -> dict:
        """:meth:`snapshot` as plain JSON-ready data."""
        return self.snapshot().model_dump(mode="json")

    def _one_session_per_client(self) -> List[Session]:
        """A loader's connections as one client: the one serving its current epoch if any."""
        def rank(c: Session) -> int:
            return 0 if c.stream is not None and not c.stream.lookahead else 1 if c.stream is not None else 2

        shown: Dict[str, Session] = {}
        out = []
        for c in self.sessions:
            if not c.client:
                out.append(c)
            elif c.client not in shown or rank(c) < rank(shown[c.client]):
                shown[c.client] = c
        return out + list(shown.values())

    @staticmethod
    def _client_status(c: Session, now: float, slots: str, slot_bytes: int) -> ClientStatus:
        s = c.stream
        stream = None
        if s is not None:
            st, h = s.state, s.hello
            stream = StreamStatus(
                id=s.id, dataset=s.source.name, epoch=h.epoch, rank=h.rank, world_size=h.spec.world_size,
                batch_size=h.spec.batch_size,
                next_batch=st.order[st.next_send] if st.next_send < len(st.order) else s.plan.num_batches,
                sent=st.next_send, to_send=st.to_send, num_batches=s.plan.num_batches,
                credits=st.granted - st.next_send, in_flight=len(st.tasks), lookahead=s.lookahead,
                skipped=st.skipped, wait_s=round(s.wait_s, 3), h2d_s=round(s.h2d_s, 3))
        return ClientStatus(client=c.name, job=c.job, batches=c.batches, samples=c.samples,
                            connected_s=round(now - c.connected, 1), stream=stream, slots=slots,
                            slot_bytes=slot_bytes)

    def scale(self, n: int) -> dict:
        """Set the worker count (REST). Refused while the autoscaler owns the count."""
        if self.autoscaler is not None:
            p = self.autoscaler.policy
            raise AutoscaleConflict(f"the autoscaler manages the worker count ({p.min_workers}:{p.max_workers}); "
                                    "restart without --autoscale to set it by hand")
        if not 0 <= n <= self.config.max_workers:
            raise ValueError(f"worker count must be in [0, {self.config.max_workers}], got {n}")
        before = self.pool.target
        self.pool.scale(n)
        log.info("worker pool scaled %d -> %d by request", before, n)
        return {"previous": before, "target": n, "workers": self.pool.counts()}

    def autoscale_step(self) -> Optional[dict]:
        """One autoscaler decision from a fresh snapshot, applied to the pool."""
        assert self.autoscaler is not None
        decision = self.autoscaler.step(self.snapshot())
        if decision is not None and decision["to"] != decision["from"]:
            self.pool.scale(decision["to"])
        return decision

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
        # tell clients first, so they start reconnecting while workers stop
        for session in self.sessions:
            try:
                self._send(session.ident, P.Error(code=P.ErrorCode.SHUTTING_DOWN, fatal=False,
                                                  message="the service is stopping; reconnect and resume"))
            except zmq.ZMQError:
                pass
        self.memory.stop()  # nothing opens while the service stops
        try:
            self.pool.close(timeout=self.config.stop_timeout_s)
        finally:
            for session in self.sessions:
                self._drop_client(session.ident, "service stopping")
            self.monitor.close(0)
            self.front.close()  # LINGER (CLOSE_LINGER_MS) lets the goodbyes above leave
            self.guard.close()  # the ZAP handler's socket would hold term() up
            self.ctx.term()  # returns once zmq has released every zero-copy frame
            self.memory.close()
            self._wake_r.close()
            self._wake_w.close()
            while True:  # anyone still waiting on a call learns that the service is gone
                try:
                    _, fut = self._calls.get_nowait()
                except queue.Empty:
                    break
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError("the service stopped"))


def cannot_bind(port: str, host: str, number: int, err: int) -> OSError:
    """The error for a ``port`` ("data" or "REST") that cannot be bound, with what to change."""
    option = {"data": "--data-port / LOADER_DATA_PORT", "REST": "--http-port / LOADER_HTTP_PORT"}[port]
    if err == errno.EADDRINUSE:
        hint = f"another process listens there: choose another port with {option}, or 0 for any free one"
    elif err == errno.EADDRNOTAVAIL:
        hint = "that address is not one of this machine's: set --host / LOADER_HOST to one of its addresses, or 0.0.0.0"
    elif err == errno.EACCES:
        hint = f"ports below 1024 need privileges: choose one above with {option}"
    else:
        hint = f"check --host / LOADER_HOST and {option}"
    return OSError(err, f"cannot bind the {port} port {host}:{number}: {os.strerror(err)} ({hint})")


def _stream_of(frame) -> int:
    """Best effort: the stream a refused message was about, so its sender can match the error."""
    try:
        header = msgpack.unpackb(frame.bytes, raw=False)
        stream = header.get("stream", -1)
        return stream if isinstance(stream, int) and not isinstance(stream, bool) else -1
    except Exception:
        return -1

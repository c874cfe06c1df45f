"""The dispatcher: the one thread where service state changes, as a thin I/O loop.

It reads three sockets (clients, workers, the connection monitor), the workers' process
sentinels and a wake-up pipe, turns what it reads into events for the pure parts and carries
out what they decide (messages, tasks for workers, killed workers):

* :class:`~loader_service.dispatch.admission.Admission`: what a Hello becomes (job rules included);
* :class:`~loader_service.dispatch.memory.BatchMemory`: batch slots, reserves, lending, waiting;
* :class:`~loader_service.dispatch.stream_state.StreamState`: one stream's batches, slots, redo and
  isolation rules, and the order batches leave in;
* :mod:`~loader_service.dispatch.sending`: a batch's message and the slot blocks it is sent from;
* :class:`~loader_service.dispatch.tasks.Tasks`: tasks on workers and their deadlines;
* :class:`~loader_service.dispatch.scheduler.Scheduler`: which stream an idle worker serves;
* :class:`~loader_service.dispatch.sessions.Sessions`: connections and their identities;
* :mod:`~loader_service.dispatch.status`: the status snapshot.

Other threads never touch this state: they submit a function with :meth:`Dispatcher.call` (a
Future comes back) or :meth:`Dispatcher.post`, and the loop runs it between events (through
its :class:`~loader_service.dispatch.mailbox.Mailbox`). Every
wait of the loop has a deadline: the next task deadline, a starting worker's, the time a
quiet stream's slots may be lent, or the end of a draining stop.

Failures are loud: an exception while handling a client's message fails that client's stream
with the traceback; an exception in the loop itself ends the loop with :attr:`failure` set,
which makes ``/healthz`` fail and ``serve`` exit non-zero.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import struct
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import Future
from typing import Callable, Deque, Dict, Iterator, List, Optional, Tuple, Union

import msgpack
import numpy as np
import zmq

from wire import protocol as P
from loader_service.config import ServiceConfig
from loader_service.decode.pipelines import Registry
from loader_service.dispatch import door, heap, local, sending, status
from loader_service.dispatch.admission import Admission, Refuse
from loader_service.dispatch.curve import HANDSHAKE_FAILED, secure_router
from loader_service.dispatch.deadlines import TaskDeadlines
from loader_service.dispatch.mailbox import Mailbox
from loader_service.dispatch.memory import BatchMemory, Broke, NoSlots, slot_cap
from loader_service.dispatch.scheduler import Scheduler
from loader_service.dispatch.sessions import Session, Sessions
from loader_service.dispatch.status import SKIPS_SHOWN, SkippedSample, Totals
from loader_service.dispatch.stream_state import Effect, Fail, Finish, SendBatch, StreamLimits
from loader_service.dispatch.streams import Opening, Stream
from loader_service.dispatch.tasks import Tasks
from loader_service.sources import Source
from loader_service.sources.base import DiskChange
from loader_service.workers.pool import WorkerPool, describe_exit

log = logging.getLogger("loader_service.dispatch.loop")

ACCEPT_REPORT_GRACE_S = 10.0  # how late a connection's accept may be reported after its first message
CLOSE_LINGER_MS = 500  # on close, how long goodbyes and batches already queued may take to leave
CLIENT_QUEUE = 32  # messages of one connection queued unread at most (ZMQ_RCVHWM)


class Dispatcher:
    def __init__(self, config: ServiceConfig, sources: Dict[str, Source], workers: Optional[int] = None):
        """``workers``: the pool's size at start (default: the configured count)."""
        if not sources:
            raise ValueError("the service needs at least one dataset")
        self.config, self.sources = config, sources
        pipelines = Registry(config.pipeline)  # first: a pipeline that does not import stops the start here
        self.admission = Admission(sources, pipelines, StreamLimits(on_error=config.on_error,
                                                                    max_skipped=config.max_skipped))
        self.instance = uuid.uuid4().hex[:12]
        self.ctx, self.front, self.guard, self.monitor, self.data_port = _data_port(config)
        # The workers' socket has a context (an I/O thread) of its own: on the data port's, every
        # task and result queued behind the work of every client connection; at 10,000 connections
        # that thread spends most of its time in libzmq's heartbeat timers (issue 32, see
        # docs/benchmarks.md section 12), and one-image tasks ran at ~90/s with the workers idle.
        self.pool_ctx = zmq.Context(1)
        self.pool = WorkerPool(self.pool_ctx, [s.spec() for s in sources.values()], config.start_method,
                               config.decode_options, config.worker_start_s)
        self.mailbox = Mailbox()  # functions other threads hand to this one
        self.colocation = local.Colocation()  # the probe a co-located client reads (issue 41)
        self.sessions = Sessions()
        cap, hint = slot_cap(config.max_shm_bytes)
        self.scheduler: Scheduler[Stream] = Scheduler()
        self.memory = BatchMemory(cap, config.reclaim_idle_s, self.sessions.streams, self.sessions.__contains__, hint)
        self._unreachable: Dict[bytes, None] = {}  # idents a send found gone: dropped after the event at hand
        self._trim_rule = heap.TrimRule()
        self._trim_due = False  # many sessions left: give the heap back after this round of events
        self.tasks = Tasks(TaskDeadlines(config.task_deadline_s, config.task_deadline_floor_s), config.on_error)
        self.totals = Totals()
        self.recent_skips: Deque[SkippedSample] = deque(maxlen=SKIPS_SHOWN)  # for the status page
        # dataset name -> DiskChange: written whole by the service's watch thread, read by snapshot
        self.disk_changes: Dict[str, DiskChange] = {}
        self.rate = status.Rate()  # samples delivered lately (the status reads it)
        self.loop_thread: Optional[int] = None  # the thread running :meth:`run`
        self._running_loop = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._stop_by: Optional[float] = None  # a draining stop: end the loop by then
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
        frame = sys._current_frames().get(self.loop_thread) if self.loop_thread is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(the loop thread is not running)"

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the dispatcher thread, no answer; thread-safe, never blocks. Dropped
        once the dispatcher has stopped."""
        if not self._closed:
            self.mailbox.put(fn, None)

    def stop(self, drain_s: float = 0.0) -> None:
        """Ask the loop to end, after letting tasks in flight finish and go out for up to
        ``drain_s`` seconds (thread-safe, idempotent)."""
        self.call(self._request_stop, drain_s)

    def _request_stop(self, drain_s: float) -> None:
        if drain_s <= 0 or not self.tasks.running:
            self._running_loop = False
        elif self._stop_by is None:
            self._stop_by = time.monotonic() + drain_s
            log.info("letting %d tasks in flight finish (at most %.1fs) before stopping", len(self.tasks.running),
                     drain_s)

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
            self.pool.scale(self.first_workers)
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
                        self._on_worker_exit(wid)
                self._expire_tasks()
                self._expire_unreported()
                self.pool.expire_starts(time.monotonic())
                if self.pool.broken:
                    self._fail_all(self.pool.broken)
                self._release_idle_streams()
                self._lend_if_due()
                self._schedule()
                self._drop_unreachable()
                if self._trim_due:
                    self._trim_heap()
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
        ends = [t for t in (self.tasks.next_deadline(), self.pool.next_start_deadline(),
                            self.memory.next_lend_at(now), self.sessions.next_early_due()) if t is not None]
        if self._stop_by is not None:
            if now >= self._stop_by or not self.tasks.running:
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
                self._drop_unreachable()
            except Exception as exc:
                # a bug met by one message must not take the service down for everyone
                self._internal_error(frames[0].bytes if sock is self.front else None, "handling a message",
                                     f"{type(exc).__name__}: {exc}", traceback.format_exc())

    def _internal_error(self, ident: Optional[bytes], what: str, error: str, tb: str) -> None:
        """The last resort: a bug met while ``what`` (counted as ``internal_errors``, logged; the
        tests assert it never happens). Acting for client ``ident``, it fails that client alone:
        its stream ends with ``[internal]`` and the traceback, and its session closes."""
        self.totals.internal_errors += 1
        log.error("error while %s%s: %s\n%s", what, f" for client {ident.hex()[:12]}" if ident else "", error, tb)
        if ident is None:
            return
        session = self.sessions.get(ident)
        msg = f"internal error in the service: {error}"
        try:
            waiting = self.memory.waiting.pop(ident, None)
            if session is not None and session.stream is not None:
                self._end_stream(session.stream, Fail(P.ErrorCode.INTERNAL, msg, tb))
            else:
                stream = waiting.hello.stream if waiting is not None else -1
                self._send(ident, P.Error(code=P.ErrorCode.INTERNAL, message=msg, traceback=tb, stream=stream))
        except Exception:
            log.exception("could not report an internal error to client %s", ident.hex()[:12])
        try:
            self._drop_client(ident, "was closed after an internal error")
        except Exception:
            log.exception("could not close client %s after an internal error", ident.hex()[:12])

    @contextlib.contextmanager
    def _for_client(self, ident: bytes, what: str) -> Iterator[None]:
        """Act for one client outside its own message (a task done, a send let go of, slots that
        came back): a bug met there fails that client alone (:meth:`_internal_error`)."""
        try:
            yield
        except Exception as exc:
            self._internal_error(ident, what, f"{type(exc).__name__}: {exc}", traceback.format_exc())

    def _send(self, ident: bytes, msg: P.Message) -> None:
        self._send_frames(ident, P.encode(msg))

    def _send_frames(self, ident: bytes, frames: list, copy: bool = True) -> bool:
        """Send to ``ident``; False if its connection is gone (ROUTER_MANDATORY says so at once:
        then the session is dropped after the event at hand, whatever the monitor has said yet)."""
        try:
            self.front.send_multipart([ident, *frames], copy=copy)
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, errno.EAGAIN):  # EAGAIN: a pipe being torn down (no HWM here)
                raise
            self._unreachable[ident] = None
            return False

    def _drop_unreachable(self) -> None:
        while self._unreachable:
            ident = next(iter(self._unreachable))
            del self._unreachable[ident]
            self._drop_client(ident, "is unreachable: its connection is gone")

    # ------------------------------------------------------------------ clients
    def _on_monitor(self, frames) -> None:
        ev = monitor_event(frames)
        if ev["event"] == zmq.EVENT_ACCEPTED:
            self.sessions.accepted(ev["value"])
            self._trim_rule.connections(self.sessions.connections)
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            ident = self.sessions.disconnected(ev["value"])
            if ident is not None:
                self._drop_client(ident, "disconnected")
            self._trim_due |= self._trim_rule.connections(self.sessions.connections)
        elif self.guard.on_event(ev):
            self.totals.refused_handshakes += 1

    def _expire_unreported(self) -> None:
        """Connections opened on a message whose accept never came were gone before it was read."""
        due = self.sessions.next_early_due()
        if due is None or due > time.monotonic():
            return
        self._read_monitor()  # a report still queued confirms its connection
        for ident in self.sessions.unreported(time.monotonic()):
            self.totals.unreported_connections += 1
            self._drop_client(ident, "is gone: its connection closed before its first message was read")

    def _read_monitor(self) -> None:
        """Every monitor event queued now (bounded by the connections the service has)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_monitor(frames)

    def _on_client(self, frames) -> None:
        ident = frames[0].bytes
        fd = frames[-1].get(zmq.SRCFD)
        session = self.sessions.get(ident)
        if session is None or session.fd != fd:
            # Read the monitor to the end first, so that the disconnect of an earlier connection
            # on this fd number is not taken for this one's. A message whose fd is still not open
            # came before its connection's accept was reported, or after it was gone: it is
            # answered, and its connection opened early until the report comes (sessions.py).
            self._read_monitor()
            if not self.sessions.is_open(fd):
                self.totals.early_messages += 1
                self.sessions.open_early(fd, time.monotonic() + ACCEPT_REPORT_GRACE_S)
            if session is not None and session.fd != fd:
                self._bind_fd(session, fd)
        try:
            msg, _ = P.decode(frames[1:], expect=(P.Hello, P.Credit, P.Request, P.Bye, P.Describe, P.Release))
        except P.ProtocolError as exc:
            self.totals.bad_messages += 1
            log.warning("refused a message from client %s: %s", ident.hex()[:12], exc)
            self._send(ident, P.Error(code=exc.code, message=str(exc), stream=_stream_of(frames[1])))
            return
        if (self.guard.curve and isinstance(msg, (P.Hello, P.Credit, P.Request))
                and not self.guard.authorized(frames[-1].get("User-Id"), time.monotonic())):
            return self._revoked(ident, session, msg)
        if isinstance(msg, P.Hello) and self._stop_by is not None:
            self._send(ident, P.Error(code=P.ErrorCode.SHUTTING_DOWN, stream=msg.stream, fatal=False,
                                      message="the service is shutting down; reconnect and resume"))
            return
        if isinstance(msg, P.Hello):
            if session is None:
                if len(self.sessions) >= self.config.max_sessions:
                    self.totals.refused_sessions += 1
                    return self._send(ident, P.Error(code=P.ErrorCode.NO_CAPACITY, stream=msg.stream, message=(
                        f"the service holds {len(self.sessions)} sessions, its cap (--max-sessions "
                        f"{self.config.max_sessions}); try again later or ask its operator to raise the cap")))
                session = self.sessions.add(ident)
                self._bind_fd(session, fd)
            self._on_hello(session, msg)
        elif isinstance(msg, (P.Credit, P.Request)):
            self._on_credit(ident, session, msg)
        elif isinstance(msg, P.Release):
            self._on_release(session, msg)
        elif isinstance(msg, P.Describe):
            self._send(ident, self.colocation.describe(self.admission.describe(msg)))
        elif isinstance(msg, P.Bye):
            self._drop_client(ident, "said bye")

    def _revoked(self, ident: bytes, session: Optional[Session], msg: P.Message) -> None:
        """The key this connection's handshake used was removed: its stream ends, its session goes."""
        why = "this client's CURVE key is no longer authorized by the service (removed from its keys directory)"
        if session is not None and session.stream is not None:
            self.totals.revoked += 1
            log.warning("client %s: %s; its stream ends", ident.hex()[:12], why)
            self._end_stream(session.stream, Fail(P.ErrorCode.REVOKED, why))
        else:
            self._send(ident, P.Error(code=P.ErrorCode.REVOKED, stream=getattr(msg, "stream", -1), message=why))
        if session is not None:
            self._drop_client(ident, "was revoked")

    def _bind_fd(self, session: Session, fd: int) -> None:
        for other in self.sessions.bind(session, fd):
            self._drop_client(other, "connection replaced")

    def _refuse(self, ident: bytes, hello: P.Hello, r: Union[Refuse, NoSlots]) -> None:
        code = r.code if isinstance(r, Refuse) else P.ErrorCode.NO_CAPACITY
        self._send(ident, P.Error(code=code, stream=hello.stream, message=r.message, fatal=r.fatal))

    def _on_hello(self, session: Session, hello: P.Hello) -> None:
        """A new stream: admitted (after any takeover of its job's rank), then given slots."""
        stale = self.admission.stale(session, hello)
        if stale is not None:
            return self._refuse(session.ident, hello, stale)
        session.stream_id, session.job, session.client = hello.stream, hello.job, hello.client
        self.memory.waiting.pop(session.ident, None)
        self.memory.moved_on(session.ident, session.stream)  # co-located: it reads nothing it was lent any more
        if session.stream is not None:
            self._retire(session.stream)
        verdict = self.admission.admit(session, hello, self.sessions.of_job(hello.job), self.pool.broken)
        for t in verdict.takeovers:
            log.warning("client %s: %s", t.session.name, t.why)
            self.sessions.hold(t.session, None)
            if t.session.stream is not None:
                self._end_stream(t.session.stream, Fail(P.ErrorCode.REPLACED, t.why))
            else:
                self._send(t.session.ident, P.Error(code=P.ErrorCode.REPLACED, message=t.why))
        if verdict.spec is not None:
            session.rank, session.run = hello.rank, (hello.epoch, hello.entry)
            self.sessions.hold(session, verdict.spec)
        if isinstance(verdict.outcome, Refuse):
            return self._refuse(session.ident, hello, verdict.outcome)
        opening = verdict.outcome
        if len(self.memory.waiting) >= self.config.max_waiting and not hello.lookahead:
            self.totals.refused_sessions += 1
            return self._refuse(session.ident, hello, Refuse(P.ErrorCode.NO_CAPACITY, (
                f"{len(self.memory.waiting)} new streams already wait for batch slots, the cap (--max-waiting "
                f"{self.config.max_waiting}); try again later"), fatal=False))
        result = self.memory.open(opening, time.monotonic())
        if result is None:
            log.info("client %s stream %d waits for %.1f MiB of slots that ending streams still hold",
                     session.name, hello.stream, opening.nbytes / 2**20)
        self._opened([] if result is None else [(opening, result)])

    def _opened(self, results: List[Tuple[Opening, Union[Stream, NoSlots, Broke]]]) -> None:
        """Start serving the streams that have their slots now; refuse those that cannot have them;
        then act on what the batch memory left in its outboxes (every call to it that may open,
        wake or unlink ends here)."""
        self._memory_outboxes()
        for o, result in results:
            if isinstance(result, Broke):  # opening it raised: a bug, its client alone is failed
                self._internal_error(o.ident, f"opening stream {o.hello.stream}", result.error, result.traceback)
                continue
            with self._for_client(o.ident, "starting its stream"):
                if isinstance(result, NoSlots):
                    self._refuse(o.ident, o.hello, result)
                else:
                    self._start(o.session, result)

    def _memory_outboxes(self) -> None:
        """Streams that have slots again take their place in the scheduler's line; the workers
        unmap the segments the batch memory unlinked."""
        for s in self.memory.take_woken():
            with self._for_client(s.ident, "giving its slots back"):
                self._may_take_task(s)
        for name in self.memory.take_unlinked():
            self.pool.unmap(name)

    def _start(self, session: Session, s: Stream) -> None:
        hello, plan = s.hello, s.plan
        self.sessions.serve(session, s)
        self.totals.streams += 1
        self._send(session.ident, P.Accept(stream=hello.stream, epoch=hello.epoch, num_batches=plan.num_batches,
                                           num_samples=plan.num_samples, dataset_length=len(s.source),
                                           dataset=s.source.name, service=self.instance,
                                           fingerprint=s.source.fingerprint()))
        log.info("client %s job %r rank %d/%d epoch %d: stream %d %s %d of %d batches%s", session.name,
                 hello.job, hello.rank, hello.spec.world_size, hello.epoch, hello.stream,
                 "on demand, asked at once for" if hello.on_demand else "serves", len(s.state.order),
                 plan.num_batches, " (lookahead)" if hello.lookahead else "")
        self._apply(s, s.state.start())

    def _on_credit(self, ident: bytes, session: Optional[Session], msg: Union[P.Credit, P.Request]) -> None:
        """A Credit (more of a plain stream) or a Request (batches of an on-demand stream), let in
        by the door (:mod:`.door`) whatever the stream's life: waiting for its slots or served."""
        if session is None or msg.stream > session.stream_id:
            # the service restarted or forgot this client: it will start again from its cursor
            self._send(ident, P.Error(code=P.ErrorCode.UNKNOWN_CLIENT, stream=msg.stream, fatal=False,
                                      message="this service has no stream for the client; start it again"))
            return
        s = session.stream
        o = self.memory.waiting.get(ident) if s is None else None  # a stream still waiting for its slots
        if (o is None or o.hello.stream != msg.stream) and (s is None or s.id != msg.stream):
            return  # for a stream that already ended or was replaced
        target: Union[Stream, Opening] = s if s is not None else o
        asks = target.asks()
        refusal = door.check_request(msg, asks) if isinstance(msg, P.Request) else door.check_credit(msg, asks)
        if refusal is not None:
            self.totals.refused_asks += 1
            log.warning("client %s stream %d: refused %s: %s", session.name, msg.stream, type(msg).__name__,
                        refusal.message)
            return self._end_stream(target, Fail(refusal.code, refusal.message))
        # the stall figures are deltas since the connection's previous message: add, keep no baseline
        self.totals.wait_s += msg.wait_s
        self.totals.h2d_s += msg.h2d_s
        now = time.monotonic()
        if s is None:
            o.asked(msg)
            if getattr(msg, "probe", False):
                self._send(ident, status.progress(self.pool, self.tasks, msg.stream, None, len(o.order), True, now))
            return
        if getattr(msg, "probe", False):
            self._send(ident, status.progress(self.pool, self.tasks, s.id, s, s.state.not_started,
                                              s in self.memory.starved, now))
        if (isinstance(msg, P.Credit) and msg.n) or (isinstance(msg, P.Request) and msg.batches):
            s.asked_at, s.asked = now, True
        s.wait_s += msg.wait_s
        s.h2d_s += msg.h2d_s
        if msg.promote:
            s.lookahead = False
            self._may_take_task(s)  # its place in the scheduler's line changes
        if isinstance(msg, P.Credit):
            s.state.grant(msg.n)
        else:
            self._apply(s, s.state.extend(msg.batches, final=msg.final))
        self.memory.wake(s, now)
        self._memory_outboxes()
        self._may_take_task(s)

    def _on_release(self, session: Optional[Session], msg: P.Release) -> None:
        """A co-located client handed slots back (:mod:`.local`), of its stream or of one that ended
        (finished, failed, replaced: it keeps what it lent until its client moves on); one the
        stream did not lend ends that stream."""
        if session is None:
            return
        s = session.stream if session.stream is not None and session.stream.id == msg.stream else \
            local.retired(self.memory.retiring, session.ident, msg.stream)
        if s is None:
            return  # a stream its client already moved on from: what it lent is back
        slots = local.release(s, msg)
        if isinstance(slots, door.Refusal):
            self.totals.refused_asks += 1
            log.warning("client %s stream %d: refused Release: %s", session.name, msg.stream, slots.message)
            return self._end_stream(s, Fail(slots.code, slots.message))
        for slot in slots:
            s.state.send_complete(slot)
        self._may_take_task(s)

    def _drop_client(self, ident: bytes, why: str) -> None:
        session = self.sessions.pop(ident)
        if session is None:
            return
        if session.stream is not None:
            self.scheduler.forget(session.stream)
        opened = self.memory.leave(ident, session.stream, time.monotonic())
        log.info("client %s %s", session.name, why)
        self._opened(opened)

    def _trim_heap(self) -> None:
        """Give the heap that departed sessions freed back to the system (see :mod:`.heap`)."""
        self._trim_due = False
        before = heap.rss_bytes()
        for part in (self.sessions, self.scheduler, self.tasks, self.memory):
            part.compact()
        if heap.trim():
            self.totals.heap_trims += 1
            log.info("%d connections now: gave %.0f MiB of freed heap back to the system",
                     self.sessions.connections, (before - heap.rss_bytes()) / 2**20)

    # ------------------------------------------------------------------ streams
    def _apply(self, s: Stream, effects: List[Effect]) -> None:
        """Carry out what a stream's state asked for (after an event that may also have given it
        a task to hand out: it is a candidate for the next idle worker then)."""
        for e in effects:
            if isinstance(e, SendBatch):
                self._send_batch(s, e)
            else:
                self._end_stream(s, e)
        self._may_take_task(s)

    def _may_take_task(self, s: Stream) -> None:
        """An event may have let ``s`` take a task (credit, a free slot, slots back, a task to
        redo, its start): the scheduler asks it when its turn comes. Called after every event
        on a stream, so the batch memory's indexes (quiet streams, current epochs) follow too."""
        self.memory.changed(s)
        if not s.state.done:
            self.scheduler.ready(s, s.tier)

    def _end_stream(self, s: Union[Stream, Opening], e: Effect) -> None:
        """Tell the client how its stream ended (``Finish`` or ``Fail``), then retire it (a
        stream still waiting for its slots stops waiting)."""
        if isinstance(s, Opening):
            assert isinstance(e, Fail)
            if self.memory.waiting.get(s.ident) is s:
                del self.memory.waiting[s.ident]
            log.error("stream %d of client %s failed while waiting for slots: %s", s.hello.stream, s.ident.hex()[:12],
                      e.message)
            self._send(s.ident, P.Error(code=e.code, message=e.message, stream=s.hello.stream, fatal=True))
            return
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
            self.sessions.serve(session, None)
        self.scheduler.forget(s)
        self._opened(self.memory.retire(s, time.monotonic()))

    def _release_idle_streams(self) -> None:
        """Retired streams that nothing reads any more give their slots back: retry what waits."""
        self._opened(self.memory.release_idle(time.monotonic()))

    def _lend_if_due(self) -> None:
        """Retry what waits for slots if a quiet stream's slots may be lent now."""
        self._opened(self.memory.lend_if_due(time.monotonic()))

    def _send_batch(self, s: Stream, e: SendBatch) -> None:
        out = sending.outgoing(s.layout, s.plan, s.id, s.hello.epoch, e)
        lent = s.hello.local and s.segment is not None  # co-located: the client reads the slot (local.py)
        if lent:
            out = local.lend(s, e, out)
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

        frames, nbytes, frame = [], 0, None
        for offset, size in out.blocks:
            frame, zero_copy = sending.frame(s.segment, offset, size, lambda: self.post(sent))
            frames.append(frame)
            pending[0] += zero_copy
            nbytes += size
        delivered = self._send_frames(s.ident, [header, *frames, labels], copy=False)
        if not pending[0] and not lent:
            state.send_complete(slot)
        del frames, frame  # unsent zero-copy frames are released here: their ``sent`` runs all the same
        if not delivered:
            return
        session = self.sessions.get(s.ident)
        if session is not None:
            session.batches += 1
            session.samples += n
        self.totals.samples += n
        self.totals.batches += 1
        self.totals.bytes += nbytes
        self.rate.add(time.monotonic(), self.totals.samples)

    def _send_complete(self, s: Stream, slot: int) -> None:
        # runs as a post, so the loop schedules right after: a stream that waited for this slot
        # can take an idle worker at once
        with self._for_client(s.ident, "letting go of a sent batch"):
            s.state.send_complete(slot)
            self._may_take_task(s)

    def _fail_all(self, why: str) -> None:
        for stream in self.sessions.streams():
            self._end_stream(stream, Fail(P.ErrorCode.INTERNAL, why))

    # ------------------------------------------------------------------ workers
    def _schedule(self) -> None:
        places = self.pool.places()
        if not places or self._stop_by is not None:
            return
        places.reverse()  # popped from the end: idle workers first

        def take(s: Stream) -> None:
            with self._for_client(s.ident, "handing its batch to a worker"):
                self._dispatch(s, places[-1])
                places.pop()

        self.scheduler.pick(len(places), lambda s: s.segment is not None and s.state.dispatchable(),
                            lambda s: s.tier, take)

    def _dispatch(self, s: Stream, worker) -> None:
        t = s.state.next_task(self.tasks.next_id())
        assert t is not None, "the scheduler picked a stream with nothing to do"
        behind = worker.tasks[-1] if worker.tasks else None
        self.pool.assign(worker, self.tasks.start(s, t, worker.id, time.monotonic(), behind))
        s.source.prefetch(s.plan, t.batch)  # a queued hint: a remote source downloads the next shards on a thread

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
        now = time.monotonic()
        if w.task is not None:  # its queued task runs from now
            self.tasks.began(w.task, now)
        r = self.tasks.done(done.task, now)
        if r is None:
            return
        self.totals.read_s += done.read_s
        self.totals.decode_s += done.decode_s
        if not done.ok:
            self.totals.failed_tasks += 1
        skipped = [(int(p), int(i), str(why)) for p, i, why in done.skipped]
        with self._for_client(r.stream.ident, "taking a finished batch"):
            effects = r.stream.state.task_done(done.task, skipped, "" if done.ok else done.error,
                                               "" if done.ok else done.traceback)
            self._apply(r.stream, effects)

    def _on_worker_exit(self, wid: int) -> None:
        held, died_on, exitcode = self.pool.reap(wid)
        for task_id in held:
            r = self.tasks.lost(task_id)
            if r is None:
                continue
            self.totals.redone_tasks += 1
            with self._for_client(r.stream.ident, "redoing a task its worker lost"):
                if task_id != died_on:  # finished (its Done lost with the worker) or never began: not its fault
                    r.stream.state.task_returned(task_id)
                    self._may_take_task(r.stream)  # it has a batch to redo: back in the scheduler's line
                else:
                    self._apply(r.stream, r.stream.state.task_lost(task_id, r.lost_because(describe_exit(exitcode))))

    def _expire_tasks(self) -> None:
        """Kill the worker of every task past its deadline; its loss is handled when it is reaped."""
        def on_it(wid: int, task_id: int) -> bool:
            w = self.pool.workers.get(wid)
            return w is not None and w.task == task_id

        for task_id, r in self.tasks.overdue(time.monotonic(), on_it):
            w = self.pool.workers[r.worker]
            self.totals.hung_tasks += 1
            log.warning("task %d (stream %d, %d samples) on worker %d (pid %s) outlived its %.1fs deadline; "
                        "killing the worker, the task is redone", task_id, r.stream.id, r.samples, w.id, w.pid,
                        r.deadline - r.started)
            try:
                os.kill(w.pid, signal.SIGKILL)  # works on a stopped (SIGSTOP) process too
            except (ProcessLookupError, PermissionError):
                pass  # already gone: its sentinel reports it

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
            self.pool_ctx.term()
            self.memory.close()
            self.colocation.close()
            self.mailbox.close()


def _data_port(config: ServiceConfig):
    """The data port's context, ROUTER socket, CURVE guard and monitor socket, bound; and its
    port number. Whatever was made is closed again if a step fails."""
    ctx = zmq.Context(config.io_threads)
    front = ctx.socket(zmq.ROUTER)
    for opt, val in (
        (zmq.LINGER, CLOSE_LINGER_MS),
        (zmq.SNDHWM, 0),  # credits bound what is queued; a full ROUTER would drop batches
        # what a connection has sent and the loop has not read yet: past it libzmq stops reading
        # that connection (TCP pushes back on its client), so a client that sends faster than the
        # service decodes costs at most this many messages here, not a growing queue (issue 37)
        (zmq.RCVHWM, CLIENT_QUEUE),
        (zmq.MAXMSGSIZE, P.MAX_CLIENT_MESSAGE_BYTES),  # oversized: the peer is disconnected
        # a client's new connection takes over its identity at once: after a freeze or a network
        # blip its old connection may not be torn down yet, and without handover the new one's
        # messages would be dropped until then (the client would wait for an answer forever)
        (zmq.ROUTER_HANDOVER, 1),
        # a send to an identity whose connection is gone fails at once instead of vanishing: the
        # session is dropped then, even when the monitor's disconnect was read before its Hello
        (zmq.ROUTER_MANDATORY, 1),
        (zmq.HEARTBEAT_IVL, int(config.heartbeat_s * 1000)),
        (zmq.HEARTBEAT_TIMEOUT, int(config.heartbeat_s * 3000)),
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


def monitor_event(frames) -> dict:
    """A socket monitor message as {"event", "value", "endpoint"}, all plain values. Not pyzmq's
    ``parse_monitor_message``: it makes ``value`` (an fd, an errno) a ``zmq.Event`` flag, and the
    enum keeps a member for every value it meets, forever: one per fd number of a flood's
    connections, each pinning the heap it was allocated in (issue 32)."""
    event, value = struct.unpack("=hi", frames[0].bytes[:6])
    return {"event": event, "value": value, "endpoint": frames[1].bytes if len(frames) > 1 else b""}


def _stream_of(frame) -> int:
    """Best effort: the stream a refused message was about, so its sender can match the error."""
    try:
        header = msgpack.unpackb(frame.bytes, raw=False)
        stream = header.get("stream", -1)
        return stream if isinstance(stream, int) and not isinstance(stream, bool) else -1
    except Exception:
        return -1

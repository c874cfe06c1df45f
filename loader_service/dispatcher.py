"""The dispatcher: the one thread where service state changes.

It owns the client-facing ROUTER socket, the worker pool, every client's stream, the batch
slots in shared memory and the table of tasks in flight. Other threads (the REST API, signal
handlers) never touch that state: they submit a function with :meth:`Dispatcher.call` and
get a Future back, and the loop runs it between events.

Per stream (one rank's pass over one epoch):

* the plan comes from :func:`loader_service.plan.make_plan`, never stored elsewhere;
* a batch is dispatched only when the client has credit for it and a slot is free, so memory
  in flight is at most ``prefetch x batch bytes`` per client;
* workers finish out of order; batches leave strictly in plan order;
* a large image frame is sent zero-copy from its slot, and the slot is reused only after
  zmq's tracker for that very frame reports the send complete;
* a task whose worker died is redone; a batch that kills ``ISOLATE_AFTER`` workers is redone
  one sample per task, and a sample that kills ``MAX_SAMPLE_ATTEMPTS`` workers by itself is
  poison: skipped or reported by the ``on_error`` policy, never retried forever;
* stopping drains: no new streams, tasks in flight finish and their batches go out (up to a
  deadline), then every client is told the service is going away (it reconnects and resumes).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import socket
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from . import protocol as P
from .config import ServiceConfig
from .plan import PlanSpec, RankPlan, make_plan
from .pool import WorkerPool
from .shm import Segment
from .sources import Source

log = logging.getLogger("loader_service.dispatcher")

ISOLATE_AFTER = 2  # a batch that killed this many workers is re-run one sample per task
MAX_SAMPLE_ATTEMPTS = 2  # a sample that kills this many workers on its own is poison
TRACKER_POLL_MS = 1  # while blocked on a zero-copy send: how soon its slot is seen free


@dataclass
class Inflight:
    batch: int
    slot: int
    pos: int = -1  # >= 0: a one-sample task of an isolated batch (see Isolation)


@dataclass
class Isolation:
    """A batch being redone one sample per task because it kept killing workers."""

    slot: int
    todo: List[int]  # positions not yet dispatched
    pending: set  # positions dispatched or to dispatch, not yet done
    attempts: Dict[int, int] = field(default_factory=dict)  # position -> workers it killed
    skipped: list = field(default_factory=list)  # [[pos, idx, reason]]


class AutoscaleConflict(RuntimeError):
    """A manual scale request while autoscaling is on."""


@dataclass
class Stream:
    client: bytes
    hello: P.Hello
    source: Source
    plan: RankPlan
    segment: Segment
    slot_bytes: int
    free_slots: List[int]
    granted: int
    order: np.ndarray  # the batch indices this stream serves, in order
    next_dispatch: int  # position in order
    next_send: int  # position in order
    num_batches: int  # in the rank's epoch
    redo: List[int] = field(default_factory=list)  # heap of batch indices to dispatch again
    inflight: Dict[int, Inflight] = field(default_factory=dict)  # task id -> what it computes
    isolated: Dict[int, Isolation] = field(default_factory=dict)  # batch -> its one-sample tasks
    attempts: Dict[int, int] = field(default_factory=dict)  # batch -> workers lost on it
    ready: Dict[int, Tuple[int, P.Done]] = field(default_factory=dict)  # batch -> (slot, done)
    sending: List[Tuple[zmq.MessageTracker, int]] = field(default_factory=list)
    retired: bool = False
    finished: bool = False
    lookahead: bool = False  # low priority until the client promotes it
    samples_sent: int = 0
    skipped: int = 0
    wait_s: float = 0.0
    h2d_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> int:
        return self.hello.stream

    def dispatchable(self) -> bool:
        if self.retired:
            return False
        if any(iso.todo for iso in self.isolated.values()):
            return True
        if not self.free_slots:
            return False
        if self.redo:
            return True
        return self.next_dispatch < len(self.order) and self.next_dispatch < self.granted


@dataclass
class Client:
    ident: bytes
    fd: int = -1
    fd_gen: int = 0  # which connection on that fd number (see Dispatcher.fd_gen)
    job: str = ""
    stream_id: int = -1  # highest stream this client started
    stream: Optional[Stream] = None
    # the slots of its last stream, kept for its next one: an epoch then starts on memory that is
    # already faulted in (here, in the workers' mappings and zmq's sends) instead of a new segment
    spare: Optional[Segment] = None
    connected: float = field(default_factory=time.monotonic)
    batches: int = 0
    samples: int = 0


@dataclass
class Counters:
    samples: int = 0
    batches: int = 0
    bytes: int = 0
    skipped: int = 0
    bad_messages: int = 0
    failed_tasks: int = 0
    redone_tasks: int = 0
    streams: int = 0
    read_s: float = 0.0
    decode_s: float = 0.0
    client_wait_s: float = 0.0
    client_h2d_s: float = 0.0


class Dispatcher:
    def __init__(self, config: ServiceConfig, sources: Dict[str, Source]):
        if not sources:
            raise ValueError("the service needs at least one dataset")
        self.config, self.sources = config, sources
        self.default_dataset = next(iter(sources))
        self.instance = uuid.uuid4().hex[:12]
        self.ctx = zmq.Context(config.io_threads)
        self.front = self.ctx.socket(zmq.ROUTER)
        for opt, val in (
            (zmq.LINGER, 0),
            (zmq.SNDHWM, 0),  # credits bound what is queued; a full ROUTER would drop batches
            (zmq.RCVHWM, 0),
            (zmq.MAXMSGSIZE, P.MAX_CLIENT_MESSAGE_BYTES),  # oversized: the peer is disconnected
            (zmq.HEARTBEAT_IVL, int(config.heartbeat_s * 1000)),
            (zmq.HEARTBEAT_TIMEOUT, int(config.heartbeat_s * 3000)),
        ):
            self.front.setsockopt(opt, val)
        self.monitor = self.front.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        if config.data_port == 0:
            self.data_port = self.front.bind_to_random_port(f"tcp://{config.host}")
        else:
            self.front.bind(f"tcp://{config.host}:{config.data_port}")
            self.data_port = config.data_port
        self.pool = WorkerPool(self.ctx, [s.spec() for s in sources.values()], config.start_method)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._calls: "queue.SimpleQueue[Tuple[Callable, Future]]" = queue.SimpleQueue()
        self.clients: Dict[bytes, Client] = {}
        self.fd_owner: Dict[int, bytes] = {}
        # The kernel reuses fd numbers, so a disconnect names a connection by (fd, generation):
        # the n-th EVENT_ACCEPTED on an fd is its generation n. For one fd the monitor reports
        # accepted/disconnected strictly alternately (the old connection's disconnect is emitted
        # before its fd is closed, the new one's accept after the fd is reused).
        self.fd_gen: Dict[int, int] = {}
        self.tasks: Dict[int, Stream] = {}
        self.retiring: List[Stream] = []
        self.counters = Counters()
        self._task_ids = itertools.count()
        self._rr = 0
        self._running = False
        self._closed = False
        self._drain_until: Optional[float] = None
        self.ready = threading.Event()  # set once a worker has said Ready
        self._rate: Deque[Tuple[float, int]] = deque(maxlen=64)
        self.started = time.time()
        self.autoscaler = None
        if config.autoscale:
            from .autoscale import AutoscalePolicy, Autoscaler

            self.autoscaler = Autoscaler(AutoscalePolicy.parse(config.autoscale, config.autoscale_interval_s), self)

    # ------------------------------------------------------------------ other threads
    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the dispatcher thread; thread-safe."""
        fut: Future = Future()
        if self._closed:
            fut.set_exception(RuntimeError("the dispatcher has stopped"))
            return fut
        self._calls.put((lambda: fn(*args), fut))
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or we are shutting down
        return fut

    def stop(self, drain_s: float = 0.0) -> None:
        """Ask the loop to end, after draining work in flight for up to ``drain_s`` seconds
        (thread-safe, idempotent)."""
        self.call(self._request_stop, drain_s)

    def _request_stop(self, drain_s: float) -> None:
        if drain_s <= 0 or not self.tasks:
            self._running = False
        elif self._drain_until is None:
            self._drain_until = time.monotonic() + drain_s
            log.info("draining %d tasks in flight (at most %.1fs) before stopping", len(self.tasks), drain_s)

    def _drain_timeout_ms(self) -> Optional[int]:
        if self._drain_until is None:
            return None
        left = self._drain_until - time.monotonic()
        if left <= 0 or not self.tasks:
            self._running = False
            return 0
        return max(1, int(left * 1000))

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Serve until :meth:`stop`. Cleans up everything it owns on the way out."""
        self._running = True
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
        self.pool.scale(workers)
        try:
            while self._running:
                if pool_version != self.pool.version:
                    for fd in sentinels:
                        poller.unregister(fd)
                    sentinels = self.pool.sentinels()
                    for fd in sentinels:
                        poller.register(fd, zmq.POLLIN)
                    pool_version = self.pool.version
                timeout = TRACKER_POLL_MS if self._waiting_on_sends() else None
                drain = self._drain_timeout_ms()
                if not self._running:
                    break
                if drain is not None:
                    timeout = drain if timeout is None else min(timeout, drain)
                events = dict(poller.poll(timeout))
                if self._wake_r.fileno() in events:
                    self._run_calls()
                if self.monitor in events:
                    self._drain(self.monitor, self._on_monitor)
                if self.pool.sock in events:
                    self._drain(self.pool.sock, self._on_worker)
                if self.front in events:
                    self._drain(self.front, self._on_client)
                for fd, wid in sentinels.items():
                    if fd in events:
                        self._on_worker_exit(wid)
                if self.pool.broken:
                    self._fail_all(self.pool.broken)
                self._reap_trackers()
                self._schedule()
        finally:
            self.close()

    def _drain(self, sock: zmq.Socket, handler: Callable, limit: int = 256) -> None:
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
                log.error("error handling a message: %s\n%s", exc, tb)
                if sock is self.front:
                    self._internal_error(frames[0].bytes, exc, tb)

    def _internal_error(self, ident: bytes, exc: Exception, tb: str) -> None:
        client = self.clients.get(ident)
        msg = f"internal error in the service: {type(exc).__name__}: {exc}"
        try:
            if client is not None and client.stream is not None:
                self._fail(client.stream, P.ErrorCode.INTERNAL, msg, tb)
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
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the caller, who raises it
                    fut.set_exception(exc)

    # ------------------------------------------------------------------ clients
    def _on_monitor(self, frames) -> None:
        ev = parse_monitor_message([f.bytes for f in frames])
        fd = ev["value"]
        if ev["event"] == zmq.EVENT_ACCEPTED:
            self.fd_gen[fd] = self.fd_gen.get(fd, 0) + 1
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            ident = self.fd_owner.get(fd)
            client = self.clients.get(ident) if ident is not None else None
            if client is not None and client.fd_gen > self.fd_gen.get(fd, 0):
                return  # the owner came on a later connection that reused this fd number
            self.fd_owner.pop(fd, None)
            if ident is not None:
                self._drop_client(ident, "disconnected")

    def _on_client(self, frames) -> None:
        ident = frames[0].bytes
        fd = frames[-1].get(zmq.SRCFD)
        client = self.clients.get(ident)
        if client is None or client.fd != fd:
            # A new connection's accept is reported before any of its messages can arrive, but
            # the monitor may not have been read yet: read it now, so that the disconnect of an
            # earlier connection on this fd number is not taken for this one's.
            self._drain(self.monitor, self._on_monitor)
            client = self.clients.get(ident)
            if client is not None and client.fd != fd:
                self._bind_fd(client, fd)
        try:
            msg, _ = P.decode(frames[1:], expect=(P.Hello, P.Credit, P.Bye, P.Describe))
        except P.ProtocolError as exc:
            self.counters.bad_messages += 1
            log.warning("refused a message from client %s: %s", ident.hex()[:12], exc)
            self._send(ident, P.Error(code=exc.code, message=str(exc), stream=_stream_of(frames[1])))
            return
        if isinstance(msg, P.Hello) and self._drain_until is not None:
            self._send(ident, P.Error(code=P.ErrorCode.SHUTTING_DOWN, stream=msg.stream, fatal=False,
                                      message="the service is shutting down; reconnect and resume"))
            return
        if isinstance(msg, P.Hello):
            if client is None:
                client = self.clients[ident] = Client(ident)
                self._bind_fd(client, fd)
            self._start_stream(client, msg)
        elif isinstance(msg, P.Credit):
            self._on_credit(ident, client, msg)
        elif isinstance(msg, P.Describe):
            self._describe(ident, msg)
        elif isinstance(msg, P.Bye):
            self._drop_client(ident, "said bye")

    def _bind_fd(self, client: Client, fd: int) -> None:
        owner = self.fd_owner.get(fd)
        if owner is not None and owner != client.ident:
            # the fd was reused: its previous connection is gone even if we missed the event
            self._drop_client(owner, "connection replaced")
        if self.fd_owner.get(client.fd) == client.ident:
            del self.fd_owner[client.fd]
        client.fd, client.fd_gen = fd, self.fd_gen.get(fd, 0)
        self.fd_owner[fd] = client.ident

    def _describe(self, ident: bytes, msg: P.Describe) -> None:
        source = self._source(ident, msg.dataset, stream=-1)
        if source is not None:
            self._send(ident, P.DatasetInfo(dataset=source.name, length=len(source), num_classes=source.num_classes))

    def _source(self, ident: bytes, name: Optional[str], stream: int) -> Optional[Source]:
        source = self.sources.get(name or self.default_dataset)
        if source is None:
            self._send(ident, P.Error(
                code=P.ErrorCode.UNKNOWN_DATASET, stream=stream,
                message=f"unknown dataset {name!r}; this service serves {sorted(self.sources)}"))
        return source

    def _start_stream(self, client: Client, hello: P.Hello) -> None:
        ident = client.ident
        if hello.stream <= client.stream_id:
            self._send(ident, P.Error(code=P.ErrorCode.BAD_JOB, stream=hello.stream, message=(
                f"stream {hello.stream} is not newer than this client's stream {client.stream_id}")))
            return
        client.stream_id, client.job = hello.stream, hello.job
        if client.stream is not None:
            self._retire(client.stream)
            client.stream = None
        source = self._source(ident, hello.dataset, hello.stream)
        if source is None:
            return
        if self.pool.broken:
            self._send(ident, P.Error(code=P.ErrorCode.INTERNAL, stream=hello.stream, message=self.pool.broken))
            return
        try:
            plan = make_plan(PlanSpec(len(source), hello.batch_size, hello.seed, hello.epoch, hello.rank,
                                      hello.world_size, hello.shuffle, hello.drop_last))
        except ValueError as exc:
            self._send(ident, P.Error(code=P.ErrorCode.BAD_JOB, stream=hello.stream, message=str(exc)))
            return
        nb = plan.num_batches
        if hello.start_batch > nb:
            self._send(ident, P.Error(code=P.ErrorCode.BAD_JOB, stream=hello.stream, message=(
                f"start_batch {hello.start_batch} is past the end of the epoch ({nb} batches)")))
            return
        if hello.batches and max(hello.batches) >= nb:
            self._send(ident, P.Error(code=P.ErrorCode.BAD_JOB, stream=hello.stream, message=(
                f"batch {max(hello.batches)} is past the end of the epoch ({nb} batches here); does the "
                "client's plan come from another dataset (replicas serving different data)?")))
            return
        order = (np.asarray(hello.batches, dtype=np.int64) if hello.batches
                 else np.arange(hello.start_batch, nb, dtype=np.int64))
        slot_bytes = hello.batch_size * hello.image_size * hello.image_size * 3
        nslots = max(1, min(hello.prefetch, len(order)))
        spare, client.spare = client.spare, None
        if spare is not None and spare.size != nslots * slot_bytes:
            spare.close()  # another shape of job: its memory goes back before the capacity check
            spare = None
        in_use = self._shm_in_use()  # the spare is detached: not counted, reused or closed below
        if in_use + nslots * slot_bytes > self.config.max_shm_bytes:
            if spare is not None:
                spare.close()
            self._send(ident, P.Error(code=P.ErrorCode.NO_CAPACITY, stream=hello.stream, message=(
                f"this job needs {nslots * slot_bytes / 2**20:.1f} MiB of batch slots (prefetch {nslots} x "
                f"{slot_bytes / 2**20:.1f} MiB) but {in_use / 2**20:.1f} of {self.config.max_shm_bytes / 2**20:.0f} "
                "MiB are in use; lower prefetch or batch size, or raise --max-shm-mb")))
            return
        stream = Stream(client=ident, hello=hello, source=source, plan=plan,
                        segment=spare or Segment.create(nslots * slot_bytes, tag="slots"), slot_bytes=slot_bytes,
                        free_slots=list(range(nslots - 1, -1, -1)), granted=hello.prefetch,
                        order=order, next_dispatch=0, next_send=0, num_batches=nb, lookahead=hello.lookahead)
        client.stream = stream
        self.counters.streams += 1
        self._send(ident, P.Accept(stream=hello.stream, epoch=hello.epoch, num_batches=nb,
                                   num_samples=plan.num_samples, dataset_length=len(source),
                                   dataset=source.name, service=self.instance))
        log.info("client %s job %r rank %d/%d epoch %d: stream %d serves %d of %d batches", ident.hex()[:12],
                 hello.job, hello.rank, hello.world_size, hello.epoch, hello.stream, len(order), nb)
        if len(order) == 0:
            self._finish(stream)

    def _on_credit(self, ident: bytes, client: Optional[Client], msg: P.Credit) -> None:
        if client is None or msg.stream > client.stream_id:
            # the service restarted or forgot this client: it will start again from its cursor
            self._send(ident, P.Error(code=P.ErrorCode.UNKNOWN_CLIENT, stream=msg.stream, fatal=False,
                                      message="this service has no stream for the client; start it again"))
            return
        s = client.stream
        if s is None or s.id != msg.stream:
            return  # credit for a stream that already ended or was replaced
        s.granted += msg.n
        if msg.promote:
            s.lookahead = False
        self.counters.client_wait_s += max(0.0, msg.wait_s - s.wait_s)
        self.counters.client_h2d_s += max(0.0, msg.h2d_s - s.h2d_s)
        s.wait_s, s.h2d_s = msg.wait_s, msg.h2d_s

    def _drop_client(self, ident: bytes, why: str) -> None:
        client = self.clients.pop(ident, None)
        if client is None:
            return
        if self.fd_owner.get(client.fd) == ident:
            del self.fd_owner[client.fd]
        if client.stream is not None:
            self._retire(client.stream)
        if client.spare is not None:
            client.spare.close()
            client.spare = None
        log.info("client %s %s", ident.hex()[:12], why)

    def _send(self, ident: bytes, msg: P.Message) -> None:
        self.front.send_multipart([ident, *P.encode(msg)])

    # ------------------------------------------------------------------ workers
    def _schedule(self) -> None:
        idle = self.pool.idle()
        if not idle or self._drain_until is not None:
            return
        streams = [c.stream for c in self.clients.values() if c.stream is not None and c.stream.dispatchable()]
        if not streams:
            return
        self._rr = (self._rr + 1) % len(streams)
        streams = streams[self._rr:] + streams[: self._rr]  # take turns across clients ...
        streams.sort(key=lambda s: s.lookahead)  # ... and serve early next epochs only when idle
        while idle and streams:
            for s in list(streams):
                if not idle:
                    break
                if not s.dispatchable():
                    streams.remove(s)
                    continue
                if s.lookahead and any(not x.lookahead and x.dispatchable() for x in streams):
                    break  # a current epoch can still use this worker
                self._dispatch(s, idle.pop())

    def _dispatch(self, s: Stream, worker) -> None:
        iso_batch = next((b for b, iso in s.isolated.items() if iso.todo), None)
        if iso_batch is not None:
            iso = s.isolated[iso_batch]
            pos = iso.todo.pop(0)
            rec = Inflight(iso_batch, iso.slot, pos)
            indices = [int(s.plan.batch(iso_batch)[pos])]
            offset = iso.slot * s.slot_bytes + pos * s.hello.image_size ** 2 * 3
        else:
            if s.redo:
                batch = heapq.heappop(s.redo)
            else:
                batch = int(s.order[s.next_dispatch])
                s.next_dispatch += 1
            rec = Inflight(batch, s.free_slots.pop())
            indices = s.plan.batch(batch).tolist()
            offset = rec.slot * s.slot_bytes
        task_id = next(self._task_ids)
        h = s.hello
        task = P.Task(task=task_id, dataset=s.source.name, shm=s.segment.name, offset=offset, indices=indices,
                      seed=h.seed, epoch=h.epoch, train=h.train, image_size=h.image_size, scale=list(h.scale),
                      ratio=list(h.ratio), on_error=self.config.on_error)
        s.inflight[task_id] = rec
        self.tasks[task_id] = s
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
        s = self.tasks.pop(done.task, None)
        if s is None:
            return
        rec = s.inflight.pop(done.task)
        self.counters.read_s += done.read_s
        self.counters.decode_s += done.decode_s
        if s.retired:
            return  # its segment is closed once nothing is in flight; slots no longer matter
        if not done.ok:
            self.counters.failed_tasks += 1
            self._release(s, rec)
            self._fail(s, P.ErrorCode.SAMPLE_FAILED, done.error, done.traceback)
            return
        if rec.pos >= 0:
            iso = s.isolated[rec.batch]
            iso.pending.discard(rec.pos)
            iso.skipped += [[rec.pos, idx, why] for _, idx, why in done.skipped]
            self._finish_isolated(s, rec.batch)
            return
        s.ready[rec.batch] = (rec.slot, done)
        self._flush(s)

    def _release(self, s: Stream, rec: Inflight) -> None:
        """Give back a failed task's slot (an isolated batch's slot once, when it is dropped)."""
        if rec.pos < 0:
            s.free_slots.append(rec.slot)
        elif s.isolated.pop(rec.batch, None) is not None and not any(
                r.batch == rec.batch for r in s.inflight.values()):
            s.free_slots.append(rec.slot)

    def _finish_isolated(self, s: Stream, batch: int) -> None:
        """Once every sample of an isolated batch is done or judged poison, compact and queue it."""
        iso = s.isolated[batch]
        if iso.pending:
            return
        del s.isolated[batch]
        skipped = sorted(iso.skipped)
        if skipped:
            n = len(s.plan.batch(batch))
            img = s.hello.image_size ** 2 * 3
            view = s.segment.array(np.uint8, (n, img), iso.slot * s.slot_bytes)
            keep = [p for p in range(n) if p not in {q for q, _, _ in skipped}]
            view[: len(keep)] = view[keep]  # fancy indexing copies first: safe to overlap
            del view
        s.ready[batch] = (iso.slot, P.Done(task=-1, worker=-1, ok=True, skipped=skipped))
        self._flush(s)

    def _on_worker_exit(self, wid: int) -> None:
        task_id, exitcode = self.pool.reap(wid)
        if task_id is None:
            return
        s = self.tasks.pop(task_id, None)
        if s is None:
            return
        rec = s.inflight.pop(task_id)
        if s.retired:
            return
        self.counters.redone_tasks += 1
        if rec.pos >= 0:
            self._isolated_sample_died(s, rec, exitcode)
            return
        s.attempts[rec.batch] = s.attempts.get(rec.batch, 0) + 1
        if s.attempts[rec.batch] >= ISOLATE_AFTER:
            # find the culprit: one task per sample, written into this same slot
            n = len(s.plan.batch(rec.batch))
            s.isolated[rec.batch] = Isolation(slot=rec.slot, todo=list(range(n)), pending=set(range(n)))
            log.warning("batch %d of stream %d killed %d workers; redoing it one sample per task",
                        rec.batch, s.id, s.attempts[rec.batch])
            return
        s.free_slots.append(rec.slot)
        heapq.heappush(s.redo, rec.batch)

    def _isolated_sample_died(self, s: Stream, rec: Inflight, exitcode: Optional[int]) -> None:
        iso = s.isolated[rec.batch]
        iso.attempts[rec.pos] = iso.attempts.get(rec.pos, 0) + 1
        idx = int(s.plan.batch(rec.batch)[rec.pos])
        if iso.attempts[rec.pos] < MAX_SAMPLE_ATTEMPTS:
            iso.todo.insert(0, rec.pos)  # once more, in case the crash was not its fault
            return
        reason = f"crashed the decoder: {iso.attempts[rec.pos]} workers died on it (last exit code {exitcode})"
        if self.config.on_error == "skip":
            iso.pending.discard(rec.pos)
            iso.skipped.append([rec.pos, idx, reason])
            self._finish_isolated(s, rec.batch)
            return
        self._release(s, rec)
        self._fail(s, P.ErrorCode.SAMPLE_FAILED, f"sample {idx} ({s.source.describe(idx)}) {reason}", "")

    # ------------------------------------------------------------------ sending
    def _flush(self, s: Stream) -> None:
        """Send every batch that is next in order and done."""
        while s.next_send < len(s.order) and int(s.order[s.next_send]) in s.ready:
            b = int(s.order[s.next_send])
            slot, done = s.ready.pop(b)
            self._send_batch(s, b, slot, done)
            s.next_send += 1
        if s.next_send == len(s.order) and not s.finished:
            self._finish(s)

    def _send_batch(self, s: Stream, b: int, slot: int, done: P.Done) -> None:
        indices = s.plan.batch(b)
        padding = s.plan.batch_padding(b)
        skipped = []
        if done.skipped:
            keep = np.ones(len(indices), dtype=bool)
            for pos, idx, reason in done.skipped:
                keep[pos] = False
                skipped.append([idx, reason])
            indices, padding = indices[keep], padding[keep]
            s.skipped += len(skipped)
            self.counters.skipped += len(skipped)
        n, size = len(indices), s.hello.image_size
        nbytes = n * size * size * 3
        header = P.encode_header(P.Batch(stream=s.id, epoch=s.hello.epoch, index=b, indices=indices.tolist(),
                                         shape=[n, size, size, 3], padding=int(padding.sum()), skipped=skipped))
        labels = np.ascontiguousarray(s.source.labels[indices], dtype=np.int64).tobytes()
        assert s.segment.buf is not None
        view = s.segment.buf[slot * s.slot_bytes : slot * s.slot_bytes + nbytes]
        if nbytes >= P.ZERO_COPY_MIN_BYTES:
            frame = zmq.Frame(view, track=True)
            self.front.send_multipart([s.client, header, frame, labels])
            s.sending.append((frame.tracker, slot))
        else:
            self.front.send_multipart([s.client, header, view, labels])  # copied: slot free now
            s.free_slots.append(slot)
        view.release()
        s.samples_sent += n
        c = self.clients.get(s.client)
        if c is not None:
            c.batches += 1
            c.samples += n
        self.counters.samples += n
        self.counters.batches += 1
        self.counters.bytes += nbytes
        self._rate.append((time.monotonic(), self.counters.samples))

    def _finish(self, s: Stream) -> None:
        s.finished = True
        self._send(s.client, P.EndOfEpoch(stream=s.id, epoch=s.hello.epoch, num_batches=s.num_batches))
        c = self.clients.get(s.client)
        if c is not None and c.stream is s:
            c.stream = None
        self._retire(s)

    def _fail(self, s: Stream, code: str, message: str, tb: str) -> None:
        log.error("stream %d of client %s failed: %s", s.id, s.client.hex()[:12], message)
        self._send(s.client, P.Error(code=code, message=message, stream=s.id, fatal=True, traceback=tb))
        c = self.clients.get(s.client)
        if c is not None and c.stream is s:
            c.stream = None
        self._retire(s)

    def _fail_all(self, why: str) -> None:
        for c in self.clients.values():
            if c.stream is not None:
                self._fail(c.stream, P.ErrorCode.INTERNAL, why, "")

    def _retire(self, s: Stream) -> None:
        """Stop serving ``s``; its segment is freed once no worker or send still uses it."""
        if s.retired:
            return
        s.retired = True
        s.isolated.clear()
        for slot, _ in s.ready.values():
            s.free_slots.append(slot)
        s.ready.clear()
        s.redo.clear()
        self.retiring.append(s)
        self._reap_trackers()

    def _waiting_on_sends(self) -> bool:
        """True when something is blocked until a zero-copy send completes: a stream with work,
        credit and an idle worker but no free slot, or a retired stream's segment to release.
        Only then does the loop wake every TRACKER_POLL_MS to look at the trackers."""
        if any(s.sending for s in self.retiring):
            return True
        if not self.pool.idle():
            return False  # a worker's Done will wake the loop anyway
        for c in self.clients.values():
            s = c.stream
            if s is not None and s.sending and not s.free_slots and not s.retired and (
                    s.redo or (s.next_dispatch < len(s.order) and s.next_dispatch < s.granted)):
                return True
        return False

    def _shm_in_use(self) -> int:
        """Bytes of batch slots: every stream's, and the spares kept for clients' next streams."""
        return (sum(s.segment.size for s in self._all_streams())
                + sum(c.spare.size for c in self.clients.values() if c.spare is not None))

    def _all_streams(self):
        for c in self.clients.values():
            if c.stream is not None:
                yield c.stream
        yield from self.retiring

    def _reap_trackers(self) -> None:
        for s in self._all_streams():
            if s.sending:
                still = []
                for tracker, slot in s.sending:
                    if tracker.done:
                        s.free_slots.append(slot)
                    else:
                        still.append((tracker, slot))
                s.sending = still
        if self.retiring:
            keep = []
            for s in self.retiring:
                if s.inflight or s.sending:
                    keep.append(s)
                    continue
                c = self.clients.get(s.client)  # gone (dropped, or the service stopping): no one to keep it for
                if c is not None and c.spare is None:
                    c.spare = s.segment
                else:
                    s.segment.close()
            self.retiring = keep

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        """A consistent snapshot (call it through :meth:`call`)."""
        now = time.monotonic()
        rate = 0.0
        if len(self._rate) >= 2 and now - self._rate[0][0] > 0:
            t0, n0 = self._rate[0]
            rate = (self.counters.samples - n0) / (now - t0) if now - self._rate[-1][0] < 5 else 0.0
        workers = [
            {"id": w.id, "pid": w.pid, "state": w.state, "tasks_done": w.tasks_done,
             "busy_s": round(w.busy_s, 3), "uptime_s": round(now - w.started_at, 1)}
            for w in self.pool.workers.values()
        ]
        clients = []
        for c in self.clients.values():
            s = c.stream
            entry = {"client": c.ident.hex()[:12], "job": c.job, "batches": c.batches, "samples": c.samples,
                     "connected_s": round(now - c.connected, 1), "stream": None}
            if s is not None:
                h = s.hello
                entry["stream"] = {
                    "id": s.id, "dataset": s.source.name, "epoch": h.epoch, "rank": h.rank,
                    "world_size": h.world_size, "batch_size": h.batch_size,
                    "next_batch": int(s.order[s.next_send]) if s.next_send < len(s.order) else s.num_batches,
                    "sent": s.next_send, "to_send": len(s.order), "num_batches": s.num_batches,
                    "credits": s.granted - s.next_send,
                    "in_flight": len(s.inflight), "wait_s": round(s.wait_s, 3), "h2d_s": round(s.h2d_s, 3),
                }
            clients.append(entry)
        c = self.counters
        return {
            "instance": self.instance,
            "uptime_s": round(time.time() - self.started, 1),
            "data_port": self.data_port,
            "datasets": {n: {"length": len(s), "num_classes": s.num_classes} for n, s in self.sources.items()},
            "workers": {"target": self.pool.target, "counts": self.pool.counts(), "deaths": self.pool.deaths,
                        "broken": self.pool.broken, "list": workers},
            "clients": clients,
            "throughput": {"samples_per_s": round(rate, 1)},
            "totals": {
                "samples": c.samples, "batches": c.batches, "bytes": c.bytes, "skipped": c.skipped,
                "bad_messages": c.bad_messages, "failed_tasks": c.failed_tasks, "redone_tasks": c.redone_tasks,
                "streams": c.streams,
            },
            "stage_s": {"read": round(c.read_s, 3), "decode_augment": round(c.decode_s, 3),
                        "client_wait": round(c.client_wait_s, 3), "client_h2d": round(c.client_h2d_s, 3)},
            "shm_bytes": self._shm_in_use(),
            "autoscaler": self.autoscaler.status() if self.autoscaler else {"enabled": False},
        }

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

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop workers, drop clients, release every segment and socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._running = False
        # tell clients first, so they start reconnecting while workers stop
        self.front.setsockopt(zmq.LINGER, 500)  # bounded: lets these goodbyes leave
        for ident in list(self.clients):
            try:
                self._send(ident, P.Error(code=P.ErrorCode.SHUTTING_DOWN, fatal=False,
                                          message="the service is stopping; reconnect and resume"))
            except zmq.ZMQError:
                pass
        try:
            self.pool.close(timeout=self.config.stop_timeout_s)
        finally:
            for ident in list(self.clients):
                self._drop_client(ident, "service stopping")
            streams = list(self.retiring)
            self.retiring = []
            for sock in (self.front, self.monitor):
                sock.close(0)
            self.ctx.term()  # returns once zmq has released every zero-copy frame
            for s in streams:
                s.segment.close()
            self._wake_r.close()
            self._wake_w.close()
            while True:  # anyone still waiting on a call learns that the service is gone
                try:
                    _, fut = self._calls.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError("the service stopped"))


def _stream_of(frame) -> int:
    """Best effort: the stream a refused message was about, so its sender can match the error."""
    try:
        header = msgpack.unpackb(frame.bytes, raw=False)
        stream = header.get("stream", -1)
        return stream if isinstance(stream, int) and not isinstance(stream, bool) else -1
    except Exception:
        return -1

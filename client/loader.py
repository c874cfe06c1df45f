"""RemoteLoader: a drop-in for a DataLoader loop that streams batches from the service.

::

    loader = RemoteLoader("tcp://cpu-node:5555", batch_size=256, rank=rank, world_size=world)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            ...

The loader's cursor (epoch, next batch) is the only progress there is: ``state_dict()``
returns it, ``load_state_dict()`` on a fresh loader continues exactly after it, and after a
service restart the loader starts its stream again from it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from collections import deque
from typing import Deque, Iterator, List, Optional, Sequence, Union

import zmq

from wire import protocol as P
from wire.plan import num_batches

from client.batch import Batch
from client.config import LoaderConfig
from wire.jobspec import JobSpec
from client.curve import client_keys
from client.errors import LoaderError, LoaderTimeout
from client.flow import EpochFlow, InOrder
from client.replica import Replica
from client.sinks import make_sink

log = logging.getLogger("client")

STATE_VERSION = 1
PROBE_S = 5.0  # silence, while batches are owed, after which the loader asks again
_PLAN_KEYS = JobSpec.order_fields() + ("rank",)  # what fixes this rank's batches: a resume must match them


@dataclass
class LoaderStats:
    batches: int = 0
    samples: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # time the trainer spent blocked in next() waiting for data
    h2d_s: float = 0.0  # time spent issuing/waiting for host-to-device copies
    restarts: int = 0  # streams started again after the service forgot this client


@dataclass
class _Lookahead:
    epoch: int
    flow: EpochFlow


class RemoteLoader:
    """Iterate batches served by a loader service. See :class:`client.config.LoaderConfig`
    for every option; the common ones are keyword arguments here."""

    def __init__(self, endpoint: Union[str, Sequence[str]], batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 image_size: int = 224, train: bool = True, prefetch: int = 4, device: str = "cpu", **options):
        """``endpoint``: one ``tcp://host:port``, or a list of service replicas to spread this
        rank's batches over (see :func:`client.resolve_endpoints` for a DNS name)."""
        endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not options.get("job"):
            options["job"] = default_job()
        if not endpoints:
            raise ValueError("endpoint: give at least one tcp://host:port")
        self.endpoints = endpoints
        self.config = LoaderConfig.of(endpoints[0], batch_size=batch_size, rank=rank, world_size=world_size,
                                      seed=seed, shuffle=shuffle, drop_last=drop_last, image_size=image_size,
                                      train=train, prefetch=prefetch, device=str(device), **options)
        for e in endpoints[1:]:
            LoaderConfig(endpoint=e, spec=self.config.spec)  # validates the address
        # batches this rank may have asked for or hold (received, in the device sink) at once;
        # any one replica may be asked for all of them if it is the one that delivers soonest
        self._window = self.config.prefetch * len(endpoints)
        self._curve = client_keys(self.config.curve_keys)  # None: plain ZMTP
        # a named pipeline's outputs (and so the sink and the frame cap) come with the dataset's description
        self._frame_cap = self.config.max_frame_bytes
        self._sink = None if self.config.spec.pipeline else make_sink(self.config, self._window)
        self._ctx: Optional[zmq.Context] = None
        self._replicas: List[Replica] = []
        self._spare: List[Replica] = []  # a second connection per replica, for epoch lookahead
        self._ahead: Optional[_Lookahead] = None  # the next epoch, already streaming on the spare set
        self._stream = 0
        self._client_id = uuid.uuid4().hex  # all this loader's connections: one client to the services
        self._epoch = 0
        self._next_batch = 0
        self._epoch_set = False  # set_epoch since the last iteration: no auto-advance (see __iter__)
        self._resume = False  # the next iteration resumes at a cursor from load_state_dict
        self._pending_epoch: Optional[int] = None  # set_epoch during an epoch: for the next iteration
        self._live: Optional["weakref.ref"] = None  # the iterator of the epoch in progress
        self._iter_lock = threading.Lock()
        self._dataset_length: Optional[int] = None
        self._stats = LoaderStats()
        self._closed = False

    # ------------------------------------------------------------------ DataLoader-like API
    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        if self._dataset_length is None:
            self._describe()
        assert self._dataset_length is not None
        c = self.config
        return num_batches(self._dataset_length, c.spec.batch_size, c.spec.world_size, c.spec.drop_last) * c.echo

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration serves (as with DistributedSampler). Called while
        an epoch is being iterated, it applies to the next iteration (the cursor, and so
        :meth:`state_dict`, stay on the epoch in progress)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        with self._iter_lock:
            if self._live_iterator() is not None:
                self._pending_epoch = epoch
                return
            self._select_epoch(epoch)

    def _select_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            # another epoch from its start; a loaded cursor in the same epoch is kept (resume)
            self._epoch, self._next_batch, self._resume = epoch, 0, False
        self._epoch_set = True

    def __iter__(self) -> Iterator[Batch]:
        """One epoch, DataLoader-style: the current epoch from its first batch, except the first
        iteration after :meth:`load_state_dict`, which resumes at the loaded cursor. Iterating
        again without :meth:`set_epoch` once an epoch is complete starts the next one. One live
        iterator at a time: a second one is an error at once."""
        if self._closed:
            raise RuntimeError("this RemoteLoader is closed")
        with self._iter_lock:
            if self._live_iterator() is not None:
                raise RuntimeError("this RemoteLoader already has a live iterator (another thread, or an "
                                   "earlier iter() still referenced): finish or close it first; use one "
                                   "loader per consumer")
            if self._dataset_length is None:
                self._describe()
            if self._pending_epoch is not None:
                self._select_epoch(self._pending_epoch)
                self._pending_epoch = None
            resume, self._resume = self._resume, False  # a loaded cursor is resumed once
            if not self._epoch_set and self._next_batch >= self._raw_len():
                self._epoch, self._next_batch = self._epoch + 1, 0
            elif not resume:
                self._next_batch = 0  # an epoch left part-way (a peek, a break) starts again
            self._epoch_set = False
            gen = self._iterate(self._epoch, self._next_batch)
            self._live = weakref.ref(gen)
            return gen

    def _live_iterator(self):
        gen = self._live() if self._live is not None else None
        return gen if gen is not None and gen.gi_frame is not None else None

    def state_dict(self) -> dict:
        """The cursor: where the next iteration starts. Small, JSON-friendly."""
        c = self.config
        state = {"version": STATE_VERSION, "epoch": self._epoch, "next_batch": self._next_batch}
        state.update({k: getattr(c, k) if k == "rank" else getattr(c.spec, k) for k in _PLAN_KEYS})
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the plan-defining settings must match this loader's."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported loader state version {state.get('version')!r}")
        mine = self.state_dict()
        mismatched = {k: (state.get(k), mine[k]) for k in _PLAN_KEYS if state.get(k) != mine[k]}
        if mismatched:
            detail = ", ".join(f"{k}: saved {a!r} vs loader {b!r}" for k, (a, b) in mismatched.items())
            raise ValueError(f"loader state does not match this loader's plan ({detail})")
        with self._iter_lock:
            if self._live_iterator() is not None:
                raise RuntimeError("load_state_dict while an epoch is being iterated: finish or close it first")
            self._epoch, self._next_batch = int(state["epoch"]), int(state["next_batch"])
            self._resume, self._pending_epoch = True, None

    def stats(self) -> dict:
        """Counters since creation: batches, samples, bytes, wait_s (stall), h2d_s, restarts."""
        return asdict(self._stats)

    def close(self) -> None:
        """Tell the services we are leaving and release the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for r in self._replicas + self._spare:
            r.close()
        self._replicas, self._spare = [], []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._sink is not None:
            self._sink.close()

    def __enter__(self) -> "RemoteLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ streaming
    def _raw_len(self) -> int:
        c = self.config
        assert self._dataset_length is not None
        return num_batches(self._dataset_length, c.spec.batch_size, c.spec.world_size, c.spec.drop_last)

    def _iterate(self, epoch: int, start: int) -> Iterator[Batch]:
        """One epoch from batch ``start``, in plan order. Three stages, one job each: the
        replicas' transports (receive into host memory, in any order), the flow control
        (:class:`~client.flow.EpochFlow`: what to ask of whom), and the ordering window that
        pushes batches to the device sink in plan order, ``device_prefetch`` ahead."""
        c = self.config
        if self._dataset_length is None:
            self._describe()
        total = self._raw_len()
        reps = self._connect()
        flow = self._adopt_lookahead(epoch, start, total)
        if flow is None:
            self._drop_lookahead()
            if start >= total:
                return
            flow = self._start_epoch(reps, epoch, start, total)
        else:
            reps = self._replicas
        in_order = InOrder(flow.next_yield, c.device_prefetch)
        pushed: Deque[Batch] = deque()  # pushed to the sink (copy issued), not yet yielded
        heard = time.monotonic()  # the last message from a service
        probe_s = min(PROBE_S, c.timeout / 3)
        h2d_seen = self._sink.h2d_s
        poller = zmq.Poller()
        for r in reps:
            poller.register(r.sock, zmq.POLLIN)
            poller.register(r.monitor, zmq.POLLIN)
        try:
            while not flow.done:
                t0 = time.perf_counter()
                heard = max(heard, time.monotonic())  # the trainer's own time is no service's silence
                probed, told = heard, False
                while not self._push_due(in_order, flow, pushed):
                    now = time.monotonic()
                    wake = min([heard + c.timeout, probed + probe_s, *self._cut_times(reps)])
                    if len(reps) > 1:  # wake up in time to notice a replica that stays down
                        wake = min(wake, now + c.replica_timeout / 2)
                    events = dict(poller.poll(max(1, int((wake - now) * 1000) + 1)))
                    now = time.monotonic()
                    self._check_cut(reps, now)
                    if not events:
                        if now >= heard + c.timeout:
                            self._raise_timeout(reps)
                        if now >= probed + probe_s:
                            self._probe(reps, flow)
                            probed = now
                            if not told:  # one line per wait, so a stall is never silent
                                told = True
                                log.warning("waiting %.0fs for batch %d of epoch %d (asked of %s); nothing heard "
                                            "for %.0fs of the %gs timeout", time.perf_counter() - t0,
                                            flow.next_yield, epoch, self._owner(reps, flow), now - heard, c.timeout)
                        self._fail_over_dead(reps, flow, now)
                        self._ask(reps, flow)
                        continue
                    for r in reps:
                        if r.monitor in events:
                            self._on_monitor(r, flow)
                        if r.sock in events and self._pump(r, flow, in_order, total):
                            heard = probed = now
                    self._ask(reps, flow)
                    if not self._ahead and c.epoch_lookahead and flow.fully_asked:
                        self._start_lookahead(epoch + 1, total)
                waited = time.perf_counter() - t0
                h2d = self._sink.h2d_s - h2d_seen
                h2d_seen = self._sink.h2d_s
                self._stats.wait_s += waited
                self._stats.h2d_s = self._sink.h2d_s
                for r in reps:
                    r.stall(waited, h2d)
                flow.take()
                batch = pushed.popleft()
                self._ask(reps, flow)  # its place in the window is free
                self._stats.batches += 1
                self._stats.samples += len(batch)
                self._next_batch = flow.next_yield
                for _ in range(c.echo):
                    yield self._sink.hand_over(batch)
            for r in reps:
                if not r.dead and r.stream >= 0 and r.accepted:
                    r.request([], self._stats.batches, final=True)  # the stream ends; its slots are kept
        finally:
            self._sink.end()  # which also takes back what was received and never pushed

    def _push_due(self, in_order: InOrder, flow: EpochFlow, pushed: Deque[Batch]) -> bool:
        """Hand the sink what the ordering window lets go now; whether the next batch to yield is pushed."""
        for msg, payload in in_order.due(flow.next_yield):
            pushed.append(self._sink.push(msg, payload))
        return bool(pushed)  # pushed in plan order from next_yield: its head is next_yield

    def _start_epoch(self, reps: List[Replica], epoch: int, start: int, total: int,
                     lookahead: bool = False) -> EpochFlow:
        """The flow control of ``epoch`` from ``start`` over ``reps``, with a new stream on each
        replica asking at once for what the flow assigns it."""
        flow = EpochFlow(start, total, self._window, self._window, len(reps))
        initial = flow.assign((r.index for r in reps), time.monotonic())
        for r in reps:
            r.dead = False
            self._hello(r, epoch, initial.get(r.index, []), lookahead=lookahead)
        return flow

    def _pump(self, r: Replica, flow: EpochFlow, in_order: InOrder, total: int) -> bool:
        """Read what ``r`` has (bounded per round, so one replica cannot starve the rest);
        True if anything came from the service."""
        heard = False
        for _ in range(64):
            if not r.sock.poll(0):
                break
            msg, payload = self._recv(r)
            if isinstance(msg, P.Progress):  # the service is alive, but the timeout counts until a batch
                r.progress, r.progress_at = msg, time.monotonic()
                continue
            heard = True
            if msg is None:
                continue
            if isinstance(msg, P.Accept):
                if msg.num_batches != total:
                    raise LoaderError(P.ErrorCode.BAD_JOB, (
                        f"{r.endpoint} has {msg.num_batches} batches in this epoch, expected {total}: "
                        "do all replicas serve the same dataset?"))
                r.accepted = True
            elif isinstance(msg, P.Batch):
                r.progress = None
                if not flow.on_batch(r.index, msg.index, time.monotonic()):
                    # (its memory goes back with the rest when the epoch ends)
                    raise LoaderError(P.ErrorCode.INTERNAL, f"unexpected batch {msg.index} from {r.endpoint}")
                in_order.put(msg.index, (msg, payload))
            elif isinstance(msg, P.Error) and msg.code == P.ErrorCode.UNKNOWN_CLIENT:
                self._restart(r, flow)  # the service forgot us: ask again for what we miss
        return heard

    def _on_monitor(self, r: Replica, flow: EpochFlow) -> None:
        if r.on_monitor():  # back, maybe to a restarted service: start again with what it owes
            if r.dead:
                log.info("service replica %s is back; it takes batches again", r.endpoint)
                r.dead = False
            self._restart(r, flow)

    @staticmethod
    def _owner(reps: List[Replica], flow: EpochFlow) -> str:
        for r in reps:
            if flow.next_yield in flow.outstanding[r.index]:
                return r.endpoint
        return "no replica yet: " + ", ".join(r.endpoint for r in reps)

    def _probe(self, reps: List[Replica], flow: EpochFlow) -> None:
        """Silence while batches are owed: ask again (an empty Request). A service that forgot
        the stream (it restarted, or was frozen long enough to drop us) answers unknown_client,
        and the stream starts again from what it owed; one that knows it says nothing."""
        for r in reps:
            if not r.dead and r.stream >= 0 and flow.outstanding[r.index]:
                r.request([], self._stats.batches, probe=True)

    def _ask(self, reps: List[Replica], flow: EpochFlow) -> None:
        """Request what the flow control allows of the replicas that can take requests."""
        live = [r.index for r in reps if not r.dead and r.accepted and r.down_since is None]
        for i, batches in flow.assign(live, time.monotonic()).items():
            reps[i].request(batches, self._stats.batches)

    def _hello(self, r: Replica, epoch: int, batches: List[int], lookahead: bool = False) -> None:
        """Start a new on-demand stream on ``r``, asking for ``batches`` at once."""
        c = self.config
        self._stream += 1
        r.hello(self._stream, P.Hello(
            stream=self._stream, spec=c.spec, epoch=epoch, rank=c.rank, prefetch=c.prefetch, job=c.job,
            batches=list(batches), lookahead=lookahead, on_demand=True, client=self._client_id))

    def _restart(self, r: Replica, flow: EpochFlow) -> None:
        """A new stream on ``r`` for the batches it was asked for and has not delivered."""
        if r.stream < 0 or r.dead:
            return
        self._stats.restarts += 1
        self._hello(r, r.epoch, sorted(flow.outstanding[r.index]))

    # ------------------------------------------------------------------ epoch lookahead
    def _start_lookahead(self, epoch: int, total: int) -> None:
        """Start ``epoch`` on a second set of connections, so the service never idles between
        epochs. Best effort: adopted if the next iteration is that epoch from its start;
        otherwise (or if a service refuses it) those streams are released at once."""
        if any(r.dead or r.down_since is not None for r in self._replicas):
            return
        if not self._spare:
            self._spare = self._open_connections()
        self._ahead = _Lookahead(epoch, self._start_epoch(self._spare, epoch, 0, total, lookahead=True))

    def _adopt_lookahead(self, epoch: int, start: int, total: int) -> Optional[EpochFlow]:
        """The lookahead's flow if it is for this epoch from its start and every service accepted
        it (its first message, already there in the usual case); else None."""
        ahead = self._ahead
        if ahead is None or ahead.epoch != epoch or start != 0:
            return None
        self._ahead = None
        deadline = time.monotonic() + self.config.timeout
        for r in self._spare:
            lost = False
            while not r.accepted:
                while r.monitor.poll(0):
                    lost = r.on_monitor() or lost  # reconnected: a restarted service forgot the stream
                left = deadline - time.monotonic()
                # a spare opened at the end of the last epoch may still be in its handshake: wait
                # for it; one that was connected and dropped lost its stream
                if lost or (r.down_since is not None and r.was_connected) or left <= 0:
                    log.info("epoch lookahead lost or not answered by %s; starting epoch %d plainly", r.endpoint, epoch)
                    return self._close_spare()
                poller = zmq.Poller()
                poller.register(r.sock, zmq.POLLIN)
                poller.register(r.monitor, zmq.POLLIN)
                if r.sock not in dict(poller.poll(left * 1000)):
                    continue
                try:
                    msg, _ = self._recv(r)
                except LoaderError as exc:  # refused (no capacity, say): start the epoch plainly
                    log.info("epoch lookahead refused by %s (%s); starting epoch %d plainly", r.endpoint, exc, epoch)
                    return self._close_spare()
                if isinstance(msg, P.Accept):
                    if msg.num_batches != total:
                        return self._close_spare()
                    r.accepted = True
        self._replicas, self._spare = self._spare, self._replicas
        for r in self._replicas:
            r.request([], self._stats.batches, promote=True)  # now the trainer's current epoch
        return ahead.flow

    def _drop_lookahead(self) -> None:
        """Release lookahead streams that will not be used (Bye frees them on the service now)."""
        if self._ahead is not None:
            self._ahead = None
            self._close_spare()

    def _close_spare(self) -> None:
        for r in self._spare:
            r.close()
        self._spare = []

    @staticmethod
    def _cut_times(reps: List[Replica]) -> List[float]:
        return [t for t in (r.cut_at() for r in reps if not r.dead) if t is not None]

    def _check_cut(self, reps: List[Replica], now: float) -> None:
        """Raise at once when every connection was cut for breaking the protocol (a rogue peer,
        an endpoint that is not a loader service): waiting out the timeout would change nothing."""
        cut = [r for r in reps if r.is_cut(now)]
        if cut and all(r.dead or r in cut for r in reps):
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, (
                f"the connection to {', '.join(r.endpoint for r in cut)} was cut for breaking the protocol and is "
                f"not retried: a peer that sends a frame over this loader's cap of {self._frame_cap} "
                "bytes (this job's largest data frame + 1 MiB), or that is not a ZeroMQ peer, is refused; is this "
                "endpoint a loader service?"))

    def _fail_over_dead(self, reps: List[Replica], flow: EpochFlow, now: float) -> None:
        """Give the outstanding batches of a replica that stayed down (or was cut) to the live ones."""
        if len(reps) < 2:
            return  # nobody else to ask: wait for it, up to `timeout`
        for r in reps:
            if r.dead or r.down_since is None or (now - r.down_since < self.config.replica_timeout
                                                  and not r.is_cut(now)):
                continue
            live = [x for x in reps if not x.dead and x is not r and x.down_since is None]
            if not live:
                return
            orphans = flow.lose(r.index)
            r.dead = True
            log.warning("service replica %s has been unreachable for %.0fs; its %d batches go to %s", r.endpoint,
                        now - r.down_since, len(orphans), ", ".join(x.endpoint for x in live))

    def _recv(self, r: Replica):
        """One message from ``r``: (message, payload), or (None, None) for a stale one.

        Raises LoaderError for the service's errors except the recoverable ones.
        """
        header = r.sock.recv(copy=False)
        try:
            msg = P.decode_header(header)
        except P.ProtocolError as exc:
            r.drain()
            raise LoaderError(exc.code, f"malformed message from the service at {r.endpoint}: {exc}") from None
        if getattr(msg, "stream", -1) not in (r.stream, -1):
            r.drain()  # from a stream we already left
            return None, None
        payload = None
        if isinstance(msg, P.Batch):
            payload = self._sink.receive(r.sock, msg)
            self._stats.bytes += msg.image_bytes
        else:
            r.drain()
        if isinstance(msg, P.EndOfEpoch):
            return None, None  # the stream we ended with a final Request is done
        if isinstance(msg, P.Error):
            if msg.code == P.ErrorCode.SHUTTING_DOWN:
                return None, None  # informational: the reconnect that follows restarts the stream
            if msg.code != P.ErrorCode.UNKNOWN_CLIENT:
                raise LoaderError(msg.code, f"{msg.message} (from {r.endpoint})" if len(self._replicas) > 1
                                  else msg.message, msg.traceback)
        return msg, payload

    def _raise_timeout(self, reps: List[Replica]) -> None:
        c = self.config
        down = [r for r in reps if r.down_since is not None]
        where = ", ".join(r.endpoint for r in reps)
        self._check_cut(reps, float("inf"))  # a cut shorter than its grace still is one at the timeout
        if down and len(down) == len(reps) and any(r.was_connected for r in reps):
            raise LoaderTimeout(f"lost the connection to the loader service at {where} "
                                f"{time.monotonic() - min(r.down_since for r in down):.0f}s ago and it has not "
                                f"come back within {c.timeout:g}s")
        if not any(r.was_connected for r in reps):
            if any(r.reached for r in reps):
                raise LoaderTimeout(f"reached {where} but no ZeroMQ handshake completed within {c.timeout:g}s: "
                                    "something else listens there (the REST port? the data port is the service's "
                                    "--data-port, 5555 by default), or the service is stopped or stuck")
            raise LoaderTimeout(f"could not connect to the loader service at {where} within {c.timeout:g}s; is "
                                "it running and reachable? (start one with: loader-service serve --demo)")
        said = [_progress_text(r) for r in reps if r.progress is not None]
        if said:
            raise LoaderTimeout(f"no batch for {c.timeout:g}s: " + "; ".join(said))
        raise LoaderTimeout(f"the loader service at {where} is connected but has answered nothing for "
                            f"{c.timeout:g}s (is its process stopped or stuck? its /healthz and log say more)")

    def _describe(self) -> None:
        """Learn the dataset's length from whichever replica answers first."""
        reps = self._connect()
        c = self.config
        describe = P.Describe(dataset=c.spec.dataset, pipeline=c.spec.pipeline, pipeline_args=c.spec.pipeline_args)
        for r in reps:
            r.send(describe)
        poller = zmq.Poller()
        for r in reps:
            poller.register(r.sock, zmq.POLLIN)
            poller.register(r.monitor, zmq.POLLIN)
        deadline = time.monotonic() + self.config.timeout
        while True:
            left = min([deadline, *self._cut_times(reps)]) - time.monotonic()
            events = dict(poller.poll(max(0, left) * 1000)) if left > 0 else {}
            self._check_cut(reps, time.monotonic())
            if not events and time.monotonic() >= deadline:
                self._raise_timeout(reps)
            for r in reps:
                if r.monitor in events and r.on_monitor():
                    r.send(describe)
                if r.sock in events:
                    msg, _ = self._recv(r)
                    if isinstance(msg, P.DatasetInfo):
                        if c.spec.pipeline and self._sink is None:
                            self._use_outputs(r.endpoint, msg.outputs)
                        self._dataset_length = msg.length
                        return

    def _use_outputs(self, endpoint: str, outputs: list) -> None:
        """Size the sink and the frame cap for a named pipeline's declared outputs."""
        c = self.config
        if not outputs:
            raise LoaderError(P.ErrorCode.BAD_JOB, f"the service at {endpoint} did not describe pipeline "
                              f"{c.spec.pipeline!r}: it predates named pipelines; upgrade it")
        layout = [(str(name), tuple(int(d) for d in shape)) for name, shape in outputs]
        self._sink = make_sink(c, self._window, layout)
        cap = c.spec.batch_size * max(math.prod(s) for _, s in layout) + (1 << 20)
        if cap > self._frame_cap:  # the connections were opened with a smaller cap: open them again
            self._frame_cap = cap
            for r in self._replicas:
                r.close()
            self._replicas = self._open_connections()

    def _connect(self) -> List[Replica]:
        if not self._replicas:
            if self._closed:
                raise RuntimeError("this RemoteLoader is closed")
            self._ctx = zmq.Context(1)
            self._replicas = self._open_connections()
        return self._replicas

    def _open_connections(self) -> List[Replica]:
        """One connection per endpoint (the current set, or the lookahead's second set)."""
        c = self.config
        assert self._ctx is not None
        # A service sends a connection at most `window` batches of its stream, plus as many of a
        # stream being replaced and a few control messages: more can only come from a rogue peer,
        # and libzmq then stops reading (backpressure, nothing dropped).
        queued = 2 * self._window + 16
        return [Replica(self._ctx, e, c.heartbeat_s, i, self._curve, self._frame_cap, queued)
                for i, e in enumerate(self.endpoints)]


def default_job() -> str:
    """The job name a loader uses when given none: the launcher's id of this training, so that
    the ranks of one training share it and unrelated trainings on one service never do:
    ``TORCHELASTIC_RUN_ID`` (torchrun), else ``MASTER_ADDR:MASTER_PORT``; empty (no job rules)
    outside a launcher."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchelastic:{run_id}"[:256]
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{addr}:{port}"[:256] if addr and port else ""


def resolve_endpoints(endpoint: str) -> List[str]:
    """``tcp://name:port`` -> one endpoint per address the name resolves to (a Kubernetes
    headless Service, say), sorted so every rank lists the replicas in the same order."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(endpoint)
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise ValueError(f"expected tcp://host:port, got {endpoint!r}")
    infos = socket.getaddrinfo(u.hostname, u.port, type=socket.SOCK_STREAM)
    addrs = sorted({i[4][0] for i in infos})
    return [f"tcp://[{a}]:{u.port}" if ":" in a else f"tcp://{a}:{u.port}" for a in addrs]


__all__ = ["RemoteLoader", "LoaderStats", "default_job", "resolve_endpoints"]


def _progress_text(r: Replica) -> str:
    """What ``r``'s service last said it does for our stream, in words."""
    p, age = r.progress, time.monotonic() - r.progress_at
    where = f"the loader service at {r.endpoint}"
    if p.no_slots:
        text = (f"{where} is alive but its batch memory (--max-shm-mb) is all in use by other jobs' streams; "
                f"{p.waiting} of this loader's batches wait for slots (its /v1/status shows who holds them)")
    elif p.workers == 0:
        text = f"{where} is alive but has no workers (its /healthz says why)"
    elif p.tasks:
        text = f"{where} is alive but slow: batch {p.batch} has been decoding for {p.task_s:.0f}s"
        if p.sample >= 0:
            text += f", its worker on sample {p.sample} ({p.file}) for {p.sample_s:.0f}s"
    elif p.busy >= p.workers:
        text = (f"{where} is alive and all its {p.workers} workers are busy with other clients' tasks; "
                f"{p.waiting} of this loader's batches wait for one")
    else:
        text = f"{where} is alive with {p.workers} workers ({p.busy} busy); {p.waiting} of this loader's batches wait"
    return text + (f" (said {age:.0f}s ago)" if age >= 1 else "")


"""RemoteLoader: a drop-in for a DataLoader loop that streams batches from the service.

::

    loader = RemoteLoader("tcp://cpu-node:5555", batch_size=256, rank=rank, world_size=world)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            ...

The loader's cursor is the only progress there is: the job's position in the epoch's global
order, the same on every rank at the same step. ``state_dict()`` returns it, with what fixes
that order (seed, shuffle, shuffle_window, drop_last, the dataset's identity); ``load_state_dict()`` on any rank
of a job, at any world size and batch size, continues with exactly the rest of the epoch (see
:mod:`wire.plan`); after a service restart the loader starts its streams again from it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
import weakref
from dataclasses import asdict, replace
from typing import Dict, Iterator, List, Optional, Sequence, Union

import zmq

from wire import protocol as P
from wire.jobspec import JobSpec
from wire.plan import num_batches, position

from client.batch import Batch
from client.config import LoaderConfig
from client.connections import Connections, describe_change
from client.curve import client_keys
from client.epoch import EpochRun
from client.errors import LoaderError
from client.fleet import Fleet
from client.lookahead import Lookahead
from client.sinks import make_sink
from client.stats import LoaderStats

log = logging.getLogger("client")

STATE_VERSION = 2  # 1: one rank's batch cursor (read at its own world size and batch size only)
_ORDER_KEYS = JobSpec.order_fields()  # a resume must match these; world size and batch size may change
# order fields added since STATE_VERSION 2: written only when set, read as their default when absent
# (a state saved before them, or without them, is the order they leave unchanged)
_LATER_KEYS = {"shuffle_window": 0}


class RemoteLoader:
    """Iterate batches served by a loader service. See :class:`client.config.LoaderConfig`
    for every option; the common ones are keyword arguments here."""

    def __init__(self, endpoint: Union[str, Sequence[str]], batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 image_size: int = 224, train: bool = True, prefetch: int = 4, device: str = "cpu",
                 shuffle_window: int = 0, **options):
        """``endpoint``: one ``tcp://host:port``, or a list of service replicas to spread this
        rank's batches over. A host given by name (``tcp://loader-headless:5555``, a Kubernetes
        headless Service) stands for every address it resolves to, followed during the run:
        replicas join and leave as the name's records change (``dns_refresh_s``; see
        :mod:`client.membership`)."""
        endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not endpoints:
            raise ValueError("endpoint: give at least one tcp://host:port")
        self.endpoints = endpoints
        config = LoaderConfig.of(endpoints[0], batch_size=batch_size, rank=rank, world_size=world_size,
                                 seed=seed, shuffle=shuffle, shuffle_window=shuffle_window,
                                 drop_last=drop_last, image_size=image_size,
                                 train=train, prefetch=prefetch, device=str(device), **options)
        if not config.job:  # the launcher's id and what tells this loader from the rank's others
            config = replace(config, job=default_job(config.spec))
        self.config = config
        for e in endpoints[1:]:
            LoaderConfig(endpoint=e, spec=self.config.spec)  # validates the address
        self._fleet = Fleet(endpoints, self.config)
        self._curve = client_keys(self.config.curve_keys)  # None: plain ZMTP
        # a named pipeline's outputs (and so the sink and the frame cap) come with the dataset's description
        self._frame_cap = self.config.max_frame_bytes
        self._window = 0  # set with the replicas to start with (a followed name's are known once it resolves)
        self._sink = None
        if not self._fleet.membership.following:
            self._size_window(len(endpoints))
        self._ctx: Optional[zmq.Context] = None
        self._conns: Optional[Connections] = None  # the current set: one connection per replica
        self._stream_ids = itertools.count(1)  # the streams of both sets of connections
        self._client_id = uuid.uuid4().hex  # all this loader's connections: one client to the services
        self._epoch = 0
        self._origin = 0  # where this epoch's plan begins in its global order (a resume's position)
        self._next_batch = 0  # batches taken of that plan
        self._saved_shape: Optional[tuple] = None  # (world_size, batch_size) of a loaded state, for the log
        self._saved_identity: Optional[tuple] = None  # (length, fingerprint) a loaded state was taken on
        self._fingerprint: Optional[str] = None
        self._epoch_set = False  # set_epoch since the last iteration: no auto-advance (see __iter__)
        self._resume = False  # the next iteration resumes at a cursor from load_state_dict
        self._pending_epoch: Optional[int] = None  # set_epoch during an epoch: for the next iteration
        self._live: Optional["weakref.ref"] = None  # the _Pass of the epoch in progress
        self._iter_lock = threading.Lock()
        self._dataset_length: Optional[int] = None
        self._stats = LoaderStats()
        self._lookahead = Lookahead(self.config.timeout, self._stats)
        self._closed = False

    # ------------------------------------------------------------------ DataLoader-like API
    def __len__(self) -> int:
        """Batches per epoch for this rank (a whole epoch, also while one resumes part-way)."""
        if self._dataset_length is None:
            self._describe()
        return self._batches(0) * self.config.echo

    def batches_left(self) -> int:
        """Batches this rank still gets in the epoch at the cursor: ``len(self)`` before an epoch
        starts, the rest of the epoch after :meth:`load_state_dict` (shared at this loader's
        world size and batch size), 0 once the epoch is complete."""
        if self._dataset_length is None:
            self._describe()
        total = self._batches(self._origin)
        return (total - min(self._next_batch, total)) * self.config.echo

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration serves (as with DistributedSampler). Called while
        an epoch is being iterated, it applies to the next iteration (the cursor, and so
        :meth:`state_dict`, stay on the epoch in progress)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        with self._iter_lock:
            if self._live_pass() is not None:
                self._pending_epoch = epoch
                return
            self._select_epoch(epoch)

    def _select_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            # another epoch from its start; a loaded cursor in the same epoch is kept (resume)
            self._epoch, self._origin, self._next_batch, self._resume = epoch, 0, 0, False
        self._epoch_set = True

    def __iter__(self) -> Iterator[Batch]:
        """One epoch, DataLoader-style: the current epoch from its first batch, except the first
        iteration after :meth:`load_state_dict`, which resumes at the loaded cursor. Iterating
        again without :meth:`set_epoch` once an epoch is complete starts the next one.

        As with a DataLoader, a new ``iter()`` ends this loader's previous iterator if it was
        made in the same thread (a ``break``, a peek, a framework's ``limit_*_batches`` or
        sanity check): its streams are told to end, and using it afterwards is an error that
        says so. An iterator made in another thread that is still alive is not taken from it:
        a second consumer is refused at once (use one loader per consumer)."""
        if self._closed:
            raise RuntimeError("this RemoteLoader is closed")
        with self._iter_lock:
            self._end_live_pass("iter()")
            if self._dataset_length is None:
                self._describe()
            if self._pending_epoch is not None:
                self._select_epoch(self._pending_epoch)
                self._pending_epoch = None
            resume, self._resume = self._resume, False  # a loaded cursor is resumed once
            if not self._epoch_set and self._next_batch >= self._batches(self._origin):
                self._epoch, self._origin, self._next_batch = self._epoch + 1, 0, 0
            elif not resume:
                self._origin = self._next_batch = 0  # an epoch left part-way (a peek, a break) starts again
            elif self._saved_shape is not None:
                self._say_reshard()
            self._epoch_set = False
            started: dict = {}  # the pass's EpochRun, once its streams start
            gen = self._iterate(self._epoch, self._origin, self._next_batch, started)
            live = _Pass(gen, started, threading.current_thread(), self._epoch, resumed=resume)
            self._live = weakref.ref(live)
            return live

    def _end_live_pass(self, by: str) -> None:
        """End the live pass of this loader, if any, for ``by`` (a new ``iter()``, a
        ``load_state_dict``) the way a DataLoader's new iterator replaces the old one: a pass
        taken to its last batch (Lightning's fetcher stops at ``len()`` and never asks for the
        StopIteration) from any thread, any other from its own thread or once that thread is
        gone. A pass another live thread still uses is refused, naming the thread."""
        live = self._live_pass()
        if live is None:
            return
        taken = self._dataset_length is not None and self._next_batch >= self._batches(self._origin)
        here = threading.current_thread()
        if live.running or (not taken and live.thread is not here and live.thread.is_alive()):
            raise RuntimeError(
                f"this RemoteLoader already has a live iterator, made in thread {live.thread.name!r}, which is "
                f"{'in next() right now' if live.running else 'still running'}: {by} from thread {here.name!r} "
                "cannot take it over. Finish that iterator (or leave its loop) in its own thread first, or use "
                "one loader per consumer. (In the thread that made it, a new iter() ends it, as with a DataLoader.)")
        if not taken:
            total = self._batches(self._origin)
            (log.warning if live.resumed else log.debug)(
                "%s ends this loader's iterator of epoch %d after %d of its %d batches%s", by, live.epoch,
                self._next_batch, total, " (the resumed epoch: the rest of it is not trained on in this pass; the "
                "next iter() starts the epoch again from its first batch)" if live.resumed else
                " (a break, a peek or a framework's batch limit); the next pass starts the epoch again")
        try:
            live.end(finished=taken)
        except ValueError:  # it entered next() in another thread just now
            raise RuntimeError(f"this RemoteLoader already has a live iterator, in next() in thread "
                               f"{live.thread.name!r} right now: {by} cannot take it over; use one loader per "
                               "consumer") from None

    def _live_pass(self) -> Optional["_Pass"]:
        live = self._live() if self._live is not None else None
        return live if live is not None and live.alive else None

    def state_dict(self) -> dict:
        """The job's position: where the next iteration starts, the same on every rank at the same
        step, so any rank's copy resumes the whole job. Small, JSON-friendly."""
        c = self.config
        order = {k: getattr(c.spec, k) for k in _ORDER_KEYS}
        return {"version": STATE_VERSION, "epoch": self._epoch, "position": self._position(),
                **{k: v for k, v in order.items() if k not in _LATER_KEYS or v != _LATER_KEYS[k]},
                **dict(zip(("dataset_length", "fingerprint"), self._identity())),
                "world_size": c.spec.world_size, "batch_size": c.spec.batch_size}  # the shape it was taken at

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict` on any rank of the job, at any world
        size and batch size): the next iteration serves exactly the rest of its epoch across this
        job's ranks. The settings that fix the epoch's order (seed, shuffle, shuffle_window, drop_last, dataset)
        must match this loader's, and the dataset must be the one the state was taken on; a
        state that is not well-formed is refused with the field named, before any connection."""
        state = _checked_state(state)
        c = self.config
        mismatched = {k: (state[k], getattr(c.spec, k)) for k in _ORDER_KEYS if state[k] != getattr(c.spec, k)}
        if mismatched:
            detail = ", ".join(f"{k}: saved {a!r} vs loader {b!r}" for k, (a, b) in mismatched.items())
            raise ValueError(f"loader state does not match this loader's plan ({detail})")
        with self._iter_lock:
            self._end_live_pass("load_state_dict()")  # the loaded cursor is the next pass's
            step = c.spec.batch_size * c.spec.world_size
            if state["position"] % step == 0:  # on a step of this shape: the whole epoch's plan, from that batch
                self._origin, self._next_batch = 0, state["position"] // step
            else:  # between steps of this shape (it changed): a plan of the rest of the epoch
                self._origin, self._next_batch = state["position"], 0
            self._epoch = state["epoch"]
            self._resume, self._pending_epoch = True, None
            saved = (state["world_size"], state["batch_size"])
            self._saved_shape = saved if saved != (c.spec.world_size, c.spec.batch_size) else None
            self._saved_identity = ((state["dataset_length"], state["fingerprint"])
                                    if state["dataset_length"] is not None else None)
            if self._dataset_length is not None:
                self._check_saved_identity()
        if "lightning.pytorch" in sys.modules:  # Lightning's fit loop may be the caller: see client.lightning
            from client.lightning import ensure_elastic_resume

            ensure_elastic_resume(self)

    def replicas(self) -> List[str]:
        """The service replicas this loader streams from now (a followed name's addresses as
        last resolved; those that drain included), in the order it joined them."""
        if self._conns is None:
            return self._fleet.membership.active()
        return [r.endpoint for r in self._conns.replicas]

    def quarantined(self) -> Dict[str, str]:
        """The replicas this loader refuses because they serve other data than its epochs were
        planned on (a rolling update that changes the data, a pod on the wrong volume): endpoint
        -> why. They stay in :meth:`replicas` (the name still lists them) but get no batch."""
        return self._conns.quarantined() if self._conns is not None else {}

    def stats(self) -> dict:
        """Counters since creation: batches, samples, bytes, wait_s (stall), h2d_s, restarts,
        quarantined (replicas refused for serving other data), local_batches (received from a
        co-located service's shared memory rather than the socket)."""
        return asdict(self._stats)

    def close(self) -> None:
        """Tell the services we are leaving and release the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._conns is not None:
            self._conns.close()
            self._conns = None
        self._lookahead.close()
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
    def _batches(self, origin: int) -> int:
        """Batches per rank of this epoch's plan from ``origin``."""
        c = self.config
        assert self._dataset_length is not None
        origin = min(origin, self._dataset_length)  # a version-1 state's position may pass the end
        return num_batches(self._dataset_length, c.spec.batch_size, c.spec.world_size, c.spec.drop_last, origin)

    def _position(self) -> int:
        """The job's position in the epoch's global order: where the next iteration starts."""
        c = self.config
        if self._dataset_length is None:  # nothing described yet: nothing taken since a load
            return self._origin + self._next_batch * c.spec.batch_size * c.spec.world_size
        origin = min(self._origin, self._dataset_length)
        steps = min(self._next_batch, self._batches(origin))
        return position(self._dataset_length, c.spec.batch_size, c.spec.world_size, c.spec.drop_last, origin, steps)

    def _identity(self) -> tuple:
        """(length, fingerprint) of the dataset: as described, else as a loaded state says, else unknown."""
        if self._dataset_length is not None:
            return self._dataset_length, self._fingerprint
        return self._saved_identity or (None, None)

    def _say_reshard(self) -> None:
        """One line when a resume changes the job's shape: how the rest of the epoch is shared now."""
        c, (world, batch) = self.config, self._saved_shape
        assert self._dataset_length is not None
        # the position, not the plan's origin: a saved position on a step of the new shape resumes
        # the whole epoch's plan from a later batch, with its origin at 0
        at = self._position()
        log.warning("resuming epoch %d at sample %d of %d, saved at world size %d x batch %d, now %d x %d: the "
                    "remaining %d samples are shared by %d ranks, %d batches each (a loop that counts this epoch's "
                    "batches itself must count these: batches_left(); under Lightning the loader sees to it)",
                    self._epoch, at, self._dataset_length, world, batch, c.spec.world_size, c.spec.batch_size,
                    self._dataset_length - at, c.spec.world_size, self.batches_left())
        self._saved_shape = None

    def _iterate(self, epoch: int, origin: int, start: int, started: dict) -> Iterator[Batch]:
        """One epoch from ``origin`` in its global order and batch ``start`` of that plan, in
        plan order (:class:`~client.epoch.EpochRun`): the epoch streaming ahead if it is this
        one from its start, else new streams on the current set of connections. The run is put
        in ``started["run"]`` once it exists (for the pass to end it)."""
        if self._dataset_length is None:
            self._describe()
        origin = min(origin, self._dataset_length)
        total = self._batches(origin)
        conns = self._connect()
        self._fleet.follow(conns, time.monotonic())  # who joined or left since the last epoch
        adopted = self._lookahead.adopt(conns, epoch, start, total, self._sink, origin)
        if adopted is not None:
            self._conns, flow = adopted
        elif start >= total:
            return
        else:
            flow = conns.start_epoch(epoch, start, total, origin=origin, entry=self._position())
        run = EpochRun(self._conns, flow, self._sink, self.config, self._stats, epoch,
                       self._lookahead if self.config.epoch_lookahead else None, fleet=self._fleet)
        started["run"] = run
        try:
            while True:  # no local name for the batch: one held in place goes back once the trainer lets go
                try:
                    taken = [next(run)]  # a list emptied by the yield: the frame keeps no reference
                except StopIteration:
                    break
                self._next_batch = flow.next_yield
                yield taken.pop()
        finally:
            run.close()

    @property
    def _ahead(self) -> Optional[Lookahead]:
        """The epoch lookahead while an epoch streams ahead, else None."""
        return self._lookahead if self._lookahead.flow is not None else None

    def _describe(self) -> None:
        """Learn the dataset's length and identity from whichever replica answers first; from then
        on every service must serve that very dataset."""
        conns = self._connect()
        endpoint, info = conns.describe(self._sink)
        if self.config.spec.pipeline and self._sink is None:
            self._use_outputs(endpoint, info.outputs)
        self._dataset_length, self._fingerprint = info.length, info.fingerprint
        self._conns.identity = (info.length, info.fingerprint, info.decoding)
        self._check_saved_identity()

    def _check_saved_identity(self) -> None:
        """A loaded state was taken on this very dataset (a state from another dataset, or from this
        folder before files changed, would resume a plan over other samples)."""
        c, n = self.config, self._dataset_length
        step = c.spec.batch_size * c.spec.world_size
        if self._resume and self._origin + self._next_batch * step >= n + step:  # a version-1 state, unchecked so far
            self._resume = False
            raise LoaderError(P.ErrorCode.BAD_JOB, f"the loaded state's position, sample "
                              f"{self._origin + self._next_batch * step}, is past the end of the epoch ({n} samples)")
        saved, now = self._saved_identity, (n, self._fingerprint)
        if saved is None or saved == now:
            return
        self._saved_identity = None  # said once; a new state is loaded, or a new loader made
        raise LoaderError(P.ErrorCode.DATASET_CHANGED, describe_change(
            "the service", self.config.spec.dataset or "(its default)", now, saved, "the loaded state was taken on"))

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
            self._conns.close()
            self._conns = self._open_connections()

    def _size_window(self, replicas: int) -> None:
        """Batches this rank may have asked for or hold (received, in the device sink) at once:
        ``prefetch`` per replica; any one replica may be asked for all of them if it is the one
        that delivers soonest, and replicas that join later share them."""
        self._window = self.config.prefetch * max(replicas, self.config.expect_replicas, 1)
        if not self.config.spec.pipeline:
            self._sink = make_sink(self.config, self._window)

    def _connect(self) -> Connections:
        if self._conns is None:
            if self._closed:
                raise RuntimeError("this RemoteLoader is closed")
            first = self._fleet.first(self.config.timeout)
            if not self._window:
                self._size_window(len(first))
            self._ctx = zmq.Context(1)
            self._conns = self._open_connections()
        return self._conns

    def _open_connections(self) -> Connections:
        """One connection per replica (the lookahead's spare set is a twin of this one)."""
        assert self._ctx is not None
        return Connections(self._ctx, self._fleet.membership.active(), self.config, curve=self._curve,
                           frame_cap=self._frame_cap,
                           window=self._window, client_id=self._client_id, stream_ids=self._stream_ids,
                           stats=self._stats)


class _Pass:
    """One pass over an epoch: what ``iter(loader)`` returns. It ends when its epoch does, or
    when its loader ends it (:meth:`RemoteLoader._end_live_pass`); ended part-way, using it is
    an error that says why, never a silently short epoch."""

    def __init__(self, gen: Iterator[Batch], started: dict, thread: threading.Thread, epoch: int, resumed: bool):
        self._gen, self._started = gen, started
        self.thread, self.epoch, self.resumed = thread, epoch, resumed  # made in thread, serving epoch
        self._ended_part_way = False

    def __iter__(self) -> "_Pass":
        return self

    def __next__(self) -> Batch:
        if self._ended_part_way:
            raise RuntimeError(f"this iterator of epoch {self.epoch} was ended part-way by a later iter() or "
                               "load_state_dict() on its RemoteLoader, which starts a new pass (as a DataLoader's "
                               "new iterator does): iterate the newest one")
        return next(self._gen)

    @property
    def alive(self) -> bool:
        """Not ended: it may yield again (or owes its consumer a StopIteration)."""
        return self._gen.gi_frame is not None

    @property
    def running(self) -> bool:
        """In ``next()`` right now (in its thread)."""
        return self._gen.gi_running

    def end(self, finished: bool) -> None:
        """End it; ``finished``: every batch of its epoch was taken (what is left of it is the
        StopIteration). Each service is told its stream asks for nothing more, so the batches
        it was asked for are its last and its batch slots go back; then the run's memory is
        released. Raises ValueError if it is in ``next()`` in another thread."""
        if self.running:
            raise ValueError("generator already executing")
        run = self._started.get("run")
        if run is not None:
            run.end_streams()
        self._ended_part_way = not finished
        self._gen.close()


def default_job(spec: Optional[JobSpec] = None) -> str:
    """The job name a loader uses when given none: the launcher's id of this training, so that
    the ranks of one training share it and unrelated trainings on one service never do:
    ``TORCHELASTIC_RUN_ID`` (torchrun), else ``MASTER_ADDR:MASTER_PORT``; empty (no job rules)
    outside a launcher. With ``spec`` (the loader's :class:`JobSpec`), followed by what tells
    this loader from the others of its rank: ``/train-<digest>`` or ``/eval-<digest>``, a digest
    of every field of the spec (what the service compares across a job's ranks), so a training
    loader and a validation loader in one rank are two jobs, while every rank of one loader
    (same settings) derives the same name."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        launcher = f"torchelastic:{run_id}"
    else:
        addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        launcher = f"{addr}:{port}" if addr and port else ""
    if not launcher or spec is None:
        return launcher[:256]
    suffix = f"/{'train' if spec.train else 'eval'}-{spec_digest(spec)}"
    return launcher[:256 - len(suffix)] + suffix


def spec_digest(spec: JobSpec) -> str:
    """12 hex digits that differ between any two specs the service would tell apart (every field;
    ``scale``/``ratio`` as floats, ``pipeline_args`` by value), the same in every process."""
    fields = spec.on(spec.dataset).as_dict()
    try:
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=_plain)
    except TypeError:  # a nested map with keys of mixed types (msgpack allows them): in the order given
        text = repr(fields)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _plain(value: object) -> object:
    """A JSON stand-in for what a pipeline argument may hold beyond JSON (bytes, tuples in msgpack)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(value).hex()}
    return repr(value)


def resolve_endpoints(endpoint: str) -> List[str]:
    """``tcp://name:port`` -> one endpoint per address the name resolves to now, sorted so every
    rank lists the replicas in the same order. (A RemoteLoader given the name itself follows it
    during the run instead.)"""
    import socket

    from client.names import endpoint_of, host_port

    host, port = host_port(endpoint)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [endpoint_of(a, port) for a in sorted({i[4][0] for i in infos})]


def _checked_state(state: object) -> dict:
    """``state`` as a version-2 dict, every field checked (a version-1 state is converted); a
    ``ValueError`` naming the field otherwise."""
    if not isinstance(state, dict):
        raise ValueError(f"a loader state is a dict (from RemoteLoader.state_dict()), got {type(state).__name__}")
    version = state.get("version")
    if version == 1:
        state = _from_version_1(state)
    elif version != STATE_VERSION:
        raise ValueError(f"unsupported loader state version {version!r} (this loader reads 1 and {STATE_VERSION})")
    state = {**_LATER_KEYS, **state}
    fields = {"epoch": int, "position": int, "seed": int, "shuffle": bool, "drop_last": bool,
              "dataset": (str, type(None)), "dataset_length": (int, type(None)), "fingerprint": (str, type(None)),
              "world_size": int, "batch_size": int, "shuffle_window": int}
    for name, kind in fields.items():
        if name not in state:
            raise ValueError(f"loader state: missing {name!r}")
        value = state[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"loader state: {name} must be {getattr(kind, '__name__', 'a str or None')}, "
                             f"got {type(value).__name__} {value!r}"[:200])
    for name, lo in (("epoch", 0), ("position", 0), ("world_size", 1), ("batch_size", 1), ("shuffle_window", 0)):
        if state[name] < lo:
            raise ValueError(f"loader state: {name} must be >= {lo}, got {state[name]}")
    if state["dataset_length"] is not None:
        if state["dataset_length"] < 1:
            raise ValueError(f"loader state: dataset_length must be >= 1, got {state['dataset_length']}")
        if state["position"] > state["dataset_length"]:
            raise ValueError(f"loader state: position {state['position']} is past the end of the epoch "
                             f"({state['dataset_length']} samples)")
    return state


def _from_version_1(state: dict) -> dict:
    """A version-1 state (one rank's next batch, before the elastic resume) as a position: every
    rank was at the same step, so the job's position is next_batch x batch_size x world_size. It
    holds no dataset identity, which is then not checked."""
    need = ("epoch", "next_batch", "world_size", "batch_size", "seed", "shuffle", "drop_last", "dataset")
    missing = [k for k in need if k not in state]
    if missing:
        raise ValueError(f"loader state (version 1): missing {missing[0]!r}")
    for k in ("next_batch", "world_size", "batch_size"):
        if not isinstance(state[k], int) or isinstance(state[k], bool) or state[k] < (1 if k != "next_batch" else 0):
            raise ValueError(f"loader state (version 1): {k} must be a positive int, got {state[k]!r}"[:200])
    log.info("reading a version-1 loader state: position = next_batch x batch_size x world_size; it carries no "
             "dataset identity, so none is checked")
    out = {k: state[k] for k in need if k != "next_batch"}
    out.update(version=STATE_VERSION, position=state["next_batch"] * state["batch_size"] * state["world_size"],
               dataset_length=None, fingerprint=None)
    return out


__all__ = ["RemoteLoader", "LoaderStats", "default_job", "resolve_endpoints", "spec_digest"]


"""One connection per service replica, as a set: the loader's current set, or the spare set its
epoch lookahead streams on.

What every stage reads and sends through: :meth:`Connections.recv` (one message; a batch's
frames go straight into the sink's host memory), :meth:`~Connections.hello` and
:meth:`~Connections.start_epoch` (new streams), :meth:`~Connections.poll` (every socket and
connection monitor of the set), and the checks that every wait shares: a connection cut for
breaking the protocol, and a timeout that says why nothing came.

Two of a replica's messages change its part in the running epoch at once, here:

* a **shutting-down notice** (the service got SIGTERM; its last message, after the batches it was
  still sending): the replica drains, so what it owes is asked of the others at once and nothing
  new goes to it until its connection comes back (a new process), never ``replica_timeout`` later;
* a **dataset that is not the loader's** (another replica's copy, a rolling update that changed
  the data): the replica is **quarantined**, named once (WARNING) and kept in
  :meth:`Connections.quarantined` with the reason, its batches asked of the others; only when no
  replica that serves the loader's dataset remains is it fatal (``replica_mismatch``, or
  ``dataset_changed`` when the one service the loader had changed).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Dict, List, Optional, Set, Tuple

import zmq

from wire import protocol as P

from client.config import LoaderConfig
from client import local
from client.curve import ClientKeys
from client.errors import LoaderError, LoaderTimeout
from client.flow import EpochFlow
from client.lanes import Lanes, LanesLost
from client.replica import Replica
from client.sinks import lends_in_place
from client.stats import LoaderStats

log = logging.getLogger("client")

# (length, fingerprint, decoding): a dataset, and how a service makes its samples bytes
Identity = Tuple[int, str, str]
DESCRIBE_GRACE_S = 1.0  # after the first replica describes the dataset, how long the others may take

class Connections:
    """A connection to each of ``endpoints`` (:class:`~client.replica.Replica`, each with an
    ``index`` never reused in this set), all on behalf of the one loader ``client_id``. Replicas
    join and leave the set during a run (:mod:`client.fleet`)."""

    def __init__(self, ctx: zmq.Context, endpoints: List[str], config: LoaderConfig, *, curve: Optional[ClientKeys],
                 frame_cap: int, window: int, client_id: str, stream_ids: "itertools.count", stats: LoaderStats):
        """``frame_cap``: the largest frame a peer may send; ``window``: batches the loader may
        have asked for or hold at once; ``stream_ids``: the loader's stream numbers, shared by
        its sets; ``stats``: where received bytes are counted."""
        self.config, self.frame_cap, self.window = config, frame_cap, window
        # (length, fingerprint, decoding): the dataset the loader follows, and how its samples become bytes
        self.identity: Optional[Identity] = None
        self.origin = 0  # where the plan of the epoch streaming on this set begins (an elastic resume)
        self.entry = 0  # where the loader's run of that epoch began: what the job's ranks must agree on
        self._ctx, self._curve = ctx, curve
        self._client_id, self._stream_ids, self._stats = client_id, stream_ids, stats
        self._ids = itertools.count()
        self._poller = zmq.Poller()
        self.flow: Optional[EpochFlow] = None  # the epoch streaming on this set (start_epoch)
        # that epoch was started ahead (the lookahead) and no run has waited on this set since
        # (a run's waits poll it; the lookahead's adoption reads each replica alone)
        self.ahead = False
        # endpoint -> why its service is refused, shared with the twin set; the (endpoint,
        # identity) pairs already named in the log, so each is named once
        self.refused: Dict[str, str] = {}
        # endpoint -> its service's probe, read from here: its streams are co-located (config.local);
        # shared with the twin set
        self.colocated: Dict[str, str] = {}
        self._judged: Dict[str, str] = {}  # endpoint -> the probe last read for it, reachable or not; shared too
        self._named: Set[Tuple[str, Tuple[int, str]]] = set()
        self.replicas: List[Replica] = []
        for e in endpoints:
            self.join(e)

    @property
    def max_queued(self) -> int:
        """A service sends a connection at most ``window`` batches of its stream, plus as many of a
        stream being replaced and a few control messages: more can only come from a rogue peer.
        libzmq stops reading past it (backpressure, nothing dropped), and so many unusable batches
        in a row end the loader (client.epoch)."""
        return 2 * self.window + 16

    def join(self, endpoint: str) -> Replica:
        """Connect to one more replica."""
        r = Replica(self._ctx, endpoint, self.config.heartbeat_s, next(self._ids), self._curve, self.frame_cap,
                    self.max_queued)
        self._poller.register(r.sock, zmq.POLLIN)
        self._poller.register(r.monitor, zmq.POLLIN)
        self.replicas.append(r)
        return r

    def leave(self, r: Replica) -> None:
        """Close the connection to ``r`` (Bye frees its stream on the service) and forget it."""
        self._poller.unregister(r.sock)
        self._poller.unregister(r.monitor)
        self.replicas.remove(r)
        r.close()

    def find(self, endpoint: str) -> Optional[Replica]:
        return next((r for r in self.replicas if r.endpoint == endpoint), None)

    def twin(self) -> "Connections":
        """A second connection to each replica, on the same terms (the lookahead's spare set)."""
        twin = Connections(self._ctx, [r.endpoint for r in self.replicas], self.config, curve=self._curve,
                           frame_cap=self.frame_cap, window=self.window, client_id=self._client_id,
                           stream_ids=self._stream_ids, stats=self._stats)
        twin.identity, twin.refused, twin._named = self.identity, self.refused, self._named
        twin.colocated, twin._judged = self.colocated, self._judged
        return twin

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    # ------------------------------------------------------------------ streams
    def hello(self, r: Replica, epoch: int, batches: List[int], lookahead: bool = False) -> None:
        """Start a new on-demand stream on ``r``, asking for ``batches`` at once."""
        c = self.config
        stream = next(self._stream_ids)
        slots, r.borrowed.limit = self._slots(r)
        r.hello(stream, P.Hello(
            stream=stream, spec=c.spec, epoch=epoch, rank=c.rank, origin=self.origin, entry=self.entry,
            slots=slots, job=c.job, window=min(self.window, P.MAX_WINDOW),
            batches=list(batches), lookahead=lookahead, client=self._client_id,
            local=r.endpoint in self.colocated, heartbeat=c.heartbeat_s))

    def _slots(self, r: Replica) -> Tuple[int, int]:
        """(the slots ``r``'s streams ask for, the most batches of ``r`` lent in place at once):
        ``prefetch`` and none; for a co-located loader that takes batches in place two more slots
        (on the CPU for the batch its trainer uses and the one before it, still named while it asks
        for the next; on CUDA for batches whose copy is still reading them), and all of them but
        one lent at most (the rest are copied out, so the service always has a slot to work in)."""
        c = self.config
        if r.endpoint in self.colocated and lends_in_place(c):
            return c.prefetch + 2, c.prefetch + 1
        return c.prefetch, 0

    def start_epoch(self, epoch: int, start: int, total: int, lookahead: bool = False, origin: int = 0,
                    entry: int = 0) -> EpochFlow:
        """The flow control of ``epoch`` from batch ``start`` (of ``total``) over this set, with a
        new stream on each replica asking at once for what the flow assigns it. ``origin``: the
        epoch's plan begins there in the global order (a resume), so batch 0 is the first after it;
        ``entry``: the job's position where this run of the epoch begins."""
        self.origin, self.entry = origin, entry
        flow = EpochFlow(start, total, self.window, self.window, [r.index for r in self.replicas])
        # a quarantined replica is asked for nothing up front: its stream's Accept says whether
        # it serves the loader's dataset again (then it takes batches on demand); nor is one that
        # said it shuts down and has not come back (its record may stay listed)
        initial = flow.assign((r.index for r in self.replicas
                               if not r.draining and not r.refused and r.shutdown_at is None), time.monotonic())
        for r in self.replicas:
            r.dead = False
            self.hello(r, epoch, initial.get(r.index, []), lookahead=lookahead)
        self.flow, self.ahead = flow, lookahead
        return flow

    def healthy(self) -> bool:
        """Every replica is connected, none was given up on, quarantined, or drains."""
        return not any(r.dead or r.draining or r.refused or r.down_since is not None for r in self.replicas)

    def quarantined(self) -> Dict[str, str]:
        """The replicas refused for serving other data than the loader's: endpoint -> why."""
        return {r.endpoint: r.refused for r in self.replicas if r.refused}

    # ------------------------------------------------------------------ receiving
    def send_releases(self, waiting: bool = False) -> None:
        """Hand back the batches held in place (co-located) that the trainer let go of.
        ``waiting``: a run's wait for its next batch, which ends in a Request (or in these Releases
        sent then): a replica's current stream keeps its own while its slots need none of them
        (:meth:`Replica.send_releases`)."""
        flow = self.flow if waiting else None
        for r in self.replicas:
            if r.borrowed.back:  # several times per batch, mostly with nothing let go of
                r.send_releases(None if flow is None else len(flow.outstanding.get(r.index, ())))

    def poll(self, timeout_ms: float, waiting: bool = False) -> List[Tuple[Replica, bool, bool]]:
        """Wait up to ``timeout_ms`` for anything on the set: ``(replica, connection event,
        message)`` for each replica with either, in replica order; empty if nothing came.
        ``waiting``: see :meth:`send_releases`."""
        self.ahead = False  # a run waits on this set: its epoch is the trainer's now
        self.send_releases(waiting)
        events = dict(self._poller.poll(timeout_ms))
        return [(r, r.monitor in events, r.sock in events) for r in self.replicas
                if r.monitor in events or r.sock in events]

    def recv(self, r: Replica, sink):
        """One message from ``r``: (message, payload), or (None, None) for a stale one. A
        batch's data frames are received by ``sink`` into host memory (the payload).

        Raises LoaderError for the service's errors except the recoverable ones.
        """
        # bytes: a zmq.Frame costs more than this copy of a small header; zmq.Again if nothing waits
        header = r.sock.recv(zmq.NOBLOCK)
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
            try:
                payload = sink.receive(r.sock, msg, r.borrowed, r.lanes)
            except (LanesLost, local.SlotsGone):
                r.drain()
                raise
            if msg.local:
                self._stats.local_batches += 1
                if not r.borrowed.holds(msg.stream, msg.index):  # copied out: hand it back now
                    r.send(P.Release(stream=msg.stream, batches=[msg.index]))
            self._stats.bytes += msg.image_bytes
            return msg, payload  # (one per batch: none of the checks below is for a Batch)
        r.drain()
        if isinstance(msg, P.EndOfEpoch):
            return None, None  # the stream we ended with a final Request is done
        if isinstance(msg, (P.Accept, P.DatasetInfo)) and not self._check_identity(r, msg):
            return None, None  # quarantined: its stream's batches are stale from now on
        if isinstance(msg, P.Accept):  # (a replica that joined without a Describe, or came back elsewhere)
            r.served_by(msg.service)
            self._colocate(r, msg.probe)
        if isinstance(msg, P.Accept) and msg.lanes and self.config.lanes:
            if r.lanes is not None and r.lanes.failed:  # while no batch was on them (a cut; a restart not yet seen)
                r.drop_lanes(r.lanes.failed)
            if r.lanes is None and not r.lanes_off:
                self._open_lanes(r, msg.lanes)
        if isinstance(msg, P.Error):
            if msg.code == P.ErrorCode.SHUTTING_DOWN:  # the reconnect that follows restarts the stream
                r.shutdown_at, r.shutdown_wall = time.monotonic(), time.time()  # said if it never comes back
                self._stopping(r)
                return None, None
            if msg.code != P.ErrorCode.UNKNOWN_CLIENT:
                raise LoaderError(msg.code, f"{msg.message} (from {r.endpoint})" if len(self.replicas) > 1
                                  else msg.message, msg.traceback)
        return msg, payload

    def _open_lanes(self, r: Replica, port: int) -> None:
        """Open ``config.lanes`` bulk lanes to ``r``'s service, on ``port`` of its host; where they
        cannot be opened (a firewall lets the data port alone through, say) the loader goes on
        without, and says why once."""
        if r.endpoint in self.colocated:
            return  # its batches are handed over in place: nothing to carry
        host = r.endpoint.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
        try:
            # the buffers worth keeping: the window's batches and the two the trainer and the sink hold;
            # on a GPU, page-locked, and also those whose copy to the device may not have run yet
            gpu = self.config.device.startswith("cuda")
            keep = self.window + 2 + (self.config.device_prefetch if gpu else 0)
            r.lanes = Lanes(host, port, r.identity, self.config.lanes, self.frame_cap, self.max_queued, keep,
                            pinned=gpu)
        except OSError as exc:
            r.lanes_off = f"cannot open bulk lanes to {host}:{port}: {exc}"
            log.warning("service replica %s: %s; its batches come in data frames", r.endpoint, r.lanes_off)
            return
        log.info("service replica %s: %d bulk lanes open on port %d", r.endpoint, self.config.lanes, port)

    def _usable(self, r: Replica) -> bool:
        """``r`` may take this epoch's batches now (what :class:`~client.epoch.EpochRun` asks of)."""
        return not r.dead and not r.draining and not r.refused and r.down_since is None

    def _stopping(self, r: Replica, again: bool = False) -> None:
        """``r``'s service said it is shutting down (after the batches it was still sending, so
        every one of them is here): what it still owes is asked of the others at once, and it
        takes nothing new until its connection comes back (a new process restarts the stream). A
        lone replica is waited for instead, up to the timeout, or until another can take them
        (:meth:`drain_announced`; ``again``: that look, which says nothing when none can)."""
        flow = self.flow
        if r.dead or flow is None or r.index not in flow.outstanding:
            return
        others = [x for x in self.replicas if x is not r and self._usable(x)]
        if not others:
            if not again:
                log.info("service replica %s is shutting down; no other replica takes its batches, so the loader "
                         "waits for it to come back (up to its timeout)", r.endpoint)
            return
        orphans = flow.lose(r.index)
        r.dead = True
        log.warning("service replica %s is shutting down; it drains: its %d batches%s go to %s", r.endpoint,
                    len(orphans), _listed(orphans), ", ".join(x.endpoint for x in others))

    def drain_announced(self) -> None:
        """A replica can take batches again (it came back): those that said they shut down while
        no other could take what they owe drain to it now. (Their notice and its return may be
        read in either order, as when both came while the trainer did not iterate.)"""
        for r in self.replicas:
            if r.shutdown_at is not None:
                self._stopping(r, again=True)

    def _check_identity(self, r: Replica, msg) -> bool:
        """Whether ``r``'s service serves the dataset this loader's epochs were planned on. One that
        serves another (restarted on a changed folder, another replica's copy) is never mixed in:
        it is quarantined while replicas that serve the loader's remain, else refused for good."""
        length = msg.dataset_length if isinstance(msg, P.Accept) else msg.length
        got = (length, msg.fingerprint, msg.decoding)
        if self.identity is None or got == self.identity:
            if r.refused:
                log.warning("service replica %s serves this loader's dataset again; it takes batches again",
                            r.endpoint)
                r.refused = ""
                self.refused.pop(r.endpoint, None)
            return True
        if got[:2] == self.identity[:2] and not any(x is not r and not x.refused for x in self.replicas):
            # the same dataset decoded otherwise, and no replica decodes it the old way any more (a
            # service restarted with other decode settings, the last of a rolling update): the plan
            # holds, so the loader follows it, and says so
            log.warning("service replica %s decodes the dataset otherwise now (decoding %s, was %s: other decode "
                        "settings or pipeline code); the loader follows it", r.endpoint, got[2], self.identity[2])
            self.identity = got
            return True
        if len(self.replicas) == 1:  # the one service this loader had changed
            raise LoaderError(P.ErrorCode.DATASET_CHANGED, describe_change(
                f"the service at {r.endpoint}", msg.dataset, got[:2], self.identity[:2],
                "this loader's epochs were planned on"))
        if self.ahead:  # the lookahead gives its epoch up (it starts plainly, where the replica is quarantined)
            raise LoaderError(P.ErrorCode.REPLICA_MISMATCH, f"{r.endpoint} serves {msg.dataset!r} with {length} "
                              f"samples (fingerprint {msg.fingerprint}), not this loader's dataset")
        self._quarantine(r, msg.dataset, got, self.identity)
        good = [x for x in self.replicas if not x.refused]
        if not good:
            raise LoaderError(P.ErrorCode.REPLICA_MISMATCH, (
                "no replica serves the dataset this loader's epochs were planned on: "
                + "; ".join(f"{x.endpoint} {x.refused}" for x in self.replicas)
                + ". Samples would be missed or doubled, so none is used: deploy every replica on the same data, "
                  "or start a new loader (a new epoch) on the new one"))
        flow = self.flow
        if flow is not None and r.index in flow.outstanding:
            flow.lose(r.index)
        if r.stream >= 0 and isinstance(msg, P.Accept):
            r.request([], self._stats.batches, final=True)  # its stream sends what it was asked, then ends
        r.stream, r.accepted, r.dead = -1, False, True  # what that stream still sends is stale
        return False

    def _quarantine(self, r: Replica, dataset: str, got: Identity, identity: Identity) -> None:
        """Refuse ``r``, whose service serves ``got`` (length, fingerprint, decoding) instead of ``identity``:
        its reason kept, and said once per (replica, dataset) with who serves on."""
        r.refused = self.refused[r.endpoint] = refusal(dataset, got, identity)
        good = [x for x in self.replicas if not x.refused]
        if good and (r.endpoint, got) not in self._named:
            self._named.add((r.endpoint, got))
            self._stats.quarantined += 1
            log.warning("service replica %s is quarantined: it %s; the epoch goes on with %s (do all replicas "
                        "serve the same dataset? a rolling update that changes the data mixes two)", r.endpoint,
                        r.refused, ", ".join(x.endpoint for x in good))

    def describe(self, sink) -> Tuple[str, P.DatasetInfo]:
        """Ask every replica to describe the dataset; the answer the loader follows, and who gave
        it. That is the dataset most replicas serve, among those that answered within
        :data:`DESCRIBE_GRACE_S` of the first (a replica that is down does not hold the start up
        longer); the others are quarantined. Replicas split evenly between datasets are refused
        (``replica_mismatch``): which one is right is not the loader's to guess."""
        c = self.config
        describe = P.Describe(dataset=c.spec.dataset, pipeline=c.spec.pipeline, pipeline_args=c.spec.pipeline_args)
        for r in self.replicas:
            r.send(describe)
        deadline = time.monotonic() + c.timeout
        answers: Dict[int, Tuple[Replica, P.DatasetInfo]] = {}
        grace_end = float("inf")
        while True:
            now = time.monotonic()
            if answers and (len(answers) == len(self.replicas) or now >= grace_end):
                self._say_if_not_colocated([r for r, _ in answers.values()])
                return self._most_served(list(answers.values()))
            left = min([deadline, grace_end, *self.due_times()]) - now
            events = self.poll(max(0, left) * 1000) if left > 0 else []
            self.check_connections(time.monotonic())
            if not events and not answers and time.monotonic() >= deadline:
                self.raise_timeout()
            for r, changed, readable in events:
                if changed and r.on_monitor():
                    r.send(describe)
                if readable:
                    try:
                        msg, _ = self.recv(r, sink)
                    except zmq.Again:  # what the poll saw is gone: nothing to read (as in an epoch's wait)
                        continue
                    if isinstance(msg, P.DatasetInfo) and r.index not in answers:
                        answers[r.index] = (r, msg)
                        self._colocate(r, msg.probe)
                        grace_end = min(grace_end, time.monotonic() + DESCRIBE_GRACE_S)

    def _colocate(self, r: Replica, probe: str) -> None:
        """With ``config.local``: ``r``'s streams' batches are handed over in place if its probe is
        readable here. Read from each Describe's answer and each Accept (a replica that joined the
        fleet mid-run, a service restarted at the same endpoint on another host), once per probe."""
        if not self.config.local or self._judged.get(r.endpoint) == probe:
            return
        self._judged[r.endpoint] = probe
        if local.reachable(probe):
            if r.endpoint not in self.colocated:
                log.info("service replica %s shares this host's shared memory: its batches are handed over in place",
                         r.endpoint)
            self.colocated[r.endpoint] = probe
        elif self.colocated.pop(r.endpoint, None) is not None or probe:
            log.info("service replica %s: its shared memory is not reachable from here (probe %r); its batches "
                     "come over the socket", r.endpoint, probe)

    def misplaced(self, r: Replica) -> bool:
        """Whether ``r``'s current stream asked for the wrong hand-over, as its Accept just showed: in
        place from a service whose shared memory is out of reach, or over the socket from one that
        shares it. The stream is then asked again (a new Hello), before any of its batches is used."""
        return r.local != (r.endpoint in self.colocated)

    def _say_if_not_colocated(self, answered: List[Replica]) -> None:
        """``local=True`` that reaches no replica's shared memory is a set-up to mend, not a mode:
        said once, as a WARNING (a replica on another host among co-located ones is INFO above)."""
        if self.config.local and not any(r.endpoint in self.colocated for r in answered):
            log.warning("local=True, but the shared memory of no service replica that answered (%s) is reachable "
                        "from here: every batch comes over the socket. A container needs the service's IPC namespace "
                        "(Compose: docker-compose.colocated.yml; host networking does not share /dev/shm) and its "
                        "user (docs/deployment.md, \"Service and trainer on one host\")",
                        ", ".join(r.endpoint for r in answered))

    def _most_served(self, answers: List[Tuple[Replica, P.DatasetInfo]]) -> Tuple[str, P.DatasetInfo]:
        groups: Dict[Identity, List[Tuple[Replica, P.DatasetInfo]]] = {}
        for r, info in answers:
            groups.setdefault((info.length, info.fingerprint, info.decoding), []).append((r, info))
        ranked = sorted(groups.items(), key=lambda g: -len(g[1]))
        if len(ranked) > 1 and len(ranked[0][1]) == len(ranked[1][1]):
            raise LoaderError(P.ErrorCode.REPLICA_MISMATCH, (
                "the replicas serve different data and none is served by most of them: "
                + "; ".join(f"{r.endpoint} serves {info.dataset!r} with {info.length} samples (fingerprint "
                            f"{info.fingerprint}, decoding {info.decoding})" for r, info in answers)
                + ". Samples would be missed or doubled, or decoded two ways, so none is used: do all replicas serve "
                  "the same dataset? Deploy every replica on the same data, with the same --jpeg-fast-dct, "
                  "--jpeg-fast-upsample, --max-image-pixels and --pipeline"))
        identity, chosen = ranked[0]
        for got, members in ranked[1:]:
            for r, info in members:
                self._quarantine(r, info.dataset, got, identity)
        return chosen[0][0].endpoint, chosen[0][1]

    # ------------------------------------------------------------------ what every wait checks
    def due_times(self) -> List[float]:
        """When a connection's cut becomes certain or its retry is due: a wait wakes up then."""
        return [t for r in self.replicas if not r.dead for t in (r.cut_at(), r.retry_at) if t is not None]

    def check_connections(self, now: float) -> None:
        """Connect again where a retry is due; raise at once when every connection was cut for
        breaking the protocol after its handshake (a rogue ZeroMQ peer): waiting out the
        timeout would change nothing."""
        for r in self.replicas:
            r.tick(now)
        self._check_cut(now)

    def _check_cut(self, now: float) -> None:
        cut = [r for r in self.replicas if r.is_cut(now)]
        if cut and all(r.dead or r in cut for r in self.replicas):
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, (
                f"the connection to {', '.join(r.endpoint for r in cut)} was cut for breaking the protocol and is "
                f"not retried: a peer that sends a frame over this loader's cap of {self.frame_cap} "
                "bytes (this job's largest data frame + 1 MiB), or that breaks ZeroMQ's protocol after its "
                "handshake, is refused; is this endpoint a loader service?"))

    def raise_timeout(self) -> None:
        """Nothing came within the timeout: raise LoaderTimeout with the likeliest reason (and the
        replicas quarantined for serving other data, which were asked nothing)."""
        try:
            self._raise_timeout()
        except LoaderTimeout as exc:
            refused = self.quarantined()
            if not refused:
                raise
            raise LoaderTimeout(exc.message + "; not asked, as they serve other data: " + "; ".join(
                f"{e} {why}" for e, why in refused.items())) from None

    def _raise_timeout(self) -> None:
        c, reps = self.config, self.replicas
        down = [r for r in reps if r.down_since is not None]
        where = ", ".join(r.endpoint for r in reps)
        self._check_cut(float("inf"))  # a cut shorter than its grace still is one at the timeout
        tried = "; ".join(t for t in (r.attempts.summary() for r in reps) if t)
        if down and len(down) == len(reps) and any(r.was_connected for r in reps):
            ago = f"{time.monotonic() - min(r.down_since for r in down):.0f}s ago"
            told = [r for r in down if r.shutdown_at is not None]
            if told:
                r = told[0]
                at = time.strftime("%H:%M:%S", time.localtime(r.shutdown_wall))
                what = (f"the loader service at {r.endpoint} announced it was shutting down "
                        f"{time.monotonic() - r.shutdown_at:.0f}s ago (at {at}) and has not come back within "
                        f"{c.timeout:g}s")
            else:
                what = (f"lost the connection to the loader service at {where} {ago} and it has not come back "
                        f"within {c.timeout:g}s")
            raise LoaderTimeout(what + (f"; since then, {tried}" if tried else ""))
        if not any(r.was_connected for r in reps):
            if tried:
                raise LoaderTimeout(f"{tried}; no loader service answered within {c.timeout:g}s (a TCP proxy without "
                                    "a backend, a service still starting, or something else on that port?)")
            if any(r.reached for r in reps):
                raise LoaderTimeout(f"reached {where} but no ZeroMQ handshake completed within {c.timeout:g}s: "
                                    "something else listens there (the REST port? the data port is the service's "
                                    "--data-port, 5555 by default), or the service is stopped or stuck")
            raise LoaderTimeout(f"could not connect to the loader service at {where} within {c.timeout:g}s; is "
                                "it running and reachable? (start one with: loader-service serve --demo)")
        said = [progress_text(r) for r in reps if r.progress is not None]
        if said:
            raise LoaderTimeout(f"no batch for {c.timeout:g}s: " + "; ".join(said))
        raise LoaderTimeout(f"the loader service at {where} is connected but has answered nothing for "
                            f"{c.timeout:g}s (is its process stopped or stuck? its /healthz and log say more)")


def _listed(batches: List[int], most: int = 16) -> str:
    """`` (3, 4, 9)``: the batches named in a log line (the first ``most``), or ''."""
    if not batches:
        return ""
    more = f", ... {len(batches) - most} more" if len(batches) > most else ""
    return f" ({', '.join(map(str, batches[:most]))}{more})"


def refusal(dataset: str, got: Identity, identity: Identity) -> str:
    """Why a replica is not used: it serves another dataset, or decodes this one otherwise."""
    (n, fp, dec), (n0, fp0, dec0) = got, identity
    if (n, fp) == (n0, fp0):
        return (f"decodes {dataset!r} otherwise than the replicas this loader follows (decoding {dec}, not {dec0}: "
                "other --jpeg-fast-dct, --jpeg-fast-upsample, --max-image-pixels or --pipeline code), so its "
                "batches' bytes would differ")
    return (f"serves {dataset!r} with {n} samples (fingerprint {fp}), not the dataset this loader's epochs were "
            f"planned on ({n0} samples, fingerprint {fp0})")


def describe_change(who: str, dataset: str, now: Tuple[int, str], then: Tuple[int, str], planned: str) -> str:
    """Why a dataset is refused: what it is now, what it was, and what to do."""
    (n, fp), (n0, fp0) = now, then
    diff = f"{n - n0:+d} samples" if n != n0 else "as many samples, other files or sizes"
    return (f"the dataset changed: {who} serves {dataset!r} with {n} samples (fingerprint {fp}); {planned} {n0} "
            f"samples (fingerprint {fp0}): {diff}. Samples would be missed or doubled, so this is refused: "
            "restore the dataset, or start a new loader (a new epoch) on the changed one")


def progress_text(r: Replica) -> str:
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

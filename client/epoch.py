"""One epoch's run, in one direction: the replicas' transport (each batch received into host
memory as it comes, in any order) -> the ordering window (:class:`~client.flow.InOrder`: plan
order, ``device_prefetch`` ahead of the trainer) -> the device sink (copy, then hand-over as
``next()`` returns the batch) -> the trainer, each batch ``echo`` times.

The flow control (:class:`~client.flow.EpochFlow`) decides what to ask of which replica; this
module does the asking and the waiting. Every wait has a deadline: the loader's ``timeout``
since the last message from a service, a probe after ``PROBE_S`` (at most a third of the
timeout) of silence while batches are owed, and, with several replicas, ``replica_timeout``
before a replica that stays down loses its batches to the others.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Deque, Optional

import zmq

from wire import protocol as P

from client.batch import Batch
from client.config import LoaderConfig
from client.connections import Connections
from client.errors import LoaderError
from client.fleet import Fleet
from client.flow import EpochFlow, InOrder
from client.lanes import LanesLost
from client.local import SlotsGone
from client.lookahead import Lookahead
from client.replica import Replica
from client.stats import LoaderStats

log = logging.getLogger("client")

PROBE_S = 5.0  # silence, while batches are owed, after which the loader asks again


class EpochRun:
    """An iterator over one epoch's batches from ``flow.next_yield``, over the set ``conns``
    whose streams ``flow`` was started on. ``lookahead``: told (``start``) once every batch is
    asked for, to start the next epoch early; None: no lookahead. ``clock``: the one the
    replicas' connection states are stamped with. :meth:`close` ends the run (the loader calls
    it however the epoch ends)."""

    def __init__(self, conns: Connections, flow: EpochFlow, sink, config: LoaderConfig, stats: LoaderStats,
                 epoch: int, lookahead: Optional[Lookahead] = None, clock: Callable[[], float] = time.monotonic,
                 fleet: Optional[Fleet] = None):
        self.conns, self.flow, self.sink, self.config, self.stats = conns, flow, sink, config, stats
        self.epoch, self.lookahead, self._clock, self.fleet = epoch, lookahead, clock, fleet
        self.window = InOrder(flow.next_yield, config.device_prefetch)
        self._pushed: Deque[Batch] = deque()  # pushed to the sink (copy issued), not yet yielded
        self._heard = clock()  # the last message from a service
        self._probe_s = min(PROBE_S, config.timeout / 3)
        self._h2d_seen = sink.h2d_s
        self._repeat: Optional[Batch] = None  # the batch being echoed
        self._repeats = 0  # hand-overs of it still to come
        self._ended = False
        self._told_end = False  # each service was told its stream asks for nothing more

    def __iter__(self) -> "EpochRun":
        return self

    def __next__(self) -> Batch:
        if self._repeats:
            self._repeats -= 1
            return self.sink.hand_over(self._repeat)
        if self.flow.done or self._ended:
            self._finish()
            raise StopIteration
        batch = self._next_in_order()
        # kept only to echo it: a batch held in place is handed back once the trainer lets it go
        self._repeat, self._repeats = (batch if self.config.echo > 1 else None), self.config.echo - 1
        return self.sink.hand_over(batch)

    def close(self) -> None:
        """End the run: the sink drops what it received and never pushed. Idempotent."""
        if not self._ended:
            self._ended = True
            self.sink.end()

    def _finish(self) -> None:
        """Every batch was yielded: tell each service that its stream asks for nothing more,
        then end the run."""
        self.end_streams()
        self.close()

    def end_streams(self) -> None:
        """Tell each service that its stream asks for nothing more: it ends once the batches it
        was asked for are sent (stale to this loader once a new stream starts) and gives its
        batch slots back. At the epoch's end, and when the consumer leaves it part-way (a new
        ``iter()`` on the loader). Once only; nothing after :meth:`close`."""
        if not self._ended and not self._told_end:
            self._told_end = True
            for r in self.conns.replicas:
                if not r.dead and r.stream >= 0 and r.accepted:
                    r.request([], self.stats.batches, final=True)  # the stream ends; its slots are kept

    # ------------------------------------------------------------------ the wait for the next batch
    def _next_in_order(self) -> Batch:
        """Wait (within the deadlines) until the next batch in plan order is pushed; take it."""
        c, flow, conns = self.config, self.flow, self.conns
        t0 = time.perf_counter()
        self._heard = max(self._heard, self._clock())  # the trainer's own time is no service's silence
        if self.fleet is not None:  # also when the next batch is already there: the fleet follows its name
            self.fleet.follow(conns, self._clock(), flow, self.epoch)
            self._ask()
        probed, told = self._heard, False
        while not self._push_due():
            now = self._clock()
            wake = min([self._heard + c.timeout, probed + self._probe_s, *conns.due_times()])
            if len(conns.replicas) > 1:  # wake up in time to notice a replica that stays down
                wake = min(wake, now + c.replica_timeout / 2)
            if self.fleet is not None:
                wake = min(wake, self.fleet.wake_at(now))
            if self.lookahead is not None:
                self.lookahead.send_releases(conns)
            events = conns.poll(max(1, int((wake - now) * 1000) + 1), waiting=True)
            now = self._clock()
            conns.check_connections(now)
            if self.fleet is not None:
                self.fleet.follow(conns, now, flow, self.epoch)
            if not events:
                if now >= self._heard + c.timeout:
                    conns.raise_timeout()
                if now >= probed + self._probe_s:
                    self._probe()
                    probed = now
                    if not told:  # one line per wait, so a stall is never silent
                        told = True
                        log.warning("waiting %.0fs for batch %d of epoch %d (asked of %s); nothing heard "
                                    "for %.0fs of the %gs timeout", time.perf_counter() - t0,
                                    flow.next_yield, self.epoch, self._owner(), now - self._heard, c.timeout)
                self._fail_over_dead(now)
                self._ask()
                continue
            for r, changed, readable in events:
                if r not in conns.replicas:
                    continue  # it left the set just now
                if changed:
                    self._on_monitor(r, now)
                if readable and r in conns.replicas and self._pump(r):
                    self._heard = probed = now
            self._ask()
            if self.lookahead is not None and flow.fully_asked:
                self.lookahead.start(conns, self.epoch + 1, flow.total)
        waited = time.perf_counter() - t0
        h2d = self.sink.h2d_s - self._h2d_seen
        self._h2d_seen = self.sink.h2d_s
        self.stats.wait_s += waited
        self.stats.h2d_s = self.sink.h2d_s
        for r in conns.replicas:
            r.stall(waited, h2d)
        flow.take()
        batch = self._pushed.popleft()
        self._ask()  # its place in the window is free
        self._hand_back()  # what the Request above did not take along (another stream's; a CUDA copy that finished)
        self.stats.batches += 1
        self.stats.samples += len(batch)
        return batch

    def _hand_back(self) -> None:
        """Send the Releases of the batches held in place (co-located) that were let go of and
        that no Request took along (``Replica.request``): also when no wait came, as a next() that
        finds its batch already received polls nothing, and those slots are the service's room
        to work in. (A wait's poll sends first, before any time passes, those a stream's slots
        need for the batches it owes; the rest wait for the Request after the take.)"""
        self.conns.send_releases()
        if self.lookahead is not None:
            self.lookahead.send_releases(self.conns)

    def _push_due(self) -> bool:
        """Hand the sink what the window lets go now; whether the next batch to yield is pushed."""
        for msg, payload in self.window.due(self.flow.next_yield):
            self._pushed.append(self.sink.push(msg, payload))
        return bool(self._pushed)  # pushed in plan order from next_yield: its head is next_yield

    def _pump(self, r: Replica) -> bool:
        """Read what ``r`` has (the poll found a message on it; bounded per round, so one replica
        cannot starve the rest); True if anything came from the service."""
        heard = False
        for i in range(64):
            if i and not r.has_message():  # (the first is the poll's)
                break
            try:
                msg, payload = self.conns.recv(r, self.sink)
            except zmq.Again:  # what the poll saw is gone (nothing else reads this socket): nothing to read
                break
            except LanesLost as exc:
                self._lanes_lost(r, exc)
                heard = True
                continue
            except SlotsGone as exc:
                self._slots_gone(r, exc)
                heard = True
                continue
            if isinstance(msg, P.Progress):  # the service is alive, but the timeout counts until a batch
                r.progress, r.progress_at = msg, time.monotonic()
                continue
            heard = True
            if msg is None:
                continue
            if isinstance(msg, P.Accept):
                if msg.num_batches != self.flow.total:
                    raise LoaderError(P.ErrorCode.BAD_JOB, (
                        f"{r.endpoint} has {msg.num_batches} batches in this epoch, expected {self.flow.total}: "
                        "do all replicas serve the same dataset?"))
                if self.conns.misplaced(r):  # its batches would come in place from out of reach, or needlessly copied
                    self._restart(r)
                    continue
                r.accepted = True
            elif isinstance(msg, P.Batch):
                r.progress, r.stale_batches, r.gone_batches = None, 0, 0
                if not self.flow.on_batch(r.index, msg.index, self._clock()):
                    if self.flow.late(r.index, msg.index):
                        # given to the others when r was lost, and sent by r after all (its stream
                        # asked again just before, say): one copy is used, this one dropped
                        self.sink.drop(payload)
                        continue
                    # (its memory goes back with the rest when the run closes)
                    raise LoaderError(P.ErrorCode.INTERNAL, f"unexpected batch {msg.index} from {r.endpoint}")
                self.window.put(msg.index, (msg, payload))
                if self.fleet is not None:
                    self.fleet.delivered(self.conns, r, self._clock(), self.flow)
                    if r not in self.conns.replicas:
                        break  # it drained and left
            elif isinstance(msg, P.Error) and msg.code == P.ErrorCode.UNKNOWN_CLIENT:
                self._restart(r)  # the service forgot us: ask again for what we miss
        return heard

    # ------------------------------------------------------------------ asking, and the replicas' fate
    def _ask(self) -> None:
        """Request what the flow control allows of the replicas that can take requests."""
        if not self.flow.unasked():  # most calls: the window is full
            return
        reps = {r.index: r for r in self.conns.replicas}
        live = [i for i, r in reps.items() if not r.dead and not r.draining and r.accepted and r.down_since is None]
        for i, batches in self.flow.assign(live, self._clock()).items():
            reps[i].request(batches, self.stats.batches)

    def _probe(self) -> None:
        """Silence while batches are owed: ask again (an empty Request). A service that forgot
        the stream (it restarted, or was frozen long enough to drop us) answers unknown_client,
        and the stream starts again from what it owed; one that knows it says nothing."""
        for r in self.conns.replicas:
            if not r.dead and r.stream >= 0 and self.flow.outstanding.get(r.index):
                r.request([], self.stats.batches, probe=True)

    def _restart(self, r: Replica) -> None:
        """A new stream on ``r`` for the batches it was asked for and has not delivered."""
        if r.stream < 0 or r.dead:
            return
        self.stats.restarts += 1
        self.conns.hello(r, r.epoch, sorted(self.flow.outstanding.get(r.index, ())))

    def _lanes_lost(self, r: Replica, exc: LanesLost) -> None:
        """``r``'s bulk lanes failed: what it owes is asked for again on a new stream (a batch
        whose bytes were lost is still owed: none is lost or doubled), on new lanes once that
        stream is accepted, or in data frames after too many failures. A batch sent on a set it
        already let go of (the service had not seen that yet) is asked for again alone."""
        if exc.stale:
            # a set let go of had at most what the service may send unasked; more is a peer's game
            r.stale_batches += 1
            if r.stale_batches > self.conns.max_queued:
                raise LoaderError(P.ErrorCode.BAD_MESSAGE, (
                    f"{r.endpoint} sent {r.stale_batches} batches in a row on bulk lanes this loader does not "
                    "have: a peer that is not a loader service, or a bug"))
            log.info("service replica %s: %s; asking again for its %d batches owed, on a new stream", r.endpoint,
                     exc.why, len(self.flow.outstanding.get(r.index, ())))
            self._restart(r)
            return
        r.drop_lanes(exc.why)
        log.warning("service replica %s: %s; asking again for its %d batches owed, on a new stream (%s)", r.endpoint,
                    exc.why, len(self.flow.outstanding.get(r.index, ())),
                    r.lanes_off or "new lanes open once it is accepted")
        self._restart(r)

    def _slots_gone(self, r: Replica, exc: SlotsGone) -> None:
        """A batch of ``r`` handed over in shared memory that is gone: its service stopped or
        restarted after sending it (a graceful stop unlinks its segments; a new service on the host
        sweeps a killed one's). The batch is still owed: what ``r`` owes is asked for again on a new
        stream (a restarted service's Accept then says whether it shares this host's shared memory)."""
        r.gone_batches += 1
        if r.gone_batches > self.conns.max_queued:  # more than a stream's worth: no restart explains it
            raise LoaderError(P.ErrorCode.BAD_MESSAGE, (
                f"{r.endpoint} handed over {r.gone_batches} batches in a row in shared memory that does not exist "
                f"(the last: {exc.name!r}): a peer that is not a loader service, or a bug"))
        log.info("service replica %s: %s; asking again for its %d batches owed, on a new stream", r.endpoint, exc,
                 len(self.flow.outstanding.get(r.index, ())))
        self._restart(r)

    def _on_monitor(self, r: Replica, now: float) -> None:
        was_up = r.down_since is None
        back = r.on_monitor()
        if self.fleet is not None and was_up and r.down_since is not None:
            self.fleet.lost(self.conns, r, now, self.flow)  # look the names up again: it may be back elsewhere
            if r not in self.conns.replicas:
                return
        if back:  # back, maybe to a restarted service: start again with what it owes
            if r.dead:
                log.info("service replica %s is back; it takes batches again", r.endpoint)
                r.dead = False
            self._restart(r)
            self.conns.drain_announced()  # one that said it stops may have had nobody else to drain to

    def _fail_over_dead(self, now: float) -> None:
        """Give the outstanding batches of a replica that stayed down (or was cut) to the live ones."""
        reps = self.conns.replicas
        if len(reps) < 2:
            return  # nobody else to ask: wait for it, up to `timeout`
        for r in reps:
            if r.dead or r.down_since is None or (now - r.down_since < self.config.replica_timeout
                                                  and not r.is_cut(now)):
                continue
            live = [x for x in reps if not x.dead and x is not r and x.down_since is None]
            if not live:
                return
            orphans = self.flow.lose(r.index)
            r.dead = True
            log.warning("service replica %s has been unreachable for %.0fs; its %d batches go to %s", r.endpoint,
                        now - r.down_since, len(orphans), ", ".join(x.endpoint for x in live))

    def _owner(self) -> str:
        for r in self.conns.replicas:
            if self.flow.next_yield in self.flow.outstanding.get(r.index, ()):
                return r.endpoint
        return "no replica yet: " + ", ".join(r.endpoint for r in self.conns.replicas)

"""The dispatch state: sessions, streams, batch memory, tasks and the scheduler behind one door.

Every change goes through :meth:`DispatchState.handle` (one event in, the commands it decided
out: :mod:`.events`); everything else reads. No sockets, no processes, no clock of its own (the
caller passes ``now``): the I/O shell (:mod:`.loop`) reads the sockets into events and carries
the commands out, and the model tests drive this class with no zmq at all.

Its parts, each pure:

* :class:`~loader_service.dispatch.admission.Admission`: what a Hello becomes (job rules included);
* :mod:`~loader_service.dispatch.door`: whether a Request may touch its stream, in any life;
* :class:`~loader_service.dispatch.memory.BatchMemory`: batch slots, reserves, lending, waiting;
* :class:`~loader_service.dispatch.stream_state.StreamState`: one stream's batches, slots, redo and
  isolation rules, and the order batches leave in;
* :mod:`~loader_service.dispatch.sending`: a batch's message and the slot blocks it is sent from;
* :class:`~loader_service.dispatch.tasks.Tasks`: tasks on workers and their deadlines;
* :class:`~loader_service.dispatch.scheduler.Scheduler`: which stream an idle worker serves;
* :class:`~loader_service.dispatch.sessions.Sessions`: connections and their identities;
* :class:`~loader_service.dispatch.flood.FloodGuard`: what each connection may still send;
* :class:`~loader_service.dispatch.silence.SilenceWatch`: when connections are looked at for silence,
  which were cut for it, which of those libzmq will never close.

The worker pool is read, never changed, here (which workers can take a task, what the one on a
task is doing); the shell changes it by the commands.

Failures are contained: a bug met while handling one client's message, or acting for one client
after another event, fails that client alone with ``[internal]`` and the traceback
(:meth:`DispatchState._internal_error`, counted in ``internal_errors``; the tests assert it
never happens).
"""

from __future__ import annotations

import contextlib
import logging
import math
import traceback
from collections import deque
from typing import Callable, Deque, Dict, Iterator, List, Optional, Tuple, Union

import msgpack
import numpy as np

from wire import protocol as P
from loader_service.config import ServiceConfig
from loader_service.dispatch import door, flood, heap, local, sending, silence, status, unread
from loader_service.dispatch.door import Life
from loader_service.dispatch import events as E
from loader_service.decode.pipelines import Registry
from loader_service.dispatch.admission import Admission, Refuse
from loader_service.dispatch.deadlines import TaskDeadlines
from loader_service.dispatch.memory import BatchMemory, Broke, NoSlots, slot_cap
from loader_service.dispatch.scheduler import Scheduler
from loader_service.dispatch.sessions import Session, Sessions
from loader_service.dispatch.status import SKIPS_SHOWN, SkippedSample, Totals
from loader_service.dispatch.stream_state import Effect, Fail, Finish, SendBatch, StreamLimits
from loader_service.dispatch.streams import Opening, Stream
from loader_service.dispatch.tasks import Tasks
from loader_service.log_budget import LineBudget
from loader_service.sources import Source
from loader_service.workers.pool_state import PoolState, describe_exit

log = logging.getLogger("loader_service.dispatch.loop")  # one logger for the dispatcher, whichever half
# a client's malformed messages: rate-limited (control.http_limits.limit_logs), so a flood of them
# costs a line every few seconds, not one each (totals.bad_messages counts them all)
refused_log = logging.getLogger("loader_service.dispatch.refused")

ACCEPT_REPORT_GRACE_S = 10.0  # how late a connection's accept may be reported after its first message
CUTS_LOGGED = 5  # silent connections of one storm of cuts logged one line each (the rest in one line)
# the lines about one client's doing (a stream started, refused, failed; a client gone): each kind may write
# this many at once and earns them back over CLIENT_LINES_S, so a flood of 10,000 Hellos writes a few hundred
# lines and a count, not 20,000 lines (what is left out is counted in the next line of its kind, or a summary)
CLIENT_LINES, CLIENT_LINES_S = 100, 10.0
CLIENT_MESSAGES = (P.Hello, P.Request, P.Release, P.Bye, P.Describe)


def shutting_down(stream: int) -> P.Error:
    """The answer to a Hello while the service stops (draining, then while its workers stop): the
    client asks another replica, or this one once it is back."""
    return P.Error(code=P.ErrorCode.SHUTTING_DOWN, stream=stream, fatal=False,
                   message="the service is shutting down; reconnect and resume")


class DispatchState:
    """What the dispatcher knows and decides, for ``sources`` served through ``pipelines``.
    ``workers``: the pool, read only (its places, counts and what each worker is on);
    ``instance``: this service's id, sent in every Accept; ``authorized``: whether a CURVE key
    may still be served (None without CURVE); ``probe``: the shared-memory segment a co-located
    client reads to know it shares this host's /dev/shm, named in every DatasetInfo and Accept
    (:mod:`.local`; "": none); ``lane_port``:
    the bulk-lane port every Accept names (:mod:`.lanes`; 0: none)."""

    def __init__(self, config: ServiceConfig, sources: Dict[str, Source], pipelines: Registry, workers: PoolState,
                 instance: str, authorized: Optional[Callable[[str, float], bool]] = None, probe: str = "",
                 lane_port: int = 0):
        self.config, self.workers, self.instance, self.authorized = config, workers, instance, authorized
        self.probe, self.lane_port = probe, lane_port
        self.admission = Admission(sources, pipelines, StreamLimits(on_error=config.on_error,
                                                                    max_skipped=config.max_skipped),
                                   config.decode_options)
        self.sessions = Sessions()
        self.flood = flood.FloodGuard(config.client_allowance, config.client_allowance_rate)
        self.silence = silence.SilenceWatch(config.heartbeat_s, config.max_stranded_per_address)
        self.unread = unread.UnreadWatch()
        cap, hint = slot_cap(config.max_shm_bytes)
        self.memory = BatchMemory(cap, config.reclaim_idle_s, self.sessions.streams, self.sessions.__contains__, hint,
                                  line=self._client_line, unflushed=self.sessions.unflushed.__contains__)
        self.tasks = Tasks(TaskDeadlines(config.task_deadline_s, config.task_deadline_floor_s), config.on_error)
        self.scheduler: Scheduler[Stream] = Scheduler()
        self.totals = Totals()
        self.recent_skips: Deque[SkippedSample] = deque(maxlen=SKIPS_SHOWN)  # for the status page
        self.rate = status.Rate()  # samples delivered lately (the status reads it)
        self.stop_by: Optional[float] = None  # a draining stop: end by then
        self._trim_rule = heap.TrimRule()
        self._cuts_in_storm = 0  # silent connections cut since none were waiting to be (for the log)
        self.client_lines = LineBudget(CLIENT_LINES, CLIENT_LINES_S)  # kinds: (level, template)
        self._out: List[E.Command] = []  # the commands of the event at hand
        self._now = 0.0  # the event at hand's time

    # ------------------------------------------------------------------ the door
    def handle(self, event: E.Event, now: float) -> List[E.Command]:
        """Apply ``event`` (at monotonic time ``now``); the commands the shell must carry out, in order."""
        self._now, out = now, []
        self._out = out
        if isinstance(event, E.ClientMessage):
            try:
                self._on_client(event)
            except Exception as exc:  # a bug met by one message must not take the service down for everyone
                self._internal_error(event.ident, "handling a message", f"{type(exc).__name__}: {exc}",
                                     traceback.format_exc())
        elif isinstance(event, E.Tick):
            self._on_tick()
        elif isinstance(event, E.Quiet):
            self._on_quiet(event)
        elif isinstance(event, E.LetGo):
            with self._for_client(event.stream.ident, "letting go of a sent batch"):
                event.stream.state.send_complete(event.slot)
                self._may_take_task(event.stream)
        elif isinstance(event, E.Flushed):
            self._on_flushed(event)
        elif isinstance(event, E.WorkerDone):
            self._on_worker_done(event)
        elif isinstance(event, E.WorkerLost):
            self._on_worker_lost(event)
        elif isinstance(event, E.Accepted):
            self.flood.forget(event.fd)
            self.silence.forget(event.fd)
            self.unread.forget(event.fd)
            self.sessions.accepted(event.fd)
            self._trim_rule.connections(self.sessions.connections)
        elif isinstance(event, E.Disconnected):
            self.flood.forget(event.fd)
            self.silence.forget(event.fd)
            self.unread.forget(event.fd)
            ident = self.sessions.disconnected(event.fd)
            if ident is not None:
                self._drop_client(ident, "disconnected")
            self._connections_fell()
        elif isinstance(event, E.Unreachable):
            self._drop_client(event.ident, "is unreachable: its connection is gone")
        elif isinstance(event, E.CommandFailed):
            self._internal_error(event.ident, event.what, event.error, event.traceback)
        elif isinstance(event, E.HandshakeRefused):
            self.totals.refused_handshakes += 1
        elif isinstance(event, E.HeapTrimmed):
            self.totals.heap_trims += 1
            log.info("%d connections now: gave %.0f MiB of freed heap back to the system", self.sessions.connections,
                     event.freed / 2**20)
        elif isinstance(event, E.StopAsked):
            self._on_stop(event.drain_s)
        elif isinstance(event, E.Closing):
            self._on_closing()
        elif isinstance(event, E.Closed):
            for session in self.sessions:
                self._drop_client(session.ident, "service stopping")
        else:
            raise TypeError(f"not a dispatch event: {event!r}")
        self._out = []
        return out

    # ------------------------------------------------------------------ readers
    def knows(self, ident: bytes, fd: int) -> bool:
        """Whether ``ident`` has a session bound to connection ``fd`` (else the shell reads the
        monitor to the end before handing its message over: see :meth:`_on_client`)."""
        session = self.sessions.get(ident)
        return session is not None and session.fd == fd

    def next_deadline(self, now: float) -> Optional[float]:
        """The next time something is due without an event: a task deadline, the time a quiet
        stream's slots may be lent, a connection's late accept, the next look for silent
        connections (now, while the last one's finds wait to be cut), a trim's follow-up, the end
        of a draining stop, the summary of the client lines left out of the log."""
        if self.silence.waiting:
            return now  # more silent connections to cut: the next round, at once
        silence_at = self.silence.next_at if self.sessions.connections else None
        ends = [t for t in (self.tasks.next_deadline(), self.memory.next_lend_at(now), self.sessions.next_early_due(),
                            silence_at, self.silence.next_strand_at(), self._trim_rule.settle_at, self.stop_by,
                            self.client_lines.next_due())
                if t is not None]
        return min(ends) if ends else None

    def drained(self, now: float) -> bool:
        """A draining stop is over: its time is up, or no task is in flight any more."""
        return self.stop_by is not None and (now >= self.stop_by or not self.tasks.running)

    def early_due(self, now: float) -> bool:
        """A connection opened on an early message is past its grace: the shell reads the
        monitor (a report still queued confirms it) before the next :class:`~.events.Tick`."""
        due = self.sessions.next_early_due()
        return due is not None and due <= now

    # ------------------------------------------------------------------ guards
    def _internal_error(self, ident: Optional[bytes], what: str, error: str, tb: str) -> None:
        """The last resort: a bug met while ``what`` (counted as ``internal_errors``, logged; the
        tests assert it never happens). Acting for client ``ident``, it fails that client alone:
        its stream ends with ``[internal]`` and the traceback, and its session closes."""
        self.totals.internal_errors += 1
        if ident is None:
            log.error("error while %s: %s\n%s", what, error, tb)
            return
        # within the clients' line budget: a client that finds a way to make this happen could
        # otherwise write a traceback into the log with every message it sends
        self._client_line(logging.ERROR, "error while %s for client %s: %s\n%s", what, ident.hex()[:12], error, tb)
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
        self._out.append(E.Send(ident, msg))

    # ------------------------------------------------------------------ clients
    def _client_line(self, level: int, template: str, *args) -> None:
        """Log a line about one client's doing within its kind's budget (:data:`CLIENT_LINES`)."""
        note = self.client_lines.take((level, template), self._now)
        if note is not None:
            log.log(level, template + note, *args)

    def _on_client(self, ev: E.ClientMessage) -> None:
        ident, fd, frames = ev.ident, ev.fd, ev.frames
        if fd < 0:  # libzmq named no connection for it: nothing to tie it to, answer or cut
            self.totals.bad_messages += 1
            refused_log.warning("dropped a message from client %s: libzmq names no connection for it (a peer "
                                "speaking ZMTP 1.0 or 2.0?)", ident.hex()[:12])
            return
        session = self.sessions.get(ident)
        if (session is None or session.fd != fd) and not self.sessions.is_open(fd):
            # The shell has read the monitor to the end first (:meth:`knows`), so that the
            # disconnect of an earlier connection on this fd number is not taken for this one's.
            # A message whose fd is still not open came before its connection's accept was
            # reported, or after it was gone: it is answered, and its connection opened early
            # until the report comes (sessions.py).
            self.totals.early_messages += 1
            self.sessions.open_early(fd, self._now + ACCEPT_REPORT_GRACE_S)
        owner = self.sessions.owner(fd)
        if owner is not None and owner != ident:
            # The monitor was read to the end first, so the connection open on this fd is the
            # owner's: this message came over an older connection on the same fd number (left
            # unread when it closed: a cut flood's rest), or one libzmq renamed when its client
            # reconnected. Its client is gone or speaks elsewhere now: dropped, it costs the owner nothing.
            self.totals.stale_messages += 1
            return
        verdict = self.flood.charge(ident, fd, self.sessions.serial(fd), flood.cost(frames), self._now,
                                    self.sessions.is_early(fd))
        if verdict is not flood.Verdict.PASS:
            return self._flooded(ident, fd, verdict)
        if session is not None and session.fd != fd:
            self._bind_fd(session, fd)
        try:
            msg, _ = P.decode(list(frames), expect=CLIENT_MESSAGES)
        except P.ProtocolError as exc:
            self.totals.bad_messages += 1
            refused_log.warning("refused a message from client %s: %s", ident.hex()[:12], exc)
            self._send(ident, P.Error(code=exc.code, message=str(exc), stream=_stream_of(frames[0]) if frames else -1))
            return
        if (self.authorized is not None and isinstance(msg, (P.Hello, P.Request))
                and not self.authorized(ev.user_id, self._now)):
            return self._revoked(ident, session, msg)
        if isinstance(msg, P.Hello) and self.stop_by is not None:
            self._send(ident, shutting_down(msg.stream))
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
        elif isinstance(msg, P.Request):
            self._on_request(ident, session, msg)
        elif isinstance(msg, P.Release):
            self._on_release(session, msg)
        elif isinstance(msg, P.Describe):
            self._send(ident, local.with_probe(self.admission.describe(msg), self.probe))
        elif isinstance(msg, P.Bye):
            self._drop_client(ident, "said bye")

    def _flooded(self, ident: bytes, fd: int, verdict: flood.Verdict) -> None:
        """A message past its connection's allowance, or from a connection or identity cut: dropped
        unread. Past the allowance, the connection is cut and its session dropped."""
        self.totals.flooded_messages += 1
        if verdict is not flood.Verdict.CUT:
            return
        # A connection still early is not shut down: it may be gone, its fd a newer connection's
        # whose accept is on its way (what a cut identity left unread comes that way, dropped).
        if not self.sessions.is_early(fd):
            self.totals.floods_cut += 1
            refused_log.warning("cut the connection of client %s: it sent past its allowance (--client-allowance "
                                "%d, +%g a second, +%d a batch sent); what it sends for %.0f s is dropped unread",
                                ident.hex()[:12], self.flood.burst, self.flood.rate, flood.EARNED_PER_BATCH,
                                flood.REMEMBER_S)
            self._out.append(E.Cut(fd, self.sessions.serial(fd)))
        self._drop_client(ident, "was cut: it sent past its allowance")

    def _revoked(self, ident: bytes, session: Optional[Session], msg: P.Message) -> None:
        """The key this connection's handshake used was removed: its stream ends, its session goes."""
        why = "this client's CURVE key is no longer authorized by the service (removed from its keys directory)"
        if session is not None and session.stream is not None:
            self.totals.revoked += 1
            self._client_line(logging.WARNING, "client %s: %s; its stream ends", ident.hex()[:12], why)
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
        session.heartbeat_s = hello.heartbeat
        self.memory.waiting.pop(session.ident, None)
        self.memory.moved_on(session.ident, session.stream)  # co-located: it reads nothing it borrowed any more
        if session.stream is not None:
            self._retire(session.stream)
        verdict = self.admission.admit(session, hello, self.sessions.of_job(hello.job), self.workers.broken)
        for t in verdict.takeovers:
            self._client_line(logging.WARNING, "client %s: %s", t.session.name, t.why)
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
        behind = self.memory.behind(session.ident)
        result = self.memory.open(opening, self._now)
        if result is None and behind:
            self.totals.held_back += 1
            self._client_line(logging.INFO, "client %s stream %d waits: %s", session.name, hello.stream, behind)
        elif result is None:
            self._client_line(logging.INFO, "client %s stream %d waits for %.1f MiB of slots that ending streams still "
                              "hold", session.name, hello.stream, opening.nbytes / 2**20)
        self._opened([] if result is None else [(opening, result)])

    def _on_flushed(self, ev: E.Flushed) -> None:
        """What ``ev.ident`` was sent before its last Accept has gone to the kernel: a new stream of
        its that waited for that opens now, if memory allows."""
        if self.sessions.unflushed.get(ev.ident) != ev.stream:
            return  # an older Accept's
        del self.sessions.unflushed[ev.ident]
        with self._for_client(ev.ident, "opening a stream held back"):
            self._opened(self.memory.reopen(ev.ident, self._now))

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
            self._out.append(E.Unmap(name))

    def _start(self, session: Session, s: Stream) -> None:
        hello, plan = s.hello, s.plan
        self.sessions.serve(session, s)
        self.totals.streams += 1
        track = self.sessions.accepting(session.fd)
        if track:  # its next stream opens once this has gone (memory.py)
            self.sessions.unflushed[session.ident] = hello.stream
        accept = P.Accept(stream=hello.stream, epoch=hello.epoch, num_batches=plan.num_batches,
                          num_samples=plan.num_samples, dataset_length=len(s.source), dataset=s.source.name,
                          service=self.instance, fingerprint=s.source.fingerprint(),
                          decoding=self.admission.decoding(s.pipe), lanes=self.lane_port, probe=self.probe)
        self._out.append(E.Send(session.ident, accept, track=track))
        self._client_line(logging.INFO, "client %s job %r rank %d/%d epoch %d: stream %d asked at once for %d of %d "
                          "batches%s", session.name, hello.job, hello.rank, hello.spec.world_size, hello.epoch,
                          hello.stream, len(s.state.order), plan.num_batches, " (lookahead)" if hello.lookahead else "")
        self._apply(s, s.state.start())

    def _on_request(self, ident: bytes, session: Optional[Session], msg: P.Request) -> None:
        """A Request (more batches, stall figures, a probe, a promotion), let in by the door
        (:mod:`.door`) whatever the stream's life: waiting for its slots or served."""
        if session is None or msg.stream > session.stream_id:
            # the service restarted or forgot this client: it will start again from its cursor
            self._send(ident, P.Error(code=P.ErrorCode.UNKNOWN_CLIENT, stream=msg.stream, fatal=False,
                                      message="this service has no stream for the client; start it again"))
            return
        if msg.released:  # what a Release of them just before would do (and may end the stream)
            self._on_release(session, P.Release(stream=msg.stream, batches=msg.released))
        s = session.stream
        o = self.memory.waiting.get(ident) if s is None else None  # a stream still waiting for its slots
        if (o is None or o.hello.stream != msg.stream) and (s is None or s.id != msg.stream):
            return  # for a stream that already ended or was replaced
        target: Union[Stream, Opening] = s if s is not None else o
        refusal = door.check_request(msg, target.asks())
        if refusal is not None:
            self.totals.refused_asks += 1
            self._client_line(logging.WARNING, "client %s stream %d: refused %s: %s", session.name, msg.stream,
                              type(msg).__name__, refusal.message)
            return self._end_stream(target, Fail(refusal.code, refusal.message))
        # the stall figures are deltas since the connection's previous message: add, keep no baseline
        self.totals.wait_s += msg.wait_s
        self.totals.h2d_s += msg.h2d_s
        now = self._now
        if s is None:
            o.asked(msg)
            if msg.probe:
                self._send(ident, status.progress(self.workers, self.tasks, msg.stream, None, len(o.order), True, now))
            return
        if msg.probe:
            self._send(ident, status.progress(self.workers, self.tasks, s.id, s, s.state.not_started,
                                              s.life is Life.STARVED, now))
        if msg.batches:
            s.asked_at, s.asked = now, True
        s.wait_s += msg.wait_s
        s.h2d_s += msg.h2d_s
        if msg.promote:
            s.lookahead = False
            self._may_take_task(s)  # its place in the scheduler's line changes
        self._apply(s, s.state.extend(msg.batches, final=msg.final))
        self.memory.wake(s, now)
        self._memory_outboxes()
        self._may_take_task(s)

    def _on_release(self, session: Optional[Session], msg: P.Release) -> None:
        """A co-located client handed slots back (:mod:`.local`), of its stream or of one that ended
        (finished, failed, replaced: its client keeps what it borrowed until it moves on); one the
        stream did not hand over ends that stream, through the door like a Request."""
        if session is None or msg.stream < session.stream_id:
            return  # of a stream its client has moved on from: what it borrowed of it is back already
        s = session.stream if session.stream is not None and session.stream.id == msg.stream else \
            local.retired(self.memory.retiring, session.ident, msg.stream)
        if s is None:
            return  # a stream that ended and gave everything back
        slots = local.release(s, msg)
        if isinstance(slots, door.Refusal):
            self.totals.refused_asks += 1
            self._client_line(logging.WARNING, "client %s stream %d: refused Release: %s", session.name, msg.stream,
                              slots.message)
            return self._end_stream(s, Fail(slots.code, slots.message))
        for slot in slots:
            s.state.send_complete(slot)
        self._may_take_task(s)

    def _drop_client(self, ident: bytes, why: str, logged: bool = True) -> None:
        session = self.sessions.pop(ident)
        if session is None:
            return
        if session.stream is not None:
            self.scheduler.forget(session.stream)
        opened = self.memory.leave(ident, session.stream, self._now)
        if logged:
            self._client_line(logging.INFO, "client %s %s", session.name, why)
        self._opened(opened)

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
            self.scheduler.offer(s, s.tier)

    def _end_stream(self, s: Union[Stream, Opening], e: Effect) -> None:
        """Tell the client how its stream ended (``Finish`` or ``Fail``), then retire it (a
        stream still waiting for its slots stops waiting)."""
        if isinstance(s, Opening):
            assert isinstance(e, Fail)
            if self.memory.waiting.get(s.ident) is s:
                del self.memory.waiting[s.ident]
            self._client_line(logging.ERROR, "stream %d of client %s failed while waiting for slots: %s", s.hello.stream,
                              s.ident.hex()[:12], e.message)
            self._send(s.ident, P.Error(code=e.code, message=e.message, stream=s.hello.stream, fatal=True))
            return
        if isinstance(e, Finish):
            self._send(s.ident, P.EndOfEpoch(stream=s.id, epoch=s.hello.epoch, num_batches=s.plan.num_batches))
        elif isinstance(e, Fail):
            self._client_line(logging.ERROR, "stream %d of client %s failed: %s", s.id, s.ident.hex()[:12], e.message)
            self._send(s.ident, P.Error(code=e.code, message=e.message, stream=s.id, fatal=True,
                                        traceback=e.traceback))
        self._retire(s)

    def _retire(self, s: Stream) -> None:
        """Stop serving ``s``; its slots go back once no task or send still uses them."""
        session = self.sessions.get(s.ident)
        if session is not None and session.stream is s:
            self.sessions.serve(session, None)
        self.scheduler.forget(s)
        self._opened(self.memory.retire(s, self._now))

    def _send_batch(self, s: Stream, e: SendBatch) -> None:
        out = sending.outgoing(s.layout, s.plan, s.id, s.hello.epoch, e)
        in_place = s.hello.local and s.segment is not None  # co-located: the client borrows the slot (local.py)
        if in_place:
            out = local.hand_over(s, e, out)
        if out.keep is not None:
            for idx, reason in out.message.skipped:
                self.recent_skips.append(SkippedSample(dataset=s.source.name, index=int(idx), reason=str(reason)))
            if e.compact:
                sending.compact(s.segment, s.layout, e.slot, out.keep)
            self.totals.skipped += len(out.message.skipped)
        n = len(out.indices)
        labels = np.ascontiguousarray(s.source.labels[out.indices], dtype=np.int64).tobytes()
        self._out.append(E.SendData(s.ident, out.message, s.segment, tuple(out.blocks), labels,
                                    s, e.slot, let_go=not in_place))
        # counted as sent now: a send that finds the connection gone drops the client right after
        session = self.sessions.get(s.ident)
        if session is not None:
            session.batches += 1
            session.samples += n
            self.flood.earn(session.fd, session.fd_gen, 1, self._now)
        self.totals.samples += n
        self.totals.batches += 1
        self.totals.bytes += sum(size for _, size in out.blocks)
        self.rate.add(self._now, self.totals.samples)

    def _fail_all(self, why: str) -> None:
        for stream in self.sessions.streams():
            self._end_stream(stream, Fail(P.ErrorCode.INTERNAL, why))

    # ------------------------------------------------------------------ a round's end
    def _on_tick(self) -> None:
        self._expire_tasks()
        self._expire_unreported()
        if self.workers.broken:
            self._fail_all(self.workers.broken)
        self._opened(self.memory.release_idle(self._now))  # retired streams nothing reads any more
        self._opened(self.memory.lend_if_due(self._now))  # a quiet stream's slots may be lent now
        self._schedule()
        if self.sessions.connections and self.silence.due(self._now):
            self.silence.looked(self._now)  # its answer cuts this round's share
            self._out.append(E.Probe(tuple((fd, serial, self.sessions.owner(fd) or b"")
                                           for fd, serial in self.sessions.confirmed()
                                           if not self.silence.is_cut(fd, serial))))
        elif self.silence.waiting:
            self._cut_silent()  # what the last look found past the first rounds' share
        if self._trim_rule.settle_due(self._now):
            self._give_heap_back()
        for (level, template), n, over_s in self.client_lines.overdue(self._now):
            log.log(level, "%d more lines like %r were left out of the log in the last %.0f s (at most %d of a "
                    "kind are written per %.0f s)", n, template, over_s, CLIENT_LINES, CLIENT_LINES_S)
        for address in self.silence.strand(self._now):
            self.totals.denied_addresses += 1
            log.error("refusing new connections from %s from now on: %d of its connections were cut and libzmq never "
                      "closed them (a peer that opened a second connection under the identity of one still sending: "
                      "libzmq stops reading the first for good); each keeps a descriptor until the service stops "
                      "(--max-stranded-per-address %d)", address, self.silence.denied[address],
                      self.silence.max_per_address)
            self._out.append(E.Deny(address))

    def _on_quiet(self, ev: E.Quiet) -> None:
        """Find each connection that has brought nothing (:mod:`.silence`), or read nothing of what
        waits for it (:mod:`.unread`), for longer than its limit, and cut the first of them
        (:meth:`_cut_silent`)."""
        for fd, serial, quiet_s, address, sockets in ev.readings:
            if self.sessions.serial(fd) != serial:
                continue  # gone, or its fd a newer connection's, since the probe was commanded
            ident = self.sessions.owner(fd)
            session = self.sessions.get(ident) if ident is not None else None
            limit = self.silence.limit(session.heartbeat_s if session is not None else P.DEFAULT_HEARTBEAT_S)
            unread_s = self.unread.observe(fd, serial, sockets, self._now)
            self.silence.found(fd, serial, quiet_s, limit, address, unread_s)
        self._cut_silent()

    def _cut_silent(self) -> None:
        """Cut so many of the connections found silent, those still open; a session bound to one is
        dropped at once (its client reconnects and resumes if it was only frozen). The first
        :data:`CUTS_LOGGED` of a storm are logged one by one, the rest in one line at its end."""
        for fd, serial, quiet_s, unread_s, limit, address in self.silence.to_cut():
            if self.sessions.serial(fd) != serial or not self.silence.silent(fd, serial, quiet_s, limit, self._now,
                                                                             address, unread_s):
                continue  # gone since the look, or cut already
            self._cuts_in_storm += 1
            ident = self.sessions.owner(fd)
            if quiet_s == math.inf:
                self.totals.silent_cut += 1
                why = "its peer has closed it and libzmq has not (it may have stopped reading it)"
            elif quiet_s >= limit:
                self.totals.silent_cut += 1
                why = (f"nothing came over it for {quiet_s:.1f} s (the limit: {limit:.1f} s, "
                       f"{silence.SILENT_AFTER} of its heartbeats)")
            else:
                self.totals.unread_cut += 1
                why = (f"its peer read nothing of what waits for it for {unread_s:.1f} s "
                       f"({self.unread.unsent(fd):,} bytes unsent in the kernel, more in libzmq's queue; the limit: "
                       f"{limit:.1f} s, {silence.SILENT_AFTER} of its heartbeats)")
            logged = self._cuts_in_storm <= CUTS_LOGGED
            if logged:
                who = (f"the connection of client {ident.hex()[:12]}" if ident is not None
                       else f"a connection that has not said Hello (fd {fd})")
                refused_log.warning("cut %s from %s: %s", who, address or "an unknown address", why)
            self._out.append(E.Cut(fd, serial))
            if ident is not None:
                self._drop_client(ident, f"was cut: {why}", logged)
        if not self.silence.waiting:
            if self._cuts_in_storm > CUTS_LOGGED:
                refused_log.warning("cut %d more silent or unread connections, not logged one by one (%d and %d in "
                                    "all since the service started: silent_cut and unread_cut in /v1/status)",
                                    self._cuts_in_storm - CUTS_LOGGED, self.totals.silent_cut, self.totals.unread_cut)
            self._cuts_in_storm = 0

    def _expire_unreported(self) -> None:
        """Connections opened on a message whose accept never came were gone before it was read
        (the shell has read the monitor first: :meth:`early_due`)."""
        if not self.early_due(self._now):
            return
        for ident in self.sessions.unreported(self._now):
            self.totals.unreported_connections += 1
            self._drop_client(ident, "is gone: its connection closed before its first message was read")
        self.flood.keep_open(self.sessions.serial)
        self._connections_fell()

    def _connections_fell(self) -> None:
        """Connections closed: once many have (:class:`~.heap.TrimRule`), the parts give their
        tables back and the shell gives the heap back. Commanded here, not at the round's end: a
        drain can end in events read after the round's tick (the disconnects of the silence look's
        cuts), and a trim left to the next round would wait for the next event, maybe for good."""
        if self._trim_rule.connections(self.sessions.connections):
            self._trim_rule.trimmed(self._now)
            self._give_heap_back()

    def _give_heap_back(self) -> None:
        for part in (self.sessions, self.scheduler, self.tasks, self.memory, self.flood, self.silence, self.unread):
            part.compact()
        self._out.append(E.TrimHeap())

    def _on_stop(self, drain_s: float) -> None:
        if drain_s <= 0 or not self.tasks.running:
            self._out.append(E.EndLoop())
        elif self.stop_by is None:
            self.stop_by = self._now + drain_s
            log.info("letting %d tasks in flight finish (at most %.1fs) before stopping", len(self.tasks.running),
                     drain_s)

    def _on_closing(self) -> None:
        for session in self.sessions:  # first, so clients start reconnecting while workers stop
            self._send(session.ident, P.Error(code=P.ErrorCode.SHUTTING_DOWN, fatal=False,
                                              message="the service is stopping; reconnect and resume"))
        self.memory.stop()  # nothing opens while the service stops

    # ------------------------------------------------------------------ workers
    def _schedule(self) -> None:
        places = self.workers.places()
        if not places or self.stop_by is not None:
            return
        places.reverse()  # popped from the end: idle workers first
        last: Dict[int, int] = {}  # a worker's task handed out in this round (the shell assigns after)

        def take(s: Stream) -> None:
            with self._for_client(s.ident, "handing its batch to a worker"):
                w = places[-1]
                t = s.state.next_task(self.tasks.next_id())
                assert t is not None, "the scheduler picked a stream with nothing to do"
                behind = last.get(w.id, w.tasks[-1] if w.tasks else None)
                task = self.tasks.start(s, t, w.id, self._now, behind)
                last[w.id] = task.task
                self._out.append(E.Assign(s.ident, w, task, s, t.batch))
                places.pop()

        self.scheduler.pick(len(places), lambda s: s.segment is not None and s.state.dispatchable(),
                            lambda s: s.tier, take)

    def _on_worker_done(self, ev: E.WorkerDone) -> None:
        done = ev.done
        if ev.began is not None:  # its queued task runs from now
            self.tasks.began(ev.began, self._now)
        r = self.tasks.done(done.task, self._now)
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

    def _on_worker_lost(self, ev: E.WorkerLost) -> None:
        for task_id in ev.held:
            r = self.tasks.lost(task_id)
            if r is None:
                continue
            self.totals.redone_tasks += 1
            with self._for_client(r.stream.ident, "redoing a task its worker lost"):
                if task_id != ev.died_on:  # finished (its Done lost with the worker) or never began: not its fault
                    r.stream.state.task_returned(task_id)
                    self._may_take_task(r.stream)  # it has a batch to redo: back in the scheduler's line
                else:
                    self._apply(r.stream, r.stream.state.task_lost(task_id,
                                                                   r.lost_because(describe_exit(ev.exitcode))))

    def _expire_tasks(self) -> None:
        """Kill the worker of every task past its deadline; its loss is handled when it is reaped."""
        workers = self.workers.workers

        def on_it(wid: int, task_id: int) -> bool:
            w = workers.get(wid)
            return w is not None and w.task == task_id

        for task_id, r in self.tasks.overdue(self._now, on_it):
            w = workers[r.worker]
            self.totals.hung_tasks += 1
            log.warning("task %d (stream %d, %d samples) on worker %d (pid %s) outlived its %.1fs deadline; "
                        "killing the worker, the task is redone", task_id, r.stream.id, r.samples, w.id, w.pid,
                        r.deadline - r.started)
            self._out.append(E.Kill(w.pid))


def _stream_of(frame) -> int:
    """Best effort: the stream a refused message was about, so its sender can match the error."""
    try:
        header = msgpack.unpackb(frame.bytes, raw=False)
        stream = header.get("stream", -1)
        return stream if isinstance(stream, int) and not isinstance(stream, bool) else -1
    except Exception:
        return -1

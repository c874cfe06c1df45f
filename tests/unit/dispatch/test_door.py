"""The door (issue 37): every client message, in every life of its stream, with hostile values.

The pure checks first; then a hypothesis state machine that drives the real
:class:`~loader_service.dispatch.state.DispatchState` through its one door (no zmq, no loop, no
processes: testkit/dispatcher.py) with every message type a client can send, well-formed
or not, while streams wait for memory, run, are caught up, lend their slots, starve and end;
two workers take tasks as the state hands them out and finish, fail or lose them at random,
libzmq lets go of sent batches in any order, clients stop and start reading (libzmq holds the
Accepts sent them meanwhile, and lets go of them in any order), time passes past deadlines and reclaim times.
After every step: nothing escaped, the last-resort guard never fired, what a connection holds
stays within its window, no batch left twice, the bystander was never failed by what others
sent, and each stream's life moved only as :data:`~loader_service.dispatch.door.MAY_BECOME` allows.
"""

from __future__ import annotations

import math
import uuid
from typing import Dict, Optional, Set

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig
from loader_service.dispatch import door
from loader_service.dispatch.door import MAY_BECOME, Asked, Life
from loader_service.dispatch.flood import REMEMBER_S
from loader_service.dispatch.memory import RETIRING_HELD_MAX
from loader_service.dispatch.streams import Stream
from testkit.dispatcher import close, deliver, loopless


def _asked(**kw) -> Asked:
    base = dict(stream=3, num_batches=10, window=4, count=2, sent=1, final=False,
                has=lambda b: b in (0, 1))
    base.update(kw)
    return Asked(**base)


@pytest.mark.parametrize("batches, code, words", [
    ([2, 3, 4], None, ""),  # 1 unsent + 3 = 4: the whole window
    ([2, 3, 4, 5], P.ErrorCode.BAD_MESSAGE, "Request takes stream 3 to 5 batches asked and not yet sent, more than "
                                            "its window of 4"),
    ([10], P.ErrorCode.BAD_JOB, "batch 10 is past the end of the epoch (10 batches here)"),
    ([3, 1], P.ErrorCode.BAD_JOB, "batch 1 is already part of stream 3"),
])
def test_a_request_is_checked_against_the_plan_what_was_asked_and_the_window(batches, code, words):
    r = door.check_request(P.Request(stream=3, batches=batches), _asked())
    assert (r is None) if code is None else (r.code == code and words in r.message)


def test_nothing_may_be_asked_after_final():
    r = door.check_request(P.Request(stream=3, batches=[5]), _asked(final=True))
    assert r.code == P.ErrorCode.BAD_MESSAGE and "after its final Request" in r.message
    assert door.check_request(P.Request(stream=3, probe=True), _asked(final=True)) is None  # stall figures: fine


def test_the_window_is_what_the_client_says_else_the_cap_and_never_past_it():
    spec = JobSpec(batch_size=4, image_size=32)
    assert door.window_of(P.Hello(stream=1, spec=spec, slots=3)) == P.MAX_WINDOW
    assert door.window_of(P.Hello(stream=1, spec=spec, slots=3, window=12)) == 12
    with pytest.raises(P.ProtocolError, match="Hello.window must be"):
        P.Hello(stream=1, spec=spec, window=P.MAX_WINDOW + 1).check()


def test_every_life_may_end_and_none_comes_back_from_its_end():
    for life, after in MAY_BECOME.items():
        assert life is Life.ENDED or Life.ENDED in after
    assert MAY_BECOME[Life.ENDED] == frozenset() and MAY_BECOME[Life.ENDING] == {Life.ENDED}


def _reachable() -> Dict[Life, Set[Life]]:
    """Lives reachable in one or more steps (a rule of the machine below may take several)."""
    out = {life: set(after) for life, after in MAY_BECOME.items()}
    changed = True
    while changed:
        changed = False
        for life, after in out.items():
            more = set().union(*(out[a] for a in after)) - after if after else set()
            if more:
                after |= more
                changed = True
    return out



def test_a_message_libzmq_names_no_connection_for_is_dropped_and_counted():
    """The shell passes fd -1 for a message without connection metadata (SRCFD), as a ZMTP 1.0
    peer's were before the data port refused them: nothing to tie it to, so nothing is answered,
    opened or bound, and the service goes on."""
    from loader_service.sources.demo import ensure_demo

    source = ensure_demo(64, quiet=True)
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0), source, workers=1)
    try:
        deliver(d, b"peer", P.Hello(stream=1, spec=SPEC, slots=2, batches=[0]), fd=-1, report=False)
        assert d.sent == [] and len(d.sessions) == 0 and d.sessions.connections == 0
        assert d.totals.bad_messages == 1 and d.totals.internal_errors == 0
    finally:
        close(d)
        source.close()

REACHABLE = _reachable()
SPEC = JobSpec(batch_size=4, image_size=64)  # 48 KiB a slot, 16 of them for a whole epoch: two do not fit in 1 MiB;
# frames under 64 KiB are copied, so sends complete at once
CLIENTS = ["a", "b", "c"]  # "c" is the bystander: it only ever sends what a good client sends
NUM_BATCHES = 16  # the demo set of 64 images in batches of 4
IN_PLAN = st.integers(0, NUM_BATCHES - 1)
HOSTILE_INTS = st.one_of(IN_PLAN, IN_PLAN, st.integers(0, 80), st.integers(0, 2**31), st.integers(-5, -1))


class DoorMachine(RuleBasedStateMachine):
    """A small batch memory (two streams of 48 slots do not fit), three clients, two workers."""

    def __init__(self):
        super().__init__()
        self.d = None

    @initialize(reclaim=st.sampled_from([3600.0, 0.0]), allowance=st.sampled_from([(4096, 1024.0), (6, 0.0), (6, 0.5)]))
    def start(self, reclaim, allowance):
        """``allowance``: the service's default, or one so small that connections are cut in every
        life of their streams (flood.py), the bystander too at times (it may ask for nothing)."""
        from loader_service.sources.demo import ensure_demo

        self.source = ensure_demo(64, quiet=True)
        self.d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0,
                                        max_shm_mb=1, reclaim_idle_s=reclaim, client_allowance=allowance[0],
                                        client_allowance_rate=allowance[1]), self.source, workers=2)
        self.cuts_seen = 0
        self.cut_clients: list = []  # (ident, len(sent), len(batches), when) at each cut
        self.idents = {c: uuid.uuid4().bytes for c in CLIENTS}
        self.fds = {c: 40 + i for i, c in enumerate(CLIENTS)}
        self.stream_ids = {c: 0 for c in CLIENTS}
        self.lives: Dict[int, Life] = {}  # id() of a stream or opening seen -> its last life
        self.held: Dict[int, object] = {}  # keeps the objects behind those ids alive

    def teardown(self):
        if self.d is not None:
            close(self.d)
            self.source.close()

    # ------------------------------------------------------------------ what the loop does after events
    def _round(self) -> None:
        self.d.tick()
        for pid in self.d.killed:  # a worker killed for its deadline: its sentinel reports it gone
            wid = pid - 10_000
            if wid in self.d.pool.workers:
                self.d.lose(wid)
        self.d.killed.clear()

    def _send(self, client: str, msg) -> None:
        if isinstance(msg, dict):  # a raw header: any values at all
            msg = [msgpack.packb({"v": P.PROTOCOL_VERSION, **msg}, use_bin_type=True)]
        deliver(self.d, self.idents[client], msg, fd=self.fds[client])
        self._round()

    def _current(self, client: str) -> Optional[object]:
        ident = self.idents[client]
        session = self.d.sessions.get(ident)
        if session is not None and session.stream is not None:
            return session.stream
        return self.d.memory.waiting.get(ident)

    # ------------------------------------------------------------------ client messages
    @rule(client=st.sampled_from(CLIENTS), prefetch=st.sampled_from([48, 16, 2, 1]),
          window=st.sampled_from([0, 2, 5, P.MAX_WINDOW]),
          batches=st.one_of(st.lists(IN_PLAN, max_size=3, unique=True), st.lists(HOSTILE_INTS, max_size=6, unique=True)),
          stale=st.sampled_from([False, False, False, True]), lookahead=st.sampled_from([False, False, True]),
          local=st.booleans())
    def hello(self, client, prefetch, window, batches, stale, lookahead, local):
        if client == "c":  # the bystander: a good client's Hello
            window, stale, lookahead, local = 4, False, False, False
            batches = list(range(min(prefetch, 4)))
        if not stale:
            self.stream_ids[client] += 1
        msg = P.Hello(stream=max(self.stream_ids[client], 1), spec=SPEC, slots=prefetch,
                      window=window, batches=[b for b in batches if b >= 0], job=f"job-{client}", lookahead=lookahead,
                      local=local)
        self._send(client, msg)

    @rule(client=st.sampled_from(["a", "b"]), prefetch=st.sampled_from([48, 16]))
    def big_hello(self, client, prefetch):
        """A stream whose slots take most of the memory and that asks for nothing yet: the next
        one like it waits (or lends, with reclaim 0)."""
        self.stream_ids[client] += 1
        self._send(client, P.Hello(stream=self.stream_ids[client], spec=SPEC, slots=prefetch,
                                   job=f"job-{client}"))

    @rule(client=st.sampled_from(["a", "b"]), past=st.booleans())
    def ask_again(self, client, past):
        """Two Requests for the same batch, or one past the end: in whatever life the stream is."""
        batch = NUM_BATCHES + 7 if past else 3
        for _ in range(1 if past else 2):
            self._send(client, P.Request(stream=max(self.stream_ids[client], 0), batches=[batch]))

    @rule(client=st.sampled_from(["a", "b"]), batches=st.lists(HOSTILE_INTS, max_size=8),
          final=st.sampled_from([False, False, True]), probe=st.booleans(), which=st.sampled_from([0, 0, 0, -1, 1]),
          huge=st.sampled_from([False, False, False, True]), promote=st.booleans())
    def request(self, client, batches, final, probe, which, huge, promote):
        stream = max(self.stream_ids[client] + which, 0)
        if huge:
            batches = list(range(5000)) + batches  # a flood of asks in one message
        batches = [b for b in batches if b >= 0]
        if len(set(batches)) != len(batches) or len(batches) > 1 << 16:
            self._send(client, {"t": int(P.MsgType.REQUEST), "stream": stream, "batches": batches})
        else:
            self._send(client, P.Request(stream=stream, batches=batches, final=final, probe=probe, promote=promote))

    @rule(client=st.sampled_from(["a", "b", "a", "b", "c"]), kind=st.sampled_from(["malformed", "malformed", "bye", "describe"]),
          which=st.sampled_from([0, -1, 1]),
          field=st.sampled_from(["wait_s", "n", "batches", "stream", "final"]),
          value=st.one_of(st.just(math.nan), st.just(math.inf), st.just("x"), st.just([1, "2"]), st.just(None),
                          st.just({"k": 1}), st.just(-1.5), st.just(2**64 - 1)),
          mtype=st.sampled_from([P.MsgType.REQUEST, 2, P.MsgType.HELLO, P.MsgType.BYE, 99]))  # 2: Credit once
    def other_message(self, client, kind, which, field, value, mtype):
        """A malformed header, a Bye or a Describe (the bystander only says Bye)."""
        if client == "c" or kind == "bye":
            return self._send(client, P.Bye())
        if kind == "describe":
            return self._send(client, P.Describe())
        stream = max(self.stream_ids[client] + which, 0)
        header = {"t": int(mtype), "stream": stream, "n": 1, "batches": [0]}
        header[field] = value
        self._send(client, header)

    @rule(client=st.sampled_from(["a", "b"]), batches=st.lists(HOSTILE_INTS, max_size=4),
          borrowed=st.sampled_from([True, True, False]), which=st.sampled_from([0, 0, -1, 1]),
          by=st.sampled_from(["release", "request"]), ask=st.lists(IN_PLAN, max_size=2, unique=True))
    def release(self, client, batches, borrowed, which, by, ask):
        """A co-located client's Release (issue 41): of batches it borrows (a good one), of
        others, twice, or for another stream, in whatever life the stream is; in a Release, or
        taken along by a Request (``Request.released``, asking for ``ask``)."""
        stream = max(self.stream_ids[client] + which, 0)
        s = self._current(client)
        if borrowed and isinstance(s, Stream) and s.borrowed:
            batches = sorted(s.borrowed)[:2] + batches[:1]
        batches = [b for b in batches if b >= 0]
        if by == "request":
            header = {"t": int(P.MsgType.REQUEST), "stream": stream, "batches": ask, "released": batches}
        else:
            header = {"t": int(P.MsgType.RELEASE), "stream": stream, "batches": batches}
        if len(set(batches)) != len(batches):
            self._send(client, header)
        elif by == "request":
            self._send(client, P.Request(stream=stream, batches=ask, released=batches))
        else:
            self._send(client, P.Release(stream=stream, batches=batches))

    @rule(client=st.sampled_from(["a", "b"]))
    def disconnect(self, client):
        fd = self.fds[client]
        if fd in self.d.fds_seen:
            self.d.event(zmq.EVENT_DISCONNECTED, fd)
            self.d.read_monitor()
            self.d.fds_seen.discard(fd)
            self.fds[client] = fd + 100  # its next connection
        self._round()

    @rule(data=st.data())
    def bystander_asks(self, data):
        s = self._current("c")
        if not isinstance(s, Stream) or s.state.final:
            return
        unsent = len(s.state.order) - s.state.next_send
        nxt = [b for b in range(s.plan.num_batches) if not s.state.has(b)][: max(0, 4 - unsent)]
        take = data.draw(st.integers(0, len(nxt)))
        last = take == len(nxt) and data.draw(st.booleans())
        self._send("c", P.Request(stream=s.id, batches=nxt[:take], final=last))

    # ------------------------------------------------------------------ workers, libzmq, time
    @precondition(lambda self: self.d is not None and any(w.tasks for w in self.d.pool.workers.values()))
    @rule(data=st.data(), how=st.sampled_from(["done", "done", "done", "failed", "lost", "lost between"]))
    def a_worker_ends_a_task(self, data, how):
        wid = data.draw(st.sampled_from(sorted(w for w, r in self.d.pool.workers.items() if r.tasks)))
        if how == "done":
            self.d.finish(wid)
        elif how == "failed":
            self.d.finish(wid, ok=False, error="DecodeError: not a JPEG")
        else:
            self.d.lose(wid, died_on_first=how == "lost")
        self._round()

    @precondition(lambda self: self.d is not None and self.d.sending)
    @rule(data=st.data())
    def libzmq_lets_go_of_a_batch(self, data):
        self.d.let_go(data.draw(st.integers(0, len(self.d.sending) - 1)))
        self._round()

    @rule(reading=st.booleans())
    def clients_read_or_stop(self, reading):
        """Clients read what they are sent as it comes (the Accepts held till now go to the kernel),
        or stop reading: libzmq holds each Accept until :meth:`libzmq_lets_go_of_an_accept`."""
        self.d.reading = reading
        if reading:
            self.d.flush()
        self._round()

    @precondition(lambda self: self.d is not None and self.d.flushing)
    @rule(data=st.data())
    def libzmq_lets_go_of_an_accept(self, data):
        self.d.flush(self.d.flushing[data.draw(st.integers(0, len(self.d.flushing) - 1))][1].ident)
        self._round()

    @rule(seconds=st.sampled_from([0.5, 30.0, 5000.0]))
    def time_passes(self, seconds):
        self.d.now += seconds
        self._round()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def no_guard_fired(self):
        if self.d is not None:
            assert self.d.totals.internal_errors == 0

    @invariant()
    def what_a_connection_holds_stays_within_its_window(self):
        if self.d is None:
            return
        for o in self.d.memory.waiting.values():
            assert len(o.order) <= door.window_of(o.hello)
        for s in self.d.sessions.streams():
            assert len(s.state.order) - s.state.next_send <= door.window_of(s.hello)
            assert len({t.slot for t in s.state.tasks.values()}) <= s.state.num_slots

    @invariant()
    def a_borrowed_slot_is_a_slot_in_flight(self):
        """Every batch a co-located client borrows holds its slot as a send in flight, so the slot
        is neither written nor lent to another stream until it comes back, also after its stream ended."""
        if self.d is None:
            return
        for s in [*self.d.sessions.streams(), *self.d.memory.retiring]:
            assert set(s.borrowed.values()) <= s.state.sending  # ended streams keep theirs until the client moves on

    @invariant()
    def no_batch_leaves_twice(self):
        if self.d is not None:
            sent = [(ident, b.stream, b.index) for ident, b in self.d.batches]
            assert len(set(sent)) == len(sent)

    @invariant()
    def a_cut_client_is_sent_nothing_while_what_it_sends_is_dropped(self):
        if self.d is None:
            return
        for fd, sent, batches, when in self.d.cut_marks[self.cuts_seen:]:
            client = next(c for c in CLIENTS if self.fds[c] == fd)
            self.cut_clients.append((self.idents[client], sent, batches, when))
        self.cuts_seen = len(self.d.cut_marks)
        if self.cut_clients:
            event("a connection was cut")
        for ident, sent, batches, when in self.cut_clients:
            if self.d.now < when + REMEMBER_S:
                assert ident not in self.d.sessions
                assert all(i != ident for i, _ in self.d.sent[sent:])
                assert all(i != ident for i, _ in self.d.batches[batches:])

    @invariant()
    def the_bystander_is_never_failed_by_what_others_send(self):
        if self.d is None:
            return
        for ident, m in self.d.sent:
            if ident == self.idents["c"] and isinstance(m, P.Error):
                # memory others hold, or the workers this model kills on its samples: never a message
                assert m.code in (P.ErrorCode.NO_CAPACITY, P.ErrorCode.SAMPLE_FAILED) or not m.fatal, m

    @invariant()
    def work_has_slots_and_nothing_waits_for_room_that_exists(self):
        """The memory policy's own invariants (tests/unit/dispatch/test_memory.py checks them on
        BatchMemory alone), here through the real DispatchState's glue."""
        if self.d is None:
            return
        m, now = self.d.memory, self.d.now
        for s in self.d.sessions.streams():
            if s.state.tasks or s.state.made or s.state.sending:
                assert s.segment is not None, f"stream {s.id} works without slots"
            assert s.ident not in m.waiting, "streaming and waiting at once"
        for s in m.starved:
            assert s.segment is None
        lendable = [s for s in self.d.sessions.streams() if s.segment is not None and s.state.settled
                    and now - s.asked_at >= m.reclaim_idle_s]
        free = m.max_bytes - m.in_use() + m.reserved() + sum(s.nbytes for s in lendable)
        held = {e.ident for _, e in self.d.flushing}
        for o in m.waiting.values():
            behind = m.behind(o.ident)
            if "Accept" in behind:
                event("a new stream waits for its client to read what came before")
                assert o.ident in held, "held back for an Accept libzmq let go of"
            elif behind:
                event("a new stream waits for its replaced streams' sends")
                assert sum(s.ident == o.ident and s.segment is not None for s in m.retiring) > 1
            else:
                assert o.nbytes > free, "a new stream waits although there is room"
        for s in m.starved:
            assert s.nbytes > free, "a stream waits for its slots although there is room"

    @invariant()
    def a_client_behind_in_reading_is_sent_no_new_stream(self):
        """What libzmq may hold for one connection stays bounded however often its client says
        Hello without reading: one Accept at a time not let go of (the copied batches queued
        before it are of one stream), and at most two replaced streams holding slots for sends."""
        if self.d is None:
            return
        for client, ident in self.idents.items():
            assert sum(e.ident == ident for _, e in self.d.flushing) <= 1, f"client {client}: two Accepts held"
            held = sum(s.ident == ident and s.segment is not None for s in self.d.memory.retiring)
            session = self.d.sessions.get(ident)
            live = session is not None and session.stream is not None
            assert held <= RETIRING_HELD_MAX + (0 if live else 1), f"client {client}: {held} replaced streams hold"

    @invariant()
    def the_memory_s_counts_and_each_life_move_are_right(self):
        if self.d is None:
            return
        self.d.memory.check_counts()
        seen = list(self.d.sessions.streams()) + list(self.d.memory.waiting.values()) + list(self.d.memory.retiring)
        for x in seen:
            self.held[id(x)] = x
        for key, x in self.held.items():
            life = self.d.memory.life(x)
            if isinstance(x, Stream):  # the life each stream keeps is the one its parts say
                assert x.life is life, f"stream {x.id} keeps {x.life}, its parts say {life}"
            before = self.lives.get(key)
            if before is not None and before != life:
                assert life in REACHABLE[before], f"{before} -> {life}"
            self.lives[key] = life


TestDoor = DoorMachine.TestCase
TestDoor.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

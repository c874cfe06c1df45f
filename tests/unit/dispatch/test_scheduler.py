"""Scheduler: which stream an idle worker is given.

The dispatcher tells the scheduler when a stream may have a task to give (``ready``: it opened,
got credit, a slot came free...), when it ended (``forget``), and calls
``pick(len(idle), dispatchable, tier, take)``; ``take`` hands one task of that stream to one
idle worker, and the dispatcher asserts that the stream had a task to give. Here a stream is a
plain object with a count of tasks it can still hand out; ``take`` uses one up and records the name.
A stream's tier (``tier``): a current epoch whose client reads (or that was sent nothing yet),
then a lookahead, then a current epoch that was sent batches and whose client asked for nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loader_service.dispatch.scheduler import LOOKAHEAD, READING, UNREAD, Scheduler, tier


class FakeStream:
    def __init__(self, name: str, work: int, lookahead: bool = False, sent: int = 0, asked: bool = False):
        self.name, self.work, self.lookahead, self.sent, self.asked = name, work, lookahead, sent, asked

    @property
    def tier(self) -> int:
        return tier(self.lookahead, self.sent, self.asked)

    def __repr__(self) -> str:
        return f"{self.name}(work={self.work}, tier={self.tier})"


def pick(sched: Scheduler, streams: list[FakeStream], idle: int) -> list[str]:
    """One pick as the dispatcher makes it, after an event on each of ``streams`` (so each is a
    candidate); returns the names given a worker, in order."""
    given: list[str] = []

    def take(s: FakeStream) -> None:
        assert s.work > 0, f"the scheduler gave a worker to {s}, which has nothing to do"
        s.work -= 1
        given.append(s.name)

    for s in streams:
        sched.offer(s, s.tier)
    n = sched.pick(idle, lambda s: s.work > 0, lambda s: s.tier, take)
    assert n == len(given), "pick() must return how many tasks it handed out"
    return given


def streams(*specs: str, work: int = 100) -> list[FakeStream]:
    """``"A"`` is a current stream, ``"L*"`` a lookahead one; each with ``work`` tasks."""
    return [FakeStream(name, work, lookahead=name.startswith("L")) for name in specs]


# ------------------------------------------------------------------ nothing to give

@pytest.mark.parametrize("idle", [0, -1])
def test_no_stream_is_given_anything_when_no_worker_is_idle(idle):
    assert pick(Scheduler(), streams("A", "B"), idle) == []


def test_no_worker_is_handed_out_when_no_stream_has_work():
    ss = streams("A", "LB", work=0)
    assert pick(Scheduler(), ss, 4) == []


def test_no_worker_is_handed_out_when_there_are_no_streams():
    assert pick(Scheduler(), [], 4) == []


def test_idle_workers_beyond_the_waiting_work_stay_idle():
    ss = [FakeStream("A", 2), FakeStream("B", 1)]
    given = pick(Scheduler(), ss, 10)
    assert sorted(given) == ["A", "A", "B"]
    assert [s.work for s in ss] == [0, 0]


# ------------------------------------------------------------------ taking turns

def test_streams_take_turns_when_one_worker_is_idle_at_a_time():
    sched, ss = Scheduler(), streams("A", "B", "C")
    order = [name for _ in range(6) for name in pick(sched, ss, 1)]
    assert order == ["A", "B", "C", "A", "B", "C"]


def test_several_idle_workers_are_spread_from_the_stream_that_waited_longest():
    sched, ss = Scheduler(), streams("A", "B", "C")
    assert pick(sched, ss, 5) == ["A", "B", "C", "A", "B"]
    assert pick(sched, ss, 2) == ["C", "A"]  # C waited longest, then A


def test_a_stream_that_runs_out_of_work_mid_pick_leaves_its_share_to_the_others():
    sched = Scheduler()
    ss = [FakeStream("A", 100), FakeStream("B", 1), FakeStream("C", 100)]
    given = pick(sched, ss, 5)
    assert given == ["A", "B", "C", "A", "C"]


def test_a_call_with_no_idle_worker_does_not_use_up_a_streams_turn():
    sched, ss = Scheduler(), streams("A", "B", "C")
    assert pick(sched, ss, 1) == ["A"]
    assert pick(sched, ss, 0) == []
    assert pick(sched, streams("X", work=0), 1) == ["B"]  # X has nothing to do: it takes no turn
    assert pick(sched, ss, 1) == ["C"]


def test_a_stream_that_is_always_ready_gets_a_turn_while_another_one_comes_and_goes():
    sched = Scheduler()
    a, b, c = streams("A", "B", "C")
    served = []
    for call in range(12):
        c.work = 100 if call % 2 else 0  # C has work at every other call only (e.g. a credit of one)
        served += pick(sched, [a, b, c], 1)
    assert "A" in served, f"A was ready at all 12 calls and never served: {served}"


# ------------------------------------------------------------------ lookahead streams

def test_a_lookahead_stream_waits_while_a_current_one_has_work():
    sched = Scheduler()
    a, la = FakeStream("A", 2), FakeStream("LA", 10, lookahead=True)
    assert pick(sched, [a, la], 5) == ["A", "A", "LA", "LA", "LA"]


def test_a_lookahead_stream_listed_first_still_waits_for_the_current_ones():
    sched = Scheduler()
    la, a, b = FakeStream("LA", 10, lookahead=True), FakeStream("A", 1), FakeStream("B", 1)
    given = pick(sched, [la, a, b], 2)
    assert sorted(given) == ["A", "B"] and la.work == 10


def test_a_lookahead_stream_gets_the_idle_worker_when_no_current_stream_has_work():
    sched = Scheduler()
    a, la = FakeStream("A", 0), FakeStream("LA", 10, lookahead=True)
    assert pick(sched, [a, la], 2) == ["LA", "LA"]


def test_lookahead_streams_take_turns_among_themselves():
    sched, ss = Scheduler(), streams("LA", "LB", "LC")
    order = [name for _ in range(3) for name in pick(sched, ss, 1)]
    assert order == ["LA", "LB", "LC"]


def test_a_current_stream_with_work_is_served_before_every_lookahead_stream_at_every_turn():
    sched = Scheduler()
    ss = streams("LA", "A", "LB")
    order = [name for _ in range(5) for name in pick(sched, ss, 1)]
    assert order == ["A"] * 5


# ------------------------------------------------------------------ newcomers and floods

def test_a_new_stream_joins_at_the_back_of_the_line():
    sched = Scheduler()
    a = FakeStream("A", 100)
    assert pick(sched, [a], 1) == ["A"]
    xs = [FakeStream(f"X{i}", 1) for i in range(3)]
    order = [name for _ in range(5) for name in pick(sched, xs + [a], 1)]
    # A was last served before the X joined: it goes first, then waits one round, not for ever
    assert order == ["A", "X0", "X1", "X2", "A"]


def test_a_stream_keeps_its_turn_while_newcomers_keep_coming():
    """A flood: a new one-task stream joins before every pick, and a stream that always has work
    still gets a task every round: between two of its tasks, only streams that were waiting when
    it got the first one are served, each once (never served first starved it, issue 32)."""
    sched, a = Scheduler(), FakeStream("A", 10**6)
    ahead = [FakeStream(f"F{i}", 1) for i in range(50)]  # joined before A
    pick(sched, ahead + [a], 0)
    served, joined = [], {f"F{i}": -1 for i in range(50)}
    for i in range(400):
        joined[f"N{i}"] = i
        served += pick(sched, [FakeStream(f"N{i}", 1), a], 1)
    turns = [k for k, n in enumerate(served) if n == "A"]
    assert turns[0] == 50 and len(turns) >= 6, served
    for prev, nxt in zip(turns, turns[1:]):
        between = served[prev + 1:nxt]
        assert len(set(between)) == len(between) and all(joined[n] <= prev for n in between), between


def test_a_pick_asks_only_the_streams_in_the_line_however_many_cannot_take_a_task():
    sched, asked = Scheduler(), Counter()
    idle_ones = [FakeStream(f"I{i}", 1) for i in range(2000)]
    pick(sched, idle_ones, 2000)  # each served once; now none has work, and no event says otherwise
    a = FakeStream("A", 100)

    def dispatchable(s):
        asked[s.name] += 1
        return s.work > 0

    def take(s):
        s.work -= 1

    sched.offer(a, False)
    for _ in range(10):
        assert sched.pick(1, dispatchable, lambda s: s.lookahead, take) == 1
    assert a.work == 90
    assert sum(asked.values()) <= 20, f"a pick asked {sum(asked.values())} streams"


def test_a_forgotten_stream_is_never_given_a_task_and_the_line_does_not_keep_it():
    sched = Scheduler()
    ss = [FakeStream(f"S{i}", 5) for i in range(200)]
    for s in ss:
        sched.offer(s, False)
    for s in ss[:199]:
        sched.forget(s)
    given = []
    sched.pick(10, lambda s: s.work > 0, lambda s: s.lookahead, lambda s: given.append(s.name) or setattr(
        s, "work", s.work - 1))
    assert given == ["S199"] * 5
    assert len(sched) == 1 and sched.candidates == 0


# ------------------------------------------------------------------ clients that read nothing

@pytest.mark.parametrize("lookahead,sent,asked,expected", [
    (False, 0, False, READING),  # nothing sent yet: a newcomer is not suspected
    (False, 3, True, READING),  # its client asked for more: it reads
    (False, 1, False, UNREAD),  # sent a batch, asked for nothing since
    (True, 0, False, LOOKAHEAD),
    (True, 4, False, LOOKAHEAD),  # a lookahead's batches wait for its epoch: not a sign of anything
])
def test_the_tier_of_a_stream(lookahead, sent, asked, expected):
    assert tier(lookahead, sent, asked) == expected


def test_streams_whose_clients_read_nothing_go_after_readers_and_lookaheads():
    r = FakeStream("R", 2, sent=3, asked=True)
    la = FakeStream("LA", 1, lookahead=True)
    flood = [FakeStream(f"F{i}", 5, sent=1) for i in range(3)]
    assert pick(Scheduler(), [*flood, la, r], 6) == ["R", "R", "LA", "F0", "F1", "F2"]


def test_a_newcomer_that_was_sent_nothing_goes_before_streams_that_read_nothing():
    sched: Scheduler = Scheduler()
    flood = [FakeStream(f"F{i}", 5, sent=1) for i in range(100)]
    pick(sched, flood, 0)  # in the line first
    assert pick(sched, [FakeStream("N", 3)], 1) == ["N"]


def test_a_stream_that_starts_reading_goes_back_to_the_first_tier():
    sched: Scheduler = Scheduler()
    a, f = FakeStream("A", 5, sent=1), FakeStream("F", 5, sent=1)
    assert pick(sched, [a, f], 1) == ["A"]  # both unread: least recently served
    a.asked = True
    assert pick(sched, [a, f], 2) == ["A", "A"]


# ------------------------------------------------------------------ streams joining and leaving

@settings(max_examples=150, stateful_step_count=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
class SchedulerModel(RuleBasedStateMachine):
    """Streams join, leave, get more work (credit, after which the dispatcher says ``ready``) or
    lose it silently (their slots lent), lookahead ones are promoted; idle workers come in batches.

    After every pick: only streams with work were given a worker; no lookahead stream was given
    one while a current stream still had work; no worker stayed idle while any stream had work;
    and across picks, a stream that has had work all along waits at most one round: no other
    stream (a current one, if it is current itself) got two tasks since it last got one or got
    its work, and no stream that joined since was served before it (a newcomer joins at the back)."""

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler = Scheduler()
        self.streams: list[FakeStream] = []
        self.next_name = 0
        self.since: dict[str, Counter] = {}  # a stream with work -> tasks the others got since its wait began
        self.clock = 0  # counts events: when a stream joined, when a wait began
        self.joined: dict[str, int] = {}
        self.wait_began: dict[str, int] = {}

    def _has_work(self, s: FakeStream, work: int) -> None:
        self.clock += 1
        if s.work == 0 and work > 0:
            self.since[s.name] = Counter()
            self.wait_began[s.name] = self.clock
        s.work = work
        if not work:
            self.since.pop(s.name, None)

    @rule(work=st.integers(0, 6), lookahead=st.booleans())
    def join(self, work, lookahead):
        s = FakeStream(f"{'L' if lookahead else 'S'}{self.next_name}", 0, lookahead)
        self.next_name += 1
        self.streams.append(s)
        self.clock += 1
        self.joined[s.name] = self.clock
        self._has_work(s, work)
        self.sched.offer(s, s.tier)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def leave(self, data):
        s = data.draw(st.sampled_from(self.streams))
        self.streams.remove(s)
        self.since.pop(s.name, None)
        self.sched.forget(s)

    def _tier_changed(self, s: FakeStream, before: int) -> None:
        if s.tier != before and s.name in self.since:
            self.since[s.name] = Counter()  # it waits in another tier from now on
        self.sched.offer(s, s.tier)

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), more=st.integers(0, 4))
    def credit(self, data, more):
        """The client asks for ``more`` (0: a probe); asking at all says it reads what it is sent."""
        s = data.draw(st.sampled_from(self.streams))
        before = s.tier
        self._has_work(s, s.work + more)
        s.asked = s.asked or more > 0
        self._tier_changed(s, before)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def run_dry(self, data):
        self._has_work(data.draw(st.sampled_from(self.streams)), 0)

    @precondition(lambda self: any(s.lookahead for s in self.streams))
    @rule(data=st.data())
    def lookahead_becomes_current(self, data):
        s = data.draw(st.sampled_from([s for s in self.streams if s.lookahead]))
        before = s.tier
        s.lookahead = False
        self._tier_changed(s, before)

    @rule(idle=st.integers(0, 8))
    def idle_workers(self, idle):
        before = sum(s.work for s in self.streams)
        given: list[str] = []
        by_name = {s.name: s for s in self.streams}

        def take(s: FakeStream) -> None:
            assert s in self.streams, f"{s.name} left and was given a worker"
            assert s.work > 0, f"{s.name} was given a worker with nothing to do"
            first = [x.name for x in self.streams if x.tier < s.tier and x.work > 0]
            assert not first, f"{s.name} (tier {s.tier}) served while {first} of a lower tier had work"
            for y, others in self.since.items():
                if y == s.name:
                    continue
                others[s.name] += 1
                if by_name[y].tier != s.tier:
                    continue  # another tier: the check above
                assert self.joined[s.name] < self.wait_began[y], \
                    f"{s.name} joined after {y} began to wait and was served first: {given}"
                assert others[s.name] < 2 or by_name[y].work == 0, \
                    f"{s.name} got {others[s.name]} tasks while {y} waited with work: {given}"
            tier_before = s.tier
            self._has_work(s, s.work - 1)
            s.sent += 1  # its batch goes out: a stream whose client asked for nothing drops a tier
            if s.work:
                self.since[s.name] = Counter()
                self.wait_began[s.name] = self.clock
            if s.tier != tier_before:
                for others in self.since.values():
                    others.pop(s.name, None)  # it competes in another tier from now on
            given.append(s.name)

        n = self.sched.pick(idle, lambda s: s.work > 0, lambda s: s.tier, take)
        assert n == len(given)
        assert n == min(max(idle, 0), before), "a worker stayed idle while a stream had work"

    @invariant()
    def no_stream_has_negative_work(self):
        assert all(s.work >= 0 for s in self.streams)


TestSchedulerModel = SchedulerModel.TestCase

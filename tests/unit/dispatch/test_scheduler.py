"""Scheduler: which stream an idle worker is given.

The dispatcher calls ``pick(streams, len(idle), dispatchable, lookahead, take)`` with the
streams of its sessions in session order; ``take`` hands one task of that stream to one idle
worker, and the dispatcher asserts that the stream had a task to give. Here a stream is a plain
object with a count of tasks it can still hand out; ``take`` uses one up and records the name.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loader_service.dispatch.scheduler import Scheduler


class FakeStream:
    def __init__(self, name: str, work: int, lookahead: bool = False):
        self.name, self.work, self.lookahead = name, work, lookahead

    def __repr__(self) -> str:
        return f"{self.name}(work={self.work}, lookahead={self.lookahead})"


def pick(sched: Scheduler, streams: list[FakeStream], idle: int) -> list[str]:
    """One pick as the dispatcher makes it; returns the names given a worker, in order."""
    given: list[str] = []

    def take(s: FakeStream) -> None:
        assert s.work > 0, f"the scheduler gave a worker to {s}, which has nothing to do"
        s.work -= 1
        given.append(s.name)

    n = sched.pick(streams, idle, lambda s: s.work > 0, lambda s: s.lookahead, take)
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
    assert pick(sched, streams("X", work=0), 3) == []
    assert pick(sched, ss, 1) == ["B"]


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


# ------------------------------------------------------------------ streams joining and leaving

@settings(max_examples=60, stateful_step_count=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
class SchedulerModel(RuleBasedStateMachine):
    """Streams join, leave, get more work (credit) or lose it; idle workers come in batches.

    After every pick: only streams with work were given a worker; no lookahead stream was given
    one while a current stream in the list still had work; no worker stayed idle while any
    stream had work; within each kind, a stream given two tasks more than another left that
    other one without work (round-robin inside a call)."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = Scheduler()
        self.streams: list[FakeStream] = []
        self.next_name = 0

    @rule(work=st.integers(0, 6), lookahead=st.booleans())
    def join(self, work, lookahead):
        self.streams.append(FakeStream(f"{'L' if lookahead else 'S'}{self.next_name}", work, lookahead))
        self.next_name += 1

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def leave(self, data):
        self.streams.remove(data.draw(st.sampled_from(self.streams)))

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), more=st.integers(0, 4))
    def credit(self, data, more):
        data.draw(st.sampled_from(self.streams)).work += more

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def run_dry(self, data):
        data.draw(st.sampled_from(self.streams)).work = 0

    @precondition(lambda self: any(s.lookahead for s in self.streams))
    @rule(data=st.data())
    def lookahead_becomes_current(self, data):
        data.draw(st.sampled_from([s for s in self.streams if s.lookahead])).lookahead = False

    @rule(idle=st.integers(0, 8))
    def idle_workers(self, idle):
        before: dict[str, int] = {s.name: s.work for s in self.streams}
        given: list[str] = []

        def take(s: FakeStream) -> None:
            assert s.work > 0, f"{s.name} was given a worker with nothing to do"
            if s.lookahead:
                waiting = [x.name for x in self.streams if not x.lookahead and x.work > 0]
                assert not waiting, f"lookahead {s.name} served while current {waiting} had work"
            s.work -= 1
            given.append(s.name)

        n = self.sched.pick(list(self.streams), idle, lambda s: s.work > 0, lambda s: s.lookahead, take)
        assert n == len(given)
        assert n == min(max(idle, 0), sum(before.values())), "a worker stayed idle while a stream had work"
        for kind in (False, True):
            group = [s for s in self.streams if s.lookahead == kind]
            for x in group:
                for y in group:
                    if given.count(x.name) >= given.count(y.name) + 2:
                        assert y.work == 0, f"{x.name} got {given.count(x.name)} tasks, {y.name} " \
                                            f"{given.count(y.name)} with work left: {given}"

    @invariant()
    def no_stream_has_negative_work(self):
        assert all(s.work >= 0 for s in self.streams)


TestSchedulerModel = SchedulerModel.TestCase

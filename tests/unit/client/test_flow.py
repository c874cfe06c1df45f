"""The ordering window (InOrder) returns what may go to the sink, and, with the flow control
(EpochFlow), keeps one epoch's bookkeeping right whatever the order of events: a state machine
of replicas answering in any order, services that restart and ask again, replicas given up on
and back, a trainer that takes batches when it can."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from client.flow import EpochFlow, InOrder


def test_nothing_is_due_until_the_next_in_plan_order_arrives():
    w = InOrder(first=3, ahead=2)
    w.put(4, "b4")
    assert w.due(next_yield=3) == []
    w.put(3, "b3")
    assert w.due(next_yield=3) == ["b3", "b4"]
    assert w.due(next_yield=3) == [] and w.held == {} and w.next_out == 5


def test_at_most_ahead_beyond_the_next_batch_to_yield():
    w = InOrder(first=0, ahead=2)
    for k in (3, 2, 1, 0):
        w.put(k, f"b{k}")
    assert w.due(next_yield=0) == ["b0", "b1"]
    assert w.due(next_yield=0) == []  # b2 waits until the trainer has b0
    assert w.due(next_yield=1) == ["b2"]
    assert w.due(next_yield=2) == ["b3"]
    assert w.held == {}


def test_ahead_must_be_positive():
    with pytest.raises(ValueError, match="ahead must be >= 1"):
        InOrder(0, 0)


class EpochBookkeeping(RuleBasedStateMachine):
    """One epoch's flow control and ordering window, with the services played by the rules: what
    each replica was asked for and has not sent is its queue."""

    @initialize(replicas=st.integers(1, 3), credit=st.integers(1, 3), ahead=st.integers(1, 3),
                total=st.integers(0, 25), start=st.integers(0, 5))
    def begin(self, replicas, credit, ahead, total, start):
        start = min(start, total)
        self.window_size, self.ahead, self.start = credit * replicas, ahead, start
        self.flow = EpochFlow(start, total, self.window_size, credit, replicas)
        self.window = InOrder(start, ahead)
        self.queues = [[] for _ in range(replicas)]
        self.dead = [False] * replicas
        self.pushed = []  # in the sink: pushed, not yet yielded
        self.yielded = []
        self.clock = 0
        self._ask()

    def _ask(self):
        live = [r for r, d in enumerate(self.dead) if not d]
        if not self.flow.unasked():  # what EpochRun._ask skips on: then there is nothing to assign
            assert self.flow.assign(live, self.clock) == {}
            return
        for r, batches in self.flow.assign(live, self.clock).items():
            assert not self.dead[r]
            self.queues[r].extend(batches)

    def _live(self):
        return [r for r, d in enumerate(self.dead) if not d]

    # preconditions, not assume(): a rule that cannot run is never drawn, so no draw is wasted
    @precondition(lambda self: any(self.queues[r] for r in self._live()))
    @rule(data=st.data())
    def a_replica_sends_any_batch_it_owes(self, data):
        owing = [r for r in self._live() if self.queues[r]]
        r = data.draw(st.sampled_from(owing))
        b = data.draw(st.sampled_from(self.queues[r]))
        self.queues[r].remove(b)
        self.clock += 1
        assert self.flow.on_batch(r, b, self.clock)
        self.window.put(b, ("payload", b))
        self._ask()

    @rule()
    def the_sink_takes_what_is_due(self):
        due = self.window.due(self.flow.next_yield)
        expected = self.start + len(self.yielded) + len(self.pushed)
        assert due == [("payload", b) for b in range(expected, expected + len(due))]  # plan order, no gap
        self.pushed.extend(b for _, b in due)

    @precondition(lambda self: self.pushed)
    @rule()
    def the_trainer_takes_the_next_batch(self):
        b = self.flow.take()
        assert self.pushed.pop(0) == b
        self.yielded.append(b)
        self._ask()

    @rule(data=st.data())
    def a_service_restarts_and_is_asked_again_for_what_it_owes(self, data):
        r = data.draw(st.sampled_from(self._live()))
        self.queues[r] = sorted(self.flow.outstanding[r])

    @precondition(lambda self: len(self._live()) > 1)
    @rule(data=st.data())
    def a_replica_is_given_up_on(self, data):
        live = self._live()
        r = data.draw(st.sampled_from(live))
        assert self.flow.lose(r) == sorted(self.queues[r])
        self.queues[r], self.dead[r] = [], True
        self._ask()

    @precondition(lambda self: any(self.dead))
    @rule(data=st.data())
    def a_replica_comes_back(self, data):
        dead = [r for r, d in enumerate(self.dead) if d]
        self.dead[data.draw(st.sampled_from(dead))] = False
        self._ask()

    @invariant()
    def bounded_by_the_window(self):
        assert self.flow.in_flight() <= self.window_size
        assert len(self.window.held) + len(self.pushed) <= self.window_size

    @invariant()
    def the_sink_holds_only_the_next_few_in_order(self):
        assert self.pushed == list(range(self.flow.next_yield, self.flow.next_yield + len(self.pushed)))
        assert len(self.pushed) <= self.ahead

    @invariant()
    def every_batch_once_in_plan_order(self):
        assert self.yielded == list(range(self.start, self.flow.next_yield))

    @invariant()
    def what_is_owed_is_what_the_services_were_asked(self):
        for r in range(len(self.dead)):
            assert set(self.queues[r]) == self.flow.outstanding[r]

    @invariant()
    def never_stuck(self):
        if self.flow.done:
            return
        can_send = any(self.queues[r] for r in self._live())
        can_take = bool(self.pushed) or self.flow.next_yield in self.window.held
        assert can_send or can_take, (self.flow.outstanding, self.window.held, self.dead)


TestEpochBookkeeping = EpochBookkeeping.TestCase
TestEpochBookkeeping.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)

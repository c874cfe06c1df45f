"""The epoch lookahead without sockets (the stand-ins of tests/unit/client/fakes.py): started
once per epoch on a spare set, adopted only for that epoch from its start once every service
accepted it, dropped (its set closed) otherwise; after an adoption the set the last epoch ran on
is the next spare. A state machine plays epochs ending, iterations of any epoch and cursor, and
services that accept, refuse, lose or never answer the lookahead's streams."""

from __future__ import annotations

import logging

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from wire import protocol as P

from client.lookahead import Lookahead
from client.stats import LoaderStats

from tests.unit.client.fakes import Clock, FakeConnections, FakeReplica

TOTAL = 6


def answer(r: FakeReplica, outcome: str, clock: Clock, spare: FakeConnections = None) -> None:
    """The service's answer to the lookahead stream on ``r`` (of the set ``spare``)."""
    if outcome == "accept":
        r.answer_hello(TOTAL)
    elif outcome == "accept_after_handshake":  # the spare still in its handshake: waited for
        r.down_since = clock.now
        r.answer_hello(TOTAL)
    elif outcome == "refuse":
        r.inbox.append((P.Error(code="no_capacity", message="would leave less than 2 slots", stream=r.stream), None))
    elif outcome == "lost":  # connected, then dropped: the service forgot the stream
        r.was_connected, r.down_since = True, clock.now
    elif outcome == "other_length":
        r.answer_hello(TOTAL + 1)
    elif outcome == "accept_moved":  # its Accept shows it on the other side of the shared memory
        spare.colocated ^= {r.endpoint}
        r.answer_hello(TOTAL)
    # "silent": nothing within the timeout


def test_adopted_for_that_epoch_from_its_start_and_the_old_set_becomes_the_spare():
    clock, stats = Clock(), LoaderStats(batches=7)
    current = FakeConnections(2, 4, clock)
    ahead = Lookahead(timeout=5.0, stats=stats)
    ahead.start(current, 3, TOTAL)
    spare = ahead.spare
    assert spare is current.twins[0] and ahead.epoch == 3
    assert [(h[1], h[3]) for r in spare.replicas for h in r.hellos] == [(3, True)] * 2  # lookahead streams of 3
    ahead.start(current, 3, TOTAL)
    assert current.twins == [spare] and all(len(r.hellos) == 1 for r in spare.replicas)  # one at a time
    for r in spare.replicas:
        answer(r, "accept", clock)
    got, flow = ahead.adopt(current, 3, 0, TOTAL, sink=None)
    assert got is spare and flow.total == TOTAL and flow.next_yield == 0
    assert ahead.spare is current and ahead.flow is None and not current.closed
    assert all(r.requests == [dict(batches=[], consumed=7, promote=True, final=False, probe=False)]
               for r in spare.replicas)  # now the trainer's current epoch
    ahead.start(spare, 4, TOTAL)
    assert ahead.spare is current and len(current.twins) == 1  # the old set is reused, not reopened


def test_not_started_while_a_replica_of_the_current_set_is_down():
    current = FakeConnections(2, 4, Clock())
    current.replicas[1].down_since = 1.0
    ahead = Lookahead(timeout=5.0, stats=LoaderStats())
    ahead.start(current, 1, TOTAL)
    assert ahead.flow is None and ahead.spare is None


def test_refused_another_epoch_or_a_resume_part_way_drop_it(caplog):
    caplog.set_level(logging.INFO, logger="client")
    clock = Clock()
    current = FakeConnections(1, 4, clock)
    ahead = Lookahead(timeout=5.0, stats=LoaderStats())
    for epoch, first, outcome in [(1, 0, "refuse"), (2, 0, "accept"), (1, 3, "accept"), (1, 0, "lost"),
                                  (1, 0, "accept_moved")]:
        ahead.start(current, 1, TOTAL)
        spare = ahead.spare
        answer(spare.replicas[0], outcome, clock, spare)
        assert ahead.adopt(current, epoch, first, TOTAL, sink=None) is None
        assert spare.closed and ahead.spare is None and ahead.flow is None
    said = [r.getMessage() for r in caplog.records]
    assert said == ["epoch lookahead refused by tcp://replica-0:5555 ([no_capacity] would leave less than 2 slots); "
                    "starting epoch 1 plainly",
                    "epoch lookahead lost or not answered by tcp://replica-0:5555; starting epoch 1 plainly",
                    "epoch lookahead on tcp://replica-0:5555 asked for the wrong hand-over; starting epoch 1 plainly"]


def test_with_nothing_ahead_the_spare_set_stays_open():
    current = FakeConnections(1, 4, Clock())
    ahead = Lookahead(timeout=5.0, stats=LoaderStats())
    ahead.start(current, 1, TOTAL)
    answer(ahead.spare.replicas[0], "accept", current.clock)
    current, _ = ahead.adopt(current, 1, 0, TOTAL, sink=None)
    spare = ahead.spare
    assert ahead.adopt(current, 2, 0, TOTAL, sink=None) is None
    assert ahead.spare is spare and not spare.closed


OUTCOMES = ["accept", "accept_after_handshake", "refuse", "lost", "other_length", "silent", "accept_moved"]


class LookaheadLife(RuleBasedStateMachine):
    @initialize(replicas=st.integers(1, 3))
    def begin(self, replicas):
        self.clock = Clock()
        self.current = FakeConnections(replicas, 4, self.clock)
        self.opened = [self.current]
        self.lookahead = Lookahead(timeout=0.02, stats=LoaderStats())
        self.epoch = 0

    @rule()
    def every_batch_of_the_epoch_is_asked_for(self):
        before = self.lookahead.spare
        self.lookahead.start(self.current, self.epoch + 1, TOTAL)
        if self.lookahead.spare is not before:
            self.opened.append(self.lookahead.spare)

    @rule(epoch_step=st.sampled_from([1, 1, 1, 0, 2]), first=st.sampled_from([0, 0, 0, 2]),
          outcomes=st.lists(st.sampled_from(OUTCOMES), min_size=3, max_size=3))
    def the_next_iteration(self, epoch_step, first, outcomes):
        epoch = self.epoch + epoch_step
        spare, ahead = self.lookahead.spare, self.lookahead.epoch
        if ahead is not None:
            for r, outcome in zip(spare.replicas, outcomes):
                answer(r, outcome, self.clock, spare)
        adopted = self.lookahead.adopt(self.current, epoch, first, TOTAL, sink=None)
        expected = (ahead == epoch and first == 0
                    and all(o.startswith("accept") and o != "accept_moved" for o in outcomes[:len(spare.replicas)]))
        assert (adopted is not None) == expected
        assert self.lookahead.flow is None
        if adopted is not None:
            new, flow = adopted
            assert new is spare and flow.next_yield == 0 and flow.total == TOTAL
            assert self.lookahead.spare is self.current
            self.current = new
        elif ahead is not None:
            assert spare.closed and self.lookahead.spare is None
        else:
            assert self.lookahead.spare is spare
        self.epoch = epoch

    @invariant()
    def the_current_set_is_open_and_never_the_spare(self):
        assert not self.current.closed and self.lookahead.spare is not self.current

    @invariant()
    def two_sets_at_most_are_open(self):
        open_sets = [s for s in self.opened if not s.closed]
        assert len(open_sets) <= 2 and self.current in open_sets
        assert self.lookahead.spare is None or self.lookahead.spare in open_sets


TestLookaheadLife = LookaheadLife.TestCase
TestLookaheadLife.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)

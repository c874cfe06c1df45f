"""The replicas behind a followed name (client.membership.Membership), and the fleet that carries
its decisions out on a set of connections and an epoch's flow control (client.fleet.Fleet): rules
one at a time, then a state machine over random interleavings of lookups (addresses added,
removed, flapping, nothing, a failing resolver), connection losses and returns, replicas given up
on, batches delivered and taken: every batch of the epoch exactly once, no address reconnected
twice within the backoff, a name that resolves to nothing keeps its replicas and says so once."""

from __future__ import annotations

import copy
import logging
from typing import Dict, List, Optional

import pytest
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from client.attempts import MAX_S
from client.config import LoaderConfig
from client.fleet import Fleet
from client.membership import MAX_PER_NAME, Drain, Join, Leave, Membership, Resume, Say

from tests.unit.client.fakes import Clock, FakeConnections

NAME = "tcp://loader-headless:5555"
POOL = [f"tcp://10.0.0.{i}:5555" for i in range(1, 5)]
A, B, C = POOL[:3]


def members(refresh=10.0, backoff=2.0, drain=5.0) -> Membership:
    return Membership([NAME], [], refresh_s=refresh, backoff_s=backoff, drain_s=drain)


def test_the_first_answer_joins_every_address_sorted():
    m = members()
    assert m.lookup_due(0.0)
    assert m.resolved(0.0, {NAME: frozenset({B, A})}) == [Join(A), Join(B)]
    assert m.active() == [A, B] and not m.lookup_due(9.9) and m.lookup_due(10.0)


def test_fixed_endpoints_join_with_the_first_answer_and_never_drain():
    m = Membership([NAME], ["ipc:///tmp/x"], refresh_s=10, backoff_s=2, drain_s=5)
    assert m.resolved(0.0, {NAME: frozenset({A})}) == [Join("ipc:///tmp/x"), Join(A)]
    assert m.resolved(10.0, {NAME: frozenset({B})}) == [Join(B), Drain(A)]
    assert m.active() == ["ipc:///tmp/x", B]


def test_a_name_that_resolves_to_nothing_keeps_its_replicas_and_says_so_once():
    m = members()
    m.resolved(0.0, {NAME: frozenset({A, B})})
    first = m.resolved(10.0, {NAME: frozenset()})
    assert len(first) == 1 and isinstance(first[0], Say)
    assert first[0].text == (f"{NAME} resolved to nothing (no address); keeping its current replicas ({A}, {B}) "
                             "until it resolves again")
    assert m.resolved(20.0, {NAME: "loader-headless: Temporary failure in name resolution"}) == []  # said once
    assert m.active() == [A, B]
    assert m.resolved(30.0, {NAME: frozenset({A, B})}) == [Say(f"{NAME} resolves again: {A}, {B}")]
    said = m.resolved(40.0, {NAME: "timeout"})  # a new spell of nothing is said again
    assert [a.text.split(" (")[1] for a in said] == ["timeout); keeping its current replicas"]


def test_an_address_that_disappears_drains_then_leaves_when_it_owes_nothing():
    m = members()
    m.resolved(0.0, {NAME: frozenset({A, B})})
    assert m.resolved(10.0, {NAME: frozenset({A})}) == [Drain(B)]
    assert m.active() == [A] and B in m.members
    assert m.drained(A, 11.0) == []  # an active member does not leave for owing nothing
    assert m.drained(B, 11.0) == [Leave(B)]
    assert B not in m.members and m.drained(B, 12.0) == []


def test_a_draining_address_leaves_at_once_when_its_connection_drops_or_at_its_deadline():
    m = members(drain=5.0)
    m.resolved(0.0, {NAME: frozenset({A, B, C})})
    m.resolved(10.0, {NAME: frozenset({A})})
    assert m.lost(B, 11.0) == [Leave(B)]
    assert m.next_lookup == 12.0  # the loss brought the next lookup forward
    m.resolved(12.0, {NAME: frozenset({A})})
    assert m.due() == 15.0 and m.tick(14.9) == []
    assert m.tick(15.0) == [Leave(C)]


def test_a_draining_address_that_is_resolved_again_resumes_without_a_reconnect():
    m = members()
    m.resolved(0.0, {NAME: frozenset({A, B})})
    m.resolved(10.0, {NAME: frozenset({A})})
    assert m.resolved(20.0, {NAME: frozenset({A, B})}) == [Resume(B)]
    assert m.active() == [A, B]


def test_a_flapping_record_reconnects_an_address_at_most_once_per_backoff():
    m = members(refresh=0.5, backoff=2.0)
    m.resolved(0.0, {NAME: frozenset({A, B})})
    m.resolved(0.5, {NAME: frozenset({A})})
    assert m.drained(B, 0.5) == [Leave(B)]  # it owed nothing
    assert m.resolved(1.0, {NAME: frozenset({A, B})}) == []  # back within the backoff: it waits
    assert m.due() == 1.5  # the next lookup; B's turn comes at 2.5
    assert m.tick(2.4) == [] and m.tick(2.5) == [Join(B)]


def test_connection_losses_bring_the_lookup_forward_at_most_once_per_backoff():
    m = members(refresh=10.0, backoff=2.0)
    m.resolved(0.0, {NAME: frozenset({A})})
    m.lost(A, 0.5)
    assert m.next_lookup == 2.0  # not before the backoff since the last lookup
    m.resolved(2.0, {NAME: frozenset({A})})
    m.lost(A, 7.0)
    assert m.next_lookup == 7.0


def test_a_huge_answer_is_capped():
    m = members()
    many = frozenset(f"tcp://10.1.{i // 250}.{i % 250}:5555" for i in range(MAX_PER_NAME * 3))
    out = m.resolved(0.0, {NAME: many})
    assert out[0] == Say(f"{NAME} resolved to {MAX_PER_NAME * 3} addresses; following the first {MAX_PER_NAME} "
                         "(sorted)")
    assert len(m.active()) == MAX_PER_NAME


def test_settings_are_checked():
    with pytest.raises(ValueError, match="must be > 0"):
        Membership([NAME], [], refresh_s=0, backoff_s=1, drain_s=1)


# ---------------------------------------------------------------------- the model


class ScriptedLookups:
    """Lookups whose answers the test gives: started by the fleet, finished by a rule."""

    def __init__(self):
        self.running = False
        self.answer: Optional[Dict[str, object]] = None
        self.starts: List[float] = []
        self.clock: Optional[Clock] = None

    def start(self) -> None:
        if not self.running:
            self.running, self.answer = True, None
            self.starts.append(self.clock.now)

    def result(self):
        if self.running and self.answer is not None:
            self.running, answer, self.answer = False, self.answer, None
            return answer
        return None

    def now(self, deadline_s: float):
        self.start()
        self.answer = {NAME: frozenset(self.first)}
        return self.result()


class Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: List[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


TOTAL = 30
REPLICA_TIMEOUT = 5.0


# which replicas a rule may pick
def unaccepted(r) -> bool:
    return not r.accepted and r.down_since is None and r.stream >= 0


def owing(r) -> bool:
    return bool(r.asked) and r.down_since is None and r.accepted


def up(r) -> bool:
    return r.down_since is None


def down(r) -> bool:
    return r.down_since is not None


def down_not_dead(r) -> bool:
    return r.down_since is not None and not r.dead


class FleetDuringAnEpoch(RuleBasedStateMachine):
    """The real Membership, Fleet, EpochFlow and Connections.start_epoch over fake connections;
    the services, the resolver and the clock are played by the rules."""

    @initialize(first=st.sets(st.sampled_from(POOL), min_size=1))
    def begin(self, first):
        self.clock = Clock(0.0)
        self.lookups = ScriptedLookups()
        self.lookups.clock, self.lookups.first = self.clock, first
        config = LoaderConfig.of(NAME, batch_size=2, replica_timeout=REPLICA_TIMEOUT, dns_refresh_s=10.0)
        self.fleet = Fleet([NAME], config, clock=self.clock, lookups=self.lookups)
        self.said = Said()
        logging.getLogger("client").addHandler(self.said)
        self.conns = FakeConnections(0, 6, self.clock)
        for e in self.fleet.first(1.0):
            self.conns.join(e)
        self.flow = self.conns.start_epoch(0, 0, TOTAL)
        self.yielded: List[int] = []
        self.nothing = False  # the name's last answer was nothing
        self.said_nothing = 0

    # ------------------------------------------------------------------ the client's side, as EpochRun does it
    def _ask(self):
        reps = {r.index: r for r in self.conns.replicas}
        live = [i for i, r in reps.items() if not r.dead and not r.draining and r.accepted and r.down_since is None]
        for i, batches in self.flow.assign(live, self.clock.now).items():
            reps[i].request(batches, 0)

    def _follow(self):
        self.fleet.follow(self.conns, self.clock.now, self.flow, 0)
        self._ask()

    def _any(self, which) -> bool:
        return any(which(r) for r in self.conns.replicas)

    def _replica(self, data, which):
        reps = [r for r in self.conns.replicas if which(r)]
        return data.draw(st.sampled_from(sorted(reps, key=lambda r: r.index)))

    # ------------------------------------------------------------------ the resolver
    @rule(answer=st.sets(st.sampled_from(POOL)))
    def the_name_resolves(self, answer):
        self._resolve(frozenset(answer))

    @rule(why=st.sampled_from(["timeout", "Temporary failure in name resolution"]))
    def the_resolver_fails(self, why):
        self._resolve(why)

    def _resolve(self, answer):
        if not self.lookups.running:  # the lookup starts when due: let time pass to then
            self.clock.now = max(self.clock.now, self.fleet.membership.next_lookup)
            self._follow()
        assert self.lookups.running
        before = sorted(r.endpoint for r in self.conns.replicas if not r.draining)
        said = len(self.said.lines)
        self.lookups.answer = {NAME: answer}
        self._follow()
        nothing = not (isinstance(answer, frozenset) and answer)
        told = [x for x in self.said.lines[said:] if "resolved to nothing" in x]
        if nothing:
            # the current replicas stay (only a replica whose backoff ended may join)
            after = sorted(r.endpoint for r in self.conns.replicas if not r.draining)
            assert set(before) <= set(after), (before, after)
            assert len(told) == (0 if self.nothing else 1), told
        self.nothing = nothing

    # ------------------------------------------------------------------ the services and the network
    # preconditions, not assume(): a rule that cannot run is never drawn, so no draw is wasted
    @precondition(lambda self: self._any(unaccepted))
    @rule(data=st.data())
    def a_service_accepts_its_stream(self, data):
        r = self._replica(data, unaccepted)
        r.accepted = True
        self._ask()

    @precondition(lambda self: self._any(owing))
    @rule(data=st.data())
    def a_replica_delivers_a_batch_it_was_asked_for(self, data):
        r = self._replica(data, owing)
        b = data.draw(st.sampled_from(sorted(r.asked)))
        r.asked.remove(b)
        self.clock.now += 0.01
        assert self.flow.on_batch(r.index, b, self.clock.now), (r.endpoint, b)
        self.fleet.delivered(self.conns, r, self.clock.now, self.flow)
        self._ask()

    @precondition(lambda self: self.flow.next_received())
    @rule()
    def the_trainer_takes_the_next_batch(self):
        self.yielded.append(self.flow.take())
        self._ask()

    @precondition(lambda self: self._any(up))
    @rule(data=st.data())
    def a_connection_is_lost(self, data):
        r = self._replica(data, up)
        r.down_since = self.clock.now
        self.fleet.lost(self.conns, r, self.clock.now, self.flow)
        self._ask()

    @precondition(lambda self: self._any(down))
    @rule(data=st.data())
    def a_connection_comes_back_and_the_stream_starts_again(self, data):
        r = self._replica(data, down)
        r.down_since, r.dead = None, False
        self.conns.hello(r, 0, sorted(self.flow.outstanding.get(r.index, ())))  # as EpochRun._restart
        self._ask()

    @precondition(lambda self: self._any(down_not_dead))
    @rule(data=st.data())
    def a_replica_down_too_long_is_given_up_on(self, data):
        r = self._replica(data, down_not_dead)
        others = [x for x in self.conns.replicas if x is not r and not x.dead and x.down_since is None]
        assume(others)
        self.clock.now = max(self.clock.now, r.down_since + REPLICA_TIMEOUT)
        self.flow.lose(r.index)
        r.dead, r.asked = True, []
        self._follow()

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.0, 5.0, 11.0]))
    def time_passes(self, dt):
        self.clock.now += dt
        self._follow()

    # ------------------------------------------------------------------ what must hold
    @invariant()
    def every_batch_at_most_once_and_in_order(self):
        assert self.yielded == list(range(self.flow.next_yield))
        owed = [b for o in self.flow.outstanding.values() for b in o]
        assert len(owed) == len(set(owed)), "a batch asked of two replicas at once"
        assert not set(owed) & self.flow.received and all(b >= self.flow.next_yield for b in owed)

    @invariant()
    def the_set_is_the_membership(self):
        assert sorted(r.endpoint for r in self.conns.replicas) == sorted(self.fleet.membership.members)
        assert sorted(r.index for r in self.conns.replicas) == sorted(self.flow.outstanding)
        for r in self.conns.replicas:
            assert r.draining == (self.fleet.membership.members[r.endpoint] is not None)
            assert not r.closed
        assert all(r.closed for r in self.conns.left)

    @invariant()
    def nothing_is_due_before_due(self):
        """The fleet skips the membership's rules until ``due()`` during an epoch (it follows twice
        per batch): before then, they must have nothing to do."""
        m = self.fleet.membership
        if self.clock.now < m.due():
            assert copy.deepcopy(m).tick(self.clock.now) == []

    @invariant()
    def no_address_reconnected_within_the_backoff(self):
        # as the code computes it, last + MAX_S: a difference taken back is not exact in floats
        # (4.1 - 2.1 < 2.0 though 2.1 + 2.0 == 4.1), a sum is, and no tolerance is needed
        last: Dict[str, float] = {}
        for endpoint, at in self.conns.joins:
            if endpoint in last:
                assert at >= last[endpoint] + MAX_S, (endpoint, last[endpoint], at)
            last[endpoint] = at
        starts = self.lookups.starts
        assert all(b >= a + MAX_S for a, b in zip(starts, starts[1:])), starts

    def teardown(self):
        logging.getLogger("client").removeHandler(self.said)
        if not hasattr(self, "flow"):
            return
        # the network heals and the resolver settles: the epoch ends, every batch exactly once
        for _ in range(200):
            if self.flow.done:
                break
            self.clock.now += 1.0
            if self.lookups.running:
                self.lookups.answer = {NAME: "timeout"}  # nothing changes any more
            self._follow()
            for r in list(self.conns.replicas):
                if r.down_since is not None:
                    r.down_since, r.dead = None, False
                    self.conns.hello(r, 0, sorted(self.flow.outstanding.get(r.index, ())))
                r.accepted = r.accepted or r.stream >= 0
            self._ask()
            for r in list(self.conns.replicas):
                for b in sorted(r.asked):
                    r.asked.remove(b)
                    assert self.flow.on_batch(r.index, b, self.clock.now)
                    self.fleet.delivered(self.conns, r, self.clock.now, self.flow)
                    if r not in self.conns.replicas:
                        break
            while self.flow.next_received():
                self.yielded.append(self.flow.take())
            self._ask()
        assert sorted(self.yielded) == list(range(TOTAL))


TestFleetDuringAnEpoch = FleetDuringAnEpoch.TestCase
TestFleetDuringAnEpoch.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)

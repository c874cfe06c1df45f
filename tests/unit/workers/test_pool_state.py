"""PoolState, driven directly (no processes, no sockets, the clock passed in): a few rules by
name, then every event of a pool's life under random interleavings.

The state machine plays the edge (``WorkerPool``) and the workers' processes: scale requests of
any size in any order, workers that say Ready or fail to start, tasks handed to the places the
pool offers and finished in order, reports of tasks a worker does not run, processes that exit
at any moment (crashed, or told to stop), the clock jumping past start and stop deadlines, and
the close. After every step:

* the records are the processes: one per Spawn, gone at its exit, never reused;
* no task is lost or doubled: each assigned task is reported done once or handed back once at
  its worker's exit, in the order the worker holds them;
* a worker is told Stop only once it holds no task, and once (before the close);
* the pool never has more than twice its target of processes (2 for a target under 2), but for
  one started where none is live;
* the live workers never exceed the target, and reach it unless the pool is broken or at that
  bound;
* a worker is killed only past its start or stop deadline, once, and ``next_deadline`` never
  lets one pass unseen;
* ``deaths`` counts the exits of workers neither stopping nor failed; three failed starts in a
  row break the pool, which then starts nothing.
"""

from __future__ import annotations

from typing import Dict, List, Set

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loader_service.workers.pool_state import (MAX_START_FAILURES, QUEUE_DEPTH, KillWorker, PoolState, Spawn,
                                               TellStop)

START_S, STOP_S = 5.0, 2.0


def test_a_scale_down_dismisses_idle_workers_at_once_and_busy_ones_after_their_tasks():
    ps = PoolState(START_S, STOP_S)
    assert ps.scale(2, 0.0) == [Spawn(0), Spawn(1)]
    for wid in (0, 1):
        ps.ready(wid, 100 + wid, "", 0.0)
    ps.assign(ps.workers[1], 7, "seg", 0.0)
    assert ps.scale(0, 1.0) == [TellStop(0)]  # worker 1 is busy: it leaves after its task
    assert ps.counts() == {"stopping": 1, "leaving": 1}
    w, taken, actions = ps.done(1, 7, 2.0)
    assert taken and actions == [TellStop(1)]


def test_a_leaving_worker_stays_when_the_target_comes_back_instead_of_a_new_one_starting():
    ps = PoolState(START_S, STOP_S)
    ps.scale(1, 0.0)
    ps.ready(0, 100, "", 0.0)
    ps.assign(ps.workers[0], 1, "seg", 0.0)
    assert ps.scale(0, 0.0) == [] and ps.workers[0].state == "leaving"
    assert ps.scale(1, 0.0) == [] and ps.workers[0].state == "busy"


def test_a_worker_that_does_not_exit_after_its_stop_is_killed_at_its_deadline_once():
    ps = PoolState(START_S, STOP_S)
    ps.scale(1, 0.0)
    ps.ready(0, 100, "", 0.0)
    assert ps.scale(0, 10.0) == [TellStop(0)]
    assert ps.next_deadline() == 10.0 + STOP_S
    assert ps.expire(11.9) == []
    assert ps.expire(12.0) == [KillWorker(0)] and ps.stop_kills == 1
    assert ps.expire(30.0) == [] and ps.next_deadline() is None
    assert ps.exited(0, -9, -1, 12.1).held == [] and ps.deaths == 0


def test_three_failed_starts_in_a_row_break_the_pool_with_the_last_reason():
    ps = PoolState(START_S, STOP_S)
    ps.scale(1, 0.0)
    ps.ready(0, 100, "OSError: no such dataset", 0.0)
    assert ps.exited(0, 0, -1, 0.0).actions == [Spawn(1)]
    assert ps.expire(START_S) == [KillWorker(1)]
    assert ps.exited(1, -9, -1, START_S).actions == [Spawn(2)]
    assert ps.exited(2, 3, -1, START_S).actions == []
    assert ps.broken == "worker 2 exited before it was ready (exit code 3)"
    assert ps.scale(4, START_S) == []


def test_a_worker_whose_start_failed_is_neither_dismissed_nor_brought_back_by_scaling():
    # Before: a failed worker counted as live, so a scale-down made it "leaving" and a scale-up
    # "starting" again; its exit then counted a death and a second failed start.
    ps = PoolState(START_S, STOP_S)
    ps.scale(1, 0.0)
    ps.ready(0, 100, "OSError: cannot open dataset", 0.0)
    assert ps.scale(0, 0.0) == [] and ps.workers[0].state == "failed"
    assert ps.scale(1, 0.0) == [Spawn(1)] and ps.workers[0].state == "failed"  # a new one in its place
    assert ps.exited(0, 0, -1, 0.0).actions == []
    assert (ps.deaths, ps.start_failures) == (0, 1)


def test_a_broken_pool_starts_nothing_but_still_lets_its_workers_go():
    ps = PoolState(START_S, STOP_S)
    ps.scale(2, 0.0)
    for wid in (0, 1):
        ps.ready(wid, 100 + wid, "OSError: cannot open dataset", 0.0)
        ps.exited(wid, 0, -1, 0.0)
    ps.ready(2, 102, "OSError: cannot open dataset", 0.0)
    assert ps.broken and ps.counts() == {"failed": 1, "starting": 1}
    assert ps.scale(0, 1.0) == [] and ps.counts() == {"failed": 1, "leaving": 1}
    assert ps.exited(2, 0, -1, 1.0).actions == [] and ps.scale(3, 1.0) == []


class PoolModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.ps = PoolState(START_S, STOP_S)
        self.now = 0.0
        self.alive: Set[int] = set()  # processes started and not exited
        self.ever: Set[int] = set()  # every wid ever spawned
        self.said_ready: Set[int] = set()
        self.held: Dict[int, List[int]] = {}  # wid -> the tasks it was given and has not finished, in order
        self.stopped: Set[int] = set()  # told Stop
        self.killed: Set[int] = set()
        self.next_task = 0
        self.done_tasks: Set[int] = set()
        self.returned: Set[int] = set()
        self.deaths = 0
        self.failed_in_a_row = 0

    # ------------------------------------------------------------------ the edge's part
    def carry_out(self, actions, live_before: int) -> None:
        spawns = [a for a in actions if isinstance(a, Spawn)]
        for a in actions:
            if isinstance(a, Spawn):
                assert a.wid not in self.ever, "a worker id used twice"
                assert not self.ps.broken and not self.ps.closed
                self.ever.add(a.wid)
                self.alive.add(a.wid)
                self.held[a.wid] = []
            elif isinstance(a, TellStop):
                assert a.wid in self.alive and a.wid not in self.stopped, "a Stop twice, or to no process"
                if not self.ps.closed:
                    assert self.held[a.wid] == [], "told to stop holding tasks: they would be abandoned"
                self.stopped.add(a.wid)
            elif isinstance(a, KillWorker):
                assert a.wid in self.alive and a.wid not in self.killed, "a kill twice, or of no process"
                w = self.ps.workers[a.wid]
                assert (w.stop_sent is not None and self.now - w.stop_sent >= STOP_S) or (
                    not w.ready and self.now - w.started_at >= START_S), "killed before its deadline"
                self.killed.add(a.wid)
            else:
                raise AssertionError(a)
        if spawns:
            bound = 2 * max(self.ps.target, 1)
            assert len(self.ps.workers) <= bound or (live_before == 0 and len(spawns) == 1), \
                (len(self.ps.workers), self.ps.target, live_before, spawns)

    def live(self) -> int:
        return sum(1 for w in self.ps.workers.values() if w.state not in ("leaving", "stopping", "failed"))

    # ------------------------------------------------------------------ events
    @precondition(lambda self: not self.ps.closed)
    @rule(n=st.integers(0, 5))
    def scale(self, n):
        before = self.live()
        self.carry_out(self.ps.scale(n, self.now), before)

    @precondition(lambda self: any(w not in self.said_ready for w in self.alive))
    @rule(data=st.data(), error=st.sampled_from(["", "", "", "OSError: cannot open dataset"]))
    def ready(self, data, error):
        wid = data.draw(st.sampled_from(sorted(w for w in self.alive if w not in self.said_ready)))
        self.said_ready.add(wid)
        state_before = self.ps.workers[wid].state
        w, actions = self.ps.ready(wid, 1000 + wid, error, self.now)
        if state_before in ("starting", "leaving"):
            self.failed_in_a_row = self.failed_in_a_row + 1 if error else 0
        self.carry_out(actions, self.live())

    @rule(data=st.data())
    def repeated_or_stray_ready(self, data):
        wid = data.draw(st.sampled_from(sorted(self.said_ready) + [10_000]))
        before = {k: (v.state, v.ready) for k, v in self.ps.workers.items()}
        assert self.ps.ready(wid, 1, "", self.now)[1] == []
        assert {k: (v.state, v.ready) for k, v in self.ps.workers.items()} == before

    @precondition(lambda self: bool(self.ps.places()))
    @rule(data=st.data())
    def assign(self, data):
        places = self.ps.places()
        for w in places:
            assert w.state in ("idle", "busy") and places.count(w) <= QUEUE_DEPTH - len(w.tasks)
        w = data.draw(st.sampled_from(places))
        self.ps.assign(w, self.next_task, f"seg{self.next_task % 3}", self.now)
        self.held[w.id].append(self.next_task)
        self.next_task += 1

    @precondition(lambda self: any(self.held[w] for w in self.alive))
    @rule(data=st.data())
    def done(self, data):
        wid = data.draw(st.sampled_from(sorted(w for w in self.alive if self.held[w])))
        task = self.held[wid].pop(0)
        w, taken, actions = self.ps.done(wid, task, self.now)
        assert taken and task not in self.done_tasks
        self.done_tasks.add(task)
        self.carry_out(actions, self.live())

    @precondition(lambda self: bool(self.alive))
    @rule(data=st.data())
    def done_of_a_task_it_does_not_run(self, data):
        wid = data.draw(st.sampled_from(sorted(self.alive)))
        assert self.ps.done(wid, self.next_task + 99, self.now)[1:] == (False, [])

    @precondition(lambda self: bool(self.alive))
    @rule(data=st.data(), on_first=st.booleans(), exitcode=st.sampled_from([0, 1, -9, -11]))
    def exits(self, data, on_first, exitcode):
        wid = data.draw(st.sampled_from(sorted(self.alive)))
        w = self.ps.workers[wid]
        expected = w.state in ("stopping", "failed")
        failed_start = not w.ready and w.state not in ("stopping", "failed")
        held = self.held[wid]
        on = held[0] if held and on_first else -1
        before = self.live() - (w.state not in ("leaving", "stopping", "failed"))  # live besides the one exiting
        out = self.ps.exited(wid, exitcode, on, self.now)
        assert out.held == held, "the tasks handed back are the ones it held, in its order"
        assert out.died_on == (on if on >= 0 else None)
        assert not set(held) & (self.done_tasks | self.returned)
        self.returned |= set(held)
        self.held[wid] = []
        self.alive.discard(wid)
        self.deaths += not expected
        if failed_start:
            self.failed_in_a_row += 1
        assert self.ps.deaths == self.deaths
        self.carry_out(out.actions, before if not self.ps.closed else 0)
        assert wid not in self.ps.workers

    @rule(dt=st.sampled_from([0.5, 1.0, STOP_S, START_S, 60.0]))
    def time_passes(self, dt):
        due = self.ps.next_deadline()
        self.now += dt
        actions = self.ps.expire(self.now)
        if due is None or due > self.now:
            assert actions == [], "a kill with no deadline passed that next_deadline named"
        self.carry_out(actions, self.live())
        for w in self.ps.workers.values():  # none left past its deadline unkilled
            if w.stop_sent is not None:
                assert self.now - w.stop_sent < STOP_S or w.id in self.killed
            elif not w.ready and w.state not in ("failed",):
                assert self.now - w.started_at < START_S or w.id in self.killed

    @precondition(lambda self: not self.ps.closed)
    @rule()
    def close(self):
        self.carry_out(self.ps.close(self.now), 0)
        assert all(w.state in ("stopping", "failed") for w in self.ps.workers.values())

    # ------------------------------------------------------------------ after every step
    @invariant()
    def records_are_the_processes(self):
        assert set(self.ps.workers) == self.alive

    @invariant()
    def tasks_are_held_where_the_model_holds_them(self):
        for wid in self.alive:
            assert list(self.ps.workers[wid].tasks) == self.held[wid]
        assigned = set(range(self.next_task))
        outstanding = {t for ts in self.held.values() for t in ts}
        assert self.done_tasks | self.returned | outstanding == assigned
        assert len(self.done_tasks) + len(self.returned) + len(outstanding) == len(assigned)

    @invariant()
    def live_workers_meet_the_target(self):
        if self.ps.closed:
            return
        live = self.ps.live_count()
        assert live <= self.ps.target
        at_bound = len(self.ps.workers) >= 2 * max(self.ps.target, 1)
        # a worker whose start failed is replaced once its process has exited
        exiting_failed = sum(w.state == "failed" for w in self.ps.workers.values())
        assert live + exiting_failed >= self.ps.target or self.ps.broken or at_bound, \
            (live, self.ps.target, self.ps.counts())

    @invariant()
    def broken_after_failed_starts_in_a_row(self):
        assert self.ps.start_failures == self.failed_in_a_row
        if self.failed_in_a_row >= MAX_START_FAILURES:
            assert self.ps.broken


@pytest.mark.timeout(300)
def test_the_pool_under_random_interleavings_of_every_event():
    run = PoolModel.TestCase
    run.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    run().runTest()

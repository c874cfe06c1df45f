"""StreamState under random interleavings (hypothesis state machine).

A model drives the pure stream state the way the dispatcher does: batches asked for (a few at
a time, the last ask final), tasks handed to workers, tasks that finish (ok, with skipped
samples, or failed), workers lost (crash or deadline), sends completing in any order, and
retire. After every step: every slot is held by exactly one thing; nothing was dispatched
before it was asked for; batches left in the order asked, each once; no task is lost (every
batch asked is sent, waiting, or in work). At the end, once every
event has been delivered, the stream is finished or failed, and a retired stream is idle.
"""

from __future__ import annotations


import pytest

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from loader_service.dispatch.stream_state import (SAMPLE_FAILED, TOO_MANY_SKIPPED, Fail, Finish, SendBatch, StreamLimits,
                                         StreamState)

BATCH = 3


def _indices(b: int):
    return [b * BATCH + i for i in range(BATCH)]


class StreamModel(RuleBasedStateMachine):
    @initialize(n=st.integers(0, 12), slots=st.integers(1, 4), first=st.integers(0, 5),
                start=st.integers(0, 3), skip=st.booleans(), cap=st.sampled_from([0, 2, 50]), shuffled=st.booleans())
    def setup(self, n, slots, first, start, skip, cap, shuffled):
        self.plan = list(range(min(start, n), n))  # what the client will ask, in its order
        if shuffled:
            self.plan.reverse()
        limits = StreamLimits(on_error="skip" if skip else "raise", max_skipped=cap)
        self.order = self.plan[:first]  # asked so far
        self.s = StreamState(self.order, slots, _indices, lambda i: f"file{i}", limits,
                             final=len(self.order) == len(self.plan))
        self.sent: list = []
        self.sending: list = []  # slots whose send is in flight
        self.outcome = None  # "finished" | "failed"
        self.retired = False
        self.next_id = 0
        self._apply(self.s.start())

    def _apply(self, effects):
        for e in effects:
            assert self.outcome is None, f"effect {e} after the stream ended ({self.outcome})"
            if isinstance(e, SendBatch):
                self.sent.append(e.batch)
                self.sending.append(e.slot)
                assert not e.compact or e.skipped
                for pos, idx, _ in e.skipped:
                    assert idx == _indices(e.batch)[pos]
            elif isinstance(e, Finish):
                self.outcome = "finished"
            elif isinstance(e, Fail):
                assert e.code in (SAMPLE_FAILED, TOO_MANY_SKIPPED)
                self.outcome = "failed"

    @precondition(lambda self: not self.s.final)
    @rule(n=st.integers(0, 3), final=st.booleans())
    def ask(self, n, final):
        more = self.plan[len(self.order): len(self.order) + n]
        self.order = self.order + more
        self._apply(self.s.extend(more, final=final and len(self.order) == len(self.plan)))

    @rule()
    def dispatch(self):
        t = self.s.next_task(self.next_id)
        self.next_id += 1
        if t is not None:
            assert not self.s.done

    @precondition(lambda self: self.s.tasks)
    @rule(data=st.data(), kind=st.sampled_from(["ok", "ok", "ok", "skip", "fail"]))
    def finish_task(self, data, kind):
        tid = data.draw(st.sampled_from(sorted(self.s.tasks)))
        t = self.s.tasks[tid]
        n = 1 if t.pos >= 0 else BATCH
        skipped, error = [], ""
        if kind == "skip" and self.s.limits.on_error == "skip":
            p = data.draw(st.integers(0, n - 1))
            idx = _indices(t.batch)[t.pos if t.pos >= 0 else p]
            skipped = [(p, idx, "DecodeError: bad")]
        elif kind == "fail" and self.s.limits.on_error == "raise":
            error = "sample failed: DecodeError"
        self._apply(self.s.task_done(tid, skipped, error))

    @precondition(lambda self: self.s.tasks)
    @rule(data=st.data(), hung=st.booleans())
    def lose_worker(self, data, hung):
        tid = data.draw(st.sampled_from(sorted(self.s.tasks)))
        self._apply(self.s.task_lost(tid, "hung past its deadline" if hung else "crashed"))

    @precondition(lambda self: self.s.tasks)
    @rule(data=st.data())
    def return_queued_task(self, data):  # its worker died before it began (pool.QUEUE_DEPTH)
        tid = data.draw(st.sampled_from(sorted(self.s.tasks)))
        t = self.s.tasks[tid]
        attempts = dict(self.s.attempts)
        self.s.task_returned(tid)
        assert self.s.attempts == attempts, "a task that never ran counted as a loss"
        if not self.s.done and t.pos >= 0:
            assert t.pos in self.s.isolated[t.batch].todo

    @precondition(lambda self: self.sending)
    @rule(data=st.data())
    def complete_send(self, data):
        slot = data.draw(st.sampled_from(self.sending))
        self.sending.remove(slot)
        self.s.send_complete(slot)

    @rule()
    def retire(self):
        self.s.retire()
        self.retired = True

    @invariant()
    def slots_are_accounted_for(self):
        if self.s.done:
            return
        holders = self.s.slot_holders()  # raises if a slot has two holders
        assert sorted(holders) == list(range(self.s.num_slots)), holders

    @invariant()
    def order_and_asks(self):
        assert self.sent == self.order[: len(self.sent)], "batches left out of order or twice"
        assert list(self.s.order) == self.order and self.s.next_dispatch <= len(self.order), "dispatched unasked"

    @invariant()
    def no_task_lost(self):
        if self.s.done:
            return
        s = self.s
        in_work = {t.batch for t in s.tasks.values()} | set(s.isolated) | {b for _, b in s.redo}
        for b in self.order[len(self.sent): s.next_dispatch]:
            assert b in in_work or b in s.made, f"batch {b} was dispatched and then lost"

    def teardown(self):
        if not hasattr(self, "s"):
            return
        # deliver everything still pending: the stream must end, and then be idle
        for _ in range(10_000):
            if self.s.done and not self.s.tasks and not self.sending:
                break
            if self.sending:
                self.s.send_complete(self.sending.pop())
            elif self.s.tasks:
                self._apply(self.s.task_done(next(iter(self.s.tasks))))
            else:
                if not self.s.final:  # the client's last ask
                    more = self.plan[len(self.order):]
                    self.order = self.order + more
                    self._apply(self.s.extend(more, final=True))
                self.s.next_task(self.next_id)
                self.next_id += 1
        assert self.s.idle
        assert self.retired or self.outcome is not None
        if self.outcome == "finished":
            assert self.sent == self.order


TestStreamState = StreamModel.TestCase
TestStreamState.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_a_batch_that_keeps_losing_workers_is_isolated_and_its_poison_sample_skipped():
    s = StreamState([0, 1], 2, _indices, lambda i: f"file{i}", StreamLimits(on_error="skip"), final=True)
    assert s.start() == []
    a, b = s.next_task(1), s.next_task(2)
    assert (a.batch, b.batch) == (0, 1)
    assert s.task_done(2) == []  # batch 1 waits for batch 0
    assert s.task_lost(1, "hung") == []
    again = s.next_task(3)
    assert again.batch == 0 and again.pos == -1
    assert s.task_lost(3, "hung") == []  # second loss: one task per sample from now on
    singles = [s.next_task(10 + i) for i in range(BATCH)]
    assert [t.pos for t in singles] == [0, 1, 2] and len({t.slot for t in singles}) == 1
    assert s.task_done(10) == [] and s.task_done(12) == []
    assert s.task_lost(11, "hung") == []  # the sample alone, once: tried again
    retry = s.next_task(20)
    assert retry.pos == 1
    effects = s.task_lost(20, "hung")  # twice alone: poison, skipped
    assert effects[0] == SendBatch(0, a.slot, ((1, 1, "hung (2 workers lost on this sample)"),), compact=True)
    assert effects[1] == SendBatch(1, b.slot) and effects[2] == Finish()


def test_raise_policy_fails_the_stream_naming_the_file():
    s = StreamState([0], 1, _indices, lambda i: f"/data/x{i}.jpg",
                    StreamLimits(on_error="raise", max_sample_attempts=1), final=True)
    s.next_task(1)
    s.task_lost(1, "hung")
    s.task_lost(s.next_task(2).task, "hung")
    t = s.next_task(3)
    (fail,) = s.task_lost(t.task, "hung past its deadline")
    assert fail.code == SAMPLE_FAILED and "sample 0 (/data/x0.jpg): hung past its deadline" in fail.message
    assert s.done and s.next_task(4) is None


def test_more_skipped_samples_than_the_cap_fail_the_stream_with_the_list():
    s = StreamState([0, 1], 2, _indices, lambda i: f"f{i}", StreamLimits(on_error="skip", max_skipped=2), final=True)
    s.next_task(1), s.next_task(2)
    (sent,) = s.task_done(1, [(0, 0, "bad"), (1, 1, "bad")])
    assert isinstance(sent, SendBatch)
    (fail,) = s.task_done(2, [(0, 3, "truncated")])
    assert fail.code == TOO_MANY_SKIPPED and "3 samples skipped" in fail.message and "3 (f3): truncated" in fail.message


def test_an_extended_stream_keeps_its_order_and_refuses_a_batch_twice():
    s = StreamState([2, 3], 1, _indices, str)
    s.extend([7])
    assert list(s.order) == [2, 3, 7] and s.not_started == 3
    with pytest.raises(ValueError, match="batch 3 is already part of this stream"):
        s.extend([3])
    with pytest.raises(ValueError, match="lists a batch twice"):
        StreamState([1, 1], 1, _indices, str)

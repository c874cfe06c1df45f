"""Tasks on workers without workers: the message a task becomes, its deadline, the tasks that
outlive theirs (marked hung once, and only while their worker is still on them), and why a
lost task was lost. The clock is passed in."""

from __future__ import annotations

import types

import pytest

from wire import protocol as P
from wire.jobspec import JobSpec
from wire.plan import make_plan
from loader_service.decode.pipelines import Registry, job_pipeline
from loader_service.dispatch.deadlines import TaskDeadlines
from loader_service.dispatch.sending import BatchLayout
from loader_service.dispatch.stream_state import RunTask, StreamState
from loader_service.dispatch.streams import Stream
from loader_service.dispatch.tasks import Tasks

SPEC = JobSpec(batch_size=4, image_size=32, seed=9, shuffle=False)


@pytest.fixture
def stream() -> Stream:
    plan = make_plan(SPEC.plan(22, 3, 0))
    pipe = job_pipeline(Registry(), SPEC)
    layout = BatchLayout.of(pipe, 4)
    return Stream(ident=b"a", hello=P.Hello(stream=1, spec=SPEC, epoch=3), source=types.SimpleNamespace(name="demo"),
                  plan=plan, pipe=pipe, layout=layout, state=StreamState([0, 1], 2, plan.batch, str),
                  segment=types.SimpleNamespace(name="seg-1"), lookahead=False, asked_at=0.0)


def test_a_task_becomes_the_message_its_worker_runs(stream):
    tasks = Tasks(TaskDeadlines(fixed_s=5.0), on_error="skip")
    whole = tasks.start(stream, RunTask(task=7, batch=1, slot=1), worker=2, now=100.0)
    assert whole == P.Task(task=7, dataset="demo", shm="seg-1", offset=stream.slot_bytes, indices=[4, 5, 6, 7], seed=9,
                           epoch=3, on_error="skip", pipeline="train",
                           target=stream.pipe.target, pipeline_args=stream.pipe.args, capacity=4, position=0)
    one = tasks.start(stream, RunTask(task=8, batch=1, slot=0, pos=2), worker=3, now=100.0)
    assert (one.indices, one.position, one.offset) == ([6], 2, 0)  # one sample, written at its position
    assert [(tid, r.worker, r.samples) for tid, r in tasks.of(stream)] == [(7, 2, 4), (8, 3, 1)]


def test_deadlines_follow_what_tasks_measured(stream):
    tasks = Tasks(TaskDeadlines(floor_s=1.0), on_error="raise")
    tasks.start(stream, RunTask(0, 0, 0), worker=0, now=0.0)
    assert tasks.next_deadline() == 6.0  # nothing measured yet: 6 x the floor
    assert tasks.done(0, now=2.0).samples == 4  # 0.5 s a sample
    assert tasks.next_deadline() is None  # a finished task's deadline wakes no one
    tasks.start(stream, RunTask(1, 1, 0), worker=0, now=10.0)
    assert tasks.next_deadline() == 10.0 + 10 * 0.5 * 4
    assert tasks.done(99, now=11.0) is None and tasks.lost(99) is None  # not ours


def test_a_task_past_its_deadline_is_marked_hung_once_while_its_worker_is_on_it(stream):
    tasks = Tasks(TaskDeadlines(fixed_s=5.0), on_error="raise")
    for tid in range(3):
        tasks.start(stream, RunTask(tid, 0, 0), worker=tid, now=float(tid))
    on = {0: 0, 1: 99, 2: 2}  # worker -> the task it is on (worker 1 has moved on)
    assert tasks.overdue(4.9, lambda w, t: on[w] == t) == []
    hung = tasks.overdue(6.5, lambda w, t: on[w] == t)
    assert [tid for tid, _ in hung] == [0] and hung[0][1].hung
    assert tasks.overdue(100.0, lambda w, t: on[w] == t) == [(2, tasks.running[2])]  # task 0 is not marked twice
    hung_reason = "hung: still running after its 5.0s deadline (worker killed)"
    assert tasks.lost(0).lost_because("killed by SIGKILL") == hung_reason
    assert tasks.lost(1).lost_because("killed by SIGSEGV") == "crashed the decoder (worker killed by SIGSEGV)"


def test_a_queued_task_has_its_deadline_after_the_one_ahead_until_it_begins(stream):
    tasks = Tasks(TaskDeadlines(fixed_s=5.0), on_error="raise")
    tasks.start(stream, RunTask(0, 0, 0), worker=0, now=0.0)
    tasks.start(stream, RunTask(1, 1, 1), worker=0, now=1.0, behind=0)  # queued on the same worker
    assert (tasks.running[0].deadline, tasks.running[1].deadline) == (5.0, 10.0)
    on = {0: 0}  # worker 0 is still on task 0
    assert tasks.overdue(4.0, lambda w, t: on[w] == t) == []
    tasks.done(0, now=3.0)
    tasks.began(1, now=3.0)  # its own clock starts now
    assert tasks.running[1].deadline == 8.0 and tasks.next_deadline() == 8.0
    on[0] = 1
    assert tasks.overdue(7.9, lambda w, t: on[w] == t) == []
    assert [tid for tid, _ in tasks.overdue(8.0, lambda w, t: on[w] == t)] == [1]
    assert tasks.overdue(20.0, lambda w, t: on[w] == t) == []  # its first heap entry (10.0) marks nothing twice


def test_only_the_time_a_task_ran_teaches_the_deadlines(stream):
    tasks = Tasks(TaskDeadlines(floor_s=1.0), on_error="raise")
    tasks.start(stream, RunTask(0, 0, 0), worker=0, now=0.0)
    tasks.start(stream, RunTask(1, 1, 1), worker=0, now=0.0, behind=0)
    tasks.done(0, now=2.0)
    tasks.began(1, now=2.0)
    tasks.done(1, now=4.0)  # queued 4 s, ran 2 s: 0.5 s a sample, as task 0
    tasks.start(stream, RunTask(2, 0, 0), worker=0, now=10.0)
    assert tasks.next_deadline() == 10.0 + 10 * 0.5 * 4

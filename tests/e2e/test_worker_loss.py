"""The dispatcher driven by hand when a worker that held two tasks (one running, one queued
behind it) exits: the tasks it held are done again, by whichever worker comes next."""

from __future__ import annotations

import uuid

import pytest

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig

from testkit.dispatcher import close, deliver, loopless


@pytest.fixture
def dispatcher(demo_source):
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0), demo_source,
                 workers=1)
    yield d
    close(d)


def _two_tasks_on_one_worker(d):
    ident = uuid.uuid4().bytes
    deliver(d, ident, P.Hello(stream=1, spec=JobSpec(batch_size=4, image_size=32), slots=2, batches=[0, 1]))
    s = d.sessions.get(ident).stream
    d.tick()  # the one worker takes a task and queues the next behind it
    first, second = d.assigned
    assert list(d.pool.workers[0].tasks) == [first.task.task, second.task.task]
    # the scheduler met it with both slots taken: out of its line until an event says otherwise
    assert not s.state.dispatchable() and d.state.scheduler.candidates == 0
    return s, first, second


def test_tasks_held_by_a_worker_that_died_between_them_go_back_in_the_schedulers_line(dispatcher):
    """A worker killed between tasks (its Done on its way, its queued task never begun): neither
    counts against the batch, and the stream must be offered to the next idle worker."""
    d = dispatcher
    s, first, second = _two_tasks_on_one_worker(d)
    d.lose(0, died_on_first=False)
    assert s.state.dispatchable() and d.state.scheduler.candidates == 1
    assert d.totals.redone_tasks == 2 and d.state.tasks.running == {}
    d.tick()  # the worker that took its place takes the same batches, each once
    assert [a.batch for a in d.assigned[2:]] == [first.batch, second.batch]
    assert [a.worker.id for a in d.assigned[2:]] == [1, 1]


def test_the_task_a_worker_died_on_counts_against_its_batch_and_the_one_behind_does_not(dispatcher):
    d = dispatcher
    s, first, second = _two_tasks_on_one_worker(d)
    d.lose(0, died_on_first=True)
    assert s.state.dispatchable() and d.state.scheduler.candidates == 1
    assert d.totals.redone_tasks == 2 and d.state.tasks.running == {}
    assert s.state.tasks == {} and s.state.attempts == {first.batch: 1}  # the one behind was not its fault

"""The dispatcher driven by hand when a worker that held two tasks (one running, one queued
behind it) exits: the tasks it held are done again, by whichever worker comes next."""

from __future__ import annotations

import time
import uuid

import pytest

from wire import protocol as P
from wire.jobspec import JobSpec
from loader_service.config import ServiceConfig

from tests.support.dispatcher import close, deliver, loopless


@pytest.fixture
def dispatcher(demo_source):
    d = loopless(ServiceConfig(demo=True, host="127.0.0.1", data_port=0, http_port=0, workers=0), demo_source)
    yield d
    close(d)


def _two_tasks_on_one_worker(d, wid: int):
    ident = uuid.uuid4().bytes
    deliver(d, ident, P.Hello(stream=1, spec=JobSpec(batch_size=4, image_size=32), prefetch=2))
    s = d.sessions.get(ident).stream
    now = time.monotonic()
    first = s.state.next_task(d.tasks.next_id())
    d.tasks.start(s, first, wid, now)
    second = s.state.next_task(d.tasks.next_id())
    d.tasks.start(s, second, wid, now, behind=first.task)
    # the scheduler met it with both slots taken: out of its line until an event says otherwise
    d.scheduler.pick(1, lambda x: x.state.dispatchable(), lambda x: x.tier, lambda x: None)
    assert not s.state.dispatchable() and d.scheduler.candidates == 0
    return s, first, second


def test_tasks_held_by_a_worker_that_died_between_them_go_back_in_the_schedulers_line(dispatcher, monkeypatch):
    """A worker killed between tasks (its Done on its way, its queued task never begun): neither
    counts against the batch, and the stream must be offered to the next idle worker."""
    d = dispatcher
    s, first, second = _two_tasks_on_one_worker(d, wid=7)
    monkeypatch.setattr(d.pool, "reap", lambda wid: ([first.task, second.task], None, -9))
    d._on_worker_exit(7)
    assert s.state.dispatchable() and d.scheduler.candidates == 1
    assert d.totals.redone_tasks == 2 and d.tasks.running == {}
    taken = []
    d.scheduler.pick(2, lambda x: x.state.dispatchable(), lambda x: x.tier,
                     lambda x: taken.append(x.state.next_task(d.tasks.next_id()).batch))
    assert sorted(taken) == sorted([first.batch, second.batch])  # the same batches, each once


def test_the_task_a_worker_died_on_counts_against_its_batch_and_the_one_behind_does_not(dispatcher, monkeypatch):
    d = dispatcher
    s, first, second = _two_tasks_on_one_worker(d, wid=7)
    monkeypatch.setattr(d.pool, "reap", lambda wid: ([first.task, second.task], first.task, -9))
    d._on_worker_exit(7)
    assert s.state.dispatchable() and d.scheduler.candidates == 1
    assert d.totals.redone_tasks == 2 and d.tasks.running == {}

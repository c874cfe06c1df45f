"""One pass over an epoch (:class:`client.loader._Pass`, what ``iter(loader)`` returns), without
a service: ended by its loader it tells its run's streams to end before its generator's cleanup,
and then either owes only the StopIteration (taken to its end) or refuses to go on, saying why;
one in ``next()`` in another thread is never ended under it. The loader's rules for when it ends
a pass are run against a live service in tests/e2e/test_client.py."""

from __future__ import annotations

import threading

import pytest

from client.loader import _Pass


class Run:
    """An EpochRun's part a pass uses, recording what happened in order."""

    def __init__(self, events: list):
        self.events = events

    def end_streams(self) -> None:
        self.events.append("end_streams")


def a_pass(events: list, batches=(0, 1, 2, 3), gate: threading.Event = None,
           entered: threading.Event = None) -> _Pass:
    started: dict = {}

    def gen():
        started["run"] = Run(events)
        try:
            for b in batches:
                if gate is not None:
                    entered.set()
                    gate.wait(30)
                yield b
        finally:
            events.append("run closed")

    return _Pass(gen(), started, threading.current_thread(), epoch=4, resumed=False)


def test_a_pass_ended_part_way_tells_its_streams_then_refuses_to_go_on():
    events = []
    p = a_pass(events)
    assert [next(p), next(p)] == [0, 1] and p.alive
    p.end(finished=False)
    assert events == ["end_streams", "run closed"] and not p.alive
    with pytest.raises(RuntimeError, match="iterator of epoch 4 was ended part-way by a later iter"):
        next(p)


def test_a_pass_taken_to_its_end_owes_only_the_stop_iteration():
    events = []
    p = a_pass(events, batches=(0, 1))
    assert [next(p), next(p)] == [0, 1]
    p.end(finished=True)
    with pytest.raises(StopIteration):
        next(p)
    assert events == ["end_streams", "run closed"]


def test_a_pass_never_started_has_no_streams_to_end():
    events = []
    p = a_pass(events)
    p.end(finished=False)
    assert events == [] and not p.alive  # its generator never ran: nothing was asked of any service


def test_a_pass_in_next_in_another_thread_is_not_ended_under_it():
    events, gate, entered = [], threading.Event(), threading.Event()
    p = a_pass(events, gate=gate, entered=entered)
    got = []
    t = threading.Thread(target=lambda: got.append(next(p)))
    t.start()
    assert entered.wait(30)  # it is inside next() now, blocked on the gate
    assert p.running
    with pytest.raises(ValueError):
        p.end(finished=False)
    gate.set()
    t.join(30)
    assert got == [0] and not p.running and p.alive and "end_streams" not in events
    assert list(p) == [1, 2, 3]

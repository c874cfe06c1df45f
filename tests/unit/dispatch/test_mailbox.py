"""The mailbox other threads hand functions to the loop thread through: answers come back in
Futures, in order; a function without a Future raises in the loop; closing fails what waits."""

from __future__ import annotations

import select
import threading
from concurrent.futures import Future

import pytest

from loader_service.dispatch.mailbox import Mailbox


@pytest.fixture
def box():
    b = Mailbox()
    yield b
    b.close()


def _readable(box: Mailbox, timeout: float = 0.0) -> bool:
    poller = select.poll()  # not select(): it refuses a descriptor numbered past 1023
    poller.register(box.fileno(), select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def test_calls_from_other_threads_wake_the_loop_and_are_answered_in_order(box):
    ran, futures = [], [Future() for _ in range(3)]
    threads = [threading.Thread(target=box.put, args=(lambda i=i: ran.append(i) or i * 10, futures[i]))
               for i in range(3)]
    for t in threads:
        t.start()
        t.join()
    assert _readable(box, 5)
    box.run_all()
    assert ran == [0, 1, 2] and [f.result(0) for f in futures] == [0, 10, 20]
    assert not _readable(box)  # the wake-ups were read


def test_an_error_goes_to_the_caller_or_if_none_waits_to_the_loop(box):
    answered = Future()
    box.put(lambda: 1 / 0, answered)
    box.run_all()
    with pytest.raises(ZeroDivisionError):
        answered.result(0)
    box.put(lambda: 1 / 0, None)
    with pytest.raises(ZeroDivisionError):
        box.run_all()


def test_a_cancelled_call_is_not_run_and_closing_fails_the_calls_left():
    box = Mailbox()
    cancelled, left, ran = Future(), Future(), []
    box.put(lambda: ran.append("cancelled"), cancelled)
    cancelled.cancel()
    box.run_all()
    assert ran == []
    box.put(lambda: ran.append("left"), left)
    box.close()
    with pytest.raises(RuntimeError, match="the service stopped"):
        left.result(0)
    assert ran == []


def test_a_call_put_after_close_fails_at_once_and_is_never_run():
    # another thread's call that lost the race with the loop's close (a status line due as the
    # service stops) must not wait out its caller's timeout
    box = Mailbox()
    box.close()
    late, ran = Future(), []
    box.put(lambda: ran.append("late"), late)
    with pytest.raises(RuntimeError, match="the service stopped"):
        late.result(0)
    box.put(lambda: ran.append("posted"), None)  # a post after close: dropped, no error
    assert ran == []
    box.close()  # idempotent


def test_every_call_is_answered_or_failed_whichever_side_of_close_it_lands():
    box = Mailbox()
    futures: list = []
    go = threading.Event()

    def ask() -> None:
        go.wait()
        for i in range(200):
            f = Future()
            futures.append(f)
            box.put(lambda i=i: i, f)

    askers = [threading.Thread(target=ask) for _ in range(4)]
    for t in askers:
        t.start()
    go.set()
    box.run_all()
    box.close()
    for t in askers:
        t.join()
    assert len(futures) == 800 and all(f.done() for f in futures)
    assert {type(f.exception()) for f in futures if f.exception() is not None} <= {RuntimeError}

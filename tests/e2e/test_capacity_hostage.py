"""Batch memory is not held hostage: an idle client's slots go to a job that needs them.

Two kinds of idle: a client between epochs keeps its slots as a *reserve*, taken back at once
when another job needs them; a client whose stream is open but asks for nothing (its trainer is
checkpointing, evaluating, or gone to lunch) *lends* its slots once it has been quiet for
``reclaim_idle_s``, and takes slots again with its next request.
"""

import re

import pytest

from client import LoaderTimeout, RemoteLoader

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, status, wait_for

KW = dict(batch_size=32, image_size=64, prefetch=4, epoch_lookahead=False)  # 4 x 384 KiB = 1.5 MiB of slots
SLOTS = 4 * 32 * 64 * 64 * 3


def test_an_idle_client_s_reserve_goes_to_a_job_that_needs_it(make_service):
    svc = make_service(max_shm_mb=2)
    with RemoteLoader(svc.endpoint, seed=1, **KW) as idle:
        assert sorted(indices_of(collect(idle))) == list(range(DEMO_SIZE))
        # the epoch is over, the client stays connected and keeps its slots for its next epoch
        assert status(svc)["shm_bytes"] == SLOTS
        with RemoteLoader(svc.endpoint, seed=2, **KW) as other:  # 1.5 + 1.5 MiB > 2 MiB
            assert sorted(indices_of(collect(other))) == list(range(DEMO_SIZE))
        # and the idle client, back at work, gets memory again (the other one has left)
        assert sorted(indices_of(collect(idle))) == list(range(DEMO_SIZE))


def _clients(svc) -> dict:
    """seed of the client's job -> (its slots word, its slot bytes); seeds tell the clients apart."""
    st = status(svc)
    return {c["job"]: (c["slots"], c["slot_bytes"]) for c in st["clients"]}


def _quiet(svc, job: str) -> bool:
    """The job's stream has sent everything it was asked for and runs nothing."""
    for c in status(svc)["clients"]:
        s = c["stream"]
        if c["job"] == job and s is not None and s["in_flight"] == 0 and s["sent"] == s["to_send"]:
            return True
    return False


def test_open_streams_that_stop_asking_lend_their_slots_back_and_forth(make_service):
    """Two jobs, room for one: each pauses mid-epoch in turn, the other takes its slots; both
    epochs complete exactly once."""
    svc = make_service(max_shm_mb=2, reclaim_idle_s=0.3)
    got = {"a": [], "b": []}
    with RemoteLoader(svc.endpoint, seed=1, job="a", **KW) as a, RemoteLoader(svc.endpoint, seed=2, job="b", **KW) as b:
        it = {"a": iter(a), "b": iter(b)}
        for _ in range(2):
            got["a"] += next(it["a"]).indices
        wait_for(lambda: _quiet(svc, "a"), what="job a's stream to go quiet")
        for _ in range(2):  # b's stream waits for a's quiet time to pass, then a lends its slots
            got["b"] += next(it["b"]).indices
        assert _clients(svc) == {"a": ("lent", 0), "b": ("stream", SLOTS)}
        wait_for(lambda: _quiet(svc, "b"), what="job b's stream to go quiet")
        got["a"] += [i for batch in it["a"] for i in batch.indices]  # a asks again: b lends
        assert _clients(svc)["b"] == ("lent", 0)
        got["b"] += [i for batch in it["b"] for i in batch.indices]
    assert sorted(got["a"]) == sorted(got["b"]) == list(range(DEMO_SIZE))


def test_a_job_waiting_for_memory_that_is_not_lendable_yet_times_out_saying_so(make_service):
    svc = make_service(max_shm_mb=2, reclaim_idle_s=3600)
    with RemoteLoader(svc.endpoint, seed=1, job="a", **KW) as a:
        it = iter(a)
        first = list(next(it).indices)
        wait_for(lambda: _quiet(svc, "a"), what="job a's stream to go quiet")
        with RemoteLoader(svc.endpoint, seed=2, job="b", timeout=2, **KW) as b:
            with pytest.raises(LoaderTimeout) as info:
                next(iter(b))
            assert _clients(svc) == {"a": ("stream", SLOTS), "b": ("waiting", 0)}
        assert re.search(r"no batch for 2s: the loader service at \S+ is alive but its batch memory \(--max-shm-mb\) "
                         r"is all in use by other jobs' streams; \d+ of this loader's batches wait for slots",
                         str(info.value)), str(info.value)
        rest = [i for batch in it for i in batch.indices]
        assert sorted(first + rest) == list(range(DEMO_SIZE))  # a was never disturbed

"""Never silently wrong: DataLoader habits keep every sample, ranks that disagree are refused,
one rank has one client (live services)."""

from __future__ import annotations

import threading

import pytest

from client import LoaderError, RemoteLoader
from client.loader import default_job

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, indices_of, status

N = DEMO_SIZE
KW = dict(batch_size=16, image_size=32, seed=3, epoch_lookahead=False)


def test_peeking_at_one_batch_then_looping_yields_the_whole_epoch(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        peek = next(iter(ld))
        ld.set_epoch(0)
        epoch = [list(b.indices) for b in ld]
    assert sorted(i for b in epoch for i in b) == list(range(N))
    assert epoch[0] == list(peek.indices)  # the peeked batch comes again, first


def test_a_second_live_iterator_in_another_thread_is_an_error_at_once(service):
    """(In the iterator's own thread a new iter() ends it, as with a DataLoader: tests/e2e/test_client.py.)"""
    with RemoteLoader(service.endpoint, **KW) as ld:
        it = iter(ld)
        next(it)
        errors = []
        t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, iter, ld)))
        t.start()
        t.join(10)
        assert not t.is_alive() and errors and "already has a live iterator" in str(errors[0].value)
        rest = [list(b.indices) for b in it]  # the first iterator goes on unharmed
    assert len(rest) == N // 16 - 1


def test_a_consumer_that_stops_at_len_goes_on_to_the_next_epoch(service):
    """Lightning's fetcher takes len() batches and never asks for the StopIteration: the iterator
    of a fully taken epoch is not a second live one."""
    with RemoteLoader(service.endpoint, **KW) as ld:
        assert ld.batches_left() == len(ld) == N // 16
        epochs = []
        for _ in range(2):
            it = iter(ld)
            epochs.append([i for _ in range(len(ld)) for i in next(it).indices])
            assert ld.batches_left() == 0
        it = iter(ld)
        next(it)
        again = next(iter(ld))  # one not taken to its end is ended too: its epoch starts again
        assert again.epoch == 2 and again.index == 0
    assert [sorted(e) for e in epochs] == [list(range(N))] * 2 and epochs[0] != epochs[1]


def test_batches_left_after_a_resume_is_this_ranks_share_of_the_rest(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        it = iter(ld)
        for _ in range(3):
            next(it)
        state = ld.state_dict()
    with RemoteLoader(service.endpoint, **dict(KW, world_size=2, rank=1)) as ld:
        ld.load_state_dict(state)
        left = ld.batches_left()
        got = [b.indices for b in ld]
    assert left == len(got) == -(-(N - 3 * 16) // (2 * 16))


def test_set_epoch_during_an_epoch_applies_to_the_next_one_and_state_stays_true(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        seen = []
        for k, b in enumerate(ld):
            seen += b.indices
            if k == 1:
                ld.set_epoch(5)
                assert ld.state_dict()["epoch"] == 0 and ld.state_dict()["position"] == 2 * 16
        assert sorted(seen) == list(range(N))
        assert (ld.state_dict()["epoch"], ld.state_dict()["position"]) == (0, N)
        first = next(iter(ld))
        assert first.epoch == 5 and ld.state_dict()["epoch"] == 5


def test_only_the_first_iteration_after_load_state_dict_resumes(service):
    with RemoteLoader(service.endpoint, **KW) as ld:
        full = collect(ld)
        state = dict(ld.state_dict(), epoch=0, position=4 * 16)
    with RemoteLoader(service.endpoint, **KW) as ld:
        ld.load_state_dict(state)
        ld.set_epoch(0)
        assert indices_of(collect(ld, limit=2)) == indices_of(full[4:6])  # resumed, then left part-way
        assert indices_of(collect(ld)) == indices_of(full)  # a new iteration: the epoch from its start


@pytest.mark.parametrize("field, mine, theirs", [
    ("world_size", 3, 2), ("seed", 4, 3), ("batch_size", 8, 16), ("shuffle", False, True),
    ("drop_last", True, False), ("image_size", 48, 32),
])
def test_a_rank_whose_plan_differs_from_its_job_is_refused_naming_the_field(service, field, mine, theirs):
    base = dict(KW, job="train-a", world_size=2)
    with RemoteLoader(service.endpoint, **dict(base, rank=0)) as first:
        it = iter(first)
        next(it)  # rank 0 is connected and streaming
        other = dict(base, rank=1, **{field: mine})
        if field == "world_size":
            other["rank"] = 2
        with RemoteLoader(service.endpoint, **other) as second:
            with pytest.raises(LoaderError, match=rf"\[bad_job\].*{field}: {mine!r} here, {theirs!r} there"):
                collect(second)
        assert len(list(it)) == first.__len__() - 1  # rank 0 is unharmed


def test_a_newer_client_for_the_same_rank_takes_over_and_the_older_is_told(service):
    kw = dict(KW, job="train-b", world_size=2, rank=1)
    with RemoteLoader(service.endpoint, **kw) as old, RemoteLoader(service.endpoint, **kw) as new:
        it = iter(old)
        next(it)
        got = collect(new)
        with pytest.raises(LoaderError, match=r"\[replaced\] rank 1 of job 'train-b' was taken over"):
            list(it)
    assert len(got) == -(-(N // 2) // 16)


def test_status_counts_a_loader_with_its_lookahead_connection_as_one_client(service):
    with RemoteLoader(service.endpoint, **dict(KW, epoch_lookahead=True)) as ld:
        collect(ld)  # the next epoch now streams ahead on a second connection
        assert ld._ahead is not None
        clients = status(service)["clients"]
    assert len(clients) == 1


def test_the_default_job_comes_from_the_launcher(monkeypatch):
    for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert default_job() == ""
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert default_job() == "10.0.0.1:29500"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    assert default_job() == "torchelastic:abc123"

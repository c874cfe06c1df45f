"""Elastic resume with a real service: a state taken on any rank resumes the whole job at any world
size and batch size, and the rest of the epoch is delivered exactly once across the new ranks."""

import logging

import pytest

from client import LoaderError, RemoteLoader

from tests.conftest import DEMO_SIZE
from tests.support.helpers import collect, run_ranks

N = DEMO_SIZE  # 240
KW = dict(image_size=32, seed=11, epoch_lookahead=False)


def _real(batches):
    """The dataset indices of ``batches`` without the padding that evens out ranks at the end."""
    return [i for b in batches for i in (b["indices"][: len(b["indices"]) - b["padding"]])]


def _ranks(endpoint, world, steps, state=None, **kw):
    """Every rank of a job at once: each one's (batches, state_dict afterwards)."""
    return run_ranks(endpoint, world, steps, state, states=True, **kw)


@pytest.mark.parametrize("before, after", [
    ((2, 16), (3, 16)),   # more ranks, same batch size
    ((2, 16), (1, 16)),   # fewer ranks
    ((3, 8), (2, 12)),    # other world size and batch size
    ((1, 16), (4, 5)),    # a single process resumed by four
])
def test_a_state_from_rank_0_resumes_the_job_at_another_shape_exactly_once(make_service, caplog, before, after):
    svc = make_service()
    (w1, b1), (w2, b2) = before, after
    first = _ranks(svc.endpoint, w1, 3, batch_size=b1, job="elastic", **KW)
    states = [s for _, s in first]
    assert all(s == states[0] for s in states)  # every rank names the same position: any copy will do
    assert states[0]["position"] == 3 * b1 * w1
    caplog.set_level(logging.INFO, logger="client")
    second = _ranks(svc.endpoint, w2, -1, state=states[0], batch_size=b2, job="elastic-resumed", **KW)
    taken = [i for got, _ in first for i in _real(got)] + [i for got, _ in second for i in _real(got)]
    assert sorted(taken) == list(range(N))  # exactly once across both runs
    assert len({len(got) for got, _ in second}) == 1  # equal shares: DDP ranks never wait on each other
    assert all(s["position"] == N for _, s in second)
    if before != after:
        assert f"saved at world size {w1} x batch {b1}, now {w2} x {b2}" in caplog.text


def test_the_same_shape_resumes_on_the_whole_epochs_plan_batch_numbers_and_all(make_service):
    svc = make_service()
    full = _ranks(svc.endpoint, 2, -1, batch_size=16, **KW)
    head = _ranks(svc.endpoint, 2, 4, batch_size=16, **KW)
    rest = _ranks(svc.endpoint, 2, -1, state=head[1][1], batch_size=16, **KW)  # rank 1's copy, on both ranks
    for rank in range(2):
        assert head[rank][0] + rest[rank][0] == full[rank][0]


def test_ranks_that_loaded_different_checkpoints_are_refused_naming_both(make_service):
    svc = make_service()
    (got, early), = _ranks(svc.endpoint, 1, 2, batch_size=16, **KW)
    with RemoteLoader(svc.endpoint, batch_size=16, rank=0, world_size=2, job="mixed", **KW) as a, \
            RemoteLoader(svc.endpoint, batch_size=16, rank=1, world_size=2, job="mixed", **KW) as b:
        a.load_state_dict(early)
        b.load_state_dict(dict(early, position=early["position"] + 48))  # a newer checkpoint
        it = iter(a)
        next(it)
        with pytest.raises(LoaderError, match=r"rank 1 of job 'mixed' starts epoch 0 at sample 80 .* rank 0, which "
                                              r"is connected, runs it from sample 32: the ranks loaded different"):
            next(iter(b))


def test_a_state_taken_on_another_dataset_is_refused_saying_what_differs(make_service, imagefolder):
    demo, other = make_service(), make_service(data=(imagefolder,), demo=False)
    with RemoteLoader(demo.endpoint, batch_size=8, **KW) as ld:
        collect(ld, limit=2)
        state = ld.state_dict()
    with RemoteLoader(other.endpoint, batch_size=8, **KW) as ld:
        ld.load_state_dict(state)
        with pytest.raises(LoaderError, match=r"the dataset changed: the service serves .* samples .*; the loaded "
                                              rf"state was taken on {N} samples") as info:
            collect(ld)
        assert info.value.code == "dataset_changed"

"""Elastic resume with a real service: a state taken on any rank resumes the whole job at any world
size and batch size, and the rest of the epoch is delivered exactly once across the new ranks."""

import logging

import pytest

from client import LoaderError, RemoteLoader

from tests.conftest import DEMO_SIZE
from testkit.helpers import collect, run_ranks

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
    said = [r for r in caplog.records if f"saved at world size {w1} x batch {b1}, now {w2} x {b2}" in r.getMessage()]
    if before != after:  # a WARNING on the `client` logger: seen under Lightning and torchrun, whose logs drop INFO
        assert [(r.name, r.levelname) for r in said] == [("client", "WARNING")] * len(said) and said
        at, share = 3 * b1 * w1, len(second[0][0])  # what the line tells must be what happened
        assert all(r.getMessage().startswith(
            f"resuming epoch 0 at sample {at} of {N}, saved at world size {w1} x batch {b1}, now {w2} x {b2}: the "
            f"remaining {N - at} samples are shared by {w2} ranks, {share} batches each") for r in said)


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


@pytest.mark.parametrize("before, after", [((2, 4), (3, 5)), ((3, 4), (1, 8))])
def test_a_shuffle_window_resumes_at_another_shape_exactly_once(make_service, tmp_path, before, after):
    """WebDataset shards with shuffle_window=3: the job's first steps take a prefix of the windowed
    global order (the service uses the shards' blocks), and a resume at another world size and batch
    size serves exactly the rest; the state names the window."""
    from loader_service.sources import open_path
    from testkit.stores import write_shards
    from wire.plan import PlanSpec, epoch_order

    shards, per_shard, window = 10, 6, 3
    n = shards * per_shard
    write_shards(str(tmp_path / "data"), shards, per_shard)
    source = open_path(str(tmp_path / "data"), cache_dir=str(tmp_path / "index"))
    order = epoch_order(PlanSpec(n, 1, KW["seed"], window=window, blocks=source.blocks())).tolist()
    source.close()
    svc = make_service(data=(str(tmp_path / "data"),), demo=False, cache_dir=str(tmp_path / "index"))
    (w1, b1), (w2, b2) = before, after
    kw = dict(KW, shuffle_window=window)
    first = _ranks(svc.endpoint, w1, 2, batch_size=b1, job="windowed", **kw)
    state = first[0][1]
    assert state["shuffle_window"] == window and state["position"] == 2 * b1 * w1
    head = [i for got, _ in first for i in _real(got)]
    assert sorted(head) == sorted(order[:state["position"]])  # a prefix of the windowed order
    second = _ranks(svc.endpoint, w2, -1, state=state, batch_size=b2, job="windowed-resumed", **kw)
    rest = [i for got, _ in second for i in _real(got)]
    assert sorted(head + rest) == list(range(n))  # exactly once across both runs
    assert len({len(got) for got, _ in second}) == 1

"""The epoch plan: exactly once, equal shares, determinism, as a pure function."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.plan import PlanSpec, epoch_permutation, make_plan, num_batches


def all_ranks(length, bs, world, drop_last, seed=0, epoch=0, shuffle=True):
    return [make_plan(PlanSpec(length, bs, seed, epoch, r, world, shuffle, drop_last)) for r in range(world)]


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 300), bs=st.integers(1, 40), world=st.integers(1, 8),
       seed=st.integers(0, 2**32), epoch=st.integers(0, 50), shuffle=st.booleans())
def test_no_drop_last_delivers_every_index_with_stated_padding(length, bs, world, seed, epoch, shuffle):
    plans = all_ranks(length, bs, world, False, seed, epoch, shuffle)
    delivered = np.concatenate([p.indices for p in plans])
    padding = np.concatenate([p.padding for p in plans])
    # every index exactly once among the non-padding samples
    assert sorted(delivered[~padding].tolist()) == list(range(length))
    # padding repeats the head of the permutation: at most world-1 samples, and only to even out
    perm = epoch_permutation(length, seed, epoch, shuffle)
    total = -(-length // world) * world
    assert sorted(delivered[padding].tolist()) == sorted(np.resize(perm, total)[length:].tolist())
    # equal shares, padding only at the very end of a rank, equal batch counts
    assert len({len(p.indices) for p in plans}) == 1
    assert len({p.num_batches for p in plans}) == 1
    for p in plans:
        assert not p.padding[:-1].any()
        assert p.num_batches == num_batches(length, bs, world, False)
        got = np.concatenate([p.batch(i) for i in range(p.num_batches)])
        assert np.array_equal(got, p.indices)


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 300), bs=st.integers(1, 40), world=st.integers(1, 8), seed=st.integers(0, 999))
def test_drop_last_delivers_full_batches_without_duplicates(length, bs, world, seed):
    if length < world:
        with pytest.raises(ValueError, match="leaves every rank empty"):
            PlanSpec(length, bs, seed, 0, 0, world, True, True)
        return
    plans = all_ranks(length, bs, world, True, seed)
    delivered = [i for p in plans for b in range(p.num_batches) for i in p.batch(b).tolist()]
    assert len(delivered) == len(set(delivered))  # no index twice
    per_rank = (length // world) // bs * bs
    assert len(delivered) == per_rank * world
    for p in plans:
        assert p.num_batches == num_batches(length, bs, world, True)
        assert all(len(p.batch(b)) == bs for b in range(p.num_batches))
        assert not p.padding.any()


def test_plan_is_a_pure_function_and_epochs_differ():
    a = make_plan(PlanSpec(1000, 32, seed=7, epoch=3, rank=1, world_size=4))
    b = make_plan(PlanSpec(1000, 32, seed=7, epoch=3, rank=1, world_size=4))
    c = make_plan(PlanSpec(1000, 32, seed=7, epoch=4, rank=1, world_size=4))
    d = make_plan(PlanSpec(1000, 32, seed=8, epoch=3, rank=1, world_size=4))
    assert np.array_equal(a.indices, b.indices)
    assert not np.array_equal(a.indices, c.indices)
    assert not np.array_equal(a.indices, d.indices)


def test_no_shuffle_is_dataset_order_strided_by_rank():
    p = make_plan(PlanSpec(10, 2, rank=1, world_size=3, shuffle=False))
    assert p.indices.tolist() == [1, 4, 7, 0]  # 10 padded to 12 wraps around to index 0
    assert p.padding.tolist() == [False, False, False, True]


@pytest.mark.parametrize("kwargs, message", [
    (dict(length=0, batch_size=1), "length"),
    (dict(length=5, batch_size=0), "batch_size"),
    (dict(length=5, batch_size=1, world_size=0), "world_size"),
    (dict(length=5, batch_size=1, rank=2, world_size=2), "rank"),
    (dict(length=5, batch_size=1, seed=-1), "seed"),
])
def test_bad_specs_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlanSpec(**kwargs)


def test_batch_index_out_of_range():
    p = make_plan(PlanSpec(10, 4))
    assert p.num_batches == 3 and len(p.batch(2)) == 2
    with pytest.raises(IndexError):
        p.batch(3)


def test_every_rank_sees_one_permutation():
    plans = all_ranks(97, 5, 4, False, seed=3, epoch=2)
    counts = Counter(i for p in plans for i in p.indices.tolist())
    assert set(counts) == set(range(97))

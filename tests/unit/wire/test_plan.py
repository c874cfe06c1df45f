"""The epoch plan: exactly once, equal shares, determinism, as a pure function."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.plan import PlanSpec, epoch_permutation, make_plan, num_batches, position


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


def _taken(length, bs, world, drop_last, seed, origin, steps=None):
    """What every rank of a job at (world, bs) takes from ``origin`` on, in ``steps`` steps (None: all),
    without padding, and the job's position afterwards."""
    plans = [make_plan(PlanSpec(length, bs, seed, 0, r, world, True, drop_last, origin)) for r in range(world)]
    steps = plans[0].num_batches if steps is None else steps
    taken = [int(i) for p in plans for b in range(steps) for i, pad in zip(p.batch(b), p.batch_padding(b)) if not pad]
    positions = {p.position_after(steps) for p in plans}
    assert len(positions) == 1  # every rank names the same position: any rank's checkpoint will do
    return taken, positions.pop(), plans


@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, 400), seed=st.integers(0, 999), drop_last=st.booleans(), data=st.data(),
       world=st.integers(1, 8), bs=st.integers(1, 32), world2=st.integers(1, 8), bs2=st.integers(1, 32))
def test_a_resume_at_any_world_size_and_batch_size_serves_exactly_the_rest(length, seed, drop_last, data,
                                                                         world, bs, world2, bs2):
    """The elastic-resume rule: after k steps the job consumed a prefix of the epoch's global order,
    whatever its world size and batch size; a plan from that position, at another world size and
    batch size, serves exactly the rest (each index once; with drop_last, no index twice and only
    a tail shorter than one step of the new shape left out)."""
    if drop_last and length < max(world, world2):
        return
    first = make_plan(PlanSpec(length, bs, seed, 0, 0, world, True, drop_last))
    steps = data.draw(st.integers(0, first.num_batches), label="steps before the stop")
    before, position, _ = _taken(length, bs, world, drop_last, seed, 0, steps)
    order = epoch_permutation(length, seed, 0, True).tolist()
    if steps < first.num_batches:
        assert sorted(before) == sorted(order[:position])  # a prefix of the global order
    after, end, plans = _taken(length, bs2, world2, drop_last, seed, position)
    assert end == length
    assert len({len(p.indices) for p in plans}) == 1 and len({p.num_batches for p in plans}) == 1  # equal shares
    everything = before + after
    assert len(everything) == len(set(everything))  # never twice
    if not drop_last:
        assert sorted(everything) == list(range(length))  # exactly once
    else:
        left_out = set(order[position:]) - set(after)
        assert len(left_out) < world2 * bs2 + world2  # the tail a full step of the new shape cannot take
        assert all(len(p.batch(b)) == bs2 for p in plans for b in range(p.num_batches))


def test_a_plan_from_the_end_of_the_epoch_is_empty_and_start_is_checked():
    assert make_plan(PlanSpec(10, 4, origin=10)).num_batches == 0
    assert num_batches(10, 4, 2, False, origin=10) == 0 and num_batches(10, 4, 2, False, origin=3) == 1
    assert position(10, 2, 2, False, origin=0, steps=1) == 4 and position(10, 2, 2, False, origin=0, steps=3) == 10
    with pytest.raises(ValueError, match="steps must be in"):
        position(10, 2, 2, False, origin=0, steps=4)
    with pytest.raises(ValueError, match="origin must be in"):
        PlanSpec(10, 4, origin=11)

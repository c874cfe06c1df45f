"""The epoch plan: exactly once, equal shares, determinism, as a pure function."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.plan import Blocks, PlanSpec, epoch_order, epoch_permutation, make_plan, num_batches, position


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


# ---------------------------------------------------------------------------- a shuffle window (shard-aware)
@st.composite
def blocked(draw, max_length=400):
    """(length, Blocks): a dataset cut into contiguous blocks of any sizes (shards of a WebDataset)."""
    length = draw(st.integers(1, max_length))
    cuts = draw(st.sets(st.integers(1, length - 1), max_size=40)) if length > 1 else set()
    return length, Blocks([0, *sorted(cuts)])


def _windowed(length, blocks, window, seed=0, epoch=0):
    return epoch_order(PlanSpec(length, 1, seed, epoch, window=window, blocks=blocks))


def _block_of(length, blocks):
    return np.searchsorted(blocks.starts, np.arange(length), side="right") - 1


@settings(max_examples=300, deadline=None)
@given(data=blocked(), window=st.integers(1, 50), seed=st.integers(0, 2**32), epoch=st.integers(0, 50))
def test_a_window_orders_every_index_exactly_once_each_window_from_exactly_its_blocks(data, window, seed, epoch):
    length, blocks = data
    order = _windowed(length, blocks, window, seed, epoch)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(length))  # exactly once
    assert np.array_equal(order, _windowed(length, blocks, window, seed, epoch))  # a pure function
    # from the start of a window, the first `window` blocks met are its blocks (the last window: those
    # left); the window is then exactly all their samples, and the next one begins after it
    block_of = _block_of(length, blocks)[order].tolist()
    sizes = np.bincount(_block_of(length, blocks), minlength=len(blocks))
    pos, seen = 0, set()
    while pos < length:
        members = []
        for k in block_of[pos:]:
            if k not in members:
                members.append(k)
                if len(members) == window:
                    break
        end = pos + int(sizes[members].sum())
        assert set(block_of[pos:end]) == set(members)  # the window holds all of its blocks' samples, nothing else
        assert len(members) == min(window, len(blocks) - len(seen)) and not set(members) & seen
        seen |= set(members)
        pos = end
    assert seen == set(range(len(blocks)))


@settings(max_examples=200, deadline=None)
@given(data=blocked(), seed=st.integers(0, 999), extra=st.integers(0, 5))
def test_a_window_of_every_block_is_one_window_and_w0_is_the_old_order_exactly(data, seed, extra):
    length, blocks = data
    whole = _windowed(length, blocks, len(blocks) + extra, seed)
    assert sorted(whole.tolist()) == list(range(length))
    # W = 0, or no shuffle, or no blocks (every sample its own block): the uniform permutation, byte for byte
    assert np.array_equal(epoch_order(PlanSpec(length, 1, seed)), epoch_permutation(length, seed, 0, True))
    assert np.array_equal(epoch_order(PlanSpec(length, 1, seed, blocks=blocks)), epoch_permutation(length, seed, 0, True))
    assert np.array_equal(epoch_order(PlanSpec(length, 1, seed, window=3)), epoch_permutation(length, seed, 0, True))
    assert np.array_equal(epoch_order(PlanSpec(length, 1, seed, shuffle=False, window=3, blocks=blocks)),
                          np.arange(length))


def test_a_window_of_one_reads_block_after_block_and_windows_differ_by_seed_and_epoch():
    blocks = Blocks([0, 10, 20, 30])
    order = _windowed(40, blocks, 1, seed=4)
    for k in range(0, 40, 10):  # each run of 10 is one whole block
        assert len({int(i) // 10 for i in order[k:k + 10]}) == 1
    others = [_windowed(40, blocks, 2, seed=4, epoch=1), _windowed(40, blocks, 2, seed=5), _windowed(40, blocks, 2, seed=4)]
    assert not np.array_equal(others[0], others[2]) and not np.array_equal(others[1], others[2])


@settings(max_examples=300, deadline=None)
@given(data=blocked(), window=st.integers(1, 12), seed=st.integers(0, 999), drop_last=st.booleans(), choice=st.data(),
       world=st.integers(1, 8), bs=st.integers(1, 32), world2=st.integers(1, 8), bs2=st.integers(1, 32))
def test_a_window_keeps_the_resume_rule_at_any_world_size_and_batch_size(data, window, seed, drop_last, choice,
                                                                        world, bs, world2, bs2):
    """The global order does not depend on world size nor batch size, so the prefix rule of the
    elastic resume holds as with W = 0: k steps consumed a prefix, and a plan from there at
    another shape serves exactly the rest."""
    length, blocks = data
    if drop_last and length < max(world, world2):
        return
    spec = dict(seed=seed, drop_last=drop_last, window=window, blocks=blocks)
    order = epoch_order(PlanSpec(length, 1, **spec)).tolist()
    plans = [make_plan(PlanSpec(length, bs, rank=r, world_size=world, **spec)) for r in range(world)]
    steps = choice.draw(st.integers(0, plans[0].num_batches), label="steps before the stop")
    before = [int(i) for p in plans for b in range(steps) for i, pad in zip(p.batch(b), p.batch_padding(b)) if not pad]
    position_ = plans[0].position_after(steps)
    if steps < plans[0].num_batches:
        assert sorted(before) == sorted(order[:position_])  # a prefix of the global order
    rest = [make_plan(PlanSpec(length, bs2, rank=r, world_size=world2, origin=position_, **spec)) for r in range(world2)]
    after = [int(i) for p in rest for b in range(p.num_batches) for i, pad in zip(p.batch(b), p.batch_padding(b))
             if not pad]
    assert len({p.num_batches for p in rest}) == 1  # equal shares
    assert len(before + after) == len(set(before + after))  # never twice
    if not drop_last:
        assert sorted(before + after) == list(range(length))  # exactly once


@pytest.mark.parametrize("starts, match", [([], "at least one"), ([1, 4], "from 0"), ([0, 4, 4], "strictly increasing"),
                                           ([0, 5, 3], "strictly increasing")])
def test_bad_blocks_are_refused(starts, match):
    with pytest.raises(ValueError, match=match):
        Blocks(starts)


def test_blocks_past_the_dataset_are_refused_and_blocks_compare_by_content():
    with pytest.raises(ValueError, match="blocks start past the dataset's 10 samples"):
        PlanSpec(10, 2, window=2, blocks=Blocks([0, 5, 10]))
    with pytest.raises(ValueError, match="window must be >= 0"):
        PlanSpec(10, 2, window=-1)
    a, b = Blocks([0, 5]), Blocks(np.array([0, 5], dtype=np.int32))
    assert a == b and hash(a) == hash(b) and a != Blocks([0, 6]) and len({a, b}) == 1
    assert Blocks.of_labels(np.array([0, 0, 1, 1, 1, 3])) == Blocks([0, 2, 5])
    with pytest.raises(ValueError):
        a.starts[0] = 1  # read-only: a plan cache key never changes

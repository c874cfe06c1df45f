"""Plan-aware prefetch (sources/remote/prefetch.py): which shards a hint names, and the thread
against a real cache folder: it fetches exactly those shards, in plan order, into free room only."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from loader_service.sources.remote.cache import ShardCache, read_stats
from loader_service.sources.remote.prefetch import ShardPrefetcher, shards_ahead
from loader_service.sources.remote.store import ObjectInfo, RemoteError
from wire.plan import PlanSpec, make_plan

SHARDS, PER_SHARD, SIZE = 6, 5, 100
SHARD_OF = np.repeat(np.arange(SHARDS), PER_SHARD)
OBJECTS = [ObjectInfo(f"s{k}.tar", SIZE, f'"t{k}"') for k in range(SHARDS)]
DATA = {o.name: bytes([k]) * SIZE for k, o in enumerate(OBJECTS)}
WAIT_S = 30.0


class Fetcher:
    def __init__(self, fail=()):
        self.order, self.fail = [], set(fail)

    def __call__(self, info: ObjectInfo, fd: int) -> None:
        self.order.append(info.name)
        if info.name in self.fail:
            raise RemoteError(f"{info.name}: download not found")
        os.write(fd, DATA[info.name])


def _wait_for(pf: ShardPrefetcher, n: int) -> None:
    """Until the threads have judged ``n`` shards (a deadline, not a guess)."""
    deadline = time.monotonic() + WAIT_S
    while sum(v for k, v in pf.counts.items() if k != "dropped") < n:
        assert time.monotonic() < deadline, pf.counts
        time.sleep(0.01)


def test_the_shards_of_the_next_batches_in_order_of_first_use():
    plan = make_plan(PlanSpec(length=SHARDS * PER_SHARD, batch_size=4, seed=3))
    for batch, ahead in ((0, 1), (0, 3), (2, 4), (plan.num_batches - 1, 5)):
        idx = plan.indices[(batch + 1) * 4:(batch + 1 + ahead) * 4]
        want = list(dict.fromkeys(int(SHARD_OF[i]) for i in idx))
        assert shards_ahead(plan, batch, ahead, SHARD_OF) == want
    assert shards_ahead(plan, plan.num_batches - 1, 5, SHARD_OF) == []


@pytest.mark.parametrize("threads", [1, 4])
def test_a_hint_fetches_the_next_batches_shards_once_each_in_plan_order(tmp_path, threads):
    plan = make_plan(PlanSpec(length=SHARDS * PER_SHARD, batch_size=5, shuffle=False))  # batch b = shard b
    fetch = Fetcher()
    pf = ShardPrefetcher(lambda: ShardCache(str(tmp_path), 10 * SIZE, fetch, wait_s=1.0), OBJECTS,
                         [o.name for o in OBJECTS], SHARD_OF, ahead=3, threads=threads)
    pf.hint(plan, 0)
    pf.hint(plan, 0)  # the same shards again: each is fetched once (the second finds it queued or cached)
    _wait_for(pf, 3)
    pf.close()
    if threads == 1:
        assert fetch.order == ["s1.tar", "s2.tar", "s3.tar"]
    assert sorted(fetch.order) == ["s1.tar", "s2.tar", "s3.tar"]
    for name in fetch.order:
        assert (tmp_path / name).read_bytes() == DATA[name]
    st = read_stats(str(tmp_path))
    assert (st["prefetches"], st["misses"], st["evictions"]) == (3, 0, 0)


def test_a_prefetch_never_evicts_and_a_failed_one_is_left_to_the_read(tmp_path):
    plan = make_plan(PlanSpec(length=SHARDS * PER_SHARD, batch_size=5, shuffle=False))
    fetch = Fetcher(fail={"s2.tar"})
    reader = ShardCache(str(tmp_path), 2 * SIZE, fetch, wait_s=1.0)
    fd = reader.open(OBJECTS[0], "s0.tar")  # in use: one shard's room left
    pf = ShardPrefetcher(lambda: ShardCache(str(tmp_path), 2 * SIZE, fetch, wait_s=1.0), OBJECTS,
                         [o.name for o in OBJECTS], SHARD_OF, ahead=3, threads=1)
    pf.hint(plan, 1)  # shards 2 (fails), 3 (fits), 4 (no room: never evicts 3 nor 0 for it)
    _wait_for(pf, 3)
    pf.close()
    assert fetch.order == ["s0.tar", "s2.tar", "s3.tar"]
    assert (pf.counts["failed"], pf.counts["fetched"], pf.counts["no room"]) == (1, 1, 1)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".tar")) == ["s0.tar", "s3.tar"]
    assert read_stats(str(tmp_path))["evictions"] == 0
    os.close(fd)
    reader.close()


def test_hints_after_close_are_ignored(tmp_path):
    plan = make_plan(PlanSpec(length=SHARDS * PER_SHARD, batch_size=5, shuffle=False))
    fetch = Fetcher()
    pf = ShardPrefetcher(lambda: ShardCache(str(tmp_path), 10 * SIZE, fetch, wait_s=1.0), OBJECTS,
                         [o.name for o in OBJECTS], SHARD_OF, ahead=3)
    pf.close()
    pf.hint(plan, 0)
    pf.close()
    assert fetch.order == [] and pf.counts["fetched"] == 0


@pytest.mark.parametrize("bad", [-1])
def test_settings_refuse_a_negative_prefetch(bad):
    from loader_service.sources.remote.store import RemoteSettings

    with pytest.raises(ValueError, match="prefetch_batches"):
        RemoteSettings(prefetch_batches=bad)

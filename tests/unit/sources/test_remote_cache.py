"""The shard cache (sources/remote/cache.py) on its own: a real folder and real locks, several
handles on it (as decode processes have), objects fetched from bytes in memory. A model-based
test drives random interleavings of opens, prefetches, closes, failed downloads, killed downloads
and damaged leftovers, and checks after every step: never over the cap, a pinned shard never
evicted, a prefetch never evicts, every descriptor reads its shard's exact bytes, nothing
half-written ever opened."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loader_service.sources.remote.cache import PART, ShardCache, read_stats
from loader_service.sources.remote.store import Location, ObjectInfo, RemoteError

SIZES = (100, 250, 300, 400)
CAP = 700


def _objects():
    out = {}
    for k, size in enumerate(SIZES):
        data = bytes((k * 31 + i) % 251 for i in range(size))
        out[f"s{k}.tar"] = (ObjectInfo(f"s{k}.tar", size, f'"tag{k}"'), data)
    return out


class Store:
    """Objects in memory; ``fail`` makes the next fetch write half and raise (a dropped body)."""

    def __init__(self):
        self.objects, self.fail, self.fetches = _objects(), False, 0

    def fetch(self, info: ObjectInfo, fd: int) -> None:
        data = self.objects[info.name][1]
        self.fetches += 1
        if self.fail:
            self.fail = False
            os.write(fd, data[: len(data) // 2])
            raise RemoteError(f"{info.name}: truncated download")
        os.write(fd, data)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.folder = tempfile.mkdtemp(prefix="shard-cache-")
        self.store = Store()
        self.handles = [ShardCache(self.folder, CAP, self.store.fetch, wait_s=0.01) for _ in range(3)]
        self.open_fds = []  # (name, fd)
        self.opens = 0

    def teardown(self):
        for _, fd in self.open_fds:
            os.close(fd)
        for h in self.handles:
            h.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _pinned_bytes(self, but: str = "") -> int:
        return sum(self.store.objects[n][0].size for n in {n for n, _ in self.open_fds} if n != but)

    def _cached(self) -> set:
        return {n for n in os.listdir(self.folder) if n.endswith(".tar")}

    def _valid(self) -> set:
        """Cached shards of the version listed (a leftover of another one is fetched again)."""
        out = set()
        for n in self._cached():
            with open(os.path.join(self.folder, n + ".etag")) as f:
                if f.read().split("\n")[0] == self.store.objects[n][0].etag:
                    out.add(n)
        return out

    @rule(h=st.integers(0, 2), k=st.integers(0, len(SIZES) - 1))
    def open_shard(self, h, k):
        name = f"s{k}.tar"
        info = self.store.objects[name][0]
        was_cached = name in self._valid()
        fits = was_cached or self._pinned_bytes(but=name) + info.size <= CAP
        fetches = self.store.fetches
        try:
            fd = self.handles[h].open(info, name)
        except RemoteError as exc:
            assert not fits or "truncated" in str(exc), str(exc)
            if "room in the cache" in str(exc):
                assert self.store.fetches == fetches
            return
        assert fits, "opened a shard that cannot fit beside the pinned ones"
        assert self.store.fetches == fetches + (0 if was_cached else 1)
        self.open_fds.append((name, fd))
        self.opens += 1

    @rule(h=st.integers(0, 2), k=st.integers(0, len(SIZES) - 1))
    def prefetch_shard(self, h, k):
        name = f"s{k}.tar"
        info = self.store.objects[name][0]
        before, fetches = self._valid(), self.store.fetches
        pending = {n for n in os.listdir(self.folder) if n.endswith(PART)}  # leftovers of killed downloads
        try:
            got = self.handles[h].prefetch(info, name)
        except RemoteError as exc:
            assert "truncated" in str(exc) and name not in self._cached()
            return
        assert before - {name} <= self._valid(), "a prefetch evicted a shard"
        if got == "fetched":
            assert self.store.fetches == fetches + 1 and name in self._valid()
        else:
            assert self.store.fetches == fetches
            assert got == ("cached" if name in before else "no room"), (got, pending)
        if got == "no room":
            files = sum(os.path.getsize(os.path.join(self.folder, n)) for n in self._cached())
            assert files + info.size > CAP, "a prefetch that fits was refused"

    @precondition(lambda self: self.open_fds)
    @rule(data=st.data())
    def close_shard(self, data):
        i = data.draw(st.integers(0, len(self.open_fds) - 1))
        os.close(self.open_fds.pop(i)[1])

    @rule()
    def next_download_fails(self):
        self.store.fail = True

    @rule(k=st.integers(0, len(SIZES) - 1))
    def killed_download_left_a_part(self, k):
        path = os.path.join(self.folder, f"s{k}.tar" + PART)
        if os.path.exists(path) or os.path.exists(path[: -len(PART)]):
            return
        with open(path, "wb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(b"half")  # its process dies: the lock goes with it

    @rule(k=st.integers(0, len(SIZES) - 1))
    def leftover_of_another_version(self, k):
        name = f"s{k}.tar"
        if name in self._cached() or name in {n for n, _ in self.open_fds}:
            return
        with open(os.path.join(self.folder, name + ".etag"), "w") as f:
            f.write('"old"')
        with open(os.path.join(self.folder, name), "wb") as f:
            f.write(b"o" * self.store.objects[name][0].size)
        # left by a service of another listing, which counted it; or found by a start's scan
        # (nothing else writes the folder: the counter it shares is what lets a miss skip the scan)
        ShardCache(self.folder, CAP, self.store.fetch, wait_s=0.01).close()

    @invariant()
    def never_over_the_cap_but_by_leftovers(self):
        leftovers = sum(os.path.getsize(os.path.join(self.folder, n)) for n in os.listdir(self.folder)
                        if n.endswith(PART))
        files = sum(os.path.getsize(os.path.join(self.folder, n)) for n in os.listdir(self.folder)
                    if n.endswith(".tar"))
        stale = sum(self.store.objects[n][0].size for n in self._cached()
                    if open(os.path.join(self.folder, n + ".etag")).read().split("\n")[0] == '"old"')
        assert files - stale <= CAP
        assert leftovers <= 4 * len(SIZES)

    @invariant()
    def every_descriptor_reads_its_exact_shard(self):
        for name, fd in self.open_fds:
            data = self.store.objects[name][1]
            assert os.pread(fd, len(data) + 1, 0) == data
            assert name in self._cached(), "a pinned shard was evicted"

    @invariant()
    def counters_add_up(self):
        s = read_stats(self.folder)
        assert s["hits"] + s["misses"] >= self.opens and s["misses"] + s["prefetches"] == self.store.fetches


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_cache_model = CacheMachine.TestCase


def test_a_shard_larger_than_the_cap_is_refused_before_any_download(tmp_path):
    store = Store()
    cache = ShardCache(str(tmp_path), 200, store.fetch, wait_s=1.0)
    with pytest.raises(RemoteError, match=r"s3.tar: a shard of 400 bytes cannot fit a cache of 200 bytes"):
        cache.open(store.objects["s3.tar"][0], "s3.tar")
    assert store.fetches == 0
    cache.close()


def test_pinned_shards_leave_no_room_then_the_wait_ends_with_the_reason(tmp_path):
    store = Store()
    cache = ShardCache(str(tmp_path), 600, store.fetch, wait_s=0.05)
    fd = cache.open(store.objects["s3.tar"][0], "s3.tar")
    with pytest.raises(RemoteError, match=r"s2.tar: waited 0s for room in the cache: 4\d\d bytes of shards in use, "
                                          r"the cap is 600 bytes"):
        cache.open(store.objects["s2.tar"][0], "s2.tar")
    os.close(fd)
    fd = cache.open(store.objects["s2.tar"][0], "s2.tar")  # unpinned: s3 is evicted for it
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".tar")) == ["s2.tar"]
    assert read_stats(str(tmp_path))["evictions"] == 1
    os.close(fd)
    cache.close()


def test_a_miss_scans_the_folder_only_when_the_cap_has_no_room(tmp_path, monkeypatch):
    """A miss costs O(1) while the cap has room (the counter is trusted: it never counts less than
    the folder holds); the folder is scanned (O(files cached)) only to evict."""
    store = Store()
    cache = ShardCache(str(tmp_path), 700, store.fetch, wait_s=1.0)
    scans = []
    real = ShardCache._used
    monkeypatch.setattr(ShardCache, "_used", lambda self: scans.append(1) or real(self))
    for name in ("s0.tar", "s1.tar", "s2.tar"):  # 100 + 250 + 300 bytes: room for each
        os.close(cache.open(store.objects[name][0], name))
    assert scans == [] and read_stats(str(tmp_path))["cached_bytes"] == 650
    os.close(cache.open(store.objects["s3.tar"][0], "s3.tar"))  # 400 more: a scan, and evictions
    assert len(scans) == 1 and read_stats(str(tmp_path))["evictions"] >= 1
    assert read_stats(str(tmp_path))["cached_bytes"] <= 700
    cache.close()


@pytest.mark.parametrize("url, base, prefix, names", [
    ("s3://bkt/train/", "s3://bkt", "train/", ()),
    ("s3://bkt/train", "s3://bkt", "train/", ()),
    ("s3://bkt", "s3://bkt", "", ()),
    ("s3://bkt/a/s-{00..02}.tar", "s3://bkt", "a/", ("s-00.tar", "s-01.tar", "s-02.tar")),
    ("https://h:8/d/x/", "https://h:8/d/x/", "", ()),
    ("https://h/d/one.tar", "https://h/d/", "", ("one.tar",)),
])
def test_urls(url, base, prefix, names):
    loc = Location.parse(url)
    assert (loc.base, loc.prefix, loc.names) == (base, prefix, names)


@pytest.mark.parametrize("url, why", [("ftp://h/x/", "not a dataset URL"), ("s3:///x", "not a dataset URL"),
                                      ("https://h/a/s-{0..1}.tar.gz", "not a .tar shard")])
def test_bad_urls(url, why):
    with pytest.raises(ValueError, match=why):
        Location.parse(url)


def test_an_etag_is_one_version_with_or_without_its_quotes():
    """A store may list an object's ETag bare and send it quoted with the GET (fake-gcs-server
    does; S3 quotes both): the same version, while another value is another version."""
    from loader_service.sources.remote.store import etag_value, same_etag

    assert same_etag('"9b2cf535f27731c974343645a3985328"', "9b2cf535f27731c974343645a3985328")
    assert same_etag('W/"abc"', '"abc"') and etag_value(' "abc" ') == "abc"
    assert not same_etag('"abc"', '"abd"') and not same_etag("abc", "")

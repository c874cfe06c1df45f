"""The shard cache checks content, not only size, when a restarted service reuses it (issue 39):
a cached shard damaged at the same size is downloaded again, never read (before: a restart checked
size and ETag, and 61 of 100 samples of such a shard failed as DecodeError naming a healthy object)."""

from __future__ import annotations

import logging
import os

import pytest

from loader_service.sources import open_path
from loader_service.sources.remote.store import RemoteSettings
from testkit.stores import RangeHTTPServer, shard_set

SHARDS, PER_SHARD, PAD = 3, 6, 2000


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return shard_set(str(tmp_path_factory.mktemp("content")), SHARDS, PER_SHARD, PAD)


def _cached(tmp_path, shard: str) -> str:
    folder = tmp_path / "cache" / "shards"
    (name,) = [n for n in os.listdir(folder) if n.endswith("-" + shard)]
    return str(folder / name)


def _damage(path: str, member: bytes) -> None:
    """One byte of ``member``'s data flipped in place: the same size, the same mtime."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        data = f.read()
        at = data.index(member) + len(member) // 2
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("sidecar", ["checksum", "older version: MD5 ETag only"])
def test_a_cached_shard_damaged_at_the_same_size_is_fetched_again_after_a_restart(tmp_path, shards, caplog, sidecar):
    caplog.set_level(logging.WARNING, logger="loader_service")
    with RangeHTTPServer(shards["root"]) as http:
        settings = RemoteSettings(cache_dir=str(tmp_path / "cache"), cache_max_bytes=10 * shards["size"])
        src = open_path(http.url + "/data/", remote=settings)
        want = {src.keys[i]: src.read(i) for i in range(len(src))}
        src.close()
        damaged, healthy = _cached(tmp_path, "shard-000001.tar"), _cached(tmp_path, "shard-000002.tar")
        if sidecar != "checksum":  # what this cache's older version left: the ETag alone
            for path in (damaged, healthy):
                with open(path + ".etag") as f:
                    etag = f.read().split("\n")[0]
                with open(path + ".etag", "w") as f:
                    f.write(etag)
        _damage(damaged, shards["want"]["s1-0002"][0])
        gets = dict(http.faults.gets)
        again = open_path(http.url + "/data/", remote=settings)  # a restart: the saved index, the cache reused
        assert again.index_origin == "loaded"
        assert {again.keys[i]: again.read(i) for i in range(len(again))} == want
        assert {n: k - gets.get(n, 0) for n, k in http.faults.gets.items() if k != gets.get(n, 0)} == \
            {"shard-000001.tar": 1}
        said = [r.getMessage() for r in caplog.records if "cached copy" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith(f"{http.url}/data/shard-000001.tar: the cached copy ")
        assert "does not match its checksum" in said[0]
        again.close()

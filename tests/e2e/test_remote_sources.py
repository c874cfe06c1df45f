"""Datasets in object storage (issue 29), against real servers on loopback: moto's S3 server and a
threaded HTTP server with Range support and injected faults. Exactly once over an epoch from
each, cold and warm cache, with a cap smaller than the dataset; every failure a clear error that
names the object and the cause, and nothing half-written ever read as a shard."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from client import RemoteLoader
from loader_service.sources import open_path
from loader_service.sources.remote.cache import PART
from loader_service.sources.remote.store import RemoteError, RemoteSettings
from loader_service.sources.remote.webdataset import OPEN_SHARDS
from testkit.helpers import collect, indices_of, status
from testkit.stores import TEST_KEY, Blackhole, MotoServer, RangeHTTPServer, shard_set, write_shards

SHARDS, PER_SHARD, PAD = 5, 8, 3000
N = SHARDS * PER_SHARD
KW = dict(batch_size=4, image_size=16, seed=5)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return shard_set(str(tmp_path_factory.mktemp("remote")), SHARDS, PER_SHARD, PAD)


@pytest.fixture
def s3(shards, monkeypatch):
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    with MotoServer() as server:
        server.upload_folder("bkt", shards["data"], "train/")
        yield server


def _settings(tmp_path, shards, **kw) -> RemoteSettings:
    """A cap of 3 shards, less than the 5 of the dataset: eviction happens within every epoch."""
    return RemoteSettings(cache_dir=str(tmp_path / "cache"), cache_max_bytes=3 * shards["size"] + 100, **kw)


def _by_key(src) -> dict:
    return {src.keys[i]: (src.read(i), int(src.labels[i])) for i in range(len(src))}


def _cache_files(tmp_path) -> list:
    folder = tmp_path / "cache" / "shards"
    return sorted(os.listdir(folder)) if folder.exists() else []


# ---------------------------------------------------------------------------- the source on its own
def test_http_folder_and_pattern_read_every_sample_byte_exact_under_a_small_cap(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        settings = _settings(tmp_path, shards)
        src = open_path(http.url + "/data/", remote=settings)
        assert src.index_origin == "scanned" and src.name == "data" and len(src) == N
        assert _by_key(src) == shards["want"]
        st = src.cache_status()
        assert st["cached_bytes"] <= settings.cache_max_bytes and st["evictions"] > 0 and st["failures"] == 0
        assert not [f for f in _cache_files(tmp_path) if f.endswith(PART)]
        src.close()
        # the same listing through a pattern: the saved index is reused, no shard is scanned again
        gets = dict(http.faults.gets)
        again = open_path(http.url + "/data/shard-{000000..000004}.tar", remote=settings)
        assert again.index_origin == "loaded" and again.fingerprint() == src.fingerprint()
        assert http.faults.gets == gets
        assert again.describe(0) == f"{http.url}/data/shard-000000.tar:s0-0000"
        again.close()


def test_s3_prefix_reads_every_sample_and_a_changed_object_is_a_new_dataset(tmp_path, shards, s3):
    settings = _settings(tmp_path, shards, endpoint_url=s3.endpoint)
    src = open_path("s3://bkt/train/", remote=settings)
    assert src.name == "train" and _by_key(src) == shards["want"]
    src.close()
    # replace one object: a new ETag, so a new index (a new identity), never the old one mixed in
    client = s3.client()
    client.put_object(Bucket="bkt", Key="train/shard-000004.tar", Body=open(os.path.join(shards["data"],
                                                                                        "shard-000003.tar"), "rb").read())
    changed = open_path("s3://bkt/train/", remote=settings)
    assert changed.index_origin == "scanned" and changed.fingerprint() != src.fingerprint()
    changed.close()


def test_a_killed_services_cache_is_reused_after_verification(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        settings = _settings(tmp_path, shards)
        src = open_path(http.url + "/data/", remote=settings)
        src.close()
        cached = [f for f in _cache_files(tmp_path) if f.endswith(".tar")]
        assert len(cached) == 3
        folder = tmp_path / "cache" / "shards"
        # what a kill leaves: a half-written download, and a complete shard whose .etag says another version
        (folder / (cached[0] + PART)).write_bytes(b"half")
        (folder / (cached[1] + ".etag")).write_text('"an-older-version"')
        again = open_path(http.url + "/data/", remote=settings)
        assert again.index_origin == "loaded"
        first_of = {again.keys[i].split("-")[0]: i for i in reversed(range(N))}

        def gets_for(local):  # the GETs one read of a sample of that shard costs
            name = local.split("-", 1)[1]
            before = http.faults.gets.get(name, 0)
            i = first_of["s" + str(int(name[6:12]))]
            assert again.read(i) == shards["want"][again.keys[i]][0]
            return http.faults.gets.get(name, 0) - before

        assert gets_for(cached[2]) == 0, "a verified shard is used as it is"
        assert gets_for(cached[1]) == 1, "a mismatching one is downloaded again"
        assert gets_for(cached[0]) == 0, "the complete shard beside a stale .part is still good"
        assert not [f for f in _cache_files(tmp_path) if f.endswith(PART)], "the stale .part is gone"
        assert _by_key(again) == shards["want"]
        again.close()


def test_an_idle_decode_process_unpins_its_open_shards(tmp_path, shards):
    """A process keeps its last shards open (pinned) between reads, but not once it has no task:
    two processes whose pins filled a cap could otherwise wait on each other's idle pins (CI saw a
    read wait for room while the other process sat idle holding two shards)."""
    import fcntl

    with RangeHTTPServer(shards["root"]) as http:
        src = open_path(http.url + "/data/", remote=_settings(tmp_path, shards))
        first_of = {}
        for i in range(len(src)):
            first_of.setdefault(int(src._shard[i]), i)
        for k in (0, 1):
            src.read(first_of[k])
        pinned = [str(tmp_path / "cache" / "shards" / os.path.basename(src.shards[k])) for k in (0, 1)]

        def in_use(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                return True
            finally:
                os.close(fd)

        assert [in_use(p) for p in pinned] == [True, True]
        src.idle()
        assert [in_use(p) for p in pinned] == [False, False]
        assert src.read(first_of[1]) == shards["want"][src.keys[first_of[1]]][0]  # and it reads on afterwards
        src.close()


# ---------------------------------------------------------------------------- through the service
@pytest.mark.slow
@pytest.mark.parametrize("store", ["http", "s3"])
def test_exactly_once_over_an_epoch_cold_and_warm_with_a_cap_below_the_dataset(make_service, tmp_path, shards,
                                                                               store, request):
    local = make_service(data=(shards["data"],), demo=False, workers=2)
    with RemoteLoader(local.endpoint, **KW) as ld:
        want = collect(ld)
    local.stop()
    if store == "http":
        server = RangeHTTPServer(shards["root"]).__enter__()
        request.addfinalizer(lambda: server.__exit__(None, None, None))
        url, endpoint = server.url + "/data/", ""
    else:
        server = request.getfixturevalue("s3")
        url, endpoint = "s3://bkt/train/", server.endpoint
    cap_gb = (4 * shards["size"] + 100) / 1e9  # 2 x 2 decode processes x a shard, below the dataset's 5
    for run in ("cold", "warm"):
        svc = make_service(data=(url,), demo=False, workers=2, cache_dir=str(tmp_path / "cache"),
                           cache_max_gb=cap_gb, s3_endpoint_url=endpoint)
        with RemoteLoader(svc.endpoint, **KW) as ld:
            got = collect(ld)
        assert sorted(indices_of(got)) == list(range(N)), run
        assert indices_of(got) == indices_of(want) and [b["images"] for b in got] == [b["images"] for b in want]
        cache = status(svc)["shard_cache"]["train" if store == "s3" else "data"]
        assert cache["cached_bytes"] <= cap_gb * 1e9 and cache["failures"] == 0
        assert cache["hits"] + cache["misses"] > 0
        svc.stop()


@pytest.mark.slow
def test_with_prefetch_each_shard_is_downloaded_once_and_the_epoch_is_exactly_once(make_service, tmp_path, shards):
    """Cap above the dataset, cold cache: reads and the prefetch thread share the downloads (one per
    shard, whoever claimed it first), and the epoch is the local one, byte for byte."""
    local = make_service(data=(shards["data"],), demo=False, workers=2)
    with RemoteLoader(local.endpoint, **KW) as ld:
        want = collect(ld)
    local.stop()
    with RangeHTTPServer(shards["root"]) as http:
        cap = 2 * SHARDS * shards["size"]
        svc = make_service(data=(http.url + "/data/",), demo=False, workers=2, cache_dir=str(tmp_path / "cache"),
                           cache_max_gb=cap / 1e9, shard_prefetch=4)
        # the index is made at start by a scan that fills the cache: empty it to start cold
        for name in _cache_files(tmp_path):
            os.unlink(tmp_path / "cache" / "shards" / name)
        gets = dict(http.faults.gets)
        with RemoteLoader(svc.endpoint, **KW) as ld:
            got = collect(ld)
        assert [b["images"] for b in got] == [b["images"] for b in want] and indices_of(got) == indices_of(want)
        cache = status(svc)["shard_cache"]["data"]
        assert cache["misses"] + cache["prefetches"] == SHARDS and cache["evictions"] == 0
        assert cache["cached_bytes"] <= cap and cache["failures"] == 0
        assert {n: http.faults.gets[n] - gets.get(n, 0) for n in http.faults.gets} == \
            {f"shard-{k:06d}.tar": 1 for k in range(SHARDS)}
        svc.stop()


def test_status_metrics_and_config_show_the_cache_never_the_credentials(make_service, tmp_path, shards, s3,
                                                                      capsys):
    import urllib.request

    from loader_service.cli.main import main

    svc = make_service(data=("s3://bkt/train/",), demo=False, workers=1, cache_dir=str(tmp_path / "cache"),
                       s3_endpoint_url=s3.endpoint)
    with RemoteLoader(svc.endpoint, **KW) as ld:
        collect(ld, limit=2)
    body = json.dumps(status(svc))
    metrics = urllib.request.urlopen(svc.http_url + "/metrics", timeout=10).read().decode()
    assert "loader_shard_cache_bytes" in metrics and "loader_shard_cache_prefetches_total" in metrics and 'loader_shard_cache_misses_total{dataset="train"}' in metrics
    assert main(["config", "--data", "s3://bkt/train/", "--s3-endpoint-url", s3.endpoint]) == 0
    shown = capsys.readouterr().out
    assert "s3_endpoint_url" in shown
    for secret in (TEST_KEY["AWS_SECRET_ACCESS_KEY"], TEST_KEY["AWS_ACCESS_KEY_ID"]):
        assert secret not in body and secret not in metrics and secret not in shown
        assert secret not in repr(svc.config) and secret not in repr(next(iter(svc.sources.values())).spec())


# ---------------------------------------------------------------------------- failures
def test_missing_bucket_and_missing_prefix_name_the_url(tmp_path, shards, s3):
    settings = _settings(tmp_path, shards, endpoint_url=s3.endpoint)
    with pytest.raises(RemoteError, match=r"s3://nobucket/train/: listing .*(not found|NoSuchBucket)"):
        open_path("s3://nobucket/train/", remote=settings)
    with pytest.raises(RemoteError, match=r"s3://bkt/nothing/: no \.tar shards there"):
        open_path("s3://bkt/nothing/", remote=settings)


def test_unknown_and_expired_credentials_are_refused_naming_the_url(tmp_path, shards, s3, monkeypatch):
    """moto checking signatures: a key its IAM does not know (a revoked key), and temporary
    credentials whose session token is no longer the one issued (expired), are refused by the
    store; the service's error names the URL and says access denied. The role's real
    credentials read the bucket (the control)."""
    temporary = s3.temporary_credentials("bkt")
    s3.require_auth()
    settings = _settings(tmp_path, shards, endpoint_url=s3.endpoint, max_retries=0)
    with pytest.raises(RemoteError, match=r"s3://bkt/train/: listing access denied .*InvalidAccessKeyId"):
        open_path("s3://bkt/train/", remote=settings)  # TEST_KEY: unknown to moto's IAM
    for k, v in temporary.items():
        monkeypatch.setenv(k, v)
    src = open_path("s3://bkt/train/", remote=settings)
    assert _by_key(src) == shards["want"]
    src.close()
    monkeypatch.setenv("AWS_SESSION_TOKEN", "expired" + temporary["AWS_SESSION_TOKEN"])  # no longer the one issued
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(RemoteError, match=r"s3://bkt/train/: listing access denied .*(token|Token)"):
        open_path("s3://bkt/train/", remote=settings)


def test_access_denied_names_the_object(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        http.faults.status["shard-000002.tar"] = 403
        with pytest.raises(RemoteError, match=r"/data/shard-000002.tar: HEAD access denied"):
            open_path(http.url + "/data/", remote=_settings(tmp_path, shards))


def test_an_object_deleted_mid_epoch_fails_its_samples_naming_it(tmp_path, shards):
    data = tmp_path / "served" / "data"
    shutil.copytree(shards["data"], data)
    with RangeHTTPServer(str(tmp_path / "served")) as http:
        src = open_path(http.url + "/data/", remote=_settings(tmp_path, shards))
        # the start's scan (several shards at once) left 3 of the 5 in the cache, which 3 as it went
        cached = {int(f[-10:-4]) for f in _cache_files(tmp_path) if f.endswith(".tar")}
        gone, kept = min(set(range(SHARDS)) - cached), max(cached)
        first = [i for i in range(N) if src.keys[i].startswith(f"s{gone}-")]
        last = [i for i in range(N) if src.keys[i].startswith(f"s{kept}-")]
        src.read(last[0])  # cached: it stays readable from the cache
        os.unlink(data / f"shard-{gone:06d}.tar")
        with pytest.raises(RemoteError, match=rf"/data/shard-{gone:06d}.tar: download .*not found"):
            src.read(first[0])
        assert src.read(last[1]) == shards["want"][src.keys[last[1]]][0]
        assert not [f for f in _cache_files(tmp_path) if f"shard-{gone:06d}" in f]
        src.close()


@pytest.mark.slow
def test_an_object_deleted_mid_epoch_under_skip_is_skipped_sample_by_sample_and_named(make_service, tmp_path, shards):
    """Through the service with --on-error skip: the shard read last (no shuffle: batch k is shard k)
    is deleted from the store after the first batch arrives; its batch comes without its samples,
    each skip names the object and the cause, the other shards' batches are whole and byte-exact."""
    data = tmp_path / "served" / "data"
    shutil.copytree(shards["data"], data)
    kw = dict(KW, batch_size=PER_SHARD, shuffle=False, prefetch=2, epoch_lookahead=False)
    with RangeHTTPServer(str(tmp_path / "served")) as http:
        svc = make_service(data=(http.url + "/data/",), demo=False, workers=2, cache_dir=str(tmp_path / "cache"),
                           cache_max_gb=(4 * shards["size"] + 100) / 1e9, on_error="skip", shard_prefetch=0)
        for name in _cache_files(tmp_path):  # the start's scan cached the last shards: start cold
            os.unlink(tmp_path / "cache" / "shards" / name)
        with RemoteLoader(svc.endpoint, **kw) as ld:
            batches = iter(ld)
            first = next(batches)
            os.unlink(data / f"shard-{SHARDS - 1:06d}.tar")  # batch 0 is in; the last batch is not started yet
            rest = collect(batches)  # the same iterator: the rest of the epoch
        gone = list(range((SHARDS - 1) * PER_SHARD, N))
        skipped = {i: why for b in rest for i, why in b["skipped"]}
        assert sorted(skipped) == gone
        for why in skipped.values():
            assert f"{http.url}/data/shard-{SHARDS - 1:06d}.tar: download" in why and "not found" in why, why
        assert list(first.indices) + indices_of(rest) == list(range((SHARDS - 1) * PER_SHARD))
        assert [b["shape"][0] for b in rest] == [PER_SHARD] * (SHARDS - 2) + [0]
        st = status(svc)
        assert st["totals"]["skipped"] == PER_SHARD and st["shard_cache"]["data"]["failures"] >= 1
        svc.stop()


def test_throttling_is_retried_with_backoff(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        http.faults.throttle = 2  # two 503 SlowDown answers, then the store answers
        src = open_path(http.url + "/data/", remote=_settings(tmp_path, shards))
        assert http.faults.throttle == 0 and _by_key(src) == shards["want"]
        src.close()
        http.faults.throttle = 100  # more than the retries: a clear failure
        src = open_path(http.url + "/data/", remote=_settings(tmp_path, shards, max_retries=1))
        with pytest.raises(RemoteError, match=r"/data/shard-0000\d\d.tar: download .*503"):
            for i in range(N):
                src.read(i)
        assert not [f for f in _cache_files(tmp_path) if f.endswith(PART)]
        src.close()


def test_a_blackholed_endpoint_times_out_naming_the_url(tmp_path, shards):
    with Blackhole() as hole:
        settings = _settings(tmp_path, shards, timeout_s=1.0, max_retries=0)
        with pytest.raises(RemoteError, match=rf"{hole.url}/data/shard-000000.tar: HEAD failed.*(imeout|timed out)"):
            open_path(hole.url + "/data/shard-{000000..000001}.tar", remote=settings)


def test_a_truncated_download_is_never_read_as_a_shard(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        http.faults.short["shard-000001.tar"] = 1000
        with pytest.raises(RemoteError, match=r"/data/shard-000001.tar: .*(truncated|download)"):
            open_path(http.url + "/data/", remote=_settings(tmp_path, shards, max_retries=0))
        assert not [f for f in _cache_files(tmp_path) if "shard-000001" in f]
        del http.faults.short["shard-000001.tar"]
        src = open_path(http.url + "/data/", remote=_settings(tmp_path, shards))
        assert _by_key(src) == shards["want"]
        src.close()


# ---------------------------------------------------------------------------- a shuffle window (issue 29)
WIN_SHARDS, WIN = 12, 2


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-window")
    want = write_shards(str(root / "data"), WIN_SHARDS, PER_SHARD, pad=PAD)
    sizes = [os.path.getsize(root / "data" / f"shard-{k:06d}.tar") for k in range(WIN_SHARDS)]
    return {"root": str(root), "data": str(root / "data"), "want": want, "size": max(sizes)}


def _epoch_downloads(make_service, tmp_path, shards, url, window):
    """One shuffled epoch (seed 5) through one decode process, prefetch off, a cap of W + 2 shards (a
    third of the dataset): the epoch's indices and the shard downloads it cost."""
    cap = (WIN + OPEN_SHARDS) * shards["size"] + 100
    svc = make_service(data=(url,), demo=False, workers=1, cache_dir=str(tmp_path / f"cache-{window}"),
                       cache_max_gb=cap / 1e9, shard_prefetch=0)
    before = status(svc)["shard_cache"]["data"]  # the start's scan downloaded every shard once already
    with RemoteLoader(svc.endpoint, **KW, shuffle_window=window, epoch_lookahead=False) as ld:
        got = collect(ld)
    after = status(svc)["shard_cache"]["data"]
    svc.stop()
    assert after["cached_bytes"] <= cap and after["failures"] == 0 and after["prefetches"] == 0
    return indices_of(got), after["misses"] - before["misses"]


@pytest.mark.slow
def test_a_shuffle_window_reads_each_shard_once_per_epoch_under_a_cap_of_a_third_of_the_dataset(
        make_service, tmp_path, many_shards):
    """The windowed order (W = 2 shards) with a cap of W + 2 shards out of 12: exactly once, and each
    shard downloaded at most once in the epoch. Why at most once, exactly: the one decode process
    reads in plan order; a window's W shards and the 2 it may still hold open (pinned) fit the cap,
    so a shard, once fetched in its window, stays until its window ends, and no later window needs
    it again. The uniform shuffle (W = 0), same cap and seed, downloads many times more."""
    n = WIN_SHARDS * PER_SHARD
    with RangeHTTPServer(many_shards["root"]) as http:
        order, windowed = _epoch_downloads(make_service, tmp_path, many_shards, http.url + "/data/", WIN)
        assert sorted(order) == list(range(n))  # exactly once
        shard_runs = [i // PER_SHARD for i in order]
        for k in range(0, n, WIN * PER_SHARD):  # each window: all the samples of exactly W shards
            assert len(set(shard_runs[k:k + WIN * PER_SHARD])) == WIN
        uniform_order, uniform = _epoch_downloads(make_service, tmp_path, many_shards, http.url + "/data/", 0)
        assert sorted(uniform_order) == list(range(n)) and uniform_order != order
    assert windowed <= WIN_SHARDS, windowed
    assert uniform > 3 * WIN_SHARDS, uniform  # the issue: a uniform order under a small cap

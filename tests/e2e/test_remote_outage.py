"""An object store that goes away for a while is ridden out (issue 39): transient failures (no
answer, dropped connections, timeouts, 5xx, 429) are retried with backoff up to
``--remote-retry-s``; a read fails only after it, saying how long it was retried."""

from __future__ import annotations

import os
import threading
import time
import urllib.request

import pytest

from client import RemoteLoader
from loader_service.sources import open_path
from loader_service.sources.remote.store import RemoteError, RemoteSettings
from testkit.helpers import collect, indices_of, status, wait_for
from testkit.stores import RangeHTTPServer, shard_set

SHARDS, PER_SHARD, PAD = 5, 8, 3000
N = SHARDS * PER_SHARD
OUTAGE_S = 5.0
# prefetch=1: after 2 batches at most one more is in flight, so most of the epoch is read during or after the outage
KW = dict(batch_size=4, image_size=16, seed=5, prefetch=1, epoch_lookahead=False, timeout=120)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return shard_set(str(tmp_path_factory.mktemp("outage")), SHARDS, PER_SHARD, PAD)


def _kept(batch) -> dict:
    """What :func:`collect` keeps of a batch."""
    return {"indices": list(batch.indices), "images": batch.raw.numpy().tobytes(), "labels": batch.labels.tolist()}


def test_a_five_second_outage_mid_epoch_ends_with_the_epoch_exactly_once(make_service, tmp_path, shards):
    local = make_service(data=(shards["data"],), demo=False, workers=1)
    with RemoteLoader(local.endpoint, **KW) as ld:
        want = collect(ld)
    local.stop()
    with RangeHTTPServer(shards["root"]) as http:
        # a cap of 2 shards (1 decode process x 2) of 5: the rest of the epoch needs downloads
        svc = make_service(data=(http.url + "/data/",), demo=False, workers=1, cache_dir=str(tmp_path / "cache"),
                           cache_max_gb=(2 * shards["size"] + 100) / 1e9, shard_prefetch=0, remote_retry_s=60,
                           task_deadline_s=120)
        retries = lambda: status(svc)["shard_cache"]["data"]["retries"]  # noqa: E731
        assert retries() == 0
        with RemoteLoader(svc.endpoint, **KW) as ld:
            it = iter(ld)
            got = [_kept(next(it)), _kept(next(it))]
            rest, failed = [], []

            def drain():
                try:
                    rest.extend(map(_kept, it))
                except BaseException as exc:  # reported by the test below
                    failed.append(exc)

            t0 = time.monotonic()
            http.go_down()
            reader = threading.Thread(target=drain, name="drain", daemon=True)
            reader.start()
            wait_for(lambda: retries() > 0, timeout=30, what="a read to retry during the outage")
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t0)))  # the outage lasts OUTAGE_S
            http.come_back()
            reader.join(120)
            assert not reader.is_alive() and not failed, failed
        got += rest
        assert sorted(indices_of(got)) == list(range(N))
        assert indices_of(got) == indices_of(want) and [b["images"] for b in got] == [b["images"] for b in want]
        cache = status(svc)["shard_cache"]["data"]
        assert cache["retries"] > 0 and cache["failures"] == 0
        metrics = urllib.request.urlopen(svc.http_url + "/metrics", timeout=10).read().decode()
        assert f'loader_remote_retries_total{{dataset="data"}} {float(cache["retries"])}' in metrics


def test_a_store_down_past_the_retry_deadline_fails_the_read_saying_how_long_it_retried(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        settings = RemoteSettings(cache_dir=str(tmp_path / "cache"), cache_max_bytes=10 * shards["size"], retry_s=1.0)
        src = open_path(http.url + "/data/", remote=settings)
        for name in os.listdir(tmp_path / "cache" / "shards"):  # a cold cache: the read must download
            os.unlink(tmp_path / "cache" / "shards" / name)
        http.go_down()
        with pytest.raises(RemoteError, match=rf"^{http.url}/data/shard-000000.tar: download .*failed: .* \(still "
                                              r"failing after [1-9]\d* retries over \d+\.\ds: --remote-retry-s 1\)$"):
            src.read(0)
        http.come_back()
        assert src.read(0) == shards["want"][src.keys[0]][0]
        src.close()


def test_throttling_is_retried_until_it_stops(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        http.faults.throttle = 12  # more 503 SlowDown answers in a row than the old fixed 3 retries
        src = open_path(http.url + "/data/", remote=RemoteSettings(cache_dir=str(tmp_path / "cache"),
                                                                   cache_max_bytes=10 * shards["size"]))
        assert http.faults.throttle == 0 and {src.keys[i]: src.read(i) for i in range(N)} == \
            {k: v[0] for k, v in shards["want"].items()}
        src.close()

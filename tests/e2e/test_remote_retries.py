"""Every remote format counts its retries in /metrics (issue 39): a packed dataset (Range HTTP
server) and loose images (moto behind a GET counter that can throttle) answered 503 SlowDown five
times mid-epoch ride it out, serve the epoch exactly once, and show the five retries as
``loader_remote_retries_total`` and in /v1/status."""

from __future__ import annotations

import urllib.request

import pytest

from client import RemoteLoader
from loader_service.sources.packed import write_packed
from testkit.helpers import collect, indices_of, status
from testkit.stores import TEST_KEY, MotoServer, RangeHTTPServer, tiny_jpeg, write_image_folder

THROTTLED = 5
KW = dict(batch_size=4, image_size=16, seed=5)


def _epoch_with_retries(svc, name: str, n: int, throttle) -> None:
    assert status(svc)["shard_cache"][name]["retries"] == 0
    throttle(THROTTLED)
    with RemoteLoader(svc.endpoint, **KW) as ld:
        got = collect(ld)
    assert sorted(indices_of(got)) == list(range(n))
    assert status(svc)["shard_cache"][name]["retries"] == THROTTLED
    metrics = urllib.request.urlopen(svc.http_url + "/metrics", timeout=10).read().decode()
    assert f'loader_remote_retries_total{{dataset="{name}"}} {float(THROTTLED)}' in metrics


def test_a_packed_dataset_counts_its_retries(make_service, tmp_path):
    samples = [(f"c/{i:03d}.jpg", tiny_jpeg(i), 0) for i in range(12)]
    write_packed(str(tmp_path / "srv" / "pk"), samples, ["c"])
    with RangeHTTPServer(str(tmp_path / "srv")) as http:
        svc = make_service(data=(http.url + "/pk/",), demo=False, workers=2, cache_dir=str(tmp_path / "cache"))

        def throttle(k):
            http.faults.throttle = k

        _epoch_with_retries(svc, "pk", len(samples), throttle)
        svc.stop()


@pytest.mark.parametrize("cap_gb", [None, 1e-9], ids=["cached", "read-straight"])
def test_loose_images_count_their_retries(make_service, tmp_path, monkeypatch, cap_gb):
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    write_image_folder(str(tmp_path / "pets"), {f"{c}/{i:02d}.jpg": i for c in ("cat", "dog") for i in range(6)})
    with MotoServer(counting=True) as s3:
        s3.upload_folder("bkt", str(tmp_path / "pets"), "pets/", tree=True)
        extra = {} if cap_gb is None else {"cache_max_gb": cap_gb}
        svc = make_service(data=("s3://bkt/pets/",), demo=False, workers=2, cache_dir=str(tmp_path / "cache"),
                           s3_endpoint_url=s3.endpoint, **extra)
        assert svc.sources["pets"].cached is (cap_gb is None)
        _epoch_with_retries(svc, "pets", 12, s3.throttle)
        svc.stop()

"""Errors a person reads (issue 39): one line, the object's URL, the cause in words (no credentials
found / bucket not found / access denied / not found / the failure), the store's error code or
HTTP status; the store's raw detail (up to 600 characters of obstore debug text before) only in the
debug log."""

from __future__ import annotations

import logging
import os

import pytest

from loader_service.sources import open_path
from loader_service.sources.remote.store import RemoteError, RemoteSettings
from loader_service.sources.remote.webdataset import INDEX_FILE, write_index_file
from testkit.service import free_port
from testkit.stores import TEST_KEY, MotoServer, RangeHTTPServer, shard_set

CAUSES = {
    "no bucket": "s3://nobucket/train/: listing bucket not found",
    "no credentials": "s3://bkt/train/: listing no credentials found (set AWS_ACCESS_KEY_ID and "
                      "AWS_SECRET_ACCESS_KEY, a web identity token file or an instance role; for gs://, "
                      "GOOGLE_APPLICATION_CREDENTIALS)",
    "unknown key": "s3://bkt/train/: listing access denied (InvalidAccessKeyId: check the credentials and the "
                   "bucket policy)",
    "deleted object": "s3://bkt/train/shard-000001.tar: download (after 0 of {size} bytes) not found",
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return shard_set(str(tmp_path_factory.mktemp("errors")), 2, 4, 500)


@pytest.mark.parametrize("case", sorted(CAUSES))
def test_each_cause_is_one_line_naming_the_url_and_the_raw_detail_is_at_debug_only(tmp_path, shards, monkeypatch,
                                                                                    caplog, case):
    caplog.set_level(logging.DEBUG, logger="loader_service.sources.remote")
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    with MotoServer() as s3:
        s3.upload_folder("bkt", shards["data"], "train/")
        settings = RemoteSettings(cache_dir=str(tmp_path / "cache"), endpoint_url=s3.endpoint, retry_s=0)
        url = "s3://bkt/train/"
        if case == "no bucket":
            url = "s3://nobucket/train/"
        elif case == "no credentials":
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                monkeypatch.delenv(k)
            # the instance metadata service (an instance role's credentials) at a port where nothing listens
            monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{free_port()}")
        elif case == "unknown key":
            s3.require_auth()
        with pytest.raises(RemoteError) as info:
            src = open_path(url, remote=settings)
            s3.client().delete_object(Bucket="bkt", Key="train/shard-000001.tar")
            for name in os.listdir(tmp_path / "cache" / "shards"):  # a cold cache: the read must download
                os.unlink(tmp_path / "cache" / "shards" / name)
            try:
                src.read(len(src) - 1)
            finally:
                src.close()
    assert str(info.value) == CAUSES[case].format(size=shards["size"])
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith(str(info.value).split(": ")[0] + ": ") and len(m) > len(str(info.value)) for m in debug)


def test_a_status_the_store_gives_is_named_and_its_body_is_not(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        http.faults.status["shard-000000.tar"] = 418
        with pytest.raises(RemoteError) as info:
            open_path(http.url + "/data/shard-{000000..000001}.tar", remote=RemoteSettings(
                cache_dir=str(tmp_path / "cache"), retry_s=0))
    assert str(info.value) == f"{http.url}/data/shard-000000.tar: HEAD failed: HTTP 418 I'm a teapot"


def test_a_cap_too_small_for_the_decode_processes_is_refused_at_start_with_the_number_it_needs(
        make_service, tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        need = 2 * 3 * shards["size"]  # 2 open shards x 3 decode processes x the largest shard
        with pytest.raises(ValueError) as info:
            make_service(data=(http.url + "/data/",), demo=False, workers=3, cache_dir=str(tmp_path / "cache"),
                         cache_max_gb=(need - 1) / 1e9)
        said = str(info.value)
        del info  # its traceback holds the store's pooled connections
        assert said == (
            f"{http.url}/data/: the shard cache's cap of {need - 1} bytes (--cache-max-gb {(need - 1) / 1e9:g}) is "
            f"below what 3 decode processes may hold open at once: 2 x 3 x the largest shard "
            f"({http.url}/data/shard-000000.tar, {shards['size']} bytes) = {need} bytes; give --cache-max-gb "
            f"{-(-need // 10**6) / 1000:g} or more, or fewer --workers")
        assert http.faults.gets == {}, "refused before any shard was read"
        svc = make_service(data=(http.url + "/data/",), demo=False, workers=3, cache_dir=str(tmp_path / "cache"),
                           cache_max_gb=need / 1e9)  # exactly enough: starts
        svc.stop()


def test_a_cap_below_one_shard_names_the_object_url(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        with pytest.raises(RemoteError) as info:
            open_path(http.url + "/data/", remote=RemoteSettings(cache_dir=str(tmp_path / "cache"),
                                                                 cache_max_bytes=shards["size"] - 1))
        said = str(info.value)
        del info  # its traceback holds the store's pooled connections
    assert said == (f"{http.url}/data/shard-000000.tar: a shard of {shards['size']} bytes cannot fit a "
                               f"cache of {shards['size'] - 1} bytes (--cache-max-gb)")


def test_a_small_object_whose_body_claims_more_than_listed_is_refused_unread(tmp_path):
    served = shard_set(str(tmp_path / "store"), 2, 4, 500)
    write_index_file(served["data"])
    size = os.path.getsize(os.path.join(served["data"], INDEX_FILE))
    with RangeHTTPServer(served["root"]) as http:
        http.faults.oversize[INDEX_FILE] = 256 << 20  # the HEAD says its size, the GET claims 256 MiB more
        with pytest.raises(RemoteError) as info:
            open_path(http.url + "/data/", remote=RemoteSettings(cache_dir=str(tmp_path / "cache"), retry_s=0))
        said = str(info.value)
        del info  # its traceback holds the response
        assert said.startswith(f"{http.url}/data/{INDEX_FILE}: changed since the dataset was listed (size {size} -> "
                               f"{size + (256 << 20)}, ")
        assert http.faults.sent.get(INDEX_FILE, 0) < 32 << 20, "the claimed body was never read"


def test_a_redirect_loop_is_named_as_one(tmp_path, shards):
    with RangeHTTPServer(shards["root"]) as http:
        http.faults.redirect["shard-000000.tar"] = True
        with pytest.raises(RemoteError) as info:
            open_path(http.url + "/data/shard-{000000..000001}.tar", remote=RemoteSettings(
                cache_dir=str(tmp_path / "cache"), retry_s=0))
        said = str(info.value)
        del info
    assert said == f"{http.url}/data/shard-000000.tar: HEAD failed: too many redirects"

"""A packed dataset in object storage (issue 29: ``loader-service pack`` output read from a
prefix), against moto's S3 server and a Range HTTP server on loopback: the same samples, labels
and order as the local PackedSource of the same pack, each read one ranged GET of data.bin; the
index downloaded once and reused, a new data.bin a new identity; a deleted, changed, cut short or
oversize read a per-sample error that names the object; detection picks packed."""

from __future__ import annotations

import os

import pytest

from loader_service.sources import open_path
from loader_service.sources.packed import PackedSource, write_packed
from loader_service.sources.remote.packed import RemotePackedSource
from loader_service.sources.remote.store import RemoteError, RemoteSettings
from loader_service.sources.remote.webdataset import RemoteWebDatasetSource
from testkit.stores import TEST_KEY, MotoServer, same_epoch_as_local, RangeHTTPServer, tiny_jpeg, write_shards

N = 20
CLASSES = ["a", "b", "c"]
KW = dict(batch_size=4, image_size=16, seed=5)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("rpacked")
    samples = [(f"{CLASSES[i % 3]}/{i:03d}.jpg", tiny_jpeg(i, pad=37 * i), i % 3) for i in range(N)]
    write_packed(str(root / "pk"), samples, CLASSES)
    write_shards(str(root / "shards"), 2, 3)
    return {"pk": str(root / "pk"), "shards": str(root / "shards"), "root": str(root), "samples": samples}


@pytest.fixture
def s3(tree, monkeypatch):
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    with MotoServer() as server:
        server.upload_folder("bkt", tree["pk"], "pk/")
        yield server


def _settings(tmp_path, s3=None, **kw) -> RemoteSettings:
    return RemoteSettings(cache_dir=str(tmp_path / "cache"), endpoint_url=s3.endpoint if s3 else "", **kw)


def _samples(src) -> list:
    return [(src.names[i], src.read(i), int(src.labels[i])) for i in range(len(src))]


# ---------------------------------------------------------------------------- the source on its own
def test_an_s3_prefix_is_the_local_pack_and_a_restart_reuses_its_index(tmp_path, tree, s3):
    settings = _settings(tmp_path, s3)
    src = open_path("s3://bkt/pk/", remote=settings)
    local = PackedSource(tree["pk"])
    try:
        assert isinstance(src, RemotePackedSource) and src.index_origin == "listed" and src.name == "pk"
        assert src.classes == local.classes == CLASSES and len(src) == len(local) == N
        assert _samples(src) == _samples(local) == tree["samples"]  # names, bytes, labels, in order
        assert src.describe(3) == "s3://bkt/pk/data.bin:a/003.jpg"
        assert os.path.dirname(src.index_dir) == str(tmp_path / "cache" / "packed-index")
        assert sorted(os.listdir(src.index_dir)) == ["labels.npy", "listing.json", "meta.json", "names_blob.npy",
                                                     "names_offsets.npy", "offsets.npy"]  # no data.bin on disk
        again = open_path("s3://bkt/pk", remote=settings)  # the same prefix, without its slash
        assert again.index_origin == "loaded" and again.index_dir == src.index_dir
        assert again.fingerprint() == src.fingerprint() and _samples(again) == _samples(src)
        again.close()
    finally:
        src.close()
        local.close()


def test_a_new_data_bin_is_a_new_dataset_and_the_old_one_refuses_it(tmp_path, tree, s3):
    settings = _settings(tmp_path, s3)
    first = open_path("s3://bkt/pk/", remote=settings)
    with open(os.path.join(tree["pk"], "data.bin"), "rb") as f:
        data = f.read()
    changed_bytes = bytes(b ^ 0xFF for b in data)  # the same size, other bytes: only the ETag tells
    s3.client().put_object(Bucket="bkt", Key="pk/data.bin", Body=changed_bytes)
    changed = open_path("s3://bkt/pk/", remote=settings)
    assert changed.index_origin == "listed" and changed.index_dir != first.index_dir
    assert changed.fingerprint() != first.fingerprint()
    assert changed.read(0) == changed_bytes[:int(changed.offsets[1])]
    changed.close()
    with pytest.raises(RemoteError, match=r"^s3://bkt/pk/data.bin: changed since the dataset was listed"):
        first.read(0)  # refused by If-Match on the range GET, never served
    first.close()


def test_a_deleted_data_bin_fails_the_sample_naming_it(tmp_path, tree, s3):
    src = open_path("s3://bkt/pk/", remote=_settings(tmp_path, s3))
    assert src.read(1) == tree["samples"][1][1]
    s3.client().delete_object(Bucket="bkt", Key="pk/data.bin")
    with pytest.raises(RemoteError, match=r"^s3://bkt/pk/data.bin: range GET of bytes \d+-\d+ not found"):
        src.read(2)
    src.close()


def test_a_sample_over_the_cap_is_refused_before_any_request(tmp_path, tree, s3):
    src = open_path("s3://bkt/pk/", remote=_settings(tmp_path, s3), max_sample_bytes=700)
    big = next(i for i in range(N) if src.offsets[i + 1] - src.offsets[i] > 700)
    with pytest.raises(RemoteError, match=rf"^s3://bkt/pk/data.bin: sample {big} \(\S+\) is \d+ bytes, over the "
                                          r"sample cap of 700 bytes \(max_sample_bytes\); not read"):
        src.read(big)
    assert src._store is None, "no connection was made: the sample was refused before any request"
    assert src.read(0) == tree["samples"][0][1]
    src.close()


def test_a_missing_index_file_is_named(tmp_path, tree, s3):
    s3.client().delete_object(Bucket="bkt", Key="pk/labels.npy")
    with pytest.raises(RemoteError, match=r"^s3://bkt/pk/labels.npy: not found in the listing of s3://bkt/pk/"):
        open_path("s3://bkt/pk/", remote=_settings(tmp_path, s3))


# ---------------------------------------------------------------------------- over HTTP, with faults
def test_over_http_a_short_range_response_fails_the_sample_naming_data_bin(tmp_path, tree):
    with RangeHTTPServer(tree["root"]) as http:
        src = open_path(http.url + "/pk/", remote=_settings(tmp_path, max_retries=0))
        assert isinstance(src, RemotePackedSource) and _samples(src) == tree["samples"]
        http.faults.short["data.bin"] = 5  # the body claims the span's length and stops after 5 bytes
        with pytest.raises(RemoteError, match=rf"^{http.url}/pk/data.bin: (range GET of bytes \d+-\d+ failed|"
                                              r"truncated range GET)"):
            src.read(7)
        del http.faults.short["data.bin"]
        os.truncate(os.path.join(tree["root"], "pk", "data.bin"), int(src.offsets[N - 1]) + 3)
        try:
            with pytest.raises(RemoteError, match=rf"^{http.url}/pk/data.bin: changed since the dataset was listed"):
                src.read(N - 1)  # the server answers the range with fewer bytes: refused, never served short
        finally:
            with open(os.path.join(tree["root"], "pk", "data.bin"), "wb") as f:
                f.write(b"".join(s[1] for s in tree["samples"]))
        src.close()


def test_over_http_a_range_body_longer_than_asked_is_refused_unread(tmp_path, tree):
    claim = 256 << 20  # what a lying server adds to the span's Content-Length (zeros, until hung up on)
    with RangeHTTPServer(tree["root"]) as http:
        src = open_path(http.url + "/pk/", remote=_settings(tmp_path, max_retries=0))
        http.faults.oversize["data.bin"] = claim
        start, end = int(src.offsets[7]), int(src.offsets[8])
        with pytest.raises(RemoteError) as info:
            src.read(7)
        said = str(info.value)
        del info  # its traceback holds the response
        assert said == (f"{http.url}/pk/data.bin: the store sent more than the {end - start} bytes of the "
                        f"range {start}-{end} asked for")
        assert http.faults.gets["data.bin"] == 1, "not retried: a server that lies about a length is not transient"
        assert http.faults.sent["data.bin"] < 32 << 20, "the rest of the claimed body was never read"
        del http.faults.oversize["data.bin"]
        assert src.read(7) == tree["samples"][7][1]
        src.close()


# ---------------------------------------------------------------------------- detection
def test_detection_picks_packed_beside_the_other_kinds(tmp_path, tree, s3):
    s3.upload_folder("bkt", tree["shards"], "shards/")
    settings = _settings(tmp_path, s3)
    for url, kind in (("s3://bkt/pk/", RemotePackedSource), ("s3://bkt/shards/", RemoteWebDatasetSource)):
        src = open_path(url, remote=settings)
        assert type(src) is kind, url
        src.close()


# ---------------------------------------------------------------------------- through the service
@pytest.mark.slow
def test_exactly_once_over_an_epoch_byte_for_byte_the_local_pack(make_service, tmp_path, tree, s3):
    svc = same_epoch_as_local(make_service, tree["pk"], "s3://bkt/pk/", s3, str(tmp_path / "cache"), N, "pk", **KW)
    assert isinstance(svc.sources["pk"], RemotePackedSource)
    svc.stop()

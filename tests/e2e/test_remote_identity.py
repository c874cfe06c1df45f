"""A dataset in object storage is its objects to the byte (issue 39): a member of a WebDataset
shard replaced by bytes of the same length changes only the shard's ETag, and that is a new
dataset, named by the object's URL; a loader planned on the old one is refused, never served new
bytes under old labels."""

from __future__ import annotations

import logging

import pytest

from client import LoaderError, RemoteLoader
from loader_service.sources import open_path
from loader_service.sources.remote.store import RemoteSettings
from testkit.stores import TEST_KEY, MotoServer, write_shards

SHARDS, PER_SHARD = 4, 8
# prefetch=1: after 2 batches at most one more is in flight, so the rest must come from the restarted service
KW = dict(batch_size=4, image_size=16, seed=5, prefetch=1, epoch_lookahead=False, timeout=30)


@pytest.fixture
def s3(tmp_path, monkeypatch):
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    want = write_shards(str(tmp_path / "data"), SHARDS, PER_SHARD, pad=500)
    with MotoServer() as server:
        server.upload_folder("bkt", str(tmp_path / "data"), "train/")
        server.want = want
        yield server


def _same_size_change(s3: MotoServer, key: str, member: bytes) -> None:
    """One byte of ``member``'s data inside the shard ``key`` changed: same length, new ETag."""
    client = s3.client()
    body = bytearray(client.get_object(Bucket="bkt", Key=key)["Body"].read())
    at = body.index(member) + len(member) // 2
    body[at] ^= 0xFF
    client.put_object(Bucket="bkt", Key=key, Body=bytes(body))


def test_a_same_size_change_inside_a_shard_is_a_new_dataset_named_by_its_url(tmp_path, s3, caplog):
    caplog.set_level(logging.WARNING, logger="loader_service")
    settings = RemoteSettings(cache_dir=str(tmp_path / "cache"), endpoint_url=s3.endpoint)
    src = open_path("s3://bkt/train/", remote=settings)
    before = src.fingerprint()
    src.close()
    assert not [r for r in caplog.records if "changed since" in r.getMessage()]
    _same_size_change(s3, "train/shard-000002.tar", s3.want["s2-0003"][0])
    changed = open_path("s3://bkt/train/", remote=settings)
    assert len(changed) == SHARDS * PER_SHARD and changed.fingerprint() != before
    said = [r.getMessage() for r in caplog.records if "changed since" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("s3://bkt/train/ changed since the service last listed it: "
                                                 "s3://bkt/train/shard-000002.tar changed (size ")
    assert "[dataset_changed]" in said[0]
    changed.close()
    again = open_path("s3://bkt/train/", remote=settings)  # unchanged since: the same identity, said once
    assert again.index_origin == "loaded" and again.fingerprint() == changed.fingerprint()
    assert len([r for r in caplog.records if "changed since" in r.getMessage()]) == 1
    again.close()


def test_a_loader_mid_epoch_is_refused_by_a_service_restarted_on_a_shard_changed_at_the_same_size(
        make_service, tmp_path, s3, caplog):
    caplog.set_level(logging.WARNING, logger="loader_service")
    kw = dict(data=("s3://bkt/train/",), demo=False, workers=1, cache_dir=str(tmp_path / "cache"),
              s3_endpoint_url=s3.endpoint)
    first = make_service(**kw)
    port = int(first.endpoint.rsplit(":", 1)[1])
    with RemoteLoader(first.endpoint, **KW) as ld:
        it = iter(ld)
        got = [i for _ in range(2) for i in next(it).indices]
        state = ld.state_dict()
        first.stop()
        _same_size_change(s3, "train/shard-000001.tar", s3.want["s1-0005"][0])
        make_service(data_port=port, **kw)  # the same address, the same sizes, one shard's bytes changed
        with pytest.raises(LoaderError, match=r"the dataset changed: the service at tcp://127\.0\.0\.1:\d+ serves "
                                              r"'train' with 32 samples") as info:
            for b in it:
                got.extend(b.indices)
        assert info.value.code == "dataset_changed"
    assert len(got) == len(set(got))
    said = [r.getMessage() for r in caplog.records if "changed since" in r.getMessage()]
    assert len(said) == 1 and "s3://bkt/train/shard-000001.tar changed" in said[0]
    # a resume from a state saved on the old dataset is refused too
    with RemoteLoader(f"tcp://127.0.0.1:{port}", **KW) as ld:
        ld.load_state_dict(state)
        with pytest.raises(LoaderError) as info:
            next(iter(ld))
        assert info.value.code == "dataset_changed"


@pytest.mark.parametrize("etags", ["mtime-size", "none", "md5"])
def test_an_http_server_whose_etags_do_not_follow_the_content_is_named_at_start(tmp_path, caplog, etags):
    """nginx's ETags are the modification time and size, python -m http.server sends none: a shard
    rewritten at the same size and time cannot be told from the listing, and the start says so."""
    from testkit.stores import RangeHTTPServer

    write_shards(str(tmp_path / "store" / "data"), 2, 2, pad=100)
    caplog.set_level(logging.WARNING, logger="loader_service.sources.remote")
    with RangeHTTPServer(str(tmp_path / "store")) as http:
        http.faults.etags = etags
        src = open_path(http.url + "/data/", remote=RemoteSettings(cache_dir=str(tmp_path / "cache")))
        src.close()
    said = [r.getMessage() for r in caplog.records if "ETags are not made from the content" in r.getMessage()]
    if etags == "md5":
        assert said == []
    else:
        first = f"{http.url}/data/shard-000000.tar"
        tag = "no ETag" if etags == "none" else '"%x-%x"' % (
            int((tmp_path / "store" / "data" / "shard-000000.tar").stat().st_mtime),
            (tmp_path / "store" / "data" / "shard-000000.tar").stat().st_size)
        assert said == [f"{http.url}/data/: the server's ETags are not made from the content ({first}: {tag}; nginx "
                        "and Apache make them from the modification time and size, python -m http.server sends none): "
                        "an object rewritten at the same size (and modification time) is not seen as changed, "
                        "neither as a new dataset nor in the shard cache, which serves its old copy. Serve the "
                        "dataset where ETags are content hashes (S3, GCS, MinIO), or give a changed dataset a new URL"]

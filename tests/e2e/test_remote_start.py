"""A first start on a WebDataset prefix without downloading it (issue 39): with an index file
beside the shards (``python -m loader_service.sources.remote.webdataset index FOLDER``) the start
GETs that file alone, the plan is the one the shards give, and each shard's rows are checked
against its tar headers when it is first opened; a stale index file is not used (logged), and
rows that lie are refused naming the shard. Against moto behind a GET counter."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from client import RemoteLoader
from loader_service.sources import open_path
from loader_service.sources.remote.store import RemoteError, RemoteSettings
from loader_service.sources.remote.webdataset import INDEX_FILE, write_index_file
from testkit.helpers import collect, indices_of
from testkit.stores import TEST_KEY, MotoServer, shard_set

SHARDS, PER_SHARD = 12, 5
N = SHARDS * PER_SHARD
KW = dict(batch_size=4, image_size=16, seed=5)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return shard_set(str(tmp_path_factory.mktemp("rstart")), SHARDS, PER_SHARD, 0)


@pytest.fixture
def s3(monkeypatch):
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    with MotoServer(counting=True) as server:
        yield server


def _upload(s3, shards, tmp_path, index=True, edit=None) -> None:
    folder = tmp_path / "up"
    shutil.copytree(shards["data"], folder)
    if index:
        write_index_file(str(folder))
        if edit:
            path = folder / INDEX_FILE
            doc = json.loads(path.read_text())
            edit(doc)
            path.write_text(json.dumps(doc))
    s3.upload_folder("bkt", str(folder), "train/")


def _settings(tmp_path, s3) -> RemoteSettings:
    return RemoteSettings(cache_dir=str(tmp_path / "cache"), endpoint_url=s3.endpoint)


def _by_key(src) -> dict:
    return {src.keys[i]: (src.read(i), int(src.labels[i])) for i in range(len(src))}


def test_with_an_index_file_the_start_gets_it_alone(tmp_path, shards, s3):
    _upload(s3, shards, tmp_path)
    src = open_path("s3://bkt/train/", remote=_settings(tmp_path, s3))
    assert src.index_origin == "index file" and len(src) == N
    assert s3.gets() == 1, "the start GETs the index file, no shard"
    assert _by_key(src) == shards["want"]
    assert s3.gets() == 1 + SHARDS, "each shard downloaded once, at its first read"
    src.close()


def test_without_an_index_file_every_shard_is_read_at_start(tmp_path, shards, s3):
    _upload(s3, shards, tmp_path, index=False)
    src = open_path("s3://bkt/train/", remote=_settings(tmp_path, s3))
    assert src.index_origin == "scanned" and s3.gets() == SHARDS  # kept in the cache: no more GETs to read
    assert _by_key(src) == shards["want"] and s3.gets() == SHARDS
    src.close()


def test_the_same_plan_from_the_index_file_as_from_the_shards(make_service, tmp_path, shards, s3):
    local = make_service(data=(shards["data"],), demo=False, workers=2)
    with RemoteLoader(local.endpoint, **KW) as ld:
        want = collect(ld)
    local.stop()
    _upload(s3, shards, tmp_path)
    svc = make_service(data=("s3://bkt/train/",), demo=False, workers=2, cache_dir=str(tmp_path / "cache"),
                       s3_endpoint_url=s3.endpoint)
    assert s3.gets() == 1
    with RemoteLoader(svc.endpoint, **KW) as ld:
        got = collect(ld)
    assert sorted(indices_of(got)) == list(range(N)) and indices_of(got) == indices_of(want)
    assert [b["images"] for b in got] == [b["images"] for b in want]
    assert [b["labels"] for b in got] == [b["labels"] for b in want]
    svc.stop()


def test_a_stale_index_file_is_not_used_and_says_why(tmp_path, shards, s3, caplog):
    def grow(doc):
        doc["shards"][3]["size"] += 512

    _upload(s3, shards, tmp_path, edit=grow)
    with caplog.at_level(logging.WARNING, "loader_service.sources.remote"):
        src = open_path("s3://bkt/train/", remote=_settings(tmp_path, s3))
    assert src.index_origin == "scanned" and s3.gets() == 1 + SHARDS
    assert f"s3://bkt/train/{INDEX_FILE}: not used (shard-000003.tar is listed with {shards['size']} bytes, the " \
           f"index file says {shards['size'] + 512}); every shard is read" in caplog.text
    assert _by_key(src) == shards["want"]
    src.close()


def test_rows_that_lie_about_a_shard_are_refused_naming_it(tmp_path, shards, s3):
    def swap(doc):  # two shards of the same size: each entry now describes the other's samples
        a, b = doc["shards"][0], doc["shards"][1]
        assert a["size"] == b["size"]
        a["keys"], b["keys"] = b["keys"], a["keys"]

    _upload(s3, shards, tmp_path, edit=swap)
    src = open_path("s3://bkt/train/", remote=_settings(tmp_path, s3))
    assert src.index_origin == "index file"
    with pytest.raises(RemoteError, match=rf"^s3://bkt/train/shard-000000.tar: its samples differ from what "
                                          rf"s3://bkt/train/{INDEX_FILE} says of it \(5 samples read, 5 in the index "
                                          r"file\): the index file is stale"):
        src.read(0)
    last = N - 1  # a shard the index file describes truly is served
    assert src.read(last) == shards["want"][src.keys[last]][0]
    src.close()


def test_the_index_file_writer_names_every_shard(shards, tmp_path):
    folder = tmp_path / "w"
    shutil.copytree(shards["data"], folder)
    doc = json.loads(open(write_index_file(str(folder))).read())
    assert [e["name"] for e in doc["shards"]] == sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
    assert sum(len(e["keys"]) for e in doc["shards"]) == N

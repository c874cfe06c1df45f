"""``loader-service pack --format webdataset`` writes ``wds-index.json`` beside the shards, so the
folder it writes, copied to a bucket as it is, starts without reading a shard: the start GETs the
index file and ``classes.json`` (the class names) and nothing else, and the epoch is the
ImageFolder's (same order, bytes and labels). Against moto behind its per-object GET counter."""

from __future__ import annotations

import json
import os

import pytest

from client import RemoteLoader
from loader_service.cli.main import main as cli_main
from loader_service.sources.remote.webdataset import INDEX_FILE
from loader_service.sources.webdataset import LABEL_MAP_NAME
from tests.conftest import write_imagefolder
from testkit.helpers import collect, indices_of
from testkit.stores import moto_with_test_key

CLASSES, PER_CLASS, SHARD_SIZE = 3, 6, 4
N = CLASSES * PER_CLASS
SHARDS = -(-N // SHARD_SIZE)
KW = dict(batch_size=4, image_size=16, seed=3)


@pytest.fixture
def s3(monkeypatch):
    yield from moto_with_test_key(monkeypatch, counting=True)


def test_pack_writes_the_index_file_and_a_start_on_the_bucket_reads_no_shard(make_service, tmp_path, s3, capsys):
    src = write_imagefolder(str(tmp_path / "src"), classes=CLASSES, per_class=PER_CLASS)
    out = tmp_path / "shards"
    assert cli_main(["pack", src, str(out), "--format", "webdataset", "--shard-size", str(SHARD_SIZE),
                     "--quiet"]) == 0
    assert f"+ index + {INDEX_FILE}" in capsys.readouterr().out
    doc = json.loads((out / INDEX_FILE).read_text())
    assert [e["name"] for e in doc["shards"]] == [f"shard-{k:06d}.tar" for k in range(SHARDS)]
    assert sum(len(e["keys"]) for e in doc["shards"]) == N

    local = make_service(data=(src,), demo=False, workers=2)
    with RemoteLoader(local.endpoint, **KW) as ld:
        want = collect(ld)
    local.stop()

    s3.upload_folder("bkt", str(out), "train/")  # what pack wrote, top level as it is (not .wds-index/)
    svc = make_service(data=("s3://bkt/train/",), demo=False, workers=2, cache_dir=str(tmp_path / "cache"),
                       s3_endpoint_url=s3.endpoint)
    assert s3.gets_by_object() == {f"bkt/train/{INDEX_FILE}": 1, f"bkt/train/{LABEL_MAP_NAME}": 1}, \
        "the start GETs the index file and the class names, no shard"
    with RemoteLoader(svc.endpoint, **KW) as ld:
        got = collect(ld)
    assert sorted(indices_of(got)) == list(range(N)) and indices_of(got) == indices_of(want)
    assert [b["labels"] for b in got] == [b["labels"] for b in want]
    assert [b["images"] for b in got] == [b["images"] for b in want]
    shards = {k: n for k, n in s3.gets_by_object().items() if k.endswith(".tar")}
    assert shards == {f"bkt/train/shard-{k:06d}.tar": 1 for k in range(SHARDS)}, "each shard once, when first read"
    svc.stop()
    assert sorted(os.listdir(out)) == sorted([LABEL_MAP_NAME, INDEX_FILE, ".wds-index"] +
                                             [f"shard-{k:06d}.tar" for k in range(SHARDS)])

"""Loose images in object storage are cached (issue 39): grouped into cache units within
``--cache-max-gb``, each image GET once, then every later epoch served with no GET; a unit damaged
on disk or left half-written by a killed process is never used; a cap below the dataset reads
straight from the store. Against moto's S3 server on loopback, behind a counter of the GETs it
serves (:class:`testkit.stores.MotoServer` with ``counting``)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from client import RemoteLoader
from loader_service.sources import open_path
from loader_service.sources.imagefolder import ImageFolderSource
from loader_service.sources.remote import imagefolder
from loader_service.sources.remote.cache import PART
from loader_service.sources.remote.store import RemoteSettings
from testkit.helpers import collect, indices_of, status
from testkit.stores import TEST_KEY, MotoServer, write_image_folder

FILES = {f"{c}/{i:02d}.jpg": k * 100 + i for k, c in enumerate(("cat", "dog", "emu")) for i in range(10)}
N = len(FILES)
PER_UNIT = 4  # 30 images: 8 units
KW = dict(batch_size=4, image_size=16, seed=5)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("rfcache")
    files = write_image_folder(str(root / "pets"), FILES)
    return {"pets": str(root / "pets"), "files": files}


@pytest.fixture
def s3(tree, monkeypatch):
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(imagefolder, "UNIT_OBJECTS", PER_UNIT)  # read when the index is made
    with MotoServer(counting=True) as server:
        server.upload_folder("bkt", tree["pets"], "pets/", tree=True)
        yield server


def _settings(tmp_path, s3, **kw) -> RemoteSettings:
    return RemoteSettings(cache_dir=str(tmp_path / "cache"), endpoint_url=s3.endpoint, **kw)


def _by_name(src) -> dict:
    return {src.paths[i]: src.read(i) for i in range(len(src))}


def _units(tmp_path) -> list:
    folder = tmp_path / "cache" / "shards"
    return sorted(n for n in os.listdir(folder) if "-u0" in n and not n.endswith((".etag", PART)))


def test_a_second_epoch_on_a_cache_that_holds_the_dataset_makes_no_get(make_service, tmp_path, tree, s3):
    local = make_service(data=(tree["pets"],), demo=False, workers=2)
    with RemoteLoader(local.endpoint, **KW) as ld:
        want = collect(ld)
    local.stop()
    svc = make_service(data=("s3://bkt/pets/",), demo=False, workers=2, cache_dir=str(tmp_path / "cache"),
                       s3_endpoint_url=s3.endpoint)
    assert s3.gets() == 0, "the start lists the prefix and GETs no image"
    with RemoteLoader(svc.endpoint, **KW) as ld:
        first = collect(ld)
        assert s3.gets() == N, "epoch 0: each image GET once (by the units' downloads)"
        ld.set_epoch(1)
        second = collect(ld)
    assert s3.gets() == N, "epoch 1: served from the cache, no GET"
    for got in (first, second):
        assert sorted(indices_of(got)) == list(range(N))
    assert indices_of(first) == indices_of(want) and [b["images"] for b in first] == [b["images"] for b in want]
    assert [b["labels"] for b in first] == [b["labels"] for b in want]
    cache = status(svc)["shard_cache"]["pets"]
    units = -(-N // PER_UNIT)
    assert cache["misses"] + cache["prefetches"] == units and cache["failures"] == 0 and cache["evictions"] == 0
    assert len(_units(tmp_path)) == units
    svc.stop()


def test_a_unit_damaged_at_the_same_size_is_fetched_again_after_a_restart(tmp_path, tree, s3, caplog):
    settings = _settings(tmp_path, s3)
    src = open_path("s3://bkt/pets/", remote=settings)
    assert src.cached and _by_name(src) == tree["files"] and s3.gets() == N
    src.close()
    units = _units(tmp_path)
    path = tmp_path / "cache" / "shards" / units[1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped, the size unchanged
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "loader_service.sources.remote"):
        again = open_path("s3://bkt/pets/", remote=settings)
    assert again.index_origin == "loaded" and not path.exists(), "the damaged unit was deleted at start"
    assert "s3://bkt/pets/cat/04.jpg .. cat/07.jpg (cache unit 1)" in caplog.text
    assert "does not match its checksum" in caplog.text
    assert _by_name(again) == tree["files"]
    assert s3.gets() == N + PER_UNIT, "that unit alone was downloaded again"
    again.close()


def test_a_unit_half_written_by_a_killed_process_is_never_used(tmp_path, tree, s3):
    """A decode process SIGKILLed mid-download leaves a ``.part`` (here: garbage over part of
    the unit); the next reader deletes it, downloads the unit again and serves the right bytes."""
    script = textwrap.dedent(f"""
        import os, signal
        from loader_service.sources import open_path
        from loader_service.sources.remote import imagefolder
        from loader_service.sources.remote.store import RemoteSettings

        def torn(self, store, info, fd):
            os.pwrite(fd, b"torn" * 64, 0)
            os.kill(os.getpid(), signal.SIGKILL)

        src = open_path("s3://bkt/pets/", remote=RemoteSettings(cache_dir={str(tmp_path / 'cache')!r},
                                                               endpoint_url={s3.endpoint!r}))
        imagefolder.RemoteImageFolderSource._fetch_unit = torn
        src.read(0)
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    folder = tmp_path / "cache" / "shards"
    parts = [n for n in os.listdir(folder) if n.endswith(PART)]
    assert len(parts) == 1 and (folder / parts[0]).read_bytes()[:8] == b"torntorn" and not _units(tmp_path)
    src = open_path("s3://bkt/pets/", remote=_settings(tmp_path, s3))
    assert src.index_origin == "loaded"
    assert src.read(0) == tree["files"][src.paths[0]]
    assert not [n for n in os.listdir(folder) if n.endswith(PART)], "the killed download's .part is gone"
    assert _by_name(src) == tree["files"]
    assert s3.gets() == N
    src.close()


def test_a_cap_below_the_dataset_reads_straight_from_the_store_and_says_so(tmp_path, tree, s3, caplog):
    total = sum(len(v) for v in tree["files"].values())
    with caplog.at_level(logging.WARNING, "loader_service.sources.remote"):
        src = open_path("s3://bkt/pets/", remote=_settings(tmp_path, s3, cache_max_bytes=total - 1))
    assert not src.cached
    assert (f"s3://bkt/pets/: {N} images, {total} bytes, more than the cache's cap of {total - 1} bytes: read "
            "straight from the store every epoch") in caplog.text
    for epoch in (1, 2):
        assert _by_name(src) == tree["files"] and s3.gets() == epoch * N
    assert not os.path.exists(tmp_path / "cache" / "shards") or not _units(tmp_path)
    src.close()


def test_the_units_are_the_local_folders_samples_in_order(tmp_path, tree, s3):
    src = open_path("s3://bkt/pets/", remote=_settings(tmp_path, s3))
    local = ImageFolderSource.scan(tree["pets"])
    try:
        assert [(src.paths[i], src.read(i), int(src.labels[i])) for i in range(N)] == \
            [(local.paths[i], local.read(i), int(local.labels[i])) for i in range(N)]
    finally:
        src.close()
        local.close()

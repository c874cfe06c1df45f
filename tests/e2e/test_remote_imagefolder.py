"""An ImageFolder in object storage (issue 29: folder-style prefixes of loose images), against moto's
S3 server on loopback: the same samples, labels and order as the local ImageFolder of the same
files; the listing saved and reused, a changed object a new identity; a deleted, changed or
oversize object a per-sample error that names it; detection of each kind, and a prefix with
neither a clear error."""

from __future__ import annotations

import os

import pytest

from client import RemoteLoader
from loader_service.sources import open_path
from loader_service.sources.imagefolder import ImageFolderSource
from loader_service.sources.remote.imagefolder import RemoteImageFolderSource
from loader_service.sources.remote.store import RemoteError, RemoteSettings
from loader_service.sources.remote.webdataset import RemoteWebDatasetSource
from testkit.helpers import collect, indices_of, status
from testkit.stores import TEST_KEY, MotoServer, same_epoch_as_local, RangeHTTPServer, tiny_jpeg, write_image_folder, write_shards

# nested folders, upper-case extensions, files beside images that are no samples, a hidden
# folder and a top-level file (neither a class), a class with no image (still a class, as locally)
FILES = {f"{c}/{i:02d}.jpg": k * 100 + i for k, c in enumerate(("cat", "dog", "emu")) for i in range(8)}
FILES.update({"dog/puppies/a.JPG": 900, "dog/puppies/deeper/b.jpeg": 901, "dog/zz.jpg": 902, "cat/notes.txt": 0,
              ".hidden/x.jpg": 903, "README.txt": 0, "fox/labels.txt": 0})
N = 27
KW = dict(batch_size=4, image_size=16, seed=5)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("rfolder")
    files = write_image_folder(str(root / "pets"), FILES)
    write_shards(str(root / "shards"), 2, 3)
    return {"pets": str(root / "pets"), "shards": str(root / "shards"), "files": files, "root": str(root)}


@pytest.fixture
def s3(tree, monkeypatch):
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    with MotoServer() as server:
        server.upload_folder("bkt", tree["pets"], "pets/", tree=True)
        yield server


def _settings(tmp_path, s3, **kw) -> RemoteSettings:
    return RemoteSettings(cache_dir=str(tmp_path / "cache"), endpoint_url=s3.endpoint, **kw)


def _samples(src) -> list:
    return [(src.paths[i], src.read(i), int(src.labels[i])) for i in range(len(src))]


# ---------------------------------------------------------------------------- the source on its own
def test_an_s3_prefix_is_the_local_imagefolder_of_the_same_files(tmp_path, tree, s3):
    src = open_path("s3://bkt/pets/", remote=_settings(tmp_path, s3))
    local = ImageFolderSource.scan(tree["pets"])
    try:
        assert isinstance(src, RemoteImageFolderSource) and src.index_origin == "listed" and src.name == "pets"
        assert src.classes == local._last_listing.classes == ["cat", "dog", "emu", "fox"]
        assert len(src) == len(local) == N
        assert _samples(src) == _samples(local)  # names, bytes and labels, in the same order
        assert src.describe(0) == "s3://bkt/pets/cat/00.jpg"
        assert os.path.dirname(src.index_dir) == str(tmp_path / "cache" / "folder-index")
    finally:
        src.close()
        local.close()


def test_a_restart_reuses_the_saved_listing_and_a_changed_object_is_a_new_dataset(tmp_path, tree, s3):
    settings = _settings(tmp_path, s3)
    first = open_path("s3://bkt/pets/", remote=settings)
    again = open_path("s3://bkt/pets", remote=settings)  # the same prefix, without its slash
    assert again.index_origin == "loaded" and again.index_dir == first.index_dir
    assert again.fingerprint() == first.fingerprint() and _samples(again) == _samples(first)
    again.close()
    straight = open_path("s3://bkt/pets/", remote=_settings(tmp_path, s3, cache_max_bytes=1000))
    assert first.cached and not straight.cached  # a cap below the dataset: read straight from the store
    # the same size, other bytes: only the ETag tells, and it makes a new identity
    old = tree["files"]["emu/03.jpg"]
    new = tiny_jpeg(7777)[:len(old)].ljust(len(old), b"\0")
    assert new != old and len(new) == len(old)
    s3.client().put_object(Bucket="bkt", Key="pets/emu/03.jpg", Body=new)
    changed = open_path("s3://bkt/pets/", remote=settings)
    assert changed.index_origin == "listed" and changed.fingerprint() != first.fingerprint()
    i = next(i for i in range(len(changed)) if changed.paths[i] == "emu/03.jpg")
    assert changed.read(i) == new
    changed.close()
    # the service still serving the first listing never serves the new bytes: its cache holds the
    # version it listed (checked at download); read straight, the changed object is refused
    assert first.read(i) == old
    with pytest.raises(RemoteError, match=r"s3://bkt/pets/emu/03.jpg: changed since the dataset was listed "
                                          r"\(size .*ETag .*restart the service"):
        straight.read(i)
    first.close()
    straight.close()


def test_an_object_deleted_mid_epoch_fails_its_sample_naming_it(tmp_path, tree, s3):
    src = open_path("s3://bkt/pets/", remote=_settings(tmp_path, s3))
    i = next(i for i in range(len(src)) if src.paths[i] == "dog/puppies/a.JPG")
    s3.client().delete_object(Bucket="bkt", Key="pets/dog/puppies/a.JPG")
    with pytest.raises(RemoteError, match=r"^s3://bkt/pets/dog/puppies/a.JPG: GET \(after 0 of \d+ bytes\) not found"):
        src.read(i)
    assert src.read(i + 1) == tree["files"][src.paths[i + 1]]  # the others are still served
    src.close()


def test_an_object_listed_over_the_sample_cap_is_refused_unread(tmp_path, tree, s3):
    s3.client().put_object(Bucket="bkt", Key="big/cls/huge.jpg", Body=tiny_jpeg(1, pad=60_000))
    s3.client().put_object(Bucket="bkt", Key="big/cls/small.jpg", Body=tree["files"]["cat/00.jpg"])
    src = open_path("s3://bkt/big/", remote=_settings(tmp_path, s3), max_sample_bytes=20_000)
    assert [src.paths[i] for i in range(len(src))] == ["cls/huge.jpg", "cls/small.jpg"]
    with pytest.raises(RemoteError, match=r"s3://bkt/big/cls/huge.jpg: 6\d{4} bytes as listed, over the sample cap "
                                          r"of 20000 bytes \(max_sample_bytes\); not read"):
        src.read(0)
    assert src._store is None, "no connection was made: the object was refused before any request"
    assert src.read(1) == tree["files"]["cat/00.jpg"]
    src.close()


# ---------------------------------------------------------------------------- detection
def test_detection_picks_shards_or_folders_and_names_a_prefix_with_neither(tmp_path, tree, s3):
    s3.upload_folder("bkt", tree["shards"], "shards/")
    s3.upload_folder("bkt", tree["pets"] + "/cat", "flat/")  # images, but in no class folder
    s3.upload_folder("bkt", tree["pets"], "docs/", tree=False)  # README.txt alone
    s3.client().put_object(Bucket="bkt", Key="texts/cls/a.txt", Body=b"no image")
    settings = _settings(tmp_path, s3)
    for url, kind in (("s3://bkt/shards/", RemoteWebDatasetSource), ("s3://bkt/pets/", RemoteImageFolderSource),
                      ("s3://bkt/shards/shard-{000000..000001}.tar", RemoteWebDatasetSource)):
        src = open_path(url, remote=settings)
        assert type(src) is kind, url
        src.close()
    for url in ("s3://bkt/flat/", "s3://bkt/docs/", "s3://bkt/nothing/"):
        with pytest.raises(RemoteError, match=rf"^{url}: no \.tar shards there, nor class folders of images "
                                              r"\(<prefix>/<class>/<image>\)"):
            open_path(url, remote=settings)
    with pytest.raises(ValueError, match=r"^no images found in s3://bkt/texts/: expected ImageFolder layout"):
        open_path("s3://bkt/texts/", remote=settings)


def test_an_http_folder_of_class_folders_is_refused_with_the_reason(tmp_path, tree):
    """An HTML listing carries no sizes nor ETags: the folder layout is read from S3 or GCS only
    (over HTTP the listing would cost one HEAD per image at every start)."""
    with RangeHTTPServer(tree["root"]) as http:
        with pytest.raises(RemoteError, match=rf"^{http.url}/pets/: a folder of loose images is read from s3:// "
                                              r"or gs://"):
            open_path(http.url + "/pets/", remote=RemoteSettings(cache_dir=str(tmp_path / "cache")))
        src = open_path(http.url + "/shards/", remote=RemoteSettings(cache_dir=str(tmp_path / "cache")))
        assert type(src) is RemoteWebDatasetSource and len(src) == 6
        src.close()


# ---------------------------------------------------------------------------- through the service
@pytest.mark.slow
def test_exactly_once_over_an_epoch_byte_for_byte_the_local_folders(make_service, tmp_path, tree, s3):
    svc = same_epoch_as_local(make_service, tree["pets"], "s3://bkt/pets/", s3, str(tmp_path / "cache"), N, "pets",
                              cache_units=1, **KW)  # 27 small images: one unit
    svc.stop()


@pytest.mark.slow
def test_under_skip_a_deleted_and_an_oversize_object_are_skipped_and_named(make_service, tmp_path, tree, s3):
    """--on-error skip: an object deleted after the listing and one listed over --max-sample-bytes
    are each left out of their batch with the object and the cause; every other sample comes once."""
    s3.client().put_object(Bucket="bkt", Key="pets/emu/zz-huge.jpg", Body=tiny_jpeg(2, pad=60_000))
    svc = make_service(data=("s3://bkt/pets/",), demo=False, workers=2, cache_dir=str(tmp_path / "cache"),
                       s3_endpoint_url=s3.endpoint, on_error="skip", max_sample_bytes=20_000)
    src = svc.sources["pets"]
    where = {src.paths[i]: i for i in range(len(src))}
    assert len(src) == N + 1
    s3.client().delete_object(Bucket="bkt", Key="pets/dog/03.jpg")
    with RemoteLoader(svc.endpoint, **KW, epoch_lookahead=False) as ld:  # the next epoch's skips not counted yet
        got = collect(ld)
    skipped = {i: why for b in got for i, why in b["skipped"]}
    assert sorted(skipped) == sorted([where["dog/03.jpg"], where["emu/zz-huge.jpg"]])
    assert "s3://bkt/pets/dog/03.jpg: GET (after 0 of" in skipped[where["dog/03.jpg"]]
    assert "not found" in skipped[where["dog/03.jpg"]]
    assert "s3://bkt/pets/emu/zz-huge.jpg: 6" in skipped[where["emu/zz-huge.jpg"]]
    assert "over the sample cap of 20000 bytes" in skipped[where["emu/zz-huge.jpg"]]
    assert sorted(indices_of(got) + list(skipped)) == list(range(N + 1))
    assert status(svc)["totals"]["skipped"] == 2
    svc.stop()

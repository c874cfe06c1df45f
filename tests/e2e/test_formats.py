"""Every dataset format keeps the service's invariants, and each format's own edge cases.

The same 28-image ImageFolder is packed as packed, webdataset (3 shards, opened by a brace
pattern) and HDF5 (encoded), plus an HDF5 file of raw arrays; a service on each must deliver
every sample exactly once per epoch, deterministically, resumably, and (same bytes in, same
augment seed) the very same images whichever format it reads.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile

import numpy as np
import pytest

from client import RemoteLoader
from loader_service.cli.main import main as cli_main
from wire.plan import PlanSpec, epoch_permutation, make_plan
from loader_service.sources import detect_kind, open_path, open_source
from loader_service.sources import webdataset as wds
from loader_service.sources.hdf5 import HDF5Source
from loader_service.sources.imagefolder import ImageFolderSource
from loader_service.sources.packed import PackedSource
from loader_service.sources.webdataset import ShardError, WebDatasetSource
from loader_service.decode.transforms import decode

from tests.conftest import write_imagefolder
from testkit.helpers import collect, indices_of, run_ranks

h5py = pytest.importorskip("h5py")

CLASSES, PER_CLASS = 4, 7
N = CLASSES * PER_CLASS  # 28: world 3 pads 2 without drop_last, drops 1 with it
KW = dict(batch_size=4, image_size=32, seed=3)
FORMATS = ["imagefolder", "packed", "webdataset", "hdf5"]


def _pack(src: str, dst: str, *opts: str) -> None:
    assert cli_main(["pack", src, dst, "--quiet", *opts]) == 0


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Paths of the same samples in every format (+ ``hdf5-raw``, and the labels)."""
    root = tmp_path_factory.mktemp("formats")
    folder = write_imagefolder(str(root / "folder"), classes=CLASSES, per_class=PER_CLASS)
    _pack(folder, str(root / "packed"), "--format", "packed")
    _pack(folder, str(root / "wds"), "--format", "webdataset", "--shard-size", "10")
    _pack(folder, str(root / "data.h5"), "--format", "hdf5", "--chunk", "8")
    raw, labels = _raw_images(N)
    with h5py.File(root / "raw.h5", "w") as f:
        f.create_dataset("images", data=raw, chunks=(4,) + raw.shape[1:], compression="gzip")
        f.create_dataset("labels", data=labels)
    paths = {"imagefolder": folder, "packed": str(root / "packed"),
             "webdataset": str(root / "wds" / "shard-{000000..000002}.tar"),
             "hdf5": str(root / "data.h5"), "hdf5-raw": str(root / "raw.h5")}
    return {"paths": paths, "labels": np.repeat(np.arange(CLASSES), PER_CLASS), "raw": raw, "raw_labels": labels}


def _raw_images(n: int, h: int = 40, w: int = 52):
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:h, 0:w]
    imgs = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        base = (np.stack([xx * (i + 1), yy * 3 + i, xx + yy], -1) % 256).astype(np.uint8)
        imgs[i] = base ^ rng.integers(0, 8, size=(h, w, 3), dtype=np.uint8)
    return imgs, (np.arange(n) % 3).astype(np.int64)


def _per_sample(batches) -> dict:
    """index -> (image bytes, label) from collected batches."""
    out = {}
    for b in batches:
        imgs = np.frombuffer(b["images"], np.uint8).reshape(b["shape"])
        for k, idx in enumerate(b["indices"]):
            out[idx] = (imgs[k].tobytes(), b["labels"][k])
    return out


# ---------------------------------------------------------------------------- the invariants
@pytest.mark.parametrize("fmt", FORMATS + ["hdf5-raw"])
def test_exactly_once_deterministic_and_resumable(make_service, datasets, fmt):
    svc = make_service(data=(datasets["paths"][fmt],), demo=False, workers=2)
    (source,) = svc.sources.values()
    assert len(source) == N
    want_labels = datasets["raw_labels"] if fmt == "hdf5-raw" else datasets["labels"]
    assert np.array_equal(source.labels, want_labels)

    # exactly once per epoch, for 1 and 3 ranks, with and without drop_last (plan.py's rules)
    for world in (1, 3):
        for drop_last in (False, True):
            results = run_ranks(svc.endpoint, world, drop_last=drop_last, **KW)
            delivered = [i for r in results for i in indices_of(r)]
            assert len({len(r) for r in results}) == 1, "every rank gets the same number of batches"
            if drop_last:
                assert len(delivered) == len(set(delivered)) == (N // world) // 4 * 4 * world
                assert all(len(b["indices"]) == 4 for r in results for b in r)
            else:
                total = -(-N // world) * world
                pad = np.resize(epoch_permutation(N, KW["seed"], 0, True), total)[N:].tolist()
                assert sorted(delivered) == sorted(list(range(N)) + pad)
                assert sum(b["padding"] for r in results for b in r) == total - N
                if world == 1:
                    assert sorted(delivered) == list(range(N))
            for rank, r in enumerate(results):
                plan = make_plan(PlanSpec(N, 4, KW["seed"], 0, rank, world, True, drop_last))
                assert indices_of(r) == plan.indices[: plan.num_samples].tolist()
                for b in r:
                    assert b["labels"] == want_labels[b["indices"]].tolist()

    # determinism: same (seed, epoch) -> the same bytes; another epoch -> another order
    with RemoteLoader(svc.endpoint, **KW) as a, RemoteLoader(svc.endpoint, **KW) as b:
        first, second = collect(a), collect(b)
        b.set_epoch(1)
        other = collect(b)
    assert [x["images"] for x in first] == [x["images"] for x in second]
    assert indices_of(first) != indices_of(other) and sorted(indices_of(other)) == list(range(N))

    # resume: a state_dict taken mid-epoch gives exactly the remainder on a fresh loader
    with RemoteLoader(svc.endpoint, **KW) as ld:
        ld.set_epoch(2)
        full = collect(ld)
    with RemoteLoader(svc.endpoint, **KW) as ld:
        ld.set_epoch(2)
        head = collect(ld, limit=3)
        state = ld.state_dict()
    assert (state["epoch"], state["position"]) == (2, 3 * KW["batch_size"])
    with RemoteLoader(svc.endpoint, **KW) as fresh:
        fresh.load_state_dict(state)
        fresh.set_epoch(2)
        rest = collect(fresh)
    assert indices_of(head + rest) == indices_of(full)
    assert [b["images"] for b in head + rest] == [b["images"] for b in full]


def test_same_sample_gives_the_same_image_in_every_format(make_service, datasets):
    seen = {}
    for fmt in FORMATS:
        svc = make_service(data=(datasets["paths"][fmt],), demo=False, workers=2)
        with RemoteLoader(svc.endpoint, **KW) as ld:
            seen[fmt] = _per_sample(collect(ld))
        svc.stop()
    assert sorted(seen["imagefolder"]) == list(range(N))
    for fmt in FORMATS[1:]:
        assert seen[fmt] == seen["imagefolder"], f"{fmt} differs from the ImageFolder"


def test_raw_hdf5_arrays_arrive_pixel_exact(datasets):
    src = open_path(datasets["paths"]["hdf5-raw"])
    try:
        assert isinstance(src, HDF5Source) and src.raw
        for i in (0, 5, N - 1):
            assert np.array_equal(decode(src.read(i)), datasets["raw"][i])
    finally:
        src.close()


def test_raw_hdf5_arrays_are_read_as_arrays_never_encoded(datasets, tmp_path, monkeypatch):
    import cv2

    from loader_service.decode.transforms import TransformSpec, process_sample, sample_rng

    def no_encoding(*a, **k):
        raise AssertionError("a raw HDF5 image was encoded")

    monkeypatch.setattr(cv2, "imencode", no_encoding)
    grey = datasets["raw"][..., 1]
    with h5py.File(tmp_path / "grey1.h5", "w") as f:  # N x H x W x 1: read as H x W grey
        f.create_dataset("images", data=grey[..., None])
        f.create_dataset("labels", data=datasets["raw_labels"])
    for path, want in ((datasets["paths"]["hdf5-raw"], datasets["raw"]), (str(tmp_path / "grey1.h5"), grey)):
        src = open_source(open_path(path).spec())  # as a worker opens it
        try:
            for i in (0, 7, N - 1):
                got = src.read(i)
                assert isinstance(got, np.ndarray) and got.dtype == np.uint8 and got.shape == want[i].shape
                assert np.array_equal(got, want[i])
                out = np.zeros((16, 16, 3), np.uint8)
                process_sample(got, TransformSpec(16), sample_rng(0, 0, i), out)
        finally:
            src.close()


def test_raw_hdf5_serves_the_bytes_of_the_same_pixels_stored_as_png(make_service, datasets, tmp_path):
    """Through the workers: raw arrays and a PNG-encoded HDF5 of the same pixels give the same batches."""
    import cv2

    from loader_service.sources.hdf5 import write_hdf5

    raw = datasets["raw"]
    pngs = [(f"s{i}", cv2.imencode(".png", raw[i][:, :, ::-1])[1].tobytes(), int(lab))
            for i, lab in enumerate(datasets["raw_labels"])]
    write_hdf5(str(tmp_path / "png.h5"), iter(pngs), N, chunk=8)
    seen = {}
    for name, path in (("raw", datasets["paths"]["hdf5-raw"]), ("png", str(tmp_path / "png.h5"))):
        svc = make_service(data=(path,), demo=False, workers=2)
        for train in (True, False):
            with RemoteLoader(svc.endpoint, train=train, **KW) as ld:
                seen[name, train] = _per_sample(collect(ld))
        svc.stop()
    for train in (True, False):
        assert sorted(seen["raw", train]) == list(range(N))
        assert seen["raw", train] == seen["png", train]


# ---------------------------------------------------------------------------- detection
def test_detection_opens_every_format_with_identical_samples(datasets):
    paths = datasets["paths"]
    kinds = {fmt: detect_kind(p) for fmt, p in paths.items()}
    assert kinds == {"imagefolder": "imagefolder", "packed": "packed", "webdataset": "webdataset",
                     "hdf5": "hdf5", "hdf5-raw": "hdf5"}
    wds_dir = os.path.dirname(paths["webdataset"])
    assert detect_kind(wds_dir) == detect_kind(os.path.join(wds_dir, "shard-000001.tar")) == "webdataset"
    expected = {ImageFolderSource, PackedSource, WebDatasetSource, HDF5Source}
    sources = [open_path(paths[f]) for f in FORMATS] + [open_path(wds_dir)]
    try:
        assert {type(s) for s in sources} == expected
        ref = sources[0]
        for s in sources[1:]:
            assert len(s) == N and np.array_equal(np.asarray(s.labels), ref.labels)
            assert all(s.read(i) == ref.read(i) for i in range(N))
            assert s.describe(3)
    finally:
        for s in sources:
            s.close()
    single = open_path(os.path.join(wds_dir, "shard-000002.tar"))
    try:
        assert len(single) == N - 20 and single.read(0) == open_path(paths["packed"]).read(20)
    finally:
        single.close()


def test_detection_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_path(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images found"):
        open_path(str(tmp_path / "empty"))
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(ShardError, match="empty file"):
        open_path(str(tmp_path / "empty.tar"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="unsupported dataset file"):
        open_path(str(tmp_path / "notes.txt"))
    (tmp_path / "a.tar.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(ValueError, match="compressed"):
        open_path(str(tmp_path / "a.tar.gz"))
    (tmp_path / "gz.tar").write_bytes(b"\x1f\x8b" + b"\0" * 2000)
    with pytest.raises(ShardError, match="compressed"):
        open_path(str(tmp_path / "gz.tar"))
    (tmp_path / "empty.h5").write_bytes(b"")
    with pytest.raises(ValueError, match="empty file"):
        open_path(str(tmp_path / "empty.h5"))
    (tmp_path / "junk.h5").write_bytes(b"not hdf5 at all" * 100)
    with pytest.raises(OSError, match="cannot open .* as HDF5"):
        open_path(str(tmp_path / "junk.h5"))
    with pytest.raises(FileNotFoundError, match="2 of the 3 shards .* missing"):
        open_path(str(tmp_path / "{empty,x,y}.tar"))
    _tar(tmp_path / "nosamples.tar", [("README", b"no dot, no sample")])
    with pytest.raises(ValueError, match="no samples"):
        open_path(str(tmp_path / "nosamples.tar"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads everything")
def test_unreadable_input_is_a_clear_error(tmp_path):
    p = tmp_path / "locked.h5"
    p.write_bytes(b"x")
    p.chmod(0)
    with pytest.raises(PermissionError, match="permission denied"):
        open_path(str(p))


def test_service_refuses_a_bad_dataset_with_the_reason(make_service, tmp_path):
    _tar(tmp_path / "flat.tar", [("a.jpg", b"\xff\xd8\xff")])
    with pytest.raises(ValueError, match="has no label"):
        make_service(data=(str(tmp_path / "flat.tar"),), demo=False, workers=1)


# ---------------------------------------------------------------------------- webdataset
def _tar(path, members, fmt=tarfile.PAX_FORMAT) -> str:
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def _shards(tmp_path, datasets, n_shards=2):
    """Copies of the packed shards without their index (so they must be scanned)."""
    src = os.path.dirname(datasets["paths"]["webdataset"])
    out = tmp_path / "shards"
    out.mkdir()
    for k in range(n_shards):
        name = f"shard-{k:06d}.tar"
        with open(os.path.join(src, name), "rb") as f:
            (out / name).write_bytes(f.read())
    return out


def test_index_is_saved_and_a_restart_does_not_rescan(tmp_path, datasets, monkeypatch):
    monkeypatch.setenv("LOADER_CACHE_DIR", str(tmp_path / "cache"))
    shards = _shards(tmp_path, datasets)
    scans = []
    real_scan = wds._scan_shard
    monkeypatch.setattr(wds, "_scan_shard", lambda p: scans.append(p) or real_scan(p))

    first = WebDatasetSource.open(str(shards))
    assert first.index_origin == "scanned" and len(scans) == 2 and len(first) == 20
    assert first.index_dir.startswith(str(tmp_path / "cache"))  # not next to the data
    index_files = {f: os.stat(os.path.join(first.index_dir, f)).st_mtime_ns for f in os.listdir(first.index_dir)}
    data = [first.read(i) for i in range(len(first))]
    first.close()

    second = WebDatasetSource.open(str(shards / "shard-{000000..000001}.tar"))
    assert second.index_origin == "loaded" and len(scans) == 2  # no shard was read
    assert {f: os.stat(os.path.join(second.index_dir, f)).st_mtime_ns for f in index_files} == index_files
    assert [second.read(i) for i in range(len(second))] == data
    assert np.array_equal(second.labels, datasets["labels"][:20])
    second.close()

    os.utime(shards / "shard-000001.tar", ns=(1, 1))  # a changed shard invalidates the index
    third = WebDatasetSource.open(str(shards))
    assert third.index_origin == "scanned" and len(scans) == 4
    third.close()


def test_workers_read_by_offset_from_a_small_spec(tmp_path, datasets, monkeypatch):
    src = open_path(datasets["paths"]["webdataset"])
    spec = src.spec()
    assert len(pickle.dumps(spec)) < 1024  # the index travels as a path, never as data
    monkeypatch.setattr(wds, "iter_members", lambda *a: pytest.fail("a read parsed a tar"))
    worker_side = open_source(spec)
    try:
        assert [worker_side.read(i) for i in range(N)] == [src.read(i) for i in range(N)]
        assert np.array_equal(worker_side.labels, src.labels)
        assert len(worker_side._fds) == 3
    finally:
        worker_side.close()
        src.close()


def test_corrupt_and_truncated_tars_are_refused(tmp_path, datasets, monkeypatch):
    monkeypatch.setenv("LOADER_CACHE_DIR", str(tmp_path / "cache"))
    with open(os.path.join(os.path.dirname(datasets["paths"]["webdataset"]), "shard-000000.tar"), "rb") as f:
        good = f.read()
    members = [(m.name, m.offset) for m in tarfile.open(fileobj=io.BytesIO(good))]
    bad_header = bytearray(good)
    off = members[4][1]  # the third sample's header: checksum no longer matches
    bad_header[off : off + 10] = b"garbage!!!"
    (tmp_path / "bad.tar").write_bytes(bytes(bad_header))
    with pytest.raises(ShardError, match=f"corrupt tar header at byte {off}"):
        open_path(str(tmp_path / "bad.tar"))
    (tmp_path / "cut.tar").write_bytes(good[: len(good) // 2 + 100])
    with pytest.raises(ShardError, match="truncated"):
        open_path(str(tmp_path / "cut.tar"))
    with tarfile.open(fileobj=io.BytesIO(good)) as tf:  # cut right after the last member:
        last = tf.getmembers()[-1]  # every member whole, but no end-of-archive marker
        last_member_end = last.offset_data + -(-last.size // 512) * 512
    (tmp_path / "noend.tar").write_bytes(good[:last_member_end])
    with pytest.raises(ShardError, match="end-of-archive"):
        open_path(str(tmp_path / "noend.tar"))


def test_a_shard_truncated_after_indexing_is_an_error_on_read(tmp_path, datasets, monkeypatch):
    monkeypatch.setenv("LOADER_CACHE_DIR", str(tmp_path / "cache"))
    shards = _shards(tmp_path, datasets, n_shards=1)
    src = WebDatasetSource.open(str(shards))
    try:
        os.truncate(shards / "shard-000000.tar", int(src._offset[5]) + 10)
        with pytest.raises(OSError, match="truncated since it was indexed"):
            src.read(5)
    finally:
        src.close()
    with pytest.raises(ShardError, match="truncated"):  # the fingerprint changed: a rescan finds it
        WebDatasetSource.open(str(shards))


def test_labels_from_cls_then_folder_then_label_map(tmp_path, monkeypatch):
    monkeypatch.setenv("LOADER_CACHE_DIR", str(tmp_path / "cache"))
    jpg = b"\xff\xd8\xff fake"
    d = tmp_path / "a"
    d.mkdir()
    # folders give labels in sorted order; a .cls member wins over its folder
    _tar(d / "s.tar", [("zebra/1.jpg", jpg), ("ant/2.jpg", jpg), ("ant/3.jpg", jpg), ("ant/3.cls", b" 7\n"),
                       ("ant/4.JPEG", jpg), ("ant/4.json", b"{}")])
    src = open_path(str(d / "s.tar"))
    assert src.labels.tolist() == [1, 0, 7, 0] and src.classes == ["ant", "zebra"]
    assert src.read(3) == jpg and src.describe(0).endswith("s.tar:zebra/1")
    src.close()

    b = tmp_path / "b"
    b.mkdir()
    _tar(b / "s.tar", [("zebra/1.jpg", jpg), ("ant/2.jpg", jpg)])
    (b / "classes.json").write_text(json.dumps({"zebra": 4, "ant": 2}))
    src = open_path(str(b))
    assert src.labels.tolist() == [4, 2]
    src.close()
    (b / "classes.json").write_text(json.dumps(["zebra"]))  # the map changed: index rebuilt, and wrong
    with pytest.raises(ValueError, match="folder 'ant' is not in"):
        open_path(str(b))

    c = tmp_path / "c"
    c.mkdir()
    _tar(c / "s.tar", [("1.jpg", jpg), ("1.cls", b"3"), ("2.png", b"\x89PNG")])
    with pytest.raises(ValueError, match="sample '2' has no label"):
        open_path(str(c / "s.tar"))
    _tar(c / "t.tar", [("1.jpg", jpg), ("1.cls", b"cat")])
    with pytest.raises(ShardError, match="not an integer"):
        open_path(str(c / "t.tar"))
    _tar(c / "u.tar", [("1.cls", b"1"), ("1.txt", b"no image")])
    with pytest.raises(ShardError, match="no image member"):
        open_path(str(c / "u.tar"))


def test_gnu_and_ustar_tars_and_long_names(tmp_path, monkeypatch):
    monkeypatch.setenv("LOADER_CACHE_DIR", str(tmp_path / "cache"))
    long = "d" * 90 + "/" + "n" * 120
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        p = _tar(tmp_path / f"{fmt}.tar", [(f"{long}.jpg", b"\xff\xd8\xffA" * 300), (f"{long}.cls", b"2"),
                                          ("x/b.png", b"\x89PNGB")])
        src = open_path(p)
        assert src.labels.tolist() == [2, 0] and src.read(0) == b"\xff\xd8\xffA" * 300
        assert src.keys[0] == long
        src.close()
    assert wds.expand_braces("a-{08..10}-{x,y}.tar") == ["a-08-x.tar", "a-08-y.tar", "a-09-x.tar", "a-09-y.tar",
                                                         "a-10-x.tar", "a-10-y.tar"]
    with pytest.raises(ValueError, match="bad brace"):
        wds.expand_braces("a-{5..1}.tar")


# ---------------------------------------------------------------------------- hdf5
def test_hdf5_missing_or_inconsistent_labels_are_clear_errors(tmp_path):
    vlen = h5py.vlen_dtype(np.uint8)
    with h5py.File(tmp_path / "nolabels.h5", "w") as f:
        f.create_dataset("images", shape=(3,), dtype=vlen)
    with pytest.raises(ValueError, match="no labels dataset .* it has \\['images'\\]"):
        open_path(str(tmp_path / "nolabels.h5"))
    with h5py.File(tmp_path / "short.h5", "w") as f:
        f.create_dataset("images", data=np.zeros((3, 4, 4, 3), np.uint8))
        f.create_dataset("labels", data=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        open_path(str(tmp_path / "short.h5"))
    with h5py.File(tmp_path / "floats.h5", "w") as f:
        f.create_dataset("images", data=np.zeros((3, 4, 4, 3), np.float32))
        f.create_dataset("labels", data=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="neither"):
        open_path(str(tmp_path / "floats.h5"))


def test_hdf5_grey_raw_and_custom_dataset_names(tmp_path):
    grey = (np.arange(2 * 6 * 7) % 251).astype(np.uint8).reshape(2, 6, 7)
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f.create_dataset("x", data=grey)
        f.create_dataset("targets", data=np.array([1, 0], np.int32))
    src = open_path(str(tmp_path / "g.h5"))
    try:
        assert src.images_key == "x" and src.labels.tolist() == [1, 0]
        assert np.array_equal(decode(src.read(1))[:, :, 0], grey[1])
    finally:
        src.close()


def test_hdf5_chunk_cache_reaches_the_worker_and_no_handle_stays_open(datasets, monkeypatch):
    monkeypatch.setenv("LOADER_HDF5_RDCC_NSLOTS", "1009")
    src = HDF5Source(datasets["paths"]["hdf5"], rdcc_nbytes=8 << 20, rdcc_w0=0.5)
    assert src._file is None  # the service process holds no HDF5 handle a fork could inherit
    spec = src.spec()
    assert dict(spec.options)["rdcc_nbytes"] == 8 << 20 and dict(spec.options)["rdcc_nslots"] == 1009
    worker_side = open_source(spec)
    try:
        assert worker_side.read(2) == src.read(2)
        _, nslots, nbytes, w0 = worker_side._file.id.get_access_plist().get_cache()
        assert (nslots, nbytes, w0) == (1009, 8 << 20, 0.5)
        assert worker_side._labels is None  # a worker never loads the labels
        with h5py.File(datasets["paths"]["hdf5"], "r") as f:
            assert f["images"].chunks == (8,)
    finally:
        worker_side.close()
        src.close()
    with pytest.raises(ValueError, match="rdcc_w0 must be < 1"):  # unbounded in HDF5 2.0 (see hdf5.py)
        HDF5Source(datasets["paths"]["hdf5"], rdcc_w0=1.0)
    monkeypatch.setenv("LOADER_HDF5_RDCC_NBYTES", "lots")
    with pytest.raises(ValueError, match="LOADER_HDF5_RDCC_NBYTES"):
        HDF5Source(datasets["paths"]["hdf5"])


def test_hdf5_writer_with_equal_and_unequal_sample_sizes(tmp_path):
    from loader_service.sources.hdf5 import write_hdf5

    for sizes in ([10] * 7, [10, 11] * 3 + [12]):  # h5py stacks equal-length blocks unless told not to
        samples = [(f"s{i}", bytes([i]) * z, i % 2) for i, z in enumerate(sizes)]
        write_hdf5(str(tmp_path / "w.h5"), iter(samples), len(samples), chunk=3)
        src = HDF5Source(str(tmp_path / "w.h5"))
        assert [src.read(i) for i in range(len(src))] == [b for _, b, _ in samples]
        assert src.labels.tolist() == [lab for _, _, lab in samples]
        src.close()


@pytest.mark.parametrize("fmt", ["webdataset", "hdf5"])
def test_forked_workers_open_their_own_handles(make_service, datasets, fmt):
    svc = make_service(data=(datasets["paths"][fmt],), demo=False, workers=2, start_method="fork")
    (source,) = svc.sources.values()
    if fmt == "hdf5":
        assert source._file is None  # nothing for the fork to inherit
    with RemoteLoader(svc.endpoint, **KW) as ld:
        assert sorted(indices_of(collect(ld))) == list(range(N))


# ---------------------------------------------------------------------------- image formats
def test_an_imagefolder_in_every_torchvision_format_is_served_exactly_once(make_service, tmp_path):
    """ImageFolder reads what torchvision's does (.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff
    .webp): every such file is a sample, decoded; others (.gif, .txt) are not samples."""
    from PIL import Image

    rng = np.random.default_rng(8)
    root = tmp_path / "mixed"
    kinds = [("jpg", "JPEG", "RGB"), ("jpeg", "JPEG", "L"), ("png", "PNG", "RGBA"), ("ppm", "PPM", "RGB"),
             ("pgm", "PPM", "L"), ("bmp", "BMP", "RGB"), ("tif", "TIFF", "RGB"), ("tiff", "TIFF", "L"),
             ("webp", "WEBP", "RGB")]
    n = 0
    for c, cls in enumerate(("a", "b")):
        (root / cls).mkdir(parents=True)
        for i, (ext, fmt, mode) in enumerate(kinds):
            img = Image.fromarray(rng.integers(0, 256, (20 + i, 30 + c, 3), dtype=np.uint8)).convert(mode)
            img.save(root / cls / f"{i:02d}.{ext}", fmt)
            n += 1
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / cls / "not-a-sample.gif", "GIF")
        (root / cls / "notes.txt").write_text("not a sample")
    src = ImageFolderSource.scan(str(root))
    try:
        assert len(src) == n
        assert {os.path.splitext(src.describe(i))[1] for i in range(n)} == {"." + k for k, _, _ in kinds}
    finally:
        src.close()
    svc = make_service(data=(str(root),), demo=False, workers=1, on_error="raise")
    with RemoteLoader(svc.endpoint, batch_size=4, image_size=16, dataset="mixed", shuffle=False) as ld:
        batches = collect(ld)
    assert sorted(indices_of(batches)) == list(range(n))
    assert not [s for b in batches for s in b["skipped"]]


def test_webdataset_members_in_the_other_formats_are_images(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setenv("LOADER_CACHE_DIR", str(tmp_path / "cache"))
    rgb = np.random.default_rng(9).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    members = []
    for i, fmt in enumerate(("WEBP", "BMP", "TIFF", "PPM")):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
        ext = {"WEBP": "webp", "BMP": "bmp", "TIFF": "tif", "PPM": "ppm"}[fmt]
        members += [(f"s/{i}.{ext}", buf.getvalue()), (f"s/{i}.cls", b"2")]
    members.append(("s/9.gif", b"GIF89a"))  # no image member this loader reads: a clear error, not a skip
    _tar(tmp_path / "x.tar", members[:-1])
    src = open_path(str(tmp_path / "x.tar"))
    try:
        assert len(src) == 4 and src.labels.tolist() == [2, 2, 2, 2]
        assert all(np.array_equal(decode(src.read(i)), rgb) for i in range(4))
    finally:
        src.close()
    _tar(tmp_path / "y.tar", members)
    with pytest.raises(ShardError, match=r"sample 's/9' has no image member \(\.jpg, \.jpeg, \.png, \.ppm"):
        open_path(str(tmp_path / "y.tar"))


KIND_IN_A_FRESH_PROCESS = """
import pickle, sys
from loader_service.sources.base import SOURCE_KINDS, import_kind_modules, open_source
spec, modules = pickle.loads(sys.stdin.buffer.read())
print("known before:", spec.kind in SOURCE_KINDS)
import_kind_modules(modules)
src = open_source(spec)
print("opened:", type(src).__name__, len(src), src.read(3) == src.inner.read(3))
"""


def test_a_source_kind_registered_outside_the_package_reaches_a_fresh_process(demo_source):
    """What a spawned worker does: a kind the service registered from its own module (here the
    fault double of testkit) is unknown to a fresh interpreter until it imports the
    modules ``kind_modules`` names; then the spec opens."""
    import subprocess
    import sys

    from loader_service.sources.base import kind_modules
    from testkit.fault_source import FaultSource
    from testkit.service import ROOT

    spec = FaultSource(demo_source, crash=[7]).spec()
    modules = kind_modules([spec, demo_source.spec()])
    assert "testkit.fault_source" in modules
    out = subprocess.run([sys.executable, "-c", KIND_IN_A_FRESH_PROCESS], input=pickle.dumps((spec, modules)),
                         capture_output=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split("\n")[:2] == ["known before: False", f"opened: FaultSource {len(demo_source)} True"]

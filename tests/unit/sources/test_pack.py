"""``loader-service pack``: every format round-trips, --verify catches a bad output, and no
error leaves a half-written output behind."""

from __future__ import annotations

import os

import numpy as np
import pytest

from loader_service.sources import pack
from loader_service.cli.main import main as cli_main
from loader_service.sources import open_path
from loader_service.sources import webdataset as wds

from tests.conftest import write_imagefolder

h5py = pytest.importorskip("h5py")

N = 3 * 5
DST = {"webdataset": "out", "hdf5": "out.h5", "packed": "out"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_imagefolder(str(tmp_path_factory.mktemp("src")), classes=3, per_class=5)


def _run(*argv) -> int:
    return cli_main(["pack", *map(str, argv)])


def _leftovers(parent) -> list:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


@pytest.mark.parametrize("fmt", ["webdataset", "hdf5", "packed"])
def test_pack_and_verify_round_trip(folder, tmp_path, capsys, fmt, monkeypatch):
    dst = tmp_path / DST[fmt]
    assert _run(folder, dst, "--format", fmt, "--verify", "--shard-size", 4, "--chunk", 4, "--quiet") == 0
    out = capsys.readouterr().out
    assert f"packed {N} samples (3 classes" in out and f"as {fmt} in" in out
    assert f"output:  {dst}" in out and f"verify:  ok, {N} samples byte-identical" in out
    if fmt == "webdataset":
        assert "4 shards: shard-000000.tar .. shard-000003.tar" in out
    assert _leftovers(tmp_path) == []
    ref, got = open_path(folder), open_path(str(dst))
    try:
        assert len(got) == N and np.array_equal(np.asarray(got.labels), ref.labels)
        assert all(got.read(i) == ref.read(i) for i in range(N))
        assert got.classes == ref.classes == ["cls0", "cls1", "cls2"]
    finally:
        got.close()
        ref.close()


def test_packed_shards_carry_their_index_so_the_service_never_scans(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("LOADER_CACHE_DIR", str(tmp_path / "cache"))
    assert _run(folder, tmp_path / "out", "--format", "webdataset", "--shard-size", 6, "--quiet") == 0
    monkeypatch.setattr(wds, "_scan_shard", lambda p: pytest.fail(f"scanned {p}"))
    src = open_path(str(tmp_path / "out"))
    try:
        assert src.index_origin == "loaded" and src.index_dir.startswith(str(tmp_path / "out" / ".wds-index"))
        assert len(src) == N and src.keys[0] == "cls0/img000"
    finally:
        src.close()
    assert not os.path.exists(tmp_path / "cache")


def test_hdf5_layout_and_chunking(folder, tmp_path):
    assert _run(folder, tmp_path / "x.hdf5", "--chunk", 4, "--quiet") == 0  # format from the extension
    with h5py.File(tmp_path / "x.hdf5", "r") as f:
        assert f["images"].chunks == (4,) and h5py.check_vlen_dtype(f["images"].dtype) == np.uint8
        assert f["labels"][:].tolist() == [0] * 5 + [1] * 5 + [2] * 5
        assert f["names"][0].decode() == "cls0/img000.png"


@pytest.mark.parametrize("fmt", ["webdataset", "hdf5", "packed"])
def test_verify_reports_the_first_mismatch_and_writes_nothing(folder, tmp_path, capsys, monkeypatch, fmt):
    real = pack._samples

    def corrupt(src):
        for i, (name, blob, label) in enumerate(real(src)):
            yield name, (blob[:-1] + bytes([blob[-1] ^ 1]) if i in (6, 9) else blob), label

    monkeypatch.setattr(pack, "_samples", corrupt)
    assert _run(folder, tmp_path / DST[fmt], "--format", fmt, "--verify", "--quiet") == 1
    err = capsys.readouterr().err
    assert "verify FAILED" in err and "sample 6 (" in err and "bytes differ" in err and "sample 9" not in err
    assert not os.path.exists(tmp_path / DST[fmt]) and _leftovers(tmp_path) == []


def test_verify_checks_labels_too(folder, tmp_path, capsys, monkeypatch):
    real = pack._samples
    monkeypatch.setattr(pack, "_samples", lambda src: ((n, b, 2 if n.endswith("img003.png") else lab)
                                                       for n, b, lab in real(src)))
    assert _run(folder, tmp_path / "o", "--format", "packed", "--verify", "--quiet") == 1
    assert "label 2 in the output, 0 in the source" in capsys.readouterr().err


def test_verify_of_a_damaged_output(folder, tmp_path):
    assert _run(folder, tmp_path / "p", "--format", "packed", "--quiet") == 0
    with open(tmp_path / "p" / "data.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    src = open_path(folder)
    try:
        problem = pack.verify(src, str(tmp_path / "p"))
    finally:
        src.close()
    assert problem.startswith("sample 0 (") and "first difference at byte 100" in problem


@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt()])
@pytest.mark.parametrize("fmt", ["webdataset", "hdf5", "packed"])
def test_an_error_mid_pack_leaves_nothing(folder, tmp_path, capsys, monkeypatch, fmt, exc):
    real = pack._samples

    def failing(src):
        for i, sample in enumerate(real(src)):
            if i == 7:
                raise exc
            yield sample

    monkeypatch.setattr(pack, "_samples", failing)
    if isinstance(exc, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            _run(folder, tmp_path / DST[fmt], "--format", fmt, "--quiet")
    else:
        assert _run(folder, tmp_path / DST[fmt], "--format", fmt, "--quiet") == 2
        assert "disk full" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_existing_output_and_bad_arguments(folder, tmp_path, capsys):
    dst = tmp_path / "o.h5"
    assert _run(folder, dst, "--quiet") == 0
    before = dst.read_bytes()
    assert _run(folder, dst, "--quiet") == 2
    assert "exists; give --overwrite" in capsys.readouterr().err
    assert _run(folder, dst, "--quiet", "--overwrite", "--chunk", 2) == 0
    assert dst.read_bytes() != before and os.listdir(tmp_path) == ["o.h5"]
    assert _run(tmp_path / "missing", tmp_path / "x", "--format", "packed") == 2
    assert "does not exist" in capsys.readouterr().err
    assert _run(folder, tmp_path / "x") == 2
    assert "give --format" in capsys.readouterr().err
    assert _run(folder, tmp_path / "x", "--format", "webdataset", "--shard-size", 0) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(empty, tmp_path / "y", "--format", "packed") == 2
    assert "no images found" in capsys.readouterr().err


def _open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def test_a_packed_source_s_close_lets_go_of_its_files_at_once(tmp_path):
    """Its index and data are mappings, each with a descriptor numpy keeps: closed, not at the
    garbage collector's leisure (a test making a source per example held 1,024 until then)."""
    import gc

    from loader_service.sources.packed import PackedSource, write_packed

    write_packed(str(tmp_path / "p"), [(f"s{i}", bytes([i]) * 10, i % 2) for i in range(6)], ["a", "b"])
    gc.disable()  # what the test measures must not depend on a collection
    try:
        before = _open_fds()
        src = PackedSource(str(tmp_path / "p"))
        assert len(_open_fds() - before) == 5 and src.read(3) == bytes([3]) * 10
        keep = src  # the service keeps its sources in cycles with the rest: close must not need them gone
        src.close()
        assert _open_fds() - before == set() and len(keep) == 0
        src.close()  # idempotent
    finally:
        gc.enable()

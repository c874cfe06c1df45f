"""A dataset's identity: the fingerprint of its index (names, sizes, labels), the same for two
scans and two copies, different after any file is added, removed, resized or relabelled; and a
file changed after the scan is refused at read, never served with other bytes."""

import os
import shutil
import time

import pytest

from loader_service.cli.main import main as cli_main
from loader_service.sources import open_path, open_source
from loader_service.sources.imagefolder import ImageFolderSource
from tests.conftest import write_imagefolder


def _fp(path: str) -> str:
    src = open_path(path)
    try:
        return src.fingerprint()
    finally:
        src.close()


@pytest.fixture
def folder(tmp_path):
    return write_imagefolder(str(tmp_path / "folder"), classes=3, per_class=4)


def test_two_scans_and_a_copy_with_other_timestamps_have_one_fingerprint(folder, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(folder, copy, copy_function=shutil.copyfile)  # new mtimes, as a copy without -t
    assert _fp(folder) == _fp(folder) == _fp(copy)


@pytest.mark.parametrize("change", ["add", "remove", "resize", "relabel", "new class"])
def test_any_change_to_the_index_changes_the_fingerprint(folder, change):
    before = _fp(folder)
    first = os.path.join(folder, "cls0", sorted(os.listdir(os.path.join(folder, "cls0")))[0])
    if change == "add":
        shutil.copyfile(first, os.path.join(folder, "cls1", "zz-added.png"))
    elif change == "remove":
        os.unlink(first)
    elif change == "resize":
        with open(first, "ab") as f:
            f.write(b"\0")
    elif change == "relabel":
        os.rename(first, os.path.join(folder, "cls1", os.path.basename(first)))
    else:
        os.mkdir(os.path.join(folder, "cls00"))  # sorts between cls0 and cls1: later labels shift
        shutil.copyfile(first, os.path.join(folder, "cls00", "x.png"))
    assert _fp(folder) != before


@pytest.mark.parametrize("fmt", ["packed", "webdataset", "hdf5"])
def test_every_format_has_a_stable_fingerprint_that_follows_its_content(folder, tmp_path, fmt):
    out = str(tmp_path / fmt / ("data.h5" if fmt == "hdf5" else ""))
    assert cli_main(["pack", folder, out, "--quiet", "--format", fmt]) == 0
    first = _fp(out)  # a webdataset folder of shards, a packed folder, an HDF5 file
    assert first == _fp(out) and len(first) == 24
    other = str(tmp_path / "other")
    shutil.copytree(folder, other)
    os.unlink(os.path.join(other, "cls2", sorted(os.listdir(os.path.join(other, "cls2")))[0]))
    out2 = str(tmp_path / (fmt + "2") / ("data.h5" if fmt == "hdf5" else ""))
    assert cli_main(["pack", other, out2, "--quiet", "--format", fmt]) == 0
    assert _fp(out2) != first


def test_a_file_changed_after_the_scan_is_refused_at_read_naming_it(folder):
    src = ImageFolderSource.scan(folder)
    worker = open_source(src.spec())  # as a decode worker opens it
    try:
        path = src.describe(2)
        assert len(worker.read(2)) == os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(b"\0")
        with pytest.raises(ValueError, match=r"changed since the service scanned the dataset \(\d+ bytes then, "):
            worker.read(2)
        os.utime(src.describe(3), ns=(time.time_ns(), time.time_ns() + 10**9))
        with pytest.raises(ValueError, match="changed since the service scanned the dataset .modified"):
            worker.read(3)
        assert worker.read(4)  # the others are served
    finally:
        worker.close()
        src.close()


# ------------------------------------------------------------------ the watch: changes since the scan


@pytest.mark.parametrize("change, want", [
    ("none", None),
    ("touch", None),  # new mtimes, the same images: nothing to say
    ("add", (1, 0, 0, ("+ cls1/added.png",))),
    ("remove", (0, 1, 0, ("- cls2/",))),
    ("new class", (1, 0, 8, ("+ cls00/x.png",))),  # cls1 and cls2 (8 files) move up one label
    ("other file", None),  # not an image: not a sample
])
def test_changes_on_disk_says_what_was_added_removed_and_relabelled(folder, change, want):
    src = ImageFolderSource.scan(folder)
    try:
        first = os.path.join(folder, "cls0", sorted(os.listdir(os.path.join(folder, "cls0")))[0])
        if change == "touch":
            os.utime(first)
        elif change == "add":
            shutil.copyfile(first, os.path.join(folder, "cls1", "added.png"))
        elif change == "remove":
            gone = sorted(os.listdir(os.path.join(folder, "cls2")))[0]
            os.unlink(os.path.join(folder, "cls2", gone))
            want = (0, 1, 0, (f"- cls2/{gone}",))
        elif change == "new class":
            os.mkdir(os.path.join(folder, "cls00"))
            shutil.copyfile(first, os.path.join(folder, "cls00", "x.png"))
        elif change == "other file":
            open(os.path.join(folder, "cls1", "notes.txt"), "w").close()
        got = src.changes_on_disk()
        assert (None if got is None else (got.added, got.removed, got.relabelled, got.examples)) == want
        assert src.changes_on_disk() == got  # asked again: the same answer
    finally:
        src.close()


def test_a_change_is_seen_also_after_a_look_that_found_none(folder):
    src = ImageFolderSource.scan(folder)
    try:
        assert src.changes_on_disk() is None
        first = os.path.join(folder, "cls0", sorted(os.listdir(os.path.join(folder, "cls0")))[0])
        os.unlink(first)
        got = src.changes_on_disk()
        assert got is not None and got.removed == 1 and got.describe() == f"1 removed (e.g. - cls0/{os.path.basename(first)})"
        shutil.copyfile(os.path.join(folder, "cls1", sorted(os.listdir(os.path.join(folder, "cls1")))[0]), first)
        assert src.changes_on_disk() is None  # put back: the images the index holds again
    finally:
        src.close()


def test_a_workers_copy_watches_nothing(folder):
    src = ImageFolderSource.scan(folder)
    try:
        copy = open_source(src.spec())
        shutil.copyfile(os.path.join(folder, "cls0", sorted(os.listdir(os.path.join(folder, "cls0")))[0]),
                        os.path.join(folder, "cls0", "added.png"))
        assert copy.changes_on_disk() is None and src.changes_on_disk().added == 1
        copy.close()
    finally:
        src.close()

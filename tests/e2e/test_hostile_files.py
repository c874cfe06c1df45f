"""Files that are not files: FIFOs, device symlinks, oversized files and directory symlink
loops cost bounded time and memory, and each refusal names the file."""

import os

import psutil
import pytest

from client import LoaderError, RemoteLoader
from loader_service.sources.detect import open_path
from loader_service.sources.files import read_regular

from tests.conftest import write_imagefolder
from testkit.helpers import collect, indices_of, status

CAP = 1 << 20  # max_sample_bytes in these tests


@pytest.fixture
def hostile_folder(tmp_path):
    """12 real images plus a FIFO, a symlink to /dev/zero, a file over the cap, and two
    directory symlink loops. Returns (root, {relative path of each hostile file: reason fragment})."""
    root = write_imagefolder(str(tmp_path / "hostile"), classes=2, per_class=6, png_every=4)
    os.mkfifo(os.path.join(root, "cls0", "fifo.jpg"))
    os.symlink("/dev/zero", os.path.join(root, "cls0", "zero.jpg"))
    with open(os.path.join(root, "cls1", "big.jpg"), "wb") as f:
        f.truncate(CAP + 1)  # sparse: costs no disk
    os.symlink(".", os.path.join(root, "cls1", "self"))  # cls1/self/self/... without end
    os.makedirs(os.path.join(root, "cls1", "sub"))
    os.symlink("../..", os.path.join(root, "cls1", "sub", "up"))  # back to the root: every class again
    hostile = {"cls0/fifo.jpg": "is a FIFO, not a regular file", "cls0/zero.jpg": "is a character device",
               "cls1/big.jpg": f"over the sample cap of {CAP} bytes"}
    return root, hostile


def test_scan_enters_each_real_folder_once_and_reports_the_loops(hostile_folder, caplog):
    root, hostile = hostile_folder
    caplog.set_level("WARNING", logger="loader_service.sources")
    src = open_path(root)
    try:
        names = [src.paths[i] for i in range(len(src))]
        assert len(names) == len(set(names)) == 12 + len(hostile)  # each file once, hostile ones included
        assert sorted(p for p, _ in src.scan_skipped) == [os.path.join(root, "cls1", "self"),
                                                           os.path.join(root, "cls1", "sub", "up")]
        assert "2 folders not entered" in caplog.text and os.path.join(root, "cls1", "self") in caplog.text
    finally:
        src.close()


def test_read_regular_refuses_what_is_not_a_regular_file(hostile_folder, tmp_path):
    root, hostile = hostile_folder
    for rel, fragment in hostile.items():
        with pytest.raises(ValueError, match=fragment) as info:
            read_regular(os.path.join(root, rel), CAP)
        assert os.path.join(root, rel) in str(info.value)
    with pytest.raises(ValueError, match="is a directory"):
        read_regular(os.path.join(root, "cls0"), CAP)
    exact = tmp_path / "exact"
    exact.write_bytes(b"x" * CAP)
    assert read_regular(str(exact), CAP) == b"x" * CAP  # the cap itself is allowed


def test_skip_policy_delivers_the_real_images_once_and_names_each_hostile_file(make_service, hostile_folder):
    root, hostile = hostile_folder
    svc = make_service(demo=False, data=(root,), on_error="skip", max_sample_bytes=CAP)
    src = svc.sources["hostile"]
    where = {src.paths[i]: i for i in range(len(src))}
    bad = {where[rel]: (rel, why) for rel, why in hostile.items()}
    for epoch in range(2):  # the FIFO used to hang a worker for good; twice shows it does not
        with RemoteLoader(svc.endpoint, batch_size=5, image_size=24, dataset="hostile", epoch_lookahead=False,
                          seed=epoch) as ld:
            batches = collect(ld)
        assert sorted(indices_of(batches)) == sorted(set(range(len(src))) - set(bad))
        skipped = {i: why for b in batches for i, why in b["skipped"]}
        assert sorted(skipped) == sorted(bad)
        for i, (rel, fragment) in bad.items():
            assert os.path.join(root, rel) in skipped[i] and fragment in skipped[i]
    for w in status(svc)["workers"]["list"]:  # nobody read /dev/zero into memory
        assert psutil.Process(w["pid"]).memory_info().rss < 512 << 20


@pytest.mark.parametrize("rel", ["cls0/fifo.jpg", "cls0/zero.jpg", "cls1/big.jpg"])
def test_raise_policy_fails_the_stream_naming_the_file(make_service, tmp_path, rel):
    root = write_imagefolder(str(tmp_path / "one"), classes=2, per_class=2, png_every=0)
    path = os.path.join(root, rel)
    if rel.endswith("fifo.jpg"):
        os.mkfifo(path)
    elif rel.endswith("zero.jpg"):
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.truncate(CAP + 1)
    svc = make_service(demo=False, data=(root,), on_error="raise", max_sample_bytes=CAP)
    with RemoteLoader(svc.endpoint, batch_size=5, image_size=24, dataset="one") as ld:
        with pytest.raises(LoaderError, match="sample_failed") as info:
            collect(ld)
    assert path in info.value.message

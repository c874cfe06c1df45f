"""Hostile images against a live service (issue 18, items 1 and 3): decode bombs are refused from
their header with the file named, truncated JPEGs are errors under both on_error policies, and a
worker's memory stays bounded."""

from testkit.paths import TEST_DATA
import os
import struct
import zlib

import psutil
import pytest

from client import LoaderError, RemoteLoader

from tests.conftest import write_imagefolder
from testkit.helpers import collect, indices_of, status

PHOTO = os.path.join(TEST_DATA, "grace_hopper.jpg")


def _bomb_jpeg(w: int, h: int) -> bytes:
    photo = open(PHOTO, "rb").read()
    i = photo.index(b"\xff\xc0")  # SOF0: rewrite the frame size only
    return photo[:i + 5] + h.to_bytes(2, "big") + w.to_bytes(2, "big") + photo[i + 9:]


def _bomb_png(w: int, h: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 100000)
    chunks = b""
    for kind, body in ((b"IHDR", ihdr), (b"IDAT", idat), (b"IEND", b"")):
        chunks += struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunks


@pytest.fixture
def hostile_folder(tmp_path):
    root = write_imagefolder(str(tmp_path / "hostile"), classes=2, per_class=8, png_every=4)
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs)
    photo = open(PHOTO, "rb").read()
    bad = {}
    for i, data, why in ((2, _bomb_jpeg(65000, 65000), "65000x65000 = 4,225,000,000 pixels, above the limit"),
                         (7, _bomb_png(30000, 30000), "30000x30000 = 900,000,000 pixels, above the limit"),
                         (9, photo[: len(photo) * 2 // 3], "corrupt or truncated JPEG"),
                         (12, photo[: len(photo) - 200], "corrupt or truncated JPEG")):
        with open(files[i], "wb") as f:
            f.write(data)
        bad[i] = why
    return root, files, bad


def _worker_rss_mib(svc) -> float:
    pids = [w["pid"] for w in status(svc)["workers"]["list"] if w["pid"]]
    return max(psutil.Process(p).memory_info().rss for p in pids) / 2**20


def test_hostile_images_are_skipped_with_the_file_named_and_memory_bounded(make_service, hostile_folder):
    root, files, bad = hostile_folder
    svc = make_service(demo=False, data=(root,), on_error="skip")
    for _ in range(2):  # every epoch, the same verdicts
        with RemoteLoader(svc.endpoint, batch_size=5, image_size=24, dataset="hostile", epoch_lookahead=False) as ld:
            batches = collect(ld)
        skipped = {i: why for b in batches for i, why in b["skipped"]}
        assert sorted(skipped) == sorted(bad)
        for i, fragment in bad.items():
            assert files[i] in skipped[i] and fragment in skipped[i], skipped[i]
        assert sorted(indices_of(batches)) == sorted(set(range(16)) - set(bad))
    # a full decode of the 65000x65000 bomb would need 11.8 GiB; the workers stay near their start size
    assert _worker_rss_mib(svc) < 400
    assert status(svc)["decode_path"]


@pytest.mark.parametrize("which", [2, 7, 9])
def test_hostile_image_under_raise_is_an_error_naming_the_file(make_service, hostile_folder, which):
    root, files, bad = hostile_folder
    keep = {which}
    for i in set(bad) - keep:  # only one hostile file in the dataset
        os.unlink(files[i])
    svc = make_service(demo=False, data=(root,), on_error="raise")
    with RemoteLoader(svc.endpoint, batch_size=20, image_size=24, dataset="hostile", shuffle=False) as ld:
        with pytest.raises(LoaderError) as info:
            collect(ld)
    e = info.value
    assert e.code == "sample_failed" and files[which] in e.message and bad[which] in e.message, e.message

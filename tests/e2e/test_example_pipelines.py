"""The example pipelines (examples/pipelines/), each served by a service and consumed by a loader."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

from client import LoaderError, RemoteLoader

from tests.conftest import DEMO_SIZE

EXAMPLES = ("multicrop=examples.pipelines.multicrop:multicrop", "jitter=examples.pipelines.colorjitter:colorjitter",
            "seg=examples.pipelines.segmentation:segmentation")
PALETTE = np.array([[200, 30, 30], [30, 200, 30], [30, 30, 200], [220, 220, 40]], np.uint8)


def epoch(endpoint: str, **kw) -> list:
    with RemoteLoader(endpoint, epoch_lookahead=False, **kw) as ld:
        return [(b.indices, {k: v.numpy().copy() for k, v in b.outputs.items()}) for b in ld]


def test_multicrop_two_global_six_local_views(make_service):
    svc = make_service(pipeline=EXAMPLES)
    args = {"global_size": 64, "local_size": 32}
    first = epoch(svc.endpoint, batch_size=24, seed=1, pipeline="multicrop", pipeline_args=args)
    assert sorted(i for idx, _ in first for i in idx) == list(range(DEMO_SIZE))
    for idx, out in first:
        assert out["global"].shape == (len(idx), 2, 64, 64, 3) and out["local"].shape == (len(idx), 6, 32, 32, 3)
        assert not np.array_equal(out["global"][:, 0], out["global"][:, 1])  # two different views
    again = epoch(svc.endpoint, batch_size=24, seed=1, pipeline="multicrop", pipeline_args=args)
    assert all(a[0] == b[0] and all(np.array_equal(a[1][k], b[1][k]) for k in a[1]) for a, b in zip(first, again))
    with RemoteLoader(svc.endpoint, batch_size=4, pipeline="multicrop", epoch_lookahead=False) as ld:
        batch = next(iter(ld))  # the defaults: 2 x 224 + 6 x 96
        assert batch["global"].shape == (4, 2, 224, 224, 3) and batch["local"].shape == (4, 6, 96, 96, 3)


def test_colorjitter_classification_unpacks_like_a_dataloader(make_service):
    svc = make_service(pipeline=EXAMPLES)
    with RemoteLoader(svc.endpoint, batch_size=32, pipeline="jitter", pipeline_args={"size": 48},
                      epoch_lookahead=False) as ld:
        seen = []
        for images, labels in ld:
            assert images.shape[1:] == (48, 48, 3) and len(labels) == len(images)
            seen += labels.tolist()
    plain = epoch(svc.endpoint, batch_size=32, image_size=48)
    jittered = epoch(svc.endpoint, batch_size=32, pipeline="jitter", pipeline_args={"size": 48})
    assert len(seen) == DEMO_SIZE
    assert not np.array_equal(plain[0][1]["image"], jittered[0][1]["image"])  # the jitter did something
    with pytest.raises(LoaderError, match="argument 'hue' must be a number in \\[0.0, 0.5\\], got 0.9"):
        epoch(svc.endpoint, batch_size=32, pipeline="jitter", pipeline_args={"hue": 0.9})


@pytest.fixture(scope="module")
def seg_folder(tmp_path_factory):
    """images/<split>/*.png with masks/<split>/*.png: four blocks of classes, each image block in
    that class's colour, so image and mask agree pixel for pixel wherever geometry is shared."""
    root = tmp_path_factory.mktemp("seg")
    for k in range(12):
        h, w = 90 + 7 * k, 120 + 5 * k
        mask = np.zeros((h, w), np.uint8)
        cy, cx = h // 3 + k, w // 2 - k
        mask[:cy, cx:], mask[cy:, :cx], mask[cy:, cx:] = 1, 2, 3
        for sub in ("images", "masks"):
            os.makedirs(root / sub / "train", exist_ok=True)
        cv2.imwrite(str(root / "images" / "train" / f"{k:03d}.png"), PALETTE[mask][:, :, ::-1])
        cv2.imwrite(str(root / "masks" / "train" / f"{k:03d}.png"), mask)
    return root


def test_segmentation_image_and_mask_share_the_geometric_transform(make_service, seg_folder):
    svc = make_service(demo=False, data=(str(seg_folder / "images"),), pipeline=EXAMPLES)
    batches = epoch(svc.endpoint, batch_size=5, pipeline="seg", pipeline_args={"size": 40, "scale": [0.3, 1.0]})
    assert sorted(i for idx, _ in batches for i in idx) == list(range(12))
    for _, out in batches:
        images, masks = out["image"], out["mask"]
        assert images.shape[1:] == (40, 40, 3) and masks.shape[1:] == (40, 40) and masks.max() <= 3
        # away from class boundaries (bilinear blends there) each pixel has its class's colour
        agree = np.abs(images.astype(int) - PALETTE[masks].astype(int)).max(-1) <= 8
        assert agree.mean() > 0.85, agree.mean()


def test_segmentation_missing_mask_names_the_file(make_service, seg_folder, tmp_path):
    images = tmp_path / "images" / "a"
    os.makedirs(images)
    cv2.imwrite(str(images / "x.png"), np.zeros((20, 20, 3), np.uint8))
    svc = make_service(demo=False, data=(str(tmp_path / "images"),), pipeline=EXAMPLES)
    with pytest.raises(LoaderError, match=r"in pipeline 'seg': FileNotFoundError: .*masks/a/x.png"):
        epoch(svc.endpoint, batch_size=1, pipeline="seg", pipeline_args={"size": 16})

"""Segmentation: the image and its mask under the same RandomResizedCrop and flip.

Dataset layout: an ImageFolder whose folder is named ``images``, and beside it a folder
``masks`` with one PNG per image at the same relative path (extension ``.png``): one channel,
one class id per pixel, the image's width and height::

    data/images/<class or split>/0001.jpg     data/masks/<class or split>/0001.png

    loader-service serve --data data/images --pipeline seg=examples.pipelines.segmentation:segmentation
    loader = RemoteLoader(url, batch_size=16, pipeline="seg", pipeline_args={"size": 512})
    for batch in loader:
        images, masks = batch["image"], batch["mask"]  # (16, 512, 512, 3), (16, 512, 512)

The image is resized bilinearly (area filter when shrinking a lot), the mask by nearest
neighbour, so class ids are never blended.
"""

from __future__ import annotations

import os

import cv2
import numpy as np

from loader_service.decode.pipelines import Args, Pipeline
from loader_service.decode.transforms import decode, random_resized_crop_params, resize_into

MAX_MASK_BYTES = 64 << 20


def mask_path(image_path: str) -> str:
    """``.../images/rel/name.ext`` -> ``.../masks/rel/name.png``."""
    head, sep, rel = image_path.rpartition(os.sep + "images" + os.sep)
    if not sep:
        raise ValueError(f"{image_path}: not under a folder named 'images' (see the mask layout)")
    return os.path.join(head, "masks", os.path.splitext(rel)[0] + ".png")


def read_mask(path: str, shape) -> np.ndarray:
    st = os.stat(path)  # a missing mask is an error naming it
    if not os.path.isfile(path) or st.st_size > MAX_MASK_BYTES:
        raise ValueError(f"{path}: not a regular file of at most {MAX_MASK_BYTES} bytes")
    mask = cv2.imdecode(np.fromfile(path, np.uint8), cv2.IMREAD_UNCHANGED)
    if mask is None or mask.ndim != 2 or mask.dtype != np.uint8:
        raise ValueError(f"{path}: not a one-channel 8-bit PNG")
    if mask.shape != tuple(shape):
        raise ValueError(f"{path}: mask is {mask.shape[1]}x{mask.shape[0]}, image is {shape[1]}x{shape[0]}")
    return mask


def segmentation(args: Args) -> Pipeline:
    size = args.int("size", 512, 8, 4096)
    scale = args.range("scale", (0.25, 1.0), 1e-3, 1.0)
    ratio = args.range("ratio", (3 / 4, 4 / 3), 1e-3, 1e3)
    flip = args.bool("flip", True)

    def process(item, out):
        img = decode(item.data, item.decode_options)
        mask = read_mask(mask_path(item.where), img.shape[:2])
        top, left, ch, cw = random_resized_crop_params(img.shape[0], img.shape[1], scale, ratio, item.rng)
        flipped = flip and item.rng.random() < 0.5
        resize_into(img[top: top + ch, left: left + cw], out["image"])
        cv2.resize(mask[top: top + ch, left: left + cw], (size, size), dst=out["mask"],
                   interpolation=cv2.INTER_NEAREST)
        if flipped:
            cv2.flip(out["image"], 1, dst=out["image"])
            cv2.flip(out["mask"], 1, dst=out["mask"])

    return Pipeline({"image": (size, size, 3), "mask": (size, size)}, process)

"""Classification with colour augmentation: RandomResizedCrop (fused decode: a JPEG decodes only
the crop) + flip + ColorJitter, optionally grayscale.

    loader-service serve --data /imagenet/train --pipeline jitter=examples.pipelines.colorjitter:colorjitter
    loader = RemoteLoader(url, batch_size=256, pipeline="jitter", pipeline_args={"brightness": 0.4})
    for images, labels in loader: ...
"""

from __future__ import annotations

from loader_service.decode import ops
from loader_service.decode.pipelines import Args, Pipeline


def colorjitter(args: Args) -> Pipeline:
    size = args.int("size", 224, 8, 4096)
    scale = args.range("scale", (0.08, 1.0), 1e-3, 1.0)
    b = args.float("brightness", 0.4, 0.0, 1.0)
    c = args.float("contrast", 0.4, 0.0, 1.0)
    s = args.float("saturation", 0.4, 0.0, 1.0)
    h = args.float("hue", 0.1, 0.0, 0.5)
    grey = args.float("grayscale", 0.0, 0.0, 1.0)

    def process(item, out):
        view = out["image"]
        ops.random_resized_crop(item.data, view, item.rng, scale, flip=True, options=item.decode_options)
        img = ops.color_jitter(view, item.rng, b, c, s, h)
        if grey and item.rng.random() < grey:
            img = ops.grayscale(img)
        view[...] = img

    return Pipeline({"image": (size, size, 3)}, process)

"""Multi-crop views for self-supervised training (DINO/SwAV style): two global crops and
several local crops of every image, each with its own colour augmentation.

    loader-service serve --data /imagenet/train --pipeline multicrop=examples.pipelines.multicrop:multicrop
    loader = RemoteLoader(url, batch_size=64, pipeline="multicrop")
    for batch in loader:
        student_in, teacher_in = batch["local"], batch["global"]  # (64, 6, 96, 96, 3), (64, 2, 224, 224, 3)
"""

from __future__ import annotations

from loader_service.decode import ops
from loader_service.decode.pipelines import Args, Pipeline
from loader_service.decode.transforms import decode


def multicrop(args: Args) -> Pipeline:
    g_size = args.int("global_size", 224, 16, 1024)
    l_size = args.int("local_size", 96, 16, 1024)
    n_global = args.int("global_crops", 2, 1, 8)
    n_local = args.int("local_crops", 6, 0, 32)
    g_scale = args.range("global_scale", (0.4, 1.0), 1e-3, 1.0)
    l_scale = args.range("local_scale", (0.05, 0.4), 1e-3, 1.0)
    jitter = args.float("jitter", 0.8, 0.0, 1.0)  # probability of colour jitter (0.4, 0.4, 0.2, 0.1)
    grey = args.float("grayscale", 0.2, 0.0, 1.0)

    def augment(view, rng, blur_p: float, solarize_p: float) -> None:
        img = view
        if rng.random() < jitter:
            img = ops.color_jitter(img, rng, 0.4, 0.4, 0.2, 0.1)
        if rng.random() < grey:
            img = ops.grayscale(img)
        if rng.random() < blur_p:
            img = ops.gaussian_blur(img, 9 if view.shape[0] >= 128 else 5, float(rng.uniform(0.1, 2.0)))
        if rng.random() < solarize_p:
            img = ops.solarize(img, 128)
        if img is not view:
            view[...] = img

    def process(item, out):
        img = decode(item.data, item.decode_options)  # once; every crop is cut from these pixels
        for k in range(n_global):
            view = out["global"][k]
            ops.random_resized_crop(img, view, item.rng, g_scale, flip=True)
            augment(view, item.rng, 1.0 if k == 0 else 0.1, 0.0 if k == 0 else 0.2)
        if n_local:
            for k in range(n_local):
                view = out["local"][k]
                ops.random_resized_crop(img, view, item.rng, l_scale, flip=True)
                augment(view, item.rng, 0.5, 0.0)

    outputs = {"global": (n_global, g_size, g_size, 3)}
    if n_local:
        outputs["local"] = (n_local, l_size, l_size, 3)
    return Pipeline(outputs, process)

"""Pipelines the tests register (MODULE:CALLABLE targets): small, exact, and some broken on purpose."""

from __future__ import annotations

import numpy as np

from loader_service.decode.pipelines import Args, Pipeline
from loader_service.decode.transforms import decode

RAISES_AT = 5  # the dataset index `raises` fails on


def two_views(args: Args) -> Pipeline:
    """``big``: a (2, s, s, 3) stack of a nearest-neighbour thumbnail and its flip; ``small``:
    (t, t) grey; ``stamp``: (4,) the sample index and label bytes and one random byte."""
    s = args.int("size", 16, 4, 256)
    t = args.int("small", 8, 2, 64)

    def process(item, out):
        img = decode(item.data)
        ys = np.arange(s) * img.shape[0] // s
        xs = np.arange(s) * img.shape[1] // s
        thumb = img[ys][:, xs]
        out["big"][0] = thumb
        out["big"][1] = thumb[:, ::-1]
        yt = np.arange(t) * img.shape[0] // t
        xt = np.arange(t) * img.shape[1] // t
        out["small"][:] = img[yt][:, xt].mean(axis=2).astype(np.uint8)
        out["stamp"][:] = [item.index % 256, item.index // 256, item.label, item.rng.integers(0, 256)]

    return Pipeline({"big": (2, s, s, 3), "small": (t, t), "stamp": (4,)}, process)


def returns_arrays(args: Args) -> Pipeline:
    """Returns a dict instead of writing in place; ``dtype``/``shape`` args make it wrong on purpose."""
    dtype = args.str("dtype", "uint8", ["uint8", "float32"])
    side = args.int("side", 4, 1, 64)

    def process(item, out):
        return {"x": np.full((side, 4), item.index % 256, dtype=dtype)}

    return Pipeline({"x": (4, 4)}, process)


def raises(args: Args) -> Pipeline:
    def process(item, out):
        if item.index == RAISES_AT:
            raise RuntimeError(f"boom on {item.index}")
        out["x"][:] = 1

    return Pipeline({"x": (2,)}, process)


def not_a_factory_result(args: Args):
    return 42
